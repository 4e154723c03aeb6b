//! The engine: targets added, changed and removed at any time, probed on a jittered schedule from one timer queue
//! with bounded concurrency, and verdict transitions sent on a bounded channel.
//!
//! One scheduler task owns every target. It keeps a min-heap of due times (not a task or timer per target), spawns
//! at most `concurrency` probes at once, and applies each probe's result to that target's counters; a result for a
//! target that changed or was removed meanwhile is dropped by generation number.

use std::borrow::Borrow;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use egress_fleet::ProxyCredentials;
use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tracing::{Instrument, debug, info_span};

use crate::metrics::HealthMetrics;
use crate::probe::{FailureReason, ProbeSuccess, ProbeUrl, probe};
use crate::thresholds::{Counters, Verdict as Threshold};
use crate::verdicts::{CurrentVerdict, TargetKey, Verdicts};

/// What to probe and how, for a target identified by `K`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target<K = String> {
    /// A stable identifier chosen by the caller (the operator uses a typed Proxy reference and address).
    pub id: K,
    /// The proxy's host name or IP address.
    pub proxy_host: String,
    /// The proxy's port.
    pub proxy_port: u16,
    /// Credentials the proxy requires.
    pub credentials: Option<ProxyCredentials>,
    /// The URL fetched through the proxy.
    pub probe_url: ProbeUrl,
    /// Time between probes (at least one second).
    pub interval: Duration,
    /// Time one probe may take.
    pub timeout: Duration,
    /// Consecutive successes to become healthy.
    pub healthy_threshold: u32,
    /// Consecutive failures to become unhealthy.
    pub unhealthy_threshold: u32,
}

/// A change of verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition<K = String> {
    /// The target's identifier.
    pub id: K,
    /// The new verdict.
    pub healthy: bool,
    /// Why the last probe failed (for an unhealthy verdict).
    pub reason: Option<FailureReason>,
    /// The address the probe target saw, when the probe URL echoes it.
    pub egress_ip: Option<IpAddr>,
    /// When the verdict changed.
    pub at: SystemTime,
}

/// Settings of the engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// How many probes run at once.
    pub concurrency: usize,
    /// How many transitions may wait for the consumer before the scheduler waits for it.
    pub transition_capacity: usize,
    /// The first probe of a target whose verdict is known (seeded from a previous run, or a target changed) starts
    /// within this window (jittered), instead of within one interval: a restarted operator learns the state of its
    /// fleet in seconds, spread out, not after a whole interval. `None` uses one interval. A target with no verdict
    /// at all is probed at once.
    pub first_probe_within: Option<Duration>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self { concurrency: 64, transition_capacity: 1024, first_probe_within: None }
    }
}

enum Command<K> {
    Upsert(Arc<Target<K>>),
    Remove(K),
}

struct Outcome {
    generation: u64,
    result: Result<ProbeSuccess, FailureReason>,
}

struct Entry<K> {
    target: Arc<Target<K>>,
    generation: u64,
    counters: Counters,
    in_flight: bool,
    /// Probed at once on arrival: its second probe comes at a random point of the interval, so a fleet created in a
    /// burst is probed evenly from then on, not in the burst's shape.
    spread_next: bool,
}

/// A running engine. Dropping it stops probing (probes in flight end by their timeout, their results unread) and
/// forgets every verdict of its targets: an engine that no longer probes no longer vouches for them, and a shared
/// store holds only what a running engine stands behind.
pub struct HealthEngine<K: TargetKey = String> {
    commands: mpsc::UnboundedSender<Command<K>>,
    verdicts: Verdicts<K>,
    /// The targets as last given, so an unchanged upsert costs nothing.
    known: std::sync::Mutex<HashMap<K, Arc<Target<K>>>>,
}

