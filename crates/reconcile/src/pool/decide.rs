//! The pure heart of the pool controller: from a pool's members, its spread, its bounds, the demand for its leases
//! and the clock to the scaling decision and the members to create, delete, roll and recycle.
//!
//! Nothing here touches a client or a clock; every input is in [`PoolFacts`], so every rule is a table test. The
//! controller observes, calls [`decide_pool`], performs the actions, and writes the status only when it changed.
//!
//! The rules, in the order they apply:
//! 1. **Autoscaling** (when configured) may move `spec.replicas`: bounds first, then a wake from zero, then more
//!    members for refused leases or a leased share above the target (at most `scaleUpStep`, and not again while the
//!    last ones are still coming up inside the stabilisation window), then down to `min` after `idleSeconds`
//!    without a lease, then down by at most `scaleDownStep` for a lower leased share once the window has passed.
//! 2. **Spread**: the count is divided over the spread entries by weight (largest remainder, ties to the earlier
//!    entry), so each entry's share follows the count.
//! 3. **Scale**: an entry above its share loses members, unready first, then unleased, then the oldest; an entry
//!    below it gains members, named by the lowest free ordinals.
//! 4. **Misplaced members** (on a provider or zone no entry asks for any more) are replaced make-before-break: at
//!    most `maxSurge` members above the count while they are, and a Ready one goes only once the Ready members
//!    without it still reach the count and the floor. An unready one goes at once: it serves nothing.
//! 5. **Rolling** a template change that needs a new instance updates members in place, so each gets its new
//!    instance through the Proxy's make-before-break replacement and its leases are drained; at most `maxSurge`
//!    members replace at once, and none starts while fewer than `minAvailable` members are Ready (the floor is
//!    capped at the count: a pool scaled below `minAvailable` recycles while all its members are Ready).
//! 6. **Recycling** by age goes through the same replacement path with the same budget and floor.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

/// How soon to look again while members are coming up, going or replacing.
pub const PROGRESS_REQUEUE: Duration = Duration::from_secs(5);
/// How often an autoscaled pool is looked at again, to follow its demand.
pub const AUTOSCALE_REQUEUE: Duration = Duration::from_secs(5);
/// How often a settled pool is looked at again.
pub const SETTLED_REQUEUE: Duration = Duration::from_secs(300);

/// One spread entry, as the decision sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Its weight (at least 1).
    pub weight: u32,
}

/// One member Proxy, as the decision sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// The Proxy's name.
    pub name: String,
    /// The ordinal in its name (`<pool>-<ordinal>`), when it has one.
    pub ordinal: Option<u32>,
    /// The spread entry its provider and zone match; `None` when no entry asks for them any more.
    pub slot: Option<usize>,
    /// Whether its instance-shaping spec is what the template asks for on its slot (a change that needs no new
    /// instance is applied at once and does not count).
    pub current: bool,
    /// Whether its Ready condition is True.
    pub ready: bool,
    /// Whether it is getting a new instance: its status records an instance of another spec hash than the one it
    /// wants, or a previous instance it is draining.
    pub replacing: bool,
    /// Its active leases.
    pub leases: u32,
    /// When its current instance was made (the member's creation when it has none yet).
    pub born: SystemTime,
    /// `recycle.maxAge` shortened by this member's jitter; `None` when the pool does not recycle by age.
    pub max_age: Option<Duration>,
    /// Whether it is being deleted.
    pub deleting: bool,
}

/// Scaling by demand, with every default resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AutoscaleFacts {
    /// The fewest members.
    pub min: u32,
    /// The most members.
    pub max: u32,
    /// The leased share of Ready members, in percent, above which members are added.
    pub target_leased_percent: u32,
    /// How long the pool may have no lease before it goes down to `min`.
    pub idle: Duration,
    /// The most members one decision adds.
    pub scale_up_step: u32,
    /// The most members one decision removes for a lower leased share.
    pub scale_down_step: u32,
    /// How long after a decision the autoscaler waits before scaling down for a lower leased share, and before
    /// adding members again while earlier ones are still coming up.
    pub stabilization: Duration,
}

