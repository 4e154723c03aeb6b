//! `egress-operator gateway`: the gateway as a process of its own, the `egress-gateway` Deployment.
//!
//! Crawlers set `http://<options>:<token>@egress-gateway:8088` as their proxy. The password is a discovery token
//! with the `lease` scope, from the same tokens file the operator reads (the same Secret, mounted); each request is
//! routed through a lease taken from the discovery API with that token ([`egress_gateway::LeaseRouter`]), so the
//! gateway holds no state a restart loses: leases, cooldowns and sticky sessions are the discovery store's. It needs
//! no Kubernetes API access at all.
//!
//! Stopping (SIGTERM) is make-before-break: `/readyz` answers 503 at once while the gateway keeps accepting for
//! `--shutdown-delay`, so the Service stops sending it new connections before it stops taking them; then it stops
//! accepting, closes each kept-alive connection once its request in flight is answered, and waits up to
//! `--drain-timeout` for open tunnels and streaming answers before it exits.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::response::IntoResponse;
use axum::routing::get;
use clap::Args;
use egress_discovery::{Scope, ServerLimits, ServerMetrics, TokenFile};
use egress_gateway::{
    Authenticator, Buffers, Gateway, GatewayLimits, GatewayMetrics, LeaseRouter, LeaseRouterConfig, TokenRefused,
};
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::durations::parse_duration;
use crate::telemetry::LogFormat;

