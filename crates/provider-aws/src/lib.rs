//! The `aws` provider of egress-operator: each proxy is an EC2 instance with a public address of its own, running
//! Squid.
//!
//! EC2's Query API, signed with SigV4 ([`query`]), and no SDK (see the decision log): `RunInstances` (with a client
//! token derived from the cluster and the instance name, so a retried launch never makes a second instance, and
//! after a lookup by name, so a launch after a crash adopts the first), `DescribeInstances`, `TerminateInstances`,
//! the security group calls ([`security_group`]), and `DescribeAvailabilityZones`/`DescribeSubnets` for the
//! provider's health. Launch and terminate return as soon as EC2 accepted them; the next `get` observes progress.
//!
//! - `provider_id` is `regions/<region>/instances/<instance id>`.
//! - The instance gets the AMI and type from the request or the config's defaults, the subnet from the config (or
//!   `placement.zone` when that names a subnet), the GC contract as tags (`egress-<tag>`) beside `Name`, the
//!   cloud-init as user data (a Squid installer when the Proxy has none), the provider's security group plus the
//!   config's, a public address unless `address: private`, IMDSv2 only, and a shutdown from inside that terminates.
//! - State: pending → Provisioning; running with the chosen address → Running (without it, Provisioning);
//!   stopping/stopped/shutting-down/terminated → Terminated.
//! - Errors are classified on the error code, then the HTTP status ([`classify`]).
//! - Logging: one debug line per call (action, target, outcome, attempt, duration, and on failure the status, code
//!   and AWS's message), parameter names at trace. The user data and every credential are never logged.

pub mod classify;
pub mod config;
pub mod credentials;
pub mod ec2;
pub mod model;
pub mod query;
pub mod security_group;

pub use config::{AddressKind, AwsConfig};

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use base64::Engine;
use egress_provider::config::ProviderConfig;
use egress_provider::destinations::DestinationPolicy;
use egress_provider::registry::{Built, ProviderType};
use egress_provider::{
    Checker, CreateRequest, ErrorClass, Instance, InstanceState, Provider, ProviderError, Tags, TargetVerdict,
};
use sha2::{Digest, Sha256};
use tokio::sync::Mutex;
use tracing::trace;

use crate::credentials::CredentialChain;
use crate::ec2::Ec2;
use crate::model::{NAME_TAG, child_text, items};
use crate::security_group::Groups;

/// EC2's limit on user data, before base64.
pub const MAX_USER_DATA: usize = 16 * 1024;
/// Instances asked for per DescribeInstances page.
pub const PAGE_SIZE: u32 = 500;
/// The states of instances that hold or will hold resources, which the orphan collector and adoption look at.
const LIVE_STATES: &[&str] = &["pending", "running", "stopping", "stopped"];

/// An EC2 region as a provider.
pub struct AwsProvider {
    ec2: Ec2,
    config: AwsConfig,
    destinations: DestinationPolicy,
    groups: Groups,
    /// The VPC of each subnet launched into.
    vpcs: Mutex<HashMap<String, String>>,
    page_size: u32,
}

impl std::fmt::Debug for AwsProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AwsProvider")
            .field("region", &self.config.region)
            .field("credentials", &self.ec2.credentials().describe())
            .finish_non_exhaustive()
    }
}

impl ProviderType for AwsProvider {
    type Settings = AwsConfig;

    /// As [`AwsProvider::new`]; a config entry of another type is a permanent error.
    async fn construct(config: ProviderConfig) -> Result<Built, ProviderError> {
        let Some(settings) = config.settings::<AwsConfig>().cloned() else {
            return Err(ProviderError::permanent(format!("provider {:?} is not of type aws", config.name)));
        };
        let provider = Arc::new(AwsProvider::new(settings)?.with_destinations(config.destinations));
        Ok(Built { provider: provider.clone(), checker: Some(provider) })
    }
}

