//! Health verdicts as the operator keys them: one [`Verdicts`] store, keyed by Proxy and probed endpoint.
//!
//! The health engine writes the store; the reconciler and the discovery view read the same one, so they cannot
//! disagree. Keying by endpoint as well as Proxy matters during a replacement: the new instance is probed, and must be
//! healthy, before the Proxy's endpoint switches to it.

use std::time::SystemTime;

use egress_api::Endpoint;
use egress_health::{CurrentVerdict, Verdicts};
use kube::runtime::reflector::ObjectRef;

use crate::feed::GuardedProxy;

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
}

impl From<CurrentVerdict> for Verdict {
    fn from(verdict: CurrentVerdict) -> Self {
        Self {
            healthy: verdict.healthy,
            since: verdict.since,
            last_error: verdict.last_error.map(|reason| reason.to_string()),
            egress_ip: verdict.egress_ip.map(|ip| ip.to_string()),
        }
    }
}

/// The verdict for `endpoint` of the Proxy `namespace/name`.
pub fn verdict_of(verdicts: &ProxyVerdicts, namespace: &str, name: &str, endpoint: &Endpoint) -> Option<Verdict> {
    verdicts.get(&ProbeKey::new(namespace, name, endpoint.clone())).map(Verdict::from)
}
