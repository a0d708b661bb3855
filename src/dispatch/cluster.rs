//! Cluster mode in the core (SPEC §11, docs/cluster.md §4–§5). PostgreSQL is the source of
//! truth: the core keeps only the tasks this node's workers run (claimed from the database),
//! and every loop turn's records — submits, attempt ends, cancels, worker rows, claims for idle
//! workers, the reads held requests wait for — leave as ONE transaction, one in flight at a
//! time (group commit). Requests that need the database are held and answered through
//! [`Io::reply`] when its reply arrives: a 202 only after COMMIT, a 503 when it failed.
//!
//! Still no I/O here: `cluster::db` runs the transactions on its thread and wakes the loop.
//! The single-node paths reach this file only through a few `is_cluster` checks.

use std::collections::{HashMap, HashSet};

use super::*;
use crate::cluster::db::{Failure, Health, Reply, Request};
use crate::cluster::node::{
    BatchWait, CancelReq, Claim, EndRec, InsertFor, KeyLookup, MAX_CLAIMS_PER_TXN, MAX_INSERT_BACKLOG_BYTES,
    MAX_REFUSALS, Node, Part, ReadReq, ReadWhat, Sent, Then, UNLIMITED_CLAIM, Waiter, col, row_id, storable,
    storable_lossy, uuid_array,
};
use crate::cluster::render;
use crate::cluster::sql;
use crate::cluster::wire::{Param, Row, Rows, Stmt};
use crate::tasks::parse_id;

/// Tasks one claim asks for at most (a worker with a large concurrency fills over turns).
const MAX_CLAIM: u32 = 256;
/// A transaction in flight this long means the database stopped answering: new requests that
/// need it are refused (503) and `/healthz` says unreachable until it answers again.
const STALL_MS: u64 = 2_000;
/// Room a worker's output must have before tasks are claimed for it.
const CLAIM_ROOM_BYTES: usize = 4096;

/// A claim one idle worker makes in the turn's transaction.
struct ClaimPlan {
    conn: ConnRef,
    client_id: u128,
    ip: String,
    /// `None`: every kind.
    kinds: Option<Vec<String>>,
    free: u32,
}

/// The answer while the database cannot be used.
pub fn unavailable() -> Response {
    Response::error(503, "database_unavailable", "the database is unreachable; try again")
}

fn lost() -> Response {
    Response::error(
        503,
        "database_unavailable",
        "the database connection broke during the transaction (it may have committed: retry with the same \
         Idempotency-Key)",
    )
}

/// The answer for a task row: a submit maps the status to a code, GET is always 200.
fn row_response(row: &Row, post: bool) -> Response {
    let status = if post {
        match render::status(row) {
            "done" => 200,
            "failed" => 502,
            "canceled" => 409,
            _ => 202,
        }
    } else {
        200
    };
    Response::json(status, render::task_string(row).into_bytes())
}

fn accepted(id: &str, status: &str) -> Response {
    let mut s = String::with_capacity(80);
    s.push_str("{\"task_id\":");
    push_json_str(&mut s, id);
    s.push_str(",\"status\":");
    push_json_str(&mut s, status);
    s.push('}');
    Response::json(202, s.into_bytes())
}

fn not_found() -> Response {
    Response::error(404, "not_found", "no such task")
}

fn rows_of(rows: &[Rows], i: usize) -> &[Row] {
    rows.get(i).map_or(&[], |r| r.rows.as_slice())
}

impl Core {
    pub fn is_cluster(&self) -> bool {
        matches!(self.storage, Storage::Cluster(_))
    }

    pub fn node(&self) -> Option<&Node> {
        match &self.storage {
            Storage::Cluster(n) => Some(n),
            _ => None,
        }
    }

    fn node_mut(&mut self) -> Option<&mut Node> {
        match &mut self.storage {
            Storage::Cluster(n) => Some(n),
            _ => None,
        }
    }

    /// `Some(503)` while the database cannot be used.
    pub fn cluster_unavailable(&self) -> Option<Response> {
        (!self.cluster_usable()).then(unavailable)
    }

    /// The database answers: connected, and the transaction in flight (if any) is younger than
    /// [`STALL_MS`] (a database that stops answering without closing the connection — a
    /// partition — is noticed by the database thread only after its I/O timeout).
    fn cluster_usable(&self) -> bool {
        self.node().is_none_or(|n| {
            n.db.health() == Health::Ok
                && n.sent.as_ref().is_none_or(|s| self.now_ms.saturating_sub(s.at_ms) < STALL_MS)
        })
    }

    // ----- submit ----------------------------------------------------------------------------

    /// Can a worker of the cluster (this node's, or another live node's as of the last second)
    /// take a task of `kind` without having tried it?
    fn cluster_can_take(&self, kind: Option<&str>, tried: &[u128]) -> bool {
        let local = self
            .order
            .iter()
            .filter_map(|&s| self.worker(s))
            .any(|w| w.active() && w.accepts(kind) && !tried.contains(&w.client_id));
        local || self.node().is_some_and(|n| n.remote_can_take(kind, tried))
    }

    /// A task for the next transaction, after the checks a submit makes. Returns its id.
    fn cluster_accept(
        &mut self,
        new: &NewTask<'_>,
        for_: impl FnOnce(TaskId) -> InsertFor,
    ) -> Result<TaskId, SubmitError> {
        let scheduled = new.run_at_wall_ms.is_some_and(|at| at > self.wall_ms);
        let waits = new.queue || new.run_at_wall_ms.is_some();
        if !waits && !self.cluster_can_take(new.kind, &[]) {
            return Err(SubmitError::NoWorker);
        }
        let bytes = new.payload.get().len() as u64;
        let (max_pending, max_bytes) = (self.cfg.max_pending as u64, self.cfg.max_pending_bytes as u64);
        let id = self.rng.uuid();
        let (now, wall) = (self.now_ms, self.wall_ms);
        let Some(node) = self.node_mut() else { return Err(SubmitError::NoWorker) };
        let (tasks, pending_bytes) =
            (node.pending_total.0 + node.pending_local.0, node.pending_total.1 + node.pending_local.1);
        if tasks >= max_pending || pending_bytes + bytes > max_bytes {
            return Err(SubmitError::QueueFull);
        }
        node.pending_local.0 += 1;
        node.pending_local.1 += bytes;
        let run_at = new.run_at_wall_ms.unwrap_or(wall);
        let row = sql::NewTask {
            id: uuid_string(id),
            kind: new.kind.map(str::to_string),
            payload: new.payload.get().to_string(),
            queue: waits,
            timeout_ms: new.timeout_ms,
            max_retries: new.max_retries,
            created_ms: wall,
            run_at_ms: run_at,
            idem_owner: new.idempotency.map(|(o, _)| o.to_string()),
            idem_key: new.idempotency.map(|(_, k)| k.to_string()),
        };
        node.insert_bytes += row.payload.len();
        node.inserts.push_back((row, for_(id)));
        if scheduled {
            // Due later: this node looks for it then (the slow poll finds the others' tasks, and
            // this node's later ones, within a second of their time).
            let due = now + run_at.saturating_sub(wall);
            if node.due_timer.is_none_or(|at| due < at || at <= now) {
                node.due_timer = Some(due);
                self.wheel.arm(due, Timer::Schedule);
            }
        }
        Ok(id)
    }

    /// `POST /tasks` in cluster mode: answered (202, or the task with `wait=true`) after the
    /// turn transaction that inserts it commits. A key already taken answers for its task.
    pub fn cluster_submit(&mut self, conn: ConnRef, new: &NewTask<'_>, wait: bool) -> Result<TaskId, SubmitError> {
        let key = new.idempotency.map(|(o, k)| (o.to_string(), k.to_string()));
        self.cluster_accept(new, |_| InsertFor::Submit { conn, wait, key })
    }

