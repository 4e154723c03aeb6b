//! The local node agent: a stand-in for kubelet (and the scheduler) that really runs pods, as processes on this
//! machine.
//!
//! It registers a Node `egress-local`, binds the unscheduled pods of the namespaces it serves to it, and runs each
//! pod whose container images it can map to a local program ([`ImageMap`]): the Squid image as Debian's Squid (the
//! container's own command, with `squid.conf`'s listen address and runtime paths rewritten), any other mapped image
//! as the program given for it. For those pods it does what kubelet does that the product relies on:
//!
//! - **environment**: `value`, `fieldRef` (the downward API: `metadata.name`, `metadata.namespace`, `status.podIP`,
//!   ...), `configMapKeyRef`, `secretKeyRef`, `envFrom`, `$(VAR)` expansion in `env`, `command` and `args`, and
//!   `KUBERNETES_SERVICE_HOST`/`PORT` pointing at the apiserver so in-cluster clients find it;
//! - **volumes**: ConfigMap, Secret (with `items`, `defaultMode`, `optional`), emptyDir, hostPath, downwardAPI and
//!   projected ones, including the service-account token from the TokenRequest API, bound to the pod, that the
//!   ServiceAccount admission plugin adds as `kube-api-access-*` (with the cluster CA from `kube-root-ca.crt`);
//!   a mapped program runs in a mount namespace of its own with each volume at its `mountPath`;
//! - **user**: `runAsUser`/`runAsGroup` (and `runAsNonRoot` refusing root) through `setpriv`;
//! - **probes**: readiness, liveness and startup probes (`httpGet`, `tcpSocket`, `exec`) with their delays,
//!   periods, timeouts and thresholds, reflected in the pod's `Ready` condition;
//! - **restarts**: `restartPolicy`, with kubelet's crash-loop back-off, counted in `restartCount` with the last
//!   state, for a container that exits or fails its liveness probe;
//! - **termination**: SIGTERM, then SIGKILL after the pod's grace period, then the deletion is finished.
//!
//! Each pod gets an address of its own: from the run's pod network ([`crate::squid::pod_network`], an interface in
//! the network namespace `cargo xtask test` runs the tests in) when there is one, else a loopback address
//! (`127.1.x.y`, which EndpointSlices refuse). There is no network namespace per pod, so a mapped program's listen
//! addresses are given by the map (`{pod_ip}` in its environment), as Squid's are rewritten.
//!
//! Every process runs under a small `sh` wrapper that holds a pipe from this process: dropping the agent, or this
//! process dying in any way, closes the pipe and the wrapper stops the process. Test support only; nothing ships it.
//!
//! On an external cluster (see [`crate::EXTERNAL_KUBECONFIG_ENV`]) the cluster's kubelets run the pods and the agent
//! only offers [`NodeAgent::kill_squid`], done on the pod's kind node through `docker exec` and `crictl`.

mod container;
mod spec;

use std::collections::HashMap;
use std::fs;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Binding, Node, ObjectReference, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use spec::rewrite_squid_config;

use crate::process::Janitor;
use crate::squid::{next_pod_address, remove_shared_memory, service_name, squid_binary};
use container::{State, View};
use spec::{Prepared, Waiting};

/// The node every agent binds pods to.
pub const NODE_NAME: &str = "egress-local";

/// The pods [`NodeAgent::start`] serves: the kubernetes provider's.
pub const POD_SELECTOR: &str = "app.kubernetes.io/name=egress-proxy";

/// How often the agent re-examines its pods: level-triggered, so a ConfigMap that appears after its pod is noticed.
const RESYNC: Duration = Duration::from_millis(200);

/// How an image is run.
#[derive(Clone, Debug)]
pub enum Runtime {
    /// Debian's Squid, running the container's own command (`sh -c '... exec squid -N -f ...'`), with the listen
    /// address and runtime paths of `squid.conf` rewritten for the pod.
    Squid,
    /// A local program standing for the image's entrypoint (`entrypoint[0]` is its path), run in a mount namespace
    /// of its own. `env` is set last, over the container's own environment: the agent's stand-in for a network
    /// namespace, giving the program its listen addresses (`{pod_ip}` becomes the pod's address).
    Program {
        /// The image's entrypoint: the program and any fixed arguments.
        entrypoint: Vec<String>,
        /// Variables set over the container's own.
        env: Vec<(String, String)>,
    },
}

