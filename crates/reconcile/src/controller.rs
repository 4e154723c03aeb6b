//! The kube `Controller` over Proxies: observe → decide → act, under the finalizer helper.
//!
//! `reconcile` is the finalizer helper's single top-level call, dispatching to [`apply`] and [`cleanup`];
//! `error_policy` alone decides error backoff (1 s doubling to 5 min per object, reset on success). Objects are
//! watched through `DeserializeGuard`, so one malformed Proxy is reported and skipped instead of breaking the stream.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use egress_api::annotations::FINALIZER;
use egress_api::{Proxy, ProxyMode};
use egress_fleet::ProxyId;
use futures::Stream;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Error as FinalizerError, Event as FinalizerEvent, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, ResourceExt};
use tracing::{debug, instrument, warn};

use crate::Error;
use crate::credentials::CredentialStore;
use crate::decide::{EventSpec, Requeue};
use crate::events::Events;
use crate::health::ProxyVerdicts;
use crate::ids::proxy_id;
use crate::metrics::ReconcileMetrics;
use crate::providers::Providers;

mod act;
mod lanes;
mod observe;
mod status;

pub(crate) use act::{age, recorded_names};
use act::{apply, cleanup};
pub use lanes::run;
use lanes::{Lane, receiver_stream};

/// The field manager of every status write.
pub const FIELD_MANAGER: &str = "egress-operator";

/// When a reconcile read a stale copy, how soon it looks again if the newer copy's own trigger has not come.
const STALE_READ_RECHECK: Duration = Duration::from_secs(1);

/// Settings of the reconciler.
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// The `--cluster-id`, written on every instance so clusters sharing a provider never collect each other's.
    pub cluster_id: String,
    /// How often a settled Proxy's instance is looked at again, to notice preemption or removal.
    pub resync: Duration,
    /// How many Proxies are reconciled at once.
    pub concurrency: u16,
    /// Watch only this namespace; `None` watches all.
    pub namespace: Option<String>,
    /// How long a replaced instance is kept for the leases still on it (`--drain-timeout`).
    pub drain_timeout: Duration,
}

impl ControllerConfig {
    /// Defaults for `cluster_id`: resync every minute, 16 concurrent reconciles, all namespaces, a 5-minute drain
    /// (the default lease TTL, so a holder that never renews keeps its instance for its whole lease).
    pub fn new(cluster_id: impl Into<String>) -> Self {
        Self {
            cluster_id: cluster_id.into(),
            resync: Duration::from_secs(60),
            concurrency: 16,
            namespace: None,
            drain_timeout: Duration::from_secs(300),
        }
    }
}

/// Who holds leases on which endpoint: the discovery API, so a replaced instance is kept until its holders were
/// told the new one.
#[async_trait::async_trait]
pub trait LeaseDrain: Send + Sync {
    /// How many live leases on `proxy` were last told `endpoint` (`host:port`).
    async fn leases_on(&self, proxy: &ProxyId, endpoint: &str) -> usize;
}

/// Everything a reconcile needs, shared by all of them.
pub struct Context {
    client: Client,
    providers: Arc<dyn Providers>,
    health: ProxyVerdicts,
    credentials: CredentialStore,
    config: ControllerConfig,
    events: Events,
    metrics: ReconcileMetrics,
    failures: Mutex<HashMap<String, u32>>,
    quota_refusals: Mutex<HashMap<String, QuotaRefusal>>,
    drain: Option<Arc<dyn LeaseDrain>>,
    /// The GeoIP databases egress addresses are looked up in (`--geoip-database`), when given.
    geoip: Option<Arc<crate::geoip::GeoIp>>,
    /// One lock per Proxy (by UID) held for the length of a reconcile: the two lanes never reconcile one Proxy at
    /// once. An entry lives while a reconcile holds or waits for it.
    in_flight: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Requeues the urgent lane handed over to the bulk lane and not yet due, by UID: a token each. A bulk reconcile
    /// in between takes the entry away, since its own result schedules the next look.
    handovers: Mutex<HashMap<String, u64>>,
    next_handover: std::sync::atomic::AtomicU64,
}

/// Consecutive QuotaExceeded answers for one Proxy, and when the next create may be tried.
#[derive(Clone, Copy)]
struct QuotaRefusal {
    consecutive: u32,
    retry_at: Instant,
}

