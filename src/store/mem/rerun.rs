//! Re-runs in the memory store (SPEC §13): `POST /tasks/{id}/retry` and the bulk
//! `POST /tasks/retry`, of failed or canceled tasks in memory and of those that left it
//! (`TASK_MEMORY`). A task that left memory is read back from the journal by its reader thread,
//! never on the loop: one for a single re-run, a bounded batch at a time for a bulk one. What may
//! run again ([`MemStore::rerun_refusal`]) and what a bulk filter selects ([`matches`]) are
//! decided here only. No I/O, no clock.

use std::collections::VecDeque;

use super::*;
use crate::store::{RERUN_SCAN, RerunFilter, queue_full_response, rerun_answer};
use crate::tasks::kind_hash;

/// The most tasks, and bytes of them (payload, attempt log, ...), bulk re-runs put back in one
/// loop turn: each one rewrites its task's whole record (10,000 tasks of 5 KB held the loop for
/// 200 ms in one turn).
const RERUN_SLICE_TASKS: usize = 1024;
const RERUN_SLICE_BYTES: usize = 4 << 20;
/// Entries of the dead index the bulk re-runs walk in one loop turn, at most.
const RERUN_WALK_PER_TURN: usize = 16_384;
/// Tasks that left memory one bulk re-run has read back from the journal at once, at most.
const RERUN_READ_BATCH: usize = 64;
/// Picks one bulk re-run holds at once, at most (its window over the dead index).
const RERUN_WINDOW: usize = 1024;

/// One task a bulk re-run picked, applied in the order picked (newest first).
#[derive(Debug)]
enum Pick {
    /// In memory: looked at again when its turn comes.
    Here(TaskId),
    /// Left memory and may match: read back from the journal. `None` while the read is out;
    /// `Some(None)`: read, and not this task or not readable.
    Away(TaskId, Option<Option<Box<Task>>>),
}

/// A bulk re-run under way: its filter, how far its walk over the dead index got, the picks of
/// its window not applied yet, what it counted or re-ran.
#[derive(Debug)]
pub(super) struct BulkRerun {
    /// Names it for the reads it waits for.
    job: u64,
    conn: ConnRef,
    filter: RerunFilter,
    scope: Option<Vec<String>>,
    /// The walk goes on below this submission number.
    below: u64,
    /// Entries walked so far (at most [`RERUN_SCAN`]), and whether the walk has ended.
    scanned: usize,
    walked_all: bool,
    picks: VecDeque<Pick>,
    /// The number of the first pick in `picks` (a read names its pick by number).
    base: u64,
    reads_out: usize,
    done: Vec<TaskId>,
    /// Why it stopped before its end (the journal cannot write, the queue is full).
    stopped: Option<Response>,
}

impl BulkRerun {
    /// It can go on only once a task is read back.
    fn waiting(&self) -> bool {
        matches!(self.picks.front(), Some(Pick::Away(_, None)))
    }

    /// Tasks it may still count or re-run.
    fn wanted(&self) -> usize {
        (self.filter.limit as usize).saturating_sub(self.done.len())
    }
}

/// What one loop turn leaves the bulk re-runs to do.
struct Budget {
    tasks: usize,
    bytes: usize,
    walk: usize,
}

/// Whether a final task is one a bulk re-run's filter selects (SPEC §13), for this caller.
fn matches(f: &RerunFilter, t: &Task, scope: Option<&[String]>) -> bool {
    t.status == f.status
        && in_scope(t.kind.as_deref(), scope)
        && f.kind.as_deref().is_none_or(|k| t.kind.as_deref() == Some(k))
        && f.error_contains.as_deref().is_none_or(|e| t.error.as_deref().is_some_and(|te| te.contains(e)))
        && f.finished_after_ms.is_none_or(|at| t.finished_wall_ms.is_some_and(|fin| fin > at))
}

/// What the summary of a task that left memory tells of a match: status, and kind by hash
/// (scope too); the rest once it is read back.
fn may_match(f: &RerunFilter, e: &Evicted, kind: Option<u32>, scope: Option<&[u32]>) -> bool {
    e.status == f.status && kind.is_none_or(|h| e.kind_hash == h) && scope.is_none_or(|hs| hs.contains(&e.kind_hash))
}