impl<K: TargetKey> HealthEngine<K> {
    /// Starts the engine with a verdict store of its own; transitions arrive on the returned receiver.
    pub fn start(
        config: EngineConfig,
        tls: TlsConnector,
        metrics: HealthMetrics,
    ) -> (Self, mpsc::Receiver<Transition<K>>) {
        Self::start_with(config, tls, metrics, Verdicts::new())
    }

    /// Starts the engine writing into `verdicts`, a store others read too; transitions arrive on the returned
    /// receiver. A verdict already in the store for a target (seeded) stands until the probes overturn it by the
    /// thresholds, and the engine starts that target's counters from it.
    pub fn start_with(
        config: EngineConfig,
        tls: TlsConnector,
        metrics: HealthMetrics,
        verdicts: Verdicts<K>,
    ) -> (Self, mpsc::Receiver<Transition<K>>) {
        let (commands, command_receiver) = mpsc::unbounded_channel();
        let (transitions, transition_receiver) = mpsc::channel(config.transition_capacity.max(1));
        let scheduler = Scheduler {
            targets: HashMap::new(),
            keys: HashMap::new(),
            queue: BinaryHeap::new(),
            next_generation: 0,
            jitter: Jitter::seeded(),
            first_probe_within: config.first_probe_within,
            semaphore: Arc::new(Semaphore::new(config.concurrency.max(1))),
            tls,
            metrics,
            verdicts: verdicts.clone(),
            transitions,
            counts: [0; 3],
        };
        tokio::spawn(scheduler.run(command_receiver).instrument(info_span!("health_engine")));
        (Self { commands, verdicts, known: std::sync::Mutex::default() }, transition_receiver)
    }

    /// Adds a target, or changes it; a changed target restarts its counters and loses its verdict. Giving an
    /// unchanged target again does nothing.
    pub fn upsert(&self, target: Target<K>) {
        self.upsert_seeded(target, || None);
    }

    /// Like [`HealthEngine::upsert`], and a target new to this engine with no verdict in the store starts from the
    /// verdict `seed` gives (known from elsewhere, such as a status written before a restart): the verdict stands,
    /// and the target's counters start from it, until the probes overturn it by the thresholds. `seed` is called
    /// only for such a target.
    pub fn upsert_seeded(&self, target: Target<K>, seed: impl FnOnce() -> Option<CurrentVerdict>) {
        let mut known = self.known.lock().expect("known targets");
        let changed = match known.get(&target.id) {
            Some(old) if **old == target => return,
            Some(_) => true,
            None => false,
        };
        let target = Arc::new(target);
        known.insert(target.id.clone(), target.clone());
        if changed {
            self.verdicts.remove::<K>(&target.id);
        } else if self.verdicts.get(&target.id).is_none()
            && let Some(verdict) = seed()
        {
            // Before the scheduler hears of the target, so it starts the counters from the seed.
            self.verdicts.set(target.id.clone(), verdict);
        }
        let _ = self.commands.send(Command::Upsert(target));
    }

    /// Stops probing a target at once and forgets its verdict.
    pub fn remove<Q>(&self, id: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let Some((key, _)) = self.known.lock().expect("known targets").remove_entry(id) else { return };
        self.verdicts.remove::<K>(&key);
        let _ = self.commands.send(Command::Remove(key));
    }

    /// Whether `id` is being probed.
    pub fn contains<Q>(&self, id: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.known.lock().expect("known targets").contains_key(id)
    }

    /// The identifiers of every target being probed.
    pub fn target_ids(&self) -> Vec<K> {
        self.known.lock().expect("known targets").keys().cloned().collect()
    }

    /// How many targets are probed.
    pub fn len(&self) -> usize {
        self.known.lock().expect("known targets").len()
    }

    /// Whether no target is probed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The current verdict of a target, once it has one.
    pub fn verdict<Q>(&self, id: &Q) -> Option<CurrentVerdict>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.verdicts.get(id)
    }

    /// The store the engine writes its verdicts into.
    pub fn verdicts(&self) -> &Verdicts<K> {
        &self.verdicts
    }
}

