//! The Python and Node clients' tests (`clients/python/tests`, `clients/node/test`) against a live operator: the
//! build of `egress-operator` on the local control plane, three External Proxies on real Squids (each reaching
//! origins from an address of its own), and a local origin; one such world per client, so their cooldowns never meet.
//! `cargo xtask test` provides the rest: a venv with the Python client's pinned test dependencies (named by
//! `EGRESS_PYTHON`) and the Node client's modules (`clients/node/node_modules`, from its lock file).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use egress_api::{Proxy, ProxyPhase};
use egress_client::DiscoveryClient;
use egress_testenv::{
    GatewayProcess, LocalOrigin, OperatorOptions, OperatorProcess, Squid, SquidOptions, TestNamespace, eventually,
};
use kube::api::{Api, PostParams};

mod common;

const WAIT: Duration = Duration::from_secs(120);
const TOKEN: &str = "client-tests-token-0123456789";
const PROXIES: usize = 3;

/// An operator with three healthy External Proxies on Squids of their own, a gateway leasing from it, and an origin.
struct Live {
    _ns: TestNamespace,
    _squids: Vec<Squid>,
    origin: LocalOrigin,
    operator: OperatorProcess,
    gateway: GatewayProcess,
}

impl Live {
    async fn start(prefix: &str) -> Live {
        Self::start_with(prefix, None).await
    }

    /// Three Proxies with `cooldown` as their `spec.cooldown`.
    async fn start_with(prefix: &str, cooldown: Option<egress_api::CooldownSpec>) -> Live {
        let ns = egress_testenv::namespace(prefix).await;
        let mut squids = Vec::new();
        for _ in 0..PROXIES {
            squids.push(Squid::start(SquidOptions::default()).await.expect("squid"));
        }
        let origin = LocalOrigin::start().await.expect("origin");
        let options = OperatorOptions {
            providers_yaml: "providers: []\n".into(),
            cluster_id: ns.name().to_owned(),
            lease_token: TOKEN.into(),
            default_probe_url: origin.ip_url(),
            leader_election_namespace: None,
            extra_args: vec![format!("--watch-namespace={}", ns.name())],
            environment: Vec::new(),
        };
        let binary = Path::new(env!("CARGO_BIN_EXE_egress-operator"));
        let operator =
            OperatorProcess::start(binary, ns.control_plane().kubeconfig_path(), &options).await.expect("operator");
        let api: Api<Proxy> = ns.api();
        let mut names = Vec::new();
        for (index, squid) in squids.iter().enumerate() {
            let name = format!("{prefix}-{index}");
            let spec = egress_api::ProxySpec { cooldown, ..common::external(squid.address(), 1) };
            api.create(&PostParams::default(), &Proxy::new(&name, spec)).await.expect("create");
            names.push(name);
        }
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        common::wait_phase(&api, &refs, ProxyPhase::Ready, WAIT).await.unwrap_or_else(|error| panic!("{error}"));
        let discovery = DiscoveryClient::new(&operator.discovery_url, Some(TOKEN.into())).expect("client");
        // Listed, and each with the egress address its probes observed (the crawl tests' sites answer by it).
        eventually("discovery to list the proxies with their egress addresses", WAIT, || {
            let discovery = discovery.clone();
            async move {
                let proxies = discovery.proxies(None, None).await.ok()?;
                (proxies.len() == PROXIES && proxies.iter().all(|proxy| proxy.egress_ip.is_some())).then_some(())
            }
        })
        .await;
        // Sessions let their proxy go after 3 s idle, so a gateway crawl's leases are back before the next test
        // counts the fleet's.
        let gateway = GatewayProcess::start(binary, &operator.discovery_url, TOKEN, &["--sticky=3s".to_owned()])
            .await
            .expect("the gateway");
        Live { _ns: ns, _squids: squids, origin, operator, gateway }
    }

    /// The environment every client test reads.
    fn env(&self, command: &mut Command) {
        command
            .env("EGRESS_URL", &self.operator.discovery_url)
            .env("EGRESS_TOKEN", TOKEN)
            .env("EGRESS_METRICS", &self.operator.metrics_url)
            .env("EGRESS_ORIGIN", self.origin.url())
            .env("EGRESS_GATEWAY", self.gateway.address.to_string())
            .env("EGRESS_PROXIES", PROXIES.to_string());
    }
}

fn clients_dir(client: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../clients").join(client)
}

