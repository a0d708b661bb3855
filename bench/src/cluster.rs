//! The cluster scenario (issue 11): the same closed-loop load (`POST /tasks?wait=true`, C clients,
//! W workers) on one node with its journal, one node on PostgreSQL, and two nodes on one
//! PostgreSQL (clients and workers split between them), in the same run. Figures: tasks/s, relay
//! CPU per task (every node), PostgreSQL CPU per task (the postmaster and its backends), turn
//! transactions and all transactions per task (relay's own counters: PostgreSQL's statistics lag
//! by up to seconds), statements per transaction, p50/p99.
//!
//! PostgreSQL is a private server per setup: Debian's binaries (`/usr/lib/postgresql/*/bin` or
//! `PG_BIN`), `initdb` into a scratch directory, a unix socket only, `fsync` and
//! `synchronous_commit` on (the journal syncs too), stopped by PID. Without PostgreSQL the two
//! database setups are skipped loudly.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::httpc::{HttpConn, build_request};
use crate::load::{self, Outcome, Window};
use crate::procs::{self, Server};
use crate::scenarios::{API_TOKEN, Keep, PipeClient, WORKER_CONCURRENCY, WORKER_TOKEN, payload, start_relay};
use crate::workers::Pool;
use crate::{Opts, RESULT_DATA};

const IO_TIMEOUT: Duration = Duration::from_secs(10);
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// One setup's figures over one measured window.
pub struct Row {
    pub setup: &'static str,
    pub out: Outcome,
    /// CPU of every relay node over the window.
    pub relay_cpu: Duration,
    /// CPU of PostgreSQL (postmaster and backends) over the window.
    pub pg_cpu: Option<Duration>,
    /// Turn transactions the nodes committed, and those their database threads ran besides.
    pub turn_txns: u64,
    pub other_txns: u64,
    pub statements: u64,
    /// The journal's group commits (one fdatasync each), for the single-node row.
    pub syncs: u64,
}

impl Row {
    fn per_task(&self, d: Duration) -> f64 {
        d.as_secs_f64() * 1e6 / self.out.completed.max(1) as f64
    }
    fn txn_per_task(&self) -> f64 {
        self.turn_txns as f64 / self.out.completed.max(1) as f64
    }
    fn all_txn_per_task(&self) -> f64 {
        (self.turn_txns + self.other_txns) as f64 / self.out.completed.max(1) as f64
    }
}

pub const SETUPS: [&str; 3] = ["1 node, journal", "1 node, PostgreSQL", "2 nodes, PostgreSQL"];

