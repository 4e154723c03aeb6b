//! The pool controller: keeps each `ProxyPool`'s member Proxies at its count, on its spread, on its template and
//! under its age limit, and moves the count with demand when the pool autoscales.
//!
//! [`decide`] is the pure decision, table-tested without any server; [`controller`] observes the members through
//! the operator's one Proxy store (an [`index`] of members per pool keeps that O(1) per change), performs the
//! decision and writes the pool's status; [`metrics`] are its gauges and counters.

pub mod controller;
pub mod decide;
pub mod index;
pub mod metrics;

pub use controller::{NoSignals, POOL_FIELD_MANAGER, PoolContext, PoolDemand, PoolSignals, PoolTrigger, run_pools};
pub use metrics::PoolMetrics;
