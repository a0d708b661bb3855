//! The task-store seam (ARCHITECTURE.md, "One core, two stores"). The dispatch core
//! (`dispatch`) decides — which worker gets a task, what an attempt's end means, who waits for
//! what and what they are answered; a store keeps the tasks and answers queue operations:
//! insert, key lookup, claim due tasks for workers that can take them, give back, attempt
//! started and ended, cancel, read, list. There are two stores, chosen once at start:
//!
//! - [`mem::MemStore`]: the tasks in memory, made durable by the journal (`DATA_DIR`) or not.
//!   Every operation completes at once: its events are ready before the call returns, so a
//!   submit is answered in the loop turn that read it.
//! - [`pg::PgStore`]: PostgreSQL, shared by every node of a cluster. Operations are queued and
//!   leave at the end of the loop turn as one transaction (group commit); their events arrive
//!   when it commits.
//!
//! The core sees neither SQL, rows nor journal records: only the operations below and the
//! [`Event`]s they produce. Answers to reads are built here, by the one task JSON writer
//! (`tasks::Task::write_json`) and the one status → code map (`tasks::task_response`).
//!
//! No I/O on the loop thread: the journal's and the database's threads do it and wake the loop.

use std::net::IpAddr;

use serde_json::value::RawValue;

use crate::http::Response;
use crate::tasks::{ConnRef, Outcome, RetryPolicy, Status, TaskId};

pub mod mem;
pub mod pg;
pub mod recent;

/// A new task as the API hands it to the core (validated and authorised).
#[derive(Debug, Clone, Copy)]
pub struct NewTask<'a> {
    pub payload: &'a RawValue,
    pub kind: Option<&'a str>,
    pub run_at_wall_ms: Option<u64>,
    /// Submitted with `queue: true` (or a schedule): it waits for a worker however long.
    pub queue: bool,
    /// Per-task overrides (`None`: the configured default).
    pub timeout_ms: Option<u64>,
    pub max_retries: Option<u32>,
    /// Its own retry policy (SPEC §13).
    pub retry: RetryPolicy,
    /// Seconds of head start among due tasks (SPEC §14; 0: none).
    pub priority: i32,
    /// Who submits it and its fairness key (SPEC §14: `""` the root token / no key).
    pub submitter: &'a str,
    pub key: &'a str,
    /// (token identity, `Idempotency-Key`).
    pub idempotency: Option<(&'a str, &'a str)>,
}

impl<'a> NewTask<'a> {
    /// A task of `kind` that waits for a worker however long, every other field its default.
    pub fn queued(payload: &'a RawValue, kind: Option<&'a str>) -> NewTask<'a> {
        NewTask {
            payload,
            kind,
            run_at_wall_ms: None,
            queue: true,
            timeout_ms: None,
            max_retries: None,
            retry: RetryPolicy::default(),
            priority: 0,
            submitter: "",
            key: "",
            idempotency: None,
        }
    }
}

/// A new task as the core hands it to a store: the task, and whether a worker of this node
/// takes it at once.
#[derive(Debug, Clone, Copy)]
pub struct Insert<'a> {
    pub task: NewTask<'a>,
    /// A worker of this node that can take it has room now: it will not wait, so MAX_PENDING
    /// does not refuse it (SPEC §7 bounds the tasks that *wait*).
    pub runs_now: bool,
    /// With `runs_now`: the group of this node's workers with room for it. A store that can
    /// claims it for them as it inserts it, when no older task waits to be claimed first
    /// ([`Event::ClaimedOne`] right after [`Event::Inserted`]); else it queues it and sends
    /// [`Event::Ready`], so the core claims as usual.
    pub claim_group: Option<u32>,
}

impl<'a> From<NewTask<'a>> for Insert<'a> {
    /// An insert no worker of this node takes at once.
    fn from(task: NewTask<'a>) -> Insert<'a> {
        Insert { task, runs_now: false, claim_group: None }
    }
}

impl<'a> std::ops::Deref for Insert<'a> {
    type Target = NewTask<'a>;
    fn deref(&self) -> &NewTask<'a> {
        &self.task
    }
}

impl std::ops::DerefMut for Insert<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.task
    }
}

