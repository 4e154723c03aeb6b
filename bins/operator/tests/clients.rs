//! The Python client's tests (`clients/python/tests`) against a live operator: the release-independent build of
//! `egress-operator` on the local control plane, three External Proxies on real Squids (each reaching origins from
//! an address of its own), and a local origin. `cargo xtask test` provides the Python: a venv with the pinned test
//! dependencies, named by `EGRESS_PYTHON`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use egress_api::{Proxy, ProxyPhase};
use egress_client::DiscoveryClient;
use egress_testenv::{LocalOrigin, OperatorOptions, OperatorProcess, Squid, SquidOptions, eventually};
use kube::api::{Api, PostParams};

mod common;

const WAIT: Duration = Duration::from_secs(120);
const TOKEN: &str = "python-client-token-0123456789";
const PROXIES: usize = 3;

fn python() -> PathBuf {
    match std::env::var_os("EGRESS_PYTHON") {
        Some(python) => PathBuf::from(python),
        None => panic!(
            "EGRESS_PYTHON is not set: run this through `cargo xtask test`, which makes the venv with the Python \
             client's pinned test dependencies and names its interpreter there"
        ),
    }
}

#[tokio::test]
async fn the_python_client_passes_its_tests_against_a_live_operator() {
    let python = python();
    let ns = egress_testenv::namespace("py-client").await;
    let squids: Vec<Squid> = {
        let mut squids = Vec::new();
        for _ in 0..PROXIES {
            squids.push(Squid::start(SquidOptions::default()).await.expect("squid"));
        }
        squids
    };
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
        let spec = common::external(squid.address(), 1);
        let name = format!("py-{index}");
        api.create(&PostParams::default(), &Proxy::new(&name, spec)).await.expect("create");
        names.push(name);
    }
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    common::wait_phase(&api, &refs, ProxyPhase::Ready, WAIT).await.unwrap_or_else(|error| panic!("{error}"));
    let discovery = DiscoveryClient::new(&operator.discovery_url, Some(TOKEN.into())).expect("client");
    eventually("discovery to list the proxies", WAIT, || {
        let discovery = discovery.clone();
        async move { (discovery.proxies(None, None).await.ok()?.len() == PROXIES).then_some(()) }
    })
    .await;

    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../clients/python");
    let output = tokio::task::spawn_blocking(move || {
        Command::new(&python)
            .args(["-m", "pytest", "-q", "-s", "-rs", "-p", "no:cacheprovider", "tests"])
            .current_dir(&root)
            .env("PYTHONPATH", root.join("src"))
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("EGRESS_URL", &operator.discovery_url)
            .env("EGRESS_TOKEN", TOKEN)
            .env("EGRESS_METRICS", &operator.metrics_url)
            .env(
                "EGRESS_WHEELHOUSE",
                python.parent().and_then(Path::parent).map(|venv| venv.join("wheelhouse")).unwrap_or_default(),
            )
            .env("EGRESS_ORIGIN", origin.url())
            .env("EGRESS_PROXIES", PROXIES.to_string())
            .output()
            .unwrap_or_else(|error| panic!("running {}: {error}", python.display()))
    })
    .await
    .expect("pytest");
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    eprintln!("{text}");
    assert!(output.status.success(), "pytest failed:\n{text}");
    assert!(!text.contains("skipped"), "every live test ran:\n{text}");
}
