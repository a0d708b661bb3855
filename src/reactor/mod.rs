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

mod cluster;
mod disk_budget;
mod http_conn;
mod transfer;
mod ws;

use crate::api::{Api, Handled, Refused, Route};
use crate::auth::Identity;
use crate::config::Config;
use crate::conn::{Conn, Download, Phase, State, Streaming, Upload, Ws, WsIo, ws_context};
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
/// Unwritten response bytes beyond which a connection's further requests wait (SPEC §4: a
/// client that reads never comes near it; one that does not costs this much, not more).
const MAX_HTTP_BACKLOG_BYTES: usize = 256 * 1024;
/// Pipelined bytes buffered while a request is held.
const MAX_HELD_INPUT_BYTES: usize = 64 * 1024;
/// Output buffers above this are released once drained.
const KEEP_OUT_CAPACITY: usize = 64 * 1024;
/// Bodies at least this large are written from where they are, not copied into the output.
const SPILL_MIN_BYTES: usize = 64 * 1024;
/// Bytes of large bodies one connection writes per loop turn: a 48 MiB result leaves in
/// slices, and everyone else is served between them.
const WRITE_SLICE_BYTES: usize = 256 * 1024;
/// Under OUTPUT_MEMORY pressure, a connection whose output made no progress for this long is
/// closed (its client is not reading; everyone else's answers wait for no one).
const OUTPUT_STALL_MS: u64 = 1_000;
/// How often, under pressure, the connections are looked at for stalled output.
const OUTPUT_SCAN_MS: u64 = 250;
/// How long a closing connection waits for the peer's FIN.
const LINGER_MS: u64 = 2_000;
/// A backlog this large that still moves shows its worker reads (socket buffers alone take less).
const READER_PROOF_BYTES: usize = 256 * 1024;
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

/// Batch bodies of MAX_BATCH_BYTES buffered at once (their bytes, however many bodies share
/// them); beyond it batch bodies wait to be read.
const BATCH_BODIES_AT_ONCE: usize = 4;
/// What a batch body's buffer may hold beyond its body: chunked framing, pipelined bytes.
const BATCH_FRAMING_SLACK_BYTES: usize = MAX_HEAD_BYTES + 4096;
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
    /// Worker connections the core let go of, closed at the end of the turn.
    superseded: &'a mut Vec<ConnRef>,
    gated: &'a mut Gated,
    durable_lsn: u64,
    max_ws_out_bytes: usize,
    shutting_down: bool,
    /// This second's HTTP-date, for the `Date` of held answers.
    date: [u8; 29],
}

