//! The scenarios: start a server, attach the answering side, run the load, stop everything, and
//! put the figures in one report with the ratios the targets are stated in. Each scenario starts
//! a fresh server, so tasks kept from one never weigh on the next.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::httpc::{HttpConn, build_request, json_str_field};
use crate::load::{self, Client, Outcome, Window};
use crate::nats::{NatsConn, Op};
use crate::procs::{self, Server};
use crate::workers::{Idle, NATS_SUBJECT, Pool};
use crate::{Opts, RESULT_DATA};

pub const API_TOKEN: &str = "bench-api-token";
pub const WORKER_TOKEN: &str = "bench-worker-token";
pub(crate) const START_TIMEOUT: Duration = Duration::from_secs(10);
pub(crate) const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Tasks a fake worker may have in flight ("concurrency high").
pub(crate) const WORKER_CONCURRENCY: u32 = 1024;
/// Idle connections per source address 127.0.0.x (ephemeral ports are per source address).
const IDLE_PER_SOURCE: usize = 2000;
const IDLE_CONNECT_THREADS: usize = 4;
/// Time for idle connections to settle (at least one ping round at relay's default 2 s).
const IDLE_SETTLE: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------- clients

/// What a `PipeClient` takes from each answer.
pub(crate) enum Keep {
    Nothing,
    /// The `task_id` of each answer (async submit), for the fetch phase.
    Ids(Vec<String>),
    /// Per request (by index into `reqs`), the first answer's verdict: 0 not answered yet,
    /// 1 `"status":"done"`, 2 anything else (the fetch phase's check).
    Done(Vec<u8>),
}

/// An HTTP/1.1 keep-alive client that keeps up to `depth` requests in flight on its connection
/// (pipelining; relay and the floor answer in request order). Each call takes one answer: when no
/// complete answer is buffered it first tops the connection up to `depth` requests with one
/// write, then reads. `depth` 1 is the closed loop: write one request, read its answer.
/// Requests cycle through `reqs`; with a `budget` (shared by clients) it sends only that many in
/// all. Any status but `expect` is an error, and drops the connection with what was in flight.
pub(crate) struct PipeClient {
    addr: SocketAddr,
    depth: usize,
    reqs: Arc<Vec<Vec<u8>>>,
    expect: u16,
    keep: Keep,
    budget: Option<Arc<AtomicU64>>,
    conn: Option<HttpConn>,
    /// Requests written so far (the next one is `reqs[sent % reqs.len()]`).
    sent: u64,
    /// Index and write time of every request in flight, oldest first.
    in_flight: VecDeque<(u64, Instant)>,
    batch: Vec<u8>,
    /// Set by `finish`: read what is in flight, send nothing more.
    draining: bool,
    /// Requests in flight on a connection that failed: whether the server took them is unknown.
    lost: u64,
    last_latency: Option<Duration>,
}

impl PipeClient {
    pub(crate) fn new(addr: SocketAddr, depth: usize, reqs: Arc<Vec<Vec<u8>>>, expect: u16, keep: Keep) -> PipeClient {
        PipeClient {
            addr,
            depth: depth.max(1),
            reqs,
            expect,
            keep,
            budget: None,
            conn: None,
            sent: 0,
            in_flight: VecDeque::new(),
            batch: Vec::new(),
            draining: false,
            lost: 0,
            last_latency: None,
        }
    }

    pub(crate) fn with_budget(mut self, budget: Arc<AtomicU64>) -> PipeClient {
        self.budget = Some(budget);
        self
    }

    /// Writes requests until `depth` are in flight (fewer if the budget runs out), in one write.
    fn top_up(&mut self) -> Result<(), String> {
        let want = if self.draining { 0 } else { self.depth - self.in_flight.len().min(self.depth) };
        let n = match &self.budget {
            None => want as u64,
            Some(b) => {
                let mut took = 0;
                let _ = b.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| {
                    took = left.min(want as u64);
                    Some(left - took)
                });
                took
            }
        };
        if n == 0 {
            return Ok(());
        }
        let conn = self.conn.as_mut().ok_or("not connected")?;
        self.batch.clear();
        let now = Instant::now();
        for _ in 0..n {
            self.batch.extend_from_slice(&self.reqs[(self.sent % self.reqs.len() as u64) as usize]);
            self.in_flight.push_back((self.sent, now));
            self.sent += 1;
        }
        conn.send(&self.batch)
    }

    fn step(&mut self) -> Result<(), String> {
        if self.conn.is_none() {
            self.conn = Some(HttpConn::connect(self.addr, IO_TIMEOUT)?);
        }
        if !self.conn.as_ref().is_some_and(HttpConn::has_response) {
            self.top_up()?;
        }
        if self.in_flight.is_empty() {
            return Err("nothing in flight".into());
        }
        let conn = self.conn.as_mut().expect("connected above");
        let resp = conn.read_response()?;
        let (i, sent_at) = self.in_flight.pop_front().expect("checked above");
        self.last_latency = Some(sent_at.elapsed());
        if resp.status != self.expect {
            return Err(format!("status {}: {}", resp.status, String::from_utf8_lossy(resp.body)));
        }
        match &mut self.keep {
            Keep::Nothing => {}
            Keep::Ids(ids) => ids.push(json_str_field(resp.body, "task_id").ok_or("202 without task_id")?.to_string()),
            Keep::Done(verdicts) => {
                let v = &mut verdicts[(i % self.reqs.len() as u64) as usize];
                if *v == 0 {
                    *v = if json_str_field(resp.body, "status") == Some("done") { 1 } else { 2 };
                }
            }
        }
        Ok(())
    }
}

impl Client for PipeClient {
    fn call(&mut self) -> Result<(), String> {
        let result = self.step();
        if result.is_err() {
            self.lost += self.in_flight.len() as u64;
            self.in_flight.clear();
            self.conn = None;
        }
        result
    }

    fn latency(&self) -> Option<Duration> {
        self.last_latency
    }

    fn finished(&self) -> bool {
        self.in_flight.is_empty() && self.budget.as_ref().is_some_and(|b| b.load(Ordering::Relaxed) == 0)
    }

    /// Reads the answers still in flight (an async submit's task ids), bounded by the I/O timeout.
    fn finish(&mut self) {
        self.draining = true;
        while !self.in_flight.is_empty() && self.call().is_ok() {}
    }
}

/// A NATS requester: its own connection and inbox, one request in flight.
struct NatsRequester {
    conn: NatsConn,
    inbox: String,
    payload: Arc<Vec<u8>>,
}

const INBOX_SID: u64 = 2;

impl NatsRequester {
    fn connect(addr: SocketAddr, i: usize, payload: Arc<Vec<u8>>) -> Result<NatsRequester, String> {
        let mut conn = NatsConn::connect(addr, &format!("requester-{i}"), IO_TIMEOUT)?;
        let inbox = format!("_INBOX.bench.{i}");
        conn.sub(&inbox, None, INBOX_SID)?;
        conn.sync()?;
        Ok(NatsRequester { conn, inbox, payload })
    }
}

