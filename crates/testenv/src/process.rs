//! A process under a small `sh` wrapper that records its exit status and dies with the test process: the node
//! agent's containers, standalone test Squids and the host-process operator all run this way.

use std::fs;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// Quotes `text` for a POSIX shell.
pub(crate) fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// A process under a `sh` wrapper that records its exit status, and kills it (TERM, then KILL after 2 s) when the
/// pipe from this process closes: on drop, or when the test process dies in any way. Once the process has exited,
/// the wrapper stops its watchdog, so a later close can never signal a process that reused the ID. The wrapper
/// ignores INT, HUP and TERM itself, but the process starts with their default dispositions (an ignored signal
/// would be inherited across exec, and a shell script could then never trap SIGTERM).
pub(crate) struct Process {
    pub pid: u32,
    wrapper: Child,
    pipe: Option<ChildStdin>,
    exit_file: PathBuf,
}

impl Process {
    pub(crate) fn spawn(script: &str, log: &Path, exit_file: &Path) -> Result<Self> {
        let _ = fs::remove_file(exit_file);
        let wrapper_script = format!(
            "trap '' INT HUP TERM; exec 3<&0; ( trap - INT HUP TERM; exec 3<&-; exec {script} ) </dev/null >>{log} 2>&1 & pid=$!; echo $pid; \
             ( cat <&3 >/dev/null; kill -TERM $pid 2>/dev/null; sleep 2; kill -KILL $pid 2>/dev/null ) >/dev/null 2>&1 & \
             watchdog=$!; exec 3<&-; wait $pid; echo $? >{exit}; kill $watchdog 2>/dev/null",
            log = shell_quote(&log.display().to_string()),
            exit = shell_quote(&exit_file.display().to_string()),
        );
        let mut wrapper = Command::new("sh")
            .arg("-c")
            .arg(&wrapper_script)
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting sh")?;
        let pipe = wrapper.stdin.take();
        let mut first_line = String::new();
        if let Some(stdout) = wrapper.stdout.take() {
            let _ = BufReader::new(stdout).read_line(&mut first_line);
        }
        let pid = first_line.trim().parse::<u32>().context("the wrapper did not report the process ID")?;
        Ok(Self { pid, wrapper, pipe, exit_file: exit_file.to_path_buf() })
    }

    /// The exit code once the process has ended (128 + the signal for a killed one).
    pub(crate) fn exited(&mut self) -> Option<i32> {
        self.wrapper.try_wait().ok().flatten()?;
        Some(fs::read_to_string(&self.exit_file).ok().and_then(|text| text.trim().parse().ok()).unwrap_or(-1))
    }

    pub(crate) fn signal(&self, signal: &str) -> bool {
        Command::new("kill").args([&format!("-{signal}"), &self.pid.to_string()]).status().is_ok_and(|s| s.success())
    }

    /// SIGTERM, then SIGKILL once `grace` has passed; returns the exit code.
    pub(crate) async fn terminate(&mut self, grace: Duration) -> i32 {
        if let Some(code) = self.exited() {
            return code;
        }
        self.signal("TERM");
        let deadline = Instant::now() + grace;
        loop {
            if let Some(code) = self.exited() {
                return code;
            }
            if Instant::now() >= deadline {
                self.signal("KILL");
                // A stopped (SIGSTOP) process is killed too.
                self.signal("CONT");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        drop(self.pipe.take());
        let _ = self.wrapper.wait();
    }
}

/// A shell that removes a directory tree and a family of shared-memory segments once the pipe from this process
/// closes: on drop, or when the test process ends in any way (a test binary that leaks its cluster into a static
/// never runs destructors). It waits a few seconds first, so the [`Process`] wrappers, which give their processes
/// 2 s to stop, have finished writing there, and tries again for ten seconds while a late wrapper still writes an exit
/// file into a directory being removed (`rm -rf` then fails to remove the directory, and left it behind before).
pub(crate) struct Janitor {
    pipe: Option<ChildStdin>,
    shell: Option<Child>,
}

impl Janitor {
    /// Removes `dir` and the files in `/dev/shm` whose names start with `shm_prefix` (when not empty).
    pub(crate) fn spawn(dir: &Path, shm_prefix: &str) -> Result<Self> {
        let script = r#"trap '' INT HUP TERM; cat >/dev/null; sleep 3; for try in 1 2 3 4 5 6 7 8 9 10; do rm -rf "$1"; [ -e "$1" ] || break; sleep 1; done; [ -z "$2" ] || rm -f /dev/shm/"$2"*"#;
        let mut shell = Command::new("sh")
            .arg("-c")
            .arg(script)
            .arg("egress-testenv-janitor")
            .arg(dir)
            .arg(shm_prefix)
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting the cleanup shell (sh)")?;
        let pipe = shell.stdin.take();
        Ok(Self { pipe, shell: Some(shell) })
    }
}

impl Drop for Janitor {
    fn drop(&mut self) {
        drop(self.pipe.take());
        // Reaped off the caller's thread: the removal runs after a delay the caller need not wait for.
        if let Some(mut shell) = self.shell.take() {
            std::thread::spawn(move || shell.wait());
        }
    }
}
