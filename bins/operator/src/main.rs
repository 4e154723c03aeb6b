//! `egress-operator`: parses flags, validates them and the providers file (every problem at once), sets up
//! logging and tracing, and hands over to the composition in `run`.

mod flags;
mod run;
mod telemetry;
mod view;

use std::process::ExitCode;

use clap::Parser;

use crate::flags::Cli;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let settings = match cli.settings() {
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
