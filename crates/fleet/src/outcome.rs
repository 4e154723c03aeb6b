//! What a crawler reports about a request it sent through a leased proxy: one type for the lease store, the
//! discovery client and the gateway (which reports for its sessions).

use std::time::Duration;

/// What a crawler reports about a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The target served the request: the ban streak for (proxy, target) resets.
    Ok,
    /// The target blocked the proxy: (proxy, target) cools down, for longer with each ban in a row. A ban while
    /// that cooldown runs changes it only when it comes from an owner whose ban has not counted in it yet.
    Banned,
    /// The target asked to slow down (429 or the like): (proxy, target) cools down briefly, for the site's own
    /// `Retry-After` when given, without touching the ban streak.
    Throttled {
        /// The site's `Retry-After`.
        retry_after: Option<Duration>,
    },
    /// The request failed for another reason (counted, no cooldown).
    Failed,
}
