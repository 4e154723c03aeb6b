//! The gateway's data path against the proxies it is compared with, in one run, over loopback: 64 keep-alive
//! clients fetching a small page from a local keep-alive origin
//!
//! - through Squid directly (the baseline),
//! - through a Squid chained to that Squid (the usual hand-made gateway),
//! - through the gateway in front of that Squid,
//! - through a bare TCP relay in front of that Squid (no parsing, no routing: `copy_bidirectional` on a runtime of
//!   the gateway's size), the least any user-space hop can cost here, so the gateway's own share shows apart from
//!   the hop's,
//!
//! as plain HTTP (absolute-form requests) and through CONNECT tunnels (one per client, requests inside it), then
//! the bytes per second of one tunnel carrying a large body. It prints requests/s, p50 and p99 per path, the ratios
//! with their goals: gateway ≥ 0.95 × the bare relay and ≥ the chain, the p50 the gateway adds over the bare relay
//! (≤ 0.3 ms), the tunnel's MB/s against the bare relay's (≥ 0.95). Against direct Squid the ratios are printed
//! without a goal: on two shared cores any user-space hop gets 0.71–0.90 of direct, so they measure the machine.
//! Then plain requests with a session per client through the gateway leasing from a discovery API (in-process) whose
//! state is in memory, and one whose state is shared on a real redis-server (`cargo xtask test` installs it), against
//! the gateway with a fixed upstream: what a session costs, and what the shared state adds. Each phase runs for a fixed time, twice in alternation; the figures
//! are the better of the two. Last, the memory of idle tunnels: a gateway in a process of its own (this binary,
//! started again) holds 9,000 CONNECT tunnels to a minimal upstream in this process, and its RSS growth per tunnel is
//! printed (goal ≤ 16 KiB; 9,000 because this machine allows 20,000 open files per process and a tunnel takes two
//! in the gateway). Needs Squid (`cargo xtask test` installs it). `BENCH_GATEWAY_WORKERS` (default 2)
//! sets the gateway runtime's worker threads and `BENCH_TUNNEL_BUFFER` (default 65536) the buffer a streaming
//! tunnel reads into per direction, to measure those choices; `BENCH_SQUID_CPUS` (say `0`) runs the Squids on those
//! CPUs and everything else on the rest, as on a machine where Squid has a core of its own.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use egress_discovery::{Auth, Discovery, DiscoveryMetrics, ProxyId, ProxyRecord};
use egress_gateway::{
    Buffers, Gateway, GatewayLimits, LeaseRouter, LeaseRouterConfig, StaticRouter, StaticTokens, Upstream,
};
use egress_lease::{InMemoryLeaseStore, LeaseConfig, LeaseKey, LeaseState};
use egress_lease_redis::{RedisLeaseState, RedisOptions};
use egress_testenv::{Squid, SquidOptions};
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const CLIENTS: usize = 64;
const PHASE: Duration = Duration::from_secs(3);
const TOKEN: &str = "bench-token";
const PAGE: &[u8] = &[b'x'; 1024];
const LARGE: u64 = 256 * 1024 * 1024;

/// Accepts connections on a loopback port with a runtime of its own on its own thread, each handled by `handle`
/// in a task of its own; returns the port's address.
fn serve_on_own_thread<F, Fut>(handle: F) -> SocketAddr
where
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    listener.set_nonblocking(true).expect("nonblocking");
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        runtime.block_on(async move {
            let listener = TcpListener::from_std(listener).expect("listener");
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                tokio::spawn(handle(stream));
            }
        });
    });
    address
}

/// A keep-alive origin on its own thread: `/` answers a 1 KiB page, `/large` 256 MiB.
fn origin() -> SocketAddr {
    serve_on_own_thread(|stream| async move {
        let _ = stream.set_nodelay(true);
        let service = service_fn(|request: hyper::Request<Incoming>| async move {
            let body: http_body_util::combinators::BoxBody<Bytes, Infallible> = if request.uri().path() == "/large" {
                let chunk = Bytes::from(vec![b'y'; 64 * 1024]);
                let count = (LARGE / chunk.len() as u64) as usize;
                StreamBody::new(chunks(chunk, count)).boxed()
            } else {
                Full::new(Bytes::from_static(PAGE)).boxed()
            };
            Ok::<_, Infallible>(hyper::Response::new(body))
        });
        let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
    })
}

