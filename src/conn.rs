//! One connection: its socket, its output buffer, and its state machine
//! `Http → (Ws) → Closing`. The reactor drives it; this module owns the data and the small
//! adapters tungstenite needs, and never calls `poll` or reads the clock.

use std::io::{self, Read, Write};
use std::net::IpAddr;

use mio::net::TcpStream;
use tungstenite::protocol::{Role, WebSocketConfig, WebSocketContext};

use crate::auth::Identity;
use crate::files::{TransferId, UploadParse};
use crate::http::{ChunkedDecoder, Head, Method};
use crate::timer::TimerHandle;

pub struct Conn {
    pub stream: TcpStream,
    pub peer_ip: IpAddr,
    /// The client's address as logs and the API show it: the peer, or what a trusted proxy
    /// said in the latest request (`TRUSTED_PROXIES`).
    pub client_ip: IpAddr,
    /// Bytes waiting to be written; `out[out_pos..]` is what is left.
    pub out: Vec<u8>,
    pub out_pos: usize,
    pub state: State,
    /// When the connection's timer should act (`u64::MAX`: never).
    pub deadline_ms: u64,
    /// The armed timer and the time it was armed for.
    pub timer: Option<(u64, TimerHandle)>,
    /// Reading stopped before `WouldBlock` (buffer full, request held, or a turn's limit):
    /// edge-triggered readiness will not tell us again, so the reactor must come back.
    pub read_more: bool,
    pub in_dirty: bool,
    /// Once `out` is flushed, shut down writes and linger until the peer closes.
    pub close_after_flush: bool,
    /// Writes are shut down (once: every `shutdown(2)` wakes the socket's waiters, and under
    /// edge-triggered epoll each wake is a new writable event that would come back here).
    pub write_shut: bool,
    /// When the output last made progress (bytes written, or all of it drained): an HTTP
    /// client whose output is stuck for IDLE_TIMEOUT is closed.
    pub out_progress_ms: u64,
    /// Answers that may not leave before the journal is durable up to `lsn`: bytes from
    /// `start` in `out` on wait (in order; the sequence numbers never decrease).
    pub gates: std::collections::VecDeque<Gate>,
    /// While a session worker's messages are handled: nothing from here on is written yet (what
    /// they cause — a pong, a freed slot's next task — may have to wait for what they journal).
    pub hold_from: Option<usize>,
    /// Large bodies kept as they are rather than copied into `out`, each written where it
    /// belongs (`Spill::at`), a slice at a time.
    pub spill: std::collections::VecDeque<Spill>,
    /// Bytes of `spill` not yet written.
    pub spill_bytes: usize,
    /// The unwritten output the reactor last counted for this connection (its share of the
    /// sum it keeps against OUTPUT_MEMORY).
    pub out_counted: usize,
    /// A write stopped at its slice with the socket still taking bytes: write again next turn.
    pub write_more: bool,
}

/// A body that leaves after `out[..at]` and before `out[at..]`.
pub struct Spill {
    pub at: usize,
    pub data: Vec<u8>,
    pub pos: usize,
}

#[derive(Debug, Clone, Copy)]
pub struct Gate {
    pub lsn: u64,
    pub start: usize,
}

pub enum State {
    Http(Http),
    Ws(Box<Ws>),
    /// Writes shut down (or about to be): reads are drained and discarded until EOF.
    Closing,
}

pub struct Http {
    /// Input not yet consumed (a partial request, or pipelined ones).
    pub buf: Vec<u8>,
    /// How much of `buf` was already searched for the end of the head.
    pub scanned: usize,
    pub phase: Phase,
    pub requests: u64,
    /// The peer half-closed (read returned 0): what `buf` holds is still answered, then the
    /// connection closes.
    pub eof: bool,
    /// Bytes of the shared batch budget this connection holds for a `POST /tasks/batch` body.
    pub batch_reserved: usize,
}