/// Schedule jitter: spreading start times needs no cryptographic randomness, so `fastrand`'s generator does.
struct Jitter(fastrand::Rng);

impl Jitter {
    fn seeded() -> Self {
        Self(fastrand::Rng::new())
    }

    /// A duration uniformly in `[0, max)`.
    fn below(&mut self, max: Duration) -> Duration {
        let nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX).max(1);
        Duration::from_nanos(self.0.u64(..nanos))
    }
}

struct Scheduler<K: TargetKey> {
    targets: HashMap<K, Entry<K>>,
    /// Which target each live generation belongs to: the queue holds generations only, so it never clones keys.
    keys: HashMap<u64, K>,
    /// Due time and generation: the earliest first.
    queue: BinaryHeap<Reverse<(Instant, u64)>>,
    next_generation: u64,
    jitter: Jitter,
    first_probe_within: Option<Duration>,
    semaphore: Arc<Semaphore>,
    tls: TlsConnector,
    metrics: HealthMetrics,
    verdicts: Verdicts<K>,
    transitions: mpsc::Sender<Transition<K>>,
    /// Targets by verdict (healthy, unhealthy, unknown), kept up to date incrementally for the gauges.
    counts: [i64; 3],
}

fn slot(verdict: Threshold) -> usize {
    match verdict {
        Threshold::Healthy => 0,
        Threshold::Unhealthy => 1,
        Threshold::Unknown => 2,
    }
}

