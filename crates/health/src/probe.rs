//! One probe: a real request through the proxy, with every way of failing told apart.
//!
//! `http://` probe URLs are fetched with an absolute-form `GET` through the proxy; `https://` ones with `CONNECT`,
//! then TLS to the origin through the tunnel, then `GET`. The whole probe is bounded by the timeout: a TCP connect
//! that does not finish in time is a connect timeout, anything later that does not is an overall timeout.

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use egress_fleet::ProxyCredentials;
use http::{Method, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// The most of a probe response body that is read (an IP echo is a few bytes; anything longer is not one).
const BODY_LIMIT: usize = 4096;

/// The User-Agent of every probe, so origins and proxy logs can tell probes from crawler traffic.
pub const USER_AGENT: &str = concat!("egress-operator-health/", env!("CARGO_PKG_VERSION"));

/// Why a probe failed. Each variant has a stable [`FailureReason::kind`] for metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FailureReason {
    /// Nothing listens at the proxy's address.
    ConnectRefused,
    /// The TCP connection to the proxy did not complete within the timeout.
    ConnectTimeout,
    /// The TCP connection to the proxy failed otherwise (unreachable, reset, bad address).
    ConnectFailed(String),
    /// The proxy wants credentials, or refused the ones sent (407).
    ProxyAuthRequired,
    /// The proxy answered `CONNECT` with this status instead of 200.
    ConnectStatus(u16),
    /// The proxy's destination policy refused the probe URL (403 with `X-Egress-Policy`, naming the class).
    DestinationDenied(String),
    /// The TLS handshake with the origin through the tunnel failed.
    Tls(String),
    /// The origin (or the proxy on its behalf) answered with this non-2xx status.
    OriginStatus(u16),
    /// The probe did not finish within the timeout after connecting.
    Timeout,
    /// The proxy or origin spoke something that is not HTTP, or closed the connection early.
    Protocol(String),
}

impl FailureReason {
    /// Whether the failure says the proxy itself does not work: nothing listens, the connection cannot be made,
    /// or the proxy never answers or answers garbage. Refusals with a status (credentials, its destination
    /// policy, the origin's answer) and TLS to the origin are not the proxy being dead.
    pub fn means_dead(&self) -> bool {
        matches!(
            self,
            Self::ConnectRefused | Self::ConnectTimeout | Self::ConnectFailed(_) | Self::Timeout | Self::Protocol(_)
        )
    }

    /// A stable short string, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::ConnectRefused => "connect_refused",
            Self::ConnectTimeout => "connect_timeout",
            Self::ConnectFailed(_) => "connect_failed",
            Self::ProxyAuthRequired => "proxy_auth_required",
            Self::ConnectStatus(_) => "connect_status",
            Self::DestinationDenied(_) => "destination_denied",
            Self::Tls(_) => "tls",
            Self::OriginStatus(_) => "origin_status",
            Self::Timeout => "timeout",
            Self::Protocol(_) => "protocol",
        }
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ConnectRefused => f.write_str("connection to the proxy refused"),
            Self::ConnectTimeout => f.write_str("connecting to the proxy timed out"),
            Self::ConnectFailed(why) => write!(f, "connecting to the proxy failed: {why}"),
            Self::ProxyAuthRequired => f.write_str("the proxy requires authentication (407)"),
            Self::ConnectStatus(status) => write!(f, "the proxy answered CONNECT with {status}"),
            Self::DestinationDenied(class) => write!(
                f,
                "the proxy's destination policy refuses the probe URL ({class}): probe a public URL, or allow it in \
                 the provider's destinations"
            ),
            Self::Tls(why) => write!(f, "TLS to the origin failed: {why}"),
            Self::OriginStatus(status) => write!(f, "the origin answered {status}"),
            Self::Timeout => f.write_str("the probe timed out"),
            Self::Protocol(why) => write!(f, "protocol error: {why}"),
        }
    }
}

/// A probe URL, parsed once when the target is set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeUrl {
    https: bool,
    host: String,
    port: u16,
    path_and_query: String,
    text: String,
}

/// A probe URL that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{url:?} is not a usable probe URL: {why}")]
pub struct InvalidProbeUrl {
    url: String,
    why: &'static str,
}

impl ProbeUrl {
    /// Parses an `http://` or `https://` URL with a host.
    pub fn parse(text: &str) -> Result<Self, InvalidProbeUrl> {
        let invalid = |why| InvalidProbeUrl { url: text.to_owned(), why };
        let uri: Uri = text.parse().map_err(|_| invalid("it does not parse as a URL"))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(invalid("the scheme must be http or https")),
        };
        let host = uri.host().filter(|host| !host.is_empty()).ok_or_else(|| invalid("it has no host"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let path_and_query = uri.path_and_query().map_or("/", |path| path.as_str()).to_owned();
        Ok(Self { https, host, port, path_and_query, text: text.to_owned() })
    }

    /// `host:port`, with an IPv6 host in brackets.
    fn authority(&self) -> String {
        egress_fleet::authority(&self.host, self.port)
    }

    /// The URL as given.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The host, without brackets.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port, explicit or the scheme's.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether the probe tunnels (CONNECT) to an `https` origin rather than sending a plain GET.
    pub fn is_https(&self) -> bool {
        self.https
    }
}

/// The `Proxy-Authorization` value for `credentials`.
fn basic_authorization(credentials: &ProxyCredentials) -> String {
    let pair = format!("{}:{}", credentials.username, credentials.password.expose());
    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(pair))
}