/// Who is answered when an insert completes (carried through the store untouched).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InsertTo {
    /// `POST /tasks`; `wait`: `?wait=true`.
    Submit { conn: ConnRef, wait: bool },
    /// Item `index` of the batch the core knows as `batch`.
    Batch { batch: u64, index: u32 },
}

/// Why a store did not keep a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// 429: MAX_PENDING tasks, or MAX_PENDING_BYTES of payload, already wait.
    QueueFull,
    /// 503: the store cannot write now (the journal's disk is full, the database unreachable).
    Unavailable,
    /// 503: the database connection broke during the transaction (it may have committed).
    Lost,
}

/// How a read of one task is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadHow {
    /// `GET /tasks/{id}`: 200; `payload`: with the task's payload (`?include=payload`).
    Get { payload: bool },
    /// `wait=true`: the task if it is final, else [`Event::NotFinal`] (the core holds the
    /// request). `post`: a submit's status codes.
    Wait { post: bool },
    /// The wait is over (WAIT_TIMEOUT, shutdown, final): the task as it is now.
    Release { post: bool },
}

/// What a claim asks for: tasks that are due, in dispatch order, that one of `takers` (the
/// client ids of this node's workers with room, at most [`MAX_TAKERS`]) accepts and has not
/// tried.
#[derive(Debug, Clone, Copy)]
pub struct ClaimAsk<'a> {
    /// The core's name for this group of workers (echoed in [`Event::Claimed`]).
    pub group: u32,
    /// `None`: every kind, and tasks without one.
    pub kinds: Option<&'a [Box<str>]>,
    pub limit: u32,
    pub takers: &'a [u128],
}

/// Takers listed in one claim at most (a claim is bounded anyway; a task every listed taker
/// tried waits for the next claim, which lists others).
pub const MAX_TAKERS: usize = 64;

/// A task a claim took: from now on attempt `attempt` is this node's to run.
#[derive(Debug)]
pub struct Claimed {
    pub id: TaskId,
    /// The number of the attempt about to start: the fencing number of every write about it.
    pub attempt: u32,
    pub kind: Option<Box<str>>,
    pub payload: crate::tasks::Payload,
    pub timeout_ms: u64,
    pub max_retries: u32,
    /// The task's own retry policy (SPEC §13), if it has one: boxed, so that a claim (and the
    /// event that carries one) stays small enough to be moved without a call to `memcpy`.
    pub retry: Option<Box<RetryPolicy>>,
    /// Workers already sent the task (client ids, in the order they were), but one made
    /// eligible again ([`Later::again`]).
    pub tried: Vec<u128>,
    /// Earlier attempts that count against `max_retries` (a relay restart's do not).
    pub counted: u32,
    /// Submitted (wall clock), for the submit-to-final histogram.
    pub created_wall_ms: u64,
}

impl Claimed {
    /// The task's retry policy (the default's when it has none of its own).
    pub fn retry(&self) -> RetryPolicy {
        self.retry.as_deref().copied().unwrap_or_default()
    }

    /// A policy as a claim holds it.
    pub fn boxed_retry(retry: RetryPolicy) -> Option<Box<RetryPolicy>> {
        (!retry.is_default()).then(|| Box::new(retry))
    }
}

/// An attempt a session worker was running when relay stopped (a crash or a SIGTERM), read
/// back from the journal: the core holds it for RESUME_WINDOW from the restart (SPEC §12).
#[derive(Debug)]
pub struct RestoredAttempt {
    /// The task as a claim would hand it over (`attempt` is the open attempt's number).
    pub task: Claimed,
    pub client_id: u128,
    pub client_ip: IpAddr,
    pub started_wall_ms: u64,
    pub session: crate::tasks::SessionTag,
}

/// Who runs an attempt that starts.
#[derive(Debug, Clone, Copy)]
pub struct AttemptStart<'a> {
    pub client_id: u128,
    pub client_ip: IpAddr,
    pub started_wall_ms: u64,
    pub started_mono_ms: u64,
    /// The node's name (cluster mode): the attempt_log entry carries it (SPEC §11).
    pub node: Option<&'a str>,
    /// The worker's session (worker id, secret), if it has one (SPEC §12): kept with the
    /// attempt, so that a restart holds it for the worker to resume.
    pub session: Option<(&'a str, &'a str)>,
}

