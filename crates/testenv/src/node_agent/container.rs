//! One container's life: its process under a wrapper that dies with the test process, its probes, and kubelet's
//! restart policy with back-off.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Probe;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::Timestamp;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use super::spec::ContainerPlan;
use crate::process::Process;

/// Kubelet's crash-loop back-off: the first restart is at once, then 10 s doubling to 5 minutes, reset after
/// 10 minutes of running.
const BACKOFF_START: Duration = Duration::from_secs(10);
const BACKOFF_MAX: Duration = Duration::from_secs(300);
const BACKOFF_RESET: Duration = Duration::from_secs(600);

/// How a container's state looks in the pod's status.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum State {
    Waiting { reason: String, message: String },
    Running { started_at: Timestamp },
    Terminated { exit_code: i32, reason: String, started_at: Timestamp, finished_at: Timestamp },
}

/// What the pod's status shows of one container, and what tests ask the agent about it.
#[derive(Clone, Debug)]
pub(crate) struct View {
    pub name: String,
    pub image: String,
    pub pid: Option<u32>,
    pub ready: bool,
    pub started: bool,
    pub restart_count: i32,
    pub state: State,
    pub last_state: Option<State>,
    pub log: PathBuf,
}

impl View {
    pub(crate) fn new(plan: &ContainerPlan, log: PathBuf) -> Self {
        Self {
            name: plan.name.clone(),
            image: plan.image.clone(),
            pid: None,
            ready: false,
            started: false,
            restart_count: 0,
            state: State::Waiting { reason: "ContainerCreating".into(), message: String::new() },
            last_state: None,
            log,
        }
    }
}

/// A probe's settings with kubelet's defaults.
struct ProbeTiming {
    initial_delay: Duration,
    period: Duration,
    timeout: Duration,
    success_threshold: u32,
    failure_threshold: u32,
}

impl ProbeTiming {
    fn of(probe: &Probe) -> Self {
        let seconds =
            |value: Option<i32>, default: u64| Duration::from_secs(value.map_or(default, |v| v.max(0) as u64));
        Self {
            initial_delay: seconds(probe.initial_delay_seconds, 0),
            period: seconds(probe.period_seconds, 10).max(Duration::from_secs(1)),
            timeout: seconds(probe.timeout_seconds, 1).max(Duration::from_secs(1)),
            success_threshold: probe.success_threshold.map_or(1, |v| v.max(1) as u32),
            failure_threshold: probe.failure_threshold.map_or(3, |v| v.max(1) as u32),
        }
    }
}

/// The running state of one probe.
struct Prober {
    probe: Probe,
    timing: ProbeTiming,
    next: Instant,
    successes: u32,
    failures: u32,
}

impl Prober {
    fn new(probe: Option<&Probe>, started: Instant) -> Option<Self> {
        let probe = probe?.clone();
        let timing = ProbeTiming::of(&probe);
        Some(Self { next: started + timing.initial_delay, probe, timing, successes: 0, failures: 0 })
    }

    fn due(&self, now: Instant) -> bool {
        now >= self.next
    }

    /// Records one result; returns Some(true) once the success threshold is met, Some(false) once the failure
    /// threshold is, None while neither.
    fn record(&mut self, ok: bool, now: Instant) -> Option<bool> {
        self.next = now + self.timing.period;
        if ok {
            self.failures = 0;
            self.successes += 1;
            (self.successes >= self.timing.success_threshold).then_some(true)
        } else {
            self.successes = 0;
            self.failures += 1;
            (self.failures >= self.timing.failure_threshold).then_some(false)
        }
    }
}

/// Runs one probe once.
async fn run_probe(probe: &Probe, timeout: Duration, plan: &ContainerPlan, ip: Ipv4Addr, pid: u32) -> bool {
    let port = |port: &IntOrString| -> Option<u16> {
        match port {
            IntOrString::Int(number) => u16::try_from(*number).ok(),
            IntOrString::String(name) => plan.ports.get(name).copied().or_else(|| name.parse().ok()),
        }
    };
    let attempt = async {
        if let Some(action) = &probe.http_get {
            let host: IpAddr = action.host.as_deref().and_then(|host| host.parse().ok()).unwrap_or(IpAddr::V4(ip));
            let Some(port) = port(&action.port) else { return false };
            let path = action.path.clone().unwrap_or_else(|| "/".into());
            http_status(SocketAddr::new(host, port), &path).await.is_some_and(|status| (200..400).contains(&status))
        } else if let Some(action) = &probe.tcp_socket {
            let host: IpAddr = action.host.as_deref().and_then(|host| host.parse().ok()).unwrap_or(IpAddr::V4(ip));
            let Some(port) = port(&action.port) else { return false };
            tokio::net::TcpStream::connect(SocketAddr::new(host, port)).await.is_ok()
        } else if let Some(action) = &probe.exec {
            let pid = pid.to_string();
            let argv: Vec<String> = plan
                .exec_prefix
                .iter()
                .map(|part| part.replace("{pid}", &pid))
                .chain(action.command.iter().flatten().cloned())
                .collect();
            let Some((program, args)) = argv.split_first() else { return false };
            let mut command = tokio::process::Command::new(program);
            command.args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).kill_on_drop(true);
            command.status().await.is_ok_and(|status| status.success())
        } else {
            // gRPC probes are not used by anything this agent runs; a probe it cannot run fails, loudly.
            eprintln!("egress-testenv node agent: container {}: unsupported probe kind, counted as failed", plan.name);
            false
        }
    };
    tokio::time::timeout(timeout, attempt).await.unwrap_or(false)
}

