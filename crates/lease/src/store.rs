//! The in-memory lease store.
//!
//! Everything lives under one mutex; each operation is a handful of map and ordered-set updates. Eligible proxies
//! (healthy, cap above zero, below the cap) are kept in a `BTreeSet` ordered by (active leases, last leased), so a
//! lease takes the first entry that matches the selector and is not cooling down for the target, without looking
//! at the rest. Expiries of leases, cooldowns, revocations and sessions sit in ordered sets too, so expiring is
//! proportional to what expires and memory stays bounded by what is live.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use egress_fleet::ProxyId;

mod invariants;
mod refusal;
mod state;

use refusal::explain_refusal;
pub use state::session_weight;
use state::{EndedLease, Granted, Inner, ProxyState, rendezvous, session_key};

use crate::id::{Claims, LeaseKey};
use crate::{
    Cooldown, EndedLeaseRecord, EndedSessions, Lease, LeaseConfig, LeaseError, LeaseRequest, LeaseStore,
    LiveLeaseRecord, Outcome, Outcomes, ProxyInfo, ProxyLoad, Renewed, Report, Reported, normalize,
};

/// An internal inconsistency found by [`InMemoryLeaseStore::check_invariants`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("lease store invariant violated: {0}")]
pub struct InvariantViolation(pub String);

/// The in-memory [`LeaseStore`].
pub struct InMemoryLeaseStore {
    config: LeaseConfig,
    inner: Mutex<Inner>,
    /// Signs and verifies lease IDs.
    key: LeaseKey,
    /// A random start for serials, so two stores (an old leader's and a new one's) do not issue the same one.
    serial_base: u64,
}

impl InMemoryLeaseStore {
    /// An empty store with a key of its own: its lease IDs are not adoptable by any other store.
    pub fn new(config: LeaseConfig) -> Self {
        Self::with_key(config, LeaseKey::ephemeral())
    }

    /// An empty store signing with `key`: another store with the same key adopts the leases this one granted
    /// (after a restart or a change of leader), and this one adopts theirs.
    pub fn with_key(config: LeaseConfig, key: LeaseKey) -> Self {
        let random = LeaseKey::generate_bytes();
        let serial_base = u64::from_be_bytes(random[..8].try_into().expect("eight bytes"));
        Self { config, inner: Mutex::new(Inner::default()), key, serial_base }
    }

