//! Real daemons for the kvm provider's tests: a private libvirtd on a socket in a temp directory, a transient
//! directory pool, an HTTP server for images, and sshd on loopback with generated keys.
//!
//! libvirtd runs as root with the system's state directories, so two cannot run at once: [`exclusive`] serialises
//! the tests that start one.

#![allow(dead_code, reason = "each test binary uses its own subset")]

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::routing::get;
use sha2::{Digest, Sha256};
use virt::connect::Connect;
use virt::storage_pool::StoragePool;

/// Held by a test while its libvirtd runs.
pub async fn exclusive() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// Kills the QEMU that libvirtd starts to probe its capabilities (`-daemonize`, so reparented to init) when the daemon
/// was stopped before it killed the probe itself: left alone, it ran on for hours after the tests (`cargo xtask
/// test`'s leftovers check found one).
fn kill_orphaned_capability_probes() {
    let Ok(entries) = std::fs::read_dir("/proc") else { return };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
        let Ok(command) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let command = String::from_utf8_lossy(&command);
        let orphan = std::fs::read_to_string(entry.path().join("stat"))
            .ok()
            .and_then(|stat| {
                stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1).map(str::to_owned))
            })
            .is_some_and(|parent| parent == "1");
        let qemu = command.split('\0').next().is_some_and(|program| program.contains("qemu-system"));
        // The probe: `-machine none`, its QMP socket in libvirt's QEMU state directory (`capabilities.monitor.sock`
        // in older libvirt, `qmp-XXXXXX/qmp.monitor` in newer).
        let probe = command.contains("-machine\0none") && command.contains("/var/lib/libvirt/qemu/");
        if orphan && qemu && probe {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
    }
}

/// What the names of the tests' pools start with.
pub const POOL_PREFIX: &str = "egress-test-";

/// A libvirtd of this test's own; dropping it stops the daemon.
pub struct Libvirtd {
    dir: tempfile::TempDir,
    child: Option<Child>,
    pools: Vec<String>,
}

