//! A stopping leader's wait for a successor: make-before-break, so a rolling restart or a node drain never leaves
//! discovery without a replica that can serve.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, ListParams};
use tracing::{info, warn};

use crate::role_label::PodIdentity;

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

/// Waits until a peer of `pod` is Ready, no peer is coming, or `timeout` has passed; says which in the log.
pub async fn wait_for_successor(client: &Client, pod: &PodIdentity, selector: &str, timeout: Duration) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
    let started = Instant::now();
    let params = ListParams::default().labels(selector);
    loop {
        match pods.list(&params).await {
            Ok(list) => match successor(&list.items, &pod.name) {
                Successor::Ready(peer) => {
                    info!(%peer, waited_ms = started.elapsed().as_millis() as u64, "a successor is ready; handing over");
                    return;
                }
                Successor::None => {
                    info!(selector, "no other replica could take over; handing over now");
                    return;
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
            return;
        }
        tokio::time::sleep(POLL).await;
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
