//! The memory store: every task relay knows, in memory, made durable by the journal when
//! `DATA_DIR` is set (`durable.rs`). It answers the seam's operations at once — its events are
//! ready when a call returns — so a submit is answered in the loop turn that read it.
//!
//! It keeps the task table, the pending queues (due order, ties in submission order: SPEC §7),
//! the schedule, the idempotency keys, the listing index, the tasks that expire, and which
//! waiting tasks may lose their last worker (`fragile.rs`). It decides nothing about workers:
//! the core says who runs what and what an attempt's end means.
//!
//! Time comes in through [`MemStore::set_clock`]; nothing here reads a clock or touches a file
//! (the journal's threads do).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::BuildHasherDefault;

use serde_json::value::RawValue;

use super::{
    AttemptEnd, AttemptStart, ClaimAsk, Claimed, Event, Insert, InsertTo, Next, ReadHow, Refusal, StoreHealth, Takers,
    WorkerInfo,
};
use crate::http::Response;
use crate::journal::Journal;
use crate::log::Level;
use crate::metrics::Ignored;
use crate::tasks::{
    Attempt, ConnRef, Evicted, IdHasher, Place, Status, Stored, Task, TaskId, TaskTable, task_response, uuid_string,
};
use flow::LaneOf;
use fragile::{Fragile, KindKey};

mod durable;
mod flow;
mod fragile;
mod listing;
mod rerun;

/// (token identity, `Idempotency-Key` header).
type IdempotencyKey = (Box<str>, Box<str>);

/// A pending queue's order: due time (wall clock; in the ready queues less the priority's head
/// start, SPEC §14), then submission.
type QueueKey = (u64, u64);

/// A ready task's place in the ready queues: due time less its priority's head start, then
/// submission (SPEC §14; with priority 0, §7's due order).
fn ready_key(task: &Task) -> QueueKey {
    let head_start = i64::from(task.priority) * 1000;
    let ord = if head_start >= 0 {
        task.due_wall_ms.saturating_sub(head_start as u64)
    } else {
        task.due_wall_ms.saturating_add(head_start.unsigned_abs())
    };
    (ord, task.submit_seq)
}

/// How far one claim may look past tasks its takers all tried (retries waiting for another
/// worker) before it stops.
const MAX_CLAIM_SKIP: usize = 4096;

/// Kinds one [`Event::RetriesDue`] names at most (beyond: the next timer run).
const MAX_RETRY_KINDS_DUE: usize = 64;

/// Tasks carried forward by one compaction step (bounded work per loop turn).
const COMPACT_TASKS_PER_TURN: usize = 4096;
/// Finished tasks evicted from memory per loop turn at most.
const EVICT_PER_TURN: usize = 8192;
/// Journal bytes waiting for the disk beyond which new submits wait (backpressure).
pub const JOURNAL_BACKLOG_BYTES: u64 = 64 << 20;

#[derive(Debug, Clone)]
pub struct MemConfig {
    pub task_ttl_ms: u64,
    /// How long failed tasks are kept (`FAILED_TTL`, SPEC §13; 0: as long as `task_ttl_ms`).
    pub failed_ttl_ms: u64,
    pub max_pending: usize,
    /// Payload bytes (JSON text as received) of the tasks waiting as pending, at most.
    pub max_pending_bytes: usize,
    /// Memory for finished tasks (`TASK_MEMORY`); beyond it the oldest leave memory.
    pub task_memory_bytes: usize,
    pub task_timeout_ms: u64,
    pub max_retries: u32,
}

impl MemConfig {
    /// How long a final task of `status` is kept (SPEC §13: failed ones `FAILED_TTL`).
    pub fn ttl_of(&self, status: Status) -> u64 {
        if status == Status::Failed && self.failed_ttl_ms > 0 { self.failed_ttl_ms } else { self.task_ttl_ms }
    }
}

/// How a task read back from the journal is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReadFor {
    /// A read of one task (`post`: a submit's codes).
    One { post: bool },
    /// `DELETE`: the task is final already, 409.
    Cancel,
    /// One task of a listing page: `page` names it, `index` is its place.
    Page { page: u64, index: usize },
    /// `POST /tasks/{id}/retry` of a task that left memory: back in, and run again.
    Rerun { wait: bool },
    /// A task a bulk re-run picked (`POST /tasks/retry`): `job` names it, `at` the pick.
    Bulk { job: u64, at: u64 },
}

