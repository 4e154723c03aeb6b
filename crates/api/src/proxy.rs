//! The `Proxy` custom resource: its spec with defaults, bounds and CEL rules, its status, and its helpers.
//!
//! Every rule a user can break is enforced by the apiserver (schema bounds and the CEL rules below), so an invalid
//! object never reaches the operator; the helpers still clamp values, so a Proxy built in Rust without going
//! through the apiserver cannot make them misbehave.

use std::time::Duration as StdDuration;

use kube::core::Duration;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

mod status;

pub use status::{
    CooldownStatus, EndpointStatus, FailureStatus, HealthStatus, InstanceState, InstanceStatus, ProxyPhase, ProxyStatus,
};

/// The Squid port when `spec.port` is not given.
pub const DEFAULT_PORT: i32 = 3128;
/// The lease cap per proxy when `spec.maxLeases` is not given.
pub const DEFAULT_MAX_LEASES: i32 = 5;
/// Seconds between probes when `healthCheck.intervalSeconds` is not given.
pub const DEFAULT_INTERVAL_SECONDS: i32 = 30;
/// Seconds a probe may take when `healthCheck.timeoutSeconds` is not given.
pub const DEFAULT_TIMEOUT_SECONDS: i32 = 10;
/// Consecutive successes to become healthy when `healthCheck.healthyThreshold` is not given.
pub const DEFAULT_HEALTHY_THRESHOLD: i32 = 2;
/// Consecutive failures to become unhealthy when `healthCheck.unhealthyThreshold` is not given.
pub const DEFAULT_UNHEALTHY_THRESHOLD: i32 = 3;
/// Seconds a Managed instance may stay dead (probes cannot reach or get an answer from it) before it is replaced.
pub const DEFAULT_REPLACE_AFTER_SECONDS: i32 = 300;
/// The smallest probe interval the schema accepts.
pub const MIN_INTERVAL_SECONDS: i32 = 5;

/// The condition that says the proxy can be handed out.
pub const CONDITION_READY: &str = "Ready";
/// The condition that says the instance exists and has an address.
pub const CONDITION_PROVISIONED: &str = "Provisioned";
/// The condition that follows the health engine's verdict.
pub const CONDITION_HEALTHY: &str = "Healthy";

/// The desired state of one HTTP forward proxy.
// Each `printcolumn(...)` repeats keys such as `type_ = "string"`, which clippy mistakes for a duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "crawl.example.com",
    version = "v1alpha1",
    kind = "Proxy",
    plural = "proxies",
    namespaced,
    shortname = "px",
    category = "egress",
    status = "ProxyStatus",
    doc = "An HTTP forward proxy that egress-operator runs (Managed) or adopts (External), health-checks and hands out to crawlers.",
    printcolumn(name = "Mode", type_ = "string", json_path = ".spec.mode", description = "Managed or External"),
    printcolumn(
        name = "Provider",
        type_ = "string",
        json_path = ".spec.provider",
        description = "The configured provider that runs the instance"
    ),
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        description = "Where the proxy is in its life cycle"
    ),
    printcolumn(
        name = "Endpoint",
        type_ = "string",
        json_path = ".status.endpoint.address",
        description = "host:port crawlers connect to"
    ),
    printcolumn(
        name = "Healthy",
        type_ = "boolean",
        json_path = ".status.health.healthy",
        description = "The health engine's verdict"
    ),
    printcolumn(
        name = "Country",
        type_ = "string",
        json_path = ".status.egressCountry",
        description = "Where the GeoIP database places the egress address",
        priority = 1
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = without_nullable)]
#[x_kube(
    validation = Rule::new("has(self.provider) == has(oldSelf.provider) && (!has(self.provider) || self.provider == oldSelf.provider)")
        .message("spec.provider is immutable (setting or removing it counts as a change): create a new Proxy to move to another provider")
        .field_path(".provider"),
    validation = Rule::new("self.mode != 'Managed' || has(self.provider)")
        .message("spec.provider is required when spec.mode is Managed: name one of the providers in the operator's providers config")
        .field_path(".provider")
        .reason(kube::core::Reason::FieldValueRequired),
    validation = Rule::new("self.mode != 'External' || has(self.endpoint)")
        .message("spec.endpoint is required when spec.mode is External: give the host and port of the existing proxy")
        .field_path(".endpoint")
        .reason(kube::core::Reason::FieldValueRequired),
    validation = Rule::new("self.mode != 'External' || !(has(self.provider) || has(self.placement) || has(self.cloudInit) || has(self.destinations))")
        .message("spec.provider, spec.placement, spec.cloudInit and spec.destinations must not be set when spec.mode is External: the operator does not create an External proxy")
        .reason(kube::core::Reason::FieldValueForbidden),
    validation = Rule::new("self.mode != 'Managed' || !has(self.endpoint)")
        .message("spec.endpoint must not be set when spec.mode is Managed: the operator publishes the instance's address in status.endpoint")
        .field_path(".endpoint")
        .reason(kube::core::Reason::FieldValueForbidden),
)]
pub struct ProxySpec {
    /// `Managed`: the operator creates the instance on `provider`. `External`: the proxy exists at `endpoint`.
    /// Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.mode is immutable: create a new Proxy to change it"))]
    pub mode: ProxyMode,

