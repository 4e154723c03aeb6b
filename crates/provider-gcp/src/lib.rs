//! The `gcp` provider of egress-operator: each proxy is a Compute Engine VM with an external IP, running Squid.
//!
//! Four API calls and no more: `instances.insert` (with a request ID, so a retry never makes a second VM),
//! `instances.get`, `instances.delete` and `instances.aggregatedList` (filtered by the GC labels). Insert and delete
//! return as soon as Compute Engine accepted the operation; the next `get` observes its progress, so a reconcile is
//! never blocked on a VM booting.
//!
//! - `provider_id` is `projects/<project>/zones/<zone>/instances/<name>`.
//! - The VM gets the machine type and image from the request or the config's defaults, the GC contract as labels
//!   (`egress-<tag>`), the cloud-init as the `user-data` metadata (a Squid installer when the Proxy has none),
//!   the config's network tag (for the user's firewall rule) and an ephemeral external IP (`ONE_TO_ONE_NAT`).
//! - State: PROVISIONING/STAGING → Provisioning; RUNNING with a NAT IP → Running (without one, Provisioning);
//!   STOPPING/STOPPED/SUSPENDING/SUSPENDED/TERMINATED → Terminated.
//! - Errors are classified on the HTTP status and the error reasons ([`classify`]).
//! - Logging: one debug line per call (operation, outcome, operation name, duration), request detail at trace,
//!   the raw status and reasons before classification. The user data is never logged, at any level: it may carry
//!   secrets. The SDK's own tracing is never turned on: it records whole requests and responses, metadata
//!   included.
//!
//! Credentials: Application Default Credentials, or the service-account key file named by `credentialsFile`. The
//! endpoint can be overridden (`endpoint`) for private endpoints and tests.

pub mod classify;
pub mod config;
pub mod wire_log;

pub use config::GcpConfig;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use egress_provider::config::ProviderConfig;
use egress_provider::destinations::DestinationPolicy;
use egress_provider::registry::{Built, ProviderType};
use egress_provider::{
    Checker, CreateRequest, ErrorClass, Instance, InstanceState, Provider, ProviderError, Tags, TargetVerdict,
};
use google_cloud_compute_v1::client::Instances;
use google_cloud_compute_v1::model::{
    self, AccessConfig, AttachedDisk, AttachedDiskInitializeParams, Metadata, NetworkInterface,
};
use google_cloud_gax::exponential_backoff::ExponentialBackoffBuilder;
use google_cloud_gax::options::RequestOptionsBuilder;
use google_cloud_gax::retry_policy::{Aip194Strict, RetryPolicyExt};
use sha2::{Digest, Sha256};
use tracing::{debug, trace};

pub use crate::classify::classify;

/// The metadata key cloud-init reads.
pub const USER_DATA_KEY: &str = "user-data";
/// Label keys carrying the GC contract are the tag keys with this prefix.
pub const LABEL_PREFIX: &str = "egress-";
/// Compute Engine's public endpoint.
pub const DEFAULT_ENDPOINT: &str = "https://compute.googleapis.com";
/// The boot disk size, in GiB.
const BOOT_DISK_GB: i64 = 10;
/// Attempts per call for errors the SDK's policy retries (UNAVAILABLE, 503, I/O), with a request ID on writes.
const ATTEMPTS: u32 = 3;
/// Instances asked for per aggregatedList page.
const PAGE_SIZE: u32 = 500;

/// A Compute Engine project as a provider.
pub struct GcpProvider {
    client: Instances,
    config: GcpConfig,
    destinations: DestinationPolicy,
}

impl std::fmt::Debug for GcpProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GcpProvider").field("project", &self.config.project).finish_non_exhaustive()
    }
}

/// Installs ring as the process's rustls provider unless one is installed: the SDK's HTTP client and its
/// credentials use the process default, and ring is the one provider this workspace builds.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl ProviderType for GcpProvider {
    type Settings = GcpConfig;

    /// As [`GcpProvider::new`]; a config entry of another type is a permanent error.
    async fn construct(config: ProviderConfig) -> Result<Built, ProviderError> {
        let Some(settings) = config.settings::<GcpConfig>().cloned() else {
            return Err(ProviderError::permanent(format!("provider {:?} is not of type gcp", config.name)));
        };
        let provider = Arc::new(GcpProvider::new(settings).await?.with_destinations(config.destinations));
        Ok(Built { provider: provider.clone(), checker: Some(provider) })
    }
}

