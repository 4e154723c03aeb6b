//! The shared lease state against a real `redis-server`: several replicas (stores on one server) agree on caps,
//! sessions, cooldowns and leases, a lost server answers `StateUnavailable` and is used again once back, and a
//! server that lost its data adopts the leases its clients show and takes cooldowns back from their records, also
//! behind a forwarder that closes connections while the server is away.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use egress_lease::{
    Cooldown, EndedSessions, InMemoryLeaseStore, LeaseConfig, LeaseError, LeaseKey, LeaseRequest, LeaseState,
    LeaseStore, Outcome, Pacing, ProxyId, ProxyInfo, Report, SessionLimits,
};
use egress_lease_redis::{ConnectError, RedisLeaseState, RedisOptions, redact};
use egress_testenv::redis::RedisServer;

fn proxy(name: &str, cap: u32, egress_ip: Option<&str>) -> ProxyInfo {
    ProxyInfo {
        id: ProxyId::new("crawl", name),
        healthy: true,
        max_leases: cap,
        labels: BTreeMap::new(),
        endpoint: format!("{name}.crawl:3128"),
        egress_ip: egress_ip.map(str::to_owned),
        pool: None,
        zone: None,
        provider: None,
        cooldown: None,
        pacing: None,
    }
}

fn request(target: &str, owner: &str) -> LeaseRequest {
    LeaseRequest { target: target.into(), owner: owner.into(), ..LeaseRequest::default() }
}

/// `count` replicas' stores on `server`, sharing one lease key, each knowing `proxies`.
async fn replicas(server: &RedisServer, count: usize, proxies: &[ProxyInfo]) -> Vec<Arc<RedisLeaseState>> {
    let key = LeaseKey::from_bytes(&[9; 32]).expect("key");
    let mut stores = Vec::new();
    for _ in 0..count {
        let store = RedisLeaseState::connect(&RedisOptions::new(server.url()), LeaseConfig::default(), key.clone())
            .await
            .expect("connect");
        for info in proxies {
            store.upsert_proxy(info.clone()).await.expect("upsert");
        }
        stores.push(Arc::new(store));
    }
    stores
}

/// `time` as the state keeps it, to the millisecond.
fn to_millis(time: SystemTime) -> SystemTime {
    let since = time.duration_since(SystemTime::UNIX_EPOCH).expect("after the epoch");
    SystemTime::UNIX_EPOCH + Duration::from_millis(since.as_millis() as u64)
}

