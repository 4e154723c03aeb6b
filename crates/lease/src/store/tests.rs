//! The lease store's rules, one test each, and the invariants under random (and concurrent) operations.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::*;
use crate::{CooldownPolicy, Pacing, PoolId, Selector, SessionLimits, TargetMode};

fn t(seconds: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + seconds)
}

/// Proxy `text` (`namespace/name`, or a name in namespace `test`).
fn p(text: &str) -> ProxyId {
    text.parse().unwrap_or_else(|_| ProxyId::new("test", text))
}

/// Pool `namespace/name`.
fn pool_id(text: &str) -> PoolId {
    text.parse().expect("namespace/name")
}

fn proxy(id: &str, max: u32) -> ProxyInfo {
    ProxyInfo {
        id: p(id),
        healthy: true,
        max_leases: max,
        labels: BTreeMap::new(),
        endpoint: format!("{id}:3128"),
        egress_ip: None,
        pool: None,
        zone: None,
        provider: None,
        cooldown: None,
        pacing: None,
    }
}

fn labelled(id: &str, region: &str) -> ProxyInfo {
    ProxyInfo { labels: [("region".to_owned(), region.to_owned())].into(), ..proxy(id, 5) }
}

fn request(target: &str) -> LeaseRequest {
    LeaseRequest { target: target.into(), ..LeaseRequest::default() }
}

fn store_with(proxies: &[ProxyInfo]) -> InMemoryLeaseStore {
    let store = InMemoryLeaseStore::new(LeaseConfig::default());
    for proxy in proxies {
        store.upsert_proxy(proxy.clone());
    }
    store
}

#[test]
fn least_loaded_wins_and_ties_go_to_the_least_recently_leased() {
    let store = store_with(&[proxy("a", 5), proxy("b", 5), proxy("c", 5)]);
    let first: Vec<ProxyId> =
        (0..3).map(|_| store.lease(&request("example.com"), t(0)).expect("lease").proxy).collect();
    let mut sorted = first.clone();
    sorted.sort();
    assert_eq!(sorted, [p("a"), p("b"), p("c")], "one each before any proxy gets a second");
    // All have one lease now; the least recently leased (the first one chosen) is next.
    assert_eq!(store.lease(&request("example.com"), t(0)).expect("lease").proxy, first[0]);
    store.check_invariants().expect("invariants");
}

#[test]
fn caps_and_drained_proxies_are_respected() {
    let store = store_with(&[proxy("a", 1), proxy("drained", 0)]);
    let lease = store.lease(&request("example.com"), t(0)).expect("lease");
    assert_eq!(lease.proxy, p("a"));
    let refused = store.lease(&request("example.com"), t(0)).expect_err("full");
    assert_eq!(refused, LeaseError::AllAtCapacity { retry_at: Some(lease.expires_at) });
    store.release(&lease.id, "", t(1)).expect("release");
    assert_eq!(store.lease(&request("example.com"), t(1)).expect("lease again").proxy, p("a"));
    let named = LeaseRequest { proxy: Some(p("drained")), ..request("example.com") };
    assert!(matches!(
        store.lease(&named, t(1)),
        Err(LeaseError::ProxyUnavailable { why: "it is drained (maxLeases 0)", .. })
    ));
}

#[test]
fn a_pool_request_is_given_members_only_and_refused_for_the_pool_alone() {
    let member = |id: &str, pool: &str| ProxyInfo { pool: Some(pool_id(pool)), ..proxy(id, 1) };
    let store = store_with(&[member("ns/eu-0", "ns/eu"), member("ns/us-0", "ns/us"), proxy("ns/loose", 5)]);
    let eu = LeaseRequest { pool: Some(pool_id("ns/eu")), ..request("example.com") };
    assert_eq!(store.lease(&eu, t(0)).expect("lease").proxy, p("ns/eu-0"));
    // The only member is at its cap: refused for the pool's capacity, though other proxies are free.
    assert!(matches!(store.lease(&eu, t(0)), Err(LeaseError::AllAtCapacity { .. })), "{:?}", store.lease(&eu, t(0)));
    let elsewhere = LeaseRequest { proxy: Some(p("ns/us-0")), ..eu.clone() };
    assert!(matches!(store.lease(&elsewhere, t(0)), Err(LeaseError::ProxyUnavailable { .. })));
    let empty = LeaseRequest { pool: Some(pool_id("ns/none")), ..request("example.com") };
    assert_eq!(store.lease(&empty, t(0)), Err(LeaseError::NoneHealthy));
    // Without a pool, members are proxies like any other.
    assert_eq!(store.lease(&request("example.com"), t(0)).expect("lease").proxy, p("ns/loose"));
}

#[test]
fn selectors_and_named_proxies() {
    let store = store_with(&[labelled("eu-1", "eu"), labelled("us-1", "us")]);
    let eu = LeaseRequest { selector: Selector::parse("region=eu").expect("selector"), ..request("example.com") };
    for _ in 0..3 {
        assert_eq!(store.lease(&eu, t(0)).expect("lease").proxy, p("eu-1"));
    }
    let named = LeaseRequest { proxy: Some(p("us-1")), ..request("example.com") };
    assert_eq!(store.lease(&named, t(0)).expect("lease").proxy, p("us-1"));
    let missing = LeaseRequest { proxy: Some(p("nope")), ..request("example.com") };
    assert_eq!(store.lease(&missing, t(0)), Err(LeaseError::UnknownProxy(p("nope"))));
    let none = LeaseRequest { selector: Selector::parse("region=ap").expect("selector"), ..request("example.com") };
    assert_eq!(store.lease(&none, t(0)), Err(LeaseError::NoneHealthy));
}

#[test]
fn sticky_sessions_keep_their_proxy_while_it_is_eligible() {
    let store = store_with(&[proxy("a", 5), proxy("b", 5)]);
    let session = LeaseRequest { session: Some("crawl-42".into()), ..request("shop.example.com") };
    let first = store.lease(&session, t(0)).expect("lease").proxy;
    for _ in 0..3 {
        assert_eq!(store.lease(&session, t(0)).expect("lease").proxy, first, "same session, same target");
    }
    store.upsert_proxy(ProxyInfo { healthy: false, ..proxy(first.name(), 5) });
    let moved = store.lease(&session, t(1)).expect("lease").proxy;
    assert_ne!(moved, first, "an unhealthy proxy is not sticky");
}

#[test]
fn a_session_moves_to_another_proxy_after_its_lifetime_or_its_leases() {
    let store = store_with(&[proxy("a", 5), proxy("b", 5), proxy("c", 5)]);
    let limits = |age: Option<u64>, leases: Option<u32>| SessionLimits {
        max_age: age.map(Duration::from_secs),
        max_leases: leases,
    };
    // At most 3 leases on one proxy: the 4th goes elsewhere, and counts start over there.
    let by_leases = LeaseRequest {
        session: Some("by-leases".into()),
        session_limits: limits(None, Some(3)),
        ..request("shop.example.com")
    };
    let proxies: Vec<ProxyId> = (0..9).map(|_| store.lease(&by_leases, t(0)).expect("lease").proxy).collect();
    for (n, chunk) in proxies.chunks(3).enumerate() {
        assert!(chunk.iter().all(|proxy| *proxy == chunk[0]), "leases {n}: three on one proxy: {proxies:?}");
    }
    assert_ne!(proxies[2], proxies[3], "the 4th lease moved: {proxies:?}");
    assert_ne!(proxies[5], proxies[6], "so did the 7th: {proxies:?}");
    // At most 60 s on one proxy, from the lease that chose it; leases meanwhile do not extend it.
    let by_age = LeaseRequest {
        session: Some("by-age".into()),
        session_limits: limits(Some(60), None),
        ..request("shop.example.com")
    };
    let lease = store.lease(&by_age, t(0)).expect("lease");
    assert_eq!(lease.session_until, Some(t(60)), "the lease says when the session moves on");
    let first = lease.proxy;
    let again = store.lease(&by_age, t(30)).expect("lease");
    assert_eq!((&again.proxy, again.session_until), (&first, Some(t(60))), "from the lease that chose it");
    assert_eq!(store.lease(&by_age, t(59)).expect("lease").proxy, first);
    let second = store.lease(&by_age, t(60)).expect("lease").proxy;
    assert_ne!(second, first, "moved at 60 s");
    assert_eq!(store.lease(&by_age, t(119)).expect("lease").proxy, second, "a new 60 s from the move");
    assert_ne!(store.lease(&by_age, t(120)).expect("lease").proxy, second);
    // Without limits the same session keeps its proxy, however many leases or however long.
    let unlimited = LeaseRequest { session_limits: SessionLimits::default(), ..by_age.clone() };
    let kept = store.lease(&unlimited, t(500)).expect("lease").proxy;
    assert_eq!(store.lease(&unlimited, t(5000)).expect("lease").proxy, kept);
    // With only one proxy it can take, a lapsed session stays there, and its lifetime starts over.
    let single = store_with(&[proxy("only", 5)]);
    let once = LeaseRequest { session: Some("s".into()), session_limits: limits(None, Some(1)), ..request("x.org") };
    for n in 0..3 {
        assert_eq!(single.lease(&once, t(n)).expect("stays").proxy, p("only"));
    }
    store.check_invariants().expect("invariants");
}

