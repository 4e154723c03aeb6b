//! `cargo xtask e2e`: the end-to-end suite. `e2e.rs` applies `deploy/default` as shipped on the local control plane
//! (with kube-controller-manager) and runs against the two operator pods through the discovery Service;
//! `host_process.rs` runs the operator binary as a process of its own where a test needs that. Both run inside the
//! tests' network namespace (see [`crate::podnet`]). `cargo xtask test` runs them too, with every other test.
//!
//! `cargo xtask e2e --kind` runs the same suite against a kind cluster instead, where Docker and kind exist: it
//! creates the cluster `egress-e2e` when missing (and deletes it afterwards only then), routes the pod network from
//! this host to the nodes so the operator (a process here) reaches pod IPs, serves the test origin on the kind
//! network's gateway so Squid in the pods reaches it, and points the tests at the cluster through
//! `EGRESS_TEST_KUBECONFIG` and `EGRESS_TEST_ORIGIN_HOST` (see `egress-testenv`).

use std::net::Ipv4Addr;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::process::{cargo, output, run};
use crate::{envtest, packages, podnet, python};

/// The suite's test binaries, for `cargo test`.
const SUITE_TESTS: [&str; 8] =
    ["-p", "egress-operator", "--test", "e2e", "--test", "e2e_shared", "--test", "host_process"];

/// The kind cluster the suite uses.
const KIND_CLUSTER: &str = "egress-e2e";

pub fn run_suite(kind: bool, cargo_test_args: &[String]) -> Result<()> {
    if kind {
        return run_on_kind(cargo_test_args);
    }
    packages::ensure_installed()?;
    envtest::ensure_built()?;
    // The gateway crawls run Scrapy from the Python client's test venv.
    let python = python::ensure_venv()?;
    run(suite(&[]).arg("--no-run"))?;
    let network = podnet::PodNetwork::create()?;
    let mut inside = network.command(crate::process::cargo_program());
    crate::process::forget_cargo_run(&mut inside)
        .env("EGRESS_PYTHON", &python)
        .args(["test", "--locked", "--offline"])
        .args(SUITE_TESTS)
        .args(cargo_test_args);
    run(&mut inside)
}

/// `cargo test` of the e2e suite; cargo builds the operator binary it runs.
fn suite(cargo_test_args: &[String]) -> Command {
    let mut command = cargo();
    command.args(["test", "--locked"]).args(SUITE_TESTS).args(cargo_test_args);
    command
}

fn run_on_kind(cargo_test_args: &[String]) -> Result<()> {
    let missing = missing_tools(|tool| output(Command::new(tool).args(version_args(tool))).is_some());
    if !missing.is_empty() {
        bail!("{}", missing_tools_message(&missing));
    }
    let engine = Command::new("docker").args(["info", "--format", "{{.ServerVersion}}"]).output()?;
    if !engine.status.success() {
        bail!("`docker info` fails, so kind cannot run its nodes: {}", String::from_utf8_lossy(&engine.stderr).trim());
    }

    let clusters = output(Command::new("kind").arg("get").arg("clusters")).unwrap_or_default();
    let created = !clusters.lines().any(|line| line.trim() == KIND_CLUSTER);
    if created {
        run(Command::new("kind").args(["create", "cluster", "--name", KIND_CLUSTER, "--wait", "180s"]))?;
    } else {
        eprintln!("using the existing kind cluster {KIND_CLUSTER}");
    }
    let result = run_against_cluster(cargo_test_args);
    if created && let Err(error) = run(Command::new("kind").args(["delete", "cluster", "--name", KIND_CLUSTER])) {
        eprintln!("warning: {error:#}");
    }
    result
}

