//! `cargo xtask test`: everything CI runs, in the order that fails fastest.
//!
//! Set-up first (Debian packages; the control-plane binaries and helm, the Python client's venv and moto's, the Node
//! client's modules and the kvm boot test's guest image are made beside the Rust build), then formatting, lints, the
//! CRD drift check and the operator's OCI image (`cargo xtask image`), then every test in the workspace, which needs the
//! control plane, inside a network namespace with a pod network (see [`crate::podnet`]); last, when no test filter
//! was given, `cargo xtask quickstart --exit`, then a quickstart stopped with SIGTERM; and at the very end, a check
//! that no process, network namespace or temp entry the run made is left.

use std::time::Duration;

use anyhow::{Result, anyhow};

use crate::process::{cargo, cargo_program, run};
use crate::{crdgen, envtest, guest, helm, image, leftovers, node, packages, podnet, python};

pub fn run_all(cargo_test_args: &[String]) -> Result<()> {
    let before = leftovers::Snapshot::take();
    packages::ensure_installed()?;
    // The control plane's Go build (minutes on a fresh machine, nothing on a warm one) runs beside the Rust build,
    // which does not need it: each fills the cores the other leaves idle (a big crate or a link compiling alone,
    // downloads). Only the tests need the binaries.
    // helm follows it in the same thread: the two share Go packages, which then compile once.
    let control_plane = std::thread::spawn(|| envtest::ensure_built().and_then(|_| helm::ensure_built()));
    // So does the Python client's venv (a download on a fresh machine, nothing on a warm one).
    let venv = std::thread::spawn(python::ensure_venv);
    // And moto's EC2 emulator, for the aws provider's tests.
    let moto = std::thread::spawn(python::ensure_moto);
    // And the Node client's modules, and the guest image (two minutes of packages on a fresh machine, then cached).
    let modules = std::thread::spawn(node::ensure_modules);
    let image = std::thread::spawn(guest::ensure_built);
    let checked = check_and_build();
    let built = control_plane.join().map_err(|_| anyhow!("building the control plane panicked"))?;
    let python = venv.join().map_err(|_| anyhow!("making the Python venv panicked"))?;
    let moto = moto.join().map_err(|_| anyhow!("making the moto venv panicked"))?;
    let modules = modules.join().map_err(|_| anyhow!("installing the Node modules panicked"))?;
    let image = image.join().map_err(|_| anyhow!("building the guest image panicked"))?;
    checked?;
    // The operator's OCI image, which its test runs with crun: the release build (cargo serialises it behind the
    // test build above, which holds the same target directory), then a new top layer only when the binary changed.
    image::ensure_built()?;
    built?;
    let python = python?;
    let moto = moto?;
    modules?;
    image?;
    let network = podnet::PodNetwork::create()?;
    let mut tests = network.command(cargo_program());
    run(crate::process::forget_cargo_run(&mut tests)
        .env("EGRESS_PYTHON", &python)
        .env("EGRESS_MOTO_PYTHON", &moto)
        .args(["test", "--workspace", "--locked", "--offline"])
        .args(cargo_test_args))?;
    drop(network);
    // The README's first command is a promise too: run it as a user would, to the end of its demo.
    if cargo_test_args.is_empty() {
        crate::quickstart::run_built(true, None)?;
        // And so is stopping it: SIGTERM leaves nothing behind.
        crate::quickstart::check_sigterm_cleans_up()?;
    }
    // Nothing this run started outlives it (a daemonized QEMU of libvirtd's once ran on for 90 minutes).
    leftovers::assert_none_since(&before, "`cargo xtask test`", Duration::from_secs(20))
}

/// Formatting, lints, the CRD drift check and the test build: everything before the tests that needs no control
/// plane, in the order that fails fastest.
fn check_and_build() -> Result<()> {
    run(cargo().args(["fmt", "--all", "--check"]))?;
    run(cargo().args(["clippy", "--workspace", "--all-targets", "--locked", "--", "-D", "warnings"]))?;
    crdgen::run(true)?;
    // Built here, where the crate registry is reachable; run inside the tests' network namespace, which has none.
    run(cargo().args(["test", "--workspace", "--locked", "--no-run"]))
}
