//! `GET /v1/proxies`: the healthy proxies with their load, credentials only on the caller's own leases.

use super::*;

/// Everything but RFC 3986's unreserved characters, which a URL userinfo part carries as they are.
pub(super) const NOT_UNRESERVED: &percent_encoding::AsciiSet =
    &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// Percent-encodes a URL userinfo part.
pub(super) fn userinfo(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, NOT_UNRESERVED).to_string()
}

/// The proxy URL; with credentials only when `credentials` (the caller holds a lease on it, or is an admin).
pub(super) fn proxy_url(record: &ProxyRecord, credentials: bool) -> String {
    match &record.credentials {
        Some(found) if credentials => {
            let (user, password) = (userinfo(&found.username), userinfo(found.password.expose()));
            format!("http://{user}:{password}@{}", record.endpoint())
        }
        _ => format!("http://{}", record.endpoint()),
    }
}

/// A healthy proxy, with its load.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(rename = "Proxy")]
pub(super) struct ProxyEntry {
    namespace: String,
    name: String,
    host: String,
    port: u16,
    /// `http://[user:password@]host:port`; credentials only on the caller's own leases (an admin sees them all).
    url: String,
    /// The address sites see requests through this proxy come from, once its probes observed it; proxies sharing
    /// it share cooldowns.
    #[serde(rename = "egressIP", skip_serializing_if = "Option::is_none")]
    egress_ip: Option<String>,
    labels: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    zone: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    provider: Option<String>,
    /// The name of the ProxyPool it is a member of, in its namespace.
    #[serde(skip_serializing_if = "Option::is_none")]
    pool: Option<String>,
    active_leases: u32,
    max_leases: u32,
    /// How long a ban cools it down for a site, when it has a policy of its own (the operator always gives one).
    #[serde(skip_serializing_if = "Option::is_none")]
    cooldown_policy: Option<CooldownPolicyEntry>,
    /// With `target`: when its cooldown for that site ends.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    cooling_down_until: Option<String>,
    /// With `target`: the share of requests reported through this proxy for that site (in the last hour of
    /// reports) that it served.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    success_rate: Option<f64>,
    /// With `target`: how many reported requests `successRate` is over.
    #[serde(skip_serializing_if = "Option::is_none")]
    reported: Option<u64>,
}

/// The proxies `GET /v1/proxies` lists.
#[derive(Serialize, JsonSchema)]
pub(super) struct ProxyList {
    proxies: Vec<ProxyEntry>,
}

/// How long a site's ban cools a proxy down: `baseSeconds` after the first ban in a row, times `factor` for each
/// further one, at most `maxSeconds`.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(rename = "CooldownPolicy")]
pub(super) struct CooldownPolicyEntry {
    base_seconds: u64,
    factor: u32,
    max_seconds: u64,
}

impl From<egress_lease::CooldownPolicy> for CooldownPolicyEntry {
    fn from(policy: egress_lease::CooldownPolicy) -> Self {
        Self { base_seconds: policy.base.as_secs(), factor: policy.factor, max_seconds: policy.max.as_secs() }
    }
}

pub(super) async fn list_proxies(
    State(state): Shared,
    Headers(headers): Headers,
    query: Result<Query<BTreeMap<String, String>>, QueryRejection>,
) -> Result<Response, Problem> {
    let caller = authorize(&state, &headers, Scope::Read)?;
    let query = parse_query(query, &["selector", "target", "pool"])?;
    let selector = Selector::parse(query.get("selector").map_or("", String::as_str))
        .map_err(|error| Problem::bad_request(error.to_string()))?;
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
    let entries: Vec<ProxyEntry> = matching
        .iter()
        .zip(loads)
        .map(|(record, load)| ProxyEntry {
            namespace: record.id.namespace().to_owned(),
            name: record.id.name().to_owned(),
            host: record.host.clone(),
            port: record.port,
            url: proxy_url(record, credentials(record)),
            egress_ip: record.egress_ip.clone(),
            labels: record.labels.clone(),
            zone: record.zone.clone(),
            provider: record.provider.clone(),
            pool: record.pool.as_ref().map(|pool| pool.name().to_owned()),
            active_leases: load.as_ref().map_or(0, |load| load.active_leases),
            max_leases: record.max_leases,
            cooldown_policy: record.cooldown.map(CooldownPolicyEntry::from),
            cooling_down_until: load.as_ref().and_then(|load| load.cooling_down_until).map(timestamp),
            success_rate: load.as_ref().and_then(|load| load.outcomes).and_then(|outcomes| outcomes.success_rate()),
            reported: load.as_ref().and_then(|load| load.outcomes).map(|outcomes| outcomes.total()),
        })
        .collect();
    Ok(Json(ProxyList { proxies: entries }).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn userinfo_is_percent_encoded() {
        assert_eq!(userinfo("crawler"), "crawler");
        assert_eq!(userinfo("p@ss:w/rd %"), "p%40ss%3Aw%2Frd%20%25");
    }
}
