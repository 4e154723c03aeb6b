//! The in-memory lease store.
//!
//! Everything lives under one mutex; each operation is a handful of map and ordered-set updates. Eligible proxies
//! (healthy, cap above zero, below the cap) are kept in a `BTreeSet` ordered by (active leases, last leased), so a
//! lease takes the first entry that matches the selector and is not cooling down for the target, without looking
//! at the rest. Expiries of leases, cooldowns, revocations and sessions sit in ordered sets too, so expiring is
//! proportional to what expires and memory stays bounded by what is live.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use crate::{
    Cooldown, Lease, LeaseConfig, LeaseError, LeaseRequest, LeaseStore, Outcome, ProxyInfo, ProxyLoad, normalize,
};

struct ProxyState {
    info: ProxyInfo,
    active: u32,
    last_leased: u64,
    leases: HashSet<String>,
}

impl ProxyState {
    fn eligible(&self) -> bool {
        self.info.healthy && self.active < self.info.max_leases
    }
    fn key(&self) -> (u32, u64, String) {
        (self.active, self.last_leased, self.info.id.clone())
    }
}

struct LeaseState {
    proxy: String,
    target: String,
    expires_at: SystemTime,
    /// The order of grant, so a lowered cap revokes the newest leases first.
    sequence: u64,
    granted_at: SystemTime,
}

struct CooldownState {
    until: SystemTime,
    streak: u32,
    forget_at: SystemTime,
    /// The store sequence when the ban was reported, to tell a cooldown that predates a lease from a later one.
    started: u64,
}

#[derive(Default)]
struct Inner {
    proxies: HashMap<String, ProxyState>,
    /// Eligible proxies by (active leases, last leased sequence, id).
    available: BTreeSet<(u32, u64, String)>,
    leases: HashMap<String, LeaseState>,
    lease_expiries: BTreeSet<(SystemTime, String)>,
    /// Revoked leases: proxy and target (so a late ban report still counts), kept until they would have expired.
    revoked: HashMap<String, (String, String, SystemTime)>,
    revoked_expiries: BTreeSet<(SystemTime, String)>,
    cooldowns: HashMap<(String, String), CooldownState>,
    cooldown_expiries: BTreeSet<(SystemTime, String, String)>,
    sessions: HashMap<(String, String), (String, SystemTime)>,
    session_expiries: BTreeSet<(SystemTime, String, String)>,
    sequence: u64,
}

/// An internal inconsistency found by [`InMemoryLeaseStore::check_invariants`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("lease store invariant violated: {0}")]
pub struct InvariantViolation(pub String);

/// The in-memory [`LeaseStore`].
pub struct InMemoryLeaseStore {
    config: LeaseConfig,
    inner: Mutex<Inner>,
    /// Mixed into lease identifiers so they cannot be guessed from their order.
    secret: u64,
}

