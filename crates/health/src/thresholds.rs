//! Hysteresis: consecutive successes make a proxy healthy, consecutive failures make it unhealthy, and a single
//! result against the trend never flips the verdict.

/// The verdict a target currently has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not enough results yet.
    Unknown,
    /// `healthyThreshold` consecutive successes since the last failure streak.
    Healthy,
    /// `unhealthyThreshold` consecutive failures since the last success streak.
    Unhealthy,
}

/// The counters of one target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counters {
    verdict: Verdict,
    successes: u32,
    failures: u32,
}

impl Default for Counters {
    fn default() -> Self {
        Self { verdict: Verdict::Unknown, successes: 0, failures: 0 }
    }
}

impl Counters {
    /// Counters that start from a verdict known from elsewhere (a status written before a restart): the next
    /// `unhealthyThreshold` failures overturn a healthy seed, as they would a verdict the probes had formed.
    pub fn seeded(healthy: bool) -> Self {
        Self { verdict: if healthy { Verdict::Healthy } else { Verdict::Unhealthy }, successes: 0, failures: 0 }
    }

    /// Records one probe result; returns the new verdict when it changed.
    pub fn record(&mut self, success: bool, healthy_threshold: u32, unhealthy_threshold: u32) -> Option<Verdict> {
        if success {
            self.successes = self.successes.saturating_add(1);
            self.failures = 0;
            if self.verdict != Verdict::Healthy && self.successes >= healthy_threshold.max(1) {
                self.verdict = Verdict::Healthy;
                return Some(Verdict::Healthy);
            }
        } else {
            self.failures = self.failures.saturating_add(1);
            self.successes = 0;
            if self.verdict != Verdict::Unhealthy && self.failures >= unhealthy_threshold.max(1) {
                self.verdict = Verdict::Unhealthy;
                return Some(Verdict::Unhealthy);
            }
        }
        None
    }

    /// The current verdict.
    pub fn verdict(&self) -> Verdict {
        self.verdict
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds a sequence of results (1 = success) and returns the verdict after each.
    fn run(results: &str, healthy: u32, unhealthy: u32) -> Vec<Verdict> {
        let mut counters = Counters::default();
        results
            .chars()
            .map(|result| {
                counters.record(result == '1', healthy, unhealthy);
                counters.verdict()
            })
            .collect()
    }

    #[test]
    fn thresholds_and_hysteresis() {
        use Verdict::{Healthy as H, Unhealthy as X, Unknown as U};
        let cases: [(&str, u32, u32, Vec<Verdict>); 6] = [
            ("11", 2, 3, vec![U, H]),
            ("1101111", 2, 3, vec![U, H, H, H, H, H, H]),
            ("11000", 2, 3, vec![U, H, H, H, X]),
            ("110100", 2, 3, vec![U, H, H, H, H, H]),
            ("0001", 2, 3, vec![U, U, X, X]),
            ("00011", 2, 3, vec![U, U, X, X, H]),
        ];
        for (results, healthy, unhealthy, expected) in cases {
            assert_eq!(run(results, healthy, unhealthy), expected, "{results}");
        }
    }

    #[test]
    fn transitions_are_reported_once() {
        let mut counters = Counters::default();
        assert_eq!(counters.record(true, 1, 1), Some(Verdict::Healthy));
        assert_eq!(counters.record(true, 1, 1), None);
        assert_eq!(counters.record(false, 1, 1), Some(Verdict::Unhealthy));
        assert_eq!(counters.record(false, 1, 1), None);
    }

    #[test]
    fn a_seeded_verdict_is_overturned_by_the_thresholds_only() {
        let mut counters = Counters::seeded(true);
        assert_eq!(counters.record(true, 2, 3), None, "a confirming probe is no transition");
        assert_eq!(counters.record(false, 2, 3), None);
        assert_eq!(counters.record(false, 2, 3), None);
        assert_eq!(counters.record(false, 2, 3), Some(Verdict::Unhealthy));
        let mut counters = Counters::seeded(false);
        assert_eq!(counters.record(true, 2, 3), None);
        assert_eq!(counters.record(true, 2, 3), Some(Verdict::Healthy));
    }
}