#[test]
fn a_paced_address_is_leased_for_a_site_once_per_interval_and_the_refusal_says_when_next() {
    let paced = Pacing { interval: Duration::from_secs(2), burst: 1 };
    let via = |id: &str, ip: &str| ProxyInfo { egress_ip: Some(ip.into()), pacing: Some(paced), ..proxy(id, 5) };
    // Two proxies through one address share its pace; a third has an address of its own.
    let store = store_with(&[via("a1", "192.0.2.1"), via("a2", "192.0.2.1"), via("b", "192.0.2.2")]);
    let first = store.lease(&request("shop.example"), t(0)).expect("lease").proxy;
    let second = store.lease(&request("shop.example"), t(0)).expect("lease").proxy;
    assert_eq!(
        [&first, &second].iter().filter(|proxy| ***proxy == p("b")).count(),
        1,
        "one per address: {first} {second}"
    );
    let refused = store.lease(&request("shop.example"), t(1)).expect_err("both addresses paced");
    assert_eq!(refused, LeaseError::Paced { until: t(2), proxy: None });
    // Another site is paced on its own; so is an unpaced proxy's use.
    store.lease(&request("other.example"), t(1)).expect("another site");
    assert!(store.lease(&request("shop.example"), t(2)).is_ok(), "a slot frees after 2 s");
    // A session waits for its own proxy's slot rather than move.
    let session = LeaseRequest { session: Some("s".into()), ..request("news.example") };
    let own = store.lease(&session, t(10)).expect("lease").proxy;
    assert!(
        matches!(store.lease(&session, t(11)), Err(LeaseError::Paced { until, proxy: Some(proxy) }) if until == t(12) && proxy == own)
    );
    assert_eq!(store.lease(&session, t(12)).expect("its slot").proxy, own);
    // Named: refused with its slot.
    let named = LeaseRequest { proxy: Some(p("b")), ..request("named.example") };
    store.lease(&named, t(20)).expect("lease");
    assert_eq!(store.lease(&named, t(21)), Err(LeaseError::Paced { until: t(22), proxy: Some(p("b")) }));
    // A burst of 3: three at once, then one per interval.
    let bursty = store_with(&[ProxyInfo { pacing: Some(Pacing { burst: 3, ..paced }), ..proxy("c", 10) }]);
    for _ in 0..3 {
        bursty.lease(&request("x.example"), t(0)).expect("within the burst");
    }
    assert_eq!(bursty.lease(&request("x.example"), t(0)), Err(LeaseError::Paced { until: t(2), proxy: None }));
    bursty.lease(&request("x.example"), t(2)).expect("the next slot");
    // Paces are forgotten once past.
    store.expire(t(100));
    bursty.expire(t(100));
    assert_eq!((store.lock().paces.len(), bursty.lock().pace_expiries.len()), (0, 0), "paces kept past their time");
}

/// Every gateway replica a session's requests reach holds a lease of its own for it: they share one slot, so a
/// proxy at its cap still takes the session's next lease, and the slot is free again only when the last one ends.
#[test]
fn a_sessions_leases_for_one_site_share_one_slot_of_the_cap() {
    let store = store_with(&[proxy("a", 1), proxy("b", 1)]);
    let session = LeaseRequest { session: Some("crawl-7".into()), owner: "team".into(), ..request("shop.example") };
    let first = store.lease(&session, t(0)).expect("lease");
    let second = store.lease(&session, t(0)).expect("the session's second lease shares its slot");
    assert_eq!(second.proxy, first.proxy, "the session's proxy, though it is at its cap");
    let named = LeaseRequest { proxy: Some(first.proxy.clone()), ..session.clone() };
    let third = store.lease(&named, t(0)).expect("named, the session's slot admits it too");
    let loads = store.loads(None, t(0)).expect("loads");
    let load = loads.iter().find(|load| load.id == first.proxy).expect("known");
    assert_eq!((load.active_leases, store.active_leases()), (1, 3), "one slot, three leases");
    // Another session, another site of this one, and a lease without a session each take a slot of their own.
    let other = LeaseRequest { session: Some("crawl-8".into()), ..session.clone() };
    let elsewhere = LeaseRequest { target: "news.example".into(), ..session.clone() };
    let taken = store.lease(&other, t(0)).expect("the other proxy").proxy;
    assert_ne!(taken, first.proxy);
    assert!(matches!(store.lease(&elsewhere, t(0)), Err(LeaseError::AllAtCapacity { .. })));
    assert!(matches!(store.lease(&request("shop.example"), t(0)), Err(LeaseError::AllAtCapacity { .. })));
    let foreign = LeaseRequest { owner: "other-team".into(), ..session.clone() };
    assert!(matches!(store.lease(&foreign, t(0)), Err(LeaseError::AllAtCapacity { .. })), "owners' sessions differ");
    store.check_invariants().expect("invariants");
    // The slot is held until the last of the session's leases ends.
    store.release(&first.id, "team", t(1)).expect("release");
    store.release(&third.id, "team", t(1)).expect("release");
    assert!(matches!(store.lease(&request("shop.example"), t(1)), Err(LeaseError::AllAtCapacity { .. })));
    store.release(&second.id, "team", t(1)).expect("release");
    assert_eq!(store.lease(&request("shop.example"), t(1)).expect("the slot is free").proxy, first.proxy);
    store.check_invariants().expect("invariants");
}

/// An owner ends one of its sessions, or all of them: their leases are released and their proxies forgotten,
/// idle sessions (a proxy kept, no lease) included; other sessions, other owners' sessions of the same name and
/// leases without a session stay.
#[test]
fn an_owner_ends_its_sessions_by_name_or_all_at_once() {
    let store = store_with(&[proxy("a", 5), proxy("b", 5)]);
    let session = |name: &str, owner: &str, target: &str| LeaseRequest {
        session: Some(name.into()),
        owner: owner.into(),
        ..request(target)
    };
    let s1 = [
        store.lease(&session("s1", "team", "shop.example"), t(0)).expect("lease"),
        store.lease(&session("s1", "team", "shop.example"), t(0)).expect("lease"),
    ];
    let s1_news = store.lease(&session("s1", "team", "news.example"), t(0)).expect("lease");
    let s2 = store.lease(&session("s2", "team", "shop.example"), t(0)).expect("lease");
    let foreign = store.lease(&session("s1", "other", "shop.example"), t(0)).expect("lease");
    let plain = store.lease(&LeaseRequest { owner: "team".into(), ..request("shop.example") }, t(0)).expect("lease");
    // s3 is idle: its lease went back, its proxy is kept.
    let s3 = store.lease(&session("s3", "team", "shop.example"), t(0)).expect("lease");
    store.release(&s3.id, "team", t(0)).expect("release");
    assert_eq!(store.sizes().2, 5, "five sessions know their proxy");

    let ended = store.end_sessions("team", Some("s1"), t(1));
    assert_eq!(ended, EndedSessions { sessions: 2, leases: 3 }, "s1 on both sites, three leases");
    for lease in s1.iter().chain([&s1_news]) {
        assert!(matches!(store.renew(&lease.id, "team", None, t(1)), Err(LeaseError::UnknownLease(_))), "released");
    }
    for (lease, owner) in [(&s2, "team"), (&foreign, "other"), (&plain, "team")] {
        store.renew(&lease.id, owner, None, t(1)).expect("left alone");
    }
    assert_eq!(store.sizes().2, 3, "s2, s3 and the other owner's s1 keep their proxies");
    store.check_invariants().expect("invariants");

    let ended = store.end_sessions("team", None, t(2));
    assert_eq!(ended, EndedSessions { sessions: 2, leases: 1 }, "s2 with its lease, and the idle s3");
    assert!(matches!(store.renew(&s2.id, "team", None, t(2)), Err(LeaseError::UnknownLease(_))));
    store.renew(&plain.id, "team", None, t(2)).expect("a lease without a session stays");
    store.renew(&foreign.id, "other", None, t(2)).expect("another owner's session stays");
    assert_eq!(store.sizes().2, 1, "only the other owner's session is left");
    assert_eq!(store.end_sessions("team", None, t(3)), EndedSessions::default(), "nothing left to end");
    store.check_invariants().expect("invariants");
}

