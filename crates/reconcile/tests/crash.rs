//! Crash safety: random operations over many Proxies while the controller is killed and restarted at random
//! moments, then the world must settle to exactly one instance per live Proxy and nothing else.
//!
//! The run is seeded; the seed is printed, and `EGRESS_CRASH_SEED=<seed>` replays it.

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime};

use egress_api::Proxy;
use egress_api::annotations::ROTATE;
use egress_provider::instance_name;
use egress_reconcile::gc::OrphanCollector;
use kube::ResourceExt;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::{Harness, managed};

const PROXIES: usize = 20;
const OPERATIONS: usize = 200;
const SETTLE: Duration = Duration::from_secs(180);

/// xorshift64*: small, seedable, and good enough to pick operations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// What is wrong with the world now, or nothing.
async fn violations(harness: &Harness) -> Vec<String> {
    let mut problems = Vec::new();
    let proxies: Vec<Proxy> = harness.proxies().list(&ListParams::default()).await.expect("list Proxies").items;
    let mut wanted = BTreeSet::new();
    for proxy in &proxies {
        let name = proxy.name_any();
        if proxy.metadata.deletion_timestamp.is_some() {
            problems.push(format!("{name} is still being deleted"));
            continue;
        }
        let desired = instance_name(&proxy.uid().expect("uid"), &proxy.desired_spec_hash());
        let status = proxy.status.clone().unwrap_or_default();
        if status.instance.as_ref().map(|instance| &instance.name) != Some(&desired) {
            problems.push(format!(
                "{name} records {:?}, not its desired instance {desired}",
                status.instance.map(|i| i.name)
            ));
        }
        if let Some(previous) = status.previous_instance {
            problems.push(format!("{name} still has a previous instance {}", previous.name));
        }
        wanted.insert(desired);
    }
    let live: BTreeSet<String> = harness.provider.live().into_iter().collect();
    for extra in live.difference(&wanted) {
        problems.push(format!("instance {extra} belongs to no live Proxy's desired state"));
    }
    for missing in wanted.difference(&live) {
        problems.push(format!("desired instance {missing} does not exist"));
    }
    problems
}

#[tokio::test]
async fn random_operations_with_crashes_converge() {
    let seed = std::env::var("EGRESS_CRASH_SEED").ok().and_then(|seed| seed.parse().ok()).unwrap_or_else(|| {
        SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64) | 1
    });
    eprintln!("crash-safety seed {seed} (replay with EGRESS_CRASH_SEED={seed})");
    let mut rng = Rng(seed);
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
        let problems = violations(&harness).await;
        if problems.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "seed {seed}: not settled after {SETTLE:?}: {problems:#?}");
    }
}
