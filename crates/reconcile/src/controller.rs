//! The kube `Controller` over Proxies: observe → decide → act, under the finalizer helper.
//!
//! `reconcile` is the finalizer helper's single top-level call, dispatching to [`apply`] and [`cleanup`];
//! `error_policy` alone decides error backoff (1 s doubling to 5 min per object, reset on success). Objects are
//! watched through `DeserializeGuard`, so one malformed Proxy is reported and skipped instead of breaking the stream.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use egress_api::annotations::{self, FINALIZER};
use egress_api::{InstanceStatus, Proxy, ProxyMode, ProxyPhase, ProxyStatus};
use egress_fleet::ProxyId;
use egress_provider::destinations::DestinationRule;
use egress_provider::{CreateRequest, ErrorClass, Instance, Provider, ProviderError, Sensitive, Tags};
use futures::{FutureExt, Stream, StreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Config as RuntimeConfig, Controller};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Error as FinalizerError, Event as FinalizerEvent, finalizer};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource, ResourceExt};
use tracing::{Instrument, debug, info, info_span, instrument, warn};

use crate::Error;
use crate::credentials::CredentialStore;
use crate::decide::{self, CleanupDecision, Decision, EventSpec, Facts, Observed, PreviousObserved, Requeue};
use crate::feed::{Change, ProxyFeed};
use crate::health::{ProbeKey, ProxyVerdicts, seed_from_status, verdict_of};
use crate::ids::proxy_id;
use crate::metrics::ReconcileMetrics;
use crate::providers::Providers;
use crate::status::time;

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
pub trait LeaseDrain: Send + Sync {
    /// How many live leases on `proxy` were last told `endpoint` (`host:port`).
    fn leases_on(&self, proxy: &ProxyId, endpoint: &str) -> usize;
}

