//! Acting on a decision: `apply` (observe, decide, create or delete, status, Events) for a live Proxy, `cleanup`
//! under the finalizer for one being deleted, and the provider request a create sends.

use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime};

use egress_api::annotations;
use egress_api::{InstanceStatus, Proxy, ProxyMode, ProxyPhase, ProxyStatus};
use egress_provider::destinations::DestinationRule;
use egress_provider::{CreateRequest, ErrorClass, Instance, Provider, ProviderError, Sensitive, Tags};
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::Api;
use tracing::{debug, info, warn};

use super::observe::{
    ARRIVING_AUTH_SECRET_RECHECK, MISSING_AUTH_SECRET_RECHECK, auth_secret_exists, observe, provider_label,
    provider_name, waiting_for_auth_secret,
};
use super::status::{provisioned_message, write_geo_labels, write_status};
use super::{Context, QuotaRefusal};
use crate::Error;
use crate::decide::{self, CleanupDecision, Decision, EventSpec, Facts, Requeue};
use crate::ids::proxy_id;
use crate::status::time;

pub(super) async fn apply(proxy: &Proxy, context: &Context) -> Result<Requeue, Error> {
    let uid = proxy.uid().unwrap_or_default();
    let provider = match (proxy.spec.mode, provider_name(proxy)) {
        (ProxyMode::Managed, Some(name)) => match context.providers.provider(name).await {
            Ok(provider) => Some(provider),
            Err(error) if error.class() == ErrorClass::Permanent => {
                let facts = observe(proxy, context, None).await?;
                return latch(proxy, context, &facts, &error).await;
            }
            Err(error) => return Err(error.into()),
        },
        (ProxyMode::Managed, None) => {
            let facts = observe(proxy, context, None).await?;
            let error = ProviderError::permanent("spec.provider is not set");
            return latch(proxy, context, &facts, &error).await;
        }
        (ProxyMode::External, _) => None,
    };
    let facts = match observe(proxy, context, provider.as_ref()).await {
        Ok(facts) => facts,
        Err(error) if error.class() == ErrorClass::Permanent => {
            let facts = observe(proxy, context, None).await?;
            return latch(proxy, context, &facts, &error).await;
        }
        Err(error) => return Err(error.into()),
    };
    let Decision { action, mut status, events, requeue } = decide::decide(&facts);
    let mut requeue = requeue;
    match (&action, &provider) {
        (decide::Action::Nothing, _) | (_, None) => {}
        (decide::Action::Create, Some(provider)) => {
            // Any change (our own status write among them) triggers a reconcile; the quota backoff still holds.
            let refusal = context.quota_refusals.lock().expect("quota refusals").get(&uid).copied();
            if let Some(wait) = refusal.and_then(|refusal| refusal.retry_at.checked_duration_since(Instant::now())) {
                debug!(wait_secs = wait.as_secs(), "create deferred by the quota backoff");
                return Ok(Requeue::After(wait));
            }
            let request = match create_request(proxy, context, &facts, provider.as_ref()).await {
                Ok(request) => request,
                // A spec the provider can never serve (a malformed deny rule, a denied probe URL): latched.
                Err(Error::Provider(error)) if error.class() == ErrorClass::Permanent => {
                    return latch(proxy, context, &facts, &error).await;
                }
                Err(error) => {
                    if waiting_for_auth_secret(proxy, context) && auth_secret_exists(proxy, context).await? {
                        // Being read by the credential store right now: nothing to tell the user.
                        return Ok(Requeue::After(ARRIVING_AUTH_SECRET_RECHECK));
                    }
                    // Say why on the object (a Secret missing, or a key missing); the error backoff retries.
                    let message = error.to_string();
                    let status = decide::on_transient_failure(&facts, &message);
                    write_status(proxy, context, &facts.status, &status).await?;
                    if waiting_for_auth_secret(proxy, context) {
                        // Said once per wait as an Event too. Its creation does not wake the controller, so look
                        // again soon instead of backing off further each time.
                        if provisioned_message(&facts.status) != Some(message.as_str()) {
                            let event = EventSpec { warning: true, reason: "AuthSecretMissing", note: message };
                            context.publish(proxy, &event).await;
                        }
                        return Ok(Requeue::After(MISSING_AUTH_SECRET_RECHECK));
                    }
                    return Err(error);
                }
            };
            match provider.create(&request).await {
                Ok(instance) => {
                    status.instance =
                        Some(instance_status(&instance, &facts.desired_hash, facts.fingerprint.as_deref()));
                    context.quota_refusals.lock().expect("quota refusals").remove(&uid);
                    requeue = Requeue::After(Duration::from_secs(1));
                }
                Err(error) if error.class() == ErrorClass::QuotaExceeded => {
                    let consecutive = refusal.map_or(1, |refusal| refusal.consecutive.saturating_add(1));
                    let (status, event, backoff) = decide::on_quota_exceeded(&facts, &error.chain(), consecutive);
                    context
                        .quota_refusals
                        .lock()
                        .expect("quota refusals")
                        .insert(uid.clone(), QuotaRefusal { consecutive, retry_at: Instant::now() + backoff });
                    write_status(proxy, context, &facts.status, &status).await?;
                    context.publish(proxy, &event).await;
                    info!(backoff_secs = backoff.as_secs(), "provider quota exceeded; backing off");
                    return Ok(Requeue::After(backoff));
                }
                Err(error) if error.class() == ErrorClass::Permanent => {
                    return latch(proxy, context, &facts, &error).await;
                }
                Err(error) => {
                    // Say why on the object; the error backoff decides when to try again.
                    let status = decide::on_transient_failure(&facts, &error.chain());
                    write_status(proxy, context, &facts.status, &status).await?;
                    return Err(error.into());
                }
            }
        }
        (decide::Action::Delete { provider_id }, Some(provider)) => match provider.delete(provider_id).await {
            Ok(()) => {}
            Err(error) if error.class() == ErrorClass::Permanent => return latch(proxy, context, &facts, &error).await,
            Err(error) => return Err(error.into()),
        },
    }
    write_status(proxy, context, &facts.status, &status).await?;
    write_geo_labels(proxy, context, &status).await?;
    for event in &events {
        context.publish(proxy, event).await;
    }
    context.metrics.phase(&proxy_id(proxy), status.phase.map(|phase| (phase, provider_label(proxy))));
    Ok(match requeue {
        Requeue::AwaitChange => Requeue::AwaitChange,
        Requeue::After(after) => Requeue::After(after.max(Duration::from_millis(100))),
    })
}

