//! Lease + release pairs through the lease-state port: the shared state on a real `redis-server` against the
//! in-memory store, in the same run, one client at a time (each pair's latency: p50, p99) and eight at once (pairs
//! per second). 100 proxies of cap 5, 1,000 sites. The ratio says what sharing the state costs; a Redis round trip
//! on loopback bounds it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use egress_lease::{InMemoryLeaseStore, LeaseConfig, LeaseKey, LeaseRequest, LeaseState, ProxyId, ProxyInfo};
use egress_lease_redis::{RedisLeaseState, RedisOptions};
use egress_testenv::redis::RedisServer;

const PROXIES: usize = 100;
const SEQUENTIAL: usize = 5_000;
const CONCURRENT: usize = 8;
const PER_CLIENT: usize = 2_500;

async fn fill(state: &dyn LeaseState) {
    for index in 0..PROXIES {
        let info = ProxyInfo {
            id: ProxyId::new("bench", &format!("proxy-{index}")),
            healthy: true,
            max_leases: 5,
            labels: BTreeMap::new(),
            endpoint: format!("10.0.0.{index}:3128"),
            egress_ip: None,
            pool: None,
            zone: None,
            provider: None,
            cooldown: None,
            pacing: None,
        };
        state.upsert_proxy(info).await.expect("upsert");
    }
}

async fn pair(state: &dyn LeaseState, index: usize) {
    let request = LeaseRequest {
        target: format!("site-{}.example", index % 1_000),
        owner: "bench".into(),
        ..LeaseRequest::default()
    };
    let lease = state.lease(&request, SystemTime::now()).await.expect("a proxy is free");
    state.release(&lease.id, "bench", SystemTime::now()).await.expect("release");
}

/// (p50, p99, pairs per second with CONCURRENT clients).
async fn measure(state: Arc<dyn LeaseState>) -> (Duration, Duration, f64) {
    for index in 0..500 {
        pair(state.as_ref(), index).await;
    }
    let mut latencies = Vec::with_capacity(SEQUENTIAL);
    for index in 0..SEQUENTIAL {
        let started = Instant::now();
        pair(state.as_ref(), index).await;
        latencies.push(started.elapsed());
    }
    latencies.sort();
    let started = Instant::now();
    let clients: Vec<_> = (0..CONCURRENT)
        .map(|client| {
            let state = state.clone();
            tokio::spawn(async move {
                for index in 0..PER_CLIENT {
                    pair(state.as_ref(), client * PER_CLIENT + index).await;
                }
            })
        })
        .collect();
    for client in clients {
        client.await.expect("client");
    }
    let rate = (CONCURRENT * PER_CLIENT) as f64 / started.elapsed().as_secs_f64();
    (latencies[SEQUENTIAL / 2], latencies[SEQUENTIAL * 99 / 100], rate)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    runtime.block_on(async {
        let server = RedisServer::start(None).await.expect("redis-server");
        let key = LeaseKey::ephemeral();
        let memory: Arc<dyn LeaseState> = Arc::new(InMemoryLeaseStore::with_key(LeaseConfig::default(), key.clone()));
        fill(memory.as_ref()).await;
        let shared = RedisLeaseState::connect(&RedisOptions::new(server.url()), LeaseConfig::default(), key)
            .await
            .expect("connect");
        let shared: Arc<dyn LeaseState> = Arc::new(shared);
        fill(shared.as_ref()).await;
        println!(
            "lease-state benchmark: {PROXIES} proxies; {SEQUENTIAL} lease+release pairs one at a time, then {} by \
             {CONCURRENT} clients at once",
            CONCURRENT * PER_CLIENT
        );
        let (memory_p50, memory_p99, memory_rate) = measure(memory).await;
        println!("in memory:  p50 {memory_p50:>9.2?}  p99 {memory_p99:>9.2?}  {memory_rate:>9.0} pairs/s");
        let (shared_p50, shared_p99, shared_rate) = measure(shared).await;
        println!("redis:      p50 {shared_p50:>9.2?}  p99 {shared_p99:>9.2?}  {shared_rate:>9.0} pairs/s");
        // What the server spent per script: the rest of a pair's time is the two round trips and the client.
        let client = redis::Client::open(server.url()).expect("client");
        let mut connection = client.get_multiplexed_async_connection().await.expect("connection");
        let stats: String = redis::cmd("INFO").arg("commandstats").query_async(&mut connection).await.expect("info");
        for line in
            stats.lines().filter(|line| line.starts_with("cmdstat_evalsha") || line.starts_with("cmdstat_eval:"))
        {
            println!("server: {line}");
        }
        println!(
            "redis / in memory: {:.3} of the pairs per second, p50 {:.1} times",
            shared_rate / memory_rate,
            shared_p50.as_secs_f64() / memory_p50.as_secs_f64()
        );
    });
}
