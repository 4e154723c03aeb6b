//! The lease state on Valkey or Redis: every replica of the operator shares one set of leases, caps, tenant quotas,
//! sticky sessions, cooldowns and ban streaks, so any replica can serve discovery and all of them agree.
//!
//! Each operation is one Lua script run whole on the server (`src/state.lua`),
//! on the server's clock: two replicas leasing at once never take a proxy above its cap, and replicas with skewed
//! clocks agree on expiries and cooldowns. Every key carries one hash tag (`{egress}` by default), so a Redis
//! Cluster keeps the whole state in one slot: it works, on one shard.
//!
//! The proxies themselves are each replica's own view ([`LeaseState::upsert_proxy`]): every replica watches the
//! `Proxy` objects, and a lease's candidates (healthy, matching, not drained) are sent with the request; the server
//! picks the least-loaded one with room that is not cooling down for the target. Lease IDs are signed with the
//! replicas' shared key, as in memory, so a Redis that lost its data adopts the leases its clients show.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use egress_lease::{
    Claims, Cooldown, CooldownPolicy, EndedSessions, Lease, LeaseConfig, LeaseError, LeaseKey, LeaseRequest,
    LeaseState, Outcome, Outcomes, ProxyId, ProxyInfo, ProxyLoad, Refused, Renewed, Report, Reported, SharedRefusal,
    normalize, session_weight,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, Value};
use tokio::sync::broadcast;

/// Where the state lives and how to reach it.
#[derive(Clone)]
pub struct RedisOptions {
    /// `redis://host:port/db` or `rediss://…` (TLS).
    pub url: String,
    /// The password, when it is kept apart from the URL (a Secret's key); it replaces the URL's.
    pub password: Option<String>,
    /// What every key starts with, inside the hash tag: installations sharing one server keep apart with
    /// different prefixes.
    pub prefix: String,
    /// How long one operation may take before it fails as unavailable.
    pub timeout: Duration,
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field("url", &redact(&self.url))
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl RedisOptions {
    /// Options for `url` with the default prefix (`egress`) and timeout (two seconds).
    pub fn new(url: impl Into<String>) -> Self {
        Self { url: url.into(), password: None, prefix: "egress".into(), timeout: Duration::from_secs(2) }
    }
}

/// `url` without the password of its user information, for messages.
pub fn redact(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((userinfo, host)) => {
                let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
                format!("{scheme}://{user}:<redacted>@{host}")
            }
            None => url.to_owned(),
        },
        None => "<not a URL>".to_owned(),
    }
}

/// Why the state could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL is not one the client accepts.
    #[error("--state-store {url}: {reason}")]
    InvalidUrl {
        /// The URL, its password redacted.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The prefix would break the hash tag.
    #[error("--state-store-prefix {0:?}: must be non-empty and contain none of `{{`, `}}` and newlines")]
    InvalidPrefix(String),
    /// The server did not answer.
    #[error("the state store at {url} is unreachable: {reason}")]
    Unreachable {
        /// The URL, its password redacted.
        url: String,
        /// What the client saw.
        reason: String,
    },
}

/// The [`LeaseState`] on Valkey or Redis.
pub struct RedisLeaseState {
    connection: ConnectionManager,
    script: Script,
    /// `{prefix}:`
    prefix: String,
    config: LeaseConfig,
    key: LeaseKey,
    /// This replica's view of the proxies.
    proxies: RwLock<HashMap<ProxyId, ProxyInfo>>,
    adopted: AtomicU64,
    /// Where a fresh server's serial counter starts.
    serial_start: u64,
    refusals: broadcast::Sender<SharedRefusal>,
    follower: tokio::task::JoinHandle<()>,
}

