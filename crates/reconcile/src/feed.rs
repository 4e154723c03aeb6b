//! One reflector store of Proxies for the whole operator, and a fan-out of its changes.
//!
//! The controller, the health feed and the discovery view all read the same `Store` and are woken by the same
//! watch: one list-and-watch against the apiserver, not three. Changes fan out on a broadcast channel that never
//! blocks the watch; a subscriber that falls behind is handed every stored object again, which is safe because
//! every consumer is level-triggered.
//!
//! Readiness: wait on [`ProxyFeed::ready`], never on `Store::wait_until_ready` of a store that is not yet ready.
//! kube-runtime keeps a store's readiness in a one-shot channel that holds one waker, so when several tasks wait
//! on it at once only the last one to poll is woken; the others wait forever (the controller's runner among them,
//! which is how a controller on this store once never reconciled). The feed flips its own `watch` flag when the
//! reflector reports the initial list done, which wakes every waiter; whoever waits on the store after that finds
//! the value already sent.

use std::sync::Arc;

use egress_api::Proxy;
use futures::{Stream, StreamExt};
use kube::Client;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::{broadcast, watch as flag};
use tokio::task::JoinHandle;
use tracing::{Instrument, debug, info_span};

/// How many changes may wait for the slowest subscriber before it is resynchronised from the store.
const FAN_OUT_CAPACITY: usize = 4096;

/// The watched Proxies.
pub type GuardedProxy = DeserializeGuard<Proxy>;

/// The shared store and its change fan-out. Cloning shares both.
#[derive(Clone)]
pub struct ProxyFeed {
    store: Store<GuardedProxy>,
    changes: broadcast::Sender<Arc<GuardedProxy>>,
    ready: flag::Receiver<bool>,
}

impl ProxyFeed {
    /// Starts watching Proxies (in `namespace`, or all) into one store; the returned task drives the watch.
    pub fn start(client: Client, namespace: Option<&str>) -> (Self, JoinHandle<()>) {
        let api: Api<GuardedProxy> = match namespace {
            Some(namespace) => Api::namespaced(client, namespace),
            None => Api::all(client),
        };
        Self::spawn(watcher(api, watcher::Config::default()).default_backoff())
    }

    /// Keeps a store from a stream of watch events; the returned task drives the stream.
    fn spawn(
        events: impl Stream<Item = Result<watcher::Event<GuardedProxy>, watcher::Error>> + Send + 'static,
    ) -> (Self, JoinHandle<()>) {
        let (store, writer) = reflector::store();
        let (changes, _) = broadcast::channel(FAN_OUT_CAPACITY);
        let sender = changes.clone();
        let (ready_sender, ready) = flag::channel(false);
        let watch = reflector(writer, events)
            .inspect(move |event| {
                // The reflector has applied the event to the store before it yields it.
                if matches!(event, Ok(watcher::Event::InitDone)) {
                    ready_sender.send_replace(true);
                }
            })
            .applied_objects()
            .for_each(move |object| {
                match object {
                    // No subscriber is fine (a follower, or before the first term): the store is still kept.
                    Ok(object) => drop(sender.send(Arc::new(object))),
                    Err(error) => debug!(%error, "Proxy watch error; the watcher retries"),
                }
                async {}
            });
        let task = tokio::spawn(watch.instrument(info_span!("proxy_store")));
        (Self { store, changes, ready }, task)
    }

    /// Resolves once the store holds the initial list (`true`), or when the watch task is gone without it
    /// (`false`). Any number of tasks may wait at once.
    pub async fn ready(&self) -> bool {
        wait_ready(self.ready.clone()).await
    }

    /// The shared store.
    pub fn store(&self) -> Store<GuardedProxy> {
        self.store.clone()
    }

