//! HTTP/1.1 without I/O: finding and parsing a request head (httparse, with caps), body framing
//! (Content-Length or chunked), and writing responses into a byte buffer.
//!
//! The reactor owns the bytes and the socket; this module only looks at slices it is given.

use std::fmt;

/// The head, request line included, may not be larger than this (SPEC §4).
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Nor have more headers than this.
pub const MAX_HEADERS: usize = 64;
/// Chunk extensions and trailers are skipped, but not without limit.
const MAX_CHUNK_LINE_BYTES: usize = 4 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Get,
    Head,
    Post,
    Put,
    Delete,
    Patch,
    Options,
    Other,
}

impl Method {
    fn parse(text: &str) -> Method {
        match text {
            "GET" => Method::Get,
            "HEAD" => Method::Head,
            "POST" => Method::Post,
            "PUT" => Method::Put,
            "DELETE" => Method::Delete,
            "PATCH" => Method::Patch,
            "OPTIONS" => Method::Options,
            _ => Method::Other,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body (no Content-Length, or zero, and not chunked).
    Empty,
    Length(u64),
    Chunked,
}

/// What the server needs from a request head. Owned, so the bytes behind it can move on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub method: Method,
    pub path: String,
    pub query: String,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor_version: u8,
    /// Whether the connection may stay open after this request.
    pub keep_alive: bool,
    pub framing: Framing,
    pub expect_continue: bool,
    pub authorization: Option<String>,
    pub upgrade_websocket: bool,
    pub connection_upgrade: bool,
    pub ws_key: Option<String>,
    pub ws_version: Option<String>,
    pub forwarded_for: Option<String>,
    pub real_ip: Option<String>,
    pub idempotency_key: Option<String>,
    pub content_type: Option<String>,
    pub range: Option<String>,
    pub if_range: Option<String>,
    pub if_none_match: Option<String>,
    /// Bytes of the head, final blank line included.
    pub head_len: usize,
}

impl Head {
    /// The value of `name` in the query string (`wait=true`), undecoded.
    pub fn query_param(&self, name: &str) -> Option<&str> {
        self.query.split('&').find_map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            (key == name).then_some(value)
        })
    }

    pub fn bearer_token(&self) -> Option<&str> {
        let value = self.authorization.as_deref()?.trim();
        let (scheme, token) = value.split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
    }
}

/// Why a head could not be accepted; each maps to one status code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadError {
    /// 431: more than 16 KiB or more than 64 headers.
    TooLarge(&'static str),
    /// 400 with a message saying what is wrong.
    Bad(String),
    /// 501: a transfer coding other than chunked.
    NotImplemented(String),
    /// 417: an `Expect` other than `100-continue` (RFC 9110 §10.1.1).
    ExpectationFailed(String),
}

impl HeadError {
    pub fn status(&self) -> u16 {
        match self {
            HeadError::TooLarge(_) => 431,
            HeadError::Bad(_) => 400,
            HeadError::NotImplemented(_) => 501,
            HeadError::ExpectationFailed(_) => 417,
        }
    }
}

impl fmt::Display for HeadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeadError::TooLarge(why) => f.write_str(why),
            HeadError::Bad(why) | HeadError::NotImplemented(why) | HeadError::ExpectationFailed(why) => {
                f.write_str(why)
            }
        }
    }
}

/// Returns the length of the head (through the blank line) if `buf` holds a complete one.
/// `scanned` is how many bytes an earlier call already looked at, so slow clients cost O(n).
pub fn find_head_end(buf: &[u8], scanned: usize) -> Option<usize> {
    let start = scanned.saturating_sub(3);
    let mut i = start;
    while i < buf.len() {
        if buf[i] == b'\n' {
            if buf.get(i + 1) == Some(&b'\n') {
                return Some(i + 2);
            }
            if buf.get(i + 1) == Some(&b'\r') && buf.get(i + 2) == Some(&b'\n') {
                return Some(i + 3);
            }
        }
        i += 1;
    }
    None
}

/// How much of a request line [`could_be_request`] looks at.
const REQUEST_LINE_PROBE_BYTES: usize = 64;

/// Whether a head still arriving can be an HTTP request at all: its first line (leading empty
/// lines skipped, RFC 9112 §2.2) starts with a method token and a space, and holds no control
/// bytes. Looks at the first 64 bytes only, so a slow client costs nothing; a TLS
/// ClientHello or other binary on the plain port fails at its first byte, not at HEADER_TIMEOUT.
pub fn could_be_request(buf: &[u8]) -> bool {
    let start = buf.iter().position(|&b| b != b'\r' && b != b'\n').unwrap_or(buf.len());
    let line = &buf[start..buf.len().min(start + REQUEST_LINE_PROBE_BYTES)];
    let method_len = line.iter().position(|&b| !is_tchar(b)).unwrap_or(line.len());
    let Some(&after) = line.get(method_len) else { return true };
    if after != b' ' || method_len == 0 {
        return false;
    }
    for &b in &line[method_len..] {
        match b {
            b'\n' => return true,
            // Bytes above 0x7f are left to the parser (some clients send raw UTF-8 paths).
            b' ' | b'\r' | 0x21..=0x7e | 0x80..=0xff => {}
            _ => return false,
        }
    }
    true
}

