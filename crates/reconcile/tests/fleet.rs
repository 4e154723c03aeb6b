//! The controller keeps reconciling while a thousand Proxies arrive: a spec change made halfway through the ramp is
//! reconciled promptly, not after the ramp.
//!
//! The regressions this guards: at 3,000 Proxies the Proxy feed held a runtime worker while it re-copied the store
//! for every change, and the controller stopped reconciling for minutes; later, with one queue for everything, a
//! change waited behind the ramp's own reconciles (6 s at 1,000, 48 s at 10,000). Changes to known Proxies (a new
//! generation, as here, or labels, annotations, finalizers, deletion: the same trigger fingerprint) now have a lane of
//! their own; the 10,000 figure is `cargo xtask bench fleet`'s.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use egress_api::{Proxy, ProxySpec};
use egress_health::{EngineConfig, HealthEngine, HealthMetrics, tls_connector};
use egress_reconcile::health_feed::{HealthFeedConfig, run_health_feed};
use egress_reconcile::{
    Context, ControllerConfig, CredentialStore, ProxyFeed, ProxyVerdicts, ReconcileMetrics, StaticProviders,
};
use egress_testenv::eventually;
use futures::StreamExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

const PROXIES: usize = 1_000;
const CONCURRENCY: usize = 32;
/// The bound at the ramp's peak (the lane measured 0.15 s here in a debug build).
const PROMPTLY: Duration = Duration::from_secs(2);

fn external(index: usize) -> Proxy {
    Proxy::new(&format!("p-{index:04}"), ProxySpec::external("127.0.0.1", 40_000 + (index % 1000) as u16))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_change_during_a_ramp_of_a_thousand_is_reconciled_promptly() {
    // Composed as the operator composes it: one Proxy store and one credential store read by the controller and
    // by the health feed, whose engine probes every Proxy (their ports refuse, so verdicts flip and trigger
    // reconciles too).
    let ns = egress_testenv::namespace("fleet").await;
    let verdicts = ProxyVerdicts::new();
    let (feed, _watch) = ProxyFeed::start(ns.client(), Some(ns.name()));
    let (credentials, _secret_watch) = CredentialStore::start(ns.client(), Some(ns.name()), &feed);
    let mut config = ControllerConfig::new(ns.name());
    config.namespace = Some(ns.name().to_owned());
    let context = Arc::new(Context::new(
        ns.client(),
        Arc::new(StaticProviders::new()),
        verdicts.clone(),
        credentials.clone(),
        config,
        ReconcileMetrics::default(),
    ));
    let (triggers, trigger_stream) = egress_reconcile::trigger_channel();
    let _controller =
        tokio::spawn(egress_reconcile::run(context, feed.clone(), trigger_stream, futures::future::pending()));
    let engine_config = EngineConfig { first_probe_within: Some(Duration::from_secs(2)), ..EngineConfig::default() };
    let (engine, transitions) =
        HealthEngine::start_with(engine_config, tls_connector(b"").expect("TLS"), HealthMetrics::default(), verdicts);
    let feed_config = HealthFeedConfig { default_probe_url: "http://127.0.0.1:9/".into() };
    let _health = tokio::spawn(run_health_feed(
        feed,
        credentials,
        feed_config,
        Arc::new(engine),
        transitions,
        triggers,
        futures::future::pending(),
    ));
    let proxies: Api<Proxy> = ns.api();
    proxies.create(&PostParams::default(), &external(0)).await.expect("create the first Proxy");
    let created = Arc::new(AtomicUsize::new(1));
    let ramp = {
        let (proxies, created) = (proxies.clone(), created.clone());
        tokio::spawn(async move {
            futures::stream::iter(1..PROXIES)
                .map(|index| {
                    let proxies = proxies.clone();
                    async move { proxies.create(&PostParams::default(), &external(index)).await.expect("create") }
                })
                .buffer_unordered(CONCURRENCY)
                .for_each(|_| {
                    created.fetch_add(1, Ordering::SeqCst);
                    async {}
                })
                .await;
        })
    };
    eventually("the ramp's midpoint", Duration::from_secs(300), || async {
        (created.load(Ordering::SeqCst) >= PROXIES / 2).then_some(())
    })
    .await;
    let changed = Instant::now();
    let patch = json!({ "spec": { "maxLeases": 7 } });
    let patched = proxies.patch("p-0000", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch");
    let generation = patched.metadata.generation;
    let at_midpoint = created.load(Ordering::SeqCst);
    eventually(
        &format!("the spec change made at {at_midpoint} of {PROXIES} Proxies to be reconciled"),
        PROMPTLY,
        || async {
            let proxy = proxies.get("p-0000").await.ok()?;
            (proxy.status.and_then(|status| status.observed_generation) >= generation).then_some(())
        },
    )
    .await;
    let reconciled = changed.elapsed();
    println!(
        "spec change reconciled in {reconciled:?}, while {} of {PROXIES} Proxies had been created",
        created.load(Ordering::SeqCst)
    );
    ramp.await.expect("the ramp");
}
