//! Plain `http://` requests: each sent through its upstream proxy over a pooled kept-alive connection, its
//! hop-by-hop headers dropped and the upstream's credentials added, tried again elsewhere when the site blocked the
//! proxy and sending twice does nothing twice; the answer streamed back naming the proxy.

use std::time::Duration;

use http::uri::Scheme;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, Version, header};
use http_body_util::BodyExt;
use hyper::body::{Body as _, Bytes, Incoming};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tracing::debug;

use egress_fleet::error_chain;

use super::{Gateway, Holding, LEASE_HEADER, PROXY_HEADER, Who};
use crate::Body;
use crate::route::{REPORT_HEADER, RouteRequest, Routed, Upstream, Verdict};
use crate::status::{GatewayError, full};
use crate::upstream::{POLICY_HEADER, UpstreamConnector, policy_denial};

/// The pooled client of one upstream.
pub(super) type UpstreamClient = Client<UpstreamConnector, Body>;

impl Gateway {
    pub(super) async fn forward(
        &self,
        request: Request<Incoming>,
        who: Who<'_>,
    ) -> Result<Response<Body>, GatewayError> {
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

/// Whether sending a request with `method` twice has the effect of sending it once (RFC 9110, 9.2.2).
fn is_idempotent(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE)
}

/// Removes the headers that belong to one hop: the standard ones and those `Connection` names.
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
pub(super) fn identify(headers: &mut HeaderMap, upstream: &Upstream) {
    if let Ok(proxy) = HeaderValue::from_str(&upstream.proxy) {
        headers.insert(PROXY_HEADER, proxy);
    }
    if let Some(lease) = upstream.lease.as_deref().and_then(|lease| HeaderValue::from_str(lease).ok()) {
        headers.insert(LEASE_HEADER, lease);
    }
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, HeaderName, HeaderValue};

    use super::strip_hop_by_hop;

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
