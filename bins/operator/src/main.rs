//! `egress-operator`: parses flags, validates them and the providers file (every problem at once), sets up
//! logging, and hands over to the composition in `run`.

mod flags;
mod run;
mod view;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

use crate::flags::{Cli, LogFormat};

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
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,kube=warn,hyper=warn,tower=warn"));
    match cli.log_format {
        // Colours only on a terminal: a log file or collector gets plain text.
        LogFormat::Text => {
            tracing_subscriber::fmt().with_env_filter(filter).with_ansi(std::io::stdout().is_terminal()).init()
        }
        LogFormat::Json => tracing_subscriber::fmt().json().with_env_filter(filter).init(),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("egress-operator: starting the runtime failed: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run::run(settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{error:#}");
            ExitCode::FAILURE
        }
    }
}
