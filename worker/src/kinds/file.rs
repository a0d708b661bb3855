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
        let filename = header(CONTENT_DISPOSITION).and_then(|d| filename_of(&d)).unwrap_or_else(|| file_id.clone());
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

/// The `filename` of a `Content-Disposition` value (quoted or bare), if any.
fn filename_of(disposition: &str) -> Option<String> {
    disposition.split(';').map(str::trim).find_map(|param| {
        let (key, value) = param.split_once('=')?;
        if !key.trim().eq_ignore_ascii_case("filename") {
            return None;
        }
        let value = value.trim();
        let value = value.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(value);
        (!value.is_empty()).then(|| value.to_string())
    })
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
            (r#"attachment; filename="report.pdf""#, Some("report.pdf")),
            ("attachment; filename=data.csv", Some("data.csv")),
            ("attachment; FILENAME = \"a b.txt\"", Some("a b.txt")),
            ("attachment", None),
            (r#"attachment; filename="""#, None),
        ] {
            assert_eq!(filename_of(value).as_deref(), expected, "{value}");
        }
    }
}
