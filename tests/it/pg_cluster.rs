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