/// Flags of `egress-operator gateway` (each with an environment fallback).
#[derive(Args, Debug)]
pub struct GatewayCli {
    /// Where crawlers connect: the address they set as their HTTP proxy.
    #[arg(long, env = "EGRESS_GATEWAY_ADDR", default_value = "0.0.0.0:8088")]
    pub listen_addr: String,
    /// The discovery API the gateway leases from (`http://host:port`): the `egress-discovery` Service.
    #[arg(long, env = "EGRESS_DISCOVERY_URL", default_value = "http://egress-discovery:8090")]
    pub discovery_url: String,
    /// The discovery tokens file (the operator's): a crawler's proxy password is one of its `lease` or `admin`
    /// tokens, and the tenant is that token's.
    #[arg(long, env = "EGRESS_DISCOVERY_TOKENS")]
    pub discovery_tokens: PathBuf,
    /// Where `/metrics` is served.
    #[arg(long, env = "EGRESS_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    pub metrics_addr: String,
    /// Where `/livez` and `/readyz` are served.
    #[arg(long, env = "EGRESS_HEALTH_ADDR", default_value = "0.0.0.0:8081")]
    pub health_addr: String,
    /// How long each lease lasts unless renewed (a session's lease is renewed at half of it while in use).
    #[arg(long, env = "EGRESS_GATEWAY_LEASE_TTL", default_value = "2m")]
    pub lease_ttl: String,
    /// How long an idle session keeps its proxy when its user name sets no `sticky-<seconds>`.
    #[arg(long, env = "EGRESS_GATEWAY_STICKY", default_value = "10m")]
    pub sticky: String,
    /// Upstream statuses of plain HTTP requests reported as a ban of the proxy for the site (comma-separated; empty
    /// for none).
    #[arg(long, env = "EGRESS_GATEWAY_BAN_STATUSES", default_value = "401,403")]
    pub ban_statuses: String,
    /// Upstream statuses reported as a throttle, with the answer's `Retry-After` (comma-separated; empty for none).
    #[arg(long, env = "EGRESS_GATEWAY_THROTTLE_STATUSES", default_value = "429")]
    pub throttle_statuses: String,
    /// How long a request waits for a proxy when none can take it now but one can within this (all cooling down
    /// for the site, all at their cap, a pool waking); past it, or at `0`, the gateway answers 503 with
    /// `Retry-After`.
    #[arg(long, env = "EGRESS_GATEWAY_MAX_WAIT", default_value = "10s")]
    pub max_wait: String,
    /// How many times an idempotent plain request without a body (GET, HEAD, …) is tried again on another proxy
    /// after a ban or throttle status; the last answer is passed on. 0 passes the first one on.
    #[arg(long, env = "EGRESS_GATEWAY_RETRIES", default_value_t = 2)]
    pub retries: u32,
    /// How long a client may take to send a request head, and may idle between requests.
    #[arg(long, env = "EGRESS_GATEWAY_HEADER_TIMEOUT", default_value = "10s")]
    pub header_timeout: String,
    /// How long reaching an upstream proxy may take (the connection, and its answer to a `CONNECT`).
    #[arg(long, env = "EGRESS_GATEWAY_CONNECT_TIMEOUT", default_value = "10s")]
    pub connect_timeout: String,
    /// Open client connections and tunnels together; at the cap a new connection is closed as soon as it is
    /// accepted and a new tunnel answered 503.
    #[arg(long, env = "EGRESS_GATEWAY_MAX_CONNECTIONS", default_value_t = 16_384)]
    pub max_connections: usize,
    /// Tunnels open and plain requests in flight one tenant may have at once (at most --max-connections); one more
    /// is answered 429 with Retry-After: 1. Half the connection cap by default: no tenant can take all of it.
    #[arg(long, env = "EGRESS_GATEWAY_MAX_TENANT_CONNECTIONS", default_value_t = 8192)]
    pub max_tenant_connections: usize,
    /// Connections from one client address that have not sent a request with a valid token yet; one more from that
    /// address is closed as soon as it is accepted.
    #[arg(long, env = "EGRESS_GATEWAY_MAX_UNAUTHENTICATED_PER_SOURCE", default_value_t = 256)]
    pub max_unauthenticated_per_source: usize,
    /// Connections from all addresses that have not sent a request with a valid token yet (at most
    /// --max-connections); the rest of the connection cap is kept for authenticated connections and their tunnels.
    #[arg(long, env = "EGRESS_GATEWAY_MAX_UNAUTHENTICATED", default_value_t = 8192)]
    pub max_unauthenticated: usize,
    /// After SIGTERM, how long the gateway keeps accepting while `/readyz` already says it is stopping (so the
    /// Service has stopped sending it connections before it stops taking them).
    #[arg(long, env = "EGRESS_GATEWAY_SHUTDOWN_DELAY", default_value = "5s")]
    pub shutdown_delay: String,
    /// Then how long it waits for open tunnels and answers still streaming before it exits and cuts them.
    #[arg(long, env = "EGRESS_GATEWAY_DRAIN_TIMEOUT", default_value = "30s")]
    pub drain_timeout: String,
    /// Log format.
    #[arg(long, env = "EGRESS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Send traces to this OTLP/HTTP receiver; off when unset.
    #[arg(long, env = "EGRESS_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

/// The gateway's validated settings.
#[derive(Debug)]
pub struct GatewaySettings {
    /// Where crawlers connect.
    pub listen_addr: SocketAddr,
    /// Where `/metrics` listens.
    pub metrics_addr: SocketAddr,
    /// Where `/livez` and `/readyz` listen.
    pub health_addr: SocketAddr,
    /// The tokens file.
    pub discovery_tokens: PathBuf,
    /// How requests are leased.
    pub router: LeaseRouterConfig,
    /// The gateway's limits.
    pub limits: GatewayLimits,
    /// How long a stopping gateway keeps accepting after it turned unready.
    pub shutdown_delay: Duration,
    /// How long it then waits for what is open.
    pub drain_timeout: Duration,
    /// Text or JSON logs.
    pub log_format: LogFormat,
    /// Where spans are exported, when set.
    pub otlp_endpoint: Option<http::Uri>,
}

/// Parses a comma-separated list of HTTP statuses (`401,403`; empty for none).
fn statuses(text: &str) -> Result<Vec<u16>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty())
        .map(|part| match part.parse::<u16>() {
            Ok(status) if (100..=599).contains(&status) => Ok(status),
            _ => Err(format!("{part:?} is not an HTTP status from 100 to 599")),
        })
        .collect()
}

