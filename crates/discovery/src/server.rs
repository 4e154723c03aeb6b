//! Serving a router with limits that hostile or broken clients cannot outlast: how long a client may take to send
//! a request's headers and its body, how long a connection may sit idle, HTTP/2 keep-alive pings and a cap on
//! concurrent streams, and a cap on open connections (excess connections are closed as soon as they are accepted,
//! and counted). The operator serves discovery, metrics and health this way.
//!
//! Connections that have not yet sent an authenticated request (every connection, on a server without
//! authentication) are capped per source address, so one client cannot take the whole connection cap: a kubelet's
//! probes and other clients' connections still get through. A response the router marks [`Authenticated`] lifts
//! its connection out of that count. Request heads are limited to `max_header_bytes`: hyper answers a larger one
//! itself, with 431 and no body (HTTP/1), or refuses the stream (HTTP/2). A body announced larger than the API takes
//! is answered 413 at once, without waiting for it; both close the connection.
//!
//! HTTP/1: hyper's header-read timer starts whenever the connection waits for a request head, so a connection that
//! sends nothing, a request line only, or headers byte by byte is closed after `header_timeout`; so is a keep-alive
//! connection idle between requests for that long. HTTP/2: a connection with no request in flight for
//! `idle_timeout` is closed, and one whose peer stops answering pings after `http2_keepalive_timeout`.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use egress_fleet::sources::SourceCounts;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tower::ServiceExt;
use tracing::{debug, warn};

use crate::problem::Problem;

/// The largest request body any route takes: the server refuses a larger one before a route sees it.
pub const MAX_BODY_BYTES: usize = 16 * 1024;

/// The default limit of a request head: far above any real client's, far below what fills memory.
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;

/// The limits of one server. The defaults suit the discovery API on a busy cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    /// How long a client may take to send a request's headers (HTTP/1; also the longest idle keep-alive wait).
    pub header_timeout: Duration,
    /// How long a client may take to send a request's body, once its headers arrived.
    pub body_timeout: Duration,
    /// How long an HTTP/2 connection may have no request in flight.
    pub idle_timeout: Duration,
    /// How often an idle HTTP/2 connection is pinged.
    pub http2_keepalive_interval: Duration,
    /// How long a ping may go unanswered before the connection is closed.
    pub http2_keepalive_timeout: Duration,
    /// Concurrent streams per HTTP/2 connection.
    pub http2_max_streams: u32,
    /// Open connections; one more is closed as soon as it is accepted.
    pub max_connections: usize,
    /// Open connections from one source address that have not sent an authenticated request yet; one more from
    /// that address is closed as soon as it is accepted.
    pub max_unauthenticated_per_source: usize,
    /// The most bytes a request head (request line and headers) may have.
    pub max_header_bytes: usize,
}

/// Marks a response to an authenticated request: its connection no longer counts against
/// [`ServerLimits::max_unauthenticated_per_source`].
#[derive(Clone, Copy, Debug)]
pub struct Authenticated;

/// Marks a response whose body is a stream that may stay open for long: its request counts as in flight until the
/// body ends, so neither the idle timeout nor the header timeout closes its connection meanwhile.
#[derive(Clone, Copy, Debug)]
pub struct Streamed;

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            http2_keepalive_interval: Duration::from_secs(20),
            http2_keepalive_timeout: Duration::from_secs(10),
            http2_max_streams: 100,
            max_connections: 1024,
            max_unauthenticated_per_source: 64,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServerLabels {
    server: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClosedLabels {
    server: &'static str,
    reason: &'static str,
}

/// Connection metrics of every server that shares them: open connections, connections refused at the cap, and
/// connections closed by a limit (`header-timeout`, `body-timeout`, `idle-timeout`, `per-source` for one refused
/// at its source address's cap). Cloning shares them.
#[derive(Clone, Debug, Default)]
pub struct ServerMetrics {
    open: Family<ServerLabels, Gauge>,
    refused: Family<ServerLabels, Counter>,
    closed: Family<ClosedLabels, Counter>,
}

impl ServerMetrics {
    /// Registers the metrics under `http_` in `registry` (`egress_http_` in the operator's).
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        let registry = registry.sub_registry_with_prefix("http");
        registry.register("connections_open", "Open connections, by server", metrics.open.clone());
        registry.register(
            "connections_refused",
            "Connections closed at once because the server had max-connections open",
            metrics.refused.clone(),
        );
        registry.register(
            "connections_closed_by_limit",
            "Connections closed by a limit, by server and reason",
            metrics.closed.clone(),
        );
        metrics
    }

    /// Open connections of `server` now.
    pub fn open(&self, server: &'static str) -> i64 {
        self.open.get_or_create(&ServerLabels { server }).get()
    }

    /// Connections `server` refused at its cap so far.
    pub fn refused(&self, server: &'static str) -> u64 {
        self.refused.get_or_create(&ServerLabels { server }).get()
    }

    /// Connections `server` closed for `reason` so far.
    pub fn closed_by_limit(&self, server: &'static str, reason: &'static str) -> u64 {
        self.closed.get_or_create(&ClosedLabels { server, reason }).get()
    }

    fn close(&self, server: &'static str, reason: &'static str) {
        self.closed.get_or_create(&ClosedLabels { server, reason }).inc();
    }
}

