//! The end-to-end suite with a shared state store, in-cluster: `deploy/default` with the `deploy/shared-state`
//! component, as `docs/install.md` says ("A shared state store"), over a Valkey run by the node agent as Debian's
//! `redis-server` (the `valkey` Deployment and Service); two operator replicas that both serve discovery, two gateway
//! replicas. Run by `cargo xtask e2e` and `cargo xtask test`, in the tests' network namespace.
//!
//! One installation serves the binary, on its own control plane; every test disturbs it (kills, restarts, the store
//! stopped), so each holds the suite's lock.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use common::cluster::{
    Grants, WAIT, a_ban_at_one_gateway_replica_moves_the_session_at_both, is_leader, kubectl, lease_every_200ms,
    longest_gap, pod_ip, ready, through_gateway,
};
use egress_api::{Proxy, ProxyPhase, ProxySpec};
use egress_client::{ClientError, DiscoveryClient, LeaseOptions, Outcome};
use egress_testenv::install::{
    InstallOptions, Installation, OPERATOR_SELECTOR, SHIPPED_LEASE_TOKEN, STATE_STORE_DEPLOYMENT, STATE_STORE_SELECTOR,
    SYSTEM_NAMESPACE,
};
use egress_testenv::{LocalOrigin, eventually, eventually_every};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

/// The tests' namespaces, each with its provider `pods-<namespace>`.
const NAMESPACES: [&str; 3] = ["shared-gateway", "shared-chaos", "shared-outage"];

/// Every test holds it: each disturbs the installation.
static SUITE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Cluster {
    installation: Installation,
    origin: LocalOrigin,
}

/// The installation, applied on first use.
fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<&'static Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        // Its tasks (node agent, service proxies, origin) must outlive every test's runtime.
        let runtime: &'static tokio::runtime::Runtime = Box::leak(Box::new(
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime"),
        ));
        let cluster = std::thread::spawn(move || {
            runtime.block_on(async {
                let plane = egress_testenv::shared().await;
                let client = plane.client().await.expect("client");
                for name in NAMESPACES.iter().copied().chain([SYSTEM_NAMESPACE]) {
                    let namespace = Namespace {
                        metadata: ObjectMeta { name: Some(name.into()), ..ObjectMeta::default() },
                        ..Namespace::default()
                    };
                    let _ = Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &namespace).await;
                }
                let origin = LocalOrigin::start().await.expect("origin");
                let providers: String = NAMESPACES
                    .iter()
                    .map(|ns| {
                        format!(
                            "  - name: pods-{ns}\n    type: kubernetes\n    destinations: {}\n    \
                             kubernetes: {{ namespace: {ns}, image: \"ubuntu/squid:latest\" }}\n",
                            origin.destinations_yaml()
                        )
                    })
                    .collect();
                let options = InstallOptions {
                    operator_binary: env!("CARGO_BIN_EXE_egress-operator").into(),
                    providers_yaml: format!("providers:\n{providers}"),
                    proxy_namespaces: NAMESPACES.iter().map(|ns| (*ns).to_owned()).collect(),
                    default_probe_url: origin.ip_url(),
                    discovery_tokens: None,
                    shared_state: true,
                };
                let started = Instant::now();
                let installation = Installation::apply(plane, &options)
                    .await
                    .unwrap_or_else(|error| panic!("installing deploy/default with deploy/shared-state: {error:#}"));
                eprintln!("e2e-shared: installed and Available in {:.1?}", started.elapsed());
                Cluster { installation, origin }
            })
        })
        .join()
        .expect("the installation starts");
        Box::leak(Box::new(cluster))
    })
}

async fn client() -> Client {
    egress_testenv::shared().await.client().await.expect("client")
}

fn discovery() -> DiscoveryClient {
    DiscoveryClient::new(&cluster().installation.discovery.url(), Some(SHIPPED_LEASE_TOKEN.into())).expect("client")
}

