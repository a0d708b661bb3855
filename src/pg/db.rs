//! The database thread and its API to the event loop. The loop never waits on PostgreSQL: it
//! hands a [`Request`] (statements that form one transaction) to a bounded channel and goes
//! on; the thread runs it and queues a [`Reply`], then wakes the loop through the one mio
//! `Waker` (the `wake` callback). While the database is unreachable, [`Db::send`] refuses at
//! once, so the API can answer 503 promptly.
//!
//! Two helper threads, each with its own connection:
//! - `relay-db`: requests, the node heartbeat, and the housekeeping that is no node's decision
//!   (forgetting nodes silent for an hour, deleting expired files, analyzing the queue's
//!   tables when they grew sharply, the lane sweep); connects with exponential
//!   backoff and full jitter; runs the schema migrations on every connect (cheap when up to
//!   date: one lock, one read). Everything about tasks — expiry, retention, tasks nobody can
//!   take, a dead node's attempts — rides in the nodes' own turn transactions
//!   (`store::pg`), where the core decides.
//! - `relay-db-listen`: `LISTEN`s on the configured channels and raises a flag per channel; the
//!   loop takes the flags (coalesced: a thousand NOTIFYs between two turns are one flag).
//!
//! Notifications are sent debounced: [`Db::notify`] only sets a flag; the next transaction the
//! thread runs carries one `pg_notify` per flagged channel (delivered at its COMMIT), or a
//! statement of its own when no request comes soon. Never one per task.

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::schema;
use super::sql;
use super::url::DbParams;
use super::wire::{Conn, Param, Patience, PgError, Rows, Stmt, Timeouts};
use crate::log::Level;

/// Most channels one node listens on (one bit each).
pub const MAX_CHANNELS: usize = 64;

/// Settings of the database threads.
#[derive(Debug, Clone)]
pub struct DbConfig {
    pub params: DbParams,
    /// This process's node id (a fresh UUID per start) and its name in logs and /clients.
    pub node_id: String,
    pub node_name: String,
    /// Requests waiting for the thread; beyond it [`Db::send`] answers `Busy`.
    pub max_queued_requests: usize,
    pub heartbeat_interval_ms: u64,
    /// A node silent this long is dead. SPEC §11: its tasks return at most PONG_WAIT + 5 s after
    /// its last heartbeat, and live nodes look for them every second: PONG_WAIT + 4 s.
    pub lease_ms: u64,
    /// How often this thread's housekeeping runs (and the node's connection counts as settled).
    pub housekeeping_interval_ms: u64,
    pub backoff_min_ms: u64,
    pub backoff_max_ms: u64,
    /// Longest one transaction may take before the connection counts as broken (a database
    /// that stops answering without closing it); the loop refuses new work after 2 s anyway.
    pub io_timeout_ms: u64,
    /// Channels to LISTEN on; [`Db::take_notified`] reports them by index.
    pub listen: Vec<&'static str>,
    /// Run housekeeping (tests of the API alone turn it off).
    pub housekeeping: bool,
    /// Housekeeping also deletes expired files (`FILE_EXPIRE`).
    pub files_housekeeping: bool,
}

impl DbConfig {
    /// Defaults for a node; `lease_ms` from PONG_WAIT per SPEC §11.
    pub fn new(params: DbParams, node_id: String, pong_wait_ms: u64) -> DbConfig {
        DbConfig {
            params,
            node_name: node_id.clone(),
            node_id,
            max_queued_requests: 1024,
            heartbeat_interval_ms: 1_000,
            lease_ms: pong_wait_ms + 4_000,
            housekeeping_interval_ms: 1_000,
            backoff_min_ms: 100,
            backoff_max_ms: 5_000,
            io_timeout_ms: 5_000,
            listen: vec![sql::CHANNEL_PENDING, sql::CHANNEL_CANCEL, sql::CHANNEL_TOKENS, sql::CHANNEL_FINISHED],
            housekeeping: true,
            files_housekeeping: true,
        }
    }
}

/// Whether the database can be used now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    Ok,
    Unreachable,
}

impl Health {
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Ok => "ok",
            Health::Unreachable => "unreachable",
        }
    }
}

/// One transaction's worth of work, tagged by the loop to match its reply.
#[derive(Debug)]
pub struct Request {
    pub tag: u64,
    pub stmts: Vec<Stmt>,
}

