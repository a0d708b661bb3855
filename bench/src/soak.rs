//! `relay-bench soak`: minutes of mixed load against the release relay while workers join, die
//! and misbehave, then the accounting. Run by `scripts/soak.sh`.
//!
//! Workers: real `relay-worker` processes (kinds `http`, `file`, `echo`) that the chaos thread kills
//! with SIGKILL, drains with SIGTERM, restarts, and adds for a while; and fake workers (kind
//! `echo`) over real WebSockets: good ones that leave and rejoin, a black hole that takes tasks
//! and never answers, a dropper that cuts its connection in the middle of every other task, and
//! a flaky one that fails, answers twice, or sends garbage. Clients: wait=true and async submits,
//! delayed and queued tasks, cancels, file uploads with `file` tasks, reads of the task, health
//! and metrics endpoints. Every accepted task is followed to a final status.
//!
//! The load runs in two halves, each followed by a quiet period: clients stop, the worker
//! population returns to its starting shape, every task becomes final, TASK_TTL passes so relay
//! forgets them, and relay is measured (open fds, RSS). The run fails when:
//! - a task was lost: accepted, but never seen done, failed or canceled (or relay's own
//!   `relay_tasks_total` counters disagree with what the clients saw);
//! - a request got an answer the API does not give for it, or relay died;
//! - relay's open fds at the end exceed those at the start by more than `FD_SLACK`;
//! - relay's RSS at the end exceeds its RSS after the first half by more than
//!   max(`RSS_SLACK_KIB`, 10 %): the first half brings the allocator to its working size, so
//!   what the second half adds on top is what does not come back. (RSS at the start is printed
//!   too; it is lower because nothing has run yet.)
//!
//! Everything it starts it stops by PID; it only talks to loopback.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use serde_json::Value;
use tungstenite::Message;

use crate::Opts;
use crate::httpc::{HttpConn, build_request};
use crate::procs::{self, Server};
use crate::scenarios::{API_TOKEN, WORKER_TOKEN, watchdog};
use crate::workers::{is_timeout, ws_connect};

const IO_TIMEOUT: Duration = Duration::from_secs(20);
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// relay's TASK_TTL (and BLOB_TTL) in the soak: short, so the quiet period can wait it out.
const TTL_SECS: u64 = 15;
/// Real relay-worker processes in the starting population.
const REAL_WORKERS: usize = 3;
/// Good fake workers in the starting population (plus one each of the misbehaving kinds).
const GOOD_FAKES: usize = 2;
/// Open fds relay may hold at the end beyond those at the start (measured with only the
/// workers' connections open, so the same set is expected).
const FD_SLACK: usize = 0;
/// Growth of RSS over the second half that is still "flat" (allocator noise), at the least.
const RSS_SLACK_KIB: u64 = 8 * 1024;

/// Tells the threads of one phase to stop.
type Flag = Arc<AtomicBool>;

#[derive(Default)]
struct Counts {
    submitted: AtomicU64,
    refused: AtomicU64,
    done: AtomicU64,
    failed: AtomicU64,
    canceled: AtomicU64,
    lost: AtomicU64,
    errors: AtomicU64,
    uploads: AtomicU64,
    reads: AtomicU64,
}

