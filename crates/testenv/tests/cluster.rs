//! The local cluster does what the product's manifests rely on: kube-controller-manager turns a Deployment into a
//! ReplicaSet and Pods, the node agent runs them (environment from the downward API, the projected service-account
//! token, a non-root user, probes, restarts), the endpointslice controller lists only Ready pods, and the garbage
//! collector removes what an owner leaves behind.

use std::collections::BTreeSet;
use std::time::Duration;

use egress_testenv::node_agent::{AgentConfig, ImageMap, Runtime};
use egress_testenv::{NodeAgent, eventually, http_get};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(90);

/// A Deployment whose pods serve their own service-account directory over HTTP, as a non-root user; `ready` says
/// whether its readiness probe can pass.
fn deployment(name: &str, replicas: i32, ready: bool) -> Deployment {
    let probe = if ready {
        json!({ "httpGet": { "path": "/namespace", "port": "http" }, "periodSeconds": 1 })
    } else {
        json!({ "tcpSocket": { "port": 9 }, "periodSeconds": 1 })
    };
    serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": {
            "replicas": replicas,
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": { "app": name, "tier": "web" } },
                "spec": {
                    "securityContext": { "runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532 },
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "web",
                        "image": "egress-test/web:1",
                        "args": ["-m", "http.server", "--bind", "$(POD_IP)", "8000"],
                        "workingDir": "/var/run/secrets/kubernetes.io/serviceaccount",
                        "env": [{ "name": "POD_IP", "valueFrom": { "fieldRef": { "fieldPath": "status.podIP" } } }],
                        "ports": [{ "name": "http", "containerPort": 8000 }],
                        "readinessProbe": probe,
                    }],
                },
            },
        },
    }))
    .expect("a Deployment")
}

async fn agent(client: &Client, namespace: &str) -> NodeAgent {
    let plane = egress_testenv::shared().await;
    let images = ImageMap::new()
        .with("egress-test/web:1", Runtime::Program { entrypoint: vec!["/usr/bin/python3".into()], env: Vec::new() });
    let config = AgentConfig {
        namespaces: vec![namespace.to_owned()],
        label_selector: None,
        images,
        apiserver: plane.server_address(),
    };
    NodeAgent::start_with(client.clone(), config).await.expect("node agent")
}

async fn pods_of(api: &Api<Pod>, app: &str) -> Vec<Pod> {
    api.list(&ListParams::default().labels(&format!("app={app}"))).await.expect("pods").items
}

