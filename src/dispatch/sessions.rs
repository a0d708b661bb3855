//! Worker sessions (SPEC §12): a worker that says `worker_id` in its hello gets a session — a
//! secret, and a `client_id` that outlives its connection. When the connection is lost (no
//! close frame, or silence past PONG_WAIT), its attempts are *held* for RESUME_WINDOW: they stay
//! in the core's running table (their timeouts still running), the worker takes no new task, and
//! `/clients` shows it inactive with `resumable_until`. A hello that presents the worker id and
//! the secret within the window takes them back (adopts what it lists in `running`, the rest
//! end at once); when the window passes, they end `disconnect` and retry as in §5.
//!
//! Part of the core: no I/O, no clock (time comes in `now_ms`/`wall_ms`).

use std::collections::HashMap;

use serde::Deserialize;

use super::{Core, Io, Timer};
use crate::log::Level;
use crate::store::{RestoredAttempt, WorkerInfo};
use crate::tasks::{ConnRef, Outcome, TaskId, push_json_str, push_uuid, uuid_string};
use crate::timer::TimerHandle;

/// Bytes a `worker_id` has at most (SPEC §12: 1–128 UTF-8 bytes; outside that, no session).
pub const MAX_WORKER_ID_BYTES: usize = 128;
/// Sessions held (connection lost, window open) at most, counted apart for sessions that held
/// attempts and sessions that held none (so that connections which ran nothing cannot use up
/// the room of those that did): beyond it a lost connection's attempts end at once, as without
/// a session. Live sessions are bounded by the connections.
pub const MAX_HELD_SESSIONS: usize = 10_000;
/// Entries of a hello's `running` list looked at, at most.
pub const MAX_RUNNING_LISTED: usize = 4_096;
/// Hellos waiting for the database to say where their session is, at most.
const MAX_PENDING_RESUMES: usize = 1_024;
/// A presented session secret longer than this is no secret relay issued.
const MAX_SECRET_BYTES: usize = 128;
/// The error of a held attempt read back after a restart whose worker did not resume in time
/// (the journal's: such an attempt uses up no retry, also after later restarts).
pub use crate::journal::codec::RESTART_ERROR;

/// One entry of a hello's `running`: a task the worker still runs, and which attempt of it.
#[derive(Debug, Deserialize)]
pub struct RunningEntry {
    pub task_id: String,
    #[serde(default)]
    pub attempt: Option<u64>,
}

/// What a hello says about sessions.
#[derive(Debug, Default)]
pub struct SessionHello {
    pub worker_id: Option<String>,
    pub session: Option<String>,
    pub running: Option<Vec<RunningEntry>>,
}

#[derive(Debug)]
struct Session {
    worker_id: Box<str>,
    secret: Box<str>,
    client_id: u128,
    /// The connection it is on; `None` while held.
    conn: Option<ConnRef>,
    /// While held: the attempts kept for it, the worker as it was, and the window's end.
    held: Vec<TaskId>,
    shown: Option<WorkerInfo>,
    until_mono_ms: u64,
    timer: Option<TimerHandle>,
    /// Held with no attempt (counted in `Sessions::held_empty`).
    empty_hold: bool,
}

/// The core's session table.
#[derive(Debug, Default)]
pub struct Sessions {
    by_id: HashMap<u64, Session>,
    by_secret: HashMap<Box<str>, u64>,
    next: u64,
    held_sessions: usize,
    /// Of those, the ones held with no attempt.
    pub(super) held_empty: usize,
    /// Cluster mode: hellos waiting for `TAKE_SESSION` (bounded by [`MAX_PENDING_RESUMES`]).
    pending: HashMap<ConnRef, PendingResume>,
}

/// A hello that presented a session this node does not know, waiting for the database.
#[derive(Debug)]
struct PendingResume {
    worker_id: Box<str>,
    secret: Box<str>,
    listed: Vec<(TaskId, Option<u32>)>,
}

impl Sessions {
    /// `/clients` entries of the sessions held now.
    pub fn held_infos(&self) -> impl Iterator<Item = &WorkerInfo> {
        self.by_id.values().filter(|s| s.conn.is_none()).filter_map(|s| s.shown.as_ref())
    }

    /// (worker id, secret) of session `sid`, for the attempts it starts.
    pub fn tag(&self, sid: u64) -> Option<(&str, &str)> {
        self.by_id.get(&sid).map(|s| (&*s.worker_id, &*s.secret))
    }