impl Counts {
    fn finished(&self, status: &str) -> bool {
        let counter = match status {
            "done" => &self.done,
            "failed" => &self.failed,
            "canceled" => &self.canceled,
            _ => return false,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// Shared by clients, checker and report.
struct Ledger {
    counts: Counts,
    /// Accepted tasks not yet seen final: id → when it was accepted.
    open: Mutex<HashMap<String, Instant>>,
    /// The first few unexpected answers, for the report.
    samples: Mutex<Vec<String>>,
}

impl Ledger {
    fn error(&self, what: String) {
        self.counts.errors.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut s) = self.samples.lock()
            && s.len() < 10
        {
            s.push(what);
        }
    }

    fn track(&self, id: &str) {
        self.counts.submitted.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut open) = self.open.lock() {
            open.insert(id.to_string(), Instant::now());
        }
    }

    fn open_count(&self) -> usize {
        self.open.lock().map(|o| o.len()).unwrap_or(0)
    }
}

struct Chaos {
    kills: AtomicU64,
    drains: AtomicU64,
    joins: AtomicU64,
    fake_cycles: AtomicU64,
    drops: AtomicU64,
    held: AtomicU64,
    flaky: AtomicU64,
}

/// The run's settings.
struct Setup {
    relay: SocketAddr,
    floor: SocketAddr,
    worker_bin: PathBuf,
    clients: usize,
}

pub fn run(opts: &Opts) -> Result<(), String> {
    let total = Duration::from_secs(opts.soak_secs.max(2));
    let half = total / 2;
    // Two halves of load, two quiet periods (TTL plus settling), start-up: bounded.
    let done_flag = watchdog(total + Duration::from_secs(2 * (TTL_SECS + 120) + 60));
    for bin in [&opts.relay, &opts.relay_worker] {
        if !bin.exists() {
            return Err(format!("{} not found (build it: cargo build --release --workspace)", bin.display()));
        }
    }
    let scratch = std::env::temp_dir().join(format!("relay-soak-{}", std::process::id()));
    let mut relay = start_relay(opts, &scratch)?;
    let floor = start_floor(total)?;
    let setup = Setup {
        relay: relay.addr,
        floor: floor.addr,
        worker_bin: opts.relay_worker.clone(),
        clients: opts.soak_clients.max(1),
    };
    let result = soak(&setup, &mut relay, half);
    relay.stop();
    drop(floor);
    let _ = std::fs::remove_dir_all(&scratch);
    done_flag.store(true, Ordering::Relaxed);
    result
}

fn start_relay(opts: &Opts, scratch: &std::path::Path) -> Result<Server, String> {
    let mut cmd = Command::new(&opts.relay);
    let ttl = format!("{TTL_SECS}s");
    cmd.env_clear()
        .env("PORT", "0")
        .env("BIND", "127.0.0.1")
        .env("API_TOKEN", API_TOKEN)
        .env("WORKER_TOKEN", WORKER_TOKEN)
        .env("DATA_DIR", "")
        .env("LOG_LEVEL", "warn")
        .env("TASK_TIMEOUT", "1s")
        .env("MAX_RETRIES", "4")
        .env("WAIT_TIMEOUT", "10s")
        .env("TASK_TTL", &ttl)
        .env("BLOB_TTL", &ttl)
        .env("PING_INTERVAL", "500ms")
        .env("PONG_WAIT", "2s")
        .env("SHUTDOWN_TIMEOUT", "2s")
        .env("BLOB_DIR", scratch.join("blobs"))
        .env("TOKEN_STORE", scratch.join("tokens.json"));
    for (k, v) in &opts.relay_env {
        cmd.env(k, v);
    }
    Server::start("relay", cmd, procs::relay_listening, START_TIMEOUT)
}

fn start_floor(total: Duration) -> Result<Server, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    let lifetime = total + Duration::from_secs(2 * (TTL_SECS + 120) + 60);
    cmd.args(["serve-floor", "--seconds", &lifetime.as_secs().to_string()]);
    Server::start("floor", cmd, procs::relay_listening, START_TIMEOUT)
}

/// relay's open file descriptors (what each points to) and resident memory.
#[derive(Clone)]
struct Snapshot {
    fds: usize,
    /// The targets of the fds, sorted (`socket:[…]` numbers made generic), to name what changed.
    targets: Vec<String>,
    rss_kib: u64,
}

fn snapshot(pid: u32) -> Result<Snapshot, String> {
    let dir = format!("/proc/{pid}/fd");
    let mut targets: Vec<String> = std::fs::read_dir(&dir)
        .map_err(|e| format!("{dir}: {e}"))?
        .flatten()
        .map(|e| std::fs::read_link(e.path()).map(|t| t.to_string_lossy().into_owned()).unwrap_or_else(|_| "?".into()))
        .map(|t| if t.starts_with("socket:") { "socket".to_string() } else { t })
        .collect();
    targets.sort();
    Ok(Snapshot { fds: targets.len(), targets, rss_kib: procs::mem(pid)?.rss_kib })
}

