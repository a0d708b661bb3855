//! The JSON a node answers with, made from database rows: a task (SPEC §4's task JSON, whose
//! `attempt_log` entries also carry the `node` that ran them), a listing page with its cluster
//! cursor, and a worker of another node for `/clients`. Pure: rows in, bytes out.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::Deserialize;

use super::node::col;
use super::wire::Row;
use crate::tasks::{push_json_str, push_u64};
use crate::timefmt::write_rfc3339_ms;

/// One entry of a task's `attempt_log` column, as the statements write it.
#[derive(Deserialize)]
struct LogEntry {
    #[serde(default)]
    num: Option<u64>,
    #[serde(default)]
    client_id: Option<String>,
    #[serde(default)]
    client_ip: Option<String>,
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    started_ms: Option<u64>,
    #[serde(default)]
    outcome: Option<String>,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    duration_ms: Option<u64>,
}

fn ms(row: &Row, i: usize) -> Option<u64> {
    row.i64(i).and_then(|v| u64::try_from(v).ok())
}

fn push_time(s: &mut String, key: &str, at: Option<u64>) {
    if let Some(at) = at {
        s.push_str(",\"");
        s.push_str(key);
        s.push_str("\":\"");
        write_rfc3339_ms(s, at);
        s.push('"');
    }
}

fn push_field(s: &mut String, key: &str, value: Option<&str>) {
    if let Some(v) = value {
        s.push_str(",\"");
        s.push_str(key);
        s.push_str("\":");
        push_json_str(s, v);
    }
}

/// The status column of a task row.
pub fn status(row: &Row) -> &str {
    row.text(col::STATUS).unwrap_or("pending")
}

pub fn is_final(status: &str) -> bool {
    matches!(status, "done" | "failed" | "canceled")
}

/// Appends the task JSON of a `GET_TASK`-shaped row.
pub fn task_json(row: &Row, s: &mut String) {
    let st = status(row);
    let log: Vec<LogEntry> =
        row.text(col::ATTEMPT_LOG).and_then(|text| serde_json::from_str(text).ok()).unwrap_or_default();
    let created = ms(row, col::CREATED_MS).unwrap_or(0);
    let finished = ms(row, col::FINISHED_MS);
    s.push_str("{\"task_id\":");
    push_json_str(s, row.text(col::ID).unwrap_or(""));
    s.push_str(",\"status\":");
    push_json_str(s, st);
    push_field(s, "kind", row.text(col::KIND));
    push_time(s, "created_at", Some(created));
    // A task submitted without a schedule is due when it was created.
    push_time(s, "run_at", ms(row, col::RUN_AT_MS).filter(|&at| at != created));
    push_time(s, "finished_at", finished);
    if st == "done" {
        s.push_str(",\"result\":");
        s.push_str(row.text(col::RESULT).unwrap_or("null"));
    }
    if st == "failed" {
        push_field(s, "error", row.text(col::ERROR));
    }
    if st == "done" || st == "failed" {
        // The worker that finished it, or (failed) the one of its last attempt.
        let last = log.last();
        let client_id = row.text(col::CLIENT_ID).or_else(|| last.and_then(|e| e.client_id.as_deref()));
        let client_ip = row.text(col::CLIENT_IP).or_else(|| last.and_then(|e| e.client_ip.as_deref()));
        push_field(s, "client_id", client_id);
        push_field(s, "client_ip", client_ip);
    }
    s.push_str(",\"attempts\":");
    push_u64(s, log.len() as u64);
    s.push_str(",\"attempt_log\":[");
    let last = log.len().saturating_sub(1);
    for (i, e) in log.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str("{\"num\":");
        push_u64(s, e.num.unwrap_or(i as u64 + 1));
        push_field(s, "client_id", e.client_id.as_deref());
        push_field(s, "client_ip", e.client_ip.as_deref());
        push_field(s, "node", e.node.as_deref());
        push_field(s, "outcome", e.outcome.as_deref());
        push_field(s, "error", e.error.as_deref());
        push_time(s, "started_at", e.started_ms);
        if e.outcome.is_some() {
            // A cancel or a reaper closes an attempt without timing it: the task's end is the
            // attempt's end when it was the last.
            let duration = e.duration_ms.or_else(|| {
                let (start, end) = (e.started_ms?, finished.filter(|_| i == last)?);
                Some(end.saturating_sub(start))
            });
            if let Some(d) = duration {
                s.push_str(",\"duration_ms\":");
                push_u64(s, d);
            }
        }
        s.push('}');
    }
    s.push_str("]}");
}

