//! The kubernetes provider: each proxy instance is Squid in a Pod of the cluster the operator runs in.
//!
//! For an instance named `px-…` the provider creates, in the instance's namespace (`placement.zone`, else the
//! configured namespace), a Pod, a ConfigMap with `squid.conf`, and — when the Proxy has credentials — a Secret with
//! the password file, all named like the instance. The ConfigMap and Secret are owned by the Pod, so the cluster's
//! garbage collector removes them with it; `delete` removes all three anyway, so nothing depends on a collector
//! running. Every object carries the GC contract as labels under `crawl.example.com/`.
//!
//! `provider_id` is `<namespace>/<pod>`. Errors are classified from the API's status codes (see [`classify`]).

pub mod config;
mod objects;
pub use egress_provider::squid;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::SystemTime;

use async_trait::async_trait;
use egress_fleet::NamespacedName;
use egress_provider::config::ProviderConfig;
use egress_provider::destinations::DestinationPolicy;
use egress_provider::registry::{Built, ProviderType};
use egress_provider::{
    Checker, CreateRequest, ErrorClass, Instance, InstanceState, Provider, ProviderError, Tags, TargetVerdict,
};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, Resource};
use tracing::{debug, instrument};

pub use config::{KubernetesConfig, ResourceProfile};
pub use objects::{INSTANCE_LABEL, LABEL_PREFIX, tag_label};

/// The kubernetes provider.
#[derive(Clone)]
pub struct KubernetesProvider {
    client: Client,
    config: KubernetesConfig,
    destinations: DestinationPolicy,
}

impl ProviderType for KubernetesProvider {
    type Settings = KubernetesConfig;

    /// Uses the operator's own in-cluster or kubeconfig credentials.
    async fn construct(config: ProviderConfig) -> Result<Built, ProviderError> {
        let Some(settings) = config.settings::<KubernetesConfig>().cloned() else {
            return Err(ProviderError::permanent(format!("provider {:?} is not of type kubernetes", config.name)));
        };
        let client = Client::try_default().await.map_err(|error| {
            ProviderError::transient("no Kubernetes client configuration (in-cluster or kubeconfig)").with_source(error)
        })?;
        let provider = std::sync::Arc::new(Self::new(client, settings).with_destinations(config.destinations));
        Ok(Built { provider: provider.clone(), checker: Some(provider) })
    }
}

impl KubernetesProvider {
    /// A provider that creates pods through `client` with the given settings and the default destination policy
    /// (plus the settings' `cluster_networks`).
    pub fn new(client: Client, config: KubernetesConfig) -> Self {
        Self { client, config, destinations: DestinationPolicy::default() }
    }

    /// Where its pods are listed: in each of `namespaces` when the config names them, else cluster-wide.
    fn pod_apis(&self) -> Vec<Api<Pod>> {
        if self.config.namespaces.is_empty() {
            vec![Api::all(self.client.clone())]
        } else {
            self.config.namespaces.iter().map(|namespace| Api::namespaced(self.client.clone(), namespace)).collect()
        }
    }

    /// The same provider with `destinations` added to the default destination policy of every proxy it renders.
    pub fn with_destinations(mut self, destinations: DestinationPolicy) -> Self {
        self.destinations = destinations;
        self
    }

    fn resources(&self, machine_type: Option<&str>) -> Result<&ResourceProfile, ProviderError> {
        match machine_type {
            None => Ok(&self.config.resources),
            Some(name) => self.config.machine_types.get(name).ok_or_else(|| {
                let known: Vec<&str> = self.config.machine_types.keys().map(String::as_str).collect();
                ProviderError::permanent(format!(
                    "unknown machine type {name:?} for the kubernetes provider (configured: {})",
                    if known.is_empty() { "none".to_owned() } else { known.join(", ") }
                ))
            }),
        }
    }
}

/// The pod a provider ID (`<namespace>/<pod>`) names.
fn parse_provider_id(provider_id: &str) -> Result<NamespacedName, ProviderError> {
    provider_id.parse().map_err(|_| {
        ProviderError::permanent(format!(
            "{provider_id:?} is not a kubernetes provider ID (expected <namespace>/<pod>)"
        ))
    })
}

