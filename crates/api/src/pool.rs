//! The `ProxyPool` custom resource: a fleet of Managed Proxies declared by count, spread over providers and zones by
//! weight, recycled by age in rolling batches, and optionally scaled by demand down to zero.
//!
//! A pool owns its member Proxies (owner references, the label [`POOL_LABEL`]) the way a ReplicaSet owns Pods, and
//! has a scale subresource, so `kubectl scale` and a HorizontalPodAutoscaler work on it. Every bound a user can break
//! is a schema bound or a CEL rule here, each with a message naming the field.

use std::collections::BTreeMap;
use std::time::Duration as StdDuration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, MicroTime, ObjectMeta};
use kube::core::Duration;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::proxy::{
    CloudInit, DEFAULT_PORT, HealthCheck, Placement, ProxyAuth, ProxyDestinations, ProxyMode, ProxySpec,
};

/// The label every member Proxy carries: the name of the pool that owns it. The pool's selector is this label.
pub const POOL_LABEL: &str = "crawl.example.com/pool";
/// The longest pool name: member names are `<pool>-<ordinal>` and the name is a label value (at most 63).
pub const MAX_POOL_NAME_LENGTH: usize = 58;
/// The most members a pool may have.
pub const MAX_REPLICAS: i32 = 1000;

/// The condition that says the pool has at least its floor of Ready members.
pub const CONDITION_AVAILABLE: &str = "Available";
/// The condition that says the pool is creating, removing, rolling or recycling members.
pub const CONDITION_PROGRESSING: &str = "Progressing";

/// The default share of Ready members that may be leased before the autoscaler adds members.
pub const DEFAULT_TARGET_LEASED_PERCENT: i32 = 80;
/// The default time without any lease before an autoscaled pool goes down to `autoscale.min`.
pub const DEFAULT_IDLE_SECONDS: i32 = 600;
/// The default most members one autoscaling decision adds.
pub const DEFAULT_SCALE_UP_STEP: i32 = 4;
/// The default most members one autoscaling decision removes (idleness goes to `min` at once).
pub const DEFAULT_SCALE_DOWN_STEP: i32 = 1;
/// The default time after a scaling decision before the autoscaler scales down for a lower leased share.
pub const DEFAULT_STABILIZATION_SECONDS: i32 = 60;
/// The default jitter of `recycle.maxAge`, in percent: a member is recycled up to this much earlier.
pub const DEFAULT_JITTER_PERCENT: i32 = 10;

/// A fleet of Managed Proxies made from one template.
// Each `printcolumn(...)` repeats keys such as `type_ = "integer"`, which clippy mistakes for a duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "crawl.example.com",
    version = "v1alpha1",
    kind = "ProxyPool",
    plural = "proxypools",
    namespaced,
    shortname = "pxp",
    category = "egress",
    status = "ProxyPoolStatus",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    doc = "A fleet of Managed Proxies declared by count: spread over providers by weight, recycled by age, scaled by demand.",
    printcolumn(
        name = "Desired",
        type_ = "integer",
        json_path = ".spec.replicas",
        description = "How many members the pool should have"
    ),
    printcolumn(
        name = "Ready",
        type_ = "integer",
        json_path = ".status.readyReplicas",
        description = "Members that are Ready (healthy and handed out)"
    ),
    printcolumn(
        name = "Leased",
        type_ = "integer",
        json_path = ".status.leasedReplicas",
        description = "Members with at least one active lease"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = kube::core::Rule::new("size(self.metadata.name) <= 58")
        .message("a ProxyPool's name must be at most 58 characters: members are named <pool>-<ordinal> and carry the pool's name as a label value")
        .field_path(".metadata.name")
        .reason(kube::core::Reason::FieldValueInvalid)
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = crate::proxy::without_nullable)]
#[x_kube(
    validation = Rule::new("(has(self.spread) && size(self.spread) > 0) || has(self.template.spec.provider)")
        .message("a ProxyPool needs a provider: set spec.template.spec.provider, or list providers in spec.spread")
        .field_path(".template.spec.provider")
        .reason(kube::core::Reason::FieldValueRequired),
    validation = Rule::new("!(has(self.spread) && size(self.spread) > 0) || !has(self.template.spec.provider)")
        .message("spec.template.spec.provider must not be set when spec.spread lists providers: each member's provider comes from its spread entry")
        .field_path(".template.spec.provider")
        .reason(kube::core::Reason::FieldValueForbidden),
)]
pub struct ProxyPoolSpec {
    /// How many members the pool should have. With `autoscale`, the operator sets it (within `min` and `max`);
    /// `kubectl scale` and a HorizontalPodAutoscaler set it through the scale subresource.
    #[serde(default)]
    #[schemars(range(min = 0, max = 1000))]
    pub replicas: i32,

