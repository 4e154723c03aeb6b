//! The pure heart of the reconciler: from what was observed to what to do and what the status should say.
//!
//! Nothing here touches a client, a clock or a provider; every input is in [`Facts`], so every row of the state
//! machine is a table test. The controller observes, calls [`decide`], performs the one [`Action`], and writes the
//! status only when it differs from what it read.

use std::time::{Duration, SystemTime};

use egress_api::proxy::{CONDITION_HEALTHY, CONDITION_PROVISIONED, CONDITION_READY};
use egress_api::{
    Endpoint, EndpointStatus, FailureStatus, HealthStatus, InstanceState, InstanceStatus, ProxyMode, ProxyPhase,
    ProxyStatus,
};

use crate::health::Verdict;
use crate::status::{ConditionSpec, merge_conditions, time};

/// How soon to look again at an instance that is still being created.
pub const PROVISIONING_REQUEUE: Duration = Duration::from_secs(5);
/// How soon to look again after deleting an instance (deletion may be graceful and take a while).
pub const DELETING_REQUEUE: Duration = Duration::from_secs(2);
/// The first quota backoff; it doubles per consecutive QuotaExceeded up to [`QUOTA_BACKOFF_MAX`].
pub const QUOTA_BACKOFF_MIN: Duration = Duration::from_secs(60);
/// The longest quota backoff.
pub const QUOTA_BACKOFF_MAX: Duration = Duration::from_secs(15 * 60);
/// How often a draining previous instance is looked at again, to delete it as soon as its last lease moved.
pub const DRAIN_RECHECK: Duration = Duration::from_secs(2);
/// How long a new External Proxy's first status waits for its first health verdict (the engine probes a new target
/// within 2 s), so the first write says Ready or Unhealthy instead of Running followed by a second write.
pub const FIRST_VERDICT_WAIT: Duration = Duration::from_secs(5);

/// What the provider said about the instance the status records as current, when its spec hash is the desired one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Observed {
    /// The status records no current instance with the desired spec hash, so nothing was asked.
    NotRecorded,
    /// The provider has it.
    Found {
        /// Its state.
        state: InstanceState,
        /// Its address.
        ip: Option<String>,
        /// When it was created.
        created_at: Option<SystemTime>,
    },
    /// The provider does not have it.
    NotFound,
}

/// What the provider said about `status.previousInstance`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreviousObserved {
    /// No previous instance is recorded.
    None,
    /// It still exists.
    Present,
    /// It is gone.
    Gone,
}

/// Everything [`decide`] needs.
#[derive(Clone, Debug)]
pub struct Facts {
    /// The Proxy's mode.
    pub mode: ProxyMode,
    /// `metadata.generation`.
    pub generation: Option<i64>,
    /// `spec.port`.
    pub port: i32,
    /// `spec.endpoint` (External).
    pub spec_endpoint: Option<Endpoint>,
    /// The status as read.
    pub status: ProxyStatus,
    /// The spec hash the instance should have (including the rotation token and the provider's fingerprint).
    pub desired_hash: String,
    /// The provider's instance fingerprint (its destination policy's digest) mixed into `desired_hash`, recorded
    /// on the instance created for it.
    pub fingerprint: Option<String>,
    /// Why the current instance (when its hash is not `desired_hash`) is replaced, for the `Replacing` Event.
    pub replacement_cause: &'static str,
    /// The `retry` annotation's value.
    pub retry_token: Option<String>,
    /// `maxAge`, already jittered for this Proxy.
    pub max_age: Option<Duration>,
    /// `healthCheck.replaceAfterSeconds`: how long a dead instance is kept; `None` never replaces it.
    pub replace_after: Option<Duration>,
    /// How long a Running, settled Proxy waits before looking at its instance again (to notice preemption).
    pub resync: Duration,
    /// The current time.
    pub now: SystemTime,
    /// The observation of the current instance.
    pub desired: Observed,
    /// The observation of the previous instance.
    pub previous: PreviousObserved,
    /// How many live leases are still on the previous instance's endpoint (their holders were not told the new
    /// one yet).
    pub previous_leases: usize,
    /// How long a replaced instance is kept for the leases still on it.
    pub drain_timeout: Duration,
    /// The health verdict for the endpoint this decision is about: the running instance's address (Managed) or
    /// `spec.endpoint` (External).
    pub health: Option<Verdict>,
    /// What the GeoIP databases say about the verdict's egress address; `None` without databases (or address).
    pub geo: Option<crate::geoip::Geo>,
    /// `metadata.creationTimestamp`.
    pub created: Option<SystemTime>,
}

