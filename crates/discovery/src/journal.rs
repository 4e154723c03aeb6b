//! Writing cooldowns somewhere durable, coalesced per proxy.
//!
//! A ban is answered only after a write that includes it has finished (or failed, or timed out): the caller that
//! got `cooldownUntil` knows the cooldown survives a restart. Reports on one proxy that arrive while a write is in
//! flight share the next write, so a burst costs two writes, not one per ban. A failed write is retried by the
//! expiry loop.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use egress_lease::{Cooldown, LeaseState, ProxyId};
use tracing::warn;

use crate::DiscoveryMetrics;

/// The most cooldowns kept per proxy: the ones ending last are kept.
pub const MAX_PERSISTED_COOLDOWNS: usize = 64;

/// How long a report waits for its write before it is answered anyway.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);

/// Where cooldowns are kept (the operator: the Proxy's status).
#[async_trait]
pub trait CooldownJournal: Send + Sync {
    /// Replaces the kept cooldowns of proxy `id` (`namespace/name`) with `cooldowns` (at most
    /// [`MAX_PERSISTED_COOLDOWNS`], latest end first).
    async fn write(&self, id: &ProxyId, cooldowns: &[Cooldown]) -> Result<(), String>;
}

#[derive(Default)]
struct Progress {
    /// Bumped by each ban.
    wanted: u64,
    /// The `wanted` value the last successful write covered.
    written: u64,
    /// One write per proxy at a time.
    writing: Arc<tokio::sync::Mutex<()>>,
}

/// The per-proxy bookkeeping in front of a journal; without one, persisting does nothing.
#[derive(Default)]
pub(crate) struct Persister {
    journal: Option<Arc<dyn CooldownJournal>>,
    progress: Mutex<HashMap<ProxyId, Progress>>,
}

impl Persister {
    pub(crate) fn new(journal: Arc<dyn CooldownJournal>) -> Self {
        Self { journal: Some(journal), progress: Mutex::default() }
    }

    fn progress(&self) -> std::sync::MutexGuard<'_, HashMap<ProxyId, Progress>> {
        self.progress.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Writes the cooldowns of `proxy` after a change the store already holds; returns once a write that covers
    /// it finished. `false` when it failed (the ban holds in memory and the write is retried).
    pub(crate) async fn persist(&self, store: &dyn LeaseState, proxy: &ProxyId, metrics: &DiscoveryMetrics) -> bool {
        if self.journal.is_none() {
            return true;
        }
        let (mine, writing) = {
            let mut progress = self.progress();
            let entry = progress.entry(proxy.clone()).or_default();
            entry.wanted += 1;
            (entry.wanted, entry.writing.clone())
        };
        self.write_covering(store, proxy, mine, &writing, metrics).await
    }

    async fn write_covering(
        &self,
        store: &dyn LeaseState,
        proxy: &ProxyId,
        mine: u64,
        writing: &tokio::sync::Mutex<()>,
        metrics: &DiscoveryMetrics,
    ) -> bool {
        let Some(journal) = &self.journal else { return true };
        let _turn = writing.lock().await;
        // Read what to cover only now: every ban counted so far is in the store, so this write covers them all.
        let covering = match self.progress().get(proxy) {
            Some(entry) if entry.written >= mine => return true,
            Some(entry) => entry.wanted,
            None => return true,
        };
        let result = match store.proxy_cooldowns(proxy, SystemTime::now()).await {
            Ok(mut cooldowns) => {
                cooldowns.truncate(MAX_PERSISTED_COOLDOWNS);
                match tokio::time::timeout(WRITE_TIMEOUT, journal.write(proxy, &cooldowns)).await {
                    Ok(result) => result,
                    Err(_) => Err(format!("no answer within {WRITE_TIMEOUT:?}")),
                }
            }
            Err(error) => Err(format!("reading them: {error}")),
        };
        metrics.cooldown_write(result.is_ok());
        match result {
            Ok(()) => {
                if let Some(entry) = self.progress().get_mut(proxy) {
                    entry.written = entry.written.max(covering);
                }
                true
            }
            Err(error) => {
                warn!(%proxy, %error, "writing the cooldowns failed; they hold in memory and the write is retried");
                false
            }
        }
    }

    /// Writes again every proxy whose last write failed.
    pub(crate) async fn retry(&self, store: &dyn LeaseState, metrics: &DiscoveryMetrics) {
        let behind: Vec<(ProxyId, u64, Arc<tokio::sync::Mutex<()>>)> = self
            .progress()
            .iter()
            .filter(|(_, entry)| entry.written < entry.wanted)
            .map(|(proxy, entry)| (proxy.clone(), entry.wanted, entry.writing.clone()))
            .collect();
        for (proxy, wanted, writing) in behind {
            self.write_covering(store, &proxy, wanted, &writing, metrics).await;
        }
    }

    /// Drops the bookkeeping of a proxy that is gone.
    pub(crate) fn forget(&self, proxy: &ProxyId) {
        self.progress().remove(proxy);
    }
}
