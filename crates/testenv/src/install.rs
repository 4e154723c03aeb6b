//! The product installed as a user installs it: `kubectl apply -k` of `deploy/default`, as shipped (or `helm install`
//! of the chart), on the local control plane, with the node agent running the operator's and the gateway's pods and
//! the proxies' pods, and a stand-in for kube-proxy that reaches a Service through its EndpointSlices.
//!
//! Only two things are test inputs, in a kustomize overlay over the unmodified `deploy/default`: the providers
//! ConfigMap, and (outside the manifests) the node agent's image map, which runs the operator's image as the
//! built binary and the Squid image as Debian's Squid.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Component, Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, ResourceExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::node_agent::{AgentConfig, ImageMap, Runtime};
use crate::{ControlPlane, NodeAgent, assets};

/// The namespace `deploy/default` installs into.
pub const SYSTEM_NAMESPACE: &str = "egress-system";

/// The image the shipped Deployment names.
pub const OPERATOR_IMAGE: &str = "egress-operator:latest";

/// The Squid image the shipped providers ConfigMap names.
pub const SQUID_IMAGE: &str = "ubuntu/squid:latest";

/// The discovery token the shipped Secret holds (with the `lease` scope).
pub const SHIPPED_LEASE_TOKEN: &str = "replace-me-lease-token-0000";

/// The label selecting the operator's pods.
pub const OPERATOR_SELECTOR: &str = "app.kubernetes.io/name=egress-operator";

/// The label selecting the gateway's pods.
pub const GATEWAY_SELECTOR: &str = "app.kubernetes.io/name=egress-gateway";

/// What a test chooses about an installation.
#[derive(Clone, Debug)]
pub struct InstallOptions {
    /// The built `egress-operator` binary, run for the operator's image.
    pub operator_binary: PathBuf,
    /// The content of the providers ConfigMap's `providers.yaml`.
    pub providers_yaml: String,
    /// The namespaces whose pods the proxies' provider creates (the node agent runs them too).
    pub proxy_namespaces: Vec<String>,
    /// Where the operator's health checks fetch through each proxy when a Proxy names no URL: the test's origin,
    /// standing in for the internet the default would reach.
    pub default_probe_url: String,
    /// The discovery tokens file's content (`lease <token>` lines), replacing the shipped example tokens; None
    /// keeps them ([`SHIPPED_LEASE_TOKEN`]).
    pub discovery_tokens: Option<String>,
    /// Installs with the shared state store as `docs/install.md` says (the `deploy/shared-state` component over
    /// `deploy/default`, its URL and password Secret), and the store itself: Debian's `redis-server`, run by the
    /// node agent for a `valkey` Deployment and Service in [`SYSTEM_NAMESPACE`] (kustomize only).
    pub shared_state: bool,
}

/// The image the test's state store Deployment names, run as Debian's `redis-server`.
pub const STATE_STORE_IMAGE: &str = "valkey/valkey:8";

/// The test's state store Deployment (and Service) in [`SYSTEM_NAMESPACE`].
pub const STATE_STORE_DEPLOYMENT: &str = "valkey";

/// The label selecting the test's state store's pods.
pub const STATE_STORE_SELECTOR: &str = "app=valkey";

/// The password of the test's state store.
const STATE_STORE_PASSWORD: &str = "e2e-state-store-password";

/// `deploy/default` running on the local control plane.
pub struct Installation {
    agent: NodeAgent,
    client: Client,
    /// The `egress-discovery` Service, reached through its EndpointSlices.
    pub discovery: ServiceProxy,
    /// The `egress-gateway` Service, reached the same way.
    pub gateway: ServiceProxy,
    /// The state store's `valkey` Service, when installed with [`InstallOptions::shared_state`].
    pub state_store: Option<ServiceProxy>,
}

/// How an installation is made.
#[derive(Clone, Debug)]
pub enum Installer {
    /// `kubectl apply -k` of an overlay over the shipped `deploy/default`.
    Kustomize,
    /// `helm install <release> <chart>` into [`SYSTEM_NAMESPACE`] (created by Helm), the providers file and the
    /// tokens passed as values (`--set-file`), then `args`.
    Helm {
        /// The chart's directory.
        chart: PathBuf,
        /// The release's name.
        release: String,
        /// More arguments for `helm install` (`--set` of other values).
        args: Vec<String>,
    },
}

