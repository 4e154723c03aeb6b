//! The local node agent: a stand-in for kubelet that really runs the proxy pods, as Squid processes on this machine.
//!
//! It registers a Node `egress-local`, binds the unscheduled pods of the namespaces it serves to it, and for each pod
//! materialises the ConfigMap and Secret volumes under a temp directory, rewrites the pod's command and Squid's
//! configuration (only the listen address, to the pod's own loopback address `127.1.x.y`, and runtime paths, to the
//! temp directory), runs it, and reports the pod `Running` with that address once Squid accepts connections. When
//! the pod is deleted it stops the process and finishes the deletion as kubelet would.
//!
//! Each Squid runs under a small `sh` wrapper that holds a pipe from this process: dropping the agent, or this
//! process dying in any way, closes the pipe and the wrapper kills Squid. Test support only; nothing ships it.
//!
//! On an external cluster (see [`crate::EXTERNAL_KUBECONFIG_ENV`]) the cluster's kubelets run the pods and the agent
//! only offers [`NodeAgent::kill_squid`], done on the pod's kind node through `docker exec` and `crictl`.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Binding, ConfigMap, Node, ObjectReference, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::task::JoinHandle;

use crate::squid::{
    START_TIMEOUT, Wrapped, next_loopback_address, read_tail, remove_shared_memory, service_name, squid_binary,
    wait_accepting,
};

/// The node every agent binds pods to.
pub const NODE_NAME: &str = "egress-local";

/// The pods an agent serves: the kubernetes provider's.
pub const POD_SELECTOR: &str = "app.kubernetes.io/name=egress-proxy";

/// How often the agent re-examines its pods: level-triggered, so a ConfigMap that appears after its pod is noticed.
const RESYNC: Duration = Duration::from_millis(200);

/// One Squid started for a pod.
struct Running {
    ip: Ipv4Addr,
    process: Wrapped,
    dir: PathBuf,
}

impl Running {
    fn stop(self) {
        self.process.stop();
        let _ = fs::remove_dir_all(&self.dir);
        remove_shared_memory(&service_name(&self.dir));
    }
}

#[derive(Default)]
struct State {
    /// Pods with a process, by `namespace/name`.
    running: HashMap<String, Running>,
    /// Pods whose start is in flight or failed, by UID, so they are not started twice.
    claimed: HashMap<String, ()>,
}

/// A running agent. Dropping it stops every Squid it started.
pub struct NodeAgent {
    task: Option<JoinHandle<()>>,
    state: Arc<Mutex<State>>,
    /// Set on an external cluster, whose kubelets run the pods.
    cluster: Option<Client>,
}

impl NodeAgent {
    /// Registers the node and starts serving the provider's pods in `namespaces`; on an external cluster, only
    /// keeps the client for [`NodeAgent::kill_squid`].
    ///
    /// Fails at once, with the install command, when Squid is not installed.
    pub async fn start(client: Client, namespaces: &[&str]) -> Result<Self> {
        if crate::external_kubeconfig().is_some() {
            return Ok(Self { task: None, state: Arc::default(), cluster: Some(client) });
        }
        squid_binary()?;
        register_node(&client).await?;
        let state = Arc::new(Mutex::new(State::default()));
        let mut streams = Vec::new();
        let mut stores = Vec::new();
        for namespace in namespaces {
            let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
            let (reader, writer) = reflector::store();
            let stream = reflector(writer, watcher(pods, watcher::Config::default().labels(POD_SELECTOR)))
                .default_backoff()
                .applied_objects()
                .map(|_| ())
                .boxed();
            streams.push(stream);
            stores.push(reader);
        }
        let loop_state = state.clone();
        let task = tokio::spawn(async move {
            let mut events = futures::stream::select_all(streams);
            let mut tick = tokio::time::interval(RESYNC);
            loop {
                tokio::select! {
                    _ = events.next() => {}
                    _ = tick.tick() => {}
                }
                let pods: Vec<Arc<Pod>> = stores.iter().flat_map(|store| store.state()).collect();
                sync(&client, &loop_state, &pods).await;
            }
        });
        Ok(Self { task: Some(task), state, cluster: None })
    }