    /// The slot a session's leases for `target` share on a proxy: every lease of one owner's session for one site
    /// counts once toward the proxy's cap, so a session that two gateway replicas each lease for is one user of it.
    /// A digest keyed with the lease key: the same in every store that shares the key (a new leader restores the
    /// slots from the previous one's record), and a record that names no session or site.
    fn slot(&self, session_key: &str, target: &str) -> u64 {
        self.key.digest(&[b"slot", session_key.as_bytes(), target.as_bytes()])
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The lease `granted` describes, with its ID signed for `owner`. Called after the lock is let go: signing is
    /// the costliest step of a lease and needs none of the state.
    fn sign(&self, granted: Granted, owner: &str) -> Lease {
        let Granted { serial, proxy, target, expires_at, endpoint } = granted;
        let claims = Claims { serial, expires_at, proxy, target };
        let id = self.key.sign(&claims, owner);
        Lease { id, proxy: claims.proxy, target: claims.target, expires_at, endpoint, session_until: None }
    }

    /// The serial of the lease `id` names (`claims`, which it verified with for its owner), adopting it when it is
    /// valid but unknown here. `Err` for an expired one, and one whose proxy is gone or unhealthy (revoked).
    fn resolve(
        &self,
        inner: &mut Inner,
        id: &str,
        claims: Claims,
        owner: &str,
        now: SystemTime,
    ) -> Result<u64, LeaseError> {
        let unknown = || LeaseError::UnknownLease(id.to_owned());
        if let Some(lease) = inner.leases.get_mut(&claims.serial) {
            if lease.unconfirmed {
                // Restored from a previous leader's record, which leaves the target out: the ID names it.
                lease.unconfirmed = false;
                lease.target = claims.target;
                // Its session's proxy, restored with it, learns the target too (an owner ending the session by
                // name finds it by the target).
                if let Some(sticky) = lease.slot.and_then(|slot| inner.sessions.get_mut(&slot))
                    && sticky.target.is_empty()
                {
                    sticky.target.clone_from(&lease.target);
                }
            }
            return Ok(claims.serial);
        }
        match inner.ended.get(&claims.serial) {
            Some(ended) if ended.released => return Err(unknown()),
            Some(_) => return Err(LeaseError::Revoked(id.to_owned())),
            None => {}
        }
        if claims.expires_at <= now {
            return Err(unknown());
        }
        let Some(proxy) = inner.proxies.get(&claims.proxy).filter(|proxy| proxy.info.healthy) else {
            return Err(LeaseError::Revoked(id.to_owned()));
        };
        // Taking it over must not take its proxy above the cap (the new leader may have filled it meanwhile). A
        // lease shown is surely held; one only on the previous leader's record may have been released since, so
        // the shown one takes the slot that only unconfirmed leases hold and that ends first, freeing all of them
        // (each one, if it is held after all, is taken over again when shown, while there is room).
        if proxy.active >= proxy.info.max_leases {
            // Each slot: when its last lease ends, its leases, and whether none of them was shown.
            let mut slots: HashMap<Result<u64, u64>, (SystemTime, Vec<u64>, bool)> = HashMap::new();
            for serial in &proxy.leases {
                let Some(lease) = inner.leases.get(serial) else { continue };
                let (ends, serials, unconfirmed) =
                    slots.entry(lease.slot.ok_or(*serial)).or_insert((lease.expires_at, Vec::new(), true));
                *ends = (*ends).max(lease.expires_at);
                serials.push(*serial);
                *unconfirmed &= lease.unconfirmed;
            }
            let making_room = slots.into_values().filter(|slot| slot.2).min_by_key(|slot| slot.0);
            let Some((_, serials, _)) = making_room else { return Err(LeaseError::NotAdopted(id.to_owned())) };
            for serial in serials {
                inner.free(serial);
            }
        }
        inner.adopted += 1;
        let serial = claims.serial;
        inner.adopt(serial, claims.proxy, Some(claims.target), owner.to_owned(), None, claims.expires_at, now);
        Ok(serial)
    }

    fn ttl(&self, requested: Option<Duration>) -> Duration {
        requested.unwrap_or(self.config.default_ttl).clamp(Duration::from_secs(1), self.config.max_ttl)
    }

    /// The cooldown of `proxy` after the `streak`-th ban in a row, by its own policy or the store's.
    fn cooldown_for(&self, inner: &Inner, proxy: &ProxyId, streak: u32) -> Duration {
        let policy = inner.proxies.get(proxy).and_then(|state| state.info.cooldown).unwrap_or(self.config.cooldown);
        policy.after(streak)
    }

    /// Counts of live entries, for memory-bound tests: (leases, cooldowns, sessions, revoked, outcome counters).
    pub fn sizes(&self) -> (usize, usize, usize, usize, usize) {
        let inner = self.lock();
        (inner.leases.len(), inner.cooldowns.len(), inner.sessions.len(), inner.ended.len(), inner.outcomes.len())
    }
}

impl LeaseStore for InMemoryLeaseStore {
    fn upsert_proxy(&self, proxy: ProxyInfo) {
        let mut inner = self.lock();
        let id = proxy.id.clone();
        let before = inner.proxies.get(&id).and_then(|state| state.info.egress_ip.clone());
        if before != proxy.egress_ip {
            inner.unindex_egress(&id, before.as_deref());
            if let Some(ip) = &proxy.egress_ip {
                inner.by_egress.entry(ip.clone()).or_default().insert(id.clone());
            }
        }
        let healthy = proxy.healthy;
        let cap = proxy.max_leases;
        let lowered = match inner.proxies.get(&id) {
            Some(state) => {
                let lowered = cap < state.info.max_leases;
                inner.reindex(&id, |state| state.info = proxy);
                lowered
            }
            None => {
                let state = ProxyState::new(proxy);
                if state.eligible() {
                    inner.available.insert(state.key());
                }
                inner.proxies.insert(id.clone(), state);
                false
            }
        };
        if !healthy {
            inner.revoke_all(&id);
        } else if lowered {
            // A lowered cap (maxLeases 0 drains) revokes the newest leases above it. Adopted leases above an
            // unchanged cap stay: they were granted before a takeover and end by release or expiry.
            inner.revoke_above(&id, cap);
        }
    }

