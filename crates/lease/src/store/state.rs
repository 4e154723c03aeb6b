//! The store's state under its one mutex: proxies with their eligibility index, live and ended leases, cooldowns,
//! sessions and outcomes, each with its expiry set; and the operations on it that keep those indexes in step.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, SystemTime};

use egress_fleet::ProxyId;

use super::{InMemoryLeaseStore, whole_seconds};
use crate::{Cooldown, Outcomes, ProxyInfo};

/// A map keyed by what the store makes or an administrator names (serials, slots, proxies, tenants): foldhash,
/// seeded per process, at a fraction of SipHash's cost on the hot path. Keys a client chooses (sites) stay on SipHash.
pub(super) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
/// See [`FastMap`].
pub(super) type FastSet<K> = HashSet<K, foldhash::fast::RandomState>;

pub(super) struct ProxyState {
    pub(super) info: ProxyInfo,
    /// The slots its live leases take, the number its cap bounds: one per lease without a session, one per
    /// (session, target) however many leases share it.
    pub(super) active: u32,
    pub(super) last_leased: u64,
    /// Serials of its live leases.
    pub(super) leases: FastSet<u64>,
    /// The live leases sharing each session's slot, by [`InMemoryLeaseStore::slot`].
    pub(super) slots: FastMap<u64, u32>,
}

impl ProxyState {
    pub(super) fn new(info: ProxyInfo) -> Self {
        Self { info, active: 0, last_leased: 0, leases: FastSet::default(), slots: FastMap::default() }
    }
    /// Whether a lease in `slot` may be granted here: the proxy is eligible, or it is healthy and the session
    /// already holds a slot here (each gateway replica the session's requests reach holds a lease of its own, and
    /// they are one user of the proxy).
    pub(super) fn admits_slot(&self, slot: Option<u64>) -> bool {
        self.eligible() || (self.info.healthy && slot.is_some_and(|slot| self.slots.contains_key(&slot)))
    }
    pub(super) fn eligible(&self) -> bool {
        self.info.healthy && self.active < self.info.max_leases
    }
    /// Counts the live lease `serial`: a slot of its own, or a share of its session's `slot`.
    pub(super) fn hold(&mut self, serial: u64, slot: Option<u64>) {
        self.leases.insert(serial);
        let shared = slot.is_some_and(|slot| match self.slots.get_mut(&slot) {
            Some(sharing) => {
                *sharing += 1;
                true
            }
            None => {
                self.slots.insert(slot, 1);
                false
            }
        });
        if !shared {
            self.active += 1;
        }
    }
    /// Stops counting the lease `serial` ([`Self::hold`]): its slot is free once no other lease shares it.
    pub(super) fn let_go(&mut self, serial: u64, slot: Option<u64>) {
        self.leases.remove(&serial);
        let shared = slot.is_some_and(|slot| match self.slots.get_mut(&slot) {
            Some(sharing) if *sharing > 1 => {
                *sharing -= 1;
                true
            }
            _ => {
                self.slots.remove(&slot);
                false
            }
        });
        if !shared {
            self.active -= 1;
        }
    }
    pub(super) fn key(&self) -> (u32, u64, ProxyId) {
        (self.active, self.last_leased, self.info.id.clone())
    }
}

/// A lease just granted, before its ID is signed (outside the store's lock).
pub(super) struct Granted {
    pub(super) serial: u64,
    pub(super) proxy: ProxyId,
    pub(super) target: String,
    pub(super) expires_at: SystemTime,
    pub(super) endpoint: String,
}

