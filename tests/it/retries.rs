//! Retries (SPEC §13): backoff with full jitter, waiting as `pending` with `waiting_on:
//! "backoff"` and `next_attempt_at` (across a restart too), `any_worker`, a worker's permanent
//! (`"retry": false`) and paced (`"retry_after_ms"`) failures. Both modes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::worker::TaskMsg;
use crate::support::*;

fn ms(v: &Value) -> u64 {
    relay::timefmt::parse_rfc3339_ms(v.as_str().unwrap_or_else(|| panic!("a time, got {v}"))).expect("RFC 3339")
}

fn id_of(r: &Resp) -> String {
    assert_eq!(r.status, 202, "{}", r.text());
    r.json()["task_id"].as_str().expect("task_id").to_string()
}

fn outcomes(t: &Value) -> Vec<String> {
    t["attempt_log"].as_array().expect("log").iter().map(|a| a["outcome"].as_str().unwrap_or("-").to_string()).collect()
}

/// From the end of attempt `i` (0-based) to the start of the next, in ms.
fn gap_after(t: &Value, i: usize) -> u64 {
    let a = &t["attempt_log"][i];
    let end = ms(&a["started_at"]) + a["duration_ms"].as_u64().expect("duration");
    ms(&t["attempt_log"][i + 1]["started_at"]).saturating_sub(end)
}

/// The first task any of `workers` receives within `within`, and which worker got it.
fn first_task(workers: &[&FakeWorker], within: Duration) -> Option<(usize, TaskMsg)> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        for (i, w) in workers.iter().enumerate() {
            if let Some(t) = w.next_task(Duration::from_millis(5)) {
                return Some((i, t));
            }
        }
    }
    None
}

fn fail_with(w: &FakeWorker, id: &str, extra: Value) {
    let mut msg = json!({"type": "result", "task_id": id, "status": "failed", "error": "upstream down"});
    if let (Some(m), Some(e)) = (msg.as_object_mut(), extra.as_object()) {
        m.extend(e.clone());
    }
    w.send(msg.to_string());
}

#[test]
fn a_retry_waits_out_a_jittered_backoff_as_pending_and_within_its_bounds() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let hello = json!({"type":"hello","kinds":["k"]});
        let bad = FakeWorker::connect(&relay, Some(hello.clone()), Auto::Fail("upstream down".into()));
        let good = FakeWorker::connect(&relay, Some(hello), Auto::Echo);
        relay.wait_clients(2, |c| c.get("kinds").is_some());
        let body = r#"{"payload":{"kind":"k"},"retry":{"backoff":"1s","backoff_max":"1s"}}"#;
        let ids: Vec<String> = (0..8).map(|_| id_of(&relay.submit(body))).collect();
        let seen_waiting = std::cell::Cell::new(false);
        let mut gaps = Vec::new();
        for id in &ids {
            let t = relay.wait_task(id, Duration::from_secs(10), |t| {
                if t["waiting_on"] == "backoff" {
                    seen_waiting.set(true);
                    // While it waits: pending, and when it may run is said.
                    assert_eq!(t["status"], "pending", "{t}");
                    let next = ms(&t["next_attempt_at"]);
                    let a = &t["attempt_log"][0];
                    let end = ms(&a["started_at"]) + a["duration_ms"].as_u64().expect("duration");
                    assert!(next >= end && next <= end + 1_000, "next_attempt_at outside [end, end + 1s]: {t}");
                }
                t["status"] == "done"
            });
            if outcomes(&t).len() == 2 {
                assert_eq!(outcomes(&t), ["failed", "done"]);
                let gap = gap_after(&t, 0);
                // At most min(backoff_max, backoff · 2^0) = 1 s (plus a loop turn or a claim).
                assert!(gap <= 1_800, "retry 1 waited {gap} ms, more than its 1 s bound: {t}");
                gaps.push(gap);
            }
            assert!(t.get("waiting_on").is_none() && t.get("next_attempt_at").is_none(), "{t}");
        }
        // First attempts alternate over the two workers: half the tasks met the failing one.
        assert!(gaps.len() >= 3, "{gaps:?}");
        // Uniform in [0, 1 s]: that every wait was under 150 ms has odds of 0.15^n.
        assert!(gaps.iter().any(|&g| g >= 150), "no wait at all: {gaps:?}");
        // (Polled every 10 ms, a wait of 150 ms or more is seen while it lasts.)
        assert!(seen_waiting.get(), "no task was seen waiting_on backoff: {gaps:?}");
        drop((bad, good));
    });
}

#[test]
fn the_configured_backoff_applies_and_doubles_per_retry() {
    for_each_mode(|mode| {
        // RETRY_BACKOFF 300ms: retry 1 waits ≤ 300 ms, retry 2 ≤ 600 ms, retry 3 ≤ 700 ms (the max).
        let relay =
            mode.start_with(&[("RETRY_BACKOFF", "300ms"), ("RETRY_BACKOFF_MAX", "700ms"), ("MAX_RETRIES", "3")]);
        let ws: Vec<FakeWorker> =
            (0..4).map(|i| FakeWorker::connect(&relay, None, Auto::Fail(format!("e{i}")))).collect();
        relay.wait_clients(4, |_| true);
        let r = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":1}"#));
        assert_eq!(r.status, 502, "a wait=true caller keeps waiting through the backoffs: {}", r.text());
        let t = r.json();
        assert_eq!(outcomes(&t), ["failed", "failed", "failed", "failed"], "{t}");
        for (i, bound) in [(0, 300), (1, 600), (2, 700)] {
            let gap = gap_after(&t, i);
            assert!(gap <= bound + 800, "retry {} waited {gap} ms (bound {bound}): {t}", i + 1);
        }
        drop(ws);
    });
}