/// Creates Managed Proxies `names` in `ns` labelled `e2e=<label>`, with `maxLeases`, and waits until they are
/// Ready and discovery lists them.
async fn proxies(client: &Client, ns: &str, names: &[&str], label: &str, max_leases: i32) -> Api<Proxy> {
    let api: Api<Proxy> = Api::namespaced(client.clone(), ns);
    for name in names {
        let spec = ProxySpec { max_leases: Some(max_leases), ..common::managed(&format!("pods-{ns}"), None) };
        let mut proxy = Proxy::new(name, spec);
        proxy.metadata.labels = Some([("e2e".to_owned(), label.to_owned())].into());
        api.create(&PostParams::default(), &proxy).await.expect("create Proxy");
    }
    if let Err(error) = common::wait_phase(&api, names, ProxyPhase::Ready, WAIT).await {
        panic!("{error}\noperator logs:\n{}", cluster().installation.operator_logs().await);
    }
    let discovery = discovery();
    let selector = format!("e2e={label}");
    eventually("discovery to list the proxies", WAIT, || {
        let (discovery, selector) = (discovery.clone(), selector.clone());
        async move {
            let listed = discovery.proxies(Some(&selector), None).await.ok()?;
            (listed.len() == names.len()).then_some(())
        }
    })
    .await;
    api
}

async fn delete_all(api: &Api<Proxy>, names: &[&str]) {
    for name in names {
        api.delete(name, &DeleteParams::default()).await.expect("delete");
    }
}

async fn operator_pods(client: &Client) -> Vec<Pod> {
    let pods = Api::<Pod>::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let mut items = pods.list(&ListParams::default().labels(OPERATOR_SELECTOR)).await.expect("operator pods").items;
    items.sort_by_key(ResourceExt::name_any);
    items
}

