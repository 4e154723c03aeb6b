//! The fleet benchmark: the release operator against a local control plane and 10 real Squids, at N External
//! Proxies each (`cargo xtask bench fleet 100 1000 10000`; default 100 and 1000).
//!
//! For each N, on a fresh control plane: the apiserver's own time to create and delete N Proxies with nobody
//! reconciling them (the baseline, measured in the same run); then the operator starts and N Proxies are created as
//! fast as the apiserver accepts them (64 at once), probed every 5 s (30 s from 10,000 on) with
//! `healthyThreshold: 1`. Printed per N: all Ready ÷ create time, operator CPU per Proxy during the ramp, resident
//! memory per Proxy above the empty operator, seconds from the last Ready until the operator is back to steady CPU,
//! steady CPU per probe, status writes per Proxy per hour in steady state, `GET /v1/proxies` time (and per returned
//! Proxy), lease + release pairs per second with 16 clients, delete-all ÷ baseline, whether reconciles rose in every
//! 10 s window of the ramp, and how long a spec change of one Proxy took to be reconciled at the ramp's midpoint.
//! With them, where the time went: the control plane's CPU (kube-apiserver and etcd) in each phase, created and Ready
//! counts every half second of the ramp, and the apiserver's own count of Proxy requests during it. Last, with the
//! operator stopped, a second baseline of objects like the operator's: N status writes (the operator's status, by
//! server-side apply) and the delete of those Proxies, by the apiserver alone.
//! Then the ratios between the largest and the smallest N. Everything is loopback; every loop is bounded in time.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use egress_api::{Endpoint, HealthCheck, Proxy, ProxyMode, ProxyPhase, ProxySpec};
use egress_client::{DiscoveryClient, LeaseOptions};
use egress_testenv::{ControlPlane, LocalOrigin, OperatorOptions, OperatorProcess, Squid, SquidOptions, http_get};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};

const NAMESPACE: &str = "fleet";
const SQUIDS: usize = 10;
const CONCURRENCY: usize = 64;
const LEASE_CLIENTS: usize = 16;
const LEASE_PHASE: Duration = Duration::from_secs(5);
const TOKEN: &str = "fleet-bench-lease-token";
/// Seconds of one-second CPU samples after the last Proxy turned Ready: 45, plus one per 100 Proxies.
fn settle_samples(n: usize) -> usize {
    45 + n / 100
}
/// The last samples of those, taken as steady state.
const STEADY_SAMPLES: usize = 15;
/// Seconds averaged when deciding whether the operator is back to steady CPU.
const QUIET_WINDOW: usize = 5;

/// CPU seconds used by `pid` so far.
fn cpu_seconds(pid: u32, ticks: f64) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let Some((_, rest)) = stat.rsplit_once(')') else { return 0.0 };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |index: usize| fields.get(index).and_then(|value| value.parse::<f64>().ok()).unwrap_or(0.0);
    (field(11) + field(12)) / ticks
}

/// Resident memory of `pid` in KiB.
fn rss_kib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.split_whitespace().next())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0.0)
}

/// The pids of this bench's control plane (the kube-apiserver and etcd it started), found by name among its
/// children: their CPU shows whether a phase is bound by the apiserver's work or by the operator's.
fn control_plane_pids() -> Vec<u32> {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let Some((head, rest)) = stat.rsplit_once(')') else { return false };
            let comm = head.split_once('(').map_or("", |(_, comm)| comm);
            let parent = rest.split_whitespace().nth(1).and_then(|value| value.parse::<u32>().ok());
            matches!(comm, "kube-apiserver" | "etcd") && parent == Some(me)
        })
        .collect()
}

/// CPU seconds used by every process in `pids` so far.
fn cpu_seconds_of(pids: &[u32], ticks: f64) -> f64 {
    pids.iter().map(|&pid| cpu_seconds(pid, ticks)).sum()
}

