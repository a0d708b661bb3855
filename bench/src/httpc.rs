//! A minimal blocking HTTP/1.1 keep-alive client: requests are pre-built byte strings, responses
//! must carry `Content-Length` (relay's and the floor's do). One request in flight (`request`), or
//! several (HTTP/1.1 pipelining: `send` any number, then `read_response` them in order). Just
//! enough to load a server without the client's own cost hiding the server's.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Cap on a response (head + body); relay's task JSON for a 100-byte payload is well under it.
/// A batch answer (one entry per item) needs more: see `HttpConn::with_max_response`.
const MAX_RESPONSE_BYTES: usize = 1 << 20;
const READ_CHUNK_BYTES: usize = 16 * 1024;

pub struct HttpConn {
    stream: TcpStream,
    buf: Vec<u8>,
    /// Bytes at the front of `buf` that belong to responses already returned.
    consumed: usize,
    max_response: usize,
}

/// Status and body range (into the connection's buffer) of the last response.
pub struct Response<'a> {
    pub status: u16,
    pub body: &'a [u8],
}

impl HttpConn {
    pub fn connect(addr: SocketAddr, io_timeout: Duration) -> Result<HttpConn, String> {
        let stream = TcpStream::connect_timeout(&addr, io_timeout).map_err(|e| format!("connect {addr}: {e}"))?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        stream.set_read_timeout(Some(io_timeout)).map_err(|e| e.to_string())?;
        stream.set_write_timeout(Some(io_timeout)).map_err(|e| e.to_string())?;
        Ok(HttpConn {
            stream,
            buf: Vec::with_capacity(READ_CHUNK_BYTES),
            consumed: 0,
            max_response: MAX_RESPONSE_BYTES,
        })
    }

    /// Raises the cap on one response (e.g. the answer to a batch of 100,000 tasks).
    pub fn with_max_response(mut self, bytes: usize) -> HttpConn {
        self.max_response = bytes;
        self
    }

    /// Sends one complete request and reads its response (nothing else may be in flight).
    pub fn request(&mut self, req: &[u8]) -> Result<Response<'_>, String> {
        self.send(req)?;
        let (status, body_at, total) = self.next_response()?;
        if self.buf.len() > total {
            return Err("bytes after the response (unexpected with one request in flight)".into());
        }
        Ok(Response { status, body: &self.buf[body_at..total] })
    }

    /// Writes requests (one or several, back to back) without reading anything.
    pub fn send(&mut self, reqs: &[u8]) -> Result<(), String> {
        self.stream.write_all(reqs).map_err(|e| format!("write: {e}"))
    }

    /// Reads the next response of those in flight, in request order.
    pub fn read_response(&mut self) -> Result<Response<'_>, String> {
        let (status, body_at, total) = self.next_response()?;
        Ok(Response { status, body: &self.buf[body_at..total] })
    }

    /// Whether a complete response is already buffered (`read_response` will not read the socket).
    pub fn has_response(&self) -> bool {
        let rest = &self.buf[self.consumed..];
        matches!(parse_head(rest), Ok(Some((_, at, len))) if rest.len() >= at + len)
    }

    /// Status, body start and end (in `buf`) of the next response; marks it consumed.
    fn next_response(&mut self) -> Result<(u16, usize, usize), String> {
        if self.consumed > 0 {
            self.buf.drain(..self.consumed);
            self.consumed = 0;
        }
        let (status, body_at, body_len) = loop {
            if let Some(head) = parse_head(&self.buf)? {
                break head;
            }
            self.fill()?;
        };
        let total = body_at + body_len;
        if total > self.max_response {
            return Err(format!("response of {total} bytes"));
        }
        while self.buf.len() < total {
            self.fill()?;
        }
        self.consumed = total;
        Ok((status, body_at, total))
    }

    fn fill(&mut self) -> Result<(), String> {
        let len = self.buf.len();
        if len >= self.max_response {
            return Err("response head too large".into());
        }
        self.buf.resize(len + READ_CHUNK_BYTES, 0);
        match self.stream.read(&mut self.buf[len..]) {
            Ok(0) => {
                self.buf.truncate(len);
                Err("connection closed by the server".into())
            }
            Ok(n) => {
                self.buf.truncate(len + n);
                Ok(())
            }
            Err(e) => {
                self.buf.truncate(len);
                Err(format!("read: {e}"))
            }
        }
    }
}

