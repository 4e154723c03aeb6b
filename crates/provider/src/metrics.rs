//! The `WithMetrics` decorator: counts and times every provider call by provider, operation and outcome.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::{CreateRequest, Instance, Provider, ProviderError, Tags};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    provider: String,
    operation: &'static str,
    /// `ok`, or the error class's `kind()`.
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DurationLabels {
    provider: String,
    operation: &'static str,
}

/// Provider call metrics, shared by every decorated provider.
#[derive(Clone)]
pub struct ProviderMetrics {
    calls: Family<CallLabels, Counter>,
    duration: Family<DurationLabels, Histogram>,
}

impl Default for ProviderMetrics {
    fn default() -> Self {
        Self {
            calls: Family::default(),
            // 5 ms to about 80 s: a pod create answers in milliseconds, a cloud API call can take tens of seconds.
            duration: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.005, 2.0, 15))),
        }
    }
}

/// The provider operations [`WithMetrics`] records.
const OPERATIONS: [&str; 4] = ["create", "get", "delete", "list_by_tag"];

impl ProviderMetrics {
    /// Creates the metrics and registers them under the `provider` prefix of `registry`:
    /// `provider_calls_total{provider, operation, result}` and `provider_call_duration_seconds{provider, operation}`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        let registry = registry.sub_registry_with_prefix("provider");
        registry.register("calls", "Provider calls by provider, operation and result", metrics.calls.clone());
        registry.register(
            "call_duration_seconds",
            "Provider call duration by provider and operation",
            metrics.duration.clone(),
        );
        metrics
    }

    /// Puts every (operation, result) series of each of `providers` (the configured names) at 0, and creates their
    /// duration histograms, so dashboards and alerts see them on every replica before the first call.
    pub fn expect_providers<'a>(&self, providers: impl IntoIterator<Item = &'a str>) {
        for provider in providers {
            for operation in OPERATIONS {
                for result in ["ok", "not_found", "quota_exceeded", "transient", "permanent"] {
                    let _ = self.calls.get_or_create(&CallLabels { provider: provider.to_owned(), operation, result });
                }
                let _ = self.duration.get_or_create(&DurationLabels { provider: provider.to_owned(), operation });
            }
        }
    }

    fn observe<T>(&self, provider: &str, operation: &'static str, started: Instant, result: &Result<T, ProviderError>) {
        let outcome = match result {
            Ok(_) => "ok",
            Err(error) => error.kind(),
        };
        self.calls.get_or_create(&CallLabels { provider: provider.to_owned(), operation, result: outcome }).inc();
        self.duration
            .get_or_create(&DurationLabels { provider: provider.to_owned(), operation })
            .observe(started.elapsed().as_secs_f64());
    }
}

/// Wraps a provider and records every call in [`ProviderMetrics`] under the provider's configured name.
pub struct WithMetrics {
    inner: Arc<dyn Provider>,
    name: String,
    metrics: ProviderMetrics,
}

impl WithMetrics {
    /// Decorates `inner`, labelling its calls with `name`.
    pub fn new(inner: Arc<dyn Provider>, name: impl Into<String>, metrics: ProviderMetrics) -> Self {
        Self { inner, name: name.into(), metrics }
    }
}

#[async_trait]
impl Provider for WithMetrics {
    async fn create(&self, request: &CreateRequest) -> Result<Instance, ProviderError> {
        let started = Instant::now();
        let result = self.inner.create(request).await;
        self.metrics.observe(&self.name, "create", started, &result);
        result
    }

    async fn get(&self, provider_id: &str) -> Result<Instance, ProviderError> {
        let started = Instant::now();
        let result = self.inner.get(provider_id).await;
        self.metrics.observe(&self.name, "get", started, &result);
        result
    }

    async fn delete(&self, provider_id: &str) -> Result<(), ProviderError> {
        let started = Instant::now();
        let result = self.inner.delete(provider_id).await;
        self.metrics.observe(&self.name, "delete", started, &result);
        result
    }

    async fn list_by_tag(&self, tags: &Tags) -> Result<Vec<Instance>, ProviderError> {
        let started = Instant::now();
        let result = self.inner.list_by_tag(tags).await;
        self.metrics.observe(&self.name, "list_by_tag", started, &result);
        result
    }

    fn destination_policy(&self) -> Option<&crate::destinations::DestinationPolicy> {
        self.inner.destination_policy()
    }

    fn denied_networks(&self) -> &[ipnet::IpNet] {
        self.inner.denied_networks()
    }

    fn destination_denial(
        &self,
        host: &str,
        port: u16,
        connect: bool,
        deny: &[crate::destinations::DestinationRule],
    ) -> Option<crate::destinations::Denial> {
        self.inner.destination_denial(host, port, connect, deny)
    }

    fn instance_fingerprint(&self) -> Option<String> {
        self.inner.instance_fingerprint()
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;

    use super::*;
    use crate::InstanceState;

    /// A provider whose `get` finds one instance and whose `delete` always fails permanently.
    struct Fixed;

    #[async_trait]
    impl Provider for Fixed {
        async fn create(&self, request: &CreateRequest) -> Result<Instance, ProviderError> {
            Ok(Instance::new(&request.name, &request.name, InstanceState::Provisioning, None, None, Tags::new()))
        }
        async fn get(&self, provider_id: &str) -> Result<Instance, ProviderError> {
            Ok(Instance::new(provider_id, provider_id, InstanceState::Running, None, None, Tags::new()))
        }
        async fn delete(&self, _provider_id: &str) -> Result<(), ProviderError> {
            Err(ProviderError::permanent("forbidden"))
        }
        async fn list_by_tag(&self, _tags: &Tags) -> Result<Vec<Instance>, ProviderError> {
            Ok(Vec::new())
        }
        fn instance_fingerprint(&self) -> Option<String> {
            Some("0123456789abcdef".into())
        }
    }

    /// The reconciler reads the fingerprint through this wrapper: without it, a provider's changed destination
    /// policy never reached its running proxies.
    #[test]
    fn the_instance_fingerprint_is_the_wrapped_providers() {
        let provider = WithMetrics::new(Arc::new(Fixed), "pods", ProviderMetrics::register(&mut Registry::default()));
        assert_eq!(provider.instance_fingerprint().as_deref(), Some("0123456789abcdef"));
    }

    #[tokio::test]
    async fn calls_are_counted_by_operation_and_result() {
        let mut registry = Registry::with_prefix("egress");
        let metrics = ProviderMetrics::register(&mut registry);
        let provider = WithMetrics::new(Arc::new(Fixed), "pods", metrics);
        provider.get("a").await.expect("get succeeds");
        provider.get("b").await.expect("get succeeds");
        provider.delete("a").await.expect_err("delete fails");

        let mut text = String::new();
        encode(&mut text, &registry).expect("encodes");
        assert!(
            text.contains(r#"egress_provider_calls_total{provider="pods",operation="get",result="ok"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"egress_provider_calls_total{provider="pods",operation="delete",result="permanent"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"egress_provider_call_duration_seconds_count{provider="pods",operation="get"} 2"#));
    }
}
