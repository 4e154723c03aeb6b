//! A local HTTP origin for requests sent through proxies, and a minimal proxy client.
//!
//! The origin answers every request with `200 ok` (or, at `/ip`, the caller's address as a bare IP, as IP-echo
//! services do; at `/logged`, noting when and from where; under `/site/`, a crawl target that refuses 8 % of requests, see [`crate::site`]) and counts what it
//! served, so a test can assert that probes stopped; it can be told to fail the
//! next requests with 503, and can serve HTTPS with a certificate from a [`TestCa`]. The client speaks just enough
//! HTTP/1.1 to send an absolute-form GET through a forward proxy and read the status code.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use base64::Engine;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

use crate::pki::TestCa;
use crate::site::CrawlSite;

/// The address plain origins listen on instead of 127.0.0.1, when set: one the pods of an external cluster can
/// reach (for kind, the gateway of its Docker network). `cargo xtask e2e --kind` sets it.
pub const ORIGIN_HOST_ENV: &str = "EGRESS_TEST_ORIGIN_HOST";

/// A running origin; dropping it stops it.
pub struct LocalOrigin {
    address: SocketAddr,
    requests: Arc<AtomicU64>,
    failures: Arc<AtomicU64>,
    site: Arc<CrawlSite>,
    https: bool,
    task: JoinHandle<()>,
}

impl LocalOrigin {
    /// Starts a plain HTTP origin on a free port of 127.0.0.1 (or of [`ORIGIN_HOST_ENV`]).
    pub async fn start() -> Result<Self> {
        Self::serve(None).await
    }

    /// Starts an HTTPS origin for `localhost` and 127.0.0.1, with a certificate issued by `ca`.
    pub async fn start_tls(ca: &TestCa) -> Result<Self> {
        let issued = ca.server_cert(&["localhost"], &[IpAddr::V4(Ipv4Addr::LOCALHOST)])?;
        let certs = CertificateDer::pem_slice_iter(issued.cert.as_bytes()).collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_slice(issued.key.as_bytes())?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(certs, key)?;
        Self::serve(Some(TlsAcceptor::from(Arc::new(config)))).await
    }

    async fn serve(tls: Option<TlsAcceptor>) -> Result<Self> {
        // TLS origins stay on loopback: their certificate names localhost and 127.0.0.1.
        let host = match std::env::var(ORIGIN_HOST_ENV) {
            Ok(host) if !host.is_empty() && tls.is_none() => {
                host.parse::<IpAddr>().with_context(|| format!("{ORIGIN_HOST_ENV}={host:?} is not an IP address"))?
            }
            _ => IpAddr::V4(Ipv4Addr::LOCALHOST),
        };
        let listener =
            TcpListener::bind((host, 0)).await.with_context(|| format!("binding the local origin on {host}"))?;
        let address = listener.local_addr()?;
        let requests = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(AtomicU64::new(0));
        let site = Arc::new(CrawlSite::default());
        let (counter, failing, crawled) = (requests.clone(), failures.clone(), site.clone());
        let https = tls.is_some();
        let task = tokio::spawn(async move {
            while let Ok((stream, peer)) = listener.accept().await {
                let (counter, failing, site, tls) = (counter.clone(), failing.clone(), crawled.clone(), tls.clone());
                tokio::spawn(async move {
                    let _ = match tls {
                        Some(tls) => match tls.accept(stream).await {
                            Ok(stream) => answer(stream, peer, &counter, &failing, &site).await,
                            Err(error) => Err(error.into()),
                        },
                        None => answer(stream, peer, &counter, &failing, &site).await,
                    };
                });
            }
        });
        Ok(Self { address, requests, failures, site, https, task })
    }

    /// `http://127.0.0.1:<port>/`, or for an HTTPS origin `https://localhost:<port>/` (the name its certificate
    /// carries).
    pub fn url(&self) -> String {
        if self.https {
            format!("https://localhost:{}/", self.address.port())
        } else {
            format!("http://{}/", self.address)
        }
    }

    /// The IP-echo URL: the body is the caller's address.
    pub fn ip_url(&self) -> String {
        format!("{}ip", self.url())
    }

    /// Answers the next `count` requests with 503.
    pub fn fail_next(&self, count: u64) {
        self.failures.store(count, Ordering::SeqCst);
    }

