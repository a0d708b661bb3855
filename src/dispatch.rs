//! The relay's brain, without I/O: the task table, the connected workers, the pending queues,
//! round-robin choice, attempts, fallback, waiters and expiry.
//!
//! Every task status change goes through `set_status` (one place for a future journal record).
//! Output leaves only through the [`Io`] trait (a frame for a worker, a reply for a held HTTP
//! request), and time comes in through `now_ms`/`wall_ms`, which the reactor sets. Nothing here
//! may close a connection or read a clock.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::hash::BuildHasherDefault;
use std::net::IpAddr;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::auth::Identity;
use crate::http::Response;
use crate::journal::Journal;
use crate::journal::codec::{self as journal_codec, FrameAt, RESTART_ERROR, Record};
use crate::journal::replay::Replayed;
use crate::journal::thread::ReadDone;
use crate::log::Level;
use crate::metrics::{Gauges, Ignored, Metrics};
use crate::tasks::{
    Attempt, ConnRef, Evicted, IdHasher, Outcome, Place, Status, Stored, Task, TaskId, TaskTable, kind_hash,
    push_json_str, push_uuid, uuid_string,
};
use crate::timefmt::write_rfc3339_ms;
use crate::timer::{TimerHandle, Wheel};
use reach::{Accepts, Fragile, Reach};

/// What the reactor does for the core.
pub trait Io {
    /// Queues one text frame for a worker whose content is `parts` concatenated (so the frame
    /// needs no intermediate string); `false` if it cannot be written (the connection failed or
    /// is closing), which makes the attempt `send_failed`.
    fn send_text(&mut self, worker: ConnRef, parts: &[&str]) -> bool;
    /// Whether a frame of about `bytes` fits in the worker's output buffer now. A worker whose
    /// buffer is full is not eligible until it drains (SPEC §5), and the reactor then calls
    /// [`Core::worker_drained`]; it never costs an attempt. (An `Io` without a buffer cap
    /// always has room.)
    fn has_room(&mut self, worker: ConnRef, bytes: usize) -> bool {
        let _ = (worker, bytes);
        true
    }
    /// Completes an HTTP request that was held (`wait=true`).
    fn reply(&mut self, conn: ConnRef, response: Response);
}

/// Timer wheel payloads, for the core and the reactor alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timer {
    /// The reactor's per-connection deadline (header, idle, ping, linger).
    Conn(ConnRef),
    Attempt {
        task: TaskId,
        num: u32,
    },
    Wait(ConnRef),
    /// A new worker's [`HELLO_GRACE_MS`] is over.
    HelloGrace(ConnRef),
    Schedule,
    Sweep,
    /// The reactor stopped accepting after EMFILE; try again.
    AcceptResume,
    /// A stored file reached BLOB_TTL.
    BlobExpire(u128),
    /// The hourly clean-up of BLOB_DIR.
    BlobSweep,
    ShutdownDeadline,
    /// Cluster mode: the node's periodic refreshes and slow poll.
    ClusterTick,
}

/// (token identity, `Idempotency-Key` header).
type IdempotencyKey = (Box<str>, Box<str>);
type IdSet = HashSet<TaskId, BuildHasherDefault<IdHasher>>;

/// The round-robin cursor key of tasks without a kind (not a string a kind can be).
const NO_KIND: &str = "\u{0}";
/// Round-robin cursors kept at most (kinds come from clients; the map must stay bounded).
const MAX_CURSORS: usize = 4096;

/// How far one search of a pending queue may look for a task a worker has not tried yet.
const MAX_QUEUE_SCAN: usize = 4096;

/// Bytes of a task frame besides its payload (type, task id, braces, WebSocket header).
const TASK_FRAME_OVERHEAD_BYTES: usize = 80;

/// A new worker connection is sent nothing until its first text message is read, or until
/// this long has passed without one (SPEC §5): a worker that says hello is never sent a task
/// it did not ask for, and one that never does is served as the seed protocol says.
pub const HELLO_GRACE_MS: u64 = 1_000;

#[derive(Debug, Clone)]
pub struct CoreConfig {
    pub task_timeout_ms: u64,
    pub max_retries: u32,
    pub wait_timeout_ms: u64,
    pub task_ttl_ms: u64,
    pub max_pending: usize,
    /// Memory for finished tasks (`TASK_MEMORY`); beyond it the oldest leave memory.
    pub task_memory_bytes: usize,
    /// Payload bytes (JSON text as received) of the tasks waiting as pending, at most.
    pub max_pending_bytes: usize,
}

/// Where tasks are kept durable.
pub enum Storage {
    /// Nowhere: a restart forgets everything (`DATA_DIR` empty).
    Memory,
    Journal(Box<Journal>),
    /// Cluster mode (SPEC §11): PostgreSQL, shared with the other nodes (`cluster.rs`).
    Cluster(Box<crate::cluster::node::Node>),
}

/// Which record a task change needs.
#[derive(Clone, Copy)]
enum Rec {
    Whole,
    AttemptStarted,
    AttemptEnded,
}

/// How a task read back from the journal is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadFor {
    /// `GET /tasks/{id}` (also with `wait=true`: the task is final): 200.
    Get,
    /// A submit with `wait=true` whose idempotency key names a finished task: its status.
    PostWait,
    /// `DELETE`: the task is final already, 409.
    Cancel,
    /// One task of a listing page (`GET /tasks`): `page` names it, `index` is its place.
    Page { page: u64, index: usize },
}

/// A listing page waiting for tasks read back from the journal.
struct PendingPage {
    conn: ConnRef,
    pieces: Vec<Option<String>>,
    missing: usize,
    next: Option<u64>,
    lsn: u64,
    /// The page's `kind` filter, checked exactly once a task is read back.
    kind: Option<String>,
}

struct PendingRead {
    conn: ConnRef,
    id: TaskId,
    purpose: ReadFor,
    identity: Identity,
}

/// Tasks carried forward by one compaction step (bounded work per loop turn).
const COMPACT_TASKS_PER_TURN: usize = 4096;
/// Finished tasks evicted from memory per loop turn at most.
const EVICT_PER_TURN: usize = 8192;

#[derive(Debug)]
struct Worker {
    conn: ConnRef,
    client_id: u128,
    ip: IpAddr,
    connected_wall_ms: u64,
    /// `None` (no hello, or a hello without kinds): every kind.
    kinds: Option<Vec<Box<str>>>,
    /// `None`: unlimited (the seed protocol). `Some(0)`: draining.
    concurrency: Option<u32>,
    version: Option<Box<str>>,
    in_flight: Vec<TaskId>,
    /// Its first text message was read, or [`HELLO_GRACE_MS`] passed: it may be sent tasks.
    greeted: bool,
    /// Cluster mode: its last claim found fewer tasks than it asked for; no claim for it until
    /// tasks are queued somewhere (a notification) or the slow poll.
    claim_starved: bool,
}

