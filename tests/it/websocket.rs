//! The worker WebSocket (SPEC §5): handshake, pings and death, limits, frame types.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::*;

#[test]
fn silent_worker_dies_after_pong_wait_and_its_task_moves_on() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("PING_INTERVAL", "100ms"), ("PONG_WAIT", "500ms"), ("TASK_TIMEOUT", "10s")]);
        let frozen = FakeWorker::connect(&relay, None, Auto::Manual);
        relay.wait_clients(1, |_| true);
        let r = relay.submit(r#"{"payload":1}"#);
        let id = r.json()["task_id"].as_str().expect("id").to_string();
        frozen.expect_task();
        // Alive while it answers pings: eight pings, 100 ms apart, span more than PONG_WAIT.
        assert!(poll_until(Duration::from_secs(10), || frozen.pings() >= 8 || frozen.is_closed()));
        assert!(!frozen.is_closed(), "pongs keep it alive");
        assert_eq!(relay.clients()["count"], 1, "pongs keep it alive");
        let good = FakeWorker::connect(&relay, None, Auto::Echo);
        relay.wait_clients(2, |_| true);
        let started = Instant::now();
        frozen.freeze();
        relay.wait_clients(1, |_| true);
        assert!(started.elapsed() >= Duration::from_millis(300), "not before PONG_WAIT");
        let t = relay.wait_status(&id, "done", Duration::from_secs(3));
        assert_eq!(t["attempt_log"][0]["outcome"], "disconnect");
        drop(good);
    });
}

#[test]
fn oversize_binary_and_protocol_errors_close_with_codes() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("MAX_MESSAGE_SIZE", "1024")]);
        let w = FakeWorker::connect(&relay, None, Auto::Manual);
        w.send("x".repeat(2000));
        assert_eq!(w.wait_closed(Duration::from_secs(3)), Some(Some(1009)));

        let w = FakeWorker::connect(&relay, None, Auto::Manual);
        w.send_binary();
        assert_eq!(w.wait_closed(Duration::from_secs(3)), Some(Some(1003)));
        relay.wait_clients(0, |_| true);
    });
}

#[test]
fn malformed_messages_are_ignored_and_the_worker_stays() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let w = FakeWorker::connect(&relay, None, Auto::Echo);
        relay.wait_clients(1, |_| true);
        for bad in [
            "not json",
            "{}",
            r#"{"type":"result"}"#,
            r#"{"type":"result","task_id":"x","status":"done"}"#,
            r#"{"type":"dance"}"#,
            "[]",
        ] {
            w.send(bad.to_string());
        }
        assert!(poll_until(Duration::from_secs(2), || relay.metric("relay_ws_messages_malformed_total") >= 5.0));
        assert_eq!(relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":1}"#)).status, 200);
        assert!(!w.is_closed());
    });
}

#[test]
fn closed_worker_leaves_clients() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let w = FakeWorker::connect(&relay, None, Auto::Echo);
        relay.wait_clients(1, |_| true);
        w.close();
        relay.wait_clients(0, |_| true);
        assert_eq!(relay.metric("relay_workers_connected"), 0.0);
    });
}

/// A masked client text frame (payload < 126 bytes).
fn masked_text(text: &str) -> Vec<u8> {
    let mask = [0x11u8, 0x22, 0x33, 0x44];
    let mut f = vec![0x81, 0x80 | text.len() as u8];
    f.extend_from_slice(&mask);
    f.extend(text.bytes().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

#[test]
fn frames_sent_with_the_upgrade_request_are_not_lost() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let mut s = TcpStream::connect(relay.addr).expect("connect");
        let hello = json!({"type":"hello","kinds":["early"],"concurrency":2}).to_string();
        let mut raw = format!(
            "GET /ws?token={WRK} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        .into_bytes();
        raw.extend(masked_text(&hello));
        s.write_all(&raw).expect("write");
        s.set_read_timeout(Some(Duration::from_secs(3))).expect("timeout");
        let mut buf = [0u8; 256];
        let n = s.read(&mut buf).expect("101");
        let head = String::from_utf8_lossy(&buf[..n]);
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        assert!(head.contains("Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo="), "{head}");
        relay.wait_clients(1, |c| c["kinds"] == json!(["early"]) && c["concurrency"] == 2);
    });
}

