//! Durability (SPEC §7): the journal in DATA_DIR across clean stops, `kill -9` and damage;
//! schedules, idempotency and batches across restarts; finished tasks over TASK_MEMORY read
//! back from disk; compaction. Each test owns a fresh DATA_DIR.

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
        // A random moment while the load runs.
        let at = Duration::from_millis(150 + next() % 450);
        std::thread::sleep(at);
        kill9(&mut relay);
        stop.store(true, Ordering::SeqCst);
        for c in clients {
            c.join().expect("client thread");
        }
        drop(workers);
        assert!(!acked.lock().expect("lock").is_empty(), "round {round} acknowledged nothing");
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

/// A disk that fills up: the write fails, relay must stop (exit non-zero), never answer 202
/// for what it could not write. Needs a small tmpfs, which needs root.
#[test]
fn a_failed_journal_write_is_fatal() {
    let mnt = DataDir::new("full");
    std::fs::create_dir_all(&mnt.0).expect("mkdir");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k", "tmpfs", mnt.path()])
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        return skip_or_fail("a_failed_journal_write_is_fatal", "cannot mount a tmpfs (not root?)");
    }
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(self.0).status();
        }
    }
    let _unmount = Unmount(&mnt.0);
    let data = mnt.0.join("data");
    let mut relay = Relay::start_with(&[("DATA_DIR", data.to_str().expect("path"))]);
    let big = "x".repeat(16 * 1024);
    let mut acked = 0;
    for _ in 0..64 {
        match try_call(relay.addr, "POST", "/tasks", &json!({"payload": big, "queue": true}).to_string()) {
            Some((202, _)) => acked += 1,
            _ => break,
        }
    }
    let status = relay.wait_exit(Duration::from_secs(10)).expect("relay exits when the disk is full");
    assert!(!status.success(), "exit status must be non-zero: {status:?}");
    assert!(relay.log_text().contains("journal write failed"), "{}", relay.log_text());
    assert!(acked < 64 && acked * 16 * 1024 <= 256 * 1024, "acknowledged {acked} tasks of 16 KiB on a 256 KiB disk");
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
