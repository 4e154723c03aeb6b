//! The discovery HTTP API that crawlers call: list proxies, lease one for a target, renew, release, and report a
//! ban, which cools that proxy down for that site only.
//!
//! No Kubernetes here: the operator tells the [`Discovery`] state of each proxy that changes
//! ([`Discovery::upsert`], [`Discovery::remove`]), one at a time, and leases live in an
//! [`egress_lease::LeaseState`]. [`router`] builds the whole API (so tests drive it in-process or over a real
//! socket); [`run_expiry`] releases expired leases in the background.
//!
//! Cooldowns outlive the process through a [`CooldownJournal`] the operator provides: a ban is written there
//! (coalesced per proxy) before the report is answered, and the cooldowns a record carries are taken back into
//! the lease store when it arrives ([`ProxyRecord::cooldowns`]).

mod api;
pub mod auth;
mod forward;
mod journal;
mod metrics;
mod problem;
mod server;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use axum::Router;
use egress_lease::{Cooldown, LeaseState, ProxyInfo};
use tracing::{debug, info, warn};

pub use egress_fleet::{PoolDemand, PoolId, ProxyCredentials, ProxyId};

pub use api::{HEARTBEAT as REFUSAL_HEARTBEAT, openapi};
pub use auth::{Auth, Identity, Quota, Scope, TokenEntry, TokenFile, TokenFileError};
pub use journal::{CooldownJournal, MAX_PERSISTED_COOLDOWNS};
pub use metrics::DiscoveryMetrics;
pub use problem::Problem;
pub use server::{
    Authenticated, DEFAULT_MAX_HEADER_BYTES, LISTEN_BACKLOG, MAX_BODY_BYTES, ServerLimits, ServerMetrics, Streamed,
    bind, serve, serve_with,
};

/// One proxy as the discovery API shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyRecord {
    /// Which Proxy.
    pub id: ProxyId,
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
    pub credentials: Option<ProxyCredentials>,
    /// Cooldowns kept for this proxy (by a [`CooldownJournal`]), taken into the lease store when they are newer
    /// than what it knows.
    pub cooldowns: Vec<Cooldown>,
    /// The pool it is a member of, when it has one.
    pub pool: Option<PoolId>,
    /// Its ban cooldown policy (the Proxy's, else its provider's), when it has one of its own.
    pub cooldown: Option<egress_lease::CooldownPolicy>,
    /// How often its egress address may be leased for one site; `None`: unpaced.
    pub pacing: Option<egress_lease::Pacing>,
}

/// One pool of proxies, as the discovery API needs it to answer leases asked for by pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolRecord {
    /// Which pool.
    pub id: PoolId,
    /// How many members it should have (`spec.replicas`).
    pub replicas: u32,
    /// How many members are Ready.
    pub ready: u32,
    /// Whether a lease asked for while it has no members makes it grow (it autoscales, up to at least one).
    pub wakes: bool,
    /// How long a new member takes to become Ready, from the provider's recent provisioning times: the
    /// `Retry-After` of a lease asked for while the pool scales up.
    pub provisioning: Duration,
}

/// A refusal a tenant reported (a ban or a throttle): `proxies` cool down for `target` until `until`. Every
/// [`Discovery::refusals`] subscriber hears it as soon as the lease store has it, before the cooldown is written
/// down, so a gateway replica that did not see the refusal moves its sessions off those proxies at once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Whose report it was (its sessions are the ones that move).
    pub tenant: Arc<str>,
    /// The normalised site.
    pub target: String,
    /// The reported proxy, and those leaving through the same egress address that the report cooled too.
    pub proxies: Vec<ProxyId>,
    /// When the cooldown ends.
    pub until: SystemTime,
}

/// How many refusals a slow subscriber may fall behind before its stream ends (and its client reconnects and takes
/// a snapshot of the live cooldowns instead).
const REFUSAL_BACKLOG: usize = 4096;

/// Who hears that a pool's demand changed (the operator's pool controller, which then looks at the pool at once).
pub trait PoolWaker: Send + Sync {
    /// Leases for `pool` were refused for lack of members or capacity.
    fn wake(&self, pool: &PoolId);
}

impl ProxyRecord {
    /// `host:port` (`[host]:port` for IPv6): the endpoint leases remember.
    pub fn endpoint(&self) -> String {
        egress_fleet::authority(&self.host, self.port)
    }

