//! `cargo xtask e2e`: the end-to-end suite (the real operator binary under the shipped RBAC, against the local
//! control plane with the node agent). `cargo xtask test` runs it too, with every other test.

use anyhow::Result;

use crate::process::{cargo, run};
use crate::{envtest, packages};

pub fn run_suite(cargo_test_args: &[String]) -> Result<()> {
    packages::ensure_installed()?;
    envtest::ensure_built()?;
    run(cargo().args(["test", "--locked", "-p", "egress-operator", "--test", "e2e"]).args(cargo_test_args))
}