struct PendingRead {
    conn: ConnRef,
    id: TaskId,
    purpose: ReadFor,
    scope: Option<Vec<String>>,
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

/// Small, fast, non-cryptographic generator for task ids (xoshiro256**), seeded from the OS.
pub struct Rng([u64; 4]);

impl Rng {
    pub fn from_os() -> Rng {
        let a = uuid::Uuid::new_v4().as_u128();
        let b = uuid::Uuid::new_v4().as_u128();
        Rng([a as u64 | 1, (a >> 64) as u64, b as u64, (b >> 64) as u64])
    }
    pub fn next_u64(&mut self) -> u64 {
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
    pub fn uuid(&mut self) -> u128 {
        let raw = (u128::from(self.next_u64()) << 64) | u128::from(self.next_u64());
        (raw & !(0xF << 76) & !(0x3 << 62)) | (0x4 << 76) | (0x2 << 62)
    }
}

/// Whether a task of `kind` is visible to a caller scoped to `scope` (`None`: every kind; a
/// scoped caller never sees tasks without a kind).
pub fn in_scope(kind: Option<&str>, scope: Option<&[String]>) -> bool {
    scope.is_none_or(|kinds| kind.is_some_and(|k| kinds.iter().any(|own| own == k)))
}

pub struct MemStore {
    cfg: MemConfig,
    /// The attempts of tasks dropped from memory (evicted or forgotten), for [`MemStore::stray`].
    recent: crate::store::recent::Recent,
    now_ms: u64,
    wall_ms: u64,
    tasks: TaskTable,
    status_counts: [usize; Status::COUNT],
    /// Payload bytes of the tasks whose status is pending (bounded by MAX_PENDING_BYTES).
    pending_bytes: usize,
    /// The ready lanes and kinds (`flow.rs`): per kind a rotation over submitters and keys,
    /// policies, and the next task of every open kind.
    flow: flow::Flow,
    /// Ready first attempts by their real due time (the ready queues' order includes the
    /// priority): they expire TASK_TTL after they fell due.
    ready_due: BTreeMap<QueueKey, TaskId>,
    /// Ready tasks that fail when no untried worker that could take them is connected.
    fragile: Fragile,
    scheduled: BTreeMap<QueueKey, TaskId>,
    /// Kinds of retries whose backoff ended in this timer run ([`Event::RetriesDue`]).
    retries_due: Option<Vec<fragile::KindKey>>,
    retries_due_all: bool,
    /// Final tasks in finishing order, with the time (monotonic) they are forgotten.
    finished: VecDeque<(u64, TaskId)>,
    /// Failed tasks kept another while (`FAILED_TTL` beyond `TASK_TTL`, moved here from
    /// `finished`) or forgotten sooner (`FAILED_TTL` below it), with the time they are forgotten.
    failed_extra: VecDeque<(u64, TaskId)>,
    /// Failed and canceled tasks, in memory or left it (`evicted`), by submission: what
    /// `POST /tasks/retry` walks.
    dead: BTreeMap<u64, TaskId>,
    /// Bulk re-runs under way (`POST /tasks/retry`), a bounded slice a loop turn (`rerun.rs`).
    bulk_reruns: std::collections::VecDeque<rerun::BulkRerun>,
    idempotency: HashMap<IdempotencyKey, TaskId>,
    idempotency_expiry: VecDeque<(u64, IdempotencyKey)>,
    /// The earliest time a due task may expire in the queue (monotonic), if one waits.
    next_expiry_ms: Option<u64>,
    /// Every known task by its submission sequence number, for the listing (newest first).
    by_submission: BTreeMap<u64, TaskId>,
    next_seq: u64,
    rng: Rng,
    journal: Option<Box<Journal>>,
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
    events: Vec<Event>,
    /// A restart holds the attempts session workers ran (RESUME_WINDOW is not 0): they stay
    /// dispatched and are listed in `restored_held` for the core (SPEC §12).
    pub hold_sessions: bool,
    pub restored_held: Vec<crate::store::RestoredAttempt>,
    /// Finished tasks evicted from memory (`relay_tasks_evicted_total`).
    pub tasks_evicted: u64,
}

impl MemStore {
    pub fn new(cfg: MemConfig, journal: Option<Box<Journal>>) -> MemStore {
        MemStore {
            recent: crate::store::recent::Recent::default(),
            cfg,
            now_ms: 0,
            wall_ms: 0,
            tasks: TaskTable::default(),
            status_counts: [0; Status::COUNT],
            pending_bytes: 0,
            flow: flow::Flow::new(journal.is_some()),
            ready_due: BTreeMap::new(),
            fragile: Fragile::default(),
            scheduled: BTreeMap::new(),
            retries_due: Some(Vec::new()),
            retries_due_all: false,
            finished: VecDeque::new(),
            failed_extra: VecDeque::new(),
            dead: BTreeMap::new(),
            bulk_reruns: std::collections::VecDeque::new(),
            idempotency: HashMap::new(),
            idempotency_expiry: VecDeque::new(),
            next_expiry_ms: None,
            by_submission: BTreeMap::new(),
            next_seq: 0,
            rng: Rng::from_os(),
            journal,
            evicted: HashMap::default(),
            finished_mem: 0,
            evict_next: 0,
            reads: HashMap::new(),
            pages: HashMap::new(),
            next_read: 1,
            compacting: None,
            compacted_upto: 0,
            logged_forgetting: false,
            events: Vec::new(),
            hold_sessions: false,
            restored_held: Vec::new(),
            tasks_evicted: 0,
        }
    }

