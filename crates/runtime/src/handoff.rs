//! A stopping leader's wait for a successor, and its hand-over of the requests that still reach it: make-before-break,
//! so a rolling restart or a node drain never leaves discovery without a replica that serves, nor the Service without
//! an endpoint.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, ListParams};
use tracing::{info, warn};

use crate::role_label::{LEADER, PodIdentity, ROLE_LABEL};

/// What the peers look like now.
#[derive(Debug, PartialEq, Eq)]
pub enum Successor {
    /// A peer is Ready (its stores synced) and not being deleted: it can take over at once.
    Ready(String),
    /// Peers are on their way (not being deleted, not Ready yet).
    Coming,
    /// No peer that could take over exists.
    None,
}

/// Classifies `pods` (this Deployment's, by the peer selector) for the pod `me`.
pub fn successor(pods: &[Pod], me: &str) -> Successor {
    let mut coming = false;
    for pod in pods {
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        if name == me || pod.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let status = pod.status.as_ref();
        let ended = status
            .and_then(|status| status.phase.as_deref())
            .is_some_and(|phase| matches!(phase, "Succeeded" | "Failed"));
        if ended {
            continue;
        }
        let ready = status
            .and_then(|status| status.conditions.as_ref())
            .is_some_and(|conditions| conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        if ready {
            return Successor::Ready(name.to_owned());
        }
        coming = true;
    }
    if coming { Successor::Coming } else { Successor::None }
}

/// How often the peers are looked at while waiting.
const POLL: Duration = Duration::from_millis(250);

/// Waits until a peer of `pod` is Ready, no peer is coming, or `timeout` has passed; says which in the log. Returns
/// whether a peer is Ready to take over.
pub async fn wait_for_successor(client: &Client, pod: &PodIdentity, selector: &str, timeout: Duration) -> bool {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
    let started = Instant::now();
    let params = ListParams::default().labels(selector);
    loop {
        match pods.list(&params).await {
            Ok(list) => match successor(&list.items, &pod.name) {
                Successor::Ready(peer) => {
                    info!(%peer, waited_ms = started.elapsed().as_millis() as u64, "a successor is ready; handing over");
                    return true;
                }
                Successor::None => {
                    info!(selector, "no other replica could take over; handing over now");
                    return false;
                }
                Successor::Coming => {}
            },
            Err(error) => warn!(%error, selector, "listing the peer pods failed; still waiting for a successor"),
        }
        if started.elapsed() + POLL > timeout {
            warn!(
                timeout_s = timeout.as_secs(),
                selector,
                "no other replica became Ready in time; handing over anyway (discovery pauses until one leads)"
            );
            return false;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// How long a stopping replica waits to see the next holder of the Lease.
const HOLDER_WAIT: Duration = Duration::from_secs(5);
/// A stopping replica hands requests on for at least this long after its label went, and then until none came for
/// [`QUIET`] (the Service routes elsewhere), at most [`FORWARD_MAX`].
const FORWARD_MIN: Duration = Duration::from_secs(2);
const QUIET: Duration = Duration::from_secs(1);
const FORWARD_MAX: Duration = Duration::from_secs(10);

/// After this replica gave the Lease up (it is stopping, and `discovery` holds its requests): finds the next
/// holder's pod among `selector`'s in `pod`'s namespace, sends the requests that arrive here there, and waits until
/// that pod carries the leader label (the Service routes to it), so this pod's own label goes only then and the
/// Service is never without an endpoint. Without a successor, requests are refused as before. Returns when this
/// pod's label may go: whether requests are handed on.
pub async fn hand_to_successor(
    client: &Client,
    discovery: &egress_discovery::Discovery,
    lease_namespace: &str,
    own_identity: &str,
    pod: Option<&PodIdentity>,
    selector: &str,
    port: u16,
) -> bool {
    let next = next_holder(client, lease_namespace, own_identity).await;
    let (Some(next), Some(pod)) = (next, pod) else {
        warn!(waited_s = HOLDER_WAIT.as_secs(), "no replica took the Lease in time; refusing requests until exit");
        discovery.stop_forwarding();
        return false;
    };
    let name = next.rsplit_once('_').map_or(next.as_str(), |(name, _)| name);
    let Some(successor) = successor_address(client, pod, selector, name, port).await else {
        discovery.stop_forwarding();
        return false;
    };
    info!(%successor, "handing discovery requests to the new leader until the Service routes there");
    discovery.forward_to(successor);
    let started = Instant::now();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
    let labelled = ListParams::default().labels(&format!("{selector},{ROLE_LABEL}={LEADER}"));
    while started.elapsed() < HOLDER_WAIT {
        if let Ok(list) = pods.list(&labelled).await
            && list.items.iter().any(|peer| peer.metadata.name.as_deref() == Some(name))
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    warn!(successor = name, "the new leader's pod is not labelled yet; removing this pod's label all the same");
    true
}

/// The identity that holds the leader Lease after this replica (`own_identity`) gave it up, read from the apiserver
/// (this replica's election stopped watching when it let go): `None` if none took it within [`HOLDER_WAIT`].
async fn next_holder(client: &Client, namespace: &str, own_identity: &str) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let started = Instant::now();
    while started.elapsed() < HOLDER_WAIT {
        if let Ok(Some(lease)) = leases.get_opt(crate::election::LEASE_NAME).await
            && let Some(holder) = lease.spec.and_then(|spec| spec.holder_identity)
            && !holder.is_empty()
            && holder != own_identity
        {
            return Some(holder);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// Keeps handing requests on, for at least [`FORWARD_MIN`] from `since` and then until none came for [`QUIET`] (the
/// Service routes elsewhere), at most [`FORWARD_MAX`].
pub async fn linger_until_quiet(discovery: &egress_discovery::Discovery, since: Instant) {
    loop {
        let elapsed = since.elapsed();
        if elapsed >= FORWARD_MAX || (elapsed >= FORWARD_MIN && discovery.quiet_for() >= QUIET) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The discovery address of the pod `name` among `selector`'s.
async fn successor_address(
    client: &Client,
    pod: &PodIdentity,
    selector: &str,
    name: &str,
    port: u16,
) -> Option<std::net::SocketAddr> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
    match pods.list(&ListParams::default().labels(selector)).await {
        Ok(list) => {
            let found = list.items.iter().find(|peer| peer.metadata.name.as_deref() == Some(name));
            let ip = found.and_then(|peer| peer.status.as_ref()?.pod_ip.as_deref()?.parse::<std::net::IpAddr>().ok());
            if ip.is_none() {
                warn!(
                    pod = name,
                    selector, "the new leader's pod has no address among the peers; refusing requests until exit"
                );
            }
            ip.map(|ip| std::net::SocketAddr::new(ip, port))
        }
        Err(error) => {
            warn!(%error, "listing the peer pods failed; refusing requests until exit");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::api::ObjectMeta;

    use super::*;

    fn pod(name: &str, ready: bool, deleting: bool) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                deletion_timestamp: deleting.then(|| Time(k8s_openapi::jiff::Timestamp::now())),
                ..ObjectMeta::default()
            },
            status: Some(PodStatus {
                phase: Some("Running".into()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    ..PodCondition::default()
                }]),
                ..PodStatus::default()
            }),
            ..Pod::default()
        }
    }

    #[test]
    fn only_a_ready_peer_that_stays_is_a_successor() {
        assert_eq!(successor(&[pod("me", true, true)], "me"), Successor::None);
        // The other old replica, itself being deleted, cannot take over.
        assert_eq!(successor(&[pod("me", true, true), pod("old", true, true)], "me"), Successor::None);
        // A surge pod still syncing: wait for it.
        assert_eq!(successor(&[pod("me", true, true), pod("new", false, false)], "me"), Successor::Coming);
        assert_eq!(
            successor(&[pod("me", true, true), pod("new", false, false), pod("b", true, false)], "me"),
            Successor::Ready("b".into())
        );
    }
}
