//! The lease routes: lease (by site, selector, proxy, session or pool), renew, release and report.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use egress_lease::{Lease, LeaseError, LeaseRequest, Outcome, Report, SessionLimits};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{
    Authorized, Caller, DEFAULT_TTL_SECONDS, MAX_TTL_SECONDS, Shared, lease_id, needs, over_quota, parse_body,
    precise_timestamp, timestamp,
};
use crate::problem::Problem;
use crate::{Discovery, PoolId, PoolRecord, ProxyId};

/// What to lease a proxy for.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schemars(rename = "LeaseRequest")]
pub(super) struct LeaseBody {
    /// Host name, IP address or URL of the site.
    #[schemars(length(max = 2048))]
    target: String,
    /// A label selector the proxy must match: `a=b`, `a!=b`, `a`, `!a`, comma-separated.
    selector: Option<String>,
    /// How long the lease lasts unless renewed (the tenant's `maxLeaseSeconds` may lower the limit).
    #[schemars(range(min = 1, max = 3600), extend("default" = 300))]
    ttl_seconds: Option<u64>,
    /// `namespace/name` of a specific proxy.
    proxy: Option<String>,
    /// A sticky-session key: the same proxy for the same (session, target) while it stays eligible.
    #[schemars(length(max = 256))]
    session: Option<String>,
    /// The longest the session keeps one proxy, from the lease that chose it: its first lease after that goes to
    /// another proxy (the same one only when no other can take it). Needs `session`.
    #[schemars(range(min = 1, max = 86400))]
    session_lifetime_seconds: Option<u64>,
    /// The most leases the session takes on one proxy before its next goes to another (through the gateway, every
    /// request is one lease). Needs `session`.
    #[schemars(range(min = 1, max = 1000000))]
    session_max_leases: Option<u64>,
    /// Only members of this ProxyPool: `namespace/name`, or a name only one namespace has; a pool with no members
    /// that autoscales answers 503 `scaling-up` and grows.
    pool: Option<String>,
    /// Only proxies in this zone (a Proxy's `placement.zone`, listed as `zone`).
    #[schemars(length(min = 1, max = 253))]
    zone: Option<String>,
    /// Only proxies on this provider (a Managed Proxy's `provider`, listed as `provider`).
    #[schemars(length(min = 1, max = 253))]
    provider: Option<String>,
}

/// The longest `sessionLifetimeSeconds` (a day, as the gateway's `sticky`).
const MAX_SESSION_LIFETIME_SECONDS: u64 = 86_400;
/// The most `sessionMaxLeases`.
const MAX_SESSION_LEASES: u64 = 1_000_000;

/// A lease request's session lifetime, checked.
fn session_limits(body: &LeaseBody) -> Result<SessionLimits, Problem> {
    for (field, given) in [
        ("sessionLifetimeSeconds", body.session_lifetime_seconds.is_some()),
        ("sessionMaxLeases", body.session_max_leases.is_some()),
    ] {
        if given && body.session.is_none() {
            return Err(Problem::bad_request(format!("{field} limits a session: it needs session")));
        }
    }
    let max_age = match body.session_lifetime_seconds {
        Some(seconds @ 1..=MAX_SESSION_LIFETIME_SECONDS) => Some(Duration::from_secs(seconds)),
        Some(seconds) => {
            return Err(Problem::bad_request(format!(
                "sessionLifetimeSeconds {seconds} is out of range (1 to {MAX_SESSION_LIFETIME_SECONDS})"
            )));
        }
        None => None,
    };
    let max_leases = match body.session_max_leases {
        Some(leases @ 1..=MAX_SESSION_LEASES) => u32::try_from(leases).ok(),
        Some(leases) => {
            return Err(Problem::bad_request(format!(
                "sessionMaxLeases {leases} is out of range (1 to {MAX_SESSION_LEASES})"
            )));
        }
        None => None,
    };
    Ok(SessionLimits { max_age, max_leases })
}

