//! File transfer (SPEC §9): streaming multipart uploads and downloads with the real curl,
//! limits, TTL, bad ids, ranges, and flat memory under a slow downloader.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::pg::TestDb;
use crate::support::*;

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("relay-it-{tag}-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .map(|d| d.flatten().filter_map(|e| e.file_name().to_str().map(String::from)).collect())
            .unwrap_or_default();
        names.sort();
        names
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

fn curl(args: &[&str]) -> (bool, Vec<u8>, String) {
    let out = Command::new("curl").args(["-sS", "--max-time", "60"]).args(args).output().expect("curl runs");
    (out.status.success(), out.stdout, String::from_utf8_lossy(&out.stderr).into_owned())
}

fn upload_with_curl(relay: &Relay, path: &Path, token: &str) -> (u16, serde_json::Value) {
    let (ok, out, err) = curl(&[
        "-v",
        "-w",
        "\n%{http_code}",
        "-H",
        &format!("Authorization: Bearer {token}"),
        "-F",
        &format!("file=@{}", path.display()),
        &format!("http://{}/files", relay.addr),
    ]);
    assert!(ok, "curl upload failed: {err}");
    let text = String::from_utf8_lossy(&out).into_owned();
    let (body, code) = text.rsplit_once('\n').expect("status line");
    let json = serde_json::from_str(body).unwrap_or(serde_json::Value::Null);
    (code.trim().parse().expect("code"), json)
}

/// A relay of `mode` with its files in `blobs` (one node; a cluster node keeps them in its
/// database, and `BLOB_DIR` stays unused).
fn start(mode: Mode, blobs: &TempDir, extra: &[(&str, &str)]) -> Relay {
    restart(mode, None, blobs, extra)
}

/// A relay of `mode` on `blobs` (one node) or on `db` (a cluster node: a fresh database when
/// `None`).
fn restart(mode: Mode, db: Option<Arc<TestDb>>, blobs: &TempDir, extra: &[(&str, &str)]) -> Relay {
    let dir = blobs.path().to_string_lossy().into_owned();
    let mut env = vec![("BLOB_DIR", dir.as_str())];
    env.extend_from_slice(extra);
    match db {
        Some(db) => Mode::start_on(db, &env),
        None => mode.start_with(&env),
    }
}

/// What is kept of uploads once every upload before it was dealt with: a small upload goes
/// after them through the same thread of the store (the disk's, or the database's files thread),
/// which handles its jobs in order. Its own entries are left out.
fn kept_after_another_upload(relay: &Relay, blobs: &TempDir, work: &TempDir) -> Vec<String> {
    let src = work.path().join("barrier.txt");
    std::fs::write(&src, b"after the others").expect("write");
    let (code, meta) = upload_with_curl(relay, &src, API);
    assert_eq!(code, 201, "{meta}");
    let id = meta["file_id"].as_str().expect("file_id").to_string();
    kept(relay.db.as_deref(), blobs).into_iter().filter(|e| !e.contains(&id)).collect()
}

/// What is kept of uploads: `BLOB_DIR`'s entries on one node (a blob and its metadata per
/// file, temp files while uploading); in cluster mode (`db`) the rows of `relay_files` and
/// `relay_file_chunks`.
fn kept(db: Option<&TestDb>, blobs: &TempDir) -> Vec<String> {
    match db {
        None => blobs.names(),
        Some(db) => db.query(
            "SELECT 'file ' || file_id FROM relay_files \
             UNION ALL SELECT 'chunk ' || file_id || ' ' || n FROM relay_file_chunks ORDER BY 1",
        ),
    }
}

#[test]
fn curl_round_trip_of_a_multi_mib_file_is_byte_identical() {
    for_each_mode(|mode| {
        let blobs = TempDir::new("blobs");
        let relay = start(mode, &blobs, &[]);
        let work = TempDir::new("work");
        let data = pseudo_random(5 * 1024 * 1024 + 123, 7);
        let src = work.path().join("report 2026.bin");
        std::fs::write(&src, &data).expect("write source");

        let (code, meta) = upload_with_curl(&relay, &src, API);
        assert_eq!(code, 201, "{meta}");
        assert_eq!(meta["size"], data.len() as u64);
        assert_eq!(meta["sha256"], sha256_hex(&data));
        assert_eq!(meta["filename"], "report 2026.bin");
        assert_eq!(meta["content_type"], "application/octet-stream");
        assert!(meta["expires_at"].as_str().is_some_and(|s| s.ends_with('Z')));
        let id = meta["file_id"].as_str().expect("file_id").to_string();

        // Download with the worker token, as a worker would, keeping the server's file name.
        let out_dir = TempDir::new("out");
        let (ok, _, err) = curl(&[
            "-OJ",
            "--output-dir",
            &out_dir.path().to_string_lossy(),
            "-H",
            &format!("Authorization: Bearer {WRK}"),
            &format!("http://{}/files/{id}", relay.addr),
        ]);
        assert!(ok, "curl download failed: {err}");
        let got = std::fs::read(out_dir.path().join("report 2026.bin")).expect("downloaded under its name");
        assert!(got == data, "downloaded bytes differ ({} vs {} bytes)", got.len(), data.len());
    });
}

#[test]
fn a_file_of_exactly_max_file_size_is_kept_and_one_byte_more_is_413_leaving_nothing() {
    for_each_mode(|mode| {
        let blobs = TempDir::new("limit");
        let relay = start(mode, &blobs, &[("MAX_FILE_SIZE", "100000")]);
        let work = TempDir::new("work");
        let exact = work.path().join("exact.bin");
        std::fs::write(&exact, pseudo_random(100_000, 1)).expect("write");
        let (code, meta) = upload_with_curl(&relay, &exact, API);
        assert_eq!((code, meta["size"].as_u64()), (201, Some(100_000)));

        let before = kept(relay.db.as_deref(), &blobs);
        let over = work.path().join("over.bin");
        std::fs::write(&over, pseudo_random(100_001, 2)).expect("write");
        let (code, body) = upload_with_curl(&relay, &over, API);
        assert_eq!(code, 413, "{body}");
        assert_eq!(body["error"], "payload_too_large");
        // A much larger declared body is refused from its head alone.
        let big = work.path().join("big.bin");
        std::fs::write(&big, pseudo_random(400_000, 3)).expect("write");
        assert_eq!(upload_with_curl(&relay, &big, API).0, 413);
        let after = kept_after_another_upload(&relay, &blobs, &work);
        assert_eq!(after, before, "the refused uploads left files behind");
    });
}

#[test]
fn expired_files_are_removed_and_old_runs_are_cleaned_at_start() {
    // In cluster mode "an earlier run" is a node before this one on the same database.
    for_each_mode(|mode| {
        let blobs = TempDir::new("ttl");
        let work = TempDir::new("work");
        let src = work.path().join("t.txt");
        std::fs::write(&src, b"short-lived").expect("write");
        let (expires_at, db) = {
            let relay = start(mode, &blobs, &[("BLOB_TTL", "1s")]);
            let (code, meta) = upload_with_curl(&relay, &src, API);
            assert_eq!(code, 201);
            let id = meta["file_id"].as_str().expect("id").to_string();
            assert_eq!(relay.api("GET", &format!("/files/{id}"), None).status, 200);
            assert!(
                poll_until(Duration::from_secs(4), || relay.api("GET", &format!("/files/{id}"), None).status == 404)
            );
            let gone = poll_until(Duration::from_secs(3), || kept(relay.db.as_deref(), &blobs).is_empty());
            assert!(gone, "{:?}", kept(relay.db.as_deref(), &blobs));

            // One more, then stop before it expires.
            let (code, meta) = upload_with_curl(&relay, &src, API);
            assert_eq!(code, 201);
            let db = relay.db.clone();
            assert_eq!(relay.stop().code(), Some(0));
            let expires_at =
                meta["expires_at"].as_str().map(|t| relay::timefmt::parse_rfc3339_ms(t).expect("RFC 3339"));
            (expires_at.expect("expires_at"), db)
        };
        // One node: its blob and metadata; cluster: its row and its one chunk.
        assert_eq!(kept(db.as_deref(), &blobs).len(), 2, "{:?}", kept(db.as_deref(), &blobs));
        // Wait until the file's expiry time has passed on the wall clock.
        assert!(poll_until(Duration::from_secs(5), || relay::timefmt::wall_ms() > expires_at));
        let relay = restart(mode, db.clone(), &blobs, &[("BLOB_TTL", "1s")]);
        assert!(
            poll_until(Duration::from_secs(3), || kept(db.as_deref(), &blobs).is_empty()),
            "left by the earlier run: {:?}",
            kept(db.as_deref(), &blobs)
        );

        // A file within its TTL survives a restart.
        let keep = {
            let relay2 = restart(mode, db.clone(), &blobs, &[("BLOB_TTL", "1h")]);
            let (code, meta) = upload_with_curl(&relay2, &src, API);
            assert_eq!(code, 201);
            relay2.stop();
            meta["file_id"].as_str().expect("id").to_string()
        };
        drop(relay);
        let relay = restart(mode, db, &blobs, &[]);
        let r = relay.api("GET", &format!("/files/{keep}"), None);
        assert_eq!((r.status, r.body.as_slice()), (200, b"short-lived".as_slice()));
    });
}

#[test]
fn bad_and_unknown_ids_are_404() {
    for_each_mode(|mode| {
        let blobs = TempDir::new("ids");
        let relay = start(mode, &blobs, &[]);
        for path in [
            "/files/../etc/passwd",
            "/files/..%2F..%2Fetc%2Fpasswd",
            "/files/%2e%2e",
            "/files/not-a-uuid",
            "/files/7c0e1b52-9a52-4c2e-8a8e-3f0a4a6b9d10",
            "/files/7c0e1b52-9a52-4c2e-8a8e-3f0a4a6b9d10.json",
        ] {
            let r = relay.api("GET", path, None);
            assert_eq!(r.status, 404, "{path}: {}", r.text());
        }
        let r = request(relay.addr, "GET", "/files/7c0e1b52-9a52-4c2e-8a8e-3f0a4a6b9d10", &[], None);
        assert_eq!(r.status, 401, "no token");
    });
}

#[test]
fn head_range_and_names_are_served() {
    for_each_mode(|mode| {
        let blobs = TempDir::new("range");
        let relay = start(mode, &blobs, &[]);
        let work = TempDir::new("work");
        let src = work.path().join("данные €.txt");
        std::fs::write(&src, b"0123456789abcdef").expect("write");
        let (code, meta) = upload_with_curl(&relay, &src, WRK);
        assert_eq!(code, 201, "the worker token may upload: {meta}");
        let id = meta["file_id"].as_str().expect("id").to_string();
        let auth = format!("Bearer {API}");
        let path = format!("/files/{id}");

        let r = request(relay.addr, "GET", &path, &[("Authorization", &auth)], None);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("Content-Length"), Some("16"));
        let cd = r.header("Content-Disposition").expect("disposition");
        assert!(cd.starts_with("attachment; filename=\"") && cd.contains("filename*=UTF-8''"), "{cd}");
        assert!(cd.contains("%E2%82%AC.txt"), "{cd}");

        let mut c = Client::connect(relay.addr);
        c.send("HEAD", &path, &[("Authorization", &auth)], None);
        let h = c.read_response_to(true).expect("head");
        assert_eq!((h.status, h.header("Content-Length")), (200, Some("16")));
        assert!(h.body.is_empty());
        // The connection is still in step after a HEAD.
        assert_eq!(c.call("GET", "/healthz", &[], None).status, 200);

        let r = request(relay.addr, "GET", &path, &[("Authorization", &auth), ("Range", "bytes=10-")], None);
        assert_eq!((r.status, r.body.as_slice()), (206, b"abcdef".as_slice()));
        assert_eq!(r.header("Content-Range"), Some("bytes 10-15/16"));
        let r = request(relay.addr, "GET", &path, &[("Authorization", &auth), ("Range", "bytes=-3")], None);
        assert_eq!((r.status, r.body.as_slice()), (206, b"def".as_slice()));
        let r = request(relay.addr, "GET", &path, &[("Authorization", &auth), ("Range", "bytes=99-")], None);
        assert_eq!((r.status, r.header("Content-Range")), (416, Some("bytes */16")));
    });
}