    /// Name of a provider instance in the operator's providers config. Required when Managed, forbidden when
    /// External; immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub provider: Option<String>,

    /// Where and on what the instance runs; each field falls back to the provider's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,

    /// Cloud-init user data for VM providers, inline or from a Secret. It may hold secrets and is never logged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init: Option<CloudInit>,

    /// External only: where the existing proxy is reachable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<Endpoint>,

    /// Managed only: the port Squid listens on.
    #[serde(default = "default_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,

    /// Proxy credentials: Squid requires them, and the discovery API hands them to clients with the `lease` scope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<ProxyAuth>,

    /// How the health engine probes this proxy.
    #[serde(default)]
    pub health_check: HealthCheck,

    /// At most this many concurrent leases on this proxy; a session's leases for one site count once (each gateway
    /// replica serving it holds one). 0 means never lease it (drain). Defaults to 5.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 100000), extend("default" = DEFAULT_MAX_LEASES))]
    pub max_leases: Option<i32>,

    /// Replace the instance (so it gets a new IP) once it is older than this, for example `90m` or `24h`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // The pattern's own message covers a malformed value; the rule then holds, so CEL never parses it.
    #[x_kube(validation = Rule::new("!self.matches('^([0-9]+(\\\\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$') || duration(self) > duration('0s')").message("spec.maxAge must be a positive duration such as 90m or 24h"))]
    #[schemars(regex(pattern = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"))]
    pub max_age: Option<Duration>,

    /// Managed only: destinations this proxy refuses on top of its provider's destination policy. A Proxy can only
    /// narrow the policy; widening it is for whoever writes the operator's providers file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destinations: Option<ProxyDestinations>,

    /// How long a site's ban keeps this proxy from being leased for that site. Fields left unset come from the
    /// provider's `cooldown` in the providers file, then the operator's default (600 s, doubling, at most a day).
    /// Changing it replaces nothing: it applies to the next ban.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cooldown: Option<CooldownSpec>,

    /// How often this proxy's egress address is leased for one site, across every replica: `burst` leases at once,
    /// then one per `intervalMilliseconds`. A lease (and so a gateway request) for a site whose slot is not free yet
    /// goes through another proxy, or waits for the slot (a session, whose proxy it is). Proxies leaving through one
    /// address share its pace. Unset: as often as `maxLeases` allows. Changing it replaces nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pacing: Option<PacingSpec>,
}

/// A pace per (egress address, site): `burst` leases at once, then one per `intervalMilliseconds`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PacingSpec {
    /// The time between two leases for one site once the burst is spent, in milliseconds (Zyte's default is
    /// 12,000 per address).
    #[schemars(range(min = 1, max = 86400000))]
    pub interval_milliseconds: u32,
    /// How many leases may go at once after a quiet spell (default 1: every lease `intervalMilliseconds` apart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub burst: Option<u32>,
}

