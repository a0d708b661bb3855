//! Regression tests of the dispatch core, each named after the bug it pins (issue 10).

use super::*;

fn submit_queued(core: &mut Core, io: &mut FakeIo, kind: Option<&str>) -> TaskId {
    let p = payload("{}");
    core.submit_direct(io, NewTask::queued(&p, kind)).expect("queued")
}

/// Advances both clocks to `now_ms` and fires what is due.
fn advance(core: &mut Core, io: &mut FakeIo, now_ms: u64) {
    let wall = core.wall_ms + (now_ms - core.now_ms);
    core.set_clock(now_ms, wall);
    let mut fired = Vec::new();
    core.wheel.advance(now_ms, &mut fired);
    for t in fired {
        core.on_timer(io, t);
    }
}

#[test]
fn new_worker_gets_queued_tasks_before_its_hello() {
    let mut c = core();
    let mut io = FakeIo::default();
    let gpu: Vec<TaskId> = (0..3).map(|_| submit_queued(&mut c, &mut io, Some("gpu"))).collect();
    let busy: Vec<TaskId> = (0..6).map(|_| submit_queued(&mut c, &mut io, Some("http"))).collect();
    let w = conn(0);
    c.worker_connected(&mut io, w, "10.0.0.1".parse().expect("ip"));
    assert!(io.sent.is_empty(), "nothing goes to a worker before its first message: {:?}", io.sent);
    c.worker_message(&mut io, w, r#"{"type":"hello","kinds":["http"],"concurrency":1}"#);
    assert_eq!(io.tasks_to(w), [busy[0]], "one http task for a worker of concurrency 1");
    for id in gpu {
        let t = c.task(id).expect("task");
        assert_eq!((t.status, t.attempts.len()), (Status::Pending, 0), "a gpu task never reaches an http worker");
    }
}

#[test]
fn silent_worker_is_served_after_the_hello_grace() {
    let mut c = core();
    let mut io = FakeIo::default();
    let id = submit_queued(&mut c, &mut io, Some("any"));
    let w = conn(0);
    c.worker_connected(&mut io, w, "10.0.0.1".parse().expect("ip"));
    advance(&mut c, &mut io, HELLO_GRACE_MS - 1);
    assert!(io.tasks_to(w).is_empty(), "still within the grace");
    advance(&mut c, &mut io, HELLO_GRACE_MS + 50);
    assert_eq!(io.tasks_to(w), [id], "a worker that never says hello takes every kind after the grace");
}

#[test]
fn any_first_text_message_ends_the_hello_wait() {
    let mut c = core();
    let mut io = FakeIo::default();
    let id = submit_queued(&mut c, &mut io, None);
    let w = conn(0);
    c.worker_connected(&mut io, w, "10.0.0.1".parse().expect("ip"));
    c.worker_message(&mut io, w, "not json");
    assert_eq!(io.tasks_to(w), [id]);
}

#[test]
fn full_worker_output_buffer_is_recorded_as_send_failed() {
    // Issue 10 #3: a full buffer burned an attempt (`send_failed`) and, with one worker, failed
    // the task. It means "no capacity right now": the task waits and goes out once it drains.
    let mut c = core();
    let mut io = FakeIo::default();
    let w = conn(0);
    join(&mut c, &mut io, w, "10.0.0.1");
    io.full.push(w);
    let plain = submit(&mut c, &mut io, "{}", None).expect("a full buffer is not a 503");
    let queued = submit_queued(&mut c, &mut io, None);
    for id in [plain, queued] {
        let t = c.task(id).expect("task");
        assert_eq!((t.status, t.attempts.len()), (Status::Pending, 0), "waits without an attempt");
    }
    assert_eq!(c.metrics.attempts.iter().sum::<u64>(), 0, "no attempt was used up");
    io.full.clear();
    c.worker_drained(&mut io, w);
    assert_eq!(io.tasks_to(w), [plain, queued], "both go out in order once it drains");
    assert!(outcomes(&c, plain).is_empty() && outcomes(&c, queued).is_empty());
}

#[test]
fn recheck_fragile_costs_waiting_tasks_times_workers() {
    // Issue 10 #8: every hello and every disconnect rechecked each waiting retry or plain task
    // against every worker. Now it looks only at kinds the worker stopped taking.
    let mut c = core_with(|m| {
        m.max_pending = 1 << 20;
        m.max_pending_bytes = 1 << 30;
    });
    let mut io = FakeIo::default();
    let hello = r#"{"type":"hello","kinds":["a"],"concurrency":1}"#;
    for w in [conn(0), conn(1)] {
        c.worker_connected(&mut io, w, "10.0.0.1".parse().expect("ip"));
        c.worker_message(&mut io, w, hello);
    }
    let waiting = 50_000;
    for _ in 0..waiting + 2 {
        submit(&mut c, &mut io, "{}", Some("a")).expect("accepted");
    }
    assert_eq!(c.task_count(Status::Pending), waiting);
    let started = std::time::Instant::now();
    // A worker looping on the same hello, and a fleet of unrelated workers coming and going.
    for _ in 0..2_000 {
        c.worker_message(&mut io, conn(1), hello);
    }
    for i in 0..500 {
        let w = ConnRef { slot: 2, generation: i };
        c.worker_connected(&mut io, w, "10.0.0.2".parse().expect("ip"));
        c.worker_message(&mut io, w, r#"{"type":"hello","kinds":["b"]}"#);
        c.worker_disconnected(&mut io, w, "gone");
    }
    let took = started.elapsed();
    assert!(took < std::time::Duration::from_secs(3), "2,500 hellos and 500 disconnects took {took:?}");
    assert_eq!(c.task_count(Status::Pending), waiting, "nothing lost hope");
    // When the last worker of kind a leaves, every plain task waiting for it fails at once.
    c.worker_disconnected(&mut io, conn(0), "gone");
    assert_eq!(c.task_count(Status::Pending), waiting + 1, "one a-worker is still there; its task waits as a retry");
    c.worker_message(&mut io, conn(1), r#"{"type":"hello","kinds":["b"],"concurrency":1}"#);
    assert_eq!(c.task_count(Status::Pending), 0);
    assert_eq!(c.task_count(Status::Failed), waiting + 1, "the retry from the departed worker too");
}

#[test]
fn max_pending_counts_tasks_whatever_their_payload_size() {
    // Issue 10 #10: MAX_PENDING_BYTES bounds the payload bytes waiting as pending.
    let mut c = core_with(|m| m.max_pending_bytes = 1_000);
    let mut io = FakeIo::default();
    let big = payload(&format!("\"{}\"", "x".repeat(398))); // 400 bytes of JSON text
    let queued = |c: &mut Core, io: &mut FakeIo| c.submit_direct(io, NewTask::queued(&big, None));
    let first = queued(&mut c, &mut io).expect("400 bytes wait");
    queued(&mut c, &mut io).expect("800 bytes wait");
    assert_eq!(queued(&mut c, &mut io), Err(SubmitError::QueueFull), "1,200 bytes would be over 1,000");
    assert_eq!(c.cancel_direct(&mut io, first), CancelResult::Canceled);
    queued(&mut c, &mut io).expect("a canceled task's bytes are free again");
    // Dispatched tasks do not count: a worker takes both, and two more fit.
    join(&mut c, &mut io, conn(0), "10.0.0.1");
    assert_eq!(c.task_count(Status::Pending), 0);
    queued(&mut c, &mut io).expect("nothing waits now");
}

/// (Review of issues 9/12.) Restoring the journal put tasks that had expired while relay was
/// down into the listing index before forgetting them: their entries stayed for the life of
/// the process, and every page had to step over them.
#[test]
fn tasks_that_expired_while_relay_was_down_leave_nothing_in_the_listing_index() {
    use crate::journal::codec::{RecordType, put_frame, put_task, segment_header};
    let mut before = core();
    let mut io = FakeIo::default();
    let id = submit_queued(&mut before, &mut io, Some("k"));
    assert_eq!(before.cancel_direct(&mut io, id), CancelResult::Canceled);
    let mut segment = segment_header().to_vec();
    put_frame(&mut segment, 1, RecordType::Task, |out| put_task(out, before.task(id).expect("task")));
    let replayed = crate::journal::replay::replay_bytes(&[(1, &segment)], 64 << 20);
    assert_eq!(replayed.tasks.len(), 1);

    // One TASK_TTL (60 s) and a bit later.
    let mut after = core();
    after.set_clock(0, before.wall_ms + 61_000);
    let restored = after.store.mem_mut().map(|m| m.restore(replayed));
    assert_eq!(restored, Some(0), "nothing to restore: it expired");
    assert!(after.task(id).is_none());
    assert_eq!(after.task_count(Status::Canceled), 0);
    assert_eq!(after.tasks_newest_first(u64::MAX).len(), 0, "a forgotten task left in the listing index");
}
