//! Command-line flags (each with an environment fallback) and their validation into [`Settings`].
//!
//! Every problem is collected and reported at once, together with the providers file's own problems, before
//! anything starts.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

pub use crate::durations::parse_duration;
use egress_provider::config::ProvidersConfig;

pub use crate::telemetry::LogFormat;

/// The egress-operator: runs HTTP forward proxies for web crawlers as `Proxy` objects.
///
/// Without a subcommand it runs the operator; `egress-operator gateway` runs the gateway.
#[derive(Parser, Debug)]
#[command(
    name = "egress-operator",
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("EGRESS_GIT_COMMIT"), ")"),
    subcommand_negates_reqs = true
)]
pub struct Cli {
    /// What to run instead of the operator.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// The providers config file (YAML).
    #[arg(long, env = "EGRESS_PROVIDERS_CONFIG", required = true)]
    pub providers_config: Option<PathBuf>,
    /// This installation's identifier, written on every instance (a label value: letters, digits, '-', '_', '.').
    #[arg(long, env = "EGRESS_CLUSTER_ID", required = true)]
    pub cluster_id: Option<String>,
    /// Where the discovery API listens.
    #[arg(long, env = "EGRESS_DISCOVERY_ADDR", default_value = "0.0.0.0:8090")]
    pub discovery_addr: String,
    /// Where `/metrics` is served.
    #[arg(long, env = "EGRESS_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    pub metrics_addr: String,
    /// Where `/livez` and `/readyz` are served.
    #[arg(long, env = "EGRESS_HEALTH_ADDR", default_value = "0.0.0.0:8081")]
    pub health_addr: String,
    /// Elect a leader through a `coordination.k8s.io` Lease; only the leader reconciles, probes and serves leases.
    #[arg(long, env = "EGRESS_LEADER_ELECT", default_value_t = false)]
    pub leader_elect: bool,
    /// The namespace of the leader-election Lease (default: the pod's namespace from POD_NAMESPACE, else `default`).
    #[arg(long, env = "EGRESS_LEADER_ELECTION_NAMESPACE")]
    pub leader_election_namespace: Option<String>,
    /// How long the leader Lease is valid after each renewal (renewed every third of it). A crashed leader is
    /// replaced about this long after its last renewal; shorter means faster takeover but more writes to the
    /// apiserver, and a leader cut off from the apiserver for two thirds of it steps down.
    #[arg(long, env = "EGRESS_LEADER_ELECTION_LEASE_DURATION", default_value = "15s")]
    pub leader_election_lease_duration: String,
    /// On SIGTERM the leader keeps serving until another replica (a pod matching `--peer-selector` in its namespace)
    /// is Ready, then hands the Lease over; it waits at most this long (`0`: hand over at once).
    #[arg(long, env = "EGRESS_HANDOFF_TIMEOUT", default_value = "20s")]
    pub handoff_timeout: String,
    /// The label selector of this Deployment's pods, which a stopping leader looks among for a successor.
    #[arg(long, env = "EGRESS_PEER_SELECTOR", default_value = "app.kubernetes.io/name=egress-operator")]
    pub peer_selector: String,
    /// The discovery tokens file (`read <token>` / `lease <token>` lines); required unless `--discovery-auth=none`.
    #[arg(long, env = "EGRESS_DISCOVERY_TOKENS")]
    pub discovery_tokens: Option<PathBuf>,
    /// The Secret (in the leader-election namespace) holding the key lease IDs are signed with, created with a
    /// random key on first start. Every replica reads the same one, so leases survive a restart and a failover.
    #[arg(long, env = "EGRESS_LEASE_KEY_SECRET", default_value = "egress-operator-lease-key")]
    pub lease_key_secret: String,
    /// Where leases, sessions and cooldowns live: `memory` (this process; only the leader serves discovery) or a
    /// Valkey/Redis URL (`redis://host:6379/0`, `rediss://` for TLS) that every replica shares, each then serving.
    #[arg(long, env = "EGRESS_STATE_STORE", default_value = "memory")]
    pub state_store: String,
    /// A file holding the state store's password (a Secret's key, mounted); it replaces one in the URL.
    #[arg(long, env = "EGRESS_STATE_STORE_PASSWORD_FILE")]
    pub state_store_password_file: Option<PathBuf>,
    /// What the state store's keys start with (inside one hash tag): installations sharing a server need their own.
    #[arg(long, env = "EGRESS_STATE_STORE_PREFIX", default_value = "egress")]
    pub state_store_prefix: String,
    /// `tokens` (default) or `none` (no authentication; warned about at start).
    #[arg(long, env = "EGRESS_DISCOVERY_AUTH", value_enum, default_value_t = DiscoveryAuth::Tokens)]
    pub discovery_auth: DiscoveryAuth,
    /// The probe URL for Proxies that set none (http:// or https://).
    #[arg(long, env = "EGRESS_DEFAULT_PROBE_URL", default_value = "https://www.gstatic.com/generate_204")]
    pub default_probe_url: String,
    /// Extra CA certificates (PEM) trusted by health probes.
    #[arg(long, env = "EGRESS_PROBE_CA_FILE")]
    pub probe_ca_file: Option<PathBuf>,
    /// A MaxMind-format database (GeoIP2/GeoLite2 Country or City, and/or ASN) to look proxies' egress addresses up
    /// in, for `status.egressCountry`/`egressASN`, their labels, and selection by country; give it once per file
    /// (the environment variable takes a comma-separated list).
    #[arg(long = "geoip-database", value_name = "FILE", env = "EGRESS_GEOIP_DATABASE", value_delimiter = ',')]
    pub geoip_databases: Vec<PathBuf>,
    /// How many health probes run at once.
    #[arg(long, env = "EGRESS_PROBE_CONCURRENCY", default_value_t = 64)]
    pub probe_concurrency: usize,
    /// How often the orphan collector runs (for example `5m`).
    #[arg(long, env = "EGRESS_GC_INTERVAL", default_value = "5m")]
    pub gc_interval: String,
    /// How old an orphan must be before it is deleted (for example `10m`).
    #[arg(long, env = "EGRESS_GC_GRACE", default_value = "10m")]
    pub gc_grace: String,
    /// How often providers are checked; `0` turns checks off, otherwise at least `10s`.
    #[arg(long, env = "EGRESS_PROVIDER_CHECK_INTERVAL", default_value = "1m")]
    pub provider_check_interval: String,
    /// How long a replaced instance is kept for the leases still on it: until each holder has renewed (and been
    /// told the new URL), released, or let its lease expire, but no longer than this.
    #[arg(long, env = "EGRESS_DRAIN_TIMEOUT", default_value = "5m")]
    pub drain_timeout: String,
    /// How long one round of provider checks may take.
    #[arg(long, env = "EGRESS_PROVIDER_CHECK_TIMEOUT", default_value = "15s")]
    pub provider_check_timeout: String,
    /// Log format.
    #[arg(long, env = "EGRESS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Send traces to this OTLP/HTTP receiver (for example `http://127.0.0.1:4318`; `/v1/traces` is added when the
    /// URL has no path). Off when unset.
    #[arg(long, env = "EGRESS_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Watch Proxies in this namespace only (default: all namespaces). Use a cluster ID of its own per namespace.
    #[arg(long, env = "EGRESS_WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,
    /// How long a client of the discovery, metrics and health servers may take to send a request's headers; also
    /// the longest an HTTP/1 keep-alive connection may wait idle for its next request.
    #[arg(long, env = "EGRESS_HTTP_HEADER_TIMEOUT", default_value = "10s")]
    pub http_header_timeout: String,
    /// How long a client may take to send a request's body once its headers arrived (408 after that).
    #[arg(long, env = "EGRESS_HTTP_BODY_TIMEOUT", default_value = "10s")]
    pub http_body_timeout: String,
    /// How long an HTTP/2 connection may have no request in flight.
    #[arg(long, env = "EGRESS_HTTP_IDLE_TIMEOUT", default_value = "60s")]
    pub http_idle_timeout: String,
    /// How often idle HTTP/2 connections are pinged; one whose ping goes unanswered for half that is closed.
    #[arg(long, env = "EGRESS_HTTP2_KEEPALIVE_INTERVAL", default_value = "20s")]
    pub http2_keepalive_interval: String,
    /// Concurrent streams per HTTP/2 connection.
    #[arg(long, env = "EGRESS_HTTP2_MAX_STREAMS", default_value_t = 100)]
    pub http2_max_streams: u32,
    /// Open connections per server; more are closed as soon as they are accepted (counted in
    /// `egress_http_connections_refused_total`).
    #[arg(long, env = "EGRESS_HTTP_MAX_CONNECTIONS", default_value_t = 1024)]
    pub http_max_connections: usize,
    /// Open connections per server from one source address that have not sent a request with a valid token yet
    /// (on the metrics and health servers, every connection); more from that address are closed as soon as they
    /// are accepted (`egress_http_connections_closed_by_limit_total{reason="per-source"}`).
    #[arg(long, env = "EGRESS_HTTP_MAX_UNAUTHENTICATED_PER_SOURCE", default_value_t = 64)]
    pub http_max_unauthenticated_per_source: usize,
    /// The most bytes of a request head (request line and headers); a larger one is answered 431.
    #[arg(long, env = "EGRESS_HTTP_MAX_HEADER_BYTES", default_value_t = egress_discovery::DEFAULT_MAX_HEADER_BYTES)]
    pub http_max_header_bytes: usize,
}

