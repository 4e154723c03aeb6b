//! One reflector store per kind the operator reads (Proxies, pools, and the auth Secrets Proxies name: see
//! [`crate::credentials`]), and an incremental fan-out of its changes.
//!
//! Every consumer (the controller, the health feed, the discovery view) reads the same `Store` and is told which
//! object changed: the fan-out carries object references only, never objects, so a change costs each consumer one
//! lookup of an `Arc` in the store, whatever the fleet's size. A consumer treats a reference it can no longer find as
//! a deletion, so deletions need no event of their own and a late lookup always sees the newest object. When the
//! watch relists (after a restart of the watch, or the first list) or a consumer falls behind the channel, the
//! consumer is told to [`Change::Resync`]: it compares its own entries against the store, visiting `Arc`s without
//! cloning objects; that costs O(n) once, never O(n) per change.
//!
//! Objects are trimmed before they are stored (managed fields and the last-applied annotation go), so the store
//! holds only what the operator reads.
//!
//! Why not kube's own shared-stream dispatcher (`reflect_shared` with `Writer::subscribe`): it announces no
//! deletions, a subscriber can only be made from the writer (which the watch owns once it runs, while the leader's
//! controller subscribes anew each term), a subscriber that is not being polled holds the watch back, and a handle
//! whose object was deleted before it looked it up returns `Pending` without a wake-up. The controller still runs on
//! kube's shared-stream API (`Controller::for_shared_stream`), fed from this fan-out.
//!
//! Readiness: wait on [`Fanout::ready`], never on `Store::wait_until_ready` of a store that is not yet ready.
//! kube-runtime keeps a store's readiness in a one-shot channel that holds one waker, so when several tasks wait on
//! it at once only the last one to poll is woken. The fan-out flips its own `watch` flag when the reflector reports
//! the initial list done, which wakes every waiter.

use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::sync::Arc;

use egress_api::{Proxy, ProxyPool};
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::Client;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::{broadcast, watch as flag};
use tokio::task::JoinHandle;
use tracing::{Instrument, debug, info_span};

/// How many changes may wait for the slowest consumer before it is told to resynchronise.
const FAN_OUT_CAPACITY: usize = 16_384;

/// The watched Proxies.
pub type GuardedProxy = DeserializeGuard<Proxy>;

/// What a consumer is told.
#[derive(Debug)]
pub enum Change<K: Resource<DynamicType = ()>> {
    /// This object changed or is gone: look it up in the store.
    Object(ObjectRef<K>),
    /// Compare everything against the store (after a relist, or after falling behind).
    Resync,
}

impl<K: Resource<DynamicType = ()>> Clone for Change<K> {
    fn clone(&self) -> Self {
        match self {
            Self::Object(reference) => Self::Object(reference.clone()),
            Self::Resync => Self::Resync,
        }
    }
}

/// A reflector store and its change fan-out. Cloning shares both.
pub struct Fanout<K: Resource<DynamicType = ()> + 'static> {
    store: Store<K>,
    changes: broadcast::Sender<Change<K>>,
    ready: flag::Receiver<bool>,
}

impl<K: Resource<DynamicType = ()> + 'static> Clone for Fanout<K> {
    fn clone(&self) -> Self {
        Self { store: self.store.clone(), changes: self.changes.clone(), ready: self.ready.clone() }
    }
}

impl<K> Fanout<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + Send + Sync + 'static,
{
    /// Keeps a store from a stream of watch events, each object passed through `trim` first; the returned task
    /// drives the stream.
    pub fn spawn(
        events: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
        trim: fn(&mut K),
        name: &'static str,
    ) -> (Self, JoinHandle<()>) {
        let (store, mut writer) = reflector::store();
        let (changes, _) = broadcast::channel(FAN_OUT_CAPACITY);
        let sender = changes.clone();
        let (ready_sender, ready) = flag::channel(false);
        let watch = events.for_each(move |event| {
            match event {
                Ok(event) => {
                    let event = event.modify(trim);
                    writer.apply_watcher_event(&event);
                    // Announced after the store holds the change. No consumer is fine: the store is still kept.
                    match &event {
                        watcher::Event::Apply(object) | watcher::Event::Delete(object) => {
                            drop(sender.send(Change::Object(reference_of(object))));
                        }
                        watcher::Event::InitDone => {
                            drop(sender.send(Change::Resync));
                            ready_sender.send_replace(true);
                        }
                        watcher::Event::Init | watcher::Event::InitApply(_) => {}
                    }
                }
                Err(error) => debug!(%error, kind = name, "watch error; the watcher retries"),
            }
            async {}
        });
        let task = tokio::spawn(watch.instrument(info_span!("store", kind = name)));
        (Self { store, changes, ready }, task)
    }