/// Runs `command` off the runtime and returns its output with stdout and stderr together, echoed.
async fn run(mut command: Command, what: &'static str) -> (Output, String) {
    let output = tokio::task::spawn_blocking(move || command.output())
        .await
        .expect("join")
        .unwrap_or_else(|error| panic!("running {what}: {error}"));
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    eprintln!("{text}");
    (output, text)
}

/// The interpreter of the venv `cargo xtask test` made with the Python client's pinned test dependencies.
fn python() -> PathBuf {
    match std::env::var_os("EGRESS_PYTHON") {
        Some(python) => PathBuf::from(python),
        None => panic!(
            "EGRESS_PYTHON is not set: run this through `cargo xtask test`, which makes the venv with the Python \
             client's pinned test dependencies and names its interpreter there"
        ),
    }
}

/// Runs pytest in `clients/python` with `args` against `live`, and returns what it printed; fails on a failure or
/// a skipped test.
async fn pytest(live: Live, args: &[&str], env: &[(&str, &str)]) -> String {
    let python = python();
    let root = clients_dir("python");
    let mut command = Command::new(&python);
    command
        .args(["-m", "pytest", "-q", "-s", "-rs", "-p", "no:cacheprovider"])
        .args(args)
        .current_dir(&root)
        .env("PYTHONPATH", root.join("src"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env(
            "EGRESS_WHEELHOUSE",
            python.parent().and_then(Path::parent).map(|venv| venv.join("wheelhouse")).unwrap_or_default(),
        )
        .envs(env.iter().copied());
    live.env(&mut command);
    let (output, text) = run(command, "pytest").await;
    if !output.status.success() || text.contains("skipped") {
        fail_after(live, "pytest failed, or skipped a test", &text);
    }
    text
}

#[tokio::test]
async fn the_python_client_passes_its_tests_against_a_live_operator() {
    let live = Live::start("py").await;
    // The refusals crawl needs a fleet of its own (below).
    pytest(live, &["tests", "--ignore=tests/test_scrapy_refusals.py"], &[]).await;
}

/// The Python client's sources pass `mypy --strict` (the settings are in its `pyproject.toml`), Scrapy adapter too.
#[tokio::test]
async fn the_python_client_type_checks_under_mypy_strict() {
    let mut command = Command::new(python());
    command
        .args(["-m", "mypy", "--cache-dir=/dev/null"])
        .current_dir(clients_dir("python"))
        .env("PYTHONDONTWRITEBYTECODE", "1");
    let (output, text) = run(command, "mypy").await;
    assert!(output.status.success() && text.contains("Success: no issues found"), "mypy --strict failed:\n{text}");
}

/// `clients/python/tests/test_scrapy_refusals.py`: a Scrapy crawl of a site refusing 8 % of requests, on three
/// proxies with a 10 s first-ban cooldown, reports every refusal and never sends through a refused proxy.
#[tokio::test]
async fn a_scrapy_crawl_of_a_site_refusing_8_percent_reports_every_refusal() {
    let cooldown = egress_api::CooldownSpec { base_seconds: Some(10), ..egress_api::CooldownSpec::default() };
    let live = Live::start_with("scrapyref", Some(cooldown)).await;
    pytest(live, &["tests/test_scrapy_refusals.py"], &[("EGRESS_REFUSALS_FLEET", "1")]).await;
}

#[tokio::test]
async fn the_node_client_passes_its_tests_against_a_live_operator() {
    let root = clients_dir("node");
    assert!(
        root.join("node_modules/.bin/tsc").exists(),
        "{} has no installed modules: run this through `cargo xtask test`, which installs them from the lock file",
        root.display()
    );
    let mut build = Command::new(root.join("node_modules/.bin/tsc"));
    build.args(["-p", "tsconfig.json"]).current_dir(&root);
    let (output, text) = run(build, "tsc").await;
    assert!(output.status.success(), "the TypeScript build failed:\n{text}");
    // The tests themselves, type-checked against what the build declared.
    let mut check = Command::new(root.join("node_modules/.bin/tsc"));
    check.args(["-p", "tsconfig.test.json"]).current_dir(&root);
    let (output, text) = run(check, "tsc on the tests").await;
    assert!(output.status.success(), "the Node tests do not type-check against the client:\n{text}");
    let live = Live::start("js").await;
    let mut command = Command::new("node");
    // One file at a time: the live tests count the leases held across the whole fleet.
    command.args(["--test", "--test-concurrency=1", "--test-reporter=tap", "test/"]).current_dir(&root);
    live.env(&mut command);
    let (output, text) = run(command, "node --test").await;
    if !(output.status.success() && text.contains("# fail 0") && text.contains("# skipped 0")) {
        fail_after(live, "the Node tests failed, or skipped one", &text);
    }
}

/// Fails with what `text` (a client's test output, printed whole above) says of its failures, after stopping `live`
/// (a namespace dropped while its test panics prints the control plane's logs, which would then end the output, and
/// CI shows the output's ends).
fn fail_after(live: Live, what: &str, text: &str) -> ! {
    drop(live);
    panic!("{what} (the whole output is above); the failures:\n{}", failures(text));
}

/// The failure reports in a client's test output: each TAP `not ok` line with what the test printed before it (up
/// to 20 lines since the test before it ended) and its diagnostics, and pytest's short summary and what it skipped;
/// the last 40 lines when there are none.
fn failures(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut picked = Vec::new();
    let mut index = 0;
    // Where the lines of the test now running start: after the last test's end.
    let mut since = 0;
    while index < lines.len() {
        let line = lines[index];
        if line.trim() == "..." || line.trim_start().starts_with("ok ") {
            since = index + 1;
        }
        if line.trim_start().starts_with("not ok") {
            picked.extend(&lines[since.max(index.saturating_sub(20))..index]);
            // The diagnostics follow, indented, up to their `...`.
            let indent = line.len() - line.trim_start().len();
            picked.push(line);
            index += 1;
            while index < lines.len() {
                let next = lines[index];
                picked.push(next);
                index += 1;
                if next.trim() == "..." && next.len() - next.trim_start().len() <= indent + 2 {
                    break;
                }
            }
            since = index;
            continue;
        }
        if line.contains("short test summary info") || line.starts_with("SKIPPED") {
            picked.extend(&lines[index..]);
            break;
        }
        index += 1;
    }
    if picked.is_empty() {
        picked = lines[lines.len().saturating_sub(40)..].to_vec();
    }
    picked.join("\n")
}

#[test]
fn failures_pick_tap_diagnostics_and_pytest_summaries() {
    let tap = "# Subtest: fine\nok 1 - fine\n  ---\n  duration_ms: 3\n  ...\n# crawl: 201 pages\n\
               not ok 2 - a crawl\n  ---\n  error: |-\n    3 requests inside a Retry-After\n  ...\n# tests 2\n";
    assert_eq!(
        failures(tap),
        "# crawl: 201 pages\nnot ok 2 - a crawl\n  ---\n  error: |-\n    3 requests inside a Retry-After\n  ..."
    );
    let pytest =
        "..F.\n== FAILURES ==\nlong traceback\n== short test summary info ==\nFAILED tests/x.py::y - boom\n1 failed";
    assert_eq!(failures(pytest), "== short test summary info ==\nFAILED tests/x.py::y - boom\n1 failed");
    let other: String = (0..50).map(|line| format!("{line}\n")).collect();
    assert_eq!(failures(&other).lines().count(), 40);
}

/// A site of `PAGES` pages that answers 403 to each address on every `every`-th request from it: it bans every proxy
/// now and then. Counts the pages it served and the bans it answered.
struct BanningSite {
    address: std::net::SocketAddr,
    bans: Arc<AtomicU32>,
    task: tokio::task::JoinHandle<()>,
}

const PAGES: usize = 200;

impl BanningSite {
    async fn start(every: u32) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let served: Arc<std::sync::Mutex<HashMap<std::net::IpAddr, u32>>> = Arc::default();
        let bans = Arc::new(AtomicU32::new(0));
        let counted = bans.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut stream, peer)) = listener.accept().await {
                let (served, bans) = (served.clone(), counted.clone());
                tokio::spawn(async move {
                    let mut request = Vec::new();
                    let mut buffer = [0; 2048];
                    while !request.windows(4).any(|window| window == b"\r\n\r\n") {
                        match stream.read(&mut buffer).await {
                            Ok(0) | Err(_) => return,
                            Ok(read) => request.extend_from_slice(&buffer[..read]),
                        }
                    }
                    let count = {
                        let mut served = served.lock().expect("served");
                        let count = served.entry(peer.ip()).or_default();
                        *count += 1;
                        *count
                    };
                    let status = if count % every == 0 {
                        bans.fetch_add(1, Ordering::SeqCst);
                        "403 Forbidden"
                    } else {
                        "200 OK"
                    };
                    let answer = format!("HTTP/1.1 {status}\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok");
                    let _ = stream.write_all(answer.as_bytes()).await;
                });
            }
        });
        Self { address, bans, task }
    }
}

