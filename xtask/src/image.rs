//! `cargo xtask image`: builds the project's OCI images into the cache without a registry or a Docker daemon
//! (`egress_testenv::image` holds the recipes and says what each image is).
//!
//! The operator's image has two layers. The base, rebuilt only when the recipe's key changes: `mmdebstrap --variant=extract` unpacks the
//! packages and their dependencies from the host's apt sources (nothing runs inside it: no shell, no maintainer
//! script), the CA bundle is written as `update-ca-certificates` would, and unneeded directories are removed;
//! `umoci` turns it into an OCI layout. The top layer, rebuilt when the release binary changes: the binary at
//! `/usr/local/bin/egress-operator`, with the image's user, entrypoint and ports. Builds run in scratch directories
//! renamed into place at the end, so an interrupted build never leaves an image that looks finished.
//!
//! Squid's image is one layer, rebuilt when its recipe's key changes: `mmdebstrap --variant=minbase` installs
//! Debian trixie's `squid` (maintainer scripts run, so the `proxy` user and Squid's directories exist), from the
//! host's apt sources with the suite renamed.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use egress_testenv::image::{
    self, BINARY, CA_BUNDLE, PACKAGES, PORTS, REMOVED, SOURCE_FILE, SQUID_PACKAGES, SQUID_PORT, SQUID_SUITE, SUITE,
    TAG, USER, base_key, operator_layout, squid_key, squid_layout,
};

use crate::process::{cargo, run};

/// Builds both images where the cache does not hold them as their recipes say.
pub fn ensure_built() -> Result<()> {
    ensure_operator()?;
    ensure_squid()?;
    Ok(())
}

/// Builds the release binary, then the operator's image unless the cache holds it for this binary and recipe;
/// returns the OCI layout's path.
pub fn ensure_operator() -> Result<PathBuf> {
    let started = Instant::now();
    run(cargo().args(["build", "--release", "--locked", "-p", "egress-operator"]))?;
    let binary = release_binary();
    let source = format!("base {}\nbinary {} (stripped)\n", base_key(), crate::guest::sha256_file(&binary)?);
    let layout = operator_layout();
    if fs::read_to_string(layout.join(SOURCE_FILE)).is_ok_and(|recorded| recorded == source) {
        eprintln!("image: {} is current ({:.1} s)", layout.display(), started.elapsed().as_secs_f64());
        println!("{}", layout.display());
        return Ok(layout);
    }
    if !crate::packages::is_root() {
        bail!("building the image needs root (mmdebstrap unpacks packages, umoci keeps their owners)");
    }
    let base = ensure_base()?;
    build_into(&layout, "operator", |scratch| build_operator(&base, &binary, scratch, &source))?;
    report_built(&layout, started)?;
    Ok(layout)
}

/// Builds Squid's image unless the cache holds it for this recipe; returns the OCI layout's path.
pub fn ensure_squid() -> Result<PathBuf> {
    let started = Instant::now();
    let source = format!("squid {}\n", squid_key());
    let layout = squid_layout();
    if fs::read_to_string(layout.join(SOURCE_FILE)).is_ok_and(|recorded| recorded == source) {
        eprintln!("image: {} is current", layout.display());
        println!("{}", layout.display());
        return Ok(layout);
    }
    if !crate::packages::is_root() {
        bail!("building Squid's image needs root (mmdebstrap installs packages in a chroot)");
    }
    build_into(&layout, "squid", |scratch| build_squid(scratch, &source))?;
    report_built(&layout, started)?;
    Ok(layout)
}

/// Runs `build` in a scratch directory beside the cache's images, then renames the OCI layout it made there
/// (`<scratch>/layout`) to `layout`: a failed or interrupted build leaves nothing that looks finished.
fn build_into(layout: &Path, name: &str, build: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let scratch = image::image_dir().join(format!(".{name}-{}", std::process::id()));
    remove_if_present(&scratch)?;
    let built = build(&scratch);
    if built.is_err() {
        let _ = remove_if_present(&scratch);
    }
    built?;
    remove_if_present(layout)?;
    fs::rename(scratch.join("layout"), layout).with_context(|| format!("moving the image to {}", layout.display()))?;
    remove_if_present(&scratch)
}

fn report_built(layout: &Path, started: Instant) -> Result<()> {
    eprintln!(
        "image: built {} in {:.1} s ({} MiB of blobs)",
        layout.display(),
        started.elapsed().as_secs_f64(),
        directory_size(&layout.join("blobs"))? >> 20
    );
    println!("{}", layout.display());
    Ok(())
}

