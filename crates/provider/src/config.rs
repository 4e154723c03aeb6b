//! The providers config file (`--providers-config`): a list of named provider instances, each with one
//! type-specific block.
//!
//! Parsing is strict and complete: the YAML is read into a plain tree first, then walked by hand, so that unknown
//! keys, type/block mismatches, duplicate names, missing fields and malformed identifiers are all reported in one
//! pass, each with its path (`providers[2].kvm.hosts[0].name: must match ...`). Serde's derive stops at the first
//! problem, which would make a user fix a file one mistake per restart.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::PathBuf;

use ipnet::IpNet;
use serde_json::{Map, Value};

use crate::destinations::{Denial, DestinationPolicy, DestinationRule};

mod walker;

use walker::Walker;

/// The pattern every name and key in the file must match: it keeps IDs, file names and label values parseable.
pub const IDENTIFIER_PATTERN: &str = "[a-z0-9]([a-z0-9-]*[a-z0-9])?";

/// The provider types this file knows.
pub const PROVIDER_TYPES: [&str; 3] = ["kubernetes", "gcp", "kvm"];

/// A parsed and validated providers file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProvidersConfig {
    /// The providers, in file order; names are unique.
    pub providers: Vec<ProviderConfig>,
}

/// One named provider instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProviderConfig {
    /// The name `Proxy.spec.provider` refers to.
    pub name: String,
    /// Where this provider's proxies may connect, beyond the defaults (`destinations: {allow, deny}`).
    pub destinations: DestinationPolicy,
    /// How long a site's ban cools its proxies down (`cooldown: {baseSeconds, factor, maxSeconds}`), where a Proxy
    /// sets nothing of its own.
    pub cooldown: CooldownSettings,
    /// The type-specific settings.
    pub settings: ProviderSettings,
}

/// A ban cooldown policy, any part of which may be left to the next level (a Proxy's `spec.cooldown`, then its
/// provider's, then the operator's 600 s, doubling, at most 86,400 s).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CooldownSettings {
    /// The cooldown after the first ban in a row, in seconds (1 to 86,400).
    pub base_seconds: Option<u32>,
    /// What each further ban in a row multiplies it by (1 to 10).
    pub factor: Option<u32>,
    /// The longest cooldown, in seconds (1 to 604,800).
    pub max_seconds: Option<u32>,
}

/// The settings block of one provider type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProviderSettings {
    /// Squid in Pods of this cluster.
    Kubernetes(KubernetesConfig),
    /// Compute Engine VMs.
    Gcp(GcpConfig),
    /// libvirt guests on hosts reached over SSH.
    Kvm(KvmConfig),
}

impl ProviderSettings {
    /// The `type` value this block belongs to.
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::Kubernetes(_) => "kubernetes",
            Self::Gcp(_) => "gcp",
            Self::Kvm(_) => "kvm",
        }
    }
}

/// `kubernetes:` — Squid in a Pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubernetesConfig {
    /// Namespace for pods whose Proxy gives no `placement.zone`. Default `egress-proxies`.
    pub namespace: String,
    /// Container image with Squid. Default `ubuntu/squid:latest`.
    pub image: String,
    /// `Always`, `IfNotPresent` or `Never`; unset leaves Kubernetes' default.
    pub image_pull_policy: Option<String>,
    /// The open-files limit Squid runs under (`ulimit -n`). Default 16384.
    pub fd_limit: u32,
    /// Requests and memory limit for pods whose Proxy gives no `placement.machineType`.
    pub resources: ResourceProfile,
    /// Named resource profiles `placement.machineType` may select.
    pub machine_types: BTreeMap<String, ResourceProfile>,
    /// The cluster's own pod and service networks, which its proxies may never reach (on top of the default
    /// denials, for clusters whose networks are not private ranges).
    pub cluster_networks: Vec<IpNet>,
    /// The only namespaces its pods may go in (`namespace` among them), when given: `placement.zone` must name one,
    /// and pods are listed in each of them rather than cluster-wide, so the operator needs no cluster-wide grant on
    /// pods, ConfigMaps or Secrets (`deploy/namespaced`). Empty: any namespace, listed cluster-wide.
    pub namespaces: Vec<String>,
}

/// A pod resource profile: CPU request, and memory as both request and limit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceProfile {
    /// CPU request, a Kubernetes quantity (`50m`, `1`).
    pub cpu: String,
    /// Memory request and limit, a Kubernetes quantity (`128Mi`).
    pub memory: String,
}

/// `gcp:` — Compute Engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GcpConfig {
    /// The project instances are created in.
    pub project: String,
    /// The VPC network. Default `default`.
    pub network: String,
    /// The subnetwork, when the network is in custom mode.
    pub subnetwork: Option<String>,
    /// The zone for Proxies that give no `placement.zone`.
    pub default_zone: Option<String>,
    /// The machine type for Proxies that give no `placement.machineType`. Default `e2-micro`.
    pub default_machine_type: String,
    /// The image for Proxies that give no `placement.image`; it must run cloud-init.
    pub default_image: String,
    /// The network tag the user's firewall rule opens the proxy port for. Default `egress-proxy`.
    pub firewall_tag: String,
    /// A service-account key file; unset uses Application Default Credentials.
    pub credentials_file: Option<PathBuf>,
    /// The Compute Engine endpoint; unset uses Google's. For private endpoints and tests.
    pub endpoint: Option<String>,
    /// `wireLogging: true` turns on the SDK's own request tracing (whole requests and responses, at debug), which
    /// the operator logs through a redacting layer: records about auth or tokens dropped, fields over 1 KiB and any
    /// value holding user data elided. Default false.
    pub wire_logging: bool,
}

