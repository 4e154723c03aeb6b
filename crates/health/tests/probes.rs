//! The health engine against real Squid processes and a local origin over HTTP and HTTPS.

use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime};

use egress_health::{
    CurrentVerdict, EngineConfig, FailureReason, HealthEngine, HealthMetrics, ProbeUrl, ProxyCredentials, Target,
    Transition, Verdicts, probe, tls_connector,
};
use egress_testenv::pki::TestCa;
use egress_testenv::{LocalOrigin, Squid, SquidOptions, eventually};
use tokio::sync::mpsc::Receiver;
use tokio_rustls::TlsConnector;

const WAIT: Duration = Duration::from_secs(30);

fn target(id: &str, proxy: SocketAddr, url: &str, healthy_threshold: u32, unhealthy_threshold: u32) -> Target {
    Target {
        id: id.into(),
        proxy_host: proxy.ip().to_string(),
        proxy_port: proxy.port(),
        credentials: None,
        probe_url: ProbeUrl::parse(url).expect("valid probe URL"),
        interval: Duration::from_secs(1),
        timeout: Duration::from_millis(900),
        healthy_threshold,
        unhealthy_threshold,
    }
}

fn engine(extra_ca: &[u8]) -> (HealthEngine, Receiver<Transition>, HealthMetrics) {
    let metrics = HealthMetrics::default();
    let tls = tls_connector(extra_ca).expect("TLS setup");
    let (engine, transitions) = HealthEngine::start(EngineConfig::default(), tls, metrics.clone());
    (engine, transitions, metrics)
}

async fn next_transition(transitions: &mut Receiver<Transition>) -> Transition {
    tokio::time::timeout(WAIT, transitions.recv()).await.expect("a transition in time").expect("the engine runs")
}

async fn probe_once(
    proxy: SocketAddr,
    url: &str,
    credentials: Option<&ProxyCredentials>,
    timeout: Duration,
    tls: &TlsConnector,
) -> Result<(), FailureReason> {
    let url = ProbeUrl::parse(url).expect("valid probe URL");
    probe(&proxy.ip().to_string(), proxy.port(), credentials, &url, timeout, tls).await.map(|_| ())
}

#[tokio::test]
async fn a_working_proxy_becomes_healthy_after_the_threshold() {
    let squid = Squid::start(SquidOptions::default()).await.expect("squid");
    let origin = LocalOrigin::start().await.expect("origin");
    let (engine, mut transitions, metrics) = engine(b"");
    engine.upsert(target("a", squid.address(), &origin.url(), 3, 2));
    let transition = next_transition(&mut transitions).await;
    assert!(transition.healthy);
    assert_eq!(transition.id, "a");
    assert_eq!(metrics.probes_total(), 3, "healthy exactly after healthyThreshold successful probes");
    assert!(engine.verdict("a").is_some_and(|verdict| verdict.healthy));
}

#[tokio::test]
async fn a_killed_squid_becomes_unhealthy_after_the_threshold() {
    let mut squid = Squid::start(SquidOptions::default()).await.expect("squid");
    let origin = LocalOrigin::start().await.expect("origin");
    let (engine, mut transitions, metrics) = engine(b"");
    engine.upsert(target("a", squid.address(), &origin.url(), 1, 3));
    assert!(next_transition(&mut transitions).await.healthy);
    squid.kill();
    let before = metrics.probes_total();
    let transition = next_transition(&mut transitions).await;
    assert!(!transition.healthy);
    assert_eq!(transition.reason, Some(FailureReason::ConnectRefused));
    assert_eq!(metrics.probes_total() - before, 3, "unhealthy exactly after unhealthyThreshold failed probes");
}

#[tokio::test]
async fn a_single_failure_never_flips_the_verdict() {
    let squid = Squid::start(SquidOptions::default()).await.expect("squid");
    let origin = LocalOrigin::start().await.expect("origin");
    let (engine, mut transitions, metrics) = engine(b"");
    engine.upsert(target("a", squid.address(), &origin.url(), 1, 2));
    assert!(next_transition(&mut transitions).await.healthy);
    origin.fail_next(1);
    let before = metrics.probes_total();
    // Counted when the engine has applied each result, so any transition they caused has been sent.
    eventually("four more probes, one of them failed", WAIT, || async {
        (metrics.probes_total() >= before + 4).then_some(())
    })
    .await;
    assert_eq!(origin.requests(), metrics.probes_total(), "every probe reached the origin, the failed one included");
    assert!(transitions.try_recv().is_err(), "no transition: one failure between successes is not two in a row");
    assert!(engine.verdict("a").is_some_and(|verdict| verdict.healthy));
}

