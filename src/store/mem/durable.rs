//! The memory store's side of the journal (SPEC §7): restoring tasks after a restart, the
//! memory budget for finished tasks (`TASK_MEMORY`), answers read back from the journal, and the
//! compaction step of each turn. Still no I/O: the journal's threads do the disk work.

use std::collections::HashSet;
use std::hash::BuildHasherDefault;

use super::*;
use crate::journal::codec::{self as journal_codec, FrameAt, RESTART_ERROR, Record};
use crate::journal::replay::Replayed;
use crate::journal::thread::ReadDone;
use crate::tasks::{Outcome, kind_hash};

type IdSet = HashSet<TaskId, BuildHasherDefault<IdHasher>>;

impl MemStore {
    /// Every record up to this sequence number is on disk (memory-only mode: everything).
    pub fn durable_lsn(&self) -> u64 {
        self.journal.as_ref().map_or(u64::MAX, |j| j.durable_lsn())
    }

    /// An answer waits until the record `lsn` is durable (see [`Journal::want`]).
    pub fn want_durable(&mut self, lsn: u64) {
        if let Some(j) = &mut self.journal
            && lsn > 0
        {
            j.want(lsn);
        }
    }

    /// When the journal's held-back records must go to its writer (the loop's clock, ms).
    pub fn hold_deadline_ms(&mut self) -> Option<u64> {
        self.journal.as_mut().and_then(|j| j.hold_deadline_ms())
    }

    /// Once per loop turn, after its work: finished tasks over the budget leave memory, a
    /// step of compaction, and the turn's records go to the journal's writer.
    pub fn end_turn(&mut self) {
        self.save_buckets();
        self.evict_over_budget();
        self.compact_step();
        if let Some(j) = &mut self.journal {
            j.now_ms = self.now_ms;
            j.end_turn();
        }
    }

    /// The journal's threads woke the loop: tasks read back answer the requests waiting on them.
    pub fn on_wake(&mut self) {
        let mut done = Vec::new();
        if let Some(j) = &mut self.journal {
            while let Some(d) = j.try_read_done() {
                done.push(d);
            }
            if j.take_writable_again() {
                // The disk has room again: idle workers get the tasks that waited.
                self.events.push(Event::Ready);
            }
        }
        for d in done {
            self.on_read_done(d);
        }
    }

    /// The oldest finished tasks leave memory while their memory is over `TASK_MEMORY`: to the
    /// journal (read back on demand) or, in memory-only mode, forgotten early.
    fn evict_over_budget(&mut self) {
        let durable = self.durable_lsn();
        let mut evicted = 0;
        while self.finished_mem > self.cfg.task_memory_bytes && evicted < EVICT_PER_TURN {
            let Some(&(_, id)) = self.finished.get(self.evict_next) else { break };
            let Some(task) = self.tasks.get(&id).filter(|t| t.status.is_final()) else {
                self.evict_next += 1;
                continue;
            };
            if task.stored.lsn > durable {
                break; // its final record is not on disk yet: next turn
            }
            self.evict_next += 1;
            evicted += 1;
            let Some(task) = self.tasks.remove(&id) else { continue };
            self.remember_attempts(&task);
            self.finished_mem = self.finished_mem.saturating_sub(task.mem_bytes());
            self.tasks_evicted += 1;
            if self.journal.is_some() {
                self.evicted.insert(
                    id,
                    Evicted {
                        loc: task.stored.home,
                        submit_seq: task.submit_seq,
                        status: task.status,
                        kind_hash: kind_hash(task.kind.as_deref()),
                        finished_mono_ms: task.finished_mono_ms,
                    },
                );
            } else {
                self.status_counts[task.status.index()] -= 1;
                self.by_submission.remove(&task.submit_seq);
                self.dead.remove(&task.submit_seq);
                if !self.logged_forgetting {
                    self.logged_forgetting = true;
                    crate::log!(
                        Level::Warn,
                        "finished tasks over TASK_MEMORY are forgotten before TASK_TTL (memory-only mode; \
                         set DATA_DIR to keep them on disk)",
                        task_memory = self.cfg.task_memory_bytes
                    );
                }
            }
        }
    }

