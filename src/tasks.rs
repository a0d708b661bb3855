//! The leaf of shared types under the core and both stores: a task, its attempts, its states,
//! the one task JSON writer and the one status → HTTP code map. No I/O, no clock: times are
//! passed in. A task's status changes only in a store, at the core's word (`store`).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::net::IpAddr;

use serde_json::value::RawValue;

use crate::timefmt::write_rfc3339_ms;

pub type TaskId = u128;

/// A hasher for keys that are already random (task ids, client ids, and pairs of them): fold,
/// don't hash.
#[derive(Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u128(&mut self, n: u128) {
        // (One id: its folded halves. A pair: the first rotated, so (a, b) and (b, a) differ.)
        self.0 = self.0.rotate_left(23) ^ (n as u64) ^ ((n >> 64) as u64);
    }
}

type IdMap<V> = HashMap<TaskId, V, BuildHasherDefault<IdHasher>>;

/// Shards of the task table: a million finished tasks kept for TASK_TTL must not stall the
/// loop while one huge hash table doubles; each shard grows (and rehashes) on its own.
pub const TASK_SHARDS: usize = 64;

/// Every task relay knows, by id. Tasks are boxed: a shard that grows moves pointers, not
/// whole tasks, and an empty slot costs a pointer, not a task.
pub struct TaskTable {
    shards: Vec<IdMap<Box<Task>>>,
}

impl Default for TaskTable {
    fn default() -> TaskTable {
        TaskTable { shards: (0..TASK_SHARDS).map(|_| IdMap::default()).collect() }
    }
}

impl TaskTable {
    fn shard(id: TaskId) -> usize {
        // Ids are random; the top bits pick the shard, the folded hash the bucket.
        (id >> 120) as usize % TASK_SHARDS
    }
    pub fn get(&self, id: &TaskId) -> Option<&Task> {
        self.shards[Self::shard(*id)].get(id).map(|t| &**t)
    }
    pub fn get_mut(&mut self, id: &TaskId) -> Option<&mut Task> {
        self.shards[Self::shard(*id)].get_mut(id).map(|t| &mut **t)
    }
    pub fn contains_key(&self, id: &TaskId) -> bool {
        self.shards[Self::shard(*id)].contains_key(id)
    }
    pub fn insert(&mut self, id: TaskId, task: Task) {
        self.shards[Self::shard(id)].insert(id, Box::new(task));
    }
    pub fn insert_boxed(&mut self, id: TaskId, task: Box<Task>) {
        self.shards[Self::shard(id)].insert(id, task);
    }
    pub fn remove(&mut self, id: &TaskId) -> Option<Task> {
        self.shards[Self::shard(*id)].remove(id).map(|t| *t)
    }
    pub fn len(&self) -> usize {
        self.shards.iter().map(HashMap::len).sum()
    }
    /// Room for `n` more tasks (spread over the shards), so a restore does not rehash.
    pub fn reserve(&mut self, n: usize) {
        for shard in &mut self.shards {
            shard.reserve(n / TASK_SHARDS + 1);
        }
    }
    /// The tasks of shard `i` (a bounded slice of the table, for work spread over turns).
    pub fn shard_tasks(&self, i: usize) -> impl Iterator<Item = &Task> {
        self.shards.get(i).into_iter().flat_map(|m| m.values().map(|t| &**t))
    }
    pub fn is_empty(&self) -> bool {
        self.shards.iter().all(HashMap::is_empty)
    }
}

/// A connection's identity: its slot and the slot's generation when it was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnRef {
    pub slot: u32,
    pub generation: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Status {
    #[default]
    Pending,
    Dispatched,
    Done,
    Failed,
    Canceled,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Dispatched => "dispatched",
            Status::Done => "done",
            Status::Failed => "failed",
            Status::Canceled => "canceled",
        }
    }

    pub fn is_final(self) -> bool {
        matches!(self, Status::Done | Status::Failed | Status::Canceled)
    }

    pub const COUNT: usize = 5;

    pub fn index(self) -> usize {
        self as usize
    }
}

