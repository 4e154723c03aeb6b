//! A small async client for the egress-operator discovery API.
//!
//! ```no_run
//! # async fn crawl() -> Result<(), egress_client::ClientError> {
//! use egress_client::{DiscoveryClient, LeaseOptions, Outcome};
//! let client = DiscoveryClient::new("http://egress-discovery.egress-system:8090", Some("lease-token".into()))?;
//! let lease = client.lease(LeaseOptions::for_target("shop.example.com")).await?;
//! // Use lease.proxy_url() as the HTTP client's proxy (for reqwest: reqwest::Proxy::all(lease.proxy_url())).
//! lease.report(Outcome::Banned, Some(403)).await?;
//! lease.release().await?; // or drop it: the guard releases in the background
//! # Ok(()) }
//! ```
//!
//! While the operator changes leader (a rolling restart, a drain, a crash), the discovery Service briefly has no
//! replica that serves: a call retries refused and reset connections and `not-serving` answers, quickly, for up to
//! [`DEFAULT_FAILOVER_BUDGET`] (see [`DiscoveryClient::failover_budget`]) before it returns the error.
//!
//! Errors are typed: no eligible proxy is [`ClientError::Unavailable`] with the server's reason and `Retry-After`,
//! a named proxy that is cooling down or full is [`ClientError::Conflict`], a revoked lease is
//! [`ClientError::Gone`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http::{Method, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// What happened with a leased proxy, for [`LeaseGuard::report`]: the type the lease store and the gateway share.
pub use egress_fleet::Outcome;
pub use egress_fleet::ProxyId;
pub use egress_wire::{Credentials, OwnedLease, ProxyRef};
pub use refusals::{REFUSAL_STREAM_SILENCE, RefusalEvent, RefusalStream};

mod refusals;
use serde_json::{Value, json};

/// What went wrong with a call.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// The base URL is not an `http://` URL.
    #[error("invalid discovery URL {0:?}: it must be http://host:port")]
    InvalidUrl(String),
    /// 503: no proxy can be leased now (or the server is not serving).
    #[error("no proxy available ({reason}): {detail}")]
    Unavailable {
        /// `none-healthy`, `all-at-capacity`, `all-cooling-down`, `scaling-up`, `not-serving`.
        reason: String,
        /// The server's explanation.
        detail: String,
        /// When to try again.
        retry_after: Option<Duration>,
    },
    /// 409: the named proxy is cooling down for the target, full, drained or unhealthy.
    #[error("the proxy cannot be leased ({reason}): {detail}")]
    Conflict {
        /// `proxy-cooling-down` or `proxy-unavailable`.
        reason: String,
        /// The server's explanation.
        detail: String,
        /// When to try again, for a cooldown.
        retry_after: Option<Duration>,
    },
    /// 429: the tenant's quota is used up.
    #[error("the tenant's quota is used up ({reason}): {detail}")]
    QuotaExceeded {
        /// `quota-max-leases` (release a lease first) or `quota-reports-per-minute`.
        reason: String,
        /// The server's explanation.
        detail: String,
        /// When to try again.
        retry_after: Option<Duration>,
    },
    /// 404: no such lease or proxy.
    #[error("not found: {0}")]
    NotFound(String),
    /// 410: the lease was revoked.
    #[error("the lease was revoked: {0}")]
    Gone(String),
    /// 401: missing or unknown token.
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    /// 403: the token's scope is too small.
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// 400: the request was invalid.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// 400 `ttl-above-tenant-max`: the TTL asked for is above the tenant's `maxLeaseSeconds`; ask within `max`.
    #[error("bad request: {detail}")]
    TtlAboveTenantMax {
        /// The longest lease the tenant may ask for.
        max: Duration,
        /// The server's words.
        detail: String,
    },
    /// Any other status.
    #[error("unexpected status {status}: {detail}")]
    Status {
        /// The status code.
        status: u16,
        /// The body's detail, or the body.
        detail: String,
    },
    /// The request did not complete.
    #[error("transport error: {0}")]
    Transport(String),
    /// The answer was not what the API promises.
    #[error("unexpected response: {0}")]
    Decode(String),
}