#[test]
fn a_worker_asks_for_a_pause_and_the_next_attempt_waits_at_least_that_long_also_across_a_restart() {
    for_each_mode(|mode| {
        let data = files_dir("retry-restart");
        let data_dir = data.to_string_lossy().into_owned();
        let env: Vec<(&str, &str)> = if mode.is_cluster() { vec![] } else { vec![("DATA_DIR", data_dir.as_str())] };
        let relay = mode.start_with(&env);
        let w = FakeWorker::connect(&relay, None, Auto::Manual);
        relay.wait_clients(1, |_| true);
        let id = id_of(&relay.submit(r#"{"payload":1,"retry":{"any_worker":true}}"#));
        let task = w.expect_task();
        fail_with(&w, &task.id, json!({"retry_after_ms": 2500}));
        let t = relay.wait_task(&id, Duration::from_secs(5), |t| t["waiting_on"] == "backoff");
        let next = ms(&t["next_attempt_at"]);
        let end = ms(&t["attempt_log"][0]["started_at"]) + t["attempt_log"][0]["duration_ms"].as_u64().expect("ms");
        // (The end is timed on the monotonic clock, next_attempt_at on the wall clock: a few ms apart.)
        assert!(next + 10 >= end + 2_500 && next <= end + 2_700, "{t}");
        // A restart keeps the wait.
        let db = relay.db.clone();
        drop(w);
        assert!(relay.stop().success());
        let relay = match db {
            Some(db) => Mode::start_on(Arc::clone(&db), &env),
            None => mode.start_with(&env),
        };
        let t = relay.get_task(&id);
        assert_eq!((t["status"].as_str(), t["waiting_on"].as_str()), (Some("pending"), Some("backoff")), "{t}");
        assert_eq!(ms(&t["next_attempt_at"]), next, "{t}");
        let w = FakeWorker::connect(&relay, None, Auto::Echo);
        let t = relay.wait_status(&id, "done", Duration::from_secs(10));
        let started = ms(&t["attempt_log"][1]["started_at"]);
        assert!(started >= next, "the retry started {} ms before its time: {t}", next - started);
        drop(w);
        let _ = std::fs::remove_dir_all(&data);
    });
}

fn files_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("relay-it-{tag}-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

#[test]
fn retry_after_ms_paces_the_retry_on_another_worker() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let a = FakeWorker::connect(&relay, None, Auto::Manual);
        let b = FakeWorker::connect(&relay, None, Auto::Manual);
        relay.wait_clients(2, |_| true);
        let id = id_of(&relay.submit(r#"{"payload":1}"#));
        let workers = [&a, &b];
        let (first, task) = first_task(&workers, Duration::from_secs(5)).expect("a first attempt");
        fail_with(workers[first], &task.id, json!({"retry_after_ms": 800}));
        let other = workers[1 - first];
        let retry = other.next_task(Duration::from_secs(5)).expect("the retry, on the other worker");
        other.done(&retry.id, json!(1));
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        let gap = gap_after(&t, 0);
        // (The end is timed on the monotonic clock, the start on the wall clock: a few ms apart;
        // the upper bound leaves room for a loaded machine.)
        assert!((790..2_300).contains(&gap), "retry_after_ms 800, waited {gap} ms: {t}");
    });
}

#[test]
fn retry_false_ends_the_task_after_one_attempt() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("MAX_RETRIES", "5")]);
        let a = FakeWorker::connect(&relay, None, Auto::Manual);
        let b = FakeWorker::connect(&relay, None, Auto::Manual);
        relay.wait_clients(2, |_| true);
        let mut waiter = Client::connect(relay.addr);
        let auth = format!("Bearer {API}");
        waiter.send("POST", "/tasks?wait=true", &[("Authorization", auth.as_str())], Some(br#"{"payload":1}"#));
        let workers = [&a, &b];
        let (first, task) = first_task(&workers, Duration::from_secs(5)).expect("a first attempt");
        fail_with(workers[first], &task.id, json!({"error": "bad request: no such user", "retry": false}));
        let r = waiter.read_response().expect("the answer");
        assert_eq!(r.status, 502, "{}", r.text());
        let t = r.json();
        assert_eq!(outcomes(&t), ["failed"], "a permanent failure is not retried: {t}");
        assert_eq!(t["error"], "bad request: no such user");
    });
}

#[test]
fn any_worker_retries_on_the_only_worker_and_then_on_the_one_tried_longest_ago() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let only = FakeWorker::connect(&relay, None, Auto::Manual);
        relay.wait_clients(1, |_| true);
        let id = id_of(&relay.submit(r#"{"payload":1,"retry":{"any_worker":true}}"#));
        let t1 = only.expect_task();
        only.fail(&t1.id, "blip");
        let t2 = only.next_task(Duration::from_secs(5)).expect("the retry, on the same worker");
        only.done(&t2.id, json!("ok"));
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        assert_eq!(outcomes(&t), ["failed", "done"]);
        assert_eq!(t["attempt_log"][0]["client_id"], t["attempt_log"][1]["client_id"]);
        drop(only);

        // RETRY_ANY_WORKER: with both tried, attempts alternate (longest ago first).
        let relay = mode.start_with(&[("RETRY_ANY_WORKER", "true"), ("MAX_RETRIES", "3")]);
        let ws: Vec<FakeWorker> =
            (0..2).map(|i| FakeWorker::connect(&relay, None, Auto::Fail(format!("e{i}")))).collect();
        relay.wait_clients(2, |_| true);
        let r = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":1}"#));
        assert_eq!(r.status, 502, "{}", r.text());
        let t = r.json();
        let who: Vec<&str> =
            t["attempt_log"].as_array().expect("log").iter().map(|a| a["client_id"].as_str().expect("id")).collect();
        assert_eq!(who.len(), 4, "{t}");
        assert!(who[0] != who[1] && who[0] == who[2] && who[1] == who[3], "{t}");
        // Without it, a task whose every worker was tried fails (SPEC §5).
        let r = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":1,"retry":{"any_worker":false}}"#));
        assert_eq!(outcomes(&r.json()).len(), 2, "{}", r.text());
        drop(ws);
    });
}

