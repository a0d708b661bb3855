//! A task, its attempts, its states, and its JSON view. No I/O, no clock: times are passed in.
//!
//! Status changes are made only by `dispatch::Core` (one place, so a journal record can be
//! emitted there); this module defines the data and how it reads.

use std::net::IpAddr;

use serde_json::value::RawValue;

use crate::timefmt::write_rfc3339_ms;
use crate::timer::TimerHandle;

pub type TaskId = u128;

/// A connection's identity: its slot and the slot's generation when it was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnRef {
    pub slot: u32,
    pub generation: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Pending,
    Dispatched,
    Done,
    Failed,
    Canceled,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Dispatched => "dispatched",
            Status::Done => "done",
            Status::Failed => "failed",
            Status::Canceled => "canceled",
        }
    }

    pub fn is_final(self) -> bool {
        matches!(self, Status::Done | Status::Failed | Status::Canceled)
    }

    pub const COUNT: usize = 5;

    pub fn index(self) -> usize {
        self as usize
    }
}

/// How one attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Done,
    Failed,
    Timeout,
    Disconnect,
    SendFailed,
    Canceled,
}

impl Outcome {
    pub const COUNT: usize = 6;
    pub const ALL: [Outcome; Outcome::COUNT] =
        [Outcome::Done, Outcome::Failed, Outcome::Timeout, Outcome::Disconnect, Outcome::SendFailed, Outcome::Canceled];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Done => "done",
            Outcome::Failed => "failed",
            Outcome::Timeout => "timeout",
            Outcome::Disconnect => "disconnect",
            Outcome::SendFailed => "send_failed",
            Outcome::Canceled => "canceled",
        }
    }
}

#[derive(Debug)]
pub struct Attempt {
    pub worker: ConnRef,
    pub client_id: u128,
    pub client_ip: IpAddr,
    pub started_wall_ms: u64,
    pub started_mono_ms: u64,
    pub outcome: Option<Outcome>,
    pub error: Option<Box<str>>,
    pub duration_ms: u64,
    /// The worker sent a result for this attempt (a second one is a duplicate).
    pub answered: bool,
}

/// Where a pending task waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Not in a queue (dispatched, final, or being moved).
    Nowhere,
    /// Due, waiting for a worker with capacity.
    Ready,
    /// Waiting for its `run_at`.
    Scheduled,
}

#[derive(Debug)]
pub struct Task {
    pub id: TaskId,
    pub status: Status,
    pub kind: Option<Box<str>>,
    pub payload: Box<RawValue>,
    pub created_wall_ms: u64,
    pub created_mono_ms: u64,
    /// Set for tasks submitted with `delay`/`run_at`.
    pub run_at_wall_ms: Option<u64>,
    /// When the task became (or becomes) due, on the monotonic clock.
    pub due_mono_ms: u64,
    pub finished_wall_ms: Option<u64>,
    pub result: Option<Box<RawValue>>,
    pub error: Option<Box<str>>,
    pub attempts: Vec<Attempt>,
    pub max_retries: u32,
    pub timeout_ms: u64,
    /// Position in the pending queues (due order, then submission order).
    pub seq: u64,
    /// Which pending queue holds the task, if any.
    pub place: Place,
    pub attempt_timer: Option<TimerHandle>,
    /// HTTP connections blocked in `wait=true` on this task.
    pub waiters: Vec<ConnRef>,
}

impl Task {
    pub fn current_attempt(&self) -> Option<&Attempt> {
        self.attempts.last()
    }

    pub fn tried(&self, client_id: u128) -> bool {
        self.attempts.iter().any(|a| a.client_id == client_id)
    }

    /// The last error among finished attempts (the task's error when it fails).
    pub fn last_error(&self) -> Option<&str> {
        self.attempts.iter().rev().find_map(|a| a.error.as_deref())
    }

    /// Appends the task JSON of SPEC §4 to `out`.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        let mut s = String::with_capacity(256);
        s.push_str("{\"task_id\":\"");
        push_uuid(&mut s, self.id);
        s.push_str("\",\"status\":\"");
        s.push_str(self.status.as_str());
        s.push('"');
        if let Some(kind) = &self.kind {
            s.push_str(",\"kind\":");
            push_json_str(&mut s, kind);
        }
        push_time(&mut s, "created_at", Some(self.created_wall_ms));
        push_time(&mut s, "run_at", self.run_at_wall_ms);
        push_time(&mut s, "finished_at", self.finished_wall_ms);
        if self.status == Status::Done {
            s.push_str(",\"result\":");
            s.push_str(self.result.as_deref().map_or("null", RawValue::get));
        }
        if let Some(error) = &self.error {
            s.push_str(",\"error\":");
            push_json_str(&mut s, error);
        }
        if matches!(self.status, Status::Done | Status::Failed)
            && let Some(last) = self.attempts.last()
        {
            s.push_str(",\"client_id\":\"");
            push_uuid(&mut s, last.client_id);
            s.push_str("\",\"client_ip\":\"");
            s.push_str(&last.client_ip.to_string());
            s.push('"');
        }
        s.push_str(",\"attempts\":");
        s.push_str(&self.attempts.len().to_string());
        s.push_str(",\"attempt_log\":[");
        for (i, a) in self.attempts.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            s.push_str("{\"num\":");
            s.push_str(&(i + 1).to_string());
            s.push_str(",\"client_id\":\"");
            push_uuid(&mut s, a.client_id);
            s.push_str("\",\"client_ip\":\"");
            s.push_str(&a.client_ip.to_string());
            s.push('"');
            if let Some(outcome) = a.outcome {
                s.push_str(",\"outcome\":\"");
                s.push_str(outcome.as_str());
                s.push('"');
            }
            if let Some(error) = &a.error {
                s.push_str(",\"error\":");
                push_json_str(&mut s, error);
            }
            push_time(&mut s, "started_at", Some(a.started_wall_ms));
            if a.outcome.is_some() {
                s.push_str(",\"duration_ms\":");
                s.push_str(&a.duration_ms.to_string());
            }
            s.push('}');
        }
        s.push_str("]}");
        out.extend_from_slice(s.as_bytes());
    }
}

