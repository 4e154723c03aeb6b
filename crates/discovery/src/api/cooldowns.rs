//! The cooldown routes: list the live cooldowns, and (admin) clear a site's.

use std::collections::BTreeMap;
use std::time::SystemTime;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};

use super::leases::{lease_problem, parse_proxy};
use super::{Authorized, Shared, needs, parse_query, timestamp};
use crate::ProxyId;
use crate::auth::Scope;
use crate::problem::Problem;

/// `DELETE /v1/cooldowns?target=…[&proxy=namespace/name]`: ends the cooldowns for a site now (of one proxy and
/// those sharing its egress IP, or of every proxy) and forgets their streaks; answered once the change is kept.
pub(super) async fn clear_cooldowns(
    State(state): Shared,
    Authorized { .. }: Authorized<needs::Admin>,
    query: Result<Query<BTreeMap<String, String>>, QueryRejection>,
) -> Result<Response, Problem> {
    let query = parse_query(query, &["target", "proxy"])?;
    let Some(target) = query.get("target") else {
        return Err(Problem::bad_request("give the site whose cooldowns to clear: ?target=<host or URL>"));
    };
    let proxy = query.get("proxy").map(|proxy| parse_proxy(proxy)).transpose()?;
    if let Some(proxy) = &proxy
        && !state.records.read().expect("record lock").contains_key(proxy)
    {
        return Err(Problem::not_found(format!("no proxy {proxy:?}")));
    }
    let cleared =
        state.store.clear_cooldowns(target, proxy.as_ref(), SystemTime::now()).await.map_err(lease_problem)?;
    let mut proxies: Vec<&ProxyId> = cleared.iter().map(|cooldown| &cooldown.proxy).collect();
    proxies.dedup();
    let writes = proxies.iter().map(|proxy| state.journal.persist(state.store.as_ref(), proxy, &state.metrics));
    futures::future::join_all(writes).await;
    state.metrics.cooldowns_cleared(cleared.len());
    tracing::info!(target = %target, proxy = ?proxy, cleared = cleared.len(), "cooldowns cleared by an administrator");
    Ok(Json(egress_wire::ClearedCooldowns { cleared: cleared.into_iter().map(listed).collect() }).into_response())
}

/// A lease store's cooldown as the API lists it.
fn listed(cooldown: egress_lease::Cooldown) -> egress_wire::Cooldown {
    egress_wire::Cooldown {
        proxy: cooldown.proxy.to_string(),
        target: cooldown.target,
        until: timestamp(cooldown.until),
        streak: cooldown.streak,
    }
}

pub(super) async fn list_cooldowns(
    State(state): Shared,
    Authorized { caller, .. }: Authorized<needs::Read>,
    query: Result<Query<BTreeMap<String, String>>, QueryRejection>,
) -> Result<Response, Problem> {
    let query = parse_query(query, &["target"])?;
    let cooldowns = state
        .store
        .cooldowns(query.get("target").map(String::as_str), SystemTime::now())
        .await
        .map_err(lease_problem)?;
    // A tenant sees the cooldowns its own reports made; an admin sees every one.
    let cooldowns: Vec<egress_wire::Cooldown> = cooldowns
        .into_iter()
        .filter(|cooldown| {
            caller.scope == Scope::Admin || cooldown.reporters.iter().any(|reporter| reporter == caller.owner())
        })
        .map(listed)
        .collect();
    Ok(Json(egress_wire::CooldownList { cooldowns }).into_response())
}
