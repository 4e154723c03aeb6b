//! One real etcd, kube-apiserver and kube-controller-manager on loopback, with generated certificates and the
//! project's CRDs installed.
//!
//! The controller-manager runs the controllers the product and its manifests rely on (see [`CONTROLLERS`]):
//! Deployments become ReplicaSets and Pods, Services get EndpointSlices of their Ready pods, owner references are
//! garbage-collected, namespaces are emptied on deletion, and every namespace gets its `default` ServiceAccount and
//! its `kube-root-ca.crt` ConfigMap. There is no scheduler and no kubelet: the [`crate::NodeAgent`] binds and runs
//! pods.
//!
//! The processes run in their own process group, so a Ctrl-C in the terminal does not race the cleanup, and are
//! watched by a small supervisor shell that holds the read end of a pipe from this process: when this process exits
//! for any reason (normal end of a test binary, a panic, SIGKILL), the pipe closes and the supervisor kills the
//! control plane and removes its temporary directory. Dropping a [`ControlPlane`] does the same at once.
//!
//! [`ControlPlane::external`] uses a cluster somebody else runs instead (a kind cluster for `cargo xtask e2e
//! --kind`): nothing is started or stopped, the CRDs are applied to it, and the same API serves the tests.

use std::fs::{self, File};
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, Config};

use crate::assets;
use crate::pki::{self, TestCa};

/// How long the apiserver may take to report ready. A cold start on two busy cores takes a few seconds; this bound
/// only stops a broken start from hanging a test run.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// How long a CRD may take to become Established.
const ESTABLISHED_TIMEOUT: Duration = Duration::from_secs(60);

/// The controllers kube-controller-manager runs: what Deployments, Services, owner references, namespaces and pods'
/// service-account tokens need. Node lifecycle, scheduling-related and cloud controllers are left out: there is one
/// node, run by the node agent, and no cloud.
pub const CONTROLLERS: &[&str] = &[
    "deployment-controller",
    "replicaset-controller",
    "endpointslice-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
];

/// What a local control plane runs.
#[derive(Clone, Debug)]
pub struct ControlPlaneOptions {
    /// The directory whose CRDs are installed.
    pub crds: PathBuf,
    /// Whether kube-controller-manager runs beside the apiserver (on by default; a benchmark that measures the
    /// apiserver's own cost turns it off).
    pub controller_manager: bool,
}

impl Default for ControlPlaneOptions {
    fn default() -> Self {
        Self { crds: crds_dir(), controller_manager: true }
    }
}

/// The field manager the control plane uses to install CRDs.
const FIELD_MANAGER: &str = "egress-testenv";

/// A running etcd, kube-apiserver and kube-controller-manager, or an external cluster. Dropping a local one kills both processes and removes
/// their files; dropping an external one leaves the cluster alone.
pub struct ControlPlane {
    local: Option<Local>,
    server_url: String,
    kubeconfig_path: PathBuf,
    startup: Duration,
}

/// The processes and files of a control plane this crate started.
struct Local {
    dir: PathBuf,
    etcd: Child,
    apiserver: Child,
    controller_manager: Option<Child>,
    supervisor: Option<(Child, ChildStdin)>,
    /// Supervisors of processes started after the first one (the controller-manager).
    extra_supervisors: Vec<(Child, ChildStdin)>,
    apiserver_log: PathBuf,
    controller_manager_log: PathBuf,
    ca_pem: String,
}

impl ControlPlane {
    /// Starts etcd, kube-apiserver and kube-controller-manager on free loopback ports, waits until the apiserver
    /// is ready, and installs every CRD found in the workspace's `crds/` directory, waiting until each is
    /// Established.
    pub async fn start() -> Result<Self> {
        Self::start_with(ControlPlaneOptions::default()).await
    }

    /// Like [`ControlPlane::start`], installing the CRDs from the given directory.
    pub async fn start_with_crds(crds: &Path) -> Result<Self> {
        Self::start_with(ControlPlaneOptions { crds: crds.to_path_buf(), ..ControlPlaneOptions::default() }).await
    }