    pub fn set_clock(&mut self, now_ms: u64, wall_ms: u64) {
        self.now_ms = now_ms;
        self.wall_ms = wall_ms;
    }

    // ----- queries (the model test and the gauges read them) ------------------------------

    pub fn task(&self, id: TaskId) -> Option<&Task> {
        self.tasks.get(&id)
    }

    pub fn evicted(&self, id: TaskId) -> Option<&Evicted> {
        self.evicted.get(&id)
    }

    pub fn evicted_count(&self) -> usize {
        self.evicted.len()
    }

    pub fn finished_mem_bytes(&self) -> usize {
        self.finished_mem
    }

    pub fn task_count(&self, status: Status) -> usize {
        self.status_counts[status.index()]
    }

    /// Tasks by submission, newest first, strictly below submission number `below`.
    pub fn tasks_newest_first(&self, below: u64) -> impl Iterator<Item = (u64, TaskId)> + '_ {
        self.by_submission.range(..below).rev().map(|(&seq, &id)| (seq, id))
    }

    pub fn journal(&self) -> Option<&Journal> {
        self.journal.as_deref()
    }

    pub fn journal_mut(&mut self) -> Option<&mut Journal> {
        self.journal.as_deref_mut()
    }

    pub fn health(&self) -> StoreHealth {
        let mut counts = [0u64; Status::COUNT];
        for (c, n) in counts.iter_mut().zip(self.status_counts) {
            *c = n as u64;
        }
        StoreHealth { counts, node: None, database_up: None, journal_up: self.journal.as_ref().map(|j| j.writable()) }
    }

    // ----- inserts ---------------------------------------------------------------------------

    /// Whether one more pending task of `bytes` of payload fits in MAX_PENDING and
    /// MAX_PENDING_BYTES (SPEC §7): a submit's question, and a re-run's.
    pub(super) fn pending_room(&self, bytes: usize) -> bool {
        self.task_count(Status::Pending) < self.cfg.max_pending
            && self.pending_bytes + bytes <= self.cfg.max_pending_bytes
    }

    /// A re-run's payload bytes (what it adds to MAX_PENDING_BYTES).
    pub(super) fn rerun_bytes(task: &Task) -> usize {
        task.payload.as_ref().map_or(0, |p| p.get().len())
    }

    pub fn insert(&mut self, new: &Insert<'_>, to: InsertTo) {
        if let Some((owner, key)) = new.idempotency
            && let Some(id) = self.key_holder(owner, key)
        {
            let status = self.status_of(id).unwrap_or(Status::Pending);
            self.events.push(Event::KeyHeld { to, id, status });
            return;
        }
        if !self.writable() {
            // (A repeat is answered above: it writes nothing.)
            self.events.push(Event::NotInserted { to, why: Refusal::Unavailable });
            return;
        }
        let bytes = new.payload.get().len();
        if !new.runs_now && !self.pending_room(bytes) {
            self.events.push(Event::NotInserted { to, why: Refusal::QueueFull });
            return;
        }
        let mut id = self.rng.uuid();
        while self.tasks.contains_key(&id) || self.evicted.contains_key(&id) {
            id = self.rng.uuid();
        }
        let seq = self.take_seq();
        let due_wall_ms = new.run_at_wall_ms.map_or(self.wall_ms, |at| at.max(self.wall_ms));
        let task = Task {
            id,
            status: Status::Pending,
            kind: new.kind.map(Box::from),
            payload: Some(new.payload.into()),
            created_wall_ms: self.wall_ms,
            run_at_wall_ms: new.run_at_wall_ms,
            due_wall_ms,
            max_retries: new.max_retries.unwrap_or(self.cfg.max_retries),
            timeout_ms: new.timeout_ms.unwrap_or(self.cfg.task_timeout_ms),
            submit_seq: seq,
            priority: new.priority,
            submitter: Box::from(new.submitter),
            key: Box::from(new.key),
            queued: new.queue || new.run_at_wall_ms.is_some(),
            idempotency: new.idempotency.map(|(owner, key)| Box::new((Box::from(owner), Box::from(key)))),
            retry: new.retry,
            ..Task::default()
        };
        self.tasks.insert(id, task);
        self.record(id, Rec::Whole);
        self.by_submission.insert(seq, id);
        self.status_counts[Status::Pending.index()] += 1;
        let lane = LaneOf { kind: new.kind, submitter: new.submitter, key: new.key };
        self.flow.count_kind(lane, None, Some(Status::Pending), self.wall_ms, &mut self.events);
        self.pending_bytes += bytes;
        crate::log!(Level::Debug, "task accepted", task_id = uuid_string(id), kind = new.kind.unwrap_or("-"));
        if let Some((owner, key)) = new.idempotency {
            self.remember_key((Box::from(owner), Box::from(key)), id, self.cfg.task_ttl_ms);
        }
        self.events.push(Event::Inserted { to, id });
        if due_wall_ms > self.wall_ms {
            self.schedule(id);
        } else if let Some(group) = new
            .claim_group
            .filter(|_| self.flow.heads.is_empty() && self.writable() && self.flow.admit_now(lane, self.wall_ms))
        {
            // Nothing older waits to be claimed: the idle group takes it as it is stored.
            if let Some(task) = self.claimed(id) {
                self.events.push(Event::ClaimedOne { group, task });
            }
        } else {
            self.enqueue_ready(id);
            self.events.push(Event::Ready);
        }
    }

