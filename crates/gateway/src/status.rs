//! The gateway's own answers: every error it makes carries an RFC 9209 `Proxy-Status` header naming the gateway, the
//! error type and a readable `details`, and a problem document body; bad credentials are a 407 with
//! `Proxy-Authenticate`. A crawler can always tell the gateway's refusal from the site's answer.

use std::time::Duration;

use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;

use crate::Body;

/// The name the gateway gives itself in `Proxy-Status` and `Via`.
pub const GATEWAY_NAME: &str = "egress-gateway";

/// The realm of the gateway's `Proxy-Authenticate` challenge.
pub const REALM: &str = "egress-gateway";

/// An error the gateway answers itself.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{status} {kind}: {details}")]
pub struct GatewayError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The RFC 9209 error type (`destination_unavailable`, `http_request_denied`, …).
    pub kind: &'static str,
    /// What happened, for a person.
    pub details: String,
    /// When trying again may help.
    pub retry_after: Option<Duration>,
}

impl GatewayError {
    fn new(status: StatusCode, kind: &'static str, details: impl Into<String>) -> Self {
        Self { status, kind, details: details.into(), retry_after: None }
    }

    /// No usable credentials: 407 with a Basic challenge.
    pub fn credentials(details: impl Into<String>) -> Self {
        Self::new(StatusCode::PROXY_AUTHENTICATION_REQUIRED, "http_request_denied", details)
    }

    /// A request the gateway cannot take as written (a malformed user name, target or request).
    pub fn bad_request(details: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "http_request_error", details)
    }

    /// A destination the policy refuses.
    pub fn denied(details: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "destination_ip_prohibited", details)
    }

    /// A tenant over one of its quotas.
    pub fn quota(details: impl Into<String>, retry_after: Option<Duration>) -> Self {
        Self { retry_after, ..Self::new(StatusCode::TOO_MANY_REQUESTS, "http_request_denied", details) }
    }

    /// No proxy can take the request now (none ready for the site, all cooling down, all at their cap).
    pub fn unavailable(details: impl Into<String>, retry_after: Option<Duration>) -> Self {
        Self { retry_after, ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "destination_unavailable", details) }
    }

    /// The upstream proxy could not be reached or answered something that is not a proxy's answer.
    pub fn upstream(kind: &'static str, details: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, kind, details)
    }

    /// The upstream proxy did not answer in time.
    pub fn upstream_timeout(details: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "connection_timeout", details)
    }

    /// The discovery API, which the gateway leases from, cannot be reached or answered something unexpected.
    pub fn discovery(details: impl Into<String>) -> Self {
        Self {
            retry_after: Some(Duration::from_secs(1)),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "proxy_internal_error",
                format!("the discovery API: {}", details.into()),
            )
        }
    }

    /// The gateway has as many connections and tunnels open as it takes (RFC 9209 has no closer type).
    pub fn busy(details: impl Into<String>) -> Self {
        Self {
            retry_after: Some(Duration::from_secs(1)),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "proxy_internal_error", details)
        }
    }

    /// Something inside the gateway failed.
    pub fn internal(details: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "proxy_internal_error", details)
    }

    /// The `Proxy-Status` value: `egress-gateway; error=<kind>; details="<details>"`.
    pub fn proxy_status(&self) -> String {
        let details: String = self
            .details
            .chars()
            .filter(|c| c.is_ascii() && !c.is_ascii_control())
            .flat_map(|c| if matches!(c, '"' | '\\') { vec!['\\', c] } else { vec![c] })
            .collect();
        format!("{GATEWAY_NAME}; error={}; details=\"{details}\"", self.kind)
    }

    /// The answer: the status, `Proxy-Status`, `Retry-After` when known, the challenge on a 407, and a problem
    /// document.
    pub fn response(&self) -> Response<Body> {
        let body = serde_json::json!({
            "type": format!("urn:egress:gateway:{}", self.kind),
            "title": self.status.canonical_reason().unwrap_or("Error"),
            "status": self.status.as_u16(),
            "detail": self.details,
        });
        let mut response = Response::new(full(Bytes::from(body.to_string())));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Ok(value) = HeaderValue::from_str(&self.proxy_status()) {
            headers.insert("proxy-status", value);
        }
        if let Some(after) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(after.as_secs().max(1)));
        }
        if self.status == StatusCode::PROXY_AUTHENTICATION_REQUIRED {
            let challenge = format!("Basic realm=\"{REALM}\", charset=\"UTF-8\"");
            if let Ok(value) = HeaderValue::from_str(&challenge) {
                headers.insert(header::PROXY_AUTHENTICATE, value);
            }
        }
        response
    }
}

/// A body of bytes in memory.
pub fn full(bytes: Bytes) -> Body {
    Full::new(bytes).map_err(|never| match never {}).boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_carry_proxy_status_retry_after_and_the_challenge() {
        let error =
            GatewayError::unavailable("every proxy is cooling down for \"example.com\"", Some(Duration::from_secs(90)));
        let response = error.response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            response.headers()["proxy-status"],
            "egress-gateway; error=destination_unavailable; details=\"every proxy is cooling down for \\\"example.com\\\"\""
        );
        assert_eq!(response.headers()[header::RETRY_AFTER], "90");
        let challenge = GatewayError::credentials("no Proxy-Authorization").response();
        assert_eq!(challenge.status(), StatusCode::PROXY_AUTHENTICATION_REQUIRED);
        assert_eq!(
            challenge.headers()[header::PROXY_AUTHENTICATE],
            "Basic realm=\"egress-gateway\", charset=\"UTF-8\""
        );
        assert!(GatewayError::bad_request("caf\u{e9}\nx").proxy_status().ends_with("details=\"cafx\""));
    }
}
