//! HTTP/1.1 behaviour real clients rely on (SPEC §4): keep-alive, pipelining, 1.0, close,
//! chunked bodies, 100-continue, limits and timeouts.

use std::io::Write;
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::http::build;
use crate::support::*;

fn auth() -> String {
    format!("Bearer {API}")
}

#[test]
fn pipelined_keep_alive_requests_are_answered_in_order() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let mut c = Client::connect(relay.addr);
        let a = auth();
        let mut raw = build("GET", "/healthz", &[], None);
        raw.extend(build("POST", "/tasks", &[("Authorization", &a)], Some(br#"{"payload":1}"#)));
        raw.extend(build("GET", "/nope", &[], None));
        raw.extend(build("GET", "/clients", &[("Authorization", &a)], None));
        c.send_raw(&raw);
        let statuses: Vec<u16> = (0..4).map(|_| c.read_response().expect("response").status).collect();
        assert_eq!(statuses, [200, 503, 404, 200]);
        // Still open for more.
        assert_eq!(c.call("GET", "/healthz", &[], None).status, 200);
    });
}

#[test]
fn pipelined_requests_split_at_every_byte_still_parse() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let mut c = Client::connect(relay.addr);
        let mut raw = build("GET", "/healthz", &[], None);
        raw.extend(build("GET", "/healthz", &[("X-Long", &"x".repeat(300))], None));
        for b in &raw {
            c.send_raw(std::slice::from_ref(b));
        }
        assert_eq!(c.read_response().expect("first").status, 200);
        assert_eq!(c.read_response().expect("second").status, 200);
    });
}

#[test]
fn http10_and_connection_close_are_answered_then_closed() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let mut c = Client::connect(relay.addr);
        c.send_raw(b"GET /healthz HTTP/1.0\r\n\r\n");
        let r = c.read_response().expect("response");
        assert_eq!(r.status, 200);
        assert_eq!(r.header("Connection"), Some("close"));
        assert!(c.closed_within(Duration::from_secs(2)));

        let mut c = Client::connect(relay.addr);
        let r = c.call("GET", "/healthz", &[("Connection", "close")], None);
        assert_eq!(r.status, 200);
        assert!(c.closed_within(Duration::from_secs(2)));
    });
}

/// A connection answered with `Connection: close` lingers (2 s) for its peer's close; while
/// the client keeps its socket open, relay sits idle. Each writable event called shutdown(2)
/// again, which woke the socket again: the loop spun at full CPU for the whole linger (1.3 s
/// of CPU in 1.5 s). After SIGTERM every answered `wait=true` lingers so, beside the
/// downloads that must keep moving at full speed (SPEC §10; issue 19).
#[test]
fn a_connection_lingering_for_its_peers_close_costs_no_cpu() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let pid = relay.pid();
        let mut c = Client::connect(relay.addr);
        let r = c.call("GET", "/healthz", &[("Connection", "close")], None);
        assert_eq!(r.status, 200);
        let (since, cpu_before) = (Instant::now(), cpu_secs(pid).expect("relay runs"));
        // relay closes the connection once the linger is over: /metrics' own connection is
        // then the only one open.
        let mut closed = false;
        while !closed && since.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(100));
            closed = relay.metric("relay_connections_open") <= 1.0;
        }
        let cpu = cpu_secs(pid).expect("relay runs") - cpu_before;
        let lingered = since.elapsed();
        assert!(closed, "relay never closed the lingering connection ({lingered:?})");
        assert!(cpu < 0.5, "relay used {cpu:.2} s of CPU in the {lingered:?} a connection lingered");
        drop(c);
    });
}

#[test]
fn chunked_request_body_is_decoded() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let _w = FakeWorker::connect(&relay, None, Auto::Echo);
        relay.wait_clients(1, |_| true);
        let mut c = Client::connect(relay.addr);
        let body = r#"{"payload":{"n":42}}"#;
        let (a, b) = body.split_at(7);
        let raw = format!(
            "POST /tasks?wait=true HTTP/1.1\r\nHost: relay\r\nAuthorization: {}\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x};ext=1\r\n{b}\r\n0\r\n\r\n",
            auth(),
            a.len(),
            b.len()
        );
        c.send_raw(raw.as_bytes());
        let r = c.read_response().expect("response");
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["result"]["echo"]["n"], 42);

        // Malformed chunk size → 400 and close.
        let mut c = Client::connect(relay.addr);
        c.send_raw(
            format!(
                "POST /tasks HTTP/1.1\r\nHost: relay\r\nAuthorization: {}\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                auth()
            )
            .as_bytes(),
        );
        let r = c.read_response().expect("response");
        assert_eq!(r.status, 400);
        assert!(r.json()["message"].as_str().unwrap_or_default().contains("chunk"));
    });
}