    /// What every member is made from.
    pub template: ProxyTemplate,

    /// The providers (and zones) members run on, with weights: members are divided in proportion to the weights
    /// and kept that way as the count changes. Empty: every member runs on `template.spec.provider`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    #[x_kube(validation = Rule::new("self.all(a, self.exists_one(b, b.provider == a.provider && (has(b.zone) ? b.zone : '') == (has(a.zone) ? a.zone : '')))")
        .message("spec.spread lists a provider and zone twice: give each (provider, zone) once, with its weight"))]
    pub spread: Vec<SpreadEntry>,

    /// Replacing members by age, in rolling batches that never drop Ready members below a floor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recycle: Option<Recycle>,

    /// Scaling by demand: up when leases for the pool are refused for lack of capacity, down when it is idle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscale: Option<Autoscale>,
}

/// The part of a member Proxy a pool's template gives: its labels and annotations, and a Managed spec.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct ProxyTemplate {
    /// Labels and annotations every member gets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateMetadata>,
    /// The members' spec (always Managed).
    pub spec: ProxyTemplateSpec,
}

/// Labels and annotations of the members.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[x_kube(validation = Rule::new("!has(self.labels) || !('crawl.example.com/pool' in self.labels)")
    .message("spec.template.metadata.labels must not set crawl.example.com/pool: the operator sets it to the pool's name")
    .field_path(".labels"))]
pub struct TemplateMetadata {
    /// Labels of every member (selectors in the discovery API match them).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations of every member.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// A member's spec: a Managed Proxy's spec without `mode` (always Managed), `endpoint` (Managed proxies publish
/// theirs) and `maxAge` (the pool recycles by age itself, at its own pace).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyTemplateSpec {
    /// The provider every member runs on, when `spread` is empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub provider: Option<String>,
    /// Where and on what members run; a spread entry's `zone` takes the place of `placement.zone`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,
    /// Cloud-init user data for VM providers, inline or from a Secret. Never logged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init: Option<CloudInit>,
    /// The port Squid listens on.
    #[serde(default = "default_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// Proxy credentials every member requires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<ProxyAuth>,
    /// How the health engine probes members.
    #[serde(default)]
    pub health_check: HealthCheck,
    /// At most this many concurrent leases per member. Defaults to 5.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 100000), extend("default" = crate::proxy::DEFAULT_MAX_LEASES))]
    pub max_leases: Option<i32>,
    /// Destinations members refuse on top of their provider's policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destinations: Option<ProxyDestinations>,
    /// How long a site's ban keeps a member from being leased for that site (as a Proxy's `spec.cooldown`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cooldown: Option<crate::CooldownSpec>,
    /// How often a member's egress address is leased for one site (as a Proxy's `spec.pacing`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pacing: Option<crate::PacingSpec>,
}

fn default_port() -> i32 {
    DEFAULT_PORT
}

impl Default for ProxyTemplateSpec {
    fn default() -> Self {
        Self {
            provider: None,
            placement: None,
            cloud_init: None,
            port: DEFAULT_PORT,
            auth: None,
            health_check: HealthCheck::default(),
            max_leases: None,
            destinations: None,
            cooldown: None,
            pacing: None,
        }
    }
}

/// One provider (and zone) members run on, and its share.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SpreadEntry {
    /// A provider in the operator's providers config.
    #[schemars(length(min = 1, max = 253))]
    pub provider: String,
    /// The zone (GCE zone, KVM host key, namespace for pods); absent: the template's zone, else the provider's
    /// default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub zone: Option<String>,
    /// This entry's share, relative to the other entries' weights.
    #[serde(default = "default_weight")]
    #[schemars(range(min = 1, max = 1000))]
    pub weight: i32,
}

fn default_weight() -> i32 {
    1
}