impl GcpProvider {
    /// Builds the client: credentials from `config.credentials_file` or Application Default Credentials, and the
    /// endpoint from `config.endpoint` or Google's.
    ///
    /// # Errors
    /// A credentials file that cannot be read or is not a service-account key (Permanent), or no Application
    /// Default Credentials (Permanent: they will not appear by themselves).
    pub async fn new(config: GcpConfig) -> Result<Self, ProviderError> {
        install_crypto_provider();
        let credentials = match &config.credentials_file {
            Some(path) => {
                let text = tokio::fs::read(path).await.map_err(|error| {
                    ProviderError::permanent(format!("reading the credentials file {}", path.display()))
                        .with_source(error)
                })?;
                // The key's content never goes into an error message.
                let key: serde_json::Value = serde_json::from_slice(&text).map_err(|_| {
                    ProviderError::permanent(format!("the credentials file {} is not JSON", path.display()))
                })?;
                google_cloud_auth::credentials::service_account::Builder::new(key).build().map_err(|error| {
                    ProviderError::permanent(format!(
                        "the credentials file {} is not a service-account key",
                        path.display()
                    ))
                    .with_source(error)
                })?
            }
            None => google_cloud_auth::credentials::Builder::default().build().map_err(|error| {
                ProviderError::permanent(
                    "no Application Default Credentials (set gcp.credentialsFile, GOOGLE_APPLICATION_CREDENTIALS, \
                     or run on Google Cloud with a service account)",
                )
                .with_source(error)
            })?,
        };
        let backoff = ExponentialBackoffBuilder::new()
            .with_initial_delay(Duration::from_millis(200))
            .with_maximum_delay(Duration::from_secs(2))
            .build()
            .map_err(|error| ProviderError::permanent("the retry backoff").with_source(error))?;
        // The SDK's own tracing stays off unless `wireLogging` asks for it: it records whole requests and
        // responses, whose instance metadata holds the user data, so its records must only be written through
        // `wire_log`. This provider logs every call itself either way.
        let mut builder = Instances::builder()
            .with_endpoint(config.endpoint.clone().unwrap_or_else(|| DEFAULT_ENDPOINT.to_owned()))
            .with_credentials(credentials)
            .with_retry_policy(Aip194Strict.with_attempt_limit(ATTEMPTS))
            .with_backoff_policy(backoff);
        if config.wire_logging {
            builder = builder.with_tracing();
        }
        let client = builder
            .build()
            .await
            .map_err(|error| ProviderError::permanent("building the Compute Engine client").with_source(error))?;
        Ok(Self { client, config, destinations: DestinationPolicy::default() })
    }

    /// The same provider with `destinations` added to the default destination policy of the Squid its default
    /// cloud-init configures.
    pub fn with_destinations(mut self, destinations: DestinationPolicy) -> Self {
        self.destinations = destinations;
        self
    }

    fn zone_for<'a>(&'a self, request: &'a CreateRequest) -> Result<&'a str, ProviderError> {
        request.zone.as_deref().or(self.config.default_zone.as_deref()).ok_or_else(|| {
            ProviderError::permanent(
                "no zone: set placement.zone on the Proxy or gcp.defaultZone in the providers config",
            )
        })
    }

