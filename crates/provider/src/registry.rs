//! Building the configured providers by name, from the [`ProviderTypes`] the binary registers.
//!
//! The registry depends on no backend: the operator registers the `kubernetes`, `gcp` and `kvm` backends (each its
//! settings block and constructor), and a tool embedding only one backend registers only that one. A provider that fails to construct (a missing
//! key file, credentials not mounted yet) does not take the others down: it is reported not ready by its checker,
//! and construction is tried again on use once [`RETRY_CONSTRUCTION_AFTER`] has passed.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

use crate::config::{ProviderConfig, ProvidersConfig, SettingsBlock, SettingsTypes};
use crate::{Checker, Provider, ProviderError, ProviderMetrics, TargetVerdict, WithMetrics};

/// How long a failed construction is remembered before the next use tries again.
pub const RETRY_CONSTRUCTION_AFTER: Duration = Duration::from_secs(30);

/// What a constructor builds: the provider, and its checker when it has one.
#[derive(Clone)]
pub struct Built {
    /// The provider.
    pub provider: Arc<dyn Provider>,
    /// Its health checker, if the backend has one.
    pub checker: Option<Arc<dyn Checker>>,
}

/// The future a constructor returns.
pub type BuildFuture = Pin<Box<dyn Future<Output = Result<Built, ProviderError>> + Send>>;

/// Builds one provider from its config entry.
pub type Constructor = Arc<dyn Fn(ProviderConfig) -> BuildFuture + Send + Sync>;

/// A backend: its settings block and how to build a provider from a config entry. Registering it is the one line a
/// new backend adds to a build ([`ProviderTypes::register`]).
pub trait ProviderType {
    /// Its settings block, whose [`SettingsBlock::TYPE`] is the type's name.
    type Settings: SettingsBlock;

    /// Builds one provider from its config entry, whose block is a `Self::Settings`.
    fn construct(config: ProviderConfig) -> impl Future<Output = Result<Built, ProviderError>> + Send + 'static;
}

/// The provider types a build supports: the settings blocks its providers file may hold, and their constructors.
#[derive(Clone, Default)]
pub struct ProviderTypes {
    settings: SettingsTypes,
    constructors: HashMap<&'static str, Constructor>,
}

impl ProviderTypes {
    /// No types.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers the backend `P`.
    #[must_use]
    pub fn register<P: ProviderType>(self) -> Self {
        self.with_constructor::<P::Settings>(|config| Box::pin(P::construct(config)))
    }

    /// Registers the settings block `S` with a constructor of its own (for tests and tools that build providers in
    /// their own way).
    #[must_use]
    pub fn with_constructor<S: SettingsBlock>(
        mut self,
        constructor: impl Fn(ProviderConfig) -> BuildFuture + Send + Sync + 'static,
    ) -> Self {
        self.settings = self.settings.with::<S>();
        self.constructors.insert(S::TYPE, Arc::new(constructor));
        self
    }

    /// The settings blocks, for [`ProvidersConfig::parse`].
    pub fn settings(&self) -> &SettingsTypes {
        &self.settings
    }

    /// The provider types with a constructor, sorted.
    pub fn types(&self) -> Vec<&str> {
        let mut types: Vec<&str> = self.constructors.keys().copied().collect();
        types.sort_unstable();
        types
    }
}

/// A configured provider type that this build has no constructor for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("provider {name:?} has type {type_name:?}, which this build does not support (supported: {supported})")]
pub struct UnsupportedType {
    /// The provider's name.
    pub name: String,
    /// Its type.
    pub type_name: String,
    /// The types this build supports, comma-separated.
    pub supported: String,
}

enum SlotState {
    Ready(Built),
    Failed { error: String, at: Instant },
}

struct Slot {
    config: ProviderConfig,
    constructor: Constructor,
    metrics: Option<ProviderMetrics>,
    state: Mutex<SlotState>,
}

