//! The shell examples of README.md and docs/api.md run as written, in document order, against
//! the real `relay` and `relay-worker` on a loopback port — as a reader would type them into
//! one terminal (variables a block sets are there in the next), with the server and worker
//! blocks started in the background as the reader starts them in other terminals.
//!
//! What the test changes in a block before it runs it, and nothing else:
//! - `localhost:8080` becomes the address relay listens on (it is started with `PORT=0`);
//! - `./target/release/relay` and `./target/release/relay-worker` become the binaries this
//!   test uses (the ones `cargo test` built), and `cargo build --release --workspace && ` is
//!   dropped for the same reason;
//! - `curl` is a shim that runs the real curl with a `--write-out` on stderr, so the test sees
//!   every HTTP status.
//!
//! A block fails when a command in it fails (`set -euo pipefail`), when it takes longer than
//! `BLOCK_DEADLINE`, or when relay answers it with a status of 400 or more (or none) that the
//! block does not show as the first word of an output comment (`# 503 {...}`). A block is
//! marked by an HTML comment on the line before its fence (invisible when rendered):
//! `<!-- docs-test: server -->` and `<!-- docs-test: worker -->` start in the background (the
//! server until it logs `listening`, a worker until `/healthz` counts one more active client);
//! `<!-- docs-test: skip <why> -->` is not run and says so on stderr (it needs the network, or
//! it is an illustration). Every other `sh` block runs. The test also fails when a document no
//! longer has the blocks it expects (`Shape`), so examples cannot silently stop being run.
//! Each document gets its own directory (also `HOME` and `TMPDIR`), relay and worker; the
//! processes are stopped by their process group's id when the test ends. `DOCS_TEST_SHOW=1`
//! prints every block with its output.
//!
//! Single-node only: the documents' examples start one node as written (no `DATABASE_URL`);
//! changing what they run would no longer test what a reader types.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::support::{poll_until, relay_bin, request, skip_or_fail};

const README: &str = include_str!("../../README.md");
const API_MD: &str = include_str!("../../docs/api.md");
const CI_RUN: &str = include_str!("../../.ci/run");

/// Longest a foreground block may run (the slowest, a batch of 1,000 tasks, takes about 1 s).
const BLOCK_DEADLINE: Duration = Duration::from_secs(60);
/// A block slower than this is named on stderr (the examples are meant to be quick).
const SLOW_BLOCK: Duration = Duration::from_secs(3);
/// Longest relay may take to listen, or a worker to connect.
const START_DEADLINE: Duration = Duration::from_secs(20);
const MARKER_PREFIX: &str = "<!-- docs-test:";
/// What the curl shim writes on stderr for each transfer.
const STATUS_PREFIX: &str = "docs-test: HTTP ";