    fn remove_proxy(&self, id: &ProxyId) {
        let mut inner = self.lock();
        inner.revoke_all(id);
        if let Some(state) = inner.proxies.remove(id) {
            inner.available.remove(&state.key());
            inner.unindex_egress(id, state.info.egress_ip.as_deref());
        }
    }

    fn lease(&self, request: &LeaseRequest, now: SystemTime) -> Result<Lease, LeaseError> {
        let target = normalize(&request.target, self.config.target_mode)?;
        let ttl = self.ttl(request.ttl);
        let owner = request.owner.as_str();
        let mut inner = self.lock();
        inner.expire(now);
        if let Some(limit) = request.owner_quota {
            let held = inner.owners.get(owner);
            if held.is_some_and(|held| held.len() >= limit as usize) {
                let retry_at = held
                    .into_iter()
                    .flatten()
                    .filter_map(|serial| inner.leases.get(serial).map(|lease| lease.expires_at))
                    .min();
                return Err(LeaseError::QuotaExceeded { limit, retry_at });
            }
        }

        // A session's leases for one site share one slot on their proxy.
        let session_key = request.session.as_ref().map(|session| (session_key(owner, session), target.clone()));
        let slot = session_key.as_ref().map(|(session, target)| self.slot(session, target));
        if let Some(name) = &request.proxy {
            let Some(proxy) = inner.proxies.get(name) else { return Err(LeaseError::UnknownProxy(name.clone())) };
            let unavailable = |why| Err(LeaseError::ProxyUnavailable { proxy: name.clone(), why });
            if !request.selector.matches(&proxy.info.labels) {
                return unavailable("it does not match the selector");
            }
            if !request.admits(&proxy.info) {
                return unavailable("it is not a member of the pool asked for");
            }
            if !proxy.info.healthy {
                return unavailable("it is unhealthy");
            }
            if proxy.info.max_leases == 0 {
                return unavailable("it is drained (maxLeases 0)");
            }
            if !proxy.admits_slot(slot) {
                return unavailable("it is at its lease cap");
            }
            if let Some(until) = inner.cooling_until(name, &target, now) {
                return Err(LeaseError::ProxyCoolingDown { proxy: name.clone(), until });
            }
            if let Some(until) = inner.paced_until(name, &target, now) {
                return Err(LeaseError::Paced { until, proxy: Some(name.clone()) });
            }
            let name = name.clone();
            let granted = inner.grant(self, &name, &target, owner, slot, ttl, now);
            inner.pace(&name, &target, now);
            drop(inner);
            return Ok(self.sign(granted, owner));
        }

        // Usable but for its pace; and usable now.
        let unpaced = |inner: &Inner, id: &ProxyId| {
            inner.proxies.get(id).is_some_and(|proxy| proxy.admits_slot(slot) && request.admits(&proxy.info))
                && inner.cooling_until(id, &target, now).is_none()
        };
        let usable = |inner: &Inner, id: &ProxyId| unpaced(inner, id) && inner.paced_until(id, &target, now).is_none();
        // A session past its lifetime moves on: its proxy is chosen afresh, another one while any can take it.
        let (sticky, lapsed) = match slot.and_then(|slot| inner.sessions.get(&slot)) {
            Some(sticky) if request.session_limits.lapsed(sticky.since, sticky.leases, now) => {
                (None, Some(sticky.proxy.clone()))
            }
            // A session waits for its own proxy's next slot rather than move.
            Some(sticky) if unpaced(&inner, &sticky.proxy) => {
                if let Some(until) = inner.paced_until(&sticky.proxy, &target, now) {
                    return Err(LeaseError::Paced { until, proxy: Some(sticky.proxy.clone()) });
                }
                (Some(sticky.proxy.clone()), None)
            }
            Some(_) => (None, None),
            None => (None, None),
        };
        let choose = |inner: &Inner, avoid: Option<&ProxyId>| {
            let usable = |id: &ProxyId| Some(id) != avoid && usable(inner, id);
            match &session_key {
                // A session's first proxy is the same on every replica, so a change of leader (which forgets the
                // sessions) gives it the one it had while the same proxies are eligible.
                Some((key, target)) => inner
                    .available
                    .iter()
                    .filter(|(_, _, id)| usable(id))
                    .max_by_key(|(_, _, id)| rendezvous(key, target, id))
                    .map(|(_, _, id)| id.clone()),
                None => inner.available.iter().find(|(_, _, id)| usable(id)).map(|(_, _, id)| id.clone()),
            }
        };
        let chosen = sticky
            .or_else(|| choose(&inner, lapsed.as_ref()))
            .or_else(|| lapsed.as_ref().and_then(|_| choose(&inner, None)));
        let Some(proxy) = chosen else { return Err(explain_refusal(&inner, request, &target, now)) };
        let granted = inner.grant(self, &proxy, &target, owner, slot, ttl, now);
        inner.pace(&proxy, &target, now);
        if let Some(slot) = slot {
            if lapsed.is_some() {
                // Even when it stays on the same proxy (no other could take it), its lifetime starts over.
                inner.sessions.remove(&slot);
            }
            let forget_at = granted.expires_at + self.config.max_ttl;
            inner.stick(slot, proxy, forget_at, owner, &target, now);
        }
        let session_until = slot
            .and_then(|slot| inner.sessions.get(&slot))
            .and_then(|sticky| request.session_limits.max_age.map(|age| sticky.since + age));
        drop(inner);
        Ok(Lease { session_until, ..self.sign(granted, owner) })
    }