impl Client for NatsRequester {
    fn call(&mut self) -> Result<(), String> {
        self.conn.publish(NATS_SUBJECT, Some(&self.inbox), &self.payload)?;
        loop {
            match self.conn.read_op()? {
                Op::Msg { sid: INBOX_SID, payload_len, .. } => {
                    self.conn.consume(payload_len);
                    return Ok(());
                }
                Op::Msg { payload_len, .. } => self.conn.consume(payload_len),
                Op::Ping => self.conn.pong()?,
                Op::Err(e) => return Err(format!("-ERR {e}")),
                Op::Pong | Op::Ok | Op::Info => {}
            }
        }
    }
}

// ---------------------------------------------------------------- servers

/// A JSON object of exactly `bytes` bytes: `{"d":"xxx..."}`.
pub(crate) fn payload(bytes: usize) -> String {
    let pad = bytes.saturating_sub(8).max(1);
    format!("{{\"d\":\"{}\"}}", "x".repeat(pad))
}

pub(crate) fn scratch_dir() -> PathBuf {
    std::env::temp_dir().join(format!("relay-bench-{}", std::process::id()))
}

pub(crate) fn start_relay(opts: &Opts, binary: &Path, extra_env: &[(&str, String)]) -> Result<Server, String> {
    if !binary.exists() {
        return Err(format!("relay binary {} not found (build it: cargo build --release -p relay)", binary.display()));
    }
    let dir = scratch_dir();
    let mut cmd = Command::new(binary);
    cmd.env_clear()
        .env("PORT", "0")
        .env("BIND", "127.0.0.1")
        .env("API_TOKEN", API_TOKEN)
        .env("WORKER_TOKEN", WORKER_TOKEN)
        .env("DATA_DIR", "")
        .env("LOG_LEVEL", "warn")
        .env("SHUTDOWN_TIMEOUT", "1s")
        .env("BLOB_DIR", dir.join("blobs"))
        .env("TOKEN_STORE", dir.join("tokens.json"));
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    for (k, v) in &opts.relay_env {
        cmd.env(k, v);
    }
    Server::start("relay", cmd, procs::relay_listening, START_TIMEOUT)
}

fn start_nats(opts: &Opts) -> Result<Server, String> {
    let mut cmd = Command::new(&opts.nats_server);
    cmd.args(["-a", "127.0.0.1", "-p", "-1"]);
    Server::start("nats-server", cmd, procs::nats_listening, START_TIMEOUT)
        .map_err(|e| format!("{e}\n(install it with: apt-get install -y nats-server)"))
}

fn start_floor(opts: &Opts) -> Result<Server, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.args(["serve-floor", "--seconds", &opts.max_total.as_secs().to_string()]);
    Server::start("floor", cmd, procs::relay_listening, START_TIMEOUT)
}