/// Requests in flight on one connection, whether it ever sent one, and when the last one started or ended.
struct Activity {
    in_flight: AtomicUsize,
    any: AtomicBool,
    last: Mutex<Instant>,
}

impl Activity {
    fn touch(&self) {
        *self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Instant::now();
    }

    /// Resolves, with the limit's name, once the connection has sent no complete request head within `header`
    /// of opening (whatever the protocol: before the first bytes, hyper's own header timer has not started), or
    /// has had no request in flight for `idle` since its last one.
    async fn limit(&self, header: Duration, idle: Duration) -> &'static str {
        loop {
            let last = *self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let (limit, reason) =
                if self.any.load(Ordering::Acquire) { (idle, "idle-timeout") } else { (header, "header-timeout") };
            let busy = self.in_flight.load(Ordering::Acquire) > 0;
            if !busy && last.elapsed() >= limit {
                return reason;
            }
            // A request in flight ends with a touch, so looking again one period from now is soon enough.
            tokio::time::sleep_until(if busy { Instant::now() + limit } else { last + limit }).await;
        }
    }
}

/// Ends a request on its connection's [`Activity`] when dropped (its response sent, or the request abandoned).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.touch();
    }
}

/// Connections beyond `max_connections` kept for addresses that have fewer than [`RESERVE_PER_SOURCE`] connections
/// without a valid token open (on metrics and health, fewer than that open at all): what the kubelet's probes need,
/// whatever other addresses hold.
pub const RESERVED_CONNECTIONS: usize = 64;
/// See [`RESERVED_CONNECTIONS`].
pub const RESERVE_PER_SOURCE: usize = 2;

/// How many accepted-but-not-yet-served connections the kernel queues. The standard library's (and mio's) 128
/// overflows under a burst of connections; the kernel then answers with SYN cookies and drops the handshake's last
/// ACK, so a client that connected but has not sent anything yet holds a connection the server never sees.
pub const LISTEN_BACKLOG: u32 = 4096;

/// Binds a listener for [`serve_with`] with [`LISTEN_BACKLOG`] (the kernel caps it at `net.core.somaxconn`).
pub fn bind(address: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if address.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(address)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Serves `router` on `listener` with the default limits until `shutdown` resolves, finishing in-flight requests.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, router, ServerLimits::default(), "discovery", ServerMetrics::default(), shutdown).await
}