impl Io for Wire<'_> {
    fn has_room(&mut self, worker: ConnRef, bytes: usize) -> bool {
        let Some(conn) = self.conns.get_mut(worker) else { return true };
        if fits(conn.pending_out(), bytes, self.max_ws_out_bytes) {
            return true;
        }
        // A burst within one loop turn is not a full buffer: try the socket first. (A write
        // error says yes, so that `send_text` fails and the attempt is `send_failed`.)
        if write_out(conn).is_err() || fits(conn.pending_out(), bytes, self.max_ws_out_bytes) {
            return true;
        }
        if let State::Ws(ws) = &mut conn.state {
            ws.starved = true;
        }
        false
    }

    fn hold_until_durable(&mut self, worker: ConnRef, lsn: u64) {
        let Some(conn) = self.conns.get_mut(worker) else { return };
        if lsn > self.durable_lsn {
            self.gated.want = self.gated.want.max(lsn);
        }
        if conn.gate(lsn, self.durable_lsn) {
            self.gated.conns.push(worker);
        }
    }

    fn send_text(&mut self, worker: ConnRef, parts: &[&str]) -> bool {
        let Some(conn) = self.conns.get_mut(worker) else { return false };
        let len: usize = parts.iter().map(|p| p.len()).sum();
        match &conn.state {
            State::Ws(ws) if ws.ctx.can_write() && !conn.close_after_flush => {}
            _ => return false,
        }
        if !fits(conn.pending_out(), len, self.max_ws_out_bytes) {
            // Over the cap: it is only a failure if the socket will not take bytes now (a burst
            // within one loop turn is not a stalled worker).
            if write_out(conn).is_err() || !fits(conn.pending_out(), len, self.max_ws_out_bytes) {
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
        let Phase::Held { keep_alive, head_only, http11, .. } = http.phase else { return };
        let Phase::Held { method, path, .. } = std::mem::replace(&mut http.phase, Phase::Idle) else { return };
        // The line an answer given at once gets (`complete_request`): a held answer — a
        // `wait=true`, and in cluster mode every answer a transaction gives — is logged too.
        crate::log!(
            Level::Debug,
            "request",
            method = format!("{method:?}"),
            path = path,
            status = response.status,
            client_ip = conn.client_ip
        );
        let close = !keep_alive || response.close || self.shutting_down;
        put_response(conn, r, response, close, head_only, http11, self.durable_lsn, self.gated, &self.date);
        conn.close_after_flush |= close;
        mark_dirty(&mut conn.in_dirty, r, self.dirty);
        // Pipelined requests may be waiting behind the held one.
        self.again.push(r);
    }

    fn close_worker(&mut self, worker: ConnRef) {
        if self.superseded.len() < MAX_SUPERSEDED_PER_TURN {
            self.superseded.push(worker);
        }
    }
}

/// Superseded worker connections closed per turn at most (each needs a resume, which needs a
/// message: bounded by what one turn reads anyway).
const MAX_SUPERSEDED_PER_TURN: usize = 65_536;

/// Whether a frame of `bytes` may join `pending` unwritten bytes under the cap. An empty buffer
/// takes any frame: the cap bounds what piles up, and a frame larger than it (a payload from a
/// run with a larger MAX_MESSAGE_SIZE) must still go out some time.
fn fits(pending: usize, bytes: usize, cap: usize) -> bool {
    pending == 0 || pending + bytes <= cap
}

/// Writes the connection's output until it is all written or the socket would block, or
/// until [`WRITE_SLICE_BYTES`] of large bodies left in this call (`write_more` then asks for
/// the next turn). Bytes held back for the journal (`Conn::gates`) stay in the buffer.
fn write_out(conn: &mut Conn) -> io::Result<()> {
    conn.write_more = false;
    let mut sliced = 0;
    loop {
        let end = conn.writable_end();
        // `out` up to the next large body (or the journal's gate).
        let stop = conn.spill.front().map_or(end, |s| s.at.min(end));
        while conn.out_pos < stop {
            match conn.stream.write(&conn.out[conn.out_pos..stop]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => conn.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Drop what is written once it is most of the buffer, so a slow reader's
                    // buffer holds its unwritten bytes, not everything since it last drained.
                    if conn.out_pos >= KEEP_OUT_CAPACITY {
                        drop_written(conn);
                    }
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        // A large body whose turn it is (and not behind a gate: `stop` is its start).
        let Some(spill) = conn.spill.front_mut() else { break };
        if conn.out_pos != spill.at {
            break;
        }
        if sliced >= WRITE_SLICE_BYTES {
            conn.write_more = true;
            return Ok(());
        }
        let upto = spill.data.len().min(spill.pos + WRITE_SLICE_BYTES - sliced);
        match conn.stream.write(&spill.data[spill.pos..upto]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                spill.pos += n;
                sliced += n;
                conn.spill_bytes -= n;
                if spill.pos == spill.data.len() {
                    conn.spill.pop_front();
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if conn.spill.is_empty() && conn.out_pos == conn.out.len() {
        drop_written(conn);
    }
    Ok(())
}

/// Drops the written bytes from the front of the output; the journal gates and the large
/// bodies, which hold offsets into it, move with it.
fn drop_written(conn: &mut Conn) {
    let n = conn.out_pos;
    conn.out.drain(..n);
    conn.out_pos = 0;
    for gate in &mut conn.gates {
        gate.start = gate.start.saturating_sub(n);
    }
    if let Some(h) = &mut conn.hold_from {
        *h = h.saturating_sub(n);
    }
    for spill in &mut conn.spill {
        spill.at = spill.at.saturating_sub(n);
    }
}

/// Connections with answers held back for the journal (`Conn::gates`).
#[derive(Default)]
struct Gated {
    conns: Vec<ConnRef>,
    /// The newest record an answer held back this turn waits on: the journal's writer is told
    /// to sync it without delay ([`crate::journal::Journal::want`]).
    want: u64,
}

/// Appends an answer to a connection's output, held back until the journal is durable up to
/// what it shows (`Response::lsn`); a connection newly held back is added to `gated`.
#[allow(clippy::too_many_arguments)]
fn put_response(
    conn: &mut Conn,
    r: ConnRef,
    mut response: Response,
    close: bool,
    head_only: bool,
    http11: bool,
    durable_lsn: u64,
    gated: &mut Gated,
    date: &[u8],
) {
    if response.lsn > durable_lsn {
        gated.want = gated.want.max(response.lsn);
    }
    if conn.gate(response.lsn, durable_lsn) {
        gated.conns.push(r);
    }
    if let Some(s) = &mut response.stream {
        s.chunked = http11;
    }
    if head_only || response.stream.is_none() {
        write_response(conn, response, close, head_only, date);
        return;
    }
    // A streamed answer (`crate::stream`): its head and first piece now, the rest as the
    // output drains (`pump_stream`). Without chunks (HTTP/1.0) its end is the connection's.
    let close = close || !http11;
    response.close = close;
    response.write_head(&mut conn.out, date);
    let Some(body) = response.stream.take() else { return };
    if body.chunked {
        crate::stream::push_chunk(&mut conn.out, &response.body);
    } else {
        conn.out.extend_from_slice(&response.body);
    }
    if body.done {
        if body.chunked {
            conn.out.extend_from_slice(crate::stream::LAST_CHUNK);
        }
        return;
    }
    if let State::Http(http) = &mut conn.state {
        http.phase = Phase::Stream(Box::new(Streaming { body: *body, keep_alive: !close }));
    }
}

/// A held reply, a download or a streamed answer that has not been written completely yet.
fn answer_under_way(conn: &Conn) -> bool {
    matches!(&conn.state, State::Http(http) if matches!(http.phase, Phase::Held { .. } | Phase::Batch { .. } | Phase::Download(_) | Phase::Stream(_) | Phase::Upload(_)))
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

/// Appends an answer to a connection's output. A large body is not copied: it is kept as it
/// is and written a slice at a time (`Conn::spill`), so one large result costs the loop no
/// copy of its size and other connections are served between its slices.
fn write_response(conn: &mut Conn, mut response: Response, close: bool, head_only: bool, date: &[u8]) {
    // (A streamed answer goes through `put_response`; a head alone may announce one.)
    debug_assert!(head_only || response.stream.is_none(), "a streamed answer's first piece alone");
    response.close = close;
    if head_only || response.status == 304 || response.body.len() < SPILL_MIN_BYTES {
        response.write_to(&mut conn.out, head_only, date);
        return;
    }
    response.write_head(&mut conn.out, date);
    conn.push_spill(std::mem::take(&mut response.body));
}

/// Why the server could not start.
#[derive(Debug)]
pub enum StartError {
    /// The listening socket (exit 1).
    Listen(io::Error),
    /// DATA_DIR cannot be used: a configuration error (exit 2).
    DataDir(String),
    /// The journal could not be read (exit 1).
    Journal(String),
    Io(io::Error),
}

impl From<io::Error> for StartError {
    fn from(e: io::Error) -> StartError {
        StartError::Io(e)
    }
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Listen(e) | StartError::Io(e) => write!(f, "{e}"),
            StartError::DataDir(m) | StartError::Journal(m) => f.write_str(m),
        }
    }
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
    superseded: Vec<ConnRef>,
    fired: Vec<Timer>,
    accept_pending: bool,
    shutdown_flag: Arc<AtomicBool>,
    shutdown_started: bool,
    /// SHUTDOWN_TIMEOUT passed.
    shutdown_expired: bool,
    max_ws_out_bytes: usize,
    /// Input an HTTP connection may buffer: a head, the largest body, and a little more.
    http_input_cap: usize,
    store: Store,
    /// Which connection a disk transfer belongs to.
    transfers: HashMap<TransferId, ConnRef>,
    next_transfer: TransferId,
    /// Upload bytes queued to the disk thread and not yet written, over all uploads.
    disk: disk_budget::DiskBudget,
    /// Batch bodies buffered at once (`POST /tasks/batch`), over every connection.
    batches: disk_budget::BatchBudget,
    /// Connections with answers held back for the journal (`Conn::gates`).
    gated: Gated,
    /// The journal's durable sequence number when `gated` was last looked at.
    durable_seen: u64,
    /// Connections whose next submit waits because too many journal bytes are not yet durable.
    journal_blocked: Vec<ConnRef>,
    /// Connections whose request waits for the token registry to be re-read.
    auth_waiters: Vec<ConnRef>,
    /// Batch items that may still be submitted this turn (`api::BATCH_ITEMS_PER_TURN` over all
    /// batches, so many batches at once cannot hold the loop).
    batch_budget: usize,
    /// Unwritten HTTP output over every connection (each connection's part is its
    /// `out_counted`), against OUTPUT_MEMORY.
    out_total: usize,
    /// Under OUTPUT_MEMORY pressure: when stalled connections are next looked for.
    next_output_scan_ms: u64,
    /// The second the `Date` header was formatted for, and its text (once a second, not once
    /// an answer).
    date: (u64, [u8; 29]),
}

/// An `Io` for the start, before any connection exists.
struct NoIo;

impl Io for NoIo {
    fn send_text(&mut self, _: ConnRef, _: &[&str]) -> bool {
        false
    }
    fn reply(&mut self, _: ConnRef, _: Response) {}
}

/// The memory store, with the journal of `DATA_DIR` replayed into it (or memory only).
fn open_memory_store(cfg: &Config, wall_ms: u64, waker: &Arc<Waker>) -> Result<crate::store::Store, StartError> {
    let mem_cfg = crate::store::mem::MemConfig {
        task_ttl_ms: cfg.task_ttl_ms,
        failed_ttl_ms: cfg.failed_ttl_ms,
        max_pending: cfg.max_pending,
        max_pending_bytes: cfg.max_pending_bytes,
        task_memory_bytes: cfg.task_memory_bytes,
        task_timeout_ms: cfg.task_timeout_ms,
        max_retries: cfg.max_retries,
    };
    let Some(dir) = &cfg.data_dir else {
        return Ok(crate::store::Store::Mem(Box::new(crate::store::mem::MemStore::new(mem_cfg, None))));
    };
    let journal_waker = waker.clone();
    let wake: crate::journal::thread::Wake = Arc::new(move || {
        let _ = journal_waker.wake();
    });
    let (mut journal, replayed) =
        crate::journal::Journal::open(dir, cfg.task_memory_bytes, wall_ms, wake).map_err(|e| match e {
            crate::journal::OpenError::Unusable(m) => StartError::DataDir(m),
            crate::journal::OpenError::Io(m) => StartError::Journal(m),
        })?;
    journal.set_segment_bytes(cfg.journal_segment_bytes);
    let (records, skipped, truncated, elapsed) =
        (replayed.records, replayed.skipped, replayed.truncated_bytes, replayed.elapsed);
    let segments = replayed.segments.len();
    let mut mem = crate::store::mem::MemStore::new(mem_cfg, Some(Box::new(journal)));
    // Session workers' running attempts are held across the restart (SPEC §12).
    mem.hold_sessions = cfg.resume_window_ms > 0;
    mem.set_clock(0, wall_ms);
    let restored = mem.restore(replayed);
    let level = if skipped > 0 { Level::Error } else { Level::Info };
    crate::log!(
        level,
        "journal replayed",
        data_dir = dir.display(),
        tasks_restored = restored,
        pending = mem.task_count(crate::tasks::Status::Pending),
        records = records,
        records_skipped = skipped,
        torn_bytes_cut = truncated,
        segments = segments,
        replay_ms = elapsed.as_millis()
    );
    Ok(crate::store::Store::Mem(Box::new(mem)))
}

impl Server {
    /// Binds the listener and prepares the loop. Returns the server and the waker that
    /// helper threads (signals, later disk work) use to wake it.
    pub fn bind(cfg: Config, shutdown_flag: Arc<AtomicBool>) -> Result<(Server, Arc<Waker>), StartError> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let mut listener = TcpListener::bind(SocketAddr::new(cfg.bind, cfg.port)).map_err(StartError::Listen)?;
        poll.registry().register(&mut listener, LISTENER, Interest::READABLE)?;
        let local_addr = listener.local_addr()?;
        let started = Instant::now();
        let auth = crate::auth::Auth::new(&cfg.api_token, &cfg.worker_token);
        let token_cache = std::rc::Rc::new(std::cell::RefCell::new(crate::tokens::pg::TokenCache::default()));
        let auth = match &cfg.database {
            // Cluster mode: the node's cache of the database's registry (its turn transactions
            // refresh it).
            Some(_) => auth.with_db_tokens(cfg.token_secret.as_deref(), token_cache.clone()),
            None => auth.with_scoped_tokens(cfg.token_secret.as_deref(), &cfg.token_store),
        };
        let api = Api {
            auth,
            max_message_bytes: cfg.max_message_bytes,
            max_batch_bytes: cfg.max_batch_bytes,
            max_file_bytes: cfg.max_file_bytes,
        };
        let disk_waker = waker.clone();
        let wake_disk: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
            let _ = disk_waker.wake();
        });
        let wall = crate::timefmt::wall_ms();
        // The task store, chosen once: PostgreSQL (cluster mode, which also keeps files in the
        // database, where every node can read them), or memory with the journal or without.
        let (task_store, blobs) = match &cfg.database {
            Some(params) => {
                let pg = cluster::start_node(&cfg, params, local_addr.port(), waker.clone(), token_cache)?;
                let probe = pg.probe();
                let blobs = crate::files::pg::start(params.clone(), probe, cfg.blob_ttl_ms, wake_disk)?;
                (crate::store::Store::Pg(Box::new(pg)), blobs)
            }
            None => {
                (open_memory_store(&cfg, wall, &waker)?, crate::files::disk::start(cfg.blob_dir.clone(), wake_disk)?)
            }
        };
        let store = blobs;
        store.send(Job::Scan { now_wall_ms: crate::timefmt::wall_ms() });
        let mut core = Core::new(
            CoreConfig {
                task_timeout_ms: cfg.task_timeout_ms,
                max_retries: cfg.max_retries,
                wait_timeout_ms: cfg.wait_timeout_ms,
                retry_backoff_ms: cfg.retry_backoff_ms,
                retry_backoff_max_ms: cfg.retry_backoff_max_ms,
                retry_any_worker: cfg.retry_any_worker,
            },
            task_store,
            0,
            wall,
        );
        core.set_clock(0, wall);
        core.resume_window_ms = cfg.resume_window_ms;
        core.restore_held();
        {
            // Restored records (attempts a restart cut short) go out with the first turn.
            let mut nothing = NoIo;
            core.end_turn(&mut nothing);
        }
        let registry_waker = waker.clone();
        api.auth.start_registry_loader(Arc::new(move || {
            let _ = registry_waker.wake();
        }))?;
        core.wheel.arm(BLOB_SWEEP_MS, Timer::BlobSweep);
        let max_ws_out_bytes = cfg.max_message_bytes.saturating_mul(4).saturating_add(64 * 1024);
        let cfg_max_body = cfg.max_message_bytes;
        let cfg_max_batch = cfg.max_batch_bytes;
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
            superseded: Vec::new(),
            fired: Vec::new(),
            accept_pending: false,
            shutdown_flag,
            shutdown_started: false,
            shutdown_expired: false,
            max_ws_out_bytes,
            http_input_cap: MAX_HEAD_BYTES + cfg_max_body + 4096,
            store,
            transfers: HashMap::new(),
            next_transfer: 1,
            disk: disk_budget::DiskBudget::new(DISK_BUDGET_BYTES),
            batches: disk_budget::BatchBudget::new(
                cfg_max_batch.saturating_add(BATCH_FRAMING_SLACK_BYTES).saturating_mul(BATCH_BODIES_AT_ONCE),
                cfg_max_batch.saturating_add(BATCH_FRAMING_SLACK_BYTES),
            ),
            gated: Gated::default(),
            durable_seen: 0,
            journal_blocked: Vec::new(),
            auth_waiters: Vec::new(),
            batch_budget: crate::api::BATCH_ITEMS_PER_TURN,
            date: (wall / 1000, crate::timefmt::http_date(wall / 1000)),
            out_total: 0,
            next_output_scan_ms: 0,
        };
        Ok((server, waker))
    }

    fn tick_clock(&mut self) {
        self.now_ms = self.started.elapsed().as_millis() as u64;
        let wall = crate::timefmt::wall_ms();
        self.core.set_clock(self.now_ms, wall);
        if wall / 1000 != self.date.0 {
            self.date = (wall / 1000, crate::timefmt::http_date(wall / 1000));
        }
    }

    fn wire(&mut self) -> (Wire<'_>, &mut Core) {
        let (wire, core, _) = self.wire_and_api();
        (wire, core)
    }

    /// The core, its window on the connections, and the API, borrowed together.
    fn wire_and_api(&mut self) -> (Wire<'_>, &mut Core, &Api) {
        (
            Wire {
                durable_lsn: self.core.store.durable_lsn(),
                conns: &mut self.conns,
                dirty: &mut self.dirty,
                again: &mut self.again,
                superseded: &mut self.superseded,
                gated: &mut self.gated,
                max_ws_out_bytes: self.max_ws_out_bytes,
                shutting_down: self.shutdown_started,
                date: self.date.1,
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
            let timeout = if !self.again.is_empty() || !self.dirty.is_empty() || self.accept_pending {
                Some(Duration::ZERO)
            } else {
                // (Records the journal holds back go to its writer by their deadline.)
                let held = self.core.store.hold_deadline_ms();
                let at = match (self.core.wheel.next_wakeup_ms(), held) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                at.map(|at| Duration::from_millis(at.saturating_sub(self.now_ms)))
            };
            if let Err(e) = self.poll.poll(&mut events, timeout)
                && e.kind() != io::ErrorKind::Interrupted
            {
                return Err(e);
            }
            self.tick_clock();
            self.batch_budget = crate::api::BATCH_ITEMS_PER_TURN;
            for event in events.iter() {
                match event.token() {
                    LISTENER => self.accept_pending = true,
                    WAKER => {
                        self.on_disk_done();
                        self.on_journal()?;
                        {
                            let (mut wire, core) = self.wire();
                            core.on_wake(&mut wire);
                        }
                        if matches!(self.core.store, crate::store::Store::Pg(_)) {
                            // (Cluster mode: session rows committed, their task frames leave.)
                            self.release_gated(self.core.store.durable_lsn());
                        }
                        if !self.journal_full() && !self.journal_blocked.is_empty() {
                            // Cluster mode: submits held back for the insert backlog resume.
                            self.again.append(&mut self.journal_blocked);
                        }
                        // (After the node's replies: a token refresh may answer waiting requests.)
                        if self.api.auth.poll_registry() {
                            self.resume_auth_waiters();
                        }
                    }
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
            // The turn's records go to the journal (or, in cluster mode, the database) before
            // its answers are written, so the sync runs while the rest of the output leaves.
            self.core.store.want_durable(std::mem::take(&mut self.gated.want));
            {
                let (mut wire, core) = self.wire();
                core.end_turn(&mut wire);
            }
            for r in std::mem::take(&mut self.superseded) {
                if matches!(self.conns.get_mut(r).map(|c| &c.state), Some(State::Ws(_))) {
                    self.close_ws(r, CloseCode::Policy, "the session was resumed on another connection");
                }
            }
            self.flush_dirty();
            if self.output_pressure() && self.now_ms >= self.next_output_scan_ms {
                self.next_output_scan_ms = self.now_ms + OUTPUT_SCAN_MS;
                self.close_stalled_output();
            }
            // (Cluster mode: the attempts handed back at shutdown are written first, unless the
            // database is unreachable or SHUTDOWN_TIMEOUT passed.)
            let flushed = self.core.store.flushed() || self.shutdown_expired;
            if self.shutdown_started
                && flushed
                && (self.conns.is_empty() || (self.core.wheel.is_empty() && self.gated.conns.is_empty()))
            {
                // (With timers and journal waits gone, nothing could ever end the remaining
                // connections.) Everything accepted is made durable before the exit.
                self.core.store.stop().map_err(io::Error::other)?;
                crate::log!(Level::Info, "shutdown complete");
                return Ok(());
            }
        }
    }

    // ----- the journal -----------------------------------------------------------------------

    /// What waited for the store to be durable up to `durable` leaves: answers (journal), and
    /// session workers' task frames (journal, or in cluster mode their session rows' COMMIT).
    fn release_gated(&mut self, durable: u64) {
        if durable == self.durable_seen {
            return;
        }
        self.durable_seen = durable;
        let gated = std::mem::take(&mut self.gated.conns);
        for r in gated {
            let Some(conn) = self.conns.get_mut(r) else { continue };
            if conn.release_gates(durable) {
                self.gated.conns.push(r);
            }
            mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        }
    }

    /// The journal's threads woke the loop: answers it made durable leave, tasks read back are
    /// answered, and submits held back for the backlog resume. A failed write is fatal.
    fn on_journal(&mut self) -> io::Result<()> {
        let Some(j) = self.core.store.mem().and_then(|m| m.journal()) else { return Ok(()) };
        if j.failed() {
            return Err(io::Error::other("the journal could not be written (see the error above)"));
        }
        let durable = j.durable_lsn();
        let writable = j.writable();
        let backlog_full = self.core.store.backlog_full();
        self.release_gated(durable);
        // (A journal that cannot write refuses submits with 503: those waiting for the disk
        // to catch up go on to get that answer.)
        if (!backlog_full || !writable) && !self.journal_blocked.is_empty() {
            // Their requests' clock starts again (a body may still be on its way).
            let at = self.now_ms + self.cfg.header_timeout_ms;
            for r in std::mem::take(&mut self.journal_blocked) {
                if matches!(self.http_phase(r), Some(Phase::Body { .. })) {
                    self.set_deadline(r, at);
                }
                self.again.push(r);
            }
        }
        Ok(())
    }

    /// Too many journal bytes wait for the disk (or, in cluster mode, submitted payloads for
    /// the database): new submits wait (backpressure).
    fn journal_full(&self) -> bool {
        self.core.store.backlog_full()
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
                    self.shutdown_expired = true;
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
                    if conn.pending_out() == 0 {
                        self.close_now(r, "idle");
                        return;
                    }
                    // Still writing to a slow reader: fine while its output moves at all.
                    let stalled_at = conn.out_progress_ms + self.cfg.idle_timeout_ms;
                    if now >= stalled_at {
                        crate::log!(Level::Debug, "client stopped reading", client_ip = conn.client_ip);
                        self.close_now(r, "output made no progress within IDLE_TIMEOUT");
                    } else {
                        self.set_deadline(r, stalled_at);
                    }
                }
                Phase::Head | Phase::AuthWait(_) | Phase::Body { .. } => {
                    crate::log!(Level::Debug, "request timeout", client_ip = conn.client_ip);
                    self.respond_and_close(r, crate::http::error(408, "request not complete within HEADER_TIMEOUT"));
                }
                Phase::Held { .. } | Phase::Batch { .. } => {}
                Phase::Upload(_) => {
                    crate::log!(Level::Debug, "upload stalled", client_ip = conn.client_ip);
                    self.respond_and_close(r, crate::http::error(408, "upload made no progress within HEADER_TIMEOUT"));
                }
                Phase::Download(_) => self.close_now(r, "download stalled"),
                Phase::Stream(_) => self.close_now(r, "streamed answer stalled"),
            },
            State::Ws(ws) => {
                if !conn.gates.is_empty() {
                    // Its output (pings too) is held for the store — a session worker's task
                    // frame waits for its start to be durable, SPEC §12: it cannot answer pings
                    // it never got. Silence counts from when the output leaves.
                    ws.last_seen_ms = ws.last_seen_ms.max(now);
                }
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
                    // A held answer that went out (`Wire::reply`) leaves the connection idle
                    // with no deadline yet: it gets IDLE_TIMEOUT like any other answer.
                    let idle_unarmed = self.conns.get_mut(r).is_some_and(|c| {
                        c.deadline_ms == u64::MAX
                            && matches!(&c.state, State::Http(h) if matches!(h.phase, Phase::Idle))
                    });
                    if idle_unarmed {
                        let at = self.now_ms + self.cfg.idle_timeout_ms;
                        self.set_deadline(r, at);
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
        let durable = self.core.store.durable_lsn();
        let Some(conn) = self.conns.get_mut(r) else { return };
        conn.release_gates(durable);
        let total = conn.out.len() + conn.spill_bytes;
        let before = conn.pending_out();
        if write_out(conn).is_err() {
            self.close_now(r, "write error");
            return;
        }
        if conn.write_more {
            // A large body left a slice and the socket takes more: the next slice next turn,
            // after everyone else had theirs.
            mark_dirty(&mut conn.in_dirty, r, &mut self.dirty);
        }
        self.count_out(r);
        let Some(conn) = self.conns.get_mut(r) else { return };
        if conn.pending_out() < before || conn.pending_out() == 0 {
            conn.out_progress_ms = self.now_ms;
            // A worker still taking in a large frame cannot answer the ping queued behind it;
            // output moving past what socket buffers absorb shows it is reading.
            if let State::Ws(ws) = &mut conn.state
                && before > READER_PROOF_BYTES
            {
                ws.last_seen_ms = self.now_ms;
            }
        }
        let drained = conn.pending_out() <= self.max_ws_out_bytes / 2;
        if matches!(&conn.state, State::Ws(ws) if ws.starved) && drained {
            self.refill_worker(r);
        }
        let Some(conn) = self.conns.get_mut(r) else { return };
        if conn.pending_out() > 0 {
            // A writable event follows; a download or a streamed answer may still want its
            // next piece.
            self.pump_download(r);
            self.pump_stream(r);
            return;
        }
        // Requests may wait behind the output just written (more than MAX_HTTP_BACKLOG_BYTES
        // of it, possibly compacted since, so `total` alone cannot tell): look at them again.
        let had_backlog =
            total > MAX_HTTP_BACKLOG_BYTES || matches!(&conn.state, State::Http(http) if !http.buf.is_empty());
        if conn.out.capacity() > KEEP_OUT_CAPACITY {
            conn.out = Vec::new();
        }
        if conn.close_after_flush && !answer_under_way(conn) {
            // Once only: shutdown(2) on a socket whose writes are already shut down wakes it
            // again, and that writable event came back here — the loop spun at full CPU for
            // each connection lingering for its peer's close (after SIGTERM: beside the
            // downloads it must keep moving, SPEC §10).
            if !conn.write_shut {
                conn.write_shut = true;
                let _ = conn.stream.shutdown(std::net::Shutdown::Write);
            }
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
        self.pump_stream(r);
    }

    /// The core held tasks back for this worker (its output was full) and it has room again:
    /// give it more and write them. Again while that empties its output (a task that did not
    /// fit may go into an empty buffer, see `fits`); not when the socket takes nothing more —
    /// the next writable event comes back here. (Calling `flush` again instead recursed without
    /// end when a task never fitted.)
    fn refill_worker(&mut self, r: ConnRef) {
        loop {
            let Some(conn) = self.conns.get_mut(r) else { return };
            let State::Ws(ws) = &mut conn.state else { return };
            ws.starved = false;
            {
                let (mut wire, core) = self.wire();
                core.worker_drained(&mut wire, r);
            }
            let Some(conn) = self.conns.get_mut(r) else { return };
            if write_out(conn).is_err() {
                self.close_now(r, "write error");
                return;
            }
            let starved = matches!(&conn.state, State::Ws(ws) if ws.starved);
            if !starved || conn.pending_out() > 0 {
                return;
            }
        }
    }

    // ----- closing ---------------------------------------------------------------------------

    fn close_now(&mut self, r: ConnRef, why: &str) {
        self.release_batch(r);
        let Some(mut conn) = self.conns.remove(r) else { return };
        self.out_total = self.out_total.saturating_sub(conn.out_counted);
        self.core.metrics.output_buffered_bytes = self.out_total;
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

    // ----- output memory ---------------------------------------------------------------------

    /// Brings the sum of unwritten HTTP output up to date with `r`'s (a worker's frames are
    /// bounded per worker instead, and do not count). A streamed answer's snapshot (cluster
    /// mode's `GET /kinds` rows, `crate::stream`) is output not written yet, and counts too.
    pub(super) fn count_out(&mut self, r: ConnRef) {
        let Some(conn) = self.conns.get_mut(r) else { return };
        let now = match &conn.state {
            State::Ws(_) => 0,
            State::Http(http) => match &http.phase {
                Phase::Stream(st) => conn.pending_out() + st.body.held_bytes(),
                _ => conn.pending_out(),
            },
            _ => conn.pending_out(),
        };
        self.out_total = self.out_total.saturating_sub(conn.out_counted) + now;
        conn.out_counted = now;
        self.core.metrics.output_buffered_bytes = self.out_total;
    }

    /// OUTPUT_MEMORY is used up: a connection with unwritten output gets no new answer (and a
    /// download no new chunk) until its output is gone.
    pub(super) fn output_pressure(&self) -> bool {
        self.out_total > self.cfg.output_memory_bytes
    }

    /// Under pressure: HTTP connections whose output made no progress for OUTPUT_STALL_MS are
    /// closed, so clients that do not read cannot hold OUTPUT_MEMORY against those that do.
    fn close_stalled_output(&mut self) {
        let now = self.now_ms;
        for r in self.conns.refs() {
            let Some(conn) = self.conns.get_mut(r) else { continue };
            let stalled = !matches!(conn.state, State::Ws(_))
                && conn.pending_out() > 0
                && now.saturating_sub(conn.out_progress_ms) >= OUTPUT_STALL_MS;
            if stalled {
                crate::log!(
                    Level::Info,
                    "client not reading while OUTPUT_MEMORY is used up: closed",
                    client_ip = conn.client_ip,
                    unwritten_bytes = conn.pending_out()
                );
                self.core.metrics.output_stalled_closed += 1;
                self.close_now(r, "output stalled under OUTPUT_MEMORY pressure");
                if !self.output_pressure() {
                    return;
                }
            }
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
        // Nothing is accepted any more: a pending accept must not keep the poll at a zero
        // timeout (a busy loop for the rest of the grace period, beside the downloads).
        self.accept_pending = false;
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
                State::Ws(_) => {
                    if self.core.is_session_worker(r) {
                        // It reconnects at once and resumes on the next run (SPEC §12).
                        self.send_reconnect(r);
                    }
                    self.close_ws(r, CloseCode::Away, "server shutting down")
                }
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

    /// Sets a socket buffer size (`SO_SNDBUF`/`SO_RCVBUF`), so a test can fill a socket fast.
    fn set_buf(fd: std::os::fd::RawFd, opt: libc::c_int, bytes: libc::c_int) {
        // SAFETY: setsockopt on a socket we own, with a pointer to a live c_int of the size given.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&bytes as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "setsockopt");
    }

    /// `write_out` drops the written part of a slow reader's buffer (more than 64 KiB written,
    /// then the socket would block) but left the journal gates' offsets as they were: the next
    /// write went past the held answer (sent before it was durable) or past the end of the
    /// buffer (a panic on the event loop).
    #[test]
    fn answers_held_for_the_journal_stay_held_when_written_output_is_dropped() {
        use std::io::Read as _;
        use std::os::fd::AsRawFd;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut client = std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (server, peer) = listener.accept().expect("accept");
        set_buf(server.as_raw_fd(), libc::SO_SNDBUF, 16384);
        set_buf(client.as_raw_fd(), libc::SO_RCVBUF, 16384);
        server.set_nonblocking(true).expect("nonblocking");
        client.set_nonblocking(true).expect("nonblocking");
        let mut conn = Conn::new(TcpStream::from_std(server), peer.ip());
        let free = 200 * 1024;
        conn.out.extend(std::iter::repeat_n(b'a', free));
        assert!(conn.gate(7, 0), "a new wait");
        conn.out.extend_from_slice(b"HELD");
        let mut got = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        let mut read_all = |client: &mut std::net::TcpStream, got: &mut Vec<u8>| loop {
            match client.read(&mut chunk) {
                Ok(0) => panic!("closed"),
                Ok(n) => got.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => panic!("read: {e}"),
            }
        };
        let mut compacted = false;
        let deadline = Instant::now() + Duration::from_secs(20);
        while !(got.len() >= free && compacted) && Instant::now() < deadline {
            let len = conn.out.len();
            write_out(&mut conn).expect("write");
            compacted |= conn.out.len() < len;
            let before = got.len();
            read_all(&mut client, &mut got);
            if got.len() == before {
                std::thread::sleep(Duration::from_millis(1)); // (a tiny TCP window reopens on a timer)
            }
        }
        assert!(compacted, "the test never made write_out drop written bytes");
        // Give the socket every chance to take more: nothing past the gate may leave.
        for _ in 0..20 {
            write_out(&mut conn).expect("write");
            read_all(&mut client, &mut got);
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(got.len(), free, "bytes held for the journal were sent before it was durable");
        assert!(!conn.release_gates(7));
        let deadline = Instant::now() + Duration::from_secs(10);
        while got.len() < free + 4 && Instant::now() < deadline {
            write_out(&mut conn).expect("write");
            read_all(&mut client, &mut got);
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(got.ends_with(b"aHELD") && got.len() == free + 4, "the held answer follows, whole");
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
