//! Durability (SPEC §7): the journal in DATA_DIR across clean stops, `kill -9` and damage;
//! schedules, idempotency and batches across restarts; finished tasks over TASK_MEMORY read
//! back from disk; compaction. Each test owns a fresh DATA_DIR.
//!
//! Single-node only, all of it: the journal lives in DATA_DIR, which cluster mode does not use
//! (SPEC §11); what PostgreSQL keeps across a node's crash is `cluster.rs`'s.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::*;

/// A DATA_DIR of the test's own, removed on drop.
struct DataDir(PathBuf);

impl DataDir {
    fn new(tag: &str) -> DataDir {
        DataDir(std::env::temp_dir().join(format!("relay-it-data-{tag}-{}", uuid::Uuid::new_v4().simple())))
    }
    fn path(&self) -> &str {
        self.0.to_str().expect("utf-8 temp path")
    }
    fn segments(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&self.0)
            .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        v.retain(|p| p.extension().is_some_and(|e| e == "journal"));
        v.sort();
        v
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn start(dir: &DataDir, env: &[(&str, &str)]) -> Relay {
    let mut all = vec![("DATA_DIR", dir.path())];
    all.extend_from_slice(env);
    Relay::start_with(&all)
}

fn kill9(relay: &mut Relay) {
    relay.signal("KILL");
    relay.wait_exit(Duration::from_secs(5)).expect("relay dies on SIGKILL");
}

fn queued(relay: &Relay, payload: Value) -> String {
    let r = relay.submit(&json!({"payload": payload, "queue": true}).to_string());
    assert_eq!(r.status, 202, "{}", r.text());
    r.json()["task_id"].as_str().expect("task_id").to_string()
}

fn metric_value(relay: &Relay, series: &str) -> Option<f64> {
    relay.metrics().lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Offsets of the frames of a segment file (16-byte header, 8-byte aligned frames; a segment
/// prepared ahead of time ends in zeros after its last frame).
fn frame_offsets(bytes: &[u8]) -> Vec<usize> {
    let mut offs = Vec::new();
    let mut off = 16;
    while off + 8 <= bytes.len() {
        let len = u32::from_le_bytes([bytes[off], bytes[off + 1], bytes[off + 2], bytes[off + 3]]) as usize;
        if len == 0 {
            break;
        }
        offs.push(off);
        off += (8 + len + 7) & !7;
    }
    offs
}

/// Where a segment's records end (its zeros, if prepared, start).
fn records_end(bytes: &[u8]) -> usize {
    frame_offsets(bytes).last().map_or(16, |&off| {
        let len = u32::from_le_bytes([bytes[off], bytes[off + 1], bytes[off + 2], bytes[off + 3]]) as usize;
        off + ((8 + len + 7) & !7)
    })
}

#[test]
fn accepted_tasks_and_results_survive_kill_9() {
    let dir = DataDir::new("kill");
    let mut relay = start(&dir, &[]);
    let worker = FakeWorker::connect(&relay, Some(json!({"type": "hello", "kinds": ["echo"]})), Auto::Echo);
    relay.wait_clients(1, |_| true);
    let done = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":{"kind":"echo","n":1}}"#));
    assert_eq!(done.status, 200, "{}", done.text());
    let done = done.json();
    let waiting: Vec<String> = (0..3).map(|i| queued(&relay, json!({"kind": "later", "i": i}))).collect();
    kill9(&mut relay);
    drop(worker);

    let relay = start(&dir, &[]);
    assert!(relay.log_text().contains("tasks_restored=4"), "{}", relay.log_text());
    let id = done["task_id"].as_str().expect("id");
    assert_eq!(relay.get_task(id), done, "a result read before the crash reads the same after it");
    for id in &waiting {
        let t = relay.get_task(id);
        assert_eq!(t["status"], "pending", "{t}\n{}", relay.log_text());
    }
    let _worker = FakeWorker::connect(&relay, Some(json!({"type": "hello", "kinds": ["later"]})), Auto::Echo);
    for (i, id) in waiting.iter().enumerate() {
        let t = relay.wait_status(id, "done", Duration::from_secs(5));
        assert_eq!(t["result"], json!({"echo": {"kind": "later", "i": i}}));
    }
}

/// A result nobody waits on (its task was answered 202 long ago) is held back from the
/// journal's writer for a couple of milliseconds, to share the sync of the next answer that
/// waits: with no request and no ping to end another loop turn, relay wakes for that deadline
/// by itself and the record reaches the journal file.
#[test]
fn a_result_nobody_waits_on_reaches_the_journal_without_another_request() {
    let dir = DataDir::new("hold");
    // No ping turns: only relay's own deadline can hand the record over.
    let relay = start(&dir, &[("PING_INTERVAL", "60s"), ("PONG_WAIT", "120s")]);
    let worker = FakeWorker::connect(&relay, Some(json!({"type": "hello", "kinds": ["held"]})), Auto::Manual);
    relay.wait_clients(1, |_| true);
    let r = relay.submit(r#"{"payload":{"kind":"held"}}"#);
    assert_eq!(r.status, 202, "{}", r.text());
    let task = worker.expect_task();
    let marker = format!("held-result-{}", uuid::Uuid::new_v4().simple());
    worker.done(&task.id, json!({ "marker": marker }));
    let in_journal = || {
        dir.segments()
            .iter()
            .any(|p| std::fs::read(p).is_ok_and(|b| b.windows(marker.len()).any(|w| w == marker.as_bytes())))
    };
    // The hold is 2 ms; the bound leaves a loaded machine 200 times that, and stays below the
    // ≈ 1 s after which some other timer of relay's would end a turn anyway.
    assert!(
        poll_until(Duration::from_millis(400), in_journal),
        "the result did not reach the journal\n{}",
        relay.log_text()
    );
    let t = relay.wait_status(&task.id, "done", Duration::from_secs(5));
    assert_eq!(t["result"]["marker"], json!(marker));
}

#[test]
fn an_attempt_cut_short_by_a_crash_is_closed_as_disconnect_and_runs_again() {
    let dir = DataDir::new("cut");
    let mut relay = start(&dir, &[]);
    let worker = FakeWorker::connect(&relay, None, Auto::Manual);
    relay.wait_clients(1, |_| true);
    // max_retries 0: the restart must not count as the one attempt it had.
    let r = relay.submit(r#"{"payload":{"kind":"slow"},"max_retries":0}"#);
    assert_eq!(r.status, 202);
    let id = r.json()["task_id"].as_str().expect("id").to_string();
    let task = worker.expect_task();
    assert_eq!(task.id, id);
    assert_eq!(relay.get_task(&id)["status"], "dispatched");
    kill9(&mut relay);
    drop(worker);

    let relay = start(&dir, &[]);
    let t = relay.get_task(&id);
    assert_eq!(t["status"], "pending", "{t}");
    assert_eq!(t["attempts"], 1);
    assert_eq!(t["attempt_log"][0]["outcome"], "disconnect");
    assert!(t["attempt_log"][0]["error"].as_str().is_some_and(|e| e.contains("relay restarted")), "{t}");
    let worker = FakeWorker::connect(&relay, None, Auto::Echo);
    let t = relay.wait_status(&id, "done", Duration::from_secs(5));
    assert_eq!(t["attempts"], 2, "{t}");
    drop(worker);
}

/// A small HTTP call that reports failure instead of panicking (the server dies under it).
fn try_call(addr: SocketAddr, method: &str, path: &str, body: &str) -> Option<(u16, Value)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: relay\r\nAuthorization: Bearer {API}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, serde_json::from_str(body).ok()?))
}

#[test]
fn kill_9_under_load_loses_no_acknowledged_task() {
    let dir = DataDir::new("load");
    // Every acknowledged task: id → payload; results and statuses seen before a crash.
    let acked: Arc<Mutex<HashMap<String, Value>>> = Arc::default();
    let seen: Arc<Mutex<HashMap<String, Value>>> = Arc::default();
    let mut seed = 0x2545_F491_4F6C_DD1D_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for round in 0..4 {
        let mut relay = start(&dir, &[]);
        let workers: Vec<FakeWorker> =
            (0..2).map(|_| FakeWorker::connect(&relay, Some(json!({"type": "hello"})), Auto::Echo)).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let clients: Vec<_> = (0..4)
            .map(|c| {
                let (addr, stop, acked, seen) = (relay.addr, stop.clone(), acked.clone(), seen.clone());
                std::thread::spawn(move || {
                    let mut i = 0;
                    while !stop.load(Ordering::SeqCst) {
                        i += 1;
                        let payload = json!({"round": round, "client": c, "i": i});
                        let sync = i % 2 == 0;
                        let path = if sync { "/tasks?wait=true" } else { "/tasks" };
                        let body = json!({"payload": payload, "queue": true}).to_string();
                        match try_call(addr, "POST", path, &body) {
                            Some((200 | 202, v)) => {
                                let id = v["task_id"].as_str().unwrap_or_default().to_string();
                                acked.lock().expect("lock").insert(id.clone(), payload);
                                if v["status"] == "done" {
                                    seen.lock().expect("lock").insert(id, v);
                                }
                            }
                            Some((status, v)) => panic!("unexpected answer {status}: {v}"),
                            None => {} // the server died mid-call: not acknowledged
                        }
                    }
                })
            })
            .collect();
        // A random moment while the load runs (once it runs: the first answers came back).
        let before = acked.lock().expect("lock").len();
        let running =
            crate::support::poll_until(Duration::from_secs(20), || acked.lock().expect("lock").len() > before);
        assert!(running, "round {round}: no task acknowledged within 20 s");
        let at = Duration::from_millis(next() % 450);
        std::thread::sleep(at);
        kill9(&mut relay);
        stop.store(true, Ordering::SeqCst);
        for c in clients {
            c.join().expect("client thread");
        }
        drop(workers);
    }

    let relay = start(&dir, &[]);
    let _workers: Vec<FakeWorker> =
        (0..2).map(|_| FakeWorker::connect(&relay, Some(json!({"type": "hello"})), Auto::Echo)).collect();
    let acked = acked.lock().expect("lock").clone();
    let seen = seen.lock().expect("lock").clone();
    for (id, payload) in &acked {
        let t = relay.wait_status(id, "done", Duration::from_secs(20));
        assert_eq!(t["result"], json!({"echo": payload}), "task {id} done without its result");
        if let Some(before) = seen.get(id) {
            assert_eq!(&t, before, "a result read before a crash changed after it");
        }
    }
    assert!(seen.len() > 10, "too few sync results to compare: {}", seen.len());
}

#[test]
fn a_torn_tail_is_cut_off_and_everything_before_it_kept() {
    let dir = DataDir::new("torn");
    let relay = start(&dir, &[]);
    let ids: Vec<String> = (0..5).map(|i| queued(&relay, json!({"i": i}))).collect();
    assert!(relay.stop().success());
    let seg = dir.segments().pop().expect("a segment");
    let mut bytes = std::fs::read(&seg).expect("read segment");
    // (Zeros prepared ahead are no records: the torn write lands right after the last one.)
    let clean_len = records_end(&bytes);
    bytes.truncate(clean_len);
    // Half of a frame: a length and checksum, then the write stopped.
    bytes.extend_from_slice(&[200, 0, 0, 0, 1, 2, 3, 4, 9, 9, 9]);
    std::fs::write(&seg, &bytes).expect("write segment");

    let relay = start(&dir, &[]);
    assert!(relay.log_text().contains("torn tail cut off"), "{}", relay.log_text());
    assert_eq!(std::fs::metadata(&seg).expect("segment").len() as usize, clean_len);
    for id in &ids {
        assert_eq!(relay.get_task(id)["status"], "pending");
    }
    assert_eq!(metric_value(&relay, "relay_journal_corrupt_records_total"), Some(0.0), "a torn tail is not corruption");
}

#[test]
fn a_corrupt_record_in_the_middle_is_skipped_and_the_records_after_it_kept() {
    let dir = DataDir::new("corrupt");
    let relay = start(&dir, &[]);
    let ids: Vec<String> = (0..5).map(|i| queued(&relay, json!({"i": i}))).collect();
    assert!(relay.stop().success());
    let seg = dir.segments().pop().expect("a segment");
    let mut bytes = std::fs::read(&seg).expect("read segment");
    let frames = frame_offsets(&bytes);
    assert_eq!(frames.len(), 5, "one record per submit");
    bytes[frames[1] + 40] ^= 0x55; // inside the second task's record
    std::fs::write(&seg, &bytes).expect("write segment");

    let relay = start(&dir, &[]);
    assert!(relay.log_text().contains("level=error msg=\"journal: damaged record skipped"), "{}", relay.log_text());
    assert_eq!(metric_value(&relay, "relay_journal_corrupt_records_total"), Some(1.0));
    assert_eq!(relay.api("GET", &format!("/tasks/{}", ids[1]), None).status, 404);
    for id in ids.iter().enumerate().filter(|(i, _)| *i != 1).map(|(_, id)| id) {
        assert_eq!(relay.get_task(id)["status"], "pending", "records after the damage are kept");
    }
}

#[test]
fn a_missing_data_dir_is_created_private_and_an_empty_one_is_fine() {
    let dir = DataDir::new("fresh");
    let nested = dir.0.join("a/b");
    let relay = Relay::start_with(&[("DATA_DIR", nested.to_str().expect("path"))]);
    queued(&relay, json!(1));
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&nested).expect("created").permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
    drop(relay);
    let empty = DataDir::new("empty");
    std::fs::create_dir_all(&empty.0).expect("mkdir");
    let relay = start(&empty, &[]);
    assert!(relay.log_text().contains("tasks_restored=0"), "{}", relay.log_text());
}

#[test]
fn an_unusable_data_dir_stops_startup_with_exit_2() {
    let dir = DataDir::new("file");
    std::fs::create_dir_all(&dir.0).expect("mkdir");
    let file = dir.0.join("plain-file");
    std::fs::write(&file, b"x").expect("file");
    let under_file = file.join("journal");
    let base = [("PORT", "0"), ("BIND", "127.0.0.1"), ("API_TOKEN", API), ("WORKER_TOKEN", WRK)];
    for bad in [under_file.to_str().expect("path"), file.to_str().expect("path"), "/proc/self"] {
        let mut env = base.to_vec();
        env.push(("DATA_DIR", bad));
        let (code, _, err) = run_relay_env(&[], &env);
        assert_eq!(code, Some(2), "DATA_DIR={bad}: {err}");
        assert!(err.contains("DATA_DIR"), "the message names the variable: {err}");
    }
    // A second relay on a DATA_DIR in use.
    let relay = start(&dir, &[]);
    let mut env = base.to_vec();
    env.push(("DATA_DIR", dir.path()));
    let (code, _, err) = run_relay_env(&[], &env);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("in use by another relay"), "{err}");
    drop(relay);
}

