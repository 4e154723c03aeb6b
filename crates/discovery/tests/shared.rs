//! Two discovery replicas over one shared lease state (a real `redis-server`), as `--state-store` runs them: both
//! serve, a ban reported at one is refused at the other, caps hold across both, and a state that does not answer
//! is a `503 state-unavailable` with `Retry-After` that ends once it answers again.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use egress_discovery::{Auth, Discovery, DiscoveryMetrics, ProxyId, ProxyRecord, router, serve};
use egress_lease::{LeaseConfig, LeaseKey};
use egress_lease_redis::{RedisLeaseState, RedisOptions};
use egress_testenv::redis::RedisServer;
use serde_json::{Value, json};

fn record(name: &str, max_leases: u32) -> ProxyRecord {
    ProxyRecord {
        id: ProxyId::new("crawl", name),
        host: format!("10.0.0.{}", name.len()),
        port: 3128,
        egress_ip: Some(format!("203.0.113.{}", name.bytes().map(u32::from).sum::<u32>() % 250)),
        labels: BTreeMap::new(),
        zone: None,
        provider: None,
        max_leases,
        healthy: true,
        credentials: None,
        cooldowns: Vec::new(),
        pool: None,
        cooldown: None,
        pacing: None,
    }
}

/// A discovery replica over the shared state at `server`.
async fn replica(server: &RedisServer, key: &LeaseKey, records: &[ProxyRecord]) -> SocketAddr {
    replica_synced(server, key, records, true).await
}