/// How one attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Done,
    Failed,
    Timeout,
    Disconnect,
    SendFailed,
    Canceled,
}

impl Outcome {
    pub const COUNT: usize = 6;
    pub const ALL: [Outcome; Outcome::COUNT] =
        [Outcome::Done, Outcome::Failed, Outcome::Timeout, Outcome::Disconnect, Outcome::SendFailed, Outcome::Canceled];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Done => "done",
            Outcome::Failed => "failed",
            Outcome::Timeout => "timeout",
            Outcome::Disconnect => "disconnect",
            Outcome::SendFailed => "send_failed",
            Outcome::Canceled => "canceled",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Attempt {
    pub client_id: u128,
    pub client_ip: IpAddr,
    /// The node that ran it (cluster mode): its attempt_log entry names it (SPEC §11).
    pub node: Option<Box<str>>,
    pub started_wall_ms: u64,
    pub outcome: Option<Outcome>,
    pub error: Option<Box<str>>,
    pub duration_ms: u64,
    /// The worker sent a result for this attempt (a second one is a duplicate).
    pub answered: bool,
    /// A restart of relay closed this attempt: it does not count against `max_retries`.
    pub restarted: bool,
    /// Times a resuming worker took the attempt back after a lost connection (SPEC §12).
    pub resumes: u32,
    /// The session of the worker that runs it (SPEC §12): a restart holds the attempt for it.
    pub session: Option<Box<SessionTag>>,
}

/// A worker session as an attempt remembers it, for a restart (SPEC §12).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionTag {
    pub worker_id: Box<str>,
    pub secret: Box<str>,
}

impl Attempt {
    /// An attempt that started at `started_wall_ms` and has not ended.
    pub fn new(client_id: u128, client_ip: IpAddr, started_wall_ms: u64) -> Attempt {
        Attempt {
            client_id,
            client_ip,
            node: None,
            started_wall_ms,
            outcome: None,
            error: None,
            duration_ms: 0,
            answered: false,
            restarted: false,
            resumes: 0,
            session: None,
        }
    }
}

/// A task's own retry policy (SPEC §13, `"retry": {...}` on submit): `None` fields take the
/// configured default (`RETRY_BACKOFF`, `RETRY_BACKOFF_MAX`, `RETRY_ANY_WORKER`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetryPolicy {
    pub backoff_ms: Option<u64>,
    pub backoff_max_ms: Option<u64>,
    pub any_worker: Option<bool>,
}

impl RetryPolicy {
    pub fn is_default(&self) -> bool {
        *self == RetryPolicy::default()
    }
}