    /// Where it listens.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The providers file's destination rule that lets proxies reach this origin (and nothing else on its
    /// address): rendered proxies deny loopback and private addresses by default.
    pub fn allow_rule(&self) -> String {
        self.address.to_string()
    }

    /// A providers-file `destinations:` value (YAML flow style) allowing only this origin.
    pub fn destinations_yaml(&self) -> String {
        format!("{{ allow: [\"{}\"] }}", self.allow_rule())
    }

    /// A URL whose requests the origin notes with their time and caller ([`CrawlSite::arrivals`]), answered `ok`.
    pub fn logged_url(&self) -> String {
        format!("{}logged", self.url())
    }

    /// How many requests it has answered.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    /// The crawl target under `/site/`: its log.
    pub fn site(&self) -> &CrawlSite {
        &self.site
    }

    /// The crawl target's index URL.
    pub fn site_url(&self) -> String {
        format!("{}site/", self.url())
    }
}

impl Drop for LocalOrigin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    peer: SocketAddr,
    counter: &AtomicU64,
    failing: &AtomicU64,
    site: &CrawlSite,
) -> Result<()> {
    loop {
        let head = read_head(&mut stream).await?;
        counter.fetch_add(1, Ordering::SeqCst);
        let target = head.split_whitespace().nth(1).unwrap_or("/");
        // Through a proxy the request line carries the absolute URL: the path is what follows the authority.
        let path = match target.split_once("://") {
            Some((_, rest)) => rest.find('/').map_or("/", |at| &rest[at..]),
            None => target,
        };
        let (status, headers, body, kind) = if path.starts_with("/site/") {
            let (status, headers, body) = site.answer(path, peer.ip());
            (status, headers, body, "text/html")
        } else {
            let fail = failing.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(1)).is_ok();
            if path.starts_with("/logged") {
                site.arrive(peer.ip());
            }
            let body = if path.ends_with("/ip") { peer.ip().to_string() } else { "ok".to_owned() };
            (if fail { "503 Service Unavailable" } else { "200 OK" }, String::new(), body, "text/plain")
        };
        // Closed after each answer, unless the request asks to keep the connection (a test holding a tunnel).
        let keep = head.to_ascii_lowercase().contains(KEEP_ALIVE_HEADER);
        let response = format!(
            "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\n{headers}Content-Length: {}\r\nConnection: {}\r\n\r\n{body}",
            body.len(),
            if keep { "keep-alive" } else { "close" }
        );
        stream.write_all(response.as_bytes()).await?;
        if !keep {
            stream.shutdown().await?;
            return Ok(());
        }
    }
}

/// The request header (lower case, as a line) that keeps the origin's connection open after its answer.
pub const KEEP_ALIVE_HEADER: &str = "\r\nx-keep-alive: 1\r\n";

async fn read_head<S: AsyncRead + Unpin>(stream: &mut S) -> Result<String> {
    let mut buffer = Vec::with_capacity(1024);
    let mut chunk = [0_u8; 1024];
    while !buffer.windows(4).any(|window| window == b"\r\n\r\n") {
        let read = stream.read(&mut chunk).await?;
        if read == 0 || buffer.len() > 64 * 1024 {
            bail!("the request ended before its headers did");
        }
        buffer.extend_from_slice(&chunk[..read]);
    }
    Ok(String::from_utf8_lossy(&buffer).into_owned())
}

/// Sends `GET url` through the forward proxy at `proxy`, with basic credentials when given, and returns the HTTP
/// status code the proxy answered with.
pub async fn get_through_proxy(proxy: SocketAddr, url: &str, credentials: Option<(&str, &str)>) -> Result<u16> {
    Ok(through_proxy(proxy, "GET", url, credentials).await?.status)
}

/// What a forward proxy answered.
#[derive(Clone, Debug)]
pub struct ProxyAnswer {
    /// The status code.
    pub status: u16,
    /// The status line and headers, as sent.
    pub head: String,
    /// The body (empty for a CONNECT tunnel the proxy opened).
    pub body: String,
}

impl ProxyAnswer {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.trim().eq_ignore_ascii_case(name).then(|| value.trim())
        })
    }
}

