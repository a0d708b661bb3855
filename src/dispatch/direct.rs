//! Calls that answer at once, for the memory store: the dispatch tests, the model test and its
//! fuzz target drive the core through these (the API's own calls take a connection to answer
//! and may answer later). With a database store they answer what the store has answered so far,
//! which is why the model test over PostgreSQL drives the store to quiet between steps.

use super::*;
use crate::journal::Journal;
use crate::tasks::{Evicted, Task};

/// The connection the direct calls answer on (no slot is ever this one).
pub const DIRECT: ConnRef = ConnRef { slot: u32::MAX, generation: u32::MAX };

/// Why a direct submit stored nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    /// 503: no connected worker could ever take it.
    NoWorker,
    /// 429: MAX_PENDING tasks, or MAX_PENDING_BYTES of payload, already wait.
    QueueFull,
    /// 503 for another reason (the store cannot write now).
    Unavailable,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelResult {
    Canceled,
    AlreadyFinal,
    NotFound,
    /// Answered later through `Io::reply` on [`DIRECT`] (a task read back from the journal).
    Later,
}

impl Core {
    /// A submit without `wait`, answered at once: the task's id, or why nothing was stored.
    pub fn submit_direct(&mut self, io: &mut dyn Io, new: NewTask<'_>) -> Result<TaskId, SubmitError> {
        let r = self.submit(io, DIRECT, &new, false);
        submit_answer(r)
    }

    /// `DELETE /tasks/{id}` with the root token, answered at once.
    pub fn cancel_direct(&mut self, io: &mut dyn Io, id: TaskId) -> CancelResult {
        match self.cancel(io, DIRECT, id, None).map(|r| r.status) {
            Some(200) => CancelResult::Canceled,
            Some(409) => CancelResult::AlreadyFinal,
            Some(_) => CancelResult::NotFound,
            None => CancelResult::Later,
        }
    }

    /// `conn` waits on task `id` (`post`: a submit's `wait=true`): the answer at once when the
    /// task is final (or shutdown began), else `None` and it comes through `Io::reply`.
    pub fn wait(&mut self, io: &mut dyn Io, conn: ConnRef, id: TaskId, post: bool) -> Option<Response> {
        self.begin(conn);
        if self.shutting_down {
            self.read(io, id, None, conn, ReadHow::Release { post });
        } else {
            self.read(io, id, None, conn, ReadHow::Wait { post });
        }
        self.end(io)
    }

    /// `GET /tasks/{id}` with the root token: `None` when it is answered later (read back from
    /// the journal).
    pub fn get_direct(&mut self, io: &mut dyn Io, conn: ConnRef, id: TaskId) -> Option<Response> {
        self.get(io, conn, id, None, false, false)
    }

    /// `/clients` as this node knows it now: its workers, and other nodes' as last read.
    pub fn clients_json(&self) -> Vec<u8> {
        let mut entries = self.local_infos();
        entries.extend(self.store.remote_workers().iter().cloned());
        entries.sort_by_key(|w| w.connected_wall_ms);
        super::clients_json(&entries)
    }

    pub fn health_json(&self) -> Vec<u8> {
        self.health().body
    }

    pub fn has_held(&self) -> bool {
        !self.held.is_empty()
    }

    // ----- the memory store's tasks (`None`/0 with a database) ----------------------------------

    pub fn task(&self, id: TaskId) -> Option<&Task> {
        self.store.mem().and_then(|m| m.task(id))
    }

    pub fn evicted(&self, id: TaskId) -> Option<&Evicted> {
        self.store.mem().and_then(|m| m.evicted(id))
    }

    pub fn task_count(&self, status: Status) -> usize {
        self.store.health().counts[status.index()] as usize
    }

    pub fn journal(&self) -> Option<&Journal> {
        self.store.mem().and_then(|m| m.journal())
    }

    pub fn finished_mem_bytes(&self) -> usize {
        self.store.mem().map_or(0, |m| m.finished_mem_bytes())
    }

    /// Tasks by submission, newest first, strictly below `below` (memory store).
    pub fn tasks_newest_first(&self, below: u64) -> Vec<(u64, TaskId)> {
        self.store.mem().map(|m| m.tasks_newest_first(below).collect()).unwrap_or_default()
    }

    /// Appends the task JSON for `id` (memory store, task in memory).
    pub fn write_task_json(&self, id: TaskId, out: &mut String) -> bool {
        match self.task(id) {
            Some(task) => {
                task.write_json(out);
                true
            }
            None => false,
        }
    }
}

/// What a submit's answer says, as a direct call returns it.
pub fn submit_answer(r: Option<Response>) -> Result<TaskId, SubmitError> {
    let Some(r) = r else { return Err(SubmitError::Unavailable) };
    match r.status {
        202 | 200 => {
            let v: serde_json::Value = serde_json::from_slice(&r.body).map_err(|_| SubmitError::Unavailable)?;
            v["task_id"].as_str().and_then(crate::tasks::parse_id).ok_or(SubmitError::Unavailable)
        }
        429 => Err(SubmitError::QueueFull),
        503 if r.body.windows(9).any(|w| w == b"no_worker") => Err(SubmitError::NoWorker),
        _ => Err(SubmitError::Unavailable),
    }
}
