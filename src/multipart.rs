//! A streaming `multipart/form-data` parser. No I/O and no copies of part data: it is fed the
//! bytes that have arrived, reports events whose data borrow from that input, and says how much
//! it consumed; the caller keeps the rest (at most a delimiter's length, or a part's headers)
//! and feeds it again with what arrives next. So a boundary split across reads is found, and
//! memory stays bounded whatever the size of a part.

use std::fmt;

/// Part headers larger than this are an error (a bound on what must be buffered).
pub const MAX_PART_HEADER_BYTES: usize = 8 * 1024;
/// RFC 2046: a boundary is 1 to 70 characters.
const MAX_BOUNDARY_BYTES: usize = 70;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PartInfo {
    /// The `name` of `Content-Disposition: form-data`.
    pub name: Option<String>,
    /// The `filename` (or decoded `filename*`), unsanitised.
    pub filename: Option<String>,
    pub content_type: Option<String>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Event<'a> {
    PartStart(PartInfo),
    Data(&'a [u8]),
    PartEnd,
    /// The closing delimiter was seen; anything after it is ignored.
    End,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MultipartError {
    BadContentType(&'static str),
    Malformed(&'static str),
}

impl fmt::Display for MultipartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MultipartError::BadContentType(why) | MultipartError::Malformed(why) => f.write_str(why),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the first delimiter (preamble is discarded).
    Start,
    /// Just after a delimiter: `--` (the end) or CRLF (a part follows).
    AfterDelimiter,
    Headers,
    Body,
    /// After the closing delimiter.
    Epilogue,
}

pub struct Multipart {
    /// `\r\n--` + boundary.
    delimiter: Vec<u8>,
    state: State,
    /// Nothing consumed yet: the first delimiter may come without a CRLF before it.
    at_body_start: bool,
}

impl Multipart {
    /// From the request's `Content-Type` (`multipart/form-data; boundary=...`).
    pub fn new(content_type: &str) -> Result<Multipart, MultipartError> {
        let mut parts = content_type.split(';');
        let mime = parts.next().unwrap_or("").trim();
        if !mime.eq_ignore_ascii_case("multipart/form-data") {
            return Err(MultipartError::BadContentType("Content-Type must be multipart/form-data"));
        }
        let boundary = params(content_type)
            .into_iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("boundary"))
            .map(|(_, v)| v)
            .ok_or(MultipartError::BadContentType("multipart Content-Type without a boundary"))?;
        if boundary.is_empty()
            || boundary.len() > MAX_BOUNDARY_BYTES
            || boundary.bytes().any(|b| !(0x20..=0x7e).contains(&b))
        {
            return Err(MultipartError::BadContentType("invalid multipart boundary"));
        }
        let mut delimiter = b"\r\n--".to_vec();
        delimiter.extend_from_slice(boundary.as_bytes());
        Ok(Multipart { delimiter, state: State::Start, at_body_start: true })
    }

    pub fn is_done(&self) -> bool {
        self.state == State::Epilogue
    }

    /// Parses as much of `input` as it can, appending events. Returns the bytes consumed; the
    /// caller must present the unconsumed rest again, followed by new bytes.
    pub fn feed<'a>(&mut self, input: &'a [u8], events: &mut Vec<Event<'a>>) -> Result<usize, MultipartError> {
        let mut pos = 0;
        loop {
            let rest = &input[pos..];
            match self.state {
                State::Start => {
                    // The first delimiter may open the body without a preceding CRLF.
                    let dash = &self.delimiter[2..];
                    if self.at_body_start && rest.len() < dash.len() && dash.starts_with(rest) {
                        return Ok(pos);
                    }
                    if self.at_body_start && rest.starts_with(dash) {
                        pos += dash.len();
                        self.state = State::AfterDelimiter;
                        continue;
                    }
                    match find(rest, &self.delimiter) {
                        Some(at) => {
                            pos += at + self.delimiter.len();
                            self.state = State::AfterDelimiter;
                        }
                        None => {
                            // Preamble: discard all but what could start a delimiter.
                            let keep = self.delimiter.len() - 1;
                            let discard = rest.len().saturating_sub(keep);
                            if discard > 0 {
                                self.at_body_start = false;
                            }
                            return Ok(pos + discard);
                        }
                    }
                }
                State::AfterDelimiter => {
                    if rest.len() < 2 {
                        return Ok(pos);
                    }
                    if rest.starts_with(b"--") {
                        pos += 2;
                        self.state = State::Epilogue;
                        events.push(Event::End);
                        continue;
                    }
                    // Transport padding (spaces, tabs) may precede the CRLF.
                    let pad = rest.iter().take_while(|b| **b == b' ' || **b == b'\t').count();
                    if pad > 256 {
                        return Err(MultipartError::Malformed("too much padding after a boundary"));
                    }
                    if rest.len() < pad + 2 {
                        return Ok(pos);
                    }
                    if &rest[pad..pad + 2] != b"\r\n" {
                        return Err(MultipartError::Malformed("expected CRLF after a boundary"));
                    }
                    pos += pad + 2;
                    self.state = State::Headers;
                }
                State::Headers => {
                    let end = if rest.starts_with(b"\r\n") {
                        Some((0, 2))
                    } else {
                        find(rest, b"\r\n\r\n").map(|at| (at, at + 4))
                    };
                    let Some((block_end, consumed)) = end else {
                        if rest.len() > MAX_PART_HEADER_BYTES {
                            return Err(MultipartError::Malformed("part headers over 8 KiB"));
                        }
                        return Ok(pos);
                    };
                    if block_end > MAX_PART_HEADER_BYTES {
                        return Err(MultipartError::Malformed("part headers over 8 KiB"));
                    }
                    let info = parse_part_headers(&rest[..block_end])?;
                    events.push(Event::PartStart(info));
                    pos += consumed;
                    self.state = State::Body;
                }
                State::Body => match find(rest, &self.delimiter) {
                    Some(at) => {
                        if at > 0 {
                            events.push(Event::Data(&rest[..at]));
                        }
                        events.push(Event::PartEnd);
                        pos += at + self.delimiter.len();
                        self.state = State::AfterDelimiter;
                    }
                    None => {
                        let safe = safe_prefix(rest, &self.delimiter);
                        if safe > 0 {
                            events.push(Event::Data(&rest[..safe]));
                        }
                        return Ok(pos + safe);
                    }
                },
                State::Epilogue => return Ok(input.len()),
            }
        }
    }
}

/// How much of `data` certainly holds no start of `delimiter`: everything before the last
/// position where a prefix of it could begin.
fn safe_prefix(data: &[u8], delimiter: &[u8]) -> usize {
    let tail_start = data.len().saturating_sub(delimiter.len() - 1);
    for i in tail_start..data.len() {
        if delimiter.starts_with(&data[i..]) {
            return i;
        }
    }
    data.len()
}

/// First occurrence of `needle` in `hay` (needles here start with CR, which is rare in text and
/// common only at line ends, so scanning for it first is cheap).
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    let first = *needle.first()?;
    let mut i = 0;
    while i + needle.len() <= hay.len() {
        match hay[i..hay.len() - needle.len() + 1].iter().position(|b| *b == first) {
            None => return None,
            Some(off) => {
                i += off;
                if &hay[i..i + needle.len()] == needle {
                    return Some(i);
                }
                i += 1;
            }
        }
    }
    None
}

