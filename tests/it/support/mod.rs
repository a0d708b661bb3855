//! Test support: start the real `relay` binary on an ephemeral loopback port, talk HTTP to it
//! over plain sockets, and connect fake workers over real WebSockets.

pub mod http;
pub mod modes;
pub mod pg;
pub mod proxy;
pub mod real_worker;
pub mod strace;
/// The worker tests' HTTP target (a slow, counting `http` task target), shared, not copied.
#[allow(dead_code)]
#[path = "../../../worker/tests/it/support/target.rs"]
pub mod target;
pub mod worker;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use self::http::{Client, Resp, request};
pub use self::modes::{Mode, for_each_mode};
pub use self::worker::{Auto, FakeWorker};

/// True when `CI` names a CI run (set, not empty, not `0` or `false`; `.ci/run` exports
/// `CI=true`): there, a test that cannot run its real subject fails instead of skipping.
pub fn in_ci() -> bool {
    ci_requires_tools(std::env::var("CI").ok().as_deref())
}

fn ci_requires_tools(ci: Option<&str>) -> bool {
    ci.is_some_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
}

/// `test` cannot run for `why` (a missing tool, no root): under CI a failure; elsewhere a loud
/// SKIPPED line, and the caller returns. Written to the process's stderr, not with `eprintln!`,
/// which the test harness captures (and shows only for failing tests).
pub fn skip_or_fail(test: &str, why: &str) {
    if in_ci() {
        panic!("{test}: {why} (CI is set: this is a failure, not a skip; .ci/run installs what tests need)");
    }
    use std::io::Write;
    let _ =
        writeln!(std::io::stderr().lock(), "\n*** SKIPPED {test}: {why} (set CI=true to make this a failure) ***\n");
}

#[test]
fn ci_is_any_value_but_empty_0_or_false() {
    for (v, want) in [(None, false), (Some(""), false), (Some("0"), false), (Some("FALSE"), false)] {
        assert_eq!(ci_requires_tools(v), want, "{v:?}");
    }
    for v in ["true", "1", "yes"] {
        assert!(ci_requires_tools(Some(v)), "{v}");
    }
}

pub const API: &str = "api-token";
pub const WRK: &str = "worker-token";

/// A running relay process. Dropping it kills the process.
pub struct Relay {
    child: Option<Child>,
    pub addr: SocketAddr,
    pub log: Arc<Mutex<String>>,
    /// Set once relay's stderr reached EOF: every line it wrote is in `log`.
    log_done: Arc<AtomicBool>,
    /// A BLOB_DIR of this relay's own, unless the test chose one (relays running side by side
    /// must not share one); removed on drop.
    own_blobs: Option<std::path::PathBuf>,
    /// Cluster mode (`Mode::Cluster`): the database this node uses, dropped after the node
    /// stopped (fields drop after `Drop::drop` killed the process).
    pub db: Option<Arc<pg::TestDb>>,
}

/// Defaults that keep tests fast: short timeouts, memory only, debug logs.
const DEFAULTS: &[(&str, &str)] = &[
    ("PORT", "0"),
    ("BIND", "127.0.0.1"),
    ("API_TOKEN", API),
    ("WORKER_TOKEN", WRK),
    ("DATA_DIR", ""),
    ("LOG_LEVEL", "debug"),
    ("PING_INTERVAL", "200ms"),
    ("PONG_WAIT", "1s"),
    ("TASK_TIMEOUT", "2s"),
    ("WAIT_TIMEOUT", "5s"),
    ("SHUTDOWN_TIMEOUT", "2s"),
    // Small segments: tests with a journal rotate, and prepare 1 MiB of zeros, not 64 MiB.
    ("JOURNAL_SEGMENT_SIZE", "1048576"),
];

/// Heartbeat for tests whose workers must stay connected while a heavy external program
/// (Chromium, schemathesis) starts and runs beside them on the same two cores: relay's own
/// defaults (SPEC §2), in place of DEFAULTS' 200 ms / 1 s, which are there so that the tests
/// of dead workers run fast. With 1 s, any stall of a second of relay or of the test process
/// (a cold start of the program) had relay drop every worker for silence, for good: a stalled
/// relay sends no pings, and its next turn counts the time it was stalled as the workers'
/// silence. Those tests then failed with "0 connected" and 503 `no_worker`.
pub const STEADY_HEARTBEAT: &[(&str, &str)] = &[("PING_INTERVAL", "2s"), ("PONG_WAIT", "6s")];