#[test]
fn uploads_need_multipart_with_a_file_part() {
    for_each_mode(|mode| {
        let blobs = TempDir::new("multipart");
        let relay = start(mode, &blobs, &[]);
        let auth = format!("Bearer {API}");
        let r = request(
            relay.addr,
            "POST",
            "/files",
            &[("Authorization", &auth), ("Content-Type", "text/plain")],
            Some(b"x"),
        );
        assert_eq!(r.status, 400);
        let body = b"--b\r\nContent-Disposition: form-data; name=\"other\"\r\n\r\nx\r\n--b--\r\n";
        let ct = ("Content-Type", "multipart/form-data; boundary=b");
        let r = request(relay.addr, "POST", "/files", &[("Authorization", &auth), ct], Some(body));
        assert_eq!(r.status, 400);
        assert!(r.json()["message"].as_str().is_some_and(|m| m.contains("file")));
        let r = request(relay.addr, "POST", "/files", &[ct], Some(body));
        assert_eq!(r.status, 401);
        // A chunked multipart upload, with other fields around the file, works too.
        let mut c = Client::connect(relay.addr);
        let payload = b"--b\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nhi\r\n--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"c.txt\"\r\nContent-Type: text/plain\r\n\r\nchunked!\r\n--b--\r\n";
        let mut raw = format!("POST /files HTTP/1.1\r\nHost: relay\r\nAuthorization: {auth}\r\nContent-Type: multipart/form-data; boundary=b\r\nTransfer-Encoding: chunked\r\n\r\n").into_bytes();
        for piece in payload.chunks(7) {
            raw.extend(format!("{:x}\r\n", piece.len()).bytes());
            raw.extend_from_slice(piece);
            raw.extend_from_slice(b"\r\n");
        }
        raw.extend_from_slice(b"0\r\n\r\n");
        c.send_raw(&raw);
        let r = c.read_response().expect("response");
        assert_eq!(r.status, 201, "{}", r.text());
        assert_eq!(r.json()["content_type"], "text/plain");
        let id = r.json()["file_id"].as_str().expect("id").to_string();
        let got = c.call("GET", &format!("/files/{id}"), &[("Authorization", &auth)], None);
        assert_eq!((got.body.as_slice(), got.header("Content-Type")), (b"chunked!".as_slice(), Some("text/plain")));
    });
}

