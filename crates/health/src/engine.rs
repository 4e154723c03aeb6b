//! The engine: targets added, changed and removed at any time, probed on a jittered schedule from one timer queue
//! with bounded concurrency, and verdict transitions sent on a bounded channel.
//!
//! One scheduler task owns every target. It keeps a min-heap of due times (not a task or timer per target), spawns
//! at most `concurrency` probes at once, and applies each probe's result to that target's counters; a result for a
//! target that changed or was removed meanwhile is dropped by generation number.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tracing::{Instrument, debug, info_span};

use crate::metrics::HealthMetrics;
use crate::probe::{Credentials, FailureReason, ProbeSuccess, ProbeUrl, probe};
use crate::thresholds::{Counters, Verdict as Threshold};

/// What to probe and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// A stable identifier chosen by the caller (the operator uses `namespace/name@host:port`).
    pub id: String,
    /// The proxy's host name or IP address.
    pub proxy_host: String,
    /// The proxy's port.
    pub proxy_port: u16,
    /// Credentials the proxy requires.
    pub credentials: Option<Credentials>,
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
pub struct Transition {
    /// The target's identifier.
    pub id: String,
    /// The new verdict.
    pub healthy: bool,
    /// Why the last probe failed (for an unhealthy verdict).
    pub reason: Option<FailureReason>,
    /// The address the probe target saw, when the probe URL echoes it.
    pub egress_ip: Option<IpAddr>,
    /// When the verdict changed.
    pub at: SystemTime,
}

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

/// Settings of the engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// How many probes run at once.
    pub concurrency: usize,
    /// How many transitions may wait for the consumer before the scheduler waits for it.
    pub transition_capacity: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self { concurrency: 64, transition_capacity: 1024 }
    }
}

enum Command {
    Upsert(Target),
    Remove(String),
}

struct Outcome {
    id: Arc<str>,
    generation: u64,
    result: Result<ProbeSuccess, FailureReason>,
}

struct Entry {
    target: Arc<Target>,
    generation: u64,
    counters: Counters,
    in_flight: bool,
}

/// A running engine. Dropping it stops every probe.
pub struct HealthEngine {
    commands: mpsc::UnboundedSender<Command>,
    verdicts: Arc<RwLock<HashMap<String, CurrentVerdict>>>,
    /// The targets as last given, so an unchanged upsert costs nothing (callers re-send every target on every
    /// change of their source).
    known: std::sync::Mutex<HashMap<String, Target>>,
    task: JoinHandle<()>,
}

impl HealthEngine {
    /// Starts the engine; transitions arrive on the returned receiver.
    pub fn start(
        config: EngineConfig,
        tls: TlsConnector,
        metrics: HealthMetrics,
    ) -> (Self, mpsc::Receiver<Transition>) {
        let (commands, command_receiver) = mpsc::unbounded_channel();
        let (transitions, transition_receiver) = mpsc::channel(config.transition_capacity.max(1));
        let verdicts = Arc::new(RwLock::new(HashMap::new()));
        let scheduler = Scheduler {
            targets: HashMap::new(),
            queue: BinaryHeap::new(),
            next_generation: 0,
            jitter: Jitter::seeded(),
            semaphore: Arc::new(Semaphore::new(config.concurrency.max(1))),
            tls,
            metrics,
            verdicts: verdicts.clone(),
            transitions,
            counts: [0; 3],
        };
        let task = tokio::spawn(scheduler.run(command_receiver).instrument(info_span!("health_engine")));
        (Self { commands, verdicts, known: std::sync::Mutex::default(), task }, transition_receiver)
    }

    /// Adds a target, or changes it; a changed target restarts its counters and loses its verdict. Giving an
    /// unchanged target again does nothing.
    pub fn upsert(&self, target: Target) {
        let mut known = self.known.lock().expect("known targets");
        if known.get(&target.id) == Some(&target) {
            return;
        }
        known.insert(target.id.clone(), target.clone());
        self.verdicts.write().expect("verdict map").remove(&target.id);
        let _ = self.commands.send(Command::Upsert(target));
    }

    /// Stops probing a target at once and forgets its verdict.
    pub fn remove(&self, id: &str) {
        if self.known.lock().expect("known targets").remove(id).is_none() {
            return;
        }
        self.verdicts.write().expect("verdict map").remove(id);
        let _ = self.commands.send(Command::Remove(id.to_owned()));
    }

    /// The identifiers of every target being probed.
    pub fn target_ids(&self) -> Vec<String> {
        self.known.lock().expect("known targets").keys().cloned().collect()
    }

    /// The current verdict of a target, once it has one.
    pub fn verdict(&self, id: &str) -> Option<CurrentVerdict> {
        self.verdicts.read().expect("verdict map").get(id).cloned()
    }
}

impl Drop for HealthEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A small xorshift generator for schedule jitter: spreading start times needs no cryptographic randomness.
struct Jitter(u64);

impl Jitter {
    fn seeded() -> Self {
        let nanos =
            SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |elapsed| elapsed.subsec_nanos());
        Self(u64::from(nanos) | 1)
    }

    /// A duration uniformly in `[0, max)`.
    fn below(&mut self, max: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX).max(1);
        Duration::from_nanos(self.0 % nanos)
    }
}

