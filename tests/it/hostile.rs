//! Hostile clients (issue 10): slowloris crowds, the connection limit, clients and workers that
//! never read, ping floods, oversized fragmented WebSocket messages, request smuggling shapes.
//! Each checks that the attacker gets only what it deserves and that everyone else is served.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::*;

/// Raises this process's soft limit on open files to its hard limit (a crowd of sockets).
fn raise_fd_limit(needed: u64) {
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0, "getrlimit");
        if lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        }
        assert!(lim.rlim_cur >= needed, "this test needs {needed} open files; the limit is {}", lim.rlim_cur);
    }
}

/// Raises the flag when dropped: helper threads of a `thread::scope` stop even when the test's
/// own thread panics (the scope would otherwise wait for them forever).
pub struct StopOnDrop<'a>(pub &'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// `n` request latencies of `GET /healthz`, each on a fresh connection.
fn healthz_latencies(addr: SocketAddr, n: usize) -> Vec<Duration> {
    (0..n)
        .map(|_| {
            let t = Instant::now();
            let r = request(addr, "GET", "/healthz", &[], None);
            assert_eq!(r.status, 200);
            t.elapsed()
        })
        .collect()
}

fn p99(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[(samples.len() * 99 / 100).min(samples.len() - 1)]
}

// Single-node only: a latency load test of the reactor's accept and head parsing, where no store is involved; a cluster half beside it on two cores would only make its p99 bound flaky
#[test]
fn a_thousand_slowloris_connections_do_not_slow_normal_clients() {
    raise_fd_limit(4_000);
    let relay = Relay::start_with(&[("HEADER_TIMEOUT", "60s"), ("LOG_LEVEL", "info")]);
    let unloaded = p99(healthz_latencies(relay.addr, 300));

    // 1,000 connections, each with half a head, and a byte more now and then.
    let crowd: Vec<TcpStream> = (0..1_000)
        .map(|_| {
            let mut s = TcpStream::connect(relay.addr).expect("connect");
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: relay\r\nX-Slow: ").expect("partial head");
            s.set_nonblocking(true).expect("nonblocking");
            s
        })
        .collect();
    let stop = AtomicBool::new(false);
    let loaded = std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                for mut c in &crowd {
                    let _ = c.write(b"a");
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        let _stop = StopOnDrop(&stop);
        assert!(
            poll_until(Duration::from_secs(20), || relay.metric("relay_connections_open") >= 1_000.0),
            "the crowd never got in"
        );
        p99(healthz_latencies(relay.addr, 300))
    });
    assert!(relay.metric("relay_connections_open") >= 1_000.0, "the slowloris crowd is still connected");
    eprintln!("GET /healthz p99: {unloaded:?} alone, {loaded:?} beside 1,000 slowloris connections");
    // Twice the unloaded p99, with a floor for scheduler noise on a shared 2-core machine.
    let bound = unloaded.max(Duration::from_millis(20)) * 2;
    assert!(loaded <= bound, "p99 {loaded:?} beside the crowd, {unloaded:?} alone (bound {bound:?})");
    drop(crowd);
}

#[test]
fn the_connection_limit_is_reached_and_recovered() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("MAX_CONNECTIONS", "40"), ("LOG_LEVEL", "info")]);
        let mut held: Vec<Client> = (0..40).map(|_| Client::connect(relay.addr)).collect();
        // The 40 are in once each has been answered.
        for c in &mut held {
            assert_eq!(c.call("GET", "/healthz", &[], None).status, 200);
        }
        // Beyond the limit: accepted and closed at once (not left in the kernel's queue).
        for _ in 0..20 {
            let mut extra = Client::connect(relay.addr);
            let started = Instant::now();
            extra.send_raw(&crate::support::http::build("GET", "/healthz", &[], None));
            assert!(extra.read_response().is_none(), "a connection past MAX_CONNECTIONS was served");
            assert!(started.elapsed() < Duration::from_secs(2), "refused late: {:?}", started.elapsed());
        }
        // The held connections still work.
        for c in &mut held {
            assert_eq!(c.call("GET", "/healthz", &[], None).status, 200);
        }
        // Some leave: new clients get in again.
        held.truncate(30);
        assert!(
            poll_until(Duration::from_secs(5), || {
                let mut c = Client::connect(relay.addr);
                c.send_raw(&crate::support::http::build("GET", "/healthz", &[], None));
                c.read_response().is_some_and(|r| r.status == 200)
            }),
            "the limit was never recovered"
        );
        let refused = relay.metric("relay_connections_refused_total");
        assert!(refused >= 20.0, "refusals are counted: {refused}");
    });
}