/// Which images the agent can run, and how: exact image references, or `*` for any other image.
#[derive(Clone, Debug, Default)]
pub struct ImageMap {
    entries: Vec<(String, Runtime)>,
}

impl ImageMap {
    /// An empty map: no image runs.
    pub fn new() -> Self {
        Self::default()
    }

    /// Maps `image` (an exact reference such as `egress-operator:latest`, or `*`) to `runtime`.
    pub fn with(mut self, image: &str, runtime: Runtime) -> Self {
        self.entries.push((image.to_owned(), runtime));
        self
    }

    fn resolve(&self, image: &str) -> Option<&Runtime> {
        let exact = self.entries.iter().find(|(pattern, _)| pattern == image);
        exact.or_else(|| self.entries.iter().find(|(pattern, _)| pattern == "*")).map(|(_, runtime)| runtime)
    }

    fn needs_squid(&self) -> bool {
        self.entries.iter().any(|(_, runtime)| matches!(runtime, Runtime::Squid))
    }
}

/// What an agent serves.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// The namespaces whose pods it runs.
    pub namespaces: Vec<String>,
    /// Only pods with these labels (a label selector), or every pod.
    pub label_selector: Option<String>,
    /// How images run.
    pub images: ImageMap,
    /// The apiserver's address, given to containers as `KUBERNETES_SERVICE_HOST`/`PORT`.
    pub apiserver: Option<SocketAddr>,
}

/// One pod the agent runs.
struct PodEntry {
    key: (String, String),
    ip: Ipv4Addr,
    containers: Arc<Mutex<Vec<Arc<Mutex<View>>>>>,
    /// `Some(grace)` asks the pod to stop; `delete` says whether to finish its deletion afterwards.
    stop: watch::Sender<Option<(Duration, bool)>>,
    task: JoinHandle<()>,
}

#[derive(Default)]
struct State_ {
    /// Pods with a worker, by UID.
    pods: HashMap<String, PodEntry>,
}

/// A running agent. Dropping it stops every process it started.
pub struct NodeAgent {
    task: Option<JoinHandle<()>>,
    state: Arc<Mutex<State_>>,
    /// Set on an external cluster, whose kubelets run the pods.
    cluster: Option<Client>,
    /// Where the pods' files live, one directory each; removed with the pods' shared memory by the janitor.
    directory: PathBuf,
    _janitor: Option<Janitor>,
}

impl NodeAgent {
    /// Registers the node and runs the kubernetes provider's pods in `namespaces` (any image, as Squid); on an
    /// external cluster, only keeps the client for [`NodeAgent::kill_squid`].
    ///
    /// Fails at once, with the install command, when Squid is not installed.
    pub async fn start(client: Client, namespaces: &[&str]) -> Result<Self> {
        let config = AgentConfig {
            namespaces: namespaces.iter().map(|namespace| (*namespace).to_owned()).collect(),
            label_selector: Some(POD_SELECTOR.into()),
            images: ImageMap::new().with("*", Runtime::Squid),
            apiserver: None,
        };
        Self::start_with(client, config).await
    }