impl Worker {
    fn active(&self) -> bool {
        self.concurrency != Some(0)
    }
    /// May be sent a task now (capacity and kind aside).
    fn ready(&self) -> bool {
        self.greeted && self.active()
    }
    fn accepts(&self, kind: Option<&str>) -> bool {
        match &self.kinds {
            None => true,
            Some(kinds) => kind.is_some_and(|k| kinds.iter().any(|own| &**own == k)),
        }
    }
    fn acceptance(&self) -> Accepts {
        Accepts::of(self.active(), self.kinds.as_deref())
    }
    fn has_capacity(&self) -> bool {
        self.concurrency.is_none_or(|c| self.in_flight.len() < c as usize)
    }
}

struct Held {
    task: TaskId,
    post: bool,
    timer: TimerHandle,
}

/// A new task as the API hands it over (already validated and authorised).
pub struct NewTask<'a> {
    pub payload: &'a RawValue,
    pub kind: Option<&'a str>,
    pub run_at_wall_ms: Option<u64>,
    pub queue: bool,
    pub timeout_ms: Option<u64>,
    pub max_retries: Option<u32>,
    /// (token identity, Idempotency-Key).
    pub idempotency: Option<(&'a str, &'a str)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    /// 503: no connected worker could ever take it.
    NoWorker,
    /// 429: MAX_PENDING tasks, or MAX_PENDING_BYTES of payload, already wait.
    QueueFull,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelResult {
    Canceled,
    AlreadyFinal,
    NotFound,
}

/// Small, fast, non-cryptographic generator for task ids (xoshiro256**), seeded from the OS.
struct Rng([u64; 4]);

impl Rng {
    fn from_os() -> Rng {
        let a = uuid::Uuid::new_v4().as_u128();
        let b = uuid::Uuid::new_v4().as_u128();
        Rng([a as u64 | 1, (a >> 64) as u64, b as u64, (b >> 64) as u64])
    }
    fn next(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }
    /// A random version-4 UUID.
    fn uuid(&mut self) -> u128 {
        let raw = (u128::from(self.next()) << 64) | u128::from(self.next());
        (raw & !(0xF << 76) & !(0x3 << 62)) | (0x4 << 76) | (0x2 << 62)
    }
}

#[derive(Deserialize)]
struct Incoming<'a> {
    #[serde(rename = "type", borrow)]
    kind: std::borrow::Cow<'a, str>,
    #[serde(borrow, default)]
    task_id: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    status: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    data: Option<&'a RawValue>,
    // (Borrowed: a long error is cut, not copied whole first.)
    #[serde(borrow, default)]
    error: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    kinds: Option<Vec<String>>,
    #[serde(default)]
    concurrency: Option<u64>,
    #[serde(default)]
    version: Option<String>,
}

pub struct Core {
    cfg: CoreConfig,
    pub wheel: Wheel<Timer>,
    pub metrics: Metrics,
    /// Monotonic and wall clock of the current loop iteration (set by the reactor).
    pub now_ms: u64,
    pub wall_ms: u64,
    started_mono_ms: u64,
    pub shutting_down: bool,
    tasks: TaskTable,
    status_counts: [usize; Status::COUNT],
    /// Payload bytes of the tasks whose status is pending (bounded by MAX_PENDING_BYTES).
    pending_bytes: usize,
    workers: Vec<Option<Worker>>,
    /// Slots of connected workers, in connection order (the round-robin ring).
    order: Vec<u32>,
    /// Round-robin position per kind (key [`NO_KIND`]: tasks without a kind).
    cursors: HashMap<Box<str>, usize>,
    ready_all: BTreeMap<u64, TaskId>,
    ready_kind: HashMap<Box<str>, BTreeMap<u64, TaskId>>,
    /// Ready tasks that fail when no untried worker that could take them is connected:
    /// retries, and first attempts of tasks submitted without `queue` or a schedule.
    fragile: Fragile,
    /// How many active workers take each kind.
    reach: Reach,
    scheduled: BTreeMap<(u64, u64), TaskId>,
    schedule_timer: Option<(u64, TimerHandle)>,
    sweep_timer: Option<(u64, TimerHandle)>,
    /// Final tasks in finishing order, with the time they are forgotten.
    finished: VecDeque<(u64, TaskId)>,
    idempotency: HashMap<IdempotencyKey, TaskId>,
    idempotency_expiry: VecDeque<(u64, IdempotencyKey)>,
    held: HashMap<ConnRef, Held>,
    /// Every known task by its submission sequence number (`Task::submit_seq`), for the
    /// listing (`GET /tasks`, newest first). Maintained where tasks are inserted and forgotten.
    by_submission: BTreeMap<u64, TaskId>,
    next_seq: u64,
    rng: Rng,
    pub storage: Storage,
    /// Finished tasks that left memory; read back from the journal on demand.
    evicted: HashMap<TaskId, Evicted, BuildHasherDefault<IdHasher>>,
    /// Memory held by finished tasks still in `tasks` (estimate, see `Task::mem_bytes`).
    finished_mem: usize,
    /// Index into `finished` of the oldest task that may still be in memory.
    evict_next: usize,
    reads: HashMap<u64, PendingRead>,
    pages: HashMap<u64, PendingPage>,
    next_read: u64,
    /// Compaction: the stale segment being cleared and the next task-table shard to scan.
    compacting: Option<(u32, usize)>,
    /// The newest stale segment a finished compaction pass cleared.
    compacted_upto: u32,
    logged_forgetting: bool,
}

impl Core {
    pub fn new(cfg: CoreConfig, now_ms: u64, wall_ms: u64) -> Core {
        Core {
            cfg,
            wheel: Wheel::new(4096, now_ms),
            metrics: Metrics::new(),
            now_ms,
            wall_ms,
            started_mono_ms: now_ms,
            shutting_down: false,
            tasks: TaskTable::default(),
            status_counts: [0; Status::COUNT],
            pending_bytes: 0,
            workers: Vec::new(),
            order: Vec::new(),
            cursors: HashMap::new(),
            ready_all: BTreeMap::new(),
            ready_kind: HashMap::new(),
            fragile: Fragile::default(),
            reach: Reach::default(),
            scheduled: BTreeMap::new(),
            schedule_timer: None,
            sweep_timer: None,
            finished: VecDeque::new(),
            idempotency: HashMap::new(),
            idempotency_expiry: VecDeque::new(),
            held: HashMap::new(),
            by_submission: BTreeMap::new(),
            next_seq: 1,
            rng: Rng::from_os(),
            storage: Storage::Memory,
            evicted: HashMap::default(),
            finished_mem: 0,
            evict_next: 0,
            reads: HashMap::new(),
            pages: HashMap::new(),
            next_read: 1,
            compacting: None,
            compacted_upto: 0,
            logged_forgetting: false,
        }
    }

    // ----- queries -------------------------------------------------------------------------

    pub fn task(&self, id: TaskId) -> Option<&Task> {
        self.tasks.get(&id)
    }

