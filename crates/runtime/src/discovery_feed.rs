//! Keeps the discovery API's proxies in line with the Proxy store, the verdict store and the credential store, one
//! Proxy per change.
//!
//! A changed Proxy, a flipped verdict of one of its endpoints, or a changed auth Secret recomputes that Proxy's
//! [`ProxyRecord`] (or removes it) and hands it to [`Discovery::upsert`]; nothing copies the fleet. A resync (the
//! first list, a relist, a consumer that fell behind) compares every stored Proxy, yielding as it goes, and removes
//! records whose Proxy is gone. Discovery reports ready once the Proxies, the auth Secrets and the ProxyPools have
//! been listed and every Proxy was handed over once. Each changed ProxyPool becomes a [`PoolRecord`] the same way.

use std::sync::Arc;

use egress_api::pool::member_of;
use egress_api::{Proxy, ProxyPool};
use egress_discovery::{Discovery, PoolRecord, ProxyRecord};
use egress_reconcile::ids::{PoolId, ProxyId, pool_id, pool_id_of, proxy_id, proxy_id_of, proxy_ref};
use egress_reconcile::pool::{PoolDemand, PoolMetrics, PoolSignals, provisioning_estimate};
use egress_reconcile::{
    Change, CredentialStore, GuardedPool, GuardedProxy, LeaseDrain, PoolFeed, ProbeKey, ProxyFeed, ProxyVerdicts,
    current_verdict, reference_of,
};
use futures::StreamExt;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::broadcast::error::RecvError;
use tracing::{Instrument, debug, info_span};

/// How many Proxies a resync handles before it lets other tasks run.
const YIELD_EVERY: usize = 256;

/// What each provider in the providers file sets for its proxies' leases, by name.
pub type ProviderLeasing = std::collections::HashMap<String, LeasingDefaults>;

/// A provider's defaults for its proxies' leases: where a Proxy sets nothing of its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeasingDefaults {
    /// The ban cooldown policy, part by part.
    pub cooldown: egress_provider::config::CooldownSettings,
    /// The pace, whole.
    pub pacing: Option<egress_provider::config::PacingSettings>,
}

impl LeasingDefaults {
    /// The defaults of `provider`, as the providers file sets them.
    pub fn of(provider: &egress_provider::config::ProviderConfig) -> Self {
        Self { cooldown: provider.cooldown, pacing: provider.pacing }
    }
}

/// A Proxy's pace: its `spec.pacing`, else its provider's, else none.
pub fn pacing(proxy: &Proxy, providers: &ProviderLeasing) -> Option<egress_lease::Pacing> {
    let (interval, burst) = match &proxy.spec.pacing {
        Some(own) => (own.interval_milliseconds, own.burst),
        None => {
            let provider = providers.get(proxy.spec.provider.as_ref()?)?.pacing?;
            (provider.interval_milliseconds, provider.burst)
        }
    };
    Some(egress_lease::Pacing {
        interval: std::time::Duration::from_millis(u64::from(interval)),
        burst: burst.unwrap_or(1),
    })
}

/// A Proxy's ban cooldown policy: each part from its `spec.cooldown`, else its provider's, else the operator's
/// default (600 s, doubling, at most a day).
pub fn cooldown_policy(proxy: &Proxy, providers: &ProviderLeasing) -> egress_lease::CooldownPolicy {
    let default = egress_lease::LeaseConfig::default().cooldown;
    let own = proxy.spec.cooldown.unwrap_or_default();
    let provider =
        proxy.spec.provider.as_ref().and_then(|name| providers.get(name)).map(|p| p.cooldown).unwrap_or_default();
    let seconds = |value: u32| std::time::Duration::from_secs(u64::from(value));
    let base = own.base_seconds.or(provider.base_seconds).map_or(default.base, seconds);
    let factor = own.factor.or(provider.factor).unwrap_or(default.factor);
    // A maximum below the base (from two different levels) is raised to it.
    let max = own.max_seconds.or(provider.max_seconds).map_or(default.max, seconds).max(base);
    egress_lease::CooldownPolicy { base, factor, max }
}