#[test]
fn a_client_that_never_reads_costs_only_itself() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("IDLE_TIMEOUT", "2s")]);
        let stuck = crate::regressions::never_reading_clients(&relay, 5);
        // Everyone else is served at once meanwhile.
        let started = Instant::now();
        for _ in 0..50 {
            assert_eq!(request(relay.addr, "GET", "/healthz", &[], None).status, 200);
        }
        assert!(started.elapsed() < Duration::from_secs(5), "50 requests took {:?}", started.elapsed());
        assert!(
            poll_until(Duration::from_secs(15), || relay.metric("relay_connections_open") == 1.0),
            "clients that never read were never closed"
        );
        drop(stuck);
    });
}

#[test]
fn a_worker_that_never_reads_is_dropped_and_its_tasks_move_on() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[
            ("MAX_MESSAGE_SIZE", "4096"),
            ("PING_INTERVAL", "200ms"),
            ("PONG_WAIT", "1500ms"),
            ("TASK_TIMEOUT", "30s"),
        ]);
        // Says hello, then neither reads nor writes; a good worker beside it.
        let mut deaf = crate::regressions::RawWorker::connect(&relay, &json!({"type":"hello","version":"deaf"}));
        let good = FakeWorker::connect(&relay, Some(json!({"type":"hello","version":"good"})), Auto::Echo);
        relay.wait_clients(2, |c| c["version"] == "deaf" || c["version"] == "good");
        let baseline = rss_kib(relay.pid());
        let body = format!(r#"{{"payload":"{}","queue":true}}"#, "x".repeat(3_000));
        let ids: Vec<String> = (0..2_000)
            .map(|_| {
                let r = relay.submit(&body);
                assert_eq!(r.status, 202, "{}", r.text());
                r.json()["task_id"].as_str().expect("id").to_string()
            })
            .collect();
        let growth = rss_kib(relay.pid()).saturating_sub(baseline);
        // 2,000 payloads of 3 KB are 6 MB in the task table; the worker's output is capped.
        assert!(growth < 32 * 1024, "relay grew by {growth} KiB");
        // PONG_WAIT without a frame from it: dropped, and what it held is retried on the other.
        relay.wait_clients(1, |c| c["version"] == "good");
        let mut moved = 0;
        for id in &ids {
            let t = relay.wait_status(id, "done", Duration::from_secs(30));
            let log = t["attempt_log"].as_array().expect("log");
            assert!(log.len() <= 2, "{t}");
            if log.len() == 2 {
                assert_eq!(log[0]["outcome"], "disconnect", "{t}");
                moved += 1;
            }
        }
        assert!(moved > 0, "no task was ever sent to the deaf worker");
        drop(good);
        let _ = deaf.ws.get_mut().shutdown(std::net::Shutdown::Both);
    });
}

