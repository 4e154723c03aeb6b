//! The project's OCI images: their recipes (shared by `cargo xtask image`, which builds them, and the tests, which
//! run them with crun), where the cache keeps them, and a container of one running under crun.
//!
//! Two images, built without a registry or a Docker daemon:
//!
//! - **the operator's** (`egress-operator`): `mmdebstrap --variant=extract` unpacks Debian's `libvirt0` and
//!   `ca-certificates` with their dependencies (no shell, no package manager, no maintainer scripts run), the CA
//!   bundle is the concatenation `update-ca-certificates` would write, and `umoci` makes it an OCI image with a second
//!   layer holding the release binary. The `Dockerfile` builds the same layout with the same steps.
//! - **Squid's** (`egress-squid`): Debian trixie's Squid 6 installed on a minimal Debian (`--variant=minbase`), the
//!   image the `pods` provider's proxies can run. The tests run every other Squid from the host's packages (bookworm's
//!   Squid 5); this one is how the rendered configuration is tested in Squid 6, the major version of the
//!   `ubuntu/squid` image the providers file names by default.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use std::os::unix::fs::PermissionsExt as _;

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

use crate::assets;
use crate::process::shell_quote;
use crate::squid::Wrapped;

/// The Debian release the image's libraries come from (the machine's own, so the binary links against the same).
pub const SUITE: &str = "bookworm";

/// The packages unpacked into the base layer (with their dependencies): libvirt's client library, which the kvm
/// provider links, and the CA roots that TLS to cloud APIs verifies against.
pub const PACKAGES: &[&str] = &["libvirt0", "ca-certificates"];

/// Removed from the base layer: apt's and dpkg's state (the image has neither), and what nothing in the image reads.
pub const REMOVED: &[&str] = &[
    "etc/apt",
    "var/lib/apt",
    "var/cache/apt",
    "var/lib/dpkg",
    "var/log",
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
    // Scripts for interpreters the image lacks (it has no Perl and no shell): debconf's and OpenSSL's Perl tools,
    // which come with ca-certificates' dependencies, and update-ca-certificates, whose output is written below.
    "usr/share/perl5",
    "usr/share/debconf",
    "usr/lib/ssl/misc",
    "usr/bin/c_rehash",
    "usr/bin/debconf",
    "usr/bin/debconf-apt-progress",
    "usr/bin/debconf-communicate",
    "usr/bin/debconf-copydb",
    "usr/bin/debconf-escape",
    "usr/bin/debconf-set-selections",
    "usr/bin/debconf-show",
    "usr/sbin/dpkg-preconfigure",
    "usr/sbin/dpkg-reconfigure",
    "usr/sbin/update-ca-certificates",
];

/// The CA bundle, as `update-ca-certificates` writes it from `/usr/share/ca-certificates/mozilla/*.crt`.
pub const CA_BUNDLE: &str = "etc/ssl/certs/ca-certificates.crt";

/// Where the binary lives in the image, and its entrypoint.
pub const BINARY: &str = "/usr/local/bin/egress-operator";

/// The user the image runs as (the Deployment's `runAsUser`).
pub const USER: &str = "65532:65532";

/// The ports the image exposes: discovery, metrics, health, and the gateway's (`egress-operator gateway`).
pub const PORTS: [u16; 4] = [8090, 8080, 8081, 8088];

/// The tag of the operator's image in its OCI layout.
pub const TAG: &str = "latest";

/// Bumped when the build steps change in a way the data above does not show.
const LAYOUT: &str = "extract + ca bundle + removed, v2";

/// The base layer's key: the first 16 hex digits of a hash over everything that goes into it.
pub fn base_key() -> String {
    let mut digest = Sha256::new();
    for part in [SUITE, LAYOUT, CA_BUNDLE].iter().chain(PACKAGES).chain(REMOVED) {
        digest.update(part.as_bytes());
        digest.update([0]);
    }
    digest.finalize().iter().take(8).map(|byte| format!("{byte:02x}")).collect()
}

/// The cache directory of images.
pub fn image_dir() -> PathBuf {
    assets::cache_dir().join("image")
}

/// The OCI layout holding the operator's image (tag [`TAG`]), as `cargo xtask image` leaves it.
pub fn operator_layout() -> PathBuf {
    image_dir().join("egress-operator")
}

/// The file in an image's layout naming what the image was built from (for the operator: the base key and the
/// binary's SHA-256; for Squid: its key).
pub const SOURCE_FILE: &str = "egress-source";

/// The Debian release Squid's image comes from: trixie's Squid is 6.x, as in Ubuntu's `ubuntu/squid` images.
pub const SQUID_SUITE: &str = "trixie";

/// The packages installed in Squid's image (with their dependencies, on a minimal Debian: `/bin/sh`, the `proxy`
/// user, `basic_ncsa_auth`).
pub const SQUID_PACKAGES: &[&str] = &["squid"];

