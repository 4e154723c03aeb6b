//! Bakes the git commit into the binary for `--version` (or `unknown` outside a git checkout).

fn main() {
    let commit = std::env::var("EGRESS_GIT_COMMIT").ok().filter(|commit| !commit.is_empty()).or_else(|| {
        std::process::Command::new("git")
            .args(["rev-parse", "--short=12", "HEAD"])
            .output()
            .ok()
            .filter(|output| output.status.success())
            .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned())
    });
    println!("cargo:rustc-env=EGRESS_GIT_COMMIT={}", commit.unwrap_or_else(|| "unknown".into()));
    println!("cargo:rerun-if-env-changed=EGRESS_GIT_COMMIT");
    println!("cargo:rerun-if-changed=../../.git/HEAD");
}