#[test]
fn expect_100_continue_is_answered_before_the_body() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let mut c = Client::connect(relay.addr);
        let body = format!(r#"{{"payload":"{}"}}"#, "y".repeat(2000));
        c.send_raw(
        format!(
            "POST /tasks HTTP/1.1\r\nHost: relay\r\nAuthorization: {}\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
            auth(),
            body.len()
        )
        .as_bytes(),
    );
        let interim = c.read_response().expect("100 Continue");
        assert_eq!(interim.status, 100);
        c.send_raw(body.as_bytes());
        let r = c.read_response().expect("final");
        assert_eq!(r.status, 503, "no worker: {}", r.text());

        // When the head already decides (bad token), the final status comes at once, no 100.
        let mut c = Client::connect(relay.addr);
        c.send_raw(
        b"POST /tasks HTTP/1.1\r\nHost: relay\r\nAuthorization: Bearer nope\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n",
    );
        let r = c.read_response().expect("final");
        assert_eq!(r.status, 401);
        assert!(c.closed_within(Duration::from_secs(2)), "body never sent: the connection cannot be reused");
    });
}

#[test]
fn real_curl_posts_a_large_body_with_100_continue() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let _w = FakeWorker::connect(&relay, None, Auto::Echo);
        relay.wait_clients(1, |_| true);
        let body = format!(r#"{{"payload":{{"blob":"{}"}}}}"#, "z".repeat(4096));
        let out = Command::new("curl")
            .args(["-sS", "-v", "--max-time", "10", "-H", "Expect: 100-continue"])
            .arg("-H")
            .arg(format!("Authorization: Bearer {API}"))
            .arg("--data-binary")
            .arg(&body)
            .arg(format!("http://{}/tasks?wait=true", relay.addr))
            .output()
            .expect("curl runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "curl failed: {stderr}");
        assert!(stderr.contains("HTTP/1.1 100 Continue"), "no 100 Continue seen:\n{stderr}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(v["status"], "done");
        assert_eq!(v["result"]["echo"]["blob"].as_str().map(str::len), Some(4096));
    });
}

#[test]
fn oversized_heads_and_bodies_are_refused() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("MAX_MESSAGE_SIZE", "1000")]);
        let mut c = Client::connect(relay.addr);
        let r = c.call("GET", "/healthz", &[("X-Big", &"a".repeat(17 * 1024))], None);
        assert_eq!(r.status, 431);

        let many: Vec<(String, String)> = (0..65).map(|i| (format!("X-H{i}"), "v".to_string())).collect();
        let refs: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let r = request(relay.addr, "GET", "/healthz", &refs, None);
        assert_eq!(r.status, 431);

        let a = auth();
        let r = request(relay.addr, "POST", "/tasks", &[("Authorization", &a)], Some(&[b'x'; 1001]));
        assert_eq!(r.status, 413);
        assert_eq!(r.error(), "payload_too_large");

        // Chunked bodies are limited as they are decoded.
        let mut c = Client::connect(relay.addr);
        let chunk = "a".repeat(800);
        c.send_raw(
        format!("POST /tasks HTTP/1.1\r\nHost: relay\r\nAuthorization: {a}\r\nTransfer-Encoding: chunked\r\n\r\n320\r\n{chunk}\r\n320\r\n{chunk}\r\n0\r\n\r\n")
            .as_bytes(),
    );
        assert_eq!(c.read_response().expect("response").status, 413);
    });
}