    /// One bounded step of compaction: tasks still pinning a segment closed more than
    /// TASK_TTL ago (only unfinished ones can) are written again at the head, so that
    /// segment can go once those records are durable.
    fn compact_step(&mut self) {
        let Some(j) = &self.journal else { return };
        if !j.writable() {
            // (Rewriting tasks now would only grow what waits for the disk.)
            return;
        }
        let (seg, shard) = match self.compacting {
            Some(state) => state,
            None => match j.stale_segment(self.cfg.task_ttl_ms) {
                Some(seg) if seg > self.compacted_upto => (seg, 0),
                _ => return,
            },
        };
        let ids: Vec<TaskId> = self
            .tasks
            .shard_tasks(shard)
            .filter(|t| t.stored.segs.iter().any(|&s| s != 0 && s <= seg))
            .map(|t| t.id)
            .take(COMPACT_TASKS_PER_TURN)
            .collect();
        let full = ids.len() == COMPACT_TASKS_PER_TURN;
        if shard == 0 {
            self.compact_policies(seg);
        }
        for id in ids {
            self.record(id, Rec::Whole);
        }
        // A full step may have left tasks in this shard: look at it again next turn.
        let next = if full { shard } else { shard + 1 };
        if next >= crate::tasks::TASK_SHARDS {
            self.compacting = None;
            self.compacted_upto = seg;
        } else {
            self.compacting = Some((seg, next));
        }
    }

    /// Takes over what the journal held at start. Finished tasks keep their results until
    /// TASK_TTL; unfinished ones wait as pending for a worker, in due order (ties in
    /// submission order), an attempt cut short by the restart closed as `disconnect`.
    /// Returns how many tasks were restored.
    pub fn restore(&mut self, replayed: Replayed) -> usize {
        let Replayed { tasks, evicted, rehome, policies, .. } = replayed;
        let policies = policies
            .into_iter()
            .filter_map(|image| match crate::flow::Policy::parse(image.json.as_bytes()) {
                Ok(p) => Some((image, p)),
                Err(e) => {
                    crate::log!(
                        Level::Error,
                        "journal: a kind policy does not parse; it is dropped",
                        kind = image.kind,
                        error = e
                    );
                    None
                }
            })
            .collect();
        self.restore_policies(policies);
        let (now, wall, ttl) = (self.now_ms, self.wall_ms, self.cfg.task_ttl_ms);
        let mut restored = 0;
        self.tasks.reserve(tasks.len());
        // The listing index, built at the end in bulk from submission order.
        let mut listed: Vec<(u64, TaskId)> = Vec::with_capacity(tasks.len() + evicted.len());
        // Finished tasks, oldest first (the order they are forgotten and evicted in).
        let mut finished: Vec<(u64, TaskId)> = Vec::new();
        // Failed tasks forgotten before TASK_TTL (FAILED_TTL below it), oldest first.
        let mut sooner: Vec<(u64, TaskId)> = Vec::new();
        let cfg = self.cfg.clone();
        for (id, light) in evicted {
            let forget_wall = light.finished_wall_ms.saturating_add(cfg.ttl_of(light.evicted.status));
            if forget_wall <= wall {
                self.forget_stale(id, Stored { lsn: 0, home: light.evicted.loc, segs: [light.evicted.loc.seg, 0, 0] });
                continue;
            }
            self.status_counts[light.evicted.status.index()] += 1;
            self.next_seq = self.next_seq.max(light.evicted.submit_seq);
            if let Some(key) = light.idempotency {
                self.remember_key(*key, id, forget_wall - wall);
            }
            listed.push((light.evicted.submit_seq, id));
            if matches!(light.evicted.status, Status::Failed | Status::Canceled) {
                // (A bulk re-run finds it there: SPEC §13.)
                self.dead.insert(light.evicted.submit_seq, id);
            }
            if cfg.ttl_of(light.evicted.status) < ttl {
                sooner.push((light.finished_wall_ms, id));
            }
            self.evicted.insert(id, light.evicted);
            finished.push((light.finished_wall_ms, id));
            restored += 1;
        }
        let mut unfinished: Vec<Box<Task>> = Vec::new();
        for mut task in tasks {
            self.next_seq = self.next_seq.max(task.submit_seq);
            let (id, submit_seq) = (task.id, task.submit_seq);
            if task.status.is_final() {
                let finished_wall = task.finished_wall_ms.unwrap_or(task.created_wall_ms);
                let forget_wall = finished_wall.saturating_add(cfg.ttl_of(task.status));
                if cfg.ttl_of(task.status) < ttl && forget_wall > wall {
                    sooner.push((finished_wall, id));
                }
                if forget_wall <= wall {
                    self.forget_stale(id, task.stored);
                    continue;
                }
                if let Some(key) = &task.idempotency {
                    self.remember_key((**key).clone(), id, forget_wall - wall);
                }
                self.status_counts[task.status.index()] += 1;
                self.finished_mem += task.mem_bytes();
                finished.push((finished_wall, id));
                if matches!(task.status, Status::Failed | Status::Canceled) {
                    self.dead.insert(submit_seq, id);
                }
                self.tasks.insert_boxed(id, task);
            } else {
                if let Some(key) = &task.idempotency {
                    self.remember_key((**key).clone(), id, ttl);
                }
                // (A retry waiting out its backoff keeps waiting: SPEC §13.)
                task.due_wall_ms = task.run_at_wall_ms.unwrap_or(0).max(task.created_wall_ms);
                if let Some(at) = task.next_attempt_wall_ms {
                    task.due_wall_ms = task.due_wall_ms.max(at);
                }
                unfinished.push(task);
            }
            // (Not before: a task whose TASK_TTL ran out while relay was down is not listed.)
            listed.push((submit_seq, id));
            restored += 1;
        }
        listed.sort_unstable();
        if self.by_submission.is_empty() {
            self.by_submission = listed.into_iter().collect();
        } else {
            self.by_submission.extend(listed);
        }
        finished.sort_unstable();
        for (finished_wall, id) in finished {
            let forget_at = now + finished_wall.saturating_add(ttl).saturating_sub(wall);
            self.finished.push_back((forget_at, id));
        }
        sooner.sort_unstable();
        let keep = cfg.ttl_of(Status::Failed);
        for (finished_wall, id) in sooner {
            self.failed_extra.push_back((now + finished_wall.saturating_add(keep).saturating_sub(wall), id));
        }

        // Unfinished tasks: due order is their queue key, so the order they go in is free.
        let rehome: IdSet = rehome.into_iter().collect();
        for task in unfinished {
            let mut task = if self.hold_sessions {
                match self.hold_restored(task) {
                    Ok(()) => continue,
                    Err(task) => task,
                }
            } else {
                task
            };
            let id = task.id;
            let mut cut_short = false;
            if let Some(a) = task.attempts.last_mut().filter(|a| a.outcome.is_none()) {
                a.outcome = Some(Outcome::Disconnect);
                a.error = Some(Box::from(RESTART_ERROR));
                a.duration_ms = wall.saturating_sub(a.started_wall_ms);
                a.restarted = true;
                cut_short = true;
            }
            task.status = Status::Pending;
            task.restored = true;
            task.place = Place::Nowhere;
            let due = task.due_wall_ms;
            self.status_counts[Status::Pending.index()] += 1;
            self.count_task(&task, None, Some(Status::Pending));
            self.pending_bytes += task.payload.as_ref().map_or(0, |p| p.get().len());
            self.tasks.insert_boxed(id, task);
            if cut_short {
                self.record(id, Rec::AttemptEnded);
            } else if rehome.contains(&id) {
                self.record(id, Rec::Whole);
            }
            if due > wall {
                self.schedule(id);
            } else {
                self.enqueue_ready(id);
            }
        }
        restored
    }