impl Slot {
    async fn construct(&self) -> SlotState {
        match (self.constructor)(self.config.clone()).await {
            Ok(mut built) => {
                if let Some(metrics) = &self.metrics {
                    built.provider = Arc::new(WithMetrics::new(built.provider, &self.config.name, metrics.clone()));
                }
                tracing::info!(provider = %self.config.name, "provider constructed");
                SlotState::Ready(built)
            }
            Err(error) => {
                tracing::warn!(provider = %self.config.name, error = %error.chain(), "provider could not be constructed; will retry on use");
                SlotState::Failed { error: error.chain(), at: Instant::now() }
            }
        }
    }

    /// The built provider, constructing it again if the last attempt failed long enough ago.
    async fn built(&self) -> Result<Built, ProviderError> {
        let mut state = self.state.lock().await;
        if let SlotState::Failed { at, .. } = &*state
            && at.elapsed() >= RETRY_CONSTRUCTION_AFTER
        {
            *state = self.construct().await;
        }
        match &*state {
            SlotState::Ready(built) => Ok(built.clone()),
            SlotState::Failed { error, .. } => {
                Err(ProviderError::transient(format!("provider {:?} is not available: {error}", self.config.name)))
            }
        }
    }
}

/// The configured providers, built and ready to use by name.
pub struct ProviderSet {
    slots: BTreeMap<String, Slot>,
}

impl ProviderSet {
    /// Constructs every configured provider. A type without a constructor is an error (the config cannot be
    /// served); a constructor that fails is not: that provider is retried on use.
    pub async fn build(
        config: &ProvidersConfig,
        types: &ProviderTypes,
        metrics: Option<ProviderMetrics>,
    ) -> Result<Self, Vec<UnsupportedType>> {
        let mut unsupported = Vec::new();
        let mut pending = Vec::new();
        for entry in &config.providers {
            let type_name = entry.type_name();
            match types.constructors.get(type_name) {
                Some(constructor) => pending.push((entry.clone(), constructor.clone())),
                None => unsupported.push(UnsupportedType {
                    name: entry.name.clone(),
                    type_name: type_name.to_owned(),
                    supported: types.types().join(", "),
                }),
            }
        }
        if !unsupported.is_empty() {
            return Err(unsupported);
        }
        let mut slots = BTreeMap::new();
        for (config, constructor) in pending {
            let mut slot = Slot {
                config,
                constructor,
                metrics: metrics.clone(),
                state: Mutex::new(SlotState::Failed { error: String::new(), at: Instant::now() }),
            };
            slot.state = Mutex::new(slot.construct().await);
            slots.insert(slot.config.name.clone(), slot);
        }
        Ok(Self { slots })
    }

    /// The provider with this name. An unknown name is `Permanent` (the Proxy names a provider the config does not
    /// have); a provider that failed to construct is `Transient` (it may heal).
    pub async fn provider(&self, name: &str) -> Result<Arc<dyn Provider>, ProviderError> {
        let slot = self.slot(name)?;
        Ok(slot.built().await?.provider)
    }

    /// One round of health verdicts for the named provider. A provider that cannot be constructed gets a single
    /// not-ready verdict saying why; one without a checker gets a single ready verdict once constructed.
    pub async fn check(&self, name: &str) -> Vec<TargetVerdict> {
        let slot = match self.slot(name) {
            Ok(slot) => slot,
            Err(error) => return vec![TargetVerdict::not_ready(name, "NotConfigured", error.to_string())],
        };
        match slot.built().await {
            Ok(Built { checker: Some(checker), .. }) => checker.check().await,
            Ok(Built { checker: None, .. }) => vec![TargetVerdict::ready(name)],
            Err(error) => vec![TargetVerdict::not_ready(name, "ConstructionFailed", error.to_string())],
        }
    }

