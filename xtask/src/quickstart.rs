//! `cargo xtask quickstart`: the whole product on one machine, end to end.
//!
//! Starts the local control plane and the node agent, runs the real operator binary with the kubernetes provider,
//! creates three sample Proxies, shows their progress until they are Ready (their Squid processes probed for real),
//! leases one through the discovery API with egress-client and fetches a local page through it, prints a summary,
//! and keeps everything running until Ctrl-C (`--exit` stops after the demo).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use egress_api::{HealthCheck, Proxy, ProxyMode, ProxyPhase, ProxySpec};
use egress_client::{DiscoveryClient, LeaseOptions};
use egress_testenv::{ControlPlane, LocalOrigin, NodeAgent, OperatorOptions, OperatorProcess, get_through_proxy};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ListParams, ObjectMeta, PostParams};

use crate::process::{cargo, output, run as run_command};
use crate::{envtest, packages, workspace_root};

const PROXY_NAMESPACE: &str = "egress-proxies";
const NAMES: [&str; 3] = ["quickstart-1", "quickstart-2", "quickstart-3"];

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| workspace_root().join("target"), PathBuf::from)
}

pub fn run(exit: bool) -> Result<()> {
    packages::ensure_installed()?;
    envtest::ensure_built()?;
    run_command(cargo().args(["build", "--locked", "-p", "egress-operator"]))?;
    let binary = target_dir().join("debug").join("egress-operator");
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(demo(binary, exit))
}

fn phase(proxy: &Proxy) -> String {
    proxy
        .status
        .as_ref()
        .and_then(|status| status.phase)
        .map_or_else(|| "Pending".to_owned(), |phase| format!("{phase:?}"))
}