    fn renew(&self, id: &str, owner: &str, ttl: Option<Duration>, now: SystemTime) -> Result<Renewed, LeaseError> {
        let ttl = self.ttl(ttl);
        let claims = self.key.verify(id, owner).ok_or_else(|| LeaseError::UnknownLease(id.to_owned()))?;
        let mut inner = self.lock();
        inner.expire(now);
        let serial = self.resolve(&mut inner, id, claims, owner, now)?;
        let endpoint = inner
            .leases
            .get(&serial)
            .and_then(|lease| inner.proxies.get(&lease.proxy))
            .map(|proxy| proxy.info.endpoint.clone())
            .unwrap_or_default();
        let lease = inner.leases.get_mut(&serial).expect("resolved leases are live");
        let previous = lease.expires_at;
        lease.expires_at = whole_seconds(now + ttl);
        // The holder is told the proxy's current endpoint: from now on its lease no longer keeps the old one.
        let moved_from = (lease.endpoint != endpoint).then(|| std::mem::replace(&mut lease.endpoint, endpoint));
        let granted = Granted {
            serial,
            proxy: lease.proxy.clone(),
            target: lease.target.clone(),
            expires_at: lease.expires_at,
            endpoint: lease.endpoint.clone(),
        };
        inner.lease_expiries.remove(&(previous, serial));
        inner.lease_expiries.insert((granted.expires_at, serial));
        inner.live_generation += 1;
        drop(inner);
        Ok(Renewed { lease: self.sign(granted, owner), moved_from })
    }

    fn release(&self, id: &str, owner: &str, now: SystemTime) -> Result<(), LeaseError> {
        let Some(claims) = self.key.verify(id, owner) else { return Err(LeaseError::UnknownLease(id.to_owned())) };
        let mut inner = self.lock();
        inner.expire(now);
        if inner.release_live(claims.serial) {
            return Ok(());
        }
        // A lease that already ended (revoked, or released before) is accepted again and stays refused.
        if inner.mark_released(claims.serial) {
            return Ok(());
        }
        // A valid lease this store never saw (granted before a takeover): nothing to free, but none of its IDs
        // may be adopted from now on. Another ID of it may carry a later expiry, at most the longest TTL away.
        if claims.expires_at > now {
            inner.end(
                claims.serial,
                EndedLease { until: now + self.config.max_ttl, released: true, granted_at: now, reported: 0 },
            );
            return Ok(());
        }
        Err(LeaseError::UnknownLease(id.to_owned()))
    }

