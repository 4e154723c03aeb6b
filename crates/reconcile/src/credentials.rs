//! The one store of proxy auth Secrets, shared by creates, probes and discovery, so all three always agree and a
//! rotated Secret reaches them in one event.
//!
//! The operator never writes to a user's Secret. It watches the metadata of the Secrets in the namespaces it
//! watches (names and resource versions, never data) and reads with `get` only the Secrets that some Proxy names, so
//! the store holds exactly those, trimmed to `username` and `password`. Which Secrets are named it learns from the
//! Proxy store: a Proxy that starts naming a Secret gets it fetched at once, a Secret no Proxy names any more is
//! dropped from memory. A Secret created after the Proxy that names it, or rotated, reaches the store through its
//! metadata event. A relist of the metadata watch fetches again only the Secrets whose resource version moved.
//!
//! Rejected: a label on the user's Secret and a watch by that label (the operator needed `patch` on every Secret in
//! the Proxies' namespaces, and wrote to objects it does not own), and a watch of whole Secrets (every token and
//! Helm release in those namespaces would cross the wire and sit in memory).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use egress_fleet::ProxyCredentials;
use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::Secret;
use kube::Client;
use kube::ResourceExt;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{Instrument, debug, info_span, warn};

use crate::feed::{Change, Fanout, GuardedProxy, ProxyFeed, SecretIndex, auth_secret_of, reference_of, trim_metadata};

/// The auth Secrets that Proxies name, and which Proxy names which; see the module documentation.
///
/// The index of who names what is the one the store itself follows (its resolver updates it before it reads a
/// newly named Secret), so a consumer that hears of a changed Secret finds every Proxy that named it by then:
/// consumers keep no copy of their own.
#[derive(Clone)]
pub struct CredentialStore {
    secrets: Fanout<Secret>,
    named: Arc<RwLock<SecretIndex>>,
}

/// How often a named Secret whose read failed (not a 404) is read again.
const RETRY_FAILED_READS: Duration = Duration::from_secs(5);

/// Keeps only the two keys the operator reads from an auth Secret.
fn trim_secret(secret: &mut Secret) {
    trim_metadata(secret);
    secret.string_data = None;
    if let Some(data) = secret.data.as_mut() {
        data.retain(|key, _| key == "username" || key == "password");
    }
}

impl CredentialStore {
    /// Starts keeping the auth Secrets that the Proxies in `proxies` name (in `namespace`, or all). The store
    /// becomes ready after the Proxy store does and every Secret named then has been read. The returned task drives
    /// it; aborting it ends the store's watch too.
    pub fn start(client: Client, namespace: Option<&str>, proxies: &ProxyFeed) -> (Self, JoinHandle<()>) {
        let (sender, receiver) = mpsc::unbounded_channel();
        let events =
            stream::unfold(
                receiver,
                |mut receiver| async move { receiver.recv().await.map(|event| (Ok(event), receiver)) },
            );
        let (secrets, _store_task) = Fanout::spawn(events, trim_secret, "Secret");
        let named = Arc::new(RwLock::new(SecretIndex::default()));
        // A watch of `PartialObjectMeta` asks the apiserver for metadata only.
        let metadata: Api<PartialObjectMeta<Secret>> = match namespace {
            Some(namespace) => Api::namespaced(client.clone(), namespace),
            None => Api::all(client.clone()),
        };
        let resolver = Resolver {
            client,
            metadata,
            events: sender,
            named: named.clone(),
            held: HashMap::new(),
            failed: HashSet::new(),
        };
        let task = tokio::spawn(resolver.run(proxies.clone()).instrument(info_span!("credentials")));
        (Self { secrets, named }, task)
    }

    /// Whether the store is ready: see [`Fanout::ready`].
    pub async fn ready(&self) -> bool {
        self.secrets.ready().await
    }

