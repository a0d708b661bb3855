//! The built-in `file` kind (SPEC §8, §9): spec `{file_id}`. Downloads `GET /files/{id}` from
//! relay with the worker token, and streams the bytes straight back as a new upload
//! (`POST /files`, multipart field `file`) while counting them and hashing them with SHA-256.
//! Result: `{result_file_id, size, sha256}`. Nothing is held in memory beyond one buffer: the
//! download is the upload's body. relay's HTTP base comes from RELAY_URL (`ws` → `http`,
//! `wss` → `https`, `/ws` → `/files`). `HTTP_TIMEOUT` bounds each of the two requests, body
//! included; relay's answer (`size`, `sha256`) is checked against what was sent.

use std::io::{self, Cursor, Read};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::Url;
use reqwest::blocking::{Body, Client};
use reqwest::header::{CONTENT_DISPOSITION, CONTENT_TYPE};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::kinds::describe_error;
use crate::kinds::multipart::Multipart;
use crate::{Config, Error};

pub struct FileKind {
    client: Client,
    base: Url,
    token: String,
    timeout: Duration,
}

#[derive(Deserialize)]
struct Spec {
    file_id: Option<String>,
}

#[derive(Deserialize)]
struct Uploaded {
    file_id: String,
    size: Option<u64>,
    sha256: Option<String>,
}

impl FileKind {
    pub fn new(cfg: &Config, mut tls: rustls::ClientConfig) -> Result<FileKind, Error> {
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let timeout = Duration::from_millis(cfg.http_timeout_ms);
        let client = Client::builder()
            .tls_backend_preconfigured(tls)
            .no_proxy()
            // relay never redirects /files; a redirect would carry the token elsewhere.
            .redirect(reqwest::redirect::Policy::none())
            .timeout(timeout)
            .connect_timeout(timeout)
            .user_agent(crate::runner::VERSION)
            .build()
            .map_err(|e| Error::new(format!("cannot build the HTTP client: {}", describe_error(&e))))?;
        Ok(FileKind { client, base: cfg.http_base(), token: cfg.token.clone(), timeout })
    }

    pub fn run(&self, _task_id: &str, spec: &RawValue) -> Result<Value, Error> {
        let spec: Spec = serde_json::from_str(spec.get())
            .map_err(|e| Error::new(format!("bad file spec (expected {{file_id}}): {e}")))?;
        let file_id = spec.file_id.ok_or("spec.file_id is required")?;
        if file_id.is_empty() || file_id.len() > 64 || !file_id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(Error::new(format!("spec.file_id {file_id:?} is not a file id")));
        }
        let url = self.url(&format!("files/{file_id}"))?;
        let download = self
            .client
            .get(url)
            .bearer_auth(&self.token)
            .timeout(self.timeout)
            .send()
            .map_err(|e| Error::new(format!("download: {}", describe_error(&e))))?;
        if !download.status().is_success() {
            return Err(Error::new(format!("download of file {file_id}: HTTP {}", download.status())));
        }
        let header = |name| download.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
        let content_type = header(CONTENT_TYPE).unwrap_or_else(|| "application/octet-stream".into());
        // Content-Disposition as UTF-8, not `to_str` (visible ASCII only): some servers send a
        // raw UTF-8 `filename`; relay itself sends ASCII with `filename*`.
        let disposition =
            download.headers().get(CONTENT_DISPOSITION).and_then(|v| std::str::from_utf8(v.as_bytes()).ok());
        let filename = disposition.and_then(filename_of).unwrap_or_else(|| file_id.clone());
        let length = download.content_length();