#[derive(Debug, Clone, PartialEq, Eq)]
enum Role {
    Run,
    Server,
    Worker,
    Skip(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Block {
    /// 1-based line of the opening fence.
    line: usize,
    role: Role,
    text: String,
}

/// What a document must hold, so that a change of shape fails instead of running nothing.
struct Shape {
    min_runs: usize,
    /// Each entry: substrings that one block that runs must contain together.
    must_run: &'static [&'static [&'static str]],
    /// Each entry: a substring of a skipped block.
    must_skip: &'static [&'static str],
}

const README_SHAPE: Shape = Shape {
    min_runs: 6,
    must_run: &[&["\"kind\":\"echo\"", "wait=true"], &["/files", "file_id"], &["/healthz"]],
    must_skip: &["cargo test --workspace"],
};

const API_SHAPE: Shape = Shape {
    min_runs: 15,
    must_run: &[
        &["/tasks/batch"],
        &["cursor="],
        &["Idempotency-Key"],
        &["-X DELETE"],
        &["relay token create"],
        &["relay token revoke"],
        &["-F", "/files"],
        &["Range:"],
        &["/clients"],
        &["/metrics"],
    ],
    must_skip: &[],
};

#[test]
fn readme_examples_run_as_written() {
    // README promises that its test command is exactly what CI runs.
    assert!(
        CI_RUN.lines().any(|l| l.trim() == "cargo test --workspace"),
        ".ci/run no longer runs `cargo test --workspace`"
    );
    run_document("README.md", README, &README_SHAPE);
}

#[test]
fn api_examples_run_as_written() {
    run_document("docs/api.md", API_MD, &API_SHAPE);
}

fn run_document(name: &str, text: &str, shape: &Shape) {
    let blocks = match parse_blocks(text) {
        Ok(b) => b,
        Err(e) => panic!("{name}: {e}"),
    };
    if let Err(e) = check_shape(&blocks, shape) {
        panic!("{name}: {e}");
    }
    let Some(tools) = Tools::find() else { return };
    let bins = match Bins::get() {
        Ok(b) => b,
        Err(why) => {
            skip_or_fail(&format!("docs examples of {name}"), &format!("relay-worker could not be built: {why}"));
            return;
        }
    };
    let mut session = Session::new(name, bins, &tools);
    for block in &blocks {
        session.step(block);
    }
    session.finish();
}

// ----- reading the documents (pure) --------------------------------------------------------

fn is_shell(lang: &str) -> bool {
    matches!(lang, "sh" | "bash" | "shell")
}

/// The fenced blocks of a Markdown text, with their roles. Errors: an unclosed fence, a marker
/// that is not right before a fence or is not understood, a marker on a block that is not
/// shell, or a non-shell block that looks like a command for relay (it would escape the test).
fn parse_blocks(text: &str) -> Result<Vec<Block>, String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut blocks = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let trimmed = lines[i].trim_start();
        if trimmed.starts_with(MARKER_PREFIX) {
            let next_is_fence = lines.get(i + 1).is_some_and(|l| l.trim_start().starts_with("```"));
            if !next_is_fence {
                return Err(format!("line {}: a docs-test marker must be right before a code fence", i + 1));
            }
            i += 1;
            continue;
        }
        let Some(lang) = trimmed.strip_prefix("```") else {
            i += 1;
            continue;
        };
        let indent = lines[i].len() - trimmed.len();
        let lang = lang.trim().to_string();
        let fence_line = i + 1;
        let marker = i.checked_sub(1).map(|p| lines[p].trim()).filter(|l| l.starts_with(MARKER_PREFIX));
        let mut body = Vec::new();
        i += 1;
        loop {
            let Some(line) = lines.get(i) else {
                return Err(format!("line {fence_line}: the code fence is never closed"));
            };
            i += 1;
            if line.trim() == "```" {
                break;
            }
            body.push(line.strip_prefix(&lines[fence_line - 1][..indent]).unwrap_or(line.trim_start()));
        }
        let text = body.join("\n");
        if !is_shell(&lang) {
            if marker.is_some() {
                return Err(format!("line {fence_line}: a docs-test marker on a ```{lang} block (only sh blocks run)"));
            }
            if ["curl ", "localhost:8080", "./target/release/"].iter().any(|s| text.contains(s)) {
                return Err(format!(
                    "line {fence_line}: a ```{lang} block that looks like a command for relay: make it ```sh \
                     (or mark it skip) so the docs test sees it"
                ));
            }
            continue;
        }
        let role = match marker {
            None => Role::Run,
            Some(m) => parse_marker(m).map_err(|e| format!("line {}: {e}", fence_line - 1))?,
        };
        blocks.push(Block { line: fence_line, role, text });
    }
    Ok(blocks)
}

fn parse_marker(line: &str) -> Result<Role, String> {
    let inner = line
        .strip_prefix(MARKER_PREFIX)
        .and_then(|r| r.strip_suffix("-->"))
        .map(str::trim)
        .ok_or_else(|| format!("a marker is written {MARKER_PREFIX} ... -->: {line:?}"))?;
    match inner.split_once(' ').map_or((inner, ""), |(a, b)| (a, b.trim())) {
        ("server", "") => Ok(Role::Server),
        ("worker", "") => Ok(Role::Worker),
        ("skip", "") => Err("a skip marker says why: <!-- docs-test: skip <why> -->".into()),
        ("skip", why) => Ok(Role::Skip(why.to_string())),
        _ => Err(format!("unknown marker {line:?} (server, worker, or skip <why>)")),
    }
}

fn check_shape(blocks: &[Block], shape: &Shape) -> Result<(), String> {
    let count = |role: &Role| blocks.iter().filter(|b| &b.role == role).count();
    let (servers, workers) = (count(&Role::Server), count(&Role::Worker));
    if servers != 1 || workers < 1 {
        return Err(format!("expected one server block and a worker block, found {servers} and {workers}"));
    }
    let runs: Vec<&Block> = blocks.iter().filter(|b| b.role == Role::Run).collect();
    if runs.len() < shape.min_runs {
        return Err(format!(
            "only {} blocks run (expected at least {}): were examples removed?",
            runs.len(),
            shape.min_runs
        ));
    }
    for wanted in shape.must_run {
        if !runs.iter().any(|b| wanted.iter().all(|w| b.text.contains(w))) {
            return Err(format!("no block that runs contains all of {wanted:?}"));
        }
    }
    for wanted in shape.must_skip {
        if !blocks.iter().any(|b| matches!(b.role, Role::Skip(_)) && b.text.contains(wanted)) {
            return Err(format!("no skipped block contains {wanted:?}"));
        }
    }
    Ok(())
}