/// Sends one request through the forward proxy at `proxy`: `GET http://...` (any method with an absolute URL), or
/// `CONNECT host:port`; with basic credentials when given. Reads the status line, headers and body (by
/// Content-Length, else to the end; nothing after a tunnel's 200).
pub async fn through_proxy(
    proxy: SocketAddr,
    method: &str,
    target: &str,
    credentials: Option<(&str, &str)>,
) -> Result<ProxyAnswer> {
    through_proxy_with(proxy, method, target, credentials, &[]).await
}

/// [`through_proxy`] with `headers` added to the request (for example a gateway's `X-Egress-Report`).
pub async fn through_proxy_with(
    proxy: SocketAddr,
    method: &str,
    target: &str,
    credentials: Option<(&str, &str)>,
    headers: &[(&str, &str)],
) -> Result<ProxyAnswer> {
    let exchange = async {
        let mut stream = TcpStream::connect(proxy).await.with_context(|| format!("connecting to the proxy {proxy}"))?;
        let host = match target.split_once("://") {
            Some((_, rest)) => rest.split('/').next().unwrap_or_default(),
            None => target,
        };
        let mut head = format!("{method} {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        let request = with_credentials(head, credentials);
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        let mut chunk = [0u8; 4096];
        let head_end = loop {
            if let Some(end) = response.windows(4).position(|window| window == b"\r\n\r\n") {
                break end + 4;
            }
            let read = stream.read(&mut chunk).await?;
            if read == 0 {
                bail!(
                    "the proxy closed the connection before its headers ended: {:?}",
                    String::from_utf8_lossy(&response)
                );
            }
            response.extend_from_slice(&chunk[..read]);
        };
        let head = String::from_utf8_lossy(&response[..head_end]).into_owned();
        let status = head.split_whitespace().nth(1).context("the proxy sent no status line")?;
        let status = status.parse::<u16>().with_context(|| format!("{status:?} is not a status code"))?;
        let mut answer = ProxyAnswer { status, head, body: String::new() };
        if method == "CONNECT" && status == 200 {
            return Ok(answer);
        }
        let mut body = response[head_end..].to_vec();
        match answer.header("content-length").and_then(|length| length.parse::<usize>().ok()) {
            Some(length) => {
                while body.len() < length {
                    let read = stream.read(&mut chunk).await?;
                    if read == 0 {
                        break;
                    }
                    body.extend_from_slice(&chunk[..read]);
                }
            }
            None => {
                stream.read_to_end(&mut body).await?;
            }
        }
        answer.body = String::from_utf8_lossy(&body).into_owned();
        Ok(answer)
    };
    tokio::time::timeout(Duration::from_secs(20), exchange).await.context("the request through the proxy timed out")?
}

/// Opens a `CONNECT` tunnel to `target` (`host:port`) through the forward proxy at `proxy`, with basic
/// `credentials` when given, and reads the answer's head byte by byte, so nothing after it is taken from the tunnel.
/// Returns the stream and the head when the proxy answered 200; an error with the head otherwise.
pub async fn open_tunnel(
    proxy: SocketAddr,
    target: &str,
    credentials: Option<(&str, &str)>,
) -> Result<(TcpStream, String)> {
    let exchange = async {
        let mut stream = TcpStream::connect(proxy).await.with_context(|| format!("connecting to the proxy {proxy}"))?;
        let request = with_credentials(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"), credentials);
        stream.write_all(request.as_bytes()).await?;
        let mut head = Vec::new();
        let mut byte = [0_u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if stream.read(&mut byte).await? == 0 {
                bail!("the proxy closed the tunnel before its answer: {:?}", String::from_utf8_lossy(&head));
            }
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head).into_owned();
        anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "CONNECT {target} through {proxy}: {head}");
        Ok((stream, head))
    };
    tokio::time::timeout(Duration::from_secs(20), exchange).await.context("the CONNECT through the proxy timed out")?
}

/// A request head ended: `head` (its request line and headers) with `Proxy-Authorization: Basic` for `credentials`
/// when given, and the blank line.
fn with_credentials(mut head: String, credentials: Option<(&str, &str)>) -> String {
    if let Some((user, password)) = credentials {
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        head.push_str(&format!("Proxy-Authorization: Basic {token}\r\n"));
    }
    head.push_str("\r\n");
    head
}