/// The status code of a plain HTTP/1.1 GET.
async fn http_status(address: SocketAddr, path: &str) -> Option<u16> {
    let mut stream = tokio::net::TcpStream::connect(address).await.ok()?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nUser-Agent: kube-probe/egress-testenv\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut head = vec![0u8; 64];
    let read = stream.read(&mut head).await.ok()?;
    let text = String::from_utf8_lossy(&head[..read]);
    text.split_whitespace().nth(1)?.parse().ok()
}

/// What ends one run of the process.
enum Ended {
    Exited(i32),
    LivenessFailed(i32),
    Stopped,
}

/// Runs a container until `stop` carries a grace period, restarting it as `restart_policy` says; every change is
/// written to `view` and announced on `changed`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    plan: ContainerPlan,
    restart_policy: String,
    grace: Duration,
    ip: Ipv4Addr,
    dir: PathBuf,
    view: Arc<Mutex<View>>,
    changed: watch::Sender<()>,
    mut stop: watch::Receiver<Option<Duration>>,
) {
    let update = |apply: &dyn Fn(&mut View)| {
        apply(&mut view.lock().expect("container view"));
        changed.send_replace(());
    };
    let log = view.lock().expect("container view").log.clone();
    let exit_file = dir.join(format!("{}.exit", plan.name));
    let mut backoff: Option<Duration> = None;
    loop {
        if stop.borrow().is_some() {
            return;
        }
        let started = Instant::now();
        let started_at = Timestamp::now();
        let mut process = match Process::spawn(&plan.script, &log, &exit_file) {
            Ok(process) => process,
            Err(error) => {
                let message = format!("{error:#}");
                update(&|view| {
                    view.state = State::Waiting { reason: "RunContainerError".into(), message: message.clone() }
                });
                return;
            }
        };
        let pid = process.pid;
        update(&|view| {
            view.pid = Some(pid);
            view.started = plan.startup.is_none();
            view.ready = false;
            view.state = State::Running { started_at };
        });
        let mut startup = Prober::new(plan.startup.as_ref(), started);
        let mut readiness = Prober::new(plan.readiness.as_ref(), started);
        let mut liveness = Prober::new(plan.liveness.as_ref(), started);
        if readiness.is_none() {
            // No readiness probe: ready once started, as kubelet does.
            update(&|view| view.ready = view.started);
        }
        let ended = loop {
            if let Some(code) = process.exited() {
                break Ended::Exited(code);
            }
            let now = Instant::now();
            let startup_done = startup.is_none();
            if let Some(prober) = startup.as_mut().filter(|prober| prober.due(now)) {
                let ok = run_probe(&prober.probe, prober.timing.timeout, &plan, ip, pid).await;
                match prober.record(ok, Instant::now()) {
                    Some(true) => {
                        startup = None;
                        let no_readiness = readiness.is_none();
                        update(&|view| {
                            view.started = true;
                            view.ready = no_readiness;
                        });
                    }
                    Some(false) => break Ended::LivenessFailed(process.terminate(grace).await),
                    None => {}
                }
            }
            if startup_done {
                if let Some(prober) = readiness.as_mut().filter(|prober| prober.due(now)) {
                    let ok = run_probe(&prober.probe, prober.timing.timeout, &plan, ip, pid).await;
                    if let Some(ready) = prober.record(ok, Instant::now())
                        && view.lock().expect("container view").ready != ready
                    {
                        update(&|view| view.ready = ready);
                    }
                }
                if let Some(prober) = liveness.as_mut().filter(|prober| prober.due(now)) {
                    let ok = run_probe(&prober.probe, prober.timing.timeout, &plan, ip, pid).await;
                    if prober.record(ok, Instant::now()) == Some(false) {
                        eprintln!(
                            "egress-testenv node agent: container {} failed its liveness probe; restarting it",
                            plan.name
                        );
                        break Ended::LivenessFailed(process.terminate(grace).await);
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                _ = stop.changed() => {
                    let grace = stop.borrow().unwrap_or(grace);
                    let code = process.terminate(grace).await;
                    let finished_at = Timestamp::now();
                    update(&|view| {
                        view.ready = false;
                        view.pid = None;
                        view.state = State::Terminated {
                            exit_code: code,
                            reason: if code == 0 { "Completed".into() } else { "Error".into() },
                            started_at,
                            finished_at,
                        };
                    });
                    break Ended::Stopped;
                }
            }
        };
        let code = match ended {
            Ended::Stopped => return,
            Ended::Exited(code) | Ended::LivenessFailed(code) => code,
        };
        let finished_at = Timestamp::now();
        let terminated = State::Terminated {
            exit_code: code,
            reason: if code == 0 { "Completed".into() } else { "Error".into() },
            started_at,
            finished_at,
        };
        let restart = !matches!((restart_policy.as_str(), &ended), ("Never", _) | ("OnFailure", Ended::Exited(0)));
        if !restart {
            update(&|view| {
                view.pid = None;
                view.ready = false;
                view.state = terminated.clone();
            });
            return;
        }
        if started.elapsed() > BACKOFF_RESET {
            backoff = None;
        }
        let delay = backoff.unwrap_or(Duration::ZERO);
        backoff = Some(backoff.map_or(BACKOFF_START, |previous| (previous * 2).min(BACKOFF_MAX)));
        update(&|view| {
            view.pid = None;
            view.ready = false;
            view.restart_count += 1;
            view.last_state = Some(terminated.clone());
            view.state = if delay.is_zero() {
                terminated.clone()
            } else {
                State::Waiting {
                    reason: "CrashLoopBackOff".into(),
                    message: format!("back-off {}s restarting failed container {}", delay.as_secs(), plan.name),
                }
            };
        });
        drop(process);
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            _ = stop.changed() => return,
        }
    }
}
