//! Real Squid processes for tests: the wrapper that guarantees they die with the test process, and a standalone
//! Squid with the options health tests need (credentials, CONNECT denied).

use std::fs;
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Result, bail};
use sha_crypt::{PasswordHasher, ShaCrypt};

use crate::process::Janitor;

/// How long Squid may take to accept connections.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Loopback addresses handed out in this process, `127.1.0.1` upwards, never reused (so a stale probe of a stopped
/// proxy cannot reach a new one).
static NEXT_ADDRESS: AtomicU32 = AtomicU32::new(1);

/// A loopback address of its own for one proxy.
pub fn next_loopback_address() -> Ipv4Addr {
    let n = NEXT_ADDRESS.fetch_add(1, Ordering::SeqCst);
    Ipv4Addr::new(127, 1, (n >> 8) as u8, (n & 0xff) as u8)
}

/// Names the pod network a test run has: an IPv4 network (`10.244.0.0/16`) on an interface of a network namespace
/// that `cargo xtask test` creates and runs the tests in (see [`pod_network`]).
pub const POD_NETWORK_ENV: &str = "EGRESS_TEST_POD_NETWORK";

/// The pod network of this test run, when [`POD_NETWORK_ENV`] names one: its first address (the interface's own)
/// and its prefix length.
///
/// # Panics
/// When the variable is set but is not an IPv4 network of /16 to /24.
pub fn pod_network() -> Option<(Ipv4Addr, u8)> {
    let value = std::env::var(POD_NETWORK_ENV).ok().filter(|value| !value.is_empty())?;
    let parsed = value
        .parse::<ipnet::Ipv4Net>()
        .ok()
        .filter(|network| (16..=24).contains(&network.prefix_len()))
        .map(|network| (network.addr(), network.prefix_len()));
    Some(parsed.unwrap_or_else(|| panic!("{POD_NETWORK_ENV}={value:?} is not an IPv4 network of /16 to /24")))
}

/// An address of its own for one pod: from the pod network when the run has one (EndpointSlices refuse loopback
/// addresses), else a loopback address. Never reused within a process.
pub fn next_pod_address() -> Ipv4Addr {
    match pod_network() {
        None => next_loopback_address(),
        Some((network, prefix)) => {
            let n = NEXT_ADDRESS.fetch_add(1, Ordering::SeqCst);
            let size = 1u32 << (32 - u32::from(prefix));
            // Skip the network address and the interface's own (.1), and stay below the last host address (kept
            // for `client_address`) and the broadcast address.
            let offset = 2 + (n - 1) % (size - 4);
            Ipv4Addr::from((u32::from(network) & !(size - 1)) + offset)
        }
    }
}

/// The pod network's last host address, never handed to a pod: a socket bound to it connects as a client of its
/// own, apart from everything else in the run (which connects from the interface's address). `None` without a pod
/// network.
pub fn client_address() -> Option<Ipv4Addr> {
    let (network, prefix) = pod_network()?;
    let size = 1u32 << (32 - u32::from(prefix));
    // Not the broadcast address: a socket bound to that one connects from the interface's address.
    Some(Ipv4Addr::from((u32::from(network) & !(size - 1)) + size - 2))
}

/// The Squid binary, or an error naming how to install it.
pub fn squid_binary() -> Result<PathBuf> {
    for candidate in ["/usr/sbin/squid", "/usr/bin/squid"] {
        if Path::new(candidate).is_file() {
            return Ok(PathBuf::from(candidate));
        }
    }
    bail!("squid is not installed: run `cargo xtask test` as root (it installs it) or `apt-get install squid`")
}

/// A command running under a `sh` wrapper that kills it when a pipe from this process closes: on [`Wrapped::stop`],
/// on drop, or when this process dies in any way. The node agent's container process, without its exit code.
pub(crate) struct Wrapped {
    /// The wrapped command's process ID.
    pub pid: u32,
    inner: crate::process::Process,
}