/// The record discovery shows for a Proxy, or `None` when it has nothing to show (no endpoint yet, being deleted,
/// or invalid).
pub fn proxy_record(
    proxy: &Proxy,
    verdicts: &ProxyVerdicts,
    credentials: &CredentialStore,
    leasing: &ProviderLeasing,
) -> Option<ProxyRecord> {
    if proxy.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let endpoint = proxy.effective_endpoint()?;
    let port = u16::try_from(endpoint.port).ok()?;
    let id = proxy_id(proxy);
    let namespace = id.namespace();
    let host = endpoint.host.trim_start_matches('[').trim_end_matches(']').to_owned();
    // The engine's verdict is the newest, ahead of the status write it triggers; without one (on a replica that does
    // not lead) the leader's, from the status.
    let key = ProbeKey::of(&id, endpoint);
    let healthy = current_verdict(verdicts, proxy, &key).is_some_and(|verdict| verdict.healthy);
    let credentials =
        proxy.spec.auth.as_ref().and_then(|auth| credentials.credentials(namespace, &auth.secret_ref.name));
    Some(ProxyRecord {
        credentials,
        egress_ip: proxy.status.as_ref().and_then(|status| status.egress_ip.clone()),
        labels: proxy.metadata.labels.clone().unwrap_or_default(),
        zone: proxy.spec.placement.as_ref().and_then(|placement| placement.zone.clone()),
        provider: proxy.spec.provider.clone(),
        max_leases: proxy.spec.max_leases(),
        host,
        port,
        healthy,
        cooldowns: crate::durable::cooldowns_of(proxy),
        pool: member_of(&proxy.metadata).map(|(pool, _)| PoolId::new(namespace, pool)),
        cooldown: Some(cooldown_policy(proxy, leasing)),
        pacing: pacing(proxy, leasing),
        id,
    })
}

/// The record discovery keeps for a pool, or `None` for one being deleted.
pub fn pool_record(pool: &ProxyPool) -> Option<PoolRecord> {
    if pool.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pool.status.clone().unwrap_or_default();
    Some(PoolRecord {
        id: pool_id(pool),
        replicas: pool.spec.replicas.max(0).unsigned_abs(),
        ready: status.ready_replicas.max(0).unsigned_abs(),
        wakes: pool.spec.autoscale.as_ref().is_some_and(|autoscale| autoscale.max >= 1),
        provisioning: provisioning_estimate(pool),
    })
}

/// The discovery API as the pool controller's [`PoolSignals`]: lease counts and refused leases.
pub struct DiscoverySignals(pub Arc<Discovery>);

#[async_trait::async_trait]
impl PoolSignals for DiscoverySignals {
    async fn leases_of(&self, proxy: &ProxyId) -> u32 {
        self.0.active_leases(proxy).await
    }

    fn demand(&self, pool: &PoolId) -> PoolDemand {
        self.0.pool_demand(pool)
    }
}

/// Tells the pool controller (whichever term of leadership is running) of a pool whose leases were refused.
pub struct PoolWakes(pub tokio::sync::broadcast::Sender<PoolId>);

impl egress_discovery::PoolWaker for PoolWakes {
    fn wake(&self, pool: &PoolId) {
        // Nobody listening (a follower, or between terms) is fine: the next term looks at every pool.
        drop(self.0.send(pool.clone()));
    }
}

fn update_pool(pools: &PoolFeed, discovery: &Discovery, metrics: &PoolMetrics, reference: &ObjectRef<GuardedPool>) {
    let stored = pools.store().get(reference);
    let record = stored.as_deref().and_then(|guarded| guarded.0.as_ref().ok()).and_then(pool_record);
    match record {
        Some(record) => discovery.upsert_pool(record),
        None => remove_pool(discovery, metrics, &pool_id_of(reference)),
    }
}

/// A pool that is gone: discovery forgets it, and so do its series in `/metrics` (the pool controller sees no
/// deleted pool, so it cannot).
fn remove_pool(discovery: &Discovery, metrics: &PoolMetrics, id: &PoolId) {
    discovery.remove_pool(id);
    metrics.forget(id);
}