/// Everything a reconcile needs, shared by all of them.
pub struct Context {
    client: Client,
    providers: Arc<dyn Providers>,
    health: ProxyVerdicts,
    credentials: CredentialStore,
    config: ControllerConfig,
    reporter: Reporter,
    metrics: ReconcileMetrics,
    failures: Mutex<HashMap<String, u32>>,
    quota_refusals: Mutex<HashMap<String, QuotaRefusal>>,
    drain: Option<Arc<dyn LeaseDrain>>,
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
        let reporter = Reporter { controller: "egress-operator".into(), instance: std::env::var("POD_NAME").ok() };
        Self {
            client,
            providers,
            health,
            credentials,
            config,
            reporter,
            metrics,
            failures: Mutex::default(),
            quota_refusals: Mutex::default(),
            drain: None,
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
        let event = KubeEvent {
            type_: if event.warning { EventType::Warning } else { EventType::Normal },
            reason: event.reason.to_owned(),
            note: Some(event.note.clone()),
            action: "Reconcile".into(),
            secondary: None,
        };
        // A recorder per Event: kube's Recorder scans its whole cache of past Events on every publish (O(n) in the
        // fleet) and keeps each for minutes only to aggregate repeats, which the state machine does not make (an
        // Event follows a transition).
        let recorder = Recorder::new(self.client.clone(), self.reporter.clone());
        if let Err(error) = recorder.publish(&event, &proxy.object_ref(&())).await {
            warn!(%error, reason = %event.reason, "publishing an Event failed");
        }
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

/// Runs the controller on a shared [`ProxyFeed`] until `shutdown` resolves; in-flight reconciles finish first.
///
/// The controller runs on kube's shared-stream API over the feed's store and is woken by the feed's changes, so the
/// operator lists and watches Proxies once. Each change costs one store lookup; a resync (the start of a term, a
/// relist) hands the controller every stored `Arc`, which its scheduler deduplicates. It starts only after the
/// feed's initial list: kube's runner waits on the store's readiness, and that wait loses its wake-up when other
/// tasks wait on it too (see [`crate::feed::Fanout::ready`]).
pub async fn run(
    context: Arc<Context>,
    feed: ProxyFeed,
    health_triggers: impl Stream<Item = Trigger> + Send + 'static,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let shutdown = shutdown.shared();
    let ready = tokio::select! {
        ready = feed.ready() => ready,
        () = shutdown.clone() => return,
    };
    if !ready {
        warn!("the Proxy watch ended before its first list; the controller does not start");
        return;
    }
    let store = feed.store();
    let metrics = context.metrics.clone();
    // Two lanes over the same store: a change to a Proxy already known (its spec, labels, annotations, deletion)
    // goes to a controller of its own, so a user's edit is never queued behind a fleet's creation or its first
    // verdicts, which all go to the other. A task of its own sorts the feed's changes as they come: a controller
    // takes triggers only when it has a free slot, so sorting inside one lane's trigger stream would hold the other
    // lane's changes behind the busy one.
    let (bulk_sender, bulk) = tokio::sync::mpsc::unbounded_channel::<Arc<DeserializeGuard<Proxy>>>();
    let (urgent_sender, urgent) = tokio::sync::mpsc::unbounded_channel::<Arc<DeserializeGuard<Proxy>>>();
    let changes = feed.subscribe();
    let sorter = tokio::spawn(
        async move {
            futures::pin_mut!(changes);
            // What each Proxy last triggered a reconcile with: a change to anything else (our own status writes)
            // wakes nothing, so a ramp costs one reconcile per real change, not one more per status write.
            let mut seen: HashMap<ObjectRef<DeserializeGuard<Proxy>>, u64> = HashMap::new();
            while let Some(change) = changes.next().await {
                match change {
                    Change::Object(reference) => match store.get(&reference) {
                        Some(object) => {
                            let fingerprint = trigger_fingerprint(&object);
                            let lane = match seen.insert(reference, fingerprint) {
                                Some(before) if before == fingerprint => continue,
                                Some(_) => &urgent_sender,
                                None => &bulk_sender,
                            };
                            if lane.send(object).is_err() {
                                return;
                            }
                        }
                        None => {
                            // Gone. A Proxy without our finalizer (External) is never reconciled on its way out.
                            metrics.phase(&crate::ids::proxy_id_of(&reference), None);
                            seen.remove(&reference);
                        }
                    },
                    // A relist or a fall behind: everything once, level-triggered.
                    Change::Resync => {
                        let all = store.state();
                        seen = all
                            .iter()
                            .map(|object| (crate::feed::reference_of(object.as_ref()), trigger_fingerprint(object)))
                            .collect();
                        for object in all {
                            if bulk_sender.send(object).is_err() {
                                return;
                            }
                        }
                    }
                }
            }
        }
        .instrument(info_span!("proxy_trigger_sorter")),
    );
    // The bulk lane alone keeps each Proxy's schedule (requeues and error backoffs): the urgent lane hands the
    // requeue its reconcile asked for over to it, so a Proxy never has two timers.
    let (handover, handed_over) = tokio::sync::mpsc::unbounded_channel::<Trigger>();
    let shutdown_urgent = shutdown.clone();
    let bulk = drive(
        Controller::for_shared_stream(receiver_stream(bulk), feed.store()),
        context.clone(),
        Arc::new(Lane { store: feed.store(), handover: None }),
        context.config.concurrency,
        futures::stream::select(health_triggers, receiver_stream(handed_over)),
        shutdown,
    );
    let urgent = drive(
        Controller::for_shared_stream(receiver_stream(urgent), feed.store()),
        context.clone(),
        Arc::new(Lane { store: feed.store(), handover: Some(handover) }),
        URGENT_CONCURRENCY,
        futures::stream::empty(),
        shutdown_urgent,
    );
    futures::join!(bulk, urgent);
    sorter.abort();
}

/// One of the two controllers: the store a reconcile reads its Proxy from once it holds the Proxy's lock, and, for
/// the urgent lane, where it hands requeues over to the bulk lane.
struct Lane {
    store: Store<DeserializeGuard<Proxy>>,
    handover: Option<tokio::sync::mpsc::UnboundedSender<Trigger>>,
}

impl Lane {
    /// The action for kube's scheduler: the bulk lane schedules `next` itself; the urgent lane asks the bulk lane to
    /// look again after that long, and schedules nothing.
    fn action(&self, context: &Arc<Context>, object: &DeserializeGuard<Proxy>, next: Requeue) -> Action {
        match (&self.handover, next) {
            (_, Requeue::AwaitChange) => Action::await_change(),
            (None, Requeue::After(after)) => Action::requeue(after),
            (Some(handover), Requeue::After(after)) => {
                let uid = object.uid().unwrap_or_default();
                let token = context.next_handover.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                context.handovers.lock().expect("handovers").insert(uid.clone(), token);
                let (handover, reference, context) = (handover.clone(), ObjectRef::from_obj(object), context.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    let mut handovers = context.handovers.lock().expect("handovers");
                    if handovers.get(&uid) == Some(&token) {
                        handovers.remove(&uid);
                        let _ = handover.send(reference);
                    }
                });
                Action::await_change()
            }
        }
    }
}

/// A stream of what `receiver` receives.
fn receiver_stream<T: Send + 'static>(
    receiver: tokio::sync::mpsc::UnboundedReceiver<T>,
) -> impl Stream<Item = T> + Send {
    futures::stream::unfold(receiver, |mut receiver| async move { receiver.recv().await.map(|item| (item, receiver)) })
}

