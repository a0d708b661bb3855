//! Regression tests for the defects of issue 10, each named after the bug it pins. Each failed
//! on the server as it was before its fix.

use std::time::Duration;

use serde_json::json;

use crate::support::*;

fn id_of(r: &Resp) -> String {
    r.json()["task_id"].as_str().expect("task_id").to_string()
}

#[test]
fn queued_tasks_reach_a_new_worker_before_its_hello() {
    // Issue 10 #1: the first fill happened at the upgrade, while the worker still counted as
    // "every kind, unlimited concurrency"; the hello that follows the 101 came too late.
    let relay = Relay::start();
    let gpu: Vec<String> = (0..3)
        .map(|_| {
            let r = relay.submit(r#"{"payload":{"kind":"gpu"},"queue":true}"#);
            assert_eq!(r.status, 202, "{}", r.text());
            id_of(&r)
        })
        .collect();
    let http: Vec<String> = (0..6)
        .map(|_| {
            let r = relay.submit(r#"{"payload":{"kind":"http"},"queue":true}"#);
            assert_eq!(r.status, 202, "{}", r.text());
            id_of(&r)
        })
        .collect();
    let w = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["http"],"concurrency":1})), Auto::Manual);
    let first = w.expect_task();
    assert_eq!(first.id, http[0], "the oldest http task goes first");
    // Past the 1 s grace too: a worker of concurrency 1 holds one task, and no gpu task.
    assert!(w.no_task(Duration::from_millis(1_500)), "a second task reached a worker of concurrency 1");
    for id in &gpu {
        let t = relay.get_task(id);
        assert_eq!(t["status"], "pending", "{t}");
        assert_eq!(t["attempts"], 0, "{t}");
    }
    w.done(&first.id, json!(1));
    assert_eq!(w.expect_task().id, http[1], "capacity freed: the next http task");
}

#[test]
fn a_worker_that_never_says_hello_is_served_after_one_second() {
    let relay = Relay::start();
    let r = relay.submit(r#"{"payload":{"kind":"x"},"queue":true}"#);
    assert_eq!(r.status, 202);
    let started = std::time::Instant::now();
    let w = FakeWorker::connect(&relay, None, Auto::Manual);
    let t = w.expect_task();
    assert_eq!(t.id, id_of(&r));
    assert!(started.elapsed() >= Duration::from_millis(900), "sent before the grace: {:?}", started.elapsed());
}
