//! The session route: a tenant ends its sessions.

use std::collections::BTreeMap;
use std::time::SystemTime;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};

use super::leases::lease_problem;
use super::{Authorized, Shared, needs, parse_query};
use crate::problem::Problem;

/// `DELETE /v1/sessions[?session=…]`: ends the caller's session of that name, or all of its sessions: their leases
/// are released (a gateway holding one learns it at its next renewal and leases anew) and the proxies they kept are
/// forgotten, so their next leases choose afresh. Leases without a session are left alone.
pub(super) async fn end_sessions(
    State(state): Shared,
    Authorized { caller, .. }: Authorized<needs::Lease>,
    query: Result<Query<BTreeMap<String, String>>, QueryRejection>,
) -> Result<Response, Problem> {
    let query = parse_query(query, &["session"])?;
    let session = query.get("session").map(String::as_str);
    if session.is_some_and(|session| session.is_empty() || session.len() > 256) {
        return Err(Problem::bad_request("session must be 1 to 256 characters"));
    }
    let ended = state.store.end_sessions(caller.owner(), session, SystemTime::now()).await.map_err(lease_problem)?;
    tracing::info!(
        tenant = caller.owner(),
        session = session.unwrap_or("(all)"),
        sessions = ended.sessions,
        leases = ended.leases,
        "sessions ended by their tenant"
    );
    let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    Ok(Json(egress_wire::EndedSessions { sessions: count(ended.sessions), released_leases: count(ended.leases) })
        .into_response())
}