impl Wrapped {
    /// Runs `script` (a shell command line) with its output appended to `log`.
    pub(crate) fn spawn(script: &str, log: &Path) -> Result<Self> {
        let inner = crate::process::Process::spawn(script, log, &log.with_extension("exit"))?;
        Ok(Self { pid: inner.pid, inner })
    }

    /// Whether the wrapped process still runs.
    pub(crate) fn alive(&self) -> bool {
        Path::new(&format!("/proc/{}", self.pid)).exists()
    }

    /// Kills the wrapped process with SIGKILL, as a crash would.
    pub(crate) fn kill(&self) -> bool {
        self.inner.signal("KILL")
    }

    /// Stops the wrapped process (SIGTERM, then SIGKILL after two seconds) and waits for the wrapper.
    pub(crate) fn stop(self) {
        drop(self.inner);
    }
}

/// Waits until `address` accepts TCP connections; fails early if the process `wrapped` (`what`) exits.
pub(crate) async fn wait_accepting(
    what: &str,
    address: SocketAddr,
    wrapped: &Wrapped,
    timeout: Duration,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut poll = tokio::time::interval(Duration::from_millis(50));
    loop {
        poll.tick().await;
        if tokio::net::TcpStream::connect(address).await.is_ok() {
            return Ok(());
        }
        if !wrapped.alive() {
            return Err(format!("{what} exited"));
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("{what} did not accept connections in time"));
        }
    }
}

/// The last lines of a log file.
pub(crate) fn read_tail(path: &Path) -> String {
    let mut text = String::new();
    if let Ok(mut file) = fs::File::open(path) {
        let _ = file.read_to_string(&mut text);
    }
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n") + "\n"
}

/// Options of a standalone test Squid.
#[derive(Clone, Debug, Default)]
pub struct SquidOptions {
    /// Require these basic credentials.
    pub credentials: Option<(String, String)>,
    /// Refuse every CONNECT (403), to test the CONNECT-status failure.
    pub deny_connect: bool,
    /// Send every request through this parent Squid instead of to the origin (a chain of two proxies, the usual
    /// hand-made gateway, for benchmarks). Each test Squid names itself after its address, so the parent does not
    /// take the chain for a forwarding loop.
    pub parent: Option<SocketAddr>,
    /// Run Squid on these CPUs only (a `taskset -c` list such as `0`), for benchmarks that give it a core of its own.
    pub cpus: Option<String>,
    /// Listen on (and send from) this loopback address instead of a fresh one: for an address another component
    /// chose, such as the private address moto gives an EC2 instance in a VPC on 127.0.0.0/16.
    pub address: Option<Ipv4Addr>,
}

/// A standalone Squid on its own loopback address. Dropping it stops it and removes its files.
pub struct Squid {
    address: SocketAddr,
    process: Option<Wrapped>,
    dir: PathBuf,
    service: String,
    _janitor: Janitor,
}

