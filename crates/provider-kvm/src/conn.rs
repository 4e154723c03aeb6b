//! One libvirt connection per host: dialled lazily, redialled after a drop, kept alive, bounded by a handshake
//! deadline, and every call logged at debug with its name, identifiers, duration and libvirt error code.
//!
//! libvirt's calls block, so each runs on Tokio's blocking pool. A connection is moved into the blocking task for
//! the call and put back afterwards; a call that fails because the connection is gone (or times out) leaves the
//! slot empty, so the next call dials again. Calls to one host are therefore serialised, which libvirt's remote
//! driver would largely do anyway; long transfers (image uploads) dial a connection of their own.

use std::path::PathBuf;
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use egress_provider::ProviderError;
use tokio::sync::Mutex;
use virt::connect::Connect;
use virt::error::ErrorNumber;

use crate::classify;
use crate::config::{KvmHost, KvmSsh};

/// How long dialling (TCP, SSH handshake, authentication, libvirt's hello) may take.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(20);
/// How long one ordinary call may take once connected.
pub const CALL_DEADLINE: Duration = Duration::from_secs(60);
/// Keepalive: a probe every 5 s, the connection declared dead after 3 unanswered ones.
const KEEPALIVE_INTERVAL: i32 = 5;
const KEEPALIVE_COUNT: u32 = 3;

/// A connection that closes when dropped: on a blocking thread when dropped inside the Tokio runtime, since closing
/// a remote connection is a round trip.
pub struct Live(Option<Connect>);

impl Live {
    fn new(connect: Connect) -> Self {
        Self(Some(connect))
    }

    /// The libvirt connection.
    pub fn connect(&self) -> &Connect {
        self.0.as_ref().expect("a live connection until dropped")
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        if let Some(mut connect) = self.0.take() {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn_blocking(move || {
                        let _ = connect.close();
                    });
                }
                Err(_) => {
                    let _ = connect.close();
                }
            }
        }
    }
}

/// How to reach one host, and its pooled connection.
pub struct Host {
    /// The key `placement.zone` uses.
    pub name: String,
    /// The storage pool for images and disks.
    pub pool: String,
    /// The bridge guests attach to.
    pub bridge: String,
    uri: String,
    /// Files that must exist before dialling over SSH (read by libvirt at each dial, so a Secret mounted after
    /// start is picked up).
    ssh_files: Vec<(&'static str, PathBuf)>,
    slot: Mutex<Option<Live>>,
}

impl Host {
    /// The host as configured; nothing is dialled yet.
    pub fn new(host: &KvmHost, ssh: &KvmSsh) -> Self {
        let (uri, ssh_files) = match &host.uri {
            Some(uri) => (uri.clone(), Vec::new()),
            None => (
                ssh_uri(host, ssh),
                vec![
                    ("ssh.privateKeyFile", ssh.private_key_file.clone()),
                    ("ssh.knownHostsFile", ssh.known_hosts_file.clone()),
                ],
            ),
        };
        Self {
            name: host.name.clone(),
            pool: host.pool.clone(),
            bridge: host.bridge.clone(),
            uri,
            ssh_files,
            slot: Mutex::new(None),
        }
    }

    /// The URI this host is dialled with.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// Whether this host is libvirt's test driver, which runs only `type="test"` domains and cannot upload.
    pub fn is_test_driver(&self) -> bool {
        self.uri.starts_with("test:")
    }

