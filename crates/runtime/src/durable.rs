//! What the discovery API keeps in the apiserver so that a restart or a new leader loses nothing a client relies
//! on: cooldowns in each Proxy's `status.cooldowns` (written under a field manager of their own), the key lease
//! IDs are signed with, in a Secret every replica reads, and the leases that ended before their expiry and those
//! still live, in a ConfigMap the leader rewrites (so a released lease's ID is not adopted again by the next leader,
//! and a held one counts against its proxy's cap there before its holder shows it).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use async_trait::async_trait;
use egress_api::{CooldownStatus, Proxy};
use egress_discovery::{CooldownJournal, MAX_PERSISTED_COOLDOWNS};
use egress_lease::{Cooldown, EndedLeaseRecord, LeaseKey, LeaseStore, LiveLeaseRecord, MIN_KEY_BYTES, ProxyId};
use egress_reconcile::ids::proxy_id;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use tokio::sync::watch;
use tracing::{debug, info, warn};

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
                target: cooldown.target.clone(),
                site: None,
                until: Time(until),
                streak: cooldown.streak,
                tenants: cooldown.reporters.iter().take(16).cloned().collect(),
            })
        })
        .collect()
}

/// The cooldowns a Proxy's status keeps, for the lease store.
pub fn cooldowns_of(proxy: &Proxy) -> Vec<Cooldown> {
    let id = proxy_id(proxy);
    proxy
        .status
        .iter()
        .flat_map(|status| &status.cooldowns)
        .map(|kept| Cooldown {
            proxy: id.clone(),
            target: kept.target().to_owned(),
            until: SystemTime::from(kept.until.0),
            streak: kept.streak,
            reporters: kept.tenants.clone(),
        })
        .collect()
}

