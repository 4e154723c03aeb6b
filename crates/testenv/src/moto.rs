//! moto's EC2 and STS emulator (`python -m moto.server`, from the venv `cargo xtask test` makes of
//! `xtask/moto-requirements.lock` and names in `EGRESS_MOTO_PYTHON`) on a loopback address of its own, for the aws
//! provider's tests. Its state lives in the process: each server starts empty.

use std::fs;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::process::shell_quote;
use crate::squid::{Wrapped, next_loopback_address, read_tail, wait_accepting};

/// The moto venv's interpreter, or an error naming how to get it.
pub fn moto_python() -> Result<PathBuf> {
    match std::env::var_os("EGRESS_MOTO_PYTHON") {
        Some(path) if PathBuf::from(&path).is_file() => Ok(path.into()),
        Some(path) => bail!("EGRESS_MOTO_PYTHON names {}, which is not a file", PathBuf::from(path).display()),
        None => bail!(
            "EGRESS_MOTO_PYTHON is not set: run this through `cargo xtask test`, which makes the moto venv from \
             xtask/moto-requirements.lock"
        ),
    }
}

/// A running moto server. Dropping it stops it and removes its log.
pub struct MotoServer {
    address: SocketAddr,
    process: Option<Wrapped>,
    dir: PathBuf,
}

impl MotoServer {
    /// Starts `moto.server` on a fresh `127.1.x.y:5000` and waits until it accepts connections.
    pub async fn start() -> Result<Self> {
        let python = moto_python()?;
        let dir = tempfile::Builder::new().prefix("egress-moto-").tempdir()?.keep();
        let address = SocketAddr::new(IpAddr::V4(next_loopback_address()), 5000);
        let log = dir.join("moto.log");
        let script = format!(
            "{} -m moto.server -H {} -p {}",
            shell_quote(&python.display().to_string()),
            address.ip(),
            address.port()
        );
        let process = Wrapped::spawn(&script, &log).context("starting moto")?;
        let waited = wait_accepting("moto", address, &process, Duration::from_secs(30)).await;
        let server = Self { address, process: Some(process), dir };
        if let Err(error) = waited {
            bail!("{error} on {}; its log ends:\n{}", server.address, read_tail(&log));
        }
        Ok(server)
    }

    /// The endpoint URL (`http://127.1.x.y:5000`).
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// The last lines of its request log.
    pub fn log_tail(&self) -> String {
        read_tail(&self.dir.join("moto.log"))
    }
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        if let Some(process) = self.process.take() {
            process.stop();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}