/// The block as the test runs it (see the module doc), or why it cannot run.
fn rewrite(text: &str, bins: &Bins, addr: Option<SocketAddr>) -> Result<String, String> {
    let mut out = text.replace("cargo build --release --workspace && ", "");
    out = out.replace("./target/release/relay-worker", &bins.worker.to_string_lossy());
    out = out.replace("./target/release/relay", &bins.relay.to_string_lossy());
    if out.contains("cargo ") {
        return Err("it runs cargo: mark it <!-- docs-test: skip <why> -->".into());
    }
    if out.contains("localhost:8080") {
        let addr = addr.ok_or("it talks to relay before a server block started one")?;
        out = out.replace("localhost:8080", &addr.to_string());
    }
    Ok(out)
}

/// The HTTP statuses a block shows in its output comments (`# 503 {...}`): answers it expects.
fn shown_statuses(text: &str) -> Vec<u16> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(pos) = line.find('#') else { continue };
        let comment = line[pos + 1..].trim_start();
        let word = comment.split_whitespace().next().unwrap_or("");
        if word.len() == 3
            && let Ok(code) = word.parse::<u16>()
            && (100..600).contains(&code)
        {
            out.push(code);
        }
    }
    out
}

/// The statuses the curl shim reported, and the ones the block did not expect.
fn unexpected_statuses(stderr: &str, block: &str) -> (usize, Vec<String>) {
    let shown = shown_statuses(block);
    let mut seen = 0;
    let mut bad = Vec::new();
    for line in stderr.lines() {
        let Some(rest) = line.strip_prefix(STATUS_PREFIX) else { continue };
        seen += 1;
        let code = rest.split_whitespace().next().and_then(|c| c.parse::<u16>().ok()).unwrap_or(0);
        if (code == 0 || code >= 400) && !shown.contains(&code) {
            bad.push(rest.to_string());
        }
    }
    (seen, bad)
}

// ----- running them --------------------------------------------------------------------------

struct Tools {
    curl: PathBuf,
}

impl Tools {
    /// bash, curl and jq on PATH; `None` (after a skip, or a failure under CI) when one is not.
    fn find() -> Option<Tools> {
        let find = |name: &str| {
            std::env::var_os("PATH")
                .map(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|f| f.is_file()))
                .unwrap_or_default()
        };
        let (bash, curl, jq) = (find("bash"), find("curl"), find("jq"));
        match (bash, curl, jq) {
            (Some(_), Some(curl), Some(_)) => Some(Tools { curl }),
            _ => {
                skip_or_fail("docs examples", "the examples need bash, curl and jq on PATH (apt-get install curl jq)");
                None
            }
        }
    }
}

#[derive(Clone)]
struct Bins {
    relay: PathBuf,
    worker: PathBuf,
}

impl Bins {
    /// The relay binary Cargo built for these tests, and relay-worker, which Cargo does not hand
    /// to another package's tests: built here once, with the same cargo, profile, target and
    /// target directory as this test executable (a no-op when it is up to date).
    fn get() -> Result<Bins, String> {
        static BINS: OnceLock<Result<Bins, String>> = OnceLock::new();
        BINS.get_or_init(|| {
            let worker = crate::support::real_worker::bin()?.to_path_buf();
            Ok(Bins { relay: PathBuf::from(relay_bin()), worker })
        })
        .clone()
    }
}

/// A process started by a background block, in its own process group.
struct Background {
    child: Child,
    line: usize,
    log: Arc<Mutex<String>>,
}

