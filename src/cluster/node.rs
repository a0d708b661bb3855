//! One node of a cluster (SPEC §11, docs/cluster.md §4–§5): what the next turn transaction will
//! carry, what the transaction in flight was for, the requests held for the database, and the
//! caches a node answers from (the cluster's workers, task counts, pending totals, tokens).
//!
//! Data and small pure helpers only: the core (`dispatch::cluster`) decides, the database
//! threads (`cluster::db`) talk to PostgreSQL, and nothing here reads a clock or a socket.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::rc::Rc;

use super::db::{Db, Health};
use super::sql;
use super::tokens::TokenCache;
use super::wire::Row;
use crate::http::Response;
use crate::tasks::{ConnRef, TaskId};
use crate::timer::TimerHandle;

/// Tasks one transaction inserts at most (a batch of a hundred thousand goes in several).
pub const MAX_INSERTS_PER_TXN: usize = 10_000;
/// Payload bytes one transaction inserts at most (payloads are up to MAX_MESSAGE_SIZE each).
pub const MAX_INSERT_BYTES_PER_TXN: usize = 16 << 20;
/// Payload bytes waiting for a transaction beyond which new submits wait (backpressure, as
/// the journal's backlog does on one node).
pub const MAX_INSERT_BACKLOG_BYTES: usize = 64 << 20;
/// Workers one transaction claims for at most (the next turn starts further along the ring).
pub const MAX_CLAIMS_PER_TXN: usize = 64;
/// How often the token cache is refreshed (SPEC §11: a revoke is refused within 1 s).
pub const TOKEN_REFRESH_MS: u64 = 500;
/// How often the counts (/healthz), the cluster's workers and the pending totals are re-read.
pub const CACHE_REFRESH_MS: u64 = 1_000;
/// The safety net behind notifications: idle workers claim, waiters look, this often.
pub const POLL_MS: u64 = 1_000;
/// The node's own timer.
pub const TICK_MS: u64 = 250;
/// Tasks claimed per turn for a worker that declared no concurrency (unlimited, the seed
/// protocol): it may take any number, but one node must not empty the queue into one socket.
pub const UNLIMITED_CLAIM: u32 = 16;
/// A record the database refused this many times is dropped (logged): it would never pass.
pub const MAX_REFUSALS: u8 = 3;
/// Results remembered after their attempt ended, to tell `late` and `duplicate` from `unknown`.
pub const RECENT_RESULTS: usize = 65_536;
/// Workers that left, remembered for `DELETE_WORKERS`; beyond it (workers coming and going
/// through a long outage) the node rewrites its rows whole (`RESYNC_WORKERS`).
pub const MAX_WORKERS_GONE: usize = 10_000;

/// A worker of the cluster as another node wrote it to `relay_workers`.
#[derive(Debug, Clone)]
pub struct RemoteWorker {
    pub client_id: u128,
    pub node_id: String,
    pub active: bool,
    /// `None`: every kind.
    pub kinds: Option<Vec<String>>,
}

impl RemoteWorker {
    pub fn accepts(&self, kind: Option<&str>) -> bool {
        self.active
            && match &self.kinds {
                None => true,
                Some(kinds) => kind.is_some_and(|k| kinds.iter().any(|own| own == k)),
            }
    }
}

/// Who gets the answer of a task insert.
#[derive(Debug, Clone)]
pub enum InsertFor {
    /// `POST /tasks`: 202 after the COMMIT, or a waiter (`wait=true`). `key` is (owner, key)
    /// when it carried an `Idempotency-Key` (a conflict answers for the task holding it).
    Submit { conn: ConnRef, wait: bool, key: Option<(String, String)> },
    /// One item of a `POST /tasks/batch`.
    Batch { batch: u64, index: usize },
}

/// A keyed submit to answer for the task that holds its key, or with `missing` when none does.
#[derive(Debug)]
pub struct KeyLookup {
    pub conn: ConnRef,
    pub owner: String,
    pub key: String,
    pub wait: bool,
    pub missing: Response,
}

/// A read of tasks for a held request.
#[derive(Debug, Clone)]
pub struct ReadReq {
    pub conn: ConnRef,
    /// The kinds the caller may see (`None`: every kind, the root token).
    pub scope: Option<Vec<String>>,
    pub what: ReadWhat,
}

