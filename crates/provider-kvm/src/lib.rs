//! The kvm provider of egress-operator: Squid in libvirt guests on one or more hosts, reached over SSH.
//!
//! Each instance is a domain defined from [`xml::domain`]: a qcow2 overlay on a cached base image
//! ([`images`]), a NoCloud seed ISO ([`seed`], written by [`iso`]), a bridged NIC, UEFI unless the image says BIOS,
//! and the GC contract in a namespaced `<metadata>` element. `placement.zone` picks the host, `placement.image`
//! the image key and `placement.machineType` the machine profile. `provider_id` is `hosts/<host>/domains/<name>`.
//! Connections are pooled per host ([`conn`]); errors are classified in [`classify`].
//!
//! Nothing here depends on Kubernetes; the operator registers [`KvmProvider::construct`] for `type: kvm`.

pub mod classify;
pub mod config;
pub mod conn;
pub mod images;
pub mod iso;
pub mod names;
pub mod seed;
pub mod xml;

pub use config::{KvmConfig, KvmHost, KvmImage, KvmMachineType, KvmSsh};

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use egress_provider::config::ProviderConfig;
use egress_provider::destinations::DestinationPolicy;
use egress_provider::registry::{Built, ProviderType};
use egress_provider::{Checker, CreateRequest, Instance, InstanceState, Provider, ProviderError, Tags, TargetVerdict};
use virt::connect::Connect;
use virt::domain::Domain;
use virt::error::ErrorNumber;
use virt::storage_pool::StoragePool;

use crate::conn::Host;
use crate::images::ImageCache;
use crate::xml::{DomainFacts, DomainSpec, Firmware};

/// The machine profile used when neither the Proxy nor the config names one.
pub const FALLBACK_MACHINE: KvmMachineType = KvmMachineType { vcpus: 1, memory_mib: 1024, disk_gib: 10 };

/// How long an image download may take in all.
const DOWNLOAD_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// libvirt guests on the configured hosts.
pub struct KvmProvider {
    config: KvmConfig,
    destinations: DestinationPolicy,
    hosts: BTreeMap<String, Arc<Host>>,
    images: Arc<ImageCache>,
}

impl ProviderType for KvmProvider {
    type Settings = KvmConfig;

    /// As [`KvmProvider::new`]; a config entry of another type is a permanent error.
    async fn construct(config: ProviderConfig) -> Result<Built, ProviderError> {
        let Some(settings) = config.settings::<KvmConfig>().cloned() else {
            return Err(ProviderError::permanent(format!("provider {:?} is not of type kvm", config.name)));
        };
        let provider = Arc::new(KvmProvider::new(settings)?.with_destinations(config.destinations));
        Ok(Built { provider: provider.clone(), checker: Some(provider) })
    }
}

impl KvmProvider {
    /// The provider for `config`. Nothing is dialled: each host's connection opens on its first call, and the SSH
    /// key and known_hosts files are read then, so they may appear after start.
    ///
    /// # Errors
    /// The HTTP client for image downloads cannot be built (Permanent).
    pub fn new(config: KvmConfig) -> Result<Self, ProviderError> {
        let hosts =
            config.hosts.iter().map(|host| (host.name.clone(), Arc::new(Host::new(host, &config.ssh)))).collect();
        Ok(Self {
            images: Arc::new(ImageCache::new(http_client()?)),
            hosts,
            config,
            destinations: DestinationPolicy::default(),
        })
    }

    /// The same provider with `destinations` added to the default destination policy of the Squid its default
    /// cloud-init configures.
    pub fn with_destinations(mut self, destinations: DestinationPolicy) -> Self {
        self.destinations = destinations;
        self
    }

    fn host(&self, name: &str) -> Result<&Arc<Host>, ProviderError> {
        self.hosts.get(name).ok_or_else(|| {
            let known: Vec<&str> = self.hosts.keys().map(String::as_str).collect();
            ProviderError::permanent(format!("host {name:?} is not configured (hosts: {})", known.join(", ")))
        })
    }

    fn host_for(&self, request: &CreateRequest) -> Result<&Arc<Host>, ProviderError> {
        let name = request
            .zone
            .as_deref()
            .or(self.config.default_host.as_deref())
            .or_else(|| self.config.hosts.first().map(|host| host.name.as_str()))
            .ok_or_else(|| ProviderError::permanent("no kvm hosts are configured"))?;
        self.host(name)
    }