/// Polls relay's /healthz until `n` workers are active.
pub(crate) fn wait_workers(addr: SocketAddr, n: usize) -> Result<(), String> {
    let req = build_request("GET", "/healthz", None, b"");
    let mut conn = HttpConn::connect(addr, IO_TIMEOUT)?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let resp = conn.request(&req)?;
        let active = json_num_field(resp.body, "active_clients");
        if active == Some(n as u64) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{active:?} of {n} workers active after {START_TIMEOUT:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub(crate) fn healthz(addr: SocketAddr) -> Result<String, String> {
    let mut conn = HttpConn::connect(addr, IO_TIMEOUT)?;
    let resp = conn.request(&build_request("GET", "/healthz", None, b""))?;
    Ok(String::from_utf8_lossy(resp.body).into_owned())
}

/// The number in `"key":123` of a JSON text.
pub(crate) fn json_num_field(text: &[u8], key: &str) -> Option<u64> {
    let pat = format!("\"{key}\":");
    let at = text.windows(pat.len()).position(|w| w == pat.as_bytes())? + pat.len();
    let digits: String = text[at..].iter().take_while(|b| b.is_ascii_digit()).map(|&b| b as char).collect();
    digits.parse().ok()
}

/// Fails the scenario when the server died under it, with its last log lines.
pub(crate) fn check_alive(server: &mut Server) -> Result<(), String> {
    if server.alive() {
        Ok(())
    } else {
        Err(format!("{} exited during the run; stderr:\n{}", server.name, server.log_tail()))
    }
}

// ---------------------------------------------------------------- scenarios

pub(crate) fn window(opts: &Opts) -> Window {
    Window { warmup: opts.warmup, measure: opts.measure, syscalls: opts.syscalls }
}

pub(crate) fn relay_sync(opts: &Opts, clients: usize, workers: usize) -> Result<Outcome, String> {
    let mut relay = start_relay(opts, &opts.relay, &[])?;
    let pool = Pool::ws(relay.addr, WORKER_TOKEN, workers, WORKER_CONCURRENCY, RESULT_DATA)?;
    wait_workers(relay.addr, workers)?;
    let body = format!("{{\"payload\":{}}}", payload(opts.payload_bytes));
    let req = Arc::new(vec![build_request("POST", "/tasks?wait=true", Some(API_TOKEN), body.as_bytes())]);
    let cs: Vec<_> = (0..clients).map(|_| PipeClient::new(relay.addr, 1, req.clone(), 200, Keep::Nothing)).collect();
    let (out, _) = load::run(cs, relay.pid(), window(opts), std::slice::from_ref(&pool.answered));
    check_alive(&mut relay)?;
    pool.stop()?;
    Ok(out)
}

/// TASK_MEMORY that holds every finished task of a run (16 GiB).
pub(crate) const TASK_MEMORY_ALL: u64 = 16 << 30;
/// How long the workers may take to finish what an async window submitted.
pub(crate) const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the check of the ids the fetch window did not reach may take.
const VERIFY_TIMEOUT: Duration = Duration::from_secs(120);

struct AsyncResult {
    submit: Outcome,
    fetch: Outcome,
    note: String,
    /// Why not every submitted task was seen `done`, if so.
    problem: Option<String>,
}

/// Async submit (`POST /tasks`, 202) with `depth` requests in flight per connection (1 = closed
/// loop), the workers answering inside the window; then the workers drain what is left; then
/// `GET /tasks/{id}` over every submitted id with the same depth (the fetch row), and an untimed
/// pass over the ids the fetch window did not reach: every submitted task must be `done`.
fn relay_async(opts: &Opts, depth: usize) -> Result<AsyncResult, String> {
    // Every finished task must stay readable for the fetch phase: memory-only relay forgets
    // finished tasks beyond TASK_MEMORY (64 MiB by default, ~100,000 tasks) early.
    let mut relay = start_relay(opts, &opts.relay, &[("TASK_MEMORY", TASK_MEMORY_ALL.to_string())])?;
    let pool = Pool::ws(relay.addr, WORKER_TOKEN, opts.workers, WORKER_CONCURRENCY, RESULT_DATA)?;
    wait_workers(relay.addr, opts.workers)?;
    let body = format!("{{\"payload\":{}}}", payload(opts.payload_bytes));
    let req = Arc::new(vec![build_request("POST", "/tasks", Some(API_TOKEN), body.as_bytes())]);
    let cs: Vec<_> = (0..opts.clients)
        .map(|_| PipeClient::new(relay.addr, depth, req.clone(), 202, Keep::Ids(Vec::new())))
        .collect();
    let (submit, cs) = load::run(cs, relay.pid(), window(opts), std::slice::from_ref(&pool.answered));
    let lost: u64 = cs.iter().map(|c| c.lost).sum();
    let ids: Vec<String> = cs
        .into_iter()
        .flat_map(|c| match c.keep {
            Keep::Ids(ids) => ids,
            _ => Vec::new(),
        })
        .collect();

    // Let the workers drain what was submitted: nothing pending or dispatched, bounded.
    let t = Instant::now();
    let drained = loop {
        let h = healthz(relay.addr)?;
        let open = |k| json_num_field(h.as_bytes(), k);
        if open("pending") == Some(0) && open("dispatched") == Some(0) {
            break true;
        }
        if t.elapsed() > DRAIN_TIMEOUT {
            break false;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let drain_time = t.elapsed();
    let answered_total = pool.answered.load(Ordering::Relaxed);

    let fetch_clients = |ids: &[String], depth: usize, budget: bool| -> Vec<PipeClient> {
        let per = ids.len().div_ceil(opts.clients).max(1);
        ids.chunks(per)
            .map(|chunk| {
                let reqs: Vec<Vec<u8>> = chunk
                    .iter()
                    .map(|id| build_request("GET", &format!("/tasks/{id}"), Some(API_TOKEN), b""))
                    .collect();
                let c = PipeClient::new(relay.addr, depth, Arc::new(reqs), 200, Keep::Done(vec![0; chunk.len()]));
                if budget { c.with_budget(Arc::new(AtomicU64::new(chunk.len() as u64))) } else { c }
            })
            .collect()
    };
    // Per id, the verdict of its first fetch (0: not fetched).
    let verdicts = |clients: Vec<PipeClient>| -> Vec<u8> {
        clients
            .into_iter()
            .flat_map(|c| match c.keep {
                Keep::Done(v) => v,
                _ => Vec::new(),
            })
            .collect()
    };
    let (fetch, fetchers) = load::run(fetch_clients(&ids, depth, false), relay.pid(), window(opts), &[]);
    let mut seen = verdicts(fetchers);
    let in_window = seen.iter().filter(|&&v| v != 0).count();
    // The ids the window did not reach: fetched once each, untimed.
    let rest: Vec<usize> = (0..ids.len()).filter(|&i| seen[i] == 0).collect();
    if !rest.is_empty() {
        let rest_ids: Vec<String> = rest.iter().map(|&i| ids[i].clone()).collect();
        let win = Window { warmup: Duration::ZERO, measure: VERIFY_TIMEOUT, syscalls: None };
        let (_, checkers) = load::run(fetch_clients(&rest_ids, opts.pipeline_depth, true), relay.pid(), win, &[]);
        for (i, v) in rest.into_iter().zip(verdicts(checkers)) {
            seen[i] = v;
        }
    }
    let done = seen.iter().filter(|&&v| v == 1).count();
    let unfetched = seen.iter().filter(|&&v| v == 0).count();
    let health = healthz(relay.addr).unwrap_or_else(|e| format!("healthz failed: {e}"));
    let relay_done = json_num_field(health.as_bytes(), "done");
    check_alive(&mut relay)?;
    pool.stop()?;
    let note = format!(
        "{depth} in flight per connection: submitted {} (window: {} submits, {} worker answers){}; \
         drained in {:.1} s; answered in all {answered_total}; fetched {in_window} in the fetch window \
         and {} after it: {done}/{} done; healthz: {health}",
        ids.len(),
        submit.completed,
        submit.counters.first().copied().unwrap_or(0),
        if lost > 0 { format!(", {lost} more in flight on failed connections") } else { String::new() },
        drain_time.as_secs_f64(),
        ids.len() - in_window - unfetched,
        ids.len(),
    );
    let problem = if !drained {
        Some(format!("workers did not drain in {DRAIN_TIMEOUT:?}"))
    } else if done != ids.len() || ids.is_empty() {
        Some(format!("{done} of {} submitted tasks done ({unfetched} not fetched)", ids.len()))
    } else if !relay_done.is_some_and(|d| (ids.len() as u64..=ids.len() as u64 + lost).contains(&d)) {
        Some(format!("relay counts {relay_done:?} done tasks, the clients submitted {} (+{lost} unknown)", ids.len()))
    } else {
        None
    };
    Ok(AsyncResult { submit, fetch, note, problem })
}

fn nats_reqrep(opts: &Opts, clients: usize, workers: usize) -> Result<Outcome, String> {
    let mut nats = start_nats(opts)?;
    let pool = Pool::nats(nats.addr, workers, RESULT_DATA.as_bytes())?;
    let payload = Arc::new(payload(opts.payload_bytes).into_bytes());
    let cs =
        (0..clients).map(|i| NatsRequester::connect(nats.addr, i, payload.clone())).collect::<Result<Vec<_>, _>>()?;
    let (out, _) = load::run(cs, nats.pid(), window(opts), std::slice::from_ref(&pool.answered));
    check_alive(&mut nats)?;
    pool.stop()?;
    Ok(out)
}

fn floor(opts: &Opts) -> Result<Outcome, String> {
    let mut floor = start_floor(opts)?;
    let body = format!("{{\"payload\":{}}}", payload(opts.payload_bytes));
    let req = Arc::new(vec![build_request("POST", "/echo", Some(API_TOKEN), body.as_bytes())]);
    let cs: Vec<_> =
        (0..opts.clients).map(|_| PipeClient::new(floor.addr, 1, req.clone(), 200, Keep::Nothing)).collect();
    let (out, _) = load::run(cs, floor.pid(), window(opts), &[]);
    check_alive(&mut floor)?;
    Ok(out)
}

struct MemoryResult {
    connected: usize,
    base_rss_kib: u64,
    rss_kib: u64,
    hwm_kib: u64,
    connect_time: Duration,
    still_open: usize,
}

impl MemoryResult {
    fn bytes_per_conn(&self) -> f64 {
        (self.rss_kib.saturating_sub(self.base_rss_kib) * 1024) as f64 / self.connected.max(1) as f64
    }
}

fn memory(opts: &Opts) -> Result<MemoryResult, String> {
    let n = opts.idle_conns;
    let nofile = procs::raise_nofile();
    if (nofile as usize) < n + 100 {
        return Err(format!("open-file limit {nofile} is too low for {n} connections"));
    }
    let max_conns = (n + 500).to_string();
    let mut relay = start_relay(opts, &opts.relay, &[("MAX_CONNECTIONS", max_conns)])?;
    std::thread::sleep(Duration::from_millis(300));
    let base = procs::mem(relay.pid())?;
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(120).min(opts.max_total);
    let idle = Idle::open(relay.addr, WORKER_TOKEN, n, IDLE_PER_SOURCE, IDLE_CONNECT_THREADS, deadline)?;
    let connect_time = t0.elapsed();
    std::thread::sleep(IDLE_SETTLE);
    wait_workers(relay.addr, n)?;
    check_alive(&mut relay)?;
    let after = procs::mem(relay.pid())?;
    let connected = idle.connected;
    let still_open = idle.close();
    Ok(MemoryResult {
        connected,
        base_rss_kib: base.rss_kib,
        rss_kib: after.rss_kib,
        hwm_kib: after.hwm_kib,
        connect_time,
        still_open,
    })
}

struct PendingResult {
    tasks: u64,
    base_rss_kib: u64,
    rss_kib: u64,
    submit: Outcome,
}

impl PendingResult {
    fn bytes_per_task(&self) -> f64 {
        (self.rss_kib.saturating_sub(self.base_rss_kib) * 1024) as f64 / self.tasks.max(1) as f64
    }
}

/// Scheduled tasks (`"delay":"1h"`, no worker connected): `--pending-tasks` of them submitted
/// (pipelined) or as many as `--pending-max-secs` allows; relay's RSS per task held.
/// `MAX_PENDING` is raised above the count so that no submit is refused.
fn pending(opts: &Opts) -> Result<PendingResult, String> {
    let max_pending = (opts.pending_tasks.saturating_mul(2)).max(1_000_000).to_string();
    let mut relay = start_relay(opts, &opts.relay, &[("MAX_PENDING", max_pending)])?;
    healthz(relay.addr)?;
    let base = procs::mem(relay.pid())?;
    let body = format!("{{\"payload\":{},\"delay\":\"1h\"}}", payload(opts.payload_bytes));
    let req = Arc::new(vec![build_request("POST", "/tasks", Some(API_TOKEN), body.as_bytes())]);
    let budget = Arc::new(AtomicU64::new(opts.pending_tasks));
    let cs: Vec<_> = (0..opts.clients)
        .map(|_| {
            PipeClient::new(relay.addr, opts.pipeline_depth, req.clone(), 202, Keep::Nothing)
                .with_budget(budget.clone())
        })
        .collect();
    let win = Window { warmup: Duration::ZERO, measure: opts.pending_max, syscalls: None };
    let (submit, _) = load::run(cs, relay.pid(), win, &[]);
    std::thread::sleep(Duration::from_millis(200));
    let health = healthz(relay.addr)?;
    let tasks = json_num_field(health.as_bytes(), "pending").ok_or_else(|| format!("no pending count in {health}"))?;
    let after = procs::mem(relay.pid())?;
    check_alive(&mut relay)?;
    Ok(PendingResult { tasks, base_rss_kib: base.rss_kib, rss_kib: after.rss_kib, submit })
}

struct StartupResult {
    median: Duration,
    max: Duration,
    idle_rss_kib: u64,
}

fn startup(opts: &Opts, binary: &Path) -> Result<StartupResult, String> {
    let runs = opts.startup_runs;
    let mut times = Vec::new();
    let mut idle_rss_kib = 0;
    for _ in 0..runs {
        let mut relay = start_relay(opts, binary, &[])?;
        times.push(relay.startup);
        std::thread::sleep(Duration::from_millis(200));
        // One request so the figure includes a loop that has served something.
        healthz(relay.addr)?;
        std::thread::sleep(Duration::from_millis(50));
        idle_rss_kib = idle_rss_kib.max(procs::mem(relay.pid())?.rss_kib);
        relay.stop();
    }
    times.sort();
    Ok(StartupResult { median: times[times.len() / 2], max: times[times.len() - 1], idle_rss_kib })
}

// ---------------------------------------------------------------- the run

/// Per-round outcomes: the comparisons run in rounds (relay, NATS, floor, relay, ...) so that
/// each ratio can be taken within a round and the spread over rounds shows the noise.
#[derive(Default)]
struct Results {
    sync: Vec<Outcome>,
    nats: Vec<Outcome>,
    floor: Vec<Outcome>,
    /// Async submit + fetch, one request in flight per connection, per round.
    async_closed: Vec<AsyncResult>,
    /// The same with `--pipeline-depth` requests in flight per connection, per round.
    async_pipe: Vec<AsyncResult>,
    sync1: Vec<Outcome>,
    nats1: Vec<Outcome>,
    memory: Option<MemoryResult>,
    startup: Option<StartupResult>,
    startup_static: Option<StartupResult>,
    pending: Option<PendingResult>,
    static_bytes: Option<u64>,
    /// The durability and slowloris scenarios (durable.rs).
    durable: crate::durable::DurableResults,
    failures: Vec<String>,
    /// /proc/loadavg at the start and the end: other work on the machine skews every figure.
    load_before: String,
    load_after: String,
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Kills every child and exits if the whole run overstays `limit` (a hung scenario).
pub fn watchdog(limit: Duration) -> Arc<AtomicBool> {
    let done = Arc::new(AtomicBool::new(false));
    let done2 = done.clone();
    std::thread::spawn(move || {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if done2.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("relay-bench: the run exceeded {limit:?}; killing its children and exiting");
        procs::kill_all_children();
        std::process::exit(3);
    });
    done
}

pub fn run_all(opts: &Opts) -> Result<(), String> {
    let known = ["all", "sync", "async", "nats", "floor", "latency", "memory", "startup", "pending", "cluster", "flow"];
    // (Flow control's own comparison, issue 22: only when asked for by name, not in "all".)
    if opts.scenarios.iter().any(|s| s == "flow") {
        return crate::flow::run(opts);
    }
    if let Some(bad) =
        opts.scenarios.iter().find(|s| !known.contains(&s.as_str()) && !crate::durable::SCENARIOS.contains(&s.as_str()))
    {
        return Err(format!("unknown scenario {bad:?}"));
    }
    let want = |s: &str| opts.scenarios.iter().any(|x| x == s || x == "all");
    let mut opts = opts.clone();
    if opts.syscalls.is_some()
        && let Err(e) = procs::perf_works()
    {
        eprintln!("bench: syscall counts off (perf stat does not work here: {e})");
        opts.syscalls = None;
    }
    let opts = &opts;
    let done = watchdog(opts.max_total);
    let started = Instant::now();
    let mut r = Results { load_before: loadavg(), ..Results::default() };
    let step = |name: &str| eprintln!("bench: [{:>5.1}s] {name}", started.elapsed().as_secs_f64());

    fn keep<T>(failures: &mut Vec<String>, name: &str, res: Result<T, String>) -> Option<T> {
        res.map_err(|e| {
            eprintln!("bench: {name} failed: {e}");
            failures.push(format!("{name}: {e}"));
        })
        .ok()
    }
    let (c, w, n) = (opts.clients, opts.workers, opts.rounds);
    for round in 1..=n {
        if want("sync") {
            step(&format!("round {round}/{n}: relay sync, {c} clients, {w} workers"));
            r.sync.extend(keep(&mut r.failures, "relay sync", relay_sync(opts, c, w)));
        }
        // Right after relay sync: the durable run's ratios to it are taken within the round.
        crate::durable::round(opts, &mut r.durable, round, &want, &step, &mut r.failures);
        if want("nats") {
            step(&format!("round {round}/{n}: NATS request-reply, {c} requesters, {w} responders"));
            r.nats.extend(keep(&mut r.failures, "nats", nats_reqrep(opts, c, w)));
        }
        if want("floor") {
            step(&format!("round {round}/{n}: HTTP floor, {c} clients"));
            r.floor.extend(keep(&mut r.failures, "floor", floor(opts)));
        }
        if want("async") {
            let d = opts.pipeline_depth;
            let modes: &[(usize, &str)] =
                if d > 1 { &[(1, "closed loop"), (d, "pipelined")] } else { &[(1, "closed loop")] };
            for &(depth, kind) in modes {
                step(&format!(
                    "round {round}/{n}: relay async submit + fetch, {kind}, {c} clients × {depth}, {w} workers"
                ));
                if let Some(a) = keep(&mut r.failures, "relay async", relay_async(opts, depth)) {
                    if let Some(p) = &a.problem {
                        eprintln!("bench: relay async ({kind}) check failed: {p}");
                        r.failures.push(format!("relay async ({kind}) check: {p}"));
                    }
                    if depth == 1 { &mut r.async_closed } else { &mut r.async_pipe }.push(a);
                }
            }
        }
    }
    if want("latency") {
        for round in 1..=n {
            step(&format!("round {round}/{n}: relay sync, 1 client 1 worker"));
            r.sync1.extend(keep(&mut r.failures, "relay 1c1w", relay_sync(opts, 1, 1)));
            step(&format!("round {round}/{n}: NATS request-reply, 1 requester 1 responder"));
            r.nats1.extend(keep(&mut r.failures, "nats 1c1w", nats_reqrep(opts, 1, 1)));
        }
    }
    if want("startup") {
        step("relay start-up and idle RSS");
        r.startup = keep(&mut r.failures, "startup", startup(opts, &opts.relay));
        if opts.relay_static.exists() {
            r.static_bytes = std::fs::metadata(&opts.relay_static).ok().map(|m| m.len());
            r.startup_static = keep(&mut r.failures, "startup (static)", startup(opts, &opts.relay_static));
        }
    }
    if want("pending") {
        step(&format!(
            "relay holding scheduled tasks (delay 1h): {} submitted by {c} clients × {}, at most {} s",
            opts.pending_tasks,
            opts.pipeline_depth,
            opts.pending_max.as_secs()
        ));
        r.pending = keep(&mut r.failures, "pending", pending(opts));
    }
    crate::durable::once(opts, &mut r.durable, &want, &step, &mut r.failures);
    if want("memory") && opts.idle_conns > 0 {
        step(&format!("relay with {} idle worker connections", opts.idle_conns));
        r.memory = keep(&mut r.failures, "memory", memory(opts));
    }
    // Cluster mode (issue 11, `cluster.rs`): its own rounds and its own table.
    let mut cluster_rounds = Vec::new();
    if want("cluster") {
        match crate::cluster::available() {
            Ok(()) => {
                for round in 1..=n {
                    step(&format!("round {round}/{n}: cluster"));
                    cluster_rounds.push(crate::cluster::round(opts, &step, &mut r.failures));
                }
            }
            Err(e) => eprintln!("bench: *** cluster scenario SKIPPED: {e} ***"),
        }
    }
    step("done");
    r.load_after = loadavg();
    r.durable.cleanup();
    done.store(true, Ordering::Relaxed);
    let _ = std::fs::remove_dir_all(scratch_dir());
    print!("{}", report(opts, &r));
    if !cluster_rounds.is_empty() {
        print!("{}", crate::cluster::report(&cluster_rounds, opts));
    }
    if r.failures.is_empty() { Ok(()) } else { Err(format!("{} scenario(s) failed", r.failures.len())) }
}

/// Load an already running relay (e.g. one under `perf record`) for `--seconds`.
pub fn drive(opts: &Opts) -> Result<(), String> {
    let addr: SocketAddr =
        opts.addr.as_deref().ok_or("drive needs --addr")?.parse().map_err(|e| format!("--addr: {e}"))?;
    if !addr.ip().is_loopback() {
        return Err("only loopback targets are allowed".into());
    }
    let pool = Pool::ws(addr, WORKER_TOKEN, opts.workers, WORKER_CONCURRENCY, RESULT_DATA)?;
    wait_workers(addr, opts.workers)?;
    let body = format!("{{\"payload\":{}}}", payload(opts.payload_bytes));
    let req = Arc::new(vec![build_request("POST", "/tasks?wait=true", Some(API_TOKEN), body.as_bytes())]);
    let cs: Vec<_> = (0..opts.clients).map(|_| PipeClient::new(addr, 1, req.clone(), 200, Keep::Nothing)).collect();
    let win = Window { warmup: Duration::ZERO, measure: Duration::from_secs(opts.seconds), syscalls: None };
    let (out, _) = load::run(cs, 0, win, &[]);
    pool.stop()?;
    println!(
        "drive: {} tasks in {:.1}s = {:.0}/s, p50 {} ms, p99 {} ms, errors {}",
        out.completed,
        out.elapsed.as_secs_f64(),
        out.per_sec(),
        ms(out.latency.p50),
        ms(out.latency.p99),
        out.errors
    );
    Ok(())
}

// ---------------------------------------------------------------- the report

pub(crate) fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

pub(crate) fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

pub(crate) fn median(mut xs: Vec<f64>) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(f64::total_cmp);
    let m = xs.len() / 2;
    Some(if xs.len() % 2 == 1 { xs[m] } else { (xs[m - 1] + xs[m]) / 2.0 })
}

/// A figure's median over rounds and, with more than one round, its range.
pub(crate) struct Spread {
    pub(crate) median: f64,
    min: f64,
    max: f64,
    n: usize,
}

impl Spread {
    fn of(xs: Vec<f64>) -> Option<Spread> {
        let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
        let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let n = xs.len();
        median(xs).map(|median| Spread { median, min, max, n })
    }
    pub(crate) fn show(&self, digits: usize) -> String {
        if self.n > 1 {
            format!("{:.d$} ({:.d$}–{:.d$})", self.median, self.min, self.max, d = digits)
        } else {
            format!("{:.d$}", self.median, d = digits)
        }
    }
}

/// `f(a) / f(b)` within each round (the pairs ran back to back).
pub(crate) fn paired<'a>(
    a: impl IntoIterator<Item = &'a Outcome>,
    b: impl IntoIterator<Item = &'a Outcome>,
    f: impl Fn(&Outcome) -> f64,
) -> Option<Spread> {
    Spread::of(a.into_iter().zip(b).map(|(x, y)| f(x) / f(y).max(1e-12)).collect())
}

pub(crate) fn of<'a>(a: impl IntoIterator<Item = &'a Outcome>, f: impl Fn(&Outcome) -> f64) -> Option<Spread> {
    Spread::of(a.into_iter().map(f).collect())
}

fn submits(a: &[AsyncResult]) -> impl Iterator<Item = &Outcome> {
    a.iter().map(|x| &x.submit)
}

fn fetches(a: &[AsyncResult]) -> impl Iterator<Item = &Outcome> {
    a.iter().map(|x| &x.fetch)
}

pub(crate) fn cpu_us(o: &Outcome) -> f64 {
    o.cpu_us_per_op()
}
fn p50(o: &Outcome) -> f64 {
    o.latency.p50.as_secs_f64() * 1e3
}
pub(crate) fn p99(o: &Outcome) -> f64 {
    o.latency.p99.as_secs_f64() * 1e3
}
pub(crate) fn rate(o: &Outcome) -> f64 {
    o.per_sec()
}

pub(crate) fn row(t: &mut String, label: &str, c: &str, w: &str, o: &Outcome) {
    let _ = writeln!(
        t,
        "| {label} | {c} | {w} | {:.0} | **{:.1}** | {:.0}% | {:.1} | {:.0}% / {:.0}% | {} | {} | {} | {} | {:.1} | {} |",
        o.per_sec(),
        o.cpu_us_per_op(),
        o.cpu_share() * 100.0,
        o.bench_cpu_us_per_op(),
        o.others_cpu.as_secs_f64() * 100.0 / o.elapsed.as_secs_f64().max(1e-9),
        o.steal.as_secs_f64() * 100.0 / o.elapsed.as_secs_f64().max(1e-9),
        ms(o.latency.p50),
        ms(o.latency.p99),
        ms(o.latency.p999),
        ms(o.latency.max),
        mib(o.peak_rss_kib),
        o.errors
    );
}

pub(crate) fn rows<'a>(t: &mut String, label: &str, c: &str, w: &str, os: impl IntoIterator<Item = &'a Outcome>) {
    let os: Vec<&Outcome> = os.into_iter().collect();
    for (i, o) in os.iter().enumerate() {
        let label = if os.len() > 1 { format!("{label} #{}", i + 1) } else { label.to_string() };
        row(t, &label, c, w, o);
    }
}

pub(crate) fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "**not met**" }
}