/// A snapshot taken once relay holds no socket but its listener and the workers' (the
/// connections the soak used to look at relay may still be closing); the last one after 5 s.
fn settled_snapshot(pid: u32, workers: usize) -> Result<Snapshot, String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let snap = snapshot(pid)?;
        let sockets = snap.targets.iter().filter(|t| *t == "socket").count();
        if sockets == workers + 1 || Instant::now() > deadline {
            return Ok(snap);
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// The fd targets in `now` beyond those in `before` (a multiset difference).
fn new_fds(before: &Snapshot, now: &Snapshot) -> Vec<String> {
    let mut rest = before.targets.clone();
    let mut added = Vec::new();
    for t in &now.targets {
        match rest.iter().position(|r| r == t) {
            Some(i) => {
                rest.remove(i);
            }
            None => added.push(t.clone()),
        }
    }
    added
}

fn soak(setup: &Setup, relay: &mut Server, half: Duration) -> Result<(), String> {
    let ledger =
        Arc::new(Ledger { counts: Counts::default(), open: Mutex::new(HashMap::new()), samples: Mutex::default() });
    let chaos = Arc::new(Chaos {
        kills: AtomicU64::new(0),
        drains: AtomicU64::new(0),
        joins: AtomicU64::new(0),
        fake_cycles: AtomicU64::new(0),
        drops: AtomicU64::new(0),
        held: AtomicU64::new(0),
        flaky: AtomicU64::new(0),
    });
    let mut pop = Population::start(setup, &chaos)?;
    let baseline_workers = pop.expected();
    wait_quiet(setup.relay, baseline_workers, &ledger, relay)?;
    let start = settled_snapshot(relay.pid(), baseline_workers)?;
    println!(
        "soak: relay pid {}, {} workers ({} relay-worker, {} good fakes, a black hole, a dropper, a flaky one), {} clients, 2 x {:?} of load",
        relay.pid(),
        baseline_workers,
        REAL_WORKERS,
        GOOD_FAKES,
        setup.clients,
        half
    );
    println!("soak: start: fds {}, RSS {} KiB", start.fds, start.rss_kib);

    let mut mids = Vec::new();
    for phase in 1..=2 {
        let began = Instant::now();
        let stop: Flag = Arc::new(AtomicBool::new(false));
        let checker_stop: Flag = Arc::new(AtomicBool::new(false));
        let checker = spawn_checker(setup.relay, ledger.clone(), checker_stop.clone());
        let clients: Vec<JoinHandle<()>> = (0..setup.clients)
            .map(|i| {
                let (l, s, addr, floor) = (ledger.clone(), stop.clone(), setup.relay, setup.floor);
                thread::spawn(move || client(i, addr, floor, &l, &s))
            })
            .collect();
        let mut round = 0u64;
        while began.elapsed() < half {
            thread::sleep(Duration::from_secs(2));
            if !relay.alive() {
                stop.store(true, Ordering::Relaxed);
                checker_stop.store(true, Ordering::Relaxed);
                return Err(format!("relay died under load; its last lines:\n{}", relay.log_tail()));
            }
            pop.chaos_step(round, setup, &chaos);
            round += 1;
            if round.is_multiple_of(15) {
                report_progress(phase, began, &ledger);
            }
        }
        stop.store(true, Ordering::Relaxed);
        for c in clients {
            let _ = c.join();
        }
        pop.restore(setup)?;
        // Every task final, with the checker still running.
        let deadline = Instant::now() + Duration::from_secs(60);
        while ledger.open_count() > 0 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(200));
        }
        checker_stop.store(true, Ordering::Relaxed);
        let _ = checker.join();
        let still_open = drain_open(setup.relay, &ledger)?;
        if still_open > 0 {
            println!("soak: {still_open} tasks still not final 60 s after the load stopped");
        }
        wait_quiet(setup.relay, baseline_workers, &ledger, relay)?;
        let snap = settled_snapshot(relay.pid(), baseline_workers)?;
        println!(
            "soak: after half {phase}: fds {} (new since the start: {:?}), RSS {} KiB, peak RSS {} KiB",
            snap.fds,
            new_fds(&start, &snap),
            snap.rss_kib,
            procs::mem(relay.pid())?.hwm_kib
        );
        mids.push(snap);
    }
    pop.stop();

    let metrics = fetch(setup.relay, "/metrics")?;
    let relay_final = |status: &str| metric(&metrics, &format!("relay_tasks_total{{status=\"{status}\"}}"));
    let c = &ledger.counts;
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let (submitted, done, failed, canceled) = (get(&c.submitted), get(&c.done), get(&c.failed), get(&c.canceled));
    let lost = get(&c.lost) + submitted.saturating_sub(done + failed + canceled + get(&c.lost));
    let relay_counts = (relay_final("done"), relay_final("failed"), relay_final("canceled"));
    println!(
        "soak: tasks submitted {submitted}, done {done}, failed {failed}, canceled {canceled}, lost {lost} \
         (503 no_worker {}, uploads {}, reads {})",
        get(&c.refused),
        get(&c.uploads),
        get(&c.reads)
    );
    println!(
        "soak: relay_tasks_total: done {:?}, failed {:?}, canceled {:?}; results ignored: late {:?}, duplicate {:?}, unknown {:?}",
        relay_counts.0,
        relay_counts.1,
        relay_counts.2,
        metric(&metrics, "relay_results_ignored_total{reason=\"late\"}"),
        metric(&metrics, "relay_results_ignored_total{reason=\"duplicate\"}"),
        metric(&metrics, "relay_results_ignored_total{reason=\"unknown\"}"),
    );
    let attempts: Vec<String> = ["done", "failed", "timeout", "disconnect", "send_failed", "canceled"]
        .iter()
        .map(|o| {
            format!("{o} {}", metric(&metrics, &format!("relay_attempts_total{{outcome=\"{o}\"}}")).unwrap_or(-1.0))
        })
        .collect();
    println!("soak: attempts: {}", attempts.join(", "));
    println!(
        "soak: chaos: relay-worker SIGKILLs {}, SIGTERM drains {}, extra workers joined {}, fake workers left and rejoined {}, \
         dropper cut {} tasks, black hole held {} tasks, flaky misbehaved {} times",
        get(&chaos.kills),
        get(&chaos.drains),
        get(&chaos.joins),
        get(&chaos.fake_cycles),
        get(&chaos.drops),
        get(&chaos.held),
        get(&chaos.flaky)
    );
    let (mid, end) = (&mids[0], &mids[1]);
    let rss_bound = mid.rss_kib + RSS_SLACK_KIB.max(mid.rss_kib / 10);
    println!(
        "soak: relay RSS KiB: start {}, after half 1 {}, end {} (bound {rss_bound}); open fds: start {}, after half 1 {}, end {} (bound {})",
        start.rss_kib,
        mid.rss_kib,
        end.rss_kib,
        start.fds,
        mid.fds,
        end.fds,
        start.fds + FD_SLACK
    );

    let mut failures = Vec::new();
    if lost > 0 {
        failures.push(format!("{lost} tasks lost"));
    }
    let as_f = |n: u64| Some(n as f64);
    if relay_counts != (as_f(done), as_f(failed), as_f(canceled)) {
        failures.push(format!(
            "relay's final counts {relay_counts:?} differ from the clients' ({done}, {failed}, {canceled})"
        ));
    }
    if get(&c.errors) > 0 {
        let samples = ledger.samples.lock().map(|s| s.join("\n  ")).unwrap_or_default();
        failures.push(format!("{} unexpected answers or I/O errors, e.g.:\n  {samples}", get(&c.errors)));
    }
    if end.fds > start.fds + FD_SLACK {
        failures.push(format!("open fds grew from {} to {}", start.fds, end.fds));
    }
    if end.rss_kib > rss_bound {
        failures.push(format!(
            "RSS grew over the second half: {} KiB after half 1, {} KiB at the end",
            mid.rss_kib, end.rss_kib
        ));
    }
    if failures.is_empty() {
        println!("soak: OK");
        Ok(())
    } else {
        Err(format!("soak FAILED:\n- {}", failures.join("\n- ")))
    }
}

