//! The worker side of relay's WebSocket protocol (docs/protocol.md): parsing what
//! relay sends and building what the worker answers. Pure: text in, values out, no I/O.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

/// A message from relay, as the worker acts on it.
#[derive(Debug)]
pub enum ServerMsg {
    Task(Task),
    Cancel {
        task_id: String,
    },
    /// relay's answer to a hello with a `worker_id` (SPEC §12).
    Welcome(Welcome),
    /// relay asks the worker to reconnect now (it is restarting).
    Reconnect,
    /// Valid JSON the worker does not act on (a future message type).
    Other(String),
}

#[derive(Debug)]
pub struct Task {
    pub task_id: String,
    /// `payload.kind`; `None` when the payload is not an object or has no string kind.
    pub kind: Option<String>,
    /// `payload.spec`, or `null` when absent.
    pub spec: Box<RawValue>,
    /// Why this task cannot be run though relay routed it (a payload with two `spec` fields).
    pub invalid: Option<String>,
    /// The attempt number a session's task frames carry (its result echoes it).
    pub attempt: Option<u64>,
}

/// A `welcome`: the session's secret, and what relay adopted or wants stopped.
#[derive(Debug, Deserialize)]
pub struct Welcome {
    #[serde(default)]
    pub client_id: String,
    pub session: String,
    #[serde(default)]
    pub resume_window_ms: u64,
    #[serde(default)]
    pub adopted: Vec<String>,
    #[serde(default)]
    pub abandon: Vec<String>,
}

#[derive(Deserialize)]
struct Envelope {
    #[serde(rename = "type")]
    kind: String,
    task_id: Option<String>,
    payload: Option<Box<RawValue>>,
    #[serde(default)]
    attempt: Option<u64>,
}

/// The payload's `kind`, read as relay reads it: only that field (others, repeated or not,
/// are skipped), so the worker and relay always agree on a task's kind.
#[derive(Deserialize)]
struct KindProbe {
    kind: Option<Value>,
}

/// The payload's `spec`, read on its own for the same reason.
#[derive(Deserialize)]
struct SpecProbe {
    spec: Option<Box<RawValue>>,
}

/// Parses one text frame from relay.
pub fn parse_server_msg(text: &str) -> Result<ServerMsg, String> {
    let env: Envelope = serde_json::from_str(text).map_err(|e| format!("not a relay message: {e}"))?;
    match env.kind.as_str() {
        "task" => {
            let task_id = env.task_id.filter(|id| !id.is_empty()).ok_or("task without task_id")?;
            // Only an object has a kind (serde would read an array positionally). Not an object
            // (relay accepts any JSON payload): no kind, no spec.
            let object = env.payload.as_deref().filter(|p| p.get().trim_start().starts_with('{'));
            let kind = object
                .and_then(|p| serde_json::from_str::<KindProbe>(p.get()).ok())
                .and_then(|p| p.kind)
                .and_then(|k| k.as_str().map(str::to_string));
            let (spec, invalid) = match object.map(|p| serde_json::from_str::<SpecProbe>(p.get())) {
                Some(Ok(p)) => (p.spec, None),
                Some(Err(e)) => (None, Some(format!("invalid payload: {e}"))),
                None => (None, None),
            };
            let attempt = env.attempt;
            Ok(ServerMsg::Task(Task { task_id, kind, spec: spec.unwrap_or_else(null_raw), invalid, attempt }))
        }
        "cancel" => {
            let task_id = env.task_id.ok_or("cancel without task_id")?;
            Ok(ServerMsg::Cancel { task_id })
        }
        "welcome" => {
            let w: Welcome = serde_json::from_str(text).map_err(|e| format!("malformed welcome: {e}"))?;
            Ok(ServerMsg::Welcome(w))
        }
        "reconnect" => Ok(ServerMsg::Reconnect),
        other => Ok(ServerMsg::Other(other.to_string())),
    }
}

pub fn null_raw() -> Box<RawValue> {
    RawValue::from_string("null".into()).unwrap_or_else(|_| unreachable!("null is valid JSON"))
}

/// `hello`: kinds (sorted), concurrency (0 = draining), version; with a session (SPEC §12):
/// the worker id, the secret of the last welcome, and the tasks it still runs or holds a
/// result of (task id, attempt).
pub fn hello(kinds: &[String], concurrency: usize, session: Option<SessionHello<'_>>) -> String {
    let mut v = json!({
        "type": "hello",
        "kinds": kinds,
        "concurrency": concurrency,
        "version": concat!("relay-worker/", env!("CARGO_PKG_VERSION")),
    });
    if let Some(s) = session {
        v["worker_id"] = json!(s.worker_id);
        if let Some(secret) = s.secret {
            v["session"] = json!(secret);
        }
        if let Some(running) = s.running {
            v["running"] = running
                .iter()
                .map(|(id, attempt)| match attempt {
                    Some(a) => json!({"task_id": id, "attempt": a}),
                    None => json!({"task_id": id}),
                })
                .collect();
        }
    }
    v.to_string()
}