    pub fn lookup_key(&mut self, owner: &str, key: &str, conn: ConnRef, wait: bool, missing: Response) {
        let held = self.key_holder(owner, key).map(|id| (id, self.status_of(id).unwrap_or(Status::Pending)));
        self.events.push(Event::Key { conn, wait, held, missing: Box::new(missing) });
    }

    /// The task an `Idempotency-Key` of this token identity names, if it still exists.
    fn key_holder(&self, owner: &str, key: &str) -> Option<TaskId> {
        let id = *self.idempotency.get(&(Box::from(owner), Box::from(key)))?;
        (self.tasks.contains_key(&id) || self.evicted.contains_key(&id)).then_some(id)
    }

    fn status_of(&self, id: TaskId) -> Option<Status> {
        self.tasks.get(&id).map(|t| t.status).or_else(|| self.evicted.get(&id).map(|e| e.status))
    }

    fn take_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    fn remember_key(&mut self, key: IdempotencyKey, id: TaskId, lives_ms: u64) {
        let expires = self.now_ms + lives_ms;
        self.idempotency.insert(key.clone(), id);
        self.idempotency_expiry.push_back((expires, key));
    }

    // ----- queues ------------------------------------------------------------------------------

    fn enqueue_ready(&mut self, id: TaskId) {
        let Some(task) = self.tasks.get_mut(&id) else { return };
        let was_claimed = task.place == Place::Claimed;
        task.place = Place::Ready;
        let key = ready_key(task);
        let attempts = task.attempts.len();
        // (A re-run is a queued task until an attempt of its own run failed.)
        let fragile = (!task.this_run().is_empty() || !task.queued) && !task.restored;
        if fragile {
            self.fragile.insert(task.kind.as_deref(), id, attempts);
        }
        let Some(task) = self.tasks.get(&id) else { return };
        self.flow.lane_insert(LaneOf::of(task), key, id);
        if was_claimed {
            self.flow.count_claimed(LaneOf::of(task), false, self.wall_ms, &mut self.events);
        }
        if attempts == 0 {
            // A first attempt expires TASK_TTL after it fell due.
            self.ready_due.insert((task.due_wall_ms, task.submit_seq), id);
            let at = self.now_ms + (task.due_wall_ms + self.cfg.task_ttl_ms).saturating_sub(self.wall_ms);
            if self.next_expiry_ms.is_none_or(|e| at < e) {
                self.next_expiry_ms = Some(at);
            }
        }
    }

    fn schedule(&mut self, id: TaskId) {
        let Some(task) = self.tasks.get_mut(&id) else { return };
        task.place = Place::Scheduled;
        self.scheduled.insert((task.due_wall_ms, task.submit_seq), id);
    }

    /// Takes a pending task out of whichever queue holds it.
    fn unqueue(&mut self, id: TaskId) {
        let Some(task) = self.tasks.get_mut(&id) else { return };
        let key = (task.due_wall_ms, task.submit_seq);
        let place = std::mem::replace(&mut task.place, Place::Nowhere);
        match place {
            Place::Ready => {
                if task.attempts.is_empty() {
                    self.ready_due.remove(&key);
                }
                self.fragile.remove(task.kind.as_deref(), id, task.attempts.len());
                self.flow.lane_remove(LaneOf::of(task), ready_key(task), self.wall_ms);
            }
            Place::Scheduled => {
                self.scheduled.remove(&key);
            }
            Place::Claimed => self.flow.count_claimed(LaneOf::of(task), false, self.wall_ms, &mut self.events),
            Place::Nowhere => {}
        }
    }

    /// The one place a task's status changes.
    fn set_status(&mut self, id: TaskId, status: Status) {
        let Some(task) = self.tasks.get_mut(&id) else { return };
        if task.status == status {
            return;
        }
        debug_assert!(!task.status.is_final(), "a final task never changes status");
        let bytes = task.payload.as_ref().map_or(0, |p| p.get().len());
        if task.status == Status::Pending {
            self.pending_bytes -= bytes;
        } else if status == Status::Pending {
            self.pending_bytes += bytes;
        }
        self.status_counts[task.status.index()] -= 1;
        self.status_counts[status.index()] += 1;
        let from = std::mem::replace(&mut task.status, status);
        self.flow.count_kind(LaneOf::of(task), Some(from), Some(status), self.wall_ms, &mut self.events);
    }

    // ----- claims and attempts -----------------------------------------------------------------

    pub fn claim(&mut self, ask: &ClaimAsk<'_>) {
        // (A full journal: no attempt starts, since its result could not be kept; the workers
        // claim again once it can write.)
        let tasks = if self.writable() { self.claim_tasks(ask) } else { Vec::new() };
        self.events.push(Event::Claimed { group: ask.group, tasks });
    }

