//! The store conformance suite (ARCHITECTURE.md, "One core, two stores"): every queue
//! operation of the seam (`relay::store`) against both stores — the memory store, and the
//! PostgreSQL store on a private server — with the same expectations. A store answers through
//! events; a database's arrive when its transaction commits, so each step drives the store
//! until it is idle (its transactions sent and answered) before it looks.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use relay::http::Response;
use relay::listing::parse_query;
use relay::pg::db::{Db, DbConfig, Health};
use relay::pg::url::parse as parse_url;
use relay::store::mem::{MemConfig, MemStore};
use relay::store::pg::{PgConfig, PgStore};
use relay::store::{
    AttemptEnd, AttemptStart, ClaimAsk, Claimed, Event, Insert, InsertTo, NewTask, Next, ReadHow, Refusal, Store,
};
use relay::tasks::{ConnRef, Outcome, Status, TaskId, parse_id, uuid_string};
use relay::tokens::pg::TokenCache;
use serde_json::Value;
use serde_json::value::RawValue;

use crate::support::pg::Pg;

const CONN: ConnRef = ConnRef { slot: 7, generation: 1 };
const W1: u128 = 0x1111;
const W2: u128 = 0x2222;

/// One store under test, and what keeps it running.
struct Harness {
    store: Store,
    woken: Arc<AtomicBool>,
    started: Instant,
    _pg: Option<Pg>,
}

fn limits() -> (usize, usize) {
    (5, 1 << 20)
}

fn mem() -> Harness {
    let (max_pending, max_pending_bytes) = limits();
    let cfg = MemConfig {
        task_ttl_ms: 3_600_000,
        failed_ttl_ms: 0,
        max_pending,
        max_pending_bytes,
        task_memory_bytes: 64 << 20,
        task_timeout_ms: 1_000,
        max_retries: 2,
    };
    let mut h = Harness {
        store: Store::Mem(Box::new(MemStore::new(cfg, None))),
        woken: Arc::new(AtomicBool::new(false)),
        started: Instant::now(),
        _pg: None,
    };
    h.tick();
    h
}

fn pg(test: &str) -> Option<Harness> {
    let pg = Pg::start(test)?;
    let node = uuid::Uuid::new_v4().hyphenated().to_string();
    let mut cfg = DbConfig::new(parse_url(&pg.url()).expect("url"), node.clone(), 1_000);
    cfg.node_name = "node-t".into();
    cfg.heartbeat_interval_ms = 200;
    let woken = Arc::new(AtomicBool::new(false));
    let w = woken.clone();
    let db = Db::start(cfg, Arc::new(move || w.store(true, Ordering::SeqCst))).expect("db threads");
    assert!(
        crate::support::poll_until(Duration::from_secs(10), || db.health() == Health::Ok),
        "the database never answered"
    );
    let (max_pending, max_pending_bytes) = limits();
    let cfg = PgConfig {
        task_ttl_ms: 3_600_000,
        failed_ttl_ms: 0,
        task_timeout_ms: 1_000,
        max_retries: 2,
        max_pending,
        max_pending_bytes,
    };
    let tokens = Rc::new(RefCell::new(TokenCache::default()));
    let store = PgStore::new(node, "node-t".into(), db, 5_000, tokens, cfg);
    let mut h = Harness { store: Store::Pg(Box::new(store)), woken, started: Instant::now(), _pg: Some(pg) };
    h.tick();
    h.settle();
    Some(h)
}

/// Runs `check` against the memory store and (when PostgreSQL is there; a failure under CI)
/// the PostgreSQL store.
fn both(test: &str, check: impl Fn(&mut Harness)) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{test}: the memory store");
    check(&mut mem());
    if let Some(mut h) = pg(test) {
        let _ = writeln!(std::io::stderr(), "{test}: the PostgreSQL store");
        check(&mut h);
    }
}

impl Harness {
    fn tick(&mut self) {
        let now = self.started.elapsed().as_millis() as u64;
        self.store.set_clock(now, relay::timefmt::wall_ms());
    }

