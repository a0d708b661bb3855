//! NATS JetStream as the durable peer of relay (issue 9): a work-queue stream on file storage,
//! one durable pull consumer shared by the workers, explicit acks. A requester publishes its
//! task with a reply subject (the PubAck comes back there once JetStream has stored it) and a
//! `Bench-Reply` header naming its answer inbox; it waits for the PubAck and for the answer. A
//! worker keeps pull requests open on the consumer, answers each message on its `Bench-Reply`
//! subject and acks it (`+ACK` on the message's reply subject), in one write. The same closed
//! loop and the same ~100-byte payload and answer as relay's and core NATS's scenarios.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::load::Client;
use crate::nats::{self, NatsConn, Op, header_block, header_status, header_value, js};
use crate::procs::{self, Server};

pub const STREAM: &str = "BENCH";
pub const SUBJECT: &str = "bench.js";
const DURABLE: &str = "workers";
/// Messages one pull request asks for; a worker asks again when fewer than half are still due.
const PULL_BATCH: i64 = 64;
/// Unacknowledged messages the consumer allows (far above what 64 closed-loop clients keep).
const MAX_ACK_PENDING: u64 = 20_000;
const READY_TIMEOUT: Duration = Duration::from_secs(10);
const POLL_STOP_MS: u64 = 100;
const ACK_SID: u64 = 2;
const ANSWER_SID: u64 = 3;
const INBOX_SID: u64 = 1;

/// How nats-server syncs its JetStream files.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Sync {
    /// The server's default: the PubAck leaves before any fsync (files are synced every 2 min).
    Default,
    /// `jetstream { sync_interval: always }`: every write is synced before the PubAck.
    Always,
}

/// Starts `binary` with JetStream storing in `store` (a fresh directory on a real disk).
pub fn start(binary: &Path, store: &Path, sync: Sync) -> Result<Server, String> {
    let mut cmd = Command::new(binary);
    cmd.args(["-a", "127.0.0.1", "-p", "-1"]);
    match sync {
        Sync::Default => {
            cmd.arg("-js").arg("-sd").arg(store);
        }
        Sync::Always => {
            let conf = store.join("js.conf");
            let text = format!("jetstream {{\n  store_dir: {:?}\n  sync_interval: always\n}}\n", store.join("js"));
            std::fs::write(&conf, text).map_err(|e| format!("{}: {e}", conf.display()))?;
            cmd.arg("-c").arg(conf);
        }
    }
    Server::start("nats-server (JetStream)", cmd, procs::nats_listening, READY_TIMEOUT)
        .map_err(|e| format!("{e}\n(binary {})", binary.display()))
}

/// `nats-server --version`, e.g. `v2.9.10`.
pub fn version(binary: &Path) -> String {
    Command::new(binary)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().trim_start_matches("nats-server: ").to_string())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "unknown version".into())
}

/// Creates the stream and the consumer, retrying while JetStream is not ready (503 no responders).
pub fn setup(addr: SocketAddr) -> Result<(), String> {
    let mut conn = NatsConn::connect_with(addr, "bench-admin", Duration::from_secs(5), true)?;
    let inbox = "_INBOX.bench.admin";
    js::api_inbox(&mut conn, inbox)?;
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        match js::create_work_queue(&mut conn, inbox, STREAM, SUBJECT) {
            Ok(()) => break,
            Err(e) if e.contains("status 503") && Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(format!("creating the stream: {e}")),
        }
    }
    js::create_pull_consumer(&mut conn, inbox, STREAM, DURABLE, MAX_ACK_PENDING)
        .map_err(|e| format!("creating the consumer: {e}"))
}

/// Messages still in the stream (not yet acked), from `$JS.API.STREAM.INFO`.
pub fn stream_messages(addr: SocketAddr) -> Result<u64, String> {
    let mut conn = NatsConn::connect_with(addr, "bench-admin", Duration::from_secs(5), true)?;
    let inbox = "_INBOX.bench.info";
    js::api_inbox(&mut conn, inbox)?;
    let text = js::api(&mut conn, inbox, &format!("$JS.API.STREAM.INFO.{STREAM}"), "")?;
    let state = text.find("\"state\"").map(|i| &text[i..]).ok_or_else(|| format!("no state in {text}"))?;
    crate::scenarios::json_num_field(state.as_bytes(), "messages").ok_or_else(|| format!("no message count in {text}"))
}

/// The workers: `n` threads, each on its own connection with pull requests open on the consumer.
pub struct Workers {
    stop: Arc<AtomicBool>,
    pub answered: Arc<AtomicU64>,
    joins: Vec<JoinHandle<Result<(), String>>>,
}

impl Workers {
    pub fn start(addr: SocketAddr, n: usize, reply: &[u8]) -> Result<Workers, String> {
        let (stop, answered) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let mut joins = Vec::new();
        for i in 0..n {
            let mut conn = NatsConn::connect_with(addr, &format!("js-worker-{i}"), Duration::from_secs(5), true)?;
            let inbox = format!("_INBOX.bench.jsw.{i}");
            conn.sub(&inbox, None, INBOX_SID)?;
            conn.sync()?;
            conn.set_read_timeout(Duration::from_millis(POLL_STOP_MS))?;
            let (stop, answered, reply) = (stop.clone(), answered.clone(), reply.to_vec());
            joins.push(thread::spawn(move || work(conn, &inbox, &stop, &answered, &reply)));
        }
        Ok(Workers { stop, answered, joins })
    }

