//! Worker sessions (SPEC §12): a lost connection's attempts are held for RESUME_WINDOW and a
//! worker that resumes its session takes them back; a blip costs no attempt. Connections are cut
//! by a loopback proxy (no close frame), as a NAT or a restarting proxy cuts them. Every test
//! runs in both modes: the hold is the one core's, on the node the worker was connected to.

use std::time::Duration;

use serde_json::{Value, json};

use crate::support::proxy::Proxy;
use crate::support::*;

fn id_of(r: &Resp) -> String {
    assert_eq!(r.status, 202, "{}", r.text());
    r.json()["task_id"].as_str().expect("task_id").to_string()
}

fn outcomes(t: &Value) -> Vec<String> {
    t["attempt_log"].as_array().expect("log").iter().map(|a| a["outcome"].as_str().unwrap_or("-").to_string()).collect()
}

fn hello(worker_id: &str) -> Value {
    json!({"type": "hello", "worker_id": worker_id, "version": "it"})
}

fn resume(worker_id: &str, session: &Value, running: Value) -> Value {
    json!({"type": "hello", "worker_id": worker_id, "session": session, "running": running, "version": "it"})
}

/// Waits until `/clients` lists one held session (inactive, with `resumable_until`).
fn wait_held(relay: &Relay) -> Value {
    let mut last = Value::Null;
    let held = poll_until(Duration::from_secs(5), || {
        last = relay.clients();
        last["clients"]
            .as_array()
            .is_some_and(|c| c.iter().any(|w| w["active"] == false && w["resumable_until"].is_string()))
    });
    assert!(held, "no held session listed: {last}\n{}", worker_losses(&relay.log_text()));
    last
}

fn wait_metric(relay: &Relay, series: &str, value: f64) {
    let ok = poll_until(Duration::from_secs(5), || relay.metric(series) == value);
    assert!(ok, "{series} never became {value}: {}", relay.metric(series));
}

#[test]
fn a_cut_connection_resumes_and_the_task_runs_once() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("RESUME_WINDOW", "5s")]);
        let proxy = Proxy::start(relay.addr);
        let a = FakeWorker::connect_url(&proxy.ws_url(), Some(hello("w-blip")), Auto::Manual).expect("connects");
        let welcome = a.expect_welcome();
        assert_eq!(welcome["resume_window_ms"], 5000, "{welcome}");
        assert_eq!(welcome["adopted"], json!([]));
        assert_eq!(welcome["abandon"], json!([]));
        let secret = welcome["session"].clone();
        assert!(secret.as_str().is_some_and(|s| s.len() >= 32), "at least 128 bits: {welcome}");
        let client_id = welcome["client_id"].clone();
        relay.wait_clients(1, |c| c["version"] == "it" && c["client_id"] == client_id);

        let id = id_of(&relay.submit(r#"{"payload":{"n":1}}"#));
        let task = a.expect_task();
        assert_eq!(
            (task.id.as_str(), task.attempt),
            (id.as_str(), Some(1)),
            "a session's task frame carries the attempt"
        );

        proxy.cut();
        let clients = wait_held(&relay);
        let w = &clients["clients"][0];
        assert_eq!((w["client_id"].clone(), w["in_flight"].clone()), (client_id.clone(), json!(1)), "{clients}");
        wait_metric(&relay, "relay_attempts_held", 1.0);
        let t = relay.get_task(&id);
        assert_eq!((t["status"].as_str(), t["attempts"].as_u64()), (Some("dispatched"), Some(1)), "held: {t}");

        let b = FakeWorker::connect_url(
            &proxy.ws_url(),
            Some(resume("w-blip", &secret, json!([{"task_id": id, "attempt": 1}]))),
            Auto::Manual,
        )
        .expect("reconnects");
        let welcome = b.expect_welcome();
        assert_eq!(welcome["client_id"], client_id, "a resume keeps the client id: {welcome}");
        assert_eq!(welcome["adopted"], json!([id]), "{welcome}");
        assert_eq!(welcome["abandon"], json!([]), "{welcome}");
        b.done_attempt(&id, 1, json!({"ok": true}));
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        assert_eq!(t["attempts"], 1, "one attempt: {t}");
        assert_eq!(t["attempt_log"][0]["resumes"], 1, "{t}");
        assert_eq!(t["attempt_log"][0]["outcome"], "done", "{t}");
        assert_eq!(t["client_id"], client_id, "{t}");
        assert_eq!(t["result"], json!({"ok": true}));
        assert_eq!(relay.metric("relay_sessions_resumed_total"), 1.0);
        assert_eq!(relay.metric("relay_attempts_adopted_total"), 1.0);
        assert_eq!(relay.metric("relay_attempts_held"), 0.0);
        assert_eq!(relay.metric("relay_attempts_total{outcome=\"disconnect\"}"), 0.0);
        relay.wait_clients(1, |c| {
            c["active"] == true && c["client_id"] == client_id && c.get("resumable_until").is_none()
        });
        drop((a, b, proxy));
    });
}

#[test]
fn a_worker_silent_past_pong_wait_is_held_and_resumes() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("RESUME_WINDOW", "5s")]);
        let a = FakeWorker::connect(&relay, Some(hello("w-silent")), Auto::Manual);
        let secret = a.expect_welcome()["session"].clone();
        relay.wait_clients(1, |c| c["version"] == "it");
        let id = id_of(&relay.submit(r#"{"payload":2}"#));
        assert_eq!(a.expect_task().id, id);
        // Silence: relay closes it after PONG_WAIT (1 s), and holds its attempt.
        a.freeze();
        wait_held(&relay);
        let b = FakeWorker::connect(
            &relay,
            Some(resume("w-silent", &secret, json!([{"task_id": id, "attempt": 1}]))),
            Auto::Manual,
        );
        assert_eq!(b.expect_welcome()["adopted"], json!([id]));
        b.done(&id, json!("late but fine"));
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        assert_eq!(outcomes(&t), ["done"], "{t}");
        drop((a, b));
    });
}

#[test]
fn a_worker_not_back_within_the_window_is_retried_elsewhere() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("RESUME_WINDOW", "800ms")]);
        let proxy = Proxy::start(relay.addr);
        let a = FakeWorker::connect_url(&proxy.ws_url(), Some(hello("w-gone")), Auto::Manual).expect("connects");
        let a_id = a.expect_welcome()["client_id"].clone();
        relay.wait_clients(1, |c| c["version"] == "it");
        let id = id_of(&relay.submit(r#"{"payload":3}"#));
        assert_eq!(a.expect_task().id, id);
        let c = FakeWorker::connect(&relay, Some(json!({"type": "hello", "version": "other"})), Auto::Echo);
        relay.wait_clients(2, |_| true);
        proxy.cut();
        wait_held(&relay);
        // Held: not retried on the idle worker while the window is open.
        assert_eq!(relay.get_task(&id)["attempts"], 1);
        let t = relay.wait_status(&id, "done", Duration::from_secs(8));
        assert_eq!(outcomes(&t), ["disconnect", "done"], "{t}");
        assert_eq!(t["attempt_log"][0]["client_id"], a_id);
        assert_eq!(t["attempt_log"][0]["error"], "worker disconnected");
        assert_ne!(t["client_id"], a_id);
        assert_eq!(relay.metric("relay_attempts_held"), 0.0);
        // The session is gone: its worker id and secret no longer resume anything.
        relay.wait_clients(1, |w| w["version"] == "other");
        drop((a, c, proxy));
    });
}

