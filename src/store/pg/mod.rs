//! The PostgreSQL store (SPEC §11, docs/cluster.md §4–§5): PostgreSQL is the source of truth,
//! shared by every node. The seam's operations are queued here, and every loop turn's records —
//! inserts, claims, attempt starts and ends, give-backs, cancels, worker rows, the reads held
//! requests wait for — leave as ONE transaction, one in flight at a time (group commit). Their
//! [`Event`]s arrive when it commits: a 202 only after COMMIT, a 503 when it failed.
//!
//! Which task, in which order, for which group of workers: the claim statements. Which worker,
//! what an attempt's end means: the core's, told here as records. Nothing here decides a retry.
//! Still no I/O on the loop: `pg::db` runs the transactions on its thread and wakes the loop.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::rc::Rc;

use super::{
    AttemptEnd, AttemptStart, ClaimAsk, Claimed, Event, Insert, InsertTo, Next, ReadHow, Refusal, StoreHealth, Takers,
    WorkerInfo,
};
use crate::http::Response;
use crate::log::Level;
use crate::metrics::ClusterGauges;
use crate::pg::db::{Db, Failure, Health, Reply, Request};
use crate::pg::sql;
use crate::pg::wire::{Param, Row, Rows, Stmt};
use crate::tasks::{ConnRef, Status, TaskId, parse_id, uuid_string};
use crate::tokens::pg::TokenCache;
use node::{
    CancelReq, ClaimReq, DbStats, EndRec, InsertRec, KeyLookup, ListReq, MAX_CLAIMS_PER_TXN, MAX_INSERT_BACKLOG_BYTES,
    MAX_READS_PER_TXN, MAX_REFUSALS, MAX_SESSION_ROWS, MAX_TAKES, MAX_WORKERS_GONE, Part, REFUSED_UNHEALTHY, ReadReq,
    RerunReq, STALL_MS, Sent, TakeReq,
};
use rows::{ccol, storable, storable_lossy, uuid_array};

pub mod kinds;
pub mod node;
pub mod rows;

/// The answer while the database cannot be used.
pub fn unavailable() -> Response {
    Response::error(503, "database_unavailable", "the database is unreachable; try again")
}

fn not_found() -> Response {
    Response::error(404, "not_found", "no such task")
}

fn rows_of(rows: &[Rows], i: usize) -> &[Row] {
    rows.get(i).map_or(&[], |r| r.rows.as_slice())
}

/// What the store needs of the configuration.
#[derive(Debug, Clone)]
pub struct PgConfig {
    pub task_ttl_ms: u64,
    /// How long failed tasks are kept (`FAILED_TTL`, SPEC §13; 0: as long as `task_ttl_ms`).
    pub failed_ttl_ms: u64,
    pub task_timeout_ms: u64,
    pub max_retries: u32,
    pub max_pending: usize,
    pub max_pending_bytes: usize,
}

/// The start of an attempt this node runs: written with the next transaction (or with its end).
#[derive(Debug, Clone)]
struct Start {
    attempt: u32,
    runner: sql::Runner,
    written: bool,
}

/// How long an attempt's start waits before it is written on its own: an attempt that ends
/// sooner is written once, start and end together (one row update per task fewer). Until then
/// the database knows the attempt from its claim (`relay_running`) but not its worker; this
/// node's own reads show the worker meanwhile.
const START_WRITE_DELAY_MS: u64 = 200;

/// How soon a node with idle workers looks again for tasks of a limited kind that still has
/// some waiting (a slot or a token may free on another node, which does not tell).
const LIMITED_POLL_MS: u64 = 100;

/// The most kinds one transaction brings in line with their policies ([`sql::REHOLD`]).
const REHOLD_KINDS: usize = 8;

pub struct PgStore {
    /// Attempts that ended on this node, for [`PgStore::stray`].
    recent: crate::store::recent::Recent,
    pub id: String,
    pub name: String,
    db: Db,
    lease_ms: u64,
    tokens: Rc<RefCell<TokenCache>>,
    cfg: PgConfig,
    now_ms: u64,
    wall_ms: u64,
    rng: super::mem::Rng,
    /// Health as the loop last saw it.
    health: Health,
    next_tag: u64,
    sent: Option<Sent>,
    /// Transactions refused in a row (`/healthz` is 503 from [`REFUSED_UNHEALTHY`]).
    refused_in_a_row: u32,

    // ----- what the next transaction carries
    lookups: Vec<KeyLookup>,
    inserts: VecDeque<InsertRec>,
    /// Payload bytes in `inserts`.
    insert_bytes: usize,
    claims: Vec<ClaimReq>,
    starts: HashMap<TaskId, Start>,
    /// Starts in the order they came, with when each is to be written (entries whose attempt
    /// ended or was written meanwhile are skipped when they come up).
    starts_due: VecDeque<(u64, TaskId, u32)>,
    /// Attempts adopted from a lost node, by the node's name, until this node closes them.
    adopted_from: HashMap<TaskId, String>,
    ended: Vec<EndRec>,
    unclaim: Vec<(String, u32)>,
    cancels: Vec<CancelReq>,
    reruns: Vec<RerunReq>,
    reads: Vec<ReadReq>,
    lists: Vec<ListReq>,
    worker_reads: Vec<ConnRef>,
    /// Ids to look up with `FINISHED_AMONG` (waited-for tasks, and this node's running tasks
    /// after a cancel notification).
    check_finished: HashSet<TaskId>,
    watched: HashSet<TaskId>,
    workers_dirty: HashMap<u128, WorkerInfo>,
    /// Rows whose only change is `in_flight`: written with the slow poll, not every turn.
    workers_later: HashMap<u128, WorkerInfo>,
    /// This node's workers as their rows were last queued.
    workers_written: HashMap<u128, WorkerInfo>,
    workers_gone: Vec<u128>,
    /// Delete every row of this node's but its current workers' (`RESYNC_WORKERS`).
    workers_resync: bool,

    /// A claiming transaction was lost: release what the database says this node runs and the
    /// node does not know.
    orphans: bool,
    want_counts: bool,
    want_workers: bool,
    want_tokens: bool,
    want_adopt: bool,
    /// Workers resuming a session this node does not know (SPEC §12), and the session
    /// attempts whose `relay_running` rows must name their session.
    takes: Vec<TakeReq>,
    /// Session attempt rows to write, each with its record number.
    session_rows: Vec<(sql::SessionAttempt, u64)>,
    /// Session attempt rows and attempt ends are numbered as they are queued (`record_seq`:
    /// the newest; `last_start_seq`: the row [`PgStore::attempt_started`] queued last, 0 if
    /// none), and the numbers not committed yet are `uncommitted`: a session worker's task frame
    /// waits for its row, so that the worker can resume the attempt on any node even if this one
    /// dies at once, and what relay says to it after a result waits for that result's end, so
    /// that a worker told its result was read never loses it ([`PgStore::rows_committed`]).
    record_seq: u64,
    last_start_seq: u64,
    uncommitted: std::collections::BTreeSet<u64>,
    /// RESUME_WINDOW: a lost node's session attempts wait this long after its last heartbeat.
    pub resume_window_ms: u64,
    /// Expiry in the queue and retention are due (once a second, on this node's clock).
    want_housekeeping: bool,
    /// Waiting tasks may have lost their last worker (a worker left; once a second).
    want_unplaceable: bool,
    /// `/kinds` requests for the next transaction.
    kind_reqs: Vec<(ConnRef, crate::flow::KindOp)>,
    /// Kind policies as last read (SPEC §14; at most a second old, this node's own changes at
    /// once), and the newest change read.
    policies: HashMap<String, crate::flow::Policy>,
    policies_high: i64,
    /// Kinds whose policy changed (read by this node, its own changes included) and whose
    /// pending rows may not say `held` as the policy does yet: [`sql::REHOLD`] each turn, from
    /// the last row it walked, until it finds fewer rows than it may look at.
    rehold: BTreeMap<String, (i64, i64)>,
    /// The last kind a transaction stepped (the next takes the kinds after it first).
    rehold_last: String,
    /// The limited kinds that may have tasks pending: queued here, read so every second
    /// ([`sql::LIMITED_PENDING`]), or newly limited; a claim that finds none due leaves a kind
    /// out until then. Only these are locked and probed by claims.
    limited_pending: HashSet<String>,
    want_policies: bool,
    /// Tasks the `CLAIM_LIMITED` of the claim being read took (they join its `Claimed`).
    limited_claimed: Vec<Claimed>,
    /// Limited kinds out of room as their last claim found them (for `waiting_on`).
    held_kinds: HashMap<String, crate::flow::WaitingOn>,
    /// The held kinds with tasks waiting already counted in `held_total` (at most one entry per
    /// limited kind, as `held_kinds`).
    held_counted: HashMap<String, crate::flow::WaitingOn>,
    /// Lanes (kind, submitter, key) a per-key limit holds back with tasks waiting, as the last
    /// claim of their kind found them (at most 1000 a kind: `LANE_BACKLOG`), for `waiting_on`
    /// and `held_total` (counted as a lane becomes held).
    held_lanes: HashMap<(String, String, String), crate::flow::WaitingOn>,
    /// Claims a limit held back, by `WaitingOn` index; kinds with a policy as last counted.
    held_total: [u64; 6],
    kind_gauges: Vec<(String, u64, u64)>,

    // ----- timers of the store's own tick
    next_tick_ms: u64,
    next_tokens_ms: u64,
    next_cache_ms: u64,
    next_poll_ms: u64,
    next_adopt_ms: u64,
    /// When tasks scheduled from this node fall due (monotonic; the earliest
    /// [`node::MAX_DUE_TIMES`] — the slow poll finds the rest, and other nodes' tasks).
    due_ms: std::collections::BTreeSet<u64>,

    // ----- caches
    /// Cluster-wide counts by status (`Status::index` order), from `COUNTS`.
    counts: [u64; Status::COUNT],
    remote: Vec<WorkerInfo>,
    /// Attempts this node runs (claimed, not ended): task → attempt number.
    running: HashMap<TaskId, u32>,
    /// Groups whose last claim found fewer tasks than asked, with the takers it was for: no claim
    /// for them (for the same takers) until tasks are queued somewhere (a notification, this
    /// node's own inserts) or the slow poll.
    starved: HashMap<u32, String>,
    /// How often the queue may have gained a task for idle groups (an insert, a give-back, a
    /// retry, a wake): a claim that was built before the last one starves no group.
    queue_changes: u64,
    /// Tasks the last commit made final, as it returned them: a waiter's read of one is
    /// answered from here (one read fewer per `wait=true` task).
    fresh_final: HashMap<TaskId, crate::tasks::Task>,
    /// Tasks the last commit inserted, with when its transaction was sent: a wait that starts
    /// on one needs no look for its end unless an end was announced since.
    fresh_inserted: HashMap<TaskId, u64>,
    /// When the last `relay_finished` notification was taken (monotonic).
    finished_noted_ms: u64,
    pub stats: DbStats,
    events: Vec<Event>,
}