        let form = Multipart::new(&uuid::Uuid::new_v4().simple().to_string(), "file", &filename, &content_type);
        let digest = Arc::new(Mutex::new(None));
        let hashing = Hashing { inner: download, hasher: Sha256::new(), size: 0, out: digest.clone() };
        let head = form.head();
        let tail = form.tail();
        let total = length.map(|n| head.len() as u64 + n + tail.len() as u64);
        let reader = Cursor::new(head).chain(hashing).chain(Cursor::new(tail));
        let body = match total {
            Some(n) => Body::sized(reader, n),
            None => Body::new(reader),
        };
        let upload = self
            .client
            .post(self.url("files")?)
            .bearer_auth(&self.token)
            .header(CONTENT_TYPE, form.content_type())
            .body(body)
            .timeout(self.timeout)
            .send()
            .map_err(|e| Error::new(format!("upload: {}", describe_error(&e))))?;
        let status = upload.status();
        let answer = upload.text().map_err(|e| Error::new(format!("upload answer: {}", describe_error(&e))))?;
        if !status.is_success() {
            return Err(Error::new(format!("upload: HTTP {status}: {}", answer.chars().take(200).collect::<String>())));
        }
        let uploaded: Uploaded =
            serde_json::from_str(&answer).map_err(|e| Error::new(format!("upload answer is not a file: {e}")))?;
        let taken = digest.lock().map(|mut d| d.take()).unwrap_or(None);
        let (size, sha256) = taken.ok_or("the upload finished before the download did")?;
        // relay's digest is compared when it is the hex form SPEC §9 implies (any case).
        let their_sha =
            uploaded.sha256.as_deref().filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()));
        if uploaded.size.is_some_and(|s| s != size) || their_sha.is_some_and(|h| !h.eq_ignore_ascii_case(&sha256)) {
            return Err(Error::new(format!(
                "relay stored something else: sent {size} bytes sha256 {sha256}, relay has {:?} bytes sha256 {:?}",
                uploaded.size, uploaded.sha256
            )));
        }
        Ok(json!({"result_file_id": uploaded.file_id, "size": size, "sha256": sha256}))
    }

    fn url(&self, path: &str) -> Result<Url, Error> {
        self.base.join(path).map_err(|e| Error::new(format!("relay URL: {e}")))
    }
}

