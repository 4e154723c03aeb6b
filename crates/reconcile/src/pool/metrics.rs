//! Pool metrics: members per pool by state, scaling decisions by reason, and pool reconciles by result.

use egress_fleet::PoolId;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolStateLabels {
    pool: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// The states `egress_pool_replicas` reports for each pool.
const STATES: [&str; 5] = ["desired", "current", "ready", "leased", "updated"];

/// The pool controller's metrics. Cloning shares them.
#[derive(Clone, Default)]
pub struct PoolMetrics {
    replicas: Family<PoolStateLabels, Gauge>,
    decisions: Family<ReasonLabels, Counter>,
    reconciles: Family<ResultLabels, Counter>,
}

/// One pool's member counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolCounts {
    /// `spec.replicas` after this pass's scaling decision.
    pub desired: u32,
    /// Members that exist and are not being deleted.
    pub current: u32,
    /// Ready members.
    pub ready: u32,
    /// Members holding a lease.
    pub leased: u32,
    /// Members on the current template and not replacing.
    pub updated: u32,
}

impl PoolMetrics {
    /// Creates the metrics and registers them under the `pool` prefix of `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        let registry = registry.sub_registry_with_prefix("pool");
        registry.register(
            "replicas",
            "Members of each pool (namespace/name) by state: desired, current, ready, leased, updated",
            metrics.replicas.clone(),
        );
        registry.register(
            "scaling_decisions",
            "Changes of a pool's spec.replicas by reason (the autoscaler's reasons, Created and Manual)",
            metrics.decisions.clone(),
        );
        registry.register("reconciles", "Pool reconciles by result", metrics.reconciles.clone());
        // At 0 from the start on every replica (the pool controller runs on the leader only).
        for reason in crate::pool::decide::ScaleReason::ALL
            .map(crate::pool::decide::ScaleReason::as_str)
            .into_iter()
            .chain(["Created", "Manual"])
        {
            let _ = metrics.decisions.get_or_create(&ReasonLabels { reason });
        }
        for result in ["ok", "error"] {
            let _ = metrics.reconciles.get_or_create(&ResultLabels { result });
        }
        metrics
    }

    pub(crate) fn counts(&self, pool: &PoolId, counts: PoolCounts) {
        let values = [counts.desired, counts.current, counts.ready, counts.leased, counts.updated];
        for (state, value) in STATES.into_iter().zip(values) {
            self.replicas.get_or_create(&PoolStateLabels { pool: pool.to_string(), state }).set(i64::from(value));
        }
    }

    /// Drops a deleted pool's gauges, so a pool that is gone is not reported below its desired
    /// count for ever.
    pub fn forget(&self, pool: &PoolId) {
        for state in STATES {
            self.replicas.remove(&PoolStateLabels { pool: pool.to_string(), state });
        }
    }

    pub(crate) fn decision(&self, reason: &'static str) {
        self.decisions.get_or_create(&ReasonLabels { reason }).inc();
    }

    /// How many scaling decisions were made for `reason`.
    pub fn decisions(&self, reason: &'static str) -> u64 {
        self.decisions.get_or_create(&ReasonLabels { reason }).get()
    }

    /// How many pool reconciles ended well (`ok`) or with an error.
    pub fn reconciles(&self, ok: bool) -> u64 {
        self.reconciles.get_or_create(&ResultLabels { result: if ok { "ok" } else { "error" } }).get()
    }

    pub(crate) fn reconciled(&self, ok: bool) {
        self.reconciles.get_or_create(&ResultLabels { result: if ok { "ok" } else { "error" } }).inc();
    }
}
