//! `GET /v1/proxies`: the healthy proxies with their load, credentials only on the caller's own leases.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};

use super::leases::{lease_problem, resolve_pool};
use super::{Authorized, Shared, needs, parse_query, timestamp};
use crate::auth::Scope;
use crate::problem::Problem;
use crate::{ProxyId, ProxyRecord};

/// A lease store's cooldown policy as the API lists it.
/// A proxy's pace as the API shows it.
pub(super) fn pacing(pacing: egress_lease::Pacing) -> egress_wire::Pacing {
    egress_wire::Pacing {
        interval_milliseconds: u64::try_from(pacing.interval.as_millis()).unwrap_or(u64::MAX),
        burst: pacing.burst,
    }
}

fn cooldown_policy(policy: egress_lease::CooldownPolicy) -> egress_wire::CooldownPolicy {
    egress_wire::CooldownPolicy {
        base_seconds: policy.base.as_secs(),
        factor: policy.factor,
        max_seconds: policy.max.as_secs(),
    }
}

pub(super) async fn list_proxies(
    State(state): Shared,
    Authorized { caller, .. }: Authorized<needs::Read>,
    query: Result<Query<BTreeMap<String, String>>, QueryRejection>,
) -> Result<Response, Problem> {
    let query = parse_query(query, &["selector", "target", "pool"])?;
    let selector = state.selector(query.get("selector").map_or("", String::as_str))?;
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
    let loads =
        state.store.loads_of(&ids, query.get("target").map(String::as_str), now).await.map_err(lease_problem)?;
    // Credentials only on the caller's own leases (an admin sees them all): a lease token never learns the password
    // of a proxy it was not leased.
    let held = if caller.scope == Scope::Lease {
        state.store.held_by(caller.owner(), now).await.map_err(lease_problem)?
    } else {
        Default::default()
    };
    let credentials = |record: &ProxyRecord| caller.scope == Scope::Admin || held.contains(&record.id);
    let proxies: Vec<egress_wire::Proxy> = matching
        .iter()
        .zip(loads)
        .map(|(record, load)| egress_wire::Proxy {
            namespace: record.id.namespace().to_owned(),
            name: record.id.name().to_owned(),
            host: record.host.clone(),
            port: record.port,
            url: record.url(credentials(record)),
            egress_ip: record.egress_ip.clone(),
            labels: record.labels.clone(),
            zone: record.zone.clone(),
            provider: record.provider.clone(),
            pool: record.pool.as_ref().map(|pool| pool.name().to_owned()),
            active_leases: load.as_ref().map_or(0, |load| load.active_leases),
            max_leases: record.max_leases,
            cooldown_policy: record.cooldown.map(cooldown_policy),
            pacing: record.pacing.map(pacing),
            cooling_down_until: load.as_ref().and_then(|load| load.cooling_down_until).map(timestamp),
            success_rate: load.as_ref().and_then(|load| load.outcomes).and_then(|outcomes| outcomes.success_rate()),
            reported: load.as_ref().and_then(|load| load.outcomes).map(|outcomes| outcomes.total()),
        })
        .collect();
    Ok(Json(egress_wire::ProxyList { proxies }).into_response())
}
