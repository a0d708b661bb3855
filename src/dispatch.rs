//! The relay's brain, without I/O — one core for both stores (ARCHITECTURE.md). It decides:
//! this node's workers and their round-robin, which claimed task goes to which worker, the
//! attempts running here and their timeouts, what an attempt's end means (done, retry on an
//! untried worker, failed), who waits for which task, batches, and every answer's shape.
//! A store (`store`) keeps the tasks and answers queue operations; the core never sees SQL,
//! rows or journal records, and never asks which store it has.
//!
//! Output leaves only through the [`Io`] trait (a frame for a worker, a reply for a held HTTP
//! request), and time comes in through `now_ms`/`wall_ms`, which the reactor sets. Nothing here
//! may close a connection or read a clock.

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasherDefault;
use std::net::IpAddr;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::http::Response;
use crate::log::Level;
use crate::metrics::{Gauges, Ignored, Metrics};
pub use crate::store::NewTask;
use crate::store::{
    AttemptEnd, AttemptStart, ClaimAsk, Claimed, Event, Insert, InsertTo, Later, Next, ReadHow, Refusal, Store, Takers,
    WorkerInfo,
};
use crate::tasks::{
    ConnRef, IdHasher, Outcome, RetryPolicy, Status, TaskId, accepted_json, push_json_str, push_uuid, uuid_string,
};
use crate::timer::{TimerHandle, Wheel};
use workers::{Accepts, Groups, Reach, Worker};

mod direct;
mod sessions;
pub mod workers;

pub use direct::{CancelResult, DIRECT, SubmitError, submit_answer};

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
    /// Completes an HTTP request that was held.
    fn reply(&mut self, conn: ConnRef, response: Response);
    /// Closes a worker connection the core let go of (its session resumed on another
    /// connection, SPEC §12): a close frame, then the socket. The core knows it no more.
    fn close_worker(&mut self, worker: ConnRef) {
        let _ = worker;
    }
    /// What is queued for `worker` from now on leaves only once the journal is durable up to
    /// record `lsn` (a session worker's task frame waits for its attempt's start, SPEC §12).
    /// (An `Io` without a journal sends at once.)
    fn hold_until_durable(&mut self, worker: ConnRef, lsn: u64) {
        let _ = (worker, lsn);
    }
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
    /// A held session's RESUME_WINDOW is over (SPEC §12).
    Session(u64),
    /// The store's own time (schedules, expiry, a database's refreshes).
    Store,
    /// A claim round was cut short by its budget: the rest claim in the next turn.
    Claim,
    /// The reactor stopped accepting after EMFILE; try again.
    AcceptResume,
    /// A stored file reached BLOB_TTL.
    BlobExpire(u128),
    /// The hourly clean-up of BLOB_DIR.
    BlobSweep,
    ShutdownDeadline,
}

/// The round-robin cursor key of tasks without a kind (not a string a kind can be).
const NO_KIND: &str = "\u{0}";
/// Round-robin cursors kept at most (kinds come from clients; the map must stay bounded).
const MAX_CURSORS: usize = 4096;

/// Round-robin positions of first attempts (indexes into the ring), per kind. Tasks without a
/// kind have a field of their own: their lookups, two or three per task, hash nothing.
#[derive(Default)]
struct Cursors {
    no_kind: Option<usize>,
    kinds: HashMap<Box<str>, usize>,
}

impl Cursors {
    fn get(&self, kind: Option<&str>) -> Option<usize> {
        match kind {
            None => self.no_kind,
            Some(k) => self.kinds.get(k).copied(),
        }
    }

    fn set(&mut self, kind: Option<&str>, i: usize) {
        let Some(k) = kind else {
            self.no_kind = Some(i);
            return;
        };
        match self.kinds.get_mut(k) {
            Some(cursor) => *cursor = i,
            None => {
                if self.kinds.len() >= MAX_CURSORS {
                    self.kinds.clear();
                }
                self.kinds.insert(Box::from(k), i);
            }
        }
    }
}
/// Bytes of a task frame besides its payload (type, task id, braces, WebSocket header).
const TASK_FRAME_OVERHEAD_BYTES: usize = 96;
/// Tasks one claim asks for at most.
const MAX_CLAIM: u32 = 256;
/// Workers a submit looks at, at most, for one with a free slot (`free_taker`).
const FREE_TAKER_LOOKS: usize = 256;
/// Tasks claimed in one settle at most (the rest in the next turn): bounded work per turn.
const CLAIMS_PER_TURN: usize = 4096;
/// Kinds named in a `no_worker` message at most.
const MAX_KINDS_NAMED: usize = 10;

/// A new worker connection is sent nothing until its first text message is read, or until
/// this long has passed without one (SPEC §5): a worker that says hello is never sent a task
/// it did not ask for, and one that never does is served as the seed protocol says.
pub const HELLO_GRACE_MS: u64 = 1_000;

#[derive(Debug, Clone, Default)]
pub struct CoreConfig {
    pub task_timeout_ms: u64,
    pub max_retries: u32,
    pub wait_timeout_ms: u64,
    /// The default retry policy (SPEC §13): `RETRY_BACKOFF` (0: retry at once),
    /// `RETRY_BACKOFF_MAX`, `RETRY_ANY_WORKER`.
    pub retry_backoff_ms: u64,
    pub retry_backoff_max_ms: u64,
    pub retry_any_worker: bool,
}

/// The longest wait a worker's `retry_after_ms` asks for that is honoured (a day).
pub const MAX_RETRY_AFTER_MS: u64 = 86_400_000;

/// What a worker said about its failure besides the error (SPEC §13).
#[derive(Debug, Clone, Copy, Default)]
struct Hint {
    /// `"retry": false`: the task fails at once.
    permanent: bool,
    /// `"retry_after_ms": N`: the next attempt waits at least N ms.
    after_ms: Option<u64>,
}

impl Hint {
    /// A result's `retry` and `retry_after_ms`, as the worker wrote them. Only `"retry": false`
    /// is a permanent failure; `retry_after_ms` is any non-negative JSON number of ms (a
    /// fraction waits the next whole ms; at most [`MAX_RETRY_AFTER_MS`]). Anything else — a
    /// string, a negative number — is logged and ignored: the answer itself still counts (it
    /// was dropped whole as a malformed message, and the attempt then ran into its timeout).
    fn of(retry: Option<&RawValue>, after: Option<&RawValue>) -> Hint {
        let permanent = retry.is_some_and(|r| r.get() == "false");
        if let Some(r) = retry.filter(|r| !matches!(r.get(), "true" | "false")) {
            crate::log!(Level::Warn, "a result's retry is not true or false: ignored", retry = r.get());
        }
        let after_ms = after.and_then(|a| {
            let text = a.get();
            let ms = match text.parse::<u64>() {
                Ok(n) => Some(n),
                // (A fraction, an exponent, or an integer past u64: as a float, rounded up.)
                Err(_) => text
                    .parse::<f64>()
                    .ok()
                    .filter(|f| *f >= 0.0 && text.bytes().all(|b| b.is_ascii_digit() || b"+-.eE".contains(&b)))
                    .map(|f| f.ceil().min(MAX_RETRY_AFTER_MS as f64) as u64),
            };
            if ms.is_none() {
                crate::log!(
                    Level::Warn,
                    "a result's retry_after_ms is not a non-negative number of ms: ignored",
                    retry_after_ms = text
                );
            }
            ms.map(|ms| ms.min(MAX_RETRY_AFTER_MS))
        });
        Hint { permanent, after_ms }
    }
}

/// An attempt running on one of this node's workers.
#[derive(Debug)]
struct Running {
    attempt: u32,
    conn: ConnRef,
    client_id: u128,
    timer: TimerHandle,
    started_mono_ms: u64,
    timeout_ms: u64,
    kind: Option<Box<str>>,
    max_retries: u32,
    retry: RetryPolicy,
    /// Earlier attempts that count against `max_retries`.
    counted: u32,
    /// Workers sent the task before, maybe with this one (`client_id`): a first attempt's is
    /// empty and allocates nothing; [`Running::tried_all`] adds this one when a failure asks.
    tried: Vec<u128>,
    created_wall_ms: u64,
    answered: bool,
    /// Held for this session while its worker's connection is lost (SPEC §12).
    held: Option<u64>,
    /// Times a resuming worker took it back.
    resumes: u32,
    /// Read back from the journal at start, held for its session (SPEC §12).
    restored: bool,
}

impl Running {
    /// Every worker sent the task, this attempt's included (a failure's questions).
    fn tried_all(&self) -> Vec<u128> {
        let mut tried = Vec::with_capacity(self.tried.len() + 1);
        tried.extend_from_slice(&self.tried);
        if !tried.contains(&self.client_id) {
            tried.push(self.client_id);
        }
        tried
    }
}

/// A `wait=true` request held until its task is final or WAIT_TIMEOUT.
struct Held {
    task: TaskId,
    post: bool,
    timer: TimerHandle,
}

