//! The lease store: which proxy a crawler gets for a target site, for how long, and which proxies are cooling down
//! for which sites.
//!
//! No Kubernetes and no HTTP: proxies are known only as [`ProxyInfo`] (`id`, `healthy`, `max_leases`, labels). A
//! lease goes to the least-loaded eligible proxy (ties to the least recently leased) — healthy, matching the
//! selector, below its cap, not cooling down for the target — found through an ordered index, not a scan. Leases
//! expire unless renewed; a `banned` report cools that proxy down for that target only, for a time that doubles with
//! each ban in a row. Leases on a proxy that turns unhealthy or disappears are revoked.
//!
//! Lease IDs are self-verifying ([`LeaseKey`]): a store that shares the key adopts a lease it has never seen when
//! it is shown one (after a restart or a change of leader), and an ID is usable only by the token that took it.
//! Cooldowns can be read per proxy and restored ([`LeaseStore::proxy_cooldowns`],
//! [`LeaseStore::restore_cooldowns`]), so a caller can keep them somewhere durable.

mod id;
mod port;
mod selector;
mod store;
mod target;

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

/// What a crawler reports about a lease: the type the discovery client and the gateway share.
pub use egress_fleet::Outcome;
pub use egress_fleet::{PoolId, ProxyId};

pub use id::{Claims, LeaseKey, MIN_KEY_BYTES, ShortKey};
pub use port::{LeaseState, Refused, SharedRefusal};
pub use selector::{InvalidSelector, Selector};
pub use store::{InMemoryLeaseStore, InvariantViolation, session_weight};
pub use target::{InvalidTarget, TargetMode, normalize};

/// A proxy as the store knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyInfo {
    /// Which proxy.
    pub id: ProxyId,
    /// Whether it may be handed out.
    pub healthy: bool,
    /// At most this many leases at once; 0 never leases it.
    pub max_leases: u32,
    /// Labels selectors match against.
    pub labels: BTreeMap<String, String>,
    /// Where crawlers connect (for example `host:port`). A lease remembers the endpoint its holder was told, so a
    /// caller can keep a replaced instance until no lease is on it ([`LeaseStore::leases_on`]).
    pub endpoint: String,
    /// The address sites see its requests come from, when known. Proxies that share one share their cooldowns:
    /// a site that banned the address banned all of them.
    pub egress_ip: Option<String>,
    /// The pool it is a member of, when it has one.
    pub pool: Option<PoolId>,
    /// The zone it runs in (the Proxy's `placement.zone`), when set.
    pub zone: Option<String>,
    /// The provider it runs on (the Proxy's `provider`), for Managed proxies.
    pub provider: Option<String>,
    /// How long a site's ban cools it down; `None`: the store's ([`LeaseConfig::cooldown`]).
    pub cooldown: Option<CooldownPolicy>,
    /// How often its egress address may be leased for one site; `None`: as often as its cap allows.
    pub pacing: Option<Pacing>,
}

/// How often one egress address is leased for one site, by the generic cell rate algorithm: `burst` leases at once,
/// then one per `interval`. Proxies leaving through one address share its pace (the site sees the address).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pacing {
    /// The time between two leases once the burst is spent.
    pub interval: Duration,
    /// How many leases may go at once after a quiet spell (at least 1; 1 spaces every lease by `interval`).
    pub burst: u32,
}

impl Pacing {
    /// When the next lease may go, given the address's theoretical arrival time `tat` (the time by which the leases
    /// so far would have gone at exactly one per interval); `None` when one may go at `now`.
    pub fn next_slot(&self, tat: Option<SystemTime>, now: SystemTime) -> Option<SystemTime> {
        let allowance = self.interval.saturating_mul(self.burst.max(1) - 1);
        let earliest = tat?.checked_sub(allowance)?;
        (earliest > now).then_some(earliest)
    }

    /// The theoretical arrival time after a lease at `now`.
    pub fn after_lease(&self, tat: Option<SystemTime>, now: SystemTime) -> SystemTime {
        tat.map_or(now, |tat| tat.max(now)) + self.interval
    }
}