/// Why a request has no result.
#[derive(Debug)]
pub enum Failure {
    /// Never sent: the database was unreachable. Nothing happened.
    Unreachable,
    /// Sent, and the connection broke before the answer: it may or may not have committed.
    /// (A submit is then answered 503; its retry with the same Idempotency-Key is safe.)
    Lost(String),
    /// The database refused it; the transaction was rolled back.
    Refused(PgError),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Unreachable => f.write_str("database unreachable"),
            Failure::Lost(e) => write!(f, "connection lost during the transaction: {e}"),
            Failure::Refused(e) => write!(f, "refused: {e}"),
        }
    }
}

#[derive(Debug)]
pub struct Reply {
    pub tag: u64,
    pub result: Result<Vec<Rows>, Failure>,
}

/// Why [`Db::send`] refused a request (it is handed back).
#[derive(Debug)]
pub enum SendError {
    Unreachable(Request),
    Busy(Request),
    Stopped(Request),
}

/// State shared by the loop and the threads.
struct Shared {
    health: AtomicU8,
    replies: Mutex<VecDeque<Reply>>,
    /// Bit i: a NOTIFY arrived on `listen[i]`.
    notified: AtomicU64,
    /// Bit i: send one NOTIFY on `listen[i]` soon.
    to_notify: AtomicU64,
    stop: AtomicBool,
    wake: Arc<dyn Fn() + Send + Sync>,
    /// Transactions the thread ran on its own (heartbeats, housekeeping, notifications).
    background: AtomicU64,
    /// The backend PID of the `relay-db` session: what it notifies, this node knows already
    /// (the listener ignores it; the slow poll covers what housekeeping changed).
    own_pid: AtomicI32,
    /// Set when the connection has been up for one lease: every live node has beaten since,
    /// so a node without a heartbeat is dead (after a database restart the UNLOGGED heartbeats
    /// are gone until every node beat again).
    settled: AtomicBool,
    /// Set while `relay-db` runs one of the loop's requests: `relay-db-listen` then asks the
    /// database, on its own connection, whether it still answers ([`PROBE_MS`]).
    running: AtomicBool,
    /// When the database last answered such a question, in ms since `epoch` (0: not since the
    /// request began).
    answered_ms: AtomicU64,
    /// When the request that runs now began, in ms since `epoch`.
    began_ms: AtomicU64,
    /// When `relay-db-listen` last saw `relay-db`'s server process at work on that request
    /// (`active`), in ms since `epoch` (0: not since it began): the request may run past the I/O
    /// timeout ([`Patience`]).
    busy_ms: AtomicU64,
    /// This process's start, wall clock, for its heartbeat.
    started_ms: i64,
    epoch: Instant,
}

/// How often `relay-db-listen` asks the database whether it answers while a request runs: a
/// long transaction (one 48 MiB row takes PostgreSQL seconds to hand out on a loaded machine)
/// is told from a database that stopped answering.
const PROBE_MS: u64 = 250;

/// How many I/O timeouts one request may run in all while its server process is at work on it
/// (longer, and it is given up as if the database stopped answering). Meanwhile
/// `relay-db-listen` sends this node's heartbeats, so a long transaction is not a lost node.
const PATIENCE_IO_TIMEOUTS: u64 = 6;

impl Shared {
    fn since_epoch_ms(&self) -> u64 {
        (self.epoch.elapsed().as_millis() as u64).max(1)
    }

    /// `relay-db-listen` saw `relay-db`'s server process at work within the last second.
    fn busy_lately(&self) -> bool {
        let at = self.busy_ms.load(Ordering::SeqCst);
        at != 0 && self.since_epoch_ms().saturating_sub(at) < 1_000
    }

    fn set_health(&self, h: Health) -> bool {
        let v = match h {
            Health::Ok => 1,
            Health::Unreachable => 0,
        };
        self.health.swap(v, Ordering::SeqCst) != v
    }
}

/// [`Db::health`] for another thread.
#[derive(Clone)]
pub struct HealthProbe(Arc<Shared>);

impl HealthProbe {
    pub fn health(&self) -> Health {
        if self.0.health.load(Ordering::SeqCst) == 1 { Health::Ok } else { Health::Unreachable }
    }
}

/// The loop's handle on the database threads.
pub struct Db {
    requests: Option<SyncSender<Request>>,
    shared: Arc<Shared>,
    listen: Vec<&'static str>,
    threads: Vec<JoinHandle<()>>,
}