/// The `wait=true` requests held for one task: nearly always one (no vector allocated then).
struct Waiters {
    first: ConnRef,
    more: Vec<ConnRef>,
}

impl Waiters {
    /// Forgets `conn`; true when no request is left.
    fn remove(&mut self, conn: ConnRef) -> bool {
        if self.first == conn {
            match self.more.pop() {
                Some(next) => self.first = next,
                None => return true,
            }
        } else {
            self.more.retain(|&c| c != conn);
        }
        false
    }
}

/// A `POST /tasks/batch` whose items are being stored.
struct BatchWait {
    conn: ConnRef,
    /// Per item: its task id, or its error (code, message).
    items: Vec<Option<Result<TaskId, (&'static str, String)>>>,
    outstanding: usize,
    complete: bool,
    lsn: u64,
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
    /// (A result) `false`: a permanent failure (SPEC §13). Raw, as `retry_after_ms`: a hint of
    /// the wrong type is ignored, it does not cost the worker its answer.
    #[serde(borrow, default)]
    retry: Option<&'a RawValue>,
    /// (A result) the next attempt waits at least this long (SPEC §13).
    #[serde(borrow, default)]
    retry_after_ms: Option<&'a RawValue>,
    /// Sessions (SPEC §12): hello's `worker_id`, `session`, `running`; a result's `attempt`.
    #[serde(default)]
    worker_id: Option<String>,
    #[serde(default)]
    session: Option<String>,
    #[serde(default)]
    running: Option<Vec<sessions::RunningEntry>>,
    #[serde(default)]
    attempt: Option<u64>,
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
    pub store: Store,
    /// This node's name in attempt_log entries (cluster mode).
    node_name: Option<Box<str>>,
    workers: Vec<Option<Worker>>,
    /// Slots of connected workers, in connection order (the round-robin ring).
    order: Vec<u32>,
    /// Round-robin position of first attempts per kind.
    cursors: Cursors,
    /// How many active workers of this node take each kind.
    reach: Reach,
    groups: Groups,
    running: HashMap<TaskId, Running, BuildHasherDefault<IdHasher>>,
    /// A claim round's buffers, kept between rounds: (group, limit) asked, one group's takers.
    claim_asks: Vec<(u32, u32)>,
    /// The group of the worker whose turn it is for the last task submitted to run now: the
    /// next claim round asks it first, so that a store which claims in its own time (a
    /// database) rotates first attempts over groups as [`Core::free_taker`] does.
    next_taker: Option<u32>,
    claim_takers: Vec<u128>,
    /// Workers a submit found without room for its frame (kept between submits).
    claim_takers_slots: Vec<u32>,
    held: HashMap<ConnRef, Held, BuildHasherDefault<IdHasher>>,
    waiters: HashMap<TaskId, Waiters, BuildHasherDefault<IdHasher>>,
    batches: HashMap<u64, BatchWait, BuildHasherDefault<IdHasher>>,
    next_batch: u64,
    /// A task became ready or a worker gained room: a claim round is due.
    claim_wanted: bool,
    claim_timer: bool,
    store_timer: Option<(u64, TimerHandle)>,
    /// Submits stored this step: answered once the step's claims ran (so a task dispatched at
    /// once answers `dispatched`).
    answers_due: Vec<(ConnRef, TaskId, u64)>,
    /// The request the API is handling now: its answer is returned, not sent (`Io::reply`
    /// completes only requests that were held).
    answering: Option<ConnRef>,
    captured: Option<Response>,
    events: Vec<Event>,
    /// For the jitter of retry backoffs.
    rng: crate::store::mem::Rng,
    /// The latest end of a cool-down of a degraded worker (monotonic ms): before it, first
    /// attempts look past degraded workers (SPEC §13).
    degraded_until_ms: u64,
    /// Per kind (key [`NO_KIND`]: tasks without one), the latest success: when (monotonic ms)
    /// and by whom — a worker failing while others succeed at its kinds is degraded.
    last_done: HashMap<Box<str>, (u64, u128)>,
    /// An attempt failed at some time (until then nobody can be degraded, and the sync hot path
    /// keeps no per-kind record of successes).
    seen_failure: bool,
    /// Worker sessions (SPEC §12) and how long a lost one's attempts are held (0: never).
    sessions: sessions::Sessions,
    pub resume_window_ms: u64,
}

impl Core {
    pub fn new(cfg: CoreConfig, store: Store, now_ms: u64, wall_ms: u64) -> Core {
        let node_name = store.health().node.map(Box::from);
        Core {
            cfg,
            wheel: Wheel::new(4096, now_ms),
            metrics: Metrics::new(),
            now_ms,
            wall_ms,
            started_mono_ms: now_ms,
            shutting_down: false,
            store,
            node_name,
            workers: Vec::new(),
            order: Vec::new(),
            cursors: Cursors::default(),
            reach: Reach::default(),
            groups: Groups::default(),
            running: HashMap::default(),
            claim_asks: Vec::new(),
            next_taker: None,
            claim_takers: Vec::new(),
            claim_takers_slots: Vec::new(),
            held: HashMap::default(),
            waiters: HashMap::default(),
            batches: HashMap::default(),
            next_batch: 1,
            claim_wanted: true,
            claim_timer: false,
            store_timer: None,
            answers_due: Vec::new(),
            answering: None,
            captured: None,
            events: Vec::new(),
            rng: crate::store::mem::Rng::from_os(),
            degraded_until_ms: 0,
            last_done: HashMap::new(),
            seen_failure: false,
            sessions: sessions::Sessions::default(),
            resume_window_ms: 0,
        }
    }

    /// The clocks of this loop turn (the reactor's; the store gets them too).
    pub fn set_clock(&mut self, now_ms: u64, wall_ms: u64) {
        self.now_ms = now_ms;
        self.wall_ms = wall_ms;
        self.store.set_clock(now_ms, wall_ms);
        crate::tasks::set_json_clock(wall_ms);
    }

    // ----- queries -------------------------------------------------------------------------

    pub fn workers_connected(&self) -> usize {
        self.order.len()
    }

    pub fn workers_active(&self) -> usize {
        self.order.iter().filter(|&&slot| self.worker(slot).is_some_and(Worker::active)).count()
    }

    pub fn gauges(&self, connections_open: usize) -> Gauges {
        let health = self.store.health();
        let mut g = Gauges {
            workers_connected: self.workers_connected(),
            workers_active: self.workers_active(),
            tasks_pending: health.counts[Status::Pending.index()] as usize,
            tasks_dispatched: health.counts[Status::Dispatched.index()] as usize,
            connections_open,
            finished_memory_bytes: 0,
            tasks_on_disk: 0,
            tasks_evicted: 0,
            journal: None,
            cluster: None,
            kinds: Vec::new(),
            held: [0; 6],
        };
        self.store.gauges(&mut g);
        g.held[crate::flow::WaitingOn::Paused.index()] += self.metrics.held_paused;
        g
    }

    /// Is any worker of the relay (this node's, or another live node's as last read) able to
    /// take a task of `kind`, capacity aside?
    pub fn can_ever_take(&self, kind: Option<&str>) -> bool {
        self.takers().untried(kind, &[])
    }

    fn takers(&self) -> TakersView<'_> {
        TakersView { core: self, remote: self.store.remote_workers() }
    }

