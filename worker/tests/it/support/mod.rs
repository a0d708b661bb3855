//! Test support: the real `relay` and `relay-worker` processes on ephemeral loopback ports, a
//! small HTTP target server, a fake relay (for what the real one never sends), and a
//! TLS-terminating proxy. Everything listens on 127.0.0.1 only.

pub mod fake_relay;
pub mod target;
pub mod tls_proxy;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const API: &str = "api-token";
pub const WRK: &str = "worker-token";

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

// ----- locating the binaries ---------------------------------------------------------------

pub fn worker_bin() -> &'static str {
    env!("CARGO_BIN_EXE_relay-worker")
}

/// True when the environment says this is CI (`CI` set to anything but empty, `0` or
/// `false`; `.ci/run` exports `CI=true`). There, a test that cannot run its real subject fails.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
}

/// A test cannot run for `reason`: in CI that is a failure; elsewhere it says loudly that it
/// skipped (the caller then returns).
pub fn skip_or_fail(reason: &str) {
    let test = std::thread::current().name().unwrap_or("a worker test").to_string();
    if in_ci() {
        panic!("{test}: {reason} (CI is set, so this is a failure, not a skip)");
    }
    // Straight to the process's stderr: the test harness captures `eprintln!` of passing tests.
    let _ = writeln!(std::io::stderr(), "\n*** SKIPPED {test}: {reason} ***\n");
}

/// Returns from the calling test unless the `relay` binary could be built (see `relay_bin`);
/// in CI a failed build fails the test instead.
#[macro_export]
macro_rules! require_relay {
    () => {
        if let Err(why) = $crate::support::relay_build() {
            $crate::support::skip_or_fail(&format!("the relay binary could not be built: {why}"));
            return;
        }
    };
}

/// The `relay` binary of this workspace; a test calls `require_relay!()` first.
pub fn relay_bin() -> &'static Path {
    match relay_build() {
        Ok(bin) => bin,
        Err(why) => panic!("the relay binary could not be built (a test lacks `require_relay!()`): {why}"),
    }
}

/// Integration tests of the worker package only get their own package's binaries from Cargo,
/// so this builds relay once per test process with the same cargo, profile, target and target
/// directory as this test executable (a no-op when it is up to date; Cargo decides staleness).
/// A failed build is an error, never a silent fall back on an older binary.
pub fn relay_build() -> Result<&'static Path, String> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(build_relay).as_deref().map_err(String::clone)
}

fn build_relay() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    // <target-dir>[/<triple>]/<profile-dir>/deps/<test-exe>
    let profile_dir = exe.parent().and_then(Path::parent).ok_or("test executable not in <profile>/deps")?.to_path_buf();
    let bin = profile_dir.join(format!("relay{}", std::env::consts::EXE_SUFFIX));
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev".to_string(),
        Some(other) => other.to_string(),
        None => "dev".to_string(),
    };
    let above = profile_dir.parent().ok_or("no target dir")?;
    // With `--target <triple>` the layout has one more level, and that level has no CACHEDIR.TAG.
    let (target_dir, triple) = if above.join("CACHEDIR.TAG").exists() || above.parent().is_none() {
        (above.to_path_buf(), None)
    } else {
        let triple = above.file_name().and_then(|n| n.to_str()).map(str::to_string);
        (above.parent().map(Path::to_path_buf).unwrap_or_else(|| above.to_path_buf()), triple)
    };
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("Cargo.toml");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.arg("build").arg("--manifest-path").arg(&manifest).args(["-p", "relay", "--bin", "relay", "--profile"]);
    cmd.arg(&profile).arg("--target-dir").arg(&target_dir);
    if let Some(triple) = &triple {
        cmd.args(["--target", triple]);
    }
    let out = cmd.stdin(Stdio::null()).output().map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("cargo build -p relay failed:\n{}", String::from_utf8_lossy(&out.stderr)));
    }
    if !bin.exists() {
        return Err(format!("cargo built relay but {} is missing", bin.display()));
    }
    Ok(bin)
}

// ----- processes ---------------------------------------------------------------------------

/// A child process whose stderr is collected into a string. Dropping it kills the process.
pub struct Proc {
    child: Option<Child>,
    pub log: Arc<Mutex<String>>,
}

