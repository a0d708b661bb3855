//! A model-based test of the dispatch core (issue 10). Random sequences of operations — submits
//! (kind, queue, delay/run_at, retries, timeout, idempotency key), workers connecting, saying
//! hello (kinds, concurrency, draining) or something else first, answering (on time, late,
//! twice, about tasks they were never sent), timing out, filling their output buffer, failing
//! writes and going away; cancels, waits, time passing (timeouts, schedules, TTL expiry) and
//! restarts from the journal — are run against a small reference model of SPEC §5/§7, and
//! invariants are checked after every step.
//!
//! The model is written from the SPEC, not from the core's code: it decides what must happen
//! (which answers count, when a task fails, expires or is forgotten, what a restart keeps) and
//! *observes* the choices the SPEC leaves open — which eligible worker gets a task — from the
//! frames the core sends, checking that each one was allowed when it was made. Between steps it
//! compares every task, worker and counter with the core.
//!
//! This file is also the fuzz target `dispatch_model` (`fuzz/fuzz_targets/dispatch_model.rs`
//! includes it by path), so it uses only relay's public API, through `relay::` paths. Restarts
//! use a real journal in a scratch directory (on tmpfs when there is one): the core writes its
//! records as in production, and `Journal::open` replays them for `Core::restore`. The model
//! never reads the core's private state: only what relay shows (tasks, /healthz, /clients,
//! metrics, frames and replies through `Io`).
//!
//! Two places where the core's reading of the SPEC is accepted rather than checked (see
//! `restart` and `result`): a task that fell due before a restart counts TASK_TTL in the queue
//! from the restart, and an answer about a task no longer in memory is counted `unknown`.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use relay::dispatch::{CancelResult, Core, CoreConfig, Io, NewTask, SubmitError};
use relay::http::Response;
use relay::journal::Journal;
use relay::journal::codec::RESTART_ERROR;
use relay::metrics::Ignored;
use relay::store::Store;
use relay::store::mem::{MemConfig, MemStore};

/// A PostgreSQL store for the model, given by the integration tests (`tests/it/model_pg.rs`),
/// which own the server and read the database directly.
pub trait PgBackend {
    /// A store over a clean database.
    fn store(&mut self, cfg: &ModelConfig) -> Store;
    /// Waits (at most `within`) for the store's threads to wake the loop.
    fn wait_wake(&self, within: Duration);
    /// Every task the database holds, as the store reads them.
    fn tasks(&mut self) -> HashMap<TaskId, Task>;
    /// Every task id in submission order, newest first.
    fn listed(&mut self) -> Vec<TaskId>;
}
use relay::tasks::{ConnRef, Outcome, Status, Task, TaskId};
use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;

/// `/healthz`, as far as the model checks it.
#[derive(Deserialize)]
struct Health {
    clients: u64,
    active_clients: u64,
    tasks: HealthTasks,
}

#[derive(Deserialize)]
struct HealthTasks {
    pending: u64,
    dispatched: u64,
    done: u64,
    failed: u64,
    canceled: u64,
}

/// `/clients`, as far as the model checks it.
#[derive(Deserialize)]
struct Clients<'a> {
    #[serde(borrow)]
    clients: Vec<Client<'a>>,
}

#[derive(Deserialize)]
struct Client<'a> {
    client_id: &'a str,
    active: bool,
    in_flight: u64,
    #[serde(default)]
    kinds: Option<Vec<String>>,
}

// ----- operations ------------------------------------------------------------------------------

/// When a submitted task is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// No schedule.
    Now,
    /// `run_at` this many ms from now (`In(0)`: a `run_at` of now — due, but it waits).
    In(u64),
    /// `run_at` this many ms in the past: due at submission, and it waits (SPEC §7).
    Past(u64),
}

/// One step of a sequence. Workers, tasks and waiting requests are named by index (modulo how
/// many there are), so any sequence is valid and a shorter one still means something.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `kind`: index into [`KINDS`] (`None`: no kind). `key`: (identity, key) of an
    /// `Idempotency-Key`. `pad`: payload size class.
    Submit {
        kind: Option<u8>,
        queue: bool,
        when: When,
        max_retries: Option<u32>,
        timeout_ms: Option<u64>,
        key: Option<(u8, u8)>,
        pad: u8,
    },
    /// A worker's WebSocket opens (it says nothing yet).
    Connect,
    /// `kinds`: indexes into [`KINDS`] (`None`: no `kinds` field).
    Hello {
        w: u8,
        kinds: Option<Vec<u8>>,
        concurrency: Option<u32>,
    },
    /// A text message that is not a valid one (a first message all the same).
    Garbage {
        w: u8,
    },
    Disconnect {
        w: u8,
    },
    /// The worker answers one of the tasks it runs (or, if it runs none, any task it was sent).
    Answer {
        w: u8,
        t: u8,
        done: bool,
    },
    /// The worker answers about a task it does not run: one it ran before (late or duplicate),
    /// one it was never sent, or an id nobody knows (unknown).
    Stray {
        w: u8,
        t: u8,
        done: bool,
    },
    Cancel {
        t: u8,
    },
    /// `GET /tasks/{id}?wait=true` (`post: false`) or the wait of `POST /tasks?wait=true`.
    Wait {
        t: u8,
        post: bool,
    },
    /// `GET /tasks/{id}` of a finished task that left memory (`TASK_MEMORY`): read back from
    /// the journal by its reader thread.
    Read {
        t: u8,
    },
    /// A waiting HTTP client goes away.
    CloseWait {
        c: u8,
    },
    /// Time passes; the timer wheel fires as the reactor fires it.
    Advance {
        ms: u64,
    },
    /// The worker's output buffer is full (`true`) or drained (`false`).
    Full {
        w: u8,
        full: bool,
    },
    /// Writes to the worker fail from now on (its connection broke; it goes later).
    Break {
        w: u8,
    },
    /// relay stops and starts again (journal mode), after `downtime_ms`.
    Restart {
        downtime_ms: u64,
    },
}

pub const KINDS: [&str; 3] = ["a", "b", "c"];

/// The settings of one sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    /// `DATA_DIR` set: a journal, and restarts.
    pub journal: bool,
    /// Journal segments of the minimum size (rotation and compaction happen).
    pub small_segments: bool,
    pub max_retries: u32,
    pub task_ttl_ms: u64,
    pub max_pending: usize,
    pub max_pending_bytes: usize,
    pub task_memory_bytes: usize,
    /// Tasks from two submitters and with two fairness keys (SPEC §14): dispatch order then
    /// holds within a lane (kind, submitter, key) only.
    pub lanes: bool,
}

/// The submitters (the root token, a scoped token's jti) and fairness keys of tasks when
/// [`ModelConfig::lanes`] is set.
const SUBMITTERS: [&str; 2] = ["", "jti-1"];
const FAIR_KEYS: [&str; 2] = ["", "k1"];

pub const TASK_TIMEOUT_MS: u64 = 1_000;
pub const WAIT_TIMEOUT_MS: u64 = 2_500;
/// SPEC §5: a new connection is sent nothing until its first text message, or this long.
const HELLO_GRACE_MS: u64 = 1_000;
const WALL_START_MS: u64 = 1_700_000_000_000;
const MAX_SLOTS: u32 = 6;

// ----- byte sources: seeds for `cargo test`, raw bytes for the fuzzer ---------------------------

pub trait Source {
    fn byte(&mut self) -> u8;
}

/// xorshift64*: deterministic from its seed.
pub struct Seeded(u64);

impl Seeded {
    pub fn new(seed: u64) -> Seeded {
        Seeded(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
}

impl Source for Seeded {
    fn byte(&mut self) -> u8 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
    }
}

/// The fuzzer's bytes; zeros once they run out.
pub struct Bytes<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Bytes<'_> {
    fn done(&self) -> bool {
        self.pos >= self.data.len()
    }
}

impl Source for Bytes<'_> {
    fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }
}

fn choose<T: Copy>(s: &mut dyn Source, items: &[T]) -> T {
    items[s.byte() as usize % items.len()]
}

pub fn config_from(s: &mut dyn Source) -> ModelConfig {
    let a = s.byte();
    let b = s.byte();
    let journal = a.is_multiple_of(3);
    ModelConfig {
        journal,
        small_segments: a & 0x10 != 0,
        max_retries: u32::from((a >> 2) % 4),
        task_ttl_ms: if a & 0x20 != 0 { 4_000 } else { 12_000 },
        max_pending: choose(s, &[3, 8, 1_000]),
        max_pending_bytes: if b.is_multiple_of(4) { 250 } else { 1 << 20 },
        // Small more often with a journal: finished tasks then leave memory and are read back.
        task_memory_bytes: if b & 0x10 != 0 || (journal && b & 0x20 != 0) { 3_000 } else { 64 << 20 },
        lanes: a & 0x40 != 0,
    }
}

pub fn op_from(s: &mut dyn Source, journal: bool) -> Op {
    let w = s.byte();
    match s.byte() % 100 {
        0..=21 => {
            let flags = s.byte();
            let extra = s.byte();
            let when = match (flags >> 3) % 8 {
                0 => When::In(choose(s, &[0, 1, 300, 1_000, 2_500, 20_000])),
                1 => When::Past(choose(s, &[1, 5_000, 100_000])),
                _ => When::Now,
            };
            Op::Submit {
                kind: match flags % 4 {
                    3 => None,
                    k => Some(k),
                },
                queue: flags & 4 != 0,
                when,
                max_retries: match extra % 6 {
                    0 => Some(0),
                    1 => Some(1),
                    2 => Some(3),
                    _ => None,
                },
                timeout_ms: match (extra / 6) % 5 {
                    0 => Some(200),
                    1 => Some(3_000),
                    _ => None,
                },
                key: (extra >= 190).then_some((w % 2, (w / 2) % 3)),
                pad: w % 4,
            }
        }
        22..=28 => Op::Connect,
        29..=37 => {
            let shape = s.byte();
            let kinds = match shape % 5 {
                0 => None,
                1 => Some(Vec::new()),
                _ => Some((0..3u8).filter(|k| shape & (8 << k) != 0).chain((shape & 0x80 != 0).then_some(0)).collect()),
            };
            let concurrency = match s.byte() % 6 {
                0 => None,
                1 => Some(0),
                2 => Some(2),
                3 => Some(3),
                _ => Some(1),
            };
            Op::Hello { w, kinds, concurrency }
        }
        38..=39 => Op::Garbage { w },
        40..=44 => Op::Disconnect { w },
        45..=64 => Op::Answer { w, t: s.byte(), done: !s.byte().is_multiple_of(3) },
        65..=68 => Op::Stray { w, t: s.byte(), done: s.byte().is_multiple_of(2) },
        69..=72 => Op::Cancel { t: s.byte() },
        73..=75 => Op::Wait { t: s.byte(), post: w.is_multiple_of(2) },
        76..=77 => Op::Read { t: s.byte() },
        78 => Op::CloseWait { c: w },
        79..=91 => {
            Op::Advance { ms: choose(s, &[1, 7, 100, 200, 500, 999, 1_000, 1_001, 2_000, 2_500, 3_000, 5_000, 13_000]) }
        }
        92..=94 => Op::Full { w, full: s.byte().is_multiple_of(2) },
        95 => Op::Break { w },
        _ if journal => Op::Restart { downtime_ms: choose(s, &[0, 0, 1_500, 5_000, 30_000]) },
        _ => Op::Advance { ms: 50 },
    }
}

