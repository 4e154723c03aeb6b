//! Observing the world for one Proxy: the provider's view of the recorded instances, the health verdicts, the
//! drained leases of a replaced instance, and whether its auth Secret has arrived.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use egress_api::annotations;
use egress_api::{Proxy, ProxyMode};
use egress_provider::{Instance, Provider, ProviderError};
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::Api;

use super::Context;
use crate::Error;
use crate::decide::{Facts, Observed, PreviousObserved};
use crate::health::verdict_of;
use crate::ids::proxy_id;

/// `maxAge` shortened by a per-Proxy jitter of up to 10%, so a fleet created together does not rotate together.
pub(super) fn jittered_max_age(proxy: &Proxy) -> Option<Duration> {
    let max_age = proxy.spec.max_age()?;
    let uid = proxy.uid().unwrap_or_default();
    let spread = uid.bytes().fold(0_u32, |acc, byte| acc.wrapping_mul(31).wrapping_add(u32::from(byte))) % 1000;
    Some(max_age.mul_f64(1.0 - f64::from(spread) / 10_000.0))
}

pub(super) fn observed(instance: &Instance) -> Observed {
    Observed::Found {
        state: match instance.state {
            egress_provider::InstanceState::Provisioning => egress_api::InstanceState::Provisioning,
            egress_provider::InstanceState::Running => egress_api::InstanceState::Running,
            egress_provider::InstanceState::Stopped => egress_api::InstanceState::Stopped,
            egress_provider::InstanceState::Terminated => egress_api::InstanceState::Terminated,
        },
        ip: instance.ip.map(|ip| ip.to_string()),
        created_at: instance.created_at,
    }
}

/// The `provider` label of the phase gauges: `spec.provider`, `external` for an External Proxy, `none` for a
/// Managed one without a provider (which fails).
pub(super) fn provider_label(proxy: &Proxy) -> &str {
    match proxy.spec.mode {
        ProxyMode::External => "external",
        ProxyMode::Managed => proxy.spec.provider.as_deref().unwrap_or("none"),
    }
}

pub(super) fn provider_name(proxy: &Proxy) -> Option<&str> {
    proxy.spec.provider.as_deref()
}

/// Reads the world: the status, and what the provider says about the recorded instances.
pub(super) async fn observe(
    proxy: &Proxy,
    context: &Context,
    provider: Option<&Arc<dyn Provider>>,
) -> Result<Facts, ProviderError> {
    let status = proxy.status.clone().unwrap_or_default();
    let retry_token = annotations::annotation(proxy, annotations::RETRY).map(str::to_owned);
    // The provider's policy is baked into its instances: a change of it replaces them, as a spec change does.
    // Without the provider at hand (a latched failure) the recorded instance's fingerprint stands, so nothing is
    // replaced for want of it.
    let fingerprint = match provider {
        Some(provider) => provider.instance_fingerprint(),
        None => status.instance.as_ref().and_then(|instance| instance.provider_fingerprint.clone()),
    };
    let desired_hash = proxy.desired_spec_hash_with(fingerprint.as_deref());
    let replacement_cause = match &status.instance {
        Some(instance) if instance.spec_hash != desired_hash => proxy.replacement_cause(
            &instance.spec_hash,
            instance.provider_fingerprint.as_deref(),
            fingerprint.as_deref(),
        ),
        _ => "",
    };
    let mut facts = Facts {
        mode: proxy.spec.mode,
        generation: proxy.metadata.generation,
        port: proxy.spec.port,
        spec_endpoint: proxy.spec.endpoint.clone(),
        status: status.clone(),
        desired_hash,
        fingerprint,
        replacement_cause,
        retry_token,
        max_age: jittered_max_age(proxy),
        replace_after: proxy.spec.health_check.replace_after(),
        resync: context.config.resync,
        now: SystemTime::now(),
        desired: Observed::NotRecorded,
        previous: PreviousObserved::None,
        previous_leases: 0,
        drain_timeout: context.config.drain_timeout,
        health: None,
        geo: None,
        created: proxy.metadata.creation_timestamp.as_ref().map(|time| SystemTime::from(time.0)),
    };
    let latched = status.failure.as_ref().is_some_and(|failure| {
        status.observed_generation == facts.generation && failure.retry_token == facts.retry_token
    });
    if let (Some(provider), false) = (provider, latched) {
        if let Some(current) = status.instance.as_ref().filter(|current| current.spec_hash == facts.desired_hash) {
            facts.desired = match provider.get(&current.provider_id).await {
                Ok(instance) => observed(&instance),
                Err(error) if error.is_not_found() => Observed::NotFound,
                Err(error) => return Err(error),
            };
        }
        if let Some(previous) = &status.previous_instance {
            facts.previous = match provider.get(&previous.provider_id).await {
                Ok(_) => PreviousObserved::Present,
                Err(error) if error.is_not_found() => PreviousObserved::Gone,
                Err(error) => return Err(error),
            };
            if let (Some(drain), Some(ip)) = (&context.drain, &previous.ip) {
                let endpoint = egress_api::Endpoint { host: ip.clone(), port: facts.port };
                facts.previous_leases = drain.leases_on(&proxy_id(proxy), &endpoint.address()).await;
            }
        }
        if let Observed::Found { ip: Some(ip), .. } = &facts.desired {
            let endpoint = egress_api::Endpoint { host: ip.clone(), port: facts.port };
            facts.health = verdict_of(&context.health, proxy, &endpoint);
        }
    }
    if proxy.spec.mode == ProxyMode::External
        && let Some(endpoint) = &proxy.spec.endpoint
    {
        facts.health = verdict_of(&context.health, proxy, endpoint);
    }
    if let (Some(geoip), Some(ip)) = (
        &context.geoip,
        facts.health.as_ref().and_then(|verdict| verdict.egress_ip.as_deref()).and_then(|ip| ip.parse().ok()),
    ) {
        facts.geo = Some(geoip.lookup(ip));
    }
    Ok(facts)
}

/// How soon a Proxy whose auth Secret does not exist yet is looked at again: the controller is not woken by
/// Secrets (the credential store is, and holds the Secret as soon as it exists).
pub(super) const MISSING_AUTH_SECRET_RECHECK: Duration = Duration::from_secs(5);

/// How soon a Proxy whose auth Secret exists but has not reached the credential store yet (it is being read, on
/// the same Proxy event that started this reconcile) is looked at again.
pub(super) const ARRIVING_AUTH_SECRET_RECHECK: Duration = Duration::from_millis(500);

/// Whether the Proxy names an auth Secret the credential store does not hold (missing, or not read yet).
pub(super) fn waiting_for_auth_secret(proxy: &Proxy, context: &Context) -> bool {
    proxy
        .spec
        .auth
        .as_ref()
        .is_some_and(|auth| !context.credentials.holds(&proxy.namespace().unwrap_or_default(), &auth.secret_ref.name))
}

/// Whether the auth Secret the Proxy names exists, asked of the API (its metadata only): told apart from one the
/// credential store has not read yet.
pub(super) async fn auth_secret_exists(proxy: &Proxy, context: &Context) -> Result<bool, Error> {
    let Some(auth) = &proxy.spec.auth else { return Ok(true) };
    let secrets: Api<Secret> = Api::namespaced(context.client.clone(), &proxy.namespace().unwrap_or_default());
    Ok(secrets.get_metadata_opt(&auth.secret_ref.name).await?.is_some())
}