    /// The VM to insert for `request` in `zone`.
    fn instance_body(&self, request: &CreateRequest, zone: &str) -> Result<model::Instance, ProviderError> {
        let machine_type = request.machine_type.as_deref().unwrap_or(&self.config.default_machine_type);
        let machine_type = if machine_type.contains('/') {
            machine_type.to_owned()
        } else {
            format!("zones/{zone}/machineTypes/{machine_type}")
        };
        let image = request.image.as_deref().unwrap_or(&self.config.default_image);
        let network = if self.config.network.contains('/') {
            self.config.network.clone()
        } else {
            format!("global/networks/{}", self.config.network)
        };
        let mut interface = NetworkInterface::new().set_network(network).set_access_configs([AccessConfig::new()
            .set_name("External NAT")
            .set_type(model::access_config::Type::OneToOneNat)]);
        if let Some(subnetwork) = &self.config.subnetwork {
            let subnetwork = if subnetwork.contains('/') {
                subnetwork.clone()
            } else {
                format!("regions/{}/subnetworks/{subnetwork}", region_of(zone))
            };
            interface = interface.set_subnetwork(subnetwork);
        }
        let user_data = String::from_utf8(egress_provider::cloud_init::for_request(
            request,
            &self.destinations.narrowed_by(&request.deny_destinations),
        ))
        .map_err(|_| ProviderError::permanent("the cloud-init is not UTF-8 text, which instance metadata requires"))?;
        Ok(model::Instance::new()
            .set_name(request.name.clone())
            .set_description("An egress proxy managed by egress-operator")
            .set_machine_type(machine_type)
            .set_labels(labels(&request.tags)?)
            .set_tags(model::Tags::new().set_items([self.config.firewall_tag.clone()]))
            .set_metadata(
                Metadata::new().set_items([model::metadata::Items::new().set_key(USER_DATA_KEY).set_value(user_data)]),
            )
            .set_disks([AttachedDisk::new().set_boot(true).set_auto_delete(true).set_initialize_params(
                AttachedDiskInitializeParams::new().set_source_image(image.to_owned()).set_disk_size_gb(BOOT_DISK_GB),
            )])
            .set_network_interfaces([interface]))
    }

    fn target(&self) -> String {
        format!("projects/{}", self.config.project)
    }
}

/// `us-central1-a` → `us-central1`.
fn region_of(zone: &str) -> &str {
    zone.rsplit_once('-').map_or(zone, |(region, _)| region)
}