/// RFC 9110 §5.6.2 token characters.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Parses the complete head `buf[..head_len]` (found by [`find_head_end`]).
pub fn parse_head(buf: &[u8], head_len: usize) -> Result<Head, HeadError> {
    if head_len > MAX_HEAD_BYTES {
        return Err(HeadError::TooLarge("request head over 16 KiB"));
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(&buf[..head_len]) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(HeadError::Bad("incomplete request head".into())),
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooLarge("more than 64 header fields")),
        Err(e) => return Err(HeadError::Bad(format!("malformed request head: {e}"))),
    }
    let method = Method::parse(req.method.unwrap_or(""));
    let target = req.path.unwrap_or("/");
    if !target.starts_with('/') {
        return Err(HeadError::Bad("request target must be an absolute path".into()));
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let minor_version = req.version.unwrap_or(1);

    let mut head = Head {
        method,
        path: path.to_string(),
        query: query.to_string(),
        minor_version,
        keep_alive: minor_version == 1,
        framing: Framing::Empty,
        expect_continue: false,
        authorization: None,
        upgrade_websocket: false,
        connection_upgrade: false,
        ws_key: None,
        ws_version: None,
        forwarded_for: None,
        real_ip: None,
        idempotency_key: None,
        content_type: None,
        range: None,
        if_range: None,
        if_none_match: None,
        head_len,
    };
    let mut content_length: Option<u64> = None;
    // Every coding of every Transfer-Encoding field, in order (`None`: no such field).
    let mut codings: Option<Vec<&str>> = None;
    let mut hosts = 0;
    for h in req.headers.iter() {
        let value = std::str::from_utf8(h.value)
            .map_err(|_| HeadError::Bad(format!("header {} is not valid UTF-8", h.name)))?
            .trim();
        let name = h.name;
        if name.eq_ignore_ascii_case("content-length") {
            let n: u64 = value
                .parse()
                .ok()
                .filter(|_| !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| HeadError::Bad(format!("invalid Content-Length {value:?}")))?;
            if content_length.is_some_and(|old| old != n) {
                return Err(HeadError::Bad("conflicting Content-Length headers".into()));
            }
            content_length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            codings.get_or_insert_with(Vec::new).extend(value.split(',').map(str::trim).filter(|c| !c.is_empty()));
        } else if name.eq_ignore_ascii_case("host") {
            hosts += 1;
        } else if name.eq_ignore_ascii_case("connection") {
            for token in value.split(',').map(str::trim) {
                if token.eq_ignore_ascii_case("close") {
                    head.keep_alive = false;
                } else if token.eq_ignore_ascii_case("upgrade") {
                    head.connection_upgrade = true;
                }
            }
        } else if name.eq_ignore_ascii_case("expect") {
            if value.eq_ignore_ascii_case("100-continue") {
                head.expect_continue = true;
            } else {
                return Err(HeadError::ExpectationFailed(format!("unsupported Expect {value:?}")));
            }
        } else if name.eq_ignore_ascii_case("authorization") {
            head.authorization = Some(value.to_string());
        } else if name.eq_ignore_ascii_case("upgrade") {
            head.upgrade_websocket = value.split(',').any(|p| p.trim().eq_ignore_ascii_case("websocket"));
        } else if name.eq_ignore_ascii_case("sec-websocket-key") {
            head.ws_key = Some(value.to_string());
        } else if name.eq_ignore_ascii_case("sec-websocket-version") {
            head.ws_version = Some(value.to_string());
        } else if name.eq_ignore_ascii_case("x-forwarded-for") {
            // Several X-Forwarded-For fields form one list, in order.
            match &mut head.forwarded_for {
                Some(list) => {
                    list.push_str(", ");
                    list.push_str(value);
                }
                None => head.forwarded_for = Some(value.to_string()),
            }
        } else if name.eq_ignore_ascii_case("x-real-ip") {
            head.real_ip = Some(value.to_string());
        } else if name.eq_ignore_ascii_case("idempotency-key") {
            head.idempotency_key = Some(value.to_string());
        } else if name.eq_ignore_ascii_case("content-type") {
            head.content_type = Some(value.to_string());
        } else if name.eq_ignore_ascii_case("range") {
            head.range = Some(value.to_string());
        } else if name.eq_ignore_ascii_case("if-range") {
            head.if_range = Some(value.to_string());
        } else if name.eq_ignore_ascii_case("if-none-match") {
            // Several fields form one list.
            match &mut head.if_none_match {
                Some(list) => {
                    list.push_str(", ");
                    list.push_str(value);
                }
                None => head.if_none_match = Some(value.to_string()),
            }
        }
    }
    if minor_version == 1 && hosts != 1 {
        // RFC 9112 §3.2: exactly one Host field in an HTTP/1.1 request.
        let why = if hosts == 0 { "an HTTP/1.1 request needs a Host header" } else { "more than one Host header" };
        return Err(HeadError::Bad(why.into()));
    }
    // RFC 9112 §6.3: a Transfer-Encoding whose last coding is not chunked cannot be framed; a
    // server that fell back to Content-Length would read the rest as another request.
    let chunked = match codings {
        None => false,
        Some(codings) => {
            let chunks = codings.iter().filter(|c| c.eq_ignore_ascii_case("chunked")).count();
            if !codings.last().is_some_and(|c| c.eq_ignore_ascii_case("chunked")) || chunks > 1 {
                return Err(HeadError::Bad("Transfer-Encoding must end with chunked, once".into()));
            }
            if codings.len() > 1 {
                return Err(HeadError::NotImplemented(format!("unsupported Transfer-Encoding {codings:?}")));
            }
            true
        }
    };
    head.framing = match (chunked, content_length) {
        (true, Some(_)) => return Err(HeadError::Bad("both Content-Length and Transfer-Encoding".into())),
        (true, None) => Framing::Chunked,
        (false, Some(0) | None) => Framing::Empty,
        (false, Some(n)) => Framing::Length(n),
    };
    if chunked && minor_version == 0 {
        return Err(HeadError::Bad("chunked encoding in an HTTP/1.0 request".into()));
    }
    Ok(head)
}