    /// Drives the store until it is idle and returns what it said.
    fn settle(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            self.tick();
            self.store.end_turn();
            self.store.take_events(&mut events);
            if self.store.idle() {
                return events;
            }
            assert!(Instant::now() < deadline, "the store never became idle");
            let until = Instant::now() + Duration::from_millis(50);
            while !self.woken.swap(false, Ordering::SeqCst) && Instant::now() < until {
                std::thread::sleep(Duration::from_micros(200));
            }
            self.store.on_wake();
        }
    }

    fn insert_with(&mut self, payload: &str, kind: Option<&str>, tune: impl FnOnce(&mut Insert<'_>)) -> Event {
        let raw = RawValue::from_string(payload.to_string()).expect("JSON");
        let mut new = Insert::from(NewTask::queued(&raw, kind));
        tune(&mut new);
        self.store.insert(&new, InsertTo::Submit { conn: CONN, wait: false });
        let mut events = self.settle();
        events.retain(|e| matches!(e, Event::Inserted { .. } | Event::KeyHeld { .. } | Event::NotInserted { .. }));
        assert_eq!(events.len(), 1, "one answer to an insert: {events:?}");
        events.remove(0)
    }

    fn insert(&mut self, kind: Option<&str>) -> TaskId {
        match self.insert_with(r#"{"n":1}"#, kind, |_| {}) {
            Event::Inserted { id, .. } => id,
            other => panic!("not inserted: {other:?}"),
        }
    }

    fn answer(&mut self, events: &[Event]) -> Response {
        let answers: Vec<&Response> = events
            .iter()
            .filter_map(|e| match e {
                Event::Answer { conn, response } if *conn == CONN => Some(response),
                _ => None,
            })
            .collect();
        assert_eq!(answers.len(), 1, "one answer: {events:?}");
        answers[0].clone()
    }

    fn read(&mut self, id: TaskId, scope: Option<&[String]>, how: ReadHow) -> (u16, Value) {
        // (An answer the store has at once is returned; else it comes as an event.)
        let r = match self.store.read(id, scope, CONN, how) {
            Some(r) => r,
            None => {
                let events = self.settle();
                self.answer(&events)
            }
        };
        (r.status, serde_json::from_slice(&r.body).unwrap_or(Value::Null))
    }

    fn get(&mut self, id: TaskId) -> Value {
        let (status, v) = self.read(id, None, ReadHow::Get { payload: false });
        assert_eq!(status, 200, "{v}");
        v
    }

    /// A claim for a group of workers; a group is the workers that take the same kinds (the
    /// core's), so its number follows the kinds.
    fn claim(&mut self, kinds: Option<&[&str]>, limit: u32, takers: &[u128]) -> Vec<Claimed> {
        let group = kinds.map_or(1, |k| 2 + k.len() as u32 + k.first().map_or(0, |f| u32::from(f.as_bytes()[0])));
        let kinds: Option<Vec<Box<str>>> = kinds.map(|k| k.iter().map(|s| Box::from(*s)).collect());
        self.store.claim(&ClaimAsk { group, kinds: kinds.as_deref(), limit, takers });
        let events = self.settle();
        let mut claimed = Vec::new();
        for e in events {
            match e {
                Event::Claimed { group: g, tasks } => {
                    assert_eq!(g, group);
                    claimed.extend(tasks);
                }
                Event::ClaimedOne { group: g, task } => {
                    assert_eq!(g, group);
                    claimed.push(task);
                }
                _ => {}
            }
        }
        claimed
    }

    fn start(&mut self, c: &Claimed, client: u128) {
        let start = AttemptStart {
            client_id: client,
            client_ip: "10.0.0.1".parse().expect("ip"),
            started_wall_ms: relay::timefmt::wall_ms(),
            started_mono_ms: 0,
            node: Some("node-t"),
            session: None,
        };
        self.store.attempt_started(c.id, c.attempt, &start);
    }

    fn end(&mut self, id: TaskId, attempt: u32, outcome: Outcome, next: Next<'_>) -> Vec<Event> {
        let end = AttemptEnd {
            outcome,
            error: (outcome != Outcome::Done).then_some("it broke"),
            duration_ms: 5,
            ended_wall_ms: relay::timefmt::wall_ms(),
            uncounted: false,
            resumes: 0,
        };
        self.store.attempt_ended(id, attempt, &end, next);
        self.settle()
    }

    fn cancel(&mut self, id: TaskId, scope: Option<&[String]>) -> (u16, Vec<Event>) {
        self.store.cancel(id, scope, CONN);
        let events = self.settle();
        (self.answer(&events).status, events)
    }

    fn list(&mut self, query: &str, scope: Option<&[String]>) -> (Vec<TaskId>, Option<String>) {
        let q = parse_query(query).expect("query");
        self.store.list(&q, scope, CONN);
        let events = self.settle();
        let r = self.answer(&events);
        assert_eq!(r.status, 200);
        let v: Value = serde_json::from_slice(&r.body).expect("JSON page");
        let ids =
            v["tasks"].as_array().expect("tasks").iter().filter_map(|t| parse_id(t["task_id"].as_str()?)).collect();
        (ids, v["next_cursor"].as_str().map(str::to_string))
    }
}