    /// Resolves once the store holds the initial list (`true`), or when the watch task is gone without it
    /// (`false`). Any number of tasks may wait at once.
    pub async fn ready(&self) -> bool {
        wait_ready(self.ready.clone()).await
    }

    /// Whether the store holds the initial list.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// The shared store.
    pub fn store(&self) -> Store<K> {
        self.store.clone()
    }

    /// The changes from now on, starting with a [`Change::Resync`] once the store is ready, so a consumer that
    /// arrives late (a controller starting when this replica becomes leader) still hears of every object. A
    /// consumer that falls behind gets a `Resync` in place of what it missed. The stream ends with the watch.
    pub fn subscribe(&self) -> impl Stream<Item = Change<K>> + Send + 'static {
        // Subscribed at once, so nothing that changes while the consumer waits for the list is lost.
        let receiver = self.changes.subscribe();
        let ready = self.ready.clone();
        futures::stream::unfold((receiver, ready, false), |(mut receiver, ready, started)| async move {
            if !started {
                // A fan-out whose watch is gone never becomes ready; then there is nothing to hear.
                if !wait_ready(ready.clone()).await {
                    return None;
                }
                return Some((Change::Resync, (receiver, ready, true)));
            }
            match receiver.recv().await {
                Ok(change) => Some((change, (receiver, ready, true))),
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    debug!(missed, "a change consumer fell behind; it resynchronises");
                    Some((Change::Resync, (receiver, ready, true)))
                }
                Err(broadcast::error::RecvError::Closed) => None,
            }
        })
    }
}

/// A reference to `object` by namespace and name only, the way the store keys it (no resource version or UID to
/// carry around in long-lived maps).
pub fn reference_of<K: Resource<DynamicType = ()>>(object: &K) -> ObjectRef<K> {
    let mut reference = ObjectRef::new(&object.name_any());
    reference.namespace = object.namespace();
    reference
}

/// The operator's Proxy store.
pub type ProxyFeed = Fanout<GuardedProxy>;

/// The watched ProxyPools.
pub type GuardedPool = DeserializeGuard<ProxyPool>;

/// The operator's ProxyPool store: the pool controller reads it on the leader, discovery on every replica.
pub type PoolFeed = Fanout<GuardedPool>;

/// Drops what no consumer reads, so the store holds a small object: managed fields, and the copy of the whole
/// object that `kubectl apply` keeps in an annotation.
pub(crate) fn trim_metadata<K: Resource>(object: &mut K) {
    let metadata = object.meta_mut();
    metadata.managed_fields = None;
    if let Some(annotations) = metadata.annotations.as_mut() {
        annotations.remove("kubectl.kubernetes.io/last-applied-configuration");
        if annotations.is_empty() {
            metadata.annotations = None;
        }
    }
}

fn trim_proxy(object: &mut GuardedProxy) {
    if let Ok(proxy) = object.0.as_mut() {
        trim_metadata(proxy);
    }
}