fn run_against_cluster(cargo_test_args: &[String]) -> Result<()> {
    let kubeconfig = egress_testenv::assets::cache_dir().join("kind-kubeconfig");
    let text = output(Command::new("kind").args(["get", "kubeconfig", "--name", KIND_CLUSTER]))
        .context("`kind get kubeconfig` failed")?;
    std::fs::create_dir_all(egress_testenv::assets::cache_dir())?;
    std::fs::write(&kubeconfig, text).with_context(|| format!("writing {}", kubeconfig.display()))?;

    // The operator runs on this host and probes pod IPs: route each node's pod range to the node's container.
    let nodes = output(Command::new("kubectl").arg(format!("--kubeconfig={}", kubeconfig.display())).args([
        "get",
        "nodes",
        "-o",
        r#"jsonpath={range .items[*]}{.spec.podCIDR} {.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}"#,
    ]))
    .context("listing the kind nodes with kubectl")?;
    let routes = pod_routes(&nodes)?;
    for (cidr, via) in &routes {
        run(Command::new("ip").args(["route", "replace", cidr, "via", &via.to_string()]))
            .context("routing the pod network to the kind nodes (needs root)")?;
    }

    // Squid in the pods fetches the test origin: serve it on the kind network's gateway, this host's side of it.
    let gateways = output(Command::new("docker").args([
        "network",
        "inspect",
        "kind",
        "--format",
        "{{range .IPAM.Config}}{{.Gateway}} {{end}}",
    ]))
    .context("inspecting the Docker network `kind`")?;
    let origin_host = ipv4_gateway(&gateways)?;

    let mut command = suite(cargo_test_args);
    command.env("EGRESS_TEST_KUBECONFIG", &kubeconfig).env("EGRESS_TEST_ORIGIN_HOST", origin_host.to_string());
    let result = run(&mut command);
    for (cidr, via) in &routes {
        let _ = output(Command::new("ip").args(["route", "del", cidr, "via", &via.to_string()]));
    }
    result
}

/// Arguments that make `tool` print its version without contacting anything.
fn version_args(tool: &str) -> &'static [&'static str] {
    if tool == "kubectl" { &["version", "--client"] } else { &["--version"] }
}

/// The tools `--kind` needs that `present` says are absent.
fn missing_tools(present: impl Fn(&str) -> bool) -> Vec<&'static str> {
    ["docker", "kind", "kubectl"].into_iter().filter(|tool| !present(tool)).collect()
}

fn missing_tools_message(missing: &[&str]) -> String {
    format!(
        "`cargo xtask e2e --kind` needs Docker, kind and kubectl; not found: {}. Install them (kind: `go install \
         sigs.k8s.io/kind@latest`), or run `cargo xtask e2e` for the same suite on the local control plane",
        missing.join(", ")
    )
}

/// Parses `<podCIDR> <InternalIP>` lines into routes; every node must have both.
fn pod_routes(nodes: &str) -> Result<Vec<(String, Ipv4Addr)>> {
    let mut routes = Vec::new();
    for line in nodes.lines().filter(|line| !line.trim().is_empty()) {
        let mut fields = line.split_whitespace();
        let (Some(cidr), Some(address)) = (fields.next(), fields.next()) else {
            bail!("a kind node lacks a pod CIDR or an InternalIP: {line:?}");
        };
        let via: Ipv4Addr =
            address.parse().with_context(|| format!("a kind node's InternalIP {address:?} is not IPv4"))?;
        if !cidr.contains('/') {
            bail!("a kind node's pod CIDR {cidr:?} is not a CIDR");
        }
        routes.push((cidr.to_owned(), via));
    }
    if routes.is_empty() {
        bail!("the kind cluster reports no nodes");
    }
    Ok(routes)
}

/// The first IPv4 address among the Docker network's gateways.
fn ipv4_gateway(gateways: &str) -> Result<Ipv4Addr> {
    gateways
        .split_whitespace()
        .find_map(|gateway| gateway.parse().ok())
        .with_context(|| format!("the Docker network `kind` has no IPv4 gateway (gateways: {:?})", gateways.trim()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_tools_are_named_with_the_alternative() {
        let missing = missing_tools(|tool| tool == "kubectl");
        assert_eq!(missing, ["docker", "kind"]);
        let message = missing_tools_message(&missing);
        assert!(message.contains("not found: docker, kind"), "{message}");
        assert!(message.contains("cargo xtask e2e`"), "{message}");
        assert!(missing_tools(|_| true).is_empty());
    }

    #[test]
    fn node_lines_become_routes() {
        let routes = pod_routes("10.244.0.0/24 172.18.0.2\n10.244.1.0/24 172.18.0.3\n").expect("routes");
        assert_eq!(
            routes,
            [
                ("10.244.0.0/24".to_owned(), Ipv4Addr::new(172, 18, 0, 2)),
                ("10.244.1.0/24".into(), [172, 18, 0, 3].into())
            ]
        );
        assert!(pod_routes("").unwrap_err().to_string().contains("no nodes"));
        assert!(pod_routes(" 172.18.0.2\n").unwrap_err().to_string().contains("lacks"));
        assert!(pod_routes("10.244.0.0/24 fc00::2\n").unwrap_err().to_string().contains("not IPv4"));
    }

    #[test]
    fn the_ipv4_gateway_is_picked() {
        assert_eq!(ipv4_gateway("fc00:f853:ccd:e793::1 172.18.0.1 ").expect("gateway"), Ipv4Addr::new(172, 18, 0, 1));
        assert!(ipv4_gateway("fc00::1").is_err());
    }
}