pub(super) struct LeaseState {
    pub(super) proxy: ProxyId,
    pub(super) target: String,
    pub(super) expires_at: SystemTime,
    /// The order of grant (or adoption), so a lowered cap revokes the newest leases first.
    pub(super) sequence: u64,
    pub(super) granted_at: SystemTime,
    /// The proxy's endpoint the holder was last told, so a replaced instance is drained until its leases move.
    pub(super) endpoint: String,
    /// Taken over from an ID another store issued (after a restart or a change of leader): it may have been
    /// granted before a cooldown this store knows, and it may take its proxy above the cap.
    pub(super) adopted: bool,
    /// Restored from a previous leader's record and not shown by its holder since: it may have been released in
    /// that leader's last second, so a lease its holder does show may take its slot.
    pub(super) unconfirmed: bool,
    /// Requests its reports have counted so far (bounded by what the lease could have made).
    pub(super) reported: u64,
    /// Who holds it (the owner its IDs are bound to).
    pub(super) owner: String,
    /// The session's slot ([`slot_key`]) it shares with the session's other leases on the proxy; `None` for a
    /// lease without a session (or taken over from an ID, which does not name its session), which takes a slot
    /// of its own.
    pub(super) slot: Option<u64>,
}

/// A lease that ended before its last expiry: its IDs stay valid signatures until then, so the store remembers it
/// to refuse them (a released lease never comes back) and to still count a late report against its proxy. Its
/// proxy and target are not kept: every ID of the lease carries them, verified, and they never change (one record
/// per release, and a busy store releases tens of thousands a second, each remembered for up to a TTL).
pub(super) struct EndedLease {
    /// Its latest expiry; remembered until then.
    pub(super) until: SystemTime,
    /// Released by its holder (404 from now on) rather than revoked by the store (410).
    pub(super) released: bool,
    pub(super) granted_at: SystemTime,
    pub(super) reported: u64,
}

impl EndedLease {
    /// A live lease that ended now: released by its holder, or revoked.
    pub(super) fn of(lease: LeaseState, released: bool) -> Self {
        Self { until: lease.expires_at, released, granted_at: lease.granted_at, reported: lease.reported }
    }
}

pub(super) struct CooldownState {
    pub(super) until: SystemTime,
    pub(super) streak: u32,
    pub(super) forget_at: SystemTime,
    /// The store sequence when the ban was reported, to tell a cooldown that predates a lease from a later one.
    pub(super) started: u64,
    /// Who made the running cooldown (lease owners), and whether with a ban: one owner's further reports while
    /// it runs change nothing (a ban after only a throttle still counts), another owner's ban counts once.
    pub(super) reporters: Vec<(String, bool)>,
    /// The end of a cooldown an administrator cleared: an older record of it (in the journal) is not restored.
    pub(super) cleared_until: Option<SystemTime>,
}

impl CooldownState {
    /// The running cooldown of `proxy` for `target`, as the store's callers see it.
    pub(super) fn shown(&self, proxy: &ProxyId, target: &str) -> Cooldown {
        Cooldown {
            proxy: proxy.clone(),
            target: target.to_owned(),
            until: self.until,
            streak: self.streak,
            reporters: self.reporters.iter().map(|(who, _)| who.clone()).collect(),
        }
    }
}

/// A session's proxy for one target, kept after its leases end so its next lease goes there again.
pub(super) struct Sticky {
    pub(super) proxy: ProxyId,
    /// When it is forgotten.
    pub(super) forget_at: SystemTime,
    /// The session's owner and the target, so an owner can end its sessions (the slot, a digest, names neither).
    pub(super) owner: String,
    pub(super) target: String,
    /// When the session chose this proxy, and how many of its leases went to it since: its lifetime
    /// ([`crate::SessionLimits`]).
    pub(super) since: SystemTime,
    pub(super) leases: u32,
}

