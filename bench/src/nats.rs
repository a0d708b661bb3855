//! A blocking client for the NATS text protocol, just what request-reply and a JetStream work
//! queue need: INFO/CONNECT, SUB (with a queue group), PUB/HPUB with a reply subject, MSG/HMSG,
//! PING/PONG, and the few JetStream API calls (plain request-reply on `$JS.API.*` subjects) that
//! create a stream and a pull consumer. Used for the peers' responders, workers and requesters;
//! it never talks to anything but a nats-server on loopback.

use std::fmt;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Cap on a protocol line and on a message payload.
const MAX_LINE_BYTES: usize = 64 * 1024;
const MAX_PAYLOAD_BYTES: usize = 1 << 20;
const READ_CHUNK_BYTES: usize = 16 * 1024;

pub struct NatsConn {
    stream: TcpStream,
    buf: Vec<u8>,
    /// Start of the unread bytes in `buf`.
    pos: usize,
    out: Vec<u8>,
}

#[derive(Debug)]
pub enum Error {
    /// The read timeout passed with nothing (or only part of an operation) to read.
    Timeout,
    Io(String),
    Protocol(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Timeout => f.write_str("read timed out"),
            Error::Io(e) => write!(f, "I/O: {e}"),
            Error::Protocol(e) => write!(f, "protocol: {e}"),
        }
    }
}

impl From<Error> for String {
    fn from(e: Error) -> String {
        e.to_string()
    }
}

/// One server operation. `Msg` borrows nothing: the reply subject is copied (it is short).
/// `payload_len` is everything after the line (for HMSG: headers and body); `header_len` is the
/// headers' share of it (0 for MSG).
#[derive(Debug, PartialEq)]
pub enum Op {
    Msg { sid: u64, reply: Option<String>, header_len: usize, payload_len: usize },
    Ping,
    Pong,
    Ok,
    Info,
    Err(String),
}

impl NatsConn {
    /// Connects, reads INFO, sends CONNECT (no echo, not verbose) and waits for the PONG that
    /// proves the server processed it.
    pub fn connect(addr: SocketAddr, name: &str, io_timeout: Duration) -> Result<NatsConn, String> {
        NatsConn::connect_with(addr, name, io_timeout, false)
    }

    /// `connect`, with headers (HPUB/HMSG) and no-responders status messages turned on when
    /// `headers` (JetStream needs them; core request-reply does without, as before).
    pub fn connect_with(addr: SocketAddr, name: &str, io_timeout: Duration, headers: bool) -> Result<NatsConn, String> {
        let stream = TcpStream::connect_timeout(&addr, io_timeout).map_err(|e| format!("connect {addr}: {e}"))?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        stream.set_read_timeout(Some(io_timeout)).map_err(|e| e.to_string())?;
        stream.set_write_timeout(Some(io_timeout)).map_err(|e| e.to_string())?;
        let mut conn =
            NatsConn { stream, buf: Vec::with_capacity(READ_CHUNK_BYTES), pos: 0, out: Vec::with_capacity(512) };
        match conn.read_op().map_err(String::from)? {
            Op::Info => {}
            other => return Err(format!("expected INFO, got {other:?}")),
        }
        let connect = format!(
            "CONNECT {{\"verbose\":false,\"pedantic\":false,\"echo\":false,\"headers\":{headers},\"no_responders\":{headers},\"name\":\"{name}\",\"lang\":\"rust\",\"version\":\"0.1.0\",\"protocol\":1}}\r\n"
        );
        conn.stream.write_all(connect.as_bytes()).map_err(|e| format!("write: {e}"))?;
        conn.sync()?;
        Ok(conn)
    }

    /// Subscribes `sid` to `subject` (in `queue` if given).
    pub fn sub(&mut self, subject: &str, queue: Option<&str>, sid: u64) -> Result<(), String> {
        let line = match queue {
            Some(q) => format!("SUB {subject} {q} {sid}\r\n"),
            None => format!("SUB {subject} {sid}\r\n"),
        };
        self.stream.write_all(line.as_bytes()).map_err(|e| format!("write: {e}"))
    }

    /// PING and wait for PONG: everything sent before is processed by the server.
    pub fn sync(&mut self) -> Result<(), String> {
        self.stream.write_all(b"PING\r\n").map_err(|e| format!("write: {e}"))?;
        loop {
            match self.read_op().map_err(String::from)? {
                Op::Pong => return Ok(()),
                Op::Ping => self.stream.write_all(b"PONG\r\n").map_err(|e| format!("write: {e}"))?,
                Op::Err(e) => return Err(format!("-ERR {e}")),
                Op::Msg { payload_len, .. } => self.consume(payload_len),
                Op::Ok | Op::Info => {}
            }
        }
    }

