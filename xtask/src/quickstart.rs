//! `cargo xtask quickstart`: the whole product on one machine, end to end, installed as a user installs it.
//!
//! The demo runs in a network namespace of its own (pods need non-loopback addresses for EndpointSlices, see
//! [`crate::podnet`]): the local control plane with kube-controller-manager, `deploy/default` applied with
//! `kubectl apply -k` (random `lease` and `read` discovery tokens instead of the example one), the node agent running
//! the two operator pods as the built binary and the proxy pods as Squid; three sample Proxies shown until Ready (the
//! last one requires credentials from a Secret), that one leased through the `egress-discovery` Service and a local
//! page fetched through it with the credentials its lease URL carries, and the page fetched again through the
//! `egress-gateway` Service with only a proxy URL. Every file it writes is 0600 in a 0700 directory.
//!
//! This process stays outside: it starts the demo inside with `ip netns exec`, and forwards a loopback port here to
//! the apiserver and others to the discovery and gateway Services, through Unix sockets the demo listens on (the file system
//! is shared across network namespaces). So `kubectl` on this machine works with the kubeconfig it prints, and so
//! does the discovery URL. Everything runs until Ctrl-C (`--exit` stops after the demo, once it has checked that
//! `kubectl get endpointslices` through the forwarded kubeconfig lists the leader).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use egress_api::{HealthCheck, Proxy, ProxyAuth, ProxyPhase, ProxySpec, SecretNameRef};
use egress_client::{DiscoveryClient, LeaseOptions, ProxyId};
use egress_testenv::install::{InstallOptions, Installation, SYSTEM_NAMESPACE};
use egress_testenv::{ControlPlane, LocalOrigin, assets, get_through_proxy, through_proxy};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, ListParams, ObjectMeta, PostParams};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use crate::process::{cargo, output, run as run_command};
use crate::{envtest, packages, podnet, workspace_root};

const PROXY_NAMESPACE: &str = "egress-proxies";
const NAMES: [&str; 3] = ["quickstart-1", "quickstart-2", "quickstart-3"];
/// The sample Proxy that requires credentials, and their Secret.
const CREDENTIALED: &str = "quickstart-3";
const AUTH_SECRET: &str = "quickstart-3-auth";

/// What the demo inside tells this process, in `ready.json` of the shared directory.
const READY_FILE: &str = "ready.json";

/// What this process tells the demo inside (with `--exit`) once it has checked the EndpointSlice.
const DONE_FILE: &str = "done";

/// The label the leader sets on its own pod (`egress_runtime::role_label::ROLE_LABEL`, which xtask does not link).
const ROLE_LABEL: &str = "egress.crawl.example.com/role";

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| workspace_root().join("target"), PathBuf::from)
}

/// Runs the quickstart; with `inside` (set by the outer process only), runs the demo in this network namespace and
/// reports through that directory.
pub fn run(exit: bool, inside: Option<PathBuf>) -> Result<()> {
    if inside.is_none() {
        packages::ensure_installed()?;
        envtest::ensure_built()?;
        run_command(cargo().args(["build", "--locked", "-p", "egress-operator"]))?;
    }
    run_built(exit, inside)
}

/// The quickstart with the operator binary already built: `cargo xtask test` runs it after `cargo test --workspace`,
/// which builds `target/debug/egress-operator` for the end-to-end tests (a `cargo build -p` would unify features
/// differently and rebuild for a minute).
pub fn run_built(exit: bool, inside: Option<PathBuf>) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    if let Some(dir) = inside {
        let binary = target_dir().join("debug").join("egress-operator");
        return runtime.block_on(async {
            let mut signals = Signals::new()?;
            // A signal at any step drops the demo, whose parts stop their processes and remove their files.
            tokio::select! {
                result = demo(binary, exit, &dir) => result,
                signal = signals.next() => {
                    println!("[quickstart] {signal}: stopping (the node agent stops the operator pods with SIGTERM)");
                    Ok(())
                }
            }
        });
    }
    let network = podnet::PodNetwork::create()?;
    let dir = tempfile::Builder::new().prefix("egress-quickstart-").tempdir()?;
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o700))?;
    let mut inner = network.command(std::env::current_exe().context("finding the xtask binary")?);
    inner.arg("quickstart").arg("--inside").arg(dir.path());
    if exit {
        inner.arg("--exit");
    }
    let mut child = tokio::process::Command::from(inner);
    runtime.block_on(async {
        // SIGTERM, SIGINT or SIGHUP here stops the demo inside, then this process removes the network namespace and
        // the shared directory (both on drop).
        let mut signals = Signals::new()?;
        let mut child = child.kill_on_drop(false).spawn().context("starting the demo in its network namespace")?;
        let pid = child.id().context("the demo's process ID")?;
        let signal = tokio::select! {
            result = outside(&mut child, &dir, &network, exit) => return result,
            signal = signals.next() => signal,
        };
        println!("[quickstart] {signal}: stopping the demo");
        let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
        match tokio::time::timeout(Duration::from_secs(120), child.wait()).await {
            Ok(status) => {
                status?;
            }
            Err(_) => {
                child.kill().await?;
                bail!("the demo did not stop within 120 s of SIGTERM; killed it");
            }
        }
        println!("[quickstart] stopped");
        Ok(())
    })
}