#[test]
fn a_scheduled_task_keeps_its_time_across_a_restart() {
    let dir = DataDir::new("sched");
    let relay = start(&dir, &[]);
    let r = relay.submit(r#"{"payload":{"kind":"later"},"delay":"1500ms"}"#);
    assert_eq!(r.status, 202);
    let id = r.json()["task_id"].as_str().expect("id").to_string();
    let run_at = relay.get_task(&id)["run_at"].as_str().expect("run_at").to_string();
    assert!(relay.stop().success());

    let relay = start(&dir, &[]);
    let worker = FakeWorker::connect(&relay, None, Auto::Manual);
    let t = relay.get_task(&id);
    assert_eq!((t["status"].as_str(), t["run_at"].as_str()), (Some("pending"), Some(run_at.as_str())));
    let task = worker.next_task(Duration::from_secs(5)).expect("dispatched once due");
    assert_eq!(task.id, id);
    let t = relay.get_task(&id);
    let started = t["attempt_log"][0]["started_at"].as_str().expect("started_at");
    assert!(started >= run_at.as_str(), "dispatched at {started}, before its time {run_at}");
}

#[test]
fn due_order_with_ties_in_submission_order_survives_a_restart() {
    let dir = DataDir::new("order");
    let relay = start(&dir, &[]);
    let at = |ms: u64| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as u64;
        let t = now + ms;
        // RFC 3339 with milliseconds, UTC, by hand (no date crate in tests).
        let (secs, millis) = (t / 1000, t % 1000);
        let days = secs / 86_400;
        let (h, m, s) = (secs % 86_400 / 3600, secs % 3600 / 60, secs % 60);
        let (y, mo, d) = civil(days as i64);
        format!("{y:04}-{mo:02}-{d:02}T{h:02}:{m:02}:{s:02}.{millis:03}Z")
    };
    let tie = at(1200);
    let mut expected = Vec::new();
    let early = relay.submit(&json!({"payload": {"n": "early"}, "run_at": at(600)}).to_string()).json();
    for n in 0..3 {
        let r = relay.submit(&json!({"payload": {"n": n}, "run_at": tie}).to_string()).json();
        expected.push(r["task_id"].as_str().expect("id").to_string());
    }
    expected.insert(0, early["task_id"].as_str().expect("id").to_string());
    assert!(relay.stop().success());

    let relay = start(&dir, &[]);
    let worker = FakeWorker::connect(&relay, Some(json!({"type": "hello", "concurrency": 1})), Auto::Manual);
    let mut got = Vec::new();
    for _ in 0..4 {
        let t = worker.next_task(Duration::from_secs(5)).expect("a task");
        worker.done(&t.id, json!(null));
        got.push(t.id);
    }
    assert_eq!(got, expected, "due order, ties in submission order");
}