    /// Starts a control plane as `options` say.
    pub async fn start_with(options: ControlPlaneOptions) -> Result<Self> {
        let started = Instant::now();
        let (apiserver_bin, etcd_bin, manager_bin) =
            (assets::kube_apiserver(), assets::etcd(), assets::kube_controller_manager());
        let mut needed = vec![&apiserver_bin, &etcd_bin];
        if options.controller_manager {
            needed.push(&manager_bin);
        }
        for binary in needed {
            if !binary.is_file() {
                bail!(
                    "{} does not exist: run `cargo xtask envtest` to build the test control plane (or set {} to a \
                     directory holding kube-apiserver, kube-controller-manager and etcd {})",
                    binary.display(),
                    assets::BIN_DIR_ENV,
                    assets::KUBERNETES_VERSION,
                );
            }
        }

        let dir = tempfile::Builder::new().prefix("egress-testenv-").tempdir().context("creating a temp dir")?.keep();
        // The cluster's keys live here: nobody else may even list it.
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
                .context("making the state directory private")?;
        }
        let files = Files::write(&dir)?;
        let etcd_client_port = free_port()?;
        let etcd_peer_port = free_port()?;
        let apiserver_port = free_port()?;

        let etcd_client_url = format!("http://127.0.0.1:{etcd_client_port}");
        let etcd_peer_url = format!("http://127.0.0.1:{etcd_peer_port}");
        let mut etcd = Command::new(&etcd_bin);
        etcd.args([
            "--name=default",
            &format!("--data-dir={}", dir.join("etcd").display()),
            &format!("--listen-client-urls={etcd_client_url}"),
            &format!("--advertise-client-urls={etcd_client_url}"),
            &format!("--listen-peer-urls={etcd_peer_url}"),
            &format!("--initial-advertise-peer-urls={etcd_peer_url}"),
            &format!("--initial-cluster=default={etcd_peer_url}"),
            // Test data is thrown away, so durability buys nothing and fsync costs seconds on a busy disk.
            "--unsafe-no-fsync=true",
            "--log-level=warn",
        ]);
        let etcd = spawn_logged(etcd, &dir.join("etcd.log"))?;

        let server_url = format!("https://127.0.0.1:{apiserver_port}");
        let mut apiserver = Command::new(&apiserver_bin);
        apiserver.args([
            &format!("--etcd-servers={etcd_client_url}"),
            &format!("--cert-dir={}", dir.display()),
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            &format!("--secure-port={apiserver_port}"),
            &format!("--tls-cert-file={}", files.serving_cert.display()),
            &format!("--tls-private-key-file={}", files.serving_key.display()),
            &format!("--client-ca-file={}", files.ca_cert.display()),
            &format!("--service-account-issuer={server_url}"),
            &format!("--service-account-key-file={}", files.service_account_public_key.display()),
            &format!("--service-account-signing-key-file={}", files.service_account_key.display()),
            "--service-cluster-ip-range=10.0.0.0/24",
            "--authorization-mode=RBAC",
            "--allow-privileged=true",
            // There is no kube-proxy or network behind the `kubernetes` Service; keeping its Endpoints is noise.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
        ]);
        let apiserver_log = dir.join("kube-apiserver.log");
        let apiserver = spawn_logged(apiserver, &apiserver_log)?;

        let kubeconfig_path = dir.join("kubeconfig");
        write_private(
            &kubeconfig_path,
            kubeconfig_yaml(&server_url, &files.ca_cert, &files.admin_cert, &files.admin_key),
        )
        .with_context(|| format!("writing {}", kubeconfig_path.display()))?;
        let controller_manager_log = dir.join("kube-controller-manager.log");
        let supervisor = spawn_supervisor(&dir, &[etcd.id(), apiserver.id()])?;

