//! Running external commands, and the cargo that runs xtask: the bootstrap's, which needs them before xtask
//! compiles.

pub use xtask_bootstrap::process::{cargo, cargo_program, forget_cargo_run, output, run};