    /// Task `id`, out of every queue, as a claim hands it over.
    fn claimed(&mut self, id: TaskId) -> Option<Claimed> {
        let task = self.tasks.get_mut(&id)?;
        let payload = task.payload.clone()?;
        task.place = Place::Claimed;
        self.flow.count_claimed(LaneOf::of(task), true, self.wall_ms, &mut self.events);
        Some(Claimed {
            id,
            attempt: task.attempts.len() as u32 + 1,
            kind: task.kind.clone(),
            payload,
            timeout_ms: task.timeout_ms,
            max_retries: task.max_retries,
            retry: Claimed::boxed_retry(task.retry),
            tried: task.tried_by(),
            counted: task.counted(),
            created_wall_ms: task.created_wall_ms,
        })
    }

    pub fn give_back(&mut self, id: TaskId, attempt: u32) {
        let Some(task) = self.tasks.get(&id) else { return };
        if task.place == Place::Claimed && task.attempts.len() as u32 + 1 == attempt {
            self.enqueue_ready(id);
        }
    }

    /// An event of the core's own making, answered through the store like the others.
    pub fn push_event(&mut self, e: Event) {
        self.events.push(e);
    }

    pub fn attempt_started(&mut self, id: TaskId, attempt: u32, start: &AttemptStart<'_>) {
        let Some(task) = self.tasks.get_mut(&id) else { return };
        if task.place != Place::Claimed || task.attempts.len() as u32 + 1 != attempt {
            debug_assert!(false, "an attempt starts only on a claimed task");
            return;
        }
        task.place = Place::Nowhere;
        task.next_attempt_wall_ms = None;
        let mut a = Attempt::new(start.client_id, start.client_ip, start.started_wall_ms);
        a.node = start.node.map(Box::from);
        a.session = start.session.map(|(worker_id, secret)| {
            Box::new(crate::tasks::SessionTag { worker_id: worker_id.into(), secret: secret.into() })
        });
        // (Most tasks have one attempt: room for exactly one, which the final task's
        // `shrink_to_fit` keeps as it is, where a push would take four and copy them to one.)
        if task.attempts.capacity() == 0 {
            task.attempts.reserve_exact(1);
        }
        task.attempts.push(a);
        self.set_status(id, Status::Dispatched);
        if let Some(task) = self.tasks.get(&id) {
            self.flow.count_claimed(LaneOf::of(task), false, self.wall_ms, &mut self.events);
        }
        self.record(id, Rec::AttemptStarted);
    }

    pub fn attempt_ended(&mut self, id: TaskId, attempt: u32, end: &AttemptEnd<'_>, next: Next<'_>) {
        let Some(task) = self.tasks.get_mut(&id) else {
            self.events.push(Event::Fenced { id, attempt });
            return;
        };
        let open = task.status == Status::Dispatched
            && task.attempts.len() as u32 == attempt
            && task.attempts.last().is_some_and(|a| a.outcome.is_none());
        if !open {
            self.events.push(Event::Fenced { id, attempt });
            return;
        }
        if let Some(a) = task.attempts.last_mut() {
            a.outcome = Some(end.outcome);
            a.error = end.error.map(Box::from);
            a.duration_ms = end.duration_ms;
            a.restarted |= end.uncounted;
            a.resumes = end.resumes;
            a.answered |= matches!(end.outcome, crate::tasks::Outcome::Done | crate::tasks::Outcome::Failed);
        }
        let later = match next {
            Next::Retry => Some(super::Later::default()),
            Next::Later(l) => Some(l),
            _ => None,
        };
        if let Some(later) = later {
            let wait = later.at_wall_ms.filter(|&at| at > self.wall_ms);
            task.next_attempt_wall_ms = wait;
            task.again = later.again;
            self.set_status(id, Status::Pending);
            self.record(id, Rec::AttemptEnded);
            match wait {
                Some(at) => {
                    // It waits out its backoff like a scheduled task, and is due when it ends
                    // (SPEC §13): due order counts from then.
                    if let Some(task) = self.tasks.get_mut(&id) {
                        task.due_wall_ms = at;
                    }
                    self.schedule(id);
                }
                None => {
                    // (It keeps its place: due order is the order it fell due in, SPEC §7.)
                    self.enqueue_ready(id);
                    self.events.push(Event::Ready);
                }
            }
            return;
        }
        match next {
            Next::Retry | Next::Later(_) => {}
            Next::Done { result } => self.finalize(id, Status::Done, Some(result.to_owned()), None),
            Next::Failed { error } => self.finalize(id, Status::Failed, None, Some(error)),
        }
    }

    /// An attempt closed: nothing to remember yet (its task's attempt log tells, until the task
    /// leaves memory: [`MemStore::remember_attempts`]).
    pub fn attempt_closed(&mut self, _id: TaskId, _client_id: u128, _answered: bool) {}

