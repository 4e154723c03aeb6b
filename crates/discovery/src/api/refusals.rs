//! `GET /v1/refusals`: a stream of the refusals (bans, throttles) the caller's tenant reports, from any client, as the
//! lease store takes them. Gateway replicas follow it, so a refusal seen at one replica moves the tenant's sessions
//! off that proxy at every replica, not only at the one that saw it.
//!
//! The body is newline-delimited JSON (`application/x-ndjson`): first the tenant's live cooldowns (so a client that
//! reconnects, after a change of leader for example, misses none), then `{"type":"synced"}`, then each refusal as it
//! comes, with `{"type":"heartbeat"}` every [`HEARTBEAT`] while nothing does. The stream ends when this replica stops
//! serving (a follower, or shutting down), or when its client falls [`crate::REFUSAL_BACKLOG`] refusals behind; the
//! client connects again.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use schemars::JsonSchema;
use serde::Serialize;
use tokio::sync::broadcast;

use super::{Authorized, Shared, needs, parse_query, timestamp};
use crate::metrics::StreamGuard;
use crate::problem::Problem;
use crate::{Discovery, Refusal};

/// How often a stream with nothing to say sends a heartbeat, so its client can tell a quiet stream from a dead one.
pub const HEARTBEAT: Duration = Duration::from_secs(10);

/// How often a stream looks whether this replica still serves.
const GATE_CHECK: Duration = Duration::from_millis(250);

/// One line of the stream.
#[derive(Serialize, JsonSchema)]
#[serde(tag = "type", rename_all = "camelCase")]
#[schemars(rename = "RefusalEvent")]
pub(super) enum RefusalLine {
    /// `proxies` cool down for `target` until `until`: the tenant's sessions on them for that site move.
    Refusal {
        /// The normalised site.
        target: String,
        /// `namespace/name` of each proxy the refusal cooled down (the reported one, and those leaving through its
        /// egress address).
        proxies: Vec<String>,
        /// When the cooldown ends.
        #[schemars(extend("format" = "date-time"))]
        until: String,
    },
    /// Every cooldown live when the stream opened has been sent; refusals follow as they come.
    Synced,
    /// Nothing happened for a while; the stream is alive.
    Heartbeat,
}

impl RefusalLine {
    fn of(refusal: &Refusal) -> Self {
        Self::Refusal {
            target: refusal.target.clone(),
            proxies: refusal.proxies.iter().map(ToString::to_string).collect(),
            until: timestamp(refusal.until),
        }
    }

    fn bytes(&self) -> Bytes {
        let mut line = serde_json::to_vec(self).unwrap_or_default();
        line.push(b'\n');
        Bytes::from(line)
    }
}

/// What a stream carries between lines.
struct Follow {
    state: Arc<Discovery>,
    tenant: Arc<str>,
    receiver: broadcast::Receiver<Arc<Refusal>>,
    pending: VecDeque<Bytes>,
    ticks: tokio::time::Interval,
    quiet_since: tokio::time::Instant,
    _open: StreamGuard,
}

impl Follow {
    /// The next line, or `None` to end the stream.
    async fn next(&mut self) -> Option<Bytes> {
        loop {
            if let Some(line) = self.pending.pop_front() {
                self.quiet_since = tokio::time::Instant::now();
                return Some(line);
            }
            tokio::select! {
                received = self.receiver.recv() => match received {
                    Ok(refusal) if refusal.tenant == self.tenant => {
                        self.state.metrics.refusal_sent();
                        self.pending.push_back(RefusalLine::of(&refusal).bytes());
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        tracing::warn!(tenant = %self.tenant, missed, "a refusal stream fell behind; ending it so its client reconnects");
                        return None;
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                },
                _ = self.ticks.tick() => {
                    if self.state.gate.refusal().is_some() {
                        return None;
                    }
                    if self.quiet_since.elapsed() >= HEARTBEAT {
                        self.pending.push_back(RefusalLine::Heartbeat.bytes());
                    }
                }
            }
        }
    }
}

/// `GET /v1/refusals`: the caller's tenant's live cooldowns, then its refusals as they come.
pub(super) async fn watch_refusals(
    State(state): Shared,
    Authorized { caller, .. }: Authorized<needs::Read>,
    query: Result<Query<BTreeMap<String, String>>, QueryRejection>,
) -> Result<Response, Problem> {
    parse_query(query, &[])?;
    // Subscribed before the snapshot is read, so a refusal between the two is sent (twice at worst), never lost.
    let receiver = state.refusals();
    let now = SystemTime::now();
    // Without the snapshot the stream would claim a sync it does not have: refused, and the gateway asks again.
    let live = state.store.cooldowns(None, now).await.map_err(super::leases::lease_problem)?;
    let mut pending: VecDeque<Bytes> = live
        .into_iter()
        .filter(|cooldown| cooldown.reporters.iter().any(|reporter| reporter == caller.owner()))
        .map(|cooldown| {
            state.metrics.refusal_sent();
            RefusalLine::Refusal {
                target: cooldown.target,
                proxies: vec![cooldown.proxy.to_string()],
                until: timestamp(cooldown.until),
            }
            .bytes()
        })
        .collect();
    pending.push_back(RefusalLine::Synced.bytes());
    let mut ticks = tokio::time::interval(GATE_CHECK);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let follow = Follow {
        _open: state.metrics.refusal_stream(),
        state: state.clone(),
        tenant: caller.tenant.clone(),
        receiver,
        pending,
        ticks,
        quiet_since: tokio::time::Instant::now(),
    };
    let lines = futures::stream::unfold(follow, |mut follow| async move {
        let line = follow.next().await?;
        Some((Ok::<_, std::convert::Infallible>(line), follow))
    });
    let mut response = (StatusCode::OK, Body::from_stream(lines)).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response.extensions_mut().insert(crate::Streamed);
    Ok(response)
}