/// The one provider call a decision asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Nothing to call.
    Nothing,
    /// Create the desired instance (idempotent by name) and record it as `status.instance`.
    Create,
    /// Delete this instance.
    Delete {
        /// The instance's provider ID.
        provider_id: String,
    },
}

/// When to reconcile again, absent a change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Requeue {
    /// Only on a change to the object or a health transition.
    AwaitChange,
    /// After this long.
    After(Duration),
}

/// An Event to publish on the Proxy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventSpec {
    /// Warning (true) or Normal.
    pub warning: bool,
    /// CamelCase reason.
    pub reason: &'static str,
    /// For a human.
    pub note: String,
}

impl EventSpec {
    fn normal(reason: &'static str, note: impl Into<String>) -> Self {
        Self { warning: false, reason, note: note.into() }
    }
    fn warning(reason: &'static str, note: impl Into<String>) -> Self {
        Self { warning: true, reason, note: note.into() }
    }
}

/// What to do.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The provider call.
    pub action: Action,
    /// The status to write (if it differs from the one read).
    pub status: ProxyStatus,
    /// Events to publish.
    pub events: Vec<EventSpec>,
    /// When to look again.
    pub requeue: Requeue,
}

/// Decides one reconcile of a Proxy that is not being deleted.
pub fn decide(facts: &Facts) -> Decision {
    if let Some(wait) = awaiting_first_verdict(facts) {
        return Decision {
            action: Action::Nothing,
            status: facts.status.clone(),
            events: Vec::new(),
            requeue: Requeue::After(wait),
        };
    }
    let mut decision = match facts.mode {
        ProxyMode::External => decide_external(facts),
        ProxyMode::Managed => decide_managed(facts),
    };
    finish(facts, &mut decision);
    decision
}

/// A new External Proxy (never reconciled, never edited, created less than [`FIRST_VERDICT_WAIT`] ago) with no
/// verdict yet: how much longer its first status waits. The verdict's arrival triggers a reconcile of its own, so the
/// one write it makes carries the phase; a probe that takes longer gets `Running` written when the wait ends.
fn awaiting_first_verdict(facts: &Facts) -> Option<Duration> {
    // Only the spec as created waits: an edit wants its answer (observedGeneration) now.
    let as_created = facts.generation.is_none_or(|generation| generation <= 1);
    if facts.mode != ProxyMode::External
        || facts.health.is_some()
        || facts.status.observed_generation.is_some()
        || !as_created
    {
        return None;
    }
    let age = facts.now.duration_since(facts.created?).unwrap_or_default();
    FIRST_VERDICT_WAIT.checked_sub(age).filter(|wait| !wait.is_zero())
}

fn decide_external(facts: &Facts) -> Decision {
    let mut status = facts.status.clone();
    status.instance = None;
    status.previous_instance = None;
    status.failure = None;
    status.endpoint = facts.spec_endpoint.as_ref().map(EndpointStatus::from);
    let mut events = Vec::new();
    apply_health(facts, &mut status, &mut events);
    status.phase = Some(match facts.health.as_ref().map(|verdict| verdict.healthy) {
        Some(true) => ProxyPhase::Ready,
        Some(false) => ProxyPhase::Unhealthy,
        None => ProxyPhase::Running,
    });
    Decision { action: Action::Nothing, status, events, requeue: Requeue::AwaitChange }
}

fn decide_managed(facts: &Facts) -> Decision {
    let mut status = facts.status.clone();
    if let Some(failure) = &facts.status.failure {
        let unchanged =
            facts.status.observed_generation == facts.generation && failure.retry_token == facts.retry_token;
        if unchanged {
            // Latched: retrying the same thing fails the same way. Wait for a spec or `retry` change.
            return Decision {
                action: Action::Nothing,
                status: facts.status.clone(),
                events: Vec::new(),
                requeue: Requeue::AwaitChange,
            };
        }
        status.failure = None;
    }
    if let Some(decision) = cancel_replacement(facts, &mut status) {
        return decision;
    }
    let Some(current) = status.instance.clone().filter(|current| current.spec_hash == facts.desired_hash) else {
        return create_desired(facts, status);
    };
    match &facts.desired {
        Observed::NotRecorded | Observed::NotFound => instance_lost(status, &current),
        Observed::Found { state: InstanceState::Terminated | InstanceState::Stopped, .. } => {
            instance_stopped(status, &current)
        }
        Observed::Found { state, ip, .. } if *state != InstanceState::Running || ip.is_none() => {
            instance_coming_up(status, ip.clone())
        }
        Observed::Found { ip, created_at, .. } => {
            instance_running(facts, status, &current, ip.clone().unwrap_or_default(), *created_at)
        }
    }
}

