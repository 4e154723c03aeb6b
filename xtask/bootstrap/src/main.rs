//! `cargo xtask ARGS`: installs the Debian packages that compiling xtask needs when they are missing (a fresh
//! machine), then becomes `cargo run --quiet --package xtask -- ARGS`.

use std::os::unix::process::CommandExt;
use std::process::ExitCode;

fn main() -> ExitCode {
    if let Err(error) = xtask_bootstrap::packages::ensure(xtask_bootstrap::packages::TO_BUILD_XTASK) {
        eprintln!("error: {error:#}");
        return ExitCode::FAILURE;
    }
    let mut xtask = xtask_bootstrap::process::cargo();
    xtask.args(["run", "--quiet", "--package", "xtask", "--"]).args(std::env::args_os().skip(1));
    // Only returns when the exec failed.
    let error = xtask.exec();
    eprintln!("error: running `{}`: {error}", xtask_bootstrap::process::describe(&xtask));
    ExitCode::FAILURE
}