    /// A task whose open attempt ran on a session worker stays dispatched: the core holds the
    /// attempt for the worker to resume (SPEC §12). `Err`: it does not (given back).
    fn hold_restored(&mut self, mut task: Box<Task>) -> Result<(), Box<Task>> {
        let Some(a) = task.attempts.last().filter(|a| a.outcome.is_none()) else { return Err(task) };
        let (Some(session), Some(payload)) = (a.session.as_deref(), task.payload.clone()) else { return Err(task) };
        let held = crate::store::RestoredAttempt {
            task: crate::store::Claimed {
                id: task.id,
                attempt: task.attempts.len() as u32,
                kind: task.kind.clone(),
                payload,
                timeout_ms: task.timeout_ms,
                max_retries: task.max_retries,
                tried: task.attempts.iter().map(|a| a.client_id).collect(),
                // (This run's attempts that count, but the open one.)
                counted: task.counted().saturating_sub(1),
                created_wall_ms: task.created_wall_ms,
                retry: crate::store::Claimed::boxed_retry(task.retry),
            },
            client_id: a.client_id,
            client_ip: a.client_ip,
            started_wall_ms: a.started_wall_ms,
            session: session.clone(),
        };
        task.status = Status::Dispatched;
        task.restored = true;
        task.place = Place::Nowhere;
        self.status_counts[Status::Dispatched.index()] += 1;
        self.count_task(&task, None, Some(Status::Dispatched));
        self.tasks.insert_boxed(held.task.id, task);
        self.restored_held.push(held);
        Ok(())
    }

    /// A task the journal held that expired while relay was down.
    fn forget_stale(&mut self, id: TaskId, stored: Stored) {
        if let Some(j) = &mut self.journal {
            j.forget(id, &stored);
        }
    }

