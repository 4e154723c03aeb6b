//! The lease-state port: what discovery asks of the state every replica must agree on (leases, caps, quotas,
//! sessions, cooldowns and ban streaks), asynchronously, so an adapter may keep it in another process.
//!
//! Two adapters implement it: [`InMemoryLeaseStore`] (this crate; one process's memory, the embedded default) and
//! `egress-lease-redis` (Valkey or Redis, shared by every replica). The proxies themselves ([`ProxyInfo`]) are each
//! replica's own view of the watched `Proxy` objects: an adapter keeps them locally and shares only the state.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use egress_fleet::ProxyId;

use crate::{
    Cooldown, EndedSessions, InMemoryLeaseStore, Lease, LeaseError, LeaseRequest, LeaseStore, ProxyInfo, ProxyLoad,
    Renewed, Report, Reported,
};

/// The state leases live in, as discovery uses it. Every method takes the caller's clock (`now`); an adapter that
/// shares the state between processes may use its server's clock instead, so replicas with skewed clocks agree.
///
/// An adapter that cannot reach its state answers [`LeaseError::StateUnavailable`]; nothing else changes then.
#[async_trait::async_trait]
pub trait LeaseState: Send + Sync {
    /// Adds or updates a proxy in this replica's view. A proxy that turns unhealthy, or whose cap is lowered, has
    /// leases revoked.
    async fn upsert_proxy(&self, proxy: ProxyInfo) -> Result<(), LeaseError>;
    /// Removes a proxy from this replica's view and revokes its leases.
    async fn remove_proxy(&self, id: &ProxyId) -> Result<(), LeaseError>;
    /// Grants a lease.
    async fn lease(&self, request: &LeaseRequest, now: SystemTime) -> Result<Lease, LeaseError>;
    /// Extends a lease; see [`LeaseStore::renew`].
    async fn renew(&self, id: &str, owner: &str, ttl: Option<Duration>, now: SystemTime)
    -> Result<Renewed, LeaseError>;
    /// Ends a lease.
    async fn release(&self, id: &str, owner: &str, now: SystemTime) -> Result<(), LeaseError>;
    /// Records what happened with a lease; see [`LeaseStore::report`].
    async fn report(&self, id: &str, owner: &str, report: &Report, now: SystemTime) -> Result<Reported, LeaseError>;
    /// The cooldowns of one proxy, latest end first; see [`LeaseStore::proxy_cooldowns`].
    async fn proxy_cooldowns(&self, proxy: &ProxyId, now: SystemTime) -> Result<Vec<Cooldown>, LeaseError>;
    /// Takes in cooldowns kept elsewhere; see [`LeaseStore::restore_cooldowns`].
    async fn restore_cooldowns(&self, cooldowns: &[Cooldown], now: SystemTime) -> Result<usize, LeaseError>;
    /// Ends cooldowns for a target now; see [`LeaseStore::clear_cooldowns`].
    async fn clear_cooldowns(
        &self,
        target: &str,
        proxy: Option<&ProxyId>,
        now: SystemTime,
    ) -> Result<Vec<Cooldown>, LeaseError>;
    /// Live cooldowns, for one target or all.
    async fn cooldowns(&self, target: Option<&str>, now: SystemTime) -> Result<Vec<Cooldown>, LeaseError>;
    /// Ends `owner`'s sessions; see [`LeaseStore::end_sessions`].
    async fn end_sessions(
        &self,
        owner: &str,
        session: Option<&str>,
        now: SystemTime,
    ) -> Result<EndedSessions, LeaseError>;
    /// The load of each of `ids`, in order; see [`LeaseStore::loads_of`].
    async fn loads_of(
        &self,
        ids: &[&ProxyId],
        target: Option<&str>,
        now: SystemTime,
    ) -> Result<Vec<Option<ProxyLoad>>, LeaseError>;
    /// The proxies `owner` holds live leases on.
    async fn held_by(&self, owner: &str, now: SystemTime) -> Result<BTreeSet<ProxyId>, LeaseError>;
    /// How many live leases on `proxy` were last told `endpoint`.
    async fn leases_on(&self, proxy: &ProxyId, endpoint: &str, now: SystemTime) -> Result<usize, LeaseError>;
    /// Releases every lease that has expired; returns how many.
    async fn expire(&self, now: SystemTime) -> Result<usize, LeaseError>;
    /// How many leases are active.
    async fn active_leases(&self) -> Result<usize, LeaseError>;
    /// How many live leases each owner holds.
    async fn leases_by_owner(&self) -> Result<BTreeMap<String, usize>, LeaseError>;
    /// How many leases this replica took over from IDs the state had not issued.
    fn adopted(&self) -> u64;
    /// The store itself when the state lives only in this process, so a caller must keep its ended leases
    /// elsewhere across a change of leader ([`LeaseStore::ended_leases`]); `None` for a shared state.
    fn local(&self) -> Option<&dyn LeaseStore> {
        None
    }
    /// The refusals (bans and throttles) every replica sharing this state takes, as they are taken; `None` when the
    /// state is this process's own, whose caller hears of refusals from its own reports.
    fn shared_refusals(&self) -> Option<tokio::sync::broadcast::Receiver<SharedRefusal>> {
        None
    }
}