/// The state store's output, for messages.
async fn state_store_logs(client: &Client) -> String {
    let pods = Api::<Pod>::namespaced(client.clone(), SYSTEM_NAMESPACE);
    let items =
        pods.list(&ListParams::default().labels(STATE_STORE_SELECTOR)).await.map(|list| list.items).unwrap_or_default();
    let agent = cluster().installation.agent();
    items
        .iter()
        .map(|pod| {
            let status = serde_json::to_string(&pod.status).unwrap_or_default();
            let log = agent.container_log(SYSTEM_NAMESPACE, &pod.name_any(), "valkey");
            format!("==== {} {status}\n{log}", pod.name_any())
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A discovery client for each operator pod, asked directly (not through the Service), by pod name.
async fn each_replica(client: &Client) -> Vec<(String, DiscoveryClient)> {
    operator_pods(client)
        .await
        .iter()
        .map(|pod| {
            let url = format!("http://{}:8090", pod_ip(pod));
            (pod.name_any(), DiscoveryClient::new(&url, Some(SHIPPED_LEASE_TOKEN.into())).expect("client"))
        })
        .collect()
}

/// Both operator pods Ready, one of them leading, the discovery Service routing to both, and each replica leasing
/// when asked directly.
async fn both_serving(client: &Client) -> Vec<Pod> {
    let pods = eventually("both operator pods Ready behind the discovery Service, one leading", WAIT, || async {
        let pods = operator_pods(client).await;
        let routed = cluster().installation.discovery.endpoints();
        let ok = pods.len() == 2
            && pods.iter().all(ready)
            && pods.iter().filter(|pod| is_leader(pod)).count() == 1
            && routed.len() == 2;
        ok.then_some(pods)
    })
    .await;
    // Each replica leases, asked directly: one that cannot reach the store would otherwise hide behind the other.
    for (pod, at) in each_replica(client).await {
        let leased = eventually_every(
            &format!("operator pod {pod} to answer a lease (not state-unavailable)"),
            WAIT,
            Duration::from_millis(250),
            || {
                let at = at.clone();
                async move {
                    match at.lease(LeaseOptions::for_target("serving.example")).await {
                        Ok(lease) => Ok(lease.release().await),
                        Err(ClientError::Unavailable { reason, .. }) if reason == "state-unavailable" => {
                            Err("state-unavailable".to_owned())
                        }
                        // No proxy (yet) is not the question here.
                        Err(ClientError::Unavailable { .. }) => Ok(Ok(())),
                        Err(error) => Ok(Err(error)),
                    }
                }
            },
        )
        .await;
        if let Err(error) = leased {
            panic!(
                "operator pod {pod} did not lease ({error}); operator logs:\n{}\nstate store:\n{}",
                cluster().installation.operator_logs().await,
                state_store_logs(client).await
            );
        }
    }
    pods
}

/// With the shared state every operator replica serves: the discovery Service routes to both pods, not only to the
/// leader's. Then the gateway's promise of `deploy/default` holds in this mode too: a ban reported at one gateway
/// replica moves the session at both.
#[tokio::test]
async fn both_operator_replicas_serve_and_a_ban_at_one_gateway_replica_moves_the_session_at_both() {
    let _suite = SUITE.lock().await;
    let cluster = cluster();
    let client = client().await;
    let pods = both_serving(&client).await;
    let mut routed: Vec<String> =
        cluster.installation.discovery.endpoints().iter().map(|endpoint| endpoint.ip().to_string()).collect();
    routed.sort();
    let mut addresses: Vec<String> = pods.iter().map(pod_ip).collect();
    addresses.sort();
    assert_eq!(routed, addresses, "the discovery Service routes to every operator pod");
    a_ban_at_one_gateway_replica_moves_the_session_at_both(
        &cluster.installation,
        &client,
        &cluster.origin.ip_url(),
        NAMESPACES[0],
    )
    .await;
}

/// With the shared state and both operator replicas serving, crawls of a site refusing 8 % of requests through
/// both gateway replicas (curl-style and Scrapy) pass no request through a refused proxy while it cools down.
#[tokio::test]
async fn crawls_through_both_gateway_replicas_pass_no_request_through_a_refused_proxy_with_the_shared_state() {
    let _suite = SUITE.lock().await;
    let cluster = cluster();
    let client = client().await;
    both_serving(&client).await;
    common::cluster::crawls_through_both_gateway_replicas_avoid_every_refused_proxy(
        &cluster.installation,
        &client,
        &cluster.origin,
        NAMESPACES[0],
    )
    .await;
}

/// Held leases renewed every 2 s by one crawler until `stop`; every failed renewal, with when it was sent (seconds
/// after `epoch`).
async fn hold_and_renew(
    discovery: DiscoveryClient,
    count: usize,
    stop: Arc<AtomicBool>,
    epoch: Instant,
) -> (usize, Vec<String>, Vec<egress_client::LeaseGuard>) {
    let mut held = Vec::new();
    for index in 0..count {
        let options = LeaseOptions::for_target(format!("held-{index}.example")).ttl(Duration::from_secs(20));
        held.push(discovery.lease(options).await.expect("a held lease"));
    }
    let (mut renewed, mut failures) = (0, Vec::new());
    let (started, mut slowest) = (epoch, (Duration::ZERO, Duration::ZERO));
    let mut pace = tokio::time::interval(Duration::from_secs(2));
    pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::SeqCst) {
        pace.tick().await;
        for lease in &mut held {
            let sent = Instant::now();
            let answer = lease.renew(Some(Duration::from_secs(20))).await;
            slowest = slowest.max((sent.elapsed(), sent - started));
            match answer {
                Ok(_) => renewed += 1,
                Err(error) => {
                    failures.push(format!("renew {} at {:.1} s: {error}", lease.id(), (sent - started).as_secs_f64()))
                }
            }
        }
    }
    eprintln!(
        "e2e-shared: the slowest renewal took {} ms, sent at {:.1} s",
        slowest.0.as_millis(),
        slowest.1.as_secs_f64()
    );
    (renewed, failures, held)
}

/// The failover promise with a shared state: under 8 crawlers leasing and releasing every 200 ms and 4 held
/// leases renewed every 2 s, three SIGKILLs of the leader and a `kubectl rollout restart` fail no call, every held
/// lease renews throughout, a cooldown reported before is kept, no listing shows a proxy above its cap, and a lease
/// is granted at least every second.
#[tokio::test]
async fn leader_kills_and_a_rolling_restart_fail_no_call_with_the_shared_state() {
    let _suite = SUITE.lock().await;
    let cluster = cluster();
    let client = client().await;
    let ns = NAMESPACES[1];
    let names = ["k-1", "k-2", "k-3", "k-4"];
    // 32 slots for at most 12 leases held at once (8 crawlers, 4 held): a lease whose answer a SIGKILL cut off
    // stays held until its TTL (30 s; docs/discovery-api.md), and the crawlers' load must not turn a few of those
    // into refusals for capacity, which would say nothing about the failover.
    const MAX_LEASES: i32 = 8;
    let api = proxies(&client, ns, &names, "chaos", MAX_LEASES).await;
    both_serving(&client).await;
    let discovery = discovery();

    // A ban before the kills: the proxy cools down for the site.
    let banned = discovery.lease(LeaseOptions::for_target("kept.example")).await.expect("a lease to ban");
    let banned_proxy = banned.proxy();
    banned.report(Outcome::Banned, Some(403)).await.expect("the ban is reported");
    banned.release().await.expect("release");

    let (grants, stop) = (Arc::new(Grants::default()), Arc::new(AtomicBool::new(false)));
    let crawlers: Vec<_> = (0..8)
        .map(|index| tokio::spawn(lease_every_200ms(index, discovery.clone(), grants.clone(), stop.clone())))
        .collect();
    let epoch = Instant::now();
    let holder = tokio::spawn(hold_and_renew(discovery.clone(), 4, stop.clone(), epoch));
    let overshoot = {
        let (discovery, stop) = (discovery.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut worst, mut listings, mut failed) = (i64::MIN, 0, Vec::new());
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            while !stop.load(Ordering::SeqCst) {
                tick.tick().await;
                match discovery.proxies(Some("e2e=chaos"), None).await {
                    Ok(listed) => {
                        listings += 1;
                        for proxy in listed {
                            worst = worst.max(i64::from(proxy.active_leases) - i64::from(proxy.max_leases));
                        }
                    }
                    Err(error) => failed.push(format!("list: {error}")),
                }
            }
            (worst, listings, failed)
        })
    };
    eventually("the crawlers to lease", WAIT, || async {
        (grants.at.lock().expect("grants").len() >= 40).then_some(())
    })
    .await;

    let started = Instant::now();
    let agent = cluster.installation.agent();
    for kill in 1..=3 {
        let leader = eventually("a leader", WAIT, || async {
            operator_pods(&client).await.into_iter().find(|pod| is_leader(pod) && ready(pod))
        })
        .await;
        assert!(agent.signal_container(SYSTEM_NAMESPACE, &leader.name_any(), "operator", "KILL"), "SIGKILL #{kill}");
        let killed = Instant::now();
        let granted = grants.at.lock().expect("grants").len();
        eventually("leases granted after the kill", WAIT, || async {
            (grants.at.lock().expect("grants").len() >= granted + 20).then_some(())
        })
        .await;
        let serving = killed.elapsed();
        both_serving(&client).await;
        eprintln!(
            "e2e-shared: leader SIGKILL {kill} at {:.1} s: 20 more leases {:.1} s after it, both replicas serving \
             again after {:.1} s",
            (killed - epoch).as_secs_f64(),
            serving.as_secs_f64(),
            killed.elapsed().as_secs_f64()
        );
    }
    let old_pods: Vec<String> = operator_pods(&client).await.iter().map(ResourceExt::name_any).collect();
    let rollout = Instant::now();
    eprintln!("e2e-shared: the rollout starts at {:.1} s", (rollout - epoch).as_secs_f64());
    kubectl(&["rollout", "restart", "deployment/egress-operator", "-n", SYSTEM_NAMESPACE]).await;
    kubectl(&["rollout", "status", "deployment/egress-operator", "-n", SYSTEM_NAMESPACE, "--timeout=300s"]).await;
    eventually("two new operator pods, both serving", WAIT, || async {
        let pods = both_serving(&client).await;
        pods.iter().all(|pod| !old_pods.contains(&pod.name_any())).then_some(())
    })
    .await;
    let rolled = rollout.elapsed();
    let granted = grants.at.lock().expect("grants").len();
    eventually("40 more leases after the rollout", WAIT, || async {
        (grants.at.lock().expect("grants").len() >= granted + 40).then_some(())
    })
    .await;
    let ended = Instant::now();
    stop.store(true, Ordering::SeqCst);
    for crawler in crawlers {
        crawler.await.expect("crawler");
    }
    let (renewed, renew_failures, held) = holder.await.expect("the holder");
    let (worst, listings, list_failures) = overshoot.await.expect("the sampler");
    let at = grants.at.lock().expect("grants").clone();
    let failures = grants.failures.lock().expect("grants").clone();
    let gap = longest_gap(&at, started, ended);
    let cooldowns = discovery.cooldowns(Some("kept.example")).await.expect("cooldowns");
    let kept = cooldowns.iter().any(|cooldown| cooldown.proxy == banned_proxy.as_str());
    eprintln!(
        "e2e-shared: 3 leader SIGKILLs and a rollout ({:.1} s) under 8 crawlers leasing every 200 ms: {} leases, \
         {} failed calls, longest time without a grant {} ms; 4 held leases renewed {renewed} times, {} failed; \
         {listings} listings every 100 ms, the worst proxy {} its cap ({} failed); the cooldown of {banned_proxy} \
         for kept.example kept: {kept}; failures by kind: {}",
        rolled.as_secs_f64(),
        at.len(),
        failures.len(),
        gap.as_millis(),
        renew_failures.len(),
        if worst > 0 { format!("{worst} above") } else { format!("{} below", -worst) },
        list_failures.len(),
        tally(&failures),
    );
    assert!(failures.is_empty(), "{} failed calls: {}", failures.len(), tally(&failures));
    assert!(renew_failures.is_empty(), "held leases failed to renew: {renew_failures:?}");
    assert!(list_failures.is_empty(), "listings failed: {list_failures:?}");
    assert!(worst <= 0, "a listing showed a proxy {worst} above its cap");
    assert!(gap <= Duration::from_secs(1), "no lease was granted for {gap:?}");
    assert!(kept, "the cooldown of {banned_proxy} for kept.example was lost: {cooldowns:?}");
    for _ in 0..4 {
        let lease = discovery.lease(LeaseOptions::for_target("kept.example")).await.expect("a lease");
        assert_ne!(lease.proxy(), banned_proxy, "a proxy cooling down for the site was leased for it");
        lease.release().await.expect("release");
    }
    for lease in held {
        lease.release().await.expect("a held lease releases");
    }
    delete_all(&api, &names).await;
}