thread_local! {
    /// The wall clock of the loop turn, for the task JSON writer's time-dependent fields
    /// (`waiting_on`, `next_attempt_at`): set with the core's clock ([`set_json_clock`]); the
    /// writer reads no clock of its own. 0: not set (nothing is taken as not due yet).
    static JSON_WALL_MS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Sets the wall clock the task JSON writer compares due times with (the loop's, each turn).
pub fn set_json_clock(wall_ms: u64) {
    JSON_WALL_MS.with(|c| c.set(wall_ms));
}

fn json_clock() -> u64 {
    JSON_WALL_MS.with(std::cell::Cell::get)
}

/// Where a pending task waits (the memory store's queues).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Place {
    /// Not in a queue (dispatched, final, or being moved).
    #[default]
    Nowhere,
    /// Due, waiting for a worker with capacity.
    Ready,
    /// Waiting for its due time.
    Scheduled,
    /// Taken by a claim; its attempt is about to start (or it is given back).
    Claimed,
}

/// A task's payload, JSON as submitted, shared by the task and its claims: it is copied once,
/// from the request body, when the task is stored (an `Arc<RawValue>` would take two copies:
/// to a `Box<RawValue>`, then into the `Arc`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload(std::sync::Arc<str>);

impl Payload {
    /// The JSON text.
    pub fn get(&self) -> &str {
        &self.0
    }
}

impl From<&RawValue> for Payload {
    fn from(raw: &RawValue) -> Payload {
        Payload(std::sync::Arc::from(raw.get()))
    }
}

impl From<Box<RawValue>> for Payload {
    fn from(raw: Box<RawValue>) -> Payload {
        Payload::from(&*raw)
    }
}

#[derive(Debug, Default)]
pub struct Task {
    pub id: TaskId,
    pub status: Status,
    pub kind: Option<Box<str>>,
    /// What workers are sent; dropped once the task is final.
    pub payload: Option<Payload>,
    pub created_wall_ms: u64,
    /// Set for tasks submitted with `delay`/`run_at`.
    pub run_at_wall_ms: Option<u64>,
    /// When the task became (or becomes) due, wall clock: pending tasks are dispatched in this
    /// order, ties in submission order (SPEC §7). A retry is due when its attempt ended.
    pub due_wall_ms: u64,
    pub finished_wall_ms: Option<u64>,
    pub result: Option<Box<RawValue>>,
    pub error: Option<Box<str>>,
    pub attempts: Vec<Attempt>,
    pub max_retries: u32,
    pub timeout_ms: u64,
    /// The submission sequence number: set once, never changed. Orders the listing (newest
    /// first), is what a listing cursor points at, and breaks ties in due order.
    pub submit_seq: u64,
    /// Seconds of head start among due tasks (SPEC §14): ready order is due − priority.
    pub priority: i32,
    /// Who submitted it (SPEC §14 fairness: `""` the root token, else the scoped token's `jti`).
    pub submitter: Box<str>,
    /// Its fairness key (SPEC §14; `""`: none given).
    pub key: Box<str>,
    /// The kind policy that holds it back (`paused`, `concurrency`, `rate`), as its store last
    /// found: set just before a pending task's JSON is written ([`Task::waiting_on`]).
    pub held_by: std::cell::Cell<Option<WaitingOn>>,
    /// Which pending queue holds the task, if any (the memory store's).
    pub place: Place,
    /// Submitted with `queue: true` or a schedule: its first attempt waits for a worker however
    /// long it takes (until TASK_TTL), rather than failing when none can take it.
    pub queued: bool,
    /// Read back from the journal at start: it waits for a worker however long it takes
    /// (it was accepted), like a `queue: true` task, retries included.
    pub restored: bool,
    /// (token identity, `Idempotency-Key`) it was submitted with: a key lives with its task.
    pub idempotency: Option<Box<(Box<str>, Box<str>)>>,
    /// Its own retry policy (SPEC §13; defaults: the configuration's).
    pub retry: RetryPolicy,
    /// A retry waits out its backoff until then (wall clock, SPEC §13): pending, not claimable
    /// before. Cleared when an attempt starts.
    pub next_attempt_wall_ms: Option<u64>,
    /// A worker that tried the task and may take it again (`any_worker`: no untried eligible
    /// worker was connected, so the one tried longest ago is eligible again, SPEC §13). Not
    /// counted in [`Task::tried_by`]; cleared when the next attempt ends.
    pub again: Option<u128>,
    /// Times `POST /tasks/{id}/retry` ran it again (SPEC §13).
    pub reruns: u32,
    /// The attempts before the current run (a re-run's retry budget and tried workers start
    /// after them; attempt numbers go on).
    pub rerun_base: u32,
    /// When it last became final (the memory store's monotonic clock; 0: unknown, as after a
    /// restart): which of its entries in the store's TTL queues is its current one.
    pub finished_mono_ms: u64,
    /// Where the storage backend keeps the task; `stored.lsn` is the newest record about it,
    /// which must be durable before anyone is shown the task as it is now.
    pub stored: Stored,
}

/// A task's place in durable storage (all zero in memory-only mode).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    /// Sequence number of the newest record about the task.
    pub lsn: u64,
    /// The newest record holding the task's whole state.
    pub home: Loc,
    /// Journal segments holding records the task still needs (0: unused).
    pub segs: [u32; 3],
}