/// `count` frames of `chunk`, as a stream.
fn chunks(
    chunk: Bytes,
    count: usize,
) -> impl futures::Stream<Item = Result<Frame<Bytes>, Infallible>> + Send + Sync + Unpin {
    struct Chunks(Bytes, usize);
    impl futures::Stream for Chunks {
        type Item = Result<Frame<Bytes>, Infallible>;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            if self.1 == 0 {
                return std::task::Poll::Ready(None);
            }
            self.1 -= 1;
            std::task::Poll::Ready(Some(Ok(Frame::data(self.0.clone()))))
        }
    }
    Chunks(chunk, count)
}

/// Binds a loopback port and runs `serve` on it, on a runtime of `workers` threads and a thread of its own; returns
/// the port's address.
fn on_own_runtime<F, Fut>(workers: usize, serve: F) -> SocketAddr
where
    F: FnOnce(TcpListener) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    listener.set_nonblocking(true).expect("nonblocking");
    std::thread::spawn(move || {
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build().expect("runtime");
        runtime.block_on(async move { serve(TcpListener::from_std(listener).expect("listener")).await });
    });
    address
}

/// The gateway in front of `squid`, on its own runtime of `workers` threads.
fn gateway(squid: SocketAddr, workers: usize, limits: GatewayLimits) -> SocketAddr {
    on_own_runtime(workers, move |listener| async move {
        let router = StaticRouter(Upstream::new(squid.to_string(), None, "bench/squid"));
        let gateway = Gateway::new(Arc::new(router), Arc::new(StaticTokens::new().with(TOKEN, "bench")), limits);
        gateway.serve(listener, std::future::pending()).await.expect("serve");
    })
}

/// A discovery API with `squid` as its one proxy over `store`, on a runtime of its own thread.
fn discovery(squid: SocketAddr, store: Arc<dyn LeaseState>) -> SocketAddr {
    on_own_runtime(1, move |listener| async move {
        let state = Arc::new(Discovery::new(store, Auth::Disabled, DiscoveryMetrics::default()));
        state
            .upsert(ProxyRecord {
                id: ProxyId::new("bench", "squid"),
                host: squid.ip().to_string(),
                port: squid.port(),
                egress_ip: None,
                labels: Default::default(),
                zone: None,
                provider: None,
                max_leases: 1000,
                healthy: true,
                credentials: None,
                cooldowns: Vec::new(),
                pool: None,
                cooldown: None,
                pacing: None,
            })
            .await;
        state.mark_synced();
        egress_discovery::serve(listener, egress_discovery::router(state), std::future::pending())
            .await
            .expect("serve");
    })
}

/// The gateway leasing from the discovery API at `discovery`, on its own runtime of `workers` threads: a request
/// with a session goes through that session's lease, taken on its first request and renewed while in use.
fn leasing_gateway(discovery: SocketAddr, workers: usize, limits: GatewayLimits) -> SocketAddr {
    on_own_runtime(workers, move |listener| async move {
        let router = LeaseRouter::start(LeaseRouterConfig::new(format!("http://{discovery}"))).expect("the router");
        let gateway = Gateway::new(router, Arc::new(StaticTokens::new().with(TOKEN, "bench")), limits);
        gateway.serve(listener, std::future::pending()).await.expect("serve");
    })
}

