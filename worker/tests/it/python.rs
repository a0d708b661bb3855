//! The Python example worker (`examples/worker.py`, standard library + `websockets`) against
//! the real relay: proof that docs/protocol.md is enough to write a worker.

use std::path::Path;
use std::time::Duration;

use serde_json::json;

use crate::support::{Relay, WRK, python_missing, skip_or_fail, spawn_python};

#[test]
fn python_example_worker_runs_tasks_and_drains() {
    crate::require_relay!();
    if let Some(why) = python_missing() {
        skip_or_fail(&why);
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/worker.py");
    let relay = Relay::start();
    let url = relay.ws_url();
    let mut worker = spawn_python(&script, &[("RELAY_URL", &url), ("TOKEN", WRK), ("CONCURRENCY", "2")]);
    let connected = worker.wait_log("msg=\"connected\"", Duration::from_secs(15));
    assert!(connected, "worker.py did not connect:\n{}", worker.log_text());
    relay.wait_clients(1, Duration::from_secs(5), |c| {
        c["kinds"] == json!(["echo", "fail", "sleep"]) && c["concurrency"] == 2 && c["version"] == "worker.py/1"
    });

    let task = relay.run_task(json!({"kind": "echo", "spec": {"hello": ["world", 1]}}));
    assert_eq!(task["status"], "done", "{task}");
    assert_eq!(task["result"], json!({"hello": ["world", 1]}));

    // A handler's retry hints (SPEC §13). `any_worker` would run a retry on this one worker
    // at once: `retry: false` ends the task after one attempt instead...
    let submit = |spec: serde_json::Value| {
        let body = json!({"payload": {"kind": "fail", "spec": spec}, "retry": {"any_worker": true}});
        let (status, t) = relay.api("POST", "/tasks", Some(&body.to_string()));
        assert_eq!(status, 202, "{t}");
        t["task_id"].as_str().expect("task_id").to_string()
    };
    let id = submit(json!({"error": "bad input", "retry": false}));
    let task = relay.wait_final(&id, Duration::from_secs(5));
    assert_eq!((task["status"].as_str(), task["error"].as_str()), (Some("failed"), Some("bad input")), "{task}");
    assert_eq!(task["attempts"], 1, "retry: false is final: {task}");
    // ... and `retry_after_ms` holds the retry back, pending as `backoff`.
    let id = submit(json!({"error": "upstream 503", "retry_after_ms": 60_000}));
    let mut task = json!(null);
    let waits = crate::support::poll_until(Duration::from_secs(5), || {
        task = relay.api("GET", &format!("/tasks/{id}"), None).1;
        task["waiting_on"] == "backoff"
    });
    assert!(waits, "the retry does not wait: {task}");
    assert_eq!((task["status"].as_str(), task["attempts"].as_u64()), (Some("pending"), Some(1)), "{task}");
    assert!(task["next_attempt_at"].is_string(), "{task}");
    assert_eq!(relay.api("DELETE", &format!("/tasks/{id}"), None).0, 200);

    let id = relay.submit(json!({"kind": "sleep", "spec": {"ms": 2000}}));
    relay.wait_clients(1, Duration::from_secs(5), |c| c["in_flight"] == 1);
    worker.signal("TERM");
    relay.wait_clients(1, Duration::from_secs(5), |c| c["active"] == false);
    let task = relay.wait_final(&id, Duration::from_secs(5));
    assert_eq!((task["status"].as_str(), &task["result"]), (Some("done"), &json!({"slept_ms": 2000})), "{task}");
    let status = worker.wait_exit(Duration::from_secs(10)).expect("worker.py exits after draining");
    assert_eq!(status.code(), Some(0), "{}", worker.log_text());
}

#[test]
fn python_example_worker_stops_on_a_wrong_token() {
    crate::require_relay!();
    if let Some(why) = python_missing() {
        skip_or_fail(&why);
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/worker.py");
    let relay = Relay::start();
    let url = relay.ws_url();
    let mut worker = spawn_python(&script, &[("RELAY_URL", &url), ("TOKEN", "not-the-token")]);
    let status = worker.wait_exit(Duration::from_secs(15));
    let log = worker.log_text();
    assert_eq!(status.and_then(|s| s.code()), Some(2), "a 401 is final for worker.py too:\n{log}");
    assert!(log.contains("relay refused TOKEN (HTTP 401)"), "{log}");
    assert!(!log.contains("retry_in_ms"), "{log}");
}

/// The Python worker speaks sessions (docs/protocol.md, "Sessions"): after a cut it presents
/// its session and what it ran, and a result finished meanwhile goes out once adopted, echoing
/// the attempt.
#[test]
fn python_example_worker_resumes_its_session() {
    if let Some(why) = python_missing() {
        skip_or_fail(&why);
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/worker.py");
    let fake = crate::support::fake_relay::FakeRelay::start();
    let url = fake.ws_url();
    let worker = spawn_python(&script, &[("RELAY_URL", &url), ("TOKEN", WRK), ("WORKER_ID", "py-1")]);
    let mut conn = fake.accept(Duration::from_secs(15)).expect("worker.py connects");
    let hello = conn.recv_type("hello", Duration::from_secs(5)).expect("hello");
    assert_eq!((hello["worker_id"].clone(), hello["running"].clone()), (json!("py-1"), json!([])), "{hello}");
    conn.send(
        &json!({"type":"welcome","client_id":"c","session":"s-1","resume_window_ms":10000,"adopted":[],"abandon":[]}),
    );
    conn.send(&json!({"type":"task","task_id":"t-1","attempt":2,"payload":{"kind":"sleep","spec":{"ms":300}}}));
    conn.cut();
    let mut again = fake.accept(Duration::from_secs(15)).expect("worker.py reconnects");
    let hello = again.recv_type("hello", Duration::from_secs(5)).expect("hello again");
    assert_eq!(hello["session"], "s-1", "{hello}");
    assert_eq!(hello["running"], json!([{"task_id": "t-1", "attempt": 2}]), "{hello}");
    assert!(worker.wait_log("result kept", Duration::from_secs(5)), "{}", worker.log_text());
    again.send(&json!({"type":"welcome","client_id":"c","session":"s-1","resume_window_ms":10000,"adopted":["t-1"],"abandon":[]}));
    let r = again.recv_type("result", Duration::from_secs(5)).expect("the kept result");
    assert_eq!(
        (r["task_id"].clone(), r["attempt"].clone(), r["data"].clone()),
        (json!("t-1"), json!(2), json!({"slept_ms": 300})),
        "{r}"
    );
}

/// As relay-worker (worker it sessions::a_worker_with_held_work_reconnects_within...): while
/// its session holds a task, worker.py reconnects within a quarter of the resume window, however
/// often it was cut (its backoff alone doubled past a 2 s window by the fourth cut).
#[test]
fn python_example_worker_reconnects_within_the_resume_window_while_it_holds_a_task() {
    if let Some(why) = python_missing() {
        skip_or_fail(&why);
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/worker.py");
    let fake = crate::support::fake_relay::FakeRelay::start();
    let url = fake.ws_url();
    let _worker = spawn_python(&script, &[("RELAY_URL", &url), ("TOKEN", WRK), ("WORKER_ID", "py-often")]);
    let mut conn = fake.accept(Duration::from_secs(15)).expect("worker.py connects");
    conn.recv_type("hello", Duration::from_secs(5)).expect("hello");
    conn.send(
        &json!({"type":"welcome","client_id":"c","session":"s-o","resume_window_ms":2000,"adopted":[],"abandon":[]}),
    );
    conn.send(&json!({"type":"task","task_id":"t-o","attempt":1,"payload":{"kind":"sleep","spec":{"ms":20000}}}));
    conn.recv(Duration::from_millis(300)); // (the task has started)
    for round in 0..6 {
        conn.cut();
        let cut = std::time::Instant::now();
        conn = fake.accept(Duration::from_secs(20)).expect("worker.py reconnects");
        let took = cut.elapsed();
        assert!(took < Duration::from_millis(1000), "round {round}: back in {took:?}, the window is 2 s");
        conn.recv_type("hello", Duration::from_secs(5)).expect("hello");
    }
}
