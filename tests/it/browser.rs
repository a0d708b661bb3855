//! The dashboard in a real browser: Debian's Chromium driven by playwright-core
//! (`tests/browser/dashboard.mjs`) against the real relay with two scripted workers. Needs
//! `/usr/bin/chromium`, `node` and `npm ci` in `tests/browser`; `.ci/run` installs them. With
//! `CI=true` a missing tool fails the test; otherwise it is skipped, loudly.
//!
//! Single-node only: the page is the same static `/ui` over the same API in both modes, and
//! one Chromium run is the suite's slowest start.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::*;

const CHROMIUM: &str = "/usr/bin/chromium";

fn browser_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser")
}

pub fn artifacts_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("test-artifacts")
}

fn missing_browser_tools() -> Option<String> {
    if !Path::new(CHROMIUM).exists() {
        return Some(format!("{CHROMIUM} is not installed (apt-get install chromium)"));
    }
    if Command::new("node").arg("--version").stdout(Stdio::null()).status().map_or(true, |s| !s.success()) {
        return Some("node is not installed".into());
    }
    if !browser_dir().join("node_modules/playwright-core/package.json").exists() {
        return Some("tests/browser/node_modules is missing (npm ci --prefix tests/browser)".into());
    }
    None
}

#[test]
fn dashboard_in_chromium_shows_workers_attempts_and_runs_no_payload() {
    let name = "browser::dashboard_in_chromium_shows_workers_attempts_and_runs_no_payload";
    if let Some(why) = missing_browser_tools() {
        return skip_or_fail(name, &why);
    }
    let relay = Relay::start_with(&[&[("TASK_TIMEOUT", "5s")], STEADY_HEARTBEAT].concat());
    let hello = |v: &str| Some(json!({"type": "hello", "concurrency": 8, "version": v}));
    let flaky =
        FakeWorker::connect(&relay, hello("scripted-flaky/1"), Auto::Fail("upstream refused the connection".into()));
    let good = FakeWorker::connect(&relay, hello("scripted-echo/1"), Auto::Echo);
    relay.wait_clients(2, |c| c["version"].is_string());
    let workers: Vec<String> = relay.clients()["clients"]
        .as_array()
        .expect("clients")
        .iter()
        .map(|c| c["client_id"].as_str().expect("client_id").to_string())
        .collect();

    // Round-robin alternates: one of two consecutive tasks starts on the flaky worker.
    let mut fallback = None;
    for _ in 0..4 {
        let r = relay.submit(r#"{"payload":{"kind":"fetch","spec":{"url":"https://example.invalid/"}}}"#);
        assert_eq!(r.status, 202, "{}", r.text());
        let id = r.json()["task_id"].as_str().expect("task_id").to_string();
        let t = relay.wait_status(&id, "done", Duration::from_secs(5));
        if t["attempts"] == 2 {
            fallback = Some(id);
            break;
        }
    }
    let fallback = fallback.expect("a task that failed on its first worker and was done on the second");
    let hostile = json!({"payload": {
        "kind": "<img src=x onerror=window.__xss=1>",
        "note": "<script>window.__xss=2</script><img src=x onerror=\"window.__xss=3;alert(3)\">",
    }});
    let r = relay.submit(&hostile.to_string());
    assert_eq!(r.status, 202, "{}", r.text());
    let xss = r.json()["task_id"].as_str().expect("task_id").to_string();
    relay.wait_status(&xss, "done", Duration::from_secs(5));
    // A few more done before the page opens, for the chart's first buckets: after relay's first
    // two seconds (the chart counts from its uptime in whole seconds, and the tasks above may
    // all have finished in the first one — a fallback found at the first try leaves only two).
    let settled = poll_until(Duration::from_secs(10), || {
        request(relay.addr, "GET", "/healthz", &[], None).json()["uptime_s"].as_u64().is_some_and(|s| s >= 2)
    });
    assert!(settled, "relay's uptime never reached 2 s");
    for i in 0..3 {
        let r = relay.submit(&format!(r#"{{"payload":{{"kind":"seed","i":{i}}}}}"#));
        assert_eq!(r.status, 202, "{}", r.text());
        let id = r.json()["task_id"].as_str().expect("task_id").to_string();
        relay.wait_status(&id, "done", Duration::from_secs(5));
    }
    // A failed task, for the Retry buttons: without retries, one of two lands on the flaky worker.
    let mut failed = None;
    for _ in 0..4 {
        let r = relay.api("POST", "/tasks?wait=true", Some(r#"{"payload":{"kind":"fetch"},"max_retries":0}"#));
        if r.status == 502 {
            failed = r.json()["task_id"].as_str().map(str::to_string);
            break;
        }
    }
    let failed = failed.expect("a task that failed");
    let r = relay.submit(r#"{"payload":{"kind":"report","note":"<img src=x onerror=window.__xss=3>"},"delay":"1h"}"#);
    let delayed = r.json()["task_id"].as_str().expect("task_id").to_string();
    // The chart fills in what finished before the page opened, in 2 s steps back to relay's
    // start: give it a few of those.
    let up = poll_until(Duration::from_secs(10), || {
        request(relay.addr, "GET", "/healthz", &[], None).json()["uptime_s"].as_u64().is_some_and(|s| s >= 5)
    });
    assert!(up, "relay's uptime never reached 5 s");

    let artifacts = artifacts_dir();
    std::fs::create_dir_all(&artifacts).expect("artifacts dir");
    let user_data = std::env::temp_dir().join(format!("relay-chromium-{}", uuid::Uuid::new_v4().simple()));
    let out = std::fs::File::create(artifacts.join("browser.log")).expect("log file");
    let err = out.try_clone().expect("log file");
    let mut node = Command::new("node")
        .arg("dashboard.mjs")
        .current_dir(browser_dir())
        .env("RELAY_URL", format!("http://{}", relay.addr))
        .env("API_TOKEN", API)
        .env("WORKERS", workers.join(","))
        .env("FALLBACK_TASK", &fallback)
        .env("XSS_TASK", &xss)
        .env("DELAYED_TASK", &delayed)
        .env("FAILED_TASK", &failed)
        .env("ARTIFACTS", &artifacts)
        .env("USER_DATA_DIR", &user_data)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("spawn node");

    // Traffic for the live chart while the browser looks (bounded by the deadline).
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut n = 0u32;
    let mut lost = None;
    let status = loop {
        if let Some(status) = node.try_wait().expect("wait node") {
            break Some(status);
        }
        // Everything the page is checked on needs both workers: a lost one is the failure to
        // report, with relay's reason, rather than whatever the page shows without it.
        if (flaky.is_closed() || good.is_closed()) && lost.is_none() {
            lost = Some(worker_losses(&relay.log_text()));
        }
        if Instant::now() > deadline || lost.is_some() {
            let _ = node.kill();
            let _ = node.wait();
            break None;
        }
        // Some with no retry, so the flaky worker fails a few for good.
        let retries = if n.is_multiple_of(3) { 0 } else { 2 };
        relay.submit(&format!(r#"{{"payload":{{"kind":"load","n":{n}}},"max_retries":{retries}}}"#));
        n += 1;
        std::thread::sleep(Duration::from_millis(150));
    };
    let _ = std::fs::remove_dir_all(&user_data);
    let log = std::fs::read_to_string(artifacts.join("browser.log")).unwrap_or_default();
    eprintln!("{log}");
    if let Some(why) = lost {
        panic!("a worker was disconnected while the browser ran:\n{why}");
    }
    assert!(status.is_some(), "the browser test did not finish within 180 s");
    assert!(status.is_some_and(|s| s.success()), "the browser test failed (artefacts in {})", artifacts.display());
    assert!(artifacts.join("dashboard.png").exists(), "screenshot written");
    assert!(
        !flaky.is_closed() && !good.is_closed(),
        "both workers stayed connected: {}",
        worker_losses(&relay.log_text())
    );
    eprintln!("screenshots: {}", artifacts.display());
    drop((flaky, good));
}