fn report(opts: &Opts, r: &Results) -> String {
    let mut t = String::new();
    let (c, w) = (opts.clients, opts.workers.to_string());
    let (cs, d) = (c.to_string(), opts.pipeline_depth);
    let cd = format!("{c} × {d}");
    let _ = writeln!(
        t,
        "\n## relay-bench results\n\n{} round(s); per scenario {} ms warm-up + {} ms measured; payload {} bytes; \
         server CPU = utime+stime of the server process (all threads) over the measured window, from /proc/<pid>/stat. \
         Ratios are taken within a round and given as median (min–max over rounds). \
         \"others / steal\": CPU used by every other process on the machine, and hypervisor steal, \
         over the window, in % of one core: a row where they are high is not comparable. \
         Load average before / after the run: {} / {} on {} CPUs.\n",
        opts.rounds,
        opts.warmup.as_millis(),
        opts.measure.as_millis(),
        opts.payload_bytes,
        r.load_before,
        r.load_after,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let _ = writeln!(
        t,
        "| scenario | clients | workers | ops/s | server CPU µs/op | server CPU | bench CPU µs/op | others / steal | p50 ms | p99 ms | p99.9 ms | max ms | peak RSS MiB | errors |"
    );
    let _ = writeln!(t, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    rows(&mut t, "relay sync `POST /tasks?wait=true`", &cs, &w, &r.sync);
    rows(&mut t, "NATS request-reply", &cs, &w, &r.nats);
    rows(&mut t, "HTTP floor (one hop, answers at once)", &cs, "-", &r.floor);
    crate::durable::table_rows(&mut t, opts, &r.durable);
    rows(&mut t, "relay async submit `POST /tasks` (202), closed loop", &cs, &w, submits(&r.async_closed));
    rows(&mut t, &format!("relay async submit (202), pipelined {d} deep"), &cd, &w, submits(&r.async_pipe));
    rows(&mut t, "relay async fetch `GET /tasks/{id}`, closed loop", &cs, &w, fetches(&r.async_closed));
    rows(&mut t, &format!("relay async fetch, pipelined {d} deep"), &cd, &w, fetches(&r.async_pipe));
    if let Some(p) = &r.pending {
        row(&mut t, &format!("relay scheduled submit (`delay`, no worker), pipelined {d} deep"), &cd, "0", &p.submit);
    }
    rows(&mut t, "relay sync, 1 client 1 worker", "1", "1", &r.sync1);
    rows(&mut t, "NATS request-reply, 1 client 1 responder", "1", "1", &r.nats1);
    if !r.async_closed.is_empty() || !r.async_pipe.is_empty() {
        let _ = writeln!(
            t,
            "\nasync: \"{c} × {d}\" = {c} connections, each with up to {d} requests in flight (HTTP/1.1 \
             pipelining); latency there runs from the write of a request to its answer, queueing behind the \
             others included."
        );
    }
    for a in r.async_closed.iter().chain(&r.async_pipe) {
        let _ = writeln!(t, "\n- async, {}", a.note);
    }
    if let Some(span) = opts.syscalls {
        syscall_table(&mut t, span, r);
    }

    let _ = writeln!(t, "\n| memory and start-up | value |\n|---|---:|");
    if let Some(s) = &r.startup {
        let _ = writeln!(
            t,
            "| relay start-up to listening (median / max of {}) | {} / {} ms |",
            opts.startup_runs,
            ms(s.median),
            ms(s.max)
        );
        let _ = writeln!(t, "| relay idle RSS | {:.2} MiB |", mib(s.idle_rss_kib));
    }
    if let Some(s) = &r.startup_static {
        let _ =
            writeln!(t, "| static relay start-up to listening (median / max) | {} / {} ms |", ms(s.median), ms(s.max));
        let _ = writeln!(t, "| static relay idle RSS | {:.2} MiB |", mib(s.idle_rss_kib));
    }
    match r.static_bytes {
        Some(b) => {
            let _ = writeln!(t, "| static binary, stripped | {:.2} MiB ({b} bytes) |", b as f64 / 1048576.0);
        }
        None => {
            let _ = writeln!(t, "| static binary | not built (bench/run.sh builds it) |");
        }
    }
    if let Some(m) = &r.memory {
        let _ = writeln!(
            t,
            "| idle worker connections | {} connected in {:.1} s, {} still open at the end |",
            m.connected,
            m.connect_time.as_secs_f64(),
            m.still_open
        );
        let _ = writeln!(
            t,
            "| relay RSS before / with them (peak) | {:.1} / {:.1} MiB ({:.1}) |",
            mib(m.base_rss_kib),
            mib(m.rss_kib),
            mib(m.hwm_kib)
        );
        let _ = writeln!(t, "| relay RSS per idle worker connection | {:.2} KiB |", m.bytes_per_conn() / 1024.0);
    }
    if let Some(p) = &r.pending {
        let _ = writeln!(
            t,
            "| scheduled tasks held / relay RSS before → after | {} / {:.1} → {:.1} MiB |",
            p.tasks,
            mib(p.base_rss_kib),
            mib(p.rss_kib)
        );
        let _ = writeln!(
            t,
            "| relay RSS per scheduled task ({}-byte payload) / beyond the payload | {:.0} / {:.0} bytes |",
            opts.payload_bytes,
            p.bytes_per_task(),
            p.bytes_per_task() - opts.payload_bytes as f64
        );
    }

    crate::durable::figures(&mut t, opts, &r.durable);

    let _ = writeln!(t, "\n| target | goal | measured | |\n|---|---|---|---|");
    if let (Some(ratio), Some(s), Some(n)) =
        (paired(&r.sync, &r.nats, cpu_us), of(&r.sync, cpu_us), of(&r.nats, cpu_us))
    {
        let _ = writeln!(
            t,
            "| relay CPU per sync task ÷ NATS CPU per request-reply | ≤ 0.55 | {} (relay {} µs, NATS {} µs) | {} |",
            ratio.show(2),
            s.show(1),
            n.show(1),
            verdict(ratio.median <= 0.55)
        );
    }
    if let Some(s) = of(&r.sync, cpu_us) {
        let _ = writeln!(t, "| relay CPU per sync task | ≤ 12 µs | {} µs | {} |", s.show(1), verdict(s.median <= 12.0));
    }
    if let (Some(ratio), Some(s), Some(n)) = (paired(&r.sync, &r.nats, p99), of(&r.sync, p99), of(&r.nats, p99)) {
        let _ = writeln!(
            t,
            "| p99 at {c} clients, relay ÷ NATS | ≤ 0.5 | {} (relay {} ms, NATS {} ms) | {} |",
            ratio.show(2),
            s.show(3),
            n.show(3),
            verdict(ratio.median <= 0.5)
        );
    }
    if let (Some(ratio), Some(s), Some(n)) = (paired(&r.sync1, &r.nats1, p50), of(&r.sync1, p50), of(&r.nats1, p50)) {
        let _ = writeln!(
            t,
            "| p50 1 client 1 worker, relay ÷ NATS | ≤ 1.0 | {} (relay {} ms, NATS {} ms) | {} |",
            ratio.show(2),
            s.show(3),
            n.show(3),
            verdict(ratio.median <= 1.0)
        );
    }
    if let Some(m) = &r.memory {
        let kib = m.bytes_per_conn() / 1024.0;
        let _ = writeln!(
            t,
            "| RSS per idle worker connection at {} | ≤ 8 KiB | {kib:.2} KiB | {} |",
            m.connected,
            verdict(kib <= 8.0)
        );
    }
    if let Some(s) = &r.startup {
        let idle = mib(s.idle_rss_kib);
        let _ = writeln!(t, "| idle RSS | ≤ 4 MiB | {idle:.2} MiB | {} |", verdict(idle <= 4.0));
        let _ = writeln!(
            t,
            "| start-up to listening (median) | ≤ 20 ms | {} ms | {} |",
            ms(s.median),
            verdict(s.median <= Duration::from_millis(20))
        );
    }
    if let Some(b) = r.static_bytes {
        let size = b as f64 / 1048576.0;
        let _ = writeln!(t, "| static binary, stripped | ≤ 4 MiB | {size:.2} MiB | {} |", verdict(size <= 4.0));
    }
    if let (Some(s), Some(closed)) = (of(&r.sync, rate), paired(submits(&r.async_closed), &r.sync, rate)) {
        let closed_rate = of(submits(&r.async_closed), rate).map_or(0.0, |x| x.median);
        let pipe = paired(submits(&r.async_pipe), &r.sync, rate);
        let pipe_rate = of(submits(&r.async_pipe), rate).map_or(0.0, |x| x.median);
        let (pipe_text, ok) = match &pipe {
            Some(p) => (
                format!(
                    "**pipelined** ({c} × {d} in flight): {} ({pipe_rate:.0} / {:.0} per s); ",
                    p.show(2),
                    s.median
                ),
                p.median >= 2.0,
            ),
            None => (String::new(), closed.median >= 2.0),
        };
        let _ = writeln!(
            t,
            "| async submit throughput ÷ sync | ≥ 2 | {pipe_text}closed loop ({c} × 1): {} ({closed_rate:.0} / {:.0} per s) | {}{} |",
            closed.show(2),
            s.median,
            verdict(ok),
            if pipe.is_some() { " (pipelined)" } else { "" }
        );
    }
    crate::durable::targets(&mut t, opts, &r.sync, &r.durable);
    let _ = writeln!(t, "\n| other ratios (no target) | value |\n|---|---:|");
    if let Some(x) = paired(&r.sync, &r.floor, cpu_us) {
        let _ = writeln!(t, "| relay CPU per sync task ÷ floor CPU per request | {} |", x.show(2));
    }
    if let Some(x) = paired(&r.nats, &r.floor, cpu_us) {
        let _ = writeln!(t, "| NATS CPU per request-reply ÷ floor CPU per request | {} |", x.show(2));
    }
    if let Some(x) = paired(&r.sync, &r.nats, rate) {
        let _ = writeln!(t, "| relay sync throughput ÷ NATS throughput | {} |", x.show(2));
    }
    if let Some(x) = paired(submits(&r.async_closed), &r.sync, cpu_us) {
        let _ = writeln!(t, "| relay CPU per async submit, closed loop ÷ per sync task | {} |", x.show(2));
    }
    if let Some(x) = paired(submits(&r.async_pipe), &r.sync, cpu_us) {
        let _ = writeln!(t, "| relay CPU per async submit, pipelined {d} deep ÷ per sync task | {} |", x.show(2));
    }
    if let Some(x) = paired(&r.sync1, &r.nats1, cpu_us) {
        let _ = writeln!(t, "| relay CPU per task ÷ NATS, 1 client 1 worker | {} |", x.show(2));
    }
    crate::durable::ratios(&mut t, &r.sync, &r.durable);
    for f in &r.failures {
        let _ = writeln!(t, "\nFAILED: {f}");
    }
    let groups: [(&str, Vec<&Outcome>); 9] = [
        ("relay sync", r.sync.iter().collect()),
        ("nats", r.nats.iter().collect()),
        ("floor", r.floor.iter().collect()),
        ("relay async submit, closed loop", submits(&r.async_closed).collect()),
        ("relay async submit, pipelined", submits(&r.async_pipe).collect()),
        ("relay async fetch", fetches(&r.async_closed).chain(fetches(&r.async_pipe)).collect()),
        ("relay scheduled submit", r.pending.iter().map(|p| &p.submit).collect()),
        ("relay 1c1w", r.sync1.iter().collect()),
        ("nats 1c1w", r.nats1.iter().collect()),
    ];
    for (name, os) in groups.into_iter().chain(crate::durable::syscall_groups(&r.durable)) {
        if let Some(e) = os.iter().find_map(|o| o.first_error.as_ref()) {
            let _ = writeln!(t, "\n{name}: first client error: {e}");
        }
    }
    t
}

/// Syscalls and context switches per operation, medians over rounds.
fn syscall_table(t: &mut String, span: Duration, r: &Results) {
    let _ = writeln!(
        t,
        "\nPer operation, counted by `perf stat` over {} ms after each measured window (all threads of the \
         server; median over rounds):\n\n\
         | scenario | syscalls | reads | of which EAGAIN | writes | epoll waits | futex | context switches |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|",
        span.as_millis()
    );
    let groups: [(&str, Vec<&Outcome>); 9] = [
        ("relay sync", r.sync.iter().collect()),
        ("NATS request-reply", r.nats.iter().collect()),
        ("HTTP floor", r.floor.iter().collect()),
        ("relay async submit, closed loop", submits(&r.async_closed).collect()),
        ("relay async submit, pipelined", submits(&r.async_pipe).collect()),
        ("relay async fetch, closed loop", fetches(&r.async_closed).collect()),
        ("relay async fetch, pipelined", fetches(&r.async_pipe).collect()),
        ("relay sync 1c1w", r.sync1.iter().collect()),
        ("NATS 1c1w", r.nats1.iter().collect()),
    ];
    let kinds: [&[&str]; 7] = [
        &["raw_syscalls:sys_enter"],
        &["sys_enter_read", "sys_enter_recvfrom"],
        &["sys_exit_read", "sys_exit_recvfrom"],
        &["sys_enter_write", "sys_enter_sendto", "sys_enter_writev"],
        &["sys_enter_epoll_wait", "sys_enter_epoll_pwait"],
        &["sys_enter_futex"],
        &["context-switches"],
    ];
    for (label, os) in groups.into_iter().chain(crate::durable::syscall_groups(&r.durable)) {
        let counted: Vec<&Vec<(String, f64)>> = os.iter().filter_map(|o| o.per_op_events.as_ref().ok()).collect();
        if counted.is_empty() {
            if let Some(Err(e)) = os.first().map(|o| &o.per_op_events) {
                let _ = writeln!(t, "| {label} | {e} | | | | | | |");
            }
            continue;
        }
        let cells: Vec<String> = kinds
            .iter()
            .map(|names| {
                let per_round = counted
                    .iter()
                    .map(|ev| ev.iter().filter(|(e, _)| names.iter().any(|n| e.ends_with(n))).map(|(_, v)| v).sum())
                    .collect();
                median(per_round).map_or("-".into(), |m| format!("{m:.2}"))
            })
            .collect();
        let _ = writeln!(t, "| {label} | {} |", cells.join(" | "));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that answers every request (no body) at once, in order, whatever the batching.
    fn answering_server(body: &'static str) -> SocketAddr {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let resp = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len());
            let (mut pending, mut chunk) = (Vec::new(), [0u8; 4096]);
            while let Ok(n @ 1..) = s.read(&mut chunk) {
                pending.extend_from_slice(&chunk[..n]);
                let mut out = Vec::new();
                while let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                    pending.drain(..end + 4);
                    out.extend_from_slice(resp.as_bytes());
                }
                if s.write_all(&out).is_err() {
                    return;
                }
            }
        });
        addr
    }

    #[test]
    fn pipelined_client_keeps_depth_and_budget() {
        let addr = answering_server(r#"{"task_id":"t","status":"done"}"#);
        let reqs: Vec<Vec<u8>> = (0..3).map(|i| build_request("GET", &format!("/tasks/{i}"), None, b"")).collect();
        let budget = Arc::new(AtomicU64::new(10));
        let mut c = PipeClient::new(addr, 4, Arc::new(reqs), 200, Keep::Done(vec![0; 3])).with_budget(budget.clone());
        let mut calls = 0;
        while !c.finished() {
            c.call().expect("call");
            assert!(c.in_flight.len() < 4, "one answer taken out of at most 4 in flight");
            assert!(c.latency().is_some());
            calls += 1;
            assert!(calls <= 10);
        }
        assert_eq!((calls, c.sent, budget.load(Ordering::Relaxed), c.lost), (10, 10, 0, 0));
        let Keep::Done(v) = &c.keep else { panic!("keeps verdicts") };
        assert_eq!(v, &[1, 1, 1]);
        // Depth 1 is the closed loop; a wrong status is an error.
        let mut c = PipeClient::new(
            answering_server("{}"),
            1,
            Arc::new(vec![b"GET / HTTP/1.1\r\n\r\n".to_vec()]),
            202,
            Keep::Nothing,
        );
        assert!(c.call().is_err());
        assert_eq!((c.lost, c.in_flight.len()), (0, 0));
    }

    #[test]
    fn pipelined_client_drains_on_finish() {
        let addr = answering_server(r#"{"task_id":"abc"}"#);
        let req = Arc::new(vec![build_request("POST", "/tasks", None, b"{}")]);
        let mut c = PipeClient::new(addr, 8, req, 200, Keep::Ids(Vec::new()));
        c.call().expect("call");
        assert_eq!(c.in_flight.len(), 7);
        c.finish();
        let Keep::Ids(ids) = &c.keep else { panic!("keeps ids") };
        assert_eq!((ids.len(), c.in_flight.len()), (8, 0));
        assert!(ids.iter().all(|id| id == "abc"));
    }

    #[test]
    fn payload_sizes() {
        for n in [16, 100, 1000] {
            assert_eq!(payload(n).len(), n);
        }
    }

    #[test]
    fn medians() {
        fn check(xs: &[f64], expected: Option<f64>) {
            assert_eq!(median(xs.to_vec()), expected, "{xs:?}");
        }
        check(&[], None);
        check(&[3.0], Some(3.0));
        check(&[3.0, 1.0, 2.0], Some(2.0));
        check(&[4.0, 1.0, 2.0, 3.0], Some(2.5));
    }

    #[test]
    fn num_fields() {
        fn check(text: &str, key: &str, expected: Option<u64>) {
            assert_eq!(json_num_field(text.as_bytes(), key), expected, "{text}");
        }
        check(r#"{"status":"ok","clients":8,"active_clients":7}"#, "active_clients", Some(7));
        check(r#"{"clients":8}"#, "clients", Some(8));
        check(r#"{"clients":"8"}"#, "clients", None);
    }
}