/// How an attempt ended.
#[derive(Debug, Clone, Copy)]
pub struct AttemptEnd<'a> {
    pub outcome: Outcome,
    pub error: Option<&'a str>,
    pub duration_ms: u64,
    pub ended_wall_ms: u64,
    /// Closed by a loss of relay's own (a lost node): not counted against `max_retries`, and
    /// the task waits for a worker however long it takes, as one read back after a restart.
    pub uncounted: bool,
    /// Times a resuming worker took the attempt back (SPEC §12): its attempt_log entry counts them.
    pub resumes: u32,
}

/// What becomes of the task after an attempt ended: the core's decision.
#[derive(Debug, Clone, Copy)]
pub enum Next<'a> {
    /// Back to pending, for another worker.
    Retry,
    /// Back to pending, after a wait and/or for a worker that tried it (SPEC §13).
    Later(Later),
    /// `done`, with the worker's data.
    Done { result: &'a RawValue },
    /// `failed`, with this error.
    Failed { error: &'a str },
}

/// `POST /tasks/retry`: which final tasks to run again (SPEC §13), checked by the API.
#[derive(Debug, Clone)]
pub struct RerunFilter {
    /// `failed` (the default) or `canceled`.
    pub status: Status,
    pub kind: Option<String>,
    /// A substring of the task's final error (exact bytes).
    pub error_contains: Option<String>,
    /// Finished strictly after this (wall clock, ms).
    pub finished_after_ms: Option<u64>,
    /// At most this many (≤ [`MAX_RERUN_LIMIT`]).
    pub limit: u32,
    /// Only count: nothing is re-run.
    pub dry_run: bool,
}

/// The most tasks one `POST /tasks/retry` re-runs.
pub const MAX_RERUN_LIMIT: u32 = 10_000;
/// The newest tasks one `POST /tasks/retry` looks at, at most (bounded work in one statement or
/// one loop turn; a filter that matches older ones is repeated).
pub const RERUN_SCAN: usize = 100_000;

/// 429 `queue_full` (SPEC §7): MAX_PENDING tasks or MAX_PENDING_BYTES of payload already wait —
/// for a submit, and for a re-run, which puts a task back among them (SPEC §13).
pub fn queue_full_response() -> Response {
    Response::error(
        429,
        "queue_full",
        "the queue is full (MAX_PENDING tasks or MAX_PENDING_BYTES of payload already wait)",
    )
}

/// The answer of `POST /tasks/retry`: `{"retried": n, "task_ids": [...]}`.
pub fn rerun_answer(ids: &[TaskId]) -> Response {
    let mut s = String::with_capacity(32 + ids.len() * 40);
    s.push_str("{\"retried\":");
    crate::tasks::push_u64(&mut s, ids.len() as u64);
    s.push_str(",\"task_ids\":[");
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push('"');
        crate::tasks::push_uuid(&mut s, *id);
        s.push('"');
    }
    s.push_str("]}");
    Response::json(200, s.into_bytes())
}

/// How a retry waits (SPEC §13).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Later {
    /// Not claimable before this (wall clock): its backoff, or the worker's `retry_after_ms`.
    pub at_wall_ms: Option<u64>,
    /// A worker that tried it and may take it again (`any_worker`: no untried eligible worker
    /// is connected; the one tried longest ago).
    pub again: Option<u128>,
}

