//! Cluster mode on PostgreSQL (SPEC §11): the private-server harness, the wire client, the
//! database thread, the schema and the statements of docs/cluster.md, each against a
//! PostgreSQL server of the test's own (`support::pg`).

use std::time::{Duration, Instant};

use crate::support::pg::Pg;

#[test]
fn pg_harness_starts_a_private_server_and_stops_it_by_pid() {
    let Some(mut pg) = Pg::start("pg_harness_starts_a_private_server_and_stops_it_by_pid") else { return };
    assert_eq!(pg.psql("select 40 + 2"), "42");
    assert_eq!(pg.psql("show fsync"), "off", "tests run with fsync off by default");
    let pid = pg.pid().expect("running");
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    let root = pg.data.parent().expect("root").to_path_buf();

    // Stop and start again on the same data: what was committed is there.
    pg.psql("create table t (x int); insert into t values (7)");
    pg.stop();
    assert!(pg.pid().is_none());
    pg.start_again();
    assert_eq!(pg.psql("select x from t"), "7");

    let started = Instant::now();
    drop(pg);
    assert!(started.elapsed() < Duration::from_secs(5), "fast shutdown");
    let gone =
        crate::support::poll_until(Duration::from_secs(5), || !std::path::Path::new(&format!("/proc/{pid}")).exists());
    assert!(gone, "the postmaster {pid} is gone after drop");
    assert!(!root.exists(), "the data directory is removed");
}

#[test]
fn pg_harness_durable_option_turns_fsync_on() {
    let opts = crate::support::pg::PgOptions { durable: true, ..Default::default() };
    let Some(mut pg) = Pg::start_with("pg_harness_durable_option_turns_fsync_on", opts) else { return };
    assert_eq!(pg.psql("show fsync"), "on");
    assert_eq!(pg.psql("show synchronous_commit"), "on");
    assert!(pg.url().contains(pg.socket_dir.to_str().expect("utf-8")) && pg.url_tcp().contains("127.0.0.1"));
    // A crash (kill -9 of the postmaster) loses nothing committed.
    pg.psql("create table t (x int); insert into t values (9)");
    pg.kill();
    pg.start_again();
    assert_eq!(pg.psql("select x from t"), "9");
}

// ---------------------------------------------------------------------------------------------
// The wire client (src/pg/wire.rs).

use relay::pg::url::parse as parse_url;
use relay::pg::wire::{Conn, Param, PgError, Stmt, Timeouts};

fn connect(url: &str) -> Conn {
    let params = parse_url(url).expect("url");
    Conn::connect(&params, Timeouts::default()).expect("connect")
}

#[test]
fn pg_wire_simple_and_pipelined_statements_over_socket_and_tcp() {
    let Some(pg) = Pg::start("pg_wire_simple_and_pipelined_statements_over_socket_and_tcp") else { return };
    for url in [pg.url(), pg.url_tcp()] {
        let mut c = connect(&url);
        let out = c.simple("create temp table t (n int, s text, b bytea); select 1, 'x'").expect("script");
        assert_eq!(out.len(), 2, "one result per statement");
        assert_eq!((out[1].rows[0].i64(0), out[1].rows[0].text(1)), (Some(1), Some("x")));

        let ins = "insert into t values ($1::int, $2::text, $3::bytea)";
        let blob: Vec<u8> = (0..=255u8).collect();
        let stmts = vec![
            Stmt::new(ins, vec![Param::from(1i64), Param::from("a ' quote"), Param::Bytes(blob.clone())]),
            Stmt::new(ins, vec![Param::from(2i64), Param::Null, Param::Null]),
            Stmt::new("select n, s, s is null from t order by n", vec![]),
            Stmt {
                sql: "select b from t where n = $1::int",
                params: vec![Param::from(1i64)],
                binary_results: true,
                json_columns: &[],
                rows_made: None,
            },
        ];
        let out = c.pipeline(&stmts).expect("pipeline");
        assert_eq!(out[0].affected, 1);
        let rows = &out[2].rows;
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].text(1), rows[1].text(1), rows[1].bool(2)), (Some("a ' quote"), None, Some(true)));
        assert_eq!(out[3].rows[0].bytes(0), Some(&blob[..]), "bytea in and out in binary, byte for byte");
        // The same statements again reuse their prepared names.
        let out = c.pipeline(&stmts[2..3]).expect("again");
        assert_eq!(out[0].rows.len(), 2);
    }
}

#[test]
fn pg_wire_a_failed_pipeline_is_rolled_back_whole_and_the_connection_survives() {
    let Some(pg) = Pg::start("pg_wire_a_failed_pipeline_is_rolled_back_whole_and_the_connection_survives") else {
        return;
    };
    let mut c = connect(&pg.url());
    c.simple("create table u (k text primary key)").expect("table");
    let ins = "insert into u values ($1::text)";
    let err = c
        .pipeline(&[
            Stmt::new(ins, vec!["a".into()]),
            Stmt::new(ins, vec!["b".into()]),
            Stmt::new(ins, vec!["a".into()]),
        ])
        .expect_err("duplicate key");
    assert_eq!(err.code(), Some("23505"), "{err}");
    assert!(!err.is_fatal());
    let n = c.pipeline(&[Stmt::new("select count(*) from u", vec![])]).expect("count");
    assert_eq!(n[0].rows[0].i64(0), Some(0), "nothing of the failed pipeline stayed");
    let bad = c.pipeline(&[Stmt::new("select nonsense from nowhere", vec![])]).expect_err("bad sql");
    assert_eq!(bad.code(), Some("42P01"));
    c.pipeline(&[Stmt::new(ins, vec!["a".into()])]).expect("usable after errors");
    // A statement that keeps failing is prepared afresh each time, and its old copy closed.
    for _ in 0..10 {
        c.pipeline(&[Stmt::new(ins, vec!["a".into()])]).expect_err("duplicate");
    }
    let n = c.pipeline(&[Stmt::new("select count(*) from pg_prepared_statements", vec![])]).expect("count");
    assert!(n[0].rows[0].i64(0).is_some_and(|n| n <= 4), "prepared statements pile up: {:?}", n[0].rows[0].i64(0));
}

#[test]
fn pg_wire_a_large_pipeline_does_not_deadlock() {
    let Some(pg) = Pg::start("pg_wire_a_large_pipeline_does_not_deadlock") else { return };
    let mut c = connect(&pg.url_tcp());
    // Far more than the socket buffers on both sides hold: the server writes results while we
    // are still writing statements.
    let stmts: Vec<Stmt> =
        (0..20_000i64).map(|i| Stmt::new("select $1::int8, repeat('x', 500)", vec![i.into()])).collect();
    let started = Instant::now();
    let out = c.pipeline(&stmts).expect("pipeline");
    assert_eq!(out.len(), 20_000);
    assert_eq!(out[19_999].rows[0].i64(0), Some(19_999));
    eprintln!("20000 statements in one pipeline: {:?}", started.elapsed());
}

#[test]
fn pg_wire_password_logins_scram_and_md5() {
    let Some(pg) = Pg::start("pg_wire_password_logins_scram_and_md5") else { return };
    pg.psql(
        "set password_encryption = 'scram-sha-256'; create role s login password 'p@ss word';
         set password_encryption = 'md5'; create role m login password 'md5pw';",
    );
    pg.set_hba(
        "local all postgres trust\n\
         host all s 127.0.0.1/32 scram-sha-256\n\
         host all m 127.0.0.1/32 md5\n\
         host all all 127.0.0.1/32 reject\n",
    );
    let port = pg.port;
    let url = |user: &str, pw: &str| format!("postgres://{user}:{pw}@127.0.0.1:{port}/postgres");
    let login = |u: &str| Conn::connect(&parse_url(u).expect("url"), Timeouts::default());
    // The reload is asynchronous: wait until the reject line is in force.
    let reloaded = crate::support::poll_until(Duration::from_secs(5), || {
        login(&format!("postgres://postgres@127.0.0.1:{port}/postgres")).is_err()
    });
    assert!(reloaded, "pg_hba.conf reloaded");
    let mut c = login(&url("s", "p%40ss%20word")).expect("scram login");
    assert_eq!(c.simple("select current_user").expect("q")[0].rows[0].text(0), Some("s"));
    let mut c = login(&url("m", "md5pw")).expect("md5 login");
    assert_eq!(c.simple("select current_user").expect("q")[0].rows[0].text(0), Some("m"));
    assert!(matches!(login(&url("s", "wrong")), Err(PgError::Db { .. })), "a wrong password is refused");
    assert!(login(&format!("postgres://s@127.0.0.1:{port}/postgres")).is_err(), "no password given");
}

#[test]
fn pg_wire_notifications_arrive_while_idle_and_between_calls() {
    let Some(pg) = Pg::start("pg_wire_notifications_arrive_while_idle_and_between_calls") else { return };
    let mut listener = connect(&pg.url());
    listener.simple("listen relay_pending").expect("listen");
    let mut other = connect(&pg.url());
    assert_eq!(listener.wait_notification(Duration::from_millis(50)).expect("idle"), None);
    other.pipeline(&[Stmt::new("select pg_notify('relay_pending', $1::text)", vec!["n1".into()])]).expect("notify");
    let n = listener.wait_notification(Duration::from_secs(5)).expect("wait").expect("a notification");
    assert_eq!((n.channel.as_str(), n.payload.as_str()), ("relay_pending", "n1"));
    // One that arrives around a query (before it, or during it) is kept for later.
    other.simple("notify relay_pending, 'n2'").expect("notify");
    listener.simple("select 1").expect("query");
    let n = listener.wait_notification(Duration::from_secs(5)).expect("wait").expect("kept");
    assert_eq!(n.payload, "n2");
}

#[test]
fn pg_wire_a_dead_server_is_an_error_not_a_hang() {
    let Some(mut pg) = Pg::start("pg_wire_a_dead_server_is_an_error_not_a_hang") else { return };
    let mut c = connect(&pg.url_tcp());
    c.simple("select 1").expect("alive");
    pg.stop();
    let started = Instant::now();
    let err = c.simple("select 1").expect_err("the server is gone");
    assert!(err.is_fatal(), "{err}");
    assert!(Conn::connect(&parse_url(&pg.url_tcp()).expect("url"), Timeouts::default()).is_err());
    assert!(started.elapsed() < Duration::from_secs(5), "errors come promptly: {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------------------------
// Schema migrations (src/pg/schema.rs).

use relay::pg::schema;

#[test]
fn pg_schema_migrations_are_versioned_and_safe_when_nodes_start_together() {
    let Some(pg) = Pg::start("pg_schema_migrations_are_versioned_and_safe_when_nodes_start_together") else { return };
    let url = pg.url();
    let starters: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || schema::migrate(&mut connect(&url)).expect("migrate"))
        })
        .collect();
    let results: Vec<schema::Migrated> = starters.into_iter().map(|t| t.join().expect("thread")).collect();
    let latest = schema::latest_version();
    assert_eq!(results.iter().filter(|m| m.from == 0).count(), 1, "exactly one node applied v1: {results:?}");
    assert!(results.iter().all(|m| m.to == latest));
    let all: Vec<String> = (1..=latest).map(|v| v.to_string()).collect();
    assert_eq!(pg.psql("select string_agg(version::text, ',' order by version) from relay_schema"), all.join(","));

    let mut c = connect(&url);
    assert_eq!(schema::migrate(&mut c).expect("again"), schema::Migrated { from: latest, to: latest });
    // A later build adds a version: only that one runs.
    let mut next = schema::MIGRATIONS.to_vec();
    next.push((latest + 1, "a test column", "ALTER TABLE relay_nodes ADD COLUMN test_col int"));
    assert_eq!(schema::migrate_to(&mut c, &next).expect("upgrade"), schema::Migrated { from: latest, to: latest + 1 });
    assert_eq!(pg.psql("select count(*) from relay_schema"), (latest + 1).to_string());
    // An older build refuses a newer schema, and leaves it alone.
    let err = schema::migrate(&mut c).expect_err("newer schema");
    assert!(err.to_string().contains("newer than this relay knows"), "{err}");
    // A failing migration leaves nothing behind (one transaction).
    let mut bad = next.clone();
    bad.push((latest + 2, "broken", "CREATE TABLE half_done (x int); SELECT no_such_function()"));
    assert!(schema::migrate_to(&mut c, &bad).is_err());
    assert_eq!(pg.psql("select count(*) from pg_tables where tablename = 'half_done'"), "0");
    assert_eq!(pg.psql("select max(version) from relay_schema"), (latest + 1).to_string());
}

