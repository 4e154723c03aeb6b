//! One table per rule of [`decide_pool`]: spread, scale up and down, misplaced members, rolling, recycling, and
//! each autoscaling reason.

use super::*;

const NOW_SECS: u64 = 1_000_000;

/// A table row for the rolling and recycling budget: name, members, maxSurge, minAvailable, the members chosen.
type BudgetCase = (&'static str, Vec<Member>, u32, u32, &'static [&'static str]);

/// A table row for autoscaling: name, facts, the new count and why.
type ScaleCase = (&'static str, PoolFacts, Option<(u32, ScaleReason)>);

fn at(seconds: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(seconds)
}

fn now() -> SystemTime {
    at(NOW_SECS)
}

fn ago(seconds: u64) -> SystemTime {
    at(NOW_SECS - seconds)
}

/// A Ready, current member `ordinal` on `slot`, born `age` seconds ago, with no lease.
fn member(ordinal: u32, slot: usize, age: u64) -> Member {
    Member {
        name: format!("pool-{ordinal}"),
        ordinal: Some(ordinal),
        slot: Some(slot),
        current: true,
        ready: true,
        replacing: false,
        leases: 0,
        born: ago(age),
        max_age: None,
        deleting: false,
    }
}

impl Member {
    fn leased(mut self, leases: u32) -> Self {
        self.leases = leases;
        self
    }
    fn unready(mut self) -> Self {
        self.ready = false;
        self
    }
    fn misplaced(mut self) -> Self {
        self.slot = None;
        self
    }
    fn outdated(mut self) -> Self {
        self.current = false;
        self
    }
    fn replacing(mut self) -> Self {
        self.replacing = true;
        self
    }
    fn deleting(mut self) -> Self {
        self.deleting = true;
        self
    }
    fn max_age(mut self, seconds: u64) -> Self {
        self.max_age = Some(Duration::from_secs(seconds));
        self
    }
}

fn pool(replicas: u32, weights: &[u32], members: Vec<Member>) -> PoolFacts {
    PoolFacts {
        replicas,
        slots: weights.iter().map(|weight| Slot { weight: *weight }).collect(),
        members,
        max_surge: 1,
        min_available: 0,
        autoscale: None,
        demand: Demand::default(),
        last_scale: None,
        now: now(),
    }
}

fn autoscaled(replicas: u32, members: Vec<Member>, min: u32, max: u32) -> PoolFacts {
    PoolFacts {
        autoscale: Some(AutoscaleFacts {
            min,
            max,
            target_leased_percent: 80,
            idle: Duration::from_secs(20),
            scale_up_step: 4,
            scale_down_step: 1,
            stabilization: Duration::from_secs(60),
        }),
        ..pool(replicas, &[1], members)
    }
}

fn created_slots(decision: &PoolDecision) -> Vec<usize> {
    decision.create.iter().map(|new| new.slot).collect()
}

fn created_ordinals(decision: &PoolDecision) -> Vec<u32> {
    decision.create.iter().map(|new| new.ordinal).collect()
}

#[test]
fn apportion_divides_by_weight_with_the_largest_remainder() {
    let cases: [(u32, &[u32], &[u32]); 9] = [
        (6, &[2, 1], &[4, 2]),
        (9, &[2, 1], &[6, 3]),
        (7, &[2, 1], &[5, 2]),
        (1, &[1, 1], &[1, 0]),
        (0, &[1, 1], &[0, 0]),
        (5, &[1], &[5]),
        (4, &[1, 1, 1], &[2, 1, 1]),
        (10, &[3, 3, 4], &[3, 3, 4]),
        (3, &[], &[]),
    ];
    for (total, weights, expected) in cases {
        let shares = apportion(total, weights);
        assert_eq!(shares, expected, "{total} over {weights:?}");
        if !weights.is_empty() {
            assert_eq!(shares.iter().sum::<u32>(), total, "every member is placed");
        }
    }
}

#[test]
fn a_new_pool_is_created_on_its_spread() {
    let decision = decide_pool(&pool(6, &[2, 1], vec![]));
    assert_eq!(decision.desired_per_slot, [4, 2]);
    assert_eq!(created_ordinals(&decision), [0, 1, 2, 3, 4, 5]);
    let mut slots = created_slots(&decision);
    slots.sort_unstable();
    assert_eq!(slots, [0, 0, 0, 0, 1, 1]);
    assert!(decision.delete.is_empty() && decision.roll.is_empty());
    assert!(decision.progressing);
    assert_eq!(decision.requeue, PROGRESS_REQUEUE);
}

#[test]
fn scaling_up_keeps_the_ratio_and_fills_the_lowest_free_ordinals() {
    let members = vec![
        member(0, 0, 100),
        member(1, 0, 100),
        member(2, 0, 100),
        member(3, 0, 100),
        member(4, 1, 100),
        // Ordinal 5 is taken by a member still being deleted: its name cannot be used again yet.
        member(5, 1, 100).deleting(),
        member(6, 1, 100),
    ];
    let decision = decide_pool(&pool(9, &[2, 1], members));
    assert_eq!(decision.desired_per_slot, [6, 3]);
    let mut slots = created_slots(&decision);
    slots.sort_unstable();
    assert_eq!(slots, [0, 0, 1]);
    assert_eq!(created_ordinals(&decision), [7, 8, 9]);
    assert!(decision.delete.is_empty());
}

#[test]
fn scaling_down_removes_unready_then_unleased_then_oldest() {
    let cases: [(&str, Vec<Member>, u32, &[&str]); 4] = [
        (
            "unready first",
            vec![member(0, 0, 300).leased(1), member(1, 0, 200).unready(), member(2, 0, 100)],
            2,
            &["pool-1"],
        ),
        (
            "unleased before leased, whatever the age",
            vec![member(0, 0, 300).leased(2), member(1, 0, 10), member(2, 0, 200).leased(1)],
            2,
            &["pool-1"],
        ),
        (
            "fewer leases, then the oldest",
            vec![member(0, 0, 100).leased(2), member(1, 0, 300).leased(1), member(2, 0, 200).leased(1)],
            1,
            &["pool-1", "pool-2"],
        ),
        ("to zero", vec![member(0, 0, 100), member(1, 0, 100).leased(3)], 0, &["pool-0", "pool-1"]),
    ];
    for (name, members, replicas, expected) in cases {
        let decision = decide_pool(&pool(replicas, &[1], members));
        assert_eq!(decision.delete, expected, "{name}");
        assert!(decision.create.is_empty(), "{name}");
    }
}

#[test]
fn scaling_down_takes_from_the_entry_above_its_share() {
    // 9 → 6 over 2:1: from 6+3 to 4+2, the surplus of each entry, nothing from the other.
    let members: Vec<Member> =
        (0..9).map(|ordinal| member(ordinal, usize::from(ordinal >= 6), 1000 - u64::from(ordinal))).collect();
    let decision = decide_pool(&pool(6, &[2, 1], members));
    assert_eq!(decision.delete, ["pool-0", "pool-1", "pool-6"]);
}

#[test]
fn members_being_deleted_do_not_count() {
    let members = vec![member(0, 0, 100), member(1, 0, 100).deleting()];
    let decision = decide_pool(&pool(2, &[1], members));
    assert_eq!(created_ordinals(&decision), [2]);
    assert!(decision.delete.is_empty(), "a member already going is not deleted again");
}

#[test]
fn misplaced_members_are_replaced_make_before_break_within_the_surge() {
    // The spread moved every member's provider: one new member at a time (maxSurge 1), the old one going only
    // once the new one is Ready.
    let old: Vec<Member> = (0..3).map(|ordinal| member(ordinal, 0, 100).misplaced()).collect();
    let first = decide_pool(&pool(3, &[1], old.clone()));
    assert_eq!(created_ordinals(&first), [3], "one surge member");
    assert!(first.delete.is_empty(), "no old member goes before a new one is Ready");

    let mut coming_up = old.clone();
    coming_up.push(member(3, 0, 5).unready());
    let waiting = decide_pool(&pool(3, &[1], coming_up));
    assert!(waiting.create.is_empty() && waiting.delete.is_empty(), "{waiting:?}");

    let mut up = old.clone();
    up.push(member(3, 0, 5));
    let swap = decide_pool(&pool(3, &[1], up));
    assert_eq!(swap.delete, ["pool-0"], "the new one is Ready: the oldest misplaced one goes");
    assert!(swap.create.is_empty(), "the surge is used until that deletion shows");

    // With maxSurge 2, two at a time; an unready misplaced member goes at once.
    let mut mixed = old;
    mixed[1] = mixed[1].clone().unready();
    let mut facts = pool(3, &[1], mixed);
    facts.max_surge = 2;
    let decision = decide_pool(&facts);
    assert_eq!(decision.delete, ["pool-1"]);
    // Two misplaced members still serve: up to count + maxSurge = 5 members in all.
    assert_eq!(created_ordinals(&decision), [3, 4, 5]);
}

#[test]
fn a_misplaced_member_stays_while_the_floor_needs_it() {
    let mut members: Vec<Member> = (0..2).map(|ordinal| member(ordinal, 0, 100).misplaced()).collect();
    members.push(member(2, 0, 5));
    members.push(member(3, 0, 5).unready());
    let decision = decide_pool(&pool(2, &[1], members));
    // 3 Ready (two misplaced, one new) over a count of 2: one misplaced may go, not both.
    assert_eq!(decision.delete, ["pool-0"]);
}

#[test]
fn a_template_change_rolls_within_the_surge_and_the_floor() {
    let outdated =
        |count: u32| -> Vec<Member> { (0..count).map(|ordinal| member(ordinal, 0, 100).outdated()).collect() };
    let cases: [BudgetCase; 5] = [
        ("one at a time", outdated(4), 1, 0, &["pool-0"]),
        ("maxSurge 2", outdated(4), 2, 0, &["pool-0", "pool-1"]),
        (
            "one already replacing uses the budget",
            vec![member(0, 0, 100).outdated().replacing(), member(1, 0, 100).outdated()],
            1,
            0,
            &[],
        ),
        (
            "below the floor only unready members roll",
            vec![member(0, 0, 100).outdated(), member(1, 0, 100).outdated().unready(), member(2, 0, 100).outdated()],
            2,
            3,
            &["pool-1"],
        ),
        (
            "unleased members first, then the oldest",
            vec![member(0, 0, 300).outdated().leased(1), member(1, 0, 100).outdated(), member(2, 0, 200).outdated()],
            2,
            0,
            &["pool-2", "pool-1"],
        ),
    ];
    for (name, members, surge, floor, expected) in cases {
        let replicas = members.len() as u32;
        let mut facts = pool(replicas, &[1], members);
        facts.max_surge = surge;
        facts.min_available = floor;
        let decision = decide_pool(&facts);
        assert_eq!(decision.roll, expected, "{name}");
        assert!(decision.progressing, "{name}");
    }
}

#[test]
fn recycling_by_age_shares_the_budget_and_keeps_the_floor() {
    let old = |ordinal: u32, age: u64| member(ordinal, 0, age).max_age(1000);
    let cases: [BudgetCase; 6] = [
        ("none old enough", vec![old(0, 999), old(1, 10)], 1, 0, &[]),
        // Scaled below minAvailable: the floor is the count, which all Ready members meet.
        ("a floor above the count is the count", vec![old(0, 1500), old(1, 2000)], 1, 4, &["pool-1"]),
        ("the oldest first", vec![old(0, 1500), old(1, 2000), old(2, 10)], 1, 0, &["pool-1"]),
        ("maxSurge 2", vec![old(0, 1500), old(1, 2000), old(2, 10)], 2, 0, &["pool-1", "pool-0"]),
        ("a replacement in flight uses the budget", vec![old(0, 1500), old(1, 2000).replacing()], 1, 0, &[]),
        ("the floor holds", vec![old(0, 1500), old(1, 2000), old(2, 10).unready()], 1, 3, &[]),
    ];
    for (name, members, surge, floor, expected) in cases {
        let replicas = members.len() as u32;
        let mut facts = pool(replicas, &[1], members);
        facts.max_surge = surge;
        facts.min_available = floor;
        let decision = decide_pool(&facts);
        assert_eq!(decision.recycle, expected, "{name}");
    }
    // A rolling member takes the budget first.
    let mut facts = pool(2, &[1], vec![old(0, 1500), member(1, 0, 10).outdated()]);
    facts.max_surge = 1;
    let decision = decide_pool(&facts);
    assert_eq!(decision.roll, ["pool-1"]);
    assert!(decision.recycle.is_empty());
}

#[test]
fn a_settled_pool_looks_again_when_the_next_member_comes_of_age() {
    let members = vec![member(0, 0, 100).max_age(1000), member(1, 0, 400).max_age(1000)];
    let decision = decide_pool(&pool(2, &[1], members));
    assert!(!decision.progressing);
    assert_eq!(decision.requeue, Duration::from_secs(300), "the settled resync comes first");
    let members = vec![member(0, 0, 990).max_age(1000)];
    assert_eq!(decide_pool(&pool(1, &[1], members)).requeue, Duration::from_secs(10));
    assert_eq!(decide_pool(&pool(1, &[1], vec![member(0, 0, 1)])).requeue, SETTLED_REQUEUE);
}

fn scale_of(facts: &PoolFacts) -> Option<(u32, ScaleReason)> {
    decide_pool(facts).scale.map(|scale| (scale.to, scale.reason))
}

#[test]
fn autoscaling_reasons() {
    let ready = |count: u32, leased: u32| -> Vec<Member> {
        (0..count).map(|ordinal| member(ordinal, 0, 500).leased(u32::from(ordinal < leased))).collect()
    };
    let with = |mut facts: PoolFacts, change: &dyn Fn(&mut PoolFacts)| {
        change(&mut facts);
        facts
    };
    let cases: Vec<ScaleCase> = vec![
        ("steady", autoscaled(4, ready(4, 3), 0, 10), None),
        ("below min", autoscaled(1, ready(1, 0), 2, 10), Some((2, ScaleReason::Bounds))),
        ("above max", autoscaled(12, ready(12, 0), 0, 10), Some((10, ScaleReason::Bounds))),
        ("zero and nobody asked", autoscaled(0, vec![], 0, 10), None),
        (
            "zero and a lease was asked for",
            with(autoscaled(0, vec![], 0, 10), &|facts| facts.demand.woken = Some(ago(1))),
            Some((1, ScaleReason::Wake)),
        ),
        (
            "a wake the last decision already answered",
            with(autoscaled(0, vec![], 0, 10), &|facts| {
                facts.demand.woken = Some(ago(30));
                facts.last_scale = Some(ago(10));
            }),
            None,
        ),
        (
            // The status keeps the decision's time to the microsecond: a refusal 700 ns into that microsecond came
            // before the decision.
            "a wake in the microsecond the last decision was recorded in",
            with(autoscaled(0, vec![], 0, 10), &|facts| {
                facts.demand.woken = Some(ago(1) + Duration::from_nanos(700));
                facts.last_scale = Some(ago(1));
            }),
            None,
        ),
        (
            "a refusal in the microsecond the last decision was recorded in",
            with(autoscaled(4, ready(4, 3), 0, 10), &|facts| {
                facts.demand.at_capacity = Some(ago(1) + Duration::from_nanos(700));
                facts.last_scale = Some(ago(1));
            }),
            None,
        ),
        (
            "a refusal a microsecond after the last decision",
            with(autoscaled(4, ready(4, 3), 0, 10), &|facts| {
                facts.demand.at_capacity = Some(ago(1) + Duration::from_micros(1));
                facts.last_scale = Some(ago(1) + Duration::from_nanos(999));
            }),
            Some((5, ScaleReason::AtCapacity)),
        ),
        (
            "at capacity adds at least one",
            with(autoscaled(4, ready(4, 3), 0, 10), &|facts| facts.demand.at_capacity = Some(ago(1))),
            Some((5, ScaleReason::AtCapacity)),
        ),
        (
            "at capacity with every member leased adds what the share asks for",
            with(autoscaled(4, ready(4, 4), 0, 10), &|facts| facts.demand.at_capacity = Some(ago(1))),
            Some((5, ScaleReason::AtCapacity)),
        ),
        (
            "at capacity at max",
            with(autoscaled(10, ready(10, 10), 0, 10), &|facts| facts.demand.at_capacity = Some(ago(1))),
            None,
        ),
        (
            "none healthy",
            with(autoscaled(2, ready(2, 0), 0, 10), &|facts| facts.demand.none_healthy = Some(ago(1))),
            Some((3, ScaleReason::NoneHealthy)),
        ),
        (
            "refusals while the last members still come up wait for the window",
            with(
                autoscaled(
                    3,
                    vec![member(0, 0, 500).leased(1), member(1, 0, 5).unready(), member(2, 0, 5).unready()],
                    0,
                    10,
                ),
                &|facts| {
                    facts.demand.at_capacity = Some(ago(1));
                    facts.last_scale = Some(ago(5));
                },
            ),
            None,
        ),
        (
            "refusals after the window add again even if members still come up",
            with(
                autoscaled(
                    3,
                    vec![member(0, 0, 500).leased(1), member(1, 0, 5).unready(), member(2, 0, 5).unready()],
                    0,
                    10,
                ),
                &|facts| {
                    facts.demand.at_capacity = Some(ago(1));
                    facts.last_scale = Some(ago(61));
                },
            ),
            Some((4, ScaleReason::AtCapacity)),
        ),
        ("leased share above the target", autoscaled(5, ready(5, 5), 0, 10), Some((7, ScaleReason::LeasedShare))),
        ("leased share at the target", autoscaled(5, ready(5, 4), 0, 10), None),
        (
            "leased share bounded by the step",
            autoscaled(20, ready(20, 20), 0, 100),
            Some((24, ScaleReason::LeasedShare)),
        ),
        (
            "idle for idleSeconds goes to min at once",
            with(autoscaled(6, ready(6, 0), 0, 10), &|facts| facts.demand.idle_since = Some(ago(20))),
            Some((0, ScaleReason::Idle)),
        ),
        (
            "idle but not for long enough",
            with(autoscaled(6, ready(6, 0), 0, 10), &|facts| facts.demand.idle_since = Some(ago(19))),
            None,
        ),
        (
            "idle ignores the stabilisation window",
            with(autoscaled(6, ready(6, 0), 2, 10), &|facts| {
                facts.demand.idle_since = Some(ago(25));
                facts.last_scale = Some(ago(21));
            }),
            Some((2, ScaleReason::Idle)),
        ),
        (
            "a wake restarts the idle clock",
            with(autoscaled(1, ready(1, 0), 0, 10), &|facts| {
                facts.demand.idle_since = Some(ago(60));
                facts.last_scale = Some(ago(5));
            }),
            None,
        ),
        (
            "idle long enough after the last decision",
            with(autoscaled(1, ready(1, 0), 0, 10), &|facts| {
                facts.demand.idle_since = Some(ago(60));
                facts.last_scale = Some(ago(20));
            }),
            Some((0, ScaleReason::Idle)),
        ),
        (
            "a lower leased share steps down after the window",
            with(autoscaled(10, ready(10, 2), 0, 10), &|facts| facts.last_scale = Some(ago(61))),
            Some((9, ScaleReason::LowerLeasedShare)),
        ),
        (
            "a lower leased share inside the window waits",
            with(autoscaled(10, ready(10, 2), 0, 10), &|facts| facts.last_scale = Some(ago(30))),
            None,
        ),
        (
            "a lower leased share never goes below min",
            with(autoscaled(3, ready(3, 1), 3, 10), &|facts| facts.last_scale = Some(ago(61))),
            None,
        ),
    ];
    for (name, facts, expected) in cases {
        assert_eq!(scale_of(&facts), expected, "{name}");
    }
}

#[test]
fn a_scaling_decision_drives_the_members_in_the_same_pass() {
    let mut facts = autoscaled(0, vec![], 0, 10);
    facts.demand.woken = Some(ago(1));
    let decision = decide_pool(&facts);
    assert_eq!(decision.target, 1);
    assert_eq!(created_ordinals(&decision), [0]);
    let scale = decision.scale.expect("a scale");
    assert_eq!((scale.from, scale.to), (0, 1));
    assert!(scale.message.contains("no members"), "{}", scale.message);

    let mut idle = autoscaled(2, vec![member(0, 0, 100), member(1, 0, 100)], 0, 10);
    idle.demand.idle_since = Some(ago(60));
    let decision = decide_pool(&idle);
    assert_eq!(decision.target, 0);
    assert_eq!(decision.delete, ["pool-0", "pool-1"]);
    assert_eq!(decision.requeue, AUTOSCALE_REQUEUE);
}
