//! One pass over a pool: read its members, decide, act (create, delete, roll and recycle members, scale), and
//! remember what the store must show before the next pass acts.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use egress_api::pool::{POOL_LABEL, member_of};
use egress_api::proxy::CONDITION_READY;
use egress_api::{Proxy, ProxyPool, ScalingDecision, annotations};
use egress_fleet::PoolId;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};
use tracing::{debug, info};

use super::super::decide::{AutoscaleFacts, Demand, Member, PoolDecision, PoolFacts, Slot, decide_pool};
use super::super::metrics::PoolCounts;
use super::context::{AFTER_ACTING, Expectation, POOL_FIELD_MANAGER, PoolContext, TEMPLATE_LABELS_ANNOTATION};
use super::slots::{SlotSpec, slot_specs};
use super::status::{failed_members, pool_status, provisioning_seconds};
use crate::Error;
use crate::feed::GuardedPool;
use crate::ids::proxy_id;
use crate::status::{micro_time, system_micro_time, system_time};

/// The members this pool owns (labelled for it and controlled by its UID), and the ordinals other Proxies
/// labelled for it take.
pub(super) fn members(pool: &ProxyPool, namespace: &str, context: &PoolContext) -> (Vec<Arc<Proxy>>, BTreeSet<u32>) {
    let reference: ObjectRef<GuardedPool> = ObjectRef::new(&pool.name_any()).within(namespace);
    let names = context.index.lock().expect("member index").members_of(&reference);
    let uid = pool.metadata.uid.as_deref();
    let mut owned = Vec::new();
    let mut foreign = BTreeSet::new();
    for name in names {
        let Some(object) = context.proxies.get(&ObjectRef::new(&name).within(namespace)) else { continue };
        let controlled = member_of(object.meta()).is_some_and(|(_, owner)| Some(owner) == uid);
        match (&object.0, controlled) {
            (Ok(proxy), true) => owned.push(Arc::new(proxy.clone())),
            _ => {
                if let Some(ordinal) = ordinal_of(&pool.name_any(), &name) {
                    foreign.insert(ordinal);
                }
            }
        }
    }
    (owned, foreign)
}

/// The ordinal in a member name `<pool>-<ordinal>`, in its canonical spelling only (`eu-01` has none).
pub fn ordinal_of(pool: &str, name: &str) -> Option<u32> {
    let suffix = name.strip_prefix(pool)?.strip_prefix('-')?;
    let ordinal: u32 = suffix.parse().ok()?;
    (ordinal.to_string() == suffix).then_some(ordinal)
}

/// `recycle.maxAge` shortened by up to `jitterPercent`, by an amount fixed per member.
pub(super) fn jittered_max_age(pool: &ProxyPool, member: &Proxy) -> Option<Duration> {
    let max_age = pool.spec.recycle_max_age()?;
    let jitter = pool.spec.recycle.as_ref().map_or(0, |recycle| recycle.jitter_percent.clamp(0, 50));
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    member.metadata.uid.hash(&mut hasher);
    member.metadata.name.hash(&mut hasher);
    let fraction = (hasher.finish() % 10_000) as f64 / 10_000.0;
    Some(max_age.mul_f64(1.0 - f64::from(jitter) / 100.0 * fraction))
}

pub(super) fn is_ready(proxy: &Proxy) -> bool {
    proxy.status.as_ref().is_some_and(|status| {
        status.conditions.iter().any(|condition| condition.type_ == CONDITION_READY && condition.status == "True")
    })
}

/// Whether the member is getting a new instance: it records one of another spec hash than it wants (on its
/// provider's fingerprint as the instance recorded it: a change of the provider's policy shows once the member's
/// controller starts the new instance), or is still draining the one it replaced.
pub(super) fn is_replacing(proxy: &Proxy) -> bool {
    proxy.status.as_ref().is_some_and(|status| {
        status.previous_instance.is_some()
            || status.instance.as_ref().is_some_and(|instance| {
                instance.spec_hash != proxy.desired_spec_hash_with(instance.provider_fingerprint.as_deref())
            })
    })
}

