//! The file kind against relay's `/files` (SPEC §9), and against a stand-in for what the real
//! relay cannot be made to do.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::{API, Relay, Worker, header, http_bytes, http_full};

/// Uploads `data` as `filename` / `content_type` with the API token; the upload answer.
fn upload(addr: SocketAddr, filename: &str, content_type: &str, data: &[u8]) -> Value {
    let boundary = "test-boundary-1234";
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n\
         Content-Type: {content_type}\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(data);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let auth = format!("Bearer {API}");
    let content_type = format!("multipart/form-data; boundary={boundary}");
    let (status, answer) =
        http_bytes(addr, "POST", "/files", &[("Authorization", &auth), ("Content-Type", &content_type)], Some(&body));
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&answer));
    serde_json::from_slice(&answer).expect("upload JSON")
}

/// `GET /files/{id}` with the API token: (Content-Type, Content-Disposition, bytes).
fn download(addr: SocketAddr, id: &str) -> (String, String, Vec<u8>) {
    let auth = format!("Bearer {API}");
    let (status, headers, bytes) = http_full(addr, "GET", &format!("/files/{id}"), &[("Authorization", &auth)], None);
    assert_eq!(status, 200, "GET /files/{id}");
    let get = |name| header(&headers, name).unwrap_or_else(|| panic!("{name} in {headers:?}")).to_string();
    (get("Content-Type"), get("Content-Disposition"), bytes)
}

