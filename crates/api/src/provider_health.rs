//! The `ProviderHealth` custom resource: one cluster-scoped object per configured provider, written by the
//! operator's provider monitor, saying whether each of the provider's targets (a GCP project, a KVM host, a cluster)
//! answers.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `ProviderHealth` has no desired state: the object exists so its status can be read with kubectl and alerted on.
// Each `printcolumn(...)` repeats keys such as `type_ = "string"`, which clippy mistakes for a duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "crawl.example.com",
    version = "v1alpha1",
    kind = "ProviderHealth",
    plural = "providerhealths",
    category = "egress",
    status = "ProviderHealthStatus",
    doc = "The health of one provider configured in egress-operator, one verdict per target. Written by the operator.",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.ready",
        description = "Ready targets / all targets"
    ),
    printcolumn(name = "Last Check", type_ = "date", json_path = ".status.lastCheckTime"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
pub struct ProviderHealthSpec {}

/// The provider monitor's last verdicts.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProviderHealthStatus {
    /// `Ready`: every target is ready.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// One verdict per target.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub targets: Vec<TargetHealth>,
    /// How many targets are ready.
    #[serde(default)]
    pub ready_targets: i32,
    /// How many targets there are.
    #[serde(default)]
    pub total_targets: i32,
    /// `ready/total`, for display.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
    /// When the last round of checks finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_check_time: Option<Time>,
}

/// One target's verdict.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TargetHealth {
    /// The target: a project, a host, a cluster.
    pub name: String,
    /// Whether the target answered as expected.
    pub ready: bool,
    /// A stable, machine-readable reason when not ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What went wrong, for a human.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// When `ready` last flipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
}

impl ProviderHealthStatus {
    /// Builds a status from the targets, filling the counts and the `ready/total` summary from them.
    pub fn from_targets(targets: Vec<TargetHealth>, last_check_time: Option<Time>) -> Self {
        let total = targets.len();
        let ready = targets.iter().filter(|target| target.ready).count();
        Self {
            conditions: Vec::new(),
            ready_targets: i32::try_from(ready).unwrap_or(i32::MAX),
            total_targets: i32::try_from(total).unwrap_or(i32::MAX),
            ready: Some(format!("{ready}/{total}")),
            targets,
            last_check_time,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(name: &str, ready: bool) -> TargetHealth {
        TargetHealth { name: name.into(), ready, reason: None, message: None, last_transition_time: None }
    }

    #[test]
    fn counts_follow_the_targets() {
        let cases = [
            (vec![], 0, 0, "0/0"),
            (vec![target("a", true)], 1, 1, "1/1"),
            (vec![target("a", true), target("b", false)], 1, 2, "1/2"),
        ];
        for (targets, ready, total, summary) in cases {
            let status = ProviderHealthStatus::from_targets(targets, None);
            assert_eq!(
                (status.ready_targets, status.total_targets, status.ready.as_deref()),
                (ready, total, Some(summary))
            );
        }
    }
}
