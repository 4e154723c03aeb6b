//! The discovery server against hostile clients, over real sockets: idle connections, request lines alone,
//! slowloris headers, slow bodies and idle HTTP/2 connections are closed within the configured limits while an
//! ordinary client keeps its latency, and the connection cap holds, refusing the excess at once.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

use egress_discovery::{Auth, Discovery, DiscoveryMetrics, ServerLimits, ServerMetrics, router, serve_with};
use egress_lease::{InMemoryLeaseStore, LeaseConfig};
use egress_testenv::eventually;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LIMITS: ServerLimits = ServerLimits {
    header_timeout: Duration::from_secs(2),
    body_timeout: Duration::from_secs(2),
    idle_timeout: Duration::from_secs(3),
    http2_keepalive_interval: Duration::from_secs(1),
    http2_keepalive_timeout: Duration::from_secs(1),
    http2_max_streams: 8,
    max_connections: 400,
    max_unauthenticated_per_source: 400,
    max_header_bytes: egress_discovery::DEFAULT_MAX_HEADER_BYTES,
};

/// Slack on top of a limit for the server to act on it, on a loaded two-core machine.
const SLACK: Duration = Duration::from_millis(1500);

async fn start(limits: ServerLimits) -> (SocketAddr, ServerMetrics) {
    let store = Arc::new(InMemoryLeaseStore::new(LeaseConfig::default()));
    let state = Arc::new(Discovery::new(store, Auth::Disabled, DiscoveryMetrics::default()));
    state.mark_synced();
    // As the operator binds: a burst of 350 connections must not overflow the accept queue.
    let listener = egress_discovery::bind("127.0.0.1:0".parse().expect("an address")).expect("bind");
    let address = listener.local_addr().expect("address");
    let metrics = ServerMetrics::default();
    tokio::spawn(serve_with(listener, router(state), limits, "discovery", metrics.clone(), std::future::pending()));
    (address, metrics)
}

/// Writes `first`, then `trickle` one byte every 300 ms; returns how long until the server closed the connection
/// and everything it sent.
async fn hold(address: SocketAddr, first: &'static [u8], trickle: &'static [u8]) -> (Duration, String) {
    let stream = TcpStream::connect(address).await.expect("connect");
    // From the connection's establishment: a connect queued in the listen backlog under load is not the server's time.
    let started = Instant::now();
    let (mut reader, mut writer) = stream.into_split();
    let closed = Arc::new(AtomicBool::new(false));
    let writing = closed.clone();
    let writer_task = tokio::spawn(async move {
        if writer.write_all(first).await.is_err() {
            return;
        }
        if trickle.is_empty() {
            // Send nothing more, and keep the write half open (dropping it would send FIN).
            std::future::pending::<()>().await;
        }
        for byte in trickle.iter().cycle() {
            tokio::time::sleep(Duration::from_millis(300)).await;
            if writing.load(Ordering::Relaxed) || writer.write_all(&[*byte]).await.is_err() {
                return;
            }
        }
    });
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    let deadline = Duration::from_secs(30);
    loop {
        match tokio::time::timeout(deadline.saturating_sub(started.elapsed()), reader.read(&mut chunk)).await {
            Ok(Ok(0) | Err(_)) => break,
            Ok(Ok(read)) => received.extend_from_slice(&chunk[..read]),
            Err(_) => panic!("the connection was still open after {deadline:?}"),
        }
    }
    closed.store(true, Ordering::Relaxed);
    writer_task.abort();
    (started.elapsed(), String::from_utf8_lossy(&received).into_owned())
}

