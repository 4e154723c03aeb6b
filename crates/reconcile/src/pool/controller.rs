//! The kube `Controller` over ProxyPools: observe the members → [`decide_pool`] → act → status.
//!
//! A pool owns its members by an owner reference with `controller: true` and labels them with its name; it never
//! touches a Proxy it does not own, even one carrying its label. Member names are `<pool>-<ordinal>`, the lowest free
//! ordinals, so a create repeated after a crash meets the object the first one made (409) instead of making a second.
//! Because the store may not yet show the controller's own last writes, each pass records what it expects to see
//! (a member present, gone, or changed) and the next pass acts only once the store shows it, or after
//! [`EXPECTATION_TIMEOUT`]: a stale read never doubles a create or a delete. A restarted operator starts from a fresh
//! list, which needs no expectations.
//!
//! Deleting a pool deletes its members through the owner references (the cluster's garbage collector); each
//! member's own finalizer then deletes its instance. The pool needs no finalizer of its own.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use egress_api::pool::{CONDITION_AVAILABLE, CONDITION_PROGRESSING, POOL_LABEL, slot_of};
use egress_api::proxy::CONDITION_READY;
use egress_api::{
    Proxy, ProxyPhase, ProxyPool, ProxyPoolStatus, ProxySpec, ScalingDecision, SpreadStatus, annotations,
};
use egress_fleet::{PoolDemand, PoolId, ProxyId};
use futures::{Stream, StreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::{Action, Config as RuntimeConfig, Controller};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource, ResourceExt};
use serde_json::{Value, json};
use tracing::{Instrument, debug, info, info_span, instrument, warn};

use super::decide::{AutoscaleFacts, Demand, Member, PoolDecision, PoolFacts, Slot, decide_pool};
use super::index::{MemberIndex, pool_of};
use super::metrics::{PoolCounts, PoolMetrics};
use crate::Error;
use crate::feed::{Change, GuardedPool, GuardedProxy, PoolFeed, ProxyFeed};
use crate::ids::{pool_id, proxy_id};
use crate::status::{ConditionSpec, merge_conditions, micro_time, system_micro_time, system_time};

/// The field manager of every write the pool controller makes (members and pool status).
pub const POOL_FIELD_MANAGER: &str = "egress-operator-pool";

/// The annotation on a member listing the label keys the pool's template put there, so a label dropped from the
/// template is dropped from the members too (and a label someone else added is kept).
pub const TEMPLATE_LABELS_ANNOTATION: &str = "crawl.example.com/pool-template-labels";

/// How long a pass waits for the store to show the previous pass's writes before it acts without them.
pub const EXPECTATION_TIMEOUT: Duration = Duration::from_secs(30);
/// How soon to look again while the store does not show the previous pass's writes yet.
const EXPECTATION_RECHECK: Duration = Duration::from_secs(1);
/// How soon to look again after acting.
const AFTER_ACTING: Duration = Duration::from_secs(2);
/// How many pools are reconciled at once.
const CONCURRENCY: u16 = 4;

/// What the discovery API knows about a pool's leases: the pool controller reads it on the leader, where discovery
/// serves.
pub trait PoolSignals: Send + Sync {
    /// Active leases on `proxy`.
    fn leases_of(&self, proxy: &ProxyId) -> u32;
    /// When leases for `pool` were last refused, by reason.
    fn demand(&self, pool: &PoolId) -> PoolDemand;
}

/// Signals of a process without a discovery API: no leases, no demand. Pools then follow `spec.replicas` only.
pub struct NoSignals;

impl PoolSignals for NoSignals {
    fn leases_of(&self, _proxy: &ProxyId) -> u32 {
        0
    }
    fn demand(&self, _pool: &PoolId) -> PoolDemand {
        PoolDemand::default()
    }
}

/// A reconcile trigger: the pool to look at.
pub type PoolTrigger = ObjectRef<GuardedPool>;

/// What one pass expects the store to show before the next pass acts.
#[derive(Clone, Debug)]
enum Expectation {
    /// A member it created.
    Present(String),
    /// A member it deleted (by UID): gone, or being deleted.
    Gone { name: String, uid: String },
    /// A member it patched: a newer version than this one.
    Changed { name: String, resource_version: String },
}

