//! Gateway metrics, per tenant (a bounded set: the tenants the token file names; a refused credential counts under
//! no tenant) and per upstream proxy (bounded by the fleet; never per site, which is unbounded: the site is in each
//! request's span): requests by kind (`plain`, `connect`, `report`) and result (`2xx`…`5xx` for answers passed on, `refused` for
//! the gateway's own errors by their `Proxy-Status` error type), retries after a site blocked a proxy, bytes through
//! tunnels each way, tunnels open and closed after a refusal, connections and tunnels refused at the cap, connections
//! refused before authenticating, and requests whose credentials went unchecked after too many wrong ones.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    tenant: String,
    kind: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BytesLabels {
    tenant: String,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProxyLabels {
    proxy: String,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProxyBytesLabels {
    proxy: String,
    direction: &'static str,
}

/// The gateway's metrics. Cloning shares them.
#[derive(Clone, Debug, Default)]
pub struct GatewayMetrics {
    requests: Family<RequestLabels, Counter>,
    tunnel_bytes: Family<BytesLabels, Counter>,
    open_tunnels: Gauge,
    refused_connections: Counter,
    refused_unauthenticated: Family<ReasonLabels, Counter>,
    throttled_credentials: Counter,
    retries: Family<TenantLabels, Counter>,
    revoked_tunnels: Family<TenantLabels, Counter>,
    proxy_requests: Family<ProxyLabels, Counter>,
    proxy_tunnel_bytes: Family<ProxyBytesLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabels {
    tenant: String,
}

impl GatewayMetrics {
    /// Metrics registered in `registry` under `egress_gateway_`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        let registry = registry.sub_registry_with_prefix("egress_gateway");
        registry.register(
            "requests",
            "Requests by tenant, kind (plain, connect) and result (the answer's status class, or the gateway's own error type)",
            metrics.requests.clone(),
        );
        registry.register(
            "tunnel_bytes",
            "Bytes through CONNECT tunnels by tenant and direction (up: from the crawler, down: to it)",
            metrics.tunnel_bytes.clone(),
        );
        registry.register("open_tunnels", "CONNECT tunnels open now", metrics.open_tunnels.clone());
        registry.register(
            "proxy_requests",
            "Plain requests sent and tunnels opened through each upstream proxy (namespace/name), by kind",
            metrics.proxy_requests.clone(),
        );
        registry.register(
            "proxy_tunnel_bytes",
            "Bytes through CONNECT tunnels by upstream proxy (namespace/name) and direction",
            metrics.proxy_tunnel_bytes.clone(),
        );
        registry.register(
            "retries",
            "Plain requests tried again on another proxy after the site blocked the one they went through",
            metrics.retries.clone(),
        );
        registry.register(
            "revoked_tunnels",
            "CONNECT tunnels closed by the gateway because the site refused their proxy (a ban or throttle reported)",
            metrics.revoked_tunnels.clone(),
        );
        registry.register(
            "refused_connections",
            "Connections closed as soon as they were accepted, at the connection cap",
            metrics.refused_connections.clone(),
        );
        registry.register(
            "refused_unauthenticated_connections",
            "Connections closed as soon as they were accepted because their address (reason per-source), or all \
             addresses (total), had as many connections without a valid token yet as they may",
            metrics.refused_unauthenticated.clone(),
        );
        registry.register(
            "throttled_credentials",
            "Requests answered 429 without checking their credentials: their address sent too many wrong tokens",
            metrics.throttled_credentials.clone(),
        );
        for reason in ["per-source", "total"] {
            let _ = metrics.refused_unauthenticated.get_or_create(&ReasonLabels { reason });
        }
        metrics
    }

    /// One request answered: `kind` is `plain`, `connect` or `report`; `result` the status class passed on, or the
    /// gateway's error type.
    pub(crate) fn request(&self, tenant: &str, kind: &'static str, result: &'static str) {
        self.requests.get_or_create(&RequestLabels { tenant: tenant.to_owned(), kind, result }).inc();
    }

    /// A tunnel opened through `proxy`; the returned guard counts it closed when dropped, with the bytes it carried.
    pub(crate) fn tunnel(&self, tenant: &str, proxy: &str) -> TunnelGauge {
        self.open_tunnels.inc();
        self.proxied(proxy, "connect");
        TunnelGauge { metrics: self.clone(), tenant: tenant.to_owned(), proxy: proxy.to_owned(), up: 0, down: 0 }
    }

    /// A plain request sent (`plain`) or a tunnel opened (`connect`) through `proxy`.
    pub(crate) fn proxied(&self, proxy: &str, kind: &'static str) {
        self.proxy_requests.get_or_create(&ProxyLabels { proxy: proxy.to_owned(), kind }).inc();
    }

    pub(crate) fn retried(&self, tenant: &str) {
        self.retries.get_or_create(&TenantLabels { tenant: tenant.to_owned() }).inc();
    }

    pub(crate) fn refused_connection(&self) {
        self.refused_connections.inc();
    }

    pub(crate) fn refused_unauthenticated(&self, reason: &'static str) {
        self.refused_unauthenticated.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub(crate) fn throttled_credentials(&self) {
        self.throttled_credentials.inc();
    }
}

/// Counts one tunnel open until dropped.
pub(crate) struct TunnelGauge {
    metrics: GatewayMetrics,
    tenant: String,
    proxy: String,
    up: u64,
    down: u64,
}

impl TunnelGauge {
    /// The gateway closed the tunnel: the site refused its proxy.
    pub(crate) fn revoked(&self) {
        self.metrics.revoked_tunnels.get_or_create(&TenantLabels { tenant: self.tenant.clone() }).inc();
    }

    /// The bytes the tunnel carried, counted when it is dropped.
    pub(crate) fn carried(&mut self, up: u64, down: u64) {
        (self.up, self.down) = (up, down);
    }
}

impl Drop for TunnelGauge {
    fn drop(&mut self) {
        self.metrics.open_tunnels.dec();
        for (direction, bytes) in [("up", self.up), ("down", self.down)] {
            self.metrics
                .tunnel_bytes
                .get_or_create(&BytesLabels { tenant: self.tenant.clone(), direction })
                .inc_by(bytes);
            self.metrics
                .proxy_tunnel_bytes
                .get_or_create(&ProxyBytesLabels { proxy: self.proxy.clone(), direction })
                .inc_by(bytes);
        }
    }
}

/// The `result` label of an answer passed on.
pub(crate) fn status_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}