impl Background {
    fn log_text(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// SIGTERM to the group; once the process and everything else in its group have ended
    /// (bounded: then SIGKILL), its exit status.
    fn stop(&mut self) -> Option<ExitStatus> {
        let pid = self.child.id();
        signal_group(pid, "TERM");
        let mut status = None;
        let ended = poll_until(Duration::from_secs(10), || {
            if status.is_none() {
                status = self.child.try_wait().ok().flatten();
            }
            status.is_some() && !signal_group(pid, "0")
        });
        if !ended {
            signal_group(pid, "KILL");
            if status.is_none() {
                status = self.child.wait().ok();
            }
        }
        status
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Signals the process group that `pid` leads (every process this test spawns leads its own);
/// whether any process of the group was there to get it (signal `0` only asks).
fn signal_group(pid: u32, sig: &str) -> bool {
    Command::new("kill")
        .args([format!("-{sig}"), "--".into(), format!("-{pid}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Collects a pipe into `log` on a thread of its own.
fn collect(pipe: impl Read + Send + 'static, log: Arc<Mutex<String>>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if let Ok(mut l) = log.lock() {
                l.push_str(&line);
                l.push('\n');
            }
        }
    })
}

struct Session {
    doc: String,
    dir: PathBuf,
    state: PathBuf,
    env: BTreeMap<String, String>,
    bins: Bins,
    addr: Option<SocketAddr>,
    background: Vec<Background>,
    ran: usize,
}

impl Session {
    fn new(doc: &str, bins: Bins, tools: &Tools) -> Session {
        let dir = std::env::temp_dir().join(format!("relay-docs-{}", uuid::Uuid::new_v4().simple()));
        let shim_dir = dir.join(".docs-test-bin");
        std::fs::create_dir_all(dir.join("tmp")).expect("work dir");
        std::fs::create_dir_all(&shim_dir).expect("shim dir");
        let shim = format!(
            "#!/bin/sh\nexec '{}' --write-out '%{{stderr}}{STATUS_PREFIX}%{{http_code}} %{{method}} %{{url_effective}}\\n' \"$@\"\n",
            tools.curl.display()
        );
        let shim_path = shim_dir.join("curl");
        std::fs::write(&shim_path, shim).expect("curl shim");
        let made_executable = Command::new("chmod").arg("+x").arg(&shim_path).status().is_ok_and(|s| s.success());
        assert!(made_executable, "chmod +x the curl shim");
        let path = std::env::var("PATH").unwrap_or_default();
        let mut env = BTreeMap::new();
        for (k, v) in [
            ("PATH", format!("{}:{path}", shim_dir.display())),
            ("HOME", dir.display().to_string()),
            ("TMPDIR", dir.join("tmp").display().to_string()),
            // relay picks a free port and logs it; BIND keeps it on loopback.
            ("PORT", "0".into()),
            ("BIND", "127.0.0.1".into()),
        ] {
            env.insert(k.to_string(), v);
        }
        let state = dir.join(".docs-test-env");
        Session { doc: doc.to_string(), dir, state, env, bins, addr: None, background: Vec::new(), ran: 0 }
    }

    fn step(&mut self, block: &Block) {
        if let Role::Skip(why) = &block.role {
            let _ = writeln!(
                std::io::stderr().lock(),
                "*** SKIPPED {}:{} (not run by the docs test: {why}) ***",
                self.doc,
                block.line
            );
            return;
        }
        let script = match rewrite(&block.text, &self.bins, self.addr) {
            Ok(s) => s,
            Err(e) => self.fail(block, &format!("cannot run: {e}"), ""),
        };
        let started = Instant::now();
        match block.role {
            Role::Run => self.run(block, &script),
            Role::Server => self.start_server(block, &script),
            Role::Worker => self.start_worker(block, &script),
            Role::Skip(_) => {}
        }
        let took = started.elapsed();
        if took > SLOW_BLOCK {
            let _ = writeln!(std::io::stderr().lock(), "docs example {}:{} took {took:?}", self.doc, block.line);
        }
        self.ran += 1;
    }

    fn command(&self, script: &str) -> Command {
        let mut cmd = Command::new("bash");
        cmd.args(["--noprofile", "--norc", "-c", script]).env_clear().envs(&self.env).current_dir(&self.dir);
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
        cmd
    }

    /// A foreground block: runs to its end, and its variables carry over to the next block.
    fn run(&mut self, block: &Block, script: &str) {
        let full = format!("set -a -euo pipefail\n{script}\nenv -0 > '{}'\n", self.state.display());
        let _ = std::fs::remove_file(&self.state);
        let mut child = self.command(&full).spawn().expect("spawn bash");
        let (out, err) = (Arc::new(Mutex::new(String::new())), Arc::new(Mutex::new(String::new())));
        let readers = [
            collect(child.stdout.take().expect("stdout"), out.clone()),
            collect(child.stderr.take().expect("stderr"), err.clone()),
        ];
        let mut status = None;
        let ended = poll_until(BLOCK_DEADLINE, || {
            status = child.try_wait().ok().flatten();
            status.is_some()
        });
        if !ended {
            // (Not yet reaped, so the group is still this block's.)
            signal_group(child.id(), "KILL");
            let _ = child.wait();
        }
        for r in readers {
            let _ = r.join();
        }
        let (out, err) =
            (out.lock().map(|s| s.clone()).unwrap_or_default(), err.lock().map(|s| s.clone()).unwrap_or_default());
        let output = format!("--- stdout ---\n{out}--- stderr ---\n{err}");
        match status {
            None => self.fail(block, &format!("did not end within {BLOCK_DEADLINE:?}"), &output),
            Some(s) if !s.success() => self.fail(block, &format!("a command failed ({s})"), &output),
            Some(_) => {}
        }
        let (seen, bad) = unexpected_statuses(&err, &block.text);
        if !bad.is_empty() {
            self.fail(
                block,
                &format!("relay answered {bad:?}, which the block does not show (# <status> ...)"),
                &output,
            );
        }
        if block.text.contains("curl ") && seen == 0 {
            self.fail(block, "it runs curl, but the shim saw no transfer (a --write-out of its own?)", &output);
        }
        if std::env::var_os("DOCS_TEST_SHOW").is_some() {
            let _ = writeln!(std::io::stderr().lock(), "=== {}:{}\n{}\n{output}", self.doc, block.line, block.text);
        }
        self.load_state(block, &output);
    }

    fn load_state(&mut self, block: &Block, output: &str) {
        let bytes = match std::fs::read(&self.state) {
            Ok(b) => b,
            Err(e) => self.fail(block, &format!("the block's variables could not be kept: {e}"), output),
        };
        let mut env = BTreeMap::new();
        for entry in bytes.split(|b| *b == 0).filter(|e| !e.is_empty()) {
            let entry = String::from_utf8_lossy(entry);
            if let Some((k, v)) = entry.split_once('=')
                && !matches!(k, "_" | "SHLVL" | "PWD" | "OLDPWD")
            {
                env.insert(k.to_string(), v.to_string());
            }
        }
        self.env = env;
    }

    /// A background block, as it is: a single command (the usual case) is exec'd by bash, so
    /// the signals and the exit status are the program's own.
    fn spawn_background(&mut self, block: &Block, script: &str) -> usize {
        let mut child = self.command(script).spawn().expect("spawn bash");
        let log = Arc::new(Mutex::new(String::new()));
        collect(child.stdout.take().expect("stdout"), log.clone());
        collect(child.stderr.take().expect("stderr"), log.clone());
        self.background.push(Background { child, line: block.line, log });
        self.background.len() - 1
    }

    fn start_server(&mut self, block: &Block, script: &str) {
        let i = self.spawn_background(block, script);
        let mut addr = None;
        let listening = poll_until(START_DEADLINE, || {
            let bg = &mut self.background[i];
            addr = bg.log_text().lines().find(|l| l.contains("msg=listening")).and_then(|l| {
                l.split_whitespace().find_map(|kv| kv.strip_prefix("addr=")).and_then(|a| a.parse().ok())
            });
            addr.is_some() || bg.child.try_wait().ok().flatten().is_some()
        });
        match addr {
            Some(a) if listening => self.addr = Some(a),
            _ => {
                let log = self.background[i].log_text();
                self.fail(block, "relay did not start listening", &log)
            }
        }
    }

    fn start_worker(&mut self, block: &Block, script: &str) {
        let Some(addr) = self.addr else { self.fail(block, "a worker block before the server block", "") };
        let active = || {
            let r = request(addr, "GET", "/healthz", &[], None);
            (r.status == 200).then(|| r.json()["active_clients"].as_u64()).flatten().unwrap_or(0)
        };
        let before = active();
        let i = self.spawn_background(block, script);
        let connected = poll_until(START_DEADLINE, || {
            active() > before || self.background[i].child.try_wait().ok().flatten().is_some()
        });
        if !connected || active() <= before {
            let log = self.background[i].log_text();
            self.fail(block, "the worker did not connect", &log);
        }
    }

    /// Panics with everything a reader needs to see why the example failed.
    fn fail(&mut self, block: &Block, why: &str, output: &str) -> ! {
        let mut logs = String::new();
        for bg in &self.background {
            let text = bg.log_text();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(40)..].join("\n");
            logs.push_str(&format!("--- log of the block at line {} (last 40 lines) ---\n{tail}\n", bg.line));
        }
        self.stop_all();
        panic!("the example at {}:{} {why}\n--- the block ---\n{}\n{output}\n{logs}", self.doc, block.line, block.text);
    }

    fn stop_all(&mut self) {
        while let Some(mut bg) = self.background.pop() {
            bg.stop();
        }
    }

    fn finish(mut self) {
        assert!(self.ran > 0, "{}: no example ran", self.doc);
        // Workers first (they drain), then relay: SIGTERM is its graceful shutdown.
        let mut statuses = Vec::new();
        while let Some(mut bg) = self.background.pop() {
            statuses.push((bg.line, bg.stop(), bg.log_text()));
        }
        for (line, status, log) in statuses {
            let ok = status.is_some_and(|s| s.success() || s.code().is_none());
            assert!(ok, "{}:{}: the background block ended with {status:?} after SIGTERM:\n{log}", self.doc, line);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.stop_all();
    }
}

mod tests {
    use super::*;

    fn check(doc: &str, expected: Result<Vec<(usize, Role)>, &str>) {
        let got = parse_blocks(doc).map(|bs| bs.into_iter().map(|b| (b.line, b.role)).collect::<Vec<_>>());
        match (&got, &expected) {
            (Ok(g), Ok(e)) => assert_eq!(g, e, "{doc}"),
            (Err(g), Err(e)) => assert!(g.contains(e), "{doc}: {g}"),
            _ => panic!("{doc}: got {got:?}, expected {expected:?}"),
        }
    }

    #[test]
    fn blocks_markers_and_mistakes() {
        let skip = |why: &str| Role::Skip(why.to_string());
        check("text\n```sh\ncurl x\n```\n", Ok(vec![(2, Role::Run)]));
        check("<!-- docs-test: server -->\n```sh\nrelay\n```\n", Ok(vec![(2, Role::Server)]));
        check("<!-- docs-test: worker -->\n```bash\nw\n```\n", Ok(vec![(2, Role::Worker)]));
        check(
            "<!-- docs-test: skip needs the internet -->\n```sh\nc\n```\n",
            Ok(vec![(2, skip("needs the internet"))]),
        );
        check("```json\n{\"a\":1}\n```\n```rust\nfn main() {}\n```\n", Ok(vec![]));
        check("- item\n  ```sh\n  curl y\n  ```\n", Ok(vec![(2, Role::Run)]));
        check("```sh\ncurl x\n", Err("never closed"));
        check("<!-- docs-test: skip x -->\n\n```sh\nc\n```\n", Err("right before a code fence"));
        check("<!-- docs-test: skip -->\n```sh\nc\n```\n", Err("says why"));
        check("<!-- docs-test: later -->\n```sh\nc\n```\n", Err("unknown marker"));
        check("<!-- docs-test: server -->\n```json\n{}\n```\n", Err("only sh blocks run"));
        check("```\ncurl localhost:8080/healthz\n```\n", Err("looks like a command"));
    }

    #[test]
    fn rewrites_and_statuses() {
        let bins = Bins { relay: "/b/relay".into(), worker: "/b/relay-worker".into() };
        let addr: SocketAddr = "127.0.0.1:4000".parse().expect("addr");
        let quick = "cargo build --release --workspace && A=1 ./target/release/relay";
        assert_eq!(rewrite(quick, &bins, None), Ok("A=1 /b/relay".into()));
        let worker = "RELAY_URL=ws://localhost:8080/ws ./target/release/relay-worker";
        assert_eq!(rewrite(worker, &bins, Some(addr)), Ok("RELAY_URL=ws://127.0.0.1:4000/ws /b/relay-worker".into()));
        assert!(rewrite("curl localhost:8080/x", &bins, None).is_err_and(|e| e.contains("before a server")));
        assert!(rewrite("cargo test --workspace", &bins, None).is_err_and(|e| e.contains("runs cargo")));

        let block = "curl a\n# 503 {\"error\":\"no_worker\"}\ncurl b   # 409 when final\ncurl c\n# {\"x\":1}";
        assert_eq!(shown_statuses(block), vec![503, 409]);
        let stderr = format!("{STATUS_PREFIX}202 POST u\n{STATUS_PREFIX}503 POST u\nnoise\n{STATUS_PREFIX}404 GET v\n");
        assert_eq!(unexpected_statuses(&stderr, block), (3, vec!["404 GET v".to_string()]));
        assert_eq!(unexpected_statuses(&format!("{STATUS_PREFIX}000 GET w\n"), block).1, vec!["000 GET w"]);
    }
}