fn resync_pools(pools: &PoolFeed, discovery: &Discovery, metrics: &PoolMetrics) {
    let stored = pools.store().state();
    let mut seen = std::collections::BTreeSet::new();
    for object in &stored {
        let reference = reference_of(object.as_ref());
        seen.insert(pool_id_of(&reference));
        update_pool(pools, discovery, metrics, &reference);
    }
    for id in discovery.pool_ids() {
        if !seen.contains(&id) {
            remove_pool(discovery, metrics, &id);
        }
    }
}

/// The discovery API as the controller's [`LeaseDrain`]: a replaced instance is kept while leases are on it.
pub struct DiscoveryDrain(pub Arc<Discovery>);

#[async_trait::async_trait]
impl LeaseDrain for DiscoveryDrain {
    async fn leases_on(&self, proxy: &ProxyId, endpoint: &str) -> usize {
        self.0.leases_on(proxy, endpoint).await
    }
}

struct Records {
    feed: ProxyFeed,
    verdicts: ProxyVerdicts,
    /// The providers' ban cooldown policies.
    leasing: Arc<ProviderLeasing>,
    credentials: CredentialStore,
    discovery: Arc<Discovery>,
}

impl Records {
    async fn update(&mut self, reference: &ObjectRef<GuardedProxy>) {
        let stored = self.feed.proxy(reference);
        let proxy = stored.as_deref().and_then(|guarded| guarded.0.as_ref().ok());
        match proxy.and_then(|proxy| proxy_record(proxy, &self.verdicts, &self.credentials, &self.leasing)) {
            Some(record) => self.discovery.upsert(record).await,
            None => self.discovery.remove(&proxy_id_of(reference)).await,
        }
    }

    async fn resync(&mut self) {
        let stored = self.feed.store().state();
        for (index, object) in stored.iter().enumerate() {
            self.update(&reference_of(object.as_ref())).await;
            if index % YIELD_EVERY == YIELD_EVERY - 1 {
                tokio::task::yield_now().await;
            }
        }
        let store = self.feed.store();
        for id in self.discovery.ids() {
            let reference = proxy_ref(&id);
            if store.get(&reference).is_none() {
                self.update(&reference).await;
            }
        }
    }

    async fn update_all(&mut self, references: Vec<ObjectRef<GuardedProxy>>) {
        for (index, reference) in references.iter().enumerate() {
            self.update(reference).await;
            if index % YIELD_EVERY == YIELD_EVERY - 1 {
                tokio::task::yield_now().await;
            }
        }
    }
}