    fn insert(&mut self, s: Session) -> u64 {
        self.next += 1;
        let id = self.next;
        self.by_secret.insert(s.secret.clone(), id);
        self.by_id.insert(id, s);
        id
    }

    fn remove(&mut self, id: u64) -> Option<Session> {
        let s = self.by_id.remove(&id)?;
        self.by_secret.remove(&s.secret);
        if s.conn.is_none() {
            self.held_sessions -= 1;
            if s.empty_hold {
                self.held_empty -= 1;
            }
        }
        Some(s)
    }
}

/// A new session secret: 256 bits of the OS's randomness (two v4 UUIDs' worth, 244 random),
/// as hex.
fn new_secret() -> Box<str> {
    let a = uuid::Uuid::new_v4().as_u128();
    let b = uuid::Uuid::new_v4().as_u128();
    format!("{a:032x}{b:032x}").into()
}

impl SessionHello {
    /// The worker id, if it is one (1–128 bytes).
    fn worker_id(&self) -> Option<&str> {
        self.worker_id.as_deref().filter(|w| !w.is_empty() && w.len() <= MAX_WORKER_ID_BYTES)
    }
}

impl Core {
    /// A hello's session part (after its kinds and concurrency were applied): opens a session,
    /// or resumes the one it presents, and answers `welcome`. Without a (valid) `worker_id`
    /// nothing happens: the seed protocol.
    pub(super) fn session_hello(&mut self, io: &mut dyn Io, conn: ConnRef, hello: SessionHello) {
        let Some(worker_id) = hello.worker_id() else { return };
        let Some(w) = self.worker_at(conn) else { return };
        let (current, busy) = (w.session, !w.in_flight.is_empty());
        let listed: Vec<(TaskId, Option<u32>)> = hello
            .running
            .iter()
            .flatten()
            .take(MAX_RUNNING_LISTED)
            .filter_map(|e| {
                let id = crate::tasks::parse_id(&e.task_id)?;
                Some((id, e.attempt.map(|a| u32::try_from(a).unwrap_or(u32::MAX))))
            })
            .collect();
        // The session it presents, when the worker id matches it.
        let presented = hello
            .session
            .as_deref()
            .filter(|s| s.len() <= MAX_SECRET_BYTES)
            .and_then(|s| self.sessions.by_secret.get(s).copied())
            .filter(|sid| self.sessions.by_id.get(sid).is_some_and(|s| &*s.worker_id == worker_id));
        let sid = match (current, presented) {
            // A later hello on the same connection, of the same session.
            (Some(cur), Some(p)) if cur == p => cur,
            (Some(cur), None) if self.sessions.by_id.get(&cur).is_some_and(|s| &*s.worker_id == worker_id) => cur,
            // A resume. (A connection that already runs tasks under its own id does not take
            // another's: it gets a session of its own.) In cluster mode the database is asked
            // first even when this node knows the session: the worker may have resumed on
            // another node since, which holds its attempts now (and fences this node's writes
            // about them); they come back here before the worker takes them.
            (None, Some(p)) if !busy => {
                if self.store.shares_sessions()
                    && self.sessions.pending.len() < MAX_PENDING_RESUMES
                    && let Some(secret) = hello.session.as_deref()
                {
                    self.await_session(conn, worker_id, secret, listed);
                    return;
                }
                self.resume(io, conn, p, &listed);
                p
            }
            _ => {
                if let Some(cur) = current {
                    // It says it is another worker now: its old session ends (nothing is held).
                    self.sessions.remove(cur);
                }
                // Cluster mode: a session this node does not know may be held on another node;
                // the welcome waits for the database's answer (`session_taken`).
                let unknown = hello.session.as_deref().filter(|s| !s.is_empty() && s.len() <= MAX_SECRET_BYTES);
                if let Some(secret) = unknown
                    && current.is_none()
                    && !busy
                    && self.store.shares_sessions()
                    && self.sessions.pending.len() < MAX_PENDING_RESUMES
                {
                    let secret = secret.to_string();
                    self.await_session(conn, worker_id, &secret, listed);
                    return;
                }
                match self.new_session(conn, worker_id) {
                    Some(sid) => sid,
                    None => return,
                }
            }
        };
        self.send_welcome(io, conn, sid, &listed);
    }