/// `failures` by kind, the most frequent first: how many of each, with its first message.
fn tally(failures: &[String]) -> String {
    let mut kinds: std::collections::BTreeMap<String, (usize, &str)> = std::collections::BTreeMap::new();
    for failure in failures {
        // The kind is the message without its numbers (lease IDs, times, addresses differ between calls).
        let kind: String = failure.chars().filter(|c| !c.is_ascii_digit()).take(120).collect();
        kinds.entry(kind).or_insert((0, failure)).0 += 1;
    }
    let mut kinds: Vec<(usize, &str)> = kinds.into_values().collect();
    kinds.sort_by_key(|kind| std::cmp::Reverse(kind.0));
    kinds.iter().take(6).map(|(count, first)| format!("{count} × {first}")).collect::<Vec<_>>().join("; ")
}

/// Scales the test's state store to `replicas` and waits until its Service routes to that many pods.
async fn scale_state_store(client: &Client, replicas: i32) {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    deployments
        .patch(
            STATE_STORE_DEPLOYMENT,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "replicas": replicas } })),
        )
        .await
        .expect("scale the state store");
    let service = cluster().installation.state_store.as_ref().expect("the state store");
    let wanted = usize::try_from(replicas).expect("replicas");
    eventually("the state store's Service to route to the scaled pods", WAIT, || async {
        (service.endpoints().len() == wanted).then_some(())
    })
    .await;
}

