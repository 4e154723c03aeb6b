//! Leader election on a `coordination.k8s.io` Lease, with the Lease watched, so a released Lease is taken within
//! milliseconds rather than when its term would have run out.
//!
//! The rules are client-go's: the holder renews every third of the lease duration and steps down when it could not
//! renew for two thirds of it; a candidate takes the Lease when it is free (no holder) or when it has not changed for
//! a whole lease duration of the candidate's own clock since it last saw it change (so clock skew between nodes does
//! not matter); every write carries the resourceVersion it read, so two candidates can never both win. Unlike
//! client-go (which polls every 2 s) and `kube-lease-manager` (whose followers sleep until the Lease expires), a
//! candidate watches the Lease and acts on each change: a graceful release is taken over at once.

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch;
use tracing::{debug, info, warn};

/// What the election is run with.
#[derive(Clone, Debug)]
pub struct ElectionConfig {
    /// The Lease's name.
    pub name: String,
    /// The Lease's namespace.
    pub namespace: String,
    /// This candidate's identity (unique per process).
    pub identity: String,
    /// How long the Lease is valid after each renewal; a crashed leader is replaced about this long after its last
    /// renewal.
    pub lease_duration: Duration,
}

impl ElectionConfig {
    /// How often the holder renews.
    pub fn renew_every(&self) -> Duration {
        self.lease_duration / 3
    }

    /// How long the holder keeps leading without a successful renewal: less than the lease duration, so it has
    /// stepped down before any candidate may take over.
    pub fn renew_deadline(&self) -> Duration {
        self.lease_duration * 2 / 3
    }
}

/// The Lease as this process last saw it, and when it last saw it change.
#[derive(Clone, Debug)]
enum Seen {
    /// Not listed yet.
    Unknown,
    /// There is no such Lease.
    Absent,
    /// The Lease, and when its holder or renew time last changed (by this process's clock).
    Present(Box<Lease>, Instant),
}

/// The leader Lease's name (in the leader-election namespace).
pub const LEASE_NAME: &str = "egress-operator";