/// What a store tells the core. A memory store's events are ready when the operation
/// returns; a database's arrive when its transaction commits.
#[derive(Debug)]
pub enum Event {
    /// A new task is stored.
    Inserted { to: InsertTo, id: TaskId },
    /// The submit's `Idempotency-Key` is held by task `id` (nothing new was stored).
    KeyHeld { to: InsertTo, id: TaskId, status: Status },
    /// Nothing was stored.
    NotInserted { to: InsertTo, why: Refusal },
    /// A keyed submit that will not be stored asked whether its key names a task: `held`; if
    /// not, `missing` is its answer.
    /// (`missing` is boxed: the rare event does not make every event larger.)
    Key { conn: ConnRef, wait: bool, held: Option<(TaskId, Status)>, missing: Box<Response> },
    /// Tasks claimed for the workers of `group`.
    Claimed { group: u32, tasks: Vec<Claimed> },
    /// One task claimed for `group` as it was stored (the same as [`Event::Claimed`] with one
    /// task, without a vector to allocate on the submit's fast path).
    ClaimedOne { group: u32, task: Claimed },
    /// The store refused to record the end of this attempt: the task moved on (canceled, or
    /// reaped while this node was cut off). A result that ended it counts `late`.
    Fenced { id: TaskId, attempt: u32 },
    /// The task is final (its record is written): waiters may be answered. `took_ms`: this
    /// node made it final, so many ms after it was submitted (counted in its metrics).
    Final { id: TaskId, status: Status, took_ms: Option<u64> },
    /// The task this node runs as attempt `attempt` is over elsewhere (canceled, or reaped):
    /// the worker is told to stop and its slot is free. Nothing is written.
    Stop { id: TaskId, attempt: u32 },
    /// A read's answer.
    Answer { conn: ConnRef, response: Response },
    /// A `wait=true` read found the task not final: the core holds the request.
    NotFinal { conn: ConnRef, id: TaskId, post: bool },
    /// `/clients`: the workers of other nodes (cluster mode).
    Clients { conn: ConnRef, remote: Vec<WorkerInfo> },
    /// Tasks became due or went back to pending: idle workers may claim.
    Ready,
    /// Retries of these kinds (`None`: of any) finished waiting out their backoff: those whose
    /// last possible worker left meanwhile fail ([`Store::fail_unplaceable`]).
    RetriesDue { kinds: Option<Vec<Option<Box<str>>>> },
    /// Attempts of a dead node were handed to this node to close (`disconnect`, naming the
    /// lost node); the core decides what becomes of each task.
    Orphaned { tasks: Vec<Claimed>, error: String },
    /// [`Store::take_session`]'s answer: the session's attempts that were held on other nodes
    /// are this node's now (empty: none; the session is unknown, or its window is over).
    SessionTaken { conn: ConnRef, found: Vec<RestoredAttempt> },
}

/// A worker as `/clients` shows it (one writer for this node's and other nodes' workers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerInfo {
    pub client_id: u128,
    pub ip: String,
    pub connected_wall_ms: u64,
    pub active: bool,
    pub in_flight: u32,
    /// `None`: no kinds declared (every kind).
    pub kinds: Option<Vec<String>>,
    pub concurrency: Option<u32>,
    pub version: Option<String>,
    /// The node it is connected to (cluster mode).
    pub node: Option<String>,
    /// `None`: it takes every kind's tasks (for the core's "can anyone take it" questions).
    pub node_id: Option<u128>,
    /// A session worker whose connection was lost: until when it may resume (SPEC §12).
    pub resumable_until_wall_ms: Option<u64>,
    /// Its recent attempts keep failing while others succeed (SPEC §13): no first attempts
    /// for a while. Judged by the node it is connected to.
    pub degraded: bool,
}

impl WorkerInfo {
    /// Whether it would take a task of `kind` (active, kinds aside).
    pub fn accepts(&self, kind: Option<&str>) -> bool {
        self.active
            && match &self.kinds {
                None => true,
                Some(kinds) => kind.is_some_and(|k| kinds.iter().any(|own| own == k)),
            }
    }

