//! `cargo xtask bench [health|lease|discovery|gateway|fleet [N...]]`: runs the benchmarks (optimised builds) and lets
//! them print their figures and ratios. Without a name, runs all of them (the fleet at its default sizes, 100 and 1,000).

use anyhow::{Result, bail};

use crate::process::{cargo, run};

const BENCHES: [(&str, &str, &str); 6] = [
    ("health", "egress-health", "engine"),
    ("lease", "egress-lease", "store"),
    // The shared state against the in-memory store through the same port, on a real redis-server.
    ("lease", "egress-lease-redis", "shared"),
    ("discovery", "egress-discovery", "http"),
    ("gateway", "egress-gateway", "gateway"),
    ("fleet", "egress-operator", "fleet"),
];

/// Runs the benchmark `name` (all without one); `sizes` are the fleet benchmark's Proxy counts.
pub fn run_benches(name: Option<&str>, sizes: &[String]) -> Result<()> {
    if !sizes.is_empty() && name != Some("fleet") {
        bail!("only the fleet benchmark takes sizes (cargo xtask bench fleet 100 1000 10000)");
    }
    if let Some(bad) = sizes.iter().find(|size| size.parse::<u32>().map_or(true, |size| size == 0)) {
        bail!("fleet sizes are positive whole numbers of Proxies, not {bad:?}");
    }
    let selected: Vec<_> = BENCHES.iter().filter(|(bench, _, _)| name.is_none_or(|name| name == *bench)).collect();
    if selected.is_empty() {
        let known: Vec<&str> = BENCHES.iter().map(|(bench, _, _)| *bench).collect();
        bail!("unknown benchmark {:?} (known: {})", name.unwrap_or_default(), known.join(", "));
    }
    for (bench, package, target) in selected {
        let mut command = cargo();
        command.args(["bench", "--locked", "-p", package, "--bench", target]);
        if *bench == "gateway" || *package == "egress-lease-redis" {
            // Squid, which the gateway is measured against and in front of; redis-server for the shared state.
            crate::packages::ensure_installed()?;
        }
        if *bench == "fleet" {
            // The fleet needs the control plane and Squid; its operator logs only warnings, so logging stays out
            // of the measurement.
            crate::packages::ensure_installed()?;
            crate::envtest::ensure_built()?;
            command.env("RUST_LOG", "warn").arg("--").args(sizes);
        }
        run(&mut command)?;
    }
    Ok(())
}