impl Proc {
    fn spawn(bin: &Path, args: &[&str], env: &[(&str, &str)], cwd: Option<&Path>) -> Proc {
        let mut cmd = Command::new(bin);
        cmd.args(args).env_clear();
        if let Ok(path) = std::env::var("PATH") {
            cmd.env("PATH", path);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        if let Some(dir) = cwd {
            cmd.current_dir(dir);
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let mut l = log2.lock().expect("log lock");
                l.push_str(&line);
                l.push('\n');
            }
        });
        Proc { child: Some(child), log }
    }

    pub fn log_text(&self) -> String {
        self.log.lock().expect("log").clone()
    }

    pub fn wait_log(&self, needle: &str, within: Duration) -> bool {
        poll_until(within, || self.log_text().contains(needle))
    }

    /// How many times `needle` occurs in the log.
    pub fn count_log(&self, needle: &str) -> usize {
        self.log_text().matches(needle).count()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).expect("running")
    }

    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill").arg(format!("-{sig}")).arg(self.pid().to_string()).status().expect("kill");
        assert!(status.success(), "kill -{sig}");
    }

    pub fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        let child = self.child.as_mut()?;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A running relay.
pub struct Relay {
    pub proc: Proc,
    pub addr: SocketAddr,
    /// This relay's own BLOB_DIR (relays running side by side must not share one).
    blobs: std::path::PathBuf,
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.blobs);
    }
}

const RELAY_ENV: &[(&str, &str)] = &[
    ("BIND", "127.0.0.1"),
    ("API_TOKEN", API),
    ("WORKER_TOKEN", WRK),
    ("DATA_DIR", ""),
    ("LOG_LEVEL", "debug"),
    ("PING_INTERVAL", "200ms"),
    ("PONG_WAIT", "1s"),
    ("TASK_TIMEOUT", "5s"),
    ("WAIT_TIMEOUT", "10s"),
    ("SHUTDOWN_TIMEOUT", "2s"),
];

impl Relay {
    pub fn start() -> Relay {
        Relay::start_on(0)
    }

    /// Starts relay on `port` (0 = ephemeral); a restart passes the old port.
    pub fn start_on(port: u16) -> Relay {
        Relay::start_env(port, &[])
    }

    /// [`Relay::start_on`] with more variables (a DATA_DIR, say).
    pub fn start_env(port: u16, extra: &[(&str, &str)]) -> Relay {
        let port = port.to_string();
        let blobs = std::env::temp_dir().join(format!("relay-worker-it-blobs-{}", uuid::Uuid::new_v4().simple()));
        let blob_dir = blobs.to_string_lossy().into_owned();
        let mut env = RELAY_ENV.to_vec();
        env.push(("PORT", &port));
        env.push(("BLOB_DIR", &blob_dir));
        env.retain(|(k, _)| !extra.iter().any(|(e, _)| e == k));
        env.extend_from_slice(extra);
        let proc = Proc::spawn(relay_bin(), &[], &env, None);
        let mut addr = None;
        let found = poll_until(Duration::from_secs(10), || {
            addr = proc.log_text().lines().find(|l| l.contains("msg=listening")).and_then(|l| {
                l.split_whitespace().find_map(|kv| kv.strip_prefix("addr=")).and_then(|a| a.parse().ok())
            });
            addr.is_some()
        });
        assert!(found, "relay did not start; log:\n{}", proc.log_text());
        Relay { proc, addr: addr.expect("addr"), blobs }
    }

    pub fn ws_url(&self) -> String {
        format!("ws://{}/ws", self.addr)
    }

    pub fn api(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
        let (status, body) = http(self.addr, method, path, &[("Authorization", &format!("Bearer {API}"))], body);
        let json = serde_json::from_slice(&body).unwrap_or(Value::Null);
        (status, json)
    }

    /// Submits a task and waits for it to be final (`wait=true`), returning the task JSON.
    pub fn run_task(&self, payload: Value) -> Value {
        let body = serde_json::json!({"payload": payload}).to_string();
        let (status, task) = self.api("POST", "/tasks?wait=true", Some(&body));
        assert!(matches!(status, 200 | 502), "submit: {status} {task}");
        task
    }

    pub fn submit(&self, payload: Value) -> String {
        let body = serde_json::json!({"payload": payload}).to_string();
        let (status, task) = self.api("POST", "/tasks", Some(&body));
        assert_eq!(status, 202, "submit: {task}");
        task["task_id"].as_str().expect("task_id").to_string()
    }

    pub fn wait_final(&self, id: &str, within: Duration) -> Value {
        let mut last = Value::Null;
        let done = poll_until(within, || {
            last = self.api("GET", &format!("/tasks/{id}"), None).1;
            matches!(last["status"].as_str(), Some("done" | "failed" | "canceled"))
        });
        assert!(done, "task {id} not final within {within:?}: {last}");
        last
    }

