//! The Proxy's status: read back for what the last pass recorded, written by server-side apply only when it
//! changed.

use egress_api::{Proxy, ProxyStatus};
use egress_fleet::labels::{EGRESS_ASN as EGRESS_ASN_LABEL, EGRESS_COUNTRY as EGRESS_COUNTRY_LABEL};
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

/// Sets the Proxy's labels [`EGRESS_COUNTRY_LABEL`] and [`EGRESS_ASN_LABEL`] to what `status` says (removing one the
/// status no longer has), with a merge patch of those two keys only, when they differ. Only with GeoIP databases:
/// without them the labels are the user's to keep or remove.
pub(super) async fn write_geo_labels(proxy: &Proxy, context: &Context, status: &ProxyStatus) -> Result<(), Error> {
    if context.geoip.is_none() {
        return Ok(());
    }
    let wanted = [
        (EGRESS_COUNTRY_LABEL, status.egress_country.clone()),
        (EGRESS_ASN_LABEL, status.egress_asn.map(|asn| asn.to_string())),
    ];
    let labels = proxy.labels();
    if wanted.iter().all(|(key, value)| labels.get(*key) == value.as_ref()) {
        return Ok(());
    }
    let labels: serde_json::Map<String, serde_json::Value> =
        wanted.iter().map(|(key, value)| ((*key).to_owned(), value.clone().into())).collect();
    let api: Api<Proxy> = Api::namespaced(context.client.clone(), &proxy.namespace().unwrap_or_default());
    let patch = serde_json::json!({ "metadata": { "labels": labels } });
    api.patch(&proxy.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await?;
    debug!(country = ?status.egress_country, asn = ?status.egress_asn, "egress labels written");
    Ok(())
}
