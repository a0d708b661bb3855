//! The event loop: one mio `Poll`, the listener, the connection slots, the timer wheel's clock.
//! The only module that makes syscalls on sockets or reads the clock.
//!
//! Invariants:
//! - readiness is edge-triggered: a socket is read until `WouldBlock`, or `read_more` is set and
//!   the connection is revisited (`again`) once whatever stopped the read is gone;
//! - output is appended to a connection's buffer and written once per loop turn (`dirty`), so
//!   several responses or frames leave in one syscall;
//! - a token carries the slot's generation: events, timers and core references to a closed
//!   connection are dropped, never applied to the slot's next occupant;
//! - nothing here blocks: no sleeps, no disk, no blocking sockets.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};
use tungstenite::Message;
use tungstenite::protocol::CloseFrame;
use tungstenite::protocol::frame::coding::CloseCode;

use crate::api::{Api, Handled};
use crate::config::Config;
use crate::conn::{Conn, Phase, State, Ws, WsIo, ws_context};
use crate::dispatch::{Core, CoreConfig, Io, Timer};
use crate::http::{self, ChunkedDecoder, Framing, Head, MAX_HEAD_BYTES, Method, Response};
use crate::log::Level;
use crate::tasks::ConnRef;

const LISTENER: Token = Token(usize::MAX);
const WAKER: Token = Token(usize::MAX - 1);

/// Connections accepted per loop turn before others get their turn.
const ACCEPT_BATCH: usize = 256;
/// Requests (or WebSocket messages) handled per connection per turn.
const MAX_ITEMS_PER_TURN: usize = 64;
/// Unwritten response bytes beyond which a connection's further requests wait.
const MAX_HTTP_BACKLOG_BYTES: usize = 1 << 20;
/// Pipelined bytes buffered while a request is held.
const MAX_HELD_INPUT_BYTES: usize = 64 * 1024;
/// Output buffers above this are released once drained.
const KEEP_OUT_CAPACITY: usize = 64 * 1024;
/// How long a closing connection waits for the peer's FIN.
const LINGER_MS: u64 = 2_000;
/// Retry delay after the process ran out of file descriptors.
const ACCEPT_BACKOFF_MS: u64 = 100;

const CONTINUE_100: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

fn token(r: ConnRef) -> Token {
    Token((r.generation as usize) << 32 | r.slot as usize)
}

fn conn_ref(t: Token) -> ConnRef {
    ConnRef { slot: (t.0 & 0xFFFF_FFFF) as u32, generation: (t.0 >> 32) as u32 }
}

struct Slot {
    generation: u32,
    conn: Option<Conn>,
}

/// Connection slots with generations, and a free list.
#[derive(Default)]
pub struct Conns {
    slots: Vec<Slot>,
    free: Vec<u32>,
    len: usize,
}

impl Conns {
    fn insert(&mut self, conn: Conn) -> ConnRef {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Slot { generation: 0, conn: None });
                (self.slots.len() - 1) as u32
            }
        };
        let entry = &mut self.slots[slot as usize];
        entry.generation = entry.generation.wrapping_add(1);
        entry.conn = Some(conn);
        self.len += 1;
        ConnRef { slot, generation: entry.generation }
    }

    fn get_mut(&mut self, r: ConnRef) -> Option<&mut Conn> {
        let entry = self.slots.get_mut(r.slot as usize)?;
        if entry.generation != r.generation {
            return None;
        }
        entry.conn.as_mut()
    }

    fn remove(&mut self, r: ConnRef) -> Option<Conn> {
        let entry = self.slots.get_mut(r.slot as usize)?;
        if entry.generation != r.generation {
            return None;
        }
        let conn = entry.conn.take()?;
        self.free.push(r.slot);
        self.len -= 1;
        Some(conn)
    }

    fn refs(&self) -> Vec<ConnRef> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.conn.is_some())
            .map(|(i, s)| ConnRef { slot: i as u32, generation: s.generation })
            .collect()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Queues a connection for the end-of-turn write (takes the flag alone, so callers may hold
/// other fields of the connection).
fn mark_dirty(in_dirty: &mut bool, r: ConnRef, dirty: &mut Vec<ConnRef>) {
    if !*in_dirty {
        *in_dirty = true;
        dirty.push(r);
    }
}

/// The core's window on the connections (see [`Io`]). It never closes or removes one.
struct Wire<'a> {
    conns: &'a mut Conns,
    dirty: &'a mut Vec<ConnRef>,
    again: &'a mut Vec<ConnRef>,
    max_ws_out_bytes: usize,
    shutting_down: bool,
}