impl PgStore {
    pub fn new(
        id: String,
        name: String,
        db: Db,
        lease_ms: u64,
        tokens: Rc<RefCell<TokenCache>>,
        cfg: PgConfig,
    ) -> PgStore {
        PgStore {
            recent: crate::store::recent::Recent::default(),
            id,
            name,
            db,
            lease_ms,
            tokens,
            cfg,
            now_ms: 0,
            wall_ms: 0,
            rng: super::mem::Rng::from_os(),
            health: Health::Unreachable,
            next_tag: 1,
            sent: None,
            refused_in_a_row: 0,
            lookups: Vec::new(),
            inserts: VecDeque::new(),
            insert_bytes: 0,
            claims: Vec::new(),
            starts: HashMap::new(),
            starts_due: VecDeque::new(),
            adopted_from: HashMap::new(),
            ended: Vec::new(),
            unclaim: Vec::new(),
            cancels: Vec::new(),
            reruns: Vec::new(),
            reads: Vec::new(),
            lists: Vec::new(),
            worker_reads: Vec::new(),
            check_finished: HashSet::new(),
            watched: HashSet::new(),
            workers_dirty: HashMap::new(),
            workers_later: HashMap::new(),
            workers_written: HashMap::new(),
            workers_gone: Vec::new(),
            workers_resync: true,

            orphans: true,
            want_counts: true,
            want_workers: true,
            want_tokens: true,
            want_adopt: false,
            takes: Vec::new(),
            session_rows: Vec::new(),
            record_seq: 0,
            last_start_seq: 0,
            uncommitted: std::collections::BTreeSet::new(),
            resume_window_ms: 0,
            want_housekeeping: false,
            want_unplaceable: false,
            kind_reqs: Vec::new(),
            policies: HashMap::new(),
            policies_high: 0,
            rehold: BTreeMap::new(),
            rehold_last: String::new(),
            limited_pending: HashSet::new(),
            want_policies: true,
            limited_claimed: Vec::new(),
            held_kinds: HashMap::new(),
            held_lanes: HashMap::new(),
            held_counted: HashMap::new(),
            held_total: [0; 6],
            kind_gauges: Vec::new(),
            next_tick_ms: 0,
            next_tokens_ms: 0,
            next_cache_ms: 0,
            next_poll_ms: 0,
            next_adopt_ms: 0,
            due_ms: std::collections::BTreeSet::new(),
            counts: [0; Status::COUNT],
            remote: Vec::new(),
            running: HashMap::new(),
            starved: HashMap::new(),
            queue_changes: 0,
            fresh_final: HashMap::new(),
            fresh_inserted: HashMap::new(),
            finished_noted_ms: 0,
            stats: DbStats::default(),
            events: Vec::new(),
        }
    }

    pub fn set_clock(&mut self, now_ms: u64, wall_ms: u64) {
        self.now_ms = now_ms;
        self.wall_ms = wall_ms;
    }

    /// The database answers: connected, the transaction in flight (if any) younger than
    /// [`STALL_MS`] or the database answering the listener meanwhile (a database that stops
    /// answering without closing the connection — a partition — is noticed by the database
    /// thread only after its I/O timeout; a transaction that takes long, such as reading one
    /// 48 MiB row on a loaded machine, is not a database gone), and not refusing every
    /// transaction.
    fn usable(&self) -> bool {
        self.db.health() == Health::Ok
            && self.sent.as_ref().is_none_or(|s| {
                self.now_ms.saturating_sub(s.at_ms) < STALL_MS
                    || self.db.answered_ago_ms().is_some_and(|ago| ago < STALL_MS)
            })
            && self.refused_in_a_row < REFUSED_UNHEALTHY
    }

    pub fn unavailable(&self, _write: bool) -> Option<Response> {
        (!self.usable()).then(unavailable)
    }

    pub fn backlog_full(&self) -> bool {
        self.insert_bytes > MAX_INSERT_BACKLOG_BYTES
    }

    pub fn health(&self) -> StoreHealth {
        StoreHealth {
            counts: self.counts,
            node: Some(self.name.clone()),
            database_up: Some(self.usable()),
            journal_up: None,
        }
    }

    /// An attempt of this node closed: remembered for [`PgStore::stray`].
    pub fn attempt_closed(&mut self, id: TaskId, client_id: u128, answered: bool) {
        self.recent.remember(id, client_id, answered);
    }

    /// A result for an attempt this node no longer runs: `late` or `duplicate` when it ended
    /// here recently; other nodes' and older attempts are fenced by the database instead.
    pub fn stray(&mut self, id: TaskId, client_id: u128) -> Option<crate::metrics::Ignored> {
        self.recent.stray(id, client_id)
    }

    /// `relay_kind_running` / `relay_kind_pending` (at most a second old) and
    /// `relay_dispatch_held_total`.
    pub fn kind_gauges(&self, g: &mut crate::metrics::Gauges) {
        g.kinds.clone_from(&self.kind_gauges);
        g.held = self.held_total;
    }

    pub fn gauges(&self) -> ClusterGauges {
        ClusterGauges {
            up: self.db.health() == Health::Ok,
            committed: self.stats.committed,
            refused: self.stats.refused,
            lost: self.stats.lost,
            unreachable: self.stats.unreachable,
            statements: self.stats.statements,
            background: self.db.background_transactions(),
            tasks_inserted: self.stats.tasks_inserted,
            tasks_claimed: self.stats.tasks_claimed,
            attempts_ended: self.stats.attempts_ended,
            fenced: self.stats.fenced,
        }
    }

    /// Nothing is in flight or waiting to be written (shutdown waits for this).
    pub fn flushed(&self) -> bool {
        self.sent.is_none()
            && (self.db.health() != Health::Ok
                || (self.ended.is_empty()
                    && self.unclaim.is_empty()
                    && self.inserts.is_empty()
                    && self.workers_gone.is_empty()))
    }

    pub fn stop(&mut self) -> Result<(), String> {
        Ok(())
    }

    /// Reads the cached counts and the cluster's workers with the next transaction (they are
    /// otherwise at most a second old; the dispatch model compares them every step).
    pub fn refresh(&mut self) {
        self.want_counts = true;
        self.want_workers = true;
    }

    /// Nothing in flight and nothing queued for a transaction (tests drive the store to this).
    pub fn idle(&self) -> bool {
        self.sent.is_none() && !self.has_work()
    }

    pub fn tokens(&self) -> &Rc<RefCell<TokenCache>> {
        &self.tokens
    }

    /// The database's health as other threads (the files thread) can see it.
    pub fn probe(&self) -> crate::pg::db::HealthProbe {
        self.db.probe()
    }

    // ----- operations --------------------------------------------------------------------------

    pub fn insert(&mut self, new: &Insert<'_>, to: InsertTo) {
        if !self.usable() {
            self.events.push(Event::NotInserted { to, why: Refusal::Unavailable });
            return;
        }
        let id = self.rng.uuid();
        let run_at = new.run_at_wall_ms.unwrap_or(self.wall_ms);
        if let Some(kind) = new.kind.filter(|k| self.policies.get(*k).is_some_and(|p| p.claimed_apart())) {
            self.limited_pending.insert(kind.to_string());
        }
        let row = sql::NewTask {
            id: uuid_string(id),
            kind: new.kind.map(str::to_string),
            payload: new.payload.get().to_string(),
            queue: new.queue || new.run_at_wall_ms.is_some(),
            timeout_ms: new.timeout_ms,
            max_retries: new.max_retries,
            created_ms: self.wall_ms,
            run_at_ms: run_at,
            idem_owner: new.idempotency.map(|(o, _)| o.to_string()),
            idem_key: new.idempotency.map(|(_, k)| k.to_string()),
            runs_now: new.runs_now,
            retry_backoff_ms: new.retry.backoff_ms,
            retry_backoff_max_ms: new.retry.backoff_max_ms,
            retry_any_worker: new.retry.any_worker,
            priority: new.priority,
            // (The API refuses a key with U+0000; a jti is checked against the registry.)
            submitter: storable_lossy(new.submitter),
            fair_key: storable_lossy(new.key),
        };
        if new.runs_now {
            // (This store claims in the transaction that inserts: the core's claim round asks.)
            self.events.push(Event::Ready);
        }
        if run_at > self.wall_ms {
            // Due later: this node looks for it then (the slow poll finds the others' tasks,
            // and this node's later ones, within a second of their time).
            let due = self.now_ms + (run_at - self.wall_ms);
            self.due_ms.insert(due);
            if self.due_ms.len() > node::MAX_DUE_TIMES {
                self.due_ms.pop_last();
            }
        }
        self.insert_bytes += row.payload.len();
        self.inserts.push_back(InsertRec { row, id, to });
        // The task joins the queue with this turn's transaction: every idle group may find it
        // (its own notification does not come back to this node).
        self.queue_changed();
    }

    pub fn lookup_key(&mut self, owner: &str, key: &str, conn: ConnRef, wait: bool, missing: Response) {
        if !self.usable() {
            self.events.push(Event::Answer { conn, response: unavailable() });
            return;
        }
        self.lookups.push(KeyLookup { conn, owner: owner.to_string(), key: key.to_string(), wait, missing });
    }

    pub fn claim(&mut self, ask: &ClaimAsk<'_>) {
        let takers = uuid_array(ask.takers.iter().copied());
        let starved = self.starved.get(&ask.group).is_some_and(|t| *t == takers);
        if starved || !self.usable() || self.claims.len() >= MAX_CLAIMS_PER_TXN {
            self.events.push(Event::Claimed { group: ask.group, tasks: Vec::new() });
            return;
        }
        let kinds = ask.kinds.map(|k| k.iter().filter(|k| storable(k)).map(|k| k.to_string()).collect());
        self.claims.push(ClaimReq { group: ask.group, kinds, limit: ask.limit, takers, seen: 0 });
    }

    /// `/kinds` requests: answered after the next transaction (a change once committed).
    pub fn kind_op(&mut self, op: crate::flow::KindOp, conn: ConnRef) {
        if !self.usable() {
            self.events.push(Event::Answer { conn, response: unavailable() });
            return;
        }
        if let crate::flow::KindOp::Set(kind, Some(_)) = &op
            && !self.policies.contains_key(kind)
            && self.policies.len() >= crate::flow::MAX_POLICIES
        {
            let r = Response::error(409, "too_many_policies", "relay keeps at most 10000 kind policies");
            self.events.push(Event::Answer { conn, response: r });
            return;
        }
        self.kind_reqs.push((conn, op));
    }

    pub fn kind_paused(&self, kind: Option<&str>) -> bool {
        kind.and_then(|k| self.policies.get(k)).is_some_and(|p| p.paused)
    }

    /// A policy as this node now knows it: claims follow it from the next one on.
    fn apply_policy(&mut self, kind: String, policy: Option<crate::flow::Policy>, first_read: bool) {
        let before = self.policies.get(&kind).copied();
        // The kind's rows are brought in line when `holds` turns over — on every node that
        // reads the change, so one that dies meanwhile leaves it to the others — and, for the
        // kinds held no more, on the first read after a start (all nodes may have died before
        // their rows were freed; rows of a held kind not marked yet only cost the walk a step,
        // claims leave them out by the policy row).
        let holds = |p: Option<crate::flow::Policy>| p.is_some_and(|p| p.limits());
        if holds(before) != holds(policy) || (first_read && !holds(policy)) {
            self.rehold.insert(kind.clone(), (i64::MIN, i64::MIN));
        }
        if policy.is_some_and(|p| p.claimed_apart()) {
            self.limited_pending.insert(kind.clone());
        } else {
            self.limited_pending.remove(&kind);
        }
        match policy {
            Some(p) => {
                self.policies.insert(kind, p);
            }
            None => {
                self.held_counted.remove(&kind);
                self.held_lanes.retain(|lane, _| lane.0 != kind);
                self.policies.remove(&kind);
            }
        }
        if before != policy {
            // A kind held no more (or less) may have tasks for idle workers.
            self.unstarve();
        }
    }