#[async_trait]
impl CooldownJournal for StatusCooldownJournal {
    async fn write(&self, id: &ProxyId, cooldowns: &[Cooldown]) -> Result<(), String> {
        let api: Api<Proxy> = Api::namespaced(self.client.clone(), id.namespace());
        let patch = serde_json::json!({
            "apiVersion": "crawl.example.com/v1alpha1",
            "kind": "Proxy",
            "status": { "cooldowns": cooldown_status(cooldowns) },
        });
        let params = PatchParams::apply(COOLDOWN_FIELD_MANAGER).force();
        match api.patch_status(id.name(), &params, &Patch::Apply(&patch)).await {
            Ok(_) => {
                debug!(proxy = %id, cooldowns = cooldowns.len(), "cooldowns written");
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
            info!(namespace, secret = name, "created the lease-key Secret");
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

/// The ConfigMap, in the operator's namespace, that the leader keeps ended leases in.
pub const ENDED_LEASES_CONFIGMAP: &str = "egress-operator-ended-leases";

/// The most ended leases kept (the ones whose IDs stay valid longest): 17 bytes each, so the ConfigMap stays far
/// below the apiserver's 1 MiB object limit.
pub const MAX_PERSISTED_ENDED: usize = 20_000;

/// How often the leader writes the ended leases when they changed: the most a leader killed without warning loses.
pub const ENDED_WRITE_INTERVAL: Duration = Duration::from_secs(1);

/// Failed journal writes are retried after twice the write interval, doubling to a minute.
const WRITE_RETRIES: egress_reconcile::backoff::Backoff =
    egress_reconcile::backoff::Backoff::new(ENDED_WRITE_INTERVAL.saturating_mul(2), Duration::from_secs(60));

/// The most live leases kept (the ones expiring last): about 40 bytes each plus each proxy's and owner's name once,
/// so with the ended ones (340 KB at most) the ConfigMap stays below the apiserver's 1 MiB limit. Leases beyond it
/// are taken over when their holders show them, while their proxies have room.
pub const MAX_PERSISTED_LIVE: usize = 10_000;

/// The key in the ConfigMap's binaryData of the ended leases ([`encode_ended`]).
pub const ENDED_ENTRY: &str = "ended-v1";
/// The key in the ConfigMap's binaryData of the live leases ([`encode_live`]).
pub const LIVE_ENTRY: &str = "live-v1";
/// The field manager that writes them.
const ENDED_FIELD_MANAGER: &str = "egress-operator-ended-leases";
const RECORD_BYTES: usize = 17;

/// `records` as bytes: per lease the serial and the end (seconds since the epoch, rounded up), big-endian, and
/// whether it was released (1) or revoked (0).
pub fn encode_ended(records: &[EndedLeaseRecord]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(records.len() * RECORD_BYTES);
    for record in records {
        let until = record.until.duration_since(UNIX_EPOCH).unwrap_or_default();
        let seconds = until.as_secs() + u64::from(until.subsec_nanos() > 0);
        bytes.extend_from_slice(&record.serial.to_be_bytes());
        bytes.extend_from_slice(&seconds.to_be_bytes());
        bytes.push(u8::from(record.released));
    }
    bytes
}

/// The records [`encode_ended`] wrote, or what is wrong with `bytes`.
pub fn decode_ended(bytes: &[u8]) -> Result<Vec<EndedLeaseRecord>> {
    if !bytes.len().is_multiple_of(RECORD_BYTES) {
        bail!("{} bytes are not a whole number of {RECORD_BYTES}-byte records", bytes.len());
    }
    bytes
        .chunks_exact(RECORD_BYTES)
        .map(|chunk| {
            let serial = u64::from_be_bytes(chunk[..8].try_into().expect("eight bytes"));
            let seconds = u64::from_be_bytes(chunk[8..16].try_into().expect("eight bytes"));
            let released = match chunk[16] {
                0 => false,
                1 => true,
                other => bail!("a record's last byte is {other}, not 0 (revoked) or 1 (released)"),
            };
            Ok(EndedLeaseRecord { serial, until: UNIX_EPOCH + Duration::from_secs(seconds), released })
        })
        .collect()
}

/// The live leases as kept: each name once, each lease as (serial, expiry in seconds since the epoch rounded up,
/// index of its proxy, of its owner), and the session slot of each lease that has one as (index of the lease,
/// slot). Records written before slots were kept have none and read as leases without a session.
#[derive(serde::Serialize, serde::Deserialize)]
struct LiveLeases {
    proxies: Vec<String>,
    owners: Vec<String>,
    leases: Vec<(u64, u64, usize, usize)>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    slots: Vec<(usize, u64)>,
}

/// `records` as JSON bytes, every proxy and owner named once.
pub fn encode_live(records: &[LiveLeaseRecord]) -> Vec<u8> {
    fn index(names: &mut Vec<String>, seen: &mut std::collections::HashMap<String, usize>, name: &str) -> usize {
        *seen.entry(name.to_owned()).or_insert_with(|| {
            names.push(name.to_owned());
            names.len() - 1
        })
    }
    let mut kept = LiveLeases { proxies: Vec::new(), owners: Vec::new(), leases: Vec::new(), slots: Vec::new() };
    let (mut proxies, mut owners) = Default::default();
    for record in records {
        let until = record.until.duration_since(UNIX_EPOCH).unwrap_or_default();
        let seconds = until.as_secs() + u64::from(until.subsec_nanos() > 0);
        let proxy = index(&mut kept.proxies, &mut proxies, &record.proxy.to_string());
        let owner = index(&mut kept.owners, &mut owners, &record.owner);
        if let Some(slot) = record.slot {
            kept.slots.push((kept.leases.len(), slot));
        }
        kept.leases.push((record.serial, seconds, proxy, owner));
    }
    serde_json::to_vec(&kept).expect("plain data serialises")
}

/// The records [`encode_live`] wrote, or what is wrong with `bytes`.
pub fn decode_live(bytes: &[u8]) -> Result<Vec<LiveLeaseRecord>> {
    let kept: LiveLeases = serde_json::from_slice(bytes).context("the live leases are not the JSON written")?;
    let proxies = kept
        .proxies
        .iter()
        .map(|proxy| proxy.parse::<ProxyId>().map_err(|error| anyhow::anyhow!("proxy {proxy:?}: {error}")))
        .collect::<Result<Vec<_>>>()?;
    let mut slots = std::collections::HashMap::new();
    for &(lease, slot) in &kept.slots {
        if lease >= kept.leases.len() {
            bail!("a slot names lease {lease}, not in the list");
        }
        slots.insert(lease, slot);
    }
    kept.leases
        .iter()
        .enumerate()
        .map(|(index, &(serial, seconds, proxy, owner))| {
            let missing = |what: &str, at: usize| format!("lease {serial:x} names {what} {at}, not in the list");
            Ok(LiveLeaseRecord {
                serial,
                proxy: proxies.get(proxy).cloned().with_context(|| missing("proxy", proxy))?,
                owner: kept.owners.get(owner).cloned().with_context(|| missing("owner", owner))?,
                slot: slots.get(&index).copied(),
                until: UNIX_EPOCH + Duration::from_secs(seconds),
            })
        })
        .collect()
}

/// Keeps the lease store's ended leases in a ConfigMap while this replica leads: read into the store when it
/// takes over (before it serves leases), written again at most every [`ENDED_WRITE_INTERVAL`] when they changed,
/// and once more when it stops leading gracefully.
pub struct EndedLeases {
    configmaps: Api<ConfigMap>,
    namespace: String,
    store: Arc<dyn LeaseStore>,
    /// The store's ended generation the last write covered.
    written: AtomicU64,
    /// Whether this term read the previous leader's record: until it has, writing would replace that record with
    /// less.
    restored: AtomicBool,
}

impl EndedLeases {
    /// Ended leases of `store`, kept in [`ENDED_LEASES_CONFIGMAP`] in `namespace`.
    pub fn new(client: Client, namespace: &str, store: Arc<dyn LeaseStore>) -> Self {
        Self {
            configmaps: Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
            store,
            written: AtomicU64::new(u64::MAX),
            restored: AtomicBool::new(false),
        }
    }

    fn name(&self) -> String {
        format!("{}/{ENDED_LEASES_CONFIGMAP}", self.namespace)
    }

    /// Reads the kept ended leases into the store; from now on, changes are written.
    pub async fn restore(&self) -> Result<usize> {
        let kept = self
            .configmaps
            .get_opt(ENDED_LEASES_CONFIGMAP)
            .await
            .with_context(|| format!("reading the ended leases in ConfigMap {}", self.name()))?;
        let bytes = kept.as_ref().and_then(|map| map.binary_data.as_ref()).and_then(|data| data.get(ENDED_ENTRY));
        let records = match bytes {
            Some(ByteString(bytes)) => decode_ended(bytes).unwrap_or_else(|error| {
                // A record this version cannot read is replaced by the next write rather than stopping the leader.
                warn!(configmap = %self.name(), %error, "the kept ended leases cannot be read; starting without them");
                Vec::new()
            }),
            None => Vec::new(),
        };
        let restored = self.store.restore_ended(&records, SystemTime::now());
        let live = match kept.as_ref().and_then(|map| map.binary_data.as_ref()).and_then(|data| data.get(LIVE_ENTRY)) {
            Some(ByteString(bytes)) => decode_live(bytes).unwrap_or_else(|error| {
                warn!(configmap = %self.name(), error = %format!("{error:#}"), "the kept live leases cannot be read; \
                      their holders' leases are taken over when shown, while their proxies have room");
                Vec::new()
            }),
            None => Vec::new(),
        };
        let counted = self.store.restore_live(&live, SystemTime::now());
        self.restored.store(true, Ordering::Release);
        info!(
            configmap = %self.name(),
            kept = records.len(),
            restored,
            live = live.len(),
            counted,
            "ended and live leases restored"
        );
        Ok(restored)
    }

    /// Writes the ended leases when they changed since the last write (and this term restored them first).
    pub async fn flush(&self) -> Result<()> {
        if !self.restored.load(Ordering::Acquire) {
            return Ok(());
        }
        if self.generation() == self.written.load(Ordering::Acquire) {
            return Ok(());
        }
        let (ended_generation, records) = self.store.ended_leases(MAX_PERSISTED_ENDED, SystemTime::now());
        let (live_generation, live) = self.store.live_leases(MAX_PERSISTED_LIVE, SystemTime::now());
        let generation = ended_generation.wrapping_add(live_generation);
        let body = serde_json::json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": ENDED_LEASES_CONFIGMAP,
                "labels": { "app.kubernetes.io/managed-by": "egress-operator" },
            },
            "binaryData": {
                ENDED_ENTRY: ByteString(encode_ended(&records)),
                LIVE_ENTRY: ByteString(encode_live(&live)),
            },
        });
        self.configmaps
            .patch(ENDED_LEASES_CONFIGMAP, &PatchParams::apply(ENDED_FIELD_MANAGER).force(), &Patch::Apply(&body))
            .await
            .with_context(|| format!("writing the ended leases to ConfigMap {}", self.name()))?;
        self.written.store(generation, Ordering::Release);
        debug!(configmap = %self.name(), ended = records.len(), live = live.len(), "ended and live leases written");
        Ok(())
    }

    /// Changes whenever a lease is granted, renewed, taken over or ends.
    fn generation(&self) -> u64 {
        self.store.ended_generation().wrapping_add(self.store.live_generation())
    }

    /// This replica stopped leading: the next term reads the record again before writing.
    pub fn forget_term(&self) {
        self.restored.store(false, Ordering::Release);
        self.written.store(u64::MAX, Ordering::Release);
    }

    /// While `leader` says this replica leads: restores (retrying until it works), then writes changes every
    /// [`ENDED_WRITE_INTERVAL`]. Returns when `stop` turns true.
    pub async fn run(self: Arc<Self>, mut leader: watch::Receiver<bool>, mut stop: watch::Receiver<bool>) {
        let mut ticks = tokio::time::interval(ENDED_WRITE_INTERVAL);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // After a failure, the next attempt waits twice as long each time (up to a minute), and only the first
        // failure of a streak is logged as a warning.
        let (mut failures, mut next_attempt) = (0_u32, tokio::time::Instant::now());
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                changed = leader.changed() => if changed.is_err() { return },
                changed = stop.changed() => if changed.is_err() || *stop.borrow() { return },
            }
            if *stop.borrow() {
                return;
            }
            if !*leader.borrow() {
                self.forget_term();
                (failures, next_attempt) = (0, tokio::time::Instant::now());
                continue;
            }
            if tokio::time::Instant::now() < next_attempt {
                continue;
            }
            let done = if self.restored.load(Ordering::Acquire) {
                self.flush().await.map(|()| 0)
            } else {
                self.restore().await
            };
            match done {
                Ok(_) => failures = 0,
                Err(error) => {
                    if failures == 0 {
                        warn!("{error:#}; retrying with backoff");
                    } else {
                        debug!("{error:#}");
                    }
                    failures = failures.saturating_add(1);
                    let wait = WRITE_RETRIES.after(failures);
                    next_attempt = tokio::time::Instant::now() + wait;
                }
            }
        }
    }
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
            proxy: ProxyId::new("crawl", "a"),
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
            serde_json::json!({"target": "example.com", "until": "2027-01-15T08:00:00Z", "streak": 3, "tenants": ["team-a"]})
        );
        // A status an older operator wrote names the target `site`: still read.
        let older = serde_json::json!({"cooldowns": [{"site": "example.com", "until": "2027-01-15T08:00:00Z", "streak": 3, "tenants": ["team-a"]}]});
        proxy.status = Some(serde_json::from_value(older).expect("an older status"));
        assert_eq!(cooldowns_of(&proxy), cooldowns);
    }

    #[test]
    fn live_leases_round_trip_with_each_name_once_and_bad_bytes_are_named() {
        let at = |seconds| UNIX_EPOCH + Duration::from_secs(seconds);
        let record = |serial, proxy: &str, owner: &str, until| LiveLeaseRecord {
            serial,
            proxy: ProxyId::new("crawl", proxy),
            owner: owner.into(),
            slot: None,
            until,
        };
        let records = vec![
            record(u64::MAX, "a", "t1", at(1_800_000_100)),
            LiveLeaseRecord { slot: Some(u64::MAX - 1), ..record(7, "b", "t1", at(1_800_000_000)) },
            record(8, "a", "", at(1_800_000_000) + Duration::from_millis(1)),
        ];
        let bytes = encode_live(&records);
        let text = String::from_utf8(bytes.clone()).expect("JSON");
        assert_eq!(text.matches("crawl/a").count(), 1, "each name once: {text}");
        let mut expected = records.clone();
        expected[2].until = at(1_800_000_001);
        assert_eq!(decode_live(&bytes).expect("decoded"), expected, "to the second, rounded up");
        assert!(decode_live(b"[1").unwrap_err().to_string().contains("not the JSON written"));
        let dangling = br#"{"proxies":["crawl/a"],"owners":[""],"leases":[[10,1,0,3]]}"#;
        assert!(format!("{:#}", decode_live(dangling).unwrap_err()).contains("lease a names owner 3"));
        let bad = br#"{"proxies":["no-slash"],"owners":[],"leases":[]}"#;
        assert!(format!("{:#}", decode_live(bad).unwrap_err()).contains("no-slash"));
        let stray = br#"{"proxies":["crawl/a"],"owners":[""],"leases":[[10,1,0,0]],"slots":[[1,5]]}"#;
        assert!(format!("{:#}", decode_live(stray).unwrap_err()).contains("a slot names lease 1"));
        // A record an older operator wrote keeps no slots: its leases read as leases without a session.
        let older = br#"{"proxies":["crawl/a"],"owners":["t1"],"leases":[[10,1,0,0]]}"#;
        assert_eq!(decode_live(older).expect("an older record")[0].slot, None);
    }

    #[test]
    fn ended_leases_round_trip_and_bad_bytes_are_named() {
        let at = |seconds: u64| UNIX_EPOCH + Duration::from_secs(seconds);
        let records = vec![
            EndedLeaseRecord { serial: u64::MAX, until: at(1_800_000_000), released: true },
            EndedLeaseRecord { serial: 7, until: at(1_800_000_001), released: false },
        ];
        let bytes = encode_ended(&records);
        assert_eq!(bytes.len(), 34);
        assert_eq!(decode_ended(&bytes).expect("decoded"), records);
        // An end between seconds is kept to the next one: never earlier than the IDs' own expiry.
        let between = [EndedLeaseRecord { serial: 1, until: at(10) + Duration::from_millis(1), released: true }];
        assert_eq!(decode_ended(&encode_ended(&between)).expect("decoded")[0].until, at(11));
        assert!(decode_ended(&bytes[..20]).unwrap_err().to_string().contains("20 bytes are not a whole number"));
        let mut flagged = bytes.clone();
        flagged[16] = 9;
        assert!(decode_ended(&flagged).unwrap_err().to_string().contains("last byte is 9"));
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
