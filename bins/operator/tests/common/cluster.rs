//! Helpers of the in-cluster binaries (`e2e`, `e2e_shared`): pods, the gateway, crawlers' loads, and the checks both
//! installations (the leader's memory, the shared state store) must pass alike.
#![allow(dead_code)] // Not every binary that includes this module uses every helper.

use std::time::{Duration, Instant};

use egress_api::{Proxy, ProxyPhase};
use egress_client::{DiscoveryClient, LeaseOptions};
use egress_testenv::eventually_every;
use egress_testenv::install::{Installation, SHIPPED_LEASE_TOKEN};
use egress_testenv::site::{SITE_PAGES, Visit, through_cooling, unexplained_moves};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use kube::{Client, ResourceExt};

/// How long a step waits for the cluster.
pub const WAIT: Duration = Duration::from_secs(120);

/// Whether the pod is Ready.
pub fn ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|status| status.conditions.as_ref())
        .is_some_and(|conditions| conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The pod's address.
pub fn pod_ip(pod: &Pod) -> String {
    pod.status.as_ref().and_then(|status| status.pod_ip.clone()).expect("a pod IP")
}

/// Whether the operator's leader labelled this pod as its own.
pub fn is_leader(pod: &Pod) -> bool {
    pod.labels().get(egress_runtime::role_label::ROLE_LABEL).map(String::as_str) == Some("leader")
}

/// What the rollout's crawlers saw: when each lease was granted, and every failed call.
#[derive(Default)]
pub struct Grants {
    pub at: std::sync::Mutex<Vec<Instant>>,
    pub failures: std::sync::Mutex<Vec<String>>,
}

/// One crawler: every 200 ms, lease a proxy for one of 20 sites and release it, through the Service.
pub async fn lease_every_200ms(
    index: usize,
    discovery: DiscoveryClient,
    grants: std::sync::Arc<Grants>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    let mut pace = tokio::time::interval(Duration::from_millis(200));
    pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut round = index;
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        pace.tick().await;
        round += 1;
        let site = format!("rollout-{}.example", round % 20);
        match discovery.lease(LeaseOptions::for_target(site).ttl(Duration::from_secs(30))).await {
            Ok(lease) => {
                grants.at.lock().expect("grants").push(Instant::now());
                if let Err(error) = lease.release().await {
                    grants.failures.lock().expect("grants").push(format!("release: {error}"));
                }
            }
            Err(error) => grants.failures.lock().expect("grants").push(format!("lease: {error}")),
        }
    }
}

/// The longest time between two grants in `at` (sorted) within `from..to`.
pub fn longest_gap(at: &[Instant], from: Instant, to: Instant) -> Duration {
    let mut inside: Vec<Instant> = at.iter().copied().filter(|at| *at >= from && *at <= to).collect();
    inside.sort();
    let mut edges = vec![from];
    edges.extend(inside);
    edges.push(to);
    edges.windows(2).map(|pair| pair[1] - pair[0]).max().unwrap_or_default()
}

/// A GET of `url` through the gateway at `gateway` as `user`: the status and the proxy it went through.
pub async fn through_gateway(gateway: std::net::SocketAddr, url: &str, user: &str) -> Result<(u16, String), String> {
    let answer = tokio::time::timeout(
        Duration::from_secs(45),
        egress_testenv::through_proxy(gateway, "GET", url, Some((user, SHIPPED_LEASE_TOKEN))),
    )
    .await
    .map_err(|_| "no answer within 45 s".to_owned())?
    .map_err(|error| format!("{error:#}"))?;
    let proxy = answer.header("x-egress-proxy").unwrap_or_default().to_owned();
    if answer.status != 200 {
        return Err(format!("{} via {proxy:?}: {}", answer.status, answer.header("proxy-status").unwrap_or_default()));
    }
    Ok((answer.status, proxy))
}

