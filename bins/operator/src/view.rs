//! Adapts the operator's Proxy store and health board to the discovery API's `ProxyView`.
//!
//! Credentials for proxy URLs are read from the Proxies' auth Secrets by a background refresher, so the view itself
//! never waits on the API server.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use egress_api::Proxy;
use egress_discovery::{ProxyRecord, ProxyView};
use egress_reconcile::{HealthBoard, ProxyFeed};
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::{Client, ResourceExt};

type Credentials = HashMap<(String, String), (String, String)>;

/// The view.
pub struct StoreView {
    feed: ProxyFeed,
    board: HealthBoard,
    credentials: RwLock<Credentials>,
    synced: AtomicBool,
}

impl StoreView {
    pub fn new(feed: ProxyFeed, board: HealthBoard) -> Self {
        Self { feed, board, credentials: RwLock::default(), synced: AtomicBool::new(false) }
    }

    fn valid(&self) -> Vec<Proxy> {
        self.feed.store().state().iter().filter_map(|object| object.0.as_ref().ok().cloned()).collect()
    }

    /// Waits for the store's first full list, then keeps the credentials fresh every `interval`.
    pub async fn run(self: Arc<Self>, client: Client, interval: Duration) {
        if !self.feed.ready().await {
            return;
        }
        let mut tick = tokio::time::interval(interval);
        loop {
            let mut fresh = Credentials::new();
            for proxy in self.valid() {
                let Some(auth) = &proxy.spec.auth else { continue };
                let namespace = proxy.namespace().unwrap_or_default();
                let key = (namespace.clone(), auth.secret_ref.name.clone());
                if fresh.contains_key(&key) {
                    continue;
                }
                let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
                if let Ok(Some(secret)) = secrets.get_opt(&auth.secret_ref.name).await {
                    let data = secret.data.unwrap_or_default();
                    let field = |name: &str| data.get(name).map(|value| String::from_utf8_lossy(&value.0).into_owned());
                    if let (Some(user), Some(password)) = (field("username"), field("password")) {
                        fresh.insert(key, (user, password));
                    }
                }
            }
            *self.credentials.write().expect("credentials lock") = fresh;
            self.synced.store(true, Ordering::SeqCst);
            tick.tick().await;
        }
    }
}

impl ProxyView for StoreView {
    fn synced(&self) -> bool {
        self.synced.load(Ordering::SeqCst)
    }

    fn proxies(&self) -> Vec<ProxyRecord> {
        let credentials = self.credentials.read().expect("credentials lock");
        self.valid()
            .into_iter()
            .filter(|proxy| proxy.metadata.deletion_timestamp.is_none())
            .filter_map(|proxy| {
                let endpoint = proxy.effective_endpoint()?;
                let port = u16::try_from(endpoint.port).ok()?;
                let namespace = proxy.namespace().unwrap_or_default();
                let name = proxy.name_any();
                // The board has the newest verdict, ahead of the status write it triggers.
                let healthy =
                    self.board.get(&namespace, &name, &endpoint.address()).is_some_and(|verdict| verdict.healthy);
                let secret = proxy.spec.auth.as_ref().map(|auth| (namespace.clone(), auth.secret_ref.name.clone()));
                Some(ProxyRecord {
                    credentials: secret.and_then(|key| credentials.get(&key).cloned()),
                    egress_ip: proxy.status.as_ref().and_then(|status| status.egress_ip.clone()),
                    labels: proxy.metadata.labels.clone().unwrap_or_else(BTreeMap::new),
                    zone: proxy.spec.placement.as_ref().and_then(|placement| placement.zone.clone()),
                    provider: proxy.spec.provider.clone(),
                    max_leases: proxy.spec.max_leases(),
                    host: endpoint.host.trim_start_matches('[').trim_end_matches(']').to_owned(),
                    port,
                    healthy,
                    namespace,
                    name,
                })
            })
            .collect()
    }
}
