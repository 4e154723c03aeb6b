//! The options a crawler puts in the gateway's proxy user name.
//!
//! The user name is a comma-separated list of `key-value` options (the value is everything after the key's first
//! dash), the password a tenant token: `http://session-a1,pool-eu-west:TOKEN@egress-gateway:8088`. [`ROTATE`] (or
//! an empty user name, which python-requests and Scrapy do not send at all) means no options. Keys:
//!
//! | option | value | meaning |
//! | --- | --- | --- |
//! | `session-<id>` | 1–128 of `A-Z a-z 0-9 . _ ~ -` | requests of one session and site go through one proxy |
//! | `sticky-<seconds>` | 1–86400 | how long an idle session keeps its proxy (needs `session`) |
//! | `lifetime-<seconds>` | 1–86400 | the longest a session keeps one proxy, from its first request there; then it moves (needs `session`) |
//! | `requests-<count>` | 1–1000000 | the most requests a session sends through one proxy; then it moves (needs `session`) |
//! | `pool-<name>` | a ProxyPool, `name` or `namespace.name` | only that pool's members |
//! | `zone-<zone>` | a zone | only proxies in that zone (a Proxy's `placement.zone`, listed as `zone`) |
//! | `provider-<name>` | a provider's name | only proxies on that provider (a Proxy's `provider`) |
//! | `country-<cc>` | ISO 3166-1 alpha-2, any case | only proxies whose egress address the operator's GeoIP database places there |
//! | `asn-<number>` | an AS number | only proxies whose egress address is in that autonomous system (same database) |
//! | `label-<key>=<value>` | a label key and value | only proxies with that label (repeatable) |
//!
//! An unknown key, a key given twice (other than `label`), a malformed value or an option without a value is an
//! error naming it; nothing is ignored.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use egress_fleet::{PoolId, is_dns_label};

/// The user name that means no options: every request rotates. An empty one means the same, but python-requests
/// and Scrapy send no credentials at all for a proxy URL whose user name is empty (`http://:TOKEN@gateway`).
pub const ROTATE: &str = "rotate";

/// The longest session ID.
pub const MAX_SESSION_CHARS: usize = 128;

/// The longest stickiness a session may ask for.
pub const MAX_STICKY: Duration = Duration::from_secs(86_400);

/// The longest lifetime a session may ask for (`lifetime-<seconds>`).
pub const MAX_LIFETIME: Duration = Duration::from_secs(86_400);

/// The most requests a session may ask to send through one proxy (`requests-<count>`).
pub const MAX_SESSION_REQUESTS: u32 = 1_000_000;

/// What the user name asked for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// The session: requests of one session and site reuse one proxy.
    pub session: Option<String>,
    /// How long an idle session keeps its proxy; `None`: the gateway's default.
    pub sticky: Option<Duration>,
    /// The longest a session keeps one proxy, from its first request through it; `None`: while it is eligible.
    pub lifetime: Option<Duration>,
    /// The most requests a session sends through one proxy; `None`: no limit.
    pub requests: Option<u32>,
    /// Only members of this ProxyPool (`name`, or `namespace/name` written `namespace.name`).
    pub pool: Option<String>,
    /// Only proxies in this zone (a Proxy's `placement.zone`).
    pub zone: Option<String>,
    /// Only proxies on this provider (a Managed Proxy's `provider`).
    pub provider: Option<String>,
    /// Labels the proxy must have (each `label-k=v`).
    pub labels: BTreeMap<String, String>,
}

/// Why a user name was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("proxy user name option {option:?}: {reason}")]
pub struct OptionError {
    /// The option as written (empty for the user name as a whole).
    pub option: String,
    /// What is wrong with it.
    pub reason: String,
}

/// How much of an option an error repeats: a user name of any length is not echoed back whole.
const ECHOED_CHARS: usize = 64;

impl OptionError {
    fn new(option: &str, reason: impl fmt::Display) -> Self {
        let option = match option.char_indices().nth(ECHOED_CHARS) {
            Some((end, _)) => format!("{}… ({} characters)", &option[..end], option.chars().count()),
            None => option.to_owned(),
        };
        Self { option, reason: reason.to_string() }
    }
}