/// Recycling members by age (CloudProxy's rolling model).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Recycle {
    /// A member whose instance is older than this gets a new instance (so a new IP), for example `24h`; the old
    /// instance serves until the new one is healthy and is then drained of its leases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // The pattern's own message covers a malformed value; the rule then holds, so CEL never parses it.
    #[x_kube(validation = Rule::new("!self.matches('^([0-9]+(\\\\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$') || duration(self) > duration('0s')").message("spec.recycle.maxAge must be a positive duration such as 90m or 24h"))]
    #[schemars(regex(pattern = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"))]
    pub max_age: Option<Duration>,
    /// Up to this share of `maxAge` earlier, different per member, so members made together are not recycled
    /// together.
    #[serde(default = "default_jitter_percent")]
    #[schemars(range(min = 0, max = 50))]
    pub jitter_percent: i32,
    /// At most this many members get a new instance at once (each has two while it does); also the pace of a
    /// template change.
    #[serde(default = "default_max_surge")]
    #[schemars(range(min = 1, max = 100))]
    pub max_surge: i32,
    /// Recycling and template changes start on a member only while at least this many members are Ready, or all
    /// of them when `replicas` is lower: like a PodDisruptionBudget's, the floor never stops `kubectl scale`, an
    /// HPA or the autoscaler from going below it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000))]
    pub min_available: Option<i32>,
}

fn default_jitter_percent() -> i32 {
    DEFAULT_JITTER_PERCENT
}

fn default_max_surge() -> i32 {
    1
}

impl Default for Recycle {
    fn default() -> Self {
        Self { max_age: None, jitter_percent: DEFAULT_JITTER_PERCENT, max_surge: 1, min_available: None }
    }
}

/// Scaling by demand (Scrapoxy's up-on-demand, down-when-idle, with bounds and a stabilisation window).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.min <= self.max")
    .message("spec.autoscale.min must not exceed spec.autoscale.max")
    .field_path(".min"))]
pub struct Autoscale {
    /// The fewest members; 0 lets an idle pool scale to zero (a lease then wakes it).
    #[serde(default)]
    #[schemars(range(min = 0, max = 1000))]
    pub min: i32,
    /// The most members.
    #[schemars(range(min = 1, max = 1000))]
    pub max: i32,
    /// Add members when more than this percentage of Ready members hold a lease.
    #[serde(default = "default_target_leased_percent")]
    #[schemars(range(min = 1, max = 100))]
    pub target_leased_percent: i32,
    /// Go down to `min` after this many seconds without any lease on the pool.
    #[serde(default = "default_idle_seconds")]
    #[schemars(range(min = 1, max = 86400))]
    pub idle_seconds: i32,
    /// At most this many members added by one decision.
    #[serde(default = "default_scale_up_step")]
    #[schemars(range(min = 1, max = 1000))]
    pub scale_up_step: i32,
    /// At most this many members removed by one decision for a lower leased share (idleness goes to `min` at once).
    #[serde(default = "default_scale_down_step")]
    #[schemars(range(min = 1, max = 1000))]
    pub scale_down_step: i32,
    /// After a scaling decision, wait this long before scaling down for a lower leased share, and before adding
    /// members again while earlier ones are still coming up.
    #[serde(default = "default_stabilization_seconds")]
    #[schemars(range(min = 0, max = 3600))]
    pub stabilization_seconds: i32,
}

fn default_target_leased_percent() -> i32 {
    DEFAULT_TARGET_LEASED_PERCENT
}
fn default_idle_seconds() -> i32 {
    DEFAULT_IDLE_SECONDS
}
fn default_scale_up_step() -> i32 {
    DEFAULT_SCALE_UP_STEP
}
fn default_scale_down_step() -> i32 {
    DEFAULT_SCALE_DOWN_STEP
}
fn default_stabilization_seconds() -> i32 {
    DEFAULT_STABILIZATION_SECONDS
}

impl Autoscale {
    /// Bounds from `min` to `max`, every other field at its default.
    pub fn new(min: i32, max: i32) -> Self {
        Self {
            min,
            max,
            target_leased_percent: DEFAULT_TARGET_LEASED_PERCENT,
            idle_seconds: DEFAULT_IDLE_SECONDS,
            scale_up_step: DEFAULT_SCALE_UP_STEP,
            scale_down_step: DEFAULT_SCALE_DOWN_STEP,
            stabilization_seconds: DEFAULT_STABILIZATION_SECONDS,
        }
    }
}

/// What the pool controller observed and decided.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyPoolStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Members that exist and are not being deleted.
    #[serde(default)]
    pub replicas: i32,
    /// Members that are Ready.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Members with at least one active lease.
    #[serde(default)]
    pub leased_replicas: i32,
    /// Members made from the current template and not in the middle of getting a new instance.
    #[serde(default)]
    pub updated_replicas: i32,
    /// The label selector of the members, for the scale subresource (`crawl.example.com/pool=<name>`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub selector: String,
    /// Members per spread entry: how many the weights ask for, how many there are, how many are Ready.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spread: Vec<SpreadStatus>,
    /// The last scaling decision: the operator's own (autoscale) or one it noticed (`kubectl scale`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale: Option<ScalingDecision>,
    /// `Available` and `Progressing`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// Members of one spread entry.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SpreadStatus {
    /// The provider.
    pub provider: String,
    /// The zone, when the entry names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// How many members the weights give this entry.
    pub desired: i32,
    /// How many members it has.
    pub current: i32,
    /// How many of them are Ready.
    pub ready: i32,
    /// How long this entry's members recently took from creation to Ready, in seconds (the median over its Ready
    /// members; kept while it has none). The discovery API's `Retry-After` while the pool scales up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioning_seconds: Option<i32>,
}