/// A masked client frame (RFC 6455 §5.2).
fn frame(fin: bool, opcode: u8, payload: &[u8]) -> Vec<u8> {
    let mask = [0x5au8, 0x11, 0xc3, 0x07];
    let mut f = vec![(if fin { 0x80 } else { 0 }) | opcode];
    match payload.len() {
        n if n < 126 => f.push(0x80 | n as u8),
        n if n <= 0xffff => {
            f.push(0x80 | 126);
            f.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            f.push(0x80 | 127);
            f.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

/// Upgrades a raw socket to a worker WebSocket; returns the socket (the 101 consumed).
fn raw_worker(relay: &Relay) -> TcpStream {
    let mut s = TcpStream::connect(relay.addr).expect("connect");
    let raw = format!(
        "GET /ws?token={WRK} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    );
    s.write_all(raw.as_bytes()).expect("upgrade");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let mut head = Vec::new();
    let mut byte = [0u8];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).expect("101");
        head.push(byte[0]);
    }
    assert!(head.starts_with(b"HTTP/1.1 101"), "{}", String::from_utf8_lossy(&head));
    s
}

/// Reads frames until a close frame arrives; returns its code.
fn close_code(s: &mut TcpStream) -> Option<u16> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        // Server frames are unmasked; payloads here are short.
        while buf.len() >= 2 {
            let len = (buf[1] & 0x7f) as usize;
            let (start, len) = match len {
                126 if buf.len() >= 4 => (4, u16::from_be_bytes([buf[2], buf[3]]) as usize),
                127 if buf.len() >= 10 => (10, u64::from_be_bytes(buf[2..10].try_into().expect("8 bytes")) as usize),
                126 | 127 => break,
                n => (2, n),
            };
            if buf.len() < start + len {
                break;
            }
            if buf[0] & 0x0f == 0x8 {
                return (len >= 2).then(|| u16::from_be_bytes([buf[start], buf[start + 1]]));
            }
            buf.drain(..start + len);
        }
        match s.read(&mut chunk) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    None
}

#[test]
fn a_worker_that_floods_pings_starves_nobody() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("MAX_MESSAGE_SIZE", "4096"), ("LOG_LEVEL", "info")]);
        let mut flood = raw_worker(&relay);
        // It takes no task (else, after the hello grace, it would be sent some and never answer).
        flood.write_all(&frame(true, 0x1, br#"{"type":"hello","kinds":[]}"#)).expect("hello");
        let good = FakeWorker::connect(&relay, Some(json!({"type":"hello","version":"good"})), Auto::Echo);
        relay.wait_clients(2, |c| c["version"] == "good" || c["kinds"] == json!([]));
        let clients = relay.clients();
        let good_id = clients["clients"]
            .as_array()
            .expect("clients")
            .iter()
            .find(|c| c["version"] == "good")
            .map(|c| c["client_id"].clone())
            .expect("the good worker");
        // The flooder reads what it is sent (so its pongs drain) and pings as fast as it can.
        let stop = AtomicBool::new(false);
        let baseline = rss_kib(relay.pid());
        std::thread::scope(|s| {
            let mut reader = flood.try_clone().expect("clone");
            let stop = &stop;
            s.spawn(move || {
                let mut sink = [0u8; 65536];
                reader.set_read_timeout(Some(Duration::from_millis(100))).expect("timeout");
                while !stop.load(Ordering::Relaxed) {
                    match reader.read(&mut sink) {
                        Ok(0) => return,
                        Ok(_) => {}
                        Err(e)
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock
                                    | std::io::ErrorKind::TimedOut
                                    | std::io::ErrorKind::Interrupted
                            ) => {}
                        Err(_) => return,
                    }
                }
            });
            let writer = &mut flood;
            s.spawn(move || {
                let burst: Vec<u8> = (0..1_000).flat_map(|_| frame(true, 0x9, b"ping")).collect();
                writer.set_write_timeout(Some(Duration::from_millis(200))).expect("timeout");
                while !stop.load(Ordering::Relaxed) {
                    let _ = writer.write_all(&burst);
                }
            });
            let _stop = StopOnDrop(stop);
            let started = Instant::now();
            for i in 0..50 {
                let r = relay.api("POST", "/tasks?wait=true", Some(&format!(r#"{{"payload":{i}}}"#)));
                assert_eq!(r.status, 200, "{}", r.text());
                assert_eq!(r.json()["client_id"], good_id, "only the good worker takes tasks");
            }
            let took = started.elapsed();
            assert!(took < Duration::from_secs(10), "50 tasks beside a ping flood took {took:?}");
        });
        let growth = rss_kib(relay.pid()).saturating_sub(baseline);
        assert!(growth < 16 * 1024, "relay grew by {growth} KiB under a ping flood");
        drop(good);
        let _ = flood.shutdown(std::net::Shutdown::Both);
    });
}

#[test]
fn fragmented_websocket_messages_over_the_size_limit_close_with_1009() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("MAX_MESSAGE_SIZE", "1000")]);
        // Fragments of 400 bytes: each is small, the message is not.
        let mut s = raw_worker(&relay);
        let piece = vec![b'a'; 400];
        let mut msg = frame(false, 0x1, &piece);
        msg.extend(frame(false, 0x0, &piece));
        msg.extend(frame(true, 0x0, &piece));
        s.write_all(&msg).expect("fragments");
        assert_eq!(close_code(&mut s), Some(1009), "1,200 bytes in three fragments");
        // A trickle of one-byte fragments that never ends.
        let mut s = raw_worker(&relay);
        let mut msg = frame(false, 0x1, b"a");
        for _ in 0..1_500 {
            msg.extend(frame(false, 0x0, b"a"));
        }
        let _ = s.write_all(&msg);
        assert_eq!(close_code(&mut s), Some(1009), "1,501 one-byte fragments");
        // Within the limit, fragments are one message (a malformed one here: counted, not fatal).
        let mut s = raw_worker(&relay);
        let mut msg = frame(false, 0x1, b"{\"type\":");
        msg.extend(frame(true, 0x0, b"\"nope\"}"));
        s.write_all(&msg).expect("fragments");
        assert!(poll_until(Duration::from_secs(5), || relay.metric("relay_ws_messages_malformed_total") == 1.0));
        assert_eq!(relay.clients()["count"], 1, "the worker with a fine message stays");
    });
}

