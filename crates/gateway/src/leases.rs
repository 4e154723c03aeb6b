//! Routing through the discovery API: each request's proxy is a lease, taken with the crawler's own token, so the
//! tenant's quotas, the proxies' caps, the sites' cooldowns and the pools are the lease store's and nothing here
//! copies them.
//!
//! A request with a session (`session-<id>` in the user name) is routed through the lease held for that tenant,
//! session and site: the first request takes it (with the session as the lease's sticky key, so the store gives the
//! session the same proxy again after a gateway restart), later ones reuse it, and it is renewed at half its TTL
//! while the session sends requests or has a tunnel open through it. A session that did neither since the last
//! renewal releases it (an idle session holds no slot of a proxy's cap) and keeps its choice: the store's sticky key
//! gives its next request the same proxy while that is eligible. The session itself is forgotten here once idle for
//! its stickiness (`sticky-<seconds>`, else the configured default).
//! A ban or a throttle seen at the gateway is reported and ends the session's hold on that proxy: the next request
//! leases again, and the store, which cools the proxy down for that site, picks another. Every other session of the
//! tenant on that proxy (or its egress address) for the site lets go of it at once, not when the discovery API
//! answers (which is after it has written the cooldown down); until it has answered, a lease that comes back on that
//! proxy for the site is given back and taken again once the report is in. A renewal that finds the
//! proxy replaced moves the session to the new instance. A request without a session takes a lease of its own,
//! held until its answer (or its tunnel) ends, so consecutive requests rotate: the store hands out the least-loaded
//! proxy, ties to the least recently leased.
//!
//! Every time here is read from tokio's clock, so `tests/router.rs` drives stickiness, renewals, the echo window and
//! waits for a proxy on a paused clock, in milliseconds.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use egress_client::{ClientError, DiscoveryClient, LeaseGuard, LeaseOptions, Outcome, ProxyId, RefusalEvent};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info};

use crate::route::{Report, RouteRequest, Routed, Router, Upstream, Verdict};
use crate::status::GatewayError;

/// How the gateway leases.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRouterConfig {
    /// The discovery API, `http://host:port`.
    pub discovery_url: String,
    /// How long each lease lasts unless renewed; a session's lease is renewed at half of it. A tenant whose
    /// `maxLeaseSeconds` is shorter gets leases of that length instead.
    pub lease_ttl: Duration,
    /// How long an idle session keeps its proxy when its user name gives no `sticky`.
    pub default_sticky: Duration,
    /// Upstream statuses of plain HTTP requests reported as a ban.
    pub ban_statuses: Vec<u16>,
    /// Upstream statuses reported as a throttle (with the answer's `Retry-After`).
    pub throttle_statuses: Vec<u16>,
    /// How long a request waits for a proxy when none can take it now: every proxy at its cap (asking again after
    /// 50 ms, doubling to 1 s, since any lease ending frees a slot), or cooling down for the site or a pool waking
    /// with a `Retry-After` inside it. A crawler that knows only a proxy URL cannot be expected to read the
    /// gateway's 503 and wait. Zero answers 503 at once.
    pub max_wait: Duration,
}

impl LeaseRouterConfig {
    /// The defaults for the discovery API at `discovery_url`: 120 s leases, 10 min of stickiness, 401 and 403 as
    /// bans and 429 as a throttle (crawlee's blocked statuses), and up to 10 s of waiting for a proxy.
    pub fn new(discovery_url: impl Into<String>) -> Self {
        Self {
            discovery_url: discovery_url.into(),
            lease_ttl: Duration::from_secs(120),
            default_sticky: Duration::from_secs(600),
            ban_statuses: vec![401, 403],
            throttle_statuses: vec![429],
            max_wait: Duration::from_secs(10),
        }
    }
}

/// Which session: the token (so one tenant's session names are its own), the session, the site and what the user
/// name asked for; and the tenant, whose cooldowns its leases obey.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct SessionKey {
    tenant: String,
    token: String,
    session: String,
    host: String,
    pool: Option<String>,
    zone: Option<String>,
    provider: Option<String>,
    selector: Option<String>,
}

/// The discovery API's reason for a lease refused because every matching proxy is at its cap.
const AT_CAPACITY: &str = "all-at-capacity";