fn replacing(status: &ProxyStatus) -> bool {
    status.previous_instance.is_some()
}

/// The phase of a Proxy whose current instance is not serving yet: `Replacing` while a previous one serves.
fn coming_up_phase(status: &ProxyStatus) -> ProxyPhase {
    if replacing(status) { ProxyPhase::Replacing } else { ProxyPhase::Provisioning }
}

/// The spec went back to what the previous instance runs while its replacement was in flight: cancel the
/// replacement. Otherwise the create that follows would adopt the previous instance by name, making it both current
/// and previous, and the switch would delete the instance that serves.
fn cancel_replacement(facts: &Facts, status: &mut ProxyStatus) -> Option<Decision> {
    let current_matches = status.instance.as_ref().is_some_and(|current| current.spec_hash == facts.desired_hash);
    if current_matches {
        return None;
    }
    let previous = status.previous_instance.take_if(|previous| previous.spec_hash == facts.desired_hash)?;
    let name = previous.name.clone();
    // The phase stays as it is (the previous instance kept serving); the next pass sets it from the facts.
    let unfinished = status.instance.replace(previous);
    let status = status.clone();
    Some(match unfinished {
        Some(unfinished) => Decision {
            action: Action::Delete { provider_id: unfinished.provider_id },
            status,
            events: vec![EventSpec::normal(
                "ReplacementCancelled",
                format!("the spec is back to instance {name}'s; deleting the unfinished {}", unfinished.name),
            )],
            requeue: Requeue::After(Duration::ZERO),
        },
        None => {
            Decision { action: Action::Nothing, status, events: Vec::new(), requeue: Requeue::After(Duration::ZERO) }
        }
    })
}

/// No instance with the desired spec: create it (the create is idempotent by name, so this also finds an instance
/// created before a crash that never reached the status), keeping a stale current one as the previous instance.
fn create_desired(facts: &Facts, mut status: ProxyStatus) -> Decision {
    let mut events = Vec::new();
    if let Some(stale) = status.instance.take() {
        if status.previous_instance.is_some() {
            // A replacement is already in flight and the spec changed again: the unfinished instance never
            // served, so delete it now; the previous one keeps serving until the newest is ready.
            status.phase = Some(ProxyPhase::Replacing);
            return Decision {
                action: Action::Delete { provider_id: stale.provider_id },
                status,
                events,
                requeue: Requeue::After(Duration::ZERO),
            };
        }
        events.push(EventSpec::normal(
            "Replacing",
            format!("{}; creating a new instance before deleting {}", facts.replacement_cause, stale.name),
        ));
        status.previous_instance = Some(stale);
    } else if !matches!(status.phase, Some(ProxyPhase::Provisioning | ProxyPhase::Replacing)) {
        events.push(EventSpec::normal("Provisioning", "creating the instance"));
    }
    status.phase = Some(coming_up_phase(&status));
    Decision { action: Action::Create, status, events, requeue: Requeue::After(Duration::ZERO) }
}

/// The provider does not know the current instance: create it again.
fn instance_lost(mut status: ProxyStatus, current: &InstanceStatus) -> Decision {
    let mut events = Vec::new();
    if current.state != InstanceState::Terminated {
        events.push(EventSpec::warning(
            "InstanceLost",
            format!("instance {} disappeared from the provider; creating it again", current.name),
        ));
    }
    status.phase = Some(coming_up_phase(&status));
    Decision { action: Action::Create, status, events, requeue: Requeue::After(Duration::ZERO) }
}