    /// Appends its `/clients` entry.
    pub fn write_json(&self, s: &mut String) {
        use crate::tasks::{push_json_str, push_u64, push_uuid};
        s.push_str("{\"client_id\":\"");
        push_uuid(s, self.client_id);
        s.push_str("\",\"ip\":");
        push_json_str(s, &self.ip);
        s.push_str(",\"connected_at\":\"");
        crate::timefmt::write_rfc3339_ms(s, self.connected_wall_ms);
        s.push_str("\",\"active\":");
        s.push_str(if self.active { "true" } else { "false" });
        s.push_str(",\"in_flight\":");
        push_u64(s, u64::from(self.in_flight));
        if let Some(kinds) = &self.kinds {
            s.push_str(",\"kinds\":[");
            for (j, k) in kinds.iter().enumerate() {
                if j > 0 {
                    s.push(',');
                }
                push_json_str(s, k);
            }
            s.push(']');
        }
        if let Some(c) = self.concurrency {
            s.push_str(",\"concurrency\":");
            push_u64(s, u64::from(c));
        }
        if let Some(v) = &self.version {
            s.push_str(",\"version\":");
            push_json_str(s, v);
        }
        if let Some(n) = &self.node {
            s.push_str(",\"node\":");
            push_json_str(s, n);
        }
        if self.degraded {
            s.push_str(",\"degraded\":true");
        }
        if let Some(until) = self.resumable_until_wall_ms {
            s.push_str(",\"resumable_until\":\"");
            crate::timefmt::write_rfc3339_ms(s, until);
            s.push('"');
        }
        s.push('}');
    }
}

/// What the workers of the whole relay could take, for a store's questions about waiting tasks
/// that may have lost their last possible worker (SPEC §5).
pub trait Takers {
    /// Is an active worker connected that takes `kind` and is not one of `tried`?
    fn untried(&self, kind: Option<&str>, tried: &[u128]) -> bool;
    /// How many active workers take `kind`.
    fn count(&self, kind: Option<&str>) -> usize;
}

/// The store's state for `/healthz` and `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct StoreHealth {
    /// Tasks by status (`Status::index` order); cluster mode: cluster-wide, ≤ 1 s old.
    pub counts: [u64; Status::COUNT],
    /// Cluster mode: this node's name, and whether the database answers.
    pub node: Option<String>,
    pub database_up: Option<bool>,
    /// With a journal: whether it can write (SPEC §7: `"journal":"full"`).
    pub journal_up: Option<bool>,
}

impl StoreHealth {
    pub fn ok(&self) -> bool {
        self.database_up != Some(false) && self.journal_up != Some(false)
    }
}

/// The store, chosen once at start (ripgrep's one enum over two matchers).
pub enum Store {
    Mem(Box<mem::MemStore>),
    Pg(Box<pg::PgStore>),
}

/// Forwards a call to whichever store this is.
macro_rules! each {
    ($self:expr, $s:ident => $e:expr) => {
        match $self {
            Store::Mem($s) => $e,
            Store::Pg($s) => $e,
        }
    };
}

impl Store {
    /// Sets the clocks of the current loop turn (the reactor reads them; the store never does).
    pub fn set_clock(&mut self, now_ms: u64, wall_ms: u64) {
        each!(self, s => s.set_clock(now_ms, wall_ms))
    }

    /// Stores a new task (or finds the task its key names): [`Event::Inserted`],
    /// [`Event::KeyHeld`] or [`Event::NotInserted`].
    pub fn insert(&mut self, new: &Insert<'_>, to: InsertTo) {
        each!(self, s => s.insert(new, to))
    }

    /// [`Event::Key`].
    pub fn lookup_key(&mut self, owner: &str, key: &str, conn: ConnRef, wait: bool, missing: Response) {
        each!(self, s => s.lookup_key(owner, key, conn, wait, missing))
    }

    /// [`Event::Claimed`] (possibly empty).
    pub fn claim(&mut self, ask: &ClaimAsk<'_>) {
        each!(self, s => s.claim(ask))
    }

    /// A claimed task the core could not send after all: pending again, attempt `attempt`
    /// never happened.
    pub fn give_back(&mut self, id: TaskId, attempt: u32) {
        each!(self, s => s.give_back(id, attempt))
    }

    pub fn attempt_started(&mut self, id: TaskId, attempt: u32, start: &AttemptStart<'_>) {
        each!(self, s => s.attempt_started(id, attempt, start))
    }

    /// Records an attempt's end and what becomes of the task ([`Event::Final`] when final,
    /// [`Event::Fenced`] if the store refused it).
    pub fn attempt_ended(&mut self, id: TaskId, attempt: u32, end: &AttemptEnd<'_>, next: Next<'_>) {
        each!(self, s => s.attempt_ended(id, attempt, end, next))
    }

