//! The provider monitor: checks every configured provider's targets, publishes one `ProviderHealth` object per
//! provider, logs targets going down, changing reason or coming back, and exports per-target gauges.
//!
//! Leader-only, like everything that writes. A round checks all providers concurrently under one timeout, so one
//! hanging backend cannot stall the others' verdicts.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use egress_api::annotations::{MANAGED_BY_LABEL, MANAGED_BY_VALUE};
use egress_api::{ProviderHealth, ProviderHealthSpec, ProviderHealthStatus, TargetHealth};
use egress_provider::TargetVerdict;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tracing::{Instrument, info, info_span, warn};

use crate::controller::FIELD_MANAGER;
use crate::providers::Providers;
use crate::status::{ConditionSpec, merge_conditions, time};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TargetLabels {
    provider: String,
    target: String,
}

/// Per-target gauges: up (1/0), the duration of the last check, and its time.
#[derive(Clone, Default)]
pub struct MonitorMetrics {
    up: Family<TargetLabels, Gauge>,
    duration: Family<TargetLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    timestamp: Family<TargetLabels, Gauge>,
}

impl MonitorMetrics {
    /// Creates the gauges and registers them under the `provider_health` prefix of `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        let registry = registry.sub_registry_with_prefix("provider_health");
        registry.register("up", "Whether a provider target answered its last check (1) or not (0)", metrics.up.clone());
        registry.register(
            "check_duration_seconds",
            "Duration of the last check round of a provider",
            metrics.duration.clone(),
        );
        registry.register(
            "check_timestamp_seconds",
            "Unix time of a provider target's last check",
            metrics.timestamp.clone(),
        );
        metrics
    }
}

/// The monitor.
pub struct ProviderMonitor {
    client: Client,
    providers: Arc<dyn Providers>,
    timeout: Duration,
    metrics: MonitorMetrics,
    last: HashMap<(String, String), TargetVerdict>,
}

impl ProviderMonitor {
    /// A monitor checking every provider with `timeout` per round.
    pub fn new(client: Client, providers: Arc<dyn Providers>, timeout: Duration, metrics: MonitorMetrics) -> Self {
        Self { client, providers, timeout, metrics, last: HashMap::new() }
    }

