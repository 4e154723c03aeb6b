//! `cargo xtask bench [health|lease|discovery]`: runs the benchmarks (optimised builds) and lets them print their
//! figures and ratios. Without a name, runs all of them.

use anyhow::{Result, bail};

use crate::process::{cargo, run};

const BENCHES: [(&str, &str, &str); 3] = [
    ("health", "egress-health", "engine"),
    ("lease", "egress-lease", "store"),
    ("discovery", "egress-discovery", "http"),
];

pub fn run_benches(name: Option<&str>) -> Result<()> {
    let selected: Vec<_> = BENCHES.iter().filter(|(bench, _, _)| name.is_none_or(|name| name == *bench)).collect();
    if selected.is_empty() {
        let known: Vec<&str> = BENCHES.iter().map(|(bench, _, _)| *bench).collect();
        bail!("unknown benchmark {:?} (known: {})", name.unwrap_or_default(), known.join(", "));
    }
    for (_, package, target) in selected {
        run(cargo().args(["bench", "--locked", "-p", package, "--bench", target]))?;
    }
    Ok(())
}
