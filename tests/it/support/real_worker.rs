//! The real `relay-worker` binary for tests of this package, which Cargo does not hand it:
//! built once per test process with the same cargo, profile, target and target directory as
//! this test executable (a no-op when it is up to date), and started as a child process whose
//! stderr is collected. Dropping a [`RealWorker`] kills it (by its own PID).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};

use super::WRK;

/// The relay-worker binary, built on first use; a failed build is an error, never a fall back
/// on an older binary.
pub fn bin() -> Result<&'static Path, String> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(build_worker).as_deref().map_err(String::clone)
}

fn build_worker() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    // <target-dir>[/<triple>]/<profile-dir>/deps/<test-exe>
    let profile_dir = exe.parent().and_then(Path::parent).ok_or("test executable not in <profile>/deps")?;
    let bin = profile_dir.join(format!("relay-worker{}", std::env::consts::EXE_SUFFIX));
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_string(),
        Some(other) => other.to_string(),
    };
    let above = profile_dir.parent().ok_or("no target dir")?;
    // With `--target <triple>` the layout has one more level, and that level has no CACHEDIR.TAG.
    let (target_dir, triple) = if above.join("CACHEDIR.TAG").exists() || above.parent().is_none() {
        (above.to_path_buf(), None)
    } else {
        let triple = above.file_name().and_then(|n| n.to_str()).map(str::to_string);
        (above.parent().map_or_else(|| above.to_path_buf(), Path::to_path_buf), triple)
    };
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.arg("build").arg("--manifest-path").arg(&manifest);
    cmd.args(["-p", "relay-worker", "--bin", "relay-worker", "--profile", &profile])
        .arg("--target-dir")
        .arg(&target_dir);
    if let Some(triple) = &triple {
        cmd.args(["--target", triple]);
    }
    let out = cmd.stdin(Stdio::null()).output().map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("cargo build -p relay-worker failed:\n{}", String::from_utf8_lossy(&out.stderr)));
    }
    if !bin.exists() {
        return Err(format!("cargo built relay-worker but {} is missing", bin.display()));
    }
    Ok(bin)
}

/// A running relay-worker.
pub struct RealWorker {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl RealWorker {
    /// Starts relay-worker for `url` (`ws://host:port/ws`) with the test worker token, plus
    /// `env`; panics if the binary cannot be had (call [`bin`] first to skip instead).
    pub fn start(url: &str, env: &[(&str, &str)]) -> RealWorker {
        let bin = bin().unwrap_or_else(|why| panic!("relay-worker: {why}"));
        let mut cmd = Command::new(bin);
        cmd.env_clear().env("RELAY_URL", url).env("TOKEN", WRK);
        if let Ok(path) = std::env::var("PATH") {
            cmd.env("PATH", path);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn relay-worker: {e}"));
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
        RealWorker { child, log }
    }

    pub fn log_text(&self) -> String {
        self.log.lock().expect("log").clone()
    }
}

impl Drop for RealWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