impl Options {
    /// Parses a user name.
    ///
    /// # Errors
    /// The first option that is unknown, repeated, malformed or without a value.
    pub fn parse(user: &str) -> Result<Self, OptionError> {
        let mut options = Self::default();
        if user.is_empty() || user == ROTATE {
            return Ok(options);
        }
        for option in user.split(',') {
            let Some((key, value)) = option.split_once('-') else {
                return Err(OptionError::new(option, "expected key-value, such as session-a1 or pool-eu"));
            };
            if value.is_empty() {
                return Err(OptionError::new(option, "has no value"));
            }
            match key {
                "session" => {
                    if !is_session(value) {
                        return Err(OptionError::new(
                            option,
                            format!("a session is 1 to {MAX_SESSION_CHARS} of A-Z a-z 0-9 . _ ~ -"),
                        ));
                    }
                    set_once(&mut options.session, option, value.to_owned())?;
                }
                "sticky" | "lifetime" => {
                    let (slot, most) = if key == "sticky" {
                        (&mut options.sticky, MAX_STICKY)
                    } else {
                        (&mut options.lifetime, MAX_LIFETIME)
                    };
                    let seconds = value.parse::<u64>().ok().filter(|seconds| (1..=most.as_secs()).contains(seconds));
                    let Some(seconds) = seconds else {
                        return Err(OptionError::new(
                            option,
                            format!("is not a whole number of seconds from 1 to {}", most.as_secs()),
                        ));
                    };
                    set_once(slot, option, Duration::from_secs(seconds))?;
                }
                "requests" => {
                    let count = value.parse::<u32>().ok().filter(|count| (1..=MAX_SESSION_REQUESTS).contains(count));
                    let Some(count) = count else {
                        return Err(OptionError::new(
                            option,
                            format!("is not a count from 1 to {MAX_SESSION_REQUESTS}"),
                        ));
                    };
                    set_once(&mut options.requests, option, count)?;
                }
                "pool" => {
                    let pool = match value.split_once('.') {
                        Some((namespace, name)) if is_dns_label(namespace) && is_dns_label(name) => {
                            PoolId::new(namespace, name).to_string()
                        }
                        None if is_dns_label(value) => value.to_owned(),
                        _ => {
                            return Err(OptionError::new(option, "a pool is a name, or namespace.name, of DNS labels"));
                        }
                    };
                    set_once(&mut options.pool, option, pool)?;
                }
                "zone" | "provider" => {
                    if !is_label_value(value) {
                        return Err(OptionError::new(
                            option,
                            format!("is not a {key} name (63 of A-Z a-z 0-9 . _ -, alphanumeric at both ends)"),
                        ));
                    }
                    let slot = if key == "zone" { &mut options.zone } else { &mut options.provider };
                    if slot.replace(value.to_owned()).is_some() {
                        return Err(OptionError::new(option, format!("{key} is given twice")));
                    }
                }
                "country" | "asn" => {
                    // The labels the operator sets from its GeoIP database: a country as ISO 3166-1 alpha-2 (any
                    // case), an AS number as digits.
                    let (label, wanted) = if key == "country" {
                        let valid = value.len() == 2 && value.bytes().all(|byte| byte.is_ascii_alphabetic());
                        if !valid {
                            return Err(OptionError::new(option, "is not a two-letter country code (ISO 3166-1)"));
                        }
                        (egress_fleet::labels::EGRESS_COUNTRY, value.to_ascii_uppercase())
                    } else {
                        let valid = value.parse::<u32>().is_ok_and(|asn| asn > 0) && !value.starts_with('0');
                        if !valid {
                            return Err(OptionError::new(option, "is not an AS number (1 to 4294967295)"));
                        }
                        (egress_fleet::labels::EGRESS_ASN, value.to_owned())
                    };
                    if options.labels.insert(label.to_owned(), wanted).is_some() {
                        return Err(OptionError::new(option, format!("{key} is given twice")));
                    }
                }
                "label" => {
                    let Some((name, label)) = value.split_once('=') else {
                        return Err(OptionError::new(option, "expected label-<key>=<value>"));
                    };
                    if !is_label_key(name) || !is_label_value(label) {
                        return Err(OptionError::new(option, "is not a label key=value"));
                    }
                    if options.labels.insert(name.to_owned(), label.to_owned()).is_some() {
                        return Err(OptionError::new(option, format!("the label {name} is given twice")));
                    }
                }
                other => {
                    return Err(OptionError::new(
                        option,
                        format!(
                            "unknown option {other:?} (known: session, sticky, lifetime, requests, pool, zone, \
                             provider, country, asn, label)"
                        ),
                    ));
                }
            }
        }
        let of_a_session = [
            ("sticky", options.sticky.is_some()),
            ("lifetime", options.lifetime.is_some()),
            ("requests", options.requests.is_some()),
        ];
        if options.session.is_none()
            && let Some((name, _)) = of_a_session.iter().find(|(_, given)| *given)
        {
            return Err(OptionError::new(user, format!("{name} needs a session")));
        }
        Ok(options)
    }