#[test]
fn request_smuggling_shapes_get_400_and_close() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let auth = format!("Authorization: Bearer {API}\r\n");
        let smuggled = "GET /smuggled HTTP/1.1\r\nHost: relay\r\n\r\n";
        let body = r#"{"payload":1,"queue":true}"#;
        // (name, request; 400 unless the name says 413: a chunk size over the body limit is refused
        // as too large at its size line).
        let cases: Vec<(&str, String)> = vec![
            (
                "CL.TE",
                format!(
                    "POST /tasks HTTP/1.1\r\nHost: relay\r\n{auth}Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n\
                 1a\r\n{body}\r\n0\r\n\r\n{smuggled}"
                ),
            ),
            (
                "TE.CL",
                format!(
                    "POST /tasks HTTP/1.1\r\nHost: relay\r\n{auth}Transfer-Encoding: chunked\r\nContent-Length: 26\r\n\r\n\
                 {body}{smuggled}"
                ),
            ),
            (
                "two Content-Lengths",
                format!(
                    "POST /tasks HTTP/1.1\r\nHost: relay\r\n{auth}Content-Length: 26\r\nContent-Length: 4\r\n\r\n{body}{smuggled}"
                ),
            ),
            (
                "Content-Length list",
                format!("POST /tasks HTTP/1.1\r\nHost: relay\r\n{auth}Content-Length: 26, 4\r\n\r\n{body}{smuggled}"),
            ),
            (
                "TE with a space before the colon",
                format!(
                    "POST /tasks HTTP/1.1\r\nHost: relay\r\n{auth}Transfer-Encoding : chunked\r\nContent-Length: 26\r\n\r\n\
                 {body}{smuggled}"
                ),
            ),
            (
                "TE: xchunked",
                format!(
                    "POST /tasks HTTP/1.1\r\nHost: relay\r\n{auth}Transfer-Encoding: xchunked\r\nContent-Length: 26\r\n\r\n\
                 {body}{smuggled}"
                ),
            ),
            (
                "TE: chunked, identity",
                format!(
                    "POST /tasks HTTP/1.1\r\nHost: relay\r\n{auth}Transfer-Encoding: chunked, identity\r\n\r\n\
                 1a\r\n{body}\r\n0\r\n\r\n{smuggled}"
                ),
            ),
            (
                "chunk size with a 0x prefix",
                format!(
                    "POST /tasks HTTP/1.1\r\nHost: relay\r\n{auth}Transfer-Encoding: chunked\r\n\r\n0x1a\r\n{body}\r\n0\r\n\r\n{smuggled}"
                ),
            ),
            (
                "negative chunk size",
                format!(
                    "POST /tasks HTTP/1.1\r\nHost: relay\r\n{auth}Transfer-Encoding: chunked\r\n\r\n-1a\r\n{body}\r\n0\r\n\r\n{smuggled}"
                ),
            ),
            (
                "chunk size that overflows 64 bits (413)",
                format!(
                    "POST /tasks HTTP/1.1\r\nHost: relay\r\n{auth}Transfer-Encoding: chunked\r\n\r\n\
                 1000000000000001a\r\n{body}\r\n0\r\n\r\n{smuggled}"
                ),
            ),
            (
                "chunk size ended by a bare LF",
                format!(
                    "POST /tasks HTTP/1.1\r\nHost: relay\r\n{auth}Transfer-Encoding: chunked\r\n\r\n1a\n{body}\r\n0\r\n\r\n{smuggled}"
                ),
            ),
            (
                "obs-fold in a header",
                format!(
                    "POST /tasks HTTP/1.1\r\nHost: relay\r\n{auth}X-Folded: a\r\n b\r\nContent-Length: 26\r\n\r\n{body}{smuggled}"
                ),
            ),
            (
                "obs-fold continuing Transfer-Encoding",
                format!(
                    "POST /tasks HTTP/1.1\r\nHost: relay\r\n{auth}Transfer-Encoding: identity\r\n chunked\r\nContent-Length: 26\r\n\r\n\
                 {body}{smuggled}"
                ),
            ),
        ];
        for (name, raw) in &cases {
            let mut c = Client::connect(relay.addr);
            c.send_raw(raw.as_bytes());
            let r = c.read_response().unwrap_or_else(|| panic!("{name}: no answer"));
            let expected = if name.ends_with("(413)") { 413 } else { 400 };
            assert_eq!(r.status, expected, "{name}: {}", r.text());
            assert!(c.closed_within(Duration::from_secs(5)), "{name}: the connection must close after the 400");
        }
        assert!(!relay.log_text().contains("/smuggled"), "a smuggled request was answered:\n{}", relay.log_text());
        assert_eq!(
            relay.api("GET", "/healthz", None).json()["tasks"]["pending"],
            0,
            "no smuggling request made a task"
        );
    });
}