#[test]
fn bad_retry_policies_are_refused() {
    for_each_mode(|mode| {
        let relay = mode.start();
        for body in [
            r#"{"payload":1,"retry":{"backoff":"soon"}}"#,
            r#"{"payload":1,"retry":{"backoff_max":"0s"}}"#,
            r#"{"payload":1,"retry":{"any_worker":1}}"#,
            r#"{"payload":1,"retry":{"backof":"1s"}}"#,
            r#"{"payload":1,"retry":"2s"}"#,
        ] {
            let r = relay.api("POST", "/tasks", Some(body));
            assert_eq!(r.status, 400, "{body}: {}", r.text());
            assert_eq!(r.json()["error"], "bad_request", "{}", r.text());
            assert!(r.json()["message"].is_string());
        }
    });
    // (Startup checks of the environment: the same in both modes.)
    for (var, value) in [("RETRY_BACKOFF", "-1s"), ("RETRY_BACKOFF_MAX", "0s"), ("RETRY_ANY_WORKER", "maybe")] {
        let (code, _, err) = run_relay_env(
            &[],
            &[("API_TOKEN", "a"), ("WORKER_TOKEN", "w"), ("DATA_DIR", ""), ("PORT", "0"), (var, value)],
        );
        assert_eq!(code, Some(2), "{var}={value}: {err}");
        assert!(err.contains(var), "{err}");
    }
}

fn post(relay: &Relay, path: &str, body: Option<&str>) -> Resp {
    relay.api("POST", path, body)
}

