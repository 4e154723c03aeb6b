//! The discovery API's answers as typed values: leases, and the listings of proxies and cooldowns. The discovery
//! server writes them (a lease borrowing from its records, so answering copies nothing), the Rust client reads them
//! (owning, `'static`), and the gateway routes through what the client read: host, port and credentials as fields,
//! so nobody parses a URL another part formatted, and a field renamed on one side fails to compile on the other.

use std::borrow::Cow;
use std::fmt;

use serde::{Deserialize, Serialize};

mod listing;

pub use listing::{ClearedCooldowns, Cooldown, CooldownList, CooldownPolicy, EndedSessions, Pacing, Proxy, ProxyList};

/// A lease: granted (`POST /v1/leases`), or renewed (`POST /v1/leases/{id}/renew`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema), schemars(rename = "Lease"))]
#[serde(rename_all = "camelCase")]
pub struct Lease<'a> {
    /// Self-verifying: usable only with a token of the tenant that took the lease, by any replica that shares the
    /// operator's lease key (it survives restarts and failovers); renew answers a newer ID for the same lease.
    pub id: Cow<'a, str>,
    /// The proxy it is on.
    pub proxy: ProxyRef<'a>,
    /// The normalised target.
    pub target: Cow<'a, str>,
    /// RFC 3339.
    #[cfg_attr(feature = "schema", schemars(extend("format" = "date-time")))]
    pub expires_at: Cow<'a, str>,
    /// On renew only: true when the proxy's instance was replaced since the holder was last told its URL: use
    /// `proxy.url` from now on (the old instance is kept only until its holders renew, or the drain timeout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaced: Option<bool>,
    /// For a session with `sessionLifetimeSeconds`: how long, from this answer, it keeps this proxy (its next lease
    /// after that goes to another); a holder lets go of the proxy then (the gateway closes the session's tunnels).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_ends_in_milliseconds: Option<u64>,
}

/// The proxy a lease is on.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema), schemars(rename = "ProxyRef"))]
#[serde(rename_all = "camelCase")]
pub struct ProxyRef<'a> {
    /// The Proxy's namespace.
    pub namespace: Cow<'a, str>,
    /// The Proxy's name.
    pub name: Cow<'a, str>,
    /// A host name, an IPv4 address or an IPv6 address (without brackets).
    pub host: Cow<'a, str>,
    /// Its port.
    pub port: u16,
    /// `http://[user:password@]host:port`; credentials only for lease-scope tokens.
    pub url: Cow<'a, str>,
    /// The credentials the proxy takes (the ones in `url`, not percent-encoded), for lease-scope tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<Credentials<'a>>,
    /// The address sites see requests through this proxy come from, once its probes observed it: a client holding
    /// leases on several proxies drops, on a ban or a throttle, every one that leaves through the same address
    /// (they share the cooldown).
    #[serde(rename = "egressIP", default, skip_serializing_if = "Option::is_none")]
    pub egress_ip: Option<Cow<'a, str>>,
    /// Its pace for one site, when it is paced: a holder sends one request per lease through it, and takes a new
    /// lease (which waits for the next slot) for the next request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pacing: Option<Pacing>,
}

impl ProxyRef<'_> {
    /// `host:port`, with an IPv6 host in brackets: what a client connects to.
    pub fn address(&self) -> String {
        egress_fleet::authority(&self.host, self.port)
    }

    /// `namespace/name`.
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

impl fmt::Debug for ProxyRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URL's user information holds the password: it never reaches a log.
        let url = redacted_url(&self.url);
        f.debug_struct("ProxyRef")
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .field("host", &self.host)
            .field("port", &self.port)
            .field("url", &url)
            .field("credentials", &self.credentials)
            .field("egress_ip", &self.egress_ip)
            .field("pacing", &self.pacing)
            .finish()
    }
}

/// A proxy URL with its user information (user name and password) replaced by `<redacted>`.
fn redacted_url(url: &str) -> String {
    match url.split_once("://").and_then(|(scheme, rest)| Some((scheme, rest.rsplit_once('@')?.1))) {
        Some((scheme, address)) => format!("{scheme}://<redacted>@{address}"),
        None => url.to_owned(),
    }
}

/// A proxy's user name and password.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema), schemars(rename = "ProxyCredentials"))]
pub struct Credentials<'a> {
    /// The user name.
    pub username: Cow<'a, str>,
    /// The password.
    pub password: Cow<'a, str>,
}

impl fmt::Debug for Credentials<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The password never reaches a log.
        f.debug_struct("Credentials").field("username", &self.username).field("password", &"<redacted>").finish()
    }
}

/// An owned lease, as a client keeps it.
pub type OwnedLease = Lease<'static>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_written_borrowed_reads_back_owned_and_the_password_stays_out_of_debug() {
        let (host, password) = (String::from("2001:db8::7"), String::from("s3cret"));
        let lease = Lease {
            id: Cow::Borrowed("l1.abc"),
            proxy: ProxyRef {
                namespace: Cow::Borrowed("crawl"),
                name: Cow::Borrowed("eu-0"),
                host: Cow::Borrowed(&host),
                port: 3128,
                url: Cow::Borrowed("http://u:s3cret@[2001:db8::7]:3128"),
                credentials: Some(Credentials { username: Cow::Borrowed("u"), password: Cow::Borrowed(&password) }),
                egress_ip: None,
                pacing: None,
            },
            target: Cow::Borrowed("example.com"),
            expires_at: Cow::Borrowed("2026-12-06T03:00:00Z"),
            replaced: None,
            session_ends_in_milliseconds: None,
        };
        let json = serde_json::to_string(&lease).expect("serialised");
        assert!(!json.contains("replaced") && !json.contains("egressIP"), "absent fields are left out: {json}");
        let read: OwnedLease = serde_json::from_str(&json).expect("read back");
        assert_eq!(read, lease);
        assert_eq!(read.proxy.address(), "[2001:db8::7]:3128");
        assert_eq!(read.proxy.id(), "crawl/eu-0");
        assert!(!format!("{read:?}").contains("s3cret"), "{read:?}");
        // An answer from a server before credentials were a field still reads.
        let older = json.replace(r#","credentials":{"username":"u","password":"s3cret"}"#, "");
        assert_eq!(serde_json::from_str::<OwnedLease>(&older).expect("older").proxy.credentials, None);
    }
}
