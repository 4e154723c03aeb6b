//! The one store of health verdicts: written by the engine only, read by whoever needs a verdict, and watchable.
//!
//! The engine records every verdict here as it forms; the operator's reconciler and its discovery view read the same
//! map, so they can never disagree about a proxy. A verdict known from elsewhere (a status written before a restart)
//! reaches the store through the engine too ([`crate::HealthEngine::upsert_seeded`]): its first probes then confirm
//! or overturn it by the normal thresholds. While no engine runs (a replica that does not lead) the store is empty,
//! and a reader falls back to what it knows otherwise. Every change
//! of a key's `healthy` verdict, including its removal, is announced on a broadcast channel of keys; a subscriber
//! that falls behind is told so (`Lagged`) and can compare its own view against [`Verdicts::for_each`], which visits
//! every entry without copying the map.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use tokio::sync::broadcast;

use crate::probe::FailureReason;

/// What may identify a target: any small value the caller chooses, such as a typed (object, address) pair.
pub trait TargetKey: Clone + Eq + Hash + Debug + Send + Sync + 'static {}

impl<K: Clone + Eq + Hash + Debug + Send + Sync + 'static> TargetKey for K {}

/// How many verdict changes may wait for the slowest subscriber before it is told it lagged.
const CHANGE_CAPACITY: usize = 4096;

/// The current verdict of a target that has one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CurrentVerdict {
    /// Whether probes get through.
    pub healthy: bool,
    /// When that last changed.
    pub since: SystemTime,
    /// Why the last failing probe failed.
    pub last_error: Option<FailureReason>,
    /// The last egress IP seen.
    pub egress_ip: Option<IpAddr>,
}

struct Shared<K> {
    map: RwLock<HashMap<K, CurrentVerdict>>,
    changes: broadcast::Sender<K>,
}

/// The shared verdict map. Cloning shares it.
pub struct Verdicts<K> {
    shared: Arc<Shared<K>>,
}

impl<K> Clone for Verdicts<K> {
    fn clone(&self) -> Self {
        Self { shared: self.shared.clone() }
    }
}

impl<K: TargetKey> Default for Verdicts<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: TargetKey> Verdicts<K> {
    /// An empty store.
    pub fn new() -> Self {
        let (changes, _) = broadcast::channel(CHANGE_CAPACITY);
        Self { shared: Arc::new(Shared { map: RwLock::default(), changes }) }
    }

    /// The verdict for `key`, when there is one.
    pub fn get<Q>(&self, key: &Q) -> Option<CurrentVerdict>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.shared.map.read().expect("verdict map").get(key).cloned()
    }

    /// Whether `key` has a healthy verdict.
    pub fn is_healthy<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.shared.map.read().expect("verdict map").get(key).is_some_and(|verdict| verdict.healthy)
    }

    /// Records a verdict; subscribers hear of it when `healthy` changed (or the key is new).
    pub(crate) fn set(&self, key: K, verdict: CurrentVerdict) {
        let flipped = {
            let mut map = self.shared.map.write().expect("verdict map");
            let flipped = map.get(&key).is_none_or(|old| old.healthy != verdict.healthy);
            map.insert(key.clone(), verdict);
            flipped
        };
        if flipped {
            let _ = self.shared.changes.send(key);
        }
    }

    /// Updates the details of an existing verdict (last error, egress IP) without announcing a change.
    pub(crate) fn update_details(&self, key: &K, last_error: Option<FailureReason>, egress_ip: Option<IpAddr>) {
        if let Some(current) = self.shared.map.write().expect("verdict map").get_mut(key) {
            if last_error.is_some() {
                current.last_error = last_error;
            }
            if egress_ip.is_some() {
                current.egress_ip = egress_ip;
            }
        }
    }

    /// Forgets a verdict; subscribers hear of it when there was one.
    pub(crate) fn remove<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let removed = self.shared.map.write().expect("verdict map").remove_entry(key);
        if let Some((key, _)) = removed {
            let _ = self.shared.changes.send(key);
        }
    }

    /// Records a verdict as an engine would: for tests that play the engine (the `testing` feature only).
    #[cfg(feature = "testing")]
    pub fn set_as_engine(&self, key: K, verdict: CurrentVerdict) {
        self.set(key, verdict);
    }

    /// Every key whose verdict flips or disappears from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<K> {
        self.shared.changes.subscribe()
    }

    /// Visits every verdict under the read lock, without copying the map; keep `visit` short.
    pub fn for_each(&self, mut visit: impl FnMut(&K, &CurrentVerdict)) {
        for (key, verdict) in self.shared.map.read().expect("verdict map").iter() {
            visit(key, verdict);
        }
    }

    /// How many verdicts there are.
    pub fn len(&self) -> usize {
        self.shared.map.read().expect("verdict map").len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(healthy: bool) -> CurrentVerdict {
        CurrentVerdict { healthy, since: SystemTime::UNIX_EPOCH, last_error: None, egress_ip: None }
    }

    #[test]
    fn only_flips_and_removals_are_announced() {
        let verdicts: Verdicts<String> = Verdicts::new();
        let mut changes = verdicts.subscribe();
        verdicts.set("a".into(), verdict(true));
        verdicts.set("a".into(), verdict(true));
        verdicts.update_details(&"a".into(), Some(FailureReason::Timeout), None);
        verdicts.set("a".into(), verdict(false));
        verdicts.remove("a");
        verdicts.remove("a");
        let mut heard = Vec::new();
        while let Ok(key) = changes.try_recv() {
            heard.push(key);
        }
        assert_eq!(heard, ["a", "a", "a"], "new, flipped, removed; repeats and details are silent");
        assert!(verdicts.is_empty());
    }

    #[test]
    fn details_never_create_a_verdict() {
        let verdicts: Verdicts<String> = Verdicts::new();
        verdicts.update_details(&"a".into(), Some(FailureReason::Timeout), None);
        assert!(verdicts.get("a").is_none());
        verdicts.set("a".into(), verdict(false));
        verdicts.update_details(&"a".into(), Some(FailureReason::Timeout), None);
        assert_eq!(verdicts.get("a").and_then(|verdict| verdict.last_error), Some(FailureReason::Timeout));
        assert!(!verdicts.is_healthy("a"));
    }
}