    /// The attempts of a task about to leave memory, remembered for [`MemStore::stray`].
    pub(super) fn remember_attempts(&mut self, task: &Task) {
        for a in &task.attempts {
            self.recent.remember(task.id, a.client_id, a.answered);
        }
    }

    /// A result for a task its worker no longer runs: `late` or `duplicate` when the worker
    /// ran it, `None` when this store does not know that it did.
    pub fn stray(&mut self, id: TaskId, client_id: u128) -> Option<Ignored> {
        let Some(task) = self.tasks.get_mut(&id) else { return self.recent.stray(id, client_id) };
        let a = task.attempts.iter_mut().rev().find(|a| a.client_id == client_id)?;
        let why = if a.answered { Ignored::Duplicate } else { Ignored::Late };
        a.answered = true;
        Some(why)
    }

    /// A task becomes final: its record is written, and it is kept for TASK_TTL.
    fn finalize(&mut self, id: TaskId, status: Status, result: Option<Box<RawValue>>, error: Option<&str>) {
        debug_assert!(status.is_final());
        self.unqueue(id);
        self.set_status(id, status);
        let Some(task) = self.tasks.get_mut(&id) else { return };
        task.finished_wall_ms = Some(self.wall_ms);
        // A task that is done never runs again: its payload is not kept for TASK_TTL (a failed
        // or canceled one keeps it, to be run again, SPEC §13).
        if status == Status::Done {
            task.payload = None;
        }
        task.attempts.shrink_to_fit();
        task.result = result;
        task.error = error.map(Box::from);
        self.finished_mem += task.mem_bytes();
        let took_ms = self.wall_ms.saturating_sub(task.created_wall_ms);
        if matches!(status, Status::Failed | Status::Canceled) {
            self.dead.insert(task.submit_seq, id);
        }
        task.finished_mono_ms = self.now_ms;
        self.record(id, Rec::Whole);
        self.finished.push_back((self.now_ms + self.cfg.task_ttl_ms, id));
        if status == Status::Failed && self.cfg.ttl_of(status) < self.cfg.task_ttl_ms {
            self.failed_extra.push_back((self.now_ms + self.cfg.ttl_of(status), id));
        }
        crate::log!(Level::Debug, "task final", task_id = uuid_string(id), status = status.as_str());
        self.events.push(Event::Final { id, status, took_ms: Some(took_ms) });
    }

    pub fn fail_unplaceable(&mut self, takers: &dyn Takers, kinds: Option<&[KindKey]>) {
        if self.fragile.is_empty() {
            return;
        }
        let mut hopeless = Vec::new();
        for kind in self.fragile.kinds_among(kinds) {
            let count = takers.count(kind.as_deref());
            if count == 0 {
                hopeless.extend(self.fragile.all_of(&kind));
            } else {
                for id in self.fragile.retries_with_at_least(&kind, count) {
                    let Some(t) = self.tasks.get(&id) else { continue };
                    let tried = t.tried_by();
                    if !takers.untried(kind.as_deref(), &tried) {
                        hopeless.push(id);
                    }
                }
            }
        }
        for id in hopeless {
            let error = self
                .tasks
                .get(&id)
                .and_then(Task::last_error)
                .unwrap_or("no connected worker can take this task any more")
                .to_string();
            self.finalize(id, Status::Failed, None, Some(&error));
        }
    }

    // ----- cancel and reads ------------------------------------------------------------------

    pub fn cancel(&mut self, id: TaskId, scope: Option<&[String]>, conn: ConnRef) {
        let Some(task) = self.tasks.get_mut(&id) else {
            if !self.read_evicted(conn, id, ReadFor::Cancel, scope) {
                self.answer(conn, not_found());
            }
            return;
        };
        if !in_scope(task.kind.as_deref(), scope) {
            self.answer(conn, not_found());
            return;
        }
        if !task.status.is_final()
            && let Some(r) = self.unavailable(true)
        {
            self.answer(conn, r);
            return;
        }
        let Some(task) = self.tasks.get_mut(&id) else { return };
        match task.status {
            Status::Pending => {}
            Status::Dispatched => {
                let wall = self.wall_ms;
                let attempt = task.attempts.len() as u32;
                if let Some(a) = task.attempts.last_mut().filter(|a| a.outcome.is_none()) {
                    a.outcome = Some(crate::tasks::Outcome::Canceled);
                    a.duration_ms = wall.saturating_sub(a.started_wall_ms);
                }
                self.events.push(Event::Stop { id, attempt });
            }
            _ => {
                let mut r = task_response(task, false);
                r.status = 409;
                self.answer(conn, r);
                return;
            }
        }
        self.finalize(id, Status::Canceled, None, None);
        if let Some(task) = self.tasks.get(&id) {
            let r = task_response(task, false);
            self.answer(conn, r);
        }
    }