pub enum Phase {
    /// Between requests (or before the first byte of the first one).
    Idle,
    /// Some bytes of a head have arrived.
    Head,
    /// The head is parsed, and its token waits for the registry's new version to be read
    /// (off the loop); the request is checked again once it is in.
    AuthWait(Box<Head>),
    /// The head is parsed (and passed its checks as `identity`); the body is arriving.
    Body { head: Box<Head>, identity: Option<Identity>, chunked: Option<Box<(ChunkedDecoder, Vec<u8>)>> },
    /// The core holds the response (`wait=true`, or any answer a database transaction gives
    /// in cluster mode); `keep_alive` is the request's, `method` and `path` are for its log line.
    /// `http11`: the answer may be chunked (a streamed one, `crate::stream`).
    Held { keep_alive: bool, head_only: bool, http11: bool, method: Method, path: Box<str> },
    /// `POST /tasks/batch`: items are submitted a slice per loop turn.
    Batch { batch: Box<crate::api::Batch>, keep_alive: bool },
    /// `POST /files`: the body streams through the multipart parser to the disk thread.
    Upload(Box<Upload>),
    /// `GET /files/{id}`: the file streams from the disk thread to the socket.
    Download(Box<Download>),
    /// An answer written a piece at a time as its output drains (`GET /kinds`, `crate::stream`).
    Stream(Box<Streaming>),
}

pub struct Streaming {
    pub body: crate::stream::BodyStream,
    pub keep_alive: bool,
}

pub struct Upload {
    pub transfer: TransferId,
    pub file_id: u128,
    pub keep_alive: bool,
    /// `None` once finished.
    pub parse: Option<UploadParse>,
    /// For chunked bodies: the decoder and the decoded bytes not yet parsed.
    pub chunked: Option<(ChunkedDecoder, Vec<u8>)>,
    /// Content-Length bytes not yet consumed (unused for chunked bodies).
    pub body_left: u64,
    /// File bytes sent to the disk thread and not yet written.
    pub disk_bytes: usize,
    /// The Finish job is sent; waiting for its answer.
    pub finishing: bool,
}

pub struct Download {
    pub transfer: TransferId,
    pub keep_alive: bool,
    pub head_only: bool,
    pub range: Option<String>,
    /// `If-Range`: the range applies only while the file's ETag is this one.
    pub if_range: Option<String>,
    /// `If-None-Match`: 304 when the file's ETag is among these.
    pub if_none_match: Option<String>,
    /// The file is open and the head is written.
    pub started: bool,
    pub next: u64,
    pub end: u64,
    /// A Read job is outstanding.
    pub reading: bool,
}

pub struct Ws {
    pub ctx: WebSocketContext,
    pub last_seen_ms: u64,
    pub next_ping_ms: u64,
    /// The core was told its output buffer is full (`Io::has_room`): tell it when it drains.
    pub starved: bool,
    /// The worker sent a close frame (it is stopping: its session ends, SPEC §12).
    pub peer_closed: bool,
}

impl Conn {
    pub fn new(stream: TcpStream, peer_ip: IpAddr) -> Conn {
        Conn {
            stream,
            peer_ip,
            client_ip: peer_ip,
            out: Vec::new(),
            out_pos: 0,
            state: State::Http(Http {
                buf: Vec::new(),
                scanned: 0,
                phase: Phase::Idle,
                requests: 0,
                eof: false,
                batch_reserved: 0,
            }),
            deadline_ms: u64::MAX,
            timer: None,
            read_more: false,
            in_dirty: false,
            close_after_flush: false,
            write_shut: false,
            gates: std::collections::VecDeque::new(),
            hold_from: None,
            out_progress_ms: 0,
            spill: std::collections::VecDeque::new(),
            spill_bytes: 0,
            out_counted: 0,
            write_more: false,
        }
    }

    pub fn pending_out(&self) -> usize {
        self.out.len() - self.out_pos + self.spill_bytes
    }

    /// Queues `body` to leave after everything appended to `out` so far.
    pub fn push_spill(&mut self, body: Vec<u8>) {
        self.spill_bytes += body.len();
        self.spill.push_back(Spill { at: self.out.len(), data: body, pos: 0 });
    }

    /// Starts holding the bytes appended from now on until the journal is durable up to
    /// `lsn`. `true` if this is a new wait (the reactor must remember the connection).
    pub fn gate(&mut self, lsn: u64, durable_lsn: u64) -> bool {
        if lsn <= durable_lsn {
            return false;
        }
        let lsn = self.gates.back().map_or(lsn, |g| g.lsn.max(lsn));
        let first = self.gates.is_empty();
        self.gates.push_back(Gate { lsn, start: self.out.len() });
        first
    }