fn ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|status| status.conditions.as_ref())
        .is_some_and(|conditions| conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[tokio::test]
async fn deployments_run_and_only_ready_pods_are_endpoints() {
    assert!(
        egress_testenv::pod_network().is_some(),
        "EndpointSlices refuse loopback pod addresses: run this through `cargo xtask test`, which runs the tests in a \
         network namespace with a pod network ({} names it)",
        egress_testenv::POD_NETWORK_ENV
    );
    let ns = egress_testenv::namespace("cluster").await;
    assert!(ns.control_plane().has_controller_manager(), "the local control plane runs kube-controller-manager");
    let _agent = agent(&ns.client(), ns.name()).await;
    let deployments = ns.api::<Deployment>();
    deployments.create(&PostParams::default(), &deployment("web", 2, true)).await.expect("create web");
    deployments.create(&PostParams::default(), &deployment("stuck", 1, false)).await.expect("create stuck");
    let service: Service = serde_json::from_value(json!({
        "metadata": { "name": "web" },
        "spec": { "selector": { "tier": "web" }, "ports": [{ "name": "http", "port": 80, "targetPort": "http" }] },
    }))
    .expect("a Service");
    ns.api::<Service>().create(&PostParams::default(), &service).await.expect("create the Service");

    // The deployment controller made a ReplicaSet owned by the Deployment, and it made the Pods.
    let replica_sets = eventually("the web ReplicaSet", WAIT, || async {
        let sets = ns.api::<ReplicaSet>().list(&ListParams::default().labels("app=web")).await.ok()?;
        (!sets.items.is_empty()).then_some(sets.items)
    })
    .await;
    let owner = replica_sets[0].owner_references().first().expect("an owner").clone();
    assert_eq!((owner.kind.as_str(), owner.name.as_str()), ("Deployment", "web"));

    let pods = ns.api::<Pod>();
    let web = eventually("two Ready web pods", WAIT, || async {
        let ready_pods: Vec<Pod> = pods_of(&pods, "web").await.into_iter().filter(ready).collect();
        (ready_pods.len() == 2).then_some(ready_pods)
    })
    .await;
    let addresses: BTreeSet<String> =
        web.iter().filter_map(|pod| pod.status.as_ref()?.pod_ip.clone()).collect::<BTreeSet<_>>();
    assert_eq!(addresses.len(), 2, "each pod has an address of its own");

    // What a pod sees: its namespace, a real token for its ServiceAccount, and the cluster's CA, served by a
    // process running as 65532 in its own mount namespace.
    let address = addresses.iter().next().expect("an address");
    let (status, namespace) = http_get(&format!("http://{address}:8000/namespace")).await.expect("GET /namespace");
    assert_eq!((status, namespace.as_str()), (200, ns.name()));
    let (status, token) = http_get(&format!("http://{address}:8000/token")).await.expect("GET /token");
    assert_eq!(status, 200);
    assert_eq!(token.split('.').count(), 3, "the token is a JWT: {token}");
    let (_, ca) = http_get(&format!("http://{address}:8000/ca.crt")).await.expect("GET /ca.crt");
    assert_eq!(Some(ca.as_str()), ns.control_plane().ca_pem(), "the projected CA is the cluster's");
    let uid = std::fs::read_to_string(format!(
        "/proc/{}/status",
        _agent.container_pid(ns.name(), &web[0].name_any(), "web").expect("a pid")
    ))
    .expect("the process's status");
    assert!(uid.lines().any(|line| line.starts_with("Uid:") && line.contains("65532")), "runs as 65532:\n{uid}");

    // The EndpointSlice holds the two Ready pods as ready endpoints, and the stuck one as not ready at most.
    let slices: Api<EndpointSlice> = ns.api();
    eventually("the EndpointSlice to list exactly the Ready pods", WAIT, || async {
        let list = slices.list(&ListParams::default().labels("kubernetes.io/service-name=web")).await.ok()?;
        let ready_addresses: BTreeSet<String> = list
            .items
            .iter()
            .flat_map(|slice| slice.endpoints.iter().flatten())
            .filter(|endpoint| endpoint.conditions.as_ref().and_then(|c| c.ready) == Some(true))
            .flat_map(|endpoint| endpoint.addresses.clone())
            .collect();
        (ready_addresses == addresses).then_some(())
    })
    .await;
    let stuck = pods_of(&pods, "stuck").await;
    assert_eq!(stuck.len(), 1);
    assert!(!ready(&stuck[0]), "a pod whose readiness probe fails is not Ready");

    // A container that dies is restarted and counted.
    let victim = web[0].name_any();
    assert!(_agent.signal_container(ns.name(), &victim, "web", "KILL"));
    eventually("the killed container to be restarted", WAIT, || async {
        let pod = pods.get(&victim).await.ok()?;
        let status = pod.status.as_ref()?.container_statuses.as_ref()?.first()?.clone();
        (status.restart_count == 1 && status.ready).then_some(())
    })
    .await;
    assert_eq!(_agent.restart_count(ns.name(), &victim, "web"), Some(1));

    // Deleting the Deployment removes its ReplicaSet and Pods (the garbage collector) and their processes.
    let pid = _agent.container_pid(ns.name(), &victim, "web").expect("a pid");
    deployments.delete("web", &DeleteParams::foreground()).await.expect("delete web");
    eventually("the web pods to be gone", WAIT, || async { pods_of(&pods, "web").await.is_empty().then_some(()) })
        .await;
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "the process is gone with its pod");
}