/// How soon a request waiting for a slot at the cap asks again at first; the pause doubles up to [`MAX_CAP_POLL`].
const FIRST_CAP_POLL: Duration = Duration::from_millis(50);
const MAX_CAP_POLL: Duration = Duration::from_secs(1);

/// How long after a session left a proxy a report with no lease held since is taken for an echo of the refusal
/// that made it leave: long enough for the requests in flight through the proxy then to be answered.
const ECHO_WINDOW: Duration = Duration::from_secs(5);

/// A session's hold on a proxy.
#[derive(Default)]
struct Held {
    lease: Option<LeaseGuard>,
    upstream: Option<Upstream>,
    renewed: Option<Instant>,
    /// Revokes the upstream handed out for the lease, closing the session's tunnels through it.
    revoke: Option<watch::Sender<bool>>,
    /// The proxy the session last left after a refusal, and when.
    left: Option<(String, Instant)>,
}

impl Held {
    /// Holds `lease` through `upstream`, which is handed out with a revocation the hold can fire.
    fn hold(&mut self, lease: LeaseGuard, mut upstream: Upstream) -> Upstream {
        let (revoke, revoked) = watch::channel(false);
        upstream.revoked = Some(revoked);
        (self.lease, self.upstream, self.renewed, self.revoke) =
            (Some(lease), Some(upstream.clone()), Some(Instant::now()), Some(revoke));
        upstream
    }

    /// Lets the proxy go because the site refused it: the session's tunnels through it close, and its next request
    /// leases again. Returns the lease, to report on.
    fn leave(&mut self) -> Option<LeaseGuard> {
        if let Some(revoke) = self.revoke.take() {
            revoke.send_replace(true);
        }
        (self.upstream, self.renewed) = (None, None);
        let lease = self.lease.take();
        if let Some(lease) = &lease {
            self.left = Some((lease.proxy().to_string(), Instant::now()));
        }
        lease
    }

    /// The proxy the session left after a refusal less than [`ECHO_WINDOW`] ago, when it has not leased another
    /// since: a report now is most likely an echo of that refusal (another request of the session, in flight through
    /// the same proxy, refused too), not news about a proxy the session has not used yet.
    fn echo(&self) -> Option<&str> {
        match (&self.lease, &self.left) {
            (None, Some((proxy, at))) if at.elapsed() < ECHO_WINDOW => Some(proxy),
            _ => None,
        }
    }
}

/// A proxy the site refused, as the lease it was refused through shows it: the tenant, the normalised site, the
/// proxy and the address it leaves through (proxies sharing it share cooldowns).
struct Refused {
    tenant: String,
    target: String,
    proxy: ProxyId,
    egress_ip: Option<String>,
}

impl Refused {
    fn of(tenant: &str, lease: &LeaseGuard) -> Self {
        Self {
            tenant: tenant.to_owned(),
            target: lease.target().to_owned(),
            proxy: lease.proxy(),
            egress_ip: lease.egress_ip().map(str::to_owned),
        }
    }

    /// `lease` (held by the tenant) is on this proxy, or one leaving through its address, for this site.
    fn covers(&self, tenant: &str, lease: &LeaseGuard) -> bool {
        self.tenant == tenant
            && lease.target() == self.target
            && (lease.proxy() == self.proxy
                || self.egress_ip.as_deref().is_some_and(|egress| lease.egress_ip() == Some(egress)))
    }
}

/// A refusal being reported to the discovery API: in [`LeaseRouter::reporting`] until it drops.
struct Reporting<'a> {
    reports: &'a watch::Sender<Vec<Arc<Refused>>>,
    refused: Arc<Refused>,
}

impl Drop for Reporting<'_> {
    fn drop(&mut self) {
        self.reports.send_modify(|reports| reports.retain(|report| !Arc::ptr_eq(report, &self.refused)));
    }
}

struct Session {
    held: tokio::sync::Mutex<Held>,
    last_used: Mutex<Instant>,
    sticky: Duration,
}