    /// The answer, when it is ready in the call (a task in memory); else `None` and an event
    /// follows ([`Event::NotFinal`], or the answer once a task on disk is read back).
    pub fn read(&mut self, id: TaskId, scope: Option<&[String]>, conn: ConnRef, how: ReadHow) -> Option<Response> {
        let post = matches!(how, ReadHow::Wait { post: true } | ReadHow::Release { post: true });
        match self.tasks.get(&id) {
            Some(task) if !in_scope(task.kind.as_deref(), scope) => Some(not_found()),
            Some(task) if matches!(how, ReadHow::Wait { .. }) && !task.status.is_final() => {
                self.events.push(Event::NotFinal { conn, id, post });
                None
            }
            Some(task) => {
                self.note_waiting(task);
                Some(match how {
                    ReadHow::Get { payload: true } => crate::tasks::task_response_with_payload(task),
                    _ => task_response(task, post),
                })
            }
            None => (!self.read_evicted(conn, id, ReadFor::One { post }, scope)).then(not_found),
        }
    }

    fn answer(&mut self, conn: ConnRef, response: Response) {
        self.events.push(Event::Answer { conn, response });
    }

    pub fn watch(&mut self, _id: TaskId) {}

    pub fn unwatch(&mut self, _id: TaskId) {}

    pub fn list_workers(&mut self, conn: ConnRef) {
        self.events.push(Event::Clients { conn, remote: Vec::new() });
    }

    pub fn worker_changed(&mut self, _w: &WorkerInfo) {}

    pub fn worker_gone(&mut self, _client_id: u128) {}

    pub fn remote_workers(&self) -> &[WorkerInfo] {
        &[]
    }

    pub fn take_events(&mut self, out: &mut Vec<Event>) {
        if out.is_empty() {
            // (The core's buffer is empty: the two trade places, no event is moved.)
            std::mem::swap(out, &mut self.events);
        } else {
            out.append(&mut self.events);
        }
    }

    // ----- time --------------------------------------------------------------------------------

    pub fn next_timer_ms(&self) -> Option<u64> {
        let due = self.scheduled.first_key_value().map(|(&(due, _), _)| self.now_ms + due.saturating_sub(self.wall_ms));
        let sweep = [
            self.finished.front().map(|f| f.0),
            self.failed_extra.front().map(|f| f.0),
            self.idempotency_expiry.front().map(|f| f.0),
            self.next_expiry_ms,
        ];
        // (A bulk re-run under way: its next slice in the next turn.)
        let rerun = self.bulk_rerun_due().then_some(self.now_ms);
        // (A plain fold, not a chain of iterators: this runs twice per sync task.)
        let [a, b, c, d] = sweep;
        [due, a, b, c, d, self.next_rate_wake_ms(), rerun].into_iter().fold(None, |m, t| match (m, t) {
            (Some(m), Some(t)) => Some(m.min(t)),
            (m, None) => m,
            (None, t) => t,
        })
    }

    pub fn on_timer(&mut self) {
        self.bulk_rerun_slice();
        self.on_rate_wakes();
        self.on_schedule();
        self.on_sweep();
    }

    fn on_schedule(&mut self) {
        let mut any = false;
        while let Some((&(due, seq), &id)) = self.scheduled.first_key_value() {
            if due > self.wall_ms {
                break;
            }
            self.scheduled.remove(&(due, seq));
            if let Some(task) = self.tasks.get_mut(&id) {
                task.place = Place::Nowhere;
                if !task.attempts.is_empty() && !task.restored {
                    // A retry whose backoff ended: its last possible worker may have left
                    // meanwhile (the core asks, SPEC §5).
                    let kind = task.kind.clone();
                    if let Some(due) = &mut self.retries_due
                        && !due.contains(&kind)
                    {
                        if due.len() < MAX_RETRY_KINDS_DUE {
                            due.push(kind);
                        } else {
                            // (Many kinds at once: every kind is looked at.)
                            self.retries_due_all = true;
                        }
                    }
                }
                self.enqueue_ready(id);
                any = true;
            }
        }
        if any {
            self.events.push(Event::Ready);
        }
        let due = self.retries_due.as_mut().map(std::mem::take).unwrap_or_default();
        if self.retries_due_all {
            self.retries_due_all = false;
            self.events.push(Event::RetriesDue { kinds: None });
        } else if !due.is_empty() {
            self.events.push(Event::RetriesDue { kinds: Some(due) });
        }
    }