    /// Registers the node and runs the pods `config` selects.
    pub async fn start_with(client: Client, config: AgentConfig) -> Result<Self> {
        if crate::external_kubeconfig().is_some() {
            return Ok(Self {
                task: None,
                state: Arc::default(),
                cluster: Some(client),
                directory: PathBuf::new(),
                _janitor: None,
            });
        }
        if config.images.needs_squid() {
            squid_binary()?;
        }
        register_node(&client).await?;
        let directory =
            tempfile::Builder::new().prefix("egress-node-").tempdir().context("creating a temp dir")?.keep();
        // Squid names its shared memory after the service (`-n`), which is the pod directory's name without
        // punctuation: one prefix per agent lets the janitor find what a killed Squid left in /dev/shm.
        let id = directory.file_name().and_then(|name| name.to_str()).unwrap_or_default();
        let pod_prefix = format!("egressn{}", id.trim_start_matches("egress-node-"));
        let janitor = Janitor::spawn(&directory, &pod_prefix)?;
        let state = Arc::new(Mutex::new(State_::default()));
        let mut streams = Vec::new();
        let mut stores = Vec::new();
        for namespace in &config.namespaces {
            let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
            let mut watch_config = watcher::Config::default();
            if let Some(selector) = &config.label_selector {
                watch_config = watch_config.labels(selector);
            }
            let (reader, writer) = reflector::store();
            let stream =
                reflector(writer, watcher(pods, watch_config)).default_backoff().applied_objects().map(|_| ()).boxed();
            streams.push(stream);
            stores.push(reader);
        }
        let loop_state = state.clone();
        let agent = Arc::new(Shared {
            client: client.clone(),
            images: config.images,
            apiserver: config.apiserver,
            directory: directory.clone(),
            pod_prefix: format!("{pod_prefix}-"),
        });
        let task = tokio::spawn(async move {
            let mut events = futures::stream::select_all(streams);
            let mut tick = tokio::time::interval(RESYNC);
            loop {
                tokio::select! {
                    _ = events.next() => {}
                    _ = tick.tick() => {}
                }
                let pods: Vec<Arc<Pod>> = stores.iter().flat_map(|store| store.state()).collect();
                sync(&agent, &loop_state, &pods).await;
            }
        });
        Ok(Self { task: Some(task), state, cluster: None, directory, _janitor: Some(janitor) })
    }

    fn with_pod<T>(&self, namespace: &str, name: &str, read: impl FnOnce(&PodEntry) -> Option<T>) -> Option<T> {
        let state = self.state.lock().expect("agent state");
        let key = key(namespace, name);
        state.pods.values().find(|entry| entry.key == key).and_then(read)
    }

    fn container_view(&self, namespace: &str, pod: &str, container: Option<&str>) -> Option<View> {
        self.with_pod(namespace, pod, |entry| {
            let containers = entry.containers.lock().expect("containers");
            let view = match container {
                Some(name) => containers.iter().find(|view| view.lock().expect("view").name == name)?,
                None => containers.first()?,
            };
            Some(view.lock().expect("view").clone())
        })
    }

    /// The directory holding the files of every pod the agent runs (empty on an external cluster). It and the
    /// pods' shared memory are removed a few seconds after the agent is dropped or the test process ends.
    pub fn directory(&self) -> &Path {
        &self.directory
    }

    /// The loopback address of a pod the agent runs (None on an external cluster: read the pod's status).
    pub fn pod_ip(&self, namespace: &str, name: &str) -> Option<Ipv4Addr> {
        self.with_pod(namespace, name, |entry| Some(entry.ip))
    }

    /// The process ID of a running pod's first container, its Squid for a proxy pod (None on an external cluster).
    pub fn squid_pid(&self, namespace: &str, name: &str) -> Option<u32> {
        self.container_view(namespace, name, None)?.pid
    }

    /// The process ID of one container of a pod, while it runs.
    pub fn container_pid(&self, namespace: &str, pod: &str, container: &str) -> Option<u32> {
        self.container_view(namespace, pod, Some(container))?.pid
    }

    /// How often a container of a pod was restarted.
    pub fn restart_count(&self, namespace: &str, pod: &str, container: &str) -> Option<i32> {
        Some(self.container_view(namespace, pod, Some(container))?.restart_count)
    }

    /// The access log of a Squid pod the agent runs: the lines of its container's output that are access-log lines
    /// (Squid writes them to `/dev/stdout`, and its cache log to `/dev/stderr`, as in a pod); empty when there is
    /// none.
    pub fn squid_access_log(&self, namespace: &str, pod: &str) -> String {
        let Some(view) = self.container_view(namespace, pod, None) else { return String::new() };
        let output = fs::read_to_string(&view.log).unwrap_or_default();
        // An access-log line starts with Squid's `%ts.%03tu` timestamp; a cache-log line with a date.
        let access = |line: &&str| {
            line.split_whitespace().next().and_then(|first| first.split_once('.')).is_some_and(|(seconds, millis)| {
                millis.len() == 3 && [seconds, millis].iter().all(|part| part.bytes().all(|byte| byte.is_ascii_digit()))
            })
        };
        output.lines().filter(access).map(|line| format!("{line}\n")).collect()
    }