impl InMemoryLeaseStore {
    /// An empty store.
    pub fn new(config: LeaseConfig) -> Self {
        let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |elapsed| elapsed.as_nanos());
        let secret = (nanos as u64) ^ (u64::from(std::process::id()) << 32) ^ 0x9e37_79b9_7f4a_7c15;
        Self { config, inner: Mutex::new(Inner::default()), secret }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lease_id(&self, sequence: u64) -> String {
        // SplitMix64 of a per-store secret and the sequence: unique per store and not predictable from outside.
        let mut z = self.secret.wrapping_add(sequence.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        format!("l-{z:016x}{sequence:x}")
    }

    fn ttl(&self, requested: Option<Duration>) -> Duration {
        requested.unwrap_or(self.config.default_ttl).clamp(Duration::from_secs(1), self.config.max_ttl)
    }

    /// The cooldown after the `streak`-th ban in a row.
    fn cooldown_for(&self, streak: u32) -> Duration {
        let factor = 1_u32.checked_shl(streak.saturating_sub(1)).unwrap_or(u32::MAX);
        self.config.cooldown_base.saturating_mul(factor).min(self.config.cooldown_cap)
    }

    /// Checks every internal invariant: no proxy above its cap, active counts equal the live leases, no lease on an
    /// unhealthy proxy, no lease granted while its (proxy, target) cooled down, the eligibility index matches the
    /// proxies.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let inner = self.lock();
        let violation = |text: String| Err(InvariantViolation(text));
        let mut counted: HashMap<&str, u32> = HashMap::new();
        for (id, lease) in &inner.leases {
            let Some(proxy) = inner.proxies.get(&lease.proxy) else {
                return violation(format!("lease {id} is on unknown proxy {}", lease.proxy));
            };
            if !proxy.info.healthy {
                return violation(format!("lease {id} is on unhealthy proxy {}", lease.proxy));
            }
            if !proxy.leases.contains(id) {
                return violation(format!("lease {id} is missing from its proxy's lease set"));
            }
            if let Some(cooldown) = inner.cooldowns.get(&(lease.proxy.clone(), lease.target.clone()))
                && cooldown.started < lease.sequence
                && cooldown.until > lease.granted_at
            {
                return violation(format!(
                    "lease {id} was granted on {} while it cooled down for {}",
                    lease.proxy, lease.target
                ));
            }
            *counted.entry(lease.proxy.as_str()).or_default() += 1;
        }
        for (id, proxy) in &inner.proxies {
            let live = counted.get(id.as_str()).copied().unwrap_or(0);
            if proxy.active != live || proxy.leases.len() as u32 != live {
                return violation(format!("proxy {id} counts {} active leases but has {live}", proxy.active));
            }
            if proxy.active > proxy.info.max_leases {
                return violation(format!(
                    "proxy {id} has {} leases, above its cap {}",
                    proxy.active, proxy.info.max_leases
                ));
            }
            if proxy.eligible() != inner.available.contains(&proxy.key()) {
                return violation(format!("proxy {id} is indexed as available wrongly"));
            }
        }
        if inner.available.len() != inner.proxies.values().filter(|proxy| proxy.eligible()).count() {
            return violation("the availability index holds stale entries".into());
        }
        if inner.lease_expiries.len() != inner.leases.len() {
            return violation("lease expiries and leases differ in number".into());
        }
        Ok(())
    }

    /// Counts of live entries, for memory-bound tests: (leases, cooldowns, sessions, revoked).
    pub fn sizes(&self) -> (usize, usize, usize, usize) {
        let inner = self.lock();
        (inner.leases.len(), inner.cooldowns.len(), inner.sessions.len(), inner.revoked.len())
    }
}

impl Inner {
    fn cooling_until(&self, proxy: &str, target: &str, now: SystemTime) -> Option<SystemTime> {
        self.cooldowns
            .get(&(proxy.to_owned(), target.to_owned()))
            .map(|cooldown| cooldown.until)
            .filter(|until| *until > now)
    }

    fn reindex(&mut self, id: &str, update: impl FnOnce(&mut ProxyState)) {
        let Some(proxy) = self.proxies.get_mut(id) else { return };
        self.available.remove(&proxy.key());
        update(proxy);
        if proxy.eligible() {
            self.available.insert(proxy.key());
        }
    }

    /// Frees a live lease's slot. Returns its state, or `None` if it is not live (so a slot is never freed twice).
    fn free(&mut self, id: &str) -> Option<LeaseState> {
        let lease = self.leases.remove(id)?;
        self.lease_expiries.remove(&(lease.expires_at, id.to_owned()));
        let proxy = lease.proxy.clone();
        self.reindex(&proxy, |state| {
            state.active -= 1;
            state.leases.remove(id);
        });
        Some(lease)
    }

    fn revoke_all(&mut self, proxy: &str) {
        self.revoke_above(proxy, 0);
    }

    /// Revokes the newest leases of `proxy` until at most `keep` remain.
    fn revoke_above(&mut self, proxy: &str, keep: u32) {
        let mut ids: Vec<(u64, String)> = self
            .proxies
            .get(proxy)
            .map(|state| {
                state.leases.iter().filter_map(|id| Some((self.leases.get(id)?.sequence, id.clone()))).collect()
            })
            .unwrap_or_default();
        ids.sort_unstable();
        let excess = ids.len().saturating_sub(keep as usize);
        for (_, id) in ids.into_iter().rev().take(excess) {
            if let Some(lease) = self.free(&id) {
                self.revoked_expiries.insert((lease.expires_at, id.clone()));
                self.revoked.insert(id, (lease.proxy, lease.target, lease.expires_at));
            }
        }
    }

