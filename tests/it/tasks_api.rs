//! The task API (SPEC §4): submit, wait, read, cancel, validation, idempotency, expiry.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::*;

fn id_of(r: &Resp) -> String {
    r.json()["task_id"].as_str().expect("task_id").to_string()
}

#[test]
fn submit_without_workers_is_503_and_stores_nothing() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let r = relay.submit(r#"{"payload":{"x":1}}"#);
        assert_eq!(r.status, 503);
        assert_eq!(r.error(), "no_worker");
        let h = request(relay.addr, "GET", "/healthz", &[], None).json();
        assert_eq!(h["tasks"]["pending"], 0);
        assert_eq!(h["tasks"]["failed"], 0);
    });
}

#[test]
fn async_submit_then_get_shows_result_and_history() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let _w = FakeWorker::connect(&relay, Some(json!({"type":"hello","version":"it"})), Auto::Echo);
        // Wait until its hello is read: nothing is sent to a worker before that.
        relay.wait_clients(1, |c| c["version"] == "it");
        let r = relay.submit(r#"{"payload":{"kind":"http","n":7}}"#);
        assert_eq!(r.status, 202, "{}", r.text());
        let v = r.json();
        assert!(v["status"] == "dispatched" || v["status"] == "done", "{v}");
        let id = id_of(&r);
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        assert_eq!(t["result"]["echo"]["n"], 7);
        assert_eq!(t["kind"], "http");
        assert_eq!(t["attempts"], 1);
        let log = t["attempt_log"].as_array().expect("log");
        assert_eq!(log.len(), 1);
        assert_eq!(log[0]["outcome"], "done");
        assert_eq!(log[0]["num"], 1);
        assert_eq!(log[0]["client_ip"], "127.0.0.1");
        assert!(log[0]["duration_ms"].is_u64());
        assert_eq!(t["client_id"], log[0]["client_id"]);
        assert_eq!(t["client_ip"], "127.0.0.1");
        for key in ["created_at", "finished_at"] {
            let s = t[key].as_str().expect(key);
            assert!(s.len() == 24 && s.ends_with('Z') && s.as_bytes()[19] == b'.', "{key}={s}");
        }
        assert!(t.get("error").is_none() && t.get("run_at").is_none(), "absent, not null: {t}");
    });
}

#[test]
fn wait_true_maps_final_status_to_http_code() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("WAIT_TIMEOUT", "500ms")]);
        let ok = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["ok"]})), Auto::Echo);
        let bad = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["bad"]})), Auto::Fail("boom".into()));
        let slow = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["slow"]})), Auto::Manual);
        relay.wait_clients(3, |c| c.get("kinds").is_some());

        let r = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":{"kind":"ok","v":1}}"#));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["result"]["echo"]["v"], 1);

        let r = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":{"kind":"bad"}}"#));
        assert_eq!(r.status, 502, "{}", r.text());
        assert_eq!(r.json()["status"], "failed");
        assert_eq!(r.json()["error"], "boom");

        let started = Instant::now();
        let r = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":{"kind":"slow"}}"#));
        assert_eq!(r.status, 202, "not final at WAIT_TIMEOUT: {}", r.text());
        assert_eq!(r.json()["status"], "dispatched");
        assert!(started.elapsed() >= Duration::from_millis(450));
        let id = id_of(&r);
        let task = slow.expect_task();

        // A canceled task answers a waiting POST... it is final already: 409 via DELETE's view.
        let d = relay.api("DELETE", &format!("/tasks/{id}"), None);
        assert_eq!(d.status, 200);
        assert_eq!(d.json()["status"], "canceled");
        assert_eq!(slow.next_cancel(Duration::from_secs(2)).as_deref(), Some(task.id.as_str()));
        drop((ok, bad));
    });
}

#[test]
fn waiting_post_gets_409_when_canceled() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let w = FakeWorker::connect(&relay, None, Auto::Manual);
        relay.wait_clients(1, |_| true);
        let addr = relay.addr;
        let waiter = std::thread::spawn(move || {
            let auth = format!("Bearer {API}");
            request(addr, "POST", "/tasks?wait=true", &[("Authorization", &auth)], Some(br#"{"payload":{"p":1}}"#))
        });
        let task = w.expect_task();
        let d = relay.api("DELETE", &format!("/tasks/{}", task.id), None);
        assert_eq!(d.status, 200);
        let r = waiter.join().expect("waiter");
        assert_eq!(r.status, 409, "{}", r.text());
        assert_eq!(r.json()["status"], "canceled");
        assert_eq!(r.json()["attempt_log"][0]["outcome"], "canceled");
        // The worker's late answer is ignored.
        w.done(&task.id, json!(1));
        assert!(
            poll_until(Duration::from_secs(2), || relay.metric("relay_results_ignored_total{reason=\"late\"}") == 1.0)
        );
        assert_eq!(relay.get_task(&task.id)["status"], "canceled");
    });
}

