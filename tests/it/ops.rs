//! Operations (SPEC §2, §10): configuration errors, help, metrics, logs, graceful shutdown.
//!
//! Single-node only (SPEC §2, §10, outside §4–§9): a cluster node's SIGTERM hands its running
//! attempts back to `pending` instead (SPEC §11), which `cluster.rs` tests.

use std::time::{Duration, Instant};

use crate::support::*;

const BASE: &[(&str, &str)] = &[("API_TOKEN", "a"), ("WORKER_TOKEN", "w"), ("PORT", "0"), ("BIND", "127.0.0.1")];

#[test]
fn help_and_version() {
    let (code, out, _) = run_relay_env(&["--help"], &[]);
    assert_eq!(code, Some(0));
    for var in [
        "PORT",
        "BIND",
        "WORKER_TOKEN",
        "API_TOKEN",
        "AUTH_TOKEN",
        "PING_INTERVAL",
        "PONG_WAIT",
        "TASK_TIMEOUT",
        "MAX_RETRIES",
        "WAIT_TIMEOUT",
        "BLOB_DIR",
        "BLOB_TTL",
        "MAX_FILE_SIZE",
        "TASK_TTL",
        "MAX_MESSAGE_SIZE",
        "TOKEN_SECRET",
        "TOKEN_STORE",
        "DATA_DIR",
        "MAX_CONNECTIONS",
        "HEADER_TIMEOUT",
        "IDLE_TIMEOUT",
        "MAX_PENDING",
        "MAX_BATCH_BYTES",
        "SHUTDOWN_TIMEOUT",
        "LOG_LEVEL",
        "TRUSTED_PROXIES",
        "DATABASE_URL",
    ] {
        assert!(out.contains(var), "--help lacks {var}");
    }
    let (code, out, _) = run_relay_env(&["--version"], &[]);
    assert_eq!(code, Some(0));
    assert!(out.starts_with("relay "));
    let (code, _, err) = run_relay_env(&["--bogus"], &[]);
    assert_eq!(code, Some(2));
    assert!(err.contains("--bogus"));
    let (code, _, err) = run_relay_env(&["serve", "--bogus"], &[]);
    assert_eq!(code, Some(2));
    assert!(err.contains("serve takes no arguments"), "{err}");
}