/// Latches a permanent failure: status `Failed` with the reason, an Event, and no retry until something changes.
pub(super) async fn latch(
    proxy: &Proxy,
    context: &Context,
    facts: &Facts,
    error: &ProviderError,
) -> Result<Requeue, Error> {
    warn!(error = %error.chain(), "permanent failure; waiting for a spec or retry-annotation change");
    let (status, event) = decide::on_permanent_failure(facts, &error.chain());
    write_status(proxy, context, &facts.status, &status).await?;
    context.publish(proxy, &event).await;
    context.metrics.phase(&proxy_id(proxy), status.phase.map(|phase| (phase, provider_label(proxy))));
    Ok(Requeue::AwaitChange)
}

/// The status record of a freshly created instance. It is recorded as Provisioning whatever `create` returned: the
/// next reconcile's `get` observes the real state, and that transition is what publishes the address and the
/// `Provisioned` Event, in one place.
pub(super) fn instance_status(instance: &Instance, spec_hash: &str, fingerprint: Option<&str>) -> InstanceStatus {
    InstanceStatus {
        name: instance.name.clone(),
        provider_id: instance.provider_id.clone(),
        state: egress_api::InstanceState::Provisioning,
        ip: None,
        spec_hash: spec_hash.to_owned(),
        provider_fingerprint: fingerprint.map(str::to_owned),
        created_at: instance.created_at.map(time),
        draining_since: None,
    }
}