impl Drop for BanningSite {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `host:port` of a lease's proxy URL (`http://[user:password@]host:port`).
fn proxy_address(url: &str) -> std::net::SocketAddr {
    let authority = url.trim_start_matches("http://").trim_end_matches('/');
    let host = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    host.parse().unwrap_or_else(|error| panic!("{url}: {error}"))
}

/// One crawler: keeps a lease on a proxy for the site while the site serves through it, reports each success (which
/// ends a ban streak) and each ban (then leases again), until every page is fetched.
async fn crawl_pages(
    discovery: DiscoveryClient,
    site: std::net::SocketAddr,
    pages: Arc<std::sync::Mutex<Vec<usize>>>,
    fetched: Arc<AtomicU32>,
    deadline: tokio::time::Instant,
) -> Result<(), String> {
    let target = format!("site-{}.example", site.port());
    let mut held: Option<egress_client::LeaseGuard> = None;
    loop {
        let Some(page) = pages.lock().expect("pages").pop() else { return Ok(()) };
        let lease = match held.take() {
            Some(lease) => lease,
            None => loop {
                match discovery.lease(egress_client::LeaseOptions::for_target(&target)).await {
                    Ok(lease) => break lease,
                    Err(egress_client::ClientError::Unavailable { retry_after, .. }) => {
                        if tokio::time::Instant::now() >= deadline {
                            pages.lock().expect("pages").push(page);
                            return Err(format!("no proxy for {target} before the deadline"));
                        }
                        let wait = retry_after.unwrap_or(Duration::from_secs(1)).min(Duration::from_secs(2));
                        tokio::time::sleep(wait).await;
                    }
                    Err(error) => return Err(format!("lease: {error}")),
                }
            },
        };
        let url = format!("http://{site}/page/{page}");
        let status = egress_testenv::get_through_proxy(proxy_address(lease.proxy_url()), &url, None)
            .await
            .map_err(|error| format!("{url}: {error:#}"))?;
        match status {
            200 => {
                fetched.fetch_add(1, Ordering::SeqCst);
                lease.report_counts(1, 0).await.map_err(|error| format!("report: {error}"))?;
                held = Some(lease);
            }
            403 => {
                pages.lock().expect("pages").push(page);
                lease
                    .report(egress_client::Outcome::Banned, Some(403))
                    .await
                    .map_err(|error| format!("report: {error}"))?;
                lease.release().await.map_err(|error| format!("release: {error}"))?;
            }
            other => return Err(format!("{url} answered {other}")),
        }
    }
}

/// A site that bans each proxy on every 40th request from it, crawled by three crawlers over three proxies: with the
/// default cooldown (10 minutes) the crawl stopped at 195 of 200 pages until its 180 s deadline, every proxy cooling
/// down; with a 30 s first-ban cooldown in the Proxies' spec, it fetches all 200.
#[tokio::test]
async fn a_small_fleet_with_a_30_s_cooldown_crawls_a_site_that_bans_every_proxy() {
    let cooldown = egress_api::CooldownSpec { base_seconds: Some(30), ..egress_api::CooldownSpec::default() };
    let live = Live::start_with("small", Some(cooldown)).await;
    let discovery = DiscoveryClient::new(&live.operator.discovery_url, Some(TOKEN.into())).expect("client");
    let listed = discovery.proxies(None, None).await.expect("proxies");
    assert!(
        listed.iter().all(|proxy| proxy.cooldown_policy.is_some_and(|policy| policy.base_seconds == 30)),
        "every proxy lists its 30 s policy: {listed:?}"
    );
    let site = BanningSite::start(40).await;
    let pages = Arc::new(std::sync::Mutex::new((0..PAGES).collect::<Vec<_>>()));
    let fetched = Arc::new(AtomicU32::new(0));
    let started = std::time::Instant::now();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    let crawlers: Vec<_> = (0..PROXIES)
        .map(|_| tokio::spawn(crawl_pages(discovery.clone(), site.address, pages.clone(), fetched.clone(), deadline)))
        .collect();
    let mut failures = Vec::new();
    for crawler in crawlers {
        if let Err(error) = crawler.await.expect("crawler") {
            failures.push(error);
        }
    }
    let (fetched, bans) = (fetched.load(Ordering::SeqCst), site.bans.load(Ordering::SeqCst));
    eprintln!(
        "small fleet: {fetched} of {PAGES} pages through {PROXIES} proxies with a 30 s first-ban cooldown in {:.1} s, \
         {bans} bans",
        started.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{failures:?}");
    assert_eq!(fetched as usize, PAGES, "the whole site");
    assert!(bans as usize >= PROXIES, "every proxy was banned at least once: {bans}");
}