/// Routes through leases.
pub struct LeaseRouter {
    config: LeaseRouterConfig,
    clients: Mutex<HashMap<String, DiscoveryClient>>,
    sessions: Mutex<HashMap<SessionKey, Arc<Session>>>,
    /// Tenants whose `maxLeaseSeconds` is below [`LeaseRouterConfig::lease_ttl`], with it (as the discovery API
    /// said when asked for more).
    tenant_ttls: Mutex<HashMap<String, Duration>>,
    /// The refusals being reported now: the discovery API cools a proxy down when a report arrives, but answers
    /// only once the cooldown is written down (the operator's apiserver), so until then a lease may still be on it.
    reporting: watch::Sender<Vec<Arc<Refused>>>,
    /// How many tenants' refusal streams are following now (synced with the discovery API).
    following: watch::Sender<usize>,
    /// Dropped with the router: the refusal followers see it go and stop.
    alive: watch::Sender<()>,
    me: Weak<LeaseRouter>,
}

impl LeaseRouter {
    /// A router leasing from `config.discovery_url`, with its background task (renewing sessions' leases, releasing
    /// idle ones) running on the current runtime until the router is dropped.
    ///
    /// # Errors
    /// The discovery URL is not `http://host:port`.
    pub fn start(config: LeaseRouterConfig) -> Result<Arc<Self>, ClientError> {
        DiscoveryClient::new(&config.discovery_url, None)?;
        let router = Arc::new_cyclic(|me| Self {
            config,
            clients: Mutex::new(HashMap::new()),
            sessions: Mutex::new(HashMap::new()),
            tenant_ttls: Mutex::new(HashMap::new()),
            reporting: watch::Sender::new(Vec::new()),
            following: watch::Sender::new(0),
            alive: watch::Sender::new(()),
            me: me.clone(),
        });
        let weak = Arc::downgrade(&router);
        tokio::spawn(sweep(weak));
        Ok(router)
    }

    /// How long `tenant`'s leases last: the configured TTL, or the tenant's `maxLeaseSeconds` when shorter.
    fn ttl_for(&self, tenant: &str) -> Duration {
        lock(&self.tenant_ttls).get(tenant).copied().unwrap_or(self.config.lease_ttl)
    }

    /// The number of sessions holding (or about to hold) a proxy.
    pub fn sessions(&self) -> usize {
        lock(&self.sessions).len()
    }

    /// How many tenants' refusal streams follow the discovery API now: each token that has leased here follows the
    /// refusals its tenant reports through any gateway replica or client ([`DiscoveryClient::refusals`]).
    pub fn refusal_streams(&self) -> watch::Receiver<usize> {
        self.following.subscribe()
    }

    /// The discovery client of `token` (the tenant's); the first use also starts following the tenant's refusals.
    fn client(&self, token: &str, tenant: &str) -> Result<DiscoveryClient, GatewayError> {
        let mut clients = lock(&self.clients);
        if let Some(client) = clients.get(token) {
            return Ok(client.clone());
        }
        let client = DiscoveryClient::new(&self.config.discovery_url, Some(token.to_owned()))
            .map_err(|error| GatewayError::internal(error.to_string()))?;
        clients.insert(token.to_owned(), client.clone());
        tokio::spawn(follow_refusals(
            self.me.clone(),
            self.alive.subscribe(),
            client.clone(),
            token.to_owned(),
            tenant.to_owned(),
        ));
        Ok(client)
    }