    /// Does a policy hold kind `kind` back (paused or limited), as this node knows it?
    fn holds(&self, kind: &str) -> bool {
        self.policies.get(kind).is_some_and(|p| p.limits())
    }

    /// The kind policy that holds a pending task back, as this node knows it (SPEC §14).
    fn note_waiting(&self, task: &crate::tasks::Task) {
        let why = match task.kind.as_deref() {
            Some(k) if task.status == Status::Pending => match self.policies.get(k) {
                Some(p) if p.paused => Some(crate::flow::WaitingOn::Paused),
                Some(p) if p.limits() => {
                    let lane = (k.to_string(), task.submitter.to_string(), task.key.to_string());
                    let by_lane = self.held_lanes.get(&lane).copied();
                    // (The first reason in SPEC order: concurrency before rate.)
                    [self.held_kinds.get(k).copied(), by_lane].into_iter().flatten().min_by_key(|w| w.index())
                }
                _ => None,
            },
            _ => None,
        };
        task.held_by.set(why);
    }

    pub fn give_back(&mut self, id: TaskId, attempt: u32) {
        self.running.remove(&id);
        self.queue_changed();
        self.unclaim.push((uuid_string(id), attempt));
    }

    pub fn attempt_started(&mut self, id: TaskId, attempt: u32, start: &AttemptStart<'_>) {
        let runner = sql::Runner {
            client_id: uuid_string(start.client_id),
            client_ip: start.client_ip.to_string(),
            started_ms: start.started_wall_ms,
        };
        self.starts.insert(id, Start { attempt, runner, written: false });
        self.starts_due.push_back((self.now_ms + START_WRITE_DELAY_MS, id, attempt));
        self.last_start_seq = 0;
        if let Some((worker_id, secret)) = start.session
            && self.session_rows.len() < MAX_SESSION_ROWS
        {
            let seq = self.next_record();
            self.last_start_seq = seq;
            // (A worker id is the worker's text: U+0000, which PostgreSQL's text refuses, is
            // stored replaced, as `take_session` asks for it. Secrets are relay's hex.)
            self.session_rows.push((
                sql::SessionAttempt {
                    id: uuid_string(id),
                    attempt,
                    secret: storable_lossy(secret),
                    worker_id: storable_lossy(worker_id),
                    client_id: uuid_string(start.client_id),
                    started_ms: start.started_wall_ms,
                },
                seq,
            ));
        }
    }

    /// The number of a record (a session attempt row, an attempt end) queued now, uncommitted.
    fn next_record(&mut self) -> u64 {
        self.record_seq += 1;
        self.uncommitted.insert(self.record_seq);
        self.record_seq
    }

    /// The newest record queued (0: none yet).
    pub fn newest_record(&self) -> u64 {
        self.record_seq
    }

    /// The number of the session row the last attempt start queued (0: none), for
    /// [`PgStore::rows_committed`].
    pub fn start_mark(&self) -> u64 {
        self.last_start_seq
    }

    /// Records up to this number are committed (each one that is not is written again, never
    /// dropped).
    pub fn rows_committed(&self) -> u64 {
        self.uncommitted.first().map_or(self.record_seq, |&n| n - 1)
    }

    /// A worker presents a session this node does not know: the session's attempts held on
    /// other nodes come here ([`Event::SessionTaken`] at COMMIT).
    pub fn take_session(&mut self, conn: ConnRef, worker_id: &str, secret: &str) {
        // (A presented secret with U+0000 is none relay issued; it must not reach the database,
        // which would refuse the turn's whole transaction.)
        if !self.usable() || self.takes.len() >= MAX_TAKES || !storable(secret) {
            self.events.push(Event::SessionTaken { conn, found: Vec::new() });
            return;
        }
        self.takes.push(TakeReq { conn, worker_id: worker_id.to_string(), secret: secret.to_string() });
    }

    pub fn attempt_ended(&mut self, id: TaskId, attempt: u32, end: &AttemptEnd<'_>, next: Next<'_>) {
        if self.policies.values().any(|p| p.running_cap().is_some()) {
            // A capped kind may have room again: this node's idle workers look.
            self.unstarve();
        }
        self.running.remove(&id);
        let runner = self.starts.remove(&id).filter(|s| s.attempt == attempt).map(|s| s.runner);
        let lost = self.adopted_from.remove(&id);
        let adopted = lost.is_some();
        let node = if runner.is_some() { Some(self.name.clone()) } else { lost };
        let later = match next {
            Next::Later(l) => l,
            _ => super::Later::default(),
        };
        let next_attempt_ms = later.at_wall_ms.filter(|&at| at > self.wall_ms);
        if let Some(at) = next_attempt_ms {
            // This node looks for it when its wait ends (the others within the slow poll).
            self.due_ms.insert(self.now_ms + (at - self.wall_ms));
            if self.due_ms.len() > node::MAX_DUE_TIMES {
                self.due_ms.pop_last();
            }
        }
        let (status, result, final_error) = match next {
            Next::Retry | Next::Later(_) => ("pending", None, None),
            Next::Done { result } => ("done", Some(result.get().to_string()), None),
            Next::Failed { error } => ("failed", None, Some(storable_lossy(error))),
        };
        let ended = sql::Ended {
            id: uuid_string(id),
            attempt,
            outcome: end.outcome.as_str(),
            error: end.error.map(storable_lossy),
            ended_ms: end.ended_wall_ms,
            // (A lost node's attempt: the core never timed it; its entry's start tells.)
            duration_ms: if adopted { None } else { Some(end.duration_ms) },
            status,
            result,
            final_error,
            runner,
            node,
            uncounted: end.uncounted,
            next_attempt_ms,
            again: later.again.map(uuid_string),
            resumes: end.resumes,
        };
        let final_status = status != "pending";
        if !final_status {
            self.queue_changed();
        }
        let seq = self.next_record();
        self.ended.push(EndRec { ended, refusals: 0, final_status, seq });
    }

    pub fn cancel(&mut self, id: TaskId, scope: Option<&[String]>, conn: ConnRef) {
        if !self.usable() {
            self.events.push(Event::Answer { conn, response: unavailable() });
            return;
        }
        self.cancels.push(CancelReq { conn, id, scope: scope.map(<[String]>::to_vec) });
    }

    pub fn rerun(&mut self, id: TaskId, scope: Option<&[String]>, conn: ConnRef, wait: bool) {
        if !self.usable() {
            self.events.push(Event::Answer { conn, response: unavailable() });
            return;
        }
        self.reruns.push(RerunReq { conn, id, scope: scope.map(<[String]>::to_vec), wait, filter: None });
    }

    pub fn rerun_many(&mut self, filter: &crate::store::RerunFilter, scope: Option<&[String]>, conn: ConnRef) {
        if !self.usable() {
            self.events.push(Event::Answer { conn, response: unavailable() });
            return;
        }
        let filter = Some(filter.clone());
        self.reruns.push(RerunReq { conn, id: 0, scope: scope.map(<[String]>::to_vec), wait: false, filter });
    }

    /// A re-run committed (`rows` of `RERUN`, `task_row` read after it) or `RERUN_MANY` did.
    fn on_rerun(&mut self, r: RerunReq, rows: &[Row], task_row: Option<&Row>) {
        if r.filter.is_some() {
            let ids: Vec<TaskId> = rows.iter().filter_map(|row| row.text(0).and_then(parse_id)).collect();
            if r.filter.as_ref().is_some_and(|f| !f.dry_run) && !ids.is_empty() {
                self.unstarve();
            }
            // (Some matched, and MAX_PENDING left room for none: 429, as a submit would be.)
            let matched = rows.first().and_then(|row| row.i64(1)).unwrap_or(0);
            let response = if ids.is_empty() && matched > 0 {
                crate::store::queue_full_response()
            } else {
                crate::store::rerun_answer(&ids)
            };
            self.events.push(Event::Answer { conn: r.conn, response });
            return;
        }
        let task = task_row.filter(|row| rows::in_scope(row, r.scope.as_deref())).and_then(rows::task);
        let (Some(old), Some(task)) = (rows.first(), task) else {
            self.events.push(Event::Answer { conn: r.conn, response: not_found() });
            return;
        };
        if old.bool(1) != Some(true)
            && matches!(task.status, Status::Failed | Status::Canceled)
            && old.bool(2) == Some(false)
        {
            self.events.push(Event::Answer { conn: r.conn, response: crate::store::queue_full_response() });
            return;
        }
        if old.bool(1) != Some(true) {
            let mut response = crate::tasks::task_response(&task, false);
            response.status = 409;
            self.events.push(Event::Answer { conn: r.conn, response });
            return;
        }
        self.unstarve();
        if r.wait {
            self.events.push(Event::NotFinal { conn: r.conn, id: r.id, post: true });
        } else {
            let response = crate::tasks::task_response(&task, true);
            self.events.push(Event::Answer { conn: r.conn, response });
        }
    }

    /// The answer when it needs no statement (a task this node just made final, or the database
    /// is unavailable); else `None`, and it comes as an event after the turn's transaction.
    pub fn read(&mut self, id: TaskId, scope: Option<&[String]>, conn: ConnRef, how: ReadHow) -> Option<Response> {
        if let (Some(task), ReadHow::Release { post }) = (self.fresh_final.get(&id), how)
            && crate::store::mem::in_scope(task.kind.as_deref(), scope)
        {
            return Some(crate::tasks::task_response(task, post));
        }
        if !self.usable() || self.reads.len() >= MAX_READS_PER_TXN * 4 {
            return Some(unavailable());
        }
        self.reads.push(ReadReq { conn, id, scope: scope.map(<[String]>::to_vec), how });
        None
    }

    pub fn list(&mut self, q: &crate::listing::Query, scope: Option<&[String]>, conn: ConnRef) {
        if !self.usable() {
            self.events.push(Event::Answer { conn, response: unavailable() });
            return;
        }
        self.lists.push(ListReq {
            conn,
            scope: scope.map(<[String]>::to_vec),
            status: q.status.map(Status::as_str),
            kind: q.kind.clone(),
            below: q.below,
            limit: q.limit,
        });
    }

    pub fn watch(&mut self, id: TaskId) {
        self.watched.insert(id);
        // It may have become final before the watch began — unless it was inserted by the last
        // commit and no end was announced since.
        match self.fresh_inserted.remove(&id) {
            Some(sent_ms) if self.finished_noted_ms < sent_ms => {}
            _ => {
                self.check_finished.insert(id);
            }
        }
    }

    pub fn unwatch(&mut self, id: TaskId) {
        self.watched.remove(&id);
    }

    pub fn list_workers(&mut self, conn: ConnRef) {
        if !self.usable() {
            self.events.push(Event::Answer { conn, response: unavailable() });
            return;
        }
        self.worker_reads.push(conn);
    }

    pub fn worker_changed(&mut self, w: &WorkerInfo) {
        self.workers_later.remove(&w.client_id);
        self.workers_written.insert(w.client_id, w.clone());
        self.workers_dirty.insert(w.client_id, w.clone());
    }

    /// Only a worker's `in_flight` changed: its row follows with the slow poll.
    pub fn worker_busy(&mut self, client_id: u128, in_flight: u32) {
        if let Some(w) = self.workers_written.get_mut(&client_id) {
            w.in_flight = in_flight;
            if !self.workers_dirty.contains_key(&client_id) {
                self.workers_later.insert(client_id, w.clone());
            }
        }
    }