/// What the discovery API saw of the demand for this pool's leases.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Demand {
    /// When a lease for the pool was last refused because every member was at its lease cap.
    pub at_capacity: Option<SystemTime>,
    /// When a lease for the pool was last refused because no member was healthy (while it had members).
    pub none_healthy: Option<SystemTime>,
    /// When a lease for the pool was last asked for while it had no members.
    pub woken: Option<SystemTime>,
    /// Since when the pool has held no lease; `None` while it holds one.
    pub idle_since: Option<SystemTime>,
}

/// Everything [`decide_pool`] needs.
#[derive(Clone, Debug)]
pub struct PoolFacts {
    /// `spec.replicas`.
    pub replicas: u32,
    /// The spread entries.
    pub slots: Vec<Slot>,
    /// Every member Proxy that exists, those being deleted included.
    pub members: Vec<Member>,
    /// `recycle.maxSurge` (at least 1).
    pub max_surge: u32,
    /// `recycle.minAvailable` (0 when unset).
    pub min_available: u32,
    /// Scaling by demand, when configured.
    pub autoscale: Option<AutoscaleFacts>,
    /// The demand signals.
    pub demand: Demand,
    /// When `spec.replicas` last changed by a recorded decision.
    pub last_scale: Option<SystemTime>,
    /// The current time.
    pub now: SystemTime,
}

/// Why the autoscaler moved `spec.replicas`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleReason {
    /// `spec.replicas` was outside `min` and `max`.
    Bounds,
    /// A lease was asked for while the pool had no members.
    Wake,
    /// Leases were refused because every member was at its cap.
    AtCapacity,
    /// Leases were refused because no member was healthy.
    NoneHealthy,
    /// More than the target share of Ready members held leases.
    LeasedShare,
    /// No lease for `idleSeconds`.
    Idle,
    /// The leased share stayed low for the stabilisation window.
    LowerLeasedShare,
}

impl ScaleReason {
    /// Every reason.
    pub const ALL: [ScaleReason; 7] = [
        Self::Bounds,
        Self::Wake,
        Self::AtCapacity,
        Self::NoneHealthy,
        Self::LeasedShare,
        Self::Idle,
        Self::LowerLeasedShare,
    ];

    /// The stable name, used as the Event reason suffix, the status reason and the metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Bounds => "Bounds",
            Self::Wake => "Wake",
            Self::AtCapacity => "AtCapacity",
            Self::NoneHealthy => "NoneHealthy",
            Self::LeasedShare => "LeasedShare",
            Self::Idle => "Idle",
            Self::LowerLeasedShare => "LowerLeasedShare",
        }
    }
}

/// A change of `spec.replicas`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scale {
    /// The count before.
    pub from: u32,
    /// The count after.
    pub to: u32,
    /// Why.
    pub reason: ScaleReason,
    /// What led to it, for a human.
    pub message: String,
}

/// A member to create.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NewMember {
    /// Its ordinal: the name is `<pool>-<ordinal>`.
    pub ordinal: u32,
    /// The spread entry it goes on.
    pub slot: usize,
}

/// What to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolDecision {
    /// The new `spec.replicas`, when the autoscaler moves it.
    pub scale: Option<Scale>,
    /// The count everything below works towards.
    pub target: u32,
    /// Each spread entry's share of `target`.
    pub desired_per_slot: Vec<u32>,
    /// Members to create.
    pub create: Vec<NewMember>,
    /// Members to delete, by name.
    pub delete: Vec<String>,
    /// Members to bring to the template in place (each then gets a new instance), by name.
    pub roll: Vec<String>,
    /// Members to give a new instance for their age, by name.
    pub recycle: Vec<String>,
    /// Whether members are coming up, going or replacing (the `Progressing` condition).
    pub progressing: bool,
    /// When to look again, absent a change.
    pub requeue: Duration,
}

