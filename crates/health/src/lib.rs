//! The health engine: checks every proxy by tunnelling a real request through it, with hysteresis, and reports
//! only verdict transitions.
//!
//! Knows nothing of Kubernetes. It is given [`Target`]s (an identifier, the proxy endpoint, optional credentials,
//! the probe URL, interval, timeout and thresholds) and emits [`Transition`]s on a bounded channel; the current
//! verdict of every target is readable at any time from [`Verdicts`], the one store the engine writes and everyone
//! else reads. The operator feeds it from its Proxy store and turns each
//! transition into one reconcile, so a Proxy's status is written once per transition, never per probe.

mod engine;
mod metrics;
mod probe;
mod thresholds;
mod verdicts;

pub use egress_fleet::ProxyCredentials;
pub use engine::{EngineConfig, HealthEngine, Target, Transition};
pub use metrics::HealthMetrics;
pub use probe::{
    FailureReason, InvalidProbeUrl, ProbeSuccess, ProbeUrl, TlsSetupError, USER_AGENT, probe, tls_connector,
};
pub use thresholds::{Counters, Verdict};
pub use verdicts::{CurrentVerdict, TargetKey, Verdicts};