fn report_progress(phase: u32, began: Instant, ledger: &Ledger) {
    let c = &ledger.counts;
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    eprintln!(
        "soak: half {phase}, {:>4} s: submitted {}, done {}, failed {}, canceled {}, open {}, 503 {}, errors {}",
        began.elapsed().as_secs(),
        get(&c.submitted),
        get(&c.done),
        get(&c.failed),
        get(&c.canceled),
        ledger.open_count(),
        get(&c.refused),
        get(&c.errors)
    );
}

// ---------------------------------------------------------------- relay's state

fn fetch(addr: SocketAddr, path: &str) -> Result<String, String> {
    let mut conn = HttpConn::connect(addr, IO_TIMEOUT)?;
    let resp = conn.request(&build_request("GET", path, Some(API_TOKEN), b""))?;
    if resp.status != 200 {
        return Err(format!("GET {path}: {}", resp.status));
    }
    Ok(String::from_utf8_lossy(resp.body).into_owned())
}

fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

/// Waits until relay is at rest: `workers` connected, no task pending or running, every task
/// forgotten (TASK_TTL after it finished), and no connection but the workers' and ours.
fn wait_quiet(addr: SocketAddr, workers: usize, ledger: &Ledger, relay: &mut Server) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(TTL_SECS + 90);
    loop {
        if !relay.alive() {
            return Err(format!("relay died; its last lines:\n{}", relay.log_tail()));
        }
        let health: Value = serde_json::from_str(&fetch(addr, "/healthz")?).map_err(|e| e.to_string())?;
        let metrics = fetch(addr, "/metrics")?;
        let known: u64 = ["pending", "dispatched", "done", "failed", "canceled"]
            .iter()
            .map(|s| health["tasks"][s].as_u64().unwrap_or(u64::MAX / 8))
            .sum();
        let conns = metric(&metrics, "relay_connections_open");
        let quiet = health["clients"] == workers as u64
            && health["active_clients"] == workers as u64
            && known == 0
            && conns == Some(workers as f64 + 1.0)
            && ledger.open_count() == 0;
        if quiet {
            return Ok(());
        }
        if Instant::now() > deadline {
            let open = ledger.open_count();
            return Err(format!(
                "relay never came to rest: healthz {health}, connections {conns:?}, open tasks {open}"
            ));
        }
        thread::sleep(Duration::from_millis(500));
    }
}

// ---------------------------------------------------------------- clients

/// A small deterministic generator per client.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

struct Api {
    addr: SocketAddr,
    conn: Option<HttpConn>,
}

impl Api {
    /// One request on the keep-alive connection (reopened after an error): (status, body).
    fn call(&mut self, req: &[u8]) -> Result<(u16, Vec<u8>), String> {
        if self.conn.is_none() {
            self.conn = Some(HttpConn::connect(self.addr, IO_TIMEOUT)?);
        }
        let conn = self.conn.as_mut().ok_or("no connection")?;
        match conn.request(req) {
            Ok(r) => Ok((r.status, r.body.to_vec())),
            Err(e) => {
                self.conn = None;
                Err(e)
            }
        }
    }
}