/// The Proxy's own deny rules (`spec.destinations.deny`), or a permanent error naming every malformed one with its
/// index.
pub(super) fn deny_rules(proxy: &Proxy) -> Result<Vec<DestinationRule>, ProviderError> {
    let deny = proxy.spec.destinations.as_ref().map(|destinations| destinations.deny.as_slice()).unwrap_or_default();
    let mut rules = Vec::with_capacity(deny.len());
    let mut problems = Vec::new();
    for (index, text) in deny.iter().enumerate() {
        match text.parse::<DestinationRule>() {
            Ok(rule) => rules.push(rule),
            Err(error) => problems.push(format!("spec.destinations.deny[{index}]: {error}")),
        }
    }
    if problems.is_empty() { Ok(rules) } else { Err(ProviderError::permanent(problems.join("; "))) }
}

/// A permanent error when the Proxy's own probe URL is one its proxy would refuse: it could never turn Ready.
pub(super) fn check_probe_url(
    proxy: &Proxy,
    provider: &dyn Provider,
    deny: &[DestinationRule],
) -> Result<(), ProviderError> {
    let Some(url) = proxy.spec.health_check.probe_url.as_deref() else { return Ok(()) };
    let Ok(probe) = egress_health::ProbeUrl::parse(url) else { return Ok(()) };
    match provider.destination_denial(probe.host(), probe.port(), probe.is_https(), deny) {
        None => Ok(()),
        Some(denial) => Err(ProviderError::permanent(format!(
            "spec.healthCheck.probeURL {url} is refused by the destination policy of provider {:?}: {denial}; probe \
             a public URL, or have it allowed in the provider's destinations (the operator's providers file)",
            proxy.spec.provider.as_deref().unwrap_or_default()
        ))),
    }
}

/// Builds the provider request, reading the cloud-init and credentials Secrets. A missing Secret or key is
/// transient: the Secret may be created after the Proxy.
pub(super) async fn create_request(
    proxy: &Proxy,
    context: &Context,
    facts: &Facts,
    provider: &dyn Provider,
) -> Result<CreateRequest, Error> {
    let deny_destinations = deny_rules(proxy)?;
    check_probe_url(proxy, provider, &deny_destinations)?;
    let uid = proxy.uid().unwrap_or_default();
    let namespace = proxy.namespace().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(context.client.clone(), &namespace);
    let read_key = |name: String, key: String| {
        let secrets = secrets.clone();
        let namespace = namespace.clone();
        async move {
            let secret = secrets.get_opt(&name).await?;
            let value =
                secret.and_then(|secret| secret.data).and_then(|mut data| data.remove(&key)).map(|bytes| bytes.0);
            value.ok_or_else(|| {
                Error::Provider(ProviderError::transient(format!("Secret {namespace}/{name} has no key {key:?} (yet)")))
            })
        }
    };
    let placement = proxy.spec.placement.clone().unwrap_or_default();
    let cloud_init = match &proxy.spec.cloud_init {
        Some(cloud_init) => match (&cloud_init.inline, &cloud_init.secret_ref) {
            (Some(inline), _) => Some(Sensitive::new(inline.clone().into_bytes())),
            (None, Some(reference)) => {
                Some(Sensitive::new(read_key(reference.name.clone(), reference.key.clone()).await?))
            }
            (None, None) => None,
        },
        None => None,
    };
    // From the credential store that probes and discovery read too, so all three use the same password.
    let credentials = match &proxy.spec.auth {
        Some(auth) => {
            let name = &auth.secret_ref.name;
            let found = context.credentials.credentials(&namespace, name).ok_or_else(|| {
                Error::Provider(ProviderError::transient(format!(
                    "auth Secret {namespace}/{name} is missing, lacks the keys username and password, or has not \
                     reached the operator's credential store yet"
                )))
            })?;
            Some(found)
        }
        None => None,
    };
    Ok(CreateRequest {
        name: egress_provider::instance_name(&uid, &facts.desired_hash),
        zone: placement.zone,
        machine_type: placement.machine_type,
        image: placement.image,
        cloud_init,
        port: u16::try_from(proxy.spec.port).unwrap_or(3128),
        credentials,
        tags: Tags::gc_contract(&context.config.cluster_id, &uid, &facts.desired_hash),
        deny_destinations,
    })
}

