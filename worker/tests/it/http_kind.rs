//! The http kind end to end: relay → relay-worker → a local HTTP target on 127.0.0.1.

use std::time::Duration;

use serde_json::json;

use crate::support::target::{Reply, Target};
use crate::support::{Relay, Worker};

#[test]
fn http_task_returns_status_headers_and_json_body() {
    crate::require_relay!();
    let target = Target::start(|req, _| {
        if req.path != "/things" {
            return Reply::new(404, &[], "no");
        }
        Reply::Respond {
            status: 201,
            headers: vec![
                ("Content-Type".into(), "application/json; charset=utf-8".into()),
                ("X-Multi".into(), "a".into()),
                ("x-multi".into(), "b".into()),
            ],
            body: br#"{"ok":true,"n":[1,2]}"#.to_vec(),
        }
    });
    let relay = Relay::start();
    let worker = Worker::start(&relay.ws_url(), &[]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |c| {
        c["kinds"] == json!(["echo", "file", "http"]) && c["concurrency"] == 16
    });

    let task = relay.run_task(json!({"kind": "http", "spec": {
        "method": "post", "url": target.url("/things"),
        "headers": {"X-Trace": "t-1"}, "body": {"name": "widget"}}}));
    assert_eq!(task["status"], "done", "{task}");
    let result = &task["result"];
    assert_eq!(result["status_code"], 201, "{result}");
    assert_eq!(result["body"], json!({"ok": true, "n": [1, 2]}));
    assert_eq!(result["headers"]["x-multi"], "a, b");
    assert_eq!(result["headers"]["content-type"], "application/json; charset=utf-8");

    let hits = target.hits.lock().expect("hits").clone();
    assert_eq!(hits.len(), 1);
    assert_eq!((hits[0].method.as_str(), hits[0].path.as_str()), ("POST", "/things"));
    assert_eq!(hits[0].header("content-type"), Some("application/json"));
    assert_eq!(hits[0].header("x-trace"), Some("t-1"));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&hits[0].body).expect("json body"),
        json!({"name": "widget"})
    );
}

#[test]
fn non_2xx_is_done_and_bodies_are_text_or_base64() {
    crate::require_relay!();
    let target = Target::start(|req, _| match req.path.as_str() {
        "/missing" => Reply::new(404, &[("Content-Type", "text/plain")], "not here"),
        "/binary" => Reply::new(200, &[("Content-Type", "application/octet-stream")], vec![0xff, 0x00, 0x80]),
        "/echo" => Reply::new(200, &[], req.body.clone()),
        _ => Reply::new(500, &[], ""),
    });
    let relay = Relay::start();
    let worker = Worker::start(&relay.ws_url(), &[]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |_| true);

    let task = relay.run_task(json!({"kind": "http", "spec": {"url": target.url("/missing")}}));
    assert_eq!((task["status"].as_str(), &task["result"]["status_code"]), (Some("done"), &json!(404)), "{task}");
    assert_eq!(task["result"]["body"], "not here");

    let task = relay.run_task(json!({"kind": "http", "spec": {"url": target.url("/binary")}}));
    assert_eq!(task["result"]["body_base64"], "/wCA", "{task}");
    assert!(task["result"].get("body").is_none(), "{task}");

    let task = relay.run_task(json!({"kind": "http", "spec": {"method": "PUT", "url": target.url("/echo"),
        "headers": {"Content-Type": "text/csv"}, "body": "a,b\n1,2"}}));
    assert_eq!(task["result"]["body"], "a,b\n1,2", "{task}");
    let hits = target.hits.lock().expect("hits").clone();
    let echo = hits.iter().find(|r| r.path == "/echo").expect("echo request");
    assert_eq!((echo.method.as_str(), echo.header("content-type")), ("PUT", Some("text/csv")));

    let task = relay.run_task(json!({"kind": "http", "spec": {"method": "GET"}}));
    assert_eq!(task["status"], "failed");
    assert_eq!(task["error"], "spec.url is required");
}

