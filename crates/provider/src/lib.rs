//! The provider contract of egress-operator: what every backend (Kubernetes pods, Compute Engine VMs, libvirt
//! guests) implements, and the shared machinery around it.
//!
//! This crate depends on neither `kube` nor the operator's API types, so other tools can embed the backends. It
//! owns:
//!
//! - the [`Provider`] and [`Checker`] traits, and the types they speak ([`Instance`], [`CreateRequest`], [`Tags`]);
//! - [`ProviderError`] with its [`ErrorClass`], decided once at the provider edge;
//! - [`instance_name`], the pure function that makes creation idempotent and crash-safe;
//! - the providers config file ([`config`]), parsed strictly with every problem reported at once;
//! - the [`registry`] that builds named providers from a type → constructor map the binary passes in;
//! - the [`WithMetrics`] decorator;
//! - Squid's configuration and password file ([`squid`]), the same for every backend.

pub mod cloud_init;
pub mod config;
pub mod destinations;
mod error;
mod instance;
mod metrics;
mod naming;
pub mod registry;
pub mod squid;

use async_trait::async_trait;

pub use error::{ErrorClass, ProviderError};
pub use instance::{CreateRequest, Instance, InstanceState, ProxyCredentials, Sensitive, Tags};
pub use metrics::{ProviderMetrics, WithMetrics};
pub use naming::instance_name;

use destinations::{Denial, DestinationRule};

/// A backend that creates, observes and deletes proxy instances.
///
/// Every method is safe to call again after a crash at any point: `create` adopts an existing instance with the
/// requested name, `delete` of a missing instance succeeds, and `get` reads the world afresh.
#[async_trait]
pub trait Provider: Send + Sync {
    /// Creates the instance, or returns the existing one with that name (idempotent). Long-running work is not
    /// awaited: the returned instance may be `Provisioning`, and `get` observes its progress.
    async fn create(&self, request: &CreateRequest) -> Result<Instance, ProviderError>;

    /// Reads the instance that `provider_id` names; a missing one is an error of class `NotFound`.
    async fn get(&self, provider_id: &str) -> Result<Instance, ProviderError>;

    /// Deletes the instance and everything created for it. Idempotent: deleting a missing instance succeeds.
    async fn delete(&self, provider_id: &str) -> Result<(), ProviderError>;

    /// Every instance carrying all of `tags`, across all zones, hosts or namespaces of this provider.
    async fn list_by_tag(&self, tags: &Tags) -> Result<Vec<Instance>, ProviderError>;

    /// The destination policy this provider renders into every proxy it creates; `None` (the default) when it
    /// renders none. [`Self::destination_denial`] and [`Self::instance_fingerprint`] follow from it.
    fn destination_policy(&self) -> Option<&destinations::DestinationPolicy> {
        None
    }

    /// Networks the rendered policy refuses besides the policy's own rules (the Kubernetes provider's cluster
    /// networks); none by default.
    fn denied_networks(&self) -> &[ipnet::IpNet] {
        &[]
    }

    /// Why a proxy this provider renders, with `deny` added to its policy, would refuse a request to `host`:`port`
    /// (a CONNECT tunnel when `connect`), when that is known without DNS (an IP literal or `localhost`). `None`
    /// when it is allowed, when only DNS can tell, or when the provider renders no destination policy.
    fn destination_denial(&self, host: &str, port: u16, connect: bool, deny: &[DestinationRule]) -> Option<Denial> {
        self.destination_policy()?.narrowed_by(deny).check_host(host, port, connect, self.denied_networks())
    }

    /// What of this provider's own configuration every instance it creates bakes in, as a short digest: its
    /// destination policy ([`destinations::DestinationPolicy::fingerprint`]). The reconciler mixes it into each
    /// Proxy's desired spec hash, so a change rolls the provider's proxies make-before-break. `None` when nothing
    /// is baked in.
    fn instance_fingerprint(&self) -> Option<String> {
        self.destination_policy()?.fingerprint()
    }
}

/// A provider's own health: one verdict per target (a project, a host, a cluster). It never fails as a whole.
#[async_trait]
pub trait Checker: Send + Sync {
    /// Checks every target once.
    async fn check(&self) -> Vec<TargetVerdict>;
}

/// Whether one target of a provider works.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetVerdict {
    /// The target: a project, a host, a cluster.
    pub target: String,
    /// Whether it answered as expected.
    pub ready: bool,
    /// A stable, machine-readable reason when not ready (CamelCase).
    pub reason: Option<String>,
    /// What went wrong, for a human.
    pub message: Option<String>,
}

impl TargetVerdict {
    /// A ready target.
    pub fn ready(target: impl Into<String>) -> Self {
        Self { target: target.into(), ready: true, reason: None, message: None }
    }

    /// A target that is not ready, with a reason and a message.
    pub fn not_ready(target: impl Into<String>, reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self { target: target.into(), ready: false, reason: Some(reason.into()), message: Some(message.into()) }
    }
}
