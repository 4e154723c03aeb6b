//! The gateway's own endpoint and the crawler's reports: `POST /report?target=<host>` and `X-Egress-Report`, which
//! report a session's proxy for a site the crawler saw refuse it.

use http::{HeaderMap, HeaderValue, Method, Request, Response, header};
use hyper::body::{Bytes, Incoming};

use super::{Gateway, PROXY_HEADER, Who};
use crate::Body;
use crate::options::Options;
use crate::route::{REPORT_HEADER, Report, RouteRequest};
use crate::status::{GatewayError, full};

/// The path of the gateway's own report endpoint.
pub const REPORT_PATH: &str = "/report";

impl Gateway {
    /// A request to the gateway itself (origin form): `POST /report?target=<host>` with `X-Egress-Report`, which
    /// reports the session's proxy for that site without sending anything through it.
    pub(super) async fn own(&self, request: &Request<Incoming>, who: Who<'_>) -> Result<Response<Body>, GatewayError> {
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
}

/// The `X-Egress-Report` of a request, which takes a session to report on.
pub(super) fn reported(headers: &HeaderMap, options: &Options) -> Result<Option<Report>, GatewayError> {
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
