//! A fake relay: a WebSocket server on 127.0.0.1 that lets a test send what the real relay
//! never would (a task of an undeclared kind, a task to a draining worker) and watch exactly
//! what the real relay-worker answers.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde_json::Value;
use tungstenite::handshake::server::{Request, Response};
use tungstenite::{Message, WebSocket};

pub struct FakeRelay {
    listener: TcpListener,
    pub addr: SocketAddr,
}

pub struct FakeConn {
    ws: WebSocket<TcpStream>,
    /// The request path and query the worker used.
    pub uri: String,
}

impl FakeRelay {
    pub fn start() -> FakeRelay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("addr");
        FakeRelay { listener, addr }
    }

    pub fn ws_url(&self) -> String {
        format!("ws://{}/ws", self.addr)
    }

    /// Accepts the next worker connection within `within`.
    // tungstenite's callback signature fixes the (large) error type; nothing to box here.
    #[allow(clippy::result_large_err)]
    pub fn accept(&self, within: Duration) -> Option<FakeConn> {
        let deadline = Instant::now() + within;
        let stream = loop {
            match self.listener.accept() {
                Ok((s, _)) => break s,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                Err(_) => return None,
            }
        };
        stream.set_nonblocking(false).ok()?;
        // The handshake gets a generous bound (a loaded machine may take a while to send the
        // upgrade request); reads after it poll in short steps against their own deadlines.
        stream.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        let mut uri = String::new();
        let ws = tungstenite::accept_hdr(stream, |req: &Request, resp: Response| {
            uri = req.uri().to_string();
            Ok(resp)
        })
        .ok()?;
        ws.get_ref().set_read_timeout(Some(Duration::from_millis(20))).ok()?;
        Some(FakeConn { ws, uri })
    }
}

impl FakeRelay {
    /// Accepts the next connection within `within`, reads its request head and answers it
    /// with `status` and no upgrade (as relay answers a wrong token with 401). Returns the
    /// request line, or `None` when no connection came.
    pub fn refuse_next(&self, status: u16, within: Duration) -> Option<String> {
        use std::io::{Read, Write};
        let deadline = Instant::now() + within;
        let mut stream = loop {
            match self.listener.accept() {
                Ok((s, _)) => break s,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                Err(_) => return None,
            }
        };
        stream.set_nonblocking(false).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") && head.len() < 16 * 1024 {
            match stream.read(&mut byte) {
                Ok(1) => head.push(byte[0]),
                _ => return None,
            }
        }
        let answer = format!("HTTP/1.1 {status} Refused\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        stream.write_all(answer.as_bytes()).ok()?;
        let _ = stream.shutdown(std::net::Shutdown::Write);
        String::from_utf8_lossy(&head).lines().next().map(str::to_string)
    }
}

impl FakeConn {
    pub fn send(&mut self, msg: &Value) {
        self.ws.send(Message::text(msg.to_string())).expect("send to worker");
    }

    /// The next JSON text message within `within` (pings are answered by tungstenite).
    pub fn recv(&mut self, within: Duration) -> Option<Value> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            match self.ws.read() {
                Ok(Message::Text(t)) => return serde_json::from_str(t.as_str()).ok(),
                Ok(_) => {}
                Err(tungstenite::Error::Io(e))
                    if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(_) => return None,
            }
        }
        None
    }

    /// The next message of `type` (skipping others) within `within`.
    pub fn recv_type(&mut self, kind: &str, within: Duration) -> Option<Value> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(v) = self.recv(deadline - Instant::now())
                && v["type"] == kind
            {
                return Some(v);
            }
        }
        None
    }

    /// Reads (answering pings) and flushes for `within`, ignoring what comes.
    pub fn pump(&mut self, within: Duration) {
        let _ = self.recv(within);
        let _ = self.ws.flush();
    }

    /// Drops the TCP connection without a close frame.
    pub fn cut(self) {
        let _ = self.ws.get_ref().shutdown(std::net::Shutdown::Both);
    }
}