    /// The file a container's output goes to (every run of it, appended), while its pod runs here.
    pub fn container_log_path(&self, namespace: &str, pod: &str, container: &str) -> Option<PathBuf> {
        self.container_view(namespace, pod, Some(container)).map(|view| view.log)
    }

    /// The end of a container's output (every run of it, appended).
    pub fn container_log(&self, namespace: &str, pod: &str, container: &str) -> String {
        self.container_view(namespace, pod, Some(container))
            .map(|view| fs::read_to_string(&view.log).unwrap_or_default())
            .unwrap_or_default()
    }

    /// Sends `signal` (`KILL`, `TERM`, ...) to a container's process, as a crash or an operator would; the agent
    /// then treats the exit as kubelet does. Returns whether there was a process to signal.
    pub fn signal_container(&self, namespace: &str, pod: &str, container: &str, signal: &str) -> bool {
        let Some(pid) = self.container_pid(namespace, pod, container) else { return false };
        std::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .status()
            .is_ok_and(|status| status.success())
    }

    /// Takes a proxy pod's Squid out of service, leaving the pod's status alone, and returns whether there was a
    /// process to stop. It is frozen with SIGSTOP, locally and on an external cluster alike: a killed Squid would
    /// be restarted at once by the restart policy, while a frozen one still accepts TCP connections (so its
    /// readiness probe passes) but answers nothing, which only the operator's health check through the proxy
    /// sees. On an external cluster the signal is sent from the pod's node (Squid is the container's PID 1, which
    /// ignores signals sent inside its namespace).
    pub async fn kill_squid(&self, namespace: &str, name: &str) -> bool {
        match &self.cluster {
            None => self.squid_pid(namespace, name).is_some_and(|pid| {
                std::process::Command::new("kill")
                    .args(["-STOP", &pid.to_string()])
                    .status()
                    .is_ok_and(|status| status.success())
            }),
            Some(client) => match freeze_on_node(client, namespace, name).await {
                Ok(()) => true,
                Err(error) => {
                    eprintln!("egress-testenv: stopping Squid in pod {namespace}/{name}: {error:#}");
                    false
                }
            },
        }
    }
}

/// SIGSTOPs the Squid of a pod on an external kind cluster, from its node container.
async fn freeze_on_node(client: &Client, namespace: &str, name: &str) -> Result<()> {
    let pod = Api::<Pod>::namespaced(client.clone(), namespace).get(name).await.context("reading the pod")?;
    let node = pod.spec.and_then(|spec| spec.node_name).context("the pod is not scheduled")?;
    let script = format!(
        "set -e; pod=$(crictl pods -q --namespace {ns} --name {name} --state ready); test -n \"$pod\"; \
         container=$(crictl ps -q --pod \"$pod\" --name proxy); test -n \"$container\"; \
         pid=$(crictl inspect -o go-template --template '{{{{.info.pid}}}}' \"$container\"); kill -STOP \"$pid\"",
        ns = spec::shell_quote(namespace),
        name = spec::shell_quote(name),
    );
    let output = tokio::process::Command::new("docker")
        .args(["exec", &node, "sh", "-c", &script])
        .output()
        .await
        .context("running docker exec")?;
    if !output.status.success() {
        bail!("docker exec {node} failed ({}): {}", output.status, String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(())
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
        let pods: Vec<PodEntry> =
            self.state.lock().map(|mut state| state.pods.drain().map(|(_, entry)| entry).collect()).unwrap_or_default();
        for entry in pods {
            // Aborting the worker drops its processes, whose wrappers then stop them.
            entry.task.abort();
        }
    }
}

fn key(namespace: &str, name: &str) -> (String, String) {
    (namespace.to_owned(), name.to_owned())
}

/// What every pod worker shares.
struct Shared {
    client: Client,
    images: ImageMap,
    apiserver: Option<SocketAddr>,
    directory: PathBuf,
    pod_prefix: String,
}

async fn register_node(client: &Client) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let node =
        Node { metadata: ObjectMeta { name: Some(NODE_NAME.into()), ..ObjectMeta::default() }, ..Node::default() };
    match nodes.create(&PostParams::default(), &node).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(error) => return Err(error).context("registering the node"),
    }
    let status = json!({ "status": {
        "conditions": [{ "type": "Ready", "status": "True", "reason": "EgressLocalAgent", "message": "the local node agent runs pods as processes" }],
        "addresses": [{ "type": "InternalIP", "address": "127.0.0.1" }, { "type": "Hostname", "address": NODE_NAME }],
        "capacity": { "cpu": "2", "memory": "24Gi", "pods": "250" },
        "allocatable": { "cpu": "2", "memory": "24Gi", "pods": "250" },
    }});
    nodes
        .patch_status(NODE_NAME, &PatchParams::default(), &Patch::Merge(status))
        .await
        .context("reporting the node Ready")?;
    Ok(())
}

