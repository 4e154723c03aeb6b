//! Reconciler metrics: reconciles by result and their duration, errors by kind, proxies by phase and provider, and
//! orphans deleted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use egress_api::ProxyPhase;
use egress_fleet::ProxyId;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: String,
    /// The Proxy's `spec.provider`, or `external` for an External Proxy.
    provider: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OrphanLabels {
    provider: String,
    reason: &'static str,
}

/// The reconciler's metrics. Cloning shares them.
#[derive(Clone)]
pub struct ReconcileMetrics {
    reconciles: Family<ResultLabels, Counter>,
    duration: Family<ResultLabels, Histogram>,
    errors: Family<KindLabels, Counter>,
    proxies: Family<PhaseLabels, Gauge>,
    phases: Arc<Mutex<HashMap<ProxyId, (ProxyPhase, String)>>>,
    orphans: Family<OrphanLabels, Counter>,
}

/// A reconcile's results.
const RESULTS: [&str; 3] = ["ok", "error", "cancelled"];

/// Every phase, so each has its gauge from the start (at 0) for every provider, which dashboards expect.
const PHASES: [ProxyPhase; 8] = [
    ProxyPhase::Pending,
    ProxyPhase::Provisioning,
    ProxyPhase::Running,
    ProxyPhase::Ready,
    ProxyPhase::Unhealthy,
    ProxyPhase::Replacing,
    ProxyPhase::Deleting,
    ProxyPhase::Failed,
];

impl Default for ReconcileMetrics {
    fn default() -> Self {
        Self {
            reconciles: Family::default(),
            duration: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 16))),
            errors: Family::default(),
            proxies: Family::default(),
            phases: Arc::default(),
            orphans: Family::default(),
        }
    }
}

impl ReconcileMetrics {
    /// Creates the metrics and registers them under the `reconcile` prefix of `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        let registry = registry.sub_registry_with_prefix("reconcile");
        registry.register("reconciles", "Proxy reconciles by result", metrics.reconciles.clone());
        registry.register("duration_seconds", "Proxy reconcile duration by result", metrics.duration.clone());
        registry.register("errors", "Reconcile errors by kind", metrics.errors.clone());
        registry.register("proxies", "Proxies by phase", metrics.proxies.clone());
        registry.register(
            "orphans_deleted",
            "Orphaned instances deleted, by provider and reason",
            metrics.orphans.clone(),
        );
        // At 0 from the start on every replica (the controller runs on the leader only): dashboards and alerts see
        // 0, not no data.
        for result in RESULTS {
            let _ = metrics.reconciles.get_or_create(&ResultLabels { result });
            let _ = metrics.duration.get_or_create(&ResultLabels { result });
        }
        for kind in crate::error::Error::KINDS {
            let _ = metrics.errors.get_or_create(&KindLabels { kind });
        }
        metrics
    }

    /// How many reconciles have finished, whatever their result.
    pub fn reconciles_total(&self) -> u64 {
        RESULTS.into_iter().map(|result| self.reconciles.get_or_create(&ResultLabels { result }).get()).sum()
    }

    /// Starts timing one reconcile; the guard records it when dropped (also when the reconcile is cancelled).
    pub(crate) fn start(&self) -> ReconcileTimer {
        ReconcileTimer { metrics: self.clone(), started: Instant::now(), result: "cancelled" }
    }

    pub(crate) fn error(&self, kind: &'static str) {
        self.errors.get_or_create(&KindLabels { kind }).inc();
    }

    /// Puts every phase's gauge at 0 for each of `providers` (the configured ones, and `external`), so a
    /// dashboard sees every series from the start.
    pub fn expect_providers<'a>(&self, providers: impl IntoIterator<Item = &'a str>) {
        for provider in providers {
            for phase in PHASES {
                let _ =
                    self.proxies.get_or_create(&PhaseLabels { phase: format!("{phase:?}"), provider: provider.into() });
            }
        }
    }

    /// Records the phase of one Proxy (`namespace/name`) on `provider` (`None` when it is gone) and moves it between
    /// the per-phase gauges: O(1), whatever the fleet's size.
    pub(crate) fn phase(&self, proxy: &ProxyId, state: Option<(ProxyPhase, &str)>) {
        let mut phases = self.phases.lock().expect("phase map");
        let state = state.map(|(phase, provider)| (phase, provider.to_owned()));
        let previous = match &state {
            Some(state) => phases.insert(proxy.clone(), state.clone()),
            None => phases.remove(proxy),
        };
        if previous == state {
            return;
        }
        let gauge = |(phase, provider): (ProxyPhase, String)| {
            self.proxies.get_or_create(&PhaseLabels { phase: format!("{phase:?}"), provider }).clone()
        };
        if let Some(previous) = previous {
            gauge(previous).dec();
        }
        if let Some(state) = state {
            gauge(state).inc();
        }
    }

    pub(crate) fn orphan_deleted(&self, provider: &str, reason: &'static str) {
        self.orphans.get_or_create(&OrphanLabels { provider: provider.to_owned(), reason }).inc();
    }
}

