//! Serving the gateway: HTTP/1.1 connections from crawlers, each request authenticated, routed and forwarded.
//!
//! A plain `http://` request (absolute form) goes to its upstream proxy over a kept-alive connection from a pool per
//! upstream, its hop-by-hop headers dropped and the upstream's credentials added; the answer is streamed back with
//! `X-Egress-Proxy` naming the proxy. A `CONNECT host:port` opens a connection to the upstream, asks it for the
//! same tunnel, answers `200` with `X-Egress-Proxy` (and `X-Egress-Lease`) once the upstream agreed, and then
//! copies bytes both ways until either side closes. A client that takes longer than `header_timeout` to send a
//! request head (or idles that long between requests) is closed. Client connections and open tunnels share
//! `max_connections` slots: at the cap a new connection is closed as soon as it is accepted, and a `CONNECT` on a
//! connection already open is answered 503.
//!
//! Stopping is two steps: [`Gateway::serve`]'s `shutdown` stops accepting and asks every client connection to close
//! once its request in flight is answered; [`Gateway::drain`] then waits for the answers still streaming and the
//! tunnels still open, up to a deadline.
//!
//! This module serves connections and holds the slots; each kind of request is a child's: `authenticate` (who a
//! request is from), `forward` (plain requests), `connect` (tunnels) and `report` (the gateway's own
//! `POST /report` and the crawler's `X-Egress-Report`).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderValue, Method, Request, Response, header};
use http_body_util::BodyExt;
use hyper::body::{Bytes, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tracing::{Instrument, debug};

use egress_fleet::sources::SourceSlot;

use crate::Body;
use crate::admission::Admission;
use crate::autoanswer::ClientIo;
use crate::metrics::{GatewayMetrics, status_class};
use crate::options::Options;
use crate::route::{Authenticator, Report, Router};
use crate::status::GatewayError;
use crate::tunnel::Buffers;
use forward::UpstreamClient;
use report::reported;

mod authenticate;
mod connect;
mod forward;
mod report;

pub use report::REPORT_PATH;

/// The answer header naming the proxy a request went through (`namespace/name`).
pub const PROXY_HEADER: &str = "x-egress-proxy";

/// The answer header naming the lease a request went under.
pub const LEASE_HEADER: &str = "x-egress-lease";

/// The gateway's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatewayLimits {
    /// How long a client may take to send a request head, and may idle between requests.
    pub header_timeout: Duration,
    /// How long reaching an upstream may take: the TCP connection, and its answer to a `CONNECT`.
    pub connect_timeout: Duration,
    /// Open client connections and tunnels together; one more connection is closed as soon as it is accepted, one
    /// more tunnel is answered 503.
    pub max_connections: usize,
    /// The buffers of each direction of a tunnel: none while it idles, `small` after it wakes, `large` while it
    /// streams.
    pub tunnel_buffers: Buffers,
    /// How many times an idempotent plain request without a body is tried again on another proxy after the site
    /// blocked the one it went through ([`crate::Verdict::Blocked`]); the last answer is passed on.
    pub retries: u32,
    /// Tunnels open and plain requests in flight (until their answer's body ends) one tenant may have at once; one
    /// more is answered 429 with `Retry-After`, so no tenant can take every connection slot of a shared gateway (the
    /// default is half of `max_connections`' default).
    pub max_tenant_connections: usize,
    /// Connections from one client address that have not sent a request with a valid token yet; one more from that
    /// address is closed as soon as it is accepted ([`crate::admission`]).
    pub max_unauthenticated_per_source: usize,
    /// Connections from all addresses that have not sent a request with a valid token yet; the rest of
    /// `max_connections` is kept for authenticated connections and their tunnels.
    pub max_unauthenticated: usize,
}

impl Default for GatewayLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            max_connections: 16_384,
            tunnel_buffers: Buffers::default(),
            retries: 2,
            max_tenant_connections: 8192,
            max_unauthenticated_per_source: 256,
            max_unauthenticated: 8192,
        }
    }
}

/// The gateway: a router, an authenticator, limits, and the connection pools to upstreams.
pub struct Gateway {
    router: Arc<dyn Router>,
    auth: Arc<dyn Authenticator>,
    limits: GatewayLimits,
    metrics: GatewayMetrics,
    clients: Mutex<HashMap<String, UpstreamClient>>,
    /// One permit per open client connection or tunnel.
    slots: Arc<Semaphore>,
    /// True once the gateway stops: connections close after their request in flight.
    draining: watch::Sender<bool>,
    /// Tunnels open and requests in flight, per tenant.
    tenants: Arc<Mutex<HashMap<String, usize>>>,
    /// Connections not authenticated yet, and wrong tokens, per client address.
    admission: Admission,
}