/// Reads from `s` until `buf` holds a complete response head; returns (status, headers, head
/// length). Every read has the socket's timeout.
fn read_head(s: &mut TcpStream, buf: &mut Vec<u8>) -> (u16, Vec<(String, String)>, usize) {
    let mut chunk = [0u8; 4096];
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        if let Ok(httparse::Status::Complete(n)) = resp.parse(buf) {
            let hs = resp
                .headers
                .iter()
                .map(|h| (h.name.to_string(), String::from_utf8_lossy(h.value).into_owned()))
                .collect();
            return (resp.code.unwrap_or(0), hs, n);
        }
        let n = s.read(&mut chunk).expect("response head within the read timeout");
        assert!(n > 0, "EOF before a response head");
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[test]
fn uploads_and_slow_downloads_keep_memory_flat_and_others_are_served() {
    for_each_mode(|mode| {
        let blobs = TempDir::new("slow");
        let relay = start(mode, &blobs, &[("IDLE_TIMEOUT", "30s")]);
        let work = TempDir::new("work");
        let size = 32 * 1024 * 1024;
        let data = pseudo_random(size, 9);
        let src = work.path().join("big.bin");
        std::fs::write(&src, &data).expect("write");
        // Bound on growth over the idle baseline, for the upload and then the download: relay
        // queues at most 512 KiB of an upload for the disk and ~192 KiB of a download's output.
        let bound_kib = 8 * 1024;
        let (baseline, peak_before) = (rss_kib(relay.pid()), peak_rss_kib(relay.pid()));

        // The upload streams to disk: relay's peak stays near the baseline, not the file's size.
        let (code, meta) = upload_with_curl(&relay, &src, API);
        assert_eq!(code, 201);
        assert_eq!(meta["sha256"], sha256_hex(&data));
        // The high-water mark only rises above its earlier value if this upload raised it.
        let peak = peak_rss_kib(relay.pid());
        let growth = peak.saturating_sub(baseline);
        assert!(
            peak <= peak_before.max(baseline + bound_kib),
            "relay's peak RSS grew by {growth} KiB receiving a {size}-byte upload"
        );
        let id = meta["file_id"].as_str().expect("id").to_string();

        let mut slow = TcpStream::connect(relay.addr).expect("connect");
        slow.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
        slow.write_all(
            format!("GET /files/{id} HTTP/1.1\r\nHost: relay\r\nAuthorization: Bearer {API}\r\n\r\n").as_bytes(),
        )
        .expect("write");
        let mut got = Vec::new();
        let (status, headers, head_len) = read_head(&mut slow, &mut got);
        assert_eq!(status, 200);
        let length = headers.iter().find(|(k, _)| k.eq_ignore_ascii_case("content-length")).map(|(_, v)| v.as_str());
        assert_eq!(length, Some(size.to_string().as_str()));
        got.drain(..head_len);

        // A slow reader: 16 KiB every 50 ms for 3 s, while others keep being served at once.
        let mut chunk = vec![0u8; 16 * 1024];
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(3) {
            let n = slow.read(&mut chunk).expect("the download keeps coming");
            assert!(n > 0, "EOF in the middle of the download");
            got.extend_from_slice(&chunk[..n]);
            let t = Instant::now();
            assert_eq!(request(relay.addr, "GET", "/healthz", &[], None).status, 200);
            assert!(t.elapsed() < Duration::from_secs(1), "others are served while the download stalls");
            std::thread::sleep(Duration::from_millis(50)); // the reader's pace, not a synchronisation
        }
        assert!(got.len() < size / 2, "the reader is slow ({} body bytes read)", got.len());
        let peak = peak_rss_kib(relay.pid());
        let growth = peak.saturating_sub(baseline);
        assert!(
            peak <= peak_before.max(baseline + bound_kib),
            "relay's peak RSS grew by {growth} KiB serving a {size}-byte file to a slow reader"
        );

        // Reading the rest quickly completes the download, byte for byte.
        while got.len() < size {
            let n = slow.read(&mut chunk).expect("the rest of the download");
            assert!(n > 0, "EOF after {} of {size} body bytes", got.len());
            got.extend_from_slice(&chunk[..n]);
        }
        assert_eq!(got.len(), size, "more bytes than Content-Length");
        assert!(got == data, "the downloaded bytes differ from the upload");
        // The connection is still in step: the next request on it is answered.
        slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").expect("write");
        let mut next = Vec::new();
        assert_eq!(read_head(&mut slow, &mut next).0, 200);
    });
}

/// Found by schemathesis: a complete body whose part never ends its headers made the upload
/// wait for bytes that could not come, and the client got 408 after HEADER_TIMEOUT.
#[test]
fn a_complete_upload_body_with_an_unfinished_multipart_is_400_at_once_not_408() {
    for_each_mode(|mode| {
        let blobs = TempDir::new("unfinished");
        let relay = start(mode, &blobs, &[("HEADER_TIMEOUT", "10s")]);
        let auth = format!("Bearer {API}");
        let ct = ("Content-Type", "multipart/form-data; boundary=b");
        for body in
            [&b"--b\r\n54492723313104969007104--b--\r\n"[..], b"--b\r\nContent-Disposition: form-data; name=\"file\""]
        {
            let started = Instant::now();
            let r = request(relay.addr, "POST", "/files", &[("Authorization", &auth), ct], Some(body));
            assert_eq!(r.status, 400, "{}", r.text());
            assert!(started.elapsed() < Duration::from_secs(5), "answered at once, not at HEADER_TIMEOUT");
        }
        let work = TempDir::new("work");
        assert_eq!(kept_after_another_upload(&relay, &blobs, &work), Vec::<String>::new(), "nothing kept");
    });
}

/// Uploads `data` as `name` with the API token over a plain socket (no curl), returning the id.
fn upload_raw(relay: &Relay, name: &str, data: &[u8]) -> String {
    let mut body = Vec::with_capacity(data.len() + 256);
    body.extend_from_slice(
        format!(
            "--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(data);
    body.extend_from_slice(b"\r\n--b0undary--\r\n");
    let auth = format!("Bearer {API}");
    let r = request(
        relay.addr,
        "POST",
        "/files",
        &[("Authorization", &auth), ("Content-Type", "multipart/form-data; boundary=b0undary")],
        Some(&body),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()["file_id"].as_str().expect("file_id").to_string()
}

/// Issue 19: after SIGTERM a 32 MiB download stopped at ~27 MiB and was cut at
/// SHUTDOWN_TIMEOUT. SPEC §10: it keeps moving at full speed until it ends.
fn a_download_keeps_moving_after_sigterm(mut relay: Relay) {
    let size = 32 * 1024 * 1024;
    let data = pseudo_random(size, 11);
    let id = upload_raw(&relay, "big.bin", &data);
    let mut s = TcpStream::connect(relay.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
    s.write_all(format!("GET /files/{id} HTTP/1.1\r\nHost: relay\r\nAuthorization: Bearer {API}\r\n\r\n").as_bytes())
        .expect("write");
    let mut got = Vec::new();
    let (status, _, head_len) = read_head(&mut s, &mut got);
    assert_eq!(status, 200);
    got.drain(..head_len);
    let mut chunk = vec![0u8; 256 * 1024];
    while got.len() < 4 * 1024 * 1024 {
        let n = s.read(&mut chunk).expect("the download's start");
        assert!(n > 0, "EOF early");
        got.extend_from_slice(&chunk[..n]);
    }
    // As in the Quickstart: a worker is connected (the shutdown closes it) and a wait=true
    // request is held (the shutdown answers it).
    let w = FakeWorker::connect(&relay, None, Auto::Manual);
    relay.wait_clients(1, |_| true);
    let mut held = Client::connect(relay.addr);
    let auth = format!("Bearer {API}");
    held.send("POST", "/tasks?wait=true", &[("Authorization", &auth)], Some(br#"{"payload":{"x":1}}"#));
    let _task = w.expect_task();
    relay.signal("TERM");
    assert!(relay.wait_log("shutting down", Duration::from_secs(5)), "relay never began its shutdown");
    let started = Instant::now();
    while got.len() < size {
        let n = s.read(&mut chunk).unwrap_or_else(|e| panic!("stalled after SIGTERM at {} bytes: {e}", got.len()));
        assert!(n > 0, "cut after SIGTERM at {} of {size} bytes", got.len());
        got.extend_from_slice(&chunk[..n]);
    }
    let took = started.elapsed();
    assert!(got == data, "the downloaded bytes differ");
    assert!(
        took < Duration::from_secs(5),
        "the rest of the download took {took:?} after SIGTERM (SHUTDOWN_TIMEOUT 20s)"
    );
    // The held request's client has its answer and keeps its socket open: relay lingers for
    // its close (2 s), and must do so idle. It spun the loop at full CPU while it lingered —
    // beside the downloads, which then moved 5–8 times slower with 1,000 such clients.
    let pid = relay.pid();
    let (lingering, cpu_before) = (Instant::now(), cpu_secs(pid).expect("relay runs"));
    let mut cpu_used = 0.0;
    while let Some(cpu) = cpu_secs(pid) {
        cpu_used = cpu - cpu_before;
        if lingering.elapsed() > Duration::from_secs(10) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let lingered = lingering.elapsed();
    assert!(
        cpu_used < 0.5,
        "relay used {cpu_used:.2} s of CPU in the {lingered:?} it waited for the held client's close after the download"
    );
    drop(held);
    let status = relay.wait_exit(Duration::from_secs(10)).expect("relay exits once the download is done");
    assert!(status.success(), "{status:?}");
}

#[test]
fn a_download_keeps_moving_at_full_speed_after_sigterm() {
    for_each_mode(|mode| {
        let blobs = TempDir::new("term");
        a_download_keeps_moving_after_sigterm(start(mode, &blobs, &[("SHUTDOWN_TIMEOUT", "20s")]));
    });
}

/// Issue 19 (REDbot, requests, httpx): `If-None-Match` with the file's ETag was answered with
/// the whole file, an `If-Range` naming another version got 206 of the new one, and the 416
/// body said `error`. Every answer also carries a `Date`.
#[test]
fn downloads_honour_if_none_match_and_if_range_and_416_says_range_not_satisfiable() {
    for_each_mode(|mode| {
        let blobs = TempDir::new("validators");
        let relay = start(mode, &blobs, &[]);
        let id = upload_raw(&relay, "v.txt", b"0123456789abcdef");
        let auth = format!("Bearer {API}");
        let path = format!("/files/{id}");
        let get = |extra: &[(&str, &str)]| {
            let mut headers = vec![("Authorization", auth.as_str())];
            headers.extend_from_slice(extra);
            request(relay.addr, "GET", &path, &headers, None)
        };
        let full = get(&[]);
        assert_eq!(full.status, 200);
        let etag = full.header("ETag").expect("an ETag").to_string();
        assert!(full.header("Date").is_some_and(|d| d.ends_with(" GMT")), "{:?}", full.headers);

        let mut c = Client::connect(relay.addr);
        for tag in [etag.clone(), format!("W/{etag}"), format!("\"other\", {etag}"), "*".to_string()] {
            let r = c.call("GET", &path, &[("Authorization", &auth), ("If-None-Match", &tag)], None);
            assert_eq!((r.status, r.body.len()), (304, 0), "If-None-Match: {tag}");
            assert_eq!(r.header("ETag"), Some(etag.as_str()));
            assert!(r.header("Content-Length").is_none(), "a 304 carries no Content-Length: {:?}", r.headers);
            assert!(r.header("Date").is_some());
        }
        // The keep-alive connection is still in step after the 304s.
        assert_eq!(c.call("GET", "/healthz", &[], None).status, 200);
        assert_eq!(get(&[("If-None-Match", "\"other\"")]).status, 200);

        let r = get(&[("Range", "bytes=10-"), ("If-Range", &etag)]);
        assert_eq!((r.status, r.body.as_slice()), (206, b"abcdef".as_slice()));
        for other in ["\"other\"", "W/\"x\"", "Sun, 06 Nov 1994 08:49:37 GMT"] {
            let r = get(&[("Range", "bytes=10-"), ("If-Range", other)]);
            assert_eq!((r.status, r.body.as_slice()), (200, b"0123456789abcdef".as_slice()), "If-Range: {other}");
            assert!(r.header("Content-Range").is_none());
        }

        let r = get(&[("Range", "bytes=99-")]);
        assert_eq!((r.status, r.header("Content-Range")), (416, Some("bytes */16")));
        assert_eq!(r.json()["error"], "range_not_satisfiable", "{}", r.text());
        assert!(r.json()["message"].is_string());
    });
}