    /// Reads a task that left memory back from the journal for `conn`; the answer comes later.
    /// `false` if the task is not (or no longer) in the journal.
    pub(super) fn read_evicted(
        &mut self,
        conn: ConnRef,
        id: TaskId,
        purpose: ReadFor,
        scope: Option<&[String]>,
    ) -> bool {
        let (Some(e), Some(j)) = (self.evicted.get(&id), &self.journal) else { return false };
        let token = self.next_read;
        self.next_read += 1;
        j.read(token, e.loc);
        self.reads.insert(token, PendingRead { conn, id, purpose, scope: scope.map(<[String]>::to_vec) });
        true
    }

    /// Completes a listing page whose plan reached tasks that left memory: they are read back
    /// (reader thread), and the page is answered once all are in.
    pub(super) fn read_page(
        &mut self,
        conn: ConnRef,
        plan: listing::Plan,
        kind: Option<String>,
        scope: Option<&[String]>,
    ) {
        let page = self.next_read;
        self.next_read += 1;
        let missing = plan.evicted.len();
        self.pages
            .insert(page, PendingPage { conn, pieces: plan.pieces, missing, next: plan.next, lsn: plan.lsn, kind });
        for (index, id) in plan.evicted {
            if !self.read_evicted(conn, id, ReadFor::Page { page, index }, scope) {
                // (Not expected: the plan was made this very turn.) Left out of the page.
                self.finish_piece(page, index, None);
            }
        }
    }

    /// One task of a page came back (`None`: left out); the page is answered when it is whole.
    fn finish_piece(&mut self, page: u64, index: usize, json: Option<String>) {
        let Some(p) = self.pages.get_mut(&page) else { return };
        if let Some(slot) = p.pieces.get_mut(index) {
            *slot = json;
        }
        p.missing = p.missing.saturating_sub(1);
        if p.missing > 0 {
            return;
        }
        if let Some(p) = self.pages.remove(&page) {
            let mut r = Response::json(200, crate::listing::render(&p.pieces, p.next));
            r.lsn = p.lsn;
            self.answer(p.conn, r);
        }
    }

    /// The reader thread answered: the waiting request gets the task (or 404 if it went).
    fn on_read_done(&mut self, done: ReadDone) {
        let Some(pending) = self.reads.remove(&done.token) else { return };
        let task = done.result.as_ref().ok().and_then(|bytes| match journal_codec::frame_at(bytes) {
            FrameAt::Valid { kind, payload, .. } => match journal_codec::decode(kind, payload) {
                Some(Record::Task(image)) if image.id == pending.id => Some(image.into_task(Stored::default())),
                _ => None,
            },
            _ => None,
        });
        if task.is_none() && self.evicted.contains_key(&pending.id) {
            let why =
                done.result.as_ref().err().cloned().unwrap_or_else(|| "the record read back is not this task".into());
            crate::log!(
                Level::Error,
                "cannot read a task back from the journal",
                task_id = uuid_string(pending.id),
                error = why
            );
        }
        let scope = pending.scope.as_deref();
        if let ReadFor::Bulk { job, at } = pending.purpose {
            self.bulk_read_back(job, at, pending.id, task);
            return;
        }
        if let ReadFor::Rerun { wait } = pending.purpose {
            self.rerun_read_back(pending.conn, pending.id, task, scope, wait);
            return;
        }
        if let ReadFor::Page { page, index } = pending.purpose {
            let wanted = self.pages.get(&page).map(|p| p.kind.clone());
            let json = task.filter(|t| {
                in_scope(t.kind.as_deref(), scope)
                    && wanted.as_ref().is_some_and(|k| k.as_deref().is_none_or(|k| t.kind.as_deref() == Some(k)))
            });
            let json = json.map(|t| {
                let mut s = String::new();
                t.write_json(&mut s);
                s
            });
            self.finish_piece(page, index, json);
            return;
        }
        let response = match task {
            Some(task) if in_scope(task.kind.as_deref(), scope) => match pending.purpose {
                ReadFor::One { post } => task_response(&task, post),
                ReadFor::Cancel => {
                    let mut r = task_response(&task, false);
                    r.status = 409;
                    r
                }
                ReadFor::Page { .. } | ReadFor::Rerun { .. } | ReadFor::Bulk { .. } => return,
            },
            Some(_) => not_found(),
            None if self.evicted.contains_key(&pending.id) => {
                Response::error(500, "internal", "cannot read the task from the journal")
            }
            None => not_found(),
        };
        self.answer(pending.conn, response);
    }
}