#[derive(Debug, Clone)]
pub enum ReadWhat {
    /// One task, answered as `then` says.
    Task { id: TaskId, then: Then },
    /// `GET /tasks`.
    List { status: Option<&'static str>, kind: Option<String>, at: Option<(u64, u64)>, limit: usize },
    /// `GET /clients`.
    Clients,
}

/// What a read of one task answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Then {
    /// `GET /tasks/{id}`: 200.
    Get,
    /// `wait=true`: the task if final, else the request waits (`post`: a submit's status codes).
    Wait { post: bool },
    /// The wait is over (WAIT_TIMEOUT, shutdown): the task as it is now.
    Release { post: bool },
}

/// `DELETE /tasks/{id}`.
#[derive(Debug, Clone)]
pub struct CancelReq {
    pub conn: ConnRef,
    pub id: TaskId,
    pub scope: Option<Vec<String>>,
}

/// An attempt's end waiting to be written (with how often the database refused it).
#[derive(Debug, Clone)]
pub struct EndRec {
    pub ended: sql::Ended,
    pub refusals: u8,
    /// The task is final: waiters may be answered once it is written.
    pub final_status: bool,
}

/// What one statement of the transaction in flight is for (one part per statement, in order).
#[derive(Debug)]
pub enum Part {
    Lookups(Vec<KeyLookup>),
    Insert(Vec<(String, InsertFor)>),
    /// The `IDEMPOTENT_LOOKUP` right after an insert with keys.
    InsertKeys,
    Ended(Vec<EndRec>),
    Unclaim(Vec<(String, u32)>),
    Orphans,
    /// `CANCEL`; the next statement reads the task back.
    Cancel(CancelReq),
    CancelRead,
    DeleteWorkers(Vec<u128>),
    ResyncWorkers,
    UpsertWorkers(Vec<u128>),
    Claim {
        conn: ConnRef,
        client_id: u128,
        asked: u32,
    },
    Finished(Vec<TaskId>),
    Tasks(Vec<ReadReq>),
    List(ReadReq),
    Workers(Vec<ReadReq>),
    Counts,
    PendingTotals,
    Tokens,
    Notify,
}

/// The transaction in flight.
#[derive(Debug)]
pub struct Sent {
    pub tag: u64,
    pub parts: Vec<Part>,
    /// Monotonic time it was sent (for the log when one is slow).
    pub at_ms: u64,
}

/// A `POST /tasks/batch` whose items are being written.
#[derive(Debug)]
pub struct BatchWait {
    pub conn: ConnRef,
    /// Per item: its task id, or its error (code, message).
    pub items: Vec<Result<TaskId, (&'static str, String)>>,
    /// Inserts not yet answered by the database.
    pub outstanding: usize,
    /// Every item is validated (no more inserts will come).
    pub complete: bool,
}

/// A request waiting for its task to become final (`wait=true`).
#[derive(Debug)]
pub struct Waiter {
    pub task: TaskId,
    pub post: bool,
    pub timer: TimerHandle,
}

/// The database's facts about a task this node runs.
#[derive(Debug, Clone)]
pub struct Claim {
    /// The attempt number in the database: the fencing number of every write about it.
    pub attempt: u32,
    /// Workers (client ids) that were sent the task, this attempt's included.
    pub tried: Vec<u128>,
}

/// Counters of the database traffic (for /metrics and the benchmark).
#[derive(Debug, Default, Clone, Copy)]
pub struct DbStats {
    pub committed: u64,
    pub refused: u64,
    pub lost: u64,
    pub unreachable: u64,
    pub statements: u64,
    pub tasks_inserted: u64,
    pub tasks_claimed: u64,
    pub attempts_ended: u64,
    /// Attempt ends the database fenced (a stale node, or the task was canceled or reaped).
    pub fenced: u64,
}

/// A node's state in cluster mode (owned by the core as `Storage::Cluster`).
pub struct Node {
    pub id: String,
    pub id_u128: u128,
    pub name: String,
    pub db: Db,
    pub lease_ms: u64,
    pub tokens: Rc<RefCell<TokenCache>>,
    /// Health as the loop last saw it.
    pub health: Health,
    pub next_tag: u64,
    pub sent: Option<Sent>,

    // ----- what the next transaction carries
    pub lookups: Vec<KeyLookup>,
    pub inserts: VecDeque<(sql::NewTask, InsertFor)>,
    /// Payload bytes in `inserts`.
    pub insert_bytes: usize,
    pub ended: Vec<EndRec>,
    pub unclaim: Vec<(String, u32)>,
    pub cancels: Vec<CancelReq>,
    pub reads: Vec<ReadReq>,
    /// Ids to look up with `FINISHED_AMONG` (waiters', and this node's running tasks after a
    /// cancel notification).
    pub check_finished: HashSet<TaskId>,
    pub workers_dirty: HashSet<u128>,
    pub workers_gone: Vec<u128>,
    /// Delete every row of this node's but its current workers' (`RESYNC_WORKERS`).
    pub workers_resync: bool,
    /// A claiming transaction was lost: release what the database says this node runs and the
    /// node does not know.
    pub orphans: bool,
    /// Some worker may want a claim (capacity freed, a worker arrived, tasks were queued).
    pub claim_check: bool,
    pub want_counts: bool,
    pub want_workers: bool,
    pub want_pending: bool,
    pub want_tokens: bool,
    /// The transaction carries inserts or requeues: notify `relay_pending` at its COMMIT.
    pub notify_pending: bool,