/// `kill -TERM` of a running `cargo xtask quickstart` (the outer process, as a user or a service manager sends it)
/// stops the whole demo and leaves no process, network namespace or file; run by `cargo xtask test`.
pub fn check_sigterm_cleans_up() -> Result<()> {
    use std::io::BufRead;
    let before = crate::leftovers::Snapshot::take();
    // As built for the tests, like the `--exit` run before it (a `cargo build -p` would rebuild for a minute).
    let mut child = std::process::Command::new(std::env::current_exe().context("finding the xtask binary")?)
        .args(["quickstart", "--built"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the quickstart")?;
    let stdout = child.stdout.take().context("the quickstart's output")?;
    let (lines, running) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            println!("  | {line}");
            if line.starts_with("Running until Ctrl-C") {
                let _ = lines.send(());
            }
        }
    });
    if running.recv_timeout(Duration::from_secs(300)).is_err() {
        let _ = child.kill();
        let _ = child.wait();
        bail!("the quickstart did not reach `Running until Ctrl-C` within 300 s");
    }
    let started = Instant::now();
    run_command(std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]))?;
    let deadline = Instant::now() + Duration::from_secs(150);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            bail!("the quickstart did not stop within 150 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    if !status.success() {
        bail!("the quickstart ended with {status} after SIGTERM");
    }
    println!("quickstart: stopped {:.1} s after SIGTERM", started.elapsed().as_secs_f64());
    crate::leftovers::assert_none_since(&before, "`kill -TERM` of the quickstart", Duration::from_secs(20))?;
    println!("quickstart: nothing left behind (processes, network namespaces, temp files)");
    Ok(())
}

/// The termination signals, registered once (from then on they no longer end the process by themselves).
struct Signals {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            terminate: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
            hangup: signal(SignalKind::hangup())?,
        })
    }

    /// The next one to arrive, by name.
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "SIGINT",
            _ = self.hangup.recv() => "SIGHUP",
        }
    }
}

