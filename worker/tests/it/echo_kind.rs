//! The echo kind end to end: relay → relay-worker → the spec back as the result, with nothing
//! else running (no target, no network): the README's first task.

use std::time::Duration;

use serde_json::json;

use crate::support::{Relay, Worker};

#[test]
fn echo_task_returns_its_spec_and_a_task_without_spec_returns_null() {
    crate::require_relay!();
    let relay = Relay::start();
    let worker = Worker::start(&relay.ws_url(), &[]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |c| c["kinds"] == json!(["echo", "file", "http"]));

    let spec = json!({"text": "hello", "n": [1, 2.5, true, null], "nested": {"k": "ü"}});
    let task = relay.run_task(json!({"kind": "echo", "spec": spec}));
    assert_eq!(task["status"], "done", "{task}");
    assert_eq!(task["result"], spec, "{task}");
    assert_eq!(task["attempts"], 1, "{task}");

    let task = relay.run_task(json!({"kind": "echo"}));
    assert_eq!(task["status"], "done", "{task}");
    assert_eq!(task["result"], serde_json::Value::Null, "{task}");
}