/// The proxy a request names, which must be `namespace/name`.
pub(super) fn parse_proxy(proxy: &str) -> Result<ProxyId, Problem> {
    proxy.parse().map_err(|error: egress_fleet::InvalidName| Problem::bad_request(format!("proxy {error}")))
}

/// The pool a request names: `namespace/name`, or a name that only one namespace has.
pub(super) fn resolve_pool(state: &Discovery, pool: &str) -> Result<Arc<PoolRecord>, Problem> {
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

pub(super) fn unknown_pool(pool: &str) -> Problem {
    Problem::new(StatusCode::NOT_FOUND, "unknown-pool", "No such pool", format!("no ProxyPool {pool:?} is known"))
        .with_reason("unknown-pool")
}

/// The answer for a pool that has no member to lease yet but is getting one.
pub(super) fn scaling_up(pool: &PoolRecord) -> Problem {
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
pub(super) fn ttl(seconds: Option<u64>, caller: &Caller) -> Result<Option<Duration>, Problem> {
    let tenant_max = caller.quota.max_lease_seconds;
    match seconds {
        None => Ok(tenant_max.map(|max| Duration::from_secs(max.min(DEFAULT_TTL_SECONDS)))),
        Some(seconds) if !(1..=MAX_TTL_SECONDS).contains(&seconds) => {
            Err(Problem::bad_request(format!("ttlSeconds {seconds} is out of range (1 to {MAX_TTL_SECONDS})")))
        }
        Some(seconds) if tenant_max.is_some_and(|max| seconds > max) => {
            let max = tenant_max.unwrap_or_default();
            // Named, so a client (the gateway) can ask again within it.
            let mut problem =
                Problem::bad_request(format!("ttlSeconds {seconds} is above this tenant's maxLeaseSeconds ({max})"))
                    .with_reason("ttl-above-tenant-max");
            problem.max_lease_seconds = u32::try_from(max).ok();
            Err(problem)
        }
        Some(seconds) => Ok(Some(Duration::from_secs(seconds))),
    }
}

/// The lease as JSON bytes, serialised straight from the record under the read lock (no copies on the hot path).
/// `replaced` is given on renew. The holder of a lease is told the proxy's credentials.
pub(super) fn lease_json(state: &Discovery, lease: &Lease, replaced: Option<bool>) -> Result<Vec<u8>, Problem> {
    let records = state.records.read().expect("record lock");
    let record = records.get(&lease.proxy).ok_or_else(|| {
        Problem::new(StatusCode::SERVICE_UNAVAILABLE, "proxy-gone", "The proxy just went away", "retry the request")
            .with_reason("proxy-gone")
            .with_retry_after(Duration::from_secs(1))
    })?;
    let response = egress_wire::Lease {
        id: Cow::Borrowed(&lease.id),
        proxy: egress_wire::ProxyRef {
            namespace: Cow::Borrowed(record.id.namespace()),
            name: Cow::Borrowed(record.id.name()),
            host: Cow::Borrowed(&record.host),
            port: record.port,
            url: Cow::Owned(record.url(true)),
            credentials: record.credentials.as_ref().map(|credentials| egress_wire::Credentials {
                username: Cow::Borrowed(&credentials.username),
                password: Cow::Borrowed(credentials.password.expose()),
            }),
            egress_ip: record.egress_ip.as_deref().map(Cow::Borrowed),
            pacing: record.pacing.map(super::proxies::pacing),
        },
        target: Cow::Borrowed(&lease.target),
        expires_at: Cow::Owned(timestamp(lease.expires_at)),
        replaced,
        session_ends_in_milliseconds: lease.session_until.map(|until| {
            u64::try_from(until.duration_since(SystemTime::now()).unwrap_or_default().as_millis()).unwrap_or(u64::MAX)
        }),
    };
    serde_json::to_vec(&response).map_err(|error| {
        Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "Internal error", error.to_string())
    })
}

pub(super) async fn create_lease(
    State(state): Shared,
    Authorized { caller, headers, .. }: Authorized<needs::Lease>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    let body: LeaseBody = parse_body(&headers, body, false)?;
    if body.target.trim().is_empty() || body.target.len() > 2048 {
        return Err(Problem::bad_request("target must be a host name or URL of at most 2048 characters"));
    }
    if body.session.as_ref().is_some_and(|session| session.is_empty() || session.len() > 256) {
        return Err(Problem::bad_request("session must be 1 to 256 characters"));
    }
    let session_limits = session_limits(&body)?;
    for (field, value) in [("zone", &body.zone), ("provider", &body.provider)] {
        if value.as_ref().is_some_and(|value| value.is_empty() || value.len() > 253) {
            return Err(Problem::bad_request(format!("{field} must be 1 to 253 characters")));
        }
    }
    let proxy = body.proxy.as_deref().map(parse_proxy).transpose()?;
    let selector = state.selector(body.selector.as_deref().unwrap_or(""))?;
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
        session_limits,
        owner: caller.owner().to_owned(),
        owner_quota: caller.quota.max_leases,
        pool: pool.as_ref().map(|pool| pool.id.clone()),
        zone: body.zone,
        provider: body.provider,
    };
    match state.store.lease(&request, now).await {
        Ok(lease) => {
            state.metrics.granted();
            state.metrics.tenant_granted(caller.owner());
            let body = lease_json(&state, &lease, None)?;
            let location = format!("/v1/leases/{}", lease.id);
            Ok((
                StatusCode::CREATED,
                [(header::LOCATION, location)],
                [(header::CONTENT_TYPE, "application/json")],
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

pub(super) fn until(time: SystemTime) -> Duration {
    time.duration_since(SystemTime::now()).unwrap_or(Duration::from_secs(1))
}

/// Maps a store error to its problem document.
/// How long a client waits before asking again when the lease state does not answer.
const STATE_RETRY_AFTER: Duration = Duration::from_secs(2);

pub(super) fn lease_problem(error: LeaseError) -> Problem {
    if let LeaseError::StateUnavailable(why) = &error {
        // The store's own words stay in the log: they name its address, which is not the client's business.
        tracing::warn!(error = %why, "the lease state did not answer");
    }
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
        LeaseError::AllCoolingDown { until: first, .. } => {
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
        LeaseError::Paced { until: next, proxy } => {
            let detail = format!("{detail}: the next slot is at {}", precise_timestamp(next));
            let problem = match proxy {
                None => unavailable("paced", detail),
                Some(_) => {
                    Problem::new(StatusCode::CONFLICT, "proxy-paced", "The proxy is paced for this target", detail)
                        .with_reason("paced")
                }
            };
            problem.with_precise_retry_after(next.duration_since(SystemTime::now()).unwrap_or_default())
        }
        LeaseError::ProxyUnavailable { .. } => {
            Problem::new(StatusCode::CONFLICT, "proxy-unavailable", "The proxy cannot take a lease now", detail)
                .with_reason("proxy-unavailable")
        }
        LeaseError::UnknownProxy(_) | LeaseError::UnknownLease(_) => Problem::not_found(detail),
        LeaseError::Revoked(_) => Problem::new(StatusCode::GONE, "revoked", "The lease was revoked", detail),
        LeaseError::NotAdopted(_) => Problem::new(
            StatusCode::GONE,
            "not-adopted",
            "The lease was not taken over after a change of leader",
            detail,
        )
        .with_reason("not-adopted"),
        LeaseError::StateUnavailable(_) => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "state-unavailable",
            "The lease state is unavailable",
            "the store every replica keeps leases in does not answer; nothing was changed, try again shortly",
        )
        .with_reason("state-unavailable")
        .with_retry_after(STATE_RETRY_AFTER),
        LeaseError::QuotaExceeded { retry_at, .. } => over_quota(
            "maxLeases",
            format!("{detail}: release one first"),
            retry_at.map_or(Duration::from_secs(5), until),
        ),
    }
}

/// How long to extend a lease by.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schemars(rename = "RenewRequest")]
pub(super) struct RenewBody {
    /// From now; the lease's TTL when absent.
    #[schemars(range(min = 1, max = 3600))]
    ttl_seconds: Option<u64>,
}

pub(super) async fn renew_lease(
    State(state): Shared,
    id: Result<Path<String>, PathRejection>,
    Authorized { caller, headers, .. }: Authorized<needs::Lease>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    let id = lease_id(id)?;
    let body: RenewBody = parse_body(&headers, body, true)?;
    let renewed = state
        .store
        .renew(&id, caller.owner(), ttl(body.ttl_seconds, &caller)?, SystemTime::now())
        .await
        .map_err(lease_problem)?;
    let body = lease_json(&state, &renewed.lease, Some(renewed.moved_from.is_some()))?;
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

pub(super) async fn release_lease(
    State(state): Shared,
    id: Result<Path<String>, PathRejection>,
    Authorized { caller, .. }: Authorized<needs::Lease>,
) -> Result<Response, Problem> {
    let id = lease_id(id)?;
    state.store.release(&id, caller.owner(), SystemTime::now()).await.map_err(lease_problem)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// What the site did. `banned`: a cooldown that doubles with each ban in a row; `throttled` (429 and the like): a
/// short cooldown, for `retryAfterSeconds` when given, that leaves the ban streak alone. While a cooldown runs, a
/// further ban or throttle from the same tenant changes nothing (the answer gives the running cooldown's end);
/// another tenant's ban counts once.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
#[schemars(rename = "Outcome")]
pub(super) enum OutcomeBody {
    Ok,
    Banned,
    Throttled,
    Failed,
}

/// What happened with a lease: an outcome, counts, or both.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schemars(rename = "Report")]
pub(super) struct ReportBody {
    outcome: Option<OutcomeBody>,
    /// The site's status code (informational).
    #[schemars(range(min = 100, max = 599))]
    status_code: Option<u16>,
    /// With outcome `throttled`: the site's own `Retry-After`.
    #[schemars(range(min = 1, max = 86400))]
    retry_after_seconds: Option<u64>,
    /// Requests the site served through this lease since the last report; one lease's reports count at most 100
    /// requests plus 100 per second of its age, the rest is dropped.
    #[schemars(range(max = 1000000))]
    ok: Option<u32>,
    /// Requests that failed otherwise.
    #[schemars(range(max = 1000000))]
    failed: Option<u32>,
    /// Also end the lease.
    #[schemars(extend("default" = false))]
    release: Option<bool>,
}

/// The answer to a report.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub(super) struct ReportResult {
    /// For a ban or a throttle: when the proxy's cooldown for the lease's site ends.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    cooldown_until: Option<String>,
}

/// The most requests one report may count.
pub(super) const MAX_REPORTED: u32 = 1_000_000;
/// The longest `retryAfterSeconds` a throttle report may carry.
pub(super) const MAX_RETRY_AFTER_SECONDS: u64 = 86_400;

/// A report body as the store's report, or what is wrong with it.
pub(super) fn report_of(body: ReportBody) -> Result<Report, Problem> {
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

pub(super) async fn report_lease(
    State(state): Shared,
    id: Result<Path<String>, PathRejection>,
    Authorized { caller, headers, .. }: Authorized<needs::Lease>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
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
    let reported = state.store.report(&id, caller.owner(), &report, SystemTime::now()).await.map_err(lease_problem)?;
    state.metrics.reported(&report);
    state.metrics.tenant_reported(caller.owner());
    let until = reported.cooldown_until;
    if let (Some(until), Some(Outcome::Banned | Outcome::Throttled { .. })) = (until, report.outcome) {
        // Told before the cooldown is written down: the other gateway replicas move their sessions now.
        let proxies = if reported.cooled.is_empty() { vec![reported.proxy.clone()] } else { reported.cooled.clone() };
        state.refused(crate::Refusal {
            tenant: caller.tenant.clone(),
            target: reported.target.clone(),
            proxies,
            until,
        });
    }
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
    Ok(Json(ReportResult { cooldown_until: until.map(timestamp) }).into_response())
}
