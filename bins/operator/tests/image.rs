//! The operator's OCI image, as `cargo xtask image` builds it, run by a real OCI runtime (crun) against the local
//! control plane: as the image's non-root user, with no capability, on a read-only root filesystem, it takes the leader Lease, probes an
//! External Proxy (a real Squid) Ready and answers a lease.

mod common;

use std::time::{Duration, Instant};

use egress_api::{Proxy, ProxyPhase};
use egress_client::{DiscoveryClient, LeaseOptions};
use egress_testenv::image::{BINARY, Container, ContainerOptions, PORTS, operator_layout};
use egress_testenv::{LocalOrigin, Squid, SquidOptions};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, PostParams};

const TOKEN: &str = "image-test-lease-token";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("a port").local_addr().expect("an address").port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_runs_under_crun_as_non_root_on_a_read_only_root_and_leads_and_answers_a_lease() {
    let ns = egress_testenv::namespace("image").await;
    let plane = egress_testenv::shared().await;
    let origin = LocalOrigin::start().await.expect("origin");
    let squid = Squid::start(SquidOptions::default()).await.expect("squid");
    let (discovery, metrics, health) = (free_port(), free_port(), free_port());
    let providers = format!(
        "providers:\n  - name: pods\n    type: kubernetes\n    destinations: {}\n    kubernetes: {{ namespace: {} }}\n",
        origin.destinations_yaml(),
        ns.name()
    );
    let args = vec![
        "--providers-config=/etc/egress/providers.yaml".to_owned(),
        format!("--cluster-id={}", ns.name()),
        format!("--discovery-addr=127.0.0.1:{discovery}"),
        format!("--metrics-addr=127.0.0.1:{metrics}"),
        format!("--health-addr=127.0.0.1:{health}"),
        "--discovery-tokens=/etc/egress/tokens".to_owned(),
        format!("--default-probe-url={}", origin.ip_url()),
        "--leader-elect".to_owned(),
        format!("--leader-election-namespace={}", ns.name()),
        format!("--watch-namespace={}", ns.name()),
    ];
    let started = Instant::now();
    // As the Deployment runs it: no capability, a read-only root filesystem.
    let mut container = Container::run(
        &operator_layout(),
        &ContainerOptions {
            args,
            env: vec![
                ("KUBECONFIG".to_owned(), "/etc/egress/kubeconfig".to_owned()),
                ("POD_NAME".to_owned(), "image-test".to_owned()),
            ],
            files: vec![
                ("/etc/egress/kubeconfig".to_owned(), plane.kubeconfig_inline().expect("a kubeconfig")),
                ("/etc/egress/providers.yaml".to_owned(), providers),
                ("/etc/egress/tokens".to_owned(), format!("lease {TOKEN}\n")),
            ],
            read_only_root: true,
            ..ContainerOptions::default()
        },
    )
    .expect("the container starts");

    // The image's own configuration: its entrypoint and a non-root user.
    let process = container.process_config().expect("the bundle's process");
    assert_eq!(process["args"][0], BINARY);
    assert_eq!(process["user"]["uid"], 65532);
    assert_eq!(process["user"]["gid"], 65532);
    let exposed = container.exposed_ports().expect("the image's exposed ports");
    let mut ports = PORTS.map(|port| format!("{port}/tcp")).to_vec();
    ports.sort();
    assert_eq!(exposed, ports, "discovery, metrics, health and the gateway's port");
    assert!(exposed.contains(&"8088/tcp".to_owned()), "the gateway's port: {exposed:?}");
    image_holds_only_what_runs(&container.rootfs());

    // It leads: the Lease names it.
    let leases: Api<Lease> = ns.api();
    let led = egress_testenv::eventually_every(
        "the container holds the Lease",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            assert!(container.alive(), "the container stopped:\n{}", container.log());
            let holder =
                leases.get_opt("egress-operator").await.ok().flatten().and_then(|lease| lease.spec?.holder_identity);
            match holder {
                Some(holder) if holder.starts_with("image-test") => Ok(holder),
                other => Err(format!("holder {other:?}; container log:\n{}", container.log())),
            }
        },
    )
    .await;
    println!("image: the container leads as {led} {:.1?} after crun started it", started.elapsed());

    // As the Deployment runs it: uid 65532, and the root filesystem read-only.
    let pid = container.pid().expect("the container's pid");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("its status");
    let uid = status.lines().find(|line| line.starts_with("Uid:")).expect("a Uid line");
    assert!(uid.split_whitespace().skip(1).all(|id| id == "65532"), "{uid}");
    let capabilities = status.lines().find(|line| line.starts_with("CapEff:")).expect("a CapEff line");
    assert_eq!(capabilities.split_whitespace().nth(1), Some("0000000000000000"), "no capability: {capabilities}");
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).expect("its mounts");
    let root = mounts.lines().find(|line| line.split_whitespace().nth(4) == Some("/")).expect("a root mount");
    let options = root.split_whitespace().nth(5).expect("mount options");
    assert!(options.split(',').any(|option| option == "ro"), "the root filesystem is mounted {options}");

    // It serves discovery: an External Proxy (a real Squid) probed Ready through the image's TLS and HTTP stack, then
    // leased.
    let proxies: Api<Proxy> = ns.api();
    proxies
        .create(&PostParams::default(), &Proxy::new("squid", common::external(squid.address(), 1)))
        .await
        .expect("a Proxy");
    if let Err(error) = common::wait_phase(&proxies, &["squid"], ProxyPhase::Ready, Duration::from_secs(60)).await {
        panic!("{error}\ncontainer log:\n{}", container.log());
    }
    let client =
        DiscoveryClient::new(&format!("http://127.0.0.1:{discovery}"), Some(TOKEN.to_owned())).expect("client");
    let lease = client.lease(LeaseOptions::for_target("example.com")).await.expect("a lease from the container");
    assert!(lease.proxy_url().contains(&squid.address().to_string()), "{}", lease.proxy_url());
    println!("image: leased {} from the container", lease.proxy_url());
    lease.release().await.expect("release");

    let stopping = Instant::now();
    container.stop();
    println!("image: stopped in {:.1?}", stopping.elapsed());
    assert!(!container.alive());
}