/// A bare TCP relay in front of `squid`, on a runtime of `workers` threads: each connection is copied both ways to a
/// connection of its own to Squid, nothing read or decided.
fn bare_relay(squid: SocketAddr, workers: usize) -> SocketAddr {
    on_own_runtime(workers, move |listener| async move {
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else { continue };
            tokio::spawn(async move {
                let _ = inbound.set_nodelay(true);
                let Ok(mut outbound) = TcpStream::connect(squid).await else { return };
                let _ = outbound.set_nodelay(true);
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
        }
    })
}

fn authorization() -> String {
    authorization_as("session-bench")
}

/// `Proxy-Authorization` for `user` with the bench's token.
fn authorization_as(user: &str) -> String {
    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{user}:{TOKEN}")))
}

/// One client sending absolute-form requests through `proxy` on one keep-alive connection until the deadline.
async fn plain_client(proxy: SocketAddr, origin: SocketAddr, deadline: Instant, user: String) -> Vec<Duration> {
    let stream = TcpStream::connect(proxy).await.expect("connect to the proxy");
    let _ = stream.set_nodelay(true);
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
    tokio::spawn(connection);
    let url = format!("http://{origin}/");
    let auth = authorization_as(&user);
    let mut latencies = Vec::new();
    while Instant::now() < deadline {
        let started = Instant::now();
        let request = hyper::Request::get(url.as_str())
            .header("host", origin.to_string())
            .header("proxy-authorization", auth.as_str())
            .body(Empty::<Bytes>::new())
            .expect("request");
        let response = sender.send_request(request).await.expect("an answer");
        assert_eq!(response.status(), 200, "through {proxy}");
        let _ = response.into_body().collect().await.expect("body");
        latencies.push(started.elapsed());
    }
    latencies
}

/// Opens a tunnel to `origin` through `proxy`.
async fn tunnel(proxy: SocketAddr, origin: SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(proxy).await.expect("connect to the proxy");
    let _ = stream.set_nodelay(true);
    let head =
        format!("CONNECT {origin} HTTP/1.1\r\nHost: {origin}\r\nProxy-Authorization: {}\r\n\r\n", authorization());
    stream.write_all(head.as_bytes()).await.expect("CONNECT");
    let mut answer = Vec::new();
    let mut byte = [0_u8; 1];
    while !answer.ends_with(b"\r\n\r\n") {
        assert_eq!(stream.read(&mut byte).await.expect("the answer"), 1, "the proxy closed the tunnel");
        answer.push(byte[0]);
    }
    assert!(
        answer.starts_with(b"HTTP/1.1 200") || answer.starts_with(b"HTTP/1.0 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    stream
}

/// One client sending requests inside one tunnel until the deadline.
async fn tunnel_client(proxy: SocketAddr, origin: SocketAddr, deadline: Instant) -> Vec<Duration> {
    let stream = tunnel(proxy, origin).await;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
    tokio::spawn(connection);
    let mut latencies = Vec::new();
    while Instant::now() < deadline {
        let started = Instant::now();
        let request =
            hyper::Request::get("/").header("host", origin.to_string()).body(Empty::<Bytes>::new()).expect("request");
        let response = sender.send_request(request).await.expect("an answer");
        let _ = response.into_body().collect().await.expect("body");
        latencies.push(started.elapsed());
    }
    latencies
}

#[derive(Clone, Copy, Debug)]
struct Figures {
    rate: f64,
    p50: Duration,
    p99: Duration,
}

async fn phase(name: &str, proxy: SocketAddr, origin: SocketAddr, connect: bool) -> Figures {
    let deadline = Instant::now() + PHASE;
    let started = Instant::now();
    let handles: Vec<_> = (0..CLIENTS)
        .map(|client| {
            if connect {
                tokio::spawn(tunnel_client(proxy, origin, deadline))
            } else {
                // A session of its own per client: through the leasing gateway, 64 sessions and their leases.
                tokio::spawn(plain_client(proxy, origin, deadline, format!("session-bench{client}")))
            }
        })
        .collect();
    let mut latencies = Vec::new();
    for handle in handles {
        latencies.extend(handle.await.expect("client"));
    }
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort_unstable();
    let percentile = |p: f64| latencies[((latencies.len() as f64 * p) as usize).min(latencies.len() - 1)];
    let figures = Figures { rate: latencies.len() as f64 / elapsed, p50: percentile(0.5), p99: percentile(0.99) };
    println!(
        "  {name:<22} {:>8.0} requests/s, p50 {:>8.2?}, p99 {:>8.2?} ({} requests)",
        figures.rate,
        figures.p50,
        figures.p99,
        latencies.len()
    );
    figures
}

/// Requests with a session (64 clients, one session each) through the gateway leasing from a discovery API whose
/// state is in memory, and from one whose state is shared on a real redis-server, against the gateway with a fixed
/// upstream (`fixed`): what a session costs, and what the shared state adds to it.
async fn sessions(squid: SocketAddr, origin: SocketAddr, fixed: SocketAddr, workers: usize, limits: GatewayLimits) {
    let redis = egress_testenv::redis::RedisServer::start(None).await.expect("redis-server");
    let shared =
        RedisLeaseState::connect(&RedisOptions::new(redis.url()), LeaseConfig::default(), LeaseKey::ephemeral())
            .await
            .expect("the shared state");
    let in_memory =
        leasing_gateway(discovery(squid, Arc::new(InMemoryLeaseStore::new(LeaseConfig::default()))), workers, limits);
    let on_redis = leasing_gateway(discovery(squid, Arc::new(shared)), workers, limits);
    println!("plain HTTP with a session per client, the gateway leasing from a discovery API:");
    let paths = [
        ("gateway, fixed upstream", fixed),
        ("sessions, in-memory", in_memory),
        ("sessions, shared (redis)", on_redis),
    ];
    let mut best: Vec<Option<Figures>> = vec![None; paths.len()];
    for _ in 0..2 {
        for (index, (name, proxy)) in paths.iter().enumerate() {
            let figures = phase(name, *proxy, origin, false).await;
            best[index] = Some(best[index].map_or(figures, |known| better(known, figures)));
        }
    }
    let [fixed, memory, redis_backed] = [best[0], best[1], best[2]].map(|figures| figures.expect("measured"));
    println!(
        "  ratios: sessions in-memory / fixed upstream {:.2}, shared / in-memory {:.2} (p50 {:.3} ms against {:.3} ms)",
        memory.rate / fixed.rate,
        redis_backed.rate / memory.rate,
        redis_backed.p50.as_secs_f64() * 1e3,
        memory.p50.as_secs_f64() * 1e3
    );
    drop(redis);
}

/// MB/s of one tunnel through `proxy` carrying the large body.
async fn tunnel_throughput(proxy: SocketAddr, origin: SocketAddr) -> f64 {
    let stream = tunnel(proxy, origin).await;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
    tokio::spawn(connection);
    let started = Instant::now();
    let request =
        hyper::Request::get("/large").header("host", origin.to_string()).body(Empty::<Bytes>::new()).expect("request");
    let mut body = sender.send_request(request).await.expect("an answer").into_body();
    let mut bytes = 0_u64;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("a frame").into_data() {
            bytes += data.len() as u64;
        }
    }
    assert_eq!(bytes, LARGE);
    bytes as f64 / started.elapsed().as_secs_f64() / 1e6
}

fn better(a: Figures, b: Figures) -> Figures {
    Figures { rate: a.rate.max(b.rate), p50: a.p50.min(b.p50), p99: a.p99.min(b.p99) }
}

/// How many idle tunnels the memory phase holds: as many as this machine allows, whose limit of 20,000 open files
/// per process (which root cannot raise here) leaves the gateway, with two sockets per tunnel, room for 9,000.
const IDLE_TUNNELS: usize = 9_000;

/// The environment variable that makes this binary the gateway of the memory phase, in front of the upstream it
/// names: it prints `listening <address>`, then answers each line on its input with `rss <bytes>`.
const IDLE_GATEWAY: &str = "BENCH_IDLE_GATEWAY_UPSTREAM";

/// A minimal upstream proxy on its own thread: answers every `CONNECT` with 200 and holds the connection, idle,
/// until the client closes it.
fn idle_upstream() -> SocketAddr {
    serve_on_own_thread(|mut stream| async move {
        let mut head = Vec::new();
        let mut byte = [0_u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if stream.read(&mut byte).await.unwrap_or(0) == 0 {
                return;
            }
            head.push(byte[0]);
        }
        if stream.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await.is_err() {
            return;
        }
        let _ = stream.read(&mut byte).await;
    })
}

/// This process's resident set, in bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|pages| pages.parse().ok()).expect("resident pages");
    pages * 4096
}

/// The memory phase's gateway process: a gateway (two worker threads, as in the throughput phases) in front of
/// `upstream`, reporting its own RSS on request.
fn idle_gateway(upstream: SocketAddr) {
    use std::io::BufRead;
    // One tenant holds every tunnel here.
    let limits = GatewayLimits {
        max_connections: IDLE_TUNNELS * 2,
        max_tenant_connections: IDLE_TUNNELS * 2,
        ..GatewayLimits::default()
    };
    println!("listening {}", gateway(upstream, 2, limits));
    for line in std::io::stdin().lock().lines() {
        if line.is_err() {
            return;
        }
        println!("rss {}", rss());
    }
}

/// Opens `IDLE_TUNNELS` tunnels through a gateway process of its own to an idle upstream in this one, and prints
/// the gateway's RSS growth per tunnel.
async fn idle_tunnel_memory() {
    use std::io::{BufRead, Write};
    let upstream = idle_upstream();
    let mut child = std::process::Command::new(std::env::current_exe().expect("this binary"))
        .env(IDLE_GATEWAY, upstream.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("the gateway process");
    let mut input = child.stdin.take().expect("its input");
    let mut output = std::io::BufReader::new(child.stdout.take().expect("its output")).lines();
    let mut next = move || output.next().and_then(Result::ok).unwrap_or_default();
    let proxy: SocketAddr =
        next().strip_prefix("listening ").and_then(|address| address.parse().ok()).expect("address");
    let mut gateway_rss = move || -> u64 {
        writeln!(input, "rss").expect("ask");
        next().strip_prefix("rss ").and_then(|bytes| bytes.parse().ok()).expect("an RSS")
    };
    // Idle, but warm: one tunnel opened and closed first.
    drop(tunnel(proxy, upstream).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle = gateway_rss();
    let mut held = Vec::with_capacity(IDLE_TUNNELS);
    while held.len() < IDLE_TUNNELS {
        let batch = (IDLE_TUNNELS - held.len()).min(256);
        let opening: Vec<_> = (0..batch).map(|_| tokio::spawn(tunnel(proxy, upstream))).collect();
        for handle in opening {
            held.push(handle.await.expect("a tunnel"));
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let loaded = gateway_rss();
    let per_tunnel = loaded.saturating_sub(idle) as f64 / IDLE_TUNNELS as f64 / 1024.0;
    println!(
        "{IDLE_TUNNELS} idle tunnels: gateway RSS {:.1} MiB idle, {:.1} MiB with them open: {per_tunnel:.1} KiB per \
         tunnel (goal <= 16)",
        idle as f64 / 1048576.0,
        loaded as f64 / 1048576.0
    );
    drop(held);
    let _ = child.kill();
    let _ = child.wait();
}

/// `BENCH_SQUID_CPUS` (a `taskset -c` list): Squid's CPUs, and this process's threads moved to the others, so Squid
/// (single-threaded, the baseline's bottleneck) has a core of its own as it would on a machine with cores to spare.
/// Returns (Squid's CPUs, this process's CPUs).
fn pinning() -> Option<(String, String)> {
    let squid = std::env::var("BENCH_SQUID_CPUS").ok().filter(|cpus| !cpus.is_empty())?;
    let all = std::thread::available_parallelism().map_or(1, usize::from);
    let taken: Vec<usize> = squid
        .split(',')
        .flat_map(|part| {
            let (first, last) = part.split_once('-').unwrap_or((part, part));
            let bound = |text: &str| text.trim().parse::<usize>().expect("BENCH_SQUID_CPUS is a CPU list, such as 0");
            bound(first)..=bound(last)
        })
        .collect();
    let rest: Vec<String> = (0..all).filter(|cpu| !taken.contains(cpu)).map(|cpu| cpu.to_string()).collect();
    assert!(!rest.is_empty(), "BENCH_SQUID_CPUS={squid} leaves no CPU of the {all} for the clients and the gateway");
    let rest = rest.join(",");
    let status = std::process::Command::new("taskset")
        .args(["-a", "-p", "-c", &rest, &std::process::id().to_string()])
        .stdout(std::process::Stdio::null())
        .status()
        .expect("taskset runs");
    assert!(status.success(), "taskset could not move this process to CPUs {rest}");
    Some((squid, rest))
}

fn main() {
    if let Some(upstream) = std::env::var(IDLE_GATEWAY).ok().and_then(|address| address.parse().ok()) {
        idle_gateway(upstream);
        return;
    }
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("the runtime");
    runtime.block_on(async {
        throughput().await;
        idle_tunnel_memory().await;
    });
}

/// The throughput and latency phases.
async fn throughput() {
    let origin = origin();
    let cpus = pinning();
    let squid = Squid::start(SquidOptions { cpus: cpus.clone().map(|(squid, _)| squid), ..SquidOptions::default() })
        .await
        .expect("Squid");
    let chained = Squid::start(SquidOptions {
        parent: Some(squid.address()),
        cpus: cpus.clone().map(|(squid, _)| squid),
        ..SquidOptions::default()
    })
    .await
    .expect("the chained Squid");
    let setting =
        |name: &str, default: usize| std::env::var(name).ok().and_then(|value| value.parse().ok()).unwrap_or(default);
    let (workers, buffer) =
        (setting("BENCH_GATEWAY_WORKERS", 2), setting("BENCH_TUNNEL_BUFFER", Buffers::default().large));
    let limits =
        GatewayLimits { tunnel_buffers: Buffers { large: buffer, ..Buffers::default() }, ..GatewayLimits::default() };
    let gateway = gateway(squid.address(), workers, limits);
    let relay = bare_relay(squid.address(), workers);
    println!(
        "gateway benchmark: {CLIENTS} keep-alive clients, a 1 KiB page from a local origin, {PHASE:?} per phase, twice; \
         the gateway on {workers} worker thread(s), tunnel buffers up to {buffer} bytes{}",
        cpus.map(|(squid, rest)| format!("; Squid on CPU {squid}, clients, origin and gateway on CPU {rest}"))
            .unwrap_or_default()
    );
    let paths = [
        ("direct Squid", squid.address()),
        ("Squid -> Squid", chained.address()),
        ("gateway -> Squid", gateway),
        ("bare relay -> Squid", relay),
    ];
    for connect in [false, true] {
        println!("{}:", if connect { "CONNECT tunnels (requests inside)" } else { "plain HTTP (absolute-form)" });
        let mut best: Vec<Option<Figures>> = vec![None; paths.len()];
        for _ in 0..2 {
            for (index, (name, proxy)) in paths.iter().enumerate() {
                let figures = phase(name, *proxy, origin, connect).await;
                best[index] = Some(best[index].map_or(figures, |known| better(known, figures)));
            }
        }
        let [direct, chain, through, bare] =
            [best[0], best[1], best[2], best[3]].map(|figures| figures.expect("measured"));
        println!(
            "  ratios: gateway / bare relay {:.2} (goal >= 0.95), gateway / chain {:.2} (goal >= 1); p50 added by the \
             gateway over the bare relay {:.3} ms (goal <= 0.3)",
            through.rate / bare.rate,
            through.rate / chain.rate,
            (through.p50.as_secs_f64() - bare.p50.as_secs_f64()) * 1e3
        );
        println!(
            "  the machine: bare relay / direct {:.2}, gateway / direct {:.2}, chain / direct {:.2} (what one \
             user-space hop costs on these cores, not the gateway's share)",
            bare.rate / direct.rate,
            through.rate / direct.rate,
            chain.rate / direct.rate
        );
    }
    sessions(squid.address(), origin, gateway, workers, limits).await;
    let (mut direct, mut through, mut bare) = (0.0_f64, 0.0_f64, 0.0_f64);
    for _ in 0..2 {
        direct = direct.max(tunnel_throughput(squid.address(), origin).await);
        through = through.max(tunnel_throughput(gateway, origin).await);
        bare = bare.max(tunnel_throughput(relay, origin).await);
    }
    println!(
        "one tunnel, {} MiB: direct Squid {direct:.0} MB/s, bare relay -> Squid {bare:.0} MB/s, gateway -> Squid \
         {through:.0} MB/s; gateway / bare relay {:.2} (goal >= 0.95), gateway / direct {:.2}",
        LARGE >> 20,
        through / bare,
        through / direct
    );
}