/// One change of `spec.replicas`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScalingDecision {
    /// When it was made, to the microsecond.
    // Not a `Time`: the autoscaler compares it with the refusal or wake that led to it, and at whole seconds a refusal
    // just before the decision looked newer than the decision, so the pool scaled for it again on every pass.
    pub time: MicroTime,
    /// The count before.
    pub from: i32,
    /// The count after.
    pub to: i32,
    /// A stable, machine-readable reason: `Wake`, `AtCapacity`, `NoneHealthy`, `LeasedShare`, `Idle`,
    /// `LowerLeasedShare`, `Bounds` (the operator's), `Manual` (somebody else set `spec.replicas`) or `Created`
    /// (the count the pool was created with).
    pub reason: String,
    /// What led to it, for a human.
    pub message: String,
}

impl ProxyPoolSpec {
    /// A pool of `replicas` members made from `template`, with no spread, recycling or autoscaling.
    pub fn new(replicas: i32, template: ProxyTemplate) -> Self {
        Self { replicas, template, spread: Vec::new(), recycle: None, autoscale: None }
    }

    /// The spread entries members are divided over: `spread`, or one entry of weight 1 for the template's
    /// provider (none when the template names none).
    pub fn slots(&self) -> Vec<SpreadEntry> {
        if !self.spread.is_empty() {
            return self.spread.clone();
        }
        self.template
            .spec
            .provider
            .iter()
            .map(|provider| SpreadEntry { provider: provider.clone(), zone: None, weight: 1 })
            .collect()
    }

    /// The spec of a member placed on `slot`: the template's, Managed, on the slot's provider and (when it names
    /// one) zone.
    pub fn member_spec(&self, slot: &SpreadEntry) -> ProxySpec {
        let template = &self.template.spec;
        let mut placement = template.placement.clone();
        if let Some(zone) = &slot.zone {
            placement.get_or_insert_with(Placement::default).zone = Some(zone.clone());
        }
        ProxySpec {
            provider: Some(slot.provider.clone()),
            placement,
            cloud_init: template.cloud_init.clone(),
            port: template.port,
            auth: template.auth.clone(),
            health_check: template.health_check.clone(),
            max_leases: template.max_leases,
            destinations: template.destinations.clone(),
            cooldown: template.cooldown,
            pacing: template.pacing,
            ..ProxySpec::new(ProxyMode::Managed)
        }
    }

    /// `recycle.maxAge` as a standard duration, when set and positive.
    pub fn recycle_max_age(&self) -> Option<StdDuration> {
        let age = self.recycle.as_ref()?.max_age?;
        (!age.is_negative()).then(|| StdDuration::from(age)).filter(|age| !age.is_zero())
    }
}

impl ProxyPool {
    /// The member selector: `crawl.example.com/pool=<name>`.
    pub fn selector(name: &str) -> String {
        format!("{POOL_LABEL}={name}")
    }
}

/// The pool a Proxy is a member of, from its metadata: the pool its [`POOL_LABEL`] names, when that pool also controls
/// it (a controller owner reference of kind `ProxyPool` with that name); the pool's name and UID. A Proxy that only
/// carries the label is no member: it is not leased as one, and the pool neither counts nor replaces it (its
/// ordinal stays taken). The one definition of membership: discovery, the pool controller and its member index
/// (which keeps the labelled Proxies, the candidates) all go by it.
pub fn member_of(metadata: &ObjectMeta) -> Option<(&str, &str)> {
    let pool = metadata.labels.as_ref()?.get(POOL_LABEL)?;
    metadata
        .owner_references
        .iter()
        .flatten()
        .find(|owner| owner.controller == Some(true) && owner.kind == "ProxyPool" && &owner.name == pool)
        .map(|owner| (pool.as_str(), owner.uid.as_str()))
}