/// A stable request ID (a UUID) for an operation on an instance: the same call after a crash or a retry carries the
/// same ID, and Compute Engine answers it with the first operation instead of doing the work twice.
pub fn request_id(operation: &str, provider_id: &str) -> String {
    let digest = Sha256::new()
        .chain_update(b"egress-operator gcp request\0")
        .chain_update(operation.as_bytes())
        .chain_update(b"\0")
        .chain_update(provider_id.as_bytes())
        .finalize();
    let mut bytes = [0_u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    bytes[6] = (bytes[6] & 0x0f) | 0x50; // version 5 layout: name-based
    bytes[8] = (bytes[8] & 0x3f) | 0x80; // RFC 4122 variant
    let hex: String = bytes.iter().map(|byte| format!("{byte:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

/// Whether `value` may be a Compute Engine label key (`key`) or value.
fn is_label(value: &str, key: bool) -> bool {
    let allowed = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_';
    value.len() <= 63 && value.chars().all(allowed) && (!key || value.starts_with(|c: char| c.is_ascii_lowercase()))
}

/// The GC contract as labels; a tag that cannot be a label is a permanent error.
pub fn labels(tags: &Tags) -> Result<HashMap<String, String>, ProviderError> {
    let mut labels = HashMap::new();
    for (key, value) in tags.iter() {
        let label = format!("{LABEL_PREFIX}{key}");
        if !is_label(&label, true) || !is_label(value, false) {
            return Err(ProviderError::permanent(format!(
                "tag {key}={value:?} cannot be a Compute Engine label (at most 63 lowercase letters, digits, '-' and \
                 '_'); the cluster ID must be lowercase for the gcp provider"
            )));
        }
        labels.insert(label, value.to_owned());
    }
    Ok(labels)
}

/// The tags recorded in an instance's labels.
pub fn tags_from_labels(labels: &HashMap<String, String>) -> Tags {
    labels.iter().filter_map(|(key, value)| Some((key.strip_prefix(LABEL_PREFIX)?, value.as_str()))).collect()
}

/// The aggregatedList filter selecting instances with every tag.
pub fn filter(tags: &Tags) -> Result<String, ProviderError> {
    let labels = labels(tags)?;
    let mut terms: Vec<String> = labels.iter().map(|(key, value)| format!("(labels.{key} = \"{value}\")")).collect();
    terms.sort();
    Ok(terms.join(" "))
}

/// Splits `projects/<p>/zones/<z>/instances/<name>`.
pub fn parse_provider_id(provider_id: &str) -> Result<(&str, &str, &str), ProviderError> {
    let parts: Vec<&str> = provider_id.split('/').collect();
    match parts.as_slice() {
        ["projects", project, "zones", zone, "instances", name]
            if !project.is_empty() && !zone.is_empty() && !name.is_empty() =>
        {
            Ok((project, zone, name))
        }
        _ => Err(ProviderError::permanent(format!(
            "{provider_id:?} is not a gcp provider ID (projects/<project>/zones/<zone>/instances/<name>)"
        ))),
    }
}

fn provider_id(project: &str, zone: &str, name: &str) -> String {
    format!("projects/{project}/zones/{zone}/instances/{name}")
}

/// The last segment of a URL or path (`.../zones/us-central1-a` → `us-central1-a`).
fn last_segment(text: &str) -> &str {
    text.rsplit('/').next().unwrap_or(text)
}

/// The contract's view of a Compute Engine instance.
pub fn instance_from_gce(project: &str, vm: &model::Instance) -> Instance {
    use model::instance::Status;
    let name = vm.name.clone().unwrap_or_default();
    let zone = vm.zone.as_deref().map(last_segment).unwrap_or_default();
    let ip: Option<IpAddr> = vm
        .network_interfaces
        .iter()
        .flat_map(|interface| &interface.access_configs)
        .find_map(|config| config.nat_ip.as_deref()?.parse().ok());
    let state = match &vm.status {
        Some(Status::Running) if ip.is_some() => InstanceState::Running,
        Some(Status::Stopping | Status::Stopped | Status::Suspending | Status::Suspended | Status::Terminated) => {
            InstanceState::Terminated
        }
        // PROVISIONING, STAGING, RUNNING without an address yet, REPAIRING, and states this build does not know.
        _ => InstanceState::Provisioning,
    };
    let created_at =
        vm.creation_timestamp.as_deref().and_then(|text| text.parse::<jiff::Timestamp>().ok()).map(SystemTime::from);
    let ip = if state == InstanceState::Running { ip } else { None };
    Instance::new(name.clone(), provider_id(project, zone, &name), state, ip, created_at, tags_from_labels(&vm.labels))
}

/// Logs one finished call at debug.
fn log_call(operation: &str, target: &str, started: Instant, outcome: &str, operation_name: Option<&str>) {
    debug!(
        operation,
        target,
        outcome,
        operation_name = operation_name.unwrap_or(""),
        duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        "Compute Engine call"
    );
}

#[async_trait]
impl Provider for GcpProvider {
    fn destination_policy(&self) -> Option<&DestinationPolicy> {
        Some(&self.destinations)
    }

    async fn create(&self, request: &CreateRequest) -> Result<Instance, ProviderError> {
        let zone = self.zone_for(request)?;
        let project = &self.config.project;
        let id = provider_id(project, zone, &request.name);
        let body = self.instance_body(request, zone)?;
        // Never the body itself: its metadata holds the user data.
        trace!(
            instance = %request.name,
            zone,
            machine_type = body.machine_type.as_deref().unwrap_or(""),
            image = request.image.as_deref().unwrap_or(&self.config.default_image),
            labels = ?body.labels,
            network_tag = %self.config.firewall_tag,
            port = request.port,
            "inserting an instance"
        );
        let started = Instant::now();
        let result = self
            .client
            .insert()
            .set_project(project.clone())
            .set_zone(zone.to_owned())
            .set_request_id(request_id("insert", &id))
            .set_body(body)
            // The request ID makes a repeated insert safe, so the SDK may retry it.
            .with_idempotency(true)
            .send()
            .await;
        match result {
            Ok(operation) => {
                log_call("insert", &id, started, "accepted", operation.name.as_deref());
                Ok(Instance::new(
                    request.name.clone(),
                    id,
                    InstanceState::Provisioning,
                    None,
                    Some(SystemTime::now()),
                    request.tags.clone(),
                ))
            }
            Err(error) if error.http_status_code() == Some(409) => {
                // An instance with this name exists (an earlier insert, before a crash): adopt it.
                log_call("insert", &id, started, "exists", None);
                self.get(&id).await
            }
            Err(error) => {
                log_call("insert", &id, started, "failed", None);
                Err(classify("insert", &id, error))
            }
        }
    }

    async fn get(&self, provider_id: &str) -> Result<Instance, ProviderError> {
        let (project, zone, name) = parse_provider_id(provider_id)?;
        let started = Instant::now();
        let result = self
            .client
            .get()
            .set_project(project.to_owned())
            .set_zone(zone.to_owned())
            .set_instance(name.to_owned())
            .send()
            .await;
        match result {
            Ok(vm) => {
                let instance = instance_from_gce(project, &vm);
                log_call("get", provider_id, started, instance.state.as_str(), None);
                Ok(instance)
            }
            Err(error) => {
                log_call("get", provider_id, started, "failed", None);
                Err(classify("get", provider_id, error))
            }
        }
    }

    async fn delete(&self, provider_id: &str) -> Result<(), ProviderError> {
        let (project, zone, name) = parse_provider_id(provider_id)?;
        let started = Instant::now();
        let result = self
            .client
            .delete()
            .set_project(project.to_owned())
            .set_zone(zone.to_owned())
            .set_instance(name.to_owned())
            .set_request_id(request_id("delete", provider_id))
            .with_idempotency(true)
            .send()
            .await;
        match result {
            Ok(operation) => {
                log_call("delete", provider_id, started, "accepted", operation.name.as_deref());
                Ok(())
            }
            Err(error) => {
                let error = classify("delete", provider_id, error);
                if error.class() == ErrorClass::NotFound {
                    log_call("delete", provider_id, started, "already gone", None);
                    Ok(())
                } else {
                    log_call("delete", provider_id, started, "failed", None);
                    Err(error)
                }
            }
        }
    }

    async fn list_by_tag(&self, tags: &Tags) -> Result<Vec<Instance>, ProviderError> {
        let filter = filter(tags)?;
        let project = &self.config.project;
        let target = self.target();
        let mut instances = Vec::new();
        let mut page_token: Option<String> = None;
        loop {
            let started = Instant::now();
            trace!(target = %target, filter = %filter, page_token = page_token.as_deref().unwrap_or(""), "listing instances");
            let page = self
                .client
                .aggregated_list()
                .set_project(project.clone())
                .set_filter(filter.clone())
                .set_max_results(PAGE_SIZE)
                .set_or_clear_page_token(page_token.take())
                .send()
                .await
                .map_err(|error| {
                    log_call("aggregatedList", &target, started, "failed", None);
                    classify("aggregatedList", &target, error)
                })?;
            log_call("aggregatedList", &target, started, "listed", None);
            if !page.unreachables.is_empty() {
                // A partial answer would make the orphan collector blind to some zones; say so and fail the round.
                return Err(ProviderError::transient(format!(
                    "aggregatedList {target}: unreachable scopes {}",
                    page.unreachables.join(", ")
                )));
            }
            for scoped in page.items.values() {
                for vm in &scoped.instances {
                    let instance = instance_from_gce(project, vm);
                    // The server filtered already; checking again costs nothing and guards against a loose filter.
                    if instance.tags.contains_all(tags) {
                        instances.push(instance);
                    }
                }
            }
            match page.next_page_token {
                Some(token) if !token.is_empty() => page_token = Some(token),
                _ => break,
            }
        }
        instances.sort_by(|a, b| a.provider_id.cmp(&b.provider_id));
        Ok(instances)
    }
}

#[async_trait]
impl Checker for GcpProvider {
    /// One verdict for the project: the credentials work and one page of at most one instance lists.
    async fn check(&self) -> Vec<TargetVerdict> {
        let target = self.target();
        let started = Instant::now();
        let result =
            self.client.aggregated_list().set_project(self.config.project.clone()).set_max_results(1_u32).send().await;
        let verdict = match result {
            Ok(_) => {
                log_call("aggregatedList", &target, started, "checked", None);
                TargetVerdict::ready(target.clone())
            }
            Err(error) => {
                log_call("aggregatedList", &target, started, "failed", None);
                let raw = classify::Raw::of(&error);
                let reason = match raw.status {
                    Some(401) => "Unauthenticated",
                    Some(403) => "PermissionDenied",
                    Some(404) => "ProjectNotFound",
                    Some(429) => "QuotaExceeded",
                    Some(_) => "ApiError",
                    None if raw.authentication => "CredentialsUnusable",
                    None => "Unreachable",
                };
                let error = classify("aggregatedList", &target, error);
                TargetVerdict::not_ready(target.clone(), reason, error.chain())
            }
        };
        vec![verdict]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_ids_round_trip_and_reject_others() {
        let id = provider_id("my-project", "europe-west1-b", "px-abc");
        assert_eq!(id, "projects/my-project/zones/europe-west1-b/instances/px-abc");
        assert_eq!(parse_provider_id(&id).unwrap(), ("my-project", "europe-west1-b", "px-abc"));
        for bad in ["", "px-abc", "projects/p/zones/z/instances/", "projects/p/regions/r/instances/x", "a/b/c/d/e/f/g"]
        {
            assert_eq!(parse_provider_id(bad).unwrap_err().class(), ErrorClass::Permanent, "{bad:?}");
        }
    }

    #[test]
    fn request_ids_are_stable_uuids_per_operation_and_instance() {
        let id = request_id("insert", "projects/p/zones/z/instances/a");
        assert_eq!(id, request_id("insert", "projects/p/zones/z/instances/a"));
        assert_ne!(id, request_id("delete", "projects/p/zones/z/instances/a"));
        assert_ne!(id, request_id("insert", "projects/p/zones/z/instances/b"));
        assert_eq!(id.len(), 36);
        assert_eq!(id.matches('-').count(), 4);
        assert_eq!(&id[14..15], "5");
    }

    #[test]
    fn tags_become_prefixed_labels_and_back() {
        let tags = Tags::gc_contract("prod-eu", "0b9c-11", "340e470e78ddee5a");
        let labels = labels(&tags).unwrap();
        assert_eq!(labels.get("egress-cluster").map(String::as_str), Some("prod-eu"));
        assert_eq!(tags_from_labels(&labels), tags);
        let mut with_foreign = labels.clone();
        with_foreign.insert("team".into(), "crawl".into());
        assert_eq!(tags_from_labels(&with_foreign), tags, "labels without the prefix are not tags");
    }

    #[test]
    fn an_uppercase_cluster_id_is_a_permanent_error() {
        let error = labels(&Tags::owned_by_cluster("Prod.EU")).unwrap_err();
        assert_eq!(error.class(), ErrorClass::Permanent);
        assert!(error.to_string().contains("lowercase"), "{error}");
    }

    #[test]
    fn the_filter_ands_every_label() {
        let tags = Tags::owned_by_cluster("c1");
        assert_eq!(
            filter(&tags).unwrap(),
            "(labels.egress-cluster = \"c1\") (labels.egress-managed-by = \"egress-operator\")"
        );
    }

    #[test]
    fn states_map_like_the_design_says() {
        use model::instance::Status;
        let vm = |status: Status, nat: Option<&str>| {
            let mut access = AccessConfig::new();
            if let Some(nat) = nat {
                access = access.set_nat_ip(nat);
            }
            model::Instance::new()
                .set_name("px-a")
                .set_zone("https://compute.googleapis.com/compute/v1/projects/p/zones/us-east1-b")
                .set_status(status)
                .set_network_interfaces([NetworkInterface::new().set_access_configs([access])])
        };
        let cases = [
            (vm(Status::Provisioning, None), InstanceState::Provisioning),
            (vm(Status::Staging, None), InstanceState::Provisioning),
            (vm(Status::Running, None), InstanceState::Provisioning),
            (vm(Status::Running, Some("203.0.113.7")), InstanceState::Running),
            (vm(Status::Stopping, Some("203.0.113.7")), InstanceState::Terminated),
            (vm(Status::Suspended, None), InstanceState::Terminated),
            (vm(Status::Suspending, None), InstanceState::Terminated),
            (vm(Status::Terminated, None), InstanceState::Terminated),
        ];
        for (vm, state) in cases {
            let instance = instance_from_gce("p", &vm);
            assert_eq!(instance.state, state, "{:?}", vm.status);
            assert_eq!(instance.provider_id, "projects/p/zones/us-east1-b/instances/px-a");
            assert_eq!(instance.ip.is_some(), state == InstanceState::Running);
        }
    }

    #[test]
    fn zones_name_their_region() {
        assert_eq!(region_of("us-central1-a"), "us-central1");
        assert_eq!(region_of("europe-west4-c"), "europe-west4");
    }
}