/// A ban cooldown policy: `baseSeconds` after the first ban in a row, multiplied by `factor` for each further one
/// (1 keeps it flat), never more than `maxSeconds`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.baseSeconds) || !has(self.maxSeconds) || self.maxSeconds >= self.baseSeconds")
    .message("cooldown.maxSeconds must be at least cooldown.baseSeconds")
    .field_path(".maxSeconds"))]
pub struct CooldownSpec {
    /// The cooldown after the first ban in a row, in seconds (default 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 86400))]
    pub base_seconds: Option<u32>,
    /// What each further ban in a row multiplies the cooldown by (default 2; 1 keeps it flat).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10))]
    pub factor: Option<u32>,
    /// The longest cooldown, in seconds (default 86,400).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 604800))]
    pub max_seconds: Option<u32>,
}

/// A Proxy's additions to its provider's destination policy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyDestinations {
    /// Rules denied on top of the provider's policy: `CIDR`, an address, `CIDR:PORT`, `CIDR:PORT-PORT`,
    /// `[IPv6 CIDR]:PORT` or `*:PORT`. A malformed rule fails the Proxy with a message naming it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 64)))]
    pub deny: Vec<String>,
}

/// Makes every `Option` field inside a schema non-nullable.
///
/// schemars describes an `Option` as "the type, or null", which kube turns into `nullable: true`, and the apiserver
/// then stores an explicit `null` that CEL's `has()` counts as set: `provider: null` would satisfy "Managed requires
/// provider". Without `nullable`, the apiserver drops nulls before defaulting and validation, so in the spec `null`
/// always means absent.
pub(crate) fn without_nullable(schema: &mut schemars::Schema) {
    fn walk(value: &mut serde_json::Value) {
        match value {
            serde_json::Value::Object(map) => {
                map.remove("nullable");
                if let Some(serde_json::Value::Array(types)) = map.get_mut("type") {
                    types.retain(|kind| kind != "null");
                    if types.len() == 1 {
                        let only = types.remove(0);
                        map.insert("type".into(), only);
                    }
                }
                for key in ["anyOf", "oneOf"] {
                    if let Some(serde_json::Value::Array(variants)) = map.get_mut(key) {
                        variants.retain(|variant| variant.get("type").is_none_or(|kind| kind != "null"));
                    }
                }
                map.values_mut().for_each(walk);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    if let Some(object) = schema.as_object_mut() {
        object.values_mut().for_each(walk);
    }
}

fn default_port() -> i32 {
    DEFAULT_PORT
}

/// Whether the operator runs the proxy or adopts one that exists elsewhere.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ProxyMode {
    /// The operator creates the instance on a provider and deletes it with the object.
    Managed,
    /// The proxy exists elsewhere; the operator only health-checks it and hands it out.
    External,
}

/// Provider-specific placement of a Managed instance.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    /// GCE zone, KVM host key, or namespace for the kubernetes provider.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub zone: Option<String>,
    /// GCE machine type, KVM machine profile key, or pod resource profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub machine_type: Option<String>,
    /// GCE image, KVM image key or URL, or container image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub image: Option<String>,
}

/// Cloud-init user data: exactly one of `inline` and `secretRef`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.inline) != has(self.secretRef)")
    .message("spec.cloudInit needs exactly one of inline and secretRef"))]
pub struct CloudInit {
    /// The user data itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub inline: Option<String>,
    /// A key of a Secret in the Proxy's namespace that holds the user data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretKeyRef>,
}

/// A key of a Secret in the referring object's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct SecretKeyRef {
    /// The Secret's name.
    #[schemars(length(min = 1))]
    pub name: String,
    /// The key within the Secret's data.
    #[schemars(length(min = 1))]
    pub key: String,
}

/// A Secret in the referring object's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct SecretNameRef {
    /// The Secret's name.
    #[schemars(length(min = 1))]
    pub name: String,
}

