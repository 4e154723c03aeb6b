//! Builds helm from its Go module (`xtask/helm`) into the cache, for the chart's tests: `helm lint`, `helm template`
//! and `helm install`/`upgrade`/`uninstall` on the local control plane. Like kubectl, it is built, not downloaded:
//! the Go module proxy is the one source of Go programs this project trusts.

use std::fs;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use egress_testenv::assets::{self, HELM_VERSION};

use crate::process::{output, run};
use crate::workspace_root;

/// Builds helm unless the cache holds it at [`HELM_VERSION`].
pub fn ensure_built() -> Result<()> {
    let path = assets::helm();
    if is_current() {
        eprintln!("helm {HELM_VERSION} is present at {}", path.display());
        return Ok(());
    }
    let dir = path.parent().context("the helm path has a directory")?;
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // Built beside and renamed into place, so an interrupted build never leaves a truncated binary that looks current.
    let scratch = dir.join(format!(".helm-{}", std::process::id()));
    let started = Instant::now();
    eprintln!("helm: building {HELM_VERSION} from its Go module (a minute or two on a fresh machine)");
    run(Command::new("go")
        .current_dir(workspace_root().join("xtask").join("helm"))
        .env("CGO_ENABLED", "0")
        .args(["build", "-trimpath", "-ldflags"])
        .arg(format!("-s -w -X helm.sh/helm/v4/internal/version.version={HELM_VERSION}"))
        .arg("-o")
        .arg(&scratch)
        .arg("helm.sh/helm/v4/cmd/helm"))?;
    fs::rename(&scratch, &path).with_context(|| format!("moving helm into {}", dir.display()))?;
    if !is_current() {
        bail!("the freshly built {} does not report {HELM_VERSION}", path.display());
    }
    eprintln!("helm: built in {:.0?}", started.elapsed());
    Ok(())
}

fn is_current() -> bool {
    output(Command::new(assets::helm()).args(["version", "--short"]))
        .is_some_and(|text| text.trim().starts_with(HELM_VERSION))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_go_module_requires_the_helm_the_tests_expect() {
        let go_mod = fs::read_to_string(workspace_root().join("xtask/helm/go.mod")).expect("xtask/helm/go.mod");
        assert!(go_mod.contains(&format!("helm.sh/helm/v4 {HELM_VERSION}")), "go.mod must require helm {HELM_VERSION}");
    }
}