#[derive(Default)]
pub(super) struct Inner {
    pub(super) proxies: FastMap<ProxyId, ProxyState>,
    /// Eligible proxies by (active leases, last leased sequence, id).
    pub(super) available: BTreeSet<(u32, u64, ProxyId)>,
    /// Live leases by serial.
    pub(super) leases: FastMap<u64, LeaseState>,
    pub(super) lease_expiries: BTreeSet<(SystemTime, u64)>,
    /// Leases revoked or released before their expiry, kept until then.
    pub(super) ended: FastMap<u64, EndedLease>,
    pub(super) ended_expiries: BTreeSet<(SystemTime, u64)>,
    /// Changes whenever a lease ends (or an ended one turns from revoked to released), so a caller that keeps the
    /// ended leases elsewhere knows when to write them again.
    pub(super) ended_generation: u64,
    /// Changes whenever a lease is granted, taken over, renewed or freed, so a caller that keeps the live leases
    /// elsewhere knows when to write them again.
    pub(super) live_generation: u64,
    pub(super) cooldowns: HashMap<(ProxyId, String), CooldownState>,
    pub(super) cooldown_expiries: BTreeSet<(SystemTime, ProxyId, String)>,
    /// Sticky sessions by their slot ([`InMemoryLeaseStore::slot`] of owner, session and target).
    pub(super) sessions: FastMap<u64, Sticky>,
    pub(super) session_expiries: BTreeSet<(SystemTime, u64)>,
    /// Proxies by the egress IP they were last seen leaving through.
    pub(super) by_egress: HashMap<String, BTreeSet<ProxyId>>,
    /// The pace of each (egress address, or proxy without a known one; target) whose proxies are paced: its
    /// theoretical arrival time ([`crate::Pacing`]), forgotten once past.
    pub(super) paces: HashMap<(String, String), SystemTime>,
    pub(super) pace_expiries: BTreeSet<(SystemTime, String, String)>,
    /// What was reported per (proxy, target), and when each is forgotten.
    pub(super) outcomes: HashMap<(ProxyId, String), (Outcomes, SystemTime)>,
    pub(super) outcome_expiries: BTreeSet<(SystemTime, ProxyId, String)>,
    pub(super) sequence: u64,
    /// How many leases were taken over from IDs this store had not issued.
    pub(super) adopted: u64,
    /// Live leases by owner.
    pub(super) owners: FastMap<String, FastSet<u64>>,
}

/// The key of an owner's session: sessions of different owners never meet, whatever they are called.
pub(super) fn session_key(owner: &str, session: &str) -> String {
    format!("{owner}\n{session}")
}

/// A session's weight for a proxy (rendezvous hashing): the session's first proxy is the eligible one with the
/// highest weight, the same choice on every replica and after every restart while the same proxies are eligible,
/// and an even spread of sessions over them. SipHash with the standard library's fixed keys: the same in every
/// process of one build, which is what every replica runs.
pub(super) fn rendezvous(session: &str, target: &str, proxy: &ProxyId) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    (session, target, proxy.namespace(), proxy.name()).hash(&mut hasher);
    hasher.finish()
}

/// A session's weight for `proxy` (`owner`'s `session` for the normalised `target`): a session's first proxy is the
/// eligible one of highest weight, the same in every store of one build, so an adapter that shares the state picks it
/// the same way.
pub fn session_weight(owner: &str, session: &str, target: &str, proxy: &ProxyId) -> u64 {
    rendezvous(&session_key(owner, session), target, proxy)
}

/// How long a (proxy, target) pair's reported outcomes are kept after its last report.
pub(super) const OUTCOMES_KEPT: Duration = Duration::from_secs(3600);

impl Inner {
    pub(super) fn unindex_egress(&mut self, id: &ProxyId, ip: Option<&str>) {
        if let Some(ip) = ip
            && let Some(proxies) = self.by_egress.get_mut(ip)
        {
            proxies.remove(id);
            if proxies.is_empty() {
                self.by_egress.remove(ip);
            }
        }
    }

    /// The other proxies known to leave through the same egress IP as `proxy`.
    pub(super) fn siblings(&self, proxy: &ProxyId) -> Vec<ProxyId> {
        let Some(ip) = self.proxies.get(proxy).and_then(|state| state.info.egress_ip.as_ref()) else {
            return Vec::new();
        };
        self.by_egress
            .get(ip)
            .map_or_else(Vec::new, |proxies| proxies.iter().filter(|other| *other != proxy).cloned().collect())
    }