/// `kvm:` — libvirt guests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvmConfig {
    /// How to reach the hosts.
    pub ssh: KvmSsh,
    /// The hosts; `placement.zone` names one.
    pub hosts: Vec<KvmHost>,
    /// Images by key; `placement.image` names one.
    pub images: BTreeMap<String, KvmImage>,
    /// Machine profiles by key; `placement.machineType` names one.
    pub machine_types: BTreeMap<String, KvmMachineType>,
    /// The host for Proxies that give no `placement.zone`; default the first host.
    pub default_host: Option<String>,
    /// The image for Proxies that give no `placement.image`; default the only image when there is one.
    pub default_image: Option<String>,
    /// The machine profile for Proxies that give no `placement.machineType`.
    pub default_machine_type: Option<String>,
    /// cloud-init vendor-data to add beside the provider's own (which installs qemu-guest-agent); any format
    /// cloud-init accepts as a MIME part (a script, a cloud-config).
    pub vendor_data: Option<String>,
    /// The libvirt domain type: `kvm` (default) or `qemu` (emulation, for hosts without hardware virtualisation).
    pub domain_type: String,
}

/// SSH settings shared by all hosts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvmSsh {
    /// The default user. Default `root`.
    pub user: String,
    /// The private key file (for example a mounted Secret); read lazily, so it may appear after start.
    pub private_key_file: PathBuf,
    /// The known_hosts file; no host key is ever accepted unchecked.
    pub known_hosts_file: PathBuf,
}

/// One KVM host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvmHost {
    /// The key `placement.zone` uses.
    pub name: String,
    /// Host name or IP address for SSH (`localhost` when `uri` is set and this is not).
    pub address: String,
    /// SSH port. Default 22.
    pub port: u16,
    /// SSH user; default `ssh.user`.
    pub user: Option<String>,
    /// The libvirt storage pool for images and disks. Default `default`.
    pub pool: String,
    /// The bridge guests attach to. Default `br0`.
    pub bridge: String,
    /// The libvirt daemon's socket on the host, when not the system default (`socket=` in the URI).
    pub socket: Option<String>,
    /// A libvirt URI used instead of SSH: `qemu:///system` when the operator runs on the host itself, or
    /// `test:///default` for tests. `address`, `port`, `user` and the ssh settings are then unused.
    pub uri: Option<String>,
}

/// A cached guest image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvmImage {
    /// Where to download it (http or https).
    pub url: String,
    /// Its SHA-256, 64 lowercase hex characters; a mismatch fails the download.
    pub sha256: String,
    /// `qcow2` (default) or `raw`.
    pub format: String,
    /// `uefi` (default) or `bios`.
    pub firmware: String,
}

/// A guest size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvmMachineType {
    /// Virtual CPUs.
    pub vcpus: u32,
    /// Memory in MiB.
    pub memory_mib: u32,
    /// Root disk size in GiB.
    pub disk_gib: u32,
}

/// One problem in the file, with the path to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Where: `providers[2].kvm.hosts[0].name`, or the empty string for the whole file.
    pub path: String,
    /// What is wrong and, where it helps, what is expected.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() { f.write_str(&self.message) } else { write!(f, "{}: {}", self.path, self.message) }
    }
}

/// Every problem found in a providers file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// Where the file came from, for the message (a path, or `<input>`).
    pub source_name: String,
    /// Every problem, in file order.
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let count = self.problems.len();
        write!(f, "{} has {count} problem{}:", self.source_name, if count == 1 { "" } else { "s" })?;
        for problem in &self.problems {
            write!(f, "\n  - {problem}")?;
        }
        Ok(())
    }
}

impl ProviderConfig {
    /// Networks this provider's proxies may never reach besides the default denials (a cluster's own).
    pub fn provider_networks(&self) -> &[IpNet] {
        match &self.settings {
            ProviderSettings::Kubernetes(settings) => &settings.cluster_networks,
            ProviderSettings::Gcp(_) | ProviderSettings::Kvm(_) => &[],
        }
    }

    /// Why this provider's proxies would refuse a request to `host`:`port` (a CONNECT tunnel when `connect`), when
    /// that is known without DNS (an IP literal or `localhost`); `None` when it is allowed or only DNS can tell.
    pub fn denies(&self, host: &str, port: u16, connect: bool) -> Option<Denial> {
        self.destinations.check_host(host, port, connect, self.provider_networks())
    }
}

impl ProvidersConfig {
    /// Parses and validates a providers file; `source_name` names it in the error (usually its path).
    pub fn parse(text: &str, source_name: &str) -> Result<Self, ConfigError> {
        let fail = |problems| ConfigError { source_name: source_name.to_owned(), problems };
        let tree: Value = match serde_saphyr::from_str(text) {
            Ok(tree) => tree,
            Err(error) => {
                return Err(fail(vec![Problem { path: String::new(), message: format!("not valid YAML: {error}") }]));
            }
        };
        let mut walker = Walker::default();
        let config = walker.file(&tree);
        match config {
            Some(config) if walker.problems.is_empty() => Ok(config),
            _ => Err(fail(walker.problems)),
        }
    }

    /// The provider with this name.
    pub fn get(&self, name: &str) -> Option<&ProviderConfig> {
        self.providers.iter().find(|provider| provider.name == name)
    }
}

/// Whether `value` matches [`IDENTIFIER_PATTERN`] and fits a DNS label (63 characters).
pub fn is_identifier(value: &str) -> bool {
    let bytes = value.as_bytes();
    let allowed = |byte: &u8| byte.is_ascii_lowercase() || byte.is_ascii_digit();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes.first().is_some_and(allowed)
        && bytes.last().is_some_and(allowed)
        && bytes.iter().all(|byte| allowed(byte) || *byte == b'-')
}

#[cfg(test)]
mod tests;