/// Proxy credentials.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyAuth {
    /// A Secret with the keys `username` and `password`.
    pub secret_ref: SecretNameRef,
}

/// Where a proxy is reachable.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub struct Endpoint {
    /// Host name or IP address.
    #[schemars(length(min = 1, max = 253))]
    pub host: String,
    /// TCP port.
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
}

impl Endpoint {
    /// `host:port`, with an IPv6 address in brackets so the result parses as a socket address or URL authority.
    pub fn address(&self) -> String {
        if self.host.contains(':') && !self.host.starts_with('[') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// How the health engine probes a proxy. Every field has a default, so `healthCheck: {}` is complete.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.timeoutSeconds < self.intervalSeconds")
    .message("spec.healthCheck.timeoutSeconds must be less than spec.healthCheck.intervalSeconds (unset, they are 10 and 30)")
    .field_path(".timeoutSeconds"))]
pub struct HealthCheck {
    /// Seconds between probes.
    #[serde(default = "default_interval_seconds")]
    #[schemars(range(min = 5, max = 86400))]
    pub interval_seconds: i32,
    /// Seconds a probe may take; less than `intervalSeconds`.
    #[serde(default = "default_timeout_seconds")]
    #[schemars(range(min = 1, max = 3600))]
    pub timeout_seconds: i32,
    /// Consecutive successes before an unhealthy proxy becomes healthy.
    #[serde(default = "default_healthy_threshold")]
    #[schemars(range(min = 1, max = 1000))]
    pub healthy_threshold: i32,
    /// Consecutive failures before a healthy proxy becomes unhealthy.
    #[serde(default = "default_unhealthy_threshold")]
    #[schemars(range(min = 1, max = 1000))]
    pub unhealthy_threshold: i32,
    /// The http:// or https:// URL fetched through the proxy; defaults to the operator's `--default-probe-url`.
    #[serde(rename = "probeURL", default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^https?://[^\s/?#]+([/?#]\S*)?$"), length(max = 2048))]
    pub probe_url: Option<String>,
    /// Managed only: seconds the instance may stay dead (probes time out, or cannot connect or get an answer)
    /// before it is replaced, make-before-break; 0 never replaces it. A replacement that is itself dead waits
    /// twice as long each time (at most 16 times), so a proxy that cannot work does not churn instances.
    #[serde(default = "default_replace_after_seconds")]
    #[schemars(range(min = 0, max = 86400))]
    pub replace_after_seconds: i32,
}

fn default_replace_after_seconds() -> i32 {
    DEFAULT_REPLACE_AFTER_SECONDS
}

fn default_interval_seconds() -> i32 {
    DEFAULT_INTERVAL_SECONDS
}
fn default_timeout_seconds() -> i32 {
    DEFAULT_TIMEOUT_SECONDS
}
fn default_healthy_threshold() -> i32 {
    DEFAULT_HEALTHY_THRESHOLD
}
fn default_unhealthy_threshold() -> i32 {
    DEFAULT_UNHEALTHY_THRESHOLD
}

impl HealthCheck {
    /// The default check, probing every `interval_seconds` with a `timeout_seconds` limit, healthy after
    /// `healthy_threshold` good probes and unhealthy after `unhealthy_threshold` bad ones.
    pub fn every(
        interval_seconds: i32,
        timeout_seconds: i32,
        healthy_threshold: i32,
        unhealthy_threshold: i32,
    ) -> Self {
        Self { interval_seconds, timeout_seconds, healthy_threshold, unhealthy_threshold, ..Self::default() }
    }
}

impl Default for HealthCheck {
    fn default() -> Self {
        Self {
            interval_seconds: DEFAULT_INTERVAL_SECONDS,
            timeout_seconds: DEFAULT_TIMEOUT_SECONDS,
            healthy_threshold: DEFAULT_HEALTHY_THRESHOLD,
            unhealthy_threshold: DEFAULT_UNHEALTHY_THRESHOLD,
            probe_url: None,
            replace_after_seconds: DEFAULT_REPLACE_AFTER_SECONDS,
        }
    }
}