impl Db {
    /// Starts both threads. The database is `Unreachable` until the first connection (and
    /// migration) succeeds.
    pub fn start(cfg: DbConfig, wake: Arc<dyn Fn() + Send + Sync>) -> io::Result<Db> {
        assert!(cfg.listen.len() <= MAX_CHANNELS, "at most {MAX_CHANNELS} channels");
        let (tx, rx) = sync_channel::<Request>(cfg.max_queued_requests.max(1));
        let shared = Arc::new(Shared {
            health: AtomicU8::new(0),
            replies: Mutex::new(VecDeque::new()),
            notified: AtomicU64::new(0),
            to_notify: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            wake,
            background: AtomicU64::new(0),
            own_pid: AtomicI32::new(0),
            settled: AtomicBool::new(false),
            running: AtomicBool::new(false),
            answered_ms: AtomicU64::new(0),
            began_ms: AtomicU64::new(0),
            busy_ms: AtomicU64::new(0),
            started_ms: crate::timefmt::wall_ms() as i64,
            epoch: Instant::now(),
        });
        let listen = cfg.listen.clone();
        let mut threads = Vec::new();
        let (s, c) = (shared.clone(), cfg.clone());
        threads.push(std::thread::Builder::new().name("relay-db".into()).spawn(move || worker(c, s, rx))?);
        if !cfg.listen.is_empty() {
            let s = shared.clone();
            threads.push(std::thread::Builder::new().name("relay-db-listen".into()).spawn(move || listener(cfg, s))?);
        }
        Ok(Db { requests: Some(tx), shared, listen, threads })
    }

    pub fn health(&self) -> Health {
        self.probe().health()
    }

    /// The database's health as other threads (the files thread) can see it.
    pub fn probe(&self) -> HealthProbe {
        HealthProbe(self.shared.clone())
    }

    /// Queues a transaction. Refused at once while the database is unreachable or the queue is
    /// full; never blocks.
    pub fn send(&self, req: Request) -> Result<(), SendError> {
        let Some(tx) = &self.requests else { return Err(SendError::Stopped(req)) };
        if self.health() == Health::Unreachable {
            return Err(SendError::Unreachable(req));
        }
        match tx.try_send(req) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(req)) => Err(SendError::Busy(req)),
            Err(TrySendError::Disconnected(req)) => Err(SendError::Stopped(req)),
        }
    }

    /// How long ago the database answered `relay-db-listen`'s question during the request that
    /// runs now (`None`: not since it began, or no listener runs).
    pub fn answered_ago_ms(&self) -> Option<u64> {
        let at = self.shared.answered_ms.load(Ordering::SeqCst);
        (at != 0).then(|| (self.shared.epoch.elapsed().as_millis() as u64).saturating_sub(at))
    }

    /// The connection has been up for one lease: dead nodes can be told from live ones.
    pub fn settled(&self) -> bool {
        self.health() == Health::Ok && self.shared.settled.load(Ordering::SeqCst)
    }

    /// Transactions the database thread ran besides the loop's requests (heartbeats,
    /// housekeeping, notifications), for the transactions-per-task figure.
    pub fn background_transactions(&self) -> u64 {
        self.shared.background.load(Ordering::Relaxed)
    }

    /// Moves every reply that arrived into `out`.
    pub fn take_replies(&self, out: &mut Vec<Reply>) {
        let mut q = self.shared.replies.lock().unwrap_or_else(|e| e.into_inner());
        out.extend(q.drain(..));
    }

    /// The channels (as indexes into the configured `listen` list) notified since the last
    /// call. After a reconnect of the listener every channel is reported once, since some
    /// notifications may have been missed.
    pub fn take_notified(&self) -> Vec<&'static str> {
        let bits = self.shared.notified.swap(0, Ordering::SeqCst);
        self.listen.iter().enumerate().filter(|(i, _)| bits & (1 << i) != 0).map(|(_, c)| *c).collect()
    }

    /// Asks for one NOTIFY on `channel` soon (debounced: many calls, one NOTIFY). The channel
    /// must be one of the configured `listen` channels.
    pub fn notify(&self, channel: &str) {
        if let Some(i) = self.listen.iter().position(|c| *c == channel) {
            self.shared.to_notify.fetch_or(1 << i, Ordering::SeqCst);
        }
    }

    /// Stops both threads and waits for them (at most one I/O timeout).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.requests = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Exponential backoff with full jitter: the next delay is uniform in [d/2, d], d doubling
/// from `min` to `max`.
#[derive(Debug)]
pub struct Backoff {
    min_ms: u64,
    max_ms: u64,
    current_ms: u64,
}

impl Backoff {
    pub fn new(min_ms: u64, max_ms: u64) -> Backoff {
        Backoff { min_ms: min_ms.max(1), max_ms: max_ms.max(min_ms.max(1)), current_ms: min_ms.max(1) }
    }

