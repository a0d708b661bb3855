//! The answering side of the load: fake relay workers over WebSocket and NATS queue-group
//! responders, each a thread on a blocking socket that answers every request at once with a fixed
//! ~100-byte result. Also the idle worker connections of the memory scenario.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::os::fd::FromRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use tungstenite::protocol::WebSocketConfig;
use tungstenite::{Message, WebSocket};

use crate::httpc::json_str_field;
use crate::nats::{self, NatsConn, Op};

/// How often a blocked responder looks at the stop flag.
const POLL_STOP_MS: u64 = 100;
/// The subject requesters publish on and the queue group that shares it.
pub const NATS_SUBJECT: &str = "bench.req";
const NATS_QUEUE: &str = "workers";

/// A running set of answering threads; `answered` counts replies sent.
pub struct Pool {
    stop: Arc<AtomicBool>,
    pub answered: Arc<AtomicU64>,
    joins: Vec<JoinHandle<Result<(), String>>>,
}

impl Pool {
    /// Stops every thread and returns the first error any of them hit.
    pub fn stop(self) -> Result<(), String> {
        self.stop.store(true, Ordering::Relaxed);
        let mut first = Ok(());
        for j in self.joins {
            let r = j.join().unwrap_or_else(|_| Err("worker thread panicked".into()));
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// `n` relay workers: connected and said hello before this returns.
    pub fn ws(addr: SocketAddr, token: &str, n: usize, concurrency: u32, result_data: &str) -> Result<Pool, String> {
        let (stop, answered) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let mut joins = Vec::new();
        for i in 0..n {
            let mut ws = ws_connect(addr, token, None)?;
            let hello = format!(r#"{{"type":"hello","concurrency":{concurrency},"version":"relay-bench/{i}"}}"#);
            ws.send(Message::text(hello)).map_err(|e| format!("hello: {e}"))?;
            ws.get_mut().set_read_timeout(Some(Duration::from_millis(POLL_STOP_MS))).map_err(|e| e.to_string())?;
            let (stop, answered, data) = (stop.clone(), answered.clone(), result_data.to_string());
            joins.push(thread::spawn(move || ws_answer(ws, &stop, &answered, &data)));
        }
        Ok(Pool { stop, answered, joins })
    }

    /// `n` NATS responders in one queue group: subscribed (and confirmed) before this returns.
    pub fn nats(addr: SocketAddr, n: usize, reply: &[u8]) -> Result<Pool, String> {
        let (stop, answered) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let mut joins = Vec::new();
        for i in 0..n {
            let mut conn = NatsConn::connect(addr, &format!("responder-{i}"), Duration::from_secs(5))?;
            conn.sub(NATS_SUBJECT, Some(NATS_QUEUE), 1)?;
            conn.sync()?;
            conn.set_read_timeout(Duration::from_millis(POLL_STOP_MS))?;
            let (stop, answered, reply) = (stop.clone(), answered.clone(), reply.to_vec());
            joins.push(thread::spawn(move || nats_answer(conn, &stop, &answered, &reply)));
        }
        Ok(Pool { stop, answered, joins })
    }
}

fn ws_config() -> WebSocketConfig {
    // Small buffers: the memory scenario holds thousands of these in the bench process.
    WebSocketConfig::default().read_buffer_size(4096).write_buffer_size(0).max_message_size(Some(1 << 20))
}

/// Opens a worker WebSocket, from `source` if given (spreads idle connections over 127.0.0.x).
pub fn ws_connect(addr: SocketAddr, token: &str, source: Option<Ipv4Addr>) -> Result<WebSocket<TcpStream>, String> {
    let stream = match source {
        Some(ip) => connect_from(ip, addr)?,
        None => {
            TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| format!("connect {addr}: {e}"))?
        }
    };
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    stream.set_write_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    let url = format!("ws://{addr}/ws?token={token}");
    let (ws, _resp) = tungstenite::client::client_with_config(url.as_str(), stream, Some(ws_config()))
        .map_err(|e| format!("WebSocket handshake: {e}"))?;
    Ok(ws)
}

/// A blocking TCP connection bound to `source` before connecting.
fn connect_from(source: Ipv4Addr, to: SocketAddr) -> Result<TcpStream, String> {
    let SocketAddr::V4(to) = to else { return Err("IPv4 target expected".into()) };
    let sockaddr = |a: SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a descriptor we own; the sockaddr structs outlive the calls;
    // the descriptor goes into a TcpStream (which closes it) or is closed on failure.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(format!("socket: {}", std::io::Error::last_os_error()));
        }
        let from = sockaddr(SocketAddrV4::new(source, 0));
        let dest = sockaddr(to);
        if libc::bind(fd, (&raw const from).cast(), len) != 0 {
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            return Err(format!("bind {source}: {e}"));
        }
        if libc::connect(fd, (&raw const dest).cast(), len) != 0 {
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            return Err(format!("connect {to} from {source}: {e}"));
        }
        Ok(TcpStream::from_raw_fd(fd))
    }
}

