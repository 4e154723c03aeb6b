//! Helpers both end-to-end binaries use.

use std::time::Duration;

use egress_api::{Proxy, ProxyPhase};
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
