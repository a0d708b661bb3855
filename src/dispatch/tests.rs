//! Dispatch decisions without sockets: a fake `Io` records frames and replies.

use super::*;

#[derive(Default)]
struct FakeIo {
    sent: Vec<(ConnRef, String)>,
    replies: Vec<(ConnRef, u16)>,
    /// Connections whose writes fail (→ send_failed).
    broken: Vec<ConnRef>,
    /// Connections whose output buffer is full (→ not eligible until drained).
    full: Vec<ConnRef>,
}

impl Io for FakeIo {
    fn has_room(&mut self, worker: ConnRef, _bytes: usize) -> bool {
        !self.full.contains(&worker)
    }
    fn send_text(&mut self, worker: ConnRef, parts: &[&str]) -> bool {
        if self.broken.contains(&worker) {
            return false;
        }
        self.sent.push((worker, parts.concat()));
        true
    }
    fn reply(&mut self, conn: ConnRef, response: Response) {
        self.replies.push((conn, response.status));
    }
}

impl FakeIo {
    /// Task frames sent to `w`, as task ids.
    fn tasks_to(&self, w: ConnRef) -> Vec<TaskId> {
        self.sent
            .iter()
            .filter(|(c, t)| *c == w && t.contains("\"type\":\"task\""))
            .filter_map(|(_, t)| {
                let v: serde_json::Value = serde_json::from_str(t).ok()?;
                crate::tasks::parse_id(v["task_id"].as_str()?)
            })
            .collect()
    }
}

fn core() -> Core {
    core_with(|_| {})
}

/// A memory-only core at wall clock 1,000,000, its store's limits as `tune` sets them.
fn core_with(tune: impl FnOnce(&mut crate::store::mem::MemConfig)) -> Core {
    let mut mem = crate::store::mem::MemConfig {
        task_ttl_ms: 60_000,
        failed_ttl_ms: 0,
        max_pending: 100,
        max_pending_bytes: 1 << 20,
        task_memory_bytes: 64 << 20,
        task_timeout_ms: 1_000,
        max_retries: 2,
    };
    tune(&mut mem);
    let store = Store::Mem(Box::new(crate::store::mem::MemStore::new(mem, None)));
    let cfg = CoreConfig { task_timeout_ms: 1_000, max_retries: 2, wait_timeout_ms: 5_000, ..CoreConfig::default() };
    let mut c = Core::new(cfg, store, 0, 1_000_000);
    c.set_clock(0, 1_000_000);
    c
}

fn conn(slot: u32) -> ConnRef {
    ConnRef { slot, generation: 1 }
}

fn payload(text: &str) -> Box<RawValue> {
    RawValue::from_string(text.to_string()).expect("raw JSON")
}

fn submit(core: &mut Core, io: &mut FakeIo, body: &str, kind: Option<&str>) -> Result<TaskId, SubmitError> {
    let p = payload(body);
    core.submit_direct(io, NewTask { queue: false, ..NewTask::queued(&p, kind) })
}

