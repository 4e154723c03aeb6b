//! The pool controller against the test control plane, beside the Proxy controller and its scriptable provider:
//! members made on the spread and kept there as the count changes, a template change rolled within `maxSurge` and
//! `minAvailable`, recycling by age, Proxies the pool does not own left alone, members deleted with their pool by the
//! cluster's garbage collector, autoscaling to zero and back, and random scale, template and delete operations with
//! both controllers killed at random points, which must settle with exactly the desired members and no orphan.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use egress_api::pool::POOL_LABEL;
use egress_api::{Proxy, ProxyPool};
use egress_reconcile::ids::{PoolId, ProxyId};
use egress_reconcile::pool::{NoSignals, PoolContext, PoolDemand, PoolMetrics, PoolSignals, run_pools};
use egress_reconcile::{PoolFeed, ProxyFeed};
use egress_testenv::eventually_every;
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
};
use serde_json::{Value, json};
use support::{Harness, Rng, managed};
use tokio::task::JoinHandle;

const SETTLE: Duration = Duration::from_secs(90);
/// How often a wait looks again (each look lists the Proxies and reports health).
const LOOK: Duration = Duration::from_millis(200);

/// Lease counts and demand the test sets, standing for the discovery API.
#[derive(Default)]
struct TestSignals {
    leases: Mutex<HashMap<ProxyId, u32>>,
    demand: Mutex<PoolDemand>,
}

#[async_trait::async_trait]
impl PoolSignals for TestSignals {
    async fn leases_of(&self, proxy: &ProxyId) -> u32 {
        self.leases.lock().unwrap().get(proxy).copied().unwrap_or(0)
    }
    fn demand(&self, _pool: &PoolId) -> PoolDemand {
        *self.demand.lock().unwrap()
    }
}

/// The pool controller beside the harness's Proxy controller, on the same Proxy store.
struct PoolController {
    tasks: Vec<JoinHandle<()>>,
    metrics: PoolMetrics,
}

impl PoolController {
    fn start(harness: &Harness, signals: Arc<dyn PoolSignals>) -> Self {
        let proxies: ProxyFeed = harness.feed.clone().expect("the harness runs a Proxy feed");
        let (pools, watch) = PoolFeed::start(harness.ns.client(), Some(harness.ns.name()));
        let metrics = PoolMetrics::default();
        let context = Arc::new(PoolContext::new(harness.ns.client(), &proxies, signals, metrics.clone()));
        let controller =
            tokio::spawn(run_pools(context, pools, proxies, futures::stream::pending(), futures::future::pending()));
        Self { tasks: vec![watch, controller], metrics }
    }
}