/// What the controller remembers of one pool between passes (lost on restart, which is safe: a fresh list shows
/// every write, and an idle clock that starts again only delays a scale-down).
#[derive(Default)]
struct PoolMemory {
    /// Since when the pool has held no lease.
    idle_since: Option<SystemTime>,
    expected: Vec<Expectation>,
    expected_since: Option<Instant>,
    failures: u32,
    /// Ordinals whose names are taken by Proxies this pool does not own.
    foreign: BTreeSet<u32>,
    /// The last scaling decision this controller wrote, until the store's copy of the pool shows it: a pass on a
    /// copy that shows a new `spec.replicas` but not yet the status written after it would take the autoscaler's
    /// own change for somebody else's.
    scale_written: Option<(ScalingDecision, Instant)>,
    /// The last scale this controller patched into `spec.replicas`, until the stored status names it. A copy that
    /// does not show it yet is not acted on (it would scale again from the old count, and delete the member just
    /// made); a copy that shows the new count but a status without the decision (its status write was refused or
    /// lost) takes it as the last decision rather than somebody else's change.
    scale_patched: Option<(ScalingDecision, Instant)>,
}

/// Everything a pool reconcile needs.
pub struct PoolContext {
    client: Client,
    proxies: Store<GuardedProxy>,
    index: Arc<Mutex<MemberIndex>>,
    signals: Arc<dyn PoolSignals>,
    metrics: PoolMetrics,
    reporter: Reporter,
    memory: Mutex<HashMap<PoolId, PoolMemory>>,
}

impl PoolContext {
    /// A context over the operator's Proxy store, reading lease counts and demand from `signals`.
    pub fn new(client: Client, proxies: &ProxyFeed, signals: Arc<dyn PoolSignals>, metrics: PoolMetrics) -> Self {
        let reporter = Reporter { controller: "egress-operator".into(), instance: std::env::var("POD_NAME").ok() };
        Self {
            client,
            proxies: proxies.store(),
            index: Arc::default(),
            signals,
            metrics,
            reporter,
            memory: Mutex::default(),
        }
    }

    /// The metrics this context records into.
    pub fn metrics(&self) -> &PoolMetrics {
        &self.metrics
    }

    async fn publish(&self, pool: &ProxyPool, warning: bool, reason: &str, note: String) {
        let event = KubeEvent {
            type_: if warning { EventType::Warning } else { EventType::Normal },
            reason: reason.to_owned(),
            note: Some(note),
            action: "Reconcile".into(),
            secondary: None,
        };
        let recorder = Recorder::new(self.client.clone(), self.reporter.clone());
        if let Err(error) = recorder.publish(&event, &pool.object_ref(&())).await {
            warn!(%error, reason, "publishing an Event failed");
        }
    }

    fn with_memory<T>(&self, key: &PoolId, change: impl FnOnce(&mut PoolMemory) -> T) -> T {
        change(self.memory.lock().expect("pool memory").entry(key.clone()).or_default())
    }

    /// Whether the store shows what the last pass expected (or it waited long enough); clears the expectations
    /// when it does.
    fn expectations_met(&self, key: &PoolId, namespace: &str) -> bool {
        let store = &self.proxies;
        self.with_memory(key, |memory| {
            let met = memory.expected.iter().all(|expected| {
                let lookup = |name: &str| store.get(&ObjectRef::new(name).within(namespace));
                match expected {
                    Expectation::Present(name) => lookup(name).is_some(),
                    Expectation::Gone { name, uid } => lookup(name).is_none_or(|object| {
                        object.meta().uid.as_deref() != Some(uid) || object.meta().deletion_timestamp.is_some()
                    }),
                    Expectation::Changed { name, resource_version } => lookup(name)
                        .is_none_or(|object| object.meta().resource_version.as_deref() != Some(resource_version)),
                }
            });
            let timed_out = memory.expected_since.is_some_and(|since| since.elapsed() >= EXPECTATION_TIMEOUT);
            if timed_out && !met {
                warn!(pool = %key, "the store did not show the pool's last writes in time; acting on what it shows");
            }
            if met || timed_out {
                memory.expected.clear();
                memory.expected_since = None;
            }
            met || timed_out
        })
    }

    /// Whether the pool as stored shows the last scaling decision this controller wrote (or it waited long enough).
    fn shows_last_scale(&self, key: &PoolId, pool: &ProxyPool) -> bool {
        let stored = pool.status.as_ref().and_then(|status| status.last_scale.as_ref());
        self.with_memory(key, |memory| {
            if let Some((written, since)) = &memory.scale_written {
                if stored != Some(written) && since.elapsed() < EXPECTATION_TIMEOUT {
                    return false;
                }
                memory.scale_written = None;
            }
            if let Some((patched, since)) = &memory.scale_patched {
                if stored == Some(patched) || since.elapsed() >= EXPECTATION_TIMEOUT {
                    memory.scale_patched = None;
                } else if pool.spec.replicas != patched.to {
                    return false;
                }
            }
            true
        })
    }

    /// The scale this controller patched whose decision the stored status does not name yet, when `pool` shows it.
    fn pending_scale(&self, key: &PoolId, pool: &ProxyPool) -> Option<ScalingDecision> {
        self.with_memory(key, |memory| {
            memory
                .scale_patched
                .as_ref()
                .map(|(patched, _)| patched.clone())
                .filter(|patched| patched.to == pool.spec.replicas)
        })
    }