impl Io for Wire<'_> {
    fn send_text(&mut self, worker: ConnRef, text: String) -> bool {
        let Some(conn) = self.conns.get_mut(worker) else { return false };
        if conn.pending_out() + text.len() > self.max_ws_out_bytes || conn.close_after_flush {
            return false;
        }
        let State::Ws(ws) = &mut conn.state else { return false };
        let mut io = WsIo { stream: &mut conn.stream, out: &mut conn.out, got_bytes: false };
        if ws.ctx.write(&mut io, Message::text(text)).is_err() {
            return false;
        }
        mark_dirty(&mut conn.in_dirty, worker, self.dirty);
        true
    }

    fn reply(&mut self, r: ConnRef, response: Response) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        let State::Http(http) = &mut conn.state else { return };
        let Phase::Held { keep_alive, head_only } = http.phase else { return };
        let close = !keep_alive || response.close || self.shutting_down;
        write_response(&mut conn.out, response, close, head_only);
        http.phase = Phase::Idle;
        conn.close_after_flush |= close;
        mark_dirty(&mut conn.in_dirty, r, self.dirty);
        // Pipelined requests may be waiting behind the held one.
        self.again.push(r);
    }
}

fn write_response(out: &mut Vec<u8>, mut response: Response, close: bool, head_only: bool) {
    response.close = close;
    response.write_to(out, head_only);
}

pub struct Server {
    poll: Poll,
    listener: Option<TcpListener>,
    pub local_addr: SocketAddr,
    conns: Conns,
    core: Core,
    api: Api,
    cfg: Config,
    started: Instant,
    now_ms: u64,
    scratch: Vec<u8>,
    dirty: Vec<ConnRef>,
    again: Vec<ConnRef>,
    fired: Vec<Timer>,
    accept_pending: bool,
    shutdown_flag: Arc<AtomicBool>,
    shutdown_started: bool,
    max_ws_out_bytes: usize,
    /// Input an HTTP connection may buffer: a head, the largest body, and a little more.
    http_input_cap: usize,
}