#[test]
fn invalid_configuration_exits_2_naming_the_variable() {
    let table: &[(&str, &str)] = &[
        ("PORT", "99999"),
        ("PING_INTERVAL", "0s"),
        ("PONG_WAIT", "-1s"),
        ("TASK_TIMEOUT", "soon"),
        ("MAX_RETRIES", "-2"),
        ("LOG_LEVEL", "chatty"),
        ("MAX_CONNECTIONS", "many"),
        ("BIND", "256.0.0.1"),
        ("TOKEN_SECRET", "too-short"),
        ("HEADER_TIMEOUT", "18446744073709551615ms"),
        ("PONG_WAIT", "1s"),
        ("TASK_TTL", "1000000h"),
        ("DATABASE_URL", "mysql://u:pw@h/db"),
        ("DATABASE_URL", "postgres://h/db?sslmode=verify-full"),
    ];
    for (var, value) in table {
        let mut env = BASE.to_vec();
        env.push((var, value));
        let started = Instant::now();
        let (code, _, err) = run_relay_env(&[], &env);
        assert_eq!(code, Some(2), "{var}={value}: {err}");
        assert!(err.contains(var), "{var}: stderr should name it: {err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
    let (code, _, err) = run_relay_env(&[], &[("API_TOKEN", "a")]);
    assert_eq!(code, Some(2));
    assert!(err.contains("WORKER_TOKEN"), "{err}");
}

#[test]
fn metrics_expose_every_family() {
    let relay = Relay::start();
    let _w = FakeWorker::connect(&relay, None, Auto::Echo);
    relay.wait_clients(1, |_| true);
    assert_eq!(relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":1}"#)).status, 200);
    let r = request(relay.addr, "GET", "/metrics", &[], None);
    assert!(r.header("Content-Type").is_some_and(|c| c.starts_with("text/plain")));
    let text = r.text();
    for family in [
        "relay_tasks_total{status=\"done\"} 1",
        "relay_attempts_total{outcome=\"done\"} 1",
        "relay_results_ignored_total{reason=\"late\"} 0",
        "relay_workers_connected 1",
        "relay_workers_active 1",
        "relay_tasks_pending 0",
        "relay_tasks_dispatched 0",
        "relay_connections_open ",
        "relay_http_requests_total{code=\"200\"} ",
        "relay_task_duration_seconds_count 1",
        "relay_task_duration_seconds_bucket{le=\"+Inf\"} 1",
    ] {
        assert!(text.contains(family), "missing {family:?} in\n{text}");
    }
}

#[test]
fn logs_are_key_value_lines_without_tokens() {
    let relay = Relay::start();
    let _w = FakeWorker::connect(&relay, None, Auto::Echo);
    relay.wait_clients(1, |_| true);
    relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":1}"#));
    request(relay.addr, "GET", "/ws?token=guess", &[], None);
    assert!(relay.wait_log("msg=\"worker connected\"", Duration::from_secs(2)));
    let log = relay.log_text();
    for line in log.lines() {
        assert!(line.starts_with("ts=") && line.contains(" level=") && line.contains(" msg="), "{line}");
    }
    assert!(!log.contains(API) && !log.contains(WRK), "a token leaked into the logs:\n{log}");
    assert!(!log.contains("guess"));
}

/// Makes relay log at each level a client can provoke: info (a worker connects), warn (a
/// malformed worker message), debug (a request refused 401, an accepted task); then stops it
/// (exit 0) and returns everything it logged.
fn provoke_every_level(relay: Relay) -> String {
    let w = FakeWorker::connect(&relay, None, Auto::Echo);
    relay.wait_clients(1, |_| true);
    w.send("not json".to_string());
    assert!(poll_until(Duration::from_secs(5), || relay.metric("relay_ws_messages_malformed_total") == 1.0));
    let r = request(relay.addr, "GET", "/clients", &[("Authorization", "Bearer nope")], None);
    assert_eq!(r.status, 401);
    assert_eq!(relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":1}"#)).status, 200);
    let mut relay = relay;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(Duration::from_secs(10)).and_then(|s| s.code()), Some(0));
    relay.log_text()
}

/// The levels of the lines in `log`, except the `listening` line (printed at every level).
fn levels_seen(log: &str) -> Vec<String> {
    let mut levels: Vec<String> = log
        .lines()
        .filter(|l| !l.contains("msg=listening"))
        .filter_map(|l| l.split_whitespace().find_map(|kv| kv.strip_prefix("level=")).map(str::to_string))
        .collect();
    levels.sort();
    levels.dedup();
    levels
}

#[test]
fn log_level_filters() {
    let log = provoke_every_level(Relay::start_with(&[("LOG_LEVEL", "WARN")]));
    assert!(log.contains("msg=listening"), "the bound address is always logged:\n{log}");
    assert!(log.contains("level=warn msg=\"malformed worker message ignored\""), "warn lines appear at warn:\n{log}");
    assert_eq!(levels_seen(&log), ["warn"], "only the listening line ignores LOG_LEVEL:\n{log}");

    let log = provoke_every_level(Relay::start_with(&[("LOG_LEVEL", "error")]));
    assert!(log.contains("msg=listening"), "the bound address is always logged:\n{log}");
    assert_eq!(levels_seen(&log), Vec::<String>::new(), "nothing below error:\n{log}");

    let log = provoke_every_level(Relay::start_with(&[("LOG_LEVEL", "debug")]));
    for line in [
        "level=debug msg=request method=Get path=/clients status=401",
        "level=debug msg=\"task accepted\"",
        "level=info msg=\"worker connected\"",
        "level=warn msg=\"malformed worker message ignored\"",
    ] {
        assert!(log.contains(line), "{line:?} missing at debug:\n{log}");
    }
    assert!(!log.contains("level=trace"), "trace lines stay out at debug:\n{log}");
}

#[test]
fn the_metric_helper_fails_on_a_missing_series() {
    let relay = Relay::start();
    assert_eq!(relay.metric("relay_workers_connected"), 0.0);
    let missing = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| relay.metric("relay_no_such_series")));
    assert!(missing.is_err(), "a missing series must fail the test, not read as 0");
    // A prefix of a real series is not that series.
    assert_eq!(metric_value("relay_workers_connected 3\n", "relay_workers"), None);
}

#[test]
fn sigterm_answers_waiters_closes_workers_and_exits_0() {
    let relay = Relay::start_with(&[("WAIT_TIMEOUT", "30s"), ("SHUTDOWN_TIMEOUT", "3s")]);
    let w = FakeWorker::connect(&relay, None, Auto::Manual);
    relay.wait_clients(1, |_| true);
    let addr = relay.addr;
    let waiter = std::thread::spawn(move || {
        let auth = format!("Bearer {API}");
        request(addr, "POST", "/tasks?wait=true", &[("Authorization", &auth)], Some(br#"{"payload":"s"}"#))
    });
    let _task = w.expect_task();
    let mut idle = Client::connect(relay.addr);
    assert_eq!(idle.call("GET", "/healthz", &[], None).status, 200);
    let started = Instant::now();
    let status = relay.stop();
    assert_eq!(status.code(), Some(0));
    assert!(started.elapsed() < Duration::from_secs(3), "no reason to wait for the grace period");
    let r = waiter.join().expect("waiter");
    assert_eq!(r.status, 202, "a POST waiter gets the task as it is: {}", r.text());
    assert_eq!(r.json()["status"], "dispatched");
    assert_eq!(r.header("Connection"), Some("close"));
    assert_eq!(w.wait_closed(Duration::from_secs(2)), Some(Some(1001)));
    assert!(idle.closed_within(Duration::from_secs(2)));
}

#[test]
fn sigint_also_exits_0() {
    let mut relay = Relay::start();
    relay.signal("INT");
    assert_eq!(relay.wait_exit(Duration::from_secs(5)).and_then(|s| s.code()), Some(0));
}

#[test]
fn port_zero_logs_the_bound_address() {
    let relay = Relay::start();
    assert!(relay.log_text().contains(&format!("msg=listening addr={}", relay.addr)));
}

#[test]
fn two_signals_at_once_are_one_graceful_shutdown_and_a_later_one_forces_exit() {
    // Regression: GNU `timeout` signals the process and then its group; the second signal,
    // microseconds later, skipped the graceful shutdown (exit 1).
    let mut relay = Relay::start_with(&[("WAIT_TIMEOUT", "30s")]);
    let w = FakeWorker::connect(&relay, None, Auto::Manual);
    relay.wait_clients(1, |_| true);
    let addr = relay.addr;
    let waiter = std::thread::spawn(move || {
        let auth = format!("Bearer {API}");
        request(addr, "POST", "/tasks?wait=true", &[("Authorization", &auth)], Some(br#"{"payload":1}"#))
    });
    w.expect_task();
    let pid = relay.pid().to_string();
    let status = std::process::Command::new("sh")
        .args(["-c", &format!("kill -TERM {pid}; kill -TERM {pid}")])
        .status()
        .expect("kill twice");
    assert!(status.success());
    assert_eq!(relay.wait_exit(Duration::from_secs(5)).and_then(|s| s.code()), Some(0));
    assert_eq!(waiter.join().expect("waiter").status, 202, "the waiter got its graceful answer");

    // A request under way keeps the graceful shutdown waiting (SHUTDOWN_TIMEOUT 30s); a second
    // signal a second later ends it at once.
    let mut relay = Relay::start_with(&[("SHUTDOWN_TIMEOUT", "30s"), ("HEADER_TIMEOUT", "30s")]);
    let mut slow = Client::connect(relay.addr);
    // relay has read this head when it answers 100 Continue: the request is under way.
    slow.send_raw(
        format!(
            "POST /tasks HTTP/1.1\r\nHost: relay\r\nAuthorization: Bearer {API}\r\nExpect: 100-continue\r\nContent-Length: 13\r\n\r\n"
        )
        .as_bytes(),
    );
    assert_eq!(slow.read_response().expect("100 Continue").status, 100);
    relay.signal("TERM");
    // The window for a forcing repeat counts from relay's receipt of the first signal.
    assert!(relay.wait_log("msg=\"signal received\"", Duration::from_secs(5)), "{}", relay.log_text());
    assert!(relay.wait_exit(Duration::from_millis(1200)).is_none(), "still finishing the request under way");
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(Duration::from_secs(3)).and_then(|s| s.code()), Some(1));
}