    fn report(&self, id: &str, owner: &str, report: &Report, now: SystemTime) -> Result<Reported, LeaseError> {
        let unknown = || LeaseError::UnknownLease(id.to_owned());
        let claims = self.key.verify(id, owner).ok_or_else(unknown)?;
        let mut inner = self.lock();
        inner.expire(now);
        let serial = claims.serial;
        // A report on a lease that ended (released, or revoked) still counts, against the proxy it was on: the
        // answer it reports was on its way when the lease ended. It never brings the lease back.
        if !inner.ended.contains_key(&serial) {
            match self.resolve(&mut inner, id, claims.clone(), owner, now) {
                Ok(_) => {}
                Err(LeaseError::Revoked(_)) => {
                    // Revoked before this store knew it (its proxy is gone or unhealthy): remembered as such.
                    inner.end(
                        serial,
                        EndedLease { until: claims.expires_at, released: false, granted_at: now, reported: 0 },
                    );
                }
                Err(error) => return Err(error),
            }
        }
        // An ended lease's proxy and target are its ID's (verified) claims.
        let (proxy, target, granted_at, reported) = match (inner.leases.get(&serial), inner.ended.get(&serial)) {
            (Some(lease), _) => (lease.proxy.clone(), lease.target.clone(), lease.granted_at, lease.reported),
            (None, Some(ended)) => (claims.proxy.clone(), claims.target.clone(), ended.granted_at, ended.reported),
            (None, None) => return Err(unknown()),
        };
        // What one lease's reports may count is bounded by what it could have sent: a burst, then a rate over its
        // age. The outcome itself always counts; counts beyond the bound are dropped.
        let age = now.duration_since(granted_at).unwrap_or_default().as_secs();
        let mut budget = self
            .config
            .reported_burst
            .saturating_add(self.config.reported_per_second.saturating_mul(age))
            .saturating_sub(reported);
        let mut take = |asked: u32| {
            let taken = u64::from(asked).min(budget);
            budget -= taken;
            taken
        };
        let key = (proxy.clone(), target.clone());
        let mut counted = Outcomes::default();
        if report.outcome.is_some() {
            take(1);
        }
        counted.ok = take(report.ok);
        counted.failed = take(report.failed);
        // A served request means the site does not block this proxy now: the ban streak starts over (before a ban
        // in the same report, which then counts as the first in a row).
        if (report.ok > 0 || report.outcome == Some(Outcome::Ok))
            && let Some(cooldown) = inner.cooldowns.get_mut(&key)
        {
            cooldown.streak = 0;
        }
        // A cooldown already running is changed only by an owner whose report has not counted in it yet: one
        // client reporting again and again never lengthens it nor raises the streak.
        let running = inner.cooldowns.get(&key).filter(|cooldown| cooldown.until > now);
        let reported_before = |ban: bool| {
            running
                .is_some_and(|cooldown| cooldown.reporters.iter().any(|(who, banned)| who == owner && *banned >= ban))
        };
        let (banned_already, throttled_already) = (reported_before(true), reported_before(false));
        let running_until = running.map(|cooldown| cooldown.until);
        let mut changed = false;
        let cooldown_until = match report.outcome {
            None => None,
            Some(Outcome::Ok) => {
                counted.ok += 1;
                None
            }
            Some(Outcome::Failed) => {
                counted.failed += 1;
                None
            }
            Some(Outcome::Banned) if banned_already => {
                counted.banned += 1;
                running_until
            }
            Some(Outcome::Banned) => {
                counted.banned += 1;
                let streak = inner.cooldowns.get(&key).map_or(0, |cooldown| cooldown.streak).saturating_add(1);
                let until = (now + self.cooldown_for(&inner, &proxy, streak)).max(running_until.unwrap_or(now));
                inner.set_cooldown(self, proxy.clone(), target.clone(), until, streak);
                inner.reported_by(&key, owner, true, running_until.is_some());
                changed = true;
                Some(until)
            }
            Some(Outcome::Throttled { .. }) if throttled_already => {
                counted.throttled += 1;
                running_until
            }
            Some(Outcome::Throttled { retry_after }) => {
                counted.throttled += 1;
                let wait = retry_after
                    .unwrap_or(self.config.throttle_default)
                    .clamp(Duration::from_secs(1), self.config.throttle_cap);
                // A throttle never shortens a cooldown already running, and leaves the ban streak as it is.
                let streak = inner.cooldowns.get(&key).map_or(0, |cooldown| cooldown.streak);
                let until = running_until.unwrap_or(now).max(now + wait);
                inner.set_cooldown(self, proxy.clone(), target.clone(), until, streak);
                inner.reported_by(&key, owner, false, running_until.is_some());
                changed = true;
                Some(until)
            }
        };
        let mut cooled = Vec::new();
        if changed && let Some(until) = cooldown_until {
            let streak = inner.cooldowns.get(&key).map_or(0, |cooldown| cooldown.streak);
            cooled.push(proxy.clone());
            let ban = report.outcome == Some(Outcome::Banned);
            cooled.extend(inner.share_cooldown(self, &proxy, &target, until, streak, (owner, ban), now));
        }
        let used = counted.total();
        match inner.leases.get_mut(&serial) {
            Some(lease) => lease.reported += used,
            None => {
                if let Some(ended) = inner.ended.get_mut(&serial) {
                    ended.reported += used;
                }
            }
        }
        inner.count(self, key, counted, now);
        if report.release && !inner.release_live(serial) {
            inner.mark_released(serial);
        }
        Ok(Reported { proxy, target, cooldown_until, cooled })
    }

