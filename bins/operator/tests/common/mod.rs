//! Helpers the end-to-end binaries use.

pub mod cluster;

use std::net::SocketAddr;
use std::time::Duration;

use egress_api::{HealthCheck, Proxy, ProxyPhase, ProxySpec};
use kube::api::Api;

/// Waits until every named Proxy is in `phase` and returns them; on timeout, the phases last seen.
pub async fn wait_phase(
    api: &Api<Proxy>,
    names: &[&str],
    phase: ProxyPhase,
    timeout: Duration,
) -> Result<Vec<Proxy>, String> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut poll = tokio::time::interval(Duration::from_millis(250));
    loop {
        poll.tick().await;
        let mut found = Vec::new();
        let mut seen = Vec::new();
        for name in names {
            let proxy = api.get(name).await.map_err(|error| format!("reading Proxy {name}: {error}"))?;
            let current = proxy.status.as_ref().and_then(|status| status.phase);
            seen.push(format!("{name}={current:?}"));
            if current == Some(phase) {
                found.push(proxy);
            }
        }
        if found.len() == names.len() {
            return Ok(found);
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("timed out after {timeout:?} waiting for {phase:?}; phases: {}", seen.join(", ")));
        }
    }
}

/// Probes every 5 s (3 s timeout), healthy after `healthy_threshold` good probes, unhealthy after 2 bad ones.
fn fast_probes(healthy_threshold: i32) -> HealthCheck {
    HealthCheck::every(5, 3, healthy_threshold, 2)
}

/// An External Proxy spec for the proxy at `address`, probed every 5 s, Ready after `healthy_threshold` probes.
#[allow(dead_code)] // Not every binary that includes this module uses it.
pub fn external(address: SocketAddr, healthy_threshold: i32) -> ProxySpec {
    ProxySpec::external(address.ip().to_string(), address.port()).with_health_check(fast_probes(healthy_threshold))
}

/// A Managed Proxy spec on `provider` (in namespace `zone`, if given), probed every 5 s, Ready after one good probe.
#[allow(dead_code)] // Not every binary that includes this module uses it.
pub fn managed(provider: &str, zone: Option<&str>) -> ProxySpec {
    ProxySpec::managed(provider, zone).with_health_check(fast_probes(1))
}

/// Every query of the shipped Grafana dashboard (`deploy/grafana/egress-operator.json`), with its panel's title.
#[allow(dead_code)] // Not every binary that includes this module uses it.
pub fn dashboard_queries() -> Vec<(String, String)> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/grafana/egress-operator.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|error| panic!("reading {}: {error}", path.display()));
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let title = panel["title"].as_str().expect("a title").to_owned();
            queries.push((title, target["expr"].as_str().expect("an expr").to_owned()));
        }
    }
    queries
}

/// The metric families the shipped dashboard and alert rules read (a histogram by its family name, a counter by its
/// `_total` name).
#[allow(dead_code)]
pub fn dashboard_and_alert_families() -> std::collections::BTreeSet<String> {
    let rules = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/prometheus/prometheusrule.yaml");
    let rules = std::fs::read_to_string(&rules).unwrap_or_else(|error| panic!("reading {}: {error}", rules.display()));
    let mut text: String = dashboard_queries().into_iter().map(|(_, expr)| expr + "\n").collect();
    text.push_str(&rules);
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("egress_"))
        .map(family)
        .collect()
}

/// The families of a Prometheus text exposition that have at least one sample.
#[allow(dead_code)]
pub fn families_with_samples(exposition: &str) -> std::collections::BTreeSet<String> {
    exposition
        .lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .filter_map(|line| line.split(['{', ' ']).next())
        .map(family)
        .collect()
}

/// A sample's or a query's metric name as its family: a histogram's `_bucket`, `_sum` and `_count` dropped.
fn family(name: &str) -> String {
    ["_bucket", "_sum", "_count"].iter().find_map(|suffix| name.strip_suffix(suffix)).unwrap_or(name).to_owned()
}