/// Classifies a Kubernetes API error.
///
/// 404 → `NotFound`; 403 whose message says a quota was exceeded → `QuotaExceeded`; 400, 403 and 422 →
/// `Permanent`; 429, 5xx and everything that is not an API answer (transport, TLS, timeouts) → `Transient`.
pub fn classify(context: &str, error: kube::Error) -> ProviderError {
    match &error {
        // The API's own answer says everything (code, reason, message); it is kept as the message rather than as a
        // source, whose Display would repeat it with a debug dump of the status.
        kube::Error::Api(status) => {
            let class = match status.code {
                404 => ErrorClass::NotFound,
                403 if status.message.contains("exceeded quota") => ErrorClass::QuotaExceeded,
                400 | 403 | 422 => ErrorClass::Permanent,
                _ => ErrorClass::Transient,
            };
            ProviderError::new(class, format!("{context}: {} {}: {}", status.code, status.reason, status.message))
        }
        _ => ProviderError::transient(context.to_owned()).with_source(error),
    }
}

fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

/// The instance a pod stands for.
///
/// Pending → Provisioning; Running and Ready → Running; Running but not Ready (Squid not yet listening, or its
/// container restarting) → Provisioning; Succeeded, Failed and Unknown → Terminated; a pod being deleted →
/// Terminated. The phase alone is not enough: kubelet reports `Running` as soon as the container starts, before
/// Squid accepts connections, which its readiness probe checks.
pub fn instance_from_pod(pod: &Pod) -> Instance {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let status = pod.status.as_ref();
    let ip: Option<IpAddr> = status.and_then(|status| status.pod_ip.as_deref()).and_then(|ip| ip.parse().ok());
    let state = if pod.metadata.deletion_timestamp.is_some() {
        InstanceState::Terminated
    } else {
        let ready = status
            .and_then(|status| status.conditions.as_ref())
            .is_some_and(|conditions| conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        match status.and_then(|status| status.phase.as_deref()) {
            Some("Running") if ready => InstanceState::Running,
            Some("Running") => InstanceState::Provisioning,
            Some("Succeeded" | "Failed" | "Unknown") => InstanceState::Terminated,
            _ => InstanceState::Provisioning,
        }
    };
    let created_at = pod.metadata.creation_timestamp.as_ref().map(|time| SystemTime::from(time.0));
    let tags = objects::tags_from_labels(pod.metadata.labels.as_ref().unwrap_or(&BTreeMap::new()));
    Instance::new(name.clone(), NamespacedName::new(&namespace, &name).to_string(), state, ip, created_at, tags)
}

#[async_trait]
impl Provider for KubernetesProvider {
    fn destination_policy(&self) -> Option<&DestinationPolicy> {
        Some(&self.destinations)
    }

    fn denied_networks(&self) -> &[ipnet::IpNet] {
        &self.config.cluster_networks
    }

    #[instrument(skip(self, request), fields(provider = "kubernetes", instance = %request.name))]
    async fn create(&self, request: &CreateRequest) -> Result<Instance, ProviderError> {
        let namespace = request.zone.as_deref().unwrap_or(&self.config.namespace);
        if !egress_provider::config::is_identifier(namespace) {
            return Err(ProviderError::permanent(format!(
                "{namespace:?} (placement.zone) is not a valid namespace name for the kubernetes provider"
            )));
        }
        if !self.config.namespaces.is_empty() && !self.config.namespaces.iter().any(|allowed| allowed == namespace) {
            return Err(ProviderError::permanent(format!(
                "{namespace:?} (placement.zone) is not one of this kubernetes provider's namespaces ({})",
                self.config.namespaces.join(", ")
            )));
        }
        let resources = self.resources(request.machine_type.as_deref())?;
        let image = request.image.as_deref().unwrap_or(&self.config.image);
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let pod = objects::pod(&self.config, request, namespace, image, resources)?;
        let pod = match pods.create(&PostParams::default(), &pod).await {
            Ok(created) => {
                debug!(namespace, "pod created");
                created
            }
            // Same name, so same Proxy and spec hash: a create that ran before a crash. Adopt it.
            Err(error) if is_conflict(&error) => {
                debug!(namespace, "pod exists; adopting it");
                pods.get(&request.name).await.map_err(|error| classify("reading the existing pod", error))?
            }
            // On create, 404 means the namespace does not exist: retrying the same request cannot help.
            Err(kube::Error::Api(status)) if status.code == 404 => {
                return Err(ProviderError::permanent(format!(
                    "namespace {namespace:?} does not exist: {}",
                    status.message
                )));
            }
            Err(error) => return Err(classify("creating the pod", error)),
        };
        // The ConfigMap and Secret are made after the pod so they can name it as owner; the pod waits for them.
        // Re-running this after a crash between the two steps creates what is missing.
        let owner = pod.controller_owner_ref(&()).map(|mut owner| {
            owner.controller = Some(false);
            owner
        });
        let config_maps: Api<ConfigMap> = Api::namespaced(self.client.clone(), namespace);
        let config_map = objects::config_map(
            request,
            namespace,
            owner.clone(),
            &self.destinations.narrowed_by(&request.deny_destinations),
            &self.config,
        );
        match config_maps.create(&PostParams::default(), &config_map).await {
            Ok(_) => {}
            Err(error) if is_conflict(&error) => {}
            Err(error) => return Err(classify("creating the squid ConfigMap", error)),
        }
        if let Some(secret) = objects::auth_secret(request, namespace, owner) {
            let secrets: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
            match secrets.create(&PostParams::default(), &secret).await {
                Ok(_) => {}
                Err(error) if is_conflict(&error) => {}
                Err(error) => return Err(classify("creating the proxy auth Secret", error)),
            }
        }
        Ok(instance_from_pod(&pod))
    }

    #[instrument(skip(self), fields(provider = "kubernetes"))]
    async fn get(&self, provider_id: &str) -> Result<Instance, ProviderError> {
        let pod_id = parse_provider_id(provider_id)?;
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), pod_id.namespace());
        let pod =
            pods.get(pod_id.name()).await.map_err(|error| classify(&format!("reading pod {provider_id}"), error))?;
        Ok(instance_from_pod(&pod))
    }

    #[instrument(skip(self), fields(provider = "kubernetes"))]
    async fn delete(&self, provider_id: &str) -> Result<(), ProviderError> {
        let pod_id = parse_provider_id(provider_id)?;
        let (namespace, name) = (pod_id.namespace(), pod_id.name());
        let params = DeleteParams::background();
        let ignore_missing = |result: Result<_, kube::Error>, what: &str| match result {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(error) => Err(classify(&format!("deleting {what} {provider_id}"), error)),
        };
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        ignore_missing(pods.delete(name, &params).await.map(|_| ()), "pod")?;
        let config_maps: Api<ConfigMap> = Api::namespaced(self.client.clone(), namespace);
        ignore_missing(config_maps.delete(name, &params).await.map(|_| ()), "ConfigMap")?;
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        ignore_missing(secrets.delete(name, &params).await.map(|_| ()), "Secret")?;
        Ok(())
    }

    #[instrument(skip(self, tags), fields(provider = "kubernetes"))]
    async fn list_by_tag(&self, tags: &Tags) -> Result<Vec<Instance>, ProviderError> {
        let selector = objects::selector(tags)?;
        let mut instances = Vec::new();
        for pods in self.pod_apis() {
            let list = pods
                .list(&ListParams::default().labels(&selector))
                .await
                .map_err(|error| classify("listing proxy pods", error))?;
            instances.extend(list.items.iter().map(instance_from_pod));
        }
        Ok(instances)
    }
}

