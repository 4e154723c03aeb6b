//! Feeds the health engine from the Proxies, one Proxy per change, and its transitions back into the reconciler.
//!
//! Targets follow the Proxies: each Proxy's published endpoint (Managed: the instance address; External: the
//! spec's), and during a replacement also the new instance's address, so it can be proven healthy before the
//! endpoint switches. Probe settings come from `spec.healthCheck` with the operator's default probe URL, and
//! credentials from the [`CredentialStore`], the one the reconciler and discovery read too. A target new to the engine
//! starts from the verdict its Proxy's status records, when there is one for that endpoint (a warm restart).
//!
//! Work per change is O(1) in the fleet: a changed Proxy recomputes its own targets only, and a changed auth Secret
//! recomputes the Proxies that name it (an index kept here). A resync (the first list, a relist, or after falling
//! behind) compares every Proxy without cloning one, yielding to the runtime as it goes. Each transition triggers one
//! reconcile of its Proxy, which writes the status: one write per transition, none per probe. The verdicts
//! themselves live in the engine's [`egress_health::Verdicts`] store, which everyone reads.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use egress_api::{Endpoint, InstanceState, Proxy, ProxyMode, ProxyPhase};
use egress_health::{HealthEngine, ProbeUrl, Target, Transition};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::mpsc;
use tracing::{Instrument, debug, info_span, warn};

use crate::controller::Trigger;
use crate::credentials::CredentialStore;
use crate::feed::{Change, GuardedProxy, ProxyFeed, reference_of};
use crate::health::{ProbeKey, status_verdict};

/// How many Proxies a resync handles before it lets other tasks run.
const YIELD_EVERY: usize = 256;

/// Settings of the feed.
#[derive(Clone, Debug)]
pub struct HealthFeedConfig {
    /// The probe URL for Proxies that set none (`--default-probe-url`).
    pub default_probe_url: String,
}

/// The addresses of a Proxy worth probing.
pub fn probe_endpoints(proxy: &Proxy) -> Vec<Endpoint> {
    if proxy.metadata.deletion_timestamp.is_some() {
        return Vec::new();
    }
    let Some(status) = proxy.status.as_ref() else {
        return match proxy.spec.mode {
            ProxyMode::External => proxy.spec.endpoint.iter().cloned().collect(),
            ProxyMode::Managed => Vec::new(),
        };
    };
    if status.phase == Some(ProxyPhase::Failed) {
        return Vec::new();
    }
    let mut endpoints = Vec::new();
    match proxy.spec.mode {
        ProxyMode::External => endpoints.extend(proxy.spec.endpoint.clone()),
        ProxyMode::Managed => {
            endpoints.extend(status.endpoint.as_ref().map(Endpoint::from));
            if let Some(instance) = status.instance.as_ref().filter(|instance| instance.state == InstanceState::Running)
                && let Some(ip) = &instance.ip
            {
                let candidate = Endpoint { host: ip.clone(), port: proxy.spec.port };
                if !endpoints.contains(&candidate) {
                    endpoints.push(candidate);
                }
            }
        }
    }
    endpoints
}

/// The feed's own bookkeeping: which targets each Proxy has, and which Proxies each auth Secret serves.
struct Targets {
    feed: ProxyFeed,
    credentials: CredentialStore,
    config: HealthFeedConfig,
    engine: Arc<HealthEngine<ProbeKey>>,
    of_proxy: HashMap<ObjectRef<GuardedProxy>, Vec<ProbeKey>>,
}

impl Targets {
    /// Brings one Proxy's targets in line with the store.
    fn apply(&mut self, reference: &ObjectRef<GuardedProxy>) {
        let stored = self.feed.proxy(reference);
        let proxy = stored.as_deref().and_then(|guarded| guarded.0.as_ref().ok());
        let wanted = proxy.map(|proxy| self.targets_of(reference, proxy)).unwrap_or_default();
        let keys: Vec<ProbeKey> = wanted.iter().map(|target| target.id.clone()).collect();
        if let Some(previous) = self.of_proxy.remove(reference) {
            for key in previous.iter().filter(|key| !keys.contains(key)) {
                self.engine.remove(key);
            }
        }
        for target in wanted {
            let key = target.id.clone();
            self.engine.upsert_seeded(target, || proxy.and_then(|proxy| status_verdict(proxy, &key)));
        }
        if !keys.is_empty() {
            self.of_proxy.insert(reference.clone(), keys);
        }
    }

