//! Fair shares in the cluster store (SPEC §14): claims rotate over submitters, then keys, with
//! the rotation kept in PostgreSQL, and per-key limits hold across nodes claiming at once.
//! (tests/it/fairness.rs holds the tests both stores pass; these are the cluster's own.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::pg::TestDb;
use crate::support::*;

const SECRET: &str = "integration-test-secret-0123456789abcdef";

/// A private database, or `None` (skipped loudly; a failure where PostgreSQL is required).
fn database(test: &str) -> Option<Arc<TestDb>> {
    match crate::support::pg::shared() {
        Ok(pg) => Some(Arc::new(TestDb::create(pg))),
        Err(why) => {
            assert!(!crate::support::pg::required(), "PostgreSQL is required: {why}");
            skip_or_fail(test, &why);
            None
        }
    }
}

/// A scoped token for `kinds` in the database's registry: (jti, token).
fn scoped(db: &TestDb, name: &str, kinds: &str) -> (String, String) {
    let url = db.url();
    let (code, out, err) = run_relay_env(
        &["token", "create", "--name", name, "--kinds", kinds, "--ttl", "1h"],
        &[("TOKEN_SECRET", SECRET), ("DATABASE_URL", url.as_str())],
    );
    assert_eq!(code, Some(0), "token create failed: {err}");
    let field = |key: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(key).and_then(|rest| rest.strip_prefix(": ")))
            .unwrap_or_else(|| panic!("no {key} in {out:?}"))
            .to_string()
    };
    (field("jti"), field("token"))
}

fn submit_as(relay: &Relay, token: Option<&str>, body: &str) {
    let auth = token.map(|t| format!("Bearer {t}"));
    let r = match &auth {
        Some(a) => request(relay.addr, "POST", "/tasks", &[("Authorization", a.as_str())], Some(body.as_bytes())),
        None => relay.submit(body),
    };
    assert_eq!(r.status, 202, "{body}: {}", r.text());
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

/// Two submitters (the root token and a scoped token), the root token's tasks on two keys: one
/// worker is handed them in rotation — submitters take turns, the root token's keys take turns
/// within its turns, each key in submission order — and once one runs dry the rest come in
/// order. The rotation state lives in the database: a claim after another sees its stamps.
#[test]
fn cluster_claims_rotate_over_submitters_then_keys() {
    let Some(db) = database("cluster_claims_rotate_over_submitters_then_keys") else { return };
    let (_, token) = scoped(&db, "other", "f");
    let relay = Mode::start_on(db.clone(), &[("TOKEN_SECRET", SECRET)]);
    let task = |n: &str, key: &str| format!(r#"{{"payload":{{"kind":"f","n":"{n}"}},"queue":true,"key":"{key}"}}"#);
    for i in 0..5 {
        submit_as(&relay, None, &task(&format!("r{i}"), ""));
    }
    for i in 0..2 {
        submit_as(&relay, None, &task(&format!("k{i}"), "k2"));
    }
    for i in 0..3 {
        submit_as(&relay, Some(&token), &task(&format!("s{i}"), ""));
    }
    let w = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["f"],"concurrency":1})), Auto::Manual);
    assert_eq!(run_in_order(&w, 10), ["r0", "s0", "k0", "s1", "r1", "s2", "k1", "r2", "r3", "r4"]);
    // Nothing is left to rotate over: the lanes' rows go with the next sweep.
    poll_until(Duration::from_secs(5), || db.query("SELECT count(*) FROM relay_fair_lanes") == ["0"]);
    assert_eq!(db.query("SELECT count(*) FROM relay_fair_submitters"), ["0"]);
    assert_eq!(db.query("SELECT count(*) FROM relay_fair_kinds"), ["0"]);
}

