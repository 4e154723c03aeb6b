//! The control plane leaves nothing behind: dropping it, or killing the process that started it with SIGKILL,
//! stops etcd and kube-apiserver and removes the temporary directory.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use egress_testenv::{ControlPlane, eventually};

/// Set in the re-executed copy of this test binary that plays the process to be killed.
const CHILD_ENV: &str = "EGRESS_TESTENV_LIFECYCLE_CHILD";

fn alive(pid: u32) -> bool {
    // A zombie has exited; it only waits to be reaped by whoever inherited it.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')))
        .unwrap_or(false)
}

fn control_plane_pids(dir: &Path) -> Vec<u32> {
    let marker = dir.display().to_string();
    std::fs::read_dir("/proc")
        .expect("/proc is readable")
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|cmdline| String::from_utf8_lossy(&cmdline).contains(&marker))
                .unwrap_or(false)
        })
        .collect()
}

fn state_dir(plane: &ControlPlane) -> PathBuf {
    plane.kubeconfig_path().parent().expect("the kubeconfig sits in the state directory").to_path_buf()
}

#[tokio::test]
async fn dropping_the_control_plane_stops_it_and_removes_its_files() {
    let plane = ControlPlane::start().await.expect("the control plane starts");
    let dir = state_dir(&plane);
    let pids = control_plane_pids(&dir);
    assert!(pids.len() >= 2, "etcd and kube-apiserver run with the state directory on their command line: {pids:?}");
    // Keys and kubeconfigs are the cluster's credentials: only their owner reads them.
    let mode = |path: &Path| {
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(path).expect("metadata").permissions()) & 0o777
    };
    assert_eq!(mode(&dir), 0o700, "{}", dir.display());
    let mut private = 0;
    for entry in std::fs::read_dir(&dir).expect("the state directory").flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".key") || name.ends_with(".crt") || name.contains("kubeconfig") {
            assert_eq!(mode(&entry.path()), 0o600, "{name}");
            private += 1;
        }
    }
    assert!(private >= 6, "the keys, certificates and kubeconfig were found: {private}");
    drop(plane);
    assert!(!dir.exists(), "{} is removed", dir.display());
    for pid in pids {
        assert!(!alive(pid), "process {pid} is stopped");
    }
}

#[tokio::test]
async fn killing_the_owning_process_still_cleans_up() {
    if std::env::var_os(CHILD_ENV).is_some() {
        // The child: start a control plane, say where it lives, and wait to be killed. libtest prints the test
        // name on the same line first, so the parent looks for the marker anywhere in a line.
        let plane = ControlPlane::start().await.expect("the control plane starts");
        println!("STATE_DIR {}", state_dir(&plane).display());
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        return;
    }

    let mut child = Command::new(std::env::current_exe().expect("the test binary's path"))
        .args(["--exact", "killing_the_owning_process_still_cleans_up", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("re-running this test binary as the child");
    let stdout = child.stdout.take().expect("piped stdout");
    let dir = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|line| line.split_once("STATE_DIR ").map(|(_, dir)| PathBuf::from(dir.trim())))
        .expect("the child reports its state directory");
    let pids = control_plane_pids(&dir);
    assert!(pids.len() >= 2, "the child's control plane runs: {pids:?}");

    child.kill().expect("SIGKILL the child");
    child.wait().expect("reap the child");

    eventually("the supervisor to stop the control plane and remove its files", Duration::from_secs(30), || {
        let done = !dir.exists() && pids.iter().all(|pid| !alive(*pid));
        async move { done.then_some(()) }
    })
    .await;
}
