//! How the reconciler finds a provider by name: the operator's `ProviderSet`, or a fixed map (tests, embedders).

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use egress_provider::registry::ProviderSet;
use egress_provider::{Checker, Provider, ProviderError, TargetVerdict};

/// The configured providers, by name.
#[async_trait]
pub trait Providers: Send + Sync {
    /// The provider called `name`; an unknown name is a `Permanent` error.
    async fn provider(&self, name: &str) -> Result<Arc<dyn Provider>, ProviderError>;
    /// Every configured name.
    fn names(&self) -> Vec<String>;
    /// Whether `name` is configured at all.
    fn is_configured(&self, name: &str) -> bool {
        self.names().iter().any(|known| known == name)
    }
    /// One round of health verdicts for the provider `name`.
    async fn check(&self, name: &str) -> Vec<TargetVerdict>;
}

#[async_trait]
impl Providers for ProviderSet {
    async fn provider(&self, name: &str) -> Result<Arc<dyn Provider>, ProviderError> {
        ProviderSet::provider(self, name).await
    }
    fn names(&self) -> Vec<String> {
        ProviderSet::names(self).map(str::to_owned).collect()
    }
    async fn check(&self, name: &str) -> Vec<TargetVerdict> {
        ProviderSet::check(self, name).await
    }
}

/// A fixed set of already-built providers, with their checkers where given.
#[derive(Clone, Default)]
pub struct StaticProviders(BTreeMap<String, Entry>);

/// A provider and, when it has one, its checker.
type Entry = (Arc<dyn Provider>, Option<Arc<dyn Checker>>);

impl StaticProviders {
    /// No providers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a provider under `name`.
    pub fn with(mut self, name: impl Into<String>, provider: Arc<dyn Provider>) -> Self {
        self.0.insert(name.into(), (provider, None));
        self
    }

    /// Adds a provider under `name` with its checker.
    pub fn with_checker(
        mut self,
        name: impl Into<String>,
        provider: Arc<dyn Provider>,
        checker: Arc<dyn Checker>,
    ) -> Self {
        self.0.insert(name.into(), (provider, Some(checker)));
        self
    }
}

#[async_trait]
impl Providers for StaticProviders {
    async fn provider(&self, name: &str) -> Result<Arc<dyn Provider>, ProviderError> {
        self.0
            .get(name)
            .map(|(provider, _)| provider.clone())
            .ok_or_else(|| ProviderError::permanent(format!("no provider named {name:?} is configured")))
    }
    fn names(&self) -> Vec<String> {
        self.0.keys().cloned().collect()
    }
    async fn check(&self, name: &str) -> Vec<TargetVerdict> {
        match self.0.get(name) {
            Some((_, Some(checker))) => checker.check().await,
            Some((_, None)) => vec![TargetVerdict::ready(name)],
            None => vec![TargetVerdict::not_ready(
                name,
                "NotConfigured",
                format!("no provider named {name:?} is configured"),
            )],
        }
    }
}