    /// Extends the cooldown of every sibling of `proxy` for `target` to at least `until` and `streak`: the site
    /// sees one address. `owner`'s report (a ban when `ban`) made it, on each of them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn share_cooldown(
        &mut self,
        store: &InMemoryLeaseStore,
        proxy: &ProxyId,
        target: &str,
        until: SystemTime,
        streak: u32,
        (owner, ban): (&str, bool),
        now: SystemTime,
    ) -> Vec<ProxyId> {
        let siblings = self.siblings(proxy);
        for sibling in &siblings {
            let key = (sibling.clone(), target.to_owned());
            let known = self.cooldowns.get(&key);
            let running = known.is_some_and(|cooldown| cooldown.until > now);
            let (known_until, known_streak) = known.map_or((until, 0), |cooldown| (cooldown.until, cooldown.streak));
            self.set_cooldown(
                store,
                sibling.clone(),
                target.to_owned(),
                known_until.max(until),
                known_streak.max(streak),
            );
            self.reported_by(&key, owner, ban, running);
        }
        siblings
    }

    pub(super) fn outcomes_of(&self, proxy: &ProxyId, target: &str) -> Option<Outcomes> {
        self.outcomes.get(&(proxy.to_owned(), target.to_owned())).map(|(outcomes, _)| *outcomes)
    }

    pub(super) fn cooling_until(&self, proxy: &ProxyId, target: &str, now: SystemTime) -> Option<SystemTime> {
        self.cooldowns
            .get(&(proxy.to_owned(), target.to_owned()))
            .map(|cooldown| cooldown.until)
            .filter(|until| *until > now)
    }

    /// When the next lease of `proxy` for `target` may go, when it is paced and that is later than `now`.
    pub(super) fn paced_until(&self, proxy: &ProxyId, target: &str, now: SystemTime) -> Option<SystemTime> {
        let state = self.proxies.get(proxy)?;
        let pacing = state.info.pacing?;
        let tat = self.paces.get(&(pace_key(&state.info), target.to_owned())).copied();
        pacing.next_slot(tat, now)
    }

    /// Counts a lease of `proxy` for `target` at `now` against its address's pace, when it is paced.
    pub(super) fn pace(&mut self, proxy: &ProxyId, target: &str, now: SystemTime) {
        let Some(state) = self.proxies.get(proxy) else { return };
        let Some(pacing) = state.info.pacing else { return };
        let key = (pace_key(&state.info), target.to_owned());
        let previous = self.paces.get(&key).copied();
        let tat = pacing.after_lease(previous, now);
        if let Some(previous) = previous {
            self.pace_expiries.remove(&(previous, key.0.clone(), key.1.clone()));
        }
        self.pace_expiries.insert((tat, key.0.clone(), key.1.clone()));
        self.paces.insert(key, tat);
    }

    pub(super) fn reindex(&mut self, id: &ProxyId, update: impl FnOnce(&mut ProxyState)) {
        let Some(proxy) = self.proxies.get_mut(id) else { return };
        self.available.remove(&proxy.key());
        update(proxy);
        if proxy.eligible() {
            self.available.insert(proxy.key());
        }
    }

    /// Keeps the session of `slot` (`owner`'s, for `target`) on `proxy` until `forget_at` (sticky), or until it is
    /// moved.
    /// Keeps `proxy` as the session's (slot's) until `forget_at`; a lease of the session on the proxy it already
    /// had counts toward its lifetime, one on another starts a new one at `now`.
    pub(super) fn stick(
        &mut self,
        slot: u64,
        proxy: ProxyId,
        forget_at: SystemTime,
        owner: &str,
        target: &str,
        now: SystemTime,
    ) {
        let (since, leases) = match self.sessions.get(&slot) {
            Some(sticky) if sticky.proxy == proxy => (sticky.since, sticky.leases.saturating_add(1)),
            _ => (now, 1),
        };
        let sticky = Sticky { proxy, forget_at, owner: owner.to_owned(), target: target.to_owned(), since, leases };
        if let Some(previous) = self.sessions.insert(slot, sticky) {
            self.session_expiries.remove(&(previous.forget_at, slot));
        }
        self.session_expiries.insert((forget_at, slot));
    }

    /// Ends `owner`'s sessions whose slot `ended` names (given the slot and the target): releases their live leases
    /// and forgets their proxies. Returns (sessions ended, leases released).
    pub(super) fn end_sessions(&mut self, owner: &str, ended: impl Fn(u64, &str) -> bool) -> (usize, usize) {
        // A lease restored from a previous leader's record does not know its target until its holder shows it, but
        // its session's sticky entry does.
        let mut slots: HashSet<u64> = self
            .sessions
            .iter()
            .filter(|(slot, sticky)| sticky.owner == owner && ended(**slot, &sticky.target))
            .map(|(slot, _)| *slot)
            .collect();
        let serials: Vec<u64> = self.owners.get(owner).map(|held| held.iter().copied().collect()).unwrap_or_default();
        let mut released = 0;
        for serial in serials {
            let Some(lease) = self.leases.get(&serial) else { continue };
            let Some(slot) = lease.slot.filter(|slot| slots.contains(slot) || ended(*slot, &lease.target)) else {
                continue;
            };
            if self.release_live(serial) {
                slots.insert(slot);
                released += 1;
            }
        }
        for slot in &slots {
            if let Some(sticky) = self.sessions.remove(slot) {
                self.session_expiries.remove(&(sticky.forget_at, *slot));
            }
        }
        (slots.len(), released)
    }

    /// Counts the lease `serial` (unknown here, its proxy known, healthy and with room) against its proxy, as held
    /// by `owner` until `expires_at`, in its session's `slot` when it had one: taken over from another store, when
    /// its holder showed it (`target` from its ID, which does not name the session) or from the previous leader's
    /// record (`None`: unconfirmed until shown; the record keeps the slot).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn adopt(
        &mut self,
        serial: u64,
        proxy: ProxyId,
        target: Option<String>,
        owner: String,
        slot: Option<u64>,
        expires_at: SystemTime,
        now: SystemTime,
    ) {
        let endpoint = self.proxies.get(&proxy).map(|state| state.info.endpoint.clone()).unwrap_or_default();
        self.sequence += 1;
        self.live_generation += 1;
        let sequence = self.sequence;
        self.reindex(&proxy, |state| state.hold(serial, slot));
        self.lease_expiries.insert((expires_at, serial));
        self.owners.entry(owner.clone()).or_default().insert(serial);
        let unconfirmed = target.is_none();
        let lease = LeaseState {
            proxy,
            target: target.unwrap_or_default(),
            expires_at,
            sequence,
            granted_at: now,
            endpoint,
            adopted: true,
            unconfirmed,
            reported: 0,
            owner,
            slot,
        };
        self.leases.insert(serial, lease);
    }

    /// Whether the lease `serial` is live here or known to have ended.
    pub(super) fn knows(&self, serial: u64) -> bool {
        self.leases.contains_key(&serial) || self.ended.contains_key(&serial)
    }

    /// Frees a live lease's slot. Returns its state, or `None` if it is not live (so a slot is never freed twice).
    pub(super) fn free(&mut self, serial: u64) -> Option<LeaseState> {
        let lease = self.leases.remove(&serial)?;
        self.live_generation += 1;
        self.lease_expiries.remove(&(lease.expires_at, serial));
        if let Some(held) = self.owners.get_mut(&lease.owner) {
            held.remove(&serial);
            if held.is_empty() {
                self.owners.remove(&lease.owner);
            }
        }
        self.reindex(&lease.proxy, |state| state.let_go(serial, lease.slot));
        Some(lease)
    }

    /// Remembers a lease that ended before `until` (its latest expiry), so its IDs are refused until then.
    pub(super) fn end(&mut self, serial: u64, ended: EndedLease) {
        let until = ended.until;
        if let Some(previous) = self.ended.insert(serial, ended) {
            self.ended_expiries.remove(&(previous.until, serial));
        }
        self.ended_expiries.insert((until, serial));
        self.ended_generation += 1;
    }

    /// Marks an ended lease released (404 from now on rather than 410).
    pub(super) fn mark_released(&mut self, serial: u64) -> bool {
        let Some(ended) = self.ended.get_mut(&serial) else { return false };
        if !ended.released {
            ended.released = true;
            self.ended_generation += 1;
        }
        true
    }

    /// Ends a live lease for good: its slot is freed and its IDs are refused from now on. Whether it was live.
    pub(super) fn release_live(&mut self, serial: u64) -> bool {
        let Some(lease) = self.free(serial) else { return false };
        self.end(serial, EndedLease::of(lease, true));
        true
    }

    pub(super) fn revoke_all(&mut self, proxy: &ProxyId) {
        self.revoke_above(proxy, 0);
    }

    /// Revokes the newest slots of `proxy` (each with every lease sharing it) until at most `keep` remain.
    pub(super) fn revoke_above(&mut self, proxy: &ProxyId, keep: u32) {
        let Some(state) = self.proxies.get(proxy) else { return };
        if state.active <= keep {
            return;
        }
        // Each slot's leases, newest slot (by its newest lease) first. A lease without a session is a slot of its
        // own, keyed by its serial.
        let mut slots: HashMap<Result<u64, u64>, (u64, Vec<u64>)> = HashMap::new();
        for serial in &state.leases {
            let Some(lease) = self.leases.get(serial) else { continue };
            let (newest, serials) = slots.entry(lease.slot.ok_or(*serial)).or_default();
            *newest = (*newest).max(lease.sequence);
            serials.push(*serial);
        }
        let mut groups: Vec<(u64, Vec<u64>)> = slots.into_values().collect();
        groups.sort_unstable_by_key(|group| std::cmp::Reverse(group.0));
        for (_, serials) in groups {
            if self.proxies.get(proxy).is_none_or(|state| state.active <= keep) {
                break;
            }
            for serial in serials {
                if let Some(lease) = self.free(serial) {
                    self.end(serial, EndedLease::of(lease, false));
                }
            }
        }
    }

    /// Notes that `owner`'s report (a ban or a throttle) made the cooldown of `key`: added to who counted in it
    /// when it was running already, else the first.
    pub(super) fn reported_by(&mut self, key: &(ProxyId, String), owner: &str, ban: bool, running: bool) {
        if let Some(cooldown) = self.cooldowns.get_mut(key) {
            if !running {
                cooldown.reporters.clear();
            }
            match cooldown.reporters.iter_mut().find(|(who, _)| who == owner) {
                Some((_, banned)) => *banned |= ban,
                None => cooldown.reporters.push((owner.to_owned(), ban)),
            }
        }
    }

    /// Grants a lease on `proxy` (which admits it: [`ProxyState::admits_slot`]), sharing `slot` when the session
    /// holds it there already.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn grant(
        &mut self,
        store: &InMemoryLeaseStore,
        proxy: &ProxyId,
        target: &str,
        owner: &str,
        slot: Option<u64>,
        ttl: Duration,
        now: SystemTime,
    ) -> Granted {
        self.sequence += 1;
        self.live_generation += 1;
        let sequence = self.sequence;
        let serial = store.serial_base.wrapping_add(sequence);
        // To the second, as the ID carries it: the store that adopts the lease sees the same expiry.
        let expires_at = whole_seconds(now + ttl);
        let mut endpoint = String::new();
        self.reindex(proxy, |state| {
            state.hold(serial, slot);
            state.last_leased = sequence;
            endpoint.clone_from(&state.info.endpoint);
        });
        let lease = LeaseState {
            proxy: proxy.to_owned(),
            target: target.to_owned(),
            expires_at,
            sequence,
            granted_at: now,
            endpoint,
            adopted: false,
            unconfirmed: false,
            reported: 0,
            owner: owner.to_owned(),
            slot,
        };
        match self.owners.get_mut(owner) {
            Some(held) => {
                held.insert(serial);
            }
            None => {
                self.owners.insert(owner.to_owned(), FastSet::from_iter([serial]));
            }
        }
        let granted = Granted {
            serial,
            proxy: proxy.to_owned(),
            target: target.to_owned(),
            expires_at,
            endpoint: lease.endpoint.clone(),
        };
        self.leases.insert(serial, lease);
        self.lease_expiries.insert((expires_at, serial));
        granted
    }

    /// Adds `counted` to what (proxy, target) has seen reported, remembered for an hour after the last report;
    /// beyond the configured bound, the least recently reported pairs go.
    pub(super) fn count(
        &mut self,
        store: &InMemoryLeaseStore,
        key: (ProxyId, String),
        counted: Outcomes,
        now: SystemTime,
    ) {
        if counted.total() == 0 {
            return;
        }
        let forget_at = now + OUTCOMES_KEPT;
        let entry = self.outcomes.entry(key.clone()).or_insert((Outcomes::default(), forget_at));
        let previous = std::mem::replace(&mut entry.1, forget_at);
        entry.0.ok += counted.ok;
        entry.0.failed += counted.failed;
        entry.0.banned += counted.banned;
        entry.0.throttled += counted.throttled;
        self.outcome_expiries.remove(&(previous, key.0.clone(), key.1.clone()));
        self.outcome_expiries.insert((forget_at, key.0, key.1));
        while self.outcomes.len() > store.config.max_outcomes {
            let Some((_, proxy, target)) = self.outcome_expiries.pop_first() else { break };
            self.outcomes.remove(&(proxy, target));
        }
    }

    /// Records a cooldown of `proxy` for `target`, remembered for one more cooldown length after it ends (so a
    /// ban soon after counts as "in a row"); beyond the configured bound, the entries closest to being forgotten go.
    pub(super) fn set_cooldown(
        &mut self,
        store: &InMemoryLeaseStore,
        proxy: ProxyId,
        target: String,
        until: SystemTime,
        streak: u32,
    ) {
        let forget_at = until + store.cooldown_for(self, &proxy, streak.saturating_add(1));
        self.sequence += 1;
        let started = self.sequence;
        let key = (proxy, target);
        let (reporters, cleared_until) = self
            .cooldowns
            .get(&key)
            .map(|previous| (previous.reporters.clone(), previous.cleared_until))
            .unwrap_or_default();
        let state = CooldownState { until, streak, forget_at, started, reporters, cleared_until };
        if let Some(previous) = self.cooldowns.insert(key.clone(), state) {
            self.cooldown_expiries.remove(&(previous.forget_at, key.0.clone(), key.1.clone()));
        }
        self.cooldown_expiries.insert((forget_at, key.0, key.1));
        while self.cooldowns.len() > store.config.max_cooldowns {
            let Some((at, proxy, target)) = self.cooldown_expiries.pop_first() else { break };
            let key = (proxy, target);
            if self.cooldowns.get(&key).is_some_and(|cooldown| cooldown.forget_at == at) {
                self.cooldowns.remove(&key);
            }
        }
    }

    pub(super) fn expire(&mut self, now: SystemTime) -> usize {
        let mut expired = 0;
        while let Some((at, serial)) = self.lease_expiries.first().copied() {
            if at > now {
                break;
            }
            if self.free(serial).is_some() {
                expired += 1;
            }
        }
        while let Some((at, serial)) = self.ended_expiries.first().copied() {
            if at > now {
                break;
            }
            self.ended_expiries.pop_first();
            self.ended.remove(&serial);
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
        while let Some((at, proxy, target)) = self.outcome_expiries.first().cloned() {
            if at > now {
                break;
            }
            self.outcome_expiries.pop_first();
            self.outcomes.remove(&(proxy, target));
        }
        while let Some((at, address, target)) = self.pace_expiries.first().cloned() {
            if at > now {
                break;
            }
            self.pace_expiries.pop_first();
            let key = (address, target);
            if self.paces.get(&key) == Some(&at) {
                self.paces.remove(&key);
            }
        }
        while let Some((at, slot)) = self.session_expiries.first().copied() {
            if at > now {
                break;
            }
            self.session_expiries.pop_first();
            if self.sessions.get(&slot).is_some_and(|sticky| sticky.forget_at == at) {
                self.sessions.remove(&slot);
            }
        }
        expired
    }
}

/// What a proxy's pace is kept by: the address sites see (proxies sharing it share it), else the proxy itself.
fn pace_key(info: &crate::ProxyInfo) -> String {
    match &info.egress_ip {
        Some(address) => address.clone(),
        None => format!("proxy:{}", info.id),
    }
}