/// A lowered cap revokes the newest slots until they fit it: a session's leases go together.
#[test]
fn a_lowered_cap_counts_a_sessions_leases_once() {
    let store = store_with(&[proxy("a", 3)]);
    let session = LeaseRequest { session: Some("s".into()), ..request("shop.example") };
    let shared: Vec<Lease> = (0..2).map(|_| store.lease(&session, t(0)).expect("lease")).collect();
    let alone = store.lease(&request("shop.example"), t(0)).expect("lease");
    store.upsert_proxy(proxy("a", 1));
    assert!(matches!(store.renew(&alone.id, "", None, t(1)), Err(LeaseError::Revoked(_))), "the newest slot goes");
    for lease in &shared {
        store.renew(&lease.id, "", None, t(1)).expect("the session's slot fits the cap");
    }
    store.check_invariants().expect("invariants");
}

/// A session's first proxy does not depend on the store's history: a fresh store (a new leader) with the same
/// proxies gives it the same one, whatever the loads; and sessions spread over the proxies.
#[test]
fn a_sessions_first_proxy_is_the_same_in_every_store() {
    let proxies: Vec<ProxyInfo> = ["a", "b", "c", "d"].into_iter().map(|name| proxy(name, 100)).collect();
    let first = store_with(&proxies);
    let second = store_with(&proxies);
    // Loads that differ between the two stores.
    for index in 0..7 {
        second.lease(&request(&format!("other-{index}.example")), t(0)).expect("lease");
    }
    let mut spread: BTreeMap<ProxyId, usize> = BTreeMap::new();
    for index in 0..200 {
        let session = LeaseRequest { session: Some(format!("s{index}")), ..request("shop.example.com") };
        let chosen = first.lease(&session, t(0)).expect("lease").proxy;
        assert_eq!(second.lease(&session, t(0)).expect("lease").proxy, chosen, "session s{index}");
        *spread.entry(chosen).or_default() += 1;
    }
    assert_eq!(spread.len(), 4, "{spread:?}");
    assert!(spread.values().all(|count| (25..=75).contains(count)), "an even spread: {spread:?}");
    // Another owner's session of the same name is its own.
    let theirs = LeaseRequest { session: Some("s0".into()), owner: "team-b".into(), ..request("shop.example.com") };
    let mine = LeaseRequest { session: Some("s0".into()), ..request("shop.example.com") };
    let owners_differ = (0..20).any(|index| {
        let theirs = LeaseRequest { session: Some(format!("s{index}")), ..theirs.clone() };
        let mine = LeaseRequest { session: Some(format!("s{index}")), ..mine.clone() };
        first.lease(&theirs, t(0)).expect("lease").proxy != first.lease(&mine, t(0)).expect("lease").proxy
    });
    assert!(owners_differ, "owners' sessions are hashed apart");
}

#[test]
fn ttl_renew_and_expiry() {
    let store = store_with(&[proxy("a", 1)]);
    let lease = store
        .lease(&LeaseRequest { ttl: Some(Duration::from_secs(60)), ..request("example.com") }, t(0))
        .expect("lease");
    assert_eq!(lease.expires_at, t(60));
    let renewed = store.renew(&lease.id, "", Some(Duration::from_secs(120)), t(50)).expect("renew").lease;
    assert_eq!(renewed.expires_at, t(170));
    assert_eq!(store.expire(t(169)), 0);
    assert_eq!(store.expire(t(170)), 1);
    assert_eq!(store.renew(&renewed.id, "", None, t(171)), Err(LeaseError::UnknownLease(renewed.id.clone())));
    assert_eq!(
        store.release(&lease.id, "", t(171)),
        Err(LeaseError::UnknownLease(lease.id.clone())),
        "freed once only"
    );
    // TTLs are clamped to the maximum.
    let long = store
        .lease(&LeaseRequest { ttl: Some(Duration::from_secs(99_999)), ..request("example.com") }, t(200))
        .expect("lease");
    assert_eq!(long.expires_at, t(200 + 3600));
    store.check_invariants().expect("invariants");
}

#[test]
fn bans_cool_down_one_proxy_for_one_site_with_a_growing_streak() {
    let store = store_with(&[proxy("a", 5), proxy("b", 5)]);
    let on_a = LeaseRequest { proxy: Some(p("a")), ..request("www.shop.example.co.uk") };
    let lease = store.lease(&on_a, t(0)).expect("lease");
    assert_eq!(lease.target, "example.co.uk");
    assert_eq!(
        store.report(&lease.id, "", &Report::of(Outcome::Banned).and_release(), t(0)).map(|r| r.cooldown_until),
        Ok(Some(t(600)))
    );
    // The same site (any subdomain) avoids "a"; another site does not.
    for _ in 0..4 {
        assert_eq!(store.lease(&request("img.shop.example.co.uk"), t(1)).expect("lease").proxy, p("b"));
    }
    assert!(matches!(
        store.lease(&LeaseRequest { proxy: Some(p("a")), ..request("example.co.uk") }, t(1)),
        Err(LeaseError::ProxyCoolingDown { .. })
    ));
    assert_eq!(
        store.lease(&LeaseRequest { proxy: Some(p("a")), ..request("other.org") }, t(1)).expect("other site").proxy,
        p("a")
    );

    // A second ban in a row doubles the cooldown; a third doubles again; the cap holds.
    let again = store.lease(&on_a, t(600)).expect("after the cooldown");
    assert_eq!(
        store.report(&again.id, "", &Report::of(Outcome::Banned).and_release(), t(600)).map(|r| r.cooldown_until),
        Ok(Some(t(600 + 1200)))
    );
    let third = store.lease(&on_a, t(1800)).expect("after the second cooldown");
    assert_eq!(
        store.report(&third.id, "", &Report::of(Outcome::Banned).and_release(), t(1800)).map(|r| r.cooldown_until),
        Ok(Some(t(1800 + 2400)))
    );
    // An ok report resets the streak.
    let fourth = store.lease(&on_a, t(4200)).expect("after the third cooldown");
    store.report(&fourth.id, "", &Report::of(Outcome::Ok), t(4200)).expect("ok");
    assert_eq!(
        store.report(&fourth.id, "", &Report::of(Outcome::Banned).and_release(), t(4200)).map(|r| r.cooldown_until),
        Ok(Some(t(4200 + 600)))
    );
    store.check_invariants().expect("invariants");
}

/// The cooldowns of `proxy`'s bans in a row, each reported when the one before ended.
fn ban_cooldowns(store: &InMemoryLeaseStore, proxy: &str, bans: usize) -> (Vec<u64>, SystemTime) {
    let mut now = t(0);
    let mut cooldowns = Vec::new();
    for _ in 0..bans {
        let request = LeaseRequest { proxy: Some(p(proxy)), ..request("example.com") };
        let lease = store.lease(&request, now).expect("lease");
        let until = store
            .report(&lease.id, "", &Report::of(Outcome::Banned).and_release(), now)
            .expect("report")
            .cooldown_until
            .expect("until");
        cooldowns.push(until.duration_since(now).expect("future").as_secs());
        now = until;
    }
    (cooldowns, now)
}

#[test]
fn cooldown_cap_and_memory_bound() {
    let policy = CooldownPolicy { base: Duration::from_secs(100), factor: 2, max: Duration::from_secs(250) };
    let store = InMemoryLeaseStore::new(LeaseConfig { cooldown: policy, ..LeaseConfig::default() });
    store.upsert_proxy(proxy("a", 5));
    let (cooldowns, now) = ban_cooldowns(&store, "a", 4);
    assert_eq!(cooldowns, [100, 200, 250, 250]);
    assert_eq!(store.sizes().1, 1);
    store.expire(now + Duration::from_secs(10_000));
    assert_eq!(store.sizes(), (0, 0, 0, 0, 0), "nothing outlives its usefulness");
}