#[test]
fn errors_are_json_with_the_right_codes() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let r = request(relay.addr, "GET", "/nowhere", &[], None);
        assert_eq!((r.status, r.error().as_str()), (404, "not_found"));
        assert_eq!(r.header("Content-Type"), Some("application/json"));

        let r = request(relay.addr, "PUT", "/tasks", &[], None);
        assert_eq!(r.status, 405);
        assert_eq!(r.header("Allow"), Some("GET, HEAD, POST"));
        let r = request(relay.addr, "GET", "/tasks/batch", &[], None);
        assert_eq!((r.status, r.header("Allow")), (405, Some("POST")));
        let r = request(relay.addr, "POST", "/tasks/0b9d2f7e-8f7e-4a63-9a1c-2d4c6f1e0a11", &[], None);
        assert_eq!((r.status, r.header("Allow")), (405, Some("GET, HEAD, DELETE")));
        let mut c = Client::connect(relay.addr);
        c.send("HEAD", "/ws", &[], None);
        let r = c.read_response_to(true).expect("answer");
        assert_eq!((r.status, r.header("Allow")), (405, Some("GET")));

        // 404 before 405 before 401.
        let r = request(relay.addr, "DELETE", "/clients", &[("Authorization", "Bearer wrong")], None);
        assert_eq!(r.status, 405);
        let r = request(relay.addr, "GET", "/clients", &[("Authorization", "Bearer wrong")], None);
        assert_eq!(r.status, 401);

        let mut c = Client::connect(relay.addr);
        c.send_raw(b"GARBAGE\r\n\r\n");
        let r = c.read_response().expect("response");
        assert_eq!(r.status, 400);
        assert!(r.json()["message"].as_str().is_some_and(|m| m.contains("malformed")), "{}", r.text());

        let a = auth();
        let r = request(
            relay.addr,
            "POST",
            "/tasks",
            &[("Authorization", &a), ("Content-Length", "5"), ("Content-Length", "6")],
            None,
        );
        assert_eq!(r.status, 400);
    });
}

#[test]
fn slow_requests_time_out_with_408_and_silent_connections_close() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("HEADER_TIMEOUT", "3s"), ("IDLE_TIMEOUT", "400ms")]);
        // A partial head: 408 once HEADER_TIMEOUT passes.
        let mut slow = Client::connect(relay.addr);
        let started = Instant::now();
        slow.send_raw(b"GET /healthz HTTP/1.1\r\nHost: x\r\n");
        // Meanwhile others are served at once: before the slow one's timeout, not after it.
        assert_eq!(request(relay.addr, "GET", "/healthz", &[], None).status, 200);
        assert!(slow.nothing_received(), "the slow request was answered first ({:?})", started.elapsed());
        let r = slow.read_response().expect("408");
        assert_eq!(r.status, 408);
        assert!(started.elapsed() >= Duration::from_millis(2900), "408 too early");
        assert!(slow.closed_within(Duration::from_secs(5)));

        // A connection that never sends a byte is closed after HEADER_TIMEOUT.
        let mut silent = Client::connect(relay.addr);
        let started = Instant::now();
        assert!(silent.closed_within(Duration::from_secs(10)));
        assert!(started.elapsed() >= Duration::from_millis(2900), "closed too early");

        // An idle keep-alive connection is closed silently after IDLE_TIMEOUT.
        let mut idle = Client::connect(relay.addr);
        assert_eq!(idle.call("GET", "/healthz", &[], None).status, 200);
        let started = Instant::now();
        assert!(idle.closed_within(Duration::from_secs(3)));
        assert!(started.elapsed() >= Duration::from_millis(300), "idle closed too early");
        assert!(idle.buffered().is_empty(), "closed silently, without a response");
    });
}

/// A held answer (`wait=true`; in cluster mode every answer a transaction gives) left its
/// keep-alive connection without an idle deadline: it stayed open for good (found by a hostile
/// probe: client pools slowly filled MAX_CONNECTIONS).
#[test]
fn a_keep_alive_connection_closes_after_idle_timeout_also_after_a_held_answer() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("IDLE_TIMEOUT", "500ms")]);
        let _w = FakeWorker::connect(&relay, None, Auto::Echo);
        relay.wait_clients(1, |_| true);
        let a = auth();
        for (method, path, body) in [
            ("POST", "/tasks?wait=true", Some(&br#"{"payload":{"n":1}}"#[..])),
            ("GET", "/tasks?limit=1", None),
            ("GET", "/clients", None),
        ] {
            let mut c = Client::connect(relay.addr);
            let r = c.call(method, path, &[("Authorization", &a)], body);
            assert!(r.status == 200, "{method} {path}: {}", r.status);
            let started = Instant::now();
            assert!(c.closed_within(Duration::from_secs(5)), "{method} {path}: still open 5 s after its answer");
            assert!(started.elapsed() >= Duration::from_millis(400), "{method} {path}: closed too early");
        }
    });
}