    /// Publishes `payload` on `subject`, with a reply subject if given; one write.
    pub fn publish(&mut self, subject: &str, reply: Option<&str>, payload: &[u8]) -> Result<(), String> {
        self.out.clear();
        self.queue_publish(subject, reply, None, payload);
        self.flush()
    }

    /// Appends a PUB (or, with `headers`, an HPUB) to the output buffer without writing it:
    /// several go out in one write with `flush`. `headers` is a complete header block
    /// (`NATS/1.0\r\nKey: value\r\n\r\n`, see `header_block`).
    pub fn queue_publish(&mut self, subject: &str, reply: Option<&str>, headers: Option<&[u8]>, payload: &[u8]) {
        self.out.extend_from_slice(if headers.is_some() { b"HPUB " } else { b"PUB " });
        self.out.extend_from_slice(subject.as_bytes());
        if let Some(r) = reply {
            self.out.push(b' ');
            self.out.extend_from_slice(r.as_bytes());
        }
        let h = headers.unwrap_or_default();
        if headers.is_some() {
            self.out.extend_from_slice(format!(" {} {}\r\n", h.len(), h.len() + payload.len()).as_bytes());
        } else {
            self.out.extend_from_slice(format!(" {}\r\n", payload.len()).as_bytes());
        }
        self.out.extend_from_slice(h);
        self.out.extend_from_slice(payload);
        self.out.extend_from_slice(b"\r\n");
    }

    /// Writes everything queued by `queue_publish` in one write.
    pub fn flush(&mut self) -> Result<(), String> {
        let r = self.stream.write_all(&self.out).map_err(|e| format!("write: {e}"));
        self.out.clear();
        r
    }

    /// The payload (headers and body) of the `Op::Msg` just read; valid until `consume`.
    pub fn payload(&self, payload_len: usize) -> &[u8] {
        &self.buf[self.pos..(self.pos + payload_len).min(self.buf.len())]
    }

    /// A request on `subject` answered on `inbox` (already subscribed as `sid`): the answer's
    /// body, headers left out. A NATS status message (e.g. 503, no responders: JetStream not
    /// ready yet) is an error naming the status.
    pub fn request(&mut self, subject: &str, inbox: &str, sid: u64, body: &[u8]) -> Result<Vec<u8>, String> {
        self.publish(subject, Some(inbox), body)?;
        loop {
            match self.read_op().map_err(String::from)? {
                Op::Msg { sid: s, header_len, payload_len, .. } if s == sid => {
                    let all = self.payload(payload_len);
                    let (head, body) = all.split_at(header_len.min(all.len()));
                    let status = header_status(head);
                    let body = body.to_vec();
                    self.consume(payload_len);
                    if let Some(code) = status.filter(|_| body.is_empty()) {
                        return Err(format!("{subject}: status {code}"));
                    }
                    return Ok(body);
                }
                Op::Msg { payload_len, .. } => self.consume(payload_len),
                Op::Ping => self.pong()?,
                Op::Err(e) => return Err(format!("-ERR {e}")),
                Op::Pong | Op::Ok | Op::Info => {}
            }
        }
    }

    /// Reads the next operation. After `Op::Msg`, the payload is at the front of the buffer:
    /// call `consume(payload_len)` before reading again. On `Error::Timeout` nothing is lost: the
    /// same call can be repeated.
    pub fn read_op(&mut self) -> Result<Op, Error> {
        loop {
            if let Some(i) = self.buf[self.pos..].windows(2).position(|w| w == b"\r\n") {
                let line_end = self.pos + i;
                let line = std::str::from_utf8(&self.buf[self.pos..line_end])
                    .map_err(|_| Error::Protocol("non-UTF-8 line".into()))?;
                let op = parse_line(line).map_err(Error::Protocol)?;
                let need = match op {
                    Op::Msg { payload_len, .. } if payload_len > MAX_PAYLOAD_BYTES => {
                        return Err(Error::Protocol(format!("payload of {payload_len} bytes")));
                    }
                    Op::Msg { payload_len, .. } => payload_len + 2,
                    _ => 0,
                };
                // The position moves only once the whole operation is buffered.
                if self.buf.len() - (line_end + 2) >= need {
                    self.pos = line_end + 2;
                    return Ok(op);
                }
            } else if self.buf.len() - self.pos > MAX_LINE_BYTES {
                return Err(Error::Protocol("protocol line too long".into()));
            }
            self.fill()?;
        }
    }