fn parse_part_headers(block: &[u8]) -> Result<PartInfo, MultipartError> {
    let text = std::str::from_utf8(block).map_err(|_| MultipartError::Malformed("part headers are not UTF-8"))?;
    let mut info = PartInfo::default();
    for line in text.split("\r\n").filter(|l| !l.is_empty()) {
        let (name, value) =
            line.split_once(':').ok_or(MultipartError::Malformed("part header line without a colon"))?;
        let value = value.trim();
        if name.trim().eq_ignore_ascii_case("content-disposition") {
            let mut star = None;
            for (k, v) in params(value) {
                if k.eq_ignore_ascii_case("name") {
                    info.name = Some(v);
                } else if k.eq_ignore_ascii_case("filename") {
                    info.filename = Some(v);
                } else if k.eq_ignore_ascii_case("filename*") {
                    star = decode_ext_value(&v);
                }
            }
            if star.is_some() {
                info.filename = star;
            }
        } else if name.trim().eq_ignore_ascii_case("content-type") {
            info.content_type = Some(value.to_string());
        }
    }
    Ok(info)
}

/// `key=value` parameters after the first `;`, values unquoted (backslash escapes honoured).
fn params(header: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let bytes = header.as_bytes();
    let mut i = match header.find(';') {
        Some(p) => p + 1,
        None => return out,
    };
    while i < bytes.len() {
        while i < bytes.len() && (bytes[i] == b' ' || bytes[i] == b'\t' || bytes[i] == b';') {
            i += 1;
        }
        let key_start = i;
        while i < bytes.len() && bytes[i] != b'=' && bytes[i] != b';' {
            i += 1;
        }
        let key = header[key_start..i].trim().to_string();
        if i >= bytes.len() || bytes[i] == b';' {
            continue;
        }
        i += 1; // '='
        while i < bytes.len() && (bytes[i] == b' ' || bytes[i] == b'\t') {
            i += 1;
        }
        let mut value = Vec::new();
        if i < bytes.len() && bytes[i] == b'"' {
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                if bytes[i] == b'\\' && i + 1 < bytes.len() {
                    i += 1;
                }
                value.push(bytes[i]);
                i += 1;
            }
            i += 1; // closing quote
        } else {
            while i < bytes.len() && bytes[i] != b';' {
                value.push(bytes[i]);
                i += 1;
            }
            while value.last().is_some_and(|b| *b == b' ' || *b == b'\t') {
                value.pop();
            }
        }
        if !key.is_empty() {
            out.push((key, String::from_utf8_lossy(&value).into_owned()));
        }
    }
    out
}