    /// Its proxy URL; with its credentials only when `credentials` (the caller holds a lease on it, or is an
    /// admin), each percent-encoded as a URL userinfo part.
    pub fn url(&self, credentials: bool) -> String {
        match &self.credentials {
            Some(found) if credentials => {
                let (user, password) = (userinfo(&found.username), userinfo(found.password.expose()));
                format!("http://{user}:{password}@{}", self.endpoint())
            }
            _ => format!("http://{}", self.endpoint()),
        }
    }
}

/// Everything but RFC 3986's unreserved characters, which a URL userinfo part carries as they are.
const NOT_UNRESERVED: &percent_encoding::AsciiSet =
    &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// Percent-encodes a URL userinfo part.
fn userinfo(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, NOT_UNRESERVED).to_string()
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
    store: Arc<dyn LeaseState>,
    auth: Auth,
    gate: Arc<dyn Gate>,
    metrics: DiscoveryMetrics,
    records: std::sync::RwLock<BTreeMap<ProxyId, Arc<ProxyRecord>>>,
    synced: AtomicBool,
    journal: journal::Persister,
    pools: std::sync::RwLock<BTreeMap<PoolId, Arc<PoolRecord>>>,
    demand: std::sync::Mutex<BTreeMap<PoolId, PoolDemand>>,
    waker: Option<Arc<dyn PoolWaker>>,
    /// Reports per tenant in the current minute (for `reportsPerMinute`): when the minute started, how many.
    report_windows: std::sync::Mutex<std::collections::HashMap<Arc<str>, (std::time::Instant, u32)>>,
    /// Every refusal reported here (or, with a shared state, at any replica), for the `GET /v1/refusals` streams;
    /// replaced when refusals may have been missed, which ends every stream (their clients reconnect and start
    /// over from the live cooldowns).
    refusals: Arc<std::sync::RwLock<RefusalSender>>,
    /// Whether refusals come from the shared state rather than from this replica's own reports.
    shared_refusals: bool,
    /// Set when the shared state was lost (it may come back empty): the records' kept cooldowns are given to it
    /// again.
    restore_cooldowns: Arc<AtomicBool>,
    /// Whether this replica hands its requests to a successor (it is stopping), and to which.
    handoff: tokio::sync::watch::Sender<forward::Handoff>,
    /// When the last request was handed on (milliseconds since `started`), for a stopping replica to linger while
    /// the Service still routes to it.
    last_forwarded: std::sync::atomic::AtomicU64,
    started: std::time::Instant,
    /// Whether the operator looks egress addresses up in GeoIP databases, so the labels only they set
    /// ([`egress_fleet::labels::GEO`]) may be selected by.
    geoip: bool,
}

type RefusalSender = tokio::sync::broadcast::Sender<Arc<Refusal>>;

/// Passes the refusals every replica takes, as the shared state publishes them, to this replica's streams.
async fn follow_shared_refusals(
    mut shared: tokio::sync::broadcast::Receiver<egress_lease::SharedRefusal>,
    refusals: std::sync::Weak<std::sync::RwLock<RefusalSender>>,
    restore_cooldowns: Arc<AtomicBool>,
) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        let received = shared.recv().await;
        let Some(refusals) = refusals.upgrade() else { return };
        let mut sender = refusals.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        match received {
            Ok(egress_lease::SharedRefusal::Refused(refused)) => {
                let _ = sender.send(Arc::new(Refusal {
                    tenant: refused.owner.into(),
                    target: refused.target,
                    proxies: refused.proxies,
                    until: refused.until,
                }));
            }
            Ok(egress_lease::SharedRefusal::Gap) | Err(RecvError::Lagged(_)) => {
                *sender = tokio::sync::broadcast::Sender::new(REFUSAL_BACKLOG);
                restore_cooldowns.store(true, Ordering::Release);
            }
            Err(RecvError::Closed) => return,
        }
    }
}

impl Discovery {
    /// State over a lease store, with no proxies yet.
    pub fn new(store: Arc<dyn LeaseState>, auth: Auth, metrics: DiscoveryMetrics) -> Self {
        Self {
            store,
            auth,
            gate: Arc::new(AlwaysServe),
            metrics,
            records: std::sync::RwLock::default(),
            synced: AtomicBool::new(false),
            journal: journal::Persister::default(),
            pools: std::sync::RwLock::default(),
            demand: std::sync::Mutex::default(),
            waker: None,
            report_windows: std::sync::Mutex::default(),
            refusals: Arc::new(std::sync::RwLock::new(tokio::sync::broadcast::Sender::new(REFUSAL_BACKLOG))),
            shared_refusals: false,
            restore_cooldowns: Arc::new(AtomicBool::new(false)),
            handoff: tokio::sync::watch::Sender::new(forward::Handoff::Serving),
            last_forwarded: std::sync::atomic::AtomicU64::new(0),
            started: std::time::Instant::now(),
            geoip: false,
        }
        .following_shared_refusals()
    }

