//! The provider monitor against the real control plane: one ProviderHealth per provider, transition times kept
//! while a target's readiness holds, and objects of unconfigured providers pruned.

mod support;

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use egress_api::ProviderHealth;
use egress_api::annotations::{MANAGED_BY_LABEL, MANAGED_BY_VALUE};
use egress_provider::{Checker, Provider, TargetVerdict};
use egress_reconcile::StaticProviders;
use egress_reconcile::monitor::{MonitorMetrics, ProviderMonitor};
use kube::api::{Api, ObjectMeta, PostParams};
use support::ScriptedProvider;

/// A checker whose verdicts the test sets.
#[derive(Default)]
struct Switch(Mutex<Vec<TargetVerdict>>);

#[async_trait]
impl Checker for Switch {
    async fn check(&self) -> Vec<TargetVerdict> {
        self.0.lock().unwrap().clone()
    }
}

#[tokio::test]
async fn provider_health_objects_follow_the_checks() {
    let ns = egress_testenv::namespace("monitor").await;
    // ProviderHealth is cluster-scoped: the provider name carries the namespace so parallel tests never collide.
    let name = format!("scripted-{}", ns.name());
    let switch =
        Arc::new(Switch(Mutex::new(vec![TargetVerdict::ready("project-a"), TargetVerdict::ready("project-b")])));
    let providers =
        StaticProviders::new().with_checker(&name, ScriptedProvider::new() as Arc<dyn Provider>, switch.clone());
    let mut monitor = ProviderMonitor::new(
        ns.client(),
        Arc::new(providers),
        std::time::Duration::from_secs(5),
        MonitorMetrics::default(),
    );
    let api: Api<ProviderHealth> = Api::all(ns.client());

    monitor.check_once().await.expect("check");
    let first = api.get(&name).await.expect("created");
    assert_eq!(first.labels().get(MANAGED_BY_LABEL).map(String::as_str), Some(MANAGED_BY_VALUE));
    let status = first.status.clone().expect("status");
    assert_eq!(status.ready.as_deref(), Some("2/2"));
    assert_eq!(status.conditions[0].status, "True");
    let b_since = status.targets.iter().find(|t| t.name == "project-b").and_then(|t| t.last_transition_time.clone());

    *switch.0.lock().unwrap() = vec![
        TargetVerdict::ready("project-a"),
        TargetVerdict::not_ready("project-b", "Forbidden", "credentials rejected"),
    ];
    monitor.check_once().await.expect("check");
    let second = api.get(&name).await.expect("get").status.expect("status");
    assert_eq!(second.ready.as_deref(), Some("1/2"));
    assert_eq!(second.conditions[0].status, "False");
    let a_before = status.targets.iter().find(|t| t.name == "project-a").and_then(|t| t.last_transition_time.clone());
    let a_after = second.targets.iter().find(|t| t.name == "project-a").and_then(|t| t.last_transition_time.clone());
    assert_eq!(a_before, a_after, "a target whose readiness holds keeps its transition time");
    let b = second.targets.iter().find(|t| t.name == "project-b").expect("project-b");
    assert_eq!(b.reason.as_deref(), Some("Forbidden"));
    assert!(b.last_transition_time >= b_since);

    // An object of a provider that is not configured any more is pruned.
    let stale_name = format!("gone-{}", ns.name());
    let mut stale = ProviderHealth::new(&stale_name, egress_api::ProviderHealthSpec {});
    stale.metadata = ObjectMeta {
        name: Some(stale_name.clone()),
        labels: Some([(MANAGED_BY_LABEL.to_owned(), MANAGED_BY_VALUE.to_owned())].into()),
        ..ObjectMeta::default()
    };
    api.create(&PostParams::default(), &stale).await.expect("create stale");
    monitor.prune(false).await.expect("prune");
    assert!(api.get_opt(&stale_name).await.expect("get").is_none(), "pruned");
    assert!(api.get_opt(&name).await.expect("get").is_some(), "a configured provider's object stays");
}

use kube::ResourceExt;