/// What a successful probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeSuccess {
    /// How long it took.
    pub latency: Duration,
    /// The body, when it is a bare IP address (an IP-echo probe URL).
    pub egress_ip: Option<IpAddr>,
}

/// Probes `url` through the proxy at `proxy_host:proxy_port` within `timeout`.
pub async fn probe(
    proxy_host: &str,
    proxy_port: u16,
    credentials: Option<&ProxyCredentials>,
    url: &ProbeUrl,
    timeout: Duration,
    tls: &TlsConnector,
) -> Result<ProbeSuccess, FailureReason> {
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + timeout;
    let connect = TcpStream::connect((proxy_host, proxy_port));
    let stream = match tokio::time::timeout_at(deadline, connect).await {
        Err(_) => return Err(FailureReason::ConnectTimeout),
        Ok(Err(error)) if error.kind() == std::io::ErrorKind::ConnectionRefused => {
            return Err(FailureReason::ConnectRefused);
        }
        Ok(Err(error)) => return Err(FailureReason::ConnectFailed(error.to_string())),
        Ok(Ok(stream)) => stream,
    };
    let _ = stream.set_nodelay(true);
    let exchange = async {
        if url.https {
            through_tunnel(stream, credentials, url, tls).await
        } else {
            absolute_get(stream, credentials, url).await
        }
    };
    let body = tokio::time::timeout_at(deadline, exchange).await.map_err(|_| FailureReason::Timeout)??;
    let egress_ip = std::str::from_utf8(&body).ok().and_then(|text| text.trim().parse::<IpAddr>().ok());
    Ok(ProbeSuccess { latency: started.elapsed(), egress_ip })
}

fn protocol(error: impl fmt::Display) -> FailureReason {
    FailureReason::Protocol(error.to_string())
}

/// Sends one request on a fresh HTTP/1.1 connection over `io` and returns the response.
async fn send<I>(
    io: I,
    request: Request<Empty<Bytes>>,
    upgrades: bool,
) -> Result<hyper::Response<hyper::body::Incoming>, FailureReason>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await.map_err(protocol)?;
    // The connection is driven by its own task; it ends when the exchange (or the tunnel) is done.
    if upgrades {
        tokio::spawn(async move {
            let _ = connection.with_upgrades().await;
        });
    } else {
        tokio::spawn(async move {
            let _ = connection.await;
        });
    }
    sender.send_request(request).await.map_err(protocol)
}

/// The class a rendered proxy's destination policy names when it refused the request (`X-Egress-Policy: denied
/// <class>` on a 403).
fn policy_denial<B>(response: &hyper::Response<B>) -> Option<FailureReason> {
    if response.status() != StatusCode::FORBIDDEN {
        return None;
    }
    let value = response.headers().get("x-egress-policy")?.to_str().ok()?;
    Some(FailureReason::DestinationDenied(value.trim().trim_start_matches("denied").trim().to_owned()))
}

async fn read_success_body(response: hyper::Response<hyper::body::Incoming>) -> Result<Bytes, FailureReason> {
    let status = response.status();
    if status == StatusCode::PROXY_AUTHENTICATION_REQUIRED {
        return Err(FailureReason::ProxyAuthRequired);
    }
    if let Some(denial) = policy_denial(&response) {
        return Err(denial);
    }
    if !status.is_success() {
        return Err(FailureReason::OriginStatus(status.as_u16()));
    }
    let body = Limited::new(response.into_body(), BODY_LIMIT).collect().await;
    // A body longer than the limit is fine for a health check; it just is not an IP echo.
    Ok(body.map(|collected| collected.to_bytes()).unwrap_or_default())
}

async fn absolute_get(
    stream: TcpStream,
    credentials: Option<&ProxyCredentials>,
    url: &ProbeUrl,
) -> Result<Bytes, FailureReason> {
    let mut request = Request::get(url.as_str())
        .header(header::HOST, url.authority())
        .header(header::USER_AGENT, USER_AGENT)
        .header(header::CONNECTION, "close");
    if let Some(credentials) = credentials {
        request = request.header(header::PROXY_AUTHORIZATION, basic_authorization(credentials));
    }
    let request = request.body(Empty::new()).map_err(protocol)?;
    read_success_body(send(stream, request, false).await?).await
}