    pub fn worker_gone(&mut self, client_id: u128) {
        self.workers_written.remove(&client_id);
        self.workers_later.remove(&client_id);
        self.workers_dirty.remove(&client_id);
        if self.workers_gone.len() < MAX_WORKERS_GONE {
            self.workers_gone.push(client_id);
        } else {
            self.workers_gone.clear();
            self.workers_resync = true;
        }
    }

    pub fn remote_workers(&self) -> &[WorkerInfo] {
        &self.remote
    }

    /// The database fails waiting tasks nobody can take (`FAIL_UNPLACEABLE`, against the
    /// cluster's worker rows: after this node's worker rows changed, and once a second).
    pub fn fail_unplaceable(&mut self, _takers: &dyn Takers, _kinds: Option<&[Option<Box<str>>]>) {
        self.want_unplaceable = true;
    }

    pub fn take_events(&mut self, out: &mut Vec<Event>) {
        out.append(&mut self.events);
    }

    // ----- time --------------------------------------------------------------------------------

    pub fn next_timer_ms(&self) -> Option<u64> {
        let due = self.due_ms.first().copied().into_iter();
        let start = self.starts_due.front().map(|&(at, ..)| at);
        due.chain(start).min().map(|at| at.min(self.next_tick_ms)).or(Some(self.next_tick_ms))
    }

    /// The store's own timer: periodic refreshes, the slow poll behind notifications, dead
    /// nodes' attempts, and tasks scheduled from this node falling due.
    pub fn on_timer(&mut self) {
        let now = self.now_ms;
        if self.due_ms.first().is_some_and(|&d| d <= now) {
            while self.due_ms.first().is_some_and(|&d| d <= now) {
                self.due_ms.pop_first();
            }
            self.unstarve();
        }
        if now < self.next_tick_ms {
            return;
        }
        self.next_tick_ms = now + node::TICK_MS;
        // (Every tick: a policy set on another node applies here within a second, SPEC §14.)
        self.want_policies = true;
        if now >= self.next_tokens_ms {
            self.want_tokens = true;
            self.next_tokens_ms = now + node::TOKEN_REFRESH_MS;
        }
        if now >= self.next_cache_ms {
            self.want_counts = true;
            self.want_workers = true;
            self.next_cache_ms = now + node::CACHE_REFRESH_MS;
        }
        if now >= self.next_adopt_ms {
            self.next_adopt_ms = now + node::ADOPT_MS;
            self.want_housekeeping = true;
            // (Dead nodes are told from live ones once this node's connection settled: after a
            // database restart the UNLOGGED heartbeats and worker rows are gone a while.)
            if self.db.settled() {
                self.want_adopt = true;
                self.want_unplaceable = true;
            }
        }
        if now >= self.next_poll_ms {
            self.next_poll_ms = now + node::POLL_MS;
            let later: Vec<(u128, WorkerInfo)> = self.workers_later.drain().collect();
            self.workers_dirty.extend(later);
            let watched: Vec<TaskId> = self.watched.iter().copied().collect();
            self.check_finished.extend(watched);
            self.unstarve();
        }
    }

    /// Tasks may wait for this node's idle workers: every group may claim again.
    fn unstarve(&mut self) {
        self.queue_changed();
        self.events.push(Event::Ready);
    }

    /// The queue may hold something new for idle groups: none is starved any more, and a
    /// claim already on its way, whose snapshot may not see it, starves no group either
    /// ([`Self::on_claimed`]).
    fn queue_changed(&mut self) {
        self.starved.clear();
        self.queue_changes += 1;
    }

    fn has_work(&self) -> bool {
        !self.lookups.is_empty()
            || !self.inserts.is_empty()
            || !self.claims.is_empty()
            || self.starts_due.front().is_some_and(|&(at, ..)| at <= self.now_ms)
            || !self.ended.is_empty()
            || !self.unclaim.is_empty()
            || !self.cancels.is_empty()
            || !self.reruns.is_empty()
            || !self.reads.is_empty()
            || !self.lists.is_empty()
            || !self.worker_reads.is_empty()
            || !self.check_finished.is_empty()
            || !self.workers_dirty.is_empty()
            || !self.workers_gone.is_empty()
            || self.workers_resync
            || self.orphans
            || self.want_counts
            || self.want_workers
            || self.want_tokens
            || self.want_adopt
            || !self.takes.is_empty()
            || !self.session_rows.is_empty()
            || self.want_housekeeping
            || (self.want_unplaceable && self.db.settled())
            || !self.kind_reqs.is_empty()
            || !self.rehold.is_empty()
            || self.want_policies
    }

    fn take_tag(&mut self) -> u64 {
        let t = self.next_tag;
        self.next_tag += 1;
        t
    }

    // ----- the turn transaction ------------------------------------------------------------------

    /// End of a loop turn: everything the turn wants stored or read leaves as one transaction,
    /// unless one is in flight (then it waits and leaves with the next turn's records).
    pub fn end_turn(&mut self) {
        if self.sent.is_some() {
            if !self.usable() {
                // Stalled: what waits behind the transaction in flight is answered 503 now
                // (the transaction's own requests get its outcome when it comes).
                self.fail_queued();
            }
            return;
        }
        if self.db.health() != Health::Ok {
            self.fail_queued();
            return;
        }
        if !self.has_work() {
            return;
        }
        let (stmts, parts) = self.build();
        if stmts.is_empty() {
            return;
        }
        let tag = self.take_tag();
        self.stats.statements += stmts.len() as u64;
        match self.db.send(Request { tag, stmts }) {
            Ok(()) => self.sent = Some(Sent { tag, parts, at_ms: self.now_ms }),
            Err(_) => {
                self.stats.unreachable += 1;
                self.fail_parts(parts, &Failure::Unreachable);
            }
        }
    }

