//! Request heads hyper cannot parse are answered by hyper itself, without calling the gateway: those answers carry
//! the gateway's `Proxy-Status` too, on a connection's first request and after a served one; and a tunnel's bytes
//! pass unchanged even when they look like such an answer.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use egress_gateway::{Gateway, GatewayLimits, StaticRouter, StaticTokens, Upstream};
use egress_testenv::{LocalOrigin, Squid, SquidOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const TOKEN: &str = "t0ken";

/// hyper's largest request head (`DEFAULT_MAX_BUFFER_SIZE`: 8 KiB and 100 times 4 KiB).
const MAX_HEAD: usize = 8192 + 4096 * 100;

/// What hyper answers a head it cannot parse, as a site could send it inside a tunnel.
const HYPERS_ANSWER: &[u8] =
    b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\ndate: Mon, 07 Dec 2026 05:00:00 GMT\r\n\r\n";

async fn gateway(squid: &Squid) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let gateway = Gateway::new(
        Arc::new(StaticRouter(Upstream::new(squid.address().to_string(), None, "crawl/squid-1"))),
        Arc::new(StaticTokens::new().with(TOKEN, "crawlers")),
        GatewayLimits::default(),
    );
    tokio::spawn(gateway.serve(listener, std::future::pending()));
    address
}

fn authorization() -> String {
    use base64::Engine;
    format!("Proxy-Authorization: Basic {}\r\n", base64::engine::general_purpose::STANDARD.encode(format!(":{TOKEN}")))
}

/// Reads one answer's head (up to the blank line) and the body its `content-length` gives.
async fn answer(stream: &mut TcpStream) -> String {
    let mut received = Vec::new();
    let mut byte = [0_u8; 1];
    while !received.ends_with(b"\r\n\r\n") {
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut byte)).await.expect("an answer");
        if read.expect("read") == 0 {
            break;
        }
        received.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&received).into_owned();
    let length = head
        .lines()
        .find_map(|line| line.to_ascii_lowercase().strip_prefix("content-length:").map(|value| value.trim().to_owned()))
        .and_then(|value| value.parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0_u8; length];
    stream.read_exact(&mut body).await.expect("the body");
    head
}

#[tokio::test]
async fn heads_hyper_cannot_parse_are_answered_with_proxy_status_and_tunnels_pass_untouched() {
    let origin = LocalOrigin::start().await.expect("origin");
    let squid = Squid::start(SquidOptions::default()).await.expect("Squid");
    let gateway = gateway(&squid).await;
    let prefix = "GET http://example.com/ HTTP/1.1\r\nX-Long: ";
    let too_large = format!("{prefix}{}", "a".repeat(MAX_HEAD - prefix.len()));
    let cases: [(&str, String, &str); 6] = [
        ("a header line without a colon", "GET http://example.com/ HTTP/1.1\r\nNo colon\r\n\r\n".into(), "400"),
        ("a method with a bad character", "G(T http://example.com/ HTTP/1.1\r\n\r\n".into(), "400"),
        ("an unknown version", "GET http://example.com/ HTTP/2.5\r\n\r\n".into(), "400"),
        ("a space in the target", "GET http://example.com/a b HTTP/1.1\r\n\r\n".into(), "400"),
        ("a control character in a header", "GET http://example.com/ HTTP/1.1\r\nX: a\u{1}b\r\n\r\n".into(), "400"),
        ("a head larger than the gateway reads", too_large, "431"),
    ];
    for (name, request, status) in &cases {
        let mut stream = TcpStream::connect(gateway).await.expect("connect");
        stream.write_all(request.as_bytes()).await.expect("send");
        let head = answer(&mut stream).await;
        println!("{name}: {}", head.lines().take(2).collect::<Vec<_>>().join(" | "));
        assert!(head.starts_with(&format!("HTTP/1.1 {status} ")), "{name}: {head}");
        assert!(
            head.contains("\r\nproxy-status: egress-gateway; error=http_request_error; details=\""),
            "{name}: no Proxy-Status in {head}"
        );
    }

    // After a request the gateway served on the same connection.
    let mut stream = TcpStream::connect(gateway).await.expect("connect");
    let url = origin.ip_url();
    stream
        .write_all(format!("GET {url} HTTP/1.1\r\nHost: origin\r\n{}\r\n", authorization()).as_bytes())
        .await
        .expect("GET");
    let served = answer(&mut stream).await;
    assert!(served.starts_with("HTTP/1.1 200 "), "{served}");
    stream.write_all(b"GET http://example.com/ HTTP/1.1\r\nNo colon\r\n\r\n").await.expect("send");
    let head = answer(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 400 ") && head.contains("\r\nproxy-status: egress-gateway;"), "{head}");

    // A site that sends, inside a tunnel, exactly what hyper answers: the client gets those bytes as they were.
    let site = TcpListener::bind("127.0.0.1:0").await.expect("a site");
    let site_address = site.local_addr().expect("its address");
    tokio::spawn(async move {
        if let Ok((mut stream, _)) = site.accept().await {
            let _ = stream.write_all(HYPERS_ANSWER).await;
            let _ = stream.shutdown().await;
        }
    });
    let mut stream = TcpStream::connect(gateway).await.expect("connect");
    let connect = format!("CONNECT {site_address} HTTP/1.1\r\nHost: {site_address}\r\n{}\r\n", authorization());
    stream.write_all(connect.as_bytes()).await.expect("CONNECT");
    let head = answer(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    let mut carried = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut carried)).await.expect("the tunnel").ok();
    assert_eq!(
        String::from_utf8_lossy(&carried),
        String::from_utf8_lossy(HYPERS_ANSWER),
        "the site's bytes, untouched"
    );
}