/// Incremental decoder of a chunked body.
#[derive(Debug, Default, Clone)]
pub struct ChunkedDecoder {
    state: ChunkState,
    size: u64,
    digits: u8,
    line_bytes: usize,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    #[default]
    Size,
    Extension,
    /// Inside a quoted-string of an extension (`escaped`: after a backslash).
    ExtensionQuoted {
        escaped: bool,
    },
    SizeLf,
    Data,
    DataCr,
    DataLf,
    TrailerStart,
    TrailerLine,
    TrailerLineLf,
    TrailerEndLf,
    Done,
}

/// Bytes that may not appear in chunk extensions or trailers (as in a header line): controls
/// other than tab, and DEL.
fn is_forbidden_in_line(b: u8) -> bool {
    (b < 0x20 && b != b'\t') || b == 0x7f
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkError {
    /// The decoded body would exceed the limit.
    TooLarge,
    Malformed(&'static str),
}

impl ChunkedDecoder {
    pub fn is_done(&self) -> bool {
        self.state == ChunkState::Done
    }

    /// Decodes from `input`, appending body bytes to `out` (never beyond `max_body_bytes`: a
    /// chunk size that would pass it is refused as soon as its digits are read). Lines end in
    /// CRLF only: a bare LF, a NUL, or a CR or LF inside a quoted extension is malformed, as are
    /// obs-fold and control bytes in trailers. Returns how many input bytes were consumed;
    /// stops right after the final CRLF.
    pub fn decode(&mut self, input: &[u8], out: &mut Vec<u8>, max_body_bytes: usize) -> Result<usize, ChunkError> {
        let mut i = 0;
        while i < input.len() && self.state != ChunkState::Done {
            let b = input[i];
            match self.state {
                ChunkState::Size => match b {
                    b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                        if self.digits >= 15 {
                            return Err(ChunkError::Malformed("chunk size too long"));
                        }
                        let d = (b as char).to_digit(16).unwrap_or(0);
                        self.size = self.size * 16 + u64::from(d);
                        self.digits += 1;
                        if self.size > max_body_bytes.saturating_sub(out.len()) as u64 {
                            return Err(ChunkError::TooLarge);
                        }
                        i += 1;
                    }
                    b';' | b' ' | b'\t' if self.digits > 0 => {
                        self.state = ChunkState::Extension;
                        self.line_bytes = 0;
                        i += 1;
                    }
                    b'\r' if self.digits > 0 => {
                        self.state = ChunkState::SizeLf;
                        i += 1;
                    }
                    b'\n' => return Err(ChunkError::Malformed("bare LF in a chunk size line")),
                    _ => return Err(ChunkError::Malformed("invalid chunk size")),
                },
                ChunkState::Extension | ChunkState::ExtensionQuoted { .. } => {
                    self.line_bytes += 1;
                    if self.line_bytes > MAX_CHUNK_LINE_BYTES {
                        return Err(ChunkError::Malformed("chunk extension too long"));
                    }
                    self.state = match (self.state, b) {
                        (ChunkState::Extension, b'\r') => ChunkState::SizeLf,
                        (ChunkState::Extension, b'"') => ChunkState::ExtensionQuoted { escaped: false },
                        (_, b'\r' | b'\n') => return Err(ChunkError::Malformed("bare CR or LF in a chunk extension")),
                        (_, b) if is_forbidden_in_line(b) => {
                            return Err(ChunkError::Malformed("control byte in a chunk extension"));
                        }
                        (ChunkState::ExtensionQuoted { escaped: false }, b'\\') => {
                            ChunkState::ExtensionQuoted { escaped: true }
                        }
                        (ChunkState::ExtensionQuoted { escaped: false }, b'"') => ChunkState::Extension,
                        (ChunkState::ExtensionQuoted { .. }, _) => ChunkState::ExtensionQuoted { escaped: false },
                        (state, _) => state,
                    };
                    i += 1;
                }
                ChunkState::SizeLf => {
                    if b != b'\n' {
                        return Err(ChunkError::Malformed("expected LF after chunk size"));
                    }
                    self.end_size_line();
                    i += 1;
                }
                ChunkState::Data => {
                    let take = (input.len() - i).min(usize::try_from(self.size).unwrap_or(usize::MAX));
                    if out.len() + take > max_body_bytes {
                        return Err(ChunkError::TooLarge);
                    }
                    out.extend_from_slice(&input[i..i + take]);
                    i += take;
                    self.size -= take as u64;
                    if self.size == 0 {
                        self.state = ChunkState::DataCr;
                    }
                }
                ChunkState::DataCr => {
                    if b != b'\r' {
                        return Err(ChunkError::Malformed("expected CRLF after chunk data"));
                    }
                    self.state = ChunkState::DataLf;
                    i += 1;
                }
                ChunkState::DataLf => {
                    if b != b'\n' {
                        return Err(ChunkError::Malformed("expected LF after chunk data"));
                    }
                    self.next_chunk();
                    i += 1;
                }
                ChunkState::TrailerStart => {
                    self.line_bytes += 1;
                    self.state = match b {
                        b'\r' => ChunkState::TrailerEndLf,
                        b' ' | b'\t' => return Err(ChunkError::Malformed("obs-fold in trailers")),
                        b if is_forbidden_in_line(b) => {
                            return Err(ChunkError::Malformed("bare LF or control byte in trailers"));
                        }
                        _ => ChunkState::TrailerLine,
                    };
                    i += 1;
                }
                ChunkState::TrailerLine => {
                    self.line_bytes += 1;
                    if self.line_bytes > MAX_CHUNK_LINE_BYTES {
                        return Err(ChunkError::Malformed("trailer section too long"));
                    }
                    match b {
                        b'\r' => self.state = ChunkState::TrailerLineLf,
                        b if is_forbidden_in_line(b) => {
                            return Err(ChunkError::Malformed("bare LF or control byte in trailers"));
                        }
                        _ => {}
                    }
                    i += 1;
                }
                ChunkState::TrailerLineLf => {
                    if b != b'\n' {
                        return Err(ChunkError::Malformed("expected LF after a trailer line"));
                    }
                    self.state = ChunkState::TrailerStart;
                    i += 1;
                }
                ChunkState::TrailerEndLf => {
                    if b != b'\n' {
                        return Err(ChunkError::Malformed("expected LF after trailers"));
                    }
                    self.state = ChunkState::Done;
                    i += 1;
                }
                ChunkState::Done => break,
            }
        }
        Ok(i)
    }

    fn end_size_line(&mut self) {
        if self.size == 0 {
            self.state = ChunkState::TrailerStart;
            self.line_bytes = 0;
        } else {
            self.state = ChunkState::Data;
        }
    }

    fn next_chunk(&mut self) {
        self.state = ChunkState::Size;
        self.size = 0;
        self.digits = 0;
    }
}

pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        101 => "Switching Protocols",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        206 => "Partial Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Content Too Large",
        304 => "Not Modified",
        416 => "Range Not Satisfiable",
        417 => "Expectation Failed",
        426 => "Upgrade Required",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// A complete response, ready to be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    /// Extra header lines, e.g. `("Allow", "GET, DELETE")`.
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
    /// Close the connection once this response is written.
    pub close: bool,
    /// The journal record this answer shows must be durable before it leaves (0: nothing).
    pub lsn: u64,
    /// `body` is the first piece of a body that goes on (`crate::stream`): the rest is written
    /// a piece at a time as the connection's output drains.
    pub stream: Option<Box<crate::stream::BodyStream>>,
}

