//! The real `egress-operator` binary as a child process, for the end-to-end suite and the quickstart.
//!
//! It runs under the same pipe-holding wrapper as Squid, so it dies with the process that started it; it can also
//! be killed with SIGKILL (a crash) or stopped with SIGTERM (a graceful shutdown) on purpose.

use std::fs;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

// Ports for the processes' listeners come from below the kernel's ephemeral range: a port that binding port 0 gave
// was taken meanwhile as the local port of an outgoing connection, and a gateway exited with "binding the metrics
// address ...: Address already in use" (CI).
use crate::control_plane::free_port;
use crate::process::{Janitor, shell_quote};
use crate::squid::{Wrapped, read_tail};

/// How the operator is started.
#[derive(Clone, Debug)]
pub struct OperatorOptions {
    /// The providers file's content.
    pub providers_yaml: String,
    /// `--cluster-id`.
    pub cluster_id: String,
    /// A token with the `lease` scope, written to the tokens file.
    pub lease_token: String,
    /// `--default-probe-url`.
    pub default_probe_url: String,
    /// `--leader-elect`, with the Lease in this namespace.
    pub leader_election_namespace: Option<String>,
    /// Extra flags.
    pub extra_args: Vec<String>,
    /// Extra environment variables (a provider's credentials).
    pub environment: Vec<(String, String)>,
}

/// A running operator.
pub struct OperatorProcess {
    process: Option<Wrapped>,
    dir: PathBuf,
    log: PathBuf,
    /// `http://127.0.0.1:<port>` of the discovery API.
    pub discovery_url: String,
    /// `http://127.0.0.1:<port>` of `/metrics`.
    pub metrics_url: String,
    /// `http://127.0.0.1:<port>` of `/livez` and `/readyz`.
    pub health_url: String,
    _janitor: Janitor,
}

impl OperatorProcess {
    /// Starts `binary` against the cluster of `kubeconfig` and waits until `/livez` answers.
    pub async fn start(binary: &Path, kubeconfig: &Path, options: &OperatorOptions) -> Result<Self> {
        if !binary.is_file() {
            bail!("{} does not exist: build it with `cargo build -p egress-operator`", binary.display());
        }
        let dir = tempfile::Builder::new().prefix("egress-operator-").tempdir()?.keep();
        let janitor = Janitor::spawn(&dir, "")?;
        let providers = dir.join("providers.yaml");
        fs::write(&providers, &options.providers_yaml)?;
        let tokens = dir.join("tokens");
        fs::write(&tokens, format!("lease {}\n", options.lease_token))?;
        let (discovery, metrics, health) = (free_port()?, free_port()?, free_port()?);
        let mut args = vec![
            format!("--providers-config={}", providers.display()),
            format!("--cluster-id={}", options.cluster_id),
            format!("--discovery-addr=127.0.0.1:{discovery}"),
            format!("--metrics-addr=127.0.0.1:{metrics}"),
            format!("--health-addr=127.0.0.1:{health}"),
            format!("--discovery-tokens={}", tokens.display()),
            format!("--default-probe-url={}", options.default_probe_url),
            "--gc-interval=10s".into(),
            "--provider-check-interval=10s".into(),
        ];
        if let Some(namespace) = &options.leader_election_namespace {
            args.push("--leader-elect".into());
            args.push(format!("--leader-election-namespace={namespace}"));
        }
        args.extend(options.extra_args.iter().cloned());
        let identity = format!("operator-{discovery}");
        let environment: String = options
            .environment
            .iter()
            .map(|(name, value)| format!("{}={} ", shell_quote(name), shell_quote(value)))
            .collect();
        let script = format!(
            "env {environment}KUBECONFIG={} POD_NAME={identity} RUST_LOG=${{RUST_LOG:-info,kube=warn}} {} {}",
            shell_quote(&kubeconfig.display().to_string()),
            shell_quote(&binary.display().to_string()),
            args.iter().map(|arg| shell_quote(arg)).collect::<Vec<_>>().join(" ")
        );
        let operator = Self {
            process: None,
            log: dir.join("operator.log"),
            dir,
            discovery_url: format!("http://127.0.0.1:{discovery}"),
            metrics_url: format!("http://127.0.0.1:{metrics}"),
            health_url: format!("http://127.0.0.1:{health}"),
            _janitor: janitor,
        };
        operator.launch(&script, "the operator").await
    }

    /// Runs `script` under the wrapper and waits until `/livez` answers.
    async fn launch(mut self, script: &str, what: &str) -> Result<Self> {
        self.process = Some(Wrapped::spawn(script, &self.log)?);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let mut poll = tokio::time::interval(Duration::from_millis(100));
        loop {
            poll.tick().await;
            if http_get(&format!("{}/livez", self.health_url)).await.is_ok_and(|(status, _)| status == 200) {
                return Ok(self);
            }
            if !self.alive() {
                bail!("{what} exited during start-up; its log ends with:\n{}", self.log_tail());
            }
            if tokio::time::Instant::now() > deadline {
                bail!("{what} did not answer /livez in time; its log ends with:\n{}", self.log_tail());
            }
        }
    }

    /// Whether the process still runs.
    pub fn alive(&self) -> bool {
        self.process.as_ref().is_some_and(Wrapped::alive)
    }