/// A running election: [`Election::leading`] says whether this candidate holds the Lease now.
pub struct Election {
    identity: String,
    leading: watch::Receiver<bool>,
    holder: watch::Receiver<Option<String>>,
    release: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Election {
    /// Starts competing for the Lease once `ready` resolves (a candidate takes over only when it can serve).
    pub fn start(client: Client, config: ElectionConfig, ready: impl Future<Output = ()> + Send + 'static) -> Self {
        let api: Api<Lease> = Api::namespaced(client, &config.namespace);
        let identity = config.identity.clone();
        let (seen_sender, seen) = watch::channel(Seen::Unknown);
        let (holder_sender, holder) = watch::channel(None);
        let (leading_sender, leading) = watch::channel(false);
        let (release, release_requested) = watch::channel(false);
        let watch_config = watcher::Config::default().fields(&format!("metadata.name={}", config.name));
        let watch = watcher::watcher(api.clone(), watch_config).default_backoff();
        let task = tokio::spawn(async move {
            let observer = tokio::spawn(observe(watch, seen_sender, holder_sender));
            tokio::select! {
                () = ready => {
                    let candidate = Candidate { api, config, seen, leading: leading_sender, release: release_requested };
                    candidate.run().await;
                }
                _ = wait_true(release_requested.clone()) => {}
            }
            observer.abort();
        });
        Self { identity, leading, holder, release, task }
    }

    /// This candidate's identity (the pod's name and a suffix of this process's own).
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Whether this candidate leads, as it changes.
    pub fn leading(&self) -> watch::Receiver<bool> {
        self.leading.clone()
    }

    /// The Lease's holder as last seen (`None` when free or unknown).
    pub fn holder(&self) -> watch::Receiver<Option<String>> {
        self.holder.clone()
    }

    /// Stops competing and, while leading, gives the Lease up (no holder, so a waiting candidate takes it at once).
    /// Returns when that is done or has failed (then the Lease simply expires).
    pub async fn release(self) -> Result<(), tokio::task::JoinError> {
        let _ = self.release.send(true);
        self.task.await
    }

    /// Resolves when the election task ends without being asked to (it panicked).
    pub async fn failed(&mut self) -> tokio::task::JoinError {
        match (&mut self.task).await {
            Err(error) => error,
            Ok(()) => std::future::pending().await,
        }
    }
}

async fn wait_true(mut flag: watch::Receiver<bool>) {
    let _ = flag.wait_for(|value| *value).await;
}

/// Keeps `seen` equal to the Lease as the watch shows it.
async fn observe(
    watch: impl futures::Stream<Item = Result<Event<Lease>, watcher::Error>>,
    seen: watch::Sender<Seen>,
    holder: watch::Sender<Option<String>>,
) {
    let mut watch = std::pin::pin!(watch);
    let mut listed: Option<Lease> = None;
    while let Some(event) = watch.next().await {
        let update = match event {
            Ok(Event::Apply(lease) | Event::InitApply(lease)) => {
                listed = Some(lease.clone());
                Some(Some(lease))
            }
            Ok(Event::Delete(_)) => {
                listed = None;
                Some(None)
            }
            Ok(Event::Init) => {
                listed = None;
                None
            }
            Ok(Event::InitDone) => Some(listed.clone()),
            Err(error) => {
                debug!(%error, "watching the leader Lease failed; the watcher retries");
                None
            }
        };
        let Some(update) = update else { continue };
        holder.send_replace(update.as_ref().and_then(holder_of));
        seen.send_modify(|seen| *seen = next_seen(seen, update));
    }
}

/// How far the clocks of two replicas may disagree for a candidate to trust the age a Lease's `renewTime` shows.
const CLOCK_SKEW: Duration = Duration::from_secs(1);

/// The new observation: the time of change is kept when neither the holder nor the renew time changed. A term seen
/// for the first time (this candidate just started, or the holder just renewed) is as old as its `renewTime` says,
/// less [`CLOCK_SKEW`]: a candidate that starts just before the leader dies then takes over a lease duration after
/// the last renewal, not after its own start. That is safe while clocks agree within a third of the lease duration
/// plus the skew, since the holder steps down two thirds of a duration after its last renewal.
fn next_seen(previous: &Seen, lease: Option<Lease>) -> Seen {
    let Some(lease) = lease else { return Seen::Absent };
    let since = match previous {
        Seen::Present(old, since) if same_term(old, &lease) => *since,
        _ => {
            let now = Instant::now();
            now.checked_sub(credited_age(&lease)).unwrap_or(now)
        }
    };
    Seen::Present(Box::new(lease), since)
}

/// How long ago, at least, the Lease was renewed by this process's clock: its `renewTime`'s age less the skew,
/// never negative and never more than its duration.
fn credited_age(lease: &Lease) -> Duration {
    let Some(spec) = lease.spec.as_ref() else { return Duration::ZERO };
    let Some(renewed) = spec.renew_time.as_ref() else { return Duration::ZERO };
    let duration = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64);
    let age = Duration::try_from(Timestamp::now().duration_since(renewed.0)).unwrap_or(Duration::ZERO);
    age.saturating_sub(CLOCK_SKEW).min(duration)
}

fn same_term(a: &Lease, b: &Lease) -> bool {
    let key = |lease: &Lease| {
        let spec = lease.spec.clone().unwrap_or_default();
        (spec.holder_identity, spec.renew_time, spec.lease_duration_seconds)
    };
    key(a) == key(b)
}

