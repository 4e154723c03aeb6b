//! Running external commands with their command line echoed and their failure turned into a clear error.

use std::process::Command;

use anyhow::{Context, Result, bail};

/// Runs the command with inherited output and fails, naming the command, when it does not exit successfully.
pub fn run(command: &mut Command) -> Result<()> {
    let shown = describe(command);
    eprintln!("$ {shown}");
    let status = command.status().with_context(|| format!("starting `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Runs the command and returns its standard output, or `None` when it cannot start or fails.
pub fn output(command: &mut Command) -> Option<String> {
    let output = command.output().ok()?;
    output.status.success().then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The cargo that runs this program (`$CARGO`, which `cargo run` sets), for commands that start it.
pub fn cargo_program() -> std::ffi::OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into())
}

/// A cargo command, using the cargo that runs this program.
pub fn cargo() -> Command {
    Command::new(cargo_program())
}

/// The command line, as shown before running it and in errors.
pub fn describe(command: &Command) -> String {
    let mut parts = vec![command.get_program().to_string_lossy().into_owned()];
    parts.extend(command.get_args().map(|arg| arg.to_string_lossy().into_owned()));
    parts.join(" ")
}
