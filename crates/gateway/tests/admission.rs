//! Clients that never show a valid token cannot take the gateway from those that do: connections without one are
//! capped per address and in all, a 407 closes its connection, and an address that sends wrong tokens is slowed
//! to one a second after a burst. The flooding clients connect from other loopback addresses (127.0.0.2 and up).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use egress_gateway::{Gateway, GatewayLimits, GatewayMetrics, StaticRouter, StaticTokens, Upstream};
use egress_testenv::{LocalOrigin, Squid, SquidOptions, through_proxy};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

const TOKEN: &str = "t0ken";

/// A gateway with `limits` in front of `squid`, serving, and its metrics.
async fn gateway(squid: &Squid, limits: GatewayLimits) -> (SocketAddr, Registry) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let mut registry = Registry::default();
    let metrics = GatewayMetrics::register(&mut registry);
    let gateway = Gateway::with_metrics(
        Arc::new(StaticRouter(Upstream::new(squid.address().to_string(), None, "crawl/squid-1"))),
        Arc::new(StaticTokens::new().with(TOKEN, "crawlers")),
        limits,
        metrics,
    );
    tokio::spawn(gateway.serve(listener, std::future::pending()));
    (address, registry)
}

/// A connection to `gateway` from the loopback address `source`.
async fn connect_from(source: &str, gateway: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    socket.bind(SocketAddr::new(source.parse::<IpAddr>().expect("address"), 0)).expect("bind the source");
    socket.connect(gateway).await.expect("connect")
}

/// Whether the gateway closed `stream` (without a word) within half a second.
async fn closed(stream: &mut TcpStream) -> bool {
    let mut byte = [0_u8; 1];
    match tokio::time::timeout(Duration::from_millis(500), stream.read(&mut byte)).await {
        Ok(Ok(0) | Err(_)) => true,
        Ok(Ok(_)) => panic!("the gateway said something to a client that sent nothing"),
        Err(_) => false,
    }
}

/// How many of `streams` the gateway holds open.
async fn held(streams: &mut [TcpStream]) -> usize {
    futures::future::join_all(streams.iter_mut().map(closed)).await.into_iter().filter(|closed| !closed).count()
}

/// Sends a plain GET of `url` with `password` (none: no credentials) from `source`; returns the answer's head and
/// whether the gateway then closed the connection.
async fn get_from(source: &str, gateway: SocketAddr, url: &str, password: Option<&str>) -> (String, bool) {
    use base64::Engine;
    let mut stream = connect_from(source, gateway).await;
    let mut request = format!("GET {url} HTTP/1.1\r\nHost: origin\r\n");
    if let Some(password) = password {
        let basic = base64::engine::general_purpose::STANDARD.encode(format!(":{password}"));
        request.push_str(&format!("Proxy-Authorization: Basic {basic}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut answer = Vec::new();
    let mut chunk = [0_u8; 4096];
    let closed = loop {
        match tokio::time::timeout(Duration::from_millis(500), stream.read(&mut chunk)).await {
            Ok(Ok(0) | Err(_)) => break true,
            Ok(Ok(read)) => answer.extend_from_slice(&chunk[..read]),
            Err(_) => break false,
        }
    };
    let text = String::from_utf8_lossy(&answer).into_owned();
    (text.split("\r\n\r\n").next().unwrap_or_default().to_owned(), closed)
}

fn metric(registry: &Registry, line: &str) -> bool {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).expect("encode");
    text.lines().any(|found| found == line)
}

#[tokio::test]
async fn connections_without_a_valid_token_are_capped_per_address_and_in_all() {
    let origin = LocalOrigin::start().await.expect("origin");
    let squid = Squid::start(SquidOptions::default()).await.expect("Squid");
    // Long enough a header timeout that none of the held connections times out while they are counted.
    let limits = GatewayLimits {
        max_unauthenticated_per_source: 20,
        max_unauthenticated: 50,
        header_timeout: Duration::from_secs(120),
        ..GatewayLimits::default()
    };
    let (gateway, registry) = gateway(&squid, limits).await;

    // One address holding connections that say nothing gets 20 of them; the rest are closed at once.
    let mut flood = Vec::new();
    for _ in 0..40 {
        flood.push(connect_from("127.0.0.2", gateway).await);
    }
    assert_eq!(held(&mut flood).await, 20, "the per-address cap");
    // Another client is served meanwhile, and its connection no longer counts once it showed its token.
    let answer = through_proxy(gateway, "GET", &origin.ip_url(), Some(("", TOKEN))).await.expect("an answer");
    assert_eq!(answer.status, 200, "{answer:?}");
    // Two more addresses: 20 from one, and from the other only what the total of 50 leaves (10).
    let mut more = Vec::new();
    for source in ["127.0.0.3", "127.0.0.4"] {
        for _ in 0..20 {
            more.push(connect_from(source, gateway).await);
        }
    }
    assert_eq!(held(&mut more).await, 30, "20 from 127.0.0.3, 10 from 127.0.0.4 up to the total");
    assert!(metric(&registry, r#"egress_gateway_refused_unauthenticated_connections_total{reason="per-source"} 20"#));
    assert!(metric(&registry, r#"egress_gateway_refused_unauthenticated_connections_total{reason="total"} 10"#));
    // The held ones leave when they go: the cap is free again.
    drop((flood, more));
    egress_testenv::eventually("the closed connections' places to come back", Duration::from_secs(5), || async {
        let (head, _) = get_from("127.0.0.4", gateway, &origin.ip_url(), Some(TOKEN)).await;
        head.starts_with("HTTP/1.1 200").then_some(())
    })
    .await;

    // A request without credentials is answered 407, and its connection closed.
    let (head, closed) = get_from("127.0.0.2", gateway, &origin.ip_url(), None).await;
    assert!(head.starts_with("HTTP/1.1 407"), "{head}");
    assert!(head.to_ascii_lowercase().contains("connection: close") && closed, "{head}");
}

#[tokio::test]
async fn an_address_sending_wrong_tokens_is_slowed_and_others_are_not() {
    let origin = LocalOrigin::start().await.expect("origin");
    let squid = Squid::start(SquidOptions::default()).await.expect("Squid");
    let (gateway, registry) = gateway(&squid, GatewayLimits::default()).await;
    let url = origin.ip_url();
    for attempt in 0..20 {
        let (head, closed) = get_from("127.0.0.5", gateway, &url, Some(&format!("guess-{attempt}"))).await;
        assert!(head.starts_with("HTTP/1.1 407") && closed, "attempt {attempt}: {head}");
    }
    // The burst is spent: the next one is not checked, not even when it is right.
    for password in ["guess-20", TOKEN] {
        let (head, closed) = get_from("127.0.0.5", gateway, &url, Some(password)).await;
        assert!(head.starts_with("HTTP/1.1 429") && closed, "{head}");
        let lower = head.to_ascii_lowercase();
        assert!(lower.contains("retry-after: 1") && lower.contains("too many wrong tokens"), "{head}");
    }
    assert!(metric(&registry, "egress_gateway_throttled_credentials_total 2"));
    // Another address is served, and this one is again a second later.
    let (head, _) = get_from("127.0.0.6", gateway, &url, Some(TOKEN)).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // A right token while throttled spends nothing: polling with it sees the address served once a second passed.
    egress_testenv::eventually("the address to be served again", Duration::from_secs(5), || async {
        let (head, _) = get_from("127.0.0.5", gateway, &url, Some(TOKEN)).await;
        head.starts_with("HTTP/1.1 200").then_some(())
    })
    .await;
    assert_eq!(origin.requests(), 2, "no refused request reached the origin");
}