fn build_squid(scratch: &Path, source: &str) -> Result<()> {
    let layout = scratch.join("layout");
    let bundle = scratch.join("bundle");
    fs::create_dir_all(scratch)?;
    // The host's sources name its own suite; the same mirrors serve trixie, signed by keys in the same keyring.
    let host = crate::guest::host_sources()?;
    let text = fs::read_to_string(&host).with_context(|| format!("reading {}", host.display()))?;
    let sources = scratch.join(if host.extension().is_some_and(|extension| extension == "sources") {
        "squid.sources"
    } else {
        "squid.list"
    });
    fs::write(&sources, text.replace(SUITE, SQUID_SUITE))?;
    let image = format!("{}:{TAG}", layout.display());
    run(Command::new("umoci").args(["init", "--layout"]).arg(&layout))?;
    run(Command::new("umoci").args(["new", "--image"]).arg(&image))?;
    run(Command::new("umoci").args(["unpack", "--image"]).arg(&image).arg(&bundle))?;
    let rootfs = bundle.join("rootfs");
    run(Command::new("mmdebstrap")
        .args(["--variant=minbase", "--mode=root", "--quiet"])
        .arg(format!("--include={}", SQUID_PACKAGES.join(",")))
        .args([
            "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*",
            "--dpkgopt=path-exclude=/usr/share/info/*",
        ])
        .arg(SQUID_SUITE)
        .arg(&rootfs)
        .arg(&sources))?;
    // Package lists and downloaded packages: an image is rebuilt, not upgraded in place.
    for leftover in ["var/lib/apt/lists", "var/cache/apt"] {
        remove_if_present(&rootfs.join(leftover))?;
    }
    run(Command::new("umoci").args(["repack", "--image"]).arg(&image).arg(&bundle))?;
    run(Command::new("umoci")
        .args(["config", "--image"])
        .arg(&image)
        .args(["--config.cmd=squid", "--config.cmd=-N", "--config.cmd=-f", "--config.cmd=/etc/squid/squid.conf"])
        .arg("--config.workingdir=/")
        .arg(format!("--config.exposedports={SQUID_PORT}/tcp"))
        .arg("--author=egress-operator")
        .arg("--created=1970-01-01T00:00:00Z"))?;
    run(Command::new("umoci").args(["gc", "--layout"]).arg(&layout))?;
    fs::write(layout.join(SOURCE_FILE), source)?;
    Ok(())
}

fn release_binary() -> PathBuf {
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| crate::workspace_root().join("target"), PathBuf::from);
    target.join("release").join("egress-operator")
}

/// The base layer's OCI layout (tag `base`), built when its key is new.
fn ensure_base() -> Result<PathBuf> {
    let dir = image::image_dir().join(format!("base-{}", base_key()));
    if dir.join("index.json").is_file() {
        return Ok(dir);
    }
    let started = Instant::now();
    build_into(&dir, "base", build_base)?;
    eprintln!("image: built the base layer {} in {:.0} s", dir.display(), started.elapsed().as_secs_f64());
    // Bases of earlier recipes are not used again.
    for entry in fs::read_dir(image::image_dir())?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("base-") && entry.path() != dir {
            remove_if_present(&entry.path())?;
        }
    }
    Ok(dir)
}

fn build_base(scratch: &Path) -> Result<()> {
    let layout = scratch.join("layout");
    let bundle = scratch.join("bundle");
    fs::create_dir_all(scratch)?;
    run(Command::new("umoci").args(["init", "--layout"]).arg(&layout))?;
    run(Command::new("umoci").args(["new", "--image"]).arg(format!("{}:base", layout.display())))?;
    run(Command::new("umoci").args(["unpack", "--image"]).arg(format!("{}:base", layout.display())).arg(&bundle))?;
    let rootfs = bundle.join("rootfs");
    run(Command::new("mmdebstrap")
        .args(["--variant=extract", "--mode=root", "--quiet"])
        .arg(format!("--include={}", PACKAGES.join(",")))
        .arg(SUITE)
        .arg(&rootfs)
        .arg(crate::guest::host_sources()?))?;
    for removed in REMOVED {
        remove_if_present(&rootfs.join(removed))?;
    }
    fs::write(rootfs.join(CA_BUNDLE), ca_bundle(&rootfs.join("usr/share/ca-certificates/mozilla"))?)?;
    run(Command::new("umoci").args(["repack", "--image"]).arg(format!("{}:base", layout.display())).arg(&bundle))?;
    Ok(())
}