pub fn is_timeout(e: &tungstenite::Error) -> bool {
    matches!(e, tungstenite::Error::Io(io) if matches!(io.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
}

fn ws_answer(mut ws: WebSocket<TcpStream>, stop: &AtomicBool, answered: &AtomicU64, data: &str) -> Result<(), String> {
    let mut reply = String::with_capacity(256);
    while !stop.load(Ordering::Relaxed) {
        match ws.read() {
            Ok(Message::Text(text)) => {
                let bytes = text.as_bytes();
                if !text.starts_with(r#"{"type":"task""#) {
                    continue; // cancel: advisory
                }
                let id = json_str_field(bytes, "task_id").ok_or_else(|| format!("task without task_id: {text}"))?;
                reply.clear();
                reply.push_str(r#"{"type":"result","task_id":""#);
                reply.push_str(id);
                reply.push_str(r#"","status":"done","data":"#);
                reply.push_str(data);
                reply.push('}');
                ws.send(Message::text(reply.as_str())).map_err(|e| format!("send result: {e}"))?;
                answered.fetch_add(1, Ordering::Relaxed);
            }
            Ok(_) => {}
            Err(e) if is_timeout(&e) => {}
            Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => return Ok(()),
            Err(e) => {
                // relay closing with 1001 while the harness stops it is not a failure.
                return if stop.load(Ordering::Relaxed) { Ok(()) } else { Err(format!("worker read: {e}")) };
            }
        }
    }
    close_ws(&mut ws);
    Ok(())
}

/// A clean close, bounded in time: send Close, read until the server's Close or a timeout.
fn close_ws(ws: &mut WebSocket<TcpStream>) {
    let _ = ws.close(None);
    let deadline = Instant::now() + Duration::from_millis(500);
    while Instant::now() < deadline {
        match ws.read() {
            Ok(_) => {}
            Err(e) if is_timeout(&e) => {}
            Err(_) => break,
        }
    }
}

fn nats_answer(mut conn: NatsConn, stop: &AtomicBool, answered: &AtomicU64, reply: &[u8]) -> Result<(), String> {
    while !stop.load(Ordering::Relaxed) {
        match conn.read_op() {
            Ok(Op::Msg { reply: Some(to), payload_len, .. }) => {
                conn.consume(payload_len);
                conn.publish(&to, None, reply)?;
                answered.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Op::Msg { payload_len, .. }) => conn.consume(payload_len),
            Ok(Op::Ping) => conn.pong()?,
            Ok(Op::Err(e)) => return Err(format!("nats -ERR {e}")),
            Ok(_) => {}
            Err(nats::Error::Timeout) => {}
            Err(e) => return Err(format!("responder: {e}")),
        }
    }
    Ok(())
}

/// Idle worker connections, kept alive (pings answered) by one thread until dropped.
pub struct Idle {
    stop: Arc<AtomicBool>,
    keeper: Option<JoinHandle<usize>>,
    pub connected: usize,
}

impl Idle {
    /// Opens `n` worker connections that say hello and then only answer pings. Connections go
    /// out from 127.0.0.2, 127.0.0.3, ... (`per_source` each) to avoid exhausting ephemeral ports.
    pub fn open(
        addr: SocketAddr,
        token: &str,
        n: usize,
        per_source: usize,
        threads: usize,
        deadline: Instant,
    ) -> Result<Idle, String> {
        let (tx, rx) = mpsc::channel::<WebSocket<TcpStream>>();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let keeper = thread::spawn(move || keep_alive(rx, &stop2));
        let threads = threads.max(1);
        let connectors: Vec<JoinHandle<Result<usize, String>>> = (0..threads)
            .map(|t| {
                let (tx, token) = (tx.clone(), token.to_string());
                thread::spawn(move || {
                    let mut made = 0;
                    for i in (t..n).step_by(threads) {
                        if Instant::now() > deadline {
                            return Err(format!("deadline reached after {made} connections on this thread"));
                        }
                        // 127.0.0.2, 127.0.0.3, ...: all of 127/8 is loopback.
                        let k = 2 + i / per_source.max(1);
                        let source = Ipv4Addr::new(127, 0, (k >> 8) as u8, (k & 0xff) as u8);
                        let mut ws = ws_connect(addr, &token, Some(source))?;
                        ws.send(Message::text(r#"{"type":"hello","concurrency":16,"version":"relay-bench-idle"}"#))
                            .map_err(|e| format!("hello: {e}"))?;
                        ws.get_mut().set_nonblocking(true).map_err(|e| e.to_string())?;
                        if tx.send(ws).is_err() {
                            return Err("keeper thread gone".into());
                        }
                        made += 1;
                    }
                    Ok(made)
                })
            })
            .collect();
        drop(tx);
        let mut idle = Idle { stop, keeper: Some(keeper), connected: 0 };
        let mut first_err = None;
        for c in connectors {
            match c.join().unwrap_or_else(|_| Err("connector panicked".into())) {
                Ok(made) => idle.connected += made,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(format!("{} idle connections opened, then: {e}", idle.connected)),
            None => Ok(idle),
        }
    }

    /// Stops the keeper, closing every connection; returns how many were still open.
    pub fn close(mut self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        self.keeper.take().and_then(|k| k.join().ok()).unwrap_or(0)
    }
}

impl Drop for Idle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(k) = self.keeper.take() {
            let _ = k.join();
        }
    }
}

/// Every 200 ms: take new connections, read what each has (tungstenite queues the pongs),
/// flush. Returns how many were alive at the end.
fn keep_alive(rx: mpsc::Receiver<WebSocket<TcpStream>>, stop: &AtomicBool) -> usize {
    let mut conns: Vec<WebSocket<TcpStream>> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        while let Ok(ws) = rx.try_recv() {
            conns.push(ws);
        }
        conns.retain_mut(|ws| {
            loop {
                match ws.read() {
                    Ok(_) => {}
                    Err(e) if is_timeout(&e) => break,
                    Err(_) => return false,
                }
            }
            match ws.flush() {
                Ok(()) => true,
                Err(e) => is_timeout(&e),
            }
        });
        thread::sleep(Duration::from_millis(200));
    }
    while let Ok(ws) = rx.try_recv() {
        conns.push(ws);
    }
    conns.len()
}

/// What [`Recorder`] workers saw since the last reset.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    /// Dispatch starts (task frames read), since the reset.
    pub starts: Vec<Duration>,
    /// Each dispatch: the task id and when its frame was read.
    pub dispatched: Vec<(Box<str>, Instant)>,
    pub done: usize,
    /// The most tasks running at once over every worker (sent and not answered yet).
    pub max_running: usize,
    /// The most tasks of one payload `"fk"` (the bench's copy of the task's key) running at once.
    pub max_running_per_key: usize,
    running: usize,
    per_key: std::collections::HashMap<Box<str>, usize>,
    since: Option<Instant>,
}

impl Seen {
    fn started(&mut self, id: &str, key: Option<&str>) {
        let now = Instant::now();
        let at = self.since.map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        self.starts.push(at);
        self.dispatched.push((id.into(), now));
        self.running += 1;
        self.max_running = self.max_running.max(self.running);
        if let Some(k) = key {
            let n = self.per_key.entry(k.into()).or_insert(0);
            *n += 1;
            self.max_running_per_key = self.max_running_per_key.max(*n);
        }
    }

    fn ended(&mut self, key: Option<&str>) {
        self.running = self.running.saturating_sub(1);
        self.done += 1;
        if let Some(k) = key
            && let Some(n) = self.per_key.get_mut(k)
        {
            *n -= 1;
            if *n == 0 {
                self.per_key.remove(k);
            }
        }
    }
}

/// Workers that hold each task `hold` before answering it and record, over all of them, when
/// tasks start and how many run at once (in all, and per key): what a limit lets through, and
/// when each task was dispatched, measured by the workers.
pub struct Recorder {
    stop: Arc<AtomicBool>,
    seen: Arc<std::sync::Mutex<Seen>>,
    joins: Vec<JoinHandle<Result<(), String>>>,
}

impl Recorder {
    /// `n` workers spread round robin over `addrs` (one relay node each), recording together.
    /// With a `pace`, each worker answers at most one task per `pace` (the workers' phases
    /// staggered), so that together they drain a backlog at a steady `n / pace` per second, not
    /// in waves of every slot at once; `Duration::ZERO`: each task is answered once held.
    pub fn ws_on(
        addrs: &[SocketAddr],
        token: &str,
        n: usize,
        concurrency: u32,
        hold: Duration,
        pace: Duration,
    ) -> Result<Recorder, String> {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(std::sync::Mutex::new(Seen { since: Some(Instant::now()), ..Seen::default() }));
        let mut recorder = Recorder { stop, seen, joins: Vec::new() };
        for i in 0..n {
            let addr = *addrs.get(i % addrs.len().max(1)).ok_or("no address to connect workers to")?;
            let mut ws = ws_connect(addr, token, None)?;
            let hello =
                format!(r#"{{"type":"hello","concurrency":{concurrency},"version":"relay-bench-recorder/{i}"}}"#);
            ws.send(Message::text(hello)).map_err(|e| format!("hello: {e}"))?;
            let tick = if pace.is_zero() { Duration::from_millis(2) } else { (pace / 2).min(Duration::from_millis(2)) };
            ws.get_mut().set_read_timeout(Some(tick.max(Duration::from_micros(500)))).map_err(|e| e.to_string())?;
            let (stop, seen) = (recorder.stop.clone(), recorder.seen.clone());
            let phase = Instant::now() + pace * i as u32 / n.max(1) as u32;
            recorder.joins.push(thread::spawn(move || record(ws, &stop, &seen, hold, pace, phase)));
        }
        Ok(recorder)
    }

    /// Forgets what was seen (the workers must be idle).
    pub fn reset(&self) {
        if let Ok(mut s) = self.seen.lock() {
            *s = Seen { since: Some(Instant::now()), ..Seen::default() };
        }
    }

    /// Waits until `n` tasks were answered since the reset; what was seen.
    pub fn wait_done(&self, n: usize, within: Duration) -> Result<Seen, String> {
        let deadline = Instant::now() + within;
        loop {
            {
                // (No copy while waiting: `dispatched` may hold 100,000 entries.)
                let s = self.seen.lock().map_err(|_| "poisoned")?;
                if s.done >= n {
                    return Ok(s.clone());
                }
                if Instant::now() > deadline {
                    return Err(format!("{} of {n} tasks answered within {within:?}", s.done));
                }
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn stop(mut self) -> Result<(), String> {
        self.stop.store(true, Ordering::Relaxed);
        let mut first = Ok(());
        for j in std::mem::take(&mut self.joins) {
            let r = j.join().unwrap_or_else(|_| Err("recorder thread panicked".into()));
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// One recording worker: each task is held `hold`, then answered `done`; with a `pace`, one
/// answer per `pace` at most (answer k at max(its hold's end, answer k−1's time + pace), the
/// first no earlier than `phase`).
fn record(
    mut ws: WebSocket<TcpStream>,
    stop: &AtomicBool,
    seen: &std::sync::Mutex<Seen>,
    hold: Duration,
    pace: Duration,
    phase: Instant,
) -> Result<(), String> {
    // When the next answer may go at the earliest (the last one's scheduled time + pace).
    let mut next_slot = phase;
    let mut held: std::collections::VecDeque<(Instant, String, Option<String>)> = std::collections::VecDeque::new();
    while !stop.load(Ordering::Relaxed) {
        match ws.read() {
            Ok(Message::Text(text)) if text.starts_with(r#"{"type":"task""#) => {
                let id = json_str_field(text.as_bytes(), "task_id").unwrap_or_default().to_string();
                let key = json_str_field(text.as_bytes(), "fk").map(str::to_string);
                seen.lock().map_err(|_| "poisoned")?.started(&id, key.as_deref());
                held.push_back((Instant::now() + hold, id, key));
            }
            Ok(_) => {}
            Err(e) if is_timeout(&e) => {}
            Err(_) if stop.load(Ordering::Relaxed) => return Ok(()),
            Err(e) => return Err(format!("recorder read: {e}")),
        }
        while let Some(&(due, _, _)) = held.front() {
            let at = if pace.is_zero() { due } else { due.max(next_slot) };
            if at > Instant::now() {
                break;
            }
            next_slot = at + pace;
            let Some((_, id, key)) = held.pop_front() else { break };
            seen.lock().map_err(|_| "poisoned")?.ended(key.as_deref());
            let reply = format!(r#"{{"type":"result","task_id":"{id}","status":"done","data":null}}"#);
            ws.send(Message::text(reply)).map_err(|e| format!("send result: {e}"))?;
        }
    }
    close_ws(&mut ws);
    Ok(())
}
