//! What the pool controller keeps between passes: its settings, the signals it reads (lease counts, demand), and
//! per pool the expectations of its last pass, its last scale and its error count.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use egress_api::{ProxyPool, ScalingDecision};
use egress_fleet::{PoolDemand, PoolId, ProxyId};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource};
use tracing::warn;

use super::super::index::MemberIndex;
use super::super::metrics::PoolMetrics;
use crate::decide::EventSpec;
use crate::events::Events;
use crate::feed::{GuardedPool, GuardedProxy, ProxyFeed};

/// The field manager of every write the pool controller makes (members and pool status).
pub const POOL_FIELD_MANAGER: &str = "egress-operator-pool";

/// The annotation on a member listing the label keys the pool's template put there, so a label dropped from the
/// template is dropped from the members too (and a label someone else added is kept).
pub const TEMPLATE_LABELS_ANNOTATION: &str = "crawl.example.com/pool-template-labels";

/// How long a pass waits for the store to show the previous pass's writes before it acts without them.
pub const EXPECTATION_TIMEOUT: Duration = Duration::from_secs(30);
/// How soon to look again while the store does not show the previous pass's writes yet.
pub(super) const EXPECTATION_RECHECK: Duration = Duration::from_secs(1);
/// How soon to look again after acting.
pub(super) const AFTER_ACTING: Duration = Duration::from_secs(2);
/// How many pools are reconciled at once.
pub(super) const CONCURRENCY: u16 = 4;

/// What the discovery API knows about a pool's leases: the pool controller reads it on the leader, where discovery
/// serves.
#[async_trait::async_trait]
pub trait PoolSignals: Send + Sync {
    /// Active leases on `proxy`.
    async fn leases_of(&self, proxy: &ProxyId) -> u32;
    /// When leases for `pool` were last refused, by reason.
    fn demand(&self, pool: &PoolId) -> PoolDemand;
}

/// Signals of a process without a discovery API: no leases, no demand. Pools then follow `spec.replicas` only.
pub struct NoSignals;

#[async_trait::async_trait]
impl PoolSignals for NoSignals {
    async fn leases_of(&self, _proxy: &ProxyId) -> u32 {
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
pub(super) enum Expectation {
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
pub(super) struct PoolMemory {
    /// Since when the pool has held no lease.
    pub(super) idle_since: Option<SystemTime>,
    pub(super) expected: Vec<Expectation>,
    pub(super) expected_since: Option<Instant>,
    pub(super) failures: u32,
    /// Ordinals whose names are taken by Proxies this pool does not own.
    pub(super) foreign: BTreeSet<u32>,
    /// The last scaling decision this controller wrote, until the store's copy of the pool shows it: a pass on a
    /// copy that shows a new `spec.replicas` but not yet the status written after it would take the autoscaler's
    /// own change for somebody else's.
    pub(super) scale_written: Option<(ScalingDecision, Instant)>,
    /// The last scale this controller patched into `spec.replicas`, until the stored status names it. A copy that
    /// does not show it yet is not acted on (it would scale again from the old count, and delete the member just
    /// made); a copy that shows the new count but a status without the decision (its status write was refused or
    /// lost) takes it as the last decision rather than somebody else's change.
    pub(super) scale_patched: Option<(ScalingDecision, Instant)>,
}

/// Everything a pool reconcile needs.
pub struct PoolContext {
    pub(super) client: Client,
    pub(super) proxies: Store<GuardedProxy>,
    pub(super) index: Arc<Mutex<MemberIndex>>,
    pub(super) signals: Arc<dyn PoolSignals>,
    pub(super) metrics: PoolMetrics,
    pub(super) events: Events,
    pub(super) memory: Mutex<HashMap<PoolId, PoolMemory>>,
}

impl PoolContext {
    /// A context over the operator's Proxy store, reading lease counts and demand from `signals`.
    pub fn new(client: Client, proxies: &ProxyFeed, signals: Arc<dyn PoolSignals>, metrics: PoolMetrics) -> Self {
        Self {
            events: Events::new(client.clone()),
            client,
            proxies: proxies.store(),
            index: Arc::default(),
            signals,
            metrics,
            memory: Mutex::default(),
        }
    }

    /// The metrics this context records into.
    pub fn metrics(&self) -> &PoolMetrics {
        &self.metrics
    }

    pub(super) async fn publish(&self, pool: &ProxyPool, warning: bool, reason: &'static str, note: String) {
        self.events.publish(pool, &EventSpec { warning, reason, note }, "Reconcile").await;
    }

    pub(super) fn with_memory<T>(&self, key: &PoolId, change: impl FnOnce(&mut PoolMemory) -> T) -> T {
        change(self.memory.lock().expect("pool memory").entry(key.clone()).or_default())
    }

    /// Whether the store shows what the last pass expected (or it waited long enough); clears the expectations
    /// when it does.
    pub(super) fn expectations_met(&self, key: &PoolId, namespace: &str) -> bool {
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
    pub(super) fn shows_last_scale(&self, key: &PoolId, pool: &ProxyPool) -> bool {
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
    pub(super) fn pending_scale(&self, key: &PoolId, pool: &ProxyPool) -> Option<ScalingDecision> {
        self.with_memory(key, |memory| {
            memory
                .scale_patched
                .as_ref()
                .map(|(patched, _)| patched.clone())
                .filter(|patched| patched.to == pool.spec.replicas)
        })
    }

    pub(super) fn expect(&self, key: &PoolId, expected: Vec<Expectation>) {
        if expected.is_empty() {
            return;
        }
        self.with_memory(key, |memory| {
            memory.expected.extend(expected);
            memory.expected_since.get_or_insert_with(Instant::now);
        });
    }
}