impl AwsProvider {
    /// Builds the client: credentials from the standard chain ([`credentials`]) and the endpoint from the config.
    ///
    /// # Errors
    /// No credentials, or half a source of them (Permanent).
    pub fn new(config: AwsConfig) -> Result<Self, ProviderError> {
        let chain = |http: reqwest::Client| {
            CredentialChain::from_process(config.profile.as_deref(), config.sts_endpoint(), http)
        };
        Self::with_credentials(config.clone(), chain)
    }

    /// As [`Self::new`], with the credential chain `chain` makes from the HTTP client (tests give an environment of
    /// their own).
    ///
    /// # Errors
    /// What `chain` returns.
    pub fn with_credentials(
        config: AwsConfig,
        chain: impl FnOnce(reqwest::Client) -> Result<CredentialChain, ProviderError>,
    ) -> Result<Self, ProviderError> {
        // ring is the one TLS crypto provider this workspace builds; reqwest's rustls needs it installed.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(query::CALL_TIMEOUT)
            .build()
            .map_err(|error| ProviderError::permanent("building the HTTP client").with_source(error))?;
        let credentials = chain(http.clone())?;
        let ec2 = Ec2::new(http, credentials, config.region.clone(), config.ec2_endpoint());
        Ok(Self {
            ec2,
            config,
            destinations: DestinationPolicy::default(),
            groups: Groups::default(),
            vpcs: Mutex::new(HashMap::new()),
            page_size: PAGE_SIZE,
        })
    }

    /// The same provider listing `page_size` instances per DescribeInstances page (5 to 1000; [`PAGE_SIZE`] unless
    /// set), so a test can page through a few.
    pub fn with_page_size(mut self, page_size: u32) -> Self {
        self.page_size = page_size.clamp(5, 1000);
        self
    }

    /// The EC2 client, for calls the provider does not make itself (tests set up VPCs with it).
    pub fn ec2(&self) -> &Ec2 {
        &self.ec2
    }

    /// The same provider with `destinations` added to the default destination policy of the Squid its default
    /// cloud-init configures.
    pub fn with_destinations(mut self, destinations: DestinationPolicy) -> Self {
        self.destinations = destinations;
        self
    }

    /// The subnet for `request`: `placement.zone` when it names a subnet, else the config's.
    fn subnet_for<'a>(&'a self, request: &'a CreateRequest) -> Result<&'a str, ProviderError> {
        match request.zone.as_deref() {
            None => Ok(&self.config.subnet_id),
            Some(zone) if zone.starts_with("subnet-") => Ok(zone),
            Some(zone) => Err(ProviderError::permanent(format!(
                "placement.zone {zone:?} is not a subnet ID: the aws provider launches into a subnet (its zone \
                 follows), so give placement.zone a subnet-… ID or leave it empty for aws.subnetId"
            ))),
        }
    }

    /// The VPC `subnet` belongs to.
    async fn vpc_of(&self, subnet: &str) -> Result<String, ProviderError> {
        if let Some(vpc) = self.vpcs.lock().await.get(subnet) {
            return Ok(vpc.clone());
        }
        let mut form = Ec2::form("DescribeSubnets");
        form.push("SubnetId.1", subnet);
        let text = self.ec2.call(&form, subnet).await?;
        let document = model::parse(&text)?;
        let vpc = items(document.root_element(), "subnetSet")
            .find_map(|item| child_text(item, "vpcId"))
            .ok_or_else(|| ProviderError::permanent(format!("the subnet {subnet} was not found")))?
            .to_owned();
        self.vpcs.lock().await.insert(subnet.to_owned(), vpc.clone());
        Ok(vpc)
    }

    /// The live instance named `name` with every tag of `tags`, when one exists (an earlier launch).
    async fn find_by_name(&self, name: &str, tags: &Tags) -> Result<Option<Instance>, ProviderError> {
        let mut form = Ec2::form("DescribeInstances");
        form.filter(&format!("tag:{NAME_TAG}"), &[name]).filter("instance-state-name", LIVE_STATES);
        for (key, value) in model::tag_pairs(tags) {
            form.filter(&format!("tag:{key}"), &[&value]);
        }
        let text = self.ec2.call(&form, name).await?;
        let document = model::parse(&text)?;
        let found = model::instance_nodes(&document)
            .into_iter()
            .map(|node| model::instance_of(&self.config.region, node, self.config.address))
            .find(|instance| instance.name == name && instance.tags.contains_all(tags));
        Ok(found)
    }

