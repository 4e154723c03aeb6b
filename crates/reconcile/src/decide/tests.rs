//! One case per row of the state machine (the design's Managed table, External mode, cleanup, quota, latch).

use super::*;

const HASH: &str = "1111111111111111";
const OLD_HASH: &str = "0000000000000000";

fn at(seconds: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(seconds)
}

fn instance(name: &str, hash: &str, state: InstanceState, ip: Option<&str>) -> InstanceStatus {
    InstanceStatus {
        name: name.into(),
        provider_id: format!("scripted/{name}"),
        state,
        ip: ip.map(Into::into),
        spec_hash: hash.into(),
        provider_fingerprint: None,
        created_at: Some(time(at(1_000))),
        draining_since: None,
    }
}

fn verdict(healthy: bool) -> Option<Verdict> {
    Some(Verdict {
        healthy,
        since: at(1_500),
        last_error: (!healthy).then(|| "connect refused".into()),
        egress_ip: None,
        dead: !healthy,
    })
}

fn facts() -> Facts {
    Facts {
        mode: ProxyMode::Managed,
        generation: Some(1),
        port: 3128,
        spec_endpoint: None,
        status: ProxyStatus::default(),
        desired_hash: HASH.into(),
        fingerprint: None,
        replacement_cause: "the spec (or the crawl.example.com/rotate annotation) changed",
        retry_token: None,
        max_age: None,
        replace_after: None,
        resync: Duration::from_secs(60),
        now: at(2_000),
        desired: Observed::NotRecorded,
        previous: PreviousObserved::None,
        previous_leases: 0,
        drain_timeout: Duration::from_secs(300),
        health: None,
        geo: None,
        created: None,
    }
}

fn with_current(state: InstanceState, ip: Option<&str>) -> Facts {
    let mut facts = facts();
    facts.status.instance = Some(instance("px-new", HASH, state, ip));
    facts.desired = Observed::Found { state, ip: ip.map(Into::into), created_at: Some(at(1_000)) };
    facts
}

fn reasons(decision: &Decision) -> Vec<&'static str> {
    decision.events.iter().map(|event| event.reason).collect()
}

fn condition<'a>(
    status: &'a ProxyStatus,
    type_: &str,
) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    status.conditions.iter().find(|condition| condition.type_ == type_).expect("condition present")
}

// Row: no current instance → Create desired; phase Provisioning.
#[test]
fn no_instance_creates_one() {
    let decision = decide(&facts());
    assert_eq!(decision.action, Action::Create);
    assert_eq!(decision.status.phase, Some(ProxyPhase::Provisioning));
    assert_eq!(reasons(&decision), ["Provisioning"]);
    assert_eq!(decision.status.observed_generation, Some(1));
    assert_eq!(condition(&decision.status, "Ready").status, "False");
}

// Row: current instance's spec hash ≠ desired → Create desired, current becomes previousInstance; phase Replacing.
#[test]
fn spec_change_starts_a_replacement() {
    let mut facts = facts();
    facts.status.instance = Some(instance("px-old", OLD_HASH, InstanceState::Running, Some("10.0.0.1")));
    facts.status.endpoint = Some(EndpointStatus::from(&Endpoint { host: "10.0.0.1".into(), port: 3128 }));
    let decision = decide(&facts);
    assert_eq!(decision.action, Action::Create);
    assert_eq!(decision.status.phase, Some(ProxyPhase::Replacing));
    assert_eq!(decision.status.previous_instance.as_ref().map(|i| i.name.as_str()), Some("px-old"));
    assert_eq!(decision.status.instance, None);
    assert_eq!(
        decision.status.endpoint.as_ref().map(|e| e.address.as_str()),
        Some("10.0.0.1:3128"),
        "the old endpoint keeps serving"
    );
    assert_eq!(reasons(&decision), ["Replacing"]);
    // The Event says why, as the controller worked it out from the instance's hash.
    facts.replacement_cause = "the instance reached maxAge";
    assert_eq!(
        decide(&facts).events[0].note,
        "the instance reached maxAge; creating a new instance before deleting px-old"
    );
}

