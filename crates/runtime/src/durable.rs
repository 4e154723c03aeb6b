//! What the discovery API keeps in the apiserver so that a restart or a new leader loses nothing a client relies
//! on: cooldowns in each Proxy's `status.cooldowns` (written under a field manager of their own), and the key lease
//! IDs are signed with, in a Secret every replica reads.

use std::time::SystemTime;

use anyhow::{Context, Result, bail};
use async_trait::async_trait;
use egress_api::{CooldownStatus, Proxy};
use egress_discovery::{CooldownJournal, MAX_PERSISTED_COOLDOWNS};
use egress_lease::{Cooldown, LeaseKey, MIN_KEY_BYTES};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use tracing::{debug, info};

/// The field manager of `status.cooldowns`: the reconciler's apply never sends the field, so neither removes the
/// other's.
pub const COOLDOWN_FIELD_MANAGER: &str = "egress-operator-cooldowns";

/// The key in the lease-key Secret's data.
const KEY_ENTRY: &str = "key";

/// Keeps cooldowns in the Proxies' status.
pub struct StatusCooldownJournal {
    client: Client,
}

impl StatusCooldownJournal {
    /// A journal writing through `client`.
    pub fn new(client: Client) -> Self {
        Self { client }
    }
}

/// `cooldowns` as `status.cooldowns` entries.
pub fn cooldown_status(cooldowns: &[Cooldown]) -> Vec<CooldownStatus> {
    cooldowns
        .iter()
        .take(MAX_PERSISTED_COOLDOWNS)
        .filter_map(|cooldown| {
            let until = Timestamp::try_from(cooldown.until).ok()?;
            Some(CooldownStatus {
                site: cooldown.target.clone(),
                until: Time(until),
                streak: cooldown.streak,
                tenants: cooldown.reporters.iter().take(16).cloned().collect(),
            })
        })
        .collect()
}

/// The cooldowns a Proxy's status keeps, for the lease store.
pub fn cooldowns_of(proxy: &Proxy) -> Vec<Cooldown> {
    let id = format!("{}/{}", proxy.namespace().unwrap_or_default(), proxy.name_any());
    proxy
        .status
        .iter()
        .flat_map(|status| &status.cooldowns)
        .map(|kept| Cooldown {
            proxy: id.clone(),
            target: kept.site.clone(),
            until: SystemTime::from(kept.until.0),
            streak: kept.streak,
            reporters: kept.tenants.clone(),
        })
        .collect()
}

#[async_trait]
impl CooldownJournal for StatusCooldownJournal {
    async fn write(&self, id: &str, cooldowns: &[Cooldown]) -> Result<(), String> {
        let Some((namespace, name)) = id.split_once('/') else { return Err(format!("{id:?} is not namespace/name")) };
        let api: Api<Proxy> = Api::namespaced(self.client.clone(), namespace);
        let patch = serde_json::json!({
            "apiVersion": "crawl.example.com/v1alpha1",
            "kind": "Proxy",
            "status": { "cooldowns": cooldown_status(cooldowns) },
        });
        let params = PatchParams::apply(COOLDOWN_FIELD_MANAGER).force();
        match api.patch_status(name, &params, &Patch::Apply(&patch)).await {
            Ok(_) => {
                debug!(proxy = id, cooldowns = cooldowns.len(), "cooldowns written");
                Ok(())
            }
            // A Proxy deleted meanwhile has no cooldowns to keep.
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(error) => Err(error.to_string()),
        }
    }
}

/// The lease-ID key from Secret `namespace/name`, created with a random key when absent (the first replica to
/// start creates it; one that loses the race reads the winner's).
pub async fn lease_key(client: &Client, namespace: &str, name: &str) -> Result<LeaseKey> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let context = || format!("reading the lease-key Secret {namespace}/{name} (--lease-key-secret)");
    if let Some(secret) = secrets.get_opt(name).await.with_context(context)? {
        return key_of(&secret, namespace, name);
    }
    let bytes = LeaseKey::generate_bytes();
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some([("app.kubernetes.io/managed-by".to_owned(), "egress-operator".to_owned())].into()),
            ..ObjectMeta::default()
        },
        data: Some([(KEY_ENTRY.to_owned(), ByteString(bytes.to_vec()))].into()),
        ..Secret::default()
    };
    match secrets.create(&PostParams::default(), &secret).await {
        Ok(created) => {
            info!(secret = %format!("{namespace}/{name}"), "created the lease-key Secret");
            key_of(&created, namespace, name)
        }
        Err(kube::Error::Api(status)) if status.code == 409 => {
            let secret = secrets.get(name).await.with_context(context)?;
            key_of(&secret, namespace, name)
        }
        Err(error) => Err(error).with_context(|| format!("creating the lease-key Secret {namespace}/{name}")),
    }
}

fn key_of(secret: &Secret, namespace: &str, name: &str) -> Result<LeaseKey> {
    let Some(ByteString(bytes)) = secret.data.as_ref().and_then(|data| data.get(KEY_ENTRY)) else {
        bail!(
            "the lease-key Secret {namespace}/{name} has no data key {KEY_ENTRY:?}; delete it to have a new one made"
        );
    };
    LeaseKey::from_bytes(bytes).map_err(|_| {
        anyhow::anyhow!(
            "the lease-key Secret {namespace}/{name} holds {} bytes under {KEY_ENTRY:?}; at least {MIN_KEY_BYTES} are \
             needed",
            bytes.len()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use egress_api::ProxyStatus;
    use std::time::Duration;

    #[test]
    fn cooldowns_round_trip_through_the_status_to_the_second() {
        let until = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let cooldowns = vec![Cooldown {
            proxy: "crawl/a".into(),
            target: "example.com".into(),
            until,
            streak: 3,
            reporters: vec!["team-a".into()],
        }];
        let mut proxy = Proxy::new("a", egress_api::ProxySpec::new(egress_api::ProxyMode::External));
        proxy.metadata.namespace = Some("crawl".into());
        proxy.status = Some(ProxyStatus { cooldowns: cooldown_status(&cooldowns), ..ProxyStatus::default() });
        assert_eq!(cooldowns_of(&proxy), cooldowns);
        let json = serde_json::to_value(&proxy.status).expect("json");
        assert_eq!(
            json["cooldowns"][0],
            serde_json::json!({"site": "example.com", "until": "2027-01-15T08:00:00Z", "streak": 3, "tenants": ["team-a"]})
        );
    }

    #[test]
    fn a_short_or_missing_key_is_a_clear_error() {
        let secret = |bytes: Option<Vec<u8>>| Secret {
            data: bytes.map(|bytes| [(KEY_ENTRY.to_owned(), ByteString(bytes))].into()),
            ..Secret::default()
        };
        let missing = key_of(&secret(None), "ops", "k").unwrap_err().to_string();
        assert!(missing.contains("ops/k has no data key \"key\""), "{missing}");
        let short = key_of(&secret(Some(vec![1; 8])), "ops", "k").unwrap_err().to_string();
        assert!(short.contains("holds 8 bytes") && short.contains("at least 32"), "{short}");
        assert!(key_of(&secret(Some(vec![1; 32])), "ops", "k").is_ok());
    }
}
