//! The Node modules the Node client's tests run with: `npm ci` from `clients/node/package-lock.json` into a directory
//! under the cache named by a hash of the lock file, the manifest and Node's version (npm's own download cache beside
//! it), so a warm machine reuses it and a changed lock file gets a new one. `clients/node/node_modules` is a symlink
//! to it, so every clone shares one install and Node's resolution finds it from the clone's sources.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

use crate::process::{output, run};
use crate::workspace_root;

/// The files `npm ci` reads: the key of the install, and what is copied beside it.
const INPUTS: [&str; 3] = ["package.json", "package-lock.json", ".npmrc"];

/// Makes `clients/node/node_modules` (a symlink into the cache), installing it if missing; returns its target.
pub fn ensure_modules() -> Result<PathBuf> {
    let project = workspace_root().join("clients/node");
    let version = output(Command::new("node").arg("--version"))
        .context("node is not on PATH; the Node client's tests need Node 18.17 or newer, with npm")?;
    check_version(version.trim())?;
    let mut hasher = Sha256::new();
    hasher.update(version.trim().as_bytes());
    for input in INPUTS {
        let path = project.join(input);
        hasher.update(input.as_bytes());
        hasher.update(std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?);
    }
    let key: String = hasher.finalize().iter().take(8).map(|byte| format!("{byte:02x}")).collect();
    let cache = egress_testenv::assets::cache_dir();
    let installs = cache.join("node");
    let install = installs.join(&key);
    let modules = install.join("node_modules");
    if !modules.is_dir() {
        std::fs::create_dir_all(&installs)?;
        // Made beside its final place and renamed, so a run killed half-way never leaves an install that looks whole.
        let partial = installs.join(format!("{key}.partial-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&partial);
        std::fs::create_dir_all(&partial)?;
        for input in INPUTS {
            std::fs::copy(project.join(input), partial.join(input)).with_context(|| format!("copying {input}"))?;
        }
        run(Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund", "--loglevel=error", "--cache"])
            .arg(cache.join("npm"))
            .current_dir(&partial))?;
        std::fs::rename(&partial, &install).with_context(|| format!("moving the install to {}", install.display()))?;
    }
    link(&project.join("node_modules"), &modules)?;
    Ok(modules)
}

/// Node 18.17 or newer (`--test`, `fetch`, `AbortSignal.timeout`).
fn check_version(version: &str) -> Result<()> {
    let parsed: Vec<u32> =
        version.trim_start_matches('v').split('.').take(2).filter_map(|part| part.parse().ok()).collect();
    match parsed.as_slice() {
        [major, minor] if (*major, *minor) >= (18, 17) => Ok(()),
        _ => bail!("node {version} is too old or unreadable: the Node client's tests need Node 18.17 or newer"),
    }
}

/// Points `link` at `target`, replacing an older symlink; a real directory there (a developer's own `npm install`)
/// is left alone.
fn link(link: &Path, target: &Path) -> Result<()> {
    match std::fs::symlink_metadata(link) {
        Ok(meta) if meta.file_type().is_symlink() => {
            if std::fs::read_link(link).ok().as_deref() == Some(target) {
                return Ok(());
            }
            std::fs::remove_file(link).with_context(|| format!("removing the old {}", link.display()))?;
        }
        Ok(_) => {
            eprintln!("note: {} is a directory of its own; the Node tests use it as it is", link.display());
            return Ok(());
        }
        Err(_) => {}
    }
    std::os::unix::fs::symlink(target, link)
        .with_context(|| format!("linking {} to {}", link.display(), target.display()))
}

#[cfg(test)]
mod tests {
    use super::check_version;

    #[test]
    fn node_versions_are_checked() {
        assert!(check_version("v20.20.2").is_ok());
        assert!(check_version("v18.17.0").is_ok());
        assert!(check_version("v22.1.0").is_ok());
        assert!(check_version("v18.16.1").unwrap_err().to_string().contains("18.17 or newer"));
        assert!(check_version("garbage").is_err());
    }
}