    /// Deletes the `ProviderHealth` objects of providers that are not configured (all of them when `keep_none`).
    pub async fn prune(&self, keep_none: bool) -> Result<usize, kube::Error> {
        let api: Api<ProviderHealth> = Api::all(self.client.clone());
        let selector = format!("{MANAGED_BY_LABEL}={MANAGED_BY_VALUE}");
        let names = self.providers.names();
        let mut deleted = 0;
        for object in api.list(&ListParams::default().labels(&selector)).await?.items {
            let name = object.name_any();
            if keep_none || !names.contains(&name) {
                match api.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => deleted += 1,
                    Err(kube::Error::Api(status)) if status.code == 404 => {}
                    Err(error) => return Err(error),
                }
                info!(provider = %name, "deleted the ProviderHealth of a provider that is not configured");
            }
        }
        Ok(deleted)
    }

    /// One round: every provider checked concurrently, each `ProviderHealth` written.
    pub async fn check_once(&mut self) -> Result<(), kube::Error> {
        let names = self.providers.names();
        let started = Instant::now();
        let checks = names.iter().map(|name| {
            let providers = self.providers.clone();
            let timeout = self.timeout;
            let name = name.clone();
            async move {
                let verdicts = match tokio::time::timeout(timeout, providers.check(&name)).await {
                    Ok(verdicts) => verdicts,
                    Err(_) => vec![TargetVerdict::not_ready(
                        &name,
                        "CheckTimeout",
                        format!("the check did not finish within {timeout:?}"),
                    )],
                };
                (name, verdicts)
            }
        });
        let results = futures::future::join_all(checks).await;
        let duration = started.elapsed().as_secs_f64();
        for (name, verdicts) in results {
            self.publish(&name, verdicts, duration).await?;
        }
        Ok(())
    }

    async fn publish(
        &mut self,
        provider: &str,
        verdicts: Vec<TargetVerdict>,
        duration: f64,
    ) -> Result<(), kube::Error> {
        let api: Api<ProviderHealth> = Api::all(self.client.clone());
        let existing = match api.get_opt(provider).await? {
            Some(existing) => existing,
            None => {
                let mut object = ProviderHealth::new(provider, ProviderHealthSpec {});
                object.metadata = ObjectMeta {
                    name: Some(provider.to_owned()),
                    labels: Some(BTreeMap::from([(MANAGED_BY_LABEL.to_owned(), MANAGED_BY_VALUE.to_owned())])),
                    ..ObjectMeta::default()
                };
                match api.create(&PostParams::default(), &object).await {
                    Ok(created) => created,
                    Err(kube::Error::Api(status)) if status.code == 409 => api.get(provider).await?,
                    Err(error) => return Err(error),
                }
            }
        };
        let previous = existing.status.clone().unwrap_or_default();
        let now = SystemTime::now();
        let unix = now.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |elapsed| elapsed.as_secs());
        let mut targets = Vec::new();
        for verdict in verdicts {
            let labels = TargetLabels { provider: provider.to_owned(), target: verdict.target.clone() };
            self.metrics.up.get_or_create(&labels).set(i64::from(verdict.ready));
            self.metrics.duration.get_or_create(&labels).set(duration);
            self.metrics.timestamp.get_or_create(&labels).set(i64::try_from(unix).unwrap_or(i64::MAX));
            let key = (provider.to_owned(), verdict.target.clone());
            match (self.last.get(&key), verdict.ready) {
                (Some(before), true) if !before.ready => {
                    info!(provider, target = %verdict.target, "provider target is back")
                }
                (Some(before), false) if before.ready || before.reason != verdict.reason => warn!(
                    provider, target = %verdict.target, reason = verdict.reason.as_deref().unwrap_or(""),
                    message = verdict.message.as_deref().unwrap_or(""), "provider target is down"
                ),
                (None, false) => warn!(
                    provider, target = %verdict.target, reason = verdict.reason.as_deref().unwrap_or(""),
                    message = verdict.message.as_deref().unwrap_or(""), "provider target is down"
                ),
                _ => {}
            }
            let before = previous.targets.iter().find(|target| target.name == verdict.target);
            let last_transition_time = match before {
                Some(before) if before.ready == verdict.ready => before.last_transition_time.clone(),
                _ => Some(time(now)),
            };
            targets.push(TargetHealth {
                name: verdict.target.clone(),
                ready: verdict.ready,
                reason: verdict.reason.clone(),
                message: verdict.message.clone(),
                last_transition_time,
            });
            self.last.insert(key, verdict);
        }
        let mut status = ProviderHealthStatus::from_targets(targets, Some(time(now)));
        let all_ready = status.ready_targets == status.total_targets && status.total_targets > 0;
        let condition = ConditionSpec {
            type_: "Ready",
            status: if all_ready { "True" } else { "False" },
            reason: if all_ready { "AllTargetsReady".into() } else { "TargetsNotReady".into() },
            message: format!("{} of {} targets ready", status.ready_targets, status.total_targets),
        };
        let conditions: Vec<Condition> = merge_conditions(&previous.conditions, &[condition], None, now);
        status.conditions = conditions;
        let patch = serde_json::json!({ "apiVersion": "crawl.example.com/v1alpha1", "kind": "ProviderHealth", "status": status });
        api.patch_status(provider, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch)).await?;
        Ok(())
    }

    /// Prunes once, then checks every `interval` until `shutdown` resolves.
    pub async fn run(mut self, interval: Duration, shutdown: impl Future<Output = ()>) {
        if let Err(error) = self.prune(false).await {
            warn!(%error, "pruning ProviderHealth objects failed");
        }
        let rounds = async {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                if let Err(error) = self.check_once().await {
                    warn!(%error, "publishing provider health failed");
                }
            }
        };
        tokio::select! {
            () = rounds.instrument(info_span!("provider_monitor")) => {}
            () = shutdown => {}
        }
    }
}