    /// With a shared state, feeds the refusal streams from it (when a Tokio runtime runs: outside one, nothing
    /// could stream anyway).
    fn following_shared_refusals(mut self) -> Self {
        if let (Some(shared), Ok(runtime)) = (self.store.shared_refusals(), tokio::runtime::Handle::try_current()) {
            let restore = self.restore_cooldowns.clone();
            runtime.spawn(follow_shared_refusals(shared, Arc::downgrade(&self.refusals), restore));
            self.shared_refusals = true;
        }
        self
    }

    /// Tells `waker` of every lease refused for a pool's lack of members or capacity.
    pub fn with_pool_waker(mut self, waker: Arc<dyn PoolWaker>) -> Self {
        self.waker = Some(waker);
        self
    }

    /// Adds or changes one pool.
    pub fn upsert_pool(&self, record: PoolRecord) {
        self.pools.write().expect("pool lock").insert(record.id.clone(), Arc::new(record));
    }

    /// Removes one pool.
    pub fn remove_pool(&self, id: &PoolId) {
        self.pools.write().expect("pool lock").remove(id);
        self.demand.lock().expect("demand lock").remove(id);
    }

    /// Every pool known.
    pub fn pool_ids(&self) -> Vec<PoolId> {
        self.pools.read().expect("pool lock").keys().cloned().collect()
    }

    /// When leases for pool `id` were last refused, by why.
    pub fn pool_demand(&self, id: &PoolId) -> PoolDemand {
        self.demand.lock().expect("demand lock").get(id).copied().unwrap_or_default()
    }

    /// The active leases on proxy `id` (0 when the lease state does not answer).
    pub async fn active_leases(&self, id: &ProxyId) -> u32 {
        self.store
            .loads_of(&[id], None, SystemTime::now())
            .await
            .ok()
            .and_then(|loads| loads.into_iter().next().flatten())
            .map_or(0, |load| load.active_leases)
    }

    /// Records a refusal for a pool and tells the waker.
    fn refused_for(&self, pool: &PoolId, record: impl FnOnce(&mut PoolDemand)) {
        record(self.demand.lock().expect("demand lock").entry(pool.clone()).or_default());
        if let Some(waker) = &self.waker {
            waker.wake(pool);
        }
    }

    /// Keeps cooldowns in `journal`: every ban is written there before its report is answered.
    pub fn with_journal(mut self, journal: Arc<dyn CooldownJournal>) -> Self {
        self.journal = journal::Persister::new(journal);
        self
    }

    /// Allows selection by the labels GeoIP databases set (`--geoip-database`); without, a selector naming one is
    /// refused with 400, since nothing would ever match it.
    pub fn with_geoip(mut self) -> Self {
        self.geoip = true;
        self
    }

    /// A selector parsed from `text`, or the 400 that says why it is refused: it does not parse, or it selects by a
    /// GeoIP label while the operator has no GeoIP database.
    pub(crate) fn selector(&self, text: &str) -> Result<egress_lease::Selector, problem::Problem> {
        let selector =
            egress_lease::Selector::parse(text).map_err(|error| problem::Problem::bad_request(error.to_string()))?;
        if !self.geoip
            && let Some(label) = egress_fleet::labels::GEO.iter().find(|label| selector.mentions(label))
        {
            return Err(problem::Problem::bad_request(format!(
                "the selector names {label}, which only the operator's GeoIP database sets, and this operator has                  none (start it with --geoip-database)"
            )));
        }
        Ok(selector)
    }

    /// Refuses lease routes (503) while `gate` says so.
    pub fn with_gate(mut self, gate: Arc<dyn Gate>) -> Self {
        self.gate = gate;
        self
    }