#[test]
fn a_proxy_with_a_cooldown_policy_of_its_own_follows_it() {
    let store = InMemoryLeaseStore::new(LeaseConfig::default());
    let short = CooldownPolicy { base: Duration::from_secs(30), factor: 3, max: Duration::from_secs(300) };
    let flat = CooldownPolicy { base: Duration::from_secs(45), factor: 1, max: Duration::from_secs(45) };
    store.upsert_proxy(ProxyInfo { cooldown: Some(short), ..proxy("short", 5) });
    store.upsert_proxy(ProxyInfo { cooldown: Some(flat), ..proxy("flat", 5) });
    store.upsert_proxy(proxy("default", 5));
    assert_eq!(ban_cooldowns(&store, "short", 4).0, [30, 90, 270, 300]);
    assert_eq!(ban_cooldowns(&store, "flat", 3).0, [45, 45, 45]);
    assert_eq!(ban_cooldowns(&store, "default", 3).0, [600, 1200, 2400], "the store's: 10 minutes, doubling");
    // A huge streak neither overflows nor passes the maximum.
    assert_eq!(short.after(u32::MAX), Duration::from_secs(300));
    assert_eq!(LeaseConfig::default().cooldown.after(40), Duration::from_secs(86_400));
    store.check_invariants().expect("invariants");
}

#[test]
fn unhealthy_or_removed_proxies_have_their_leases_revoked() {
    let store = store_with(&[proxy("a", 5), proxy("b", 5)]);
    let on_a = store.lease(&LeaseRequest { proxy: Some(p("a")), ..request("example.com") }, t(0)).expect("lease");
    let on_b = store.lease(&LeaseRequest { proxy: Some(p("b")), ..request("example.com") }, t(0)).expect("lease");
    store.upsert_proxy(ProxyInfo { healthy: false, ..proxy("a", 5) });
    store.remove_proxy(&p("b"));
    assert_eq!(store.renew(&on_a.id, "", None, t(1)), Err(LeaseError::Revoked(on_a.id.clone())));
    assert_eq!(store.renew(&on_b.id, "", None, t(1)), Err(LeaseError::Revoked(on_b.id.clone())));
    // A ban reported on a revoked lease still counts.
    assert!(store.report(&on_a.id, "", &Report::of(Outcome::Banned), t(1)).expect("report").cooldown_until.is_some());
    store.release(&on_a.id, "", t(1)).expect("releasing a revoked lease is accepted");
    store.check_invariants().expect("invariants");
    assert_eq!(store.lease(&request("example.com"), t(2)), Err(LeaseError::NoneHealthy));
}

#[test]
fn refusal_reasons() {
    let store = store_with(&[proxy("a", 1)]);
    let lease = store.lease(&request("example.com"), t(0)).expect("lease");
    store.report(&lease.id, "", &Report::of(Outcome::Banned).and_release(), t(0)).expect("ban");
    let cooling = LeaseError::AllCoolingDown { until: t(600), cooling: 1, at_capacity: 0 };
    assert_eq!(store.lease(&request("example.com"), t(1)), Err(cooling));
    assert!(matches!(store.lease(&request("not a host"), t(1)), Err(LeaseError::InvalidTarget(_))));
}

/// Some proxies cooling down and the others at their cap: the refusal says how many of each (regression: it said
/// every matching proxy was cooling down when 8 of them were only at their cap).
#[test]
fn a_refusal_says_how_many_proxies_cool_down_and_how_many_are_at_their_cap() {
    let store = store_with(&[proxy("a", 1), proxy("b", 1), proxy("c", 1)]);
    let held = store.lease(&request("other.example"), t(0)).expect("lease");
    let _also = store.lease(&request("other.example"), t(0)).expect("lease");
    let free = ["a", "b", "c"]
        .into_iter()
        .map(p)
        .find(|id| store.loads(None, t(0)).expect("loads").iter().any(|l| &l.id == id && l.active_leases == 0))
        .expect("one proxy with room");
    let named = LeaseRequest { proxy: Some(free), ..request("example.com") };
    let lease = store.lease(&named, t(0)).expect("lease");
    store.report(&lease.id, "", &Report::of(Outcome::Banned).and_release(), t(0)).expect("ban");
    let refused = store.lease(&request("example.com"), t(1)).expect_err("nothing eligible");
    assert_eq!(refused, LeaseError::AllCoolingDown { until: t(600), cooling: 1, at_capacity: 2 });
    assert_eq!(refused.to_string(), "1 matching proxy is cooling down for this target and 2 are at their lease cap");
    drop(held);
    store.check_invariants().expect("invariants");
}

#[test]
fn exact_host_mode_separates_subdomains() {
    let store = InMemoryLeaseStore::new(LeaseConfig { target_mode: TargetMode::ExactHost, ..LeaseConfig::default() });
    store.upsert_proxy(proxy("a", 5));
    let lease = store.lease(&request("www.example.com"), t(0)).expect("lease");
    store.report(&lease.id, "", &Report::of(Outcome::Banned).and_release(), t(0)).expect("ban");
    assert!(store.lease(&request("img.example.com"), t(1)).is_ok());
}

fn keyed(key: &LeaseKey, proxies: &[ProxyInfo]) -> InMemoryLeaseStore {
    let store = InMemoryLeaseStore::with_key(LeaseConfig::default(), key.clone());
    for proxy in proxies {
        store.upsert_proxy(proxy.clone());
    }
    store
}

#[test]
fn ended_leases_kept_elsewhere_are_refused_by_a_store_that_never_saw_them() {
    let key = LeaseKey::from_bytes(&[7; 32]).expect("key");
    let old = keyed(&key, &[proxy("a", 5)]);
    let owner = "token-a";
    let ask = || LeaseRequest { owner: owner.into(), ..request("example.com") };
    let leases: Vec<Lease> = (0..4).map(|_| old.lease(&ask(), t(0)).expect("lease")).collect();
    let generation = old.ended_generation();
    old.release(&leases[0].id, owner, t(1)).expect("release");
    old.release(&leases[1].id, owner, t(1)).expect("release");
    assert_ne!(old.ended_generation(), generation, "a release changes what is kept");
    // A lowered cap revokes the newest lease.
    old.upsert_proxy(proxy("a", 1));
    let (_, kept) = old.ended_leases(100, t(2));
    assert_eq!(kept.len(), 3, "{kept:?}");
    assert_eq!(kept.iter().filter(|record| record.released).count(), 2);
    assert_eq!(old.ended_leases(1, t(2)).1.len(), 1, "at most the limit");

    let new = keyed(&key, &[proxy("a", 5)]);
    assert_eq!(new.restore_ended(&kept, t(3)), 3);
    assert_eq!(new.restore_ended(&kept, t(3)), 0, "restoring twice takes nothing more");
    for released in &leases[..2] {
        let refused = new.renew(&released.id, owner, None, t(4));
        assert_eq!(refused, Err(LeaseError::UnknownLease(released.id.clone())), "a released lease stays gone");
    }
    assert_eq!(new.renew(&leases[3].id, owner, None, t(4)), Err(LeaseError::Revoked(leases[3].id.clone())));
    // The lease still held is adopted as before, and a late report on a released one counts against its proxy.
    new.renew(&leases[2].id, owner, None, t(4)).expect("held: adopted");
    assert_eq!(new.active_leases(), 1);
    let report = Report { outcome: Some(Outcome::Ok), ..Report::default() };
    assert_eq!(new.report(&leases[0].id, owner, &report, t(5)).expect("late report").proxy, p("a"));
    new.check_invariants().expect("invariants");
    // Nothing is restored past its expiry.
    assert_eq!(keyed(&key, &[proxy("a", 5)]).restore_ended(&kept, leases[0].expires_at), 0);
}