        let mut plane = Self {
            local: Some(Local {
                dir,
                etcd,
                apiserver,
                controller_manager: None,
                supervisor: Some(supervisor),
                extra_supervisors: Vec::new(),
                apiserver_log,
                controller_manager_log,
                ca_pem: files.ca_pem.clone(),
            }),
            server_url,
            kubeconfig_path,
            startup: Duration::ZERO,
        };
        plane.wait_ready().await?;
        if options.controller_manager {
            // Only once the apiserver is ready: before its RBAC bootstrap, the controller-manager is refused the
            // ConfigMap it reads at start-up, and exits.
            plane.start_controller_manager(&files)?;
        }
        plane.create_default_service_account().await?;
        plane.install_crds(&options.crds).await?;
        plane.startup = started.elapsed();
        Ok(plane)
    }

    /// Uses the cluster of `kubeconfig` (its current context, with rights to install CRDs and impersonate): waits
    /// until its apiserver is ready and applies every CRD of the workspace's `crds/` directory. Nothing is started,
    /// and dropping the value leaves the cluster as it is.
    pub async fn external(kubeconfig: &Path) -> Result<Self> {
        let started = Instant::now();
        let config = Kubeconfig::read_from(kubeconfig)
            .with_context(|| format!("reading the external cluster's kubeconfig {}", kubeconfig.display()))?;
        let cluster_name = current_context(&config)?.cluster.clone();
        let server_url = config
            .clusters
            .iter()
            .find(|cluster| cluster.name == cluster_name)
            .and_then(|cluster| cluster.cluster.as_ref()?.server.clone())
            .with_context(|| format!("the kubeconfig's cluster {cluster_name:?} has no server"))?;
        let mut plane =
            Self { local: None, server_url, kubeconfig_path: kubeconfig.to_path_buf(), startup: Duration::ZERO };
        plane.wait_ready().await?;
        plane.install_crds(&crds_dir()).await?;
        plane.startup = started.elapsed();
        Ok(plane)
    }

    /// Whether this is a cluster somebody else runs ([`ControlPlane::external`]).
    pub fn is_external(&self) -> bool {
        self.local.is_none()
    }

    /// The apiserver's URL (`https://127.0.0.1:<port>`).
    pub fn server_url(&self) -> &str {
        &self.server_url
    }

    /// A kubeconfig with cluster-admin rights (group `system:masters`, or the external cluster's own);
    /// `kubectl --kubeconfig` works with it.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig_path
    }

    /// Writes a kubeconfig to `path` that authenticates as the admin but impersonates `user` (and `groups`), so a
    /// process using it gets exactly that identity's RBAC permissions.
    ///
    /// The file is JSON (which is YAML too), with the admin's credentials as the source kubeconfig holds them.
    pub fn write_kubeconfig_as(&self, path: &Path, user: &str, groups: &[&str]) -> Result<()> {
        let mut config = Kubeconfig::read_from(&self.kubeconfig_path)
            .with_context(|| format!("reading {}", self.kubeconfig_path.display()))?;
        let context = current_context(&config)?;
        let user_name = context.user.clone().context("the kubeconfig's current context names no user")?;
        let auth = config
            .auth_infos
            .iter_mut()
            .find(|named| named.name == user_name)
            .and_then(|named| named.auth_info.as_mut())
            .with_context(|| format!("the kubeconfig has no user {user_name:?}"))?;
        auth.impersonate = Some(user.to_owned());
        auth.impersonate_groups =
            (!groups.is_empty()).then(|| groups.iter().map(|group| (*group).to_owned()).collect());
        let text = serde_json::to_string_pretty(&config).context("serializing the kubeconfig")?;
        write_private(path, text).with_context(|| format!("writing {}", path.display()))
    }

    /// The admin kubeconfig with the files it names inlined (`certificate-authority-data`, `client-certificate-data`,
    /// `client-key-data`), as JSON: for a process that sees none of this machine's files (a container).
    pub fn kubeconfig_inline(&self) -> Result<String> {
        use base64::Engine as _;
        let config = Kubeconfig::read_from(&self.kubeconfig_path)
            .with_context(|| format!("reading {}", self.kubeconfig_path.display()))?;
        let mut value = serde_json::to_value(&config).context("serializing the kubeconfig")?;
        let entries = [
            ("clusters", "cluster", "certificate-authority"),
            ("users", "user", "client-certificate"),
            ("users", "user", "client-key"),
        ];
        for (list, inner, field) in entries {
            for entry in value[list].as_array_mut().into_iter().flatten() {
                let object = &mut entry[inner];
                if let Some(path) = object.get(field).and_then(serde_json::Value::as_str).map(str::to_owned) {
                    let bytes = fs::read(&path).with_context(|| format!("reading {path}"))?;
                    object[format!("{field}-data")] = base64::engine::general_purpose::STANDARD.encode(bytes).into();
                    object.as_object_mut().context("an object")?.remove(field);
                }
            }
        }
        serde_json::to_string_pretty(&value).context("serializing the kubeconfig")
    }

    /// How long the start took, from spawning etcd to the last CRD Established.
    pub fn startup_duration(&self) -> Duration {
        self.startup
    }

    /// A new admin client. Build one per tokio runtime: a client's connections belong to the runtime it ran on.
    pub async fn client(&self) -> Result<Client> {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig_path).context("reading the test kubeconfig")?;
        let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .context("loading the test kubeconfig")?;
        Client::try_from(config).context("building a client for the test control plane")
    }

    /// The last `lines` lines of kube-controller-manager's log (empty when it does not run here).
    pub fn controller_manager_log_tail(&self, lines: usize) -> String {
        match &self.local {
            Some(local) if local.controller_manager.is_some() => tail(&local.controller_manager_log, lines),
            _ => String::new(),
        }
    }

    /// Whether kube-controller-manager (or, on an external cluster, the cluster's own) runs Deployments,
    /// EndpointSlices and garbage collection.
    pub fn has_controller_manager(&self) -> bool {
        self.local.as_ref().is_none_or(|local| local.controller_manager.is_some())
    }

    /// The cluster CA's certificate in PEM, which in-cluster clients trust (None for an external cluster).
    pub fn ca_pem(&self) -> Option<&str> {
        self.local.as_ref().map(|local| local.ca_pem.as_str())
    }

    /// The apiserver's loopback socket address (None for an external cluster).
    pub fn server_address(&self) -> Option<std::net::SocketAddr> {
        self.local.as_ref()?;
        self.server_url.strip_prefix("https://")?.parse().ok()
    }

    /// The last `lines` lines of the apiserver's log (an external cluster's is not available here).
    pub fn apiserver_log_tail(&self, lines: usize) -> String {
        match &self.local {
            Some(local) => tail(&local.apiserver_log, lines),
            None => format!("(an external cluster at {}: its apiserver log is not readable here)", self.server_url),
        }
    }

    /// Starts kube-controller-manager with its own client certificate, under the same cleanup supervisor.
    fn start_controller_manager(&mut self, files: &Files) -> Result<()> {
        let server_url = self.server_url.clone();
        let Some(local) = self.local.as_mut() else { return Ok(()) };
        let dir = local.dir.clone();
        let controller_manager_log = local.controller_manager_log.clone();
        let manager_bin = assets::kube_controller_manager();
        let kubeconfig = dir.join("controller-manager.kubeconfig");
        write_private(
            &kubeconfig,
            kubeconfig_yaml(&server_url, &files.ca_cert, &files.manager_cert, &files.manager_key),
        )
        .with_context(|| format!("writing {}", kubeconfig.display()))?;
        let mut manager = Command::new(&manager_bin);
        manager.args([
            &format!("--kubeconfig={}", kubeconfig.display()),
            "--bind-address=127.0.0.1",
            &format!("--secure-port={}", free_port()?),
            &format!("--cert-dir={}", dir.join("controller-manager").display()),
            &format!("--controllers={}", CONTROLLERS.join(",")),
            "--leader-elect=false",
            // Each controller acts as its own ServiceAccount, as in a production cluster, so the bootstrap RBAC
            // of each one is what is exercised.
            "--use-service-account-credentials=true",
            &format!("--service-account-private-key-file={}", files.service_account_key.display()),
            &format!("--root-ca-file={}", files.ca_cert.display()),
            "--profiling=false",
        ]);
        let manager = spawn_logged(manager, &controller_manager_log)?;
        // The supervisor was started with the other two; a second one watches this process the same way.
        let supervisor = spawn_supervisor_for(&[manager.id()])?;
        local.controller_manager = Some(manager);
        local.extra_supervisors.push(supervisor);
        Ok(())
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let client = self.client().await?;
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut poll = tokio::time::interval(Duration::from_millis(100));
        loop {
            poll.tick().await;
            if let Some(local) = &mut self.local {
                let mut children = vec![
                    ("etcd", &mut local.etcd, local.dir.join("etcd.log")),
                    ("kube-apiserver", &mut local.apiserver, local.apiserver_log.clone()),
                ];
                if let Some(manager) = local.controller_manager.as_mut() {
                    children.push(("kube-controller-manager", manager, local.controller_manager_log.clone()));
                }
                for (name, child, log) in children {
                    if let Some(status) = child.try_wait()? {
                        bail!("{name} exited during start-up ({status}); the end of its log:\n{}", tail(&log, 40));
                    }
                }
            }
            let request = http::Request::get("/readyz").body(Vec::new())?;
            let last_error = match client.request_text(request).await {
                Ok(body) if body.trim() == "ok" => return Ok(()),
                Ok(body) => body,
                Err(error) => error.to_string(),
            };
            if Instant::now() > deadline {
                bail!(
                    "kube-apiserver was not ready after {READY_TIMEOUT:?} (last answer: {last_error}); the end of its \
                     log:\n{}",
                    self.apiserver_log_tail(40)
                );
            }
        }
    }

    /// Creates `default/default`, which the controller-manager would: pods in `default` need it to pass admission.
    async fn create_default_service_account(&self) -> Result<()> {
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client().await?, "default");
        let account = ServiceAccount {
            metadata: ObjectMeta { name: Some("default".into()), ..ObjectMeta::default() },
            ..ServiceAccount::default()
        };
        match accounts.create(&PostParams::default(), &account).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
            Err(error) => Err(error).context("creating the default ServiceAccount in namespace default"),
        }
    }

    async fn install_crds(&self, crds: &Path) -> Result<()> {
        let client = self.client().await?;
        let api: Api<CustomResourceDefinition> = Api::all(client);
        let mut paths: Vec<PathBuf> = fs::read_dir(crds)
            .with_context(|| format!("reading the CRD directory {}", crds.display()))?
            .map(|entry| entry.map(|entry| entry.path()))
            .collect::<Result<_, _>>()?;
        // Every YAML file but the kustomization that lets deploy/ include the directory.
        paths.retain(|path| {
            path.extension().is_some_and(|ext| ext == "yaml")
                && path.file_name().is_some_and(|name| name != "kustomization.yaml")
        });
        paths.sort();
        for path in &paths {
            let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let crd: CustomResourceDefinition =
                serde_saphyr::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
            let name = crd.metadata.name.clone().with_context(|| format!("{} has no metadata.name", path.display()))?;
            // Applying onto a CRD that is still being deleted patches the dying object, which never becomes
            // Established: wait for it to be gone first.
            if let Some(existing) = api.get_opt(&name).await.with_context(|| format!("reading CRD {name}"))?
                && existing.metadata.deletion_timestamp.is_some()
            {
                let uid = existing.metadata.uid.unwrap_or_default();
                tokio::time::timeout(
                    ESTABLISHED_TIMEOUT,
                    await_condition(api.clone(), &name, conditions::is_deleted(&uid)),
                )
                .await
                .with_context(|| format!("CRD {name} was still being deleted after {ESTABLISHED_TIMEOUT:?}"))?
                .with_context(|| format!("watching CRD {name}"))?;
            }
            api.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&crd))
                .await
                .with_context(|| format!("installing the CRD from {}", path.display()))?;
            tokio::time::timeout(
                ESTABLISHED_TIMEOUT,
                await_condition(api.clone(), &name, conditions::is_crd_established()),
            )
            .await
            .with_context(|| format!("CRD {name} was not Established within {ESTABLISHED_TIMEOUT:?}"))?
            .with_context(|| format!("watching CRD {name}"))?;
        }
        Ok(())
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        if let Some(manager) = self.controller_manager.as_mut() {
            let _ = manager.kill();
            let _ = manager.wait();
        }
        for child in [&mut self.apiserver, &mut self.etcd] {
            // Killing an already-exited child fails harmlessly; the wait reaps it either way.
            let _ = child.kill();
            let _ = child.wait();
        }
        for (mut supervisor, stdin) in self.supervisor.take().into_iter().chain(self.extra_supervisors.drain(..)) {
            drop(stdin);
            let _ = supervisor.wait();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The kubeconfig's current context.
fn current_context(config: &Kubeconfig) -> Result<&kube::config::Context> {
    let name = config.current_context.as_deref().context("the kubeconfig has no current-context")?;
    config
        .contexts
        .iter()
        .find(|context| context.name == name)
        .and_then(|context| context.context.as_ref())
        .with_context(|| format!("the kubeconfig has no context {name:?}"))
}

/// The workspace's `crds/` directory.
pub fn crds_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("..").join("crds")
}