/// How long a ban cools a proxy down for a site: `base` after the first ban in a row, multiplied by `factor` for each
/// further one, never more than `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CooldownPolicy {
    /// The cooldown after the first ban in a row.
    pub base: Duration,
    /// What each further ban in a row multiplies it by (1 keeps it flat).
    pub factor: u32,
    /// The longest cooldown.
    pub max: Duration,
}

impl CooldownPolicy {
    /// The cooldown after the `streak`-th ban in a row.
    pub fn after(&self, streak: u32) -> Duration {
        let mut cooldown = self.base;
        for _ in 1..streak {
            if cooldown >= self.max {
                break;
            }
            cooldown = cooldown.saturating_mul(self.factor.max(1));
        }
        cooldown.min(self.max)
    }
}

/// A lease that ended before its last expiry, as kept elsewhere ([`LeaseStore::ended_leases`]): its IDs are
/// refused until `until`, with 404 when it was released and 410 when it was revoked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndedLeaseRecord {
    /// The serial every ID of the lease carries.
    pub serial: u64,
    /// Its latest expiry, to the second.
    pub until: SystemTime,
    /// Released by its holder rather than revoked.
    pub released: bool,
}

/// A live lease as kept elsewhere ([`LeaseStore::live_leases`]), so the next leader counts it against its proxy's
/// cap before its holder shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveLeaseRecord {
    /// The serial every ID of the lease carries.
    pub serial: u64,
    /// The proxy it counts against.
    pub proxy: ProxyId,
    /// The owner its IDs are bound to (a tenant's name). Not the target: what a tenant crawls is not written
    /// down; the store takes it from the lease's ID when its holder shows it.
    pub owner: String,
    /// The slot of the proxy's cap it shares with its session's other leases for the same site, as a digest keyed
    /// with the lease key (no session or site is written down); `None` for a lease without a session, which takes
    /// a slot of its own.
    pub slot: Option<u64>,
    /// Its expiry, to the second.
    pub until: SystemTime,
}

/// What a crawler asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaseRequest {
    /// The site the proxy is for: a host, an IP address or a URL.
    pub target: String,
    /// Only proxies matching this selector.
    pub selector: Selector,
    /// How long the lease lasts before it expires unless renewed; default and maximum come from the config.
    pub ttl: Option<Duration>,
    /// A specific proxy.
    pub proxy: Option<ProxyId>,
    /// A sticky-session key: the same (owner, session, target) gets the same proxy while it stays eligible.
    /// Sessions are the owner's: another owner naming the same key has a session of its own.
    pub session: Option<String>,
    /// Only members of this pool.
    pub pool: Option<PoolId>,
    /// Only proxies in this zone ([`ProxyInfo::zone`]).
    pub zone: Option<String>,
    /// Only proxies on this provider ([`ProxyInfo::provider`]).
    pub provider: Option<String>,
    /// Who asks (the operator: the caller's tenant): the lease is usable only with the same owner.
    pub owner: String,
    /// The most leases `owner` may hold at once, this one included; `None` for no limit.
    pub owner_quota: Option<u32>,
    /// How long, and for how many leases, the session keeps one proxy before it moves to another (needs
    /// `session`); no limits: it keeps it while it is eligible.
    pub session_limits: SessionLimits,
}

/// How long a session keeps one proxy: a session whose proxy has been its own for `max_age` since the lease that
/// chose it, or has been leased `max_leases` times, moves to another proxy at its next lease (the one it had is
/// kept only when no other can take it). Through the gateway every request is one lease, so `max_leases` counts
/// requests. A lease already held is not cut short.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionLimits {
    /// The longest time a session keeps one proxy, from the lease that chose it.
    pub max_age: Option<Duration>,
    /// The most leases a session takes on one proxy.
    pub max_leases: Option<u32>,
}