    /// Every stored object, then every change from now on; after falling behind, every stored object once more.
    ///
    /// The stream first waits for the store's initial list to complete, then replays it: a subscriber that arrives
    /// after the list (a controller starting when this replica becomes leader) would otherwise never hear of
    /// objects that do not change, and one that arrives during it would look them up before the store has them.
    /// The receiver is subscribed at once, so nothing that changes meanwhile is lost.
    pub fn subscribe(&self) -> impl Stream<Item = GuardedProxy> + Send + 'static {
        let receiver = self.changes.subscribe();
        // The stream holds no sender of its own, so it ends when the feed is gone.
        let state = (receiver, self.store.clone(), self.ready.clone());
        futures::stream::unfold(
            (state, None::<Vec<Arc<GuardedProxy>>>),
            |((mut receiver, store, ready), backlog)| async move {
                let mut backlog = match backlog {
                    Some(backlog) => backlog,
                    None => {
                        // A feed whose watch is gone never becomes ready; then there is nothing to replay.
                        wait_ready(ready.clone()).await;
                        store.state()
                    }
                };
                loop {
                    if let Some(object) = backlog.pop() {
                        return Some(((*object).clone(), ((receiver, store, ready), Some(backlog))));
                    }
                    match receiver.recv().await {
                        Ok(object) => return Some(((*object).clone(), ((receiver, store, ready), Some(backlog)))),
                        Err(broadcast::error::RecvError::Lagged(missed)) => {
                            debug!(missed, "a Proxy change subscriber fell behind; replaying the store");
                            backlog = store.state();
                        }
                        Err(broadcast::error::RecvError::Closed) => return None,
                    }
                }
            },
        )
    }
}

async fn wait_ready(mut ready: flag::Receiver<bool>) -> bool {
    ready.wait_for(|ready| *ready).await.is_ok()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kube::ResourceExt;
    use kube::api::ObjectMeta;
    use tokio::sync::mpsc;
    use tokio::time::timeout;

    use super::*;

    const PATIENCE: Duration = Duration::from_secs(2);

    fn proxy(name: &str) -> GuardedProxy {
        let mut proxy = Proxy::new(name, serde_json::from_value(serde_json::json!({"mode": "External"})).unwrap());
        proxy.metadata = ObjectMeta { name: Some(name.into()), namespace: Some("ns".into()), ..ObjectMeta::default() };
        DeserializeGuard(Ok(proxy))
    }

    type Events = mpsc::UnboundedSender<Result<watcher::Event<GuardedProxy>, watcher::Error>>;

    fn feed() -> (ProxyFeed, Events, JoinHandle<()>) {
        let (events, receiver) = mpsc::unbounded_channel();
        let stream = futures::stream::unfold(receiver, |mut receiver| async move {
            receiver.recv().await.map(|event| (event, receiver))
        });
        let (feed, task) = ProxyFeed::spawn(stream);
        (feed, events, task)
    }

    async fn let_waiters_park() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    /// Why the feed has its own readiness flag: kube's store wakes only the last of several concurrent waiters.
    /// If this starts failing, kube fixed it and `ProxyFeed::ready` could go back to `Store::wait_until_ready`.
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
                    // After the feed is ready, the store's own wait returns at once, for every caller.
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
    async fn subscribers_replay_the_initial_list_then_follow_changes() {
        let (feed, events, _task) = feed();
        let mut early = feed.subscribe().boxed();
        events.send(Ok(watcher::Event::Init)).unwrap();
        events.send(Ok(watcher::Event::InitApply(proxy("a")))).unwrap();
        events.send(Ok(watcher::Event::InitDone)).unwrap();
        let first = timeout(PATIENCE, early.next()).await.expect("replay").expect("an object");
        assert_eq!(first.name_any(), "a");
        // A subscriber that arrives after the list still hears of the object that never changes again.
        let mut late = feed.subscribe().boxed();
        assert_eq!(timeout(PATIENCE, late.next()).await.expect("replay").expect("an object").name_any(), "a");
        events.send(Ok(watcher::Event::Apply(proxy("b")))).unwrap();
        for subscriber in [&mut early, &mut late] {
            // One that subscribed during the list may hear of "a" twice (replay and change); consumers are
            // level-triggered, so repeats are harmless, but nothing may be missed.
            loop {
                let next = timeout(PATIENCE, subscriber.next()).await.expect("a change").expect("an object");
                match next.name_any().as_str() {
                    "b" => break,
                    "a" => {}
                    other => panic!("unexpected object {other}"),
                }
            }
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_watch_that_ends_before_its_list_is_never_ready() {
        let (feed, events, task) = feed();
        drop(events);
        task.await.unwrap();
        assert!(!timeout(PATIENCE, feed.ready()).await.expect("ready resolves when the watch is gone"));
    }
}
