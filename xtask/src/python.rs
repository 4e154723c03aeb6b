//! The Python the client tests run with: a venv holding exactly `clients/python/requirements-test.lock` (and the
//! same packages as wheels in its `wheelhouse`, for installs without an index), made once
//! under the cache directory and named by a hash of the lock file and the interpreter's version, so a warm machine
//! reuses it and a changed lock file gets a new one. The client itself is not installed into it: the tests import it
//! from the clone (`PYTHONPATH`), so one venv serves every clone.
//!
//! A second venv, made the same way from `xtask/moto-requirements.lock`, holds moto's `moto_server` (the EC2 and STS
//! emulator the aws provider is tested against): apart, so neither lock file's versions constrain the other's.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};

use crate::process::{output, run};
use crate::workspace_root;

/// The client's venv's interpreter, made if missing.
pub fn ensure_venv() -> Result<PathBuf> {
    Ok(ensure_from("clients/python/requirements-test.lock", "python", true)?.join("bin/python"))
}

/// The moto venv's interpreter (run as `python -m moto.server`: a venv's scripts name the directory it was made in,
/// which is renamed), made if missing.
pub fn ensure_moto() -> Result<PathBuf> {
    Ok(ensure_from("xtask/moto-requirements.lock", "moto", false)?.join("bin/python"))
}

/// The venv under the cache's `kind` directory holding exactly the lock file `lock` (a path in the workspace), and
/// with `wheelhouse` the same packages as wheels; made if missing.
fn ensure_from(lock: &str, kind: &str, wheelhouse: bool) -> Result<PathBuf> {
    let lock_path = workspace_root().join(lock);
    let lock = std::fs::read(&lock_path).with_context(|| format!("reading {}", lock_path.display()))?;
    let version = output(Command::new("python3").arg("--version"))
        .context("python3 is not on PATH; the Python client's tests need Python 3.9 or newer")?;
    let mut hasher = Sha256::new();
    hasher.update(version.trim().as_bytes());
    hasher.update(&lock);
    let key: String = hasher.finalize().iter().take(8).map(|byte| format!("{byte:02x}")).collect();
    let venvs = egress_testenv::assets::cache_dir().join(kind);
    let venv = venvs.join(&key);
    if venv.join("bin/python").is_file() {
        return Ok(venv);
    }
    std::fs::create_dir_all(&venvs)?;
    // Made beside its final place and renamed, so a run killed half-way never leaves a venv that looks complete.
    let partial = venvs.join(format!("{key}.partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    run(Command::new("python3").args(["-m", "venv"]).arg(&partial))?;
    run(Command::new(partial.join("bin/pip"))
        .args(["install", "--quiet", "--disable-pip-version-check", "--no-input", "--require-virtualenv", "-r"])
        .arg(&lock_path))?;
    // The same wheels, for the packaging test: it installs the built client into a clean venv with no index (the
    // tests' network namespace reaches no registry).
    if wheelhouse {
        run(Command::new(partial.join("bin/pip"))
            .args(["download", "--quiet", "--disable-pip-version-check", "--no-input", "--no-deps", "--dest"])
            .arg(partial.join("wheelhouse"))
            .arg("-r")
            .arg(&lock_path))?;
    }
    std::fs::rename(&partial, &venv).with_context(|| format!("moving the venv to {}", venv.display()))?;
    Ok(venv)
}