async fn active(store: &RedisLeaseState, proxies: &[ProxyInfo]) -> Vec<u32> {
    let ids: Vec<&ProxyId> = proxies.iter().map(|info| &info.id).collect();
    store
        .loads_of(&ids, None, SystemTime::now())
        .await
        .expect("loads")
        .into_iter()
        .map(|load| load.expect("known").active_leases)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_leasing_at_once_never_take_a_proxy_above_its_cap() {
    let server = RedisServer::start(None).await.expect("redis");
    let proxies: Vec<ProxyInfo> = (0..5).map(|n| proxy(&format!("px-{n}"), 3, None)).collect();
    let stores = replicas(&server, 3, &proxies).await;
    let mut random = fastrand::Rng::with_seed(44);
    let mut held: Vec<(usize, String)> = Vec::new();
    for round in 0..12 {
        // Every replica asks at once, more than there is room for.
        let asks = (0..30).map(|n| {
            let store = stores[n % 3].clone();
            async move {
                (n % 3, store.lease(&request("example.com", &format!("tenant-{}", n % 4)), SystemTime::now()).await)
            }
        });
        for (replica, outcome) in futures::future::join_all(asks).await {
            match outcome {
                Ok(lease) => held.push((replica, lease.id)),
                Err(LeaseError::AllAtCapacity { retry_at }) => assert!(retry_at.is_some(), "a retry hint"),
                Err(error) => panic!("round {round}: {error}"),
            }
        }
        let counts = active(&stores[round % 3], &proxies).await;
        assert!(counts.iter().all(|count| *count <= 3), "round {round}: {counts:?}");
        assert_eq!(counts.iter().sum::<u32>() as usize, held.len(), "round {round}: every grant counted once");
        assert_eq!(held.len(), 15, "round {round}: the fleet fills up exactly");
        assert_eq!(stores[0].active_leases().await.expect("active"), 15);
        // Some leases end, at any replica (the one that granted them or another).
        random.shuffle(&mut held);
        let ending = random.usize(1..8);
        for (_, id) in held.drain(..ending) {
            let owner_of = |id: &str| {
                (0..4)
                    .map(|n| format!("tenant-{n}"))
                    .find(|owner| LeaseKey::from_bytes(&[9; 32]).expect("key").verify(id, owner).is_some())
            };
            let owner = owner_of(&id).expect("an owner");
            stores[random.usize(0..3)].release(&id, &owner, SystemTime::now()).await.expect("release");
        }
    }
    let by_owner = stores[1].leases_by_owner().await.expect("by owner");
    assert_eq!(by_owner.values().sum::<usize>(), held.len());
}

#[tokio::test]
async fn a_ban_at_one_replica_cools_the_proxy_for_that_site_at_every_replica() {
    let server = RedisServer::start(None).await.expect("redis");
    let proxies = vec![
        proxy("a", 5, Some("203.0.113.1")),
        proxy("b", 5, Some("203.0.113.1")),
        proxy("c", 5, Some("203.0.113.9")),
    ];
    let stores = replicas(&server, 2, &proxies).await;
    let now = SystemTime::now();
    let lease = stores[0].lease(&request("shop.example.com", "t1"), now).await.expect("lease");
    let reported = stores[0].report(&lease.id, "t1", &Report::of(Outcome::Banned), now).await.expect("report a ban");
    let until = reported.cooldown_until.expect("a cooldown");
    let cooldown = until.duration_since(now).expect("later");
    assert!(cooldown > Duration::from_secs(590) && cooldown <= Duration::from_secs(601), "{cooldown:?}");
    // The proxy leaving through the same address cools down too; the site sees one address.
    let mut cooled = reported.cooled.clone();
    cooled.sort();
    let sibling = if lease.proxy.name() == "a" {
        "b"
    } else if lease.proxy.name() == "b" {
        "a"
    } else {
        ""
    };
    if sibling.is_empty() {
        assert_eq!(cooled, vec![lease.proxy.clone()]);
    } else {
        assert_eq!(cooled.len(), 2, "{cooled:?}");
    }
    // The other replica never hands out a cooled proxy for that site, but does for another.
    for _ in 0..6 {
        let other = stores[1].lease(&request("www.example.com", "t2"), SystemTime::now()).await;
        let other = match other {
            Ok(other) => other,
            Err(LeaseError::AllCoolingDown { .. }) => break,
            Err(error) => panic!("{error}"),
        };
        assert!(!cooled.contains(&other.proxy), "{} is cooling down", other.proxy);
    }
    let elsewhere = stores[1]
        .lease(&LeaseRequest { proxy: Some(lease.proxy.clone()), ..request("other.org", "t2") }, SystemTime::now())
        .await
        .expect("the same proxy for another site");
    assert_eq!(elsewhere.proxy, lease.proxy);
    let named = stores[1]
        .lease(&LeaseRequest { proxy: Some(lease.proxy.clone()), ..request("example.com", "t2") }, SystemTime::now())
        .await;
    assert!(matches!(named, Err(LeaseError::ProxyCoolingDown { .. })), "{named:?}");
    // Both replicas list it, with who reported it; reporting again changes nothing.
    let listed = stores[1].cooldowns(Some("example.com"), SystemTime::now()).await.expect("cooldowns");
    assert_eq!(listed.len(), cooled.len());
    assert!(listed.iter().all(|cooldown| cooldown.reporters == ["t1"] && cooldown.streak == 1), "{listed:?}");
    let again =
        stores[1].report(&lease.id, "t1", &Report::of(Outcome::Banned), SystemTime::now()).await.expect("again");
    assert_eq!(again.cooldown_until, Some(until));
    assert!(again.cooled.is_empty());
    assert_eq!(stores[0].proxy_cooldowns(&lease.proxy, SystemTime::now()).await.expect("of the proxy")[0].until, until);
    // Clearing at one replica ends it at both.
    let cleared = stores[0].clear_cooldowns("example.com", Some(&lease.proxy), SystemTime::now()).await.expect("clear");
    assert_eq!(cleared.len(), cooled.len());
    assert!(stores[1].cooldowns(None, SystemTime::now()).await.expect("cooldowns").is_empty());
    let back = stores[1]
        .lease(&LeaseRequest { proxy: Some(lease.proxy.clone()), ..request("example.com", "t2") }, SystemTime::now())
        .await
        .expect("no longer cooling");
    assert_eq!(back.proxy, lease.proxy);
    // The outcomes counted are the same everywhere.
    let loads = stores[1].loads_of(&[&lease.proxy], Some("example.com"), SystemTime::now()).await.expect("loads");
    let outcomes = loads[0].as_ref().and_then(|load| load.outcomes).expect("outcomes");
    assert_eq!(outcomes.banned, 2);
}

#[tokio::test]
async fn a_session_gets_the_same_proxy_at_every_replica_and_as_in_memory() {
    let server = RedisServer::start(None).await.expect("redis");
    let proxies: Vec<ProxyInfo> = (0..6).map(|n| proxy(&format!("px-{n}"), 100, None)).collect();
    let stores = replicas(&server, 2, &proxies).await;
    let memory = InMemoryLeaseStore::new(LeaseConfig::default());
    for info in &proxies {
        LeaseStore::upsert_proxy(&memory, info.clone());
    }
    for session in ["s1", "s2", "s3", "s4"] {
        let ask = LeaseRequest { session: Some(session.into()), ..request("example.com", "t1") };
        let first = stores[0].lease(&ask, SystemTime::now()).await.expect("lease");
        let expected = LeaseStore::lease(&memory, &ask, SystemTime::now()).expect("in memory");
        assert_eq!(first.proxy, expected.proxy, "{session}: the same first proxy as the in-memory store");
        for n in 0..4 {
            let again = stores[n % 2].lease(&ask, SystemTime::now()).await.expect("lease");
            assert_eq!(again.proxy, first.proxy, "{session} at replica {}", n % 2);
        }
    }
    // Another owner's session of the same name is its own.
    let theirs = LeaseRequest { session: Some("s1".into()), ..request("example.com", "t2") };
    let expected = LeaseStore::lease(&memory, &theirs, SystemTime::now()).expect("in memory").proxy;
    assert_eq!(stores[1].lease(&theirs, SystemTime::now()).await.expect("lease").proxy, expected);
}

/// A session's lifetime is the shared state's: leases at either replica count toward it, and it moves as the
/// in-memory store moves it.
#[tokio::test]
async fn a_session_moves_after_its_leases_at_any_replica_and_after_its_lifetime() {
    let server = RedisServer::start(None).await.expect("redis");
    let proxies: Vec<ProxyInfo> = (0..4).map(|n| proxy(&format!("px-{n}"), 100, None)).collect();
    let stores = replicas(&server, 2, &proxies).await;
    let by_leases = LeaseRequest {
        session: Some("s1".into()),
        session_limits: SessionLimits { max_leases: Some(3), max_age: None },
        ..request("example.com", "t1")
    };
    let mut seen = Vec::new();
    for n in 0..9 {
        seen.push(stores[n % 2].lease(&by_leases, SystemTime::now()).await.expect("lease").proxy);
    }
    for (n, chunk) in seen.chunks(3).enumerate() {
        assert!(chunk.iter().all(|proxy| *proxy == chunk[0]), "leases {n}: three on one proxy: {seen:?}");
    }
    assert!(seen[2] != seen[3] && seen[5] != seen[6], "moved after every third lease: {seen:?}");
    let by_age = LeaseRequest {
        session: Some("s2".into()),
        session_limits: SessionLimits { max_age: Some(Duration::from_millis(1500)), max_leases: None },
        ..request("example.com", "t1")
    };
    let asked = SystemTime::now();
    let lease = stores[0].lease(&by_age, asked).await.expect("lease");
    let left = lease.session_until.and_then(|until| until.duration_since(asked).ok()).expect("the session's end");
    assert!(left > Duration::from_millis(1300) && left <= Duration::from_millis(1600), "{left:?}");
    let first = lease.proxy;
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(stores[1].lease(&by_age, SystemTime::now()).await.expect("lease").proxy, first, "within 1.5 s");
    tokio::time::sleep(Duration::from_millis(900)).await;
    let moved = stores[1].lease(&by_age, SystemTime::now()).await.expect("lease").proxy;
    assert_ne!(moved, first, "moved once 1.5 s passed");
    assert_eq!(stores[0].lease(&by_age, SystemTime::now()).await.expect("lease").proxy, moved, "and stays there");
    // A session kept by a version that wrote only the proxy's name counts as chosen now.
    let client = redis::Client::open(server.url()).expect("client");
    let mut connection = client.get_multiplexed_async_connection().await.expect("connect");
    redis::cmd("SET")
        .arg("{egress}:s:t1\ns3\nexample.com")
        .arg("crawl/px-2")
        .query_async::<()>(&mut connection)
        .await
        .expect("set");
    let old = LeaseRequest { session: Some("s3".into()), ..by_leases.clone() };
    for _ in 0..3 {
        assert_eq!(stores[0].lease(&old, SystemTime::now()).await.expect("lease").proxy, ProxyId::new("crawl", "px-2"));
    }
    assert_ne!(stores[0].lease(&old, SystemTime::now()).await.expect("lease").proxy, ProxyId::new("crawl", "px-2"));
}

/// A paced address is leased for a site once per interval across replicas, on the server's clock: the refusal says
/// when the next slot is, a session waits for its own proxy's slot, and another address takes the lease meanwhile.
#[tokio::test]
async fn a_paced_address_is_leased_once_per_interval_at_every_replica() {
    let server = RedisServer::start(None).await.expect("redis");
    let paced = Pacing { interval: Duration::from_millis(1500), burst: 1 };
    let proxies: Vec<ProxyInfo> = [("a1", "192.0.2.1"), ("a2", "192.0.2.1"), ("b", "192.0.2.2")]
        .into_iter()
        .map(|(name, ip)| ProxyInfo { pacing: Some(paced), ..proxy(name, 10, Some(ip)) })
        .collect();
    let stores = replicas(&server, 2, &proxies).await;
    let ask = request("shop.example", "t1");
    let first = stores[0].lease(&ask, SystemTime::now()).await.expect("lease").proxy;
    let second = stores[1].lease(&ask, SystemTime::now()).await.expect("lease").proxy;
    let addresses: std::collections::BTreeSet<bool> =
        [&first, &second].into_iter().map(|proxy| proxy.name() == "b").collect();
    assert_eq!(addresses.len(), 2, "one lease per address: {first} {second}");
    let asked = SystemTime::now();
    match stores[0].lease(&ask, asked).await {
        Err(LeaseError::Paced { until, proxy: None }) => {
            let wait = until.duration_since(asked).unwrap_or_default();
            assert!(wait > Duration::from_millis(1000) && wait <= Duration::from_millis(1500), "{wait:?}");
        }
        other => panic!("both addresses paced: {other:?}"),
    }
    stores[1].lease(&request("other.example", "t1"), SystemTime::now()).await.expect("another site has its own pace");
    tokio::time::sleep(Duration::from_millis(1600)).await;
    stores[1].lease(&ask, SystemTime::now()).await.expect("a slot freed");
    // A session waits for its own proxy: refused with its name and slot, then given it.
    let session = LeaseRequest { session: Some("s".into()), ..request("news.example", "t1") };
    let own = stores[0].lease(&session, SystemTime::now()).await.expect("lease").proxy;
    match stores[1].lease(&session, SystemTime::now()).await {
        Err(LeaseError::Paced { proxy: Some(proxy), .. }) => assert_eq!(proxy, own),
        other => panic!("the session's proxy is paced: {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert_eq!(stores[1].lease(&session, SystemTime::now()).await.expect("its slot").proxy, own);
}

/// Each gateway replica a session's requests reach leases for it: the session's leases for one site share one slot
/// of their proxy's cap at every replica, concurrently, and the slot is free once the last of them ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_leases_at_every_replica_share_one_slot_of_the_cap() {
    let server = RedisServer::start(None).await.expect("redis");
    let proxies: Vec<ProxyInfo> = (0..3).map(|n| proxy(&format!("px-{n}"), 2, None)).collect();
    let stores = replicas(&server, 3, &proxies).await;
    let ask = |session: usize| LeaseRequest { session: Some(format!("s{session}")), ..request("example.com", "t1") };
    // Six sessions fill the six slots; each replica then leases for every session at once.
    let mut held: Vec<(usize, ProxyId, String)> = Vec::new();
    for session in 0..6 {
        let lease = stores[0].lease(&ask(session), SystemTime::now()).await.expect("a slot for each session");
        held.push((session, lease.proxy, lease.id));
    }
    let asks = (0..18).map(|n| {
        let store = stores[n % 3].clone();
        async move { (n / 3, store.lease(&ask(n / 3), SystemTime::now()).await) }
    });
    for (session, outcome) in futures::future::join_all(asks).await {
        let lease = outcome.unwrap_or_else(|error| panic!("session s{session}: {error}"));
        assert_eq!(lease.proxy, held[session].1, "s{session} keeps its proxy though it is at its cap");
        held.push((session, lease.proxy, lease.id));
    }
    assert_eq!(active(&stores[1], &proxies).await, vec![2, 2, 2], "one slot per session");
    assert_eq!(stores[2].active_leases().await.expect("active"), 24);
    let refused = stores[1].lease(&request("example.com", "t1"), SystemTime::now()).await;
    assert!(matches!(refused, Err(LeaseError::AllAtCapacity { .. })), "{refused:?}");
    let other_site = LeaseRequest { target: "other.org".into(), ..ask(0) };
    let refused = stores[1].lease(&other_site, SystemTime::now()).await;
    assert!(matches!(refused, Err(LeaseError::AllAtCapacity { .. })), "another site is another slot: {refused:?}");
    // Session s0's slot stays taken until the last of its four leases ends, at whichever replica.
    let mine: Vec<String> = held.iter().filter(|(session, ..)| *session == 0).map(|(.., id)| id.clone()).collect();
    for (n, id) in mine.iter().enumerate() {
        assert!(stores[2].lease(&request("example.com", "t2"), SystemTime::now()).await.is_err(), "lease {n}");
        stores[n % 3].release(id, "t1", SystemTime::now()).await.expect("release");
    }
    let freed = stores[2].lease(&request("example.com", "t2"), SystemTime::now()).await.expect("s0's slot is free");
    assert_eq!(freed.proxy, held[0].1);
    held.retain(|(session, ..)| *session != 0);
    // A lowered cap revokes the newest slots until they fit it: a session's leases go together.
    let target = held[0].1.clone();
    let index = proxies.iter().position(|info| info.id == target).expect("known");
    stores[0].upsert_proxy(proxy(target.name(), 1, None)).await.expect("lower the cap");
    let mut renewed: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
    for (session, _, id) in held.iter().filter(|(_, proxy, _)| *proxy == target) {
        let ok = stores[1].renew(id, "t1", None, SystemTime::now()).await.is_ok();
        let (kept, all) = renewed.entry(*session).or_default();
        *kept += usize::from(ok);
        *all += 1;
    }
    let kept: Vec<_> = renewed.iter().filter(|(_, (kept, _))| *kept > 0).collect();
    assert!(kept.len() == 1 && kept[0].1.0 == kept[0].1.1, "one session's leases kept, all of them: {renewed:?}");
    assert_eq!(active(&stores[2], &proxies).await[index], 1);
}

#[tokio::test]
async fn leases_renew_release_and_report_at_any_replica_and_survive_a_server_that_lost_its_data() {
    let mut server = RedisServer::start(None).await.expect("redis");
    let proxies = vec![proxy("a", 2, None)];
    let stores = replicas(&server, 2, &proxies).await;
    let now = SystemTime::now();
    let lease = stores[0].lease(&request("example.com", "t1"), now).await.expect("lease");
    assert!(
        matches!(stores[1].renew(&lease.id, "t2", None, now).await, Err(LeaseError::UnknownLease(_))),
        "another owner"
    );
    let renewed = stores[1].renew(&lease.id, "t1", Some(Duration::from_secs(600)), now).await.expect("renew");
    assert!(renewed.lease.expires_at > lease.expires_at && renewed.moved_from.is_none());
    // The server restarts empty: the lease is adopted when shown, the cooldown comes back from its record.
    server.restart().await.expect("restart");
    let record = Cooldown {
        proxy: lease.proxy.clone(),
        target: "example.com".into(),
        until: SystemTime::now() + Duration::from_secs(300),
        streak: 1,
        reporters: vec!["t1".into()],
    };
    let mut restored = None;
    for _ in 0..50 {
        match stores[0].restore_cooldowns(std::slice::from_ref(&record), SystemTime::now()).await {
            Ok(count) => {
                restored = Some(count);
                break;
            }
            Err(LeaseError::StateUnavailable(_)) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(error) => panic!("{error}"),
        }
    }
    assert_eq!(restored, Some(1), "taken back once the server answers");
    assert_eq!(stores[0].restore_cooldowns(std::slice::from_ref(&record), SystemTime::now()).await.expect("again"), 0);
    let adopted = stores[1].renew(&renewed.lease.id, "t1", None, SystemTime::now()).await.expect("adopted");
    assert_eq!(adopted.lease.proxy, lease.proxy);
    assert_eq!(stores[1].adopted(), 1);
    assert_eq!(active(&stores[0], &proxies).await, vec![1]);
    // Its ban changes nothing: its owner's report made the restored cooldown.
    let reported = stores[0].report(&adopted.lease.id, "t1", &Report::of(Outcome::Banned), SystemTime::now()).await;
    assert_eq!(reported.expect("report").cooldown_until, Some(to_millis(record.until)));
    // Released at one replica, refused at the other from then on, and never adopted again.
    stores[0].release(&adopted.lease.id, "t1", SystemTime::now()).await.expect("release");
    stores[0].release(&adopted.lease.id, "t1", SystemTime::now()).await.expect("a second release is accepted");
    for id in [&lease.id, &renewed.lease.id, &adopted.lease.id] {
        let refused = stores[1].renew(id, "t1", None, SystemTime::now()).await;
        assert!(matches!(refused, Err(LeaseError::UnknownLease(_))), "{refused:?}");
    }
    assert_eq!(active(&stores[1], &proxies).await, vec![0]);
    // A late report on the released lease still counts against its proxy.
    let late = stores[1].report(&lease.id, "t1", &Report { ok: 3, ..Report::default() }, SystemTime::now()).await;
    assert_eq!(late.expect("a late report").proxy, lease.proxy);
}

#[tokio::test]
async fn quotas_drains_unhealthy_proxies_and_expiry_hold_across_replicas() {
    let server = RedisServer::start(None).await.expect("redis");
    let proxies = vec![proxy("a", 3, None), proxy("b", 3, None)];
    let stores = replicas(&server, 2, &proxies).await;
    let quota = |ttl| LeaseRequest {
        owner_quota: Some(2),
        ttl: Some(Duration::from_secs(ttl)),
        ..request("example.com", "t1")
    };
    let first = stores[0].lease(&quota(1), SystemTime::now()).await.expect("lease");
    stores[1].lease(&quota(600), SystemTime::now()).await.expect("lease");
    let over = stores[1].lease(&quota(600), SystemTime::now()).await;
    assert!(matches!(over, Err(LeaseError::QuotaExceeded { limit: 2, retry_at: Some(_) })), "{over:?}");
    // The one-second lease expires and frees its slot and the quota, at both replicas.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_eq!(stores[1].expire(SystemTime::now()).await.expect("expire"), 1);
    assert!(matches!(
        stores[0].renew(&first.id, "t1", None, SystemTime::now()).await,
        Err(LeaseError::UnknownLease(_))
    ));
    let third = stores[1].lease(&quota(600), SystemTime::now()).await.expect("room under the quota again");
    assert_eq!(stores[0].held_by("t1", SystemTime::now()).await.expect("held").len(), 2);
    // A proxy turning unhealthy in a replica's view revokes its leases for every replica.
    let mut sick = proxies.iter().find(|info| info.id == third.proxy).expect("known").clone();
    sick.healthy = false;
    stores[0].upsert_proxy(sick.clone()).await.expect("unhealthy");
    let revoked = stores[1].renew(&third.id, "t1", None, SystemTime::now()).await;
    assert!(matches!(revoked, Err(LeaseError::Revoked(_))), "{revoked:?}");
    // A lowered cap revokes the newest above it.
    let healthy = proxies.iter().find(|info| info.id != third.proxy).expect("the other").clone();
    for _ in active(&stores[0], std::slice::from_ref(&healthy)).await[0]..3 {
        stores[0]
            .lease(&LeaseRequest { proxy: Some(healthy.id.clone()), ..request("example.com", "t3") }, SystemTime::now())
            .await
            .expect("fill");
    }
    let full = stores[1]
        .lease(&LeaseRequest { proxy: Some(healthy.id.clone()), ..request("example.com", "t3") }, SystemTime::now())
        .await;
    assert!(matches!(full, Err(LeaseError::ProxyUnavailable { why: "it is at its lease cap", .. })), "{full:?}");
    stores[1].upsert_proxy(ProxyInfo { max_leases: 1, ..healthy.clone() }).await.expect("lower the cap");
    assert_eq!(active(&stores[0], std::slice::from_ref(&healthy)).await, vec![1]);
}

#[tokio::test]
async fn a_lost_server_answers_state_unavailable_and_is_used_again_once_back() {
    let mut server = RedisServer::start(Some("s3cret-pass")).await.expect("redis");
    let key = LeaseKey::from_bytes(&[9; 32]).expect("key");
    let refused = RedisLeaseState::connect(&RedisOptions::new(server.url()), LeaseConfig::default(), key.clone()).await;
    assert!(matches!(refused, Err(ConnectError::Unreachable { .. })), "no password: {refused:?}");
    let with_password = format!("redis://:s3cret-pass@{}/", server.address());
    assert!(!format!("{:?}", RedisOptions::new(with_password.clone())).contains("s3cret"));
    assert_eq!(redact(&with_password), format!("redis://:<redacted>@{}/", server.address()));
    let options = RedisOptions { password: Some("s3cret-pass".into()), ..RedisOptions::new(server.url()) };
    let store = RedisLeaseState::connect(&options, LeaseConfig::default(), key).await.expect("connect");
    store.upsert_proxy(proxy("a", 5, None)).await.expect("upsert");
    store.lease(&request("example.com", "t1"), SystemTime::now()).await.expect("lease");
    server.kill();
    let started = std::time::Instant::now();
    let down = store.lease(&request("example.com", "t1"), SystemTime::now()).await;
    assert!(matches!(down, Err(LeaseError::StateUnavailable(_))), "{down:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "answered within the timeout: {:?}", started.elapsed());
    server.restart().await.expect("restart");
    let back = std::time::Instant::now();
    loop {
        match store.lease(&request("example.com", "t1"), SystemTime::now()).await {
            Ok(_) => break,
            Err(LeaseError::StateUnavailable(_)) if back.elapsed() < Duration::from_secs(5) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(error) => panic!("not back within 5 s: {error}"),
        }
    }
    eprintln!("used again {:?} after the server returned", back.elapsed());
    let bad =
        RedisLeaseState::connect(&RedisOptions::new("http://x"), LeaseConfig::default(), LeaseKey::ephemeral()).await;
    assert!(matches!(bad, Err(ConnectError::InvalidUrl { .. })), "{bad:?}");
    let tag = RedisOptions { prefix: "a}b".into(), ..RedisOptions::new(server.url()) };
    let bad = RedisLeaseState::connect(&tag, LeaseConfig::default(), LeaseKey::ephemeral()).await;
    assert!(matches!(bad, Err(ConnectError::InvalidPrefix(_))), "{bad:?}");
}

#[tokio::test]
async fn a_fleet_larger_than_the_sample_is_leased_evenly_and_to_its_last_slot() {
    let server = RedisServer::start(None).await.expect("redis");
    // 40 proxies: the script looks at 16 at a time, in a random order.
    let proxies: Vec<ProxyInfo> = (0..40).map(|n| proxy(&format!("px-{n}"), 12, None)).collect();
    let stores = replicas(&server, 2, &proxies).await;
    for n in 0..400 {
        stores[n % 2].lease(&request("example.com", "t1"), SystemTime::now()).await.expect("lease");
    }
    let counts = active(&stores[0], &proxies).await;
    let (least, most) = (counts.iter().min().copied(), counts.iter().max().copied());
    assert!(least >= Some(9) && most <= Some(11), "400 leases over 40 proxies: {counts:?}");
    // The last 80 slots are found wherever they are, by both replicas.
    for n in 0..80 {
        stores[n % 2].lease(&request("example.com", "t1"), SystemTime::now()).await.expect("a slot is left");
    }
    assert_eq!(active(&stores[1], &proxies).await, vec![12; 40]);
    let full = stores[0].lease(&request("example.com", "t1"), SystemTime::now()).await;
    assert!(matches!(full, Err(LeaseError::AllAtCapacity { .. })), "{full:?}");
}

/// A TCP forwarder to `target` that, while `up` is false, accepts each connection and closes it at once (as a
/// Service, a sidecar or a load balancer in front of a store with no backend does) and has dropped the ones it was
/// carrying.
struct Forwarder {
    address: std::net::SocketAddr,
    up: Arc<std::sync::atomic::AtomicBool>,
    carried: Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    async fn start(target: std::net::SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind((target.ip(), 0)).await.expect("bind");
        let address = listener.local_addr().expect("address");
        let up = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let carried: Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>> = Arc::default();
        let (routing, tasks) = (up.clone(), carried.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !routing.load(std::sync::atomic::Ordering::SeqCst) {
                    continue;
                }
                tasks.lock().expect("tasks").push(tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                }));
            }
        });
        Self { address, up, carried, accept }
    }

    fn set_up(&self, up: bool) {
        self.up.store(up, std::sync::atomic::Ordering::SeqCst);
        if !up {
            for task in self.carried.lock().expect("tasks").drain(..) {
                task.abort();
            }
        }
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.accept.abort();
        self.set_up(false);
    }
}