    /// The store's changes: see [`Fanout::subscribe`].
    pub fn subscribe(&self) -> impl futures::Stream<Item = Change<Secret>> + Send + 'static {
        self.secrets.subscribe()
    }

    /// The Proxies a change of the store affects: those naming the changed Secret, or on a resync every Proxy that
    /// names one.
    pub fn affected(&self, change: &Change<Secret>) -> Vec<ObjectRef<GuardedProxy>> {
        self.named.read().unwrap_or_else(std::sync::PoisonError::into_inner).affected(change)
    }

    /// The credentials in `namespace/name`, when the store holds that Secret with both keys.
    pub fn credentials(&self, namespace: &str, name: &str) -> Option<ProxyCredentials> {
        let secret = self.secrets.store().get(&ObjectRef::new(name).within(namespace))?;
        let data = secret.data.as_ref()?;
        let field = |key: &str| data.get(key).map(|value| String::from_utf8_lossy(&value.0).into_owned());
        Some(ProxyCredentials::new(field("username")?, field("password")?))
    }

    /// Whether the store holds `namespace/name` (named by a Proxy, existing, and read).
    pub fn holds(&self, namespace: &str, name: &str) -> bool {
        self.secrets.store().get(&ObjectRef::new(name).within(namespace)).is_some()
    }
}

/// Turns Proxy changes and Secret metadata events into the store's watch events: the only task that writes it.
struct Resolver {
    client: Client,
    metadata: Api<PartialObjectMeta<Secret>>,
    events: mpsc::UnboundedSender<watcher::Event<Secret>>,
    /// Which Secret each Proxy names (shared with the store's consumers; written here only).
    named: Arc<RwLock<SecretIndex>>,
    /// What the store holds (as sent to it), so a relist can be replayed and an unchanged version skipped.
    held: HashMap<ObjectRef<Secret>, Secret>,
    /// Named Secrets whose read failed for a reason other than absence; read again every few seconds.
    failed: HashSet<ObjectRef<Secret>>,
}