/// Watches `K` (in `namespace`, or all) with `config`, with kube's default watch backoff.
fn watch<K>(
    client: Client,
    namespace: Option<&str>,
    config: watcher::Config,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + 'static,
{
    let api: Api<K> = match namespace {
        Some(namespace) => Api::namespaced(client, namespace),
        None => Api::all(client),
    };
    watcher(api, config).default_backoff()
}

impl ProxyFeed {
    /// Starts watching Proxies (in `namespace`, or all) into one store; the returned task drives the watch.
    pub fn start(client: Client, namespace: Option<&str>) -> (Self, JoinHandle<()>) {
        Self::spawn(watch(client, namespace, watcher::Config::default()), trim_proxy, "Proxy")
    }

    /// The valid Proxy behind a reference, when the store holds one.
    pub fn proxy(&self, reference: &ObjectRef<GuardedProxy>) -> Option<Arc<GuardedProxy>> {
        self.store.get(reference)
    }
}

fn trim_pool(object: &mut GuardedPool) {
    if let Ok(pool) = object.0.as_mut() {
        trim_metadata(pool);
    }
}

impl PoolFeed {
    /// Starts watching ProxyPools (in `namespace`, or all) into one store; the returned task drives the watch.
    pub fn start(client: Client, namespace: Option<&str>) -> (Self, JoinHandle<()>) {
        Self::spawn(watch(client, namespace, watcher::Config::default()), trim_pool, "ProxyPool")
    }
}

/// The reference of a Secret as the credential store keys it.
pub fn secret_ref(namespace: &str, name: &str) -> ObjectRef<Secret> {
    ObjectRef::new(name).within(namespace)
}

/// The auth Secret a Proxy names, as a store reference.
pub fn auth_secret_of(proxy: &Proxy) -> Option<ObjectRef<Secret>> {
    let auth = proxy.spec.auth.as_ref()?;
    Some(secret_ref(&proxy.namespace().unwrap_or_default(), &auth.secret_ref.name))
}

/// Which auth Secret each Proxy names, and which Proxies each Secret serves: what a consumer of both stores needs
/// to recompute exactly the Proxies a changed Secret affects.
#[derive(Default)]
pub struct SecretIndex {
    secret_of: HashMap<ObjectRef<GuardedProxy>, ObjectRef<Secret>>,
    users_of: HashMap<ObjectRef<Secret>, HashSet<ObjectRef<GuardedProxy>>>,
}

impl SecretIndex {
    /// Records that `proxy` names `secret` (or none, or is gone).
    pub fn set(&mut self, proxy: &ObjectRef<GuardedProxy>, secret: Option<ObjectRef<Secret>>) {
        let previous = match secret.clone() {
            Some(secret) => self.secret_of.insert(proxy.clone(), secret),
            None => self.secret_of.remove(proxy),
        };
        if previous == secret {
            return;
        }
        if let Some(previous) = previous
            && let Some(users) = self.users_of.get_mut(&previous)
        {
            users.remove(proxy);
            if users.is_empty() {
                self.users_of.remove(&previous);
            }
        }
        if let Some(secret) = secret {
            self.users_of.entry(secret).or_default().insert(proxy.clone());
        }
    }

    /// The Proxies a change of the credential store affects: those naming the changed Secret, or on a resync all
    /// that name one.
    pub fn affected(&self, change: &Change<Secret>) -> Vec<ObjectRef<GuardedProxy>> {
        match change {
            Change::Object(secret) => self.users_of.get(secret).into_iter().flatten().cloned().collect(),
            Change::Resync => self.secret_of.keys().cloned().collect(),
        }
    }

    /// Every Proxy that names a Secret.
    pub fn proxies(&self) -> impl Iterator<Item = &ObjectRef<GuardedProxy>> {
        self.secret_of.keys()
    }

    /// Every Secret that some Proxy names.
    pub fn secrets(&self) -> impl Iterator<Item = &ObjectRef<Secret>> {
        self.users_of.keys()
    }

    /// Whether some Proxy names `secret`.
    pub fn names(&self, secret: &ObjectRef<Secret>) -> bool {
        self.users_of.contains_key(secret)
    }
}

async fn wait_ready(mut ready: flag::Receiver<bool>) -> bool {
    ready.wait_for(|ready| *ready).await.is_ok()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kube::api::ObjectMeta;
    use tokio::sync::mpsc;
    use tokio::time::timeout;

    use super::*;

    const PATIENCE: Duration = Duration::from_secs(2);

    fn proxy(name: &str) -> GuardedProxy {
        let mut proxy = Proxy::new(name, serde_json::from_value(serde_json::json!({"mode": "External"})).unwrap());
        proxy.metadata = ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns".into()),
            annotations: Some(
                [("kubectl.kubernetes.io/last-applied-configuration".to_owned(), "{}".to_owned())].into(),
            ),
            managed_fields: Some(Vec::new()),
            ..ObjectMeta::default()
        };
        DeserializeGuard(Ok(proxy))
    }

    type Events = mpsc::UnboundedSender<Result<watcher::Event<GuardedProxy>, watcher::Error>>;

    fn feed() -> (ProxyFeed, Events, JoinHandle<()>) {
        let (events, receiver) = mpsc::unbounded_channel();
        let stream = futures::stream::unfold(receiver, |mut receiver| async move {
            receiver.recv().await.map(|event| (event, receiver))
        });
        let (feed, task) = ProxyFeed::spawn(stream, trim_proxy, "Proxy");
        (feed, events, task)
    }

    async fn let_waiters_park() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    fn name(change: &Change<GuardedProxy>) -> String {
        match change {
            Change::Object(reference) => reference.name.clone(),
            Change::Resync => "<resync>".into(),
        }
    }

    /// Why the fan-out has its own readiness flag: kube's store wakes only the last of several concurrent waiters.
    /// If this starts failing, kube fixed it and `Fanout::ready` could go back to `Store::wait_until_ready`.
    #[tokio::test(flavor = "current_thread")]
    async fn kube_store_readiness_wakes_only_the_last_of_concurrent_waiters() {
        let (store, mut writer) = reflector::store::<GuardedProxy>();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move { store.wait_until_ready().await.is_ok() })
            })
            .collect();
        let_waiters_park().await;
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitDone);
        let mut woken = 0;
        for waiter in waiters {
            if timeout(Duration::from_millis(300), waiter).await.is_ok() {
                woken += 1;
            }
        }
        assert_eq!(woken, 1, "kube-runtime's store readiness now wakes {woken} of 3 concurrent waiters");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn every_concurrent_waiter_sees_the_feed_ready_and_the_store_too() {
        let (feed, events, _task) = feed();
        let waiters: Vec<_> = (0..5)
            .map(|index| {
                let feed = feed.clone();
                tokio::spawn(async move {
                    let ready = feed.ready().await;
                    let store_ready = feed.store().wait_until_ready().await.is_ok();
                    (index, ready && store_ready, feed.store().state().len())
                })
            })
            .collect();
        let_waiters_park().await;
        events.send(Ok(watcher::Event::Init)).unwrap();
        events.send(Ok(watcher::Event::InitApply(proxy("a")))).unwrap();
        events.send(Ok(watcher::Event::InitDone)).unwrap();
        for waiter in waiters {
            let (index, ready, stored) = timeout(PATIENCE, waiter).await.expect("a waiter was never woken").unwrap();
            assert!(ready, "waiter {index} saw the feed fail");
            assert_eq!(stored, 1, "waiter {index} ran before the store held the initial list");
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn consumers_start_with_a_resync_then_hear_each_change_by_reference() {
        let (feed, events, _task) = feed();
        let mut early = feed.subscribe().boxed();
        events.send(Ok(watcher::Event::Init)).unwrap();
        events.send(Ok(watcher::Event::InitApply(proxy("a")))).unwrap();
        events.send(Ok(watcher::Event::InitDone)).unwrap();
        assert_eq!(name(&timeout(PATIENCE, early.next()).await.unwrap().unwrap()), "<resync>");
        // A consumer that arrives after the list starts with a resync too.
        let mut late = feed.subscribe().boxed();
        assert_eq!(name(&timeout(PATIENCE, late.next()).await.unwrap().unwrap()), "<resync>");
        events.send(Ok(watcher::Event::Apply(proxy("b")))).unwrap();
        events.send(Ok(watcher::Event::Delete(proxy("a")))).unwrap();
        for consumer in [&mut early, &mut late] {
            let mut heard = Vec::new();
            while heard.len() < 3 && !heard.contains(&"a".to_owned()) {
                heard.push(name(&timeout(PATIENCE, consumer.next()).await.unwrap().unwrap()));
            }
            // The early consumer also hears the InitDone resync it was subscribed for.
            heard.retain(|name| name != "<resync>");
            assert_eq!(heard, ["b", "a"]);
        }
        let stored = feed.proxy(&ObjectRef::new("b").within("ns")).expect("b is stored");
        let stored = stored.0.as_ref().unwrap();
        assert!(stored.metadata.managed_fields.is_none() && stored.metadata.annotations.is_none(), "trimmed");
        assert!(feed.proxy(&ObjectRef::new("a").within("ns")).is_none(), "a deletion is a reference not found");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_consumer_that_falls_behind_is_told_to_resync() {
        let (feed, events, _task) = feed();
        events.send(Ok(watcher::Event::Init)).unwrap();
        events.send(Ok(watcher::Event::InitDone)).unwrap();
        let mut slow = feed.subscribe().boxed();
        assert_eq!(name(&timeout(PATIENCE, slow.next()).await.unwrap().unwrap()), "<resync>");
        for index in 0..FAN_OUT_CAPACITY + 10 {
            events.send(Ok(watcher::Event::Apply(proxy(&format!("p{index}"))))).unwrap();
        }
        // Let the watch task apply everything before the slow consumer reads again.
        while feed.store().state().len() < FAN_OUT_CAPACITY + 10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(name(&timeout(PATIENCE, slow.next()).await.unwrap().unwrap()), "<resync>");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_watch_that_ends_before_its_list_is_never_ready() {
        let (feed, events, task) = feed();
        drop(events);
        task.await.unwrap();
        assert!(!timeout(PATIENCE, feed.ready()).await.expect("ready resolves when the watch is gone"));
        assert!(feed.subscribe().boxed().next().await.is_none());
    }
}