    /// The RunInstances call for `request`.
    fn launch_form(
        &self,
        request: &CreateRequest,
        subnet: &str,
        groups: &[String],
    ) -> Result<query::Form, ProviderError> {
        let image = request.image.as_deref().or(self.config.default_image_id.as_deref()).ok_or_else(|| {
            ProviderError::permanent(
                "no AMI: set placement.image on the Proxy or aws.defaultImageId in the providers config",
            )
        })?;
        let user_data = egress_provider::cloud_init::for_request(
            request,
            &self.destinations.narrowed_by(&request.deny_destinations),
        );
        if user_data.len() > MAX_USER_DATA {
            return Err(ProviderError::permanent(format!(
                "the cloud-init is {} bytes; EC2 takes at most {MAX_USER_DATA} bytes of user data",
                user_data.len()
            )));
        }
        let mut form = Ec2::form("RunInstances");
        form.push("ImageId", image)
            .push("InstanceType", request.machine_type.as_deref().unwrap_or(&self.config.default_instance_type))
            .push("MinCount", "1")
            .push("MaxCount", "1")
            .push("ClientToken", client_token(request.tags.get(Tags::CLUSTER).unwrap_or(""), &request.name))
            .push("UserData", base64::engine::general_purpose::STANDARD.encode(&user_data))
            .push("InstanceInitiatedShutdownBehavior", "terminate")
            .push("MetadataOptions.HttpTokens", "required")
            .push("NetworkInterface.1.DeviceIndex", "0")
            .push("NetworkInterface.1.SubnetId", subnet)
            .push("NetworkInterface.1.DeleteOnTermination", "true")
            .push(
                "NetworkInterface.1.AssociatePublicIpAddress",
                if self.config.address == AddressKind::Public { "true" } else { "false" },
            );
        for (index, group) in groups.iter().enumerate() {
            form.push(format!("NetworkInterface.1.SecurityGroupId.{}", index + 1), group.as_str());
        }
        let mut tags = vec![(NAME_TAG.to_owned(), request.name.clone())];
        tags.extend(model::tag_pairs(&request.tags));
        for (spec, resource) in [(1, "instance"), (2, "volume")] {
            form.push(format!("TagSpecification.{spec}.ResourceType"), resource);
            for (index, (key, value)) in tags.iter().enumerate() {
                form.push(format!("TagSpecification.{spec}.Tag.{}.Key", index + 1), key.as_str())
                    .push(format!("TagSpecification.{spec}.Tag.{}.Value", index + 1), value.as_str());
            }
        }
        Ok(form)
    }

    fn target(&self) -> String {
        format!("regions/{}", self.config.region)
    }

    /// The region of `provider_id`, which must be this provider's.
    fn instance_id<'a>(&self, provider_id: &'a str) -> Result<&'a str, ProviderError> {
        let (region, id) = model::parse_provider_id(provider_id)?;
        if region != self.config.region {
            return Err(ProviderError::permanent(format!(
                "{provider_id} is in region {region}; this provider manages {}",
                self.config.region
            )));
        }
        Ok(id)
    }
}

/// The idempotency token of the launch of instance `name` of `cluster` (at most 64 ASCII characters): the same
/// launch after a timeout or a crash carries the same token, and EC2 answers it with the first instance.
pub fn client_token(cluster: &str, name: &str) -> String {
    let digest = Sha256::new()
        .chain_update(b"egress-operator aws launch\0")
        .chain_update(cluster.as_bytes())
        .chain_update(b"\0")
        .chain_update(name.as_bytes())
        .finalize();
    digest.iter().take(24).map(|byte| format!("{byte:02x}")).collect()
}