    /// Runs `call` on this host's connection, dialling first when there is none. `op` and `ids` name the call in
    /// the debug log.
    pub async fn call<T, F>(self: &Arc<Self>, op: &'static str, ids: &str, call: F) -> Result<T, ProviderError>
    where
        T: Send + 'static,
        F: FnOnce(&Connect) -> Result<T, virt::error::Error> + Send + 'static,
    {
        let mut slot = self.slot.lock().await;
        let live = match slot.take() {
            // A connection whose peer went away (noticed by the event loop or a failed keepalive) is not used.
            Some(live) if live.connect().is_alive().unwrap_or(false) => live,
            Some(_) => {
                tracing::debug!(host = %self.name, "the libvirt connection was lost; dialling again");
                self.dial().await?
            }
            None => self.dial().await?,
        };
        let started = Instant::now();
        let task = tokio::task::spawn_blocking(move || {
            let result = call(live.connect());
            (live, result)
        });
        let outcome = tokio::time::timeout(CALL_DEADLINE, task).await;
        let elapsed = started.elapsed();
        match outcome {
            Ok(Ok((live, Ok(value)))) => {
                tracing::debug!(host = %self.name, call = op, ids, duration_ms = elapsed.as_millis(), "libvirt call");
                *slot = Some(live);
                Ok(value)
            }
            Ok(Ok((live, Err(error)))) => {
                tracing::debug!(
                    host = %self.name,
                    call = op,
                    ids,
                    duration_ms = elapsed.as_millis(),
                    code = ?error.code(),
                    error = error.message(),
                    "libvirt call failed"
                );
                if !connection_lost(&error) && live.connect().is_alive().unwrap_or(false) {
                    *slot = Some(live);
                }
                Err(classify::classify(&error, op, &self.name, ids))
            }
            Ok(Err(join)) => {
                Err(ProviderError::transient(format!("libvirt call {op} on host {} panicked", self.name))
                    .with_source(join))
            }
            Err(_) => {
                tracing::debug!(host = %self.name, call = op, ids, "libvirt call timed out; the connection is dropped");
                Err(ProviderError::transient(format!(
                    "libvirt call {op} on host {} did not finish within {CALL_DEADLINE:?}",
                    self.name
                )))
            }
        }
    }

    /// A connection of its own, for a long transfer that must not hold up the host's other calls.
    pub async fn dial(&self) -> Result<Live, ProviderError> {
        for (key, path) in &self.ssh_files {
            if !path.is_file() {
                return Err(ProviderError::transient(format!(
                    "{key} {} does not exist (yet): host {} cannot be dialled until it does",
                    path.display(),
                    self.name
                )));
            }
        }
        start_event_loop();
        let uri = self.uri.clone();
        let name = self.name.clone();
        let started = Instant::now();
        let task = tokio::task::spawn_blocking(move || Connect::open(Some(&uri)).map(Live::new));
        match tokio::time::timeout(HANDSHAKE_DEADLINE, task).await {
            Ok(Ok(Ok(live))) => {
                // Keepalives need the event loop; drivers without them (test, local) refuse, which is fine.
                let keepalive = live.connect().set_keep_alive(KEEPALIVE_INTERVAL, KEEPALIVE_COUNT);
                tracing::debug!(
                    host = %name,
                    duration_ms = started.elapsed().as_millis(),
                    keepalive = keepalive.is_ok(),
                    "libvirt connection opened"
                );
                Ok(live)
            }
            Ok(Ok(Err(error))) => {
                tracing::debug!(host = %name, code = ?error.code(), error = error.message(), "libvirt dial failed");
                Err(classify::dial_error(&error, &name))
            }
            Ok(Err(join)) => Err(ProviderError::transient(format!("dialling host {name} panicked")).with_source(join)),
            Err(_) => Err(ProviderError::transient(format!(
                "host {name} did not complete the libvirt handshake within {HANDSHAKE_DEADLINE:?}"
            ))),
        }
    }

    /// Drops the pooled connection (the next call dials again).
    pub async fn forget(&self) {
        self.slot.lock().await.take();
    }
}

/// Whether an error means the connection itself is unusable.
fn connection_lost(error: &virt::error::Error) -> bool {
    matches!(
        error.code(),
        ErrorNumber::NoConnect | ErrorNumber::Rpc | ErrorNumber::SystemError | ErrorNumber::InvalidConn
    )
}

/// `qemu+libssh2://user@address:port/system?keyfile=…&known_hosts=…&known_hosts_verify=normal&sshauth=privkey`,
/// with `socket=` when the host's daemon listens elsewhere. `normal` refuses an unknown or changed host key.
pub fn ssh_uri(host: &KvmHost, ssh: &KvmSsh) -> String {
    let user = host.user.as_deref().unwrap_or(&ssh.user);
    let address = if host.address.contains(':') { format!("[{}]", host.address) } else { host.address.clone() };
    let mut uri = format!(
        "qemu+libssh2://{}@{address}:{}/system?keyfile={}&known_hosts={}&known_hosts_verify=normal&sshauth=privkey",
        encode(user),
        host.port,
        encode(&ssh.private_key_file.display().to_string()),
        encode(&ssh.known_hosts_file.display().to_string()),
    );
    if let Some(socket) = &host.socket {
        uri.push_str("&socket=");
        uri.push_str(&encode(socket));
        // A daemon on a non-default socket is reached through netcat on the host.
        uri.push_str("&proxy=netcat");
    }
    uri
}

/// Everything but RFC 3986's unreserved characters and `/`, which a URI path carries as they are.
const PATH: &percent_encoding::AsciiSet =
    &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~').remove(b'/');

/// Percent-encodes everything but unreserved characters and `/`.
fn encode(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, PATH).to_string()
}

/// Registers libvirt's default event loop and runs it on a thread of its own, once per process: keepalives and
/// stream events need it.
fn start_event_loop() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // libvirt prints every error to stderr by default; the provider reports them itself.
        virt::error::clear_error_callback();
        if let Err(error) = virt::event::event_register_default_impl() {
            tracing::warn!(error = error.message(), "libvirt's event loop could not be registered; no keepalives");
            return;
        }
        let spawned = std::thread::Builder::new().name("libvirt-events".into()).spawn(|| {
            loop {
                if virt::event::event_run_default_impl().is_err() {
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        });
        if let Err(error) = spawned {
            tracing::warn!(%error, "libvirt's event loop thread could not start; no keepalives");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> KvmHost {
        KvmHost {
            name: "rack1".into(),
            address: "192.0.2.10".into(),
            port: 2222,
            user: None,
            pool: "default".into(),
            bridge: "br0".into(),
            socket: None,
            uri: None,
        }
    }

    fn ssh() -> KvmSsh {
        KvmSsh {
            user: "root".into(),
            private_key_file: "/keys/id ed25519".into(),
            known_hosts_file: "/keys/known_hosts".into(),
        }
    }

    #[test]
    fn the_ssh_uri_verifies_host_keys_and_encodes_paths() {
        assert_eq!(
            ssh_uri(&host(), &ssh()),
            "qemu+libssh2://root@192.0.2.10:2222/system?keyfile=/keys/id%20ed25519&known_hosts=/keys/known_hosts\
             &known_hosts_verify=normal&sshauth=privkey"
        );
        let mut other = host();
        other.address = "2001:db8::1".into();
        other.user = Some("virt".into());
        other.socket = Some("/run/egress/libvirt-sock".into());
        let uri = ssh_uri(&other, &ssh());
        assert!(uri.starts_with("qemu+libssh2://virt@[2001:db8::1]:2222/system?"), "{uri}");
        assert!(uri.ends_with("&socket=/run/egress/libvirt-sock&proxy=netcat"), "{uri}");
    }

    #[test]
    fn a_local_uri_needs_no_ssh_files() {
        let mut local = host();
        local.uri = Some("test:///default".into());
        let host = Host::new(&local, &ssh());
        assert_eq!(host.uri(), "test:///default");
        assert!(host.ssh_files.is_empty());
    }
}