    /// Leases a proxy for `request`; a session's lease counts toward its lifetime (`lifetime`, `requests`) when
    /// `counted`, so the lease state moves the session on once it is over.
    async fn lease(&self, request: &RouteRequest<'_>, counted: bool) -> Result<(LeaseGuard, Upstream), GatewayError> {
        let mut ttl = self.ttl_for(request.tenant);
        let mut options = LeaseOptions::for_target(request.host).ttl(ttl);
        if let Some(session) = &request.options.session {
            options = options.session(session.clone());
            if counted {
                if let Some(lifetime) = request.options.lifetime {
                    options = options.session_lifetime(lifetime);
                }
                if let Some(requests) = request.options.requests {
                    options = options.session_max_leases(requests);
                }
            }
        }
        if let Some(pool) = &request.options.pool {
            options = options.pool(pool.clone());
        }
        if let Some(selector) = request.options.selector() {
            options = options.selector(selector);
        }
        if let Some(zone) = &request.options.zone {
            options = options.zone(zone.clone());
        }
        if let Some(provider) = &request.options.provider {
            options = options.provider(provider.clone());
        }
        let client = self.client(request.token, request.tenant)?;
        let deadline = Instant::now() + self.config.max_wait;
        let mut cap_poll = FIRST_CAP_POLL;
        let lease = loop {
            match client.lease(options.clone()).await {
                Ok(lease) => {
                    let Some(refused) = self.being_reported(request.tenant, &lease) else { break lease };
                    // The store had not heard of the refusal yet: this lease goes back, and the next one is taken
                    // once the report is in (the store then cools the proxy down and picks another).
                    debug!(proxy = %lease.proxy(), host = request.host, "leased a proxy whose refusal for the site is being reported; leasing again once it is in");
                    drop(lease);
                    let mut reports = self.reporting.subscribe();
                    let reported =
                        reports.wait_for(|reports| !reports.iter().any(|report| Arc::ptr_eq(report, &refused)));
                    if tokio::time::timeout_at(deadline, reported).await.is_err() {
                        return Err(GatewayError::unavailable(
                            format!(
                                "the discovery API offered {} for {}, and the site's refusal of it was still being \
                                 reported when the wait for a proxy ran out",
                                refused.proxy, request.host
                            ),
                            Some(Duration::from_secs(1)),
                        ));
                    }
                }
                // At the cap a slot frees whenever a lease on a matching proxy ends, and a request without a
                // session ends its own with its answer: the API's Retry-After (the first lease's expiry, up to the
                // lease TTL) is only the latest one frees, so the request asks again soon, then less often.
                Err(ClientError::Unavailable { reason, retry_after, .. })
                    if reason == AT_CAPACITY && Instant::now() + cap_poll <= deadline =>
                {
                    debug!(host = request.host, ?cap_poll, "every proxy is at its cap; asking again");
                    tokio::time::sleep(retry_after.map_or(cap_poll, |after| after.min(cap_poll))).await;
                    cap_poll = (cap_poll * 2).min(MAX_CAP_POLL);
                }
                Err(
                    ClientError::Unavailable { retry_after: Some(wait), .. }
                    | ClientError::Conflict { retry_after: Some(wait), .. },
                ) if Instant::now() + wait <= deadline => {
                    debug!(host = request.host, ?wait, "no proxy can take the request yet; waiting");
                    tokio::time::sleep(wait.max(Duration::from_millis(100))).await;
                }
                // The tenant may not hold leases that long: its leases last as long as it may, from now on.
                Err(ClientError::TtlAboveTenantMax { max, .. }) if max >= Duration::from_secs(1) && max < ttl => {
                    debug!(
                        tenant = request.tenant,
                        ?max,
                        "the tenant's leases are shorter than --lease-ttl; leasing for its maxLeaseSeconds"
                    );
                    lock(&self.tenant_ttls).insert(request.tenant.to_owned(), max);
                    ttl = max;
                    options = options.ttl(ttl);
                }
                Err(error) => return Err(refusal(error)),
            }
        };
        let upstream = upstream_of(&lease);
        debug!(proxy = %upstream.proxy, lease = lease.id(), host = request.host, "leased");
        Ok((lease, upstream))
    }

    fn session_key(&self, request: &RouteRequest<'_>) -> Option<SessionKey> {
        let session = request.options.session.clone()?;
        Some(SessionKey {
            tenant: request.tenant.to_owned(),
            token: request.token.to_owned(),
            session,
            host: request.host.to_ascii_lowercase(),
            pool: request.options.pool.clone(),
            zone: request.options.zone.clone(),
            provider: request.options.provider.clone(),
            selector: request.options.selector(),
        })
    }

    fn session(&self, key: &SessionKey, sticky: Duration) -> Arc<Session> {
        lock(&self.sessions)
            .entry(key.clone())
            .or_insert_with(|| {
                Arc::new(Session {
                    held: tokio::sync::Mutex::new(Held::default()),
                    last_used: Mutex::new(Instant::now()),
                    sticky,
                })
            })
            .clone()
    }

    /// The refusal being reported that `lease`, just taken by `tenant`, is on.
    fn being_reported(&self, tenant: &str, lease: &LeaseGuard) -> Option<Arc<Refused>> {
        self.reporting.borrow().iter().find(|report| report.covers(tenant, lease)).cloned()
    }