pub const JSON: &str = "application/json";

impl Response {
    pub fn json(status: u16, body: Vec<u8>) -> Response {
        Response { status, content_type: JSON, headers: Vec::new(), body, close: false, lsn: 0, stream: None }
    }

    /// `body` is the first piece; `stream` writes the rest (`crate::stream`).
    pub fn streamed(mut self, stream: crate::stream::BodyStream) -> Response {
        self.stream = Some(Box::new(stream));
        self
    }

    /// `{"error": code, "message": message}`.
    pub fn error(status: u16, code: &str, message: &str) -> Response {
        #[derive(serde::Serialize)]
        struct ErrorBody<'a> {
            error: &'a str,
            message: &'a str,
        }
        let body = serde_json::to_vec(&ErrorBody { error: code, message }).unwrap_or_default();
        Response::json(status, body)
    }

    pub fn with_header(mut self, name: &'static str, value: impl Into<String>) -> Response {
        self.headers.push((name, value.into()));
        self
    }

    pub fn closing(mut self) -> Response {
        self.close = true;
        self
    }

    /// Appends the response to `out`, with `date` (an HTTP-date, [`crate::timefmt::http_date`])
    /// as its `Date`. A HEAD response carries the headers only; a 304 carries neither body nor
    /// Content-Length (RFC 9110 §8.6: it could only be the 200's length). A JSON answer is
    /// live state (a task, a listing, counts): `Cache-Control: no-store` unless it says otherwise.
    /// Every answer passes here: plain byte pushes, no formatting machinery.
    pub fn write_to(&self, out: &mut Vec<u8>, head_only: bool, date: &[u8]) {
        self.write_head(out, date);
        if !head_only && self.status != 304 {
            out.extend_from_slice(&self.body);
        }
    }

    /// The status line and the headers of [`Response::write_to`], without the body.
    pub fn write_head(&self, out: &mut Vec<u8>, date: &[u8]) {
        out.reserve(160);
        out.extend_from_slice(b"HTTP/1.1 ");
        push_decimal(out, u64::from(self.status));
        out.push(b' ');
        out.extend_from_slice(reason(self.status).as_bytes());
        out.extend_from_slice(b"\r\nDate: ");
        out.extend_from_slice(date);
        let not_modified = self.status == 304;
        if !not_modified {
            out.extend_from_slice(b"\r\nContent-Type: ");
            out.extend_from_slice(self.content_type.as_bytes());
            match &self.stream {
                None => {
                    out.extend_from_slice(b"\r\nContent-Length: ");
                    push_decimal(out, self.body.len() as u64);
                }
                Some(s) if s.chunked => out.extend_from_slice(b"\r\nTransfer-Encoding: chunked"),
                // (HTTP/1.0: the body ends when the connection closes.)
                Some(_) => {}
            }
        }
        out.extend_from_slice(b"\r\n");
        if self.content_type == JSON && !self.headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("cache-control")) {
            out.extend_from_slice(b"Cache-Control: no-store\r\n");
        }
        for (name, value) in &self.headers {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        if self.close {
            out.extend_from_slice(b"Connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
    }
}

/// Whether an `If-None-Match` value names `etag` (RFC 9110 §13.1.2: `*`, or a list compared
/// weakly, so `W/"x"` matches `"x"`).
pub fn none_match(header: &str, etag: &str) -> bool {
    let etag = etag.strip_prefix("W/").unwrap_or(etag);
    header.split(',').map(str::trim).any(|tag| tag == "*" || tag.strip_prefix("W/").unwrap_or(tag) == etag)
}

/// Whether an `If-Range` value lets a `Range` apply (RFC 9110 §13.1.5): only a strong entity
/// tag equal to `etag`; a date or any other validator means the whole representation is sent.
pub fn if_range_holds(header: &str, etag: &str) -> bool {
    let header = header.trim();
    !header.starts_with("W/") && header == etag
}

/// Appends `n` in decimal.
fn push_decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&buf[i..]);
}

