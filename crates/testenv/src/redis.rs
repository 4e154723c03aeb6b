//! A real `redis-server` (Debian's) on a loopback address of its own, for the shared lease state's tests: in memory
//! only (no snapshot, no append-only file), so a restart starts it empty, as a lost Redis would come back.

use std::fs;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Result, bail};

use crate::process::shell_quote;
use crate::squid::{Wrapped, next_loopback_address, read_tail};

/// The `redis-server` binary, or an error naming how to install it.
pub fn redis_binary() -> Result<PathBuf> {
    for candidate in ["/usr/bin/redis-server", "/usr/sbin/redis-server"] {
        if Path::new(candidate).is_file() {
            return Ok(PathBuf::from(candidate));
        }
    }
    bail!(
        "redis-server is not installed: run `cargo xtask test` as root (it installs it) or `apt-get install redis-server`"
    )
}

/// A test Redis. Dropping it stops it and removes its files.
pub struct RedisServer {
    address: SocketAddr,
    password: Option<String>,
    process: Option<Wrapped>,
    dir: PathBuf,
}

impl RedisServer {
    /// Starts `redis-server` on a fresh `127.1.x.y:6379` and waits until it accepts connections; with `password`,
    /// clients must give it.
    pub async fn start(password: Option<&str>) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("egress-redis-").tempdir()?.keep();
        let address = SocketAddr::new(IpAddr::V4(next_loopback_address()), 6379);
        let mut server = Self { address, password: password.map(str::to_owned), process: None, dir };
        server.restart().await?;
        Ok(server)
    }

    /// `redis://` URL of the server, without the password.
    pub fn url(&self) -> String {
        format!("redis://{}/", self.address)
    }

    /// Its address.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Stops the server (SIGKILL, as a crash): clients see it gone until [`RedisServer::restart`].
    pub fn kill(&mut self) {
        if let Some(process) = self.process.take() {
            process.kill();
            process.stop();
        }
    }

    /// Starts the server again, empty, on the same address, and waits until it accepts connections.
    pub async fn restart(&mut self) -> Result<()> {
        self.kill();
        let binary = redis_binary()?;
        let log = self.dir.join("redis.log");
        let mut args = format!(
            "{} --bind {} --port {} --save '' --appendonly no --dir {} --protected-mode no",
            shell_quote(&binary.display().to_string()),
            self.address.ip(),
            self.address.port(),
            shell_quote(&self.dir.display().to_string()),
        );
        if let Some(password) = &self.password {
            args.push_str(&format!(" --requirepass {}", shell_quote(password)));
        }
        let process = Wrapped::spawn(&args, &log)?;
        let waited =
            crate::squid::wait_accepting("redis-server", self.address, &process, Duration::from_secs(10)).await;
        self.process = Some(process);
        if let Err(error) = waited {
            bail!("{error} on {}; its log ends:\n{}", self.address, read_tail(&log));
        }
        Ok(())
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = fs::remove_dir_all(&self.dir);
    }
}
