//! One real etcd and kube-apiserver on loopback, with generated certificates and the project's CRDs installed.
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

/// The field manager the control plane uses to install CRDs.
const FIELD_MANAGER: &str = "egress-testenv";

/// A running etcd and kube-apiserver, or an external cluster. Dropping a local one kills both processes and removes
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
    supervisor: Option<(Child, ChildStdin)>,
    apiserver_log: PathBuf,
}

impl ControlPlane {
    /// Starts etcd and kube-apiserver on free loopback ports, waits until the apiserver is ready, and installs
    /// every CRD found in the workspace's `crds/` directory, waiting until each is Established.
    pub async fn start() -> Result<Self> {
        Self::start_with_crds(&crds_dir()).await
    }

    /// Like [`ControlPlane::start`], installing the CRDs from the given directory.
    pub async fn start_with_crds(crds: &Path) -> Result<Self> {
        let started = Instant::now();
        let (apiserver_bin, etcd_bin) = (assets::kube_apiserver(), assets::etcd());
        for binary in [&apiserver_bin, &etcd_bin] {
            if !binary.is_file() {
                bail!(
                    "{} does not exist: run `cargo xtask envtest` to build the test control plane (or set {} to a \
                     directory holding kube-apiserver and etcd {})",
                    binary.display(),
                    assets::BIN_DIR_ENV,
                    assets::KUBERNETES_VERSION,
                );
            }
        }

        let dir = tempfile::Builder::new().prefix("egress-testenv-").tempdir().context("creating a temp dir")?.keep();
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

        let supervisor = spawn_supervisor(&dir, &[etcd.id(), apiserver.id()])?;
        let kubeconfig_path = dir.join("kubeconfig");
        fs::write(&kubeconfig_path, kubeconfig_yaml(&server_url, &files))
            .with_context(|| format!("writing {}", kubeconfig_path.display()))?;

        let mut plane = Self {
            local: Some(Local { dir, etcd, apiserver, supervisor: Some(supervisor), apiserver_log }),
            server_url,
            kubeconfig_path,
            startup: Duration::ZERO,
        };
        plane.wait_ready().await?;
        plane.create_default_service_account().await?;
        plane.install_crds(crds).await?;
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
        fs::write(path, text).with_context(|| format!("writing {}", path.display()))
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

    /// The last `lines` lines of the apiserver's log (an external cluster's is not available here).
    pub fn apiserver_log_tail(&self, lines: usize) -> String {
        match &self.local {
            Some(local) => tail(&local.apiserver_log, lines),
            None => format!("(an external cluster at {}: its apiserver log is not readable here)", self.server_url),
        }
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let client = self.client().await?;
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut poll = tokio::time::interval(Duration::from_millis(100));
        loop {
            poll.tick().await;
            if let Some(local) = &mut self.local {
                for (name, child, log) in [
                    ("etcd", &mut local.etcd, local.dir.join("etcd.log")),
                    ("kube-apiserver", &mut local.apiserver, local.apiserver_log.clone()),
                ] {
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
        for child in [&mut self.apiserver, &mut self.etcd] {
            // Killing an already-exited child fails harmlessly; the wait reaps it either way.
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some((mut supervisor, stdin)) = self.supervisor.take() {
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
    ca_cert: PathBuf,
    serving_cert: PathBuf,
    serving_key: PathBuf,
    admin_cert: PathBuf,
    admin_key: PathBuf,
    service_account_key: PathBuf,
    service_account_public_key: PathBuf,
}

impl Files {
    fn write(dir: &Path) -> Result<Self> {
        let ca = TestCa::new("egress-testenv-ca")?;
        let serving =
            ca.server_cert(&["localhost"], &[IpAddr::V4(Ipv4Addr::LOCALHOST), IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))])?;
        let admin = ca.client_cert("egress-testenv-admin", &["system:masters"])?;
        let files = Self {
            ca_cert: dir.join("ca.crt"),
            serving_cert: dir.join("apiserver.crt"),
            serving_key: dir.join("apiserver.key"),
            admin_cert: dir.join("admin.crt"),
            admin_key: dir.join("admin.key"),
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
            (&files.service_account_key, service_account.key),
            (&files.service_account_public_key, service_account.cert),
        ];
        for (path, pem) in contents {
            fs::write(path, pem).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(files)
    }
}

fn kubeconfig_yaml(server_url: &str, files: &Files) -> String {
    // JSON strings are valid YAML scalars, so serde_json quotes the paths safely.
    let quote = |path: &Path| serde_json::Value::from(path.display().to_string()).to_string();
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: egress-testenv\n  cluster:\n    server: {server}\n    \
         certificate-authority: {ca}\nusers:\n- name: egress-testenv-admin\n  user:\n    client-certificate: {cert}\n    \
         client-key: {key}\ncontexts:\n- name: egress-testenv\n  context:\n    cluster: egress-testenv\n    user: \
         egress-testenv-admin\n    namespace: default\ncurrent-context: egress-testenv\n",
        server = serde_json::Value::from(server_url),
        ca = quote(&files.ca_cert),
        cert = quote(&files.admin_cert),
        key = quote(&files.admin_key),
    )
}

/// A loopback port that was free a moment ago. Another process could take it before the control plane binds it;
/// on this machine's loopback nothing else allocates ports at that rate, and a clash shows as a clear start error.
fn free_port() -> Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("finding a free loopback port")?;
    Ok(listener.local_addr()?.port())
}

fn spawn_logged(mut command: Command, log: &Path) -> Result<Child> {
    let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let err = out.try_clone()?;
    command.stdin(Stdio::null()).stdout(out).stderr(err).process_group(0);
    command.spawn().with_context(|| format!("starting {:?}", command.get_program()))
}

/// Starts the shell that cleans up after this process, however it ends.
fn spawn_supervisor(dir: &Path, pids: &[u32]) -> Result<(Child, ChildStdin)> {
    let script = r#"trap '' INT TERM HUP; cat >/dev/null; kill -9 "$@" 2>/dev/null; rm -rf "$EGRESS_TESTENV_DIR""#;
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