    /// Reports `reported` on `lease` (the tenant's, which the site refused): first every session of the tenant lets
    /// go of that proxy (or one with its egress address) for the site, closing its tunnels there, so none goes on
    /// sending through it while the discovery API writes the cooldown down; and until the API has answered, a lease
    /// the tenant takes on it for the site is given back ([`LeaseRouter::lease`]). Returns the end of the cooldown.
    async fn refuse(
        &self,
        tenant: &str,
        lease: &LeaseGuard,
        reported: Outcome,
        status: Option<u16>,
    ) -> Result<Option<String>, ClientError> {
        let refused = Arc::new(Refused::of(tenant, lease));
        self.reporting.send_modify(|reports| reports.push(refused.clone()));
        let _reporting = Reporting { reports: &self.reporting, refused: refused.clone() };
        // At once, not one after the other: until the report reaches the discovery API, every other gateway replica
        // may still be given the proxy for the site, so nothing here may hold the report up (a session busy leasing
        // made this replica's sessions wait up to 200 ms each before the report went out, and crawls at full caps
        // sent requests through the refused proxy at the other replica meanwhile).
        let ((), answer) = tokio::join!(self.let_go(&refused), lease.report(reported, status));
        answer
    }

    /// Ends every session's hold of the tenant on the proxy `refused` names (or one with its egress address) for its
    /// site: the proxy now cools down for the site, so no session of the tenant may go on sending there; each leases
    /// again at its next request.
    async fn let_go(&self, refused: &Refused) {
        let moved = self.leave_where(&refused.tenant, |lease| refused.covers(&refused.tenant, lease)).await;
        if moved > 0 {
            debug!(proxy = %refused.proxy, target = refused.target, moved, "sessions let go of a proxy cooling down");
        }
    }

    /// Ends every session's hold of `tenant` on a (site, proxy) pair of `cooling`: what a refusal stream that
    /// (re)connected says is cooling down for the sites the tenant's reports refused.
    async fn let_go_cooling(&self, tenant: &str, cooling: &HashSet<(String, ProxyId)>) {
        if !cooling.is_empty() {
            self.leave_where(tenant, |lease| cooling.contains(&(lease.target().to_owned(), lease.proxy()))).await;
        }
    }

    /// Ends the hold of every session of `tenant` whose lease `leaves` picks; returns how many.
    async fn leave_where(&self, tenant: &str, leaves: impl Fn(&LeaseGuard) -> bool) -> usize {
        let sessions: Vec<Arc<Session>> = lock(&self.sessions)
            .iter()
            .filter(|(key, _)| key.tenant == tenant)
            .map(|(_, session)| session.clone())
            .collect();
        // Every session at once: a session waiting for a new lease holds its lock for as long as that takes (up to
        // --max-wait when the fleet is full), and the lease it gets is not on the cooling proxy, so it is given up on
        // after 200 ms, without holding up the sessions after it.
        let leaves = &leaves;
        let attempts = sessions.into_iter().map(|session| async move {
            let Ok(mut held) = tokio::time::timeout(Duration::from_millis(200), session.held.lock()).await else {
                return 0;
            };
            if held.lease.as_ref().is_some_and(leaves) {
                held.leave();
                1
            } else {
                0
            }
        });
        futures::future::join_all(attempts).await.into_iter().sum()
    }

    /// Reports `report` on the proxy `session` holds for the request's site, and lets every session of the tenant go
    /// of it. A session this replica holds no lease for (its requests went through another replica, or it idled
    /// past its stickiness here) leases one first: the store gives a session the proxy it holds, whichever replica
    /// leased it. Returns the proxy reported.
    async fn report_session(
        &self,
        request: &RouteRequest<'_>,
        session: &Session,
        report: Report,
    ) -> Result<String, GatewayError> {
        let mut held = session.held.lock().await;
        if let Some(proxy) = held.echo() {
            debug!(%proxy, host = request.host, "a report of a proxy the session just left: already reported");
            return Ok(proxy.to_owned());
        }
        let left = held.leave();
        drop(held);
        let lease = match left {
            Some(lease) => lease,
            // Not one of the session's requests: its lifetime does not move it to another proxy to report on.
            None => self.lease(request, false).await?.0,
        };
        let reported = match report {
            Report::Banned => Outcome::Banned,
            Report::Throttled(retry_after) => Outcome::Throttled { retry_after },
        };
        // Reported or not, the crawler saw the site refuse it: no session of the tenant goes on through it.
        let result = self.refuse(request.tenant, &lease, reported, None).await;
        let until =
            result.map_err(|error| GatewayError::discovery(format!("reporting the refusal failed: {error}")))?;
        info!(
            proxy = %lease.proxy(),
            host = request.host,
            cooldown_until = until.as_deref().unwrap_or("-"),
            "reported the refusal the crawler saw"
        );
        // A lease taken just to report on was never held: its proxy is the one the session left all the same.
        session.held.lock().await.left = Some((lease.proxy().to_string(), Instant::now()));
        Ok(lease.proxy().to_string())
    }