/// A ban reported at one gateway replica reaches the other, with two replicas as `deploy/default` ships
/// them (whichever lease state the operator keeps): a session's 4 requests go through one proxy P on both replicas, one request
/// reports `X-Egress-Report: banned` at the first replica, then 80 requests on new connections, alternating between
/// the replicas over 60 s, send none through P and all through the session's one new proxy. Regression: a ban
/// reached only the replica that saw it, and about half of the 80 left through P.
pub async fn a_ban_at_one_gateway_replica_moves_the_session_at_both(
    installation: &Installation,
    client: &Client,
    url: &str,
    ns: &str,
) {
    let url = url.to_owned();
    let names = ["coherent-1", "coherent-2"];
    let proxies = ready_proxies(installation, client, ns, &names, "coherent").await;
    let replicas = gateway_replicas(installation).await;
    let user = "session-coherent,label-e2e=coherent";

    let mut before = Vec::new();
    for request in 0..4 {
        let replica = replicas[request % 2];
        let (_, proxy) = eventually_every("a GET through a gateway replica", WAIT, Duration::from_millis(500), || {
            let url = url.clone();
            async move { through_gateway(replica, &url, user).await }
        })
        .await;
        before.push(proxy);
    }
    let banned = before[0].clone();
    assert!(before.iter().all(|proxy| *proxy == banned), "one session, one proxy on both replicas: {before:?}");

    let reported = egress_testenv::through_proxy_with(
        replicas[0],
        "GET",
        &url,
        Some((user, SHIPPED_LEASE_TOKEN)),
        &[("X-Egress-Report", "banned")],
    )
    .await
    .expect("the reporting request");
    let moved_to = reported.header("x-egress-proxy").unwrap_or_default().to_owned();
    assert_eq!(reported.status, 200, "{:?}", reported.header("proxy-status"));
    assert_ne!(moved_to, banned, "the reporting request went elsewhere");

    let started = Instant::now();
    let mut pace = tokio::time::interval(Duration::from_millis(750));
    pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut through: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    let mut failed = Vec::new();
    for request in 0..80 {
        pace.tick().await;
        match through_gateway(replicas[request % 2], &url, user).await {
            Ok((_, proxy)) => *through.entry(proxy).or_default() += 1,
            Err(error) => failed.push(error),
        }
    }
    eprintln!(
        "e2e: after a ban of {banned} reported at one gateway replica, 80 requests over {:.1?} alternating between \
         both: {through:?}, {} failed",
        started.elapsed(),
        failed.len()
    );
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(through.get(&banned), None, "requests left through the banned proxy {banned}");
    assert_eq!(through.keys().collect::<Vec<_>>(), vec![&moved_to], "the session's requests leave through one proxy");
    for name in names {
        proxies.delete(name, &DeleteParams::default()).await.expect("delete");
    }
}

/// Managed Proxies `names` in `ns` (on the namespace's pods provider), labelled `e2e=<label>`, once Ready.
pub async fn ready_proxies(
    installation: &Installation,
    client: &Client,
    ns: &str,
    names: &[&str],
    label: &str,
) -> Api<Proxy> {
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), ns);
    for name in names {
        let mut proxy = Proxy::new(name, crate::common::managed(&format!("pods-{ns}"), None));
        proxy.metadata.labels = Some([("e2e".to_owned(), label.to_owned())].into());
        proxies.create(&PostParams::default(), &proxy).await.expect("create Proxy");
    }
    if let Err(error) = crate::common::wait_phase(&proxies, names, ProxyPhase::Ready, WAIT).await {
        panic!("{error}\noperator logs:\n{}", installation.operator_logs().await);
    }
    proxies
}

/// The two gateway replicas' pod addresses, as `deploy/default` ships them.
pub async fn gateway_replicas(installation: &Installation) -> Vec<std::net::SocketAddr> {
    let pods = installation.gateway_pods().await.expect("gateway pods");
    assert_eq!(pods.len(), 2, "deploy/default runs two gateway replicas");
    pods.iter().map(|pod| format!("{}:8088", pod_ip(pod)).parse().expect("a pod address")).collect()
}