/// The session part of a hello.
pub struct SessionHello<'a> {
    pub worker_id: &'a str,
    pub secret: Option<&'a str>,
    /// `None`: not said (a later hello on the same connection).
    pub running: Option<&'a [(String, Option<u64>)]>,
}

/// A result message. A `done` result that would exceed `max_message_bytes` becomes a `failed`
/// one saying so: relay closes a socket that sends an oversized message (1009), which would
/// take every other task on the connection down with it.
#[cfg(test)]
pub fn result(task_id: &str, outcome: &Result<Value, String>, max_message_bytes: usize) -> String {
    result_of(task_id, None, outcome, max_message_bytes)
}

/// The result message, echoing the task frame's `attempt` (a session's: relay then accepts it only for
/// that attempt).
pub fn result_of(
    task_id: &str,
    attempt: Option<u64>,
    outcome: &Result<Value, String>,
    max_message_bytes: usize,
) -> String {
    result_with(task_id, attempt, outcome, crate::RetryHint::default(), max_message_bytes)
}

/// [`result_of`], a failure carrying what it says about its retry (`retry: false`,
/// `retry_after_ms`, SPEC §13).
pub fn result_with(
    task_id: &str,
    attempt: Option<u64>,
    outcome: &Result<Value, String>,
    hint: crate::RetryHint,
    max_message_bytes: usize,
) -> String {
    let mut v = match outcome {
        Ok(data) => json!({"type": "result", "task_id": task_id, "status": "done", "data": data}),
        Err(error) => {
            let mut v = failed(task_id, error);
            if hint.permanent {
                v["retry"] = json!(false);
            }
            if let Some(ms) = hint.after_ms {
                v["retry_after_ms"] = json!(ms);
            }
            v
        }
    };
    if let Some(a) = attempt {
        v["attempt"] = json!(a);
    }
    let text = v.to_string();
    if text.len() <= max_message_bytes {
        return text;
    }
    let error = format!("result too large: {} bytes (MAX_MESSAGE_SIZE is {max_message_bytes})", text.len());
    let mut v = failed(task_id, &error);
    if let Some(a) = attempt {
        v["attempt"] = json!(a);
    }
    v.to_string()
}

fn failed(task_id: &str, error: &str) -> Value {
    // An error text is ours or a handler's; cut it so the message always fits.
    let error = truncate(error, 4096);
    json!({"type": "result", "task_id": task_id, "status": "failed", "error": error})
}