    /// Whether the session moves on after a time or a number of requests: each of its requests then leases (with
    /// the session as the sticky key, so the lease state counts them at every gateway replica).
    pub fn limits_session(&self) -> bool {
        self.session.is_some() && (self.lifetime.is_some() || self.requests.is_some())
    }

    /// The label selector the options ask for (`k=v,k=v`), `None` without labels.
    pub fn selector(&self) -> Option<String> {
        (!self.labels.is_empty())
            .then(|| self.labels.iter().map(|(key, value)| format!("{key}={value}")).collect::<Vec<_>>().join(","))
    }
}

fn set_once<T>(slot: &mut Option<T>, option: &str, value: T) -> Result<(), OptionError> {
    if slot.is_some() {
        return Err(OptionError::new(option, "is given twice"));
    }
    *slot = Some(value);
    Ok(())
}

fn is_session(value: &str) -> bool {
    value.len() <= MAX_SESSION_CHARS
        && value.bytes().all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'~' | b'-'))
}

/// A Kubernetes label value: at most 63 of `A-Z a-z 0-9 . _ -`, starting and ending alphanumeric (not empty here).
fn is_label_value(value: &str) -> bool {
    let bytes = value.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.iter().all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'-'))
}

/// A Kubernetes label key: an optional DNS-subdomain prefix and `/`, then a name like a label value.
fn is_label_key(value: &str) -> bool {
    match value.rsplit_once('/') {
        Some((prefix, name)) => {
            prefix.len() <= 253 && !prefix.is_empty() && prefix.split('.').all(is_dns_label) && is_label_value(name)
        }
        None => is_label_value(value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse() {
        assert_eq!(Options::parse("").expect("empty"), Options::default());
        assert_eq!(Options::parse("rotate").expect("the option-less user name"), Options::default());
        let options =
            Options::parse("session-a1.B_~-x,sticky-600,pool-crawl.eu-west,zone-eu,label-tier=gold").expect("parses");
        assert_eq!(options.session.as_deref(), Some("a1.B_~-x"));
        assert_eq!(options.sticky, Some(Duration::from_secs(600)));
        let limited = Options::parse("session-s,lifetime-300,requests-20").expect("a session's lifetime");
        assert_eq!((limited.lifetime, limited.requests), (Some(Duration::from_secs(300)), Some(20)));
        assert!(limited.limits_session() && !options.limits_session());
        assert_eq!(options.pool.as_deref(), Some("crawl/eu-west"));
        assert_eq!(options.selector().as_deref(), Some("tier=gold"));
        assert_eq!(options.zone.as_deref(), Some("eu"), "the zone is the Proxy's, not a label");
        assert_eq!(Options::parse("pool-eu").expect("a bare pool").pool.as_deref(), Some("eu"));
        let prefixed = Options::parse("label-example.com/team=search,provider-gcp").expect("prefixed");
        assert_eq!(prefixed.selector().as_deref(), Some("example.com/team=search"));
        assert_eq!(prefixed.provider.as_deref(), Some("gcp"));
        let geo = Options::parse("country-de,asn-64500").expect("country and AS number");
        assert_eq!(
            geo.selector().as_deref(),
            Some("crawl.example.com/egress-asn=64500,crawl.example.com/egress-country=DE"),
            "the labels the operator sets from its GeoIP database"
        );
    }

    /// Every example user name in docs/gateway.md's options table parses, as a client sends it (percent-decoded).
    #[test]
    fn the_documented_examples_parse() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/gateway.md");
        let text = std::fs::read_to_string(path).expect("docs/gateway.md");
        let block = text
            .split("Examples:\n\n```\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .expect("the examples block after the options table");
        let mut parsed = 0;
        for line in block.lines().filter(|line| !line.trim().is_empty()) {
            let user = line.split_whitespace().next().expect("a user name");
            let decoded = percent_encoding::percent_decode_str(user).decode_utf8().expect("UTF-8");
            let options = Options::parse(&decoded).unwrap_or_else(|error| panic!("{user}: {error}"));
            assert_ne!(options, Options::default(), "{user} asks for something");
            parsed += 1;
        }
        assert!(parsed >= 5, "{parsed} examples");
    }

    #[test]
    fn every_malformed_option_is_refused_with_its_reason() {
        let cases = [
            ("session", "expected key-value"),
            ("session-", "has no value"),
            ("session-a,session-b", "is given twice"),
            ("session-a b", "a session is"),
            (&format!("session-{}", "a".repeat(129)), "a session is"),
            ("sticky-0,session-a", "from 1 to 86400"),
            ("sticky-86401,session-a", "from 1 to 86400"),
            ("sticky-ten,session-a", "whole number"),
            ("sticky-60", "sticky needs a session"),
            ("lifetime-60", "lifetime needs a session"),
            ("requests-5,pool-eu", "requests needs a session"),
            ("lifetime-0,session-a", "from 1 to 86400"),
            ("lifetime-86401,session-a", "from 1 to 86400"),
            ("lifetime-1m,session-a", "whole number of seconds"),
            ("requests-0,session-a", "count from 1 to 1000000"),
            ("requests-1000001,session-a", "count from 1 to 1000000"),
            ("requests-5,requests-6,session-a", "is given twice"),
            ("pool-EU", "a pool is"),
            ("pool-a.b.c", "a pool is"),
            ("pool-a,pool-b", "is given twice"),
            ("zone-eu,zone-us", "zone is given twice"),
            ("provider-a,provider-b", "provider is given twice"),
            ("zone-eu west", "is not a zone name"),
            ("provider--gcp", "is not a provider name"),
            ("label-tier", "expected label-<key>=<value>"),
            ("label-=gold", "is not a label key"),
            ("label-tier=gold,label-tier=silver", "the label tier is given twice"),
            ("country-deu", "is not a two-letter country code"),
            ("country-d1", "is not a two-letter country code"),
            ("country-de,country-us", "country is given twice"),
            ("asn-0", "is not an AS number"),
            ("asn-064500", "is not an AS number"),
            ("asn-4294967296", "is not an AS number"),
            ("city-berlin", "unknown option \"city\""),
            ("session-a,", "expected key-value"),
            ("rotate,session-a", "expected key-value"),
            (",session-a", "expected key-value"),
        ];
        // A user name of any length is not echoed back whole (regression: 100,000 characters came back, twice).
        let long = format!("session-{}", "a".repeat(100_000));
        let error = Options::parse(&long).expect_err("too long").to_string();
        assert!(error.len() < 300 && error.contains("(100008 characters)"), "{} bytes: {error:.200}", error.len());
        for (user, expected) in cases {
            let error = Options::parse(user).expect_err(user);
            assert!(error.to_string().contains(expected), "{user}: {error}");
        }
    }
}