    fn expect(&self, key: &PoolId, expected: Vec<Expectation>) {
        if expected.is_empty() {
            return;
        }
        self.with_memory(key, |memory| {
            memory.expected.extend(expected);
            memory.expected_since.get_or_insert_with(Instant::now);
        });
    }
}

/// Runs the pool controller until `shutdown` resolves; in-flight reconciles finish first.
///
/// Pools are woken by their own changes, by changes to the Proxies labelled for them (through a [`MemberIndex`]
/// kept from the Proxy feed), and by `wakes` (the discovery API's demand).
pub async fn run_pools(
    context: Arc<PoolContext>,
    pools: PoolFeed,
    proxies: ProxyFeed,
    wakes: impl Stream<Item = PoolTrigger> + Send + 'static,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let shutdown = futures::FutureExt::shared(shutdown);
    let ready = tokio::select! {
        ready = async { pools.ready().await && proxies.ready().await } => ready,
        () = shutdown.clone() => return,
    };
    if !ready {
        warn!("the ProxyPool or Proxy watch ended before its first list; the pool controller does not start");
        return;
    }
    let (member_sender, member_triggers) = tokio::sync::mpsc::unbounded_channel::<PoolTrigger>();
    let index = context.index.clone();
    let store = proxies.store();
    let changes = proxies.subscribe();
    let indexer = tokio::spawn(
        async move {
            futures::pin_mut!(changes);
            while let Some(change) = changes.next().await {
                let touched = {
                    let mut index = index.lock().expect("member index");
                    match change {
                        Change::Object(reference) => {
                            let pool = store.get(&reference).and_then(|object| pool_of(&object));
                            index.set(&reference, pool)
                        }
                        Change::Resync => {
                            let all = store.state();
                            index.rebuild(all.iter().map(AsRef::as_ref));
                            index.pools()
                        }
                    }
                };
                for pool in touched {
                    if member_sender.send(pool).is_err() {
                        return;
                    }
                }
            }
        }
        .instrument(info_span!("pool_member_index")),
    );
    let pool_store = pools.store();
    let pool_changes = pools.subscribe().flat_map(move |change| {
        let objects = match change {
            Change::Object(reference) => pool_store.get(&reference).into_iter().collect(),
            Change::Resync => pool_store.state(),
        };
        futures::stream::iter(objects)
    });
    let member_triggers = futures::stream::unfold(member_triggers, |mut receiver| async move {
        receiver.recv().await.map(|item| (item, receiver))
    });
    Controller::for_shared_stream(pool_changes, pools.store())
        .with_config(RuntimeConfig::default().concurrency(CONCURRENCY))
        .reconcile_on(futures::stream::select(member_triggers, wakes))
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, context)
        .for_each(|result| async move {
            if let Err(error) = result {
                debug!(%error, "pool controller event");
            }
        })
        .instrument(info_span!("pool_controller"))
        .await;
    indexer.abort();
}

fn error_policy(object: Arc<GuardedPool>, error: &Error, context: Arc<PoolContext>) -> Action {
    let key = pool_id(object.as_ref());
    let failures = context.with_memory(&key, |memory| {
        memory.failures = memory.failures.saturating_add(1);
        memory.failures
    });
    let backoff = crate::backoff::RECONCILE_ERRORS.after(failures);
    context.metrics.reconciled(false);
    warn!(pool = %key, kind = error.kind(), %error, failures, backoff_secs = backoff.as_secs(), "pool reconcile failed");
    Action::requeue(backoff)
}

#[instrument(skip(object, context), fields(pool = %object.name_any(), namespace = object.namespace().unwrap_or_default()))]
async fn reconcile(object: Arc<GuardedPool>, context: Arc<PoolContext>) -> Result<Action, Error> {
    let pool = match &object.0 {
        Ok(pool) => pool,
        Err(invalid) => {
            warn!(error = %invalid.error, "skipping a ProxyPool that cannot be read");
            return Ok(Action::await_change());
        }
    };
    let namespace = pool.namespace().unwrap_or_default();
    let key = pool_id(pool);
    if pool.metadata.deletion_timestamp.is_some() {
        // The garbage collector deletes the members through their owner references.
        context.metrics.forget(&key);
        context.memory.lock().expect("pool memory").remove(&key);
        return Ok(Action::await_change());
    }
    if !context.expectations_met(&key, &namespace) || !context.shows_last_scale(&key, pool) {
        return Ok(Action::requeue(EXPECTATION_RECHECK));
    }
    let next = apply(pool, &key, &namespace, &context).await?;
    context.with_memory(&key, |memory| memory.failures = 0);
    context.metrics.reconciled(true);
    Ok(Action::requeue(next))
}