    fn on_sweep(&mut self) {
        let now = self.now_ms;
        while let Some(&(at, id)) = self.finished.front() {
            if at > now {
                break;
            }
            self.finished.pop_front();
            self.evict_next = self.evict_next.saturating_sub(1);
            let Some((status, finished)) = self.final_state(id) else { continue };
            if finished != 0 && finished != at.saturating_sub(self.cfg.task_ttl_ms) {
                // Re-run since (SPEC §13): this entry is of an earlier end.
                continue;
            }
            let keep = self.cfg.ttl_of(status);
            if keep > self.cfg.task_ttl_ms {
                // A failed task is kept FAILED_TTL.
                self.failed_extra.push_back((at + (keep - self.cfg.task_ttl_ms), id));
                continue;
            }
            self.forget(id);
        }
        while let Some(&(at, id)) = self.failed_extra.front() {
            if at > now {
                break;
            }
            self.failed_extra.pop_front();
            let Some((status, finished)) = self.final_state(id) else { continue };
            if status != Status::Failed || (finished != 0 && finished != at.saturating_sub(self.cfg.ttl_of(status))) {
                continue;
            }
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
        if self.next_expiry_ms.is_some_and(|at| at <= now) {
            self.expire_in_queue();
        }
    }

    /// Pending tasks expire TASK_TTL after they fell due; the queue is in due order. A retry
    /// waiting for an untried worker's capacity does not expire: it ends when no untried
    /// worker is left (with its last error) or runs when one frees up.
    fn expire_in_queue(&mut self) {
        let (now, wall, ttl) = (self.now_ms, self.wall_ms, self.cfg.task_ttl_ms);
        let mut expired = Vec::new();
        self.next_expiry_ms = None;
        for (&(due, _), &id) in &self.ready_due {
            if due + ttl > wall {
                self.next_expiry_ms = Some(now + (due + ttl - wall));
                break;
            }
            expired.push(id);
        }
        for id in expired {
            self.finalize(id, Status::Failed, None, Some("expired in queue"));
        }
    }

    /// A final task's status and when it became final (monotonic; 0: unknown), in memory or not.
    fn final_state(&self, id: TaskId) -> Option<(Status, u64)> {
        match self.tasks.get(&id) {
            Some(t) => t.status.is_final().then_some((t.status, t.finished_mono_ms)),
            None => self.evicted.get(&id).map(|e| (e.status, e.finished_mono_ms)),
        }
    }

    /// TASK_TTL has passed since the task finished: it is gone, from memory and journal.
    fn forget(&mut self, id: TaskId) {
        let stored = if let Some(task) = self.tasks.get(&id).filter(|t| t.status.is_final()) {
            self.status_counts[task.status.index()] -= 1;
            self.finished_mem = self.finished_mem.saturating_sub(task.mem_bytes());
            let stored = task.stored;
            self.by_submission.remove(&task.submit_seq);
            self.dead.remove(&task.submit_seq);
            if let Some(task) = self.tasks.remove(&id) {
                self.remember_attempts(&task);
            }
            stored
        } else if let Some(e) = self.evicted.remove(&id) {
            self.status_counts[e.status.index()] -= 1;
            self.by_submission.remove(&e.submit_seq);
            self.dead.remove(&e.submit_seq);
            Stored { lsn: 0, home: e.loc, segs: [e.loc.seg, 0, 0] }
        } else {
            return;
        };
        if let Some(j) = &mut self.journal {
            j.forget(id, &stored);
        }
    }

    // ----- the store's availability ------------------------------------------------------------

    /// The journal can write (always without one). While it cannot — a full disk — requests
    /// that must write are refused and no attempt starts (SPEC §7).
    /// Some task is ready to be claimed (O(1): the first task of every open lane is in `heads`;
    /// a lane its kind's policy holds back has none to give).
    pub fn has_ready(&self) -> bool {
        !self.flow.heads.is_empty()
    }

    pub fn writable(&self) -> bool {
        self.journal.as_ref().is_none_or(|j| j.writable())
    }

    pub fn unavailable(&self, write: bool) -> Option<Response> {
        (write && !self.writable()).then(|| {
            Response::error(
                503,
                "journal_unavailable",
                "the journal cannot write (no space on the disk of DATA_DIR); reads go on, try again later",
            )
        })
    }

    /// Journal bytes wait for the disk: new submits wait (only while it can write: one that
    /// cannot answers 503 instead).
    pub fn backlog_full(&self) -> bool {
        self.journal.as_ref().is_some_and(|j| j.writable() && j.backlog_bytes() > JOURNAL_BACKLOG_BYTES)
    }

    pub fn flushed(&self) -> bool {
        true
    }

    pub fn stop(&mut self) -> Result<(), String> {
        if let Some(j) = &mut self.journal {
            j.stop();
            if j.failed() {
                return Err("the journal could not be written".into());
            }
        }
        Ok(())
    }
}

/// Which record a task change needs.
#[derive(Clone, Copy)]
enum Rec {
    Whole,
    AttemptStarted,
    AttemptEnded,
}

impl MemStore {
    /// Writes the record a change of task `id` needs (nothing in memory-only mode).
    fn record(&mut self, id: TaskId, rec: Rec) {
        let Some(j) = &mut self.journal else { return };
        let Some(task) = self.tasks.get_mut(&id) else { return };
        let mut stored = task.stored;
        match rec {
            Rec::Whole => j.task(task, &mut stored),
            Rec::AttemptStarted => j.attempt_started(task, &mut stored),
            Rec::AttemptEnded => j.attempt_ended(task, &mut stored),
        }
        task.stored = stored;
    }
}

fn not_found() -> Response {
    Response::error(404, "not_found", "no such task")
}