    fn targets_of(&self, reference: &ObjectRef<GuardedProxy>, proxy: &Proxy) -> Vec<Target<ProbeKey>> {
        let endpoints = probe_endpoints(proxy);
        if endpoints.is_empty() {
            return Vec::new();
        }
        let check = proxy.spec.health_check.effective(&self.config.default_probe_url);
        let probe_url = match ProbeUrl::parse(&check.probe_url) {
            Ok(url) => url,
            Err(error) => {
                warn!(proxy = %reference, %error, "not probing a Proxy with an unusable probe URL");
                return Vec::new();
            }
        };
        // A Secret not in the store probes without credentials; the proxy answers 407, and the failure names it.
        let credentials = proxy.spec.auth.as_ref().and_then(|auth| {
            let namespace = proxy.namespace().unwrap_or_default();
            self.credentials.credentials(&namespace, &auth.secret_ref.name)
        });
        endpoints
            .into_iter()
            .filter_map(|endpoint| {
                let port = u16::try_from(endpoint.port).ok()?;
                Some(Target {
                    proxy_host: endpoint.host.trim_start_matches('[').trim_end_matches(']').to_owned(),
                    proxy_port: port,
                    id: ProbeKey { proxy: reference.clone(), endpoint },
                    credentials: credentials.clone(),
                    probe_url: probe_url.clone(),
                    interval: check.interval,
                    timeout: check.timeout,
                    healthy_threshold: check.healthy_threshold,
                    unhealthy_threshold: check.unhealthy_threshold,
                })
            })
            .collect()
    }

    /// Every Proxy compared against the store, and targets of Proxies no longer stored removed.
    async fn resync(&mut self) {
        let stored = self.feed.store().state();
        for (index, object) in stored.iter().enumerate() {
            self.apply(&reference_of(object.as_ref()));
            if index % YIELD_EVERY == YIELD_EVERY - 1 {
                tokio::task::yield_now().await;
            }
        }
        let store = self.feed.store();
        let gone: Vec<_> = self.of_proxy.keys().filter(|key| store.get(key).is_none()).cloned().collect();
        for reference in gone {
            self.apply(&reference);
        }
    }

    /// Recomputes the Proxies that name a changed auth Secret (all that name one, on a resync of the Secrets).
    async fn secret_changed(&mut self, change: Change<Secret>) {
        let users = self.credentials.affected(&change);
        for (index, reference) in users.iter().enumerate() {
            self.apply(reference);
            if index % YIELD_EVERY == YIELD_EVERY - 1 {
                tokio::task::yield_now().await;
            }
        }
    }
}

/// Runs the feed until `shutdown` resolves.
pub async fn run_health_feed(
    feed: ProxyFeed,
    credentials: CredentialStore,
    config: HealthFeedConfig,
    engine: Arc<HealthEngine<ProbeKey>>,
    mut transitions: mpsc::Receiver<Transition<ProbeKey>>,
    triggers: mpsc::UnboundedSender<Trigger>,
    shutdown: impl Future<Output = ()>,
) {
    let mut changes = feed.subscribe().boxed();
    let mut secret_changes = credentials.subscribe().boxed();
    let mut targets = Targets { feed, credentials, config, engine, of_proxy: HashMap::new() };
    let work = async {
        loop {
            tokio::select! {
                change = changes.next() => match change {
                    Some(Change::Object(reference)) => targets.apply(&reference),
                    Some(Change::Resync) => targets.resync().await,
                    None => return,
                },
                Some(change) = secret_changes.next() => targets.secret_changed(change).await,
                Some(transition) = transitions.recv() => {
                    debug!(target = ?transition.id, healthy = transition.healthy, "health transition");
                    let _ = triggers.send(transition.id.proxy);
                }
            }
        }
    };
    tokio::select! {
        () = work.instrument(info_span!("health_feed")) => {}
        () = shutdown => {}
    }
}

#[cfg(test)]
mod tests {
    use egress_api::{EndpointStatus, InstanceStatus, ProxySpec, ProxyStatus};

    use super::*;

    fn managed(status: ProxyStatus) -> Proxy {
        let mut proxy =
            Proxy::new("p", ProxySpec { provider: Some("pods".into()), ..ProxySpec::new(ProxyMode::Managed) });
        proxy.status = Some(status);
        proxy
    }

    fn instance(ip: &str, state: InstanceState) -> InstanceStatus {
        InstanceStatus {
            name: "px-a".into(),
            provider_id: "ns/px-a".into(),
            state,
            ip: Some(ip.into()),
            spec_hash: "h".into(),
            provider_fingerprint: None,
            created_at: None,
            draining_since: None,
        }
    }