/// The members this pool owns (labelled for it and controlled by its UID), and the ordinals other Proxies
/// labelled for it take.
fn members(pool: &ProxyPool, namespace: &str, context: &PoolContext) -> (Vec<Arc<Proxy>>, BTreeSet<u32>) {
    let reference: ObjectRef<GuardedPool> = ObjectRef::new(&pool.name_any()).within(namespace);
    let names = context.index.lock().expect("member index").members_of(&reference);
    let uid = pool.metadata.uid.as_deref();
    let mut owned = Vec::new();
    let mut foreign = BTreeSet::new();
    for name in names {
        let Some(object) = context.proxies.get(&ObjectRef::new(&name).within(namespace)) else { continue };
        let controlled = object.meta().owner_references.iter().flatten().any(|owner| {
            owner.controller == Some(true) && Some(owner.uid.as_str()) == uid && owner.kind == "ProxyPool"
        });
        match (&object.0, controlled) {
            (Ok(proxy), true) => owned.push(Arc::new(proxy.clone())),
            _ => {
                if let Some(ordinal) = ordinal_of(&pool.name_any(), &name) {
                    foreign.insert(ordinal);
                }
            }
        }
    }
    (owned, foreign)
}

/// The ordinal in a member name `<pool>-<ordinal>`, in its canonical spelling only (`eu-01` has none).
pub fn ordinal_of(pool: &str, name: &str) -> Option<u32> {
    let suffix = name.strip_prefix(pool)?.strip_prefix('-')?;
    let ordinal: u32 = suffix.parse().ok()?;
    (ordinal.to_string() == suffix).then_some(ordinal)
}

/// `recycle.maxAge` shortened by up to `jitterPercent`, by an amount fixed per member.
fn jittered_max_age(pool: &ProxyPool, member: &Proxy) -> Option<Duration> {
    let max_age = pool.spec.recycle_max_age()?;
    let jitter = pool.spec.recycle.as_ref().map_or(0, |recycle| recycle.jitter_percent.clamp(0, 50));
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    member.metadata.uid.hash(&mut hasher);
    member.metadata.name.hash(&mut hasher);
    let fraction = (hasher.finish() % 10_000) as f64 / 10_000.0;
    Some(max_age.mul_f64(1.0 - f64::from(jitter) / 100.0 * fraction))
}

fn is_ready(proxy: &Proxy) -> bool {
    proxy.status.as_ref().is_some_and(|status| {
        status.conditions.iter().any(|condition| condition.type_ == CONDITION_READY && condition.status == "True")
    })
}

/// Whether the member is getting a new instance: it records one of another spec hash than it wants (on its
/// provider's fingerprint as the instance recorded it: a change of the provider's policy shows once the member's
/// controller starts the new instance), or is still draining the one it replaced.
fn is_replacing(proxy: &Proxy) -> bool {
    proxy.status.as_ref().is_some_and(|status| {
        status.previous_instance.is_some()
            || status.instance.as_ref().is_some_and(|instance| {
                instance.spec_hash != proxy.desired_spec_hash_with(instance.provider_fingerprint.as_deref())
            })
    })
}

/// The member spec one spread entry asks for, and the provider and zone that tell its members apart.
struct SlotSpec {
    spec: ProxySpec,
    provider: Option<String>,
    zone: Option<String>,
}

impl SlotSpec {
    /// Whether a member with `spec` runs where this entry asks.
    fn holds(&self, spec: &ProxySpec) -> bool {
        let (provider, zone) = slot_of(spec);
        self.provider.as_deref() == provider && self.zone.as_deref() == zone
    }
}

/// The member spec each spread entry asks for.
fn slot_specs(pool: &ProxyPool) -> Vec<SlotSpec> {
    pool.spec
        .slots()
        .iter()
        .map(|slot| {
            let spec = pool.spec.member_spec(slot);
            let (provider, zone) = slot_of(&spec);
            let (provider, zone) = (provider.map(str::to_owned), zone.map(str::to_owned));
            SlotSpec { spec, provider, zone }
        })
        .collect()
}

