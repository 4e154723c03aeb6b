//! Reconciler metrics: reconciles by result and their duration, errors by kind, proxies by phase, and orphans
//! deleted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use egress_api::ProxyPhase;
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
    phases: Arc<Mutex<HashMap<String, ProxyPhase>>>,
    orphans: Family<OrphanLabels, Counter>,
}

/// Every phase, so each has its gauge from the start (at 0), which dashboards expect.
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
        let proxies: Family<PhaseLabels, Gauge> = Family::default();
        for phase in PHASES {
            let _ = proxies.get_or_create(&PhaseLabels { phase: format!("{phase:?}") });
        }
        Self {
            reconciles: Family::default(),
            duration: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 16))),
            errors: Family::default(),
            proxies,
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
        metrics
    }

    /// How many reconciles have finished, whatever their result.
    pub fn reconciles_total(&self) -> u64 {
        ["ok", "error", "cancelled"]
            .into_iter()
            .map(|result| self.reconciles.get_or_create(&ResultLabels { result }).get())
            .sum()
    }

    /// Starts timing one reconcile; the guard records it when dropped (also when the reconcile is cancelled).
    pub(crate) fn start(&self) -> ReconcileTimer {
        ReconcileTimer { metrics: self.clone(), started: Instant::now(), result: "cancelled" }
    }

    pub(crate) fn error(&self, kind: &'static str) {
        self.errors.get_or_create(&KindLabels { kind }).inc();
    }

    /// Records the phase of one Proxy (`namespace/name`; `None` when it is gone) and moves it between the
    /// per-phase gauges: O(1), whatever the fleet's size.
    pub(crate) fn phase(&self, proxy: &str, phase: Option<ProxyPhase>) {
        let mut phases = self.phases.lock().expect("phase map");
        let previous = match phase {
            Some(phase) => phases.insert(proxy.to_owned(), phase),
            None => phases.remove(proxy),
        };
        if previous == phase {
            return;
        }
        let gauge =
            |phase: ProxyPhase| self.proxies.get_or_create(&PhaseLabels { phase: format!("{phase:?}") }).clone();
        if let Some(previous) = previous {
            gauge(previous).dec();
        }
        if let Some(phase) = phase {
            gauge(phase).inc();
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

    fn count(metrics: &ReconcileMetrics, phase: ProxyPhase) -> i64 {
        metrics.proxies.get_or_create(&PhaseLabels { phase: format!("{phase:?}") }).get()
    }

    #[test]
    fn proxies_move_between_phase_gauges() {
        let metrics = ReconcileMetrics::default();
        assert!(PHASES.iter().all(|phase| count(&metrics, *phase) == 0), "every phase starts at 0");
        metrics.phase("ns/a", Some(ProxyPhase::Running));
        metrics.phase("ns/b", Some(ProxyPhase::Running));
        metrics.phase("ns/a", Some(ProxyPhase::Ready));
        metrics.phase("ns/a", Some(ProxyPhase::Ready));
        assert_eq!((count(&metrics, ProxyPhase::Running), count(&metrics, ProxyPhase::Ready)), (1, 1));
        metrics.phase("ns/b", None);
        metrics.phase("ns/b", None);
        metrics.phase("ns/gone", None);
        assert_eq!((count(&metrics, ProxyPhase::Running), count(&metrics, ProxyPhase::Ready)), (0, 1));
    }
}