    fn image_for(&self, request: &CreateRequest) -> Result<(&str, &KvmImage), ProviderError> {
        let key = match request.image.as_deref().or(self.config.default_image.as_deref()) {
            Some(key) => key,
            None if self.config.images.len() == 1 => self.config.images.keys().next().expect("one image"),
            None => {
                return Err(ProviderError::permanent(
                    "no image: set placement.image on the Proxy or kvm.defaultImage in the providers config",
                ));
            }
        };
        let (key, image) = self.config.images.get_key_value(key).ok_or_else(|| {
            let known: Vec<&str> = self.config.images.keys().map(String::as_str).collect();
            ProviderError::permanent(format!("image {key:?} is not configured (images: {})", known.join(", ")))
        })?;
        Ok((key.as_str(), image))
    }

    fn machine_for(&self, request: &CreateRequest) -> Result<KvmMachineType, ProviderError> {
        match request.machine_type.as_deref().or(self.config.default_machine_type.as_deref()) {
            None => Ok(FALLBACK_MACHINE),
            Some(key) => self.config.machine_types.get(key).cloned().ok_or_else(|| {
                let known: Vec<&str> = self.config.machine_types.keys().map(String::as_str).collect();
                ProviderError::permanent(format!(
                    "machine type {key:?} is not configured (machineTypes: {})",
                    known.join(", ")
                ))
            }),
        }
    }

    /// Reads one domain into an instance; `None` when no domain has that name.
    async fn read(&self, host: &Arc<Host>, name: &str) -> Result<Option<Instance>, ProviderError> {
        let (domain_name, host_name) = (name.to_owned(), host.name.clone());
        host.call("domainLookup", name, move |conn| match Domain::lookup_by_name(conn, &domain_name) {
            Ok(domain) => observe(&domain, &host_name).map(Some),
            Err(error) if error.code() == ErrorNumber::NoDomain => Ok(None),
            Err(error) => Err(error),
        })
        .await?
        .map(|observed| observed.into_instance().map_err(ProviderError::permanent))
        .transpose()
    }

    /// Deletes the instance's overlay and seed volumes; missing ones are fine.
    async fn delete_volumes(&self, host: &Arc<Host>, name: &str) -> Result<(), ProviderError> {
        images::delete_volume(host, &names::overlay_volume(name)).await?;
        images::delete_volume(host, &names::seed_volume(name)).await
    }

    /// Removes older checksums of this config's images once nothing uses them; a failure is only logged (the next
    /// delete tries again).
    async fn collect_images(&self, host: &Arc<Host>) {
        let configured = self.config.images.iter().map(|(key, image)| names::base_volume(key, &image.sha256)).collect();
        match images::collect_unused(host, configured).await {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(host = %host.name, removed = ?removed, "removed outdated base images no guest uses");
            }
            Ok(_) => {}
            Err(error) => tracing::warn!(host = %host.name, error = %error.chain(), "collecting unused base images"),
        }
    }
}

/// The HTTP client image downloads use: rustls with ring and the system's roots (no process-wide TLS provider is
/// installed), a connect timeout, and an overall bound per download.
///
/// # Errors
/// The TLS configuration or the client cannot be built (Permanent).
pub fn http_client() -> Result<reqwest::Client, ProviderError> {
    let mut roots = rustls::RootCertStore::empty();
    let loaded = rustls_native_certs::load_native_certs();
    for certificate in loaded.certs {
        let _ = roots.add(certificate);
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|error| ProviderError::permanent("TLS for image downloads").with_source(error))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .connect_timeout(Duration::from_secs(30))
        .timeout(DOWNLOAD_TIMEOUT)
        .build()
        .map_err(|error| ProviderError::permanent("building the image download client").with_source(error))
}

/// What one libvirt read of a domain says.
struct Observed {
    name: String,
    host: String,
    state: InstanceState,
    ip: Option<IpAddr>,
    facts: DomainFacts,
}

impl Observed {
    fn into_instance(self) -> Result<Instance, String> {
        if !self.facts.ours {
            return Err(format!(
                "domain {} on host {} exists but was not made by egress-operator (no egress metadata)",
                self.name, self.host
            ));
        }
        let created = self.facts.created_unix.map(|seconds| UNIX_EPOCH + Duration::from_secs(seconds));
        Ok(Instance::new(
            self.name.clone(),
            names::provider_id(&self.host, &self.name),
            self.state,
            self.ip,
            created,
            self.facts.tags,
        ))
    }
}

