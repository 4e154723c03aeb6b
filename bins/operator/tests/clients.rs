//! The Python and Node clients' tests (`clients/python/tests`, `clients/node/test`) against a live operator: the
//! build of `egress-operator` on the local control plane, three External Proxies on real Squids (each reaching
//! origins from an address of its own), and a local origin; one such world per client, so their cooldowns never meet.
//! `cargo xtask test` provides the rest: a venv with the Python client's pinned test dependencies (named by
//! `EGRESS_PYTHON`) and the Node client's modules (`clients/node/node_modules`, from its lock file).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use egress_api::{Proxy, ProxyPhase};
use egress_client::DiscoveryClient;
use egress_testenv::{LocalOrigin, OperatorOptions, OperatorProcess, Squid, SquidOptions, TestNamespace, eventually};
use kube::api::{Api, PostParams};

mod common;

const WAIT: Duration = Duration::from_secs(120);
const TOKEN: &str = "client-tests-token-0123456789";
const PROXIES: usize = 3;

/// An operator with three healthy External Proxies on Squids of their own, and an origin.
struct Live {
    _ns: TestNamespace,
    _squids: Vec<Squid>,
    origin: LocalOrigin,
    operator: OperatorProcess,
}

impl Live {
    async fn start(prefix: &str) -> Live {
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
        };
        let binary = Path::new(env!("CARGO_BIN_EXE_egress-operator"));
        let operator =
            OperatorProcess::start(binary, ns.control_plane().kubeconfig_path(), &options).await.expect("operator");
        let api: Api<Proxy> = ns.api();
        let mut names = Vec::new();
        for (index, squid) in squids.iter().enumerate() {
            let name = format!("{prefix}-{index}");
            api.create(&PostParams::default(), &Proxy::new(&name, common::external(squid.address(), 1)))
                .await
                .expect("create");
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
        Live { _ns: ns, _squids: squids, origin, operator }
    }

    /// The environment every client test reads.
    fn env(&self, command: &mut Command) {
        command
            .env("EGRESS_URL", &self.operator.discovery_url)
            .env("EGRESS_TOKEN", TOKEN)
            .env("EGRESS_METRICS", &self.operator.metrics_url)
            .env("EGRESS_ORIGIN", self.origin.url())
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

#[tokio::test]
async fn the_python_client_passes_its_tests_against_a_live_operator() {
    let python = match std::env::var_os("EGRESS_PYTHON") {
        Some(python) => PathBuf::from(python),
        None => panic!(
            "EGRESS_PYTHON is not set: run this through `cargo xtask test`, which makes the venv with the Python \
             client's pinned test dependencies and names its interpreter there"
        ),
    };
    let live = Live::start("py").await;
    let root = clients_dir("python");
    let mut command = Command::new(&python);
    command
        .args(["-m", "pytest", "-q", "-s", "-rs", "-p", "no:cacheprovider", "tests"])
        .current_dir(&root)
        .env("PYTHONPATH", root.join("src"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env(
            "EGRESS_WHEELHOUSE",
            python.parent().and_then(Path::parent).map(|venv| venv.join("wheelhouse")).unwrap_or_default(),
        );
    live.env(&mut command);
    let (output, text) = run(command, "pytest").await;
    assert!(output.status.success(), "pytest failed:\n{text}");
    assert!(!text.contains("skipped"), "every live test ran:\n{text}");
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
    let live = Live::start("js").await;
    let mut command = Command::new("node");
    // One file at a time: the live tests count the leases held across the whole fleet.
    command.args(["--test", "--test-concurrency=1", "--test-reporter=tap", "test/"]).current_dir(&root);
    live.env(&mut command);
    let (output, text) = run(command, "node --test").await;
    assert!(output.status.success(), "the Node tests failed:\n{text}");
    assert!(text.contains("# fail 0") && text.contains("# skipped 0"), "every Node test ran and passed:\n{text}");
}