fn json(body: &[u8]) -> Value {
    serde_json::from_slice(body).unwrap_or(Value::Null)
}

fn client(index: usize, addr: SocketAddr, floor: SocketAddr, ledger: &Ledger, stop: &AtomicBool) {
    let mut rng = Rng(index as u64 * 7919 + 1);
    let mut api = Api { addr, conn: None };
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let pick = rng.below(100);
        let result = match pick {
            0..35 => submit(&mut api, ledger, true, &format!(r#"{{"payload":{{"kind":"echo","n":{n}}}}}"#)),
            35..60 => submit(&mut api, ledger, false, &format!(r#"{{"payload":{{"kind":"echo","n":{n}}}}}"#)),
            60..70 => {
                let body = format!(r#"{{"payload":{{"kind":"http","spec":{{"url":"http://{floor}/t/{n}"}}}}}}"#);
                submit(&mut api, ledger, false, &body)
            }
            70..76 => {
                let delay = 200 + rng.below(2800);
                submit(&mut api, ledger, false, &format!(r#"{{"payload":{{"kind":"echo"}},"delay":"{delay}ms"}}"#))
            }
            76..80 => submit(&mut api, ledger, false, r#"{"payload":{"kind":"echo","q":1},"queue":true}"#),
            80..87 => submit_and_cancel(&mut api, ledger, rng.below(2) == 0),
            87..92 => upload_and_process(&mut api, ledger, n, index),
            _ => read_something(&mut api, ledger, rng.below(3)),
        };
        if let Err(e) = result {
            ledger.error(format!("client {index}: {e}"));
        }
        // The pace of a client: a few hundred operations per second in all, not a flood.
        thread::sleep(Duration::from_millis(2 + rng.below(8)));
    }
}

/// Submits; records the task by the answer: final (counted), accepted (followed), or 503.
fn submit(api: &mut Api, ledger: &Ledger, wait: bool, body: &str) -> Result<(), String> {
    let path = if wait { "/tasks?wait=true" } else { "/tasks" };
    let (status, resp) = api.call(&build_request("POST", path, Some(API_TOKEN), body.as_bytes()))?;
    let v = json(&resp);
    match (status, v["task_id"].as_str()) {
        (503, _) if v["error"] == "no_worker" => {
            ledger.counts.refused.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        (200 | 502 | 409, Some(_)) if wait => {
            ledger.counts.submitted.fetch_add(1, Ordering::Relaxed);
            let st = v["status"].as_str().unwrap_or("");
            if ledger.counts.finished(st) { Ok(()) } else { Err(format!("{status} with status {st:?}")) }
        }
        (202, Some(id)) => {
            ledger.track(id);
            Ok(())
        }
        _ => Err(format!("POST {path} {body}: {status} {}", String::from_utf8_lossy(&resp))),
    }
}

/// Submits and cancels at once (before or after the worker got it); the DELETE's answer says
/// how the task ended.
fn submit_and_cancel(api: &mut Api, ledger: &Ledger, delayed: bool) -> Result<(), String> {
    let body = if delayed { r#"{"payload":{"kind":"echo"},"delay":"2s"}"# } else { r#"{"payload":{"kind":"echo"}}"# };
    let (status, resp) = api.call(&build_request("POST", "/tasks", Some(API_TOKEN), body.as_bytes()))?;
    let v = json(&resp);
    let id = match (status, v["task_id"].as_str()) {
        (202, Some(id)) => id.to_string(),
        (503, _) => {
            ledger.counts.refused.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        _ => return Err(format!("POST /tasks: {status} {}", String::from_utf8_lossy(&resp))),
    };
    ledger.counts.submitted.fetch_add(1, Ordering::Relaxed);
    let (status, resp) = api.call(&build_request("DELETE", &format!("/tasks/{id}"), Some(API_TOKEN), b""))?;
    let v = json(&resp);
    let st = v["status"].as_str().unwrap_or("");
    match status {
        200 if st == "canceled" => {
            ledger.counts.finished(st);
            Ok(())
        }
        409 if ledger.counts.finished(st) => Ok(()),
        _ => {
            // Not known final: follow it like any other task.
            if let Ok(mut open) = ledger.open.lock() {
                open.insert(id.clone(), Instant::now());
            }
            Err(format!("DELETE /tasks/{id}: {status} {}", String::from_utf8_lossy(&resp)))
        }
    }
}

/// Uploads a small file and submits a `file` task for it (a relay-worker downloads, hashes and
/// uploads it back).
fn upload_and_process(api: &mut Api, ledger: &Ledger, n: u64, index: usize) -> Result<(), String> {
    let data: Vec<u8> = (0..4096u32).map(|i| (i as u64 ^ n) as u8).collect();
    let mut body = format!(
        "--soakboundary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"soak-{index}-{n}.bin\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(&data);
    body.extend_from_slice(b"\r\n--soakboundary--\r\n");
    let mut req = format!(
        "POST /files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_TOKEN}\r\n\
         Content-Type: multipart/form-data; boundary=soakboundary\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(&body);
    let (status, resp) = api.call(&req)?;
    let v = json(&resp);
    let Some(file_id) = v["file_id"].as_str().filter(|_| status == 201) else {
        return Err(format!("POST /files: {status} {}", String::from_utf8_lossy(&resp)));
    };
    ledger.counts.uploads.fetch_add(1, Ordering::Relaxed);
    let task = format!(r#"{{"payload":{{"kind":"file","spec":{{"file_id":"{file_id}"}}}}}}"#);
    submit(api, ledger, false, &task)
}

fn read_something(api: &mut Api, ledger: &Ledger, which: u64) -> Result<(), String> {
    let path = ["/healthz", "/metrics", "/clients"][which as usize % 3];
    let (status, resp) = api.call(&build_request("GET", path, Some(API_TOKEN), b""))?;
    if status != 200 {
        return Err(format!("GET {path}: {status} {}", String::from_utf8_lossy(&resp)));
    }
    ledger.counts.reads.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// Follows every accepted task until it is final, until `stop`; one that relay no longer
/// knows before it was seen final is lost.
fn spawn_checker(addr: SocketAddr, ledger: Arc<Ledger>, stop: Flag) -> JoinHandle<()> {
    thread::spawn(move || {
        let mut api = Api { addr, conn: None };
        while !stop.load(Ordering::Relaxed) {
            let ids: Vec<String> = ledger.open.lock().map(|o| o.keys().cloned().collect()).unwrap_or_default();
            for id in ids {
                if let Err(e) = check_one(&mut api, &ledger, &id) {
                    ledger.error(format!("checker: {e}"));
                }
            }
            thread::sleep(Duration::from_millis(20));
        }
    })
}

fn check_one(api: &mut Api, ledger: &Ledger, id: &str) -> Result<(), String> {
    let (status, resp) = api.call(&build_request("GET", &format!("/tasks/{id}"), Some(API_TOKEN), b""))?;
    let outcome = match status {
        200 => {
            let v = json(&resp);
            let st = v["status"].as_str().unwrap_or("").to_string();
            if !matches!(st.as_str(), "done" | "failed" | "canceled") {
                return Ok(()); // pending or dispatched: look again later
            }
            Some(st)
        }
        404 => None,
        _ => return Err(format!("GET /tasks/{id}: {status} {}", String::from_utf8_lossy(&resp))),
    };
    let removed = ledger.open.lock().map(|mut o| o.remove(id).is_some()).unwrap_or(false);
    if removed {
        match outcome {
            Some(st) => {
                ledger.counts.finished(&st);
            }
            None => {
                ledger.counts.lost.fetch_add(1, Ordering::Relaxed);
                ledger.error(format!("task {id} forgotten by relay before it was seen final"));
            }
        }
    }
    Ok(())
}

/// After the wait for the open tasks: counts those still open as lost, and forgets them.
fn drain_open(addr: SocketAddr, ledger: &Ledger) -> Result<usize, String> {
    let ids: Vec<String> = ledger.open.lock().map(|o| o.keys().cloned().collect()).unwrap_or_default();
    let mut api = Api { addr, conn: None };
    for id in &ids {
        check_one(&mut api, ledger, id)?;
    }
    let left: Vec<String> = ledger.open.lock().map(|mut o| o.drain().map(|(k, _)| k).collect()).unwrap_or_default();
    for id in &left {
        ledger.counts.lost.fetch_add(1, Ordering::Relaxed);
        ledger.error(format!("task {id} not final 60 s after the load stopped"));
    }
    Ok(left.len())
}

// ---------------------------------------------------------------- workers

/// How a fake worker behaves.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// Answers every task at once.
    Good,
    /// Takes tasks (up to its concurrency) and never answers; answers pings.
    BlackHole,
    /// Cuts its TCP connection in the middle of every other task, then connects again.
    Dropper,
    /// Fails, answers twice, or sends garbage before answering.
    Flaky,
}

struct Fake {
    kind: Kind,
    /// Set by the chaos thread: leave (close, or cut) and join again.
    cycle: Flag,
    stop: Flag,
    /// Whether it is connected now.
    connected: Flag,
    join: Option<JoinHandle<()>>,
}

impl Fake {
    fn start(addr: SocketAddr, kind: Kind, chaos: &Arc<Chaos>) -> Fake {
        let (cycle, stop, connected) = (Flag::default(), Flag::default(), Flag::default());
        let (c, s, k, ch) = (cycle.clone(), stop.clone(), connected.clone(), chaos.clone());
        let join = thread::spawn(move || fake_worker(addr, kind, &c, &s, &k, &ch));
        Fake { kind, cycle, stop, connected, join: Some(join) }
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

fn fake_worker(
    addr: SocketAddr,
    kind: Kind,
    cycle: &AtomicBool,
    stop: &AtomicBool,
    connected: &AtomicBool,
    chaos: &Chaos,
) {
    let concurrency = match kind {
        Kind::BlackHole => 4,
        Kind::Dropper => 8,
        Kind::Good | Kind::Flaky => 64,
    };
    let mut tasks = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut ws) = ws_connect(addr, WORKER_TOKEN, None) else {
            thread::sleep(Duration::from_millis(200));
            continue;
        };
        let hello =
            format!(r#"{{"type":"hello","kinds":["echo"],"concurrency":{concurrency},"version":"soak-{kind:?}"}}"#);
        if ws.send(Message::text(hello)).is_err()
            || ws.get_mut().set_read_timeout(Some(Duration::from_millis(100))).is_err()
        {
            continue;
        }
        connected.store(true, Ordering::Relaxed);
        let cut = loop {
            if stop.load(Ordering::Relaxed) {
                let _ = ws.close(None);
                let _ = ws.flush();
                break false;
            }
            if cycle.swap(false, Ordering::Relaxed) {
                // Good workers leave cleanly; the black hole just vanishes.
                if kind == Kind::BlackHole {
                    break true;
                }
                let _ = ws.close(None);
                let _ = ws.flush();
                break false;
            }
            let text = match ws.read() {
                Ok(Message::Text(t)) => t,
                Ok(_) => continue,
                Err(e) if is_timeout(&e) => continue,
                Err(_) => break true,
            };
            let v: Value = serde_json::from_str(text.as_str()).unwrap_or(Value::Null);
            if v["type"] != "task" {
                continue; // cancel: advisory
            }
            let id = v["task_id"].as_str().unwrap_or("").to_string();
            tasks += 1;
            let done = format!(r#"{{"type":"result","task_id":"{id}","status":"done","data":{{"by":"{kind:?}"}}}}"#);
            let sent = match kind {
                Kind::Good => ws.send(Message::text(done)),
                Kind::BlackHole => {
                    chaos.held.fetch_add(1, Ordering::Relaxed);
                    Ok(())
                }
                Kind::Dropper if tasks.is_multiple_of(2) => {
                    chaos.drops.fetch_add(1, Ordering::Relaxed);
                    break true;
                }
                Kind::Dropper => ws.send(Message::text(done)),
                Kind::Flaky => {
                    chaos.flaky.fetch_add(1, Ordering::Relaxed);
                    match tasks % 4 {
                        0 => ws.send(Message::text(format!(
                            r#"{{"type":"result","task_id":"{id}","status":"failed","error":"flaky"}}"#
                        ))),
                        1 => ws.send(Message::text(done.clone())).and_then(|()| ws.send(Message::text(done))),
                        2 => ws.send(Message::text("{not json")).and_then(|()| ws.send(Message::text(done))),
                        _ => ws.send(Message::text(done)),
                    }
                }
            };
            if sent.is_err() {
                break true;
            }
        };
        connected.store(false, Ordering::Relaxed);
        if cut {
            let _ = ws.get_mut().shutdown(std::net::Shutdown::Both);
        }
        drop(ws);
        if !stop.load(Ordering::Relaxed) {
            thread::sleep(Duration::from_millis(300));
        }
    }
}

/// A relay-worker process.
struct RealWorker {
    child: Child,
}

impl RealWorker {
    fn start(setup: &Setup) -> Result<RealWorker, String> {
        let url = format!("ws://{}/ws", setup.relay);
        let child = Command::new(&setup.worker_bin)
            .env_clear()
            .env("RELAY_URL", url)
            .env("TOKEN", WORKER_TOKEN)
            .env("CONCURRENCY", "4")
            .env("HTTP_TIMEOUT", "5s")
            .env("SHUTDOWN_TIMEOUT", "3s")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("start {}: {e}", setup.worker_bin.display()))?;
        procs::track_child(child.id());
        Ok(RealWorker { child })
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our child's PID; it is reaped only in `reap`, after which the
        // struct is gone.
        unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
    }

    /// Waits (bounded) for the exit, SIGKILLs past it, reaps.
    fn reap(mut self, within: Duration) {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        procs::untrack_child(self.child.id());
    }
}

/// Every worker of the run, and the chaos applied to them.
struct Population {
    real: Vec<RealWorker>,
    extra: Option<RealWorker>,
    fakes: Vec<Fake>,
}

impl Population {
    fn start(setup: &Setup, chaos: &Arc<Chaos>) -> Result<Population, String> {
        let real = (0..REAL_WORKERS).map(|_| RealWorker::start(setup)).collect::<Result<Vec<_>, _>>()?;
        let mut fakes: Vec<Fake> = (0..GOOD_FAKES).map(|_| Fake::start(setup.relay, Kind::Good, chaos)).collect();
        for kind in [Kind::BlackHole, Kind::Dropper, Kind::Flaky] {
            fakes.push(Fake::start(setup.relay, kind, chaos));
        }
        Ok(Population { real, extra: None, fakes })
    }

    fn expected(&self) -> usize {
        self.real.len() + self.fakes.len()
    }

    /// One step of chaos; `round` picks which.
    fn chaos_step(&mut self, round: u64, setup: &Setup, chaos: &Chaos) {
        let which = (round as usize / 6) % self.real.len().max(1);
        match round % 6 {
            0 => {
                // SIGKILL in the middle of whatever it runs; a new process takes its place.
                if let Ok(fresh) = RealWorker::start(setup) {
                    let old = std::mem::replace(&mut self.real[which], fresh);
                    old.signal(libc::SIGKILL);
                    old.reap(Duration::from_secs(5));
                    chaos.kills.fetch_add(1, Ordering::Relaxed);
                }
            }
            1 => {
                let good = self.fakes.iter().filter(|f| f.kind == Kind::Good).nth(round as usize % GOOD_FAKES.max(1));
                if let Some(f) = good {
                    f.cycle.store(true, Ordering::Relaxed);
                    chaos.fake_cycles.fetch_add(1, Ordering::Relaxed);
                }
            }
            2 => {
                // A drain: SIGTERM, it finishes what it runs and exits; then a new one.
                if let Ok(fresh) = RealWorker::start(setup) {
                    let old = std::mem::replace(&mut self.real[which], fresh);
                    old.signal(libc::SIGTERM);
                    thread::spawn(move || old.reap(Duration::from_secs(10)));
                    chaos.drains.fetch_add(1, Ordering::Relaxed);
                }
            }
            3 => {
                // An extra worker joins for a while, or the one that joined leaves (SIGKILL).
                match self.extra.take() {
                    Some(w) => {
                        w.signal(libc::SIGKILL);
                        w.reap(Duration::from_secs(5));
                    }
                    None => {
                        self.extra = RealWorker::start(setup).ok();
                        chaos.joins.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            4 => {
                if let Some(f) = self.fakes.iter().find(|f| f.kind == Kind::BlackHole) {
                    f.cycle.store(true, Ordering::Relaxed);
                }
            }
            _ => {}
        }
    }

    /// Back to the starting shape: no extra worker, every real one running, fakes connected.
    fn restore(&mut self, setup: &Setup) -> Result<(), String> {
        if let Some(w) = self.extra.take() {
            w.signal(libc::SIGKILL);
            w.reap(Duration::from_secs(5));
        }
        for slot in &mut self.real {
            if !matches!(slot.child.try_wait(), Ok(None)) {
                let old = std::mem::replace(slot, RealWorker::start(setup)?);
                old.reap(Duration::ZERO);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.fakes.iter().any(|f| !f.connected.load(Ordering::Relaxed)) {
            if Instant::now() > deadline {
                return Err("fake workers did not reconnect".into());
            }
            thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    fn stop(&mut self) {
        for f in &mut self.fakes {
            f.stop();
        }
        for w in self.real.drain(..).chain(self.extra.take()) {
            w.signal(libc::SIGTERM);
            w.reap(Duration::from_secs(5));
        }
    }
}

impl Drop for Population {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(targets: &[&str]) -> Snapshot {
        Snapshot { fds: targets.len(), targets: targets.iter().map(|t| t.to_string()).collect(), rss_kib: 0 }
    }

    #[test]
    fn new_fds_is_a_multiset_difference() {
        let start = snap(&["/dev/null", "socket", "socket"]);
        assert_eq!(new_fds(&start, &snap(&["/dev/null", "socket", "socket"])), Vec::<String>::new());
        assert_eq!(new_fds(&start, &snap(&["/dev/null", "socket", "socket", "socket"])), ["socket"]);
        assert_eq!(new_fds(&start, &snap(&["socket", "/tmp/b/x.blob"])), ["/tmp/b/x.blob"]);
    }

    #[test]
    fn metric_lines() {
        let text =
            "# TYPE relay_tasks_total counter\nrelay_tasks_total{status=\"done\"} 12\nrelay_connections_open 9\n";
        assert_eq!(metric(text, "relay_tasks_total{status=\"done\"}"), Some(12.0));
        assert_eq!(metric(text, "relay_connections_open"), Some(9.0));
        assert_eq!(metric(text, "relay_connections"), None);
        assert_eq!(metric(text, "relay_tasks_total{status=\"failed\"}"), None);
    }
}