#[async_trait]
impl Provider for AwsProvider {
    fn destination_policy(&self) -> Option<&DestinationPolicy> {
        Some(&self.destinations)
    }

    async fn create(&self, request: &CreateRequest) -> Result<Instance, ProviderError> {
        if let Some(existing) = self.find_by_name(&request.name, &request.tags).await? {
            trace!(instance = %request.name, provider_id = %existing.provider_id, "adopting the instance launched before");
            return Ok(existing);
        }
        let subnet = self.subnet_for(request)?;
        let vpc = self.vpc_of(subnet).await?;
        let own =
            self.groups.ensure(&self.ec2, &vpc, &request.tags, request.port, &self.config.allowed_sources).await?;
        let mut groups = vec![own];
        groups.extend(self.config.security_group_ids.iter().cloned());
        let form = self.launch_form(request, subnet, &groups)?;
        trace!(
            instance = %request.name,
            subnet,
            image = form.get("ImageId").unwrap_or(""),
            instance_type = form.get("InstanceType").unwrap_or(""),
            groups = ?groups,
            port = request.port,
            "launching an instance"
        );
        let text = self.ec2.call(&form, &request.name).await?;
        let document = model::parse(&text)?;
        let launched = model::instance_nodes(&document)
            .into_iter()
            .next()
            .map(|node| model::instance_of(&self.config.region, node, self.config.address))
            .ok_or_else(|| {
                ProviderError::transient(format!("RunInstances {}: no instance in the answer", request.name))
            })?;
        Ok(Instance::new(
            request.name.clone(),
            launched.provider_id,
            if launched.state == InstanceState::Running { InstanceState::Running } else { InstanceState::Provisioning },
            launched.ip,
            launched.created_at.or_else(|| Some(SystemTime::now())),
            request.tags.clone(),
        ))
    }

    async fn get(&self, provider_id: &str) -> Result<Instance, ProviderError> {
        let id = self.instance_id(provider_id)?;
        let mut form = Ec2::form("DescribeInstances");
        form.push("InstanceId.1", id);
        let text = self.ec2.call(&form, provider_id).await?;
        let document = model::parse(&text)?;
        model::instance_nodes(&document)
            .into_iter()
            .next()
            .map(|node| model::instance_of(&self.config.region, node, self.config.address))
            .ok_or_else(|| ProviderError::not_found(format!("{provider_id}: no such instance")))
    }

    async fn delete(&self, provider_id: &str) -> Result<(), ProviderError> {
        let id = self.instance_id(provider_id)?;
        // An instance already on its way out is left alone: one call instead of two on the orphan collector's
        // repeats (and moto fails a second terminate of an instance whose interface went with the first).
        let mut describe = Ec2::form("DescribeInstances");
        describe.push("InstanceId.1", id);
        match self.ec2.call(&describe, provider_id).await {
            Ok(text) => {
                let document = model::parse(&text)?;
                let state = model::instance_nodes(&document).first().and_then(|node| model::state_name(*node));
                if matches!(state, None | Some("shutting-down" | "terminated")) {
                    return Ok(());
                }
            }
            Err(error) if error.class() == ErrorClass::NotFound => return Ok(()),
            Err(error) => return Err(error),
        }
        let mut form = Ec2::form("TerminateInstances");
        form.push("InstanceId.1", id);
        match self.ec2.call(&form, provider_id).await {
            Ok(_) => Ok(()),
            Err(error) if error.class() == ErrorClass::NotFound => Ok(()),
            Err(error) => Err(error),
        }
    }