    /// The next delay, given a random number.
    pub fn next_ms(&mut self, random: u64) -> u64 {
        let d = self.current_ms;
        self.current_ms = (self.current_ms.saturating_mul(2)).min(self.max_ms);
        d / 2 + random % (d / 2 + 1)
    }

    pub fn reset(&mut self) {
        self.current_ms = self.min_ms;
    }
}

fn random_u64() -> u64 {
    uuid::Uuid::new_v4().as_u64_pair().0
}

fn push_reply(shared: &Shared, reply: Reply) {
    shared.replies.lock().unwrap_or_else(|e| e.into_inner()).push_back(reply);
    (shared.wake)();
}

/// Waits for the next connection attempt, answering requests `Unreachable` meanwhile.
/// Returns false when asked to stop.
fn wait_down(shared: &Shared, rx: &Receiver<Request>, until: Instant) -> bool {
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return false;
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return true;
        }
        match rx.recv_timeout(left.min(Duration::from_millis(200))) {
            Ok(req) => push_reply(shared, Reply { tag: req.tag, result: Err(Failure::Unreachable) }),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return false,
        }
    }
}

fn connect(cfg: &DbConfig, shared: &Arc<Shared>) -> Result<Conn, PgError> {
    let mut conn = Conn::connect(&cfg.params, Timeouts { io_ms: cfg.io_timeout_ms })?;
    let s = shared.clone();
    conn.set_patience(Patience {
        max_ms: cfg.io_timeout_ms.saturating_mul(PATIENCE_IO_TIMEOUTS),
        busy: Box::new(move || s.busy_lately()),
    });
    let m = schema::migrate(&mut conn)?;
    conn.pipeline(&[Stmt::new(sql::SET_NODE, vec![cfg.node_id.clone().into()])])?;
    if m.from != m.to {
        crate::log!(Level::Info, "database schema migrated", from = m.from, to = m.to);
    }
    Ok(conn)
}

/// The `relay-db` thread.
fn worker(cfg: DbConfig, shared: Arc<Shared>, rx: Receiver<Request>) {
    let mut backoff = Backoff::new(cfg.backoff_min_ms, cfg.backoff_max_ms);
    let started_ms = shared.started_ms;
    let mut logged_down = false;
    // The server process of the connection last lost: it may still run (blocked on a lock) the
    // transaction this node gave up on, and commit it later — claims nobody runs, a submit
    // answered 503 stored after all. It goes before this node works again.
    let mut lost_pid: Option<i32> = None;
    let mut sweep_timeouts = SweepTimeouts::default();
    'connect: loop {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let mut conn = match connect(&cfg, &shared) {
            Ok(c) => c,
            Err(e) => {
                let delay = backoff.next_ms(random_u64());
                if !logged_down {
                    crate::log!(
                        Level::Warn,
                        "database unreachable",
                        database = &cfg.params,
                        error = &e,
                        retry_ms = delay
                    );
                    logged_down = true;
                } else {
                    crate::log!(Level::Debug, "database still unreachable", error = &e, retry_ms = delay);
                }
                if !wait_down(&shared, &rx, Instant::now() + Duration::from_millis(delay)) {
                    return;
                }
                continue;
            }
        };
        let connected_at = Instant::now();
        shared.settled.store(false, Ordering::SeqCst);
        shared.own_pid.store(conn.backend_pid(), Ordering::SeqCst);
        // Heartbeat before declaring health, so this node is alive in the table first.
        if let Err(e) = conn.pipeline(&[heartbeat(&cfg, started_ms)]) {
            crate::log!(Level::Warn, "database heartbeat failed", error = &e);
            if !wait_down(&shared, &rx, Instant::now() + Duration::from_millis(backoff.next_ms(random_u64()))) {
                return;
            }
            continue;
        }
        if let Some(pid) = lost_pid.take()
            && let Err(e) = end_lost_backend(&mut conn, pid, cfg.io_timeout_ms)
        {
            crate::log!(Level::Warn, "database: could not end the lost connection's server process", error = &e);
            if e.is_fatal() {
                lost_pid = Some(pid);
                if !wait_down(&shared, &rx, Instant::now() + Duration::from_millis(backoff.next_ms(random_u64()))) {
                    return;
                }
                continue;
            }
        }
        backoff.reset();
        logged_down = false;
        crate::log!(Level::Info, "database connected", database = &cfg.params, node = &cfg.node_name);
        if shared.set_health(Health::Ok) {
            (shared.wake)();
        }
        let mut next_heartbeat = Instant::now() + Duration::from_millis(cfg.heartbeat_interval_ms);
        let mut next_housekeeping = Instant::now() + Duration::from_millis(cfg.housekeeping_interval_ms);
        let mut next_stats_check = Instant::now();
        loop {
            if shared.stop.load(Ordering::SeqCst) {
                conn.close();
                return;
            }
            let now = Instant::now();
            let due = next_heartbeat.min(next_housekeeping);
            let wait = due.saturating_duration_since(now).min(Duration::from_millis(100));
            let broken = match rx.recv_timeout(wait) {
                Ok(req) => {
                    shared.answered_ms.store(0, Ordering::SeqCst);
                    shared.busy_ms.store(0, Ordering::SeqCst);
                    shared.began_ms.store(shared.since_epoch_ms(), Ordering::SeqCst);
                    shared.running.store(true, Ordering::SeqCst);
                    let broken = run_request(&cfg, &shared, &mut conn, req);
                    shared.running.store(false, Ordering::SeqCst);
                    broken
                }
                Err(RecvTimeoutError::Timeout) => flush_notifies(&cfg, &shared, &mut conn),
                Err(RecvTimeoutError::Disconnected) => {
                    conn.close();
                    return;
                }
            };
            let mut broken = broken;
            if broken.is_none() && Instant::now() >= next_heartbeat {
                next_heartbeat = Instant::now() + Duration::from_millis(cfg.heartbeat_interval_ms);
                shared.background.fetch_add(1, Ordering::Relaxed);
                broken = conn.pipeline(&[heartbeat(&cfg, started_ms)]).err().filter(PgError::is_fatal);
            }
            if broken.is_none() && cfg.housekeeping && Instant::now() >= next_housekeeping {
                next_housekeeping = Instant::now() + Duration::from_millis(cfg.housekeeping_interval_ms);
                // Adoption waits one lease after this node (re)connected: after a database
                // restart the UNLOGGED heartbeats are gone until every live node beat again.
                let reap = connected_at.elapsed() >= Duration::from_millis(cfg.lease_ms);
                if reap && !shared.settled.swap(true, Ordering::SeqCst) {
                    (shared.wake)();
                }
                broken = housekeeping(&cfg, &shared, &mut conn, &mut sweep_timeouts);
            } else if broken.is_none() && cfg.housekeeping {
                // (Never in the same pass as the rest of housekeeping: a request waiting
                // meanwhile goes between the two.)
                broken = analyze_if_stale(&shared, &mut conn, &mut next_stats_check);
            }
            if let Some(e) = broken {
                lost_pid = Some(conn.backend_pid());
                crate::log!(Level::Warn, "database connection lost", error = &e);
                if shared.set_health(Health::Unreachable) {
                    (shared.wake)();
                }
                continue 'connect;
            }
        }
    }
}