impl Libvirtd {
    /// Starts the daemon and waits for its socket.
    pub fn start() -> Self {
        assert!(
            Command::new("id").arg("-u").output().is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0"),
            "the kvm provider's libvirtd tests run libvirtd, which needs root"
        );
        // libvirt prints every error to stderr by default; the polling below expects a few.
        virt::error::clear_error_callback();
        let dir = tempfile::Builder::new().prefix("egress-libvirtd-").tempdir().expect("temp dir");
        std::fs::write(
            dir.path().join("libvirtd.conf"),
            format!(
                "unix_sock_dir = \"{}\"\nauth_unix_rw = \"none\"\nauth_unix_ro = \"none\"\nlog_outputs = \"3:stderr\"\n",
                dir.path().display()
            ),
        )
        .expect("libvirtd.conf");
        // A test run that was killed leaves the state of its transient pools behind, and libvirtd would load them
        // again: remove what earlier runs of these tests left (their pools all start with `POOL_PREFIX`).
        if let Ok(entries) = std::fs::read_dir("/run/libvirt/storage") {
            for entry in entries.flatten() {
                if entry.file_name().to_string_lossy().starts_with(POOL_PREFIX) {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        let mut daemon = Self { dir, child: None, pools: Vec::new() };
        daemon.spawn();
        daemon.remove_test_domains();
        daemon
    }

    /// Domain definitions live in the system's libvirt directory, not in this daemon's: a run that failed midway
    /// leaves its guests defined, and the next run's create would find them instead of making its own. Removes every
    /// domain these tests made (their proxy-uid tag is `uid-px-…`; the operator's are UUIDs).
    fn remove_test_domains(&self) {
        let Ok(mut conn) = Connect::open(Some(&self.uri())) else { return };
        for domain in conn.list_all_domains(0).unwrap_or_default() {
            let ours = domain.get_xml_desc(0).is_ok_and(|xml| xml.contains(">uid-px-") || xml.contains("'uid-px-"));
            if ours {
                if domain.is_active().unwrap_or(false) {
                    let _ = domain.destroy();
                }
                let _ = domain.undefine_flags(virt::sys::VIR_DOMAIN_UNDEFINE_NVRAM);
            }
        }
        let _ = conn.close();
    }

    fn spawn(&mut self) {
        let _ = std::fs::remove_file(self.socket());
        let log = std::fs::File::create(self.dir.path().join("libvirtd.log")).expect("log file");
        let child = Command::new("libvirtd")
            .arg("--config")
            .arg(self.dir.path().join("libvirtd.conf"))
            .arg("--pid-file")
            .arg(self.dir.path().join("libvirtd.pid"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("libvirtd starts (install libvirt-daemon-system)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Connect::open(Some(&self.uri())).map(|mut conn| conn.close()).is_err() {
            assert!(
                Instant::now() < deadline,
                "libvirtd did not answer on {}: {}",
                self.socket().display(),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills the daemon (every client connection drops) and starts it again on the same socket.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Creates a transient directory pool `name` in the daemon's directory; it is destroyed (and libvirt's state
    /// for it removed) when the daemon is dropped. Returns the pool's directory.
    pub fn dir_pool(&mut self, name: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::create_dir_all(&path).expect("pool directory");
        let xml =
            format!("<pool type=\"dir\"><name>{name}</name><target><path>{}</path></target></pool>", path.display());
        let mut conn = Connect::open(Some(&self.uri())).expect("connect");
        StoragePool::create_xml(&conn, &xml, 0).expect("a transient dir pool");
        let _ = conn.close();
        self.pools.push(name.to_owned());
        path
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            kill_orphaned_capability_probes();
        }
    }

    /// The read-write socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("libvirt-sock")
    }

    /// `qemu:///system` on this daemon's socket.
    pub fn uri(&self) -> String {
        format!("qemu:///system?socket={}", self.socket().display())
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("libvirtd.log")).unwrap_or_default()
    }

    /// A directory for files that live as long as the daemon.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Libvirtd {
    fn drop(&mut self) {
        // Destroying a transient pool removes the state libvirt keeps for it under /run/libvirt.
        if let Ok(mut conn) = Connect::open(Some(&self.uri())) {
            for name in &self.pools {
                if let Ok(pool) = StoragePool::lookup_by_name(&conn, name) {
                    let _ = pool.destroy();
                }
            }
            let _ = conn.close();
        }
        self.stop();
    }
}

/// The names of a pool's volumes.
pub fn pool_volumes(uri: &str, pool: &str) -> Vec<String> {
    let mut conn = Connect::open(Some(uri)).expect("connect");
    let pool = StoragePool::lookup_by_name(&conn, pool).expect("pool");
    pool.refresh(0).expect("refresh");
    let mut names: Vec<String> =
        pool.list_all_volumes(0).expect("volumes").iter().map(|volume| volume.get_name().expect("name")).collect();
    names.sort();
    drop(pool);
    let _ = conn.close();
    names
}

/// An HTTP server on loopback serving images by name, counting requests.
pub struct ImageServer {
    pub address: SocketAddr,
    images: Arc<Mutex<HashMap<String, Vec<u8>>>>,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    held: Held,
    task: tokio::task::JoinHandle<()>,
}

/// Images whose answers wait until the test lets them go (`false` while held).
type Held = Arc<Mutex<HashMap<String, tokio::sync::watch::Receiver<bool>>>>;

impl ImageServer {
    pub async fn start() -> Self {
        let images: Arc<Mutex<HashMap<String, Vec<u8>>>> = Arc::default();
        let hits: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let held: Held = Arc::default();
        let state = (images.clone(), hits.clone(), held.clone());
        let app = Router::new().route("/{name}", get(serve)).with_state(state);
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.expect("bind");
        let address = listener.local_addr().expect("address");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { address, images, hits, held, task }
    }

    /// Like [`ImageServer::put`], but every answer for `name` waits until the returned sender sends `true`: a
    /// download that cannot finish before the test has looked at it.
    pub fn put_held(&self, name: &str, data: Vec<u8>) -> (String, String, tokio::sync::watch::Sender<bool>) {
        let (release, held) = tokio::sync::watch::channel(false);
        self.held.lock().unwrap().insert(name.to_owned(), held);
        let (url, sha) = self.put(name, data);
        (url, sha, release)
    }

    /// Serves `data` at `/<name>`; returns its URL and sha256.
    pub fn put(&self, name: &str, data: Vec<u8>) -> (String, String) {
        let sha = hex(&Sha256::digest(&data));
        self.images.lock().unwrap().insert(name.to_owned(), data);
        (format!("http://{}/{name}", self.address), sha)
    }

    /// How many times `/<name>` was fetched.
    pub fn hits(&self, name: &str) -> usize {
        self.hits.lock().unwrap().get(name).copied().unwrap_or(0)
    }
}

impl Drop for ImageServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type ServerState = (Arc<Mutex<HashMap<String, Vec<u8>>>>, Arc<Mutex<HashMap<String, usize>>>, Held);

async fn serve(
    State((images, hits, held)): State<ServerState>,
    UrlPath(name): UrlPath<String>,
) -> Result<Bytes, StatusCode> {
    *hits.lock().unwrap().entry(name.clone()).or_default() += 1;
    let gate = held.lock().unwrap().get(&name).cloned();
    if let Some(mut gate) = gate {
        let _ = gate.wait_for(|released| *released).await;
    }
    images.lock().unwrap().get(&name).cloned().map(Bytes::from).ok_or(StatusCode::NOT_FOUND)
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// sshd on a free loopback port, accepting one generated client key, with the host key written to a known_hosts
/// file. Dropping it stops sshd.
pub struct Sshd {
    pub port: u16,
    pub dir: tempfile::TempDir,
    child: Child,
}

impl Sshd {
    pub fn start() -> Self {
        let dir = tempfile::Builder::new().prefix("egress-sshd-").tempdir().expect("temp dir");
        let keygen = |name: &str| {
            let status = Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-C", name, "-f"])
                .arg(dir.path().join(name))
                .status()
                .expect("ssh-keygen runs (install openssh-client)");
            assert!(status.success(), "ssh-keygen {name}");
        };
        keygen("host_key");
        keygen("client_key");
        keygen("other_host_key");
        std::fs::copy(dir.path().join("client_key.pub"), dir.path().join("authorized_keys")).expect("authorized_keys");
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("a free port").local_addr().expect("port").port();
        let known = |key: &str| {
            let public = std::fs::read_to_string(dir.path().join(format!("{key}.pub"))).expect("public key");
            let mut fields = public.split_whitespace();
            format!("[127.0.0.1]:{port} {} {}\n", fields.next().expect("type"), fields.next().expect("key"))
        };
        std::fs::write(dir.path().join("known_hosts"), known("host_key")).expect("known_hosts");
        std::fs::write(dir.path().join("wrong_known_hosts"), known("other_host_key")).expect("wrong known_hosts");
        std::fs::write(
            dir.path().join("sshd_config"),
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {host}\nAuthorizedKeysFile {keys}\nPermitRootLogin \
                 prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nStrictModes no\n\
                 UsePAM no\nPidFile {pid}\n",
                host = dir.path().join("host_key").display(),
                keys = dir.path().join("authorized_keys").display(),
                pid = dir.path().join("sshd.pid").display(),
            ),
        )
        .expect("sshd_config");
        // sshd's privilege separation directory.
        std::fs::create_dir_all("/run/sshd").expect("/run/sshd");
        let log = std::fs::File::create(dir.path().join("sshd.log")).expect("log");
        let child = Command::new("/usr/sbin/sshd")
            .args(["-D", "-e", "-f"])
            .arg(dir.path().join("sshd_config"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("sshd starts (install openssh-server)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err() {
            assert!(Instant::now() < deadline, "sshd did not listen: {}", Self::read_log(dir.path()));
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { port, dir, child }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn log(&self) -> String {
        Self::read_log(self.dir.path())
    }

    fn read_log(dir: &Path) -> String {
        std::fs::read_to_string(dir.join("sshd.log")).unwrap_or_default()
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
