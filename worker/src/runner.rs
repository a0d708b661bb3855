//! The runner: the one thread that owns the link. It connects, says `hello`, reads tasks and
//! hands them to the pool, sends finished results, answers pings, notices a dead relay, and
//! reconnects with exponential backoff and jitter. One log line per change of state:
//! `starting`, `connected`, `connect failed`, `token refused`, `disconnected`, `draining`,
//! `stopped`.
//!
//! Connection identity: every connection gets a generation (`conn_gen`), and every task
//! carries the generation it arrived on. Without a session relay knows a worker by its
//! connection (a new connection is a new `client_id`), and it ends the attempts of a lost
//! connection with `disconnect` and retries them elsewhere, so a result is only ever sent on
//! the connection its task came from. A task whose connection dropped still runs to the end (its
//! side effects happen once, not half), but its result is dropped with a `result dropped` log
//! line: sent on a new connection relay would only count it as `unknown`.
//!
//! Sessions (SPEC §12): every hello says `worker_id`; a relay with sessions answers `welcome`
//! with a secret. After a lost connection the next hello presents it and lists the tasks still
//! running or finished meanwhile (`running`); relay holds them for its resume window. Results
//! that finish while disconnected are kept (bounded: `concurrency` of them and
//! `kept_results_max_bytes`) and sent once the welcome adopts their tasks; tasks it lists in
//! `abandon` are stopped and their results dropped. `{"type":"reconnect"}` (relay restarting)
//! reconnects at once, with up to 1 s of jitter. A relay that sends no welcome gets the
//! behaviour above, unchanged.
//!
//! A 401 on connect (`TOKEN` is not relay's `WORKER_TOKEN`) is final: no retry; running tasks
//! of an earlier connection finish as in a drain, then `run` fails with a configuration error
//! (exit 2 from `main_with`).
//!
//! Shutdown (the stop flag, set by SIGTERM/SIGINT): `hello` with concurrency 0 (relay stops
//! sending tasks), a task that still arrives is answered `failed` / `worker shutting down`,
//! running tasks finish within `shutdown_timeout_ms` and their results are sent, then the
//! socket is closed (1000) and `run` returns. A link lost while draining is re-opened only
//! with a session (saying concurrency 0): the resumed session takes the running tasks' results,
//! which relay would otherwise run again elsewhere; without one it is not.

use std::collections::{BTreeMap, HashMap};
use std::io::ErrorKind;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use rustls::ClientConfig;
use tungstenite::Message;
use tungstenite::protocol::CloseFrame;
use tungstenite::protocol::frame::coding::CloseCode;

use crate::link::{self, ConnectError, Ws};
use crate::log::Level;
use crate::pool::{Finished, Job, Pool};
use crate::protocol::{self, ServerMsg};
use crate::{Config, Error, Handler, log, signals, tls};

pub const VERSION: &str = concat!("relay-worker/", env!("CARGO_PKG_VERSION"));

pub fn run(cfg: Config, kinds: BTreeMap<String, Handler>, stop: &AtomicBool) -> Result<(), Error> {
    let tls = match cfg.relay_url.scheme() {
        "wss" => Some(tls::client_config(cfg.ca_file.as_deref())?),
        _ => None,
    };
    let names: Vec<String> = kinds.keys().cloned().collect();
    let (tx, finished) = channel();
    let pool = Pool::start(cfg.concurrency, cfg.concurrency, Arc::new(kinds), tx, cfg.max_message_bytes)
        .map_err(|e| Error::new(format!("cannot start the task threads: {e}")))?;
    log!(
        Level::Info,
        "starting",
        url = cfg.relay_url_for_logs(),
        kinds = names.join(","),
        concurrency = cfg.concurrency,
        version = VERSION
    );
    let backoff = Backoff::new(cfg.backoff_initial_ms, cfg.backoff_max_ms);
    let mut runner = Runner {
        cfg,
        tls,
        names,
        pool: Some(pool),
        finished,
        in_flight: HashMap::new(),
        jobs: HashMap::new(),
        next_job: 0,
        secret: None,
        window_ms: 0,
        kept: Vec::new(),
        kept_bytes: 0,
        unconfirmed: Vec::new(),
        unconfirmed_bytes: 0,
        confirm: None,
        confirm_seq: 0,
        reconnect_now: false,
        conn_gen: 0,
        drain_deadline: None,
        stop,
        backoff,
        token_refused: false,
    };
    runner.main_loop();
    if runner.in_flight.is_empty()
        && let Some(pool) = runner.pool.take()
    {
        pool.join();
    }
    if runner.token_refused {
        let url = runner.cfg.relay_url_for_logs();
        return Err(Error::config(format!("{TOKEN_REFUSED} (HTTP 401 from {url})")));
    }
    Ok(())
}