    pub fn clients(&self) -> Value {
        self.api("GET", "/clients", None).1
    }

    /// Waits until `/clients` lists `n` workers, each satisfying `ok`.
    pub fn wait_clients(&self, n: usize, within: Duration, ok: impl Fn(&Value) -> bool) {
        let ready = poll_until(within, || {
            let c = self.clients();
            c["count"] == n && c["clients"].as_array().is_some_and(|a| a.iter().all(&ok))
        });
        assert!(ready, "clients never became {n}: {}\nrelay log tail:\n{}", self.clients(), tail(&self.proc));
    }
}

pub fn tail(p: &Proc) -> String {
    let text = p.log_text();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// A running relay-worker process.
pub struct Worker {
    pub proc: Proc,
}

impl Worker {
    /// Starts `relay-worker` for `url` with short test timeouts, plus `env`.
    pub fn start(url: &str, env: &[(&str, &str)]) -> Worker {
        let mut all: Vec<(&str, &str)> =
            vec![("RELAY_URL", url), ("TOKEN", WRK), ("HTTP_TIMEOUT", "3s"), ("SHUTDOWN_TIMEOUT", "5s")];
        all.extend_from_slice(env);
        Worker { proc: Proc::spawn(Path::new(worker_bin()), &[], &all, None) }
    }

    pub fn wait_connected(&self) {
        assert!(
            self.proc.wait_log("msg=connected", Duration::from_secs(10)),
            "worker never connected:\n{}",
            self.proc.log_text()
        );
    }
}

/// Runs a program to completion: (exit code, stdout, stderr).
pub fn run(bin: &Path, args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut cmd = Command::new(bin);
    cmd.args(args).env_clear().stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Why the Python example worker cannot run here (no `python3`, or no `websockets` module for
/// it), if it cannot. Run with the environment `spawn_python` gives the worker.
pub fn python_missing() -> Option<String> {
    let mut cmd = Command::new("python3");
    cmd.args(["-c", "import websockets"]).env_clear().stdout(Stdio::null()).stderr(Stdio::piped());
    for (k, v) in python_env() {
        cmd.env(k, v);
    }
    match cmd.output() {
        Err(e) => Some(format!("python3 cannot be run ({e})")),
        Ok(out) if !out.status.success() => Some(format!(
            "python3 cannot import `websockets` (python3 -m pip install websockets): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Ok(_) => None,
    }
}

/// What a Python child inherits: PATH, and what pyenv shims and user site-packages need to
/// find their installs.
fn python_env() -> Vec<(String, String)> {
    ["PATH", "HOME", "PYENV_ROOT", "PYENV_VERSION", "PYTHONPATH", "VIRTUAL_ENV"]
        .iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
        .collect()
}

pub fn spawn_python(script: &Path, env: &[(&str, &str)]) -> Proc {
    let inherited = python_env();
    let mut all: Vec<(&str, &str)> = inherited.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    all.extend_from_slice(env);
    all.push(("PYTHONUNBUFFERED", "1"));
    let script = script.to_str().expect("utf-8 path");
    Proc::spawn(Path::new("python3"), &[script], &all, None)
}

// ----- a minimal HTTP client for relay's API -------------------------------------------------

/// One request on a fresh connection (`Connection: close`): (status, body).
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> (u16, Vec<u8>) {
    http_bytes(addr, method, path, headers, body.map(str::as_bytes))
}

pub fn http_bytes(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, Vec<u8>) {
    let (status, _, body) = http_full(addr, method, path, headers, body);
    (status, body)
}

/// Like `http_bytes`, with the response headers too: (status, headers in order, body). Header
/// values are decoded as UTF-8 (lossily), names kept as sent.
pub fn http_full(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n", body.map_or(0, <[u8]>::len)));
    let mut raw = req.into_bytes();
    raw.extend_from_slice(body.unwrap_or_default());
    s.write_all(&raw).expect("write");
    let mut resp = Vec::new();
    let _ = s.read_to_end(&mut resp);
    let head_end = resp.windows(4).position(|w| w == b"\r\n\r\n").expect("response head") + 4;
    let head = String::from_utf8_lossy(&resp[..head_end]).into_owned();
    let status: u16 = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).expect("status");
    let fields = head
        .split("\r\n")
        .skip(1)
        .filter_map(|line| line.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    (status, fields, resp[head_end..].to_vec())
}

/// The first header called `name` (case-insensitive) in `http_full`'s headers.
pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}