    /// Cluster mode: the welcome of the worker on `conn` waits (it is sent nothing) until the
    /// database says which of its session's attempts other nodes held (`session_taken`).
    fn await_session(&mut self, conn: ConnRef, worker_id: &str, secret: &str, listed: Vec<(TaskId, Option<u32>)>) {
        self.sessions
            .pending
            .insert(conn, PendingResume { worker_id: worker_id.into(), secret: secret.into(), listed });
        if let Some(w) = self.worker_at_mut(conn) {
            w.awaiting_welcome = true;
        }
        self.store.take_session(conn, worker_id, secret);
    }

    /// A new session for the worker on `conn` (its client id stays).
    fn new_session(&mut self, conn: ConnRef, worker_id: &str) -> Option<u64> {
        let w = self.worker_at(conn)?;
        let s = Session {
            worker_id: worker_id.into(),
            secret: new_secret(),
            client_id: w.client_id,
            conn: Some(conn),
            held: Vec::new(),
            shown: None,
            until_mono_ms: 0,
            timer: None,
            empty_hold: false,
        };
        let sid = self.sessions.insert(s);
        if let Some(w) = self.worker_at_mut(conn) {
            w.session = Some(sid);
        }
        // (A session worker's cap may be lower: MAX_RUNNING_LISTED.)
        self.refresh(conn.slot);
        Some(sid)
    }