impl SessionLimits {
    /// Whether a session that chose its proxy at `since` and has leased it `leases` times must move on at `now`.
    pub fn lapsed(&self, since: SystemTime, leases: u32, now: SystemTime) -> bool {
        self.max_age.is_some_and(|age| now >= since + age) || self.max_leases.is_some_and(|most| leases >= most)
    }
}

impl LeaseRequest {
    /// Whether a proxy is one this request may be given: it matches the selector and, when the request names a
    /// pool, a zone or a provider, is a member of that pool, in that zone and on that provider.
    pub fn admits(&self, proxy: &ProxyInfo) -> bool {
        self.selector.matches(&proxy.labels)
            && self.pool.as_ref().is_none_or(|pool| proxy.pool.as_ref() == Some(pool))
            && self.zone.as_ref().is_none_or(|zone| proxy.zone.as_ref() == Some(zone))
            && self.provider.as_ref().is_none_or(|provider| proxy.provider.as_ref() == Some(provider))
    }
}

/// A granted lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// Its identifier, used to renew, release and report.
    pub id: String,
    /// The leased proxy.
    pub proxy: ProxyId,
    /// The normalised target.
    pub target: String,
    /// When it expires unless renewed (to the second).
    pub expires_at: SystemTime,
    /// The proxy's endpoint as the holder was told it.
    pub endpoint: String,
    /// For a session with a lifetime ([`SessionLimits::max_age`]): when its time on this proxy is over and its next
    /// lease goes elsewhere, so a holder can let go of the proxy then (the gateway closes the session's tunnels).
    pub session_until: Option<SystemTime>,
}

/// A renewed lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Renewed {
    /// The lease with its new expiry (and so a new ID; the earlier ones keep naming it).
    pub lease: Lease,
    /// The endpoint the holder had before, when the proxy's endpoint changed since (its instance was replaced):
    /// the holder must switch to `lease.endpoint`.
    pub moved_from: Option<String>,
}

/// What a report did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reported {
    /// The proxy the lease is on.
    pub proxy: ProxyId,
    /// The lease's normalised target: the site the report is about.
    pub target: String,
    /// The end of the cooldown a ban or a throttle started (or, for one its owner had reported already, the end of
    /// the one running).
    pub cooldown_until: Option<SystemTime>,
    /// Every proxy whose cooldowns the report changed: the lease's, and those leaving through the same egress IP.
    pub cooled: Vec<ProxyId>,
}

/// One report on a lease: an outcome, counts of requests made through it since the last report, or both.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// What happened last, if anything worth a rule (a ban or a throttle cools down; ok resets the streak).
    pub outcome: Option<Outcome>,
    /// Requests the target served.
    pub ok: u32,
    /// Requests that failed otherwise.
    pub failed: u32,
    /// Also end the lease.
    pub release: bool,
}

impl Report {
    /// A report of one outcome.
    pub fn of(outcome: Outcome) -> Self {
        Self { outcome: Some(outcome), ..Self::default() }
    }

    /// The same report, ending the lease too.
    pub fn and_release(self) -> Self {
        Self { release: true, ..self }
    }
}

/// What a (proxy, target) pair has seen reported, since its first report (forgotten an hour after its last).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outcomes {
    /// Requests served.
    pub ok: u64,
    /// Requests failed otherwise.
    pub failed: u64,
    /// Bans.
    pub banned: u64,
    /// Throttles.
    pub throttled: u64,
}

impl Outcomes {
    /// Every request reported.
    pub fn total(&self) -> u64 {
        self.ok + self.failed + self.banned + self.throttled
    }

    /// The share of reported requests the target served, when any was reported.
    pub fn success_rate(&self) -> Option<f64> {
        let total = self.total();
        (total > 0).then(|| self.ok as f64 / total as f64)
    }
}

/// A live cooldown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cooldown {
    /// The proxy.
    pub proxy: ProxyId,
    /// The normalised target.
    pub target: String,
    /// When it ends.
    pub until: SystemTime,
    /// How many bans in a row led to it.
    pub streak: u32,
    /// The owners whose reports made it (empty when it was restored from a record that did not say).
    pub reporters: Vec<String>,
}