/// What to lease.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaseOptions {
    target: String,
    selector: Option<String>,
    ttl: Option<Duration>,
    proxy: Option<String>,
    session: Option<String>,
    session_lifetime: Option<Duration>,
    session_max_leases: Option<u32>,
    pool: Option<String>,
    zone: Option<String>,
    provider: Option<String>,
}

impl LeaseOptions {
    /// A lease for the site `target` (a host name or URL).
    pub fn for_target(target: impl Into<String>) -> Self {
        Self { target: target.into(), ..Self::default() }
    }
    /// Only proxies matching this label selector.
    pub fn selector(mut self, selector: impl Into<String>) -> Self {
        self.selector = Some(selector.into());
        self
    }
    /// How long the lease lasts unless renewed (whole seconds, 1 to 3600).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }
    /// A specific proxy (parse one from its `namespace/name` form with `str::parse`).
    pub fn proxy(mut self, proxy: &ProxyId) -> Self {
        self.proxy = Some(proxy.to_string());
        self
    }
    /// A sticky-session key.
    pub fn session(mut self, session: impl Into<String>) -> Self {
        self.session = Some(session.into());
        self
    }
    /// The longest the session keeps one proxy, from the lease that chose it (whole seconds, 1 to 86400): its first
    /// lease after that goes to another proxy. Needs [`LeaseOptions::session`].
    pub fn session_lifetime(mut self, lifetime: Duration) -> Self {
        self.session_lifetime = Some(lifetime);
        self
    }
    /// The most leases the session takes on one proxy (1 to 1000000) before its next goes to another. Needs
    /// [`LeaseOptions::session`].
    pub fn session_max_leases(mut self, leases: u32) -> Self {
        self.session_max_leases = Some(leases);
        self
    }
    /// Only members of this ProxyPool (`namespace/name`, or a name only one namespace has). A pool getting its
    /// first members answers [`ClientError::Unavailable`] with reason `scaling-up` and a `retry_after`.
    pub fn pool(mut self, pool: impl Into<String>) -> Self {
        self.pool = Some(pool.into());
        self
    }
    /// Only proxies in this zone (a Proxy's `placement.zone`, as [`ProxyInfo::zone`] lists it).
    pub fn zone(mut self, zone: impl Into<String>) -> Self {
        self.zone = Some(zone.into());
        self
    }
    /// Only proxies on this provider (a Managed Proxy's `provider`, as [`ProxyInfo::provider`] lists it).
    pub fn provider(mut self, provider: impl Into<String>) -> Self {
        self.provider = Some(provider.into());
        self
    }
}

/// A proxy as the API lists it (the wire type, under the name this crate always gave it).
pub type ProxyInfo = egress_wire::Proxy;

/// A proxy's ban cooldown policy (the wire type, under the name this crate always gave it).
pub type CooldownPolicyInfo = egress_wire::CooldownPolicy;

/// A live cooldown as the API lists it (the wire type, under the name this crate always gave it).
pub type CooldownInfo = egress_wire::Cooldown;

struct Inner {
    base: String,
    token: Option<String>,
    http: Client<HttpConnector, Full<Bytes>>,
    failover_budget: Duration,
}

/// How long a call keeps retrying while no replica serves: the shipped Lease duration (15 s, the bound of a takeover
/// after a leader is killed) twice over.
pub const DEFAULT_FAILOVER_BUDGET: Duration = Duration::from_secs(30);

/// The first pause between retries during a change of leader; it doubles up to [`MAX_RETRY_PAUSE`].
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(50);
const MAX_RETRY_PAUSE: Duration = Duration::from_millis(250);

/// Whether a failed request met a Service without a serving replica: the connection was refused, or closed or reset
/// before an answer (a replica that stopped or was killed).
fn no_replica(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(error) = cause {
        if let Some(error) = error.downcast_ref::<hyper_util::client::legacy::Error>()
            && error.is_connect()
        {
            return true;
        }
        if let Some(error) = error.downcast_ref::<hyper::Error>()
            && (error.is_incomplete_message() || error.is_canceled() || error.is_closed())
        {
            return true;
        }
        if let Some(error) = error.downcast_ref::<std::io::Error>()
            && matches!(
                error.kind(),
                std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            )
        {
            return true;
        }
        cause = error.source();
    }
    false
}