    /// `DELETE /tasks/{id}`: [`Event::Answer`] (200, 409 or 404), [`Event::Stop`] when an
    /// attempt of this node's was running, [`Event::Final`] when canceled.
    pub fn cancel(&mut self, id: TaskId, scope: Option<&[String]>, conn: ConnRef) {
        each!(self, s => s.cancel(id, scope, conn))
    }

    /// `POST /tasks/{id}/retry` (SPEC §13): a failed or canceled task pending again, with a
    /// fresh retry budget, its attempt log kept. [`Event::Answer`] (202, 409, 404), or with
    /// `wait` [`Event::NotFinal`] once it is pending again; [`Event::Ready`].
    pub fn rerun(&mut self, id: TaskId, scope: Option<&[String]>, conn: ConnRef, wait: bool) {
        each!(self, s => s.rerun(id, scope, conn, wait))
    }

    /// `POST /tasks/retry`: [`Event::Answer`] with [`rerun_answer`].
    pub fn rerun_many(&mut self, filter: &RerunFilter, scope: Option<&[String]>, conn: ConnRef) {
        each!(self, s => s.rerun_many(filter, scope, conn))
    }

    /// The answer when the store has it within the call (a memory store's task in memory: no
    /// event, no second step for the core); else `None` and [`Event::Answer`] or
    /// [`Event::NotFinal`] follows.
    #[must_use]
    pub fn read(&mut self, id: TaskId, scope: Option<&[String]>, conn: ConnRef, how: ReadHow) -> Option<Response> {
        each!(self, s => s.read(id, scope, conn, how))
    }

    /// `GET /tasks`: [`Event::Answer`].
    pub fn list(&mut self, q: &crate::listing::Query, scope: Option<&[String]>, conn: ConnRef) {
        each!(self, s => s.list(q, scope, conn))
    }

    /// The core holds requests waiting for `id` (a database must look for its end; a memory
    /// store reports every end anyway).
    pub fn watch(&mut self, id: TaskId) {
        each!(self, s => s.watch(id))
    }

    pub fn unwatch(&mut self, id: TaskId) {
        each!(self, s => s.unwatch(id))
    }

    /// `GET/PUT/DELETE /kinds/{kind}`, `GET /kinds` (SPEC §14): [`Event::Answer`], a change
    /// once it is durable.
    pub fn kind_op(&mut self, op: crate::flow::KindOp, conn: ConnRef) {
        each!(self, s => s.kind_op(op, conn))
    }

    /// The next piece of an answer a store began as [`crate::stream::BodyStream`] (`GET
    /// /kinds`: the memory store's from its kinds as they are, the database store's from the
    /// rows of its read, which the stream holds).
    pub fn stream_piece(&self, stream: &mut crate::stream::BodyStream, out: &mut String) {
        match self {
            Store::Mem(m) => m.stream_piece(stream, out),
            Store::Pg(_) => stream.write_made_piece(out),
        }
    }

    /// Is the kind paused (as this node knows its policy)? Its submits wait (SPEC §14).
    pub fn kind_paused(&self, kind: Option<&str>) -> bool {
        each!(self, s => s.kind_paused(kind))
    }

    /// `/clients`: [`Event::Clients`].
    pub fn list_workers(&mut self, conn: ConnRef) {
        each!(self, s => s.list_workers(conn))
    }

    /// A worker of this node arrived or changed (cluster mode writes its row).
    pub fn worker_changed(&mut self, w: &WorkerInfo) {
        each!(self, s => s.worker_changed(w))
    }

    /// Only the number of tasks a worker runs changed (cheap: no row is built for it).
    pub fn worker_busy(&mut self, client_id: u128, in_flight: u32) {
        if let Store::Pg(s) = self {
            s.worker_busy(client_id, in_flight);
        }
    }

    pub fn worker_gone(&mut self, client_id: u128) {
        each!(self, s => s.worker_gone(client_id))
    }

    /// Other nodes' workers as last read (≤ 1 s old; empty on one node).
    pub fn remote_workers(&self) -> &[WorkerInfo] {
        each!(self, s => s.remote_workers())
    }