/// The spread entry a member spec runs on: its provider and zone.
pub fn slot_of(spec: &ProxySpec) -> (Option<&str>, Option<&str>) {
    (spec.provider.as_deref(), spec.placement.as_ref().and_then(|placement| placement.zone.as_deref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Membership needs both the label and the named pool's controller reference; the UID comes with it.
    #[test]
    fn a_member_is_labelled_for_its_pool_and_controlled_by_it() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        let owner = |name: &str, kind: &str, controller: Option<bool>| OwnerReference {
            api_version: "crawl.example.com/v1alpha1".into(),
            kind: kind.into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            controller,
            ..OwnerReference::default()
        };
        let meta = |label: Option<&str>, owners: Vec<OwnerReference>| ObjectMeta {
            labels: label.map(|pool| [(POOL_LABEL.to_owned(), pool.to_owned())].into()),
            owner_references: Some(owners),
            ..ObjectMeta::default()
        };
        let eu = owner("eu", "ProxyPool", Some(true));
        assert_eq!(member_of(&meta(Some("eu"), vec![eu.clone()])), Some(("eu", "uid-eu")));
        assert_eq!(member_of(&meta(Some("eu"), vec![])), None, "the label alone");
        assert_eq!(member_of(&meta(None, vec![eu])), None, "the owner alone");
        assert_eq!(member_of(&meta(Some("eu"), vec![owner("us", "ProxyPool", Some(true))])), None, "another pool");
        assert_eq!(member_of(&meta(Some("eu"), vec![owner("eu", "ProxyPool", None)])), None, "not the controller");
        assert_eq!(member_of(&meta(Some("eu"), vec![owner("eu", "ReplicaSet", Some(true))])), None, "another kind");
    }

    fn template(provider: Option<&str>) -> ProxyTemplate {
        ProxyTemplate {
            metadata: None,
            spec: ProxyTemplateSpec {
                provider: provider.map(str::to_owned),
                placement: Some(Placement { zone: Some("z0".into()), machine_type: Some("small".into()), image: None }),
                max_leases: Some(7),
                ..ProxyTemplateSpec::default()
            },
        }
    }

    #[test]
    fn slots_default_to_the_template_provider() {
        let pool = ProxyPoolSpec::new(3, template(Some("pods")));
        assert_eq!(pool.slots(), [SpreadEntry { provider: "pods".into(), zone: None, weight: 1 }]);
        let spread = vec![
            SpreadEntry { provider: "gcp".into(), zone: Some("europe-west1-b".into()), weight: 2 },
            SpreadEntry { provider: "kvm".into(), zone: None, weight: 1 },
        ];
        let pool = ProxyPoolSpec { spread: spread.clone(), ..ProxyPoolSpec::new(3, template(None)) };
        assert_eq!(pool.slots(), spread);
        assert!(ProxyPoolSpec::new(3, template(None)).slots().is_empty());
    }

    #[test]
    fn a_member_spec_takes_its_slot_provider_and_zone() {
        let pool = ProxyPoolSpec::new(3, template(None));
        let zoned = pool.member_spec(&SpreadEntry { provider: "gcp".into(), zone: Some("z1".into()), weight: 1 });
        assert_eq!(zoned.mode, ProxyMode::Managed);
        assert_eq!(slot_of(&zoned), (Some("gcp"), Some("z1")));
        assert_eq!(zoned.placement.as_ref().and_then(|p| p.machine_type.as_deref()), Some("small"));
        assert_eq!(zoned.max_leases, Some(7));
        // A slot without a zone keeps the template's.
        let unzoned = pool.member_spec(&SpreadEntry { provider: "kvm".into(), zone: None, weight: 1 });
        assert_eq!(slot_of(&unzoned), (Some("kvm"), Some("z0")));
    }

    #[test]
    fn recycle_max_age_parses_and_ignores_nonsense() {
        let cases = [(None, None), (Some("24h"), Some(86400)), (Some("0s"), None), (Some("-1m"), None)];
        for (value, expected) in cases {
            let pool = ProxyPoolSpec {
                recycle: Some(Recycle { max_age: value.map(|v| v.parse().expect("a duration")), ..Recycle::default() }),
                ..ProxyPoolSpec::new(1, template(Some("pods")))
            };
            assert_eq!(pool.recycle_max_age().map(|age| age.as_secs()), expected, "{value:?}");
        }
    }

    #[test]
    fn an_empty_template_spec_deserializes_with_defaults() {
        let spec: ProxyTemplateSpec = serde_json::from_str("{}").expect("valid");
        assert_eq!(spec, ProxyTemplateSpec::default());
        let autoscale: Autoscale = serde_json::from_str(r#"{"max": 5}"#).expect("valid");
        assert_eq!(autoscale, Autoscale::new(0, 5));
    }
}