    /// The statements of the next transaction, and what each is for.
    fn build(&mut self) -> (Vec<Stmt>, Vec<Part>) {
        let mut stmts: Vec<Stmt> = Vec::new();
        let mut parts: Vec<Part> = Vec::new();
        let mut notify_pending = false;
        let mut notify_finished = false;
        let (wall, node_id) = (self.wall_ms, self.id.clone());

        if !self.lookups.is_empty() {
            let lookups = std::mem::take(&mut self.lookups);
            stmts.push(idempotent_lookup(lookups.iter().map(|l| (l.owner.as_str(), l.key.as_str()))));
            parts.push(Part::Lookups(lookups));
        }
        // A record refused alone before travels alone (it cannot keep the others out).
        if let Some(i) = self.ended.iter().position(|r| r.refusals >= MAX_REFUSALS) {
            let rec = self.ended.remove(i);
            stmts.push(sql::attempt_ended(&node_id, std::slice::from_ref(&rec.ended)).with_json(rows::col::JSON));
            parts.push(Part::Ended(vec![rec]));
            return (stmts, parts);
        }
        // Policies set by this node take effect before its claims do. First in the transaction:
        // `POLICY_LOCK` and the policy row's lock are taken before anything its inserts lock
        // (an insert of a kind waits for a change of its policy row), so two nodes setting
        // policies never wait on each other in a circle. `INSERT_LOCK` comes before them: a
        // node's `INSERT_TASKS` waits for a policy row this transaction changes, and holds
        // `INSERT_LOCK` meanwhile — taken after the row, it closed a circle (measured: a PUT
        // a few ms apart on one node while two submit, 19 deadlocks in 20 s, each a second's
        // stall and 503s on both nodes).
        if self.kind_reqs.iter().any(|(_, op)| matches!(op, crate::flow::KindOp::Set(..))) {
            stmts.push(Stmt::new(sql::INSERT_LOCK, vec![]));
            parts.push(Part::InsertLock);
        }
        for (conn, op) in std::mem::take(&mut self.kind_reqs) {
            let kind = match &op {
                crate::flow::KindOp::Set(kind, policy) => {
                    stmts.push(Stmt::new(sql::POLICY_LOCK, vec![]));
                    parts.push(Part::PolicyLock);
                    let json = policy.map(|p| p.to_json());
                    stmts.push(Stmt::new(
                        sql::SET_POLICY,
                        vec![
                            kind.as_str().into(),
                            json.map_or(Param::Null, Param::Text),
                            policy.is_some_and(|p| p.limits()).into(),
                        ],
                    ));
                    parts.push(Part::PolicySet(kind.clone(), *policy));
                    Some(kind.clone())
                }
                crate::flow::KindOp::Get(kind) => Some(kind.clone()),
                crate::flow::KindOp::List => None,
            };
            let list = kind.is_none();
            let stmt = Stmt::new(sql::KINDS, vec![kind.map_or(Param::Null, Param::Text)]);
            // (A list's JSON is made where its rows are read, a piece a row: `kinds::pack`.)
            stmts.push(if list { stmt.with_rows_made(kinds::pack) } else { stmt });
            parts.push(Part::Kinds(conn, op));
        }
        if !self.inserts.is_empty() {
            let batch = node::take_inserts(&mut self.inserts, &mut self.insert_bytes);
            let rows: Vec<sql::NewTask> = batch.iter().map(|r| r.row.clone()).collect();
            if !parts.iter().any(|p| matches!(p, Part::InsertLock)) {
                stmts.push(Stmt::new(sql::INSERT_LOCK, vec![]));
                parts.push(Part::InsertLock);
            }
            stmts.push(sql::insert_tasks(&rows, self.cfg.max_pending as u64, self.cfg.max_pending_bytes as u64));
            let keys: Vec<(String, String)> =
                rows.iter().filter_map(|r| Some((r.idem_owner.clone()?, r.idem_key.clone()?))).collect();
            parts.push(Part::Insert(batch));
            if !keys.is_empty() {
                stmts.push(idempotent_lookup(keys.iter().map(|(o, k)| (o.as_str(), k.as_str()))));
                parts.push(Part::InsertKeys);
            }
            notify_pending = true;
        }
        if !self.ended.is_empty() {
            let recs = std::mem::take(&mut self.ended);
            let ended: Vec<sql::Ended> = recs.iter().map(|r| r.ended.clone()).collect();
            stmts.push(sql::attempt_ended(&node_id, &ended).with_json(rows::col::JSON));
            notify_pending |= recs.iter().any(|r| !r.final_status);
            notify_finished |= recs.iter().any(|r| r.final_status);
            parts.push(Part::Ended(recs));
        }
        let mut unwritten: Vec<(String, u32, sql::Runner)> = Vec::new();
        // (A task canceled here has its start written first: the cancel's answer shows it.)
        for c in &self.cancels {
            if let Some(s) = self.starts.get_mut(&c.id).filter(|s| !s.written) {
                s.written = true;
                unwritten.push((uuid_string(c.id), s.attempt, s.runner.clone()));
            }
        }
        while let Some(&(at, id, attempt)) = self.starts_due.front()
            && at <= self.now_ms
        {
            self.starts_due.pop_front();
            if let Some(s) = self.starts.get_mut(&id).filter(|s| s.attempt == attempt && !s.written) {
                s.written = true;
                unwritten.push((uuid_string(id), attempt, s.runner.clone()));
            }
        }
        if !unwritten.is_empty() {
            let ids: Vec<(TaskId, u32)> = unwritten.iter().filter_map(|(id, a, _)| Some((parse_id(id)?, *a))).collect();
            stmts.push(sql::attempt_started(&node_id, &self.name, &unwritten));
            parts.push(Part::Started(ids));
        }
        if !self.unclaim.is_empty() {
            let back = std::mem::take(&mut self.unclaim);
            stmts.push(sql::unclaim(&node_id, &back));
            parts.push(Part::Unclaim(back));
            notify_pending = true;
        }
        if self.orphans {
            self.orphans = false;
            let known: Vec<TaskId> = self.running.keys().chain(self.starts.keys()).copied().collect();
            stmts.push(Stmt::new(sql::RELEASE_ORPHANS, vec![node_id.as_str().into(), Param::Text(uuid_array(known))]));
            parts.push(Part::Orphans);
            notify_pending = true;
        }
        for c in std::mem::take(&mut self.cancels) {
            let scope = c.scope.as_ref().map_or(Param::Null, |k| text_array(k));
            stmts.push(Stmt::new(sql::CANCEL, vec![uuid_string(c.id).into(), (wall as i64).into(), scope]));
            stmts.push(Stmt::new(sql::GET_TASKS, vec![Param::Text(uuid_array([c.id]))]).with_json(rows::col::JSON));
            parts.push(Part::Cancel(c));
            parts.push(Part::CancelRead);
            notify_finished = true;
        }
        if !self.reruns.is_empty() && !parts.iter().any(|p| matches!(p, Part::InsertLock)) {
            // (Re-runs queue tasks as inserts do: `FAIR_SWEEP` must not remove their lanes.)
            stmts.push(Stmt::new(sql::INSERT_LOCK, vec![]));
            parts.push(Part::InsertLock);
        }
        for r in std::mem::take(&mut self.reruns) {
            match &r.filter {
                None => {
                    stmts.push(sql::rerun(
                        &uuid_string(r.id),
                        r.scope.as_deref(),
                        wall,
                        self.cfg.max_pending as u64,
                        self.cfg.max_pending_bytes as u64,
                    ));
                    stmts.push(
                        Stmt::new(sql::GET_TASKS, vec![Param::Text(uuid_array([r.id]))]).with_json(rows::col::JSON),
                    );
                    parts.push(Part::Rerun(r));
                    parts.push(Part::CancelRead);
                }
                Some(f) => {
                    stmts.push(sql::rerun_many(
                        f,
                        r.scope.as_deref(),
                        crate::store::RERUN_SCAN,
                        wall,
                        self.cfg.max_pending as u64,
                        self.cfg.max_pending_bytes as u64,
                    ));
                    parts.push(Part::Rerun(r));
                }
            }
            notify_pending = true;
        }
        if std::mem::take(&mut self.workers_resync) {
            self.workers_gone.clear();
            let connected: Vec<u128> = self.workers_written.keys().copied().collect();
            stmts.push(Stmt::new(
                sql::RESYNC_WORKERS,
                vec![node_id.as_str().into(), Param::Text(uuid_array(connected))],
            ));
            parts.push(Part::ResyncWorkers);
        }
        if !self.workers_gone.is_empty() {
            let gone = std::mem::take(&mut self.workers_gone);
            stmts.push(Stmt::new(
                sql::DELETE_WORKERS,
                vec![Param::Text(uuid_array(gone.iter().copied())), node_id.as_str().into()],
            ));
            parts.push(Part::DeleteWorkers(gone));
        }
        if !self.workers_dirty.is_empty() {
            let dirty: Vec<WorkerInfo> = self.workers_dirty.drain().map(|(_, w)| w).collect();
            stmts.push(upsert_workers(&node_id, &dirty));
            parts.push(Part::UpsertWorkers(dirty.iter().map(|w| w.client_id).collect()));
        }
        // Pending rows brought in line with a changed policy, a bounded step per kind (after this
        // transaction's own policy changes: their locks are taken first).
        // (In turns: the kinds after the last one stepped come first, then from the start.)
        let after = (std::ops::Bound::Excluded(self.rehold_last.as_str()), std::ops::Bound::Unbounded);
        let turn: Vec<(String, (i64, i64))> = (self.rehold.range::<str, _>(after))
            .chain(self.rehold.iter())
            .take(REHOLD_KINDS.min(self.rehold.len()))
            .map(|(k, &at)| (k.clone(), at))
            .collect();
        for (kind, (ord, seq)) in turn {
            stmts.push(Stmt::new(
                sql::REHOLD,
                vec![kind.as_str().into(), ord.into(), seq.into(), sql::REHOLD_ROWS.into()],
            ));
            self.rehold_last.clone_from(&kind);
            parts.push(Part::Rehold(kind));
        }
        // Kinds a policy holds back: paused ones wait; limited ones are claimed on their own,
        // under their locks (`CLAIM_LIMITED`), each kind only when its lock was free
        // (`KIND_LOCKS` never waits: a kind another node is claiming is left for the next look,
        // `KIND_BACKLOG`'s, and delays no other kind).
        let mut limited: Vec<sql::Limited<'_>> = self
            .policies
            .iter()
            .filter(|(k, p)| p.claimed_apart() && self.limited_pending.contains(k.as_str()))
            .map(|(k, p)| sql::Limited {
                kind: k.as_str(),
                cap: p.kind_cap(),
                bucket: p.kind_bucket().map(|b| b.rate_and_capacity()),
                key_cap: p.key_cap(),
                key_bucket: p.key_bucket().map(|b| b.rate_and_capacity()),
            })
            .collect();
        limited.sort_unstable_by(|a, b| a.kind.cmp(b.kind));
        for mut c in std::mem::take(&mut self.claims) {
            c.seen = self.queue_changes;
            let kinds: Option<Vec<&str>> =
                c.kinds.as_ref().map(|k| k.iter().map(String::as_str).filter(|k| !self.holds(k)).collect());
            let mine: Vec<sql::Limited<'_>> = limited
                .iter()
                .filter(|l| c.kinds.as_ref().is_none_or(|ks| ks.iter().any(|k| k == l.kind)))
                .copied()
                .collect();
            if !mine.is_empty() {
                let names: Vec<&str> = mine.iter().map(|l| l.kind).collect();
                stmts.push(Stmt::new(sql::KIND_LOCKS, vec![text_array_of(&names), (wall as i64).into()]));
                parts.push(Part::KindLocks);
                stmts
                    .push(sql::claim_limited(&node_id, c.group, &mine, wall, c.limit, &c.takers).with_json(ccol::JSON));
                parts.push(Part::ClaimLimited);
                stmts.push(Stmt::new(sql::KIND_BACKLOG, vec![text_array_of(&names), (wall as i64).into()]));
                parts.push(Part::KindBacklog);
                if let Some(s) = sql::lane_backlog(&mine, wall) {
                    let keyed = mine.iter().filter(|l| l.key_cap.is_some() || l.key_bucket.is_some());
                    stmts.push(s);
                    parts.push(Part::LaneBacklog(keyed.map(|l| l.kind.to_string()).collect()));
                }
            }
            stmts.push(sql::claim(&node_id, c.group, kinds.as_deref(), wall, c.limit, &c.takers).with_json(ccol::JSON));
            parts.push(Part::Claim(c));
        }
        if !self.session_rows.is_empty() {
            let (rows, seqs): (Vec<sql::SessionAttempt>, Vec<u64>) =
                std::mem::take(&mut self.session_rows).into_iter().unzip();
            stmts.push(sql::session_attempts(&node_id, &rows));
            // (A failed transaction's rows come back to the queue for the next.)
            parts.push(Part::SessionAttempts(rows, seqs));
        }
        for t in std::mem::take(&mut self.takes) {
            stmts.push(Stmt::new(
                sql::TAKE_SESSION,
                vec![
                    node_id.as_str().into(),
                    t.secret.as_str().into(),
                    storable_lossy(&t.worker_id).into(),
                    (self.resume_window_ms as i64).into(),
                ],
            ));
            parts.push(Part::TakeSession(t));
        }
        if std::mem::take(&mut self.want_adopt) {
            stmts.push(
                Stmt::new(
                    sql::ADOPT_ORPHANS,
                    vec![
                        node_id.as_str().into(),
                        (self.lease_ms as i64).into(),
                        (self.resume_window_ms as i64).into(),
                        (self.cfg.task_timeout_ms as i64).into(),
                    ],
                )
                .with_json(ccol::JSON),
            );
            parts.push(Part::Adopt);
        }
        if self.want_unplaceable && self.db.settled() {
            self.want_unplaceable = false;
            // (After this transaction's worker rows: a worker that left counts no more.)
            stmts.push(sql::fail_unplaceable(self.lease_ms, wall as i64));
            parts.push(Part::Failed);
            notify_finished = true;
        }
        if std::mem::take(&mut self.want_housekeeping) {
            stmts.push(sql::expire_in_queue(wall as i64, self.cfg.task_ttl_ms));
            parts.push(Part::Failed);
            let failed_ttl = if self.cfg.failed_ttl_ms > 0 { self.cfg.failed_ttl_ms } else { self.cfg.task_ttl_ms };
            stmts.push(sql::retention(wall as i64, self.cfg.task_ttl_ms, failed_ttl));
            parts.push(Part::Retention);
            notify_finished = true;
        }
        if !self.check_finished.is_empty() {
            let ids: Vec<TaskId> = self.check_finished.drain().collect();
            stmts.push(
                Stmt::new(sql::FINISHED_AMONG, vec![Param::Text(uuid_array(ids.iter().copied()))])
                    .with_json(rows::col::JSON),
            );
            parts.push(Part::Finished(ids));
        }
        if !self.reads.is_empty() {
            let n = self.reads.len().min(MAX_READS_PER_TXN);
            let reads: Vec<ReadReq> = self.reads.drain(..n).collect();
            let (with, without): (Vec<ReadReq>, Vec<ReadReq>) =
                reads.into_iter().partition(|r| matches!(r.how, ReadHow::Get { payload: true }));
            for (reads, sql) in [(without, sql::GET_TASKS), (with, sql::GET_TASKS_PAYLOAD)] {
                if reads.is_empty() {
                    continue;
                }
                let ids: HashSet<TaskId> = reads.iter().map(|r| r.id).collect();
                stmts.push(Stmt::new(sql, vec![Param::Text(uuid_array(ids))]).with_json(rows::col::JSON));
                parts.push(Part::Reads(reads));
            }
        }
        let n = self.lists.len().min(MAX_READS_PER_TXN);
        for l in self.lists.drain(..n) {
            let scope = l.scope.as_ref().map_or(Param::Null, |k| text_array(k));
            stmts.push(
                Stmt::new(
                    sql::LIST_TASKS,
                    vec![
                        l.status.map_or(Param::Null, Param::from),
                        l.kind.as_deref().map_or(Param::Null, Param::from),
                        scope,
                        (l.below.min(i64::MAX as u64) as i64).into(),
                        (l.limit as i64 + 1).into(),
                        (crate::listing::MAX_SCAN as i64).into(),
                        (crate::listing::MAX_PAGE_BYTES as i64).into(),
                    ],
                )
                .with_json(rows::col::JSON),
            );
            parts.push(Part::List(l));
        }
        if !self.worker_reads.is_empty() || std::mem::take(&mut self.want_workers) {
            stmts.push(Stmt::new(sql::LIST_WORKERS, vec![(self.lease_ms as i64).into()]));
            parts.push(Part::Workers(std::mem::take(&mut self.worker_reads)));
        }
        if std::mem::take(&mut self.want_counts) {
            stmts.push(Stmt::new(sql::COUNTS, vec![]));
            parts.push(Part::Counts);
            if !self.policies.is_empty() {
                let mut kinds: Vec<&str> = self.policies.keys().map(String::as_str).collect();
                kinds.sort_unstable();
                kinds.truncate(crate::flow::MAX_LABELLED_KINDS);
                stmts.push(Stmt::new(sql::KIND_GAUGES, vec![text_array_of(&kinds)]));
                parts.push(Part::KindGauges);
                let limited: Vec<&str> =
                    (self.policies.iter()).filter(|(_, p)| p.claimed_apart()).map(|(k, _)| k.as_str()).collect();
                if !limited.is_empty() {
                    stmts.push(Stmt::new(sql::LIMITED_PENDING, vec![text_array_of(&limited)]));
                    parts.push(Part::LimitedPending);
                }
            } else {
                self.kind_gauges.clear();
            }
        }
        if std::mem::take(&mut self.want_policies) {
            stmts.push(Stmt::new(sql::POLICY_CHANGES, vec![self.policies_high.into()]));
            parts.push(Part::PolicyChanges);
        }
        if std::mem::take(&mut self.want_tokens) {
            let high = self.tokens.borrow().high_water();
            stmts.push(Stmt::new(sql::TOKEN_CHANGES, vec![high.into()]));
            parts.push(Part::Tokens);
        }
        for (flag, channel) in [(notify_pending, sql::CHANNEL_PENDING), (notify_finished, sql::CHANNEL_FINISHED)] {
            if flag {
                stmts.push(Stmt::new(sql::NOTIFY, vec![channel.into()]));
                parts.push(Part::Notify);
            }
        }
        (stmts, parts)
    }