impl<K: TargetKey> Scheduler<K> {
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command<K>>) {
        let (outcome_sender, mut outcomes) = mpsc::unbounded_channel::<Outcome>();
        loop {
            let next_due = self.queue.peek().map(|Reverse((due, _))| *due);
            tokio::select! {
                biased;
                command = commands.recv() => match command {
                    Some(command) => self.command(command),
                    None => return self.forget_all(),
                },
                Some(outcome) = outcomes.recv() => self.outcome(outcome).await,
                () = sleep_until(next_due) => self.start_due(&outcome_sender).await,
            }
        }
    }

    fn command(&mut self, command: Command<K>) {
        match command {
            Command::Upsert(target) => {
                if self.targets.get(&target.id).is_some_and(|entry| *entry.target == *target) {
                    return;
                }
                self.next_generation += 1;
                let generation = self.next_generation;
                // A seeded verdict starts the counters where it stands, so the thresholds apply from there.
                let seeded = self.verdicts.get(&target.id);
                // A target with a known verdict (a restart, a changed spec) gets a random first offset, which spreads
                // a fleet's probes over time; a new one is probed at once, since nothing is known about it and its
                // Proxy waits for the first verdict to say Ready (the probe concurrency bounds a burst).
                let known = seeded.is_some();
                let first = if known {
                    let window = self.first_probe_within.unwrap_or(target.interval).min(target.interval);
                    Instant::now() + self.jitter.below(window)
                } else {
                    Instant::now()
                };
                self.queue.push(Reverse((first, generation)));
                self.keys.insert(generation, target.id.clone());
                let counters = match seeded {
                    Some(seeded) => Counters::seeded(seeded.healthy),
                    None => Counters::default(),
                };
                self.counts[slot(counters.verdict())] += 1;
                let entry =
                    Entry { target: target.clone(), generation, counters, in_flight: false, spread_next: !known };
                if let Some(replaced) = self.targets.insert(target.id.clone(), entry) {
                    self.counts[slot(replaced.counters.verdict())] -= 1;
                    self.keys.remove(&replaced.generation);
                }
            }
            Command::Remove(id) => {
                if let Some(removed) = self.targets.remove(&id) {
                    self.counts[slot(removed.counters.verdict())] -= 1;
                    self.keys.remove(&removed.generation);
                }
            }
        }
        self.publish_counts();
    }

    async fn start_due(&mut self, outcomes: &mpsc::UnboundedSender<Outcome>) {
        let now = Instant::now();
        while let Some(Reverse((due, generation))) = self.queue.peek().copied() {
            if due > now {
                break;
            }
            self.queue.pop();
            let Some(id) = self.keys.get(&generation) else { continue };
            let Some(entry) = self.targets.get_mut(id) else { continue };
            let interval = entry.target.interval.max(Duration::from_secs(1));
            let next = if std::mem::take(&mut entry.spread_next) {
                due + self.jitter.below(interval).max(Duration::from_millis(100))
            } else {
                due + interval
            };
            self.queue.push(Reverse((next, generation)));
            let Some(entry) = self.targets.get_mut(id) else { continue };
            if entry.in_flight {
                // The previous probe is still running (it has its own timeout); skip this round.
                continue;
            }
            entry.in_flight = true;
            let target = entry.target.clone();
            let permit = self.semaphore.clone().acquire_owned().await.expect("the semaphore is never closed");
            let tls = self.tls.clone();
            let outcomes = outcomes.clone();
            let span = info_span!("health_probe", target = ?target.id);
            tokio::spawn(
                async move {
                    let result = probe(
                        &target.proxy_host,
                        target.proxy_port,
                        target.credentials.as_ref(),
                        &target.probe_url,
                        target.timeout,
                        &tls,
                    )
                    .await;
                    drop(permit);
                    let _ = outcomes.send(Outcome { generation, result });
                }
                .instrument(span),
            );
        }
    }

    async fn outcome(&mut self, outcome: Outcome) {
        let (kind, latency) = match &outcome.result {
            Ok(success) => ("ok", Some(success.latency.as_secs_f64())),
            Err(reason) => (reason.kind(), None),
        };
        self.metrics.probe(kind, latency);
        let Some(id) = self.keys.get(&outcome.generation) else { return };
        let Some(entry) = self.targets.get_mut(id) else { return };
        entry.in_flight = false;
        let success = outcome.result.is_ok();
        let before = entry.counters.verdict();
        let changed = entry.counters.record(success, entry.target.healthy_threshold, entry.target.unhealthy_threshold);
        let (reason, egress_ip) = match outcome.result {
            Ok(found) => (None, found.egress_ip),
            Err(reason) => (Some(reason), None),
        };
        if let Some(reason) = &reason {
            debug!(target = ?id, %reason, "probe failed");
        }
        let now = SystemTime::now();
        let Some(verdict) = changed else {
            self.verdicts.update_details(id, reason, egress_ip);
            return;
        };
        let id = id.clone();
        let healthy = verdict == Threshold::Healthy;
        // A transition that only confirms a seeded verdict keeps the seed's time; its details are refreshed.
        match self.verdicts.get(&id) {
            Some(seeded) if seeded.healthy == healthy => self.verdicts.update_details(&id, reason.clone(), egress_ip),
            _ => self
                .verdicts
                .set(id.clone(), CurrentVerdict { healthy, since: now, last_error: reason.clone(), egress_ip }),
        }
        self.counts[slot(before)] -= 1;
        self.counts[slot(verdict)] += 1;
        self.publish_counts();
        let transition = Transition { id, healthy, reason, egress_ip, at: now };
        // Back-pressure: a slow consumer slows probing rather than losing a transition.
        let _ = self.transitions.send(transition).await;
    }

    /// The engine was dropped: its verdicts go, written by this task (the store's only writer) after its last
    /// verdict, so none outlives it.
    fn forget_all(mut self) {
        for (id, _) in self.targets.drain() {
            self.verdicts.remove::<K>(&id);
        }
        self.counts = [0; 3];
        self.publish_counts();
    }

    fn publish_counts(&self) {
        let [healthy, unhealthy, unknown] = self.counts;
        self.metrics.targets(healthy, unhealthy, unknown);
    }
}

async fn sleep_until(due: Option<Instant>) {
    match due {
        Some(due) => tokio::time::sleep_until(due).await,
        None => std::future::pending().await,
    }
}