/// Days since 1970-01-01 → (year, month, day) (Howard Hinnant's civil_from_days).
fn civil(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[test]
fn idempotency_keys_survive_a_restart() {
    let dir = DataDir::new("idem");
    let relay = start(&dir, &[]);
    let call = |relay: &Relay, body: &str| {
        let auth = format!("Bearer {API}");
        request(
            relay.addr,
            "POST",
            "/tasks",
            &[("Authorization", &auth), ("Idempotency-Key", "order-7")],
            Some(body.as_bytes()),
        )
    };
    let first = call(&relay, r#"{"payload":1,"queue":true}"#);
    assert_eq!(first.status, 202);
    assert!(relay.stop().success());
    let relay = start(&dir, &[]);
    let again = call(&relay, r#"{"payload":2,"queue":true}"#);
    assert_eq!(again.status, 202);
    assert_eq!(again.json()["task_id"], first.json()["task_id"]);
    assert_eq!(relay.get_task(again.json()["task_id"].as_str().expect("id"))["status"], "pending");
    assert_eq!(metric_value(&relay, "relay_tasks_pending"), Some(1.0), "the repeat created nothing");
}

#[test]
fn a_past_run_at_with_no_worker_is_accepted_as_pending() {
    let relay = Relay::start();
    let r = relay.submit(r#"{"payload":{"kind":"x"},"run_at":"2001-01-01T00:00:00Z"}"#);
    assert_eq!(r.status, 202, "{}", r.text());
    let t = relay.get_task(r.json()["task_id"].as_str().expect("id"));
    assert_eq!(t["status"], "pending");
    let worker = FakeWorker::connect(&relay, None, Auto::Echo);
    relay.wait_status(t["task_id"].as_str().expect("id"), "done", Duration::from_secs(5));
    drop(worker);
}

#[test]
fn batch_answers_every_item_in_order_and_survives_a_restart() {
    let dir = DataDir::new("batch");
    let store = std::env::temp_dir().join(format!("relay-it-batch-tokens-{}.json", uuid::Uuid::new_v4().simple()));
    let secret = "batch-test-secret-0123456789abcdef0123";
    let store_s = store.to_str().expect("path");
    let relay = start(&dir, &[("TOKEN_SECRET", secret), ("TOKEN_STORE", store_s)]);
    let body = json!({"tasks": [
        {"payload": {"kind": "a", "n": 0}},
        {"payload": null},
        {"payload": {"kind": "a"}, "queue": false},
        {"payload": 1, "delay": "1s", "run_at": "2030-01-01T00:00:00Z"},
        {"payload": {"kind": "b", "n": 4}, "delay": "1h"},
        "not an object",
    ]});
    let r = relay.api("POST", "/tasks/batch", Some(&body.to_string()));
    assert_eq!(r.status, 202, "{}", r.text());
    let items = r.json()["tasks"].as_array().cloned().expect("tasks");
    let codes: Vec<&str> = items.iter().map(|i| i["error"].as_str().unwrap_or("ok")).collect();
    assert_eq!(codes, ["ok", "bad_request", "no_worker", "bad_request", "ok", "bad_request"], "{items:?}");
    assert!(items.iter().all(|i| i.get("task_id").is_some() == i.get("error").is_none()
        && i.get("message").is_some() == i.get("error").is_some()));
    let first = items[0]["task_id"].as_str().expect("id").to_string();
    assert_eq!(items[0]["status"], "pending");

    // A scoped token: each item checked on its own.
    let (code, out, err) = run_relay_env(
        &["token", "create", "--name", "batcher", "--kinds", "a", "--ttl", "1h"],
        &[("TOKEN_SECRET", secret), ("TOKEN_STORE", store_s)],
    );
    assert_eq!(code, Some(0), "{err}");
    let token = out.lines().find_map(|l| l.strip_prefix("token: ")).expect("token").to_string();
    let scoped = request(
        relay.addr,
        "POST",
        "/tasks/batch",
        &[("Authorization", &format!("Bearer {token}"))],
        Some(br#"{"tasks":[{"payload":{"kind":"a"}},{"payload":{"kind":"b"}},{"payload":7}]}"#),
    );
    assert_eq!(scoped.status, 202, "{}", scoped.text());
    let codes: Vec<String> = scoped.json()["tasks"]
        .as_array()
        .expect("tasks")
        .iter()
        .map(|i| i["error"].as_str().unwrap_or("ok").to_string())
        .collect();
    assert_eq!(codes, ["ok", "forbidden", "forbidden"]);
    // Bad bodies are 400 as a whole.
    for bad in [r#"[1]"#, r#"{"tasks":{}}"#, r#"{}"#, "nope"] {
        let r = relay.api("POST", "/tasks/batch", Some(bad));
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
    }
    assert_eq!(relay.api("GET", "/tasks/batch", None).status, 405);
    assert!(relay.stop().success());

    let relay = start(&dir, &[("TOKEN_SECRET", secret), ("TOKEN_STORE", store_s)]);
    assert_eq!(relay.get_task(&first)["status"], "pending");
    assert_eq!(metric_value(&relay, "relay_tasks_pending"), Some(3.0), "2 root items + 1 scoped item");
    let _ = std::fs::remove_file(&store);
}

#[test]
fn a_batch_of_100000_tasks_is_accepted_durably() {
    let dir = DataDir::new("big");
    let relay = start(&dir, &[("LOG_LEVEL", "info")]);
    let mut body = String::with_capacity(100_000 * 40);
    body.push_str("{\"tasks\":[");
    for i in 0..100_000 {
        if i > 0 {
            body.push(',');
        }
        body.push_str(&format!("{{\"payload\":{{\"kind\":\"bulk\",\"i\":{i}}}}}"));
    }
    body.push_str("]}");
    let started = Instant::now();
    let r = relay.api("POST", "/tasks/batch", Some(&body));
    let took = started.elapsed();
    assert_eq!(r.status, 202, "{}", &r.text()[..200.min(r.text().len())]);
    let items = r.json()["tasks"].as_array().cloned().expect("tasks");
    assert_eq!(items.len(), 100_000);
    assert!(items.iter().all(|i| i["status"] == "pending"));
    eprintln!("100000-task batch accepted durably in {took:?}");
    assert_eq!(metric_value(&relay, "relay_tasks_pending"), Some(100_000.0));
    let last = items[99_999]["task_id"].as_str().expect("id").to_string();
    let mut relay = relay;
    kill9(&mut relay);
    let relay = start(&dir, &[("LOG_LEVEL", "info")]);
    assert_eq!(metric_value(&relay, "relay_tasks_pending"), Some(100_000.0), "every acknowledged item survives");
    assert_eq!(relay.get_task(&last)["status"], "pending");
}

#[test]
fn finished_tasks_over_task_memory_are_read_back_from_the_journal() {
    let dir = DataDir::new("evict");
    let env = [("TASK_MEMORY", "8192")];
    let relay = start(&dir, &env);
    let worker = FakeWorker::connect(&relay, None, Auto::Echo);
    relay.wait_clients(1, |_| true);
    let mut done = Vec::new();
    for i in 0..60 {
        let r = relay.api("POST", "/tasks?wait=true", Some(&json!({"payload": {"kind": "k", "i": i}}).to_string()));
        assert_eq!(r.status, 200);
        done.push(r.json());
    }
    assert!(
        poll_until(Duration::from_secs(5), || metric_value(&relay, "relay_tasks_on_disk").is_some_and(|n| n > 0.0)),
        "{}",
        relay.metrics()
    );
    assert!(metric_value(&relay, "relay_finished_tasks_memory_bytes").expect("metric") <= 8192.0);
    let oldest = done[0]["task_id"].as_str().expect("id");
    assert_eq!(relay.get_task(oldest), done[0], "read back from disk, unchanged");
    let wait = relay.api("GET", &format!("/tasks/{oldest}?wait=true"), None);
    assert_eq!((wait.status, wait.json()), (200, done[0].clone()));
    let cancel = relay.api("DELETE", &format!("/tasks/{oldest}"), None);
    assert_eq!((cancel.status, cancel.json()), (409, done[0].clone()));
    drop(worker);
    assert!(relay.stop().success());

    let relay = start(&dir, &env);
    for t in [&done[0], &done[30], &done[59]] {
        assert_eq!(&relay.get_task(t["task_id"].as_str().expect("id")), t);
    }
    assert!(metric_value(&relay, "relay_tasks_on_disk").is_some_and(|n| n > 0.0), "the budget holds after replay too");
}

#[test]
fn memory_only_mode_forgets_finished_tasks_over_task_memory() {
    let relay = Relay::start_with(&[("TASK_MEMORY", "4096")]);
    let worker = FakeWorker::connect(&relay, None, Auto::Echo);
    relay.wait_clients(1, |_| true);
    let first = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":0}"#)).json();
    for i in 1..40 {
        assert_eq!(relay.api("POST", "/tasks?wait=true", Some(&json!({"payload": i}).to_string())).status, 200);
    }
    assert!(poll_until(Duration::from_secs(5), || metric_value(&relay, "relay_tasks_evicted_total")
        .is_some_and(|n| n > 0.0)));
    let id = first["task_id"].as_str().expect("id");
    assert_eq!(relay.api("GET", &format!("/tasks/{id}"), None).status, 404);
    assert!(relay.log_text().contains("forgotten before TASK_TTL"));
    drop(worker);
}

#[test]
fn compaction_deletes_segments_nothing_needs_and_carries_long_waiting_tasks_forward() {
    let dir = DataDir::new("compact");
    let env = [("JOURNAL_SEGMENT_SIZE", "4096"), ("TASK_TTL", "1s"), ("LOG_LEVEL", "info")];
    let relay = start(&dir, &env);
    let later = relay.submit(r#"{"payload":{"kind":"later"},"delay":"1h"}"#).json()["task_id"]
        .as_str()
        .expect("id")
        .to_string();
    let worker = FakeWorker::connect(&relay, Some(json!({"type": "hello", "kinds": ["now"]})), Auto::Echo);
    relay.wait_clients(1, |_| true);
    for i in 0..300 {
        let r = relay.api("POST", "/tasks?wait=true", Some(&json!({"payload": {"kind": "now", "i": i}}).to_string()));
        assert_eq!(r.status, 200);
    }
    // Segment numbers only grow: the newest one's number counts the segments written.
    let newest = dir.segments().last().and_then(|p| p.file_stem()?.to_str()?.parse::<u32>().ok()).unwrap_or(0);
    assert!(newest > 10, "the load should span many 4 KiB segments, got {newest}");
    // Finished tasks expire after 1 s; segments older than TASK_TTL give their live tasks up.
    assert!(poll_until(Duration::from_secs(10), || dir.segments().len() <= 3), "segments left: {:?}", dir.segments());
    drop(worker);
    assert!(relay.stop().success());
    let relay = start(&dir, &env);
    let t = relay.get_task(&later);
    assert_eq!(t["status"], "pending", "the long-waiting task was carried forward: {t}");
}

/// Kind policies, and the rate buckets their dispatches emptied (SPEC §14), are carried forward
/// by compaction: a policy kept only in a segment compacted away would be gone after a
/// restart, and a bucket record lost with its segment would come back full.
#[test]
fn compaction_carries_policies_and_their_emptied_buckets_forward() {
    let dir = DataDir::new("compact-policy");
    let env = [("JOURNAL_SEGMENT_SIZE", "4096"), ("TASK_TTL", "1s"), ("LOG_LEVEL", "info")];
    let relay = start(&dir, &env);
    let put = |relay: &Relay, kind: &str, body: &str| {
        let r = relay.api("PUT", &format!("/kinds/{kind}"), Some(body));
        assert_eq!(r.status, 200, "{}", r.text());
    };
    put(&relay, "slow", r#"{"rate":"1/h"}"#);
    put(&relay, "per-key", r#"{"rate_per_key":"1/h"}"#);
    put(&relay, "capped", r#"{"max_running":3,"paused":true}"#);
    let hello = json!({"type": "hello", "kinds": ["now", "slow", "per-key"]});
    let worker = FakeWorker::connect(&relay, Some(hello.clone()), Auto::Echo);
    relay.wait_clients(1, |_| true);
    for body in [r#"{"payload":{"kind":"slow"}}"#, r#"{"payload":{"kind":"per-key"},"key":"c1"}"#] {
        assert_eq!(relay.api("POST", "/tasks?wait=true", Some(body)).status, 200, "{body}");
    }
    for i in 0..300 {
        let r = relay.api("POST", "/tasks?wait=true", Some(&json!({"payload": {"kind": "now", "i": i}}).to_string()));
        assert_eq!(r.status, 200);
    }
    let newest = dir.segments().last().and_then(|p| p.file_stem()?.to_str()?.parse::<u32>().ok()).unwrap_or(0);
    assert!(newest > 10, "the load should span many 4 KiB segments, got {newest}");
    assert!(poll_until(Duration::from_secs(10), || dir.segments().len() <= 3), "segments left: {:?}", dir.segments());
    drop(worker);
    assert!(relay.stop().success());
    // (A longer TASK_TTL now: the held tasks below must not expire in the queue meanwhile.)
    let relay = start(&dir, &[("JOURNAL_SEGMENT_SIZE", "4096"), ("TASK_TTL", "60s")]);
    let kinds = relay.api("GET", "/kinds", None).json();
    let policies: Vec<(&str, &Value)> = kinds["kinds"]
        .as_array()
        .expect("kinds")
        .iter()
        .map(|k| (k["kind"].as_str().unwrap_or(""), &k["policy"]))
        .collect();
    assert_eq!(
        policies,
        [
            ("capped", &json!({"max_running": 3, "paused": true})),
            ("per-key", &json!({"rate_per_key": "1/h"})),
            ("slow", &json!({"rate": "1/h"})),
        ],
        "{kinds}"
    );
    let _worker = FakeWorker::connect(&relay, Some(hello), Auto::Echo);
    relay.wait_clients(1, |_| true);
    let submit = |body: &str| relay.submit(body).json()["task_id"].as_str().expect("id").to_string();
    let held = [
        submit(r#"{"payload":{"kind":"slow"},"queue":true}"#),
        submit(r#"{"payload":{"kind":"per-key"},"key":"c1","queue":true}"#),
    ];
    let free = submit(r#"{"payload":{"kind":"per-key"},"key":"c2","queue":true}"#);
    relay.wait_status(&free, "done", Duration::from_secs(5));
    for id in &held {
        let t = relay.get_task(id);
        assert_eq!((t["status"].as_str(), t["waiting_on"].as_str()), (Some("pending"), Some("rate")), "{t}");
    }
}

#[test]
fn sigterm_makes_every_accepted_task_durable_before_exit() {
    let dir = DataDir::new("term");
    let relay = start(&dir, &[]);
    let mut c = Client::connect(relay.addr);
    let auth = format!("Bearer {API}");
    for i in 0..200 {
        c.send(
            "POST",
            "/tasks",
            &[("Authorization", &auth)],
            Some(json!({"payload": i, "queue": true}).to_string().as_bytes()),
        );
    }
    let mut ids = Vec::new();
    for _ in 0..200 {
        let r = c.read_response().expect("an answer");
        assert_eq!(r.status, 202);
        ids.push(r.json()["task_id"].as_str().expect("id").to_string());
    }
    assert!(relay.stop().success(), "exit 0");
    let relay = start(&dir, &[]);
    assert_eq!(metric_value(&relay, "relay_tasks_pending"), Some(200.0));
    assert_eq!(relay.get_task(&ids[199])["status"], "pending");
}

/// A tmpfs of its own (root only): a small disk that a test can fill. Unmounted on drop.
struct Tmpfs(DataDir);

impl Tmpfs {
    fn mount(tag: &str, size: &str) -> Option<Tmpfs> {
        let dir = DataDir::new(tag);
        std::fs::create_dir_all(&dir.0).expect("mkdir");
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs", dir.path()])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        mounted.then_some(Tmpfs(dir))
    }
    fn path(&self) -> &Path {
        &self.0.0
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0.0).status();
    }
}

/// Fills the filesystem of `dir` to the last byte with one file, returned to be removed.
fn fill_disk(dir: &Path) -> PathBuf {
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).expect("filler");
    let chunk = vec![0x5a_u8; 64 << 10];
    while let Ok(n) = f.write(&chunk) {
        if n == 0 {
            break;
        }
    }
    path
}

fn data_dir_env(path: &Path) -> String {
    path.to_str().expect("utf-8 path").to_string()
}

/// A request on a fresh connection that has not been answered within `within` is held (its
/// record waits for the disk): `Err(client)` to read the answer from later.
fn call_or_held(relay: &Relay, method: &str, path: &str, body: &str, within: Duration) -> Result<Resp, Client> {
    let mut c = Client::connect(relay.addr);
    c.stream.set_read_timeout(Some(within)).expect("timeout");
    let auth = format!("Bearer {API}");
    c.send(method, path, &[("Authorization", &auth)], Some(body.as_bytes()));
    match c.read_response() {
        Some(r) => Ok(r),
        None => {
            c.stream.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
            Err(c)
        }
    }
}

fn health(relay: &Relay) -> Resp {
    request(relay.addr, "GET", "/healthz", &[], None)
}

/// SPEC §7: a full disk is not fatal. On a small disk (8 MiB) with the default
/// JOURNAL_SEGMENT_SIZE (64 MiB segments prepared ahead would not fit: relay used to leave a
/// `next-segment.preparing` that filled the disk, then exit 1 at the next submit), relay
/// stays up when the disk fills: writes answer 503 `journal_unavailable`, reads go on,
/// `/healthz` says `"journal":"full"`, no attempt starts, a result that arrives is shown only
/// once it is on disk, and when space returns relay carries on by itself.
#[test]
fn a_full_disk_refuses_writes_keeps_reads_and_carries_on_once_space_returns() {
    const TEST: &str = "a_full_disk_refuses_writes_keeps_reads_and_carries_on_once_space_returns";
    let Some(disk) = Tmpfs::mount("full", "8m") else {
        return skip_or_fail(TEST, "cannot mount a tmpfs (not root?)");
    };
    let data = disk.path().join("data");
    // (TASK_TIMEOUT: the attempt under way must outlast the full disk.)
    let env = [
        ("DATA_DIR", data_dir_env(&data)),
        ("JOURNAL_SEGMENT_SIZE", "67108864".into()),
        ("TASK_TIMEOUT", "60s".into()),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let relay = Relay::start_with(&env);
    let quick = FakeWorker::connect(&relay, Some(json!({"type": "hello", "kinds": ["quick"]})), Auto::Echo);
    let slow = FakeWorker::connect(&relay, Some(json!({"type": "hello", "kinds": ["slow"]})), Auto::Manual);
    relay.wait_clients(2, |c| c["kinds"].is_array());
    let done = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":{"kind":"quick"}}"#));
    assert_eq!(done.status, 200, "{}", done.text());
    let done = done.json();
    let done_id = done["task_id"].as_str().expect("id").to_string();
    let r = relay.submit(r#"{"payload":{"kind":"slow"}}"#);
    assert_eq!(r.status, 202, "{}", r.text());
    let running = slow.expect_task();
    let waiting = queued(&relay, json!({"kind": "later"}));

    let filler = fill_disk(disk.path());
    let pad = "p".repeat(64 << 10);
    let mut acked = Vec::new();
    let mut held = Vec::new();
    let mut refused = None;
    for i in 0..200 {
        let body = json!({"payload": {"kind": "later", "i": i, "pad": pad}, "queue": true}).to_string();
        match call_or_held(&relay, "POST", "/tasks", &body, Duration::from_secs(2)) {
            Ok(r) if r.status == 202 => acked.push(r.json()["task_id"].as_str().expect("id").to_string()),
            Ok(r) => {
                refused = Some(r);
                break;
            }
            // Accepted before the disk refused its record: the 202 waits for the disk.
            Err(client) => held.push(client),
        }
        assert!(!data.join("next-segment.preparing").exists(), "an unfinished prepared segment is left behind");
    }
    let refused = refused.expect("the disk never filled");
    assert_eq!((refused.status, refused.error().as_str()), (503, "journal_unavailable"), "{}", refused.text());
    assert!(refused.json()["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert!(!held.is_empty(), "the submit whose record met the full disk should wait for it");
    assert!(!data.join("next-segment.preparing").exists());

    // Reads go on; health says why writes are refused.
    assert_eq!(relay.get_task(&done_id), done);
    let h = health(&relay);
    assert_eq!((h.status, h.json()["journal"].as_str()), (503, Some("full")), "{}", h.text());
    assert_eq!(relay.metric("relay_journal_full"), 1.0);
    // Every request that must write is refused, not queued.
    let cancel = relay.api("DELETE", &format!("/tasks/{waiting}"), None);
    assert_eq!((cancel.status, cancel.error().as_str()), (503, "journal_unavailable"), "{}", cancel.text());
    let batch = relay.api("POST", "/tasks/batch", Some(r#"{"tasks":[{"payload":1}]}"#));
    assert_eq!((batch.status, batch.error().as_str()), (503, "journal_unavailable"), "{}", batch.text());

    // No attempt starts while the journal cannot record it (its results could not be kept).
    let later = FakeWorker::connect(&relay, Some(json!({"type": "hello", "kinds": ["later"]})), Auto::Manual);
    relay.wait_clients(3, |c| c["kinds"].is_array());
    assert!(later.no_task(Duration::from_millis(300)), "a task was dispatched while the journal was full");

    // A result that arrives now is kept, but shown to nobody before it is on disk.
    let done_attempts = || relay.metric("relay_attempts_total{outcome=\"done\"}");
    let before = done_attempts();
    slow.done(&running.id, json!({"late": true}));
    assert!(poll_until(Duration::from_secs(5), || done_attempts() > before), "the result never arrived");
    let mut get = Client::connect(relay.addr);
    get.send("GET", &format!("/tasks/{}", running.id), &[("Authorization", &format!("Bearer {API}"))], None);
    // (Answered after the GET was read: relay read the GET before this.)
    let _ = relay.metrics();
    assert!(get.nothing_received(), "the task was shown done before its record was on disk");

    // Space returns: relay carries on without a restart.
    std::fs::remove_file(&filler).expect("free the disk");
    assert!(poll_until(Duration::from_secs(10), || health(&relay).status == 200), "{}", health(&relay).text());
    assert_eq!(relay.metric("relay_journal_full"), 0.0);
    for mut c in held {
        let r = c.read_response().expect("the held submit is answered");
        assert_eq!(r.status, 202, "{}", r.text());
        acked.push(r.json()["task_id"].as_str().expect("id").to_string());
    }
    let shown = get.read_response().expect("the held GET is answered");
    assert_eq!((shown.status, shown.json()["status"].as_str()), (200, Some("done")), "{}", shown.text());
    assert_eq!(shown.json()["result"], json!({"late": true}));
    assert_eq!(later.expect_task().payload["kind"], "later", "tasks that waited are dispatched again");
    assert_eq!(relay.submit(r#"{"payload":{"kind":"later"},"queue":true}"#).status, 202);

    drop((quick, slow, later));
    assert!(relay.stop().success());
    let relay = Relay::start_with(&env);
    for id in &acked {
        assert_eq!(relay.api("GET", &format!("/tasks/{id}"), None).status, 200, "task {id} was acknowledged");
    }
    assert_eq!(relay.get_task(&running.id)["result"], json!({"late": true}));
    assert_eq!(relay.get_task(&done_id), done);
}

/// SPEC §7: relay starts on a full disk too, serves reads, refuses writes, and takes them
/// again once there is room (it used to start as if all were well and fail the first write).
#[test]
fn relay_starts_and_serves_reads_on_a_full_disk() {
    const TEST: &str = "relay_starts_and_serves_reads_on_a_full_disk";
    let Some(disk) = Tmpfs::mount("startfull", "8m") else {
        return skip_or_fail(TEST, "cannot mount a tmpfs (not root?)");
    };
    let data = data_dir_env(&disk.path().join("data"));
    let env = [("DATA_DIR", data.as_str()), ("JOURNAL_SEGMENT_SIZE", "67108864")];
    let relay = Relay::start_with(&env);
    let worker = FakeWorker::connect(&relay, Some(json!({"type": "hello", "kinds": ["quick"]})), Auto::Echo);
    relay.wait_clients(1, |_| true);
    let done = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":{"kind":"quick"}}"#)).json();
    let pending = queued(&relay, json!({"kind": "later"}));
    drop(worker);
    assert!(relay.stop().success());

    let filler = fill_disk(disk.path());
    let relay = Relay::start_with(&env);
    assert!(relay.log_text().contains("DATA_DIR is full"), "{}", relay.log_text());
    assert_eq!(relay.get_task(done["task_id"].as_str().expect("id")), done);
    assert_eq!(relay.get_task(&pending)["status"], "pending");
    let h = health(&relay);
    assert_eq!((h.status, h.json()["journal"].as_str()), (503, Some("full")), "{}", h.text());
    let r = relay.submit(r#"{"payload":{"kind":"later"},"queue":true}"#);
    assert_eq!((r.status, r.error().as_str()), (503, "journal_unavailable"), "{}", r.text());

    std::fs::remove_file(&filler).expect("free the disk");
    assert!(poll_until(Duration::from_secs(10), || health(&relay).status == 200), "{}", health(&relay).text());
    assert_eq!(health(&relay).json()["journal"], "ok");
    assert_eq!(relay.submit(r#"{"payload":{"kind":"later"},"queue":true}"#).status, 202);
}

/// A failed `fdatasync` stays fatal (SPEC §7: the page cache can no longer be trusted): relay
/// exits non-zero and never acknowledges the record.
#[test]
fn a_failed_fdatasync_is_fatal() {
    const TEST: &str = "a_failed_fdatasync_is_fatal";
    let dir = DataDir::new("fsync");
    // The journal thread's first fdatasync (its first commit) fails.
    let args = ["-e", "trace=fdatasync", "-e", "inject=fdatasync:error=EIO:when=1"];
    let Some(mut relay) = crate::support::strace::Traced::start(TEST, &args, &[("DATA_DIR", dir.path())]) else {
        return;
    };
    let answer = try_call(relay.addr, "POST", "/tasks", r#"{"payload":1,"queue":true}"#);
    assert!(answer.is_none(), "acknowledged a record whose sync failed: {answer:?}");
    let status = relay.wait_exit(Duration::from_secs(10)).expect("relay exits when a sync fails");
    assert!(!status.success(), "exit status must be non-zero: {status:?}");
    assert!(relay.log_text().contains("journal write failed"), "{}", relay.log_text());
}

/// Tasks answered `done` came back `pending` after a restart: with DATA_DIR briefly refusing
/// deletions, the oldest compacted segment's deletion failed, was logged and never retried,
/// while newer segments (the tasks' final records, their forget records) were deleted. Now a
/// failed deletion is retried and holds every newer one back. (strace makes the first three
/// deletions of segment 1 fail with EROFS.)
#[test]
fn a_failed_segment_delete_is_retried_and_no_newer_segment_goes_before_it() {
    const TEST: &str = "a_failed_segment_delete_is_retried_and_no_newer_segment_goes_before_it";
    let dir = DataDir::new("delete");
    let first = dir.0.join("0000000001.journal");
    let first_s = first.to_str().expect("path");
    let args = ["-P", first_s, "-e", "trace=unlink,unlinkat", "-e", "inject=unlink,unlinkat:error=EROFS:when=1..3"];
    let env = [("DATA_DIR", dir.path()), ("JOURNAL_SEGMENT_SIZE", "4096"), ("TASK_TTL", "1s")];
    let Some(mut relay) = crate::support::strace::Traced::start(TEST, &args, &env) else { return };
    // (A hello at once: without one the worker waits out a grace that TASK_TTL=1s can outlast.)
    let worker = FakeWorker::connect_url(&relay.ws_url(), Some(json!({"type": "hello"})), Auto::Echo).expect("worker");
    let auth = format!("Bearer {API}");
    let mut ids = Vec::new();
    for i in 0..120 {
        let body = json!({"payload": {"i": i}}).to_string();
        let r = request(relay.addr, "POST", "/tasks?wait=true", &[("Authorization", &auth)], Some(body.as_bytes()));
        assert_eq!(r.status, 200, "{}", r.text());
        ids.push(r.json()["task_id"].as_str().expect("id").to_string());
    }
    // The tasks are forgotten after TASK_TTL, their segments compacted away, oldest first.
    assert!(
        poll_until(Duration::from_secs(20), || !first.exists()),
        "segment 1 was never deleted: a failed deletion is not retried\n{}",
        relay.log_text()
    );
    // (The line follows the deletion: wait for it to reach the log.)
    let retried = "removed a compacted segment after failed tries\" segment=1 tries=4";
    assert!(poll_until(Duration::from_secs(5), || relay.log_text().contains(retried)), "{}", relay.log_text());
    let log = relay.log_text();
    assert!(log.contains("cannot remove a compacted segment"), "the injected failure did not happen:\n{log}");
    drop(worker);
    relay.signal("TERM");
    assert!(relay.wait_exit(Duration::from_secs(10)).expect("relay exits").success());
    let relay = start(&dir, &[("JOURNAL_SEGMENT_SIZE", "4096"), ("TASK_TTL", "1s")]);
    for id in &ids {
        let r = relay.api("GET", &format!("/tasks/{id}"), None);
        assert!(
            r.status == 404 || r.json()["status"] == "done",
            "task {id}, answered done, came back after a restart: {}",
            r.text()
        );
    }
}

/// Workers failing with 15 MiB errors made a task's record (every attempt's error, three
/// times over, twice more in attempt records) grow past what replay accepts once errors were
/// large enough (220 MiB ones with MAX_MESSAGE_SIZE=256MiB passed 1 GiB: the task was gone after
/// a restart) and memory reached 10.5 GiB. A worker's error is cut to 64 KiB where it arrives.
#[test]
fn a_worker_error_is_cut_to_64_kib_and_its_task_survives_a_restart() {
    let dir = DataDir::new("errcut");
    // (The fake workers of a debug build take a while over 15 MiB: no ping may end them.)
    let env = [
        ("MAX_MESSAGE_SIZE", "33554432"),
        ("TASK_TIMEOUT", "30s"),
        ("WAIT_TIMEOUT", "30s"),
        ("PING_INTERVAL", "10s"),
        ("PONG_WAIT", "30s"),
    ];
    let relay = start(&dir, &env);
    let huge = "e".repeat(15 << 20);
    let workers: Vec<FakeWorker> = (0..3)
        .map(|_| {
            FakeWorker::connect(&relay, Some(json!({"type": "hello", "kinds": ["big"]})), Auto::Fail(huge.clone()))
        })
        .collect();
    relay.wait_clients(3, |c| c["kinds"].is_array());
    let r = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":{"kind":"big"},"max_retries":2}"#));
    let t = r.json();
    assert_eq!((r.status, t["status"].as_str()), (502, Some("failed")), "{}", &r.text()[..r.text().len().min(300)]);
    let log = t["attempt_log"].as_array().expect("attempt_log");
    assert_eq!(log.len(), 3);
    for a in log {
        let e = a["error"].as_str().expect("error");
        assert!(e.len() <= 64 << 10, "an error of {} bytes was kept", e.len());
        assert!(
            e.starts_with("eeee") && e.ends_with(" bytes]"),
            "the cut is marked: ...{}",
            &e[e.len().saturating_sub(60)..]
        );
    }
    assert!(t["error"].as_str().is_some_and(|e| e.len() <= 64 << 10));
    let journal_bytes: u64 = dir.segments().iter().map(|p| records_end(&std::fs::read(p).expect("read")) as u64).sum();
    assert!(journal_bytes < 1 << 20, "the journal holds {journal_bytes} bytes of records for one task");
    let peak_mib = peak_rss_kib(relay.pid()) / 1024;
    // (About 70 MiB here: the messages as they arrive. Kept whole, the three errors, their
    // records and the answer took 413.)
    assert!(peak_mib < 120, "three 15 MiB errors took relay to {peak_mib} MiB");
    drop(workers);
    assert!(relay.stop().success());
    let relay = start(&dir, &env);
    assert_eq!(relay.get_task(t["task_id"].as_str().expect("id")), t, "the task reads the same after a restart");
}

/// After one Quickstart task DATA_DIR held 129 MiB and every restart added another 64 MiB
/// (449 MiB after five), and a restart with 23 records in 6 files took a second to replay.
/// Now a restart appends to the last segment, the first segment is small (1 MiB), the next
/// file is prepared only once the head is a quarter full, and a prepared file a run leaves is
/// reused, never one more per restart.
#[test]
fn restarts_with_a_few_tasks_add_no_file_and_replay_at_once() {
    let dir = DataDir::new("restarts");
    // JOURNAL_SEGMENT_SIZE at its default, as a small host runs it.
    let env = [("JOURNAL_SEGMENT_SIZE", "67108864"), ("LOG_LEVEL", "info")];
    let files = |dir: &DataDir| -> (u64, usize, usize) {
        let mut bytes = 0;
        let (mut segments, mut prepared) = (0, 0);
        for e in std::fs::read_dir(&dir.0).expect("dir").map(|e| e.expect("entry")) {
            bytes += e.metadata().expect("meta").len();
            let name = e.file_name().to_string_lossy().into_owned();
            segments += usize::from(name.ends_with(".journal"));
            prepared += usize::from(name.starts_with("next-segment"));
        }
        (bytes, segments, prepared)
    };
    let replay_ms = |relay: &Relay| -> u64 {
        let log = relay.log_text();
        let line = log.lines().find(|l| l.contains("journal replayed")).expect("journal replayed").to_string();
        line.split_whitespace().find_map(|kv| kv.strip_prefix("replay_ms=")?.parse().ok()).expect("replay_ms")
    };
    let mut ids = Vec::new();
    for run in 0..6 {
        let relay = start(&dir, &env);
        if run > 0 {
            let ms = replay_ms(&relay);
            assert!(ms <= 200, "run {run}: replaying a few tasks took {ms} ms");
        }
        ids.push(queued(&relay, json!({"run": run})));
        ids.push(queued(&relay, json!({"run": run, "second": true})));
        assert!(relay.stop().success());
        let (bytes, segments, prepared) = files(&dir);
        assert_eq!((segments, prepared), (1, 0), "run {run}: one small segment, nothing prepared");
        assert!(bytes <= 1 << 20, "run {run}: DATA_DIR takes {bytes} bytes for {} tasks", ids.len());
    }
    // A quarter of the head filled: the next file is prepared; restarts reuse it.
    let relay = start(&dir, &env);
    let pad = "q".repeat(1000);
    let items: Vec<String> = (0..300).map(|i| format!(r#"{{"payload":{{"i":{i},"pad":"{pad}"}}}}"#)).collect();
    let r = relay.api("POST", "/tasks/batch", Some(&format!(r#"{{"tasks":[{}]}}"#, items.join(","))));
    assert_eq!(r.status, 202);
    assert!(poll_until(Duration::from_secs(5), || files(&dir).2 == 1), "no next segment was prepared");
    assert!(relay.stop().success());
    let (before, _, _) = files(&dir);
    for run in 0..3 {
        let relay = start(&dir, &env);
        assert!(replay_ms(&relay) <= 200);
        queued(&relay, json!({"again": run}));
        assert!(relay.stop().success());
        let (bytes, segments, prepared) = files(&dir);
        assert!(prepared <= 1 && segments == 1, "restart {run}: {segments} segments, {prepared} prepared files");
        assert!(bytes <= before + 4096, "restart {run}: DATA_DIR grew from {before} to {bytes} bytes");
    }
    let relay = start(&dir, &env);
    for id in &ids {
        assert_eq!(relay.get_task(id)["status"], "pending");
    }
}

/// A crash between naming a prepared file of zeros as the new segment and writing its header
/// leaves an all-zero last segment: that is no damage (it was counted as corruption and
/// logged at error at every start).
#[test]
fn an_all_zero_last_segment_is_not_corruption() {
    let dir = DataDir::new("zeros");
    let relay = start(&dir, &[]);
    let ids: Vec<String> = (0..3).map(|i| queued(&relay, json!({"i": i}))).collect();
    assert!(relay.stop().success());
    let last = dir.segments().pop().expect("a segment");
    let n: u32 = last.file_stem().and_then(|s| s.to_str()?.parse().ok()).expect("number");
    std::fs::write(dir.0.join(format!("{:010}.journal", n + 1)), vec![0u8; 1 << 20]).expect("zeros");
    for round in 0..2 {
        let relay = start(&dir, &[]);
        assert_eq!(metric_value(&relay, "relay_journal_corrupt_records_total"), Some(0.0), "round {round}");
        assert!(!relay.log_text().contains("level=error"), "round {round}: {}", relay.log_text());
        for id in &ids {
            assert_eq!(relay.get_task(id)["status"], "pending");
        }
        queued(&relay, json!({"round": round}));
        assert!(relay.stop().success());
    }
}

/// The backup procedure (docs/operating.md, "Backups") must be safe while relay runs (SPEC §7):
/// the one the README gave (copy the segments in name order, the newest last) could keep an old
/// segment and miss a newer one that compaction deleted mid-copy, bringing forgotten tasks
/// back, or miss a long-waiting task carried forward into a segment made after the copy began.
/// Under load, with 4 KiB segments made and compacted away all the time (TASK_TTL 2 s),
/// `scripts/backup-data-dir.sh` takes snapshots; each one restores to a relay that has every
/// task acknowledged before the snapshot began, and shows every task that was done as done (or
/// forgotten), never pending.
#[test]
fn a_backup_taken_under_load_restores_every_task_acknowledged_before_it() {
    let dir = DataDir::new("backup");
    let env = [("JOURNAL_SEGMENT_SIZE", "4096"), ("TASK_TTL", "2s"), ("LOG_LEVEL", "info")];
    let relay = start(&dir, &env);
    let _worker = FakeWorker::connect(&relay, Some(json!({"type": "hello", "kinds": ["now"]})), Auto::Echo);
    relay.wait_clients(1, |_| true);
    // Every acknowledged task: when, its id, and its result if it was answered done.
    type Seen = Vec<(Instant, String, Option<Value>)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let load: Vec<_> = (0..3)
        .map(|c| {
            let (addr, seen, stop) = (relay.addr, seen.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::SeqCst) {
                    i += 1;
                    let waits = i % 4 == 0;
                    let (path, body) = if waits {
                        ("/tasks", json!({"payload": {"kind": "later", "c": c, "i": i}, "delay": "1h"}))
                    } else {
                        ("/tasks?wait=true", json!({"payload": {"kind": "now", "c": c, "i": i}}))
                    };
                    let (status, v) = try_call(addr, "POST", path, &body.to_string()).expect("an answer");
                    assert_eq!(status, if waits { 202 } else { 200 }, "{v}");
                    let id = v["task_id"].as_str().expect("id").to_string();
                    let result = (!waits).then(|| v["result"].clone());
                    seen.lock().expect("lock").push((Instant::now(), id, result));
                }
            })
        })
        .collect();
    // Compaction at work: the oldest segments are gone.
    let first = dir.0.join("0000000001.journal");
    let compacting = || seen.lock().expect("lock").len() > 100 && !first.exists();
    assert!(poll_until(Duration::from_secs(15), compacting), "no segment was ever compacted away");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/backup-data-dir.sh");
    let mut snapshots = Vec::new();
    for round in 0..3 {
        let snap = DataDir::new(&format!("snapshot{round}"));
        let began = Instant::now();
        let out = std::process::Command::new(script).arg(&dir.0).arg(&snap.0).output().expect("run the backup script");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        snapshots.push((began, snap));
    }
    stop.store(true, Ordering::SeqCst);
    for l in load {
        l.join().expect("load thread");
    }
    let seen = seen.lock().expect("lock").clone();
    for (round, (began, snap)) in snapshots.iter().enumerate() {
        let restored = DataDir::new("restored");
        std::fs::create_dir_all(&restored.0).expect("mkdir");
        for seg in std::fs::read_dir(&snap.0).expect("snapshot").map(|e| e.expect("entry").path()) {
            std::fs::copy(&seg, restored.0.join(seg.file_name().expect("name"))).expect("copy");
        }
        let relay = start(&restored, &env);
        let before: Vec<_> = seen.iter().filter(|(at, ..)| at < began).collect();
        assert!(before.len() > 50, "round {round}: too little load before the snapshot ({})", before.len());
        for (n, (_, id, result)) in before.iter().enumerate() {
            // (Every waiting task; a sample of the finished ones keeps the test short.)
            if result.is_some() && n % 3 != 0 {
                continue;
            }
            let r = relay.api("GET", &format!("/tasks/{id}"), None);
            match result {
                None => assert_eq!(
                    (r.status, r.json()["status"].as_str()),
                    (200, Some("pending")),
                    "round {round}: a task acknowledged before the snapshot is missing from it: {}",
                    r.text()
                ),
                Some(res) => assert!(
                    r.status == 404 || (r.json()["status"] == "done" && &r.json()["result"] == res),
                    "round {round}: task {id}, done before the snapshot, restored as {}",
                    r.text()
                ),
            }
        }
    }
}

/// An existing DATA_DIR kept its mode 0755 (a new one is made 0700, and BLOB_DIR is
/// tightened): other local users could read every payload and result.
#[test]
fn an_existing_data_dir_is_made_private() {
    use std::os::unix::fs::PermissionsExt;
    let dir = DataDir::new("mode");
    std::fs::create_dir_all(&dir.0).expect("mkdir");
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let relay = start(&dir, &[]);
    queued(&relay, json!(1));
    let mode = std::fs::metadata(&dir.0).expect("dir").permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
}

#[test]
fn the_listing_finds_finished_tasks_that_left_memory() {
    let dir = DataDir::new("list");
    let relay = start(&dir, &[("TASK_MEMORY", "8192")]);
    let worker = FakeWorker::connect(&relay, Some(json!({"type": "hello", "kinds": ["even", "odd"]})), Auto::Echo);
    let mut done = Vec::new();
    for i in 0..60 {
        let kind = if i % 2 == 0 { "even" } else { "odd" };
        let r = relay.api("POST", "/tasks?wait=true", Some(&json!({"payload": {"kind": kind, "i": i}}).to_string()));
        assert_eq!(r.status, 200);
        done.push(r.json());
    }
    let pending = queued(&relay, json!({"kind": "later", "i": "last"}));
    assert!(
        poll_until(Duration::from_secs(5), || metric_value(&relay, "relay_tasks_on_disk").is_some_and(|n| n > 20.0))
    );
    // Everything, newest first, in pages of 7: memory and disk mixed.
    let mut listed = Vec::new();
    let mut cursor = String::new();
    loop {
        let r = relay.api("GET", &format!("/tasks?limit=7{cursor}"), None);
        assert_eq!(r.status, 200, "{}", r.text());
        let page = r.json();
        listed.extend(page["tasks"].as_array().cloned().expect("tasks"));
        match page["next_cursor"].as_str() {
            Some(c) => cursor = format!("&cursor={c}"),
            None => break,
        }
    }
    let mut expected: Vec<Value> = done.iter().rev().cloned().collect();
    expected.insert(0, relay.get_task(&pending));
    assert_eq!(listed, expected, "every task once, newest first, as GET shows it");
    // Filters apply to tasks read back too.
    let evens = relay.api("GET", "/tasks?status=done&kind=even&limit=1000", None).json();
    let evens = evens["tasks"].as_array().cloned().expect("tasks");
    assert_eq!(evens.len(), 30);
    assert!(evens.iter().all(|t| t["kind"] == "even" && t["status"] == "done"));
    assert_eq!(evens.last(), done.first());
    drop(worker);
}

#[test]
fn batch_bodies_beyond_the_shared_budget_wait_and_are_all_answered() {
    // At most four MAX_BATCH_BYTES bodies are buffered at once; a fifth and sixth wait for room
    // and are read once one of the first four is answered.
    let relay = Relay::start_with(&[("MAX_BATCH_BYTES", "1500000"), ("HEADER_TIMEOUT", "20s")]);
    let mut body = String::from("{\"tasks\":[");
    while body.len() < 1_400_000 {
        body.push_str("{\"payload\":{\"pad\":\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"}},");
    }
    body.push_str("{\"payload\":1}]}");
    let auth = format!("Bearer {API}");
    let (first, rest) = body.as_bytes().split_at(1_300_000);
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let go_rx = Arc::new(Mutex::new(go_rx));
    let writers: Vec<_> = (0..6)
        .map(|_| {
            let mut c = Client::connect(relay.addr);
            let head = format!(
                "POST /tasks/batch HTTP/1.1\r\nHost: relay\r\nAuthorization: {auth}\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            let (first, rest, go) = (first.to_vec(), rest.to_vec(), go_rx.clone());
            std::thread::spawn(move || {
                c.send_raw(head.as_bytes());
                c.send_raw(&first);
                // Every body stays incomplete until the test has seen two of them wait.
                go.lock().expect("lock").recv().expect("go");
                c.send_raw(&rest);
                c.read_response().expect("an answer").status
            })
        })
        .collect();
    assert!(
        relay.wait_log("batch body waits for room", Duration::from_secs(10)),
        "the fifth and sixth bodies should wait: {}",
        relay.log_text()
    );
    for _ in 0..6 {
        go_tx.send(()).expect("go");
    }
    for w in writers {
        assert_eq!(w.join().expect("client"), 202);
    }
}