// A second spec change while a replacement is in flight deletes the unfinished instance, keeping the previous one.
#[test]
fn second_spec_change_abandons_the_unfinished_instance() {
    let mut facts = facts();
    facts.status.previous_instance =
        Some(instance("px-old", "aaaaaaaaaaaaaaaa", InstanceState::Running, Some("10.0.0.1")));
    facts.status.instance = Some(instance("px-mid", OLD_HASH, InstanceState::Provisioning, None));
    let decision = decide(&facts);
    assert_eq!(decision.action, Action::Delete { provider_id: "scripted/px-mid".into() });
    assert_eq!(decision.status.instance, None);
    assert_eq!(decision.status.previous_instance.as_ref().map(|i| i.name.as_str()), Some("px-old"));
}

// The spec goes back to the previous instance's while a replacement is in flight (a change reverted, found by the
// crash test's random operations): the replacement is cancelled and the previous instance is current again. Before,
// the create adopted the previous instance by name, so it was both current and previous, and the switch deleted it.
#[test]
fn a_reverted_spec_cancels_the_replacement_and_keeps_the_previous_instance() {
    let mut facts = facts();
    facts.status.previous_instance = Some(instance("px-old", HASH, InstanceState::Running, Some("10.0.0.1")));
    facts.status.instance = Some(instance("px-mid", OLD_HASH, InstanceState::Provisioning, None));
    let decision = decide(&facts);
    assert_eq!(decision.action, Action::Delete { provider_id: "scripted/px-mid".into() });
    assert_eq!(decision.status.instance.as_ref().map(|i| i.name.as_str()), Some("px-old"));
    assert_eq!(decision.status.previous_instance, None);
    assert_eq!(reasons(&decision), ["ReplacementCancelled"]);
}

// The same after the unfinished instance was already deleted: nothing to delete, the previous one is current.
#[test]
fn a_reverted_spec_with_no_unfinished_instance_makes_the_previous_current() {
    let mut facts = facts();
    facts.status.previous_instance = Some(instance("px-old", HASH, InstanceState::Running, Some("10.0.0.1")));
    let decision = decide(&facts);
    assert_eq!(decision.action, Action::Nothing);
    assert_eq!(decision.requeue, Requeue::After(Duration::ZERO));
    assert_eq!(decision.status.instance.as_ref().map(|i| i.name.as_str()), Some("px-old"));
    assert_eq!(decision.status.previous_instance, None);
}

// Row: desired instance Provisioning → requeue in a few seconds.
#[test]
fn provisioning_instance_is_polled() {
    let decision = decide(&with_current(InstanceState::Provisioning, None));
    assert_eq!(decision.action, Action::Nothing);
    assert_eq!(decision.requeue, Requeue::After(PROVISIONING_REQUEUE));
    assert_eq!(decision.status.phase, Some(ProxyPhase::Provisioning));
    assert_eq!(decision.status.endpoint, None);
}

// Row: desired instance Running with IP → publish endpoint; Running until healthy, then Ready.
#[test]
fn running_instance_is_published_and_follows_health() {
    let cases = [
        (None, ProxyPhase::Running, "False"),
        (verdict(true), ProxyPhase::Ready, "True"),
        (verdict(false), ProxyPhase::Unhealthy, "False"),
    ];
    for (health, phase, ready) in cases {
        let mut facts = with_current(InstanceState::Running, Some("10.0.0.2"));
        facts.health = health.clone();
        let decision = decide(&facts);
        assert_eq!(decision.action, Action::Nothing);
        assert_eq!(decision.status.phase, Some(phase), "{health:?}");
        assert_eq!(decision.status.endpoint.as_ref().map(|e| e.address.as_str()), Some("10.0.0.2:3128"));
        assert_eq!(condition(&decision.status, "Ready").status, ready, "{health:?}");
        assert_eq!(condition(&decision.status, "Provisioned").status, "True");
        assert_eq!(decision.requeue, Requeue::After(Duration::from_secs(60)), "resync to notice preemption");
    }
}