#[tokio::test]
async fn owned_objects_are_collected_with_their_owner() {
    let ns = egress_testenv::namespace("gc").await;
    let maps = ns.api::<ConfigMap>();
    let owner = maps
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({ "metadata": { "name": "owner" } })).expect("cm"),
        )
        .await
        .expect("create the owner");
    let dependent: ConfigMap = serde_json::from_value(json!({ "metadata": { "name": "dependent", "ownerReferences": [{
        "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.uid().expect("a uid"),
    }]}}))
    .expect("cm");
    maps.create(&PostParams::default(), &dependent).await.expect("create the dependent");
    maps.delete("owner", &DeleteParams::default()).await.expect("delete the owner");
    eventually("the dependent to be collected", WAIT, || async {
        maps.get_opt("dependent").await.ok()?.is_none().then_some(())
    })
    .await;
}

/// A bare pod whose image maps to `/bin/sh`, with its own command and probes.
fn shell_pod(name: &str, script: &str, extra: serde_json::Value) -> Pod {
    let mut container = json!({
        "name": "sh",
        "image": "egress-test/sh:1",
        "command": ["/bin/sh", "-c", script],
    });
    if let (Some(container), Some(extra)) = (container.as_object_mut(), extra.as_object()) {
        container.extend(extra.clone());
    }
    serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "terminationGracePeriodSeconds": 2, "containers": [container] },
    }))
    .expect("a Pod")
}

async fn shell_agent(client: &Client, namespace: &str) -> NodeAgent {
    let images = ImageMap::new()
        .with("egress-test/sh:1", Runtime::Program { entrypoint: vec!["/bin/sh".into()], env: Vec::new() });
    let config = AgentConfig { namespaces: vec![namespace.to_owned()], label_selector: None, images, apiserver: None };
    NodeAgent::start_with(client.clone(), config).await.expect("node agent")
}

#[tokio::test]
async fn exec_liveness_probes_restart_and_grace_periods_bound_termination() {
    let ns = egress_testenv::namespace("probes").await;
    let agent = shell_agent(&ns.client(), ns.name()).await;
    let pods = ns.api::<Pod>();
    // Passing exec probes: Ready, never restarted. Failing exec liveness: restarted and counted.
    let exec = |command: &[&str], threshold: i32| json!({ "exec": { "command": command }, "periodSeconds": 1, "failureThreshold": threshold });
    let healthy = shell_pod(
        "healthy",
        "trap 'exit 0' TERM; while true; do sleep 0.2; done",
        json!({ "readinessProbe": exec(&["true"], 1), "livenessProbe": exec(&["true"], 1) }),
    );
    let dying = shell_pod(
        "dying",
        "trap 'exit 0' TERM; while true; do sleep 0.2; done",
        json!({ "livenessProbe": exec(&["/bin/sh", "-c", "exit 1"], 2) }),
    );
    // Ignores SIGTERM: its deletion must wait the grace period (2 s), then SIGKILL, not 30 s and not at once.
    let stubborn = shell_pod("stubborn", "trap '' TERM; while true; do sleep 0.2; done", json!({}));
    for pod in [&healthy, &dying, &stubborn] {
        pods.create(&PostParams::default(), pod).await.expect("create pod");
    }
    eventually("the healthy pod Ready", WAIT, || async { pods.get("healthy").await.ok().filter(ready).map(|_| ()) })
        .await;
    // Restarted (the first time at once, then after kubelet's 10 s back-off), each time stopped with SIGTERM, which
    // the script traps: exit code 0, not 137 (a wrapper that left SIGTERM ignored made every stop a SIGKILL).
    eventually("the failing liveness probe to restart its container twice", WAIT, || async {
        let status = pods.get("dying").await.ok()?.status?.container_statuses?.into_iter().next()?;
        let last = status.last_state.and_then(|state| state.terminated)?;
        (status.restart_count >= 2 && last.exit_code == 0).then_some(())
    })
    .await;
    let healthy_now = pods.get("healthy").await.expect("healthy");
    let restarts =
        healthy_now.status.and_then(|s| s.container_statuses).and_then(|c| c.first().map(|c| c.restart_count));
    assert_eq!(restarts, Some(0), "passing probes never restart a container");

    eventually("the stubborn pod Running", WAIT, || async {
        agent.container_pid(ns.name(), "stubborn", "sh").map(|_| ())
    })
    .await;
    let pid = agent.container_pid(ns.name(), "stubborn", "sh").expect("a pid");
    let deleted = std::time::Instant::now();
    pods.delete("stubborn", &DeleteParams::default()).await.expect("delete");
    eventually("the stubborn pod to be gone", WAIT, || async {
        pods.get_opt("stubborn").await.ok()?.is_none().then_some(())
    })
    .await;
    let took = deleted.elapsed();
    assert!(took >= Duration::from_secs(2), "SIGTERM was ignored, so the grace period ran out first ({took:?})");
    assert!(took < Duration::from_secs(15), "SIGKILL followed the 2 s grace period ({took:?})");
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "the process is gone");
}