/// One level-triggered pass over the agent's pods.
async fn sync(agent: &Arc<Shared>, state: &Arc<Mutex<State_>>, pods: &[Arc<Pod>]) {
    let mut present = Vec::new();
    for pod in pods {
        let (Some(namespace), name) = (pod.namespace(), pod.name_any()) else { continue };
        let uid = pod.uid().unwrap_or_default();
        present.push(uid.clone());
        let api: Api<Pod> = Api::namespaced(agent.client.clone(), &namespace);
        let node = pod.spec.as_ref().and_then(|spec| spec.node_name.as_deref());
        if pod.metadata.deletion_timestamp.is_some() {
            let grace = Duration::from_secs(pod.metadata.deletion_grace_period_seconds.unwrap_or(0).max(0) as u64);
            let running = state.lock().expect("agent state").pods.get(&uid).map(|entry| entry.stop.clone());
            match running {
                Some(stop) if stop.borrow().is_none() => {
                    stop.send_replace(Some((grace, true)));
                }
                Some(_) => {}
                None if node.is_some() => finish_deletion(&api, &name, &uid).await,
                None => {}
            }
            continue;
        }
        match node {
            None => bind(&api, &name).await,
            Some(NODE_NAME) => {
                let mut guard = state.lock().expect("agent state");
                if let std::collections::hash_map::Entry::Vacant(vacant) = guard.pods.entry(uid) {
                    let ip = next_pod_address();
                    let (stop, stop_receiver) = watch::channel(None);
                    let containers = Arc::new(Mutex::new(Vec::new()));
                    let task = tokio::spawn(run_pod(agent.clone(), pod.clone(), ip, containers.clone(), stop_receiver));
                    vacant.insert(PodEntry { key: key(&namespace, &name), ip, containers, stop, task });
                }
            }
            Some(_) => {}
        }
    }
    // Pods gone from the store (deleted with grace 0 by someone else, or out of the selector): stop at once.
    let mut guard = state.lock().expect("agent state");
    let gone: Vec<String> = guard.pods.keys().filter(|uid| !present.contains(uid)).cloned().collect();
    for uid in gone {
        if let Some(entry) = guard.pods.get(&uid) {
            if entry.task.is_finished() {
                guard.pods.remove(&uid);
            } else if entry.stop.borrow().is_none() {
                entry.stop.send_replace(Some((Duration::ZERO, false)));
            }
        }
    }
    // A finished worker of a pod still present stays recorded, so the pod is not started twice.
}

async fn bind(api: &Api<Pod>, name: &str) {
    let binding = Binding {
        metadata: ObjectMeta { name: Some(name.to_owned()), ..ObjectMeta::default() },
        target: ObjectReference {
            kind: Some("Node".into()),
            name: Some(NODE_NAME.into()),
            ..ObjectReference::default()
        },
    };
    let _ = api.create_subresource::<Binding, Value>("binding", name, &PostParams::default(), &binding).await;
}