#[test]
fn first_run_emits_provisioned_once() {
    let mut facts = facts();
    facts.status.instance = Some(instance("px-new", HASH, InstanceState::Provisioning, None));
    facts.desired = Observed::Found { state: InstanceState::Running, ip: Some("10.0.0.2".into()), created_at: None };
    assert_eq!(reasons(&decide(&facts)), ["Provisioned"]);
    assert!(reasons(&decide(&with_current(InstanceState::Running, Some("10.0.0.2")))).is_empty());
}

// Health status is written only when `healthy` flips, with an Event for every failure and every recovery (a first
// verdict that is healthy has none: the phase says Ready).
#[test]
fn health_is_written_only_on_a_flip() {
    let mut facts = with_current(InstanceState::Running, Some("10.0.0.2"));
    facts.health = verdict(true);
    let first = decide(&facts);
    assert!(reasons(&first).is_empty(), "{:?}", reasons(&first));
    assert_eq!(first.status.health.as_ref().map(|h| h.healthy), Some(true));

    let mut steady = facts.clone();
    steady.status = first.status.clone();
    let again = decide(&steady);
    assert_eq!(again.status, first.status, "a steady verdict changes nothing");
    assert!(again.events.is_empty());

    steady.health = verdict(false);
    let flipped = decide(&steady);
    assert_eq!(reasons(&flipped), ["Unhealthy"]);
    assert_eq!(flipped.status.health.as_ref().and_then(|h| h.last_error.as_deref()), Some("connect refused"));
    assert_eq!(flipped.status.phase, Some(ProxyPhase::Unhealthy));

    let mut recovering = steady.clone();
    recovering.status = flipped.status.clone();
    recovering.health = verdict(true);
    assert_eq!(reasons(&decide(&recovering)), ["Healthy"]);

    let mut failing_first = facts.clone();
    failing_first.health = verdict(false);
    assert_eq!(reasons(&decide(&failing_first)), ["Unhealthy"], "a first verdict that fails is worth an Event");
}

// Row: desired instance Terminated/Stopped unexpectedly → Delete it, then create again; Event InstanceLost.
#[test]
fn terminated_instance_is_deleted_and_reported_lost_once() {
    for state in [InstanceState::Terminated, InstanceState::Stopped] {
        let mut facts = with_current(InstanceState::Running, Some("10.0.0.2"));
        facts.desired = Observed::Found { state, ip: None, created_at: None };
        let decision = decide(&facts);
        assert_eq!(decision.action, Action::Delete { provider_id: "scripted/px-new".into() });
        assert_eq!(reasons(&decision), ["InstanceLost"]);
        assert_eq!(decision.status.instance.as_ref().map(|i| i.state), Some(InstanceState::Terminated));
        assert_eq!(decision.status.endpoint, None, "a lost instance's address is not published");

        let mut again = facts.clone();
        again.status = decision.status.clone();
        assert!(decide(&again).events.is_empty(), "no second InstanceLost while the deletion completes");
    }
}

// Row: desired instance NotFound after it was recorded → create again; Event InstanceLost.
#[test]
fn vanished_instance_is_recreated() {
    let mut lost = with_current(InstanceState::Running, Some("10.0.0.2"));
    lost.desired = Observed::NotFound;
    let decision = decide(&lost);
    assert_eq!(decision.action, Action::Create);
    assert_eq!(reasons(&decision), ["InstanceLost"]);

    // After the operator itself deleted a terminated instance, its absence is expected: no Event.
    let mut deleted = facts();
    deleted.status.instance = Some(instance("px-new", HASH, InstanceState::Terminated, None));
    deleted.desired = Observed::NotFound;
    let decision = decide(&deleted);
    assert_eq!(decision.action, Action::Create);
    assert!(decision.events.is_empty());
}