/// The certificate and key files the control plane needs.
struct Files {
    ca_pem: String,
    ca_cert: PathBuf,
    serving_cert: PathBuf,
    serving_key: PathBuf,
    admin_cert: PathBuf,
    admin_key: PathBuf,
    manager_cert: PathBuf,
    manager_key: PathBuf,
    service_account_key: PathBuf,
    service_account_public_key: PathBuf,
}

impl Files {
    fn write(dir: &Path) -> Result<Self> {
        let ca = TestCa::new("egress-testenv-ca")?;
        let serving =
            ca.server_cert(&["localhost"], &[IpAddr::V4(Ipv4Addr::LOCALHOST), IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))])?;
        let admin = ca.client_cert("egress-testenv-admin", &["system:masters"])?;
        // The user the bootstrap RBAC binds to the controller-manager's role.
        let manager = ca.client_cert("system:kube-controller-manager", &[])?;
        let files = Self {
            ca_pem: ca.cert_pem(),
            ca_cert: dir.join("ca.crt"),
            serving_cert: dir.join("apiserver.crt"),
            serving_key: dir.join("apiserver.key"),
            admin_cert: dir.join("admin.crt"),
            admin_key: dir.join("admin.key"),
            manager_cert: dir.join("controller-manager.crt"),
            manager_key: dir.join("controller-manager.key"),
            service_account_key: dir.join("service-account.key"),
            service_account_public_key: dir.join("service-account.pub"),
        };
        let service_account = pki::key_pair_pem()?;
        let contents = [
            (&files.ca_cert, ca.cert_pem()),
            (&files.serving_cert, serving.cert),
            (&files.serving_key, serving.key),
            (&files.admin_cert, admin.cert),
            (&files.admin_key, admin.key),
            (&files.manager_cert, manager.cert),
            (&files.manager_key, manager.key),
            (&files.service_account_key, service_account.key),
            (&files.service_account_public_key, service_account.cert),
        ];
        for (path, pem) in contents {
            write_private(path, pem).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(files)
    }
}

