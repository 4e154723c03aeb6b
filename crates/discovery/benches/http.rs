//! 64 concurrent keep-alive clients doing lease → release against the discovery server, and the same clients
//! against a bare hyper server that answers with the same bytes (a lease's JSON, then an empty 204), in one run: requests per
//! second of both, p50/p99 latency, and the ratio discovery / bare (goal: at least 0.6). Loopback only; each phase
//! runs for a fixed time, the two servers alternate for five rounds and the median round's ratio counts.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use egress_discovery::{Auth, Discovery, DiscoveryMetrics, ProxyId, ProxyRecord, router, serve};
use egress_lease::{InMemoryLeaseStore, LeaseConfig};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

const CLIENTS: usize = 64;
const PHASE: Duration = Duration::from_secs(3);
const ROUNDS: usize = 5;

async fn discovery_server() -> SocketAddr {
    let records = (0..100)
        .map(|index| ProxyRecord {
            id: ProxyId::new("bench", &format!("proxy-{index}")),
            host: "127.0.0.1".into(),
            port: 3128,
            egress_ip: None,
            labels: BTreeMap::new(),
            zone: None,
            provider: None,
            max_leases: 5,
            healthy: true,
            credentials: None,
            cooldowns: Vec::new(),
            pool: None,
            cooldown: None,
            pacing: None,
        })
        .collect::<Vec<_>>();
    let store = Arc::new(InMemoryLeaseStore::new(LeaseConfig::default()));
    let state = Arc::new(Discovery::new(store, Auth::Disabled, DiscoveryMetrics::default()));
    for record in records {
        state.upsert(record).await;
    }
    state.mark_synced();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(serve(listener, router(state), std::future::pending()));
    address
}

/// The answer to a lease from the discovery server, taken once, for the bare server to send back: both servers put
/// the same bytes on the wire and the clients do the same work with them, so the ratio measures the servers.
async fn lease_answer(discovery: SocketAddr) -> (Bytes, String) {
    let stream = tokio::net::TcpStream::connect(discovery).await.expect("connect");
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
    tokio::spawn(connection);
    let request = hyper::Request::post("/v1/leases")
        .header("host", "bench")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"target":"answer.example.com"}"#)))
        .expect("request");
    let response = sender.send_request(request).await.expect("lease");
    assert_eq!(response.status(), 201, "the sample lease was refused");
    let location = response.headers()["location"].to_str().expect("location").to_owned();
    let body = response.into_body().collect().await.expect("body").to_bytes();
    let request = hyper::Request::delete(location.as_str()).header("host", "bench").body(Full::new(Bytes::new()));
    let response = sender.send_request(request.expect("request")).await.expect("release");
    assert_eq!(response.status(), 204, "the sample lease was not released");
    (body, location)
}

/// A hyper server that answers a POST as discovery answers a lease (201, `Location`, the lease's JSON) and anything
/// else as it answers a release (204, no body), with no other work.
async fn bare_server(answer: Bytes, location: String) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let location = hyper::header::HeaderValue::from_str(&location).expect("location");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let (answer, location) = (answer.clone(), location.clone());
            tokio::spawn(async move {
                let service = service_fn(move |request: hyper::Request<Incoming>| {
                    let response = if request.method() == hyper::Method::POST {
                        hyper::Response::builder()
                            .status(201)
                            .header("location", location.clone())
                            .header("content-type", "application/json")
                            .body(Full::new(answer.clone()))
                    } else {
                        hyper::Response::builder().status(204).body(Full::new(Bytes::new()))
                    };
                    async move { Ok::<_, Infallible>(response.expect("response")) }
                });
                let _ =
                    hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
    address
}

/// One client: lease → release on one keep-alive connection until the deadline; returns request latencies.
async fn client(address: SocketAddr, index: usize, deadline: Instant) -> Vec<Duration> {
    let stream = tokio::net::TcpStream::connect(address).await.expect("connect");
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
    tokio::spawn(connection);
    let mut latencies = Vec::new();
    let body = format!(r#"{{"target":"site-{index}.example.com"}}"#);
    while Instant::now() < deadline {
        let started = Instant::now();
        let request = hyper::Request::post("/v1/leases")
            .header("host", "bench")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.clone())))
            .expect("request");
        let response = sender.send_request(request).await.expect("lease");
        let bytes = response.into_body().collect().await.expect("body").to_bytes();
        latencies.push(started.elapsed());
        let value: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
        let id = value["id"].as_str().expect("lease id").to_owned();
        let started = Instant::now();
        let request = hyper::Request::delete(format!("/v1/leases/{id}"))
            .header("host", "bench")
            .body(Full::new(Bytes::new()))
            .expect("request");
        let response = sender.send_request(request).await.expect("release");
        let _ = response.into_body().collect().await.expect("body");
        latencies.push(started.elapsed());
    }
    latencies
}

async fn phase(name: &str, address: SocketAddr) -> f64 {
    let deadline = Instant::now() + PHASE;
    let started = Instant::now();
    let handles: Vec<_> = (0..CLIENTS).map(|index| tokio::spawn(client(address, index, deadline))).collect();
    let mut latencies = Vec::new();
    for handle in handles {
        latencies.extend(handle.await.expect("client"));
    }
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort_unstable();
    let rate = latencies.len() as f64 / elapsed;
    let percentile = |p: f64| latencies[((latencies.len() as f64 * p) as usize).min(latencies.len() - 1)];
    println!(
        "{name:>10}: {:>8.0} requests/s, p50 {:>8.2?}, p99 {:>8.2?} ({} requests)",
        rate,
        percentile(0.50),
        percentile(0.99),
        latencies.len()
    );
    rate
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!(
        "discovery benchmark: {CLIENTS} keep-alive clients doing lease -> release over loopback, {PHASE:?} per server"
    );
    let discovery = discovery_server().await;
    let (answer, location) = lease_answer(discovery).await;
    let bare = bare_server(answer, location).await;
    // This machine's neighbours make one phase's figure swing by a third: the phases alternate, each round's two
    // phases give a ratio, and the median round's counts.
    let mut ratios = Vec::new();
    for round in 1..=ROUNDS {
        let bare_rate = phase("bare hyper", bare).await;
        let discovery_rate = phase("discovery", discovery).await;
        println!("  round {round}: ratio discovery / bare hyper {:.2}", discovery_rate / bare_rate);
        ratios.push(discovery_rate / bare_rate);
    }
    ratios.sort_by(f64::total_cmp);
    println!("median of {ROUNDS} rounds: ratio discovery / bare hyper: {:.2} (goal: at least 0.6)", ratios[ROUNDS / 2]);
}