/// Reads state, address and metadata of a domain (blocking; on the connection's thread).
fn observe(domain: &Domain, host: &str) -> Result<Observed, virt::error::Error> {
    let name = domain.get_name()?;
    let (state, _reason) = domain.get_state()?;
    let state = map_state(state);
    let ip = if state == InstanceState::Running { address(domain) } else { None };
    let facts = xml::domain_facts(&domain.get_xml_desc(0)?).unwrap_or_default();
    Ok(Observed { name, host: host.to_owned(), state, ip, facts })
}

/// libvirt's domain states as instance states.
pub fn map_state(state: virt::sys::virDomainState) -> InstanceState {
    match state {
        virt::sys::VIR_DOMAIN_RUNNING | virt::sys::VIR_DOMAIN_BLOCKED => InstanceState::Running,
        virt::sys::VIR_DOMAIN_PAUSED
        | virt::sys::VIR_DOMAIN_SHUTDOWN
        | virt::sys::VIR_DOMAIN_SHUTOFF
        | virt::sys::VIR_DOMAIN_PMSUSPENDED => InstanceState::Stopped,
        virt::sys::VIR_DOMAIN_CRASHED => InstanceState::Terminated,
        _ => InstanceState::Provisioning,
    }
}

/// The guest's address: from the guest agent, else the host's ARP table. The first global IPv4 address wins,
/// then the first global IPv6 one.
fn address(domain: &Domain) -> Option<IpAddr> {
    for source in [
        virt::sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT,
        virt::sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_ARP,
        virt::sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE,
    ] {
        let Ok(interfaces) = domain.interface_addresses(source, 0) else { continue };
        let addresses: Vec<IpAddr> = interfaces
            .iter()
            .flat_map(|interface| interface.addrs.iter())
            .filter_map(|address| address.addr.parse::<IpAddr>().ok())
            .filter(|ip| usable(*ip))
            .collect();
        if let Some(ip) = addresses.iter().find(|ip| ip.is_ipv4()).or_else(|| addresses.first()) {
            return Some(*ip);
        }
    }
    None
}

/// Not loopback, unspecified or link-local.
fn usable(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => !(v4.is_loopback() || v4.is_unspecified() || v4.is_link_local()),
        IpAddr::V6(v6) => !(v6.is_loopback() || v6.is_unspecified() || (v6.segments()[0] & 0xffc0) == 0xfe80),
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|elapsed| elapsed.as_secs()).unwrap_or_default()
}

#[async_trait]
impl Provider for KvmProvider {
    fn destination_policy(&self) -> Option<&DestinationPolicy> {
        Some(&self.destinations)
    }