    // ----- timers of the node's own tick
    pub next_tokens_ms: u64,
    pub next_cache_ms: u64,
    pub next_poll_ms: u64,
    pub in_flight_changed: bool,
    /// When the timer for the earliest scheduled task submitted here fires.
    pub due_timer: Option<u64>,

    // ----- caches
    /// Cluster-wide counts by status (`Status::index` order), from `COUNTS`.
    pub counts: [i64; 5],
    pub remote: Vec<RemoteWorker>,
    /// From `PENDING_TOTALS`: tasks and payload bytes waiting, cluster-wide.
    pub pending_total: (u64, u64),
    /// Accepted by this node since that was read.
    pub pending_local: (u64, u64),

    // ----- held requests and running tasks
    pub waiters: HashMap<TaskId, Vec<ConnRef>>,
    pub held: HashMap<ConnRef, Waiter>,
    pub batches: HashMap<u64, BatchWait>,
    pub next_batch: u64,
    pub claims: HashMap<TaskId, Claim>,
    /// (task, worker) of attempts that ended here recently, and whether the worker answered.
    pub recent: HashMap<(TaskId, u128), bool>,
    pub recent_order: VecDeque<(TaskId, u128)>,
    pub stats: DbStats,
    /// Where the next turn's claims start in the ring of workers (round-robin over turns).
    pub claim_cursor: usize,
}

impl Node {
    pub fn new(id: String, name: String, db: Db, lease_ms: u64, tokens: Rc<RefCell<TokenCache>>) -> Node {
        let id_u128 = crate::tasks::parse_id(&id).unwrap_or(0);
        Node {
            id,
            id_u128,
            name,
            db,
            lease_ms,
            tokens,
            health: Health::Unreachable,
            next_tag: 1,
            sent: None,
            lookups: Vec::new(),
            inserts: VecDeque::new(),
            insert_bytes: 0,
            ended: Vec::new(),
            unclaim: Vec::new(),
            cancels: Vec::new(),
            reads: Vec::new(),
            check_finished: HashSet::new(),
            workers_dirty: HashSet::new(),
            workers_gone: Vec::new(),
            workers_resync: false,
            orphans: false,
            claim_check: true,
            want_counts: true,
            want_workers: true,
            want_pending: true,
            want_tokens: true,
            notify_pending: false,
            next_tokens_ms: 0,
            next_cache_ms: 0,
            next_poll_ms: 0,
            in_flight_changed: false,
            due_timer: None,
            counts: [0; 5],
            remote: Vec::new(),
            pending_total: (0, 0),
            pending_local: (0, 0),
            waiters: HashMap::new(),
            held: HashMap::new(),
            batches: HashMap::new(),
            next_batch: 1,
            claims: HashMap::new(),
            recent: HashMap::new(),
            recent_order: VecDeque::new(),
            stats: DbStats::default(),
            claim_cursor: 0,
        }
    }

    /// Anything for the next transaction besides claims?
    pub fn has_work(&self) -> bool {
        !self.lookups.is_empty()
            || !self.inserts.is_empty()
            || !self.ended.is_empty()
            || !self.unclaim.is_empty()
            || !self.cancels.is_empty()
            || !self.reads.is_empty()
            || !self.check_finished.is_empty()
            || !self.workers_dirty.is_empty()
            || !self.workers_gone.is_empty()
            || self.workers_resync
            || self.orphans
            || self.want_counts
            || self.want_workers
            || self.want_pending
            || self.want_tokens
    }

    /// Remembers that `worker` was sent `task` and the attempt ended (bounded: the oldest go).
    pub fn remember(&mut self, task: TaskId, worker: u128, answered: bool) {
        if self.recent.insert((task, worker), answered).is_none() {
            self.recent_order.push_back((task, worker));
            while self.recent_order.len() > RECENT_RESULTS {
                if let Some(old) = self.recent_order.pop_front() {
                    self.recent.remove(&old);
                }
            }
        }
    }