fn result(core: &mut Core, io: &mut FakeIo, w: ConnRef, id: TaskId, done: bool) {
    let msg = if done {
        format!(r#"{{"type":"result","task_id":"{}","status":"done","data":{{"ok":1}}}}"#, uuid_string(id))
    } else {
        format!(r#"{{"type":"result","task_id":"{}","status":"failed","error":"e"}}"#, uuid_string(id))
    };
    core.worker_message(io, w, &msg);
}

/// Connects a worker that speaks at once (so it may be sent tasks straight away): a hello
/// without kinds or concurrency, which is what the seed protocol's silent worker gets.
fn join(core: &mut Core, io: &mut FakeIo, w: ConnRef, ip: &str) {
    core.worker_connected(io, w, ip.parse().expect("ip"));
    core.worker_message(io, w, r#"{"type":"hello"}"#);
}

fn outcomes(core: &Core, id: TaskId) -> Vec<Outcome> {
    core.task(id).expect("task").attempts.iter().filter_map(|a| a.outcome).collect()
}

#[test]
fn submit_decisions() {
    // (workers' hellos, task kind, expected: Ok(index of worker that gets it) or error)
    type Case<'a> = (&'a [Option<&'a str>], Option<&'a str>, Result<Option<usize>, SubmitError>);
    let table: &[Case] = &[
        (&[], None, Err(SubmitError::NoWorker)),
        (&[None], None, Ok(Some(0))),
        (&[None], Some("x"), Ok(Some(0))),
        (&[Some(r#"{"type":"hello","kinds":["a"]}"#)], Some("b"), Err(SubmitError::NoWorker)),
        (&[Some(r#"{"type":"hello","kinds":["a"]}"#)], None, Err(SubmitError::NoWorker)),
        (&[Some(r#"{"type":"hello","kinds":["a"]}"#), None], Some("b"), Ok(Some(1))),
        (&[Some(r#"{"type":"hello","kinds":[]}"#)], Some("a"), Err(SubmitError::NoWorker)),
        (&[Some(r#"{"type":"hello","concurrency":0}"#)], None, Err(SubmitError::NoWorker)),
        // Busy but eligible: accepted and pending, not 503.
        (&[Some(r#"{"type":"hello","concurrency":1}"#)], None, Ok(Some(0))),
    ];
    for (hellos, kind, expected) in table {
        let mut c = core();
        let mut io = FakeIo::default();
        let ws: Vec<ConnRef> = (0..hellos.len() as u32).map(conn).collect();
        for (w, hello) in ws.iter().zip(hellos.iter()) {
            match hello {
                Some(h) => {
                    c.worker_connected(&mut io, *w, "127.0.0.1".parse().expect("ip"));
                    c.worker_message(&mut io, *w, h);
                }
                None => join(&mut c, &mut io, *w, "127.0.0.1"),
            }
        }
        let got = submit(&mut c, &mut io, "{}", *kind).map(|id| ws.iter().position(|w| io.tasks_to(*w).contains(&id)));
        assert_eq!(got, *expected, "hellos {hellos:?} kind {kind:?}");
    }
}

#[test]
fn round_robin_per_kind() {
    let mut c = core();
    let mut io = FakeIo::default();
    let ws = [conn(0), conn(1), conn(2)];
    for w in ws {
        join(&mut c, &mut io, w, "127.0.0.1");
    }
    let ids: Vec<TaskId> = (0..6).map(|_| submit(&mut c, &mut io, "{}", Some("k")).expect("ok")).collect();
    for w in ws {
        assert_eq!(io.tasks_to(w).len(), 2, "two each");
    }
    // Consecutive tasks go to different workers.
    for pair in ids.windows(2) {
        let owner = |id| ws.iter().position(|w| io.tasks_to(*w).contains(id));
        assert_ne!(owner(&pair[0]), owner(&pair[1]));
    }
}

#[test]
fn send_failed_moves_the_task_on() {
    let mut c = core();
    let mut io = FakeIo::default();
    let (a, b) = (conn(0), conn(1));
    join(&mut c, &mut io, a, "10.0.0.1");
    join(&mut c, &mut io, b, "10.0.0.2");
    io.broken.push(a);
    io.broken.push(b);
    let id = submit(&mut c, &mut io, "{}", None).expect("accepted");
    assert_eq!(outcomes(&c, id), [Outcome::SendFailed, Outcome::SendFailed]);
    assert_eq!(c.task(id).expect("task").status, Status::Failed);
    assert_eq!(c.task(id).expect("task").error.as_deref(), Some("could not write the task to the worker"));

    io.broken.retain(|w| *w != b);
    let id = submit(&mut c, &mut io, "{}", None).expect("accepted");
    let t = c.task(id).expect("task");
    assert_eq!(t.status, Status::Dispatched);
    assert_eq!(
        t.attempts.last().map(|a| a.client_ip.to_string()).as_deref(),
        Some("10.0.0.2"),
        "on the writable worker"
    );
    assert!(t.attempts[..t.attempts.len() - 1].iter().all(|a| a.outcome == Some(Outcome::SendFailed)));
    assert_eq!(io.tasks_to(b), [id]);
}

#[test]
fn only_the_current_attempt_finishes_a_task() {
    let mut c = core();
    let mut io = FakeIo::default();
    let (a, b) = (conn(0), conn(1));
    join(&mut c, &mut io, a, "10.0.0.1");
    let id = submit(&mut c, &mut io, "{}", None).expect("accepted");
    join(&mut c, &mut io, b, "10.0.0.2");
    // a times out; the task moves to b.
    c.set_clock(1_000, 1_001_000);
    let mut fired = Vec::new();
    c.wheel.advance(1_000, &mut fired);
    for t in fired {
        c.on_timer(&mut io, t);
    }
    assert_eq!(io.tasks_to(b), [id]);
    result(&mut c, &mut io, a, id, true); // late
    assert_eq!(c.task(id).expect("task").status, Status::Dispatched);
    assert_eq!(c.metrics.ignored[Ignored::Late as usize], 1);
    result(&mut c, &mut io, b, id, true);
    assert_eq!(c.task(id).expect("task").status, Status::Done);
    result(&mut c, &mut io, b, id, true); // duplicate
    assert_eq!(c.metrics.ignored[Ignored::Duplicate as usize], 1);
    assert_eq!(outcomes(&c, id), [Outcome::Timeout, Outcome::Done]);
    // A stale connection reference (same slot, older generation) is not the worker.
    result(&mut c, &mut io, ConnRef { slot: 1, generation: 0 }, id, true);
    assert_eq!(c.metrics.ignored.iter().sum::<u64>(), 2);
}

#[test]
fn waiters_are_answered_once_and_forgotten_on_close() {
    let mut c = core();
    let mut io = FakeIo::default();
    let w = conn(0);
    join(&mut c, &mut io, w, "10.0.0.1");
    let id = submit(&mut c, &mut io, "{}", None).expect("accepted");
    let (h1, h2) = (conn(10), conn(11));
    assert!(c.wait(&mut io, h1, id, true).is_none());
    assert!(c.wait(&mut io, h2, id, false).is_none());
    c.conn_closed(h2);
    result(&mut c, &mut io, w, id, true);
    assert_eq!(io.replies, [(h1, 200)]);
    assert!(!c.has_held());
    // A final task answers at once.
    assert_eq!(c.wait(&mut io, h1, id, true).map(|r| r.status), Some(200));
}

#[test]
fn canceled_attempts_free_the_slot_and_notify_the_worker() {
    let mut c = core();
    let mut io = FakeIo::default();
    let w = conn(0);
    join(&mut c, &mut io, w, "10.0.0.1");
    c.worker_message(&mut io, w, r#"{"type":"hello","concurrency":1}"#);
    let first = submit(&mut c, &mut io, "1", None).expect("accepted");
    let second = submit(&mut c, &mut io, "2", None).expect("accepted");
    assert_eq!(c.task(second).expect("t").status, Status::Pending);
    assert_eq!(c.cancel_direct(&mut io, first), CancelResult::Canceled);
    assert!(io.sent.iter().any(|(_, t)| t.contains("\"type\":\"cancel\"")));
    assert_eq!(io.tasks_to(w), [first, second], "the freed slot took the next task");
    assert_eq!(c.cancel_direct(&mut io, first), CancelResult::AlreadyFinal);
    assert_eq!(c.cancel_direct(&mut io, 42), CancelResult::NotFound);
}

#[test]
fn human_durations() {
    for (ms, text) in [(10_000, "10s"), (1_500, "1.5s"), (250, "250ms"), (60_000, "60s")] {
        assert_eq!(human_ms(ms), text);
    }
}

mod model;
mod model_runs;
mod regressions;
mod restarts;

#[test]
fn sessions_that_held_nothing_do_not_use_up_the_room_of_those_that_held_attempts() {
    // MAX_HELD_SESSIONS connections said hello with a worker id and were lost running nothing
    // (a flood, or a crash loop): a worker lost while it runs a task is still held.
    let mut core = core();
    core.resume_window_ms = 10_000;
    let mut io = FakeIo::default();
    let n = sessions::MAX_HELD_SESSIONS as u32;
    for slot in 0..=n {
        let w = conn(slot);
        core.worker_connected(&mut io, w, "10.0.0.1".parse().expect("ip"));
        core.worker_message(&mut io, w, &format!(r#"{{"type":"hello","worker_id":"idle-{slot}"}}"#));
        core.worker_disconnected(&mut io, w, "cut");
    }
    assert_eq!(core.sessions.held_empty, sessions::MAX_HELD_SESSIONS, "the empty ones are bounded");
    let w = conn(n + 1);
    core.worker_connected(&mut io, w, "10.0.0.2".parse().expect("ip"));
    core.worker_message(&mut io, w, r#"{"type":"hello","worker_id":"busy"}"#);
    let id = submit(&mut core, &mut io, r#"{"n":1}"#, None).expect("submitted");
    assert_eq!(io.tasks_to(w), vec![id]);
    core.worker_disconnected(&mut io, w, "cut");
    assert_eq!(outcomes(&core, id), Vec::<Outcome>::new(), "held, not ended");
    assert_eq!(core.metrics.attempts_held, 1);
}

#[test]
fn a_session_worker_runs_no_more_attempts_than_a_resume_can_list() {
    // Found by issue 20's hostile probe: a resume reads the first MAX_RUNNING_LISTED entries
    // of `running`; a session worker with a larger concurrency (or none declared) held more, and
    // the attempts past the list's end were ended at the resume ("worker no longer runs this
    // task") while the worker still ran them — they ran twice.
    for hello in [r#"{"concurrency":100000,"#, "{"] {
        let cap = sessions::MAX_RUNNING_LISTED;
        let mut core = core_with(|m| m.max_pending = 2 * cap);
        core.resume_window_ms = 10_000;
        let mut io = FakeIo::default();
        let (w, again) = (conn(0), conn(1));
        core.worker_connected(&mut io, w, "10.0.0.1".parse().expect("ip"));
        core.worker_message(&mut io, w, &format!(r#"{hello}"type":"hello","worker_id":"many"}}"#));
        let welcome = io.sent.iter().find(|(_, t)| t.contains("welcome")).expect("welcome");
        let secret = serde_json::from_str::<serde_json::Value>(&welcome.1).expect("json")["session"].clone();
        let ids: Vec<TaskId> = (0..cap + 4)
            .map(|i| {
                let p = payload(&i.to_string());
                core.submit_direct(&mut io, NewTask::queued(&p, None)).expect("accepted")
            })
            .collect();
        let sent = io.tasks_to(w);
        assert_eq!(sent.len(), cap, "{hello}: at most {cap} at once");
        core.worker_disconnected(&mut io, w, "cut");
        core.worker_connected(&mut io, again, "10.0.0.1".parse().expect("ip"));
        let running: Vec<serde_json::Value> =
            sent.iter().map(|id| serde_json::json!({"task_id": uuid_string(*id), "attempt": 1})).collect();
        let resume = serde_json::json!({"type": "hello", "worker_id": "many", "session": secret, "running": running});
        core.worker_message(&mut io, again, &resume.to_string());
        let ended = ids.iter().filter(|id| !outcomes(&core, **id).is_empty()).count();
        assert_eq!(ended, 0, "{hello}: every held attempt adopted, none ended");
        for id in &sent {
            result(&mut core, &mut io, again, *id, true);
        }
        assert_eq!(io.tasks_to(again).len(), 4, "{hello}: the rest follow as room frees");
    }
}