    /// The loopback address a running pod's Squid listens on (None on an external cluster: read the pod's status).
    pub fn pod_ip(&self, namespace: &str, name: &str) -> Option<Ipv4Addr> {
        self.state.lock().expect("agent state").running.get(&key(namespace, name)).map(|running| running.ip)
    }

    /// The process ID of a running pod's Squid (None on an external cluster).
    pub fn squid_pid(&self, namespace: &str, name: &str) -> Option<u32> {
        self.state.lock().expect("agent state").running.get(&key(namespace, name)).map(|running| running.process.pid)
    }

    /// Takes a pod's Squid out of service as a crash would, leaving the pod's status alone, and returns whether
    /// there was a process to stop. Locally that is SIGKILL. On an external cluster it is SIGSTOP, sent from the
    /// pod's node (Squid is the container's PID 1, which ignores signals sent inside its namespace, and a killed
    /// container is restarted by kubelet at once): the frozen Squid accepts nothing until the pod is deleted.
    pub async fn kill_squid(&self, namespace: &str, name: &str) -> bool {
        match &self.cluster {
            None => {
                let state = self.state.lock().expect("agent state");
                state.running.get(&key(namespace, name)).is_some_and(|running| running.process.kill())
            }
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
        ns = shell_quote(namespace),
        name = shell_quote(name),
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
        let running: Vec<Running> =
            self.state.lock().map(|mut state| state.running.drain().map(|(_, r)| r).collect()).unwrap_or_default();
        for process in running {
            process.stop();
        }
    }
}

fn key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
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
        "addresses": [{ "type": "InternalIP", "address": "127.0.0.1" }],
    }});
    nodes
        .patch_status(NODE_NAME, &PatchParams::default(), &Patch::Merge(status))
        .await
        .context("reporting the node Ready")?;
    Ok(())
}

/// One level-triggered pass over the agent's pods.
async fn sync(client: &Client, state: &Arc<Mutex<State>>, pods: &[Arc<Pod>]) {
    let mut present = Vec::new();
    for pod in pods {
        let (Some(namespace), name) = (pod.namespace(), pod.name_any()) else { continue };
        let uid = pod.uid().unwrap_or_default();
        present.push(key(&namespace, &name));
        let api: Api<Pod> = Api::namespaced(client.clone(), &namespace);
        let node = pod.spec.as_ref().and_then(|spec| spec.node_name.as_deref());
        if pod.metadata.deletion_timestamp.is_some() {
            stop(state, &key(&namespace, &name));
            if node.is_some() {
                // Kubelet's part of graceful deletion: confirm the containers are gone.
                let params = DeleteParams {
                    grace_period_seconds: Some(0),
                    preconditions: Some(Preconditions { uid: Some(uid), resource_version: None }),
                    ..DeleteParams::default()
                };
                let _ = api.delete(&name, &params).await;
            }
            continue;
        }
        match node {
            None => {
                let binding = Binding {
                    metadata: ObjectMeta { name: Some(name.clone()), ..ObjectMeta::default() },
                    target: ObjectReference {
                        kind: Some("Node".into()),
                        name: Some(NODE_NAME.into()),
                        ..ObjectReference::default()
                    },
                };
                let _ = api
                    .create_subresource::<Binding, serde_json::Value>(
                        "binding",
                        &name,
                        &PostParams::default(),
                        &binding,
                    )
                    .await;
            }
            Some(NODE_NAME) => {
                let claimed = {
                    let mut guard = state.lock().expect("agent state");
                    guard.claimed.insert(uid.clone(), ()).is_some()
                };
                if !claimed {
                    match prepare(client, pod, &namespace, &name).await {
                        Ok(Some(prepared)) => {
                            let state = state.clone();
                            let api = api.clone();
                            tokio::spawn(async move { start(api, state, prepared).await });
                        }
                        // A volume's object does not exist yet: unclaim and look again on the next pass.
                        Ok(None) => {
                            state.lock().expect("agent state").claimed.remove(&uid);
                        }
                        Err(error) => report_failed(&api, &name, &format!("{error:#}")).await,
                    }
                }
            }
            Some(_) => {}
        }
    }
    let gone: Vec<String> = {
        let guard = state.lock().expect("agent state");
        guard.running.keys().filter(|key| !present.contains(key)).cloned().collect()
    };
    for key in gone {
        stop(state, &key);
    }
}

