//! Health verdicts as the operator keys them: one [`Verdicts`] store, keyed by Proxy and probed endpoint.
//!
//! The health engine alone writes the store (seeded from the status through it); the reconciler and the discovery
//! view read the same one, through [`current_verdict`], so they cannot disagree. Keying by endpoint as well as Proxy
//! matters during a replacement: the new instance is probed, and must be healthy, before the Proxy's endpoint
//! switches to it.

use std::time::SystemTime;

use egress_api::{Endpoint, Proxy, ProxyMode};
use egress_health::{CurrentVerdict, Verdicts};
use kube::runtime::reflector::ObjectRef;

use crate::feed::GuardedProxy;
use crate::status::system_time;

/// Which endpoint of which Proxy a verdict is about.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProbeKey {
    /// The Proxy.
    pub proxy: ObjectRef<GuardedProxy>,
    /// The endpoint that is probed.
    pub endpoint: Endpoint,
}

impl ProbeKey {
    /// The key of `endpoint` of the Proxy `namespace/name`.
    pub fn new(namespace: &str, name: &str, endpoint: Endpoint) -> Self {
        Self { proxy: ObjectRef::new(name).within(namespace), endpoint }
    }

    /// The key of `endpoint` of the Proxy `proxy`.
    pub fn of(proxy: &egress_fleet::ProxyId, endpoint: Endpoint) -> Self {
        Self { proxy: crate::ids::proxy_ref(proxy), endpoint }
    }
}

/// The operator's one verdict store.
pub type ProxyVerdicts = Verdicts<ProbeKey>;

/// A verdict as the state machine reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Whether probes get through (after the thresholds).
    pub healthy: bool,
    /// When `healthy` last flipped.
    pub since: SystemTime,
    /// Why the last failing probe failed.
    pub last_error: Option<String>,
    /// The address the probe target saw, when it echoes one.
    pub egress_ip: Option<String>,
    /// Whether the last failure says the proxy itself is dead (no connection, no answer, or garbage) rather than
    /// refusing for a reason of its own (credentials, its policy, the origin's answer): what self-healing acts on.
    pub dead: bool,
}

impl From<CurrentVerdict> for Verdict {
    fn from(verdict: CurrentVerdict) -> Self {
        Self {
            healthy: verdict.healthy,
            since: verdict.since,
            dead: !verdict.healthy && verdict.last_error.as_ref().is_some_and(egress_health::FailureReason::means_dead),
            last_error: verdict.last_error.map(|reason| reason.to_string()),
            egress_ip: verdict.egress_ip.map(|ip| ip.to_string()),
        }
    }
}

/// The verdict of `key`: the engine's, else the one the Proxy's status records for exactly that endpoint. The
/// status answers while the engine has not (yet) formed or seeded one: on a replica that does not lead (it runs no
/// engine, so the leader's verdicts reach it through the status), and on a new leader before its engine has taken
/// the target, so a Proxy that was Ready stays Ready (and leasable) across a restart or a change of leader. Every
/// reader of verdicts goes through here, so none can act on "no verdict" for a Proxy whose status has one.
pub fn current_verdict(verdicts: &ProxyVerdicts, proxy: &Proxy, key: &ProbeKey) -> Option<CurrentVerdict> {
    verdicts.get(key).or_else(|| status_verdict(proxy, key))
}

/// The verdict the Proxy's status records for exactly the endpoint of `key`: what the health feed seeds the engine
/// with.
pub fn status_verdict(proxy: &Proxy, key: &ProbeKey) -> Option<CurrentVerdict> {
    let status = proxy.status.as_ref()?;
    let health = status.health.as_ref()?;
    // The recorded verdict is about the published endpoint: the old instance's until a replacement switches, the
    // new one's from the switch's write on (it records the new instance's verdict). A new instance not yet published
    // starts unknown: its endpoint is not the published one. Only when a replacement's two instances share an
    // address can the status not say which of them it describes.
    let published = match proxy.spec.mode {
        ProxyMode::External => proxy.spec.endpoint.clone(),
        ProxyMode::Managed => status.endpoint.as_ref().map(Endpoint::from),
    };
    let ambiguous = status.previous_instance.as_ref().is_some_and(|previous| {
        previous.ip.is_some() && previous.ip == status.instance.as_ref().and_then(|instance| instance.ip.clone())
    });
    if published.as_ref() != Some(&key.endpoint) || ambiguous {
        return None;
    }
    let since = health.last_transition_time.as_ref().map_or_else(SystemTime::now, system_time);
    let egress_ip = status.egress_ip.as_deref().and_then(|ip| ip.parse().ok());
    Some(CurrentVerdict { healthy: health.healthy, since, last_error: None, egress_ip })
}

/// The verdict for `endpoint` of `proxy`, as the state machine reads it (see [`current_verdict`]).
pub fn verdict_of(verdicts: &ProxyVerdicts, proxy: &Proxy, endpoint: &Endpoint) -> Option<Verdict> {
    let key = ProbeKey::of(&crate::ids::proxy_id(proxy), endpoint.clone());
    current_verdict(verdicts, proxy, &key).map(Verdict::from)
}