    /// Waiting tasks that need a worker now (retries, and submits without `queue` or a
    /// schedule) fail once no untried worker that could take them is connected. `kinds`: the
    /// kinds whose takers went away (`None` in the list: tasks without a kind; `None`: any).
    pub fn fail_unplaceable(&mut self, takers: &dyn Takers, kinds: Option<&[Option<Box<str>>]>) {
        each!(self, s => s.fail_unplaceable(takers, kinds))
    }

    /// Takes what happened since the last call.
    pub fn take_events(&mut self, out: &mut Vec<Event>) {
        each!(self, s => s.take_events(out))
    }

    /// The journal's or the database's threads woke the loop.
    pub fn on_wake(&mut self) {
        each!(self, s => s.on_wake())
    }

    /// When the store wants [`Store::on_timer`] (the loop's monotonic clock, ms).
    pub fn next_timer_ms(&self) -> Option<u64> {
        each!(self, s => s.next_timer_ms())
    }

    pub fn on_timer(&mut self) {
        each!(self, s => s.on_timer())
    }

    /// End of a loop turn: what the turn wrote leaves (the journal's group commit, the
    /// database's one transaction).
    pub fn end_turn(&mut self) {
        each!(self, s => s.end_turn())
    }

    /// `Some(503)` while the store cannot serve a request that writes (`write`) or reads: a
    /// full disk stops writes only (SPEC §7), an unreachable database both (SPEC §11).
    pub fn unavailable(&self, write: bool) -> Option<Response> {
        each!(self, s => s.unavailable(write))
    }

    /// Too many written bytes wait for the disk or the database: new submits wait.
    pub fn backlog_full(&self) -> bool {
        each!(self, s => s.backlog_full())
    }

    pub fn health(&self) -> StoreHealth {
        each!(self, s => s.health())
    }

    /// Nothing is in flight or waiting to be written (shutdown waits for this).
    pub fn flushed(&self) -> bool {
        each!(self, s => s.flushed())
    }

    /// A claim is answered within the call (the memory store: its events are there to take at
    /// once); a database store answers with a later turn, after its transaction.
    pub fn answers_at_once(&self) -> bool {
        matches!(self, Store::Mem(_))
    }

    /// Whether a claim could find a task now: `false` only when the store knows, at no cost, that
    /// none is ready (the memory store's queues are empty); a database is asked.
    pub fn may_have_ready(&self) -> bool {
        match self {
            Store::Mem(s) => s.has_ready(),
            Store::Pg(_) => true,
        }
    }

    /// The journal record that must be durable before an answer about task `id` leaves (0: none
    /// is needed, as with a database store, whose answers leave after their COMMIT).
    pub fn lsn(&self, id: TaskId) -> u64 {
        match self {
            Store::Mem(s) => s.task(id).map_or(0, |t| t.stored.lsn),
            Store::Pg(_) => 0,
        }
    }

    /// Why a result for an attempt the core no longer runs is ignored: `late` or `duplicate`
    /// when the store knows the worker ran the task (its attempt log, or the attempts it
    /// remembers, [`recent`]), `None` when it does not.
    pub fn stray(&mut self, id: TaskId, client_id: u128) -> Option<crate::metrics::Ignored> {
        each!(self, s => s.stray(id, client_id))
    }

    /// An attempt of worker `client_id` closed on this node (`answered`: its worker answered):
    /// a store without the task's attempt log at hand remembers it for [`Store::stray`].
    pub fn attempt_closed(&mut self, id: TaskId, client_id: u128, answered: bool) {
        each!(self, s => s.attempt_closed(id, client_id, answered))
    }

    /// Sessions are shared by the nodes of a cluster: a session this node does not know may be
    /// held on another ([`Store::take_session`]).
    pub fn shares_sessions(&self) -> bool {
        matches!(self, Store::Pg(_))
    }

    /// A worker on `conn` presents a session this node does not know: [`Event::SessionTaken`].
    pub fn take_session(&mut self, conn: ConnRef, worker_id: &str, secret: &str) {
        match self {
            Store::Pg(s) => s.take_session(conn, worker_id, secret),
            Store::Mem(s) => s.push_event(Event::SessionTaken { conn, found: Vec::new() }),
        }
    }

