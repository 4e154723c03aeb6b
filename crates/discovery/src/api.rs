//! The routes, their request and response bodies, and the mapping of every failure to a problem document.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use egress_lease::{Lease, LeaseError, LeaseRequest, Outcome, Report, Selector};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::auth::{Auth, Identity, Scope};
use crate::problem::Problem;
use crate::{Discovery, PoolId, PoolRecord, ProxyId, ProxyRecord};

/// The largest request body accepted.
pub const MAX_BODY_BYTES: usize = 16 * 1024;

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
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/openapi.json", get(|| async { Json(crate::openapi::document()) }))
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
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

/// Records each request's route, status and latency, and marks the response to a request with a valid token
/// [`Authenticated`](crate::Authenticated), so its connection leaves its address's unauthenticated count.
async fn observe(State(state): Shared, request: Request, next: Next) -> Response {
    let route = request.extensions().get::<MatchedPath>().cloned();
    let authenticated = identify(&state.auth, request.headers()).is_some();
    let started = Instant::now();
    let mut response = next.run(request).await;
    state.metrics.request(route.as_ref().map(MatchedPath::as_str), response.status().as_u16(), started.elapsed());
    if authenticated {
        response.extensions_mut().insert(crate::Authenticated);
    }
    response
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
    if let Some(reason) = state.gate.refusal() {
        state.metrics.not_serving();
        // Only for a moment, while the leader changes: the client may retry at once, on a new connection.
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

/// Everything but RFC 3986's unreserved characters, which a URL userinfo part carries as they are.
const NOT_UNRESERVED: &percent_encoding::AsciiSet =
    &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// Percent-encodes a URL userinfo part.
fn userinfo(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, NOT_UNRESERVED).to_string()
}

/// The proxy URL; with credentials only when `credentials` (the caller holds a lease on it, or is an admin).
fn proxy_url(record: &ProxyRecord, credentials: bool) -> String {
    match &record.credentials {
        Some(found) if credentials => {
            let (user, password) = (userinfo(&found.username), userinfo(found.password.expose()));
            format!("http://{user}:{password}@{}", record.endpoint())
        }
        _ => format!("http://{}", record.endpoint()),
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ProxyEntry {
    namespace: String,
    name: String,
    host: String,
    port: u16,
    url: String,
    #[serde(rename = "egressIP", skip_serializing_if = "Option::is_none")]
    egress_ip: Option<String>,
    labels: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    zone: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    provider: Option<String>,
    /// The name of the pool it is a member of (in its namespace).
    #[serde(skip_serializing_if = "Option::is_none")]
    pool: Option<String>,
    active_leases: u32,
    max_leases: u32,
    /// How long a ban cools it down for a site, when it has a policy of its own (the operator always gives one).
    #[serde(skip_serializing_if = "Option::is_none")]
    cooldown_policy: Option<CooldownPolicyEntry>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cooling_down_until: Option<String>,
    /// With `target`: the share of requests reported through this proxy for that site that it served.
    #[serde(skip_serializing_if = "Option::is_none")]
    success_rate: Option<f64>,
    /// With `target`: how many requests that share is over.
    #[serde(skip_serializing_if = "Option::is_none")]
    reported: Option<u64>,
}

/// A proxy's ban cooldown policy, as the API shows it.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct CooldownPolicyEntry {
    base_seconds: u64,
    factor: u32,
    max_seconds: u64,
}

impl From<egress_lease::CooldownPolicy> for CooldownPolicyEntry {
    fn from(policy: egress_lease::CooldownPolicy) -> Self {
        Self { base_seconds: policy.base.as_secs(), factor: policy.factor, max_seconds: policy.max.as_secs() }
    }
}

async fn list_proxies(
    State(state): Shared,
    headers: HeaderMap,
    query: Result<Query<BTreeMap<String, String>>, QueryRejection>,
) -> Result<Response, Problem> {
    let caller = authorize(&state, &headers, Scope::Read)?;
    let query = parse_query(query, &["selector", "target", "pool"])?;
    let selector = Selector::parse(query.get("selector").map_or("", String::as_str))
        .map_err(|error| Problem::bad_request(error.to_string()))?;
    let pool = query.get("pool").map(|pool| resolve_pool(&state, pool)).transpose()?.map(|pool| pool.id.clone());
    let now = SystemTime::now();
    // Only the matching records are copied (as `Arc`s), and only their loads are looked up: the answer costs what
    // it returns.
    let matching: Vec<Arc<ProxyRecord>> = state
        .records
        .read()
        .expect("record lock")
        .values()
        .filter(|record| record.healthy && selector.matches(&record.labels))
        .filter(|record| pool.is_none() || record.pool == pool)
        .cloned()
        .collect();
    let ids: Vec<&ProxyId> = matching.iter().map(|record| &record.id).collect();
    let loads = state.store.loads_of(&ids, query.get("target").map(String::as_str), now).map_err(lease_problem)?;
    // Credentials only on the caller's own leases (an admin sees them all): a lease token never learns the password
    // of a proxy it was not leased.
    let held = if caller.scope == Scope::Lease { state.store.held_by(caller.owner(), now) } else { Default::default() };
    let credentials = |record: &ProxyRecord| caller.scope == Scope::Admin || held.contains(&record.id);
    let entries: Vec<ProxyEntry> = matching
        .iter()
        .zip(loads)
        .map(|(record, load)| ProxyEntry {
            namespace: record.id.namespace().to_owned(),
            name: record.id.name().to_owned(),
            host: record.host.clone(),
            port: record.port,
            url: proxy_url(record, credentials(record)),
            egress_ip: record.egress_ip.clone(),
            labels: record.labels.clone(),
            zone: record.zone.clone(),
            provider: record.provider.clone(),
            pool: record.pool.as_ref().map(|pool| pool.name().to_owned()),
            active_leases: load.as_ref().map_or(0, |load| load.active_leases),
            max_leases: record.max_leases,
            cooldown_policy: record.cooldown.map(CooldownPolicyEntry::from),
            cooling_down_until: load.as_ref().and_then(|load| load.cooling_down_until).map(timestamp),
            success_rate: load.as_ref().and_then(|load| load.outcomes).and_then(|outcomes| outcomes.success_rate()),
            reported: load.as_ref().and_then(|load| load.outcomes).map(|outcomes| outcomes.total()),
        })
        .collect();
    Ok(Json(json!({ "proxies": entries })).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct LeaseBody {
    target: String,
    selector: Option<String>,
    ttl_seconds: Option<u64>,
    proxy: Option<String>,
    session: Option<String>,
    pool: Option<String>,
}

/// The proxy a request names, which must be `namespace/name`.
fn parse_proxy(proxy: &str) -> Result<ProxyId, Problem> {
    proxy.parse().map_err(|error: egress_fleet::InvalidName| Problem::bad_request(format!("proxy {error}")))
}

/// The pool a request names: `namespace/name`, or a name that only one namespace has.
fn resolve_pool(state: &Discovery, pool: &str) -> Result<Arc<PoolRecord>, Problem> {
    let pools = state.pools.read().expect("pool lock");
    if pool.contains('/') {
        let id: PoolId =
            pool.parse().map_err(|error: egress_fleet::InvalidName| Problem::bad_request(format!("pool {error}")))?;
        return pools.get(&id).cloned().ok_or_else(|| unknown_pool(pool));
    }
    let mut named = pools.values().filter(|record| record.id.name() == pool);
    match (named.next(), named.next()) {
        (Some(record), None) => Ok(record.clone()),
        (None, _) => Err(unknown_pool(pool)),
        (Some(_), Some(_)) => Err(Problem::bad_request(format!(
            "pool {pool:?} exists in more than one namespace: name it as namespace/name"
        ))),
    }
}

fn unknown_pool(pool: &str) -> Problem {
    Problem::new(StatusCode::NOT_FOUND, "unknown-pool", "No such pool", format!("no ProxyPool {pool:?} is known"))
        .with_reason("unknown-pool")
}

/// The answer for a pool that has no member to lease yet but is getting one.
fn scaling_up(pool: &PoolRecord) -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "scaling-up",
        "The pool is scaling up",
        format!(
            "pool {} has no Ready member yet ({} of {} Ready); a new member takes about {} s",
            pool.id,
            pool.ready,
            pool.replicas,
            pool.provisioning.as_secs()
        ),
    )
    .with_reason("scaling-up")
    .with_retry_after(pool.provisioning.max(Duration::from_secs(1)))
}

/// The TTL a request asks for, within the API's range and the tenant's `maxLeaseSeconds` (which also caps the
/// default when it is shorter).
fn ttl(seconds: Option<u64>, caller: &Caller) -> Result<Option<Duration>, Problem> {
    let tenant_max = caller.quota.max_lease_seconds;
    match seconds {
        None => Ok(tenant_max.map(|max| Duration::from_secs(max.min(DEFAULT_TTL_SECONDS)))),
        Some(seconds) if !(1..=MAX_TTL_SECONDS).contains(&seconds) => {
            Err(Problem::bad_request(format!("ttlSeconds {seconds} is out of range (1 to {MAX_TTL_SECONDS})")))
        }
        Some(seconds) if tenant_max.is_some_and(|max| seconds > max) => Err(Problem::bad_request(format!(
            "ttlSeconds {seconds} is above this tenant's maxLeaseSeconds ({})",
            tenant_max.unwrap_or_default()
        ))),
        Some(seconds) => Ok(Some(Duration::from_secs(seconds))),
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct LeasedProxy<'a> {
    namespace: &'a str,
    name: &'a str,
    host: &'a str,
    port: u16,
    url: String,
    /// The address sites see, once probes observed it: a client holding leases on several proxies drops, on a ban
    /// or a throttle, every one that leaves through the same address (they share the cooldown).
    #[serde(rename = "egressIP", skip_serializing_if = "Option::is_none")]
    egress_ip: Option<&'a str>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct LeaseResponse<'a> {
    id: &'a str,
    proxy: LeasedProxy<'a>,
    target: &'a str,
    expires_at: String,
    /// On renew only: whether the proxy's instance was replaced since the holder was last told its URL.
    #[serde(skip_serializing_if = "Option::is_none")]
    replaced: Option<bool>,
}

/// The lease as JSON bytes, serialised straight from the record under the read lock (no copies on the hot path).
/// `replaced` is given on renew. The holder of a lease is told the proxy's credentials.
fn lease_json(state: &Discovery, lease: &Lease, replaced: Option<bool>) -> Result<Vec<u8>, Problem> {
    let records = state.records.read().expect("record lock");
    let record = records.get(&lease.proxy).ok_or_else(|| {
        Problem::new(StatusCode::SERVICE_UNAVAILABLE, "proxy-gone", "The proxy just went away", "retry the request")
            .with_reason("proxy-gone")
            .with_retry_after(Duration::from_secs(1))
    })?;
    let response = LeaseResponse {
        id: &lease.id,
        proxy: LeasedProxy {
            namespace: record.id.namespace(),
            name: record.id.name(),
            host: &record.host,
            port: record.port,
            url: proxy_url(record, true),
            egress_ip: record.egress_ip.as_deref(),
        },
        target: &lease.target,
        expires_at: timestamp(lease.expires_at),
        replaced,
    };
    serde_json::to_vec(&response).map_err(|error| {
        Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "Internal error", error.to_string())
    })
}

async fn create_lease(
    State(state): Shared,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    let caller = authorize(&state, &headers, Scope::Lease)?;
    let body: LeaseBody = parse_body(&headers, body, false)?;
    if body.target.trim().is_empty() || body.target.len() > 2048 {
        return Err(Problem::bad_request("target must be a host name or URL of at most 2048 characters"));
    }
    if body.session.as_ref().is_some_and(|session| session.is_empty() || session.len() > 256) {
        return Err(Problem::bad_request("session must be 1 to 256 characters"));
    }
    let proxy = body.proxy.as_deref().map(parse_proxy).transpose()?;
    let selector = Selector::parse(body.selector.as_deref().unwrap_or(""))
        .map_err(|error| Problem::bad_request(error.to_string()))?;
    let pool = body.pool.as_deref().map(|pool| resolve_pool(&state, pool)).transpose()?;
    let now = SystemTime::now();
    if let Some(pool) = &pool
        && pool.replicas == 0
    {
        // Nothing to lease: a pool that wakes on demand grows, the crawler comes back when a member is Ready.
        let problem = if pool.wakes {
            state.refused_for(&pool.id, |demand| demand.woken = Some(now));
            scaling_up(pool)
        } else {
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "no-eligible-proxy",
                "No proxy can be leased now",
                format!("pool {} has no members (spec.replicas 0) and does not autoscale", pool.id),
            )
            .with_reason("none-healthy")
            .with_retry_after(Duration::from_secs(30))
        };
        state.metrics.denied(problem.reason.as_deref().unwrap_or("invalid"));
        return Err(problem);
    }
    let request = LeaseRequest {
        target: body.target,
        selector,
        ttl: ttl(body.ttl_seconds, &caller)?,
        proxy,
        session: body.session,
        owner: caller.owner().to_owned(),
        owner_quota: caller.quota.max_leases,
        pool: pool.as_ref().map(|pool| pool.id.clone()),
    };
    match state.store.lease(&request, now) {
        Ok(lease) => {
            state.metrics.granted();
            state.metrics.tenant_granted(caller.owner());
            let body = lease_json(&state, &lease, None)?;
            let location = format!("/v1/leases/{}", lease.id);
            Ok((
                StatusCode::CREATED,
                [(header::LOCATION, location), (header::CONTENT_TYPE, "application/json".to_owned())],
                body,
            )
                .into_response())
        }
        Err(error) => {
            let problem = match (&pool, &error) {
                // A pool still bringing its members up says so, with how long a member takes. Crawlers waiting for
                // members already on their way are no demand for more.
                (Some(pool), LeaseError::NoneHealthy) if pool.ready < pool.replicas => scaling_up(pool),
                (Some(pool), LeaseError::NoneHealthy) => {
                    state.refused_for(&pool.id, |demand| demand.none_healthy = Some(now));
                    lease_problem(error)
                }
                (Some(pool), LeaseError::AllAtCapacity { .. }) => {
                    state.refused_for(&pool.id, |demand| demand.at_capacity = Some(now));
                    lease_problem(error)
                }
                _ => lease_problem(error),
            };
            let reason = problem.reason.as_deref().unwrap_or("invalid");
            state.metrics.denied(reason);
            state.metrics.tenant_refused(caller.owner(), reason);
            Err(problem)
        }
    }
}

fn until(time: SystemTime) -> Duration {
    time.duration_since(SystemTime::now()).unwrap_or(Duration::from_secs(1))
}

/// Maps a store error to its problem document.
fn lease_problem(error: LeaseError) -> Problem {
    let detail = error.to_string();
    let unavailable = |reason: &str, detail: String| {
        Problem::new(StatusCode::SERVICE_UNAVAILABLE, "no-eligible-proxy", "No proxy can be leased now", detail)
            .with_reason(reason)
    };
    match error {
        LeaseError::InvalidTarget(_) => Problem::bad_request(detail),
        LeaseError::NoneHealthy => unavailable("none-healthy", detail).with_retry_after(Duration::from_secs(30)),
        LeaseError::AllAtCapacity { retry_at } => {
            unavailable("all-at-capacity", detail).with_retry_after(retry_at.map_or(Duration::from_secs(5), until))
        }
        LeaseError::AllCoolingDown { until: first } => {
            unavailable("all-cooling-down", format!("{detail}; the first cooldown ends at {}", timestamp(first)))
                .with_retry_after(until(first))
        }
        LeaseError::ProxyCoolingDown { until: end, .. } => Problem::new(
            StatusCode::CONFLICT,
            "proxy-cooling-down",
            "The proxy is cooling down for this target",
            format!("{detail} until {}", timestamp(end)),
        )
        .with_reason("proxy-cooling-down")
        .with_retry_after(until(end)),
        LeaseError::ProxyUnavailable { .. } => {
            Problem::new(StatusCode::CONFLICT, "proxy-unavailable", "The proxy cannot take a lease now", detail)
                .with_reason("proxy-unavailable")
        }
        LeaseError::UnknownProxy(_) | LeaseError::UnknownLease(_) => Problem::not_found(detail),
        LeaseError::Revoked(_) => Problem::new(StatusCode::GONE, "revoked", "The lease was revoked", detail),
        LeaseError::QuotaExceeded { retry_at, .. } => over_quota(
            "maxLeases",
            format!("{detail}: release one first"),
            retry_at.map_or(Duration::from_secs(5), until),
        ),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RenewBody {
    ttl_seconds: Option<u64>,
}

async fn renew_lease(
    State(state): Shared,
    id: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    let caller = authorize(&state, &headers, Scope::Lease)?;
    let id = lease_id(id)?;
    let body: RenewBody = parse_body(&headers, body, true)?;
    let renewed = state
        .store
        .renew(&id, caller.owner(), ttl(body.ttl_seconds, &caller)?, SystemTime::now())
        .map_err(lease_problem)?;
    let body = lease_json(&state, &renewed.lease, Some(renewed.moved_from.is_some()))?;
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

async fn release_lease(
    State(state): Shared,
    id: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    let caller = authorize(&state, &headers, Scope::Lease)?;
    let id = lease_id(id)?;
    state.store.release(&id, caller.owner(), SystemTime::now()).map_err(lease_problem)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum OutcomeBody {
    Ok,
    Banned,
    Throttled,
    Failed,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ReportBody {
    outcome: Option<OutcomeBody>,
    status_code: Option<u16>,
    retry_after_seconds: Option<u64>,
    ok: Option<u32>,
    failed: Option<u32>,
    release: Option<bool>,
}

/// The most requests one report may count.
const MAX_REPORTED: u32 = 1_000_000;
/// The longest `retryAfterSeconds` a throttle report may carry.
const MAX_RETRY_AFTER_SECONDS: u64 = 86_400;

/// A report body as the store's report, or what is wrong with it.
fn report_of(body: ReportBody) -> Result<Report, Problem> {
    if let Some(code) = body.status_code
        && !(100..=599).contains(&code)
    {
        return Err(Problem::bad_request(format!("statusCode {code} is not an HTTP status")));
    }
    for (field, count) in [("ok", body.ok), ("failed", body.failed)] {
        if count.is_some_and(|count| count > MAX_REPORTED) {
            return Err(Problem::bad_request(format!("{field} counts at most {MAX_REPORTED} requests per report")));
        }
    }
    if body.outcome.is_none() && body.ok.is_none() && body.failed.is_none() {
        return Err(Problem::bad_request("a report needs an outcome, counts (ok, failed), or both"));
    }
    let retry_after = match (body.retry_after_seconds, &body.outcome) {
        (None, _) => None,
        (Some(seconds), Some(OutcomeBody::Throttled)) if (1..=MAX_RETRY_AFTER_SECONDS).contains(&seconds) => {
            Some(Duration::from_secs(seconds))
        }
        (Some(seconds), Some(OutcomeBody::Throttled)) => {
            return Err(Problem::bad_request(format!(
                "retryAfterSeconds {seconds} is out of range (1 to {MAX_RETRY_AFTER_SECONDS})"
            )));
        }
        (Some(_), _) => return Err(Problem::bad_request("retryAfterSeconds goes only with outcome throttled")),
    };
    let outcome = body.outcome.map(|outcome| match outcome {
        OutcomeBody::Ok => Outcome::Ok,
        OutcomeBody::Banned => Outcome::Banned,
        OutcomeBody::Throttled => Outcome::Throttled { retry_after },
        OutcomeBody::Failed => Outcome::Failed,
    });
    Ok(Report {
        outcome,
        ok: body.ok.unwrap_or(0),
        failed: body.failed.unwrap_or(0),
        release: body.release.unwrap_or(false),
    })
}

async fn report_lease(
    State(state): Shared,
    id: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    let caller = authorize(&state, &headers, Scope::Lease)?;
    let id = lease_id(id)?;
    let report = report_of(parse_body(&headers, body, false)?)?;
    if let Some(per_minute) = caller.quota.reports_per_minute
        && let Err(wait) = state.count_report(&caller.tenant, per_minute)
    {
        state.metrics.tenant_refused(caller.owner(), "quota-reports-per-minute");
        return Err(over_quota(
            "reportsPerMinute",
            format!("the tenant made its {per_minute} reports this minute (its reportsPerMinute quota)"),
            wait,
        ));
    }
    let reported = state.store.report(&id, caller.owner(), &report, SystemTime::now()).map_err(lease_problem)?;
    state.metrics.reported(&report);
    state.metrics.tenant_reported(caller.owner());
    let until = reported.cooldown_until;
    // A report that changed no cooldown (its owner had counted in the running one already) needs no write.
    if !reported.cooled.is_empty() {
        if report.outcome == Some(Outcome::Banned) {
            state.metrics.cooldown_started();
        }
        // Answered once the cooldown is kept, on every proxy it reached: a restart or a new leader after this
        // answer still has it.
        let writes =
            reported.cooled.iter().map(|proxy| state.journal.persist(state.store.as_ref(), proxy, &state.metrics));
        futures::future::join_all(writes).await;
    }
    Ok(Json(match until {
        Some(until) => json!({ "cooldownUntil": timestamp(until) }),
        None => json!({}),
    })
    .into_response())
}

/// `DELETE /v1/cooldowns?target=…[&proxy=namespace/name]`: ends the cooldowns for a site now (of one proxy and
/// those sharing its egress IP, or of every proxy) and forgets their streaks; answered once the change is kept.
async fn clear_cooldowns(
    State(state): Shared,
    headers: HeaderMap,
    query: Result<Query<BTreeMap<String, String>>, QueryRejection>,
) -> Result<Response, Problem> {
    authorize(&state, &headers, Scope::Admin)?;
    let query = parse_query(query, &["target", "proxy"])?;
    let Some(target) = query.get("target") else {
        return Err(Problem::bad_request("give the site whose cooldowns to clear: ?target=<host or URL>"));
    };
    let proxy = query.get("proxy").map(|proxy| parse_proxy(proxy)).transpose()?;
    if let Some(proxy) = &proxy
        && !state.records.read().expect("record lock").contains_key(proxy)
    {
        return Err(Problem::not_found(format!("no proxy {proxy:?}")));
    }
    let cleared = state.store.clear_cooldowns(target, proxy.as_ref(), SystemTime::now()).map_err(lease_problem)?;
    let mut proxies: Vec<&ProxyId> = cleared.iter().map(|cooldown| &cooldown.proxy).collect();
    proxies.dedup();
    let writes = proxies.iter().map(|proxy| state.journal.persist(state.store.as_ref(), proxy, &state.metrics));
    futures::future::join_all(writes).await;
    state.metrics.cooldowns_cleared(cleared.len());
    tracing::info!(target = %target, proxy = ?proxy, cleared = cleared.len(), "cooldowns cleared by an administrator");
    Ok(Json(json!({ "cleared": cleared.into_iter().map(cooldown_json).collect::<Vec<_>>() })).into_response())
}

fn cooldown_json(cooldown: egress_lease::Cooldown) -> serde_json::Value {
    json!({
        "proxy": cooldown.proxy.as_str(),
        "target": cooldown.target,
        "until": timestamp(cooldown.until),
        "streak": cooldown.streak,
    })
}

async fn list_cooldowns(
    State(state): Shared,
    headers: HeaderMap,
    query: Result<Query<BTreeMap<String, String>>, QueryRejection>,
) -> Result<Response, Problem> {
    let caller = authorize(&state, &headers, Scope::Read)?;
    let query = parse_query(query, &["target"])?;
    let cooldowns =
        state.store.cooldowns(query.get("target").map(String::as_str), SystemTime::now()).map_err(lease_problem)?;
    // A tenant sees the cooldowns its own reports made; an admin sees every one.
    let entries: Vec<serde_json::Value> = cooldowns
        .into_iter()
        .filter(|cooldown| {
            caller.scope == Scope::Admin || cooldown.reporters.iter().any(|reporter| reporter == caller.owner())
        })
        .map(cooldown_json)
        .collect();
    Ok(Json(json!({ "cooldowns": entries })).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn userinfo_is_percent_encoded() {
        assert_eq!(userinfo("crawler"), "crawler");
        assert_eq!(userinfo("p@ss:w/rd %"), "p%40ss%3Aw%2Frd%20%25");
    }
}
