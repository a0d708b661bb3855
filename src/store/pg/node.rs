//! What the PostgreSQL store carries between loop turns: the records and reads the next turn
//! transaction will carry, what the transaction in flight was for (one [`Part`] per statement),
//! and the limits that bound them. Data only: `store::pg` builds and answers the transactions.

use std::collections::VecDeque;

use crate::http::Response;
use crate::pg::sql;
use crate::store::{InsertTo, ReadHow};
use crate::tasks::{ConnRef, TaskId};

/// Tasks one transaction inserts at most (a batch of a hundred thousand goes in several): small
/// enough that a transaction stays well within [`STALL_MS`] on a loaded machine (a longer one
/// reads as a database that stopped answering).
pub const MAX_INSERTS_PER_TXN: usize = 2_000;
/// Payload bytes one transaction inserts at most (payloads are up to MAX_MESSAGE_SIZE each).
pub const MAX_INSERT_BYTES_PER_TXN: usize = 4 << 20;
/// Payload bytes waiting for a transaction beyond which new submits wait (backpressure, as
/// the journal's backlog does on one node).
pub const MAX_INSERT_BACKLOG_BYTES: usize = 64 << 20;
/// Claims one transaction carries at most (the rest in the next one).
pub const MAX_CLAIMS_PER_TXN: usize = 64;
/// Reads (tasks, pages) one transaction carries at most.
pub const MAX_READS_PER_TXN: usize = 4096;
/// How often the token cache is refreshed (SPEC §11: a revoke is refused within 1 s).
pub const TOKEN_REFRESH_MS: u64 = 500;
/// How often the counts (/healthz) and the cluster's workers are re-read.
pub const CACHE_REFRESH_MS: u64 = 1_000;
/// The safety net behind notifications: idle workers claim, waiters look, this often.
pub const POLL_MS: u64 = 1_000;
/// How often a node looks for dead nodes' attempts to adopt, and runs expiry and retention.
pub const ADOPT_MS: u64 = 1_000;
/// Due times of tasks scheduled from this node kept for its timer at most.
pub const MAX_DUE_TIMES: usize = 4096;
/// The store's own timer.
pub const TICK_MS: u64 = 250;
/// A record the database refused this many times travels alone from then on (so it cannot keep
/// the others from being written); it is never dropped.
pub const MAX_REFUSALS: u8 = 3;
/// Consecutive refused transactions from which `/healthz` says the database is not usable.
pub const REFUSED_UNHEALTHY: u32 = 3;
/// Workers that left, remembered for `DELETE_WORKERS`; beyond it (workers coming and going
/// through a long outage) the node rewrites its rows whole (`RESYNC_WORKERS`).
pub const MAX_WORKERS_GONE: usize = 10_000;
/// Session attempts whose rows wait to name their session, at most (beyond it an attempt is
/// not resumable on another node: it is retried there as any lost node's).
pub const MAX_SESSION_ROWS: usize = 65_536;
/// Resumes waiting for `TAKE_SESSION` at most (beyond it a resume gets a new session).
pub const MAX_TAKES: usize = 1_024;
/// A transaction in flight this long means the database stopped answering: new requests that
/// need it are refused (503) and `/healthz` says unreachable until it answers again.
pub const STALL_MS: u64 = 2_000;

/// A keyed submit to answer for the task that holds its key, or with `missing` when none does.
#[derive(Debug)]
pub struct KeyLookup {
    pub conn: ConnRef,
    pub owner: String,
    pub key: String,
    pub wait: bool,
    pub missing: Response,
}

/// A read of one task for a held request.
#[derive(Debug, Clone)]
pub struct ReadReq {
    pub conn: ConnRef,
    pub id: TaskId,
    /// The kinds the caller may see (`None`: every kind, the root token).
    pub scope: Option<Vec<String>>,
    pub how: ReadHow,
}

/// `GET /tasks`.
#[derive(Debug, Clone)]
pub struct ListReq {
    pub conn: ConnRef,
    pub scope: Option<Vec<String>>,
    pub status: Option<&'static str>,
    pub kind: Option<String>,
    pub below: u64,
    pub limit: usize,
}

/// `DELETE /tasks/{id}`.
#[derive(Debug, Clone)]
pub struct CancelReq {
    pub conn: ConnRef,
    pub id: TaskId,
    pub scope: Option<Vec<String>>,
}

/// `POST /tasks/{id}/retry` (`filter` `None`) or `POST /tasks/retry`.
#[derive(Debug, Clone)]
pub struct RerunReq {
    pub conn: ConnRef,
    pub id: TaskId,
    pub scope: Option<Vec<String>>,
    pub wait: bool,
    pub filter: Option<crate::store::RerunFilter>,
}

