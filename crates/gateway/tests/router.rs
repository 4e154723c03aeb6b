//! The lease router on its own, in-process and on a paused clock: a real discovery server and lease store on
//! loopback, the router's `route`, `outcome` and `report` called directly, no Squid and no gateway in front. What
//! takes minutes of wall time through real proxies (stickiness, renewals at half the TTL, the echo window, waiting
//! for a proxy) takes the clock's jumps here, so each test runs in milliseconds.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use egress_discovery::{Auth, Discovery, DiscoveryMetrics, ProxyId, ProxyRecord, router, serve};
use egress_gateway::{
    GatewayError, LeaseRouter, LeaseRouterConfig, Options, Report, RouteRequest, Routed, Router, Upstream, Verdict,
};
use egress_lease::{InMemoryLeaseStore, LeaseConfig, LeaseStore};
use http::StatusCode;
use tokio::net::TcpListener;
use tokio::time::{Instant, sleep};

const TOKEN: &str = "t0ken";

/// A proxy nothing connects to (the router only hands out its address), leaving through its own egress address.
fn record(index: u8, max_leases: u32, healthy: bool) -> ProxyRecord {
    ProxyRecord {
        id: ProxyId::new("crawl", &format!("p{index}")),
        host: format!("127.0.0.{}", index + 10),
        port: 3128,
        egress_ip: Some(format!("127.0.0.{}", index + 10)),
        labels: BTreeMap::new(),
        zone: None,
        provider: None,
        max_leases,
        healthy,
        credentials: None,
        cooldowns: Vec::new(),
        pool: None,
        cooldown: None,
        pacing: None,
    }
}

/// A discovery server in this runtime, with the requests it was asked to renew a lease counted.
struct Fleet {
    state: Arc<Discovery>,
    store: Arc<InMemoryLeaseStore>,
    address: SocketAddr,
    renewals: Arc<AtomicUsize>,
}

impl Fleet {
    async fn start(proxies: Vec<ProxyRecord>) -> Self {
        let store = Arc::new(InMemoryLeaseStore::new(LeaseConfig::default()));
        let state = Arc::new(Discovery::new(store.clone(), Auth::Disabled, DiscoveryMetrics::default()));
        for proxy in proxies {
            state.upsert(proxy).await;
        }
        state.mark_synced();
        let renewals = Arc::new(AtomicUsize::new(0));
        let counted = renewals.clone();
        let app = router(state.clone()).layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                if request.uri().path().ends_with("/renew") {
                    counted.fetch_add(1, Ordering::SeqCst);
                }
                next.run(request)
            },
        ));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        tokio::spawn(serve(listener, app, std::future::pending()));
        Self { state, store, address, renewals }
    }

    fn router(&self, config: impl FnOnce(LeaseRouterConfig) -> LeaseRouterConfig) -> Arc<LeaseRouter> {
        LeaseRouter::start(config(LeaseRouterConfig::new(format!("http://{}", self.address)))).expect("router")
    }

    fn active(&self) -> usize {
        self.store.active_leases()
    }

    /// The proxies cooling down for `site`.
    fn cooling(&self, site: &str) -> BTreeSet<String> {
        let cooldowns = self.store.cooldowns(Some(site), SystemTime::now()).expect("cooldowns");
        cooldowns.into_iter().map(|cooldown| cooldown.proxy.to_string()).collect()
    }

    /// Waits (on the paused clock) until the store holds `count` leases: a lease given back on drop is released
    /// by a request of its own.
    async fn settle(&self, count: usize) {
        for _ in 0..100 {
            if self.active() == count {
                return;
            }
            sleep(Duration::from_millis(10)).await;
        }
        panic!("the store holds {} leases, not {count}", self.active());
    }
}

/// What the gateway asks the router for a crawler's request to `host` with the proxy user name `user`.
struct Ask {
    options: Options,
    host: &'static str,
}

impl Ask {
    fn new(user: &str, host: &'static str) -> Self {
        Self { options: Options::parse(user).expect("user name"), host }
    }