    /// Adds or changes one proxy. The lease store hears of it only when what it keeps changed (health, cap,
    /// labels); an unhealthy proxy has its leases revoked there. Costs O(log n), whatever the fleet's size.
    /// Calls for one proxy must not overlap (the feed makes them one at a time).
    pub async fn upsert(&self, record: ProxyRecord) {
        let id = record.id.clone();
        let (info, cooldowns) = {
            let mut records = self.records.write().expect("record lock");
            let previous = records.get(&id);
            if previous.is_some_and(|previous| **previous == record) {
                return;
            }
            let (info, cooldowns) = Self::changes(previous.map(Arc::as_ref), &record);
            records.insert(id.clone(), Arc::new(record));
            (info, cooldowns)
        };
        // A lease state that does not answer misses only a revocation (the leases on an unhealthy proxy end when
        // their holders next renew) or cooldowns it already had (they stay in the Proxy's status).
        if let Some(info) = info
            && let Err(error) = self.store.upsert_proxy(info).await
        {
            warn!(proxy = %id, %error, "the lease state did not take a proxy's change");
        }
        if let Some(cooldowns) = cooldowns
            && let Err(error) = self.store.restore_cooldowns(&cooldowns, SystemTime::now()).await
        {
            warn!(proxy = %id, %error, "the lease state did not take a proxy's recorded cooldowns");
        }
    }

    /// What the lease state must hear of a proxy's change from `previous` to `record`: its new info when what the
    /// state keeps changed, and its recorded cooldowns when they changed.
    fn changes(previous: Option<&ProxyRecord>, record: &ProxyRecord) -> (Option<ProxyInfo>, Option<Vec<Cooldown>>) {
        let id = record.id.clone();
        let endpoint = record.endpoint();
        let store_changed = previous.is_none_or(|previous| {
            previous.healthy != record.healthy
                || previous.max_leases != record.max_leases
                || previous.labels != record.labels
                || previous.endpoint() != endpoint
                || previous.egress_ip != record.egress_ip
                || previous.pool != record.pool
                || previous.zone != record.zone
                || previous.provider != record.provider
                || previous.cooldown != record.cooldown
                || previous.pacing != record.pacing
        });
        let cooldowns_changed = previous.is_none_or(|previous| previous.cooldowns != record.cooldowns);
        let info = store_changed.then(|| ProxyInfo {
            id,
            healthy: record.healthy,
            max_leases: record.max_leases,
            labels: record.labels.clone(),
            endpoint,
            egress_ip: record.egress_ip.clone(),
            pool: record.pool.clone(),
            zone: record.zone.clone(),
            provider: record.provider.clone(),
            cooldown: record.cooldown,
            pacing: record.pacing,
        });
        // Our own writes come back here too; the store keeps whichever ends later, so they change nothing.
        let cooldowns = (cooldowns_changed && !record.cooldowns.is_empty()).then(|| record.cooldowns.clone());
        (info, cooldowns)
    }

    /// How many live leases on proxy `id` were last told `endpoint` (`host:port`): while this is above zero, a
    /// replaced instance at that endpoint still has holders who have not renewed since.
    /// When the lease state does not answer, as many as the proxy's cap: the instance is kept.
    pub async fn leases_on(&self, id: &ProxyId, endpoint: &str) -> usize {
        match self.store.leases_on(id, endpoint, SystemTime::now()).await {
            Ok(count) => count,
            Err(error) => {
                warn!(proxy = %id, %error, "the lease state did not say who holds leases on a replaced instance");
                usize::MAX
            }
        }
    }

    /// Removes one proxy and revokes its leases.
    pub async fn remove(&self, id: &ProxyId) {
        let removed = self.records.write().expect("record lock").remove(id).is_some();
        if removed {
            self.journal.forget(id);
            if let Err(error) = self.store.remove_proxy(id).await {
                warn!(proxy = %id, %error, "the lease state did not take a proxy's removal; its leases expire");
            }
        }
    }

    /// The identifiers of every proxy known, for a caller that compares its own view against this one.
    pub fn ids(&self) -> Vec<ProxyId> {
        self.records.read().expect("record lock").keys().cloned().collect()
    }

    /// How many proxies are known.
    pub fn len(&self) -> usize {
        self.records.read().expect("record lock").len()
    }

    /// Whether no proxy is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Says that every proxy has been given at least once: from now on `/readyz` is ready.
    pub fn mark_synced(&self) {
        self.synced.store(true, Ordering::SeqCst);
    }