    /// `welcome` for session `sid` on `conn`: of the tasks the hello listed, those the worker
    /// runs here as the listed attempt are `adopted`; the rest are no longer its (`abandon`).
    fn send_welcome(&mut self, io: &mut dyn Io, conn: ConnRef, sid: u64, listed: &[(TaskId, Option<u32>)]) {
        let mut adopted = Vec::new();
        let mut abandon = Vec::new();
        for &(id, attempt) in listed {
            let mine = self
                .running
                .get(&id)
                .is_some_and(|r| r.conn == conn && attempt.is_none_or(|a| a == r.attempt) && r.held.is_none());
            if mine { adopted.push(id) } else { abandon.push(id) }
        }
        let Some(s) = self.sessions.by_id.get(&sid) else { return };
        let mut out = String::with_capacity(256 + 40 * listed.len());
        out.push_str("{\"type\":\"welcome\",\"client_id\":\"");
        push_uuid(&mut out, s.client_id);
        out.push_str("\",\"session\":");
        push_json_str(&mut out, &s.secret);
        out.push_str(",\"resume_window_ms\":");
        out.push_str(&self.resume_window_ms.to_string());
        for (name, ids) in [("adopted", &adopted), ("abandon", &abandon)] {
            out.push_str(",\"");
            out.push_str(name);
            out.push_str("\":[");
            for (i, id) in ids.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push('"');
                push_uuid(&mut out, *id);
                out.push('"');
            }
            out.push(']');
        }
        out.push('}');
        io.send_text(conn, &[&out]);
    }

    /// The worker on `conn` presented session `sid`: it takes the session's client id and the
    /// held attempts it lists (as the same attempt); the held ones it does not list end now.
    fn resume(&mut self, io: &mut dyn Io, conn: ConnRef, sid: u64, listed: &[(TaskId, Option<u32>)]) {
        // Its old connection may still look alive here (relay did not notice the loss yet):
        // it is let go now, its attempts held for this resume.
        if let Some(old) = self.sessions.by_id.get(&sid).and_then(|s| s.conn) {
            self.hold_worker(old, sid, "the worker resumed its session on a new connection");
            // (Should it still be alive, it is no worker any more: it is closed, not left open
            // unanswered.)
            io.close_worker(old);
        }
        let Some(s) = self.sessions.by_id.get_mut(&sid) else { return };
        if s.conn.is_none() {
            self.sessions.held_sessions -= 1;
            if std::mem::take(&mut s.empty_hold) {
                self.sessions.held_empty -= 1;
            }
        }
        s.conn = Some(conn);
        s.shown = None;
        let held = std::mem::take(&mut s.held);
        let client_id = s.client_id;
        if let Some(t) = s.timer.take() {
            self.wheel.cancel(t);
        }
        let node = self.node_name.clone();
        let Some(w) = self.worker_at_mut(conn) else { return };
        let fresh = w.client_id;
        w.client_id = client_id;
        w.session = Some(sid);
        let info = w.info(node.as_deref());
        self.store.worker_gone(fresh);
        self.store.worker_changed(&info);
        self.metrics.sessions_resumed += 1;
        self.metrics.attempts_held = self.metrics.attempts_held.saturating_sub(held.len());
        // (By task: a session may hold many attempts, and the list has up to
        // MAX_RUNNING_LISTED entries; a search of the list per held attempt stalled the loop.)
        let listed: HashMap<TaskId, Option<u32>> = listed.iter().copied().collect();
        let mut adopted = 0;
        for id in held {
            let wanted = self.running.get(&id).and_then(|r| {
                let entry = listed.get(&id)?;
                entry.is_none_or(|a| a == r.attempt).then_some(())
            });
            match wanted {
                Some(()) => {
                    if let Some(r) = self.running.get_mut(&id) {
                        r.conn = conn;
                        r.held = None;
                        r.resumes += 1;
                    }
                    if let Some(w) = self.worker_at_mut(conn) {
                        w.in_flight.push(id);
                    }
                    adopted += 1;
                }
                None => {
                    if let Some(r) = self.running.get_mut(&id) {
                        r.held = None;
                    }
                    self.end_attempt(id, Outcome::Disconnect, Some("worker no longer runs this task"), None);
                }
            }
        }
        self.metrics.attempts_adopted += adopted;
        crate::log!(Level::Info, "worker session resumed", client_id = uuid_string(client_id), adopted = adopted,);
        self.refresh(conn.slot);
    }

    /// The worker on `conn` is gone without a close frame. With a session and a resume window,
    /// it is held (`true`); else the caller ends its attempts as for any worker.
    pub(super) fn try_hold(&mut self, conn: ConnRef, why: &str) -> bool {
        // (A resume waiting for the database: its answer is held for the session, if any.)
        self.sessions.pending.remove(&conn);
        let Some((sid, empty)) = self.worker_at(conn).and_then(|w| Some((w.session?, w.in_flight.is_empty()))) else {
            return false;
        };
        let full = if empty {
            self.sessions.held_empty >= MAX_HELD_SESSIONS
        } else {
            self.sessions.held_sessions - self.sessions.held_empty >= MAX_HELD_SESSIONS
        };
        if self.resume_window_ms == 0 || self.shutting_down || full {
            self.sessions.remove(sid);
            return false;
        }
        self.hold_worker(conn, sid, why);
        true
    }

    /// Takes the worker on `conn` out of the ring and holds its attempts for its session.
    fn hold_worker(&mut self, conn: ConnRef, sid: u64, why: &str) {
        let Some((mut worker, before)) = self.unlist(conn) else { return };
        let held = std::mem::take(&mut worker.in_flight);
        for id in &held {
            if let Some(r) = self.running.get_mut(id) {
                r.held = Some(sid);
            }
        }
        let until_mono_ms = self.now_ms + self.resume_window_ms;
        let mut shown = worker.info(self.node_name.as_deref());
        shown.active = false;
        shown.in_flight = held.len() as u32;
        shown.resumable_until_wall_ms = Some(self.wall_ms + self.resume_window_ms);
        crate::log!(
            Level::Info,
            "worker connection lost, session held",
            client_id = uuid_string(worker.client_id),
            ip = worker.ip,
            reason = why,
            held = held.len(),
            window_ms = self.resume_window_ms
        );
        // Other nodes see it inactive (it takes nothing) until it resumes or the window ends.
        self.store.worker_changed(&shown);
        self.metrics.attempts_held += held.len();
        let timer = self.wheel.arm(until_mono_ms, Timer::Session(sid));
        if let Some(s) = self.sessions.by_id.get_mut(&sid) {
            if s.conn.is_some() {
                self.sessions.held_sessions += 1;
                s.empty_hold = held.is_empty();
                if s.empty_hold {
                    self.sessions.held_empty += 1;
                }
            }
            s.conn = None;
            s.held.extend(held);
            s.shown = Some(shown);
            s.until_mono_ms = until_mono_ms;
            if let Some(old) = s.timer.replace(timer) {
                self.wheel.cancel(old);
            }
        }
        self.lost_takers(&before, &crate::dispatch::workers::Accepts::Nothing);
    }

    /// At start: the attempts session workers ran when relay stopped, read back by the store,
    /// are held for RESUME_WINDOW from now, each for its session (SPEC §12), their
    /// TASK_TIMEOUT counted from when they started.
    pub fn restore_held(&mut self) {
        let restored = self.store.take_restored();
        if restored.is_empty() {
            return;
        }
        let n = restored.len();
        for r in restored {
            self.hold_restored(r, true);
        }
        crate::log!(
            Level::Info,
            "attempts held for their workers after a restart",
            attempts = n,
            sessions = self.sessions.held_sessions,
            window_ms = self.resume_window_ms
        );
    }

    /// Holds an attempt that comes from the store (read back after a restart: `restored`; or
    /// taken over from another node) for its session, which is made (held) if this node does
    /// not know it. Returns the session.
    fn hold_restored(&mut self, r: RestoredAttempt, restored: bool) -> u64 {
        let until_mono_ms = self.now_ms + self.resume_window_ms;
        let sid = match self.sessions.by_secret.get(&*r.session.secret).copied() {
            Some(sid) => sid,
            None => {
                let shown = WorkerInfo {
                    client_id: r.client_id,
                    ip: r.client_ip.to_string(),
                    connected_wall_ms: r.started_wall_ms,
                    active: false,
                    in_flight: 0,
                    kinds: None,
                    concurrency: None,
                    version: None,
                    node: self.node_name.as_deref().map(str::to_string),
                    node_id: None,
                    resumable_until_wall_ms: Some(self.wall_ms + self.resume_window_ms),
                    degraded: false,
                };
                let sid = self.sessions.insert(Session {
                    worker_id: r.session.worker_id.clone(),
                    secret: r.session.secret.clone(),
                    client_id: r.client_id,
                    conn: None,
                    held: Vec::new(),
                    shown: Some(shown),
                    until_mono_ms,
                    timer: None,
                    empty_hold: false,
                });
                let timer = self.wheel.arm(until_mono_ms, Timer::Session(sid));
                if let Some(s) = self.sessions.by_id.get_mut(&sid) {
                    s.timer = Some(timer);
                }
                self.sessions.held_sessions += 1;
                sid
            }
        };
        let c = r.task;
        if let Some(old) = self.running.get(&c.id) {
            if old.attempt == c.attempt && old.held == Some(sid) {
                // (Held here already: this node held it before the worker resumed elsewhere.)
                return sid;
            }
            // This node's own entry is stale (the attempt moved to another node and on; what
            // this node wrote about it since was fenced): the database's word replaces it.
            self.forget_running(c.id);
        }
        let ran_ms = self.wall_ms.saturating_sub(r.started_wall_ms);
        let started_mono_ms = self.now_ms.saturating_sub(ran_ms);
        let deadline = self.now_ms + c.timeout_ms.saturating_sub(ran_ms);
        let timer = self.wheel.arm(deadline, Timer::Attempt { task: c.id, num: c.attempt });
        if let Some(s) = self.sessions.by_id.get_mut(&sid) {
            s.held.push(c.id);
            if let Some(shown) = s.shown.as_mut() {
                shown.in_flight = s.held.len() as u32;
            }
        }
        let retry = c.retry();
        let mut tried = c.tried;
        if !tried.contains(&r.client_id) {
            tried.push(r.client_id);
        }
        self.running.insert(
            c.id,
            super::Running {
                attempt: c.attempt,
                // (No connection: a resume gives it one.)
                conn: ConnRef { slot: u32::MAX, generation: u32::MAX },
                client_id: r.client_id,
                timer,
                started_mono_ms,
                timeout_ms: c.timeout_ms,
                kind: c.kind,
                max_retries: c.max_retries,
                counted: c.counted,
                tried,
                created_wall_ms: c.created_wall_ms,
                retry,
                answered: false,
                held: Some(sid),
                resumes: 0,
                restored,
            },
        );
        self.metrics.attempts_held += 1;
        sid
    }

    /// Cluster mode: what `TAKE_SESSION` found for the worker on `conn`, which presented a
    /// session this node did not know. Found attempts are held here and the worker resumes
    /// them; nothing found: the worker gets a new session. Either way it is welcomed now.
    pub(super) fn session_taken(&mut self, io: &mut dyn Io, conn: ConnRef, found: Vec<RestoredAttempt>) {
        let pending = self.sessions.pending.remove(&conn);
        let mut sid = None;
        for r in found {
            sid = Some(self.hold_restored(r, false));
        }
        let Some(p) = pending else { return };
        if self.worker_at(conn).is_none() {
            return;
        }
        if let Some(w) = self.worker_at_mut(conn) {
            w.awaiting_welcome = false;
        }
        // Nothing moved here: the session may still be this node's own (held, or live on a
        // connection relay has not seen fail yet).
        let sid = sid.or_else(|| {
            let sid = self.sessions.by_secret.get(&p.secret).copied()?;
            self.sessions.by_id.get(&sid).is_some_and(|s| s.worker_id == p.worker_id).then_some(sid)
        });
        let sid = match sid {
            Some(sid) => {
                self.resume(io, conn, sid, &p.listed);
                sid
            }
            None => match self.new_session(conn, &p.worker_id) {
                Some(sid) => sid,
                None => return,
            },
        };
        self.send_welcome(io, conn, sid, &p.listed);
        self.greet(conn);
    }

    /// A held session's window passed: its attempts end `disconnect` and retry (SPEC §5).
    pub(super) fn session_expired(&mut self, sid: u64) {
        let Some(s) = self.sessions.by_id.get(&sid) else { return };
        if s.conn.is_some() || s.until_mono_ms > self.now_ms {
            return;
        }
        let Some(s) = self.sessions.remove(sid) else { return };
        crate::log!(Level::Info, "worker session expired", client_id = uuid_string(s.client_id), held = s.held.len());
        self.metrics.attempts_held = self.metrics.attempts_held.saturating_sub(s.held.len());
        self.store.worker_gone(s.client_id);
        for id in s.held {
            let Some(r) = self.running.get_mut(&id) else { continue };
            r.held = None;
            let error = if r.restored { RESTART_ERROR } else { "worker disconnected" };
            self.end_attempt(id, Outcome::Disconnect, Some(error), None);
        }
    }

    /// Drops this node's entry of an attempt another node owns now, without a word to the store
    /// (the database already says who runs it).
    fn forget_running(&mut self, id: TaskId) {
        let Some(r) = self.running.remove(&id) else { return };
        self.wheel.cancel(r.timer);
        if let Some(sid) = r.held {
            self.unheld(sid, id);
        }
        if let Some(w) = self.worker_at_mut(r.conn)
            && let Some(pos) = w.in_flight.iter().position(|t| *t == id)
        {
            w.in_flight.swap_remove(pos);
            self.refresh(r.conn.slot);
        }
    }

    /// A held attempt ended otherwise (timeout, cancel): its session no longer holds it.
    pub(super) fn unheld(&mut self, sid: u64, id: TaskId) {
        if let Some(s) = self.sessions.by_id.get_mut(&sid)
            && let Some(pos) = s.held.iter().position(|t| *t == id)
        {
            s.held.swap_remove(pos);
            self.metrics.attempts_held = self.metrics.attempts_held.saturating_sub(1);
            if let Some(shown) = s.shown.as_mut() {
                shown.in_flight = s.held.len() as u32;
            }
        }
    }

    /// Whether the worker on `conn` has a session.
    pub fn is_session_worker(&self, conn: ConnRef) -> bool {
        self.has_session(conn)
    }

    /// Shutdown with a store that holds attempts across the restart: a session worker's
    /// attempts stay open (the next run holds them for it to resume); the worker is let go.
    pub(super) fn leave_for_restart(&mut self, conn: ConnRef) -> bool {
        if !(self.shutting_down && self.store.holds_restarts() && self.has_session(conn)) {
            return false;
        }
        let Some(mut worker) = self.workers.get_mut(conn.slot as usize).and_then(Option::take) else { return false };
        if worker.conn != conn {
            self.workers[conn.slot as usize] = Some(worker);
            return false;
        }
        self.order.retain(|&s| s != conn.slot);
        self.reach.remove(&worker.acceptance());
        self.groups.remove(conn.slot, &mut worker);
        crate::log!(
            Level::Info,
            "session worker left for the restart",
            client_id = uuid_string(worker.client_id),
            running = worker.in_flight.len()
        );
        true
    }

    /// The worker on `conn` closed with a close frame (or relay closed it): its session ends.
    pub(super) fn end_session_of(&mut self, conn: ConnRef) {
        self.sessions.pending.remove(&conn);
        if let Some(sid) = self.worker_at(conn).and_then(|w| w.session) {
            self.sessions.remove(sid);
        }
    }

    /// The session of the worker on `conn`, if it has one (task frames then carry `attempt`).
    pub(super) fn has_session(&self, conn: ConnRef) -> bool {
        self.worker_at(conn).is_some_and(|w| w.session.is_some())
    }
}
