//! The Proxy's status: phase, instances, endpoint, health, cooldowns, failure.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Endpoint;

/// The observed state of a proxy, written by the operator.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyStatus {
    /// Where the proxy is in its life cycle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<ProxyPhase>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The current instance (Managed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<InstanceStatus>,
    /// The instance being replaced, while a replacement is in progress (make-before-break).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_instance: Option<InstanceStatus>,
    /// Where crawlers connect: the instance's address and port (Managed) or `spec.endpoint` (External).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<EndpointStatus>,
    /// The address the probe target saw, when the probe URL echoes it.
    #[serde(rename = "egressIP", default, skip_serializing_if = "Option::is_none")]
    pub egress_ip: Option<String>,
    /// The country of `egressIP` (ISO 3166-1 alpha-2, upper case), when the operator has a GeoIP database
    /// (`--geoip-database`) that knows it; also the label `crawl.example.com/egress-country`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_country: Option<String>,
    /// The autonomous system number of `egressIP`, when the operator has a GeoIP database with AS numbers; also the
    /// label `crawl.example.com/egress-asn`.
    #[serde(rename = "egressASN", default, skip_serializing_if = "Option::is_none")]
    pub egress_asn: Option<u32>,
    /// The health engine's verdict; written only when it flips.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthStatus>,
    /// Set when a permanent error latched the object; cleared by a spec change or the `retry` annotation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<FailureStatus>,
    /// How many times `maxAge` has replaced the instance; part of the desired spec hash, so raising it starts a
    /// replacement that survives an operator restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_age_rotations: Option<u32>,
    /// How many times self-healing has replaced a dead instance (`healthCheck.replaceAfterSeconds`); part of the
    /// desired spec hash like `maxAgeRotations`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replacements: Option<u32>,
    /// `Ready`, `Provisioned` and `Healthy`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The sites that banned this proxy and for how long it is not leased for them, kept so a restart or a new
    /// leader keeps every cooldown. Written by the discovery API under its own field manager
    /// (`egress-operator-cooldowns`), never by the reconciler; at most 64, the latest-ending first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub cooldowns: Vec<CooldownStatus>,
}

/// A proxy's cooldown for one target (site).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CooldownStatus {
    /// The target, as leases and the discovery API name it (a site's registrable domain by default).
    #[serde(default)]
    #[schemars(length(max = 2048))]
    pub target: String,
    /// Deprecated: the name `target` had before; read from statuses older operators wrote, never written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 2048))]
    pub site: Option<String>,
    /// When the proxy may be leased for the site again.
    pub until: Time,
    /// How many bans in a row led to this cooldown; the next one in a row doubles it.
    pub streak: u32,
    /// The tenants whose reports made it: their further reports change nothing while it runs, and only they (and
    /// admins) see it in the discovery API.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), inner(length(max = 63)))]
    pub tenants: Vec<String>,
}

impl CooldownStatus {
    /// The target: `target`, or the deprecated `site` of a status an older operator wrote.
    pub fn target(&self) -> &str {
        if self.target.is_empty() { self.site.as_deref().unwrap_or_default() } else { &self.target }
    }
}

/// The life-cycle phase of a proxy.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum ProxyPhase {
    /// Accepted, nothing created yet (or waiting for quota).
    Pending,
    /// The instance is being created.
    Provisioning,
    /// The instance runs and has an address; not yet proven healthy.
    Running,
    /// Healthy and handed out to crawlers.
    Ready,
    /// Probes fail; not handed out.
    Unhealthy,
    /// A new instance is being made before the old one is deleted.
    Replacing,
    /// The object is being deleted and its instances cleaned up.
    Deleting,
    /// A permanent error latched the object; see `status.failure`.
    Failed,
}

/// The provider's view of an instance's state, as recorded in status.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum InstanceState {
    /// Being created or booting; no address yet.
    Provisioning,
    /// Running with an address.
    Running,
    /// Stopped but still defined.
    Stopped,
    /// Gone or going (preempted, failed, deleted).
    Terminated,
}

/// One provider instance.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstanceStatus {
    /// The instance name (`px-` and 16 base32 characters).
    pub name: String,
    /// The provider's self-contained identifier of the instance.
    #[serde(rename = "providerID")]
    pub provider_id: String,
    /// The last observed state.
    pub state: InstanceState,
    /// The instance's address, once it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<String>,
    /// The spec hash the instance was created for (with the provider's fingerprint mixed in, when it had one).
    pub spec_hash: String,
    /// The provider's instance fingerprint (a digest of its destination policy) the instance was created with;
    /// absent when the provider had none (the default policy). A provider whose policy changes rolls its proxies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_fingerprint: Option<String>,
    /// When the provider created the instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<Time>,
    /// On `previousInstance` only: when the endpoint switched away from it. It is kept until no lease is on it any
    /// more (every holder renewed onto the new instance, released, or let its lease expire) or the operator's drain
    /// timeout has passed since this time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draining_since: Option<Time>,
}

/// The published endpoint.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct EndpointStatus {
    /// Host name or IP address.
    pub host: String,
    /// TCP port.
    pub port: i32,
    /// `host:port`, for display (IPv6 in brackets).
    pub address: String,
}

impl From<&Endpoint> for EndpointStatus {
    fn from(endpoint: &Endpoint) -> Self {
        Self { host: endpoint.host.clone(), port: endpoint.port, address: endpoint.address() }
    }
}

impl From<&EndpointStatus> for Endpoint {
    fn from(status: &EndpointStatus) -> Self {
        Self { host: status.host.clone(), port: status.port }
    }
}

/// The health engine's verdict.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HealthStatus {
    /// Whether probes get through.
    pub healthy: bool,
    /// When `healthy` last flipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
    /// Why the last failing probe failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// A latched permanent failure.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailureStatus {
    /// A stable, machine-readable reason.
    pub reason: String,
    /// What went wrong, for a human.
    pub message: String,
    /// When the failure latched.
    pub since: Time,
    /// The `crawl.example.com/retry` annotation's value when the failure latched; changing it clears the latch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_token: Option<String>,
}