pub fn task_string(row: &Row) -> String {
    let mut s = String::with_capacity(512);
    task_json(row, &mut s);
    s
}

/// Does `scope` (None: every kind) allow the task of this row?
pub fn in_scope(row: &Row, scope: Option<&[String]>) -> bool {
    match scope {
        None => true,
        Some(kinds) => row.text(col::KIND).is_some_and(|k| kinds.iter().any(|own| own == k)),
    }
}

/// Cursor format version of the cluster listing (`crate::listing` uses 1).
const CURSOR_V2: u8 = 2;

/// The opaque cursor for "continue below (created_ms, seq)".
pub fn encode_cursor(created_ms: u64, seq: u64) -> String {
    let mut raw = [0u8; 17];
    raw[0] = CURSOR_V2;
    raw[1..9].copy_from_slice(&created_ms.to_be_bytes());
    raw[9..].copy_from_slice(&seq.to_be_bytes());
    URL_SAFE_NO_PAD.encode(raw)
}

pub fn decode_cursor(text: &str) -> Option<(u64, u64)> {
    if text.len() != 23 {
        return None;
    }
    let raw = URL_SAFE_NO_PAD.decode(text).ok()?;
    if raw.len() != 17 || raw[0] != CURSOR_V2 {
        return None;
    }
    let created = u64::from_be_bytes(raw[1..9].try_into().ok()?);
    let seq = u64::from_be_bytes(raw[9..17].try_into().ok()?);
    Some((created, seq))
}

/// `LIST_TASKS`'s columns after the task's.
mod lcol {
    pub const WALKED: usize = 14;
    pub const STOP_CREATED_MS: usize = 15;
    pub const STOP_SEQ: usize = 16;
}

/// A listing page from `LIST_TASKS` rows (asked for `limit + 1` tasks, at most `walk` looked
/// at, cut by the database once [`crate::listing::MAX_PAGE_BYTES`] of results were listed).
/// There is a next page when there was one more task, when the page was cut by size (it goes on
/// after the last task shown), or when the walk ran out (it goes on where the walk stopped).
pub fn list_page(rows: &[Row], limit: usize, walk: usize) -> Vec<u8> {
    let tasks: Vec<&Row> = rows.iter().filter(|r| r.text(col::ID).is_some()).collect();
    let shown = &tasks[..tasks.len().min(limit)];
    let bytes: usize = shown.iter().map(|r| r.bytes(col::RESULT).map_or(0, <[u8]>::len)).sum();
    let mut s = String::with_capacity(64 + bytes + shown.len() * 512);
    s.push_str("{\"tasks\":[");
    for (i, row) in shown.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        task_json(row, &mut s);
    }
    s.push(']');
    let after_last = || shown.last().and_then(|r| Some((ms(r, col::CREATED_MS)?, ms(r, col::SEQ)?)));
    let walked = rows.first().and_then(|r| ms(r, lcol::WALKED)).unwrap_or(0);
    let next = if tasks.len() > limit || (bytes >= crate::listing::MAX_PAGE_BYTES && !shown.is_empty()) {
        after_last()
    } else if walked as usize >= walk {
        rows.first().and_then(|r| Some((ms(r, lcol::STOP_CREATED_MS)?, ms(r, lcol::STOP_SEQ)?)))
    } else {
        None
    };
    if let Some((created, seq)) = next {
        s.push_str(",\"next_cursor\":\"");
        s.push_str(&encode_cursor(created, seq));
        s.push('"');
    }
    s.push('}');
    s.into_bytes()
}

/// `LIST_WORKERS` columns.
pub mod wcol {
    pub const CLIENT_ID: usize = 0;
    pub const IP: usize = 1;
    pub const CONNECTED_MS: usize = 2;
    pub const KINDS: usize = 3;
    pub const CONCURRENCY: usize = 4;
    pub const IN_FLIGHT: usize = 5;
    pub const ACTIVE: usize = 6;
    pub const VERSION: usize = 7;
    pub const NODE_NAME: usize = 8;
    pub const NODE_ID: usize = 9;
}