/// The outside part: waits for the demo to be ready, prints how to reach it, checks the EndpointSlice through the
/// forwarded kubeconfig, and waits for the demo to end.
async fn outside(
    child: &mut tokio::process::Child,
    dir: &tempfile::TempDir,
    network: &podnet::PodNetwork,
    exit: bool,
) -> Result<()> {
    {
        let ready = loop {
            if let Some(status) = child.try_wait()? {
                bail!("the demo ended before it was ready ({status})");
            }
            if let Ok(text) = fs::read_to_string(dir.path().join(READY_FILE)) {
                break serde_json::from_str::<Value>(&text).context("reading the demo's ready file")?;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let apiserver = forward(dir.path().join("apiserver.sock")).await?;
        let discovery = forward(dir.path().join("discovery.sock")).await?;
        let gateway = forward(dir.path().join("gateway.sock")).await?;
        let inner_kubeconfig = ready["kubeconfig"].as_str().context("the ready file names the kubeconfig")?;
        let inner_server = ready["server"].as_str().context("the ready file names the apiserver")?;
        let kubeconfig = dir.path().join("kubeconfig");
        let text = fs::read_to_string(inner_kubeconfig).context("reading the demo's kubeconfig")?;
        fs::write(&kubeconfig, text.replace(inner_server, &format!("https://{apiserver}")))?;
        fs::set_permissions(&kubeconfig, fs::Permissions::from_mode(0o600))?;
        let kubectl = assets::kubectl();
        println!();
        println!("kubeconfig:  {}", kubeconfig.display());
        println!("kubectl:     {} (or any kubectl)", kubectl.display());
        println!("discovery:   http://{discovery}");
        // The gateway runs inside, beside the proxies, so it answers here: a crawler needs only this proxy URL.
        println!(
            "gateway:     http://session-1:{}@{gateway} (a proxy URL for any crawler; docs/gateway.md)",
            ready["token"].as_str().unwrap_or("")
        );
        println!(
            "tokens:      {} (scope lease: lease, renew, release, report)\n             {} (scope read: list proxies, cooldowns)",
            ready["token"].as_str().unwrap_or(""),
            ready["readToken"].as_str().unwrap_or("")
        );
        println!(
            "proxies:     inside the network namespace, e.g. `ip netns exec {} curl -x <proxy URL> ...`",
            network.name()
        );
        // The proxies answer only inside the namespace, and the discovery Service answers there too: a crawler run
        // there reaches both.
        println!(
            "crawl:       ip netns exec {} env EGRESS_URL={} EGRESS_TOKEN={} <your crawler>",
            network.name(),
            ready["discoveryInside"].as_str().unwrap_or_default(),
            ready["token"].as_str().unwrap_or("")
        );
        // No kubelet serves `kubectl logs` here: the node agent runs the pods and keeps their output in files.
        let logs = ready["logs"].as_array().cloned().unwrap_or_default();
        if logs.is_empty() {
            bail!("the demo's ready file names no log file of the operator and gateway pods");
        }
        println!("logs:        `kubectl logs` needs a kubelet, which the quickstart has not; the pods' output is in");
        for log in &logs {
            let (pod, container, path) = (
                log["pod"].as_str().unwrap_or(""),
                log["container"].as_str().unwrap_or(""),
                log["path"].as_str().unwrap_or(""),
            );
            if !Path::new(path).is_file() {
                bail!("the log file of {pod} ({container}) the demo named is not there: {path}");
            }
            println!("             {path}  ({pod}, {container})");
        }
        let endpoints =
            output(std::process::Command::new(&kubectl).arg(format!("--kubeconfig={}", kubeconfig.display())).args([
                "get",
                "endpointslices",
                "-n",
                SYSTEM_NAMESPACE,
                "-l",
                "kubernetes.io/service-name=egress-discovery",
            ]))
            .context("kubectl get endpointslices through the forwarded kubeconfig failed")?;
        println!("{}", endpoints.trim_end());
        let leader = ready["leader"].as_str().unwrap_or_default();
        if !endpoints.contains(leader) {
            bail!("the egress-discovery EndpointSlice does not list the leader's address {leader}");
        }
        if exit {
            fs::write(dir.path().join(DONE_FILE), "")?;
        } else {
            println!("\nRunning until Ctrl-C (try: kubectl --kubeconfig {} get px,pods -A)", kubeconfig.display());
        }
        let status = child.wait().await?;
        if !status.success() {
            bail!("the demo ended with {status}");
        }
        Ok(())
    }
}

/// Forwards a fresh loopback port to the Unix socket `socket`; returns the port's address.
async fn forward(socket: PathBuf) -> Result<std::net::SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let socket = socket.clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = UnixStream::connect(&socket).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    Ok(address)
}

/// Serves the Unix socket `socket`, forwarding each connection to `target` (inside this network namespace).
fn serve_socket(socket: &Path, target: std::net::SocketAddr) -> Result<()> {
    let listener = UnixListener::bind(socket).with_context(|| format!("listening on {}", socket.display()))?;
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    Ok(())
}

fn phase(proxy: &Proxy) -> String {
    proxy
        .status
        .as_ref()
        .and_then(|status| status.phase)
        .map_or_else(|| "Pending".to_owned(), |phase| format!("{phase:?}"))
}

/// 24 random bytes, hex-encoded: a token or a password.
fn random_token() -> Result<String> {
    let mut bytes = [0u8; 24];
    std::io::Read::read_exact(&mut fs::File::open("/dev/urandom")?, &mut bytes)?;
    Ok(bytes.iter().map(|byte| format!("{byte:02x}")).collect())
}

async fn demo(binary: PathBuf, exit: bool, dir: &Path) -> Result<()> {
    let started = Instant::now();
    println!("[quickstart] starting the local control plane (etcd, kube-apiserver, kube-controller-manager)");
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
    let origin = LocalOrigin::start().await?;
    let token = random_token()?;
    let read_token = random_token()?;
    let options = InstallOptions {
        operator_binary: binary.clone(),
        providers_yaml: format!(
            "providers:\n  - name: pods\n    type: kubernetes\n    # The demo's origin is on loopback, which proxies may not\n    \
             # reach unless allowed.\n    destinations: {}\n    kubernetes:\n      namespace: {PROXY_NAMESPACE}\n      \
             image: ubuntu/squid:latest\n",
            origin.destinations_yaml()
        ),
        proxy_namespaces: vec![PROXY_NAMESPACE.into()],
        default_probe_url: origin.ip_url(),
        // One tenant, so the read token sees the cooldowns the lease token's reports make; at most 10 of the
        // demo fleet's 15 lease slots, so a second tenant added to the Secret still gets proxies.
        discovery_tokens: Some(format!("lease {token} tenant=demo maxLeases=10\nread {read_token} tenant=demo\n")),
        shared_state: false,
    };
    println!("[quickstart] kubectl apply -k deploy/default (the operator's image runs as {})", binary.display());
    let installation = Installation::apply(&plane, &options).await?;
    println!(
        "[quickstart] {:>5.1}s  the egress-operator Deployment is Available (2 replicas)",
        started.elapsed().as_secs_f64()
    );

    // The last sample requires credentials, from a Secret of its own: its lease URL carries them.
    let password = random_token()?;
    let secret = Secret {
        metadata: ObjectMeta { name: Some(AUTH_SECRET.into()), ..ObjectMeta::default() },
        string_data: Some([("username".to_owned(), "crawler".to_owned()), ("password".to_owned(), password)].into()),
        ..Secret::default()
    };
    Api::<Secret>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &secret)
        .await
        .context("creating the sample proxy credentials")?;
    let proxies: Api<Proxy> = Api::namespaced(client.clone(), "default");
    for name in NAMES {
        let auth = (name == CREDENTIALED).then(|| ProxyAuth { secret_ref: SecretNameRef { name: AUTH_SECRET.into() } });
        let spec =
            ProxySpec { auth, ..ProxySpec::managed("pods", None).with_health_check(HealthCheck::every(5, 3, 1, 3)) };
        let mut proxy = Proxy::new(name, spec);
        proxy.metadata.labels = Some([("demo".to_owned(), "quickstart".to_owned())].into());
        proxies.create(&PostParams::default(), &proxy).await.with_context(|| format!("creating Proxy {name}"))?;
    }
    println!("[quickstart] created Proxies {} ({CREDENTIALED} with credentials)", NAMES.join(", "));

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
                "the Proxies were not Ready within 3 minutes; the operator pods' logs:\n{}",
                installation.operator_logs().await
            );
        }
    }

    // Through the egress-discovery Service, as a crawler in the cluster would.
    let discovery = DiscoveryClient::new(&installation.discovery.url(), Some(token.clone()))?;
    let lease = {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match discovery
                .lease(LeaseOptions::for_target(origin.url()).proxy(&ProxyId::new("default", CREDENTIALED)))
                .await
            {
                Ok(lease) => break lease,
                Err(_) if Instant::now() < deadline => {
                    tick.tick().await;
                }
                Err(error) => bail!("leasing a proxy failed: {error}"),
            }
        }
    };
    let authority = lease.proxy_url().trim_start_matches("http://");
    let (userinfo, host) = authority.rsplit_once('@').context("the leased proxy URL carries its credentials")?;
    let proxy_address: std::net::SocketAddr =
        host.parse().context("the leased proxy URL has an IP address and port")?;
    let credentials = userinfo.split_once(':').context("the credentials are user:password")?;
    let status = get_through_proxy(proxy_address, &origin.url(), Some(credentials)).await?;

    // Through the egress-gateway Service, as a crawler that knows nothing but a proxy URL would: the user name names
    // a session, the password is the lease token.
    let gateway_address: std::net::SocketAddr =
        installation.gateway.url().trim_start_matches("http://").parse().context("the gateway Service's address")?;
    let through_gateway = {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let answer = through_proxy(gateway_address, "GET", &origin.url(), Some(("session-demo", &token))).await;
            match answer {
                Ok(answer) if answer.status == 200 => break answer,
                Ok(_) | Err(_) if Instant::now() < deadline => {
                    tick.tick().await;
                }
                Ok(answer) => bail!(
                    "the page fetched through the gateway answered {}: {}; the gateway pods' logs:\n{}",
                    answer.status,
                    answer.header("proxy-status").unwrap_or_default(),
                    installation.gateway_logs().await
                ),
                Err(error) => bail!("fetching through the gateway failed: {error:#}"),
            }
        }
    };

    println!();
    println!("=== egress-operator quickstart: ready in {:.0?} ===", started.elapsed());
    let kubectl = |args: &[&str]| {
        output(
            std::process::Command::new(assets::kubectl())
                .arg(format!("--kubeconfig={}", plane.kubeconfig_path().display()))
                .args(args),
        )
        .unwrap_or_default()
    };
    println!("{}", kubectl(&["get", "px", "-A"]).trim_end());
    println!("{}", kubectl(&["get", "pods", "-n", SYSTEM_NAMESPACE, "-L", ROLE_LABEL]).trim_end());
    println!();
    println!(
        "lease:       {} on {} for {} (expires {})",
        lease.id(),
        lease.proxy(),
        lease.target(),
        lease.expires_at()
    );
    // The proxy's password stays in the lease answer: a demo's output ends up in terminals, logs and bug reports.
    println!("fetched:     GET {} through {} -> {status}", origin.url(), without_password(lease.proxy_url()));
    if status != 200 {
        bail!("the page fetched through the leased proxy answered {status}, not 200");
    }
    lease.release().await?;
    println!(
        "gateway:     GET {} through http://session-demo:***@{gateway_address} -> {} via {}",
        origin.url(),
        through_gateway.status,
        through_gateway.header("x-egress-proxy").unwrap_or("?")
    );

    // Tell the process outside how to reach the apiserver and the discovery Service.
    let apiserver = plane.server_address().context("the local control plane has an address")?;
    let discovery_address: std::net::SocketAddr =
        installation.discovery.url().trim_start_matches("http://").parse().context("the Service's address")?;
    serve_socket(&dir.join("apiserver.sock"), apiserver)?;
    serve_socket(&dir.join("discovery.sock"), discovery_address)?;
    serve_socket(&dir.join("gateway.sock"), gateway_address)?;
    let leader =
        installation.discovery.endpoints().first().map(|endpoint| endpoint.ip().to_string()).unwrap_or_default();
    let ready = json!({
        "kubeconfig": plane.kubeconfig_path(),
        "server": plane.server_url(),
        "token": token,
        "readToken": read_token,
        "leader": leader,
        "discoveryInside": installation.discovery.url(),
        "logs": installation
            .log_files()
            .await
            .into_iter()
            .map(|(pod, container, path)| json!({"pod": pod, "container": container, "path": path}))
            .collect::<Vec<_>>(),
    });
    let ready_path = dir.join(READY_FILE);
    fs::write(dir.join("ready.tmp"), ready.to_string())?;
    fs::set_permissions(dir.join("ready.tmp"), fs::Permissions::from_mode(0o600))?;
    fs::rename(dir.join("ready.tmp"), &ready_path)?;

    if exit {
        // Until the process outside has checked the EndpointSlice through the forwarded kubeconfig.
        let deadline = Instant::now() + Duration::from_secs(60);
        while !dir.join(DONE_FILE).exists() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    } else {
        // Until a signal: the caller stops the demo then.
        std::future::pending::<()>().await;
    }
    println!("[quickstart] stopping (the node agent stops the operator pods with SIGTERM)");
    drop(installation);
    drop(plane);
    println!("[quickstart] done");
    Ok(())
}

/// A proxy URL with its password replaced by `***` (`http://user:***@host:port`).
fn without_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
            format!("{scheme}://{user}:***@{host}")
        }
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::without_password;

    #[test]
    fn printed_proxy_urls_carry_no_password() {
        assert_eq!(without_password("http://crawler:s3cr%40t@10.0.0.1:3128"), "http://crawler:***@10.0.0.1:3128");
        assert_eq!(without_password("http://10.0.0.1:3128"), "http://10.0.0.1:3128");
    }
}