/// The current instance stopped (preempted or failed): delete it; the next pass creates it again.
fn instance_stopped(mut status: ProxyStatus, current: &InstanceStatus) -> Decision {
    let mut events = Vec::new();
    if current.state != InstanceState::Terminated {
        events.push(EventSpec::warning(
            "InstanceLost",
            format!(
                "instance {} stopped unexpectedly (preempted or failed); deleting and creating it again",
                current.name
            ),
        ));
    }
    let instance = status.instance.as_mut().expect("the current instance is recorded");
    instance.state = InstanceState::Terminated;
    instance.ip = None;
    if !replacing(&status) {
        status.endpoint = None;
    }
    status.phase = Some(coming_up_phase(&status));
    Decision {
        action: Action::Delete { provider_id: current.provider_id.clone() },
        status,
        events,
        requeue: Requeue::After(DELETING_REQUEUE),
    }
}

/// The current instance exists but is not running with an address yet.
fn instance_coming_up(mut status: ProxyStatus, ip: Option<String>) -> Decision {
    let instance = status.instance.as_mut().expect("the current instance is recorded");
    instance.state = InstanceState::Provisioning;
    instance.ip = ip;
    status.phase = Some(coming_up_phase(&status));
    Decision { action: Action::Nothing, status, events: Vec::new(), requeue: Requeue::After(PROVISIONING_REQUEUE) }
}

/// The current instance runs at `ip`: it serves (or, during a replacement, takes over once healthy).
fn instance_running(
    facts: &Facts,
    mut status: ProxyStatus,
    current: &InstanceStatus,
    ip: String,
    created_at: Option<SystemTime>,
) -> Decision {
    let mut events = Vec::new();
    let instance = status.instance.as_mut().expect("the current instance is recorded");
    let first_run = instance.state != InstanceState::Running;
    instance.state = InstanceState::Running;
    instance.ip = Some(ip.clone());
    if first_run {
        events.push(EventSpec::normal("Provisioned", format!("instance {} runs at {ip}", current.name)));
    }
    let candidate = Endpoint { host: ip, port: facts.port };
    if let Some(previous) = status.previous_instance.clone() {
        return take_over(facts, status, events, current, &previous, &candidate);
    }
    serve(facts, status, events, current, &candidate, created_at)
}

/// A replacement whose new instance runs: make before break. The old instance serves until the new one is proven
/// healthy; then the endpoint switches in one write and the old one drains and goes.
fn take_over(
    facts: &Facts,
    mut status: ProxyStatus,
    mut events: Vec<EventSpec>,
    current: &InstanceStatus,
    previous: &InstanceStatus,
    candidate: &Endpoint,
) -> Decision {
    if facts.health.as_ref().map(|verdict| verdict.healthy) != Some(true) {
        status.phase = Some(ProxyPhase::Replacing);
        // A replacement that is itself dead is replaced in turn, each time after twice as long.
        let factor = 1_u32 << status.replacements.unwrap_or(0).min(4);
        let requeue = match self_heal(facts, &mut status, &mut events, &current.name, factor) {
            Some(wait) => wait.min(facts.resync),
            None => facts.resync,
        };
        return Decision { action: Action::Nothing, status, events, requeue: Requeue::After(requeue) };
    }
    status.endpoint = Some(EndpointStatus::from(candidate));
    apply_health(facts, &mut status, &mut events);
    status.phase = Some(ProxyPhase::Ready);
    match facts.previous {
        PreviousObserved::Present => drain_previous(facts, status, events, current, previous),
        PreviousObserved::Gone | PreviousObserved::None => {
            status.previous_instance = None;
            events.push(EventSpec::normal("Replaced", format!("instance {} replaced {}", current.name, previous.name)));
            Decision { action: Action::Nothing, status, events, requeue: Requeue::After(facts.resync) }
        }
    }
}

/// The old instance of a finished replacement serves the leases still on it until their holders renew (and are
/// told the new URL), release, or let them expire, or until the drain timeout; then it is deleted.
fn drain_previous(
    facts: &Facts,
    mut status: ProxyStatus,
    mut events: Vec<EventSpec>,
    current: &InstanceStatus,
    previous: &InstanceStatus,
) -> Decision {
    let since = previous.draining_since.as_ref().map_or(facts.now, crate::status::system_time);
    let deadline = since + facts.drain_timeout;
    if facts.previous_leases > 0 && facts.now < deadline {
        if previous.draining_since.is_none() {
            events.push(EventSpec::normal(
                "Draining",
                format!(
                    "instance {} serves; {} keeps serving {} lease(s) until their holders renew onto it, release or \
                     expire (at most {}s)",
                    current.name,
                    previous.name,
                    facts.previous_leases,
                    facts.drain_timeout.as_secs()
                ),
            ));
        }
        if let Some(previous) = status.previous_instance.as_mut() {
            previous.draining_since = Some(time(since));
        }
        let left = deadline.duration_since(facts.now).unwrap_or_default();
        let requeue = DRAIN_RECHECK.min(left).max(Duration::from_millis(100));
        return Decision { action: Action::Nothing, status, events, requeue: Requeue::After(requeue) };
    }
    if facts.previous_leases > 0 {
        events.push(EventSpec::warning(
            "DrainTimedOut",
            format!(
                "deleting {} with {} lease(s) still on it after the {}s drain timeout",
                previous.name,
                facts.previous_leases,
                facts.drain_timeout.as_secs()
            ),
        ));
    }
    Decision {
        action: Action::Delete { provider_id: previous.provider_id.clone() },
        status,
        events,
        requeue: Requeue::After(DELETING_REQUEUE),
    }
}