async fn apply(pool: &ProxyPool, key: &PoolId, namespace: &str, context: &PoolContext) -> Result<Duration, Error> {
    let now = SystemTime::now();
    let name = pool.name_any();
    let (owned, foreign) = members(pool, namespace, context);
    let slots = slot_specs(pool);
    let spread = pool.spec.slots();

    let member_facts: Vec<Member> = owned
        .iter()
        .map(|proxy| {
            let slot = slots.iter().position(|slot| slot.holds(&proxy.spec));
            let current = slot.is_some_and(|slot| {
                egress_api::spec_hash(&proxy.spec, None) == egress_api::spec_hash(&slots[slot].spec, None)
            });
            let status = proxy.status.as_ref();
            let born = status
                .and_then(|status| status.instance.as_ref())
                .and_then(|instance| instance.created_at.as_ref())
                .or(proxy.metadata.creation_timestamp.as_ref())
                .map_or(now, system_time);
            Member {
                name: proxy.name_any(),
                ordinal: ordinal_of(&name, &proxy.name_any()),
                slot,
                current,
                ready: is_ready(proxy),
                replacing: is_replacing(proxy),
                leases: context.signals.leases_of(&proxy_id(proxy.as_ref())),
                born,
                max_age: jittered_max_age(pool, proxy),
                deleting: proxy.metadata.deletion_timestamp.is_some(),
            }
        })
        .collect();
    // Ordinals taken by Proxies this pool does not own count as members that are being deleted: their names are
    // not free.
    let mut facts_members = member_facts.clone();
    let known_foreign = context.with_memory(key, |memory| {
        memory.foreign.extend(foreign.iter().copied());
        memory.foreign.clone()
    });
    for ordinal in known_foreign {
        if facts_members.iter().all(|member| member.ordinal != Some(ordinal)) {
            facts_members.push(Member {
                name: format!("{name}-{ordinal}"),
                ordinal: Some(ordinal),
                slot: None,
                current: false,
                ready: false,
                replacing: false,
                leases: 0,
                born: now,
                max_age: None,
                deleting: true,
            });
        }
    }

    let total_leases: u32 = member_facts.iter().filter(|member| !member.deleting).map(|member| member.leases).sum();
    let idle_since = context.with_memory(key, |memory| {
        if total_leases > 0 {
            memory.idle_since = None;
        } else if memory.idle_since.is_none() {
            memory.idle_since = Some(now);
        }
        memory.idle_since
    });
    let demand = context.signals.demand(key);
    let status = pool.status.clone().unwrap_or_default();
    let replicas = pool.spec.replicas.max(0).unsigned_abs();

    // The last scaling decision: recorded at creation, and noticed when somebody else moved spec.replicas.
    let mut last_scale = context.pending_scale(key, pool).or_else(|| status.last_scale.clone());
    match &last_scale {
        None => {
            last_scale = Some(ScalingDecision {
                time: micro_time(now),
                from: 0,
                to: pool.spec.replicas,
                reason: "Created".into(),
                message: format!("the pool was created with {} replicas", pool.spec.replicas),
            });
            context.metrics.decision("Created");
        }
        Some(last) if last.to != pool.spec.replicas => {
            let decision = ScalingDecision {
                time: micro_time(now),
                from: last.to,
                to: pool.spec.replicas,
                reason: "Manual".into(),
                message: format!("spec.replicas was set from {} to {}", last.to, pool.spec.replicas),
            };
            context.metrics.decision("Manual");
            context
                .publish(
                    pool,
                    false,
                    "Scaled",
                    format!("scaled from {} to {}: {}", decision.from, decision.to, decision.message),
                )
                .await;
            last_scale = Some(decision);
        }
        Some(_) => {}
    }

    let recycle = pool.spec.recycle.clone().unwrap_or_default();
    let facts = PoolFacts {
        replicas,
        slots: spread.iter().map(|entry| Slot { weight: entry.weight.max(1).unsigned_abs() }).collect(),
        members: facts_members,
        max_surge: recycle.max_surge.max(1).unsigned_abs(),
        min_available: recycle.min_available.unwrap_or(0).max(0).unsigned_abs(),
        autoscale: pool.spec.autoscale.as_ref().map(|autoscale| AutoscaleFacts {
            min: autoscale.min.max(0).unsigned_abs(),
            max: autoscale.max.max(0).unsigned_abs(),
            target_leased_percent: autoscale.target_leased_percent.clamp(1, 100).unsigned_abs(),
            idle: Duration::from_secs(autoscale.idle_seconds.max(1).unsigned_abs().into()),
            scale_up_step: autoscale.scale_up_step.max(1).unsigned_abs(),
            scale_down_step: autoscale.scale_down_step.max(1).unsigned_abs(),
            stabilization: Duration::from_secs(autoscale.stabilization_seconds.max(0).unsigned_abs().into()),
        }),
        demand: Demand {
            at_capacity: demand.at_capacity,
            none_healthy: demand.none_healthy,
            woken: demand.woken,
            idle_since,
        },
        last_scale: last_scale.as_ref().map(|last| system_micro_time(&last.time)),
        now,
    };
    let decision = decide_pool(&facts);
    debug!(?decision, "pool decision");

    let pools: Api<ProxyPool> = Api::namespaced(context.client.clone(), namespace);
    if let Some(scale) = &decision.scale {
        let to = i32::try_from(scale.to).unwrap_or(i32::MAX);
        pools.patch_scale(&name, &PatchParams::default(), &Patch::Merge(json!({ "spec": { "replicas": to } }))).await?;
        let decided = ScalingDecision {
            time: micro_time(now),
            from: i32::try_from(scale.from).unwrap_or(i32::MAX),
            to,
            reason: scale.reason.as_str().into(),
            message: scale.message.clone(),
        };
        context.with_memory(key, |memory| memory.scale_patched = Some((decided.clone(), Instant::now())));
        let direction = if scale.to > scale.from { "ScaledUp" } else { "ScaledDown" };
        info!(from = scale.from, to = scale.to, reason = scale.reason.as_str(), "scaling the pool");
        context.metrics.decision(scale.reason.as_str());
        context
            .publish(
                pool,
                false,
                direction,
                format!("scaled from {} to {} ({}): {}", scale.from, scale.to, scale.reason.as_str(), scale.message),
            )
            .await;
        last_scale = Some(decided);
    }

    let acted = act(pool, namespace, &owned, &slots, &decision, context).await?;
    context.expect(key, acted.expected);
    if !acted.taken.is_empty() {
        context.with_memory(key, |memory| memory.foreign.extend(acted.taken.iter().copied()));
    }

    // Status.
    let live: Vec<&Member> = member_facts.iter().filter(|member| !member.deleting).collect();
    let counts = PoolCounts {
        desired: decision.target,
        current: live.len() as u32,
        ready: live.iter().filter(|member| member.ready).count() as u32,
        leased: live.iter().filter(|member| member.leases > 0).count() as u32,
        updated: live.iter().filter(|member| member.current && !member.replacing).count() as u32,
    };
    context.metrics.counts(key, counts);
    let provisioning = provisioning_seconds(&owned, &slots);
    let failed = failed_members(&owned);
    let new_status =
        pool_status(pool, &status, &decision, &member_facts, counts, &facts, last_scale, &provisioning, &failed, now);
    if new_status != status {
        let written = new_status.last_scale.clone().filter(|last| Some(last) != status.last_scale.as_ref());
        let body = json!({ "apiVersion": "crawl.example.com/v1alpha1", "kind": "ProxyPool", "status": new_status });
        pools.patch_status(&name, &PatchParams::apply(POOL_FIELD_MANAGER).force(), &Patch::Apply(&body)).await?;
        if let Some(written) = written {
            context.with_memory(key, |memory| memory.scale_written = Some((written, Instant::now())));
        }
    }
    let next = if acted.any { decision.requeue.min(AFTER_ACTING) } else { decision.requeue };
    Ok(next)
}

