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

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::Scheme;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, Version, header};
use http_body_util::BodyExt;
use hyper::body::{Body as _, Bytes, Frame, Incoming, SizeHint};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tracing::{Instrument, debug};

use egress_fleet::error_chain;
use egress_fleet::sources::SourceSlot;

use crate::Body;
use crate::admission::{Admission, credentials};
use crate::autoanswer::ClientIo;
use crate::metrics::{GatewayMetrics, status_class};
use crate::options::Options;
use crate::route::{Authenticator, REPORT_HEADER, Report, RouteRequest, Routed, Router, Upstream, Verdict};
use crate::status::{GatewayError, full};
use crate::tunnel::{Buffers, splice};
use crate::upstream::{POLICY_HEADER, UpstreamConnector, open_tunnel, policy_denial};

/// The answer header naming the proxy a request went through (`namespace/name`).
pub const PROXY_HEADER: &str = "x-egress-proxy";

/// The answer header naming the lease a request went under.
pub const LEASE_HEADER: &str = "x-egress-lease";

/// The path of the gateway's own report endpoint.
pub const REPORT_PATH: &str = "/report";

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

type UpstreamClient = Client<UpstreamConnector, Body>;

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

    /// The tenant, token and options of a request's credentials; a connection that shows a valid token leaves the
    /// unauthenticated ones. An address out of wrong tokens to send is told to wait, its credentials unchecked.
    fn authenticate(&self, headers: &HeaderMap, peer: &Peer) -> Result<(String, String, Options), GatewayError> {
        let offered = headers.contains_key(header::PROXY_AUTHORIZATION);
        let now = std::time::Instant::now();
        if offered && let Some(wait) = self.admission.throttled(peer.source, now) {
            self.metrics.throttled_credentials();
            return Err(GatewayError::quota(
                "this address sent too many wrong tokens; its credentials are checked again after Retry-After",
                Some(wait.max(Duration::from_secs(1))),
            ));
        }
        match credentials(headers, self.auth.as_ref()) {
            Ok(found) => {
                peer.unauthenticated.release();
                Ok(found)
            }
            Err(error) => {
                if offered && error.status == http::StatusCode::PROXY_AUTHENTICATION_REQUIRED {
                    self.admission.failed(peer.source, now);
                }
                Err(error)
            }
        }
    }

    async fn tunnel(
        &self,
        request: Request<Incoming>,
        who: Who<'_>,
        tenant_slot: TenantSlot,
    ) -> Result<Response<Body>, GatewayError> {
        let authority = request
            .uri()
            .authority()
            .filter(|authority| request.uri().scheme().is_none() && authority.port_u16().is_some_and(|port| port != 0))
            .cloned()
            .ok_or_else(|| GatewayError::bad_request("CONNECT takes host:port, with a port from 1 to 65535"))?;
        let port = authority.port_u16().unwrap_or_default();
        tracing::Span::current().record("host", authority.host());
        // The tunnel outlives the client connection's slot (which is given back once the connection is upgraded).
        let slot = self.slots.clone().try_acquire_owned().map_err(|_| {
            self.metrics.refused_connection();
            GatewayError::busy("the gateway has as many connections and tunnels open as it takes")
        })?;
        let route = RouteRequest {
            tenant: who.tenant,
            token: who.token,
            host: authority.host(),
            port,
            options: who.options,
            connect: true,
            report: who.report,
        };
        let upstream = self.router.route(&route).await?;
        tracing::Span::current().record("proxy", upstream.proxy.as_str());
        let opened =
            tokio::time::timeout(self.limits.connect_timeout, open_tunnel(&upstream, authority.as_str())).await;
        let (stream, leftover) = match opened {
            Ok(Ok(opened)) => opened,
            Ok(Err(error)) => {
                self.router.outcome(&route, &upstream, Routed::Failed).await;
                return Err(error);
            }
            Err(_) => {
                self.router.outcome(&route, &upstream, Routed::Failed).await;
                return Err(GatewayError::upstream_timeout(format!(
                    "proxy {} did not open the tunnel in time",
                    upstream.proxy
                )));
            }
        };
        self.router.outcome(&route, &upstream, Routed::Tunnelled).await;
        let buffers = self.limits.tunnel_buffers;
        let upgrade = hyper::upgrade::on(request);
        // Kept until the tunnel closes (a lease of the tunnel's own is released then).
        let hold = upstream.hold.clone();
        let revoked = upstream.clone();
        let mut gauge = self.metrics.tunnel(who.tenant, &upstream.proxy);
        tokio::spawn(async move {
            let _hold = hold;
            let _slot = slot;
            let _tenant_slot = tenant_slot;
            let upgraded = match upgrade.await {
                Ok(upgraded) => upgraded,
                Err(error) => {
                    debug!(%error, "the client left before its tunnel opened");
                    return;
                }
            };
            // The client's own TCP stream, out of hyper's wrapping (a boxed stream behind a buffer of what was read
            // past the CONNECT head, behind the rewriting of hyper's own answers, which a tunnel never needs): each
            // read and write of the tunnel goes through three layers fewer.
            match upgraded.downcast::<TokioIo<ClientIo<TcpStream>>>() {
                Ok(parts) => {
                    let client = parts.io.into_inner().into_inner();
                    carry(client, &parts.read_buf, stream, &leftover, buffers, &revoked, &mut gauge).await;
                }
                Err(upgraded) => {
                    carry(TokioIo::new(upgraded), &[], stream, &leftover, buffers, &revoked, &mut gauge).await;
                }
            }
        });
        let mut response = Response::new(full(Bytes::new()));
        // What proxies (and RFC 9110's examples) answer a CONNECT with, and what the docs show.
        response.extensions_mut().insert(hyper::ext::ReasonPhrase::from_static(b"Connection established"));
        identify(response.headers_mut(), &upstream);
        Ok(response)
    }

    /// A request to the gateway itself (origin form): `POST /report?target=<host>` with `X-Egress-Report`, which
    /// reports the session's proxy for that site without sending anything through it.
    async fn own(&self, request: &Request<Incoming>, who: Who<'_>) -> Result<Response<Body>, GatewayError> {
        if request.uri().path() != REPORT_PATH {
            return Err(GatewayError::bad_request(format!(
                "the gateway forwards absolute http:// URLs (and CONNECT for https://); the only request to the \
                 gateway itself is POST {REPORT_PATH}, not {} {}",
                request.method(),
                request.uri().path()
            )));
        }
        if request.method() != Method::POST {
            return Err(GatewayError::bad_request(format!("{REPORT_PATH} takes POST, not {}", request.method())));
        }
        let target = report_target(request.uri().query().unwrap_or_default())?;
        let report = who.report.ok_or_else(|| {
            GatewayError::bad_request(format!(
                "POST {REPORT_PATH} takes {REPORT_HEADER}: banned, or throttled[; retry-after=<seconds>]"
            ))
        })?;
        tracing::Span::current().record("host", target.host());
        let route = RouteRequest {
            tenant: who.tenant,
            token: who.token,
            host: target.host(),
            port: target.port_u16().unwrap_or(443),
            options: who.options,
            connect: false,
            report: None,
        };
        let proxy = self.router.report(&route, report).await?;
        tracing::Span::current().record("proxy", proxy.as_str());
        let body = serde_json::json!({ "proxy": proxy, "target": target.host() }).to_string();
        let mut response = Response::new(full(Bytes::from(body)));
        response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Ok(value) = HeaderValue::from_str(&proxy) {
            response.headers_mut().insert(PROXY_HEADER, value);
        }
        Ok(response)
    }

    async fn forward(&self, request: Request<Incoming>, who: Who<'_>) -> Result<Response<Body>, GatewayError> {
        let uri = request.uri().clone();
        if uri.scheme() != Some(&Scheme::HTTP) {
            return Err(GatewayError::bad_request(
                "the gateway forwards absolute http:// URLs; send https:// through CONNECT (any HTTPS-capable client does)",
            ));
        }
        let host = uri
            .host()
            .filter(|host| !host.is_empty())
            .ok_or_else(|| GatewayError::bad_request("the URL has no host"))?;
        if uri.port_u16() == Some(0) {
            return Err(GatewayError::bad_request("the URL's port is 0"));
        }
        tracing::Span::current().record("host", host);
        let route = RouteRequest {
            tenant: who.tenant,
            token: who.token,
            host,
            port: uri.port_u16().unwrap_or(80),
            options: who.options,
            connect: false,
            report: who.report,
        };
        let (mut parts, body) = request.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        // The report is the gateway's to act on, not the site's to see.
        parts.headers.remove(REPORT_HEADER);
        parts.version = Version::HTTP_11;
        // Tried again elsewhere only when sending it twice cannot do anything twice, and there is no body to keep.
        let retryable = self.limits.retries > 0 && is_idempotent(&parts.method) && body.is_end_stream();
        let mut body = Some(body.boxed());
        let mut blocked: Option<Response<Body>> = None;
        for attempt in 0..=self.limits.retries {
            let upstream = match self.router.route(&route).await {
                Ok(upstream) => upstream,
                // No other proxy to try: the site's answer it is.
                Err(_) if blocked.is_some() => break,
                Err(error) => return Err(error),
            };
            let mut head = Request::new(body.take().unwrap_or_else(|| full(Bytes::new())));
            *head.method_mut() = parts.method.clone();
            *head.uri_mut() = parts.uri.clone();
            *head.version_mut() = Version::HTTP_11;
            *head.headers_mut() = parts.headers.clone();
            if let Some(authorization) = &upstream.authorization {
                head.headers_mut().insert(header::PROXY_AUTHORIZATION, authorization.clone());
            }
            let (response, verdict) = self.send(&route, upstream, head).await?;
            if verdict == Verdict::Accepted || !retryable || attempt == self.limits.retries {
                return Ok(response);
            }
            debug!(host = route.host, attempt, "the site blocked the proxy; trying another");
            self.metrics.retried(who.tenant);
            blocked = Some(response);
        }
        blocked.ok_or_else(|| GatewayError::internal("no attempt was made"))
    }

    /// Sends one request through `upstream`; returns the answer to pass on, and what the router made of it.
    async fn send(
        &self,
        route: &RouteRequest<'_>,
        upstream: Upstream,
        request: Request<Body>,
    ) -> Result<(Response<Body>, Verdict), GatewayError> {
        let route = *route;
        tracing::Span::current().record("proxy", upstream.proxy.as_str());
        let client = self.client(&upstream);
        self.metrics.proxied(&upstream.proxy, "plain");
        let answer =
            tokio::time::timeout(self.limits.connect_timeout.max(Duration::from_secs(60)), client.request(request))
                .await;
        let response = match answer {
            Ok(Ok(response)) => response,
            Ok(Err(error)) => {
                self.router.outcome(&route, &upstream, Routed::Failed).await;
                let kind = if error.is_connect() { "connection_refused" } else { "http_response_incomplete" };
                return Err(GatewayError::upstream(kind, format!("proxy {}: {}", upstream.proxy, error_chain(&error))));
            }
            Err(_) => {
                self.router.outcome(&route, &upstream, Routed::Failed).await;
                return Err(GatewayError::upstream_timeout(format!("proxy {} sent no answer in time", upstream.proxy)));
            }
        };
        // The proxy's own refusal (its destination policy), not the site's: no ban to report, nothing to retry.
        if response.status() == http::StatusCode::FORBIDDEN
            && let Some(policy) = response.headers().get(POLICY_HEADER)
        {
            let policy = String::from_utf8_lossy(policy.as_bytes()).into_owned();
            return Err(policy_denial(&upstream.proxy, route.host, Some(policy)));
        }
        let retry_after = response
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let verdict = self.router.outcome(&route, &upstream, Routed::Answered(response.status(), retry_after)).await;
        let (mut parts, body) = response.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        identify(&mut parts.headers, &upstream);
        let body = match upstream.hold {
            Some(hold) => Holding { inner: body.boxed(), _hold: hold }.boxed(),
            None => body.boxed(),
        };
        Ok((Response::from_parts(parts, body), verdict))
    }

    /// The pooled client for `upstream`.
    fn client(&self, upstream: &Upstream) -> UpstreamClient {
        let mut clients = self.clients.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        clients
            .entry(upstream.address.clone())
            .or_insert_with(|| {
                let connector = UpstreamConnector {
                    address: upstream.address.clone().into(),
                    timeout: self.limits.connect_timeout,
                };
                Client::builder(TokioExecutor::new())
                    .pool_idle_timeout(Duration::from_secs(90))
                    .pool_timer(TokioTimer::new())
                    .build(connector)
            })
            .clone()
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

/// Removes the headers that belong to one hop: the standard ones and those `Connection` names.
/// The `X-Egress-Report` of a request, which takes a session to report on.
fn reported(headers: &HeaderMap, options: &Options) -> Result<Option<Report>, GatewayError> {
    let Some(value) = headers.get(REPORT_HEADER) else { return Ok(None) };
    let value = value.to_str().map_err(|_| GatewayError::bad_request(format!("{REPORT_HEADER} is not ASCII")))?;
    let report = Report::parse(value).map_err(GatewayError::bad_request)?;
    if options.session.is_none() {
        return Err(GatewayError::bad_request(format!(
            "{REPORT_HEADER} reports the proxy of a session: put session-<id> in the proxy user name"
        )));
    }
    Ok(Some(report))
}

/// The site of a `POST /report`: its `target=` query parameter, a host or `host:port` (percent-encoded or not).
fn report_target(query: &str) -> Result<http::uri::Authority, GatewayError> {
    let value = query.split('&').find_map(|pair| pair.strip_prefix("target=")).ok_or_else(|| {
        GatewayError::bad_request(format!("POST {REPORT_PATH} takes ?target=<host> (the site refused)"))
    })?;
    let value = percent_encoding::percent_decode_str(value).decode_utf8_lossy().into_owned();
    value
        .parse::<http::uri::Authority>()
        .ok()
        .filter(|target| !target.host().is_empty() && !target.as_str().contains('@') && target.port_u16() != Some(0))
        .ok_or_else(|| GatewayError::bad_request(format!("the report's target {value:?} is not a host or host:port")))
}

/// Whether sending a request with `method` twice has the effect of sending it once (RFC 9110, 9.2.2).
fn is_idempotent(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE)
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in listed {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
}

/// Adds the headers naming the proxy and lease a request went through.
fn identify(headers: &mut HeaderMap, upstream: &Upstream) {
    if let Ok(proxy) = HeaderValue::from_str(&upstream.proxy) {
        headers.insert(PROXY_HEADER, proxy);
    }
    if let Some(lease) = upstream.lease.as_deref().and_then(|lease| HeaderValue::from_str(lease).ok()) {
        headers.insert(LEASE_HEADER, lease);
    }
}

/// Carries a tunnel between `client` and the proxy's `upstream` until either side ends it or the site refuses the
/// proxy: first what the client sent past its CONNECT head (`early`) and what the proxy sent past its answer
/// (`leftover`), then both ways.
async fn carry<C>(
    mut client: C,
    early: &[u8],
    mut upstream: TcpStream,
    leftover: &[u8],
    buffers: Buffers,
    revoked: &Upstream,
    gauge: &mut crate::metrics::TunnelGauge,
) where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    if !early.is_empty() && upstream.write_all(early).await.is_err() {
        return;
    }
    if !leftover.is_empty() && client.write_all(leftover).await.is_err() {
        return;
    }
    tokio::select! {
        copied = splice(&mut client, &mut upstream, buffers) => match copied {
            Ok((up, down)) => gauge.carried(up, down),
            Err(error) => debug!(%error, "tunnel ended with an error"),
        },
        () = revoked.revocation() => {
            debug!(proxy = %revoked.proxy, "closing a tunnel: its proxy was refused by the site");
            gauge.revoked();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "keep-alive, x-private"),
            ("x-private", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "keep-alive"),
            ("proxy-authorization", "Basic abc"),
            ("te", "trailers"),
            ("accept", "*/*"),
        ] {
            headers.append(name, HeaderValue::from_static(value));
        }
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers.keys().map(HeaderName::as_str).collect::<Vec<_>>(), ["accept"]);
    }
}
