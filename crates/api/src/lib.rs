//! The custom resources of egress-operator, written once in Rust.
//!
//! `Proxy` (namespaced, short name `px`) declares one HTTP forward proxy: in `Managed` mode the operator creates and
//! deletes an instance on a configured provider, in `External` mode it adopts a proxy that exists elsewhere.
//! `ProxyPool` (namespaced, short name `pxp`) declares a fleet of Managed Proxies by count, spread over providers,
//! recycled by age and scaled by demand. `ProviderHealth` (cluster-scoped, status only) publishes the health of one
//! configured provider.
//!
//! The CRD YAML in `crds/` is generated from these types by `cargo xtask crdgen`; the apiserver enforces the schema,
//! the defaults and the CEL rules declared here. This crate also holds the pure helpers every other part needs
//! (effective endpoint, health check with defaults, lease cap with default, and the spec hash), and depends on no
//! other workspace crate.

pub mod annotations;
pub mod crdgen;
pub mod hash;
pub mod pool;
pub mod provider_health;
pub mod proxy;

pub use hash::{spec_hash, spec_hash_with};
pub use pool::{
    Autoscale, ProxyPool, ProxyPoolSpec, ProxyPoolStatus, ProxyTemplate, ProxyTemplateSpec, Recycle, ScalingDecision,
    SpreadEntry, SpreadStatus, TemplateMetadata,
};
pub use provider_health::{ProviderHealth, ProviderHealthSpec, ProviderHealthStatus, TargetHealth};
pub use proxy::{
    CloudInit, CooldownSpec, CooldownStatus, EffectiveHealthCheck, Endpoint, EndpointStatus, FailureStatus,
    HealthCheck, HealthStatus, InstanceState, InstanceStatus, PacingSpec, Placement, Proxy, ProxyAuth,
    ProxyDestinations, ProxyMode, ProxyPhase, ProxySpec, ProxyStatus, SecretKeyRef, SecretNameRef,
};

/// The API group of every resource in this crate.
pub const GROUP: &str = "crawl.example.com";

/// The API version of every resource in this crate.
pub const VERSION: &str = "v1alpha1";