    fn grant(
        &mut self,
        store: &InMemoryLeaseStore,
        proxy: &str,
        target: &str,
        ttl: Duration,
        now: SystemTime,
    ) -> Lease {
        self.sequence += 1;
        let sequence = self.sequence;
        let id = store.lease_id(sequence);
        let expires_at = now + ttl;
        self.reindex(proxy, |state| {
            state.active += 1;
            state.last_leased = sequence;
            state.leases.insert(id.clone());
        });
        self.leases.insert(
            id.clone(),
            LeaseState { proxy: proxy.to_owned(), target: target.to_owned(), expires_at, sequence, granted_at: now },
        );
        self.lease_expiries.insert((expires_at, id.clone()));
        Lease { id, proxy: proxy.to_owned(), target: target.to_owned(), expires_at }
    }

    fn expire(&mut self, now: SystemTime) -> usize {
        let mut expired = 0;
        while let Some((at, id)) = self.lease_expiries.first().cloned() {
            if at > now {
                break;
            }
            if self.free(&id).is_some() {
                expired += 1;
            }
        }
        while let Some((at, id)) = self.revoked_expiries.first().cloned() {
            if at > now {
                break;
            }
            self.revoked_expiries.pop_first();
            self.revoked.remove(&id);
        }
        while let Some((at, proxy, target)) = self.cooldown_expiries.first().cloned() {
            if at > now {
                break;
            }
            self.cooldown_expiries.pop_first();
            let key = (proxy, target);
            if self.cooldowns.get(&key).is_some_and(|cooldown| cooldown.forget_at == at) {
                self.cooldowns.remove(&key);
            }
        }
        while let Some((at, session, target)) = self.session_expiries.first().cloned() {
            if at > now {
                break;
            }
            self.session_expiries.pop_first();
            let key = (session, target);
            if self.sessions.get(&key).is_some_and(|(_, forget_at)| *forget_at == at) {
                self.sessions.remove(&key);
            }
        }
        expired
    }
}

impl LeaseStore for InMemoryLeaseStore {
    fn upsert_proxy(&self, proxy: ProxyInfo) {
        let mut inner = self.lock();
        let id = proxy.id.clone();
        let healthy = proxy.healthy;
        if inner.proxies.contains_key(&id) {
            inner.reindex(&id, |state| state.info = proxy);
        } else {
            let state = ProxyState { info: proxy, active: 0, last_leased: 0, leases: HashSet::new() };
            if state.eligible() {
                inner.available.insert(state.key());
            }
            inner.proxies.insert(id.clone(), state);
        }
        if healthy {
            // A lowered cap (maxLeases 0 drains) revokes the newest leases above it: the cap always holds.
            let cap = inner.proxies.get(&id).map_or(0, |state| state.info.max_leases);
            inner.revoke_above(&id, cap);
        } else {
            inner.revoke_all(&id);
        }
    }

    fn remove_proxy(&self, id: &str) {
        let mut inner = self.lock();
        inner.revoke_all(id);
        if let Some(state) = inner.proxies.remove(id) {
            inner.available.remove(&state.key());
        }
    }

    fn lease(&self, request: &LeaseRequest, now: SystemTime) -> Result<Lease, LeaseError> {
        let target = normalize(&request.target, self.config.target_mode)?;
        let ttl = self.ttl(request.ttl);
        let mut inner = self.lock();
        inner.expire(now);

        if let Some(name) = &request.proxy {
            let Some(proxy) = inner.proxies.get(name) else { return Err(LeaseError::UnknownProxy(name.clone())) };
            let unavailable = |why| Err(LeaseError::ProxyUnavailable { proxy: name.clone(), why });
            if !request.selector.matches(&proxy.info.labels) {
                return unavailable("it does not match the selector");
            }
            if !proxy.info.healthy {
                return unavailable("it is unhealthy");
            }
            if proxy.info.max_leases == 0 {
                return unavailable("it is drained (maxLeases 0)");
            }
            if proxy.active >= proxy.info.max_leases {
                return unavailable("it is at its lease cap");
            }
            if let Some(until) = inner.cooling_until(name, &target, now) {
                return Err(LeaseError::ProxyCoolingDown { proxy: name.clone(), until });
            }
            let name = name.clone();
            return Ok(inner.grant(self, &name, &target, ttl, now));
        }

        let usable = |inner: &Inner, id: &str| {
            inner.proxies.get(id).is_some_and(|proxy| proxy.eligible() && request.selector.matches(&proxy.info.labels))
                && inner.cooling_until(id, &target, now).is_none()
        };
        let session_key = request.session.as_ref().map(|session| (session.clone(), target.clone()));
        let sticky = session_key
            .as_ref()
            .and_then(|key| inner.sessions.get(key))
            .map(|(proxy, _)| proxy.clone())
            .filter(|proxy| usable(&inner, proxy));
        let chosen = sticky
            .or_else(|| inner.available.iter().find(|(_, _, id)| usable(&inner, id)).map(|(_, _, id)| id.clone()));
        let Some(proxy) = chosen else { return Err(explain_refusal(&inner, request, &target, now)) };
        let lease = inner.grant(self, &proxy, &target, ttl, now);
        if let Some(key) = session_key {
            let forget_at = lease.expires_at + self.config.max_ttl;
            if let Some((_, previous)) = inner.sessions.insert(key.clone(), (proxy, forget_at)) {
                inner.session_expiries.remove(&(previous, key.0.clone(), key.1.clone()));
            }
            inner.session_expiries.insert((forget_at, key.0, key.1));
        }
        Ok(lease)
    }

