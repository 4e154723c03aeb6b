//! The orphan collector: deletes provider instances that carry this cluster's tags but that no Proxy owns.
//!
//! An instance is an orphan when no Proxy has its `proxy-uid`, or when that Proxy's current, previous and desired
//! instances are all other instances. Orphans younger than the grace period are left alone, because a create may
//! not have reached the Proxy's status yet; an instance whose Proxy cannot be read is never touched.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use egress_api::Proxy;
use egress_provider::{Instance, Tags};
use kube::api::{Api, ListParams};
use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use tokio::sync::Mutex;
use tracing::{Instrument, info, info_span, warn};

use crate::controller::{age, recorded_names};
use crate::decide::EventSpec;
use crate::events::Events;
use crate::metrics::ReconcileMetrics;
use crate::providers::Providers;

/// One instance the collector deleted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Collected {
    /// The provider it lived on.
    pub provider: String,
    /// Its provider ID.
    pub provider_id: String,
    /// Why it was an orphan: `proxy-gone`, `superseded` or `untagged`.
    pub reason: &'static str,
}

/// The Proxies by UID, as stored or as listed.
#[derive(Default)]
struct Owners(HashMap<String, Arc<DeserializeGuard<Proxy>>>);

impl Owners {
    fn from_store(store: &Store<DeserializeGuard<Proxy>>) -> Self {
        Self(store.state().into_iter().map(|object| (object.uid().unwrap_or_default(), object)).collect())
    }

    /// Why `instance` is an orphan, or `None` when a Proxy owns it (or may: one that cannot be read); `fingerprint`
    /// is its provider's instance fingerprint, which names the instance a Proxy wants there.
    fn orphan_reason(&self, instance: &Instance, fingerprint: Option<&str>) -> Option<&'static str> {
        let Some(uid) = instance.tags.get(Tags::PROXY_UID) else { return Some("untagged") };
        match self.0.get(uid).map(|object| object.0.as_ref()) {
            None => Some("proxy-gone"),
            // The Proxy exists but cannot be read: never delete what it may own.
            Some(Err(_)) => None,
            Some(Ok(proxy)) if recorded_names(proxy, fingerprint).contains(&instance.name) => None,
            Some(Ok(_)) => Some("superseded"),
        }
    }

    /// The readable Proxy that `instance` names, if any.
    fn readable(&self, instance: &Instance) -> Option<&Proxy> {
        self.0.get(instance.tags.get(Tags::PROXY_UID)?)?.0.as_ref().ok()
    }
}

/// The orphan collector.
pub struct OrphanCollector {
    client: Client,
    providers: Arc<dyn Providers>,
    cluster_id: String,
    grace: Duration,
    metrics: ReconcileMetrics,
    /// When each instance without a creation time was first seen, so the grace period still applies to it.
    first_seen: Mutex<HashMap<String, SystemTime>>,
    namespace: Option<String>,
    store: Option<Store<DeserializeGuard<Proxy>>>,
    events: Events,
}

impl OrphanCollector {
    /// A collector for instances tagged with `cluster_id`, sparing those younger than `grace`.
    pub fn new(
        client: Client,
        providers: Arc<dyn Providers>,
        cluster_id: impl Into<String>,
        grace: Duration,
        metrics: ReconcileMetrics,
    ) -> Self {
        Self {
            events: Events::new(client.clone()),
            client,
            providers,
            cluster_id: cluster_id.into(),
            grace,
            metrics,
            first_seen: Mutex::default(),
            namespace: None,
            store: None,
        }
    }

    /// Judges owners against the shared Proxy store first (confirming with the apiserver before any deletion), so
    /// a round with no orphans costs no list of the Proxies.
    pub fn with_store(mut self, store: Store<DeserializeGuard<Proxy>>) -> Self {
        self.store = Some(store);
        self
    }