    fn request(&self, report: Option<Report>) -> RouteRequest<'_> {
        RouteRequest {
            tenant: "crawlers",
            token: TOKEN,
            host: self.host,
            port: 443,
            options: &self.options,
            connect: true,
            report,
        }
    }

    async fn route(&self, router: &LeaseRouter) -> Upstream {
        router.route(&self.request(None)).await.expect("a proxy")
    }
}

fn revoked(upstream: &Upstream) -> bool {
    upstream.revoked.as_ref().is_some_and(|revoked| *revoked.borrow())
}

/// Requests of one session and site keep one proxy and one lease; requests without a session take a lease each,
/// given back when the request ends, and rotate over the proxies the session leaves free.
#[tokio::test(start_paused = true)]
async fn sessions_stick_and_requests_without_one_rotate() {
    let fleet = Fleet::start((1..=3).map(|index| record(index, 10, true)).collect()).await;
    let router = fleet.router(|config| config);
    let session = Ask::new("session-s1", "a.test");
    let first = session.route(&router).await;
    for _ in 0..3 {
        let again = session.route(&router).await;
        assert_eq!((&again.proxy, &again.lease), (&first.proxy, &first.lease), "the session moved");
    }
    assert_eq!((fleet.active(), router.sessions()), (1, 1));

    let rotating = Ask::new("", "a.test");
    let mut seen = Vec::new();
    for _ in 0..4 {
        let upstream = rotating.route(&router).await;
        assert_eq!(fleet.active(), 2, "a request without a session holds a lease of its own while it runs");
        seen.push(upstream.proxy.clone());
        drop(upstream);
        fleet.settle(1).await;
    }
    assert!(!seen.contains(&first.proxy), "a request without a session was sent to the busier proxy: {seen:?}");
    assert_eq!(seen.iter().collect::<BTreeSet<_>>().len(), 2, "requests without a session did not rotate: {seen:?}");
}

/// A session with a lifetime (`requests-<n>`) leases for each request, holds the lease until the request ends, and
/// moves to another proxy after its n-th request there; a refusal moves it at once, its count starting over.
#[tokio::test(start_paused = true)]
async fn a_session_with_a_request_limit_leases_per_request_and_moves_after_it() {
    let fleet = Fleet::start((1..=3).map(|index| record(index, 10, true)).collect()).await;
    let router = fleet.router(|config| config);
    let session = Ask::new("session-s1,requests-2", "a.test");
    let mut seen = Vec::new();
    for _ in 0..6 {
        let upstream = session.route(&router).await;
        assert_eq!(fleet.active(), 1, "the request holds its lease while it runs");
        seen.push(upstream.proxy.clone());
        drop(upstream);
        fleet.settle(0).await;
    }
    for pair in seen.chunks(2) {
        assert_eq!(pair[0], pair[1], "two requests per proxy: {seen:?}");
    }
    assert!(seen[1] != seen[2] && seen[3] != seen[4], "moved after every 2nd request: {seen:?}");
    // A ban on the first of a pair: the next request goes elsewhere at once.
    let refused = session.route(&router).await;
    let verdict = router.outcome(&session.request(None), &refused, Routed::Answered(StatusCode::FORBIDDEN, None)).await;
    assert_eq!(verdict, Verdict::Blocked);
    let next = session.route(&router).await;
    assert_ne!(next.proxy, refused.proxy, "a refused proxy is left at once");
    assert_eq!(fleet.cooling("a.test"), BTreeSet::from([refused.proxy.clone()]));
}

/// A session with `lifetime-<seconds>` is told how long it keeps its proxy: a tunnel open through it closes then, so
/// a browser's kept-alive tunnel does not keep the proxy past the session's lifetime.
#[tokio::test(start_paused = true)]
async fn a_tunnel_of_a_session_with_a_lifetime_closes_when_its_time_on_the_proxy_is_over() {
    let fleet = Fleet::start((1..=2).map(|index| record(index, 10, true)).collect()).await;
    let router = fleet.router(|config| config);
    let tunnel = Ask::new("session-s1,lifetime-3", "a.test").route(&router).await;
    sleep(Duration::from_millis(2500)).await;
    assert!(!revoked(&tunnel), "open within the lifetime");
    sleep(Duration::from_millis(600)).await;
    assert!(revoked(&tunnel), "closed once the session's 3 s on the proxy are over");
    // A session without a lifetime keeps its tunnel.
    let kept = Ask::new("session-s2", "a.test").route(&router).await;
    sleep(Duration::from_secs(30)).await;
    assert!(!revoked(&kept));
}