#[test]
fn a_worker_id_without_the_secret_gets_a_new_session_and_never_takes_over() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("RESUME_WINDOW", "1500ms")]);
        let proxy = Proxy::start(relay.addr);
        let a = FakeWorker::connect_url(&proxy.ws_url(), Some(hello("w-same")), Auto::Manual).expect("connects");
        let first = a.expect_welcome();
        relay.wait_clients(1, |c| c["version"] == "it");
        let id = id_of(&relay.submit(r#"{"payload":4}"#));
        assert_eq!(a.expect_task().id, id);
        proxy.cut();
        wait_held(&relay);
        let running = json!([{"task_id": id, "attempt": 1}]);
        // No secret, then a wrong one: each a new session of its own.
        let b = FakeWorker::connect(
            &relay,
            Some(json!({"type":"hello","worker_id":"w-same","running":running,"version":"b"})),
            Auto::Echo,
        );
        let wb = b.expect_welcome();
        let forged = json!("0".repeat(64));
        let c = FakeWorker::connect(&relay, Some(resume("w-same", &forged, running.clone())), Auto::Echo);
        let wc = c.expect_welcome();
        for w in [&wb, &wc] {
            assert_ne!(w["client_id"], first["client_id"], "{w}");
            assert_ne!(w["session"], first["session"], "{w}");
            assert_eq!(w["adopted"], json!([]), "{w}");
            assert_eq!(w["abandon"], json!([id]), "{w}");
        }
        assert_ne!(wb["session"], wc["session"]);
        // Its result for the task it does not hold is ignored; the held attempt stays held.
        b.done_attempt(&id, 1, json!("not mine"));
        assert!(poll_until(Duration::from_secs(5), || relay.metric("relay_results_ignored_total{reason=\"unknown\"}")
            >= 1.0));
        let t = relay.get_task(&id);
        assert_eq!((t["status"].as_str(), t["attempts"].as_u64()), (Some("dispatched"), Some(1)), "{t}");
        // The window passes: the task runs on another worker (b or c), never on a's session.
        let t = relay.wait_status(&id, "done", Duration::from_secs(8));
        assert_eq!(outcomes(&t), ["disconnect", "done"], "{t}");
        assert_ne!(t["client_id"], first["client_id"]);
        assert_ne!(t["result"], json!("not mine"));
        drop((a, b, c, proxy));
    });
}

#[test]
fn a_close_frame_or_an_empty_running_list_frees_the_attempts_at_once() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("RESUME_WINDOW", "60s")]);
        let proxy = Proxy::start(relay.addr);
        let other = FakeWorker::connect(&relay, Some(json!({"type": "hello", "kinds": ["x"]})), Auto::Echo);
        relay.wait_clients(1, |_| true);

        // A close frame: the worker is stopping; nothing is held.
        let a = FakeWorker::connect(
            &relay,
            Some(json!({"type":"hello","worker_id":"w-close","kinds":["k"]})),
            Auto::Manual,
        );
        a.expect_welcome();
        relay.wait_clients(2, |_| true);
        let id = id_of(&relay.submit(r#"{"payload":{"kind":"k"}}"#));
        assert_eq!(a.expect_task().id, id);
        let other2 = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["k"]})), Auto::Echo);
        relay.wait_clients(3, |_| true);
        a.close();
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        assert_eq!(outcomes(&t), ["disconnect", "done"], "{t}");

        // A resume that runs nothing (the worker restarted): its held attempts end at once.
        let b = FakeWorker::connect_url(
            &proxy.ws_url(),
            Some(json!({"type":"hello","worker_id":"w-restart","kinds":["k"]})),
            Auto::Manual,
        )
        .expect("connects");
        let secret = b.expect_welcome()["session"].clone();
        drop(other2);
        relay.wait_clients(2, |_| true);
        let id = id_of(&relay.submit(r#"{"payload":{"kind":"k"}}"#));
        assert_eq!(b.expect_task().id, id);
        let other3 = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["k"]})), Auto::Echo);
        relay.wait_clients(3, |_| true);
        proxy.cut();
        wait_held(&relay);
        let b2 = FakeWorker::connect(
            &relay,
            Some(json!({"type":"hello","worker_id":"w-restart","session":secret,"running":[],"kinds":["k"]})),
            Auto::Manual,
        );
        let w = b2.expect_welcome();
        assert_eq!((w["adopted"].clone(), w["abandon"].clone()), (json!([]), json!([])), "{w}");
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        assert_eq!(outcomes(&t), ["disconnect", "done"], "{t}");
        assert_eq!(t["attempt_log"][0]["error"], "worker no longer runs this task", "{t}");
        assert_eq!(relay.metric("relay_attempts_held"), 0.0);
        drop((other, other3, a, b, b2, proxy));
    });
}

#[test]
fn a_result_naming_another_attempt_is_ignored_and_a_hello_without_worker_id_gets_no_welcome() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let plain = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["plain"]})), Auto::Manual);
        let a = FakeWorker::connect(
            &relay,
            Some(json!({"type":"hello","worker_id":"w-fence","kinds":["s"]})),
            Auto::Manual,
        );
        assert_eq!(a.expect_welcome()["resume_window_ms"], 10000, "RESUME_WINDOW defaults to 10s");
        relay.wait_clients(2, |_| true);

        let id = id_of(&relay.submit(r#"{"payload":{"kind":"plain"}}"#));
        let t = plain.expect_task();
        assert_eq!((t.id.as_str(), t.attempt), (id.as_str(), None), "no session, no attempt field");
        assert!(plain.next_other(Duration::ZERO).is_none(), "no welcome without worker_id (it would precede the task)");
        plain.done(&id, json!(1));
        relay.wait_status(&id, "done", Duration::from_secs(5));

        let id = id_of(&relay.submit(r#"{"payload":{"kind":"s"}}"#));
        assert_eq!(a.expect_task().attempt, Some(1));
        a.done_attempt(&id, 2, json!("wrong attempt"));
        assert!(
            poll_until(Duration::from_secs(5), || relay.metric("relay_results_ignored_total{reason=\"late\"}") == 1.0)
        );
        assert_eq!(relay.get_task(&id)["status"], "dispatched");
        a.done_attempt(&id, 1, json!("right attempt"));
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        assert_eq!(t["result"], "right attempt");
        drop((plain, a));
    });
}

#[test]
fn resume_window_0s_holds_nothing() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("RESUME_WINDOW", "0s")]);
        let proxy = Proxy::start(relay.addr);
        let a = FakeWorker::connect_url(&proxy.ws_url(), Some(hello("w-zero")), Auto::Manual).expect("connects");
        assert_eq!(a.expect_welcome()["resume_window_ms"], 0);
        relay.wait_clients(1, |_| true);
        let id = id_of(&relay.submit(r#"{"payload":5}"#));
        assert_eq!(a.expect_task().id, id);
        let c = FakeWorker::connect(&relay, Some(json!({"type": "hello", "version": "other"})), Auto::Echo);
        relay.wait_clients(2, |_| true);
        proxy.cut();
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        assert_eq!(outcomes(&t), ["disconnect", "done"], "{t}");
        drop((a, c, proxy));
    });
}

