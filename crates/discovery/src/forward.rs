//! A stopping replica's requests, handed to its successor: make-before-break in the data path.
//!
//! A leader that stops hands the Lease to a Ready replica, but the Service keeps routing to the stopping pod until
//! the EndpointSlice follows the leader label (a second or so); a refusal there (`503 not-serving`) is a failed call
//! for a client that does not retry. So from the moment this replica stops serving until it exits, each request it
//! receives is sent on to the successor (the new leader's pod, once known) and its answer passed back; while the
//! successor is not known yet or not serving yet, the request waits, at most [`FORWARD_WAIT`]. Each answer closes its
//! connection, so the client's next request goes through the Service again.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use http::header;
use http_body_util::{BodyExt, Full};

use crate::Discovery;
use crate::problem::Problem;
use crate::server::MAX_BODY_BYTES;

/// Where this replica's requests go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handoff {
    /// Answered here.
    Serving,
    /// Sent on to the successor at this address (the same discovery port on its pod), or held until it is known.
    Forwarding(Option<SocketAddr>),
}

/// The longest a request waits for a successor that serves, then it is refused as before (`not-serving`).
pub const FORWARD_WAIT: Duration = Duration::from_secs(10);

/// How long one attempt to reach the successor may take.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);

/// Headers of one connection, not of the request (RFC 9110, 7.6.1).
const HOP_BY_HOP: [header::HeaderName; 6] = [
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
];

impl Discovery {
    /// Stops answering requests here: each is held until [`Discovery::forward_to`] names the successor, then sent
    /// there.
    pub fn hand_off(&self) {
        self.handoff.send_replace(Handoff::Forwarding(None));
    }

    /// Sends the requests this replica receives to `successor` (the new leader's discovery address).
    pub fn forward_to(&self, successor: SocketAddr) {
        self.handoff.send_replace(Handoff::Forwarding(Some(successor)));
    }

    /// Answers requests here again (refused while this replica does not serve): no successor could be found.
    pub fn stop_forwarding(&self) {
        self.handoff.send_replace(Handoff::Serving);
    }

    /// Whether requests are handed on rather than answered here.
    pub(crate) fn forwarding(&self) -> bool {
        *self.handoff.borrow() != Handoff::Serving
    }

    /// How long since the last request was handed on (or since the process started).
    pub fn quiet_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_forwarded.load(Ordering::Acquire));
        self.started.elapsed().saturating_sub(last)
    }
}

/// Hands `request` on to the successor, waiting for one that serves at most [`FORWARD_WAIT`]; its answer, or the
/// refusal this replica would have given.
pub(crate) async fn forward(state: Arc<Discovery>, request: Request) -> Response {
    let deadline = tokio::time::Instant::now() + FORWARD_WAIT;
    let (parts, body) = request.into_parts();
    let body = match axum::body::to_bytes(body, MAX_BODY_BYTES).await {
        Ok(body) => body,
        Err(_) => return Problem::bad_request(format!("the body is over {MAX_BODY_BYTES} bytes")).into_response(),
    };
    let mut handoff = state.handoff.subscribe();
    let mut last_error = "no successor yet".to_owned();
    loop {
        let target = *handoff.borrow_and_update();
        if let Handoff::Forwarding(Some(successor)) = target {
            state
                .last_forwarded
                .store(u64::try_from(state.started.elapsed().as_millis()).unwrap_or(u64::MAX), Ordering::Release);
            match tokio::time::timeout(ATTEMPT_TIMEOUT, send(successor, &parts, body.clone())).await {
                Ok(Ok(Some(response))) => return response,
                // The successor is not serving yet (it is reading the fleet): asked again.
                Ok(Ok(None)) => last_error = format!("{successor} is not serving yet"),
                Ok(Err(error)) => last_error = format!("{successor}: {error}"),
                Err(_) => last_error = format!("{successor} did not answer within {ATTEMPT_TIMEOUT:?}"),
            }
        }
        let pause = tokio::time::Instant::now() + Duration::from_millis(100);
        if pause >= deadline {
            tracing::warn!(error = %last_error, "a request found no successor to take it");
            state.metrics.not_serving();
            return Problem::new(
                http::StatusCode::SERVICE_UNAVAILABLE,
                "not-serving",
                "Not serving",
                format!("the operator is shutting down and its successor did not answer ({last_error})"),
            )
            .with_reason("not-serving")
            .with_retry_after(Duration::from_secs(1))
            .closing_connection()
            .into_response();
        }
        // Woken by a new successor, or after a pause to ask the same one again.
        let _ = tokio::time::timeout_at(pause, handoff.changed()).await;
    }
}

/// One attempt: the request to `successor` on a connection of its own. `None` when it answered `not-serving`.
async fn send(successor: SocketAddr, parts: &http::request::Parts, body: Bytes) -> Result<Option<Response>, String> {
    let stream = tokio::net::TcpStream::connect(successor).await.map_err(|error| error.to_string())?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|error| error.to_string())?;
    tokio::spawn(connection);
    let mut request = http::Request::builder()
        .method(parts.method.clone())
        .uri(parts.uri.path_and_query().map_or("/", http::uri::PathAndQuery::as_str));
    for (name, value) in &parts.headers {
        if !HOP_BY_HOP.contains(name) {
            request = request.header(name, value);
        }
    }
    let request = request.body(Full::new(body)).map_err(|error| error.to_string())?;
    let response = sender.send_request(request).await.map_err(|error| error.to_string())?;
    let (mut parts, body) = response.into_parts();
    let body = body.collect().await.map_err(|error| error.to_string())?.to_bytes();
    if parts.status == http::StatusCode::SERVICE_UNAVAILABLE
        && serde_json::from_slice::<serde_json::Value>(&body).is_ok_and(|problem| problem["reason"] == "not-serving")
    {
        return Ok(None);
    }
    for name in &HOP_BY_HOP {
        parts.headers.remove(name);
    }
    // The client's next request opens a new connection, which the Service sends to a replica that stays: this pod
    // goes soon, and a kept-alive connection to it would be reset under the client's next request.
    parts.headers.insert(header::CONNECTION, header::HeaderValue::from_static("close"));
    Ok(Some(Response::from_parts(parts, Body::from(body))))
}
