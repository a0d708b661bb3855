//! The link: hello, reconnects after a worker or relay restart, wss:// through a TLS proxy,
//! what the worker answers to tasks relay would never route to it, and the policy for results
//! whose connection is gone.

use std::time::Duration;

use serde_json::json;

use crate::support::fake_relay::FakeRelay;
use crate::support::target::{Reply, Target};
use crate::support::tls_proxy::TlsProxy;
use crate::support::{Relay, WRK, Worker, poll_until};

#[test]
fn hello_announces_kinds_concurrency_and_version_and_token_is_sent() {
    let fake = FakeRelay::start();
    let worker = Worker::start(&fake.ws_url(), &[("CONCURRENCY", "3")]);
    let mut conn = fake.accept(Duration::from_secs(10)).expect("worker connects");
    assert_eq!(conn.uri, format!("/ws?token={WRK}"));
    let hello = conn.recv(Duration::from_secs(5)).expect("hello first");
    assert_eq!(hello["type"], "hello");
    assert_eq!(hello["kinds"], json!(["echo", "file", "http"]));
    assert_eq!(hello["concurrency"], 3);
    assert!(hello["version"].as_str().is_some_and(|v| v.starts_with("relay-worker/")), "{hello}");
    assert!(!worker.proc.log_text().contains(WRK), "the token never appears in logs");
}