fn replacing(health: Option<Verdict>, previous: PreviousObserved) -> Facts {
    let mut facts = with_current(InstanceState::Running, Some("10.0.0.9"));
    facts.status.previous_instance = Some(instance("px-old", OLD_HASH, InstanceState::Running, Some("10.0.0.1")));
    facts.status.endpoint = Some(EndpointStatus::from(&Endpoint { host: "10.0.0.1".into(), port: 3128 }));
    facts.status.phase = Some(ProxyPhase::Replacing);
    facts.health = health;
    facts.previous = previous;
    facts
}

// Row: new instance Ready and previousInstance set → Delete previous; clear it once NotFound.
#[test]
fn replacement_switches_the_endpoint_only_when_the_new_instance_is_healthy() {
    let waiting = decide(&replacing(None, PreviousObserved::Present));
    assert_eq!(waiting.action, Action::Nothing);
    assert_eq!(waiting.status.phase, Some(ProxyPhase::Replacing));
    assert_eq!(waiting.status.endpoint.as_ref().map(|e| e.address.as_str()), Some("10.0.0.1:3128"));

    let switching = decide(&replacing(verdict(true), PreviousObserved::Present));
    assert_eq!(switching.action, Action::Delete { provider_id: "scripted/px-old".into() });
    assert_eq!(switching.status.endpoint.as_ref().map(|e| e.address.as_str()), Some("10.0.0.9:3128"));
    assert_eq!(switching.status.phase, Some(ProxyPhase::Ready));
    assert!(switching.status.previous_instance.is_some(), "kept until it is gone");

    let done = decide(&replacing(verdict(true), PreviousObserved::Gone));
    assert_eq!(done.action, Action::Nothing);
    assert_eq!(done.status.previous_instance, None);
    assert!(reasons(&done).contains(&"Replaced"));
}

// Row: new instance healthy, leases still on the previous one → keep it (drain) until they are gone or the drain
// timeout passed since the switch; then delete it.
#[test]
fn a_replaced_instance_is_kept_while_leases_are_on_it_until_the_drain_timeout() {
    let mut held = replacing(verdict(true), PreviousObserved::Present);
    held.previous_leases = 2;
    let draining = decide(&held);
    assert_eq!(draining.action, Action::Nothing, "kept for its leases");
    assert_eq!(draining.status.endpoint.as_ref().map(|e| e.address.as_str()), Some("10.0.0.9:3128"), "switched");
    assert_eq!(draining.status.phase, Some(ProxyPhase::Ready));
    let since = draining.status.previous_instance.as_ref().and_then(|p| p.draining_since.clone());
    assert_eq!(since, Some(time(at(2_000))));
    assert!(reasons(&draining).contains(&"Draining"), "{:?}", reasons(&draining));
    let note = &draining.events.iter().find(|event| event.reason == "Draining").expect("the Event").note;
    assert!(!note.contains("  ") && note.contains("renew onto it"), "one space between words: {note:?}");
    assert_eq!(draining.requeue, Requeue::After(DRAIN_RECHECK));

    // Later, still held: no second Event, the start is kept.
    let mut later = held.clone();
    later.status = draining.status.clone();
    later.now = at(2_100);
    let still = decide(&later);
    assert_eq!(still.action, Action::Nothing);
    assert!(reasons(&still).is_empty(), "{:?}", reasons(&still));
    assert_eq!(still.status.previous_instance.as_ref().and_then(|p| p.draining_since.clone()), since);

    // The last lease moved: deleted at once.
    let mut moved = later.clone();
    moved.previous_leases = 0;
    assert_eq!(decide(&moved).action, Action::Delete { provider_id: "scripted/px-old".into() });

    // Held past the timeout: deleted, with a warning.
    let mut timed_out = later;
    timed_out.now = at(2_300);
    let deleted = decide(&timed_out);
    assert_eq!(deleted.action, Action::Delete { provider_id: "scripted/px-old".into() });
    assert_eq!(reasons(&deleted), ["DrainTimedOut"]);
}