/// One claim for a group of this node's workers.
#[derive(Debug, Clone)]
pub struct ClaimReq {
    pub group: u32,
    pub kinds: Option<Vec<String>>,
    pub limit: u32,
    /// A PostgreSQL `uuid[]` literal of the group's takers.
    pub takers: String,
    /// The store's `queue_changes` when the claim's statements were built.
    pub seen: u64,
}

/// An attempt's end waiting to be written (with how often the database refused it).
#[derive(Debug, Clone)]
pub struct EndRec {
    pub ended: sql::Ended,
    pub refusals: u8,
    /// The task is final: this node counts it and waiters may be answered once it is written.
    pub final_status: bool,
    /// Its record number ([`super::PgStore::rows_committed`]).
    pub seq: u64,
}

/// A task to insert, and whom its insert answers.
#[derive(Debug, Clone)]
pub struct InsertRec {
    pub row: sql::NewTask,
    pub id: TaskId,
    pub to: InsertTo,
}

/// A worker that presents a session this node does not know: its attempts may be on another
/// node (SPEC §12).
#[derive(Debug)]
pub struct TakeReq {
    pub conn: crate::tasks::ConnRef,
    pub worker_id: String,
    pub secret: String,
}

/// What one statement of the transaction in flight is for (one part per statement, in order).
#[derive(Debug)]
pub enum Part {
    Lookups(Vec<KeyLookup>),
    InsertLock,
    Insert(Vec<InsertRec>),
    /// The `IDEMPOTENT_LOOKUP` right after an insert with keys.
    InsertKeys,
    Ended(Vec<EndRec>),
    Started(Vec<(TaskId, u32)>),
    Unclaim(Vec<(String, u32)>),
    Orphans,
    Adopt,
    /// `TAKE_SESSION` for a worker resuming here (SPEC §12).
    TakeSession(TakeReq),
    /// `SESSION_ATTEMPTS`.
    /// The rows, and their record numbers.
    SessionAttempts(Vec<crate::pg::sql::SessionAttempt>, Vec<u64>),
    /// `CANCEL`; the next statement reads the task back.
    Cancel(CancelReq),
    CancelRead,
    /// `RERUN` (the next statement reads the task back) or `RERUN_MANY`.
    Rerun(RerunReq),
    DeleteWorkers(Vec<u128>),
    ResyncWorkers,
    UpsertWorkers(Vec<u128>),
    Claim(ClaimReq),
    Finished(Vec<TaskId>),
    Reads(Vec<ReadReq>),
    List(ListReq),
    Workers(Vec<ConnRef>),
    Counts,
    Tokens,
    /// Tasks that failed waiting (`EXPIRE_IN_QUEUE`, `FAIL_UNPLACEABLE`).
    Failed,
    /// `RETENTION`: one row, how many finished tasks it deleted.
    Retention,
    Notify,
    /// `SET_POLICY` (the lock before it: `PolicyLock`); the `KINDS` read after it answers.
    PolicyLock,
    PolicySet(String, Option<crate::flow::Policy>),
    /// `KINDS`: the answer to a `/kinds` request.
    Kinds(ConnRef, crate::flow::KindOp),
    PolicyChanges,
    /// `LIMITED_PENDING`: the limited kinds with tasks pending.
    LimitedPending,
    /// `REHOLD` of a kind whose policy changed: whether its rows are all in line yet.
    Rehold(String),
    /// `KIND_LOCKS` (tried, never waited for), then `CLAIM_LIMITED` of the kinds it got (its
    /// tasks join the group's claim that follows), then `KIND_BACKLOG`.
    KindLocks,
    ClaimLimited,
    KindBacklog,
    /// `LANE_BACKLOG`, after `KIND_BACKLOG` when a limited kind has per-key limits: the kinds.
    LaneBacklog(Vec<String>),
    KindGauges,
}

/// The transaction in flight.
#[derive(Debug)]
pub struct Sent {
    pub tag: u64,
    pub parts: Vec<Part>,
    /// Monotonic time it was sent.
    pub at_ms: u64,
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

/// The inserts of the next transaction (bounded in count and payload bytes).
pub fn take_inserts(inserts: &mut VecDeque<InsertRec>, insert_bytes: &mut usize) -> Vec<InsertRec> {
    let mut out = Vec::new();
    let mut bytes = 0;
    while out.len() < MAX_INSERTS_PER_TXN && (out.is_empty() || bytes < MAX_INSERT_BYTES_PER_TXN) {
        let Some(item) = inserts.pop_front() else { break };
        bytes += item.row.payload.len();
        out.push(item);
    }
    *insert_bytes = insert_bytes.saturating_sub(bytes);
    out
}