/// Serves `router` on `listener` (HTTP/1.1 and HTTP/2) under `limits` until `shutdown` resolves; then stops
/// accepting, lets requests in flight finish (at most `header_timeout + body_timeout` more) and returns. `name`
/// labels the metrics.
pub async fn serve_with(
    listener: TcpListener,
    router: Router,
    limits: ServerLimits,
    name: &'static str,
    metrics: ServerMetrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let body_limit = Arc::new(BodyLimit { timeout: limits.body_timeout, metrics: metrics.clone(), server: name });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        // hyper's smallest read buffer is 8 KiB.
        .max_buf_size(limits.max_header_bytes.max(8192));
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(limits.http2_keepalive_interval))
        .keep_alive_timeout(limits.http2_keepalive_timeout)
        .max_concurrent_streams(limits.http2_max_streams)
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX));
    let builder = Arc::new(builder);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let reserve = Arc::new(Semaphore::new(RESERVED_CONNECTIONS));
    // Connections per source address that have not sent an authenticated request yet.
    let unauthenticated = SourceCounts::new();
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, source) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => (stream, peer.ip()),
                Err(error) => {
                    // Out of file descriptors, or a connection reset before it was accepted: keep serving.
                    debug!(%error, server = name, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // At the cap, an address with (almost) nothing open here still gets in, from a small reserve: a flood from
        // other addresses cannot keep out the kubelet's probe of the health port, or any client that asks for little.
        let slot = slots.clone().try_acquire_owned().ok().or_else(|| {
            let few = unauthenticated.counted(source).0 < RESERVE_PER_SOURCE;
            few.then(|| reserve.clone().try_acquire_owned().ok()).flatten()
        });
        let Some(slot) = slot else {
            metrics.refused.get_or_create(&ServerLabels { server: name }).inc();
            drop(stream);
            continue;
        };
        let Ok(source_slot) = unauthenticated.admit(source, limits.max_unauthenticated_per_source, usize::MAX) else {
            metrics.close(name, "per-source");
            drop(stream);
            continue;
        };
        let source_slot = Arc::new(source_slot);
        let _ = stream.set_nodelay(true);
        let activity = Arc::new(Activity {
            in_flight: AtomicUsize::new(0),
            any: AtomicBool::new(false),
            last: Mutex::new(Instant::now()),
        });
        let tracked = activity.clone();
        let router = router.clone();
        let held = source_slot.clone();
        let body_limit = body_limit.clone();
        let service = tower::service_fn(move |request: Request<hyper::body::Incoming>| {
            tracked.in_flight.fetch_add(1, Ordering::AcqRel);
            tracked.any.store(true, Ordering::Release);
            tracked.touch();
            let guard = InFlight(tracked.clone());
            let router = router.clone();
            let held = held.clone();
            let body_limit = body_limit.clone();
            async move {
                // The body is read here, within its timeout, before any route sees the request: one step of
                // this future rather than a middleware layer boxed around every route.
                let request = match read_body_in_time(&body_limit, request).await {
                    Ok(request) => request,
                    Err(refusal) => return Ok(refusal),
                };
                let response = router.oneshot(request).await;
                if let Ok(response) = &response
                    && response.extensions().get::<Authenticated>().is_some()
                {
                    held.release();
                }
                // A streamed answer (`GET /v1/refusals`) stays in flight until its body ends, not only its head:
                // it is no idle connection for the idle timeout to close.
                match response {
                    Ok(response) if response.extensions().get::<Streamed>().is_some() => Ok(response.map(|body| {
                        Body::new(body.map_frame(move |frame| {
                            let _in_flight = &guard;
                            frame
                        }))
                    })),
                    response => {
                        drop(guard);
                        response
                    }
                }
            }
        });
        let connection = graceful.watch(
            builder
                .serve_connection_with_upgrades(TokioIo::new(stream), TowerToHyperService::new(service))
                .into_owned(),
        );
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let _slots = (slot, source_slot);
            let open = metrics.open.get_or_create(&ServerLabels { server: name }).clone();
            open.inc();
            tokio::select! {
                result = connection => {
                    if let Err(error) = result {
                        if error.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_timeout) {
                            metrics.close(name, "header-timeout");
                        } else {
                            debug!(%error, server = name, "connection ended with an error");
                        }
                    }
                }
                reason = activity.limit(limits.header_timeout, limits.idle_timeout) => metrics.close(name, reason),
            }
            open.dec();
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.header_timeout + limits.body_timeout, graceful.shutdown()).await.is_err() {
        warn!(server = name, "connections still open after the shutdown grace; closing them");
    }
    Ok(())
}

/// What the body middleware needs.
#[derive(Clone)]
struct BodyLimit {
    timeout: Duration,
    metrics: ServerMetrics,
    server: &'static str,
}

/// Reads the request's body within the body timeout (so a client that trickles it cannot hold a connection), and
/// gives the request back with the body in memory; or the answer to send instead: 413 for a body above the limit,
/// 408 (closing the connection) for a late one. A request that says it has no body is given back as it is.
async fn read_body_in_time(
    limit: &BodyLimit,
    request: Request<hyper::body::Incoming>,
) -> Result<Request<Body>, Response> {
    if hyper::body::Body::is_end_stream(request.body()) {
        return Ok(request.map(|_| Body::empty()));
    }
    let (parts, body) = request.into_parts();
    let timeout = limit.timeout;
    let too_large = || {
        let mut response = Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too-large",
            "The request body is too large",
            format!("at most {MAX_BODY_BYTES} bytes"),
        )
        .into_response();
        // The rest of the body may still be on its way: the connection cannot carry another request.
        response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        response
    };
    // A body announced larger than the limit is refused before any of it is read.
    let announced = parts.headers.get(header::CONTENT_LENGTH).and_then(|value| value.to_str().ok());
    if announced
        .and_then(|length| length.trim().parse::<u64>().ok())
        .is_some_and(|length| length > MAX_BODY_BYTES as u64)
    {
        return Err(too_large());
    }
    // A small body usually came with the head: read what is there first, and only a body still on its way is
    // timed (a timer armed and disarmed per request shows in the request rate).
    let mut collect = std::pin::pin!(http_body_util::Limited::new(body, MAX_BODY_BYTES).collect());
    let ready = std::future::poll_fn(|context| std::task::Poll::Ready(collect.as_mut().poll(context))).await;
    let read = match ready {
        std::task::Poll::Ready(read) => Ok(read),
        std::task::Poll::Pending => tokio::time::timeout(timeout, collect).await,
    };
    match read {
        Ok(Ok(collected)) => Ok(Request::from_parts(parts, Body::from(collected.to_bytes()))),
        Ok(Err(error)) if error.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Ok(Err(error)) => {
            Err(Problem::bad_request(format!("the request body could not be read: {error}")).into_response())
        }
        Err(_) => {
            limit.metrics.close(limit.server, "body-timeout");
            let mut response = Problem::new(
                StatusCode::REQUEST_TIMEOUT,
                "body-timeout",
                "The request body was not sent in time",
                format!("the whole body must arrive within {timeout:?} of the headers"),
            )
            .into_response();
            response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
            Err(response)
        }
    }
}