/// Where a record is: journal segment, byte offset, frame length.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Loc {
    pub seg: u32,
    pub off: u32,
    pub len: u32,
}

/// What relay keeps of a finished task that left memory (`TASK_MEMORY`): enough to find it
/// in the journal, list it and forget it.
#[derive(Debug, Clone, Copy)]
pub struct Evicted {
    pub loc: Loc,
    pub submit_seq: u64,
    pub status: Status,
    /// `kind_hash` of its kind (listing filters compare it, then check the kind read back).
    pub kind_hash: u32,
    /// [`Task::finished_mono_ms`] of the task that left memory.
    pub finished_mono_ms: u64,
}

/// A small hash of a task's kind (0 for none).
pub fn kind_hash(kind: Option<&str>) -> u32 {
    kind.map_or(0, |k| {
        let mut h: u32 = 0x811C_9DC5;
        for b in k.bytes() {
            h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
        }
        h | 1
    })
}

impl Task {
    /// Roughly what the task costs in memory (for the `TASK_MEMORY` budget).
    pub fn mem_bytes(&self) -> usize {
        const TABLE_ENTRY_BYTES: usize = 48;
        std::mem::size_of::<Task>()
            + TABLE_ENTRY_BYTES
            + self.attempts.capacity() * std::mem::size_of::<Attempt>()
            + self.attempts.iter().map(|a| a.error.as_ref().map_or(0, |e| e.len())).sum::<usize>()
            + self.kind.as_ref().map_or(0, |k| k.len())
            + self.payload.as_ref().map_or(0, |p| p.get().len())
            + self.result.as_ref().map_or(0, |r| r.get().len())
            + self.error.as_ref().map_or(0, |e| e.len())
            + self.idempotency.as_ref().map_or(0, |i| i.0.len() + i.1.len() + 32)
    }

    pub fn current_attempt(&self) -> Option<&Attempt> {
        self.attempts.last()
    }

    pub fn tried(&self, client_id: u128) -> bool {
        self.again != Some(client_id) && self.this_run().iter().any(|a| a.client_id == client_id)
    }

    /// The workers a claim must not give the task to: every one sent it in this run, but
    /// [`Task::again`].
    pub fn tried_by(&self) -> Vec<u128> {
        self.this_run().iter().map(|a| a.client_id).filter(|&c| Some(c) != self.again).collect()
    }

    /// The attempts of the current run (all of them, unless it was re-run).
    pub fn this_run(&self) -> &[Attempt] {
        self.attempts.get(self.rerun_base as usize..).unwrap_or(&[])
    }

    /// Attempts of this run that count against `max_retries` (a relay restart's do not).
    pub fn counted(&self) -> u32 {
        self.this_run().iter().filter(|a| !a.restarted).count() as u32
    }