/// A session that sends nothing gives its lease back at its first renewal (half the TTL) and keeps its choice; it
/// is forgotten once idle for its stickiness.
#[tokio::test(start_paused = true)]
async fn an_idle_session_gives_its_lease_back_at_half_its_ttl_and_is_forgotten_after_its_stickiness() {
    let fleet = Fleet::start((1..=3).map(|index| record(index, 10, true)).collect()).await;
    let router = fleet.router(|config| LeaseRouterConfig { lease_ttl: Duration::from_secs(10), ..config });
    let session = Ask::new("session-idle,sticky-60", "a.test");
    let first = session.route(&router).await.proxy;
    drop(session.route(&router).await);
    sleep(Duration::from_millis(4_500)).await;
    assert_eq!(fleet.active(), 1, "released before its renewal was due");
    sleep(Duration::from_secs(1)).await;
    fleet.settle(0).await;
    assert_eq!((router.sessions(), fleet.renewals.load(Ordering::SeqCst)), (1, 0), "an idle lease was renewed");

    let again = session.route(&router).await.proxy;
    assert_eq!(again, first, "the store did not keep the session's choice");
    sleep(Duration::from_secs(61)).await;
    assert_eq!((router.sessions(), fleet.active()), (0, 0), "a session idle past its stickiness is still held");
}

/// A session with a request or tunnel in flight renews its lease at every half TTL however long it lasts, and gives
/// it back at the first renewal after the last one ended.
#[tokio::test(start_paused = true)]
async fn a_session_in_use_renews_its_lease_every_half_ttl() {
    let fleet = Fleet::start((1..=2).map(|index| record(index, 10, true)).collect()).await;
    let router = fleet.router(|config| LeaseRouterConfig { lease_ttl: Duration::from_secs(10), ..config });
    let session = Ask::new("session-busy", "a.test");
    let tunnel = session.route(&router).await;
    sleep(Duration::from_millis(30_500)).await;
    let renewals = fleet.renewals.load(Ordering::SeqCst);
    assert!((5..=6).contains(&renewals), "{renewals} renewals in 30 s of 10 s leases");
    let again = session.route(&router).await;
    assert_eq!(again.lease, tunnel.lease, "the session's lease changed while it renewed");
    assert_eq!(fleet.active(), 1);

    drop((tunnel, again));
    sleep(Duration::from_secs(11)).await;
    fleet.settle(0).await;
    assert_eq!(router.sessions(), 1, "only the lease goes; the session is kept for its stickiness");
}

/// A ban seen on one session's request cools the proxy down for that site, closes the tunnels of every session of
/// the tenant on it for the site and moves them, and leaves sessions for other sites where they are.
#[tokio::test(start_paused = true)]
async fn a_ban_moves_every_session_of_the_tenant_off_the_proxy_for_that_site_only() {
    // Only p1 is up at first, so every session starts on it.
    let fleet = Fleet::start(vec![record(1, 10, true), record(2, 10, false)]).await;
    let router = fleet.router(|config| config);
    let (s1, s2, other) =
        (Ask::new("session-s1", "a.test"), Ask::new("session-s2", "a.test"), Ask::new("session-s3", "b.test"));
    let (u1, u2, u3) = (s1.route(&router).await, s2.route(&router).await, other.route(&router).await);
    assert!([&u2.proxy, &u3.proxy].iter().all(|proxy| **proxy == u1.proxy));
    fleet.state.upsert(record(2, 10, true)).await;

    let verdict = router.outcome(&s1.request(None), &u1, Routed::Answered(StatusCode::FORBIDDEN, None)).await;
    assert_eq!(verdict, Verdict::Blocked);
    assert_eq!(fleet.cooling("a.test"), BTreeSet::from([u1.proxy.clone()]));
    assert!(revoked(&u1) && revoked(&u2), "the tunnels through the banned proxy for the site stay open");
    assert!(!revoked(&u3), "a session for another site lost its proxy");

    for session in [&s1, &s2] {
        assert_eq!(session.route(&router).await.proxy, "crawl/p2", "a session stayed on the banned proxy");
    }
    let kept = other.route(&router).await;
    assert_eq!((kept.proxy, kept.lease), (u3.proxy.clone(), u3.lease.clone()));
    assert_eq!(Ask::new("", "a.test").route(&router).await.proxy, "crawl/p2");

    // Any other answer is the site's to give, and moves nothing.
    let kept = s1.route(&router).await;
    let verdict = router.outcome(&s1.request(None), &kept, Routed::Answered(StatusCode::NOT_FOUND, None)).await;
    assert_eq!((verdict, revoked(&kept)), (Verdict::Accepted, false));
}

