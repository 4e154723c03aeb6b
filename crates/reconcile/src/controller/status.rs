//! The Proxy's status: read back for what the last pass recorded, written by server-side apply only when it
//! changed.

use egress_api::{Proxy, ProxyStatus};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use tracing::debug;

use super::{Context, FIELD_MANAGER};
use crate::Error;

/// The message of the status's `Provisioned` condition.
pub(super) fn provisioned_message(status: &ProxyStatus) -> Option<&str> {
    status
        .conditions
        .iter()
        .find(|condition| condition.type_ == egress_api::proxy::CONDITION_PROVISIONED)
        .map(|condition| condition.message.as_str())
}

/// Writes the status with server-side apply, only when it differs from what was read. `cooldowns` belong to the
/// discovery API's own field manager: they are neither compared nor sent, so this apply never owns or removes them.
pub(super) async fn write_status(
    proxy: &Proxy,
    context: &Context,
    before: &ProxyStatus,
    after: &ProxyStatus,
) -> Result<(), Error> {
    let without_cooldowns = |status: &ProxyStatus| ProxyStatus { cooldowns: Vec::new(), ..status.clone() };
    let after = &without_cooldowns(after);
    if &without_cooldowns(before) == after {
        return Ok(());
    }
    let api: Api<Proxy> = Api::namespaced(context.client.clone(), &proxy.namespace().unwrap_or_default());
    let patch = serde_json::json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "status": after,
    });
    api.patch_status(&proxy.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch)).await?;
    debug!(phase = ?after.phase, "status written");
    Ok(())
}