impl MemStore {
    /// Whether `task` may run again now, or the answer that refuses it (SPEC §13): out of the
    /// caller's kinds 404; not `failed` or `canceled` 409 with the task; the journal cannot
    /// write 503; MAX_PENDING or MAX_PENDING_BYTES reached 429 (SPEC §7). The one check of
    /// every re-run: single or bulk, in memory or read back.
    fn rerun_refusal(&self, task: &Task, scope: Option<&[String]>) -> Option<Response> {
        if !in_scope(task.kind.as_deref(), scope) {
            return Some(not_found());
        }
        if !matches!(task.status, Status::Failed | Status::Canceled) {
            let mut r = task_response(task, false);
            r.status = 409;
            return Some(r);
        }
        if let Some(r) = self.unavailable(true) {
            return Some(r);
        }
        if !self.pending_room(Self::rerun_bytes(task)) {
            return Some(queue_full_response());
        }
        None
    }

    pub fn rerun(&mut self, id: TaskId, scope: Option<&[String]>, conn: ConnRef, wait: bool) {
        let Some(task) = self.tasks.get(&id) else {
            if !self.read_evicted(conn, id, ReadFor::Rerun { wait }, scope) {
                self.answer(conn, not_found());
            }
            return;
        };
        if let Some(r) = self.rerun_refusal(task, scope) {
            self.answer(conn, r);
            return;
        }
        self.run_again(id);
        self.answer_rerun(conn, id, wait);
    }

    /// A single re-run of a task that had left memory, read back: it comes back in (its record
    /// where the journal has it) and runs again, or is answered as a re-run in memory is.
    pub(super) fn rerun_read_back(
        &mut self,
        conn: ConnRef,
        id: TaskId,
        task: Option<Task>,
        scope: Option<&[String]>,
        wait: bool,
    ) {
        if self.tasks.contains_key(&id) {
            // (In memory again meanwhile: a bulk re-run brought it back.)
            self.rerun(id, scope, conn, wait);
            return;
        }
        let Some(task) = task.filter(|_| self.evicted.contains_key(&id)) else {
            // (Forgotten meanwhile, or unreadable: as a read would say.)
            self.answer(conn, not_found());
            return;
        };
        if let Some(r) = self.rerun_refusal(&task, scope) {
            self.answer(conn, r);
            return;
        }
        self.bring_back(id, task);
        self.run_again(id);
        self.answer_rerun(conn, id, wait);
    }

    /// A task read back from the journal is in memory again (its summary goes).
    fn bring_back(&mut self, id: TaskId, mut task: Task) {
        let Some(e) = self.evicted.remove(&id) else { return };
        task.stored = Stored { lsn: 0, home: e.loc, segs: [e.loc.seg, 0, 0] };
        task.submit_seq = e.submit_seq;
        task.finished_mono_ms = e.finished_mono_ms;
        self.finished_mem += task.mem_bytes();
        self.tasks.insert(id, task);
    }

    /// The answer to a re-run: the task as it is now (202), or held until it is final.
    pub(super) fn answer_rerun(&mut self, conn: ConnRef, id: TaskId, wait: bool) {
        if wait {
            self.events.push(Event::NotFinal { conn, id, post: true });
        } else if let Some(task) = self.tasks.get(&id) {
            let r = task_response(task, true);
            self.answer(conn, r);
        }
    }

    /// `POST /tasks/retry`: walks the failed and canceled tasks newest first, in memory and
    /// out of it, a bounded slice a loop turn (answered at once when one slice does it all).
    pub fn rerun_many(&mut self, f: &RerunFilter, scope: Option<&[String]>, conn: ConnRef) {
        if !f.dry_run
            && let Some(r) = self.unavailable(true)
        {
            self.answer(conn, r);
            return;
        }
        let job = self.next_read;
        self.next_read += 1;
        self.bulk_reruns.push_back(BulkRerun {
            job,
            conn,
            filter: f.clone(),
            scope: scope.map(<[String]>::to_vec),
            below: u64::MAX,
            scanned: 0,
            walked_all: false,
            picks: VecDeque::new(),
            base: 0,
            reads_out: 0,
            done: Vec::new(),
            stopped: None,
        });
        self.bulk_rerun_slice();
    }