impl Squid {
    /// Starts Squid on a fresh `127.1.x.y:3128` and waits until it accepts connections. It reaches origins from that
    /// address too, so origins (and the health engine's egress IP) tell two test Squids apart.
    pub async fn start(options: SquidOptions) -> Result<Self> {
        let binary = squid_binary()?;
        let ip = match options.address {
            Some(ip) if ip.is_loopback() => ip,
            Some(ip) => bail!("{ip} is not a loopback address: test Squids listen on loopback only"),
            None => next_loopback_address(),
        };
        let address = SocketAddr::new(IpAddr::V4(ip), 3128);
        let dir = tempfile::Builder::new().prefix("egress-squid-").tempdir()?.keep();
        // Squid drops privileges to the `proxy` user, which writes its runtime files here.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777))?;
        let runtime = dir.display();
        let mut conf = format!(
            "http_port {address}\nvisible_hostname egress-test-squid-{ip}\nacl clients src 127.0.0.0/8\n\
             access_log stdio:{runtime}/access.log\ncache_log {runtime}/cache.log\npid_filename {runtime}/squid.pid\n\
             coredump_dir {runtime}\nnetdb_filename none\npinger_enable off\ncache deny all\nshutdown_lifetime 1 seconds\n\
             tcp_outgoing_address {ip}\n"
        );
        if options.deny_connect {
            conf.push_str("http_access deny CONNECT\n");
        }
        if let Some(parent) = options.parent {
            conf.push_str(&format!(
                "cache_peer {} parent {} 0 no-query no-digest default\nnever_direct allow all\n",
                parent.ip(),
                parent.port()
            ));
        }
        if let Some((user, password)) = &options.credentials {
            // At most 12 salt bytes: they become 16 crypt characters, the most glibc's SHA-crypt reads.
            let hash = ShaCrypt::SHA512
                .hash_password_with_salt(password.as_bytes(), b"egress-salt1")
                .map_err(|error| anyhow::anyhow!("hashing the test password: {error}"))?;
            let passwd = dir.join("passwd");
            fs::write(&passwd, format!("{user}:{hash}\n"))?;
            fs::set_permissions(&passwd, fs::Permissions::from_mode(0o644))?;
            conf.push_str(&format!(
                "auth_param basic program /usr/lib/squid/basic_ncsa_auth {}\nauth_param basic children 2 startup=1 idle=1\n\
                 acl authenticated proxy_auth REQUIRED\nhttp_access deny !clients\nhttp_access allow authenticated\n",
                passwd.display()
            ));
        } else {
            conf.push_str("http_access allow clients\n");
        }
        conf.push_str("http_access deny all\n");
        let conf_path = dir.join("squid.conf");
        fs::write(&conf_path, conf)?;
        fs::set_permissions(&conf_path, fs::Permissions::from_mode(0o644))?;
        let log = dir.join("output.log");
        let service = service_name(&dir);
        let janitor = Janitor::spawn(&dir, &format!("{service}-"))?;
        let pinned = match &options.cpus {
            Some(cpus)
                if !cpus.is_empty() && cpus.bytes().all(|byte| byte.is_ascii_digit() || b",-".contains(&byte)) =>
            {
                format!("taskset -c {cpus} ")
            }
            Some(cpus) => bail!("{cpus:?} is not a CPU list such as 0 or 0-1,3"),
            None => String::new(),
        };
        let process = Wrapped::spawn(
            &format!("{pinned}'{}' -N -n '{service}' -f '{}'", binary.display(), conf_path.display()),
            &log,
        )?;
        if let Err(why) = wait_accepting("Squid", address, &process, START_TIMEOUT).await {
            let output = read_tail(&log) + &read_tail(&dir.join("cache.log"));
            bail!("{why}; its output ends with:\n{output}");
        }
        Ok(Self { address, process: Some(process), dir, service, _janitor: janitor })
    }

    /// Where it listens.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Kills Squid with SIGKILL, as a crash would, and waits until it is gone.
    pub fn kill(&mut self) {
        if let Some(process) = self.process.take() {
            process.kill();
            process.stop();
        }
    }
}

impl Drop for Squid {
    fn drop(&mut self) {
        if let Some(process) = self.process.take() {
            process.stop();
        }
        let _ = fs::remove_dir_all(&self.dir);
        remove_shared_memory(&self.service);
    }
}

/// A Squid service name (`-n`) of its own, from the Squid's temp directory. Squid names its shared-memory segments
/// after the service (`/squid-cf__metadata.shm` by default), so two test Squids starting at once could otherwise
/// refuse each other with "File exists".
pub(crate) fn service_name(dir: &Path) -> String {
    dir.file_name()
        .map(|name| name.to_string_lossy().chars().filter(char::is_ascii_alphanumeric).collect())
        .unwrap_or_default()
}

/// Removes the shared-memory segments of Squid service `service`, which a killed Squid leaves behind.
pub(crate) fn remove_shared_memory(service: &str) {
    if service.is_empty() {
        return;
    }
    if let Ok(entries) = fs::read_dir("/dev/shm") {
        let prefix = format!("{service}-");
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
}
