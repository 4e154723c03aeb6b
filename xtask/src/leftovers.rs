//! What a run leaves behind: the processes of the programs the tests and the quickstart start, the network namespaces
//! and the `egress-*` entries of the temp directory. A snapshot taken before is compared with the state after; what is
//! new and still there is a leftover.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::process::output;

/// The programs the tests and the quickstart start, by their `comm` (at most 15 characters).
const PROGRAMS: [&str; 15] = [
    "etcd",
    "kube-apiserver",
    "kube-controller",
    "egress-operator",
    "squid",
    "xtask",
    "libvirtd",
    "dnsmasq",
    "qemu-system-x86",
    "python3",
    "node",
    "prometheus",
    "helm",
    "crun",
    "umoci",
];

/// Processes, network namespaces and temp entries at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    processes: BTreeSet<(u32, String)>,
    namespaces: BTreeSet<String>,
    temp: BTreeSet<String>,
}

impl Snapshot {
    /// The state now.
    pub fn take() -> Self {
        let own = std::process::id();
        let mut processes = BTreeSet::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
            let Ok(comm) = std::fs::read_to_string(entry.path().join("comm")) else { continue };
            let comm = comm.trim().to_owned();
            if pid != own && PROGRAMS.contains(&comm.as_str()) {
                processes.insert((pid, comm));
            }
        }
        let namespaces = output(Command::new("ip").args(["netns", "list"]))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| line.split_whitespace().next().map(str::to_owned))
            .collect();
        let temp = std::fs::read_dir(std::env::temp_dir())
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with("egress-") || name.starts_with("egressn"))
            .collect();
        Self { processes, namespaces, temp }
    }

    /// What is in `self` and was not in `before`.
    fn since(&self, before: &Self) -> Self {
        Self {
            processes: self.processes.difference(&before.processes).cloned().collect(),
            namespaces: self.namespaces.difference(&before.namespaces).cloned().collect(),
            temp: self.temp.difference(&before.temp).cloned().collect(),
        }
    }

    fn is_empty(&self) -> bool {
        self.processes.is_empty() && self.namespaces.is_empty() && self.temp.is_empty()
    }
}

/// Waits up to `grace` for everything new since `before` to go (the test support's cleanup gives processes 2 s to
/// stop and removes directories a few seconds after); fails naming what stayed.
pub fn assert_none_since(before: &Snapshot, what: &str, grace: Duration) -> Result<()> {
    let deadline = Instant::now() + grace;
    loop {
        let left = Snapshot::take().since(before);
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            let processes: Vec<String> = left
                .processes
                .iter()
                .map(|(pid, comm)| format!("{comm} (pid {pid}: {})", command_line(*pid)))
                .collect();
            bail!(
                "{what} left behind: processes {processes:?}, network namespaces {:?}, in {}: {:?}",
                left.namespaces,
                std::env::temp_dir().display(),
                left.temp
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn command_line(pid: u32) -> String {
    let path = PathBuf::from(format!("/proc/{pid}/cmdline"));
    let text = std::fs::read(path).unwrap_or_default();
    String::from_utf8_lossy(&text).replace('\0', " ").trim().chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_is_new_is_a_leftover() {
        let before = Snapshot {
            processes: [(1, "etcd".into())].into(),
            namespaces: ["a".into()].into(),
            temp: ["egress-x".into()].into(),
        };
        let after = Snapshot {
            processes: [(1, "etcd".into()), (2, "squid".into())].into(),
            namespaces: ["a".into()].into(),
            temp: BTreeSet::new(),
        };
        let left = after.since(&before);
        assert_eq!(left.processes, [(2, "squid".to_owned())].into());
        assert!(left.namespaces.is_empty() && left.temp.is_empty());
        assert!(!left.is_empty());
        assert!(before.since(&before).is_empty());
    }
}