/// The image ships no script whose interpreter it lacks (it has no shell and no Perl), and a binary without its
/// symbol table (stripped: about a quarter smaller).
fn image_holds_only_what_runs(rootfs: &std::path::Path) {
    let mut scripts = Vec::new();
    let mut stack = vec![rootfs.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("a directory of the image").flatten() {
            let kind = entry.file_type().expect("a file type");
            if kind.is_dir() {
                stack.push(entry.path());
            } else if kind.is_file() {
                let mut head = [0u8; 128];
                let read = std::io::Read::read(&mut std::fs::File::open(entry.path()).expect("a file"), &mut head)
                    .expect("its first bytes");
                let Some(line) = head[..read].strip_prefix(b"#!") else { continue };
                let line = String::from_utf8_lossy(line.split(|byte| *byte == b'\n').next().unwrap_or_default());
                let interpreter = line.split_whitespace().next().unwrap_or_default().to_owned();
                let inside = rootfs.join(interpreter.trim_start_matches('/'));
                if interpreter.is_empty() || std::fs::symlink_metadata(&inside).is_err() {
                    scripts.push(format!("{} (#!{line})", entry.path().strip_prefix(rootfs).unwrap().display()));
                }
            }
        }
    }
    assert!(scripts.is_empty(), "scripts whose interpreter the image lacks: {scripts:#?}");
    let binary = rootfs.join(BINARY.trim_start_matches('/'));
    let sections = std::process::Command::new("readelf").args(["-S", "-W"]).arg(&binary).output().expect("readelf");
    assert!(sections.status.success(), "readelf: {}", String::from_utf8_lossy(&sections.stderr));
    let sections = String::from_utf8_lossy(&sections.stdout);
    assert!(sections.contains(".dynsym"), "readelf listed no sections:\n{sections}");
    for kept in [".symtab", ".debug_info", ".debug_line"] {
        assert!(!sections.contains(kept), "the binary keeps {kept}: not stripped");
    }
    println!(
        "image: {} is {:.1} MB, stripped; no script without its interpreter",
        BINARY,
        std::fs::metadata(&binary).expect("the binary").len() as f64 / 1e6
    );
}