/// relay routes by the kinds in `hello`, so it never sends this worker an unknown kind (it
/// answers 503 instead); a relay that did gets `failed` / `unknown task kind: <kind>`.
#[test]
fn unknown_kind_fails() {
    crate::require_relay!();
    let relay = Relay::start();
    let worker = Worker::start(&relay.ws_url(), &[]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |_| true);
    let (status, body) = relay.api("POST", "/tasks", Some(r#"{"payload":{"kind":"nope","spec":{}}}"#));
    assert_eq!((status, body["error"].as_str()), (503, Some("no_worker")), "{body}");

    let fake = FakeRelay::start();
    let _worker = Worker::start(&fake.ws_url(), &[]);
    let mut conn = fake.accept(Duration::from_secs(10)).expect("worker connects");
    conn.recv_type("hello", Duration::from_secs(5)).expect("hello");
    conn.send(&json!({"type": "task", "task_id": "t-1", "payload": {"kind": "nope", "spec": {}}}));
    let result = conn.recv_type("result", Duration::from_secs(5)).expect("a result");
    assert_eq!(
        result,
        json!({"type": "result", "task_id": "t-1", "status": "failed", "error": "unknown task kind: nope"})
    );
}

#[test]
fn restarted_worker_connects_by_itself() {
    crate::require_relay!();
    let relay = Relay::start();
    let mut worker = Worker::start(&relay.ws_url(), &[]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |_| true);
    let first = relay.clients()["clients"][0]["client_id"].clone();
    worker.proc.kill();
    // Killed without a close frame: relay holds its session for RESUME_WINDOW (SPEC §12),
    // listed inactive, and a new process (a new WORKER_ID) is a new worker.
    relay.wait_clients(1, Duration::from_secs(5), |c| c["active"] == false && c["resumable_until"].is_string());

    let worker = Worker::start(&relay.ws_url(), &[]);
    worker.wait_connected();
    relay.wait_clients(2, Duration::from_secs(5), |c| c["client_id"] != first || c["active"] == false);
    let target = Target::start(|_, _| Reply::json(200, &json!({"ok": true})));
    let task = relay.run_task(json!({"kind": "http", "spec": {"url": target.url("/")}}));
    assert_eq!(task["status"], "done", "{task}");
}

#[test]
fn restarted_relay_is_reconnected() {
    crate::require_relay!();
    let relay = Relay::start();
    let port = relay.addr.port();
    let worker = Worker::start(&relay.ws_url(), &[]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |_| true);

    drop(relay); // SIGKILL: no close frame, the socket just dies.
    assert!(worker.proc.wait_log("msg=disconnected", Duration::from_secs(5)), "{}", worker.proc.log_text());
    let relay = Relay::start_on(port);
    relay.wait_clients(1, Duration::from_secs(10), |c| c["active"] == true);
    // (relay may list the worker a moment before its own log line reaches us.)
    let twice = poll_until(Duration::from_secs(5), || worker.proc.count_log("msg=connected") == 2);
    assert!(twice, "{}", worker.proc.log_text());

    let target = Target::start(|_, _| Reply::json(200, &json!({"again": true})));
    let task = relay.run_task(json!({"kind": "http", "spec": {"url": target.url("/")}}));
    assert_eq!(task["result"]["body"], json!({"again": true}), "{task}");
}

#[test]
fn wss_through_a_tls_proxy_trusting_ca_file() {
    crate::require_relay!();
    let relay = Relay::start();
    let proxy = TlsProxy::start(relay.addr);
    let url = format!("wss://localhost:{}/ws", proxy.addr.port());

    // Without CA_FILE the self-signed certificate is refused: the worker never gets in.
    let untrusting = Worker::start(&url, &[]);
    assert!(
        untrusting.proc.wait_log("msg=\"connect failed\"", Duration::from_secs(10)),
        "{}",
        untrusting.proc.log_text()
    );
    assert!(untrusting.proc.log_text().contains("certificate"), "{}", untrusting.proc.log_text());
    assert_eq!(relay.clients()["count"], 0);
    drop(untrusting);

    let ca = proxy.ca_file.to_str().expect("path").to_string();
    let worker = Worker::start(&url, &[("CA_FILE", &ca)]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |c| c["kinds"] == json!(["echo", "file", "http"]));
    let target = Target::start(|_, _| Reply::json(200, &json!({"via": "wss"})));
    let task = relay.run_task(json!({"kind": "http", "spec": {"url": target.url("/")}}));
    assert_eq!(task["result"]["body"], json!({"via": "wss"}), "{task}");
}

/// A task whose connection dropped still runs to the end, but its result is not sent on the
/// next connection (relay would count it `unknown`): it is dropped with a log line.
#[test]
fn result_of_a_lost_connection_is_dropped_not_sent_on_the_next() {
    let target = Target::start(|_, _| Reply::After(Duration::from_millis(600), Box::new(Reply::new(200, &[], "x"))));
    let fake = FakeRelay::start();
    let worker = Worker::start(&fake.ws_url(), &[]);
    let mut conn = fake.accept(Duration::from_secs(10)).expect("worker connects");
    conn.recv_type("hello", Duration::from_secs(5)).expect("hello");
    conn.send(
        &json!({"type": "task", "task_id": "slow-1", "payload": {"kind": "http", "spec": {"url": target.url("/")}}}),
    );
    assert!(crate::support::poll_until(Duration::from_secs(5), || target.hit_count() == 1), "task started");
    conn.cut();

    let mut again = fake.accept(Duration::from_secs(10)).expect("worker reconnects");
    again.recv_type("hello", Duration::from_secs(5)).expect("hello again");
    assert!(
        worker.proc.wait_log("msg=\"result dropped\" task_id=slow-1", Duration::from_secs(5)),
        "{}",
        worker.proc.log_text()
    );
    // A task sent now is answered at once (unknown kind); the first result on the new
    // connection must be its, not the old connection's.
    again.send(&json!({"type": "task", "task_id": "marker", "payload": {"kind": "nope"}}));
    let first = again.recv_type("result", Duration::from_secs(5)).expect("the marker's result");
    assert_eq!(first["task_id"], "marker", "nothing of the old connection is sent on the new one: {first}");
}

#[test]
fn wrong_token_is_final_exit_2_naming_token() {
    crate::require_relay!();
    let relay = Relay::start();
    let mut worker = Worker::start(&relay.ws_url(), &[("TOKEN", "not-the-token")]);
    let status = worker.proc.wait_exit(Duration::from_secs(10));
    let log = worker.proc.log_text();
    assert_eq!(status.and_then(|s| s.code()), Some(2), "a 401 on connect ends the worker with 2:\n{log}");
    assert!(log.contains("relay-worker: relay refused the worker token: set TOKEN to relay's WORKER_TOKEN"), "{log}");
    assert!(log.contains("HTTP 401"), "{log}");
    assert_eq!(worker.proc.count_log("msg=\"token refused\""), 1, "one try, no retry:\n{log}");
    assert!(!log.contains("retry_in_ms="), "no retry is scheduled:\n{log}");
    assert!(!log.contains("not-the-token"), "the token never appears in logs");
    assert_eq!(relay.clients()["count"], 0);
}

/// relay starts refusing the token while a task runs (its token was changed, say): the task
/// still runs to its end, and then the worker stops with 2 instead of retrying forever.
#[test]
fn token_refused_on_reconnect_lets_the_running_task_finish_then_exits_2() {
    let target =
        Target::start(|_, _| Reply::After(Duration::from_millis(1500), Box::new(Reply::json(200, &json!({})))));
    let fake = FakeRelay::start();
    let mut worker = Worker::start(&fake.ws_url(), &[]);
    let mut conn = fake.accept(Duration::from_secs(10)).expect("worker connects");
    conn.recv_type("hello", Duration::from_secs(5)).expect("hello");
    conn.send(
        &json!({"type": "task", "task_id": "t-1", "payload": {"kind": "http", "spec": {"url": target.url("/slow")}}}),
    );
    assert!(poll_until(Duration::from_secs(10), || target.hits.lock().expect("hits").len() == 1), "the task started");
    conn.cut();

    let request = fake.refuse_next(401, Duration::from_secs(10)).expect("the worker tries again once");
    assert!(request.starts_with("GET /ws?token="), "{request}");
    let status = worker.proc.wait_exit(Duration::from_secs(15));
    let log = worker.proc.log_text();
    assert_eq!(status.and_then(|s| s.code()), Some(2), "{log}");
    let refused = log.find("msg=\"token refused\"").expect("token refused logged");
    let finished = log.find("msg=\"result dropped\" task_id=t-1").expect("the running task finished");
    let stopped = log.find("msg=stopped reason=drained").expect("stopped after draining");
    assert!(refused < finished && finished < stopped, "refused, then the task ended, then the worker stopped:\n{log}");
    assert!(fake.refuse_next(401, Duration::from_millis(300)).is_none(), "no further try");
}

/// A relay that stops reading (so the worker's ping gets no pong, and nothing else arrives)
/// is given up on after the silence limit, and the worker connects again.
#[test]
fn silent_relay_is_treated_as_dead() {
    use relay_worker::{Config, Worker as LibWorker};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let fake = FakeRelay::start();
    let mut config = Config::new(&fake.ws_url(), WRK).expect("config");
    config.idle_ping_ms = 100;
    config.dead_after_ms = 400;
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let running = std::thread::spawn(move || LibWorker::new(config).run_until(&flag));

    let mut first = fake.accept(Duration::from_secs(10)).expect("worker connects");
    first.recv_type("hello", Duration::from_secs(5)).expect("hello");
    let silent_since = std::time::Instant::now();
    // `first` is kept open but never read again: no pong, no frames.
    let mut second =
        fake.accept(Duration::from_secs(5)).expect("the worker gives up on the silent relay and reconnects");
    assert!(silent_since.elapsed() >= Duration::from_millis(350), "not before the silence limit");
    second.recv_type("hello", Duration::from_secs(5)).expect("hello on the new connection");
    drop(first);

    stop.store(true, Ordering::SeqCst);
    assert!(crate::support::poll_until(Duration::from_secs(5), || running.is_finished()));
    assert_eq!(running.join().expect("no panic"), Ok(()));
}