    /// Some bulk re-run can go on in the next turn (not all wait for reads).
    pub(super) fn bulk_rerun_due(&self) -> bool {
        self.bulk_reruns.iter().any(|j| !j.waiting())
    }

    /// A slice of the bulk re-runs under way (this turn's share; the store's timer asks for the
    /// next turn while one can go on). Each re-runs what it selects, newest first, as long as
    /// MAX_PENDING and MAX_PENDING_BYTES leave room (SPEC §7) and the journal can write; then it
    /// is answered with what it re-ran — room for none: 429, as a submit would be.
    pub(super) fn bulk_rerun_slice(&mut self) {
        let mut budget = Budget { tasks: RERUN_SLICE_TASKS, bytes: RERUN_SLICE_BYTES, walk: RERUN_WALK_PER_TURN };
        for _ in 0..self.bulk_reruns.len() {
            let Some(mut job) = self.bulk_reruns.pop_front() else { break };
            if self.advance(&mut job, &mut budget) {
                self.finish_bulk(job);
            } else {
                self.bulk_reruns.push_back(job);
            }
        }
    }

    /// Takes a bulk re-run as far as the budget goes; `true` once it is to be answered.
    fn advance(&mut self, job: &mut BulkRerun, budget: &mut Budget) -> bool {
        loop {
            while job.picks.front().is_some() {
                if job.stopped.is_some() || job.wanted() == 0 {
                    return true;
                }
                if job.waiting() || (!job.filter.dry_run && (budget.tasks == 0 || budget.bytes == 0)) {
                    return false;
                }
                let Some(pick) = job.picks.pop_front() else { break };
                job.base += 1;
                self.apply(job, pick, budget);
            }
            if job.stopped.is_some() || job.wanted() == 0 || job.walked_all {
                return true;
            }
            if budget.walk == 0 {
                return false;
            }
            self.walk(job, budget);
        }
    }

    /// The next window of `job`'s walk over the dead index: tasks in memory that match, and
    /// tasks that left memory that may (their reads go out now). Ends at the window's size, a
    /// batch of reads, the turn's budget, [`RERUN_SCAN`] entries or the index's end.
    fn walk(&mut self, job: &mut BulkRerun, budget: &mut Budget) {
        let kind = job.filter.kind.as_deref().map(|k| kind_hash(Some(k)));
        let scope_hashes: Option<Vec<u32>> =
            job.scope.as_ref().map(|kinds| kinds.iter().map(|k| kind_hash(Some(k))).collect());
        let window = RERUN_WINDOW.min(job.wanted());
        let mut reads = Vec::new();
        let mut below = job.below;
        // (Stays true if the index ends, or RERUN_SCAN entries were walked.)
        let mut ended = true;
        for (&seq, &id) in self.dead.range(..job.below).rev() {
            if job.scanned >= RERUN_SCAN {
                break;
            }
            if budget.walk == 0 || job.picks.len() >= window || job.reads_out + reads.len() >= RERUN_READ_BATCH {
                ended = false;
                break;
            }
            budget.walk -= 1;
            job.scanned += 1;
            below = seq;
            if let Some(t) = self.tasks.get(&id) {
                if matches(&job.filter, t, job.scope.as_deref()) {
                    job.picks.push_back(Pick::Here(id));
                }
            } else if let Some(e) = self.evicted.get(&id)
                && may_match(&job.filter, e, kind, scope_hashes.as_deref())
            {
                reads.push((job.base + job.picks.len() as u64, id, e.loc));
                job.picks.push_back(Pick::Away(id, None));
            }
        }
        job.walked_all |= ended;
        job.below = below;
        for (at, id, loc) in reads {
            let Some(j) = &self.journal else {
                // (Not expected: only a journal keeps tasks that left memory.)
                job.walked_all = true;
                continue;
            };
            let token = self.next_read;
            self.next_read += 1;
            j.read(token, loc);
            self.reads.insert(
                token,
                PendingRead { conn: job.conn, id, purpose: ReadFor::Bulk { job: job.job, at }, scope: None },
            );
            job.reads_out += 1;
        }
    }

