//! The pool controller: keeps each `ProxyPool`'s member Proxies at its count, on its spread, on its template and
//! under its age limit, and moves the count with demand when the pool autoscales.
//!
//! [`decide`] is the pure decision, table-tested without any server; [`controller`] observes the members through
//! the operator's one Proxy store (an [`index`] of members per pool keeps that O(1) per change), performs the
//! decision and writes the pool's status; [`metrics`] are its gauges and counters.

pub mod controller;
pub mod decide;
pub mod index;
pub mod metrics;

pub use controller::{NoSignals, POOL_FIELD_MANAGER, PoolContext, PoolSignals, PoolTrigger, run_pools};
pub use egress_fleet::PoolDemand;
pub use metrics::PoolMetrics;

use std::time::Duration;

use egress_api::ProxyPool;

/// How long a new member is taken to need before it is Ready when no member of the pool was ever measured.
pub const DEFAULT_PROVISIONING: Duration = Duration::from_secs(30);

/// How long the pool's next member will likely take to become Ready: the recent provisioning time of the spread
/// entry that gets a pool's first member (the largest weight), else the slowest entry measured, else
/// [`DEFAULT_PROVISIONING`].
pub fn provisioning_estimate(pool: &ProxyPool) -> Duration {
    let slots = pool.spec.slots();
    let weights: Vec<u32> = slots.iter().map(|slot| slot.weight.max(1).unsigned_abs()).collect();
    let first = decide::apportion(1, &weights).iter().position(|share| *share > 0);
    let spread = pool.status.as_ref().map(|status| status.spread.as_slice()).unwrap_or_default();
    let measured = |index: usize| {
        let slot = slots.get(index)?;
        spread
            .iter()
            .find(|entry| entry.provider == slot.provider && entry.zone == slot.zone)
            .and_then(|entry| entry.provisioning_seconds)
    };
    let seconds = first
        .and_then(measured)
        .or_else(|| spread.iter().filter_map(|entry| entry.provisioning_seconds).max())
        .map(|seconds| Duration::from_secs(seconds.max(1).unsigned_abs().into()));
    seconds.unwrap_or(DEFAULT_PROVISIONING)
}

#[cfg(test)]
mod tests {
    use super::*;
    use egress_api::{ProxyPoolSpec, ProxyPoolStatus, ProxyTemplate, SpreadEntry, SpreadStatus};

    fn entry(provider: &str, weight: i32) -> SpreadEntry {
        SpreadEntry { provider: provider.into(), zone: None, weight }
    }

    fn measured(provider: &str, seconds: Option<i32>) -> SpreadStatus {
        SpreadStatus {
            provider: provider.into(),
            zone: None,
            desired: 0,
            current: 0,
            ready: 0,
            provisioning_seconds: seconds,
        }
    }

    #[test]
    fn the_estimate_is_the_first_members_provider_then_the_slowest_then_the_default() {
        let spec = ProxyPoolSpec {
            spread: vec![entry("kvm", 1), entry("gcp", 2)],
            ..ProxyPoolSpec::new(0, ProxyTemplate::default())
        };
        let with = |spread: Vec<SpreadStatus>| {
            let mut pool = ProxyPool::new("eu", spec.clone());
            pool.status = Some(ProxyPoolStatus { spread, ..ProxyPoolStatus::default() });
            provisioning_estimate(&pool)
        };
        // gcp has the larger weight, so it gets the first member.
        assert_eq!(with(vec![measured("kvm", Some(300)), measured("gcp", Some(40))]), Duration::from_secs(40));
        assert_eq!(with(vec![measured("kvm", Some(300)), measured("gcp", None)]), Duration::from_secs(300));
        assert_eq!(with(vec![]), DEFAULT_PROVISIONING);
    }
}