/// How many changes to known Proxies are reconciled at once, beside the bulk lane's `concurrency`.
const URGENT_CONCURRENCY: u16 = 4;

/// A hash of what a reconcile depends on beyond the status it wrote itself: identity, generation (the spec), labels,
/// annotations (rotate, retry, skip-cleanup), finalizers and deletion. Status-only changes keep it.
fn trigger_fingerprint(object: &DeserializeGuard<Proxy>) -> u64 {
    use std::hash::{Hash, Hasher};
    let metadata = object.meta();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    metadata.uid.hash(&mut hasher);
    metadata.generation.hash(&mut hasher);
    metadata.labels.hash(&mut hasher);
    metadata.annotations.hash(&mut hasher);
    metadata.finalizers.hash(&mut hasher);
    metadata.deletion_timestamp.is_some().hash(&mut hasher);
    // An object that does not parse is told apart by its content's version, so a fix to it wakes the controller.
    if object.0.is_err() {
        metadata.resource_version.hash(&mut hasher);
    }
    hasher.finish()
}

/// Configures and runs a controller over Proxies, whatever feeds it.
async fn drive(
    controller: Controller<DeserializeGuard<Proxy>>,
    context: Arc<Context>,
    lane: Arc<Lane>,
    concurrency: u16,
    health_triggers: impl Stream<Item = Trigger> + Send + 'static,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let triggers = health_triggers;
    let for_errors = lane.clone();
    controller
        .with_config(RuntimeConfig::default().concurrency(concurrency))
        .reconcile_on(triggers)
        .graceful_shutdown_on(shutdown)
        .run(
            move |object, context| reconcile(object, context, lane.clone()),
            move |object, error, context| for_errors.action(&context, &object, error_policy(&object, error, &context)),
            context,
        )
        .for_each(|result| async move {
            if let Err(error) = result {
                debug!(%error, "controller event");
            }
        })
        .instrument(info_span!("proxy_controller"))
        .await;
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

/// `maxAge` shortened by a per-Proxy jitter of up to 10%, so a fleet created together does not rotate together.
fn jittered_max_age(proxy: &Proxy) -> Option<Duration> {
    let max_age = proxy.spec.max_age()?;
    let uid = proxy.uid().unwrap_or_default();
    let spread = uid.bytes().fold(0_u32, |acc, byte| acc.wrapping_mul(31).wrapping_add(u32::from(byte))) % 1000;
    Some(max_age.mul_f64(1.0 - f64::from(spread) / 10_000.0))
}

fn observed(instance: &Instance) -> Observed {
    Observed::Found {
        state: match instance.state {
            egress_provider::InstanceState::Provisioning => egress_api::InstanceState::Provisioning,
            egress_provider::InstanceState::Running => egress_api::InstanceState::Running,
            egress_provider::InstanceState::Stopped => egress_api::InstanceState::Stopped,
            egress_provider::InstanceState::Terminated => egress_api::InstanceState::Terminated,
        },
        ip: instance.ip.map(|ip| ip.to_string()),
        created_at: instance.created_at,
    }
}

/// The `provider` label of the phase gauges: `spec.provider`, `external` for an External Proxy, `none` for a
/// Managed one without a provider (which fails).
fn provider_label(proxy: &Proxy) -> &str {
    match proxy.spec.mode {
        ProxyMode::External => "external",
        ProxyMode::Managed => proxy.spec.provider.as_deref().unwrap_or("none"),
    }
}

fn provider_name(proxy: &Proxy) -> Option<&str> {
    proxy.spec.provider.as_deref()
}

/// Reads the world: the status, and what the provider says about the recorded instances.
async fn observe(
    proxy: &Proxy,
    context: &Context,
    provider: Option<&Arc<dyn Provider>>,
) -> Result<Facts, ProviderError> {
    let status = proxy.status.clone().unwrap_or_default();
    let retry_token = annotations::annotation(proxy, annotations::RETRY).map(str::to_owned);
    // The provider's policy is baked into its instances: a change of it replaces them, as a spec change does.
    // Without the provider at hand (a latched failure) the recorded instance's fingerprint stands, so nothing is
    // replaced for want of it.
    let fingerprint = match provider {
        Some(provider) => provider.instance_fingerprint(),
        None => status.instance.as_ref().and_then(|instance| instance.provider_fingerprint.clone()),
    };
    let desired_hash = proxy.desired_spec_hash_with(fingerprint.as_deref());
    let replacement_cause = match &status.instance {
        Some(instance) if instance.spec_hash != desired_hash => proxy.replacement_cause(
            &instance.spec_hash,
            instance.provider_fingerprint.as_deref(),
            fingerprint.as_deref(),
        ),
        _ => "",
    };
    let mut facts = Facts {
        mode: proxy.spec.mode,
        generation: proxy.metadata.generation,
        port: proxy.spec.port,
        spec_endpoint: proxy.spec.endpoint.clone(),
        status: status.clone(),
        desired_hash,
        fingerprint,
        replacement_cause,
        retry_token,
        max_age: jittered_max_age(proxy),
        replace_after: proxy.spec.health_check.replace_after(),
        resync: context.config.resync,
        now: SystemTime::now(),
        desired: Observed::NotRecorded,
        previous: PreviousObserved::None,
        previous_leases: 0,
        drain_timeout: context.config.drain_timeout,
        health: None,
        created: proxy.metadata.creation_timestamp.as_ref().map(|time| SystemTime::from(time.0)),
    };
    let latched = status.failure.as_ref().is_some_and(|failure| {
        status.observed_generation == facts.generation && failure.retry_token == facts.retry_token
    });
    let namespace = proxy.namespace().unwrap_or_default();
    let name = proxy.name_any();
    if let (Some(provider), false) = (provider, latched) {
        if let Some(current) = status.instance.as_ref().filter(|current| current.spec_hash == facts.desired_hash) {
            facts.desired = match provider.get(&current.provider_id).await {
                Ok(instance) => observed(&instance),
                Err(error) if error.is_not_found() => Observed::NotFound,
                Err(error) => return Err(error),
            };
        }
        if let Some(previous) = &status.previous_instance {
            facts.previous = match provider.get(&previous.provider_id).await {
                Ok(_) => PreviousObserved::Present,
                Err(error) if error.is_not_found() => PreviousObserved::Gone,
                Err(error) => return Err(error),
            };
            if let (Some(drain), Some(ip)) = (&context.drain, &previous.ip) {
                let endpoint = egress_api::Endpoint { host: ip.clone(), port: facts.port };
                facts.previous_leases = drain.leases_on(&proxy_id(proxy), &endpoint.address());
            }
        }
        if let Observed::Found { ip: Some(ip), .. } = &facts.desired {
            let endpoint = egress_api::Endpoint { host: ip.clone(), port: facts.port };
            seed_from_status(&context.health, proxy, &ProbeKey::new(&namespace, &name, endpoint.clone()));
            facts.health = verdict_of(&context.health, &namespace, &name, &endpoint);
        }
    }
    if proxy.spec.mode == ProxyMode::External
        && let Some(endpoint) = &proxy.spec.endpoint
    {
        seed_from_status(&context.health, proxy, &ProbeKey::new(&namespace, &name, endpoint.clone()));
        facts.health = verdict_of(&context.health, &namespace, &name, endpoint);
    }
    Ok(facts)
}

/// How soon a Proxy whose auth Secret does not exist yet is looked at again: the controller is not woken by
/// Secrets (the credential store is, and holds the Secret as soon as it exists).
const MISSING_AUTH_SECRET_RECHECK: Duration = Duration::from_secs(5);

/// How soon a Proxy whose auth Secret exists but has not reached the credential store yet (it is being read, on
/// the same Proxy event that started this reconcile) is looked at again.
const ARRIVING_AUTH_SECRET_RECHECK: Duration = Duration::from_millis(500);

/// Whether the Proxy names an auth Secret the credential store does not hold (missing, or not read yet).
fn waiting_for_auth_secret(proxy: &Proxy, context: &Context) -> bool {
    proxy
        .spec
        .auth
        .as_ref()
        .is_some_and(|auth| !context.credentials.holds(&proxy.namespace().unwrap_or_default(), &auth.secret_ref.name))
}

/// Whether the auth Secret the Proxy names exists, asked of the API (its metadata only): told apart from one the
/// credential store has not read yet.
async fn auth_secret_exists(proxy: &Proxy, context: &Context) -> Result<bool, Error> {
    let Some(auth) = &proxy.spec.auth else { return Ok(true) };
    let secrets: Api<Secret> = Api::namespaced(context.client.clone(), &proxy.namespace().unwrap_or_default());
    Ok(secrets.get_metadata_opt(&auth.secret_ref.name).await?.is_some())
}

/// The message of the status's `Provisioned` condition.
fn provisioned_message(status: &ProxyStatus) -> Option<&str> {
    status
        .conditions
        .iter()
        .find(|condition| condition.type_ == egress_api::proxy::CONDITION_PROVISIONED)
        .map(|condition| condition.message.as_str())
}

async fn apply(proxy: &Proxy, context: &Context) -> Result<Requeue, Error> {
    let uid = proxy.uid().unwrap_or_default();
    let provider = match (proxy.spec.mode, provider_name(proxy)) {
        (ProxyMode::Managed, Some(name)) => match context.providers.provider(name).await {
            Ok(provider) => Some(provider),
            Err(error) if error.class() == ErrorClass::Permanent => {
                let facts = observe(proxy, context, None).await?;
                return latch(proxy, context, &facts, &error).await;
            }
            Err(error) => return Err(error.into()),
        },
        (ProxyMode::Managed, None) => {
            let facts = observe(proxy, context, None).await?;
            let error = ProviderError::permanent("spec.provider is not set");
            return latch(proxy, context, &facts, &error).await;
        }
        (ProxyMode::External, _) => None,
    };
    let facts = match observe(proxy, context, provider.as_ref()).await {
        Ok(facts) => facts,
        Err(error) if error.class() == ErrorClass::Permanent => {
            let facts = observe(proxy, context, None).await?;
            return latch(proxy, context, &facts, &error).await;
        }
        Err(error) => return Err(error.into()),
    };
    let Decision { action, mut status, events, requeue } = decide::decide(&facts);
    let mut requeue = requeue;
    match (&action, &provider) {
        (decide::Action::Nothing, _) | (_, None) => {}
        (decide::Action::Create, Some(provider)) => {
            // Any change (our own status write among them) triggers a reconcile; the quota backoff still holds.
            let refusal = context.quota_refusals.lock().expect("quota refusals").get(&uid).copied();
            if let Some(wait) = refusal.and_then(|refusal| refusal.retry_at.checked_duration_since(Instant::now())) {
                debug!(wait_secs = wait.as_secs(), "create deferred by the quota backoff");
                return Ok(Requeue::After(wait));
            }
            let request = match create_request(proxy, context, &facts, provider.as_ref()).await {
                Ok(request) => request,
                // A spec the provider can never serve (a malformed deny rule, a denied probe URL): latched.
                Err(Error::Provider(error)) if error.class() == ErrorClass::Permanent => {
                    return latch(proxy, context, &facts, &error).await;
                }
                Err(error) => {
                    if waiting_for_auth_secret(proxy, context) && auth_secret_exists(proxy, context).await? {
                        // Being read by the credential store right now: nothing to tell the user.
                        return Ok(Requeue::After(ARRIVING_AUTH_SECRET_RECHECK));
                    }
                    // Say why on the object (a Secret missing, or a key missing); the error backoff retries.
                    let message = error.to_string();
                    let status = decide::on_transient_failure(&facts, &message);
                    write_status(proxy, context, &facts.status, &status).await?;
                    if waiting_for_auth_secret(proxy, context) {
                        // Said once per wait as an Event too. Its creation does not wake the controller, so look
                        // again soon instead of backing off further each time.
                        if provisioned_message(&facts.status) != Some(message.as_str()) {
                            let event = EventSpec { warning: true, reason: "AuthSecretMissing", note: message };
                            context.publish(proxy, &event).await;
                        }
                        return Ok(Requeue::After(MISSING_AUTH_SECRET_RECHECK));
                    }
                    return Err(error);
                }
            };
            match provider.create(&request).await {
                Ok(instance) => {
                    status.instance =
                        Some(instance_status(&instance, &facts.desired_hash, facts.fingerprint.as_deref()));
                    context.quota_refusals.lock().expect("quota refusals").remove(&uid);
                    requeue = Requeue::After(Duration::from_secs(1));
                }
                Err(error) if error.class() == ErrorClass::QuotaExceeded => {
                    let consecutive = refusal.map_or(1, |refusal| refusal.consecutive.saturating_add(1));
                    let (status, event, backoff) = decide::on_quota_exceeded(&facts, &error.chain(), consecutive);
                    context
                        .quota_refusals
                        .lock()
                        .expect("quota refusals")
                        .insert(uid.clone(), QuotaRefusal { consecutive, retry_at: Instant::now() + backoff });
                    write_status(proxy, context, &facts.status, &status).await?;
                    context.publish(proxy, &event).await;
                    info!(backoff_secs = backoff.as_secs(), "provider quota exceeded; backing off");
                    return Ok(Requeue::After(backoff));
                }
                Err(error) if error.class() == ErrorClass::Permanent => {
                    return latch(proxy, context, &facts, &error).await;
                }
                Err(error) => {
                    // Say why on the object; the error backoff decides when to try again.
                    let status = decide::on_transient_failure(&facts, &error.chain());
                    write_status(proxy, context, &facts.status, &status).await?;
                    return Err(error.into());
                }
            }
        }
        (decide::Action::Delete { provider_id }, Some(provider)) => match provider.delete(provider_id).await {
            Ok(()) => {}
            Err(error) if error.class() == ErrorClass::Permanent => return latch(proxy, context, &facts, &error).await,
            Err(error) => return Err(error.into()),
        },
    }
    write_status(proxy, context, &facts.status, &status).await?;
    for event in &events {
        context.publish(proxy, event).await;
    }
    context.metrics.phase(&proxy_id(proxy), status.phase.map(|phase| (phase, provider_label(proxy))));
    Ok(match requeue {
        Requeue::AwaitChange => Requeue::AwaitChange,
        Requeue::After(after) => Requeue::After(after.max(Duration::from_millis(100))),
    })
}

/// Latches a permanent failure: status `Failed` with the reason, an Event, and no retry until something changes.
async fn latch(proxy: &Proxy, context: &Context, facts: &Facts, error: &ProviderError) -> Result<Requeue, Error> {
    warn!(error = %error.chain(), "permanent failure; waiting for a spec or retry-annotation change");
    let (status, event) = decide::on_permanent_failure(facts, &error.chain());
    write_status(proxy, context, &facts.status, &status).await?;
    context.publish(proxy, &event).await;
    context.metrics.phase(&proxy_id(proxy), status.phase.map(|phase| (phase, provider_label(proxy))));
    Ok(Requeue::AwaitChange)
}

/// The status record of a freshly created instance. It is recorded as Provisioning whatever `create` returned: the
/// next reconcile's `get` observes the real state, and that transition is what publishes the address and the
/// `Provisioned` Event, in one place.
fn instance_status(instance: &Instance, spec_hash: &str, fingerprint: Option<&str>) -> InstanceStatus {
    InstanceStatus {
        name: instance.name.clone(),
        provider_id: instance.provider_id.clone(),
        state: egress_api::InstanceState::Provisioning,
        ip: None,
        spec_hash: spec_hash.to_owned(),
        provider_fingerprint: fingerprint.map(str::to_owned),
        created_at: instance.created_at.map(time),
        draining_since: None,
    }
}

/// Builds the provider request, reading the cloud-init and credentials Secrets. A missing Secret or key is
/// transient: the Secret may be created after the Proxy.
/// `spec.destinations.deny` as rules; a malformed one is a permanent error naming it.
/// The Proxy's own deny rules, or a permanent error naming every malformed one with its index.
fn deny_rules(proxy: &Proxy) -> Result<Vec<DestinationRule>, ProviderError> {
    let deny = proxy.spec.destinations.as_ref().map(|destinations| destinations.deny.as_slice()).unwrap_or_default();
    let mut rules = Vec::with_capacity(deny.len());
    let mut problems = Vec::new();
    for (index, text) in deny.iter().enumerate() {
        match text.parse::<DestinationRule>() {
            Ok(rule) => rules.push(rule),
            Err(error) => problems.push(format!("spec.destinations.deny[{index}]: {error}")),
        }
    }
    if problems.is_empty() { Ok(rules) } else { Err(ProviderError::permanent(problems.join("; "))) }
}

/// A permanent error when the Proxy's own probe URL is one its proxy would refuse: it could never turn Ready.
fn check_probe_url(proxy: &Proxy, provider: &dyn Provider, deny: &[DestinationRule]) -> Result<(), ProviderError> {
    let Some(url) = proxy.spec.health_check.probe_url.as_deref() else { return Ok(()) };
    let Ok(probe) = egress_health::ProbeUrl::parse(url) else { return Ok(()) };
    match provider.destination_denial(probe.host(), probe.port(), probe.is_https(), deny) {
        None => Ok(()),
        Some(denial) => Err(ProviderError::permanent(format!(
            "spec.healthCheck.probeURL {url} is refused by the destination policy of provider {:?}: {denial}; probe \
             a public URL, or have it allowed in the provider's destinations (the operator's providers file)",
            proxy.spec.provider.as_deref().unwrap_or_default()
        ))),
    }
}

async fn create_request(
    proxy: &Proxy,
    context: &Context,
    facts: &Facts,
    provider: &dyn Provider,
) -> Result<CreateRequest, Error> {
    let deny_destinations = deny_rules(proxy)?;
    check_probe_url(proxy, provider, &deny_destinations)?;
    let uid = proxy.uid().unwrap_or_default();
    let namespace = proxy.namespace().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(context.client.clone(), &namespace);
    let read_key = |name: String, key: String| {
        let secrets = secrets.clone();
        let namespace = namespace.clone();
        async move {
            let secret = secrets.get_opt(&name).await?;
            let value =
                secret.and_then(|secret| secret.data).and_then(|mut data| data.remove(&key)).map(|bytes| bytes.0);
            value.ok_or_else(|| {
                Error::Provider(ProviderError::transient(format!("Secret {namespace}/{name} has no key {key:?} (yet)")))
            })
        }
    };
    let placement = proxy.spec.placement.clone().unwrap_or_default();
    let cloud_init = match &proxy.spec.cloud_init {
        Some(cloud_init) => match (&cloud_init.inline, &cloud_init.secret_ref) {
            (Some(inline), _) => Some(Sensitive::new(inline.clone().into_bytes())),
            (None, Some(reference)) => {
                Some(Sensitive::new(read_key(reference.name.clone(), reference.key.clone()).await?))
            }
            (None, None) => None,
        },
        None => None,
    };
    // From the credential store that probes and discovery read too, so all three use the same password.
    let credentials = match &proxy.spec.auth {
        Some(auth) => {
            let name = &auth.secret_ref.name;
            let found = context.credentials.credentials(&namespace, name).ok_or_else(|| {
                Error::Provider(ProviderError::transient(format!(
                    "auth Secret {namespace}/{name} is missing, lacks the keys username and password, or has not \
                     reached the operator's credential store yet"
                )))
            })?;
            Some(found)
        }
        None => None,
    };
    Ok(CreateRequest {
        name: egress_provider::instance_name(&uid, &facts.desired_hash),
        zone: placement.zone,
        machine_type: placement.machine_type,
        image: placement.image,
        cloud_init,
        port: u16::try_from(proxy.spec.port).unwrap_or(3128),
        credentials,
        tags: Tags::gc_contract(&context.config.cluster_id, &uid, &facts.desired_hash),
        deny_destinations,
    })
}

/// Writes the status with server-side apply, only when it differs from what was read. `cooldowns` belong to the
/// discovery API's own field manager: they are neither compared nor sent, so this apply never owns or removes them.
async fn write_status(
    proxy: &Proxy,
    context: &Context,
    before: &ProxyStatus,
    after: &ProxyStatus,
) -> Result<(), Error> {
    let without_cooldowns = |status: &ProxyStatus| ProxyStatus { cooldowns: Vec::new(), ..status.clone() };
    let after = &without_cooldowns(after);
    if &without_cooldowns(before) == after {
        return Ok(());
    }
    let api: Api<Proxy> = Api::namespaced(context.client.clone(), &proxy.namespace().unwrap_or_default());
    let patch = serde_json::json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "status": after,
    });
    api.patch_status(&proxy.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch)).await?;
    debug!(phase = ?after.phase, "status written");
    Ok(())
}

