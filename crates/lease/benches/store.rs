//! Lease + release cost at 100 and at 10,000 proxies, each with 1,000 live cooldowns, and their ratio (goal: at
//! most 2). Selection walks an ordered index, so the cost should barely grow with the fleet.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use egress_lease::{InMemoryLeaseStore, LeaseConfig, LeaseRequest, LeaseStore, Outcome, ProxyId, ProxyInfo, Report};

const OPERATIONS: u32 = 200_000;
const COOLDOWNS: usize = 1_000;

fn run(proxies: usize) -> Duration {
    let store = InMemoryLeaseStore::new(LeaseConfig::default());
    for index in 0..proxies {
        store.upsert_proxy(ProxyInfo {
            id: ProxyId::new("bench", &format!("proxy-{index}")),
            healthy: true,
            max_leases: 5,
            labels: BTreeMap::new(),
            endpoint: format!("10.0.{}.{}:3128", index / 256, index % 256),
            egress_ip: None,
            pool: None,
            zone: None,
            provider: None,
            cooldown: None,
            pacing: None,
        });
    }
    let now = SystemTime::now();
    // 1,000 live cooldowns spread over proxies and sites.
    for index in 0..COOLDOWNS {
        let request = LeaseRequest {
            target: format!("site-{}.example", index % 500),
            proxy: Some(ProxyId::new("bench", &format!("proxy-{}", index % proxies))),
            ..LeaseRequest::default()
        };
        if let Ok(lease) = store.lease(&request, now) {
            store.report(&lease.id, "", &Report::of(Outcome::Banned).and_release(), now).expect("report");
        }
    }
    let targets: Vec<String> = (0..1_000).map(|index| format!("site-{index}.example")).collect();
    let started = Instant::now();
    for operation in 0..OPERATIONS {
        let request =
            LeaseRequest { target: targets[operation as usize % targets.len()].clone(), ..LeaseRequest::default() };
        let lease = store.lease(&request, now).expect("a proxy is free");
        store.release(&lease.id, "", now).expect("release");
    }
    let per_operation = started.elapsed() / OPERATIONS;
    println!("{proxies:>6} proxies, {COOLDOWNS} cooldowns: lease+release {per_operation:>8.2?}");
    per_operation
}

fn main() {
    println!("lease store benchmark: {OPERATIONS} lease+release pairs per size");
    let small = run(100);
    let large = run(10_000);
    println!("ratio 10,000 / 100 proxies: {:.2} (goal: at most 2)", large.as_secs_f64() / small.as_secs_f64());
}
