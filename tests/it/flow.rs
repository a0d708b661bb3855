//! Flow control (SPEC §14): priorities (a head start in seconds over due order), in both modes.

use std::time::Duration;

use serde_json::{Value, json};

use crate::support::*;

fn id_of(r: &Resp) -> String {
    assert_eq!(r.status, 202, "{}", r.text());
    r.json()["task_id"].as_str().expect("task_id").to_string()
}

/// Queues a task (no worker needed) with `extra` fields on the submit body.
fn queued(relay: &Relay, name: &str, extra: &str) -> String {
    id_of(&relay.submit(&format!(r#"{{"payload":{{"n":"{name}"}},"queue":true{extra}}}"#)))
}

/// The names of the next `n` tasks a worker of concurrency 1 is sent, answering each.
fn run_in_order(w: &FakeWorker, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| {
            let t = w.expect_task();
            w.done(&t.id, json!(null));
            t.payload["n"].as_str().expect("n").to_string()
        })
        .collect()
}

#[test]
fn priority_orders_due_tasks_by_head_start_ties_in_submission_order() {
    for_each_mode(|mode| {
        let relay = mode.start();
        for (name, p) in [("a", 0), ("b", 0), ("c", 60), ("d", -60), ("e", 60), ("f", 86_400), ("g", -86_400)] {
            queued(&relay, name, &format!(r#","priority":{p}"#));
        }
        let w = FakeWorker::connect(&relay, Some(json!({"type":"hello","concurrency":1})), Auto::Manual);
        assert_eq!(run_in_order(&w, 7), ["f", "c", "e", "a", "b", "d", "g"]);
    });
}

#[test]
fn a_head_start_of_s_seconds_never_overtakes_a_task_that_waited_longer_than_s() {
    // x waits 1.5 s; then y (1 s of head start: x waited longer) and z (2 s: it overtakes x).
    for_each_mode(|mode| {
        let relay = mode.start();
        let x = queued(&relay, "x", "");
        let waited = std::time::Instant::now();
        poll_until(Duration::from_secs(5), || waited.elapsed() >= Duration::from_millis(1_500));
        queued(&relay, "y", r#","priority":1"#);
        queued(&relay, "z", r#","priority":2"#);
        assert_eq!(relay.get_task(&x)["status"], "pending");
        let w = FakeWorker::connect(&relay, Some(json!({"type":"hello","concurrency":1})), Auto::Manual);
        assert_eq!(run_in_order(&w, 3), ["z", "x", "y"]);
    });
}

#[test]
fn priority_never_runs_a_task_before_it_is_due() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let w = FakeWorker::connect(&relay, Some(json!({"type":"hello","concurrency":1})), Auto::Manual);
        relay.wait_clients(1, |c| c["concurrency"] == 1);
        let later = queued(&relay, "later", r#","delay":"2s","priority":86400"#);
        let now = queued(&relay, "now", "");
        let t = w.expect_task();
        assert_eq!(t.payload["n"], "now", "the task not due yet waits, whatever its priority");
        w.done(&t.id, json!(null));
        let task = relay.get_task(&later);
        assert_eq!((task["status"].as_str(), task["priority"].as_i64()), (Some("pending"), Some(86_400)), "{task}");
        let t = w.next_task(Duration::from_secs(6)).expect("the delayed task runs when due");
        assert_eq!(t.id, later);
        relay.wait_status(&now, "done", Duration::from_secs(2));
    });
}

#[test]
fn priority_is_validated_and_shown_in_the_task_json() {
    for_each_mode(|mode| {
        let relay = mode.start();
        for bad in ["1.5", "1e2", "86401", "-86401", "\"5\"", "[]", "99999999999999999999"] {
            let r = relay.submit(&format!(r#"{{"payload":1,"queue":true,"priority":{bad}}}"#));
            assert_eq!((r.status, r.error()), (400, "bad_request".to_string()), "priority {bad}: {}", r.text());
        }
        let batch = relay.api(
            "POST",
            "/tasks/batch",
            Some(r#"{"tasks":[{"payload":1,"priority":-5},{"payload":2,"priority":0.5},{"payload":3}]}"#),
        );
        assert_eq!(batch.status, 202, "{}", batch.text());
        let items = batch.json()["tasks"].as_array().expect("tasks").clone();
        assert_eq!(items[1]["error"], "bad_request", "{items:?}");
        let first = relay.get_task(items[0]["task_id"].as_str().expect("id"));
        assert_eq!(first["priority"], -5, "{first}");
        let plain = relay.get_task(items[2]["task_id"].as_str().expect("id"));
        assert!(plain.get("priority").is_none(), "no priority given, none shown: {plain}");
        let listed = relay.api("GET", "/tasks?status=pending", None).json();
        let shown: Vec<Value> =
            listed["tasks"].as_array().expect("tasks").iter().map(|t| t["priority"].clone()).collect();
        assert_eq!(shown, [Value::Null, json!(-5)], "newest first: {listed}");
    });
}

/// A directory of the test's own (a DATA_DIR), removed on drop.
pub struct TempDir(std::path::PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        TempDir(std::env::temp_dir().join(format!("relay-it-flow-{tag}-{}", uuid::Uuid::new_v4().simple())))
    }
    pub fn path(&self) -> &str {
        self.0.to_str().expect("utf-8 temp path")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A relay that keeps what it was told across [`restart`]: a journal (single node) or its
/// database (cluster).
pub fn durable(mode: Mode, dir: &TempDir, env: &[(&str, &str)]) -> Relay {
    let mut all = env.to_vec();
    if !mode.is_cluster() {
        all.push(("DATA_DIR", dir.path()));
    }
    mode.start_with(&all)
}

/// Stops `relay` and starts it again on the same journal or database.
pub fn restart(relay: Relay, dir: &TempDir, env: &[(&str, &str)]) -> Relay {
    let db = relay.db.clone();
    assert!(relay.stop().success());
    match db {
        Some(db) => Mode::start_on(db, env),
        None => {
            let mut all = env.to_vec();
            all.push(("DATA_DIR", dir.path()));
            Relay::start_with(&all)
        }
    }
}

#[test]
fn priorities_survive_a_restart() {
    for_each_mode(|mode| {
        let dir = TempDir::new("priority");
        let relay = durable(mode, &dir, &[]);
        for (name, p) in [("a", 0), ("b", -10), ("c", 10)] {
            queued(&relay, name, &format!(r#","priority":{p}"#));
        }
        let relay = restart(relay, &dir, &[]);
        let w = FakeWorker::connect(&relay, Some(json!({"type":"hello","concurrency":1})), Auto::Manual);
        assert_eq!(run_in_order(&w, 3), ["c", "a", "b"]);
    });
}