/// `Ok(None)` until the head is complete; then status, where the body starts, and its length.
fn parse_head(buf: &[u8]) -> Result<Option<(u16, usize, usize)>, String> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    let head = std::str::from_utf8(&buf[..end]).map_err(|_| "response head is not UTF-8".to_string())?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .strip_prefix("HTTP/1.1 ")
        .and_then(|s| s.get(..3))
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let mut length = None;
    for line in lines {
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = Some(value.trim().parse::<usize>().map_err(|_| format!("bad Content-Length {value:?}"))?);
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                return Err("chunked responses are not supported by the bench client".into());
            }
        }
    }
    let length = length.ok_or("response without Content-Length")?;
    Ok(Some((status, end + 4, length)))
}

/// A complete request with a body; `target` is the path and query.
pub fn build_request(method: &str, target: &str, token: Option<&str>, body: &[u8]) -> Vec<u8> {
    let mut req = format!("{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n");
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        req.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// The string value of `"key":"..."` in a flat JSON text (ids are plain ASCII, no escapes).
pub fn json_str_field<'a>(text: &'a [u8], key: &str) -> Option<&'a str> {
    let pat = format!("\"{key}\":\"");
    let at = text.windows(pat.len()).position(|w| w == pat.as_bytes())? + pat.len();
    let len = text[at..].iter().position(|&b| b == b'"')?;
    std::str::from_utf8(&text[at..at + len]).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads() {
        fn check(buf: &str, expected: Result<Option<(u16, usize, usize)>, ()>) {
            assert_eq!(parse_head(buf.as_bytes()).map_err(|_| ()), expected, "{buf:?}");
        }
        check("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", Ok(Some((200, 38, 2))));
        check("HTTP/1.1 202 Accepted\r\ncontent-length:0\r\n\r\n", Ok(Some((202, 43, 0))));
        check("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n", Ok(None));
        check("HTTP/1.1 200 OK\r\n\r\n", Err(()));
        check("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", Err(()));
        check("HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", Err(()));
        check("HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n", Err(()));
    }

    #[test]
    fn fields() {
        fn check(text: &str, key: &str, expected: Option<&str>) {
            assert_eq!(json_str_field(text.as_bytes(), key), expected, "{text} {key}");
        }
        check(r#"{"task_id":"ab-12","status":"dispatched"}"#, "task_id", Some("ab-12"));
        check(r#"{"task_id":"ab-12","status":"done"}"#, "status", Some("done"));
        check(r#"{"task_id":12}"#, "task_id", None);
        check(r#"{"task_id":"open"#, "task_id", None);
    }

    #[test]
    fn pipelined_responses() {
        use std::net::TcpListener;
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let mut got = Vec::new();
            let mut chunk = [0u8; 1024];
            while got.windows(4).filter(|w| w == b"\r\n\r\n").count() < 3 {
                let n = s.read(&mut chunk).expect("read");
                assert!(n > 0, "client closed early");
                got.extend_from_slice(&chunk[..n]);
            }
            // Three answers in one write, the last split in two.
            let r = |b: &str| format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{b}", b.len());
            let all = format!("{}{}{}", r("one"), r("two"), r("three"));
            let cut = all.len() - 3;
            s.write_all(&all.as_bytes()[..cut]).expect("write");
            std::thread::sleep(Duration::from_millis(50));
            s.write_all(&all.as_bytes()[cut..]).expect("write");
        });
        let mut c = HttpConn::connect(addr, Duration::from_secs(5)).expect("connect");
        assert!(!c.has_response());
        let get = build_request("GET", "/x", None, b"");
        c.send(&[get.as_slice(), &get, &get].concat()).expect("send");
        for body in ["one", "two", "three"] {
            let resp = c.read_response().expect("response");
            assert_eq!((resp.status, resp.body), (200, body.as_bytes()));
        }
        assert!(!c.has_response());
        server.join().expect("server");
    }

    #[test]
    fn requests() {
        let req = build_request("POST", "/tasks?wait=true", Some("t"), b"{}");
        assert_eq!(
            std::str::from_utf8(&req).expect("ascii"),
            "POST /tasks?wait=true HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer t\r\n\
             Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
        );
        let req = build_request("GET", "/healthz", None, b"");
        assert_eq!(std::str::from_utf8(&req).expect("ascii"), "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    }
}