impl GatewayCli {
    /// Validates every flag and reads the tokens file; returns every problem found.
    pub fn settings(&self) -> Result<GatewaySettings, Vec<String>> {
        let mut problems = Vec::new();
        let mut address = |flag: &str, value: &str| match value.parse::<SocketAddr>() {
            Ok(address) => Some(address),
            Err(_) => {
                problems.push(format!("--{flag} {value:?} is not host:port (for example 0.0.0.0:8088)"));
                None
            }
        };
        let listen_addr = address("listen-addr", &self.listen_addr);
        let metrics_addr = address("metrics-addr", &self.metrics_addr);
        let health_addr = address("health-addr", &self.health_addr);
        let mut duration =
            |flag: &str, value: &str, range: std::ops::RangeInclusive<Duration>, words: &str| match parse_duration(
                value,
            ) {
                Ok(duration) if range.contains(&duration) => Some(duration),
                Ok(_) => {
                    problems.push(format!("--{flag} must be {words}"));
                    None
                }
                Err(why) => {
                    problems.push(format!("--{flag}: {why}"));
                    None
                }
            };
        let second = Duration::from_secs(1);
        let lease_ttl = duration(
            "lease-ttl",
            &self.lease_ttl,
            Duration::from_secs(10)..=Duration::from_secs(3600),
            "from 10s to 1h (the discovery API's longest lease)",
        );
        let sticky = duration("sticky", &self.sticky, second..=Duration::from_secs(86_400), "from 1s to 24h");
        let header_timeout =
            duration("header-timeout", &self.header_timeout, second..=Duration::from_secs(600), "from 1s to 10m");
        let connect_timeout =
            duration("connect-timeout", &self.connect_timeout, second..=Duration::from_secs(600), "from 1s to 10m");
        let max_wait = duration("max-wait", &self.max_wait, Duration::ZERO..=Duration::from_secs(300), "at most 5m");
        let shutdown_delay =
            duration("shutdown-delay", &self.shutdown_delay, Duration::ZERO..=Duration::from_secs(60), "at most 1m");
        let drain_timeout =
            duration("drain-timeout", &self.drain_timeout, Duration::ZERO..=Duration::from_secs(3600), "at most 1h");
        let mut status_list = |flag: &str, value: &str| match statuses(value) {
            Ok(list) => list,
            Err(why) => {
                problems.push(format!("--{flag}: {why}"));
                Vec::new()
            }
        };
        let ban_statuses = status_list("ban-statuses", &self.ban_statuses);
        let throttle_statuses = status_list("throttle-statuses", &self.throttle_statuses);
        if let Some(both) = ban_statuses.iter().find(|status| throttle_statuses.contains(status)) {
            problems
                .push(format!("--ban-statuses and --throttle-statuses both name {both}; a status is one or the other"));
        }
        if self.retries > 10 {
            problems.push("--retries must be from 0 to 10".into());
        }
        if !(1..=1_000_000).contains(&self.max_connections) {
            problems.push("--max-connections must be from 1 to 1000000".into());
        }
        if !(1..=self.max_connections.max(1)).contains(&self.max_tenant_connections) {
            problems.push(format!(
                "--max-tenant-connections must be from 1 to --max-connections ({})",
                self.max_connections
            ));
        }
        if !(1..=self.max_connections.max(1)).contains(&self.max_unauthenticated) {
            problems
                .push(format!("--max-unauthenticated must be from 1 to --max-connections ({})", self.max_connections));
        }
        if !(1..=self.max_unauthenticated.max(1)).contains(&self.max_unauthenticated_per_source) {
            problems.push(format!(
                "--max-unauthenticated-per-source must be from 1 to --max-unauthenticated ({})",
                self.max_unauthenticated
            ));
        }
        let url = self.discovery_url.trim_end_matches('/');
        if url.contains('@') {
            // Not echoed: it may hold a password.
            problems.push(
                "--discovery-url must not carry credentials; the gateway leases with each crawler's token".into(),
            );
        } else if !url.parse::<http::Uri>().is_ok_and(|uri| {
            uri.scheme_str() == Some("http")
                && uri.host().is_some()
                && uri.path_and_query().is_none_or(|path| path.as_str() == "/")
        }) {
            problems.push(format!(
                "--discovery-url {:?} is not http://host:port (for example http://egress-discovery:8090)",
                self.discovery_url
            ));
        }
        if let Err(error) = TokenFile::load(&self.discovery_tokens) {
            problems.push(format!("--discovery-tokens: {error}"));
        }
        let otlp_endpoint = self.otlp_endpoint.as_deref().and_then(|text| match crate::telemetry::traces_url(text) {
            Ok(url) => Some(url),
            Err(why) => {
                problems.push(format!("--otlp-endpoint: {why}"));
                None
            }
        });
        let (
            Some(listen_addr),
            Some(metrics_addr),
            Some(health_addr),
            Some(lease_ttl),
            Some(sticky),
            Some(header_timeout),
            Some(connect_timeout),
            Some(max_wait),
            Some(shutdown_delay),
            Some(drain_timeout),
            true,
        ) = (
            listen_addr,
            metrics_addr,
            health_addr,
            lease_ttl,
            sticky,
            header_timeout,
            connect_timeout,
            max_wait,
            shutdown_delay,
            drain_timeout,
            problems.is_empty(),
        )
        else {
            return Err(problems);
        };
        let router = LeaseRouterConfig {
            lease_ttl,
            default_sticky: sticky,
            ban_statuses,
            throttle_statuses,
            max_wait,
            ..LeaseRouterConfig::new(url)
        };
        Ok(GatewaySettings {
            listen_addr,
            metrics_addr,
            health_addr,
            discovery_tokens: self.discovery_tokens.clone(),
            router,
            limits: GatewayLimits {
                header_timeout,
                connect_timeout,
                max_connections: self.max_connections,
                tunnel_buffers: Buffers::default(),
                retries: self.retries,
                max_tenant_connections: self.max_tenant_connections,
                max_unauthenticated_per_source: self.max_unauthenticated_per_source,
                max_unauthenticated: self.max_unauthenticated,
            },
            shutdown_delay,
            drain_timeout,
            log_format: self.log_format,
            otlp_endpoint,
        })
    }
}