#[tokio::test]
async fn failure_reasons_are_told_apart() {
    let tls = tls_connector(b"").expect("TLS setup");
    let origin = LocalOrigin::start().await.expect("origin");
    let timeout = Duration::from_secs(2);

    let authenticated =
        Squid::start(SquidOptions { credentials: Some(("crawler".into(), "right".into())), ..SquidOptions::default() })
            .await
            .expect("squid with auth");
    let wrong = ProxyCredentials::new("crawler", "wrong");
    let right = ProxyCredentials::new("crawler", "right");
    assert_eq!(
        probe_once(authenticated.address(), &origin.url(), None, timeout, &tls).await,
        Err(FailureReason::ProxyAuthRequired)
    );
    assert_eq!(
        probe_once(authenticated.address(), &origin.url(), Some(&wrong), timeout, &tls).await,
        Err(FailureReason::ProxyAuthRequired)
    );
    assert_eq!(probe_once(authenticated.address(), &origin.url(), Some(&right), timeout, &tls).await, Ok(()));

    // A closed port: bind one, note it, close it.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("address");
    assert_eq!(probe_once(closed, &origin.url(), None, timeout, &tls).await, Err(FailureReason::ConnectRefused));

    // A listener that accepts and never answers: the probe ends at its timeout, not later.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let silent_address = silent.local_addr().expect("address");
    let _held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let started = Instant::now();
    assert_eq!(
        probe_once(silent_address, &origin.url(), None, Duration::from_secs(1), &tls).await,
        Err(FailureReason::Timeout)
    );
    assert!(started.elapsed() < Duration::from_millis(1500), "bounded by the timeout: {:?}", started.elapsed());

    let deny = Squid::start(SquidOptions { deny_connect: true, ..SquidOptions::default() })
        .await
        .expect("squid denying CONNECT");
    let ca = TestCa::new("probe-test-ca").expect("CA");
    let https_origin = LocalOrigin::start_tls(&ca).await.expect("https origin");
    assert_eq!(
        probe_once(deny.address(), &https_origin.url(), None, timeout, &tls).await,
        Err(FailureReason::ConnectStatus(403))
    );

    origin.fail_next(1);
    assert_eq!(
        probe_once(authenticated.address(), &origin.url(), Some(&right), timeout, &tls).await,
        Err(FailureReason::OriginStatus(503))
    );
}

#[tokio::test]
async fn https_probes_tunnel_through_connect_with_an_extra_ca() {
    let squid = Squid::start(SquidOptions::default()).await.expect("squid");
    let ca = TestCa::new("probe-test-ca").expect("CA");
    let origin = LocalOrigin::start_tls(&ca).await.expect("https origin");
    let trusting = tls_connector(ca.cert_pem().as_bytes()).expect("TLS setup with the test CA");
    let untrusting = tls_connector(b"").expect("TLS setup");
    let timeout = Duration::from_secs(3);
    assert_eq!(probe_once(squid.address(), &origin.url(), None, timeout, &trusting).await, Ok(()));
    assert!(matches!(
        probe_once(squid.address(), &origin.url(), None, timeout, &untrusting).await,
        Err(FailureReason::Tls(_))
    ));
    assert_eq!(origin.requests(), 1, "the untrusted handshake never reached the request");
}

#[tokio::test]
async fn an_ip_echo_origin_fills_the_egress_ip() {
    let squid = Squid::start(SquidOptions::default()).await.expect("squid");
    let origin = LocalOrigin::start().await.expect("origin");
    let (engine, mut transitions, _) = engine(b"");
    engine.upsert(target("echo", squid.address(), &origin.ip_url(), 1, 1));
    let transition = next_transition(&mut transitions).await;
    assert!(transition.healthy);
    // The test Squid reaches origins from its own address, which the origin echoes.
    assert_eq!(transition.egress_ip, Some(squid.address().ip()));
}

#[tokio::test]
async fn a_removed_target_is_not_probed_any_more() {
    let squid = Squid::start(SquidOptions::default()).await.expect("squid");
    let removed_origin = LocalOrigin::start().await.expect("origin");
    let witness_origin = LocalOrigin::start().await.expect("origin");
    let (engine, mut transitions, _) = engine(b"");
    engine.upsert(target("removed", squid.address(), &removed_origin.url(), 1, 1));
    engine.upsert(target("witness", squid.address(), &witness_origin.url(), 1, 1));
    next_transition(&mut transitions).await;
    next_transition(&mut transitions).await;
    engine.remove("removed");
    assert!(engine.verdict("removed").is_none(), "its verdict is forgotten");
    // A probe may have been in flight at the moment of removal; count from after it could have landed.
    let witness_before = witness_origin.requests();
    eventually("one witness probe", WAIT, || async { (witness_origin.requests() > witness_before).then_some(()) })
        .await;
    let removed_count = removed_origin.requests();
    let witness_now = witness_origin.requests();
    eventually("three more witness probes", WAIT, || async {
        (witness_origin.requests() >= witness_now + 3).then_some(())
    })
    .await;
    assert_eq!(removed_origin.requests(), removed_count, "no probe of the removed target while the witness got three");
}

