//! The gateway in front of a real Squid: plain HTTP and CONNECT reach a local origin through it, and every way a
//! request can be refused is answered with its status and `Proxy-Status`.

use std::net::SocketAddr;
use std::sync::Arc;

use egress_gateway::{Gateway, GatewayLimits, GatewayMetrics, StaticRouter, StaticTokens, Upstream};
use egress_testenv::{LocalOrigin, Squid, SquidOptions, through_proxy};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const TOKEN: &str = "t0ken";

async fn gateway_to(upstream: Upstream) -> SocketAddr {
    gateway_counting(upstream, GatewayMetrics::default()).await
}

async fn gateway_counting(upstream: Upstream, metrics: GatewayMetrics) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let gateway = Gateway::with_metrics(
        Arc::new(StaticRouter(upstream)),
        Arc::new(StaticTokens::new().with(TOKEN, "crawlers")),
        GatewayLimits::default(),
        metrics,
    );
    tokio::spawn(gateway.serve(listener, std::future::pending()));
    address
}

#[tokio::test]
async fn plain_http_and_tunnels_reach_the_origin_through_squid() {
    let origin = LocalOrigin::start().await.expect("origin");
    let squid = Squid::start(SquidOptions::default()).await.expect("Squid");
    let mut registry = Registry::default();
    let metrics = GatewayMetrics::register(&mut registry);
    let gateway = gateway_counting(Upstream::new(squid.address().to_string(), None, "crawl/squid-1"), metrics).await;

    let answer = through_proxy(gateway, "GET", &origin.ip_url(), Some(("session-a", TOKEN))).await.expect("GET");
    assert_eq!(answer.status, 200, "{}", answer.head);
    assert_eq!(answer.header("x-egress-proxy"), Some("crawl/squid-1"));
    // The origin saw Squid's address, not the gateway's: the request went through the upstream.
    assert_eq!(answer.body, squid.address().ip().to_string());

    // A tunnel: CONNECT, then a request inside it.
    let target = origin.address();
    let (mut stream, head) = open_tunnel(gateway, target).await;
    // As the docs show it (regression: `200 OK`).
    assert!(head.starts_with("HTTP/1.1 200 Connection established\r\n"), "{head}");
    assert!(head.to_ascii_lowercase().contains("x-egress-proxy: crawl/squid-1"), "{head}");
    stream.write_all(format!("GET /ip HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes()).await.expect("GET inside");
    let mut rest = String::new();
    stream.read_to_string(&mut rest).await.expect("the origin's answer");
    assert!(rest.starts_with("HTTP/1.1 200"), "{rest}");
    assert!(rest.ends_with(&squid.address().ip().to_string()), "{rest}");
    drop(stream);

    // Counted per tenant: one plain answer, one tunnel, its bytes once it closed.
    let _ = through_proxy(gateway, "GET", &origin.url(), None).await.expect("a refusal");
    let text = egress_testenv::eventually("the tunnel is counted closed", std::time::Duration::from_secs(5), || {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        let closed = text.contains("egress_gateway_open_tunnels 0");
        async move { closed.then_some(text) }
    })
    .await;
    for line in [
        r#"egress_gateway_requests_total{tenant="crawlers",kind="plain",result="2xx"} 1"#,
        r#"egress_gateway_requests_total{tenant="crawlers",kind="connect",result="2xx"} 1"#,
        r#"egress_gateway_requests_total{tenant="",kind="plain",result="http_request_denied"} 1"#,
        // And per upstream proxy.
        r#"egress_gateway_proxy_requests_total{proxy="crawl/squid-1",kind="plain"} 1"#,
        r#"egress_gateway_proxy_requests_total{proxy="crawl/squid-1",kind="connect"} 1"#,
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
    for direction in ["up", "down"] {
        for series in [
            format!(r#"egress_gateway_tunnel_bytes_total{{tenant="crawlers",direction="{direction}"}}"#),
            format!(r#"egress_gateway_proxy_tunnel_bytes_total{{proxy="crawl/squid-1",direction="{direction}"}}"#),
        ] {
            let bytes = text
                .lines()
                .find(|line| line.starts_with(&series))
                .and_then(|line| line.rsplit(' ').next())
                .and_then(|value| value.parse::<u64>().ok());
            assert!(bytes.is_some_and(|bytes| bytes > 0), "{series} in\n{text}");
        }
    }
}

/// A client that sends its first bytes for the site with the CONNECT, before the gateway answered it (hyper reads
/// them with the head): they reach the site, and its answer comes back through the tunnel. The gateway takes the
/// client's TCP stream back from hyper for the tunnel, and what hyper had read must go with it.
#[tokio::test]
async fn bytes_sent_with_the_connect_head_go_through_the_tunnel_first() {
    let origin = LocalOrigin::start().await.expect("origin");
    let squid = Squid::start(SquidOptions::default()).await.expect("Squid");
    let metrics = GatewayMetrics::register(&mut Registry::default());
    let gateway = gateway_counting(Upstream::new(squid.address().to_string(), None, "crawl/squid-1"), metrics).await;
    let target = origin.address();
    let mut stream = tokio::net::TcpStream::connect(gateway).await.expect("connect");
    let auth = base64_basic("", TOKEN);
    let connect = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: {auth}\r\n\r\n");
    let inside = format!("GET /ip HTTP/1.1\r\nHost: {target}\r\n\r\n");
    stream.write_all(format!("{connect}{inside}").as_bytes()).await.expect("CONNECT and GET in one write");
    // The origin answers once and closes; bounded, so bytes that never reach it fail the test rather than hang it.
    let mut answer = String::new();
    tokio::time::timeout(std::time::Duration::from_secs(10), stream.read_to_string(&mut answer))
        .await
        .expect("the tunnel answered in time")
        .expect("read");
    let (tunnel, inside) = answer.split_once("\r\n\r\n").expect("the CONNECT's answer");
    assert!(tunnel.starts_with("HTTP/1.1 200 Connection established\r\n"), "{answer}");
    assert!(inside.starts_with("HTTP/1.1 200"), "the GET sent with the CONNECT: {answer}");
    assert!(inside.ends_with(&squid.address().ip().to_string()), "{answer}");
}

/// Opens a tunnel to `target` through the gateway at `gateway`; returns the stream and the answer's head.
async fn open_tunnel(gateway: SocketAddr, target: SocketAddr) -> (tokio::net::TcpStream, String) {
    open_tunnel_as(gateway, target, TOKEN).await
}

async fn open_tunnel_as(gateway: SocketAddr, target: SocketAddr, token: &str) -> (tokio::net::TcpStream, String) {
    let mut stream = tokio::net::TcpStream::connect(gateway).await.expect("connect");
    let auth = base64_basic("", token);
    stream
        .write_all(
            format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: {auth}\r\n\r\n").as_bytes(),
        )
        .await
        .expect("CONNECT");
    let head = read_head(&mut stream).await;
    (stream, head)
}

/// One request inside an open tunnel to the origin, kept alive; its answer's body.
async fn through_tunnel(stream: &mut tokio::net::TcpStream, target: SocketAddr) -> String {
    stream.write_all(format!("GET /ip HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes()).await.expect("GET inside");
    let head = read_head(stream).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let length: usize = head
        .lines()
        .find_map(|line| line.to_ascii_lowercase().strip_prefix("content-length:").map(|n| n.trim().parse().ok()))
        .flatten()
        .expect("a Content-Length");
    let mut body = vec![0; length];
    stream.read_exact(&mut body).await.expect("the body");
    String::from_utf8_lossy(&body).into_owned()
}

/// A gateway with `limits` in front of `squid` (not serving yet), and the listener it is to serve on.
async fn gateway_in_front_of(squid: &Squid, limits: GatewayLimits) -> (TcpListener, SocketAddr, Arc<Gateway>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let gateway = Gateway::new(
        Arc::new(StaticRouter(Upstream::new(squid.address().to_string(), None, "crawl/squid-1"))),
        Arc::new(StaticTokens::new().with(TOKEN, "crawlers").with(OTHER_TOKEN, "others")),
        limits,
    );
    (listener, address, gateway)
}

/// Another tenant's token.
const OTHER_TOKEN: &str = "0ther-t0ken";

/// One tenant cannot take every slot: past its cap its tunnels and requests are answered 429 (a quota, with
/// Retry-After), another tenant's are not, and a tunnel closed gives its slot back.
#[tokio::test]
async fn each_tenant_has_a_cap_on_its_tunnels_and_requests() {
    let origin = LocalOrigin::start().await.expect("origin");
    let squid = Squid::start(SquidOptions::default()).await.expect("Squid");
    let limits = GatewayLimits { max_tenant_connections: 2, ..GatewayLimits::default() };
    let (listener, address, gateway) = gateway_in_front_of(&squid, limits).await;
    tokio::spawn(gateway.serve(listener, std::future::pending()));
    let (first, head) = open_tunnel(address, origin.address()).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let (_second, head) = open_tunnel(address, origin.address()).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let (_third, head) = open_tunnel(address, origin.address()).await;
    assert!(head.starts_with("HTTP/1.1 429"), "{head}");
    let lower = head.to_ascii_lowercase();
    assert!(lower.contains("retry-after: 1") && lower.contains("error=http_request_denied"), "{head}");
    assert!(head.contains("--max-tenant-connections"), "{head}");
    let plain = through_proxy(address, "GET", &origin.ip_url(), Some(("", TOKEN))).await.expect("an answer");
    assert_eq!(plain.status, 429, "a plain request counts too");
    let requests = origin.requests();
    // Another tenant is not held up by this one.
    let (_theirs, head) = open_tunnel_as(address, origin.address(), OTHER_TOKEN).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(origin.requests(), requests, "the refused requests reached nothing");
    // A closed tunnel gives its slot back.
    drop(first);
    egress_testenv::eventually("a closed tunnel's slot to come back", std::time::Duration::from_secs(5), || async {
        let (_tunnel, head) = open_tunnel(address, origin.address()).await;
        head.starts_with("HTTP/1.1 200").then_some(())
    })
    .await;
}

/// Client connections and tunnels share the cap: a tunnel keeps its slot after its connection is upgraded.
#[tokio::test]
async fn tunnels_count_against_the_connection_cap() {
    let origin = LocalOrigin::start().await.expect("origin");
    let squid = Squid::start(SquidOptions::default()).await.expect("Squid");
    let (listener, address, gateway) =
        gateway_in_front_of(&squid, GatewayLimits { max_connections: 3, ..GatewayLimits::default() }).await;
    tokio::spawn(gateway.clone().serve(listener, std::future::pending()));
    let (mut first, head) = open_tunnel(address, origin.address()).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let (_second, head) = open_tunnel(address, origin.address()).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    egress_testenv::eventually("two tunnels hold two slots", std::time::Duration::from_secs(5), || {
        let open = gateway.open();
        async move { (open == 2).then_some(()) }
    })
    .await;
    // The third connection takes the last slot, so its CONNECT finds none for the tunnel.
    let (_third, head) = open_tunnel(address, origin.address()).await;
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    assert!(head.to_ascii_lowercase().contains("proxy-status: egress-gateway; error=proxy_internal_error"), "{head}");
    // The tunnels still carry.
    assert_eq!(through_tunnel(&mut first, origin.address()).await, squid.address().ip().to_string());
}

/// Stopping: no new connection is taken, an idle kept-alive connection is closed, a tunnel carries on until its
/// client closes it, and the drain waits for it.
#[tokio::test]
async fn a_stopping_gateway_closes_idle_connections_and_drains_tunnels() {
    let origin = LocalOrigin::start().await.expect("origin");
    let squid = Squid::start(SquidOptions::default()).await.expect("Squid");
    let (listener, address, gateway) = gateway_in_front_of(&squid, GatewayLimits::default()).await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(gateway.clone().serve(listener, async move {
        let _ = stopped.await;
    }));
    let (mut tunnel, head) = open_tunnel(address, origin.address()).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // A kept-alive plain connection, idle after one answer.
    let mut idle = tokio::net::TcpStream::connect(address).await.expect("connect");
    let auth = base64_basic("", TOKEN);
    let url = origin.ip_url();
    idle.write_all(format!("GET {url} HTTP/1.1\r\nHost: x\r\nProxy-Authorization: {auth}\r\n\r\n").as_bytes())
        .await
        .expect("GET");
    let head = read_head(&mut idle).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");

    stop.send(()).expect("stop");
    serving.await.expect("serve").expect("served");
    assert!(tokio::net::TcpStream::connect(address).await.is_err(), "no new connection after the stop");
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(std::time::Duration::from_secs(5), idle.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the idle kept-alive connection is closed by the gateway");
    assert_eq!(gateway.drain(std::time::Duration::from_millis(300)).await, 1, "the tunnel is still open");
    assert_eq!(through_tunnel(&mut tunnel, origin.address()).await, squid.address().ip().to_string());
    drop(tunnel);
    assert_eq!(gateway.drain(std::time::Duration::from_secs(5)).await, 0, "drained once the tunnel closed");
}

#[tokio::test]
async fn refusals_carry_their_status_and_proxy_status() {
    let origin = LocalOrigin::start().await.expect("origin");
    let squid = Squid::start(SquidOptions { deny_connect: true, ..SquidOptions::default() }).await.expect("Squid");
    let gateway = gateway_to(Upstream::new(squid.address().to_string(), None, "crawl/squid-1")).await;
    // Nothing listens on the discard port of this loopback address.
    let nowhere = gateway_to(Upstream::new("127.0.0.1:9", None, "crawl/gone")).await;
    let url = origin.url();
    let (plain, connect) = ("GET", "CONNECT");
    let target = origin.address().to_string();
    let long_session = format!("session-{}", "s".repeat(129));
    let cases = [
        Case {
            name: "no credentials",
            proxy: gateway,
            method: plain,
            target: &url,
            credentials: None,
            status: 407,
            kind: "http_request_denied",
        },
        Case {
            name: "wrong token",
            proxy: gateway,
            method: plain,
            target: &url,
            credentials: Some(("", "guess")),
            status: 407,
            kind: "http_request_denied",
        },
        Case {
            name: "unknown option",
            proxy: gateway,
            method: plain,
            target: &url,
            credentials: Some(("city-berlin", TOKEN)),
            status: 400,
            kind: "http_request_error",
        },
        Case {
            name: "https in absolute form",
            proxy: gateway,
            method: plain,
            target: "https://example.com/",
            credentials: Some(("", TOKEN)),
            status: 400,
            kind: "http_request_error",
        },
        Case {
            name: "CONNECT without a port",
            proxy: gateway,
            method: connect,
            target: "example.com",
            credentials: Some(("", TOKEN)),
            status: 400,
            kind: "http_request_error",
        },
        Case {
            name: "CONNECT the upstream refuses",
            proxy: gateway,
            method: connect,
            target: &target,
            credentials: Some(("", TOKEN)),
            status: 403,
            kind: "destination_ip_prohibited",
        },
        Case {
            name: "upstream down, plain",
            proxy: nowhere,
            method: plain,
            target: &url,
            credentials: Some(("", TOKEN)),
            status: 502,
            kind: "connection_refused",
        },
        Case {
            name: "upstream down, CONNECT",
            proxy: nowhere,
            method: connect,
            target: &target,
            credentials: Some(("", TOKEN)),
            status: 502,
            kind: "connection_refused",
        },
    ];
    for Case { name, proxy, method, target, credentials, status, kind } in cases {
        let answer =
            through_proxy(proxy, method, target, credentials).await.unwrap_or_else(|error| panic!("{name}: {error:#}"));
        assert_eq!(answer.status, status, "{name}: {}", answer.head);
        let proxy_status =
            answer.header("proxy-status").unwrap_or_else(|| panic!("{name}: no Proxy-Status in {}", answer.head));
        assert!(
            proxy_status.starts_with(&format!("egress-gateway; error={kind}; details=\"")),
            "{name}: {proxy_status}"
        );
        if status == 407 {
            assert!(answer.header("proxy-authenticate").is_some_and(|value| value.starts_with("Basic")), "{name}");
        }
        assert!(answer.body.contains("\"status\""), "{name}: a problem document, got {:?}", answer.body);
    }
    // More malformed requests and user names, each refused by the gateway itself.
    let more = [
        ("origin-form request", "GET", "/", "", 400, "http_request_error"),
        ("ftp URL", "GET", "ftp://example.com/file", "", 400, "http_request_error"),
        ("port 0", "GET", "http://example.com:0/", "", 400, "http_request_error"),
        ("CONNECT to port 0", "CONNECT", "example.com:0", "", 400, "http_request_error"),
        ("CONNECT with a URL", "CONNECT", "http://example.com:443/", "", 400, "http_request_error"),
        ("an upper-case pool", "GET", url.as_str(), "pool-EU", 400, "http_request_error"),
        ("sticky without a session", "GET", url.as_str(), "sticky-60", 400, "http_request_error"),
        ("a label without a value", "GET", url.as_str(), "label-tier", 400, "http_request_error"),
        ("an option without a dash", "GET", url.as_str(), "session", 400, "http_request_error"),
        ("a trailing comma", "GET", url.as_str(), "session-a,", 400, "http_request_error"),
        ("a session given twice", "CONNECT", target.as_str(), "session-a,session-b", 400, "http_request_error"),
        ("a session with a slash", "GET", url.as_str(), "session-a/b", 400, "http_request_error"),
        ("a session of 129 characters", "GET", url.as_str(), &long_session, 400, "http_request_error"),
        ("sticky 0", "GET", url.as_str(), "session-a,sticky-0", 400, "http_request_error"),
        ("sticky over a day", "GET", url.as_str(), "session-a,sticky-86401", 400, "http_request_error"),
        ("sticky not a number", "GET", url.as_str(), "session-a,sticky-1m", 400, "http_request_error"),
        ("a pool of three parts", "GET", url.as_str(), "pool-a.b.c", 400, "http_request_error"),
        ("a zone that is no label value", "GET", url.as_str(), "zone-eu west", 400, "http_request_error"),
        ("a zone given twice", "GET", url.as_str(), "zone-a,zone-b", 400, "http_request_error"),
        ("a label without a key", "GET", url.as_str(), "label-=x", 400, "http_request_error"),
        ("an empty option", "GET", url.as_str(), "session-a,,pool-p", 400, "http_request_error"),
        ("an option with an empty value", "GET", url.as_str(), "session-", 400, "http_request_error"),
        ("an empty host", "GET", "http://:80/", "", 400, "http_request_error"),
    ];
    for (name, method, target, user, status, kind) in more {
        let answer = through_proxy(gateway, method, target, Some((user, TOKEN)))
            .await
            .unwrap_or_else(|error| panic!("{name}: {error:#}"));
        assert_eq!(answer.status, status, "{name}: {}", answer.head);
        let proxy_status =
            answer.header("proxy-status").unwrap_or_else(|| panic!("{name}: no Proxy-Status in {}", answer.head));
        assert!(proxy_status.contains(&format!("error={kind}")), "{name}: {proxy_status}");
    }
    // Credentials that are not Basic user:password.
    for (name, authorization) in [
        ("a Bearer token", "Bearer t0ken".to_owned()),
        ("Basic that is not base64", "Basic !!!".to_owned()),
        ("Basic without a colon", format!("Basic {}", base64_encode(TOKEN))),
    ] {
        let mut stream = tokio::net::TcpStream::connect(gateway).await.expect("connect");
        stream
            .write_all(
                format!("GET {url} HTTP/1.1\r\nHost: x\r\nProxy-Authorization: {authorization}\r\n\r\n").as_bytes(),
            )
            .await
            .expect("request");
        let head = read_head(&mut stream).await;
        assert!(head.starts_with("HTTP/1.1 407"), "{name}: {head}");
        assert!(
            head.to_ascii_lowercase().contains("proxy-status: egress-gateway; error=http_request_denied"),
            "{name}"
        );
    }
    assert_eq!(origin.requests(), 0, "no refused request reached the origin");
}

fn base64_encode(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// One refused request and what the gateway must answer.
struct Case<'a> {
    name: &'a str,
    proxy: SocketAddr,
    method: &'a str,
    target: &'a str,
    credentials: Option<(&'a str, &'a str)>,
    status: u16,
    kind: &'a str,
}

fn base64_basic(user: &str, password: &str) -> String {
    use base64::Engine;
    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}")))
}

async fn read_head(stream: &mut tokio::net::TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0_u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(stream.read(&mut byte).await.expect("read"), 1, "closed before the head ended");
        head.push(byte[0]);
    }
    String::from_utf8_lossy(&head).into_owned()
}