/// A health check with every default resolved, in the units the health engine works in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EffectiveHealthCheck {
    /// Time between probes.
    pub interval: StdDuration,
    /// Time one probe may take; always less than `interval`.
    pub timeout: StdDuration,
    /// Consecutive successes to become healthy (at least 1).
    pub healthy_threshold: u32,
    /// Consecutive failures to become unhealthy (at least 1).
    pub unhealthy_threshold: u32,
    /// The URL fetched through the proxy.
    pub probe_url: String,
}

impl HealthCheck {
    /// How long a dead Managed instance is kept before it is replaced; `None` never replaces it.
    pub fn replace_after(&self) -> Option<StdDuration> {
        (self.replace_after_seconds > 0)
            .then(|| StdDuration::from_secs(self.replace_after_seconds.unsigned_abs().into()))
    }

    /// Resolves the probe URL default and clamps every value into the schema's bounds.
    ///
    /// The apiserver already enforces the bounds; clamping here keeps a Proxy built in Rust (a test fixture, an
    /// embedding tool) from producing a zero interval or a timeout longer than the interval.
    pub fn effective(&self, default_probe_url: &str) -> EffectiveHealthCheck {
        let interval_seconds = self.interval_seconds.clamp(MIN_INTERVAL_SECONDS, 86400);
        let timeout_seconds = self.timeout_seconds.clamp(1, interval_seconds - 1);
        EffectiveHealthCheck {
            interval: StdDuration::from_secs(interval_seconds.unsigned_abs().into()),
            timeout: StdDuration::from_secs(timeout_seconds.unsigned_abs().into()),
            healthy_threshold: self.healthy_threshold.max(1).unsigned_abs(),
            unhealthy_threshold: self.unhealthy_threshold.max(1).unsigned_abs(),
            probe_url: self.probe_url.clone().unwrap_or_else(|| default_probe_url.to_owned()),
        }
    }
}

impl ProxySpec {
    /// A spec of the given mode with every optional field unset and every default applied.
    pub fn new(mode: ProxyMode) -> Self {
        Self {
            mode,
            provider: None,
            placement: None,
            cloud_init: None,
            endpoint: None,
            port: DEFAULT_PORT,
            auth: None,
            health_check: HealthCheck::default(),
            max_leases: None,
            max_age: None,
            destinations: None,
            cooldown: None,
            pacing: None,
        }
    }

    /// An External Proxy: the forward proxy at `host:port`, adopted as it runs.
    pub fn external(host: impl Into<String>, port: u16) -> Self {
        Self { endpoint: Some(Endpoint { host: host.into(), port: i32::from(port) }), ..Self::new(ProxyMode::External) }
    }

    /// A Managed Proxy that the provider named `provider` creates, in `zone` (a GCE zone, KVM host or namespace)
    /// when given.
    pub fn managed(provider: impl Into<String>, zone: Option<&str>) -> Self {
        Self {
            provider: Some(provider.into()),
            placement: zone.map(|zone| Placement { zone: Some(zone.to_owned()), ..Placement::default() }),
            ..Self::new(ProxyMode::Managed)
        }
    }

    /// This spec with `health_check`.
    #[must_use]
    pub fn with_health_check(self, health_check: HealthCheck) -> Self {
        Self { health_check, ..self }
    }

    /// The lease cap: `maxLeases`, or 5 when unset. An explicit 0 stays 0 (the proxy is drained).
    pub fn max_leases(&self) -> u32 {
        self.max_leases.unwrap_or(DEFAULT_MAX_LEASES).max(0).unsigned_abs()
    }

    /// `maxAge` as a standard duration, when set and positive.
    pub fn max_age(&self) -> Option<StdDuration> {
        self.max_age.filter(|age| !age.is_negative()).map(StdDuration::from).filter(|age| !age.is_zero())
    }
}