fn kind(name: &str) -> Vec<String> {
    vec![name.to_string()]
}

#[test]
fn store_insert_read_and_scope() {
    both("store_insert_read_and_scope", |h| {
        let id = h.insert(Some("a"));
        let t = h.get(id);
        assert_eq!((t["status"].as_str(), t["kind"].as_str()), (Some("pending"), Some("a")));
        assert_eq!((t["attempts"].as_u64(), t.get("payload")), (Some(0), None));
        let (_, with) = h.read(id, None, ReadHow::Get { payload: true });
        assert_eq!(with["payload"], serde_json::json!({"n": 1}), "?include=payload");
        assert_eq!(h.read(id, Some(&kind("b")), ReadHow::Get { payload: false }).0, 404, "out of scope");
        assert_eq!(h.read(id, Some(&kind("a")), ReadHow::Get { payload: false }).0, 200, "in scope");
        assert_eq!(h.read(0x42, None, ReadHow::Get { payload: false }).0, 404, "unknown");
        let none = h.insert(None);
        assert_eq!(h.read(none, Some(&kind("a")), ReadHow::Get { payload: false }).0, 404, "no kind, scoped caller");
        // A wait on a pending task is held by the core; on a final one it is answered.
        assert!(h.store.read(id, None, CONN, ReadHow::Wait { post: true }).is_none(), "not answered at once");
        let events = h.settle();
        assert!(
            events.iter().any(|e| matches!(e, Event::NotFinal { id: i, post: true, .. } if *i == id)),
            "{events:?}"
        );
        assert_eq!(h.cancel(id, None).0, 200);
        let (code, v) = h.read(id, None, ReadHow::Wait { post: true });
        assert_eq!((code, v["status"].as_str()), (409, Some("canceled")), "a submit's code for canceled");
    });
}