#[test]
fn a_store_with_the_same_key_adopts_leases_it_never_saw() {
    let key = LeaseKey::from_bytes(&[9; 32]).expect("key");
    let old = keyed(&key, &[proxy("a", 5)]);
    let owner = "token-a";
    let lease = old.lease(&LeaseRequest { owner: owner.into(), ..request("example.com") }, t(0)).expect("lease");
    let new = keyed(&key, &[proxy("a", 5)]);

    // Renewing on the new store adopts it: same proxy and target, counted against the cap, the expiry extended.
    let renewed = new.renew(&lease.id, owner, Some(Duration::from_secs(600)), t(10)).expect("adopted");
    assert_eq!((renewed.lease.proxy.name(), renewed.lease.target.as_str()), ("a", "example.com"));
    assert_eq!(renewed.lease.expires_at, t(610));
    assert_eq!(new.adopted(), 1);
    assert_eq!(new.active_leases(), 1);
    // Every ID of the lease names it; showing it again adopts nothing more.
    new.renew(&lease.id, owner, None, t(11)).expect("the first ID still names it");
    assert_eq!((new.adopted(), new.active_leases()), (1, 1));
    new.check_invariants().expect("invariants");

    // Only its owner can use it, and only with the key: anything else is a lease that does not exist.
    for (id, who, store) in
        [(&lease.id, "token-b", &new), (&lease.id, "", &new), (&lease.id, owner, &store_with(&[proxy("a", 5)]))]
    {
        assert_eq!(store.renew(id, who, None, t(12)), Err(LeaseError::UnknownLease(id.clone())));
        assert_eq!(store.release(id, who, t(12)), Err(LeaseError::UnknownLease(id.clone())));
        assert!(matches!(store.report(id, who, &Report::of(Outcome::Banned), t(12)), Err(LeaseError::UnknownLease(_))));
    }
    // An expired ID is not adopted.
    let short = old
        .lease(&LeaseRequest { owner: owner.into(), ttl: Some(Duration::from_secs(5)), ..request("example.com") }, t(0))
        .expect("lease");
    assert_eq!(new.renew(&short.id, owner, None, t(6)), Err(LeaseError::UnknownLease(short.id.clone())));

    // A ban reported on a lease the store never saw counts; releasing one frees nothing and is accepted.
    let third = old.lease(&LeaseRequest { owner: owner.into(), ..request("example.org") }, t(0)).expect("lease");
    let reported =
        new.report(&third.id, owner, &Report::of(Outcome::Banned).and_release(), t(20)).expect("adopted report");
    assert_eq!(
        reported,
        Reported { proxy: p("a"), target: "example.org".into(), cooldown_until: Some(t(620)), cooled: vec![p("a")] }
    );
    let fourth = old.lease(&LeaseRequest { owner: owner.into(), ..request("example.net") }, t(0)).expect("lease");
    new.release(&fourth.id, owner, t(20)).expect("release of an unseen lease");
    assert_eq!(new.active_leases(), 1);
    new.check_invariants().expect("invariants");

    // A lease whose proxy is gone or unhealthy on the new store is revoked, not unknown.
    let fifth = old.lease(&LeaseRequest { owner: owner.into(), ..request("example.io") }, t(0)).expect("lease");
    new.upsert_proxy(ProxyInfo { healthy: false, ..proxy("a", 5) });
    assert_eq!(new.renew(&fifth.id, owner, None, t(21)), Err(LeaseError::Revoked(fifth.id.clone())));
}

#[test]
fn a_lease_is_taken_over_only_while_its_proxy_has_room() {
    let key = LeaseKey::from_bytes(&[3; 32]).expect("key");
    let old = keyed(&key, &[proxy("a", 1)]);
    let held = old.lease(&request("example.com"), t(0)).expect("held before the takeover");
    let new = keyed(&key, &[proxy("a", 1)]);
    let fresh = new.lease(&request("example.com"), t(1)).expect("granted by the new store");
    let refused = new.renew(&held.id, "", None, t(2));
    assert!(matches!(refused, Err(LeaseError::NotAdopted(_))), "the proxy is full here: {refused:?}");
    let loads = new.loads(None, t(2)).expect("loads");
    assert_eq!((loads[0].active_leases, loads[0].max_leases), (1, 1), "never above the cap");
    new.check_invariants().expect("invariants");
    new.release(&fresh.id, "", t(3)).expect("release");
    new.renew(&held.id, "", None, t(3)).expect("with room, the held lease is taken over");
    assert!(matches!(new.lease(&request("example.com"), t(3)), Err(LeaseError::AllAtCapacity { .. })));
    new.check_invariants().expect("invariants");
}

#[test]
fn live_leases_kept_elsewhere_count_against_the_cap_before_their_holders_show_them() {
    let key = LeaseKey::from_bytes(&[4; 32]).expect("key");
    let old = keyed(&key, &[proxy("a", 2), proxy("b", 1)]);
    let generation = old.live_generation();
    let on_a = old.lease(&LeaseRequest { owner: "t1".into(), ..request("example.com") }, t(0)).expect("lease");
    let on_b = old.lease(&LeaseRequest { owner: "t2".into(), ..request("example.org") }, t(0)).expect("lease");
    assert_ne!(old.live_generation(), generation, "a grant changes the generation");
    let renewed = old.renew(&on_a.id, "t1", Some(Duration::from_secs(90)), t(10)).expect("renew").lease;
    let released = old.lease(&request("example.net"), t(10)).expect("lease");
    old.release(&released.id, "", t(11)).expect("release");
    let (_, records) = old.live_leases(10, t(11));
    assert_eq!(
        records.iter().map(|r| (r.proxy.as_str(), r.owner.as_str(), r.until)).collect::<Vec<_>>(),
        [("test/b", "t2", on_b.expires_at), ("test/a", "t1", t(100))],
        "the live ones, latest expiry first, with the renewed expiry"
    );
    assert_eq!(old.live_leases(1, t(11)).1.len(), 1, "at most the limit");

    // The next leader takes them in before serving: b is full, a has one slot left, each holder renews.
    let new = keyed(&key, &[proxy("a", 2), proxy("b", 1)]);
    assert_eq!(new.restore_live(&records, t(12)), 2);
    assert_eq!(new.restore_live(&records, t(12)), 0, "known ones are left as they are");
    assert_eq!(new.leases_by_owner(), [("t1".to_owned(), 1), ("t2".to_owned(), 1)].into());
    for _ in 0..2 {
        let lease = new.lease(&request("example.com"), t(13)).expect("a's last slot");
        assert_eq!(lease.proxy, p("a"));
        new.release(&lease.id, "", t(13)).expect("release");
    }
    let one = new.lease(&request("example.com"), t(13)).expect("a's last slot");
    assert!(matches!(new.lease(&request("example.com"), t(13)), Err(LeaseError::AllAtCapacity { .. })));
    new.renew(&renewed.id, "t1", None, t(14)).expect("the restored lease renews");
    // Its target comes from the ID: a ban reported on it cools its proxy down for that site.
    let report = Report::of(Outcome::Banned);
    assert!(new.report(&renewed.id, "t1", &report, t(14)).expect("ban").cooldown_until.is_some());
    assert_eq!(new.cooldowns(Some("example.com"), t(14)).expect("cooldowns").len(), 1);
    new.renew(&on_b.id, "t2", None, t(14)).expect("the restored lease renews");
    assert_eq!(new.adopted(), 0, "restored, not adopted when shown");
    new.check_invariants().expect("invariants");
    new.release(&one.id, "", t(15)).expect("release");

    // Expired records, records of ended leases and records beyond a cap are left out.
    let other = keyed(&key, &[proxy("a", 1), proxy("b", 1)]);
    other.release(&on_b.id, "t2", t(12)).expect("b's lease released here first");
    assert_eq!(other.restore_live(&records, t(12)), 1, "the ended one is not restored");
    let beyond = LiveLeaseRecord { serial: records[1].serial + 1000, ..records[1].clone() };
    assert_eq!(other.restore_live(&[beyond], t(12)), 0, "a is full");
    assert_eq!(keyed(&key, &[proxy("a", 2), proxy("b", 1)]).restore_live(&records, t(400)), 0, "expired");
    other.check_invariants().expect("invariants");

    // A lease shown beats one only on record (it may have been released in the old leader's last second): it takes
    // the slot, and the one on record, shown later, is taken over only if there is room then.
    let full = keyed(&key, &[proxy("a", 1), proxy("b", 1)]);
    let on_record = records.iter().find(|record| record.proxy == p("b")).expect("b's record");
    assert_eq!(full.restore_live(std::slice::from_ref(on_record), t(12)), 1);
    let unknown = keyed(&key, &[proxy("b", 2)])
        .lease(&LeaseRequest { owner: "t3".into(), ..request("example.org") }, t(12))
        .expect("a lease the record does not hold");
    full.renew(&unknown.id, "t3", None, t(13)).expect("shown: it takes the unconfirmed lease's slot");
    let refused = full.renew(&on_b.id, "t2", None, t(13));
    assert!(matches!(refused, Err(LeaseError::NotAdopted(_))), "no room left: {refused:?}");
    assert_eq!(full.leases_by_owner(), [("t3".to_owned(), 1)].into());
    full.check_invariants().expect("invariants");
}

