//! Health engine metrics: probes by result, probe latency, and targets by verdict.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    /// `ok` or the failure reason's kind.
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerdictLabels {
    verdict: &'static str,
}

/// The engine's metrics. Cloning shares them.
#[derive(Clone)]
pub struct HealthMetrics {
    probes: Family<ResultLabels, Counter>,
    latency: Histogram,
    targets: Family<VerdictLabels, Gauge>,
}

impl Default for HealthMetrics {
    fn default() -> Self {
        Self {
            probes: Family::default(),
            latency: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            targets: Family::default(),
        }
    }
}

/// A probe's results: `ok` or the failure's reason.
const RESULTS: [&str; 10] = [
    "ok",
    "connect_refused",
    "connect_timeout",
    "connect_failed",
    "proxy_auth_required",
    "connect_status",
    "tls",
    "origin_status",
    "timeout",
    "protocol",
];

impl HealthMetrics {
    /// Creates the metrics and registers them under the `health` prefix of `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        let registry = registry.sub_registry_with_prefix("health");
        registry.register("probes", "Health probes by result (ok or the failure reason)", metrics.probes.clone());
        registry.register("probe_duration_seconds", "Duration of successful health probes", metrics.latency.clone());
        registry.register("targets", "Probed endpoints by verdict", metrics.targets.clone());
        // At 0 from the start on every replica (probes run on the leader only): dashboards and alerts see 0.
        for result in RESULTS {
            let _ = metrics.probes.get_or_create(&ResultLabels { result });
        }
        metrics.targets(0, 0, 0);
        metrics
    }

    pub(crate) fn probe(&self, result: &'static str, seconds: Option<f64>) {
        self.probes.get_or_create(&ResultLabels { result }).inc();
        if let Some(seconds) = seconds {
            self.latency.observe(seconds);
        }
    }

    pub(crate) fn targets(&self, healthy: i64, unhealthy: i64, unknown: i64) {
        for (verdict, count) in [("healthy", healthy), ("unhealthy", unhealthy), ("unknown", unknown)] {
            self.targets.get_or_create(&VerdictLabels { verdict }).set(count);
        }
    }

    /// Probes recorded so far, whatever their result (for tests and benchmarks).
    pub fn probes_total(&self) -> u64 {
        RESULTS.into_iter().map(|result| self.probes.get_or_create(&ResultLabels { result }).get()).sum()
    }
}