async fn cleanup(proxy: &Proxy, context: &Context) -> Result<Requeue, Error> {
    let uid = proxy.uid().unwrap_or_default();
    let skip = annotations::skip_cleanup(proxy);
    let name = provider_name(proxy).unwrap_or_default().to_owned();
    let configured = proxy.spec.mode == ProxyMode::External || context.providers.is_configured(&name);
    let mut remaining = BTreeSet::new();
    if proxy.spec.mode == ProxyMode::Managed && configured && !skip {
        let provider = context.providers.provider(&name).await?;
        let status = proxy.status.clone().unwrap_or_default();
        // Recorded instances, and any instance tagged with this Proxy's UID (a create whose result never reached
        // the status before a crash). A recorded instance whose Get fails other than NotFound is still deleted.
        for recorded in [&status.instance, &status.previous_instance].into_iter().flatten() {
            match provider.get(&recorded.provider_id).await {
                Err(error) if error.is_not_found() => {}
                _ => {
                    remaining.insert(recorded.provider_id.clone());
                }
            }
        }
        let tags = Tags::owned_by_cluster(&context.config.cluster_id).with(Tags::PROXY_UID, &uid);
        for instance in provider.list_by_tag(&tags).await? {
            remaining.insert(instance.provider_id);
        }
    }
    let remaining: Vec<String> = remaining.into_iter().collect();
    let recorded =
        proxy.status.as_ref().is_some_and(|status| status.instance.is_some() || status.previous_instance.is_some());
    match decide::decide_cleanup(proxy.spec.mode, skip, configured, recorded, &remaining) {
        CleanupDecision::Release { event } => {
            if let Some(event) = event {
                context.publish(proxy, &event).await;
            }
            context.metrics.phase(&proxy_id(proxy), None);
            info!("cleanup finished; releasing the finalizer");
            Ok(Requeue::AwaitChange)
        }
        CleanupDecision::ProviderMissing => {
            let error = Error::ProviderMissing(name);
            context
                .publish(proxy, &EventSpec { warning: true, reason: "ProviderMissing", note: error.to_string() })
                .await;
            Err(error)
        }
        CleanupDecision::Delete { provider_ids } => {
            let provider = context.providers.provider(provider_name(proxy).unwrap_or_default()).await?;
            for provider_id in &provider_ids {
                provider.delete(provider_id).await?;
            }
            let before = proxy.status.clone().unwrap_or_default();
            if before.phase != Some(ProxyPhase::Deleting) {
                let after = ProxyStatus { phase: Some(ProxyPhase::Deleting), ..before.clone() };
                write_status(proxy, context, &before, &after).await?;
                context.metrics.phase(&proxy_id(proxy), Some((ProxyPhase::Deleting, provider_label(proxy))));
            }
            debug!(instances = provider_ids.len(), "deleting instances; waiting until they are gone");
            Ok(Requeue::After(decide::DELETING_REQUEUE))
        }
    }
}