/// Issue 19: four connections declaring 64 MiB batch bodies (MAX_BATCH_BYTES) and trickling
/// bytes took the whole batch budget (it reserved what heads declared), so another client's
/// 2.3 MB batch waited 9.1 s for their 408s instead of 0.2 s. A body now holds what arrived.
#[test]
fn stalled_batch_bodies_do_not_keep_an_honest_batch_waiting() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("HEADER_TIMEOUT", "20s")]);
        let auth = format!("Bearer {API}");
        let declared = 64 * 1024 * 1024;
        let mut stalled = Vec::new();
        for _ in 0..4 {
            let mut c = Client::connect(relay.addr);
            c.send_raw(
            format!(
                "POST /tasks/batch HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\nContent-Type: application/json\r\n\
                 Content-Length: {declared}\r\n\r\n{{\"tasks\":["
            )
            .as_bytes(),
        );
            stalled.push(c);
        }
        relay.barrier();
        // A trickle: a few more bytes each, as a slow client would.
        for c in &mut stalled {
            c.send_raw(br#"{"payload":{"kind":"x"},"queue":true},"#);
        }
        relay.barrier();
        let item = format!(r#"{{"payload":{{"kind":"x","pad":"{}"}},"queue":true}}"#, "p".repeat(2_200));
        let body = format!("{{\"tasks\":[{}]}}", vec![item.as_str(); 1_000].join(","));
        assert!(body.len() > 2_000_000);
        let started = Instant::now();
        let mut honest = Client::connect(relay.addr);
        honest.stream.set_read_timeout(Some(Duration::from_secs(8))).expect("timeout");
        honest.send("POST", "/tasks/batch", &[("Authorization", &auth)], Some(body.as_bytes()));
        let r = honest.read_response().expect("the honest batch is answered while the others stall");
        let took = started.elapsed();
        assert_eq!(r.status, 202, "{}", r.text());
        assert_eq!(r.json()["tasks"].as_array().map(Vec::len), Some(1_000));
        assert!(took < Duration::from_secs(3), "the honest batch took {took:?} beside four stalled ones");
        // The stalled ones are still open, waiting for their bytes (HEADER_TIMEOUT is 20 s).
        for c in &mut stalled {
            assert!(!c.closed_within(Duration::from_millis(10)), "a stalled body was cut early");
        }
    });
}