/// Passes bytes through, counting and hashing them; at EOF stores `(size, hex sha256)`.
struct Hashing<R> {
    inner: R,
    hasher: Sha256,
    size: u64,
    out: Arc<Mutex<Option<(u64, String)>>>,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 {
            let hex = hex(&self.hasher.clone().finalize());
            if let Ok(mut out) = self.out.lock() {
                *out = Some((self.size, hex));
            }
        } else {
            self.hasher.update(&buf[..n]);
            self.size += n as u64;
        }
        Ok(n)
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The file name a `Content-Disposition` value carries (RFC 6266), if any: `filename*` (RFC 8187
/// ext-value, UTF-8 or ISO-8859-1, percent-decoded) when present and well-formed, else
/// `filename` (a token or a quoted string with backslash escapes). relay sends both for a
/// non-ASCII name: `attachment; filename="r_sum_.pdf"; filename*=UTF-8''r%C3%A9sum%C3%A9.pdf`.
#[doc(hidden)]
pub fn filename_of(disposition: &str) -> Option<String> {
    let mut plain = None;
    let mut extended = None;
    for (key, value) in disposition_params(disposition) {
        if key.eq_ignore_ascii_case("filename") {
            plain.get_or_insert(value);
        } else if key.eq_ignore_ascii_case("filename*") {
            extended.get_or_insert(value);
        }
    }
    let extended = extended.as_deref().and_then(decode_ext_value).filter(|name| !name.is_empty());
    extended.or(plain.filter(|name| !name.is_empty()))
}

/// The `key=value` parameters of a header value, in order. A value is a quoted string (backslash
/// escapes honoured, so `;` and `\"` may appear inside; an unterminated one runs to the end) or
/// a bare token up to the next `;` (surrounding whitespace trimmed). An item without `=` — the
/// disposition type itself — is skipped.
fn disposition_params(value: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut chars = value.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace() || *c == ';').is_some() {}
        if chars.peek().is_none() {
            return out;
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && *c != ';') {
            key.push(c);
        }
        if chars.next_if_eq(&'=').is_none() {
            continue; // `;` or the end: a parameter without a value
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut val = String::new();
        if chars.next_if_eq(&'"').is_some() {
            while let Some(c) = chars.next() {
                match c {
                    '"' => break,
                    '\\' => val.extend(chars.next()),
                    c => val.push(c),
                }
            }
            // Anything between the closing quote and the next `;` is not part of the value.
            while chars.next_if(|c| *c != ';').is_some() {}
        } else {
            while let Some(c) = chars.next_if(|c| *c != ';') {
                val.push(c);
            }
            val.truncate(val.trim_end().len());
        }
        let key = key.trim();
        if !key.is_empty() {
            out.push((key.to_string(), val));
        }
    }
}

/// An RFC 8187 ext-value `charset'[language]'pct-encoded` → text; `None` when malformed (a `%`
/// not followed by two hex digits, bytes that are not UTF-8) or in another charset.
fn decode_ext_value(value: &str) -> Option<String> {
    let mut parts = value.splitn(3, '\'');
    let (charset, _language, encoded) = (parts.next()?, parts.next()?, parts.next()?);
    let mut bytes = Vec::with_capacity(encoded.len());
    let mut input = encoded.bytes();
    while let Some(b) = input.next() {
        if b == b'%' {
            let hi = input.next().and_then(|h| (h as char).to_digit(16))?;
            let lo = input.next().and_then(|l| (l as char).to_digit(16))?;
            bytes.push(u8::try_from(hi * 16 + lo).ok()?);
        } else {
            bytes.push(b);
        }
    }
    if charset.eq_ignore_ascii_case("UTF-8") {
        String::from_utf8(bytes).ok()
    } else if charset.eq_ignore_ascii_case("ISO-8859-1") {
        Some(bytes.into_iter().map(char::from).collect())
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashing_reader_counts_and_hashes() {
        let out = Arc::new(Mutex::new(None));
        let mut r = Hashing { inner: Cursor::new(b"abc".to_vec()), hasher: Sha256::new(), size: 0, out: out.clone() };
        let mut sink = Vec::new();
        r.read_to_end(&mut sink).expect("read");
        assert_eq!(sink, b"abc");
        let got = out.lock().expect("lock").clone();
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(got, Some((3, abc.to_string())));
    }

    #[test]
    fn filenames() {
        for (value, expected) in [
            // plain: quoted, bare, spacing and case
            (r#"attachment; filename="report.pdf""#, Some("report.pdf")),
            ("attachment; filename=data.csv", Some("data.csv")),
            ("attachment; filename=data.csv ; size=3", Some("data.csv")),
            ("attachment; FILENAME = \"a b.txt\"", Some("a b.txt")),
            ("attachment;filename=\"x\";", Some("x")),
            // `;` and `=` inside a quoted value
            (r#"attachment; filename="notes; v2.txt""#, Some("notes; v2.txt")),
            (r#"attachment; filename="a=b;c=d.txt"; size=4"#, Some("a=b;c=d.txt")),
            (r#"attachment; name="x;filename=evil"; filename="good.txt""#, Some("good.txt")),
            // escaped quotes and backslashes
            (r#"attachment; filename="say \"hi\".txt""#, Some(r#"say "hi".txt"#)),
            (r#"attachment; filename="a\\b\;c.txt""#, Some(r"a\b;c.txt")),
            (r#"attachment; filename="unterminated \"; x"#, Some(r#"unterminated "; x"#)),
            // filename* with UTF-8 (relay's form for non-ASCII names)
            ("attachment; filename*=UTF-8''r%C3%A9sum%C3%A9.pdf", Some("résumé.pdf")),
            ("attachment; filename*=utf-8'fr'%E2%82%AC%20rate%3B%22q%22.txt", Some("€ rate;\"q\".txt")),
            ("attachment; filename*=ISO-8859-1''caf%E9.txt", Some("café.txt")),
            // both present: filename* wins, whichever comes first
            (r#"attachment; filename="r_sum_.pdf"; filename*=UTF-8''r%C3%A9sum%C3%A9.pdf"#, Some("résumé.pdf")),
            (r#"attachment; filename*=UTF-8''%E6%97%A5.txt; filename="_.txt""#, Some("日.txt")),
            (r#"attachment; filename="_; x.csv"; filename*=UTF-8''%D1%8F%3B%20x.csv"#, Some("я; x.csv")),
            // malformed filename* → filename
            (r#"attachment; filename="fallback.pdf"; filename*=UTF-8''r%C3%A9sum%C3.pdf"#, Some("fallback.pdf")),
            (r#"attachment; filename="fallback.pdf"; filename*=UTF-8''100%"#, Some("fallback.pdf")),
            (r#"attachment; filename="fallback.pdf"; filename*=UTF-8''%zz.pdf"#, Some("fallback.pdf")),
            (r#"attachment; filename="fallback.pdf"; filename*=UTF-8''%FF.pdf"#, Some("fallback.pdf")),
            (r#"attachment; filename="fallback.pdf"; filename*=no-quotes.pdf"#, Some("fallback.pdf")),
            (r#"attachment; filename="fallback.pdf"; filename*=KOI8-R''%C1.pdf"#, Some("fallback.pdf")),
            (r#"attachment; filename="fallback.pdf"; filename*=UTF-8''"#, Some("fallback.pdf")),
            ("attachment; filename*=UTF-8''%E2%82", None),
            // nothing usable
            ("attachment", None),
            ("", None),
            (r#"attachment; filename="""#, None),
            ("attachment; filename", None),
            ("attachment; filename=", None),
            (r#"inline; name="file""#, None),
            // no disposition type at all
            (r#"filename="a;b.txt""#, Some("a;b.txt")),
        ] {
            assert_eq!(filename_of(value).as_deref(), expected, "{value}");
        }
    }
}