impl Proxy {
    /// The token that forces replacements: the `rotate` annotation and the number of `maxAge` rotations, combined.
    /// `None` when neither is set, so a Proxy that was never rotated hashes exactly like its plain spec.
    pub fn rotation_token(&self) -> Option<String> {
        let (annotation, rotations, replacements) = self.rotation_parts();
        rotation_token(annotation, rotations, replacements)
    }

    /// What the rotation token is made of: the `rotate` annotation, the `maxAge` rotations and the self-healing
    /// replacements.
    fn rotation_parts(&self) -> (Option<&str>, u32, u32) {
        let annotation = crate::annotations::annotation(self, crate::annotations::ROTATE);
        let rotations = self.status.as_ref().and_then(|status| status.max_age_rotations).unwrap_or(0);
        let replacements = self.status.as_ref().and_then(|status| status.replacements).unwrap_or(0);
        (annotation, rotations, replacements)
    }

    /// Why the desired instance differs from one created for `instance_hash` with the provider fingerprint
    /// `instance_fingerprint`, for the `Replacing` Event: the provider's destination policy changed (the current
    /// spec with the instance's fingerprint hashes as the instance does, but the provider now has `fingerprint`);
    /// a self-healing replacement, a `maxAge` rotation or the `rotate` annotation being set, when the hash says so
    /// (each is the current spec with one of them undone); otherwise a change of the spec or of the annotation.
    pub fn replacement_cause(
        &self,
        instance_hash: &str,
        instance_fingerprint: Option<&str>,
        fingerprint: Option<&str>,
    ) -> &'static str {
        let (annotation, rotations, replacements) = self.rotation_parts();
        let was = |annotation: Option<&str>, rotations: u32, replacements: u32| {
            let token = rotation_token(annotation, rotations, replacements);
            crate::spec_hash_with(&self.spec, token.as_deref(), instance_fingerprint) == instance_hash
        };
        if instance_fingerprint != fingerprint && was(annotation, rotations, replacements) {
            "the provider's destination policy changed"
        } else if replacements > 0 && was(annotation, rotations, replacements - 1) {
            "self-healing replaces the dead instance"
        } else if rotations > 0 && was(annotation, rotations - 1, replacements) {
            "the instance reached maxAge"
        } else if annotation.is_some() && was(None, rotations, replacements) {
            "the crawl.example.com/rotate annotation was set"
        } else {
            "the spec (or the crawl.example.com/rotate annotation) changed"
        }
    }

    /// The spec hash the current instance should have on a provider without an instance fingerprint (the
    /// default destination policy): [`crate::spec_hash`] over the spec and the rotation token.
    pub fn desired_spec_hash(&self) -> String {
        self.desired_spec_hash_with(None)
    }

    /// The spec hash the current instance should have on a provider whose instance fingerprint is `fingerprint`.
    pub fn desired_spec_hash_with(&self, fingerprint: Option<&str>) -> String {
        crate::spec_hash_with(&self.spec, self.rotation_token().as_deref(), fingerprint)
    }

    /// Where crawlers connect: `spec.endpoint` for External proxies, the published `status.endpoint` for Managed
    /// ones (none until the instance has an address).
    pub fn effective_endpoint(&self) -> Option<Endpoint> {
        match self.spec.mode {
            ProxyMode::External => self.spec.endpoint.clone(),
            ProxyMode::Managed => self.status.as_ref()?.endpoint.as_ref().map(Endpoint::from),
        }
    }
}

/// The rotation token of a Proxy with these parts; `None` when none is set.
fn rotation_token(annotation: Option<&str>, rotations: u32, replacements: u32) -> Option<String> {
    let mut token = match (annotation, rotations) {
        (None, 0) => None,
        (Some(token), 0) => Some(token.to_owned()),
        (token, rotations) => Some(format!("{}#maxAge{rotations}", token.unwrap_or_default())),
    };
    if replacements > 0 {
        token = Some(format!("{}#heal{replacements}", token.unwrap_or_default()));
    }
    token
}

#[cfg(test)]
mod tests;