    fn renew(&self, id: &str, ttl: Option<Duration>, now: SystemTime) -> Result<Lease, LeaseError> {
        let ttl = self.ttl(ttl);
        let mut inner = self.lock();
        inner.expire(now);
        if inner.revoked.contains_key(id) {
            return Err(LeaseError::Revoked(id.to_owned()));
        }
        let Some(lease) = inner.leases.get_mut(id) else { return Err(LeaseError::UnknownLease(id.to_owned())) };
        let previous = lease.expires_at;
        lease.expires_at = now + ttl;
        let renewed = Lease {
            id: id.to_owned(),
            proxy: lease.proxy.clone(),
            target: lease.target.clone(),
            expires_at: lease.expires_at,
        };
        inner.lease_expiries.remove(&(previous, id.to_owned()));
        inner.lease_expiries.insert((renewed.expires_at, id.to_owned()));
        Ok(renewed)
    }

    fn release(&self, id: &str, now: SystemTime) -> Result<(), LeaseError> {
        let mut inner = self.lock();
        inner.expire(now);
        if inner.free(id).is_some() {
            return Ok(());
        }
        // A revoked lease's slot was freed when it was revoked; releasing it is accepted and forgets it.
        if let Some((_, _, at)) = inner.revoked.remove(id) {
            inner.revoked_expiries.remove(&(at, id.to_owned()));
            return Ok(());
        }
        Err(LeaseError::UnknownLease(id.to_owned()))
    }

    fn report(
        &self,
        id: &str,
        outcome: Outcome,
        release: bool,
        now: SystemTime,
    ) -> Result<Option<SystemTime>, LeaseError> {
        let mut inner = self.lock();
        inner.expire(now);
        let (proxy, target) = match (inner.leases.get(id), inner.revoked.get(id)) {
            (Some(lease), _) => (lease.proxy.clone(), lease.target.clone()),
            (None, Some((proxy, target, _))) => (proxy.clone(), target.clone()),
            (None, None) => return Err(LeaseError::UnknownLease(id.to_owned())),
        };
        let key = (proxy.clone(), target.clone());
        let until = match outcome {
            Outcome::Ok => {
                if let Some(cooldown) = inner.cooldowns.get_mut(&key) {
                    cooldown.streak = 0;
                }
                None
            }
            Outcome::Failed => None,
            Outcome::Banned => {
                let streak = inner.cooldowns.get(&key).map_or(0, |cooldown| cooldown.streak).saturating_add(1);
                let until = now + self.cooldown_for(streak);
                // The streak is remembered for one more cooldown length after this one ends, so a ban soon after
                // counts as "in a row"; then the entry is dropped and memory follows live cooldowns.
                let forget_at = until + self.cooldown_for(streak.saturating_add(1));
                inner.sequence += 1;
                let started = inner.sequence;
                if let Some(previous) =
                    inner.cooldowns.insert(key.clone(), CooldownState { until, streak, forget_at, started })
                {
                    inner.cooldown_expiries.remove(&(previous.forget_at, proxy.clone(), target.clone()));
                }
                inner.cooldown_expiries.insert((forget_at, proxy, target));
                while inner.cooldowns.len() > self.config.max_cooldowns {
                    let Some((at, proxy, target)) = inner.cooldown_expiries.pop_first() else { break };
                    let key = (proxy, target);
                    if inner.cooldowns.get(&key).is_some_and(|cooldown| cooldown.forget_at == at) {
                        inner.cooldowns.remove(&key);
                    }
                }
                Some(until)
            }
        };
        if release
            && inner.free(id).is_none()
            && let Some((_, _, at)) = inner.revoked.remove(id)
        {
            inner.revoked_expiries.remove(&(at, id.to_owned()));
        }
        Ok(until)
    }