// ----- the core's side: an Io that records what leaves ----------------------------------------

#[derive(Debug)]
enum Event {
    Task { to: ConnRef, id: TaskId, payload: String, sent: bool },
    Cancel { to: ConnRef, id: TaskId },
    Reply { conn: ConnRef, status: u16, body: Vec<u8> },
    Unreadable(String),
}

#[derive(Default)]
struct ModelIo {
    events: Vec<Event>,
    full: HashSet<ConnRef>,
    broken: HashSet<ConnRef>,
}

impl Io for ModelIo {
    fn send_text(&mut self, worker: ConnRef, parts: &[&str]) -> bool {
        let text = parts.concat();
        let sent = !self.broken.contains(&worker);
        let v: Option<Value> = serde_json::from_str(&text).ok();
        let id = v.as_ref().and_then(|v| v["task_id"].as_str()).and_then(relay::tasks::parse_id);
        let event = match (v.as_ref().and_then(|v| v["type"].as_str()), id) {
            (Some("task"), Some(id)) => Event::Task {
                to: worker,
                id,
                payload: v.as_ref().map(|v| v["payload"].to_string()).unwrap_or_default(),
                sent,
            },
            (Some("cancel"), Some(id)) => Event::Cancel { to: worker, id },
            _ => Event::Unreadable(text),
        };
        self.events.push(event);
        sent
    }
    fn has_room(&mut self, worker: ConnRef, _bytes: usize) -> bool {
        !self.full.contains(&worker)
    }
    fn reply(&mut self, conn: ConnRef, response: Response) {
        self.events.push(Event::Reply { conn, status: response.status, body: response.body });
    }
}

// ----- the model -------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gone {
    /// In the core's memory.
    Live,
    /// Final, left memory for the journal (still known, still counted).
    Evicted,
    /// TASK_TTL passed (or, in memory-only mode, it left memory early): unknown now.
    Forgotten,
    /// Final, after a restart: in memory or in the journal, as the replay's budget decided.
    Unsure,
}

#[derive(Debug, Clone)]
struct MAttempt {
    worker: usize,
    client: u128,
    outcome: Option<Outcome>,
    error: Option<String>,
    started: u64,
    duration: u64,
    restarted: bool,
    answered: bool,
    /// It ended while the current process ran (the core remembers a bounded number of such
    /// attempts, so a late answer is told from an unknown one after its task was forgotten).
    ended_here: bool,
}

#[derive(Debug, Clone)]
struct MTask {
    id: TaskId,
    kind: Option<String>,
    /// (submitter, key): indexes into [`SUBMITTERS`] and [`FAIR_KEYS`].
    lane: (usize, usize),
    payload: String,
    queued: bool,
    restored: bool,
    run_at: Option<u64>,
    due: u64,
    /// Pending, not due yet.
    scheduled: bool,
    /// TASK_TTL in the queue counts from here (see `restart`).
    expiry_base: u64,
    max_retries: u32,
    timeout_ms: u64,
    status: Status,
    attempts: Vec<MAttempt>,
    result: Option<String>,
    error: Option<String>,
    created: u64,
    finished: Option<u64>,
    gone: Gone,
    /// The task JSON when it became final: it never changes again.
    snapshot: Option<String>,
}

impl MTask {
    fn known(&self) -> bool {
        self.gone != Gone::Forgotten
    }
    fn waiting(&self) -> bool {
        self.gone == Gone::Live && self.status == Status::Pending && !self.scheduled
    }
    fn tried(&self, client: u128) -> bool {
        self.attempts.iter().any(|a| a.client == client)
    }
    fn last_error(&self) -> Option<&str> {
        self.attempts.iter().rev().find_map(|a| a.error.as_deref())
    }
    fn open_attempt(&self) -> Option<&MAttempt> {
        self.attempts.last().filter(|a| a.outcome.is_none())
    }
}

#[derive(Debug, Clone)]
struct MWorker {
    conn: ConnRef,
    client: u128,
    alive: bool,
    greeted: bool,
    grace_at: u64,
    kinds: Option<Vec<String>>,
    concurrency: Option<u32>,
    in_flight: Vec<usize>,
    full: bool,
    broken: bool,
}

impl MWorker {
    /// Not draining (a worker that has not said hello yet counts: it may take anything).
    fn active(&self) -> bool {
        self.concurrency != Some(0)
    }
    fn accepts(&self, kind: Option<&str>) -> bool {
        match &self.kinds {
            None => true,
            Some(kinds) => kind.is_some_and(|k| kinds.iter().any(|own| own == k)),
        }
    }
    fn has_capacity(&self) -> bool {
        self.concurrency.is_none_or(|c| self.in_flight.len() < c as usize)
    }
    /// Could ever take a task of `kind` (capacity aside): what keeps a waiting task's hope.
    fn could_take(&self, kind: Option<&str>) -> bool {
        self.alive && self.active() && self.accepts(kind)
    }
    /// May be sent a task of `kind` now.
    fn may_send(&self, kind: Option<&str>) -> bool {
        self.could_take(kind) && self.greeted && self.has_capacity() && !self.full
    }
}

#[derive(Debug, Clone)]
struct MWaiter {
    conn: ConnRef,
    task: usize,
    post: bool,
    deadline: u64,
}

/// What one step expects besides the state: cancels to see, tasks to place, tasks to expire.
#[derive(Default)]
struct Ctx {
    /// Waiting (due, pending) tasks when the step began, minus those that may expire in it.
    settled: Vec<usize>,
    /// Tasks whose attempt ended or that became due or were accepted in this step: the core
    /// decides their fate (dispatch, wait, fail) during the step.
    limbo: Vec<usize>,
    cancels: Vec<(ConnRef, TaskId)>,
    expire: Vec<usize>,
    finals: Vec<usize>,
    replies: Vec<(ConnRef, u16, Vec<u8>)>,
}

#[derive(Debug, Clone)]
pub struct Failure {
    pub step: usize,
    pub check: &'static str,
    pub detail: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {}: [{}] {}", self.step, self.check, self.detail)
    }
}

/// What the sequences reached, counted so a test can insist that each was reached (a
/// generator that stopped producing timeouts would otherwise pass quietly).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    Dispatch,
    SendFailed,
    Timeout,
    Disconnect,
    WorkerFailed,
    Done,
    Late,
    Duplicate,
    Unknown,
    CancelPending,
    CancelDispatched,
    Expired,
    Hopeless,
    RetriesUsedUp,
    NoUntriedWorker,
    Restart,
    RestartCut,
    Forgotten,
    Evicted,
    QueueFull,
    NoWorker,
    Repeat,
    WaitFinal,
    WaitTimeout,
    Draining,
    Grace,
    WaitsForCapacity,
    BufferFull,
    FellDue,
    ReadBack,
}

impl Seen {
    pub const ALL: [Seen; 30] = [
        Seen::Dispatch,
        Seen::SendFailed,
        Seen::Timeout,
        Seen::Disconnect,
        Seen::WorkerFailed,
        Seen::Done,
        Seen::Late,
        Seen::Duplicate,
        Seen::Unknown,
        Seen::CancelPending,
        Seen::CancelDispatched,
        Seen::Expired,
        Seen::Hopeless,
        Seen::RetriesUsedUp,
        Seen::NoUntriedWorker,
        Seen::Restart,
        Seen::RestartCut,
        Seen::Forgotten,
        Seen::Evicted,
        Seen::QueueFull,
        Seen::NoWorker,
        Seen::Repeat,
        Seen::WaitFinal,
        Seen::WaitTimeout,
        Seen::Draining,
        Seen::Grace,
        Seen::WaitsForCapacity,
        Seen::BufferFull,
        Seen::FellDue,
        Seen::ReadBack,
    ];
}

#[derive(Debug, Clone, Default)]
pub struct Stats(pub [u64; Seen::ALL.len()]);

impl Stats {
    fn add(&mut self, what: Seen) {
        self.0[what as usize] += 1;
    }
    pub fn merge(&mut self, other: &Stats) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a += b;
        }
    }
    pub fn get(&self, what: Seen) -> u64 {
        self.0[what as usize]
    }
}

macro_rules! ensure {
    ($cond:expr, $check:literal, $($arg:tt)*) => {
        if !$cond {
            return Err(Failure { step: 0, check: $check, detail: format!($($arg)*) });
        }
    };
}

fn outcome_index(o: Outcome) -> usize {
    Outcome::ALL.iter().position(|x| *x == o).unwrap_or(0)
}

/// The error text of a timeout, as SPEC §4's example writes it ("no answer within 10s").
fn timeout_error(ms: u64) -> String {
    match ms {
        200 => "no answer within 200ms".into(),
        1_000 => "no answer within 1s".into(),
        3_000 => "no answer within 3s".into(),
        other => format!("no answer within {other}ms?"),
    }
}

const DISCONNECT_ERROR: &str = "worker disconnected";
const SEND_FAILED_ERROR: &str = "could not write the task to the worker";
const EXPIRED_ERROR: &str = "expired in queue";
const HOPELESS_ERROR: &str = "no connected worker can take this task any more";

