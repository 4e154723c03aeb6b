//! Discovery metrics: requests by route and status with latency, leases granted and denied by reason, active
//! leases, expired leases, cooldowns started and written, leases adopted, and per tenant (a bounded set: the
//! tenants the token file names) leases held, granted and refused, and reports.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: &'static str,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: &'static str,
}

/// The routes by their path templates, so labels are static strings (no allocation per request).
const ROUTES: [&str; 10] = [
    "/v1/proxies",
    "/v1/refusals",
    "/v1/leases",
    "/v1/leases/{id}",
    "/v1/leases/{id}/renew",
    "/v1/leases/{id}/report",
    "/v1/cooldowns",
    "/healthz",
    "/readyz",
    "/openapi.json",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabels {
    tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantReasonLabels {
    tenant: String,
    reason: String,
}

/// The reasons a lease is refused for want of a proxy or of the state, each with its series from the start.
const DENIED_REASONS: [&str; 4] = ["none-healthy", "all-at-capacity", "all-cooling-down", "state-unavailable"];

/// The outcomes crawlers report.
const OUTCOMES: [&str; 4] = ["ok", "failed", "banned", "throttled"];

/// The discovery server's metrics. Cloning shares them.
#[derive(Clone)]
pub struct DiscoveryMetrics {
    requests: Family<RequestLabels, Counter>,
    latency: Family<RouteLabels, Histogram>,
    granted: Counter,
    denied: Family<ReasonLabels, Counter>,
    active: Gauge,
    expired: Counter,
    cooldowns: Counter,
    cleared: Counter,
    cooldown_writes: Family<ResultLabels, Counter>,
    outcomes: Family<OutcomeLabels, Counter>,
    adopted: Counter,
    not_serving: Counter,
    tenant_active: Family<TenantLabels, Gauge>,
    tenant_granted: Family<TenantLabels, Counter>,
    tenant_refused: Family<TenantReasonLabels, Counter>,
    tenant_reports: Family<TenantLabels, Counter>,
    refusal_streams: Gauge,
    refusals_sent: Counter,
}

impl Default for DiscoveryMetrics {
    fn default() -> Self {
        Self {
            requests: Family::default(),
            latency: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.0001, 2.0, 16))),
            granted: Counter::default(),
            denied: Family::default(),
            active: Gauge::default(),
            expired: Counter::default(),
            cooldowns: Counter::default(),
            cleared: Counter::default(),
            cooldown_writes: Family::default(),
            outcomes: Family::default(),
            adopted: Counter::default(),
            not_serving: Counter::default(),
            tenant_active: Family::default(),
            tenant_granted: Family::default(),
            tenant_refused: Family::default(),
            tenant_reports: Family::default(),
            refusal_streams: Gauge::default(),
            refusals_sent: Counter::default(),
        }
    }
}