/// Writes a file only its owner may read (0600, also when it existed): keys, certificates and kubeconfigs.
fn write_private(path: &Path, contents: impl AsRef<[u8]>) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut file = fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    file.set_permissions(fs::Permissions::from_mode(0o600))?;
    file.write_all(contents.as_ref())
}

fn kubeconfig_yaml(server_url: &str, ca: &Path, cert: &Path, key: &Path) -> String {
    // JSON strings are valid YAML scalars, so serde_json quotes the paths safely.
    let quote = |path: &Path| serde_json::Value::from(path.display().to_string()).to_string();
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: egress-testenv\n  cluster:\n    server: {server}\n    \
         certificate-authority: {ca}\nusers:\n- name: egress-testenv-admin\n  user:\n    client-certificate: {cert}\n    \
         client-key: {key}\ncontexts:\n- name: egress-testenv\n  context:\n    cluster: egress-testenv\n    user: \
         egress-testenv-admin\n    namespace: default\ncurrent-context: egress-testenv\n",
        server = serde_json::Value::from(server_url),
        ca = quote(ca),
        cert = quote(cert),
        key = quote(key),
    )
}

/// A loopback port that was free a moment ago, chosen below the kernel's ephemeral range (32768 and up by
/// default). A port from that range (what binding port 0 gives) may be handed out meanwhile as the local port of any
/// outgoing connection, and the control plane then cannot bind it: CI saw kube-apiserver fail with "bind: address
/// already in use" that way. Below the range only another listener could take it first, and nothing here listens on
/// random ports there. The operator and gateway processes the tests start take theirs here too.
pub(crate) fn free_port() -> Result<u16> {
    const BELOW_EPHEMERAL: std::ops::Range<u16> = 20_000..32_768;
    for _ in 0..64 {
        let port = fastrand::u16(BELOW_EPHEMERAL);
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return Ok(port);
        }
    }
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("finding a free loopback port")?;
    Ok(listener.local_addr()?.port())
}