    /// Holds the bytes appended from `start` on (an earlier length of `out`, this turn) until
    /// the journal is durable up to `lsn`: gates already set from `start` on wait for it too.
    /// `true` if this is a new wait.
    pub fn gate_from(&mut self, start: usize, lsn: u64, durable_lsn: u64) -> bool {
        if lsn <= durable_lsn {
            return false;
        }
        let start = start.clamp(self.out_pos, self.out.len());
        let first = self.gates.is_empty();
        let at = self.gates.iter().position(|g| g.start >= start).unwrap_or(self.gates.len());
        for g in self.gates.iter_mut().skip(at) {
            g.lsn = g.lsn.max(lsn);
        }
        let lsn = if at > 0 { self.gates[at - 1].lsn.max(lsn) } else { lsn };
        self.gates.insert(at, Gate { lsn, start });
        first
    }

    /// Releases what the journal made durable; `true` while something still waits.
    pub fn release_gates(&mut self, durable_lsn: u64) -> bool {
        while self.gates.front().is_some_and(|g| g.lsn <= durable_lsn) {
            self.gates.pop_front();
        }
        !self.gates.is_empty()
    }

    /// How far `out` may be written now.
    pub fn writable_end(&self) -> usize {
        let gated = self.gates.front().map_or(self.out.len(), |g| g.start);
        self.hold_from.map_or(gated, |h| gated.min(h))
    }
}

/// tungstenite's view of a connection. Reads come from `input` — bytes the reactor already
/// read from the socket in one syscall — and end in `WouldBlock` when it is used up (never
/// `Ok(0)`, which would mean EOF); writes are appended to the connection's own output buffer
/// and never block, so the reactor decides when bytes hit the socket.
pub struct WsIo<'a> {
    pub input: &'a [u8],
    pub pos: usize,
    pub out: &'a mut Vec<u8>,
}

impl<'a> WsIo<'a> {
    /// For writing only.
    pub fn writer(out: &'a mut Vec<u8>) -> WsIo<'a> {
        WsIo { input: &[], pos: 0, out }
    }
}

impl Read for WsIo<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let rest = &self.input[self.pos..];
        if rest.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let n = rest.len().min(buf.len());
        buf[..n].copy_from_slice(&rest[..n]);
        self.pos += n;
        Ok(n)
    }
}

impl Write for WsIo<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Appends one unmasked, final text frame (server to client, RFC 6455 §5.2) whose payload is
/// `parts` concatenated (`len` bytes in all): the hot path of sending tasks, with no copy into
/// an intermediate string or into tungstenite's buffer.
pub fn push_text_frame(out: &mut Vec<u8>, parts: &[&str], len: usize) {
    out.reserve(10 + len);
    out.push(0x81);
    if len < 126 {
        out.push(len as u8);
    } else if len <= usize::from(u16::MAX) {
        out.push(126);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(127);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
    for part in parts {
        out.extend_from_slice(part.as_bytes());
    }
}

/// Bytes tungstenite reserves for reading per connection: small, because idle workers are many
/// (a larger message grows the buffer for as long as it needs).
pub const WS_READ_BUFFER_BYTES: usize = 2048;

/// Every tungstenite limit set explicitly (its defaults are 128 KiB buffers and no write cap).
pub fn ws_config(max_message_bytes: usize) -> WebSocketConfig {
    WebSocketConfig::default()
        .read_buffer_size(WS_READ_BUFFER_BYTES)
        // Frames go straight through to `WsIo`, which only appends to our buffer.
        .write_buffer_size(0)
        .max_write_buffer_size(max_message_bytes + 64 * 1024)
        .max_message_size(Some(max_message_bytes))
        .max_frame_size(Some(max_message_bytes))
        .accept_unmasked_frames(false)
}

pub fn ws_context(leftover: Vec<u8>, max_message_bytes: usize) -> WebSocketContext {
    WebSocketContext::from_partially_read(leftover, Role::Server, Some(ws_config(max_message_bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tungstenite::protocol::frame::FrameSocket;

    #[test]
    fn frames_we_write_are_frames_tungstenite_reads() {
        for len in [0usize, 1, 125, 126, 127, 65_535, 65_536, 200_000] {
            let text = "x".repeat(len);
            let (a, b) = text.split_at(len / 2);
            let mut out = Vec::new();
            push_text_frame(&mut out, &[a, b], len);
            let mut socket = FrameSocket::new(std::io::Cursor::new(out));
            let frame = socket.read(None).expect("readable").expect("a frame");
            assert!(frame.header().is_final);
            assert_eq!(frame.payload().len(), len);
            assert_eq!(frame.into_text().expect("text").as_str(), text);
        }
    }
}