async fn through_tunnel(
    stream: TcpStream,
    credentials: Option<&ProxyCredentials>,
    url: &ProbeUrl,
    tls: &TlsConnector,
) -> Result<Bytes, FailureReason> {
    let authority = url.authority();
    let mut connect =
        Request::builder().method(Method::CONNECT).uri(authority.as_str()).header(header::HOST, authority.as_str());
    if let Some(credentials) = credentials {
        connect = connect.header(header::PROXY_AUTHORIZATION, basic_authorization(credentials));
    }
    let connect = connect.body(Empty::new()).map_err(protocol)?;
    let response = send(stream, connect, true).await?;
    if let Some(denial) = policy_denial(&response) {
        return Err(denial);
    }
    match response.status() {
        StatusCode::OK => {}
        StatusCode::PROXY_AUTHENTICATION_REQUIRED => return Err(FailureReason::ProxyAuthRequired),
        status => return Err(FailureReason::ConnectStatus(status.as_u16())),
    }
    let tunnel = hyper::upgrade::on(response).await.map_err(protocol)?;
    let server_name = ServerName::try_from(url.host.clone()).map_err(|error| FailureReason::Tls(error.to_string()))?;
    let tls_stream =
        tls.connect(server_name, TokioIo::new(tunnel)).await.map_err(|error| FailureReason::Tls(error.to_string()))?;
    let request = Request::get(url.path_and_query.as_str())
        .header(header::HOST, authority.as_str())
        .header(header::USER_AGENT, USER_AGENT)
        .header(header::CONNECTION, "close")
        .body(Empty::new())
        .map_err(protocol)?;
    read_success_body(send(tls_stream, request, false).await?).await
}

/// A TLS client trusting the system's roots plus `extra_ca_pem` (PEM certificates, for self-hosted probe targets).
pub fn tls_connector(extra_ca_pem: &[u8]) -> Result<TlsConnector, TlsSetupError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for certificate in native.certs {
        // One unusable system certificate must not take the others down.
        let _ = roots.add(certificate);
    }
    let mut extra = 0;
    for certificate in CertificateDer::pem_slice_iter(extra_ca_pem) {
        let certificate =
            certificate.map_err(|error| TlsSetupError(format!("reading the extra CA certificates: {error}")))?;
        roots.add(certificate).map_err(|error| TlsSetupError(format!("adding an extra CA certificate: {error}")))?;
        extra += 1;
    }
    if !extra_ca_pem.iter().all(u8::is_ascii_whitespace) && extra == 0 {
        return Err(TlsSetupError("the extra CA file holds no PEM certificate".into()));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|error| TlsSetupError(error.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}

/// The TLS client could not be set up.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TlsSetupError(String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_urls_parse() {
        let https = ProbeUrl::parse("https://probe.example/ip?x=1").expect("valid");
        assert_eq!(
            (https.https, https.host.as_str(), https.port, https.path_and_query.as_str()),
            (true, "probe.example", 443, "/ip?x=1")
        );
        let http = ProbeUrl::parse("http://127.0.0.1:8080").expect("valid");
        assert_eq!(
            (http.https, http.port, http.path_and_query.as_str(), http.authority()),
            (false, 8080, "/", "127.0.0.1:8080".to_owned())
        );
        let v6 = ProbeUrl::parse("http://[::1]:81/").expect("valid");
        assert_eq!(v6.authority(), "[::1]:81");
        for bad in ["ftp://x/", "/relative", "http://", "not a url"] {
            assert!(ProbeUrl::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn credentials_do_not_show_in_debug_output() {
        let credentials = ProxyCredentials::new("crawler", "s3cret");
        assert!(!format!("{credentials:?}").contains("s3cret"));
        assert_eq!(basic_authorization(&credentials), "Basic Y3Jhd2xlcjpzM2NyZXQ=");
    }

    #[test]
    fn reason_kinds_are_stable() {
        let kinds: Vec<&str> = [
            FailureReason::ConnectRefused,
            FailureReason::ConnectTimeout,
            FailureReason::ProxyAuthRequired,
            FailureReason::ConnectStatus(403),
            FailureReason::DestinationDenied("loopback".into()),
            FailureReason::Tls("x".into()),
            FailureReason::OriginStatus(503),
            FailureReason::Timeout,
        ]
        .iter()
        .map(FailureReason::kind)
        .collect();
        assert_eq!(
            kinds,
            [
                "connect_refused",
                "connect_timeout",
                "proxy_auth_required",
                "connect_status",
                "destination_denied",
                "tls",
                "origin_status",
                "timeout"
            ]
        );
    }

    #[test]
    fn only_a_403_naming_the_policy_is_a_policy_denial() {
        let response = |status: u16, header: Option<&str>| {
            let mut builder = hyper::Response::builder().status(status);
            if let Some(value) = header {
                builder = builder.header("X-Egress-Policy", value);
            }
            builder.body(()).expect("a response")
        };
        assert_eq!(
            policy_denial(&response(403, Some("denied private"))),
            Some(FailureReason::DestinationDenied("private".into()))
        );
        assert_eq!(policy_denial(&response(403, None)), None, "a plain 403 is the origin's or another proxy's");
        assert_eq!(policy_denial(&response(200, Some("denied private"))), None);
    }
}