    async fn create(&self, request: &CreateRequest) -> Result<Instance, ProviderError> {
        let host = self.host_for(request)?.clone();
        let (image_key, image) = self.image_for(request)?;
        let machine = self.machine_for(request)?;
        if !egress_provider::config::is_identifier(&request.name) {
            return Err(ProviderError::permanent(format!("{:?} cannot be a domain name", request.name)));
        }
        if let Some(existing) = self.read(&host, &request.name).await? {
            return Ok(existing);
        }
        tracing::debug!(host = %host.name, instance = %request.name, image = image_key, "creating a guest");

        let base = match self.images.ready_or_start(&host, image_key, image).await? {
            images::Readiness::Ready(path) => path,
            images::Readiness::Downloading { received, seconds } => {
                return Err(ProviderError::transient(format!(
                    "image {image_key} is being downloaded to host {} ({} MiB after {seconds} s); the guest is \
                     created once it is cached",
                    host.name,
                    received >> 20
                )));
            }
        };
        let seed = seed::image(
            request,
            self.config.vendor_data.as_deref(),
            &self.destinations.narrowed_by(&request.deny_destinations),
        )
        .map_err(|error| ProviderError::permanent("building the seed ISO").with_source(error))?;
        let capacity = u64::from(machine.disk_gib) << 30;
        let made = async {
            let overlay = names::overlay_volume(&request.name);
            let disk_path = images::create_overlay(&host, &overlay, &base, &image.format, capacity).await?;
            let seed_path = images::put_volume(&host, &names::seed_volume(&request.name), seed).await?;
            let domain_type = if host.is_test_driver() { "test" } else { self.config.domain_type.as_str() };
            let spec = DomainSpec {
                name: request.name.clone(),
                domain_type: domain_type.to_owned(),
                vcpus: machine.vcpus,
                memory_mib: machine.memory_mib,
                firmware: if image.firmware == "bios" { Firmware::Bios } else { Firmware::Uefi },
                disk_path,
                seed_path,
                bridge: host.bridge.clone(),
                tags: request.tags.clone(),
                port: request.port,
                created_unix: unix_now(),
            };
            let definition = xml::domain(&spec);
            host.call("domainDefineAndStart", &request.name, move |conn| {
                let domain = Domain::define_xml(conn, &definition)?;
                if let Err(error) = domain.create() {
                    let _ = domain.undefine_flags(undefine_flags());
                    return Err(error);
                }
                Ok(())
            })
            .await
        }
        .await;
        if let Err(error) = made {
            // Never leave a half-made guest: what this call created goes again, unless a domain exists after all
            // (a call that timed out may still have defined it), which owns the volumes now.
            match self.read(&host, &request.name).await {
                Ok(None) => {
                    if let Err(cleanup) = self.delete_volumes(&host, &request.name).await {
                        tracing::warn!(host = %host.name, instance = %request.name, error = %cleanup.chain(),
                            "removing the volumes of a failed create");
                    }
                }
                Ok(Some(_)) => {}
                Err(read) => tracing::warn!(host = %host.name, instance = %request.name, error = %read.chain(),
                    "a failed create's volumes are left until the domain's state is known"),
            }
            return Err(error);
        }
        // The guest runs; a failure to read it back now is for the next reconcile's get, never a reason to clean up.
        match self.read(&host, &request.name).await? {
            Some(instance) => Ok(instance),
            None => Err(ProviderError::transient(format!(
                "domain {} on host {} was started but is gone again",
                request.name, host.name
            ))),
        }
    }

    async fn get(&self, provider_id: &str) -> Result<Instance, ProviderError> {
        let (host_name, name) = names::parse_provider_id(provider_id)?;
        let host = self.host(host_name)?.clone();
        self.read(&host, name).await?.ok_or_else(|| ProviderError::not_found(format!("{provider_id} does not exist")))
    }

    async fn delete(&self, provider_id: &str) -> Result<(), ProviderError> {
        let (host_name, name) = names::parse_provider_id(provider_id)?;
        let Some(host) = self.hosts.get(host_name).cloned() else {
            tracing::debug!(provider_id, "delete on a host that is not configured: nothing to do");
            return Ok(());
        };
        let domain_name = name.to_owned();
        let outcome = host
            .call("domainDestroyUndefine", name, move |conn| {
                let domain = match Domain::lookup_by_name(conn, &domain_name) {
                    Ok(domain) => domain,
                    Err(error) if error.code() == ErrorNumber::NoDomain => return Ok(Removal::AlreadyGone),
                    Err(error) => return Err(error),
                };
                if !xml::domain_facts(&domain.get_xml_desc(0)?).unwrap_or_default().ours {
                    return Ok(Removal::Foreign);
                }
                if domain.is_active()? {
                    match domain.destroy() {
                        Ok(()) => {}
                        Err(error) if error.code() == ErrorNumber::OperationInvalid => {}
                        Err(error) => return Err(error),
                    }
                }
                match domain.undefine_flags(undefine_flags()) {
                    Ok(()) => Ok(Removal::Removed),
                    Err(error) if error.code() == ErrorNumber::NoDomain => Ok(Removal::AlreadyGone),
                    // Drivers without NVRAM support (the test driver) refuse the flag; nothing to remove there.
                    Err(error) if matches!(error.code(), ErrorNumber::InvalidArg | ErrorNumber::NoSupport) => {
                        domain.undefine().map(|()| Removal::Removed)
                    }
                    Err(error) => Err(error),
                }
            })
            .await?;
        if outcome == Removal::Foreign {
            return Err(ProviderError::permanent(format!(
                "domain {name} on host {host_name} was not made by egress-operator (no egress metadata); it is left \
                 alone"
            )));
        }
        self.delete_volumes(&host, name).await?;
        // The guest's overlay is gone, so an outdated base it used may be free now.
        self.collect_images(&host).await;
        Ok(())
    }