/// A crawler's report on its session (`POST /report`, `X-Egress-Report`) cools the session's proxy down; another
/// within the echo window, before the session leased again, is the same refusal seen twice and cools nothing else;
/// one after it is news, and cools the proxy the session is given next.
#[tokio::test(start_paused = true)]
async fn a_second_report_is_an_echo_inside_the_window_and_news_after_it() {
    let fleet = Fleet::start((1..=3).map(|index| record(index, 10, true)).collect()).await;
    let router = fleet.router(|config| config);
    let session = Ask::new("session-r", "a.test");
    let first = session.route(&router).await.proxy;
    let reported = router.report(&session.request(None), Report::Banned).await.expect("reported");
    assert_eq!(reported, first);
    sleep(Duration::from_secs(4)).await;
    let echo = router.report(&session.request(None), Report::Banned).await.expect("reported");
    assert_eq!((echo, fleet.cooling("a.test")), (first.clone(), BTreeSet::from([first.clone()])));

    sleep(Duration::from_secs(2)).await;
    let news = router.report(&session.request(None), Report::Throttled(None)).await.expect("reported");
    assert_ne!(news, first);
    assert_eq!(fleet.cooling("a.test"), BTreeSet::from([first.clone(), news.clone()]));
    let next = session.route(&router).await.proxy;
    assert!(next != first && next != news, "the session was given a cooling proxy: {next}");
}

/// With every proxy at its cap, a request waits for a slot to free (any lease ending frees one), not for the
/// discovery API's `Retry-After`, which at the cap is the first lease's expiry (up to the TTL, 120 s by default, past
/// any `max_wait`): it asks again after 50 ms, doubling to 1 s, takes the slot within a second of its release, and
/// is told the fleet is busy once `max_wait` has run out. The slot is held through one gateway replica and waited
/// for at another, as the two replicas `deploy/default` ships share one fleet.
#[tokio::test(start_paused = true)]
async fn a_request_at_the_cap_waits_for_a_slot_to_free_within_max_wait() {
    let fleet = Fleet::start(vec![record(1, 1, true)]).await;
    let replica = fleet.router(|config| LeaseRouterConfig { max_wait: Duration::from_secs(10), ..config });
    let router = fleet.router(|config| LeaseRouterConfig { max_wait: Duration::from_secs(10), ..config });
    let rotating = Ask::new("", "a.test");
    let holding = rotating.route(&replica).await;
    let started = Instant::now();
    let waiting = {
        let router = router.clone();
        tokio::spawn(async move {
            let upstream = Ask::new("", "a.test").route(&router).await;
            (upstream.proxy, started.elapsed())
        })
    };
    sleep(Duration::from_secs(3)).await;
    drop(holding);
    let (proxy, waited) = waiting.await.expect("the waiting request");
    assert_eq!(proxy, "crawl/p1");
    assert!(waited >= Duration::from_secs(3) && waited <= Duration::from_secs(4), "waited {waited:?}");

    let _holding = rotating.route(&router).await;
    let started = Instant::now();
    let error: GatewayError = router.route(&rotating.request(None)).await.expect_err("no slot within max_wait");
    let waited = started.elapsed();
    assert_eq!(error.status, StatusCode::SERVICE_UNAVAILABLE, "{error:?}");
    assert!(waited >= Duration::from_secs(9) && waited <= Duration::from_secs(10), "gave up after {waited:?}");
    assert_eq!(error.retry_after.map(|after| after > Duration::from_secs(100)), Some(true), "{error:?}");
}
