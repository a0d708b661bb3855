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

use std::collections::HashMap;

use crate::api::{Api, Handled, Route};
use crate::auth::Identity;
use crate::config::Config;
use crate::conn::{Conn, Download, Phase, State, Upload, Ws, WsIo, ws_context};
use crate::dispatch::{Core, CoreConfig, Io, Timer};
use crate::files::{self, Done, FileMeta, Job, OpenError, RangeAnswer, Store, TransferId, UploadError, UploadParse};
use crate::http::{self, ChunkedDecoder, Framing, Head, MAX_HEAD_BYTES, Method, Response};
use crate::log::Level;
use crate::tasks::{ConnRef, uuid_string};

const LISTENER: Token = Token(usize::MAX);
const WAKER: Token = Token(usize::MAX - 1);

/// Connections accepted per loop turn before others get their turn.
const ACCEPT_BATCH: usize = 256;
/// Requests handled per connection per turn.
const MAX_ITEMS_PER_TURN: usize = 64;
/// Socket reads (of up to 64 KiB) per worker connection per turn.
const MAX_READS_PER_TURN: usize = 4;
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

/// Input an upload may buffer ahead of the parser.
const UPLOAD_INPUT_BYTES: usize = 256 * 1024;
/// File bytes of one upload sent to the disk thread and not yet written.
const UPLOAD_WINDOW_BYTES: usize = 512 * 1024;
/// The same, summed over every upload: beyond it uploads wait for the disk.
const DISK_BUDGET_BYTES: usize = 64 << 20;
/// How often BLOB_DIR is swept for leftovers (temp files and blobs without metadata that
/// nothing wrote to for an hour) and files past their time.
const BLOB_SWEEP_MS: u64 = 60 * 60 * 1000;
/// One read from a file being downloaded.
const DOWNLOAD_CHUNK_BYTES: usize = 64 * 1024;
/// A download asks for more only when its unwritten output is at most this.
const DOWNLOAD_LOW_WATER_BYTES: usize = 128 * 1024;

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
    fn send_text(&mut self, worker: ConnRef, parts: &[&str]) -> bool {
        let Some(conn) = self.conns.get_mut(worker) else { return false };
        let len: usize = parts.iter().map(|p| p.len()).sum();
        match &conn.state {
            State::Ws(ws) if ws.ctx.can_write() && !conn.close_after_flush => {}
            _ => return false,
        }
        if conn.pending_out() + len > self.max_ws_out_bytes {
            // Over the cap: it is only a failure if the socket will not take bytes now (a burst
            // within one loop turn is not a stalled worker).
            if write_out(conn).is_err() || conn.pending_out() + len > self.max_ws_out_bytes {
                return false;
            }
        }
        // tungstenite keeps nothing buffered (write_buffer_size 0: every frame it makes goes
        // straight to `out`), so a frame written here keeps the stream in order.
        crate::conn::push_text_frame(&mut conn.out, parts, len);
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

/// Writes the connection's output until it is all written or the socket would block.
fn write_out(conn: &mut Conn) -> io::Result<()> {
    while conn.out_pos < conn.out.len() {
        match conn.stream.write(&conn.out[conn.out_pos..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => conn.out_pos += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    conn.out.clear();
    conn.out_pos = 0;
    Ok(())
}

/// A held reply or a download that has not been written completely yet.
fn answer_under_way(conn: &Conn) -> bool {
    matches!(&conn.state, State::Http(http) if matches!(http.phase, Phase::Held { .. } | Phase::Download(_) | Phase::Upload(_)))
}

/// Tells the disk thread a connection's transfer is over (an upload not finished is removed).
fn end_transfer(store: &Store, transfers: &mut HashMap<TransferId, ConnRef>, phase: &Phase) {
    match phase {
        Phase::Upload(up) => {
            transfers.remove(&up.transfer);
            if !up.finishing {
                store.send(Job::Abort { t: up.transfer });
            }
        }
        Phase::Download(d) => {
            transfers.remove(&d.transfer);
            store.send(Job::Close { t: d.transfer });
        }
        _ => {}
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
    store: Store,
    /// Which connection a disk transfer belongs to.
    transfers: HashMap<TransferId, ConnRef>,
    next_transfer: TransferId,
    /// Upload bytes queued to the disk thread and not yet written, over all uploads.
    disk_bytes: usize,
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
        let mut core = Core::new(
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
            max_file_bytes: cfg.max_file_bytes,
        };
        let disk_waker = waker.clone();
        let store = Store::start(
            cfg.blob_dir.clone(),
            Arc::new(move || {
                let _ = disk_waker.wake();
            }),
        )?;
        store.send(Job::Scan { now_wall_ms: crate::timefmt::wall_ms() });
        core.wheel.arm(BLOB_SWEEP_MS, Timer::BlobSweep);
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
            store,
            transfers: HashMap::new(),
            next_transfer: 1,
            disk_bytes: 0,
        };
        Ok((server, waker))
    }

    fn tick_clock(&mut self) {
        self.now_ms = self.started.elapsed().as_millis() as u64;
        self.core.now_ms = self.now_ms;
        self.core.wall_ms = crate::timefmt::wall_ms();
    }

    fn wire(&mut self) -> (Wire<'_>, &mut Core) {
        let (wire, core, _) = self.wire_and_api();
        (wire, core)
    }

    /// The core, its window on the connections, and the API, borrowed together.
    fn wire_and_api(&mut self) -> (Wire<'_>, &mut Core, &Api) {
        (
            Wire {
                conns: &mut self.conns,
                dirty: &mut self.dirty,
                again: &mut self.again,
                max_ws_out_bytes: self.max_ws_out_bytes,
                shutting_down: self.shutdown_started,
            },
            &mut self.core,
            &self.api,
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
                    WAKER => self.on_disk_done(),
                    t => {
                        let r = conn_ref(t);
                        if event.is_readable() || event.is_read_closed() || event.is_error() {
                            self.on_readable(r, event.is_read_closed() || event.is_error());
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
                Timer::BlobExpire(file_id) => self.store.send(Job::Delete { file_id }),
                Timer::BlobSweep => {
                    self.store.send(Job::Sweep { now_wall_ms: crate::timefmt::wall_ms() });
                    self.core.wheel.arm(self.now_ms + BLOB_SWEEP_MS, Timer::BlobSweep);
                }
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
                    crate::log!(Level::Debug, "request timeout", client_ip = conn.client_ip);
                    self.respond_and_close(r, crate::api::error(408, "request not complete within HEADER_TIMEOUT"));
                }
                Phase::Held { .. } => {}
                Phase::Upload(_) => {
                    crate::log!(Level::Debug, "upload stalled", client_ip = conn.client_ip);
                    self.respond_and_close(r, crate::api::error(408, "upload made no progress within HEADER_TIMEOUT"));
                }
                Phase::Download(_) => self.close_now(r, "download stalled"),
            },
            State::Ws(ws) => {
                if now >= ws.last_seen_ms + self.cfg.pong_wait_ms {
                    crate::log!(Level::Info, "worker silent past PONG_WAIT", client_ip = conn.client_ip);
                    self.close_now(r, "no pong within PONG_WAIT");
                    return;
                }
                if now >= ws.next_ping_ms {
                    let mut io = WsIo::writer(&mut conn.out);
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

    /// `peer_closed`: the event reported a hang-up, so reading must go on until EOF is seen.
    fn on_readable(&mut self, r: ConnRef, peer_closed: bool) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        match conn.state {
            State::Http(_) => self.read_http(r, !peer_closed),
            State::Ws(_) => self.read_ws(r, !peer_closed),
            State::Closing => self.drain_closing(r),
        }
    }

    /// Reads and handles requests. With `stop_on_short`, a read that did not fill the room it
    /// had counts as draining the socket (edge-triggered epoll reports later data anew).
    fn read_http(&mut self, r: ConnRef, stop_on_short: bool) {
        loop {
            let Some(conn) = self.conns.get_mut(r) else { return };
            let State::Http(http) = &mut conn.state else { return };
            // The most input the connection may buffer in its phase.
            let cap = match &http.phase {
                Phase::Held { .. } | Phase::Download(_) => MAX_HELD_INPUT_BYTES,
                Phase::Upload(up) if up.disk_bytes >= UPLOAD_WINDOW_BYTES || self.disk_bytes >= DISK_BUDGET_BYTES => 0,
                Phase::Upload(_) => UPLOAD_INPUT_BYTES,
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
                    // The peer closed its side. An answer under way (or already queued) is
                    // still delivered; nothing more will be read.
                    let answering = matches!(http.phase, Phase::Held { .. } | Phase::Download(_));
                    if answering || conn.pending_out() > 0 {
                        conn.close_after_flush = true;
                        conn.read_more = false;
                        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
                    } else {
                        self.close_now(r, "peer closed");
                    }
                    return;
                }
                Ok(n) => {
                    http.buf.extend_from_slice(&self.scratch[..n]);
                    self.process_http(r);
                    if stop_on_short && n < room {
                        if let Some(conn) = self.conns.get_mut(r) {
                            conn.read_more = false;
                        }
                        return;
                    }
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
            Phase::Held { .. } | Phase::Download(_) => false,
            Phase::Upload(_) => self.step_upload(r),
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
                conn.client_ip = self.cfg.trusted_proxies.client_ip(
                    conn.peer_ip,
                    head.forwarded_for.as_deref(),
                    head.real_ip.as_deref(),
                );
                let identity = match self.api.precheck(&head, self.core.wall_ms) {
                    Ok(identity) => identity,
                    Err(response) => {
                        self.answer_early(r, &head, response);
                        return true;
                    }
                };
                match Route::of(&head.path) {
                    Route::Files => return self.start_upload(r, head),
                    Route::File(id) => {
                        let id = crate::tasks::parse_id(id);
                        return self.start_download(r, head, id);
                    }
                    _ => {}
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
                    let wanted = (n as usize).min(self.http_input_cap);
                    http.buf.reserve(wanted.saturating_sub(http.buf.len()));
                }
                http.phase = Phase::Body { head: Box::new(head), identity, chunked };
                true
            }
            Phase::Body { head, chunked, .. } => {
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
                        let limit = self.api.body_limit(Route::of(&head.path)) as usize;
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
                let Phase::Body { head, identity, .. } = std::mem::replace(&mut http.phase, Phase::Idle) else {
                    return false;
                };
                self.complete_request(r, &head, identity.as_ref(), &body);
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
            status = response.status,
            client_ip = conn.client_ip
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

    fn complete_request(&mut self, r: ConnRef, head: &Head, identity: Option<&Identity>, body: &[u8]) {
        let open = self.conns.len();
        let handled = {
            let (mut wire, core, api) = self.wire_and_api();
            api.handle(core, &mut wire, r, head, identity, body, open)
        };
        let Some(conn) = self.conns.get_mut(r) else { return };
        let State::Http(http) = &mut conn.state else { return };
        let client_ip = conn.client_ip;
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
        self.read_ws(r, false);
    }

    /// Reads a worker's socket into the scratch buffer and lets tungstenite parse frames from
    /// there: one syscall per batch of frames rather than one per refill of tungstenite's small
    /// buffer. With `stop_on_short`, a read that did not fill the buffer counts as draining the
    /// socket (edge-triggered epoll reports data that arrives later as a new event).
    fn read_ws(&mut self, r: ConnRef, stop_on_short: bool) {
        let now = self.now_ms;
        let mut texts = Vec::new();
        let mut close: Option<(CloseCode, &'static str)> = None;
        let mut gone = false;
        let mut more = false;
        let mut blocked = false;
        {
            let Some(conn) = self.conns.get_mut(r) else { return };
            let State::Ws(ws) = &mut conn.state else { return };
            // First what tungstenite already holds (frames that came with the upgrade), then
            // the socket.
            let mut n = 0;
            let mut reads = 0;
            loop {
                // A worker that does not read what relay writes (its pongs included) is not
                // read either until its output drains: `flush` brings it back. Its frames then
                // wait in the kernel, and PONG_WAIT ends it if it never reads again.
                if conn.out.len() - conn.out_pos > self.max_ws_out_bytes {
                    blocked = true;
                    break;
                }
                let mut io = WsIo { input: &self.scratch[..n], pos: 0, out: &mut conn.out };
                loop {
                    match ws.ctx.read(&mut io) {
                        Ok(Message::Text(text)) => texts.push(text),
                        Ok(Message::Binary(_)) => {
                            close = Some((CloseCode::Unsupported, "binary frames are not accepted"));
                            break;
                        }
                        Ok(_) => {} // ping (answered by tungstenite), pong, close (reply queued)
                        Err(tungstenite::Error::Io(e)) if e.kind() == io::ErrorKind::WouldBlock => break,
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
                if close.is_some() || gone || (stop_on_short && reads > 0 && n < self.scratch.len()) {
                    break;
                }
                if reads == MAX_READS_PER_TURN {
                    more = true;
                    break;
                }
                match conn.stream.read(&mut self.scratch) {
                    Ok(0) => {
                        gone = true;
                        break;
                    }
                    Ok(got) => {
                        n = got;
                        reads += 1;
                        ws.last_seen_ms = now;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => n = 0,
                    Err(_) => {
                        gone = true;
                        break;
                    }
                }
            }
            conn.read_more = more || blocked;
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
        } else if more {
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
            let mut io = WsIo::writer(&mut conn.out);
            let _ = ws.ctx.close(&mut io, Some(CloseFrame { code, reason: reason.into() }));
            crate::log!(
                Level::Info,
                "closing worker connection",
                client_ip = conn.client_ip,
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
            let phase = std::mem::replace(&mut http.phase, Phase::Idle);
            end_transfer(&self.store, &mut self.transfers, &phase);
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
                        self.read_http(r, false);
                    }
                }
                State::Ws(_) => self.read_ws(r, false),
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
        let total = conn.out.len();
        if write_out(conn).is_err() {
            self.close_now(r, "write error");
            return;
        }
        if conn.pending_out() > 0 {
            // A writable event follows; a download may still want its next chunk.
            self.pump_download(r);
            return;
        }
        let had_backlog = total > MAX_HTTP_BACKLOG_BYTES;
        if conn.out.capacity() > KEEP_OUT_CAPACITY {
            conn.out = Vec::new();
        }
        if conn.close_after_flush && !answer_under_way(conn) {
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
        self.pump_download(r);
    }

    // ----- closing ---------------------------------------------------------------------------

    fn close_now(&mut self, r: ConnRef, why: &str) {
        let Some(mut conn) = self.conns.remove(r) else { return };
        if let State::Http(http) = &conn.state {
            self.end_transfer(&http.phase);
        }
        let _ = self.poll.registry().deregister(&mut conn.stream);
        if let Some((_, h)) = conn.timer.take() {
            self.core.wheel.cancel(h);
        }
        crate::log!(Level::Trace, "connection closed", client_ip = conn.client_ip, reason = why);
        drop(conn);
        // A no-op unless the connection was a worker's (or held a wait=true request).
        self.worker_gone(r, why);
        self.core.conn_closed(r);
    }

    // ----- file transfers ----------------------------------------------------------------------

    fn end_transfer(&mut self, phase: &Phase) {
        end_transfer(&self.store, &mut self.transfers, phase);
    }

    /// `POST /files` passed its checks: stream the body to the disk thread.
    fn start_upload(&mut self, r: ConnRef, head: Head) -> bool {
        if head.framing == Framing::Empty {
            self.answer_early(r, &head, crate::api::error(400, "POST /files needs a multipart body"));
            return true;
        }
        let parse = match UploadParse::new(head.content_type.as_deref(), self.cfg.max_file_bytes) {
            Ok(p) => p,
            Err(UploadError::Bad(msg)) => {
                self.answer_early(r, &head, crate::api::error(400, &msg));
                return true;
            }
            Err(UploadError::TooLarge) => {
                self.answer_early(r, &head, crate::api::error(413, "file over MAX_FILE_SIZE"));
                return true;
            }
        };
        let transfer = self.next_transfer;
        self.next_transfer += 1;
        let file_id = uuid::Uuid::new_v4().as_u128();
        self.transfers.insert(transfer, r);
        self.store.send(Job::Create { t: transfer, file_id });
        let Some(conn) = self.conns.get_mut(r) else { return false };
        let State::Http(http) = &mut conn.state else { return false };
        let body_here = matches!(head.framing, Framing::Length(n) if http.buf.len() as u64 >= n);
        if head.expect_continue && !body_here && head.minor_version == 1 {
            conn.out.extend_from_slice(CONTINUE_100);
            mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        }
        let (body_left, chunked) = match head.framing {
            Framing::Length(n) => (n, None),
            _ => (0, Some((ChunkedDecoder::default(), Vec::new()))),
        };
        http.phase = Phase::Upload(Box::new(Upload {
            transfer,
            file_id,
            keep_alive: head.keep_alive,
            parse: Some(parse),
            chunked,
            body_left,
            disk_bytes: 0,
            finishing: false,
        }));
        crate::log!(Level::Debug, "upload started", file_id = uuid_string(file_id), client_ip = conn.client_ip);
        let at = self.now_ms + self.cfg.header_timeout_ms;
        self.set_deadline(r, at);
        true
    }

    /// Feeds buffered body bytes to the upload's parser and its file bytes to the disk.
    fn step_upload(&mut self, r: ConnRef) -> bool {
        enum Step {
            Wait,
            Progress,
            Finish(Result<files::Uploaded, UploadError>),
            Fail(UploadError),
        }
        let budget_full = self.disk_bytes >= DISK_BUDGET_BYTES;
        let Some(conn) = self.conns.get_mut(r) else { return false };
        let State::Http(http) = &mut conn.state else { return false };
        let crate::conn::Http { buf, phase, .. } = http;
        let Phase::Upload(up) = phase else { return false };
        if up.finishing || up.disk_bytes >= UPLOAD_WINDOW_BYTES || budget_full {
            return false;
        }
        let Some(parse) = up.parse.as_mut() else { return false };
        let mut to_disk = Vec::new();
        let mut used_any = false;
        let step = match &mut up.chunked {
            Some((decoder, decoded)) => {
                let fed = match decoder.decode(buf, decoded, usize::MAX) {
                    Ok(used) => {
                        buf.drain(..used);
                        used_any |= used > 0;
                        parse.feed(decoded, &mut to_disk)
                    }
                    Err(_) => Err(UploadError::Bad("malformed chunked body".into())),
                };
                match fed {
                    Err(e) => Step::Fail(e),
                    Ok(used) => {
                        decoded.drain(..used);
                        used_any |= used > 0;
                        if parse.is_done() {
                            decoded.clear(); // the epilogue
                        }
                        if decoder.is_done() {
                            Step::Finish(Ok(files::Uploaded::default()))
                        } else if used_any {
                            Step::Progress
                        } else {
                            Step::Wait
                        }
                    }
                }
            }
            None => {
                let avail = (buf.len() as u64).min(up.body_left) as usize;
                match parse.feed(&buf[..avail], &mut to_disk) {
                    Err(e) => Step::Fail(e),
                    Ok(mut used) => {
                        if parse.is_done() {
                            used = avail; // the epilogue
                        }
                        buf.drain(..used);
                        up.body_left -= used as u64;
                        if up.body_left == 0 {
                            Step::Finish(Ok(files::Uploaded::default()))
                        } else if used > 0 {
                            Step::Progress
                        } else {
                            Step::Wait
                        }
                    }
                }
            }
        };
        let transfer = up.transfer;
        if !to_disk.is_empty() && !matches!(step, Step::Fail(_)) {
            up.disk_bytes += to_disk.len();
            self.disk_bytes += to_disk.len();
            self.store.send(Job::Write { t: transfer, data: to_disk });
        }
        let step = match step {
            // The body is complete: the parser must have seen its end and a file part.
            Step::Finish(_) => {
                Step::Finish(up.parse.take().map_or(Err(UploadError::Bad("no upload".into())), UploadParse::finish))
            }
            other => other,
        };
        match step {
            Step::Wait => false,
            Step::Progress => {
                let at = self.now_ms + self.cfg.header_timeout_ms;
                self.set_deadline(r, at);
                true
            }
            Step::Finish(Ok(file)) => {
                up.finishing = true;
                let file_id = up.file_id;
                let now = crate::timefmt::wall_ms();
                let meta = FileMeta {
                    file_id: uuid_string(file_id),
                    filename: file.filename,
                    content_type: file.content_type,
                    size: file.size,
                    sha256: file.sha256,
                    created_ms: now,
                    expires_ms: now + self.cfg.blob_ttl_ms,
                };
                self.store.send(Job::Finish { t: transfer, meta });
                self.set_deadline(r, u64::MAX);
                false
            }
            Step::Finish(Err(e)) | Step::Fail(e) => {
                let response = match e {
                    UploadError::TooLarge => {
                        crate::api::error(413, &format!("file over MAX_FILE_SIZE ({} bytes)", self.cfg.max_file_bytes))
                    }
                    UploadError::Bad(msg) => crate::api::error(400, &msg),
                };
                self.respond_and_close(r, response);
                false
            }
        }
    }

    /// `GET`/`HEAD /files/{id}`: ask the disk thread to open the file.
    fn start_download(&mut self, r: ConnRef, head: Head, file_id: Option<u128>) -> bool {
        let Some(file_id) = file_id else {
            self.answer_early(r, &head, crate::api::error(404, "no such file"));
            return true;
        };
        if head.framing != Framing::Empty {
            self.answer_early(r, &head, crate::api::error(400, "a file download takes no request body"));
            return true;
        }
        let transfer = self.next_transfer;
        self.next_transfer += 1;
        self.transfers.insert(transfer, r);
        self.store.send(Job::Open { t: transfer, file_id, now_wall_ms: crate::timefmt::wall_ms() });
        let Some(conn) = self.conns.get_mut(r) else { return false };
        let State::Http(http) = &mut conn.state else { return false };
        http.phase = Phase::Download(Box::new(Download {
            transfer,
            keep_alive: head.keep_alive,
            head_only: head.method == Method::Head,
            range: head.range.clone(),
            started: false,
            next: 0,
            end: 0,
            reading: false,
        }));
        let at = self.now_ms + self.cfg.idle_timeout_ms;
        self.set_deadline(r, at);
        false
    }

    /// Asks for the next chunk of a download once its output has drained enough.
    fn pump_download(&mut self, r: ConnRef) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        let pending = conn.pending_out();
        let State::Http(http) = &mut conn.state else { return };
        let Phase::Download(d) = &mut http.phase else { return };
        if !d.started || d.reading || d.next >= d.end || pending > DOWNLOAD_LOW_WATER_BYTES {
            return;
        }
        let len = (d.end - d.next).min(DOWNLOAD_CHUNK_BYTES as u64) as usize;
        d.reading = true;
        self.store.send(Job::Read { t: d.transfer, offset: d.next, len });
    }

    /// A transfer is over: its connection may take the next request.
    fn finish_transfer(&mut self, r: ConnRef, keep_alive: bool) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        if let State::Http(http) = &mut conn.state {
            http.phase = Phase::Idle;
        }
        if !keep_alive || self.shutdown_started {
            conn.close_after_flush = true;
        }
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        self.again.push(r);
        let at = self.now_ms + self.cfg.idle_timeout_ms;
        self.set_deadline(r, at);
    }

    /// Answers from the disk thread.
    fn on_disk_done(&mut self) {
        while let Some(done) = self.store.try_done() {
            match done {
                Done::Scanned(files) => {
                    let wall = crate::timefmt::wall_ms();
                    for (file_id, expires_ms) in files {
                        let at = self.now_ms + expires_ms.saturating_sub(wall);
                        self.core.wheel.arm(at, Timer::BlobExpire(file_id));
                    }
                }
                Done::Created { t, result: Err(e) } => {
                    crate::log!(
                        Level::Error,
                        "cannot create an upload file",
                        dir = self.cfg.blob_dir.display(),
                        error = e
                    );
                    if let Some(r) = self.transfers.get(&t).copied() {
                        self.respond_and_close(r, crate::api::error(500, "cannot store the file"));
                    }
                }
                Done::Created { result: Ok(()), .. } => {}
                Done::Written { t, len } => {
                    self.disk_bytes = self.disk_bytes.saturating_sub(len);
                    if let Some(r) = self.transfers.get(&t).copied()
                        && let Some(Phase::Upload(up)) = self.http_phase(r)
                    {
                        up.disk_bytes = up.disk_bytes.saturating_sub(len);
                        self.again.push(r);
                    }
                }
                Done::Finished { t, result } => self.upload_finished(t, result),
                Done::Opened { t, result } => self.download_opened(t, result),
                Done::Read { t, result } => self.download_read(t, result),
            }
        }
    }

    fn http_phase(&mut self, r: ConnRef) -> Option<&mut Phase> {
        match &mut self.conns.get_mut(r)?.state {
            State::Http(http) => Some(&mut http.phase),
            _ => None,
        }
    }

    fn upload_finished(&mut self, t: TransferId, result: Result<FileMeta, String>) {
        let r = self.transfers.remove(&t);
        let meta = match result {
            Ok(meta) => meta,
            Err(e) => {
                crate::log!(Level::Error, "cannot store an upload", error = e);
                if let Some(r) = r {
                    self.respond_and_close(r, crate::api::error(500, "cannot store the file"));
                }
                return;
            }
        };
        let Some(file_id) = crate::tasks::parse_id(&meta.file_id) else { return };
        let ttl_at = self.now_ms + meta.expires_ms.saturating_sub(meta.created_ms);
        self.core.wheel.arm(ttl_at, Timer::BlobExpire(file_id));
        crate::log!(Level::Info, "file stored", file_id = meta.file_id, size = meta.size);
        let Some(r) = r else { return };
        let Some(Phase::Upload(up)) = self.http_phase(r) else { return };
        let keep_alive = up.keep_alive;
        let mut body = String::with_capacity(256);
        body.push_str("{\"file_id\":\"");
        body.push_str(&meta.file_id);
        body.push_str("\",\"filename\":");
        crate::tasks::push_json_str(&mut body, &meta.filename);
        body.push_str(",\"content_type\":");
        crate::tasks::push_json_str(&mut body, &meta.content_type);
        body.push_str(&format!(",\"size\":{},\"sha256\":\"{}\",\"expires_at\":\"", meta.size, meta.sha256));
        crate::timefmt::write_rfc3339_ms(&mut body, meta.expires_ms);
        body.push_str("\"}");
        let response = Response::json(201, body.into_bytes());
        self.core.metrics.http_request(201);
        if let Some(conn) = self.conns.get_mut(r) {
            write_response(&mut conn.out, response, !keep_alive || self.shutdown_started, false);
        }
        self.finish_transfer(r, keep_alive);
    }

    fn download_opened(&mut self, t: TransferId, result: Result<FileMeta, OpenError>) {
        let Some(r) = self.transfers.get(&t).copied() else {
            self.store.send(Job::Close { t });
            return;
        };
        let shutting_down = self.shutdown_started;
        let Some(conn) = self.conns.get_mut(r) else { return };
        let State::Http(http) = &mut conn.state else { return };
        let Phase::Download(d) = &mut http.phase else { return };
        let (keep_alive, head_only) = (d.keep_alive, d.head_only);
        let close = !keep_alive || shutting_down;
        let meta = match result {
            Ok(meta) => meta,
            Err(e) => {
                self.transfers.remove(&t);
                let response = match e {
                    OpenError::NotFound => crate::api::error(404, "no such file"),
                    OpenError::Io(msg) => {
                        crate::log!(Level::Error, "cannot open a stored file", error = msg);
                        crate::api::error(500, "cannot read the file")
                    }
                };
                self.core.metrics.http_request(response.status);
                write_response(&mut conn.out, response, close, head_only);
                self.finish_transfer(r, keep_alive);
                return;
            }
        };
        let (status, start, end) = match files::parse_range(d.range.as_deref(), meta.size) {
            RangeAnswer::Full => (200, 0, meta.size),
            RangeAnswer::Partial { start, end } => (206, start, end),
            RangeAnswer::Unsatisfiable => {
                self.transfers.remove(&t);
                self.store.send(Job::Close { t });
                let response = crate::api::error(416, "range not satisfiable")
                    .with_header("Content-Range", format!("bytes */{}", meta.size));
                self.core.metrics.http_request(416);
                write_response(&mut conn.out, response, close, head_only);
                self.finish_transfer(r, keep_alive);
                return;
            }
        };
        use std::io::Write as _;
        let out = &mut conn.out;
        let _ = write!(
            out,
            "HTTP/1.1 {status} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nContent-Disposition: {}\r\n\
             Accept-Ranges: bytes\r\nETag: \"{}\"\r\nX-Content-Type-Options: nosniff\r\n",
            http::reason(status),
            meta.content_type,
            end - start,
            files::content_disposition(&meta.filename),
            meta.sha256
        );
        if status == 206 {
            let _ = write!(out, "Content-Range: bytes {start}-{}/{}\r\n", end - 1, meta.size);
        }
        if close {
            out.extend_from_slice(b"Connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        self.core.metrics.http_request(status);
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        if head_only || start == end {
            self.transfers.remove(&t);
            self.store.send(Job::Close { t });
            self.finish_transfer(r, keep_alive);
            return;
        }
        d.started = true;
        d.next = start;
        d.end = end;
        self.pump_download(r);
    }

    fn download_read(&mut self, t: TransferId, result: Result<Vec<u8>, String>) {
        let Some(r) = self.transfers.get(&t).copied() else {
            self.store.send(Job::Close { t });
            return;
        };
        let Some(conn) = self.conns.get_mut(r) else { return };
        let State::Http(http) = &mut conn.state else { return };
        let Phase::Download(d) = &mut http.phase else { return };
        d.reading = false;
        let data = match result {
            Ok(data) if !data.is_empty() => data,
            other => {
                // The head is sent: all we can do is end the connection early.
                let why = other.err().unwrap_or_else(|| "the file is shorter than its metadata says".into());
                crate::log!(Level::Error, "file read failed mid-download", error = why);
                self.close_now(r, "file read failed");
                return;
            }
        };
        d.next += data.len() as u64;
        let (done, keep_alive) = (d.next >= d.end, d.keep_alive);
        conn.out.extend_from_slice(&data);
        mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        let at = self.now_ms + self.cfg.idle_timeout_ms;
        self.set_deadline(r, at);
        if done {
            self.transfers.remove(&t);
            self.store.send(Job::Close { t });
            self.finish_transfer(r, keep_alive);
        }
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
