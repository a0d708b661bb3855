//! Files (`/files`): the protocol between the event loop and the thread that stores them — on
//! disk (`disk`) or in the database (`pg`) — and the pure helpers of the API.
//!
//! The loop sends [`Job`]s; the thread answers with [`Done`]s and wakes the loop.
//!
//! Also here: the pure helpers of the `/files` API (file name sanitising, `Content-Disposition`,
//! `Range`).

pub mod disk;
pub mod pg;

pub use disk::{blob_path, prepare_blob_dir};

use std::io;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::multipart::{Event, Multipart};

use crate::log::Level;

pub type TransferId = u64;

/// What the store keeps about a file, next to it as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileMeta {
    pub file_id: String,
    pub filename: String,
    pub content_type: String,
    pub size: u64,
    pub sha256: String,
    pub created_ms: u64,
    pub expires_ms: u64,
}

#[derive(Debug)]
pub enum Job {
    /// Create BLOB_DIR, remove temp files and files past their time; report the rest.
    Scan {
        now_wall_ms: u64,
    },
    /// The same clean-up, reporting nothing (run every hour for leftovers of uploads that
    /// were under way, here or in another relay, when this one started).
    Sweep {
        now_wall_ms: u64,
    },
    Create {
        t: TransferId,
        file_id: u128,
    },
    Write {
        t: TransferId,
        data: Vec<u8>,
    },
    /// Flush, rename into place, write the metadata.
    Finish {
        t: TransferId,
        meta: FileMeta,
    },
    Abort {
        t: TransferId,
    },
    Open {
        t: TransferId,
        file_id: u128,
        now_wall_ms: u64,
    },
    Read {
        t: TransferId,
        offset: u64,
        len: usize,
    },
    Close {
        t: TransferId,
    },
    Delete {
        file_id: u128,
    },
}

#[derive(Debug)]
pub enum Done {
    Scanned(Vec<(u128, u64)>),
    Created { t: TransferId, result: Result<(), String> },
    Written { t: TransferId, len: usize },
    Finished { t: TransferId, result: Result<FileMeta, String> },
    Opened { t: TransferId, result: Result<FileMeta, OpenError> },
    Read { t: TransferId, result: Result<Vec<u8>, String> },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenError {
    NotFound,
    Io(String),
}

/// The loop's handle on the disk thread.
pub struct Store {
    jobs: Sender<Job>,
    done: Receiver<Done>,
    /// The files live in the database ([`pg`]), not on this node's disk.
    in_database: bool,
}

impl Store {
    /// Starts a thread that answers jobs with `run` (the disk here; the database in cluster
    /// mode, [`pg`]): the same protocol, so the reactor's transfers do not care.
    pub fn spawn(
        name: &str,
        mut run: impl FnMut(Job) -> Option<Done> + Send + 'static,
        wake: Arc<dyn Fn() + Send + Sync>,
    ) -> io::Result<Store> {
        let (jobs_tx, jobs_rx) = channel::<Job>();
        let (done_tx, done_rx) = channel::<Done>();
        std::thread::Builder::new().name(name.into()).spawn(move || {
            while let Ok(job) = jobs_rx.recv() {
                if let Some(done) = run(job) {
                    if done_tx.send(done).is_err() {
                        return;
                    }
                    wake();
                }
            }
        })?;
        Ok(Store { jobs: jobs_tx, done: done_rx, in_database: false })
    }

    /// The answer when this store could not do its job: a broken disk is the server's error
    /// (500); an unreachable database a 503 the caller may retry, perhaps through another node.
    pub fn failed(&self, message: &str) -> crate::http::Response {
        if self.in_database {
            crate::http::Response::error(
                503,
                "database_unavailable",
                &format!("{message}: the database is unreachable"),
            )
        } else {
            crate::http::error(500, message)
        }
    }

    pub fn send(&self, job: Job) {
        // The thread lives as long as the process; a send can only fail after it died.
        if self.jobs.send(job).is_err() {
            crate::log!(Level::Error, "disk thread is gone");
        }
    }