    /// The database is unreachable: held requests are answered 503 at once; records (attempt
    /// ends, worker rows) stay queued for when it returns.
    fn fail_queued(&mut self) {
        let mut parts = Vec::new();
        if !self.lookups.is_empty() {
            parts.push(Part::Lookups(std::mem::take(&mut self.lookups)));
        }
        if !self.inserts.is_empty() {
            self.insert_bytes = 0;
            parts.push(Part::Insert(self.inserts.drain(..).collect()));
        }
        for c in std::mem::take(&mut self.cancels) {
            parts.push(Part::Cancel(c));
        }
        for r in std::mem::take(&mut self.reruns) {
            parts.push(Part::Rerun(r));
        }
        if !self.reads.is_empty() {
            parts.push(Part::Reads(std::mem::take(&mut self.reads)));
        }
        for l in std::mem::take(&mut self.lists) {
            parts.push(Part::List(l));
        }
        if !self.worker_reads.is_empty() {
            parts.push(Part::Workers(std::mem::take(&mut self.worker_reads)));
        }
        for c in std::mem::take(&mut self.claims) {
            parts.push(Part::Claim(c));
        }
        for (conn, op) in std::mem::take(&mut self.kind_reqs) {
            parts.push(Part::Kinds(conn, op));
        }
        if !parts.is_empty() {
            self.fail_parts(parts, &Failure::Unreachable);
        }
    }

    /// A transaction failed (or was never sent): held requests get 503, records are queued
    /// again (fenced writes: sending one twice is harmless), claims answer empty.
    fn fail_parts(&mut self, parts: Vec<Part>, why: &Failure) {
        let refused = matches!(why, Failure::Refused(_));
        let (answer, refusal) = match why {
            Failure::Lost(_) => (crate::store::lost_response(), Refusal::Lost),
            _ => (unavailable(), Refusal::Unavailable),
        };
        for part in parts {
            match part {
                Part::Lookups(ls) => {
                    for l in ls {
                        self.events.push(Event::Answer { conn: l.conn, response: answer.clone() });
                    }
                }
                Part::Insert(items) => {
                    for r in items {
                        self.events.push(Event::NotInserted { to: r.to, why: refusal });
                    }
                }
                Part::Ended(recs) => {
                    for mut r in recs {
                        r.refusals = r.refusals.saturating_add(u8::from(refused));
                        if r.refusals == MAX_REFUSALS {
                            crate::log!(
                                Level::Error,
                                "the database keeps refusing an attempt's end; it is written alone from now on",
                                task_id = r.ended.id
                            );
                        }
                        self.ended.push(r);
                    }
                }
                Part::Started(ids) => {
                    for (id, attempt) in ids {
                        if let Some(s) = self.starts.get_mut(&id).filter(|s| s.attempt == attempt) {
                            s.written = false;
                            self.starts_due.push_back((self.now_ms, id, attempt));
                        }
                    }
                }
                Part::Unclaim(back) => self.unclaim.extend(back),
                Part::Orphans => self.orphans = true,
                Part::Adopt => {}
                Part::SessionAttempts(rows, seqs) => self.session_rows.extend(rows.into_iter().zip(seqs)),
                Part::TakeSession(t) => {
                    // (Lost: it may have committed; what came here unseen goes back.)
                    if matches!(why, Failure::Lost(_)) {
                        self.orphans = true;
                    }
                    self.events.push(Event::SessionTaken { conn: t.conn, found: Vec::new() });
                }
                Part::Cancel(c) => self.events.push(Event::Answer { conn: c.conn, response: answer.clone() }),
                Part::Rerun(r) => self.events.push(Event::Answer { conn: r.conn, response: answer.clone() }),
                Part::DeleteWorkers(gone) => self.workers_gone.extend(gone),
                Part::ResyncWorkers => self.workers_resync = true,
                Part::UpsertWorkers(_) => self.workers_resync = true,
                Part::Claim(c) => {
                    // Lost: the claim may have committed; what the database gave this node and
                    // it never saw goes back (`RELEASE_ORPHANS`).
                    if matches!(why, Failure::Lost(_)) {
                        self.orphans = true;
                    }
                    self.events.push(Event::Claimed { group: c.group, tasks: Vec::new() });
                }
                Part::Reads(rs) => {
                    for r in rs {
                        self.events.push(Event::Answer { conn: r.conn, response: answer.clone() });
                    }
                }
                Part::List(l) => self.events.push(Event::Answer { conn: l.conn, response: answer.clone() }),
                Part::Workers(conns) => {
                    for conn in conns {
                        self.events.push(Event::Answer { conn, response: answer.clone() });
                    }
                    self.want_workers = true;
                }
                Part::Counts => self.want_counts = true,
                Part::Tokens => self.want_tokens = true,
                Part::Failed => {}
                // (Tried again with the next housekeeping, a second later.)
                Part::Retention => {}
                Part::Finished(ids) => self.check_finished.extend(ids),
                Part::InsertLock | Part::InsertKeys | Part::CancelRead | Part::Notify => {}
                Part::PolicyLock
                | Part::PolicySet(..)
                | Part::KindLocks
                | Part::KindBacklog
                | Part::LaneBacklog(_)
                | Part::Rehold(_)
                | Part::LimitedPending
                | Part::KindGauges => {}
                Part::ClaimLimited => {
                    if matches!(why, Failure::Lost(_)) {
                        self.orphans = true;
                    }
                }
                Part::Kinds(conn, _) => self.events.push(Event::Answer { conn, response: answer.clone() }),
                Part::PolicyChanges => self.want_policies = true,
            }
        }
        // Every group may claim again once the database answers.
        if refused || matches!(why, Failure::Lost(_)) {
            self.events.push(Event::Ready);
        }
    }

    // ----- what the database says ------------------------------------------------------------

    /// The database threads woke the loop: health changes, replies, notifications.
    pub fn on_wake(&mut self) {
        let health = self.db.health();
        if health != self.health {
            self.health = health;
            crate::log!(Level::Info, "database health", node = self.name, database = health.as_str());
            if health == Health::Ok {
                // After an outage (or a database restart, which empties the UNLOGGED worker
                // table) the node writes its workers again and catches up on what it missed.
                self.want_counts = true;
                self.want_workers = true;
                self.want_tokens = true;
                self.workers_resync = true;
                self.workers_gone.clear();
                let all: Vec<(u128, WorkerInfo)> =
                    self.workers_written.iter().map(|(&id, w)| (id, w.clone())).collect();
                self.workers_dirty.extend(all);
                let watched: Vec<TaskId> = self.watched.iter().copied().collect();
                self.check_finished.extend(watched);
                self.unstarve();
            }
        }
        let mut replies: Vec<Reply> = Vec::new();
        self.db.take_replies(&mut replies);
        self.fresh_final.clear();
        self.fresh_inserted.clear();
        for reply in replies {
            let Some(sent) = self.sent.take_if(|s| s.tag == reply.tag) else { continue };
            match reply.result {
                Ok(mut rows) => {
                    self.stats.committed += 1;
                    self.refused_in_a_row = 0;
                    self.on_committed(sent.parts, &mut rows, sent.at_ms);
                }
                Err(failure) => {
                    match &failure {
                        Failure::Refused(e) => {
                            self.stats.refused += 1;
                            self.refused_in_a_row += 1;
                            crate::log!(Level::Error, "the database refused a transaction", error = e);
                        }
                        Failure::Lost(e) => {
                            self.stats.lost += 1;
                            crate::log!(Level::Warn, "a database transaction was lost", error = e);
                        }
                        Failure::Unreachable => self.stats.unreachable += 1,
                    }
                    self.fail_parts(sent.parts, &failure);
                }
            }
        }
        for channel in self.db.take_notified() {
            match channel {
                sql::CHANNEL_PENDING => self.unstarve(),
                sql::CHANNEL_CANCEL => {
                    let running: Vec<TaskId> = self.running.keys().copied().collect();
                    self.check_finished.extend(running);
                }
                sql::CHANNEL_TOKENS => self.want_tokens = true,
                sql::CHANNEL_FINISHED => {
                    self.finished_noted_ms = self.now_ms;
                    let watched: Vec<TaskId> = self.watched.iter().copied().collect();
                    self.check_finished.extend(watched);
                }
                _ => {}
            }
        }
    }