    fn proxy_cooldowns(&self, proxy: &ProxyId, now: SystemTime) -> Vec<Cooldown> {
        let mut inner = self.lock();
        inner.expire(now);
        let mut cooldowns: Vec<Cooldown> = inner
            .cooldowns
            .iter()
            .filter(|((cooled, _), _)| cooled == proxy)
            .map(|((proxy, target), cooldown)| cooldown.shown(proxy, target))
            .collect();
        cooldowns.sort_by(|a, b| (b.until, &a.target).cmp(&(a.until, &b.target)));
        cooldowns
    }

    fn ended_leases(&self, limit: usize, now: SystemTime) -> (u64, Vec<EndedLeaseRecord>) {
        let mut inner = self.lock();
        inner.expire(now);
        let records = inner
            .ended_expiries
            .iter()
            .rev()
            .take(limit)
            .filter_map(|(until, serial)| {
                let ended = inner.ended.get(serial)?;
                Some(EndedLeaseRecord { serial: *serial, until: *until, released: ended.released })
            })
            .collect();
        (inner.ended_generation, records)
    }

    fn ended_generation(&self) -> u64 {
        self.lock().ended_generation
    }

    fn restore_ended(&self, records: &[EndedLeaseRecord], now: SystemTime) -> usize {
        let mut inner = self.lock();
        inner.expire(now);
        let mut restored = 0;
        for record in records {
            // A lease live here (adopted since) or already known to have ended keeps what this store knows.
            if record.until <= now || inner.knows(record.serial) {
                continue;
            }
            inner.end(
                record.serial,
                EndedLease { until: record.until, released: record.released, granted_at: now, reported: 0 },
            );
            restored += 1;
        }
        restored
    }

    fn live_leases(&self, limit: usize, now: SystemTime) -> (u64, Vec<LiveLeaseRecord>) {
        let mut inner = self.lock();
        inner.expire(now);
        let records = inner
            .lease_expiries
            .iter()
            .rev()
            .take(limit)
            .filter_map(|(until, serial)| {
                let lease = inner.leases.get(serial)?;
                Some(LiveLeaseRecord {
                    serial: *serial,
                    proxy: lease.proxy.clone(),
                    owner: lease.owner.clone(),
                    slot: lease.slot,
                    until: *until,
                })
            })
            .collect();
        (inner.live_generation, records)
    }

    fn live_generation(&self) -> u64 {
        self.lock().live_generation
    }

    fn restore_live(&self, records: &[LiveLeaseRecord], now: SystemTime) -> usize {
        let mut inner = self.lock();
        inner.expire(now);
        let mut restored = 0;
        for record in records {
            // A session's lease shares the slot the session holds on the proxy already, as it did before.
            let room = inner.proxies.get(&record.proxy).is_some_and(|proxy| proxy.admits_slot(record.slot));
            if record.until <= now || !room || inner.knows(record.serial) {
                continue;
            }
            let (proxy, owner) = (record.proxy.clone(), record.owner.clone());
            inner.adopt(record.serial, proxy, None, owner, record.slot, record.until, now);
            // The session stays on its proxy, as it did with the previous leader (its target unknown, "", until a
            // lease of it is shown).
            if let Some(slot) = record.slot {
                inner.stick(slot, record.proxy.clone(), record.until + self.config.max_ttl, &record.owner, "", now);
            }
            restored += 1;
        }
        restored
    }

