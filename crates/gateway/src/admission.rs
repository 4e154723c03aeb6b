//! Who may hold a connection before showing a valid token, and how many wrong tokens an address may show.
//!
//! A connection counts as unauthenticated from its accept until a request on it carries a valid token: at most
//! [`GatewayLimits::max_unauthenticated_per_source`] of them per client address and
//! [`GatewayLimits::max_unauthenticated`] in all (the rest of the connection cap is a reserve only authenticated
//! connections and their tunnels use); one more is closed as soon as it is accepted. A request refused for its
//! credentials (407) closes its connection. Each address may send [`FAILED_AUTH_BURST`] wrong tokens at once and
//! one more per second after that ([`FAILED_AUTH_PER_SECOND`]); beyond that its requests with credentials are
//! answered 429 with `Retry-After`, unchecked, until it has a wrong one to spend again.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use base64::Engine;
use egress_fleet::sources::{Refused, SourceCounts, SourceSlot};
use http::{HeaderMap, header};

use crate::GatewayLimits;
use crate::options::Options;
use crate::route::Authenticator;
use crate::status::GatewayError;

/// Wrong tokens one address may send at once.
pub const FAILED_AUTH_BURST: f64 = 20.0;
/// Wrong tokens one address may send per second beyond the burst.
pub const FAILED_AUTH_PER_SECOND: f64 = 1.0;
/// Addresses whose wrong tokens are remembered at once; past it, one that has spent none recently is forgotten,
/// and when none has, a new address is not limited (memory stays bounded whatever the number of addresses).
const TRACKED_ADDRESSES: usize = 65_536;

/// The gateway's admission of connections and credentials.
pub(crate) struct Admission {
    unauthenticated: Arc<SourceCounts>,
    per_source: usize,
    total: usize,
    /// Per address: the wrong tokens it may still send, as of when.
    failures: Mutex<HashMap<IpAddr, (f64, Instant)>>,
}

impl Admission {
    pub(crate) fn new(limits: &GatewayLimits) -> Self {
        Self {
            unauthenticated: SourceCounts::new(),
            per_source: limits.max_unauthenticated_per_source,
            total: limits.max_unauthenticated,
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Counts a new connection from `source` as unauthenticated, unless that is one too many.
    pub(crate) fn admit(&self, source: IpAddr) -> Result<SourceSlot, Refused> {
        self.unauthenticated.admit(source, self.per_source, self.total)
    }

    /// How long `source` waits before its credentials are checked again, when it has no wrong token left to send.
    pub(crate) fn throttled(&self, source: IpAddr, now: Instant) -> Option<Duration> {
        let failures = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
        let left = failures.get(&source).map(|&(left, at)| refilled(left, at, now))?;
        (left < 1.0).then(|| Duration::from_secs_f64((1.0 - left) / FAILED_AUTH_PER_SECOND))
    }

    /// `source` sent a wrong token.
    pub(crate) fn failed(&self, source: IpAddr, now: Instant) {
        let mut failures = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
        if !failures.contains_key(&source) && failures.len() >= TRACKED_ADDRESSES {
            failures.retain(|_, &mut (left, at)| refilled(left, at, now) < FAILED_AUTH_BURST);
            if failures.len() >= TRACKED_ADDRESSES {
                return;
            }
        }
        let entry = failures.entry(source).or_insert((FAILED_AUTH_BURST, now));
        *entry = ((refilled(entry.0, entry.1, now) - 1.0).max(0.0), now);
    }
}

/// The tenant, token and options of a request, from its `Proxy-Authorization: Basic` (user name: options;
/// password: a tenant token).
pub(crate) fn credentials(
    headers: &HeaderMap,
    auth: &dyn Authenticator,
) -> Result<(String, String, Options), GatewayError> {
    let value = headers.get(header::PROXY_AUTHORIZATION).ok_or_else(|| {
        GatewayError::credentials("send Proxy-Authorization: Basic, with a tenant token as the password")
    })?;
    let value = value.to_str().map_err(|_| GatewayError::credentials("Proxy-Authorization is not text"))?;
    let encoded = value
        .split_once(' ')
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("basic"))
        .map(|(_, encoded)| encoded.trim())
        .ok_or_else(|| GatewayError::credentials("Proxy-Authorization must use the Basic scheme"))?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .ok()
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .ok_or_else(|| GatewayError::credentials("Proxy-Authorization: Basic is not base64 of UTF-8 user:password"))?;
    let (user, token) = decoded
        .split_once(':')
        .ok_or_else(|| GatewayError::credentials("Proxy-Authorization: Basic has no password"))?;
    let tenant = auth.tenant(token).map_err(|refused| GatewayError::credentials(refused.explain()))?;
    let options = Options::parse(user).map_err(|error| GatewayError::bad_request(error.to_string()))?;
    Ok((tenant, token.to_owned(), options))
}

/// What is left of a budget that had `left` at `at`, by `now`.
fn refilled(left: f64, at: Instant, now: Instant) -> f64 {
    (left + now.saturating_duration_since(at).as_secs_f64() * FAILED_AUTH_PER_SECOND).min(FAILED_AUTH_BURST)
}

#[cfg(test)]
mod tests {
    use base64::Engine;
    use http::{HeaderValue, StatusCode, header};

