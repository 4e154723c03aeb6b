//! `cargo xtask test`: everything CI runs, in the order that fails fastest.
//!
//! Set-up first (Debian packages, the control-plane binaries), then formatting, lints and the CRD drift check, which take seconds,
//! then every test in the workspace, which needs the control plane, inside a network namespace with a pod network
//! (see [`crate::podnet`]); last, when no test filter was given, `cargo xtask quickstart --exit`.

use anyhow::Result;

use crate::process::{cargo, run};
use crate::{crdgen, envtest, packages, podnet};

pub fn run_all(cargo_test_args: &[String]) -> Result<()> {
    packages::ensure_installed()?;
    envtest::ensure_built()?;
    run(cargo().args(["fmt", "--all", "--check"]))?;
    run(cargo().args(["clippy", "--workspace", "--all-targets", "--locked", "--", "-D", "warnings"]))?;
    crdgen::run(true)?;
    // Built here, where the crate registry is reachable; run inside the tests' network namespace, which has none.
    run(cargo().args(["test", "--workspace", "--locked", "--no-run"]))?;
    let network = podnet::PodNetwork::create()?;
    run(network.command(cargo_program()).args(["test", "--workspace", "--locked", "--offline"]).args(cargo_test_args))?;
    drop(network);
    // The README's first command is a promise too: run it as a user would, to the end of its demo.
    if cargo_test_args.is_empty() {
        crate::quickstart::run_built(true, None)?;
    }
    Ok(())
}

/// The cargo that runs xtask, for commands that start it through another program.
pub fn cargo_program() -> std::ffi::OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into())
}
