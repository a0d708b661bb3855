//! The dispatch model (`src/dispatch/tests/model.rs`, the same file the unit tests and the
//! `dispatch_model` fuzz target run) over the PostgreSQL store, on a private server: random
//! sequences of submits, workers, answers, cancels, waits and time, every step checked against
//! the model of SPEC §5/§7 — the one core must decide the same over either store.
//!
//! Over PostgreSQL the sequences have no journal and no restarts, and keep their tasks an hour
//! (the database forgets finished tasks by its own housekeeping); each step drives the store
//! until its transactions are answered before the model looks. `MODEL_PG_SEQUENCES` sets how
//! many run (default 40), `MODEL_PG_SEED` runs one.

#[allow(dead_code)]
#[path = "../../src/dispatch/tests/model.rs"]
mod model;

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use relay::pg::db::{Db, DbConfig, Health};
use relay::pg::url::parse as parse_url;
use relay::pg::wire::{Conn, Timeouts};
use relay::store::Store;
use relay::store::pg::{PgConfig, PgStore};
use relay::tasks::{Task, TaskId};
use relay::tokens::pg::TokenCache;

use crate::support::pg::Pg;

/// The server, and a connection of the test's own to read what the store wrote.
struct Backend {
    pg: Rc<Pg>,
    reader: Conn,
    woken: Arc<AtomicBool>,
}

impl Backend {
    fn new(pg: Rc<Pg>) -> Backend {
        let params = parse_url(&pg.url()).expect("url");
        let mut reader = Conn::connect(&params, Timeouts { io_ms: 10_000 }).expect("connect");
        relay::pg::schema::migrate(&mut reader).expect("migrate");
        Backend { pg, reader, woken: Arc::new(AtomicBool::new(false)) }
    }
}

impl model::PgBackend for Backend {
    fn store(&mut self, cfg: &model::ModelConfig) -> Store {
        // A clean database: every sequence starts from nothing.
        self.reader
            .simple(
                "TRUNCATE relay_tasks, relay_pending, relay_running, relay_counters, relay_pending_counts, relay_kind_pending,
                 relay_workers, relay_nodes",
            )
            .expect("truncate");
        let node = uuid::Uuid::new_v4().hyphenated().to_string();
        let mut db_cfg = DbConfig::new(parse_url(&self.pg.url()).expect("url"), node.clone(), 100);
        db_cfg.node_name = "model".into();
        // Beat fast and settle fast: dead nodes are told from live ones after one lease, and the
        // model wants waiting tasks that lost their last worker failed at once.
        db_cfg.heartbeat_interval_ms = 50;
        db_cfg.lease_ms = 300;
        db_cfg.housekeeping_interval_ms = 50;
        let w = self.woken.clone();
        let db = Db::start(db_cfg, Arc::new(move || w.store(true, Ordering::SeqCst))).expect("db threads");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !db.settled() {
            assert!(Instant::now() < deadline, "the database never settled");
            assert!(db.health() != Health::Unreachable || Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(5));
        }
        let pg_cfg = PgConfig {
            task_ttl_ms: cfg.task_ttl_ms,
            failed_ttl_ms: 0,
            task_timeout_ms: model::TASK_TIMEOUT_MS,
            max_retries: cfg.max_retries,
            max_pending: cfg.max_pending,
            max_pending_bytes: cfg.max_pending_bytes,
        };
        let tokens = Rc::new(RefCell::new(TokenCache::default()));
        Store::Pg(Box::new(PgStore::new(node, "model".into(), db, 300, tokens, pg_cfg)))
    }

    fn wait_wake(&self, within: Duration) {
        let until = Instant::now() + within;
        while !self.woken.swap(false, Ordering::SeqCst) && Instant::now() < until {
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    fn tasks(&mut self) -> HashMap<TaskId, Task> {
        let rows = self
            .reader
            .simple(
                "SELECT id::text, status, kind, created_ms, run_at_ms, finished_ms, result, error, client_id::text,
                        client_ip, attempt_log::text, priority, reruns, fair_key, submitter,
                        CASE WHEN status = 'done' THEN NULL ELSE payload END
                 FROM relay_tasks",
            )
            .expect("tasks");
        rows.iter().flat_map(|r| r.rows.iter()).filter_map(relay::store::pg::rows::task).map(|t| (t.id, t)).collect()
    }

    fn listed(&mut self) -> Vec<TaskId> {
        let rows = self.reader.simple("SELECT id::text FROM relay_tasks ORDER BY seq DESC").expect("listed");
        rows.iter().flat_map(|r| r.rows.iter()).filter_map(|r| r.text(0).and_then(relay::tasks::parse_id)).collect()
    }
}

#[test]
fn pg_model_sequences_follow_the_model() {
    let Some(pg) = Pg::start("pg_model_sequences_follow_the_model") else { return };
    let pg = Rc::new(pg);
    let ops_per = std::env::var("MODEL_OPS").ok().and_then(|s| s.parse().ok()).unwrap_or(40);
    let seeds: Vec<u64> = match std::env::var("MODEL_PG_SEED").ok().and_then(|s| s.parse().ok()) {
        Some(seed) => vec![seed],
        None => {
            let n = std::env::var("MODEL_PG_SEQUENCES").ok().and_then(|s| s.parse().ok()).unwrap_or(40);
            (0..n).collect()
        }
    };
    let mut stats = model::Stats::default();
    for seed in seeds {
        let (cfg, ops) = model::sequence_pg(seed, ops_per);
        let backend = Box::new(Backend::new(pg.clone()));
        if let Err(f) = model::run_with(&cfg, &ops, &mut stats, Some(backend)) {
            panic!("dispatch model over PostgreSQL: seed {seed} failed\n  {f}\nconfig {cfg:?}\nops {ops:?}");
        }
    }
    let reached: Vec<String> =
        model::Seen::ALL.iter().filter(|s| stats.get(**s) > 0).map(|s| format!("{s:?} {}", stats.get(*s))).collect();
    eprintln!("dispatch model over PostgreSQL reached: {}", reached.join(", "));
    for must in [model::Seen::Dispatch, model::Seen::Done, model::Seen::Late, model::Seen::CancelDispatched] {
        assert!(stats.get(must) > 0, "the sequences never reached {must:?}: {reached:?}");
    }
}
