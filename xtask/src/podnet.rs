//! The network namespace the tests run in, with a pod network of its own.
//!
//! EndpointSlices refuse loopback addresses, so pods that Services route to need other addresses; the only other
//! addresses a test may use are ones inside a network namespace it made. `cargo xtask test` and `cargo xtask e2e`
//! therefore create a namespace whose loopback interface also holds [`POD_NETWORK`] (every address of it is then
//! local, as 127.0.0.0/8 is, with no dummy or veth driver needed), run the test
//! binaries inside it (built outside first, where the crate registry is reachable), and delete it afterwards. The
//! node agent hands pods addresses from that network (`EGRESS_TEST_POD_NETWORK`); everything else stays on
//! loopback. No traffic can leave the namespace: it has no route out.

use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::process::{output, run};

/// The pod network, as the dummy interface's address and prefix.
pub const POD_NETWORK: &str = "10.244.0.1/16";

/// The interface that holds it: the namespace's own loopback.
const INTERFACE: &str = "lo";

/// Namespaces are named with this prefix and the creating process's ID.
const PREFIX: &str = "egress-test-";

/// A network namespace that exists while this value lives.
pub struct PodNetwork {
    name: String,
}

impl PodNetwork {
    /// Creates the namespace (removing any left by a run that was killed), or says why it cannot.
    pub fn create() -> Result<Self> {
        if output(Command::new("id").arg("-u")).is_none_or(|uid| uid.trim() != "0") {
            bail!(
                "the tests run in a network namespace of their own (pods need non-loopback addresses for \
                 EndpointSlices), which needs root: run `cargo xtask test` as root"
            );
        }
        if output(Command::new("ip").arg("-V")).is_none() {
            bail!("`ip` (iproute2) is missing: install it with `apt-get install iproute2`");
        }
        remove_stale();
        let name = format!("{PREFIX}{}", std::process::id());
        run(Command::new("ip").args(["netns", "add", &name])).context("creating the tests' network namespace")?;
        let network = Self { name };
        for args in [vec!["link", "set", INTERFACE, "up"], vec!["addr", "add", POD_NETWORK, "dev", INTERFACE]] {
            run(Command::new("ip").args(["-n", &network.name]).args(&args))
                .context("setting up the tests' network namespace")?;
        }
        eprintln!("tests run in network namespace {} (pod network {POD_NETWORK} on {INTERFACE})", network.name);
        Ok(network)
    }

    /// The namespace's name (for `ip netns exec`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `program` to run inside the namespace, told the pod network.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.name]).arg(program).env(egress_testenv::POD_NETWORK_ENV, POD_NETWORK);
        command
    }
}

impl Drop for PodNetwork {
    fn drop(&mut self) {
        let _ = output(Command::new("ip").args(["netns", "del", &self.name]));
    }
}

/// Deletes the namespaces of earlier runs whose process is gone.
fn remove_stale() {
    let Some(list) = output(Command::new("ip").args(["netns", "list"])) else { return };
    for name in stale(&list, |pid| std::path::Path::new(&format!("/proc/{pid}")).exists()) {
        let _ = output(Command::new("ip").args(["netns", "del", &name]));
    }
}

/// The namespaces in `ip netns list` output that this tool made for a process that no longer `alive`s.
fn stale(list: &str, alive: impl Fn(u32) -> bool) -> Vec<String> {
    list.lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter_map(|name| Some((name, name.strip_prefix(PREFIX)?.parse::<u32>().ok()?)))
        .filter(|(_, pid)| !alive(*pid))
        .map(|(name, _)| name.to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_namespaces_of_dead_runs_are_stale() {
        let list = "egress-test-100 (id: 3)\negress-test-200\nsomeone-else-300\negress-test-x\n";
        assert_eq!(stale(list, |pid| pid == 200), ["egress-test-100"]);
    }
}