#[test]
fn get_with_wait_long_polls_until_final() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let w = FakeWorker::connect(&relay, None, Auto::Manual);
        relay.wait_clients(1, |_| true);
        let id = id_of(&relay.submit(r#"{"payload":"x"}"#));
        let task = w.expect_task();
        let auth = format!("Bearer {API}");
        let mut poller = Client::connect(relay.addr);
        poller.send("GET", &format!("/tasks/{id}?wait=true"), &[("Authorization", &auth)], None);
        // relay has read the GET (and holds it) before the result exists: an answer given at once
        // would show the task `dispatched`.
        relay.barrier();
        w.done(&task.id, json!({"ok": true}));
        let r = poller.read_response().expect("the long-poll's answer");
        assert_eq!(r.status, 200);
        assert_eq!(r.json()["status"], "done", "it waited for the result: {}", r.text());
        // On a final task it answers at once, and always 200.
        let r = relay.api("GET", &format!("/tasks/{id}?wait=true"), None);
        assert_eq!((r.status, r.json()["result"]["ok"].clone()), (200, json!(true)));
    });
}

#[test]
fn get_wait_times_out_with_200_and_the_current_task() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("WAIT_TIMEOUT", "300ms")]);
        let _w = FakeWorker::connect(&relay, Some(json!({"type":"hello","version":"it"})), Auto::Manual);
        // Wait until its hello is read: nothing is sent to a worker before that.
        relay.wait_clients(1, |c| c["version"] == "it");
        let id = id_of(&relay.submit(r#"{"payload":1}"#));
        let r = relay.api("GET", &format!("/tasks/{id}?wait=true"), None);
        assert_eq!(r.status, 200);
        assert_eq!(r.json()["status"], "dispatched");
        assert_eq!(r.json()["attempts"], 1);
        assert!(r.json()["attempt_log"][0].get("outcome").is_none(), "attempt in progress has no outcome");
    });
}

#[test]
fn delete_rules() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let w = FakeWorker::connect(&relay, None, Auto::Echo);
        relay.wait_clients(1, |_| true);
        let r = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":1}"#));
        let id = id_of(&r);
        let d = relay.api("DELETE", &format!("/tasks/{id}"), None);
        assert_eq!(d.status, 409, "final tasks cannot be canceled");
        assert_eq!(d.json()["status"], "done");
        let d = relay.api("DELETE", "/tasks/7c0e1b52-9a52-4c2e-8a8e-3f0a4a6b9d10", None);
        assert_eq!(d.status, 404);
        let d = relay.api("DELETE", "/tasks/..%2Fetc", None);
        assert_eq!(d.status, 404);
        drop(w);

        // A pending (queued) task is canceled without ever reaching a worker.
        let q = relay.submit(r#"{"payload":1,"queue":true,"delay":"1h"}"#);
        assert_eq!(q.status, 202);
        let qid = id_of(&q);
        assert_eq!(relay.get_task(&qid)["status"], "pending");
        let d = relay.api("DELETE", &format!("/tasks/{qid}"), None);
        assert_eq!(d.status, 200);
        assert_eq!(d.json()["status"], "canceled");
        assert_eq!(d.json()["attempts"], 0);
    });
}

#[test]
fn auth_rules() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let body = Some(br#"{"payload":1}"#.as_slice());
        for token in ["", "Bearer nope", &format!("Bearer {WRK}"), &format!("Basic {API}")] {
            let headers: Vec<(&str, &str)> = if token.is_empty() { vec![] } else { vec![("Authorization", token)] };
            let r = request(relay.addr, "POST", "/tasks", &headers, body);
            assert_eq!(r.status, 401, "token {token:?}");
            assert_eq!(r.error(), "unauthorized");
        }
        // healthz and metrics need nothing.
        assert_eq!(request(relay.addr, "GET", "/healthz", &[], None).status, 200);
        assert_eq!(request(relay.addr, "GET", "/metrics", &[], None).status, 200);
        // The API token does not open /ws.
        let r = request(relay.addr, "GET", &format!("/ws?token={API}"), &[], None);
        assert_eq!(r.status, 401);
        assert!(FakeWorker::connect_url(&format!("ws://{}/ws?token={API}", relay.addr), None, Auto::Echo).is_err());
        assert!(FakeWorker::connect_url(&format!("ws://{}/ws", relay.addr), None, Auto::Echo).is_err());
    });
}

