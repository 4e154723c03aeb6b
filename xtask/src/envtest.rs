//! `cargo xtask envtest`: builds kube-apiserver, kube-controller-manager, kubectl and etcd from their Go modules into the cache directory, and with
//! `--up` keeps a control plane running for manual use.
//!
//! The Go wrapper module in `xtask/envtest/` pins `k8s.io/kubernetes` and replaces each of its staging modules with
//! the matching published release, so `go build` resolves everything through the Go module proxy. The binaries land
//! in `egress_testenv::assets::bin_dir()`, outside the checkout, so a machine builds them once.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use egress_testenv::assets::{self, KUBERNETES_VERSION};

use crate::process::{output, run};
use crate::workspace_root;

/// The Go module that builds the control plane.
pub fn go_module_dir() -> PathBuf {
    workspace_root().join("xtask").join("envtest")
}

/// The binaries of the test control plane: file name, Go package, and whether it is a Kubernetes component (stamped
/// with the pinned version, which `--version` then reports).
const BINARIES: [(&str, &str, bool); 4] = [
    ("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver", true),
    ("kube-controller-manager", "k8s.io/kubernetes/cmd/kube-controller-manager", true),
    // kubectl's `apply -k` is how users install the operator; the in-cluster suite and the quickstart use it too.
    ("kubectl", "k8s.io/kubernetes/cmd/kubectl", true),
    ("etcd", "go.etcd.io/etcd/server/v3", false),
];

/// Builds each binary the cache does not already hold at the right version; returns their directory.
pub fn ensure_built() -> Result<PathBuf> {
    let dir = assets::bin_dir();
    let missing: Vec<_> = BINARIES.iter().filter(|(name, _, stamped)| !is_current(&dir, name, *stamped)).collect();
    if missing.is_empty() {
        eprintln!(
            "envtest: kube-apiserver, kube-controller-manager, kubectl {KUBERNETES_VERSION} and etcd are present in {}",
            dir.display()
        );
        return Ok(dir);
    }
    if output(Command::new("go").arg("version")).is_none() {
        bail!(
            "building the test control plane needs Go (1.26 or newer) on PATH; install it, or set {} to a directory \
             that already holds kube-apiserver, kube-controller-manager, kubectl and etcd {KUBERNETES_VERSION}",
            assets::BIN_DIR_ENV
        );
    }
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // Build into a scratch directory and rename into place, so an interrupted build never leaves a binary that
    // looks current but is truncated.
    let scratch = dir.join(format!(".build-{}", std::process::id()));
    fs::create_dir_all(&scratch)?;
    let version = KUBERNETES_VERSION.trim_start_matches('v');
    let (major, minor) =
        version.split_once('.').map(|(major, rest)| (major, rest.split('.').next().unwrap_or(""))).unwrap_or(("", ""));
    let mut stamp = Vec::new();
    for package in ["k8s.io/component-base/version", "k8s.io/client-go/pkg/version"] {
        stamp.push(format!("-X {package}.gitVersion={KUBERNETES_VERSION}"));
        stamp.push(format!("-X {package}.gitMajor={major}"));
        stamp.push(format!("-X {package}.gitMinor={minor}"));
        stamp.push(format!("-X {package}.gitTreeState=clean"));
    }
    // One `go build` for every missing binary: the packages they share compile once, with the whole graph in
    // parallel, and one binary links while another's packages still compile. `-X` for a package a binary does not
    // link (etcd has no component-base) is ignored.
    let names: Vec<&str> = missing.iter().map(|(name, _, _)| *name).collect();
    let started = Instant::now();
    eprintln!("envtest: building {} (the first build on a machine takes several minutes)", names.join(", "));
    let ldflags = format!("-s -w {}", stamp.join(" "));
    let mut output_dir = scratch.clone().into_os_string();
    output_dir.push("/");
    run(Command::new("go")
        .current_dir(go_module_dir())
        .env("CGO_ENABLED", "0")
        .args(["build", "-trimpath", "-ldflags", &ldflags, "-o"])
        .arg(&output_dir)
        .args(missing.iter().map(|(_, package, _)| *package)))?;
    eprintln!("envtest: built {} in {:.0?}", names.join(", "), started.elapsed());
    for (name, package, stamped) in &missing {
        fs::rename(scratch.join(go_binary_name(package)), dir.join(name))
            .with_context(|| format!("moving {name} into {}", dir.display()))?;
        if !is_current(&dir, name, *stamped) {
            bail!("the freshly built {name} in {} does not report {KUBERNETES_VERSION}", dir.display());
        }
    }
    fs::remove_dir_all(&scratch)?;
    Ok(dir)
}