/// A client; cloning shares its connection pool.
#[derive(Clone)]
pub struct DiscoveryClient(Arc<Inner>);

/// A JSON answer, decoded.
fn decode<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ClientError> {
    serde_json::from_slice(body).map_err(|error| ClientError::Decode(error.to_string()))
}

/// Everything but RFC 3986's unreserved characters, which a query value carries as they are.
const NOT_UNRESERVED: &percent_encoding::AsciiSet =
    &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

fn encode(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, NOT_UNRESERVED).to_string()
}

/// A transport error with every cause in its chain (hyper's own message says only which step failed, such as
/// `client error (SendRequest)`; the cause says why, such as `connection closed before message completed`).
fn transport(error: &(dyn std::error::Error + 'static)) -> ClientError {
    ClientError::Transport(egress_fleet::error_chain(error))
}

/// The `Retry-After` of an answer, in seconds.
fn retry_after(headers: &http::HeaderMap) -> Option<Duration> {
    headers
        .get(header::RETRY_AFTER)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok())
        .map(Duration::from_secs)
}

/// The error an unsuccessful answer stands for, and whether it came from a replica that does not serve (so the call
/// may be tried again at once).
fn error_of(status: StatusCode, bytes: &[u8], retry_after: Option<Duration>) -> (ClientError, bool) {
    let problem: Value = serde_json::from_slice(bytes).unwrap_or(Value::Null);
    let detail = problem["detail"].as_str().map_or_else(|| String::from_utf8_lossy(bytes).into_owned(), str::to_owned);
    let reason = problem["reason"].as_str().unwrap_or_default().to_owned();
    // A follower, or a leader handing over: the Service sends the next connection to the leader.
    let retry = status == StatusCode::SERVICE_UNAVAILABLE && reason == "not-serving";
    // A paced slot is finer than Retry-After's whole seconds: the problem says it to the millisecond.
    let retry_after = problem["retryAfterMilliseconds"].as_u64().map(Duration::from_millis).or(retry_after);
    let error = match status {
        StatusCode::SERVICE_UNAVAILABLE => ClientError::Unavailable { reason, detail, retry_after },
        StatusCode::CONFLICT => ClientError::Conflict { reason, detail, retry_after },
        StatusCode::TOO_MANY_REQUESTS => ClientError::QuotaExceeded { reason, detail, retry_after },
        StatusCode::NOT_FOUND => ClientError::NotFound(detail),
        StatusCode::GONE => ClientError::Gone(detail),
        StatusCode::UNAUTHORIZED => ClientError::Unauthorized(detail),
        StatusCode::FORBIDDEN => ClientError::Forbidden(detail),
        StatusCode::BAD_REQUEST => match problem["maxLeaseSeconds"].as_u64() {
            Some(max) if reason == "ttl-above-tenant-max" => {
                ClientError::TtlAboveTenantMax { max: Duration::from_secs(max), detail }
            }
            _ => ClientError::BadRequest(detail),
        },
        other => ClientError::Status { status: other.as_u16(), detail },
    };
    (error, retry)
}