    /// Considers only the Proxies of one namespace as owners (for a cluster ID used by one namespace alone, as in
    /// tests). Every instance of the cluster ID whose owner is not there counts as an orphan.
    pub fn within_namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// One pass over every provider. A provider that fails is logged and skipped; the others are still collected.
    ///
    /// Instances are listed first: with none tagged for this cluster, the Proxies are not looked at at all. Owners
    /// are then judged against the shared store when there is one (no copies), and the instances that look orphaned
    /// past the grace period are judged once more against a fresh list from the apiserver before anything is
    /// deleted, so a stale store can never delete what a Proxy owns. Without a store, that list is the only one.
    pub async fn collect_once(&self) -> Result<Vec<Collected>, kube::Error> {
        let now = SystemTime::now();
        let mut seen = HashSet::new();
        let mut candidates = Vec::new();
        let mut owners: Option<Owners> = None;
        for provider_name in self.providers.names() {
            let provider = match self.providers.provider(&provider_name).await {
                Ok(provider) => provider,
                Err(error) => {
                    warn!(provider = %provider_name, error = %error.chain(), "orphan collection skipped a provider");
                    continue;
                }
            };
            // Names the instance each Proxy wants on this provider; the same for all of them, so asked once.
            let fingerprint = provider.instance_fingerprint();
            let instances = match provider.list_by_tag(&Tags::owned_by_cluster(&self.cluster_id)).await {
                Ok(instances) => instances,
                Err(error) => {
                    warn!(provider = %provider_name, error = %error.chain(), "orphan collection could not list instances");
                    continue;
                }
            };
            for instance in instances {
                seen.insert(instance.provider_id.clone());
                if owners.is_none() {
                    owners = Some(match &self.store {
                        Some(store) => Owners::from_store(store),
                        None => self.list_owners().await?,
                    });
                }
                // Judged again against a fresh list before anything is deleted (below).
                if owners.as_ref().and_then(|owners| owners.orphan_reason(&instance, fingerprint.as_deref())).is_none()
                {
                    continue;
                }
                let first_seen = *self.first_seen.lock().await.entry(instance.provider_id.clone()).or_insert(now);
                let age = age(instance.created_at, first_seen, now);
                if age >= self.grace {
                    candidates.push((provider_name.clone(), provider.clone(), fingerprint.clone(), instance, age));
                }
            }
        }
        self.first_seen.lock().await.retain(|provider_id, _| seen.contains(provider_id));
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        // Judged from the store: confirm with the apiserver before deleting anything.
        let owners = if self.store.is_some() { self.list_owners().await? } else { owners.unwrap_or_default() };
        let mut collected = Vec::new();
        for (provider_name, provider, fingerprint, instance, age) in candidates {
            let Some(reason) = owners.orphan_reason(&instance, fingerprint.as_deref()) else {
                continue;
            };
            if let Err(error) = provider.delete(&instance.provider_id).await {
                warn!(provider = %provider_name, instance = %instance.provider_id, error = %error.chain(), "deleting an orphan failed");
                continue;
            }
            info!(provider = %provider_name, instance = %instance.provider_id, reason, age_secs = age.as_secs(), "deleted an orphaned instance");
            self.metrics.orphan_deleted(&provider_name, reason);
            if let Some(proxy) = owners.readable(&instance) {
                self.publish(proxy, &instance.provider_id).await;
            }
            collected.push(Collected { provider: provider_name, provider_id: instance.provider_id, reason });
        }
        Ok(collected)
    }

    async fn list_owners(&self) -> Result<Owners, kube::Error> {
        let proxies: Api<DeserializeGuard<Proxy>> = match &self.namespace {
            Some(namespace) => Api::namespaced(self.client.clone(), namespace),
            None => Api::all(self.client.clone()),
        };
        let list = proxies.list(&ListParams::default()).await?;
        Ok(Owners(list.items.into_iter().map(|object| (object.uid().unwrap_or_default(), Arc::new(object))).collect()))
    }

    async fn publish(&self, proxy: &Proxy, provider_id: &str) {
        let spec = EventSpec {
            warning: false,
            reason: "OrphanDeleted",
            note: format!("deleted {provider_id}, which the Proxy no longer uses"),
        };
        self.events.publish(proxy, &spec, "CollectOrphans").await;
    }

    /// Collects every `interval` until `shutdown` resolves.
    pub async fn run(self, interval: Duration, shutdown: impl Future<Output = ()>) {
        let rounds = async {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                match self.collect_once().await {
                    Ok(collected) if !collected.is_empty() => {
                        info!(deleted = collected.len(), "orphan collection finished")
                    }
                    Ok(_) => {}
                    Err(error) => warn!(%error, "orphan collection could not list Proxies"),
                }
            }
        };
        tokio::select! {
            () = rounds.instrument(info_span!("orphan_collector")) => {}
            () = shutdown => {}
        }
    }
}