/// What a 401 on connect means, for the log and the exit message.
const TOKEN_REFUSED: &str = "relay refused the worker token: set TOKEN to relay's WORKER_TOKEN";

/// A task handed to the pool.
struct Flight {
    job: u64,
    /// The attempt its task frame named (a session's).
    attempt: Option<u64>,
    /// Its cancel mark.
    canceled: Arc<AtomicBool>,
}

/// A result waiting for a resumed session to take its task back.
struct Kept {
    task_id: String,
    attempt: Option<u64>,
    message: String,
}

/// How a connection ended.
enum End {
    /// Drained (or the grace period ran out): the worker stops.
    Done,
    /// Lost: reconnect after a backoff delay.
    Lost(String),
}

struct Runner<'a> {
    cfg: Config,
    tls: Option<Arc<ClientConfig>>,
    names: Vec<String>,
    pool: Option<Pool>,
    finished: Receiver<Finished>,
    /// Tasks handed to the pool and not finished, by (connection, task id). Bounded by the
    /// pool: threads + queue.
    in_flight: HashMap<(u64, String), Flight>,
    /// The pool's job numbers → their `in_flight` key (a resumed session moves tasks to the
    /// new connection's key).
    jobs: HashMap<u64, (u64, String)>,
    next_job: u64,
    /// The secret of the last `welcome` (relay has sessions): results are kept while
    /// disconnected, for the resumed session.
    secret: Option<String>,
    /// The last welcome's `resume_window_ms`: how long relay holds what a lost connection ran.
    window_ms: u64,
    /// Results finished while disconnected (or before the welcome adopted their task).
    kept: Vec<Kept>,
    kept_bytes: usize,
    /// With a session: results written to the live connection that relay has not been seen to
    /// read yet (bounded as `kept`). A ping follows them; its pong says relay read everything
    /// before it. A connection lost before that keeps them for the resume: a cut can swallow a
    /// result already written, and relay, not listed it, would end the attempt and run the
    /// task again (SPEC §12).
    unconfirmed: Vec<Kept>,
    unconfirmed_bytes: usize,
    /// The ping in flight for `unconfirmed`: its number, and how many of them it covers.
    confirm: Option<(u64, usize)>,
    confirm_seq: u64,
    /// relay sent `reconnect`: the next connect comes at once (jitter ≤ 1 s).
    reconnect_now: bool,
    conn_gen: u64,
    /// Set once the stop flag is seen: the end of the grace period.
    drain_deadline: Option<Instant>,
    stop: &'a AtomicBool,
    backoff: Backoff,
    /// relay answered 401 on connect: the worker stops (exit 2), after its running tasks.
    token_refused: bool,
}