    /// Regression: a replacement records its previous instance as it starts, before the new one runs. The status's
    /// verdict then still describes the published (old) endpoint; it was ignored, so an operator that restarted
    /// into a replacement had no verdict for the published endpoint until its engine took the target and probed
    /// it, and the lease store revoked the leases held on the proxy meanwhile (a CI run's renew got 410).
    #[test]
    fn a_replacement_in_flight_keeps_the_published_endpoints_recorded_verdict() {
        use egress_api::HealthStatus;
        let key = |host: &str| ProbeKey::new("default", "p", Endpoint { host: host.into(), port: 3128 });
        let health = Some(HealthStatus { healthy: true, last_transition_time: None, last_error: None });
        let old = EndpointStatus::from(&Endpoint { host: "10.0.0.1".into(), port: 3128 });
        let starting = managed(ProxyStatus {
            endpoint: Some(old.clone()),
            health: health.clone(),
            instance: Some(InstanceStatus { ip: None, ..instance("10.0.0.2", InstanceState::Provisioning) }),
            previous_instance: Some(instance("10.0.0.1", InstanceState::Running)),
            ..ProxyStatus::default()
        });
        assert!(status_verdict(&starting, &key("10.0.0.1")).is_some_and(|verdict| verdict.healthy));
        let running = managed(ProxyStatus {
            instance: Some(instance("10.0.0.2", InstanceState::Running)),
            ..starting.status.clone().expect("a status")
        });
        assert!(status_verdict(&running, &key("10.0.0.1")).is_some_and(|verdict| verdict.healthy));
        assert!(status_verdict(&running, &key("10.0.0.2")).is_none(), "the new instance starts unknown");
        // Switched: the status's verdict is the new instance's.
        let switched = managed(ProxyStatus {
            endpoint: Some(EndpointStatus::from(&Endpoint { host: "10.0.0.2".into(), port: 3128 })),
            ..running.status.clone().expect("a status")
        });
        assert!(status_verdict(&switched, &key("10.0.0.2")).is_some_and(|verdict| verdict.healthy));
        assert!(status_verdict(&switched, &key("10.0.0.1")).is_none());
        // Two instances on one address: the status cannot say which one it describes.
        let same_address = managed(ProxyStatus {
            endpoint: Some(old),
            health,
            instance: Some(instance("10.0.0.1", InstanceState::Running)),
            previous_instance: Some(instance("10.0.0.1", InstanceState::Running)),
            ..ProxyStatus::default()
        });
        assert!(status_verdict(&same_address, &key("10.0.0.1")).is_none());
    }

    #[test]
    fn endpoints_follow_the_status() {
        let published = |host: &str| Some(EndpointStatus::from(&Endpoint { host: host.into(), port: 3128 }));
        let addresses = |proxy: &Proxy| probe_endpoints(proxy).iter().map(Endpoint::address).collect::<Vec<_>>();
        assert!(addresses(&managed(ProxyStatus::default())).is_empty());
        let settled = managed(ProxyStatus {
            endpoint: published("10.0.0.1"),
            instance: Some(instance("10.0.0.1", InstanceState::Running)),
            ..ProxyStatus::default()
        });
        assert_eq!(addresses(&settled), ["10.0.0.1:3128"]);
        let replacing = managed(ProxyStatus {
            endpoint: published("10.0.0.1"),
            instance: Some(instance("10.0.0.2", InstanceState::Running)),
            ..ProxyStatus::default()
        });
        assert_eq!(
            addresses(&replacing),
            ["10.0.0.1:3128", "10.0.0.2:3128"],
            "the new instance is probed before the switch"
        );
        let booting = managed(ProxyStatus {
            instance: Some(instance("10.0.0.2", InstanceState::Provisioning)),
            ..ProxyStatus::default()
        });
        assert!(addresses(&booting).is_empty());
        let failed = managed(ProxyStatus {
            phase: Some(ProxyPhase::Failed),
            endpoint: published("10.0.0.1"),
            ..ProxyStatus::default()
        });
        assert!(addresses(&failed).is_empty());
        let external = Proxy::new(
            "e",
            ProxySpec {
                endpoint: Some(Endpoint { host: "::1".into(), port: 8080 }),
                ..ProxySpec::new(ProxyMode::External)
            },
        );
        assert_eq!(addresses(&external), ["[::1]:8080"]);
    }
}