/// One `/clients` entry for a worker of another node (a `LIST_WORKERS` row).
pub fn remote_client_json(row: &Row, s: &mut String) {
    s.push_str("{\"client_id\":");
    push_json_str(s, row.text(wcol::CLIENT_ID).unwrap_or(""));
    s.push_str(",\"ip\":");
    push_json_str(s, row.text(wcol::IP).unwrap_or(""));
    push_time(s, "connected_at", ms(row, wcol::CONNECTED_MS));
    s.push_str(",\"active\":");
    s.push_str(if row.bool(wcol::ACTIVE) == Some(true) { "true" } else { "false" });
    s.push_str(",\"in_flight\":");
    push_u64(s, ms(row, wcol::IN_FLIGHT).unwrap_or(0));
    if let Some(kinds) = row.text(wcol::KINDS).and_then(|t| serde_json::from_str::<Vec<String>>(t).ok()) {
        s.push_str(",\"kinds\":[");
        for (i, k) in kinds.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            push_json_str(s, k);
        }
        s.push(']');
    }
    if let Some(c) = ms(row, wcol::CONCURRENCY) {
        s.push_str(",\"concurrency\":");
        push_u64(s, c);
    }
    push_field(s, "version", row.text(wcol::VERSION));
    push_field(s, "node", row.text(wcol::NODE_NAME));
    s.push('}');
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `GET_TASKS` row: (status, kind, created, run_at, finished, result, error, client, log).
    #[allow(clippy::type_complexity)]
    fn row(
        cols: (&str, Option<&str>, &str, &str, Option<&str>, Option<&str>, Option<&str>, Option<&str>, &str),
    ) -> Row {
        let (status, kind, created, run_at, finished, result, error, client, log) = cols;
        Row::from_texts(&[
            Some("00000000-0000-4000-8000-000000000001"),
            Some(status),
            kind,
            Some(created),
            Some(run_at),
            finished,
            result,
            error,
            client,
            client.map(|_| "10.0.0.9"),
            Some("1"),
            Some(log),
            None,
        ])
    }

    fn check(r: Row, expected: serde_json::Value) {
        let got: serde_json::Value = serde_json::from_str(&task_string(&r)).expect("valid JSON");
        assert_eq!(got, expected);
    }

    #[test]
    fn task_json_from_rows() {
        let id = "00000000-0000-4000-8000-000000000001";
        let w = "00000000-0000-4000-8000-00000000000a";
        check(
            row(("pending", Some("http"), "1000", "1000", None, None, None, None, "[]")),
            serde_json::json!({"task_id": id, "status": "pending", "kind": "http",
                "created_at": "1970-01-01T00:00:01.000Z", "attempts": 0, "attempt_log": []}),
        );
        // Scheduled: run_at shown; done: the result and the worker that finished it.
        let log = format!(
            r#"[{{"num":1,"client_id":"{w}","client_ip":"10.0.0.9","node":"n1:1","started_ms":2000,"outcome":"done","duration_ms":5}}]"#
        );
        check(
            row(("done", None, "1000", "2000", Some("2005"), Some(r#"{"a":1}"#), None, Some(w), &log)),
            serde_json::json!({"task_id": id, "status": "done", "created_at": "1970-01-01T00:00:01.000Z",
                "run_at": "1970-01-01T00:00:02.000Z", "finished_at": "1970-01-01T00:00:02.005Z",
                "result": {"a": 1}, "client_id": w, "client_ip": "10.0.0.9", "attempts": 1,
                "attempt_log": [{"num": 1, "client_id": w, "client_ip": "10.0.0.9", "node": "n1:1",
                    "outcome": "done", "started_at": "1970-01-01T00:00:02.000Z", "duration_ms": 5}]}),
        );
        // Failed by the reaper (no client columns, no duration): the last attempt names the
        // worker, and the task's end times the attempt.
        let log = format!(
            r#"[{{"num":1,"client_id":"{w}","client_ip":"10.0.0.9","node":"n1:1","started_ms":2000,"outcome":"disconnect","error":"relay node n1:1 was lost"}}]"#
        );
        check(
            row(("failed", None, "1000", "1000", Some("9000"), None, Some("relay node n1:1 was lost"), None, &log)),
            serde_json::json!({"task_id": id, "status": "failed", "created_at": "1970-01-01T00:00:01.000Z",
                "finished_at": "1970-01-01T00:00:09.000Z", "error": "relay node n1:1 was lost",
                "client_id": w, "client_ip": "10.0.0.9", "attempts": 1,
                "attempt_log": [{"num": 1, "client_id": w, "client_ip": "10.0.0.9", "node": "n1:1",
                    "outcome": "disconnect", "error": "relay node n1:1 was lost",
                    "started_at": "1970-01-01T00:00:02.000Z", "duration_ms": 7000}]}),
        );
        // A running attempt: no outcome, no duration; done without data shows null.
        let log = format!(r#"[{{"num":1,"client_id":"{w}","client_ip":"10.0.0.9","node":"n2:2","started_ms":3000}}]"#);
        let running = task_string(&row(("dispatched", None, "1000", "1000", None, None, None, None, &log)));
        assert!(!running.contains("duration_ms") && !running.contains("outcome"), "{running}");
        let done = task_string(&row(("done", None, "1000", "1000", Some("1"), None, None, None, "[]")));
        assert!(done.contains(r#""result":null"#), "{done}");
    }

    /// A `LIST_TASKS` row: a task (created, seq) or the marker of an empty page (`None`), with
    /// how far the walk went and where it stopped.
    fn list_row(task: Option<(u64, u64)>, walked: u64, stop: (u64, u64)) -> Row {
        let (created, seq) = task.map_or((None, None), |(c, s)| (Some(c.to_string()), Some(s.to_string())));
        let (walked, sc, ss) = (walked.to_string(), stop.0.to_string(), stop.1.to_string());
        let id = task.map(|_| "00000000-0000-4000-8000-000000000001");
        let mut cols: Vec<Option<&str>> = vec![id, task.map(|_| "pending"), None, created.as_deref()];
        cols.extend([created.as_deref(), None, None, None, None, None, Some("0"), task.map(|_| "[]"), None]);
        cols.extend([seq.as_deref(), Some(walked.as_str()), Some(sc.as_str()), Some(ss.as_str())]);
        Row::from_texts(&cols)
    }

    #[test]
    fn list_pages_and_where_the_next_one_starts() {
        let next = |rows: &[Row], limit: usize| -> (usize, Option<(u64, u64)>) {
            let page: serde_json::Value = serde_json::from_slice(&list_page(rows, limit, 10)).expect("JSON");
            let n = page["tasks"].as_array().map_or(0, Vec::len);
            (n, page["next_cursor"].as_str().and_then(decode_cursor))
        };
        // One more than the limit: the next page starts after the last one shown.
        let rows = [list_row(Some((9, 3)), 4, (5, 1)), list_row(Some((8, 2)), 4, (5, 1))];
        assert_eq!(next(&rows, 1), (1, Some((9, 3))));
        assert_eq!(next(&rows, 2), (2, None), "the walk saw the end of the table");
        // Nothing matched, and the walk ran out: go on where it stopped.
        assert_eq!(next(&[list_row(None, 10, (5, 1))], 50), (0, Some((5, 1))));
        assert_eq!(next(&[list_row(None, 7, (5, 1))], 50), (0, None), "the table ended");
        // Some matched, fewer than the limit, and the walk ran out.
        assert_eq!(next(&[list_row(Some((9, 3)), 10, (5, 1))], 50), (1, Some((5, 1))));
    }

    #[test]
    fn cluster_cursors_round_trip_and_reject_others() {
        for (created, seq) in [(0, 0), (1_700_000_000_000, 42), (u64::MAX, u64::MAX)] {
            let c = encode_cursor(created, seq);
            assert_eq!(c.len(), 23);
            assert_eq!(decode_cursor(&c), Some((created, seq)));
        }
        for bad in ["", "AQAAAAAAAAAB", "!!!!!!!!!!!!!!!!!!!!!!!", &encode_cursor(1, 2)[..22]] {
            assert_eq!(decode_cursor(bad), None, "{bad}");
        }
    }
}
