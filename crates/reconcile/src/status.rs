//! Building a Proxy's status: conditions that keep their transition time, and time conversions.

use std::time::SystemTime;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, MicroTime, Time};
use k8s_openapi::jiff::Timestamp;

/// A Kubernetes timestamp for `time`, at whole-second precision (what the API stores), so that a status written
/// and read back compares equal.
pub fn time(time: SystemTime) -> Time {
    let timestamp = Timestamp::try_from(time).unwrap_or(Timestamp::UNIX_EPOCH);
    Time(Timestamp::from_second(timestamp.as_second()).unwrap_or(timestamp))
}

/// A Kubernetes timestamp for `time` at microsecond precision (what the API stores for a `MicroTime`), so that a
/// status written and read back compares equal.
pub fn micro_time(time: SystemTime) -> MicroTime {
    let timestamp = Timestamp::try_from(time).unwrap_or(Timestamp::UNIX_EPOCH);
    let micros = timestamp.as_microsecond();
    MicroTime(Timestamp::from_microsecond(micros).unwrap_or(timestamp))
}

/// The wall-clock time a Kubernetes microsecond timestamp stands for.
pub fn system_micro_time(time: &MicroTime) -> SystemTime {
    SystemTime::from(time.0)
}

/// The wall-clock time a Kubernetes timestamp stands for.
pub fn system_time(time: &Time) -> SystemTime {
    SystemTime::from(time.0)
}

/// One condition as decided, before merging with the previous ones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConditionSpec {
    /// `Ready`, `Provisioned` or `Healthy`.
    pub type_: &'static str,
    /// `True`, `False` or `Unknown`.
    pub status: &'static str,
    /// CamelCase reason.
    pub reason: String,
    /// For a human.
    pub message: String,
}

/// Builds the condition list, keeping each condition's `lastTransitionTime` unless its status flipped.
pub fn merge_conditions(
    previous: &[Condition],
    desired: &[ConditionSpec],
    generation: Option<i64>,
    now: SystemTime,
) -> Vec<Condition> {
    desired
        .iter()
        .map(|spec| {
            let before = previous.iter().find(|condition| condition.type_ == spec.type_);
            let last_transition_time = match before {
                Some(before) if before.status == spec.status => before.last_transition_time.clone(),
                _ => time(now),
            };
            Condition {
                type_: spec.type_.to_owned(),
                status: spec.status.to_owned(),
                reason: spec.reason.clone(),
                message: spec.message.clone(),
                observed_generation: generation,
                last_transition_time,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn spec(status: &'static str, reason: &str) -> ConditionSpec {
        ConditionSpec { type_: "Ready", status, reason: reason.into(), message: String::new() }
    }

    #[test]
    fn transition_time_changes_only_when_the_status_flips() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let t1 = t0 + Duration::from_secs(60);
        let first = merge_conditions(&[], &[spec("False", "Provisioning")], Some(1), t0);
        let same_status = merge_conditions(&first, &[spec("False", "QuotaExceeded")], Some(1), t1);
        assert_eq!(same_status[0].last_transition_time, time(t0));
        assert_eq!(same_status[0].reason, "QuotaExceeded");
        let flipped = merge_conditions(&same_status, &[spec("True", "Ready")], Some(2), t1);
        assert_eq!(flipped[0].last_transition_time, time(t1));
        assert_eq!(flipped[0].observed_generation, Some(2));
    }

    #[test]
    fn times_round_to_seconds() {
        let precise = SystemTime::UNIX_EPOCH + Duration::from_millis(1_500);
        assert_eq!(system_time(&time(precise)), SystemTime::UNIX_EPOCH + Duration::from_secs(1));
    }
}
