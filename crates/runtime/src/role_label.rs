//! The leader labels its own Pod, so the `egress-discovery` Service (which selects the label) sends discovery
//! traffic to the leader only, the way Patroni and CloudNativePG route their primary Service. A follower's pod stays
//! Ready, so rollouts keep working, but is never among that Service's endpoints.
//!
//! The label is set when this replica starts leading and removed when it stops: on losing the Lease, on shutdown
//! (before the Lease is released), and at start-up (a process restarted after a crash finds the label its previous
//! incarnation left). Outside a pod (no `POD_NAME`/`POD_NAMESPACE`) nothing is labelled.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use tokio::sync::watch;
use tracing::{info, warn};

/// The label on the leader's Pod; `deploy/default`'s discovery Service selects it.
pub const ROLE_LABEL: &str = "egress.crawl.example.com/role";

/// Its value on the leader's Pod.
pub const LEADER: &str = "leader";

/// How long a shutdown waits for the label's removal before giving up the Lease anyway.
pub const REMOVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The Pod this process runs in, from the downward API variables the Deployment sets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodIdentity {
    /// `POD_NAME`.
    pub name: String,
    /// `POD_NAMESPACE`.
    pub namespace: String,
}

impl PodIdentity {
    /// From `POD_NAME` and `POD_NAMESPACE`; None unless both are set and non-empty.
    pub fn from_env() -> Option<Self> {
        Self::from_values(std::env::var("POD_NAME").ok(), std::env::var("POD_NAMESPACE").ok())
    }

    fn from_values(name: Option<String>, namespace: Option<String>) -> Option<Self> {
        let name = name.filter(|name| !name.is_empty())?;
        let namespace = namespace.filter(|namespace| !namespace.is_empty())?;
        Some(Self { name, namespace })
    }
}

/// The merge patch that sets (`leading`) or removes the label.
pub fn label_patch(leading: bool) -> serde_json::Value {
    let value = if leading { json!(LEADER) } else { serde_json::Value::Null };
    json!({ "metadata": { "labels": { ROLE_LABEL: value } } })
}

/// Keeps the label on `pod` equal to `leading`, retrying failed patches with back-off; from `stop` on, keeps it as it
/// is until `unlabel` (a stopping leader's Service endpoint stays until its successor's pod has the label), then
/// removes it and returns.
pub async fn run(
    client: Client,
    pod: PodIdentity,
    mut leading: watch::Receiver<bool>,
    mut stop: watch::Receiver<bool>,
    mut unlabel: watch::Receiver<bool>,
) {
    let pods: Api<Pod> = Api::namespaced(client, &pod.namespace);
    let mut applied: Option<bool> = None;
    let mut backoff = Duration::from_millis(200);
    // The unlabel sender gone counts as unlabel.
    let mut gone = false;
    loop {
        let removing = gone || *unlabel.borrow();
        // Once stopping, the label stays as it is (a stopping leader hands its requests on while the Service still
        // routes here) until `unlabel`, whatever the election says meanwhile.
        let stopping = *stop.borrow() && !removing;
        let wanted = if removing {
            false
        } else if stopping {
            applied.unwrap_or(false)
        } else {
            *leading.borrow()
        };
        if applied != Some(wanted) {
            match pods.patch(&pod.name, &PatchParams::default(), &Patch::Merge(label_patch(wanted))).await {
                Ok(_) => {
                    info!(pod = %pod.name, leader = wanted, "{}", if wanted { "labelled this pod as the leader" } else { "this pod is not labelled as the leader" });
                    applied = Some(wanted);
                    backoff = Duration::from_millis(200);
                }
                Err(error) => {
                    // While shutting down too: the caller bounds that wait with REMOVE_TIMEOUT.
                    warn!(pod = %pod.name, %error, "setting the pod's leader label failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                    continue;
                }
            }
        }
        if removing {
            return;
        }
        if stopping {
            gone = unlabel.changed().await.is_err();
            continue;
        }
        tokio::select! {
            changed = leading.changed() => if changed.is_err() {
                // The election is gone: not leading any more.
                let _ = stop.changed().await;
            },
            _ = stop.changed() => {}
            changed = unlabel.changed() => gone = changed.is_err(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_patch_sets_and_removes_the_label() {
        assert_eq!(
            label_patch(true),
            json!({ "metadata": { "labels": { "egress.crawl.example.com/role": "leader" } } })
        );
        assert_eq!(label_patch(false), json!({ "metadata": { "labels": { "egress.crawl.example.com/role": null } } }));
    }

    #[test]
    fn a_pod_identity_needs_both_variables() {
        let some = |text: &str| Some(text.to_owned());
        assert_eq!(
            PodIdentity::from_values(some("op-1"), some("egress-system")),
            Some(PodIdentity { name: "op-1".into(), namespace: "egress-system".into() })
        );
        assert_eq!(PodIdentity::from_values(some("op-1"), None), None);
        assert_eq!(PodIdentity::from_values(some(""), some("egress-system")), None);
        assert_eq!(PodIdentity::from_values(None, some("egress-system")), None);
    }
}
