//! Talking to an upstream proxy: a `CONNECT` through it for a tunnel, and the connector that gives the pooled client
//! a connection to it for plain requests.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::route::Upstream;
use crate::status::GatewayError;

/// The longest answer head an upstream may send to a `CONNECT`.
const MAX_CONNECT_ANSWER: usize = 8192;

/// The header a rendered Squid names the destination rule or class it refused a request by.
pub(crate) const POLICY_HEADER: &str = "x-egress-policy";

/// The gateway's answer to a proxy refusing `target` by its destination policy (`policy`, when it said which).
pub(crate) fn policy_denial(proxy: &str, target: &str, policy: Option<String>) -> GatewayError {
    GatewayError::denied(format!(
        "proxy {proxy} refuses {target}{}",
        policy.map(|policy| format!(" ({policy})")).unwrap_or_default()
    ))
}

/// Connects to `upstream` and asks it for a tunnel to `authority`; the stream and any bytes after its answer.
pub(crate) async fn open_tunnel(upstream: &Upstream, authority: &str) -> Result<(TcpStream, Vec<u8>), GatewayError> {
    let mut stream = TcpStream::connect(upstream.address.as_str()).await.map_err(|error| {
        GatewayError::upstream(
            "connection_refused",
            format!("proxy {} at {}: {error}", upstream.proxy, upstream.address),
        )
    })?;
    let _ = stream.set_nodelay(true);
    let mut head = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n");
    if let Some(authorization) = upstream.authorization.as_ref().and_then(|value| value.to_str().ok()) {
        head.push_str("Proxy-Authorization: ");
        head.push_str(authorization);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    let broken = |error: io::Error| {
        GatewayError::upstream("connection_terminated", format!("proxy {}: {error}", upstream.proxy))
    };
    stream.write_all(head.as_bytes()).await.map_err(broken)?;
    let mut answer = Vec::with_capacity(512);
    let end = loop {
        if let Some(end) = answer.windows(4).position(|window| window == b"\r\n\r\n") {
            break end + 4;
        }
        if answer.len() >= MAX_CONNECT_ANSWER {
            return Err(GatewayError::upstream(
                "http_response_header_section_size",
                format!("proxy {} answered with an oversized head", upstream.proxy),
            ));
        }
        let mut chunk = [0_u8; 1024];
        let read = stream.read(&mut chunk).await.map_err(broken)?;
        if read == 0 {
            return Err(GatewayError::upstream(
                "connection_terminated",
                format!("proxy {} closed before answering", upstream.proxy),
            ));
        }
        answer.extend_from_slice(&chunk[..read]);
    };
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut parsed = httparse::Response::new(&mut headers);
    let status = match parsed.parse(&answer[..end]) {
        Ok(httparse::Status::Complete(_)) => parsed.code.unwrap_or_default(),
        _ => {
            return Err(GatewayError::upstream(
                "http_protocol_error",
                format!("proxy {} answered with something not HTTP", upstream.proxy),
            ));
        }
    };
    match status {
        200..=299 => Ok((stream, answer[end..].to_vec())),
        403 => {
            let policy = parsed
                .headers
                .iter()
                .find(|header| header.name.eq_ignore_ascii_case(POLICY_HEADER))
                .map(|header| String::from_utf8_lossy(header.value).into_owned());
            Err(policy_denial(&upstream.proxy, authority, policy))
        }
        407 => Err(GatewayError::upstream(
            "proxy_configuration_error",
            format!("proxy {} refused the gateway's credentials", upstream.proxy),
        )),
        code => Err(GatewayError::upstream(
            "destination_unavailable",
            format!("proxy {} answered CONNECT {authority} with {code}", upstream.proxy),
        )),
    }
}

/// Connects the pooled client to one upstream proxy, whatever the request's host: the connection is marked as a
/// proxy's, so requests keep their absolute URL.
#[derive(Clone)]
pub(crate) struct UpstreamConnector {
    pub(crate) address: Arc<str>,
    pub(crate) timeout: Duration,
}

impl tower::Service<Uri> for UpstreamConnector {
    type Response = ProxyStream;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<ProxyStream>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: Uri) -> Self::Future {
        let (address, timeout) = (self.address.clone(), self.timeout);
        Box::pin(async move {
            let stream = tokio::time::timeout(timeout, TcpStream::connect(&*address))
                .await
                .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, format!("connecting to {address} timed out")))??;
            let _ = stream.set_nodelay(true);
            Ok(ProxyStream(TokioIo::new(stream)))
        })
    }
}

/// A connection to an upstream proxy.
pub(crate) struct ProxyStream(TokioIo<TcpStream>);

impl Connection for ProxyStream {
    fn connected(&self) -> Connected {
        Connected::new().proxy(true)
    }
}

impl hyper::rt::Read for ProxyStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for ProxyStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