/// The client end of a connection: its address, and its place among the unauthenticated ones until a request on it
/// shows a valid token.
struct Peer {
    source: IpAddr,
    unauthenticated: SourceSlot,
    /// Set once the connection carries a tunnel ([`crate::autoanswer::ClientIo`] then looks at nothing).
    tunnelled: Arc<std::sync::atomic::AtomicBool>,
}

/// One of a tenant's tunnels or requests in flight, counted until dropped.
struct TenantSlot {
    tenants: Arc<Mutex<HashMap<String, usize>>>,
    tenant: String,
}

impl Drop for TenantSlot {
    fn drop(&mut self) {
        let mut tenants = self.tenants.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(count) = tenants.get_mut(&self.tenant) {
            *count -= 1;
            if *count == 0 {
                tenants.remove(&self.tenant);
            }
        }
    }
}

impl Gateway {
    /// A gateway routing with `router` and telling tenants with `auth`.
    pub fn new(router: Arc<dyn Router>, auth: Arc<dyn Authenticator>, limits: GatewayLimits) -> Arc<Self> {
        Self::with_metrics(router, auth, limits, GatewayMetrics::default())
    }

    /// As [`Gateway::new`], counting into `metrics`.
    pub fn with_metrics(
        router: Arc<dyn Router>,
        auth: Arc<dyn Authenticator>,
        limits: GatewayLimits,
        metrics: GatewayMetrics,
    ) -> Arc<Self> {
        let slots = Arc::new(Semaphore::new(limits.max_connections));
        let (draining, _) = watch::channel(false);
        Arc::new(Self {
            router,
            auth,
            limits,
            metrics,
            clients: Mutex::new(HashMap::new()),
            slots,
            draining,
            tenants: Arc::new(Mutex::new(HashMap::new())),
            admission: Admission::new(&limits),
        })
    }

    /// One more tunnel or request of `tenant`, unless it has as many as it may.
    fn tenant_slot(&self, tenant: &str) -> Result<TenantSlot, GatewayError> {
        let mut tenants = self.tenants.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = tenants.entry(tenant.to_owned()).or_default();
        if *count >= self.limits.max_tenant_connections {
            return Err(GatewayError::quota(
                format!(
                    "the tenant has {count} tunnels and requests open through the gateway, as many as one tenant may \
                     (--max-tenant-connections)"
                ),
                Some(Duration::from_secs(1)),
            ));
        }
        *count += 1;
        Ok(TenantSlot { tenants: self.tenants.clone(), tenant: tenant.to_owned() })
    }

    /// Client connections and tunnels open now.
    pub fn open(&self) -> usize {
        self.limits.max_connections - self.slots.available_permits()
    }

    /// Waits until no client connection or tunnel is open, or `timeout` has passed; returns how many are still
    /// open (those are cut when the process exits). Meant for after [`Gateway::serve`] has returned.
    pub async fn drain(&self, timeout: Duration) -> usize {
        let all = u32::try_from(self.limits.max_connections).unwrap_or(u32::MAX);
        match tokio::time::timeout(timeout, self.slots.acquire_many(all)).await {
            Ok(Ok(permits)) => {
                drop(permits);
                0
            }
            _ => self.open(),
        }
    }