/// The port Squid's image exposes (Squid's default `http_port`).
pub const SQUID_PORT: u16 = 3128;

/// Bumped when Squid's image's build steps change in a way the data above does not show.
const SQUID_RECIPE: &str = "minbase + squid, no docs, v1";

/// Squid's image's key: the first 16 hex digits of a hash over everything that goes into it.
pub fn squid_key() -> String {
    let mut digest = Sha256::new();
    for part in [SQUID_SUITE, SQUID_RECIPE].iter().chain(SQUID_PACKAGES) {
        digest.update(part.as_bytes());
        digest.update([0]);
    }
    digest.finalize().iter().take(8).map(|byte| format!("{byte:02x}")).collect()
}

/// The OCI layout holding Squid's image (tag [`TAG`]).
pub fn squid_layout() -> PathBuf {
    image_dir().join("egress-squid")
}

/// The capabilities a container runtime gives a pod's container that asks for none (containerd's and Docker's
/// default set): Squid's, started as root, needs `SETUID`/`SETGID` to drop to its `proxy` user.
pub const DEFAULT_CAPABILITIES: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// The open-file limit containers get: this process's hard limit, as a runtime passes its own on (containerd's is
/// usually 1,048,576; these machines cap it lower, and raising it needs a privilege the sandbox may not grant).
/// Squid's pod command lowers it with `ulimit -n` before Squid starts.
fn nofile_limit() -> u64 {
    fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|limits| {
            let line = limits.lines().find(|line| line.starts_with("Max open files"))?.to_owned();
            line.split_whitespace().nth(4)?.parse().ok()
        })
        .unwrap_or(1024)
}

/// A container running under crun from an unpacked image, in this process's network namespace (so it reaches the
/// local control plane and the tests' loopback servers, and they reach it). Stopped on drop.
pub struct Container {
    id: String,
    dir: tempfile::TempDir,
    process: Option<Wrapped>,
    log: PathBuf,
}

/// What a container runs with, beyond the image's own configuration: what a pod spec's container says.
#[derive(Clone, Debug, Default)]
pub struct ContainerOptions {
    /// Replaces the image's entrypoint, as a pod's `command` does.
    pub command: Option<Vec<String>>,
    /// Arguments after the entrypoint (or `command`).
    pub args: Vec<String>,
    /// Environment variables added to the image's.
    pub env: Vec<(String, String)>,
    /// Files bind-mounted read-only: (path in the container, content). Readable by every user.
    pub files: Vec<(String, String)>,
    /// `readOnlyRootFilesystem`.
    pub read_only_root: bool,
    /// The process's capabilities (bounding, effective, permitted): none, as `drop: [ALL]` leaves, or
    /// [`DEFAULT_CAPABILITIES`].
    pub capabilities: Vec<String>,
}