// Row: the instance has been dead (unhealthy, no answer) for replaceAfterSeconds → count a replacement, which
// changes the desired hash; the next pass starts a make-before-break replacement.
#[test]
fn a_dead_instance_is_replaced_after_replace_after() {
    // Dead since 1500, now 2000: 500 s.
    let mut dead = with_current(InstanceState::Running, Some("10.0.0.2"));
    dead.health = verdict(false);
    dead.replace_after = Some(Duration::from_secs(300));
    let decision = decide(&dead);
    assert_eq!(decision.status.replacements, Some(1));
    assert_eq!(reasons(&decision), ["Unhealthy", "SelfHealing"]);
    assert!(
        decision.events[1].warning && decision.events[1].note.contains("not worked for 500s"),
        "{:?}",
        decision.events
    );
    assert_eq!(decision.requeue, Requeue::After(Duration::ZERO));
    assert_eq!(decision.status.phase, Some(ProxyPhase::Unhealthy), "it keeps serving what it can until replaced");

    let mut early = dead.clone();
    early.replace_after = Some(Duration::from_secs(600));
    let decision = decide(&early);
    assert_eq!(decision.status.replacements, None);
    assert_eq!(decision.requeue, Requeue::After(Duration::from_secs(60)), "resync first, then the due time");
    early.replace_after = Some(Duration::from_secs(530));
    assert_eq!(decide(&early).requeue, Requeue::After(Duration::from_secs(30)), "wake up when it is due");

    let mut off = dead.clone();
    off.replace_after = None;
    assert_eq!(decide(&off).status.replacements, None, "replaceAfterSeconds 0 never replaces");

    // Refusing for a reason of its own (credentials, its policy, the origin) is not dead.
    let mut refusing = dead.clone();
    refusing.health = verdict(false).map(|verdict| Verdict { dead: false, ..verdict });
    assert_eq!(decide(&refusing).status.replacements, None);
}

// Row: a replacement that is itself dead is replaced in turn, waiting twice as long per replacement so far.
#[test]
fn a_dead_replacement_is_replaced_with_backoff() {
    let mut facts = replacing(verdict(false), PreviousObserved::Present);
    facts.replace_after = Some(Duration::from_secs(300));
    facts.status.replacements = Some(1);
    // 500 s dead, but the second try waits 2 × 300 s.
    let waiting = decide(&facts);
    assert_eq!(waiting.status.replacements, Some(1));
    assert_eq!(waiting.status.phase, Some(ProxyPhase::Replacing));
    assert_eq!(waiting.requeue, Requeue::After(Duration::from_secs(60)));
    assert_eq!(waiting.status.endpoint.as_ref().map(|e| e.address.as_str()), Some("10.0.0.1:3128"), "old serves");
    facts.replace_after = Some(Duration::from_secs(200));
    let retry = decide(&facts);
    assert_eq!(retry.status.replacements, Some(2));
    assert_eq!(reasons(&retry), ["SelfHealing"]);
    // The next pass deletes the unfinished replacement; the old instance keeps serving until the newest is ready.
    let mut next = facts.clone();
    next.status = retry.status.clone();
    next.desired_hash = "2222222222222222".into();
    let cleanup = decide(&next);
    assert_eq!(cleanup.action, Action::Delete { provider_id: "scripted/px-new".into() });
    assert_eq!(cleanup.status.previous_instance.as_ref().map(|p| p.name.as_str()), Some("px-old"));
}

// Row: maxAge set and instance older → start a replacement.
#[test]
fn max_age_triggers_a_rotation() {
    let mut old = with_current(InstanceState::Running, Some("10.0.0.2"));
    old.max_age = Some(Duration::from_secs(500)); // created at 1000, now 2000
    let decision = decide(&old);
    assert_eq!(decision.status.max_age_rotations, Some(1));
    assert_eq!(reasons(&decision), ["Replacing"]);
    assert_eq!(decision.requeue, Requeue::After(Duration::ZERO));

    let mut young = with_current(InstanceState::Running, Some("10.0.0.2"));
    young.max_age = Some(Duration::from_secs(1_030));
    let decision = decide(&young);
    assert_eq!(decision.status.max_age_rotations, None);
    assert_eq!(decision.requeue, Requeue::After(Duration::from_secs(30)), "wake up when it expires");
}

