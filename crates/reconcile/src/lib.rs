//! The Proxy state machine: turns each `Proxy` into exactly one live provider instance, replaces it without
//! downtime when its spec changes, never leaks or duplicates an instance when killed at any point, and cleans up on
//! delete. Plus the orphan collector, which deletes instances no Proxy owns any more.
//!
//! The shape is observe → decide → act. [`observe`](controller) reads the provider and the object, [`decide`] is a
//! pure function from those facts to an action and a new status (table-tested without any server), and the
//! controller performs the action, writes the status only when it changed, and publishes Events. kube's
//! `Controller` drives it; `error_policy` alone decides error backoff, per object, reset on success.

pub mod backoff;
mod controller;
mod credentials;
pub mod decide;
mod error;
mod events;
pub mod feed;
pub mod gc;
pub mod geoip;
mod health;
pub mod health_feed;
pub mod ids;
mod metrics;
pub mod monitor;
pub mod pool;
mod providers;
mod status;

pub use controller::{Context, ControllerConfig, LeaseDrain, Trigger, run, trigger_channel};
pub use credentials::CredentialStore;
pub use egress_fleet::ProxyCredentials;
pub use error::Error;
pub use feed::{Change, Fanout, GuardedPool, GuardedProxy, PoolFeed, ProxyFeed, auth_secret_of, reference_of};
pub use health::{ProbeKey, ProxyVerdicts, Verdict, current_verdict, status_verdict, verdict_of};
pub use metrics::ReconcileMetrics;
pub use providers::{Providers, StaticProviders};