/// Records a reconcile's duration and result when dropped.
pub(crate) struct ReconcileTimer {
    metrics: ReconcileMetrics,
    started: Instant,
    result: &'static str,
}

impl ReconcileTimer {
    pub(crate) fn finish(mut self, ok: bool) {
        self.result = if ok { "ok" } else { "error" };
    }
}

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        let labels = ResultLabels { result: self.result };
        self.metrics.reconciles.get_or_create(&labels).inc();
        self.metrics.duration.get_or_create(&labels).observe(self.started.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(metrics: &ReconcileMetrics, phase: ProxyPhase, provider: &str) -> i64 {
        metrics.proxies.get_or_create(&PhaseLabels { phase: format!("{phase:?}"), provider: provider.into() }).get()
    }

    #[test]
    fn proxies_move_between_phase_gauges_per_provider() {
        let metrics = ReconcileMetrics::default();
        metrics.expect_providers(["pods", "external"]);
        let mut text = String::new();
        let mut registry = Registry::default();
        registry.register("proxies", "", metrics.proxies.clone());
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        assert_eq!(text.lines().filter(|line| line.starts_with("proxies{")).count(), 2 * PHASES.len(), "{text}");
        assert!(PHASES.iter().all(|phase| count(&metrics, *phase, "pods") == 0), "every phase starts at 0");
        metrics.phase(&ProxyId::new("ns", "a"), Some((ProxyPhase::Running, "pods")));
        metrics.phase(&ProxyId::new("ns", "b"), Some((ProxyPhase::Running, "pods")));
        metrics.phase(&ProxyId::new("ns", "a"), Some((ProxyPhase::Ready, "pods")));
        metrics.phase(&ProxyId::new("ns", "a"), Some((ProxyPhase::Ready, "pods")));
        metrics.phase(&ProxyId::new("ns", "x"), Some((ProxyPhase::Ready, "external")));
        assert_eq!((count(&metrics, ProxyPhase::Running, "pods"), count(&metrics, ProxyPhase::Ready, "pods")), (1, 1));
        assert_eq!(count(&metrics, ProxyPhase::Ready, "external"), 1);
        // A Proxy moved to another provider (a spec change) leaves the first provider's gauge.
        metrics.phase(&ProxyId::new("ns", "b"), Some((ProxyPhase::Running, "vms")));
        assert_eq!((count(&metrics, ProxyPhase::Running, "pods"), count(&metrics, ProxyPhase::Running, "vms")), (0, 1));
        metrics.phase(&ProxyId::new("ns", "b"), None);
        metrics.phase(&ProxyId::new("ns", "b"), None);
        metrics.phase(&ProxyId::new("ns", "gone"), None);
        assert_eq!((count(&metrics, ProxyPhase::Running, "vms"), count(&metrics, ProxyPhase::Ready, "pods")), (0, 1));
    }
}
