//! The routes, their request and response bodies, and the mapping of every failure to a problem document.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, FromRequestParts, MatchedPath, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;

use crate::Discovery;
use crate::auth::{Auth, Identity, Scope};
use crate::problem::Problem;
use crate::server::MAX_BODY_BYTES;

mod cooldowns;
mod leases;
mod proxies;
mod refusals;
mod sessions;

use cooldowns::{clear_cooldowns, list_cooldowns};
use leases::{create_lease, release_lease, renew_lease, report_lease};
use proxies::list_proxies;

pub mod openapi;

pub use refusals::HEARTBEAT;

/// The longest lease a request may ask for, in seconds.
const MAX_TTL_SECONDS: u64 = 3600;
/// The TTL of a lease that asks for none (the lease store's default), in seconds.
const DEFAULT_TTL_SECONDS: u64 = 300;

type Shared = State<Arc<Discovery>>;

pub fn routes(state: Arc<Discovery>) -> Router {
    Router::new()
        .route("/v1/proxies", get(list_proxies))
        .route("/v1/leases", post(create_lease))
        .route("/v1/leases/{id}", axum::routing::delete(release_lease))
        .route("/v1/leases/{id}/renew", post(renew_lease))
        .route("/v1/leases/{id}/report", post(report_lease))
        .route("/v1/cooldowns", get(list_cooldowns).delete(clear_cooldowns))
        .route("/v1/sessions", axum::routing::delete(sessions::end_sessions))
        .route("/v1/refusals", get(refusals::watch_refusals))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/openapi.json", get(|| async { Json(openapi::document()) }))
        .fallback(|| async { Problem::not_found("no such route; see /openapi.json") })
        .method_not_allowed_fallback(|| async {
            Problem::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "Method not allowed",
                "this route does not take that method; see /openapi.json",
            )
        })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(Forward { inner: (), state: state.clone() })
        .layer(Observe { inner: (), state: state.clone() })
        .with_state(state)
}

/// While this replica hands off (it is stopping), sends each API request to its successor instead of answering it
/// (`crate::forward`); probes, the OpenAPI document and the refusal streams stay here.
#[derive(Clone)]
struct Forward<S> {
    inner: S,
    state: Arc<Discovery>,
}

impl<S> tower::Layer<S> for Forward<()> {
    type Service = Forward<S>;

    fn layer(&self, inner: S) -> Forward<S> {
        Forward { inner, state: self.state.clone() }
    }
}

impl<S> tower::Service<Request> for Forward<S>
where
    S: tower::Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = futures::future::Either<S::Future, futures::future::BoxFuture<'static, Result<Response, S::Error>>>;

    fn poll_ready(&mut self, context: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(context)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let local = request
            .extensions()
            .get::<MatchedPath>()
            .is_some_and(|route| matches!(route.as_str(), "/healthz" | "/readyz" | "/openapi.json" | "/v1/refusals"));
        if local || !self.state.forwarding() {
            return futures::future::Either::Left(self.inner.call(request));
        }
        let state = self.state.clone();
        futures::future::Either::Right(Box::pin(async move { Ok(crate::forward::forward(state, request).await) }))
    }
}

/// Records each request's route, status and latency, and marks the response to a request with a valid token
/// [`Authenticated`](crate::Authenticated), so its connection leaves its address's unauthenticated count. A layer
/// of its own rather than `middleware::from_fn`, which boxes the route and its future for every request.
#[derive(Clone)]
struct Observe<S> {
    inner: S,
    state: Arc<Discovery>,
}

impl<S> tower::Layer<S> for Observe<()> {
    type Service = Observe<S>;

    fn layer(&self, inner: S) -> Observe<S> {
        Observe { inner, state: self.state.clone() }
    }
}

impl<S> tower::Service<Request> for Observe<S>
where
    S: tower::Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Observed<S::Future>;

    fn poll_ready(&mut self, context: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(context)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let route = request.extensions().get::<MatchedPath>().cloned();
        let authenticated = identify(&self.state.auth, request.headers()).is_some();
        Observed {
            inner: self.inner.call(request),
            state: self.state.clone(),
            route,
            authenticated,
            started: Instant::now(),
        }
    }
}

pin_project_lite::pin_project! {
    /// A route's answer on its way, recorded when it comes.
    struct Observed<F> {
        #[pin]
        inner: F,
        state: Arc<Discovery>,
        route: Option<MatchedPath>,
        authenticated: bool,
        started: Instant,
    }
}