/// Default error code names for statuses.
pub fn error_code(status: u16) -> &'static str {
    match status {
        400 => "bad_request",
        401 => "unauthorized",
        403 => "forbidden",
        404 => "not_found",
        405 => "method_not_allowed",
        408 => "request_timeout",
        409 => "conflict",
        413 => "payload_too_large",
        416 => "range_not_satisfiable",
        417 => "expectation_failed",
        426 => "upgrade_required",
        429 => "queue_full",
        431 => "header_too_large",
        501 => "not_implemented",
        503 => "unavailable",
        _ => "error",
    }
}

/// An error answer with the default code for its status (`{"error","message"}`).
pub fn error(status: u16, message: &str) -> Response {
    Response::error(status, error_code(status), message)
}

/// Decodes `%XX` and `+` in a query value; invalid escapes are kept as they are.
pub fn percent_decode(text: &str) -> String {
    String::from_utf8_lossy(&decode_escapes(text, true)).into_owned()
}

/// Decodes `%XX` in a path segment (`+` is itself there, RFC 3986); `None` when the bytes are
/// not UTF-8 (a name must not be guessed at with U+FFFD).
pub fn percent_decode_segment(text: &str) -> Option<String> {
    String::from_utf8(decode_escapes(text, false)).ok()
}

fn decode_escapes(text: &str, plus_is_space: bool) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &str) -> Result<Head, HeadError> {
        let buf = raw.as_bytes();
        let end = find_head_end(buf, 0).ok_or(HeadError::Bad("no end".into()))?;
        parse_head(buf, end)
    }

    fn check(raw: &str, expected: Result<(Method, &str, Framing, bool), u16>) {
        let got = parse(raw).map(|h| (h.method, h.path.clone(), h.framing, h.keep_alive)).map_err(|e| e.status());
        let expected = expected.map(|(m, p, f, k)| (m, p.to_string(), f, k));
        assert_eq!(got, expected, "{raw:?}");
    }

    #[test]
    fn heads() {
        use Framing::*;
        use Method::*;
        check("GET / HTTP/1.1\r\nHost: a\r\n\r\n", Ok((Get, "/", Empty, true)));
        check("GET /tasks/x?wait=true HTTP/1.1\r\nHost: a\r\n\r\n", Ok((Get, "/tasks/x", Empty, true)));
        check("POST /tasks HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n", Ok((Post, "/tasks", Length(5), true)));
        check(
            "POST /t HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
            Ok((Post, "/t", Length(5), true)),
        );
        check("POST /t HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n", Ok((Post, "/t", Chunked, true)));
        check("GET / HTTP/1.0\r\n\r\n", Ok((Get, "/", Empty, false)));
        check("GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n", Ok((Get, "/", Empty, false)));
        check("GET / HTTP/1.1\nHost: lf-only\n\n", Ok((Get, "/", Empty, true)));
        check("BREW /pot HTTP/1.1\r\nHost: a\r\n\r\n", Ok((Other, "/pot", Empty, true)));
        check("POST /t HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", Err(400));
        check("POST /t HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", Err(400));
        check("POST /t HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", Err(400));
        check("POST /t HTTP/1.1\r\nHost: a\r\nContent-Length: +1\r\n\r\n", Err(400));
        check("POST /t HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", Err(501));
        check("GET http://x/ HTTP/1.1\r\nHost: a\r\n\r\n", Err(400));
        check("GET / HTTP/2.0\r\n\r\n", Err(400));
        check("\x01\x02 / HTTP/1.1\r\n\r\n", Err(400));
        let many: String = (0..65).map(|i| format!("X-{i}: v\r\n")).collect();
        check(&format!("GET / HTTP/1.1\r\n{many}\r\n"), Err(431));
        let big = "a".repeat(MAX_HEAD_BYTES);
        check(&format!("GET / HTTP/1.1\r\nX: {big}\r\n\r\n"), Err(431));
    }

    #[test]
    fn unsupported_expect_gets_400() {
        // Issue 10 #12: RFC 9110 §10.1.1 says 417.
        check("POST /t HTTP/1.1\r\nHost: a\r\nExpect: 200-ok\r\n\r\n", Err(417));
        check(
            "POST /t HTTP/1.1\r\nHost: a\r\nExpect: 100-Continue\r\n\r\n",
            Ok((Method::Post, "/t", Framing::Empty, true)),
        );
    }

    #[test]
    fn empty_transfer_encoding_is_ignored() {
        // Issue 10 #13: a Transfer-Encoding without chunked last (empty included) fell back to
        // Content-Length framing: a TE.CL desync behind a proxy that treats "TE present" as
        // chunked. RFC 9112 §6.3: 400.
        for te in ["", " ", ",", " , ", "chunked, gzip", "gzip", "chunked, chunked", "identity"] {
            let raw = format!("POST /t HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: {te}\r\nContent-Length: 13\r\n\r\n");
            assert_eq!(parse(&raw).map_err(|e| e.status()).err(), Some(400), "TE {te:?} + CL");
            let raw = format!("POST /t HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: {te}\r\n\r\n");
            assert_eq!(parse(&raw).map_err(|e| e.status()).err(), Some(400), "TE {te:?}");
        }
        // Two fields form one list: chunked must end it, once.
        check(
            "POST /t HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: \r\nTransfer-Encoding: chunked\r\n\r\n",
            Ok((Method::Post, "/t", Framing::Chunked, true)),
        );
        check(
            "POST /t HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
            Err(400),
        );
    }

    #[test]
    fn host_missing_or_repeated_on_http_1_1_is_accepted() {
        // Issue 10 #15: RFC 9112 §3.2, exactly one Host on HTTP/1.1 (1.0 may omit it).
        check("GET / HTTP/1.1\r\n\r\n", Err(400));
        check("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", Err(400));
        check("GET / HTTP/1.1\r\nHost: a\r\nhost: a\r\n\r\n", Err(400));
        check("GET / HTTP/1.1\r\nHOST: a\r\n\r\n", Ok((Method::Get, "/", Framing::Empty, true)));
        check("GET / HTTP/1.0\r\nHost: a\r\n\r\n", Ok((Method::Get, "/", Framing::Empty, false)));
    }

    #[test]
    fn head_fields() {
        let h = parse(
            "POST /tasks?a=1&wait=true HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer  tok \r\nExpect: 100-continue\r\n\
             X-Forwarded-For: 1.1.1.1\r\nX-Forwarded-For: 2.2.2.2\r\nIdempotency-Key: k1\r\n\r\n",
        )
        .expect("parse");
        assert_eq!(h.bearer_token(), Some("tok"));
        assert_eq!(h.query_param("wait"), Some("true"));
        assert_eq!(h.query_param("b"), None);
        assert!(h.expect_continue);
        assert_eq!(h.forwarded_for.as_deref(), Some("1.1.1.1, 2.2.2.2"));
        assert_eq!(h.idempotency_key.as_deref(), Some("k1"));
    }

    #[test]
    fn a_first_line_that_cannot_be_http_waits_for_header_timeout() {
        // Issue 10 #16: a TLS ClientHello (or any binary) on the plain port got 408 after
        // HEADER_TIMEOUT; it is refused as soon as its first bytes show it is not HTTP.
        for (raw, ok) in [
            (&b"GET / HTTP/1.1\r\nHost: a\r\n"[..], true),
            (b"G", true),
            (b"", true),
            (b"\r\nPOST /tasks HT", true),
            (b"BREW /pot HTTP/1.1\r\n", true),
            (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", false),
            (b"GET\t/ HTTP/1.1\r\n", false),
            (b" GET / HTTP/1.1\r\n", false),
            (b"GET /\x00 HTTP/1.1\r\n", false),
            (b"GET /\xc3\xa9 HTTP/1.1\r\n", true),
            (b"{\"payload\":1}", false),
        ] {
            assert_eq!(could_be_request(raw), ok, "{raw:?}");
        }
        // Past the first line (or 64 bytes of it), anything goes: the parser decides.
        let mut long = b"GET /".to_vec();
        long.extend_from_slice(&[b'a'; 100]);
        long.push(0);
        assert!(could_be_request(&long));
    }

    #[test]
    fn head_end_is_found_incrementally() {
        let raw = b"GET / HTTP/1.1\r\nHost: a\r\n\r\nNEXT";
        for split in 0..raw.len() {
            // Scanning the first part, then the whole, must find the same end.
            let first = find_head_end(&raw[..split], 0);
            let whole = find_head_end(raw, split);
            assert_eq!(first.or(whole), Some(raw.len() - 4), "split at {split}");
        }
    }

    fn check_chunked(input: &[&[u8]], limit: usize, expected: Result<(&[u8], usize), ChunkError>) {
        let mut dec = ChunkedDecoder::default();
        let mut out = Vec::new();
        let mut consumed = 0;
        let mut result = Ok(());
        for part in input {
            match dec.decode(part, &mut out, limit) {
                Ok(n) => consumed += n,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        let got = result
            .map(|()| (out.as_slice(), consumed))
            .and_then(|v| if dec.is_done() { Ok(v) } else { Err(ChunkError::Malformed("not done")) });
        assert_eq!(got, expected, "{input:?}");
    }

    #[test]
    fn chunked_table() {
        check_chunked(&[b"5\r\nhello\r\n0\r\n\r\n"], 100, Ok((b"hello", 15)));
        check_chunked(&[b"5\r\nhel", b"lo\r\n6\r\n world\r\n0\r\n\r\n"], 100, Ok((b"hello world", 26)));
        check_chunked(&[b"5;ext=1\r\nhello\r\n0\r\nTrailer: x\r\n\r\n"], 100, Ok((b"hello", 33)));
        check_chunked(&[b"A\r\n0123456789\r\n0\r\n\r\nGET /next"], 100, Ok((b"0123456789", 20)));
        check_chunked(&[b"5;a=\"x;y\\\"z\"\r\nhello\r\n0\r\n\r\n"], 100, Ok((b"hello", 26)));
        // Split at every byte.
        let raw = b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        let parts: Vec<&[u8]> = raw.chunks(1).collect();
        check_chunked(&parts, 100, Ok((b"abcde", raw.len())));
        check_chunked(&[b"5\r\nhello\r\n"], 4, Err(ChunkError::TooLarge));
        check_chunked(&[b"x\r\n"], 100, Err(ChunkError::Malformed("invalid chunk size")));
        check_chunked(&[b"\r\n"], 100, Err(ChunkError::Malformed("invalid chunk size")));
        check_chunked(&[b"5\r\nhelloX"], 100, Err(ChunkError::Malformed("expected CRLF after chunk data")));
        check_chunked(&[b"00000000000000005\r\n"], 100, Err(ChunkError::Malformed("chunk size too long")));
        check_chunked(&[b"1000000000000000\r\n"], 1 << 62, Err(ChunkError::Malformed("chunk size too long")));
    }

    #[test]
    fn bare_lf_inside_chunked_framing_is_accepted() {
        // Issue 10 #14: chunked framing requires CRLF; NUL or a quoted CRLF in an extension,
        // and obs-fold or NUL in trailers, are refused as they would be in a header.
        let table: &[(&[u8], &str)] = &[
            (b"5\nhello\r\n0\r\n\r\n", "bare LF in a chunk size line"),
            (b"5\r\nhello\n0\r\n\r\n", "expected CRLF after chunk data"),
            (b"5\r\nhello\r\n0\n\r\n", "bare LF in a chunk size line"),
            (b"5\r\nhello\r\n0\r\n\n", "bare LF or control byte in trailers"),
            (b"5;a=b\nhello\r\n0\r\n\r\n", "bare CR or LF in a chunk extension"),
            (b"5;a=\0\r\nhello\r\n0\r\n\r\n", "control byte in a chunk extension"),
            (b"5;a=\"x\r\ny\"\r\nhello\r\n0\r\n\r\n", "bare CR or LF in a chunk extension"),
            (b"5\r\nhello\r\n0\r\nX: a\r\n b\r\n\r\n", "obs-fold in trailers"),
            (b"5\r\nhello\r\n0\r\nX: a\0\r\n\r\n", "bare LF or control byte in trailers"),
            (b"5\r\nhello\r\n0\r\nX: a\n\r\n", "bare LF or control byte in trailers"),
            (b"5\r\nhello\r\n0\r\nX: a\rb\r\n\r\n", "expected LF after a trailer line"),
        ];
        for (raw, why) in table {
            check_chunked(&[raw], 100, Err(ChunkError::Malformed(why)));
            // Fed a byte at a time, the same verdict.
            let parts: Vec<&[u8]> = raw.chunks(1).collect();
            check_chunked(&parts, 100, Err(ChunkError::Malformed(why)));
        }
    }

    #[test]
    fn chunk_size_over_the_body_limit_waits_for_the_bytes() {
        // Issue 10 #16: a declared chunk size over the limit is refused at its size line, not
        // after its bytes (which a client may never send).
        check_chunked(&[b"65\r\n"], 100, Err(ChunkError::TooLarge));
        check_chunked(&[b"64\r\n"], 100, Err(ChunkError::Malformed("not done")));
        check_chunked(&[b"32\r\n", &[b'a'; 50], b"\r\n33\r\n"], 100, Err(ChunkError::TooLarge));
        check_chunked(&[b"ffffffff"], 1 << 20, Err(ChunkError::TooLarge));
    }

    #[test]
    fn response_bytes() {
        let mut out = Vec::new();
        Response::error(405, "method_not_allowed", "use GET").with_header("Allow", "GET").closing().write_to(
            &mut out,
            false,
            b"Sun, 06 Nov 1994 08:49:37 GMT",
        );
        let text = String::from_utf8(out).expect("utf8");
        assert!(
            text.starts_with("HTTP/1.1 405 Method Not Allowed\r\nDate: Sun, 06 Nov 1994 08:49:37 GMT\r\n"),
            "{text}"
        );
        assert!(text.contains("\r\nAllow: GET\r\n") && text.contains("Connection: close\r\n"));
        assert!(text.contains("\r\nCache-Control: no-store\r\n"), "{text}");
        assert!(text.ends_with("\r\n\r\n{\"error\":\"method_not_allowed\",\"message\":\"use GET\"}"));
        // A 304 has no body and no Content-Length (it could only be the 200's).
        let mut out = Vec::new();
        let mut r = Response::json(304, Vec::new()).with_header("ETag", "\"x\"");
        r.content_type = "text/css";
        r.write_to(&mut out, false, b"Sun, 06 Nov 1994 08:49:37 GMT");
        let text = String::from_utf8(out).expect("utf8");
        assert!(!text.contains("Content-Length") && text.ends_with("ETag: \"x\"\r\n\r\n"), "{text}");
    }

    #[test]
    fn validators() {
        let etag = "\"abc\"";
        for (header, want) in [
            ("\"abc\"", true),
            ("W/\"abc\"", true),
            ("\"x\", \"abc\"", true),
            ("*", true),
            ("\"abcd\"", false),
            ("", false),
        ] {
            assert_eq!(none_match(header, etag), want, "If-None-Match {header:?}");
        }
        for (header, want) in [
            ("\"abc\"", true),
            (" \"abc\" ", true),
            ("W/\"abc\"", false),
            ("\"other\"", false),
            ("Sun, 06 Nov 1994 08:49:37 GMT", false),
        ] {
            assert_eq!(if_range_holds(header, etag), want, "If-Range {header:?}");
        }
    }

    #[test]
    fn percent_decoding() {
        for (input, expected) in
            [("a%20b", "a b"), ("a+b", "a b"), ("%zz", "%zz"), ("100%", "100%"), ("%4", "%4"), ("x%41", "xA")]
        {
            assert_eq!(percent_decode(input), expected, "{input}");
        }
        for (input, expected) in
            [("c++", Some("c++")), ("a%2Fb", Some("a/b")), ("a%20b", Some("a b")), ("%E2%82", None)]
        {
            assert_eq!(percent_decode_segment(input).as_deref(), expected, "{input}");
        }
    }
}