struct Scheduler {
    targets: HashMap<Arc<str>, Entry>,
    /// Due time, generation and target: the earliest first.
    queue: BinaryHeap<Reverse<(Instant, u64, Arc<str>)>>,
    next_generation: u64,
    jitter: Jitter,
    semaphore: Arc<Semaphore>,
    tls: TlsConnector,
    metrics: HealthMetrics,
    verdicts: Arc<RwLock<HashMap<String, CurrentVerdict>>>,
    transitions: mpsc::Sender<Transition>,
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

impl Scheduler {
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>) {
        let (outcome_sender, mut outcomes) = mpsc::unbounded_channel::<Outcome>();
        loop {
            let next_due = self.queue.peek().map(|Reverse((due, _, _))| *due);
            tokio::select! {
                command = commands.recv() => match command {
                    Some(command) => self.command(command),
                    None => return,
                },
                Some(outcome) = outcomes.recv() => self.outcome(outcome).await,
                () = sleep_until(next_due) => self.start_due(&outcome_sender).await,
            }
        }
    }

    fn command(&mut self, command: Command) {
        match command {
            Command::Upsert(target) => {
                let id: Arc<str> = Arc::from(target.id.as_str());
                if self.targets.get(&id).is_some_and(|entry| *entry.target == target) {
                    return;
                }
                self.next_generation += 1;
                let generation = self.next_generation;
                // A random first offset within one interval spreads a fleet's probes over time.
                let first = Instant::now() + self.jitter.below(target.interval);
                self.queue.push(Reverse((first, generation, id.clone())));
                self.verdicts.write().expect("verdict map").remove(&target.id);
                let entry =
                    Entry { target: Arc::new(target), generation, counters: Counters::default(), in_flight: false };
                self.counts[slot(Threshold::Unknown)] += 1;
                if let Some(replaced) = self.targets.insert(id, entry) {
                    self.counts[slot(replaced.counters.verdict())] -= 1;
                }
            }
            Command::Remove(id) => {
                if let Some(removed) = self.targets.remove(id.as_str()) {
                    self.counts[slot(removed.counters.verdict())] -= 1;
                }
                self.verdicts.write().expect("verdict map").remove(&id);
            }
        }
        self.publish_counts();
    }

    async fn start_due(&mut self, outcomes: &mpsc::UnboundedSender<Outcome>) {
        let now = Instant::now();
        while let Some(Reverse((due, generation, id))) = self.queue.peek().cloned() {
            if due > now {
                break;
            }
            self.queue.pop();
            let Some(entry) = self.targets.get_mut(&id) else { continue };
            if entry.generation != generation {
                continue;
            }
            let interval = entry.target.interval.max(Duration::from_secs(1));
            self.queue.push(Reverse((due + interval, generation, id.clone())));
            if entry.in_flight {
                // The previous probe is still running (it has its own timeout); skip this round.
                continue;
            }
            entry.in_flight = true;
            let target = entry.target.clone();
            let permit = self.semaphore.clone().acquire_owned().await.expect("the semaphore is never closed");
            let tls = self.tls.clone();
            let outcomes = outcomes.clone();
            let span = info_span!("health_probe", target = %target.id);
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
                    let _ = outcomes.send(Outcome { id, generation, result });
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
        let Some(entry) = self.targets.get_mut(&outcome.id) else { return };
        if entry.generation != outcome.generation {
            return;
        }
        entry.in_flight = false;
        let success = outcome.result.is_ok();
        let before = entry.counters.verdict();
        let changed = entry.counters.record(success, entry.target.healthy_threshold, entry.target.unhealthy_threshold);
        let (reason, egress_ip) = match outcome.result {
            Ok(found) => (None, found.egress_ip),
            Err(reason) => (Some(reason), None),
        };
        if let Some(reason) = &reason {
            debug!(target = %outcome.id, %reason, "probe failed");
        }
        let now = SystemTime::now();
        {
            let mut verdicts = self.verdicts.write().expect("verdict map");
            match changed {
                Some(verdict) => {
                    verdicts.insert(
                        outcome.id.to_string(),
                        CurrentVerdict {
                            healthy: verdict == Threshold::Healthy,
                            since: now,
                            last_error: reason.clone(),
                            egress_ip,
                        },
                    );
                }
                None => {
                    if let Some(current) = verdicts.get_mut(&*outcome.id) {
                        if reason.is_some() {
                            current.last_error = reason.clone();
                        }
                        if egress_ip.is_some() {
                            current.egress_ip = egress_ip;
                        }
                    }
                }
            }
        }
        if let Some(verdict) = changed {
            self.counts[slot(before)] -= 1;
            self.counts[slot(verdict)] += 1;
            self.publish_counts();
            let transition = Transition {
                id: outcome.id.to_string(),
                healthy: verdict == Threshold::Healthy,
                reason,
                egress_ip,
                at: now,
            };
            // Back-pressure: a slow consumer slows probing rather than losing a transition.
            let _ = self.transitions.send(transition).await;
        }
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
