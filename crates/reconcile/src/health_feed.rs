//! Feeds the health engine from the Proxies and its transitions back into the reconciler.
//!
//! Targets follow the Proxies: each Proxy's published endpoint (Managed: the instance address; External: the
//! spec's), and during a replacement also the new instance's address, so it can be proven healthy before the
//! endpoint switches. Probe settings come from `spec.healthCheck` with the operator's default probe URL, and
//! credentials from the Proxy's auth Secret. Each transition updates the [`HealthBoard`] and triggers one reconcile
//! of its Proxy, which writes the status: one write per transition, none per probe.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use egress_api::{Endpoint, InstanceState, Proxy, ProxyMode, ProxyPhase};
use egress_health::{Credentials, HealthEngine, ProbeUrl, Target, Transition};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::{Client, ResourceExt};
use tokio::sync::mpsc;
use tracing::{Instrument, debug, info_span, warn};

use crate::feed::ProxyFeed;
use crate::health::{HealthBoard, HealthKey, Verdict};

/// How long a read auth Secret is reused before it is read again.
const CREDENTIALS_TTL: Duration = Duration::from_secs(60);

/// How often the targets are recomputed even without a Proxy change (to pick up rotated credentials).
const RESYNC: Duration = Duration::from_secs(30);

/// Settings of the feed.
#[derive(Clone, Debug)]
pub struct HealthFeedConfig {
    /// The probe URL for Proxies that set none (`--default-probe-url`).
    pub default_probe_url: String,
    /// Watch only this namespace; `None` watches all.
    pub namespace: Option<String>,
}

/// The target identifier of one endpoint of one Proxy: `namespace/name@host:port`.
pub fn target_id(namespace: &str, name: &str, address: &str) -> String {
    format!("{namespace}/{name}@{address}")
}

fn parse_target_id(id: &str) -> Option<HealthKey> {
    let (proxy, address) = id.rsplit_once('@')?;
    let (namespace, name) = proxy.split_once('/')?;
    Some(HealthKey { namespace: namespace.to_owned(), name: name.to_owned(), address: address.to_owned() })
}

/// The addresses of a Proxy worth probing.
pub fn probe_endpoints(proxy: &Proxy) -> Vec<Endpoint> {
    if proxy.metadata.deletion_timestamp.is_some() {
        return Vec::new();
    }
    let status = proxy.status.clone().unwrap_or_default();
    if status.phase == Some(ProxyPhase::Failed) {
        return Vec::new();
    }
    let mut endpoints = Vec::new();
    match proxy.spec.mode {
        ProxyMode::External => endpoints.extend(proxy.spec.endpoint.clone()),
        ProxyMode::Managed => {
            endpoints.extend(status.endpoint.as_ref().map(Endpoint::from));
            if let Some(instance) = status.instance.filter(|instance| instance.state == InstanceState::Running)
                && let Some(ip) = instance.ip
            {
                let candidate = Endpoint { host: ip, port: proxy.spec.port };
                if !endpoints.contains(&candidate) {
                    endpoints.push(candidate);
                }
            }
        }
    }
    endpoints
}

struct CachedCredentials {
    credentials: Option<Credentials>,
    read_at: Instant,
}

/// Runs the feed on a shared [`ProxyFeed`] until `shutdown` resolves.
#[allow(clippy::too_many_arguments)]
pub async fn run_health_feed(
    client: Client,
    feed: ProxyFeed,
    config: HealthFeedConfig,
    engine: Arc<HealthEngine>,
    mut transitions: mpsc::Receiver<Transition>,
    board: HealthBoard,
    triggers: mpsc::UnboundedSender<(String, String)>,
    shutdown: impl Future<Output = ()>,
) {
    let store = feed.store();
    let mut changes = feed.subscribe().boxed();
    let mut credentials: HashMap<(String, String), CachedCredentials> = HashMap::new();
    let mut resync = tokio::time::interval(RESYNC);
    let work = async {
        loop {
            tokio::select! {
                change = changes.next() => {
                    if change.is_none() {
                        return;
                    }
                }
                _ = resync.tick() => {}
                Some(transition) = transitions.recv() => {
                    apply_transition(&board, &triggers, transition);
                    continue;
                }
            }
            let proxies: Vec<Proxy> =
                store.state().iter().filter_map(|object| object.0.as_ref().ok().cloned()).collect();
            sync_targets(&client, &config, &engine, &board, &proxies, &mut credentials).await;
        }
    };
    tokio::select! {
        () = work.instrument(info_span!("health_feed")) => {}
        () = shutdown => {}
    }
}