    /// Why a pending task is not running yet (SPEC §14's order: `schedule`, `backoff`, `paused`,
    /// `concurrency`, `rate`, `worker`), against the loop's wall clock. `None` unless pending.
    /// (A store that knows of more reasons — kind policies — adds them between.)
    pub fn waiting_on(&self) -> Option<&'static str> {
        if self.status != Status::Pending {
            return None;
        }
        let now = json_clock();
        if self.run_at_wall_ms.is_some_and(|at| at > now) && self.attempts.is_empty() {
            return Some("schedule");
        }
        if self.backoff_until().is_some() {
            return Some("backoff");
        }
        if let Some(why) = self.held_by.get() {
            return Some(why.as_str());
        }
        Some("worker")
    }

    /// While a retry waits out its backoff: when it may run (SPEC §13 `next_attempt_at`).
    pub fn backoff_until(&self) -> Option<u64> {
        self.next_attempt_wall_ms.filter(|&at| self.status == Status::Pending && at > json_clock())
    }

    /// The last error among finished attempts (the task's error when it fails).
    pub fn last_error(&self) -> Option<&str> {
        self.attempts.iter().rev().find_map(|a| a.error.as_deref())
    }

    /// Appends the task JSON of SPEC §4 to `s`. On the hot path of every answer: no
    /// formatting machinery, no allocation beyond `s` growing.
    pub fn write_json(&self, s: &mut String) {
        self.write_json_with(s, false);
    }

    /// [`Task::write_json`], with the payload when `payload` (and the task still has it: a
    /// task that is done drops it).
    pub fn write_json_with(&self, s: &mut String, payload: bool) {
        s.reserve(320 + self.attempts.len() * 200 + self.result.as_ref().map_or(0, |r| r.get().len()));
        s.push_str("{\"task_id\":\"");
        push_uuid(s, self.id);
        s.push_str("\",\"status\":\"");
        s.push_str(self.status.as_str());
        s.push('"');
        if let Some(kind) = &self.kind {
            s.push_str(",\"kind\":");
            push_json_str(s, kind);
        }
        if payload && let Some(p) = &self.payload {
            s.push_str(",\"payload\":");
            s.push_str(p.get());
        }
        push_time(s, "created_at", Some(self.created_wall_ms));
        push_time(s, "run_at", self.run_at_wall_ms);
        push_time(s, "finished_at", self.finished_wall_ms);
        if self.priority != 0 {
            s.push_str(",\"priority\":");
            if self.priority < 0 {
                s.push('-');
            }
            push_u64(s, u64::from(self.priority.unsigned_abs()));
        }
        if !self.key.is_empty() {
            s.push_str(",\"key\":");
            push_json_str(s, &self.key);
        }
        if self.status == Status::Done {
            s.push_str(",\"result\":");
            s.push_str(self.result.as_deref().map_or("null", RawValue::get));
        }
        if let Some(error) = &self.error {
            s.push_str(",\"error\":");
            push_json_str(s, error);
        }
        if let Some(reason) = self.waiting_on() {
            s.push_str(",\"waiting_on\":\"");
            s.push_str(reason);
            s.push('"');
            push_time(s, "next_attempt_at", self.backoff_until());
        }
        if matches!(self.status, Status::Done | Status::Failed)
            && let Some(last) = self.attempts.last()
        {
            s.push_str(",\"client_id\":\"");
            push_uuid(s, last.client_id);
            s.push_str("\",\"client_ip\":\"");
            push_ip(s, last.client_ip);
            s.push('"');
        }
        if self.reruns > 0 {
            s.push_str(",\"reruns\":");
            push_u64(s, u64::from(self.reruns));
        }
        s.push_str(",\"attempts\":");
        push_u64(s, self.attempts.len() as u64);
        s.push_str(",\"attempt_log\":[");
        for (i, a) in self.attempts.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            s.push_str("{\"num\":");
            push_u64(s, i as u64 + 1);
            s.push_str(",\"client_id\":\"");
            push_uuid(s, a.client_id);
            s.push_str("\",\"client_ip\":\"");
            push_ip(s, a.client_ip);
            s.push('"');
            if let Some(outcome) = a.outcome {
                s.push_str(",\"outcome\":\"");
                s.push_str(outcome.as_str());
                s.push('"');
            }
            if let Some(error) = &a.error {
                s.push_str(",\"error\":");
                push_json_str(s, error);
            }
            push_time(s, "started_at", Some(a.started_wall_ms));
            if let Some(node) = &a.node {
                s.push_str(",\"node\":");
                push_json_str(s, node);
            }
            if a.outcome.is_some() {
                s.push_str(",\"duration_ms\":");
                push_u64(s, a.duration_ms);
            }
            if a.resumes > 0 {
                s.push_str(",\"resumes\":");
                push_u64(s, u64::from(a.resumes));
            }
            s.push('}');
        }
        s.push_str("]}");
    }
}

/// The HTTP status a task answers with: a submit (`post`) maps its status (done 200, failed
/// 502, canceled 409, not final 202); `GET /tasks/{id}` is always 200 (SPEC §4). The one map.
pub fn status_code(status: Status, post: bool) -> u16 {
    if !post {
        return 200;
    }
    match status {
        Status::Done => 200,
        Status::Failed => 502,
        Status::Canceled => 409,
        Status::Pending | Status::Dispatched => 202,
    }
}