    /// Drops a message payload (and its CRLF) read by `read_op`.
    pub fn consume(&mut self, payload_len: usize) {
        self.pos = (self.pos + payload_len + 2).min(self.buf.len());
    }

    pub fn pong(&mut self) -> Result<(), String> {
        self.stream.write_all(b"PONG\r\n").map_err(|e| format!("write: {e}"))
    }

    fn fill(&mut self) -> Result<(), Error> {
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        let len = self.buf.len();
        self.buf.resize(len + READ_CHUNK_BYTES, 0);
        let read = self.stream.read(&mut self.buf[len..]);
        self.buf.truncate(len + *read.as_ref().unwrap_or(&0));
        match read {
            Ok(0) => Err(Error::Io("connection closed by nats-server".into())),
            Ok(_) => Ok(()),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Err(Error::Timeout),
            Err(e) => Err(Error::Io(format!("read: {e}"))),
        }
    }

    /// A read that waits longer than this returns `Error::Timeout` (responders poll a flag).
    pub fn set_read_timeout(&self, timeout: Duration) -> Result<(), String> {
        self.stream.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())
    }
}

fn parse_line(line: &str) -> Result<Op, String> {
    let (verb, rest) = line.split_once(' ').unwrap_or((line, ""));
    match verb {
        "MSG" => {
            // MSG <subject> <sid> [reply-to] <#bytes>
            let parts: Vec<&str> = rest.split_whitespace().collect();
            let (sid, reply, len) = match parts.as_slice() {
                [_, sid, len] => (sid, None, len),
                [_, sid, reply, len] => (sid, Some(reply.to_string()), len),
                _ => return Err(format!("bad MSG line {line:?}")),
            };
            let sid = sid.parse().map_err(|_| format!("bad sid in {line:?}"))?;
            let payload_len = len.parse().map_err(|_| format!("bad size in {line:?}"))?;
            Ok(Op::Msg { sid, reply, header_len: 0, payload_len })
        }
        "HMSG" => {
            // HMSG <subject> <sid> [reply-to] <#header bytes> <#total bytes>
            let parts: Vec<&str> = rest.split_whitespace().collect();
            let (sid, reply, hlen, len) = match parts.as_slice() {
                [_, sid, hlen, len] => (sid, None, hlen, len),
                [_, sid, reply, hlen, len] => (sid, Some(reply.to_string()), hlen, len),
                _ => return Err(format!("bad HMSG line {line:?}")),
            };
            let sid = sid.parse().map_err(|_| format!("bad sid in {line:?}"))?;
            let header_len: usize = hlen.parse().map_err(|_| format!("bad header size in {line:?}"))?;
            let payload_len: usize = len.parse().map_err(|_| format!("bad size in {line:?}"))?;
            if header_len > payload_len {
                return Err(format!("header larger than the message in {line:?}"));
            }
            Ok(Op::Msg { sid, reply, header_len, payload_len })
        }
        "PING" => Ok(Op::Ping),
        "PONG" => Ok(Op::Pong),
        "+OK" => Ok(Op::Ok),
        "INFO" => Ok(Op::Info),
        "-ERR" => Ok(Op::Err(rest.to_string())),
        _ => Err(format!("unknown operation {line:?}")),
    }
}

/// A header block with the given fields, as HPUB wants it.
pub fn header_block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut h = b"NATS/1.0\r\n".to_vec();
    for (k, v) in fields {
        h.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    h.extend_from_slice(b"\r\n");
    h
}

/// The status code of a header block's first line (`NATS/1.0 408 Request Timeout`), if any.
pub fn header_status(head: &[u8]) -> Option<u16> {
    let first = head.split(|&b| b == b'\r').next()?;
    let rest = first.strip_prefix(b"NATS/1.0 ")?;
    std::str::from_utf8(rest.get(..3)?).ok()?.parse().ok()
}