    /// Stops every worker and returns the first error any of them hit.
    pub fn stop(self) -> Result<(), String> {
        self.stop.store(true, Ordering::Relaxed);
        let mut first = Ok(());
        for j in self.joins {
            let r = j.join().unwrap_or_else(|_| Err("JetStream worker panicked".into()));
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

fn work(mut conn: NatsConn, inbox: &str, stop: &AtomicBool, answered: &AtomicU64, reply: &[u8]) -> Result<(), String> {
    let next = js::next_subject(STREAM, DURABLE);
    let pull = format!("{{\"batch\":{PULL_BATCH}}}");
    // Messages asked for and not delivered yet, over every pull request this worker has open.
    let mut due: i64 = 0;
    while !stop.load(Ordering::Relaxed) {
        if due <= PULL_BATCH / 2 {
            conn.queue_publish(&next, Some(inbox), None, pull.as_bytes());
            conn.flush()?;
            due += PULL_BATCH;
        }
        match conn.read_op() {
            Ok(Op::Msg { sid: INBOX_SID, reply: Some(ack), header_len, payload_len }) => {
                let head = &conn.payload(payload_len)[..header_len];
                let to = header_value(head, "Bench-Reply").map(str::to_string);
                conn.consume(payload_len);
                due -= 1;
                let to = to.ok_or("a JetStream message without its Bench-Reply header")?;
                conn.queue_publish(&to, None, None, reply);
                conn.queue_publish(&ack, None, None, b"+ACK");
                conn.flush()?;
                answered.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Op::Msg { sid: INBOX_SID, reply: None, header_len, payload_len }) => {
                // A status for a pull request: 408/409 end it with Nats-Pending-Messages undelivered.
                let head = &conn.payload(payload_len)[..header_len];
                let status = header_status(head);
                let left = header_value(head, "Nats-Pending-Messages").and_then(|v| v.parse::<i64>().ok());
                conn.consume(payload_len);
                match (status, left) {
                    (Some(100), _) => {} // heartbeat
                    (Some(_), Some(n)) => due -= n,
                    (Some(code), None) => return Err(format!("pull request ended with status {code}")),
                    (None, _) => {}
                }
            }
            Ok(Op::Msg { payload_len, .. }) => conn.consume(payload_len),
            Ok(Op::Ping) => conn.pong()?,
            Ok(Op::Err(e)) => return Err(format!("nats -ERR {e}")),
            Ok(_) => {}
            Err(nats::Error::Timeout) => {}
            Err(e) => return Err(format!("JetStream worker: {e}")),
        }
    }
    Ok(())
}

/// A requester: its own connection, a PubAck inbox and an answer inbox; one task in flight.
pub struct Requester {
    conn: NatsConn,
    ack_inbox: String,
    headers: Vec<u8>,
    payload: Arc<Vec<u8>>,
}

impl Requester {
    pub fn connect(
        addr: SocketAddr,
        i: usize,
        payload: Arc<Vec<u8>>,
        io_timeout: Duration,
    ) -> Result<Requester, String> {
        let mut conn = NatsConn::connect_with(addr, &format!("js-requester-{i}"), io_timeout, true)?;
        let ack_inbox = format!("_INBOX.bench.jsc.{i}.ack");
        let answer_inbox = format!("_INBOX.bench.jsc.{i}.ans");
        conn.sub(&ack_inbox, None, ACK_SID)?;
        conn.sub(&answer_inbox, None, ANSWER_SID)?;
        conn.sync()?;
        let headers = header_block(&[("Bench-Reply", &answer_inbox)]);
        Ok(Requester { conn, ack_inbox, headers, payload })
    }
}

impl Client for Requester {
    /// Publishes one task and returns once both its PubAck and its answer are in (the answer may
    /// come first: the worker can be quicker than the PubAck's way back).
    fn call(&mut self) -> Result<(), String> {
        self.conn.queue_publish(SUBJECT, Some(&self.ack_inbox), Some(&self.headers), &self.payload);
        self.conn.flush()?;
        let (mut acked, mut answered) = (false, false);
        while !(acked && answered) {
            match self.conn.read_op()? {
                Op::Msg { sid: ACK_SID, header_len, payload_len, .. } => {
                    let all = self.conn.payload(payload_len);
                    let bad = header_len > 0 || all.windows(8).any(|w| w == b"\"error\"");
                    let text = bad.then(|| String::from_utf8_lossy(all).into_owned());
                    self.conn.consume(payload_len);
                    if let Some(text) = text {
                        return Err(format!("publish not acknowledged: {text}"));
                    }
                    acked = true;
                }
                Op::Msg { sid: ANSWER_SID, payload_len, .. } => {
                    self.conn.consume(payload_len);
                    answered = true;
                }
                Op::Msg { payload_len, .. } => self.conn.consume(payload_len),
                Op::Ping => self.conn.pong()?,
                Op::Err(e) => return Err(format!("-ERR {e}")),
                Op::Pong | Op::Ok | Op::Info => {}
            }
        }
        Ok(())
    }
}