#[async_trait]
impl Checker for KubernetesProvider {
    /// One target, `cluster`: the API answers and this identity may list pods where `list_by_tag` does
    /// (cluster-wide, or in each of the provider's `namespaces`).
    async fn check(&self) -> Vec<TargetVerdict> {
        let mut listed = Ok(());
        for pods in self.pod_apis() {
            if let Err(error) = pods.list_metadata(&ListParams::default().limit(1)).await {
                listed = Err(error);
                break;
            }
        }
        let verdict = match listed {
            Ok(()) => TargetVerdict::ready("cluster"),
            Err(error) => {
                let error = classify("listing pods", error);
                let reason = match error.class() {
                    ErrorClass::Permanent => "Forbidden",
                    _ => "Unreachable",
                };
                TargetVerdict::not_ready("cluster", reason, error.chain())
            }
        };
        vec![verdict]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_ids_parse_strictly() {
        let pod = parse_provider_id("egress/px-a").expect("valid");
        assert_eq!((pod.namespace(), pod.name()), ("egress", "px-a"));
        for bad in ["px-a", "/px-a", "egress/", "a/b/c", ""] {
            assert_eq!(parse_provider_id(bad).expect_err(bad).class(), ErrorClass::Permanent, "{bad:?}");
        }
    }
}
