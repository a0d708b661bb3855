//! Flow control (SPEC §14): priorities (a head start in seconds over due order), in both modes.

use std::io::{Read, Write};
use std::net::TcpStream;
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

/// A hostile probe: `"key":5` and a 200-byte key were accepted (202); SPEC §14 says another
/// type or more than 128 bytes → 400, on a submit as on a batch item.
#[test]
fn a_fairness_key_is_a_string_of_at_most_128_bytes() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let long = "k".repeat(128);
        for bad in ["5".to_string(), "true".into(), "{}".into(), "[\"a\"]".into(), format!("\"{long}k\"")] {
            let r = relay.submit(&format!(r#"{{"payload":1,"queue":true,"key":{bad}}}"#));
            assert_eq!((r.status, r.error()), (400, "bad_request".to_string()), "key {bad}: {}", r.text());
        }
        for good in ["\"\"".to_string(), "\"c1\"".into(), "null".into(), format!("\"{long}\"")] {
            id_of(&relay.submit(&format!(r#"{{"payload":1,"queue":true,"key":{good}}}"#)));
        }
        let batch =
            relay.api("POST", "/tasks/batch", Some(r#"{"tasks":[{"payload":1,"key":"c2"},{"payload":2,"key":7}]}"#));
        assert_eq!(batch.status, 202, "{}", batch.text());
        let items = batch.json()["tasks"].as_array().expect("tasks").clone();
        assert!(items[0]["task_id"].is_string(), "{items:?}");
        assert_eq!(items[1]["error"], "bad_request", "{items:?}");
    });
}

/// A hostile probe: `PUT /kinds/c++` set the policy of the kind "c  " (`+` read as a space, as
/// in a query), and `PUT /kinds/%E2%82` (not UTF-8) set one for "\u{FFFD}". In a path `+` is
/// itself, and a kind that is not UTF-8 is a 400.
#[test]
fn a_kind_in_the_path_keeps_its_plus_signs_and_must_be_utf8() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let set = relay.api("PUT", "/kinds/c++", Some(r#"{"max_running":2}"#));
        assert_eq!(set.status, 200, "{}", set.text());
        assert_eq!(set.json()["kind"], "c++", "{}", set.text());
        let got = relay.api("GET", "/kinds/c%2B%2B", None);
        assert_eq!((got.status, got.json()["policy"].clone()), (200, json!({"max_running": 2})), "{}", got.text());
        let bad = relay.api("PUT", "/kinds/%E2%82", Some("{}"));
        assert_eq!((bad.status, bad.error()), (400, "bad_request".to_string()), "{}", bad.text());
        let listed = relay.api("GET", "/kinds", None).json();
        let names: Vec<&str> =
            listed["kinds"].as_array().expect("kinds").iter().filter_map(|k| k["kind"].as_str()).collect();
        assert_eq!(names, ["c++"], "{listed}");
    });
}

/// A hostile probe, cluster: `relay_dispatch_held_total{reason="rate"}` grew by ten a second
/// per node while one task waited for a token (every 100 ms look at the limited backlog counted
/// it again), where one node counts a kind once as it is held. A held task is counted once here.
#[test]
fn a_task_held_for_long_is_one_held_dispatch_not_one_per_look() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let w =
            FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["slow"],"concurrency":4})), Auto::Manual);
        relay.wait_clients(1, |c| c["concurrency"] == 4);
        put_policy(&relay, "slow", r#"{"rate":"1/h"}"#);
        let series = r#"relay_dispatch_held_total{reason="rate"}"#;
        let before = relay.metric(series);
        id_of(&relay.submit(r#"{"payload":{"kind":"slow","n":1},"queue":true}"#));
        let second = id_of(&relay.submit(r#"{"payload":{"kind":"slow","n":2},"queue":true}"#));
        assert!(w.next_task(Duration::from_secs(5)).is_some(), "the bucket's one token runs the first");
        assert!(
            poll_until(Duration::from_secs(5), || relay.get_task(&second)["waiting_on"] == "rate"
                && relay.metric(series) > before),
            "{} {}",
            relay.get_task(&second),
            relay.metric(series)
        );
        // (Not a synchronisation: the time over which the count must not grow.)
        std::thread::sleep(Duration::from_millis(1_500));
        let held = relay.metric(series) - before;
        assert!((1.0..=2.0).contains(&held), "one task held for 1.5 s counted {held} times");
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

/// A task's fairness key is shown in its JSON when one was given (`""` is no key), and a task
/// keeps its key and its submitter across a restart.
#[test]
fn a_key_is_shown_in_the_task_json_and_survives_a_restart() {
    for_each_mode(|mode| {
        let dir = TempDir::new("fair-key");
        let relay = durable(mode, &dir, &[]);
        let keyed = queued(&relay, "a", r#","key":"customer-7""#);
        let plain = queued(&relay, "b", r#","key":"""#);
        let shown = |relay: &Relay| {
            assert!(relay.get_task(&plain).get("key").is_none(), "no key given, none shown");
            relay.get_task(&keyed)["key"].clone()
        };
        assert_eq!(shown(&relay), "customer-7");
        let relay = restart(relay, &dir, &[]);
        assert_eq!(shown(&relay), "customer-7", "kept across a restart");
    });
}

// ----- kind policies -------------------------------------------------------------------------

fn put_policy(relay: &Relay, kind: &str, body: &str) -> Value {
    let r = relay.api("PUT", &format!("/kinds/{kind}"), Some(body));
    assert_eq!(r.status, 200, "PUT /kinds/{kind} {body}: {}", r.text());
    r.json()
}

#[test]
fn kind_policies_are_validated_set_read_listed_and_removed() {
    for_each_mode(|mode| {
        let relay = mode.start();
        assert_eq!(relay.api("GET", "/kinds/never", None).status, 404, "a kind relay never saw");
        for bad in [
            r#"{"max_running":0}"#,
            r#"{"max_running":1.5}"#,
            r#"{"rate":"10/d"}"#,
            r#"{"rate":"0/s"}"#,
            r#"{"burst":0}"#,
            r#"{"paused":"yes"}"#,
            r#"{"unknown":1}"#,
            "[]",
            "not json",
        ] {
            let r = relay.api("PUT", "/kinds/k", Some(bad));
            assert_eq!((r.status, r.error()), (400, "bad_request".to_string()), "{bad}: {}", r.text());
        }
        assert_eq!(relay.api("GET", "/kinds/k", None).status, 404, "nothing was stored");
        let full =
            r#"{"max_running":2,"max_running_per_key":1,"rate":"600/m","burst":3,"rate_per_key":"1/s","paused":true}"#;
        let got = put_policy(&relay, "k", full);
        let policy: Value = serde_json::from_str(full).expect("json");
        assert_eq!(got, json!({"kind": "k", "policy": policy, "running": 0, "pending": 0}));
        assert_eq!(relay.api("GET", "/kinds/k", None).json(), got);
        let queued_id = queued(&relay, "x", "");
        let other = id_of(&relay.submit(r#"{"payload":{"kind":"other"},"queue":true}"#));
        let list = relay.api("GET", "/kinds", None).json();
        let kinds: Vec<&str> =
            list["kinds"].as_array().expect("kinds").iter().filter_map(|k| k["kind"].as_str()).collect();
        assert_eq!(kinds, ["k", "other"], "policies and kinds with tasks: {list}");
        assert_eq!(list["kinds"][1], json!({"kind": "other", "policy": {}, "running": 0, "pending": 1}));
        let gone = relay.api("DELETE", "/kinds/k", None);
        assert_eq!((gone.status, gone.json()), (200, json!({"kind": "k", "policy": {}, "running": 0, "pending": 0})));
        assert_eq!(relay.api("GET", "/kinds/k", None).status, 404, "no policy and no tasks");
        let replaced = put_policy(&relay, "other", r#"{"max_running":1}"#);
        assert_eq!(replaced["pending"], 1);
        let replaced = put_policy(&relay, "other", r#"{"rate":"5/s"}"#);
        assert_eq!(replaced["policy"], json!({"rate": "5/s"}), "a PUT replaces the whole policy");
        drop((queued_id, other));
    });
}

#[test]
fn a_paused_kind_accepts_submits_finishes_what_runs_and_resumes_in_order() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let w =
            FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["p","q"],"concurrency":1})), Auto::Manual);
        relay.wait_clients(1, |c| c["concurrency"] == 1);
        let running = id_of(&relay.submit(r#"{"payload":{"kind":"p","n":"running"}}"#));
        let first = w.expect_task();
        assert_eq!(first.id, running);
        put_policy(&relay, "p", r#"{"paused":true}"#);
        // Plain submits (no queue) are accepted and wait, as batch items do.
        let a = id_of(&relay.submit(r#"{"payload":{"kind":"p","n":"a"}}"#));
        id_of(&relay.submit(r#"{"payload":{"kind":"p","n":"b"},"priority":5}"#));
        let c = id_of(&relay.submit(r#"{"payload":{"kind":"p","n":"c"}}"#));
        w.done(&running, json!(null));
        relay.wait_status(&running, "done", Duration::from_secs(5));
        // Another kind is not held.
        let q = id_of(&relay.submit(r#"{"payload":{"kind":"q","n":"q"}}"#));
        let t = w.expect_task();
        assert_eq!(t.id, q, "a pause on one kind never delays another");
        w.done(&q, json!(null));
        assert!(w.no_task(Duration::from_millis(500)), "nothing of the paused kind runs");
        let task = relay.get_task(&a);
        assert_eq!((task["status"].as_str(), task["waiting_on"].as_str()), (Some("pending"), Some("paused")), "{task}");
        assert_eq!(relay.metric("relay_dispatch_held_total{reason=\"paused\"}"), 3.0);
        let kind = relay.api("GET", "/kinds/p", None).json();
        assert_eq!((kind["pending"].as_u64(), kind["running"].as_u64()), (Some(3), Some(0)), "{kind}");
        put_policy(&relay, "p", r#"{"paused":false}"#);
        assert_eq!(run_in_order(&w, 3), ["b", "a", "c"], "in order once resumed");
        drop(c);
        // With no worker at all, a paused kind's plain submit still waits (not 503).
        drop(w);
        relay.wait_clients(0, |_| true);
        put_policy(&relay, "p", r#"{"paused":true}"#);
        let waits = id_of(&relay.submit(r#"{"payload":{"kind":"p","n":"alone"}}"#));
        assert_eq!(relay.get_task(&waits)["waiting_on"], "paused");
        let deleted = relay.api("DELETE", "/kinds/p", None);
        assert_eq!(deleted.status, 200);
        let w = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["p"],"concurrency":1})), Auto::Manual);
        assert_eq!(w.expect_task().id, waits, "deleting the policy resumes the kind");
    });
}

#[test]
fn policies_survive_a_restart() {
    for_each_mode(|mode| {
        let dir = TempDir::new("policy");
        let relay = durable(mode, &dir, &[]);
        put_policy(&relay, "a", r#"{"max_running":4,"rate":"10/s"}"#);
        put_policy(&relay, "b", r#"{"paused":true}"#);
        put_policy(&relay, "c", r#"{"max_running":1}"#);
        assert_eq!(relay.api("DELETE", "/kinds/c", None).status, 200);
        queued(&relay, "held", "");
        let held = id_of(&relay.submit(r#"{"payload":{"kind":"b"},"queue":true}"#));
        let relay = restart(relay, &dir, &[]);
        let list = relay.api("GET", "/kinds", None).json();
        assert_eq!(
            list,
            json!({"kinds": [
                {"kind": "a", "policy": {"max_running": 4, "rate": "10/s"}, "running": 0, "pending": 0},
                {"kind": "b", "policy": {"paused": true}, "running": 0, "pending": 1},
            ]}),
            "after the restart"
        );
        let w = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["b"]})), Auto::Manual);
        assert!(w.no_task(Duration::from_millis(800)), "b is still paused");
        assert_eq!(relay.get_task(&held)["waiting_on"], "paused");
    });
}

/// A hostile probe (single node, journal): a task of a kind with `"rate": "1/h"` ran, relay was
/// killed (kill -9, or SIGTERM) and started again, and the kind's next task ran at once — the
/// restart had refilled the bucket, and a key's `rate_per_key` bucket too, so a limit of one an
/// hour ran twice within a second. The buckets a dispatch takes from are journaled (the cluster
/// keeps them in the database).
#[test]
fn a_restart_refills_no_rate_bucket() {
    for_each_mode(|mode| {
        for sig in ["KILL", "TERM"] {
            let dir = TempDir::new("buckets");
            let mut relay = durable(mode, &dir, &[]);
            put_policy(&relay, "slow", r#"{"rate":"1/h"}"#);
            put_policy(&relay, "per-key", r#"{"rate_per_key":"1/h","burst":2}"#);
            let hello = json!({"type":"hello","kinds":["slow","per-key"],"concurrency":8});
            let w = FakeWorker::connect(&relay, Some(hello.clone()), Auto::Manual);
            relay.wait_clients(1, |c| c["concurrency"] == 8);
            for body in [
                r#"{"payload":{"kind":"slow"}}"#,
                r#"{"payload":{"kind":"per-key"},"key":"c1"}"#,
                r#"{"payload":{"kind":"per-key"},"key":"c1"}"#,
            ] {
                let id = id_of(&relay.submit(body));
                let t = w.expect_task();
                assert_eq!(t.id, id, "{body}: its bucket's token");
                w.done(&t.id, json!(null));
                relay.wait_status(&id, "done", Duration::from_secs(5));
            }
            drop(w);
            let db = relay.db.clone();
            relay.signal(sig);
            assert!(relay.wait_exit(Duration::from_secs(10)).is_some(), "relay exits after SIG{sig}");
            let relay = match db {
                Some(db) => Mode::start_on(db, &[]),
                None => Relay::start_with(&[("DATA_DIR", dir.path())]),
            };
            let w = FakeWorker::connect(&relay, Some(hello), Auto::Manual);
            relay.wait_clients(1, |c| c["concurrency"] == 8);
            let held = [
                id_of(&relay.submit(r#"{"payload":{"kind":"slow"},"queue":true}"#)),
                id_of(&relay.submit(r#"{"payload":{"kind":"per-key"},"key":"c1","queue":true}"#)),
            ];
            let other_key = id_of(&relay.submit(r#"{"payload":{"kind":"per-key"},"key":"c2","queue":true}"#));
            let t = w.expect_task();
            assert_eq!(t.id, other_key, "after SIG{sig}: only the key whose bucket is full runs");
            w.done(&t.id, json!(null));
            assert!(w.no_task(Duration::from_millis(800)), "after SIG{sig}: a bucket emptied before it refilled");
            for id in &held {
                let task = relay.get_task(id);
                assert_eq!(
                    (task["status"].as_str(), task["waiting_on"].as_str()),
                    (Some("pending"), Some("rate")),
                    "{task}"
                );
            }
        }
    });
}

#[test]
fn a_policy_set_on_one_node_applies_on_another_within_a_second() {
    let pg = match crate::support::pg::shared() {
        Ok(pg) => pg,
        Err(why) => {
            assert!(!crate::support::pg::required(), "PostgreSQL is required: {why}");
            crate::support::skip_or_fail("a_policy_set_on_one_node_applies_on_another_within_a_second", &why);
            return;
        }
    };
    let db = std::sync::Arc::new(crate::support::pg::TestDb::create(pg));
    let one = Mode::start_on(db.clone(), &[]);
    let two = Mode::start_on(db, &[]);
    let w = FakeWorker::connect(&two, Some(json!({"type":"hello","kinds":["k"],"concurrency":4})), Auto::Manual);
    two.wait_clients(1, |c| c["concurrency"] == 4);
    put_policy(&one, "k", r#"{"paused":true}"#);
    // A second later (what SPEC §14 allows) the other node holds the kind back too.
    let set = std::time::Instant::now();
    poll_until(Duration::from_secs(2), || set.elapsed() >= Duration::from_secs(1));
    let id = id_of(&two.submit(r#"{"payload":{"kind":"k"}}"#));
    assert!(w.no_task(Duration::from_millis(700)), "paused on every node");
    assert_eq!(two.get_task(&id)["waiting_on"], "paused");
    assert_eq!(one.api("DELETE", "/kinds/k", None).status, 200);
    assert_eq!(w.next_task(Duration::from_secs(3)).map(|t| t.id), Some(id), "resumed on every node");
}

/// A hostile probe, cluster: every `DELETE /kinds/{name}` left a row in relay_kind_policies,
/// for any name, with or without a policy (300 deletes of made-up names: 300 rows, kept for
/// ever, and every node reads them all when it starts). Removing no policy now writes nothing;
/// removing one still tells the other nodes.
#[test]
fn deleting_a_policy_that_is_not_there_stores_nothing() {
    let pg = match crate::support::pg::shared() {
        Ok(pg) => pg,
        Err(why) => {
            assert!(!crate::support::pg::required(), "PostgreSQL is required: {why}");
            crate::support::skip_or_fail("deleting_a_policy_that_is_not_there_stores_nothing", &why);
            return;
        }
    };
    let db = std::sync::Arc::new(crate::support::pg::TestDb::create(pg));
    let one = Mode::start_on(db.clone(), &[]);
    let two = Mode::start_on(db.clone(), &[]);
    for i in 0..50 {
        let r = one.api("DELETE", &format!("/kinds/made-up-{i}"), None);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["policy"], json!({}));
    }
    assert_eq!(db.query("SELECT count(*) FROM relay_kind_policies"), ["0"], "no row for a policy never set");
    // A real removal still reaches the other node.
    let w = FakeWorker::connect(&two, Some(json!({"type":"hello","kinds":["k"],"concurrency":4})), Auto::Manual);
    two.wait_clients(1, |c| c["concurrency"] == 4);
    put_policy(&one, "k", r#"{"paused":true}"#);
    let set = std::time::Instant::now();
    poll_until(Duration::from_secs(2), || set.elapsed() >= Duration::from_millis(1_100));
    let id = id_of(&two.submit(r#"{"payload":{"kind":"k"}}"#));
    assert_eq!(two.get_task(&id)["waiting_on"], "paused");
    assert_eq!(one.api("DELETE", "/kinds/k", None).status, 200);
    assert_eq!(one.api("DELETE", "/kinds/k", None).status, 200, "a second removal is no change");
    assert_eq!(w.next_task(Duration::from_secs(3)).map(|t| t.id), Some(id), "resumed on the other node");
    assert_eq!(db.query("SELECT count(*) FROM relay_kind_policies WHERE policy IS NULL"), ["1"]);
}

/// A node that sets a policy of its own right after another node set one must still learn the
/// other's: its own change (a higher `changed` number) is no mark that it read the smaller ones.
#[test]
fn a_node_that_sets_a_policy_still_learns_the_one_another_node_set_just_before() {
    let pg = match crate::support::pg::shared() {
        Ok(pg) => pg,
        Err(why) => {
            assert!(!crate::support::pg::required(), "PostgreSQL is required: {why}");
            crate::support::skip_or_fail(
                "a_node_that_sets_a_policy_still_learns_the_one_another_node_set_just_before",
                &why,
            );
            return;
        }
    };
    let db = std::sync::Arc::new(crate::support::pg::TestDb::create(pg));
    let one = Mode::start_on(db.clone(), &[]);
    let two = Mode::start_on(db, &[]);
    let w = FakeWorker::connect(&two, Some(json!({"type":"hello","kinds":["k"],"concurrency":4})), Auto::Manual);
    two.wait_clients(1, |c| c["concurrency"] == 4);
    // Back to back: node two sets its own policy before its once-a-second read of changes.
    put_policy(&one, "k", r#"{"paused":true}"#);
    put_policy(&two, "other", r#"{"max_running":9}"#);
    let set = std::time::Instant::now();
    poll_until(Duration::from_secs(3), || set.elapsed() >= Duration::from_millis(1_500));
    let id = id_of(&two.submit(r#"{"payload":{"kind":"k"}}"#));
    assert!(w.no_task(Duration::from_millis(700)), "paused on node two as well");
    assert_eq!(two.get_task(&id)["waiting_on"], "paused");
}

// ----- limits --------------------------------------------------------------------------------

#[test]
fn max_running_is_never_exceeded_over_many_workers_and_holds_no_other_kind() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let workers: Vec<FakeWorker> = (0..5)
            .map(|_| {
                FakeWorker::connect(
                    &relay,
                    Some(json!({"type":"hello","kinds":["m","free"],"concurrency":4})),
                    Auto::Manual,
                )
            })
            .collect();
        relay.wait_clients(5, |c| c["concurrency"] == 4);
        put_policy(&relay, "m", r#"{"max_running":2}"#);
        let ids: Vec<String> = (0..20)
            .map(|i| id_of(&relay.submit(&format!(r#"{{"payload":{{"kind":"m","n":{i}}},"queue":true}}"#))))
            .collect();
        // Running as the workers see it: sent and not answered yet.
        let mut running: Vec<(usize, String)> = Vec::new();
        let mut done = 0;
        let mut most = 0;
        let mut checked_free = false;
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while done < ids.len() && std::time::Instant::now() < deadline {
            for (i, w) in workers.iter().enumerate() {
                while let Some(t) = w.next_task(Duration::from_millis(20)) {
                    running.push((i, t.id));
                }
            }
            most = most.max(running.len());
            assert!(running.len() <= 2, "max_running 2 exceeded: {running:?}");
            if running.len() == 2 && !checked_free {
                checked_free = true;
                let pending = ids
                    .iter()
                    .find(|id| running.iter().all(|r| &r.1 != *id) && relay.get_task(id)["status"] == "pending");
                if let Some(p) = pending {
                    assert_eq!(relay.get_task(p)["waiting_on"], "concurrency");
                }
                assert_eq!(relay.api("GET", "/kinds/m", None).json()["running"], 2);
                // Another kind is not held back by m's cap.
                let free = id_of(&relay.submit(r#"{"payload":{"kind":"free"}}"#));
                let got = poll_until(Duration::from_secs(3), || {
                    workers.iter().any(|w| w.next_task(Duration::from_millis(10)).is_some_and(|t| t.id == free))
                });
                assert!(got, "a cap on one kind never delays another");
            }
            if let Some((i, id)) = (!running.is_empty()).then(|| running.remove(0)) {
                workers[i].done(&id, json!(null));
                done += 1;
            }
        }
        assert_eq!(done, ids.len(), "every task ran");
        assert_eq!(most, 2, "the cap was used");
        assert!(relay.metric("relay_dispatch_held_total{reason=\"concurrency\"}") >= 1.0);
        // (Cluster mode counts the kind's tasks once a second.)
        assert!(poll_until(Duration::from_secs(3), || relay.metric("relay_kind_pending{kind=\"m\"}") == 0.0));
    });
}

#[test]
fn rate_bounds_dispatch_starts_with_a_full_bucket_and_holds_no_other_kind() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let w = FakeWorker::connect(
            &relay,
            Some(json!({"type":"hello","kinds":["r","free"],"concurrency":100})),
            Auto::Manual,
        );
        relay.wait_clients(1, |c| c["concurrency"] == 100);
        put_policy(&relay, "r", r#"{"rate":"10/s","burst":4}"#);
        let start = std::time::Instant::now();
        let ids: Vec<String> = (0..24)
            .map(|i| id_of(&relay.submit(&format!(r#"{{"payload":{{"kind":"r","n":{i}}},"queue":true}}"#))))
            .collect();
        let mut starts: Vec<f64> = Vec::new();
        let mut checked = false;
        while starts.len() < ids.len() && start.elapsed() < Duration::from_secs(10) {
            if let Some(t) = w.next_task(Duration::from_millis(50)) {
                starts.push(start.elapsed().as_secs_f64());
                w.done(&t.id, json!(null));
            }
            if !checked && starts.len() >= 4 {
                checked = true;
                let waiting: Vec<Value> =
                    ids.iter().map(|id| relay.get_task(id)).filter(|t| t["status"] == "pending").collect();
                assert!(waiting.iter().any(|t| t["waiting_on"] == "rate"), "{waiting:?}");
                let free = id_of(&relay.submit(r#"{"payload":{"kind":"free"}}"#));
                let got = poll_until(Duration::from_secs(2), || match w.next_task(Duration::from_millis(10)) {
                    Some(t) if t.id == free => true,
                    Some(t) => {
                        starts.push(start.elapsed().as_secs_f64());
                        w.done(&t.id, json!(null));
                        false
                    }
                    None => false,
                });
                assert!(got, "a rate on one kind never delays another");
            }
        }
        assert_eq!(starts.len(), ids.len(), "every task ran: {starts:?}");
        // A bucket of 4 that starts full, then 10 a second: by time t at most 4 + 10 t started
        // (a little slack for the test's own timing), and the 24 take about 2 s.
        for (n, t) in starts.iter().enumerate() {
            assert!((n + 1) as f64 <= 4.0 + 10.0 * t + 1.5, "start {} at {t:.3}s is too early: {starts:?}", n + 1);
        }
        let took = starts[ids.len() - 1];
        assert!((1.6..4.0).contains(&took), "24 starts at 10/s after a burst of 4 took {took:.2}s: {starts:?}");
        assert!(relay.metric("relay_dispatch_held_total{reason=\"rate\"}") >= 1.0);
    });
}

#[test]
fn max_running_holds_for_the_whole_cluster_with_three_nodes_claiming_at_once() {
    let pg = match crate::support::pg::shared() {
        Ok(pg) => pg,
        Err(why) => {
            assert!(!crate::support::pg::required(), "PostgreSQL is required: {why}");
            crate::support::skip_or_fail(
                "max_running_holds_for_the_whole_cluster_with_three_nodes_claiming_at_once",
                &why,
            );
            return;
        }
    };
    let db = std::sync::Arc::new(crate::support::pg::TestDb::create(pg));
    let nodes: Vec<Relay> = (0..3).map(|_| Mode::start_on(db.clone(), &[])).collect();
    let mut workers = Vec::new();
    for node in &nodes {
        for _ in 0..3 {
            workers.push(FakeWorker::connect(
                node,
                Some(json!({"type":"hello","kinds":["m"],"concurrency":4})),
                Auto::Manual,
            ));
        }
    }
    nodes[0].wait_clients(9, |c| c["concurrency"] == 4);
    put_policy(&nodes[0], "m", r#"{"max_running":3}"#);
    // Every node knows the policy before the tasks come (SPEC §14: within a second).
    let set = std::time::Instant::now();
    poll_until(Duration::from_secs(2), || set.elapsed() >= Duration::from_millis(1_100));
    let body = (0..40).map(|i| format!(r#"{{"payload":{{"kind":"m","n":{i}}}}}"#)).collect::<Vec<_>>().join(",");
    let batch = nodes[1].api("POST", "/tasks/batch", Some(&format!(r#"{{"tasks":[{body}]}}"#)));
    assert_eq!(batch.status, 202, "{}", batch.text());
    let mut running: Vec<(usize, String)> = Vec::new();
    let (mut done, mut most) = (0, 0);
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    let mut last_new = std::time::Instant::now();
    while done < 40 && std::time::Instant::now() < deadline {
        for (i, w) in workers.iter().enumerate() {
            while let Some(t) = w.next_task(Duration::from_millis(5)) {
                running.push((i, t.id));
                last_new = std::time::Instant::now();
            }
        }
        most = most.max(running.len());
        assert!(running.len() <= 3, "max_running 3 exceeded across nodes: {running:?}");
        // Answer one when the cap is reached (or nothing more comes for a while: the tail).
        if !running.is_empty() && (running.len() == 3 || last_new.elapsed() > Duration::from_millis(600)) {
            let (i, id) = running.remove(0);
            workers[i].done(&id, json!(null));
            done += 1;
        }
    }
    assert_eq!(done, 40, "every task ran");
    assert_eq!(most, 3, "the cap was used");
}

/// A limited kind whose lock another claim holds (here a session of the test's own holds it)
/// delays no other kind (SPEC §14: a limit never blocks other kinds): a worker of kinds `a`
/// and `b` (both limited) and `c` (not) is sent `b`'s and `c`'s tasks at once while `a`'s lock
/// is held, and `a`'s task once it is free. Before, the claim waited for the lock of every
/// limited kind of the group: the node's whole transaction — and its one connection — stalled
/// behind `a`'s lock, and nothing of any kind was dispatched.
#[test]
fn a_limited_kind_another_claim_holds_delays_no_other_kind() {
    let pg = match crate::support::pg::shared() {
        Ok(pg) => pg,
        Err(why) => {
            assert!(!crate::support::pg::required(), "PostgreSQL is required: {why}");
            crate::support::skip_or_fail("a_limited_kind_another_claim_holds_delays_no_other_kind", &why);
            return;
        }
    };
    let db = std::sync::Arc::new(crate::support::pg::TestDb::create(pg));
    let relay = Mode::start_on(db.clone(), &[]);
    let w =
        FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["a","b","c"],"concurrency":4})), Auto::Manual);
    relay.wait_clients(1, |c| c["concurrency"] == 4);
    put_policy(&relay, "a", r#"{"max_running":10}"#);
    put_policy(&relay, "b", r#"{"rate":"100/s"}"#);
    let params = relay::pg::url::parse(&db.url()).expect("test database url");
    let mut other = relay::pg::wire::Conn::connect(&params, relay::pg::wire::Timeouts::default()).expect("connect");
    other.simple("SELECT pg_advisory_lock(hashtextextended('relay kind a', 0))").expect("lock kind a");
    let batch = relay.api(
        "POST",
        "/tasks/batch",
        Some(r#"{"tasks":[{"payload":{"kind":"a"}},{"payload":{"kind":"b"}},{"payload":{"kind":"c"}}]}"#),
    );
    assert_eq!(batch.status, 202, "{}", batch.text());
    let ids: Vec<String> = batch.json()["tasks"]
        .as_array()
        .expect("tasks")
        .iter()
        .map(|t| t["task_id"].as_str().expect("task_id").to_string())
        .collect();
    let mut got = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while got.len() < 2 && std::time::Instant::now() < deadline {
        if let Some(t) = w.next_task(Duration::from_millis(50)) {
            got.push(t.id.clone());
            w.done(&t.id, json!(null));
        }
    }
    got.sort();
    let mut others = vec![ids[1].clone(), ids[2].clone()];
    others.sort();
    assert_eq!(got, others, "b's and c's tasks run while another claim holds a's lock");
    assert_eq!(relay.get_task(&ids[0])["status"], "pending", "a waits for its lock");
    other.simple("SELECT pg_advisory_unlock(hashtextextended('relay kind a', 0))").expect("unlock kind a");
    let t = w.next_task(Duration::from_secs(3)).expect("a's task runs once its lock is free");
    assert_eq!(t.id, ids[0]);
    w.done(&t.id, json!(null));
    other.close();
}

// ----- counts --------------------------------------------------------------------------------

/// What `GET /kinds/{kind}` and `GET /kinds` say of `kind` (pending, running; (0, 0) when the
/// kind is not listed), and what `/metrics` says (the kind has a policy).
fn kind_counts(relay: &Relay, kind: &str) -> ((u64, u64), (u64, u64), (u64, u64)) {
    let of = |v: &Value| (v["pending"].as_u64().unwrap_or(0), v["running"].as_u64().unwrap_or(0));
    let one = relay.api("GET", &format!("/kinds/{kind}"), None);
    let one = if one.status == 200 { of(&one.json()) } else { (0, 0) };
    let list = relay.api("GET", "/kinds", None).json();
    let listed = list["kinds"].as_array().and_then(|ks| ks.iter().find(|k| k["kind"] == kind)).map_or((0, 0), of);
    let text = relay.metrics();
    let gauge = |name: &str| metric_value(&text, &format!("{name}{{kind=\"{kind}\"}}")).map_or(u64::MAX, |v| v as u64);
    (one, listed, (gauge("relay_kind_pending"), gauge("relay_kind_running")))
}

/// The kind's pending and running tasks as the database holds them.
fn kind_rows(db: &crate::support::pg::TestDb, kind: &str) -> (u64, u64) {
    let n = |sql: String| db.query(&sql).first().and_then(|v| v.parse().ok()).unwrap_or(u64::MAX);
    (
        n(format!("SELECT count(*) FROM relay_pending WHERE kind = '{kind}'")),
        n(format!("SELECT count(*) FROM relay_running WHERE kind = '{kind}'")),
    )
}

/// Waits until `relay`'s answers for `kind` (its `/kinds/{kind}`, its entry in `/kinds`, its
/// gauges, at most a second old) all equal `want` (pending, running), and checks the database
/// holds as many rows.
fn assert_kind_counts(relay: &Relay, db: &crate::support::pg::TestDb, kind: &str, want: (u64, u64)) {
    let mut last = kind_counts(relay, kind);
    let ok = poll_until(Duration::from_secs(5), || {
        last = kind_counts(relay, kind);
        last == (want, want, want)
    });
    assert!(ok, "kind {kind}: (/kinds/{kind}, /kinds, gauges) {last:?}, want {want:?}");
    assert_eq!(kind_rows(db, kind), want, "kind {kind}: the rows in the database");
}

/// Waits until `relay`'s answers for `kind` equal the rows the database holds, whatever they are.
fn assert_kind_counts_are_the_rows(relay: &Relay, db: &crate::support::pg::TestDb, kind: &str) {
    let (mut got, mut rows) = (kind_counts(relay, kind), kind_rows(db, kind));
    let ok = poll_until(Duration::from_secs(5), || {
        rows = kind_rows(db, kind);
        got = kind_counts(relay, kind);
        got == (rows, rows, rows) && kind_rows(db, kind) == rows
    });
    assert!(ok, "kind {kind}: (/kinds/{kind}, /kinds, gauges) {got:?}, the rows {rows:?}");
}

/// Cluster (schema version 16): `/kinds` and the kind gauges read pending counts the triggers
/// on `relay_pending` keep per node and kind, not a count of the queue; they stay exact through
/// every way a task enters or leaves the queue — submits on two nodes, claims, a failed attempt's
/// retry, a worker's loss (its attempts back to pending), a cancel and a re-run, a node's death
/// (its attempts adopted, its count rows folded into the zero node's an hour later), expiry in
/// the queue — and kinds whose tasks are all gone lose their count rows.
#[test]
fn kind_counts_stay_exact_through_every_path_of_the_queue_and_a_nodes_death() {
    let pg = match crate::support::pg::shared() {
        Ok(pg) => pg,
        Err(why) => {
            assert!(!crate::support::pg::required(), "PostgreSQL is required: {why}");
            crate::support::skip_or_fail(
                "kind_counts_stay_exact_through_every_path_of_the_queue_and_a_nodes_death",
                &why,
            );
            return;
        }
    };
    let db = std::sync::Arc::new(crate::support::pg::TestDb::create(pg));
    // (Attempts run for as long as the test needs them to.)
    let env = [("TASK_TIMEOUT", "120s")];
    let mut one = Mode::start_on(db.clone(), &env);
    let two = Mode::start_on(db.clone(), &env);
    put_policy(&one, "k", r#"{"max_running":100}"#);
    let task = r#"{"payload":{"kind":"k"},"queue":true,"max_retries":5,"retry":{"any_worker":true}}"#;
    let ids: Vec<String> =
        (0..5).map(|_| id_of(&one.submit(task))).chain((0..3).map(|_| id_of(&two.submit(task)))).collect();
    assert_kind_counts(&one, &db, "k", (8, 0));
    assert_kind_counts(&two, &db, "k", (8, 0));

    // Claims by node two's workers: `spare` (1 slot, so that a retry always has an untried
    // worker) and `w` (3 slots).
    let spare = FakeWorker::connect(&two, Some(json!({"type":"hello","kinds":["k"],"concurrency":1})), Auto::Manual);
    spare.expect_task();
    let w = FakeWorker::connect(&two, Some(json!({"type":"hello","kinds":["k"],"concurrency":3})), Auto::Manual);
    let mut running: Vec<String> = (0..3).map(|_| w.expect_task().id).collect();
    assert_kind_counts(&one, &db, "k", (4, 4));
    // A failed attempt goes back to pending for its retry; its slot takes the next task.
    let failed = running.remove(0);
    w.fail(&failed, "boom");
    running.push(w.expect_task().id);
    assert_eq!(two.get_task(&failed)["attempt_log"][0]["outcome"], "failed");
    assert_kind_counts(&two, &db, "k", (4, 4));
    // Done: one leaves for good.
    w.done(&running.remove(0), json!(null));
    running.push(w.expect_task().id);
    assert_kind_counts(&one, &db, "k", (3, 4));
    // A cancel of a waiting task, then its re-run.
    let waiting = ids.iter().find(|id| one.get_task(id)["status"] == "pending").expect("a waiting task").clone();
    assert_eq!(one.api("DELETE", &format!("/tasks/{waiting}"), None).status, 200);
    assert_kind_counts(&one, &db, "k", (2, 4));
    assert_eq!(two.api("POST", &format!("/tasks/{waiting}/retry"), None).status, 202);
    assert_kind_counts(&one, &db, "k", (3, 4));
    // `w` is lost: its attempts go back to pending.
    w.drop_connection();
    assert_kind_counts(&one, &db, "k", (6, 1));

    // Node one's worker takes 2, then node one dies: node two adopts them (back to pending),
    // and an hour later (node one's heartbeat is aged here) folds node one's count rows into
    // the zero node's.
    let w1 = FakeWorker::connect(&one, Some(json!({"type":"hello","kinds":["k"],"concurrency":2})), Auto::Manual);
    w1.expect_task();
    w1.expect_task();
    assert_kind_counts(&two, &db, "k", (4, 3));
    one.kill_now();
    assert!(one.wait_exit(Duration::from_secs(5)).is_some(), "node one died");
    let adopted = poll_until(Duration::from_secs(20), || kind_rows(&db, "k") == (6, 1));
    assert!(adopted, "node one's attempts were never adopted: {:?}", kind_rows(&db, "k"));
    assert_kind_counts(&two, &db, "k", (6, 1));
    let zero = "00000000-0000-0000-0000-000000000000";
    let dead_rows = format!(
        "SELECT count(*) FROM relay_kind_pending c WHERE c.node_id <> '{zero}'
           AND NOT EXISTS (SELECT 1 FROM relay_nodes n
                           WHERE n.node_id = c.node_id AND n.heartbeat_ms > relay_now_ms() - 3000)"
    );
    assert_ne!(db.query(&dead_rows), ["0"], "node one's rows are there before the fold");
    db.query("UPDATE relay_nodes SET heartbeat_ms = heartbeat_ms - 7200000 WHERE heartbeat_ms < relay_now_ms() - 3000");
    let folded = poll_until(Duration::from_secs(5), || db.query(&dead_rows) == ["0"]);
    assert!(folded, "node one's count rows were never folded");
    assert_kind_counts(&two, &db, "k", (6, 1));

    // Kinds made up for one task each: once those are gone (canceled), so are their rows.
    let made_up: Vec<String> = (0..5)
        .map(|i| id_of(&two.submit(&format!(r#"{{"payload":{{"kind":"made-up-{i}"}},"queue":true}}"#))))
        .collect();
    assert_eq!(db.query("SELECT count(*) FROM relay_kind_pending WHERE kind LIKE 'made-up-%'"), ["5"]);
    for id in &made_up {
        assert_eq!(two.api("DELETE", &format!("/tasks/{id}"), None).status, 200);
    }
    let swept = poll_until(Duration::from_secs(5), || {
        db.query("SELECT count(*) FROM relay_kind_pending WHERE kind LIKE 'made-up-%'") == ["0"]
    });
    assert!(swept, "the made-up kinds' rows stay");
    assert_eq!(two.api("GET", "/kinds/made-up-0", None).status, 404);

    // Expiry in the queue: a node with a short TASK_TTL (no worker takes kind `e`; the tasks of
    // `k` never sent to a worker expire too).
    let three = Mode::start_on(db.clone(), &[("TASK_TTL", "3s"), ("TASK_TIMEOUT", "120s")]);
    put_policy(&three, "e", r#"{"max_running":1}"#);
    let e: Vec<String> = (0..3).map(|_| id_of(&three.submit(r#"{"payload":{"kind":"e"},"queue":true}"#))).collect();
    assert_eq!(three.api("GET", "/kinds/e", None).json()["pending"], 3);
    for id in &e {
        assert_eq!(three.wait_status(id, "failed", Duration::from_secs(10))["error"], "expired in queue");
    }
    assert_kind_counts(&three, &db, "e", (0, 0));
    assert_kind_counts_are_the_rows(&two, &db, "k");
    assert_kind_counts_are_the_rows(&three, &db, "k");
}

// ----- GET /kinds with many kinds (single node) -----------------------------------------------

/// `n` kind names in no order: `k-<pseudo-random hex>-<i>-<padding to 120 bytes>` (long, so
/// the answer is more than the kernel's socket buffers take: 40,000 make 6.7 MB).
fn many_kind_names(n: usize) -> Vec<String> {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            format!("k-{:010x}-{i:<106}", x & 0xff_ffff_ffff).replace(' ', ".")
        })
        .collect()
}

/// Queues one task of each kind by `/tasks/batch` (no worker: they wait).
fn queue_one_of_each(relay: &Relay, kinds: &[String]) {
    for part in kinds.chunks(10_000) {
        let tasks: Vec<Value> = part.iter().map(|k| json!({"payload": {"kind": k}})).collect();
        let r = relay.api("POST", "/tasks/batch", Some(&json!({ "tasks": tasks }).to_string()));
        assert_eq!(r.status, 202, "{}", r.text());
        let items = r.json()["tasks"].as_array().expect("tasks").clone();
        assert!(items.iter().all(|t| t["task_id"].is_string()), "{:?}", &items[..3]);
    }
}

/// 40,000 kinds, each with a task queued, then `GET /kinds` on a keep-alive connection: the
/// answer comes chunked in bounded pieces, every kind once and in order, and the connection goes
/// on after it. Returns the connection, the answer and the kinds in order.
fn a_long_kinds_list_is_streamed(relay: &Relay) -> (Client, Resp, Vec<String>) {
    let kinds = many_kind_names(40_000);
    queue_one_of_each(relay, &kinds);
    let mut sorted = kinds.clone();
    sorted.sort();
    let auth = format!("Bearer {API}");
    let mut c = Client::connect(relay.addr);
    let r = c.call("GET", "/kinds", &[("Authorization", &auth)], None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("Transfer-Encoding"), Some("chunked"));
    assert!(r.chunks >= 10, "{} bytes in {} chunks", r.body.len(), r.chunks);
    assert!(r.body.len() / r.chunks <= 70 * 1024, "{} bytes in {} chunks", r.body.len(), r.chunks);
    assert_eq!(listed_kinds(&r.body), sorted, "every kind, in order");
    let first: Value = serde_json::from_slice(&r.body).expect("json");
    assert_eq!(first["kinds"][0], json!({"kind": sorted[0], "policy": {}, "running": 0, "pending": 1}));
    let next = c.call("GET", "/healthz", &[], None);
    assert_eq!(next.status, 200, "the connection goes on after a streamed answer");
    (c, r, sorted)
}

fn listed_kinds(body: &[u8]) -> Vec<String> {
    let v: Value =
        serde_json::from_slice(body).unwrap_or_else(|e| panic!("GET /kinds is not JSON ({e}), {} bytes", body.len()));
    v["kinds"].as_array().expect("kinds").iter().map(|k| k["kind"].as_str().expect("kind").to_string()).collect()
}

/// Issue 22: `GET /kinds` built and sorted its whole answer on the loop — 340-450 ms with
/// 200,000 kinds, nobody else served meanwhile (bench/README.md, flow control). It is written a
/// piece at a time now, in kind order, each piece as the client reads: several chunks of one
/// whole JSON answer, and the keep-alive connection goes on after it. A client that stops
/// reading holds no more than one piece beyond the low-water mark (not the whole answer), and
/// nothing is held for it once it goes away mid-answer. An HTTP/1.0 client gets the same body,
/// ended by the connection's close. (What an answer under way shows of kinds that come and go
/// meanwhile: `store::mem::flow`'s and `stream`'s unit tests.)
#[test]
fn get_kinds_with_40000_kinds_is_streamed_in_order_in_bounded_pieces() {
    let relay = Relay::start();
    let (_, r, mut sorted) = a_long_kinds_list_is_streamed(&relay);
    let auth = format!("Bearer {API}");

    // A client that asks and does not read, with a small receive buffer (the kernel takes
    // little of the answer): relay holds a piece or two for it, not the rest of the answer.
    let deaf = TcpStream::connect(relay.addr).expect("connect");
    crate::hostile::small_receive_buffer(&deaf);
    let mut deaf = deaf;
    deaf.write_all(format!("GET /kinds HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n\r\n").as_bytes())
        .expect("write");
    deaf.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
    assert!(deaf.peek(&mut [0u8; 1]).expect("the answer begins") > 0);
    // (Meanwhile a kind is added, before the answer's position: later answers list it.)
    let early = id_of(&relay.submit(r#"{"payload":{"kind":"0-early"},"queue":true}"#));
    let mut peak = 0f64;
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_millis(1_500) {
        peak = peak.max(relay.metric("relay_output_buffered_bytes"));
    }
    assert!(
        peak <= (256 * 1024) as f64,
        "{peak} bytes held for a client that does not read its GET /kinds (the answer is {} bytes)",
        r.body.len()
    );
    assert!(relay.api("GET", "/healthz", None).status == 200);
    // It goes away mid-answer: nothing is left held for it.
    drop(deaf);
    let freed = poll_until(Duration::from_secs(5), || relay.metric("relay_output_buffered_bytes") == 0.0);
    assert!(freed, "{} bytes still held", relay.metric("relay_output_buffered_bytes"));
    assert_eq!(relay.get_task(&early)["status"], "pending");

    // HTTP/1.0: no chunks; the body ends with the connection.
    let mut old = TcpStream::connect(relay.addr).expect("connect");
    old.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
    old.write_all(format!("GET /kinds HTTP/1.0\r\nAuthorization: {auth}\r\n\r\n").as_bytes()).expect("write");
    let mut raw = Vec::new();
    old.read_to_end(&mut raw).expect("read to the close");
    let head_end = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("a head") + 4;
    let head = String::from_utf8_lossy(&raw[..head_end]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(!head.contains("content-length") && !head.contains("transfer-encoding"), "{head}");
    assert!(head.contains("connection: close"), "{head}");
    sorted.insert(0, "0-early".to_string());
    assert_eq!(listed_kinds(&raw[head_end..]), sorted);
}

/// Issue 22, cluster mode: the node turned all of `KINDS`' rows into one answer on the loop when
/// they arrived (`kinds_answer`). Now the rows are made into pieces of JSON where they are read
/// (the database connection's thread) and written a piece at a time as the client reads, as on
/// one node: several chunks of one whole answer in kind order, and the connection goes on.
/// What a client that stops reading holds is the rest of the answer (those pieces), never more,
/// and it counts against OUTPUT_MEMORY as unwritten output: over it, such a client is closed
/// after OUTPUT_STALL like any other, and nothing is left held.
#[test]
fn cluster_get_kinds_with_40000_kinds_is_streamed_in_order_in_bounded_pieces() {
    let pg = match crate::support::pg::shared() {
        Ok(pg) => pg,
        Err(why) => {
            assert!(!crate::support::pg::required(), "PostgreSQL is required: {why}");
            crate::support::skip_or_fail(
                "cluster_get_kinds_with_40000_kinds_is_streamed_in_order_in_bounded_pieces",
                &why,
            );
            return;
        }
    };
    let db = std::sync::Arc::new(crate::support::pg::TestDb::create(pg));
    // (Less than the kernel's socket buffers take of an answer: what relay holds is over it.)
    let budget = 1024 * 1024;
    let relay = Mode::start_on(db, &[("OUTPUT_MEMORY", &budget.to_string()), ("IDLE_TIMEOUT", "60s")]);
    let (mut c, r, sorted) = a_long_kinds_list_is_streamed(&relay);
    let auth = format!("Bearer {API}");
    assert!(r.body.len() > budget, "the answer ({} bytes) is more than OUTPUT_MEMORY", r.body.len());

    // A client that asks and does not read, with a small receive buffer: relay holds the rest of
    // its answer, no more, counted as its unwritten output; over OUTPUT_MEMORY it is closed.
    let deaf = TcpStream::connect(relay.addr).expect("connect");
    crate::hostile::small_receive_buffer(&deaf);
    let mut deaf = deaf;
    deaf.write_all(format!("GET /kinds HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n\r\n").as_bytes())
        .expect("write");
    deaf.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
    assert!(deaf.peek(&mut [0u8; 1]).expect("the answer begins") > 0);
    let mut peak = 0f64;
    let closed = poll_until(Duration::from_secs(10), || {
        peak = peak.max(relay.metric("relay_output_buffered_bytes"));
        relay.metric("relay_output_stalled_closed_total") >= 1.0
    });
    assert!(
        peak > budget as f64 && peak <= (r.body.len() + 256 * 1024) as f64,
        "{peak} bytes held for a client that does not read its GET /kinds (the answer is {} bytes)",
        r.body.len()
    );
    assert!(closed, "a client that never read was not closed over OUTPUT_MEMORY (peak {peak} bytes)");
    let freed = poll_until(Duration::from_secs(5), || relay.metric("relay_output_buffered_bytes") == 0.0);
    assert!(freed, "{} bytes still held", relay.metric("relay_output_buffered_bytes"));
    let again = c.call("GET", "/kinds", &[("Authorization", &auth)], None);
    assert_eq!(listed_kinds(&again.body), sorted, "the next answer is whole");
}