#[test]
fn file_task_downloads_hashes_and_uploads_back() {
    crate::require_relay!();
    let relay = Relay::start();
    let worker = Worker::start(&relay.ws_url(), &[]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |_| true);

    // 300 KiB of non-UTF-8 bytes, uploaded with the API token.
    let data: Vec<u8> = (0..300 * 1024u32).map(|i| (i * 7 % 251) as u8).collect();
    let uploaded = upload(relay.addr, "in.bin", "application/octet-stream", &data);
    let file_id = uploaded["file_id"].as_str().expect("file_id");

    let task = relay.run_task(json!({"kind": "file", "spec": {"file_id": file_id}}));
    assert_eq!(task["status"], "done", "{task}");
    let result = &task["result"];
    assert_eq!(result["size"], data.len(), "{result}");
    assert_eq!(result["sha256"], uploaded["sha256"], "{result}");
    let result_id = result["result_file_id"].as_str().expect("result_file_id");
    assert_ne!(result_id, file_id);

    let (content_type, disposition, bytes) = download(relay.addr, result_id);
    assert!(bytes == data, "the uploaded result has the same bytes");
    assert_eq!(content_type, "application/octet-stream");
    assert_eq!(disposition, r#"attachment; filename="in.bin""#);

    let task = relay.run_task(json!({"kind": "file", "spec": {"file_id": "00000000-0000-0000-0000-000000000000"}}));
    assert_eq!(task["status"], "failed", "{task}");
    assert!(task["error"].as_str().is_some_and(|e| e.contains("404")), "{task}");
}

/// The result file keeps the source's name and content type: a non-ASCII name (relay sends an
/// ASCII fallback in `filename` and the real name in `filename*=UTF-8''...`) and names with a
/// `;` inside the quoted value.
#[test]
fn file_task_keeps_non_ascii_and_quoted_names() {
    crate::require_relay!();
    let relay = Relay::start();
    let worker = Worker::start(&relay.ws_url(), &[]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |_| true);

    for (name, content_type, expected_disposition) in [
        (
            "résumé.pdf",
            "application/pdf",
            r#"attachment; filename="r_sum_.pdf"; filename*=UTF-8''r%C3%A9sum%C3%A9.pdf"#,
        ),
        ("notes; v2.txt", "text/plain; charset=utf-8", r#"attachment; filename="notes; v2.txt""#),
        (
            "отчёт; 2026 – 日本.csv",
            "text/csv",
            "attachment; filename=\"_____; 2026 _ __.csv\"; \
             filename*=UTF-8''%D0%BE%D1%82%D1%87%D1%91%D1%82%3B%202026%20%E2%80%93%20%E6%97%A5%E6%9C%AC.csv",
        ),
    ] {
        let data = format!("contents of {name}\n").into_bytes();
        let uploaded = upload(relay.addr, name, content_type, &data);
        assert_eq!(uploaded["filename"], name, "{uploaded}");
        let file_id = uploaded["file_id"].as_str().expect("file_id");
        let (_, source_disposition, _) = download(relay.addr, file_id);
        assert_eq!(source_disposition, expected_disposition, "what relay sends for {name:?}");

        let task = relay.run_task(json!({"kind": "file", "spec": {"file_id": file_id}}));
        assert_eq!(task["status"], "done", "{task}");
        let result_id = task["result"]["result_file_id"].as_str().expect("result_file_id");
        let (result_type, result_disposition, bytes) = download(relay.addr, result_id);
        assert_eq!(bytes, data, "{name:?}");
        assert_eq!(result_type, content_type, "{name:?}");
        assert_eq!(result_disposition, expected_disposition, "the result file of {name:?} keeps its name");
    }
}

/// Against a stand-in that speaks SPEC §9 and checks the upload byte for byte: the download is streamed into a multipart upload with the worker token, and the result
/// carries relay's new file id with the size and SHA-256 of the bytes.
#[test]
fn file_kind_streams_the_download_into_a_multipart_upload() {
    use crate::support::WRK;
    use crate::support::target::{Reply, Target};
    use relay_worker::kinds::file::FileKind;
    use sha2::{Digest, Sha256};

    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
    let expected_sha = relay_worker::kinds::file::hex(&Sha256::digest(&data));
    let served = data.clone();
    let stand_in = Target::start(move |req, _| {
        if req.header("authorization") != Some(&format!("Bearer {WRK}")) {
            return Reply::new(401, &[], "");
        }
        match (req.method.as_str(), req.path.as_str()) {
            ("GET", "/files/f-1") => Reply::new(
                200,
                &[("Content-Type", "application/x-thing"), ("Content-Disposition", "attachment; filename=\"in.bin\"")],
                served.clone(),
            ),
            ("POST", "/files") => {
                let Some(ct) = req.header("content-type") else { return Reply::new(400, &[], "") };
                let Some(boundary) = ct.split("boundary=").nth(1) else { return Reply::new(400, &[], "") };
                let body = &req.body;
                let head_end = body.windows(4).position(|w| w == b"\r\n\r\n").map_or(0, |i| i + 4);
                let head = String::from_utf8_lossy(&body[..head_end]).into_owned();
                let closing = format!("\r\n--{boundary}--\r\n");
                if !head.starts_with(&format!("--{boundary}\r\n"))
                    || !head.contains("name=\"file\"; filename=\"in.bin\"")
                    || !head.contains("Content-Type: application/x-thing")
                    || !body.ends_with(closing.as_bytes())
                {
                    return Reply::new(400, &[], head);
                }
                let file = &body[head_end..body.len() - closing.len()];
                let sha = relay_worker::kinds::file::hex(&Sha256::digest(file));
                Reply::json(201, &json!({"file_id": "f-2", "filename": "in.bin", "size": file.len(), "sha256": sha}))
            }
            _ => Reply::new(404, &[], ""),
        }
    });
    let config = relay_worker::Config::new(&format!("ws://{}/ws", stand_in.addr), WRK).expect("config");
    let tls =
        rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("tls")
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
    let kind = FileKind::new(&config, tls).expect("file kind");
    let spec = serde_json::value::RawValue::from_string(r#"{"file_id":"f-1"}"#.into()).expect("raw");
    let result = kind.run("t-1", &spec).expect("file task done");
    assert_eq!(result, json!({"result_file_id": "f-2", "size": data.len(), "sha256": expected_sha}));
    let hits = stand_in.hits.lock().expect("hits").clone();
    let upload = hits.iter().find(|r| r.method == "POST").expect("an upload");
    assert!(upload.header("content-length").is_some(), "a known download length gives a sized upload");

    let spec = serde_json::value::RawValue::from_string(r#"{"file_id":"../etc/passwd"}"#.into()).expect("raw");
    assert!(kind.run("t-2", &spec).is_err_and(|e| e.message().contains("is not a file id")));
    let spec = serde_json::value::RawValue::from_string(r#"{"file_id":"missing"}"#.into()).expect("raw");
    assert!(kind.run("t-3", &spec).is_err_and(|e| e.message().contains("404")), "a missing file fails the task");
}
