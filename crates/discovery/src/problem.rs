//! RFC 9457 problem documents: every error the API returns is one.

use std::time::Duration;

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use schemars::JsonSchema;
use serde::Serialize;

/// An error response: an RFC 9457 problem document.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Problem {
    /// A URI naming the kind of problem.
    #[serde(rename = "type")]
    pub type_: String,
    /// A short, stable summary of the kind.
    pub title: &'static str,
    /// The HTTP status.
    pub status: u16,
    /// What went wrong this time, for a human.
    pub detail: String,
    /// A stable machine-readable reason: none-healthy, all-at-capacity, all-cooling-down, scaling-up (a pool is
    /// getting members; Retry-After is how long a new member takes), proxy-cooling-down, proxy-unavailable,
    /// unknown-pool, not-serving, quota-max-leases, quota-reports-per-minute, ttl-above-tenant-max, paced (the
    /// matching proxies' pace for the site holds the lease back; `retryAfterMilliseconds` says when a slot frees).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When to try again, in seconds (also sent as `Retry-After`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_seconds: Option<u32>,
    /// With reason `paced`: when the next slot frees, in milliseconds (`Retry-After` is whole seconds, rounded up).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_milliseconds: Option<u32>,
    /// With reason `ttl-above-tenant-max`: the longest lease the tenant may ask for, in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_lease_seconds: Option<u32>,
    #[serde(skip)]
    authenticate: bool,
    #[serde(skip)]
    close: bool,
}

impl Problem {
    /// A problem of the given status; `kind` becomes the type URI's last part.
    pub fn new(status: StatusCode, kind: &str, title: &'static str, detail: impl Into<String>) -> Self {
        Self {
            type_: format!("urn:egress-operator:problem:{kind}"),
            title,
            status: status.as_u16(),
            detail: detail.into(),
            reason: None,
            retry_after_seconds: None,
            retry_after_milliseconds: None,
            max_lease_seconds: None,
            authenticate: false,
            close: false,
        }
    }

    /// 400: the request is malformed or invalid.
    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad-request", "The request is invalid", detail)
    }

    /// 404.
    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not-found", "Not found", detail)
    }

    /// 401, with `WWW-Authenticate: Bearer`; the connection is closed after it.
    pub fn unauthorized(detail: impl Into<String>) -> Self {
        Self {
            authenticate: true,
            close: true,
            ..Self::new(StatusCode::UNAUTHORIZED, "unauthorized", "Authentication required", detail)
        }
    }

    /// 403.
    pub fn forbidden(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", "The token's scope does not allow this", detail)
    }

    /// Adds a machine-readable reason.
    pub fn with_reason(mut self, reason: &str) -> Self {
        self.reason = Some(reason.to_owned());
        self
    }

    /// Closes the connection after this answer (`Connection: close`), so the client's next request opens a new one,
    /// which the Service may route elsewhere.
    pub fn closing_connection(mut self) -> Self {
        self.close = true;
        self
    }

    /// Adds a retry hint to the millisecond too (rounded up), for a client that waits for a paced slot.
    pub fn with_precise_retry_after(mut self, after: Duration) -> Self {
        let millis = after.as_millis() + u128::from(!after.subsec_nanos().is_multiple_of(1_000_000));
        self.retry_after_milliseconds = Some(u32::try_from(millis).unwrap_or(u32::MAX));
        self.with_retry_after(after)
    }

    /// Adds a retry hint (rounded up to whole seconds, at least one).
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        let seconds = (after.as_secs() + u64::from(after.subsec_nanos() > 0)).max(1);
        self.retry_after_seconds = Some(u32::try_from(seconds).unwrap_or(u32::MAX));
        self
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let retry = self.retry_after_seconds;
        let (authenticate, close) = (self.authenticate, self.close);
        let mut response = (status, Json(self)).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(seconds) = retry {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if authenticate {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"egress-discovery\""));
        }
        // A client without a valid token gets no connection to keep: holding many open costs it a reconnect (and a
        // place in its address's unauthenticated-connection cap) each time. A replica that does not serve leases
        // sends its client back through the Service, to the replica that does.
        if close {
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}
