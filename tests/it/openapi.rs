//! `docs/openapi.yaml` is true: schemathesis (PyPI) fuzzes a live relay, with a fast worker
//! connected, from the document, and fails on any 5xx, any response (status, content type,
//! headers, body) the document does not describe, any accepted request the document says is
//! invalid, and any crash. Bounded: a fixed number of examples per operation and a deadline.
//! With `CI=true` a missing schemathesis fails the test; otherwise it is skipped, loudly.
//!
//! Single-node only: one schemathesis run takes most of a minute on two cores, and a cluster
//! node answers through the same task JSON, error and route writers (`api.rs`, `tasks.rs`).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::browser::artifacts_dir;
use crate::support::*;

/// Checks that do not apply to this API, each with its reason.
const EXCLUDED_CHECKS: &[&str] = &[
    // DELETE /tasks/{id} cancels; the task stays readable (200, status canceled) by design.
    "use_after_free",
    // The document cannot express every limit (positive durations, timeout ≤ 24h, delay ≤ 366
    // days, kind ≤ 128 *bytes*, delay XOR run_at), and a valid submit may be 503/429 by state:
    // schema-valid data is not always acceptable. Every answer must still be documented.
    "positive_data_acceptance",
];

const DEADLINE: Duration = Duration::from_secs(120);

#[test]
fn schemathesis_finds_nothing_the_document_does_not_allow() {
    let name = "openapi::schemathesis_finds_nothing_the_document_does_not_allow";
    if Command::new("schemathesis").arg("--version").stdout(Stdio::null()).status().map_or(true, |s| !s.success()) {
        return skip_or_fail(name, "schemathesis is not installed (pip install schemathesis)");
    }
    // The worker must outlive schemathesis's start, however cold: see STEADY_HEARTBEAT.
    let relay = Relay::start_with(
        &[
            &[("WAIT_TIMEOUT", "1s"), ("TASK_TIMEOUT", "1s"), ("MAX_FILE_SIZE", "65536"), ("LOG_LEVEL", "info")],
            STEADY_HEARTBEAT,
        ]
        .concat(),
    );
    let worker = FakeWorker::connect(&relay, Some(serde_json::json!({"type": "hello", "concurrency": 64})), Auto::Echo);
    relay.wait_clients(1, |c| c["concurrency"] == 64);

    let doc = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/openapi.yaml");
    let report = artifacts_dir().join("schemathesis");
    std::fs::create_dir_all(&report).expect("report dir");
    let seed = std::env::var("SCHEMATHESIS_SEED").unwrap_or_else(|_| "20261201".into());
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/schemathesis/schemathesis.toml");
    let mut cmd = Command::new("schemathesis");
    cmd.arg("--config-file").arg(&config).env("RELAY_API_TOKEN", API);
    cmd.arg("run")
        .arg(&doc)
        .args(["--url", &format!("http://{}", relay.addr)])
        .args(["--checks", "all", "--exclude-checks", &EXCLUDED_CHECKS.join(",")])
        .args(["--phases", "examples,coverage,fuzzing,stateful"])
        .args(["--max-examples", "40", "--seed", &seed, "--workers", "1", "--request-timeout", "10"])
        .args(["--max-failures", "50", "--suppress-health-check", "all", "--no-color"])
        .arg("--report-dir")
        .arg(&report)
        .args(["--report", "junit"]);
    let log_path = report.join("schemathesis.log");
    let out = std::fs::File::create(&log_path).expect("log");
    let err = out.try_clone().expect("log");
    // Its caches (.schemathesis/, .hypothesis/) go with the report, not into the source tree.
    cmd.current_dir(&report);
    // Repeated Idempotency-Keys are answered before the body is read (SPEC §4); the hooks make
    // each valid generated key unique so every request is judged on its own.
    let hooks = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/schemathesis");
    cmd.env("SCHEMATHESIS_HOOKS", "relay_hooks").env("PYTHONPATH", hooks);
    let mut child = cmd.env("NO_COLOR", "1").stdin(Stdio::null()).stdout(out).stderr(err).spawn().expect("spawn");
    let deadline = Instant::now() + DEADLINE;
    let mut lost = None;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        // Without its worker every submit answers 503 no_worker: report that, with relay's
        // reason, instead of what schemathesis makes of it.
        if worker.is_closed() {
            lost = Some(worker_losses(&relay.log_text()));
        }
        if Instant::now() > deadline || lost.is_some() {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    eprintln!("{log}");
    if let Some(why) = lost {
        panic!("the worker was disconnected while schemathesis ran:\n{why}");
    }
    assert!(status.is_some(), "schemathesis did not finish within {DEADLINE:?}");
    assert!(status.is_some_and(|s| s.success()), "schemathesis found problems (log: {})", log_path.display());
    // relay itself must still be alive and well after the run.
    let health = request(relay.addr, "GET", "/healthz", &[], None);
    assert_eq!(health.status, 200);
    assert!(!relay.log_text().contains("panicked"), "relay panicked:\n{}", relay.log_text());
}