    use super::*;
    use crate::route::StaticTokens;

    fn basic(user: &str, password: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        headers.insert(header::PROXY_AUTHORIZATION, HeaderValue::from_str(&format!("Basic {token}")).expect("a value"));
        headers
    }

    #[test]
    fn credentials_give_the_tenant_and_options_or_say_what_is_wrong() {
        let tokens = StaticTokens::new().with("s3cret", "crawlers");
        let (tenant, _, options) = credentials(&basic("session-a", "s3cret"), &tokens).expect("valid");
        assert_eq!((tenant.as_str(), options.session.as_deref()), ("crawlers", Some("a")));
        let refused = |headers: HeaderMap| credentials(&headers, &tokens).expect_err("refused");
        assert_eq!(refused(HeaderMap::new()).status, StatusCode::PROXY_AUTHENTICATION_REQUIRED);
        assert_eq!(refused(basic("", "wrong")).status, StatusCode::PROXY_AUTHENTICATION_REQUIRED);
        let mut bearer = HeaderMap::new();
        bearer.insert(header::PROXY_AUTHORIZATION, HeaderValue::from_static("Bearer s3cret"));
        assert!(refused(bearer).details.contains("Basic scheme"));
        let mut garbage = HeaderMap::new();
        garbage.insert(header::PROXY_AUTHORIZATION, HeaderValue::from_static("Basic !!!"));
        assert!(refused(garbage).details.contains("base64"));
        let bad_option = refused(basic("city-berlin", "s3cret"));
        assert_eq!(bad_option.status, StatusCode::BAD_REQUEST);
        assert!(bad_option.details.contains("unknown option"), "{}", bad_option.details);
    }

    #[test]
    fn an_address_spends_its_burst_of_wrong_tokens_then_one_a_second() {
        let admission = Admission::new(&GatewayLimits::default());
        let (source, other): (IpAddr, IpAddr) = ("192.0.2.7".parse().expect("ip"), "192.0.2.8".parse().expect("ip"));
        let start = Instant::now();
        for _ in 0..20 {
            assert_eq!(admission.throttled(source, start), None);
            admission.failed(source, start);
        }
        let wait = admission.throttled(source, start).expect("the burst is spent");
        assert!((wait.as_secs_f64() - 1.0).abs() < 0.01, "{wait:?}");
        assert_eq!(admission.throttled(other, start), None, "another address is not held back");
        let later = start + Duration::from_millis(1500);
        assert_eq!(admission.throttled(source, later), None, "one more after a second");
        admission.failed(source, later);
        assert!(admission.throttled(source, later).is_some());
        assert_eq!(admission.throttled(source, later + Duration::from_secs(30)), None);
    }
}