fn stop(state: &Arc<Mutex<State>>, key: &str) {
    let running = state.lock().expect("agent state").running.remove(key);
    if let Some(running) = running {
        running.stop();
    }
}

/// Everything needed to spawn one pod's Squid.
struct Prepared {
    namespace: String,
    name: String,
    uid: String,
    ip: Ipv4Addr,
    port: u16,
    dir: PathBuf,
    script: String,
}

/// Materialises the pod's volumes and rewrites its command; `None` when a referenced ConfigMap or Secret is missing.
async fn prepare(client: &Client, pod: &Pod, namespace: &str, name: &str) -> Result<Option<Prepared>> {
    let spec = pod.spec.as_ref().context("the pod has no spec")?;
    let container = spec.containers.first().context("the pod has no container")?;
    let port = container
        .ports
        .as_ref()
        .and_then(|ports| ports.first())
        .map(|port| port.container_port)
        .context("the container declares no port")?;
    let port = u16::try_from(port).context("the container port is out of range")?;
    let dir = tempfile::Builder::new().prefix("egress-pod-").tempdir()?.keep();
    // Squid drops privileges to the `proxy` user, which must be able to write its runtime files here.
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o777))?;
    let root = dir.join("root");
    let mut rewrites: Vec<(String, String)> = Vec::new();
    let volumes: BTreeMap<&str, _> =
        spec.volumes.iter().flatten().map(|volume| (volume.name.as_str(), volume)).collect();
    for mount in container.volume_mounts.iter().flatten() {
        let volume = volumes.get(mount.name.as_str()).context(format!("volume {} is not declared", mount.name))?;
        let target = root.join(mount.mount_path.trim_start_matches('/'));
        let files: BTreeMap<String, Vec<u8>> = if let Some(source) = &volume.config_map {
            match Api::<ConfigMap>::namespaced(client.clone(), namespace).get_opt(&source.name).await? {
                Some(map) => {
                    map.data.unwrap_or_default().into_iter().map(|(key, value)| (key, value.into_bytes())).collect()
                }
                None => return cleanup_and_wait(&dir),
            }
        } else if let Some(source) = &volume.secret {
            let secret_name = source.secret_name.clone().unwrap_or_default();
            match Api::<Secret>::namespaced(client.clone(), namespace).get_opt(&secret_name).await? {
                Some(secret) => {
                    secret.data.unwrap_or_default().into_iter().map(|(key, value)| (key, value.0)).collect()
                }
                None => return cleanup_and_wait(&dir),
            }
        } else {
            bail!(
                "volume {} is neither a ConfigMap nor a Secret, which the local node agent cannot provide",
                mount.name
            );
        };
        fs::create_dir_all(&target)?;
        fs::set_permissions(&target, fs::Permissions::from_mode(0o755))?;
        for (file, bytes) in files {
            let path = target.join(&file);
            fs::write(&path, bytes)?;
            fs::set_permissions(&path, fs::Permissions::from_mode(0o644))?;
        }
        rewrites.push((mount.mount_path.clone(), target.display().to_string()));
    }
    // Longest mount path first, so /etc/squid-egress-auth is not rewritten as /etc/squid-egress + "-auth".
    rewrites.sort_by_key(|(from, _)| std::cmp::Reverse(from.len()));
    let ip = next_loopback_address();
    for (_, target) in &rewrites {
        let conf = Path::new(target).join("squid.conf");
        if conf.is_file() {
            let text = fs::read_to_string(&conf)?;
            fs::write(&conf, rewrite_squid_config(&text, ip, &dir, &rewrites))?;
        }
    }
    let command: Vec<String> =
        container.command.iter().flatten().chain(container.args.iter().flatten()).cloned().collect();
    if command.is_empty() {
        bail!("the container has no command; the local node agent does not know the image's entrypoint");
    }
    let command = rewrite_command(&command, &rewrites, &service_name(&dir));
    let script = command.iter().map(|part| shell_quote(part)).collect::<Vec<_>>().join(" ");
    Ok(Some(Prepared {
        namespace: namespace.into(),
        name: name.into(),
        uid: pod.uid().unwrap_or_default(),
        ip,
        port,
        dir,
        script,
    }))
}

