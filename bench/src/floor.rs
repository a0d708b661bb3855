//! The floor: a single-threaded mio HTTP/1.1 server that answers every request at once with a
//! fixed ~100-byte JSON body. One hop, no dispatch, no parsing beyond framing: what one loopback
//! request-response costs a server on this machine. Run as its own process (`relay-bench
//! serve-floor`) so its CPU time can be read from /proc like relay's.

use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};

const LISTENER: Token = Token(usize::MAX);
const MAX_CONNS: usize = 4096;
const MAX_HEAD_BYTES: usize = 16 * 1024;
const MAX_BODY_BYTES: usize = 1 << 20;
const READ_CHUNK_BYTES: usize = 16 * 1024;

struct Conn {
    stream: TcpStream,
    inbuf: Vec<u8>,
    out: Vec<u8>,
    /// Bytes of `out` already written.
    sent: usize,
}

/// Serves on `bind` until `lifetime` has passed (it must stop by itself), then exits.
pub fn serve(bind: SocketAddr, lifetime: Duration) -> Result<(), String> {
    let deadline = Instant::now() + lifetime;
    let mut poll = Poll::new().map_err(|e| e.to_string())?;
    let mut listener = TcpListener::bind(bind).map_err(|e| format!("bind {bind}: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    poll.registry().register(&mut listener, LISTENER, Interest::READABLE).map_err(|e| e.to_string())?;
    eprintln!("msg=listening addr={addr}");

    let body = format!("{{\"status\":\"done\",\"result\":{}}}", crate::RESULT_DATA);
    let response =
        format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    let mut conns: Vec<Option<Conn>> = Vec::new();
    let mut events = Events::with_capacity(1024);
    while Instant::now() < deadline {
        match poll.poll(&mut events, Some(Duration::from_millis(200))) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.to_string()),
        }
        for ev in events.iter() {
            if ev.token() == LISTENER {
                accept(&poll, &mut listener, &mut conns);
                continue;
            }
            let slot = ev.token().0;
            let keep = match conns.get_mut(slot).and_then(Option::as_mut) {
                Some(c) => c.ready(response.as_bytes()),
                None => continue,
            };
            if !keep && let Some(mut c) = conns[slot].take() {
                let _ = poll.registry().deregister(&mut c.stream);
            }
        }
    }
    Ok(())
}

fn accept(poll: &Poll, listener: &mut TcpListener, conns: &mut Vec<Option<Conn>>) {
    loop {
        let (mut stream, _) = match listener.accept() {
            Ok(pair) => pair,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return,
            Err(_) => return,
        };
        let slot = match conns.iter().position(Option::is_none) {
            Some(s) => s,
            None if conns.len() < MAX_CONNS => {
                conns.push(None);
                conns.len() - 1
            }
            None => continue, // full: dropping the stream closes it
        };
        let _ = stream.set_nodelay(true);
        if poll.registry().register(&mut stream, Token(slot), Interest::READABLE | Interest::WRITABLE).is_err() {
            continue;
        }
        conns[slot] = Some(Conn { stream, inbuf: Vec::with_capacity(READ_CHUNK_BYTES), out: Vec::new(), sent: 0 });
    }
}

impl Conn {
    /// Reads until WouldBlock, answers every complete request, writes what it can. False: close.
    fn ready(&mut self, response: &[u8]) -> bool {
        loop {
            let len = self.inbuf.len();
            self.inbuf.resize(len + READ_CHUNK_BYTES, 0);
            let read = self.stream.read(&mut self.inbuf[len..]);
            self.inbuf.truncate(len + *read.as_ref().unwrap_or(&0));
            match read {
                Ok(0) => return false,
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
        let mut consumed = 0;
        loop {
            match request_len(&self.inbuf[consumed..]) {
                Ok(Some(n)) => {
                    consumed += n;
                    self.out.extend_from_slice(response);
                }
                Ok(None) => break,
                Err(()) => return false,
            }
        }
        self.inbuf.drain(..consumed);
        while self.sent < self.out.len() {
            match self.stream.write(&self.out[self.sent..]) {
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
        self.out.clear();
        self.sent = 0;
        true
    }
}

/// Length of the first complete request in `buf` (head + Content-Length body), `None` if it is
/// not complete yet, `Err` if it cannot be framed.
fn request_len(buf: &[u8]) -> Result<Option<usize>, ()> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if buf.len() > MAX_HEAD_BYTES { Err(()) } else { Ok(None) };
    };
    let head = std::str::from_utf8(&buf[..end]).map_err(|_| ())?;
    let mut body = 0;
    for line in head.split("\r\n").skip(1) {
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            body = value.trim().parse::<usize>().map_err(|_| ())?;
        }
    }
    if body > MAX_BODY_BYTES {
        return Err(());
    }
    let total = end + 4 + body;
    Ok((buf.len() >= total).then_some(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framing() {
        fn check(buf: &str, expected: Result<Option<usize>, ()>) {
            assert_eq!(request_len(buf.as_bytes()), expected, "{buf:?}");
        }
        check("POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", Ok(Some(40)));
        check("POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\n{", Ok(None));
        check("POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}GET", Ok(Some(40)));
        check("GET / HTTP/1.1\r\n\r\n", Ok(Some(18)));
        check("GET / HTTP/1.1\r\n", Ok(None));
        check("POST / HTTP/1.1\r\ncontent-length: x\r\n\r\n", Err(()));
    }
}