/// The first attempt hits a connection that closes without an answer (a network error, so
/// `failed`); relay moves the task to the other worker, whose attempt is `done`.
#[test]
fn network_error_falls_back_to_second_worker() {
    crate::require_relay!();
    let target = Target::start(|_, i| if i == 0 { Reply::Hangup } else { Reply::json(200, &json!({"ok": 1})) });
    let relay = Relay::start();
    let a = Worker::start(&relay.ws_url(), &[]);
    let b = Worker::start(&relay.ws_url(), &[]);
    a.wait_connected();
    b.wait_connected();
    relay.wait_clients(2, Duration::from_secs(5), |c| c["concurrency"] == 16);

    let task = relay.run_task(json!({"kind": "http", "spec": {"url": target.url("/flaky")}}));
    assert_eq!(task["status"], "done", "{task}");
    let log = task["attempt_log"].as_array().expect("attempt_log");
    assert_eq!(log.len(), 2, "{task}");
    assert_eq!(log[0]["outcome"], "failed", "{task}");
    assert!(log[0]["error"].as_str().is_some_and(|e| !e.is_empty()), "{task}");
    assert_eq!(log[1]["outcome"], "done", "{task}");
    assert_ne!(log[0]["client_id"], log[1]["client_id"], "the retry ran on the other worker");
    assert_eq!(task["result"]["body"], json!({"ok": 1}));
    assert_eq!(target.hit_count(), 2);
}

#[test]
fn allow_hosts_blocks_other_hosts_and_redirects_to_them() {
    crate::require_relay!();
    let target = Target::start(|req, _| match req.path.as_str() {
        "/to-ip" => Reply::redirect(&format!(
            "http://127.0.0.1:{}/ok",
            req.header("host").and_then(|h| h.rsplit(':').next()).unwrap_or("1")
        )),
        _ => Reply::json(200, &json!({"ok": true})),
    });
    let port = target.addr.port();
    let relay = Relay::start();
    let allow = format!("LOCALHOST:{port}");
    let worker = Worker::start(&relay.ws_url(), &[("ALLOW_HOSTS", &allow)]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |_| true);

    // 127.0.0.1 is the same machine, but not the name that was allowed: no DNS games.
    let task = relay.run_task(json!({"kind": "http", "spec": {"url": format!("http://127.0.0.1:{port}/ok")}}));
    assert_eq!(task["status"], "failed", "{task}");
    assert_eq!(task["error"], format!("host 127.0.0.1:{port} not in ALLOW_HOSTS"));
    assert_eq!(target.hit_count(), 0, "nothing was sent to a host outside ALLOW_HOSTS");

    let task = relay.run_task(json!({"kind": "http", "spec": {"url": format!("http://localhost:{port}/ok")}}));
    assert_eq!(task["status"], "done", "{task}");
    assert_eq!(target.hit_count(), 1);

    // An allowed host redirecting to one that is not: failed, and the second host never sees it.
    let task = relay.run_task(json!({"kind": "http", "spec": {"url": format!("http://localhost:{port}/to-ip")}}));
    assert_eq!(task["status"], "failed", "{task}");
    assert!(task["error"].as_str().is_some_and(|e| e.contains("not in ALLOW_HOSTS")), "{task}");
    assert_eq!(target.paths(), ["/ok", "/to-ip"], "the redirect target was not contacted");
}

#[test]
fn redirects_are_followed_up_to_five() {
    crate::require_relay!();
    let target = Target::start(|req, _| {
        let n: u32 = req.path.trim_start_matches("/r/").parse().unwrap_or(0);
        if n == 0 { Reply::json(200, &json!({"landed": true})) } else { Reply::redirect(&format!("/r/{}", n - 1)) }
    });
    let relay = Relay::start();
    let worker = Worker::start(&relay.ws_url(), &[]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |_| true);

    let task = relay.run_task(json!({"kind": "http", "spec": {"url": target.url("/r/5")}}));
    assert_eq!(task["status"], "done", "{task}");
    assert_eq!(task["result"]["body"], json!({"landed": true}));
    assert_eq!(target.hit_count(), 6);

    let task = relay.run_task(json!({"kind": "http", "spec": {"url": target.url("/r/6")}}));
    assert_eq!(task["status"], "failed", "{task}");
    assert!(task["error"].as_str().is_some_and(|e| e.contains("too many redirects")), "{task}");
    assert_eq!(target.hit_count(), 6 + 6, "the 6th redirect's target (/r/0) was not requested");
    assert_eq!(target.paths().last().map(String::as_str), Some("/r/1"));
}