pub fn push_uuid(s: &mut String, id: u128) {
    let mut buf = uuid::Uuid::encode_buffer();
    s.push_str(uuid::Uuid::from_u128(id).hyphenated().encode_lower(&mut buf));
}

pub fn uuid_string(id: u128) -> String {
    let mut s = String::with_capacity(36);
    push_uuid(&mut s, id);
    s
}

/// Parses a task id from a path segment; anything but a UUID is `None` (→ 404).
pub fn parse_id(text: &str) -> Option<TaskId> {
    if text.len() != 36 && text.len() != 32 {
        return None;
    }
    uuid::Uuid::try_parse(text).ok().map(|u| u.as_u128())
}

pub fn push_json_str(s: &mut String, text: &str) {
    // serde_json escapes exactly as JSON requires; writing into a String cannot fail.
    if let Ok(quoted) = serde_json::to_string(text) {
        s.push_str(&quoted);
    }
}

fn push_time(s: &mut String, key: &str, ms: Option<u64>) {
    if let Some(ms) = ms {
        s.push_str(",\"");
        s.push_str(key);
        s.push_str("\":\"");
        write_rfc3339_ms(s, ms);
        s.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(status: Status) -> Task {
        Task {
            id: 0x0123_4567_89ab_cdef_0123_4567_89ab_cdef,
            status,
            kind: Some("http".into()),
            payload: RawValue::from_string("{\"kind\":\"http\"}".into()).expect("raw"),
            created_wall_ms: 0,
            created_mono_ms: 0,
            run_at_wall_ms: None,
            due_mono_ms: 0,
            finished_wall_ms: None,
            result: None,
            error: None,
            attempts: Vec::new(),
            max_retries: 2,
            timeout_ms: 10_000,
            seq: 0,
            place: Place::Nowhere,
            attempt_timer: None,
            waiters: Vec::new(),
        }
    }

    fn attempt(outcome: Option<Outcome>, error: Option<&str>) -> Attempt {
        Attempt {
            worker: ConnRef { slot: 1, generation: 1 },
            client_id: 7,
            client_ip: "10.0.0.5".parse().expect("ip"),
            started_wall_ms: 1_000,
            started_mono_ms: 0,
            outcome,
            error: error.map(Into::into),
            duration_ms: 12,
            answered: false,
        }
    }

    fn check(t: &Task, expected: serde_json::Value) {
        let mut out = Vec::new();
        t.write_json(&mut out);
        let got: serde_json::Value = serde_json::from_slice(&out).expect("valid JSON");
        assert_eq!(got, expected);
    }

    #[test]
    fn json_views() {
        let id = "01234567-89ab-cdef-0123-456789abcdef";
        let pending = task(Status::Pending);
        check(
            &pending,
            serde_json::json!({"task_id": id, "status": "pending", "kind": "http",
                "created_at": "1970-01-01T00:00:00.000Z", "attempts": 0, "attempt_log": []}),
        );

        let mut running = task(Status::Dispatched);
        running.attempts.push(attempt(Some(Outcome::Timeout), Some("no answer within 10s")));
        running.attempts.push(attempt(None, None));
        check(
            &running,
            serde_json::json!({"task_id": id, "status": "dispatched", "kind": "http",
                "created_at": "1970-01-01T00:00:00.000Z", "attempts": 2, "attempt_log": [
                    {"num": 1, "client_id": "00000000-0000-0000-0000-000000000007", "client_ip": "10.0.0.5",
                     "outcome": "timeout", "error": "no answer within 10s",
                     "started_at": "1970-01-01T00:00:01.000Z", "duration_ms": 12},
                    {"num": 2, "client_id": "00000000-0000-0000-0000-000000000007", "client_ip": "10.0.0.5",
                     "started_at": "1970-01-01T00:00:01.000Z"}]}),
        );

        let mut done = task(Status::Done);
        done.kind = None;
        done.finished_wall_ms = Some(2_000);
        done.attempts.push(attempt(Some(Outcome::Done), None));
        check(
            &done,
            serde_json::json!({"task_id": id, "status": "done", "created_at": "1970-01-01T00:00:00.000Z",
                "finished_at": "1970-01-01T00:00:02.000Z", "result": null,
                "client_id": "00000000-0000-0000-0000-000000000007", "client_ip": "10.0.0.5",
                "attempts": 1, "attempt_log": [
                    {"num": 1, "client_id": "00000000-0000-0000-0000-000000000007", "client_ip": "10.0.0.5",
                     "outcome": "done", "started_at": "1970-01-01T00:00:01.000Z", "duration_ms": 12}]}),
        );
    }

    #[test]
    fn ids() {
        assert_eq!(parse_id("01234567-89ab-cdef-0123-456789abcdef"), Some(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef));
        for bad in
            ["", "x", "../etc/passwd", "01234567-89ab-cdef-0123-456789abcdeg", "{01234567-89ab-cdef-0123-456789abcdef}"]
        {
            assert_eq!(parse_id(bad), None, "{bad}");
        }
    }
}