    /// Tasks by submission, newest first, starting strictly below submission number `below`
    /// (`u64::MAX`: from the newest). Each item is `(submit_seq, task id)`; see `listing`.
    pub fn tasks_newest_first(&self, below: u64) -> impl Iterator<Item = (u64, TaskId)> + '_ {
        self.by_submission.range(..below).rev().map(|(&seq, &id)| (seq, id))
    }

    pub fn task_count(&self, status: Status) -> usize {
        self.status_counts[status.index()]
    }

    pub fn workers_connected(&self) -> usize {
        self.order.len()
    }

    pub fn workers_active(&self) -> usize {
        self.order.iter().filter(|&&slot| self.worker(slot).is_some_and(Worker::active)).count()
    }

    pub fn gauges(&self, connections_open: usize) -> Gauges {
        Gauges {
            workers_connected: self.workers_connected(),
            workers_active: self.workers_active(),
            tasks_pending: self.task_count(Status::Pending),
            tasks_dispatched: self.task_count(Status::Dispatched),
            connections_open,
            finished_memory_bytes: self.finished_mem,
            tasks_on_disk: self.evicted.len(),
            journal: self.journal().map(|j| crate::metrics::JournalGauges {
                bytes: j.disk_bytes(),
                segments: j.segment_count(),
                backlog_bytes: j.backlog_bytes(),
                syncs: j.syncs(),
                records: j.records_written,
                corrupt_records: j.records_skipped_at_start,
                full: !j.writable(),
                deletes_failing: j.deletes_failing(),
            }),
            cluster: self.node().map(|n| crate::metrics::ClusterGauges {
                up: n.db.health() == crate::cluster::db::Health::Ok,
                committed: n.stats.committed,
                refused: n.stats.refused,
                lost: n.stats.lost,
                unreachable: n.stats.unreachable,
                statements: n.stats.statements,
                background: n.db.background_transactions(),
                tasks_inserted: n.stats.tasks_inserted,
                tasks_claimed: n.stats.tasks_claimed,
                attempts_ended: n.stats.attempts_ended,
                fenced: n.stats.fenced,
            }),
        }
    }

    /// Is any connected worker able to take a task of `kind` at all (capacity aside)?
    pub fn can_ever_take(&self, kind: Option<&str>) -> bool {
        self.reach.count(kind) > 0
    }

    #[cfg(test)]
    pub fn has_held(&self) -> bool {
        !self.held.is_empty()
    }

    fn worker(&self, slot: u32) -> Option<&Worker> {
        self.workers.get(slot as usize).and_then(Option::as_ref)
    }

    fn worker_at(&self, conn: ConnRef) -> Option<&Worker> {
        self.worker(conn.slot).filter(|w| w.conn == conn)
    }

    fn worker_at_mut(&mut self, conn: ConnRef) -> Option<&mut Worker> {
        self.workers.get_mut(conn.slot as usize).and_then(Option::as_mut).filter(|w| w.conn == conn)
    }

    /// Appends the task JSON for `id`.
    pub fn write_task_json(&self, id: TaskId, out: &mut String) -> bool {
        match self.tasks.get(&id) {
            Some(task) => {
                task.write_json(out);
                true
            }
            None => false,
        }
    }

    pub fn clients_json(&self) -> Vec<u8> {
        let mut s = String::with_capacity(64 + self.order.len() * 200);
        s.push_str("{\"count\":");
        s.push_str(&self.order.len().to_string());
        s.push_str(",\"clients\":[");
        for (i, w) in self.order.iter().filter_map(|&slot| self.worker(slot)).enumerate() {
            if i > 0 {
                s.push(',');
            }
            write_worker_json(w, &mut s, None);
        }
        s.push_str("]}");
        s.into_bytes()
    }

    pub fn health_json(&self) -> Vec<u8> {
        let c = |st: Status| self.task_count(st);
        // With a journal, its state: a full disk makes relay unavailable for writes (503).
        let (status, journal) = match self.journal() {
            Some(j) if !j.writable() => ("unavailable", ",\"journal\":\"full\""),
            Some(_) => ("ok", ",\"journal\":\"ok\""),
            None => ("ok", ""),
        };
        format!(
            "{{\"status\":\"{status}\"{journal},\"clients\":{},\"active_clients\":{},\"tasks\":{{\"pending\":{},\"dispatched\":{},\
             \"done\":{},\"failed\":{},\"canceled\":{}}},\"uptime_s\":{}}}",
            self.workers_connected(),
            self.workers_active(),
            c(Status::Pending),
            c(Status::Dispatched),
            c(Status::Done),
            c(Status::Failed),
            c(Status::Canceled),
            (self.now_ms - self.started_mono_ms) / 1000
        )
        .into_bytes()
    }

    // ----- submit, wait, cancel ------------------------------------------------------------

    /// Accepts a task (or finds the one an idempotency key already names). Returns its id.
    pub fn submit(&mut self, io: &mut dyn Io, new: NewTask<'_>) -> Result<TaskId, SubmitError> {
        if let Some((owner, key)) = new.idempotency
            && let Some(id) = self.idempotent_task(owner, key)
        {
            return Ok(id);
        }
        let due_mono_ms = match new.run_at_wall_ms {
            Some(at) if at > self.wall_ms => self.now_ms + (at - self.wall_ms),
            _ => self.now_ms,
        };
        let scheduled = due_mono_ms > self.now_ms;
        let frame_bytes = new.payload.get().len() + TASK_FRAME_OVERHEAD_BYTES;
        let worker_now = if scheduled { None } else { self.pick_for(io, new.kind, &[], frame_bytes) };
        if worker_now.is_none() {
            // A `run_at` in the past is a scheduled task due now: it waits, never 503 (SPEC §7).
            let waits = new.queue || new.run_at_wall_ms.is_some();
            if !scheduled && !waits && !self.can_ever_take(new.kind) {
                return Err(SubmitError::NoWorker);
            }
            if self.task_count(Status::Pending) >= self.cfg.max_pending
                || self.pending_bytes + new.payload.get().len() > self.cfg.max_pending_bytes
            {
                return Err(SubmitError::QueueFull);
            }
        }

        let mut id = self.rng.uuid();
        while self.tasks.contains_key(&id) || self.evicted.contains_key(&id) {
            id = self.rng.uuid();
        }
        let seq = self.take_seq();
        let task = Task {
            id,
            status: Status::Pending,
            kind: new.kind.map(Box::from),
            payload: Some(new.payload.to_owned()),
            created_wall_ms: self.wall_ms,
            created_mono_ms: self.now_ms,
            run_at_wall_ms: new.run_at_wall_ms,
            due_mono_ms,
            finished_wall_ms: None,
            result: None,
            error: None,
            attempts: Vec::new(),
            max_retries: new.max_retries.unwrap_or(self.cfg.max_retries),
            timeout_ms: new.timeout_ms.unwrap_or(self.cfg.task_timeout_ms),
            seq,
            place: Place::Nowhere,
            queued: new.queue || new.run_at_wall_ms.is_some(),
            attempt_timer: None,
            waiters: Vec::new(),
            restored: false,
            submit_seq: seq,
            idempotency: new.idempotency.map(|(owner, key)| Box::new((Box::from(owner), Box::from(key)))),
            stored: Stored::default(),
        };
        self.tasks.insert(id, task);
        self.record(id, Rec::Whole);
        self.by_submission.insert(seq, id);
        self.status_counts[Status::Pending.index()] += 1;
        self.pending_bytes += new.payload.get().len();
        crate::log!(Level::Debug, "task accepted", task_id = uuid_string(id), kind = new.kind.unwrap_or("-"));

        if let Some((owner, key)) = new.idempotency {
            let k = (Box::<str>::from(owner), Box::<str>::from(key));
            self.idempotency.insert(k.clone(), id);
            let expires = self.now_ms + self.cfg.task_ttl_ms;
            self.idempotency_expiry.push_back((expires, k));
            self.ensure_sweep(expires);
        }

        match worker_now {
            Some(slot) if self.dispatch(io, id, slot) => {}
            Some(_) => self.run(io, id),
            None if scheduled => self.schedule(id),
            None => self.enqueue_ready(id),
        }
        Ok(id)
    }

    /// The task an `Idempotency-Key` of this token identity already names, if it still exists.
    pub fn idempotent_task(&self, owner: &str, key: &str) -> Option<TaskId> {
        let id = *self.idempotency.get(&(Box::from(owner), Box::from(key)))?;
        (self.tasks.contains_key(&id) || self.evicted.contains_key(&id)).then_some(id)
    }

    /// Blocks `conn` until `id` is final or WAIT_TIMEOUT passes. Returns the response at once
    /// when there is nothing to wait for.
    pub fn wait(&mut self, conn: ConnRef, id: TaskId, post: bool) -> Option<Response> {
        let task = self.tasks.get_mut(&id)?;
        if task.status.is_final() || self.shutting_down {
            return Some(task_response(task, post));
        }
        task.waiters.push(conn);
        let timer = self.wheel.arm(self.now_ms + self.cfg.wait_timeout_ms, Timer::Wait(conn));
        self.held.insert(conn, Held { task: id, post, timer });
        None
    }

    pub fn cancel(&mut self, io: &mut dyn Io, id: TaskId) -> CancelResult {
        let Some(task) = self.tasks.get(&id) else { return CancelResult::NotFound };
        match task.status {
            Status::Pending => {
                self.unqueue(id);
                self.finalize(io, id, Status::Canceled, None, None);
            }
            Status::Dispatched => {
                let worker = task.current_attempt().map(|a| a.worker);
                self.end_attempt(id, Outcome::Canceled, None);
                if let Some(w) = worker {
                    send_cancel(io, w, id);
                }
                self.finalize(io, id, Status::Canceled, None, None);
                if let Some(w) = worker {
                    self.fill(io, w.slot);
                }
            }
            _ => return CancelResult::AlreadyFinal,
        }
        CancelResult::Canceled
    }

    /// An HTTP connection went away: forget its wait.
    pub fn conn_closed(&mut self, conn: ConnRef) {
        self.cluster_conn_closed(conn);
        if let Some(held) = self.held.remove(&conn) {
            self.wheel.cancel(held.timer);
            if let Some(task) = self.tasks.get_mut(&held.task) {
                task.waiters.retain(|c| *c != conn);
            }
        }
    }

    /// Shutdown: every waiting request gets the task as it is now.
    pub fn release_waiters(&mut self, io: &mut dyn Io) {
        self.cluster_release_all();
        let conns: Vec<ConnRef> = self.held.keys().copied().collect();
        for conn in conns {
            self.release_wait(io, conn);
        }
    }

    fn release_wait(&mut self, io: &mut dyn Io, conn: ConnRef) {
        let Some(held) = self.held.remove(&conn) else { return };
        self.wheel.cancel(held.timer);
        if let Some(task) = self.tasks.get_mut(&held.task) {
            task.waiters.retain(|c| *c != conn);
            let response = task_response(task, held.post);
            self.metrics.http_request(response.status);
            io.reply(conn, response);
        }
    }

    // ----- workers -------------------------------------------------------------------------

    /// A worker's WebSocket is open. Returns its client id.
    pub fn worker_connected(&mut self, _io: &mut dyn Io, conn: ConnRef, ip: IpAddr) -> u128 {
        let client_id = uuid::Uuid::new_v4().as_u128();
        let slot = conn.slot as usize;
        if self.workers.len() <= slot {
            self.workers.resize_with(slot + 1, || None);
        }
        self.workers[slot] = Some(Worker {
            conn,
            client_id,
            ip,
            connected_wall_ms: self.wall_ms,
            kinds: None,
            concurrency: None,
            version: None,
            in_flight: Vec::new(),
            greeted: false,
            claim_starved: false,
        });
        self.reach.add(&Accepts::All);
        self.order.push(conn.slot);
        crate::log!(Level::Info, "worker connected", client_id = uuid_string(client_id), ip = ip);
        // Nothing is sent before its hello (or the grace) says what it takes.
        self.wheel.arm(self.now_ms + HELLO_GRACE_MS, Timer::HelloGrace(conn));
        self.cluster_worker_changed(client_id);
        client_id
    }

    /// The worker may be sent tasks from now on (first text message, or the grace is over).
    fn greet(&mut self, io: &mut dyn Io, conn: ConnRef) {
        if let Some(w) = self.worker_at_mut(conn)
            && !w.greeted
        {
            w.greeted = true;
            self.fill(io, conn.slot);
        }
    }

    /// A worker's output buffer drained after `Io::has_room` said it was full: fill it.
    pub fn worker_drained(&mut self, io: &mut dyn Io, conn: ConnRef) {
        if self.worker_at(conn).is_some() {
            self.fill(io, conn.slot);
        }
    }

    /// A worker's connection is gone (closed, dead, or failed): its attempts end `disconnect`.
    pub fn worker_disconnected(&mut self, io: &mut dyn Io, conn: ConnRef, why: &str) {
        let Some(worker) = self.workers.get_mut(conn.slot as usize).and_then(Option::take) else { return };
        if worker.conn != conn {
            self.workers[conn.slot as usize] = Some(worker);
            return;
        }
        self.order.retain(|&s| s != conn.slot);
        let before = worker.acceptance();
        self.reach.remove(&before);
        crate::log!(
            Level::Info,
            "worker disconnected",
            client_id = uuid_string(worker.client_id),
            ip = worker.ip,
            reason = why,
            in_flight = worker.in_flight.len()
        );
        self.cluster_worker_gone(worker.client_id);
        for &id in &worker.in_flight {
            self.end_attempt(id, Outcome::Disconnect, Some("worker disconnected"));
        }
        for id in worker.in_flight {
            self.run(io, id);
        }
        self.recheck_fragile(io, &before, &Accepts::Nothing);
    }

    /// One text message from a worker.
    pub fn worker_message(&mut self, io: &mut dyn Io, conn: ConnRef, text: &str) {
        // Any first text message, hello or not, ends the wait (a hello is applied first, so its
        // kinds and concurrency decide the first fill).
        let first = self.worker_at(conn).is_some_and(|w| !w.greeted);
        self.on_message(io, conn, text);
        if first {
            self.greet(io, conn);
        }
    }

    fn on_message(&mut self, io: &mut dyn Io, conn: ConnRef, text: &str) {
        let msg: Incoming = match serde_json::from_str(text) {
            Ok(m) => m,
            Err(e) => {
                self.metrics.ws_messages_malformed += 1;
                crate::log!(Level::Warn, "malformed worker message ignored", error = e);
                return;
            }
        };
        match &*msg.kind {
            "result" => {
                let id = msg.task_id.as_deref().and_then(crate::tasks::parse_id);
                let outcome = match msg.status.as_deref() {
                    Some("done") => Ok(msg.data.map(RawValue::to_owned)),
                    // Cut to 64 KiB (SPEC §7): the attempt log holds every one, and the journal's
                    // record of the task holds the log.
                    Some("failed") => Err(msg.error.as_deref().map_or_else(
                        || "worker reported failure".into(),
                        |e| journal_codec::cut_error(e).into_owned(),
                    )),
                    _ => {
                        self.metrics.ws_messages_malformed += 1;
                        crate::log!(Level::Warn, "result without status done/failed ignored");
                        return;
                    }
                };
                match id {
                    Some(id) => self.on_result(io, conn, id, outcome),
                    None => {
                        self.metrics.ws_messages_malformed += 1;
                        crate::log!(Level::Warn, "result without a valid task_id ignored");
                    }
                }
            }
            "hello" => self.on_hello(io, conn, msg.kinds, msg.concurrency, msg.version),
            other => {
                self.metrics.ws_messages_malformed += 1;
                crate::log!(Level::Warn, "unknown worker message type ignored", r#type = other);
            }
        }
    }

    fn on_hello(
        &mut self,
        io: &mut dyn Io,
        conn: ConnRef,
        kinds: Option<Vec<String>>,
        concurrency: Option<u64>,
        version: Option<String>,
    ) {
        let Some(w) = self.worker_at_mut(conn) else { return };
        let before = w.acceptance();
        w.kinds = kinds.map(|ks| ks.into_iter().map(Box::from).collect());
        w.concurrency = concurrency.map(|c| u32::try_from(c).unwrap_or(u32::MAX));
        w.version = version.map(Box::from);
        let after = w.acceptance();
        w.claim_starved = false;
        let client_id = w.client_id;
        crate::log!(
            Level::Info,
            "worker hello",
            client_id = uuid_string(w.client_id),
            kinds = w.kinds.as_ref().map_or("*".to_string(), |k| k.join(",")),
            concurrency = w.concurrency.map_or("unlimited".to_string(), |c| c.to_string())
        );
        if before != after {
            self.reach.remove(&before);
            self.reach.add(&after);
            self.recheck_fragile(io, &before, &after);
        }
        self.cluster_worker_changed(client_id);
        self.fill(io, conn.slot);
    }

    fn on_result(
        &mut self,
        io: &mut dyn Io,
        conn: ConnRef,
        id: TaskId,
        outcome: Result<Option<Box<RawValue>>, String>,
    ) {
        let Some(client_id) = self.worker_at(conn).map(|w| w.client_id) else { return };
        let Some(task) = self.tasks.get_mut(&id) else {
            // (Cluster mode forgets a task once its attempt ended here.)
            let why = self.cluster_stray_result(id, client_id).unwrap_or(Ignored::Unknown);
            self.metrics.ignored(why);
            return;
        };
        let Some(index) = task.attempts.iter().rposition(|a| a.client_id == client_id) else {
            self.metrics.ignored(Ignored::Unknown);
            return;
        };
        let current = index + 1 == task.attempts.len()
            && task.attempts[index].outcome.is_none()
            && task.status == Status::Dispatched;
        let attempt = &mut task.attempts[index];
        if !current {
            let why = if attempt.answered { Ignored::Duplicate } else { Ignored::Late };
            attempt.answered = true;
            self.metrics.ignored(why);
            crate::log!(Level::Debug, "result ignored", task_id = uuid_string(id), reason = format!("{why:?}"));
            return;
        }
        attempt.answered = true;
        match outcome {
            Ok(data) => {
                self.end_attempt(id, Outcome::Done, None);
                let result = data.or_else(|| RawValue::from_string("null".into()).ok());
                self.finalize(io, id, Status::Done, result, None);
            }
            Err(error) => {
                self.end_attempt(id, Outcome::Failed, Some(&error));
                self.run(io, id);
            }
        }
        self.fill(io, conn.slot);
    }

    // ----- timers --------------------------------------------------------------------------

    /// A core timer fired (the reactor handles `Conn`, `AcceptResume` and `ShutdownDeadline`).
    pub fn on_timer(&mut self, io: &mut dyn Io, timer: Timer) {
        match timer {
            Timer::Attempt { task, num } => self.on_attempt_timeout(io, task, num),
            Timer::Wait(conn) if self.is_cluster() => self.cluster_release(conn),
            Timer::Wait(conn) => self.release_wait(io, conn),
            Timer::HelloGrace(conn) => self.greet(io, conn),
            // Cluster mode: a task submitted here fell due; idle workers look for it.
            Timer::Schedule if self.is_cluster() => self.cluster_due(),
            Timer::Schedule => {
                self.schedule_timer = None;
                self.on_schedule(io);
            }
            Timer::ClusterTick => self.cluster_tick(),
            Timer::Sweep => {
                self.sweep_timer = None;
                self.on_sweep(io);
            }
            Timer::Conn(_)
            | Timer::AcceptResume
            | Timer::BlobExpire(_)
            | Timer::BlobSweep
            | Timer::ShutdownDeadline => {}
        }
    }

    fn on_attempt_timeout(&mut self, io: &mut dyn Io, id: TaskId, num: u32) {
        let Some(task) = self.tasks.get_mut(&id) else { return };
        if task.status != Status::Dispatched || task.attempts.len() != num as usize {
            return;
        }
        task.attempt_timer = None;
        let Some(worker) = task.current_attempt().filter(|a| a.outcome.is_none()).map(|a| a.worker) else { return };
        let error = format!("no answer within {}", human_ms(task.timeout_ms));
        self.end_attempt(id, Outcome::Timeout, Some(&error));
        // Advisory: the worker may stop; its slot is free again either way.
        send_cancel(io, worker, id);
        self.run(io, id);
        self.fill(io, worker.slot);
    }

    fn on_schedule(&mut self, io: &mut dyn Io) {
        while let Some((&(due, seq), &id)) = self.scheduled.first_key_value() {
            if due > self.now_ms {
                break;
            }
            self.scheduled.remove(&(due, seq));
            let new_seq = self.take_seq();
            if let Some(task) = self.tasks.get_mut(&id) {
                task.place = Place::Nowhere;
                task.seq = new_seq;
                self.run(io, id);
            }
        }
        self.arm_schedule();
    }

    fn on_sweep(&mut self, io: &mut dyn Io) {
        let now = self.now_ms;
        while let Some(&(at, id)) = self.finished.front() {
            if at > now {
                break;
            }
            self.finished.pop_front();
            self.evict_next = self.evict_next.saturating_sub(1);
            self.forget(id);
        }
        while let Some((at, _)) = self.idempotency_expiry.front() {
            if *at > now {
                break;
            }
            if let Some((_, key)) = self.idempotency_expiry.pop_front() {
                // A key lives as long as its task (a task delayed past TASK_TTL keeps it).
                match self.idempotency.get(&key) {
                    Some(id) if self.tasks.contains_key(id) || self.evicted.contains_key(id) => {
                        self.idempotency_expiry.push_back((now + self.cfg.task_ttl_ms, key));
                    }
                    _ => {
                        self.idempotency.remove(&key);
                    }
                }
            }
        }
        // Pending tasks expire TASK_TTL after they fell due; the queue is in due order. A retry
        // waiting for an untried worker's capacity does not expire: it ends when no untried
        // worker is left (with its last error) or runs when one frees up.
        let mut expired = Vec::new();
        let mut next_expiry = None;
        for &id in self.ready_all.values() {
            let Some(task) = self.tasks.get(&id) else { continue };
            if !task.attempts.is_empty() {
                continue;
            }
            let at = task.due_mono_ms + self.cfg.task_ttl_ms;
            if at > now {
                next_expiry = Some(at);
                break;
            }
            expired.push(id);
        }
        for id in expired {
            self.unqueue(id);
            self.finalize(io, id, Status::Failed, None, Some("expired in queue"));
        }
        let next = [self.finished.front().map(|f| f.0), self.idempotency_expiry.front().map(|f| f.0), next_expiry];
        if let Some(at) = next.into_iter().flatten().min() {
            self.ensure_sweep(at);
        }
    }

    fn ensure_sweep(&mut self, at: u64) {
        if self.sweep_timer.is_some_and(|(armed, _)| armed <= at) {
            return;
        }
        if let Some((_, handle)) = self.sweep_timer.take() {
            self.wheel.cancel(handle);
        }
        self.sweep_timer = Some((at, self.wheel.arm(at, Timer::Sweep)));
    }

    fn arm_schedule(&mut self) {
        let Some((&(due, _), _)) = self.scheduled.first_key_value() else { return };
        if self.schedule_timer.is_some_and(|(armed, _)| armed <= due) {
            return;
        }
        if let Some((_, handle)) = self.schedule_timer.take() {
            self.wheel.cancel(handle);
        }
        self.schedule_timer = Some((due, self.wheel.arm(due, Timer::Schedule)));
    }

    // ----- the task life cycle -------------------------------------------------------------

    fn take_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// The one place a task's status changes.
    fn set_status(&mut self, id: TaskId, status: Status) {
        if let Some(task) = self.tasks.get_mut(&id)
            && task.status != status
        {
            let bytes = task.payload.as_deref().map_or(0, |p| p.get().len());
            if task.status == Status::Pending {
                self.pending_bytes -= bytes;
            } else if status == Status::Pending {
                self.pending_bytes += bytes;
            }
            self.status_counts[task.status.index()] -= 1;
            self.status_counts[status.index()] += 1;
            task.status = status;
        }
    }

    /// The task needs a worker now (just due, or after a failed attempt): dispatch it, let it
    /// wait for capacity, or fail it.
    fn run(&mut self, io: &mut dyn Io, id: TaskId) {
        if self.is_cluster() {
            // Retries go back to the database's queue, for an untried worker of any node.
            self.cluster_after_attempt(id);
            return;
        }
        if self.shutting_down {
            self.set_status(id, Status::Pending);
            return;
        }
        loop {
            let Some(task) = self.tasks.get(&id) else { return };
            // Attempts a restart of relay cut short do not use up retries.
            let started = task.attempts.iter().filter(|a| !a.restarted).count();
            if started > 0 && started > task.max_retries as usize {
                let error = task.last_error().unwrap_or("failed").to_string();
                self.finalize(io, id, Status::Failed, None, Some(&error));
                return;
            }
            let kind = task.kind.clone();
            let tried: Vec<u128> = task.attempts.iter().map(|a| a.client_id).collect();
            let frame_bytes = task.payload.as_deref().map_or(0, |p| p.get().len()) + TASK_FRAME_OVERHEAD_BYTES;
            match self.pick_for(io, kind.as_deref(), &tried, frame_bytes) {
                Some(slot) => {
                    if self.dispatch(io, id, slot) {
                        return;
                    }
                }
                None => {
                    if started == 0 || self.any_untried(id) {
                        self.enqueue_ready(id);
                    } else {
                        let error = self.tasks.get(&id).and_then(Task::last_error).unwrap_or("no worker").to_string();
                        self.finalize(io, id, Status::Failed, None, Some(&error));
                    }
                    return;
                }
            }
        }
    }

    /// Round-robin over workers that can take a task of `kind` now (a frame of `frame_bytes`
    /// fits in their output) and were not tried.
    fn pick_for(&mut self, io: &mut dyn Io, kind: Option<&str>, tried: &[u128], frame_bytes: usize) -> Option<u32> {
        let n = self.order.len();
        // (A full journal: no attempt starts; `on_journal_state` fills the workers again.)
        if n == 0 || !self.journal_writable() {
            return None;
        }
        let key = kind.unwrap_or(NO_KIND);
        let start = self.cursors.get(key).copied().unwrap_or(n - 1);
        for step in 1..=n {
            let i = (start + step) % n;
            let slot = self.order[i];
            let Some(w) = self.worker(slot) else { continue };
            if w.ready()
                && w.accepts(kind)
                && w.has_capacity()
                && !tried.contains(&w.client_id)
                && io.has_room(w.conn, frame_bytes)
            {
                match self.cursors.get_mut(key) {
                    Some(cursor) => *cursor = i,
                    None => {
                        if self.cursors.len() >= MAX_CURSORS {
                            self.cursors.clear();
                        }
                        self.cursors.insert(Box::from(key), i);
                    }
                }
                return Some(slot);
            }
        }
        None
    }

    /// Is a worker that could take the task, and has not tried it, connected? Each attempt
    /// went to a different worker, so: more takers than attempts on takers still connected.
    fn any_untried(&self, id: TaskId) -> bool {
        let Some(task) = self.tasks.get(&id) else { return false };
        let kind = task.kind.as_deref();
        let tried_takers = task
            .attempts
            .iter()
            .filter(|a| self.worker_at(a.worker).is_some_and(|w| w.active() && w.accepts(kind)))
            .count();
        self.reach.count(kind) > tried_takers
    }

    /// Starts an attempt on the worker in `slot`. `false` if the frame could not be written
    /// (the attempt is then recorded as `send_failed`).
    fn dispatch(&mut self, io: &mut dyn Io, id: TaskId, slot: u32) -> bool {
        let Some(w) = self.worker(slot) else { return false };
        let (conn, client_id, ip) = (w.conn, w.client_id, w.ip);
        let Some(task) = self.tasks.get_mut(&id) else { return false };
        let Some(payload) = task.payload.as_deref() else { return false };
        let payload = payload.get();
        task.attempts.push(Attempt {
            worker: conn,
            client_id,
            client_ip: ip,
            started_wall_ms: self.wall_ms,
            started_mono_ms: self.now_ms,
            outcome: None,
            error: None,
            duration_ms: 0,
            answered: false,
            restarted: false,
        });
        let num = task.attempts.len() as u32;
        let deadline = self.now_ms + task.timeout_ms;
        let mut buf = uuid::Uuid::encode_buffer();
        let id_text = uuid::Uuid::from_u128(id).hyphenated().encode_lower(&mut buf);
        let sent = io.send_text(conn, &["{\"type\":\"task\",\"task_id\":\"", id_text, "\",\"payload\":", payload, "}"]);
        self.set_status(id, Status::Dispatched);
        self.record(id, Rec::AttemptStarted);
        if !sent {
            self.end_attempt(id, Outcome::SendFailed, Some("could not write the task to the worker"));
            return false;
        }
        let timer = self.wheel.arm(deadline, Timer::Attempt { task: id, num });
        if let Some(task) = self.tasks.get_mut(&id) {
            task.attempt_timer = Some(timer);
        }
        if let Some(w) = self.workers[slot as usize].as_mut() {
            w.in_flight.push(id);
        }
        crate::log!(
            Level::Debug,
            "task dispatched",
            task_id = uuid_string(id),
            attempt = num,
            client_id = uuid_string(client_id)
        );
        true
    }

    /// Closes the current attempt with `outcome` and frees the worker's slot.
    fn end_attempt(&mut self, id: TaskId, outcome: Outcome, error: Option<&str>) {
        let now = self.now_ms;
        let Some(task) = self.tasks.get_mut(&id) else { return };
        if let Some(timer) = task.attempt_timer.take() {
            self.wheel.cancel(timer);
        }
        let Some(attempt) = task.attempts.last_mut() else { return };
        if attempt.outcome.is_some() {
            return;
        }
        attempt.outcome = Some(outcome);
        attempt.error = error.map(Box::from);
        attempt.duration_ms = now.saturating_sub(attempt.started_mono_ms);
        let worker = attempt.worker;
        self.metrics.attempt(outcome);
        if task.status == Status::Dispatched && outcome != Outcome::Done && outcome != Outcome::Canceled {
            // Between attempts the task counts as pending until `run` places it.
            self.set_status(id, Status::Pending);
            // (`done` and `canceled` end the task: its final record carries the attempt.)
            self.record(id, Rec::AttemptEnded);
        }
        if let Some(w) = self.worker_at_mut(worker)
            && let Some(pos) = w.in_flight.iter().position(|t| *t == id)
        {
            w.in_flight.swap_remove(pos);
        }
    }

    fn finalize(
        &mut self,
        io: &mut dyn Io,
        id: TaskId,
        status: Status,
        result: Option<Box<RawValue>>,
        error: Option<&str>,
    ) {
        debug_assert!(status.is_final());
        if self.is_cluster() {
            // Final in the database once the turn's transaction commits; waiters anywhere
            // learn it from there.
            self.cluster_end(id, status, result, error);
            return;
        }
        self.set_status(id, status);
        let Some(task) = self.tasks.get_mut(&id) else { return };
        task.finished_wall_ms = Some(self.wall_ms);
        // A final task never runs again: its payload is not kept for TASK_TTL.
        task.payload = None;
        task.attempts.shrink_to_fit();
        task.result = result;
        task.error = error.map(Box::from);
        let duration = self.now_ms.saturating_sub(task.created_mono_ms);
        let waiters = std::mem::take(&mut task.waiters);
        self.finished_mem += task.mem_bytes();
        self.record(id, Rec::Whole);
        self.metrics.task_final(status, duration);
        let forget_at = self.now_ms + self.cfg.task_ttl_ms;
        self.finished.push_back((forget_at, id));
        self.ensure_sweep(forget_at);
        crate::log!(Level::Debug, "task final", task_id = uuid_string(id), status = status.as_str());
        for conn in waiters {
            if let Some(held) = self.held.remove(&conn) {
                self.wheel.cancel(held.timer);
                if let Some(task) = self.tasks.get(&id) {
                    let response = task_response(task, held.post);
                    self.metrics.http_request(response.status);
                    io.reply(conn, response);
                }
            }
        }
    }

    /// TASK_TTL has passed since the task finished: it is gone, from memory and journal.
    fn forget(&mut self, id: TaskId) {
        let stored = if let Some(task) = self.tasks.get(&id).filter(|t| t.status.is_final()) {
            self.status_counts[task.status.index()] -= 1;
            self.finished_mem = self.finished_mem.saturating_sub(task.mem_bytes());
            let stored = task.stored;
            self.by_submission.remove(&task.submit_seq);
            self.tasks.remove(&id);
            stored
        } else if let Some(e) = self.evicted.remove(&id) {
            self.status_counts[e.status.index()] -= 1;
            self.by_submission.remove(&e.submit_seq);
            Stored { lsn: 0, home: e.loc, segs: [e.loc.seg, 0, 0] }
        } else {
            return;
        };
        if let Storage::Journal(j) = &mut self.storage {
            j.forget(id, &stored);
        }
    }

    /// Writes the record a change of task `id` needs (nothing in memory-only mode).
    fn record(&mut self, id: TaskId, rec: Rec) {
        let Storage::Journal(j) = &mut self.storage else { return };
        let Some(task) = self.tasks.get_mut(&id) else { return };
        let mut stored = task.stored;
        match rec {
            Rec::Whole => j.task(task, &mut stored),
            Rec::AttemptStarted => j.attempt_started(task, &mut stored),
            Rec::AttemptEnded => j.attempt_ended(task, &mut stored),
        }
        task.stored = stored;
    }

    fn enqueue_ready(&mut self, id: TaskId) {
        self.set_status(id, Status::Pending);
        let Some(task) = self.tasks.get_mut(&id) else { return };
        task.place = Place::Ready;
        let (seq, kind, attempts, due) = (task.seq, task.kind.clone(), task.attempts.len(), task.due_mono_ms);
        let retry = attempts > 0;
        let fragile = (retry || !task.queued) && !task.restored;
        self.ready_all.insert(seq, id);
        if fragile {
            self.fragile.insert(kind.as_deref(), id, attempts);
        }
        if let Some(kind) = kind {
            self.ready_kind.entry(kind).or_default().insert(seq, id);
        }
        if !retry {
            self.ensure_sweep(due + self.cfg.task_ttl_ms);
        }
    }

    fn schedule(&mut self, id: TaskId) {
        let Some(task) = self.tasks.get_mut(&id) else { return };
        task.place = Place::Scheduled;
        self.scheduled.insert((task.due_mono_ms, task.seq), id);
        self.arm_schedule();
    }

    /// Takes a pending task out of whichever queue holds it.
    fn unqueue(&mut self, id: TaskId) {
        let Some(task) = self.tasks.get_mut(&id) else { return };
        match task.place {
            Place::Ready => {
                self.ready_all.remove(&task.seq);
                if let Some(kind) = &task.kind
                    && let Some(q) = self.ready_kind.get_mut(kind)
                {
                    q.remove(&task.seq);
                    if q.is_empty() {
                        self.ready_kind.remove(kind);
                    }
                }
                self.fragile.remove(task.kind.as_deref(), id, task.attempts.len());
            }
            Place::Scheduled => {
                self.scheduled.remove(&(task.due_mono_ms, task.seq));
            }
            Place::Nowhere => {}
        }
        task.place = Place::Nowhere;
    }

    /// The worker in `slot` may have capacity: give it pending tasks, oldest first.
    fn fill(&mut self, io: &mut dyn Io, slot: u32) {
        if let Storage::Cluster(node) = &mut self.storage {
            // Tasks come from the database: the turn's transaction claims for free slots.
            node.claim_check = true;
            return;
        }
        // (A full journal: no attempt starts; `on_journal_state` comes back here.)
        if self.shutting_down || !self.journal_writable() {
            return;
        }
        loop {
            let Some(w) = self.worker(slot) else { return };
            if !w.ready() || !w.has_capacity() {
                return;
            }
            let Some(id) = self.next_ready_for(w) else { return };
            let conn = w.conn;
            let frame_bytes = self.tasks.get(&id).and_then(|t| t.payload.as_deref()).map_or(0, |p| p.get().len())
                + TASK_FRAME_OVERHEAD_BYTES;
            if !io.has_room(conn, frame_bytes) {
                // Full: the task stays queued; `worker_drained` comes back here.
                return;
            }
            self.unqueue(id);
            if !self.dispatch(io, id, slot) {
                // This worker cannot be written to; the task moves on without it.
                self.run(io, id);
                return;
            }
        }
    }

    fn next_ready_for(&self, w: &Worker) -> Option<TaskId> {
        let untried = |id: &TaskId| self.tasks.get(id).is_some_and(|t| !t.tried(w.client_id));
        match &w.kinds {
            None => self.ready_all.values().take(MAX_QUEUE_SCAN).find(|id| untried(id)).copied(),
            Some(kinds) => kinds
                .iter()
                .filter_map(|k| self.ready_kind.get(k))
                .filter_map(|q| q.iter().take(MAX_QUEUE_SCAN).find(|(_, id)| untried(id)))
                .min_by_key(|(seq, _)| **seq)
                .map(|(_, id)| *id),
        }
    }

    /// Waiting tasks that need a worker now (retries, and tasks submitted without `queue` or a
    /// schedule) fail once no untried worker that could take them is connected.
    /// A worker that accepted `before` now accepts `after` (or left): only tasks of kinds it
    /// no longer takes can have lost their last possible worker, and among retries only those
    /// with at least as many attempts as takers remain.
    fn recheck_fragile(&mut self, io: &mut dyn Io, before: &Accepts, after: &Accepts) {
        if self.fragile.is_empty() {
            return;
        }
        let mut hopeless = Vec::new();
        for kind in self.fragile.affected(before, after) {
            let takers = self.reach.count(kind.as_deref());
            if takers == 0 {
                hopeless.extend(self.fragile.all_of(&kind));
            } else {
                let suspects = self.fragile.retries_with_at_least(&kind, takers);
                hopeless.extend(suspects.into_iter().filter(|&id| !self.any_untried(id)));
            }
        }
        for id in hopeless {
            self.unqueue(id);
            let error = self
                .tasks
                .get(&id)
                .and_then(Task::last_error)
                .unwrap_or("no connected worker can take this task any more")
                .to_string();
            self.finalize(io, id, Status::Failed, None, Some(&error));
        }
    }
}

