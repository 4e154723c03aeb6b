//! `cargo xtask crdgen`: writes the generated files — the CRDs under `crds/` from the Rust types, and
//! `docs/discovery-openapi.json` from the discovery API — or with `--check` reports which are stale.

use std::fs;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use crate::workspace_root;

/// Every generated file: its path under the workspace root and its content.
fn generated() -> Result<Vec<(PathBuf, String)>> {
    let mut files: Vec<(PathBuf, String)> = egress_api::crdgen::files()
        .context("rendering the CRDs as YAML")?
        .into_iter()
        .map(|file| (PathBuf::from("crds").join(file.file_name), file.contents))
        .collect();
    let openapi = serde_json::to_string_pretty(&egress_discovery::openapi::document())
        .context("rendering the OpenAPI document")?;
    files.push((PathBuf::from("docs/discovery-openapi.json"), format!("{openapi}\n")));
    Ok(files)
}

pub fn run(check: bool) -> Result<()> {
    let root = workspace_root();
    let files = generated()?;
    if check {
        let mut stale = Vec::new();
        for (relative, contents) in &files {
            let path = root.join(relative);
            match fs::read_to_string(&path) {
                Ok(committed) if committed == *contents => {}
                Ok(_) => stale.push(format!("{} differs from what the Rust code generates", relative.display())),
                Err(error) => stale.push(format!("{} cannot be read: {error}", relative.display())),
            }
        }
        let crds = root.join("crds");
        for entry in fs::read_dir(&crds).with_context(|| format!("reading {}", crds.display()))? {
            let name = PathBuf::from("crds").join(entry?.file_name());
            if name.extension().is_some_and(|ext| ext == "yaml") && !files.iter().any(|(relative, _)| *relative == name)
            {
                stale.push(format!("{} is not generated from any Rust type", name.display()));
            }
        }
        if !stale.is_empty() {
            bail!(
                "generated files are stale; run `cargo xtask crdgen` and commit the result:\n  {}",
                stale.join("\n  ")
            );
        }
        println!("generated files are up to date ({} files)", files.len());
        return Ok(());
    }
    for (relative, contents) in &files {
        let path = root.join(relative);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        fs::write(&path, contents).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", relative.display());
    }
    Ok(())
}