/// The state store stopped for 20 s during a crawl through the gateway: new leases are `503 state-unavailable`
/// with `Retry-After` (at discovery and at the gateway), sessions that hold a lease carry on through their proxies
/// at both gateway replicas, nothing else fails; the store comes back empty, leases are granted again within 5 s of
/// its return, and the cooldown reported before is back from the Proxy's status.
#[tokio::test]
async fn a_state_store_stopped_for_20s_refuses_only_new_leases_and_everything_is_back_within_5s() {
    let _suite = SUITE.lock().await;
    let cluster = cluster();
    let client = client().await;
    let ns = NAMESPACES[2];
    let names = ["o-1", "o-2", "o-3"];
    let api = proxies(&client, ns, &names, "outage", 10).await;
    both_serving(&client).await;
    let discovery = discovery();
    let url = cluster.origin.ip_url();
    let pods = cluster.installation.gateway_pods().await.expect("gateway pods");
    let replicas: Vec<std::net::SocketAddr> =
        pods.iter().map(|pod| format!("{}:8088", pod_ip(pod)).parse().expect("a pod address")).collect();
    let user = |session: usize| format!("session-o{session},label-e2e=outage");

    // Each session leases at both replicas before the store stops.
    let mut sticky = std::collections::BTreeMap::new();
    for session in 0..4 {
        for replica in &replicas {
            let (_, proxy) =
                eventually_every("a GET through a gateway replica", WAIT, Duration::from_millis(500), || {
                    let (url, user) = (url.clone(), user(session));
                    async move { through_gateway(*replica, &url, &user).await }
                })
                .await;
            assert_eq!(sticky.entry(session).or_insert_with(|| proxy.clone()), &proxy, "session {session} moved");
        }
    }
    let banned = discovery.lease(LeaseOptions::for_target("outage-banned.example").selector("e2e=outage")).await;
    let banned = banned.expect("a lease to ban");
    let banned_proxy = banned.proxy();
    banned.report(Outcome::Banned, Some(403)).await.expect("the ban is reported");
    banned.release().await.expect("release");
    let mut held = discovery
        .lease(LeaseOptions::for_target("outage-held.example").selector("e2e=outage").ttl(Duration::from_secs(120)))
        .await
        .expect("a held lease");
    // The operator writes the cooldown into the Proxy's status, from where an empty store gets it back.
    eventually("the cooldown in the Proxy's status", WAIT, || async {
        let proxy = api.get(banned_proxy.name()).await.ok()?;
        let cooldowns = proxy.status?.cooldowns;
        cooldowns.iter().any(|cooldown| cooldown.target == "outage-banned.example").then_some(())
    })
    .await;

    scale_state_store(&client, 0).await;
    let stopped = Instant::now();
    let outage = Duration::from_secs(20);
    // Three loops at once for the 20 s: the held sessions every 500 ms (alternating replicas), new leases at
    // discovery every 500 ms, and new sessions at the gateway (each waits up to the gateway's 10 s for a proxy
    // before its 503).
    let held_sessions = async {
        let (mut carried, mut unexpected) = (0, Vec::new());
        let mut pace = tokio::time::interval(Duration::from_millis(500));
        pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut round = 0;
        while stopped.elapsed() < outage {
            pace.tick().await;
            round += 1;
            for session in 0..4 {
                let replica = replicas[(session + round) % 2];
                match through_gateway(replica, &url, &user(session)).await {
                    Ok((_, proxy)) if proxy == sticky[&session] => carried += 1,
                    other => unexpected.push(format!("held session {session} at {replica}: {other:?}")),
                }
            }
        }
        (carried, unexpected)
    };
    let new_leases = async {
        let (mut refused, mut unexpected) = (0, Vec::new());
        let mut pace = tokio::time::interval(Duration::from_millis(500));
        pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut round = 0;
        while stopped.elapsed() < outage {
            pace.tick().await;
            round += 1;
            match discovery.lease(LeaseOptions::for_target(format!("new-{round}.example"))).await {
                Err(ClientError::Unavailable { reason, retry_after: Some(_), .. }) if reason == "state-unavailable" => {
                    refused += 1;
                }
                other => unexpected.push(format!("a new lease: {:?}", other.map(|lease| lease.proxy()))),
            }
        }
        (refused, unexpected)
    };
    let new_sessions = async {
        let (mut refused, mut unexpected) = (0, Vec::new());
        let mut round = 0;
        while stopped.elapsed() < outage - Duration::from_secs(10) {
            round += 1;
            let fresh = format!("session-new{round},label-e2e=outage");
            let answer =
                egress_testenv::through_proxy(replicas[round % 2], "GET", &url, Some((&fresh, SHIPPED_LEASE_TOKEN)))
                    .await
                    .map_err(|error| format!("{error:#}"));
            match answer {
                Ok(answer)
                    if answer.status == 503
                        && answer.header("retry-after").is_some()
                        && answer.header("proxy-status").unwrap_or_default().contains("state-unavailable") =>
                {
                    refused += 1;
                }
                Ok(answer) => unexpected.push(format!(
                    "a new session through the gateway: {} {:?}",
                    answer.status,
                    answer.header("proxy-status")
                )),
                Err(error) => unexpected.push(format!("a new session through the gateway: {error}")),
            }
        }
        (refused, unexpected)
    };
    let ((carried, mut unexpected), (refused, at_discovery), (sessions_refused, at_gateway)) =
        tokio::join!(held_sessions, new_leases, new_sessions);
    unexpected.extend(at_discovery.into_iter().chain(at_gateway));

    scale_state_store(&client, 1).await;
    let returned = Instant::now();
    // Every replica, asked directly, leases again: the promise holds for each, not for whichever the Service picks.
    let mut leased_after = Duration::ZERO;
    for (pod, at) in each_replica(&client).await {
        let lease = eventually(&format!("a new lease at {pod} after the store returned"), WAIT, || {
            let at = at.clone();
            async move { at.lease(LeaseOptions::for_target("back.example").selector("e2e=outage")).await.ok() }
        })
        .await;
        leased_after = leased_after.max(returned.elapsed());
        lease.release().await.expect("release");
    }
    held.renew(None).await.expect("the lease held through the outage renews");
    let cooldown_after = eventually("the cooldown back in the emptied store", WAIT, || {
        let (discovery, banned_proxy) = (discovery.clone(), banned_proxy.clone());
        async move {
            let listed = discovery.cooldowns(Some("outage-banned.example")).await.ok()?;
            listed.iter().any(|cooldown| cooldown.proxy == banned_proxy.as_str()).then(|| returned.elapsed())
        }
    })
    .await;
    let session_after = eventually("a new session through the gateway", WAIT, || {
        let url = url.clone();
        let replica = replicas[0];
        async move {
            through_gateway(replica, &url, "session-after,label-e2e=outage").await.ok().map(|_| returned.elapsed())
        }
    })
    .await;
    for session in 0..4 {
        for replica in &replicas {
            let answer = through_gateway(*replica, &url, &user(session)).await.map(|(_, proxy)| proxy);
            assert_eq!(answer.as_ref(), Ok(&sticky[&session]), "session {session} after the outage");
        }
    }
    eprintln!(
        "e2e-shared: the state store stopped for 20 s: {carried} requests of held sessions carried on, {refused} new \
         leases at discovery and {sessions_refused} new gateway sessions refused 503 state-unavailable with Retry-After, {} other answers; after it returned (empty): a \
         lease in {:.2} s, a new gateway session in {:.2} s, the cooldown back in {:.2} s",
        unexpected.len(),
        leased_after.as_secs_f64(),
        session_after.as_secs_f64(),
        cooldown_after.as_secs_f64()
    );
    assert!(unexpected.is_empty(), "{unexpected:#?}");
    assert!(
        carried >= 4 * 20 && refused >= 20 && sessions_refused >= 1,
        "too few requests in 20 s: {carried}, {refused} and {sessions_refused}"
    );
    let bound = Duration::from_secs(5);
    assert!(leased_after <= bound && session_after <= bound, "{leased_after:?} and {session_after:?} above 5 s");
    assert!(cooldown_after <= bound, "the cooldown came back after {cooldown_after:?}");
    held.release().await.expect("release the held lease");
    delete_all(&api, &names).await;
}