/// Sets SO_RCVBUF on a client socket, so the kernel absorbs little of what relay sends it.
pub(crate) fn small_receive_buffer(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let bytes: libc::c_int = 4096;
    // SAFETY: setsockopt on a socket we own, with a pointer to a live c_int of the size given.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// Issue 19: clients that never read held up to ~400 KB each unauthenticated and 1 MiB
/// authenticated — 4–10 GB at the default MAX_CONNECTIONS. SPEC §10: the output held for
/// them is bounded as a whole (OUTPUT_MEMORY); those that do not read are closed once it is used
/// up, and a client that reads is served all along.
#[test]
fn clients_that_never_read_hold_output_memory_as_a_whole_not_each() {
    for_each_mode(|mode| {
        let budget = 2 * 1024 * 1024;
        let relay = mode.start_with(&[("OUTPUT_MEMORY", &budget.to_string()), ("IDLE_TIMEOUT", "60s")]);
        let _w = FakeWorker::connect(&relay, None, Auto::Echo);
        relay.wait_clients(1, |_| true);
        let pad = "r".repeat(900 * 1024);
        let done = relay.api("POST", "/tasks?wait=true", Some(&json!({"payload": {"pad": pad}}).to_string()));
        assert_eq!(done.status, 200, "{}", done.text());
        let id = done.json()["task_id"].as_str().expect("id").to_string();
        let answer_bytes = done.body.len();
        let auth = format!("Bearer {API}");
        let one = format!("GET /tasks/{id} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n\r\n");
        let conns = 16;
        let mut deaf = Vec::new();
        for _ in 0..conns {
            let s = TcpStream::connect(relay.addr).expect("connect");
            small_receive_buffer(&s);
            let mut s = s;
            // Answers of 900 KiB asked for, none read: more than the kernel's socket buffers take.
            s.write_all(one.repeat(8).as_bytes()).expect("write");
            deaf.push(s);
        }
        let mut peak = 0f64;
        let started = Instant::now();
        let mut honest = Client::connect(relay.addr);
        while started.elapsed() < Duration::from_secs(20) && relay.metric("relay_output_stalled_closed_total") < 1.0 {
            let t = Instant::now();
            let r = honest.call("GET", &format!("/tasks/{id}"), &[("Authorization", &auth)], None);
            assert_eq!(r.status, 200);
            assert!(t.elapsed() < Duration::from_secs(1), "a client that reads waited {:?}", t.elapsed());
            peak = peak.max(relay.metric("relay_output_buffered_bytes"));
        }
        // Those that do not read hold no more than the budget, and at most one answer each of those
        // that had read everything before it was used up.
        assert!(
            peak <= (budget + conns * answer_bytes) as f64,
            "peak {peak} bytes held for {conns} clients that never read (OUTPUT_MEMORY {budget})"
        );
        assert!(
            relay.metric("relay_output_stalled_closed_total") > 0.0,
            "no client that never read was closed (peak {peak}): {}",
            relay.metrics().lines().filter(|l| l.contains("output")).collect::<Vec<_>>().join("\n")
        );
        let settled =
            poll_until(Duration::from_secs(5), || relay.metric("relay_output_buffered_bytes") <= budget as f64);
        assert!(settled, "held output stays over OUTPUT_MEMORY: {}", relay.metric("relay_output_buffered_bytes"));
    });
}

/// Issue 19: one GET of a 48 MiB result stalled the loop ~0.4 s: its body was copied into the
/// connection's buffer, and the rest of it moved down that buffer at every write. SPEC §10: it
/// leaves in slices, and other connections are served between them.
#[test]
fn a_48_mib_result_leaves_in_slices_and_others_are_served_meanwhile() {
    // (In cluster mode the result's JSON is checked on the database thread, not on the loop that
    // turns the row into a task: checked there, a 48 MiB result stalled others about 200 ms.)
    for_each_mode(|mode| {
        let relay = mode.start_with(&[
            ("MAX_MESSAGE_SIZE", "67108864"),
            ("TASK_TIMEOUT", "20s"),
            ("WAIT_TIMEOUT", "20s"),
            ("PING_INTERVAL", "2s"),
            ("PONG_WAIT", "30s"),
        ]);
        let _w = FakeWorker::connect(&relay, None, Auto::Echo);
        relay.wait_clients(1, |_| true);
        let big = "b".repeat(48 * 1024 * 1024);
        let body = format!(r#"{{"payload":{{"pad":"{big}"}}}}"#);
        drop(big);
        let auth = format!("Bearer {API}");
        let mut c = Client::connect(relay.addr);
        c.stream.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
        let done = c.call("POST", "/tasks?wait=true", &[("Authorization", &auth)], Some(body.as_bytes()));
        assert_eq!(done.status, 200, "{}", &done.text()[..done.body.len().min(300)]);
        let id = done.json()["task_id"].as_str().expect("id").to_string();
        drop(done);
        // What a /healthz waits on this machine as it is now (tests run side by side, and a busy
        // machine delays every answer): the stall is measured against it.
        // Each wait counts without the time relay's loop or this prober sat ready to run while
        // other processes had the cores (/proc schedstat): the wait a stalled loop causes stays,
        // the wait for a core on a loaded machine (two CPU-bound processes beside the suite made
        // it 120-140 ms) does not.
        let loop_tid = relay.pid();
        let mut p = Client::connect(relay.addr);
        let mut baseline = Duration::ZERO;
        let calm = Instant::now();
        while calm.elapsed() < Duration::from_millis(400) {
            let w = Waited::start(loop_tid);
            assert_eq!(p.call("GET", "/healthz", &[], None).status, 200);
            baseline = baseline.max(w.stalled());
        }
        drop(p);
        // A reader of the large result, at its own pace, while another client measures the loop.
        let stop = AtomicBool::new(false);
        let worst = std::thread::scope(|scope| {
            let prober = scope.spawn(|| {
                let mut p = Client::connect(relay.addr);
                let mut worst = Duration::ZERO;
                while !stop.load(Ordering::SeqCst) {
                    let w = Waited::start(loop_tid);
                    assert_eq!(p.call("GET", "/healthz", &[], None).status, 200);
                    worst = worst.max(w.stalled());
                }
                worst
            });
            // A fast reader (1 MiB reads): the socket would take the whole answer in one go.
            let mut s = TcpStream::connect(relay.addr).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
            let get = format!("GET /tasks/{id} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n\r\n");
            let mut buf = vec![0u8; 1 << 20];
            for _ in 0..2 {
                s.write_all(get.as_bytes()).expect("write");
                let mut got: Vec<u8> = Vec::new();
                let (head_len, length) = loop {
                    let n = s.read(&mut buf).expect("the answer's head");
                    assert!(n > 0, "EOF before the head");
                    got.extend_from_slice(&buf[..n]);
                    if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                        let length: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length: "))
                            .and_then(|v| v.trim().parse().ok())
                            .expect("a Content-Length");
                        break (end + 4, length);
                    }
                };
                assert!(length > 48 * 1024 * 1024);
                let mut body = got.len() - head_len;
                while body < length {
                    let n = s.read(&mut buf).expect("the large answer keeps coming");
                    assert!(n > 0, "EOF after {body} of {length} bytes");
                    body += n;
                }
                assert_eq!(body, length, "bytes past the answer");
            }
            stop.store(true, Ordering::SeqCst);
            prober.join().expect("prober")
        });
        assert!(
            // (Building the one 48 MiB answer takes tens of ms of page faults and copying while
            // the suite's other tests run beside it; the defects this guards against cost 200 ms
            // and more.)
            worst < baseline + Duration::from_millis(100),
            "a /healthz waited {worst:?} behind a 48 MiB answer (at most {baseline:?} without it; \
             both without the time spent waiting for a core)"
        );
    });
}

/// One request's wait, and how long relay's loop thread and the calling thread were ready to
/// run but not running meanwhile (`run_delay` of `/proc/.../schedstat`, in ns).
struct Waited {
    at: Instant,
    loop_tid: u32,
    loop_delay: u64,
    own_delay: u64,
}

impl Waited {
    fn start(loop_tid: u32) -> Waited {
        Waited {
            at: Instant::now(),
            loop_tid,
            loop_delay: run_delay_ns(&format!("/proc/{loop_tid}/task/{loop_tid}/schedstat")),
            own_delay: run_delay_ns("/proc/thread-self/schedstat"),
        }
    }

    /// The wait less the longer of the two threads' waits for a core (they may overlap).
    fn stalled(&self) -> Duration {
        let wall = self.at.elapsed();
        let path = format!("/proc/{0}/task/{0}/schedstat", self.loop_tid);
        let for_loop = run_delay_ns(&path).saturating_sub(self.loop_delay);
        let for_self = run_delay_ns("/proc/thread-self/schedstat").saturating_sub(self.own_delay);
        wall.saturating_sub(Duration::from_nanos(for_loop.max(for_self)))
    }
}

/// The second field of a schedstat file: ns spent runnable, waiting for a CPU (0 when the file
/// cannot be read: then the wait counts whole, as before).
fn run_delay_ns(path: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}