impl Runner<'_> {
    fn main_loop(&mut self) {
        loop {
            if self.check_stop() && self.drained_or_expired() {
                return;
            }
            if self.drain_deadline.is_some() && !self.resumable() {
                // Disconnected while draining, without a session: a new connection could not
                // deliver the results anyway (see the module doc), so just let the running
                // tasks finish. (With one, it reconnects: the resumed session takes them.)
                self.wait(Duration::from_millis(self.cfg.poll_interval_ms));
                continue;
            }
            self.conn_gen += 1;
            let url = self.cfg.relay_url_for_logs();
            match link::connect(&self.cfg, self.tls.as_ref()) {
                Ok(mut ws) => {
                    log!(Level::Info, "connected", url = url, conn = self.conn_gen);
                    let up = Instant::now();
                    let end = self.session(&mut ws);
                    let up_ms = up.elapsed().as_millis();
                    if up_ms >= u128::from(self.cfg.stable_after_ms) {
                        self.backoff.reset();
                    }
                    match end {
                        End::Done => return,
                        End::Lost(reason) => {
                            self.keep_unconfirmed();
                            let delay = if self.drain_deadline.is_some() && !self.resumable() {
                                0
                            } else if std::mem::take(&mut self.reconnect_now) {
                                // relay is restarting: back at once, spread over a second.
                                self.backoff.reset();
                                random() % 1001
                            } else {
                                let delay = self.backoff.next(random());
                                self.resume_delay(delay)
                            };
                            log!(
                                Level::Warn,
                                "disconnected",
                                url = url,
                                conn = self.conn_gen,
                                reason = reason,
                                up_ms = up_ms,
                                in_flight = self.in_flight.len(),
                                retry_in_ms = delay
                            );
                            self.wait(Duration::from_millis(delay));
                        }
                    }
                }
                Err(ConnectError::TokenRefused) => {
                    // Final: relay will refuse this token however often it is tried. Tasks still
                    // running from an earlier connection finish first, as when draining.
                    log!(Level::Error, "token refused", url = url, error = TOKEN_REFUSED);
                    self.token_refused = true;
                    self.start_drain("token refused");
                }
                Err(ConnectError::Failed(error)) => {
                    let delay = self.backoff.next(random());
                    let delay = self.resume_delay(delay);
                    log!(Level::Warn, "connect failed", url = url, error = error, retry_in_ms = delay);
                    self.wait(Duration::from_millis(delay));
                }
            }
        }
    }

    /// Notices the stop flag once: starts the grace period. Returns whether draining.
    fn check_stop(&mut self) -> bool {
        if self.drain_deadline.is_none() && self.stop.load(Ordering::SeqCst) {
            self.start_drain(signals::received().unwrap_or("stop requested"));
        }
        self.drain_deadline.is_some()
    }

    /// Starts the grace period: no new connection, running tasks may finish.
    fn start_drain(&mut self, reason: &str) {
        if self.drain_deadline.is_some() {
            return;
        }
        self.drain_deadline = Some(Instant::now() + Duration::from_millis(self.cfg.shutdown_timeout_ms));
        log!(
            Level::Info,
            "draining",
            reason = reason,
            in_flight = self.in_flight.len(),
            grace_ms = self.cfg.shutdown_timeout_ms
        );
    }

    /// The backoff's `delay`, at most a quarter of relay's resume window while the session
    /// holds something (tasks running, results kept): a backoff grown by repeated cuts (it
    /// resets only after a stable connection) would otherwise come back after relay let go of
    /// them, and they would run again elsewhere (SPEC §12).
    fn resume_delay(&self, delay: u64) -> u64 {
        let held = !self.in_flight.is_empty() || !self.kept.is_empty() || !self.unconfirmed.is_empty();
        if self.resumable() && held && self.window_ms > 0 { delay.min(self.window_ms / 4) } else { delay }
    }

    /// A lost connection's tasks and results can still reach relay: it has a session (SPEC §12).
    fn resumable(&self) -> bool {
        self.secret.is_some() && !self.token_refused
    }

    /// While draining: true (and logs `stopped`) once nothing runs, no result waits for a
    /// resume, or the grace period is over.
    fn drained_or_expired(&self) -> bool {
        let Some(deadline) = self.drain_deadline else { return false };
        if self.in_flight.is_empty() && self.kept.is_empty() {
            log!(Level::Info, "stopped", reason = "drained");
            return true;
        }
        if Instant::now() >= deadline {
            log!(Level::Warn, "stopped", reason = "shutdown timeout", abandoned = self.in_flight.len());
            return true;
        }
        false
    }

    /// Sleeps up to `delay` while disconnected, still collecting finished tasks; returns early
    /// when the stop flag is set.
    fn wait(&mut self, delay: Duration) {
        let end = Instant::now() + delay;
        loop {
            let _ = self.collect(None);
            let now = Instant::now();
            if now >= end || (self.drain_deadline.is_none() && self.stop.load(Ordering::SeqCst)) {
                return;
            }
            std::thread::sleep((end - now).min(Duration::from_millis(self.cfg.poll_interval_ms.max(1))));
        }
    }

    /// Takes every finished task; sends the results that belong to the live connection `ws`.
    /// With a session, a result whose connection is gone is kept for the resume.
    fn collect(&mut self, mut ws: Option<&mut Ws>) -> Result<(), String> {
        while let Ok(f) = self.finished.try_recv() {
            let Finished { job, message, failed, task_id } = f;
            let Some(key) = self.jobs.remove(&job) else {
                log!(Level::Warn, "result of an unknown job dropped", task_id = task_id);
                continue;
            };
            let attempt = self.in_flight.remove(&key).and_then(|f| f.attempt);
            let (conn_gen, task_id) = key;
            let Some(message) = message else { continue };
            match ws.as_deref_mut() {
                Some(ws) if conn_gen == self.conn_gen => {
                    let tracked = self.secret.is_some()
                        && may_keep(
                            self.unconfirmed.len(),
                            self.unconfirmed_bytes,
                            message.len(),
                            self.cfg.concurrency,
                            self.cfg.kept_results_max_bytes,
                        );
                    let copy = tracked.then(|| message.clone());
                    let sent = send(ws, message);
                    if let Some(message) = copy {
                        self.unconfirmed_bytes += message.len();
                        self.unconfirmed.push(Kept { task_id, attempt, message });
                    }
                    sent?;
                }
                _ if self.secret.is_some() => self.keep(task_id, attempt, message),
                _ => log!(
                    Level::Warn,
                    "result dropped",
                    task_id = task_id,
                    failed = failed,
                    reason = "the connection the task came on is gone; relay has moved the task on"
                ),
            }
        }
        Ok(())
    }

    /// Keeps a result for the resumed session, within its bounds.
    fn keep(&mut self, task_id: String, attempt: Option<u64>, message: String) {
        if !may_keep(
            self.kept.len(),
            self.kept_bytes,
            message.len(),
            self.cfg.concurrency,
            self.cfg.kept_results_max_bytes,
        ) {
            log!(Level::Warn, "result dropped", task_id = task_id, reason = "too many results kept while disconnected");
            return;
        }
        log!(Level::Info, "result kept for the session resume", task_id = task_id);
        self.kept_bytes += message.len();
        self.kept.push(Kept { task_id, attempt, message });
    }

    /// relay answered the ping that followed results: it read them.
    fn confirmed(&mut self, payload: &[u8]) {
        let Some((seq, n)) = self.confirm else { return };
        if payload != seq.to_be_bytes() {
            return;
        }
        self.confirm = None;
        for k in self.unconfirmed.drain(..n.min(self.unconfirmed.len())) {
            self.unconfirmed_bytes = self.unconfirmed_bytes.saturating_sub(k.message.len());
        }
    }

    /// The connection was lost: results relay was not seen to read are kept for the resume
    /// (listed in its `running`, sent again if the welcome adopts them).
    fn keep_unconfirmed(&mut self) {
        self.confirm = None;
        self.unconfirmed_bytes = 0;
        for k in std::mem::take(&mut self.unconfirmed) {
            self.keep(k.task_id, k.attempt, k.message);
        }
    }

    /// The session part of this connection's first hello: every task still running or kept.
    fn running_list(&self) -> Vec<(String, Option<u64>)> {
        let mut list: Vec<(String, Option<u64>)> =
            self.in_flight.iter().map(|((_, id), f)| (id.clone(), f.attempt)).collect();
        list.extend(self.kept.iter().map(|k| (k.task_id.clone(), k.attempt)));
        list
    }

    fn hello(&self, concurrency: usize, running: Option<&[(String, Option<u64>)]>) -> String {
        let session =
            protocol::SessionHello { worker_id: &self.cfg.worker_id, secret: self.secret.as_deref(), running };
        protocol::hello(&self.names, concurrency, Some(session))
    }

    /// relay's `welcome`: the session's secret; adopted tasks are this connection's now (their
    /// kept results go out), abandoned ones stop.
    fn on_welcome(&mut self, ws: &mut Ws, w: protocol::Welcome) -> Result<(), String> {
        let resumed = self.secret.as_deref() == Some(w.session.as_str());
        self.secret = Some(w.session);
        self.window_ms = w.resume_window_ms;
        let conn_gen = self.conn_gen;
        let old: Vec<(u64, String)> = self.in_flight.keys().filter(|(g, _)| *g != conn_gen).cloned().collect();
        for key in old {
            if w.adopted.contains(&key.1) {
                if let Some(f) = self.in_flight.remove(&key) {
                    let new_key = (conn_gen, key.1.clone());
                    self.jobs.insert(f.job, new_key.clone());
                    self.in_flight.insert(new_key, f);
                }
            } else if let Some(f) = self.in_flight.get(&key) {
                // Not relay's any more (abandoned, or not held): stop it, drop its result.
                f.canceled.store(true, Ordering::SeqCst);
            }
        }
        let kept = std::mem::take(&mut self.kept);
        self.kept_bytes = 0;
        let (mut sent, mut dropped) = (0, 0);
        for k in kept {
            if w.adopted.contains(&k.task_id) {
                send(ws, k.message)?;
                sent += 1;
            } else {
                dropped += 1;
            }
        }
        log!(
            Level::Info,
            if resumed { "session resumed" } else { "session started" },
            client_id = w.client_id,
            adopted = w.adopted.len(),
            abandoned = w.abandon.len(),
            kept_results_sent = sent,
            kept_results_dropped = dropped,
            resume_window_ms = w.resume_window_ms
        );
        Ok(())
    }

    fn session(&mut self, ws: &mut Ws) -> End {
        let conn_gen = self.conn_gen;
        let mut announced_drain = self.drain_deadline.is_some();
        let concurrency = if announced_drain { 0 } else { self.cfg.concurrency };
        let running = self.running_list();
        if let Err(e) = send(ws, self.hello(concurrency, Some(&running))) {
            return End::Lost(e);
        }
        let mut last_rx = Instant::now();
        let mut pinged = false;
        self.confirm = None;
        let mut close_reason: Option<String> = None;
        loop {
            if self.check_stop() && !announced_drain {
                if let Err(e) = send(ws, self.hello(0, None)) {
                    return End::Lost(e);
                }
                announced_drain = true;
            }
            if let Err(e) = self.collect(Some(ws)) {
                return End::Lost(e);
            }
            if self.confirm.is_none() && !self.unconfirmed.is_empty() {
                self.confirm_seq += 1;
                let payload = self.confirm_seq.to_be_bytes().to_vec();
                match ws.write(Message::Ping(payload.into())) {
                    Err(tungstenite::Error::Io(e)) if is_timeout(&e) || e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return End::Lost(format!("ping: {e}")),
                    Ok(()) => {}
                }
                self.confirm = Some((self.confirm_seq, self.unconfirmed.len()));
            }
            if self.drained_or_expired() {
                close(ws);
                return End::Done;
            }
            let silent_ms = last_rx.elapsed().as_millis();
            if silent_ms >= u128::from(self.cfg.dead_after_ms) {
                return End::Lost(format!("no frame from relay for {silent_ms} ms"));
            }
            if silent_ms >= u128::from(self.cfg.idle_ping_ms) && !pinged {
                match ws.write(Message::Ping(Default::default())) {
                    Err(tungstenite::Error::Io(e)) if is_timeout(&e) => {}
                    Err(e) => return End::Lost(format!("ping: {e}")),
                    Ok(()) => {}
                }
                pinged = true;
            }
            match ws.read() {
                Ok(msg) => {
                    last_rx = Instant::now();
                    pinged = false;
                    match msg {
                        Message::Text(text) => {
                            if let Err(e) = self.on_text(ws, conn_gen, text.as_str()) {
                                return End::Lost(e);
                            }
                        }
                        Message::Close(frame) => {
                            // tungstenite queued the reply; the next read ends the connection.
                            close_reason = Some(match frame {
                                Some(f) => format!("closed by relay ({} {})", u16::from(f.code), f.reason),
                                None => "closed by relay".into(),
                            });
                        }
                        Message::Binary(_) => log!(Level::Warn, "binary frame from relay ignored"),
                        Message::Pong(payload) => self.confirmed(&payload),
                        Message::Ping(_) | Message::Frame(_) => {}
                    }
                }
                Err(tungstenite::Error::Io(e)) if is_timeout(&e) => {
                    // Quiet: pongs queued by an earlier read leave with this flush.
                    match ws.flush() {
                        Err(tungstenite::Error::Io(e)) if is_timeout(&e) => {}
                        Err(e) => return End::Lost(format!("write: {e}")),
                        Ok(()) => {}
                    }
                }
                Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => {
                    return End::Lost(close_reason.unwrap_or_else(|| "closed by relay".into()));
                }
                Err(e) => return End::Lost(close_reason.unwrap_or_else(|| format!("read: {e}"))),
            }
        }
    }

    fn on_text(&mut self, ws: &mut Ws, conn_gen: u64, text: &str) -> Result<(), String> {
        let task = match protocol::parse_server_msg(text) {
            Ok(ServerMsg::Task(task)) => task,
            Ok(ServerMsg::Cancel { task_id }) => {
                if let Some(f) = self.in_flight.get(&(conn_gen, task_id)) {
                    f.canceled.store(true, Ordering::SeqCst);
                }
                return Ok(());
            }
            Ok(ServerMsg::Welcome(w)) => return self.on_welcome(ws, w),
            Ok(ServerMsg::Reconnect) => {
                self.reconnect_now = true;
                return Err("relay asked to reconnect (it is restarting)".into());
            }
            Ok(ServerMsg::Other(kind)) => {
                log!(Level::Warn, "message from relay ignored", r#type = kind);
                return Ok(());
            }
            Err(e) => {
                log!(Level::Warn, "malformed message from relay ignored", error = e);
                return Ok(());
            }
        };
        let max = self.cfg.max_message_bytes;
        let refuse = if self.drain_deadline.is_some() {
            Some("worker shutting down".to_string())
        } else {
            match &task.kind {
                None => Some("unknown task kind: (the payload has no kind)".to_string()),
                Some(kind) if !self.names.contains(kind) => Some(format!("unknown task kind: {kind}")),
                Some(_) => task.invalid.clone(),
            }
        };
        if let Some(error) = refuse {
            log!(Level::Warn, "task refused", task_id = task.task_id, error = error);
            return send(ws, protocol::result_of(&task.task_id, task.attempt, &Err(error), max));
        }
        let key = (conn_gen, task.task_id);
        if self.in_flight.contains_key(&key) {
            log!(Level::Warn, "duplicate task ignored", task_id = key.1);
            return Ok(());
        }
        let canceled = Arc::new(AtomicBool::new(false));
        self.next_job += 1;
        let job_no = self.next_job;
        let attempt = task.attempt;
        let job = Job {
            job: job_no,
            attempt,
            task_id: key.1.clone(),
            kind: task.kind.unwrap_or_default(),
            spec: task.spec,
            canceled: canceled.clone(),
        };
        let Some(pool) = &self.pool else { return Ok(()) };
        match pool.submit(job) {
            Ok(()) => {
                self.jobs.insert(job_no, key.clone());
                self.in_flight.insert(key, Flight { job: job_no, attempt, canceled });
                Ok(())
            }
            Err(job) => {
                let error = format!("worker busy: {} tasks running or queued", self.in_flight.len());
                log!(Level::Warn, "task refused", task_id = job.task_id, error = error);
                send(ws, protocol::result_of(&job.task_id, attempt, &Err(error), max))
            }
        }
    }
}