/// The holder's identity; an empty one is no holder.
fn holder_of(lease: &Lease) -> Option<String> {
    lease.spec.as_ref().and_then(|spec| spec.holder_identity.clone()).filter(|holder| !holder.is_empty())
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

struct Candidate {
    api: Api<Lease>,
    config: ElectionConfig,
    seen: watch::Receiver<Seen>,
    leading: watch::Sender<bool>,
    release: watch::Receiver<bool>,
}

/// How long a candidate waits after an error talking to the apiserver.
const ERROR_BACKOFF: Duration = Duration::from_secs(1);

impl Candidate {
    async fn run(mut self) {
        loop {
            let Some(lease) = self.acquire().await else { return };
            info!(identity = %self.config.identity, "took the leader Lease");
            self.leading.send_replace(true);
            let released = self.hold(lease).await;
            self.leading.send_replace(false);
            if released {
                return;
            }
        }
    }

    fn releasing(&self) -> bool {
        *self.release.borrow()
    }

    /// Waits until this candidate holds the Lease; `None` when asked to release first.
    async fn acquire(&mut self) -> Option<Lease> {
        loop {
            if self.releasing() {
                return None;
            }
            let seen = self.seen.borrow_and_update().clone();
            let wait = match seen {
                Seen::Unknown => None,
                Seen::Absent => match self.api.create(&PostParams::default(), &self.fresh(None)).await {
                    Ok(lease) => return Some(lease),
                    Err(error) if is_conflict(&error) => None,
                    Err(error) => {
                        warn!(%error, "creating the leader Lease failed; retrying");
                        Some(ERROR_BACKOFF)
                    }
                },
                Seen::Present(lease, since) => {
                    let duration = lease
                        .spec
                        .as_ref()
                        .and_then(|spec| spec.lease_duration_seconds)
                        .map_or(self.config.lease_duration, |seconds| Duration::from_secs(seconds.max(0) as u64));
                    let holder = holder_of(&lease);
                    let expires = since + duration;
                    if holder.as_deref() == Some(self.config.identity.as_str())
                        || holder.is_none()
                        || Instant::now() >= expires
                    {
                        match self
                            .api
                            .replace(&self.config.name, &PostParams::default(), &self.fresh(Some(&lease)))
                            .await
                        {
                            Ok(lease) => return Some(lease),
                            // Someone else wrote it first: the watch shows what they did.
                            Err(error) if is_conflict(&error) => Some(Duration::from_millis(500)),
                            Err(error) => {
                                warn!(%error, "taking the leader Lease failed; retrying");
                                Some(ERROR_BACKOFF)
                            }
                        }
                    } else {
                        debug!(holder = holder.as_deref().unwrap_or_default(), "the leader Lease is held");
                        Some(expires.saturating_duration_since(Instant::now()) + Duration::from_millis(50))
                    }
                }
            };
            // Until the Lease changes, the wait is over, or a release is asked for.
            let sleep = async {
                match wait {
                    Some(wait) => tokio::time::sleep(wait).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                changed = self.seen.changed() => if changed.is_err() { return None },
                () = sleep => {}
                _ = self.release.changed() => {}
            }
        }
    }

    /// The Lease held by this candidate from now, built on `current` (keeping its resourceVersion and counting a
    /// change of holder as a transition).
    fn fresh(&self, current: Option<&Lease>) -> Lease {
        let spec = current.and_then(|lease| lease.spec.clone()).unwrap_or_default();
        let ours = spec.holder_identity.as_deref() == Some(self.config.identity.as_str());
        let transitions = spec.lease_transitions.unwrap_or(0) + i32::from(!ours && current.is_some());
        Lease {
            metadata: ObjectMeta {
                name: Some(self.config.name.clone()),
                namespace: Some(self.config.namespace.clone()),
                resource_version: current.and_then(|lease| lease.metadata.resource_version.clone()),
                ..current.map(|lease| lease.metadata.clone()).unwrap_or_default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.config.identity.clone()),
                lease_duration_seconds: Some(self.config.lease_duration.as_secs().clamp(1, i32::MAX as u64) as i32),
                acquire_time: if ours { spec.acquire_time } else { Some(now()) },
                renew_time: Some(now()),
                lease_transitions: Some(transitions),
                ..spec
            }),
        }
    }

    /// Renews `lease` until it is lost (false) or released on request (true).
    async fn hold(&mut self, mut lease: Lease) -> bool {
        let mut renewed = Instant::now();
        loop {
            let due = renewed + self.config.renew_every();
            tokio::select! {
                () = tokio::time::sleep_until(due.into()) => {}
                _ = self.release.changed() => {}
            }
            if self.releasing() {
                self.give_up(lease).await;
                return true;
            }
            match self.renew(&lease, renewed).await {
                Some(next) => {
                    lease = next;
                    renewed = Instant::now();
                }
                None => {
                    warn!(identity = %self.config.identity, "lost the leader Lease");
                    return false;
                }
            }
        }
    }

    /// One renewal, retried until the renew deadline; `None` when the Lease is lost.
    async fn renew(&self, lease: &Lease, renewed: Instant) -> Option<Lease> {
        let deadline = renewed + self.config.renew_deadline();
        let mut current = lease.clone();
        loop {
            match self.api.replace(&self.config.name, &PostParams::default(), &self.fresh(Some(&current))).await {
                Ok(next) => return Some(next),
                Err(error) if is_conflict(&error) => match self.api.get(&self.config.name).await {
                    // Written by someone else meanwhile: still ours only if the holder is still this candidate.
                    Ok(latest) if holder_of(&latest).as_deref() == Some(self.config.identity.as_str()) => {
                        current = latest;
                        continue;
                    }
                    Ok(latest) => {
                        warn!(
                            holder = holder_of(&latest).unwrap_or_default(),
                            "another candidate holds the leader Lease"
                        );
                        return None;
                    }
                    Err(error) => warn!(%error, "reading the leader Lease failed"),
                },
                Err(error) => warn!(%error, "renewing the leader Lease failed; retrying until the renew deadline"),
            }
            if Instant::now() + ERROR_BACKOFF >= deadline {
                return None;
            }
            tokio::time::sleep(ERROR_BACKOFF).await;
            if self.releasing() {
                return None;
            }
        }
    }

    /// Gives the Lease up: no holder, so a waiting candidate takes it at once. On failure it expires on its own.
    async fn give_up(&self, lease: Lease) {
        let mut released = lease;
        if let Some(spec) = released.spec.as_mut() {
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
            spec.renew_time = Some(now());
        }
        match self.api.replace(&self.config.name, &PostParams::default(), &released).await {
            Ok(_) => info!(identity = %self.config.identity, "released the leader Lease"),
            Err(error) => warn!(%error, "releasing the leader Lease failed; it expires on its own"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: Option<&str>, renewed_seconds: i64) -> Lease {
        Lease {
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_owned),
                renew_time: Some(MicroTime(Timestamp::from_second(renewed_seconds).expect("a time"))),
                lease_duration_seconds: Some(15),
                ..LeaseSpec::default()
            }),
            ..Lease::default()
        }
    }

    #[test]
    fn the_time_of_change_moves_only_when_the_term_does() {
        // First seen 5 s after its renewal: counted as about 4 s old.
        let now = Timestamp::now().as_second();
        let first = next_seen(&Seen::Unknown, Some(lease(Some("a"), now - 5)));
        let Seen::Present(_, since) = first.clone() else { panic!("present") };
        // The same renewal seen again (a relist, or another field changed): the clock keeps running.
        let Seen::Present(_, again) = next_seen(&first, Some(lease(Some("a"), now - 5))) else { panic!("present") };
        assert_eq!(again, since);
        // A renewal restarts it.
        let Seen::Present(_, renewed) = next_seen(&first, Some(lease(Some("a"), now))) else { panic!("present") };
        assert!(renewed > since);
        assert!(matches!(next_seen(&first, None), Seen::Absent));
    }

    #[test]
    fn a_term_seen_first_is_as_old_as_its_renewal_less_the_skew() {
        let now = Timestamp::now().as_second();
        // Renewed 5 s ago: counted as 4 s old.
        let Seen::Present(_, since) = next_seen(&Seen::Unknown, Some(lease(Some("a"), now - 5))) else { panic!() };
        let age = since.elapsed();
        assert!(age >= Duration::from_secs(3) && age <= Duration::from_secs(5), "{age:?}");
        // A renewal in this clock's future, or one long ago: never negative, never past the duration.
        let Seen::Present(_, since) = next_seen(&Seen::Unknown, Some(lease(Some("a"), now + 30))) else { panic!() };
        assert!(since.elapsed() < Duration::from_secs(1));
        let Seen::Present(_, since) = next_seen(&Seen::Unknown, Some(lease(Some("a"), now - 3600))) else { panic!() };
        assert!(since.elapsed() >= Duration::from_secs(15) && since.elapsed() < Duration::from_secs(16));
    }

    #[test]
    fn an_empty_holder_is_none() {
        assert_eq!(holder_of(&lease(Some(""), 1)), None);
        assert_eq!(holder_of(&lease(None, 1)), None);
        assert_eq!(holder_of(&lease(Some("a"), 1)).as_deref(), Some("a"));
    }

    #[test]
    fn renewals_come_well_inside_the_lease() {
        let config = ElectionConfig {
            name: "l".into(),
            namespace: "n".into(),
            identity: "i".into(),
            lease_duration: Duration::from_secs(15),
        };
        assert_eq!(config.renew_every(), Duration::from_secs(5));
        assert_eq!(config.renew_deadline(), Duration::from_secs(10));
    }
}
