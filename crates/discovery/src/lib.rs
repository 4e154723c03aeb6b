//! The discovery HTTP API that crawlers call: list proxies, lease one for a target, renew, release, and report a
//! ban, which cools that proxy down for that site only.
//!
//! No Kubernetes here: proxies come from a [`ProxyView`] the operator adapts its Proxy store to, and leases live in
//! an [`egress_lease::LeaseStore`]. [`router`] builds the whole API (so tests drive it in-process or over a real
//! socket); [`Discovery::sync`] copies the view into the lease store and is run by [`run_sync`] in the background.

mod api;
pub mod auth;
mod metrics;
pub mod openapi;
mod problem;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use axum::Router;
use egress_lease::{LeaseStore, ProxyInfo};
use tokio::net::TcpListener;

pub use api::MAX_BODY_BYTES;
pub use auth::{Auth, Scope, TokenFile, TokenFileError};
pub use metrics::DiscoveryMetrics;
pub use problem::Problem;

/// One proxy as the discovery API shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyRecord {
    /// The Proxy's namespace.
    pub namespace: String,
    /// The Proxy's name.
    pub name: String,
    /// Where crawlers connect.
    pub host: String,
    /// The port.
    pub port: u16,
    /// The address origins see, when known.
    pub egress_ip: Option<String>,
    /// The Proxy's labels.
    pub labels: BTreeMap<String, String>,
    /// `placement.zone`, when set.
    pub zone: Option<String>,
    /// The provider, for Managed proxies.
    pub provider: Option<String>,
    /// The lease cap.
    pub max_leases: u32,
    /// The health engine's current verdict.
    pub healthy: bool,
    /// Proxy credentials (user, password), handed only to `lease`-scope tokens.
    pub credentials: Option<(String, String)>,
}

impl ProxyRecord {
    /// `namespace/name`: the identifier in the lease store.
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// A read-only view of the proxies, which the operator backs with its Proxy store.
pub trait ProxyView: Send + Sync {
    /// Whether the view has seen the whole set at least once (until then `/readyz` says not ready).
    fn synced(&self) -> bool;
    /// Every proxy with an endpoint.
    fn proxies(&self) -> Vec<ProxyRecord>;
}

/// Why the server refuses to serve leases at the moment (for example: this replica is not the leader).
pub trait Gate: Send + Sync {
    /// `None` when serving; otherwise the reason, sent with 503.
    fn refusal(&self) -> Option<String>;
}

/// A gate that always serves.
pub struct AlwaysServe;

impl Gate for AlwaysServe {
    fn refusal(&self) -> Option<String> {
        None
    }
}

/// The API's state.
pub struct Discovery {
    view: Arc<dyn ProxyView>,
    store: Arc<dyn LeaseStore>,
    auth: Auth,
    gate: Arc<dyn Gate>,
    metrics: DiscoveryMetrics,
    records: std::sync::RwLock<BTreeMap<String, ProxyRecord>>,
    synced_once: AtomicBool,
}

impl Discovery {
    /// State over a view and a store.
    pub fn new(view: Arc<dyn ProxyView>, store: Arc<dyn LeaseStore>, auth: Auth, metrics: DiscoveryMetrics) -> Self {
        Self {
            view,
            store,
            auth,
            gate: Arc::new(AlwaysServe),
            metrics,
            records: std::sync::RwLock::default(),
            synced_once: AtomicBool::new(false),
        }
    }

    /// Refuses lease routes (503) while `gate` says so.
    pub fn with_gate(mut self, gate: Arc<dyn Gate>) -> Self {
        self.gate = gate;
        self
    }

    /// Copies the view into the lease store: new and changed proxies are upserted (an unhealthy one has its
    /// leases revoked), vanished ones removed; then expired leases are released.
    pub fn sync(&self) {
        if !self.view.synced() {
            return;
        }
        let current: BTreeMap<String, ProxyRecord> =
            self.view.proxies().into_iter().map(|record| (record.id(), record)).collect();
        let mut records = self.records.write().expect("record lock");
        for (id, record) in &current {
            if records.get(id) != Some(record) {
                self.store.upsert_proxy(ProxyInfo {
                    id: id.clone(),
                    healthy: record.healthy,
                    max_leases: record.max_leases,
                    labels: record.labels.clone(),
                });
            }
        }
        for id in records.keys() {
            if !current.contains_key(id) {
                self.store.remove_proxy(id);
            }
        }
        *records = current;
        drop(records);
        let now = SystemTime::now();
        let expired = self.store.expire(now);
        self.metrics.expired(expired);
        if let Ok(loads) = self.store.loads(None, now) {
            self.metrics.set_active(loads.iter().map(|load| u64::from(load.active_leases)).sum());
        }
        self.synced_once.store(true, Ordering::SeqCst);
    }

    /// Whether the first sync has happened.
    pub fn ready(&self) -> bool {
        self.synced_once.load(Ordering::SeqCst)
    }
}

/// Builds the API router.
pub fn router(state: Arc<Discovery>) -> Router {
    api::routes(state)
}

/// Runs [`Discovery::sync`] every `interval` until `shutdown` resolves.
pub async fn run_sync(state: Arc<Discovery>, interval: Duration, shutdown: impl Future<Output = ()>) {
    let rounds = async {
        let mut tick = tokio::time::interval(interval);
        loop {
            tick.tick().await;
            state.sync();
        }
    };
    tokio::select! {
        () = rounds => {}
        () = shutdown => {}
    }
}

/// Serves the router on `listener` (HTTP/1.1 and HTTP/2) until `shutdown` resolves, finishing in-flight requests.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router).with_graceful_shutdown(shutdown).await
}