// ---------------------------------------------------------------------------------------------
// The database thread (src/pg/db.rs).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use relay::pg::db::{Db, DbConfig, Failure, Health, Reply, Request, SendError};
use relay::pg::sql;

fn db_config(pg: &Pg, node: &str) -> DbConfig {
    let mut cfg = DbConfig::new(parse_url(&pg.url()).expect("url"), node.to_string(), 1_000);
    cfg.backoff_min_ms = 50;
    cfg.backoff_max_ms = 300;
    cfg.heartbeat_interval_ms = 200;
    cfg.io_timeout_ms = 2_000;
    cfg
}

fn start_db(cfg: DbConfig) -> (Db, Arc<AtomicUsize>) {
    let wakes = Arc::new(AtomicUsize::new(0));
    let w = wakes.clone();
    let db = Db::start(
        cfg,
        Arc::new(move || {
            w.fetch_add(1, Ordering::SeqCst);
        }),
    )
    .expect("start db");
    (db, wakes)
}

fn wait_health(db: &Db, h: Health, within: Duration) {
    assert!(crate::support::poll_until(within, || db.health() == h), "database never became {h:?}");
}

/// Waits for the reply tagged `tag`.
fn reply(db: &Db, tag: u64) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    loop {
        db.take_replies(&mut got);
        if let Some(i) = got.iter().position(|r| r.tag == tag) {
            return got.swap_remove(i);
        }
        assert!(Instant::now() < deadline, "no reply {tag}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

const NODE_A: &str = "00000000-0000-4000-8000-00000000000a";
const NODE_B: &str = "00000000-0000-4000-8000-00000000000b";

#[test]
fn pg_db_thread_answers_through_the_queue_and_wakes_the_loop() {
    let Some(pg) = Pg::start("pg_db_thread_answers_through_the_queue_and_wakes_the_loop") else { return };
    let (db, wakes) = start_db(db_config(&pg, NODE_A));
    wait_health(&db, Health::Ok, Duration::from_secs(10));
    assert_eq!(pg.psql(&format!("select count(*) from relay_nodes where node_id = '{NODE_A}'")), "1", "heartbeat");

    let before = wakes.load(Ordering::SeqCst);
    let task = new_task("11111111-1111-4111-8111-111111111111", Some("http"), None);
    db.send(Request { tag: 7, stmts: vec![insert(&[task])] }).expect("send");
    let r = reply(&db, 7);
    let rows = r.result.expect("inserted");
    assert_eq!(rows[0].rows.len(), 1);
    assert!(wakes.load(Ordering::SeqCst) > before, "the reply woke the loop");

    // A refused transaction is reported as such; the connection goes on.
    db.send(Request { tag: 8, stmts: vec![Stmt::new("select 1/0", vec![])] }).expect("send");
    assert!(matches!(reply(&db, 8).result, Err(Failure::Refused(_))));
    assert_eq!(db.health(), Health::Ok);
}

#[test]
fn pg_db_notify_is_debounced_and_listen_raises_one_flag() {
    let Some(pg) = Pg::start("pg_db_notify_is_debounced_and_listen_raises_one_flag") else { return };
    let mut watcher = connect(&pg.url());
    watcher.simple("listen relay_pending").expect("listen");
    let (db, _) = start_db(db_config(&pg, NODE_A));
    wait_health(&db, Health::Ok, Duration::from_secs(10));
    // The listener thread raises every flag once when it connects; wait for that, then clear.
    assert!(crate::support::poll_until(Duration::from_secs(5), || !db.take_notified().is_empty()));

    for _ in 0..1000 {
        db.notify(sql::CHANNEL_PENDING);
    }
    db.send(Request { tag: 1, stmts: vec![Stmt::new("select 1", vec![])] }).expect("send");
    reply(&db, 1).result.expect("ok");
    let first = watcher.wait_notification(Duration::from_secs(5)).expect("wait");
    assert_eq!(first.map(|n| n.channel), Some("relay_pending".to_string()));
    assert_eq!(watcher.wait_notification(Duration::from_millis(300)).expect("wait"), None, "one NOTIFY, not 1000");

    // The node's own listener does not raise a flag for what the node itself sent (it knows).
    let echoed = crate::support::poll_until(Duration::from_millis(500), || !db.take_notified().is_empty());
    assert!(!echoed, "a node's own notification came back to it");
    // A notification from elsewhere (another node) raises the flag.
    watcher.simple("notify relay_cancel, 'x'").expect("notify");
    assert!(crate::support::poll_until(Duration::from_secs(5), || db.take_notified() == vec![sql::CHANNEL_CANCEL]));
}

#[test]
fn pg_db_outage_fails_fast_and_reconnects_when_the_database_returns() {
    let Some(mut pg) = Pg::start("pg_db_outage_fails_fast_and_reconnects_when_the_database_returns") else { return };
    let (db, wakes) = start_db(db_config(&pg, NODE_A));
    wait_health(&db, Health::Ok, Duration::from_secs(10));

    let before = wakes.load(Ordering::SeqCst);
    pg.stop();
    wait_health(&db, Health::Unreachable, Duration::from_secs(5));
    assert!(wakes.load(Ordering::SeqCst) > before, "the loop was woken to see the change");
    let started = Instant::now();
    let refused = db.send(Request { tag: 1, stmts: vec![Stmt::new("select 1", vec![])] });
    assert!(matches!(refused, Err(SendError::Unreachable(_))), "{refused:?}");
    assert!(started.elapsed() < Duration::from_millis(50), "refused at once");

    pg.start_again();
    wait_health(&db, Health::Ok, Duration::from_secs(10));
    db.send(Request { tag: 2, stmts: vec![Stmt::new("select 1", vec![])] }).expect("send");
    reply(&db, 2).result.expect("served again");
}

#[test]
fn pg_db_full_queue_is_busy_and_a_broken_transaction_is_lost() {
    let Some(mut pg) = Pg::start("pg_db_full_queue_is_busy_and_a_broken_transaction_is_lost") else { return };
    let mut cfg = db_config(&pg, NODE_A);
    cfg.max_queued_requests = 1;
    let (db, _) = start_db(cfg);
    wait_health(&db, Health::Ok, Duration::from_secs(10));
    let sleep = |tag| Request { tag, stmts: vec![Stmt::new("select pg_sleep(0.5)", vec![])] };
    // One runs, one waits in the channel; the others are refused at once.
    let taken: Vec<u64> = (1..=4).filter(|tag| !matches!(db.send(sleep(*tag)), Err(SendError::Busy(_)))).collect();
    assert!(taken.len() <= 2, "{taken:?} of 4 taken: the others are refused as busy");
    assert_eq!(taken.first(), Some(&1), "the first is taken");
    for tag in taken {
        reply(&db, tag).result.expect("what was taken ran");
    }

    // A transaction the server ends midway: Lost (it may or may not have committed).
    let tag = 100;
    db.send(Request { tag, stmts: vec![Stmt::new("select pg_sleep(5)", vec![])] }).expect("send");
    let running = crate::support::poll_until(Duration::from_secs(5), || {
        pg.psql("select count(*) from pg_stat_activity where query = 'select pg_sleep(5)' and state = 'active'") == "1"
    });
    assert!(running, "the transaction is under way");
    pg.stop();
    match reply(&db, tag).result {
        Err(Failure::Lost(_)) => {}
        other => panic!("expected Lost, got {other:?}"),
    }
}

#[test]
fn pg_db_unreachable_at_start_refuses_and_keeps_trying() {
    let Some(mut pg) = Pg::start("pg_db_unreachable_at_start_refuses_and_keeps_trying") else { return };
    pg.stop();
    let (db, _) = start_db(db_config(&pg, NODE_A));
    assert_eq!(db.health(), Health::Unreachable);
    assert!(matches!(db.send(Request { tag: 1, stmts: vec![] }), Err(SendError::Unreachable(_))));
    pg.start_again();
    wait_health(&db, Health::Ok, Duration::from_secs(10));
    assert_eq!(pg.psql("select count(*) from relay_schema"), schema::latest_version().to_string(), "migrated");
}

// ---------------------------------------------------------------------------------------------
// The statements of docs/cluster.md (src/pg/sql.rs).

fn new_task(id: &str, kind: Option<&str>, key: Option<&str>) -> sql::NewTask {
    sql::NewTask {
        id: id.to_string(),
        kind: kind.map(String::from),
        payload: format!(r#"{{"kind":"{}","n":"{id}"}}"#, kind.unwrap_or("")),
        queue: true,
        timeout_ms: None,
        max_retries: None,
        created_ms: 1_000,
        run_at_ms: 1_000,
        idem_owner: key.map(|_| "root".to_string()),
        idem_key: key.map(String::from),
        runs_now: false,
        retry_backoff_ms: None,
        retry_backoff_max_ms: None,
        retry_any_worker: None,
        priority: 0,
        submitter: String::new(),
        fair_key: String::new(),
    }
}

/// `INSERT_TASKS` with room for everything.
fn insert(tasks: &[sql::NewTask]) -> Stmt {
    sql::insert_tasks(tasks, 1 << 40, 1 << 50)
}

/// The rows of an `INSERT_TASKS` answer that were inserted.
fn inserted(rows: &relay::pg::wire::Rows) -> usize {
    rows.rows.iter().filter(|r| r.i64(1).is_some()).count()
}

fn uuid_n(n: u32) -> String {
    format!("00000000-0000-4000-8000-{n:012x}")
}

fn migrated(pg: &Pg) -> Conn {
    let mut c = connect(&pg.url());
    schema::migrate(&mut c).expect("migrate");
    c
}

/// The counters the triggers keep must equal a count of the rows.
fn assert_counts_match(pg: &Pg) {
    let counted = pg.psql(
        "select coalesce(string_agg(status || '=' || n, ',' order by status), '') from
           (select status, sum(n) as n from relay_counters group by status having sum(n) <> 0) x",
    );
    let actual = pg.psql(
        "select coalesce(string_agg(status || '=' || c, ',' order by status), '') from
           (select status, count(*) as c from relay_tasks group by status) y",
    );
    assert_eq!(counted, actual, "relay_counters vs the rows");
    assert!(!actual.is_empty(), "there is something to count");
    assert_kind_counts_match(pg);
}

/// The pending counts per kind the triggers keep (`relay_kind_pending`, summed over nodes) must
/// equal a count of the pending rows, and so must what `KINDS` and `KIND_GAUGES` answer.
fn assert_kind_counts_match(pg: &Pg) {
    let counted = pg.psql(
        "select coalesce(string_agg(kind || '=' || n, ',' order by kind), '') from
           (select kind, sum(n) as n from relay_kind_pending group by kind having sum(n) <> 0) x",
    );
    let actual = pg.psql(
        "select coalesce(string_agg(kind || '=' || c, ',' order by kind), '') from
           (select kind, count(*) as c from relay_pending where kind is not null group by kind) y",
    );
    assert_eq!(counted, actual, "relay_kind_pending vs the pending rows");
    let mut c = connect(&pg.url());
    let out = c.pipeline(&[Stmt::new(sql::KINDS, vec![Param::Null])]).expect("kinds");
    let listed: Vec<String> = out[0]
        .rows
        .iter()
        .filter(|r| r.i64(3).is_some_and(|n| n != 0))
        .map(|r| format!("{}={}", r.text(0).unwrap_or_default(), r.i64(3).unwrap_or_default()))
        .collect();
    assert_eq!(listed.join(","), actual, "KINDS' pending column");
    let kinds: Vec<&str> = actual.split(',').filter_map(|kn| kn.split('=').next()).filter(|k| !k.is_empty()).collect();
    let out = c.pipeline(&[Stmt::new(sql::KIND_GAUGES, vec![sql::array(kinds.iter().map(|k| Some(*k))).into()])]);
    let gauges: Vec<String> = out.expect("gauges")[0]
        .rows
        .iter()
        .map(|r| format!("{}={}", r.text(0).unwrap_or_default(), r.i64(2).unwrap_or_default()))
        .collect();
    assert_eq!(gauges.join(","), actual, "KIND_GAUGES' pending column");
    c.close();
}

fn heartbeat(c: &mut Conn, node: &str, name: &str) {
    c.pipeline(&[Stmt::new(sql::HEARTBEAT, vec![node.into(), name.into(), 0i64.into(), "test".into()])])
        .expect("heartbeat");
}

#[test]
fn pg_sql_claim_with_skip_locked_hands_each_task_to_one_node() {
    let Some(pg) = Pg::start("pg_sql_claim_with_skip_locked_hands_each_task_to_one_node") else { return };
    let mut c = migrated(&pg);
    let tasks: Vec<sql::NewTask> = (0..2000).map(|i| new_task(&uuid_n(i), Some("http"), None)).collect();
    let out = c.pipeline(&[insert(&tasks)]).expect("submit");
    assert_eq!(inserted(&out[0]), 2000);
    assert_eq!(pg.psql("select count(*) from relay_pending"), "2000");

    // A claim held open in a transaction: others skip its rows instead of waiting for them.
    // Each claimer is a node: its session is tagged, as the database thread does, so the
    // counters' triggers write the node's own rows and nodes never wait for each other.
    let mut holder = connect(&pg.url());
    holder.pipeline(&[Stmt::new(sql::SET_NODE, vec![NODE_A.into()])]).expect("tag");
    holder.simple("BEGIN").expect("begin");
    let held = holder.pipeline(&[claim(NODE_A, &uuid_n(9000), Some(&["http"]), 10, 2_000)]).expect("claim");
    assert_eq!(held[0].rows.len(), 10);

    let claimers: Vec<_> = (0..4)
        .map(|n| {
            let url = pg.url();
            std::thread::spawn(move || {
                let mut c = connect(&url);
                let node = uuid_n(100 + n);
                c.pipeline(&[Stmt::new(sql::SET_NODE, vec![node.as_str().into()])]).expect("tag");
                let mut mine = Vec::new();
                loop {
                    let started = Instant::now();
                    let out = c.pipeline(&[claim(&node, &uuid_n(9001), Some(&["http"]), 25, 2_000)]).expect("claim");
                    assert!(started.elapsed() < Duration::from_secs(2), "a claim never waits on locked rows");
                    if out[0].rows.is_empty() {
                        return mine;
                    }
                    mine.extend(out[0].rows.iter().map(|r| r.text(0).expect("id").to_string()));
                }
            })
        })
        .collect();
    let mut all: Vec<String> = claimers.into_iter().flat_map(|t| t.join().expect("claimer")).collect();
    assert_eq!(all.len(), 1990, "everything but the 10 held rows");
    holder.simple("COMMIT").expect("commit");
    all.extend(held[0].rows.iter().map(|r| r.text(0).expect("id").to_string()));
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 2000, "no task claimed twice");
    assert_eq!(pg.psql("select count(*) from relay_tasks where status = 'dispatched' and attempt = 1"), "2000");

    // Kinds, due times and the tried list filter the claim.
    let mut t = new_task(&uuid_n(5000), Some("file"), None);
    t.run_at_ms = 50_000;
    c.pipeline(&[insert(&[t, new_task(&uuid_n(5001), None, None)])]).expect("submit");
    let claim = |c: &mut Conn, kinds: Option<&[&str]>, now: u64| {
        c.pipeline(&[claim(NODE_A, &uuid_n(9002), kinds, 10, now)]).expect("claim")[0].rows.len()
    };
    assert_eq!(claim(&mut c, Some(&["http"]), 60_000), 0, "no http task left");
    assert_eq!(claim(&mut c, Some(&["file"]), 40_000), 0, "not due yet");
    assert_eq!(claim(&mut c, Some(&["file"]), 60_000), 1);
    assert_eq!(claim(&mut c, Some(&["file"]), 60_000), 0, "a task without kind needs a worker without kinds");
    assert_eq!(claim(&mut c, None, 60_000), 1);
    assert_counts_match(&pg);
}

/// A claim of up to `slots` tasks for one idle worker `client` of `node` (kinds `kinds`).
fn claim(node: &str, client: &str, kinds: Option<&[&str]>, slots: u32, now_ms: u64) -> Stmt {
    sql::claim(node, 1, kinds, now_ms, slots, &format!("{{{client}}}"))
}

fn runner(client: &str) -> sql::Runner {
    sql::Runner { client_id: client.to_string(), client_ip: "127.0.0.1".into(), started_ms: 5_000 }
}

/// Claims one http task for `client`, a worker of `node`, and starts its attempt on it.
fn claim_and_start(c: &mut Conn, node: &str, name: &str, client: &str) -> (String, u32) {
    let out = c.pipeline(&[claim(node, client, Some(&["http"]), 1, 10_000)]).expect("claim");
    let row = out[0].rows.first().expect("a task to claim");
    let (id, attempt) = (row.text(0).expect("id").to_string(), row.i64(1).expect("attempt") as u32);
    c.pipeline(&[sql::attempt_started(node, name, &[(id.clone(), attempt, runner(client))])]).expect("start");
    (id, attempt)
}

fn ended(id: &str, attempt: u32, outcome: &'static str, status: &'static str, client: &str) -> sql::Ended {
    sql::Ended {
        id: id.to_string(),
        attempt,
        outcome,
        error: (outcome != "done").then(|| format!("{outcome} on {client}")),
        ended_ms: 6_000,
        duration_ms: Some(1_000),
        status,
        result: (status == "done").then(|| r#"{"ok":true}"#.to_string()),
        final_error: (status == "failed").then(|| format!("{outcome} on {client}")),
        runner: Some(runner(client)),
        node: None,
        uncounted: false,
        next_attempt_ms: None,
        again: None,
        resumes: 0,
    }
}

/// `ATTEMPT_ENDED` as node `node` named `name` writes it: its own attempts name it.
fn end_as(node: &str, name: &str, ended: &[sql::Ended]) -> Stmt {
    let named: Vec<sql::Ended> =
        ended.iter().map(|e| sql::Ended { node: e.runner.as_ref().map(|_| name.to_string()), ..e.clone() }).collect();
    sql::attempt_ended(node, &named)
}

/// (status, attempts in the log, the log) of a task.
fn task_row(c: &mut Conn, id: &str) -> (String, u32, serde_json::Value) {
    let out = c.pipeline(&[Stmt::new(sql::GET_TASKS, vec![Param::Text(format!("{{{id}}}"))])]).expect("get");
    let row = &out[0].rows[0];
    let log: serde_json::Value = serde_json::from_str(row.text(10).expect("log")).expect("json");
    let n = log.as_array().map_or(0, Vec::len) as u32;
    (row.text(1).expect("status").to_string(), n, log)
}

#[test]
fn pg_sql_fenced_completion_refuses_a_stale_node() {
    let Some(pg) = Pg::start("pg_sql_fenced_completion_refuses_a_stale_node") else { return };
    let mut c = migrated(&pg);
    let id = uuid_n(1);
    c.pipeline(&[insert(&[new_task(&id, Some("http"), None)])]).expect("submit");
    heartbeat(&mut c, NODE_A, "node-a");
    heartbeat(&mut c, NODE_B, "node-b");
    let (wa, wb) = (uuid_n(0xa1), uuid_n(0xb1));
    let (got, attempt) = claim_and_start(&mut c, NODE_A, "node-a", &wa);
    assert_eq!((got.as_str(), attempt), (id.as_str(), 1));

    // Node A goes silent past its lease; B adopts its attempt (naming A) and closes it.
    c.simple(&format!("update relay_nodes set heartbeat_ms = heartbeat_ms - 60000 where node_id = '{NODE_A}'"))
        .expect("age A");
    let adopt = Stmt::new(sql::ADOPT_ORPHANS, vec![NODE_B.into(), 6_000i64.into(), 10_000i64.into(), 30_000i64.into()]);
    let out = c.pipeline(std::slice::from_ref(&adopt)).expect("adopt");
    assert_eq!(out[0].rows.len(), 1);
    assert_eq!((out[0].rows[0].text(0), out[0].rows[0].i64(1)), (Some(id.as_str()), Some(1)));
    assert_eq!(out[0].rows[0].text(8), Some("node-a"), "the lost node is named");
    assert!(c.pipeline(&[adopt]).expect("adopt")[0].rows.is_empty(), "adopted once");
    let mut lost = ended(&id, 1, "disconnect", "pending", &wa);
    lost.runner = None;
    lost.error = Some("relay node node-a was lost".into());
    assert_eq!(c.pipeline(&[end_as(NODE_B, "node-b", &[lost])]).expect("close")[0].rows.len(), 1);
    let (status, _, log) = task_row(&mut c, &id);
    assert_eq!(status, "pending");
    assert_eq!(log[0]["outcome"], "disconnect");
    assert_eq!(log[0]["client_id"], wa.as_str(), "the entry A wrote is kept");
    assert!(log[0]["error"].as_str().is_some_and(|e| e.contains("node-a")), "{log}");

    // B claims it for a worker A's attempt did not use: attempt 2.
    let out = c.pipeline(&[claim(NODE_B, &wa, Some(&["http"]), 1, 10_000)]).expect("claim");
    assert!(out[0].rows.is_empty(), "the only idle worker already tried it");
    let (_, attempt2) = claim_and_start(&mut c, NODE_B, "node-b", &wb);
    assert_eq!(attempt2, 2);

    // A comes back with its late answer: refused by the WHERE (node and attempt).
    let stale = c.pipeline(&[end_as(NODE_A, "node-a", &[ended(&id, 1, "done", "done", &wa)])]).expect("s");
    assert!(stale[0].rows.is_empty(), "a stale node's write matches nothing");
    let wrong_attempt = c.pipeline(&[end_as(NODE_B, "node-b", &[ended(&id, 1, "done", "done", &wb)])]).expect("x");
    assert!(wrong_attempt[0].rows.is_empty(), "an earlier attempt's answer matches nothing");
    let ok = c.pipeline(&[end_as(NODE_B, "node-b", &[ended(&id, 2, "done", "done", &wb)])]).expect("ok");
    assert_eq!(ok[0].rows.len(), 1);
    let dup = c.pipeline(&[end_as(NODE_B, "node-b", &[ended(&id, 2, "done", "done", &wb)])]).expect("d");
    assert!(dup[0].rows.is_empty(), "a duplicate matches nothing");

    let (status, attempts, log) = task_row(&mut c, &id);
    assert_eq!((status.as_str(), attempts), ("done", 2));
    assert_eq!(log.as_array().map(Vec::len), Some(2));
    assert_eq!((log[1]["node"].as_str(), log[1]["outcome"].as_str()), (Some("node-b"), Some("done")));
    assert_eq!(log[0]["node"], "node-a");
    assert_counts_match(&pg);
}

#[test]
fn pg_sql_retry_goes_to_an_untried_worker_on_any_node_and_cancel_fences() {
    let Some(pg) = Pg::start("pg_sql_retry_goes_to_an_untried_worker_on_any_node_and_cancel_fences") else { return };
    let mut c = migrated(&pg);
    let id = uuid_n(2);
    c.pipeline(&[insert(&[new_task(&id, Some("http"), None)])]).expect("submit");
    let (w1, w2) = (uuid_n(0x11), uuid_n(0x22));
    claim_and_start(&mut c, NODE_A, "a", &w1);
    let out = c.pipeline(&[end_as(NODE_A, "a", &[ended(&id, 1, "failed", "pending", &w1)])]).expect("f");
    assert_eq!(out[0].rows[0].text(1), Some("pending"), "back to pending for a retry");
    assert_eq!(pg.psql(&format!("select tried::text from relay_pending where task_id = '{id}'")), format!("{{{w1}}}"));
    let none = c.pipeline(&[claim(NODE_B, &w1, Some(&["http"]), 1, 10_000)]).expect("claim");
    assert!(none[0].rows.is_empty(), "not to the worker that failed it");
    let (_, attempt) = claim_and_start(&mut c, NODE_B, "b", &w2);
    assert_eq!(attempt, 2);

    // Cancel from a third node: the owner is named (to send `cancel` to its worker) and its
    // later answer is fenced.
    // A scoped caller whose kinds do not include the task's touches nothing.
    let cancel = |c: &mut Conn, scope: Param| {
        c.pipeline(&[Stmt::new(sql::CANCEL, vec![id.as_str().into(), 8_000i64.into(), scope])]).expect("cancel")
    };
    let out = cancel(&mut c, sql::array([Some("file")]).into());
    assert!(out[0].rows.is_empty(), "out of the caller's scope");
    let out = cancel(&mut c, Param::Null);
    assert_eq!(out[0].rows[0].text(0), Some(NODE_B));
    let again = cancel(&mut c, sql::array([Some("http")]).into());
    assert!(again[0].rows.is_empty(), "already final");
    let late = c.pipeline(&[end_as(NODE_B, "b", &[ended(&id, 2, "done", "done", &w2)])]).expect("late");
    assert!(late[0].rows.is_empty());
    let (status, _, log) = task_row(&mut c, &id);
    assert_eq!(status, "canceled");
    assert_eq!(log[1]["outcome"], "canceled");

    // A claim whose worker left before the task was sent is given back whole.
    let other = uuid_n(3);
    c.pipeline(&[insert(&[new_task(&other, Some("http"), None)])]).expect("submit");
    let out = c.pipeline(&[claim(NODE_A, &w1, Some(&["http"]), 1, 10_000)]).expect("claim");
    let (got, attempt) = (out[0].rows[0].text(0).expect("id").to_string(), out[0].rows[0].i64(1).expect("attempt"));
    assert_eq!((got.as_str(), attempt), (other.as_str(), 1));
    let stale = c.pipeline(&[sql::unclaim(NODE_B, &[(other.clone(), 1)])]).expect("unclaim");
    assert!(stale[0].rows.is_empty(), "only the owner may give it back");
    let back = c.pipeline(&[sql::unclaim(NODE_A, &[(other.clone(), 1)])]).expect("unclaim");
    assert_eq!(back[0].rows.len(), 1);
    let (status, attempts, log) = task_row(&mut c, &other);
    assert_eq!((status.as_str(), attempts, log), ("pending", 0, serde_json::json!([])));
    let (_, attempt) = claim_and_start(&mut c, NODE_A, "a", &w1);
    assert_eq!(attempt, 1, "the same worker may take it: it never had it");
    assert_counts_match(&pg);
}

#[test]
fn pg_sql_idempotency_keys_expiry_and_retention() {
    let Some(pg) = Pg::start("pg_sql_idempotency_keys_expiry_and_retention") else { return };
    let mut c = migrated(&pg);
    let first = new_task(&uuid_n(1), Some("http"), Some("k1"));
    let repeat = new_task(&uuid_n(2), Some("http"), Some("k1"));
    let out = c
        .pipeline(&[
            insert(&[first]),
            insert(&[repeat, new_task(&uuid_n(3), Some("http"), Some("k2"))]),
            Stmt::new(sql::IDEMPOTENT_LOOKUP, vec![sql::array([Some("root")]).into(), sql::array([Some("k1")]).into()]),
        ])
        .expect("submit");
    assert_eq!(inserted(&out[1]), 1, "the repeat created nothing");
    assert_eq!(out[1].rows[0].i64(1), None, "the repeat: not inserted");
    assert_eq!(out[1].rows[0].bool(2), Some(true), "(there was room: its key was taken)");
    assert_eq!(out[1].rows[1].text(0), Some(uuid_n(3).as_str()));
    assert_eq!(out[2].rows[0].text(2), Some(uuid_n(1).as_str()), "the key names the first task");
    assert_eq!(pg.psql("select count(*) from relay_pending"), "2");

    // Pending past TASK_TTL after due: failed `expired in queue`.
    let out = c.pipeline(&[sql::expire_in_queue(1_000 + 3_600_001, 3_600_000)]).expect("expire");
    assert_eq!(out[0].affected, 2);
    assert_eq!(pg.psql("select count(*) from relay_tasks where error = 'expired in queue'"), "2");
    // Finished past TASK_TTL: deleted, and the key is free again.
    let now = 1_000 + 3_600_001 + 3_600_001;
    let out = c.pipeline(&[sql::retention(now, 3_600_000, 3_600_000)]).expect("retention");
    assert_eq!(out[0].rows[0].i64(0), Some(2), "it answers how many it deleted");
    let out = c.pipeline(&[insert(&[new_task(&uuid_n(4), Some("http"), Some("k2"))])]).expect("reuse");
    assert_eq!(inserted(&out[0]), 1, "a key lives as long as its task");
    assert_counts_match(&pg);
    // The node's session tags its changes: the counter rows are its own.
    c.pipeline(&[Stmt::new(sql::SET_NODE, vec![NODE_A.into()])]).expect("tag");
    c.pipeline(&[insert(&[new_task(&uuid_n(5), Some("http"), None)])]).expect("submit");
    assert_eq!(
        pg.psql(&format!("select n from relay_counters where node_id = '{NODE_A}' and status = 'pending'")),
        "1"
    );
    let out = c.pipeline(&[Stmt::new(sql::COUNTS, vec![])]).expect("counts");
    let pending = out[0].rows.iter().find(|r| r.text(0) == Some("pending")).and_then(|r| r.i64(1));
    assert_eq!(pending, Some(2));
    assert_counts_match(&pg);
}

// ---------------------------------------------------------------------------------------------
// `relay token ...` with DATABASE_URL (src/tokens/pg.rs).

const TOKEN_SECRET: &str = "integration-test-secret-0123456789abcdef";

fn token_cli(url: &str, store: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let mut full = vec!["token"];
    full.extend_from_slice(args);
    crate::support::run_relay_env(
        &full,
        &[("TOKEN_SECRET", TOKEN_SECRET), ("DATABASE_URL", url), ("TOKEN_STORE", store)],
    )
}

#[test]
fn pg_token_cli_manages_the_registry_in_the_database() {
    let Some(mut pg) = Pg::start("pg_token_cli_manages_the_registry_in_the_database") else { return };
    let url = pg.url();
    let store = pg.data.parent().expect("root").join("tokens.json");
    let store = store.to_str().expect("utf-8");
    let cli = |args: &[&str]| token_cli(&url, store, args);

    let (code, out, err) = cli(&["create", "--name", "billing", "--kinds", "http,file", "--ttl", "1h"]);
    assert_eq!(code, Some(0), "{err}");
    let field = |out: &str, key: &str| {
        out.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(": ").map(String::from)).expect(key)
    };
    let (jti, token) = (field(&out, "jti"), field(&out, "token"));
    assert_eq!((field(&out, "name").as_str(), field(&out, "kinds").as_str()), ("billing", "http,file"));
    let (code, out, _) = cli(&["create", "--name", "ops", "--kinds", "http", "--ttl", "2h", "--json"]);
    assert_eq!(code, Some(0));
    let created: serde_json::Value = serde_json::from_str(&out).expect("create --json");
    let keys: Vec<&str> = created.as_object().expect("object").keys().map(String::as_str).collect();
    assert_eq!(keys.len(), 5, "{created}");
    for key in ["jti", "name", "kinds", "expires", "token"] {
        assert!(created.get(key).is_some(), "{key} in {created}");
    }

    let (code, out, _) = cli(&["list"]);
    assert_eq!(code, Some(0));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(lines[0].starts_with("JTI") && lines[0].contains("STATUS") && lines[0].contains("EXPIRES"), "{out}");
    assert!(lines[1].starts_with(&jti) && lines[1].contains(" active "), "{out}");

    let (code, out, _) = cli(&["revoke", &jti]);
    assert_eq!(code, Some(0));
    assert!(out.starts_with(&format!("revoked: {jti}")), "{out}");
    let (code, out, _) = cli(&["revoke", &jti]);
    assert_eq!(code, Some(0));
    assert!(out.starts_with("already revoked"), "{out}");
    let (code, _, err) = cli(&["revoke", "no-such-jti"]);
    assert_eq!(code, Some(1), "unknown jti: {err}");

    let (code, out, _) = cli(&["list", "--json"]);
    assert_eq!(code, Some(0));
    let list: serde_json::Value = serde_json::from_str(&out).expect("list --json");
    let first = &list[0];
    assert_eq!((first["jti"].as_str(), first["status"].as_str()), (Some(jti.as_str()), Some("revoked")));
    assert_eq!(first["kinds"], serde_json::json!(["http", "file"]));
    assert!(first["revoked_at"].is_string() && first["created_at"].is_string() && first["expires_at"].is_string());
    assert_eq!(list[1]["status"], "active");
    assert!(list[1].get("revoked_at").is_none());

    // The database holds no token material, and the file registry was never used.
    let dump = pg.psql("select string_agg(t::text, ' ') from relay_tokens t");
    assert!(dump.contains(&jti) && !dump.contains(&token), "{dump}");
    assert!(!std::path::Path::new(store).exists());

    // Database down: a prompt failure (exit 1), not a hang.
    pg.stop();
    let started = Instant::now();
    let (code, _, err) = cli(&["list"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("database"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
    let (code, _, err) = token_cli("mysql://h/db", store, &["list"]);
    assert_eq!(code, Some(2), "another scheme is a configuration error: {err}");
    assert!(err.contains("DATABASE_URL"), "{err}");
}

/// Figures for docs/cluster.md (not a check; run with `--ignored --nocapture`): the cost of
/// 1000 task inserts as 1000 round trips, as one pipeline, and as one array statement.
#[test]
#[ignore]
fn pg_bench_round_trips_pipelines_and_arrays() {
    let Some(pg) = Pg::start("pg_bench_round_trips_pipelines_and_arrays") else { return };
    let mut c = migrated(&pg);
    let mut n = 0u32;
    let mut batch = |count: u32| -> Vec<sql::NewTask> {
        (0..count)
            .map(|_| {
                n += 1;
                new_task(&uuid_n(n), Some("http"), None)
            })
            .collect()
    };
    for round in 0..2 {
        let tasks = batch(1000);
        let started = Instant::now();
        for t in &tasks {
            c.pipeline(&[insert(std::slice::from_ref(t))]).expect("insert");
        }
        let one_by_one = started.elapsed();
        let tasks = batch(1000);
        let stmts: Vec<Stmt> = tasks.iter().map(|t| insert(std::slice::from_ref(t))).collect();
        let started = Instant::now();
        c.pipeline(&stmts).expect("pipeline");
        let pipelined = started.elapsed();
        let tasks = batch(1000);
        let started = Instant::now();
        c.pipeline(&[insert(&tasks)]).expect("array");
        let array = started.elapsed();
        eprintln!(
            "round {round}: 1000 inserts: {one_by_one:?} as 1000 transactions, {pipelined:?} as one pipelined \
             transaction of 1000 statements, {array:?} as one array statement"
        );
    }
}

#[test]
fn pg_sql_waiting_tasks_fail_when_no_live_worker_can_take_them() {
    let Some(pg) = Pg::start("pg_sql_waiting_tasks_fail_when_no_live_worker_can_take_them") else { return };
    let mut c = migrated(&pg);
    heartbeat(&mut c, NODE_A, "a");
    let (w1, w2) = (uuid_n(0x11), uuid_n(0x22));
    let worker = |client: &str, kinds: Option<&str>| {
        format!(
            "insert into relay_workers values ('{client}', '{NODE_A}', '127.0.0.1', 0, {}, 4, 0, true, 'v')",
            kinds.map_or("NULL".to_string(), |k| format!("'{{{k}}}'"))
        )
    };
    c.simple(&worker(&w1, Some("http"))).expect("w1");
    let mut plain = new_task(&uuid_n(1), Some("http"), None);
    plain.queue = false;
    let mut plain_file = new_task(&uuid_n(2), Some("file"), None);
    plain_file.queue = false;
    let queued_file = new_task(&uuid_n(3), Some("file"), None);
    c.pipeline(&[insert(&[plain, plain_file, queued_file, new_task(&uuid_n(4), Some("http"), None)])]).expect("submit");
    // Task 1 (claimed first) fails on w1 and waits as a retry.
    claim_and_start(&mut c, NODE_A, "a", &w1);
    c.pipeline(&[end_as(NODE_A, "a", &[ended(&uuid_n(1), 1, "failed", "pending", &w1)])]).expect("retry");

    let out = c.pipeline(&[sql::fail_unplaceable(6_000, 10_000)]).expect("fail");
    let mut failed: Vec<(String, String)> = out[0]
        .rows
        .iter()
        .map(|r| (r.text(0).unwrap_or("").to_string(), r.text(1).unwrap_or("").to_string()))
        .collect();
    failed.sort();
    assert_eq!(
        failed,
        vec![
            (uuid_n(1), format!("failed on {w1}")),
            (uuid_n(2), "no connected worker can take this task any more".to_string())
        ],
        "the retry nobody untried can take, and the plain file task; the queued one waits"
    );
    // A second worker (any kind) makes the rest placeable.
    c.simple(&worker(&w2, None)).expect("w2");
    let out = c.pipeline(&[sql::fail_unplaceable(6_000, 10_000)]).expect("fail");
    assert!(out[0].rows.is_empty());
    assert_counts_match(&pg);
}

#[test]
fn pg_sql_every_statement_prepares_against_the_schema() {
    let Some(pg) = Pg::start("pg_sql_every_statement_prepares_against_the_schema") else { return };
    let mut c = migrated(&pg);
    for (i, (name, text)) in sql::ALL.iter().enumerate() {
        // (PREPARE takes no utility statement: ANALYZE is parsed, and run, through the extended
        // protocol, as relay runs it.)
        let done = if text.starts_with("ANALYZE") {
            c.pipeline(&[Stmt::new(text, vec![])]).map(drop)
        } else {
            c.simple(&format!("PREPARE s{i} AS {text}")).map(drop)
        };
        done.unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn pg_sql_files_workers_and_token_changes() {
    let Some(pg) = Pg::start("pg_sql_files_workers_and_token_changes") else { return };
    let mut c = migrated(&pg);
    // A file in three chunks, byte for byte through binary parameters and results.
    let file = uuid_n(0xf);
    let bytes: Vec<u8> = (0..600_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut stmts = vec![Stmt::new(
        sql::FILE_BEGIN,
        vec![
            file.as_str().into(),
            "a.bin".into(),
            "application/octet-stream".into(),
            262_144i64.into(),
            1_000i64.into(),
            9_000i64.into(),
        ],
    )];
    for (n, chunk) in bytes.chunks(262_144).enumerate() {
        stmts.push(Stmt::new(
            sql::FILE_CHUNK,
            vec![file.as_str().into(), (n as i64).into(), Param::Bytes(chunk.to_vec())],
        ));
    }
    c.pipeline(&stmts).expect("upload");
    let meta = |c: &mut Conn| {
        c.pipeline(&[Stmt::new(sql::FILE_META, vec![file.as_str().into(), 2_000i64.into()])]).expect("meta")
    };
    assert!(meta(&mut c)[0].rows.is_empty(), "not visible before it is complete");
    let complete = vec![
        file.as_str().into(),
        600_000i64.into(),
        "abc".into(),
        "b.bin".into(),
        "application/x-test".into(),
        9_000i64.into(),
    ];
    c.pipeline(&[Stmt::new(sql::FILE_COMPLETE, complete)]).expect("complete");
    assert_eq!(meta(&mut c)[0].rows[0].i64(2), Some(600_000));
    let mut back = Vec::new();
    for n in 0..3i64 {
        let stmt = Stmt {
            sql: sql::FILE_READ_CHUNK,
            params: vec![file.as_str().into(), n.into()],
            binary_results: true,
            json_columns: &[],
            rows_made: None,
        };
        back.extend_from_slice(c.pipeline(&[stmt]).expect("read")[0].rows[0].bytes(0).expect("chunk"));
    }
    assert!(back == bytes, "the file comes back byte for byte");
    let out = c.pipeline(&[Stmt::new(sql::FILE_EXPIRE, vec![9_000i64.into()])]).expect("expire");
    assert_eq!(out[0].affected, 3, "its chunks go with it");
    assert!(meta(&mut c)[0].rows.is_empty());

    // Workers of live nodes only, with their node's name.
    heartbeat(&mut c, NODE_A, "node-a");
    let upsert = Stmt::new(
        sql::UPSERT_WORKERS,
        vec![
            NODE_A.into(),
            sql::array([Some(uuid_n(1).as_str()), Some(uuid_n(2).as_str())]).into(),
            sql::array([Some("10.0.0.1"), Some("10.0.0.2")]).into(),
            sql::array([Some("5"), Some("6")]).into(),
            sql::array([Some(r#"["http","file"]"#), None]).into(),
            sql::array([Some("16"), None]).into(),
            sql::array([Some("0"), Some("3")]).into(),
            sql::array([Some("t"), Some("f")]).into(),
            sql::array([Some("w/1"), None]).into(),
            sql::array([None, Some("9000")]).into(),
        ],
    );
    c.pipeline(&[upsert]).expect("upsert");
    let out = c.pipeline(&[Stmt::new(sql::LIST_WORKERS, vec![6_000i64.into()])]).expect("list");
    let rows = &out[0].rows;
    assert_eq!(rows.len(), 2);
    assert_eq!((rows[0].text(3), rows[0].text(8)), (Some(r#"["http","file"]"#), Some("node-a")));
    assert_eq!((rows[1].text(3), rows[1].bool(6)), (None, Some(false)), "no kinds: takes every kind");
    assert_eq!((rows[0].i64(10), rows[1].i64(10)), (None, Some(9000)), "a held session's row says until when");
    // Another node's delete of a client id whose row is this node's (a session that resumed
    // here) leaves it; this node's own delete takes it.
    let delete =
        |node: &str| Stmt::new(sql::DELETE_WORKERS, vec![sql::array([Some(uuid_n(2).as_str())]).into(), node.into()]);
    let out = c.pipeline(&[delete(NODE_B)]).expect("delete");
    assert_eq!(out[0].affected, 0, "a row of another node stays");
    let out = c.pipeline(&[delete(NODE_A)]).expect("delete");
    assert_eq!(out[0].affected, 1, "its own node's delete takes it");
    c.simple(&format!("update relay_nodes set heartbeat_ms = heartbeat_ms - 60000 where node_id = '{NODE_A}'"))
        .expect("age");
    let out = c.pipeline(&[Stmt::new(sql::LIST_WORKERS, vec![6_000i64.into()])]).expect("list");
    assert!(out[0].rows.is_empty(), "a dead node's workers are not listed");

    // Token changes: a node's cache refresh sees creates and revokes in order.
    let create = |jti: &str| {
        Stmt::new(
            sql::TOKEN_INSERT,
            vec![jti.into(), "n".into(), sql::array([Some("http")]).into(), 1i64.into(), 9_999_999_999_999i64.into()],
        )
    };
    c.pipeline(&[create("j1"), create("j2")]).expect("tokens");
    let changes = |c: &mut Conn, after: i64| -> Vec<(String, bool, i64)> {
        let out = c.pipeline(&[Stmt::new(sql::TOKEN_CHANGES, vec![after.into()])]).expect("changes");
        out[0]
            .rows
            .iter()
            .map(|r| (r.text(0).unwrap_or("").to_string(), r.bool(1) == Some(true), r.i64(2).unwrap_or(0)))
            .collect()
    };
    let seen = changes(&mut c, 0);
    assert_eq!(seen.iter().map(|s| (s.0.as_str(), s.1)).collect::<Vec<_>>(), vec![("j1", false), ("j2", false)]);
    let high = seen.iter().map(|s| s.2).max().unwrap_or(0);
    assert!(changes(&mut c, high).is_empty());
    c.pipeline(&[Stmt::new(sql::TOKEN_REVOKE, vec!["j1".into(), 5i64.into()])]).expect("revoke");
    assert_eq!(changes(&mut c, high).iter().map(|s| (s.0.as_str(), s.1)).collect::<Vec<_>>(), vec![("j1", true)]);
}

/// CPU time (user + system) of a process, in milliseconds, from /proc.
fn cpu_ms(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks: u64 = fields.get(11..13).map_or(0, |f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum());
    ticks * 10 // USER_HZ = 100
}

/// Figures for docs/cluster.md (not a check; `--ignored --nocapture`): one node's turn
/// transactions, each carrying a batch's submits, the attempt ends of the batch claimed in the
/// turn before, and the claim (which opens the attempts), on a durable server (fsync on). Reports tasks/s,
/// transactions per task and the database backend's CPU per task.
#[test]
#[ignore]
fn pg_bench_turn_transactions() {
    let opts = crate::support::pg::PgOptions { durable: true, ..Default::default() };
    let Some(pg) = Pg::start_with("pg_bench_turn_transactions", opts) else { return };
    let mut c = migrated(&pg);
    c.pipeline(&[Stmt::new(sql::SET_NODE, vec![NODE_A.into()])]).expect("tag");
    heartbeat(&mut c, NODE_A, "a");
    let backend = c.backend_pid() as u32;
    let worker = uuid_n(0xabc);
    let mut next = 0u32;
    for batch in [1usize, 8, 64] {
        let turns = (4000 / batch).max(50);
        let mut claimed: Vec<(String, u32)> = Vec::new();
        let (cpu0, t0) = (cpu_ms(backend), Instant::now());
        let mut done = 0usize;
        for _ in 0..turns {
            let tasks: Vec<sql::NewTask> = (0..batch)
                .map(|_| {
                    next += 1;
                    new_task(&uuid_n(next), Some("http"), None)
                })
                .collect();
            let ends: Vec<sql::Ended> = claimed.iter().map(|(id, a)| ended(id, *a, "done", "done", &worker)).collect();
            done += ends.len();
            let out = c
                .pipeline(&[
                    Stmt::new(sql::INSERT_LOCK, vec![]),
                    insert(&tasks),
                    end_as(NODE_A, "a", &ends),
                    claim(NODE_A, &worker, Some(&["http"]), batch as u32, 10_000),
                ])
                .expect("turn");
            claimed = out[3]
                .rows
                .iter()
                .map(|r| (r.text(0).unwrap_or("").to_string(), r.i64(1).unwrap_or(0) as u32))
                .collect();
        }
        let (secs, cpu) = (t0.elapsed().as_secs_f64(), cpu_ms(backend) - cpu0);
        eprintln!(
            "batch {batch:>2}: {turns} turn transactions, {done} tasks done: {:.0} tasks/s, {:.3} transactions/task, \
             backend CPU {:.0} µs/task",
            done as f64 / secs,
            turns as f64 / done.max(1) as f64,
            cpu as f64 * 1000.0 / done.max(1) as f64
        );
    }
}

#[test]
fn pg_sql_nodes_silent_for_an_hour_are_forgotten_and_their_counts_folded() {
    let Some(pg) = Pg::start("pg_sql_nodes_silent_for_an_hour_are_forgotten_and_their_counts_folded") else { return };
    let mut c = migrated(&pg);
    c.pipeline(&[Stmt::new(sql::SET_NODE, vec![NODE_A.into()])]).expect("tag");
    heartbeat(&mut c, NODE_A, "node-a");
    heartbeat(&mut c, NODE_B, "node-b");
    let tasks: Vec<sql::NewTask> = (1..=3).map(|n| new_task(&uuid_n(n), Some("http"), None)).collect();
    c.pipeline(&[insert(&tasks)]).expect("insert");
    let rows_of = |node: &str| pg.psql(&format!("select count(*) from relay_counters where node_id = '{node}'"));
    assert_eq!(rows_of(NODE_A), "1");
    // A falls silent for two hours, B stays alive.
    c.simple(&format!("update relay_nodes set heartbeat_ms = heartbeat_ms - 7200000 where node_id = '{NODE_A}'"))
        .expect("age");
    c.pipeline(&[Stmt::new(sql::FORGET_NODES, vec![])]).expect("forget");
    assert_eq!(pg.psql("select string_agg(name, ',') from relay_nodes"), "node-b");
    assert_eq!(rows_of(NODE_A), "0", "A's counter rows are folded away");
    assert_counts_match(&pg);
    // Nothing to fold: the sums stay.
    c.pipeline(&[Stmt::new(sql::FORGET_NODES, vec![])]).expect("again");
    assert_counts_match(&pg);
}

/// `relay_kind_pending` (schema version 16): each node's statements count its own rows, a dead
/// node's rows fold into the zero node's, and a kind whose rows add up to 0 loses them (made-up
/// kinds do not pile up) — the sums always those of the pending rows. A sweep racing a trigger
/// neither waits for it nor loses its change, whichever comes first.
#[test]
fn pg_sql_pending_counts_per_kind_fold_sweep_and_race_triggers() {
    let Some(pg) = Pg::start("pg_sql_pending_counts_per_kind_fold_sweep_and_race_triggers") else { return };
    let mut a = migrated(&pg);
    let mut b = connect(&pg.url());
    a.pipeline(&[Stmt::new(sql::SET_NODE, vec![NODE_A.into()])]).expect("tag a");
    b.pipeline(&[Stmt::new(sql::SET_NODE, vec![NODE_B.into()])]).expect("tag b");
    heartbeat(&mut a, NODE_A, "node-a");
    heartbeat(&mut b, NODE_B, "node-b");
    let rows = |kind: &str| {
        pg.psql(&format!(
            "select coalesce(string_agg(node_id::text || '=' || n, ',' order by node_id), '') from relay_kind_pending where kind = '{kind}'"
        ))
    };
    // A submits 3 of `x` and 2 of `y` (and one without kind: not counted here); B claims 2 of `x`.
    let mut tasks: Vec<sql::NewTask> = (1..=3).map(|n| new_task(&uuid_n(n), Some("x"), None)).collect();
    tasks.extend((4..=5).map(|n| new_task(&uuid_n(n), Some("y"), None)));
    tasks.push(new_task(&uuid_n(6), None, None));
    a.pipeline(&[insert(&tasks)]).expect("insert");
    let claimed = b.pipeline(&[claim(NODE_B, &uuid_n(0xb1), Some(&["x"]), 2, 10_000)]).expect("claim");
    assert_eq!(claimed[0].rows.len(), 2);
    assert_eq!(rows("x"), format!("{NODE_A}=3,{NODE_B}=-2"), "each node's net change");
    assert_kind_counts_match(&pg);
    // B drains `y`: its rows add up to 0, and the next sweep removes them; `x` keeps its own.
    let claimed = b.pipeline(&[claim(NODE_B, &uuid_n(0xb1), Some(&["y"]), 5, 10_000)]).expect("claim");
    assert_eq!(claimed[0].rows.len(), 2);
    b.pipeline(&[Stmt::new(sql::FORGET_NODES, vec![])]).expect("sweep");
    assert_eq!(rows("y"), "", "a kind with nothing pending has no rows");
    assert_eq!(rows("x"), format!("{NODE_A}=3,{NODE_B}=-2"));
    assert_kind_counts_match(&pg);
    // A dies: its rows fold into the zero node's; the sums stay.
    a.simple(&format!("update relay_nodes set heartbeat_ms = heartbeat_ms - 7200000 where node_id = '{NODE_A}'"))
        .expect("age");
    b.pipeline(&[Stmt::new(sql::FORGET_NODES, vec![])]).expect("fold");
    let zero = "00000000-0000-0000-0000-000000000000";
    assert_eq!(rows("x"), format!("{zero}=3,{NODE_B}=-2"), "A's rows folded into the zero node's");
    assert_kind_counts_match(&pg);
    b.pipeline(&[Stmt::new(sql::FORGET_NODES, vec![])]).expect("again");
    assert_eq!(rows("x"), format!("{zero}=3,{NODE_B}=-2"), "nothing more to fold or sweep");
    // An update of other columns counts nothing; a hand edit of a pending row's kind moves it.
    b.simple("update relay_pending set ord_ms = ord_ms + 1").expect("update");
    assert_eq!(rows("x"), format!("{zero}=3,{NODE_B}=-2"));
    b.simple("update relay_pending set kind = 'w' where task_id = (select task_id from relay_pending where kind = 'x' limit 1)")
        .expect("rekind");
    assert_eq!(rows("w"), format!("{NODE_B}=1"));
    assert_kind_counts_match(&pg);
    b.simple("update relay_pending set kind = NULL where kind = 'w'").expect("no kind");
    assert_kind_counts_match(&pg);

    // A trigger's upsert in flight (B inserts `z` in a transaction not committed yet, its row of
    // `z` at 0 before): the sweep skips the row — without waiting — and the change is kept.
    b.pipeline(&[insert(&[new_task(&uuid_n(7), Some("z"), None)])]).expect("z");
    b.pipeline(&[claim(NODE_B, &uuid_n(0xb1), Some(&["z"]), 1, 10_000)]).expect("claim z");
    assert_eq!(rows("z"), format!("{NODE_B}=0"));
    b.simple("BEGIN").expect("begin");
    b.pipeline(&[insert(&[new_task(&uuid_n(8), Some("z"), None)])]).expect("z again");
    let mut h = connect(&pg.url());
    h.simple("SET statement_timeout = 5000").expect("timeout");
    let started = Instant::now();
    h.pipeline(&[Stmt::new(sql::FORGET_NODES, vec![])]).expect("the sweep never waits for a trigger's row");
    assert!(started.elapsed() < Duration::from_secs(2), "the sweep waited {:?}", started.elapsed());
    b.simple("COMMIT").expect("commit");
    assert_eq!(rows("z"), format!("{NODE_B}=1"));
    assert_kind_counts_match(&pg);

    // The other way round: the sweep removes `z`'s rows (at 0 again) in a transaction not
    // committed yet while B inserts `z`: B's upsert waits for it, then inserts a new row.
    b.pipeline(&[claim(NODE_B, &uuid_n(0xb1), Some(&["z"]), 1, 10_000)]).expect("claim z");
    h.simple("BEGIN").expect("begin");
    h.pipeline(&[Stmt::new(sql::FORGET_NODES, vec![])]).expect("sweep");
    assert_eq!(
        h.simple("select count(*) from relay_kind_pending where kind = 'z'").expect("seen")[0].rows[0].i64(0),
        Some(0),
        "removed, not committed"
    );
    let url = pg.url();
    let inserter = std::thread::spawn(move || {
        let mut c = connect(&url);
        c.pipeline(&[Stmt::new(sql::SET_NODE, vec![NODE_B.into()])]).expect("tag");
        c.pipeline(&[insert(&[new_task(&uuid_n(9), Some("z"), None)])]).expect("insert z");
    });
    // (The insert is waiting for the sweep's row lock.)
    let waiting = crate::support::poll_until(Duration::from_secs(5), || {
        pg.psql("select count(*) from pg_stat_activity where wait_event_type = 'Lock' and query like '%relay_pending%'")
            != "0"
    });
    assert!(waiting, "the insert waits for the sweep");
    h.simple("COMMIT").expect("commit");
    inserter.join().expect("inserter");
    assert_eq!(rows("z"), format!("{NODE_B}=1"));
    assert_kind_counts_match(&pg);
}

/// Pending rows (number, kind) written as the schema of version 15 has them.
fn older_pending(c: &mut Conn, rows: &[(u32, Option<&str>)]) {
    for (n, kind) in rows {
        let kind = kind.map_or("NULL".to_string(), |k| format!("'{k}'"));
        c.simple(&format!(
            "INSERT INTO relay_pending (task_id, due_ms, ord_ms, seq, kind, queue, payload_bytes)
             VALUES ('{}', 0, 0, {n}, {kind}, true, 2)",
            uuid_n(*n)
        ))
        .expect("older pending row");
    }
}

/// Schema version 16 fills `relay_kind_pending` from the pending rows a database of the version
/// before already holds.
#[test]
fn pg_schema_pending_counts_per_kind_are_filled_from_an_older_schema() {
    let Some(pg) = Pg::start("pg_schema_pending_counts_per_kind_are_filled_from_an_older_schema") else { return };
    let at = schema::MIGRATIONS
        .iter()
        .position(|m| m.1 == "pending tasks counted per kind by triggers")
        .expect("the migration");
    let mut c = connect(&pg.url());
    schema::migrate_to(&mut c, &schema::MIGRATIONS[..at]).expect("older schema");
    // (Rows as that schema has them: today's statements need columns added later.)
    older_pending(&mut c, &[(1, Some("a")), (2, Some("a")), (3, Some("a")), (5, Some("b")), (6, Some("b")), (7, None)]);
    assert_eq!(pg.psql("select to_regclass('relay_kind_pending') is null"), "t", "not there before");
    let done = schema::migrate(&mut c).expect("migrate");
    assert_eq!(done.from, schema::MIGRATIONS[at - 1].0);
    assert_eq!(pg.psql("select string_agg(kind || '=' || n, ',' order by kind) from relay_kind_pending"), "a=3,b=2");
    assert_kind_counts_match(&pg);
    // And the triggers count from there.
    c.pipeline(&[claim(NODE_A, &uuid_n(0xa1), Some(&["b"]), 1, 10_000)]).expect("claim");
    c.pipeline(&[insert(&[new_task(&uuid_n(8), Some("c"), None)])]).expect("insert");
    assert_kind_counts_match(&pg);
    assert_eq!(
        pg.psql("select string_agg(kind || '=' || n, ',' order by kind) from relay_kind_pending"),
        "a=3,b=1,c=1"
    );
}

/// Schema version 17 marks the pending rows of kinds a policy holds back (paused or limited)
/// `held`, from the policies of the version before, and leaves the others out of nothing.
#[test]
fn pg_schema_a_held_kinds_pending_rows_are_marked_from_an_older_schema() {
    let Some(pg) = Pg::start("pg_schema_a_held_kinds_pending_rows_are_marked_from_an_older_schema") else { return };
    let at = schema::MIGRATIONS
        .iter()
        .position(|m| m.1 == "a held kind's pending tasks are out of the index a claim of every kind walks")
        .expect("the migration");
    let mut c = connect(&pg.url());
    schema::migrate_to(&mut c, &schema::MIGRATIONS[..at]).expect("older schema");
    older_pending(&mut c, &[(1, Some("p")), (2, Some("r")), (3, Some("free")), (4, Some("gone")), (5, None)]);
    c.simple(
        r#"INSERT INTO relay_kind_policies (kind, policy) VALUES ('p', '{"paused":true}'),
               ('r', '{"rate":"10/s","burst":3}'), ('free', '{"burst":3}'), ('gone', NULL)"#,
    )
    .expect("older policies");
    schema::migrate(&mut c).expect("migrate");
    assert_eq!(
        pg.psql("select string_agg(kind || '=' || holds, ',' order by kind) from relay_kind_policies"),
        "free=false,gone=false,p=true,r=true"
    );
    assert_eq!(
        pg.psql("select string_agg(coalesce(kind, '-') || '=' || held, ',' order by kind) from relay_pending"),
        "free=false,gone=false,p=true,r=true,-=false"
    );
}

/// SPEC §12 in SQL: a lost node's attempt of a session worker is not adopted while the worker
/// may still resume it (RESUME_WINDOW after the node's last heartbeat); `TAKE_SESSION` with the
/// right secret and worker id moves it to the resuming node, a wrong one finds nothing; once
/// the window is over the reaper adopts what is left.
#[test]
fn pg_sql_a_session_attempt_waits_for_its_worker_and_moves_with_it() {
    let Some(pg) = Pg::start("pg_sql_a_session_attempt_waits_for_its_worker_and_moves_with_it") else { return };
    let mut c = migrated(&pg);
    let (one, two) = (uuid_n(1), uuid_n(2));
    c.pipeline(&[insert(&[new_task(&one, Some("http"), None), new_task(&two, Some("http"), None)])]).expect("submit");
    heartbeat(&mut c, NODE_A, "node-a");
    heartbeat(&mut c, NODE_B, "node-b");
    let wa = uuid_n(0xa1);
    let mut started = Vec::new();
    for _ in 0..2 {
        started.push(claim_and_start(&mut c, NODE_A, "node-a", &wa));
    }
    let rows: Vec<sql::SessionAttempt> = started
        .iter()
        .map(|(id, attempt)| sql::SessionAttempt {
            id: id.clone(),
            attempt: *attempt,
            secret: "s3cret".into(),
            worker_id: "w-1".into(),
            client_id: wa.clone(),
            started_ms: 5_000,
        })
        .collect();
    c.pipeline(&[sql::session_attempts(NODE_A, &rows)]).expect("name the session");
    // A silent for 8 s: past its 6 s lease, within a 10 s window.
    c.simple(&format!("update relay_nodes set heartbeat_ms = heartbeat_ms - 8000 where node_id = '{NODE_A}'"))
        .expect("age A");
    c.simple("update relay_running set started_ms = relay_now_ms() - 1000").expect("started a second ago");
    let adopt = Stmt::new(sql::ADOPT_ORPHANS, vec![NODE_B.into(), 6_000i64.into(), 10_000i64.into(), 30_000i64.into()]);
    assert!(c.pipeline(std::slice::from_ref(&adopt)).expect("adopt")[0].rows.is_empty(), "held for the worker");
    // A held attempt's TASK_TIMEOUT keeps running (SPEC §12): once it is over, the window does not
    // hold it any more.
    c.simple(&format!("update relay_running set started_ms = relay_now_ms() - 31000 where task_id = '{one}'"))
        .expect("started long ago");
    let out = c.pipeline(std::slice::from_ref(&adopt)).expect("adopt");
    assert_eq!(out[0].rows.len(), 1, "its timeout is over");
    assert_eq!(out[0].rows[0].text(0), Some(one.as_str()));
    let take =
        |secret: &str| Stmt::new(sql::TAKE_SESSION, vec![NODE_B.into(), secret.into(), "w-1".into(), 10_000i64.into()]);
    assert!(c.pipeline(&[take("wrong")]).expect("take")[0].rows.is_empty(), "a wrong secret takes nothing");
    let out = c.pipeline(&[take("s3cret")]).expect("take");
    assert_eq!(out[0].rows.len(), 1, "the one still held moves");
    let row = &out[0].rows[0];
    assert_eq!((row.text(8), row.text(14)), (Some("node-a"), Some(wa.as_str())), "the node it came from, the worker");
    let owners = c.simple("select owner_node::text from relay_tasks order by id").expect("owners");
    assert!(owners[0].rows.iter().all(|r| r.text(0) == Some(NODE_B)), "the tasks are B's now");
    assert_eq!(row.text(0), Some(two.as_str()));
    // Past the window: what a node still holds of a lost node's sessions is adopted.
    c.simple(&format!("update relay_running set owner_node = '{NODE_A}' where task_id = '{two}'")).expect("back");
    c.simple(&format!("update relay_tasks set owner_node = '{NODE_A}' where id = '{two}'")).expect("back");
    c.simple(&format!("update relay_nodes set heartbeat_ms = heartbeat_ms - 5000 where node_id = '{NODE_A}'"))
        .expect("age A more");
    let out = c.pipeline(&[adopt]).expect("adopt");
    assert_eq!(out[0].rows.len(), 1, "adopted once the window is over");
    assert_eq!(out[0].rows[0].text(0), Some(two.as_str()));
}

/// A transaction a node gave up on (no answer within its I/O timeout: here, blocked on the lock
/// every insert takes) must not commit later behind its back: the node ends the lost
/// connection's server process before it works again. Before, the submit answered 503 was
/// stored (and claimed for a worker it was never sent to) once the lock came free.
#[test]
fn a_transaction_the_node_gave_up_on_never_commits_later() {
    let name = "a_transaction_the_node_gave_up_on_never_commits_later";
    let pg = match crate::support::pg::shared() {
        Ok(pg) => pg,
        Err(why) => {
            assert!(!crate::support::pg::required(), "PostgreSQL is required: {why}");
            crate::support::skip_or_fail(name, &why);
            return;
        }
    };
    let db = std::sync::Arc::new(crate::support::pg::TestDb::create(pg));
    let node = crate::support::Mode::start_on(db.clone(), &[]);
    let params = relay::pg::url::parse(&db.url()).expect("url");
    let mut lock = relay::pg::wire::Conn::connect(&params, relay::pg::wire::Timeouts::default()).expect("connect");
    let insert_lock = relay::pg::sql::INSERT_LOCK.replace("pg_advisory_xact_lock", "pg_advisory_lock");
    lock.simple(&insert_lock).expect("take the insert lock");
    let r = node.submit(r#"{"payload":{"kind":"k"},"queue":true}"#);
    assert_eq!(r.status, 503, "the database did not answer in time: {}", r.text());
    // Every connection that waits for the lock now is one the node lost (or soon will, its
    // I/O timeout later): each must be ended before the lock comes free.
    let now = db.query("SELECT now()::text");
    let since = now.first().expect("now");
    let waiting = format!(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE l.locktype = 'advisory' AND NOT l.granted AND a.backend_start < '{since}'::timestamptz"
    );
    let gone = crate::support::poll_until(Duration::from_secs(20), || db.query(&waiting) == ["0"]);
    lock.simple("SELECT pg_advisory_unlock_all()").expect("unlock");
    // Taken again: whatever still waited for it has run by then.
    lock.simple(&insert_lock).expect("take the insert lock again");
    let stored = db.query("SELECT count(*) FROM relay_tasks");
    lock.simple("SELECT pg_advisory_unlock_all()").expect("unlock");
    lock.close();
    assert!(gone, "the lost connections' server processes were ended");
    assert_eq!(stored, ["0"], "a submit answered 503 stored nothing");
}

/// The once-a-second sweep of idle fairness lanes runs under the lock every insert takes: when
/// it is slow (here: blocked on a row another session holds; in a probe, a plan made on stale
/// statistics that ran 43 minutes) it gives up within a second instead of holding every node's
/// submits.
#[test]
fn a_slow_lane_sweep_never_holds_submits_for_long() {
    let name = "a_slow_lane_sweep_never_holds_submits_for_long";
    let pg = match crate::support::pg::shared() {
        Ok(pg) => pg,
        Err(why) => {
            assert!(!crate::support::pg::required(), "PostgreSQL is required: {why}");
            crate::support::skip_or_fail(name, &why);
            return;
        }
    };
    let db = std::sync::Arc::new(crate::support::pg::TestDb::create(pg));
    let node = crate::support::Mode::start_on(db.clone(), &[]);
    let r = node.submit(r#"{"payload":{"kind":"k"},"queue":true,"key":"a"}"#);
    assert_eq!(r.status, 202, "{}", r.text());
    let id = r.json()["task_id"].as_str().expect("task_id").to_string();
    // Another session holds the lane's submitter row; then the lane runs dry: the sweep
    // removes the lane and waits for that row, under the insert lock.
    let params = relay::pg::url::parse(&db.url()).expect("url");
    let mut other = relay::pg::wire::Conn::connect(&params, relay::pg::wire::Timeouts::default()).expect("connect");
    other.simple("BEGIN; SELECT * FROM relay_fair_submitters FOR UPDATE").expect("lock the submitter rows");
    assert_eq!(node.api("DELETE", &format!("/tasks/{id}"), None).status, 200);
    let blocked = crate::support::poll_until(Duration::from_secs(10), || {
        db.query("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'WITH gone AS%'")
            != ["0"]
    });
    assert!(blocked, "the sweep waits for the row");
    let t = Instant::now();
    let r = node.submit(r#"{"payload":{"kind":"z"},"queue":true}"#);
    let took = t.elapsed();
    other.simple("ROLLBACK").expect("rollback");
    other.close();
    assert_eq!(r.status, 202, "{}", r.text());
    assert!(took < Duration::from_secs(3), "a submit waited {took:?} behind the sweep");
}

/// `KIND_LOCKS` locks only the limited kinds with a task due: a node with thousands of idle
/// limited kinds took one advisory lock for each in every claim (10,000 policies: every request
/// 503, the lock table full; 1,000: a sync task of another kind 65 ms instead of 5), and claimed
/// each. A kind with only a task not due yet, or none, is neither locked nor claimed.
#[test]
fn pg_sql_only_limited_kinds_with_a_task_due_are_locked() {
    let Some(pg) = Pg::start("pg_sql_only_limited_kinds_with_a_task_due_are_locked") else { return };
    let mut c = migrated(&pg);
    let later = sql::NewTask { run_at_ms: 100_000, ..new_task(&uuid_n(2), Some("later"), None) };
    c.pipeline(&[insert(&[new_task(&uuid_n(1), Some("busy"), None), later])]).expect("submit");
    c.simple("BEGIN").expect("begin");
    let kinds = Param::Text(r#"{"busy","later","idle"}"#.into());
    let out = c
        .pipeline(&[
            Stmt::new(sql::KIND_LOCKS, vec![kinds, 5_000i64.into()]),
            Stmt::new(
                "SELECT current_setting('relay.kinds_locked'), (SELECT count(*) FROM pg_locks
                   WHERE locktype = 'advisory' AND pid = pg_backend_pid())",
                vec![],
            ),
        ])
        .expect("lock");
    c.simple("COMMIT").expect("commit");
    assert_eq!(out[1].rows[0].text(0), Some(r#"["busy"]"#), "the kinds locked");
    assert_eq!(out[1].rows[0].i64(1), Some(1), "one advisory lock: the due kind's");
}

/// Rows of `relay_pending` the scans of a statement's plan read, and the rows it locked
/// (`EXPLAIN (ANALYZE, FORMAT JSON)`: each scan node's actual rows times its loops, and the rows
/// its filter removed; each `LockRows` node's rows times its loops).
fn pending_rows_read(c: &mut Conn, stmt: Stmt) -> (u64, u64) {
    fn walk(plan: &serde_json::Value) -> (u64, u64) {
        let n = |k: &str| plan[k].as_f64().unwrap_or(0.0);
        let loops = n("Actual Loops").max(1.0);
        let read = if plan["Relation Name"] == "relay_pending" {
            ((n("Actual Rows") + n("Rows Removed by Filter")) * loops) as u64
        } else {
            0
        };
        let locked = if plan["Node Type"] == "LockRows" { (n("Actual Rows") * loops) as u64 } else { 0 };
        let below = plan["Plans"]
            .as_array()
            .map_or((0, 0), |ps| ps.iter().map(walk).fold((0, 0), |(r, l), (r2, l2)| (r + r2, l + l2)));
        (read + below.0, locked + below.1)
    }
    let sql: &'static str = Box::leak(format!("EXPLAIN (ANALYZE, FORMAT JSON) {}", stmt.sql).into_boxed_str());
    let out = c.pipeline(&[Stmt::new(sql, stmt.params)]).expect("explain");
    let text = out[0].rows.first().and_then(|r| r.text(0)).expect("a plan").to_string();
    let plan: serde_json::Value = serde_json::from_str(&text).expect("plan JSON");
    if std::env::var_os("SHOW_PLAN").is_some() {
        eprintln!("{text}");
    }
    walk(&plan[0]["Plan"])
}

/// Dispatch never scans the queue (issue 22): a claim reads about a claim's worth of pending
/// rows, whatever waits behind them — a worker's declared kinds each read in order on their
/// index (`kind = ANY(...)` read every due row of them and sorted them), and a claim of every
/// kind walks none of a paused kind's backlog (it stepped over all of it) — and locks only what
/// it takes (locking each declared kind's first rows locked kinds × the claim).
#[test]
fn pg_sql_a_claim_reads_a_claims_worth_of_the_queue() {
    let Some(pg) = Pg::start("pg_sql_a_claim_reads_a_claims_worth_of_the_queue") else { return };
    let mut c = migrated(&pg);
    c.simple(r#"INSERT INTO relay_kind_policies (kind, policy, holds) VALUES ('p', '{"paused":true}', true)"#)
        .expect("a paused kind");
    // The paused kind's backlog first in the queue, then two kinds, then eight small ones, then a
    // few without a kind.
    let mut n = 0;
    let mut queue = vec![(Some("p"), 3000), (Some("a"), 2000), (Some("b"), 2000)];
    let small = ["c", "d", "e", "f", "g", "h", "i", "j"];
    queue.extend(small.iter().map(|k| (Some(*k), 100)));
    queue.push((None, 20));
    for (kind, count) in queue {
        for chunk in (0..count).collect::<Vec<_>>().chunks(500) {
            let tasks: Vec<sql::NewTask> = chunk
                .iter()
                .map(|_| {
                    n += 1;
                    new_task(&uuid_n(n), kind, None)
                })
                .collect();
            c.pipeline(&[insert(&tasks)]).expect("insert");
        }
    }
    c.simple("ANALYZE relay_pending").expect("analyze");
    let held = |c: &mut Conn| c.simple("SELECT count(*) FROM relay_pending WHERE held").expect("count");
    assert_eq!(held(&mut c)[0].rows[0].i64(0), Some(3000), "the paused kind's rows are held as they come");
    let takers = format!("{{{}}}", uuid_n(0xa1));
    let mut ten = vec!["a", "b"];
    ten.extend(small);
    c.simple("BEGIN").expect("begin");
    let (kinds, _) = pending_rows_read(&mut c, sql::claim(NODE_A, 1, Some(&["a", "b"]), 10_000, 16, &takers));
    let (every, _) = pending_rows_read(&mut c, sql::claim(NODE_A, 1, None, 10_000, 16, &takers));
    let (_, locked) = pending_rows_read(&mut c, sql::claim(NODE_A, 1, Some(&ten), 10_000, 16, &takers));
    c.simple("ROLLBACK").expect("rollback");
    // (A few times the claim's 16 — each kind's first 16 read, the ones taken locked, then
    // looked up by key to delete — against the thousands behind them.)
    assert!(kinds <= 6 * 16, "a claim of two declared kinds read {kinds} pending rows");
    assert!(every <= 6 * 16, "a claim of every kind read {every} pending rows");
    assert!(locked <= 16, "a claim of 16 over ten declared kinds locked {locked} rows");
}

/// A resumed kind's rows are freed in queue order, a step at a time (`REHOLD`): until its
/// older rows are free, a claim of every kind does not take a task of the kind queued after
/// them — the kind resumes in order (SPEC §14) however many tasks its claims take at once.
#[test]
fn pg_sql_a_claim_takes_no_task_of_a_kind_from_behind_its_rows_still_held() {
    let Some(pg) = Pg::start("pg_sql_a_claim_takes_no_task_of_a_kind_from_behind_its_rows_still_held") else { return };
    let mut c = migrated(&pg);
    c.simple(r#"INSERT INTO relay_kind_policies (kind, policy, holds) VALUES ('r', '{"paused":true}', true)"#)
        .expect("a paused kind");
    let old: Vec<sql::NewTask> = (1..=5).map(|n| new_task(&uuid_n(n), Some("r"), None)).collect();
    c.pipeline(&[insert(&old)]).expect("insert");
    // Resumed: the policy row says so, the rows are not in line yet; a task comes after it.
    c.simple(r#"UPDATE relay_kind_policies SET policy = '{}', holds = false WHERE kind = 'r'"#).expect("resume");
    c.pipeline(&[insert(&[new_task(&uuid_n(6), Some("r"), None), new_task(&uuid_n(7), Some("o"), None)])])
        .expect("insert");
    let takers = format!("{{{}}}", uuid_n(0xa1));
    let out = c.pipeline(&[sql::claim(NODE_A, 1, None, 10_000, 16, &takers)]).expect("claim");
    let ids: Vec<&str> = out[0].rows.iter().filter_map(|r| r.text(0)).collect();
    assert_eq!(ids, [uuid_n(7)], "only the other kind's task: the resumed kind's older rows are still held");
    // Freed, they come first, in order.
    c.pipeline(&[Stmt::new(sql::REHOLD, vec!["r".into(), i64::MIN.into(), i64::MIN.into(), sql::REHOLD_ROWS.into()])])
        .expect("rehold");
    let out = c.pipeline(&[sql::claim(NODE_A, 1, None, 10_000, 16, &takers)]).expect("claim");
    let ids: Vec<String> = out[0].rows.iter().filter_map(|r| r.text(0)).map(str::to_string).collect();
    assert_eq!(ids, (1..=6).map(uuid_n).collect::<Vec<_>>(), "in queue order once freed");
}

/// `GET /kinds` lists the kinds in byte order in cluster mode too, as one node does, whatever
/// the database's collation (here ICU's English one, which sorts "a", "ab", "B", "é", "Zeta").
#[test]
fn pg_sql_kinds_are_listed_in_byte_order_whatever_the_collation() {
    let Some(pg) = Pg::start("pg_sql_kinds_are_listed_in_byte_order_whatever_the_collation") else { return };
    let mut admin = connect(&pg.url());
    admin
        .simple("CREATE DATABASE icu_kinds LOCALE_PROVIDER icu ICU_LOCALE 'en-US' TEMPLATE template0")
        .expect("a database with ICU's English collation");
    admin.close();
    let url = pg.url().replace("/postgres?", "/icu_kinds?");
    let mut c = connect(&url);
    schema::migrate(&mut c).expect("migrate");
    c.simple(
        r#"INSERT INTO relay_kind_policies (kind, policy, holds) VALUES
           ('Zeta', '{}', false), ('é', '{}', false), ('ab', '{}', false), ('B', '{}', false), ('a', '{}', false)"#,
    )
    .expect("policies");
    let out = c.pipeline(&[Stmt::new(sql::KINDS, vec![Param::Null])]).expect("kinds");
    let kinds: Vec<&str> = out[0].rows.iter().filter_map(|r| r.text(0)).collect();
    assert_eq!(kinds, ["B", "Zeta", "a", "ab", "é"]);
    c.close();
}