/// The current instance serves: its phase from the health verdict, self-healing of a dead instance, and the
/// `maxAge` rotation.
fn serve(
    facts: &Facts,
    mut status: ProxyStatus,
    mut events: Vec<EventSpec>,
    current: &InstanceStatus,
    candidate: &Endpoint,
    created_at: Option<SystemTime>,
) -> Decision {
    status.endpoint = Some(EndpointStatus::from(candidate));
    apply_health(facts, &mut status, &mut events);
    status.phase = Some(match facts.health.as_ref().map(|verdict| verdict.healthy) {
        Some(true) => ProxyPhase::Ready,
        Some(false) => ProxyPhase::Unhealthy,
        None => ProxyPhase::Running,
    });
    let mut requeue = facts.resync;
    if let Some(wait) = self_heal(facts, &mut status, &mut events, &current.name, 1) {
        if wait.is_zero() {
            return Decision { action: Action::Nothing, status, events, requeue: Requeue::After(wait) };
        }
        requeue = requeue.min(wait);
    }
    if let (Some(max_age), Some(created_at)) = (facts.max_age, created_at) {
        let expires = created_at + max_age;
        match expires.duration_since(facts.now) {
            Ok(left) => requeue = requeue.min(left),
            Err(_) => {
                // Older than maxAge: count a rotation, which changes the desired spec hash; the next
                // reconcile creates the replacement. Recording it in status first survives a crash.
                status.max_age_rotations = Some(status.max_age_rotations.unwrap_or(0) + 1);
                events.push(EventSpec::normal(
                    "Replacing",
                    format!("instance {} reached maxAge; replacing it for a new address", current.name),
                ));
                requeue = Duration::ZERO;
            }
        }
    }
    Decision { action: Action::Nothing, status, events, requeue: Requeue::After(requeue) }
}

/// Self-healing: when the instance `name` has been dead (unhealthy, and the failure says it does not answer) for
/// `replaceAfterSeconds` × `factor`, counts a replacement, which changes the desired spec hash; the next reconcile
/// creates the new instance, make-before-break. Returns how long until that is due (zero once counted), or `None`
/// when the instance is not dead or self-healing is off.
fn self_heal(
    facts: &Facts,
    status: &mut ProxyStatus,
    events: &mut Vec<EventSpec>,
    name: &str,
    factor: u32,
) -> Option<Duration> {
    let after = facts.replace_after?;
    let verdict = facts.health.as_ref().filter(|verdict| !verdict.healthy && verdict.dead)?;
    let limit = after.saturating_mul(factor);
    let dead_for = facts.now.duration_since(verdict.since).unwrap_or_default();
    if dead_for < limit {
        return Some(limit - dead_for);
    }
    let count = status.replacements.unwrap_or(0) + 1;
    status.replacements = Some(count);
    events.push(EventSpec::warning(
        "SelfHealing",
        format!(
            "instance {name} has not worked for {}s ({}; replacing after {}s): creating replacement {count}",
            dead_for.as_secs(),
            verdict.last_error.as_deref().unwrap_or("no answer"),
            limit.as_secs()
        ),
    ));
    Some(Duration::ZERO)
}