/// A refusal taken by a replica sharing the state, or word that some were missed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SharedRefusal {
    /// A ban or throttle was reported.
    Refused(Refused),
    /// Refusals may have been missed (the connection to the shared state was lost and is back): a subscriber that
    /// needs every one starts over from the live cooldowns.
    Gap,
}

/// A ban or throttle, as reported at any replica.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    /// Whose report it was.
    pub owner: String,
    /// The normalised site.
    pub target: String,
    /// The reported proxy, and those leaving through its egress address that the report cooled too.
    pub proxies: Vec<ProxyId>,
    /// When the cooldown ends.
    pub until: SystemTime,
}

#[async_trait::async_trait]
impl LeaseState for InMemoryLeaseStore {
    async fn upsert_proxy(&self, proxy: ProxyInfo) -> Result<(), LeaseError> {
        LeaseStore::upsert_proxy(self, proxy);
        Ok(())
    }
    async fn remove_proxy(&self, id: &ProxyId) -> Result<(), LeaseError> {
        LeaseStore::remove_proxy(self, id);
        Ok(())
    }
    async fn lease(&self, request: &LeaseRequest, now: SystemTime) -> Result<Lease, LeaseError> {
        LeaseStore::lease(self, request, now)
    }
    async fn renew(
        &self,
        id: &str,
        owner: &str,
        ttl: Option<Duration>,
        now: SystemTime,
    ) -> Result<Renewed, LeaseError> {
        LeaseStore::renew(self, id, owner, ttl, now)
    }
    async fn release(&self, id: &str, owner: &str, now: SystemTime) -> Result<(), LeaseError> {
        LeaseStore::release(self, id, owner, now)
    }
    async fn report(&self, id: &str, owner: &str, report: &Report, now: SystemTime) -> Result<Reported, LeaseError> {
        LeaseStore::report(self, id, owner, report, now)
    }
    async fn proxy_cooldowns(&self, proxy: &ProxyId, now: SystemTime) -> Result<Vec<Cooldown>, LeaseError> {
        Ok(LeaseStore::proxy_cooldowns(self, proxy, now))
    }
    async fn restore_cooldowns(&self, cooldowns: &[Cooldown], now: SystemTime) -> Result<usize, LeaseError> {
        Ok(LeaseStore::restore_cooldowns(self, cooldowns, now))
    }
    async fn clear_cooldowns(
        &self,
        target: &str,
        proxy: Option<&ProxyId>,
        now: SystemTime,
    ) -> Result<Vec<Cooldown>, LeaseError> {
        LeaseStore::clear_cooldowns(self, target, proxy, now)
    }
    async fn cooldowns(&self, target: Option<&str>, now: SystemTime) -> Result<Vec<Cooldown>, LeaseError> {
        LeaseStore::cooldowns(self, target, now)
    }
    async fn end_sessions(
        &self,
        owner: &str,
        session: Option<&str>,
        now: SystemTime,
    ) -> Result<EndedSessions, LeaseError> {
        Ok(LeaseStore::end_sessions(self, owner, session, now))
    }
    async fn loads_of(
        &self,
        ids: &[&ProxyId],
        target: Option<&str>,
        now: SystemTime,
    ) -> Result<Vec<Option<ProxyLoad>>, LeaseError> {
        LeaseStore::loads_of(self, ids, target, now)
    }
    async fn held_by(&self, owner: &str, now: SystemTime) -> Result<BTreeSet<ProxyId>, LeaseError> {
        Ok(LeaseStore::held_by(self, owner, now))
    }
    async fn leases_on(&self, proxy: &ProxyId, endpoint: &str, now: SystemTime) -> Result<usize, LeaseError> {
        Ok(LeaseStore::leases_on(self, proxy, endpoint, now))
    }
    async fn expire(&self, now: SystemTime) -> Result<usize, LeaseError> {
        Ok(LeaseStore::expire(self, now))
    }
    async fn active_leases(&self) -> Result<usize, LeaseError> {
        Ok(LeaseStore::active_leases(self))
    }
    async fn leases_by_owner(&self) -> Result<BTreeMap<String, usize>, LeaseError> {
        Ok(LeaseStore::leases_by_owner(self))
    }
    fn adopted(&self) -> u64 {
        LeaseStore::adopted(self)
    }
    fn local(&self) -> Option<&dyn LeaseStore> {
        Some(self)
    }
}