/// One round: the three setups, one after the other.
pub fn round(opts: &Opts, step: &dyn Fn(&str), failures: &mut Vec<String>) -> Vec<Row> {
    let mut rows = Vec::new();
    for (i, setup) in SETUPS.iter().enumerate() {
        step(&format!("cluster: {setup}, {} clients, {} workers", opts.clients, opts.workers));
        let result = match i {
            0 => journal(opts),
            n => pg_nodes(opts, n),
        };
        match result {
            Ok(row) => rows.push(Row { setup, ..row }),
            Err(e) => {
                eprintln!("bench: cluster ({setup}) failed: {e}");
                failures.push(format!("cluster ({setup}): {e}"));
            }
        }
    }
    rows
}

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("relay-bench-{}-{name}-{}", std::process::id(), unique()))
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn journal(opts: &Opts) -> Result<Row, String> {
    let dir = scratch("journal");
    let result = (|| {
        let relay = start_relay(opts, &opts.relay, &[("DATA_DIR", dir.display().to_string())])?;
        measure(opts, &[relay], None)
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn pg_nodes(opts: &Opts, n: usize) -> Result<Row, String> {
    let pg = Postgres::start()?;
    let url = pg.url();
    let mut nodes = Vec::new();
    for _ in 0..n {
        nodes.push(start_relay(opts, &opts.relay, &[("DATABASE_URL", url.clone())])?);
    }
    for node in &nodes {
        wait_health(node.addr)?;
    }
    let row = measure(opts, &nodes, Some(&pg));
    drop(nodes); // (the nodes end their sessions before PostgreSQL stops)
    row
}

/// Runs the load against `nodes` (clients and workers spread over them) and takes the figures.
fn measure(opts: &Opts, nodes: &[Server], pg: Option<&Postgres>) -> Result<Row, String> {
    let mut pools = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let w = opts.workers / nodes.len() + usize::from(i < opts.workers % nodes.len());
        pools.push(Pool::ws(node.addr, WORKER_TOKEN, w, WORKER_CONCURRENCY, RESULT_DATA)?);
        wait_active(node.addr, w)?;
    }
    let body = format!("{{\"payload\":{}}}", payload(opts.payload_bytes));
    let req = Arc::new(vec![build_request("POST", "/tasks?wait=true", Some(API_TOKEN), body.as_bytes())]);
    // The warm-up is a run of its own (a client is spent once its run ends), so the counters
    // can be read right where the measured window starts and ends.
    let clients = || -> Vec<PipeClient> {
        (0..opts.clients)
            .map(|i| PipeClient::new(nodes[i % nodes.len()].addr, 1, req.clone(), 200, Keep::Nothing))
            .collect()
    };
    let pid = nodes[0].pid();
    let warm = Window { warmup: Duration::ZERO, measure: opts.warmup, syscalls: None };
    let _ = load::run(clients(), pid, warm, &[]);
    let before = Snapshot::take(nodes, pg)?;
    let win = Window { warmup: Duration::ZERO, measure: opts.measure, syscalls: None };
    let (out, _) = load::run(clients(), pid, win, &[]);
    let after = Snapshot::take(nodes, pg)?;
    for p in pools {
        p.stop()?;
    }
    Ok(Row {
        setup: "",
        relay_cpu: after.relay_cpu.saturating_sub(before.relay_cpu),
        pg_cpu: after.pg_cpu.zip(before.pg_cpu).map(|(a, b)| a.saturating_sub(b)),
        turn_txns: after.turn_txns - before.turn_txns,
        other_txns: after.other_txns - before.other_txns,
        statements: after.statements - before.statements,
        syncs: after.syncs - before.syncs,
        out,
    })
}

/// Counters read before and after the measured window.
struct Snapshot {
    relay_cpu: Duration,
    pg_cpu: Option<Duration>,
    turn_txns: u64,
    other_txns: u64,
    statements: u64,
    syncs: u64,
}

impl Snapshot {
    fn take(nodes: &[Server], pg: Option<&Postgres>) -> Result<Snapshot, String> {
        let mut s = Snapshot {
            relay_cpu: Duration::ZERO,
            pg_cpu: pg.map(Postgres::cpu),
            turn_txns: 0,
            other_txns: 0,
            statements: 0,
            syncs: 0,
        };
        for node in nodes {
            s.relay_cpu += procs::cpu_time(node.pid())?;
            let m = metrics(node.addr)?;
            s.turn_txns += series(&m, "relay_db_transactions_total{result=\"committed\"}");
            s.other_txns += series(&m, "relay_db_background_transactions_total");
            s.statements += series(&m, "relay_db_statements_total");
            s.syncs += series(&m, "relay_journal_syncs_total");
        }
        Ok(s)
    }
}

fn metrics(addr: SocketAddr) -> Result<String, String> {
    let mut conn = HttpConn::connect(addr, IO_TIMEOUT)?;
    let resp = conn.request(&build_request("GET", "/metrics", None, b""))?;
    Ok(String::from_utf8_lossy(resp.body).into_owned())
}

/// The value of one series of a Prometheus text (0 when absent: the journal row has no
/// database series, the database rows no journal series).
fn series(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

fn get_json(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let mut conn = HttpConn::connect(addr, IO_TIMEOUT)?;
    let resp = conn.request(&build_request("GET", path, None, b""))?;
    Ok((resp.status, String::from_utf8_lossy(resp.body).into_owned()))
}

/// Until the node reached the database (`/healthz` 200).
pub(crate) fn wait_health(addr: SocketAddr) -> Result<(), String> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let (status, body) = get_json(addr, "/healthz")?;
        if status == 200 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("node {addr} never reached the database: {body}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Until the node has `n` active workers of its own.
pub(crate) fn wait_active(addr: SocketAddr, n: usize) -> Result<(), String> {
    let want = format!("\"active_clients\":{n},");
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let (_, body) = get_json(addr, "/healthz")?;
        if body.contains(&want) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("node {addr}: {n} workers never became active: {body}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------- PostgreSQL

/// Where the server binaries are: `PG_BIN`, or the newest `/usr/lib/postgresql/*/bin`.
fn pg_bin() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("PG_BIN") {
        return Some(PathBuf::from(dir));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, b)| b)
}

/// Whether the database setups can run here (and why not).
pub fn available() -> Result<(), String> {
    pg_bin().map(|_| ()).ok_or_else(|| "no PostgreSQL server binaries (apt-get install postgresql)".into())
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// `program`, as the `postgres` user when we are root (PostgreSQL refuses to run as root);
/// `setpriv` execs, so the PID is the program's own.
fn as_pg(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=postgres", "--regid=postgres", "--init-groups", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// A private PostgreSQL server, stopped by PID and removed when dropped.
pub(crate) struct Postgres {
    dir: PathBuf,
    port: u16,
    server: Option<Server>,
}

impl Postgres {
    pub(crate) fn start() -> Result<Postgres, String> {
        let bin = pg_bin().ok_or("no PostgreSQL server binaries")?;
        let dir = scratch("pg");
        std::fs::create_dir_all(dir.join("sock")).map_err(|e| format!("{}: {e}", dir.display()))?;
        if is_root() {
            let ok =
                Command::new("chown").args(["-R", "postgres:postgres"]).arg(&dir).status().is_ok_and(|s| s.success());
            if !ok {
                return Err("chown of the PostgreSQL directory failed".into());
            }
        }
        let data = dir.join("data");
        let out = as_pg(&bin.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C", "--no-sync", "-D"])
            .arg(&data)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("initdb: {e}"))?;
        if !out.status.success() {
            return Err(format!("initdb: {}", String::from_utf8_lossy(&out.stderr)));
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| e.to_string())?;
        let mut cmd = as_pg(&bin.join("postgres"));
        cmd.arg("-D").arg(&data).arg("-k").arg(dir.join("sock")).arg("-p").arg(port.to_string());
        for setting in [
            "listen_addresses=",
            "fsync=on",
            "synchronous_commit=on",
            "shared_buffers=128MB",
            "max_connections=50",
            "wal_level=minimal",
            "max_wal_senders=0",
            "logging_collector=off",
            "log_min_messages=log",
            // What docs/operating.md ("Cluster mode") asks of a production server: the queue table churns, and
            // the statistics of fresh tables must catch up within seconds (cached plans follow).
            "autovacuum_naptime=1s",
        ] {
            cmd.arg("-c").arg(setting);
        }
        let server = Server::start("postgres", cmd, pg_listening, READY_TIMEOUT)?;
        Ok(Postgres { dir, port, server: Some(server) })
    }

    pub(crate) fn url(&self) -> String {
        format!("postgres://postgres@/postgres?host={}&port={}", self.dir.join("sock").display(), self.port)
    }

    /// CPU of the postmaster and every process it started (backends, background workers).
    fn cpu(&self) -> Duration {
        let Some(pid) = self.server.as_ref().map(Server::pid) else { return Duration::ZERO };
        let mut total = procs::cpu_time(pid).unwrap_or_default();
        if let Ok(entries) = std::fs::read_dir("/proc") {
            for e in entries.filter_map(Result::ok) {
                let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
                if parent(child) == Some(pid) {
                    total += procs::cpu_time(child).unwrap_or_default();
                }
            }
        }
        total
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if let Some(mut s) = self.server.take() {
            s.stop();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.split_whitespace().nth(1)?.parse().ok()
}

/// PostgreSQL's `listening on Unix socket ".../.s.PGSQL.<port>"` (the address is a stand-in:
/// clients use the socket).
fn pg_listening(line: &str) -> Option<SocketAddr> {
    let (_, rest) = line.split_once("listening on Unix socket")?;
    let port: u16 = rest.trim().trim_matches('"').rsplit('.').next()?.trim_matches('"').parse().ok()?;
    Some(SocketAddr::from(([127, 0, 0, 1], port)))
}

// ---------------------------------------------------------------- report

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The table, medians over the rounds (and the spread of tasks/s).
pub fn report(rounds: &[Vec<Row>], opts: &Opts) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\ncluster (issue 11): POST /tasks?wait=true, {} clients, {} workers, {}-byte payloads; medians of {} round(s)\n",
        opts.clients,
        opts.workers,
        opts.payload_bytes,
        rounds.len()
    );
    let _ = writeln!(
        out,
        "| setup | tasks/s (min–max) | relay CPU µs/task | PostgreSQL CPU µs/task | turn txn/task | all txn/task | statements/txn | p50 | p99 |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for setup in SETUPS {
        let rows: Vec<&Row> = rounds.iter().flatten().filter(|r| r.setup == setup).collect();
        if rows.is_empty() {
            let _ = writeln!(out, "| {setup} | (failed or skipped) | | | | | | | |");
            continue;
        }
        let m = |f: &dyn Fn(&Row) -> f64| median(rows.iter().map(|r| f(r)).collect());
        let rates: Vec<f64> = rows.iter().map(|r| r.out.per_sec()).collect();
        let (lo, hi) = rates.iter().fold((f64::MAX, 0f64), |(a, b), &r| (a.min(r), b.max(r)));
        let is_pg = rows.iter().any(|r| r.pg_cpu.is_some());
        let pg =
            if is_pg { format!("{:.0}", m(&|r| r.pg_cpu.map_or(f64::NAN, |c| r.per_task(c)))) } else { "—".into() };
        let (turn, all, spt) = if is_pg {
            (
                format!("{:.3}", m(&|r| r.txn_per_task())),
                format!("{:.3}", m(&|r| r.all_txn_per_task())),
                format!("{:.1}", m(&|r| r.statements as f64 / r.turn_txns.max(1) as f64)),
            )
        } else {
            let syncs = m(&|r| r.syncs as f64 / r.out.completed.max(1) as f64);
            (format!("{syncs:.3} fsync"), "—".into(), "—".into())
        };
        let _ = writeln!(
            out,
            "| {setup} | {:.0} ({lo:.0}–{hi:.0}) | {:.0} | {pg} | {turn} | {all} | {spt} | {:.2} ms | {:.2} ms |",
            m(&|r| r.out.per_sec()),
            m(&|r| r.per_task(r.relay_cpu)),
            m(&|r| r.out.latency.p50.as_secs_f64() * 1e3),
            m(&|r| r.out.latency.p99.as_secs_f64() * 1e3),
        );
    }
    let errors: u64 = rounds.iter().flatten().map(|r| r.out.errors).sum();
    if errors > 0 {
        let first = rounds.iter().flatten().find_map(|r| r.out.first_error.clone()).unwrap_or_default();
        let _ = writeln!(out, "\n{errors} failed calls (first: {first})");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_listening_lines() {
        let line = r#"2026-01-01 00:00:00.000 UTC [42] LOG:  listening on Unix socket "/tmp/x/sock/.s.PGSQL.41234""#;
        assert_eq!(pg_listening(line), Some(SocketAddr::from(([127, 0, 0, 1], 41234))));
        assert_eq!(pg_listening("LOG:  database system is ready to accept connections"), None);
    }

    #[test]
    fn series_values() {
        let text = "# HELP x y\nrelay_db_statements_total 12\nrelay_db_transactions_total{result=\"committed\"} 3\n";
        assert_eq!(series(text, "relay_db_statements_total"), 12);
        assert_eq!(series(text, "relay_db_transactions_total{result=\"committed\"}"), 3);
        assert_eq!(series(text, "relay_journal_syncs_total"), 0);
    }
}