/// Runs the adapter until the Proxy watch ends; marks discovery ready after the first full pass. On a replica that
/// does not lead the verdict store is empty and each record's health is the leader's, from the Proxy's status, so a
/// replica that takes over serves at once.
pub async fn run_discovery_feed(
    feed: ProxyFeed,
    pools: PoolFeed,
    verdicts: ProxyVerdicts,
    leasing: Arc<ProviderLeasing>,
    credentials: CredentialStore,
    discovery: Arc<Discovery>,
    pool_metrics: PoolMetrics,
) {
    // Subscribed before anything is read, so no change between the first pass and the loop is missed.
    let mut changes = feed.subscribe().boxed();
    let mut pool_changes = pools.subscribe().boxed();
    let mut secret_changes = credentials.subscribe().boxed();
    let mut verdict_changes = verdicts.subscribe();
    let mut records = Records { feed, verdicts, leasing, credentials: credentials.clone(), discovery };
    let work = async move {
        // Proxy URLs carry credentials: wait for the Secrets' list too before the first pass; and for the pools', so
        // a lease asked for by pool is never refused as unknown by a replica that reports ready.
        if !credentials.ready().await || !pools.ready().await {
            return;
        }
        resync_pools(&pools, &records.discovery, &pool_metrics);
        loop {
            tokio::select! {
                change = changes.next() => match change {
                    Some(Change::Object(reference)) => records.update(&reference).await,
                    Some(Change::Resync) => {
                        records.resync().await;
                        records.discovery.mark_synced();
                    }
                    None => return,
                },
                Some(change) = pool_changes.next() => match change {
                    Change::Object(reference) => update_pool(&pools, &records.discovery, &pool_metrics, &reference),
                    Change::Resync => resync_pools(&pools, &records.discovery, &pool_metrics),
                },
                Some(change) = secret_changes.next() => {
                    let affected = records.credentials.affected(&change);
                    records.update_all(affected).await;
                }
                verdict = verdict_changes.recv() => match verdict {
                    Ok(key) => records.update(&key.proxy).await,
                    Err(RecvError::Lagged(missed)) => {
                        debug!(missed, "the discovery feed fell behind the verdicts; resynchronising");
                        records.resync().await;
                    }
                    Err(RecvError::Closed) => return,
                },
            }
        }
    };
    work.instrument(info_span!("discovery_feed")).await;
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use egress_api::{CooldownSpec, PacingSpec, ProxyMode, ProxySpec};
    use egress_provider::config::{CooldownSettings, PacingSettings};

    use super::*;

    #[test]
    fn each_part_of_the_cooldown_policy_comes_from_the_proxy_then_its_provider_then_the_default() {
        let cooldown = CooldownSettings { base_seconds: Some(30), factor: Some(3), max_seconds: None };
        let providers: ProviderLeasing = [("small".to_owned(), LeasingDefaults { cooldown, pacing: None })].into();
        let proxy = |provider: Option<&str>, cooldown: Option<CooldownSpec>| {
            Proxy::new(
                "p",
                ProxySpec { provider: provider.map(str::to_owned), cooldown, ..ProxySpec::new(ProxyMode::Managed) },
            )
        };
        let secs = Duration::from_secs;
        let policy = cooldown_policy(&proxy(None, None), &providers);
        assert_eq!((policy.base, policy.factor, policy.max), (secs(600), 2, secs(86_400)));
        let policy = cooldown_policy(&proxy(Some("small"), None), &providers);
        assert_eq!((policy.base, policy.factor, policy.max), (secs(30), 3, secs(86_400)));
        let own = CooldownSpec { base_seconds: None, factor: Some(1), max_seconds: Some(120) };
        let policy = cooldown_policy(&proxy(Some("small"), Some(own)), &providers);
        assert_eq!((policy.base, policy.factor, policy.max), (secs(30), 1, secs(120)));
        // A maximum below the base, from two levels, is raised to the base.
        let own = CooldownSpec { base_seconds: Some(900), factor: None, max_seconds: None };
        let cooldown = CooldownSettings { max_seconds: Some(60), ..CooldownSettings::default() };
        let low = [("low".to_owned(), LeasingDefaults { cooldown, pacing: None })].into();
        let policy = cooldown_policy(&proxy(Some("low"), Some(own)), &low);
        assert_eq!((policy.base, policy.max), (secs(900), secs(900)));
    }

    #[test]
    fn the_pace_is_the_proxys_whole_else_its_providers_else_none() {
        let polite = PacingSettings { interval_milliseconds: 12_000, burst: Some(2) };
        let providers: ProviderLeasing =
            [("polite".to_owned(), LeasingDefaults { pacing: Some(polite), ..LeasingDefaults::default() })].into();
        let proxy = |provider: Option<&str>, pacing: Option<PacingSpec>| {
            Proxy::new(
                "p",
                ProxySpec { provider: provider.map(str::to_owned), pacing, ..ProxySpec::new(ProxyMode::Managed) },
            )
        };
        let pace = |ms: u64, burst: u32| Some(egress_lease::Pacing { interval: Duration::from_millis(ms), burst });
        assert_eq!(pacing(&proxy(None, None), &providers), None);
        assert_eq!(pacing(&proxy(Some("other"), None), &providers), None);
        assert_eq!(pacing(&proxy(Some("polite"), None), &providers), pace(12_000, 2));
        let own = PacingSpec { interval_milliseconds: 500, burst: None };
        assert_eq!(pacing(&proxy(Some("polite"), Some(own)), &providers), pace(500, 1), "the Proxy's, whole");
    }
}