/// The response a waiter gets: POST maps the status to a code, GET is always 200.
pub fn task_response(task: &Task, post: bool) -> Response {
    let mut body = String::new();
    task.write_json(&mut body);
    let body = body.into_bytes();
    let lsn = task.stored.lsn;
    let status = if !post {
        200
    } else {
        match task.status {
            Status::Done => 200,
            Status::Failed => 502,
            Status::Canceled => 409,
            Status::Pending | Status::Dispatched => 202,
        }
    };
    let mut response = Response::json(status, body);
    response.lsn = lsn;
    response
}

/// One `/clients` entry for a worker of this node (`node`: its name, in cluster mode).
fn write_worker_json(w: &Worker, s: &mut String, node: Option<&str>) {
    s.push_str("{\"client_id\":\"");
    push_uuid(s, w.client_id);
    s.push_str("\",\"ip\":\"");
    s.push_str(&w.ip.to_string());
    s.push_str("\",\"connected_at\":\"");
    write_rfc3339_ms(s, w.connected_wall_ms);
    s.push_str("\",\"active\":");
    s.push_str(if w.active() { "true" } else { "false" });
    s.push_str(",\"in_flight\":");
    s.push_str(&w.in_flight.len().to_string());
    if let Some(kinds) = &w.kinds {
        s.push_str(",\"kinds\":[");
        for (j, k) in kinds.iter().enumerate() {
            if j > 0 {
                s.push(',');
            }
            push_json_str(s, k);
        }
        s.push(']');
    }
    if let Some(c) = w.concurrency {
        s.push_str(",\"concurrency\":");
        s.push_str(&c.to_string());
    }
    if let Some(v) = &w.version {
        s.push_str(",\"version\":");
        push_json_str(s, v);
    }
    if let Some(n) = node {
        s.push_str(",\"node\":");
        push_json_str(s, n);
    }
    s.push('}');
}

/// Sends the advisory `cancel` for `id` to a worker.
fn send_cancel(io: &mut dyn Io, worker: ConnRef, id: TaskId) {
    let mut buf = uuid::Uuid::encode_buffer();
    let id_text = uuid::Uuid::from_u128(id).hyphenated().encode_lower(&mut buf);
    io.send_text(worker, &["{\"type\":\"cancel\",\"task_id\":\"", id_text, "\"}"]);
}

/// `10s`, `1.5s`, `250ms`: for error messages.
pub fn human_ms(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else if ms > 1000 {
        format!("{}s", ms as f64 / 1000.0)
    } else {
        format!("{ms}ms")
    }
}

mod cluster;
mod reach;
mod storage;
#[cfg(test)]
mod tests;