/// What relay said about workers leaving, for a failure message: its log lines that tell a
/// disconnect or a dead heartbeat.
pub fn worker_losses(log: &str) -> String {
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("disconnected") || l.contains("PONG_WAIT") || l.contains("silent"))
        .take(10)
        .collect();
    if lines.is_empty() { "relay logged no worker leaving".into() } else { lines.join("\n") }
}

pub fn relay_bin() -> &'static str {
    env!("CARGO_BIN_EXE_relay")
}

impl Relay {
    pub fn start() -> Relay {
        Relay::start_with(&[])
    }

    /// Starts relay with the defaults overridden by `env` (an empty value unsets a default
    /// only for AUTH-style variables; others are passed as given).
    pub fn start_with(env: &[(&str, &str)]) -> Relay {
        let mut cmd = Command::new(relay_bin());
        cmd.env_clear();
        if let Ok(path) = std::env::var("PATH") {
            cmd.env("PATH", path);
        }
        for (k, v) in DEFAULTS {
            cmd.env(k, v);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let own_blobs = (!env.iter().any(|(k, _)| *k == "BLOB_DIR"))
            .then(|| std::env::temp_dir().join(format!("relay-it-blobs-{}", uuid::Uuid::new_v4().simple())));
        if let Some(dir) = &own_blobs {
            cmd.env("BLOB_DIR", dir);
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn relay");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let log2 = log.clone();
        let log_done = Arc::new(AtomicBool::new(false));
        let done2 = log_done.clone();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                {
                    // Logged before the address is handed over, so a test that starts with the
                    // address already sees the `listening` line.
                    let mut l = log2.lock().expect("log lock");
                    l.push_str(&line);
                    l.push('\n');
                }
                if !sent
                    && line.contains("msg=listening")
                    && let Some(addr) = line.split_whitespace().find_map(|kv| kv.strip_prefix("addr="))
                {
                    let _ = tx.send(addr.to_string());
                    sent = true;
                }
            }
            done2.store(true, Ordering::SeqCst);
        });
        let addr = match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(addr) => addr.parse().expect("listening addr"),
            Err(_) => {
                let _ = child.kill();
                panic!("relay did not start; log:\n{}", log.lock().expect("log"));
            }
        };
        Relay { child: Some(child), addr, log, log_done, own_blobs, db: None }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    pub fn log_text(&self) -> String {
        self.log.lock().expect("log").clone()
    }

    /// Waits until the log contains `needle`.
    pub fn wait_log(&self, needle: &str, within: Duration) -> bool {
        poll_until(within, || self.log_text().contains(needle))
    }

    pub fn ws_url(&self) -> String {
        format!("ws://{}/ws?token={WRK}", self.addr)
    }

    /// One request with the API token, on a fresh connection.
    pub fn api(&self, method: &str, path: &str, body: Option<&str>) -> Resp {
        let auth = format!("Bearer {API}");
        request(self.addr, method, path, &[("Authorization", auth.as_str())], body.map(str::as_bytes))
    }

    pub fn submit(&self, body: &str) -> Resp {
        self.api("POST", "/tasks", Some(body))
    }

    pub fn get_task(&self, id: &str) -> serde_json::Value {
        let r = self.api("GET", &format!("/tasks/{id}"), None);
        assert_eq!(r.status, 200, "GET task: {}", r.text());
        r.json()
    }

    /// Polls the task until `status`, returning its JSON.
    pub fn wait_status(&self, id: &str, status: &str, within: Duration) -> serde_json::Value {
        self.wait_task(id, within, |t| t["status"] == status)
    }

    /// Polls the task until `ok` holds for its JSON, returning it; fails the test at `within`.
    pub fn wait_task(&self, id: &str, within: Duration, ok: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
        let deadline = Instant::now() + within;
        loop {
            let t = self.get_task(id);
            if ok(&t) {
                return t;
            }
            if Instant::now() > deadline {
                panic!("task {id} never reached the expected state within {within:?}: {t}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Polls `/healthz` until `ok` holds for its JSON, returning it. Its task counts are a
    /// node's own in memory on one node, and cluster-wide counts at most 1 s old in cluster
    /// mode (SPEC §11): a test that reads them after a change polls, in both modes alike.
    pub fn wait_health(&self, ok: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
        let mut last = serde_json::Value::Null;
        let seen = poll_until(Duration::from_secs(5), || {
            last = request(self.addr, "GET", "/healthz", &[], None).json();
            ok(&last)
        });
        assert!(seen, "/healthz never showed the expected counts: {last}");
        last
    }

    pub fn clients(&self) -> serde_json::Value {
        let r = self.api("GET", "/clients", None);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    }

    /// Waits until `/clients` lists `n` workers, each satisfying `ok`.
    pub fn wait_clients(&self, n: usize, ok: impl Fn(&serde_json::Value) -> bool) {
        let ready = poll_until(Duration::from_secs(5), || {
            let c = self.clients();
            c["count"] == n && c["clients"].as_array().is_some_and(|a| a.iter().all(&ok))
        });
        assert!(ready, "clients never became {n}: {}", self.clients());
    }

    pub fn metrics(&self) -> String {
        request(self.addr, "GET", "/metrics", &[], None).text()
    }

    /// The value of one metric line (`name{labels}` exactly). A series that is not exposed
    /// fails the test: a missing metric is a bug, never a zero.
    pub fn metric(&self, series: &str) -> f64 {
        let text = self.metrics();
        match metric_value(&text, series) {
            Some(v) => v,
            None => panic!("metric series {series:?} is not exposed by /metrics:\n{text}"),
        }
    }

    /// Returns once relay has handled every byte this process wrote to it before the call: one
    /// request answered on a fresh connection. A write on loopback lands in relay's receive
    /// queue before `write` returns, epoll reports readiness in the order it arose, and relay
    /// reads each ready socket when its event comes up, so an answer to a later connection
    /// means the earlier bytes were read and parsed (a request that waits, such as
    /// `wait=true`, is then held).
    pub fn barrier(&self) {
        let r = request(self.addr, "GET", "/healthz", &[], None);
        assert_eq!(r.status, 200, "barrier request: {}", r.text());
    }

    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill").arg(format!("-{sig}")).arg(self.pid().to_string()).status().expect("kill");
        assert!(status.success());
    }

    /// SIGKILL at once, by a system call (not a `kill` process, which takes milliseconds to
    /// start): for tests of what a crash right after an event leaves.
    pub fn kill_now(&self) {
        // SAFETY: kill(2) on this test's own relay process.
        let rc = unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGKILL) };
        assert_eq!(rc, 0, "kill -9 {}", self.pid());
    }

    /// Sends SIGTERM and waits (bounded) for the exit status.
    pub fn stop(mut self) -> ExitStatus {
        self.signal("TERM");
        self.wait_exit(Duration::from_secs(10)).expect("relay exits after SIGTERM")
    }

    pub fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        let child = self.child.as_mut()?;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                // Its last lines may still be in the pipe: wait (bounded) for the reader's EOF.
                let drained = poll_until(Duration::from_secs(5), || self.log_done.load(Ordering::SeqCst));
                assert!(drained, "relay exited but its stderr never reached EOF");
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The test failed: what relay said is the first thing to read.
            eprintln!("--- relay log ({}) ---\n{}--- end of relay log ---", self.addr, self.log_text());
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dir) = &self.own_blobs {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The value of `series` (`name{labels}` exactly) in a Prometheus text exposition.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .map(|v| v.trim().parse().unwrap_or_else(|e| panic!("metric {series}: bad value {v:?}: {e}")))
}

/// CPU time a process has used so far (user + system, all its threads), in seconds; `None`
/// once it is gone (or a zombie).
pub fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command's `)`: state, then utime and stime as the 12th and 13th fields.
    let fields: Vec<&str> = stat.rsplit(')').next()?.split_whitespace().collect();
    if fields.first() == Some(&"Z") {
        return None;
    }
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1);
    Some(ticks as f64 / hz as f64)
}

/// Resident memory of a process, in KiB (VmRSS).
pub fn rss_kib(pid: u32) -> u64 {
    proc_status_kib(pid, "VmRSS:")
}

/// The high-water mark of a process's resident memory, in KiB (VmHWM): it catches a peak
/// however briefly it lasted, which sampling VmRSS can miss.
pub fn peak_rss_kib(pid: u32) -> u64 {
    proc_status_kib(pid, "VmHWM:")
}

fn proc_status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{field} missing in /proc/{pid}/status"))
}

/// Polls `f` every 10 ms until it is true or `within` passes.
pub fn poll_until(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `relay` with an environment and returns (exit code, stderr).
pub fn run_relay_env(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut cmd = Command::new(relay_bin());
    cmd.env_clear().args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run relay");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