    /// The configured provider names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.slots.keys().map(String::as_str)
    }

    /// The config entry of the named provider.
    pub fn config(&self, name: &str) -> Option<&ProviderConfig> {
        self.slots.get(name).map(|slot| &slot.config)
    }

    fn slot(&self, name: &str) -> Result<&Slot, ProviderError> {
        self.slots.get(name).ok_or_else(|| {
            let known: Vec<&str> = self.names().collect();
            ProviderError::permanent(format!(
                "no provider named {name:?} is configured (configured: {})",
                known.join(", ")
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use async_trait::async_trait;

    use super::*;
    use crate::{CreateRequest, ErrorClass, Instance, Tags};

    struct Empty;

    #[async_trait]
    impl Provider for Empty {
        async fn create(&self, _request: &CreateRequest) -> Result<Instance, ProviderError> {
            Err(ProviderError::permanent("read-only test provider"))
        }
        async fn get(&self, provider_id: &str) -> Result<Instance, ProviderError> {
            Err(ProviderError::not_found(provider_id.to_owned()))
        }
        async fn delete(&self, _provider_id: &str) -> Result<(), ProviderError> {
            Ok(())
        }
        async fn list_by_tag(&self, _tags: &Tags) -> Result<Vec<Instance>, ProviderError> {
            Ok(Vec::new())
        }
    }

    /// A settings block for the tests, named like the Kubernetes backend's.
    #[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
    struct Pods {
        namespace: Option<String>,
    }

    impl SettingsBlock for Pods {
        const TYPE: &'static str = "kubernetes";
    }

    /// A settings block with a required field, named like the Compute Engine backend's.
    #[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
    struct Vms {
        #[expect(dead_code, reason = "read only to be required")]
        project: String,
    }

    impl SettingsBlock for Vms {
        const TYPE: &'static str = "gcp";
    }

    fn config() -> ProvidersConfig {
        ProvidersConfig::parse(
            "providers:\n  - { name: pods, type: kubernetes }\n  - { name: broken, type: kubernetes, kubernetes: { namespace: broken } }\n",
            "test",
            &SettingsTypes::new().with::<Pods>(),
        )
        .expect("valid config")
    }

    #[tokio::test]
    async fn one_failing_provider_does_not_take_the_others_down() {
        let attempts = Arc::new(AtomicUsize::new(0));
        let counter = attempts.clone();
        let types = ProviderTypes::new().with_constructor::<Pods>(move |config: ProviderConfig| {
            let counter = counter.clone();
            Box::pin(async move {
                let settings = config.settings::<Pods>().expect("only kubernetes is configured");
                if settings.namespace.as_deref() == Some("broken") {
                    counter.fetch_add(1, Ordering::SeqCst);
                    return Err(ProviderError::permanent("the kubeconfig Secret is not mounted"));
                }
                Ok(Built { provider: Arc::new(Empty) as Arc<dyn Provider>, checker: None })
            })
        });
        let set = ProviderSet::build(&config(), &types, None).await.expect("types are supported");
        assert_eq!(set.names().collect::<Vec<_>>(), ["broken", "pods"]);
        assert!(set.provider("pods").await.is_ok());

        let error = set.provider("broken").await.err().expect("broken is not available");
        assert_eq!(error.class(), ErrorClass::Transient);
        assert!(error.to_string().contains("the kubeconfig Secret is not mounted"), "{error}");
        // Within the retry period the failure is remembered rather than retried on every call.
        assert_eq!(attempts.load(Ordering::SeqCst), 1);

        let verdicts = set.check("broken").await;
        assert_eq!(verdicts.len(), 1);
        assert!(!verdicts[0].ready);
        assert_eq!(verdicts[0].reason.as_deref(), Some("ConstructionFailed"));
        assert!(set.check("pods").await[0].ready);

        let unknown = set.provider("gcp").await.err().expect("not configured");
        assert_eq!(unknown.class(), ErrorClass::Permanent);
        assert!(unknown.to_string().contains("configured: broken, pods"), "{unknown}");
    }

    #[tokio::test]
    async fn a_type_without_constructor_is_refused() {
        let errors = ProviderSet::build(
            &config(),
            &ProviderTypes::new()
                .with_constructor::<Vms>(|_config| Box::pin(async { Err(ProviderError::permanent("unused")) })),
            None,
        )
        .await
        .err()
        .expect("kubernetes is not supported by this set of constructors");
        assert_eq!(errors.len(), 2);
        assert_eq!(
            errors[0].to_string(),
            r#"provider "pods" has type "kubernetes", which this build does not support (supported: gcp)"#
        );
    }
}