impl<F, E> std::future::Future for Observed<F>
where
    F: std::future::Future<Output = Result<Response, E>>,
{
    type Output = Result<Response, E>;

    fn poll(self: std::pin::Pin<&mut Self>, context: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let this = self.project();
        let mut response = std::task::ready!(this.inner.poll(context))?;
        let route = this.route.as_ref().map(MatchedPath::as_str);
        this.state.metrics.request(route, response.status().as_u16(), this.started.elapsed());
        if *this.authenticated {
            response.extensions_mut().insert(crate::Authenticated);
        }
        std::task::Poll::Ready(Ok(response))
    }
}

/// The bearer token a request carries, if any. The scheme is case-insensitive (RFC 9110, section 11.1).
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION).and_then(|value| value.to_str().ok())?;
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Who a request's token speaks for; `None` without a valid one.
fn identify(auth: &Auth, headers: &HeaderMap) -> Option<Identity> {
    match auth {
        Auth::Disabled => Some(Identity::anonymous()),
        Auth::Tokens(tokens) => tokens.identify(bearer(headers)?),
    }
}

async fn readyz(State(state): Shared) -> Response {
    if let Some(reason) = state.gate.refusal() {
        return Problem::new(StatusCode::SERVICE_UNAVAILABLE, "not-serving", "Not serving", reason)
            .with_reason("not-serving")
            .into_response();
    }
    if !state.ready() {
        return Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not-synced",
            "Not ready",
            "the proxy store has not synced yet",
        )
        .with_reason("not-synced")
        .into_response();
    }
    "ok".into_response()
}

/// The scope a route's token needs, as a type: the argument of [`Authorized`].
mod needs {
    use crate::auth::Scope;

    /// A scope a route needs.
    pub(in crate::api) trait Needs: Send + Sync {
        /// The least scope the token must have.
        const SCOPE: Scope;
    }

    /// Routes that list.
    pub(in crate::api) struct Read;
    /// Routes that lease, renew, release and report.
    pub(in crate::api) struct Lease;
    /// Routes that change what every tenant sees.
    pub(in crate::api) struct Admin;

    impl Needs for Read {
        const SCOPE: Scope = Scope::Read;
    }
    impl Needs for Lease {
        const SCOPE: Scope = Scope::Lease;
    }
    impl Needs for Admin {
        const SCOPE: Scope = Scope::Admin;
    }
}

/// Every API route's preamble, as an extractor: the caller, its token checked for the scope `N` names and the
/// replica's gate passed ([`authorize`]), or the problem document that refuses the request. The request's headers
/// come with it, moved out of the request (axum's `HeaderMap` extractor copies them, on every request): the body's
/// Content-Type is read from them, and no extractor after this one looks at any header.
struct Authorized<N> {
    caller: Caller,
    headers: HeaderMap,
    scope: std::marker::PhantomData<N>,
}

impl<N: needs::Needs> FromRequestParts<Arc<Discovery>> for Authorized<N> {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &Arc<Discovery>) -> Result<Self, Self::Rejection> {
        let headers = std::mem::take(&mut parts.headers);
        let caller = authorize(state, &headers, N::SCOPE)?;
        Ok(Self { caller, headers, scope: std::marker::PhantomData })
    }
}

/// Who is calling.
struct Caller {
    scope: Scope,
    /// What the caller's leases, sessions and cooldowns are bound to: its tenant.
    tenant: Arc<str>,
    quota: crate::Quota,
}

impl Caller {
    /// The owner the lease store binds leases to.
    fn owner(&self) -> &str {
        &self.tenant
    }
}

/// Checks the bearer token and the gate; returns the caller.
fn authorize(state: &Discovery, headers: &HeaderMap, needed: Scope) -> Result<Caller, Problem> {
    let identity = match &state.auth {
        Auth::Disabled => Identity::anonymous(),
        Auth::Tokens(tokens) => {
            let Some(token) = bearer(headers) else {
                return Err(Problem::unauthorized("send `Authorization: Bearer <token>`"));
            };
            tokens.identify(token).ok_or_else(|| Problem::unauthorized("the token is not known"))?
        }
    };
    let scope = identity.scope;
    if scope < needed {
        let needed = needed.name();
        return Err(Problem::forbidden(format!("this route needs a token with the {needed} scope (or above)")));
    }
    // A replica that has not read the fleet yet (just started or restarted, the Service may still route to it)
    // would take every proxy for unknown: a renewal there would end a lease every replica shares.
    let refusal = state.gate.refusal().or_else(|| {
        (!state.ready()).then(|| "this replica has not read the fleet yet (its Proxy store has not synced)".to_owned())
    });
    if let Some(reason) = refusal {
        state.metrics.not_serving();
        // Only for a moment, while the leader changes or a replica starts: the client may retry at once, on a new
        // connection.
        return Err(Problem::new(StatusCode::SERVICE_UNAVAILABLE, "not-serving", "Not serving", reason)
            .with_reason("not-serving")
            .with_retry_after(Duration::from_secs(1))
            .closing_connection());
    }
    Ok(Caller { scope, tenant: identity.tenant, quota: identity.quota })
}