    /// The `no_worker` answer: which kind was asked for, and which kinds are connected.
    pub fn no_worker(&self, kind: Option<&str>) -> Response {
        let (kinds, more) = workers::kinds_list(&self.reach, self.store.remote_workers(), MAX_KINDS_NAMED);
        let all = self.reach.takes_all() || self.store.remote_workers().iter().any(|w| w.active && w.kinds.is_none());
        let connected = match (self.workers_active() + self.store.remote_workers().len(), kinds.is_empty()) {
            (0, _) => "no worker is connected".to_string(),
            (_, true) if !all => "the connected workers take no kinds".to_string(),
            _ => {
                let mut s = String::from("connected workers take ");
                if all {
                    s.push_str("any kind (a worker without declared kinds)");
                    if !kinds.is_empty() {
                        s.push_str(", and ");
                    }
                }
                s.push_str(&kinds.iter().map(|k| format!("{k:?}")).collect::<Vec<_>>().join(", "));
                if more {
                    s.push_str(", ...");
                }
                s
            }
        };
        let msg = match kind {
            Some(k) => format!("no connected worker can take tasks of kind {k:?}: {connected}"),
            None => format!("no connected worker can take a task without a payload.kind: {connected}"),
        };
        Response::error(503, "no_worker", &msg)
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

    /// A worker's room or acceptance may have changed: its group follows, and it may claim.
    fn refresh(&mut self, slot: u32) {
        let Some(w) = self.workers.get_mut(slot as usize).and_then(Option::as_mut) else { return };
        if self.groups.refresh(slot, w) {
            self.claim_wanted = true;
        }
        self.store.worker_busy(w.client_id, w.in_flight.len() as u32);
    }

    /// `/clients` entries of this node's workers.
    fn local_infos(&self) -> Vec<WorkerInfo> {
        let mut v: Vec<WorkerInfo> = self
            .order
            .iter()
            .filter_map(|&s| self.worker(s))
            .map(|w| WorkerInfo { degraded: w.health.degraded(self.now_ms), ..w.info(self.node_name.as_deref()) })
            .collect();
        // Held sessions too: inactive, with `resumable_until` (SPEC §12).
        v.extend(self.sessions.held_infos().cloned());
        v
    }

    /// `/healthz`: this node's workers, the store's counts (cluster-wide in cluster mode),
    /// and the store's state; 503 while the store cannot take writes.
    pub fn health(&self) -> Response {
        let h = self.store.health();
        let ok = h.ok();
        let mut s = String::with_capacity(256);
        s.push_str(if ok { "{\"status\":\"ok\"" } else { "{\"status\":\"unavailable\"" });
        if let Some(node) = &h.node {
            s.push_str(",\"node\":");
            push_json_str(&mut s, node);
        }
        if let Some(up) = h.database_up {
            s.push_str(if up { ",\"database\":\"ok\"" } else { ",\"database\":\"unreachable\"" });
        }
        if let Some(up) = h.journal_up {
            s.push_str(if up { ",\"journal\":\"ok\"" } else { ",\"journal\":\"full\"" });
        }
        let c = |st: Status| h.counts[st.index()];
        s.push_str(&format!(
            ",\"clients\":{},\"active_clients\":{},\"tasks\":{{\"pending\":{},\"dispatched\":{},\"done\":{},\
             \"failed\":{},\"canceled\":{}}},\"uptime_s\":{}}}",
            self.workers_connected(),
            self.workers_active(),
            c(Status::Pending),
            c(Status::Dispatched),
            c(Status::Done),
            c(Status::Failed),
            c(Status::Canceled),
            self.now_ms.saturating_sub(self.started_mono_ms) / 1000
        ));
        Response::json(if ok { 200 } else { 503 }, s.into_bytes())
    }

    // ----- answering ---------------------------------------------------------------------------

    /// The API hands a request over: its answer is returned (`Some`) when the core has it
    /// before this call ends, else it is sent through `Io::reply` once it comes.
    fn begin(&mut self, conn: ConnRef) {
        self.answering = Some(conn);
        self.captured = None;
    }

    fn end(&mut self, io: &mut dyn Io) -> Option<Response> {
        self.settle(io);
        self.answering = None;
        self.captured.take()
    }

    fn reply(&mut self, io: &mut dyn Io, conn: ConnRef, response: Response) {
        if self.answering == Some(conn) && self.captured.is_none() {
            self.captured = Some(response);
            return;
        }
        self.metrics.http_request(response.status);
        io.reply(conn, response);
    }

    // ----- submit, wait, read, cancel --------------------------------------------------------

    /// `POST /tasks`: the answer, or `None` when it comes later through `Io::reply` (a wait,
    /// or a store that answers after its transaction).
    pub fn submit(&mut self, io: &mut dyn Io, conn: ConnRef, new: &NewTask<'_>, wait: bool) -> Option<Response> {
        self.begin(conn);
        // A paused kind's submits wait, as queued ones do, for any worker (SPEC §14).
        let held = self.store.kind_paused(new.kind);
        self.metrics.held_paused += u64::from(held);
        let paused;
        let new = if !new.queue && held {
            paused = NewTask { queue: true, ..*new };
            &paused
        } else {
            new
        };
        let waits = new.queue || new.run_at_wall_ms.is_some();
        if !waits && !self.can_ever_take(new.kind) {
            let r = self.no_worker(new.kind);
            match new.idempotency {
                // A repeat of a keyed submit is answered for its task, whatever it would be now.
                Some((owner, key)) => self.store.lookup_key(owner, key, conn, wait, r),
                None => self.captured = Some(r),
            }
            return self.end(io);
        }
        let task = self.store_task(io, new);
        self.store.insert(&task, InsertTo::Submit { conn, wait });
        // (A store that could not claim it at once sends `Ready`; a database claims for idle
        // workers in the transaction that inserts.)
        self.end(io)
    }

    /// `/kinds`, `/kinds/{kind}` (SPEC §14): the answer, or `None` when it comes later.
    pub fn kind_op(&mut self, io: &mut dyn Io, conn: ConnRef, op: crate::flow::KindOp) -> Option<Response> {
        self.begin(conn);
        self.store.kind_op(op, conn);
        self.end(io)
    }

    /// A keyed submit that will not be stored (its body is invalid, or it is refused): if the
    /// key names a task, the answer is that task's; else `missing`.
    pub fn refuse_keyed(
        &mut self,
        io: &mut dyn Io,
        conn: ConnRef,
        owner: &str,
        key: &str,
        wait: bool,
        missing: Response,
    ) -> Option<Response> {
        self.begin(conn);
        self.store.lookup_key(owner, key, conn, wait, missing);
        self.end(io)
    }

    fn store_task<'a>(&mut self, io: &mut dyn Io, new: &NewTask<'a>) -> Insert<'a> {
        let due_now = new.run_at_wall_ms.is_none_or(|at| at <= self.wall_ms);
        let frame_bytes = new.payload.get().len() + TASK_FRAME_OVERHEAD_BYTES;
        let taker = if due_now { self.free_taker(io, new.kind, frame_bytes) } else { None };
        // (Offered only to a group with no claim in flight, which may be taking its room.)
        let claim_group = taker.filter(|gid| self.groups.groups.get(gid).is_some_and(|g| g.asked == 0));
        if taker.is_some() {
            self.next_taker = taker;
        }
        Insert { task: *new, runs_now: taker.is_some(), claim_group }
    }

    /// The group of a worker of this node that takes `kind` and has a free slot and room for a
    /// frame of `frame_bytes` now, if there is one. (Workers found without room are not eligible
    /// until they drain.)
    fn free_taker(&mut self, io: &mut dyn Io, kind: Option<&str>, frame_bytes: usize) -> Option<u32> {
        // The workers in the kind's round-robin order (as `pick` walks it), from the one after
        // the last that got a first attempt: the group offered is the next eligible worker's, so
        // consecutive tasks rotate also over workers whose kind lists differ.
        let n = self.order.len();
        let any = self.groups.groups.values().any(|g| g.free > g.offered && g.accepts.takes(kind));
        if n == 0 || !any {
            return None;
        }
        let start = self.cursors.get(kind).unwrap_or(n - 1);
        let mut starved = std::mem::take(&mut self.claim_takers_slots);
        starved.clear();
        let mut found = None;
        // A degraded worker is offered a first attempt only when no other worker can take it
        // (SPEC §13): a second pass, only while some worker is degraded.
        let avoid = self.now_ms < self.degraded_until_ms;
        'passes: for pass in 0..1 + usize::from(avoid) {
            // (Bounded: with thousands of busy workers a submit looks at a few hundred; one that
            // finds none waits for a claim like any queued task.)
            for step in 1..=n.min(FREE_TAKER_LOOKS) {
                let slot = self.order[(start + step) % n];
                let Some(w) = self.workers.get(slot as usize).and_then(Option::as_ref) else { continue };
                let Some((gid, _)) = w.listed else { continue };
                if !(w.ready() && w.accepts(kind) && w.has_capacity()) {
                    continue;
                }
                if avoid && pass == 0 && w.health.degraded(self.now_ms) {
                    continue;
                }
                if self.groups.groups.get(&gid).is_none_or(|g| g.free <= g.offered) {
                    continue;
                }
                if io.has_room(w.conn, frame_bytes) {
                    found = Some(gid);
                    break 'passes;
                }
                if !starved.contains(&slot) {
                    starved.push(slot);
                }
            }
        }
        for &slot in &starved {
            if let Some(w) = self.workers.get_mut(slot as usize).and_then(Option::as_mut) {
                w.starved = true;
            }
            self.refresh(slot);
        }
        self.claim_takers_slots = starved;
        if let Some(g) = found.and_then(|gid| self.groups.groups.get_mut(&gid)) {
            g.offered += 1;
        }
        found
    }

    /// `GET /tasks/{id}` (with `wait`): the answer, or `None` when it comes later.
    pub fn get(
        &mut self,
        io: &mut dyn Io,
        conn: ConnRef,
        id: TaskId,
        scope: Option<&[String]>,
        wait: bool,
        payload: bool,
    ) -> Option<Response> {
        self.begin(conn);
        let how = if wait && !self.shutting_down { ReadHow::Wait { post: false } } else { ReadHow::Get { payload } };
        self.read(io, id, scope, conn, how);
        self.end(io)
    }

    /// `GET /tasks`.
    pub fn list(
        &mut self,
        io: &mut dyn Io,
        conn: ConnRef,
        q: &crate::listing::Query,
        scope: Option<&[String]>,
    ) -> Option<Response> {
        self.begin(conn);
        self.store.list(q, scope, conn);
        self.end(io)
    }

    /// `DELETE /tasks/{id}`.
    pub fn cancel(&mut self, io: &mut dyn Io, conn: ConnRef, id: TaskId, scope: Option<&[String]>) -> Option<Response> {
        self.begin(conn);
        self.store.cancel(id, scope, conn);
        self.end(io)
    }

    /// `POST /tasks/{id}/retry` (SPEC §13): a failed or canceled task runs again; with `wait`,
    /// the answer waits for it to be final.
    pub fn rerun(
        &mut self,
        io: &mut dyn Io,
        conn: ConnRef,
        id: TaskId,
        scope: Option<&[String]>,
        wait: bool,
    ) -> Option<Response> {
        self.begin(conn);
        self.store.rerun(id, scope, conn, wait && !self.shutting_down);
        self.claim_wanted = true;
        self.end(io)
    }

    /// `POST /tasks/retry`: the failed (or canceled) tasks the filter selects run again.
    pub fn rerun_many(
        &mut self,
        io: &mut dyn Io,
        conn: ConnRef,
        filter: &crate::store::RerunFilter,
        scope: Option<&[String]>,
    ) -> Option<Response> {
        self.begin(conn);
        self.store.rerun_many(filter, scope, conn);
        self.claim_wanted = true;
        self.end(io)
    }

    /// `GET /clients`: this node's workers and (cluster mode) every other live node's.
    pub fn clients(&mut self, io: &mut dyn Io, conn: ConnRef) -> Option<Response> {
        self.begin(conn);
        self.store.list_workers(conn);
        self.end(io)
    }

    /// `conn` waits for `id` to become final (or WAIT_TIMEOUT).
    fn hold(&mut self, conn: ConnRef, id: TaskId, post: bool) {
        let timer = self.wheel.arm(self.now_ms + self.cfg.wait_timeout_ms, Timer::Wait(conn));
        if let Some(old) = self.held.insert(conn, Held { task: id, post, timer }) {
            self.wheel.cancel(old.timer);
        }
        match self.waiters.entry(id) {
            std::collections::hash_map::Entry::Occupied(w) => w.into_mut().more.push(conn),
            std::collections::hash_map::Entry::Vacant(w) => {
                w.insert(Waiters { first: conn, more: Vec::new() });
                self.store.watch(id);
            }
        }
    }

    /// The wait of `conn` ends without the task being final (or it is, and is read): it is
    /// answered with the task as it is now.
    fn release(&mut self, io: &mut dyn Io, conn: ConnRef) {
        let Some(held) = self.unhold(conn) else { return };
        self.read(io, held.task, None, conn, ReadHow::Release { post: held.post });
    }

    /// Reads task `id` for `conn`: answered now when the store has the answer in the call, else
    /// by the store's event.
    fn read(&mut self, io: &mut dyn Io, id: TaskId, scope: Option<&[String]>, conn: ConnRef, how: ReadHow) {
        if let Some(r) = self.store.read(id, scope, conn, how) {
            self.reply(io, conn, r);
        }
    }

    fn unhold(&mut self, conn: ConnRef) -> Option<Held> {
        let held = self.held.remove(&conn)?;
        self.wheel.cancel(held.timer);
        if self.waiters.get_mut(&held.task).is_some_and(|w| w.remove(conn)) {
            self.waiters.remove(&held.task);
            self.store.unwatch(held.task);
        }
        Some(held)
    }

    /// An HTTP connection went away: forget its wait, or its batch.
    pub fn conn_closed(&mut self, conn: ConnRef) {
        self.unhold(conn);
        if !self.batches.is_empty() {
            // A batch whose connection went away is never answered (its items already stored
            // stay stored).
            self.batches.retain(|_, b| b.conn != conn);
        }
    }

    /// Shutdown: every waiting request gets the task as it is now.
    pub fn release_waiters(&mut self, io: &mut dyn Io) {
        let conns: Vec<ConnRef> = self.held.keys().copied().collect();
        for conn in conns {
            self.release(io, conn);
        }
        self.settle(io);
    }

    // ----- batches -----------------------------------------------------------------------------

    /// Starts a batch's bookkeeping. Returns its key.
    pub fn batch_begin(&mut self, conn: ConnRef) -> u64 {
        let key = self.next_batch;
        self.next_batch += 1;
        self.batches.insert(key, BatchWait { conn, items: Vec::new(), outstanding: 0, complete: false, lsn: 0 });
        key
    }

    /// One batch item: validated by the API (`Err`), or stored.
    pub fn batch_item(&mut self, io: &mut dyn Io, batch: u64, item: Result<NewTask<'_>, (&'static str, String)>) {
        let Some(b) = self.batches.get_mut(&batch) else { return };
        let index = b.items.len() as u32;
        match item {
            Err(e) => b.items.push(Some(Err(e))),
            Ok(mut new) => {
                b.items.push(None);
                b.outstanding += 1;
                // (A paused kind's items wait, as in a submit.)
                let held = self.store.kind_paused(new.kind);
                self.metrics.held_paused += u64::from(held);
                new.queue |= held;
                if !new.queue && !self.can_ever_take(new.kind) {
                    self.batch_done(batch, index, Err(("no_worker", "no connected worker can take this task".into())));
                    return;
                }
                let task = self.store_task(io, &new);
                self.store.insert(&task, InsertTo::Batch { batch, index });
            }
        }
    }

    /// Every item is in: the answer now, or `None` (sent when the store answered every item).
    pub fn batch_end(&mut self, io: &mut dyn Io, batch: u64) -> Option<Response> {
        let conn = self.batches.get(&batch)?.conn;
        self.begin(conn);
        if let Some(b) = self.batches.get_mut(&batch) {
            b.complete = true;
        }
        self.end(io)
    }

    fn batch_done(&mut self, batch: u64, index: u32, result: Result<TaskId, (&'static str, String)>) {
        let Some(b) = self.batches.get_mut(&batch) else { return };
        if let Some(item) = b.items.get_mut(index as usize)
            && item.is_none()
        {
            *item = Some(result);
            b.outstanding = b.outstanding.saturating_sub(1);
        }
    }

    fn finish_batch(&mut self, io: &mut dyn Io, batch: u64) {
        if !self.batches.get(&batch).is_some_and(|b| b.complete && b.outstanding == 0) {
            return;
        }
        let Some(b) = self.batches.remove(&batch) else { return };
        let mut out = String::with_capacity(16 + b.items.len() * 72);
        let mut lsn = b.lsn;
        out.push_str("{\"tasks\":[");
        for (i, item) in b.items.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            match item {
                Some(Ok(id)) => {
                    out.push_str("{\"task_id\":\"");
                    push_uuid(&mut out, *id);
                    out.push_str("\",\"status\":\"");
                    out.push_str(self.status_now(*id).as_str());
                    out.push_str("\"}");
                    lsn = lsn.max(self.lsn_of(*id));
                }
                Some(Err((code, message))) => {
                    out.push_str("{\"error\":\"");
                    out.push_str(code);
                    out.push_str("\",\"message\":");
                    push_json_str(&mut out, message);
                    out.push('}');
                }
                None => out.push_str("{\"error\":\"internal\",\"message\":\"not answered\"}"),
            }
        }
        out.push_str("]}");
        let mut r = Response::json(202, out.into_bytes());
        r.lsn = lsn;
        self.reply(io, b.conn, r);
    }

    /// What a new task answers now: `dispatched` when it runs here, else `pending`.
    fn status_now(&self, id: TaskId) -> Status {
        if self.running.contains_key(&id) { Status::Dispatched } else { Status::Pending }
    }

    fn lsn_of(&self, id: TaskId) -> u64 {
        self.store.lsn(id)
    }

    // ----- workers -------------------------------------------------------------------------

    /// A worker's WebSocket is open. Returns its client id.
    pub fn worker_connected(&mut self, _io: &mut dyn Io, conn: ConnRef, ip: IpAddr) -> u128 {
        let client_id = uuid::Uuid::new_v4().as_u128();
        let slot = conn.slot as usize;
        if self.workers.len() <= slot {
            self.workers.resize_with(slot + 1, || None);
        }
        let w = Worker::new(conn, client_id, ip, self.wall_ms);
        self.store.worker_changed(&w.info(self.node_name.as_deref()));
        self.workers[slot] = Some(w);
        self.reach.add(&Accepts::All);
        self.order.push(conn.slot);
        crate::log!(Level::Info, "worker connected", client_id = uuid_string(client_id), ip = ip);
        // Nothing is sent before its hello (or the grace) says what it takes.
        self.wheel.arm(self.now_ms + HELLO_GRACE_MS, Timer::HelloGrace(conn));
        client_id
    }

    /// The worker may be sent tasks from now on (first text message, or the grace is over).
    fn greet(&mut self, conn: ConnRef) {
        if let Some(w) = self.worker_at_mut(conn)
            && !w.greeted
            && !w.awaiting_welcome
        {
            w.greeted = true;
            self.refresh(conn.slot);
        }
    }

    /// A worker's output buffer drained after `Io::has_room` said it was full.
    pub fn worker_drained(&mut self, io: &mut dyn Io, conn: ConnRef) {
        if let Some(w) = self.worker_at_mut(conn) {
            w.starved = false;
            self.refresh(conn.slot);
            self.settle(io);
        }
    }

    /// A worker's connection is lost (reset, or silent past PONG_WAIT): a session worker's
    /// attempts are held for RESUME_WINDOW (SPEC §12); any other's end `disconnect`.
    pub fn worker_disconnected(&mut self, io: &mut dyn Io, conn: ConnRef, why: &str) {
        if self.leave_for_restart(conn) {
            return;
        }
        if self.try_hold(conn, why) {
            self.settle(io);
            return;
        }
        self.worker_gone(io, conn, why);
    }

    /// A worker closed its connection with a close frame (it is stopping), or relay closed it:
    /// its session ends, nothing is held, its attempts end `disconnect`.
    pub fn worker_closed(&mut self, io: &mut dyn Io, conn: ConnRef, why: &str) {
        if self.leave_for_restart(conn) {
            return;
        }
        self.end_session_of(conn);
        self.worker_gone(io, conn, why);
    }

    /// Takes the worker on `conn` out of its slot, the round-robin ring and its group; returns
    /// it with the kinds it accepted.
    fn unlist(&mut self, conn: ConnRef) -> Option<(Worker, Accepts)> {
        let mut worker = self.workers.get_mut(conn.slot as usize).and_then(Option::take)?;
        if worker.conn != conn {
            self.workers[conn.slot as usize] = Some(worker);
            return None;
        }
        self.order.retain(|&s| s != conn.slot);
        let before = worker.acceptance();
        self.reach.remove(&before);
        self.groups.remove(conn.slot, &mut worker);
        Some((worker, before))
    }

    fn worker_gone(&mut self, io: &mut dyn Io, conn: ConnRef, why: &str) {
        let Some((worker, before)) = self.unlist(conn) else { return };
        crate::log!(
            Level::Info,
            "worker disconnected",
            client_id = uuid_string(worker.client_id),
            ip = worker.ip,
            reason = why,
            in_flight = worker.in_flight.len()
        );
        self.store.worker_gone(worker.client_id);
        for &id in &worker.in_flight {
            self.end_attempt(id, Outcome::Disconnect, Some("worker disconnected"), None);
        }
        // (Not while shutting down: every worker leaves then, and the tasks handed back wait
        // for the next run; failing them as unplaceable would end them for a restart.)
        if !self.shutting_down {
            self.lost_takers(&before, &Accepts::Nothing);
        }
        self.settle(io);
    }

    /// Waiting tasks of kinds a worker no longer takes may have lost their last worker.
    fn lost_takers(&mut self, before: &Accepts, after: &Accepts) {
        let lost = before.lost(after);
        if lost.as_ref().is_some_and(Vec::is_empty) {
            return;
        }
        let snapshot = Snapshot::of(self);
        self.store.fail_unplaceable(&snapshot, lost.as_deref());
    }

    /// One text message from a worker.
    pub fn worker_message(&mut self, io: &mut dyn Io, conn: ConnRef, text: &str) {
        // Any first text message, hello or not, ends the wait (a hello is applied first, so its
        // kinds and concurrency decide the first claim).
        let first = self.worker_at(conn).is_some_and(|w| !w.greeted);
        self.on_message(io, conn, text);
        if first {
            self.greet(conn);
        }
        self.settle(io);
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
                    // (Borrowed from the message: the store copies what it keeps, once.)
                    Some("done") => Ok(msg.data),
                    // Cut to 64 KiB (SPEC §7): the attempt log holds every one, and the journal's
                    // record of the task holds the log.
                    Some("failed") => Err(msg
                        .error
                        .as_deref()
                        .map_or_else(|| "worker reported failure".into(), |e| crate::tasks::cut_error(e).into_owned())),
                    _ => {
                        self.metrics.ws_messages_malformed += 1;
                        crate::log!(Level::Warn, "result without status done/failed ignored");
                        return;
                    }
                };
                let attempt = msg.attempt.map(|a| u32::try_from(a).unwrap_or(u32::MAX));
                let hint = Hint::of(msg.retry, msg.retry_after_ms);
                match id {
                    Some(id) => self.on_result(conn, id, attempt, outcome, hint),
                    None => {
                        self.metrics.ws_messages_malformed += 1;
                        crate::log!(Level::Warn, "result without a valid task_id ignored");
                    }
                }
            }
            "hello" => {
                self.on_hello(conn, msg.kinds, msg.concurrency, msg.version);
                let hello =
                    sessions::SessionHello { worker_id: msg.worker_id, session: msg.session, running: msg.running };
                self.session_hello(io, conn, hello);
            }
            other => {
                self.metrics.ws_messages_malformed += 1;
                crate::log!(Level::Warn, "unknown worker message type ignored", r#type = other);
            }
        }
    }

    fn on_hello(
        &mut self,
        conn: ConnRef,
        kinds: Option<Vec<String>>,
        concurrency: Option<u64>,
        version: Option<String>,
    ) {
        let node = self.node_name.clone();
        let Some(w) = self.worker_at_mut(conn) else { return };
        let before = w.acceptance();
        w.kinds = kinds.map(|ks| ks.into_iter().map(Box::from).collect());
        w.concurrency = concurrency.map(|c| u32::try_from(c).unwrap_or(u32::MAX));
        w.version = version.map(Box::from);
        let after = w.acceptance();
        crate::log!(
            Level::Info,
            "worker hello",
            client_id = uuid_string(w.client_id),
            kinds = w.kinds.as_ref().map_or("*".to_string(), |k| k.join(",")),
            concurrency = w.concurrency.map_or("unlimited".to_string(), |c| c.to_string())
        );
        let info = w.info(node.as_deref());
        self.store.worker_changed(&info);
        if before != after {
            self.reach.remove(&before);
            self.reach.add(&after);
            self.lost_takers(&before, &after);
        }
        self.refresh(conn.slot);
    }

    fn on_result(
        &mut self,
        conn: ConnRef,
        id: TaskId,
        attempt: Option<u32>,
        outcome: Result<Option<&RawValue>, String>,
        hint: Hint,
    ) {
        let Some(client_id) = self.worker_at(conn).map(|w| w.client_id) else { return };
        let current = self.running.get(&id).is_some_and(|r| r.client_id == client_id && r.conn == conn);
        // A result that names its attempt is accepted only for that attempt (SPEC §12).
        if current && attempt.is_some_and(|a| self.running.get(&id).is_some_and(|r| r.attempt != a)) {
            self.metrics.ignored(Ignored::Late);
            crate::log!(Level::Debug, "result for another attempt ignored", task_id = uuid_string(id));
            return;
        }
        if !current {
            let why = self.store.stray(id, client_id).unwrap_or(Ignored::Unknown);
            self.metrics.ignored(why);
            crate::log!(Level::Debug, "result ignored", task_id = uuid_string(id), reason = format!("{why:?}"));
            return;
        }
        if let Some(r) = self.running.get_mut(&id) {
            r.answered = true;
        }
        match outcome {
            Ok(data) => {
                let null;
                let result = match data {
                    Some(d) => d,
                    None => {
                        null = null_value();
                        &*null
                    }
                };
                self.end_attempt(id, Outcome::Done, None, Some(result));
            }
            Err(error) => self.end_attempt_with(id, Outcome::Failed, Some(&error), None, hint),
        }
    }

    // ----- claims and attempts -------------------------------------------------------------------

    /// Asks the store for tasks for every group of workers with free slots (one claim per
    /// group at a time). The store answers with [`Event::Claimed`]: a memory store at once, a
    /// database when its transaction commits (for a database this runs at the end of a turn).
    fn claim_round(&mut self, io: &mut dyn Io) {
        if !self.claim_wanted || self.shutting_down {
            return;
        }
        self.claim_wanted = false;
        if !self.store.may_have_ready() {
            // (A submit offered to an idle worker was claimed as it was stored: most rounds that a
            // finished attempt calls for find the queue empty.)
            return;
        }
        let mut claimed = 0;
        let mut asks = std::mem::take(&mut self.claim_asks);
        let mut takers = std::mem::take(&mut self.claim_takers);
        loop {
            asks.clear();
            asks.extend(
                self.groups
                    .groups
                    .iter()
                    .filter(|(_, g)| g.asked == 0 && g.free > 0)
                    .map(|(&gid, g)| (gid, g.free.min(u64::from(MAX_CLAIM)) as u32)),
            );
            if asks.is_empty() {
                break;
            }
            if let Some(first) = self.next_taker.take()
                && let Some(at) = asks.iter().position(|a| a.0 == first)
            {
                asks.swap(0, at);
            }
            let mut full = false;
            for &(gid, limit) in &asks {
                let workers = &self.workers;
                self.groups.takers_into(
                    gid,
                    |slot| workers.get(slot as usize).and_then(Option::as_ref).map(|w| w.client_id),
                    &mut takers,
                );
                let Some(g) = self.groups.groups.get_mut(&gid) else { continue };
                g.asked = u64::from(limit);
                let kinds = match &g.accepts {
                    Accepts::Kinds(k) => Some(k.as_slice()),
                    _ => None,
                };
                self.store.claim(&ClaimAsk { group: gid, kinds, limit, takers: &takers });
                if !self.store.answers_at_once() {
                    continue;
                }
                // The store answered already.
                let mut events = std::mem::take(&mut self.events);
                self.store.take_events(&mut events);
                for e in events.drain(..) {
                    if let Event::Claimed { group, tasks } = &e
                        && *group == gid
                    {
                        claimed += tasks.len();
                        full |= tasks.len() as u32 >= limit;
                    }
                    self.on_event(io, e);
                }
                self.events = events;
            }
            if !full {
                break;
            }
            if claimed >= CLAIMS_PER_TURN {
                // The rest next turn: the loop must stay responsive.
                self.claim_wanted = true;
                if !self.claim_timer {
                    self.claim_timer = true;
                    self.wheel.arm(self.now_ms, Timer::Claim);
                }
                break;
            }
        }
        self.claim_asks = asks;
        self.claim_takers = takers;
    }

    /// Tasks claimed for a group: each goes to the next of its workers round-robin (for its
    /// kind) that has room and has not tried it, or back to the store.
    fn on_claimed(&mut self, io: &mut dyn Io, group: u32, tasks: impl ExactSizeIterator<Item = Claimed>) {
        let asked = self.groups.groups.get(&group).map_or(0, |g| g.asked);
        if asked > 0 && tasks.len() as u64 >= asked {
            // A full claim: more may wait (a database's next transaction asks again).
            self.claim_wanted = true;
        }
        self.groups.answered(group);
        for c in tasks {
            if self.shutting_down {
                self.store.give_back(c.id, c.attempt);
                continue;
            }
            let frame_bytes = c.payload.get().len() + TASK_FRAME_OVERHEAD_BYTES;
            // The first attempt of a run: a new task's, or a re-run's (SPEC §13: its attempt
            // numbers go on, but it is a first attempt — it rotates over the workers and avoids
            // degraded ones). (`tried` alone may be empty for a retry whose worker may take it
            // again; `counted` alone is 0 for a retry after an attempt a restart cut short.)
            let first = c.counted == 0 && c.tried.is_empty();
            match self.pick(io, group, c.kind.as_deref(), &c.tried, frame_bytes, first) {
                Some(slot) => self.start(io, slot, c),
                None => {
                    // (Another group may have room for it: the next claim round asks.)
                    self.store.give_back(c.id, c.attempt);
                    self.claim_wanted = true;
                }
            }
        }
    }

    /// Round-robin over the group's workers that can take a task of `kind` now (a frame of
    /// `frame_bytes` fits in their output) and did not try it. First attempts move the kind's
    /// cursor; retries do not, so first attempts rotate whatever retries do (SPEC §5).
    fn pick(
        &mut self,
        io: &mut dyn Io,
        group: u32,
        kind: Option<&str>,
        tried: &[u128],
        frame_bytes: usize,
        first: bool,
    ) -> Option<u32> {
        let n = self.order.len();
        if n == 0 {
            return None;
        }
        let start = self.cursors.get(kind).unwrap_or(n - 1);
        // A degraded worker gets no first attempt while another worker can take it (SPEC §13):
        // a second pass, only while some worker is degraded.
        let avoid = first && self.now_ms < self.degraded_until_ms;
        for (pass, step) in (0..1 + usize::from(avoid)).flat_map(|pass| (1..=n).map(move |step| (pass, step))) {
            let i = (start + step) % n;
            let slot = self.order[i];
            if !self.groups.contains(group, slot) {
                continue;
            }
            let Some(w) = self.worker(slot) else { continue };
            if !(w.ready() && w.accepts(kind) && w.has_capacity() && !tried.contains(&w.client_id)) {
                continue;
            }
            if avoid && pass == 0 && w.health.degraded(self.now_ms) {
                continue;
            }
            let conn = w.conn;
            if !io.has_room(conn, frame_bytes) {
                if let Some(w) = self.worker_at_mut(conn) {
                    // Not eligible until it drains (the reactor says when): no attempt lost.
                    w.starved = true;
                }
                self.refresh(slot);
                continue;
            }
            if first {
                self.cursors.set(kind, i);
            }
            return Some(slot);
        }
        None
    }

    /// Starts attempt `c.attempt` on the worker in `slot`.
    fn start(&mut self, io: &mut dyn Io, slot: u32, c: Claimed) {
        let Some(w) = self.worker(slot) else {
            self.store.give_back(c.id, c.attempt);
            return;
        };
        let (conn, client_id, ip, sid) = (w.conn, w.client_id, w.ip, w.session);
        let node = self.node_name.clone();
        self.store.attempt_started(
            c.id,
            c.attempt,
            &AttemptStart {
                client_id,
                client_ip: ip,
                started_wall_ms: self.wall_ms,
                started_mono_ms: self.now_ms,
                node: node.as_deref(),
                session: sid.and_then(|s| self.sessions.tag(s)),
            },
        );
        let timer = self.wheel.arm(self.now_ms + c.timeout_ms, Timer::Attempt { task: c.id, num: c.attempt });
        let retry = c.retry();
        self.running.insert(
            c.id,
            Running {
                attempt: c.attempt,
                conn,
                client_id,
                timer,
                started_mono_ms: self.now_ms,
                timeout_ms: c.timeout_ms,
                kind: c.kind,
                max_retries: c.max_retries,
                retry,
                counted: c.counted,
                tried: c.tried,
                created_wall_ms: c.created_wall_ms,
                answered: false,
                held: None,
                resumes: 0,
                restored: false,
            },
        );
        if let Some(w) = self.workers[slot as usize].as_mut() {
            w.in_flight.push(c.id);
        }
        self.refresh(slot);
        let mut buf = uuid::Uuid::encode_buffer();
        let id_text = uuid::Uuid::from_u128(c.id).hyphenated().encode_lower(&mut buf);
        let sent = if self.has_session(conn) {
            // A session's task frames carry the attempt, which its result may echo (SPEC §12).
            // The frame leaves once the attempt's start is durable (in cluster mode: the row
            // naming its session): a crash before that would read the task back pending (or
            // leave the attempt to the lease, as a worker's without a session), so the worker's
            // resume could not adopt it and the task would run again.
            io.hold_until_durable(conn, self.store.start_mark(c.id));
            let num = c.attempt.to_string();
            io.send_text(
                conn,
                &[
                    "{\"type\":\"task\",\"task_id\":\"",
                    id_text,
                    "\",\"attempt\":",
                    &num,
                    ",\"payload\":",
                    c.payload.get(),
                    "}",
                ],
            )
        } else {
            io.send_text(conn, &["{\"type\":\"task\",\"task_id\":\"", id_text, "\",\"payload\":", c.payload.get(), "}"])
        };
        crate::log!(
            Level::Debug,
            "task dispatched",
            task_id = uuid_string(c.id),
            attempt = c.attempt,
            client_id = uuid_string(client_id)
        );
        if !sent {
            self.end_attempt(c.id, Outcome::SendFailed, Some("could not write the task to the worker"), None);
        }
    }

    /// Ends the attempt running here for `id` and decides what becomes of the task: done, a
    /// retry on an untried worker (of any node), or failed — retries used up, or nobody left
    /// to try. The one place that decides.
    fn end_attempt(&mut self, id: TaskId, outcome: Outcome, error: Option<&str>, result: Option<&RawValue>) {
        self.end_attempt_with(id, outcome, error, result, Hint::default());
    }

    /// [`Core::end_attempt`] with what the worker said about its failure (SPEC §13).
    fn end_attempt_with(
        &mut self,
        id: TaskId,
        outcome: Outcome,
        error: Option<&str>,
        result: Option<&RawValue>,
        hint: Hint,
    ) {
        let Some(r) = self.running.remove(&id) else { return };
        self.wheel.cancel(r.timer);
        if let Some(sid) = r.held {
            self.unheld(sid, id);
        }
        if let Some(w) = self.worker_at_mut(r.conn) {
            if let Some(pos) = w.in_flight.iter().position(|t| *t == id) {
                w.in_flight.swap_remove(pos);
            }
            self.refresh(r.conn.slot);
        }
        self.metrics.attempt(outcome);
        self.store.attempt_closed(id, r.client_id, r.answered);
        self.judge_worker(&r, id, outcome, hint);
        // An attempt a restart held whose worker never came back: the loss is relay's (as a
        // restart's without sessions), it uses up no retry (SPEC §12).
        let uncounted = r.restored && outcome == Outcome::Disconnect && error == Some(sessions::RESTART_ERROR);
        let end = AttemptEnd {
            outcome,
            error,
            duration_ms: self.now_ms.saturating_sub(r.started_mono_ms),
            ended_wall_ms: self.wall_ms,
            uncounted,
            resumes: r.resumes,
        };
        let next = match (outcome, result) {
            (Outcome::Done, Some(result)) => Next::Done { result },
            _ => {
                let error = error.unwrap_or("failed");
                let tried = r.tried_all();
                if self.shutting_down || uncounted {
                    // A node shutting down hands its tasks back: not the task's fault.
                    Next::Retry
                } else if hint.permanent || r.counted + 1 > r.max_retries {
                    Next::Failed { error }
                } else if self.takers().untried(r.kind.as_deref(), &tried) {
                    self.retry_later(&r, hint, None)
                } else if r.retry.any_worker.unwrap_or(self.cfg.retry_any_worker)
                    && let Some(again) = self.tried_longest_ago(r.kind.as_deref(), &tried)
                {
                    self.retry_later(&r, hint, Some(again))
                } else {
                    Next::Failed { error }
                }
            }
        };
        self.store.attempt_ended(id, r.attempt, &end, next);
        if matches!(next, Next::Retry | Next::Later(_)) {
            self.claim_wanted = true;
        }
        let _ = r.created_wall_ms;
    }

    /// A worker's attempt ended: its health follows (SPEC §13, failing workers are avoided).
    /// `failed` and `timeout` count against it (not a permanent failure, which is the task's,
    /// nor a lost connection); a success makes it healthy again.
    fn judge_worker(&mut self, r: &Running, id: TaskId, outcome: Outcome, hint: Hint) {
        let now = self.now_ms;
        let key = r.kind.as_deref().unwrap_or(NO_KIND);
        match outcome {
            Outcome::Done if !self.seen_failure => {}
            Outcome::Done => {
                match self.last_done.get_mut(key) {
                    Some(d) => *d = (now, r.client_id),
                    None => {
                        if self.last_done.len() >= MAX_CURSORS {
                            self.last_done.clear();
                        }
                        self.last_done.insert(Box::from(key), (now, r.client_id));
                    }
                }
                if let Some(w) = self.worker_at_mut(r.conn) {
                    w.health.on_done();
                }
            }
            Outcome::Failed | Outcome::Timeout if !hint.permanent => {
                self.seen_failure = true;
                let last_done = &self.last_done;
                let Some(w) = self.workers.get_mut(r.conn.slot as usize).and_then(Option::as_mut) else { return };
                if w.conn != r.conn {
                    return;
                }
                let me = w.client_id;
                let others = |kind: Option<&str>, since: u64| {
                    last_done.get(kind.unwrap_or(NO_KIND)).is_some_and(|&(at, who)| at >= since && who != me)
                };
                if w.health.on_failed(id, r.kind.as_deref(), now, others) {
                    let until = w.health.until_ms;
                    crate::log!(
                        Level::Warn,
                        "worker degraded: its recent attempts failed while other workers succeeded; no first \
                         attempts for a while",
                        client_id = uuid_string(me),
                        cool_down_ms = until - now
                    );
                    self.degraded_until_ms = self.degraded_until_ms.max(until);
                }
            }
            _ => {}
        }
    }

    /// How retry *n* (this attempt was the n-th that counts) waits (SPEC §13): a random time in
    /// `[0, min(backoff_max, backoff · 2^(n-1))]` (full jitter), and at least what the worker
    /// asked for; `again`: a worker that tried it may take it again.
    fn retry_later<'a>(&mut self, r: &Running, hint: Hint, again: Option<u128>) -> Next<'a> {
        let backoff = r.retry.backoff_ms.unwrap_or(self.cfg.retry_backoff_ms);
        let max = r.retry.backoff_max_ms.unwrap_or(self.cfg.retry_backoff_max_ms);
        let n = r.counted + 1;
        let cap = backoff.saturating_mul(1u64.checked_shl(n.saturating_sub(1)).unwrap_or(u64::MAX)).min(max);
        let jitter = if cap == 0 { 0 } else { self.rng.next_u64() % (cap + 1) };
        let wait = jitter.max(hint.after_ms.unwrap_or(0));
        if wait == 0 && again.is_none() {
            return Next::Retry;
        }
        Next::Later(Later { at_wall_ms: (wait > 0).then(|| self.wall_ms + wait), again })
    }

    /// `any_worker` (SPEC §13): of the connected workers (of any node) that could take a task
    /// of `kind` — all tried it — the one whose last attempt at it is the oldest.
    fn tried_longest_ago(&self, kind: Option<&str>, tried: &[u128]) -> Option<u128> {
        let local = self.order.iter().filter_map(|&s| self.worker(s)).filter(|w| w.accepts(kind)).map(|w| w.client_id);
        let remote = self.store.remote_workers().iter().filter(|w| w.accepts(kind)).map(|w| w.client_id);
        local.chain(remote).filter_map(|c| tried.iter().rposition(|&t| t == c).map(|at| (at, c))).min().map(|(_, c)| c)
    }

    // ----- timers ----------------------------------------------------------------------------

    /// A core timer fired (the reactor handles `Conn`, `AcceptResume` and `ShutdownDeadline`).
    pub fn on_timer(&mut self, io: &mut dyn Io, timer: Timer) {
        match timer {
            Timer::Attempt { task, num } => self.on_attempt_timeout(io, task, num),
            Timer::Wait(conn) => self.release(io, conn),
            Timer::HelloGrace(conn) => self.greet(conn),
            Timer::Session(sid) => self.session_expired(sid),
            Timer::Store => {
                self.store_timer = None;
                self.store.on_timer();
            }
            Timer::Claim => {
                self.claim_timer = false;
                self.claim_wanted = true;
            }
            Timer::Conn(_)
            | Timer::AcceptResume
            | Timer::BlobExpire(_)
            | Timer::BlobSweep
            | Timer::ShutdownDeadline => {}
        }
        self.settle(io);
    }

    fn on_attempt_timeout(&mut self, io: &mut dyn Io, id: TaskId, num: u32) {
        let Some(r) = self.running.get(&id).filter(|r| r.attempt == num) else { return };
        let (conn, timeout) = (r.conn, r.timeout_ms);
        let error = format!("no answer within {}", human_ms(timeout));
        self.end_attempt(id, Outcome::Timeout, Some(&error), None);
        // Advisory: the worker may stop; its slot is free again either way.
        send_cancel(io, conn, id);
    }

    // ----- the store's events ----------------------------------------------------------------

    /// The journal's or the database's threads woke the loop.
    pub fn on_wake(&mut self, io: &mut dyn Io) {
        self.store.on_wake();
        self.settle(io);
    }

    /// End of a loop turn: a database's claims join the turn's transaction, and the store
    /// writes what the turn did.
    pub fn end_turn(&mut self, io: &mut dyn Io) {
        self.claim_round(io);
        // (The turn's claims ask for every slot promised to its submits.)
        self.groups.forget_offers();
        self.store.end_turn();
        self.settle(io);
    }

    /// Runs what is due: the store's events, the claim round they call for, the answers of
    /// the submits stored in this step; then (re)arms the store's timer.
    fn settle(&mut self, io: &mut dyn Io) {
        for _ in 0..64 {
            let mut events = std::mem::take(&mut self.events);
            self.store.take_events(&mut events);
            let quiet = events.is_empty();
            for e in events.drain(..) {
                self.on_event(io, e);
            }
            self.events = events;
            if self.store.answers_at_once() && self.claim_wanted && !self.shutting_down {
                self.claim_round(io);
                continue;
            }
            if quiet {
                break;
            }
        }
        if self.store.answers_at_once() {
            // Every slot promised in this step was claimed or freed by now.
            self.groups.forget_offers();
        }
        // Answers last, after the step's claims: a task dispatched at once answers `dispatched`.
        let due = std::mem::take(&mut self.answers_due);
        for (conn, id, lsn) in due {
            let mut r = Response::json(202, accepted_json(id, self.status_now(id)));
            r.lsn = lsn.max(self.lsn_of(id));
            self.reply(io, conn, r);
        }
        if !self.batches.is_empty() {
            let done: Vec<u64> =
                self.batches.iter().filter(|(_, b)| b.complete && b.outstanding == 0).map(|(&k, _)| k).collect();
            for k in done {
                self.finish_batch(io, k);
            }
        }
        self.arm_store_timer();
    }

    fn arm_store_timer(&mut self) {
        let Some(at) = self.store.next_timer_ms() else { return };
        if self.store_timer.is_some_and(|(armed, _)| armed <= at) {
            return;
        }
        if let Some((_, handle)) = self.store_timer.take() {
            self.wheel.cancel(handle);
        }
        self.store_timer = Some((at, self.wheel.arm(at.max(self.now_ms), Timer::Store)));
    }

    fn on_event(&mut self, io: &mut dyn Io, e: Event) {
        match e {
            Event::Inserted { to, id } => match to {
                InsertTo::Submit { conn, wait: true } => self.hold(conn, id, true),
                InsertTo::Submit { conn, wait: false } => self.answers_due.push((conn, id, 0)),
                InsertTo::Batch { batch, index } => self.batch_done(batch, index, Ok(id)),
            },
            Event::KeyHeld { to, id, status } => match to {
                InsertTo::Submit { conn, wait } => self.answer_existing(io, conn, id, status, wait),
                InsertTo::Batch { batch, index } => self.batch_done(batch, index, Ok(id)),
            },
            Event::NotInserted { to, why } => match to {
                InsertTo::Submit { conn, .. } => {
                    let r = self.refusal_response(why);
                    self.reply(io, conn, r);
                }
                InsertTo::Batch { batch, index } => {
                    let item = match why {
                        Refusal::QueueFull => ("queue_full", "MAX_PENDING tasks are already waiting".to_string()),
                        Refusal::Unavailable | Refusal::Lost => {
                            let r = self.refusal_response(why);
                            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
                            let code = match v["error"].as_str() {
                                Some("journal_unavailable") => "journal_unavailable",
                                Some("database_unavailable") => "database_unavailable",
                                _ => "unavailable",
                            };
                            (code, v["message"].as_str().unwrap_or("the task could not be stored").to_string())
                        }
                    };
                    self.batch_done(batch, index, Err(item));
                }
            },
            Event::Key { conn, wait, held, missing } => match held {
                Some((id, status)) => self.answer_existing(io, conn, id, status, wait),
                None => self.reply(io, conn, *missing),
            },
            Event::Claimed { group, tasks } => self.on_claimed(io, group, tasks.into_iter()),
            Event::ClaimedOne { group, task } => self.on_claimed(io, group, std::iter::once(task)),
            Event::Fenced { id, attempt } => {
                // A stale write: the task was canceled, or reaped while this node was cut off.
                self.metrics.ignored(Ignored::Late);
                crate::log!(
                    Level::Info,
                    "attempt end refused by the store (the task moved on)",
                    task_id = uuid_string(id),
                    attempt = attempt
                );
            }
            Event::Final { id, status, took_ms } => {
                if let Some(ms) = took_ms {
                    self.metrics.task_final(status, ms);
                }
                self.answer_waiters(io, id);
            }
            Event::Stop { id, attempt } => self.stop(io, id, attempt),
            Event::Answer { conn, response } => self.reply(io, conn, response),
            Event::NotFinal { conn, id, post } => self.hold(conn, id, post),
            Event::Clients { conn, remote } => {
                let mut entries = self.local_infos();
                // A session's client id is listed once: a session held here whose worker has
                // resumed on another node is that node's worker now (SPEC §12), and a row of
                // another node naming a worker connected here is older than this node's word.
                if !remote.is_empty() {
                    let live: HashSet<u128> =
                        entries.iter().filter(|w| w.resumable_until_wall_ms.is_none()).map(|w| w.client_id).collect();
                    let remote: Vec<WorkerInfo> = remote.into_iter().filter(|w| !live.contains(&w.client_id)).collect();
                    let there: HashSet<u128> = remote.iter().map(|w| w.client_id).collect();
                    entries.retain(|w| w.resumable_until_wall_ms.is_none() || !there.contains(&w.client_id));
                    entries.extend(remote);
                }
                // (Stable: this node's workers in connection order, then by connection time.)
                entries.sort_by_key(|w| w.connected_wall_ms);
                let r = Response::json(200, clients_json(&entries));
                self.reply(io, conn, r);
            }
            Event::Ready => self.claim_wanted = true,
            Event::RetriesDue { kinds } => {
                let snapshot = Snapshot::of(self);
                self.store.fail_unplaceable(&snapshot, kinds.as_deref());
            }
            Event::Orphaned { tasks, error } => self.adopt_orphans(tasks, &error),
            Event::SessionTaken { conn, found } => self.session_taken(io, conn, found),
        }
    }

    /// A submit whose key names task `id` is answered for that task (SPEC §4).
    fn answer_existing(&mut self, io: &mut dyn Io, conn: ConnRef, id: TaskId, status: Status, wait: bool) {
        if !wait {
            let mut r = Response::json(202, accepted_json(id, status));
            r.lsn = self.lsn_of(id);
            self.reply(io, conn, r);
        } else if status.is_final() || self.shutting_down {
            self.read(io, id, None, conn, ReadHow::Release { post: true });
        } else {
            self.hold(conn, id, true);
        }
    }

    /// Task `id` is final: everyone waiting on it is answered.
    fn answer_waiters(&mut self, io: &mut dyn Io, id: TaskId) {
        let Some(waiters) = self.waiters.remove(&id) else { return };
        self.store.unwatch(id);
        for conn in std::iter::once(waiters.first).chain(waiters.more) {
            if let Some(held) = self.held.remove(&conn) {
                self.wheel.cancel(held.timer);
                self.read(io, id, None, conn, ReadHow::Release { post: held.post });
            }
        }
    }

    /// The task this node runs as `attempt` is over (canceled here or elsewhere, or reaped):
    /// the worker is told to stop and its slot is free; nothing more is written.
    fn stop(&mut self, io: &mut dyn Io, id: TaskId, attempt: u32) {
        let Some(r) = self.running.get(&id).filter(|r| r.attempt == attempt) else { return };
        let conn = r.conn;
        let Some(r) = self.running.remove(&id) else { return };
        self.wheel.cancel(r.timer);
        if let Some(sid) = r.held {
            self.unheld(sid, id);
        }
        self.metrics.attempt(Outcome::Canceled);
        self.store.attempt_closed(id, r.client_id, r.answered);
        if let Some(w) = self.worker_at_mut(conn) {
            if let Some(pos) = w.in_flight.iter().position(|t| *t == id) {
                w.in_flight.swap_remove(pos);
            }
            self.refresh(conn.slot);
        }
        send_cancel(io, conn, id);
    }

    /// A dead node's attempts were handed to this node: each ends `disconnect` and the core
    /// decides, as for one of its own workers.
    /// A lost node's attempts: closed `disconnect`, and their tasks pending again (SPEC §11),
    /// as a restart's are on one node — the loss is relay's, so it uses up no retry.
    fn adopt_orphans(&mut self, tasks: Vec<Claimed>, error: &str) {
        for c in tasks {
            let end = AttemptEnd {
                outcome: Outcome::Disconnect,
                error: Some(error),
                duration_ms: 0,
                ended_wall_ms: self.wall_ms,
                uncounted: true,
                resumes: 0,
            };
            self.metrics.attempt(Outcome::Disconnect);
            self.store.attempt_ended(c.id, c.attempt, &end, Next::Retry);
            self.claim_wanted = true;
        }
    }
}