#[test]
fn legacy_auth_token_serves_both_roles() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("API_TOKEN", ""), ("WORKER_TOKEN", ""), ("AUTH_TOKEN", "shared")]);
        let w = FakeWorker::connect_url(&format!("ws://{}/ws?token=shared", relay.addr), None, Auto::Echo).expect("ws");
        let r = request(
            relay.addr,
            "POST",
            "/tasks?wait=true",
            &[("Authorization", "Bearer shared")],
            Some(br#"{"payload":1}"#),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        drop(w);
    });
}

#[test]
fn bad_submit_bodies_are_400_with_a_reason() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let _w = FakeWorker::connect(&relay, None, Auto::Echo);
        relay.wait_clients(1, |_| true);
        let table = [
            ("", "empty body"),
            ("{", "invalid JSON"),
            ("[]", "must be a JSON object"),
            ("[{\"payload\":1}]", "must be a JSON object"),
            (r#"{"payload":null}"#, "payload is required"),
            (r#"{"nopayload":1}"#, "payload is required"),
            (r#"{"payload":{"kind":1}}"#, "payload.kind must be a string"),
            (r#"{"payload":1,"delay":"1s","run_at":"2030-01-01T00:00:00Z"}"#, "not both"),
            (r#"{"payload":1,"delay":"later"}"#, "invalid delay"),
            (r#"{"payload":1,"run_at":"2030-13-01T00:00:00Z"}"#, "invalid run_at"),
            (r#"{"payload":1,"timeout":"0s"}"#, "invalid timeout"),
            (r#"{"payload":1,"max_retries":"two"}"#, "invalid JSON"),
        ];
        for (body, why) in table {
            let r = relay.submit(body);
            assert_eq!(r.status, 400, "{body}: {}", r.text());
            assert_eq!(r.error(), "bad_request");
            let msg = r.json()["message"].as_str().unwrap_or_default().to_string();
            assert!(msg.contains(why), "{body}: {msg:?} should say {why:?}");
        }
        let long_key = "k".repeat(257);
        let auth = format!("Bearer {API}");
        let r = request(
            relay.addr,
            "POST",
            "/tasks",
            &[("Authorization", &auth), ("Idempotency-Key", &long_key)],
            Some(b"{\"payload\":1}"),
        );
        assert_eq!(r.status, 400);
    });
}

#[test]
fn idempotency_key_returns_the_first_task() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let w = FakeWorker::connect(&relay, None, Auto::Manual);
        relay.wait_clients(1, |_| true);
        let auth = format!("Bearer {API}");
        let h = [("Authorization", auth.as_str()), ("Idempotency-Key", "order-17")];
        let first = request(relay.addr, "POST", "/tasks", &h, Some(br#"{"payload":{"n":1}}"#));
        assert_eq!(first.status, 202);
        let second = request(relay.addr, "POST", "/tasks", &h, Some(br#"{"payload":{"n":2}}"#));
        assert_eq!(second.status, 202);
        assert_eq!(id_of(&first), id_of(&second));
        let task = w.expect_task();
        assert_eq!(task.payload["n"], 1);
        // The replay was answered, so relay is done with it: one task exists, not two (polled:
        // cluster mode's counts may be up to 1 s old).
        relay.wait_health(|h| h["tasks"]["dispatched"] == 1 && h["tasks"]["pending"] == 0);
        // With wait=true the replay waits on the first task.
        let mut waiter = Client::connect(relay.addr);
        waiter.send("POST", "/tasks?wait=true", &h, Some(br#"{"payload":3}"#));
        relay.barrier();
        w.done(&task.id, json!("first"));
        let r = waiter.read_response().expect("the replay's answer");
        assert_eq!(r.status, 200, "it waited for the first task's result: {}", r.text());
        assert_eq!(r.json()["task_id"], task.id.as_str());
        assert_eq!(r.json()["result"], "first");
        // A different key is a different task.
        let other = request(
            relay.addr,
            "POST",
            "/tasks",
            &[("Authorization", &auth), ("Idempotency-Key", "order-18")],
            Some(b"{\"payload\":1}"),
        );
        assert_ne!(id_of(&other), task.id);
    });
}

#[test]
fn finished_tasks_are_forgotten_after_task_ttl() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("TASK_TTL", "300ms")]);
        let _w = FakeWorker::connect(&relay, Some(json!({"type":"hello","version":"it"})), Auto::Echo);
        // Wait until its hello is read: nothing is sent to a worker before that.
        relay.wait_clients(1, |c| c["version"] == "it");
        let id = id_of(&relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":1}"#)));
        assert_eq!(relay.get_task(&id)["status"], "done");
        assert!(poll_until(Duration::from_secs(3), || relay.api("GET", &format!("/tasks/{id}"), None).status == 404));
    });
}

#[test]
fn queued_task_waits_for_a_worker_then_runs() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let r = relay.submit(r#"{"payload":{"q":1},"queue":true}"#);
        assert_eq!(r.status, 202, "{}", r.text());
        assert_eq!(r.json()["status"], "pending");
        let id = id_of(&r);
        let _w = FakeWorker::connect(&relay, None, Auto::Echo);
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        assert_eq!(t["result"]["echo"]["q"], 1);
    });
}

#[test]
fn delayed_and_scheduled_tasks_run_when_due() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let w = FakeWorker::connect(&relay, None, Auto::Echo);
        relay.wait_clients(1, |_| true);
        let started = Instant::now();
        let r = relay.submit(r#"{"payload":"later","delay":"400ms"}"#);
        assert_eq!(r.status, 202);
        assert_eq!(r.json()["status"], "pending");
        let id = id_of(&r);
        let t = relay.get_task(&id);
        assert_eq!(t["status"], "pending");
        assert!(t["run_at"].is_string());
        // Not before its time, measured here (a lower bound: a loaded machine only adds to it) and
        // by relay's own clock (the attempt started no earlier than run_at, 400 ms after creation).
        let arrived = w.expect_task();
        assert!(started.elapsed() >= Duration::from_millis(390), "dispatched after {:?}", started.elapsed());
        assert_eq!(arrived.id, id);
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        let ms = |v: &Value| relay::timefmt::parse_rfc3339_ms(v.as_str().expect("a time")).expect("RFC 3339");
        let (created, run_at, attempt) =
            (ms(&t["created_at"]), ms(&t["run_at"]), ms(&t["attempt_log"][0]["started_at"]));
        assert_eq!(run_at - created, 400, "{t}");
        // Timers run on the monotonic clock and the times shown on the wall clock, read at
        // slightly different moments of a turn: a few ms apart, never the 400 ms of the delay.
        assert!(attempt + 10 >= run_at, "started before run_at: {t}");

        // run_at in the past is due at once.
        let r = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":1,"run_at":"2001-01-01T00:00:00Z"}"#));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["run_at"], "2001-01-01T00:00:00.000Z");
    });
}