    /// A keyed submit that will not be inserted (its body is invalid, or it would be refused):
    /// if the key names a task, the answer is that task's; else `missing`.
    pub fn cluster_key_lookup(&mut self, conn: ConnRef, owner: &str, key: &str, wait: bool, missing: Response) {
        if let Some(node) = self.node_mut() {
            node.lookups.push(KeyLookup { conn, owner: owner.to_string(), key: key.to_string(), wait, missing });
        }
    }

    /// Starts a batch's bookkeeping (its answer waits for every insert). Returns its key.
    pub fn cluster_batch_begin(&mut self, conn: ConnRef) -> u64 {
        let Some(node) = self.node_mut() else { return 0 };
        let key = node.next_batch;
        node.next_batch += 1;
        node.batches.insert(key, BatchWait { conn, items: Vec::new(), outstanding: 0, complete: false });
        key
    }

    /// One batch item: validated by the API (`Err`), or accepted for the next transaction.
    pub fn cluster_batch_item(&mut self, batch: u64, item: Result<NewTask<'_>, (&'static str, String)>) {
        let result = match item {
            Ok(new) => {
                let index = self.node().and_then(|n| n.batches.get(&batch)).map_or(0, |b| b.items.len());
                self.cluster_accept(&new, |_| InsertFor::Batch { batch, index }).map_err(|e| match e {
                    SubmitError::NoWorker => ("no_worker", "no connected worker can take this task".to_string()),
                    SubmitError::QueueFull => ("queue_full", "MAX_PENDING tasks are already waiting".to_string()),
                })
            }
            Err(e) => Err(e),
        };
        let Some(b) = self.node_mut().and_then(|n| n.batches.get_mut(&batch)) else { return };
        if result.is_ok() {
            b.outstanding += 1;
        }
        b.items.push(result);
    }

    /// Every item of the batch is in: its answer now, or `None` (held until the inserts commit).
    pub fn cluster_batch_end(&mut self, batch: u64) -> Option<Response> {
        let node = self.node_mut()?;
        let b = node.batches.get_mut(&batch)?;
        b.complete = true;
        if b.outstanding > 0 {
            return None;
        }
        node.batches.remove(&batch).map(|b| batch_response(&b))
    }

    // ----- reads -----------------------------------------------------------------------------

    fn cluster_read(&mut self, conn: ConnRef, scope: Option<Vec<String>>, what: ReadWhat) {
        if let Some(node) = self.node_mut() {
            node.reads.push(ReadReq { conn, scope, what });
        }
    }

    /// `GET /tasks/{id}` (with `wait`), answered from the database.
    pub fn cluster_get(&mut self, conn: ConnRef, id: TaskId, scope: Option<Vec<String>>, wait: bool) {
        let then = if wait { Then::Wait { post: false } } else { Then::Get };
        self.cluster_read(conn, scope, ReadWhat::Task { id, then });
    }

    /// `GET /tasks` from the database.
    pub fn cluster_list(&mut self, conn: ConnRef, q: &crate::listing::Query, scope: Option<Vec<String>>) {
        let what =
            ReadWhat::List { status: q.status.map(Status::as_str), kind: q.kind.clone(), at: q.at, limit: q.limit };
        self.cluster_read(conn, scope, what);
    }

    /// `GET /clients`: every live node's workers.
    pub fn cluster_clients(&mut self, conn: ConnRef) {
        self.cluster_read(conn, None, ReadWhat::Clients);
    }

    /// `DELETE /tasks/{id}` on any node.
    pub fn cluster_cancel(&mut self, conn: ConnRef, id: TaskId, scope: Option<Vec<String>>) {
        if let Some(node) = self.node_mut() {
            node.cancels.push(CancelReq { conn, id, scope });
        }
    }

    /// `conn` waits for task `id` to become final (or WAIT_TIMEOUT).
    fn cluster_hold(&mut self, io: &mut dyn Io, conn: ConnRef, id: TaskId, post: bool) {
        if self.shutting_down {
            self.cluster_read(conn, None, ReadWhat::Task { id, then: Then::Release { post } });
            return;
        }
        let timer = self.wheel.arm(self.now_ms + self.cfg.wait_timeout_ms, Timer::Wait(conn));
        let _ = io;
        let Some(node) = self.node_mut() else { return };
        node.held.insert(conn, Waiter { task: id, post, timer });
        node.waiters.entry(id).or_default().push(conn);
    }

    /// A held `wait=true` ends without the task being final: it is read once more and answered.
    pub(super) fn cluster_release(&mut self, conn: ConnRef) {
        let Some(node) = self.node_mut() else { return };
        let Some(w) = node.held.remove(&conn) else { return };
        if let Some(list) = node.waiters.get_mut(&w.task) {
            list.retain(|c| *c != conn);
            if list.is_empty() {
                node.waiters.remove(&w.task);
            }
        }
        self.wheel.cancel(w.timer);
        self.cluster_read(conn, None, ReadWhat::Task { id: w.task, then: Then::Release { post: w.post } });
    }

    /// Shutdown: every waiting request gets the task as it is now.
    pub(super) fn cluster_release_all(&mut self) {
        let conns: Vec<ConnRef> = self.node().map(|n| n.held.keys().copied().collect()).unwrap_or_default();
        for conn in conns {
            self.cluster_release(conn);
        }
    }

    pub(super) fn cluster_conn_closed(&mut self, conn: ConnRef) {
        let Some(node) = self.node_mut() else { return };
        if !node.batches.is_empty() {
            // A batch whose connection went away mid-way is never completed: forget it (its
            // inserts already queued are still written; their answers go nowhere).
            node.batches.retain(|_, b| b.conn != conn);
        }
        let Some(w) = node.held.remove(&conn) else { return };
        if let Some(list) = node.waiters.get_mut(&w.task) {
            list.retain(|c| *c != conn);
            if list.is_empty() {
                node.waiters.remove(&w.task);
            }
        }
        self.wheel.cancel(w.timer);
    }

    /// Answers every request waiting on the task of this (final) row.
    fn answer_waiters(&mut self, io: &mut dyn Io, row: &Row) {
        let Some(id) = row_id(row) else { return };
        let Some(node) = self.node_mut() else { return };
        let Some(conns) = node.waiters.remove(&id) else { return };
        let mut timers = Vec::new();
        let mut answers = Vec::new();
        for conn in conns {
            if let Some(w) = node.held.remove(&conn) {
                timers.push(w.timer);
                answers.push((conn, row_response(row, w.post)));
            }
        }
        for t in timers {
            self.wheel.cancel(t);
        }
        for (conn, r) in answers {
            self.metrics.http_request(r.status);
            io.reply(conn, r);
        }
    }

    /// A submit whose key is held by task `id` (status `status`) is answered for that task.
    fn answer_existing(&mut self, io: &mut dyn Io, conn: ConnRef, id_text: &str, status: &str, wait: bool) {
        let Some(id) = parse_id(id_text) else { return };
        if !wait {
            let r = accepted(id_text, status);
            self.metrics.http_request(r.status);
            io.reply(conn, r);
        } else if render::is_final(status) {
            self.cluster_read(conn, None, ReadWhat::Task { id, then: Then::Wait { post: true } });
        } else {
            self.cluster_hold(io, conn, id, true);
        }
    }

    // ----- workers ---------------------------------------------------------------------------

    /// A worker arrived or changed its hello: its row is written, and it may claim.
    pub(super) fn cluster_worker_changed(&mut self, client_id: u128) {
        if let Some(node) = self.node_mut() {
            node.workers_dirty.insert(client_id);
            node.claim_check = true;
        }
    }

    pub(super) fn cluster_worker_gone(&mut self, client_id: u128) {
        if let Some(node) = self.node_mut() {
            node.workers_dirty.remove(&client_id);
            if node.workers_gone.len() < crate::cluster::node::MAX_WORKERS_GONE {
                node.workers_gone.push(client_id);
            } else {
                node.workers_gone.clear();
                node.workers_resync = true;
            }
        }
    }

    /// `/clients` from `LIST_WORKERS` rows: other nodes' workers as the database has them, this
    /// node's from memory (their `in_flight` is current).
    fn clients_from(&self, rows: &[Row]) -> Vec<u8> {
        let Some(node) = self.node() else { return Vec::new() };
        let mut entries: Vec<(u64, String)> = Vec::new();
        for row in rows {
            if row.text(render::wcol::NODE_ID) == Some(node.id.as_str()) {
                continue;
            }
            let mut s = String::with_capacity(256);
            render::remote_client_json(row, &mut s);
            let at = row.i64(render::wcol::CONNECTED_MS).and_then(|v| u64::try_from(v).ok()).unwrap_or(0);
            entries.push((at, s));
        }
        for w in self.order.iter().filter_map(|&slot| self.worker(slot)) {
            let mut s = String::with_capacity(256);
            write_worker_json(w, &mut s, Some(&node.name));
            entries.push((w.connected_wall_ms, s));
        }
        entries.sort_by_key(|e| e.0);
        let mut out = String::with_capacity(32 + entries.iter().map(|e| e.1.len() + 1).sum::<usize>());
        out.push_str("{\"count\":");
        out.push_str(&entries.len().to_string());
        out.push_str(",\"clients\":[");
        for (i, (_, e)) in entries.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(e);
        }
        out.push_str("]}");
        out.into_bytes()
    }

    /// `/healthz` of this node: its workers, the cluster's counts (at most about 1 s old), its
    /// name and the database's state; 503 while the database is unreachable.
    pub fn cluster_health(&self) -> Response {
        let Some(node) = self.node() else { return Response::json(200, self.health_json()) };
        let up = self.cluster_usable();
        let c = |st: Status| node.counts[st.index()].max(0);
        let mut s = String::with_capacity(256);
        s.push_str(if up { "{\"status\":\"ok\"" } else { "{\"status\":\"unavailable\"" });
        s.push_str(",\"node\":");
        push_json_str(&mut s, &node.name);
        s.push_str(",\"database\":\"");
        s.push_str(if up { "ok" } else { "unreachable" });
        s.push_str(&format!(
            "\",\"clients\":{},\"active_clients\":{},\"tasks\":{{\"pending\":{},\"dispatched\":{},\"done\":{},\
             \"failed\":{},\"canceled\":{}}},\"uptime_s\":{}}}",
            self.workers_connected(),
            self.workers_active(),
            c(Status::Pending),
            c(Status::Dispatched),
            c(Status::Done),
            c(Status::Failed),
            c(Status::Canceled),
            (self.now_ms - self.started_mono_ms) / 1000
        ));
        Response::json(if up { 200 } else { 503 }, s.into_bytes())
    }

    // ----- attempts ----------------------------------------------------------------------------

    /// An attempt ended without a result (run() in single-node mode): back to pending for an
    /// untried worker of any node, or failed when retries are used up or nobody is left.
    pub(super) fn cluster_after_attempt(&mut self, id: TaskId) {
        let Some(task) = self.tasks.get(&id) else { return };
        let kind = task.kind.clone();
        let max_retries = task.max_retries;
        let error = task.last_error().unwrap_or("failed").to_string();
        let client = task.attempts.last().map_or(0, |a| a.client_id);
        let claim =
            self.node().and_then(|n| n.claims.get(&id).cloned()).unwrap_or(Claim { attempt: 1, tried: vec![client] });
        // A node shutting down hands its tasks back: that attempt was not the task's fault.
        let retry = self.shutting_down
            || (claim.attempt <= max_retries && self.cluster_can_take(kind.as_deref(), &claim.tried));
        if retry {
            self.cluster_end(id, Status::Pending, None, None);
        } else {
            self.cluster_end(id, Status::Failed, None, Some(&error));
        }
    }

    /// Records the end of task `id`'s current attempt with the task's new status, and forgets
    /// the task here: from now on it lives in the database only.
    pub(super) fn cluster_end(
        &mut self,
        id: TaskId,
        status: Status,
        result: Option<Box<RawValue>>,
        error: Option<&str>,
    ) {
        let wall = self.wall_ms;
        let now = self.now_ms;
        let Some(task) = self.tasks.get(&id) else { return };
        let Some(a) = task.attempts.last() else { return };
        let duration = now.saturating_sub(task.created_mono_ms);
        let ended = sql::Ended {
            id: uuid_string(id),
            attempt: 0,
            outcome: a.outcome.unwrap_or(Outcome::Disconnect).as_str(),
            error: a.error.as_deref().map(storable_lossy),
            ended_ms: wall,
            duration_ms: a.duration_ms,
            status: status.as_str(),
            result: result.map(|r| r.get().to_string()),
            final_error: error.map(storable_lossy),
            client_id: uuid_string(a.client_id),
            client_ip: a.client_ip.to_string(),
        };
        let (client, answered) = (a.client_id, a.answered);
        if status.is_final() {
            self.metrics.task_final(status, duration);
        }
        let Some(node) = self.node_mut() else { return };
        let attempt = node.claims.remove(&id).map_or(1, |c| c.attempt);
        node.remember(id, client, answered);
        node.in_flight_changed = true;
        if status.is_final() && node.waiters.contains_key(&id) {
            node.check_finished.insert(id);
        }
        node.ended.push(EndRec {
            ended: sql::Ended { attempt, ..ended },
            refusals: 0,
            final_status: status.is_final(),
        });
        self.drop_local(id);
    }

    /// The task leaves this node's memory (it ended here, or the database says it is over).
    fn drop_local(&mut self, id: TaskId) {
        let Some(task) = self.tasks.remove(&id) else { return };
        if let Some(t) = task.attempt_timer {
            self.wheel.cancel(t);
        }
        self.status_counts[task.status.index()] -= 1;
        if task.status == Status::Pending {
            self.pending_bytes -= task.payload.as_deref().map_or(0, |p| p.get().len());
        }
    }

    /// The database says a task this node runs is over (canceled on some node, or reaped while
    /// this node was cut off): the worker is told to stop and its slot is free.
    fn stop_local(&mut self, io: &mut dyn Io, id: TaskId) {
        let Some(task) = self.tasks.get(&id) else { return };
        if task.status != Status::Dispatched {
            return;
        }
        let worker = task.current_attempt().map(|a| (a.worker, a.client_id, a.answered));
        self.end_attempt(id, Outcome::Canceled, None);
        if let Some((conn, client, answered)) = worker {
            send_cancel(io, conn, id);
            if let Some(node) = self.node_mut() {
                node.remember(id, client, answered);
            }
        }
        if let Some(node) = self.node_mut() {
            node.claims.remove(&id);
            node.in_flight_changed = true;
            node.claim_check = true;
        }
        self.drop_local(id);
    }

    /// A result for a task this node no longer runs: late or duplicate if it ran here recently.
    pub(super) fn cluster_stray_result(&mut self, id: TaskId, client: u128) -> Option<Ignored> {
        let node = self.node_mut()?;
        let answered = node.recent.get_mut(&(id, client))?;
        let why = if *answered { Ignored::Duplicate } else { Ignored::Late };
        *answered = true;
        Some(why)
    }

    /// Tasks claimed for the worker at `conn` arrived: each is sent to it (an attempt the
    /// database already opened), or given back when the worker can no longer take it.
    fn on_claimed(&mut self, io: &mut dyn Io, conn: ConnRef, client_id: u128, asked: u32, rows: &[Row]) {
        let (now, wall) = (self.now_ms, self.wall_ms);
        let mut give_back = Vec::new();
        for row in rows {
            // id, attempt, kind, payload, timeout_ms, max_retries, queue, seq, tried, created_ms
            let (Some(id_text), Some(attempt)) = (row.text(0), row.i64(1)) else { continue };
            let Some(id) = parse_id(id_text) else { continue };
            let attempt = u32::try_from(attempt).unwrap_or(u32::MAX);
            let payload = row.text(3).and_then(|p| RawValue::from_string(p.to_string()).ok());
            // (Its hello may have changed since the claim left: kinds, concurrency, draining.)
            let usable = self.worker_at(conn).is_some_and(|w| {
                w.client_id == client_id
                    && w.ready()
                    && w.has_capacity()
                    && w.accepts(row.text(2))
                    && !self.shutting_down
            });
            let (Some(payload), true) = (payload, usable) else {
                give_back.push((id_text.to_string(), attempt));
                continue;
            };
            let frame_bytes = payload.get().len() + TASK_FRAME_OVERHEAD_BYTES;
            if !io.has_room(conn, frame_bytes) {
                give_back.push((id_text.to_string(), attempt));
                continue;
            }
            let created_ms = row.i64(9).and_then(|v| u64::try_from(v).ok()).unwrap_or(wall);
            let mut tried = row.text(8).map(crate::cluster::node::parse_uuid_array).unwrap_or_default();
            if !tried.contains(&client_id) {
                tried.push(client_id);
            }
            let timeout_ms = row.i64(4).and_then(|v| u64::try_from(v).ok()).unwrap_or(self.cfg.task_timeout_ms);
            let max_retries = row.i64(5).and_then(|v| u32::try_from(v).ok()).unwrap_or(self.cfg.max_retries);
            let bytes = payload.get().len();
            let task = Task {
                id,
                status: Status::Pending,
                kind: row.text(2).map(Box::from),
                payload: Some(payload),
                created_wall_ms: created_ms,
                created_mono_ms: now.saturating_sub(wall.saturating_sub(created_ms)),
                run_at_wall_ms: None,
                due_mono_ms: now,
                finished_wall_ms: None,
                result: None,
                error: None,
                attempts: Vec::with_capacity(1),
                max_retries,
                timeout_ms,
                seq: 0,
                submit_seq: 0,
                place: Place::Nowhere,
                queued: row.bool(6) == Some(true),
                attempt_timer: None,
                waiters: Vec::new(),
                restored: false,
                idempotency: None,
                stored: Stored::default(),
            };
            // (A task this node still runs under an older attempt cannot be claimed again: the
            // database only hands out pending tasks.)
            self.drop_local(id);
            self.tasks.insert(id, task);
            self.status_counts[Status::Pending.index()] += 1;
            self.pending_bytes += bytes;
            if let Some(node) = self.node_mut() {
                node.claims.insert(id, Claim { attempt, tried });
                node.stats.tasks_claimed += 1;
                node.in_flight_changed = true;
            }
            if !self.dispatch(io, id, conn.slot) {
                // `send_failed` was recorded: the task moves on (another worker, any node).
                self.cluster_after_attempt(id);
            }
        }
        if rows.len() < asked as usize
            && let Some(w) = self.worker_at_mut(conn)
        {
            // The queue has nothing more for it; a notification or the slow poll says when.
            w.claim_starved = true;
        }
        if let Some(node) = self.node_mut() {
            node.unclaim.extend(give_back);
            node.claim_check = true;
        }
    }

    /// Which workers claim in this turn's transaction: ready, with free slots and room in their
    /// output, not told by their last claim that the queue had nothing for them.
    fn plan_claims(&mut self, io: &mut dyn Io) -> Vec<ClaimPlan> {
        let mut out = Vec::new();
        if self.shutting_down {
            return out;
        }
        let n = self.order.len();
        // Start each turn one further along the ring: claims round-robin over the workers.
        let start = self.node().map_or(0, |node| node.claim_cursor) % n.max(1);
        if let Some(node) = self.node_mut() {
            node.claim_cursor = node.claim_cursor.wrapping_add(1);
        }
        for step in 0..n {
            if out.len() >= MAX_CLAIMS_PER_TXN {
                // The rest claim in the next turn's transaction.
                if let Some(node) = self.node_mut() {
                    node.claim_check = true;
                }
                break;
            }
            let slot = self.order[(start + step) % n];
            let Some(w) = self.worker(slot) else { continue };
            if !w.ready() || w.claim_starved || !w.has_capacity() || w.acceptance() == Accepts::Nothing {
                continue;
            }
            let free = match w.concurrency {
                Some(c) => c.saturating_sub(w.in_flight.len() as u32),
                None => UNLIMITED_CLAIM.saturating_sub(w.in_flight.len() as u32).max(1),
            }
            .min(MAX_CLAIM);
            if free == 0 || !io.has_room(w.conn, CLAIM_ROOM_BYTES) {
                continue;
            }
            let kinds = w.kinds.as_ref().map(|k| k.iter().filter(|k| storable(k)).map(|k| k.to_string()).collect());
            out.push(ClaimPlan { conn: w.conn, client_id: w.client_id, ip: w.ip.to_string(), kinds, free });
        }
        out
    }

    /// A scheduled task submitted here fell due: idle workers look for it.
    pub(super) fn cluster_due(&mut self) {
        if let Some(node) = self.node_mut() {
            node.due_timer = None;
        }
        self.clear_starved();
    }

    fn clear_starved(&mut self) {
        for slot in 0..self.workers.len() {
            if let Some(w) = self.workers[slot].as_mut() {
                w.claim_starved = false;
            }
        }
        if let Some(node) = self.node_mut() {
            node.claim_check = true;
        }
    }

    // ----- the turn transaction --------------------------------------------------------------

    /// End of a loop turn: everything the turn wants stored or read leaves as one transaction,
    /// unless one is in flight (then it waits and leaves with the next turn's records).
    pub fn cluster_end_turn(&mut self, io: &mut dyn Io) {
        let Some(node) = self.node() else { return };
        if node.sent.is_some() {
            if !self.cluster_usable() {
                // Stalled: what waits behind the transaction in flight is answered 503 now
                // (the transaction's own requests get its outcome when it comes).
                self.fail_queued(io);
            }
            return;
        }
        if node.db.health() != Health::Ok {
            self.fail_queued(io);
            return;
        }
        if !node.inserts.is_empty() || !node.unclaim.is_empty() || node.ended.iter().any(|r| !r.final_status) {
            // Tasks join the queue in this transaction: every idle worker may find one (its own
            // notification does not come back to this node).
            self.clear_starved();
        }
        let check = self.node_mut().is_some_and(|n| std::mem::take(&mut n.claim_check));
        let claims = if check { self.plan_claims(io) } else { Vec::new() };
        let (now, wall) = (self.now_ms, self.wall_ms);
        let lease_ms = self.node().map_or(0, |n| n.lease_ms);
        // (Only when a statement needs them: a turn must not cost O(workers) for nothing.)
        let local_ids: Vec<TaskId> =
            if self.node().is_some_and(|n| n.orphans) { self.tasks_running_here() } else { Vec::new() };
        let connected: Vec<u128> = if self.node().is_some_and(|n| n.workers_resync) {
            self.order.iter().filter_map(|&s| self.worker(s)).map(|w| w.client_id).collect()
        } else {
            Vec::new()
        };
        let Some(node) = self.node_mut() else { return };
        if !node.has_work() && claims.is_empty() {
            return;
        }
        let mut stmts: Vec<Stmt> = Vec::new();
        let mut parts: Vec<Part> = Vec::new();
        let mut notify_pending = false;
        let mut notify_finished = false;

        if !node.lookups.is_empty() {
            let lookups = std::mem::take(&mut node.lookups);
            stmts.push(idempotent_lookup(lookups.iter().map(|l| (l.owner.as_str(), l.key.as_str()))));
            parts.push(Part::Lookups(lookups));
        }
        if !node.inserts.is_empty() {
            let batch = node.take_inserts();
            let rows: Vec<sql::NewTask> = batch.iter().map(|(r, _)| r.clone()).collect();
            stmts.push(sql::insert_tasks(&rows));
            let keys: Vec<(String, String)> =
                batch.iter().filter_map(|(r, _)| Some((r.idem_owner.clone()?, r.idem_key.clone()?))).collect();
            parts.push(Part::Insert(batch.into_iter().map(|(r, f)| (r.id, f)).collect()));
            if !keys.is_empty() {
                stmts.push(idempotent_lookup(keys.iter().map(|(o, k)| (o.as_str(), k.as_str()))));
                parts.push(Part::InsertKeys);
            }
            notify_pending = true;
        }
        if !node.ended.is_empty() {
            let recs = std::mem::take(&mut node.ended);
            let ended: Vec<sql::Ended> = recs.iter().map(|r| r.ended.clone()).collect();
            stmts.push(sql::attempt_ended(&node.id, &ended));
            notify_pending |= recs.iter().any(|r| !r.final_status);
            notify_finished |= recs.iter().any(|r| r.final_status);
            parts.push(Part::Ended(recs));
        }
        if !node.unclaim.is_empty() {
            let back = std::mem::take(&mut node.unclaim);
            let refs: Vec<(&str, u32)> = back.iter().map(|(i, a)| (i.as_str(), *a)).collect();
            stmts.push(sql::unclaim(&node.id, &refs));
            parts.push(Part::Unclaim(back));
            notify_pending = true;
        }
        if node.orphans {
            node.orphans = false;
            stmts.push(Stmt::new(
                sql::RELEASE_ORPHANS,
                vec![node.id.as_str().into(), Param::Text(uuid_array(local_ids.iter().copied()))],
            ));
            parts.push(Part::Orphans);
            notify_pending = true;
        }
        for c in std::mem::take(&mut node.cancels) {
            let scope =
                c.scope.as_ref().map_or(Param::Null, |k| Param::Text(sql::array(k.iter().map(|s| Some(s.as_str())))));
            stmts.push(Stmt::new(sql::CANCEL, vec![uuid_string(c.id).into(), (wall as i64).into(), scope]));
            stmts.push(Stmt::new(sql::GET_TASKS, vec![Param::Text(uuid_array([c.id]))]));
            parts.push(Part::Cancel(c));
            parts.push(Part::CancelRead);
            notify_finished = true;
        }
        if std::mem::take(&mut node.workers_resync) {
            node.workers_gone.clear();
            stmts.push(Stmt::new(
                sql::RESYNC_WORKERS,
                vec![node.id.as_str().into(), Param::Text(uuid_array(connected.iter().copied()))],
            ));
            parts.push(Part::ResyncWorkers);
        }
        if !node.workers_gone.is_empty() {
            let gone = std::mem::take(&mut node.workers_gone);
            stmts.push(Stmt::new(sql::DELETE_WORKERS, vec![Param::Text(uuid_array(gone.iter().copied()))]));
            parts.push(Part::DeleteWorkers(gone));
        }
        let dirty: Vec<u128> = node.workers_dirty.drain().collect();
        let node_id = node.id.clone();
        let node_name = node.name.clone();
        let mut claim_parts = Vec::new();
        for ClaimPlan { conn, client_id, ip, kinds, free } in &claims {
            let client = uuid_string(*client_id);
            let kind_refs: Option<Vec<&str>> = kinds.as_ref().map(|k| k.iter().map(String::as_str).collect());
            let w = sql::ClaimFor { client_id: &client, client_ip: ip, kinds: kind_refs.as_deref(), free_slots: *free };
            claim_parts.push((
                sql::claim(&node_id, &node_name, &w, wall),
                Part::Claim { conn: *conn, client_id: *client_id, asked: *free },
            ));
        }
        let _ = now;
        // (The node is borrowed again below, once the worker rows are built.)
        let upsert = if dirty.is_empty() { None } else { Some(self.upsert_workers(&node_id, &dirty)) };
        let Some(node) = self.node_mut() else { return };
        if let Some(stmt) = upsert {
            stmts.push(stmt);
            parts.push(Part::UpsertWorkers(dirty));
        }
        for (stmt, part) in claim_parts {
            stmts.push(stmt);
            parts.push(part);
        }
        if !node.check_finished.is_empty() {
            let ids: Vec<TaskId> = node.check_finished.drain().collect();
            stmts.push(Stmt::new(sql::FINISHED_AMONG, vec![Param::Text(uuid_array(ids.iter().copied()))]));
            parts.push(Part::Finished(ids));
        }
        let reads = std::mem::take(&mut node.reads);
        let mut task_reads = Vec::new();
        let mut worker_reads = Vec::new();
        for r in reads {
            match &r.what {
                ReadWhat::Task { .. } => task_reads.push(r),
                ReadWhat::Clients => worker_reads.push(r),
                ReadWhat::List { status, kind, at, limit } => {
                    let scope = r
                        .scope
                        .as_ref()
                        .map_or(Param::Null, |k| Param::Text(sql::array(k.iter().map(|s| Some(s.as_str())))));
                    // (No cursor: from the top, below the largest key there can be.)
                    let (created, seq) = at.unwrap_or((i64::MAX as u64, i64::MAX as u64));
                    let key = |v: u64| Param::from(v.min(i64::MAX as u64) as i64);
                    let (created, seq) = (key(created), key(seq));
                    stmts.push(Stmt::new(
                        sql::LIST_TASKS,
                        vec![
                            status.map_or(Param::Null, Param::from),
                            kind.as_deref().map_or(Param::Null, Param::from),
                            scope,
                            created,
                            seq,
                            (*limit as i64 + 1).into(),
                            (crate::listing::MAX_PAGE_BYTES as i64).into(),
                            (crate::listing::MAX_SCAN as i64).into(),
                        ],
                    ));
                    parts.push(Part::List(r));
                }
            }
        }
        if !task_reads.is_empty() {
            let ids: HashSet<TaskId> = task_reads
                .iter()
                .filter_map(|r| match r.what {
                    ReadWhat::Task { id, .. } => Some(id),
                    _ => None,
                })
                .collect();
            stmts.push(Stmt::new(sql::GET_TASKS, vec![Param::Text(uuid_array(ids))]));
            parts.push(Part::Tasks(task_reads));
        }
        if !worker_reads.is_empty() || node.want_workers {
            node.want_workers = false;
            stmts.push(Stmt::new(sql::LIST_WORKERS, vec![(lease_ms as i64).into()]));
            parts.push(Part::Workers(worker_reads));
        }
        if std::mem::take(&mut node.want_counts) {
            stmts.push(Stmt::new(sql::COUNTS, vec![]));
            parts.push(Part::Counts);
        }
        if std::mem::take(&mut node.want_pending) {
            stmts.push(Stmt::new(sql::PENDING_TOTALS, vec![]));
            parts.push(Part::PendingTotals);
        }
        if std::mem::take(&mut node.want_tokens) {
            let high = node.tokens.borrow().high_water();
            stmts.push(Stmt::new(sql::TOKEN_CHANGES, vec![high.into()]));
            parts.push(Part::Tokens);
        }
        if notify_pending {
            stmts.push(Stmt::new(sql::NOTIFY, vec![sql::CHANNEL_PENDING.into()]));
            parts.push(Part::Notify);
        }
        if notify_finished {
            stmts.push(Stmt::new(sql::NOTIFY, vec![sql::CHANNEL_FINISHED.into()]));
            parts.push(Part::Notify);
        }
        if stmts.is_empty() {
            return;
        }
        let tag = node.take_tag();
        node.stats.statements += stmts.len() as u64;
        match node.db.send(Request { tag, stmts }) {
            Ok(()) => node.sent = Some(Sent { tag, parts, at_ms: now }),
            Err(_) => {
                node.stats.unreachable += 1;
                self.fail_parts(io, parts, &Failure::Unreachable);
            }
        }
    }

    /// This node's workers' rows for `UPSERT_WORKERS` (those in `clients`).
    fn upsert_workers(&self, node_id: &str, clients: &[u128]) -> Stmt {
        let wanted: HashSet<u128> = clients.iter().copied().collect();
        let ws: Vec<&Worker> =
            self.order.iter().filter_map(|&s| self.worker(s)).filter(|w| wanted.contains(&w.client_id)).collect();
        let ids: Vec<String> = ws.iter().map(|w| uuid_string(w.client_id)).collect();
        let ips: Vec<String> = ws.iter().map(|w| w.ip.to_string()).collect();
        let at: Vec<String> = ws.iter().map(|w| w.connected_wall_ms.to_string()).collect();
        let kinds: Vec<Option<String>> = ws
            .iter()
            .map(|w| {
                w.kinds.as_ref().map(|k| {
                    let ks: Vec<&str> = k.iter().map(|s| &**s).filter(|s| storable(s)).collect();
                    serde_json::to_string(&ks).unwrap_or_else(|_| "[]".into())
                })
            })
            .collect();
        let conc: Vec<Option<String>> =
            ws.iter().map(|w| w.concurrency.map(|c| c.min(i32::MAX as u32).to_string())).collect();
        let in_flight: Vec<String> = ws.iter().map(|w| w.in_flight.len().to_string()).collect();
        let active: Vec<&str> = ws.iter().map(|w| if w.active() { "t" } else { "f" }).collect();
        let versions: Vec<Option<String>> = ws.iter().map(|w| w.version.as_deref().map(storable_lossy)).collect();
        let text = |v: &[String]| Param::Text(sql::array(v.iter().map(|s| Some(s.as_str()))));
        let opt = |v: &[Option<String>]| Param::Text(sql::array(v.iter().map(|s| s.as_deref())));
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
            ],
        )
    }

    /// The tasks this node runs (the database's view must match: `RELEASE_ORPHANS`).
    fn tasks_running_here(&self) -> Vec<TaskId> {
        self.node().map(|n| n.claims.keys().copied().collect()).unwrap_or_default()
    }

    /// The database is unreachable: held requests are answered 503 at once; records (attempt
    /// ends, worker rows) stay queued for when it returns.
    fn fail_queued(&mut self, io: &mut dyn Io) {
        let Some(node) = self.node_mut() else { return };
        let mut parts = Vec::new();
        if !node.lookups.is_empty() {
            parts.push(Part::Lookups(std::mem::take(&mut node.lookups)));
        }
        if !node.inserts.is_empty() {
            let items: Vec<(String, InsertFor)> = node.inserts.drain(..).map(|(r, f)| (r.id, f)).collect();
            node.insert_bytes = 0;
            parts.push(Part::Insert(items));
        }
        for c in std::mem::take(&mut node.cancels) {
            parts.push(Part::Cancel(c));
        }
        let reads = std::mem::take(&mut node.reads);
        if !reads.is_empty() {
            parts.push(Part::Tasks(reads));
        }
        if parts.is_empty() {
            return;
        }
        self.fail_parts(io, parts, &Failure::Unreachable);
    }

    /// A transaction failed (or was never sent): held requests get 503, records are queued
    /// again (fenced writes: sending one twice is harmless).
    fn fail_parts(&mut self, io: &mut dyn Io, parts: Vec<Part>, why: &Failure) {
        let refused = matches!(why, Failure::Refused(_));
        let answer = match why {
            Failure::Lost(_) => lost(),
            _ => unavailable(),
        };
        let mut replies: Vec<(ConnRef, Response)> = Vec::new();
        let mut batch_failed: Vec<(u64, usize)> = Vec::new();
        let Some(node) = self.node_mut() else { return };
        for part in parts {
            match part {
                Part::Lookups(ls) => replies.extend(ls.into_iter().map(|l| (l.conn, answer.clone()))),
                Part::Insert(items) => {
                    for (_, f) in items {
                        match f {
                            InsertFor::Submit { conn, .. } => replies.push((conn, answer.clone())),
                            InsertFor::Batch { batch, index } => batch_failed.push((batch, index)),
                        }
                    }
                }
                Part::Ended(recs) => {
                    for mut r in recs {
                        r.refusals += u8::from(refused);
                        if r.refusals >= MAX_REFUSALS {
                            crate::log!(
                                Level::Error,
                                "the database keeps refusing an attempt's end; dropped",
                                task_id = r.ended.id
                            );
                            continue;
                        }
                        if r.final_status
                            && let Some(id) = parse_id(&r.ended.id)
                            && node.waiters.contains_key(&id)
                        {
                            node.check_finished.insert(id);
                        }
                        node.ended.push(r);
                    }
                }
                Part::Unclaim(back) => node.unclaim.extend(back),
                Part::Orphans => node.orphans = true,
                Part::Cancel(c) => replies.push((c.conn, answer.clone())),
                Part::DeleteWorkers(gone) => node.workers_gone.extend(gone),
                Part::ResyncWorkers => node.workers_resync = true,
                Part::UpsertWorkers(dirty) => node.workers_dirty.extend(dirty),
                Part::Claim { .. } => {
                    // Lost: the claim may have committed; what the database gave this node and
                    // it never saw goes back (`RELEASE_ORPHANS`).
                    if matches!(why, Failure::Lost(_)) {
                        node.orphans = true;
                    }
                    node.claim_check = true;
                }
                Part::Tasks(rs) | Part::Workers(rs) => replies.extend(rs.into_iter().map(|r| (r.conn, answer.clone()))),
                Part::List(r) => replies.push((r.conn, answer.clone())),
                Part::Counts => node.want_counts = true,
                Part::PendingTotals => node.want_pending = true,
                Part::Tokens => node.want_tokens = true,
                Part::Finished(_) | Part::InsertKeys | Part::CancelRead | Part::Notify => {}
            }
        }
        for (batch, index) in batch_failed {
            if let Some(b) = node.batches.get_mut(&batch) {
                if let Some(item) = b.items.get_mut(index) {
                    *item = Err(("database_unavailable", "the database could not store this task".to_string()));
                }
                b.outstanding = b.outstanding.saturating_sub(1);
            }
        }
        self.finish_batches(io);
        for (conn, r) in replies {
            self.metrics.http_request(r.status);
            io.reply(conn, r);
        }
    }

    /// Batches whose every insert is answered get their answer.
    fn finish_batches(&mut self, io: &mut dyn Io) {
        let Some(node) = self.node_mut() else { return };
        let done: Vec<u64> =
            node.batches.iter().filter(|(_, b)| b.complete && b.outstanding == 0).map(|(k, _)| *k).collect();
        let mut answers = Vec::new();
        for k in done {
            if let Some(b) = node.batches.remove(&k) {
                answers.push((b.conn, batch_response(&b)));
            }
        }
        for (conn, r) in answers {
            self.metrics.http_request(r.status);
            io.reply(conn, r);
        }
    }

    // ----- what the database says ------------------------------------------------------------

    /// The database threads woke the loop: health changes, replies, notifications.
    pub fn cluster_on_wake(&mut self, io: &mut dyn Io) {
        let Some(node) = self.node_mut() else { return };
        let health = node.db.health();
        if health != node.health {
            node.health = health;
            crate::log!(Level::Info, "database health", node = node.name, database = health.as_str());
            if health == Health::Ok {
                // After an outage (or a database restart, which empties the UNLOGGED worker
                // table) the node writes its workers again and catches up on what it missed.
                node.want_counts = true;
                node.want_workers = true;
                node.want_pending = true;
                node.want_tokens = true;
                let waiting: Vec<TaskId> = node.waiters.keys().copied().collect();
                node.check_finished.extend(waiting);
                let all: Vec<u128> = self.order.iter().filter_map(|&s| self.worker(s)).map(|w| w.client_id).collect();
                if let Some(node) = self.node_mut() {
                    node.workers_dirty.extend(all);
                    // (Rows of workers that left while the database was away go too.)
                    node.workers_resync = true;
                    node.workers_gone.clear();
                }
                self.clear_starved();
            }
        }
        let Some(node) = self.node_mut() else { return };
        let mut replies: Vec<Reply> = Vec::new();
        node.db.take_replies(&mut replies);
        for reply in replies {
            let Some(node) = self.node_mut() else { return };
            let Some(sent) = node.sent.take_if(|s| s.tag == reply.tag) else { continue };
            match reply.result {
                Ok(rows) => {
                    node.stats.committed += 1;
                    self.on_committed(io, sent.parts, &rows);
                }
                Err(failure) => {
                    match &failure {
                        Failure::Refused(e) => {
                            node.stats.refused += 1;
                            crate::log!(Level::Error, "the database refused a transaction", error = e);
                        }
                        Failure::Lost(e) => {
                            node.stats.lost += 1;
                            crate::log!(Level::Warn, "a database transaction was lost", error = e);
                        }
                        Failure::Unreachable => node.stats.unreachable += 1,
                    }
                    self.fail_parts(io, sent.parts, &failure);
                }
            }
        }
        let Some(node) = self.node_mut() else { return };
        for channel in node.db.take_notified() {
            match channel {
                sql::CHANNEL_PENDING => self.clear_starved(),
                sql::CHANNEL_CANCEL => {
                    let running: Vec<TaskId> = self.tasks_running_here();
                    if let Some(node) = self.node_mut() {
                        node.check_finished.extend(running);
                    }
                }
                sql::CHANNEL_TOKENS => {
                    if let Some(node) = self.node_mut() {
                        node.want_tokens = true;
                    }
                }
                sql::CHANNEL_FINISHED => {
                    if let Some(node) = self.node_mut() {
                        let waiting: Vec<TaskId> = node.waiters.keys().copied().collect();
                        node.check_finished.extend(waiting);
                    }
                }
                _ => {}
            }
        }
    }

    /// The transaction committed: each part gets its rows.
    fn on_committed(&mut self, io: &mut dyn Io, parts: Vec<Part>, rows: &[Rows]) {
        // Tasks claimed in this very transaction answer `dispatched` to their submit.
        let claimed: HashSet<&str> = parts
            .iter()
            .enumerate()
            .filter(|(_, p)| matches!(p, Part::Claim { .. }))
            .flat_map(|(i, _)| rows_of(rows, i).iter().filter_map(|r| r.text(0)))
            .collect();
        let claimed: HashSet<String> = claimed.into_iter().map(str::to_string).collect();
        let mut parts = parts.into_iter().enumerate().peekable();
        while let Some((i, part)) = parts.next() {
            let here = rows_of(rows, i);
            match part {
                Part::Lookups(ls) => {
                    let found = held_keys(here);
                    for l in ls {
                        match found.get(&(l.owner.as_str(), l.key.as_str())) {
                            Some((id, status)) => self.answer_existing(io, l.conn, id, status, l.wait),
                            None => {
                                self.metrics.http_request(l.missing.status);
                                io.reply(l.conn, l.missing);
                            }
                        }
                    }
                }
                Part::Insert(items) => {
                    let inserted: HashSet<&str> = here.iter().filter_map(|r| r.text(0)).collect();
                    let holders = match parts.peek() {
                        Some((j, Part::InsertKeys)) => held_keys(rows_of(rows, *j)),
                        _ => HashMap::new(),
                    };
                    let mut batch_done: Vec<(u64, usize, bool)> = Vec::new();
                    let mut answers: Vec<(ConnRef, String, String, bool, bool)> = Vec::new();
                    for (id, f) in items {
                        let ok = inserted.contains(id.as_str());
                        match f {
                            InsertFor::Submit { conn, wait, key } => {
                                if ok {
                                    let st = if claimed.contains(&id) { "dispatched" } else { "pending" };
                                    answers.push((conn, id, st.to_string(), wait, true));
                                } else if let Some((hid, hst)) =
                                    key.as_ref().and_then(|(o, k)| holders.get(&(o.as_str(), k.as_str())))
                                {
                                    answers.push((conn, hid.to_string(), hst.to_string(), wait, false));
                                } else {
                                    let r = Response::error(500, "internal", "the task was not stored");
                                    self.metrics.http_request(500);
                                    io.reply(conn, r);
                                }
                            }
                            InsertFor::Batch { batch, index } => batch_done.push((batch, index, ok)),
                        }
                    }
                    if let Some(node) = self.node_mut() {
                        node.stats.tasks_inserted += inserted.len() as u64;
                        for (batch, index, ok) in batch_done {
                            if let Some(b) = node.batches.get_mut(&batch) {
                                b.outstanding = b.outstanding.saturating_sub(1);
                                if !ok && let Some(item) = b.items.get_mut(index) {
                                    *item = Err(("internal", "the task was not stored".to_string()));
                                }
                            }
                        }
                    }
                    for (conn, id, status, wait, new) in answers {
                        match (wait, new, parse_id(&id)) {
                            (true, true, Some(tid)) => self.cluster_hold(io, conn, tid, true),
                            _ => self.answer_existing(io, conn, &id, &status, wait),
                        }
                    }
                    self.finish_batches(io);
                }
                Part::InsertKeys | Part::CancelRead | Part::Notify => {}
                Part::Ended(recs) => {
                    let applied: HashSet<&str> = here.iter().filter_map(|r| r.text(0)).collect();
                    let fenced = recs.iter().filter(|r| !applied.contains(r.ended.id.as_str())).count();
                    if let Some(node) = self.node_mut() {
                        node.stats.attempts_ended += applied.len() as u64;
                        node.stats.fenced += fenced as u64;
                    }
                    for r in recs.iter().filter(|r| !applied.contains(r.ended.id.as_str())) {
                        // A stale node's write: the task was canceled, or reaped while this
                        // node was cut off (it runs again elsewhere).
                        self.metrics.ignored(Ignored::Late);
                        crate::log!(
                            Level::Info,
                            "attempt result refused by the database (the task moved on)",
                            task_id = r.ended.id,
                            attempt = r.ended.attempt
                        );
                    }
                }
                Part::Unclaim(_) => {}
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
                    let owner = canceled.and_then(|r| r.text(0)).map(str::to_string);
                    let task_row = parts.peek().and_then(|(j, _)| rows_of(rows, *j).first());
                    if owner.as_deref().is_some_and(|o| Some(o) == self.node().map(|n| n.id.as_str())) {
                        self.stop_local(io, c.id);
                    }
                    let r = match task_row {
                        Some(row) if render::in_scope(row, c.scope.as_deref()) => {
                            if canceled.is_some() {
                                let ms = |i| row.i64(i).and_then(|v| u64::try_from(v).ok()).unwrap_or(0);
                                let took = ms(col::FINISHED_MS).saturating_sub(ms(col::CREATED_MS));
                                self.metrics.task_final(Status::Canceled, took);
                                self.answer_waiters(io, row);
                                row_response(row, false)
                            } else {
                                let mut r = row_response(row, false);
                                r.status = 409;
                                r
                            }
                        }
                        _ => not_found(),
                    };
                    self.metrics.http_request(r.status);
                    io.reply(c.conn, r);
                }
                Part::DeleteWorkers(_) | Part::UpsertWorkers(_) | Part::ResyncWorkers => {}
                Part::Claim { conn, client_id, asked } => self.on_claimed(io, conn, client_id, asked, here),
                Part::Finished(_) => {
                    for row in here {
                        self.answer_waiters(io, row);
                        if let Some(id) = row_id(row)
                            && self.tasks.contains_key(&id)
                        {
                            self.stop_local(io, id);
                        }
                    }
                }
                Part::Tasks(reads) => {
                    let by_id: HashMap<TaskId, &Row> = here.iter().filter_map(|r| Some((row_id(r)?, r))).collect();
                    for r in reads {
                        let ReadWhat::Task { id, then } = r.what else { continue };
                        let row = by_id.get(&id).copied().filter(|row| render::in_scope(row, r.scope.as_deref()));
                        let answer = match (row, then) {
                            (None, _) => Some(not_found()),
                            (Some(row), Then::Get) => Some(row_response(row, false)),
                            (Some(row), Then::Release { post }) => Some(row_response(row, post)),
                            (Some(row), Then::Wait { post }) => {
                                if render::is_final(render::status(row)) || self.shutting_down {
                                    Some(row_response(row, post))
                                } else {
                                    self.cluster_hold(io, r.conn, id, post);
                                    None
                                }
                            }
                        };
                        if let Some(a) = answer {
                            self.metrics.http_request(a.status);
                            io.reply(r.conn, a);
                        }
                    }
                }
                Part::List(r) => {
                    let limit = match r.what {
                        ReadWhat::List { limit, .. } => limit,
                        _ => 0,
                    };
                    let a = Response::json(200, render::list_page(here, limit, crate::listing::MAX_SCAN));
                    self.metrics.http_request(200);
                    io.reply(r.conn, a);
                }
                Part::Workers(reads) => {
                    self.refresh_remote(here);
                    for r in reads {
                        let a = Response::json(200, self.clients_from(here));
                        self.metrics.http_request(200);
                        io.reply(r.conn, a);
                    }
                }
                Part::Counts => {
                    let mut counts = [0i64; 5];
                    for row in here {
                        let st = row.text(0).and_then(crate::listing::status_of);
                        if let (Some(st), Some(n)) = (st, row.i64(1)) {
                            counts[st.index()] = n;
                        }
                    }
                    if let Some(node) = self.node_mut() {
                        node.counts = counts;
                    }
                }
                Part::PendingTotals => {
                    let row = here.first();
                    let n = row.and_then(|r| r.i64(0)).and_then(|v| u64::try_from(v).ok()).unwrap_or(0);
                    let b = row.and_then(|r| r.i64(1)).and_then(|v| u64::try_from(v).ok()).unwrap_or(0);
                    if let Some(node) = self.node_mut() {
                        node.pending_total = (n, b);
                        node.pending_local = (0, 0);
                    }
                }
                Part::Tokens => {
                    // (Stamped with the wall clock, which the API checks tokens against.)
                    let now = self.wall_ms;
                    if let Some(node) = self.node_mut() {
                        let changes = here.iter().filter_map(|r| Some((r.text(0)?, r.bool(1)?, r.i64(2)?)));
                        node.tokens.borrow_mut().apply(changes, now);
                        if here.len() >= 10_000 {
                            node.want_tokens = true;
                        }
                    }
                }
            }
        }
    }

    fn refresh_remote(&mut self, rows: &[Row]) {
        use crate::cluster::node::RemoteWorker;
        use render::wcol;
        let remote: Vec<RemoteWorker> = rows
            .iter()
            .filter_map(|r| {
                Some(RemoteWorker {
                    client_id: parse_id(r.text(wcol::CLIENT_ID)?)?,
                    node_id: r.text(wcol::NODE_ID)?.to_string(),
                    active: r.bool(wcol::ACTIVE) == Some(true),
                    kinds: r.text(wcol::KINDS).and_then(|t| serde_json::from_str(t).ok()),
                })
            })
            .collect();
        if let Some(node) = self.node_mut() {
            node.remote = remote;
        }
    }

    /// The node's own timer: periodic refreshes, the slow poll behind notifications.
    pub fn cluster_tick(&mut self) {
        let now = self.now_ms;
        let mut poll = false;
        let Some(node) = self.node_mut() else { return };
        if now >= node.next_tokens_ms {
            node.want_tokens = true;
            node.next_tokens_ms = now + crate::cluster::node::TOKEN_REFRESH_MS;
        }
        if now >= node.next_cache_ms {
            node.want_counts = true;
            node.want_workers = true;
            node.want_pending = true;
            node.next_cache_ms = now + crate::cluster::node::CACHE_REFRESH_MS;
        }
        if now >= node.next_poll_ms {
            node.next_poll_ms = now + crate::cluster::node::POLL_MS;
            let waiting: Vec<TaskId> = node.waiters.keys().copied().collect();
            node.check_finished.extend(waiting);
            poll = true;
        }
        if poll {
            let changed = self.node_mut().is_some_and(|n| std::mem::take(&mut n.in_flight_changed));
            if changed {
                let all: Vec<u128> = self.order.iter().filter_map(|&s| self.worker(s)).map(|w| w.client_id).collect();
                if let Some(node) = self.node_mut() {
                    node.workers_dirty.extend(all);
                }
            }
            self.clear_starved();
        }
        self.wheel.arm(now + crate::cluster::node::TICK_MS, Timer::ClusterTick);
    }

    /// So many submitted payload bytes wait for the database that new submits should wait.
    pub fn cluster_backlog_full(&self) -> bool {
        self.node().is_some_and(|n| n.insert_bytes > MAX_INSERT_BACKLOG_BYTES)
    }

    /// Nothing is in flight or waiting to be written (shutdown waits for this).
    pub fn cluster_flushed(&self) -> bool {
        self.node().is_none_or(|n| {
            n.sent.is_none()
                && (n.db.health() != Health::Ok
                    || (n.ended.is_empty()
                        && n.unclaim.is_empty()
                        && n.inserts.is_empty()
                        && n.workers_gone.is_empty()))
        })
    }
}

/// `(owner, key) → (task id, status)` from `IDEMPOTENT_LOOKUP` rows.
fn held_keys(rows: &[Row]) -> HashMap<(&str, &str), (&str, &str)> {
    rows.iter().filter_map(|r| Some(((r.text(0)?, r.text(1)?), (r.text(2)?, r.text(3)?)))).collect()
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

fn batch_response(b: &BatchWait) -> Response {
    let mut out = String::with_capacity(16 + b.items.len() * 72);
    out.push_str("{\"tasks\":[");
    for (i, item) in b.items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        match item {
            Ok(id) => {
                out.push_str("{\"task_id\":\"");
                push_uuid(&mut out, *id);
                out.push_str("\",\"status\":\"pending\"}");
            }
            Err((code, message)) => {
                out.push_str("{\"error\":\"");
                out.push_str(code);
                out.push_str("\",\"message\":");
                push_json_str(&mut out, message);
                out.push('}');
            }
        }
    }
    out.push_str("]}");
    Response::json(202, out.into_bytes())
}