#[test]
fn store_idempotency_keys_and_the_pending_limit() {
    both("store_idempotency_keys_and_the_pending_limit", |h| {
        let first = match h.insert_with("1", Some("k"), |n| n.idempotency = Some(("root", "key-1"))) {
            Event::Inserted { id, .. } => id,
            other => panic!("{other:?}"),
        };
        match h.insert_with("2", Some("k"), |n| n.idempotency = Some(("root", "key-1"))) {
            Event::KeyHeld { id, status, .. } => assert_eq!((id, status), (first, Status::Pending)),
            other => panic!("a repeat stored something: {other:?}"),
        }
        match h.insert_with("3", Some("k"), |n| n.idempotency = Some(("jti-2", "key-1"))) {
            Event::Inserted { id, .. } => assert_ne!(id, first, "another identity's key is another key"),
            other => panic!("{other:?}"),
        }
        h.store.lookup_key("root", "key-1", CONN, false, Response::error(400, "bad_request", "x"));
        let held = h.settle().into_iter().find_map(|e| match e {
            Event::Key { held, .. } => Some(held),
            _ => None,
        });
        assert_eq!(held, Some(Some((first, Status::Pending))));
        h.store.lookup_key("root", "key-2", CONN, false, Response::error(400, "bad_request", "x"));
        let held = h.settle().into_iter().find_map(|e| match e {
            Event::Key { held, missing, .. } => Some((held, missing.status)),
            _ => None,
        });
        assert_eq!(held, Some((None, 400)));

        // MAX_PENDING is 5: two wait now, three more fit, the next does not — unless it runs
        // at once; a cancel frees its room at once.
        let more: Vec<TaskId> = (0..3).map(|_| h.insert(Some("k"))).collect();
        match h.insert_with("4", Some("k"), |_| {}) {
            Event::NotInserted { why, .. } => assert_eq!(why, Refusal::QueueFull),
            other => panic!("over MAX_PENDING: {other:?}"),
        }
        assert!(matches!(h.insert_with("5", Some("k"), |n| n.runs_now = true), Event::Inserted { .. }));
        // (That one waits too, unclaimed: six wait.)
        assert!(matches!(h.insert_with("6", Some("k"), |_| {}), Event::NotInserted { .. }));
        assert_eq!(h.cancel(more[0], None).0, 200);
        assert_eq!(h.cancel(more[1], None).0, 200);
        assert!(matches!(h.insert_with("7", Some("k"), |_| {}), Event::Inserted { .. }), "room again");
    });
}

#[test]
fn store_claims_follow_kinds_due_order_and_tried_workers() {
    both("store_claims_follow_kinds_due_order_and_tried_workers", |h| {
        let a1 = h.insert(Some("a"));
        let b1 = h.insert(Some("b"));
        let a2 = h.insert(Some("a"));
        let later =
            match h.insert_with("{}", Some("a"), |n| n.run_at_wall_ms = Some(relay::timefmt::wall_ms() + 60_000)) {
                Event::Inserted { id, .. } => id,
                other => panic!("{other:?}"),
            };
        let none = h.insert(None);
        let got: Vec<TaskId> = h.claim(Some(&["a"]), 10, &[W1]).iter().map(|c| c.id).collect();
        assert_eq!(got, [a1, a2], "its kinds, due order, nothing scheduled for later");
        assert_eq!(h.get(later)["status"], "pending");
        // A claim given back is pending again, in its place.
        h.store.give_back(a2, 1);
        h.settle();
        let again = h.claim(Some(&["a"]), 10, &[W1]);
        assert_eq!((again.len(), again[0].id, again[0].attempt), (1, a2, 1), "the same attempt again");
        let all: Vec<TaskId> = h.claim(None, 10, &[W1]).iter().map(|c| c.id).collect();
        assert_eq!(all, [b1, none], "a worker without kinds takes the rest, tasks without a kind too");
        assert!(h.claim(None, 10, &[W1]).is_empty());

        // An attempt that fails goes back for a worker that has not tried it.
        h.start(&again[0], W1);
        let t = h.get(a2);
        assert_eq!((t["status"].as_str(), t["attempts"].as_u64()), (Some("dispatched"), Some(1)));
        assert_eq!(t["attempt_log"][0]["client_id"], uuid_string(W1));
        h.end(a2, 1, Outcome::Failed, Next::Retry);
        assert_eq!(h.get(a2)["status"], "pending");
        assert!(h.claim(Some(&["a"]), 10, &[W1]).is_empty(), "every taker tried it");
        let retry = h.claim(Some(&["a"]), 10, &[W1, W2]);
        assert_eq!(retry.len(), 1);
        assert_eq!((retry[0].id, retry[0].attempt, retry[0].counted), (a2, 2, 1));
        assert_eq!(retry[0].tried, [W1]);
    });
}