impl DiscoveryMetrics {
    /// Creates the metrics and registers them under the `discovery` prefix of `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        let registry = registry.sub_registry_with_prefix("discovery");
        registry.register("requests", "HTTP requests by route and status", metrics.requests.clone());
        registry.register("request_duration_seconds", "HTTP request latency by route", metrics.latency.clone());
        registry.register("leases_granted", "Leases granted", metrics.granted.clone());
        registry.register("leases_denied", "Lease requests refused, by reason", metrics.denied.clone());
        registry.register("leases_active", "Leases currently held", metrics.active.clone());
        registry.register("leases_expired", "Leases released because they expired", metrics.expired.clone());
        registry.register(
            "cooldowns_started",
            "Ban reports that started or lengthened a cooldown (a ban from an owner already counted in the running one \
             changes nothing)",
            metrics.cooldowns.clone(),
        );
        registry.register(
            "cooldowns_cleared",
            "Running cooldowns an administrator ended (DELETE /v1/cooldowns)",
            metrics.cleared.clone(),
        );
        registry.register(
            "cooldown_writes",
            "Writes of a proxy's cooldowns to the apiserver (each covers every ban reported while the one before was \
             in flight), by result",
            metrics.cooldown_writes.clone(),
        );
        registry.register(
            "request_outcomes",
            "Requests crawlers reported through leases, by outcome (ok, failed, banned, throttled); per proxy and \
             site, see successRate on GET /v1/proxies?target=",
            metrics.outcomes.clone(),
        );
        registry.register(
            "leases_adopted",
            "Leases taken over from IDs this process had not issued (granted before a restart or a change of leader)",
            metrics.adopted.clone(),
        );
        registry.register(
            "not_serving",
            "Requests refused with reason not-serving: this replica is a follower, shutting down, or has not read the \
             fleet yet (with the shipped egress-discovery Service, which routes to the leader only, this stays 0 \
             outside a failover)",
            metrics.not_serving.clone(),
        );
        registry.register("tenant_leases_active", "Leases held, by tenant", metrics.tenant_active.clone());
        registry.register("tenant_leases_granted", "Leases granted, by tenant", metrics.tenant_granted.clone());
        registry.register(
            "tenant_refusals",
            "Lease, renew and report requests refused, by tenant and reason (quota-max-leases and \
             quota-reports-per-minute for a quota, else the lease refusal's reason)",
            metrics.tenant_refused.clone(),
        );
        registry.register("tenant_reports", "Reports accepted, by tenant", metrics.tenant_reports.clone());
        registry.register(
            "refusal_streams",
            "Open GET /v1/refusals streams (each gateway replica keeps one per tenant it has served)",
            metrics.refusal_streams.clone(),
        );
        registry.register(
            "refusals_sent",
            "Refusals sent on GET /v1/refusals streams (one per stream that heard it, snapshots included)",
            metrics.refusals_sent.clone(),
        );
        // Series a dashboard or an alert reads, at 0 from the start on every replica (a follower included), so a
        // panel shows 0 rather than no data before the first event.
        for reason in DENIED_REASONS {
            let _ = metrics.denied.get_or_create(&ReasonLabels { reason: reason.to_owned() });
        }
        for outcome in OUTCOMES {
            let _ = metrics.outcomes.get_or_create(&OutcomeLabels { outcome });
        }
        for result in ["ok", "error"] {
            let _ = metrics.cooldown_writes.get_or_create(&ResultLabels { result });
        }
        metrics
    }

    /// Puts the per-tenant lease gauges and counters of `tenants` (the token file's) at 0, so every tenant has its
    /// series before its first lease.
    pub fn expect_tenants<'a>(&self, tenants: impl IntoIterator<Item = &'a str>) {
        for tenant in tenants {
            let labels = TenantLabels { tenant: tenant.to_owned() };
            let _ = self.tenant_active.get_or_create(&labels);
            let _ = self.tenant_granted.get_or_create(&labels);
        }
    }

    /// A refusal stream opened; it counts as open until the guard drops.
    pub(crate) fn refusal_stream(&self) -> StreamGuard {
        self.refusal_streams.inc();
        StreamGuard(self.refusal_streams.clone())
    }

    pub(crate) fn refusal_sent(&self) {
        self.refusals_sent.inc();
    }

    pub(crate) fn tenant_granted(&self, tenant: &str) {
        self.tenant_granted.get_or_create(&TenantLabels { tenant: tenant.to_owned() }).inc();
    }

    pub(crate) fn tenant_refused(&self, tenant: &str, reason: &str) {
        self.tenant_refused
            .get_or_create(&TenantReasonLabels { tenant: tenant.to_owned(), reason: reason.to_owned() })
            .inc();
    }

    pub(crate) fn tenant_reported(&self, tenant: &str) {
        self.tenant_reports.get_or_create(&TenantLabels { tenant: tenant.to_owned() }).inc();
    }

    /// Sets each tenant's held leases: every tenant in `tenants` (0 when it holds none), and every holder.
    pub(crate) fn set_tenant_active<'a>(
        &self,
        tenants: impl Iterator<Item = &'a str>,
        held: &std::collections::BTreeMap<String, usize>,
    ) {
        for tenant in tenants {
            let count = held.get(tenant).copied().unwrap_or(0);
            self.tenant_active.get_or_create(&TenantLabels { tenant: tenant.to_owned() }).set(count as i64);
        }
        for (tenant, count) in held {
            self.tenant_active.get_or_create(&TenantLabels { tenant: tenant.clone() }).set(*count as i64);
        }
    }

    pub(crate) fn request(&self, route: Option<&str>, status: u16, latency: Duration) {
        let route =
            route.and_then(|route| ROUTES.iter().find(|known| **known == route)).copied().unwrap_or("unmatched");
        self.requests.get_or_create(&RequestLabels { route, status }).inc();
        self.latency.get_or_create(&RouteLabels { route }).observe(latency.as_secs_f64());
    }

    pub(crate) fn granted(&self) {
        self.granted.inc();
        self.active.inc();
    }

    pub(crate) fn not_serving(&self) {
        self.not_serving.inc();
    }

    pub(crate) fn denied(&self, reason: &str) {
        self.denied.get_or_create(&ReasonLabels { reason: reason.to_owned() }).inc();
    }

    pub(crate) fn expired(&self, count: usize) {
        self.expired.inc_by(count as u64);
    }

    pub(crate) fn set_active(&self, count: u64) {
        self.active.set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    pub(crate) fn cooldown_started(&self) {
        self.cooldowns.inc();
    }

    pub(crate) fn cooldowns_cleared(&self, count: usize) {
        self.cleared.inc_by(u64::try_from(count).unwrap_or(u64::MAX));
    }

    pub(crate) fn reported(&self, report: &egress_lease::Report) {
        use egress_lease::Outcome;
        let add = |outcome: &'static str, count: u64| {
            if count > 0 {
                self.outcomes.get_or_create(&OutcomeLabels { outcome }).inc_by(count);
            }
        };
        add("ok", u64::from(report.ok));
        add("failed", u64::from(report.failed));
        match report.outcome {
            Some(Outcome::Ok) => add("ok", 1),
            Some(Outcome::Failed) => add("failed", 1),
            Some(Outcome::Banned) => add("banned", 1),
            Some(Outcome::Throttled { .. }) => add("throttled", 1),
            None => {}
        }
    }

    pub(crate) fn cooldown_write(&self, ok: bool) {
        self.cooldown_writes.get_or_create(&ResultLabels { result: if ok { "ok" } else { "error" } }).inc();
    }

    /// Brings the adopted-leases counter up to the store's total.
    pub(crate) fn set_adopted(&self, total: u64) {
        let counted = self.adopted.get();
        if total > counted {
            self.adopted.inc_by(total - counted);
        }
    }
}

/// Counts one open refusal stream until dropped.
pub(crate) struct StreamGuard(Gauge);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_series_are_labelled_by_tenant_and_idle_tenants_read_zero() {
        let mut registry = Registry::default();
        let metrics = DiscoveryMetrics::register(&mut registry);
        metrics.tenant_granted("team-a");
        metrics.tenant_refused("team-a", "quota-max-leases");
        metrics.tenant_reported("team-b");
        let held = std::collections::BTreeMap::from([("team-a".to_owned(), 3)]);
        metrics.set_tenant_active(["team-a", "team-b"].into_iter(), &held);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        for line in [
            "discovery_tenant_leases_granted_total{tenant=\"team-a\"} 1",
            "discovery_tenant_refusals_total{tenant=\"team-a\",reason=\"quota-max-leases\"} 1",
            "discovery_tenant_reports_total{tenant=\"team-b\"} 1",
            "discovery_tenant_leases_active{tenant=\"team-a\"} 3",
            "discovery_tenant_leases_active{tenant=\"team-b\"} 0",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