fn scratch_dir() -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // tmpfs when there is one: a restart waits for the journal's fdatasync.
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
    base.join(format!("relay-model-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)))
}

pub struct Harness {
    cfg: ModelConfig,
    core: Core,
    /// The PostgreSQL store's backend (`None`: the memory store), and the tasks it held at the
    /// last look.
    pg: Option<Box<dyn PgBackend>>,
    db_tasks: HashMap<TaskId, Task>,
    db_listed: Vec<TaskId>,
    io: ModelIo,
    dir: Option<PathBuf>,
    ctx: Ctx,
    now: u64,
    /// The wall time at which the core's monotonic clock read 0 (the process started).
    mono_base: u64,
    tasks: Vec<MTask>,
    by_id: HashMap<TaskId, usize>,
    workers: Vec<MWorker>,
    generations: [u32; MAX_SLOTS as usize],
    waiters: Vec<MWaiter>,
    next_wait_conn: u32,
    keys: HashMap<(u8, u8), usize>,
    // The core's counters since it started, as the model counts them.
    ignored: [u64; 3],
    malformed: u64,
    attempts_metric: [u64; Outcome::COUNT],
    finals_metric: [u64; 3],
    evicted_metric: u64,
    answers: u64,
    pub stats: Stats,
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = self.core.store.stop();
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl Harness {
    fn core_config(cfg: &ModelConfig) -> CoreConfig {
        CoreConfig {
            task_timeout_ms: TASK_TIMEOUT_MS,
            max_retries: cfg.max_retries,
            wait_timeout_ms: WAIT_TIMEOUT_MS,
            ..CoreConfig::default()
        }
    }

    fn mem_config(cfg: &ModelConfig) -> MemConfig {
        MemConfig {
            task_ttl_ms: cfg.task_ttl_ms,
            failed_ttl_ms: 0,
            max_pending: cfg.max_pending,
            max_pending_bytes: cfg.max_pending_bytes,
            task_memory_bytes: cfg.task_memory_bytes,
            task_timeout_ms: TASK_TIMEOUT_MS,
            max_retries: cfg.max_retries,
        }
    }

    /// A core as the reactor makes one: monotonic clock at 0, the journal replayed into it.
    fn start_core(cfg: &ModelConfig, dir: Option<&Path>, wall: u64) -> Result<Core, Failure> {
        let mut store = MemStore::new(Self::mem_config(cfg), None);
        if let Some(dir) = dir {
            let (mut journal, replayed) = Journal::open(dir, cfg.task_memory_bytes, wall, Arc::new(|| {}))
                .map_err(|e| Failure { step: 0, check: "journal", detail: format!("cannot open: {e}") })?;
            ensure!(
                replayed.skipped == 0 && replayed.truncated_bytes == 0,
                "journal",
                "a clean stop left damage: {} skipped, {} bytes cut",
                replayed.skipped,
                replayed.truncated_bytes
            );
            if cfg.small_segments {
                journal.set_segment_bytes(0);
            }
            store = MemStore::new(Self::mem_config(cfg), Some(Box::new(journal)));
            store.set_clock(0, wall);
            store.restore(replayed);
        }
        let mut core = Core::new(Self::core_config(cfg), Store::Mem(Box::new(store)), 0, wall);
        core.set_clock(0, wall);
        core.end_turn(&mut ModelIo::default());
        Ok(core)
    }

    pub fn new(cfg: ModelConfig) -> Result<Harness, Failure> {
        Self::with(cfg, None)
    }

    /// A harness over PostgreSQL: no journal, no restarts, and no task forgotten within a
    /// sequence (the database forgets by its housekeeping, up to a second late), so `cfg`'s
    /// TASK_TTL must be longer than a sequence.
    #[allow(dead_code)] // (tests/it/model_pg.rs)
    pub fn new_pg(cfg: ModelConfig, backend: Box<dyn PgBackend>) -> Result<Harness, Failure> {
        Self::with(cfg, Some(backend))
    }

    fn with(cfg: ModelConfig, mut pg: Option<Box<dyn PgBackend>>) -> Result<Harness, Failure> {
        // Thousands of sequences would print a line per worker, hello and task otherwise (the
        // level is global; nothing in the unit tests reads the log).
        relay::log::set_level(relay::log::Level::Error);
        let dir = (cfg.journal && pg.is_none()).then(scratch_dir);
        let core = match &mut pg {
            Some(backend) => {
                let store = backend.store(&cfg);
                let mut core = Core::new(Self::core_config(&cfg), store, 0, WALL_START_MS);
                core.set_clock(0, WALL_START_MS);
                core
            }
            None => Self::start_core(&cfg, dir.as_deref(), WALL_START_MS)?,
        };
        let mut h = Harness {
            cfg,
            core,
            pg,
            db_tasks: HashMap::new(),
            db_listed: Vec::new(),
            io: ModelIo::default(),
            dir,
            ctx: Ctx::default(),
            now: WALL_START_MS,
            mono_base: WALL_START_MS,
            tasks: Vec::new(),
            by_id: HashMap::new(),
            workers: Vec::new(),
            generations: [0; MAX_SLOTS as usize],
            waiters: Vec::new(),
            next_wait_conn: 0,
            keys: HashMap::new(),
            ignored: [0; 3],
            malformed: 0,
            attempts_metric: [0; Outcome::COUNT],
            finals_metric: [0; 3],
            evicted_metric: 0,
            answers: 0,
            stats: Stats::default(),
        };
        h.settle()?;
        Ok(h)
    }

    /// With PostgreSQL, drives the store until its transactions are sent and answered (a
    /// memory store answers at once); then the core's frames and replies are all in `io`.
    fn settle(&mut self) -> Result<(), Failure> {
        let Some(pg) = &self.pg else { return Ok(()) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            self.core.end_turn(&mut self.io);
            if self.core.store.idle() {
                return Ok(());
            }
            ensure!(Instant::now() < deadline, "store", "the PostgreSQL store never became idle");
            pg.wait_wake(Duration::from_millis(50));
            self.core.on_wake(&mut self.io);
        }
    }

    /// The answer to `conn`: `immediate`, or (PostgreSQL) the reply it gets once the store
    /// answered.
    fn answer_for(&mut self, conn: ConnRef, immediate: Option<Response>) -> Result<Option<Response>, Failure> {
        if immediate.is_some() || self.pg.is_none() {
            return Ok(immediate);
        }
        self.settle()?;
        let Some(pos) = self.io.events.iter().position(|e| matches!(e, Event::Reply { conn: c, .. } if *c == conn))
        else {
            return Ok(None);
        };
        match self.io.events.remove(pos) {
            Event::Reply { status, body, .. } => Ok(Some(Response::json(status, body))),
            _ => Ok(None),
        }
    }

    /// `DELETE /tasks/{id}` as the root token, answered at once or once the store answered.
    fn cancel_core(&mut self, id: TaskId) -> Result<CancelResult, Failure> {
        if self.pg.is_none() {
            return Ok(self.core.cancel_direct(&mut self.io, id));
        }
        let immediate = self.core.cancel(&mut self.io, relay::dispatch::DIRECT, id, None);
        Ok(match self.answer_for(relay::dispatch::DIRECT, immediate)?.map(|r| r.status) {
            Some(200) => CancelResult::Canceled,
            Some(409) => CancelResult::AlreadyFinal,
            Some(_) => CancelResult::NotFound,
            None => CancelResult::Later,
        })
    }

    /// The core's task `id`: in memory, or as the database had it at the last look.
    fn task_of(&self, id: TaskId) -> Option<&Task> {
        match &self.pg {
            Some(_) => self.db_tasks.get(&id),
            None => self.core.task(id),
        }
    }

    /// With PostgreSQL: the database's tasks and counts as they are now.
    fn look(&mut self) -> Result<(), Failure> {
        if self.pg.is_none() {
            return Ok(());
        }
        if let Store::Pg(p) = &mut self.core.store {
            p.refresh();
        }
        self.settle()?;
        if let Some(pg) = &mut self.pg {
            self.db_tasks = pg.tasks();
            self.db_listed = pg.listed();
        }
        // (As this node's reads show them: with the starts it has not written yet.)
        if let Store::Pg(p) = &self.core.store {
            self.db_tasks.values_mut().for_each(|t| p.show_unwritten_start(t));
        }
        Ok(())
    }

    fn alive_workers(&self) -> Vec<usize> {
        (0..self.workers.len()).filter(|&w| self.workers[w].alive).collect()
    }

    fn pick_worker(&self, w: u8) -> Option<usize> {
        let alive = self.alive_workers();
        (!alive.is_empty()).then(|| alive[w as usize % alive.len()])
    }

    fn worker_by_conn(&self, conn: ConnRef) -> Option<usize> {
        self.workers.iter().position(|w| w.alive && w.conn == conn)
    }

    /// Some connected worker could take the task and has not tried it.
    fn hope(&self, i: usize) -> bool {
        let t = &self.tasks[i];
        self.workers.iter().any(|w| w.could_take(t.kind.as_deref()) && !t.tried(w.client))
    }

    fn pending_totals(&self) -> (usize, usize) {
        let pending = self.tasks.iter().filter(|t| t.known() && t.status == Status::Pending);
        pending.fold((0, 0), |(n, bytes), t| (n + 1, bytes + t.payload.len()))
    }

    fn set_clock(&mut self, wall: u64) {
        self.now = wall;
        self.core.set_clock(wall - self.mono_base, wall);
    }

    // ----- the model's transitions -------------------------------------------------------------

    fn end_attempt(&mut self, i: usize, outcome: Outcome, error: Option<String>) {
        let now = self.now;
        let t = &mut self.tasks[i];
        let Some(a) = t.attempts.last_mut().filter(|a| a.outcome.is_none()) else { return };
        a.outcome = Some(outcome);
        a.error = error;
        a.duration = now - a.started;
        a.ended_here = true;
        let w = a.worker;
        self.workers[w].in_flight.retain(|&x| x != i);
        self.attempts_metric[outcome_index(outcome)] += 1;
        if outcome != Outcome::Done && outcome != Outcome::Canceled {
            t.status = Status::Pending;
            self.ctx.limbo.push(i);
        }
    }

    fn finalize(&mut self, i: usize, status: Status, result: Option<String>, error: Option<String>) {
        let t = &mut self.tasks[i];
        t.status = status;
        t.scheduled = false;
        t.finished = Some(self.now);
        t.result = result;
        t.error = error;
        self.finals_metric[match status {
            Status::Done => 0,
            Status::Failed => 1,
            _ => 2,
        }] += 1;
        self.ctx.finals.push(i);
    }

    fn begin_step(&mut self) {
        self.ctx = Ctx::default();
        self.ctx.settled = (0..self.tasks.len()).filter(|&i| self.tasks[i].waiting()).collect();
    }

    /// The dispatch of task `id` to `to`, as the core made it: allowed right now?
    fn on_task_frame(&mut self, to: ConnRef, id: TaskId, payload: &str, sent: bool) -> Result<(), Failure> {
        let Some(&i) = self.by_id.get(&id) else {
            return Err(Failure {
                step: 0,
                check: "dispatch",
                detail: format!("a task frame for unknown task {id:x}"),
            });
        };
        let Some(w) = self.worker_by_conn(to) else {
            return Err(Failure { step: 0, check: "dispatch", detail: format!("task {i} sent to {to:?}, no worker") });
        };
        let (t, wk) = (&self.tasks[i], &self.workers[w]);
        let kind = t.kind.as_deref();
        ensure!(
            t.waiting(),
            "dispatch",
            "task {i} sent to worker {w} while {:?} (scheduled {})",
            t.status,
            t.scheduled
        );
        ensure!(wk.greeted, "dispatch", "task {i} sent to worker {w} before its first message or the grace");
        ensure!(wk.active(), "dispatch", "task {i} sent to draining worker {w}");
        ensure!(wk.accepts(kind), "dispatch", "task {i} of kind {kind:?} sent to worker {w} taking {:?}", wk.kinds);
        ensure!(
            wk.has_capacity(),
            "concurrency",
            "task {i} sent to worker {w} running {} of {:?}",
            wk.in_flight.len(),
            wk.concurrency
        );
        ensure!(!wk.full, "dispatch", "task {i} sent to worker {w} whose output buffer is full");
        ensure!(!t.tried(wk.client), "dispatch", "task {i} sent to worker {w} a second time");
        let started = t.attempts.iter().filter(|a| !a.restarted).count();
        ensure!(started <= t.max_retries as usize, "dispatch", "task {i}: attempt {} past max_retries", started + 1);
        ensure!(payload == t.payload, "dispatch", "task {i} sent with payload {payload}, not {}", t.payload);
        // Due order, ties in submission order: no task that waited since before this step, is
        // earlier, and this worker could take, is left behind (a worker whose writes fail is
        // not really sent anything).
        if !wk.broken {
            let key = (t.due, i);
            for &u in &self.ctx.settled {
                let o = &self.tasks[u];
                // (A task whose attempt ended in this step is still being decided by the core.)
                if u != i
                    && o.waiting()
                    && !self.ctx.limbo.contains(&u)
                    && (o.due, u) < key
                    && wk.accepts(o.kind.as_deref())
                    && !o.tried(wk.client)
                    && (!self.cfg.lanes || (o.kind == t.kind && o.lane == t.lane))
                {
                    return Err(Failure {
                        step: 0,
                        check: "order",
                        detail: format!(
                            "worker {w} was sent task {i} (due {}) while task {u} (due {}) waits",
                            t.due, o.due
                        ),
                    });
                }
            }
        }
        let now = self.now;
        let client = wk.client;
        let t = &mut self.tasks[i];
        t.status = Status::Dispatched;
        t.attempts.push(MAttempt {
            worker: w,
            client,
            outcome: None,
            error: None,
            started: now,
            duration: 0,
            restarted: false,
            answered: false,
            ended_here: false,
        });
        self.workers[w].in_flight.push(i);
        self.stats.add(Seen::Dispatch);
        if !sent {
            self.stats.add(Seen::SendFailed);
            self.end_attempt(i, Outcome::SendFailed, Some(SEND_FAILED_ERROR.into()));
        }
        Ok(())
    }

    /// Takes in what the core sent during the step.
    fn absorb(&mut self) -> Result<(), Failure> {
        for event in std::mem::take(&mut self.io.events) {
            match event {
                Event::Task { to, id, payload, sent } => self.on_task_frame(to, id, &payload, sent)?,
                Event::Cancel { to, id } => {
                    let pos = self.ctx.cancels.iter().position(|c| *c == (to, id));
                    ensure!(pos.is_some(), "cancel", "unexpected cancel of {id:x} to {to:?}");
                    if let Some(pos) = pos {
                        self.ctx.cancels.swap_remove(pos);
                    }
                }
                Event::Reply { conn, status, body } => self.ctx.replies.push((conn, status, body)),
                Event::Unreadable(text) => ensure!(false, "frame", "an unreadable frame: {text}"),
            }
        }
        Ok(())
    }

    /// After the step's events: what the core must have decided for the tasks in limbo, and
    /// for waiting tasks that may have lost their last possible worker.
    fn resolve(&mut self) -> Result<(), Failure> {
        ensure!(self.ctx.cancels.is_empty(), "cancel", "cancel frames never sent: {:?}", self.ctx.cancels);
        for i in std::mem::take(&mut self.ctx.expire) {
            let t = &self.tasks[i];
            if t.waiting() && t.attempts.is_empty() {
                self.stats.add(Seen::Expired);
                self.finalize(i, Status::Failed, None, Some(EXPIRED_ERROR.into()));
            }
        }
        let mut limbo = std::mem::take(&mut self.ctx.limbo);
        limbo.sort_unstable();
        limbo.dedup();
        for i in limbo {
            let t = &self.tasks[i];
            if !t.waiting() {
                continue;
            }
            // Attempts a restart cut short do not use up retries.
            let started = t.attempts.iter().filter(|a| !a.restarted).count();
            if started > t.max_retries as usize || (started > 0 && !self.hope(i)) {
                self.stats.add(if started > t.max_retries as usize {
                    Seen::RetriesUsedUp
                } else {
                    Seen::NoUntriedWorker
                });
                let error = t.last_error().unwrap_or("failed").to_string();
                self.finalize(i, Status::Failed, None, Some(error));
            }
        }
        // Retries, and tasks submitted without `queue` or a schedule, fail once no untried
        // worker that could take them is connected; tasks read back at a restart wait.
        for i in 0..self.tasks.len() {
            let t = &self.tasks[i];
            let fragile = !t.restored && (!t.attempts.is_empty() || !t.queued);
            if t.waiting() && fragile && !self.hope(i) {
                self.stats.add(Seen::Hopeless);
                let error = t.last_error().unwrap_or(HOPELESS_ERROR).to_string();
                self.finalize(i, Status::Failed, None, Some(error));
            }
        }
        self.check_replies()
    }

    fn final_code(status: Status, post: bool) -> u16 {
        match (post, status) {
            (false, _) | (true, Status::Done) => 200,
            (true, Status::Failed) => 502,
            (true, Status::Canceled) => 409,
            (true, _) => 202,
        }
    }

    /// Every held request is answered once: when its task becomes final, or at WAIT_TIMEOUT.
    fn check_replies(&mut self) -> Result<(), Failure> {
        for (conn, status, body) in std::mem::take(&mut self.ctx.replies) {
            let Some(pos) = self.waiters.iter().position(|w| w.conn == conn) else {
                return Err(Failure {
                    step: 0,
                    check: "wait",
                    detail: format!("a reply {status} to {conn:?}, not waiting"),
                });
            };
            let waiter = self.waiters.swap_remove(pos);
            let t = &self.tasks[waiter.task];
            self.stats.add(if t.status.is_final() { Seen::WaitFinal } else { Seen::WaitTimeout });
            let mut allowed = Vec::new();
            if t.status.is_final() {
                allowed.push(Self::final_code(t.status, waiter.post));
            }
            if waiter.deadline <= self.now {
                allowed.push(if waiter.post { 202 } else { 200 });
            }
            ensure!(
                allowed.contains(&status),
                "wait",
                "waiter on task {} (post {}) got {status}, expected one of {allowed:?}",
                waiter.task,
                waiter.post
            );
            let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            ensure!(
                v["task_id"].as_str().and_then(relay::tasks::parse_id) == Some(t.id),
                "wait",
                "the reply for task {} is not its JSON",
                waiter.task
            );
            // A final answer shows the final task; one at WAIT_TIMEOUT the task as it was.
            let shown = v["status"].as_str().unwrap_or_default();
            ensure!(
                shown == t.status.as_str()
                    || (waiter.deadline <= self.now && (shown == "pending" || shown == "dispatched")),
                "wait",
                "the reply {status} for task {} shows it {shown}, the model {:?}",
                waiter.task,
                t.status
            );
        }
        for w in &self.waiters {
            let t = &self.tasks[w.task];
            ensure!(!t.status.is_final(), "wait", "a waiter on task {} was not answered when it became final", w.task);
            ensure!(w.deadline > self.now, "wait", "a waiter on task {} was not answered at WAIT_TIMEOUT", w.task);
        }
        Ok(())
    }

    /// After the turn: finished tasks over TASK_MEMORY may have left memory (oldest first).
    fn observe_evictions(&mut self) -> Result<(), Failure> {
        for i in 0..self.tasks.len() {
            let t = &self.tasks[i];
            if !matches!(t.gone, Gone::Live | Gone::Unsure) || self.task_of(t.id).is_some() {
                if t.gone == Gone::Unsure {
                    self.tasks[i].gone = Gone::Live;
                }
                continue;
            }
            ensure!(t.status.is_final(), "lost", "unfinished task {i} ({:?}) is gone from the core", t.status);
            let evicted = self.core.evicted(t.id).map(|e| e.status);
            if self.cfg.journal {
                ensure!(evicted == Some(t.status), "lost", "final task {i} is neither in memory nor on disk");
                if t.gone == Gone::Live {
                    self.evicted_metric += 1;
                    self.stats.add(Seen::Evicted);
                }
                self.tasks[i].gone = Gone::Evicted;
            } else {
                ensure!(evicted.is_none(), "evict", "memory-only mode kept task {i} as evicted");
                self.evicted_metric += 1;
                self.stats.add(Seen::Evicted);
                self.tasks[i].gone = Gone::Forgotten;
            }
        }
        // Oldest first: no task that finished (since this process started) strictly later left
        // memory while this one stayed.
        let since_start = |t: &&MTask| t.finished.is_some_and(|f| f >= self.mono_base);
        let oldest_in_memory = self
            .tasks
            .iter()
            .filter(|t| t.gone == Gone::Live && t.status.is_final())
            .filter(since_start)
            .filter_map(|t| t.finished)
            .min();
        if let Some(oldest) = oldest_in_memory {
            for (i, t) in self.tasks.iter().enumerate() {
                if t.gone == Gone::Evicted && t.finished.is_some_and(|f| f > oldest) && since_start(&t) {
                    return Err(Failure {
                        step: 0,
                        check: "evict",
                        detail: format!("task {i} left memory before an older finished task"),
                    });
                }
            }
        }
        Ok(())
    }
}

// ----- operations on the core and the model ----------------------------------------------------

impl Harness {
    /// Applies one operation, then checks everything.
    pub fn apply(&mut self, op: &Op) -> Result<(), Failure> {
        if let Op::Advance { ms } = op {
            return self.advance(*ms);
        }
        if let Op::Restart { downtime_ms } = op {
            return if self.cfg.journal { self.restart(*downtime_ms) } else { self.advance(*downtime_ms) };
        }
        self.begin_step();
        match op {
            Op::Submit { kind, queue, when, max_retries, timeout_ms, key, pad } => {
                self.submit(*kind, *queue, *when, *max_retries, *timeout_ms, *key, *pad)?
            }
            Op::Connect => self.connect()?,
            Op::Hello { w, kinds, concurrency } => self.hello(*w, kinds.as_deref(), *concurrency),
            Op::Garbage { w } => self.garbage(*w),
            Op::Disconnect { w } => self.disconnect(*w),
            Op::Answer { w, t, done } => self.result(*w, *t, *done, false),
            Op::Stray { w, t, done } => self.result(*w, *t, *done, true),
            Op::Cancel { t } => self.cancel(*t)?,
            Op::Wait { t, post } => self.wait(*t, *post)?,
            Op::Read { t } => self.read(*t)?,
            Op::CloseWait { c } => self.close_wait(*c),
            Op::Full { w, full } => self.full(*w, *full),
            Op::Break { w } => {
                if let Some(w) = self.pick_worker(*w) {
                    self.workers[w].broken = true;
                    self.io.broken.insert(self.workers[w].conn);
                }
            }
            Op::Advance { .. } | Op::Restart { .. } => {}
        }
        self.end_step()
    }

    fn end_step(&mut self) -> Result<(), Failure> {
        self.settle()?;
        self.absorb()?;
        self.resolve()?;
        for t in self.tasks.iter().filter(|t| t.waiting()) {
            let kind = t.kind.as_deref();
            let takers = self.workers.iter().filter(|w| w.could_take(kind) && w.greeted && !t.tried(w.client));
            for w in takers {
                if !w.has_capacity() {
                    self.stats.add(Seen::WaitsForCapacity);
                } else if w.full {
                    self.stats.add(Seen::BufferFull);
                }
            }
        }
        // (A memory store's snapshot is taken before the turn's end may evict the task; a
        // database's once the step's transactions are in.)
        if self.pg.is_none() {
            self.take_snapshots();
        }
        self.end_turn()?;
        self.look()?;
        if self.pg.is_some() {
            self.take_snapshots();
        }
        self.observe_evictions()?;
        self.check()
    }

    /// The end of a loop turn. When finished tasks are over TASK_MEMORY, the reactor turns again
    /// once the journal thread reports the records on disk (they leave memory only then): so
    /// here too, within a deadline.
    fn end_turn(&mut self) -> Result<(), Failure> {
        self.core.end_turn(&mut self.io);
        if self.core.journal().is_none() || self.core.finished_mem_bytes() <= self.cfg.task_memory_bytes {
            return Ok(());
        }
        let lsn = self.core.journal().map_or(0, Journal::lsn);
        // (No answer waits on them here: ask for the sync rather than wait out the writer's hold.)
        self.core.store.want_durable(lsn);
        self.core.end_turn(&mut self.io);
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.core.store.durable_lsn() < lsn {
            ensure!(Instant::now() < deadline, "journal", "records up to {lsn} never became durable");
            std::thread::sleep(Duration::from_micros(100));
        }
        self.core.end_turn(&mut self.io);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn submit(
        &mut self,
        kind: Option<u8>,
        queue: bool,
        when: When,
        max_retries: Option<u32>,
        timeout_ms: Option<u64>,
        key: Option<(u8, u8)>,
        pad: u8,
    ) -> Result<(), Failure> {
        let kind = kind.map(|k| KINDS[k as usize % KINDS.len()]);
        let n = self.tasks.len();
        let payload = format!("{{\"n\":{n},\"pad\":\"{}\"}}", "x".repeat([0, 20, 100, 180][pad as usize % 4]));
        let raw = RawValue::from_string(payload.clone()).map_err(|e| Failure {
            step: 0,
            check: "setup",
            detail: format!("payload {payload}: {e}"),
        })?;
        let run_at = match when {
            When::Now => None,
            When::In(ms) => Some(self.now + ms),
            When::Past(ms) => Some(self.now - ms),
        };
        let due = run_at.filter(|at| *at > self.now).unwrap_or(self.now);
        let scheduled = due > self.now;
        let queued = queue || run_at.is_some();
        let owners = ["root", "jti-1"];
        let keys = ["k0", "k1", "k2"];
        let idempotency = key.map(|(o, k)| (owners[o as usize % 2], keys[k as usize % 3]));
        let key = key.map(|(o, k)| (o % 2, k % 3));
        let lane = if self.cfg.lanes { ((pad as usize + n / 2) % 2, (pad as usize / 2 + n) % 2) } else { (0, 0) };

        // What SPEC §4/§7 says the answer is.
        let existing = key.and_then(|k| self.keys.get(&k).copied()).filter(|&i| self.tasks[i].known());
        let now_possible = !scheduled && self.workers.iter().any(|w| w.may_send(kind));
        let can_ever = self.workers.iter().any(|w| w.could_take(kind));
        let (pending, bytes) = self.pending_totals();
        let expected: Result<Option<usize>, SubmitError> = if let Some(i) = existing {
            Ok(Some(i))
        } else if now_possible {
            Ok(None)
        } else if !scheduled && !queued && !can_ever {
            Err(SubmitError::NoWorker)
        } else if pending >= self.cfg.max_pending || bytes + payload.len() > self.cfg.max_pending_bytes {
            Err(SubmitError::QueueFull)
        } else {
            Ok(None)
        };
        let new = NewTask {
            payload: &raw,
            kind,
            run_at_wall_ms: run_at,
            queue,
            timeout_ms,
            max_retries,
            retry: Default::default(),
            priority: 0,
            submitter: SUBMITTERS[lane.0],
            key: FAIR_KEYS[lane.1],
            idempotency,
        };
        let immediate = self.core.submit(&mut self.io, relay::dispatch::DIRECT, &new, false);
        let got = relay::dispatch::submit_answer(self.answer_for(relay::dispatch::DIRECT, immediate)?);
        match (expected, got) {
            (Ok(Some(i)), Ok(id)) => {
                self.stats.add(Seen::Repeat);
                ensure!(id == self.tasks[i].id, "submit", "an idempotent repeat of task {i} answered another task");
                ensure!(
                    self.io.events.is_empty(),
                    "submit",
                    "an idempotent repeat did something: {:?}",
                    self.io.events
                );
            }
            (Ok(None), Ok(id)) => {
                ensure!(
                    !self.by_id.contains_key(&id),
                    "submit",
                    "a new task reuses the id of task {}",
                    self.by_id[&id]
                );
                self.by_id.insert(id, n);
                self.tasks.push(MTask {
                    id,
                    kind: kind.map(String::from),
                    lane,
                    payload,
                    queued,
                    restored: false,
                    run_at,
                    due,
                    scheduled,
                    expiry_base: due,
                    max_retries: max_retries.unwrap_or(self.cfg.max_retries),
                    timeout_ms: timeout_ms.unwrap_or(TASK_TIMEOUT_MS),
                    status: Status::Pending,
                    attempts: Vec::new(),
                    result: None,
                    error: None,
                    created: self.now,
                    finished: None,
                    gone: Gone::Live,
                    snapshot: None,
                });
                if let Some(k) = key {
                    self.keys.insert(k, n);
                }
                if !scheduled {
                    self.ctx.limbo.push(n);
                }
            }
            (Err(e), Err(g)) if e == g => {
                self.stats.add(if e == SubmitError::NoWorker { Seen::NoWorker } else { Seen::QueueFull });
            }
            (expected, got) => {
                return Err(Failure {
                    step: 0,
                    check: "submit",
                    detail: format!(
                        "submit of kind {kind:?} (queue {queue}, {when:?}): expected {expected:?}, got {got:?}"
                    ),
                });
            }
        }
        Ok(())
    }

    fn connect(&mut self) -> Result<(), Failure> {
        let used: HashSet<u32> = self.workers.iter().filter(|w| w.alive).map(|w| w.conn.slot).collect();
        let Some(slot) = (0..MAX_SLOTS).find(|s| !used.contains(s)) else { return Ok(()) };
        self.generations[slot as usize] += 1;
        let conn = ConnRef { slot, generation: self.generations[slot as usize] };
        let ip: IpAddr = [10, 0, 0, slot as u8 + 1].into();
        let client = self.core.worker_connected(&mut self.io, conn, ip);
        ensure!(self.workers.iter().all(|w| w.client != client), "connect", "client id {client:x} given twice");
        ensure!(self.io.events.is_empty(), "connect", "a new connection was sent something: {:?}", self.io.events);
        self.workers.push(MWorker {
            conn,
            client,
            alive: true,
            greeted: false,
            grace_at: self.now + HELLO_GRACE_MS,
            kinds: None,
            concurrency: None,
            in_flight: Vec::new(),
            full: false,
            broken: false,
        });
        Ok(())
    }

    /// Sends a text message from worker `w`; its first one ends the wait for a hello.
    fn message(&mut self, w: usize, text: &str) {
        let conn = self.workers[w].conn;
        self.core.worker_message(&mut self.io, conn, text);
        self.workers[w].greeted = true;
    }

    fn hello(&mut self, w: u8, kinds: Option<&[u8]>, concurrency: Option<u32>) {
        let Some(w) = self.pick_worker(w) else { return };
        let names: Option<Vec<String>> =
            kinds.map(|ks| ks.iter().map(|k| KINDS[*k as usize % KINDS.len()].to_string()).collect());
        let mut text = String::from("{\"type\":\"hello\"");
        if let Some(names) = &names {
            text.push_str(&format!(",\"kinds\":{}", serde_json::to_string(names).unwrap_or_default()));
        }
        if let Some(c) = concurrency {
            text.push_str(&format!(",\"concurrency\":{c}"));
        }
        text.push_str(",\"version\":\"model\"}");
        // A later hello replaces the earlier one (no `kinds`: every kind; no `concurrency`:
        // unlimited).
        self.workers[w].kinds = names;
        self.workers[w].concurrency = concurrency;
        if concurrency == Some(0) {
            self.stats.add(Seen::Draining);
        }
        self.message(w, &text);
    }

    fn garbage(&mut self, w: u8) {
        let Some(w) = self.pick_worker(w) else { return };
        self.malformed += 1;
        let text = if w % 2 == 0 { "not json" } else { "{\"type\":\"bogus\"}" };
        self.message(w, text);
    }

    fn disconnect(&mut self, w: u8) {
        let Some(w) = self.pick_worker(w) else { return };
        let conn = self.workers[w].conn;
        self.workers[w].alive = false;
        for i in self.workers[w].in_flight.clone() {
            self.stats.add(Seen::Disconnect);
            self.end_attempt(i, Outcome::Disconnect, Some(DISCONNECT_ERROR.into()));
        }
        self.io.full.remove(&conn);
        self.io.broken.remove(&conn);
        self.core.worker_disconnected(&mut self.io, conn, "model");
    }

    /// Worker `w` answers. Not `stray`: one of the tasks it runs (if any). `stray`: a task it
    /// ran before, one it was never sent, or an id nobody knows.
    fn result(&mut self, w: u8, t: u8, done: bool, stray: bool) {
        let Some(w) = self.pick_worker(w) else { return };
        let client = self.workers[w].client;
        let in_flight = self.workers[w].in_flight.clone();
        let sent_before: Vec<usize> = (0..self.tasks.len()).filter(|&i| self.tasks[i].tried(client)).collect();
        let target: Option<usize> = if !stray && !in_flight.is_empty() {
            Some(in_flight[t as usize % in_flight.len()])
        } else if !sent_before.is_empty() && !t.is_multiple_of(3) {
            Some(sent_before[t as usize % sent_before.len()])
        } else if !self.tasks.is_empty() && t.is_multiple_of(3) && t.is_multiple_of(2) {
            Some(t as usize % self.tasks.len())
        } else {
            None
        };
        let id = target.map_or(0x4000_0000_0000_4000_8000_0000_0000_0000 | u128::from(t), |i| self.tasks[i].id);
        self.answers += 1;
        let k = self.answers;
        let text = if done {
            format!(r#"{{"type":"result","task_id":"{}","status":"done","data":{{"r":{k}}}}}"#, uuid(id))
        } else {
            format!(r#"{{"type":"result","task_id":"{}","status":"failed","error":"boom {k}"}}"#, uuid(id))
        };
        // SPEC §5: only the current attempt's worker finishes the task; a late answer (an earlier
        // attempt, or after the task became final or was canceled), a duplicate (a second answer
        // to one attempt) or an unknown one (a task this worker was never sent) is counted, never
        // applied. A task the core no longer holds in memory is told from one never sent while
        // the core remembers the attempt (it ended in this process).
        let remembered =
            |t: &MTask| t.gone == Gone::Live || t.attempts.iter().any(|a| a.client == client && a.ended_here);
        match target.filter(|&i| remembered(&self.tasks[i])) {
            None => {
                self.ignored[Ignored::Unknown as usize] += 1;
                self.stats.add(Seen::Unknown);
            }
            Some(i) => {
                let task = &mut self.tasks[i];
                let last = task.attempts.len();
                match task.attempts.iter().position(|a| a.client == client) {
                    None => {
                        self.ignored[Ignored::Unknown as usize] += 1;
                        self.stats.add(Seen::Unknown);
                    }
                    Some(p) if p + 1 == last && task.attempts[p].outcome.is_none() => {
                        task.attempts[p].answered = true;
                        self.stats.add(if done { Seen::Done } else { Seen::WorkerFailed });
                        if done {
                            self.end_attempt(i, Outcome::Done, None);
                            self.finalize(i, Status::Done, Some(format!("{{\"r\":{k}}}")), None);
                        } else {
                            self.end_attempt(i, Outcome::Failed, Some(format!("boom {k}")));
                        }
                    }
                    Some(p) => {
                        let why = if task.attempts[p].answered { Ignored::Duplicate } else { Ignored::Late };
                        task.attempts[p].answered = true;
                        self.ignored[why as usize] += 1;
                        self.stats.add(if why == Ignored::Late { Seen::Late } else { Seen::Duplicate });
                    }
                }
            }
        }
        self.message(w, &text);
    }

    fn pick_task(&self, t: u8) -> Option<usize> {
        (!self.tasks.is_empty()).then(|| t as usize % self.tasks.len())
    }

    fn cancel(&mut self, t: u8) -> Result<(), Failure> {
        let Some(i) = self.pick_task(t) else {
            let got = self.cancel_core(0x4000_0000_0000_4000_8000_0000_0000_0001)?;
            ensure!(got == CancelResult::NotFound, "cancel", "cancel of an unknown id: {got:?}");
            return Ok(());
        };
        let (gone, status, id) = (self.tasks[i].gone, self.tasks[i].status, self.tasks[i].id);
        let expected = match (gone, status) {
            (Gone::Live, Status::Pending) => {
                self.stats.add(Seen::CancelPending);
                self.finalize(i, Status::Canceled, None, None);
                CancelResult::Canceled
            }
            (Gone::Live, Status::Dispatched) => {
                self.stats.add(Seen::CancelDispatched);
                if let Some(w) = self.tasks[i].open_attempt().map(|a| a.worker) {
                    self.ctx.cancels.push((self.workers[w].conn, id));
                }
                self.end_attempt(i, Outcome::Canceled, None);
                self.finalize(i, Status::Canceled, None, None);
                CancelResult::Canceled
            }
            (Gone::Live, _) => CancelResult::AlreadyFinal,
            // A task that left memory is read back from the journal: final, 409.
            (Gone::Evicted, _) => CancelResult::Later,
            _ => CancelResult::NotFound,
        };
        let id = self.tasks[i].id;
        let got = self.cancel_core(id)?;
        ensure!(got == expected, "cancel", "cancel of task {i}: expected {expected:?}, got {got:?}");
        if got == CancelResult::Later {
            return self.read_back_reply(i, relay::dispatch::DIRECT, 409);
        }
        Ok(())
    }

    fn wait(&mut self, t: u8, post: bool) -> Result<(), Failure> {
        let Some(i) = self.pick_task(t) else { return Ok(()) };
        match self.tasks[i].gone {
            Gone::Live => {}
            // Final: the API answers it at once, from the journal.
            Gone::Evicted => return self.read_back(i),
            _ => return Ok(()),
        }
        self.next_wait_conn += 1;
        let conn = ConnRef { slot: 1_000 + self.next_wait_conn, generation: 1 };
        let id = self.tasks[i].id;
        let immediate = self.core.wait(&mut self.io, conn, id, post);
        // (A database answers a wait on a final task once it read it.)
        let got = if self.tasks[i].status.is_final() { self.answer_for(conn, immediate)? } else { immediate };
        let status = self.tasks[i].status;
        if status.is_final() {
            let code = got.as_ref().map(|r| r.status);
            ensure!(code == Some(Self::final_code(status, post)), "wait", "wait on final task {i}: {code:?}");
        } else {
            ensure!(got.is_none(), "wait", "wait on {status:?} task {i} answered at once");
            self.waiters.push(MWaiter { conn, task: i, post, deadline: self.now + WAIT_TIMEOUT_MS });
        }
        Ok(())
    }

    /// `GET /tasks/{id}` of one of the tasks that left memory.
    fn read(&mut self, t: u8) -> Result<(), Failure> {
        let evicted: Vec<usize> = (0..self.tasks.len()).filter(|&i| self.tasks[i].gone == Gone::Evicted).collect();
        match evicted.get(t as usize % evicted.len().max(1)) {
            Some(&i) => self.read_back(i),
            None => Ok(()),
        }
    }

    /// Task `i` left memory: the answer is read back from the journal, and it is the task's
    /// final JSON, byte for byte.
    fn read_back(&mut self, i: usize) -> Result<(), Failure> {
        self.next_wait_conn += 1;
        let conn = ConnRef { slot: 1_000 + self.next_wait_conn, generation: 1 };
        let id = self.tasks[i].id;
        let at_once = self.core.get_direct(&mut self.io, conn, id);
        ensure!(
            at_once.is_none(),
            "read",
            "task {i} left memory but was answered at once: {:?}",
            at_once.map(|r| r.status)
        );
        self.read_back_reply(i, conn, 200)
    }

    /// The answer for task `i` read back from the journal reaches `conn` with `code`, and it is
    /// the task's final JSON, byte for byte.
    fn read_back_reply(&mut self, i: usize, conn: ConnRef, code: u16) -> Result<(), Failure> {
        // The reader thread answers and would wake the loop; wait for that, with a deadline.
        let deadline = Instant::now() + Duration::from_secs(10);
        let pos = loop {
            self.core.on_wake(&mut self.io);
            if let Some(pos) =
                self.io.events.iter().position(|e| matches!(e, Event::Reply { conn: c, .. } if *c == conn))
            {
                break pos;
            }
            ensure!(Instant::now() < deadline, "read", "the journal's reader never answered for task {i}");
            std::thread::sleep(Duration::from_micros(200));
        };
        if let Event::Reply { status, body, .. } = self.io.events.remove(pos) {
            let body = String::from_utf8_lossy(&body);
            ensure!(status == code, "read", "task {i} read back: {status} {body}");
            let snapshot = self.tasks[i].snapshot.as_deref().unwrap_or_default();
            ensure!(body == snapshot, "final", "task {i} read back changed:\n  was {snapshot}\n  now {body}");
            self.stats.add(Seen::ReadBack);
        }
        Ok(())
    }

    fn close_wait(&mut self, c: u8) {
        if self.waiters.is_empty() {
            return;
        }
        let waiter = self.waiters.swap_remove(c as usize % self.waiters.len());
        self.core.conn_closed(waiter.conn);
    }

    fn full(&mut self, w: u8, full: bool) {
        let Some(w) = self.pick_worker(w) else { return };
        let conn = self.workers[w].conn;
        self.workers[w].full = full;
        if full {
            self.io.full.insert(conn);
        } else {
            self.io.full.remove(&conn);
            self.core.worker_drained(&mut self.io, conn);
        }
    }

    // ----- time --------------------------------------------------------------------------------

    /// The earliest moment something is due in the model.
    fn next_event(&self) -> Option<u64> {
        let ttl = self.cfg.task_ttl_ms;
        let graces = self.workers.iter().filter(|w| w.alive && !w.greeted).map(|w| w.grace_at);
        let tasks = self.tasks.iter().filter(|t| t.known()).filter_map(|t| match t.status {
            Status::Dispatched => t.open_attempt().map(|a| a.started + t.timeout_ms),
            Status::Pending if t.scheduled => Some(t.due),
            Status::Pending if t.attempts.is_empty() => Some(t.expiry_base + ttl),
            Status::Pending => None,
            _ => t.finished.map(|f| f + ttl),
        });
        let waits = self.waiters.iter().map(|w| w.deadline);
        graces.chain(tasks).chain(waits).min()
    }

    /// Time passes: the clock moves from one due moment to the next, as the reactor wakes for
    /// its timers, and each moment is a step.
    fn advance(&mut self, ms: u64) -> Result<(), Failure> {
        let target = self.now + ms;
        while self.now < target {
            let floor = self.now + 1;
            let mut t = target;
            if let Some(e) = self.next_event() {
                t = t.min(e.max(floor));
            }
            if let Some(c) = self.core.wheel.next_wakeup_ms() {
                t = t.min((c + self.mono_base).max(floor));
            }
            self.tick(t)?;
        }
        Ok(())
    }

    fn tick(&mut self, t: u64) -> Result<(), Failure> {
        let ttl = self.cfg.task_ttl_ms;
        self.set_clock(t);
        self.begin_step();
        // What is due at `t`, in the model.
        for w in self.workers.iter_mut().filter(|w| w.alive && !w.greeted && w.grace_at <= t) {
            w.greeted = true;
            self.stats.add(Seen::Grace);
        }
        for i in 0..self.tasks.len() {
            let task = &self.tasks[i];
            if !task.known() {
                continue;
            }
            match task.status {
                Status::Dispatched => {
                    if let Some(a) = task.open_attempt().filter(|a| a.started + task.timeout_ms <= t) {
                        // A timeout sends `cancel` (advisory) and frees the slot at once.
                        self.ctx.cancels.push((self.workers[a.worker].conn, task.id));
                        let error = timeout_error(task.timeout_ms);
                        self.stats.add(Seen::Timeout);
                        self.end_attempt(i, Outcome::Timeout, Some(error));
                    }
                }
                Status::Pending if task.scheduled => {
                    if task.due <= t {
                        self.stats.add(Seen::FellDue);
                        self.tasks[i].scheduled = false;
                        self.ctx.limbo.push(i);
                    }
                }
                Status::Pending => {
                    if task.attempts.is_empty() && task.expiry_base + ttl <= t {
                        self.ctx.expire.push(i);
                    }
                }
                _ => {
                    if task.finished.is_some_and(|f| f + ttl <= t) {
                        self.stats.add(Seen::Forgotten);
                        self.tasks[i].gone = Gone::Forgotten;
                    }
                }
            }
        }
        // Tasks that may expire now are not "waiting" for the order check: the core may expire
        // them before or after it fills a worker in the same moment.
        let expire = self.ctx.expire.clone();
        self.ctx.settled.retain(|i| !expire.contains(i));

        let mut fired = Vec::new();
        self.core.wheel.advance(self.core.now_ms, &mut fired);
        for timer in fired {
            self.core.on_timer(&mut self.io, timer);
        }
        self.end_step()
    }

    // ----- restart -----------------------------------------------------------------------------

    /// relay stops (every record is on disk: a clean stop, or a crash after the last sync) and
    /// starts again `downtime_ms` later from the journal.
    fn restart(&mut self, downtime_ms: u64) -> Result<(), Failure> {
        let _ = self.core.store.stop();
        // (The journal, and the lock on its directory, go with the old store.)
        self.core.store = Store::Mem(Box::new(MemStore::new(Self::mem_config(&self.cfg), None)));
        let wall = self.now + downtime_ms;
        self.core = Self::start_core(&self.cfg, self.dir.as_deref(), wall)?;
        self.io = ModelIo::default();
        self.now = wall;
        self.mono_base = wall;
        self.waiters.clear();
        for w in &mut self.workers {
            w.alive = false;
            w.in_flight.clear();
        }
        self.ignored = [0; 3];
        self.malformed = 0;
        self.attempts_metric = [0; Outcome::COUNT];
        self.finals_metric = [0; 3];
        self.evicted_metric = 0;
        self.stats.add(Seen::Restart);
        let ttl = self.cfg.task_ttl_ms;
        for t in &mut self.tasks {
            // (The new process remembers no attempt it did not end itself.)
            for a in &mut t.attempts {
                a.ended_here = false;
            }
            if !t.known() {
                continue;
            }
            if t.status.is_final() {
                // Finished tasks keep their result until TASK_TTL.
                t.gone = if t.finished.is_some_and(|f| f + ttl <= wall) { Gone::Forgotten } else { Gone::Unsure };
                continue;
            }
            // Unfinished ones wait as pending (no 503: they were accepted); an attempt the
            // restart cut short is closed `disconnect`, saying relay restarted.
            if let Some(a) = t.attempts.last_mut().filter(|a| a.outcome.is_none()) {
                a.outcome = Some(Outcome::Disconnect);
                a.error = Some(RESTART_ERROR.into());
                a.duration = wall - a.started;
                a.restarted = true;
                self.stats.0[Seen::RestartCut as usize] += 1;
            }
            t.status = Status::Pending;
            t.restored = true;
            t.scheduled = t.due > wall;
            // SPEC §7 counts TASK_TTL in the queue from when a task fell due (wall clock), also
            // across a restart.
            t.expiry_base = t.due;
        }
        self.begin_step();
        self.take_snapshots();
        self.observe_evictions()?;
        self.check_snapshots()?;
        self.check()
    }

    // ----- checks ------------------------------------------------------------------------------

    /// A task that just became final: its JSON from now on.
    fn take_snapshots(&mut self) {
        for t in &mut self.tasks {
            if t.status.is_final() && t.snapshot.is_none() {
                let json = match &self.pg {
                    Some(_) => self.db_tasks.get(&t.id).map(|task| {
                        let mut s = String::new();
                        task.write_json(&mut s);
                        s
                    }),
                    None => {
                        let mut s = String::new();
                        self.core.write_task_json(t.id, &mut s).then_some(s)
                    }
                };
                if let Some(json) = json {
                    t.snapshot = Some(json);
                }
            }
        }
    }

    fn check(&self) -> Result<(), Failure> {
        let mut counts = [0usize; Status::COUNT];
        for (i, t) in self.tasks.iter().enumerate() {
            if !t.known() {
                ensure!(
                    self.task_of(t.id).is_none() && self.core.evicted(t.id).is_none(),
                    "expiry",
                    "task {i} should be forgotten (finished {:?}, now {})",
                    t.finished,
                    self.now
                );
                continue;
            }
            counts[t.status.index()] += 1;
            match self.task_of(t.id) {
                Some(ct) => self.check_task(i, t, ct)?,
                None => {
                    let status = self.core.evicted(t.id).map(|e| e.status);
                    ensure!(t.gone == Gone::Evicted, "lost", "task {i} ({:?}) is gone from the core", t.status);
                    ensure!(status == Some(t.status), "final", "evicted task {i}: {status:?}, not {:?}", t.status);
                }
            }
        }
        // Each task in exactly one state, counted once (the /healthz numbers).
        let health = self.core.health_json();
        let Ok(health) = serde_json::from_slice::<Health>(&health) else {
            return Err(Failure {
                step: 0,
                check: "counts",
                detail: format!("/healthz: {}", String::from_utf8_lossy(&health)),
            });
        };
        let h = &health.tasks;
        let shown = [h.pending, h.dispatched, h.done, h.failed, h.canceled];
        for (s, shown) in
            [Status::Pending, Status::Dispatched, Status::Done, Status::Failed, Status::Canceled].into_iter().zip(shown)
        {
            let n = counts[s.index()];
            ensure!(
                self.core.task_count(s) == n,
                "counts",
                "{} {} tasks, the model has {n}",
                self.core.task_count(s),
                s.as_str()
            );
            ensure!(shown == n as u64, "counts", "/healthz says {shown} {}, the model has {n}", s.as_str());
        }
        let mut listed = [0usize; Status::COUNT];
        let mut seen = Vec::new();
        let listed_ids: Vec<TaskId> = match &self.pg {
            Some(_) => self.db_listed.clone(),
            None => self.core.tasks_newest_first(u64::MAX).into_iter().map(|(_, id)| id).collect(),
        };
        for id in listed_ids {
            let status = self.task_of(id).map(|t| t.status).or_else(|| self.core.evicted(id).map(|e| e.status));
            let Some(status) = status else {
                return Err(Failure { step: 0, check: "counts", detail: format!("listed task {id:x} does not exist") });
            };
            listed[status.index()] += 1;
            seen.push(id);
        }
        ensure!(listed == counts, "counts", "the listing counts {listed:?}, the model {counts:?}");
        let mut known: Vec<TaskId> = self.tasks.iter().filter(|t| t.known()).map(|t| t.id).collect();
        known.sort_unstable();
        seen.sort_unstable();
        ensure!(seen == known, "counts", "the listing holds other tasks than the model (or one twice)");

        // Workers, as /clients shows them.
        let clients = self.core.clients_json();
        let Ok(clients) = serde_json::from_slice::<Clients>(&clients) else {
            return Err(Failure {
                step: 0,
                check: "workers",
                detail: format!("/clients: {}", String::from_utf8_lossy(&clients)),
            });
        };
        let alive = self.alive_workers();
        let list = &clients.clients;
        ensure!(list.len() == alive.len(), "workers", "{} workers listed, {} connected", list.len(), alive.len());
        for (entry, &w) in list.iter().zip(&alive) {
            let wk = &self.workers[w];
            let id = relay::tasks::parse_id(entry.client_id);
            ensure!(id == Some(wk.client), "workers", "worker {w} listed as {id:?}");
            ensure!(
                entry.in_flight == wk.in_flight.len() as u64,
                "concurrency",
                "worker {w} runs {} tasks, the model {}",
                entry.in_flight,
                wk.in_flight.len()
            );
            ensure!(entry.active == wk.active(), "workers", "worker {w} active flag");
            ensure!(entry.kinds == wk.kinds, "workers", "worker {w} takes {:?}, the model {:?}", entry.kinds, wk.kinds);
        }
        let active = alive.iter().filter(|&&w| self.workers[w].active()).count();
        ensure!(
            health.clients == alive.len() as u64 && health.active_clients == active as u64,
            "workers",
            "/healthz clients {} active {}, the model {} {active}",
            health.clients,
            health.active_clients,
            alive.len()
        );

        // Nothing that could run waits: a due task and a worker that may take it now are never
        // both idle (a worker whose writes fail is left out: it is about to go).
        for (i, t) in self.tasks.iter().enumerate().filter(|(_, t)| t.waiting()) {
            for (w, wk) in self.workers.iter().enumerate() {
                ensure!(
                    !(wk.may_send(t.kind.as_deref()) && !wk.broken && !t.tried(wk.client)),
                    "idle",
                    "task {i} waits while worker {w} could take it"
                );
            }
        }

        // Counters: late, duplicate and unknown answers are counted, never applied.
        let m = &self.core.metrics;
        ensure!(m.ignored == self.ignored, "ignored", "ignored answers {:?}, the model {:?}", m.ignored, self.ignored);
        ensure!(m.ws_messages_malformed == self.malformed, "metrics", "malformed {}", m.ws_messages_malformed);
        ensure!(
            m.attempts == self.attempts_metric,
            "metrics",
            "attempt outcomes {:?}, the model {:?}",
            m.attempts,
            self.attempts_metric
        );
        ensure!(
            m.tasks_final == self.finals_metric,
            "metrics",
            "finals {:?}, the model {:?}",
            m.tasks_final,
            self.finals_metric
        );
        let evicted = self.core.gauges(0).tasks_evicted;
        ensure!(evicted == self.evicted_metric, "metrics", "evicted {evicted}, the model {}", self.evicted_metric);
        Ok(())
    }

    /// A final task never changes: its whole JSON, byte for byte (every step compares its
    /// fields with the model's frozen copy; this runs at restarts and at the end).
    fn check_snapshots(&self) -> Result<(), Failure> {
        for (i, t) in self.tasks.iter().enumerate() {
            if let (Some(snapshot), Some(ct)) = (&t.snapshot, self.task_of(t.id)) {
                let mut json = String::new();
                ct.write_json(&mut json);
                ensure!(&json == snapshot, "final", "final task {i} changed:\n  was {snapshot}\n  now {json}");
                let v: Value = serde_json::from_str(&json).unwrap_or(Value::Null);
                let log = v["attempt_log"].as_array().map(Vec::len);
                ensure!(
                    v["attempts"].as_u64().map(|n| n as usize) == log && log == Some(t.attempts.len()),
                    "attempts",
                    "task {i}: attempts {} but attempt_log has {log:?}",
                    v["attempts"]
                );
            }
        }
        Ok(())
    }

    /// The end of a sequence.
    pub fn finish(&self) -> Result<(), Failure> {
        self.check_snapshots()
    }

    fn check_task(&self, i: usize, t: &MTask, ct: &Task) -> Result<(), Failure> {
        ensure!(ct.status == t.status, "status", "task {i} is {:?}, the model says {:?}", ct.status, t.status);
        // The core's own shape: distinct workers, at most one open attempt and it is the last,
        // and `dispatched` exactly when one is open.
        let reused =
            ct.attempts.iter().enumerate().any(|(n, a)| ct.attempts[..n].iter().any(|b| b.client_id == a.client_id));
        ensure!(!reused, "attempts", "task {i} reused a worker: {:?}", ct.attempts);
        let open = ct.attempts.iter().filter(|a| a.outcome.is_none()).count();
        let last_open = ct.attempts.last().is_some_and(|a| a.outcome.is_none());
        ensure!(open <= 1 && (open == 0 || last_open), "attempts", "task {i}: {open} open attempts, not only the last");
        ensure!(
            last_open == (ct.status == Status::Dispatched),
            "attempts",
            "task {i} is {:?} with open {last_open}",
            ct.status
        );
        // A task that is done drops its payload; a failed or canceled one keeps it, to be run
        // again (SPEC §13).
        ensure!(
            ct.payload.is_some() != (ct.status == Status::Done),
            "payload",
            "task {i} ({:?}) payload kept {}",
            ct.status,
            ct.payload.is_some()
        );
        // Against the model.
        ensure!(ct.kind.as_deref() == t.kind.as_deref(), "task", "task {i} kind {:?}", ct.kind);
        ensure!(ct.created_wall_ms == t.created, "task", "task {i} created_at");
        // (A database keeps a due time, not whether `run_at` was given: one equal to the
        // submission reads as none; and the task JSON shows neither limit.)
        let run_at = if self.pg.is_some() { t.run_at.filter(|&at| at != t.created) } else { t.run_at };
        ensure!(ct.run_at_wall_ms == run_at, "task", "task {i} run_at {:?}, not {:?}", ct.run_at_wall_ms, run_at);
        ensure!(
            self.pg.is_some() || (ct.max_retries == t.max_retries && ct.timeout_ms == t.timeout_ms),
            "task",
            "task {i} limits"
        );
        ensure!(
            ct.finished_wall_ms == t.finished,
            "task",
            "task {i} finished_at {:?}, not {:?}",
            ct.finished_wall_ms,
            t.finished
        );
        ensure!(
            ct.attempts.len() == t.attempts.len(),
            "attempts",
            "task {i} has {} attempts, the model {}: {:?} vs {:?}",
            ct.attempts.len(),
            t.attempts.len(),
            ct.attempts,
            t.attempts
        );
        for (n, (ca, ma)) in ct.attempts.iter().zip(&t.attempts).enumerate() {
            ensure!(
                ca.client_id == ma.client
                    && ca.outcome == ma.outcome
                    && ca.error.as_deref() == ma.error.as_deref()
                    && ca.started_wall_ms == ma.started
                    && ca.restarted == ma.restarted,
                "attempts",
                "task {i} attempt {}: {ca:?}, the model {ma:?}",
                n + 1
            );
            ensure!(
                ca.outcome.is_none() || ca.duration_ms == ma.duration,
                "attempts",
                "task {i} attempt {} took {} ms, the model {}",
                n + 1,
                ca.duration_ms,
                ma.duration
            );
        }
        let result = ct.result.as_ref().map(|r| r.get().to_string());
        ensure!(result == t.result, "task", "task {i} result {result:?}, not {:?}", t.result);
        ensure!(ct.error.as_deref() == t.error.as_deref(), "task", "task {i} error {:?}, not {:?}", ct.error, t.error);
        Ok(())
    }
}

fn uuid(id: u128) -> String {
    let mut s = String::new();
    relay::tasks::push_uuid(&mut s, id);
    s
}

// ----- running sequences -----------------------------------------------------------------------

/// Runs `ops` from a fresh core; a panic in the core is a failure too.
pub fn run_ops(cfg: &ModelConfig, ops: &[Op]) -> Result<(), Failure> {
    run_counting(cfg, ops, &mut Stats::default())
}

/// [`run_ops`], adding what the run reached to `stats`.
pub fn run_counting(cfg: &ModelConfig, ops: &[Op], stats: &mut Stats) -> Result<(), Failure> {
    run_with(cfg, ops, stats, None)
}

/// [`run_counting`] over the memory store, or over PostgreSQL through `pg`.
pub fn run_with(
    cfg: &ModelConfig,
    ops: &[Op],
    stats: &mut Stats,
    pg: Option<Box<dyn PgBackend>>,
) -> Result<(), Failure> {
    let current = std::cell::Cell::new(0);
    let mut pg = Some(pg);
    let run = std::panic::AssertUnwindSafe(|| {
        let mut h = match pg.take().flatten() {
            Some(backend) => Harness::new_pg(cfg.clone(), backend)?,
            None => Harness::new(cfg.clone())?,
        };
        let result = ops.iter().enumerate().try_for_each(|(step, op)| {
            current.set(step);
            h.apply(op).map_err(|f| Failure { step, ..f })
        });
        let result = result.and_then(|()| h.finish().map_err(|f| Failure { step: ops.len(), ..f }));
        stats.merge(&h.stats);
        result
    });
    std::panic::catch_unwind(run).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        Err(Failure { step: current.get(), check: "panic", detail: what })
    })
}

/// A sequence for PostgreSQL (see [`Harness::new_pg`]): seed `seed`'s configuration without a
/// journal, its tasks kept an hour, and `len` operations for it.
#[allow(dead_code)] // (tests/it/model_pg.rs)
pub fn sequence_pg(seed: u64, len: usize) -> (ModelConfig, Vec<Op>) {
    let mut s = Seeded::new(seed);
    let mut cfg = config_from(&mut s);
    cfg.journal = false;
    cfg.small_segments = false;
    cfg.task_ttl_ms = 3_600_000;
    cfg.task_memory_bytes = 64 << 20;
    let ops = (0..len).map(|_| op_from(&mut s, false)).collect();
    (cfg, ops)
}

/// The configuration and operations of seed `seed` (`len` operations).
pub fn sequence(seed: u64, len: usize) -> (ModelConfig, Vec<Op>) {
    let mut s = Seeded::new(seed);
    let cfg = config_from(&mut s);
    let ops = (0..len).map(|_| op_from(&mut s, cfg.journal)).collect();
    (cfg, ops)
}

/// The fuzzer's entry: a configuration and operations decoded from bytes.
pub fn run_bytes(data: &[u8]) -> Result<(), Failure> {
    let mut s = Bytes { data, pos: 0 };
    let cfg = config_from(&mut s);
    let mut ops = Vec::new();
    while !s.done() && ops.len() < 256 {
        ops.push(op_from(&mut s, cfg.journal));
    }
    run_ops(&cfg, &ops)
}

/// The shortest sub-sequence found (by dropping runs of operations, then single ones) that
/// still fails the same check.
pub fn shrink(cfg: &ModelConfig, ops: &[Op], check: &'static str) -> Vec<Op> {
    let fails = |ops: &[Op]| run_ops(cfg, ops).is_err_and(|f| f.check == check);
    let mut ops = ops.to_vec();
    let mut chunk = ops.len().div_ceil(2).max(1);
    loop {
        let mut i = 0;
        while i < ops.len() {
            let mut candidate = ops.clone();
            candidate.drain(i..(i + chunk).min(ops.len()));
            if fails(&candidate) {
                ops = candidate;
            } else {
                i += chunk;
            }
        }
        if chunk == 1 {
            break;
        }
        chunk = chunk.div_ceil(2);
    }
    ops
}

/// Runs one seed; on failure, panics with the seed, the failure and the shrunk sequence.
pub fn check_seed(seed: u64, len: usize, stats: &mut Stats) {
    let (cfg, ops) = sequence(seed, len);
    if let Err(first) = run_counting(&cfg, &ops, stats) {
        let steps = first.step.saturating_add(1).min(ops.len());
        let minimal = shrink(&cfg, &ops[..steps], first.check);
        let last = run_ops(&cfg, &minimal).err();
        panic!(
            "dispatch model: seed {seed:#x} failed\n  {first}\nminimal sequence ({} of {steps} operations){}:\n\
             run_ops(&{cfg:?}, &{minimal:?})",
            minimal.len(),
            last.map_or_else(String::new, |f| format!(", failing with\n  {f}\n"))
        );
    }
}

// ----- cargo test --------------------------------------------------------------------------------