    /// One pick's turn: counted (a dry run) or run again, if it still matches.
    fn apply(&mut self, job: &mut BulkRerun, pick: Pick, budget: &mut Budget) {
        let (id, away) = match pick {
            Pick::Here(id) => (id, None),
            Pick::Away(id, read) => (id, read.flatten()),
        };
        let scope = job.scope.as_deref();
        // (A task read back may have come in meanwhile, by a single re-run, or been forgotten.)
        let here = self.tasks.contains_key(&id);
        let task = match (self.tasks.get(&id), away.as_deref()) {
            (Some(t), _) => t,
            (None, Some(t)) if self.evicted.contains_key(&id) => t,
            _ => return,
        };
        if !matches(&job.filter, task, scope) {
            return;
        }
        if job.filter.dry_run {
            job.done.push(id);
            return;
        }
        if let Some(r) = self.rerun_refusal(task, scope) {
            job.stopped = Some(r);
            return;
        }
        let cost = task.mem_bytes();
        if !here && let Some(t) = away {
            self.bring_back(id, *t);
        }
        if self.run_again(id) {
            job.done.push(id);
        }
        budget.tasks = budget.tasks.saturating_sub(1);
        budget.bytes = budget.bytes.saturating_sub(cost);
    }

    /// A task a bulk re-run asked for is read back (`None`: not readable). Its job, if still
    /// under way, goes on at its next turn.
    pub(super) fn bulk_read_back(&mut self, job: u64, at: u64, id: TaskId, task: Option<Task>) {
        let Some(j) = self.bulk_reruns.iter_mut().find(|j| j.job == job) else { return };
        j.reads_out = j.reads_out.saturating_sub(1);
        let Some(index) = at.checked_sub(j.base) else { return };
        if let Some(Pick::Away(picked, slot @ None)) = j.picks.get_mut(index as usize)
            && *picked == id
        {
            *slot = Some(task.map(Box::new));
        }
    }

    /// A bulk re-run is answered with what it counted or re-ran (reads still out for it are
    /// dropped as they come back).
    fn finish_bulk(&mut self, job: BulkRerun) {
        let r = match job.stopped {
            Some(r) if job.done.is_empty() => r,
            _ => {
                let mut r = rerun_answer(&job.done);
                r.lsn = job.done.iter().filter_map(|id| self.tasks.get(id)).map(|t| t.stored.lsn).max().unwrap_or(0);
                r
            }
        };
        self.answer(job.conn, r);
    }

    /// A failed or canceled task, pending again: a fresh retry budget (and no worker tried in
    /// this run), its attempt log kept, `reruns` counted. Due now; it waits for a worker however
    /// long it takes (as a queued task), and its old TASK_TTL entry is skipped.
    fn run_again(&mut self, id: TaskId) -> bool {
        let (now_wall, bytes) = {
            let Some(task) = self.tasks.get(&id) else { return false };
            (self.wall_ms, task.payload.as_ref().map_or(0, |p| p.get().len()))
        };
        let Some(task) = self.tasks.get_mut(&id) else { return false };
        if !matches!(task.status, Status::Failed | Status::Canceled) || task.payload.is_none() {
            return false;
        }
        self.finished_mem = self.finished_mem.saturating_sub(task.mem_bytes());
        self.dead.remove(&task.submit_seq);
        self.status_counts[task.status.index()] -= 1;
        self.status_counts[Status::Pending.index()] += 1;
        self.pending_bytes += bytes;
        task.status = Status::Pending;
        self.flow.count_kind(flow::LaneOf::of(task), None, Some(Status::Pending), self.wall_ms, &mut self.events);
        let Some(task) = self.tasks.get_mut(&id) else { return false };
        task.finished_wall_ms = None;
        task.error = None;
        task.result = None;
        task.reruns += 1;
        task.rerun_base = task.attempts.len() as u32;
        task.queued = true;
        task.next_attempt_wall_ms = None;
        task.again = None;
        task.due_wall_ms = now_wall;
        task.place = Place::Nowhere;
        self.record(id, Rec::Whole);
        crate::log!(Level::Debug, "task re-run", task_id = uuid_string(id));
        self.enqueue_ready(id);
        self.events.push(Event::Ready);
        true
    }
}
