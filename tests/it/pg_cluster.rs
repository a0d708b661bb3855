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
    let opts = crate::support::pg::PgOptions { durable: true };
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
// The wire client (src/cluster/wire.rs).

use relay::cluster::url::parse as parse_url;
use relay::cluster::wire::{Conn, Param, PgError, Stmt, Timeouts};

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
            Stmt { sql: "select b from t where n = $1::int", params: vec![Param::from(1i64)], binary_results: true },
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
