//! The pool's status: counts, spread, provisioning times, failed members and conditions.

use std::sync::Arc;
use std::time::SystemTime;

use egress_api::pool::{CONDITION_AVAILABLE, CONDITION_PROGRESSING};
use egress_api::proxy::CONDITION_READY;
use egress_api::{Proxy, ProxyPhase, ProxyPool, ProxyPoolStatus, ScalingDecision, SpreadStatus};
use kube::ResourceExt;

use super::super::decide::{Member, PoolDecision, PoolFacts};
use super::super::metrics::PoolCounts;
use super::slots::SlotSpec;
use crate::status::{ConditionSpec, merge_conditions, system_time};

/// Per spread entry, the median time its Ready members took from creation to Ready, in seconds.
pub(super) fn provisioning_seconds(owned: &[Arc<Proxy>], slots: &[SlotSpec]) -> Vec<Option<i32>> {
    slots
        .iter()
        .map(|slot| {
            let mut took: Vec<u64> = owned
                .iter()
                .filter(|proxy| slot.holds(&proxy.spec) && proxy.metadata.deletion_timestamp.is_none())
                .filter_map(|proxy| {
                    let created = system_time(proxy.metadata.creation_timestamp.as_ref()?);
                    let ready = proxy
                        .status
                        .as_ref()?
                        .conditions
                        .iter()
                        .find(|condition| condition.type_ == CONDITION_READY && condition.status == "True")?;
                    system_time(&ready.last_transition_time).duration_since(created).ok().map(|took| took.as_secs())
                })
                .collect();
            took.sort_unstable();
            took.get(took.len() / 2).map(|median| i32::try_from((*median).max(1)).unwrap_or(i32::MAX))
        })
        .collect()
}

/// The members whose Proxy failed for good (phase `Failed`), by name, with the failure's reason and message.
pub(super) fn failed_members(owned: &[Arc<Proxy>]) -> Vec<(String, String)> {
    let mut failed: Vec<(String, String)> = owned
        .iter()
        .filter(|proxy| proxy.metadata.deletion_timestamp.is_none())
        .filter_map(|proxy| {
            let status = proxy.status.as_ref()?;
            if status.phase != Some(ProxyPhase::Failed) {
                return None;
            }
            let why = status.failure.as_ref().map_or_else(
                || "no reason recorded".to_owned(),
                |failure| format!("{}: {}", failure.reason, failure.message),
            );
            Some((proxy.name_any(), why))
        })
        .collect();
    failed.sort();
    failed
}

#[allow(clippy::too_many_arguments)]
pub(super) fn pool_status(
    pool: &ProxyPool,
    status: &ProxyPoolStatus,
    decision: &PoolDecision,
    members: &[Member],
    counts: PoolCounts,
    facts: &PoolFacts,
    last_scale: Option<ScalingDecision>,
    provisioning: &[Option<i32>],
    failed: &[(String, String)],
    now: SystemTime,
) -> ProxyPoolStatus {
    let spread = pool
        .spec
        .slots()
        .iter()
        .enumerate()
        .map(|(index, entry)| {
            let on = members.iter().filter(|member| !member.deleting && member.slot == Some(index));
            // A measurement from members that have gone (a pool scaled to zero) stays until a new one replaces it.
            let kept = status
                .spread
                .iter()
                .find(|before| before.provider == entry.provider && before.zone == entry.zone)
                .and_then(|before| before.provisioning_seconds);
            SpreadStatus {
                provider: entry.provider.clone(),
                zone: entry.zone.clone(),
                desired: decision.desired_per_slot.get(index).copied().unwrap_or(0) as i32,
                current: on.clone().count() as i32,
                ready: on.filter(|member| member.ready).count() as i32,
                provisioning_seconds: provisioning.get(index).copied().flatten().or(kept),
            }
        })
        .collect();
    let floor = facts.min_available.min(decision.target).max(decision.target.min(1));
    let (available, available_reason, available_message) = if decision.target == 0 && counts.current == 0 {
        ("True", "ScaledToZero", "the pool has no members; a lease wakes it when it autoscales".to_owned())
    } else if counts.ready >= floor {
        ("True", "MinimumReplicasReady", format!("{} of {} members Ready", counts.ready, decision.target))
    } else {
        (
            "False",
            "BelowMinimum",
            format!("{} of {} members Ready, fewer than the {floor} the pool needs", counts.ready, decision.target),
        )
    };
    let (progressing, progressing_reason, progressing_message) = if let Some((name, why)) = failed.first() {
        // A member that failed for good never comes up by waiting: say which, and why, until it is fixed.
        let more = match failed.len() {
            1 => String::new(),
            count => format!(" ({} more failed members)", count - 1),
        };
        ("False", "MemberFailed", format!("member {name} failed ({why}){more}"))
    } else if !decision.progressing {
        ("False", "Settled", format!("{} members on the current template", counts.updated))
    } else if counts.current < decision.target || !decision.create.is_empty() {
        ("True", "ScalingUp", format!("{} of {} members exist", counts.current, decision.target))
    } else if counts.current > decision.target || !decision.delete.is_empty() {
        ("True", "ScalingDown", format!("{} members for a count of {}", counts.current, decision.target))
    } else if counts.updated < counts.current {
        ("True", "Rolling", format!("{} of {} members on the current template", counts.updated, counts.current))
    } else {
        ("True", "MembersComingUp", format!("{} of {} members Ready", counts.ready, counts.current))
    };
    let conditions = merge_conditions(
        &status.conditions,
        &[
            ConditionSpec {
                type_: CONDITION_AVAILABLE,
                status: available,
                reason: available_reason.into(),
                message: available_message,
            },
            ConditionSpec {
                type_: CONDITION_PROGRESSING,
                status: progressing,
                reason: progressing_reason.into(),
                message: progressing_message,
            },
        ],
        pool.metadata.generation,
        now,
    );
    ProxyPoolStatus {
        observed_generation: pool.metadata.generation,
        replicas: counts.current as i32,
        ready_replicas: counts.ready as i32,
        leased_replicas: counts.leased as i32,
        updated_replicas: counts.updated as i32,
        selector: ProxyPool::selector(&pool.name_any()),
        spread,
        last_scale,
        conditions,
    }
}