/// Kubelet's part of graceful deletion: the containers are gone, so the pod object may go.
async fn finish_deletion(api: &Api<Pod>, name: &str, uid: &str) {
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions { uid: Some(uid.to_owned()), resource_version: None }),
        ..DeleteParams::default()
    };
    let _ = api.delete(name, &params).await;
}

/// How often a running pod's Secret and ConfigMap volumes are brought in line with their objects.
const VOLUME_REFRESH: Duration = Duration::from_secs(10);

/// Runs one pod from preparation to termination.
async fn run_pod(
    agent: Arc<Shared>,
    pod: Arc<Pod>,
    ip: Ipv4Addr,
    views: Arc<Mutex<Vec<Arc<Mutex<View>>>>>,
    mut stop: watch::Receiver<Option<(Duration, bool)>>,
) {
    let namespace = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let uid = pod.uid().unwrap_or_default();
    let api: Api<Pod> = Api::namespaced(agent.client.clone(), &namespace);
    let dir = match tempfile::Builder::new().prefix(&agent.pod_prefix).tempdir_in(&agent.directory) {
        Ok(dir) => dir.keep(),
        Err(error) => return report_failed(&api, &name, &format!("creating the pod's directory: {error}")).await,
    };
    // Root's alone until the pod's plan says which group must reach it (as kubelet keeps a pod's directory from
    // other users of the node: its volumes hold Secrets and tokens).
    let _ = fs::set_permissions(&dir, fs::Permissions::from_mode(0o700));
    let started_at = Timestamp::now();
    let node = spec::Node { client: &agent.client, images: &agent.images, apiserver: agent.apiserver };

    // Prepare until every referenced object exists, or until told to stop.
    let mut last_waiting: Option<Waiting> = None;
    let plan = loop {
        match spec::prepare(&node, &pod, ip, &dir).await {
            Ok(Prepared::Ready(plan)) => break plan,
            Ok(Prepared::Waiting(waiting)) => {
                if last_waiting.as_ref() != Some(&waiting) {
                    report_waiting(&api, &pod, ip, started_at, &waiting).await;
                    last_waiting = Some(waiting);
                }
            }
            // Kubelet retries a container it cannot create, and the pod stays Pending with the reason.
            Err(error) => {
                let waiting = Waiting { reason: "CreateContainerError", message: format!("{error:#}") };
                if last_waiting.as_ref() != Some(&waiting) {
                    eprintln!("egress-testenv node agent: pod {namespace}/{name}: {}", waiting.message);
                    report_waiting(&api, &pod, ip, started_at, &waiting).await;
                    last_waiting = Some(waiting);
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.changed() => {}
        }
        let stopping = *stop.borrow();
        if stopping.is_some() {
            return cleanup(&api, &name, &uid, &dir, stopping).await;
        }
    };

    // Squid drops privileges to `proxy`, and programs run as their pod's user: that group may enter and write here,
    // nobody else may.
    if let Some(group) = plan.group {
        let _ = std::os::unix::fs::chown(&dir, Some(0), Some(group));
        let _ = fs::set_permissions(&dir, fs::Permissions::from_mode(0o770));
    }
    let (changed, mut changes) = watch::channel(());
    let (container_stop, container_stop_receiver) = watch::channel::<Option<Duration>>(None);
    let mut tasks = Vec::new();
    for container in &plan.containers {
        let view = Arc::new(Mutex::new(View::new(container, dir.join(format!("{}.log", container.name)))));
        views.lock().expect("containers").push(view.clone());
        tasks.push(tokio::spawn(container::run(
            container.clone(),
            plan.restart_policy.clone(),
            plan.grace,
            ip,
            dir.clone(),
            view,
            changed.clone(),
            container_stop_receiver.clone(),
        )));
    }
    drop(changed);
    let mut reported = Value::Null;
    loop {
        let status = pod_status(&views, &plan.restart_policy, ip, started_at, &reported);
        if status != reported {
            if let Err(error) =
                api.patch_status(&name, &PatchParams::default(), &Patch::Merge(json!({ "status": status }))).await
            {
                if matches!(&error, kube::Error::Api(response) if response.code == 404) {
                    break;
                }
                eprintln!("egress-testenv node agent: reporting {namespace}/{name}'s status failed: {error}");
            }
            reported = status;
        }
        let refresh_due = tokio::select! {
            changed = changes.changed() => if changed.is_err() { break } else { false },
            _ = stop.wait_for(Option::is_some) => break,
            // Mounted Secrets and ConfigMaps follow their objects, as kubelet's do (it takes up to about a minute).
            () = tokio::time::sleep(VOLUME_REFRESH), if plan.refreshes => true,
        };
        if refresh_due && let Err(error) = spec::refresh(&agent.client, &pod, &dir).await {
            eprintln!("egress-testenv node agent: refreshing {namespace}/{name}'s volumes failed: {error:#}");
        }
    }
    let (grace, _) = stop.borrow().unwrap_or((plan.grace, false));
    container_stop.send_replace(Some(grace));
    for task in tasks {
        let _ = task.await;
    }
    let stopping = *stop.borrow();
    cleanup(&api, &name, &uid, &dir, stopping).await;
}

/// Removes the pod's files and, when its deletion asked for it, finishes the deletion.
async fn cleanup(api: &Api<Pod>, name: &str, uid: &str, dir: &std::path::Path, stop: Option<(Duration, bool)>) {
    let _ = fs::remove_dir_all(dir);
    remove_shared_memory(&service_name(dir));
    if let Some((_, true)) = stop {
        finish_deletion(api, name, uid).await;
    }
}

fn time(timestamp: Timestamp) -> Value {
    json!(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(timestamp))
}

fn state_json(state: &State) -> Value {
    match state {
        State::Waiting { reason, message } => json!({ "waiting": { "reason": reason, "message": message } }),
        State::Running { started_at } => json!({ "running": { "startedAt": time(*started_at) } }),
        State::Terminated { exit_code, reason, started_at, finished_at } => json!({ "terminated": {
            "exitCode": exit_code, "reason": reason, "startedAt": time(*started_at), "finishedAt": time(*finished_at),
        }}),
    }
}

/// The pod's status from its containers' views; a condition keeps its transition time while its value holds.
fn pod_status(
    views: &Arc<Mutex<Vec<Arc<Mutex<View>>>>>,
    restart_policy: &str,
    ip: Ipv4Addr,
    started_at: Timestamp,
    previous: &Value,
) -> Value {
    let views: Vec<View> =
        views.lock().expect("containers").iter().map(|view| view.lock().expect("view").clone()).collect();
    let ready = !views.is_empty() && views.iter().all(|view| view.ready);
    let running = views.iter().any(|view| matches!(view.state, State::Running { .. }));
    // A pod ends (Succeeded or Failed) only when none of its containers will be restarted: with `Always` never,
    // with `OnFailure` once all exited 0, with `Never` once all exited.
    let all_terminated = !views.is_empty() && views.iter().all(|view| matches!(view.state, State::Terminated { .. }));
    let all_succeeded = views.iter().all(|view| matches!(view.state, State::Terminated { exit_code: 0, .. }));
    let ended = all_terminated
        && match restart_policy {
            "Never" => true,
            "OnFailure" => all_succeeded,
            _ => false,
        };
    let phase = if ended {
        if all_succeeded { "Succeeded" } else { "Failed" }
    } else if running || views.iter().any(|view| view.restart_count > 0) {
        "Running"
    } else {
        "Pending"
    };
    let condition = |kind: &str, value: bool| {
        let status = if value { "True" } else { "False" };
        let kept = previous["conditions"]
            .as_array()
            .and_then(|conditions| conditions.iter().find(|c| c["type"] == kind && c["status"] == status))
            .and_then(|c| c.get("lastTransitionTime").cloned());
        json!({ "type": kind, "status": status, "lastTransitionTime": kept.unwrap_or_else(|| time(Timestamp::now())) })
    };
    let statuses: Vec<Value> = views
        .iter()
        .map(|view| {
            let mut status = json!({
                "name": view.name, "image": view.image, "imageID": "", "ready": view.ready, "started": view.started,
                "restartCount": view.restart_count, "state": state_json(&view.state),
            });
            if let Some(pid) = view.pid {
                status["containerID"] = json!(format!("egress-local://{pid}"));
            }
            if let Some(last) = &view.last_state {
                status["lastState"] = state_json(last);
            }
            status
        })
        .collect();
    json!({
        "phase": phase,
        "podIP": ip.to_string(),
        "podIPs": [{ "ip": ip.to_string() }],
        "hostIP": "127.0.0.1",
        "hostIPs": [{ "ip": "127.0.0.1" }],
        "startTime": time(started_at),
        "conditions": [
            condition("PodScheduled", true),
            condition("Initialized", true),
            condition("ContainersReady", ready),
            condition("Ready", ready),
        ],
        "containerStatuses": statuses,
    })
}

async fn report_waiting(api: &Api<Pod>, pod: &Pod, ip: Ipv4Addr, started_at: Timestamp, waiting: &Waiting) {
    let statuses: Vec<Value> = pod
        .spec
        .iter()
        .flat_map(|spec| &spec.containers)
        .map(|container| {
            json!({
                "name": container.name, "image": container.image, "imageID": "", "ready": false, "started": false,
                "restartCount": 0, "state": { "waiting": { "reason": waiting.reason, "message": waiting.message } },
            })
        })
        .collect();
    let status = json!({ "status": {
        "phase": "Pending", "podIP": ip.to_string(), "podIPs": [{ "ip": ip.to_string() }], "hostIP": "127.0.0.1",
        "startTime": time(started_at),
        "conditions": [
            { "type": "PodScheduled", "status": "True" },
            { "type": "Ready", "status": "False", "reason": "ContainersNotReady", "message": waiting.message },
        ],
        "containerStatuses": statuses,
    }});
    if let Err(error) = api.patch_status(&pod.name_any(), &PatchParams::default(), &Patch::Merge(status)).await {
        eprintln!("egress-testenv node agent: reporting {} waiting failed: {error}", pod.name_any());
    }
}

async fn report_failed(api: &Api<Pod>, name: &str, message: &str) {
    let status = json!({ "status": { "phase": "Failed", "reason": "EgressLocalAgent", "message": message } });
    if let Err(error) = api.patch_status(name, &PatchParams::default(), &Patch::Merge(status)).await {
        eprintln!("egress-testenv node agent: reporting {name} Failed ({message}) failed too: {error}");
    }
}

/// Lists the provider's pods in a namespace (a convenience for tests that check what exists).
pub async fn list_proxy_pods(client: &Client, namespace: &str) -> Result<Vec<Pod>> {
    Ok(Api::<Pod>::namespaced(client.clone(), namespace).list(&ListParams::default().labels(POD_SELECTOR)).await?.items)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(state: State) -> Arc<Mutex<View>> {
        Arc::new(Mutex::new(View {
            name: "c".into(),
            image: "i".into(),
            pid: None,
            ready: false,
            started: true,
            restart_count: 1,
            state,
            last_state: None,
            log: std::env::temp_dir().join("unused.log"),
        }))
    }

    fn phase_of(code: i32, policy: &str) -> String {
        let now = Timestamp::now();
        let terminated =
            State::Terminated { exit_code: code, reason: "Error".into(), started_at: now, finished_at: now };
        let views = Arc::new(Mutex::new(vec![view(terminated)]));
        pod_status(&views, policy, Ipv4Addr::new(10, 244, 0, 2), now, &Value::Null)["phase"].as_str().unwrap().into()
    }

    /// A pod whose container exited but will be restarted is still Running: a Failed phase would make its
    /// ReplicaSet replace it.
    #[test]
    fn a_pod_ends_only_when_nothing_restarts() {
        assert_eq!(phase_of(137, "Always"), "Running");
        assert_eq!(phase_of(0, "Always"), "Running");
        assert_eq!(phase_of(1, "OnFailure"), "Running");
        assert_eq!(phase_of(0, "OnFailure"), "Succeeded");
        assert_eq!(phase_of(1, "Never"), "Failed");
        assert_eq!(phase_of(0, "Never"), "Succeeded");
    }
}