/// What one pass did.
#[derive(Default)]
struct Acted {
    any: bool,
    expected: Vec<Expectation>,
    /// Ordinals whose names turned out to be taken by Proxies this pool does not own.
    taken: Vec<u32>,
}

/// The owner reference every member carries.
fn owner_reference(pool: &ProxyPool) -> OwnerReference {
    OwnerReference {
        api_version: ProxyPool::api_version(&()).into_owned(),
        kind: "ProxyPool".into(),
        name: pool.name_any(),
        uid: pool.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// The labels and annotations a member should carry, given what it carries now: the template's (the keys it set
/// before and no longer sets removed), the pool label, and everything else kept.
fn member_metadata(
    pool: &ProxyPool,
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let template = pool.spec.template.metadata.clone().unwrap_or_default();
    let mut labels = labels.clone();
    if let Some(previous) = annotations.get(TEMPLATE_LABELS_ANNOTATION) {
        for key in previous.split(',').filter(|key| !key.is_empty()) {
            if !template.labels.contains_key(key) {
                labels.remove(key);
            }
        }
    }
    labels.extend(template.labels.clone());
    labels.insert(POOL_LABEL.into(), pool.name_any());
    let mut annotations = annotations.clone();
    annotations.extend(template.annotations);
    annotations
        .insert(TEMPLATE_LABELS_ANNOTATION.into(), template.labels.keys().cloned().collect::<Vec<_>>().join(","));
    (labels, annotations)
}

/// A JSON patch that applies only to the version read (`test` of the resourceVersion first).
fn guarded_patch(resource_version: &str, operations: Vec<Value>) -> Result<json_patch::Patch, Error> {
    let mut all = vec![json!({ "op": "test", "path": "/metadata/resourceVersion", "value": resource_version })];
    all.extend(operations);
    serde_json::from_value(Value::Array(all))
        .map_err(|error| Error::InvalidObject(format!("building a member patch failed: {error}")))
}

async fn act(
    pool: &ProxyPool,
    namespace: &str,
    owned: &[Arc<Proxy>],
    slots: &[SlotSpec],
    decision: &PoolDecision,
    context: &PoolContext,
) -> Result<Acted, Error> {
    let api: Api<Proxy> = Api::namespaced(context.client.clone(), namespace);
    let pool_name = pool.name_any();
    let mut acted = Acted::default();
    let by_name: HashMap<String, &Arc<Proxy>> = owned.iter().map(|proxy| (proxy.name_any(), proxy)).collect();

    // New members.
    let mut created = Vec::new();
    for new in &decision.create {
        let Some(SlotSpec { spec, .. }) = slots.get(new.slot) else { continue };
        let member_name = format!("{pool_name}-{}", new.ordinal);
        let (labels, annotations) = member_metadata(pool, &BTreeMap::new(), &BTreeMap::new());
        let proxy = Proxy {
            metadata: ObjectMeta {
                name: Some(member_name.clone()),
                namespace: Some(namespace.to_owned()),
                labels: Some(labels),
                annotations: Some(annotations),
                owner_references: Some(vec![owner_reference(pool)]),
                ..ObjectMeta::default()
            },
            spec: spec.clone(),
            status: None,
        };
        let params = PostParams { field_manager: Some(POOL_FIELD_MANAGER.into()), ..PostParams::default() };
        match api.create(&params, &proxy).await {
            Ok(_) => {
                created.push(member_name.clone());
                acted.expected.push(Expectation::Present(member_name));
            }
            Err(kube::Error::Api(status)) if status.code == 409 => {
                // Made by an earlier pass whose write the store does not show yet, or a Proxy somebody else owns.
                let existing = api.get_opt(&member_name).await?;
                let ours = existing.as_ref().is_some_and(|proxy| {
                    proxy.owner_references().iter().any(|owner| Some(&owner.uid) == pool.metadata.uid.as_ref())
                });
                if ours {
                    acted.expected.push(Expectation::Present(member_name));
                } else {
                    acted.taken.push(new.ordinal);
                    context
                        .publish(
                            pool,
                            true,
                            "MemberNameTaken",
                            format!(
                                "a Proxy named {member_name} exists and is not this pool's; the pool skips that name"
                            ),
                        )
                        .await;
                }
            }
            Err(error) => return Err(error.into()),
        }
        acted.any = true;
    }
    if !created.is_empty() {
        context.publish(pool, false, "MembersCreated", format!("created {}", created.join(", "))).await;
    }

    // Members to remove.
    let mut deleted = Vec::new();
    for member_name in &decision.delete {
        let Some(proxy) = by_name.get(member_name) else { continue };
        let uid = proxy.metadata.uid.clone().unwrap_or_default();
        let params = DeleteParams {
            preconditions: Some(Preconditions { uid: Some(uid.clone()), resource_version: None }),
            ..DeleteParams::default()
        };
        match api.delete(member_name, &params).await {
            Ok(_) => deleted.push(member_name.clone()),
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {}
            Err(error) => return Err(error.into()),
        }
        acted.expected.push(Expectation::Gone { name: member_name.clone(), uid });
        acted.any = true;
    }
    if !deleted.is_empty() {
        context.publish(pool, false, "MembersDeleted", format!("deleted {}", deleted.join(", "))).await;
    }

    // Members brought to the template: rolled ones (a new instance follows) and those whose change needs none.
    let rolled: BTreeSet<&String> = decision.roll.iter().collect();
    let mut started = Vec::new();
    for proxy in owned {
        let member_name = proxy.name_any();
        if proxy.metadata.deletion_timestamp.is_some() || decision.delete.contains(&member_name) {
            continue;
        }
        let Some(SlotSpec { spec: desired, .. }) = slots.iter().find(|slot| slot.holds(&proxy.spec)) else {
            continue;
        };
        let instance_change = egress_api::spec_hash(&proxy.spec, None) != egress_api::spec_hash(desired, None);
        let mut operations = Vec::new();
        if proxy.spec != *desired && (!instance_change || rolled.contains(&member_name)) {
            operations.push(json!({ "op": "replace", "path": "/spec", "value": desired }));
            if instance_change {
                started.push(member_name.clone());
            }
        }
        let labels = proxy.metadata.labels.clone().unwrap_or_default();
        let annotations = proxy.metadata.annotations.clone().unwrap_or_default();
        let (want_labels, want_annotations) = member_metadata(pool, &labels, &annotations);
        if want_labels != labels {
            operations.push(json!({ "op": "add", "path": "/metadata/labels", "value": want_labels }));
        }
        if want_annotations != annotations {
            operations.push(json!({ "op": "add", "path": "/metadata/annotations", "value": want_annotations }));
        }
        if operations.is_empty() {
            continue;
        }
        let resource_version = proxy.resource_version().unwrap_or_default();
        let patch = guarded_patch(&resource_version, operations)?;
        patch_member(&api, &member_name, &Patch::Json::<()>(patch), &resource_version, &mut acted).await?;
    }
    if !started.is_empty() {
        context
            .publish(pool, false, "RollingMembers", format!("giving {} the current template", started.join(", ")))
            .await;
    }

    // Members recycled for their age: a new rotate token starts the Proxy's make-before-break replacement.
    let mut recycled = Vec::new();
    for member_name in &decision.recycle {
        let Some(proxy) = by_name.get(member_name) else { continue };
        let instance = proxy.status.as_ref().and_then(|status| status.instance.as_ref());
        let token = format!("recycle-{}", instance.map_or("none", |instance| instance.name.as_str()));
        let resource_version = proxy.resource_version().unwrap_or_default();
        let mut annotations = proxy.metadata.annotations.clone().unwrap_or_default();
        annotations.insert(annotations::ROTATE.into(), token);
        let patch = guarded_patch(
            &resource_version,
            vec![json!({ "op": "add", "path": "/metadata/annotations", "value": annotations })],
        )?;
        patch_member(&api, member_name, &Patch::Json::<()>(patch), &resource_version, &mut acted).await?;
        recycled.push(member_name.clone());
    }
    if !recycled.is_empty() {
        context
            .publish(
                pool,
                false,
                "RecyclingMembers",
                format!("giving {} a new instance for its age", recycled.join(", ")),
            )
            .await;
    }
    Ok(acted)
}

/// Patches one member; a member that changed since it was read (the `test` failed) is looked at again next pass.
async fn patch_member(
    api: &Api<Proxy>,
    name: &str,
    patch: &Patch<()>,
    resource_version: &str,
    acted: &mut Acted,
) -> Result<(), Error> {
    let params = PatchParams { field_manager: Some(POOL_FIELD_MANAGER.into()), ..PatchParams::default() };
    match api.patch(name, &params, patch).await {
        Ok(_) => {
            acted
                .expected
                .push(Expectation::Changed { name: name.to_owned(), resource_version: resource_version.into() });
        }
        Err(kube::Error::Api(status)) if status.code == 422 || status.code == 409 || status.code == 404 => {
            debug!(member = name, code = status.code, "the member changed since it was read; next pass");
        }
        Err(error) => return Err(error.into()),
    }
    acted.any = true;
    Ok(())
}

/// Per spread entry, the median time its Ready members took from creation to Ready, in seconds.
fn provisioning_seconds(owned: &[Arc<Proxy>], slots: &[SlotSpec]) -> Vec<Option<i32>> {
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
fn failed_members(owned: &[Arc<Proxy>]) -> Vec<(String, String)> {
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
fn pool_status(
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

#[cfg(test)]
mod tests {
    use super::*;
    use egress_api::{ProxyPoolSpec, ProxyTemplate, TemplateMetadata};

    #[test]
    fn ordinals_are_read_in_their_canonical_spelling_only() {
        let cases = [
            ("eu-0", Some(0)),
            ("eu-12", Some(12)),
            ("eu-01", None),
            ("eu-", None),
            ("eu-x", None),
            ("eu-west-3", None),
            ("other-3", None),
            ("eu3", None),
        ];
        for (name, expected) in cases {
            assert_eq!(ordinal_of("eu", name), expected, "{name}");
        }
    }

    #[test]
    fn template_labels_replace_the_ones_they_set_before_and_keep_the_rest() {
        let mut spec = ProxyPoolSpec::new(1, ProxyTemplate::default());
        spec.template.metadata = Some(TemplateMetadata {
            labels: [("tier".to_owned(), "gold".to_owned())].into(),
            annotations: [("note".to_owned(), "x".to_owned())].into(),
        });
        let pool = ProxyPool::new("eu", spec);
        let labels: BTreeMap<String, String> =
            [("region".to_owned(), "eu".to_owned()), ("mine".to_owned(), "kept".to_owned())].into();
        let annotations: BTreeMap<String, String> =
            [(TEMPLATE_LABELS_ANNOTATION.to_owned(), "region".to_owned())].into();
        let (labels, annotations) = member_metadata(&pool, &labels, &annotations);
        let expected: BTreeMap<String, String> = [
            ("mine".to_owned(), "kept".to_owned()),
            ("tier".to_owned(), "gold".to_owned()),
            (POOL_LABEL.to_owned(), "eu".to_owned()),
        ]
        .into();
        assert_eq!(labels, expected, "region came from the old template and goes; mine was never the template's");
        assert_eq!(annotations.get(TEMPLATE_LABELS_ANNOTATION).map(String::as_str), Some("tier"));
        assert_eq!(annotations.get("note").map(String::as_str), Some("x"));
    }

    #[test]
    fn a_member_patch_tests_the_version_it_read() {
        let patch = guarded_patch("42", vec![json!({ "op": "replace", "path": "/spec", "value": {} })]).expect("valid");
        let text = serde_json::to_value(&patch).expect("serializes");
        assert_eq!(text[0], json!({ "op": "test", "path": "/metadata/resourceVersion", "value": "42" }));
        assert_eq!(text[1]["op"], "replace");
    }
}