fn spawn_logged(mut command: Command, log: &Path) -> Result<Child> {
    let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let err = out.try_clone()?;
    command.stdin(Stdio::null()).stdout(out).stderr(err).process_group(0);
    command.spawn().with_context(|| format!("starting {:?}", command.get_program()))
}

/// Starts a shell that kills `pids` when this process ends, however it ends (and removes no directory).
fn spawn_supervisor_for(pids: &[u32]) -> Result<(Child, ChildStdin)> {
    spawn_supervisor(Path::new(""), pids)
}

/// Starts the shell that cleans up after this process, however it ends: it kills `pids` and removes `dir` (unless
/// empty).
fn spawn_supervisor(dir: &Path, pids: &[u32]) -> Result<(Child, ChildStdin)> {
    let script = r#"trap '' INT TERM HUP; cat >/dev/null; kill -9 "$@" 2>/dev/null; [ -z "$EGRESS_TESTENV_DIR" ] || rm -rf "$EGRESS_TESTENV_DIR""#;
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg("egress-testenv-supervisor")
        .args(pids.iter().map(u32::to_string))
        .env("EGRESS_TESTENV_DIR", dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .context("starting the control plane's cleanup supervisor (sh)")?;
    let stdin = child.stdin.take().context("the supervisor has no stdin pipe")?;
    Ok((child, stdin))
}

fn tail(path: &Path, lines: usize) -> String {
    let Ok(file) = File::open(path) else {
        return format!("({} cannot be read)", path.display());
    };
    let all: Vec<String> = BufReader::new(file).lines().map_while(Result::ok).collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    /// The ports handed to the processes the tests start are outside the kernel's ephemeral range, where an outgoing
    /// connection could take them before the process binds them (regression: a gateway's metrics port was).
    #[test]
    fn free_ports_are_below_the_ephemeral_range() {
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").expect("the ephemeral range");
        let first: u16 = range.split_whitespace().next().and_then(|port| port.parse().ok()).expect("a port");
        for _ in 0..100 {
            let port = super::free_port().expect("a free port");
            assert!(port < first, "port {port} is in the ephemeral range from {first}");
        }
    }
}