    /// A restart holds session workers' running attempts (a journal, and RESUME_WINDOW not 0):
    /// a shutdown leaves them open for the next run (SPEC §12).
    pub fn holds_restarts(&self) -> bool {
        match self {
            Store::Mem(s) => s.hold_sessions && s.journal().is_some(),
            // (A stopped node's session attempts wait RESUME_WINDOW after its last heartbeat.)
            Store::Pg(s) => s.resume_window_ms > 0,
        }
    }

    /// Attempts of session workers read back at start, for the core to hold (SPEC §12); taken
    /// once.
    pub fn take_restored(&mut self) -> Vec<RestoredAttempt> {
        match self {
            Store::Mem(s) => std::mem::take(&mut s.restored_held),
            Store::Pg(_) => Vec::new(),
        }
    }

    /// The store's own figures for `/metrics`.
    pub fn gauges(&self, g: &mut crate::metrics::Gauges) {
        match self {
            Store::Mem(m) => {
                g.finished_memory_bytes = m.finished_mem_bytes();
                g.tasks_on_disk = m.evicted_count();
                g.tasks_evicted = m.tasks_evicted;
                g.journal = m.journal().map(|j| crate::metrics::JournalGauges {
                    bytes: j.disk_bytes(),
                    segments: j.segment_count(),
                    backlog_bytes: j.backlog_bytes(),
                    syncs: j.syncs(),
                    records: j.records_written,
                    corrupt_records: j.records_skipped_at_start,
                    full: !j.writable(),
                    deletes_failing: j.deletes_failing(),
                });
                m.kind_gauges(g);
            }
            Store::Pg(p) => {
                g.cluster = Some(p.gauges());
                p.kind_gauges(g);
            }
        }
    }

    /// Every journal record up to this sequence number is on disk (`u64::MAX` without one); in
    /// cluster mode, every session attempt row and attempt end up to this number is committed
    /// (answers there carry no number: they leave after their COMMIT).
    pub fn durable_lsn(&self) -> u64 {
        match self {
            Store::Mem(s) => s.durable_lsn(),
            Store::Pg(p) => p.rows_committed(),
        }
    }

    /// What must be durable before the task frame of the attempt of `id` that just started
    /// leaves for a session worker (SPEC §12: a crash right after it must leave the attempt
    /// resumable): the journal record of its start, or in cluster mode the row naming its
    /// session (0: nothing to wait for).
    pub fn start_mark(&self, id: TaskId) -> u64 {
        match self {
            Store::Mem(s) => s.task(id).map_or(0, |t| t.stored.lsn),
            Store::Pg(p) => p.start_mark(),
        }
    }

    /// An answer waits until the record `lsn` is durable.
    pub fn want_durable(&mut self, lsn: u64) {
        if let Store::Mem(s) = self {
            s.want_durable(lsn);
        }
    }

    /// When the journal's held-back records must go to its writer.
    pub fn hold_deadline_ms(&mut self) -> Option<u64> {
        match self {
            Store::Mem(s) => s.hold_deadline_ms(),
            Store::Pg(_) => None,
        }
    }

    pub fn mem(&self) -> Option<&mem::MemStore> {
        match self {
            Store::Mem(s) => Some(s),
            Store::Pg(_) => None,
        }
    }

    pub fn mem_mut(&mut self) -> Option<&mut mem::MemStore> {
        match self {
            Store::Mem(s) => Some(s),
            Store::Pg(_) => None,
        }
    }

    /// Nothing in flight and nothing queued (a memory store always is).
    pub fn idle(&self) -> bool {
        match self {
            Store::Mem(_) => true,
            Store::Pg(s) => s.idle(),
        }
    }

    /// Shutdown: the store's threads stop once what was accepted is written.
    pub fn stop(&mut self) -> Result<(), String> {
        each!(self, s => s.stop())
    }
}

/// The answer when the connection broke during a transaction that may have committed.
pub fn lost_response() -> Response {
    Response::error(
        503,
        "database_unavailable",
        "the database connection broke during the transaction (it may have committed: retry with the same \
         Idempotency-Key)",
    )
}