#[test]
fn max_pending_answers_429() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("MAX_PENDING", "1")]);
        assert_eq!(relay.submit(r#"{"payload":1,"queue":true}"#).status, 202);
        let r = relay.submit(r#"{"payload":2,"queue":true}"#);
        assert_eq!(r.status, 429);
        assert_eq!(r.error(), "queue_full");
    });
}

#[test]
fn pending_tasks_expire_in_queue() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("TASK_TTL", "300ms")]);
        let id = id_of(&relay.submit(r#"{"payload":1,"queue":true}"#));
        let t = relay.wait_status(&id, "failed", Duration::from_secs(3));
        assert_eq!(t["error"], "expired in queue");
        assert_eq!(t["attempts"], 0);
    });
}

#[test]
fn healthz_and_clients_report_counts() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let w = FakeWorker::connect(
            &relay,
            Some(json!({"type":"hello","kinds":["a","b"],"concurrency":3,"version":"t/1"})),
            Auto::Manual,
        );
        relay.wait_clients(1, |c| c.get("kinds").is_some());
        let c = relay.clients();
        let entry = &c["clients"][0];
        assert_eq!(entry["kinds"], json!(["a", "b"]));
        assert_eq!(entry["concurrency"], 3);
        assert_eq!(entry["active"], true);
        assert_eq!(entry["ip"], "127.0.0.1");
        assert_eq!(entry["version"], "t/1");
        assert!(entry["client_id"].as_str().is_some_and(|s| s.len() == 36));
        relay.submit(r#"{"payload":{"kind":"a"}}"#);
        let _t = w.expect_task();
        // Polled: cluster mode's task counts may be up to 1 s old (its workers' are the node's own).
        let h = relay.wait_health(|h| h["tasks"]["dispatched"] == 1);
        assert_eq!(h["status"], "ok");
        assert_eq!(h["clients"], 1);
        assert_eq!(h["active_clients"], 1);
        assert!(h["uptime_s"].is_u64());
        assert_eq!(relay.clients()["clients"][0]["in_flight"], 1);
        if mode.is_cluster() {
            assert_eq!((h["database"].as_str(), h["node"].is_string()), (Some("ok"), true), "{h}");
        }
    });
}

