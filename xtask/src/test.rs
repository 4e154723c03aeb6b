//! `cargo xtask test`: everything CI runs, in the order that fails fastest.
//!
//! Set-up first (Debian packages, the control-plane binaries), then formatting, lints and the CRD drift check, which take seconds,
//! then every test in the workspace, which needs the control plane.

use anyhow::Result;

use crate::process::{cargo, run};
use crate::{crdgen, envtest, packages};

pub fn run_all(cargo_test_args: &[String]) -> Result<()> {
    packages::ensure_installed()?;
    envtest::ensure_built()?;
    run(cargo().args(["fmt", "--all", "--check"]))?;
    run(cargo().args(["clippy", "--workspace", "--all-targets", "--locked", "--", "-D", "warnings"]))?;
    crdgen::run(true)?;
    run(cargo().args(["test", "--workspace", "--locked"]).args(cargo_test_args))?;
    Ok(())
}
