//! relay run under `strace` with fault injection: a disk that falls behind, a sync or a
//! deletion that fails. `.ci/run` installs strace; elsewhere a test without it is skipped
//! (under CI: fails, see [`super::skip_or_fail`]).

use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{API, WRK, relay_bin, skip_or_fail};

/// A relay process traced by strace (the strace process is our child; relay is its child).
pub struct Traced {
    strace: Child,
    pub relay_pid: u32,
    pub addr: SocketAddr,
    pub log: Arc<Mutex<String>>,
}

impl Traced {
    /// Starts relay under `strace -f -qq --seccomp-bpf -o /dev/null <strace_args>` with a
    /// cleared environment: loopback, port 0, the test tokens, `LOG_LEVEL=info`, then `env`.
    /// `None` (after saying so) when strace cannot be used here.
    pub fn start(test: &str, strace_args: &[&str], env: &[(&str, &str)]) -> Option<Traced> {
        let mut cmd = Command::new("strace");
        cmd.args(["-f", "-qq", "--seccomp-bpf", "-o", "/dev/null"]).args(strace_args).arg(relay_bin());
        cmd.env_clear().env("PATH", std::env::var("PATH").unwrap_or_default());
        let base =
            [("PORT", "0"), ("BIND", "127.0.0.1"), ("API_TOKEN", API), ("WORKER_TOKEN", WRK), ("LOG_LEVEL", "info")];
        cmd.envs(base.iter().chain(env).copied());
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
        let mut strace = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                skip_or_fail(test, &format!("strace is not available ({e})"));
                return None;
            }
        };
        let stderr = strace.stderr.take().expect("stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        let log = Arc::new(Mutex::new(String::new()));
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Ok(mut l) = log2.lock() {
                    l.push_str(&line);
                    l.push('\n');
                }
                if line.contains("msg=listening")
                    && let Some(addr) = line.split_whitespace().find_map(|kv| kv.strip_prefix("addr="))
                {
                    let _ = tx.send(Ok(addr.to_string()));
                } else if line.contains("strace:") {
                    let _ = tx.send(Err(line));
                }
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(Ok(addr)) => addr.parse().expect("addr"),
            other => {
                let _ = strace.kill();
                let _ = strace.wait();
                skip_or_fail(test, &format!("strace could not run relay ({other:?})"));
                return None;
            }
        };
        let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", strace.id())).expect("children");
        let relay_pid = children.split_whitespace().next().and_then(|p| p.parse().ok()).expect("relay's pid");
        Some(Traced { strace, relay_pid, addr, log })
    }

    pub fn log_text(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    pub fn ws_url(&self) -> String {
        format!("ws://{}/ws?token={WRK}", self.addr)
    }

    /// Sends `sig` to relay (by its PID).
    pub fn signal(&self, sig: &str) {
        let status =
            Command::new("kill").arg(format!("-{sig}")).arg(self.relay_pid.to_string()).status().expect("kill");
        assert!(status.success());
    }

    /// Waits (bounded) for strace, which exits with relay's status once relay is gone.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Ok(Some(status)) = self.strace.try_wait() {
                return Some(status);
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Traced {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- relay log ---\n{}--- end ---", self.log_text());
        }
        if matches!(self.strace.try_wait(), Ok(None)) {
            let _ = Command::new("kill").arg("-KILL").arg(self.relay_pid.to_string()).status();
        }
        let _ = self.strace.wait();
    }
}