/// HTTP_TIMEOUT bounds the whole request: a target that answers too late is a `failed` task.
#[test]
fn slow_target_times_out_as_failed() {
    crate::require_relay!();
    let target = Target::start(|_, _| Reply::After(Duration::from_secs(3), Box::new(Reply::new(200, &[], "late"))));
    let relay = Relay::start();
    let worker = Worker::start(&relay.ws_url(), &[("HTTP_TIMEOUT", "300ms")]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |_| true);
    let started = std::time::Instant::now();
    let task = relay.run_task(json!({"kind": "http", "spec": {"url": target.url("/slow")}}));
    assert_eq!(task["status"], "failed", "{task}");
    assert!(task["error"].as_str().is_some_and(|e| e.contains("timed out")), "{task}");
    assert!(started.elapsed() < Duration::from_secs(2), "failed at the timeout, not when the target answered");
}

/// `spec.retry_on` (SPEC §13): a listed status is a failed attempt paced by the answer's
/// `Retry-After` — in seconds, or as an HTTP-date — so the retry comes no sooner.
#[test]
fn retry_on_statuses_fail_the_attempt_and_retry_after_paces_the_retry() {
    crate::require_relay!();
    let target = Target::start(|req, _| match req.path.as_str() {
        "/secs" => Reply::new(503, &[("Retry-After", "1")], "busy"),
        "/date" => {
            let at = relay_common::timefmt::wall_ms() / 1000 + 2;
            let date = String::from_utf8_lossy(&relay_common::timefmt::http_date(at)).into_owned();
            Reply::new(429, &[("Retry-After", date.as_str())], "slow down")
        }
        "/plain" => Reply::new(503, &[], "down"),
        _ => Reply::new(200, &[], "fine"),
    });
    let relay = Relay::start();
    let worker = Worker::start(&relay.ws_url(), &[]);
    worker.wait_connected();
    relay.wait_clients(1, Duration::from_secs(5), |_| true);
    let ms = |v: &serde_json::Value| relay_common::timefmt::parse_rfc3339_ms(v.as_str().expect("time")).expect("time");
    for (path, at_least) in [("/secs", 1_000), ("/date", 900)] {
        // One worker: the retry goes to it again (any_worker), once the upstream's wait is over.
        let body = json!({"payload": {"kind": "http", "spec": {"url": target.url(path), "retry_on": [429, 503]}},
                          "max_retries": 1, "retry": {"any_worker": true}});
        let (status, task) = relay.api("POST", "/tasks?wait=true", Some(&body.to_string()));
        assert_eq!(status, 502, "{task}");
        let log = task["attempt_log"].as_array().expect("log");
        assert_eq!(log.len(), 2, "{task}");
        assert!(log[0]["error"].as_str().is_some_and(|e| e.contains("spec.retry_on")), "{task}");
        let end = ms(&log[0]["started_at"]) + log[0]["duration_ms"].as_u64().expect("ms");
        let gap = ms(&log[1]["started_at"]).saturating_sub(end);
        assert!(gap + 10 >= at_least && gap < at_least + 2_500, "{path}: the retry came {gap} ms later: {task}");
    }
    // Without Retry-After the listed status still fails the attempt; unlisted ones are done.
    let body = json!({"payload": {"kind": "http", "spec": {"url": target.url("/plain"), "retry_on": [503]}},
                      "max_retries": 0});
    let (status, task) = relay.api("POST", "/tasks?wait=true", Some(&body.to_string()));
    assert_eq!((status, task["error"].as_str()), (502, Some("HTTP 503 (spec.retry_on)")), "{task}");
    let task = relay.run_task(json!({"kind": "http", "spec": {"url": target.url("/plain"), "retry_on": [429]}}));
    assert_eq!((task["status"].as_str(), &task["result"]["status_code"]), (Some("done"), &json!(503)), "{task}");
}