impl DiscoveryClient {
    /// A client for the API at `base_url` (`http://host:port`), sending `token` as the bearer token.
    pub fn new(base_url: &str, token: Option<String>) -> Result<Self, ClientError> {
        let base = base_url.trim_end_matches('/').to_owned();
        let uri: Uri = base.parse().map_err(|_| ClientError::InvalidUrl(base_url.to_owned()))?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err(ClientError::InvalidUrl(base_url.to_owned()));
        }
        let http = Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(30)).build_http();
        Ok(Self(Arc::new(Inner { base, token, http, failover_budget: DEFAULT_FAILOVER_BUDGET })))
    }

    /// How long each call keeps retrying while the discovery Service has no serving replica (refused or reset
    /// connections, `not-serving` answers), [`DEFAULT_FAILOVER_BUDGET`] unless set; `Duration::ZERO` turns retrying
    /// off. A lease whose answer was lost when its leader was killed stays held (unknown to the caller) until its TTL.
    #[must_use]
    pub fn failover_budget(self, budget: Duration) -> Self {
        let inner = &self.0;
        Self(Arc::new(Inner {
            base: inner.base.clone(),
            token: inner.token.clone(),
            http: inner.http.clone(),
            failover_budget: budget,
        }))
    }

    /// One call, retried during a change of leader within the failover budget.
    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> Result<(StatusCode, Bytes), ClientError> {
        let body = body.map(|body| Bytes::from(body.to_string()));
        let started = tokio::time::Instant::now();
        let mut pause = FIRST_RETRY_PAUSE;
        loop {
            let (result, retry) = self.call_once(method.clone(), path, body.clone()).await;
            if !retry || started.elapsed() + pause > self.0.failover_budget {
                return result;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_RETRY_PAUSE);
        }
    }

    /// Sends one request; the answer's head, or the error and whether it met no serving replica.
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
    ) -> Result<http::Response<hyper::body::Incoming>, (ClientError, bool)> {
        let mut request = Request::builder().method(method).uri(format!("{}{path}", self.0.base));
        if let Some(token) = &self.0.token {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let body = match body {
            Some(body) => {
                request = request.header(header::CONTENT_TYPE, "application/json");
                Full::new(body)
            }
            None => Full::new(Bytes::new()),
        };
        let request = request.body(body).map_err(|error| (transport(&error), false))?;
        self.0.http.request(request).await.map_err(|error| (transport(&error), no_replica(&error)))
    }

    /// One attempt, and whether it met no serving replica (so it may be retried).
    async fn call_once(
        &self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
    ) -> (Result<(StatusCode, Bytes), ClientError>, bool) {
        let response = match self.send(method, path, body).await {
            Ok(response) => response,
            Err((error, retry)) => return (Err(error), retry),
        };
        let status = response.status();
        let retry_after = retry_after(response.headers());
        let bytes = match response.into_body().collect().await {
            Ok(body) => body.to_bytes(),
            Err(error) => return (Err(transport(&error)), false),
        };
        if status.is_success() {
            return (Ok((status, bytes)), false);
        }
        let (error, retry) = error_of(status, &bytes, retry_after);
        (Err(error), retry)
    }

    /// Follows the refusals (bans, throttles) the token's tenant reports, from any client: first the tenant's live
    /// cooldowns, then [`RefusalEvent::Synced`], then each refusal as the discovery API takes it. The stream ends
    /// (`Ok(None)` or an error) when the replica stops serving, after a change of leader for example: follow it
    /// again, which sends the live cooldowns again, so nothing falls between.
    pub async fn refusals(&self) -> Result<RefusalStream, ClientError> {
        let response = self.send(Method::GET, "/v1/refusals", None).await.map_err(|(error, _)| error)?;
        let status = response.status();
        if !status.is_success() {
            let retry_after = retry_after(response.headers());
            let bytes = response.into_body().collect().await.map_err(|error| transport(&error))?.to_bytes();
            return Err(error_of(status, &bytes, retry_after).0);
        }
        Ok(RefusalStream::new(response.into_body()))
    }

    /// Healthy proxies, optionally filtered by a label selector, with their cooldown for `target`.
    pub async fn proxies(&self, selector: Option<&str>, target: Option<&str>) -> Result<Vec<ProxyInfo>, ClientError> {
        let mut query = Vec::new();
        if let Some(selector) = selector {
            query.push(format!("selector={}", encode(selector)));
        }
        if let Some(target) = target {
            query.push(format!("target={}", encode(target)));
        }
        let path = if query.is_empty() { "/v1/proxies".to_owned() } else { format!("/v1/proxies?{}", query.join("&")) };
        let (_, body) = self.call(Method::GET, &path, None).await?;
        Ok(decode::<egress_wire::ProxyList>(&body)?.proxies)
    }

    /// Live cooldowns, for one target or all: which proxy may not be leased for which site until when.
    pub async fn cooldowns(&self, target: Option<&str>) -> Result<Vec<CooldownInfo>, ClientError> {
        let path = match target {
            Some(target) => format!("/v1/cooldowns?target={}", encode(target)),
            None => "/v1/cooldowns".to_owned(),
        };
        let (_, body) = self.call(Method::GET, &path, None).await?;
        Ok(decode::<egress_wire::CooldownList>(&body)?.cooldowns)
    }

    /// Ends the cooldowns for `target` now and forgets their streaks (an `admin` token): of `proxy`
    /// (`namespace/name`) and the proxies sharing its egress IP, or of every proxy. Returns the cooldowns that were
    /// running.
    pub async fn clear_cooldowns(
        &self,
        target: &str,
        proxy: Option<&ProxyId>,
    ) -> Result<Vec<CooldownInfo>, ClientError> {
        let mut path = format!("/v1/cooldowns?target={}", encode(target));
        if let Some(proxy) = proxy {
            path.push_str(&format!("&proxy={}", encode(proxy.as_str())));
        }
        let (_, body) = self.call(Method::DELETE, &path, None).await?;
        Ok(decode::<egress_wire::ClearedCooldowns>(&body)?.cleared)
    }

    /// Ends this token's tenant's `session` (every site), or all of its sessions: their leases are released, wherever
    /// held, and the proxies they kept forgotten (`DELETE /v1/sessions`).
    pub async fn end_sessions(&self, session: Option<&str>) -> Result<egress_wire::EndedSessions, ClientError> {
        let path = session
            .map_or_else(|| "/v1/sessions".to_owned(), |session| format!("/v1/sessions?session={}", encode(session)));
        let (_, body) = self.call(Method::DELETE, &path, None).await?;
        decode(&body)
    }

    /// Picks up a lease by its ID (one a crawler kept across its own restart, or took through another client):
    /// renews it by `ttl` (or the server's default) and returns its guard, with the proxy's current URL.
    pub async fn resume(&self, id: &str, ttl: Option<Duration>) -> Result<LeaseGuard, ClientError> {
        let body = ttl.map_or_else(|| json!({}), |ttl| json!({ "ttlSeconds": ttl.as_secs() }));
        let (_, bytes) = self.call(Method::POST, &format!("/v1/leases/{}/renew", encode(id)), Some(body)).await?;
        let lease: OwnedLease = decode(&bytes)?;
        Ok(LeaseGuard { client: self.clone(), lease, released: AtomicBool::new(false) })
    }

    /// Leases a proxy.
    pub async fn lease(&self, options: LeaseOptions) -> Result<LeaseGuard, ClientError> {
        let mut body = json!({ "target": options.target });
        if let Some(selector) = options.selector {
            body["selector"] = json!(selector);
        }
        if let Some(ttl) = options.ttl {
            body["ttlSeconds"] = json!(ttl.as_secs());
        }
        if let Some(proxy) = options.proxy {
            body["proxy"] = json!(proxy);
        }
        if let Some(session) = options.session {
            body["session"] = json!(session);
        }
        if let Some(lifetime) = options.session_lifetime {
            body["sessionLifetimeSeconds"] = json!(lifetime.as_secs());
        }
        if let Some(leases) = options.session_max_leases {
            body["sessionMaxLeases"] = json!(leases);
        }
        for (key, value) in [("pool", options.pool), ("zone", options.zone), ("provider", options.provider)] {
            if let Some(value) = value {
                body[key] = json!(value);
            }
        }
        let (_, bytes) = self.call(Method::POST, "/v1/leases", Some(body)).await?;
        let lease: OwnedLease = decode(&bytes)?;
        Ok(LeaseGuard { client: self.clone(), lease, released: AtomicBool::new(false) })
    }
}