/// A flood of one key and one task of another, for a worker that takes several at once: one
/// claim hands out the other key's task among the first two, not after the flood.
#[test]
fn cluster_one_claim_of_many_tasks_takes_them_in_rotation() {
    let Some(db) = database("cluster_one_claim_of_many_tasks_takes_them_in_rotation") else { return };
    let relay = Mode::start_on(db.clone(), &[]);
    let body = (0..200)
        .map(|i| format!(r#"{{"payload":{{"kind":"f","n":"a{i}"}},"queue":true,"key":"a"}}"#))
        .chain([r#"{"payload":{"kind":"f","n":"b0"},"queue":true,"key":"b"}"#.to_string()])
        .collect::<Vec<_>>()
        .join(",");
    let batch = relay.api("POST", "/tasks/batch", Some(&format!(r#"{{"tasks":[{body}]}}"#)));
    assert_eq!(batch.status, 202, "{}", batch.text());
    let w = FakeWorker::connect(&relay, Some(json!({"type":"hello","kinds":["f"],"concurrency":8})), Auto::Manual);
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while got.len() < 8 && Instant::now() < deadline {
        if let Some(t) = w.next_task(Duration::from_millis(100)) {
            got.push(t.payload["n"].as_str().expect("n").to_string());
        }
    }
    assert_eq!(got.len(), 8, "{got:?}");
    let at = got.iter().position(|n| n == "b0").unwrap_or_else(|| panic!("b0 not among the first 8: {got:?}"));
    assert!(at <= 1, "b0 waits at most one dispatch of the flooding key: {got:?}");
}

/// `max_running_per_key` holds for the whole cluster: three nodes with three workers each claim
/// tasks of three keys at once, and no key ever runs more than its cap (counted from what the
/// workers were sent and have not answered), while each key is used up to it.
#[test]
fn max_running_per_key_holds_for_the_whole_cluster_with_three_nodes_claiming_at_once() {
    let Some(db) = database("max_running_per_key_holds_for_the_whole_cluster_with_three_nodes_claiming_at_once") else {
        return;
    };
    // (Attempts are answered only once every key is at its cap: none may time out meanwhile.)
    let nodes: Vec<Relay> = (0..3).map(|_| Mode::start_on(db.clone(), &[("TASK_TIMEOUT", "60s")])).collect();
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
    let r = nodes[0].api("PUT", "/kinds/m", Some(r#"{"max_running_per_key":2}"#));
    assert_eq!(r.status, 200, "{}", r.text());
    // Every node knows the policy before the tasks come (SPEC §14: within a second).
    let set = Instant::now();
    poll_until(Duration::from_secs(2), || set.elapsed() >= Duration::from_millis(1_100));
    let keys = ["a", "b", "c"];
    let body = (0..45)
        .map(|i| format!(r#"{{"payload":{{"kind":"m","k":"{k}"}},"key":"{k}"}}"#, k = keys[i % 3]))
        .collect::<Vec<_>>()
        .join(",");
    let batch = nodes[1].api("POST", "/tasks/batch", Some(&format!(r#"{{"tasks":[{body}]}}"#)));
    assert_eq!(batch.status, 202, "{}", batch.text());
    let mut running: Vec<(usize, String, String)> = Vec::new();
    let mut most = std::collections::HashMap::new();
    let mut done = 0;
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut last_new = Instant::now();
    while done < 45 && Instant::now() < deadline {
        for (i, w) in workers.iter().enumerate() {
            while let Some(t) = w.next_task(Duration::from_millis(5)) {
                let k = t.payload["k"].as_str().expect("k").to_string();
                running.push((i, t.id, k));
                last_new = Instant::now();
            }
        }
        for k in keys {
            let n = running.iter().filter(|r| r.2 == k).count();
            assert!(n <= 2, "max_running_per_key 2 exceeded for key {k} across nodes: {running:?}");
            let m = most.entry(k).or_insert(0);
            *m = n.max(*m);
        }
        // Answer one when every key is at its cap (or nothing more comes for a while: the tail).
        if !running.is_empty() && (running.len() == 6 || last_new.elapsed() > Duration::from_millis(600)) {
            let (i, id, _) = running.remove(0);
            workers[i].done(&id, json!(null));
            done += 1;
        }
    }
    assert_eq!(done, 45, "every task ran");
    for k in keys {
        assert_eq!(most.get(k), Some(&2), "key {k} used its cap: {most:?}");
    }
}

/// Thousands of new keys at once: the node analyzes the queue's tables itself within seconds,
/// rather than leave every claim on plans made for empty tables until autovacuum looks (once a
/// minute; a limited claim over 10,000 fresh keys took up to 1.4 s meanwhile). Before, only
/// autovacuum analyzed them: `last_analyze` stayed empty.
#[test]
fn a_sharp_growth_of_the_queue_is_analyzed_at_once() {
    let Some(db) = database("a_sharp_growth_of_the_queue_is_analyzed_at_once") else { return };
    let relay = Mode::start_on(db.clone(), &[]);
    for b in 0..3 {
        let body = (0..1000)
            .map(|i| format!(r#"{{"payload":{{"kind":"g"}},"key":"k{b}-{i}"}}"#))
            .collect::<Vec<_>>()
            .join(",");
        let batch = relay.api("POST", "/tasks/batch", Some(&format!(r#"{{"tasks":[{body}]}}"#)));
        assert_eq!(batch.status, 202, "{}", batch.text());
    }
    let analyzed = "SELECT count(*) FROM pg_stat_user_tables
         WHERE relname IN ('relay_pending', 'relay_fair_lanes') AND last_analyze IS NOT NULL";
    assert!(
        poll_until(Duration::from_secs(15), || db.query(analyzed) == ["2"]),
        "the queue's tables analyzed: {:?}",
        db.query(
            "SELECT relname || ' ' || coalesce(last_analyze::text, '-') || ' ' || n_mod_since_analyze
                  FROM pg_stat_user_tables WHERE relname LIKE 'relay_%' ORDER BY 1"
        )
    );
}