    /// The transaction committed: each part gets its rows.
    fn on_committed(&mut self, parts: Vec<Part>, rows: &mut [Rows], sent_ms: u64) {
        let mut parts = parts.into_iter().enumerate().peekable();
        while let Some((i, part)) = parts.next() {
            let here = rows_of(rows, i);
            match part {
                Part::Lookups(ls) => {
                    let found = held_keys(here);
                    for l in ls {
                        let held = found.get(&(l.owner.as_str(), l.key.as_str())).copied();
                        self.events.push(Event::Key { conn: l.conn, wait: l.wait, held, missing: Box::new(l.missing) });
                    }
                }
                Part::Insert(items) => {
                    let holders = match parts.peek() {
                        Some((j, Part::InsertKeys)) => held_keys(rows_of(rows, *j))
                            .into_iter()
                            .map(|((o, k), v)| ((o.to_string(), k.to_string()), v))
                            .collect(),
                        _ => HashMap::new(),
                    };
                    self.on_inserted(items, here, &holders, sent_ms);
                }
                Part::Ended(recs) => self.on_ended(recs, here),
                Part::Claim(c) => self.on_claimed(c, here),
                Part::Adopt => self.on_adopted(here),
                Part::SessionAttempts(_, seqs) => {
                    for seq in seqs {
                        self.uncommitted.remove(&seq);
                    }
                }
                Part::TakeSession(t) => self.on_taken(t, here),
                Part::Orphans => {
                    if !here.is_empty() {
                        crate::log!(
                            Level::Warn,
                            "claimed tasks this node never received went back to pending",
                            count = here.len()
                        );
                    }
                }
                Part::Cancel(c) => {
                    let canceled = here.first();
                    let task_row = parts.peek().and_then(|(j, _)| rows_of(rows, *j).first());
                    self.on_canceled(c, canceled, task_row);
                }
                Part::Rerun(r) => {
                    let task_row = match (&r.filter, parts.peek()) {
                        (None, Some((j, _))) => rows_of(rows, *j).first(),
                        _ => None,
                    };
                    self.on_rerun(r, here, task_row);
                }
                Part::Finished(_) => {
                    for row in here {
                        let Some(t) = rows::task(row) else { continue };
                        if let Some(attempt) = self.running.remove(&t.id) {
                            // Over elsewhere (canceled on some node, or reaped while this node
                            // was cut off): the worker is told to stop. A start not written yet
                            // still is (who ran the canceled attempt), then forgotten.
                            match self.starts.get(&t.id) {
                                Some(s) if !s.written && s.attempt == attempt => {
                                    self.starts_due.push_back((self.now_ms, t.id, attempt));
                                }
                                _ => {
                                    self.starts.remove(&t.id);
                                }
                            }
                            self.events.push(Event::Stop { id: t.id, attempt });
                        }
                        self.events.push(Event::Final { id: t.id, status: t.status, took_ms: None });
                    }
                }
                Part::Reads(reads) => self.on_reads(reads, here),
                Part::Started(ids) => {
                    // (A start written after its attempt ended elsewhere was the last of it.)
                    for (id, _) in ids {
                        if !self.running.contains_key(&id) {
                            self.starts.remove(&id);
                        }
                    }
                }
                Part::Failed => {
                    // Rows: id, (error,) created_ms of tasks that failed waiting.
                    for row in here {
                        let Some(id) = row.text(0).and_then(parse_id) else { continue };
                        let created = row.i64(row.len() - 1).and_then(|v| u64::try_from(v).ok()).unwrap_or(0);
                        let took = self.wall_ms.saturating_sub(created);
                        self.events.push(Event::Final { id, status: Status::Failed, took_ms: Some(took) });
                    }
                }
                Part::Retention => {
                    // A full batch: more may be due, so the next transaction looks again.
                    if here.first().and_then(|r| r.i64(0)) == Some(sql::RETENTION_BATCH) {
                        self.want_housekeeping = true;
                    }
                }
                Part::PolicyLock | Part::KindLocks => {}
                Part::Rehold(kind) => {
                    let row = here.first();
                    let found = row.and_then(|r| r.i64(1)).unwrap_or(0);
                    let last = row.and_then(|r| Some((r.i64(2)?, r.i64(3)?)));
                    match (row.and_then(|r| r.bool(0)), last) {
                        // A held kind: walked on from the last row.
                        (Some(true), Some(last)) if found >= sql::REHOLD_ROWS => {
                            self.rehold.insert(kind, last);
                        }
                        // A kind held no more: its held rows, from the first again.
                        (Some(false), _) if found >= sql::REHOLD_ROWS => {}
                        _ => {
                            self.rehold.remove(&kind);
                        }
                    }
                }
                Part::KindGauges => {
                    self.kind_gauges = here
                        .iter()
                        .filter_map(|r| {
                            let n = |i: usize| r.i64(i).map_or(0, |n| n.max(0) as u64);
                            Some((r.text(0)?.to_string(), n(1), n(2)))
                        })
                        .collect();
                }
                Part::ClaimLimited => {
                    for row in here {
                        if let Some(claimed) = claimed_of(row, &self.cfg) {
                            self.limited_claimed.push(claimed);
                        }
                    }
                }
                Part::LimitedPending => {
                    let found = (here.iter().filter_map(|r| r.text(0)))
                        .filter(|k| self.policies.get(*k).is_some_and(|p| p.claimed_apart()));
                    let found: Vec<String> = found.map(str::to_string).collect();
                    self.limited_pending.extend(found);
                }
                Part::KindBacklog => {
                    let mut waiting = false;
                    for row in here {
                        let Some(kind) = row.text(0) else { continue };
                        waiting |= row.bool(1) == Some(true);
                        if row.bool(1) != Some(true) {
                            // Nothing due: left out of claims until it has tasks again.
                            self.limited_pending.remove(kind);
                        }
                        let why = self.policies.get(kind).and_then(|p| {
                            let running = row.i64(2).unwrap_or(0).max(0) as u64;
                            if p.kind_cap().is_some_and(|cap| running >= u64::from(cap)) {
                                return Some(crate::flow::WaitingOn::Concurrency);
                            }
                            let (per_ms, burst) = p.kind_bucket()?.rate_and_capacity();
                            let tokens = row.text(3).and_then(|t| t.parse::<f64>().ok())?;
                            let since = row.i64(4).unwrap_or(0).max(0) as f64;
                            ((tokens + since * per_ms).min(burst) < 1.0 - 1e-9).then_some(crate::flow::WaitingOn::Rate)
                        });
                        // (Counted when the kind becomes held with tasks waiting, as the memory
                        // store counts it: this read repeats every LIMITED_POLL_MS meanwhile.)
                        match why.filter(|_| row.bool(1) == Some(true)) {
                            Some(why) => {
                                if self.held_counted.get(kind) != Some(&why) {
                                    self.held_total[why.index()] += 1;
                                    self.held_counted.insert(kind.to_string(), why);
                                }
                            }
                            None => {
                                self.held_counted.remove(kind);
                            }
                        }
                        match why {
                            Some(why) => self.held_kinds.insert(kind.to_string(), why),
                            None => self.held_kinds.remove(kind),
                        };
                    }
                    if waiting {
                        // A slot or a token may free on any node: look again shortly.
                        self.due_ms.insert(self.now_ms + LIMITED_POLL_MS);
                    }
                }
                Part::LaneBacklog(kinds) => {
                    let mut now: HashMap<(String, String, String), crate::flow::WaitingOn> = HashMap::new();
                    for row in here {
                        let (Some(kind), Some(sub), Some(key)) = (row.text(0), row.text(1), row.text(2)) else {
                            continue;
                        };
                        let why = match row.text(3) {
                            Some("concurrency") => crate::flow::WaitingOn::Concurrency,
                            Some("rate") => crate::flow::WaitingOn::Rate,
                            _ => continue,
                        };
                        now.insert((kind.to_string(), sub.to_string(), key.to_string()), why);
                    }
                    for (lane, why) in &now {
                        if self.held_lanes.get(lane) != Some(why) {
                            self.held_total[why.index()] += 1;
                        }
                    }
                    self.held_lanes.retain(|lane, _| !kinds.contains(&lane.0));
                    self.held_lanes.extend(now);
                }
                Part::PolicySet(kind, policy) => {
                    // (`policies_high` stays: changes of other nodes with smaller numbers may
                    // not have been read yet, and the next read brings this one back, the same.)
                    self.apply_policy(kind, policy, false);
                }
                Part::Kinds(conn, op) => {
                    // (The rows are the answer's: a long list is written from them a piece at
                    // a time, `kinds`.)
                    let rows = rows.get_mut(i).map(|r| std::mem::take(&mut r.rows)).unwrap_or_default();
                    let response = kinds::answer(rows, &op);
                    self.events.push(Event::Answer { conn, response });
                }
                Part::PolicyChanges => {
                    let first_read = self.policies_high == 0;
                    for row in here {
                        let (Some(kind), Some(changed)) = (row.text(0), row.i64(2)) else { continue };
                        self.policies_high = self.policies_high.max(changed);
                        let policy = row.text(1).and_then(|p| crate::flow::Policy::parse(p.as_bytes()).ok());
                        self.apply_policy(kind.to_string(), policy, first_read);
                    }
                }
                Part::List(l) => {
                    let body = rows::list_page(here, l.limit, crate::listing::MAX_SCAN, &|t| self.note_waiting(t));
                    self.events.push(Event::Answer { conn: l.conn, response: Response::json(200, body) });
                }
                Part::Workers(conns) => {
                    let all: Vec<WorkerInfo> = here.iter().filter_map(rows::worker).collect();
                    let own = parse_id(&self.id);
                    self.remote = all.into_iter().filter(|w| w.node_id != own).collect();
                    for conn in conns {
                        self.events.push(Event::Clients { conn, remote: self.remote.clone() });
                    }
                }
                Part::Counts => {
                    let mut counts = [0u64; Status::COUNT];
                    for row in here {
                        let st = row.text(0).and_then(rows::status_of);
                        if let (Some(st), Some(n)) = (st, row.i64(1)) {
                            counts[st.index()] = u64::try_from(n).unwrap_or(0);
                        }
                    }
                    self.counts = counts;
                }
                Part::Tokens => {
                    // (Stamped with the wall clock, which the API checks tokens against.)
                    let now = self.wall_ms;
                    let changes = here.iter().filter_map(|r| Some((r.text(0)?, r.bool(1)?, r.i64(2)?)));
                    self.tokens.borrow_mut().apply(changes, now);
                    if here.len() >= 10_000 {
                        self.want_tokens = true;
                    }
                }
                Part::InsertLock
                | Part::InsertKeys
                | Part::Unclaim(_)
                | Part::CancelRead
                | Part::DeleteWorkers(_)
                | Part::ResyncWorkers
                | Part::UpsertWorkers(_)
                | Part::Notify => {}
            }
        }
    }

    fn on_inserted(
        &mut self,
        items: Vec<InsertRec>,
        here: &[Row],
        holders: &HashMap<(String, String), (TaskId, Status)>,
        sent_ms: u64,
    ) {
        // One row per task given, in order: id, seq (NULL: not inserted), room.
        let by_id: HashMap<&str, (bool, bool)> =
            here.iter().filter_map(|r| Some((r.text(0)?, (r.i64(1).is_some(), r.bool(2) == Some(true))))).collect();
        let mut inserted = 0;
        for r in items {
            let (stored, room) = by_id.get(r.row.id.as_str()).copied().unwrap_or((false, true));
            let key = r.row.idem_owner.clone().zip(r.row.idem_key.clone());
            if stored {
                inserted += 1;
                self.fresh_inserted.insert(r.id, sent_ms);
                self.events.push(Event::Inserted { to: r.to, id: r.id });
            } else if let Some(&(id, status)) = key.as_ref().and_then(|k| holders.get(k)) {
                self.events.push(Event::KeyHeld { to: r.to, id, status });
            } else if !room {
                self.events.push(Event::NotInserted { to: r.to, why: Refusal::QueueFull });
            } else {
                self.events.push(Event::NotInserted { to: r.to, why: Refusal::Unavailable });
            }
        }
        self.stats.tasks_inserted += inserted;
    }

    fn on_ended(&mut self, recs: Vec<EndRec>, here: &[Row]) {
        for r in &recs {
            self.uncommitted.remove(&r.seq);
        }
        // Rows: the tasks whose attempt the database took, as `GET_TASKS` has them.
        let applied: HashMap<&str, u64> = here
            .iter()
            .filter_map(|r| Some((r.text(rows::col::ID)?, rows::ms(r, rows::col::CREATED_MS).unwrap_or(0))))
            .collect();
        for row in here {
            if let Some(t) = rows::task(row).filter(|t| t.status.is_final() && self.watched.contains(&t.id)) {
                self.fresh_final.insert(t.id, t);
            }
        }
        self.stats.attempts_ended += applied.len() as u64;
        for r in recs {
            let Some(id) = parse_id(&r.ended.id) else { continue };
            match applied.get(r.ended.id.as_str()) {
                Some(&created) if r.final_status => {
                    let status = rows::status_of(r.ended.status).unwrap_or(Status::Failed);
                    let took = r.ended.ended_ms.saturating_sub(created);
                    self.events.push(Event::Final { id, status, took_ms: Some(took) });
                }
                Some(_) => self.events.push(Event::Ready),
                None => {
                    self.stats.fenced += 1;
                    // (Ended some other way — or by this very end, in a transaction whose
                    // answer was lost: a waiter looks.)
                    if self.watched.contains(&id) {
                        self.check_finished.insert(id);
                    }
                    self.events.push(Event::Fenced { id, attempt: r.ended.attempt });
                }
            }
        }
    }