#[test]
fn huge_durations_are_refused_not_overflowed() {
    for_each_mode(|mode| {
        // Regression: `now + timeout` overflowed (a panic in debug builds, wrapped deadlines in
        // release builds) for a timeout near u64::MAX milliseconds.
        let relay = mode.start();
        let _w = FakeWorker::connect(&relay, None, Auto::Echo);
        relay.wait_clients(1, |_| true);
        for body in [
            r#"{"payload":1,"timeout":"18446744073709551615ms"}"#,
            r#"{"payload":1,"delay":"18446744073709551615ms"}"#,
            r#"{"payload":1,"delay":"5000000000000h"}"#,
        ] {
            let r = relay.submit(body);
            assert_eq!(r.status, 400, "{body}: {}", r.text());
            assert!(r.json()["message"].as_str().is_some_and(|m| m.contains("100 years")), "{}", r.text());
        }
        // The server is alive and well (24h is the longest timeout SPEC §4 allows).
        assert_eq!(relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":1,"timeout":"24h"}"#)).status, 200);
    });
}

#[test]
fn idempotency_keys_live_as_long_as_their_task_and_ignore_the_replayed_body() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("TASK_TTL", "1s")]);
        let auth = format!("Bearer {API}");
        let h = [("Authorization", auth.as_str()), ("Idempotency-Key", "late-run")];
        // Without a worker a plain submit is 503, and a 503 reserves nothing.
        let refused = request(relay.addr, "POST", "/tasks", &h, Some(br#"{"payload":0}"#));
        assert_eq!(refused.status, 503);
        // Delayed past TASK_TTL: the key must still name the task after a TTL has passed.
        let first = request(relay.addr, "POST", "/tasks", &h, Some(br#"{"payload":1,"delay":"3s"}"#));
        assert_eq!(first.status, 202, "the 503 did not reserve the key: {}", first.text());
        // A TASK_TTL passes (by relay's clock): a queued task submitted after `first` expires.
        let marker = id_of(&relay.submit(r#"{"payload":2,"queue":true}"#));
        let expired = relay.wait_status(&marker, "failed", Duration::from_secs(5));
        assert_eq!(expired["error"], "expired in queue");
        // The replay's body is not even parsed (its payload is not compared).
        let again = request(relay.addr, "POST", "/tasks", &h, Some(br#"{"payload":null}"#));
        assert_eq!(again.status, 202, "{}", again.text());
        assert_eq!(id_of(&again), id_of(&first));
    });
}

/// Found by schemathesis: `wait=yes` (or any value but true/1) was silently taken as "don't
/// wait", so a caller expecting the final task got a 202 instead.
#[test]
fn a_misspelt_wait_value_is_400_not_silently_ignored() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let id = relay.submit(r#"{"payload":1,"queue":true}"#).json()["task_id"].as_str().expect("id").to_string();
        for path in ["/tasks?wait=yes".to_string(), format!("/tasks/{id}?wait=AAA"), "/tasks?wait=".into()] {
            let method = if path == format!("/tasks/{id}?wait=AAA") { "GET" } else { "POST" };
            let r = relay.api(method, &path, Some(r#"{"payload":1,"queue":true}"#).filter(|_| method == "POST"));
            assert_eq!((r.status, r.error().as_str()), (400, "bad_request"), "{method} {path}: {}", r.text());
        }
        assert_eq!(relay.api("GET", &format!("/tasks/{id}?wait=false"), None).status, 200);
        assert_eq!(relay.api("GET", "/healthz?wait=whatever", None).status, 200, "other routes ignore it");
        assert_eq!(relay.get_task(&id)["status"], "pending");
        // Polled: cluster mode's counts may be up to 1 s old; the refused submits stored nothing.
        relay.wait_health(|h| h["tasks"]["pending"] == 1);
    });
}

/// Found by schemathesis (also issue 10 #10): a `payload.kind` over 128 bytes was accepted.
#[test]
fn a_kind_over_128_bytes_is_400_not_accepted() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let r = relay.submit(&format!(r#"{{"payload":{{"kind":"{}"}},"queue":true}}"#, "k".repeat(129)));
        assert_eq!((r.status, r.error().as_str()), (400, "bad_request"), "{}", r.text());
        let r = relay.submit(&format!(r#"{{"payload":{{"kind":"{}"}},"queue":true}}"#, "k".repeat(128)));
        assert_eq!(r.status, 202, "{}", r.text());
    });
}