/// Whether `dir` holds the binary `name`, answering its version query (with the pinned version when `stamped`).
/// The file `go build -o DIR/` writes for `package`: its last path element, or the one before a major-version
/// suffix (`go.etcd.io/etcd/server/v3` → `server`).
fn go_binary_name(package: &str) -> &str {
    let mut elements = package.rsplit('/');
    let last = elements.next().unwrap_or(package);
    let is_major_version = last.len() > 1 && last.starts_with('v') && last[1..].bytes().all(|b| b.is_ascii_digit());
    match elements.next() {
        Some(before) if is_major_version => before,
        _ => last,
    }
}

fn is_current(dir: &Path, name: &str, stamped: bool) -> bool {
    let mut command = Command::new(dir.join(name));
    if name == "kubectl" {
        command.args(["version", "--client"]);
    } else {
        command.arg("--version");
    }
    match output(&mut command) {
        Some(text) if stamped => text.lines().next().is_some_and(|first| {
            let first = first.trim();
            first == format!("Kubernetes {KUBERNETES_VERSION}")
                || first == format!("Client Version: {KUBERNETES_VERSION}")
        }),
        Some(_) => true,
        None => false,
    }
}

/// Starts a control plane with the CRDs installed and keeps it up until Ctrl-C.
pub fn up(copy_kubeconfig_to: Option<PathBuf>, with_sample: bool, with_controller: bool) -> Result<()> {
    ensure_built()?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let plane = egress_testenv::ControlPlane::start().await?;
        let kubeconfig = match copy_kubeconfig_to {
            Some(path) => {
                fs::copy(plane.kubeconfig_path(), &path).with_context(|| format!("writing {}", path.display()))?;
                path
            }
            None => plane.kubeconfig_path().to_path_buf(),
        };
        // Kept alive until Ctrl-C: dropping them stops the controller and every Squid.
        let _running = if with_controller { Some(start_controller(&plane).await?) } else { None };
        if with_sample {
            create_sample(&plane, with_controller).await?;
        }
        println!("control plane {} ready in {:.1?}", plane.server_url(), plane.startup_duration());
        println!("kubeconfig: {}", kubeconfig.display());
        println!("try:        kubectl --kubeconfig {} get px -A", kubeconfig.display());
        println!("Ctrl-C stops it and removes its files.");
        tokio::signal::ctrl_c().await.context("waiting for Ctrl-C")?;
        println!("stopping the control plane");
        drop(plane);
        Ok(())
    })
}

/// Creates an External Proxy `example` in the `default` namespace (and, with the controller, a Managed Proxy
/// `managed-example` on the `pods` provider), so `kubectl get px` and `kubectl describe px` have something to show.
async fn create_sample(plane: &egress_testenv::ControlPlane, managed: bool) -> Result<()> {
    use egress_api::{Endpoint, Proxy, ProxyMode, ProxySpec};
    let proxies: kube::Api<Proxy> = kube::Api::namespaced(plane.client().await?, "default");
    let spec = ProxySpec {
        endpoint: Some(Endpoint { host: "127.0.0.1".into(), port: 3128 }),
        ..ProxySpec::new(ProxyMode::External)
    };
    proxies
        .create(&kube::api::PostParams::default(), &Proxy::new("example", spec))
        .await
        .context("creating the sample Proxy")?;
    println!("created the sample External Proxy default/example (127.0.0.1:3128)");
    if managed {
        let spec = ProxySpec { provider: Some("pods".into()), ..ProxySpec::new(ProxyMode::Managed) };
        proxies
            .create(&kube::api::PostParams::default(), &Proxy::new("managed-example", spec))
            .await
            .context("creating the sample Managed Proxy")?;
        println!("created the sample Managed Proxy default/managed-example (provider pods)");
    }
    Ok(())
}