    fn expire(&self, now: SystemTime) -> usize {
        self.lock().expire(now)
    }

    fn cooldowns(&self, target: Option<&str>, now: SystemTime) -> Result<Vec<Cooldown>, LeaseError> {
        let target = target.map(|target| normalize(target, self.config.target_mode)).transpose()?;
        let mut inner = self.lock();
        inner.expire(now);
        let mut live: Vec<Cooldown> = inner
            .cooldowns
            .iter()
            .filter(|((_, cooled), cooldown)| {
                cooldown.until > now && target.as_ref().is_none_or(|target| target == cooled)
            })
            .map(|((proxy, target), cooldown)| Cooldown {
                proxy: proxy.clone(),
                target: target.clone(),
                until: cooldown.until,
                streak: cooldown.streak,
            })
            .collect();
        live.sort_by(|a, b| (a.until, &a.proxy, &a.target).cmp(&(b.until, &b.proxy, &b.target)));
        Ok(live)
    }

    fn loads(&self, target: Option<&str>, now: SystemTime) -> Result<Vec<ProxyLoad>, LeaseError> {
        let target = target.map(|target| normalize(target, self.config.target_mode)).transpose()?;
        let mut inner = self.lock();
        inner.expire(now);
        let mut loads: Vec<ProxyLoad> = inner
            .proxies
            .values()
            .map(|proxy| ProxyLoad {
                id: proxy.info.id.clone(),
                active_leases: proxy.active,
                max_leases: proxy.info.max_leases,
                cooling_down_until: target.as_ref().and_then(|target| inner.cooling_until(&proxy.info.id, target, now)),
            })
            .collect();
        loads.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(loads)
    }

    fn loads_of(
        &self,
        ids: &[&str],
        target: Option<&str>,
        now: SystemTime,
    ) -> Result<Vec<Option<ProxyLoad>>, LeaseError> {
        let target = target.map(|target| normalize(target, self.config.target_mode)).transpose()?;
        let mut inner = self.lock();
        inner.expire(now);
        Ok(ids
            .iter()
            .map(|id| {
                let proxy = inner.proxies.get(*id)?;
                Some(ProxyLoad {
                    id: proxy.info.id.clone(),
                    active_leases: proxy.active,
                    max_leases: proxy.info.max_leases,
                    cooling_down_until: target.as_ref().and_then(|target| inner.cooling_until(id, target, now)),
                })
            })
            .collect())
    }

    fn active_leases(&self) -> usize {
        self.lock().leases.len()
    }
}

/// Why no proxy was eligible. Only reached on refusal, so it may look at every proxy.
fn explain_refusal(inner: &Inner, request: &LeaseRequest, target: &str, now: SystemTime) -> LeaseError {
    let matching: Vec<&ProxyState> = inner
        .proxies
        .values()
        .filter(|proxy| proxy.info.healthy && proxy.info.max_leases > 0 && request.selector.matches(&proxy.info.labels))
        .collect();
    if matching.is_empty() {
        return LeaseError::NoneHealthy;
    }
    let cooling: Vec<SystemTime> = matching
        .iter()
        .filter(|proxy| proxy.active < proxy.info.max_leases)
        .filter_map(|proxy| inner.cooling_until(&proxy.info.id, target, now))
        .collect();
    if let Some(until) = cooling.iter().min() {
        return LeaseError::AllCoolingDown { until: *until };
    }
    let retry_at = matching
        .iter()
        .flat_map(|proxy| proxy.leases.iter())
        .filter_map(|id| inner.leases.get(id).map(|lease| lease.expires_at))
        .min();
    LeaseError::AllAtCapacity { retry_at }
}

#[cfg(test)]
mod tests;
