//! Health verdicts as the reconciler reads them: a shared board keyed by Proxy and endpoint.
//!
//! The health engine writes verdicts here and sends the Proxy's reference on a channel that triggers a reconcile
//! (`Controller::reconcile_on`); the reconciler reads the verdict for the endpoint it is deciding about. Keying by
//! endpoint as well as Proxy matters during a replacement: the new instance is probed, and must be healthy, before
//! the Proxy's endpoint switches to it.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

/// Which proxy endpoint a verdict is about.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HealthKey {
    /// The Proxy's namespace.
    pub namespace: String,
    /// The Proxy's name.
    pub name: String,
    /// `host:port` that was probed.
    pub address: String,
}

/// The health engine's current verdict for one endpoint.
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

/// The shared verdict map. Cloning shares it.
#[derive(Clone, Default)]
pub struct HealthBoard(Arc<RwLock<HashMap<HealthKey, Verdict>>>);

impl HealthBoard {
    /// An empty board.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a verdict.
    pub fn set(&self, key: HealthKey, verdict: Verdict) {
        self.0.write().expect("health board lock").insert(key, verdict);
    }

    /// Forgets a verdict (the endpoint is no longer probed).
    pub fn remove(&self, key: &HealthKey) {
        self.0.write().expect("health board lock").remove(key);
    }

    /// The current verdict for one endpoint of one Proxy.
    pub fn get(&self, namespace: &str, name: &str, address: &str) -> Option<Verdict> {
        let key = HealthKey { namespace: namespace.to_owned(), name: name.to_owned(), address: address.to_owned() };
        self.0.read().expect("health board lock").get(&key).cloned()
    }
}