/// 429 for a tenant over its quota: `which` is the quota's name in the token file.
fn over_quota(which: &str, detail: String, retry_after: Duration) -> Problem {
    let reason = match which {
        "maxLeases" => "quota-max-leases",
        _ => "quota-reports-per-minute",
    };
    Problem::new(StatusCode::TOO_MANY_REQUESTS, "quota-exceeded", "The tenant's quota is used up", detail)
        .with_reason(reason)
        .with_retry_after(retry_after)
}

/// Parses a JSON body strictly; an empty body reads as `{}` when `empty_ok`.
fn parse_body<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    empty_ok: bool,
) -> Result<T, Problem> {
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too-large",
                "The request body is too large",
                format!("at most {MAX_BODY_BYTES} bytes"),
            )
        } else {
            Problem::bad_request(format!("the request body could not be read: {rejection}"))
        }
    })?;
    if !body.is_empty() {
        let kind = headers.get(header::CONTENT_TYPE).map(|value| String::from_utf8_lossy(value.as_bytes()));
        if !kind.as_deref().is_some_and(is_json_media_type) {
            let detail = match kind {
                Some(kind) => format!("Content-Type {kind:?} is not application/json (or application/*+json)"),
                None => "a body needs Content-Type: application/json".to_owned(),
            };
            return Err(Problem::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported-media-type",
                "The body must be JSON",
                detail,
            ));
        }
    }
    let text: &[u8] = if body.is_empty() && empty_ok { b"{}" } else { &body };
    serde_json::from_slice(text).map_err(|error| Problem::bad_request(format!("invalid JSON body: {error}")))
}

/// `application/json` or `application/<anything>+json`, case-insensitive, with optional parameters
/// (`; charset=utf-8`).
fn is_json_media_type(value: &str) -> bool {
    let essence = value.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    match essence.strip_prefix("application/") {
        Some("json") => true,
        Some(subtype) => {
            subtype.strip_suffix("+json").is_some_and(|name| !name.is_empty() && !name.contains(char::is_whitespace))
        }
        None => false,
    }
}

/// The lease ID from the path; a path that does not decode (`%FF`) is a problem document like every other error.
fn lease_id(path: Result<Path<String>, PathRejection>) -> Result<String, Problem> {
    path.map(|Path(id)| id)
        .map_err(|rejection| Problem::bad_request(format!("invalid lease ID in the path: {rejection}")))
}

fn parse_query(
    query: Result<Query<BTreeMap<String, String>>, QueryRejection>,
    allowed: &[&str],
) -> Result<BTreeMap<String, String>, Problem> {
    let Query(query) = query.map_err(|rejection| Problem::bad_request(format!("invalid query: {rejection}")))?;
    if let Some(unknown) = query.keys().find(|key| !allowed.contains(&key.as_str())) {
        return Err(Problem::bad_request(format!(
            "unknown query parameter {unknown:?} (allowed: {})",
            allowed.join(", ")
        )));
    }
    Ok(query)
}

fn timestamp(time: SystemTime) -> String {
    jiff::Timestamp::try_from(time).map_or_else(
        |_| "1970-01-01T00:00:00Z".to_owned(),
        |timestamp| timestamp.round(jiff::Unit::Second).unwrap_or(timestamp).to_string(),
    )
}

/// `time` in RFC 3339 to the millisecond: a paced slot is finer than a second.
fn precise_timestamp(time: SystemTime) -> String {
    jiff::Timestamp::try_from(time).map_or_else(
        |_| "1970-01-01T00:00:00Z".to_owned(),
        |timestamp| timestamp.round(jiff::Unit::Millisecond).unwrap_or(timestamp).to_string(),
    )
}
