//! The two lanes the Proxy controller runs in: a task sorts the feed's changes by their trigger fingerprint,
//! new Proxies, resyncs and health triggers to the bulk controller and changes to known Proxies to an urgent one;
//! a per-Proxy lock keeps the two from reconciling one Proxy at once, and the urgent lane hands its requeues to the
//! bulk lane, which alone keeps schedules.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use egress_api::Proxy;
use futures::{FutureExt, Stream, StreamExt};
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Config as RuntimeConfig, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use tracing::{Instrument, debug, info_span, warn};

use super::{Context, Trigger, error_policy, reconcile};
use crate::decide::Requeue;
use crate::feed::{Change, ProxyFeed};

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
pub(super) struct Lane {
    pub(super) store: Store<DeserializeGuard<Proxy>>,
    pub(super) handover: Option<tokio::sync::mpsc::UnboundedSender<Trigger>>,
}

impl Lane {
    /// The action for kube's scheduler: the bulk lane schedules `next` itself; the urgent lane asks the bulk lane to
    /// look again after that long, and schedules nothing.
    pub(super) fn action(&self, context: &Arc<Context>, object: &DeserializeGuard<Proxy>, next: Requeue) -> Action {
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
pub(super) fn receiver_stream<T: Send + 'static>(
    receiver: tokio::sync::mpsc::UnboundedReceiver<T>,
) -> impl Stream<Item = T> + Send {
    futures::stream::unfold(receiver, |mut receiver| async move { receiver.recv().await.map(|item| (item, receiver)) })
}

/// How many changes to known Proxies are reconciled at once, beside the bulk lane's `concurrency`.
pub(super) const URGENT_CONCURRENCY: u16 = 4;

/// A hash of what a reconcile depends on beyond the status it wrote itself: identity, generation (the spec), labels,
/// annotations (rotate, retry, skip-cleanup), finalizers and deletion. Status-only changes keep it.
pub(super) fn trigger_fingerprint(object: &DeserializeGuard<Proxy>) -> u64 {
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
pub(super) async fn drive(
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

#[cfg(test)]
mod tests {
    use super::*;
    use egress_api::{CooldownStatus, ProxyMode, ProxyPhase, ProxySpec, ProxyStatus};
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