// Row: Create → QuotaExceeded: phase Pending, condition reason QuotaExceeded, quota backoff 1 min doubling to 15.
#[test]
fn quota_exceeded_backs_off() {
    let (status, event, backoff) = on_quota_exceeded(&facts(), "exceeded quota: pods=0", 1);
    assert_eq!(status.phase, Some(ProxyPhase::Pending));
    assert_eq!(condition(&status, "Ready").reason, "QuotaExceeded");
    assert_eq!(condition(&status, "Provisioned").reason, "QuotaExceeded");
    assert_eq!(event.reason, "QuotaExceeded");
    assert_eq!(backoff, Duration::from_secs(60));
    let backoffs: Vec<u64> = (1..=6).map(|n| quota_backoff(n).as_secs()).collect();
    assert_eq!(backoffs, [60, 120, 240, 480, 900, 900]);
}

// Row: Create → Transient: phase Pending, the provider's message on the conditions, no Event (retried by backoff).
#[test]
fn a_transient_create_failure_is_shown_on_the_conditions() {
    let status = on_transient_failure(&facts(), "image debian12 is being downloaded to host rack1 (3 MiB after 2 s)");
    assert_eq!(status.phase, Some(ProxyPhase::Pending));
    let provisioned = condition(&status, "Provisioned");
    assert_eq!((provisioned.status.as_str(), provisioned.reason.as_str()), ("False", "ProviderRetrying"));
    assert!(provisioned.message.contains("being downloaded"), "{provisioned:?}");
    assert_eq!(condition(&status, "Ready").reason, "ProviderRetrying");
}

// Row: any call → Permanent: latch Failed with status.failure and an Event.
#[test]
fn permanent_failure_latches() {
    let mut facts = facts();
    facts.retry_token = Some("1".into());
    let (status, event) = on_permanent_failure(&facts, "unknown machine type \"huge\"");
    assert_eq!(status.phase, Some(ProxyPhase::Failed));
    let failure = status.failure.clone().expect("failure recorded");
    assert_eq!(failure.retry_token.as_deref(), Some("1"));
    assert_eq!(event.reason, "ProvisioningFailed");
    assert_eq!(condition(&status, "Provisioned").reason, "ProvisioningFailed");
}

// Row: failure latched and generation / retry token unchanged → nothing; a change clears it.
#[test]
fn latched_failure_waits_for_a_change() {
    let mut latched = facts();
    latched.retry_token = Some("1".into());
    latched.status = on_permanent_failure(&latched, "broken").0;
    let decision = decide(&latched);
    assert_eq!(decision.action, Action::Nothing);
    assert_eq!(decision.requeue, Requeue::AwaitChange);
    assert_eq!(decision.status, latched.status);

    let mut retried = latched.clone();
    retried.retry_token = Some("2".into());
    let decision = decide(&retried);
    assert_eq!(decision.action, Action::Create);
    assert_eq!(decision.status.failure, None);

    let mut edited = latched.clone();
    edited.generation = Some(2);
    assert_eq!(decide(&edited).action, Action::Create);
}

// External mode: no instance; the endpoint is the spec's; the phase follows health.
#[test]
fn external_follows_health() {
    let cases =
        [(None, ProxyPhase::Running), (verdict(true), ProxyPhase::Ready), (verdict(false), ProxyPhase::Unhealthy)];
    for (health, phase) in cases {
        let mut facts = facts();
        facts.mode = ProxyMode::External;
        facts.spec_endpoint = Some(Endpoint { host: "proxy.example".into(), port: 8080 });
        facts.health = health;
        let decision = decide(&facts);
        assert_eq!(decision.action, Action::Nothing);
        assert_eq!(decision.status.phase, Some(phase));
        assert_eq!(decision.status.endpoint.as_ref().map(|e| e.address.as_str()), Some("proxy.example:8080"));
        assert_eq!(decision.status.instance, None);
        assert_eq!(condition(&decision.status, "Provisioned").reason, "External");
    }
}