impl Resolver {
    async fn run(mut self, proxies: ProxyFeed) {
        let mut proxy_changes = proxies.subscribe().boxed();
        // The first change is the resync of a ready Proxy store: every Secret named then is read before the store
        // says it is ready, so no Proxy looks as if its Secret were missing while the operator starts.
        match proxy_changes.next().await {
            Some(change) => self.proxies_changed(&proxies, &change).await,
            None => return,
        }
        let mut secrets = watcher(self.metadata.clone(), watcher::Config::default()).default_backoff().boxed();
        let mut listed: Option<HashSet<ObjectRef<Secret>>> = None;
        let mut retry = tokio::time::interval(RETRY_FAILED_READS);
        retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                change = proxy_changes.next() => match change {
                    Some(change) => self.proxies_changed(&proxies, &change).await,
                    None => return,
                },
                event = secrets.next() => match event {
                    Some(Ok(event)) => self.secret_event(event, &mut listed).await,
                    Some(Err(error)) => debug!(%error, "Secret metadata watch error; the watcher retries"),
                    None => return,
                },
                _ = retry.tick() => {
                    for secret in std::mem::take(&mut self.failed) {
                        if self.names(&secret) {
                            self.read(&secret).await;
                        }
                    }
                }
            }
            if self.events.is_closed() {
                return;
            }
        }
    }

    /// Follows which Secrets are named: reads a newly named one, drops one no Proxy names any more.
    async fn proxies_changed(&mut self, proxies: &ProxyFeed, change: &Change<crate::GuardedProxy>) {
        let (before, after) = {
            let mut index = self.named.write().unwrap_or_else(std::sync::PoisonError::into_inner);
            let before: HashSet<ObjectRef<Secret>> = index.secrets().cloned().collect();
            match change {
                Change::Object(reference) => {
                    let secret =
                        proxies.proxy(reference).and_then(|proxy| proxy.0.as_ref().ok().and_then(auth_secret_of));
                    index.set(reference, secret);
                }
                Change::Resync => {
                    let mut named = SecretIndex::default();
                    for proxy in proxies.store().state() {
                        if let Ok(valid) = proxy.0.as_ref() {
                            named.set(&reference_of(proxy.as_ref()), auth_secret_of(valid));
                        }
                    }
                    *index = named;
                }
            }
            let after: HashSet<ObjectRef<Secret>> = index.secrets().cloned().collect();
            (before, after)
        };
        for gone in before.difference(&after) {
            self.forget(gone);
        }
        // A Secret named before but not held (absent) is read when it appears, from its metadata event.
        for new in after.difference(&before) {
            if !self.held.contains_key(new) {
                self.read(new).await;
            }
        }
    }

    async fn secret_event(
        &mut self,
        event: watcher::Event<PartialObjectMeta<Secret>>,
        listed: &mut Option<HashSet<ObjectRef<Secret>>>,
    ) {
        match event {
            watcher::Event::Init => *listed = Some(HashSet::new()),
            watcher::Event::InitApply(meta) => {
                let reference = secret_reference(&meta);
                if let Some(listed) = listed.as_mut() {
                    listed.insert(reference.clone());
                }
                self.refresh(&reference, &meta).await;
            }
            watcher::Event::Apply(meta) => self.refresh(&secret_reference(&meta), &meta).await,
            watcher::Event::Delete(meta) => self.forget(&secret_reference(&meta)),
            watcher::Event::InitDone => {
                // Deleted while the watch was down: held, but absent from the new list.
                let listed = listed.take().unwrap_or_default();
                let vanished: Vec<_> = self.held.keys().filter(|held| !listed.contains(held)).cloned().collect();
                for secret in vanished {
                    self.forget(&secret);
                }
                // Replayed as a list, so the store's consumers resynchronise against it.
                self.send(watcher::Event::Init);
                for secret in self.held.values() {
                    self.send(watcher::Event::InitApply(secret.clone()));
                }
                self.send(watcher::Event::InitDone);
            }
        }
    }

    /// Whether some Proxy names `secret`.
    fn names(&self, secret: &ObjectRef<Secret>) -> bool {
        self.named.read().unwrap_or_else(std::sync::PoisonError::into_inner).names(secret)
    }

    /// Reads a named Secret whose metadata changed (or appeared); an unnamed one is not read.
    async fn refresh(&mut self, reference: &ObjectRef<Secret>, meta: &PartialObjectMeta<Secret>) {
        if !self.names(reference) {
            return;
        }
        let held_version = self.held.get(reference).and_then(|secret| secret.metadata.resource_version.as_deref());
        if held_version.is_some() && held_version == meta.metadata.resource_version.as_deref() {
            return;
        }
        self.read(reference).await;
    }

    async fn read(&mut self, reference: &ObjectRef<Secret>) {
        let namespace = reference.namespace.as_deref().unwrap_or_default();
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        match secrets.get_opt(&reference.name).await {
            Ok(Some(mut secret)) => {
                self.failed.remove(reference);
                trim_secret(&mut secret);
                self.held.insert(reference.clone(), secret.clone());
                self.send(watcher::Event::Apply(secret));
            }
            Ok(None) => {
                self.failed.remove(reference);
                self.forget(reference);
            }
            Err(error) => {
                warn!(secret = %reference, %error, "could not read a Proxy's auth Secret; reading it again shortly");
                self.failed.insert(reference.clone());
            }
        }
    }

    fn forget(&mut self, reference: &ObjectRef<Secret>) {
        self.failed.remove(reference);
        if let Some(secret) = self.held.remove(reference) {
            self.send(watcher::Event::Delete(secret));
        }
    }

    fn send(&self, event: watcher::Event<Secret>) {
        // Closed only when the store's task is gone; `run` then ends.
        drop(self.events.send(event));
    }
}

fn secret_reference(meta: &PartialObjectMeta<Secret>) -> ObjectRef<Secret> {
    ObjectRef::new(&meta.name_any()).within(&meta.namespace().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_secret_keeps_only_the_user_name_and_the_password() {
        let mut secret: Secret = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "auth", "namespace": "ns", "managedFields": [],
                         "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"}},
            "data": {"username": "dQ==", "password": "cA==", "token": "dA=="},
            "stringData": {"other": "x"}
        }))
        .unwrap();
        trim_secret(&mut secret);
        let keys: Vec<_> = secret.data.as_ref().unwrap().keys().cloned().collect();
        assert_eq!(keys, ["password", "username"]);
        assert!(secret.string_data.is_none() && secret.metadata.managed_fields.is_none());
        assert!(secret.metadata.annotations.is_none());
    }
}