/// A session's leases (one per gateway replica) share one slot; the next leader's record keeps it, so after a
/// change of leader they still count once, and the session's next lease still fits its proxy at its cap.
#[test]
fn a_sessions_shared_slot_survives_a_change_of_leader() {
    let key = LeaseKey::from_bytes(&[5; 32]).expect("key");
    let old = keyed(&key, &[proxy("a", 2)]);
    let session = LeaseRequest { session: Some("crawl-7".into()), owner: "team".into(), ..request("shop.example") };
    let (first, second) = (old.lease(&session, t(0)).expect("lease"), old.lease(&session, t(0)).expect("shared"));
    let other = old.lease(&LeaseRequest { owner: "team".into(), ..request("news.example") }, t(0)).expect("lease");
    let (_, records) = old.live_leases(10, t(1));
    assert_eq!(records.iter().filter(|record| record.slot.is_some()).count(), 2, "the session's two: {records:?}");

    let new = keyed(&key, &[proxy("a", 2)]);
    assert_eq!(new.restore_live(&records, t(2)), 3, "all three fit the cap of two: the session's share a slot");
    new.check_invariants().expect("invariants");
    assert_eq!(new.loads(None, t(2)).expect("loads")[0].active_leases, 2);
    let third = new.lease(&session, t(3)).expect("the session's next lease shares its slot at the cap");
    assert!(matches!(new.lease(&request("shop.example"), t(3)), Err(LeaseError::AllAtCapacity { .. })));
    for (lease, owner) in [(&first, "team"), (&second, "team"), (&other, "team")] {
        new.renew(&lease.id, owner, None, t(4)).expect("each restored lease renews");
    }
    new.check_invariants().expect("invariants");

    // A lease shown at a full proxy takes the room of a slot only unconfirmed leases hold, all of them at once.
    let full = keyed(&key, &[proxy("a", 2)]);
    assert_eq!(full.restore_live(&records, t(2)), 3);
    let stranger = keyed(&key, &[proxy("a", 2)])
        .lease(&LeaseRequest { owner: "team".into(), ..request("third.example") }, t(2))
        .expect("a lease the record does not hold");
    full.renew(&stranger.id, "team", None, t(3)).expect("shown: it takes a slot of unconfirmed leases");
    full.check_invariants().expect("invariants, no proxy above its cap");
    assert_eq!(full.loads(None, t(3)).expect("loads")[0].active_leases, 2);
    drop(third);
}

#[test]
fn cooldowns_read_per_proxy_restore_into_another_store() {
    let old = store_with(&[proxy("a", 5), proxy("b", 5)]);
    for (target, at) in [("example.com", 0), ("example.org", 5)] {
        let lease = old.lease(&LeaseRequest { proxy: Some(p("a")), ..request(target) }, t(at)).expect("lease");
        old.report(&lease.id, "", &Report::of(Outcome::Banned).and_release(), t(at)).expect("ban");
    }
    let saved = old.proxy_cooldowns(&p("a"), t(10));
    assert_eq!(
        saved.iter().map(|c| (c.target.as_str(), c.until, c.streak)).collect::<Vec<_>>(),
        [("example.org", t(605), 1), ("example.com", t(600), 1)]
    );
    assert!(old.proxy_cooldowns(&p("b"), t(10)).is_empty());

    let new = store_with(&[proxy("a", 5), proxy("b", 5)]);
    assert_eq!(new.restore_cooldowns(&saved, t(10)), 2);
    for _ in 0..3 {
        assert_eq!(new.lease(&request("example.com"), t(11)).expect("lease").proxy, p("b"), "a is cooling down");
    }
    // The streak survives: the next ban in a row doubles.
    let on_a = new.lease(&LeaseRequest { proxy: Some(p("a")), ..request("example.com") }, t(600)).expect("lease");
    let reported = new.report(&on_a.id, "", &Report::of(Outcome::Banned).and_release(), t(600)).expect("ban");
    assert_eq!(reported.cooldown_until, Some(t(600 + 1200)));
    // An older record never rolls back what the store knows; ended and forgotten ones are not taken.
    assert_eq!(new.restore_cooldowns(&saved, t(601)), 0);
    assert_eq!(new.proxy_cooldowns(&p("a"), t(601))[0].until, t(1800));
    assert_eq!(store_with(&[proxy("a", 5)]).restore_cooldowns(&saved, t(100_000)), 0);
    new.check_invariants().expect("invariants");
}

#[test]
fn a_renew_after_a_replacement_moves_the_lease_to_the_new_endpoint() {
    let store = store_with(&[proxy("a", 5)]);
    let lease = store.lease(&request("example.com"), t(0)).expect("lease");
    assert_eq!(lease.endpoint, "a:3128");
    store.upsert_proxy(ProxyInfo { endpoint: "a-new:3128".into(), ..proxy("a", 5) });
    assert_eq!(store.leases_on(&p("a"), "a:3128", t(1)), 1, "the old instance still has its holder");
    let renewed = store.renew(&lease.id, "", None, t(1)).expect("renew");
    assert_eq!(renewed.moved_from.as_deref(), Some("a:3128"));
    assert_eq!(renewed.lease.endpoint, "a-new:3128");
    assert_eq!(store.leases_on(&p("a"), "a:3128", t(1)), 0, "drained");
    assert_eq!(store.leases_on(&p("a"), "a-new:3128", t(1)), 1);
    assert_eq!(store.renew(&lease.id, "", None, t(2)).expect("renew").moved_from, None, "told once");
}

#[test]
fn a_throttle_cools_down_for_the_sites_retry_after_and_leaves_the_streak_alone() {
    let store = store_with(&[proxy("a", 5), proxy("b", 5)]);
    let on_a = LeaseRequest { proxy: Some(p("a")), ..request("shop.example.com") };
    let lease = store.lease(&on_a, t(0)).expect("lease");
    let throttled = Report::of(Outcome::Throttled { retry_after: Some(Duration::from_secs(30)) });
    assert_eq!(store.report(&lease.id, "", &throttled, t(0)).expect("throttle").cooldown_until, Some(t(30)));
    assert_eq!(store.lease(&request("shop.example.com"), t(1)).expect("lease").proxy, p("b"), "a is throttled");
    assert!(matches!(store.lease(&on_a, t(10)), Err(LeaseError::ProxyCoolingDown { until, .. }) if until == t(30)));
    // Back after the site's Retry-After, and the next ban is still the first in a row.
    let again = store.lease(&on_a, t(30)).expect("back after Retry-After");
    let banned = store.report(&again.id, "", &Report::of(Outcome::Banned), t(30)).expect("ban");
    assert_eq!(banned.cooldown_until, Some(t(630)), "a throttle is not a ban");
    // A throttle never shortens a running cooldown; without Retry-After it takes the default, capped by config.
    let shorter = store.report(&again.id, "", &Report::of(Outcome::Throttled { retry_after: None }), t(40)).expect("t");
    assert_eq!(shorter.cooldown_until, Some(t(630)));
    let lease = store.lease(&LeaseRequest { proxy: Some(p("b")), ..request("other.org") }, t(0)).expect("lease");
    let long = Report::of(Outcome::Throttled { retry_after: Some(Duration::from_secs(86_400)) });
    assert_eq!(store.report(&lease.id, "", &long, t(0)).expect("t").cooldown_until, Some(t(3600)), "capped");
    let streak = store.proxy_cooldowns(&p("a"), t(50)).into_iter().find(|c| c.target == "example.com").expect("kept");
    assert_eq!(streak.streak, 1);
    store.check_invariants().expect("invariants");
}

#[test]
fn counts_in_reports_feed_the_success_rate_per_proxy_and_site() {
    let store = store_with(&[proxy("a", 5)]);
    let lease = store.lease(&request("shop.example.com"), t(0)).expect("lease");
    let batch = Report { ok: 40, failed: 2, ..Report::default() };
    store.report(&lease.id, "", &batch, t(1)).expect("counts");
    store.report(&lease.id, "", &Report::of(Outcome::Throttled { retry_after: None }), t(2)).expect("throttle");
    store.report(&lease.id, "", &Report { ok: 5, ..Report::of(Outcome::Banned) }, t(3)).expect("ok then a ban");
    let load = |target: &str| store.loads(Some(target), t(4)).expect("loads").remove(0).outcomes;
    let counted = load("www.example.com").expect("counted");
    assert_eq!(counted, Outcomes { ok: 45, failed: 2, banned: 1, throttled: 1 });
    assert_eq!(counted.success_rate(), Some(45.0 / 49.0));
    assert_eq!(load("other.org"), None, "per site");
    // A ban in the same report as served requests is the first in a row.
    assert_eq!(store.proxy_cooldowns(&p("a"), t(4))[0].streak, 1);
    // Forgotten an hour after the last report, like everything else.
    store.expire(t(3 + 3600));
    assert_eq!(store.sizes().4, 0);
}