/// A 200-page crawl of the origin's site (which refuses 8 % of requests with `429`, `Retry-After: 2`) through both
/// gateway replicas, twice: curl-style (4 sessions, each request a new connection, alternating between the
/// replicas, 8 requests/s in all) and Scrapy with nothing but `meta["proxy"]` (8 sessions, its requests alternating
/// between the replicas' URLs, 8 requests/s). By the site's own log: every page served, no request through a proxy
/// from 100 ms after its refusal until its `Retry-After` is over, and a session's requests change proxy only after
/// a refusal of the one they leave. Regression: a refusal reached only the replica that saw it, and crawls sent
/// 6-63 requests through a proxy cooling down for the site.
pub async fn crawls_through_both_gateway_replicas_avoid_every_refused_proxy(
    installation: &Installation,
    client: &Client,
    origin: &egress_testenv::LocalOrigin,
    ns: &str,
) {
    let names = ["crawl8-1", "crawl8-2", "crawl8-3"];
    // At the default maxLeases (5): 15 slots for Scrapy's 8 sessions at two replicas (16 leases). Each replica
    // holds a lease of its own for a session it serves, and a session's leases share one slot, so a full proxy
    // never moves a session (when each lease took a slot, 70 of 217 requests changed proxy with no refusal).
    let proxies = ready_proxies(installation, client, ns, &names, "crawl8").await;
    let replicas = gateway_replicas(installation).await;
    let grace = Duration::from_millis(100);
    let site = origin.site();

    // curl-style: 4 sessions, a request every 500 ms each, each on a new connection, alternating replicas.
    site.reset();
    let sessions = 4;
    let started = Instant::now();
    let crawlers = (0..sessions).map(|session| {
        let base = origin.url();
        let replicas = replicas.clone();
        tokio::spawn(async move {
            let user = format!("session-curl{session},label-e2e=crawl8");
            let mut pace = tokio::time::interval(Duration::from_millis(500));
            pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut failed = Vec::new();
            for (turn, page) in (session..SITE_PAGES).step_by(sessions).enumerate() {
                pace.tick().await;
                let url = format!("{base}site/p/{page}");
                if let Err(error) = through_gateway(replicas[turn % 2], &url, &user).await {
                    failed.push(format!("page {page}: {error}"));
                }
            }
            failed
        })
    });
    let mut failed = Vec::new();
    for crawler in crawlers.collect::<Vec<_>>() {
        failed.extend(crawler.await.expect("a crawler"));
    }
    let curl = judge("curl-style", &site.log(), sessions, grace, started.elapsed());
    assert!(failed.is_empty(), "curl-style: {} pages failed: {failed:?}", failed.len());

    // Scrapy, nothing egress-specific but the proxy URLs.
    site.reset();
    let sessions = 8;
    let started = Instant::now();
    let python = std::env::var_os("EGRESS_PYTHON").expect("EGRESS_PYTHON names the Python client's test venv");
    let tests = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../clients/python/tests");
    let output = tempfile::NamedTempFile::new().expect("a temp file");
    let proxy_urls: Vec<String> = replicas
        .iter()
        .map(|replica| format!("http://session-scrapy{{session}},label-e2e=crawl8:{SHIPPED_LEASE_TOKEN}@{replica}"))
        .collect();
    let mut command = tokio::process::Command::new(python);
    command
        .arg(tests.join("crawl.py"))
        .arg(origin.site_url())
        .arg(output.path())
        .env("PYTHONPATH", tests.join("../src"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("EGRESS_URL", "http://unused.invalid")
        .env("EGRESS_TOKEN", "unused")
        .env("CRAWL_PROXY", proxy_urls.join(" "))
        .env("CRAWL_SESSIONS", sessions.to_string())
        .env("CRAWL_SETTINGS", r#"{"CONCURRENT_REQUESTS": 8, "DOWNLOAD_DELAY": 0.125}"#);
    let done = tokio::time::timeout(Duration::from_secs(300), command.output())
        .await
        .expect("the Scrapy crawl ends within 300 s")
        .expect("Scrapy runs");
    assert!(done.status.success(), "the Scrapy crawl failed: {}", String::from_utf8_lossy(&done.stderr));
    let result: serde_json::Value =
        serde_json::from_slice(&std::fs::read(output.path()).expect("the crawl's output")).expect("JSON");
    let served: std::collections::BTreeSet<&str> = result["pages"]
        .as_array()
        .expect("pages")
        .iter()
        .filter(|page| page["status"] == 200)
        .filter_map(|page| page["url"].as_str())
        .collect();
    let scrapy = judge("Scrapy", &site.log(), sessions, grace, started.elapsed());
    assert_eq!(served.len(), SITE_PAGES + 1, "Scrapy got every page and the index with a 200: {}", result["stats"]);

    for (label, (cooling, moves)) in [("curl-style", curl), ("Scrapy", scrapy)] {
        assert!(cooling.is_empty(), "{label}: {} requests through a cooling proxy: {cooling:?}", cooling.len());
        assert!(moves.is_empty(), "{label}: {} unexplained moves: {moves:?}", moves.len());
    }
    for name in names {
        proxies.delete(name, &DeleteParams::default()).await.expect("delete");
    }
}

/// Prints one crawl's figures from the site's `log`, and returns its requests through a cooling proxy and its
/// unexplained moves.
fn judge(label: &str, log: &[Visit], sessions: usize, grace: Duration, took: Duration) -> (Vec<String>, Vec<String>) {
    let served: std::collections::BTreeSet<usize> =
        log.iter().filter(|visit| visit.status == 200).filter_map(|visit| visit.page()).collect();
    let refusals = log.iter().filter(|visit| visit.status == 429).count();
    let addresses: std::collections::BTreeSet<_> = log.iter().map(|visit| visit.from).collect();
    let cooling: Vec<String> = through_cooling(log, grace).iter().map(|visit| format!("{visit:?}")).collect();
    let moves = unexplained_moves(log, sessions, grace);
    eprintln!(
        "e2e: {label} crawl through both gateway replicas in {took:.1?}: {} of {SITE_PAGES} pages served, {} \
         requests at the site from {} addresses, {refusals} refused; through a cooling proxy {}, unexplained \
         moves {}",
        served.len(),
        log.len(),
        addresses.len(),
        cooling.len(),
        moves.len()
    );
    for line in cooling.iter().chain(&moves) {
        eprintln!("e2e: {label}: {line}");
    }
    assert_eq!(served.len(), SITE_PAGES, "{label}: the site served every page");
    assert!(refusals > 0, "{label}: the site refused some requests, so the crawl tested something");
    (cooling, moves)
}

/// Runs the real kubectl against the test cluster, as a user would; returns its standard output.
pub async fn kubectl(args: &[&str]) -> String {
    let kubeconfig = egress_testenv::shared().await.kubeconfig_path().to_path_buf();
    let args: Vec<String> = args.iter().map(|arg| (*arg).to_owned()).collect();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(egress_testenv::assets::kubectl())
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(&args)
            .output()
    })
    .await
    .expect("kubectl's thread")
    .expect("kubectl runs");
    assert!(output.status.success(), "kubectl failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}