/// The instance names a Proxy owns: its current, previous and desired instances (the orphan collector keeps these),
/// the desired one on a provider whose instance fingerprint is `fingerprint`.
pub(crate) fn recorded_names(proxy: &Proxy, fingerprint: Option<&str>) -> Vec<String> {
    let status = proxy.status.clone().unwrap_or_default();
    let uid = proxy.uid().unwrap_or_default();
    let mut names: Vec<String> = [&status.instance, &status.previous_instance]
        .into_iter()
        .flatten()
        .map(|instance| instance.name.clone())
        .collect();
    names.push(egress_provider::instance_name(&uid, &proxy.desired_spec_hash_with(fingerprint)));
    names
}

/// The age of an instance from its recorded creation time.
pub(crate) fn age(created_at: Option<SystemTime>, first_seen: SystemTime, now: SystemTime) -> Duration {
    now.duration_since(created_at.unwrap_or(first_seen)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use egress_api::{CooldownStatus, ProxySpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn guarded(proxy: &Proxy) -> DeserializeGuard<Proxy> {
        DeserializeGuard(Ok(proxy.clone()))
    }

    #[test]
    fn status_writes_never_change_the_trigger_fingerprint_and_metadata_changes_do() {
        let mut proxy = Proxy::new("p", ProxySpec::new(ProxyMode::Managed));
        proxy.metadata.uid = Some("u-1".into());
        proxy.metadata.generation = Some(1);
        let base = trigger_fingerprint(&guarded(&proxy));
        // Anything in status, the discovery API's cooldowns included, and a new resourceVersion: no reconcile.
        let mut written = proxy.clone();
        written.metadata.resource_version = Some("42".into());
        written.status = Some(ProxyStatus {
            phase: Some(ProxyPhase::Ready),
            cooldowns: vec![CooldownStatus {
                target: "example.com".into(),
                site: None,
                until: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
                streak: 3,
                tenants: Vec::new(),
            }],
            ..ProxyStatus::default()
        });
        assert_eq!(trigger_fingerprint(&guarded(&written)), base);
        // What a reconcile depends on: each one changes it.
        let mut labelled = proxy.clone();
        labelled.metadata.labels = Some([("a".to_owned(), "b".to_owned())].into());
        let mut annotated = proxy.clone();
        annotated.metadata.annotations = Some([(egress_api::annotations::ROTATE.to_owned(), "1".to_owned())].into());
        let mut respecced = proxy.clone();
        respecced.metadata.generation = Some(2);
        let mut deleting = proxy.clone();
        deleting.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        for changed in [labelled, annotated, respecced, deleting] {
            assert_ne!(trigger_fingerprint(&guarded(&changed)), base, "{:?}", changed.metadata);
        }
    }
}
