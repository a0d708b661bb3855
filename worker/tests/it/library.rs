//! The library in-process against the real relay: custom kinds, and a panicking handler that
//! fails only its own task.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use relay_worker::{Config, Error, Worker};
use serde_json::{Value, json};

use crate::support::{Relay, WRK, poll_until};

#[test]
fn panicking_handler_fails_only_its_task() {
    crate::require_relay!();
    let relay = Relay::start();
    let mut config = Config::new(&relay.ws_url(), WRK).expect("config");
    config.concurrency = 2;
    let mut worker = Worker::new(config);
    worker.register("boom", |_, _| panic!("kaboom"));
    worker.register("echo", |task_id, spec| {
        let spec: Value = serde_json::from_str(spec.get())?;
        Ok(json!({"task_id": task_id, "spec": spec}))
    });
    worker.register("refuse", |_, _| Err(Error::new("not today")));
    assert_eq!(worker.kinds(), ["boom", "echo", "refuse"]);
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let running = std::thread::spawn(move || worker.run_until(&flag));

    relay.wait_clients(1, Duration::from_secs(5), |c| c["kinds"] == json!(["boom", "echo", "refuse"]));
    let client_id = relay.clients()["clients"][0]["client_id"].clone();

    let task = relay.run_task(json!({"kind": "boom"}));
    assert_eq!(task["status"], "failed", "{task}");
    assert_eq!(task["error"], "handler panicked: kaboom");

    let task = relay.run_task(json!({"kind": "refuse"}));
    assert_eq!((task["status"].as_str(), task["error"].as_str()), (Some("failed"), Some("not today")), "{task}");

    // The same worker, on the same connection, still runs tasks: on both of its threads.
    for n in 0..4 {
        let task = relay.run_task(json!({"kind": "echo", "spec": {"n": n}}));
        assert_eq!(task["status"], "done", "{task}");
        assert_eq!(task["result"], json!({"task_id": task["task_id"], "spec": {"n": n}}));
        assert_eq!(task["client_id"], client_id);
    }
    assert_eq!(relay.clients()["count"], 1);

    stop.store(true, Ordering::SeqCst);
    assert!(poll_until(Duration::from_secs(5), || running.is_finished()), "run_until returns after stop");
    assert_eq!(running.join().expect("no panic escaped"), Ok(()));
    relay.wait_clients(0, Duration::from_secs(5), |_| true);
}