#[test]
fn proxies_leaving_through_one_address_share_their_cooldowns() {
    let via = |id: &str, ip: Option<&str>| ProxyInfo { egress_ip: ip.map(Into::into), ..proxy(id, 5) };
    let store =
        store_with(&[via("a", Some("198.51.100.7")), via("b", Some("198.51.100.7")), via("c", Some("198.51.100.8"))]);
    let on_a = LeaseRequest { proxy: Some(p("a")), ..request("shop.example.com") };
    let lease = store.lease(&on_a, t(0)).expect("lease");
    let reported = store.report(&lease.id, "", &Report::of(Outcome::Banned), t(0)).expect("ban");
    assert_eq!(reported.cooled, [p("a"), p("b")], "the site banned the address, so both proxies behind it");
    for _ in 0..4 {
        assert_eq!(store.lease(&request("shop.example.com"), t(1)).expect("lease").proxy, p("c"));
    }
    assert!(matches!(
        store.lease(&LeaseRequest { proxy: Some(p("b")), ..request("example.com") }, t(1)),
        Err(LeaseError::ProxyCoolingDown { until, .. }) if until == t(600)
    ));
    assert!(store.lease(&LeaseRequest { proxy: Some(p("b")), ..request("other.org") }, t(1)).is_ok(), "that site only");
    // An address that changes moves the proxy out of the group; a removed proxy leaves it.
    store.upsert_proxy(via("b", Some("198.51.100.9")));
    store.remove_proxy(&p("c"));
    let lease = store.lease(&LeaseRequest { proxy: Some(p("a")), ..request("news.example.net") }, t(2)).expect("lease");
    assert_eq!(store.report(&lease.id, "", &Report::of(Outcome::Banned), t(2)).expect("ban").cooled, [p("a")]);
    store.check_invariants().expect("invariants");
}

#[test]
fn one_owner_reporting_again_and_again_never_lengthens_a_cooldown() {
    let store = store_with(&[proxy("a", 5), proxy("b", 5)]);
    let on_a = LeaseRequest { proxy: Some(p("a")), owner: "tenant-a".into(), ..request("example.com") };
    let lease = store.lease(&on_a, t(0)).expect("lease");
    let first = store.report(&lease.id, "tenant-a", &Report::of(Outcome::Banned), t(0)).expect("ban");
    assert_eq!((first.cooldown_until, first.cooled.len()), (Some(t(600)), 1));
    // Twenty more bans from the same owner, on this lease and on others, while it runs: nothing changes, nothing
    // needs writing.
    for second in 1..=20 {
        let again = store.report(&lease.id, "tenant-a", &Report::of(Outcome::Banned), t(second)).expect("ban");
        assert_eq!((again.cooldown_until, again.cooled.len()), (Some(t(600)), 0), "ban {second}");
        let throttled = Report::of(Outcome::Throttled { retry_after: Some(Duration::from_secs(3600)) });
        let again = store.report(&lease.id, "tenant-a", &throttled, t(second)).expect("throttle");
        assert_eq!(again.cooldown_until, Some(t(600)), "a throttle from the same owner does not lengthen it");
    }
    store
        .lease(&LeaseRequest { proxy: Some(p("a")), owner: "tenant-a".into(), ..request("other.org") }, t(30))
        .expect("another site leases a");
    assert_eq!(store.proxy_cooldowns(&p("a"), t(30))[0].streak, 1);
    assert_eq!(store.cooldowns(Some("example.com"), t(30)).expect("cooldowns")[0].until, t(600));
    // Another owner's ban on another site is its own.
    let theirs = LeaseRequest { owner: "tenant-b".into(), ..on_a.clone() };
    let lease_b =
        store.lease(&LeaseRequest { proxy: None, ..theirs.clone() }, t(40)).expect("b leases the other proxy");
    assert_eq!(lease_b.proxy, p("b"));
    let b_on_a = store.lease(&LeaseRequest { target: "example.net".into(), ..theirs }, t(40)).expect("b on a");
    let banned_by_b = store.report(&b_on_a.id, "tenant-b", &Report::of(Outcome::Banned), t(40)).expect("ban");
    assert_eq!(banned_by_b.cooldown_until, Some(t(640)), "example.net is a site of its own");
    // Once the cooldown ended, the next ban is the next in a row.
    let after = store.lease(&on_a, t(600)).expect("after the cooldown");
    let next = store.report(&after.id, "tenant-a", &Report::of(Outcome::Banned), t(600)).expect("ban");
    assert_eq!(next.cooldown_until, Some(t(600 + 1200)));
    store.check_invariants().expect("invariants");
}

#[test]
fn a_second_owners_ban_counts_once_while_the_first_cooldown_runs() {
    let store = store_with(&[proxy("a", 5)]);
    let lease_for = |owner: &str| {
        store.lease(&LeaseRequest { owner: owner.into(), ..request("example.com") }, t(0)).expect("lease").id
    };
    let (a, b) = (lease_for("tenant-a"), lease_for("tenant-b"));
    store.report(&a, "tenant-a", &Report::of(Outcome::Banned), t(0)).expect("ban");
    let by_b = store.report(&b, "tenant-b", &Report::of(Outcome::Banned), t(100)).expect("ban");
    assert_eq!((by_b.cooldown_until, by_b.cooled.len()), (Some(t(100 + 1200)), 1));
    for _ in 0..5 {
        let again = store.report(&b, "tenant-b", &Report::of(Outcome::Banned), t(200)).expect("ban");
        assert_eq!((again.cooldown_until, again.cooled.len()), (Some(t(1300)), 0));
    }
    assert_eq!(store.proxy_cooldowns(&p("a"), t(200))[0].streak, 2);
}

#[test]
fn one_lease_counts_at_most_what_it_could_have_sent() {
    let store = store_with(&[proxy("a", 5)]);
    let lease = store.lease(&request("example.com"), t(0)).expect("lease");
    store.report(&lease.id, "", &Report { ok: 1_000_000, ..Report::default() }, t(0)).expect("counts");
    store.report(&lease.id, "", &Report::of(Outcome::Banned), t(0)).expect("a ban always counts");
    let counted = store.loads(Some("example.com"), t(0)).expect("loads")[0].outcomes.expect("counted");
    assert_eq!(counted, Outcomes { ok: 100, banned: 1, ..Outcomes::default() }, "the burst, then the ban");
    // Ten seconds later, ten seconds' worth more (at 100 a second), less what the ban used.
    store.report(&lease.id, "", &Report { ok: 1_000_000, failed: 5, ..Report::default() }, t(10)).expect("counts");
    let counted = store.loads(Some("example.com"), t(10)).expect("loads")[0].outcomes.expect("counted");
    assert_eq!((counted.ok, counted.failed), (100 + 999, 0));
    assert!(counted.success_rate().expect("a rate") < 0.9991, "one lease cannot drown a ban in successes");
}

#[test]
fn released_leases_never_come_back_and_never_pass_the_cap() {
    let key = LeaseKey::from_bytes(&[5; 32]).expect("key");
    let store = keyed(&key, &[proxy("a", 5)]);
    let ids: Vec<String> = (0..15)
        .map(|index| {
            let lease = store.lease(&request("example.com"), t(index / 5)).expect("lease");
            store.release(&lease.id, "", t(index / 5)).expect("release");
            lease.id
        })
        .collect();
    for id in &ids {
        assert_eq!(store.renew(id, "", None, t(10)), Err(LeaseError::UnknownLease(id.clone())));
        store.release(id, "", t(10)).expect("a second release is accepted");
        // A late report still counts against the proxy it was on, and does not bring the lease back.
        let reported = store.report(id, "", &Report { ok: 1, ..Report::default() }, t(10)).expect("late report");
        assert_eq!(reported.proxy, p("a"));
    }
    assert_eq!(store.active_leases(), 0);
    assert_eq!(store.adopted(), 0);
    // A lease the store never saw, released here, is not adopted afterwards either.
    let other = keyed(&key, &[proxy("a", 5)]);
    let unseen = other.lease(&request("example.org"), t(0)).expect("lease");
    store.release(&unseen.id, "", t(11)).expect("release of an unseen lease");
    assert_eq!(store.renew(&unseen.id, "", None, t(12)), Err(LeaseError::UnknownLease(unseen.id.clone())));
    // A revoked lease that its holder released stays gone when its proxy comes back.
    let revoked = store.lease(&request("example.net"), t(13)).expect("lease");
    store.upsert_proxy(ProxyInfo { healthy: false, ..proxy("a", 5) });
    store.release(&revoked.id, "", t(14)).expect("release");
    store.upsert_proxy(proxy("a", 5));
    assert_eq!(store.renew(&revoked.id, "", None, t(15)), Err(LeaseError::UnknownLease(revoked.id.clone())));
    assert_eq!(store.active_leases(), 0);
    // Remembered only until the lease would have expired.
    store.expire(t(15 + 3600 + 1));
    assert_eq!(store.sizes().3, 0);
    store.check_invariants().expect("invariants");
}