/// An insert offered to an idle group (`claim_group`): the store claims it for that group as
/// it stores it, or queues it and says `Ready`; never ahead of an older task that waits.
#[test]
fn store_an_insert_offered_to_an_idle_group_is_claimed_once_and_never_overtakes() {
    both("store_an_insert_offered_to_an_idle_group_is_claimed_once_and_never_overtakes", |h| {
        let offered = |h: &mut Harness, payload: &str| -> (TaskId, Vec<Event>) {
            let raw = RawValue::from_string(payload.to_string()).expect("JSON");
            let new = Insert {
                task: NewTask { queue: false, ..NewTask::queued(&raw, Some("a")) },
                runs_now: true,
                claim_group: Some(5),
            };
            h.store.insert(&new, InsertTo::Submit { conn: CONN, wait: false });
            let events = h.settle();
            let id = events
                .iter()
                .find_map(|e| match e {
                    Event::Inserted { id, .. } => Some(*id),
                    _ => None,
                })
                .expect("inserted");
            (id, events)
        };
        let claimed_at_insert = |events: &[Event], id: TaskId| {
            events.iter().any(|e| match e {
                Event::Claimed { group: 5, tasks } => tasks.iter().any(|c| c.id == id),
                Event::ClaimedOne { group: 5, task } => task.id == id,
                _ => false,
            })
        };
        // An empty queue: claimed at once for group 5, or queued with `Ready` for the core's
        // claim; either way one claim gets it, attempt 1.
        let (first, events) = offered(h, "1");
        let at_insert = claimed_at_insert(&events, first);
        assert!(at_insert || events.iter().any(|e| matches!(e, Event::Ready)), "claimed or Ready: {events:?}");
        let later = h.claim(Some(&["a"]), 10, &[W1]);
        if at_insert {
            assert!(later.is_empty(), "a task claimed at insert is not claimed again: {later:?}");
            assert_eq!(h.get(first)["status"], "pending", "(claimed, not started: still pending to readers)");
        } else {
            assert_eq!(later.iter().map(|c| (c.id, c.attempt)).collect::<Vec<_>>(), [(first, 1)]);
        }
        // An older task waits: the offered one queues behind it.
        let older = h.insert(Some("a"));
        let (second, events) = offered(h, "2");
        assert!(!claimed_at_insert(&events, second), "an offered task overtook an older one");
        let order: Vec<TaskId> = h.claim(Some(&["a"]), 10, &[W1]).iter().map(|c| c.id).collect();
        assert_eq!(order, [older, second], "due order");
    });
}