#[test]
fn connections_beyond_max_connections_are_closed_at_once() {
    for_each_mode(|mode| {
        let relay = mode.start_with(&[("MAX_CONNECTIONS", "3"), ("HEADER_TIMEOUT", "30s")]);
        let mut held: Vec<Client> = (0..3).map(|_| Client::connect(relay.addr)).collect();
        // The three were accepted (each is answered) before the fourth arrives.
        for c in &mut held {
            assert_eq!(c.call("GET", "/healthz", &[], None).status, 200);
        }
        let mut extra = Client::connect(relay.addr);
        // Closed at once, not left waiting (an accepted connection would stay open for the 30 s
        // of HEADER_TIMEOUT or the 60 s of IDLE_TIMEOUT).
        assert!(extra.closed_within(Duration::from_secs(10)), "the fourth connection must be closed");
        assert!(extra.buffered().is_empty(), "refused without an answer");
        drop(held);
        // Until the loop has seen the three closes, a new connection may still be refused (EOF).
        assert!(poll_until(Duration::from_secs(2), || {
            let mut c = Client::connect(relay.addr);
            c.send("GET", "/healthz", &[], None);
            c.read_response().is_some_and(|r| r.status == 200)
        }));
        assert!(relay.metric("relay_connections_refused_total") >= 1.0);
    });
}

#[test]
fn a_client_that_does_not_read_does_not_stall_others() {
    for_each_mode(|mode| {
        let relay = mode.start();
        // Pipeline many requests and never read the answers.
        let mut hog = TcpStream::connect(relay.addr).expect("connect");
        let one = build("GET", "/metrics", &[], None);
        let mut burst = Vec::new();
        for _ in 0..2000 {
            burst.extend_from_slice(&one);
        }
        hog.set_write_timeout(Some(Duration::from_millis(500))).expect("timeout");
        let _ = hog.write_all(&burst);
        for _ in 0..20 {
            let started = Instant::now();
            assert_eq!(request(relay.addr, "GET", "/healthz", &[], None).status, 200);
            assert!(started.elapsed() < Duration::from_secs(1));
        }
    });
}

#[test]
fn a_client_that_half_closes_after_its_request_still_gets_the_answer() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let _w = FakeWorker::connect(&relay, None, Auto::Late(Duration::from_millis(200)));
        relay.wait_clients(1, |_| true);
        // Pipelined requests, then FIN: every answer must still arrive, the held one included.
        let mut c = Client::connect(relay.addr);
        let a = auth();
        let mut raw = build("GET", "/healthz", &[], None);
        raw.extend(build("POST", "/tasks?wait=true", &[("Authorization", &a)], Some(br#"{"payload":1}"#)));
        c.send_raw(&raw);
        c.stream.shutdown(std::net::Shutdown::Write).expect("half close");
        assert_eq!(c.read_response().expect("first").status, 200);
        let held = c.read_response().expect("the held answer after our FIN");
        assert_eq!(held.status, 200, "{}", held.text());
        assert!(c.closed_within(Duration::from_secs(2)));
    });
}

#[test]
fn batch_bodies_may_be_larger_than_max_message_size_up_to_max_batch_bytes() {
    for_each_mode(|mode| {
        // Regression: a batch body over ~1 MiB could never finish arriving and timed out as 408.
        let relay = mode.start_with(&[("HEADER_TIMEOUT", "3s"), ("MAX_BATCH_BYTES", "4000000")]);
        let a = auth();
        let mut body = String::from("{\"tasks\":[");
        while body.len() < 2_000_000 {
            body.push_str("{\"payload\":{\"pad\":\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"}},");
        }
        body.push_str("{\"payload\":1}]}");
        let r = request(relay.addr, "POST", "/tasks/batch", &[("Authorization", &a)], Some(body.as_bytes()));
        assert_eq!(r.status, 202, "{}", &r.text()[..r.text().len().min(300)]);
        // Over MAX_BATCH_BYTES: 413 from the head, without reading the body.
        let mut c = Client::connect(relay.addr);
        c.send_raw(
            format!(
                "POST /tasks/batch HTTP/1.1\r\nHost: relay\r\nAuthorization: {a}\r\nContent-Length: 4000001\r\n\r\n"
            )
            .as_bytes(),
        );
        let r = c.read_response().expect("answer");
        assert_eq!(r.status, 413, "{}", r.text());
        // Auth is still checked first.
        let r = request(relay.addr, "POST", "/tasks/batch", &[], Some(b"{}"));
        assert_eq!(r.status, 401);
    });
}

