//! A small HTTP/1.1 client over std sockets: exactly the bytes we choose, so tests can send
//! malformed, pipelined or slow requests.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The chunks the body came in (`Transfer-Encoding: chunked`; 0: it came whole).
    pub chunks: usize,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.text()))
    }
    /// The `error` code of a JSON error body.
    pub fn error(&self) -> String {
        self.json()["error"].as_str().unwrap_or_default().to_string()
    }
}

/// A keep-alive connection.
pub struct Client {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

impl Client {
    pub fn connect(addr: SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
        stream.set_nodelay(true).expect("nodelay");
        Client { stream, buf: Vec::new() }
    }

    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("write");
    }

    pub fn send(&mut self, method: &str, path: &str, headers: &[(&str, &str)], body: Option<&[u8]>) {
        let raw = build(method, path, headers, body);
        self.send_raw(&raw);
    }

    pub fn call(&mut self, method: &str, path: &str, headers: &[(&str, &str)], body: Option<&[u8]>) -> Resp {
        self.send(method, path, headers, body);
        self.read_response().expect("a response")
    }

    /// Reads one response; `None` on EOF before a status line.
    pub fn read_response(&mut self) -> Option<Resp> {
        self.read_response_to(false)
    }

    pub(crate) fn read_response_to(&mut self, head_only: bool) -> Option<Resp> {
        loop {
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut resp = httparse::Response::new(&mut headers);
            if let Ok(httparse::Status::Complete(n)) = resp.parse(&self.buf) {
                let status = resp.code.unwrap_or(0);
                let hs: Vec<(String, String)> = resp
                    .headers
                    .iter()
                    .map(|h| (h.name.to_string(), String::from_utf8_lossy(h.value).into_owned()))
                    .collect();
                let len: usize = hs
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                    .map(|(_, v)| v.parse().expect("content-length"))
                    .unwrap_or(0);
                let len = if head_only || status == 100 || status == 101 { 0 } else { len };
                let chunked = hs.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v == "chunked");
                if chunked && !head_only {
                    assert!(!hs.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-length")), "both framings");
                    self.buf.drain(..n);
                    let (body, chunks) = self.read_chunks()?;
                    return Some(Resp { status, headers: hs, body, chunks });
                }
                while self.buf.len() < n + len {
                    if !self.fill() {
                        return None;
                    }
                }
                let body = self.buf[n..n + len].to_vec();
                self.buf.drain(..n + len);
                return Some(Resp { status, headers: hs, body, chunks: 0 });
            }
            if !self.fill() {
                return None;
            }
        }
    }

    /// A chunked body (strictly: hex sizes, CRLFs, no extensions or trailers, which relay
    /// never writes): (the data, how many chunks).
    fn read_chunks(&mut self) -> Option<(Vec<u8>, usize)> {
        let mut body = Vec::new();
        let mut chunks = 0;
        loop {
            let line_end = loop {
                if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                    break i;
                }
                assert!(self.buf.len() < 64, "a chunk size line of {:?}", String::from_utf8_lossy(&self.buf));
                if !self.fill() {
                    return None;
                }
            };
            let line = std::str::from_utf8(&self.buf[..line_end]).expect("a chunk size in ASCII");
            let size = usize::from_str_radix(line, 16).unwrap_or_else(|_| panic!("chunk size {line:?}"));
            while self.buf.len() < line_end + 2 + size + 2 {
                if !self.fill() {
                    return None;
                }
            }
            let data = line_end + 2..line_end + 2 + size;
            assert_eq!(&self.buf[data.end..data.end + 2], b"\r\n", "CRLF after a chunk");
            body.extend_from_slice(&self.buf[data.clone()]);
            self.buf.drain(..data.end + 2);
            if size == 0 {
                return Some((body, chunks));
            }
            chunks += 1;
        }
    }

    fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 8192];
        loop {
            match self.stream.read(&mut chunk) {
                // A read with a timeout can end in EINTR; it is not the server's doing.
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Ok(0) | Err(_) => return false,
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return true;
                }
            }
        }
    }

    /// True if the server closed the connection (EOF) within `within`.
    pub fn closed_within(&mut self, within: Duration) -> bool {
        self.stream.set_read_timeout(Some(within)).expect("timeout");
        let mut chunk = [0u8; 1024];
        let result = loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => break true,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break true,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break false,
            }
        };
        self.stream.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
        result
    }

    /// True if nothing has arrived from the server so far (neither buffered here nor waiting
    /// in the socket). Does not block.
    pub fn nothing_received(&mut self) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        self.stream.set_nonblocking(true).expect("nonblocking");
        let mut one = [0u8; 1];
        let result = matches!(self.stream.peek(&mut one), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        self.stream.set_nonblocking(false).expect("blocking");
        result
    }

    pub fn buffered(&self) -> &[u8] {
        &self.buf
    }
}

pub fn build(method: &str, path: &str, headers: &[(&str, &str)], body: Option<&[u8]>) -> Vec<u8> {
    let mut raw = format!("{method} {path} HTTP/1.1\r\nHost: relay\r\n");
    for (k, v) in headers {
        raw.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        raw.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    raw.push_str("\r\n");
    let mut raw = raw.into_bytes();
    if let Some(b) = body {
        raw.extend_from_slice(b);
    }
    raw
}

/// One request on a fresh connection.
pub fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: Option<&[u8]>) -> Resp {
    let mut c = Client::connect(addr);
    c.call(method, path, headers, body)
}