#[test]
fn a_bad_resume_window_is_a_startup_error_naming_it() {
    let (code, _out, err) = run_relay_env(&[], &[("WORKER_TOKEN", WRK), ("API_TOKEN", API), ("RESUME_WINDOW", "soon")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("RESUME_WINDOW"), "{err}");
}

#[test]
fn a_resume_before_relay_noticed_the_loss_takes_the_session_over() {
    for_each_mode(|mode| {
        // PONG_WAIT far beyond the test: relay still thinks the first connection is alive.
        let relay = mode.start_with(&[("RESUME_WINDOW", "5s"), ("PING_INTERVAL", "20s"), ("PONG_WAIT", "60s")]);
        let a = FakeWorker::connect(&relay, Some(hello("w-early")), Auto::Manual);
        let welcome = a.expect_welcome();
        relay.wait_clients(1, |c| c["version"] == "it");
        let id = id_of(&relay.submit(r#"{"payload":6}"#));
        assert_eq!(a.expect_task().id, id);
        a.freeze();
        let b = FakeWorker::connect(
            &relay,
            Some(resume("w-early", &welcome["session"], json!([{"task_id": id, "attempt": 1}]))),
            Auto::Manual,
        );
        let w = b.expect_welcome();
        assert_eq!((w["client_id"].clone(), w["adopted"].clone()), (welcome["client_id"].clone(), json!([id])), "{w}");
        // The old connection no longer counts as the worker: one client, active.
        relay.wait_clients(1, |c| c["active"] == true && c["client_id"] == welcome["client_id"]);
        b.done_attempt(&id, 1, json!("from the new connection"));
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        assert_eq!((t["attempts"].as_u64(), t["attempt_log"][0]["resumes"].as_u64()), (Some(1), Some(1)), "{t}");
        drop((a, b));
    });
}

// ----- relay restarts (single node: the journal keeps the sessions' attempts) ------------------

/// A DATA_DIR of the test's own, removed on drop.
struct DataDir(std::path::PathBuf);

impl DataDir {
    fn new(tag: &str) -> DataDir {
        DataDir(std::env::temp_dir().join(format!("relay-it-sessions-{tag}-{}", uuid::Uuid::new_v4().simple())))
    }
    fn path(&self) -> &str {
        self.0.to_str().expect("utf-8 temp path")
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A session worker runs a task, relay stops (`how`: KILL or TERM) and starts again on the same
/// DATA_DIR; returns the new relay, the task, and the worker's welcome.
fn running_at_restart(dir: &DataDir, how: &str, window: &str) -> (Relay, String, Value, FakeWorker) {
    // (MAX_RETRIES=0: a retry after a restart's loss must not need one.)
    let env = [("DATA_DIR", dir.path()), ("RESUME_WINDOW", window), ("MAX_RETRIES", "0")];
    let mut relay = Relay::start_with(&env);
    let a = FakeWorker::connect(&relay, Some(hello("w-restart")), Auto::Manual);
    let welcome = a.expect_welcome();
    relay.wait_clients(1, |c| c["version"] == "it");
    let id = id_of(&relay.submit(r#"{"payload":{"n":7}}"#));
    assert_eq!(a.expect_task().id, id);
    // (A read shows what is durable: the attempt's start is on disk.)
    relay.wait_status(&id, "dispatched", Duration::from_secs(5));
    relay.signal(how);
    if how == "TERM" {
        let msg = a.next_other(Duration::from_secs(5)).expect("a frame before the close");
        assert_eq!(msg["type"], "reconnect", "SIGTERM tells session workers to reconnect: {msg}");
    }
    let status = relay.wait_exit(Duration::from_secs(10)).expect("relay exits");
    if how == "TERM" {
        assert!(status.success(), "{status:?}");
    }
    let relay = Relay::start_with(&env);
    (relay, id, welcome, a)
}

#[test]
fn after_kill_9_a_running_attempt_is_held_and_the_worker_resumes_it() {
    let dir = DataDir::new("kill");
    let (relay, id, welcome, _a) = running_at_restart(&dir, "KILL", "5s");
    let t = relay.get_task(&id);
    assert_eq!((t["status"].as_str(), t["attempts"].as_u64()), (Some("dispatched"), Some(1)), "held: {t}");
    let clients = wait_held(&relay);
    assert_eq!(clients["clients"][0]["client_id"], welcome["client_id"], "{clients}");
    assert_eq!(relay.metric("relay_attempts_held"), 1.0);
    let b = FakeWorker::connect(
        &relay,
        Some(resume("w-restart", &welcome["session"], json!([{"task_id": id, "attempt": 1}]))),
        Auto::Manual,
    );
    let w = b.expect_welcome();
    assert_eq!((w["client_id"].clone(), w["adopted"].clone()), (welcome["client_id"].clone(), json!([id])), "{w}");
    b.done_attempt(&id, 1, json!("after the crash"));
    let t = relay.wait_status(&id, "done", Duration::from_secs(5));
    assert_eq!((t["attempts"].as_u64(), t["attempt_log"][0]["resumes"].as_u64()), (Some(1), Some(1)), "{t}");
    assert_eq!(t["result"], "after the crash");
    assert_eq!(relay.metric("relay_sessions_resumed_total"), 1.0);
}

#[test]
fn after_sigterm_the_worker_is_told_to_reconnect_and_resumes() {
    let dir = DataDir::new("term");
    let (relay, id, welcome, _a) = running_at_restart(&dir, "TERM", "5s");
    let b = FakeWorker::connect(
        &relay,
        Some(resume("w-restart", &welcome["session"], json!([{"task_id": id, "attempt": 1}]))),
        Auto::Manual,
    );
    assert_eq!(b.expect_welcome()["adopted"], json!([id]));
    b.done_attempt(&id, 1, json!("after the restart"));
    let t = relay.wait_status(&id, "done", Duration::from_secs(5));
    assert_eq!(outcomes(&t), ["done"], "one attempt: {t}");
}

#[test]
fn after_a_restart_a_worker_not_back_within_the_window_is_retried_without_using_a_retry() {
    let dir = DataDir::new("expire");
    let (relay, id, welcome, _a) = running_at_restart(&dir, "KILL", "700ms");
    let c = FakeWorker::connect(&relay, Some(json!({"type": "hello", "version": "other"})), Auto::Echo);
    let t = relay.wait_status(&id, "done", Duration::from_secs(8));
    assert_eq!(outcomes(&t), ["disconnect", "done"], "{t}");
    assert_eq!(t["attempt_log"][0]["client_id"], welcome["client_id"]);
    assert_eq!(t["attempt_log"][0]["error"], "relay restarted while this attempt was running", "{t}");
    drop(c);
}

/// Found by issue 20's hostile probe: a session worker's task frame left before its attempt's
/// start was durable (the journal holds such records up to 2 ms, then syncs). relay killed in
/// that window read the task back `pending`: the resuming worker's attempt was not held, its
/// welcome said `abandon`, and the task ran again — as attempt 1 a second time (9 of 10 kills
/// right after the frame, in a probe). Now the frame waits for the start to be on disk.
#[test]
fn a_kill_9_right_after_a_task_frame_left_still_lets_the_worker_resume_it() {
    for round in 0..8 {
        let dir = DataDir::new("frame");
        let env = [("DATA_DIR", dir.path()), ("RESUME_WINDOW", "5s")];
        let mut relay = Relay::start_with(&env);
        // Queued before the worker is there: its hello starts the attempt, the frame follows.
        let id = id_of(&relay.submit(&json!({"payload": {"round": round}, "queue": true}).to_string()));
        let a = FakeWorker::connect(&relay, Some(hello("w-frame")), Auto::Manual);
        let welcome = a.expect_welcome();
        let task = a.expect_task();
        assert_eq!(task.id, id);
        relay.kill_now();
        assert!(relay.wait_exit(Duration::from_secs(5)).is_some(), "relay died");
        let relay = Relay::start_with(&env);
        let b = FakeWorker::connect(
            &relay,
            Some(resume("w-frame", &welcome["session"], json!([{"task_id": id, "attempt": task.attempt}]))),
            Auto::Manual,
        );
        let w = b.expect_welcome();
        assert_eq!((w["adopted"].clone(), w["abandon"].clone()), (json!([id]), json!([])), "round {round}: {w}");
        b.done_attempt(&id, 1, json!("once"));
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        assert_eq!(outcomes(&t), ["done"], "round {round}: one attempt: {t}");
        drop((a, b));
    }
}

/// Found by issue 20's audit: relay-worker forgets a result once the pong to the ping it sent
/// after it comes back (it kept it for a resume until then). relay answered that ping as soon as
/// it had read it, before the result's record was durable: killed then, relay read the attempt
/// back as running, held it for a worker that no longer listed it, and ran the task again. Now
/// what relay says to a session worker after its messages had something written waits for the
/// journal, pongs included.
#[test]
fn a_pong_after_a_result_means_the_result_survives_a_kill_9() {
    for round in 0..8 {
        let dir = DataDir::new("pong");
        let env = [("DATA_DIR", dir.path()), ("RESUME_WINDOW", "5s")];
        let relay = Relay::start_with(&env);
        let a = FakeWorker::connect(&relay, Some(hello("w-pong")), Auto::Manual);
        a.expect_welcome();
        relay.wait_clients(1, |c| c["version"] == "it");
        let id = id_of(&relay.submit(r#"{"payload":"pong"}"#));
        assert_eq!(a.expect_task().id, id);
        relay.wait_status(&id, "dispatched", Duration::from_secs(5));
        a.done_attempt(&id, 1, json!("kept"));
        a.ping();
        let pong = a.next_other(Duration::from_secs(5)).expect("a pong");
        assert_eq!(pong["type"], "pong", "{pong}");
        relay.kill_now();
        let mut relay = relay;
        assert!(relay.wait_exit(Duration::from_secs(5)).is_some(), "relay died");
        let relay = Relay::start_with(&env);
        let t = relay.get_task(&id);
        assert_eq!(
            (t["status"].as_str(), outcomes(&t)),
            (Some("done"), vec!["done".to_string()]),
            "round {round}: {t}"
        );
        drop(a);
    }
}

#[test]
fn resume_window_0s_restarts_as_before() {
    let dir = DataDir::new("zero");
    let (relay, id, _welcome, _a) = running_at_restart(&dir, "KILL", "0s");
    let t = relay.wait_status(&id, "pending", Duration::from_secs(5));
    assert_eq!(outcomes(&t), ["disconnect"], "{t}");
    assert_eq!(relay.metric("relay_attempts_held"), 0.0);
}

// ----- cluster mode: sessions live in the database -----------------------------------------------

/// Two nodes on one database (`None`: PostgreSQL is missing, the test is skipped).
fn two_nodes(test: &str, env: &[(&str, &str)]) -> Option<(Relay, Relay)> {
    if let Err(why) = crate::support::pg::shared() {
        skip_or_fail(test, &format!("the cluster tests need PostgreSQL: {why}"));
        return None;
    }
    let a = Mode::Cluster.start_with(env);
    let b = Mode::start_on(a.db.clone().expect("a cluster node's database"), env);
    Some((a, b))
}

/// Waits until the database knows the session of the task's running attempt.
fn wait_session_row(relay: &Relay, id: &str) {
    let db = relay.db.as_ref().expect("database");
    let named = poll_until(Duration::from_secs(5), || {
        db.query(&format!("SELECT count(*) FROM relay_running WHERE task_id = '{id}' AND session IS NOT NULL")) == ["1"]
    });
    assert!(named, "the running attempt never named its session");
    // (And its start, written 200 ms behind: the attempt_log entry names the worker.)
    let started = poll_until(Duration::from_secs(5), || {
        db.query(&format!("SELECT coalesce(attempt_log -> 0 ->> 'client_id', '') FROM relay_tasks WHERE id = '{id}'"))
            .first()
            .is_some_and(|c| !c.is_empty())
    });
    assert!(started, "the attempt's start was never written");
}

#[test]
fn cluster_a_worker_resumes_on_another_node_after_its_node_was_killed() {
    resumes_on_another_node("cluster_a_worker_resumes_on_another_node_after_its_node_was_killed", "KILL");
}

#[test]
fn cluster_a_worker_resumes_on_another_node_after_its_node_stopped_with_sigterm() {
    resumes_on_another_node("cluster_a_worker_resumes_on_another_node_after_its_node_stopped_with_sigterm", "TERM");
}

fn resumes_on_another_node(test: &str, how: &str) {
    let env = [("RESUME_WINDOW", "10s")];
    let Some((mut a, b)) = two_nodes(test, &env) else {
        return;
    };
    let w = FakeWorker::connect(&a, Some(hello("w-node")), Auto::Manual);
    let welcome = w.expect_welcome();
    a.wait_clients(1, |c| c["version"] == "it");
    b.wait_clients(1, |c| c["version"] == "it");
    let id = id_of(&b.submit(r#"{"payload":{"n":8}}"#));
    assert_eq!(w.expect_task().id, id);
    wait_session_row(&a, &id);
    a.signal(how);
    if how == "TERM" {
        let msg = w.next_other(Duration::from_secs(5)).expect("a frame before the close");
        assert_eq!(msg["type"], "reconnect", "{msg}");
    }
    assert!(a.wait_exit(Duration::from_secs(10)).is_some(), "the node stopped");

    let w2 = FakeWorker::connect(
        &b,
        Some(resume("w-node", &welcome["session"], json!([{"task_id": id, "attempt": 1}]))),
        Auto::Manual,
    );
    let wb = w2.expect_welcome();
    assert_eq!((wb["client_id"].clone(), wb["adopted"].clone()), (welcome["client_id"].clone(), json!([id])), "{wb}");
    assert_eq!(wb["session"], welcome["session"], "the same session, on another node");
    w2.done_attempt(&id, 1, json!("resumed elsewhere"));
    let t = b.wait_status(&id, "done", Duration::from_secs(5));
    assert_eq!((t["attempts"].as_u64(), t["attempt_log"][0]["resumes"].as_u64()), (Some(1), Some(1)), "{t}");
    assert_eq!(t["result"], "resumed elsewhere");
    assert_eq!(b.metric("relay_sessions_resumed_total"), 1.0);
}

#[test]
fn cluster_a_blip_resumes_on_another_live_node_and_the_first_one_lets_go() {
    let env = [("RESUME_WINDOW", "1500ms")];
    let Some((a, b)) = two_nodes("cluster_a_blip_resumes_on_another_live_node_and_the_first_one_lets_go", &env) else {
        return;
    };
    let proxy = Proxy::start(a.addr);
    let w = FakeWorker::connect_url(&proxy.ws_url(), Some(hello("w-lb")), Auto::Manual).expect("connects");
    let welcome = w.expect_welcome();
    a.wait_clients(1, |c| c["version"] == "it");
    let id = id_of(&a.submit(r#"{"payload":{"n":9}}"#));
    assert_eq!(w.expect_task().id, id);
    wait_session_row(&a, &id);
    proxy.cut();
    // (The load balancer sends the reconnect to the other node.)
    let w2 = FakeWorker::connect(
        &b,
        Some(resume("w-lb", &welcome["session"], json!([{"task_id": id, "attempt": 1}]))),
        Auto::Manual,
    );
    assert_eq!(w2.expect_welcome()["adopted"], json!([id]));
    w2.done_attempt(&id, 1, json!("once"));
    let t = b.wait_status(&id, "done", Duration::from_secs(5));
    assert_eq!(outcomes(&t), ["done"], "{t}");
    // The first node's window passes: what it still held is no longer its, nothing changes.
    wait_metric(&a, "relay_attempts_held", 0.0);
    let t = a.get_task(&id);
    assert_eq!((t["status"].as_str(), t["attempts"].as_u64()), (Some("done"), Some(1)), "{t}");
    drop((w, w2, proxy));
}

#[test]
fn cluster_a_lost_nodes_session_attempt_is_retried_once_its_window_is_over() {
    let env = [("RESUME_WINDOW", "2s")];
    let Some((mut a, b)) = two_nodes("cluster_a_lost_nodes_session_attempt_is_retried_once_its_window_is_over", &env)
    else {
        return;
    };
    let w = FakeWorker::connect(&a, Some(hello("w-lost")), Auto::Manual);
    let welcome = w.expect_welcome();
    a.wait_clients(1, |c| c["version"] == "it");
    let id = id_of(&a.submit(r#"{"payload":{"n":10}}"#));
    assert_eq!(w.expect_task().id, id);
    wait_session_row(&a, &id);
    a.signal("KILL");
    assert!(a.wait_exit(Duration::from_secs(5)).is_some(), "the node died");
    let other = FakeWorker::connect(&b, Some(json!({"type": "hello", "version": "other"})), Auto::Echo);
    let t = b.wait_status(&id, "done", Duration::from_secs(20));
    assert_eq!(outcomes(&t), ["disconnect", "done"], "{t}");
    assert_eq!(t["attempt_log"][0]["client_id"], welcome["client_id"]);
    drop(other);
}

#[test]
fn the_dashboard_shows_held_sessions() {
    let relay = Relay::start();
    let js = request(relay.addr, "GET", "/ui/app.js", &[], None);
    assert_eq!(js.status, 200);
    assert!(js.text().contains("w.resumable_until ? 'held until '"), "the workers table shows a held session");
}

/// Found by the restart benchmark: a SIGTERM hands the running attempts of workers without a
/// session back to pending; as every worker then left, the store failed those tasks as
/// unplaceable ("worker disconnected") instead of keeping them for the next run.
#[test]
fn after_sigterm_a_task_handed_back_waits_for_the_next_run() {
    let dir = DataDir::new("handback");
    let env = [("DATA_DIR", dir.path())];
    let mut relay = Relay::start_with(&env);
    let a = FakeWorker::connect(&relay, Some(json!({"type": "hello", "version": "plain"})), Auto::Manual);
    relay.wait_clients(1, |c| c["version"] == "plain");
    let id = id_of(&relay.submit(r#"{"payload":11}"#));
    assert_eq!(a.expect_task().id, id);
    relay.signal("TERM");
    assert!(relay.wait_exit(Duration::from_secs(10)).is_some_and(|s| s.success()));
    let relay = Relay::start_with(&env);
    let t = relay.get_task(&id);
    assert_eq!(t["status"], "pending", "handed back, not failed: {t}");
    let b = FakeWorker::connect(&relay, None, Auto::Echo);
    relay.wait_status(&id, "done", Duration::from_secs(5));
    drop((a, b));
}

/// The node name a cluster node reports in `/healthz`.
fn node_name(relay: &Relay) -> String {
    relay.api("GET", "/healthz", None).json()["node"].as_str().expect("node").to_string()
}

#[test]
fn cluster_a_worker_that_blips_to_another_node_and_back_delivers_on_the_first_one() {
    // A worker on A blips to B (B takes its attempts from the database) and, within A's window,
    // back to A — which still holds the session from the first blip. A must take back from the
    // database what B holds now (the first task, and one B sent meanwhile) before it adopts:
    // else A's writes about them are fenced (the result lost) and B's window retries them.
    let env = [("RESUME_WINDOW", "20s")];
    let Some((a, b)) =
        two_nodes("cluster_a_worker_that_blips_to_another_node_and_back_delivers_on_the_first_one", &env)
    else {
        return;
    };
    let proxy = Proxy::start(a.addr);
    let w = FakeWorker::connect_url(&proxy.ws_url(), Some(hello("w-aba")), Auto::Manual).expect("connects");
    let secret = w.expect_welcome()["session"].clone();
    a.wait_clients(1, |c| c["version"] == "it");
    let first = id_of(&a.submit(r#"{"payload":{"n":1}}"#));
    assert_eq!(w.expect_task().id, first);
    wait_session_row(&a, &first);
    proxy.cut();
    wait_held(&a);

    proxy.retarget(b.addr);
    let w2 = FakeWorker::connect_url(
        &proxy.ws_url(),
        Some(resume("w-aba", &secret, json!([{"task_id": first, "attempt": 1}]))),
        Auto::Manual,
    )
    .expect("reconnects to B");
    assert_eq!(w2.expect_welcome()["adopted"], json!([first]));
    let active = poll_until(Duration::from_secs(5), || {
        b.clients()["clients"].as_array().is_some_and(|c| c.iter().any(|w| w["active"] == true))
    });
    assert!(active, "the worker is active on B");
    let second = id_of(&b.submit(r#"{"payload":{"n":2}}"#));
    assert_eq!(w2.expect_task().id, second);
    wait_session_row(&b, &second);
    proxy.cut();
    wait_held(&b);

    proxy.retarget(a.addr);
    let w3 = FakeWorker::connect_url(
        &proxy.ws_url(),
        Some(resume("w-aba", &secret, json!([{"task_id": first, "attempt": 1}, {"task_id": second, "attempt": 1}]))),
        Auto::Manual,
    )
    .expect("reconnects to A");
    let welcome = w3.expect_welcome();
    let mut adopted: Vec<String> =
        welcome["adopted"].as_array().expect("adopted").iter().map(|v| v.as_str().expect("id").to_string()).collect();
    adopted.sort();
    let mut both = vec![first.clone(), second.clone()];
    both.sort();
    assert_eq!((adopted, welcome["abandon"].clone()), (both, json!([])), "back on A: {welcome}");
    w3.done_attempt(&first, 1, json!("first"));
    w3.done_attempt(&second, 1, json!("second"));
    for (id, result) in [(&first, "first"), (&second, "second")] {
        let t = a.wait_status(id, "done", Duration::from_secs(5));
        assert_eq!((outcomes(&t), t["result"].clone()), (vec!["done".to_string()], json!(result)), "{t}");
    }
    // B's window passes: what it held is no longer its, nothing changes.
    wait_metric(&b, "relay_attempts_held", 0.0);
    for id in [&first, &second] {
        let t = a.get_task(id);
        assert_eq!((t["status"].as_str(), t["attempts"].as_u64()), (Some("done"), Some(1)), "{t}");
    }
    drop((w, w2, w3, proxy));
}

#[test]
fn cluster_a_resumed_worker_is_listed_once_under_the_node_it_resumed_on() {
    let env = [("RESUME_WINDOW", "4s")];
    let Some((a, b)) = two_nodes("cluster_a_resumed_worker_is_listed_once_under_the_node_it_resumed_on", &env) else {
        return;
    };
    let proxy = Proxy::start(a.addr);
    let w = FakeWorker::connect_url(&proxy.ws_url(), Some(hello("w-row")), Auto::Manual).expect("connects");
    let welcome = w.expect_welcome();
    let client_id = welcome["client_id"].clone();
    a.wait_clients(1, |c| c["version"] == "it");
    let id = id_of(&a.submit(r#"{"payload":{"n":3}}"#));
    assert_eq!(w.expect_task().id, id);
    wait_session_row(&a, &id);
    proxy.cut();
    wait_held(&a);
    let w2 = FakeWorker::connect(
        &b,
        Some(resume("w-row", &welcome["session"], json!([{"task_id": id, "attempt": 1}]))),
        Auto::Manual,
    );
    assert_eq!(w2.expect_welcome()["client_id"], client_id);
    let b_name = node_name(&b);
    let listed_once_on_b = |relay: &Relay| {
        let mut last = Value::Null;
        let ok = poll_until(Duration::from_secs(5), || {
            last = relay.clients();
            let mine: Vec<&Value> =
                last["clients"].as_array().expect("clients").iter().filter(|c| c["client_id"] == client_id).collect();
            mine.len() == 1 && mine[0]["node"] == b_name.as_str() && mine[0]["active"] == true
        });
        assert!(ok, "the resumed worker is listed once, active, on {b_name}: {last}");
    };
    // (While A's window is still open: A holds the session, the worker is B's.)
    listed_once_on_b(&b);
    listed_once_on_b(&a);
    // A's window passes (it let go of the session): the worker is still B's, in every list.
    wait_metric(&a, "relay_attempts_held", 0.0);
    poll_until(Duration::from_secs(5), || {
        !a.clients()["clients"].as_array().expect("clients").iter().any(|c| c["resumable_until"].is_string())
    });
    listed_once_on_b(&a);
    listed_once_on_b(&b);
    drop((w, w2, proxy));
}

#[test]
fn a_worker_id_with_a_nul_byte_is_a_session_like_any_other() {
    // SPEC §11: relay checks values before they reach the database. A worker id is the
    // worker's text; one with U+0000 (which PostgreSQL's text refuses) must neither fail the
    // node's transactions nor lose its session. A presented secret with one is no secret.
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("RESUME_WINDOW", "5s")]);
        let proxy = Proxy::start(relay.addr);
        let a = FakeWorker::connect_url(&proxy.ws_url(), Some(hello("w\u{0}nul")), Auto::Manual).expect("connects");
        let secret = a.expect_welcome()["session"].clone();
        relay.wait_clients(1, |c| c["version"] == "it");
        let id = id_of(&relay.submit(r#"{"payload":{"n":"nul"}}"#));
        assert_eq!(a.expect_task().id, id);
        if relay.db.is_some() {
            wait_session_row(&relay, &id);
        }
        let stranger =
            FakeWorker::connect(&relay, Some(resume("w-other", &json!("bad\u{0}secret"), json!([]))), Auto::Echo);
        assert_eq!(stranger.expect_welcome()["adopted"], json!([]), "a secret with U+0000 is none relay issued");
        proxy.cut();
        wait_held(&relay);
        let b = FakeWorker::connect_url(
            &proxy.ws_url(),
            Some(resume("w\u{0}nul", &secret, json!([{"task_id": id, "attempt": 1}]))),
            Auto::Manual,
        )
        .expect("reconnects");
        assert_eq!(b.expect_welcome()["adopted"], json!([id]));
        b.done_attempt(&id, 1, json!("nul ok"));
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        assert_eq!(outcomes(&t), ["done"], "{t}");
        // The node's other work goes on (on the stranger, which echoes).
        drop(b);
        let other = id_of(&relay.submit(r#"{"payload":{"n":"after"},"wait":false}"#));
        let t = relay.wait_status(&other, "done", Duration::from_secs(5));
        assert_eq!(t["status"], "done", "{t}");
        assert_eq!(relay.api("GET", "/healthz", None).status, 200);
        drop((a, stranger, proxy));
    });
}

#[test]
fn cluster_a_held_session_is_listed_with_resumable_until_on_every_node() {
    let env = [("RESUME_WINDOW", "20s")];
    let Some((a, b)) = two_nodes("cluster_a_held_session_is_listed_with_resumable_until_on_every_node", &env) else {
        return;
    };
    let proxy = Proxy::start(a.addr);
    let w = FakeWorker::connect_url(&proxy.ws_url(), Some(hello("w-seen")), Auto::Manual).expect("connects");
    let client_id = w.expect_welcome()["client_id"].clone();
    a.wait_clients(1, |c| c["version"] == "it");
    proxy.cut();
    wait_held(&a);
    let mut last = Value::Null;
    let seen = poll_until(Duration::from_secs(5), || {
        last = b.clients();
        last["clients"].as_array().is_some_and(|c| {
            c.iter().any(|w| w["client_id"] == client_id && w["active"] == false && w["resumable_until"].is_string())
        })
    });
    assert!(seen, "the other node lists the held session: {last}");
    drop((w, proxy));
}

#[test]
fn a_connection_whose_session_resumed_on_another_is_closed() {
    // Two live connections present one session (a half-open old connection, or a copied
    // secret): the later one has it; the earlier is no worker any more and is closed (1008),
    // not left open with its hellos unanswered.
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("RESUME_WINDOW", "5s")]);
        let a = FakeWorker::connect(&relay, Some(hello("w-twice")), Auto::Manual);
        let welcome = a.expect_welcome();
        relay.wait_clients(1, |c| c["version"] == "it");
        let id = id_of(&relay.submit(r#"{"payload":{"n":"twice"}}"#));
        assert_eq!(a.expect_task().id, id);
        let b = FakeWorker::connect(
            &relay,
            Some(resume("w-twice", &welcome["session"], json!([{"task_id": id, "attempt": 1}]))),
            Auto::Manual,
        );
        assert_eq!(b.expect_welcome()["adopted"], json!([id]));
        assert_eq!(a.wait_closed(Duration::from_secs(5)), Some(Some(1008)), "the superseded connection is closed");
        b.done_attempt(&id, 1, json!("b"));
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        assert_eq!(outcomes(&t), ["done"], "{t}");
        relay.wait_clients(1, |c| c["active"] == true && c["client_id"] == welcome["client_id"]);
        drop((a, b));
    });
}

/// Found by issue 20's hostile probe, the cluster half of
/// `a_kill_9_right_after_a_task_frame_left_still_lets_the_worker_resume_it`: the row naming a
/// session attempt's session (`SESSION_ATTEMPTS`) was written by the turn's transaction after
/// the task frame had left. A node killed before that COMMIT left the attempt unnamed: the
/// worker's resume on another node found nothing (`abandon`), and the lease retried the task —
/// it ran twice (8 of 16 kills right after the frame, in probes on a PostgreSQL with fsync on).
/// Here a trigger makes naming the session take 1.5 s, so the kill lands inside that window
/// every time; now the frame waits for the row's COMMIT.
#[test]
fn cluster_a_node_killed_right_after_a_task_frame_left_still_lets_the_worker_resume_on_another() {
    let test = "cluster_a_node_killed_right_after_a_task_frame_left_still_lets_the_worker_resume_on_another";
    let env = [("RESUME_WINDOW", "10s")];
    let Some((mut a, b)) = two_nodes(test, &env) else {
        return;
    };
    let db = a.db.clone().expect("database");
    db.query(
        "CREATE FUNCTION slow_session_rows() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
           IF NEW.session IS DISTINCT FROM OLD.session THEN PERFORM pg_sleep(1.5); END IF; RETURN NEW; END $$;
         CREATE TRIGGER slow_session_rows BEFORE UPDATE ON relay_running
           FOR EACH ROW EXECUTE FUNCTION slow_session_rows();",
    );
    let id = id_of(&a.submit(r#"{"payload":{"n":"frame"},"queue":true}"#));
    let w = FakeWorker::connect(&a, Some(hello("w-row-frame")), Auto::Manual);
    let welcome = w.expect_welcome();
    let task = w.expect_task();
    assert_eq!(task.id, id);
    a.kill_now();
    assert!(a.wait_exit(Duration::from_secs(5)).is_some(), "node A died");
    let w2 = FakeWorker::connect(
        &b,
        Some(resume("w-row-frame", &welcome["session"], json!([{"task_id": id, "attempt": task.attempt}]))),
        Auto::Manual,
    );
    let wb = w2.expect_welcome();
    assert_eq!((wb["adopted"].clone(), wb["abandon"].clone()), (json!([id]), json!([])), "{wb}");
    w2.done_attempt(&id, 1, json!("once"));
    let t = b.wait_status(&id, "done", Duration::from_secs(5));
    assert_eq!(outcomes(&t), ["done"], "one attempt: {t}");
    drop((w, w2, db));
}

#[test]
fn cluster_a_dead_nodes_held_attempt_is_retried_when_its_timeout_is_over_not_its_window() {
    // SPEC §12: a held attempt's TASK_TIMEOUT keeps running. Its node died; the worker never
    // comes back; the window (60 s) is far longer than the task's timeout (1 s): the task goes
    // on after the lease, not after the window.
    let env = [("RESUME_WINDOW", "60s")];
    let Some((mut a, b)) =
        two_nodes("cluster_a_dead_nodes_held_attempt_is_retried_when_its_timeout_is_over_not_its_window", &env)
    else {
        return;
    };
    let w = FakeWorker::connect(&a, Some(hello("w-gone")), Auto::Manual);
    w.expect_welcome();
    a.wait_clients(1, |c| c["version"] == "it");
    let id = id_of(&a.submit(r#"{"payload":{"n":11},"timeout":"1s"}"#));
    assert_eq!(w.expect_task().id, id);
    wait_session_row(&a, &id);
    a.signal("KILL");
    assert!(a.wait_exit(Duration::from_secs(5)).is_some(), "the node died");
    let other = FakeWorker::connect(&b, Some(json!({"type": "hello", "version": "other"})), Auto::Echo);
    // (The lease is PONG_WAIT + 5 s = 6 s here.)
    let t = b.wait_status(&id, "done", Duration::from_secs(20));
    assert_eq!(outcomes(&t), ["disconnect", "done"], "{t}");
    drop((w, other));
}

/// Issue 20's done-when, cluster half: the real relay-worker runs a slow `http` task through a
/// loopback proxy on node A; A is killed with `kill -9` mid-task and the proxy sends the
/// worker's reconnect to node B, where it resumes its session (taken from the database): the
/// task ends `done` after one attempt and the target saw one request. (The single-node half,
/// a relay restarted on its journal, is relay-worker's it sessions::a_relay_killed_mid_task...)
#[test]
fn cluster_a_real_worker_resumes_on_another_node_after_its_node_was_killed() {
    use crate::support::real_worker::{self, RealWorker};
    use crate::support::target::{Reply, Target};
    let test = "cluster_a_real_worker_resumes_on_another_node_after_its_node_was_killed";
    if let Err(why) = real_worker::bin() {
        skip_or_fail(test, &format!("relay-worker could not be built: {why}"));
        return;
    }
    let env = [("RESUME_WINDOW", "10s"), ("TASK_TIMEOUT", "20s")];
    let Some((mut a, b)) = two_nodes(test, &env) else {
        return;
    };
    let target =
        Target::start(|_, _| Reply::After(Duration::from_millis(2000), Box::new(Reply::new(200, &[], "once"))));
    let proxy = Proxy::start(a.addr);
    let worker = RealWorker::start(&format!("ws://{}/ws", proxy.addr), &[("HTTP_TIMEOUT", "10s")]);
    a.wait_clients(1, |c| c["active"] == true);
    b.wait_clients(1, |c| c["active"] == true);
    let spec = json!({"payload": {"kind": "http", "spec": {"url": target.url("/slow")}}});
    let id = id_of(&b.submit(&spec.to_string()));
    assert!(poll_until(Duration::from_secs(5), || target.hit_count() == 1), "the task started");
    wait_session_row(&a, &id);

    proxy.retarget(b.addr);
    a.signal("KILL");
    assert!(a.wait_exit(Duration::from_secs(5)).is_some(), "node A died");
    let t = b.wait_task(&id, Duration::from_secs(20), |t| matches!(t["status"].as_str(), Some("done" | "failed")));
    assert_eq!(t["status"], "done", "{t}\nworker:\n{}\nB:\n{}", worker.log_text(), worker_losses(&b.log_text()));
    assert_eq!(outcomes(&t), ["done"], "one attempt: {t}");
    assert_eq!(t["attempt_log"][0]["resumes"], 1, "{t}");
    assert_eq!(t["result"]["body"], "once", "{t}");
    assert_eq!(target.hit_count(), 1, "the target saw one request");
    assert_eq!(b.metric("relay_sessions_resumed_total"), 1.0);
    assert!(proxy.accepted() >= 2, "the worker reconnected through the proxy");
    drop((worker, proxy));
}

#[test]
fn a_worker_id_is_1_to_128_bytes_else_there_is_no_session() {
    // SPEC §12: 1–128 UTF-8 bytes; outside that, no session (the seed protocol: no welcome,
    // task frames without `attempt`). The task frame is the marker: a welcome comes before it.
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("RESUME_WINDOW", "5s")]);
        let max = "é".repeat(64); // 128 bytes, 64 characters
        let over = format!("{max}x");
        for (id, session) in [("", false), (over.as_str(), false), (max.as_str(), true), ("w", true)] {
            let w = FakeWorker::connect(&relay, Some(hello(id)), Auto::Manual);
            relay.wait_clients(1, |c| c["version"] == "it" && c["active"] == true);
            let task_id = id_of(&relay.submit(r#"{"payload":"len"}"#));
            let task = w.expect_task();
            assert_eq!(task.id, task_id);
            let welcome = w.next_other(Duration::ZERO);
            assert_eq!(welcome.is_some(), session, "worker_id of {} bytes: {welcome:?}", id.len());
            assert_eq!(task.attempt.is_some(), session, "worker_id of {} bytes", id.len());
            w.done_attempt(&task_id, 1, json!(1));
            relay.wait_status(&task_id, "done", Duration::from_secs(5));
            w.close();
            assert!(w.wait_closed(Duration::from_secs(5)).is_some(), "closed");
            relay.wait_clients(0, |_| true);
        }
    });
}

#[test]
fn a_held_attempts_timeout_keeps_running_and_a_late_resume_is_told_to_abandon_it() {
    // SPEC §12: held attempts are "not ended, not retried, their TASK_TIMEOUT still running".
    // (The cluster half of a dead node: cluster_a_dead_nodes_held_attempt_is_retried_when...)
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("RESUME_WINDOW", "30s"), ("MAX_RETRIES", "0")]);
        let proxy = Proxy::start(relay.addr);
        let a = FakeWorker::connect_url(&proxy.ws_url(), Some(hello("w-slow")), Auto::Manual).expect("connects");
        let secret = a.expect_welcome()["session"].clone();
        relay.wait_clients(1, |c| c["version"] == "it");
        let id = id_of(&relay.submit(r#"{"payload":"slow","timeout":"1s"}"#));
        assert_eq!(a.expect_task().id, id);
        proxy.cut();
        wait_held(&relay);
        let t = relay.wait_task(&id, Duration::from_secs(5), |t| t["status"] == "failed");
        assert_eq!(outcomes(&t), ["timeout"], "its timeout ran while it was held: {t}");
        wait_metric(&relay, "relay_attempts_held", 0.0);
        let b = FakeWorker::connect_url(
            &proxy.ws_url(),
            Some(resume("w-slow", &secret, json!([{"task_id": id, "attempt": 1}]))),
            Auto::Manual,
        )
        .expect("reconnects");
        let w = b.expect_welcome();
        assert_eq!((w["adopted"].clone(), w["abandon"].clone()), (json!([]), json!([id])), "{w}");
        b.done_attempt(&id, 1, json!("too late"));
        wait_metric(&relay, "relay_results_ignored_total{reason=\"late\"}", 1.0);
        let t = relay.get_task(&id);
        assert_eq!((t["status"].as_str(), outcomes(&t)), (Some("failed"), vec!["timeout".to_string()]), "{t}");
        drop((a, b, proxy));
    });
}

/// Cluster: what a node says to a session worker after a result — its pong included — waits
/// until the result's end is committed, as on one node it waits for the journal: a worker
/// forgets a result once a pong says relay read it, so a node dying then must not lose it.
/// Here the database refuses the end until the test lets it: no pong meanwhile; once the end
/// commits, the pong comes and the task is done. Before, the pong left at once, before the end
/// was written (a node killed then read the attempt back as running, for a worker that no
/// longer listed it, and the task ran again).
#[test]
fn cluster_a_pong_after_a_result_waits_until_the_result_is_committed() {
    let test = "cluster_a_pong_after_a_result_waits_until_the_result_is_committed";
    let env = [("RESUME_WINDOW", "10s")];
    let Some((a, _b)) = two_nodes(test, &env) else {
        return;
    };
    let db = a.db.clone().expect("database");
    db.query(
        "CREATE TABLE refuse_ends (x int);
         CREATE FUNCTION refuse_ends() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
           IF NEW.status = 'done' AND EXISTS (SELECT 1 FROM refuse_ends) THEN
             RAISE EXCEPTION 'refused by the test'; END IF; RETURN NEW; END $$;
         CREATE TRIGGER refuse_ends BEFORE UPDATE ON relay_tasks FOR EACH ROW EXECUTE FUNCTION refuse_ends();
         INSERT INTO refuse_ends VALUES (1);",
    );
    let w = FakeWorker::connect(&a, Some(hello("w-pong-c")), Auto::Manual);
    w.expect_welcome();
    let id = id_of(&a.submit(r#"{"payload":{"n":"pong"},"queue":true}"#));
    let task = w.expect_task();
    assert_eq!(task.id, id);
    a.wait_status(&id, "dispatched", Duration::from_secs(5));
    w.done_attempt(&id, 1, json!("kept"));
    w.ping();
    assert!(w.next_other(Duration::from_millis(1_500)).is_none(), "a pong before the result was committed");
    db.query("DELETE FROM refuse_ends");
    let pong = w.next_other(Duration::from_secs(5)).expect("a pong once the end committed");
    assert_eq!(pong["type"], "pong", "{pong}");
    let t = a.get_task(&id);
    assert_eq!((t["status"].as_str(), outcomes(&t)), (Some("done"), vec!["done".to_string()]), "{t}");
    drop((w, db));
}