impl Server {
    /// Binds the listener and prepares the loop. Returns the server and the waker that
    /// helper threads (signals, later disk work) use to wake it.
    pub fn bind(cfg: Config, shutdown_flag: Arc<AtomicBool>) -> io::Result<(Server, Arc<Waker>)> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let mut listener = TcpListener::bind(SocketAddr::new(cfg.bind, cfg.port))?;
        poll.registry().register(&mut listener, LISTENER, Interest::READABLE)?;
        let local_addr = listener.local_addr()?;
        let started = Instant::now();
        let core = Core::new(
            CoreConfig {
                task_timeout_ms: cfg.task_timeout_ms,
                max_retries: cfg.max_retries,
                wait_timeout_ms: cfg.wait_timeout_ms,
                task_ttl_ms: cfg.task_ttl_ms,
                max_pending: cfg.max_pending,
            },
            0,
            crate::timefmt::wall_ms(),
        );
        let api = Api {
            auth: crate::auth::Auth::new(&cfg.api_token, &cfg.worker_token)
                .with_scoped_tokens(cfg.token_secret.as_deref(), &cfg.token_store),
            max_message_bytes: cfg.max_message_bytes,
            max_batch_bytes: cfg.max_batch_bytes,
        };
        let max_ws_out_bytes = cfg.max_message_bytes.saturating_mul(4).saturating_add(64 * 1024);
        let cfg_max_body = cfg.max_message_bytes;
        let server = Server {
            poll,
            listener: Some(listener),
            local_addr,
            conns: Conns::default(),
            core,
            api,
            cfg,
            started,
            now_ms: 0,
            scratch: vec![0; 64 * 1024],
            dirty: Vec::new(),
            again: Vec::new(),
            fired: Vec::new(),
            accept_pending: false,
            shutdown_flag,
            shutdown_started: false,
            max_ws_out_bytes,
            http_input_cap: MAX_HEAD_BYTES + cfg_max_body + 4096,
        };
        Ok((server, waker))
    }

    fn tick_clock(&mut self) {
        self.now_ms = self.started.elapsed().as_millis() as u64;
        self.core.now_ms = self.now_ms;
        self.core.wall_ms = crate::timefmt::wall_ms();
    }

    fn wire(&mut self) -> (Wire<'_>, &mut Core) {
        (
            Wire {
                conns: &mut self.conns,
                dirty: &mut self.dirty,
                again: &mut self.again,
                max_ws_out_bytes: self.max_ws_out_bytes,
                shutting_down: self.shutdown_started,
            },
            &mut self.core,
        )
    }

    /// Runs until a graceful shutdown completes.
    pub fn run(mut self) -> io::Result<()> {
        let mut events = Events::with_capacity(1024);
        loop {
            self.tick_clock();
            let timeout = if !self.again.is_empty() || self.accept_pending {
                Some(Duration::ZERO)
            } else {
                self.core.wheel.next_wakeup_ms().map(|at| Duration::from_millis(at.saturating_sub(self.now_ms)))
            };
            if let Err(e) = self.poll.poll(&mut events, timeout)
                && e.kind() != io::ErrorKind::Interrupted
            {
                return Err(e);
            }
            self.tick_clock();
            for event in events.iter() {
                match event.token() {
                    LISTENER => self.accept_pending = true,
                    WAKER => {}
                    t => {
                        let r = conn_ref(t);
                        if event.is_readable() || event.is_read_closed() || event.is_error() {
                            self.on_readable(r);
                        }
                        if event.is_writable() {
                            self.flush(r);
                        }
                    }
                }
            }
            if self.shutdown_flag.load(Ordering::Relaxed) && !self.shutdown_started {
                self.begin_shutdown();
            }
            if self.accept_pending && self.listener.is_some() {
                self.accept_batch();
            }
            self.fire_timers();
            self.process_again();
            self.flush_dirty();
            if self.shutdown_started && self.conns.is_empty() {
                crate::log!(Level::Info, "shutdown complete");
                return Ok(());
            }
            if self.shutdown_started && self.core.wheel.is_empty() {
                // Nothing left that could ever end the remaining connections.
                return Ok(());
            }
        }
    }

    // ----- accepting -------------------------------------------------------------------------

    fn accept_batch(&mut self) {
        for _ in 0..ACCEPT_BATCH {
            let Some(listener) = &self.listener else { return };
            match listener.accept() {
                Ok((stream, addr)) => self.admit(stream, addr),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.accept_pending = false;
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)) {
                        crate::log!(Level::Warn, "accept failed; pausing", error = e);
                        self.accept_pending = false;
                        self.core.wheel.arm(self.now_ms + ACCEPT_BACKOFF_MS, Timer::AcceptResume);
                        return;
                    }
                    // ECONNABORTED and friends concern one connection only.
                }
            }
        }
        // More may be queued; come back next turn without waiting.
        self.accept_pending = true;
    }

    fn admit(&mut self, stream: TcpStream, addr: SocketAddr) {
        if self.conns.len() >= self.cfg.max_connections {
            self.core.metrics.connections_refused += 1;
            crate::log!(Level::Debug, "connection refused: MAX_CONNECTIONS reached", peer = addr);
            return; // dropping the stream closes it at once
        }
        let _ = stream.set_nodelay(true);
        let r = self.conns.insert(Conn::new(stream, addr.ip()));
        let Some(conn) = self.conns.get_mut(r) else { return };
        if self.poll.registry().register(&mut conn.stream, token(r), Interest::READABLE | Interest::WRITABLE).is_err() {
            self.conns.remove(r);
            return;
        }
        let deadline = self.now_ms + self.cfg.header_timeout_ms;
        self.set_deadline(r, deadline);
        crate::log!(Level::Trace, "connection accepted", peer = addr);
    }

    // ----- timers ----------------------------------------------------------------------------

    fn set_deadline(&mut self, r: ConnRef, at: u64) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        conn.deadline_ms = at;
        if at == u64::MAX {
            return; // an armed timer will find nothing due and not re-arm
        }
        match conn.timer {
            Some((armed, _)) if armed <= at => {}
            _ => {
                if let Some((_, h)) = conn.timer.take() {
                    self.core.wheel.cancel(h);
                }
                conn.timer = Some((at, self.core.wheel.arm(at, Timer::Conn(r))));
            }
        }
    }

    fn fire_timers(&mut self) {
        let mut fired = std::mem::take(&mut self.fired);
        self.core.wheel.advance(self.now_ms, &mut fired);
        for timer in fired.drain(..) {
            match timer {
                Timer::Conn(r) => self.on_conn_timer(r),
                Timer::AcceptResume => self.accept_pending = true,
                Timer::ShutdownDeadline => {
                    crate::log!(
                        Level::Warn,
                        "shutdown timeout: closing remaining connections",
                        open = self.conns.len()
                    );
                    for r in self.conns.refs() {
                        self.close_now(r, "shutdown timeout");
                    }
                }
                other => {
                    let (mut wire, core) = self.wire();
                    core.on_timer(&mut wire, other);
                }
            }
        }
        self.fired = fired;
    }

    fn on_conn_timer(&mut self, r: ConnRef) {
        let now = self.now_ms;
        let Some(conn) = self.conns.get_mut(r) else { return };
        conn.timer = None;
        if conn.deadline_ms == u64::MAX {
            return;
        }
        if now < conn.deadline_ms {
            let at = conn.deadline_ms;
            conn.timer = Some((at, self.core.wheel.arm(at, Timer::Conn(r))));
            return;
        }
        match &mut conn.state {
            State::Http(http) => match http.phase {
                Phase::Idle => {
                    if conn.pending_out() > 0 {
                        // Still writing a response to a slow reader: not idle yet.
                        let at = now + self.cfg.idle_timeout_ms;
                        self.set_deadline(r, at);
                    } else {
                        self.close_now(r, "idle");
                    }
                }
                Phase::Head | Phase::Body { .. } => {
                    crate::log!(Level::Debug, "request timeout", peer = conn.peer_ip);
                    self.respond_and_close(r, crate::api::error(408, "request not complete within HEADER_TIMEOUT"));
                }
                Phase::Held { .. } => {}
            },
            State::Ws(ws) => {
                if now >= ws.last_seen_ms + self.cfg.pong_wait_ms {
                    crate::log!(Level::Info, "worker silent past PONG_WAIT", peer = conn.peer_ip);
                    self.close_now(r, "no pong within PONG_WAIT");
                    return;
                }
                if now >= ws.next_ping_ms {
                    let mut io = WsIo { stream: &mut conn.stream, out: &mut conn.out, got_bytes: false };
                    let _ = ws.ctx.write(&mut io, Message::Ping(Default::default()));
                    ws.next_ping_ms = now + self.cfg.ping_interval_ms;
                    mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
                }
                let State::Ws(ws) = &conn.state else { return };
                let at = ws.next_ping_ms.min(ws.last_seen_ms + self.cfg.pong_wait_ms);
                self.set_deadline(r, at);
            }
            State::Closing => self.close_now(r, "linger over"),
        }
    }

    // ----- reading ---------------------------------------------------------------------------

    fn on_readable(&mut self, r: ConnRef) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        match conn.state {
            State::Http(_) => self.read_http(r),
            State::Ws(_) => self.read_ws(r),
            State::Closing => self.drain_closing(r),
        }
    }

    fn read_http(&mut self, r: ConnRef) {
        loop {
            let Some(conn) = self.conns.get_mut(r) else { return };
            let State::Http(http) = &mut conn.state else { return };
            // The most input the connection may buffer in its phase.
            let cap = match http.phase {
                Phase::Held { .. } => MAX_HELD_INPUT_BYTES,
                _ => self.http_input_cap,
            };
            let backlog = conn.out.len() - conn.out_pos;
            let blocked = conn.close_after_flush || backlog > MAX_HTTP_BACKLOG_BYTES || http.buf.len() >= cap;
            if blocked {
                conn.read_more = true;
                return;
            }
            let room = (cap - http.buf.len()).min(self.scratch.len());
            match conn.stream.read(&mut self.scratch[..room]) {
                Ok(0) => {
                    // The peer closed its side. A held request can no longer be answered.
                    self.close_now(r, "peer closed");
                    return;
                }
                Ok(n) => {
                    http.buf.extend_from_slice(&self.scratch[..n]);
                    self.process_http(r);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    conn.read_more = false;
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.close_now(r, "read error");
                    return;
                }
            }
        }
    }

    /// Handles every complete request in the connection's buffer, in order.
    fn process_http(&mut self, r: ConnRef) {
        for _ in 0..MAX_ITEMS_PER_TURN {
            if !self.step_http(r) {
                return;
            }
        }
        // A turn's worth done; the rest next turn.
        self.again.push(r);
    }

    /// One step of the HTTP state machine. `true` if it made progress and may continue.
    fn step_http(&mut self, r: ConnRef) -> bool {
        let now = self.now_ms;
        let Some(conn) = self.conns.get_mut(r) else { return false };
        if conn.close_after_flush || conn.pending_out() > MAX_HTTP_BACKLOG_BYTES {
            return false;
        }
        let State::Http(http) = &mut conn.state else { return false };
        match &mut http.phase {
            Phase::Held { .. } => false,
            Phase::Idle | Phase::Head => {
                if http.buf.is_empty() {
                    return false;
                }
                if matches!(http.phase, Phase::Idle) {
                    http.phase = Phase::Head;
                    let at = now + self.cfg.header_timeout_ms;
                    self.set_deadline(r, at);
                    return true;
                }
                let Some(end) = http::find_head_end(&http.buf, http.scanned) else {
                    if http.buf.len() > MAX_HEAD_BYTES {
                        self.respond_and_close(r, crate::api::error(431, "request head over 16 KiB"));
                    } else {
                        http.scanned = http.buf.len();
                    }
                    return false;
                };
                http.scanned = 0;
                let head = match http::parse_head(&http.buf, end) {
                    Ok(h) => h,
                    Err(e) => {
                        let status = e.status();
                        let msg = e.to_string();
                        self.respond_and_close(r, crate::api::error(status, &msg));
                        return false;
                    }
                };
                http.buf.drain(..end);
                http.requests += 1;
                http.client_ip = self.cfg.trusted_proxies.client_ip(
                    conn.peer_ip,
                    head.forwarded_for.as_deref(),
                    head.real_ip.as_deref(),
                );
                if let Some(response) = self.api.precheck(&head, self.core.wall_ms) {
                    self.answer_early(r, &head, response);
                    return true;
                }
                let body_ready = match head.framing {
                    Framing::Empty => true,
                    Framing::Length(n) => http.buf.len() as u64 >= n,
                    Framing::Chunked => false,
                };
                if head.expect_continue && !body_ready && head.minor_version == 1 {
                    conn.out.extend_from_slice(CONTINUE_100);
                    mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
                }
                let chunked =
                    (head.framing == Framing::Chunked).then(|| Box::new((ChunkedDecoder::default(), Vec::new())));
                if let Framing::Length(n) = head.framing {
                    http.buf.reserve((n as usize).saturating_sub(http.buf.len()));
                }
                http.phase = Phase::Body { head: Box::new(head), chunked };
                true
            }
            Phase::Body { head, chunked } => {
                let body = match head.framing {
                    Framing::Empty => Vec::new(),
                    Framing::Length(n) => {
                        let n = n as usize;
                        if http.buf.len() < n {
                            return false;
                        }
                        let rest = http.buf.split_off(n);
                        std::mem::replace(&mut http.buf, rest)
                    }
                    Framing::Chunked => {
                        let limit = self.api.body_limit(crate::api::Route::of(&head.path));
                        let Some(state) = chunked.as_mut() else { return false };
                        let (decoder, decoded) = &mut **state;
                        match decoder.decode(&http.buf, decoded, limit) {
                            Ok(used) => {
                                http.buf.drain(..used);
                            }
                            Err(http::ChunkError::TooLarge) => {
                                let msg = format!("body is over the limit of {limit} bytes");
                                self.respond_and_close(r, crate::api::error(413, &msg));
                                return false;
                            }
                            Err(http::ChunkError::Malformed(why)) => {
                                self.respond_and_close(
                                    r,
                                    crate::api::error(400, &format!("malformed chunked body: {why}")),
                                );
                                return false;
                            }
                        }
                        if !decoder.is_done() {
                            return false;
                        }
                        std::mem::take(decoded)
                    }
                };
                let Phase::Body { head, .. } = std::mem::replace(&mut http.phase, Phase::Idle) else {
                    return false;
                };
                self.complete_request(r, &head, &body);
                true
            }
        }
    }

    /// The head alone decided the answer. The connection stays usable only if the body (if
    /// any) is already here to be skipped.
    fn answer_early(&mut self, r: ConnRef, head: &Head, response: Response) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        let State::Http(http) = &mut conn.state else { return };
        let body_skipped = match head.framing {
            Framing::Empty => true,
            Framing::Length(n) if http.buf.len() as u64 >= n => {
                http.buf.drain(..n as usize);
                true
            }
            _ => false,
        };
        let close = !body_skipped || !head.keep_alive || self.shutdown_started;
        self.core.metrics.http_request(response.status);
        crate::log!(
            Level::Debug,
            "request",
            method = format!("{:?}", head.method),
            path = head.path,
            status = response.status
        );
        if close {
            http.buf.clear();
            conn.close_after_flush = true;
        }
        http.phase = Phase::Idle;
        write_response(&mut conn.out, response, close, head.method == Method::Head);
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        let at = self.now_ms + self.cfg.idle_timeout_ms;
        self.set_deadline(r, at);
    }

    fn complete_request(&mut self, r: ConnRef, head: &Head, body: &[u8]) {
        let open = self.conns.len();
        let handled = {
            let (mut wire, core) = (
                Wire {
                    conns: &mut self.conns,
                    dirty: &mut self.dirty,
                    again: &mut self.again,
                    max_ws_out_bytes: self.max_ws_out_bytes,
                    shutting_down: self.shutdown_started,
                },
                &mut self.core,
            );
            self.api.handle(core, &mut wire, r, head, body, open)
        };
        let Some(conn) = self.conns.get_mut(r) else { return };
        let State::Http(http) = &mut conn.state else { return };
        let client_ip = http.client_ip;
        match handled {
            Handled::Respond(response) => {
                self.core.metrics.http_request(response.status);
                crate::log!(
                    Level::Debug,
                    "request",
                    method = format!("{:?}", head.method),
                    path = head.path,
                    status = response.status,
                    client_ip = client_ip
                );
                let close = !head.keep_alive || response.close || self.shutdown_started;
                write_response(&mut conn.out, response, close, head.method == Method::Head);
                conn.close_after_flush |= close;
                mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
                let at = self.now_ms + self.cfg.idle_timeout_ms;
                self.set_deadline(r, at);
            }
            Handled::Held => {
                http.phase = Phase::Held { keep_alive: head.keep_alive, head_only: head.method == Method::Head };
                self.set_deadline(r, u64::MAX);
            }
            Handled::Upgrade { accept_key } => self.upgrade(r, &accept_key, client_ip),
        }
    }

    fn upgrade(&mut self, r: ConnRef, accept_key: &str, client_ip: IpAddr) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        let State::Http(http) = &mut conn.state else { return };
        let leftover = std::mem::take(&mut http.buf);
        conn.out.extend_from_slice(
            format!(
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                 Sec-WebSocket-Accept: {accept_key}\r\n\r\n"
            )
            .as_bytes(),
        );
        self.core.metrics.http_request(101);
        let now = self.now_ms;
        conn.state = State::Ws(Box::new(Ws {
            ctx: ws_context(leftover, self.cfg.max_message_bytes),
            last_seen_ms: now,
            next_ping_ms: now + self.cfg.ping_interval_ms,
        }));
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        conn.deadline_ms = u64::MAX;
        let at = now + self.cfg.ping_interval_ms.min(self.cfg.pong_wait_ms);
        self.set_deadline(r, at);
        {
            let (mut wire, core) = self.wire();
            core.worker_connected(&mut wire, r, client_ip);
        }
        // Frames that arrived with the upgrade request are already buffered: read them now.
        self.read_ws(r);
    }

    fn read_ws(&mut self, r: ConnRef) {
        let now = self.now_ms;
        let mut texts = Vec::new();
        let mut close: Option<(CloseCode, &'static str)> = None;
        let mut gone = false;
        {
            let Some(conn) = self.conns.get_mut(r) else { return };
            let State::Ws(ws) = &mut conn.state else { return };
            let mut io = WsIo { stream: &mut conn.stream, out: &mut conn.out, got_bytes: false };
            let mut drained = false;
            for _ in 0..MAX_ITEMS_PER_TURN {
                match ws.ctx.read(&mut io) {
                    Ok(Message::Text(text)) => texts.push(text),
                    Ok(Message::Binary(_)) => {
                        close = Some((CloseCode::Unsupported, "binary frames are not accepted"));
                        break;
                    }
                    Ok(_) => {} // ping (answered by tungstenite), pong, close (reply queued)
                    Err(tungstenite::Error::Io(e)) if e.kind() == io::ErrorKind::WouldBlock => {
                        drained = true;
                        break;
                    }
                    Err(tungstenite::Error::Io(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(tungstenite::Error::Capacity(_)) => {
                        close = Some((CloseCode::Size, "message over MAX_MESSAGE_SIZE"));
                        break;
                    }
                    Err(tungstenite::Error::Utf8(_)) => {
                        close = Some((CloseCode::Invalid, "text frame is not valid UTF-8"));
                        break;
                    }
                    Err(tungstenite::Error::Protocol(_)) => {
                        close = Some((CloseCode::Protocol, "WebSocket protocol error"));
                        break;
                    }
                    Err(_) => {
                        gone = true;
                        break;
                    }
                }
            }
            if io.got_bytes {
                ws.last_seen_ms = now;
            }
            conn.read_more = !drained && !gone && close.is_none();
            if conn.pending_out() > 0 {
                mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
            }
        }
        for text in texts {
            let (mut wire, core) = self.wire();
            core.worker_message(&mut wire, r, text.as_str());
        }
        if let Some((code, reason)) = close {
            self.close_ws(r, code, reason);
        } else if gone {
            // Closed (after a close handshake, whose reply is already queued) or reset.
            self.worker_gone(r, "connection closed");
            self.finish_after_flush(r);
        } else if self.conns.get_mut(r).is_some_and(|c| c.read_more) {
            self.again.push(r);
        }
    }

    fn worker_gone(&mut self, r: ConnRef, why: &str) {
        let (mut wire, core) = self.wire();
        core.worker_disconnected(&mut wire, r, why);
    }

    /// Sends a close frame, ends the worker, and closes once the frame is written.
    fn close_ws(&mut self, r: ConnRef, code: CloseCode, reason: &'static str) {
        if let Some(conn) = self.conns.get_mut(r)
            && let State::Ws(ws) = &mut conn.state
        {
            let mut io = WsIo { stream: &mut conn.stream, out: &mut conn.out, got_bytes: false };
            let _ = ws.ctx.close(&mut io, Some(CloseFrame { code, reason: reason.into() }));
            crate::log!(
                Level::Info,
                "closing worker connection",
                peer = conn.peer_ip,
                code = u16::from(code),
                reason = reason
            );
        }
        self.worker_gone(r, reason);
        self.finish_after_flush(r);
    }

    /// No more input will be processed: write what is queued, then shut down and linger.
    fn finish_after_flush(&mut self, r: ConnRef) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        conn.state = State::Closing;
        conn.close_after_flush = true;
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        let at = self.now_ms + LINGER_MS;
        conn.deadline_ms = u64::MAX;
        self.set_deadline(r, at);
    }

    fn respond_and_close(&mut self, r: ConnRef, response: Response) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        self.core.metrics.http_request(response.status);
        write_response(&mut conn.out, response, true, false);
        if let State::Http(http) = &mut conn.state {
            http.buf = Vec::new();
            http.phase = Phase::Idle;
        }
        conn.close_after_flush = true;
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
    }

    fn drain_closing(&mut self, r: ConnRef) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        loop {
            match conn.stream.read(&mut self.scratch) {
                Ok(0) => {
                    if conn.pending_out() == 0 {
                        self.close_now(r, "closed");
                    }
                    return;
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.close_now(r, "read error while closing");
                    return;
                }
            }
        }
    }

    fn process_again(&mut self) {
        let again = std::mem::take(&mut self.again);
        for r in again {
            let Some(conn) = self.conns.get_mut(r) else { continue };
            match conn.state {
                State::Http(_) => {
                    self.process_http(r);
                    if self.conns.get_mut(r).is_some_and(|c| c.read_more) {
                        self.read_http(r);
                    }
                }
                State::Ws(_) => self.read_ws(r),
                State::Closing => self.drain_closing(r),
            }
        }
    }

    // ----- writing ---------------------------------------------------------------------------

    fn flush_dirty(&mut self) {
        let dirty = std::mem::take(&mut self.dirty);
        for &r in &dirty {
            if let Some(conn) = self.conns.get_mut(r) {
                conn.in_dirty = false;
            }
            self.flush(r);
        }
        let mut dirty = dirty;
        dirty.clear();
        if self.dirty.is_empty() {
            self.dirty = dirty;
        }
    }

    fn flush(&mut self, r: ConnRef) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        while conn.out_pos < conn.out.len() {
            match conn.stream.write(&conn.out[conn.out_pos..]) {
                Ok(0) => {
                    self.close_now(r, "write returned 0");
                    return;
                }
                Ok(n) => conn.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return, // a writable event follows
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.close_now(r, "write error");
                    return;
                }
            }
        }
        let had_backlog = conn.out_pos > MAX_HTTP_BACKLOG_BYTES;
        conn.out.clear();
        conn.out_pos = 0;
        if conn.out.capacity() > KEEP_OUT_CAPACITY {
            conn.out = Vec::new();
        }
        if conn.close_after_flush {
            let _ = conn.stream.shutdown(std::net::Shutdown::Write);
            if !matches!(conn.state, State::Closing) {
                if let State::Http(_) = conn.state {
                    conn.state = State::Closing;
                }
                let at = self.now_ms + LINGER_MS;
                conn.deadline_ms = u64::MAX;
                self.set_deadline(r, at);
            }
            // The peer may already have closed; find out without waiting for an event.
            self.drain_closing(r);
            return;
        }
        if had_backlog || conn.read_more {
            self.again.push(r);
        }
    }

    // ----- closing ---------------------------------------------------------------------------

    fn close_now(&mut self, r: ConnRef, why: &str) {
        let Some(mut conn) = self.conns.remove(r) else { return };
        let _ = self.poll.registry().deregister(&mut conn.stream);
        if let Some((_, h)) = conn.timer.take() {
            self.core.wheel.cancel(h);
        }
        crate::log!(Level::Trace, "connection closed", peer = conn.peer_ip, reason = why);
        let was_ws = matches!(conn.state, State::Ws(_));
        drop(conn);
        let (mut wire, core) = self.wire();
        if was_ws || core.is_worker(r) {
            core.worker_disconnected(&mut wire, r, why);
        }
        core.conn_closed(r);
    }

    fn begin_shutdown(&mut self) {
        self.shutdown_started = true;
        crate::log!(
            Level::Info,
            "shutting down",
            open_connections = self.conns.len(),
            grace_ms = self.cfg.shutdown_timeout_ms
        );
        if let Some(mut listener) = self.listener.take() {
            let _ = self.poll.registry().deregister(&mut listener);
        }
        self.core.shutting_down = true;
        {
            let (mut wire, core) = self.wire();
            core.release_waiters(&mut wire);
        }
        for r in self.conns.refs() {
            let Some(conn) = self.conns.get_mut(r) else { continue };
            match &conn.state {
                State::Http(http) => {
                    if matches!(http.phase, Phase::Idle) && http.buf.is_empty() && conn.pending_out() == 0 {
                        self.close_now(r, "shutdown");
                    } else {
                        // Finish the response under way, then close.
                        if matches!(http.phase, Phase::Idle) {
                            conn.close_after_flush = true;
                            mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
                        }
                    }
                }
                State::Ws(_) => self.close_ws(r, CloseCode::Away, "server shutting down"),
                State::Closing => {}
            }
        }
        self.core.wheel.arm(self.now_ms + self.cfg.shutdown_timeout_ms, Timer::ShutdownDeadline);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip() {
        for r in [ConnRef { slot: 0, generation: 1 }, ConnRef { slot: 12345, generation: u32::MAX }] {
            assert_eq!(conn_ref(token(r)), r);
            assert_ne!(token(r), LISTENER);
            assert_ne!(token(r), WAKER);
        }
    }

    #[test]
    fn slots_reject_stale_generations() {
        // A slot's next occupant must not be reachable through the previous occupant's ref.
        let mut conns = Conns::default();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mk = || {
            let s = std::net::TcpStream::connect(addr).expect("connect");
            Conn::new(TcpStream::from_std(s), addr.ip())
        };
        let first = conns.insert(mk());
        assert!(conns.remove(first).is_some());
        let second = conns.insert(mk());
        assert_eq!(first.slot, second.slot);
        assert!(conns.get_mut(first).is_none());
        assert!(conns.remove(first).is_none());
        assert!(conns.get_mut(second).is_some());
        assert_eq!(conns.len(), 1);
    }
}