/// What the workers of the whole relay could take: this node's, and other nodes' as last read.
struct TakersView<'a> {
    core: &'a Core,
    remote: &'a [WorkerInfo],
}

impl Takers for TakersView<'_> {
    fn untried(&self, kind: Option<&str>, tried: &[u128]) -> bool {
        let local = self
            .core
            .order
            .iter()
            .filter_map(|&s| self.core.worker(s))
            .any(|w| w.accepts(kind) && !tried.contains(&w.client_id));
        local || self.remote.iter().any(|w| w.accepts(kind) && !tried.contains(&w.client_id))
    }

    fn count(&self, kind: Option<&str>) -> usize {
        self.core.reach.count(kind) + self.remote.iter().filter(|w| w.accepts(kind)).count()
    }
}

/// [`TakersView`] copied out, so that the store can be asked while the core is borrowed.
struct Snapshot {
    workers: Vec<WorkerInfo>,
}

impl Snapshot {
    fn of(core: &Core) -> Snapshot {
        let mut workers = core.local_infos();
        workers.extend(core.store.remote_workers().iter().cloned());
        workers.retain(|w| w.active);
        Snapshot { workers }
    }
}

impl Takers for Snapshot {
    fn untried(&self, kind: Option<&str>, tried: &[u128]) -> bool {
        self.workers.iter().any(|w| w.accepts(kind) && !tried.contains(&w.client_id))
    }

    fn count(&self, kind: Option<&str>) -> usize {
        self.workers.iter().filter(|w| w.accepts(kind)).count()
    }
}

/// `{"count": n, "clients": [...]}` (one writer for both modes).
fn clients_json(entries: &[WorkerInfo]) -> Vec<u8> {
    let mut s = String::with_capacity(32 + entries.len() * 220);
    s.push_str("{\"count\":");
    s.push_str(&entries.len().to_string());
    s.push_str(",\"clients\":[");
    for (i, w) in entries.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        w.write_json(&mut s);
    }
    s.push_str("]}");
    s.into_bytes()
}

impl Core {
    /// The answer to a submit the store did not keep.
    fn refusal_response(&self, why: Refusal) -> Response {
        match why {
            Refusal::QueueFull => crate::store::queue_full_response(),
            Refusal::Unavailable => self
                .store
                .unavailable(true)
                .unwrap_or_else(|| Response::error(503, "unavailable", "the task could not be stored; try again")),
            Refusal::Lost => crate::store::lost_response(),
        }
    }
}

fn null_value() -> Box<RawValue> {
    RawValue::from_string("null".into()).unwrap_or_else(|_| unreachable!("null is JSON"))
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

#[cfg(test)]
mod tests;
