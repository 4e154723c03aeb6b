//! The egress-operator's composition, as a library: flags and their validation ([`Cli`], [`Settings`]), logging and
//! tracing, and [`run`], which builds every part from the settings, serves metrics, health and discovery on every
//! replica, and runs the leader-only parts (controller, health engine, orphan collector, provider monitor) for each
//! term of leadership. The binary only parses flags and calls [`Cli::run`]; tests can call [`run`] in-process.
//!
//! This crate is the composition root, so like a binary it reports errors with `anyhow`: nothing here branches on
//! an error's kind, each is printed once at the top.

mod discovery_feed;
pub mod durable;
pub mod election;
mod flags;
mod handoff;
mod providers;
pub mod role_label;
mod run;
mod telemetry;

use std::process::ExitCode;

pub use discovery_feed::{proxy_record, run_discovery_feed};
pub use flags::{Cli, DiscoveryAuth, LogFormat, Settings, parse_duration};
pub use run::{provider_types, run};

impl Cli {
    /// Validates the flags and the providers file (every problem at once, exit code 2), sets up logging and
    /// tracing, and runs the operator until SIGTERM; the exit code says how it ended.
    pub fn run(self) -> ExitCode {
        let settings = match self.settings() {
            Ok(settings) => settings,
            Err(problems) => {
                eprintln!(
                    "egress-operator: {} problem{} in the configuration:",
                    problems.len(),
                    if problems.len() == 1 { "" } else { "s" }
                );
                for problem in &problems {
                    eprintln!("  - {problem}");
                }
                return ExitCode::from(2);
            }
        };
        let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
            Ok(runtime) => runtime,
            Err(error) => {
                eprintln!("egress-operator: starting the runtime failed: {error}");
                return ExitCode::FAILURE;
            }
        };
        runtime.block_on(async {
            let telemetry =
                match telemetry::init(settings.log_format, settings.otlp_endpoint.as_ref(), &settings.cluster_id) {
                    Ok(telemetry) => telemetry,
                    Err(error) => {
                        eprintln!("egress-operator: {error:#}");
                        return ExitCode::FAILURE;
                    }
                };
            let result = run::run(settings).await;
            if let Err(error) = &result {
                tracing::error!("{error:#}");
            }
            telemetry.shutdown().await;
            if result.is_ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
        })
    }
}