/// What else the binary runs.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// The gateway: one forward-proxy address for crawlers, leasing from the discovery API (docs/gateway.md).
    Gateway(crate::gateway::GatewayCli),
}

/// How the discovery API authenticates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DiscoveryAuth {
    /// Bearer tokens from `--discovery-tokens`.
    Tokens,
    /// No authentication.
    None,
}

/// Validated settings.
#[derive(Debug)]
pub struct Settings {
    /// The providers file, validated.
    pub providers: ProvidersConfig,
    /// `--cluster-id`.
    pub cluster_id: String,
    /// Where the discovery API listens.
    pub discovery_addr: SocketAddr,
    /// Where `/metrics` listens.
    pub metrics_addr: SocketAddr,
    /// Where `/livez` and `/readyz` listen.
    pub health_addr: SocketAddr,
    /// Whether replicas elect a leader (otherwise this one leads).
    pub leader_elect: bool,
    /// The namespace of the leader Lease.
    pub leader_election_namespace: String,
    /// How long the leader Lease is valid after each renewal.
    pub lease_duration: Duration,
    /// How long a stopping leader waits for a Ready successor.
    pub handoff_timeout: Duration,
    /// The label selector of the peer pods.
    pub peer_selector: String,
    /// The bearer-token file, or `None` with `--discovery-auth=none`.
    pub discovery_tokens: Option<PathBuf>,
    /// The name of the lease-key Secret, in `leader_election_namespace`.
    pub lease_key_secret: String,
    /// The shared state store, or `None` for this process's memory.
    pub state_store: Option<egress_lease_redis::RedisOptions>,
    /// The probe URL for Proxies that set none.
    pub default_probe_url: String,
    /// Extra CA certificates for probes (PEM).
    pub probe_ca_pem: Vec<u8>,
    /// How many probes run at once.
    pub probe_concurrency: usize,
    /// The GeoIP databases, read, when `--geoip-database` names any.
    pub geoip: Option<std::sync::Arc<egress_reconcile::geoip::GeoIp>>,
    /// How often the orphan collector runs.
    pub gc_interval: Duration,
    /// How old an orphan must be before it is deleted.
    pub gc_grace: Duration,
    /// How often providers are checked, or `None` for never.
    pub provider_check_interval: Option<Duration>,
    /// How long one provider check may take.
    pub provider_check_timeout: Duration,
    /// How long a replaced instance is kept for its leases.
    pub drain_timeout: Duration,
    /// Watch only this namespace; `None` watches all.
    pub watch_namespace: Option<String>,
    /// Text or JSON logs.
    pub log_format: LogFormat,
    /// Where spans are exported, when set.
    pub otlp_endpoint: Option<http::Uri>,
    /// The limits of the discovery, metrics and health servers.
    pub http_limits: egress_discovery::ServerLimits,
}