/// A proxy in a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyLoad {
    /// The proxy.
    pub id: ProxyId,
    /// Active leases.
    pub active_leases: u32,
    /// Its cap.
    pub max_leases: u32,
    /// When its cooldown for the asked target ends, if it is cooling down for it.
    pub cooling_down_until: Option<SystemTime>,
    /// What was reported through it for the asked target.
    pub outcomes: Option<Outcomes>,
}

/// [`LeaseError::AllCoolingDown`]'s message: how many proxies cool down, and how many are at their cap instead.
fn cooling_down(cooling: u32, at_capacity: u32) -> String {
    let cooling = match cooling {
        1 => "1 matching proxy is cooling down for this target".to_owned(),
        count => format!("{count} matching proxies are cooling down for this target"),
    };
    match at_capacity {
        0 => cooling,
        1 => format!("{cooling} and 1 is at its lease cap"),
        count => format!("{cooling} and {count} are at their lease cap"),
    }
}

/// [`LeaseError::Paced`]'s subject.
fn paced_what(proxy: Option<&ProxyId>) -> String {
    match proxy {
        Some(proxy) => format!("proxy {proxy:?} is"),
        None => "every matching proxy with room is".to_owned(),
    }
}

/// Why a request to the store failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// The target cannot be normalised.
    #[error(transparent)]
    InvalidTarget(#[from] InvalidTarget),
    /// No healthy proxy matches the request.
    #[error("no healthy proxy matches the request")]
    NoneHealthy,
    /// Every matching healthy proxy is at its lease cap.
    #[error("every matching proxy is at its lease cap")]
    AllAtCapacity {
        /// When the first lease on them expires, as a hint for retrying.
        retry_at: Option<SystemTime>,
    },
    /// Every matching healthy proxy with room is cooling down for this target; the others are at their cap.
    #[error("{}", cooling_down(*.cooling, *.at_capacity))]
    AllCoolingDown {
        /// When the first of those cooldowns ends.
        until: SystemTime,
        /// How many are cooling down (and have room).
        cooling: u32,
        /// How many of the others are at their lease cap (cooling down or not).
        at_capacity: u32,
    },
    /// The named proxy is cooling down for this target.
    #[error("proxy {proxy:?} is cooling down for this target")]
    ProxyCoolingDown {
        /// The proxy.
        proxy: ProxyId,
        /// When its cooldown ends.
        until: SystemTime,
    },
    /// Every matching proxy with room, not cooling down, is paced for this target ([`ProxyInfo::pacing`]): the
    /// next lease through one of them may go at `until` (for a session, through its own proxy). Named: `proxy`.
    #[error("{} paced for this target (its pacing): the next slot is not yet free", paced_what(.proxy.as_ref()))]
    Paced {
        /// When the first slot frees.
        until: SystemTime,
        /// The proxy asked for (by name or as the session's own), when one was.
        proxy: Option<ProxyId>,
    },
    /// The named proxy is at its lease cap (or drained, or unhealthy).
    #[error("proxy {proxy:?} cannot take a lease now: {why}")]
    ProxyUnavailable {
        /// The proxy.
        proxy: ProxyId,
        /// Why: at capacity, drained, unhealthy, not matching the selector.
        why: &'static str,
    },
    /// No proxy has that identifier.
    #[error("no proxy {0:?}")]
    UnknownProxy(ProxyId),
    /// No live lease has that identifier (never existed, released or expired): a released lease never comes back.
    #[error("no lease {0:?} (it may have expired or been released)")]
    UnknownLease(String),
    /// The lease was revoked because its proxy turned unhealthy or disappeared.
    #[error("lease {0:?} was revoked: its proxy is no longer available")]
    Revoked(String),
    /// A lease this store did not know (granted by a previous leader) whose proxy is at its cap here: taking it
    /// over would take the proxy above it, so its holder leases again.
    #[error(
        "lease {0:?} was not taken over: its proxy reached its cap (maxLeases) after a change of leader; lease again"
    )]
    NotAdopted(String),
    /// The owner holds as many leases as its quota allows.
    #[error("the tenant holds {limit} leases, its quota (maxLeases)")]
    QuotaExceeded {
        /// The quota.
        limit: u32,
        /// When the first of the owner's leases expires, as a hint for retrying.
        retry_at: Option<SystemTime>,
    },
    /// The shared state cannot be reached or answered wrongly; nothing was changed by this request.
    #[error("the lease state is unavailable: {0}")]
    StateUnavailable(String),
}

