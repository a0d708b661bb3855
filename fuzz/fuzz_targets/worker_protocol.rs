//! What relay sends a worker, as the worker parses it (relay_worker's parse_server_msg): never
//! a panic, whatever the text; a task has a non-empty id and a spec that is JSON. And for every
//! payload relay accepts (api::parse_submit), the task message relay writes for it parses back
//! in the worker with the task id, relay's own routing kind, and the payload's `spec`.
#![no_main]
use libfuzzer_sys::fuzz_target;
use relay_worker::fuzzing::{ServerMsg, parse_server_msg};
use serde::Deserialize;
use serde_json::value::RawValue;

const ID: &str = "0b9d2f7e-8f7e-4a63-9a1c-2d4c6f1e0a11";

/// The payload's `spec`, read the way relay reads `kind` (only that field, others skipped).
#[derive(Deserialize)]
struct SpecProbe<'a> {
    #[serde(borrow, default)]
    spec: Option<&'a RawValue>,
}

fn json(raw: &str) -> serde_json::Value {
    serde_json::from_str(raw).unwrap_or_else(|e| panic!("not JSON ({e}): {raw:?}"))
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(ServerMsg::Task(task)) = parse_server_msg(text) {
        assert!(!task.task_id.is_empty());
        json(task.spec.get());
    }

    // The text as the payload of a submit; relay's message for it, as dispatch writes it.
    let body = format!("{{\"payload\":{text}}}");
    let Ok(submit) = relay::api::parse_submit(body.as_bytes(), 0) else { return };
    let payload = submit.payload.get();
    let message = format!("{{\"type\":\"task\",\"task_id\":\"{ID}\",\"payload\":{payload}}}");
    let task = match parse_server_msg(&message) {
        Ok(ServerMsg::Task(task)) => task,
        other => panic!("relay's message {message:?} parsed as {other:?}"),
    };
    assert_eq!(task.task_id, ID);
    assert_eq!(task.kind.as_deref(), submit.kind.as_deref(), "relay routes {payload} by another kind");
    if payload.starts_with('{')
        && let Ok(probe) = serde_json::from_str::<SpecProbe>(payload)
    {
        let expected = probe.spec.map_or(serde_json::Value::Null, |s| json(s.get()));
        assert_eq!(json(task.spec.get()), expected, "spec of {payload}");
    }
});
