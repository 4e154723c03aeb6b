//! The discovery API's listings: proxies (`GET /v1/proxies`) and cooldowns (`GET` and `DELETE /v1/cooldowns`),
//! owned, as the server writes them and the clients read them.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::redacted_url;

/// A healthy proxy, with its load.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema), schemars(rename = "Proxy"))]
#[serde(rename_all = "camelCase")]
pub struct Proxy {
    /// The Proxy's namespace.
    pub namespace: String,
    /// The Proxy's name.
    pub name: String,
    /// A host name, an IPv4 address or an IPv6 address (without brackets).
    pub host: String,
    /// Its port.
    pub port: u16,
    /// `http://[user:password@]host:port`; credentials only on the caller's own leases (an admin sees them all).
    pub url: String,
    /// The address sites see requests through this proxy come from, once its probes observed it; proxies sharing
    /// it share cooldowns.
    #[serde(rename = "egressIP", default, skip_serializing_if = "Option::is_none")]
    pub egress_ip: Option<String>,
    /// The Proxy's labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Its zone (`placement.zone`), when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// Its provider (absent for External Proxies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// The name of the ProxyPool it is a member of, in its namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Leases on it now: one per lease without a session, one per (session, site) however many leases share it.
    pub active_leases: u32,
    /// Its lease cap.
    pub max_leases: u32,
    /// How long a ban cools it down for a site, when it has a policy of its own (the operator always gives one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cooldown_policy: Option<CooldownPolicy>,
    /// How often its egress address is leased for one site, when it is paced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pacing: Option<Pacing>,
    /// With `target`: when its cooldown for that site ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(extend("format" = "date-time")))]
    pub cooling_down_until: Option<String>,
    /// With `target`: the share of requests reported through this proxy for that site (in the last hour of
    /// reports) that it served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 0.0, max = 1.0)))]
    pub success_rate: Option<f64>,
    /// With `target`: how many reported requests `successRate` is over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reported: Option<u64>,
}

impl Proxy {
    /// `host:port`, with an IPv6 host in brackets: what a client connects to.
    pub fn address(&self) -> String {
        egress_fleet::authority(&self.host, self.port)
    }

    /// Which proxy this is.
    pub fn id(&self) -> egress_fleet::ProxyId {
        egress_fleet::ProxyId::new(&self.namespace, &self.name)
    }
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URL's user information holds the password of a proxy the caller holds a lease on: never in a log.
        f.debug_struct("Proxy")
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .field("host", &self.host)
            .field("port", &self.port)
            .field("url", &redacted_url(&self.url))
            .field("egress_ip", &self.egress_ip)
            .field("labels", &self.labels)
            .field("zone", &self.zone)
            .field("provider", &self.provider)
            .field("pool", &self.pool)
            .field("active_leases", &self.active_leases)
            .field("max_leases", &self.max_leases)
            .field("cooldown_policy", &self.cooldown_policy)
            .field("pacing", &self.pacing)
            .field("cooling_down_until", &self.cooling_down_until)
            .field("success_rate", &self.success_rate)
            .field("reported", &self.reported)
            .finish()
    }
}

/// The proxies `GET /v1/proxies` lists.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema), schemars(rename = "ProxyList"))]
pub struct ProxyList {
    /// The healthy proxies that match.
    pub proxies: Vec<Proxy>,
}

/// How long a site's ban cools a proxy down: `baseSeconds` after the first ban in a row, times `factor` for each
/// further one, at most `maxSeconds`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema), schemars(rename = "CooldownPolicy"))]
#[serde(rename_all = "camelCase")]
pub struct CooldownPolicy {
    /// The first ban's cooldown.
    pub base_seconds: u64,
    /// What each further ban in a row multiplies it by.
    pub factor: u32,
    /// The longest cooldown.
    pub max_seconds: u64,
}

/// A pace per (egress address, site): `burst` leases at once, then one per `intervalMilliseconds`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema), schemars(rename = "Pacing"))]
#[serde(rename_all = "camelCase")]
pub struct Pacing {
    /// The time between two leases for one site once the burst is spent.
    pub interval_milliseconds: u64,
    /// How many may go at once after a quiet spell.
    pub burst: u32,
}

/// A live cooldown: `proxy` is not leased for `target` until `until`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema), schemars(rename = "Cooldown"))]
pub struct Cooldown {
    /// `namespace/name`.
    pub proxy: String,
    /// The site.
    pub target: String,
    /// When the proxy may be leased for the site again (RFC 3339).
    #[cfg_attr(feature = "schema", schemars(extend("format" = "date-time")))]
    pub until: String,
    /// Bans in a row: each one multiplies the next cooldown.
    pub streak: u32,
}

/// The live cooldowns (`GET /v1/cooldowns`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema), schemars(rename = "CooldownList"))]
pub struct CooldownList {
    /// Each proxy's cooldown for each site.
    pub cooldowns: Vec<Cooldown>,
}

/// The cooldowns that were running and ended (`DELETE /v1/cooldowns`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema), schemars(rename = "ClearedCooldowns"))]
pub struct ClearedCooldowns {
    /// What was cleared.
    pub cleared: Vec<Cooldown>,
}

/// What ending sessions did (`DELETE /v1/sessions`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema), schemars(rename = "EndedSessions"))]
pub struct EndedSessions {
    /// Sessions (each per site) that held a lease or kept a proxy and hold neither now.
    pub sessions: u64,
    /// Leases released, at whichever replica or gateway held them.
    pub released_leases: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listed_proxy_reads_back_and_its_password_stays_out_of_debug() {
        let json = r#"{"namespace":"crawl","name":"eu-0","host":"2001:db8::7","port":3128,
            "url":"http://u:s3cret@[2001:db8::7]:3128","labels":{"tier":"a"},"activeLeases":1,"maxLeases":5,
            "cooldownPolicy":{"baseSeconds":600,"factor":2,"maxSeconds":3600},"successRate":0.5,"reported":4}"#;
        let proxy: Proxy = serde_json::from_str(json).expect("read");
        assert_eq!(proxy.address(), "[2001:db8::7]:3128");
        assert_eq!(proxy.id().to_string(), "crawl/eu-0");
        assert_eq!(proxy.cooldown_policy.map(|policy| policy.factor), Some(2));
        assert_eq!((proxy.zone.as_deref(), proxy.cooling_down_until.as_deref()), (None, None));
        let debug = format!("{proxy:?}");
        assert!(!debug.contains("s3cret") && debug.contains("<redacted>@[2001:db8::7]:3128"), "{debug}");
        let written = serde_json::to_string(&proxy).expect("written");
        assert!(!written.contains("zone") && !written.contains("egressIP"), "absent fields are left out: {written}");
        assert_eq!(serde_json::from_str::<Proxy>(&written).expect("read back"), proxy);
    }
}