fn apply_transition(board: &HealthBoard, triggers: &mpsc::UnboundedSender<(String, String)>, transition: Transition) {
    let Some(key) = parse_target_id(&transition.id) else {
        warn!(id = %transition.id, "a health transition for a target this feed did not make");
        return;
    };
    debug!(target = %transition.id, healthy = transition.healthy, "health transition");
    let verdict = Verdict {
        healthy: transition.healthy,
        since: transition.at,
        last_error: transition.reason.map(|reason| reason.to_string()),
        egress_ip: transition.egress_ip.map(|ip| ip.to_string()),
    };
    let proxy = (key.namespace.clone(), key.name.clone());
    board.set(key, verdict);
    let _ = triggers.send(proxy);
}

async fn sync_targets(
    client: &Client,
    config: &HealthFeedConfig,
    engine: &HealthEngine,
    board: &HealthBoard,
    proxies: &[Proxy],
    credentials: &mut HashMap<(String, String), CachedCredentials>,
) {
    let mut wanted = HashSet::new();
    for proxy in proxies {
        let namespace = proxy.namespace().unwrap_or_default();
        let name = proxy.name_any();
        let check = proxy.spec.health_check.effective(&config.default_probe_url);
        let probe_url = match ProbeUrl::parse(&check.probe_url) {
            Ok(url) => url,
            Err(error) => {
                warn!(proxy = %format!("{namespace}/{name}"), %error, "not probing a Proxy with an unusable probe URL");
                continue;
            }
        };
        let auth = match &proxy.spec.auth {
            Some(auth) => read_credentials(client, &namespace, &auth.secret_ref.name, credentials).await,
            None => None,
        };
        for endpoint in probe_endpoints(proxy) {
            let Ok(port) = u16::try_from(endpoint.port) else { continue };
            let id = target_id(&namespace, &name, &endpoint.address());
            wanted.insert(id.clone());
            engine.upsert(Target {
                id,
                proxy_host: endpoint.host.trim_start_matches('[').trim_end_matches(']').to_owned(),
                proxy_port: port,
                credentials: auth.clone(),
                probe_url: probe_url.clone(),
                interval: check.interval,
                timeout: check.timeout,
                healthy_threshold: check.healthy_threshold,
                unhealthy_threshold: check.unhealthy_threshold,
            });
        }
    }
    for id in engine.target_ids() {
        if !wanted.contains(&id) {
            engine.remove(&id);
            if let Some(key) = parse_target_id(&id) {
                board.remove(&key);
            }
        }
    }
}

/// The Proxy's credentials from its auth Secret (`username`, `password`), cached for a minute. A missing Secret
/// probes without credentials, which the proxy answers with 407: the failure then names the cause.
async fn read_credentials(
    client: &Client,
    namespace: &str,
    secret: &str,
    cache: &mut HashMap<(String, String), CachedCredentials>,
) -> Option<Credentials> {
    let key = (namespace.to_owned(), secret.to_owned());
    if let Some(cached) = cache.get(&key)
        && cached.read_at.elapsed() < CREDENTIALS_TTL
    {
        return cached.credentials.clone();
    }
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let credentials = match secrets.get_opt(secret).await {
        Ok(Some(secret)) => {
            let data = secret.data.unwrap_or_default();
            let field = |name: &str| data.get(name).map(|value| String::from_utf8_lossy(&value.0).into_owned());
            field("username").zip(field("password")).map(|(username, password)| Credentials { username, password })
        }
        Ok(None) => None,
        Err(error) => {
            warn!(namespace, secret, %error, "reading a proxy auth Secret for probes failed");
            None
        }
    };
    cache.insert(key, CachedCredentials { credentials: credentials.clone(), read_at: Instant::now() });
    credentials
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
            created_at: None,
        }
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

    #[test]
    fn target_ids_round_trip() {
        let id = target_id("ns", "p", "[::1]:8080");
        assert_eq!(
            parse_target_id(&id),
            Some(HealthKey { namespace: "ns".into(), name: "p".into(), address: "[::1]:8080".into() })
        );
        assert_eq!(parse_target_id("garbage"), None);
    }
}