impl Drop for PoolController {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

fn pools(harness: &Harness) -> Api<ProxyPool> {
    harness.ns.api()
}

async fn apply_pool(harness: &Harness, name: &str, spec: Value) -> ProxyPool {
    let body = json!({ "apiVersion": "crawl.example.com/v1alpha1", "kind": "ProxyPool", "metadata": { "name": name }, "spec": spec });
    pools(harness)
        .patch(name, &PatchParams::apply("pool-tests").force(), &Patch::Apply(&body))
        .await
        .unwrap_or_else(|error| panic!("applying ProxyPool {name}: {error}"))
}

/// The pool's members as the apiserver has them, by name.
async fn members(harness: &Harness, pool: &str) -> BTreeMap<String, Proxy> {
    let list = harness
        .proxies()
        .list(&ListParams::default().labels(&format!("{POOL_LABEL}={pool}")))
        .await
        .expect("list members");
    list.items.into_iter().map(|proxy| (proxy.name_any(), proxy)).collect()
}

fn ready(proxy: &Proxy) -> bool {
    proxy.status.as_ref().is_some_and(|status| {
        status.conditions.iter().any(|condition| condition.type_ == "Ready" && condition.status == "True")
    })
}

/// Settled on its current spec: Ready, its instance of the desired spec hash, nothing being replaced.
fn settled(proxy: &Proxy) -> bool {
    let status = proxy.status.clone().unwrap_or_default();
    ready(proxy)
        && proxy.metadata.deletion_timestamp.is_none()
        && status.previous_instance.is_none()
        && status.instance.is_some_and(|instance| instance.spec_hash == proxy.desired_spec_hash())
}

fn providers(members: &BTreeMap<String, Proxy>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for proxy in members.values() {
        *counts.entry(proxy.spec.provider.clone().unwrap_or_default()).or_default() += 1;
    }
    counts
}

/// Waits (reporting health as the engine would) until `done` holds for the pool's members; calls `observe` on
/// every look.
async fn settle(
    harness: &Harness,
    pool: &str,
    what: &str,
    observe: impl FnMut(&BTreeMap<String, Proxy>),
    done: impl Fn(&BTreeMap<String, Proxy>) -> bool,
) -> BTreeMap<String, Proxy> {
    let observe = std::cell::RefCell::new(observe);
    eventually_every(what, SETTLE, LOOK, || async {
        harness.report_health().await;
        let now = members(harness, pool).await;
        (observe.borrow_mut())(&now);
        if done(&now) {
            return Ok(now);
        }
        let states: Vec<_> =
            now.values().map(|proxy| (proxy.name_any(), proxy.spec.provider.clone(), settled(proxy))).collect();
        Err(format!("members {states:?}"))
    })
    .await
}

async fn pool_events(harness: &Harness, pool: &str) -> Vec<(String, String)> {
    let events: Api<Event> = harness.ns.api();
    let list = events.list(&ListParams::default()).await.expect("list Events");
    list.items
        .into_iter()
        .filter(|event| event.regarding.as_ref().and_then(|regarding| regarding.kind.as_deref()) == Some("ProxyPool"))
        .filter(|event| event.regarding.as_ref().and_then(|regarding| regarding.name.as_deref()) == Some(pool))
        .map(|event| (event.reason.unwrap_or_default(), event.note.unwrap_or_default()))
        .collect()
}

fn spread_spec(replicas: i32) -> Value {
    json!({
        "replicas": replicas,
        "template": { "metadata": { "labels": { "tier": "gold" } }, "spec": { "placement": { "machineType": "small" } } },
        "spread": [{ "provider": "scripted", "weight": 2 }, { "provider": "scripted-b", "weight": 1 }],
        "recycle": { "maxSurge": 1, "minAvailable": 2 },
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_keeps_its_spread_as_it_scales_and_rolls_its_template() {
    let harness = Harness::new("pool-spread").await;
    let _pools = PoolController::start(&harness, Arc::new(NoSignals));
    let pool = apply_pool(&harness, "eu", spread_spec(6)).await;

    let members = settle(
        &harness,
        "eu",
        "6 Ready members",
        |_| {},
        |members| members.len() == 6 && members.values().all(settled),
    )
    .await;
    assert_eq!(members.keys().cloned().collect::<Vec<_>>(), ["eu-0", "eu-1", "eu-2", "eu-3", "eu-4", "eu-5"]);
    assert_eq!(providers(&members), BTreeMap::from([("scripted".into(), 4), ("scripted-b".into(), 2)]));
    for proxy in members.values() {
        let owner = &proxy.owner_references()[0];
        assert_eq!((owner.kind.as_str(), owner.controller), ("ProxyPool", Some(true)));
        assert_eq!(Some(&owner.uid), pool.metadata.uid.as_ref());
        assert_eq!(proxy.labels().get("tier").map(String::as_str), Some("gold"));
        assert_eq!(proxy.spec.placement.as_ref().and_then(|p| p.machine_type.as_deref()), Some("small"));
    }
    let status = wait_for_status(&harness, "eu", |status| status.ready_replicas == 6).await;
    assert_eq!((status.replicas, status.updated_replicas), (6, 6));
    assert_eq!(status.selector, "crawl.example.com/pool=eu");
    assert_eq!(status.spread.iter().map(|entry| (entry.desired, entry.ready)).collect::<Vec<_>>(), [(4, 4), (2, 2)]);
    assert_eq!(status.last_scale.as_ref().map(|last| last.reason.as_str()), Some("Created"));

    // `kubectl scale --replicas=9`: three more, keeping 2:1.
    pools(&harness)
        .patch_scale("eu", &PatchParams::default(), &Patch::Merge(json!({ "spec": { "replicas": 9 } })))
        .await
        .expect("scale to 9");
    let members = settle(
        &harness,
        "eu",
        "9 Ready members",
        |_| {},
        |members| members.len() == 9 && members.values().all(settled),
    )
    .await;
    assert_eq!(providers(&members), BTreeMap::from([("scripted".into(), 6), ("scripted-b".into(), 3)]));
    let status = wait_for_status(&harness, "eu", |status| status.ready_replicas == 9).await;
    let last = status.last_scale.expect("the scale is recorded");
    assert_eq!((last.from, last.to, last.reason.as_str()), (6, 9, "Manual"));

    // A template change that needs new instances: every member gets one, at most maxSurge (1) replacing at a
    // time and never fewer than minAvailable (2) Ready.
    let before: BTreeMap<String, String> = members
        .iter()
        .map(|(name, proxy)| (name.clone(), proxy.status.clone().unwrap().instance.unwrap().name))
        .collect();
    let mut changed = spread_spec(9);
    changed["template"]["spec"]["placement"]["machineType"] = json!("large");
    apply_pool(&harness, "eu", changed).await;
    let (mut fewest_ready, mut most_replacing) = (usize::MAX, 0);
    let rolled = settle(
        &harness,
        "eu",
        "every member on the new template",
        |members| {
            fewest_ready = fewest_ready.min(members.values().filter(|proxy| ready(proxy)).count());
            let replacing = members
                .values()
                .filter(|proxy| {
                    let status = proxy.status.clone().unwrap_or_default();
                    status.previous_instance.is_some()
                        || status.instance.is_some_and(|instance| instance.spec_hash != proxy.desired_spec_hash())
                })
                .count();
            most_replacing = most_replacing.max(replacing);
        },
        |members| {
            members.len() == 9
                && members.values().all(|proxy| {
                    settled(proxy)
                        && proxy.spec.placement.as_ref().and_then(|p| p.machine_type.as_deref()) == Some("large")
                })
        },
    )
    .await;
    for (name, proxy) in &rolled {
        let instance = proxy.status.clone().unwrap().instance.unwrap().name;
        assert_ne!(Some(&instance), before.get(name), "{name} has a new instance");
    }
    assert!(fewest_ready >= 2, "Ready members never fell below minAvailable: fewest {fewest_ready}");
    assert!(most_replacing <= 1, "at most maxSurge members replaced at once: {most_replacing}");

    // Down to 3: 2 + 1.
    pools(&harness)
        .patch_scale("eu", &PatchParams::default(), &Patch::Merge(json!({ "spec": { "replicas": 3 } })))
        .await
        .expect("scale to 3");
    let members =
        settle(&harness, "eu", "3 members", |_| {}, |members| members.len() == 3 && members.values().all(settled))
            .await;
    assert_eq!(providers(&members), BTreeMap::from([("scripted".into(), 2), ("scripted-b".into(), 1)]));

    let reasons: Vec<String> = pool_events(&harness, "eu").await.into_iter().map(|(reason, _)| reason).collect();
    for expected in ["MembersCreated", "Scaled", "RollingMembers", "MembersDeleted"] {
        assert!(reasons.iter().any(|reason| reason == expected), "an Event {expected}: {reasons:?}");
    }
}

async fn wait_for_status(
    harness: &Harness,
    pool: &str,
    done: impl Fn(&egress_api::ProxyPoolStatus) -> bool,
) -> egress_api::ProxyPoolStatus {
    eventually_every("the pool's status", SETTLE, LOOK, || async {
        harness.report_health().await;
        let status = pools(harness).get(pool).await.expect("get pool").status.unwrap_or_default();
        if done(&status) { Ok(status) } else { Err(format!("{status:?}")) }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_leaves_proxies_it_does_not_own_and_goes_with_its_members() {
    let harness = Harness::new("pool-foreign").await;
    let _pools = PoolController::start(&harness, Arc::new(NoSignals));
    // eu-0 carries the pool's label but no owner; eu-1 has the name only. Neither is the pool's.
    let mut labelled = Proxy::new("eu-0", managed("z"));
    labelled.metadata.labels = Some([(POOL_LABEL.to_owned(), "eu".to_owned())].into());
    harness.proxies().create(&PostParams::default(), &labelled).await.expect("create eu-0");
    harness.proxies().create(&PostParams::default(), &Proxy::new("eu-1", managed("z"))).await.expect("create eu-1");
    let foreign_before: Vec<Proxy> =
        vec![harness.proxies().get("eu-0").await.expect("eu-0"), harness.proxies().get("eu-1").await.expect("eu-1")];

    apply_pool(&harness, "eu", json!({ "replicas": 2, "template": { "spec": { "provider": "scripted" } } })).await;
    let owned = eventually_every("2 owned, settled members", SETTLE, LOOK, || async {
        harness.report_health().await;
        let all = harness.proxies().list(&ListParams::default()).await.expect("list").items;
        let owned: Vec<Proxy> = all.into_iter().filter(|proxy| !proxy.owner_references().is_empty()).collect();
        if owned.len() == 2 && owned.iter().all(settled) {
            return Ok(owned);
        }
        Err(format!("owned {:?}", owned.iter().map(|p| p.name_any()).collect::<Vec<_>>()))
    })
    .await;
    let mut names: Vec<String> = owned.iter().map(|proxy| proxy.name_any()).collect();
    names.sort();
    assert_eq!(names, ["eu-2", "eu-3"], "the names others hold are skipped");
    for before in &foreign_before {
        let after = harness.proxies().get(&before.name_any()).await.expect("a foreign Proxy stays");
        assert_eq!(after.spec, before.spec, "{} untouched", before.name_any());
        assert_eq!(after.labels(), before.labels(), "{} untouched", before.name_any());
        assert!(after.owner_references().is_empty());
    }
    let reasons: Vec<String> = pool_events(&harness, "eu").await.into_iter().map(|(reason, _)| reason).collect();
    assert!(reasons.iter().any(|reason| reason == "MemberNameTaken"), "{reasons:?}");

    // Deleting the pool deletes its members (the garbage collector follows the owner references), and their
    // instances with them; the foreign Proxies stay.
    pools(&harness).delete("eu", &DeleteParams::default()).await.expect("delete the pool");
    eventually_every("the members to go with the pool", SETTLE, LOOK, || async {
        let all = harness.proxies().list(&ListParams::default()).await.expect("list").items;
        let names: Vec<String> = all.iter().map(|proxy| proxy.name_any()).collect();
        if names == ["eu-0", "eu-1"] { Ok(()) } else { Err(format!("Proxies {names:?}")) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recycling_gives_each_member_a_new_instance_one_at_a_time() {
    let harness = Harness::new("pool-recycle").await;
    let _pools = PoolController::start(&harness, Arc::new(NoSignals));
    let spec = json!({
        "replicas": 3,
        "template": { "spec": { "provider": "scripted" } },
        "recycle": { "maxAge": "20s", "jitterPercent": 0, "maxSurge": 1, "minAvailable": 2 },
    });
    apply_pool(&harness, "eu", spec).await;
    let first = settle(
        &harness,
        "eu",
        "3 Ready members",
        |_| {},
        |members| members.len() == 3 && members.values().all(settled),
    )
    .await;
    let first_instances: BTreeMap<String, String> = first
        .iter()
        .map(|(name, proxy)| (name.clone(), proxy.status.clone().unwrap().instance.unwrap().name))
        .collect();
    let (mut fewest_ready, mut most_replacing) = (usize::MAX, 0);
    settle(
        &harness,
        "eu",
        "every member recycled once",
        |members| {
            fewest_ready = fewest_ready.min(members.values().filter(|proxy| ready(proxy)).count());
            most_replacing = most_replacing.max(members.values().filter(|proxy| !settled(proxy)).count());
        },
        |members| {
            members.len() == 3
                && members.iter().all(|(name, proxy)| {
                    settled(proxy)
                        && proxy.status.clone().unwrap().instance.unwrap().name != first_instances[name]
                        && proxy.annotations().get(egress_api::annotations::ROTATE).is_some()
                })
        },
    )
    .await;
    assert!(fewest_ready >= 2, "recycling kept minAvailable: fewest Ready {fewest_ready}");
    assert!(most_replacing <= 1, "one member at a time: {most_replacing}");
    let reasons: Vec<String> = pool_events(&harness, "eu").await.into_iter().map(|(reason, _)| reason).collect();
    assert!(reasons.iter().any(|reason| reason == "RecyclingMembers"), "{reasons:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_pool_scales_to_zero_and_a_lease_request_wakes_it() {
    let harness = Harness::new("pool-autoscale").await;
    let signals = Arc::new(TestSignals::default());
    // A lease on eu-0 from the start keeps the pool busy: idleness must not begin while its members come up.
    let namespace = harness.ns.name().to_owned();
    signals.leases.lock().unwrap().insert(ProxyId::new(&namespace, "eu-0"), 1);
    let pools_controller = PoolController::start(&harness, signals.clone());
    let spec = json!({
        "replicas": 2,
        "template": { "spec": { "provider": "scripted" } },
        "autoscale": { "min": 0, "max": 3, "idleSeconds": 4, "stabilizationSeconds": 0 },
    });
    apply_pool(&harness, "eu", spec).await;
    settle(&harness, "eu", "2 Ready members", |_| {}, |members| members.len() == 2 && members.values().all(settled))
        .await;
    let status = wait_for_status(&harness, "eu", |status| status.leased_replicas == 1).await;
    assert_eq!(status.replicas, 2, "a leased pool is not idle");

    // Released: 4 s later the pool goes to zero. Had idleness counted from before the lease (the pool's creation,
    // or its first pass), it would go sooner than 4 s after the release.
    let released = Instant::now();
    signals.leases.lock().unwrap().clear();
    settle(&harness, "eu", "no members", |_| {}, BTreeMap::is_empty).await;
    let took = released.elapsed();
    assert!(took >= Duration::from_secs(4), "not before idleSeconds: {took:?}");
    let status = wait_for_status(&harness, "eu", |status| status.replicas == 0).await;
    let last = status.last_scale.clone().expect("recorded");
    assert_eq!((last.from, last.to, last.reason.as_str()), (2, 0, "Idle"));
    assert!(status.conditions.iter().any(|c| c.type_ == "Available" && c.reason == "ScaledToZero"), "{status:?}");
    assert!(harness.provider.live().is_empty(), "no instance is left");

    // A lease asked for at zero wakes it.
    signals.demand.lock().unwrap().woken = Some(SystemTime::now());
    settle(&harness, "eu", "woken", |_| {}, |members| members.len() == 1 && members.values().all(settled)).await;
    let status = wait_for_status(&harness, "eu", |status| status.ready_replicas == 1).await;
    assert_eq!(status.last_scale.map(|last| last.reason), Some("Wake".into()));

    // Every member at its cap and a refusal: one more.
    signals.leases.lock().unwrap().insert(ProxyId::new(&namespace, "eu-0"), 5);
    signals.demand.lock().unwrap().at_capacity = Some(SystemTime::now());
    settle(
        &harness,
        "eu",
        "scaled for capacity",
        |_| {},
        |members| members.len() == 2 && members.values().all(settled),
    )
    .await;
    let reasons: Vec<(String, String)> = pool_events(&harness, "eu").await;
    for (reason, note) in [("ScaledDown", "(Idle)"), ("ScaledUp", "(Wake)"), ("ScaledUp", "(AtCapacity)")] {
        assert!(reasons.iter().any(|(r, n)| r == reason && n.contains(note)), "an Event {reason} {note}: {reasons:?}");
    }
    for reason in ["Idle", "Wake", "AtCapacity"] {
        assert_eq!(pools_controller.metrics.decisions(reason), 1, "{reason}");
    }
}

/// A member that fails for good (its spread entry names a provider the operator does not have) shows on the pool as
/// `Progressing=False MemberFailed`, with the member's name and reason, instead of members coming up for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_member_shows_on_the_pool_with_its_reason() {
    let harness = Harness::new("pool-failed-member").await;
    let _pools_controller = PoolController::start(&harness, Arc::new(NoSignals));
    let spec = json!({
        "replicas": 2,
        "template": { "spec": {} },
        "spread": [{ "provider": "scripted", "weight": 1 }, { "provider": "nowhere", "weight": 1 }],
    });
    apply_pool(&harness, "mixed", spec).await;
    let status = wait_for_status(&harness, "mixed", |status| {
        status.conditions.iter().any(|condition| condition.type_ == "Progressing" && condition.reason == "MemberFailed")
    })
    .await;
    let progressing = status.conditions.iter().find(|condition| condition.type_ == "Progressing").expect("Progressing");
    assert_eq!(progressing.status, "False");
    let members = members(&harness, "mixed").await;
    let failed = members
        .values()
        .find(|proxy| proxy.spec.provider.as_deref() == Some("nowhere"))
        .expect("the member on the missing provider");
    let failure = failed.status.clone().unwrap_or_default().failure.expect("the member's failure");
    assert_eq!(
        progressing.message,
        format!("member {} failed ({}: {})", failed.name_any(), failure.reason, failure.message)
    );
}

/// Status writes to pools annotated with this are refused by a ValidatingAdmissionPolicy while it exists.
const DENY_STATUS: &str = "test.egress/deny-status";

/// A ValidatingAdmissionPolicy (and its binding) refusing status writes to pools annotated [`DENY_STATUS`]: the
/// apiserver refusing the status write that follows a scale, as an admission webhook or a timeout would.
async fn deny_pool_status_writes(harness: &Harness, name: &str) -> (Api<DynamicObject>, Api<DynamicObject>) {
    let client = harness.ns.client();
    let resource = |kind: &str, plural: &str| {
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", kind), plural)
    };
    let policies: Api<DynamicObject> =
        Api::all_with(client.clone(), &resource("ValidatingAdmissionPolicy", "validatingadmissionpolicies"));
    let bindings: Api<DynamicObject> =
        Api::all_with(client, &resource("ValidatingAdmissionPolicyBinding", "validatingadmissionpolicybindings"));
    let expression = format!("!has(object.metadata.annotations) || !('{DENY_STATUS}' in object.metadata.annotations)");
    let policy = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": { "name": name },
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": { "resourceRules": [{
                "apiGroups": ["crawl.example.com"], "apiVersions": ["*"], "operations": ["UPDATE"],
                "resources": ["proxypools/status"],
            }] },
            "validations": [{ "expression": expression, "message": "status writes are refused for this test" }],
        },
    });
    let binding = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": { "name": name },
        "spec": { "policyName": name, "validationActions": ["Deny"] },
    });
    let params = PatchParams::apply("pool-tests").force();
    policies.patch(name, &params, &Patch::Apply(&policy)).await.expect("apply the policy");
    bindings.patch(name, &params, &Patch::Apply(&binding)).await.expect("apply the binding");
    (policies, bindings)
}

/// A scale the autoscaler wrote stays its own when the status write after it is refused: the passes that follow
/// (on a copy showing the new spec.replicas but the old status, or an older copy) neither take it for a manual
/// change nor scale again, and the status names it once writes go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_status_write_after_a_scale_neither_repeats_it_nor_calls_it_manual() {
    let harness = Harness::new("pool-status-refused").await;
    let signals = Arc::new(TestSignals::default());
    let namespace = harness.ns.name().to_owned();
    // One of two members leased: at the target share, so neither more nor fewer are wanted.
    signals.leases.lock().unwrap().insert(ProxyId::new(&namespace, "cap-0"), 1);
    let pools_controller = PoolController::start(&harness, signals.clone());
    let spec = json!({
        "replicas": 2,
        "template": { "spec": { "provider": "scripted" } },
        "autoscale": {
            "min": 0, "max": 3, "idleSeconds": 3600, "stabilizationSeconds": 3600, "targetLeasedPercent": 50,
        },
    });
    apply_pool(&harness, "cap", spec).await;
    settle(&harness, "cap", "2 Ready members", |_| {}, |members| members.len() == 2 && members.values().all(settled))
        .await;
    wait_for_status(&harness, "cap", |status| status.ready_replicas == 2).await;

    // Status writes refused from now on: a dry-run write says when the policy is in force.
    let name = format!("deny-pool-status-{namespace}");
    let (policies, bindings) = deny_pool_status_writes(&harness, &name).await;
    let annotate = |value: Value| {
        let pools = pools(&harness);
        async move {
            let body = json!({ "metadata": { "annotations": { DENY_STATUS: value } } });
            pools.patch("cap", &PatchParams::default(), &Patch::Merge(&body)).await.expect("annotate the pool");
        }
    };
    annotate(json!("true")).await;
    eventually_every("the policy to refuse status writes", SETTLE, LOOK, || async {
        let probe = json!({ "status": { "observedGeneration": 999_999 } });
        let params = PatchParams { dry_run: true, ..PatchParams::default() };
        match pools(&harness).patch_status("cap", &params, &Patch::Merge(&probe)).await {
            Err(kube::Error::Api(status)) if status.code == 422 || status.code == 403 || status.code == 400 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    // A member at its cap and a refusal: the autoscaler scales to 3; its status write is refused pass after pass.
    let errors_before = pools_controller.metrics.reconciles(false);
    signals.leases.lock().unwrap().insert(ProxyId::new(&namespace, "cap-0"), 5);
    signals.demand.lock().unwrap().at_capacity = Some(SystemTime::now());
    settle(&harness, "cap", "3 Ready members", |_| {}, |members| members.len() == 3 && members.values().all(settled))
        .await;
    eventually_every("three refused passes", SETTLE, LOOK, || async {
        let errors = pools_controller.metrics.reconciles(false) - errors_before;
        if errors >= 3 { Ok(()) } else { Err(format!("{errors} refused passes")) }
    })
    .await;
    let events = pool_events(&harness, "cap").await;
    assert_eq!(pools(&harness).get("cap").await.expect("get pool").spec.replicas, 3, "{events:?}");
    assert_eq!(pools_controller.metrics.decisions("AtCapacity"), 1, "scaled once");
    assert_eq!(pools_controller.metrics.decisions("Manual"), 0, "its own scale is not a manual one");

    // Writes go through again: the status names the autoscaler's decision.
    annotate(Value::Null).await;
    let status = wait_for_status(&harness, "cap", |status| status.replicas == 3 && status.ready_replicas == 3).await;
    let last = status.last_scale.expect("recorded");
    assert_eq!((last.from, last.to, last.reason.as_str()), (2, 3, "AtCapacity"));
    assert_eq!(pools_controller.metrics.decisions("AtCapacity"), 1, "scaled once");
    assert_eq!(pools_controller.metrics.decisions("Manual"), 0, "its own scale is not a manual one");
    let reasons: Vec<String> = pool_events(&harness, "cap").await.into_iter().map(|(reason, _)| reason).collect();
    assert_eq!(reasons.iter().filter(|reason| *reason == "ScaledUp").count(), 1, "{reasons:?}");
    assert!(!reasons.iter().any(|reason| reason == "Scaled"), "no manual scale reported: {reasons:?}");
    let _ = bindings.delete(&name, &DeleteParams::default()).await;
    let _ = policies.delete(&name, &DeleteParams::default()).await;
}

/// What the crash test asks of one pool.
#[derive(Clone, Debug)]
struct Wanted {
    replicas: usize,
    machine: String,
}

fn crash_pool_spec(wanted: &Wanted, spread: bool) -> Value {
    let mut spec = json!({
        "replicas": wanted.replicas,
        "template": { "spec": { "placement": { "machineType": wanted.machine } } },
        "recycle": { "maxSurge": 2 },
    });
    if spread {
        spec["spread"] = json!([{ "provider": "scripted", "weight": 2 }, { "provider": "scripted-b", "weight": 1 }]);
    } else {
        spec["template"]["spec"]["provider"] = json!("scripted");
    }
    spec
}

/// What is wrong with the pools now, or nothing: every wanted pool has exactly its count of owned, settled members
/// on its template, and no Proxy is left of a pool that is gone.
async fn pool_violations(harness: &Harness, wanted: &BTreeMap<String, Wanted>) -> Vec<String> {
    let mut problems = support::violations(harness).await;
    let pools_now: BTreeMap<String, ProxyPool> = pools(harness)
        .list(&ListParams::default())
        .await
        .expect("list pools")
        .items
        .into_iter()
        .map(|p| (p.name_any(), p))
        .collect();
    let proxies = harness.proxies().list(&ListParams::default()).await.expect("list Proxies").items;
    for (name, want) in wanted {
        let Some(pool) = pools_now.get(name) else {
            problems.push(format!("pool {name} is missing"));
            continue;
        };
        let members: Vec<&Proxy> = proxies
            .iter()
            .filter(|proxy| proxy.owner_references().iter().any(|owner| Some(&owner.uid) == pool.metadata.uid.as_ref()))
            .collect();
        if members.len() != want.replicas {
            problems.push(format!("pool {name} has {} members, not {}", members.len(), want.replicas));
        }
        for member in members {
            let machine = member.spec.placement.as_ref().and_then(|placement| placement.machine_type.as_deref());
            if !settled(member) || machine != Some(want.machine.as_str()) {
                problems.push(format!("{} is not settled on machine {}", member.name_any(), want.machine));
            }
        }
    }
    for proxy in &proxies {
        let owner = proxy.owner_references().first().map(|owner| owner.uid.clone());
        let alive = pools_now.values().any(|pool| pool.metadata.uid == owner);
        if !alive || !wanted.contains_key(proxy.labels().get(POOL_LABEL).map_or("", String::as_str)) {
            problems.push(format!("{} belongs to no wanted pool", proxy.name_any()));
        }
    }
    problems
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_pool_operations_with_killed_controllers_settle_with_exactly_the_desired_members() {
    const OPERATIONS: usize = 60;
    let seed = support::crash_seed();
    let mut rng = Rng::seeded(seed);
    let mut harness = Harness::new("pool-crash").await;
    let mut controller = PoolController::start(&harness, Arc::new(NoSignals));
    let names = ["a", "b", "c"];
    let mut wanted: BTreeMap<String, Wanted> = BTreeMap::new();
    let mut kills = 0;
    for _ in 0..OPERATIONS {
        let name = names[rng.below(names.len())];
        let spread = name == "b";
        // Each call may race the controllers or meet a missing object; either is part of the test.
        match rng.below(5) {
            0 | 1 => {
                let want = Wanted { replicas: rng.below(6), machine: format!("m{}", rng.below(3)) };
                let body = json!({ "apiVersion": "crawl.example.com/v1alpha1", "kind": "ProxyPool", "metadata": { "name": name }, "spec": crash_pool_spec(&want, spread) });
                if pools(&harness)
                    .patch(name, &PatchParams::apply("pool-tests").force(), &Patch::Apply(&body))
                    .await
                    .is_ok()
                {
                    wanted.insert(name.to_owned(), want);
                }
            }
            2 => {
                let replicas = rng.below(6);
                let patch = json!({ "spec": { "replicas": replicas } });
                if pools(&harness).patch_scale(name, &PatchParams::default(), &Patch::Merge(patch)).await.is_ok()
                    && let Some(want) = wanted.get_mut(name)
                {
                    want.replicas = replicas;
                }
            }
            3 => {
                let machine = format!("m{}", rng.below(3));
                let patch = json!({ "spec": { "template": { "spec": { "placement": { "machineType": machine } } } } });
                if pools(&harness).patch(name, &PatchParams::default(), &Patch::Merge(patch)).await.is_ok()
                    && let Some(want) = wanted.get_mut(name)
                {
                    want.machine = machine;
                }
            }
            _ => {
                if pools(&harness).delete(name, &DeleteParams::default()).await.is_ok() {
                    wanted.remove(name);
                }
            }
        }
        harness.report_health().await;
        if rng.below(5) == 0 {
            // Both controllers die at once, as the operator's process would, and come back with nothing in memory.
            drop(controller);
            harness.crash().await;
            kills += 1;
            harness.start();
            controller = PoolController::start(&harness, Arc::new(NoSignals));
        }
        tokio::time::sleep(Duration::from_millis(rng.below(300) as u64)).await;
    }
    eprintln!("{OPERATIONS} pool operations with {kills} kills; wanted {wanted:?}; letting it settle");
    drop(controller);
    harness.crash().await;
    harness.start();
    let _controller = PoolController::start(&harness, Arc::new(NoSignals));
    let what = format!("seed {seed} to settle");
    eventually_every(&what, Duration::from_secs(180), Duration::from_millis(500), || async {
        harness.report_health().await;
        let problems = pool_violations(&harness, &wanted).await;
        if problems.is_empty() { Ok(()) } else { Err(format!("{problems:#?}")) }
    })
    .await;
}