    /// The process ID.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(|process| process.pid)
    }

    /// The end of its log.
    pub fn log_tail(&self) -> String {
        read_tail(&self.log)
    }

    /// The whole log.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Kills it with SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(process) = self.process.take() {
            process.kill();
            process.stop();
        }
    }

    /// Sends SIGTERM and waits up to `timeout` for a graceful exit; returns whether it exited in time.
    pub async fn terminate(&mut self, timeout: Duration) -> bool {
        let Some(pid) = self.pid() else { return true };
        let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
        let deadline = tokio::time::Instant::now() + timeout;
        let mut poll = tokio::time::interval(Duration::from_millis(100));
        while self.alive() {
            poll.tick().await;
            if tokio::time::Instant::now() > deadline {
                return false;
            }
        }
        if let Some(process) = self.process.take() {
            process.stop();
        }
        true
    }
}

impl Drop for OperatorProcess {
    fn drop(&mut self) {
        if let Some(process) = self.process.take() {
            process.stop();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A running `egress-operator gateway`, leasing from a discovery API.
pub struct GatewayProcess {
    /// The process (its `discovery_url` is the API the gateway leases from; metrics and health are its own).
    pub process: OperatorProcess,
    /// Where crawlers connect.
    pub address: SocketAddr,
}

impl GatewayProcess {
    /// Starts `binary gateway` on a free loopback port, leasing from `discovery_url`, with `lease_token` its one
    /// token, and `extra_args`; waits until `/livez` answers.
    pub async fn start(binary: &Path, discovery_url: &str, lease_token: &str, extra_args: &[String]) -> Result<Self> {
        if !binary.is_file() {
            bail!("{} does not exist: build it with `cargo build -p egress-operator`", binary.display());
        }
        let dir = tempfile::Builder::new().prefix("egress-gateway-").tempdir()?.keep();
        let janitor = Janitor::spawn(&dir, "")?;
        let tokens = dir.join("tokens");
        fs::write(&tokens, format!("lease {lease_token}\n"))?;
        let (listen, metrics, health) = (free_port()?, free_port()?, free_port()?);
        let mut args = vec![
            "gateway".to_owned(),
            format!("--listen-addr=127.0.0.1:{listen}"),
            format!("--metrics-addr=127.0.0.1:{metrics}"),
            format!("--health-addr=127.0.0.1:{health}"),
            format!("--discovery-url={discovery_url}"),
            format!("--discovery-tokens={}", tokens.display()),
        ];
        args.extend(extra_args.iter().cloned());
        let script = format!(
            "env RUST_LOG=${{RUST_LOG:-info}} {} {}",
            shell_quote(&binary.display().to_string()),
            args.iter().map(|arg| shell_quote(arg)).collect::<Vec<_>>().join(" ")
        );
        let process = OperatorProcess {
            process: None,
            log: dir.join("gateway.log"),
            dir,
            discovery_url: discovery_url.to_owned(),
            metrics_url: format!("http://127.0.0.1:{metrics}"),
            health_url: format!("http://127.0.0.1:{health}"),
            _janitor: janitor,
        };
        let process = process.launch(&script, "the gateway").await?;
        Ok(Self { process, address: SocketAddr::from((Ipv4Addr::LOCALHOST, listen)) })
    }

    /// `http://<user>:<token>@127.0.0.1:<port>`: the proxy URL a crawler sets.
    pub fn proxy_url(&self, user: &str, token: &str) -> String {
        format!("http://{user}:{token}@{}", self.address)
    }
}

/// A chunked body's content (RFC 9112, 7.1): each chunk's size line (extensions ignored), then its bytes, until the
/// last chunk.
fn dechunk(mut body: &str) -> Option<String> {
    let mut content = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(content);
        }
        content.push_str(rest.get(..size)?);
        body = rest.get(size..)?.strip_prefix("\r\n")?;
    }
}

/// A plain HTTP/1.1 GET of `url` (`http://host:port/path`); returns the status and the body (a chunked one decoded:
/// Prometheus's API sends larger answers chunked).
pub async fn http_get(url: &str) -> Result<(u16, String)> {
    let uri: http::Uri = url.parse().with_context(|| format!("{url:?} is not a URL"))?;
    anyhow::ensure!(uri.scheme_str() == Some("http"), "only http:// URLs: {url}");
    let authority = uri.authority().context("the URL has no host")?.as_str();
    let path = uri.path_and_query().map_or("/", http::uri::PathAndQuery::as_str);
    let address: SocketAddr = authority.parse().context("the URL's host must be an IP address and port")?;
    let exchange = async {
        let mut stream = TcpStream::connect(address).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n").as_bytes())
            .await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        let text = String::from_utf8_lossy(&response).into_owned();
        let status = text.split_whitespace().nth(1).context("no status line")?.parse::<u16>()?;
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((text.as_str(), ""));
        let chunked =
            head.lines().any(|line| line.to_ascii_lowercase().replace(' ', "") == "transfer-encoding:chunked");
        let body = if chunked { dechunk(body).context("a malformed chunked body")? } else { body.to_owned() };
        anyhow::Ok((status, body))
    };
    tokio::time::timeout(Duration::from_secs(10), exchange).await.context("the request timed out")?
}

#[cfg(test)]
mod chunked_tests {
    #[test]
    fn a_chunked_body_is_decoded() {
        assert_eq!(super::dechunk("5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n").as_deref(), Some("hello, world"));
        assert_eq!(super::dechunk("5\r\nhel"), None, "cut short");
        assert_eq!(super::dechunk("x\r\n"), None, "not a size");
    }
}
