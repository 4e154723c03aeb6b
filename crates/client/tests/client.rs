//! The client against a real discovery server over a socket.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use egress_client::{ClientError, DiscoveryClient, LeaseOptions, Outcome, RefusalEvent};
use egress_discovery::{
    Auth, Discovery, DiscoveryMetrics, PoolId, ProxyCredentials, ProxyId, ProxyRecord, TokenFile, router, serve,
};
use egress_lease::{InMemoryLeaseStore, LeaseConfig};

fn record(name: &str, max_leases: u32) -> ProxyRecord {
    ProxyRecord {
        id: ProxyId::new("crawl", name),
        host: "127.0.0.1".into(),
        port: 3128,
        egress_ip: None,
        labels: BTreeMap::from([("region".to_owned(), "eu".to_owned())]),
        zone: None,
        provider: None,
        max_leases,
        healthy: true,
        credentials: Some(ProxyCredentials::new("crawler", "secret")),
        cooldowns: Vec::new(),
        pool: None,
        cooldown: None,
        pacing: None,
    }
}

struct Fixture {
    url: String,
    state: Arc<Discovery>,
    records: Vec<ProxyRecord>,
    _tokens: tempfile::NamedTempFile,
}

async fn start(records: Vec<ProxyRecord>) -> Fixture {
    let tokens = tempfile::NamedTempFile::new().expect("token file");
    std::fs::write(
        tokens.path(),
        "read read-token-0123456789\nlease lease-token-0123456789\nadmin admin-token-0123456789\n\
         lease capped-token-0123456789 tenant=capped maxLeases=1\n",
    )
    .expect("tokens");
    let store = Arc::new(InMemoryLeaseStore::new(LeaseConfig::default()));
    let auth = Auth::Tokens(TokenFile::load(tokens.path()).expect("load tokens"));
    let state = Arc::new(Discovery::new(store, auth, DiscoveryMetrics::default()));
    for record in &records {
        state.upsert(record.clone()).await;
    }
    state.mark_synced();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(serve(listener, router(state.clone()), std::future::pending()));
    Fixture { url, state, records, _tokens: tokens }
}

fn lease_client(fixture: &Fixture) -> DiscoveryClient {
    DiscoveryClient::new(&fixture.url, Some("lease-token-0123456789".into())).expect("client")
}

async fn active(client: &DiscoveryClient) -> u32 {
    client.proxies(None, None).await.expect("list").iter().map(|proxy| proxy.active_leases).sum()
}

#[tokio::test]
async fn lease_report_renew_and_release() {
    let fixture = start(vec![record("a", 2), record("b", 2)]).await;
    let client = lease_client(&fixture);
    let mut lease = client
        .lease(LeaseOptions::for_target("www.shop.example.com").ttl(Duration::from_secs(60)))
        .await
        .expect("lease");
    assert_eq!(lease.target(), "example.com");
    assert_eq!(lease.proxy_url(), "http://crawler:secret@127.0.0.1:3128");
    let (before, first_id) = (lease.expires_at().to_owned(), lease.id().to_owned());
    assert!(!lease.renew(Some(Duration::from_secs(600))).await.expect("renew"), "no replacement");
    assert_ne!(lease.expires_at(), before);
    assert_ne!(lease.id(), first_id, "the guard keeps the renewed ID");
    lease.report_counts(9, 1).await.expect("counts");
    let until = lease.report(Outcome::Banned, Some(403)).await.expect("report");
    assert!(until.is_some(), "a ban returns the cooldown's end");
    let banned = lease.proxy();
    let resumed = client.resume(lease.id(), None).await.expect("resume by ID");
    assert_eq!((resumed.proxy(), resumed.proxy_url()), (banned.clone(), lease.proxy_url()));
    std::mem::forget(resumed);
    let cooldowns = client.cooldowns(Some("img.example.com")).await.expect("cooldowns");
    assert_eq!(cooldowns.len(), 1);
    assert_eq!(
        (cooldowns[0].proxy.as_str(), cooldowns[0].target.as_str(), cooldowns[0].streak),
        (banned.as_str(), "example.com", 1)
    );
    assert_eq!(Some(&cooldowns[0].until), until.as_ref());
    assert!(client.cooldowns(Some("other.org")).await.expect("cooldowns").is_empty());
    lease.release().await.expect("release");
    assert_eq!(active(&client).await, 0);

    let next = client.lease(LeaseOptions::for_target("example.com")).await.expect("lease");
    assert_ne!(next.proxy(), banned, "the banned proxy is skipped for that site");
    let listed = client.proxies(Some("region=eu"), Some("example.com")).await.expect("list");
    let cooling = listed.iter().find(|proxy| proxy.id() == banned).expect("listed");
    assert!(cooling.cooling_down_until.is_some());
    assert_eq!((cooling.reported, cooling.success_rate), (Some(11), Some(9.0 / 11.0)));

    // A throttle: a cooldown of the site's Retry-After, for the other proxy.
    let throttled = next
        .report(Outcome::Throttled { retry_after: Some(Duration::from_secs(20)) }, Some(429))
        .await
        .expect("throttle");
    assert!(throttled.is_some(), "a throttle returns the cooldown's end");
    assert!(matches!(
        client.lease(LeaseOptions::for_target("example.com")).await.err(),
        Some(ClientError::Unavailable { reason, retry_after: Some(_), .. }) if reason == "all-cooling-down"
    ));
}

