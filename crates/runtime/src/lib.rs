//! The egress-operator's composition, as a library: flags and their validation ([`Cli`], [`Settings`]), logging and
//! tracing, and [`run`], which builds every part from the settings, serves metrics, health and discovery on every
//! replica, and runs the leader-only parts (controller, health engine, orphan collector, provider monitor) for each
//! term of leadership; and the gateway's process ([`gateway`], `egress-operator gateway`). The binary only parses
//! flags and calls [`Cli::run`]; tests can call [`run`] and [`gateway::run`] in-process.
//!
//! This crate is the composition root, so like a binary it reports errors with `anyhow`: nothing here branches on
//! an error's kind, each is printed once at the top.

mod discovery_feed;
pub mod durable;
mod durations;
pub mod election;
mod flags;
pub mod gateway;
mod handoff;
mod providers;
pub mod role_label;
mod run;
mod serving;
mod telemetry;

use std::process::ExitCode;

pub use discovery_feed::{proxy_record, run_discovery_feed};
pub use flags::{Cli, Command, DiscoveryAuth, LogFormat, Settings, parse_duration};
pub use run::{provider_types, run};

impl Cli {
    /// Validates the flags (and the operator's providers file: every problem at once, exit code 2), sets up logging
    /// and tracing, and runs the operator, or the gateway with `gateway`, until SIGTERM; the exit code says how it
    /// ended.
    pub fn run(self) -> ExitCode {
        match &self.command {
            Some(Command::Gateway(gateway)) => match gateway.settings() {
                Ok(settings) => {
                    let (format, otlp) = (settings.log_format, settings.otlp_endpoint.clone());
                    on_runtime(format, otlp, "egress-gateway", None, gateway::run(settings))
                }
                Err(problems) => configuration_problems(&problems),
            },
            None => match self.settings() {
                Ok(settings) => {
                    let (format, otlp) = (settings.log_format, settings.otlp_endpoint.clone());
                    let cluster_id = Some(settings.cluster_id.clone());
                    on_runtime(format, otlp, "egress-operator", cluster_id, run::run(settings))
                }
                Err(problems) => configuration_problems(&problems),
            },
        }
    }
}

/// Prints every problem in the flags; exit code 2.
fn configuration_problems(problems: &[String]) -> ExitCode {
    eprintln!(
        "egress-operator: {} problem{} in the configuration:",
        problems.len(),
        if problems.len() == 1 { "" } else { "s" }
    );
    for problem in problems {
        eprintln!("  - {problem}");
    }
    ExitCode::from(2)
}

/// Runs `main` on a multi-threaded runtime with logging and tracing set up for `service`; an error it ends with is
/// logged, and the exit code says whether it did.
fn on_runtime(
    format: LogFormat,
    otlp: Option<http::Uri>,
    service: &'static str,
    cluster_id: Option<String>,
    main: impl Future<Output = anyhow::Result<()>>,
) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("{service}: starting the runtime failed: {error}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let telemetry = match telemetry::init(format, otlp.as_ref(), service, cluster_id.as_deref()) {
            Ok(telemetry) => telemetry,
            Err(error) => {
                eprintln!("{service}: {error:#}");
                return ExitCode::FAILURE;
            }
        };
        let result = main.await;
        if let Err(error) = &result {
            tracing::error!("{error:#}");
        }
        telemetry.shutdown().await;
        if result.is_ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
    })
}