/// Set in the re-executed copy of this test binary that plays the test process to be killed.
const CHILD_ENV: &str = "EGRESS_TESTENV_AGENT_CHILD";

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')))
        .unwrap_or(false)
}

/// Starts an agent running one shell pod; returns it with the pod's process ID once that runs.
async fn agent_with_a_pod(ns: &egress_testenv::TestNamespace) -> (NodeAgent, u32) {
    let agent = shell_agent(&ns.client(), ns.name()).await;
    let pod = shell_pod("sleeper", "trap 'exit 0' TERM; while true; do sleep 0.2; done", json!({}));
    ns.api::<Pod>().create(&PostParams::default(), &pod).await.expect("create pod");
    let pid = eventually("the pod's process", WAIT, || async { agent.container_pid(ns.name(), "sleeper", "sh") }).await;
    (agent, pid)
}

#[tokio::test]
async fn the_agent_leaves_no_files_behind_when_dropped_or_killed() {
    if std::env::var_os(CHILD_ENV).is_some() {
        // The child: what a test binary that leaks its cluster into a static does, ended by SIGKILL.
        let ns = egress_testenv::namespace("leftover").await;
        let (agent, pid) = agent_with_a_pod(&ns).await;
        println!("AGENT {} {pid}", agent.directory().display());
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        return;
    }

    // Dropped: the pod's process stops and the directory goes, though the pod workers were aborted.
    let ns = egress_testenv::namespace("dropped").await;
    let (agent, pid) = agent_with_a_pod(&ns).await;
    let directory = agent.directory().to_path_buf();
    assert!(directory.starts_with(std::env::temp_dir()) && directory.is_dir(), "{}", directory.display());
    drop(agent);
    eventually("the dropped agent's pod process to stop and its files to go", Duration::from_secs(20), || {
        let done = !directory.exists() && !alive(pid);
        async move { done.then_some(()) }
    })
    .await;

    // Killed: no destructor runs at all.
    let mut child = std::process::Command::new(std::env::current_exe().expect("the test binary's path"))
        .args(["--exact", "the_agent_leaves_no_files_behind_when_dropped_or_killed", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("re-running this test binary as the child");
    let stdout = child.stdout.take().expect("piped stdout");
    let (directory, pid) = std::io::BufRead::lines(std::io::BufReader::new(stdout))
        .map_while(Result::ok)
        .find_map(|line| {
            let (_, rest) = line.split_once("AGENT ")?;
            let (directory, pid) = rest.trim().rsplit_once(' ')?;
            Some((std::path::PathBuf::from(directory), pid.parse::<u32>().ok()?))
        })
        .expect("the child reports its agent's directory and pod process");
    assert!(directory.is_dir() && alive(pid), "the child's pod runs in {}", directory.display());
    child.kill().expect("SIGKILL the child");
    child.wait().expect("reap the child");
    eventually("the killed process's pod process to stop and its files to go", Duration::from_secs(30), || {
        let done = !directory.exists() && !alive(pid);
        async move { done.then_some(()) }
    })
    .await;
}