pub(super) async fn apply(
    pool: &ProxyPool,
    key: &PoolId,
    namespace: &str,
    context: &PoolContext,
) -> Result<Duration, Error> {
    let now = SystemTime::now();
    let name = pool.name_any();
    let (owned, foreign) = members(pool, namespace, context);
    let slots = slot_specs(pool);
    let spread = pool.spec.slots();

    let mut leases = Vec::with_capacity(owned.len());
    for proxy in &owned {
        leases.push(context.signals.leases_of(&proxy_id(proxy.as_ref())).await);
    }
    let member_facts: Vec<Member> = owned
        .iter()
        .zip(leases)
        .map(|(proxy, leases)| {
            let slot = slots.iter().position(|slot| slot.holds(&proxy.spec));
            let current = slot.is_some_and(|slot| {
                egress_api::spec_hash(&proxy.spec, None) == egress_api::spec_hash(&slots[slot].spec, None)
            });
            let status = proxy.status.as_ref();
            let born = status
                .and_then(|status| status.instance.as_ref())
                .and_then(|instance| instance.created_at.as_ref())
                .or(proxy.metadata.creation_timestamp.as_ref())
                .map_or(now, system_time);
            Member {
                name: proxy.name_any(),
                ordinal: ordinal_of(&name, &proxy.name_any()),
                slot,
                current,
                ready: is_ready(proxy),
                replacing: is_replacing(proxy),
                leases,
                born,
                max_age: jittered_max_age(pool, proxy),
                deleting: proxy.metadata.deletion_timestamp.is_some(),
            }
        })
        .collect();
    // Ordinals taken by Proxies this pool does not own count as members that are being deleted: their names are
    // not free.
    let mut facts_members = member_facts.clone();
    let known_foreign = context.with_memory(key, |memory| {
        memory.foreign.extend(foreign.iter().copied());
        memory.foreign.clone()
    });
    for ordinal in known_foreign {
        if facts_members.iter().all(|member| member.ordinal != Some(ordinal)) {
            facts_members.push(Member {
                name: format!("{name}-{ordinal}"),
                ordinal: Some(ordinal),
                slot: None,
                current: false,
                ready: false,
                replacing: false,
                leases: 0,
                born: now,
                max_age: None,
                deleting: true,
            });
        }
    }

    let total_leases: u32 = member_facts.iter().filter(|member| !member.deleting).map(|member| member.leases).sum();
    let idle_since = context.with_memory(key, |memory| {
        if total_leases > 0 {
            memory.idle_since = None;
        } else if memory.idle_since.is_none() {
            memory.idle_since = Some(now);
        }
        memory.idle_since
    });
    let demand = context.signals.demand(key);
    let status = pool.status.clone().unwrap_or_default();
    let replicas = pool.spec.replicas.max(0).unsigned_abs();

    // The last scaling decision: recorded at creation, and noticed when somebody else moved spec.replicas.
    let mut last_scale = context.pending_scale(key, pool).or_else(|| status.last_scale.clone());
    match &last_scale {
        None => {
            last_scale = Some(ScalingDecision {
                time: micro_time(now),
                from: 0,
                to: pool.spec.replicas,
                reason: "Created".into(),
                message: format!("the pool was created with {} replicas", pool.spec.replicas),
            });
            context.metrics.decision("Created");
        }
        Some(last) if last.to != pool.spec.replicas => {
            let decision = ScalingDecision {
                time: micro_time(now),
                from: last.to,
                to: pool.spec.replicas,
                reason: "Manual".into(),
                message: format!("spec.replicas was set from {} to {}", last.to, pool.spec.replicas),
            };
            context.metrics.decision("Manual");
            context
                .publish(
                    pool,
                    false,
                    "Scaled",
                    format!("scaled from {} to {}: {}", decision.from, decision.to, decision.message),
                )
                .await;
            last_scale = Some(decision);
        }
        Some(_) => {}
    }

    let recycle = pool.spec.recycle.clone().unwrap_or_default();
    let facts = PoolFacts {
        replicas,
        slots: spread.iter().map(|entry| Slot { weight: entry.weight.max(1).unsigned_abs() }).collect(),
        members: facts_members,
        max_surge: recycle.max_surge.max(1).unsigned_abs(),
        min_available: recycle.min_available.unwrap_or(0).max(0).unsigned_abs(),
        autoscale: pool.spec.autoscale.as_ref().map(|autoscale| AutoscaleFacts {
            min: autoscale.min.max(0).unsigned_abs(),
            max: autoscale.max.max(0).unsigned_abs(),
            target_leased_percent: autoscale.target_leased_percent.clamp(1, 100).unsigned_abs(),
            idle: Duration::from_secs(autoscale.idle_seconds.max(1).unsigned_abs().into()),
            scale_up_step: autoscale.scale_up_step.max(1).unsigned_abs(),
            scale_down_step: autoscale.scale_down_step.max(1).unsigned_abs(),
            stabilization: Duration::from_secs(autoscale.stabilization_seconds.max(0).unsigned_abs().into()),
        }),
        demand: Demand {
            at_capacity: demand.at_capacity,
            none_healthy: demand.none_healthy,
            woken: demand.woken,
            idle_since,
        },
        last_scale: last_scale.as_ref().map(|last| system_micro_time(&last.time)),
        now,
    };
    let decision = decide_pool(&facts);
    debug!(?decision, "pool decision");

    let pools: Api<ProxyPool> = Api::namespaced(context.client.clone(), namespace);
    if let Some(scale) = &decision.scale {
        let to = i32::try_from(scale.to).unwrap_or(i32::MAX);
        pools.patch_scale(&name, &PatchParams::default(), &Patch::Merge(json!({ "spec": { "replicas": to } }))).await?;
        let decided = ScalingDecision {
            time: micro_time(now),
            from: i32::try_from(scale.from).unwrap_or(i32::MAX),
            to,
            reason: scale.reason.as_str().into(),
            message: scale.message.clone(),
        };
        context.with_memory(key, |memory| memory.scale_patched = Some((decided.clone(), Instant::now())));
        let direction = if scale.to > scale.from { "ScaledUp" } else { "ScaledDown" };
        info!(from = scale.from, to = scale.to, reason = scale.reason.as_str(), "scaling the pool");
        context.metrics.decision(scale.reason.as_str());
        context
            .publish(
                pool,
                false,
                direction,
                format!("scaled from {} to {} ({}): {}", scale.from, scale.to, scale.reason.as_str(), scale.message),
            )
            .await;
        last_scale = Some(decided);
    }

    let acted = act(pool, namespace, &owned, &slots, &decision, context).await?;
    context.expect(key, acted.expected);
    if !acted.taken.is_empty() {
        context.with_memory(key, |memory| memory.foreign.extend(acted.taken.iter().copied()));
    }

    // Status.
    let live: Vec<&Member> = member_facts.iter().filter(|member| !member.deleting).collect();
    let counts = PoolCounts {
        desired: decision.target,
        current: live.len() as u32,
        ready: live.iter().filter(|member| member.ready).count() as u32,
        leased: live.iter().filter(|member| member.leases > 0).count() as u32,
        updated: live.iter().filter(|member| member.current && !member.replacing).count() as u32,
    };
    context.metrics.counts(key, counts);
    let provisioning = provisioning_seconds(&owned, &slots);
    let failed = failed_members(&owned);
    let new_status =
        pool_status(pool, &status, &decision, &member_facts, counts, &facts, last_scale, &provisioning, &failed, now);
    if new_status != status {
        let written = new_status.last_scale.clone().filter(|last| Some(last) != status.last_scale.as_ref());
        let body = json!({ "apiVersion": "crawl.example.com/v1alpha1", "kind": "ProxyPool", "status": new_status });
        pools.patch_status(&name, &PatchParams::apply(POOL_FIELD_MANAGER).force(), &Patch::Apply(&body)).await?;
        if let Some(written) = written {
            context.with_memory(key, |memory| memory.scale_written = Some((written, Instant::now())));
        }
    }
    let next = if acted.any { decision.requeue.min(AFTER_ACTING) } else { decision.requeue };
    Ok(next)
}