// A new External Proxy's first status waits up to FIRST_VERDICT_WAIT for its first verdict, so one write says Ready
// (or Unhealthy); it waits only when never reconciled and young, and never once a verdict is in.
#[test]
fn a_new_external_proxy_waits_for_its_first_verdict_before_its_first_write() {
    let mut young = facts();
    young.mode = ProxyMode::External;
    young.spec_endpoint = Some(Endpoint { host: "proxy.example".into(), port: 8080 });
    young.created = Some(young.now - Duration::from_secs(2));
    let waiting = decide(&young);
    assert_eq!(waiting.status, young.status, "nothing to write yet");
    assert_eq!(waiting.requeue, Requeue::After(FIRST_VERDICT_WAIT - Duration::from_secs(2)));
    assert!(waiting.events.is_empty());

    let mut answered = young.clone();
    answered.health = verdict(true);
    assert_eq!(decide(&answered).status.phase, Some(ProxyPhase::Ready));

    let mut old = young.clone();
    old.created = Some(young.now - FIRST_VERDICT_WAIT);
    assert_eq!(decide(&old).status.phase, Some(ProxyPhase::Running), "the wait is over: Running is written");

    let mut reconciled = young.clone();
    reconciled.status.observed_generation = Some(1);
    assert_eq!(decide(&reconciled).status.phase, Some(ProxyPhase::Running), "only the first status waits");

    let mut edited = young.clone();
    edited.generation = Some(2);
    assert_eq!(decide(&edited).status.phase, Some(ProxyPhase::Running), "an edit is answered at once");

    let mut managed = young.clone();
    managed.mode = ProxyMode::Managed;
    assert_eq!(decide(&managed).action, Action::Create, "a Managed Proxy never waits");
}

// Rows: object being deleted (skip-cleanup; instances left; none left; provider no longer configured).
#[test]
fn cleanup_rows() {
    let ids = vec!["scripted/px-a".to_owned()];
    assert!(matches!(
        decide_cleanup(ProxyMode::Managed, true, true, true, &ids),
        CleanupDecision::Release { event: Some(EventSpec { reason: "CleanupSkipped", .. }) }
    ));
    assert_eq!(
        decide_cleanup(ProxyMode::Managed, false, true, true, &ids),
        CleanupDecision::Delete { provider_ids: ids.clone() }
    );
    assert_eq!(decide_cleanup(ProxyMode::Managed, false, true, true, &[]), CleanupDecision::Release { event: None });
    assert_eq!(decide_cleanup(ProxyMode::Managed, false, false, true, &ids), CleanupDecision::ProviderMissing);
    assert!(matches!(
        decide_cleanup(ProxyMode::Managed, true, false, true, &ids),
        CleanupDecision::Release { event: Some(_) }
    ));
    assert_eq!(decide_cleanup(ProxyMode::External, false, false, true, &[]), CleanupDecision::Release { event: None });
    // A Proxy that never recorded an instance is released even when its provider is not configured.
    assert_eq!(decide_cleanup(ProxyMode::Managed, false, false, false, &[]), CleanupDecision::Release { event: None });
}

// Conditions keep their transition time while their status holds.
#[test]
fn conditions_keep_transition_times() {
    let facts = with_current(InstanceState::Running, Some("10.0.0.2"));
    let first = decide(&facts);
    let mut later = facts.clone();
    later.status = first.status.clone();
    later.now = at(9_000);
    let second = decide(&later);
    assert_eq!(second.status, first.status, "nothing changed, so nothing to write");
}