    /// Renews the leases sessions use and releases the ones idle past their stickiness.
    async fn sweep_once(&self) {
        let sessions: Vec<(SessionKey, Arc<Session>)> =
            lock(&self.sessions).iter().map(|(key, session)| (key.clone(), session.clone())).collect();
        for (key, session) in sessions {
            let idle = lock(&session.last_used).elapsed();
            if idle >= session.sticky {
                lock(&self.sessions).remove(&key);
                let mut held = session.held.lock().await;
                if let Some(lease) = held.lease.take() {
                    debug!(lease = lease.id(), "session idle past its stickiness; releasing its lease");
                }
                continue;
            }
            let mut guard = session.held.lock().await;
            let held = &mut *guard;
            let ttl = self.ttl_for(&key.tenant);
            let due = held.renewed.is_some_and(|renewed| renewed.elapsed() >= ttl / 2);
            if !due {
                continue;
            }
            let Some(lease) = held.lease.as_mut() else { continue };
            // A session that sent nothing since the last renewal and has nothing open through its proxy gives the
            // lease back rather than hold a slot of the proxy's cap while it idles: the store keeps its choice (the
            // session is the lease's sticky key), so its next request leases the same proxy while it is eligible.
            let unused = held.renewed.is_some_and(|renewed| *lock(&session.last_used) <= renewed);
            // The hold keeps one receiver of its revocation; every request or tunnel using the proxy another.
            let in_use = held.revoke.as_ref().is_some_and(|revoke| revoke.receiver_count() > 1);
            if unused && !in_use {
                debug!(
                    lease = lease.id(),
                    "session idle since its last renewal; releasing its lease, keeping its choice"
                );
                *held = Held { left: held.left.take(), ..Held::default() };
                continue;
            }
            match lease.renew(Some(ttl)).await {
                Ok(replaced) => {
                    if replaced {
                        info!(lease = lease.id(), "the session's proxy was replaced; moving to its new instance");
                        let mut upstream = upstream_of(lease);
                        upstream.revoked = held.revoke.as_ref().map(watch::Sender::subscribe);
                        held.upstream = Some(upstream);
                    }
                    held.renewed = Some(Instant::now());
                }
                // The discovery API or its state store is out of reach for now (503, a 5xx, no answer): the lease
                // stays the session's, as the API promises ("sessions holding a lease carry on"), and is renewed at
                // the next sweep. Leasing again could not succeed meanwhile, and would move the session.
                Err(error) if transient(&error) => {
                    debug!(%error, "renewing a session's lease failed for now; the session keeps its proxy and renews later");
                }
                Err(error) => {
                    debug!(%error, "renewing a session's lease failed; the next request leases again");
                    *held = Held::default();
                }
            }
        }
    }
}

/// The first pause before following a tenant's refusals again after its stream ended; it doubles up to
/// [`MAX_FOLLOW_PAUSE`] while the discovery API does not answer (a change of leader takes a few seconds at most).
const FIRST_FOLLOW_PAUSE: Duration = Duration::from_millis(50);
const MAX_FOLLOW_PAUSE: Duration = Duration::from_secs(2);