/// Ends the server process `pid` of a connection this node lost, if it is still there (older
/// than this connection: not a process that took its number since), and waits until it is gone
/// (at most `wait_ms`): its open transaction is rolled back, never committed late.
fn end_lost_backend(conn: &mut Conn, pid: i32, wait_ms: u64) -> Result<(), PgError> {
    let deadline = Instant::now() + Duration::from_millis(wait_ms);
    loop {
        let rows = conn.pipeline(&[Stmt::new(sql::END_LOST_BACKEND, vec![i64::from(pid).into()])])?;
        let left = rows.first().and_then(|r| r.rows.first()).and_then(|r| r.i64(0)).unwrap_or(0);
        if left == 0 || Instant::now() >= deadline {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn heartbeat(cfg: &DbConfig, started_ms: i64) -> Stmt {
    Stmt::new(
        sql::HEARTBEAT,
        vec![
            cfg.node_id.clone().into(),
            cfg.node_name.clone().into(),
            started_ms.into(),
            env!("CARGO_PKG_VERSION").into(),
        ],
    )
}

/// The pending NOTIFYs as statements (clearing their flags).
fn take_notify_stmts(cfg: &DbConfig, shared: &Shared) -> Vec<Stmt> {
    let bits = shared.to_notify.swap(0, Ordering::SeqCst);
    cfg.listen
        .iter()
        .enumerate()
        .filter(|(i, _)| bits & (1 << i) != 0)
        .map(|(_, c)| Stmt::new(sql::NOTIFY, vec![Param::from(*c)]))
        .collect()
}

/// Runs one request; returns the error when the connection broke.
fn run_request(cfg: &DbConfig, shared: &Shared, conn: &mut Conn, req: Request) -> Option<PgError> {
    let n = req.stmts.len();
    let mut stmts = req.stmts;
    stmts.extend(take_notify_stmts(cfg, shared));
    let (result, broken) = match conn.pipeline(&stmts) {
        Ok(mut rows) => {
            rows.truncate(n);
            (Ok(rows), None)
        }
        Err(e) if e.is_fatal() => (Err(Failure::Lost(e.to_string())), Some(e)),
        Err(e) => (Err(Failure::Refused(e)), None),
    };
    push_reply(shared, Reply { tag: req.tag, result });
    broken
}

fn flush_notifies(cfg: &DbConfig, shared: &Shared, conn: &mut Conn) -> Option<PgError> {
    let stmts = take_notify_stmts(cfg, shared);
    if stmts.is_empty() {
        return None;
    }
    shared.background.fetch_add(1, Ordering::Relaxed);
    conn.pipeline(&stmts).err().filter(PgError::is_fatal)
}

/// SQLSTATE `query_canceled`: what a statement that ran into its `statement_timeout` fails with.
const QUERY_CANCELED: &str = "57014";

/// An expected timeout of the lane sweep is logged at most this often (it is tried again every
/// second; under load it may time out every second, which is no error).
const SWEEP_TIMEOUT_LOG_MS: u64 = 60_000;

/// The lane sweep's timeouts (`SWEEP_TIMEOUT`, as designed: what it left is swept a second
/// later) since the last line that told of them.
#[derive(Debug, Default)]
struct SweepTimeouts {
    unlogged: u64,
    logged_at: Option<Instant>,
}

impl SweepTimeouts {
    /// One more timeout at `now`: `Some(n)` when a line is due (the first one, then at most one
    /// each [`SWEEP_TIMEOUT_LOG_MS`]), `n` the timeouts it tells of.
    fn note(&mut self, now: Instant) -> Option<u64> {
        self.unlogged += 1;
        let quiet = Duration::from_millis(SWEEP_TIMEOUT_LOG_MS);
        if self.logged_at.is_some_and(|at| now.saturating_duration_since(at) < quiet) {
            return None;
        }
        self.logged_at = Some(now);
        Some(std::mem::take(&mut self.unlogged))
    }
}

/// How often the database thread asks whether the queue's statistics went stale (`STALE_STATS`).
const STATS_CHECK_MS: u64 = 5_000;
/// After an ANALYZE that failed (its timeout: a table too large to sample in time), the next
/// look waits this long — autovacuum will have analyzed by then — rather than stall the
/// node's transactions for a second every few seconds.
const STATS_RETRY_MS: u64 = 60_000;

/// Analyzes the queue and fair-shares tables when they grew sharply since their last analyze
/// (`STALE_STATS`, at most once each [`STATS_CHECK_MS`]; the ANALYZE bounded by
/// `ANALYZE_TIMEOUT`): thousands of new keys submitted at once otherwise leave the claims on
/// plans made for empty tables until autovacuum's next look, up to a minute later. Only a
/// broken connection is returned.
fn analyze_if_stale(shared: &Shared, conn: &mut Conn, next_check: &mut Instant) -> Option<PgError> {
    let now = Instant::now();
    if now < *next_check {
        return None;
    }
    *next_check = now + Duration::from_millis(STATS_CHECK_MS);
    shared.background.fetch_add(1, Ordering::Relaxed);
    let stale = match conn.pipeline(&[Stmt::new(sql::STALE_STATS, vec![])]) {
        Ok(rows) => rows.first().map_or(0, |r| r.rows.len()),
        Err(e) if e.is_fatal() => return Some(e),
        Err(e) => {
            crate::log!(Level::Error, "database housekeeping failed", job = "stale statistics", error = &e);
            return None;
        }
    };
    if stale == 0 {
        return None;
    }
    shared.background.fetch_add(1, Ordering::Relaxed);
    let started = Instant::now();
    match conn.pipeline(&[Stmt::new(sql::ANALYZE_TIMEOUT, vec![]), Stmt::new(sql::ANALYZE_QUEUE, vec![])]) {
        Ok(_) => {
            let ms = started.elapsed().as_millis() as u64;
            crate::log!(Level::Debug, "database queue tables analyzed", stale_tables = stale, took_ms = ms);
            None
        }
        Err(e) if e.is_fatal() => Some(e),
        Err(e) => {
            *next_check = Instant::now() + Duration::from_millis(STATS_RETRY_MS);
            crate::log!(
                Level::Warn,
                "database: analyzing the queue tables failed",
                error = &e,
                retry_ms = STATS_RETRY_MS
            );
            None
        }
    }
}

/// Nodes silent for an hour and expired files, each its own transaction. Only a broken
/// connection is returned; a refused statement is logged.
fn housekeeping(cfg: &DbConfig, shared: &Shared, conn: &mut Conn, sweep: &mut SweepTimeouts) -> Option<PgError> {
    let now_ms = crate::timefmt::wall_ms() as i64;
    // (job, statement, channels to notify when it changed rows: tasks went back to pending, or
    // became final and may have waiters on any node)
    let mut jobs: Vec<(&str, Stmt, &[&str])> = Vec::new();
    // (Waiting tasks that expire or that nobody can take, and retention, are the nodes' own
    // transactions, on their clock: `store::pg`.)
    jobs.push(("nodes", Stmt::new(sql::FORGET_NODES, vec![]), &[]));
    if cfg.files_housekeeping {
        jobs.push(("files", Stmt::new(sql::FILE_EXPIRE, vec![now_ms.into()]), &[]));
    }
    for (what, stmt, channels) in jobs {
        let mut stmts = vec![stmt];
        stmts.extend(channels.iter().map(|c| Stmt::new(sql::NOTIFY, vec![Param::from(*c)])));
        // The statement alone first; only when it changed rows do its notifications follow (an
        // idle cluster is not woken every second for nothing).
        shared.background.fetch_add(1, Ordering::Relaxed);
        match conn.pipeline(&stmts[..1]) {
            Ok(rows) => {
                let n = rows.first().map_or(0, |r| r.affected);
                if n > 0 {
                    shared.background.fetch_add(1, Ordering::Relaxed);
                    crate::log!(Level::Debug, "database housekeeping", job = what, rows = n);
                    if stmts.len() > 1
                        && let Err(e) = conn.pipeline(&stmts[1..])
                        && e.is_fatal()
                    {
                        return Some(e);
                    }
                }
            }
            Err(e) if e.is_fatal() => return Some(e),
            Err(e) => crate::log!(Level::Error, "database housekeeping failed", job = what, error = &e),
        }
    }
    // Lanes without work lose their rotation state (SPEC §14), under the insert lock: a
    // transaction of its own, after the lock's. It holds every node's inserts meanwhile, so it
    // gives up after `SWEEP_TIMEOUT` (a plan made on stale statistics once ran for 43 minutes
    // over 15,000 new lanes, and no submit was stored on any node meanwhile); what it left is
    // swept a second later.
    shared.background.fetch_add(1, Ordering::Relaxed);
    match conn.pipeline(&[
        Stmt::new(sql::SWEEP_TIMEOUT, vec![]),
        Stmt::new(sql::INSERT_LOCK, vec![]),
        Stmt::new(sql::FAIR_SWEEP, vec![]),
    ]) {
        Ok(_) => None,
        Err(e) if e.is_fatal() => Some(e),
        Err(e) if e.code() == Some(QUERY_CANCELED) => {
            if let Some(n) = sweep.note(Instant::now()) {
                crate::log!(
                    Level::Warn,
                    "database lane sweep gave up after its timeout (tried again each second)",
                    timeouts = n,
                    logged_every_ms = SWEEP_TIMEOUT_LOG_MS
                );
            }
            None
        }
        Err(e) => {
            crate::log!(Level::Error, "database housekeeping failed", job = "fair lanes", error = &e);
            None
        }
    }
}

/// The `relay-db-listen` thread.
fn listener(cfg: DbConfig, shared: Arc<Shared>) {
    let mut backoff = Backoff::new(cfg.backoff_min_ms, cfg.backoff_max_ms);
    let all: u64 = if cfg.listen.len() >= 64 { u64::MAX } else { (1u64 << cfg.listen.len()) - 1 };
    while !shared.stop.load(Ordering::SeqCst) {
        let mut conn = match Conn::connect(&cfg.params, Timeouts { io_ms: cfg.io_timeout_ms }) {
            Ok(c) => c,
            Err(_) => {
                sleep_unless_stopped(&shared, backoff.next_ms(random_u64()));
                continue;
            }
        };
        let script: String = cfg.listen.iter().map(|c| format!("LISTEN \"{c}\";")).collect();
        if let Err(e) = conn.simple(&script) {
            crate::log!(Level::Warn, "database LISTEN failed", error = &e);
            sleep_unless_stopped(&shared, backoff.next_ms(random_u64()));
            continue;
        }
        backoff.reset();
        // Anything may have been missed while this thread was not listening.
        shared.notified.fetch_or(all, Ordering::SeqCst);
        (shared.wake)();
        // When the last probe was sent: at most one each PROBE_MS, however many notifications
        // wake this thread (every turn of every node sends some).
        let mut probed: Option<Instant> = None;
        let mut beat: Option<Instant> = None;
        loop {
            if shared.stop.load(Ordering::SeqCst) {
                conn.close();
                return;
            }
            if shared.running.load(Ordering::SeqCst)
                && probed.is_none_or(|at| at.elapsed() >= Duration::from_millis(PROBE_MS))
            {
                probed = Some(Instant::now());
                // A request that has run a second: is its server process at work on it, and
                // this node's heartbeat (`relay-db` sends none meanwhile) once a heartbeat
                // interval. (An answer that comes after the request ended is stale: dropped.)
                let age = shared.since_epoch_ms().saturating_sub(shared.began_ms.load(Ordering::SeqCst));
                let answer = if age < 1_000 {
                    conn.simple("SELECT 1").map(|_| false)
                } else {
                    let pid = i64::from(shared.own_pid.load(Ordering::SeqCst));
                    let mut stmts = vec![Stmt::new(sql::BACKEND_BUSY, vec![pid.into()])];
                    let beat_due =
                        beat.is_none_or(|at| at.elapsed() >= Duration::from_millis(cfg.heartbeat_interval_ms));
                    if beat_due {
                        beat = Some(Instant::now());
                        stmts.push(heartbeat(&cfg, shared.started_ms));
                    }
                    conn.pipeline(&stmts)
                        .map(|rows| rows.first().and_then(|r| r.rows.first()).and_then(|r| r.bool(0)).unwrap_or(false))
                };
                // (A refused statement is an answer too; only a broken connection ends this one.)
                let busy = match answer {
                    Ok(busy) => busy,
                    Err(e) if e.is_fatal() => break,
                    Err(_) => false,
                };
                if shared.running.load(Ordering::SeqCst) {
                    let now = shared.since_epoch_ms();
                    shared.answered_ms.store(now, Ordering::SeqCst);
                    if busy {
                        shared.busy_ms.store(now, Ordering::SeqCst);
                    }
                }
            }
            match conn.wait_notification(Duration::from_millis(PROBE_MS)) {
                Ok(Some(n)) => {
                    let own = shared.own_pid.load(Ordering::SeqCst);
                    let mut bits = 0u64;
                    // (This node's own transactions say what it knows already.)
                    if let Some(i) = cfg.listen.iter().position(|c| *c == n.channel).filter(|_| n.pid != own) {
                        bits |= 1 << i;
                    }
                    // Take whatever else is already here, so one wake covers a burst.
                    while let Ok(Some(more)) = conn.wait_notification(Duration::ZERO) {
                        if let Some(i) = cfg.listen.iter().position(|c| *c == more.channel).filter(|_| more.pid != own)
                        {
                            bits |= 1 << i;
                        }
                    }
                    if bits != 0 && shared.notified.fetch_or(bits, Ordering::SeqCst) & bits != bits {
                        (shared.wake)();
                    }
                }
                Ok(None) => {}
                Err(_) => break,
            }
        }
    }
}

fn sleep_unless_stopped(shared: &Shared, ms: u64) {
    let until = Instant::now() + Duration::from_millis(ms);
    while !shared.stop.load(Ordering::SeqCst) && Instant::now() < until {
        std::thread::sleep(until.saturating_duration_since(Instant::now()).min(Duration::from_millis(50)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sweep that times out every second is told of once a minute, with how many timeouts
    /// the line covers (before: an error line every second).
    #[test]
    fn sweep_timeouts_are_logged_once_per_interval_with_their_count() {
        let t0 = Instant::now();
        let mut s = SweepTimeouts::default();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // (ms after the first timeout, the line due then)
        let table: &[(u64, Option<u64>)] = &[
            (0, Some(1)),
            (1_000, None),
            (2_000, None),
            (59_999, None),
            (60_000, Some(4)),
            (61_000, None),
            (200_000, Some(2)),
        ];
        for (ms, expected) in table {
            assert_eq!(s.note(at(*ms)), *expected, "at {ms} ms");
        }
    }

    #[test]
    fn backoff_doubles_with_jitter_up_to_the_cap() {
        let mut b = Backoff::new(100, 1_000);
        let table: &[(u64, u64)] = &[(0, 50), (100, 200), (0, 200), (0, 400), (0, 500), (7, 507)];
        for (random, expected) in table {
            assert_eq!(b.next_ms(*random), *expected);
        }
        for r in 0..1000u64 {
            let d = b.next_ms(r * 7919);
            assert!((500..=1_000).contains(&d), "{d}");
        }
        b.reset();
        assert_eq!(b.next_ms(0), 50);
    }
}