/// Queues a text frame and flushes it. A signal arriving during the write (SIGTERM, handled
/// by us) interrupts it with EINTR — sockets with a timeout are not restarted by SA_RESTART —
/// and the frame is already queued then, so only the flush is retried.
fn send(ws: &mut Ws, text: String) -> Result<(), String> {
    match ws.write(Message::text(text)) {
        Ok(()) => {}
        Err(tungstenite::Error::Io(e)) if e.kind() == ErrorKind::Interrupted => {}
        Err(e) => return Err(format!("write: {e}")),
    }
    for _ in 0..16 {
        match ws.flush() {
            Ok(()) => return Ok(()),
            Err(tungstenite::Error::Io(e)) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("write: {e}")),
        }
    }
    Err("write: interrupted too often".into())
}

/// A read that timed out (the poll tick) or was interrupted by a signal: nothing is lost,
/// tungstenite and rustls keep partial frames and records; try again.
fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted)
}

/// Closes with 1000 and waits (briefly, bounded) for relay's reply.
fn close(ws: &mut Ws) {
    let frame = CloseFrame { code: CloseCode::Normal, reason: "worker shutting down".into() };
    if ws.close(Some(frame)).is_err() {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(1);
    while Instant::now() < deadline {
        match ws.read() {
            Ok(_) => {}
            Err(tungstenite::Error::Io(e)) if is_timeout(&e) => {
                let _ = ws.flush();
            }
            Err(_) => return,
        }
    }
}

/// Reconnect delays: `initial_ms` doubling per failure up to `max_ms`, each drawn from the
/// upper half of the current step ("equal jitter"), so a fleet of workers that lost relay at
/// the same moment does not come back in lockstep.
pub struct Backoff {
    initial_ms: u64,
    max_ms: u64,
    step_ms: u64,
}

impl Backoff {
    pub fn new(initial_ms: u64, max_ms: u64) -> Backoff {
        let initial_ms = initial_ms.max(1);
        Backoff { initial_ms, max_ms: max_ms.max(initial_ms), step_ms: initial_ms }
    }

    /// The next delay; `random` is any random number.
    pub fn next(&mut self, random: u64) -> u64 {
        let step = self.step_ms;
        let half = step / 2;
        self.step_ms = step.saturating_mul(2).min(self.max_ms);
        half + random % (step - half + 1)
    }

    pub fn reset(&mut self) {
        self.step_ms = self.initial_ms;
    }
}

/// Whether one more result of `bytes` may be kept beside `count` results of `kept_bytes` (SPEC
/// §12: at most `concurrency` results and `max_bytes` in all).
fn may_keep(count: usize, kept_bytes: usize, bytes: usize, concurrency: usize, max_bytes: usize) -> bool {
    count < concurrency && kept_bytes.saturating_add(bytes) <= max_bytes
}

fn random() -> u64 {
    uuid::Uuid::new_v4().as_u64_pair().0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(backoff: &mut Backoff, random: u64, expected: u64) {
        assert_eq!(backoff.next(random), expected, "random={random}");
    }

    #[test]
    fn kept_results_are_bounded_by_count_and_bytes() {
        const MIB: usize = 1 << 20;
        // (kept so far, their bytes, the new result's bytes, concurrency) → kept?
        let table: &[(usize, usize, usize, usize, bool)] = &[
            (0, 0, 10, 16, true),
            (15, 0, 10, 16, true),
            (16, 0, 10, 16, false),
            (0, 64 * MIB - 10, 10, 16, true),
            (0, 64 * MIB - 9, 10, 16, false),
            (0, 0, 64 * MIB + 1, 16, false),
            (0, usize::MAX, 1, 16, false),
        ];
        for &(count, kept, bytes, concurrency, want) in table {
            assert_eq!(
                may_keep(count, kept, bytes, concurrency, 64 * MIB),
                want,
                "{count} {kept} {bytes} {concurrency}"
            );
        }
    }

    #[test]
    fn backoff_doubles_to_the_cap_with_jitter_and_resets() {
        let mut b = Backoff::new(250, 30_000);
        // (random, delay): random 0 gives the lower bound (half the step), u64::MAX-ish the range.
        let table: &[(u64, u64)] = &[
            (0, 125),
            (0, 250),
            (0, 500),
            (500, 1_500),
            (0, 2_000),
            (0, 4_000),
            (0, 8_000),
            (0, 15_000),
            (0, 15_000),
            (15_000, 30_000),
        ];
        for (random, expected) in table {
            check(&mut b, *random, *expected);
        }
        for _ in 0..100 {
            let d = b.next(random());
            assert!((15_000..=30_000).contains(&d), "{d}");
        }
        b.reset();
        check(&mut b, 125, 250);
    }
}