#[tokio::test]
async fn dropping_the_guard_releases_the_lease() {
    let fixture = start(vec![record("a", 1)]).await;
    let client = lease_client(&fixture);
    {
        let _lease = client.lease(LeaseOptions::for_target("example.com")).await.expect("lease");
        assert_eq!(active(&client).await, 1);
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut poll = tokio::time::interval(Duration::from_millis(20));
    loop {
        poll.tick().await;
        if active(&client).await == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the dropped lease was never released");
    }
}

#[tokio::test]
async fn errors_are_typed() {
    let fixture = start(vec![record("a", 1)]).await;
    let client = lease_client(&fixture);
    let held = client.lease(LeaseOptions::for_target("example.com")).await.expect("lease");
    match client.lease(LeaseOptions::for_target("example.com").proxy(&ProxyId::new("crawl", "a"))).await {
        Err(ClientError::Conflict { reason, .. }) => assert_eq!(reason, "proxy-unavailable"),
        other => panic!("expected a conflict, got {:?}", other.map(|lease| lease.id().to_owned())),
    }
    match client.lease(LeaseOptions::for_target("example.com")).await {
        Err(ClientError::Unavailable { reason, retry_after, .. }) => {
            assert_eq!(reason, "all-at-capacity");
            assert!(retry_after.is_some());
        }
        other => panic!("expected unavailable, got {:?}", other.map(|lease| lease.id().to_owned())),
    }
    assert!(matches!(
        client.lease(LeaseOptions::for_target("example.com").proxy(&ProxyId::new("crawl", "nope"))).await.err(),
        Some(ClientError::NotFound(_))
    ));
    assert!(matches!(
        client.lease(LeaseOptions::for_target("not a host")).await.err(),
        Some(ClientError::BadRequest(_))
    ));

    // Revocation: the proxy turns unhealthy.
    let mut unhealthy = fixture.records[0].clone();
    unhealthy.healthy = false;
    fixture.state.upsert(unhealthy).await;
    let mut held = held;
    assert!(matches!(held.renew(None).await, Err(ClientError::Gone(_))));

    let anonymous = DiscoveryClient::new(&fixture.url, None).expect("client");
    assert!(matches!(anonymous.proxies(None, None).await, Err(ClientError::Unauthorized(_))));
    let reader = DiscoveryClient::new(&fixture.url, Some("read-token-0123456789".into())).expect("client");
    assert!(matches!(
        reader.lease(LeaseOptions::for_target("example.com")).await.err(),
        Some(ClientError::Forbidden(_))
    ));
    let listed = reader.proxies(None, None).await.expect("a read token lists");
    assert!(listed.is_empty(), "unhealthy proxies are not listed");
}

#[tokio::test]
async fn a_lease_by_pool_gets_a_member_or_says_the_pool_is_scaling_up() {
    let member = ProxyRecord { pool: Some(PoolId::new("crawl", "eu")), ..record("eu-0", 1) };
    let fixture = start(vec![record("loose", 5), member]).await;
    fixture.state.upsert_pool(egress_discovery::PoolRecord {
        id: PoolId::new("crawl", "eu"),
        replicas: 1,
        ready: 1,
        wakes: true,
        provisioning: Duration::from_secs(7),
    });
    fixture.state.upsert_pool(egress_discovery::PoolRecord {
        id: PoolId::new("crawl", "night"),
        replicas: 0,
        ready: 0,
        wakes: true,
        provisioning: Duration::from_secs(7),
    });
    let client = lease_client(&fixture);
    let lease = client.lease(LeaseOptions::for_target("example.com").pool("eu")).await.expect("a member");
    assert_eq!(lease.proxy(), ProxyId::new("crawl", "eu-0"));
    let listed = client.proxies(None, None).await.expect("list");
    let pools: Vec<Option<&str>> = listed.iter().map(|proxy| proxy.pool.as_deref()).collect();
    assert_eq!(pools, [Some("eu"), None]);
    match client.lease(LeaseOptions::for_target("example.com").pool("crawl/night")).await {
        Err(ClientError::Unavailable { reason, retry_after, .. }) => {
            assert_eq!(reason, "scaling-up");
            assert_eq!(retry_after, Some(Duration::from_secs(7)));
        }
        other => panic!("expected scaling-up, got {:?}", other.map(|lease| lease.id().to_owned())),
    }
}

#[tokio::test]
async fn an_admin_clears_a_cooldown_and_a_quota_is_its_own_error() {
    let fixture = start(vec![record("a", 5), record("b", 5)]).await;
    let client = lease_client(&fixture);
    let lease =
        client.lease(LeaseOptions::for_target("example.com").proxy(&ProxyId::new("crawl", "a"))).await.expect("lease");
    lease.report(Outcome::Banned, Some(403)).await.expect("ban");
    let admin = DiscoveryClient::new(&fixture.url, Some("admin-token-0123456789".into())).expect("client");
    match client.clear_cooldowns("example.com", Some(&ProxyId::new("crawl", "a"))).await {
        Err(ClientError::Forbidden(_)) => {}
        other => panic!("a lease token may not clear: {other:?}"),
    }
    let cleared = admin.clear_cooldowns("www.example.com", Some(&ProxyId::new("crawl", "a"))).await.expect("clear");
    assert_eq!((cleared.len(), cleared[0].proxy.as_str(), cleared[0].streak), (1, "crawl/a", 1));
    assert!(admin.cooldowns(None).await.expect("cooldowns").is_empty());
    client
        .lease(LeaseOptions::for_target("example.com").proxy(&ProxyId::new("crawl", "a")))
        .await
        .expect("a leases at once");

    let capped = DiscoveryClient::new(&fixture.url, Some("capped-token-0123456789".into())).expect("client");
    let _held = capped.lease(LeaseOptions::for_target("example.org")).await.expect("the first lease");
    match capped.lease(LeaseOptions::for_target("example.net")).await {
        Err(ClientError::QuotaExceeded { reason, retry_after, .. }) => {
            assert_eq!(reason, "quota-max-leases");
            assert!(retry_after.is_some());
        }
        other => panic!("the second lease is over the quota: {:?}", other.map(|lease| lease.proxy())),
    }
}

/// Refuses while its flag is set, as a replica that lost the lead or is shutting down.
struct Switch(std::sync::atomic::AtomicBool);

impl egress_discovery::Gate for Switch {
    fn refusal(&self) -> Option<String> {
        self.0.load(std::sync::atomic::Ordering::SeqCst).then(|| "not the leader".to_owned())
    }
}

/// `GET /v1/refusals` follows the tenant's own refusals from any of its clients: first its live cooldowns, then
/// `synced`, then each ban or throttle as it is taken; another tenant's refusals never appear, and the stream ends
/// when the replica stops serving (heartbeats keep it open meanwhile, unseen by the caller).
#[tokio::test]
async fn refusals_follow_the_tenants_own_reports_and_end_when_the_replica_stops_serving() {
    let tokens = tempfile::NamedTempFile::new().expect("token file");
    std::fs::write(tokens.path(), "lease team-a-token-0123456789 tenant=a\nlease team-b-token-0123456789 tenant=b\n")
        .expect("tokens");
    let gate = Arc::new(Switch(std::sync::atomic::AtomicBool::new(false)));
    let store = Arc::new(InMemoryLeaseStore::new(LeaseConfig::default()));
    let auth = Auth::Tokens(TokenFile::load(tokens.path()).expect("load tokens"));
    let state = Arc::new(Discovery::new(store, auth, DiscoveryMetrics::default()).with_gate(gate.clone()));
    for name in ["a", "b", "c"] {
        state.upsert(record(name, 5)).await;
    }
    state.mark_synced();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(serve(listener, router(state.clone()), std::future::pending()));
    let team_a = DiscoveryClient::new(&url, Some("team-a-token-0123456789".into())).expect("client");
    let team_b = DiscoveryClient::new(&url, Some("team-b-token-0123456789".into())).expect("client");

    // A cooldown the tenant made before it follows comes first, then synced.
    let earlier = team_a.lease(LeaseOptions::for_target("shop.example.com")).await.expect("lease");
    earlier.report(Outcome::Banned, Some(403)).await.expect("report");
    let mut stream = team_a.refusals().await.expect("follow");
    let first = stream.next().await.expect("an event");
    assert!(
        matches!(&first, Some(RefusalEvent::Refused { target, proxies, .. }) if target == "example.com" && proxies == &[earlier.proxy()]),
        "{first:?}"
    );
    assert_eq!(stream.next().await.expect("an event"), Some(RefusalEvent::Synced));

    // Another tenant's refusal is not this one's; its own throttle, through another client, is.
    let theirs = team_b.lease(LeaseOptions::for_target("other.example.org")).await.expect("lease");
    theirs.report(Outcome::Banned, Some(403)).await.expect("report");
    let ours = team_a.lease(LeaseOptions::for_target("news.example.net")).await.expect("lease");
    ours.report(Outcome::Throttled { retry_after: Some(Duration::from_secs(30)) }, Some(429)).await.expect("report");
    let next = tokio::time::timeout(Duration::from_secs(10), stream.next()).await.expect("in time").expect("event");
    assert!(
        matches!(&next, Some(RefusalEvent::Refused { target, proxies, .. }) if target == "example.net" && proxies == &[ours.proxy()]),
        "{next:?}"
    );
    // Counts alone refuse nothing.
    ours.report_counts(3, 0).await.expect("counts");

    // The replica stops serving: the stream ends, and a new one is refused until it serves again.
    gate.0.store(true, std::sync::atomic::Ordering::SeqCst);
    let ended = tokio::time::timeout(Duration::from_secs(5), stream.next()).await.expect("ends in time");
    assert_eq!(ended, Ok(None));
    assert!(matches!(team_a.refusals().await, Err(ClientError::Unavailable { reason, .. }) if reason == "not-serving"));
    gate.0.store(false, std::sync::atomic::Ordering::SeqCst);
    let mut again = team_a.refusals().await.expect("follow again");
    let mut snapshot = Vec::new();
    while let Some(event) = again.next().await.expect("an event") {
        if event == RefusalEvent::Synced {
            break;
        }
        snapshot.push(event);
    }
    assert_eq!(snapshot.len(), 2, "both of the tenant's live cooldowns, none of the other's: {snapshot:?}");
}