    fn restore_cooldowns(&self, cooldowns: &[Cooldown], now: SystemTime) -> usize {
        let mut inner = self.lock();
        inner.expire(now);
        let mut restored = 0;
        for cooldown in cooldowns {
            let Ok(target) = normalize(&cooldown.target, self.config.target_mode) else { continue };
            let known = inner.cooldowns.get(&(cooldown.proxy.clone(), target.clone()));
            // The newest word wins: what this store saw itself is never rolled back by an older record of it, and a
            // cooldown an administrator cleared does not come back from a record written before.
            if known.is_some_and(|known| {
                known.until >= cooldown.until || known.cleared_until.is_some_and(|cleared| cleared >= cooldown.until)
            }) {
                continue;
            }
            let forget_at =
                cooldown.until + self.cooldown_for(&inner, &cooldown.proxy, cooldown.streak.saturating_add(1));
            if forget_at <= now {
                continue;
            }
            let key = (cooldown.proxy.clone(), target.clone());
            inner.set_cooldown(self, cooldown.proxy.clone(), target, cooldown.until, cooldown.streak);
            // Who made it, as the record says: their further reports change nothing while it runs.
            for reporter in &cooldown.reporters {
                inner.reported_by(&key, reporter, true, true);
            }
            restored += 1;
        }
        restored
    }

    fn end_sessions(&self, owner: &str, session: Option<&str>, now: SystemTime) -> EndedSessions {
        let mut inner = self.lock();
        inner.expire(now);
        let key = session.map(|session| session_key(owner, session));
        let (sessions, leases) =
            inner.end_sessions(owner, |slot, target| key.as_deref().is_none_or(|key| self.slot(key, target) == slot));
        EndedSessions { sessions, leases }
    }

    fn clear_cooldowns(
        &self,
        target: &str,
        proxy: Option<&ProxyId>,
        now: SystemTime,
    ) -> Result<Vec<Cooldown>, LeaseError> {
        let target = normalize(target, self.config.target_mode)?;
        let mut inner = self.lock();
        inner.expire(now);
        let proxies: Vec<ProxyId> = match proxy {
            // The proxy's cooldown was shared with every proxy leaving through its address: so is the clearing.
            Some(proxy) => std::iter::once(proxy.to_owned()).chain(inner.siblings(proxy)).collect(),
            None => inner.cooldowns.keys().filter(|(_, cooled)| *cooled == target).map(|(id, _)| id.clone()).collect(),
        };
        let mut cleared = Vec::new();
        for id in proxies {
            let key = (id, target.clone());
            let Some(cooldown) = inner.cooldowns.get_mut(&key) else { continue };
            if cooldown.until > now {
                cleared.push(cooldown.shown(&key.0, &key.1));
            }
            // Ended now, the streak forgotten; remembered as cleared until it would have been forgotten.
            cooldown.cleared_until = cooldown.cleared_until.max(Some(cooldown.until));
            cooldown.until = cooldown.until.min(now);
            cooldown.streak = 0;
            cooldown.reporters.clear();
        }
        cleared.sort_by(|a, b| a.proxy.cmp(&b.proxy));
        Ok(cleared)
    }

    fn leases_on(&self, proxy: &ProxyId, endpoint: &str, now: SystemTime) -> usize {
        let mut inner = self.lock();
        inner.expire(now);
        let Some(state) = inner.proxies.get(proxy) else { return 0 };
        state
            .leases
            .iter()
            .filter(|serial| inner.leases.get(serial).is_some_and(|lease| lease.endpoint == endpoint))
            .count()
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
            .map(|((proxy, target), cooldown)| cooldown.shown(proxy, target))
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
                outcomes: target.as_ref().and_then(|target| inner.outcomes_of(&proxy.info.id, target)),
            })
            .collect();
        loads.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(loads)
    }

    fn loads_of(
        &self,
        ids: &[&ProxyId],
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
                    outcomes: target.as_ref().and_then(|target| inner.outcomes_of(id, target)),
                })
            })
            .collect())
    }

    fn active_leases(&self) -> usize {
        self.lock().leases.len()
    }

    fn held_by(&self, owner: &str, now: SystemTime) -> std::collections::BTreeSet<ProxyId> {
        let mut inner = self.lock();
        inner.expire(now);
        inner
            .owners
            .get(owner)
            .into_iter()
            .flatten()
            .filter_map(|serial| inner.leases.get(serial).map(|lease| lease.proxy.clone()))
            .collect()
    }

    fn leases_by_owner(&self) -> std::collections::BTreeMap<String, usize> {
        self.lock().owners.iter().map(|(owner, held)| (owner.clone(), held.len())).collect()
    }

    fn adopted(&self) -> u64 {
        self.lock().adopted
    }
}

/// `time` without its fraction of a second.
fn whole_seconds(time: SystemTime) -> SystemTime {
    let seconds = time.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |since| since.as_secs());
    SystemTime::UNIX_EPOCH + Duration::from_secs(seconds)
}

#[cfg(test)]
mod tests;
