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

/// A cargo command, using the cargo that runs this program, without what `cargo run` told this program.
pub fn cargo() -> Command {
    let mut command = Command::new(cargo_program());
    forget_cargo_run(&mut command);
    command
}

/// Removes from `command`'s environment what `cargo run` set for the program it ran (its package and manifest), so
/// the cargo that `command` starts sees the environment the user's cargo did. Build scripts watch some of it (ring's
/// watches `CARGO_MANIFEST_DIR`): inherited, it differed between the cargo that builds xtask (run by the bootstrap)
/// and the ones xtask starts, and each rebuilt ring and all that depends on it (rustls, kube, the workspace), twice
/// per `cargo xtask test`.
pub fn forget_cargo_run(command: &mut Command) -> &mut Command {
    for (name, _) in std::env::vars_os() {
        if set_by_cargo_run(&name.to_string_lossy()) {
            command.env_remove(&name);
        }
    }
    command
}

/// A variable `cargo run` sets for the program it runs (`CARGO`, the cargo itself, is kept: commands start it).
fn set_by_cargo_run(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
        || matches!(
            name,
            "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
        )
}

/// The command line, as shown before running it and in errors.
pub fn describe(command: &Command) -> String {
    let mut parts = vec![command.get_program().to_string_lossy().into_owned()];
    parts.extend(command.get_args().map(|arg| arg.to_string_lossy().into_owned()));
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cargo_commands_do_not_inherit_what_cargo_run_set() {
        for name in [
            "CARGO_MANIFEST_DIR",
            "CARGO_MANIFEST_PATH",
            "CARGO_PKG_NAME",
            "CARGO_PKG_VERSION_MAJOR",
            "CARGO_CRATE_NAME",
        ] {
            assert!(set_by_cargo_run(name), "{name}");
        }
        for name in ["CARGO", "CARGO_TARGET_DIR", "CARGO_HOME", "CARGO_TERM_COLOR", "PATH"] {
            assert!(!set_by_cargo_run(name), "{name}");
        }
        // This test runs under cargo, which set CARGO_MANIFEST_DIR: a cargo command removes it.
        assert!(std::env::var_os("CARGO_MANIFEST_DIR").is_some());
        let command = cargo();
        let removed: Vec<_> = command.get_envs().filter(|(_, value)| value.is_none()).map(|(name, _)| name).collect();
        assert!(removed.iter().any(|name| *name == "CARGO_MANIFEST_DIR"), "{removed:?}");
        assert!(removed.iter().any(|name| *name == "CARGO_PKG_NAME"), "{removed:?}");
    }
}