/// Follows the refusals the tenant of `token` reports (through any gateway replica or any client) for as long as the
/// router lives, and makes every session of the tenant here let go of each refused proxy for its site: a refusal
/// seen at another replica reaches this one's sessions as soon as the discovery API has it. A stream that ends is
/// followed again (it starts with the tenant's live cooldowns, so nothing reported meanwhile is missed); a token
/// the API no longer knows stops being followed, and is followed again when it leases here next.
async fn follow_refusals(
    router: Weak<LeaseRouter>,
    mut alive: watch::Receiver<()>,
    client: DiscoveryClient,
    token: String,
    tenant: String,
) {
    let mut pause = FIRST_FOLLOW_PAUSE;
    loop {
        let stream = tokio::select! {
            stream = client.refusals() => stream,
            _ = alive.changed() => return,
        };
        match stream {
            Ok(mut stream) => {
                let mut synced = false;
                // The live cooldowns the stream starts with are let go of in one pass over the sessions.
                let mut snapshot: HashSet<(String, ProxyId)> = HashSet::new();
                loop {
                    let event = tokio::select! {
                        event = stream.next() => event,
                        _ = alive.changed() => return,
                    };
                    let Some(router) = router.upgrade() else { return };
                    match event {
                        Ok(Some(RefusalEvent::Refused { target, proxies, .. })) if !synced => {
                            snapshot.extend(proxies.into_iter().map(|proxy| (target.clone(), proxy)));
                        }
                        Ok(Some(RefusalEvent::Refused { target, proxies, .. })) => {
                            for proxy in proxies {
                                let refused =
                                    Refused { tenant: tenant.clone(), target: target.clone(), proxy, egress_ip: None };
                                router.let_go(&refused).await;
                            }
                        }
                        Ok(Some(RefusalEvent::Synced)) => {
                            router.let_go_cooling(&tenant, &std::mem::take(&mut snapshot)).await;
                            debug!(%tenant, "following the tenant's refusals");
                            synced = true;
                            pause = FIRST_FOLLOW_PAUSE;
                            router.following.send_modify(|count| *count += 1);
                        }
                        Ok(None) | Err(_) => {
                            if let Err(error) = &event {
                                debug!(%tenant, %error, "the tenant's refusal stream broke; following it again");
                            }
                            if synced {
                                router.following.send_modify(|count| *count = count.saturating_sub(1));
                            }
                            break;
                        }
                    }
                }
            }
            Err(ClientError::Unauthorized(_) | ClientError::Forbidden(_)) => {
                debug!(%tenant, "the token may no longer follow refusals; stopping until it leases here again");
                if let Some(router) = router.upgrade() {
                    lock(&router.clients).remove(&token);
                }
                return;
            }
            Err(error) => debug!(%tenant, %error, "following the tenant's refusals failed; trying again"),
        }
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            _ = alive.changed() => return,
        }
        pause = (pause * 2).min(MAX_FOLLOW_PAUSE);
    }
}

/// How often the router looks for leases to renew and sessions to release. Well under half the shortest lease
/// (10 s, or a tenant's `maxLeaseSeconds`): at 5 s a 10 s lease's renewal, due after 5 s, could come at the next
/// sweep after it expired (its expiry is kept to the second).
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);

async fn sweep(router: Weak<LeaseRouter>) {
    let mut interval = tokio::time::interval(SWEEP_INTERVAL);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(router) = router.upgrade() else { return };
        router.sweep_once().await;
    }
}

#[async_trait]
impl Router for LeaseRouter {
    async fn route(&self, request: &RouteRequest<'_>) -> Result<Upstream, GatewayError> {
        let Some(key) = self.session_key(request) else {
            let (lease, mut upstream) = self.lease(request, true).await?;
            upstream.hold = Some(Arc::new(lease));
            return Ok(upstream);
        };
        let session = self.session(&key, request.options.sticky.unwrap_or(self.config.default_sticky));
        *lock(&session.last_used) = Instant::now();
        if let Some(report) = request.report {
            // The crawler saw a refusal the gateway could not (inside a tunnel): reported on the session's lease,
            // which every session of the tenant then leaves for the site, and this request goes elsewhere.
            self.report_session(request, &session, report).await?;
        }
        if request.options.limits_session() {
            // A session with a lifetime leases for each request, held until its answer (or tunnel) ends, like a
            // request without one: the lease state keeps it on one proxy and counts its requests and its time at
            // every replica, and moves it once it is over.
            let (lease, mut upstream) = self.lease(request, true).await?;
            if let Some(left) = lease.session_ends_in() {
                // A tunnel outliving the session's time on this proxy closes then: the client's next connection
                // leases again, elsewhere.
                let (revoke, revoked) = watch::channel(false);
                upstream.revoked = Some(revoked);
                tokio::spawn(async move {
                    tokio::select! {
                        () = tokio::time::sleep(left) => {
                            revoke.send_replace(true);
                        }
                        () = revoke.closed() => {}
                    }
                });
            }
            upstream.hold = Some(Arc::new(lease));
            return Ok(upstream);
        }
        let mut held = session.held.lock().await;
        if let (Some(_), Some(upstream)) = (&held.lease, &held.upstream) {
            return Ok(upstream.clone());
        }
        let (lease, mut upstream) = self.lease(request, true).await?;
        if lease.proxy_ref().pacing.is_some() {
            // A paced proxy takes one request per lease: the session's next request leases again (the store keeps
            // it on this proxy) and waits for the address's next slot for the site, at whichever replica it arrives.
            upstream.hold = Some(Arc::new(lease));
            return Ok(upstream);
        }
        Ok(held.hold(lease, upstream))
    }