fn ticks_per_second() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|output| String::from_utf8_lossy(&output.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// The apiserver's own count of requests for Proxies, by verb and subresource (from its /metrics).
async fn apiserver_proxy_requests(client: &Client) -> std::collections::BTreeMap<String, f64> {
    let request = http::Request::get("/metrics").body(Vec::new()).expect("a request");
    let Ok(text) = client.request_text(request).await else { return Default::default() };
    let mut counts = std::collections::BTreeMap::new();
    for line in text.lines().filter(|line| line.starts_with("apiserver_request_total{")) {
        let label = |name: &str| {
            line.split(&format!("{name}=\"")).nth(1).and_then(|rest| rest.split('"').next()).unwrap_or("").to_owned()
        };
        if label("resource") != "proxies" {
            continue;
        }
        let Some(value) = line.rsplit_once(' ').and_then(|(_, value)| value.parse::<f64>().ok()) else { continue };
        let subresource = label("subresource");
        let key = if subresource.is_empty() { label("verb") } else { format!("{} {subresource}", label("verb")) };
        *counts.entry(key).or_insert(0.0) += value;
    }
    counts
}

/// What the apiserver counted between two readings, as `verb: count` pairs.
fn request_delta(
    before: &std::collections::BTreeMap<String, f64>,
    after: &std::collections::BTreeMap<String, f64>,
) -> String {
    let parts: Vec<String> = after
        .iter()
        .map(|(key, value)| (key, value - before.get(key).copied().unwrap_or(0.0)))
        .filter(|(_, delta)| *delta > 0.0)
        .map(|(key, delta)| format!("{key} {delta:.0}"))
        .collect();
    parts.join(", ")
}

/// The sum of every series of a counter in the operator's /metrics.
async fn counter(metrics_url: &str, name: &str) -> f64 {
    let Ok((_, text)) = http_get(&format!("{metrics_url}/metrics")).await else { return 0.0 };
    text.lines()
        .filter(|line| line.starts_with(name) && !line.starts_with('#'))
        .filter_map(|line| line.rsplit_once(' ').and_then(|(_, value)| value.parse::<f64>().ok()))
        .sum()
}

fn proxy(index: usize, squids: &[Squid], interval: i32) -> Proxy {
    let squid = squids[index % squids.len()].address();
    let spec = ProxySpec {
        endpoint: Some(Endpoint { host: squid.ip().to_string(), port: i32::from(squid.port()) }),
        health_check: HealthCheck {
            interval_seconds: interval,
            timeout_seconds: 3,
            healthy_threshold: 1,
            unhealthy_threshold: 2,
            probe_url: None,
            ..HealthCheck::default()
        },
        ..ProxySpec::new(ProxyMode::External)
    };
    let mut proxy = Proxy::new(&name(index), spec);
    proxy.metadata.namespace = Some(NAMESPACE.into());
    proxy
}

fn name(index: usize) -> String {
    format!("p-{index:05}")
}

fn ready(proxy: &Proxy) -> bool {
    proxy.status.as_ref().is_some_and(|status| {
        status.phase == Some(ProxyPhase::Ready) && status.health.as_ref().is_some_and(|health| health.healthy)
    })
}

/// What the bench's own watch of the Proxies sees: which are Ready, and how many changes arrived.
#[derive(Default)]
struct Seen {
    ready: Mutex<HashMap<String, bool>>,
    ready_count: AtomicUsize,
    present: AtomicUsize,
    events: AtomicUsize,
}

impl Seen {
    fn apply(&self, proxy: &Proxy) {
        let is_ready = ready(proxy);
        let mut map = self.ready.lock().expect("seen");
        match map.insert(proxy.name_any(), is_ready) {
            None => {
                self.present.fetch_add(1, Ordering::SeqCst);
                if is_ready {
                    self.ready_count.fetch_add(1, Ordering::SeqCst);
                }
            }
            Some(was) if was != is_ready => {
                if is_ready {
                    self.ready_count.fetch_add(1, Ordering::SeqCst);
                } else {
                    self.ready_count.fetch_sub(1, Ordering::SeqCst);
                }
            }
            Some(_) => {}
        }
        self.events.fetch_add(1, Ordering::SeqCst);
    }

    fn delete(&self, proxy: &Proxy) {
        if let Some(was) = self.ready.lock().expect("seen").remove(&proxy.name_any()) {
            self.present.fetch_sub(1, Ordering::SeqCst);
            if was {
                self.ready_count.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.events.fetch_add(1, Ordering::SeqCst);
    }
}

fn watch(client: Client, seen: Arc<Seen>) -> tokio::task::JoinHandle<()> {
    let api: Api<Proxy> = Api::namespaced(client, NAMESPACE);
    tokio::spawn(async move {
        let mut events = watcher(api, watcher::Config::default()).boxed();
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::Apply(proxy) | watcher::Event::InitApply(proxy)) => seen.apply(&proxy),
                Ok(watcher::Event::Delete(proxy)) => seen.delete(&proxy),
                Ok(_) | Err(_) => {}
            }
        }
    })
}