/// Writes `status.health` and `status.egressIP` from the verdict, only when `healthy` flips (or first appears), so
/// a steady proxy costs no status writes however often it is probed; and `egressCountry`/`egressASN` from the GeoIP
/// databases' answer for that address, when the operator has databases.
fn apply_health(facts: &Facts, status: &mut ProxyStatus, events: &mut Vec<EventSpec>) {
    let Some(verdict) = &facts.health else { return };
    let flipped = status.health.as_ref().is_none_or(|health| health.healthy != verdict.healthy);
    if flipped {
        // A first verdict that is healthy is news the phase already tells (Ready); an Event for it would be one more
        // write per Proxy for a fleet coming up. Recovering from Unhealthy, and every failure, are worth one.
        let recovered = status.health.as_ref().is_some_and(|health| !health.healthy);
        status.health = Some(HealthStatus {
            healthy: verdict.healthy,
            last_transition_time: Some(time(verdict.since)),
            last_error: if verdict.healthy { None } else { verdict.last_error.clone() },
        });
        if !verdict.healthy {
            events.push(EventSpec::warning(
                "Unhealthy",
                format!(
                    "probes through the proxy fail: {}",
                    verdict.last_error.as_deref().unwrap_or("no reason given")
                ),
            ));
        } else if recovered {
            events.push(EventSpec::normal("Healthy", "probes through the proxy succeed again"));
        }
    }
    if verdict.egress_ip.is_some() && verdict.egress_ip != status.egress_ip {
        status.egress_ip = verdict.egress_ip.clone();
    }
    // What the GeoIP databases say about that address, as of this reading (an address they do not know clears it).
    if let Some(geo) = &facts.geo {
        status.egress_country.clone_from(&geo.country);
        status.egress_asn = geo.asn;
    }
}

/// The status after `Create` returned QuotaExceeded, and how long to wait before trying again.
pub fn on_quota_exceeded(facts: &Facts, message: &str, consecutive: u32) -> (ProxyStatus, EventSpec, Duration) {
    let mut status = facts.status.clone();
    status.phase = Some(if status.previous_instance.is_some() { ProxyPhase::Replacing } else { ProxyPhase::Pending });
    let mut decision = Decision { action: Action::Nothing, status, events: Vec::new(), requeue: Requeue::AwaitChange };
    finish_with_reason(facts, &mut decision, Some(("QuotaExceeded", message)));
    let backoff = quota_backoff(consecutive);
    let event = EventSpec::warning(
        "QuotaExceeded",
        format!("the provider refused for lack of quota; retrying in {}s: {message}", backoff.as_secs()),
    );
    (decision.status, event, backoff)
}

/// 1 minute doubling per consecutive refusal, at most 15 minutes.
pub fn quota_backoff(consecutive: u32) -> Duration {
    crate::backoff::Backoff::new(QUOTA_BACKOFF_MIN, QUOTA_BACKOFF_MAX).after(consecutive.max(1))
}

/// The status while creating keeps failing transiently (the provider unreachable, an image still downloading):
/// still Pending (or Replacing), with the provider's message on the conditions so users see why without the
/// operator's log. The reconcile is retried with the error backoff; no Event, since every retry would add one.
pub fn on_transient_failure(facts: &Facts, message: &str) -> ProxyStatus {
    let mut status = facts.status.clone();
    status.phase = Some(if status.previous_instance.is_some() { ProxyPhase::Replacing } else { ProxyPhase::Pending });
    let mut decision = Decision { action: Action::Nothing, status, events: Vec::new(), requeue: Requeue::AwaitChange };
    finish_with_reason(facts, &mut decision, Some(("ProviderRetrying", message)));
    decision.status
}

/// The status after a provider call failed permanently: latched until the spec or the `retry` annotation changes.
pub fn on_permanent_failure(facts: &Facts, message: &str) -> (ProxyStatus, EventSpec) {
    let mut status = facts.status.clone();
    status.phase = Some(ProxyPhase::Failed);
    status.failure = Some(FailureStatus {
        reason: "ProvisioningFailed".into(),
        message: message.to_owned(),
        since: time(facts.now),
        retry_token: facts.retry_token.clone(),
    });
    let mut decision = Decision { action: Action::Nothing, status, events: Vec::new(), requeue: Requeue::AwaitChange };
    finish(facts, &mut decision);
    let event = EventSpec::warning(
        "ProvisioningFailed",
        format!("{message}; fix the spec or change the crawl.example.com/retry annotation to try again"),
    );
    (decision.status, event)
}

/// What cleanup of a deleted Proxy should do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CleanupDecision {
    /// Remove the finalizer now.
    Release {
        /// An Event to publish first.
        event: Option<EventSpec>,
    },
    /// The provider is not configured: nothing can be deleted; warn and retry.
    ProviderMissing,
    /// Delete these instances, then look again.
    Delete {
        /// The provider IDs still present.
        provider_ids: Vec<String>,
    },
}