pub(super) async fn cleanup(proxy: &Proxy, context: &Context) -> Result<Requeue, Error> {
    let uid = proxy.uid().unwrap_or_default();
    let skip = annotations::skip_cleanup(proxy);
    let name = provider_name(proxy).unwrap_or_default().to_owned();
    let configured = proxy.spec.mode == ProxyMode::External || context.providers.is_configured(&name);
    let mut remaining = BTreeSet::new();
    if proxy.spec.mode == ProxyMode::Managed && configured && !skip {
        let provider = context.providers.provider(&name).await?;
        let status = proxy.status.clone().unwrap_or_default();
        // Recorded instances, and any instance tagged with this Proxy's UID (a create whose result never reached
        // the status before a crash). A recorded instance whose Get fails other than NotFound is still deleted.
        for recorded in [&status.instance, &status.previous_instance].into_iter().flatten() {
            match provider.get(&recorded.provider_id).await {
                Err(error) if error.is_not_found() => {}
                _ => {
                    remaining.insert(recorded.provider_id.clone());
                }
            }
        }
        let tags = Tags::owned_by_cluster(&context.config.cluster_id).with(Tags::PROXY_UID, &uid);
        for instance in provider.list_by_tag(&tags).await? {
            remaining.insert(instance.provider_id);
        }
    }
    let remaining: Vec<String> = remaining.into_iter().collect();
    let recorded =
        proxy.status.as_ref().is_some_and(|status| status.instance.is_some() || status.previous_instance.is_some());
    match decide::decide_cleanup(proxy.spec.mode, skip, configured, recorded, &remaining) {
        CleanupDecision::Release { event } => {
            if let Some(event) = event {
                context.publish(proxy, &event).await;
            }
            context.metrics.phase(&proxy_id(proxy), None);
            info!("cleanup finished; releasing the finalizer");
            Ok(Requeue::AwaitChange)
        }
        CleanupDecision::ProviderMissing => {
            let error = Error::ProviderMissing(name);
            context
                .publish(proxy, &EventSpec { warning: true, reason: "ProviderMissing", note: error.to_string() })
                .await;
            Err(error)
        }
        CleanupDecision::Delete { provider_ids } => {
            let provider = context.providers.provider(provider_name(proxy).unwrap_or_default()).await?;
            for provider_id in &provider_ids {
                provider.delete(provider_id).await?;
            }
            let before = proxy.status.clone().unwrap_or_default();
            if before.phase != Some(ProxyPhase::Deleting) {
                let after = ProxyStatus { phase: Some(ProxyPhase::Deleting), ..before.clone() };
                write_status(proxy, context, &before, &after).await?;
                context.metrics.phase(&proxy_id(proxy), Some((ProxyPhase::Deleting, provider_label(proxy))));
            }
            debug!(instances = provider_ids.len(), "deleting instances; waiting until they are gone");
            Ok(Requeue::After(decide::DELETING_REQUEUE))
        }
    }
}

/// The instance names a Proxy owns: its current, previous and desired instances (the orphan collector keeps these),
/// the desired one on a provider whose instance fingerprint is `fingerprint`.
pub(crate) fn recorded_names(proxy: &Proxy, fingerprint: Option<&str>) -> Vec<String> {
    let status = proxy.status.clone().unwrap_or_default();
    let uid = proxy.uid().unwrap_or_default();
    let mut names: Vec<String> = [&status.instance, &status.previous_instance]
        .into_iter()
        .flatten()
        .map(|instance| instance.name.clone())
        .collect();
    names.push(egress_provider::instance_name(&uid, &proxy.desired_spec_hash_with(fingerprint)));
    names
}

/// The age of an instance from its recorded creation time.
pub(crate) fn age(created_at: Option<SystemTime>, first_seen: SystemTime, now: SystemTime) -> Duration {
    now.duration_since(created_at.unwrap_or(first_seen)).unwrap_or_default()
}