impl Installation {
    /// Applies `deploy/default` with `kubectl apply -k`, starts the node agent for it, and waits until the
    /// Deployment is Available with every replica Ready and the discovery Service has a ready endpoint.
    pub async fn apply(plane: &ControlPlane, options: &InstallOptions) -> Result<Self> {
        Self::install(plane, options, &Installer::Kustomize).await
    }

    /// Installs as `installer` says, starts the node agent for it, and waits as [`Installation::apply`] does.
    pub async fn install(plane: &ControlPlane, options: &InstallOptions, installer: &Installer) -> Result<Self> {
        if !plane.has_controller_manager() {
            bail!("an installation needs kube-controller-manager for its Deployment and EndpointSlices");
        }
        let client = plane.client().await?;
        let address = plane.server_address().context("an installation needs the local control plane")?;
        let discovery = ServiceProxy::start(client.clone(), SYSTEM_NAMESPACE, "egress-discovery", "discovery").await?;
        let gateway = ServiceProxy::start(client.clone(), SYSTEM_NAMESPACE, "egress-gateway", "gateway").await?;
        let state_store = match (options.shared_state, installer) {
            (false, _) => None,
            (true, Installer::Kustomize) => {
                Some(ServiceProxy::start(client.clone(), SYSTEM_NAMESPACE, STATE_STORE_DEPLOYMENT, "redis").await?)
            }
            (true, Installer::Helm { .. }) => bail!("the shared state store is installed with kustomize only here"),
        };
        // Each pod listens on its own address (the pods share this network namespace). There is no cluster DNS
        // here: the gateway's pods reach the discovery Service through its stand-in, as the name would resolve.
        let operator_env = ["DISCOVERY", "METRICS", "HEALTH", "GATEWAY"]
            .into_iter()
            .zip([8090, 8080, 8081, 8088])
            .map(|(name, port)| (format!("EGRESS_{name}_ADDR"), format!("{{pod_ip}}:{port}")))
            .chain([
                ("EGRESS_DEFAULT_PROBE_URL".to_owned(), options.default_probe_url.clone()),
                ("EGRESS_DISCOVERY_URL".to_owned(), discovery.url()),
            ])
            .collect();
        let mut images = ImageMap::new()
            .with(
                OPERATOR_IMAGE,
                Runtime::Program { entrypoint: vec![options.operator_binary.display().to_string()], env: operator_env },
            )
            .with(SQUID_IMAGE, Runtime::Squid);
        if state_store.is_some() {
            let redis = crate::redis::redis_binary()?.display().to_string();
            images = images.with(STATE_STORE_IMAGE, Runtime::Program { entrypoint: vec![redis], env: Vec::new() });
        }
        let mut namespaces = vec![SYSTEM_NAMESPACE.to_owned()];
        namespaces.extend(options.proxy_namespaces.iter().cloned());
        let agent = NodeAgent::start_with(
            client.clone(),
            AgentConfig { namespaces, label_selector: None, images, apiserver: Some(address) },
        )
        .await?;

        let kubeconfig = format!("--kubeconfig={}", plane.kubeconfig_path().display());
        match installer {
            Installer::Kustomize => {
                let store = state_store.as_ref().map(|service| service.url().replace("http://", "redis://") + "/0");
                let overlay =
                    write_overlay(&options.providers_yaml, options.discovery_tokens.as_deref(), store.as_deref())?;
                let output = Command::new(assets::kubectl())
                    .arg(&kubeconfig)
                    .args(["apply", "-k"])
                    .arg(overlay.path())
                    .output()
                    .with_context(|| format!("running {}", assets::kubectl().display()))?;
                // Nothing reads the overlay again; a leaked installation (a test suite's static) would keep it.
                drop(overlay);
                if !output.status.success() {
                    bail!("kubectl apply -k deploy/default failed: {}", String::from_utf8_lossy(&output.stderr).trim());
                }
            }
            Installer::Helm { chart, release, args } => {
                let values = tempfile::Builder::new().prefix("egress-helm-values-").tempdir()?;
                let providers = values.path().join("providers.yaml");
                std::fs::write(&providers, &options.providers_yaml)?;
                let mut command = Command::new(assets::helm());
                command
                    .arg(&kubeconfig)
                    .args(["install", release])
                    .arg(chart)
                    .args(["--namespace", SYSTEM_NAMESPACE, "--create-namespace"])
                    .arg(format!("--set-file=providers={}", providers.display()));
                if let Some(tokens) = &options.discovery_tokens {
                    let path = values.path().join("tokens");
                    std::fs::write(&path, tokens)?;
                    command.arg(format!("--set-file=discoveryTokens.tokens={}", path.display()));
                }
                let output =
                    command.args(args).output().with_context(|| format!("running {}", assets::helm().display()))?;
                if !output.status.success() {
                    bail!("helm install failed: {}", String::from_utf8_lossy(&output.stderr).trim());
                }
            }
        }
        let installation = Self { agent, client, discovery, gateway, state_store };
        installation.wait_available(Duration::from_secs(180)).await?;
        Ok(installation)
    }