async fn wait_until(what: &str, limit: Duration, check: impl Fn() -> bool) -> Duration {
    let started = Instant::now();
    let mut poll = tokio::time::interval(Duration::from_millis(20));
    while !check() {
        poll.tick().await;
        assert!(started.elapsed() < limit, "{what} did not happen within {limit:?}");
    }
    started.elapsed()
}

async fn create_all(api: &Api<Proxy>, proxies: Vec<Proxy>, created: &AtomicUsize) {
    futures::stream::iter(proxies)
        .map(|proxy| async move {
            for attempt in 0..5 {
                match api.create(&PostParams::default(), &proxy).await {
                    Ok(_) => return,
                    Err(kube::Error::Api(status)) if status.code == 409 => return,
                    Err(error) if attempt == 4 => panic!("creating {}: {error}", proxy.name_any()),
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
        })
        .buffer_unordered(CONCURRENCY)
        .for_each(|()| {
            created.fetch_add(1, Ordering::SeqCst);
            async {}
        })
        .await;
}

async fn delete_all(api: &Api<Proxy>, count: usize) {
    futures::stream::iter(0..count)
        .map(|index| async move {
            let _ = api.delete(&name(index), &DeleteParams::default()).await;
        })
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<()>>()
        .await;
}

/// The figures of one N.
struct Figures {
    n: usize,
    baseline_create: f64,
    baseline_delete: f64,
    create: f64,
    all_ready: f64,
    ramp_cpu_per_proxy_ms: f64,
    rss_per_proxy_kib: f64,
    quiet_after: f64,
    settle_series: Vec<String>,
    steady_cpu_per_probe_us: f64,
    writes_per_proxy_hour: f64,
    list_ms: f64,
    list_returned: usize,
    lease_pairs_per_s: f64,
    delete: f64,
    delete_cpu: f64,
    /// The control plane's CPU seconds in the baseline's create and delete, the ramp and the delete.
    plane_cpu: [f64; 4],
    /// The second baseline: N status writes and the delete of those Proxies, by the apiserver alone, with the
    /// control plane's CPU seconds in each.
    status_writes_alone: (f64, f64),
    status_delete_alone: (f64, f64),
    /// Created and Ready counts every half second of the ramp.
    timeline: Vec<(usize, usize)>,
    /// The apiserver's Proxy requests during the ramp, by verb.
    ramp_requests: String,
    reconcile_windows: (usize, usize),
    spec_change_reconciled_ms: f64,
}

async fn measure(binary: &Path, n: usize, ticks: f64) -> Figures {
    let interval = if n >= 10_000 { 30 } else { 5 };
    // The apiserver alone: the baseline and the operator are measured against the same server, and a
    // controller-manager's garbage collector watching every Proxy would add noise that is not the operator's.
    let options =
        egress_testenv::control_plane::ControlPlaneOptions { controller_manager: false, ..Default::default() };
    let plane = ControlPlane::start_with(options).await.expect("control plane");
    let client = plane.client().await.expect("client");
    let namespace = Namespace {
        metadata: ObjectMeta { name: Some(NAMESPACE.into()), ..ObjectMeta::default() },
        ..Namespace::default()
    };
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &namespace).await.expect("namespace");
    let api: Api<Proxy> = Api::namespaced(client.clone(), NAMESPACE);
    let mut squids = Vec::new();
    for _ in 0..SQUIDS {
        squids.push(Squid::start(SquidOptions::default()).await.expect("squid"));
    }
    let origin = LocalOrigin::start().await.expect("origin");
    let seen = Arc::new(Seen::default());
    let watch_task = watch(client.clone(), seen.clone());
    let plane_pids = control_plane_pids();

    // Baseline: the apiserver alone, same objects, same concurrency, nobody reconciling.
    let started = Instant::now();
    let plane_cpu = cpu_seconds_of(&plane_pids, ticks);
    let created = AtomicUsize::new(0);
    create_all(&api, (0..n).map(|index| proxy(index, &squids, interval)).collect(), &created).await;
    let baseline_create = started.elapsed().as_secs_f64();
    let baseline_create_plane_cpu = cpu_seconds_of(&plane_pids, ticks) - plane_cpu;
    wait_until("the bench's watch sees every Proxy", Duration::from_secs(300), || {
        seen.present.load(Ordering::SeqCst) == n
    })
    .await;
    let started = Instant::now();
    let plane_cpu = cpu_seconds_of(&plane_pids, ticks);
    delete_all(&api, n).await;
    wait_until("baseline deletion", Duration::from_secs(600), || seen.present.load(Ordering::SeqCst) == 0).await;
    let baseline_delete = started.elapsed().as_secs_f64();
    let baseline_delete_plane_cpu = cpu_seconds_of(&plane_pids, ticks) - plane_cpu;

    let options = OperatorOptions {
        providers_yaml: "providers: []\n".into(),
        cluster_id: "fleet".into(),
        lease_token: TOKEN.into(),
        default_probe_url: origin.url(),
        leader_election_namespace: None,
        extra_args: vec![format!("--watch-namespace={NAMESPACE}"), "--probe-concurrency=128".into()],
        environment: Vec::new(),
    };
    let operator = OperatorProcess::start(binary, plane.kubeconfig_path(), &options).await.expect("operator");
    let pid = operator.pid().expect("operator pid");
    let mut poll = tokio::time::interval(Duration::from_millis(100));
    loop {
        poll.tick().await;
        if http_get(&format!("{}/readyz", operator.health_url)).await.is_ok_and(|(status, _)| status == 200) {
            break;
        }
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle_rss = rss_kib(pid);

    // The ramp: reconciles are sampled every 10 s, and at the midpoint one Proxy's spec changes (maxLeases, which
    // bumps its generation without replacing anything) and the time until its status says so is measured.
    let ramp_cpu = cpu_seconds(pid, ticks);
    let plane_cpu = cpu_seconds_of(&plane_pids, ticks);
    let requests_before = apiserver_proxy_requests(&client).await;
    let started = Instant::now();
    let created = Arc::new(AtomicUsize::new(0));
    let ramp_over = Arc::new(AtomicBool::new(false));
    // Where the ramp's time goes: created and Ready counts every half second.
    let timeline = {
        let (created, seen, ramp_over) = (created.clone(), seen.clone(), ramp_over.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            tick.tick().await;
            let mut points = Vec::new();
            while !ramp_over.load(Ordering::SeqCst) {
                tick.tick().await;
                points.push((created.load(Ordering::SeqCst), seen.ready_count.load(Ordering::SeqCst)));
            }
            points
        })
    };
    let windows = {
        let (metrics_url, ramp_over) = (operator.metrics_url.clone(), ramp_over.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(10));
            tick.tick().await;
            let mut last = counter(&metrics_url, "egress_reconcile_reconciles_total").await;
            let (mut rose, mut total) = (0, 0);
            while !ramp_over.load(Ordering::SeqCst) {
                tick.tick().await;
                let now = counter(&metrics_url, "egress_reconcile_reconciles_total").await;
                total += 1;
                if now > last {
                    rose += 1;
                }
                last = now;
            }
            (rose, total)
        })
    };
    let spec_change = {
        let (api, created) = (api.clone(), created.clone());
        tokio::spawn(async move {
            while created.load(Ordering::SeqCst) < n / 2 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let patch = serde_json::json!({ "spec": { "maxLeases": 7 } });
            let changed = Instant::now();
            let patched = api.patch(&name(0), &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch");
            let generation = patched.metadata.generation;
            loop {
                let proxy = api.get(&name(0)).await.expect("get");
                if proxy.status.and_then(|status| status.observed_generation) >= generation {
                    return changed.elapsed().as_secs_f64() * 1000.0;
                }
                assert!(changed.elapsed() < Duration::from_secs(300), "the spec change was never reconciled");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    create_all(&api, (0..n).map(|index| proxy(index, &squids, interval)).collect(), &created).await;
    let create = started.elapsed().as_secs_f64();
    wait_until("every Proxy Ready", Duration::from_secs(1800), || seen.ready_count.load(Ordering::SeqCst) == n).await;
    let all_ready = started.elapsed().as_secs_f64();
    ramp_over.store(true, Ordering::SeqCst);
    let ramp_cpu = cpu_seconds(pid, ticks) - ramp_cpu;
    let ramp_plane_cpu = cpu_seconds_of(&plane_pids, ticks) - plane_cpu;
    let timeline = timeline.await.expect("ramp timeline");
    let ramp_requests = request_delta(&requests_before, &apiserver_proxy_requests(&client).await);
    let reconcile_windows = windows.await.expect("window sampler");
    let spec_change_reconciled_ms = spec_change.await.expect("spec change");

    // Settling: CPU per second after the last Ready; steady state is the last STEADY_SAMPLES seconds.
    let mut samples = Vec::new();
    let mut previous = cpu_seconds(pid, ticks);
    let steady_probes_start = {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        let mut probes_start = 0.0;
        let mut events_start = 0;
        for index in 0..settle_samples(n) {
            tick.tick().await;
            let now = cpu_seconds(pid, ticks);
            samples.push(now - previous);
            previous = now;
            if index == settle_samples(n) - STEADY_SAMPLES - 1 {
                probes_start = counter(&operator.metrics_url, "egress_health_probes_total").await;
                events_start = seen.events.load(Ordering::SeqCst);
            }
        }
        (probes_start, events_start)
    };
    let probes = counter(&operator.metrics_url, "egress_health_probes_total").await - steady_probes_start.0;
    let steady_events = seen.events.load(Ordering::SeqCst) - steady_probes_start.1;
    let steady_cpu: f64 = samples[settle_samples(n) - STEADY_SAMPLES..].iter().sum();
    let steady_rate = steady_cpu / STEADY_SAMPLES as f64;
    // Quiet: from when on every 5 s window's CPU stays within 1.5× steady state (plus 1 % of a core for the
    // timer granularity); 5 s windows, so the 10 s collector and monitor rounds count as steady work, not as noise.
    let bound = (steady_rate * 1.5).max(steady_rate + 0.01);
    let windows: Vec<f64> =
        samples.windows(QUIET_WINDOW).map(|window| window.iter().sum::<f64>() / QUIET_WINDOW as f64).collect();
    let quiet_after = windows.iter().rposition(|&rate| rate > bound).map_or(0.0, |index| (index + QUIET_WINDOW) as f64);
    let series: Vec<String> = samples.iter().map(|sample| format!("{:.0}", sample * 1000.0)).collect();
    let steady_cpu_per_probe_us = if probes > 0.0 { steady_cpu / probes * 1e6 } else { f64::NAN };
    let writes_per_proxy_hour = steady_events as f64 / n as f64 * 3600.0 / STEADY_SAMPLES as f64;
    let rss_per_proxy_kib = (rss_kib(pid) - idle_rss) / n as f64;

    let discovery = DiscoveryClient::new(&operator.discovery_url, Some(TOKEN.into())).expect("discovery client");
    let mut list_times = Vec::new();
    let mut list_returned = 0;
    for _ in 0..11 {
        let started = Instant::now();
        list_returned = discovery.proxies(None, None).await.expect("list").len();
        list_times.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    list_times.sort_by(f64::total_cmp);
    let list_ms = list_times[list_times.len() / 2];

    let pairs = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + LEASE_PHASE;
    let clients: Vec<_> = (0..LEASE_CLIENTS)
        .map(|client| {
            let (discovery, pairs) = (discovery.clone(), pairs.clone());
            tokio::spawn(async move {
                let target = format!("site-{client}.example");
                while Instant::now() < deadline {
                    let lease = discovery.lease(LeaseOptions::for_target(target.clone())).await.expect("lease");
                    lease.release().await.expect("release");
                    pairs.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    futures::future::try_join_all(clients).await.expect("lease clients");
    let lease_pairs_per_s = pairs.load(Ordering::SeqCst) as f64 / LEASE_PHASE.as_secs_f64();

    // The status the operator wrote, for the second baseline below.
    let written_status = api.get(&name(n - 1)).await.expect("a Proxy").status.expect("a status");
    let started = Instant::now();
    let delete_cpu = cpu_seconds(pid, ticks);
    let plane_cpu = cpu_seconds_of(&plane_pids, ticks);
    delete_all(&api, n).await;
    wait_until("deletion through the operator", Duration::from_secs(1800), || seen.present.load(Ordering::SeqCst) == 0)
        .await;
    let delete = started.elapsed().as_secs_f64();
    let delete_cpu = cpu_seconds(pid, ticks) - delete_cpu;
    let delete_plane_cpu = cpu_seconds_of(&plane_pids, ticks) - plane_cpu;
    let remaining = api.list(&Default::default()).await.map(|list| list.items.len()).unwrap_or(0);
    assert_eq!(remaining, 0, "every Proxy is gone");
    drop(operator);

    // A second baseline, the apiserver alone again, with objects like the operator's: the same Proxies, each given
    // the status the operator wrote, by server-side apply under the operator's field manager, 16 at once (the
    // reconciler's bulk lane); then deleted. What one status write costs the apiserver, and what deleting objects
    // that carry a status and its managed fields costs, without the operator running.
    let created = AtomicUsize::new(0);
    create_all(&api, (0..n).map(|index| proxy(index, &squids, interval)).collect(), &created).await;
    wait_until("the bench's watch sees every Proxy again", Duration::from_secs(600), || {
        seen.present.load(Ordering::SeqCst) == n
    })
    .await;
    let started = Instant::now();
    let plane_cpu = cpu_seconds_of(&plane_pids, ticks);
    futures::stream::iter(0..n)
        .map(|index| {
            let (api, status) = (api.clone(), written_status.clone());
            async move {
                let patch = serde_json::json!({
                    "apiVersion": "crawl.example.com/v1alpha1",
                    "kind": "Proxy",
                    "status": status,
                });
                let params = PatchParams::apply("egress-operator").force();
                api.patch_status(&name(index), &params, &Patch::Apply(&patch)).await.expect("a status write");
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<()>>()
        .await;
    wait_until("the bench's watch sees every status", Duration::from_secs(600), || {
        seen.ready_count.load(Ordering::SeqCst) == n
    })
    .await;
    let status_writes_alone = started.elapsed().as_secs_f64();
    let status_writes_plane_cpu = cpu_seconds_of(&plane_pids, ticks) - plane_cpu;
    let started = Instant::now();
    let plane_cpu = cpu_seconds_of(&plane_pids, ticks);
    delete_all(&api, n).await;
    wait_until("the second baseline's deletion", Duration::from_secs(1800), || {
        seen.present.load(Ordering::SeqCst) == 0
    })
    .await;
    let status_delete_alone = started.elapsed().as_secs_f64();
    let status_delete_plane_cpu = cpu_seconds_of(&plane_pids, ticks) - plane_cpu;
    watch_task.abort();
    Figures {
        n,
        baseline_create,
        baseline_delete,
        create,
        all_ready,
        ramp_cpu_per_proxy_ms: ramp_cpu / n as f64 * 1000.0,
        rss_per_proxy_kib,
        quiet_after,
        settle_series: series,
        steady_cpu_per_probe_us,
        writes_per_proxy_hour,
        list_ms,
        list_returned,
        lease_pairs_per_s,
        delete,
        delete_cpu,
        plane_cpu: [baseline_create_plane_cpu, baseline_delete_plane_cpu, ramp_plane_cpu, delete_plane_cpu],
        status_writes_alone: (status_writes_alone, status_writes_plane_cpu),
        status_delete_alone: (status_delete_alone, status_delete_plane_cpu),
        timeline,
        ramp_requests,
        reconcile_windows,
        spec_change_reconciled_ms,
    }
}

fn print(figures: &Figures) {
    let f = figures;
    println!("fleet N = {}", f.n);
    println!(
        "  apiserver alone: create {:.1} s, delete {:.1} s (control plane CPU {:.1} s, {:.1} s)",
        f.baseline_create, f.baseline_delete, f.plane_cpu[0], f.plane_cpu[1]
    );
    println!(
        "  create {:.1} s, all Ready after {:.1} s: all-Ready / create = {:.2} (control plane CPU {:.1} s)",
        f.create,
        f.all_ready,
        f.all_ready / f.create,
        f.plane_cpu[2]
    );
    let points: Vec<String> = f
        .timeline
        .iter()
        .enumerate()
        .map(|(index, (created, ready))| format!("{:.1}:{created}/{ready}", (index + 1) as f64 / 2.0))
        .collect();
    println!("  ramp, seconds:created/Ready: {}", points.join(" "));
    println!("  the apiserver's Proxy requests during the ramp: {}", f.ramp_requests);
    println!("  operator CPU per Proxy during the ramp: {:.2} ms", f.ramp_cpu_per_proxy_ms);
    println!("  resident memory per Proxy above the empty operator: {:.1} KiB", f.rss_per_proxy_kib);
    println!("  back to steady CPU {:.0} s after the last Ready", f.quiet_after);
    println!("  operator CPU ms per second after the last Ready: {}", f.settle_series.join(" "));
    println!("  steady CPU per probe: {:.0} us", f.steady_cpu_per_probe_us);
    println!("  steady status writes per Proxy per hour: {:.2}", f.writes_per_proxy_hour);
    println!(
        "  GET /v1/proxies: {:.2} ms p50 for {} Proxies ({:.2} us per Proxy)",
        f.list_ms,
        f.list_returned,
        f.list_ms * 1000.0 / f.list_returned.max(1) as f64
    );
    println!("  lease+release pairs/s with {LEASE_CLIENTS} clients: {:.0}", f.lease_pairs_per_s);
    println!(
        "  delete all {:.1} s: delete / apiserver's own delete = {:.2} (operator CPU meanwhile {:.1} s, control plane {:.1} s)",
        f.delete,
        f.delete / f.baseline_delete,
        f.delete_cpu,
        f.plane_cpu[3]
    );
    println!(
        "  apiserver alone with the operator's status: {} status writes {:.1} s (control plane CPU {:.1} s), then \
         delete {:.1} s (control plane CPU {:.1} s); delete all / this delete = {:.2}",
        f.n,
        f.status_writes_alone.0,
        f.status_writes_alone.1,
        f.status_delete_alone.0,
        f.status_delete_alone.1,
        f.delete / f.status_delete_alone.0
    );
    // The least a ramp can take: every Proxy is one create and one status write, and the apiserver alone takes this
    // long for each set.
    println!(
        "  all Ready / (the apiserver's own create + its own status writes) = {:.2}",
        f.all_ready / (f.baseline_create + f.status_writes_alone.0)
    );
    println!(
        "  reconciles rose in {} of {} 10 s windows of the ramp; a spec change at the ramp's midpoint was reconciled in {:.0} ms",
        f.reconcile_windows.0, f.reconcile_windows.1, f.spec_change_reconciled_ms
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter(|arg| !arg.starts_with('-'))
        .map(|arg| arg.parse().unwrap_or_else(|_| panic!("fleet sizes are numbers, not {arg:?}")))
        .collect();
    let sizes = if sizes.is_empty() { vec![100, 1000] } else { sizes };
    let binary = Path::new(env!("CARGO_BIN_EXE_egress-operator"));
    let ticks = ticks_per_second();
    println!(
        "fleet benchmark: release operator, {SQUIDS} Squids, External Proxies, healthyThreshold 1, sizes {sizes:?}"
    );
    let mut all = Vec::new();
    for n in sizes {
        let figures = measure(binary, n, ticks).await;
        print(&figures);
        all.push(figures);
    }
    if let (Some(small), Some(large)) = (all.iter().min_by_key(|f| f.n), all.iter().max_by_key(|f| f.n))
        && small.n != large.n
    {
        println!("ratios, N = {} / N = {}:", large.n, small.n);
        println!("  ramp CPU per Proxy: {:.2}", large.ramp_cpu_per_proxy_ms / small.ramp_cpu_per_proxy_ms);
        println!("  steady CPU per probe: {:.2}", large.steady_cpu_per_probe_us / small.steady_cpu_per_probe_us);
        let per_proxy = |f: &Figures| f.list_ms / f.list_returned.max(1) as f64;
        println!("  GET /v1/proxies time per returned Proxy: {:.2}", per_proxy(large) / per_proxy(small));
        println!("  lease+release throughput: {:.2}", large.lease_pairs_per_s / small.lease_pairs_per_s);
    }
}
