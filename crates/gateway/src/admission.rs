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

use egress_fleet::sources::{Refused, SourceCounts, SourceSlot};

use crate::GatewayLimits;

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

/// What is left of a budget that had `left` at `at`, by `now`.
fn refilled(left: f64, at: Instant, now: Instant) -> f64 {
    (left + now.saturating_duration_since(at).as_secs_f64() * FAILED_AUTH_PER_SECOND).min(FAILED_AUTH_BURST)
}

#[cfg(test)]
mod tests {
    use super::*;

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