#[test]
fn an_administrator_clears_a_cooldown_and_an_older_record_does_not_bring_it_back() {
    let via = |id: &str, ip: &str| ProxyInfo { egress_ip: Some(ip.into()), ..proxy(id, 5) };
    let store = store_with(&[via("a", "198.51.100.7"), via("b", "198.51.100.7"), via("c", "198.51.100.8")]);
    for (proxy, target) in [("a", "example.com"), ("c", "example.com"), ("c", "example.org")] {
        let lease = store.lease(&LeaseRequest { proxy: Some(p(proxy)), ..request(target) }, t(0)).expect("lease");
        store.report(&lease.id, "", &Report::of(Outcome::Banned).and_release(), t(0)).expect("ban");
    }
    let kept = store.proxy_cooldowns(&p("a"), t(1));
    // Clearing a's cooldown clears the proxy sharing its address too, and nothing else.
    let cleared = store.clear_cooldowns("www.example.com", Some(&p("a")), t(1)).expect("clear");
    assert_eq!(cleared.iter().map(|c| c.proxy.name()).collect::<Vec<_>>(), ["a", "b"]);
    store.lease(&LeaseRequest { proxy: Some(p("a")), ..request("example.com") }, t(1)).expect("a leases at once");
    assert_eq!(store.cooldowns(None, t(1)).expect("cooldowns").len(), 2, "c's two remain");
    assert_eq!(store.restore_cooldowns(&kept, t(2)), 0, "the journal's older record is not restored");
    // The streak is forgotten: the next ban is a first one.
    let lease = store.lease(&LeaseRequest { proxy: Some(p("a")), ..request("example.com") }, t(3)).expect("lease");
    let again = store.report(&lease.id, "", &Report::of(Outcome::Banned).and_release(), t(3)).expect("ban");
    assert_eq!(again.cooldown_until, Some(t(603)));
    // Without a proxy: every proxy's cooldown for the site.
    let cleared = store.clear_cooldowns("example.com", None, t(4)).expect("clear");
    assert_eq!(cleared.iter().map(|c| c.proxy.name()).collect::<Vec<_>>(), ["a", "b", "c"]);
    assert_eq!(store.cooldowns(None, t(4)).expect("cooldowns").len(), 1, "example.org stays");
    assert!(store.clear_cooldowns("javascript:alert(1)", None, t(4)).is_err());
    store.check_invariants().expect("invariants");
}

/// Reproducible random operation sequences: a seeded `fastrand` generator.
struct Rng(fastrand::Rng);

impl Rng {
    fn seeded(seed: u64) -> Self {
        Self(fastrand::Rng::with_seed(seed))
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0.u64(..n)
    }
}

/// One random operation. With `alone` (no other thread touches the store), also checks from outside that the
/// leased proxy was not cooling down for the target; `check_invariants` checks the same from inside in every case.
fn random_step(
    store: &InMemoryLeaseStore,
    rng: &mut Rng,
    leases: &mut Vec<String>,
    now: SystemTime,
    seed: u64,
    alone: bool,
) {
    let targets = ["a.example.com", "b.example.org", "c.example.net"];
    let proxy_id = format!("p{}", rng.below(8));
    match rng.below(8) {
        0 | 1 => {
            let target = targets[rng.below(3) as usize];
            let mut request = request(target);
            if rng.below(4) == 0 {
                request.proxy = Some(p(&proxy_id));
            }
            if rng.below(2) == 0 {
                request.session = Some(format!("s{}", rng.below(3)));
            }
            request.ttl = Some(Duration::from_secs(1 + rng.below(30)));
            if let Ok(lease) = store.lease(&request, now) {
                if !alone {
                    leases.push(lease.id);
                    return;
                }
                let loads = store.loads(Some(target), now).expect("loads");
                let load = loads.iter().find(|load| load.id == lease.proxy).expect("the leased proxy is known");
                assert!(
                    load.cooling_down_until.is_none(),
                    "seed {seed}: leased {} while cooling down for {target}",
                    lease.proxy
                );
                leases.push(lease.id);
            }
        }
        2 if !leases.is_empty() => {
            let id = leases.swap_remove(rng.below(leases.len() as u64) as usize);
            let _ = store.release(&id, "", now);
            // Released means gone: no ID of it renews or is adopted again. (Only alone: threads run on clocks of
            // their own, and one far ahead forgets a tombstone another's lease would still need.)
            if alone {
                assert!(store.renew(&id, "", None, now).is_err(), "seed {seed}: a released lease renewed");
            }
        }
        3 if !leases.is_empty() => {
            let id = &leases[rng.below(leases.len() as u64) as usize];
            let _ = store.renew(id, "", Some(Duration::from_secs(1 + rng.below(30))), now);
        }
        4 if !leases.is_empty() => {
            let id = leases[rng.below(leases.len() as u64) as usize].clone();
            let outcome = [
                Outcome::Ok,
                Outcome::Banned,
                Outcome::Failed,
                Outcome::Throttled { retry_after: Some(Duration::from_secs(1 + rng.below(20))) },
            ][rng.below(4) as usize];
            let _ = store.report(&id, "", &Report { release: rng.below(2) == 0, ..Report::of(outcome) }, now);
        }
        5 => {
            store.upsert_proxy(ProxyInfo { healthy: rng.below(3) != 0, ..proxy(&proxy_id, 1 + rng.below(4) as u32) });
        }
        6 if rng.below(4) == 0 => store.remove_proxy(&p(&proxy_id)),
        6 if rng.below(3) == 0 => {
            let proxy = (rng.below(2) == 0).then(|| p(&proxy_id));
            store.clear_cooldowns(targets[rng.below(3) as usize], proxy.as_ref(), now).expect("a valid target");
        }
        _ => {
            store.expire(now);
        }
    }
}

/// 5 s, doubling, at most a day: cooldowns that end within a random run.
fn short_cooldowns() -> CooldownPolicy {
    CooldownPolicy { base: Duration::from_secs(5), ..LeaseConfig::default().cooldown }
}

#[test]
fn invariants_hold_under_random_operations() {
    for seed in 1..=20_u64 {
        let store = InMemoryLeaseStore::new(LeaseConfig { cooldown: short_cooldowns(), ..LeaseConfig::default() });
        let mut rng = Rng::seeded(seed);
        let mut leases = Vec::new();
        for step in 0..2_000_u64 {
            random_step(&store, &mut rng, &mut leases, t(step / 10), seed, true);
            if let Err(violation) = store.check_invariants() {
                panic!("seed {seed}, step {step}: {violation}");
            }
        }
    }
}

#[test]
fn invariants_hold_under_concurrent_operations() {
    let store =
        Arc::new(InMemoryLeaseStore::new(LeaseConfig { cooldown: short_cooldowns(), ..LeaseConfig::default() }));
    for index in 0..8 {
        store.upsert_proxy(proxy(&format!("p{index}"), 2));
    }
    let threads: Vec<_> = (1..=4_u64)
        .map(|seed| {
            let store = store.clone();
            std::thread::spawn(move || {
                let mut rng = Rng::seeded(seed ^ 0x2545_f491_4f6c_dd1d);
                let mut leases = Vec::new();
                for step in 0..3_000_u64 {
                    random_step(&store, &mut rng, &mut leases, t(step / 10), seed, false);
                    if let Err(violation) = store.check_invariants() {
                        panic!("thread {seed}, step {step}: {violation}");
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("no thread saw a violation");
    }
}