/// The pod's command with its mount paths rewritten, and each `squid -N` given the service name `service` (so
/// its shared-memory segments do not collide with another pod's, as standalone test Squids do).
fn rewrite_command(command: &[String], rewrites: &[(String, String)], service: &str) -> Vec<String> {
    command
        .iter()
        .map(|part| apply_rewrites(part, rewrites).replace("squid -N ", &format!("squid -N -n {service} ")))
        .collect()
}

fn cleanup_and_wait(dir: &Path) -> Result<Option<Prepared>> {
    let _ = fs::remove_dir_all(dir);
    Ok(None)
}

/// Replaces every mount path in `text` in one left-to-right pass, longest match first, so a replacement is never
/// itself rewritten again (`/etc/squid-egress` is a prefix of the rewritten `/etc/squid-egress-auth` target).
fn apply_rewrites(text: &str, rewrites: &[(String, String)]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    'scan: while !rest.is_empty() {
        for (from, to) in rewrites {
            if !from.is_empty()
                && let Some(after) = rest.strip_prefix(from.as_str())
            {
                out.push_str(to);
                rest = after;
                continue 'scan;
            }
        }
        let next = rest.chars().next().map_or(1, char::len_utf8);
        out.push_str(&rest[..next]);
        rest = &rest[next..];
    }
    out
}

/// Rewrites a pod's `squid.conf` for this machine: the listen address becomes the pod's IP, log, PID and core
/// paths move into the pod's runtime directory, mount paths move to where the volumes were materialised, and the
/// ICMP pinger (which needs privileges) is turned off. Everything else is left exactly as the provider wrote it.
pub fn rewrite_squid_config(text: &str, ip: Ipv4Addr, runtime_dir: &Path, mounts: &[(String, String)]) -> String {
    let runtime = runtime_dir.display();
    let mut out = String::with_capacity(text.len() + 256);
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let directive = words.next().unwrap_or_default();
        let rewritten = match directive {
            "http_port" => {
                let rest: Vec<&str> = words.collect();
                let port = rest.first().map(|first| first.rsplit(':').next().unwrap_or(first)).unwrap_or("3128");
                let options = rest.get(1..).map(|options| options.join(" ")).unwrap_or_default();
                format!("http_port {ip}:{port} {options}").trim_end().to_owned()
            }
            "access_log" => format!("access_log stdio:{runtime}/access.log"),
            "cache_log" => format!("cache_log {runtime}/cache.log"),
            "pid_filename" => format!("pid_filename {runtime}/squid.pid"),
            "coredump_dir" => format!("coredump_dir {runtime}"),
            _ => apply_rewrites(line, mounts),
        };
        out.push_str(&rewritten);
        out.push('\n');
    }
    out.push_str("pinger_enable off\n");
    out
}

fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// Spawns the pod's Squid under its wrapper, waits for it to accept connections, and reports the pod Running.
async fn start(api: Api<Pod>, state: Arc<Mutex<State>>, prepared: Prepared) {
    let Prepared { namespace, name, uid, ip, port, dir, script } = prepared;
    let log = dir.join("output.log");
    let process = match Wrapped::spawn(&script, &log) {
        Ok(process) => process,
        Err(error) => return report_failed(&api, &name, &format!("{error:#}")).await,
    };
    let address = SocketAddr::new(IpAddr::V4(ip), port);
    let waited = wait_accepting(address, &process, START_TIMEOUT).await;
    state
        .lock()
        .expect("agent state")
        .running
        .insert(key(&namespace, &name), Running { ip, process, dir: dir.clone() });
    if let Err(why) = waited {
        let output = read_tail(&log) + &read_tail(&dir.join("cache.log"));
        return report_failed(&api, &name, &format!("{why}; its output ends with:\n{output}")).await;
    }
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
    let status = json!({ "status": {
        "phase": "Running",
        "podIP": ip.to_string(),
        "podIPs": [{ "ip": ip.to_string() }],
        "hostIP": "127.0.0.1",
        "startTime": now,
        "conditions": [
            { "type": "PodScheduled", "status": "True" },
            { "type": "Initialized", "status": "True" },
            { "type": "ContainersReady", "status": "True" },
            { "type": "Ready", "status": "True" },
        ],
        "containerStatuses": [{
            "name": "squid", "ready": true, "started": true, "restartCount": 0, "image": "squid", "imageID": "",
            "state": { "running": { "startedAt": now } },
        }],
    }});
    if let Err(error) = api.patch_status(&name, &PatchParams::default(), &Patch::Merge(status)).await {
        eprintln!("egress-testenv node agent: reporting {namespace}/{name} ({uid}) Running failed: {error}");
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

    #[test]
    fn squid_config_is_rewritten_for_the_local_machine() {
        let conf = "http_port 3128\nauth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/squid-egress-auth/passwd\n\
                    access_log stdio:/dev/stdout\ncache_log /dev/stderr\npid_filename none\ncoredump_dir /tmp\ncache deny all\n";
        let mounts = vec![
            ("/etc/squid-egress-auth".to_owned(), "/tmp/p/root/etc/squid-egress-auth".to_owned()),
            ("/etc/squid-egress".to_owned(), "/tmp/p/root/etc/squid-egress".to_owned()),
        ];
        let out = rewrite_squid_config(conf, Ipv4Addr::new(127, 1, 0, 7), Path::new("/tmp/p"), &mounts);
        assert!(out.contains("http_port 127.1.0.7:3128\n"), "{out}");
        assert!(out.contains("basic_ncsa_auth /tmp/p/root/etc/squid-egress-auth/passwd\n"), "{out}");
        assert!(out.contains("access_log stdio:/tmp/p/access.log\n"));
        assert!(out.contains("cache_log /tmp/p/cache.log\n"));
        assert!(out.contains("pid_filename /tmp/p/squid.pid\n"));
        assert!(out.contains("coredump_dir /tmp/p\n"));
        assert!(out.contains("cache deny all\n"), "other lines are untouched");
    }

    #[test]
    fn each_pod_squid_gets_its_own_service_name() {
        let mounts = vec![("/etc/squid-egress".to_owned(), "/tmp/egress-pod-ab12/root/etc/squid-egress".to_owned())];
        let command = [
            "sh".to_owned(),
            "-c".to_owned(),
            "ulimit -n 16384 && exec squid -N -f /etc/squid-egress/squid.conf".to_owned(),
        ];
        let rewritten = rewrite_command(&command, &mounts, "egresspodab12");
        assert_eq!(
            rewritten[2],
            "ulimit -n 16384 && exec squid -N -n egresspodab12 -f /tmp/egress-pod-ab12/root/etc/squid-egress/squid.conf"
        );
    }

    #[test]
    fn rewrites_are_applied_once() {
        let mounts = vec![
            ("/etc/squid-egress-auth".to_owned(), "/tmp/p/root/etc/squid-egress-auth".to_owned()),
            ("/etc/squid-egress".to_owned(), "/tmp/p/root/etc/squid-egress".to_owned()),
        ];
        assert_eq!(
            apply_rewrites("-f /etc/squid-egress/squid.conf /etc/squid-egress-auth/passwd", &mounts),
            "-f /tmp/p/root/etc/squid-egress/squid.conf /tmp/p/root/etc/squid-egress-auth/passwd"
        );
    }

    #[test]
    fn shell_quoting_survives_quotes() {
        assert_eq!(shell_quote("a'b"), r"'a'\''b'");
    }
}