/// RFC 5987 `UTF-8''%E2%82%AC.txt` → `€.txt`.
fn decode_ext_value(v: &str) -> Option<String> {
    let (charset, rest) = v.split_once('\'')?;
    let (_lang, encoded) = rest.split_once('\'')?;
    if !charset.eq_ignore_ascii_case("utf-8") {
        return None;
    }
    let bytes = encoded.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parsed body, as a list of owned events (data of consecutive Data events joined).
    #[derive(Debug, PartialEq, Eq)]
    enum Ev {
        Start(Option<String>, Option<String>, Option<String>),
        Data(Vec<u8>),
        End,
        Done,
    }

    /// Feeds `body` in pieces of `step` bytes (carrying the unconsumed rest), as the reactor does.
    fn run(content_type: &str, body: &[u8], step: usize) -> Result<Vec<Ev>, MultipartError> {
        let mut p = Multipart::new(content_type)?;
        let mut buf = Vec::new();
        let mut out: Vec<Ev> = Vec::new();
        for piece in body.chunks(step.max(1)) {
            buf.extend_from_slice(piece);
            let mut events = Vec::new();
            let used = p.feed(&buf, &mut events)?;
            for e in events {
                match e {
                    Event::PartStart(i) => out.push(Ev::Start(i.name, i.filename, i.content_type)),
                    Event::Data(d) => match out.last_mut() {
                        Some(Ev::Data(v)) => v.extend_from_slice(d),
                        _ => out.push(Ev::Data(d.to_vec())),
                    },
                    Event::PartEnd => out.push(Ev::End),
                    Event::End => out.push(Ev::Done),
                }
            }
            buf.drain(..used);
            assert!(buf.len() <= MAX_PART_HEADER_BYTES + 80, "the carried rest stays bounded");
        }
        Ok(out)
    }

    const CT: &str = "multipart/form-data; boundary=XyZ";

    fn check(body: &str, expected: Result<Vec<Ev>, MultipartError>) {
        for step in [1, 2, 3, 5, 7, 64, 10_000] {
            assert_eq!(run(CT, body.as_bytes(), step), expected, "step {step}, body {body:?}");
        }
    }

    fn start(name: &str, filename: Option<&str>, ct: Option<&str>) -> Ev {
        Ev::Start(Some(name.into()), filename.map(Into::into), ct.map(Into::into))
    }

    #[test]
    fn bodies() {
        check(
            "--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\nContent-Type: text/plain\r\n\r\nhello\r\n--XyZ--\r\n",
            Ok(vec![start("file", Some("a.txt"), Some("text/plain")), Ev::Data(b"hello".to_vec()), Ev::End, Ev::Done]),
        );
        // Preamble, two parts, epilogue; data containing CRLF and near-boundaries.
        check(
            "preamble\r\n--XyZ\r\nContent-Disposition: form-data; name=note\r\n\r\nx\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b\"\r\n\r\nline1\r\n--Xy\r\n-XyZ\r\n--XyZ--epilogue",
            Ok(vec![
                start("note", None, None),
                Ev::Data(b"x".to_vec()),
                Ev::End,
                start("file", Some("b"), None),
                Ev::Data(b"line1\r\n--Xy\r\n-XyZ".to_vec()),
                Ev::End,
                Ev::Done,
            ]),
        );
        // An empty part and a part without headers.
        check(
            "--XyZ\r\nContent-Disposition: form-data; name=\"e\"\r\n\r\n\r\n--XyZ\r\n\r\nraw\r\n--XyZ--",
            Ok(vec![
                start("e", None, None),
                Ev::End,
                Ev::Start(None, None, None),
                Ev::Data(b"raw".to_vec()),
                Ev::End,
                Ev::Done,
            ]),
        );
        // Padding after the boundary; quoted names with escapes; RFC 5987 filename*.
        check(
            "--XyZ  \r\nContent-Disposition: form-data; name=\"f\\\"q\"; filename=\"x.bin\"; filename*=UTF-8''%E2%82%AC.txt\r\n\r\n1\r\n--XyZ--",
            Ok(vec![start("f\"q", Some("€.txt"), None), Ev::Data(b"1".to_vec()), Ev::End, Ev::Done]),
        );
    }

    #[test]
    fn malformed() {
        check(
            "--XyZ\r\nNo colon here\r\n\r\nx\r\n--XyZ--",
            Err(MultipartError::Malformed("part header line without a colon")),
        );
        check("--XyZX\r\n\r\n", Err(MultipartError::Malformed("expected CRLF after a boundary")));
        let big = format!("--XyZ\r\nX-Big: {}\r\n\r\n", "a".repeat(MAX_PART_HEADER_BYTES));
        assert_eq!(run(CT, big.as_bytes(), 10_000), Err(MultipartError::Malformed("part headers over 8 KiB")));
    }

    #[test]
    fn unfinished_body_is_not_done() {
        let mut p = Multipart::new(CT).expect("ct");
        let mut ev = Vec::new();
        let body = b"--XyZ\r\n\r\nabc";
        p.feed(body, &mut ev).expect("feed");
        assert!(!p.is_done());
    }

    #[test]
    fn content_types() {
        for (ct, ok) in [
            ("multipart/form-data; boundary=abc", true),
            ("Multipart/Form-Data;boundary=\"a b:c\"", true),
            ("multipart/form-data", false),
            ("multipart/form-data; boundary=", false),
            ("application/json; boundary=abc", false),
            (&format!("multipart/form-data; boundary={}", "b".repeat(71)), false),
        ] {
            assert_eq!(Multipart::new(ct).is_ok(), ok, "{ct}");
        }
    }

    #[test]
    fn large_part_streams_with_bounded_carry() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let mut body = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\n".to_vec();
        body.extend_from_slice(&data);
        body.extend_from_slice(b"\r\n--XyZ--\r\n");
        let out = run(CT, &body, 4096).expect("parse");
        assert_eq!(out[1], Ev::Data(data));
    }
}