/// The task JSON as an answer: [`status_code`], held back until the journal has what it shows
/// (`Response::lsn`).
pub fn task_response(task: &Task, post: bool) -> crate::http::Response {
    let mut body = String::new();
    task.write_json(&mut body);
    let mut response = crate::http::Response::json(status_code(task.status, post), body.into_bytes());
    response.lsn = task.stored.lsn;
    response
}

/// `GET /tasks/{id}?include=payload`: the task JSON with its payload, 200.
pub fn task_response_with_payload(task: &Task) -> crate::http::Response {
    let mut body = String::new();
    task.write_json_with(&mut body, true);
    let mut response = crate::http::Response::json(200, body.into_bytes());
    response.lsn = task.stored.lsn;
    response
}

/// `{"task_id": ..., "status": ...}`: what an async submit answers (202).
pub fn accepted_json(id: TaskId, status: Status) -> Vec<u8> {
    let mut s = String::with_capacity(80);
    s.push_str("{\"task_id\":\"");
    push_uuid(&mut s, id);
    s.push_str("\",\"status\":\"");
    s.push_str(status.as_str());
    s.push_str("\"}");
    s.into_bytes()
}

/// A worker's `error` text is cut to this many bytes (SPEC §7): an attempt log holds one per
/// attempt, and a task's record holds the whole log.
pub const MAX_ERROR_BYTES: usize = 64 << 10;

/// What a cut error text ends with (the number is the bytes left out).
pub const CUT_MARK: &str = "… [cut: ";

/// `text` as relay keeps it: at most [`MAX_ERROR_BYTES`] bytes, cut at a character boundary,
/// with a note of how much was left out. The core cuts where a worker's error arrives, so what
/// a caller sees is what a restart reads back; the journal's encoders cut again, so no record
/// can carry more whatever the core did.
pub fn cut_error(text: &str) -> std::borrow::Cow<'_, str> {
    if text.len() <= MAX_ERROR_BYTES {
        return std::borrow::Cow::Borrowed(text);
    }
    // Room for the note: the mark, up to 20 digits and " bytes]".
    let mut keep = MAX_ERROR_BYTES - CUT_MARK.len() - 27;
    while !text.is_char_boundary(keep) {
        keep -= 1;
    }
    let mut out = String::with_capacity(MAX_ERROR_BYTES);
    out.push_str(&text[..keep]);
    out.push_str(CUT_MARK);
    out.push_str(&(text.len() - keep).to_string());
    out.push_str(" bytes]");
    std::borrow::Cow::Owned(out)
}

pub fn push_uuid(s: &mut String, id: u128) {
    let mut buf = uuid::Uuid::encode_buffer();
    s.push_str(uuid::Uuid::from_u128(id).hyphenated().encode_lower(&mut buf));
}

/// Appends `n` in decimal.
pub fn push_u64(s: &mut String, mut n: u64) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    // Only ASCII digits were written.
    s.push_str(std::str::from_utf8(&buf[i..]).unwrap_or("0"));
}

/// Appends an IP address (IPv4 by hand, the common case; IPv6 through its Display).
pub fn push_ip(s: &mut String, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            // Into one buffer, pushed at once: a task's JSON holds two addresses.
            let mut buf = [0u8; 15];
            let mut n = 0;
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    buf[n] = b'.';
                    n += 1;
                }
                if octet >= 100 {
                    buf[n] = b'0' + octet / 100;
                    n += 1;
                }
                if octet >= 10 {
                    buf[n] = b'0' + octet / 10 % 10;
                    n += 1;
                }
                buf[n] = b'0' + octet % 10;
                n += 1;
            }
            // Only ASCII digits and dots were written.
            s.push_str(std::str::from_utf8(&buf[..n]).unwrap_or("0.0.0.0"));
        }
        IpAddr::V6(v6) => {
            use std::fmt::Write as _;
            let _ = write!(s, "{v6}");
        }
    }
}