/// Settings of a store.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    /// TTL when a request gives none.
    pub default_ttl: Duration,
    /// The longest TTL a request may ask for.
    pub max_ttl: Duration,
    /// The ban cooldown of proxies whose info names none (10 minutes, doubling, at most a day).
    pub cooldown: CooldownPolicy,
    /// How targets are compared.
    pub target_mode: TargetMode,
    /// The most cooldown entries kept; the ones closest to being forgotten go first beyond it.
    pub max_cooldowns: usize,
    /// The cooldown after a throttle that gives no `Retry-After`.
    pub throttle_default: Duration,
    /// The longest cooldown a throttle's `Retry-After` may ask for.
    pub throttle_cap: Duration,
    /// The most (proxy, target) outcome counters kept; the least recently reported go first beyond it.
    pub max_outcomes: usize,
    /// How many requests one lease's reports may count at once, before its age allows more.
    pub reported_burst: u64,
    /// How many more requests per second of a lease's age its reports may count: what one lease could have sent.
    pub reported_per_second: u64,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            default_ttl: Duration::from_secs(300),
            max_ttl: Duration::from_secs(3600),
            cooldown: CooldownPolicy { base: Duration::from_secs(600), factor: 2, max: Duration::from_secs(86_400) },
            target_mode: TargetMode::RegistrableDomain,
            max_cooldowns: 1_000_000,
            throttle_default: Duration::from_secs(60),
            throttle_cap: Duration::from_secs(3600),
            max_outcomes: 1_000_000,
            reported_burst: 100,
            reported_per_second: 100,
        }
    }
}

/// What ending an owner's sessions did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndedSessions {
    /// Sessions (each per target) that held a lease or a proxy and hold neither now.
    pub sessions: usize,
    /// Live leases released.
    pub leases: usize,
}

