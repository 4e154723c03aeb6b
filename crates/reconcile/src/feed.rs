//! One reflector store of Proxies for the whole operator, and a fan-out of its changes.
//!
//! The controller, the health feed and the discovery view all read the same `Store` and are woken by the same
//! watch: one list-and-watch against the apiserver, not three. Changes fan out on a broadcast channel that never
//! blocks the watch; a subscriber that falls behind is handed every stored object again, which is safe because
//! every consumer is level-triggered.

use std::sync::Arc;

use egress_api::Proxy;
use futures::{Stream, StreamExt};
use kube::Client;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::broadcast;
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
}

impl ProxyFeed {
    /// Starts watching Proxies (in `namespace`, or all) into one store; the returned task drives the watch.
    pub fn start(client: Client, namespace: Option<&str>) -> (Self, JoinHandle<()>) {
        let api: Api<GuardedProxy> = match namespace {
            Some(namespace) => Api::namespaced(client, namespace),
            None => Api::all(client),
        };
        let (store, writer) = reflector::store();
        let (changes, _) = broadcast::channel(FAN_OUT_CAPACITY);
        let sender = changes.clone();
        let watch = reflector(writer, watcher(api, watcher::Config::default()))
            .default_backoff()
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
        (Self { store, changes }, task)
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
        let store = self.store.clone();
        futures::stream::unfold(
            (receiver, store, None::<Vec<Arc<GuardedProxy>>>),
            |(mut receiver, store, backlog)| async move {
                let mut backlog = match backlog {
                    Some(backlog) => backlog,
                    None => {
                        // A store whose writer is gone never becomes ready; then there is nothing to replay.
                        let _ = store.wait_until_ready().await;
                        store.state()
                    }
                };
                loop {
                    if let Some(object) = backlog.pop() {
                        return Some(((*object).clone(), (receiver, store, Some(backlog))));
                    }
                    match receiver.recv().await {
                        Ok(object) => return Some(((*object).clone(), (receiver, store, Some(backlog)))),
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