#[test]
fn store_attempt_ends_are_fenced_and_final_tasks_say_so() {
    both("store_attempt_ends_are_fenced_and_final_tasks_say_so", |h| {
        let id = h.insert(Some("a"));
        let c = h.claim(Some(&["a"]), 1, &[W1]).pop().expect("claimed");
        h.start(&c, W1);
        let result = RawValue::from_string(r#"{"ok":true}"#.into()).expect("JSON");
        let events = h.end(id, 1, Outcome::Done, Next::Done { result: &result });
        assert!(
            events
                .iter()
                .any(|e| matches!(e, Event::Final { id: i, status: Status::Done, took_ms: Some(_) } if *i == id)),
            "{events:?}"
        );
        let t = h.get(id);
        assert_eq!((t["status"].as_str(), &t["result"]), (Some("done"), &serde_json::json!({"ok": true})));
        assert_eq!(t["client_id"], uuid_string(W1));
        assert_eq!(t["attempt_log"][0]["outcome"], "done");
        assert_eq!(t["attempt_log"][0]["duration_ms"], 5);
        // A second end of the same attempt, or of another, changes nothing.
        for attempt in [1, 2] {
            let events = h.end(id, attempt, Outcome::Failed, Next::Failed { error: "late" });
            assert!(events.iter().any(|e| matches!(e, Event::Fenced { .. })), "attempt {attempt}: {events:?}");
        }
        assert_eq!(h.get(id)["status"], "done");
        // Failed: the error, and the payload is kept (to be run again).
        let f = h.insert(Some("a"));
        let c = h.claim(Some(&["a"]), 1, &[W2]).pop().expect("claimed");
        h.start(&c, W2);
        h.end(f, 1, Outcome::Timeout, Next::Failed { error: "no answer within 1s" });
        let (_, t) = h.read(f, None, ReadHow::Get { payload: true });
        assert_eq!((t["status"].as_str(), t["error"].as_str()), (Some("failed"), Some("no answer within 1s")));
        assert_eq!(t["payload"], serde_json::json!({"n": 1}));
        assert_eq!(t["attempt_log"][0]["outcome"], "timeout");
    });
}

#[test]
fn store_cancel_of_pending_running_final_unknown_and_out_of_scope_tasks() {
    both("store_cancel_of_pending_running_final_unknown_and_out_of_scope_tasks", |h| {
        let pending = h.insert(Some("a"));
        let (code, events) = h.cancel(pending, Some(&kind("b")));
        assert_eq!(code, 404, "out of scope looks unknown: {events:?}");
        let (code, events) = h.cancel(pending, None);
        assert_eq!(code, 200);
        assert!(events.iter().any(|e| matches!(e, Event::Final { status: Status::Canceled, .. })), "{events:?}");
        assert_eq!(h.cancel(pending, None).0, 409, "final already");
        assert_eq!(h.cancel(0x99, None).0, 404);
        let running = h.insert(Some("a"));
        let c = h.claim(Some(&["a"]), 1, &[W1]).pop().expect("claimed");
        h.start(&c, W1);
        let (code, events) = h.cancel(running, Some(&kind("a")));
        assert_eq!(code, 200);
        assert!(
            events.iter().any(|e| matches!(e, Event::Stop { id, attempt: 1 } if *id == running)),
            "the worker is told to stop: {events:?}"
        );
        let t = h.get(running);
        assert_eq!(
            (t["status"].as_str(), t["attempt_log"][0]["outcome"].as_str()),
            (Some("canceled"), Some("canceled"))
        );
        let events = h.end(running, 1, Outcome::Done, Next::Failed { error: "late" });
        assert!(events.iter().any(|e| matches!(e, Event::Fenced { .. })), "its late end is fenced: {events:?}");
    });
}

#[test]
fn store_listing_pages_newest_first_with_filters_and_scopes() {
    both("store_listing_pages_newest_first_with_filters_and_scopes", |h| {
        let mut ids = Vec::new();
        for i in 0..12 {
            let k = if i % 3 == 0 { "b" } else { "a" };
            let id = match h.insert_with("{}", Some(k), |n| n.runs_now = true) {
                Event::Inserted { id, .. } => id,
                other => panic!("{other:?}"),
            };
            ids.push(id);
        }
        h.cancel(ids[4], None);
        let mut seen = Vec::new();
        let mut cursor: Option<String> = None;
        for _ in 0..20 {
            let q = match &cursor {
                Some(c) => format!("limit=5&cursor={c}"),
                None => "limit=5".to_string(),
            };
            let (page, next) = h.list(&q, None);
            assert!(page.len() <= 5);
            seen.extend(page);
            match next {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        let newest_first: Vec<TaskId> = ids.iter().rev().copied().collect();
        assert_eq!(seen, newest_first, "every task once, newest first");
        let (b, _) = h.list("kind=b&limit=100", None);
        assert_eq!(b, [ids[9], ids[6], ids[3], ids[0]]);
        let (canceled, _) = h.list("status=canceled", None);
        assert_eq!(canceled, [ids[4]]);
        let (scoped, _) = h.list("limit=100", Some(&kind("b")));
        assert_eq!(scoped, b, "a scoped caller lists its kinds only");
        assert!(h.list("kind=a", Some(&kind("b"))).0.is_empty());
    });
}
