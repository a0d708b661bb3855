//! A blocking client for the NATS text protocol, just what request-reply needs: INFO/CONNECT,
//! SUB (with a queue group), PUB with a reply subject, MSG, PING/PONG. Used for the peer's
//! responders and requesters; it never talks to anything but a nats-server on loopback.

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
#[derive(Debug, PartialEq)]
pub enum Op {
    Msg { sid: u64, reply: Option<String>, payload_len: usize },
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
            "CONNECT {{\"verbose\":false,\"pedantic\":false,\"echo\":false,\"name\":\"{name}\",\"lang\":\"rust\",\"version\":\"0.1.0\",\"protocol\":1}}\r\n"
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
        self.out.extend_from_slice(b"PUB ");
        self.out.extend_from_slice(subject.as_bytes());
        if let Some(r) = reply {
            self.out.push(b' ');
            self.out.extend_from_slice(r.as_bytes());
        }
        self.out.extend_from_slice(format!(" {}\r\n", payload.len()).as_bytes());
        self.out.extend_from_slice(payload);
        self.out.extend_from_slice(b"\r\n");
        self.stream.write_all(&self.out).map_err(|e| format!("write: {e}"))
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
            Ok(Op::Msg { sid, reply, payload_len })
        }
        "PING" => Ok(Op::Ping),
        "PONG" => Ok(Op::Pong),
        "+OK" => Ok(Op::Ok),
        "INFO" => Ok(Op::Info),
        "-ERR" => Ok(Op::Err(rest.to_string())),
        _ => Err(format!("unknown operation {line:?}")),
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
        check("MSG bench.req 1 _INBOX.7 100", Ok(Op::Msg { sid: 1, reply: Some("_INBOX.7".into()), payload_len: 100 }));
        check("MSG _INBOX.7 2 5", Ok(Op::Msg { sid: 2, reply: None, payload_len: 5 }));
        check("MSG a b 5", Err(()));
        check("MSG a 1 x", Err(()));
        check("MSG a", Err(()));
        check("PING", Ok(Op::Ping));
        check("PONG", Ok(Op::Pong));
        check("+OK", Ok(Op::Ok));
        check("INFO {\"server_id\":\"x\"}", Ok(Op::Info));
        check("-ERR 'Authorization Violation'", Ok(Op::Err("'Authorization Violation'".into())));
        check("HMSG a 1 2 3", Err(()));
    }
}