/// A store of leases. Every method takes the current time, so behaviour over time is testable without waiting.
pub trait LeaseStore: Send + Sync {
    /// Adds or updates a proxy. A proxy that turns unhealthy has its leases revoked.
    fn upsert_proxy(&self, proxy: ProxyInfo);
    /// Removes a proxy and revokes its leases.
    fn remove_proxy(&self, id: &ProxyId);
    /// Grants a lease.
    fn lease(&self, request: &LeaseRequest, now: SystemTime) -> Result<Lease, LeaseError>;
    /// Extends a lease by `ttl` (or the default) from now. `id` is any ID of the lease, shown by its `owner`; a
    /// valid ID this store has not seen is adopted (so are renew, release and report below).
    fn renew(&self, id: &str, owner: &str, ttl: Option<Duration>, now: SystemTime) -> Result<Renewed, LeaseError>;
    /// Ends a lease, freeing its slot.
    fn release(&self, id: &str, owner: &str, now: SystemTime) -> Result<(), LeaseError>;
    /// Records what happened with a lease: counts, and an outcome (a ban or a throttle starts a cooldown). With
    /// `report.release`, also ends it.
    fn report(&self, id: &str, owner: &str, report: &Report, now: SystemTime) -> Result<Reported, LeaseError>;
    /// The cooldowns (live, or ended but with their streak still remembered) of one proxy, latest end first.
    fn proxy_cooldowns(&self, proxy: &ProxyId, now: SystemTime) -> Vec<Cooldown>;
    /// Takes in cooldowns kept elsewhere (after a restart); one this store already knows to end later is kept,
    /// and so is the clearing of one (an older record of a cleared cooldown is not taken). Returns how many were
    /// taken.
    fn restore_cooldowns(&self, cooldowns: &[Cooldown], now: SystemTime) -> usize;
    /// The leases that ended (released or revoked) before their last expiry and whose IDs are refused until then,
    /// latest expiry first, at most `limit`; with [`LeaseStore::ended_generation`] as it was when they were read.
    fn ended_leases(&self, limit: usize, now: SystemTime) -> (u64, Vec<EndedLeaseRecord>);
    /// A number that changes whenever the set of ended leases gains one (or one turns from revoked to released).
    fn ended_generation(&self) -> u64;
    /// Takes in ended leases kept elsewhere (by the store of a previous leader), so their IDs are refused here too
    /// instead of adopted. A lease this store holds or already knows ended is left as it is. Returns how many
    /// were taken.
    fn restore_ended(&self, records: &[EndedLeaseRecord], now: SystemTime) -> usize;
    /// The live leases, latest expiry first, at most `limit`; with [`LeaseStore::live_generation`] as it was when
    /// they were read.
    fn live_leases(&self, limit: usize, now: SystemTime) -> (u64, Vec<LiveLeaseRecord>);
    /// A number that changes whenever a lease is granted, taken over, renewed or ends.
    fn live_generation(&self) -> u64;
    /// Takes in live leases kept elsewhere (by the store of a previous leader): each counts against its proxy's
    /// cap at once, as if its holder had shown it. One this store knows (live or ended), an expired one, one on a
    /// proxy unknown or unhealthy here and one its proxy has no room for are left out. Returns how many were taken.
    fn restore_live(&self, records: &[LiveLeaseRecord], now: SystemTime) -> usize;
    /// Ends the cooldowns for `target` (normalised here) now and forgets their streaks: of `proxy` and the
    /// proxies leaving through its egress IP, or of every proxy. Returns the ones that were running.
    fn clear_cooldowns(
        &self,
        target: &str,
        proxy: Option<&ProxyId>,
        now: SystemTime,
    ) -> Result<Vec<Cooldown>, LeaseError>;
    /// Ends `owner`'s sessions: `session`, or every one of them. Their live leases are released and their proxies
    /// forgotten, so their next leases choose afresh; leases without a session are left alone.
    fn end_sessions(&self, owner: &str, session: Option<&str>, now: SystemTime) -> EndedSessions;
    /// How many live leases on `proxy` were last told `endpoint`.
    fn leases_on(&self, proxy: &ProxyId, endpoint: &str, now: SystemTime) -> usize;
    /// Releases every lease that has expired; returns how many.
    fn expire(&self, now: SystemTime) -> usize;
    /// Live cooldowns, for one target (normalised here) or all.
    fn cooldowns(&self, target: Option<&str>, now: SystemTime) -> Result<Vec<Cooldown>, LeaseError>;
    /// The load of every known proxy, with its cooldown for `target` when one is given.
    fn loads(&self, target: Option<&str>, now: SystemTime) -> Result<Vec<ProxyLoad>, LeaseError>;
    /// The load of each of `ids` (`None` for one the store does not know), in the same order, under one lock: a
    /// listing costs what it returns, not the fleet.
    fn loads_of(
        &self,
        ids: &[&ProxyId],
        target: Option<&str>,
        now: SystemTime,
    ) -> Result<Vec<Option<ProxyLoad>>, LeaseError>;
    /// How many leases are active, without looking at each.
    fn active_leases(&self) -> usize;
    /// The proxies `owner` holds live leases on.
    fn held_by(&self, owner: &str, now: SystemTime) -> std::collections::BTreeSet<ProxyId>;
    /// How many live leases each owner holds (owners holding none are left out).
    fn leases_by_owner(&self) -> BTreeMap<String, usize>;
    /// How many leases this store took over from IDs it had not issued (since it was made).
    fn adopted(&self) -> u64;
}
