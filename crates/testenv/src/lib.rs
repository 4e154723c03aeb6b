//! Test support for egress-operator: a real etcd, kube-apiserver and kube-controller-manager on loopback, the
//! project's CRDs installed, and a fresh namespace per test; a node agent that runs pods as local processes; and
//! `deploy/default` installed as shipped ([`install`]).
//!
//! One control plane serves a whole test binary: the first test that asks for it starts it, the others share it, and
//! it goes away when the binary exits (see [`control_plane`] for how that is guaranteed). Each test builds its own
//! client, because a client belongs to the tokio runtime it first ran on and every `#[tokio::test]` has its own.
//!
//! ```no_run
//! # async fn example() -> anyhow::Result<()> {
//! let ns = egress_testenv::namespace("config").await;
//! let config_maps: kube::Api<k8s_openapi::api::core::v1::ConfigMap> = ns.api();
//! # Ok(()) }
//! ```
//!
//! No product crate depends on this crate at run time; it is a dev-dependency and the engine of `cargo xtask envtest`.

pub mod assets;
pub mod captured;
pub mod control_plane;
pub mod geoip;
pub mod guest;
pub mod image;
pub mod install;
pub mod moto;
pub mod node_agent;
pub mod operator;
pub mod origin;
pub mod pki;
mod process;
pub mod redis;
pub mod site;
pub mod squid;

use std::future::Future;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, ObjectMeta, PostParams};
use kube::{Client, Resource};
use tokio::sync::OnceCell;

pub use control_plane::ControlPlane;
pub use node_agent::NodeAgent;
pub use operator::{GatewayProcess, OperatorOptions, OperatorProcess, http_get};
pub use origin::{LocalOrigin, ProxyAnswer, get_through_proxy, open_tunnel, through_proxy, through_proxy_with};
pub use squid::{POD_NETWORK_ENV, Squid, SquidOptions, client_address, pod_network};

static SHARED: OnceCell<ControlPlane> = OnceCell::const_new();

/// When set, the tests use the cluster of this kubeconfig ([`ControlPlane::external`]) instead of starting a local
/// control plane, and the [`NodeAgent`] leaves pods to the cluster's kubelets. `cargo xtask e2e --kind` sets it.
pub const EXTERNAL_KUBECONFIG_ENV: &str = "EGRESS_TEST_KUBECONFIG";

/// The external cluster's kubeconfig, when [`EXTERNAL_KUBECONFIG_ENV`] names one.
pub fn external_kubeconfig() -> Option<std::path::PathBuf> {
    std::env::var_os(EXTERNAL_KUBECONFIG_ENV).filter(|value| !value.is_empty()).map(Into::into)
}

/// The control plane shared by every test in this binary, started on first use (or the external cluster, see
/// [`EXTERNAL_KUBECONFIG_ENV`]).
///
/// # Panics
/// When the control plane cannot start; the message says why and, when the binaries are missing, how to build them.
pub async fn shared() -> &'static ControlPlane {
    SHARED
        .get_or_init(|| async {
            let plane = match external_kubeconfig() {
                Some(path) => ControlPlane::external(&path).await,
                None => ControlPlane::start().await,
            };
            match plane {
                Ok(plane) => {
                    eprintln!(
                        "egress-testenv: control plane {} ready in {:?}",
                        plane.server_url(),
                        plane.startup_duration()
                    );
                    plane
                }
                Err(error) => panic!("egress-testenv: the test control plane did not start: {error:#}"),
            }
        })
        .await
}

/// A namespace of its own for one test, on the shared control plane.
///
/// When the test panics while this is alive, the end of the apiserver's log is printed, so a failure caused by the
/// server (a rejected request, a CEL error) shows its server-side side too.
pub struct TestNamespace {
    client: Client,
    name: String,
    plane: &'static ControlPlane,
}

/// Creates a fresh namespace named `<prefix>-<random suffix>` with its `default` ServiceAccount (the local control
/// plane has no controller-manager to create it, and pods need it to pass admission; on an external cluster the
/// controller-manager may be first, which is fine).
///
/// # Panics
/// When the control plane cannot start or the namespace cannot be created.
pub async fn namespace(prefix: &str) -> TestNamespace {
    let plane = shared().await;
    let client = plane.client().await.unwrap_or_else(|error| panic!("egress-testenv: {error:#}"));
    let namespace = Namespace {
        metadata: ObjectMeta { generate_name: Some(format!("{prefix}-")), ..ObjectMeta::default() },
        ..Namespace::default()
    };
    let created = Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .unwrap_or_else(|error| panic!("egress-testenv: creating a namespace: {error}"));
    let name = created.metadata.name.expect("the apiserver names a generated namespace");
    let account = ServiceAccount {
        metadata: ObjectMeta { name: Some("default".into()), ..ObjectMeta::default() },
        ..ServiceAccount::default()
    };
    match Api::<ServiceAccount>::namespaced(client.clone(), &name).create(&PostParams::default(), &account).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(error) => panic!("egress-testenv: creating the default ServiceAccount in {name}: {error}"),
    }
    TestNamespace { client, name, plane }
}

impl TestNamespace {
    /// An admin client for the shared control plane.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// An API for namespaced resources of kind `K` in this namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// The control plane this namespace lives on.
    pub fn control_plane(&self) -> &'static ControlPlane {
        self.plane
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- the end of kube-apiserver's log (test namespace {}) ----\n{}\n---- end of log ----",
                self.name,
                self.plane.apiserver_log_tail(60)
            );
            let manager = self.plane.controller_manager_log_tail(40);
            if !manager.is_empty() {
                eprintln!("---- the end of kube-controller-manager's log ----\n{manager}\n---- end of log ----");
            }
        }
    }
}

/// Polls `check` every 50 ms until it returns `Some`, or fails after `timeout` with `what` in the message.
///
/// For conditions that no watch can express; a Kubernetes object's condition is better awaited with
/// `kube::runtime::wait::await_condition`.
///
/// # Panics
/// When the deadline passes.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    eventually_every(what, timeout, Duration::from_millis(50), || {
        let pending = check();
        async move { pending.await.ok_or_else(String::new) }
    })
    .await
}

/// Polls `check` every `interval` until it returns `Ok`, or fails after `timeout` with `what` and the last `Err`
/// (what was still not so) in the message. For checks too heavy to run every 50 ms (a `kubectl`, a list and a
/// report) and for waits whose failure should show the state they ended in.
///
/// # Panics
/// When the deadline passes.
pub async fn eventually_every<T, F, Fut>(what: &str, timeout: Duration, interval: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    let mut poll = tokio::time::interval(interval);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        poll.tick().await;
        match check().await {
            Ok(value) => return value,
            Err(last) if Instant::now() >= deadline => {
                let last = if last.is_empty() { String::new() } else { format!("; last: {last}") };
                panic!("timed out after {timeout:?} waiting for {what}{last}");
            }
            Err(_) => {}
        }
    }
}