/// Whether `name` is a Kubernetes object name (an RFC 1123 subdomain).
fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.bytes().all(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit() || byte == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

/// The destination rule that allows exactly `host`:`port` (`host` an IP literal or `localhost`).
fn allow_rule_for(host: &str, port: u16) -> String {
    match egress_provider::destinations::literal_address(host) {
        Some(std::net::IpAddr::V6(address)) => format!("[{address}]:{port}"),
        Some(address) => format!("{address}:{port}"),
        None => format!("{host}:{port}"),
    }
}

fn is_label_value(value: &str) -> bool {
    let alnum = |c: char| c.is_ascii_alphanumeric();
    !value.is_empty()
        && value.len() <= 63
        && value.starts_with(alnum)
        && value.ends_with(alnum)
        && value.chars().all(|c| alnum(c) || matches!(c, '-' | '_' | '.'))
}

impl Cli {
    /// Validates every flag and reads the providers file; returns every problem found.
    pub fn settings(&self) -> Result<Settings, Vec<String>> {
        let (Some(providers_config), Some(cluster_id)) = (&self.providers_config, &self.cluster_id) else {
            return Err(vec!["--providers-config and --cluster-id are required to run the operator".into()]);
        };
        let mut problems = Vec::new();
        let mut address = |flag: &str, value: &str| match value.parse::<SocketAddr>() {
            Ok(address) => Some(address),
            Err(_) => {
                problems.push(format!("--{flag} {value:?} is not host:port (for example 0.0.0.0:8090)"));
                None
            }
        };
        let discovery_addr = address("discovery-addr", &self.discovery_addr);
        let metrics_addr = address("metrics-addr", &self.metrics_addr);
        let health_addr = address("health-addr", &self.health_addr);
        let mut duration = |flag: &str, value: &str| match parse_duration(value) {
            Ok(duration) => Some(duration),
            Err(why) => {
                problems.push(format!("--{flag}: {why}"));
                None
            }
        };
        let gc_interval = duration("gc-interval", &self.gc_interval);
        let gc_grace = duration("gc-grace", &self.gc_grace);
        let check_interval = duration("provider-check-interval", &self.provider_check_interval);
        let check_timeout = duration("provider-check-timeout", &self.provider_check_timeout);
        // 0 is allowed: a replaced instance is then deleted as soon as its successor serves, leases or not.
        let drain_timeout = duration("drain-timeout", &self.drain_timeout);
        let lease_duration = duration("leader-election-lease-duration", &self.leader_election_lease_duration);
        let handoff_timeout = duration("handoff-timeout", &self.handoff_timeout);
        if lease_duration.is_some_and(|lease| !(Duration::from_secs(3)..=Duration::from_secs(300)).contains(&lease)) {
            problems.push("--leader-election-lease-duration must be from 3s to 5m".into());
        }
        if handoff_timeout.is_some_and(|timeout| timeout > Duration::from_secs(600)) {
            problems.push("--handoff-timeout must be at most 10m".into());
        }
        if self.peer_selector.trim().is_empty() {
            problems.push("--peer-selector must not be empty (it finds this Deployment's other pods)".into());
        }
        if gc_interval.is_some_and(|interval| interval < Duration::from_secs(10)) {
            problems.push("--gc-interval must be at least 10s".into());
        }
        if check_interval.is_some_and(|interval| !interval.is_zero() && interval < Duration::from_secs(10)) {
            problems.push("--provider-check-interval must be 0 (off) or at least 10s".into());
        }
        if check_timeout.is_some_and(|timeout| timeout.is_zero()) {
            problems.push("--provider-check-timeout must be more than 0".into());
        }
        if let Some(namespace) = &self.watch_namespace
            && !egress_provider::config::is_identifier(namespace)
        {
            problems.push(format!("--watch-namespace {namespace:?} is not a namespace name"));
        }
        if !is_label_value(cluster_id) {
            problems.push(format!(
                "--cluster-id {:?} must be a label value: 1 to 63 letters, digits, '-', '_' or '.', alphanumeric at both ends",
                cluster_id
            ));
        }
        let otlp_endpoint = self.otlp_endpoint.as_deref().and_then(|text| match crate::telemetry::traces_url(text) {
            Ok(url) => Some(url),
            Err(why) => {
                problems.push(format!("--otlp-endpoint: {why}"));
                None
            }
        });
        let probe_ok = egress_health::ProbeUrl::parse(&self.default_probe_url);
        if let Err(error) = &probe_ok {
            problems.push(format!("--default-probe-url: {error}"));
        }
        let mut positive = |flag: &str, value: &str| match parse_duration(value) {
            Ok(duration) if duration.is_zero() => {
                problems.push(format!("--{flag} must be more than 0"));
                None
            }
            Ok(duration) => Some(duration),
            Err(why) => {
                problems.push(format!("--{flag}: {why}"));
                None
            }
        };
        let header_timeout = positive("http-header-timeout", &self.http_header_timeout);
        let body_timeout = positive("http-body-timeout", &self.http_body_timeout);
        let idle_timeout = positive("http-idle-timeout", &self.http_idle_timeout);
        let keepalive = positive("http2-keepalive-interval", &self.http2_keepalive_interval);
        if !(1..=10_000).contains(&self.http2_max_streams) {
            problems.push("--http2-max-streams must be from 1 to 10000".into());
        }
        if !(1..=1_000_000).contains(&self.http_max_connections) {
            problems.push("--http-max-connections must be from 1 to 1000000".into());
        }
        if !(1..=1_000_000).contains(&self.http_max_unauthenticated_per_source) {
            problems.push("--http-max-unauthenticated-per-source must be from 1 to 1000000".into());
        }
        if !(8192..=1_048_576).contains(&self.http_max_header_bytes) {
            problems.push("--http-max-header-bytes must be from 8192 to 1048576".into());
        }
        if self.probe_concurrency == 0 || self.probe_concurrency > 10_000 {
            problems.push("--probe-concurrency must be from 1 to 10000".into());
        }
        let geoip = if self.geoip_databases.is_empty() {
            None
        } else {
            match egress_reconcile::geoip::GeoIp::open(&self.geoip_databases) {
                Ok(geoip) => Some(std::sync::Arc::new(geoip)),
                Err(error) => {
                    problems.push(format!("--geoip-database {}: {}", error.path.display(), error.problem));
                    None
                }
            }
        };
        let probe_ca_pem = match &self.probe_ca_file {
            Some(path) => match std::fs::read(path) {
                Ok(pem) => {
                    if let Err(error) = egress_health::tls_connector(&pem) {
                        problems.push(format!("--probe-ca-file {}: {error}", path.display()));
                    }
                    pem
                }
                Err(error) => {
                    problems.push(format!("--probe-ca-file {}: {error}", path.display()));
                    Vec::new()
                }
            },
            None => Vec::new(),
        };
        if !is_dns_subdomain(&self.lease_key_secret) {
            problems.push(format!(
                "--lease-key-secret {:?} is not a Secret name (lower-case letters, digits, '-' and '.', at most 253)",
                self.lease_key_secret
            ));
        }
        let state_store = self.state_store(&mut problems);
        match (self.discovery_auth, &self.discovery_tokens) {
            (DiscoveryAuth::Tokens, None) => problems.push(
                "--discovery-tokens is required (or set --discovery-auth=none to turn authentication off)".into(),
            ),
            (DiscoveryAuth::Tokens, Some(path)) => {
                if let Err(error) = egress_discovery::TokenFile::load(path) {
                    problems.push(format!("--discovery-tokens: {error}"));
                }
            }
            (DiscoveryAuth::None, _) => {}
        }
        let providers = match std::fs::read_to_string(providers_config) {
            Ok(text) => match ProvidersConfig::parse(
                &text,
                &providers_config.display().to_string(),
                crate::providers::provider_types().settings(),
            ) {
                Ok(config) => Some(config),
                Err(error) => {
                    problems.extend(
                        error.problems.iter().map(|problem| format!("{}: {problem}", providers_config.display())),
                    );
                    None
                }
            },
            Err(error) => {
                problems.push(format!("--providers-config {}: {error}", providers_config.display()));
                None
            }
        };
        // A probe the proxies would refuse could never pass: say so now, not as a fleet that never turns Ready.
        if let (Ok(probe), Some(providers)) = (&probe_ok, &providers) {
            for (index, provider) in providers.providers.iter().enumerate() {
                if let Some(denial) = provider.denies(probe.host(), probe.port(), probe.is_https()) {
                    problems.push(format!(
                        "--default-probe-url {} is refused by the destination policy of provider {:?}: {denial}; \
                         probe a public URL, or add \"{}\" to providers[{index}].destinations.allow in {}",
                        probe.as_str(),
                        provider.name,
                        allow_rule_for(probe.host(), probe.port()),
                        providers_config.display()
                    ));
                }
            }
        }
        if !problems.is_empty() {
            return Err(problems);
        }
        let namespace = self
            .leader_election_namespace
            .clone()
            .or_else(|| std::env::var("POD_NAMESPACE").ok())
            .unwrap_or_else(|| "default".into());
        Ok(Settings {
            providers: providers.expect("checked above"),
            cluster_id: cluster_id.clone(),
            discovery_addr: discovery_addr.expect("checked above"),
            metrics_addr: metrics_addr.expect("checked above"),
            health_addr: health_addr.expect("checked above"),
            leader_elect: self.leader_elect,
            leader_election_namespace: namespace,
            lease_duration: lease_duration.expect("checked above"),
            handoff_timeout: handoff_timeout.expect("checked above"),
            peer_selector: self.peer_selector.trim().to_owned(),
            discovery_tokens: match self.discovery_auth {
                DiscoveryAuth::Tokens => self.discovery_tokens.clone(),
                DiscoveryAuth::None => None,
            },
            lease_key_secret: self.lease_key_secret.clone(),
            state_store,
            default_probe_url: self.default_probe_url.clone(),
            probe_ca_pem,
            probe_concurrency: self.probe_concurrency,
            geoip,
            gc_interval: gc_interval.expect("checked above"),
            gc_grace: gc_grace.expect("checked above"),
            provider_check_interval: check_interval.filter(|interval| !interval.is_zero()),
            provider_check_timeout: check_timeout.expect("checked above"),
            drain_timeout: drain_timeout.expect("checked above"),
            watch_namespace: self.watch_namespace.clone(),
            log_format: self.log_format,
            otlp_endpoint,
            http_limits: egress_discovery::ServerLimits {
                header_timeout: header_timeout.expect("checked above"),
                body_timeout: body_timeout.expect("checked above"),
                idle_timeout: idle_timeout.expect("checked above"),
                http2_keepalive_interval: keepalive.expect("checked above"),
                http2_keepalive_timeout: keepalive.expect("checked above") / 2,
                http2_max_streams: self.http2_max_streams,
                max_connections: self.http_max_connections,
                max_unauthenticated_per_source: self.http_max_unauthenticated_per_source,
                max_header_bytes: self.http_max_header_bytes,
            },
        })
    }

    /// `--state-store` and its password file and prefix: `None` for `memory`; problems go to `problems`.
    fn state_store(&self, problems: &mut Vec<String>) -> Option<egress_lease_redis::RedisOptions> {
        let url = self.state_store.trim();
        if url == "memory" {
            if self.state_store_password_file.is_some() {
                problems.push("--state-store-password-file is set, but --state-store is memory".into());
            }
            return None;
        }
        if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
            problems.push(format!(
                "--state-store {}: expected `memory` or a redis:// or rediss:// URL",
                egress_lease_redis::redact(url)
            ));
            return None;
        }
        let password = self.state_store_password_file.as_ref().and_then(|path| match std::fs::read_to_string(path) {
            Ok(text) if !text.trim().is_empty() => Some(text.trim_end_matches(['\r', '\n']).to_owned()),
            Ok(_) => {
                problems.push(format!("--state-store-password-file {}: the file is empty", path.display()));
                None
            }
            Err(error) => {
                problems.push(format!("--state-store-password-file {}: {error}", path.display()));
                None
            }
        });
        let options = egress_lease_redis::RedisOptions {
            password,
            prefix: self.state_store_prefix.clone(),
            ..egress_lease_redis::RedisOptions::new(url)
        };
        match egress_lease_redis::check(&options) {
            Ok(()) => Some(options),
            Err(error) => {
                problems.push(error.to_string());
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_problem_is_reported_at_once() {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("providers.yaml");
        std::fs::write(&config, "providers:\n  - { name: Bad_Name, type: kubernetes }\n  - { name: x, type: azure }\n")
            .expect("write");
        let cli = Cli::parse_from([
            "egress-operator",
            "--providers-config",
            config.to_str().expect("utf-8 path"),
            "--cluster-id",
            "not a label",
            "--gc-interval",
            "2s",
            "--provider-check-interval",
            "5s",
            "--default-probe-url",
            "ftp://x",
            "--discovery-addr",
            "nowhere",
            "--otlp-endpoint",
            "https://collector:4318",
            "--geoip-database",
            "/nonexistent/GeoLite2-Country.mmdb",
        ]);
        let problems = cli.settings().expect_err("invalid");
        for expected in [
            "--discovery-addr \"nowhere\"",
            "--gc-interval must be at least 10s",
            "--provider-check-interval must be 0 (off) or at least 10s",
            "--cluster-id \"not a label\"",
            "--default-probe-url",
            "--otlp-endpoint: \"https://collector:4318\": only http://",
            "--discovery-tokens is required",
            "providers[0].name",
            "providers[1].type",
            "--geoip-database /nonexistent/GeoLite2-Country.mmdb: ",
        ] {
            assert!(problems.iter().any(|problem| problem.contains(expected)), "{expected:?} in {problems:#?}");
        }
        assert_eq!(problems.len(), 10, "{problems:#?}");
    }

    /// A default probe the proxies' destination policy refuses is an error at start, naming the rule to add.
    #[test]
    fn a_probe_url_the_destination_policy_refuses_is_reported() {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("providers.yaml");
        std::fs::write(
            &config,
            "providers:\n  - { name: pods, type: kubernetes }\n  - name: open\n    type: kubernetes\n    \
             destinations: { allow: [\"127.0.0.1:8080\"] }\n",
        )
        .expect("write");
        let settings = |url: &str| {
            Cli::parse_from([
                "egress-operator",
                "--providers-config",
                config.to_str().expect("utf-8 path"),
                "--cluster-id",
                "test",
                "--discovery-auth=none",
                "--default-probe-url",
                url,
            ])
            .settings()
        };
        let problems = settings("http://127.0.0.1:8080/ip").expect_err("loopback is refused by provider pods");
        assert_eq!(problems.len(), 1, "provider open allows it: {problems:#?}");
        assert!(problems[0].starts_with("--default-probe-url http://127.0.0.1:8080/ip is refused by the destination policy of provider \"pods\": loopback"), "{}", problems[0]);
        assert!(problems[0].contains("add \"127.0.0.1:8080\" to providers[0].destinations.allow"), "{}", problems[0]);
        let problems = settings("https://localhost:8443/").expect_err("localhost is loopback");
        assert_eq!(problems.len(), 2, "{problems:#?}");
        let problems = settings("https://[::1]:8443/").expect_err("and so is ::1");
        assert!(problems[0].contains("add \"[::1]:8443\""), "{}", problems[0]);
        assert!(settings("https://example.com/").is_ok(), "a name is left to Squid, which checks what it resolves to");
    }

    #[test]
    fn the_state_store_is_memory_or_a_redis_url_with_a_readable_password_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("providers.yaml");
        std::fs::write(&config, "providers:\n  - { name: pods, type: kubernetes }\n").expect("write");
        let password = dir.path().join("password");
        std::fs::write(&password, "s3cret\n").expect("write");
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").expect("write");
        let settings = |extra: &[&str]| {
            let mut args =
                vec!["egress-operator", "--providers-config", config.to_str().expect("utf-8"), "--cluster-id", "t"];
            args.push("--discovery-auth=none");
            args.extend_from_slice(extra);
            Cli::parse_from(args).settings()
        };
        assert!(settings(&[]).expect("memory by default").state_store.is_none());
        let options = settings(&[
            "--state-store",
            "rediss://valkey.data:6380/2",
            "--state-store-password-file",
            password.to_str().expect("utf-8"),
            "--state-store-prefix",
            "crawl-a",
        ])
        .expect("valid")
        .state_store
        .expect("shared");
        assert_eq!(options.password.as_deref(), Some("s3cret"), "without its newline");
        assert_eq!(options.prefix, "crawl-a");
        assert!(!format!("{options:?}").contains("s3cret"));
        for (args, expected) in [
            (vec!["--state-store", "postgres://x"], "--state-store postgres://x: expected `memory` or a redis://"),
            (vec!["--state-store", "redis://:hunter2@:x"], "--state-store redis://:<redacted>@:x"),
            (vec!["--state-store", "redis://r", "--state-store-prefix", "a}"], "--state-store-prefix \"a}\""),
            (
                vec!["--state-store", "redis://r", "--state-store-password-file", "/nonexistent"],
                "/nonexistent: No such",
            ),
            (
                vec!["--state-store", "redis://r", "--state-store-password-file", empty.to_str().expect("utf-8")],
                "empty",
            ),
            (vec!["--state-store-password-file", password.to_str().expect("utf-8")], "but --state-store is memory"),
        ] {
            let problems = settings(&args).expect_err("invalid");
            assert_eq!(problems.len(), 1, "{problems:#?}");
            assert!(problems[0].contains(expected), "{expected:?} in {problems:#?}");
            assert!(!problems[0].contains("hunter2"), "{problems:#?}");
        }
    }
}