/// Decides cleanup from the Proxy's mode, annotations, and the instances that still exist for it.
pub fn decide_cleanup(
    mode: ProxyMode,
    skip_cleanup: bool,
    provider_configured: bool,
    recorded_instance: bool,
    remaining: &[String],
) -> CleanupDecision {
    if mode == ProxyMode::External {
        return CleanupDecision::Release { event: None };
    }
    if skip_cleanup {
        return CleanupDecision::Release {
            event: Some(EventSpec::warning(
                "CleanupSkipped",
                "crawl.example.com/skip-cleanup is set: releasing the Proxy without deleting its instances",
            )),
        };
    }
    if !provider_configured {
        // Nothing was ever recorded, so nothing can be left to delete (an instance whose creation never reached
        // the status would have needed this provider to be configured to exist at all; should one appear, the
        // orphan collector finds it by its tags once the provider is back).
        if !recorded_instance {
            return CleanupDecision::Release { event: None };
        }
        return CleanupDecision::ProviderMissing;
    }
    if remaining.is_empty() {
        CleanupDecision::Release { event: None }
    } else {
        CleanupDecision::Delete { provider_ids: remaining.to_vec() }
    }
}

/// Sets `observedGeneration` and the conditions from the decided status.
fn finish(facts: &Facts, decision: &mut Decision) {
    finish_with_reason(facts, decision, None);
}

fn finish_with_reason(facts: &Facts, decision: &mut Decision, override_reason: Option<(&'static str, &str)>) {
    let status = &mut decision.status;
    status.observed_generation = facts.generation;
    let phase = status.phase.unwrap_or(ProxyPhase::Pending);
    let phase_name = format!("{phase:?}");
    let running = status.instance.as_ref().is_some_and(|instance| instance.state == InstanceState::Running);
    let (provisioned, provisioned_reason, provisioned_message) = match (facts.mode, override_reason) {
        (ProxyMode::External, _) => ("True", "External".to_owned(), "the proxy exists outside the operator".to_owned()),
        (_, Some((reason, message))) => ("False", reason.to_owned(), message.to_owned()),
        (_, None) if running => ("True", "InstanceRunning".to_owned(), instance_message(status.instance.as_ref())),
        (_, None) if phase == ProxyPhase::Failed => (
            "False",
            "ProvisioningFailed".to_owned(),
            status.failure.as_ref().map(|failure| failure.message.clone()).unwrap_or_default(),
        ),
        (_, None) => ("False", phase_name.clone(), "the instance is not running yet".to_owned()),
    };
    let (healthy, healthy_reason, healthy_message) = match &status.health {
        Some(health) if health.healthy => ("True", "ProbesSucceed", String::new()),
        Some(health) => ("False", "ProbesFail", health.last_error.clone().unwrap_or_default()),
        None => ("Unknown", "NotProbedYet", "no health verdict yet".to_owned()),
    };
    let serving = status.endpoint.is_some() && status.health.as_ref().is_some_and(|health| health.healthy);
    let ready = serving && matches!(phase, ProxyPhase::Ready | ProxyPhase::Replacing);
    let (ready_reason, ready_message) = match override_reason {
        Some((reason, message)) => (reason.to_owned(), message.to_owned()),
        None if ready => (phase_name.clone(), "the proxy is healthy and handed out".to_owned()),
        None => (phase_name.clone(), format!("phase {phase_name}")),
    };
    let desired = [
        ConditionSpec {
            type_: CONDITION_READY,
            status: if ready { "True" } else { "False" },
            reason: ready_reason,
            message: ready_message,
        },
        ConditionSpec {
            type_: CONDITION_PROVISIONED,
            status: provisioned,
            reason: provisioned_reason,
            message: provisioned_message,
        },
        ConditionSpec {
            type_: CONDITION_HEALTHY,
            status: healthy,
            reason: healthy_reason.to_owned(),
            message: healthy_message,
        },
    ];
    status.conditions = merge_conditions(&facts.status.conditions, &desired, facts.generation, facts.now);
}

fn instance_message(instance: Option<&InstanceStatus>) -> String {
    instance
        .map(|instance| format!("instance {} runs at {}", instance.name, instance.ip.as_deref().unwrap_or("?")))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests;