/// Behind something that accepts connections and closes them while the store is away (a Service proxy, a sidecar, a
/// load balancer), a reconnection fails during the handshake rather than with a refused connection; the state is
/// still used again as soon as the store is back, without a restart.
#[tokio::test]
async fn behind_a_forwarder_that_closes_connections_while_the_store_is_away_the_state_is_used_again() {
    let server = RedisServer::start(Some("s3cret-pass")).await.expect("redis");
    let forwarder = Forwarder::start(server.address()).await;
    let options = RedisOptions {
        password: Some("s3cret-pass".into()),
        ..RedisOptions::new(format!("redis://{}/", forwarder.address))
    };
    let store =
        RedisLeaseState::connect(&options, LeaseConfig::default(), LeaseKey::ephemeral()).await.expect("connect");
    store.upsert_proxy(proxy("a", 1000, None)).await.expect("upsert");
    store.lease(&request("example.com", "t1"), SystemTime::now()).await.expect("lease");
    forwarder.set_up(false);
    for _ in 0..6 {
        let down = store.lease(&request("example.com", "t1"), SystemTime::now()).await;
        assert!(matches!(down, Err(LeaseError::StateUnavailable(_))), "{down:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    forwarder.set_up(true);
    let back = std::time::Instant::now();
    let took = egress_testenv::eventually("a lease within 5 s of the store's return", Duration::from_secs(5), || {
        let store = &store;
        async move { store.lease(&request("example.com", "t1"), SystemTime::now()).await.ok().map(|_| back.elapsed()) }
    })
    .await;
    eprintln!("used again {took:?} after the store returned");
}

/// Some proxies cooling down and the others at their cap: the refusal counts each, as in memory.
#[tokio::test]
async fn a_refusal_counts_the_proxies_cooling_down_and_those_at_their_cap() {
    let server = RedisServer::start(None).await.expect("redis");
    let proxies = vec![proxy("a", 1, None), proxy("b", 1, None)];
    let stores = replicas(&server, 2, &proxies).await;
    let now = SystemTime::now();
    let held = stores[0].lease(&request("other.org", "t1"), now).await.expect("lease");
    let free = if held.proxy.name() == "a" { "b" } else { "a" };
    let named = LeaseRequest { proxy: Some(ProxyId::new("crawl", free)), ..request("example.com", "t1") };
    let lease = stores[0].lease(&named, now).await.expect("lease");
    stores[0].report(&lease.id, "t1", &Report::of(Outcome::Banned).and_release(), now).await.expect("ban");
    let refused = stores[1].lease(&request("example.com", "t2"), SystemTime::now()).await.expect_err("none eligible");
    assert!(matches!(refused, LeaseError::AllCoolingDown { cooling: 1, at_capacity: 1, .. }), "{refused:?}: {refused}");
}

/// An owner ends one of its sessions, or all, at any replica: their leases (held at any replica) are released and
/// their proxies forgotten, an idle session's too (a proxy kept, no lease: found by its key). Other sessions, the
/// same name of another owner (whose name the first one's glob characters would match) and leases without a session
/// stay. As the in-memory store does (`an_owner_ends_its_sessions_by_name_or_all_at_once`).
#[tokio::test]
async fn an_owner_ends_its_sessions_at_any_replica_by_name_or_all_at_once() {
    let server = RedisServer::start(None).await.expect("redis");
    let proxies: Vec<ProxyInfo> = (0..2).map(|n| proxy(&format!("px-{n}"), 100, None)).collect();
    let stores = replicas(&server, 2, &proxies).await;
    let now = SystemTime::now;
    let session =
        |name: &str, owner: &str, target: &str| LeaseRequest { session: Some(name.into()), ..request(target, owner) };
    let owner = "team*";
    let s1 = [
        stores[0].lease(&session("s1", owner, "shop.example"), now()).await.expect("lease"),
        stores[1].lease(&session("s1", owner, "shop.example"), now()).await.expect("lease"),
        stores[0].lease(&session("s1", owner, "news.example"), now()).await.expect("lease"),
    ];
    let s2 = stores[1].lease(&session("s2", owner, "shop.example"), now()).await.expect("lease");
    // team-x's s1 is idle (its proxy kept, no lease): only its key says it is there.
    let foreign = stores[0].lease(&session("s1", "team-x", "shop.example"), now()).await.expect("lease");
    stores[0].release(&foreign.id, "team-x", now()).await.expect("release");
    let plain = stores[0].lease(&request("shop.example", owner), now()).await.expect("lease");
    let s3 = stores[1].lease(&session("s3", owner, "shop.example"), now()).await.expect("lease");
    stores[1].release(&s3.id, owner, now()).await.expect("release");

    let ended = stores[1].end_sessions(owner, Some("s1"), now()).await.expect("end s1");
    assert_eq!(ended, EndedSessions { sessions: 2, leases: 3 }, "s1 on both sites, three leases");
    for lease in &s1 {
        let renewed = stores[0].renew(&lease.id, owner, None, now()).await;
        assert!(matches!(renewed, Err(LeaseError::UnknownLease(_))), "released: {renewed:?}");
    }
    for lease in [&s2, &plain] {
        stores[0].renew(&lease.id, owner, None, now()).await.expect("left alone");
    }
    let ended = stores[0].end_sessions(owner, None, now()).await.expect("end all");
    assert_eq!(ended, EndedSessions { sessions: 2, leases: 1 }, "s2 with its lease, and the idle s3");
    assert!(matches!(stores[1].renew(&s2.id, owner, None, now()).await, Err(LeaseError::UnknownLease(_))));
    stores[1].renew(&plain.id, owner, None, now()).await.expect("a lease without a session stays");
    let again = stores[1].end_sessions(owner, None, now()).await.expect("end all again");
    assert_eq!(again, EndedSessions::default(), "nothing left to end");
    let theirs = stores[1].end_sessions("team-x", None, now()).await.expect("end team-x's");
    assert_eq!(theirs, EndedSessions { sessions: 1, leases: 0 }, "team-x's idle s1 was still there");
}