/// What `--controller` keeps running.
struct RunningController {
    _agent: egress_testenv::NodeAgent,
    _origin: egress_testenv::LocalOrigin,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for RunningController {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Runs the reconciler with a kubernetes provider `pods` (pods in `default`), the local node agent, and the health
/// engine probing a local origin, so Managed Proxies really run as Squid processes and become Ready.
async fn start_controller(plane: &egress_testenv::ControlPlane) -> Result<RunningController> {
    use std::sync::Arc;
    let client = plane.client().await?;
    let agent = egress_testenv::NodeAgent::start(client.clone(), &["default"]).await?;
    let origin = egress_testenv::LocalOrigin::start().await?;
    let config = egress_provider::config::ProvidersConfig::parse_as::<egress_provider_kubernetes::KubernetesConfig>(
        &format!(
            "providers:\n  - {{ name: pods, type: kubernetes, destinations: {}, kubernetes: {{ namespace: default }} }}\n",
            origin.destinations_yaml()
        ),
        "built-in",
    )?;
    let settings = config.providers[0]
        .settings::<egress_provider_kubernetes::KubernetesConfig>()
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("the built-in providers config has no kubernetes block"))?;
    let provider = Arc::new(
        egress_provider_kubernetes::KubernetesProvider::new(client.clone(), settings)
            .with_destinations(config.providers[0].destinations.clone()),
    );
    let providers =
        egress_reconcile::StaticProviders::new().with("pods", provider as Arc<dyn egress_provider::Provider>);
    let verdicts = egress_reconcile::ProxyVerdicts::new();
    let (proxies, watch) = egress_reconcile::ProxyFeed::start(client.clone(), None);
    let (credentials, secret_watch) = egress_reconcile::CredentialStore::start(client.clone(), None, &proxies);
    let context = Arc::new(egress_reconcile::Context::new(
        client.clone(),
        Arc::new(providers),
        verdicts.clone(),
        credentials.clone(),
        egress_reconcile::ControllerConfig::new("envtest"),
        egress_reconcile::ReconcileMetrics::default(),
    ));
    let (triggers, trigger_stream) = egress_reconcile::trigger_channel();
    let controller =
        tokio::spawn(egress_reconcile::run(context, proxies.clone(), trigger_stream, futures::future::pending()));
    let tls = egress_health::tls_connector(b"")?;
    let (engine, transitions) = egress_health::HealthEngine::start_with(
        egress_health::EngineConfig::default(),
        tls,
        egress_health::HealthMetrics::default(),
        verdicts,
    );
    let feed_config = egress_reconcile::health_feed::HealthFeedConfig { default_probe_url: origin.ip_url() };
    let feed = tokio::spawn(egress_reconcile::health_feed::run_health_feed(
        proxies,
        credentials,
        feed_config,
        Arc::new(engine),
        transitions,
        triggers,
        futures::future::pending(),
    ));
    println!("reconciler running with provider `pods` (Squid processes on 127.1.x.y via the local node agent)");
    println!("health engine probing {} through every proxy", origin.ip_url());
    Ok(RunningController { _agent: agent, _origin: origin, tasks: vec![watch, secret_watch, controller, feed] })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Go module, the testenv constant and the k8s-openapi feature must name one Kubernetes release.
    #[test]
    fn go_module_pins_the_testenv_version() {
        let go_mod = fs::read_to_string(go_module_dir().join("go.mod")).expect("xtask/envtest/go.mod is readable");
        assert!(
            go_mod.contains(&format!("k8s.io/kubernetes {KUBERNETES_VERSION}")),
            "go.mod must require k8s.io/kubernetes {KUBERNETES_VERSION}"
        );
        let staging = KUBERNETES_VERSION.replacen("v1.", "v0.", 1);
        for line in go_mod.lines().filter(|line| line.contains("=> k8s.io/")) {
            assert!(line.trim_end().ends_with(&staging), "staging replacement not at {staging}: {line}");
        }
        let minor = KUBERNETES_VERSION.split('.').nth(1).expect("a minor version");
        let manifest =
            fs::read_to_string(workspace_root().join("Cargo.toml")).expect("the workspace manifest is readable");
        assert!(manifest.contains(&format!("\"v1_{minor}\"")), "k8s-openapi must enable the v1_{minor} feature");
    }

    #[test]
    fn go_names_binaries_after_the_package_not_its_major_version() {
        assert_eq!(go_binary_name("k8s.io/kubernetes/cmd/kube-apiserver"), "kube-apiserver");
        assert_eq!(go_binary_name("go.etcd.io/etcd/server/v3"), "server");
        assert_eq!(go_binary_name("example.com/tools/vet"), "vet");
        assert_eq!(go_binary_name("kubectl"), "kubectl");
    }
}