/// A held lease. Dropping it releases it in the background (on a tokio runtime); [`LeaseGuard::release`] does it
/// now and reports the result.
pub struct LeaseGuard {
    client: DiscoveryClient,
    lease: OwnedLease,
    released: AtomicBool,
}

impl LeaseGuard {
    /// The lease's identifier.
    pub fn id(&self) -> &str {
        &self.lease.id
    }

    /// The leased proxy.
    pub fn proxy(&self) -> ProxyId {
        ProxyId::new(&self.lease.proxy.namespace, &self.lease.proxy.name)
    }

    /// The proxy URL, `http://[user:password@]host:port`, usable as any HTTP client's proxy (for reqwest:
    /// `reqwest::Proxy::all(guard.proxy_url())`).
    pub fn proxy_url(&self) -> &str {
        &self.lease.proxy.url
    }

    /// The leased proxy as the API answered it: host, port and credentials as fields (for a client that connects
    /// to the proxy itself rather than handing [`LeaseGuard::proxy_url`] to an HTTP client).
    pub fn proxy_ref(&self) -> &ProxyRef<'static> {
        &self.lease.proxy
    }

    /// The address sites see requests through the proxy come from, once its probes observed it. Proxies that share
    /// it share cooldowns: after a ban or a throttle, drop every lease held on a proxy with the same address.
    pub fn egress_ip(&self) -> Option<&str> {
        self.lease.proxy.egress_ip.as_deref()
    }

    /// The normalised target.
    pub fn target(&self) -> &str {
        &self.lease.target
    }

    /// For a session with a lifetime ([`LeaseOptions::session_lifetime`]): how long, from when the lease was
    /// answered, the session keeps this proxy; its next lease after that goes to another.
    pub fn session_ends_in(&self) -> Option<Duration> {
        self.lease.session_ends_in_milliseconds.map(Duration::from_millis)
    }

    /// When the lease expires unless renewed (RFC 3339).
    pub fn expires_at(&self) -> &str {
        &self.lease.expires_at
    }

    /// Extends the lease. Returns whether the proxy's instance was replaced since this guard last heard of it:
    /// then [`LeaseGuard::proxy_url`] has changed, and requests must go to the new URL from now on (the old
    /// instance is kept only until its holders have renewed, or a drain timeout). The guard keeps the renewed ID.
    pub async fn renew(&mut self, ttl: Option<Duration>) -> Result<bool, ClientError> {
        let body = ttl.map_or_else(|| json!({}), |ttl| json!({ "ttlSeconds": ttl.as_secs() }));
        let (_, bytes) =
            self.client.call(Method::POST, &format!("/v1/leases/{}/renew", encode(&self.lease.id)), Some(body)).await?;
        let renewed: OwnedLease = decode(&bytes)?;
        let replaced = renewed.replaced.unwrap_or(false);
        self.lease = renewed;
        Ok(replaced)
    }

    /// Reports what happened; for a ban or a throttle, returns when the proxy's cooldown for this site ends.
    pub async fn report(&self, outcome: Outcome, status_code: Option<u16>) -> Result<Option<String>, ClientError> {
        let (outcome, retry_after) = match outcome {
            Outcome::Ok => ("ok", None),
            Outcome::Banned => ("banned", None),
            Outcome::Throttled { retry_after } => ("throttled", retry_after),
            Outcome::Failed => ("failed", None),
        };
        let mut body = json!({ "outcome": outcome });
        if let Some(code) = status_code {
            body["statusCode"] = json!(code);
        }
        if let Some(retry_after) = retry_after {
            body["retryAfterSeconds"] = json!(retry_after.as_secs().clamp(1, 86_400));
        }
        self.send_report(body).await
    }

    /// Reports counts of requests made through the lease since the last report (cheap enough to send in batches:
    /// they feed `successRate` and start no cooldown).
    pub async fn report_counts(&self, ok: u32, failed: u32) -> Result<(), ClientError> {
        self.send_report(json!({ "ok": ok, "failed": failed })).await.map(|_| ())
    }

    async fn send_report(&self, body: Value) -> Result<Option<String>, ClientError> {
        let (_, bytes) = self
            .client
            .call(Method::POST, &format!("/v1/leases/{}/report", encode(&self.lease.id)), Some(body))
            .await?;
        let result: Value = decode(&bytes)?;
        Ok(result["cooldownUntil"].as_str().map(str::to_owned))
    }

    /// Releases the lease now.
    pub async fn release(self) -> Result<(), ClientError> {
        self.released.store(true, Ordering::SeqCst);
        self.client.call(Method::DELETE, &format!("/v1/leases/{}", encode(&self.lease.id)), None).await.map(|_| ())
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if self.released.swap(true, Ordering::SeqCst) {
            return;
        }
        // Without a runtime there is nothing to send with; the lease then expires by its TTL.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let client = self.client.clone();
            let path = format!("/v1/leases/{}", encode(&self.lease.id));
            runtime.spawn(async move {
                let _ = client.call(Method::DELETE, &path, None).await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_http_urls_are_accepted() {
        assert!(DiscoveryClient::new("http://127.0.0.1:8090", None).is_ok());
        for bad in ["https://x:1", "127.0.0.1:8090", "not a url", ""] {
            assert!(matches!(DiscoveryClient::new(bad, None), Err(ClientError::InvalidUrl(_))), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn a_transport_error_says_why() {
        use tokio::io::AsyncReadExt;
        // A server that reads each request and closes its connection without answering.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let server = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut buffer = [0; 1024];
                let _ = stream.read(&mut buffer).await;
            }
        });
        let client =
            DiscoveryClient::new(&format!("http://{address}"), None).expect("client").failover_budget(Duration::ZERO);
        let error = client.proxies(None, None).await.expect_err("no answer");
        server.abort();
        let ClientError::Transport(text) = error else { panic!("{error:?}") };
        assert!(text.starts_with("client error (SendRequest): "), "{text}");
        assert!(text.contains("connection closed before message completed"), "{text}");
    }

    /// Answers each request on its own connection with the next of `answers` (status, body), closing after each;
    /// counts the requests.
    async fn answering(
        listener: tokio::net::TcpListener,
        answers: Vec<(u16, &'static str)>,
    ) -> (tokio::task::JoinHandle<()>, Arc<std::sync::atomic::AtomicUsize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = count.clone();
        let server = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut buffer = [0; 4096];
                let _ = stream.read(&mut buffer).await;
                let index = counted.fetch_add(1, Ordering::SeqCst);
                let (status, body) = answers[index.min(answers.len() - 1)];
                let answer = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
                     connection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
            }
        });
        (server, count)
    }

    const NOT_SERVING: (u16, &str) = (503, r#"{"status":503,"reason":"not-serving","detail":"handing over"}"#);
    const EMPTY: (u16, &str) = (200, r#"{"proxies":[]}"#);

    #[tokio::test]
    async fn a_change_of_leader_is_waited_out_within_the_budget() {
        // Nobody listens at first (the Service has no endpoint), then a follower refuses twice, then the leader serves.
        let address = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            listener.local_addr().expect("address")
        };
        let client = DiscoveryClient::new(&format!("http://{address}"), None).expect("client");
        let started = std::time::Instant::now();
        let call = tokio::spawn(async move { client.proxies(None, None).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let listener = tokio::net::TcpListener::bind(address).await.expect("the same port again");
        let (server, count) = answering(listener, vec![NOT_SERVING, NOT_SERVING, EMPTY]).await;
        let proxies = call.await.expect("the call").expect("served once the leader is back");
        assert!(proxies.is_empty());
        assert_eq!(count.load(Ordering::SeqCst), 3, "two refusals, then the answer");
        assert!(started.elapsed() >= Duration::from_millis(300));
        server.abort();
    }

    #[tokio::test]
    async fn past_the_budget_the_refusal_is_returned_and_other_errors_are_never_retried() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let (server, count) = answering(listener, vec![NOT_SERVING]).await;
        let client = DiscoveryClient::new(&format!("http://{address}"), None)
            .expect("client")
            .failover_budget(Duration::from_millis(400));
        let started = std::time::Instant::now();
        match client.proxies(None, None).await {
            Err(ClientError::Unavailable { reason, .. }) => assert_eq!(reason, "not-serving"),
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(count.load(Ordering::SeqCst) >= 3, "{count:?}");
        server.abort();

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let (server, count) =
            answering(listener, vec![(503, r#"{"status":503,"reason":"none-healthy","detail":"no proxy"}"#)]).await;
        let client = DiscoveryClient::new(&format!("http://{address}"), None).expect("client");
        assert!(matches!(client.proxies(None, None).await, Err(ClientError::Unavailable { .. })));
        assert_eq!(count.load(Ordering::SeqCst), 1, "an answer about the fleet is the caller's to act on");
        server.abort();
    }

    #[test]
    fn query_values_are_encoded() {
        assert_eq!(encode("region=eu,tier!=x"), "region%3Deu%2Ctier%21%3Dx");
    }
}