    /// The node agent running the pods.
    pub fn agent(&self) -> &NodeAgent {
        &self.agent
    }

    /// The operator's pods, by name.
    pub async fn operator_pods(&self) -> Result<Vec<Pod>> {
        self.pods(OPERATOR_SELECTOR).await
    }

    /// The gateway's pods, by name.
    pub async fn gateway_pods(&self) -> Result<Vec<Pod>> {
        self.pods(GATEWAY_SELECTOR).await
    }

    async fn pods(&self, selector: &str) -> Result<Vec<Pod>> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), SYSTEM_NAMESPACE);
        let mut items = pods.list(&ListParams::default().labels(selector)).await?.items;
        items.sort_by_key(ResourceExt::name_any);
        Ok(items)
    }

    /// The holder of the leader-election Lease (`<pod name>_<suffix>`), if any, read with `client` (a client
    /// belongs to the runtime it first ran on: a test passes its own).
    pub async fn lease_holder_with(&self, client: &Client) -> Result<Option<String>> {
        let leases: Api<Lease> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
        Ok(leases.get_opt("egress-operator").await?.and_then(|lease| lease.spec?.holder_identity))
    }

    /// Waits until the operator's Deployment is Available, every replica Ready, and the discovery Service routes
    /// somewhere; and, when the gateway is installed, the same of its Deployment and Service.
    pub async fn wait_available(&self, timeout: Duration) -> Result<()> {
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), SYSTEM_NAMESPACE);
        let deadline = tokio::time::Instant::now() + timeout;
        // The gateway may be left out (the chart's `gateway.enabled=false`); the operator may not.
        let mut waited = vec![
            ("egress-operator", &self.discovery, OPERATOR_SELECTOR, "operator", false),
            ("egress-gateway", &self.gateway, GATEWAY_SELECTOR, "gateway", true),
        ];
        if let Some(store) = &self.state_store {
            waited.insert(0, (STATE_STORE_DEPLOYMENT, store, STATE_STORE_SELECTOR, "valkey", false));
        }
        for (name, service, selector, container, optional) in waited {
            loop {
                let deployment = deployments.get_opt(name).await?;
                if deployment.is_none() && optional {
                    break;
                }
                let status = deployment.as_ref().and_then(|d| d.status.clone()).unwrap_or_default();
                let wanted = deployment.and_then(|d| d.spec?.replicas).unwrap_or(1);
                let available = status
                    .conditions
                    .iter()
                    .flatten()
                    .any(|condition| condition.type_ == "Available" && condition.status == "True");
                if available && status.ready_replicas == Some(wanted) && !service.endpoints().is_empty() {
                    break;
                }
                if tokio::time::Instant::now() > deadline {
                    let pods: Vec<String> = self
                        .pods(selector)
                        .await
                        .unwrap_or_default()
                        .iter()
                        .map(|pod| {
                            format!("{} {}", pod.name_any(), serde_json::to_string(&pod.status).unwrap_or_default())
                        })
                        .collect();
                    bail!(
                        "the {name} Deployment was not Available with {wanted} Ready replicas and a Service endpoint \
                         within {timeout:?} (deployment status {status:?}; endpoints {:?}); pods:\n{}\nlogs:\n{}",
                        service.endpoints(),
                        pods.join("\n"),
                        self.logs(selector, container).await
                    );
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
        Ok(())
    }

    /// The files the operator and gateway pods' output goes to: (pod, container, path), as `kubectl logs` would
    /// show them on a cluster with a kubelet.
    pub async fn log_files(&self) -> Vec<(String, String, PathBuf)> {
        let mut files = Vec::new();
        for (selector, container) in [(OPERATOR_SELECTOR, "operator"), (GATEWAY_SELECTOR, "gateway")] {
            for pod in self.pods(selector).await.unwrap_or_default() {
                let name = pod.name_any();
                if let Some(path) = self.agent.container_log_path(SYSTEM_NAMESPACE, &name, container) {
                    files.push((name, container.to_owned(), path));
                }
            }
        }
        files
    }

    /// Every operator pod's output, for messages and for checks such as "no request was forbidden".
    pub async fn operator_logs(&self) -> String {
        self.logs(OPERATOR_SELECTOR, "operator").await
    }

    /// Every gateway pod's output.
    pub async fn gateway_logs(&self) -> String {
        self.logs(GATEWAY_SELECTOR, "gateway").await
    }

    async fn logs(&self, selector: &str, container: &str) -> String {
        let pods = self.pods(selector).await.unwrap_or_default();
        pods.iter()
            .map(|pod| {
                let name = pod.name_any();
                format!("==== {name}\n{}", self.agent.container_log(SYSTEM_NAMESPACE, &name, container))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Writes a kustomize overlay over the shipped `deploy/default` that replaces only the providers ConfigMap (and,
/// when given, the discovery tokens); with `state_store` (the store's URL), it adds the `deploy/shared-state`
/// component as `docs/install.md` says, the password Secret a user creates, and the store.
fn write_overlay(providers_yaml: &str, tokens: Option<&str>, state_store: Option<&str>) -> Result<tempfile::TempDir> {
    let dir = tempfile::Builder::new().prefix("egress-overlay-").tempdir()?;
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/default");
    let base = std::fs::canonicalize(&base).with_context(|| format!("finding {}", base.display()))?;
    let relative = relative_path(dir.path(), &base);
    // The providers file goes in as a JSON string, which is a YAML scalar too.
    let kustomization = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {}\npatches:\n  - patch: |\n      \
         apiVersion: v1\n      kind: ConfigMap\n      metadata:\n        name: egress-operator-providers\n        \
         namespace: {SYSTEM_NAMESPACE}\n      data:\n        providers.yaml: {}\n",
        relative.display(),
        serde_json::Value::from(providers_yaml)
    );
    let kustomization = match tokens {
        None => kustomization,
        Some(tokens) => format!(
            "{kustomization}  - patch: |\n      apiVersion: v1\n      kind: Secret\n      metadata:\n        name: \
             egress-operator-discovery-tokens\n        namespace: {SYSTEM_NAMESPACE}\n      stringData:\n        tokens: {}\n",
            serde_json::Value::from(tokens)
        ),
    };
    let kustomization = match state_store {
        None => kustomization,
        Some(url) => {
            let component = relative.with_file_name("shared-state");
            std::fs::write(dir.path().join("state-store.yaml"), state_store_manifests())?;
            format!(
                "{kustomization}  - patch: |\n      apiVersion: v1\n      kind: ConfigMap\n      metadata:\n        name: \
                 egress-operator-state-store\n      data:\n        url: {url}\nnamespace: {SYSTEM_NAMESPACE}\n\
                 components:\n  - {}\n",
                component.display()
            )
            .replacen("resources:\n", "resources:\n  - state-store.yaml\n", 1)
        }
    };
    std::fs::write(dir.path().join("kustomization.yaml"), kustomization)?;
    Ok(dir)
}

/// The test's state store, as a user might run one: the password Secret the operator reads, and one in-memory
/// Valkey (Debian's `redis-server` under the node agent) behind the Service `valkey`. A new pod starts empty.
fn state_store_manifests() -> String {
    format!(
        r#"apiVersion: v1
kind: Secret
metadata:
  name: egress-operator-state-store
stringData:
  password: {STATE_STORE_PASSWORD}
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {STATE_STORE_DEPLOYMENT}
spec:
  replicas: 1
  selector:
    matchLabels: {{ app: {STATE_STORE_DEPLOYMENT} }}
  template:
    metadata:
      labels: {{ app: {STATE_STORE_DEPLOYMENT} }}
    spec:
      terminationGracePeriodSeconds: 2
      # The namespace enforces the restricted Pod Security Standard.
      securityContext:
        runAsNonRoot: true
        runAsUser: 65532
        runAsGroup: 65532
        seccompProfile: {{ type: RuntimeDefault }}
      containers:
        - name: valkey
          image: {STATE_STORE_IMAGE}
          securityContext:
            allowPrivilegeEscalation: false
            capabilities: {{ drop: [ALL] }}
          args: ["--bind", "$(POD_IP)", "--port", "6379", "--save", "", "--appendonly", "no",
                 "--requirepass", "$(PASSWORD)"]
          env:
            - name: POD_IP
              valueFrom: {{ fieldRef: {{ fieldPath: status.podIP }} }}
            - name: PASSWORD
              valueFrom: {{ secretKeyRef: {{ name: egress-operator-state-store, key: password }} }}
          ports:
            - {{ name: redis, containerPort: 6379 }}
---
apiVersion: v1
kind: Service
metadata:
  name: {STATE_STORE_DEPLOYMENT}
spec:
  selector: {{ app: {STATE_STORE_DEPLOYMENT} }}
  ports:
    - {{ name: redis, port: 6379, targetPort: redis }}
"#
    )
}

/// `to` relative to the directory `from` (kustomize refuses absolute resource paths); both absolute.
pub fn relative_path(from: &Path, to: &Path) -> PathBuf {
    let from = std::fs::canonicalize(from).unwrap_or(from.to_path_buf());
    let from: Vec<Component> = from.components().collect();
    let to: Vec<Component> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut path = PathBuf::new();
    for _ in common..from.len() {
        path.push("..");
    }
    for part in &to[common..] {
        path.push(part.as_os_str());
    }
    path
}

/// A stand-in for kube-proxy: a loopback listener that forwards each connection to one endpoint of a Service,
/// picked per connection (round-robin) from its EndpointSlices as they are now: the ready endpoints, or, when none is
/// ready, the ones still serving while they terminate (kube-proxy's rule since Kubernetes 1.28, KEP-1669). With no
/// such endpoint a connection is closed at once, as a rejected one would be.
pub struct ServiceProxy {
    address: SocketAddr,
    endpoints: Arc<Mutex<Vec<SocketAddr>>>,
    connections: Arc<Mutex<Vec<SocketAddr>>>,
    tasks: Vec<JoinHandle<()>>,
}

/// The addresses a Service routes to: ready endpoints, else serving terminating ones.
fn routed(slices: &[Arc<EndpointSlice>], port_name: &str) -> Vec<SocketAddr> {
    let (mut ready, mut terminating): (BTreeSet<SocketAddr>, BTreeSet<SocketAddr>) = Default::default();
    for slice in slices {
        let port = slice
            .ports
            .iter()
            .flatten()
            .find(|port| port.name.as_deref() == Some(port_name))
            .and_then(|port| port.port)
            .and_then(|port| u16::try_from(port).ok());
        let Some(port) = port else { continue };
        for endpoint in slice.endpoints.iter().flatten() {
            let conditions = endpoint.conditions.clone().unwrap_or_default();
            let set = if conditions.ready == Some(true) {
                &mut ready
            } else if conditions.serving == Some(true) && conditions.terminating == Some(true) {
                &mut terminating
            } else {
                continue;
            };
            for address in &endpoint.addresses {
                if let Ok(ip) = address.parse::<Ipv4Addr>() {
                    set.insert(SocketAddr::new(ip.into(), port));
                }
            }
        }
    }
    if ready.is_empty() { terminating.into_iter().collect() } else { ready.into_iter().collect() }
}

impl ServiceProxy {
    /// Starts forwarding to the Service `name`'s port `port_name` in `namespace`.
    pub async fn start(client: Client, namespace: &str, name: &str, port_name: &str) -> Result<Self> {
        let slices: Api<EndpointSlice> = Api::namespaced(client, namespace);
        let (reader, writer) = reflector::store();
        let config = watcher::Config::default().labels(&format!("kubernetes.io/service-name={name}"));
        let endpoints: Arc<Mutex<Vec<SocketAddr>>> = Arc::default();
        let kept = endpoints.clone();
        let port_name = port_name.to_owned();
        let watch = tokio::spawn(async move {
            let mut stream = reflector(writer, watcher(slices, config)).default_backoff().touched_objects().boxed();
            while stream.next().await.is_some() {
                *kept.lock().expect("endpoints") = routed(&reader.state(), &port_name);
            }
        });
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let address = listener.local_addr()?;
        let connections: Arc<Mutex<Vec<SocketAddr>>> = Arc::default();
        let (routes, log) = (endpoints.clone(), connections.clone());
        let accept = tokio::spawn(async move {
            let next = AtomicUsize::new(0);
            while let Ok((mut inbound, _)) = listener.accept().await {
                let target = {
                    let routes = routes.lock().expect("endpoints");
                    (!routes.is_empty()).then(|| routes[next.fetch_add(1, Ordering::Relaxed) % routes.len()])
                };
                let Some(target) = target else { continue };
                log.lock().expect("connections").push(target);
                tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Ok(Self { address, endpoints, connections, tasks: vec![watch, accept] })
    }

    /// `http://127.0.0.1:<port>`: the Service as a client in the cluster would reach it.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// The ready endpoints the Service routes to now.
    pub fn endpoints(&self) -> Vec<SocketAddr> {
        self.endpoints.lock().expect("endpoints").clone()
    }

    /// Every endpoint a connection was forwarded to, in order.
    pub fn connections(&self) -> Vec<SocketAddr> {
        self.connections.lock().expect("connections").clone()
    }
}

impl Drop for ServiceProxy {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(endpoints: &[(&str, bool, bool, bool)]) -> Arc<EndpointSlice> {
        use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};
        Arc::new(EndpointSlice {
            address_type: "IPv4".into(),
            endpoints: Some(
                endpoints
                    .iter()
                    .map(|(address, ready, serving, terminating)| Endpoint {
                        addresses: vec![(*address).into()],
                        conditions: Some(EndpointConditions {
                            ready: Some(*ready),
                            serving: Some(*serving),
                            terminating: Some(*terminating),
                        }),
                        ..Endpoint::default()
                    })
                    .collect(),
            ),
            ports: Some(vec![EndpointPort {
                name: Some("discovery".into()),
                port: Some(8090),
                ..EndpointPort::default()
            }]),
            metadata: Default::default(),
        })
    }

    #[test]
    fn terminating_endpoints_serve_only_while_none_is_ready() {
        let address = |ip: &str| SocketAddr::new(ip.parse().expect("ip"), 8090);
        let draining = slice(&[("10.0.0.1", false, true, true), ("10.0.0.3", false, false, true)]);
        assert_eq!(routed(std::slice::from_ref(&draining), "discovery"), [address("10.0.0.1")]);
        let both = slice(&[("10.0.0.1", false, true, true), ("10.0.0.2", true, true, false)]);
        assert_eq!(routed(&[both], "discovery"), [address("10.0.0.2")]);
        assert!(routed(&[draining], "metrics").is_empty());
    }

    #[test]
    fn relative_paths_climb_to_the_common_root() {
        assert_eq!(
            relative_path(Path::new("/nonexistent/tmp/overlay"), Path::new("/nonexistent/work/deploy/default")),
            PathBuf::from("../../work/deploy/default")
        );
    }
}