/// What `update-ca-certificates` writes with every Mozilla root enabled (Debian's default): the certificates in
/// file-name order, each ending in a newline.
fn ca_bundle(mozilla: &Path) -> Result<String> {
    let mut names: Vec<PathBuf> = fs::read_dir(mozilla)
        .with_context(|| format!("reading {}", mozilla.display()))?
        .map(|entry| entry.map(|entry| entry.path()))
        .collect::<Result<_, _>>()?;
    names.retain(|path| path.extension().is_some_and(|extension| extension == "crt"));
    names.sort();
    if names.is_empty() {
        bail!("{} holds no certificate", mozilla.display());
    }
    let mut bundle = String::new();
    for name in names {
        let pem = fs::read_to_string(&name).with_context(|| format!("reading {}", name.display()))?;
        bundle.push_str(&pem);
        if !pem.ends_with('\n') {
            bundle.push('\n');
        }
    }
    Ok(bundle)
}

fn build_operator(base: &Path, binary: &Path, scratch: &Path, source: &str) -> Result<()> {
    let layout = scratch.join("layout");
    let bundle = scratch.join("bundle");
    fs::create_dir_all(scratch)?;
    run(Command::new("cp").arg("-a").arg(base).arg(&layout))?;
    let image = format!("{}:{TAG}", layout.display());
    run(Command::new("umoci").args(["unpack", "--image"]).arg(format!("{}:base", layout.display())).arg(&bundle))?;
    let target = bundle.join("rootfs").join(BINARY.trim_start_matches('/'));
    fs::create_dir_all(target.parent().context("the binary's directory")?)?;
    // Without its symbol table and debug sections (a quarter of the release binary): a panic's backtrace still
    // names functions from the dynamic symbols it keeps, and the image is what gets pulled to every node.
    run(Command::new("strip").arg("--strip-all").arg("-o").arg(&target).arg(binary))?;
    run(Command::new("umoci").args(["repack", "--image"]).arg(&image).arg(&bundle))?;
    let mut config = Command::new("umoci");
    config
        .args(["config", "--image"])
        .arg(&image)
        .arg(format!("--config.user={USER}"))
        .arg(format!("--config.entrypoint={BINARY}"))
        .arg("--config.workingdir=/")
        .arg("--config.env=PATH=/usr/local/bin:/usr/bin:/bin")
        .arg("--author=egress-operator")
        .arg("--created=1970-01-01T00:00:00Z");
    for port in PORTS {
        config.arg(format!("--config.exposedports={port}/tcp"));
    }
    run(&mut config)?;
    run(Command::new("umoci").args(["rm", "--image"]).arg(format!("{}:base", layout.display())))?;
    run(Command::new("umoci").args(["gc", "--layout"]).arg(&layout))?;
    fs::write(layout.join(SOURCE_FILE), source)?;
    Ok(())
}

fn directory_size(path: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in fs::read_dir(path)? {
        let entry = entry?;
        total += if entry.file_type()?.is_dir() { directory_size(&entry.path())? } else { entry.metadata()?.len() };
    }
    Ok(total)
}

fn remove_if_present(path: &Path) -> Result<()> {
    match fs::symlink_metadata(path) {
        Ok(metadata) if metadata.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(_) => return Ok(()),
    }
    .with_context(|| format!("removing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_bundle_is_every_mozilla_root_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("b.crt"), "B\n").unwrap();
        fs::write(dir.path().join("a.crt"), "A").unwrap();
        fs::write(dir.path().join("notes.txt"), "not a certificate").unwrap();
        assert_eq!(ca_bundle(dir.path()).unwrap(), "A\nB\n");
        assert!(ca_bundle(&dir.path().join("absent")).is_err());
    }

    /// The Dockerfile builds the same layout: the same suite, packages, removals and bundle, the binary at the same
    /// path, the same user and ports.
    #[test]
    fn the_dockerfile_builds_the_same_layout() {
        let dockerfile = fs::read_to_string(crate::workspace_root().join("Dockerfile")).expect("the Dockerfile");
        let expected = [
            format!("--variant=extract --include={}", PACKAGES.join(",")),
            format!(" {SUITE} "),
            format!("COPY --from=build /egress-operator {BINARY}"),
            "strip --strip-all".to_owned(),
            format!("USER {USER}"),
            format!("EXPOSE {}", PORTS.map(|port| port.to_string()).join(" ")),
            format!("ENTRYPOINT [\"{BINARY}\"]"),
            format!("/{CA_BUNDLE}"),
            "FROM scratch".to_owned(),
        ];
        for line in expected {
            assert!(dockerfile.contains(&line), "the Dockerfile lacks {line:?}");
        }
        for removed in REMOVED {
            assert!(dockerfile.contains(&format!("/{removed}")), "the Dockerfile keeps {removed}");
        }
    }
}