    /// Serves clients on `listener` until `shutdown` resolves; then stops accepting, asks each client connection
    /// to close once its request in flight is answered (an idle kept-alive one closes at once), and returns.
    /// Tunnels already open carry on until either side closes them; [`Gateway::drain`] waits for them.
    ///
    /// # Errors
    /// None so far: accept failures (a reset before accept, out of descriptors) are logged and waited out.
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> io::Result<()> {
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(self.limits.header_timeout);
        tokio::pin!(shutdown);
        loop {
            let (stream, source) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => (stream, peer.ip()),
                    Err(error) => {
                        debug!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                },
                () = &mut shutdown => {
                    self.draining.send_replace(true);
                    return Ok(());
                }
            };
            let Ok(slot) = self.slots.clone().try_acquire_owned() else {
                self.metrics.refused_connection();
                drop(stream);
                continue;
            };
            let unauthenticated = match self.admission.admit(source) {
                Ok(unauthenticated) => unauthenticated,
                Err(refused) => {
                    self.metrics.refused_unauthenticated(refused.label());
                    drop(stream);
                    continue;
                }
            };
            let tunnelled = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let peer = Arc::new(Peer { source, unauthenticated, tunnelled: tunnelled.clone() });
            let _ = stream.set_nodelay(true);
            let gateway = self.clone();
            let service = hyper::service::service_fn(move |request| {
                let (gateway, peer) = (gateway.clone(), peer.clone());
                async move { Ok::<_, Infallible>(gateway.handle(request, &peer).await) }
            });
            // hyper's own answers to heads it cannot parse gain the Proxy-Status the gateway's carry.
            let stream = ClientIo::new(stream, tunnelled);
            let connection = builder.serve_connection(TokioIo::new(stream), service).with_upgrades();
            let mut draining = self.draining.subscribe();
            tokio::spawn(async move {
                tokio::pin!(connection);
                let ended = tokio::select! {
                    ended = connection.as_mut() => ended,
                    () = async { drop(draining.wait_for(|draining| *draining).await) } => {
                        connection.as_mut().graceful_shutdown();
                        connection.await
                    }
                };
                if let Err(error) = ended {
                    debug!(%error, "client connection ended with an error");
                }
                drop(slot);
            });
        }
    }

    /// Answers one request: the upstream's answer, or the gateway's own error.
    async fn handle(self: Arc<Self>, request: Request<Incoming>, peer: &Peer) -> Response<Body> {
        let connect = request.method() == Method::CONNECT;
        let own = !connect && request.uri().scheme().is_none() && request.uri().authority().is_none();
        let kind = if connect {
            "connect"
        } else if own {
            "report"
        } else {
            "plain"
        };
        let (tenant, token, options) = match self.authenticate(request.headers(), peer) {
            Ok(found) => found,
            Err(error) => {
                self.metrics.request("", kind, error.kind);
                // Nothing more is served on a connection that could not say who it is: it goes, and with it its
                // place among the unauthenticated ones.
                let mut response = error.response();
                response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
                return response;
            }
        };
        let report = match reported(request.headers(), &options) {
            Ok(report) => report,
            Err(error) => {
                self.metrics.request(&tenant, kind, error.kind);
                return error.response();
            }
        };
        let slot = match self.tenant_slot(&tenant) {
            Ok(slot) => slot,
            Err(error) => {
                self.metrics.request(&tenant, kind, error.kind);
                return error.response();
            }
        };
        let who = Who { tenant: &tenant, token: &token, options: &options, report };
        // One span per request (exported with the operator's OTLP settings): who, what, through which proxy, and how
        // it ended. The host and the proxy are recorded once known.
        let span = tracing::info_span!(
            "gateway request",
            tenant = %tenant,
            kind,
            host = tracing::field::Empty,
            proxy = tracing::field::Empty,
            status = tracing::field::Empty,
        );
        let result = async {
            if connect {
                // The tunnel holds the tenant's slot for as long as it is open.
                return self.tunnel(request, who, slot).await;
            }
            let response = if own { self.own(&request, who).await } else { self.forward(request, who).await };
            // A plain answer holds it until its body has been sent.
            response.map(|response| response.map(|body| Holding { inner: body, _hold: Arc::new(slot) }.boxed()))
        }
        .instrument(span.clone())
        .await;
        match result {
            Ok(response) => {
                if connect && response.status().is_success() {
                    // From here on the connection's bytes are the tunnel's.
                    peer.tunnelled.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                span.record("status", response.status().as_u16());
                self.metrics.request(&tenant, kind, status_class(response.status().as_u16()));
                response
            }
            Err(error) => {
                span.record("status", error.status.as_u16());
                span.in_scope(|| debug!(%error, "the gateway answered with an error"));
                self.metrics.request(&tenant, kind, error.kind);
                error.response()
            }
        }
    }
}

/// Who sent a request and what its user name asked for.
#[derive(Clone, Copy)]
struct Who<'a> {
    tenant: &'a str,
    token: &'a str,
    options: &'a Options,
    report: Option<Report>,
}

/// An answer's body that keeps the router's hold until it is done.
struct Holding {
    inner: Body,
    _hold: Arc<dyn Send + Sync>,
}

impl hyper::body::Body for Holding {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