/// Divides `total` over `weights` in proportion (largest remainder; ties go to the earlier entry).
pub fn apportion(total: u32, weights: &[u32]) -> Vec<u32> {
    let sum: u64 = weights.iter().map(|weight| u64::from(*weight)).sum();
    if sum == 0 {
        return vec![0; weights.len()];
    }
    let quotas: Vec<(u64, u64)> = weights
        .iter()
        .map(|weight| {
            let share = u64::from(total) * u64::from(*weight);
            (share / sum, share % sum)
        })
        .collect();
    let mut shares: Vec<u32> = quotas.iter().map(|(base, _)| u32::try_from(*base).unwrap_or(u32::MAX)).collect();
    let given: u32 = shares.iter().sum();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|a, b| quotas[*b].1.cmp(&quotas[*a].1).then(a.cmp(b)));
    for index in order.into_iter().take(total.saturating_sub(given) as usize) {
        shares[index] += 1;
    }
    shares
}

fn since(now: SystemTime, then: SystemTime) -> Duration {
    now.duration_since(then).unwrap_or(Duration::ZERO)
}

/// Whether `signal` came after the last scaling decision (a refusal the last decision already answered counts no
/// more).
///
/// The status records a decision to the microsecond (`lastScale.time`), so a signal is compared at that precision:
/// compared to the nanosecond, a refusal just before a decision could look newer than the decision as recorded, and
/// the pool would scale for it again on every pass.
fn fresh(signal: Option<SystemTime>, last_scale: Option<SystemTime>) -> bool {
    let micros = |time: SystemTime| time.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |since| since.as_micros());
    match (signal, last_scale) {
        (Some(signal), Some(last)) => micros(signal) > micros(last),
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// The autoscaler's decision, if it moves `spec.replicas`.
fn autoscale(facts: &PoolFacts, live: &[&Member]) -> Option<Scale> {
    let bounds = facts.autoscale.as_ref()?;
    let current = facts.replicas;
    let scale = |to: u32, reason: ScaleReason, message: String| {
        (to != current).then_some(Scale { from: current, to, reason, message })
    };
    if current < bounds.min {
        return scale(bounds.min, ScaleReason::Bounds, format!("below autoscale.min {}", bounds.min));
    }
    if current > bounds.max {
        return scale(bounds.max, ScaleReason::Bounds, format!("above autoscale.max {}", bounds.max));
    }
    if current == 0 {
        return fresh(facts.demand.woken, facts.last_scale)
            .then(|| {
                scale(
                    bounds.max.min(bounds.min.max(1)),
                    ScaleReason::Wake,
                    "a lease was asked for while the pool had no members".into(),
                )
            })
            .flatten();
    }
    let ready = live.iter().filter(|member| member.ready).count() as u32;
    let leased = live.iter().filter(|member| member.leases > 0).count() as u32;
    let coming_up = current.saturating_sub(ready);
    let stabilized = facts.last_scale.is_none_or(|last| since(facts.now, last) >= bounds.stabilization);
    let up_to = |want: u32| want.min(current.saturating_add(bounds.scale_up_step)).min(bounds.max);
    // Members the leased share asks for: the leased ones must be at most the target share of the Ready ones.
    let for_share = (leased * 100).div_ceil(bounds.target_leased_percent.max(1));
    let may_add = coming_up == 0 || stabilized;
    if may_add && current < bounds.max {
        if fresh(facts.demand.at_capacity, facts.last_scale) {
            let to = up_to(for_share.max(current + 1));
            return scale(to, ScaleReason::AtCapacity, "leases were refused: every member was at its lease cap".into());
        }
        if fresh(facts.demand.none_healthy, facts.last_scale) {
            let to = up_to(current + 1);
            return scale(to, ScaleReason::NoneHealthy, "leases were refused: no member was healthy".into());
        }
        if leased * 100 > bounds.target_leased_percent * ready && for_share > current {
            return scale(
                up_to(for_share),
                ScaleReason::LeasedShare,
                format!(
                    "{leased} of {ready} Ready members hold leases, above the target of {}%",
                    bounds.target_leased_percent
                ),
            );
        }
    }
    // Idleness counts from the last decision at the earliest: a pool just woken (or grown) has not had the chance to
    // be leased yet, and going straight back down would flap.
    let idle_since = match (facts.demand.idle_since, facts.last_scale) {
        (Some(idle), Some(last)) => Some(idle.max(last)),
        (idle, _) => idle,
    };
    if let Some(idle_since) = idle_since
        && current > bounds.min
        && since(facts.now, idle_since) >= bounds.idle
    {
        return scale(
            bounds.min,
            ScaleReason::Idle,
            format!(
                "no lease for {} s (idleSeconds {})",
                since(facts.now, idle_since).as_secs(),
                bounds.idle.as_secs()
            ),
        );
    }
    if leased > 0 && stabilized && for_share < current {
        let to = for_share.max(bounds.min).max(current.saturating_sub(bounds.scale_down_step));
        return scale(
            to,
            ScaleReason::LowerLeasedShare,
            format!(
                "{leased} of {ready} Ready members hold leases, below the target of {}% for the stabilisation window",
                bounds.target_leased_percent
            ),
        );
    }
    None
}

/// Removal order: unready first, then fewer leases, then the oldest instance, then the lowest ordinal.
fn removal_order(a: &&Member, b: &&Member) -> std::cmp::Ordering {
    a.ready
        .cmp(&b.ready)
        .then(a.leases.cmp(&b.leases))
        .then(a.born.cmp(&b.born))
        .then(a.ordinal.cmp(&b.ordinal))
        .then(a.name.cmp(&b.name))
}

/// Decides what the pool controller does next.
pub fn decide_pool(facts: &PoolFacts) -> PoolDecision {
    let live: Vec<&Member> = facts.members.iter().filter(|member| !member.deleting).collect();
    let scale = autoscale(facts, &live);
    let target = scale.as_ref().map_or(facts.replicas, |scale| scale.to);
    let weights: Vec<u32> = facts.slots.iter().map(|slot| slot.weight.max(1)).collect();
    let desired_per_slot = apportion(target, &weights);

    let mut delete: Vec<String> = Vec::new();
    let mut create: Vec<NewMember> = Vec::new();
    // Unready misplaced members serve nothing: they go at once.
    let (misplaced_ready, misplaced_unready): (Vec<&Member>, Vec<&Member>) =
        live.iter().copied().filter(|member| member.slot.is_none()).partition(|member| member.ready);
    delete.extend(misplaced_unready.iter().map(|member| member.name.clone()));

    // Each entry keeps its share: a surplus goes (unready, unleased, oldest first), a deficit is counted for creation.
    let mut deficits: Vec<u32> = Vec::with_capacity(facts.slots.len());
    let mut kept: Vec<&Member> = misplaced_ready.clone();
    for (slot, desired) in desired_per_slot.iter().enumerate() {
        let mut members: Vec<&Member> = live.iter().copied().filter(|member| member.slot == Some(slot)).collect();
        members.sort_by(removal_order);
        let surplus = (members.len() as u32).saturating_sub(*desired) as usize;
        delete.extend(members[..surplus].iter().map(|member| member.name.clone()));
        kept.extend_from_slice(&members[surplus..]);
        deficits.push(desired.saturating_sub(members.len() as u32));
    }

    // New members: all of a plain scale-up; while misplaced Ready members still serve, only up to maxSurge above
    // the count.
    let needed: u32 = deficits.iter().sum();
    let allowed = if misplaced_ready.is_empty() {
        needed
    } else {
        needed.min((target + facts.max_surge).saturating_sub(kept.len() as u32))
    };
    let taken: BTreeSet<u32> = facts.members.iter().filter_map(|member| member.ordinal).collect();
    let mut free = (0..).filter(|ordinal| !taken.contains(ordinal));
    let mut remaining = allowed;
    // Round-robin over the entries' deficits, so a surge-limited replacement fills every entry evenly.
    let mut deficits_left = deficits.clone();
    while remaining > 0 && deficits_left.iter().any(|deficit| *deficit > 0) {
        for (slot, deficit) in deficits_left.iter_mut().enumerate() {
            if remaining == 0 {
                break;
            }
            if *deficit > 0 {
                *deficit -= 1;
                remaining -= 1;
                create.push(NewMember { ordinal: free.next().unwrap_or(u32::MAX), slot });
            }
        }
    }

    // Misplaced Ready members go once the other Ready members reach the count and the floor.
    let ready_kept = kept.iter().filter(|member| member.ready).count() as u32;
    // The recycling floor never exceeds the count: a pool scaled below minAvailable still recycles.
    let min_available = facts.min_available.min(target);
    let floor = target.max(min_available);
    let mut removable = ready_kept.saturating_sub(floor);
    let mut misplaced = misplaced_ready.clone();
    misplaced.sort_by(removal_order);
    for member in misplaced {
        if removable == 0 {
            break;
        }
        removable -= 1;
        delete.push(member.name.clone());
    }

    // Rolling and recycling share one budget: at most maxSurge members replacing at once, none starting below the
    // floor of Ready members.
    let staying: Vec<&Member> = kept.iter().copied().filter(|member| !delete.contains(&member.name)).collect();
    let in_flight = staying.iter().filter(|member| member.replacing).count() as u32;
    let mut budget = facts.max_surge.saturating_sub(in_flight);
    let ready_staying = staying.iter().filter(|member| member.ready).count() as u32;
    let above_floor = ready_staying >= min_available;
    let mut roll = Vec::new();
    let mut outdated: Vec<&Member> = staying
        .iter()
        .copied()
        .filter(|member| member.slot.is_some() && !member.current && !member.replacing)
        .collect();
    outdated.sort_by(removal_order);
    for member in &outdated {
        // An unready member has no capacity to lose: it rolls even below the floor.
        if budget == 0 || (member.ready && !above_floor) {
            continue;
        }
        budget -= 1;
        roll.push(member.name.clone());
    }
    let mut recycle = Vec::new();
    let mut aged: Vec<&Member> = staying
        .iter()
        .copied()
        .filter(|member| member.current && !member.replacing && member.ready)
        .filter(|member| member.max_age.is_some_and(|age| since(facts.now, member.born) >= age))
        .collect();
    aged.sort_by_key(|member| member.born);
    for member in aged {
        if budget == 0 || !above_floor {
            break;
        }
        budget -= 1;
        recycle.push(member.name.clone());
    }

    let coming_up = live.iter().any(|member| !member.ready) || (live.len() as u32) < target;
    let progressing = !create.is_empty()
        || !delete.is_empty()
        || !roll.is_empty()
        || !recycle.is_empty()
        || in_flight > 0
        || !outdated.is_empty()
        || facts.members.iter().any(|member| member.deleting)
        || coming_up;
    let next_recycle = staying
        .iter()
        .filter_map(|member| member.max_age.map(|age| (member.born + age).duration_since(facts.now).ok()))
        .map(|left| left.unwrap_or(Duration::ZERO).max(Duration::from_secs(1)))
        .min();
    let mut requeue = if progressing { PROGRESS_REQUEUE } else { SETTLED_REQUEUE };
    if facts.autoscale.is_some() {
        requeue = requeue.min(AUTOSCALE_REQUEUE);
    }
    if let Some(next) = next_recycle {
        requeue = requeue.min(next);
    }
    PoolDecision { scale, target, desired_per_slot, create, delete, roll, recycle, progressing, requeue }
}

#[cfg(test)]
mod tests;