    /// Could some worker of another node take a task of `kind` that `tried` has not tried?
    pub fn remote_can_take(&self, kind: Option<&str>, tried: &[u128]) -> bool {
        self.remote.iter().any(|w| w.node_id != self.id && w.accepts(kind) && !tried.contains(&w.client_id))
    }

    /// Takes the inserts of the next transaction (bounded in count and payload bytes).
    pub fn take_inserts(&mut self) -> Vec<(sql::NewTask, InsertFor)> {
        let mut out = Vec::new();
        let mut bytes = 0;
        while out.len() < MAX_INSERTS_PER_TXN && (out.is_empty() || bytes < MAX_INSERT_BYTES_PER_TXN) {
            let Some(item) = self.inserts.pop_front() else { break };
            bytes += item.0.payload.len();
            out.push(item);
        }
        self.insert_bytes = self.insert_bytes.saturating_sub(bytes);
        out
    }

    pub fn take_tag(&mut self) -> u64 {
        let t = self.next_tag;
        self.next_tag += 1;
        t
    }
}

/// The columns of `GET_TASKS` (and `FINISHED_AMONG`, `LIST_TASKS`), by index.
pub mod col {
    pub const ID: usize = 0;
    pub const STATUS: usize = 1;
    pub const KIND: usize = 2;
    pub const CREATED_MS: usize = 3;
    pub const RUN_AT_MS: usize = 4;
    pub const FINISHED_MS: usize = 5;
    pub const RESULT: usize = 6;
    pub const ERROR: usize = 7;
    pub const CLIENT_ID: usize = 8;
    pub const CLIENT_IP: usize = 9;
    pub const ATTEMPT_LOG: usize = 11;
    /// `LIST_TASKS` only.
    pub const SEQ: usize = 13;
}

/// A row's id column as a task id.
pub fn row_id(row: &Row) -> Option<TaskId> {
    row.text(col::ID).and_then(crate::tasks::parse_id)
}

/// Parses PostgreSQL's text form of a `uuid[]` (`{a,b}`); malformed entries are skipped.
pub fn parse_uuid_array(text: &str) -> Vec<u128> {
    let inner = text.trim().trim_start_matches('{').trim_end_matches('}');
    inner.split(',').filter_map(|s| crate::tasks::parse_id(s.trim().trim_matches('"'))).collect()
}

/// The text form of a list of uuids, as a PostgreSQL array literal.
pub fn uuid_array(ids: impl IntoIterator<Item = TaskId>) -> String {
    let texts: Vec<String> = ids.into_iter().map(crate::tasks::uuid_string).collect();
    sql::array(texts.iter().map(|s| Some(s.as_str())))
}

/// Whether a string may go to PostgreSQL as `text` (which cannot hold U+0000).
pub fn storable(text: &str) -> bool {
    !text.contains('\0')
}

/// `text` with every U+0000 replaced (for errors workers send, which relay only stores).
pub fn storable_lossy(text: &str) -> String {
    if storable(text) { text.to_string() } else { text.replace('\0', "\u{FFFD}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_arrays_both_ways() {
        let a = 0x0123_4567_89ab_cdef_0123_4567_89ab_cdef_u128;
        let b = 7u128;
        let table: &[(&str, &[u128])] = &[
            ("{}", &[]),
            ("{01234567-89ab-cdef-0123-456789abcdef}", &[a]),
            ("{01234567-89ab-cdef-0123-456789abcdef,00000000-0000-0000-0000-000000000007}", &[a, b]),
            ("{nonsense,00000000-0000-0000-0000-000000000007}", &[b]),
        ];
        for (text, expected) in table {
            assert_eq!(parse_uuid_array(text), *expected, "{text}");
        }
        assert_eq!(parse_uuid_array(&uuid_array([a, b])), vec![a, b]);
    }

    #[test]
    fn text_postgres_can_store() {
        assert!(storable("plain é"));
        assert!(!storable("nul\0inside"));
        assert_eq!(storable_lossy("a\0b"), "a\u{FFFD}b");
    }

    #[test]
    fn remote_workers_take_what_they_declared() {
        let w = |kinds: Option<&[&str]>, active| RemoteWorker {
            client_id: 1,
            node_id: "n".into(),
            active,
            kinds: kinds.map(|k| k.iter().map(|s| s.to_string()).collect()),
        };
        assert!(w(None, true).accepts(None));
        assert!(w(None, true).accepts(Some("x")));
        assert!(!w(None, false).accepts(Some("x")), "draining");
        assert!(w(Some(&["x"]), true).accepts(Some("x")));
        assert!(!w(Some(&["x"]), true).accepts(None));
        assert!(!w(Some(&[]), true).accepts(Some("x")));
    }
}