impl Context {
    /// A context for the controller.
    pub fn new(
        client: Client,
        providers: Arc<dyn Providers>,
        health: ProxyVerdicts,
        credentials: CredentialStore,
        config: ControllerConfig,
        metrics: ReconcileMetrics,
    ) -> Self {
        Self {
            events: Events::new(client.clone()),
            client,
            providers,
            health,
            credentials,
            config,
            metrics,
            failures: Mutex::default(),
            quota_refusals: Mutex::default(),
            drain: None,
            geoip: None,
            in_flight: Mutex::default(),
            handovers: Mutex::default(),
            next_handover: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Keeps a replaced instance while `drain` says leases are on it (up to the drain timeout).
    pub fn with_drain(mut self, drain: Arc<dyn LeaseDrain>) -> Self {
        self.drain = Some(drain);
        self
    }

    /// Looks every egress address up in `geoip`, for `status.egressCountry`/`egressASN` and their labels.
    pub fn with_geoip(mut self, geoip: Arc<crate::geoip::GeoIp>) -> Self {
        self.geoip = Some(geoip);
        self
    }

    /// The metrics this context records into.
    pub fn metrics(&self) -> &ReconcileMetrics {
        &self.metrics
    }

    /// The configured providers.
    pub fn providers(&self) -> Arc<dyn Providers> {
        self.providers.clone()
    }

    /// The controller's settings.
    pub fn config(&self) -> &ControllerConfig {
        &self.config
    }

    /// The Kubernetes client.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    async fn publish(&self, proxy: &Proxy, event: &EventSpec) {
        self.events.publish(proxy, event, "Reconcile").await;
    }
}

/// A reconcile trigger: the Proxy to look at.
pub type Trigger = ObjectRef<DeserializeGuard<Proxy>>;

/// A channel for health triggers: send a Proxy's reference to reconcile it; the receiving stream goes to [`run`].
pub fn trigger_channel() -> (tokio::sync::mpsc::UnboundedSender<Trigger>, impl Stream<Item = Trigger> + Send + 'static)
{
    let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
    (sender, receiver_stream(receiver))
}

#[instrument(skip(object, context, lane), fields(proxy = %object.name_any(), namespace = object.namespace().unwrap_or_default(), urgent = lane.handover.is_some()))]
async fn reconcile(
    object: Arc<DeserializeGuard<Proxy>>,
    context: Arc<Context>,
    lane: Arc<Lane>,
) -> Result<Action, Error> {
    let uid = object.uid().unwrap_or_default();
    let lock = context.in_flight.lock().expect("in-flight locks").entry(uid.clone()).or_default().clone();
    let guard = lock.lock().await;
    if lane.handover.is_none() {
        // This reconcile's result schedules the next look: a requeue the urgent lane handed over is superseded.
        context.handovers.lock().expect("handovers").remove(&uid);
    }
    // The other lane may have reconciled this Proxy while this one waited: act on the store's copy as it is now.
    let result = match lane.store.get(&ObjectRef::from_obj(object.as_ref())) {
        Some(latest) => reconcile_one(latest, &context).await.map(|next| lane.action(&context, &object, next)),
        None => Ok(Action::await_change()),
    };
    drop(guard);
    drop(lock);
    let mut locks = context.in_flight.lock().expect("in-flight locks");
    if locks.get(&uid).is_some_and(|lock| Arc::strong_count(lock) == 1) {
        locks.remove(&uid);
    }
    result
}

async fn reconcile_one(object: Arc<DeserializeGuard<Proxy>>, context: &Arc<Context>) -> Result<Requeue, Error> {
    let timer = context.metrics.start();
    let proxy = match &object.0 {
        Ok(proxy) => proxy.clone(),
        Err(invalid) => {
            // Nothing can be done until someone fixes or deletes the object; keep it out of the backoff loop.
            warn!(error = %invalid.error, "skipping a Proxy that cannot be read");
            timer.finish(false);
            return Ok(Requeue::AwaitChange);
        }
    };
    let uid = proxy.uid().unwrap_or_default();
    let namespace = proxy.namespace().unwrap_or_default();
    // An External Proxy owns nothing to clean up (its mode is immutable), so it gets no finalizer: none to add on
    // create, none to wait for on delete. One that carries ours from an older release goes through the helper,
    // which removes it on deletion.
    let result = if proxy.spec.mode == ProxyMode::External && !proxy.finalizers().iter().any(|name| name == FINALIZER) {
        if proxy.metadata.deletion_timestamp.is_some() {
            context.metrics.phase(&proxy_id(&proxy), None);
            Ok(Requeue::AwaitChange)
        } else {
            apply(&proxy, context).await
        }
    } else {
        let api: Api<Proxy> = Api::namespaced(context.client.clone(), &namespace);
        // The helper wants kube's `Action` back; what apply or cleanup asked for is kept beside it. When the helper
        // acts alone (adding or removing the finalizer), it asks for nothing: the watch event of its patch follows.
        let asked = Mutex::new(Requeue::AwaitChange);
        let result = finalizer(&api, FINALIZER, Arc::new(proxy), |event| async {
            let next = match event {
                FinalizerEvent::Apply(proxy) => apply(&proxy, context).await?,
                FinalizerEvent::Cleanup(proxy) => cleanup(&proxy, context).await?,
            };
            *asked.lock().expect("asked requeue") = next;
            Ok::<_, Error>(Action::await_change())
        })
        .await
        .map(|_| *asked.lock().expect("asked requeue"));
        match result {
            // The helper's JSON patch tests the finalizers it read, so a 422 means the store's copy is older than
            // the server's (a trigger raced the watch event of our own last write). The newer object is on its way
            // and triggers a reconcile of its own; this is no failure to back off from.
            Err(FinalizerError::AddFinalizer(kube::Error::Api(status))) if status.code == 422 => {
                debug!("the stored Proxy is older than the server's; waiting for the newer one");
                Ok(Requeue::After(STALE_READ_RECHECK))
            }
            other => other.map_err(|error| Error::Finalizer(Box::new(error))),
        }
    };
    if result.is_ok() {
        context.failures.lock().expect("failure counts").remove(&uid);
    }
    timer.finish(result.is_ok());
    result
}

fn error_policy(object: &DeserializeGuard<Proxy>, error: &Error, context: &Context) -> Requeue {
    let uid = object.uid().unwrap_or_default();
    let failures = {
        let mut counts = context.failures.lock().expect("failure counts");
        let count = counts.entry(uid).or_default();
        *count = count.saturating_add(1);
        *count
    };
    let backoff = crate::backoff::RECONCILE_ERRORS.after(failures);
    context.metrics.error(error.kind());
    warn!(proxy = %object.name_any(), kind = error.kind(), %error, failures, backoff_secs = backoff.as_secs(), "reconcile failed");
    Requeue::After(backoff)
}