    fn on_claimed(&mut self, c: ClaimReq, here: &[Row]) {
        let mut tasks = std::mem::take(&mut self.limited_claimed);
        for t in &tasks {
            self.running.insert(t.id, t.attempt);
        }
        for row in here {
            let Some(claimed) = claimed_of(row, &self.cfg) else { continue };
            self.running.insert(claimed.id, claimed.attempt);
            tasks.push(claimed);
        }
        self.stats.tasks_claimed += tasks.len() as u64;
        if (tasks.len() as u32) < c.limit {
            if c.seen == self.queue_changes {
                // The queue has nothing more for them; a notification or the slow poll says when.
                self.starved.insert(c.group, c.takers.clone());
            } else {
                // Something joined the queue after this claim's statements were built (a
                // submit, a retry falling due): its snapshot may not have seen it, and no
                // claim of the group may be waiting to: ask again (measured: a sync task, or
                // a retry's backoff, waited for the slow poll, 1 s, now and then).
                self.events.push(Event::Ready);
            }
        }
        self.events.push(Event::Claimed { group: c.group, tasks });
    }

    /// `TAKE_SESSION`'s rows: the attempts are this node's now, held for the worker.
    fn on_taken(&mut self, t: TakeReq, here: &[Row]) {
        let mut found = Vec::with_capacity(here.len());
        for row in here {
            let Some(task) = claimed_of(row, &self.cfg) else { continue };
            let Some(client_id) = row.text(ccol::SESSION_CLIENT_ID).and_then(parse_id) else { continue };
            let started_wall_ms = rows::ms(row, ccol::SESSION_STARTED_MS).unwrap_or(self.wall_ms);
            self.running.insert(task.id, task.attempt);
            found.push(crate::store::RestoredAttempt {
                task,
                client_id,
                client_ip: std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
                started_wall_ms,
                session: crate::tasks::SessionTag {
                    worker_id: t.worker_id.as_str().into(),
                    secret: t.secret.as_str().into(),
                },
            });
        }
        if !found.is_empty() {
            let from = here.first().and_then(|r| r.text(ccol::LOST_NODE)).unwrap_or("?");
            crate::log!(Level::Info, "session attempts taken over from another node", node = from, count = found.len());
        }
        self.events.push(Event::SessionTaken { conn: t.conn, found });
    }

    fn on_adopted(&mut self, here: &[Row]) {
        let mut by_node: HashMap<String, Vec<Claimed>> = HashMap::new();
        for row in here {
            let Some(mut claimed) = claimed_of(row, &self.cfg) else { continue };
            // The attempt that was running is the one to close: it is not started again.
            claimed.attempt = claimed.attempt.max(1);
            claimed.counted = claimed.attempt - 1;
            let lost = row.text(ccol::LOST_NODE).unwrap_or("?").to_string();
            self.adopted_from.insert(claimed.id, lost.clone());
            by_node.entry(lost).or_default().push(claimed);
        }
        for (lost, tasks) in by_node {
            crate::log!(Level::Warn, "attempts of a lost node adopted", node = lost, count = tasks.len());
            let error = format!("relay node {lost} was lost (no heartbeat for {} ms)", self.lease_ms);
            self.events.push(Event::Orphaned { tasks, error });
        }
    }

    fn on_canceled(&mut self, c: CancelReq, canceled: Option<&Row>, task_row: Option<&Row>) {
        let owner = canceled.and_then(|r| r.text(0)).map(str::to_string);
        let task = task_row.filter(|row| rows::in_scope(row, c.scope.as_deref())).and_then(rows::task);
        let response = match task {
            Some(task) => {
                if let Some(row) = canceled {
                    if owner.as_deref() == Some(self.id.as_str())
                        && let Some(attempt) = self.running.remove(&c.id)
                    {
                        self.starts.remove(&c.id);
                        self.events.push(Event::Stop { id: c.id, attempt });
                    }
                    let took = self.wall_ms.saturating_sub(rows::ms(row, 2).unwrap_or(self.wall_ms));
                    self.events.push(Event::Final { id: c.id, status: Status::Canceled, took_ms: Some(took) });
                    crate::tasks::task_response(&task, false)
                } else {
                    let mut r = crate::tasks::task_response(&task, false);
                    r.status = 409;
                    r
                }
            }
            None => not_found(),
        };
        self.events.push(Event::Answer { conn: c.conn, response });
    }

    /// A task this node runs whose start is not written yet: its read shows the attempt anyway.
    pub fn show_unwritten_start(&self, task: &mut crate::tasks::Task) {
        let Some(s) = self.starts.get(&task.id).filter(|s| !s.written) else { return };
        if task.status != Status::Dispatched || task.attempts.len() + 1 != s.attempt as usize {
            return;
        }
        let Some(client_id) = parse_id(&s.runner.client_id) else { return };
        let ip = s.runner.client_ip.parse().unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
        let mut attempt = crate::tasks::Attempt::new(client_id, ip, s.runner.started_ms);
        attempt.node = Some(self.name.as_str().into());
        task.attempts.push(attempt);
    }

    fn on_reads(&mut self, reads: Vec<ReadReq>, here: &[Row]) {
        let by_id: HashMap<TaskId, &Row> = here.iter().filter_map(|r| Some((rows::row_id(r)?, r))).collect();
        for r in reads {
            let row = by_id.get(&r.id).copied().filter(|row| rows::in_scope(row, r.scope.as_deref()));
            let Some(mut task) = row.and_then(rows::task) else {
                self.events.push(Event::Answer { conn: r.conn, response: not_found() });
                continue;
            };
            self.show_unwritten_start(&mut task);
            self.note_waiting(&task);
            let response = match r.how {
                ReadHow::Get { payload: true } => crate::tasks::task_response_with_payload(&task),
                ReadHow::Get { payload: false } => crate::tasks::task_response(&task, false),
                ReadHow::Release { post } => crate::tasks::task_response(&task, post),
                ReadHow::Wait { post } if !task.status.is_final() => {
                    self.events.push(Event::NotFinal { conn: r.conn, id: r.id, post });
                    continue;
                }
                ReadHow::Wait { post } => crate::tasks::task_response(&task, post),
            };
            self.events.push(Event::Answer { conn: r.conn, response });
        }
    }
}

/// A claimed task from a `CLAIM`/`ADOPT_ORPHANS` row.
fn claimed_of(row: &Row, cfg: &PgConfig) -> Option<Claimed> {
    let id = row.text(ccol::ID).and_then(parse_id)?;
    let attempt = u32::try_from(row.i64(ccol::ATTEMPT)?).ok()?;
    let payload = match row.bytes(ccol::PAYLOAD) {
        Some(_) => row.json(ccol::PAYLOAD)?,
        None => serde_json::value::RawValue::from_string("null".into()).ok()?,
    };
    let tried = row.text(ccol::TRIED).map(rows::parse_uuid_array).unwrap_or_default();
    Some(Claimed {
        id,
        attempt,
        kind: row.text(ccol::KIND).map(Box::from),
        payload: payload.into(),
        timeout_ms: rows::ms(row, ccol::TIMEOUT_MS).unwrap_or(cfg.task_timeout_ms),
        max_retries: row.i64(ccol::MAX_RETRIES).and_then(|v| u32::try_from(v).ok()).unwrap_or(cfg.max_retries),
        counted: attempt
            .saturating_sub(1)
            .saturating_sub(row.i64(ccol::RERUN_BASE).and_then(|n| u32::try_from(n).ok()).unwrap_or(0))
            .saturating_sub(row.i64(ccol::UNCOUNTED).and_then(|n| u32::try_from(n).ok()).unwrap_or(0)),
        tried,
        retry: Claimed::boxed_retry(crate::tasks::RetryPolicy {
            backoff_ms: rows::ms(row, ccol::RETRY_BACKOFF_MS),
            backoff_max_ms: rows::ms(row, ccol::RETRY_BACKOFF_MAX_MS),
            any_worker: row.bool(ccol::RETRY_ANY_WORKER),
        }),
        created_wall_ms: rows::ms(row, ccol::CREATED_MS).unwrap_or(0),
    })
}

/// `(owner, key) → (task id, status)` from `IDEMPOTENT_LOOKUP` rows.
fn held_keys(rows: &[Row]) -> HashMap<(&str, &str), (TaskId, Status)> {
    rows.iter()
        .filter_map(|r| {
            let id = parse_id(r.text(2)?)?;
            let status = rows::status_of(r.text(3)?)?;
            Some(((r.text(0)?, r.text(1)?), (id, status)))
        })
        .collect()
}

fn idempotent_lookup<'a>(keys: impl Iterator<Item = (&'a str, &'a str)> + Clone) -> Stmt {
    Stmt::new(
        sql::IDEMPOTENT_LOOKUP,
        vec![
            Param::Text(sql::array(keys.clone().map(|(o, _)| Some(o)))),
            Param::Text(sql::array(keys.map(|(_, k)| Some(k)))),
        ],
    )
}

fn text_array_of(items: &[&str]) -> Param {
    Param::Text(sql::array(items.iter().map(|s| Some(*s))))
}

fn text_array(items: &[String]) -> Param {
    Param::Text(sql::array(items.iter().filter(|s| storable(s)).map(|s| Some(s.as_str()))))
}

/// This node's workers' rows for `UPSERT_WORKERS`.
fn upsert_workers(node_id: &str, ws: &[WorkerInfo]) -> Stmt {
    let ids: Vec<String> = ws.iter().map(|w| uuid_string(w.client_id)).collect();
    let at: Vec<String> = ws.iter().map(|w| w.connected_wall_ms.to_string()).collect();
    let kinds: Vec<Option<String>> = ws
        .iter()
        .map(|w| {
            w.kinds.as_ref().map(|k| {
                let ks: Vec<&str> = k.iter().map(String::as_str).filter(|s| storable(s)).collect();
                serde_json::to_string(&ks).unwrap_or_else(|_| "[]".into())
            })
        })
        .collect();
    let conc: Vec<Option<String>> =
        ws.iter().map(|w| w.concurrency.map(|c| c.min(i32::MAX as u32).to_string())).collect();
    let in_flight: Vec<String> = ws.iter().map(|w| w.in_flight.to_string()).collect();
    let active: Vec<&str> = ws.iter().map(|w| if w.active { "t" } else { "f" }).collect();
    let versions: Vec<Option<String>> = ws.iter().map(|w| w.version.as_deref().map(storable_lossy)).collect();
    let text = |v: &[String]| Param::Text(sql::array(v.iter().map(|s| Some(s.as_str()))));
    let opt = |v: &[Option<String>]| Param::Text(sql::array(v.iter().map(|s| s.as_deref())));
    let ips: Vec<String> = ws.iter().map(|w| w.ip.clone()).collect();
    let until: Vec<Option<String>> = ws.iter().map(|w| w.resumable_until_wall_ms.map(|t| t.to_string())).collect();
    Stmt::new(
        sql::UPSERT_WORKERS,
        vec![
            node_id.into(),
            text(&ids),
            text(&ips),
            text(&at),
            opt(&kinds),
            opt(&conc),
            text(&in_flight),
            Param::Text(sql::array(active.iter().map(|s| Some(*s)))),
            opt(&versions),
            opt(&until),
        ],
    )
}