    async fn list_by_tag(&self, tags: &Tags) -> Result<Vec<Instance>, ProviderError> {
        let mut found = Vec::new();
        for host in self.hosts.values() {
            let (host_name, wanted) = (host.name.clone(), tags.clone());
            let observed = host
                .call("listAllDomains", "", move |conn: &Connect| {
                    let mut observed = Vec::new();
                    for domain in conn.list_all_domains(0)? {
                        // The metadata first: only matching domains cost a state and address query.
                        let matches = match domain.get_xml_desc(0) {
                            Ok(description) => xml::domain_facts(&description)
                                .is_ok_and(|facts| facts.ours && facts.tags.contains_all(&wanted)),
                            Err(error) if error.code() == ErrorNumber::NoDomain => false,
                            Err(error) => return Err(error),
                        };
                        if !matches {
                            continue;
                        }
                        match observe(&domain, &host_name) {
                            Ok(one) => observed.push(one),
                            // Gone between the list and the read.
                            Err(error) if error.code() == ErrorNumber::NoDomain => {}
                            Err(error) => return Err(error),
                        }
                    }
                    Ok(observed)
                })
                .await?;
            found.extend(observed.into_iter().filter_map(|one| one.into_instance().ok()));
        }
        Ok(found)
    }
}

/// What a delete found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Removal {
    Removed,
    AlreadyGone,
    /// A domain of that name without the provider's metadata: never touched.
    Foreign,
}

/// Undefine with the domain's NVRAM, managed save and snapshot metadata.
fn undefine_flags() -> virt::sys::virDomainUndefineFlagsValues {
    virt::sys::VIR_DOMAIN_UNDEFINE_NVRAM
        | virt::sys::VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
        | virt::sys::VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
}

#[async_trait]
impl Checker for KvmProvider {
    async fn check(&self) -> Vec<TargetVerdict> {
        let mut verdicts = Vec::new();
        for host in self.hosts.values() {
            let target = format!("hosts/{}", host.name);
            let pool = host.pool.clone();
            let answer = host
                .call("poolCheck", &pool.clone(), move |conn| {
                    conn.get_lib_version()?;
                    let pool = match StoragePool::lookup_by_name(conn, &pool) {
                        Ok(pool) => pool,
                        Err(error) if error.code() == ErrorNumber::NoStoragePool => return Ok(None),
                        Err(error) => return Err(error),
                    };
                    Ok(Some((pool.is_active()?, pool.get_info()?.available)))
                })
                .await;
            verdicts.push(match answer {
                Ok(Some((true, available))) if available > 0 => TargetVerdict::ready(target),
                Ok(Some((true, _))) => TargetVerdict::not_ready(
                    target,
                    "PoolFull",
                    format!("storage pool {} reports no free space", host.pool),
                ),
                Ok(Some((false, _))) => TargetVerdict::not_ready(
                    target,
                    "PoolInactive",
                    format!("storage pool {} exists but is not running (virsh pool-start {})", host.pool, host.pool),
                ),
                Ok(None) => TargetVerdict::not_ready(
                    target,
                    "PoolMissing",
                    format!("storage pool {} does not exist on the host", host.pool),
                ),
                Err(error) => TargetVerdict::not_ready(target, "Unreachable", error.chain()),
            });
        }
        verdicts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_map_like_the_design_says() {
        assert_eq!(map_state(virt::sys::VIR_DOMAIN_RUNNING), InstanceState::Running);
        assert_eq!(map_state(virt::sys::VIR_DOMAIN_SHUTOFF), InstanceState::Stopped);
        assert_eq!(map_state(virt::sys::VIR_DOMAIN_PAUSED), InstanceState::Stopped);
        assert_eq!(map_state(virt::sys::VIR_DOMAIN_CRASHED), InstanceState::Terminated);
        assert_eq!(map_state(virt::sys::VIR_DOMAIN_NOSTATE), InstanceState::Provisioning);
    }

    #[test]
    fn only_global_addresses_are_used() {
        for (ip, ok) in [
            ("10.0.0.5", true),
            ("127.0.0.1", false),
            ("169.254.1.1", false),
            ("fe80::1", false),
            ("2001:db8::5", true),
        ] {
            assert_eq!(usable(ip.parse().expect("ip")), ok, "{ip}");
        }
    }
}