#[test]
fn a_failed_task_runs_again_with_a_fresh_retry_budget_and_its_attempt_log_kept() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("MAX_RETRIES", "0")]);
        let w = FakeWorker::connect(&relay, None, Auto::Manual);
        relay.wait_clients(1, |_| true);
        let id = id_of(&relay.submit(r#"{"payload":1}"#));
        let a = w.expect_task();
        w.fail(&a.id, "upstream down");
        relay.wait_status(&id, "failed", Duration::from_secs(5));

        let r = post(&relay, &format!("/tasks/{id}/retry"), None);
        assert_eq!(r.status, 202, "{}", r.text());
        let t = r.json();
        assert!(matches!(t["status"].as_str(), Some("pending" | "dispatched")), "{t}");
        assert_eq!(t["reruns"], 1, "{t}");
        assert!(t.get("error").is_none() && t.get("finished_at").is_none(), "{t}");
        // Its run goes to the worker again (a fresh budget: no worker was tried in this run).
        let b = w.expect_task();
        assert_eq!(b.id, id);
        // Not final: 409 with the task as it is.
        let r = post(&relay, &format!("/tasks/{id}/retry"), None);
        assert_eq!((r.status, r.json()["status"].as_str()), (409, Some("dispatched")), "{}", r.text());
        w.done(&b.id, json!("second time lucky"));
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        assert_eq!(outcomes(&t), ["failed", "done"], "{t}");
        assert_eq!((t["attempts"].as_u64(), t["attempt_log"][1]["num"].as_u64()), (Some(2), Some(2)), "{t}");
        assert_eq!(t["reruns"], 1);
        // Done: 409; unknown: 404.
        assert_eq!(post(&relay, &format!("/tasks/{id}/retry"), None).status, 409);
        let r = post(&relay, "/tasks/00000000-0000-4000-8000-000000000000/retry", None);
        assert_eq!(r.status, 404, "{}", r.text());
        assert_eq!(relay.api("GET", &format!("/tasks/{id}/retry"), None).status, 405);

        // ?wait=true waits for the re-run's end: a second failure answers 502.
        let id = id_of(&relay.submit(r#"{"payload":2}"#));
        let a = w.expect_task();
        w.fail(&a.id, "first");
        relay.wait_status(&id, "failed", Duration::from_secs(5));
        let mut waiter = Client::connect(relay.addr);
        let auth = format!("Bearer {API}");
        waiter.send("POST", &format!("/tasks/{id}/retry?wait=true"), &[("Authorization", auth.as_str())], None);
        let b = w.expect_task();
        w.fail(&b.id, "second");
        let r = waiter.read_response().expect("the answer");
        assert_eq!(r.status, 502, "{}", r.text());
        let t = r.json();
        assert_eq!(
            (t["error"].as_str(), t["attempts"].as_u64(), t["reruns"].as_u64()),
            (Some("second"), Some(2), Some(1))
        );
    });
}

#[test]
fn bulk_reruns_select_by_filter_with_a_limit_and_a_dry_run() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("MAX_RETRIES", "0")]);
        let hello = json!({"type":"hello","kinds":["a","b"]});
        let w = FakeWorker::connect(&relay, Some(hello), Auto::Fail("boom: upstream 503".into()));
        relay.wait_clients(1, |c| c.get("kinds").is_some());
        let mut a_ids = Vec::new();
        for _ in 0..3 {
            let r = post(&relay, "/tasks?wait=true", Some(r#"{"payload":{"kind":"a"}}"#));
            assert_eq!(r.status, 502, "{}", r.text());
            a_ids.push(r.json()["task_id"].as_str().expect("id").to_string());
        }
        let r = post(&relay, "/tasks?wait=true", Some(r#"{"payload":{"kind":"b"}}"#));
        let b_id = r.json()["task_id"].as_str().expect("id").to_string();
        drop(w);
        relay.wait_clients(0, |_| true);

        // Refused: no filter, a bad limit, a bad status, an unknown field.
        for body in [
            r#"{}"#,
            r#"{"status":"failed"}"#,
            r#"{"kind":"a","limit":0}"#,
            r#"{"kind":"a","limit":10001}"#,
            r#"{"kind":"a","status":"done"}"#,
            r#"{"kind":"a","dryrun":true}"#,
            r#"{"finished_after":"yesterday"}"#,
            r#"[1]"#,
        ] {
            let r = post(&relay, "/tasks/retry", Some(body));
            assert_eq!(r.status, 400, "{body}: {}", r.text());
            assert_eq!(r.json()["error"], "bad_request");
        }
        // A dry run only counts, newest first.
        let r = post(&relay, "/tasks/retry", Some(r#"{"kind":"a","dry_run":true}"#));
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["retried"], 3, "{v}");
        let newest_first: Vec<Value> = a_ids.iter().rev().map(|s| json!(s)).collect();
        assert_eq!(v["task_ids"], json!(newest_first), "{v}");
        assert!(a_ids.iter().all(|id| relay.get_task(id)["status"] == "failed"), "a dry run re-runs nothing");
        // error_contains and a limit: the two newest of all four.
        let r = post(&relay, "/tasks/retry", Some(r#"{"error_contains":"upstream 503","limit":2}"#));
        let v = r.json();
        assert_eq!(v["task_ids"], json!([b_id, a_ids[2]]), "{v}");
        for id in [&b_id, &a_ids[2]] {
            let t = relay.get_task(id);
            assert_eq!((t["status"].as_str(), t["reruns"].as_u64()), (Some("pending"), Some(1)), "{t}");
        }
        assert_eq!(relay.get_task(&a_ids[0])["status"], "failed");
        // finished_after in the future matches nothing.
        let r = post(&relay, "/tasks/retry", Some(r#"{"kind":"a","finished_after":"2999-01-01T00:00:00Z"}"#));
        assert_eq!(r.json()["retried"], 0, "{}", r.text());
        // Re-run tasks wait for a worker: one that connects runs them.
        let _w = FakeWorker::connect(&relay, None, Auto::Echo);
        relay.wait_status(&b_id, "done", Duration::from_secs(5));
        relay.wait_status(&a_ids[2], "done", Duration::from_secs(5));
    });
}

/// A worker that answers by a switch: fails while `failing`, else done.
fn switch_worker(
    relay: &Relay,
    failing: Arc<std::sync::atomic::AtomicBool>,
) -> (Arc<std::sync::atomic::AtomicBool>, std::thread::JoinHandle<()>) {
    use std::sync::atomic::Ordering;
    let w = FakeWorker::connect(relay, Some(json!({"type":"hello","version":"switch"})), Auto::Manual);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let join = std::thread::spawn(move || {
        while !stop2.load(Ordering::SeqCst) {
            if let Some(t) = w.next_task(Duration::from_millis(20)) {
                if failing.load(Ordering::SeqCst) {
                    w.fail(&t.id, "no route to upstream");
                } else {
                    w.done(&t.id, json!("ok"));
                }
            }
        }
    });
    (stop, join)
}

fn first_worker(t: &Value) -> String {
    t["attempt_log"][0]["client_id"].as_str().expect("client").to_string()
}

#[test]
fn a_failing_worker_gets_no_first_attempts_while_two_healthy_share_them_and_gets_them_back_once_it_recovers() {
    use std::sync::atomic::{AtomicBool, Ordering};
    for_each_mode(|mode| {
        let relay = mode.start_with(&STEADY_HEARTBEAT_FAST);
        let failing = Arc::new(AtomicBool::new(true));
        let (stop, join) = switch_worker(&relay, failing.clone());
        let good: Vec<FakeWorker> = (0..2).map(|_| FakeWorker::connect(&relay, None, Auto::Echo)).collect();
        relay.wait_clients(3, |_| true);
        let bad_id = relay.clients()["clients"]
            .as_array()
            .expect("clients")
            .iter()
            .find(|c| c["version"] == "switch")
            .and_then(|c| c["client_id"].as_str())
            .expect("the switch worker")
            .to_string();
        let run = || {
            let r = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":1}"#));
            assert_eq!(r.status, 200, "the retry goes to a healthy worker: {}", r.text());
            r.json()
        };
        let degraded = || {
            relay.clients()["clients"]
                .as_array()
                .expect("clients")
                .iter()
                .any(|c| c["client_id"] == bad_id && c["degraded"] == true)
        };
        // Its first attempts fail (their retries succeed elsewhere): after 5, it is degraded.
        let mut failed_first = 0;
        for _ in 0..40 {
            let t = run();
            if first_worker(&t) == bad_id {
                failed_first += 1;
                assert_eq!(outcomes(&t), ["failed", "done"], "{t}");
            }
            if failed_first >= 5 {
                break;
            }
        }
        assert_eq!(failed_first, 5, "the failing worker got 5 first attempts");
        assert!(degraded(), "{}", relay.clients());
        // Now first attempts rotate over the two healthy workers only.
        let mut firsts = Vec::new();
        for _ in 0..8 {
            let t = run();
            assert_eq!(outcomes(&t), ["done"], "no first attempt on the degraded worker: {t}");
            firsts.push(first_worker(&t));
        }
        assert!(!firsts.contains(&bad_id));
        for pair in firsts.windows(2) {
            assert_ne!(pair[0], pair[1], "first attempts alternate over the healthy two: {firsts:?}");
        }
        // It recovers: once its cool-down (5 s) is over it gets a first attempt again, succeeds,
        // and is back in the rotation.
        failing.store(false, Ordering::SeqCst);
        let back = poll_until(Duration::from_secs(12), || first_worker(&run()) == bad_id);
        assert!(back, "the recovered worker never got a first attempt again");
        assert!(!degraded(), "{}", relay.clients());
        let firsts: Vec<String> = (0..6).map(|_| first_worker(&run())).collect();
        assert_eq!(firsts.iter().filter(|c| **c == bad_id).count(), 2, "one in three again: {firsts:?}");
        stop.store(true, Ordering::SeqCst);
        let _ = join.join();
        drop(good);
    });
}

/// Heartbeats that survive a loaded machine while the test runs for seconds.
const STEADY_HEARTBEAT_FAST: [(&str, &str); 2] = [("PING_INTERVAL", "500ms"), ("PONG_WAIT", "4s")];

#[test]
fn failed_tasks_are_kept_failed_ttl_longer_or_shorter_than_task_ttl() {
    for_each_mode(|mode| {
        for (task_ttl, failed_ttl, failed_outlives) in [("2s", "1h", true), ("1h", "1s", false)] {
            let relay = mode.start_with(&[("TASK_TTL", task_ttl), ("FAILED_TTL", failed_ttl), ("MAX_RETRIES", "0")]);
            let ok = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["ok"]})), Auto::Echo);
            let bad =
                FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["bad"]})), Auto::Fail("no".into()));
            relay.wait_clients(2, |c| c.get("kinds").is_some());
            let done = post(&relay, "/tasks?wait=true", Some(r#"{"payload":{"kind":"ok"}}"#)).json()["task_id"].clone();
            let failed =
                post(&relay, "/tasks?wait=true", Some(r#"{"payload":{"kind":"bad"}}"#)).json()["task_id"].clone();
            let (gone, kept) = if failed_outlives { (&done, &failed) } else { (&failed, &done) };
            let status = |id: &Value| relay.api("GET", &format!("/tasks/{}", id.as_str().expect("id")), None).status;
            assert!(poll_until(Duration::from_secs(8), || status(gone) == 404), "{gone} was never forgotten");
            assert_eq!(status(kept), 200, "TASK_TTL {task_ttl}, FAILED_TTL {failed_ttl}: {kept} is kept");
            drop((ok, bad));
        }
    });
}

#[test]
fn a_result_whose_retry_hints_are_of_the_wrong_type_still_ends_its_attempt() {
    // (They were: the whole result was dropped as malformed, and the attempt ran into its
    // timeout — the worker's answer lost, and a timeout counted against it.)
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("TASK_TIMEOUT", "30s"), ("MAX_RETRIES", "1")]);
        let a = FakeWorker::connect(&relay, None, Auto::Manual);
        let b = FakeWorker::connect(&relay, None, Auto::Manual);
        relay.wait_clients(2, |_| true);
        let workers = [&a, &b];
        // A string "false" is not a permanent failure, a negative wait is no wait: the retry
        // goes to the other worker at once.
        for extra in [json!({"retry": "false", "retry_after_ms": -5}), json!({"retry": 0, "retry_after_ms": "800"})] {
            let id = id_of(&relay.submit(r#"{"payload":1}"#));
            let (first, task) = first_task(&workers, Duration::from_secs(5)).expect("a first attempt");
            fail_with(workers[first], &task.id, extra.clone());
            let other = workers[1 - first];
            let retry = other.next_task(Duration::from_secs(5)).unwrap_or_else(|| panic!("{extra}: the retry"));
            other.done(&retry.id, json!(1));
            let t = relay.wait_status(&id, "done", Duration::from_secs(5));
            assert_eq!(outcomes(&t), ["failed", "done"], "{extra}: {t}");
            assert!(gap_after(&t, 0) < 700, "{extra}: no wait asked for: {t}");
        }
        // A fraction of a ms is a wait all the same (rounded up), and `"retry": false` after it
        // still ends the task.
        let id = id_of(&relay.submit(r#"{"payload":1}"#));
        let (first, task) = first_task(&workers, Duration::from_secs(5)).expect("a first attempt");
        fail_with(workers[first], &task.id, json!({"retry_after_ms": 800.5}));
        let other = workers[1 - first];
        let retry = other.next_task(Duration::from_secs(5)).expect("the retry");
        other.done(&retry.id, json!(1));
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        assert!((790..2_300).contains(&gap_after(&t, 0)), "retry_after_ms 800.5: {t}");
        let id = id_of(&relay.submit(r#"{"payload":1,"max_retries":3}"#));
        let (first, task) = first_task(&workers, Duration::from_secs(5)).expect("a first attempt");
        fail_with(workers[first], &task.id, json!({"retry": false, "retry_after_ms": 1e30}));
        let t = relay.wait_status(&id, "failed", Duration::from_secs(5));
        assert_eq!(outcomes(&t), ["failed"], "{t}");
        assert_eq!(relay.metric("relay_ws_messages_malformed_total"), 0.0);
    });
}

#[test]
fn the_first_attempts_of_a_bulk_rerun_rotate_over_the_workers() {
    // (They counted as retries, which do not move the round-robin: every re-run task went to
    // the same worker, and a degraded worker was not avoided.)
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("MAX_RETRIES", "0")]);
        let hello = json!({"type":"hello","kinds":["r"]});
        let bad = FakeWorker::connect(&relay, Some(hello.clone()), Auto::Fail("down".into()));
        relay.wait_clients(1, |c| c.get("kinds").is_some());
        let ids: Vec<String> = (0..6).map(|_| id_of(&relay.submit(r#"{"payload":{"kind":"r"}}"#))).collect();
        for id in &ids {
            relay.wait_status(id, "failed", Duration::from_secs(5));
        }
        drop(bad);
        relay.wait_clients(0, |_| true);
        let ws: Vec<FakeWorker> =
            (0..3).map(|_| FakeWorker::connect(&relay, Some(hello.clone()), Auto::Manual)).collect();
        relay.wait_clients(3, |c| c.get("kinds").is_some());
        let r = post(&relay, "/tasks/retry", Some(r#"{"kind":"r"}"#));
        assert_eq!(r.json()["retried"], 6, "{}", r.text());
        let mut got = [0; 3];
        let deadline = Instant::now() + Duration::from_secs(10);
        while got.iter().sum::<usize>() < 6 && Instant::now() < deadline {
            for (i, w) in ws.iter().enumerate() {
                if let Some(t) = w.next_task(Duration::from_millis(5)) {
                    got[i] += 1;
                    w.done(&t.id, json!(1));
                }
            }
        }
        assert_eq!(got, [2, 2, 2], "six re-run tasks over three workers, round-robin");
    });
}

#[test]
fn a_rerun_respects_max_pending_as_a_submit_does() {
    // (Re-runs put tasks back among the pending ones past MAX_PENDING: a bulk re-run of 8 with
    // MAX_PENDING=3 left 8 waiting.)
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("MAX_RETRIES", "0"), ("MAX_PENDING", "3")]);
        let hello = json!({"type":"hello","kinds":["q"]});
        let bad = FakeWorker::connect(&relay, Some(hello), Auto::Fail("down".into()));
        relay.wait_clients(1, |c| c.get("kinds").is_some());
        let ids: Vec<String> = (0..6).map(|_| id_of(&relay.submit(r#"{"payload":{"kind":"q"}}"#))).collect();
        for id in &ids {
            relay.wait_status(id, "failed", Duration::from_secs(5));
        }
        drop(bad);
        relay.wait_clients(0, |_| true);
        let pending = || relay.wait_health(|_| true)["tasks"]["pending"].as_u64().unwrap_or(u64::MAX);
        // One waits already; a bulk re-run fills the rest of the room, newest first.
        let waiting = id_of(&relay.submit(r#"{"payload":{"kind":"q"},"queue":true}"#));
        let r = post(&relay, "/tasks/retry", Some(r#"{"kind":"q","dry_run":true}"#));
        assert_eq!(r.json()["retried"], 6, "a dry run counts what matches: {}", r.text());
        let r = post(&relay, "/tasks/retry", Some(r#"{"kind":"q"}"#));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["task_ids"], json!([ids[5], ids[4]]), "{}", r.text());
        assert!(poll_until(Duration::from_secs(3), || pending() == 3), "{}", relay.wait_health(|_| true));
        // Full: a bulk re-run that matches is 429, and so is one task's.
        let r = post(&relay, "/tasks/retry", Some(r#"{"kind":"q"}"#));
        assert_eq!((r.status, r.json()["error"].as_str()), (429, Some("queue_full")), "{}", r.text());
        let r = post(&relay, &format!("/tasks/{}/retry", ids[0]), None);
        assert_eq!((r.status, r.json()["error"].as_str()), (429, Some("queue_full")), "{}", r.text());
        assert_eq!(relay.get_task(&ids[0])["status"], "failed");
        // Room again: the re-run goes through.
        assert_eq!(relay.api("DELETE", &format!("/tasks/{waiting}"), None).status, 200);
        let r = post(&relay, &format!("/tasks/{}/retry", ids[0]), None);
        assert_eq!(r.status, 202, "{}", r.text());
        assert!(poll_until(Duration::from_secs(3), || pending() == 3), "{}", relay.wait_health(|_| true));
    });
}

#[test]
fn a_bulk_rerun_of_thousands_of_tasks_leaves_the_loop_free_between_slices() {
    // (One node re-ran all it selected in one loop turn, each task's whole record rewritten:
    // 10,000 tasks of 5 KB held the loop ~200 ms in release. PostgreSQL re-runs them in one
    // statement on the database thread.)
    let dir = std::env::temp_dir().join(format!("relay-it-bulk-rerun-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let relay = Relay::start_with(&[("MAX_RETRIES", "0"), ("DATA_DIR", dir.to_str().expect("path"))]);
    let hello = json!({"type":"hello","kinds":["bulk"]});
    let bad = FakeWorker::connect(&relay, Some(hello), Auto::Fail("down".into()));
    relay.wait_clients(1, |c| c.get("kinds").is_some());
    let pad = "x".repeat(4096);
    let n = 5_000;
    for _ in 0..n / 1000 {
        let items: Vec<Value> = (0..1000).map(|i| json!({"payload": {"kind": "bulk", "i": i, "pad": pad}})).collect();
        let r = relay.api("POST", "/tasks/batch", Some(&json!({"tasks": items}).to_string()));
        assert_eq!(r.status, 202, "{}", r.text());
    }
    assert!(
        poll_until(Duration::from_secs(60), || relay.wait_health(|_| true)["tasks"]["failed"] == n),
        "{}",
        relay.wait_health(|_| true)
    );
    drop(bad);
    relay.wait_clients(0, |_| true);
    // While the re-run runs, a second client measures how long the loop keeps it waiting.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (addr, stop2) = (relay.addr, stop.clone());
    let probe = std::thread::spawn(move || {
        let mut c = Client::connect(addr);
        let mut worst = Duration::ZERO;
        while !stop2.load(std::sync::atomic::Ordering::SeqCst) {
            let t = Instant::now();
            c.send("GET", "/healthz", &[], None);
            c.read_response().expect("healthz");
            worst = worst.max(t.elapsed());
        }
        worst
    });
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    let r = post(&relay, "/tasks/retry", Some(r#"{"kind":"bulk","limit":10000}"#));
    let took = t.elapsed();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let worst = probe.join().expect("probe");
    eprintln!("a bulk re-run of {n}: {took:?}; /healthz waited up to {worst:?}");
    assert_eq!(r.json()["retried"], n, "{}", &r.text()[..200.min(r.text().len())]);
    assert_eq!(relay.wait_health(|_| true)["tasks"]["pending"], n);
    // A slice a turn: the loop answered others between slices (in one turn, the probe waited
    // about as long as the whole re-run).
    assert!(worst < took / 2, "a bulk re-run took {took:?}; meanwhile /healthz waited up to {worst:?}");
    drop(relay);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_task_canceled_during_its_backoff_and_run_again_no_longer_shows_the_wait() {
    // (The database kept the old wait in the last attempt_log entry: the re-run task showed
    // waiting_on "backoff" and a next_attempt_at 20 s ahead while it was due at once.)
    for_each_mode(|mode| {
        let relay = mode.start();
        let w = FakeWorker::connect(&relay, None, Auto::Manual);
        relay.wait_clients(1, |_| true);
        let id = id_of(&relay.submit(r#"{"payload":1,"retry":{"any_worker":true}}"#));
        let t1 = w.expect_task();
        fail_with(&w, &t1.id, json!({"retry_after_ms": 20_000}));
        relay.wait_task(&id, Duration::from_secs(5), |t| t["waiting_on"] == "backoff");
        assert_eq!(relay.api("DELETE", &format!("/tasks/{id}"), None).status, 200);
        drop(w);
        relay.wait_clients(0, |_| true);
        let r = post(&relay, &format!("/tasks/{id}/retry"), None);
        assert_eq!(r.status, 202, "{}", r.text());
        for t in [r.json(), relay.get_task(&id)] {
            assert_eq!(t["status"], "pending", "{t}");
            assert!(t.get("next_attempt_at").is_none() && t["waiting_on"] == "worker", "{t}");
        }
        let _w = FakeWorker::connect(&relay, None, Auto::Echo);
        relay.wait_status(&id, "done", Duration::from_secs(5));
    });
}

#[test]
fn a_bulk_rerun_finds_the_failed_tasks_that_left_memory() {
    // (One node walked only the failed tasks still in memory: those over TASK_MEMORY were
    // listed, and re-run one by one, but POST /tasks/retry never found them. It reads them back
    // from the journal in batches, off the loop; PostgreSQL has them all.)
    for_each_mode(|mode| {
        let data = files_dir("bulk-evicted");
        let data_dir = data.to_string_lossy().into_owned();
        let mut env = vec![("MAX_RETRIES", "0"), ("TASK_MEMORY", "16384")];
        if !mode.is_cluster() {
            env.push(("DATA_DIR", data_dir.as_str()));
        }
        let relay = mode.start_with(&env);
        let a = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["a"]})), Auto::Fail("boom".into()));
        let b = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["b"]})), Auto::Fail("other".into()));
        relay.wait_clients(2, |c| c.get("kinds").is_some());
        // More than one batch of reads (64) of tasks that left memory, a few newest in memory.
        let (mut a_ids, mut b_ids) = (Vec::new(), Vec::new());
        for i in 0..200 {
            let kind = if i % 4 == 3 { "b" } else { "a" };
            let r = post(&relay, "/tasks?wait=true", Some(&json!({"payload": {"kind": kind, "i": i}}).to_string()));
            assert_eq!(r.status, 502, "{}", r.text());
            let id = r.json()["task_id"].as_str().expect("id").to_string();
            if kind == "a" { a_ids.push(id) } else { b_ids.push(id) }
        }
        drop((a, b));
        relay.wait_clients(0, |_| true);
        if !mode.is_cluster() {
            assert!(
                poll_until(Duration::from_secs(10), || relay.metric("relay_tasks_on_disk") >= 100.0),
                "{}",
                relay.metrics()
            );
            assert!(relay.metric("relay_tasks_on_disk") < 200.0, "some stay in memory: {}", relay.metrics());
        }
        let newest_first = |ids: &[String]| -> Value { json!(ids.iter().rev().collect::<Vec<_>>()) };
        // A dry run counts them all, newest first: the kind is known from a task's summary,
        // the error only once it is read back.
        let r = post(&relay, "/tasks/retry", Some(r#"{"error_contains":"boom","dry_run":true}"#));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!((r.json()["retried"].as_u64(), &r.json()["task_ids"]), (Some(150), &newest_first(&a_ids)));
        let r = post(&relay, "/tasks/retry", Some(r#"{"kind":"b","dry_run":true,"limit":30}"#));
        assert_eq!(r.json()["task_ids"], newest_first(&b_ids[20..]), "{}", r.text());
        assert!(
            b_ids.iter().chain(&a_ids).all(|id| relay.get_task(id)["status"] == "failed"),
            "a dry run re-runs none"
        );

        // Re-run for real, up to a limit: the 120 newest of kind a, the oldest of them read back.
        let r = post(&relay, "/tasks/retry", Some(r#"{"kind":"a","error_contains":"boom","limit":120}"#));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["task_ids"], newest_first(&a_ids[30..]), "{}", r.text());
        // (Counted as the database's gauges are read, a moment later in cluster mode.)
        relay.wait_health(|h| h["tasks"]["pending"] == 120);
        let t = relay.get_task(&a_ids[30]);
        assert_eq!(
            (t["status"].as_str(), t["reruns"].as_u64(), t["attempts"].as_u64()),
            (Some("pending"), Some(1), Some(1))
        );
        assert_eq!(relay.get_task(&a_ids[29])["status"], "failed", "beyond the limit");
        // A worker runs them; the next dry run finds the 30 left.
        let _w = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["a"]})), Auto::Echo);
        for id in &a_ids[30..] {
            let t = relay.wait_status(id, "done", Duration::from_secs(10));
            assert_eq!(outcomes(&t), ["failed", "done"], "{t}");
        }
        let r = post(&relay, "/tasks/retry", Some(r#"{"kind":"a","dry_run":true}"#));
        assert_eq!(r.json()["task_ids"], newest_first(&a_ids[..30]), "{}", r.text());
        drop(relay);
        let _ = std::fs::remove_dir_all(&data);
    });
}

#[test]
fn failed_ttl_holds_across_a_restart() {
    // A failed task is kept FAILED_TTL from when it failed, not from the restart: listed and
    // run again after one, forgotten on time after it (and a second restart does not bring it
    // back). One node restores it from the journal in memory or, over TASK_MEMORY, as a summary
    // read back on demand; both are tried.
    for_each_mode(|mode| {
        let variants: &[(&str, &str, &str)] = if mode.is_cluster() {
            &[("1h", "4s", "67108864"), ("4s", "1h", "67108864")]
        } else {
            &[("1h", "4s", "67108864"), ("1h", "4s", "1"), ("4s", "1h", "1")]
        };
        for &(task_ttl, failed_ttl, memory) in variants {
            let failed_short = failed_ttl == "4s";
            let data = files_dir("failed-ttl-restart");
            let data_dir = data.to_string_lossy().into_owned();
            let mut env =
                vec![("TASK_TTL", task_ttl), ("FAILED_TTL", failed_ttl), ("MAX_RETRIES", "0"), ("TASK_MEMORY", memory)];
            if !mode.is_cluster() {
                env.push(("DATA_DIR", data_dir.as_str()));
            }
            let what = format!("{} TASK_TTL {task_ttl}, FAILED_TTL {failed_ttl}, TASK_MEMORY {memory}", mode.name());
            let relay = mode.start_with(&env);
            let ok = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["ok"]})), Auto::Echo);
            let bad =
                FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["bad"]})), Auto::Fail("no".into()));
            relay.wait_clients(2, |c| c.get("kinds").is_some());
            let id_of_wait = |body: &str, status: u16| {
                let r = post(&relay, "/tasks?wait=true", Some(body));
                assert_eq!(r.status, status, "{}", r.text());
                r.json()["task_id"].as_str().expect("id").to_string()
            };
            let done = id_of_wait(r#"{"payload":{"kind":"ok"}}"#, 200);
            let rerun = id_of_wait(r#"{"payload":{"kind":"bad"}}"#, 502);
            let kept = id_of_wait(r#"{"payload":{"kind":"bad"}}"#, 502);
            let ended = Instant::now();
            drop((ok, bad));
            let db = relay.db.clone();
            assert!(relay.stop().success());
            let restart = || match &db {
                Some(db) => Mode::start_on(Arc::clone(db), &env),
                None => mode.start_with(&env),
            };
            let relay = restart();

            // Within both TTLs: all three are there, the failed ones listed and re-runnable.
            let listed = relay.api("GET", "/tasks?status=failed", None).json();
            let listed: Vec<&str> =
                listed["tasks"].as_array().expect("tasks").iter().filter_map(|t| t["task_id"].as_str()).collect();
            assert!(ended.elapsed() < Duration::from_secs(4), "{what}: the restart took too long to tell");
            assert_eq!(listed, [kept.as_str(), rerun.as_str()], "{what}");
            assert_eq!(relay.get_task(&done)["status"], "done", "{what}");
            let r = post(&relay, "/tasks/retry", Some(r#"{"kind":"bad","dry_run":true}"#));
            assert_eq!(r.json()["task_ids"], json!([kept, rerun]), "{what}: {}", r.text());
            let r = post(&relay, &format!("/tasks/{rerun}/retry"), None);
            assert_eq!((r.status, r.json()["reruns"].as_u64()), (202, Some(1)), "{what}: {}", r.text());
            // The re-run runs (at once: left pending, a TASK_TTL of 4 s would expire it in the
            // queue while the wait below lasts, and it would be listed failed again).
            let w = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["bad"]})), Auto::Echo);
            relay.wait_status(&rerun, "done", Duration::from_secs(5));
            drop(w);

            // Past the shorter TTL: that task is gone, the other kept.
            let status = |relay: &Relay, id: &str| relay.api("GET", &format!("/tasks/{id}"), None).status;
            let (gone, stays) = if failed_short { (&kept, &done) } else { (&done, &kept) };
            assert!(poll_until(Duration::from_secs(10), || status(&relay, gone) == 404), "{what}: {gone} is kept");
            assert_eq!(status(&relay, stays), 200, "{what}: {stays} went too");
            let r = post(&relay, "/tasks/retry", Some(r#"{"kind":"bad","dry_run":true}"#));
            let left: Value = if failed_short { json!([]) } else { json!([kept]) };
            assert_eq!(r.json()["task_ids"], left, "{what}: {}", r.text());
            // A second restart brings nothing back.
            assert!(relay.stop().success());
            let relay = restart();
            assert_eq!(status(&relay, gone), 404, "{what}: {gone} came back after a restart");
            assert_eq!(status(&relay, stays), 200, "{what}");
            if failed_short {
                // (With the short TASK_TTL the re-run's end may be forgotten by now.)
                assert_eq!(relay.get_task(&rerun)["status"], "done", "{what}");
            }
            drop(relay);
            let _ = std::fs::remove_dir_all(&data);
        }
    });
}