fn truncate(text: &str, max_bytes: usize) -> &str {
    if text.len() <= max_bytes {
        return text;
    }
    let mut end = max_bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ("task", id, kind, spec) / ("cancel", id, None, "") / ("other", type, None, "") / ("err", "", None, "").
    type Expected<'a> = (&'a str, &'a str, Option<&'a str>, &'a str);

    fn check(text: &str, expected: Expected) {
        let got = match parse_server_msg(text) {
            Ok(ServerMsg::Task(t)) => ("task", t.task_id, t.kind, t.spec.get().to_string()),
            Ok(ServerMsg::Cancel { task_id }) => ("cancel", task_id, None, String::new()),
            Ok(ServerMsg::Other(t)) => ("other", t, None, String::new()),
            Ok(ServerMsg::Welcome(w)) => ("welcome", w.session, None, w.adopted.join(",")),
            Ok(ServerMsg::Reconnect) => ("reconnect", String::new(), None, String::new()),
            Err(_) => ("err", String::new(), None, String::new()),
        };
        let got = (got.0, got.1.as_str(), got.2.as_deref(), got.3.as_str());
        assert_eq!(got, expected, "{text}");
    }

    #[test]
    fn parsing() {
        let table: &[(&str, Expected)] = &[
            (
                r#"{"type":"task","task_id":"t1","payload":{"kind":"http","spec":{"url":"x"}}}"#,
                ("task", "t1", Some("http"), r#"{"url":"x"}"#),
            ),
            (r#"{"type":"task","task_id":"t2","payload":{"kind":"echo"}}"#, ("task", "t2", Some("echo"), "null")),
            (r#"{"type":"task","task_id":"t3","payload":[1,2]}"#, ("task", "t3", None, "null")),
            (r#"{"type":"task","task_id":"t4","payload":{"kind":7}}"#, ("task", "t4", None, "null")),
            (r#"{"type":"task","task_id":"t5","payload":{"kind":"a\"b"}}"#, ("task", "t5", Some("a\"b"), "null")),
            (r#"{"type":"task","payload":{}}"#, ("err", "", None, "")),
            (r#"{"type":"task","task_id":"","payload":{}}"#, ("err", "", None, "")),
            (r#"{"type":"cancel","task_id":"t1"}"#, ("cancel", "t1", None, "")),
            (r#"{"type":"welcome","client_id":"c","session":"s","adopted":["a","b"]}"#, ("welcome", "s", None, "a,b")),
            (r#"{"type":"welcome","client_id":"c"}"#, ("err", "", None, "")),
            (r#"{"type":"reconnect"}"#, ("reconnect", "", None, "")),
            (r#"{"type":"cancel"}"#, ("err", "", None, "")),
            (r#"{"type":"welcome","x":1}"#, ("err", "", None, "")),
            (r#"{"task_id":"t1"}"#, ("err", "", None, "")),
            ("not json", ("err", "", None, "")),
            // Regression (found by the worker_protocol fuzz target): relay routes by `kind`
            // alone, so a repeated `spec` must not hide the kind from the worker.
            (
                r#"{"type":"task","task_id":"t6","payload":{"kind":"http","spec":1,"spec":2}}"#,
                ("task", "t6", Some("http"), "null"),
            ),
            (r#"{"type":"task","task_id":"t7","payload":{"x":1,"x":2,"kind":"k"}}"#, ("task", "t7", Some("k"), "null")),
        ];
        for (text, expected) in table {
            check(text, *expected);
        }
    }

    #[test]
    fn a_payload_with_two_specs_keeps_its_kind_and_says_what_is_wrong() {
        let text = r#"{"type":"task","task_id":"t","payload":{"kind":"http","spec":1,"spec":2}}"#;
        let Ok(ServerMsg::Task(task)) = parse_server_msg(text) else { panic!("a task") };
        assert_eq!(task.kind.as_deref(), Some("http"));
        assert!(task.invalid.as_deref().is_some_and(|e| e.contains("duplicate field `spec`")), "{:?}", task.invalid);
        let text = r#"{"type":"task","task_id":"t","payload":{"kind":"http","spec":1}}"#;
        let Ok(ServerMsg::Task(task)) = parse_server_msg(text) else { panic!("a task") };
        assert_eq!(task.invalid, None);
    }

    #[test]
    fn results_fit_the_limit() {
        let ok = result("t", &Ok(json!({"a": 1})), 1024);
        assert_eq!(ok, r#"{"data":{"a":1},"status":"done","task_id":"t","type":"result"}"#);
        let big = result("t", &Ok(json!("x".repeat(2000))), 1024);
        let v: Value = serde_json::from_str(&big).expect("json");
        assert_eq!(v["status"], "failed");
        assert!(v["error"].as_str().is_some_and(|e| e.starts_with("result too large")), "{v}");
        let paced =
            result_with("t", None, &Err("503".into()), crate::RetryHint { permanent: false, after_ms: Some(7) }, 1024);
        let v: Value = serde_json::from_str(&paced).expect("json");
        assert_eq!((v["retry_after_ms"].as_u64(), v.get("retry")), (Some(7), None));
        let permanent =
            result_with("t", None, &Err("no".into()), crate::RetryHint { permanent: true, after_ms: None }, 1024);
        let v: Value = serde_json::from_str(&permanent).expect("json");
        assert_eq!(v["retry"], false);
        let long_error = result("t", &Err("é".repeat(5000)), 1_000_000);
        let v: Value = serde_json::from_str(&long_error).expect("json");
        assert_eq!(v["error"].as_str().map(str::len), Some(4096));
        let h: Value = serde_json::from_str(&hello(&["file".into(), "http".into()], 0, None)).expect("json");
        assert_eq!(h["concurrency"], 0);
        assert_eq!(h["kinds"], json!(["file", "http"]));
        assert!(h.get("worker_id").is_none());
        let running = [("t1".to_string(), Some(2)), ("t2".to_string(), None)];
        let s = SessionHello { worker_id: "w", secret: Some("sec"), running: Some(&running) };
        let h: Value = serde_json::from_str(&hello(&[], 4, Some(s))).expect("json");
        assert_eq!((h["worker_id"].clone(), h["session"].clone()), (json!("w"), json!("sec")));
        assert_eq!(h["running"], json!([{"task_id": "t1", "attempt": 2}, {"task_id": "t2"}]));
        let r: Value = serde_json::from_str(&result_of("t", Some(5), &Ok(json!(1)), 1024)).expect("json");
        assert_eq!((r["attempt"].clone(), r["status"].clone()), (json!(5), json!("done")));
    }
}