/// The value of header `name` (case-insensitive) in a header block.
pub fn header_value<'a>(head: &'a [u8], name: &str) -> Option<&'a str> {
    let text = std::str::from_utf8(head).ok()?;
    text.split("\r\n").skip(1).find_map(|line| {
        let (k, v) = line.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// The few JetStream API calls the bench needs: a work-queue stream on file storage and a durable
/// pull consumer with explicit acks. Every call is a request on `$JS.API.*` whose JSON answer
/// carries `"error"` when it failed.
pub mod js {
    use super::NatsConn;

    /// Sid of the inbox API answers come to (distinct from the callers' own sids).
    const API_SID: u64 = 90;

    pub fn api(conn: &mut NatsConn, inbox: &str, subject: &str, body: &str) -> Result<String, String> {
        let text = String::from_utf8_lossy(&conn.request(subject, inbox, API_SID, body.as_bytes())?).into_owned();
        if text.contains("\"error\"") { Err(format!("{subject}: {text}")) } else { Ok(text) }
    }

    /// Subscribes the API inbox on `conn` (once per connection, before `api`).
    pub fn api_inbox(conn: &mut NatsConn, inbox: &str) -> Result<(), String> {
        conn.sub(inbox, None, API_SID)?;
        conn.sync()
    }

    /// Creates stream `name` (file storage, work-queue retention) over `subject`.
    pub fn create_work_queue(conn: &mut NatsConn, inbox: &str, name: &str, subject: &str) -> Result<(), String> {
        let config = format!(
            r#"{{"name":"{name}","subjects":["{subject}"],"retention":"workqueue","storage":"file","discard":"old","num_replicas":1,"max_msgs":-1,"max_bytes":-1,"max_age":0}}"#
        );
        api(conn, inbox, &format!("$JS.API.STREAM.CREATE.{name}"), &config).map(drop)
    }

    /// Creates the durable pull consumer `durable` on `stream`: explicit acks, deliver all.
    pub fn create_pull_consumer(
        conn: &mut NatsConn,
        inbox: &str,
        stream: &str,
        durable: &str,
        max_ack_pending: u64,
    ) -> Result<(), String> {
        let config = format!(
            r#"{{"stream_name":"{stream}","config":{{"durable_name":"{durable}","ack_policy":"explicit","deliver_policy":"all","ack_wait":30000000000,"max_deliver":-1,"max_ack_pending":{max_ack_pending},"max_waiting":512}}}}"#
        );
        // DURABLE.CREATE: 2.9 takes a durable only there; newer servers still accept it.
        api(conn, inbox, &format!("$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}"), &config).map(drop)
    }

    /// The subject a pull request for `batch` messages goes to (its reply subject is the
    /// worker's inbox, where the messages arrive, each with its ack subject as reply).
    pub fn next_subject(stream: &str, durable: &str) -> String {
        format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines() {
        fn check(line: &str, expected: Result<Op, ()>) {
            assert_eq!(parse_line(line).map_err(|_| ()), expected, "{line}");
        }
        check(
            "MSG bench.req 1 _INBOX.7 100",
            Ok(Op::Msg { sid: 1, reply: Some("_INBOX.7".into()), header_len: 0, payload_len: 100 }),
        );
        check("MSG _INBOX.7 2 5", Ok(Op::Msg { sid: 2, reply: None, header_len: 0, payload_len: 5 }));
        check(
            "HMSG _INBOX.w 1 $JS.ACK.B.w.1.5.5.17.0 40 140",
            Ok(Op::Msg { sid: 1, reply: Some("$JS.ACK.B.w.1.5.5.17.0".into()), header_len: 40, payload_len: 140 }),
        );
        check("HMSG _INBOX.w 1 28 28", Ok(Op::Msg { sid: 1, reply: None, header_len: 28, payload_len: 28 }));
        check("HMSG _INBOX.w 1 29 28", Err(()));
        check("HMSG _INBOX.w 1 28", Err(()));
        check("MSG a b 5", Err(()));
        check("MSG a 1 x", Err(()));
        check("MSG a", Err(()));
        check("PING", Ok(Op::Ping));
        check("PONG", Ok(Op::Pong));
        check("+OK", Ok(Op::Ok));
        check("INFO {\"server_id\":\"x\"}", Ok(Op::Info));
        check("-ERR 'Authorization Violation'", Ok(Op::Err("'Authorization Violation'".into())));
        check("HPUB a 1 2 3", Err(()));
    }

    #[test]
    fn headers() {
        let h = header_block(&[("Bench-Reply", "_INBOX.js.3")]);
        assert_eq!(h, b"NATS/1.0\r\nBench-Reply: _INBOX.js.3\r\n\r\n");
        assert_eq!(header_value(&h, "bench-reply"), Some("_INBOX.js.3"));
        assert_eq!(header_value(&h, "Other"), None);
        assert_eq!(header_status(&h), None);
        let status = b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 12\r\n\r\n";
        assert_eq!(header_status(status), Some(408));
        assert_eq!(header_value(status, "Nats-Pending-Messages"), Some("12"));
        assert_eq!(header_status(b"NATS/1.0 x"), None);
    }
}