#[test]
fn upgrade_needs_the_worker_token_and_the_handshake_headers() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let r =
            request(relay.addr, "GET", "/ws?token=wrong", &[("Upgrade", "websocket"), ("Connection", "Upgrade")], None);
        assert_eq!(r.status, 401);
        let r = request(relay.addr, "GET", &format!("/ws?token={WRK}"), &[], None);
        assert_eq!(r.status, 426, "plain GET with a good token: {}", r.text());
        let r = request(
            relay.addr,
            "GET",
            &format!("/ws?token={WRK}"),
            &[
                ("Upgrade", "websocket"),
                ("Connection", "Upgrade"),
                ("Sec-WebSocket-Version", "13"),
                ("Sec-WebSocket-Key", "short"),
            ],
            None,
        );
        assert_eq!(r.status, 400);
    });
}

#[test]
fn trusted_proxy_headers_set_the_worker_ip() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("TRUSTED_PROXIES", "127.0.0.1")]);
        let mut s = TcpStream::connect(relay.addr).expect("connect");
        let raw = format!(
            "GET /ws?token={WRK} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         X-Forwarded-For: 203.0.113.9, 127.0.0.1\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        );
        s.write_all(raw.as_bytes()).expect("write");
        relay.wait_clients(1, |c| c["ip"] == "203.0.113.9");

        // Without trust the header is ignored.
        let plain = mode.start();
        let mut s2 = TcpStream::connect(plain.addr).expect("connect");
        s2.write_all(raw.as_bytes()).expect("write");
        plain.wait_clients(1, |c| c["ip"] == "127.0.0.1");
        drop((s, s2));
    });
}

#[test]
fn a_worker_that_pings_but_never_reads_cannot_grow_relays_memory() {
    for_each_mode(|mode| {
        // Regression: pongs piled up in relay's output buffer without limit (1 GB in 20 s).
        let relay =
            mode.start_with(&[("MAX_MESSAGE_SIZE", "4096"), ("PING_INTERVAL", "200ms"), ("PONG_WAIT", "1500ms")]);
        let mut s = TcpStream::connect(relay.addr).expect("connect");
        let raw = format!(
            "GET /ws?token={WRK} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        );
        s.write_all(raw.as_bytes()).expect("upgrade");
        relay.wait_clients(1, |_| true);
        let (baseline, peak_before) = (rss_kib(relay.pid()), peak_rss_kib(relay.pid()));
        let mask = [1u8, 2, 3, 4];
        let mut ping = vec![0x89, 0x80 | 125];
        ping.extend_from_slice(&mask);
        ping.extend((0..125).map(|i| b'p' ^ mask[i % 4]));
        let burst: Vec<u8> = ping.iter().copied().cycle().take(ping.len() * 512).collect();
        s.set_write_timeout(Some(Duration::from_millis(200))).expect("timeout");
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(3) {
            if s.write_all(&burst).is_err() {
                // relay stopped reading us (or closed): pace the next burst, keep the pressure on.
                std::thread::sleep(Duration::from_millis(50));
            }
            if relay.clients()["count"] == 0 {
                break;
            }
        }
        // The high-water mark catches any peak, however brief.
        let peak = peak_rss_kib(relay.pid());
        let growth = peak.saturating_sub(baseline);
        assert!(
            peak <= peak_before.max(baseline + 16 * 1024),
            "relay grew by {growth} KiB answering pings nobody read"
        );
        // Not reading relay means not being read either: PONG_WAIT ends it.
        relay.wait_clients(0, |_| true);
    });
}

#[test]
fn trusted_proxy_rules_apply_to_api_clients_and_logs() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("TRUSTED_PROXIES", "127.0.0.0/8, 10.0.0.0/8")]);
        let auth = format!("Bearer {API}");
        // Every hop trusted: the leftmost is the client. A 401 (answered from the head) logs it too.
        let r = request(relay.addr, "GET", "/clients", &[("X-Forwarded-For", "10.1.1.1, 10.2.2.2")], None);
        assert_eq!(r.status, 401);
        assert!(relay.wait_log("status=401 client_ip=10.1.1.1", Duration::from_secs(2)), "{}", relay.log_text());
        // No X-Forwarded-For: X-Real-IP.
        let r =
            request(relay.addr, "GET", "/clients", &[("Authorization", &auth), ("X-Real-IP", "198.51.100.4")], None);
        assert_eq!(r.status, 200);
        assert!(relay.wait_log("status=200 client_ip=198.51.100.4", Duration::from_secs(2)), "{}", relay.log_text());
        // IPv6 end to end, rightmost untrusted hop.
        let r = request(
            relay.addr,
            "GET",
            "/healthz",
            &[("X-Forwarded-For", "2001:db8::1, [2001:db8::2]:443, 10.0.0.9")],
            None,
        );
        assert_eq!(r.status, 200);
        assert!(relay.wait_log("client_ip=2001:db8::2", Duration::from_secs(2)), "{}", relay.log_text());
    });
}
