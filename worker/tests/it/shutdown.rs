//! SIGTERM/SIGINT: hello with concurrency 0, tasks that still arrive are refused, running tasks
//! finish and are answered, exit 0.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::fake_relay::FakeRelay;
use crate::support::target::{Reply, Target};
use crate::support::{Relay, Worker, poll_until};

#[test]
fn sigterm_lets_a_running_task_finish() {
    crate::require_relay!();
    let target = Target::start(|_, _| {
        Reply::After(Duration::from_millis(2000), Box::new(Reply::json(200, &json!({"slow": true}))))
    });
    let relay = Relay::start();
    let mut worker = Worker::start(&relay.ws_url(), &[]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |c| c["active"] == true);

    let id = relay.submit(json!({"kind": "http", "spec": {"url": target.url("/slow")}}));
    assert!(poll_until(Duration::from_secs(5), || target.hit_count() == 1), "the task is running");
    worker.proc.signal("TERM");

    // Draining: relay still lists the worker, inactive, and has nobody for new tasks.
    relay.wait_clients(1, Duration::from_secs(5), |c| c["active"] == false && c["concurrency"] == 0);
    let (status, _) =
        relay.api("POST", "/tasks", Some(r#"{"payload":{"kind":"http","spec":{"url":"http://127.0.0.1:1/"}}}"#));
    assert_eq!(status, 503);

    let task = relay.wait_final(&id, Duration::from_secs(5));
    assert_eq!(task["status"], "done", "{task}");
    assert_eq!(task["result"]["body"], json!({"slow": true}));
    let status = worker.proc.wait_exit(Duration::from_secs(5)).expect("worker exits after draining");
    assert_eq!(status.code(), Some(0));
    let log = worker.proc.log_text();
    assert!(log.contains("msg=draining reason=SIGTERM in_flight=1"), "{log}");
    assert!(log.contains("msg=stopped reason=drained"), "{log}");
}

/// relay stops sending tasks after `hello` with concurrency 0, but one already on the wire
/// still arrives: it is answered `failed` / `worker shutting down` so relay moves it on.
#[test]
fn a_task_arriving_while_draining_is_refused() {
    let target = Target::start(|_, _| Reply::After(Duration::from_millis(2000), Box::new(Reply::new(200, &[], "ok"))));
    let fake = FakeRelay::start();
    let mut worker = Worker::start(&fake.ws_url(), &[]);
    let mut conn = fake.accept(Duration::from_secs(10)).expect("worker connects");
    conn.recv_type("hello", Duration::from_secs(5)).expect("hello");
    conn.send(
        &json!({"type": "task", "task_id": "running", "payload": {"kind": "http", "spec": {"url": target.url("/")}}}),
    );
    assert!(poll_until(Duration::from_secs(5), || target.hit_count() == 1), "task started");

    worker.proc.signal("INT");
    let hello = conn.recv_type("hello", Duration::from_secs(5));
    let hello = hello.unwrap_or_else(|| panic!("no draining hello; worker log:\n{}", worker.proc.log_text()));
    assert_eq!(hello["concurrency"], 0, "{hello}");
    conn.send(
        &json!({"type": "task", "task_id": "late", "payload": {"kind": "http", "spec": {"url": target.url("/")}}}),
    );
    let refused = conn.recv_type("result", Duration::from_secs(5)).expect("an answer to the late task");
    assert_eq!(
        refused,
        json!({"type": "result", "task_id": "late", "status": "failed", "error": "worker shutting down"})
    );
    let finished = conn.recv_type("result", Duration::from_secs(5)).expect("the running task's result");
    assert_eq!(
        (finished["task_id"].as_str(), finished["status"].as_str()),
        (Some("running"), Some("done")),
        "{finished}"
    );
    assert_eq!(worker.proc.wait_exit(Duration::from_secs(5)).and_then(|s| s.code()), Some(0));
    assert_eq!(target.hit_count(), 1, "the refused task never ran");
}

/// Sends `sig` to `pid` straight from this process (no `kill` child in between), so two calls
/// land microseconds apart, as GNU `timeout` signalling the child and then its process group.
fn raw_signal(pid: u32, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("pid fits pid_t");
    // SAFETY: kill(2) on a child we spawned and have not yet reaped.
    let rc = unsafe { libc::kill(pid, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig}): {}", std::io::Error::last_os_error());
}

/// Two SIGTERMs back to back (GNU `timeout`, some supervisors) are one request to drain: a
/// repeat signal forces the exit only once 1 s has passed since the first. The second pair is
/// sent after the worker has certainly handled the first signal (its `draining` line), so the
/// handler does see a repeat rather than one coalesced pending signal. That needs the worker to
/// log `draining` well within the second: on a machine too loaded for that, the premise does
/// not hold and the scenario starts over (at most three times) rather than passing or failing
/// on the clock.
#[test]
fn sigterms_back_to_back_still_drain() {
    crate::require_relay!();
    for attempt in 1..=3 {
        match back_to_back_signals() {
            Some(()) => return,
            None => eprintln!(
                "sigterms_back_to_back_still_drain: attempt {attempt} too slow to land the repeats within 1 s"
            ),
        }
    }
    panic!("three attempts in a row could not land the repeat signals within 1 s of the first");
}

/// One run of the scenario; `None` when the repeats came too late to test the rule.
fn back_to_back_signals() -> Option<()> {
    let target = Target::start(|_, _| {
        Reply::After(Duration::from_millis(2000), Box::new(Reply::json(200, &json!({"slow": true}))))
    });
    let relay = Relay::start();
    let mut worker = Worker::start(&relay.ws_url(), &[]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |c| c["active"] == true);

    let id = relay.submit(json!({"kind": "http", "spec": {"url": target.url("/slow")}}));
    assert!(poll_until(Duration::from_secs(5), || target.hit_count() == 1), "the task is running");
    let pid = worker.proc.pid();
    let first = Instant::now();
    raw_signal(pid, libc::SIGTERM);
    raw_signal(pid, libc::SIGTERM);
    assert!(worker.proc.wait_log("msg=draining", Duration::from_secs(5)), "{}", worker.proc.log_text());
    if first.elapsed() >= Duration::from_millis(900) {
        return None;
    }
    raw_signal(pid, libc::SIGTERM);
    raw_signal(pid, libc::SIGINT);
    if first.elapsed() >= Duration::from_millis(900) {
        return None;
    }

    let task = relay.wait_final(&id, Duration::from_secs(5));
    assert_eq!(task["status"], "done", "{task}; worker log:\n{}", worker.proc.log_text());
    assert_eq!(task["result"]["body"], json!({"slow": true}));
    let status = worker.proc.wait_exit(Duration::from_secs(5)).expect("worker exits after draining");
    assert_eq!(status.code(), Some(0), "{}", worker.proc.log_text());
    let log = worker.proc.log_text();
    assert_eq!(worker.proc.count_log("msg=draining"), 1, "{log}");
    assert!(log.contains("msg=stopped reason=drained"), "{log}");
    Some(())
}

/// An operator who does not want to wait: a repeat signal 1 s or more after the first ends the
/// worker at once with exit 1, even with a task still running.
#[test]
fn a_repeat_signal_after_a_second_exits_at_once() {
    crate::require_relay!();
    let target =
        Target::start(|_, _| Reply::After(Duration::from_millis(10_000), Box::new(Reply::new(200, &[], "ok"))));
    let relay = Relay::start();
    let mut worker = Worker::start(&relay.ws_url(), &[]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |c| c["active"] == true);

    relay.submit(json!({"kind": "http", "spec": {"url": target.url("/slow")}}));
    assert!(poll_until(Duration::from_secs(5), || target.hit_count() == 1), "the task is running");
    let pid = worker.proc.pid();
    raw_signal(pid, libc::SIGTERM);
    assert!(worker.proc.wait_log("msg=draining", Duration::from_secs(5)), "{}", worker.proc.log_text());
    // The worker logged `draining` after it took the signal: 1.2 s from here is more than 1 s
    // from the signal by the worker's clock too. It must not end by itself meanwhile.
    let waited = worker.proc.wait_exit(Duration::from_millis(1200));
    assert!(waited.is_none(), "still draining: {}", worker.proc.log_text());
    raw_signal(pid, libc::SIGTERM);
    let status = worker.proc.wait_exit(Duration::from_secs(3)).expect("the repeat signal ends the worker at once");
    assert_eq!(status.code(), Some(1), "{}", worker.proc.log_text());
}
