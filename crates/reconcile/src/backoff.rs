//! Doubling backoff: the one formula behind every retry schedule of the operator (failed reconciles of Proxies and
//! pools, quota refusals, the ended-lease journal's writes).

use std::time::Duration;

/// Waits that start at `first` and double with each consecutive failure, up to `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// The wait after the first failure.
    pub first: Duration,
    /// The longest wait.
    pub max: Duration,
}

impl Backoff {
    /// A backoff from `first` doubling to `max`.
    pub const fn new(first: Duration, max: Duration) -> Self {
        Self { first, max }
    }

    /// The wait after `failures` consecutive failures: none after none, `first` after one, twice as long after each
    /// further one, never more than `max`.
    pub fn after(&self, failures: u32) -> Duration {
        if failures == 0 {
            return Duration::ZERO;
        }
        let factor = 1_u32.checked_shl(failures - 1).unwrap_or(u32::MAX);
        self.first.saturating_mul(factor).min(self.max)
    }
}

/// Failed reconciles of one object (a Proxy or a pool): 1 s doubling to 5 minutes, reset on success.
pub const RECONCILE_ERRORS: Backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(300));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_from_the_first_to_the_cap() {
        let backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(300));
        let waits: Vec<u64> =
            [0, 1, 2, 3, 8, 9, 10, 40, u32::MAX].iter().map(|n| backoff.after(*n).as_secs()).collect();
        assert_eq!(waits, [0, 1, 2, 4, 128, 256, 300, 300, 300]);
    }
}