    async fn list_by_tag(&self, tags: &Tags) -> Result<Vec<Instance>, ProviderError> {
        let target = self.target();
        let mut instances = Vec::new();
        let mut next: Option<String> = None;
        loop {
            let mut form = Ec2::form("DescribeInstances");
            form.filter("instance-state-name", LIVE_STATES);
            for (key, value) in model::tag_pairs(tags) {
                form.filter(&format!("tag:{key}"), &[&value]);
            }
            form.push("MaxResults", self.page_size.to_string());
            if let Some(token) = next.take() {
                form.push("NextToken", token);
            }
            let text = self.ec2.call(&form, &target).await?;
            let document = model::parse(&text)?;
            for node in model::instance_nodes(&document) {
                let instance = model::instance_of(&self.config.region, node, self.config.address);
                // The server filtered already; checking again costs nothing and guards against a loose filter.
                if instance.tags.contains_all(tags) {
                    instances.push(instance);
                }
            }
            match model::next_token(&document) {
                Some(token) => next = Some(token.to_owned()),
                None => break,
            }
        }
        instances.sort_by(|a, b| a.provider_id.cmp(&b.provider_id));
        Ok(instances)
    }
}

#[async_trait]
impl Checker for AwsProvider {
    /// One verdict for the region: the credentials sign, the region answers, and the configured subnet exists.
    async fn check(&self) -> Vec<TargetVerdict> {
        let target = self.target();
        // Only the answers matter: the region's zones (a handful), then the one subnet.
        let mut zones = Ec2::form("DescribeAvailabilityZones");
        zones.filter("region-name", &[&self.config.region]);
        let mut subnet = Ec2::form("DescribeSubnets");
        subnet.push("SubnetId.1", self.config.subnet_id.as_str());
        let result = match self.ec2.call(&zones, &target).await {
            Ok(_) => self.ec2.call(&subnet, &self.config.subnet_id).await.map(|_| ()),
            Err(error) => Err(error),
        };
        let verdict = match result {
            Ok(()) => TargetVerdict::ready(target.clone()),
            Err(error) => {
                let message = error.chain();
                let reason = reason_of(&message, error.class());
                TargetVerdict::not_ready(target.clone(), reason, message)
            }
        };
        vec![verdict]
    }
}

/// The health verdict's reason for a failed check.
fn reason_of(message: &str, class: ErrorClass) -> &'static str {
    let has = |code: &str| message.contains(code);
    if has("AuthFailure") || has("InvalidClientTokenId") || has("SignatureDoesNotMatch") {
        "Unauthenticated"
    } else if has("UnauthorizedOperation") || has("AccessDenied") {
        "PermissionDenied"
    } else if has("InvalidSubnetID") {
        "SubnetNotFound"
    } else if has("no AWS credentials") || has("AssumeRoleWithWebIdentity") || has("web identity") {
        "CredentialsUnusable"
    } else if class == ErrorClass::QuotaExceeded {
        "QuotaExceeded"
    } else if has("no answer") || has("timed out") {
        "Unreachable"
    } else {
        "ApiError"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_tokens_are_stable_per_cluster_and_name_and_fit_ec2s_limit() {
        let token = client_token("c1", "px-a");
        assert_eq!(token, client_token("c1", "px-a"));
        assert_ne!(token, client_token("c2", "px-a"));
        assert_ne!(token, client_token("c1", "px-b"));
        assert!(token.len() <= 64 && token.is_ascii(), "{token}");
    }

    #[test]
    fn check_reasons_name_what_to_fix() {
        for (message, class, reason) in [
            (
                "DescribeAvailabilityZones regions/x: HTTP 401 AuthFailure: bad",
                ErrorClass::Permanent,
                "Unauthenticated",
            ),
            ("…: HTTP 403 UnauthorizedOperation: …", ErrorClass::Permanent, "PermissionDenied"),
            ("…: HTTP 400 InvalidSubnetID.NotFound: …", ErrorClass::Permanent, "SubnetNotFound"),
            ("…: HTTP 503 RequestLimitExceeded: …", ErrorClass::QuotaExceeded, "QuotaExceeded"),
            ("…: no answer: no answer", ErrorClass::Transient, "Unreachable"),
            ("…: HTTP 500 InternalError: …", ErrorClass::Transient, "ApiError"),
        ] {
            assert_eq!(reason_of(message, class), reason, "{message}");
        }
    }
}