#[tokio::test]
async fn a_changed_target_restarts_its_counters() {
    let squid = Squid::start(SquidOptions::default()).await.expect("squid");
    let origin = LocalOrigin::start().await.expect("origin");
    let (engine, mut transitions, _) = engine(b"");
    engine.upsert(target("a", squid.address(), &origin.url(), 1, 1));
    assert!(next_transition(&mut transitions).await.healthy);
    let mut changed = target("a", squid.address(), &origin.ip_url(), 2, 1);
    changed.timeout = Duration::from_millis(800);
    engine.upsert(changed);
    assert!(engine.verdict("a").is_none(), "a changed target starts unknown");
    assert!(next_transition(&mut transitions).await.healthy, "and becomes healthy again under its new settings");
}

#[tokio::test]
async fn a_new_target_is_probed_at_once_however_wide_the_first_probe_window() {
    let squid = Squid::start(SquidOptions::default()).await.expect("squid");
    let origin = LocalOrigin::start().await.expect("origin");
    let config = EngineConfig { first_probe_within: Some(Duration::from_secs(30)), ..EngineConfig::default() };
    let tls = tls_connector(b"").expect("TLS setup");
    let (engine, mut transitions) = HealthEngine::start(config, tls, HealthMetrics::default());
    let mut slow = target("new", squid.address(), &origin.url(), 1, 1);
    slow.interval = Duration::from_secs(60);
    let started = Instant::now();
    engine.upsert(slow);
    let transition = next_transition(&mut transitions).await;
    assert!(transition.healthy);
    // Its Proxy waits for this verdict to say Ready: no jitter for a target nothing is known about.
    assert!(started.elapsed() < Duration::from_secs(2), "first verdict after {:?}", started.elapsed());
}

fn seed(healthy: bool) -> CurrentVerdict {
    CurrentVerdict { healthy, since: SystemTime::UNIX_EPOCH, last_error: None, egress_ip: None }
}

#[tokio::test]
async fn a_seeded_verdict_stands_until_the_probes_overturn_it_and_seeds_only_a_new_target() {
    let squid = Squid::start(SquidOptions::default()).await.expect("squid");
    // Nothing listens there: Squid answers every probe with an error.
    let gone = "http://127.0.0.1:9/";
    let (engine, mut transitions, _) = engine(b"");
    engine.upsert_seeded(target("a", squid.address(), gone, 1, 2), || Some(seed(true)));
    let seeded = engine.verdict("a").expect("the seed is the verdict at once");
    assert!(seeded.healthy);
    assert_eq!(seeded.since, SystemTime::UNIX_EPOCH);
    engine
        .upsert_seeded(target("a", squid.address(), gone, 1, 2), || panic!("an unchanged target is not seeded again"));
    let transition = next_transition(&mut transitions).await;
    assert!(!transition.healthy, "two failed probes overturn the seed");
    assert!(engine.verdict("a").is_some_and(|verdict| !verdict.healthy && verdict.since > SystemTime::UNIX_EPOCH));
    // A changed target starts unknown: a seed is for a target new to the engine only.
    engine.upsert_seeded(target("a", squid.address(), gone, 1, 3), || panic!("a changed target is not seeded"));
    assert!(engine.verdict("a").is_none());
}

#[tokio::test]
async fn a_dropped_engine_forgets_its_verdicts_in_a_shared_store() {
    let squid = Squid::start(SquidOptions::default()).await.expect("squid");
    let origin = LocalOrigin::start().await.expect("origin");
    let shared: Verdicts<String> = Verdicts::new();
    let tls = tls_connector(b"").expect("TLS setup");
    let (engine, mut transitions) =
        HealthEngine::start_with(EngineConfig::default(), tls, HealthMetrics::default(), shared.clone());
    engine.upsert(target("probed", squid.address(), &origin.url(), 1, 1));
    engine.upsert_seeded(target("seeded", squid.address(), &origin.url(), 1, 1), || Some(seed(true)));
    assert!(next_transition(&mut transitions).await.healthy);
    eventually("both verdicts in the shared store", WAIT, || async { (shared.len() == 2).then_some(()) }).await;
    let mut changes = shared.subscribe();
    drop(engine);
    drop(transitions);
    eventually("the shared store emptied", WAIT, || async { shared.is_empty().then_some(()) }).await;
    let mut forgotten = vec![changes.recv().await.expect("a change"), changes.recv().await.expect("a change")];
    forgotten.sort();
    assert_eq!(forgotten, ["probed", "seeded"], "readers hear of every verdict that went");
}