async fn demo(binary: PathBuf, exit: bool) -> Result<()> {
    let started = Instant::now();
    println!("[quickstart] starting the local control plane (etcd + kube-apiserver)");
    let plane = ControlPlane::start().await?;
    let client = plane.client().await?;
    let namespace = Namespace {
        metadata: ObjectMeta { name: Some(PROXY_NAMESPACE.into()), ..ObjectMeta::default() },
        ..Namespace::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .context("creating the proxy namespace")?;
    let account = k8s_openapi::api::core::v1::ServiceAccount {
        metadata: ObjectMeta { name: Some("default".into()), ..ObjectMeta::default() },
        ..Default::default()
    };
    Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(client.clone(), PROXY_NAMESPACE)
        .create(&PostParams::default(), &account)
        .await
        .context("creating the proxy namespace's ServiceAccount")?;
    println!("[quickstart] starting the node agent (runs proxy pods as local Squid processes) and a local origin");
    let _agent = NodeAgent::start(client.clone(), &[PROXY_NAMESPACE]).await?;
    let origin = LocalOrigin::start().await?;

    let token = format!("quickstart-{}", std::process::id()).repeat(2);
    let options = OperatorOptions {
        providers_yaml: format!(
            "providers:\n  - name: pods\n    type: kubernetes\n    kubernetes:\n      namespace: {PROXY_NAMESPACE}\n"
        ),
        cluster_id: "quickstart".into(),
        lease_token: token.clone(),
        default_probe_url: origin.ip_url(),
        leader_election_namespace: None,
        extra_args: Vec::new(),
    };
    println!("[quickstart] starting egress-operator ({})", binary.display());
    let mut operator = OperatorProcess::start(&binary, plane.kubeconfig_path(), &options).await?;

    let proxies: Api<Proxy> = Api::namespaced(client.clone(), "default");
    for name in NAMES {
        let spec = ProxySpec {
            provider: Some("pods".into()),
            health_check: HealthCheck {
                interval_seconds: 5,
                timeout_seconds: 3,
                healthy_threshold: 1,
                ..HealthCheck::default()
            },
            ..ProxySpec::new(ProxyMode::Managed)
        };
        let mut proxy = Proxy::new(name, spec);
        proxy.metadata.labels = Some([("demo".to_owned(), "quickstart".to_owned())].into());
        proxies.create(&PostParams::default(), &proxy).await.with_context(|| format!("creating Proxy {name}"))?;
    }
    println!("[quickstart] created Proxies {}", NAMES.join(", "));

    let deadline = Instant::now() + Duration::from_secs(180);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut last = String::new();
    loop {
        tick.tick().await;
        let list = proxies.list(&ListParams::default()).await?;
        let line = list
            .items
            .iter()
            .map(|proxy| format!("{}={}", proxy.metadata.name.as_deref().unwrap_or("?"), phase(proxy)))
            .collect::<Vec<_>>()
            .join("  ");
        if line != last {
            println!("[quickstart] {:>5.1}s  {line}", started.elapsed().as_secs_f64());
            last = line;
        }
        if list.items.len() == NAMES.len()
            && list
                .items
                .iter()
                .all(|proxy| proxy.status.as_ref().and_then(|status| status.phase) == Some(ProxyPhase::Ready))
        {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "the Proxies were not Ready within 3 minutes; the operator's log ends with:\n{}",
                operator.log_tail()
            );
        }
    }

    let discovery = DiscoveryClient::new(&operator.discovery_url, Some(token.clone()))?;
    // The discovery view syncs once a second; the first lease may race it.
    let lease = {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match discovery.lease(LeaseOptions::for_target(origin.url())).await {
                Ok(lease) => break lease,
                Err(error) if Instant::now() < deadline => {
                    tick.tick().await;
                    let _ = error;
                }
                Err(error) => bail!("leasing a proxy failed: {error}"),
            }
        }
    };
    let proxy_address: std::net::SocketAddr = lease
        .proxy_url()
        .trim_start_matches("http://")
        .rsplit('@')
        .next()
        .unwrap_or_default()
        .parse()
        .context("the leased proxy URL has an IP address and port")?;
    let status = get_through_proxy(proxy_address, &origin.url(), None).await?;

    println!();
    println!("=== egress-operator quickstart: ready in {:.0?} ===", started.elapsed());
    if output(Command::new("kubectl").arg("version").arg("--client")).is_some() {
        let table = output(Command::new("kubectl").args([
            "--kubeconfig",
            &plane.kubeconfig_path().display().to_string(),
            "get",
            "px",
            "-A",
        ]));
        println!("{}", table.unwrap_or_default().trim_end());
    } else {
        for proxy in proxies.list(&ListParams::default()).await?.items {
            let endpoint = proxy
                .status
                .as_ref()
                .and_then(|status| status.endpoint.as_ref())
                .map(|endpoint| endpoint.address.clone())
                .unwrap_or_default();
            println!("{:<14} {:<8} {:<18}", proxy.metadata.name.as_deref().unwrap_or("?"), phase(&proxy), endpoint);
        }
    }
    println!();
    println!(
        "lease:       {} on {} for {} (expires {})",
        lease.id(),
        lease.proxy(),
        lease.target(),
        lease.expires_at()
    );
    println!("fetched:     GET {} through {} -> {status}", origin.url(), lease.proxy_url());
    println!("kubeconfig:  {}", plane.kubeconfig_path().display());
    println!("discovery:   {} (Authorization: Bearer {token})", operator.discovery_url);
    println!("metrics:     {}/metrics", operator.metrics_url);
    if status != 200 {
        bail!("the page fetched through the leased proxy answered {status}, not 200");
    }
    lease.release().await?;
    if !exit {
        println!(
            "\nRunning until Ctrl-C (try: kubectl --kubeconfig {} get px -A -w)",
            plane.kubeconfig_path().display()
        );
        tokio::signal::ctrl_c().await?;
    }
    println!("[quickstart] stopping the operator (SIGTERM)");
    if !operator.terminate(Duration::from_secs(30)).await {
        bail!("the operator did not stop within 30 s of SIGTERM; its log ends with:\n{}", operator.log_tail());
    }
    println!("[quickstart] done");
    Ok(())
}