/// An HTTP/2 (prior knowledge) connection that makes one request and then idles; returns when the server closed it.
async fn idle_http2(address: SocketAddr) -> Duration {
    let stream = TcpStream::connect(address).await.expect("connect");
    let (mut sender, connection) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
        .await
        .expect("an HTTP/2 handshake");
    let started = Instant::now();
    let driver = tokio::spawn(connection);
    let request = http::Request::get("http://discovery/healthz").body(Empty::<Bytes>::new()).expect("request");
    let response = sender.send_request(request).await.expect("an HTTP/2 answer");
    assert_eq!(response.status(), 200);
    drop(response);
    tokio::time::timeout(Duration::from_secs(30), driver).await.expect("the server closes idle HTTP/2").ok();
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_clients_are_closed_in_time_while_others_are_served() {
    let (address, metrics) = start(LIMITS).await;
    let peak = Arc::new(AtomicI64::new(0));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (metrics, peak, sampling) = (metrics.clone(), peak.clone(), sampling.clone());
        tokio::spawn(async move {
            while sampling.load(Ordering::Relaxed) {
                peak.fetch_max(metrics.open("discovery"), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };

    let mut idle = Vec::new();
    for _ in 0..300 {
        idle.push(tokio::spawn(hold(address, b"", b"")));
    }
    let mut lines = Vec::new();
    for _ in 0..20 {
        lines.push(tokio::spawn(hold(address, b"GET /v1/proxies HTTP/1.1\r\n", b"")));
    }
    let mut slowloris = Vec::new();
    for _ in 0..5 {
        slowloris.push(tokio::spawn(hold(
            address,
            b"GET /v1/proxies HTTP/1.1\r\nHost: d\r\n",
            b"X-Slow: aaaaaaaa\r\n",
        )));
    }
    let mut slow_bodies = Vec::new();
    for _ in 0..3 {
        slow_bodies.push(tokio::spawn(hold(
            address,
            b"POST /v1/leases HTTP/1.1\r\nHost: d\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n{",
            b" ",
        )));
    }
    let mut http2 = Vec::new();
    for _ in 0..20 {
        http2.push(tokio::spawn(idle_http2(address)));
    }

    // An ordinary client meanwhile: one keep-alive connection, a request every 20 ms for 4 s.
    let stream = TcpStream::connect(address).await.expect("connect");
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
    tokio::spawn(connection);
    let mut latencies = Vec::new();
    let window = Instant::now();
    while window.elapsed() < Duration::from_secs(4) {
        let request =
            http::Request::get("/v1/proxies").header("host", "d").body(Empty::<Bytes>::new()).expect("request");
        let started = Instant::now();
        let response = sender.send_request(request).await.expect("an answer while under attack");
        let status = response.status();
        response.into_body().collect().await.expect("body");
        latencies.push(started.elapsed());
        assert_eq!(status, 200);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let report = |what: &str, times: &[Duration], limit: Duration| {
        let longest = times.iter().max().copied().unwrap_or_default();
        println!("{what}: {} closed, the last after {longest:.2?} (limit {limit:?})", times.len());
        assert!(longest <= limit + SLACK, "{what}: closed after {longest:?}, limit {limit:?}");
    };
    let mut times = Vec::new();
    for task in idle {
        times.push(task.await.expect("idle client").0);
    }
    report("300 idle connections", &times, LIMITS.header_timeout);
    let mut times = Vec::new();
    for task in lines {
        times.push(task.await.expect("request-line client").0);
    }
    report("20 request lines alone", &times, LIMITS.header_timeout);
    let mut times = Vec::new();
    for task in slowloris {
        times.push(task.await.expect("slowloris client").0);
    }
    report("5 slowloris clients", &times, LIMITS.header_timeout);
    let mut times = Vec::new();
    for task in slow_bodies {
        let (time, answer) = task.await.expect("slow-body client");
        assert!(answer.starts_with("HTTP/1.1 408"), "a slow body gets 408: {answer}");
        assert!(answer.contains("application/problem+json") && answer.contains("body-timeout"), "{answer}");
        times.push(time);
    }
    report("3 slow bodies", &times, LIMITS.body_timeout);
    let mut times = Vec::new();
    for task in http2 {
        times.push(task.await.expect("HTTP/2 client"));
    }
    report("20 idle HTTP/2 connections", &times, LIMITS.idle_timeout);

    latencies.sort();
    let p99 = latencies[latencies.len() * 99 / 100 - 1];
    println!(
        "ordinary client: {} requests, p50 {:.2?}, p99 {p99:.2?}",
        latencies.len(),
        latencies[latencies.len() / 2]
    );
    assert!(p99 < Duration::from_millis(50), "p99 {p99:?} under attack");
    sampling.store(false, Ordering::Relaxed);
    sampler.await.expect("sampler");
    let peak = peak.load(Ordering::Relaxed);
    println!("open connections at most {peak} (cap {})", LIMITS.max_connections);
    assert!(peak <= LIMITS.max_connections as i64 && peak >= 300, "peak {peak}");
    println!(
        "closed by limit: header {}, body {}, idle {}",
        metrics.closed_by_limit("discovery", "header-timeout"),
        metrics.closed_by_limit("discovery", "body-timeout"),
        metrics.closed_by_limit("discovery", "idle-timeout")
    );
    assert!(metrics.closed_by_limit("discovery", "header-timeout") >= 325);
    assert_eq!(metrics.closed_by_limit("discovery", "body-timeout"), 3);
    assert_eq!(metrics.closed_by_limit("discovery", "idle-timeout"), 20);
    assert_eq!(metrics.refused("discovery"), 0, "nothing was over the cap");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_are_refused_at_once_and_counted() {
    let limits = ServerLimits { max_connections: 50, header_timeout: Duration::from_secs(5), ..LIMITS };
    let (address, metrics) = start(limits).await;
    let mut held = Vec::new();
    for _ in 0..50 {
        held.push(TcpStream::connect(address).await.expect("connect"));
    }
    // The server takes the 50 before the next ones.
    eventually("the server to hold 50 connections", Duration::from_secs(5), || {
        let open = metrics.open("discovery");
        async move { (open == 50).then_some(()) }
    })
    .await;
    for _ in 0..30 {
        let started = Instant::now();
        let mut stream = TcpStream::connect(address).await.expect("the kernel accepts the connection");
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut byte)).await;
        assert!(matches!(read, Ok(Ok(0) | Err(_))), "an excess connection is closed at once: {read:?}");
        assert!(started.elapsed() < Duration::from_millis(500), "refused after {:?}", started.elapsed());
    }
    assert_eq!(metrics.refused("discovery"), 30);
    assert_eq!(metrics.open("discovery"), 50, "the cap held");
    drop(held);
    // Slots come back as the held connections close.
    eventually("the held connections to close", Duration::from_secs(5), || {
        let open = metrics.open("discovery");
        async move { (open == 0).then_some(()) }
    })
    .await;
    let (status, _) = get(address).await;
    assert_eq!(status, 200, "served again once the held connections closed");
}

/// A flood from several addresses fills the connection cap (1,100 connections from 20 addresses failed the
/// operator's `/livez` 24 times in 45 and restarted it); an address with (almost) nothing open still gets in, from
/// a reserve past the cap: the kubelet's probe of the health port is answered whatever the others hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_with_nothing_open_gets_past_a_cap_others_filled() {
    let limits = ServerLimits { max_connections: 10, header_timeout: Duration::from_secs(30), ..LIMITS };
    let (address, metrics) = start(limits).await;
    let mut flood = Vec::new();
    for source in ["127.0.0.2", "127.0.0.3", "127.0.0.4"] {
        for _ in 0..6 {
            flood.push(connect_from(source, address).await);
        }
    }
    // The first six from .2 and four from .3 fill the cap; .4's first two come from the reserve (it held nothing),
    // and the rest of .3's and .4's are refused.
    eventually("the flood to fill the cap", Duration::from_secs(5), || {
        let open = metrics.open("discovery");
        async move { (open == 12).then_some(()) }
    })
    .await;
    assert_eq!(metrics.refused("discovery"), 6, "an address holding two or more gets nothing past the cap");
    // The probe: a client that holds nothing here.
    let mut probe = connect_from("127.0.0.9", address).await;
    probe.write_all(b"GET /livez HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n").await.expect("write");
    let answer = read_to_close(&mut probe, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 "), "the probe is answered: {answer:?}");
    assert_eq!(metrics.refused("discovery"), 6);
    drop(flood);
}

async fn get(address: SocketAddr) -> (u16, String) {
    let mut stream = TcpStream::connect(address).await.expect("connect");
    stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n").await.expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    let status = response.split_whitespace().nth(1).and_then(|code| code.parse().ok()).unwrap_or(0);
    (status, response)
}

/// A connection to `address` from the loopback address `source` (so one test plays clients on several hosts).
async fn connect_from(source: &str, address: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.bind(format!("{source}:0").parse().expect("an address")).expect("bind the source address");
    socket.connect(address).await.expect("connect")
}

/// Reads until the server closes the connection (or `within` passes, which fails the test); returns what it sent.
async fn read_to_close(stream: &mut TcpStream, within: Duration) -> String {
    let mut received = Vec::new();
    let read = tokio::time::timeout(within, stream.read_to_end(&mut received)).await;
    assert!(read.is_ok(), "the connection was still open after {within:?}");
    String::from_utf8_lossy(&received).into_owned()
}

const TOKEN: &str = "lease-token-0123456789abcdef";

async fn start_with_tokens(limits: ServerLimits) -> (SocketAddr, ServerMetrics, tempfile::NamedTempFile) {
    let tokens = tempfile::NamedTempFile::new().expect("token file");
    std::fs::write(tokens.path(), format!("lease {TOKEN}\n")).expect("write tokens");
    let auth = Auth::Tokens(egress_discovery::TokenFile::load(tokens.path()).expect("tokens"));
    let store = Arc::new(InMemoryLeaseStore::new(LeaseConfig::default()));
    let state = Arc::new(Discovery::new(store, auth, DiscoveryMetrics::default()));
    state.mark_synced();
    let listener = egress_discovery::bind("127.0.0.1:0".parse().expect("an address")).expect("bind");
    let address = listener.local_addr().expect("address");
    let metrics = ServerMetrics::default();
    tokio::spawn(serve_with(listener, router(state), limits, "discovery", metrics.clone(), std::future::pending()));
    (address, metrics, tokens)
}

/// A client without a valid token cannot hold the server: each 401 closes its connection, and connections from one
/// address that have not authenticated are capped, while clients with a token (and other addresses) are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_without_a_token_cannot_starve_clients_with_one() {
    let limits = ServerLimits { max_unauthenticated_per_source: 32, header_timeout: Duration::from_secs(10), ..LIMITS };
    let (address, metrics, _tokens) = start_with_tokens(limits).await;

    // A 401 ends the connection: of two pipelined token-less requests, one is answered.
    let mut stream = connect_from("127.0.0.2", address).await;
    let request = "GET /v1/proxies HTTP/1.1\r\nHost: d\r\n\r\n";
    stream.write_all(format!("{request}{request}").as_bytes()).await.expect("write");
    let answered = read_to_close(&mut stream, Duration::from_secs(2)).await;
    assert_eq!(answered.matches("HTTP/1.1 401").count(), 1, "{answered}");
    assert!(answered.to_ascii_lowercase().contains("connection: close"), "{answered}");

    // 200 silent connections from one address: 32 are held, the rest closed as soon as they are accepted.
    let mut silent = Vec::new();
    for _ in 0..200 {
        silent.push(connect_from("127.0.0.2", address).await);
    }
    eventually("the excess to be closed", Duration::from_secs(10), || {
        let closed = metrics.closed_by_limit("discovery", "per-source");
        async move { (closed >= 168).then_some(()) }
    })
    .await;
    assert_eq!(metrics.open("discovery"), 32, "only the address's cap is held");
    // Clients with a token, from another address and from the flooding one, are served meanwhile.
    for source in ["127.0.0.1", "127.0.0.3"] {
        for _ in 0..20 {
            let mut stream = connect_from(source, address).await;
            let request = format!(
                "GET /v1/proxies HTTP/1.1\r\nHost: d\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n"
            );
            stream.write_all(request.as_bytes()).await.expect("write");
            let answer = read_to_close(&mut stream, Duration::from_secs(2)).await;
            assert!(answer.starts_with("HTTP/1.1 200"), "{source}: {answer}");
        }
    }
    drop(silent);

    // A connection that authenticated leaves its address's count: 32 keep-alive clients with a token, then 32
    // silent ones from the same address are all held.
    let mut kept = Vec::new();
    for _ in 0..32 {
        let mut stream = connect_from("127.0.0.4", address).await;
        let request = format!("GET /v1/proxies HTTP/1.1\r\nHost: d\r\nAuthorization: Bearer {TOKEN}\r\n\r\n");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).await.expect("an answer");
        assert_eq!(&head, b"HTTP/1.1 200");
        kept.push(stream);
    }
    let refused_before = metrics.closed_by_limit("discovery", "per-source");
    for _ in 0..32 {
        kept.push(connect_from("127.0.0.4", address).await);
    }
    // The server holds all 64: the 32 silent ones were admitted, not closed.
    eventually("the server to hold all 64 connections", Duration::from_secs(5), || {
        let open = metrics.open("discovery");
        async move { (open == 64).then_some(()) }
    })
    .await;
    assert_eq!(metrics.closed_by_limit("discovery", "per-source"), refused_before, "none refused");
}

/// Oversized heads and bodies are refused at once: 431 for a head over the limit (hyper's own answer, without a
/// body), 413 for a body announced over the limit, before any of it is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_heads_and_announced_bodies_are_refused_at_once() {
    let (address, _metrics, _tokens) = start_with_tokens(LIMITS).await;
    let mut stream = connect_from("127.0.0.1", address).await;
    let huge = "a".repeat(100 * 1024);
    let request = format!("GET /v1/proxies HTTP/1.1\r\nHost: d\r\nX-Filler: {huge}\r\n\r\n");
    // The server may close while the head is still being written.
    let _ = stream.write_all(request.as_bytes()).await;
    let answer = read_to_close(&mut stream, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");

    let started = Instant::now();
    let mut stream = connect_from("127.0.0.1", address).await;
    let request = format!(
        "POST /v1/leases HTTP/1.1\r\nHost: d\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    let answer = read_to_close(&mut stream, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("application/problem+json") && answer.contains("too-large"), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(2), "answered after {:?}", started.elapsed());
}
