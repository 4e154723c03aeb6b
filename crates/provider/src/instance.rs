//! The values the provider contract speaks in: instances, their state, create requests, and the tags that carry the
//! garbage-collection contract.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::SystemTime;

use crate::destinations::DestinationRule;

/// The life-cycle state of an instance, as the provider sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InstanceState {
    /// Being created or booting; no usable address yet.
    Provisioning,
    /// Running with an address.
    Running,
    /// Stopped but still defined.
    Stopped,
    /// Gone or going: preempted, failed, being deleted.
    Terminated,
}

impl InstanceState {
    /// A stable short string for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Provisioning => "Provisioning",
            Self::Running => "Running",
            Self::Stopped => "Stopped",
            Self::Terminated => "Terminated",
        }
    }
}

/// One instance of a provider.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instance {
    /// The instance name (`px-` and 16 base32 characters), unique per provider.
    pub name: String,
    /// The provider's self-contained identifier: it alone locates the instance.
    pub provider_id: String,
    /// The current state; see [`Instance::new`] for the one rule every provider shares.
    pub state: InstanceState,
    /// The address crawlers and probes connect to.
    pub ip: Option<IpAddr>,
    /// When the provider created it.
    pub created_at: Option<SystemTime>,
    /// The tags it carries (the GC contract among them).
    pub tags: Tags,
}

impl Instance {
    /// Builds an instance, reporting a `Running` instance without an address as `Provisioning`, so that an empty
    /// address is never published.
    pub fn new(
        name: impl Into<String>,
        provider_id: impl Into<String>,
        state: InstanceState,
        ip: Option<IpAddr>,
        created_at: Option<SystemTime>,
        tags: Tags,
    ) -> Self {
        let state = if state == InstanceState::Running && ip.is_none() { InstanceState::Provisioning } else { state };
        Self { name: name.into(), provider_id: provider_id.into(), state, ip, created_at, tags }
    }
}

pub use egress_fleet::{ProxyCredentials, Sensitive};

/// Everything a provider needs to create one instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreateRequest {
    /// The instance name, from [`crate::instance_name`]; creating the same name twice yields one instance.
    pub name: String,
    /// Provider-specific placement: a GCE zone, a KVM host key, a namespace; `None` takes the provider's default.
    pub zone: Option<String>,
    /// Machine type or resource profile; `None` takes the provider's default.
    pub machine_type: Option<String>,
    /// Image; `None` takes the provider's default.
    pub image: Option<String>,
    /// Cloud-init user data, byte for byte as the user gave it. It may hold secrets.
    pub cloud_init: Option<Sensitive<Vec<u8>>>,
    /// The port Squid listens on.
    pub port: u16,
    /// Credentials Squid requires, if any.
    pub credentials: Option<ProxyCredentials>,
    /// Tags to put on the instance (the GC contract at least).
    pub tags: Tags,
    /// Destinations the Proxy denies on top of the provider's destination policy (a Proxy can only narrow it).
    pub deny_destinations: Vec<DestinationRule>,
}

impl CreateRequest {
    /// A request for instance `name` listening on `port` with `tags`, and every placement, cloud-init and
    /// credential left to the provider's defaults (set the public fields to change them).
    pub fn new(name: impl Into<String>, port: u16, tags: Tags) -> Self {
        Self {
            name: name.into(),
            zone: None,
            machine_type: None,
            image: None,
            cloud_init: None,
            port,
            credentials: None,
            tags,
            deny_destinations: Vec::new(),
        }
    }
}

/// String tags on an instance. The GC contract keys say who owns it; backends map them onto labels, metadata or
/// whatever the platform offers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tags(BTreeMap<String, String>);

impl Tags {
    /// Set to [`Tags::MANAGED_BY_VALUE`] on everything the operator creates.
    pub const MANAGED_BY: &'static str = "managed-by";
    /// The operator's `--cluster-id`, so two clusters sharing a project never collect each other's instances.
    pub const CLUSTER: &'static str = "cluster";
    /// The UID of the Proxy that owns the instance.
    pub const PROXY_UID: &'static str = "proxy-uid";
    /// The spec hash the instance was created for.
    pub const SPEC_HASH: &'static str = "spec-hash";
    /// The value of [`Tags::MANAGED_BY`].
    pub const MANAGED_BY_VALUE: &'static str = "egress-operator";

    /// No tags.
    pub fn new() -> Self {
        Self::default()
    }

    /// The tags that select every instance this operator installation owns: managed-by and cluster.
    pub fn owned_by_cluster(cluster: &str) -> Self {
        Self::new().with(Self::MANAGED_BY, Self::MANAGED_BY_VALUE).with(Self::CLUSTER, cluster)
    }

    /// The full GC contract for one instance.
    pub fn gc_contract(cluster: &str, proxy_uid: &str, spec_hash: &str) -> Self {
        Self::owned_by_cluster(cluster).with(Self::PROXY_UID, proxy_uid).with(Self::SPEC_HASH, spec_hash)
    }

    /// Adds or replaces one tag.
    pub fn with(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.0.insert(key.into(), value.into());
        self
    }

    /// Adds or replaces one tag in place.
    pub fn insert(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.0.insert(key.into(), value.into());
    }

    /// The value of one tag.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// Whether every tag in `required` is present here with the same value.
    pub fn contains_all(&self, required: &Tags) -> bool {
        required.0.iter().all(|(key, value)| self.0.get(key) == Some(value))
    }

    /// The tags in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(key, value)| (key.as_str(), value.as_str()))
    }

    /// Whether there are no tags.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for Tags {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Self(iter.into_iter().map(|(key, value)| (key.into(), value.into())).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_without_an_address_is_provisioning() {
        let cases = [
            (InstanceState::Running, None, InstanceState::Provisioning),
            (InstanceState::Running, Some("10.0.0.1"), InstanceState::Running),
            (InstanceState::Provisioning, Some("10.0.0.1"), InstanceState::Provisioning),
            (InstanceState::Terminated, None, InstanceState::Terminated),
            (InstanceState::Stopped, None, InstanceState::Stopped),
        ];
        for (state, ip, expected) in cases {
            let ip = ip.map(|ip| ip.parse().expect("an IP"));
            assert_eq!(
                Instance::new("px-a", "ns/px-a", state, ip, None, Tags::new()).state,
                expected,
                "{state:?} {ip:?}"
            );
        }
    }

    #[test]
    fn secrets_do_not_show_in_debug_output() {
        let request = CreateRequest {
            cloud_init: Some(Sensitive::new(b"#cloud-config\npassword: hunter2\n".to_vec())),
            credentials: Some(ProxyCredentials {
                username: "crawler".into(),
                password: Sensitive::new("s3cret".into()),
            }),
            ..CreateRequest::new("px-a", 3128, Tags::new())
        };
        let shown = format!("{request:?}");
        assert!(!shown.contains("hunter2") && !shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("crawler"), "the user name is not secret: {shown}");
    }

    #[test]
    fn tag_selection_needs_every_required_tag() {
        let tags = Tags::gc_contract("prod", "uid-1", "abc");
        assert!(tags.contains_all(&Tags::owned_by_cluster("prod")));
        assert!(!tags.contains_all(&Tags::owned_by_cluster("staging")));
        assert!(tags.contains_all(&Tags::new()));
        assert!(!Tags::new().contains_all(&Tags::owned_by_cluster("prod")));
        assert_eq!(tags.get(Tags::SPEC_HASH), Some("abc"));
    }
}