/// What one pass did.
#[derive(Default)]
pub(super) struct Acted {
    pub(super) any: bool,
    pub(super) expected: Vec<Expectation>,
    /// Ordinals whose names turned out to be taken by Proxies this pool does not own.
    pub(super) taken: Vec<u32>,
}

/// The owner reference every member carries.
pub(super) fn owner_reference(pool: &ProxyPool) -> OwnerReference {
    OwnerReference {
        api_version: ProxyPool::api_version(&()).into_owned(),
        kind: "ProxyPool".into(),
        name: pool.name_any(),
        uid: pool.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// The labels and annotations a member should carry, given what it carries now: the template's (the keys it set
/// before and no longer sets removed), the pool label, and everything else kept.
pub(super) fn member_metadata(
    pool: &ProxyPool,
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let template = pool.spec.template.metadata.clone().unwrap_or_default();
    let mut labels = labels.clone();
    if let Some(previous) = annotations.get(TEMPLATE_LABELS_ANNOTATION) {
        for key in previous.split(',').filter(|key| !key.is_empty()) {
            if !template.labels.contains_key(key) {
                labels.remove(key);
            }
        }
    }
    labels.extend(template.labels.clone());
    labels.insert(POOL_LABEL.into(), pool.name_any());
    let mut annotations = annotations.clone();
    annotations.extend(template.annotations);
    annotations
        .insert(TEMPLATE_LABELS_ANNOTATION.into(), template.labels.keys().cloned().collect::<Vec<_>>().join(","));
    (labels, annotations)
}

/// A JSON patch that applies only to the version read (`test` of the resourceVersion first).
pub(super) fn guarded_patch(resource_version: &str, operations: Vec<Value>) -> Result<json_patch::Patch, Error> {
    let mut all = vec![json!({ "op": "test", "path": "/metadata/resourceVersion", "value": resource_version })];
    all.extend(operations);
    serde_json::from_value(Value::Array(all))
        .map_err(|error| Error::InvalidObject(format!("building a member patch failed: {error}")))
}

pub(super) async fn act(
    pool: &ProxyPool,
    namespace: &str,
    owned: &[Arc<Proxy>],
    slots: &[SlotSpec],
    decision: &PoolDecision,
    context: &PoolContext,
) -> Result<Acted, Error> {
    let api: Api<Proxy> = Api::namespaced(context.client.clone(), namespace);
    let pool_name = pool.name_any();
    let mut acted = Acted::default();
    let by_name: HashMap<String, &Arc<Proxy>> = owned.iter().map(|proxy| (proxy.name_any(), proxy)).collect();

    // New members.
    let mut created = Vec::new();
    for new in &decision.create {
        let Some(SlotSpec { spec, .. }) = slots.get(new.slot) else { continue };
        let member_name = format!("{pool_name}-{}", new.ordinal);
        let (labels, annotations) = member_metadata(pool, &BTreeMap::new(), &BTreeMap::new());
        let proxy = Proxy {
            metadata: ObjectMeta {
                name: Some(member_name.clone()),
                namespace: Some(namespace.to_owned()),
                labels: Some(labels),
                annotations: Some(annotations),
                owner_references: Some(vec![owner_reference(pool)]),
                ..ObjectMeta::default()
            },
            spec: spec.clone(),
            status: None,
        };
        let params = PostParams { field_manager: Some(POOL_FIELD_MANAGER.into()), ..PostParams::default() };
        match api.create(&params, &proxy).await {
            Ok(_) => {
                created.push(member_name.clone());
                acted.expected.push(Expectation::Present(member_name));
            }
            Err(kube::Error::Api(status)) if status.code == 409 => {
                // Made by an earlier pass whose write the store does not show yet, or a Proxy somebody else owns.
                let existing = api.get_opt(&member_name).await?;
                let ours = existing
                    .as_ref()
                    .and_then(|proxy| member_of(&proxy.metadata))
                    .is_some_and(|(_, owner)| Some(owner) == pool.metadata.uid.as_deref());
                if ours {
                    acted.expected.push(Expectation::Present(member_name));
                } else {
                    acted.taken.push(new.ordinal);
                    context
                        .publish(
                            pool,
                            true,
                            "MemberNameTaken",
                            format!(
                                "a Proxy named {member_name} exists and is not this pool's; the pool skips that name"
                            ),
                        )
                        .await;
                }
            }
            Err(error) => return Err(error.into()),
        }
        acted.any = true;
    }
    if !created.is_empty() {
        context.publish(pool, false, "MembersCreated", format!("created {}", created.join(", "))).await;
    }

    // Members to remove.
    let mut deleted = Vec::new();
    for member_name in &decision.delete {
        let Some(proxy) = by_name.get(member_name) else { continue };
        let uid = proxy.metadata.uid.clone().unwrap_or_default();
        let params = DeleteParams {
            preconditions: Some(Preconditions { uid: Some(uid.clone()), resource_version: None }),
            ..DeleteParams::default()
        };
        match api.delete(member_name, &params).await {
            Ok(_) => deleted.push(member_name.clone()),
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {}
            Err(error) => return Err(error.into()),
        }
        acted.expected.push(Expectation::Gone { name: member_name.clone(), uid });
        acted.any = true;
    }
    if !deleted.is_empty() {
        context.publish(pool, false, "MembersDeleted", format!("deleted {}", deleted.join(", "))).await;
    }

    // Members brought to the template: rolled ones (a new instance follows) and those whose change needs none.
    let rolled: BTreeSet<&String> = decision.roll.iter().collect();
    let mut started = Vec::new();
    for proxy in owned {
        let member_name = proxy.name_any();
        if proxy.metadata.deletion_timestamp.is_some() || decision.delete.contains(&member_name) {
            continue;
        }
        let Some(SlotSpec { spec: desired, .. }) = slots.iter().find(|slot| slot.holds(&proxy.spec)) else {
            continue;
        };
        let instance_change = egress_api::spec_hash(&proxy.spec, None) != egress_api::spec_hash(desired, None);
        let mut operations = Vec::new();
        if proxy.spec != *desired && (!instance_change || rolled.contains(&member_name)) {
            operations.push(json!({ "op": "replace", "path": "/spec", "value": desired }));
            if instance_change {
                started.push(member_name.clone());
            }
        }
        let labels = proxy.metadata.labels.clone().unwrap_or_default();
        let annotations = proxy.metadata.annotations.clone().unwrap_or_default();
        let (want_labels, want_annotations) = member_metadata(pool, &labels, &annotations);
        if want_labels != labels {
            operations.push(json!({ "op": "add", "path": "/metadata/labels", "value": want_labels }));
        }
        if want_annotations != annotations {
            operations.push(json!({ "op": "add", "path": "/metadata/annotations", "value": want_annotations }));
        }
        if operations.is_empty() {
            continue;
        }
        let resource_version = proxy.resource_version().unwrap_or_default();
        let patch = guarded_patch(&resource_version, operations)?;
        patch_member(&api, &member_name, &Patch::Json::<()>(patch), &resource_version, &mut acted).await?;
    }
    if !started.is_empty() {
        context
            .publish(pool, false, "RollingMembers", format!("giving {} the current template", started.join(", ")))
            .await;
    }

    // Members recycled for their age: a new rotate token starts the Proxy's make-before-break replacement.
    let mut recycled = Vec::new();
    for member_name in &decision.recycle {
        let Some(proxy) = by_name.get(member_name) else { continue };
        let instance = proxy.status.as_ref().and_then(|status| status.instance.as_ref());
        let token = format!("recycle-{}", instance.map_or("none", |instance| instance.name.as_str()));
        let resource_version = proxy.resource_version().unwrap_or_default();
        let mut annotations = proxy.metadata.annotations.clone().unwrap_or_default();
        annotations.insert(annotations::ROTATE.into(), token);
        let patch = guarded_patch(
            &resource_version,
            vec![json!({ "op": "add", "path": "/metadata/annotations", "value": annotations })],
        )?;
        patch_member(&api, member_name, &Patch::Json::<()>(patch), &resource_version, &mut acted).await?;
        recycled.push(member_name.clone());
    }
    if !recycled.is_empty() {
        context
            .publish(
                pool,
                false,
                "RecyclingMembers",
                format!("giving {} a new instance for its age", recycled.join(", ")),
            )
            .await;
    }
    Ok(acted)
}

/// Patches one member; a member that changed since it was read (the `test` failed) is looked at again next pass.
pub(super) async fn patch_member(
    api: &Api<Proxy>,
    name: &str,
    patch: &Patch<()>,
    resource_version: &str,
    acted: &mut Acted,
) -> Result<(), Error> {
    let params = PatchParams { field_manager: Some(POOL_FIELD_MANAGER.into()), ..PatchParams::default() };
    match api.patch(name, &params, patch).await {
        Ok(_) => {
            acted
                .expected
                .push(Expectation::Changed { name: name.to_owned(), resource_version: resource_version.into() });
        }
        Err(kube::Error::Api(status)) if status.code == 422 || status.code == 409 || status.code == 404 => {
            debug!(member = name, code = status.code, "the member changed since it was read; next pass");
        }
        Err(error) => return Err(error.into()),
    }
    acted.any = true;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use egress_api::{ProxyPoolSpec, ProxyTemplate, TemplateMetadata};

    #[test]
    fn ordinals_are_read_in_their_canonical_spelling_only() {
        let cases = [
            ("eu-0", Some(0)),
            ("eu-12", Some(12)),
            ("eu-01", None),
            ("eu-", None),
            ("eu-x", None),
            ("eu-west-3", None),
            ("other-3", None),
            ("eu3", None),
        ];
        for (name, expected) in cases {
            assert_eq!(ordinal_of("eu", name), expected, "{name}");
        }
    }

    #[test]
    fn template_labels_replace_the_ones_they_set_before_and_keep_the_rest() {
        let mut spec = ProxyPoolSpec::new(1, ProxyTemplate::default());
        spec.template.metadata = Some(TemplateMetadata {
            labels: [("tier".to_owned(), "gold".to_owned())].into(),
            annotations: [("note".to_owned(), "x".to_owned())].into(),
        });
        let pool = ProxyPool::new("eu", spec);
        let labels: BTreeMap<String, String> =
            [("region".to_owned(), "eu".to_owned()), ("mine".to_owned(), "kept".to_owned())].into();
        let annotations: BTreeMap<String, String> =
            [(TEMPLATE_LABELS_ANNOTATION.to_owned(), "region".to_owned())].into();
        let (labels, annotations) = member_metadata(&pool, &labels, &annotations);
        let expected: BTreeMap<String, String> = [
            ("mine".to_owned(), "kept".to_owned()),
            ("tier".to_owned(), "gold".to_owned()),
            (POOL_LABEL.to_owned(), "eu".to_owned()),
        ]
        .into();
        assert_eq!(labels, expected, "region came from the old template and goes; mine was never the template's");
        assert_eq!(annotations.get(TEMPLATE_LABELS_ANNOTATION).map(String::as_str), Some("tier"));
        assert_eq!(annotations.get("note").map(String::as_str), Some("x"));
    }

    #[test]
    fn a_member_patch_tests_the_version_it_read() {
        let patch = guarded_patch("42", vec![json!({ "op": "replace", "path": "/spec", "value": {} })]).expect("valid");
        let text = serde_json::to_value(&patch).expect("serializes");
        assert_eq!(text[0], json!({ "op": "test", "path": "/metadata/resourceVersion", "value": "42" }));
        assert_eq!(text[1]["op"], "replace");
    }
}
