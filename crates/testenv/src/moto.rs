//! moto's EC2 and STS emulator (`python -m moto.server`, from the venv `cargo xtask test` makes of
//! `xtask/moto-requirements.lock` and names in `EGRESS_MOTO_PYTHON`) on a loopback address of its own, for the aws
//! provider's tests. Its state lives in the process: each server starts empty.

use std::fs;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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

    /// A VPC of `vpc_cidr` with one subnet of `subnet_cidr` in it, made through moto's EC2 API (unsigned: moto checks
    /// no signature until told to), in `us-east-1`; returns their IDs. A VPC on 127.0.0.0/16 gives instances loopback
    /// addresses, where a test's Squid can stand in for them.
    pub async fn vpc_with_subnet(&self, vpc_cidr: &str, subnet_cidr: &str) -> Result<(String, String)> {
        let answer = self.ec2(&format!("Action=CreateVpc&CidrBlock={}", vpc_cidr.replace('/', "%2F"))).await?;
        let vpc = first_element(&answer, "vpcId")?;
        let answer =
            self.ec2(&format!("Action=CreateSubnet&VpcId={vpc}&CidrBlock={}", subnet_cidr.replace('/', "%2F"))).await?;
        Ok((vpc, first_element(&answer, "subnetId")?))
    }

    /// One EC2 Query call; its answer's body.
    async fn ec2(&self, query: &str) -> Result<String> {
        let body = format!("{query}&Version=2016-11-15");
        let request = format!(
            "POST / HTTP/1.1\r\nHost: {}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\
             Authorization: AWS4-HMAC-SHA256 Credential=AKIDMOTOTEST/20260101/us-east-1/ec2/aws4_request, \
             SignedHeaders=host, Signature=0\r\nConnection: close\r\n\r\n{body}",
            self.address,
            body.len()
        );
        let exchange = async {
            let mut stream = TcpStream::connect(self.address).await?;
            stream.write_all(request.as_bytes()).await?;
            let mut answer = Vec::new();
            stream.read_to_end(&mut answer).await?;
            anyhow::Ok(String::from_utf8_lossy(&answer).into_owned())
        };
        let answer = tokio::time::timeout(Duration::from_secs(10), exchange).await.context("moto did not answer")??;
        if !answer.starts_with("HTTP/1.1 200") && !answer.starts_with("HTTP/1.0 200") {
            bail!("moto refused {query}: {answer}");
        }
        Ok(answer)
    }

    /// The last lines of its request log.
    pub fn log_tail(&self) -> String {
        read_tail(&self.dir.join("moto.log"))
    }
}

/// The text of the first `<tag>` in `xml`.
fn first_element(xml: &str, tag: &str) -> Result<String> {
    let open = format!("<{tag}>");
    let start = xml.find(&open).with_context(|| format!("no {tag} in {xml}"))? + open.len();
    Ok(xml[start..].split('<').next().unwrap_or_default().to_owned())
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        if let Some(process) = self.process.take() {
            process.stop();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}
