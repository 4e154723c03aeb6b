//! `egress-operator`: parses the command line and hands over to the composition in `egress-runtime`.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    egress_runtime::Cli::parse().run()
}
