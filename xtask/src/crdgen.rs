//! `cargo xtask crdgen`: writes `crds/` from the Rust types, or with `--check` reports which files are stale.

use std::fs;

use anyhow::{Context, Result, bail};

use crate::workspace_root;

pub fn run(check: bool) -> Result<()> {
    let dir = workspace_root().join("crds");
    let files = egress_api::crdgen::files().context("rendering the CRDs as YAML")?;
    if check {
        let mut stale = Vec::new();
        for file in &files {
            let path = dir.join(&file.file_name);
            match fs::read_to_string(&path) {
                Ok(committed) if committed == file.contents => {}
                Ok(_) => stale.push(format!("{} differs from the Rust types in crates/api", path.display())),
                Err(error) => stale.push(format!("{} cannot be read: {error}", path.display())),
            }
        }
        let known: Vec<&str> = files.iter().map(|file| file.file_name.as_str()).collect();
        for entry in fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if name.ends_with(".yaml") && !known.contains(&name.as_str()) {
                stale.push(format!("{} is not generated from any Rust type", dir.join(&name).display()));
            }
        }
        if !stale.is_empty() {
            bail!(
                "the committed CRDs are stale; run `cargo xtask crdgen` and commit the result:\n  {}",
                stale.join("\n  ")
            );
        }
        println!("crds/ is up to date ({} files)", files.len());
        return Ok(());
    }
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for file in &files {
        let path = dir.join(&file.file_name);
        fs::write(&path, &file.contents).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