/// The tokens file as the gateway's authenticator: a token that may lease may use the gateway, as its tenant.
struct LeaseTokens(TokenFile);

impl Authenticator for LeaseTokens {
    fn tenant(&self, token: &str) -> Result<String, TokenRefused> {
        let identity = self.0.identify(token).ok_or(TokenRefused::Unknown)?;
        if identity.scope < Scope::Lease {
            return Err(TokenRefused::Scope(identity.scope.name()));
        }
        Ok(identity.tenant.to_string())
    }
}

/// Runs the gateway until SIGTERM (or Ctrl-C), then stops as the module says.
///
/// # Errors
/// The tokens file cannot be read, or an address cannot be bound.
pub async fn run(settings: GatewaySettings) -> Result<()> {
    run_until(settings, crate::serving::shutdown_signal()).await
}

/// As [`run`], stopping when `stop` resolves instead of on a signal.
///
/// # Errors
/// As [`run`].
pub async fn run_until(settings: GatewaySettings, stop: impl Future<Output = ()>) -> Result<()> {
    let tokens = TokenFile::load(&settings.discovery_tokens).context("reading --discovery-tokens")?;
    let mut registry = Registry::default();
    let gateway_metrics = GatewayMetrics::register(&mut registry);
    let server_metrics = ServerMetrics::register(registry.sub_registry_with_prefix("egress"));
    let registry = Arc::new(registry);
    let router = LeaseRouter::start(settings.router.clone()).context("the discovery URL")?;
    let gateway = Gateway::with_metrics(router, Arc::new(LeaseTokens(tokens)), settings.limits, gateway_metrics);
    let listener = egress_discovery::bind(settings.listen_addr)
        .with_context(|| format!("binding the gateway address {}", settings.listen_addr))?;

    let (draining_sender, draining) = watch::channel(false);
    let (servers_stop_sender, servers_stop) = watch::channel(false);
    let health = axum::Router::new().route("/livez", get(|| async { "ok" })).route(
        "/readyz",
        get(move || {
            let draining = *draining.borrow();
            async move {
                if draining {
                    (axum::http::StatusCode::SERVICE_UNAVAILABLE, "stopping: new connections go to other replicas")
                        .into_response()
                } else {
                    "ok".into_response()
                }
            }
        }),
    );
    let mut servers = Vec::new();
    for (name, address, router) in [
        ("metrics", settings.metrics_addr, crate::serving::metrics_router(registry)),
        ("health", settings.health_addr, health),
    ] {
        let listener =
            egress_discovery::bind(address).with_context(|| format!("binding the {name} address {address}"))?;
        info!(%address, "{name} listening");
        let (stop, metrics) = (servers_stop.clone(), server_metrics.clone());
        servers.push(tokio::spawn(async move {
            if let Err(error) = egress_discovery::serve_with(
                listener,
                router,
                ServerLimits::default(),
                name,
                metrics,
                crate::serving::until_true(stop),
            )
            .await
            {
                warn!(%error, "{name} server failed");
            }
        }));
    }
    let (accepting_sender, accepting) = tokio::sync::oneshot::channel::<()>();
    info!(
        address = %settings.listen_addr,
        discovery = %settings.router.discovery_url,
        "gateway listening"
    );
    let serving = tokio::spawn(gateway.clone().serve(listener, async move {
        let _ = accepting.await;
    }));

    stop.await;
    draining_sender.send_replace(true);
    info!(delay = ?settings.shutdown_delay, "stopping: unready, still accepting while the Service takes this replica out");
    tokio::time::sleep(settings.shutdown_delay).await;
    let _ = accepting_sender.send(());
    match serving.await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => warn!(%error, "the gateway server failed"),
        Err(error) => warn!(%error, "the gateway server task failed"),
    }
    info!(open = gateway.open(), timeout = ?settings.drain_timeout, "no longer accepting; draining");
    match gateway.drain(settings.drain_timeout).await {
        0 => info!("drained"),
        open => warn!(open, "the drain timeout passed; the connections and tunnels still open are cut"),
    }
    servers_stop_sender.send_replace(true);
    for server in servers {
        let _ = server.await;
    }
    info!("stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::flags::{Cli, Command};

    fn gateway_cli(args: &[&str]) -> GatewayCli {
        let cli = Cli::try_parse_from(["egress-operator", "gateway"].iter().chain(args)).expect("parses");
        match cli.command {
            Some(Command::Gateway(gateway)) => gateway,
            None => panic!("the gateway subcommand"),
        }
    }

    #[test]
    fn the_gateway_subcommand_needs_no_operator_flags_and_has_defaults() {
        let tokens = tempfile::NamedTempFile::new().expect("file");
        std::fs::write(tokens.path(), "lease gateway-test-token-0001 tenant=crawlers\n").expect("write");
        let path = tokens.path().display().to_string();
        let settings = gateway_cli(&["--discovery-tokens", &path]).settings().expect("valid");
        assert_eq!(settings.listen_addr, "0.0.0.0:8088".parse().expect("address"));
        assert_eq!(settings.router.discovery_url, "http://egress-discovery:8090");
        assert_eq!(settings.router.ban_statuses, [401, 403]);
        assert_eq!(settings.router.throttle_statuses, [429]);
        assert_eq!(settings.router.default_sticky, Duration::from_secs(600));
        assert_eq!(settings.limits.max_connections, 16_384);
        assert_eq!(settings.limits.max_tenant_connections, 8192);
        assert_eq!(settings.limits.max_unauthenticated_per_source, 256);
        assert_eq!(settings.limits.max_unauthenticated, 8192);
        assert_eq!(settings.limits.retries, 2);
        // Without the subcommand the operator's flags are still required.
        let error = Cli::try_parse_from(["egress-operator"]).expect_err("the operator needs its flags");
        assert!(error.to_string().contains("--providers-config"), "{error}");
    }

    #[test]
    fn every_gateway_flag_problem_is_reported_at_once() {
        let problems = gateway_cli(&[
            "--discovery-tokens=/nonexistent/tokens",
            "--listen-addr=8088",
            "--discovery-url=https://discovery:8090",
            "--lease-ttl=1s",
            "--sticky=soon",
            "--ban-statuses=403,999",
            "--throttle-statuses=429,4xx",
            "--max-connections=0",
            "--max-tenant-connections=0",
            "--max-unauthenticated=0",
            "--max-unauthenticated-per-source=0",
            "--retries=11",
            "--shutdown-delay=5m",
            "--otlp-endpoint=collector:4318",
        ])
        .settings()
        .expect_err("invalid");
        for expected in [
            "--listen-addr \"8088\" is not host:port",
            "--discovery-url \"https://discovery:8090\" is not http://host:port",
            "--lease-ttl must be from 10s to 1h",
            "--sticky: \"soon\" is not a duration",
            "--ban-statuses: \"999\" is not an HTTP status",
            "--throttle-statuses: \"4xx\" is not an HTTP status",
            "--max-connections must be from 1 to 1000000",
            "--max-tenant-connections must be from 1 to --max-connections (0)",
            "--max-unauthenticated must be from 1 to --max-connections (0)",
            "--max-unauthenticated-per-source must be from 1 to --max-unauthenticated (0)",
            "--retries must be from 0 to 10",
            "--shutdown-delay must be at most 1m",
            "--discovery-tokens: ",
            "--otlp-endpoint: ",
        ] {
            assert!(problems.iter().any(|problem| problem.contains(expected)), "{expected:?} in {problems:#?}");
        }
        assert_eq!(problems.len(), 14, "{problems:#?}");
        let problems = gateway_cli(&[
            "--discovery-tokens=/x",
            "--discovery-url=http://user:secret@discovery:8090",
            "--ban-statuses=403,418",
            "--throttle-statuses=429, 403",
        ])
        .settings()
        .expect_err("invalid");
        assert!(problems.iter().any(|problem| problem.contains("must not carry credentials")), "{problems:?}");
        assert!(!problems.iter().any(|problem| problem.contains("secret")), "a password is echoed: {problems:?}");
        assert!(problems.iter().any(|problem| problem.contains("both name 403")), "{problems:?}");
    }

    #[test]
    fn only_tokens_that_may_lease_use_the_gateway() {
        let file = tempfile::NamedTempFile::new().expect("file");
        std::fs::write(
            file.path(),
            "read read-token-0000000001 tenant=a\nlease lease-token-000000001 tenant=b\nadmin admin-token-000000001\n",
        )
        .expect("write");
        let tokens = LeaseTokens(TokenFile::load(file.path()).expect("tokens"));
        // A valid read token is told it lacks the lease scope, not that it is no token (regression).
        let refused = tokens.tenant("read-token-0000000001").expect_err("read may not");
        assert_eq!(refused, TokenRefused::Scope("read"));
        assert!(refused.explain().contains("has the read scope"), "{}", refused.explain());
        assert_eq!(tokens.tenant("lease-token-000000001").as_deref(), Ok("b"));
        assert!(tokens.tenant("admin-token-000000001").is_ok());
        assert_eq!(tokens.tenant("unknown"), Err(TokenRefused::Unknown));
    }
}
