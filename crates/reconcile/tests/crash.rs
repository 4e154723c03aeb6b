//! Crash safety: random operations over many Proxies while the controller is killed and restarted at random
//! moments, then the world must settle to exactly one instance per live Proxy and nothing else.
//!
//! The run is seeded; the seed is printed, and `EGRESS_CRASH_SEED=<seed>` replays it.

mod support;

use std::time::{Duration, Instant};

use egress_api::Proxy;
use egress_api::annotations::ROTATE;
use egress_reconcile::gc::OrphanCollector;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::{Harness, Rng, managed};

const PROXIES: usize = 20;
const OPERATIONS: usize = 200;
const SETTLE: Duration = Duration::from_secs(180);

#[tokio::test]
async fn random_operations_with_crashes_converge() {
    let seed = support::crash_seed();
    let mut rng = Rng::seeded(seed);
    let mut harness = Harness::new("rc-crash").await;
    let names: Vec<String> = (0..PROXIES).map(|index| format!("p{index}")).collect();
    let mut crashes = 0;

    for _ in 0..OPERATIONS {
        let name = &names[rng.below(PROXIES)];
        let zone = format!("zone-{}", rng.below(3));
        // Each call may race the controller or hit a missing object; either is part of the test, not a failure.
        match rng.below(4) {
            0 => {
                let _ = harness.proxies().create(&PostParams::default(), &Proxy::new(name, managed(&zone))).await;
            }
            1 => {
                let patch = json!({ "spec": { "placement": { "zone": zone } } });
                let _ = harness.proxies().patch(name, &PatchParams::default(), &Patch::Merge(patch)).await;
            }
            2 => {
                let patch = json!({ "metadata": { "annotations": { ROTATE: rng.next().to_string() } } });
                let _ = harness.proxies().patch(name, &PatchParams::default(), &Patch::Merge(patch)).await;
            }
            _ => {
                let _ = harness.proxies().delete(name, &DeleteParams::default()).await;
            }
        }
        harness.report_health().await;
        if rng.below(8) == 0 {
            harness.crash().await;
            crashes += 1;
            harness.start();
        }
        // Pace the operations so the controller is caught at many different points of its work.
        tokio::time::sleep(Duration::from_millis(rng.below(40) as u64)).await;
    }
    eprintln!("{OPERATIONS} operations done with {crashes} controller crashes; letting it settle");

    // A last restart, then the orphan collector and the health reports run until the world is consistent.
    harness.crash().await;
    harness.start();
    let providers = egress_reconcile::StaticProviders::new()
        .with("scripted", harness.provider.clone() as std::sync::Arc<dyn egress_provider::Provider>);
    let collector = OrphanCollector::new(
        harness.ns.client(),
        std::sync::Arc::new(providers),
        &harness.cluster_id,
        Duration::ZERO,
        harness.metrics.clone(),
    )
    .within_namespace(harness.ns.name());
    let deadline = Instant::now() + SETTLE;
    let mut poll = tokio::time::interval(Duration::from_millis(500));
    loop {
        poll.tick().await;
        harness.report_health().await;
        collector.collect_once().await.expect("orphan collection");
        let problems = support::violations(&harness).await;
        if problems.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "seed {seed}: not settled after {SETTLE:?}: {problems:#?}");
    }
}