impl Container {
    /// Unpacks the image in `layout` (tag [`TAG`]) and runs it under crun as `options` say, with
    /// `allowPrivilegeEscalation: false`.
    pub fn run(layout: &Path, options: &ContainerOptions) -> Result<Self> {
        if !layout.join("index.json").is_file() {
            bail!("{} holds no image: build it with `cargo xtask image` (`cargo xtask test` does)", layout.display());
        }
        let dir = tempfile::Builder::new().prefix("egress-container-").tempdir()?;
        let bundle = dir.path().join("bundle");
        run_tool(
            std::process::Command::new("umoci")
                .args(["unpack", "--image"])
                .arg(format!("{}:{TAG}", layout.display()))
                .arg(&bundle),
        )?;
        let config_path = bundle.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&config_path).context("reading the bundle's config.json")?)?;
        let files = dir.path().join("files");
        fs::create_dir_all(&files)?;
        let mut mounts = config["mounts"].as_array().cloned().unwrap_or_default();
        // Neither image reads its cgroup, and crun is run without a cgroup manager (see `crun_script`).
        mounts.retain(|mount| mount["type"] != "cgroup" && mount["type"] != "cgroup2");
        for (index, (target, content)) in options.files.iter().enumerate() {
            let source = files.join(index.to_string());
            fs::write(&source, content)?;
            fs::set_permissions(&source, fs::Permissions::from_mode(0o644))?;
            mounts.push(serde_json::json!({
                "destination": target, "type": "bind", "source": source, "options": ["bind", "ro"]
            }));
        }
        config["mounts"] = serde_json::Value::Array(mounts);
        let process = &mut config["process"];
        if let Some(command) = &options.command {
            process["args"] = serde_json::json!(command);
        }
        if let Some(args) = process["args"].as_array_mut() {
            args.extend(options.args.iter().map(|arg| serde_json::Value::from(arg.as_str())));
        }
        if let Some(env) = process["env"].as_array_mut() {
            env.extend(options.env.iter().map(|(name, value)| serde_json::Value::from(format!("{name}={value}"))));
        }
        // No terminal: the output goes to the container's log.
        process["terminal"] = serde_json::Value::Bool(false);
        process["noNewPrivileges"] = serde_json::Value::Bool(true);
        let nofile = nofile_limit();
        process["rlimits"] = serde_json::json!([{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}]);
        let capabilities = serde_json::json!(options.capabilities);
        process["capabilities"] = serde_json::json!({
            "bounding": capabilities, "effective": capabilities, "permitted": capabilities
        });
        // The network of this process (the test's namespace, where the control plane and the tests' servers listen).
        config["root"]["readonly"] = serde_json::Value::Bool(options.read_only_root);
        if let Some(namespaces) = config["linux"]["namespaces"].as_array_mut() {
            namespaces.retain(|namespace| namespace["type"] != "network" && namespace["type"] != "user");
        }
        fs::write(&config_path, serde_json::to_vec_pretty(&config)?)?;
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let id = format!("egress-test-{}-{}", std::process::id(), COUNT.fetch_add(1, Ordering::Relaxed));
        let log = dir.path().join("container.log");
        let script = crun_script(&["run", "--bundle", &bundle.display().to_string(), &id]);
        let process = Wrapped::spawn(&script, &log)?;
        Ok(Self { id, dir, process: Some(process), log })
    }

    /// The container's root filesystem, as the image unpacked it.
    pub fn rootfs(&self) -> PathBuf {
        self.dir.path().join("bundle/rootfs")
    }

    /// The ports the image's configuration exposes (`8090/tcp`, ...), sorted: umoci carries them into the bundle
    /// as the `org.opencontainers.image.exposedPorts` annotation.
    pub fn exposed_ports(&self) -> Result<Vec<String>> {
        let text = fs::read_to_string(self.dir.path().join("bundle/config.json"))?;
        let config: serde_json::Value = serde_json::from_str(&text)?;
        let ports = config["annotations"]["org.opencontainers.image.exposedPorts"]
            .as_str()
            .context("the bundle has no exposedPorts annotation")?;
        let mut ports: Vec<String> = ports.split(',').filter(|port| !port.is_empty()).map(str::to_owned).collect();
        ports.sort();
        Ok(ports)
    }

    /// The image's configured process as unpacked (user, args, env): `config.json`'s `process`.
    pub fn process_config(&self) -> Result<serde_json::Value> {
        let text = fs::read_to_string(self.dir.path().join("bundle/config.json"))?;
        Ok(serde_json::from_str::<serde_json::Value>(&text)?["process"].clone())
    }

    /// The container's init process ID on the host, as crun reports it.
    pub fn pid(&self) -> Result<u32> {
        let output = crun(&["state", &self.id]).output()?;
        if !output.status.success() {
            bail!("crun state {}: {}", self.id, String::from_utf8_lossy(&output.stderr).trim());
        }
        let state: serde_json::Value = serde_json::from_slice(&output.stdout)?;
        state["pid"].as_u64().map(|pid| pid as u32).context("crun state has no pid")
    }

    /// Whether crun (and so the container) still runs.
    pub fn alive(&self) -> bool {
        self.process.as_ref().is_some_and(Wrapped::alive)
    }

    /// Everything the container wrote.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Stops the container (SIGTERM through crun, which passes it on) and removes it.
    pub fn stop(&mut self) {
        let _ = crun(&["kill", &self.id, "TERM"]).output();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while self.alive() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Some(process) = self.process.take() {
            process.stop();
        }
        let _ = crun(&["delete", "--force", &self.id]).output();
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A shell script running crun with `args`, with no cgroup manager (the containers get no cgroup of their own; the
/// tests set no resource limit) in a mount namespace of its own where `/sys/fs/cgroup` is an empty tmpfs. crun reads
/// that directory's file system type to choose a cgroup mode, and refuses what it finds inside a network namespace
/// entered with `ip netns exec` (a fresh sysfs, where it is a plain directory), as `cargo xtask test` runs tests.
fn crun_script(args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|arg| shell_quote(arg)).collect();
    format!(
        "unshare --mount --propagation private sh -c \
         'mount -t tmpfs egress-cgroup /sys/fs/cgroup && exec crun --cgroup-manager=disabled \"$@\"' crun {}",
        args.join(" ")
    )
}

fn crun(args: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new("sh");
    command.arg("-c").arg(format!("exec {}", crun_script(args)));
    command
}

fn run_tool(command: &mut std::process::Command) -> Result<()> {
    let output = command.output().with_context(|| format!("running {command:?}"))?;
    if !output.status.success() {
        bail!("{command:?} failed: {}", String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(())
}