    /// Releases expired leases and refreshes the active-lease gauge; cheap whatever the fleet's size (it costs
    /// what expired).
    pub async fn expire(&self) -> Result<(), egress_lease::LeaseError> {
        let expired = self.store.expire(SystemTime::now()).await?;
        self.metrics.expired(expired);
        self.metrics.set_active(u64::try_from(self.store.active_leases().await?).unwrap_or(u64::MAX));
        self.metrics.set_adopted(self.store.adopted());
        let tenants = match &self.auth {
            Auth::Tokens(tokens) => tokens.tenants().into_keys().collect(),
            Auth::Disabled => vec!["anonymous".to_owned()],
        };
        self.metrics.set_tenant_active(tenants.iter().map(String::as_str), &self.store.leases_by_owner().await?);
        Ok(())
    }

    /// After the shared state was lost, gives it the cooldowns the Proxies keep (a state that came back empty has
    /// them again; one that kept its data keeps whichever ends later). Until it answers, at every call.
    pub async fn restore_kept_cooldowns(&self) {
        if !self.restore_cooldowns.swap(false, Ordering::AcqRel) {
            return;
        }
        let kept: Vec<Cooldown> = {
            let records = self.records.read().expect("record lock");
            records.values().flat_map(|record| record.cooldowns.iter().cloned()).collect()
        };
        match self.store.restore_cooldowns(&kept, SystemTime::now()).await {
            Ok(restored) if restored > 0 => info!(restored, "gave the shared state the cooldowns the Proxies keep"),
            Ok(_) => {}
            Err(error) => {
                debug!(%error, "the shared state does not answer yet; its cooldowns are given again at the next tick");
                self.restore_cooldowns.store(true, Ordering::Release);
            }
        }
    }

    /// Writes again the cooldowns of proxies whose last journal write failed.
    pub async fn retry_journal(&self) {
        self.journal.retry(self.store.as_ref(), &self.metrics).await;
    }

    /// Counts one report of `tenant` against its `per_minute` quota; `Err` with how long until the next minute
    /// when the quota is used up.
    fn count_report(&self, tenant: &Arc<str>, per_minute: u32) -> Result<(), Duration> {
        let mut windows = self.report_windows.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = std::time::Instant::now();
        let window = windows.entry(tenant.clone()).or_insert((now, 0));
        let elapsed = now.duration_since(window.0);
        if elapsed >= Duration::from_secs(60) {
            *window = (now, 0);
        }
        if window.1 >= per_minute {
            return Err(Duration::from_secs(60).saturating_sub(now.duration_since(window.0)));
        }
        window.1 += 1;
        Ok(())
    }

    /// Every refusal reported from now on, as the lease store takes it.
    pub fn refusals(&self) -> tokio::sync::broadcast::Receiver<Arc<Refusal>> {
        self.refusals.read().unwrap_or_else(std::sync::PoisonError::into_inner).subscribe()
    }

    /// Tells the refusal streams of a refusal the lease store has just taken. With a shared state, the state
    /// publishes it to every replica, this one included.
    fn refused(&self, refusal: Refusal) {
        if self.shared_refusals {
            return;
        }
        // No subscriber is no error: nobody needs telling.
        let _ = self.refusals.read().unwrap_or_else(std::sync::PoisonError::into_inner).send(Arc::new(refusal));
    }

    /// Whether every proxy has been given at least once.
    pub fn ready(&self) -> bool {
        self.synced.load(Ordering::SeqCst)
    }
}

/// Builds the API router.
pub fn router(state: Arc<Discovery>) -> Router {
    api::routes(state)
}

/// Runs [`Discovery::expire`] every `interval` until `shutdown` resolves.
pub async fn run_expiry(state: Arc<Discovery>, interval: Duration, shutdown: impl Future<Output = ()>) {
    let rounds = async {
        let mut tick = tokio::time::interval(interval);
        loop {
            tick.tick().await;
            if let Err(error) = state.expire().await {
                warn!(%error, "expiring leases failed; tried again at the next tick");
            }
            state.restore_kept_cooldowns().await;
            state.retry_journal().await;
        }
    };
    tokio::select! {
        () = rounds => {}
        () = shutdown => {}
    }
}

#[cfg(test)]
mod tests {
    use super::userinfo;

    #[test]
    fn userinfo_is_percent_encoded() {
        assert_eq!(userinfo("crawler"), "crawler");
        assert_eq!(userinfo("p@ss:w/rd %"), "p%40ss%3Aw%2Frd%20%25");
    }
}