#[test]
fn head_is_get_without_the_body() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let mut c = Client::connect(relay.addr);
        c.send("HEAD", "/healthz", &[], None);
        let r = c.read_response_to(true).expect("head answer");
        assert_eq!(r.status, 200);
        let len: usize = r.header("Content-Length").and_then(|v| v.parse().ok()).expect("length");
        assert!(len > 10, "the length of the body a GET would get");
        // Nothing follows the head: the next answer on the connection starts at once.
        let next = c.call("GET", "/healthz", &[], None);
        assert_eq!((next.status, next.body.len()), (200, len));
    });
}

/// Issue 19 (REDbot and browsers): no `Date` on any answer, task JSON without
/// `Cache-Control: no-store`, dashboard files without validators, and no icon (every page load
/// asked for /favicon.ico and got 404).
#[test]
fn answers_carry_date_task_json_is_no_store_and_ui_files_revalidate() {
    for_each_mode(|mode| {
        let relay = mode.start();
        let _w = FakeWorker::connect(&relay, None, Auto::Echo);
        relay.wait_clients(1, |_| true);
        let is_date = |r: &Resp| {
            r.header("Date").is_some_and(|d| {
                // IMF-fixdate: `Sun, 06 Nov 1994 08:49:37 GMT`.
                d.len() == 29 && d.ends_with(" GMT") && d.as_bytes()[3] == b',' && d.as_bytes()[19] == b':'
            })
        };
        let submit = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":{"x":1}}"#));
        assert_eq!(submit.status, 200, "{}", submit.text());
        let id = submit.json()["task_id"].as_str().expect("id").to_string();
        let answers = [
            submit,
            relay.api("GET", &format!("/tasks/{id}"), None),
            relay.api("GET", "/tasks", None),
            relay.api("GET", "/tasks/00000000-0000-0000-0000-000000000000", None),
            request(relay.addr, "GET", "/healthz", &[], None),
            request(relay.addr, "GET", "/nope", &[], None),
        ];
        for r in &answers {
            assert!(is_date(r), "no Date: {} {:?}", r.status, r.headers);
            assert_eq!(r.header("Cache-Control"), Some("no-store"), "{} {:?}", r.status, r.headers);
        }
        assert!(is_date(&request(relay.addr, "GET", "/metrics", &[], None)));

        let page = request(relay.addr, "GET", "/ui", &[], None);
        assert!(page.text().contains(r#"<link rel="icon" href="/ui/favicon.svg""#), "the page names its icon");
        let icon = request(relay.addr, "GET", "/ui/favicon.svg", &[], None);
        assert_eq!((icon.status, icon.header("Content-Type")), (200, Some("image/svg+xml")));
        assert!(icon.text().starts_with("<svg"));
        let mut c = Client::connect(relay.addr);
        for path in ["/ui", "/ui/app.js", "/ui/app.css", "/ui/favicon.svg"] {
            let r = c.call("GET", path, &[], None);
            assert_eq!(r.status, 200, "{path}");
            assert!(is_date(&r), "{path}");
            let etag = r.header("ETag").unwrap_or_else(|| panic!("{path}: no ETag")).to_string();
            let again = c.call("GET", path, &[("If-None-Match", &etag)], None);
            assert_eq!((again.status, again.body.len()), (304, 0), "{path}");
            assert_eq!(again.header("ETag"), Some(etag.as_str()), "{path}");
            assert!(again.header("Content-Length").is_none(), "{path}: {:?}", again.headers);
            assert_eq!(c.call("GET", path, &[("If-None-Match", "\"old\"")], None).status, 200, "{path}");
        }
    });
}