    pub fn try_done(&self) -> Option<Done> {
        self.done.try_recv().ok()
    }
}

/// The name a file is stored and served under: the last path component, without control
/// characters or quotes, at most 255 bytes; `file` when nothing is left.
pub fn sanitize_filename(raw: &str) -> String {
    let base = raw.rsplit(['/', '\\']).next().unwrap_or("");
    let mut out = String::new();
    for c in base.chars() {
        if c.is_control() || c == '"' || c == '\u{7f}' {
            continue;
        }
        if out.len() + c.len_utf8() > 255 {
            break;
        }
        out.push(c);
    }
    let trimmed = out.trim().trim_start_matches('.').to_string();
    if trimmed.is_empty() { "file".to_string() } else { trimmed }
}

/// A part's content type if it is a plausible header value, else `application/octet-stream`.
pub fn sanitize_content_type(raw: Option<&str>) -> String {
    match raw.map(str::trim) {
        Some(ct)
            if !ct.is_empty()
                && ct.len() <= 255
                && ct.bytes().all(|b| (0x20..0x7f).contains(&b))
                && ct.contains('/') =>
        {
            ct.to_string()
        }
        _ => "application/octet-stream".to_string(),
    }
}

/// `attachment; filename="..."` (ASCII fallback) plus `filename*=UTF-8''...` when the name is
/// not plain ASCII.
pub fn content_disposition(filename: &str) -> String {
    let ascii: String = filename
        .chars()
        .map(|c| if c.is_ascii() && !c.is_ascii_control() && c != '"' && c != '\\' { c } else { '_' })
        .collect();
    if ascii == filename {
        return format!("attachment; filename=\"{ascii}\"");
    }
    let mut encoded = String::new();
    for b in filename.bytes() {
        if b.is_ascii_alphanumeric() || b"!#$&+-.^_`|~".contains(&b) {
            encoded.push(b as char);
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    format!("attachment; filename=\"{ascii}\"; filename*=UTF-8''{encoded}")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeAnswer {
    /// No usable Range: the whole file (200).
    Full,
    /// One satisfiable range, `start..end` (206).
    Partial { start: u64, end: u64 },
    /// 416.
    Unsatisfiable,
}

/// A single `bytes=` range (RFC 9110); several ranges or other units are ignored (→ 200).
pub fn parse_range(header: Option<&str>, size: u64) -> RangeAnswer {
    let Some(spec) = header.and_then(|h| h.trim().strip_prefix("bytes=")) else { return RangeAnswer::Full };
    if spec.contains(',') {
        return RangeAnswer::Full;
    }
    let Some((first, last)) = spec.trim().split_once('-') else { return RangeAnswer::Full };
    let (first, last) = (first.trim(), last.trim());
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if first.is_empty() {
        // Suffix: the last N bytes.
        let Some(n) = Some(last).filter(|s| digits(s)).and_then(|s| s.parse::<u64>().ok()) else {
            return RangeAnswer::Full;
        };
        if n == 0 || size == 0 {
            return RangeAnswer::Unsatisfiable;
        }
        return RangeAnswer::Partial { start: size.saturating_sub(n), end: size };
    }
    let Some(start) = Some(first).filter(|s| digits(s)).and_then(|s| s.parse::<u64>().ok()) else {
        return RangeAnswer::Full;
    };
    let end = if last.is_empty() {
        size
    } else {
        match Some(last).filter(|s| digits(s)).and_then(|s| s.parse::<u64>().ok()) {
            Some(l) if l >= start => l.saturating_add(1).min(size),
            _ => return RangeAnswer::Full,
        }
    };
    if start >= size {
        return RangeAnswer::Unsatisfiable;
    }
    RangeAnswer::Partial { start, end }
}

/// Why an upload cannot be accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UploadError {
    /// 413: the `file` part is over MAX_FILE_SIZE.
    TooLarge,
    /// 400 with this message.
    Bad(String),
}

/// The multipart side of one upload, without I/O: finds the `file` part, hashes and counts
/// its bytes, enforces MAX_FILE_SIZE, and hands back the bytes to write.
pub struct UploadParse {
    parser: Multipart,
    in_file: bool,
    file_seen: bool,
    filename: String,
    content_type: String,
    hasher: Sha256,
    size: u64,
    max_file_bytes: u64,
}

/// What a finished upload knows about its file.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Uploaded {
    pub filename: String,
    pub content_type: String,
    pub size: u64,
    pub sha256: String,
}

impl UploadParse {
    pub fn new(content_type: Option<&str>, max_file_bytes: u64) -> Result<UploadParse, UploadError> {
        let ct = content_type
            .ok_or_else(|| UploadError::Bad("POST /files needs Content-Type: multipart/form-data".into()))?;
        let parser = Multipart::new(ct).map_err(|e| UploadError::Bad(e.to_string()))?;
        Ok(UploadParse {
            parser,
            in_file: false,
            file_seen: false,
            filename: String::new(),
            content_type: String::new(),
            hasher: Sha256::new(),
            size: 0,
            max_file_bytes,
        })
    }

    /// Parses `input`; returns the bytes consumed and appends file bytes to `to_disk`.
    pub fn feed(&mut self, input: &[u8], to_disk: &mut Vec<u8>) -> Result<usize, UploadError> {
        let mut events = Vec::new();
        let parsed = self.parser.feed(input, &mut events);
        // The events that came before a parse error count first, so the answer does not depend
        // on how the body was split: a file already over the limit is 413 whatever follows.
        self.apply(events, to_disk)?;
        parsed.map_err(|e| UploadError::Bad(format!("malformed multipart body: {e}")))
    }

    fn apply(&mut self, events: Vec<Event<'_>>, to_disk: &mut Vec<u8>) -> Result<(), UploadError> {
        for event in events {
            match event {
                Event::PartStart(info) => {
                    // The first part named `file` is the file; other parts are ignored.
                    self.in_file = !self.file_seen && info.name.as_deref() == Some("file");
                    if self.in_file {
                        self.file_seen = true;
                        self.filename = sanitize_filename(info.filename.as_deref().unwrap_or(""));
                        self.content_type = sanitize_content_type(info.content_type.as_deref());
                    }
                }
                Event::Data(data) if self.in_file => {
                    self.size += data.len() as u64;
                    if self.size > self.max_file_bytes {
                        return Err(UploadError::TooLarge);
                    }
                    self.hasher.update(data);
                    to_disk.extend_from_slice(data);
                }
                Event::Data(_) => {}
                Event::PartEnd => self.in_file = false,
                Event::End => {}
            }
        }
        Ok(())
    }

    pub fn is_done(&self) -> bool {
        self.parser.is_done()
    }

    /// After the closing boundary: the file's description, or why there is none.
    pub fn finish(self) -> Result<Uploaded, UploadError> {
        if !self.parser.is_done() {
            return Err(UploadError::Bad("multipart body ended before its closing boundary".into()));
        }
        if !self.file_seen {
            return Err(UploadError::Bad("no part named \"file\" in the multipart body".into()));
        }
        let digest = self.hasher.finalize();
        let mut sha256 = String::with_capacity(64);
        for b in digest.iter() {
            sha256.push_str(&format!("{b:02x}"));
        }
        Ok(Uploaded { filename: self.filename, content_type: self.content_type, size: self.size, sha256 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filenames() {
        for (raw, expected) in [
            ("report.pdf", "report.pdf"),
            ("../../etc/passwd", "passwd"),
            ("C:\\Users\\x\\a.txt", "a.txt"),
            ("a\"b\r\n.txt", "ab.txt"),
            ("", "file"),
            ("..", "file"),
            (".hidden", "hidden"),
            ("dir/", "file"),
            ("€uro.txt", "€uro.txt"),
        ] {
            assert_eq!(sanitize_filename(raw), expected, "{raw:?}");
        }
        assert!(sanitize_filename(&"é".repeat(300)).len() <= 255);
    }

    #[test]
    fn dispositions() {
        assert_eq!(content_disposition("a b.txt"), "attachment; filename=\"a b.txt\"");
        assert_eq!(content_disposition("€.txt"), "attachment; filename=\"_.txt\"; filename*=UTF-8''%E2%82%AC.txt");
    }

    #[test]
    fn content_types() {
        assert_eq!(sanitize_content_type(Some("image/png")), "image/png");
        assert_eq!(sanitize_content_type(Some("text/plain; charset=utf-8")), "text/plain; charset=utf-8");
        assert_eq!(sanitize_content_type(Some("evil\r\nX: y")), "application/octet-stream");
        assert_eq!(sanitize_content_type(Some("nonsense")), "application/octet-stream");
        assert_eq!(sanitize_content_type(None), "application/octet-stream");
    }

    #[test]
    fn ranges() {
        use RangeAnswer::*;
        let table: &[(Option<&str>, u64, RangeAnswer)] = &[
            (None, 100, Full),
            (Some("bytes=0-9"), 100, Partial { start: 0, end: 10 }),
            (Some("bytes=90-"), 100, Partial { start: 90, end: 100 }),
            (Some("bytes=90-500"), 100, Partial { start: 90, end: 100 }),
            (Some("bytes=-10"), 100, Partial { start: 90, end: 100 }),
            (Some("bytes=-500"), 100, Partial { start: 0, end: 100 }),
            (Some("bytes=100-"), 100, Unsatisfiable),
            (Some("bytes=-0"), 100, Unsatisfiable),
            (Some("bytes=5-1"), 100, Full),
            (Some("bytes=0-1,5-6"), 100, Full),
            (Some("items=0-1"), 100, Full),
            (Some("bytes=x-1"), 100, Full),
            (Some("bytes=0-0"), 0, Unsatisfiable),
        ];
        for (header, size, expected) in table {
            assert_eq!(parse_range(*header, *size), *expected, "{header:?} of {size}");
        }
    }

    fn check_upload(body: &str, max: u64, step: usize, expected: Result<(&str, &str, &[u8]), UploadError>) {
        let mut up = UploadParse::new(Some("multipart/form-data; boundary=b"), max).expect("content type");
        let mut buf = Vec::new();
        let mut disk = Vec::new();
        let mut failed = None;
        for piece in body.as_bytes().chunks(step) {
            buf.extend_from_slice(piece);
            match up.feed(&buf, &mut disk) {
                Ok(used) => drop(buf.drain(..used)),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let got = match failed {
            Some(e) => Err(e),
            None => up.finish().map(|u| (u.filename, u.content_type)),
        };
        let expected_meta = expected.clone().map(|(f, c, _)| (f.to_string(), c.to_string()));
        assert_eq!(got, expected_meta, "{body:?} step {step}");
        if let Ok((_, _, data)) = expected {
            assert_eq!(disk, data);
        }
    }

    #[test]
    fn uploads() {
        let one = "--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"../x.txt\"\r\nContent-Type: text/plain\r\n\r\n0123456789\r\n--b--\r\n";
        for step in [1, 3, 1000] {
            check_upload(one, 10, step, Ok(("x.txt", "text/plain", b"0123456789")));
            check_upload(one, 9, step, Err(UploadError::TooLarge));
        }
        let two = "--b\r\nContent-Disposition: form-data; name=\"meta\"\r\n\r\nignored\r\n--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nAB\r\n--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nsecond\r\n--b--";
        check_upload(two, 100, 4, Ok(("file", "application/octet-stream", b"AB")));
        let none = "--b\r\nContent-Disposition: form-data; name=\"other\"\r\n\r\nx\r\n--b--";
        check_upload(none, 100, 4, Err(UploadError::Bad("no part named \"file\" in the multipart body".into())));
        let cut = "--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nAB";
        check_upload(cut, 100, 4, Err(UploadError::Bad("multipart body ended before its closing boundary".into())));
        assert!(UploadParse::new(Some("application/json"), 1).is_err());
        assert!(UploadParse::new(None, 1).is_err());
        let mut up = UploadParse::new(Some("multipart/form-data; boundary=b"), 10).expect("ct");
        up.feed(one.as_bytes(), &mut Vec::new()).expect("feed");
        assert_eq!(
            up.finish().expect("done").sha256,
            "84d89877f0d4041efb6bf91a16f0248f2fd573e6af05c19f96bedb9f882f7882",
            "sha256 of 0123456789"
        );
    }

    #[test]
    fn an_oversized_file_followed_by_a_malformed_tail_is_413_however_the_body_is_split() {
        // Regression (found by the multipart fuzz target): fed whole, the parse error after the
        // file hid its size (400); fed in pieces, the size was seen first (413).
        let body = format!("--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\n{}\r\n--bXY", "a".repeat(20));
        for step in [1, 7, body.len()] {
            check_upload(&body, 10, step, Err(UploadError::TooLarge));
        }
        // Within the limit, the malformed tail is what is wrong.
        let bad = Err(UploadError::Bad("malformed multipart body: expected CRLF after a boundary".into()));
        for step in [1, 7, body.len()] {
            check_upload(&body, 100, step, bad.clone());
        }
    }
}