    async fn report(&self, request: &RouteRequest<'_>, report: Report) -> Result<String, GatewayError> {
        let key = self.session_key(request).ok_or_else(|| {
            GatewayError::bad_request("a report is on a session's proxy: put session-<id> in the proxy user name")
        })?;
        let session = self.session(&key, request.options.sticky.unwrap_or(self.config.default_sticky));
        self.report_session(request, &session, report).await
    }

    async fn outcome(&self, request: &RouteRequest<'_>, upstream: &Upstream, outcome: Routed) -> Verdict {
        let Routed::Answered(status, retry_after) = outcome else { return Verdict::Accepted };
        let code = status.as_u16();
        let reported = if self.config.ban_statuses.contains(&code) {
            Outcome::Banned
        } else if self.config.throttle_statuses.contains(&code) {
            Outcome::Throttled { retry_after }
        } else {
            return Verdict::Accepted;
        };
        let lease = match (&upstream.hold, self.session_key(request)) {
            (Some(hold), _) => Some(hold.clone()),
            (None, Some(key)) => {
                let session = lock(&self.sessions).get(&key).cloned();
                match session {
                    // The session lets go of this proxy (unless it already did, after another request's refusal,
                    // and may hold another by now): the next request leases again, elsewhere.
                    Some(session) => {
                        let mut held = session.held.lock().await;
                        let through =
                            held.lease.as_ref().is_some_and(|lease| upstream.lease.as_deref() == Some(lease.id()));
                        if through { held.leave().map(Arc::new) } else { None }
                    }
                    None => None,
                }
            }
            (None, None) => None,
        };
        if let Some(lease) = lease {
            match self.refuse(request.tenant, &lease, reported, Some(code)).await {
                Ok(until) => {
                    info!(proxy = %upstream.proxy, host = request.host, status = code, cooldown_until = until.as_deref().unwrap_or("-"), "reported the site's refusal")
                }
                Err(error) => debug!(%error, "reporting a refusal failed"),
            }
        }
        Verdict::Blocked
    }
}

/// The upstream a lease points at: the proxy's address and credentials as the API answered them.
fn upstream_of(lease: &LeaseGuard) -> Upstream {
    let proxy = lease.proxy_ref();
    let credentials = proxy.credentials.as_ref().map(|credentials| (&*credentials.username, &*credentials.password));
    let mut upstream = Upstream::new(proxy.address(), credentials, proxy.id());
    upstream.lease = Some(lease.id().to_owned());
    upstream
}

/// Whether a failed renewal says nothing of the lease itself: the API or its state could not answer now.
fn transient(error: &ClientError) -> bool {
    match error {
        ClientError::Unavailable { .. } | ClientError::Transport(_) => true,
        ClientError::Status { status, .. } => *status >= 500,
        _ => false,
    }
}

/// The gateway's answer to a lease the discovery API refused.
fn refusal(error: ClientError) -> GatewayError {
    match error {
        ClientError::Unavailable { reason, detail, retry_after }
        | ClientError::Conflict { reason, detail, retry_after } => {
            GatewayError::unavailable(format!("{reason}: {detail}"), retry_after)
        }
        ClientError::QuotaExceeded { reason, detail, retry_after } => {
            GatewayError::quota(format!("{reason}: {detail}"), retry_after)
        }
        ClientError::Unauthorized(detail) => GatewayError::credentials(format!("the token is not valid: {detail}")),
        ClientError::Forbidden(detail) => GatewayError::credentials(format!("the token may not lease: {detail}")),
        ClientError::BadRequest(detail) | ClientError::TtlAboveTenantMax { detail, .. } => {
            GatewayError::bad_request(detail)
        }
        // An unknown pool (or proxy): asking again gets the same answer, so no Retry-After.
        ClientError::NotFound(detail) => GatewayError::bad_request(detail),
        other => GatewayError::discovery(other.to_string()),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