impl Drop for RedisLeaseState {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

impl std::fmt::Debug for RedisLeaseState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLeaseState").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

/// How many refusals a slow subscriber may fall behind (it then hears of a gap).
const REFUSAL_BACKLOG: usize = 4096;

/// How often the refusal subscription pings the server, to notice a lost connection (its stream of messages does
/// not end when the server goes away).
const REFUSAL_PING: Duration = Duration::from_secs(1);

/// A client for `options`, checked.
fn client(options: &RedisOptions) -> Result<redis::Client, ConnectError> {
    if options.prefix.is_empty() || options.prefix.contains(['{', '}', '\n']) {
        return Err(ConnectError::InvalidPrefix(options.prefix.clone()));
    }
    let invalid =
        |error: redis::RedisError| ConnectError::InvalidUrl { url: redact(&options.url), reason: error.to_string() };
    let mut info = redis::IntoConnectionInfo::into_connection_info(options.url.as_str()).map_err(invalid)?;
    if let Some(password) = &options.password {
        let settings = info.redis_settings().clone().set_password(password);
        info = info.set_redis_settings(settings);
    }
    redis::Client::open(info).map_err(invalid)
}

/// Checks `options` without connecting: the URL, and the prefix.
pub fn check(options: &RedisOptions) -> Result<(), ConnectError> {
    client(options).map(drop)
}

/// Subscribes to `channel` and passes each refusal published there to `refusals`, subscribing again (and telling
/// of a gap) whenever the connection is lost.
async fn follow_refusals(
    client: redis::Client,
    channel: String,
    refusals: broadcast::Sender<SharedRefusal>,
    timeout: Duration,
) {
    use futures::StreamExt as _;
    let mut backoff = Duration::from_millis(100);
    loop {
        let subscribed = async {
            let mut pubsub = tokio::time::timeout(timeout, client.get_async_pubsub()).await.ok()?.ok()?;
            tokio::time::timeout(timeout, pubsub.subscribe(&channel)).await.ok()?.ok()?;
            Some(pubsub)
        };
        if let Some(pubsub) = subscribed.await {
            backoff = Duration::from_millis(100);
            // Whatever was published while unsubscribed is lost: subscribers start over from the cooldowns.
            let _ = refusals.send(SharedRefusal::Gap);
            let (mut sink, mut messages) = pubsub.split();
            let mut ping = tokio::time::interval(REFUSAL_PING);
            ping.tick().await;
            loop {
                tokio::select! {
                    message = messages.next() => match message {
                        Some(message) => {
                            if let Some(refused) = parse_refusal(message.get_payload_bytes()) {
                                let _ = refusals.send(SharedRefusal::Refused(refused));
                            }
                        }
                        None => break,
                    },
                    _ = ping.tick() => {
                        if !matches!(tokio::time::timeout(timeout, sink.ping::<Value>()).await, Ok(Ok(_))) {
                            break;
                        }
                    }
                }
            }
            // Lost: subscribers stop counting on this feed now, not only once it is back.
            let _ = refusals.send(SharedRefusal::Gap);
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// A refusal as `state.lua` publishes it.
fn parse_refusal(payload: &[u8]) -> Option<Refused> {
    #[derive(serde::Deserialize)]
    struct Published {
        owner: String,
        target: String,
        until: String,
        proxies: Vec<String>,
    }
    let published: Published = serde_json::from_slice(payload).ok()?;
    Some(Refused {
        owner: published.owner,
        target: published.target,
        proxies: published.proxies.iter().map(|proxy| proxy.parse().ok()).collect::<Option<_>>()?,
        until: UNIX_EPOCH + Duration::from_millis(published.until.parse().ok()?),
    })
}

/// Every operation, dispatched on its name (one script, one SHA to load).
const SCRIPT: &str = include_str!("state.lua");

mod reply;
use reply::{cooldown_list, id_args, integer, malformed, ms, never_sent, number, policy_args, proxy_id, strings, time};

impl RedisLeaseState {
    /// Connects, failing when the server does not answer within the timeout (or refuses the password).
    pub async fn connect(options: &RedisOptions, config: LeaseConfig, key: LeaseKey) -> Result<Self, ConnectError> {
        let state = Self::open(options, config, key)?;
        state.ping().await.map_err(|reason| ConnectError::Unreachable { url: redact(&options.url), reason })?;
        Ok(state)
    }

    /// A state over the server at `options.url`, connected on first use: a server that does not answer yet makes
    /// each operation [`LeaseError::StateUnavailable`] until it does. Follows the refusals every replica publishes
    /// ([`LeaseState::shared_refusals`]) from now until it is dropped. Must be called within a Tokio runtime.
    pub fn open(options: &RedisOptions, config: LeaseConfig, key: LeaseKey) -> Result<Self, ConnectError> {
        let client = client(options)?;
        let manager = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.timeout))
            .set_response_timeout(Some(options.timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        let connection = ConnectionManager::new_lazy_with_config(client.clone(), manager)
            .map_err(|error| ConnectError::InvalidUrl { url: redact(&options.url), reason: error.to_string() })?;
        let prefix = format!("{{{}}}:", options.prefix);
        let (refusals, _) = broadcast::channel(REFUSAL_BACKLOG);
        let follower =
            tokio::spawn(follow_refusals(client, format!("{prefix}refusals"), refusals.clone(), options.timeout));
        // Serials start at a random point below 2^47 (exact in the scripts' doubles), apart from any in-memory
        // store's, so a lease ID another store issued is never taken for one of these.
        let serial_start = u64::from_be_bytes(LeaseKey::generate_bytes()[..8].try_into().expect("eight bytes")) >> 17;
        Ok(Self {
            connection,
            script: Script::new(SCRIPT),
            prefix,
            config,
            key,
            proxies: RwLock::new(HashMap::new()),
            adopted: AtomicU64::new(0),
            serial_start,
            refusals,
            follower,
        })
    }

    /// Whether the server answers, with what the client saw when it does not.
    pub async fn ping(&self) -> Result<(), String> {
        let mut connection = self.connection.clone();
        redis::cmd("PING").query_async::<Value>(&mut connection).await.map(drop).map_err(|error| error.to_string())
    }

    fn view(&self) -> std::sync::RwLockReadGuard<'_, HashMap<ProxyId, ProxyInfo>> {
        self.proxies.read().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs operation `op` with `args`.
    async fn run(&self, op: &str, args: Vec<String>) -> Result<Value, LeaseError> {
        let mut invocation = self.script.key(format!("{}serial", self.prefix));
        invocation.arg(&self.prefix).arg(op);
        for arg in args {
            invocation.arg(arg);
        }
        let mut connection = self.connection.clone();
        let mut answer = invocation.invoke_async(&mut connection).await;
        // A connection the server dropped (it restarted) fails the next command sent on it; the manager reconnects,
        // and the command is sent once more: any command the server cannot have seen, and any whose repetition
        // changes nothing (all but a grant and a report, which would count twice).
        if let Err(error) = &answer
            && (never_sent(error) || (error.is_connection_dropped() && !matches!(op, "lease" | "report")))
        {
            answer = invocation.invoke_async(&mut connection).await;
        }
        answer.map_err(|error| LeaseError::StateUnavailable(format!("{op}: {error}")))
    }

    fn ttl(&self, requested: Option<Duration>) -> Duration {
        requested.unwrap_or(self.config.default_ttl).clamp(Duration::from_secs(1), self.config.max_ttl)
    }

    fn policy(&self, proxy: &ProxyId) -> CooldownPolicy {
        self.view().get(proxy).and_then(|info| info.cooldown).unwrap_or(self.config.cooldown)
    }

    /// The proxies other than `proxy` leaving through its egress IP, in this replica's view.
    fn siblings(&self, proxy: &ProxyId) -> Vec<ProxyId> {
        let view = self.view();
        let Some(ip) = view.get(proxy).and_then(|info| info.egress_ip.as_ref()) else { return Vec::new() };
        let mut siblings: Vec<ProxyId> = view
            .values()
            .filter(|other| other.egress_ip.as_ref() == Some(ip) && &other.id != proxy)
            .map(|other| other.id.clone())
            .collect();
        siblings.sort();
        siblings
    }

    /// What a lease ID says, with the proxy's health and endpoint in this replica's view.
    fn claims(&self, id: &str, owner: &str) -> Result<(Claims, bool, String), LeaseError> {
        let claims = self.key.verify(id, owner).ok_or_else(|| LeaseError::UnknownLease(id.to_owned()))?;
        let (healthy, endpoint) =
            self.view().get(&claims.proxy).map_or((false, String::new()), |info| (info.healthy, info.endpoint.clone()));
        Ok((claims, healthy, endpoint))
    }

    async fn revoke(&self, proxy: &ProxyId, keep: u32) -> Result<(), LeaseError> {
        self.run("revoke", vec![proxy.to_string(), keep.to_string()]).await.map(drop)
    }

    fn sign(&self, serial: u64, proxy: ProxyId, target: String, expires_at: SystemTime, owner: &str) -> String {
        self.key.sign(&Claims { serial, expires_at, proxy, target }, owner)
    }
}

#[async_trait::async_trait]
impl LeaseState for RedisLeaseState {
    async fn upsert_proxy(&self, proxy: ProxyInfo) -> Result<(), LeaseError> {
        let id = proxy.id.clone();
        let (healthy, cap) = (proxy.healthy, proxy.max_leases);
        let previous = {
            let mut view = self.proxies.write().unwrap_or_else(std::sync::PoisonError::into_inner);
            view.insert(id.clone(), proxy)
        };
        if !healthy {
            if previous.is_none_or(|previous| previous.healthy) {
                self.revoke(&id, 0).await?;
            }
        } else if previous.is_some_and(|previous| cap < previous.max_leases) {
            // A lowered cap (maxLeases 0 drains) revokes the newest leases above it.
            self.revoke(&id, cap).await?;
        }
        Ok(())
    }

    async fn remove_proxy(&self, id: &ProxyId) -> Result<(), LeaseError> {
        self.proxies.write().unwrap_or_else(std::sync::PoisonError::into_inner).remove(id);
        self.revoke(id, 0).await
    }

    async fn lease(&self, request: &LeaseRequest, _now: SystemTime) -> Result<Lease, LeaseError> {
        let target = normalize(&request.target, self.config.target_mode)?;
        let ttl = self.ttl(request.ttl);
        let owner = request.owner.as_str();
        let (mode, candidates) = {
            let view = self.view();
            match &request.proxy {
                Some(name) => {
                    let Some(proxy) = view.get(name) else { return Err(LeaseError::UnknownProxy(name.clone())) };
                    let unavailable = |why| Err(LeaseError::ProxyUnavailable { proxy: name.clone(), why });
                    if !request.selector.matches(&proxy.labels) {
                        return unavailable("it does not match the selector");
                    }
                    if !request.admits(proxy) {
                        return unavailable("it is not a member of the pool asked for");
                    }
                    if !proxy.healthy {
                        return unavailable("it is unhealthy");
                    }
                    if proxy.max_leases == 0 {
                        return unavailable("it is drained (maxLeases 0)");
                    }
                    ("named", vec![proxy.clone()])
                }
                None => {
                    let mut candidates: Vec<ProxyInfo> = view
                        .values()
                        .filter(|proxy| proxy.healthy && proxy.max_leases > 0 && request.admits(proxy))
                        .cloned()
                        .collect();
                    match &request.session {
                        Some(session) => {
                            candidates.sort_by_cached_key(|proxy| {
                                std::cmp::Reverse(session_weight(owner, session, &target, &proxy.id))
                            });
                            ("session", candidates)
                        }
                        None => {
                            // The script chooses among a sample of them in this order: a random one, so every
                            // replica's samples together cover the fleet.
                            fastrand::shuffle(&mut candidates);
                            ("least", candidates)
                        }
                    }
                }
            }
        };
        let session = request.session.as_ref().map_or_else(String::new, |session| format!("{owner}\n{session}"));
        let mut args = vec![
            ttl.as_millis().to_string(),
            owner.to_owned(),
            request.owner_quota.map_or_else(String::new, |quota| quota.to_string()),
            target.clone(),
            session,
            self.config.max_ttl.as_millis().to_string(),
            mode.to_owned(),
            self.serial_start.to_string(),
            request.session_limits.max_age.map_or_else(String::new, |age| age.as_millis().to_string()),
            request.session_limits.max_leases.map_or_else(String::new, |leases| leases.to_string()),
        ];
        for proxy in &candidates {
            let (pace, address) = match proxy.pacing {
                Some(pacing) => (
                    format!("{}:{}", pacing.interval.as_millis().max(1), pacing.burst.max(1)),
                    proxy.egress_ip.clone().unwrap_or_else(|| format!("proxy:{}", proxy.id)),
                ),
                None => (String::new(), String::new()),
            };
            args.extend([proxy.id.to_string(), proxy.max_leases.to_string(), proxy.endpoint.clone(), pace, address]);
        }
        let reply = strings(self.run("lease", args).await?, "a lease")?;
        let what = "a lease";
        match reply.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
            ["ok", serial, proxy, expires, endpoint, chose_at] => {
                let serial: u64 = number(serial, what)?;
                let proxy = proxy_id(proxy, what)?;
                let expires_at = time(expires, what)?.ok_or_else(|| malformed(what))?;
                let session_until = match (time(chose_at, what)?, request.session_limits.max_age) {
                    (Some(since), Some(age)) => Some(since + age),
                    _ => None,
                };
                Ok(Lease {
                    id: self.sign(serial, proxy.clone(), target.clone(), expires_at, owner),
                    proxy,
                    target,
                    expires_at,
                    endpoint: (*endpoint).to_owned(),
                    session_until,
                })
            }
            ["quota", retry] => Err(LeaseError::QuotaExceeded {
                limit: request.owner_quota.unwrap_or_default(),
                retry_at: time(retry, what)?,
            }),
            ["none"] => Err(LeaseError::NoneHealthy),
            ["cooling", until, cooling, at_capacity] => Err(LeaseError::AllCoolingDown {
                until: time(until, what)?.ok_or_else(|| malformed(what))?,
                cooling: number(cooling, what)?,
                at_capacity: number(at_capacity, what)?,
            }),
            ["capacity", retry] => Err(LeaseError::AllAtCapacity { retry_at: time(retry, what)? }),
            ["proxy-cooling", until] => Err(LeaseError::ProxyCoolingDown {
                proxy: candidates[0].id.clone(),
                until: time(until, what)?.ok_or_else(|| malformed(what))?,
            }),
            ["paced", until] => {
                Err(LeaseError::Paced { until: time(until, what)?.ok_or_else(|| malformed(what))?, proxy: None })
            }
            ["proxy-paced", until, proxy] => Err(LeaseError::Paced {
                until: time(until, what)?.ok_or_else(|| malformed(what))?,
                proxy: Some(proxy_id(proxy, what)?),
            }),
            ["proxy-full"] => {
                Err(LeaseError::ProxyUnavailable { proxy: candidates[0].id.clone(), why: "it is at its lease cap" })
            }
            _ => Err(malformed(what)),
        }
    }

    async fn renew(
        &self,
        id: &str,
        owner: &str,
        ttl: Option<Duration>,
        _now: SystemTime,
    ) -> Result<Renewed, LeaseError> {
        let (claims, healthy, endpoint) = self.claims(id, owner)?;
        let ttl = self.ttl(ttl);
        let mut args = id_args(&claims, owner, healthy, &endpoint);
        args.push(ttl.as_millis().to_string());
        let what = "a renewal";
        let reply = strings(self.run("renew", args).await?, what)?;
        match reply.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
            ["ok", expires, moved, adopted] => {
                if *adopted == "1" {
                    self.adopted.fetch_add(1, Ordering::Relaxed);
                }
                let expires_at = time(expires, what)?.ok_or_else(|| malformed(what))?;
                let lease = Lease {
                    id: self.sign(claims.serial, claims.proxy.clone(), claims.target.clone(), expires_at, owner),
                    proxy: claims.proxy,
                    target: claims.target,
                    expires_at,
                    endpoint,
                    session_until: None,
                };
                Ok(Renewed { lease, moved_from: (!moved.is_empty()).then(|| (*moved).to_owned()) })
            }
            ["unknown"] => Err(LeaseError::UnknownLease(id.to_owned())),
            ["revoked"] => Err(LeaseError::Revoked(id.to_owned())),
            _ => Err(malformed(what)),
        }
    }

    async fn release(&self, id: &str, owner: &str, _now: SystemTime) -> Result<(), LeaseError> {
        let claims = self.key.verify(id, owner).ok_or_else(|| LeaseError::UnknownLease(id.to_owned()))?;
        let args = vec![claims.serial.to_string(), ms(claims.expires_at), self.config.max_ttl.as_millis().to_string()];
        let reply = strings(self.run("release", args).await?, "a release")?;
        match reply.first().map(String::as_str) {
            Some("ok") => Ok(()),
            Some("unknown") => Err(LeaseError::UnknownLease(id.to_owned())),
            _ => Err(malformed("a release")),
        }
    }

    async fn report(&self, id: &str, owner: &str, report: &Report, _now: SystemTime) -> Result<Reported, LeaseError> {
        let (claims, healthy, endpoint) = self.claims(id, owner)?;
        let (outcome, wait) = match report.outcome {
            None => ("", Duration::ZERO),
            Some(Outcome::Ok) => ("ok", Duration::ZERO),
            Some(Outcome::Failed) => ("failed", Duration::ZERO),
            Some(Outcome::Banned) => ("banned", Duration::ZERO),
            Some(Outcome::Throttled { retry_after }) => (
                "throttled",
                retry_after
                    .unwrap_or(self.config.throttle_default)
                    .clamp(Duration::from_secs(1), self.config.throttle_cap),
            ),
        };
        let mut args = id_args(&claims, owner, healthy, &endpoint);
        args.extend([
            outcome.to_owned(),
            report.ok.to_string(),
            report.failed.to_string(),
            if report.release { "1" } else { "0" }.to_owned(),
            wait.as_millis().to_string(),
            self.config.reported_burst.to_string(),
            self.config.reported_per_second.to_string(),
        ]);
        args.extend(policy_args(self.policy(&claims.proxy)));
        for sibling in self.siblings(&claims.proxy) {
            let policy = policy_args(self.policy(&sibling));
            args.push(sibling.to_string());
            args.extend(policy);
        }
        let what = "a report";
        let reply = strings(self.run("report", args).await?, what)?;
        match reply.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
            ["ok", proxy, target, until, adopted, cooled @ ..] => {
                if *adopted == "1" {
                    self.adopted.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Reported {
                    proxy: proxy_id(proxy, what)?,
                    target: (*target).to_owned(),
                    cooldown_until: time(until, what)?,
                    cooled: cooled.iter().map(|proxy| proxy_id(proxy, what)).collect::<Result<_, _>>()?,
                })
            }
            ["unknown"] => Err(LeaseError::UnknownLease(id.to_owned())),
            ["revoked"] => Err(LeaseError::Revoked(id.to_owned())),
            _ => Err(malformed(what)),
        }
    }

    async fn proxy_cooldowns(&self, proxy: &ProxyId, _now: SystemTime) -> Result<Vec<Cooldown>, LeaseError> {
        let what = "a proxy's cooldowns";
        let mut cooldowns =
            cooldown_list(strings(self.run("proxy_cooldowns", vec![proxy.to_string()]).await?, what)?, what)?;
        cooldowns.sort_by(|a, b| (b.until, &a.target).cmp(&(a.until, &b.target)));
        Ok(cooldowns)
    }

    async fn restore_cooldowns(&self, cooldowns: &[Cooldown], _now: SystemTime) -> Result<usize, LeaseError> {
        let mut args = Vec::with_capacity(cooldowns.len() * 8);
        for cooldown in cooldowns {
            let Ok(target) = normalize(&cooldown.target, self.config.target_mode) else { continue };
            args.extend([
                cooldown.proxy.to_string(),
                target,
                ms(cooldown.until),
                cooldown.streak.to_string(),
                cooldown.reporters.join("\n"),
            ]);
            args.extend(policy_args(self.policy(&cooldown.proxy)));
        }
        if args.is_empty() {
            return Ok(0);
        }
        let restored = integer(self.run("restore", args).await?, "a restore")?;
        Ok(usize::try_from(restored).unwrap_or(usize::MAX))
    }

    async fn clear_cooldowns(
        &self,
        target: &str,
        proxy: Option<&ProxyId>,
        _now: SystemTime,
    ) -> Result<Vec<Cooldown>, LeaseError> {
        let target = normalize(target, self.config.target_mode)?;
        let proxies: Vec<ProxyId> = match proxy {
            // The proxy's cooldown was shared with every proxy leaving through its address: so is the clearing.
            Some(proxy) => std::iter::once(proxy.clone()).chain(self.siblings(proxy)).collect(),
            None => self.view().keys().cloned().collect(),
        };
        let mut args = vec![target];
        args.extend(proxies.iter().map(ToString::to_string));
        let what = "a clearing";
        let mut cleared = cooldown_list(strings(self.run("clear", args).await?, what)?, what)?;
        cleared.sort_by(|a, b| a.proxy.cmp(&b.proxy));
        Ok(cleared)
    }

    async fn cooldowns(&self, target: Option<&str>, _now: SystemTime) -> Result<Vec<Cooldown>, LeaseError> {
        let target = target.map(|target| normalize(target, self.config.target_mode)).transpose()?;
        let what = "the cooldowns";
        let mut live = cooldown_list(strings(self.run("cooldowns", Vec::new()).await?, what)?, what)?;
        live.retain(|cooldown| target.as_ref().is_none_or(|target| *target == cooldown.target));
        live.sort_by(|a, b| (a.until, &a.proxy, &a.target).cmp(&(b.until, &b.proxy, &b.target)));
        Ok(live)
    }

    async fn loads_of(
        &self,
        ids: &[&ProxyId],
        target: Option<&str>,
        _now: SystemTime,
    ) -> Result<Vec<Option<ProxyLoad>>, LeaseError> {
        let target = target.map(|target| normalize(target, self.config.target_mode)).transpose()?;
        let caps: Vec<Option<u32>> = {
            let view = self.view();
            ids.iter().map(|id| view.get(*id).map(|info| info.max_leases)).collect()
        };
        let known: Vec<&ProxyId> = ids.iter().zip(&caps).filter(|(_, cap)| cap.is_some()).map(|(id, _)| *id).collect();
        let what = "the loads";
        let fields = if known.is_empty() {
            Vec::new()
        } else {
            let mut args = vec![target.unwrap_or_default()];
            args.extend(known.iter().map(ToString::to_string));
            strings(self.run("loads", args).await?, what)?
        };
        let mut groups = fields.chunks(6);
        ids.iter()
            .zip(caps)
            .map(|(id, cap)| {
                let Some(max_leases) = cap else { return Ok(None) };
                let [active, cooling, ok, failed, banned, throttled] = groups.next().ok_or_else(|| malformed(what))?
                else {
                    return Err(malformed(what));
                };
                let outcomes = if ok.is_empty() {
                    None
                } else {
                    Some(Outcomes {
                        ok: number(ok, what)?,
                        failed: number(failed, what)?,
                        banned: number(banned, what)?,
                        throttled: number(throttled, what)?,
                    })
                };
                Ok(Some(ProxyLoad {
                    id: (*id).clone(),
                    active_leases: number(active, what)?,
                    max_leases,
                    cooling_down_until: time(cooling, what)?,
                    outcomes,
                }))
            })
            .collect()
    }

    async fn held_by(&self, owner: &str, _now: SystemTime) -> Result<BTreeSet<ProxyId>, LeaseError> {
        let what = "the held leases";
        strings(self.run("held", vec![owner.to_owned()]).await?, what)?
            .iter()
            .filter(|proxy| !proxy.is_empty())
            .map(|proxy| proxy_id(proxy, what))
            .collect()
    }

    async fn end_sessions(
        &self,
        owner: &str,
        session: Option<&str>,
        _now: SystemTime,
    ) -> Result<EndedSessions, LeaseError> {
        let what = "ending sessions";
        let reply =
            strings(self.run("end_sessions", vec![owner.to_owned(), session.unwrap_or("").to_owned()]).await?, what)?;
        let [sessions, leases] = reply.as_slice() else { return Err(malformed(what)) };
        Ok(EndedSessions { sessions: number(sessions, what)?, leases: number(leases, what)? })
    }

    async fn leases_on(&self, proxy: &ProxyId, endpoint: &str, _now: SystemTime) -> Result<usize, LeaseError> {
        let count = integer(self.run("on", vec![proxy.to_string(), endpoint.to_owned()]).await?, "the leases on")?;
        Ok(usize::try_from(count).unwrap_or(usize::MAX))
    }

    async fn expire(&self, _now: SystemTime) -> Result<usize, LeaseError> {
        let count = integer(self.run("expire", Vec::new()).await?, "an expiry")?;
        Ok(usize::try_from(count).unwrap_or(usize::MAX))
    }

    async fn active_leases(&self) -> Result<usize, LeaseError> {
        let mut connection = self.connection.clone();
        let count: u64 = redis::cmd("ZCARD")
            .arg(format!("{}exp", self.prefix))
            .query_async(&mut connection)
            .await
            .map_err(|error| LeaseError::StateUnavailable(format!("counting leases: {error}")))?;
        Ok(usize::try_from(count).unwrap_or(usize::MAX))
    }

    async fn leases_by_owner(&self) -> Result<BTreeMap<String, usize>, LeaseError> {
        let mut connection = self.connection.clone();
        let held: HashMap<String, i64> = redis::cmd("HGETALL")
            .arg(format!("{}held", self.prefix))
            .query_async(&mut connection)
            .await
            .map_err(|error| LeaseError::StateUnavailable(format!("counting leases by owner: {error}")))?;
        Ok(held
            .into_iter()
            .filter_map(|(owner, count)| Some((owner, usize::try_from(count).ok().filter(|count| *count > 0)?)))
            .collect())
    }

    fn adopted(&self) -> u64 {
        self.adopted.load(Ordering::Relaxed)
    }

    fn shared_refusals(&self) -> Option<broadcast::Receiver<SharedRefusal>> {
        Some(self.refusals.subscribe())
    }
}
