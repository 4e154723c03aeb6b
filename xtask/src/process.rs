//! Running external commands: `run` and `output` (shared with the bootstrap, which needs them before xtask
//! compiles) and the cargo that runs xtask.

use std::process::Command;

pub use xtask_bootstrap::process::{output, run};

/// A cargo command, using the cargo that runs xtask.
pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}
