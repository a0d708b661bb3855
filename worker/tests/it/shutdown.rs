//! SIGTERM/SIGINT: hello with concurrency 0, tasks that still arrive are refused, running tasks
//! finish and are answered, exit 0.

use std::time::Duration;

use serde_json::json;

use crate::support::fake_relay::FakeRelay;
use crate::support::target::{Reply, Target};
use crate::support::{Relay, Worker, poll_until};

#[test]
fn sigterm_lets_a_running_task_finish() {
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