pub fn uuid_string(id: u128) -> String {
    let mut s = String::with_capacity(36);
    push_uuid(&mut s, id);
    s
}

/// Parses a task id from a path segment; anything but a UUID is `None` (→ 404).
pub fn parse_id(text: &str) -> Option<TaskId> {
    if text.len() != 36 && text.len() != 32 {
        return None;
    }
    uuid::Uuid::try_parse(text).ok().map(|u| u.as_u128())
}

/// Why a pending task is not running yet, in the order SPEC §14 names them (the first that
/// applies is shown).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WaitingOn {
    Schedule,
    Backoff,
    Paused,
    Concurrency,
    Rate,
    Worker,
}

impl WaitingOn {
    pub const ALL: [WaitingOn; 6] = [
        WaitingOn::Schedule,
        WaitingOn::Backoff,
        WaitingOn::Paused,
        WaitingOn::Concurrency,
        WaitingOn::Rate,
        WaitingOn::Worker,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            WaitingOn::Schedule => "schedule",
            WaitingOn::Backoff => "backoff",
            WaitingOn::Paused => "paused",
            WaitingOn::Concurrency => "concurrency",
            WaitingOn::Rate => "rate",
            WaitingOn::Worker => "worker",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

pub fn push_json_str(s: &mut String, text: &str) {
    if text.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        s.push('"');
        s.push_str(text);
        s.push('"');
    } else if let Ok(quoted) = serde_json::to_string(text) {
        // serde_json escapes exactly as JSON requires; writing into a String cannot fail.
        s.push_str(&quoted);
    }
}

fn push_time(s: &mut String, key: &str, ms: Option<u64>) {
    if let Some(ms) = ms {
        s.push_str(",\"");
        s.push_str(key);
        s.push_str("\":\"");
        write_rfc3339_ms(s, ms);
        s.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(status: Status) -> Task {
        Task {
            id: 0x0123_4567_89ab_cdef_0123_4567_89ab_cdef,
            status,
            kind: Some("http".into()),
            payload: Some(RawValue::from_string("{\"kind\":\"http\"}".into()).expect("raw").into()),
            created_wall_ms: 0,
            run_at_wall_ms: None,
            due_wall_ms: 0,
            finished_wall_ms: None,
            result: None,
            error: None,
            attempts: Vec::new(),
            max_retries: 2,
            timeout_ms: 10_000,
            submit_seq: 0,
            priority: 0,
            submitter: Box::default(),
            key: Box::default(),
            held_by: Default::default(),
            place: Place::Nowhere,
            queued: false,
            restored: false,
            idempotency: None,
            retry: RetryPolicy::default(),
            next_attempt_wall_ms: None,
            again: None,
            reruns: 0,
            rerun_base: 0,
            finished_mono_ms: 0,
            stored: Stored::default(),
        }
    }

    fn attempt(outcome: Option<Outcome>, error: Option<&str>) -> Attempt {
        Attempt {
            client_id: 7,
            client_ip: "10.0.0.5".parse().expect("ip"),
            node: None,
            started_wall_ms: 1_000,
            outcome,
            error: error.map(Into::into),
            duration_ms: 12,
            answered: false,
            restarted: false,
            resumes: 0,
            session: None,
        }
    }

    fn check(t: &Task, expected: serde_json::Value) {
        let mut out = String::new();
        t.write_json(&mut out);
        let got: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
        assert_eq!(got, expected);
    }

    #[test]
    fn json_views() {
        let id = "01234567-89ab-cdef-0123-456789abcdef";
        let pending = task(Status::Pending);
        check(
            &pending,
            serde_json::json!({"task_id": id, "status": "pending", "kind": "http", "waiting_on": "worker",
                "created_at": "1970-01-01T00:00:00.000Z", "attempts": 0, "attempt_log": []}),
        );

        let mut running = task(Status::Dispatched);
        running.attempts.push(attempt(Some(Outcome::Timeout), Some("no answer within 10s")));
        running.attempts.push(attempt(None, None));
        check(
            &running,
            serde_json::json!({"task_id": id, "status": "dispatched", "kind": "http",
                "created_at": "1970-01-01T00:00:00.000Z", "attempts": 2, "attempt_log": [
                    {"num": 1, "client_id": "00000000-0000-0000-0000-000000000007", "client_ip": "10.0.0.5",
                     "outcome": "timeout", "error": "no answer within 10s",
                     "started_at": "1970-01-01T00:00:01.000Z", "duration_ms": 12},
                    {"num": 2, "client_id": "00000000-0000-0000-0000-000000000007", "client_ip": "10.0.0.5",
                     "started_at": "1970-01-01T00:00:01.000Z"}]}),
        );

        let mut done = task(Status::Done);
        done.kind = None;
        done.finished_wall_ms = Some(2_000);
        done.attempts.push(attempt(Some(Outcome::Done), None));
        check(
            &done,
            serde_json::json!({"task_id": id, "status": "done", "created_at": "1970-01-01T00:00:00.000Z",
                "finished_at": "1970-01-01T00:00:02.000Z", "result": null,
                "client_id": "00000000-0000-0000-0000-000000000007", "client_ip": "10.0.0.5",
                "attempts": 1, "attempt_log": [
                    {"num": 1, "client_id": "00000000-0000-0000-0000-000000000007", "client_ip": "10.0.0.5",
                     "outcome": "done", "started_at": "1970-01-01T00:00:01.000Z", "duration_ms": 12}]}),
        );
    }

    #[test]
    fn a_retry_waiting_out_its_backoff_says_so_until_it_is_due() {
        let mut t = task(Status::Pending);
        t.attempts.push(attempt(Some(Outcome::Failed), Some("boom")));
        t.next_attempt_wall_ms = Some(5_000);
        let json = |t: &Task| {
            let mut s = String::new();
            t.write_json(&mut s);
            serde_json::from_str::<serde_json::Value>(&s).expect("JSON")
        };
        set_json_clock(4_000);
        let v = json(&t);
        assert_eq!(v["waiting_on"], "backoff");
        assert_eq!(v["next_attempt_at"], "1970-01-01T00:00:05.000Z");
        set_json_clock(5_000);
        let v = json(&t);
        assert_eq!(v["waiting_on"], "worker");
        assert!(v.get("next_attempt_at").is_none());
        t.run_at_wall_ms = Some(9_000);
        t.attempts.clear();
        assert_eq!(json(&t)["waiting_on"], "schedule");
        t.status = Status::Dispatched;
        assert!(json(&t).get("waiting_on").is_none());
        set_json_clock(0);
    }

    #[test]
    fn writers() {
        let mut s = String::new();
        for n in [0, 7, 10, 1234567890, u64::MAX] {
            s.clear();
            push_u64(&mut s, n);
            assert_eq!(s, n.to_string());
        }
        for ip in ["0.0.0.0", "10.0.0.5", "127.0.0.1", "1.20.100.99", "255.255.255.255", "::1", "2001:db8::7"] {
            s.clear();
            push_ip(&mut s, ip.parse().expect("ip"));
            assert_eq!(s, ip);
        }
        for text in ["plain", "with \"quote\"", "back\\slash", "tab\there", "€ ok", ""] {
            s.clear();
            push_json_str(&mut s, text);
            assert_eq!(serde_json::from_str::<String>(&s).expect("JSON string"), text);
        }
    }

    #[test]
    fn ids() {
        assert_eq!(parse_id("01234567-89ab-cdef-0123-456789abcdef"), Some(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef));
        for bad in
            ["", "x", "../etc/passwd", "01234567-89ab-cdef-0123-456789abcdeg", "{01234567-89ab-cdef-0123-456789abcdef}"]
        {
            assert_eq!(parse_id(bad), None, "{bad}");
        }
    }
}