/// A discovery replica over the shared state at `server`, its Proxy store marked synced or not.
async fn replica_synced(server: &RedisServer, key: &LeaseKey, records: &[ProxyRecord], synced: bool) -> SocketAddr {
    let options = RedisOptions::new(server.url());
    let store = RedisLeaseState::connect(&options, LeaseConfig::default(), key.clone()).await.expect("connect");
    let state = Arc::new(Discovery::new(Arc::new(store), Auth::Disabled, DiscoveryMetrics::default()));
    for record in records {
        state.upsert(record.clone()).await;
    }
    if synced {
        state.mark_synced();
    }
    tokio::spawn(egress_discovery::run_expiry(state.clone(), Duration::from_millis(100), std::future::pending()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(serve(listener, router(state), std::future::pending()));
    address
}

/// One request: status, `Retry-After`, and the JSON body (`Null` when there is none).
async fn call(address: SocketAddr, method: &str, path: &str, body: Option<Value>) -> (u16, Option<String>, Value) {
    let mut stream = tokio::net::TcpStream::connect(address).await.expect("connect");
    let body = body.map(|body| body.to_string()).unwrap_or_default();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: discovery\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    tokio::io::AsyncWriteExt::write_all(&mut stream, request.as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut stream, &mut answer).await.expect("read");
    let answer = String::from_utf8(answer).expect("utf-8");
    let (head, body) = answer.split_once("\r\n\r\n").expect("a head");
    let status = head[9..12].parse().expect("status");
    let retry_after =
        head.lines().find_map(|line| line.to_ascii_lowercase().strip_prefix("retry-after: ").map(str::to_owned));
    (status, retry_after, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// Opens `GET /v1/refusals` and returns the connection, its head read.
async fn refusal_stream(address: SocketAddr) -> tokio::net::TcpStream {
    let mut stream = tokio::net::TcpStream::connect(address).await.expect("connect");
    let request = "GET /v1/refusals HTTP/1.1\r\nhost: discovery\r\n\r\n";
    tokio::io::AsyncWriteExt::write_all(&mut stream, request.as_bytes()).await.expect("write");
    stream
}

/// Reads the stream until what it has read contains `needle` (5 s at most); returns what it read.
async fn read_until(stream: &mut tokio::net::TcpStream, needle: &str) -> String {
    let mut read = Vec::new();
    let found = tokio::time::timeout(Duration::from_secs(5), async {
        let mut buffer = [0_u8; 4096];
        while !String::from_utf8_lossy(&read).contains(needle) {
            let count = tokio::io::AsyncReadExt::read(stream, &mut buffer).await.expect("read");
            assert!(count > 0, "the stream ended: {}", String::from_utf8_lossy(&read));
            read.extend_from_slice(&buffer[..count]);
        }
    })
    .await;
    let text = String::from_utf8_lossy(&read).into_owned();
    assert!(found.is_ok(), "no {needle:?} within 5 s: {text}");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_over_one_shared_state_agree_and_a_lost_state_is_a_503_until_it_returns() {
    let mut server = RedisServer::start(None).await.expect("redis");
    let key = LeaseKey::from_bytes(&[3; 32]).expect("key");
    // Proxy a's status keeps a cooldown for kept.example: a state that comes back empty gets it again.
    let kept = egress_lease::Cooldown {
        proxy: ProxyId::new("crawl", "a"),
        target: "kept.example".into(),
        until: std::time::SystemTime::now() + Duration::from_secs(600),
        streak: 1,
        reporters: vec!["anonymous".into()],
    };
    let records = vec![ProxyRecord { cooldowns: vec![kept], ..record("a", 2) }, record("bb", 2)];
    let one = replica(&server, &key, &records).await;
    let two = replica(&server, &key, &records).await;

    // A lease at one replica, banned there: the other replica never hands that proxy out for the site.
    let (status, _, lease) = call(one, "POST", "/v1/leases", Some(json!({"target": "shop.example.com"}))).await;
    assert_eq!(status, 201, "{lease}");
    let (id, banned) = (lease["id"].as_str().expect("id"), lease["proxy"]["name"].as_str().expect("proxy"));
    let (status, _, reported) =
        call(one, "POST", &format!("/v1/leases/{id}/report"), Some(json!({"outcome": "banned"}))).await;
    assert_eq!(status, 200, "{reported}");
    let (status, _, other) = call(two, "POST", "/v1/leases", Some(json!({"target": "www.example.com"}))).await;
    assert_eq!(status, 201, "{other}");
    assert_ne!(other["proxy"]["name"], banned, "the cooled proxy is not handed out at the other replica");
    // A refusal stream at the other replica starts with that ban, and hears of the next one reported at the first
    // replica as soon as the shared state publishes it.
    let mut stream = refusal_stream(two).await;
    let snapshot = read_until(&mut stream, "\"synced\"").await;
    assert!(snapshot.contains(banned), "{snapshot}");
    let (_, _, second) = call(one, "POST", "/v1/leases", Some(json!({"target": "example.com"}))).await;
    let second_proxy = second["proxy"]["name"].as_str().expect("proxy").to_owned();
    let reported_at = std::time::Instant::now();
    let path = format!("/v1/leases/{}/report", second["id"].as_str().expect("id"));
    let (status, _, body) = call(one, "POST", &path, Some(json!({"outcome": "banned"}))).await;
    assert_eq!(status, 200, "{body}");
    let line = read_until(&mut stream, &second_proxy).await;
    eprintln!("the other replica's stream had the ban {:?} after it was reported", reported_at.elapsed());
    assert!(line.contains("\"refusal\""), "{line}");
    // The other replica renews and releases the first replica's lease.
    let (status, _, renewed) = call(two, "POST", &format!("/v1/leases/{id}/renew"), Some(json!({}))).await;
    assert_eq!(status, 200, "{renewed}");
    // Caps hold across both: two proxies of cap 2 take four leases (three are held), whichever replica grants them.
    let mut granted = 3;
    for n in 0..6 {
        let (status, _, body) =
            call([one, two][n % 2], "POST", "/v1/leases", Some(json!({"target": "other.org"}))).await;
        match status {
            201 => granted += 1,
            503 => assert_eq!(body["reason"], "all-at-capacity", "{body}"),
            _ => panic!("{status}: {body}"),
        }
    }
    assert_eq!(granted, 4);

    // The state stops answering: new leases are 503 state-unavailable with Retry-After, nothing else fails.
    server.kill();
    let killed = std::time::Instant::now();
    let (status, retry_after, body) = call(two, "POST", "/v1/leases", Some(json!({"target": "example.net"}))).await;
    assert_eq!((status, body["reason"].as_str()), (503, Some("state-unavailable")), "{body}");
    assert_eq!(retry_after.as_deref(), Some("2"));
    assert!(!body.to_string().contains("127.1."), "the store's address stays in the log: {body}");
    let (status, _, body) = call(one, "GET", "/v1/proxies", None).await;
    assert_eq!(status, 503, "{body}");
    eprintln!("two answers {:?} after the state was lost", killed.elapsed());
    // The stream's body ends (its last chunk): refusals published meanwhile are lost, so its client must start
    // over from the cooldowns.
    read_until(&mut stream, "0\r\n\r\n").await;
    eprintln!("the stream ended {:?} after the state was lost", killed.elapsed());
    // Back (empty): served again within 5 s, without a restart of either replica.
    server.restart().await.expect("restart");
    let back = std::time::Instant::now();
    loop {
        let (status, _, body) = call(one, "POST", "/v1/leases", Some(json!({"target": "example.net"}))).await;
        if status == 201 {
            break;
        }
        assert!(back.elapsed() < Duration::from_secs(5), "not back within 5 s: {status} {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("served again {:?} after the state returned", back.elapsed());
    // The cooldown the Proxy keeps is back, at every replica.
    loop {
        let (status, _, body) = call(two, "GET", "/v1/cooldowns?target=kept.example", None).await;
        if status == 200 && body.to_string().contains("crawl/a") {
            break;
        }
        assert!(back.elapsed() < Duration::from_secs(5), "the kept cooldown is not back within 5 s: {status} {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("the kept cooldown was back {:?} after the state returned", back.elapsed());
    // The renewed lease, shown to the emptied state, is adopted rather than lost.
    let renewed_id = renewed["id"].as_str().expect("id");
    let (status, _, body) = call(two, "POST", &format!("/v1/leases/{renewed_id}/renew"), Some(json!({}))).await;
    assert_eq!(status, 200, "{body}");
}

/// Regression: a replica that had not read the fleet yet (just restarted, still routed to by the Service) served a
/// renewal, took the lease's proxy for unknown, and ended the lease for every replica. It now answers `503
/// not-serving` (which clients retry elsewhere) until its Proxy store has synced, and the lease lives on.
#[tokio::test]
async fn a_replica_that_has_not_read_the_fleet_refuses_and_ends_no_lease() {
    let server = RedisServer::start(None).await.expect("redis");
    let key = LeaseKey::from_bytes(&[5; 32]).expect("key");
    let serving = replica(&server, &key, &[record("a", 2)]).await;
    let starting = replica_synced(&server, &key, &[], false).await;
    let (status, _, lease) = call(serving, "POST", "/v1/leases", Some(json!({"target": "shop.example.com"}))).await;
    assert_eq!(status, 201, "{lease}");
    let renew = format!("/v1/leases/{}/renew", lease["id"].as_str().expect("id"));
    let (status, retry_after, body) = call(starting, "POST", &renew, Some(json!({}))).await;
    assert_eq!((status, body["reason"].as_str()), (503, Some("not-serving")), "{body}");
    assert_eq!(retry_after.as_deref(), Some("1"));
    assert!(body["detail"].as_str().is_some_and(|detail| detail.contains("not read the fleet")), "{body}");
    let (status, _, body) = call(serving, "POST", &renew, Some(json!({}))).await;
    assert_eq!(status, 200, "the lease lives on: {body}");
}
