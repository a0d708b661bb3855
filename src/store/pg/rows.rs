//! Database rows as the shared types: a task row becomes a [`Task`] (so the one task JSON
//! writer, `tasks::Task::write_json`, answers for both stores), a worker row a [`WorkerInfo`].
//! Pure: rows in, values out. The wide rows' column positions (tasks, claims, attempt log
//! entries, workers) are named here; short rows of two or three columns are read where they
//! arrive, by the positions their statement's doc in `pg::sql` gives.

use std::net::{IpAddr, Ipv4Addr};

use serde::Deserialize;

use crate::pg::wire::Row;
use crate::store::WorkerInfo;
use crate::tasks::{Attempt, Outcome, Status, Task, TaskId, parse_id};

/// The columns of `GET_TASKS` (and `FINISHED_AMONG`, `LIST_TASKS`), by index.
pub mod col {
    /// The JSON columns, checked on the database thread ([`crate::pg::wire::Stmt::with_json`]).
    pub const JSON: &[usize] = &[RESULT, PAYLOAD];
    pub const ID: usize = 0;
    pub const STATUS: usize = 1;
    pub const KIND: usize = 2;
    pub const CREATED_MS: usize = 3;
    pub const RUN_AT_MS: usize = 4;
    pub const FINISHED_MS: usize = 5;
    pub const RESULT: usize = 6;
    pub const ERROR: usize = 7;
    pub const CLIENT_ID: usize = 8;
    pub const CLIENT_IP: usize = 9;
    pub const ATTEMPT_LOG: usize = 10;
    pub const PRIORITY: usize = 11;
    pub const RERUNS: usize = 12;
    /// The fairness key (SPEC §14; `""`: none).
    pub const KEY: usize = 13;
    /// The submitter (SPEC §14; `""`: the root token).
    pub const SUBMITTER: usize = 14;
    pub const PAYLOAD: usize = 15;
    pub const SEQ: usize = 16;
}

/// `LIST_TASKS`'s columns after the task's.
pub mod lcol {
    pub const WALKED: usize = 17;
    pub const STOP_SEQ: usize = 18;
}

/// The columns of `CLAIM` (and `ADOPT_ORPHANS`), by index.
pub mod ccol {
    /// The JSON columns, checked on the database thread.
    pub const JSON: &[usize] = &[PAYLOAD];
    pub const ID: usize = 0;
    pub const ATTEMPT: usize = 1;
    pub const KIND: usize = 2;
    pub const PAYLOAD: usize = 3;
    pub const TIMEOUT_MS: usize = 4;
    pub const MAX_RETRIES: usize = 5;
    pub const TRIED: usize = 6;
    pub const CREATED_MS: usize = 7;
    /// (`ADOPT_ORPHANS` only) the name of the lost node that ran the attempt.
    pub const LOST_NODE: usize = 8;
    /// (`CLAIM` only) attempts that do not count against max_retries (closed by a lost node).
    pub const UNCOUNTED: usize = 9;
    /// (`CLAIM` only) the task's retry policy (SPEC §13; NULL: the default).
    pub const RETRY_BACKOFF_MS: usize = 10;
    pub const RETRY_BACKOFF_MAX_MS: usize = 11;
    pub const RETRY_ANY_WORKER: usize = 12;
    /// (`CLAIM` only) attempts before the task's current run (SPEC §13 re-runs).
    pub const RERUN_BASE: usize = 13;
    /// (`TAKE_SESSION` only) the session worker's client id, and the attempt's start.
    pub const SESSION_CLIENT_ID: usize = 14;
    pub const SESSION_STARTED_MS: usize = 15;
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
    pub const RESUMABLE_UNTIL_MS: usize = 10;
}

/// One entry of a task's `attempt_log` column, as the statements write it.
#[derive(Deserialize)]
struct LogEntry {
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
    /// Times a resuming worker took the attempt back (SPEC §12).
    #[serde(default)]
    resumes: Option<u32>,
    /// Closed by a lost node: does not count against max_retries.
    #[serde(default)]
    uncounted: bool,
    /// A retry waiting out its backoff: when it may run (SPEC §13).
    #[serde(default)]
    next_attempt_ms: Option<u64>,
}

pub fn ms(row: &Row, i: usize) -> Option<u64> {
    row.i64(i).and_then(|v| u64::try_from(v).ok())
}

/// A row's id column as a task id.
pub fn row_id(row: &Row) -> Option<TaskId> {
    row.text(col::ID).and_then(parse_id)
}

pub fn status_of(text: &str) -> Option<Status> {
    crate::listing::status_of(text)
}

fn outcome_of(text: &str) -> Option<Outcome> {
    Outcome::ALL.into_iter().find(|o| o.as_str() == text)
}

/// The task of a `GET_TASKS`-shaped row (`payload`: the row carries the payload column).
pub fn task(row: &Row) -> Option<Task> {
    let id = row_id(row)?;
    let status = row.text(col::STATUS).and_then(status_of).unwrap_or(Status::Pending);
    let created = ms(row, col::CREATED_MS).unwrap_or(0);
    let finished = ms(row, col::FINISHED_MS);
    let log: Vec<LogEntry> =
        row.text(col::ATTEMPT_LOG).and_then(|text| serde_json::from_str(text).ok()).unwrap_or_default();
    let last = log.len().saturating_sub(1);
    let unknown = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
    let attempts = log
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let outcome = e.outcome.as_deref().and_then(outcome_of);
            // A cancel or a reaper closes an attempt without timing it: the task's end is the
            // attempt's end when it was the last.
            let duration = e.duration_ms.or_else(|| {
                let (start, end) = (e.started_ms?, finished.filter(|_| i == last)?);
                Some(end.saturating_sub(start))
            });
            Attempt {
                client_id: e.client_id.as_deref().and_then(parse_id).unwrap_or(0),
                client_ip: e.client_ip.as_deref().and_then(|ip| ip.parse().ok()).unwrap_or(unknown),
                node: e.node.as_deref().map(Box::from),
                started_wall_ms: e.started_ms.unwrap_or(0),
                outcome,
                error: e.error.as_deref().map(Box::from),
                duration_ms: duration.unwrap_or(0),
                answered: false,
                restarted: e.uncounted,
                resumes: e.resumes.unwrap_or(0),
                session: None,
            }
        })
        .collect();
    let raw = |i: usize| row.json(i);
    let run_at = ms(row, col::RUN_AT_MS).filter(|&at| at != created);
    let next_attempt = log.last().and_then(|e| e.next_attempt_ms).filter(|_| status == Status::Pending);
    Some(Task {
        id,
        status,
        kind: row.text(col::KIND).map(Box::from),
        payload: if row.len() > col::PAYLOAD { raw(col::PAYLOAD).map(Into::into) } else { None },
        created_wall_ms: created,
        run_at_wall_ms: run_at,
        due_wall_ms: run_at.unwrap_or(created),
        finished_wall_ms: finished,
        result: if status == Status::Done { raw(col::RESULT) } else { None },
        error: if status == Status::Failed { row.text(col::ERROR).map(Box::from) } else { None },
        attempts,
        submit_seq: ms(row, col::SEQ).unwrap_or(0),
        next_attempt_wall_ms: next_attempt,
        reruns: row.i64(col::RERUNS).and_then(|n| u32::try_from(n).ok()).unwrap_or(0),
        priority: row.i64(col::PRIORITY).and_then(|p| i32::try_from(p).ok()).unwrap_or(0),
        key: row.text(col::KEY).map(Box::from).unwrap_or_default(),
        submitter: row.text(col::SUBMITTER).map(Box::from).unwrap_or_default(),
        ..Task::default()
    })
    .map(|mut t| {
        // The worker that finished it (or, failed, the one of its last attempt) as the row has
        // it: the writer takes them from the last attempt.
        if let (Some(c), Some(a)) = (row.text(col::CLIENT_ID).and_then(parse_id), t.attempts.last_mut())
            && a.client_id == 0
        {
            a.client_id = c;
            if let Some(ip) = row.text(col::CLIENT_IP).and_then(|ip| ip.parse().ok()) {
                a.client_ip = ip;
            }
        }
        t
    })
}

/// Does `scope` (None: every kind) allow the task of this row?
pub fn in_scope(row: &Row, scope: Option<&[String]>) -> bool {
    crate::store::mem::in_scope(row.text(col::KIND), scope)
}

/// A listing page from `LIST_TASKS` rows (asked for `limit + 1` tasks, at most `walk` looked
/// at, cut by the database once [`crate::listing::MAX_PAGE_BYTES`] of results were listed).
/// There is a next page when there was one more task, when the page was cut by size (it goes on
/// after the last task shown), or when the walk ran out (it goes on where the walk stopped).
/// `note` marks each task before it is written (why a pending one waits).
pub fn list_page(rows: &[Row], limit: usize, walk: usize, note: &dyn Fn(&Task)) -> Vec<u8> {
    let tasks: Vec<&Row> = rows.iter().filter(|r| r.text(col::ID).is_some()).collect();
    let shown = &tasks[..tasks.len().min(limit)];
    let bytes: usize = shown.iter().map(|r| r.bytes(col::RESULT).map_or(0, <[u8]>::len)).sum();
    let pieces: Vec<Option<String>> = shown
        .iter()
        .filter_map(|r| task(r))
        .map(|t| {
            note(&t);
            let mut s = String::new();
            t.write_json(&mut s);
            Some(s)
        })
        .collect();
    let walked = rows.first().and_then(|r| ms(r, lcol::WALKED)).unwrap_or(0);
    let next = if tasks.len() > limit || (bytes >= crate::listing::MAX_PAGE_BYTES && !shown.is_empty()) {
        shown.last().and_then(|r| ms(r, col::SEQ))
    } else if walked as usize >= walk {
        rows.first().and_then(|r| ms(r, lcol::STOP_SEQ))
    } else {
        None
    };
    crate::listing::render(&pieces, next)
}

/// A worker of the cluster from a `LIST_WORKERS` row.
pub fn worker(row: &Row) -> Option<WorkerInfo> {
    Some(WorkerInfo {
        client_id: parse_id(row.text(wcol::CLIENT_ID)?)?,
        ip: row.text(wcol::IP).unwrap_or("").to_string(),
        connected_wall_ms: ms(row, wcol::CONNECTED_MS).unwrap_or(0),
        active: row.bool(wcol::ACTIVE) == Some(true),
        in_flight: ms(row, wcol::IN_FLIGHT).unwrap_or(0).min(u64::from(u32::MAX)) as u32,
        kinds: row.text(wcol::KINDS).and_then(|t| serde_json::from_str(t).ok()),
        concurrency: ms(row, wcol::CONCURRENCY).map(|c| c.min(u64::from(u32::MAX)) as u32),
        version: row.text(wcol::VERSION).map(str::to_string),
        node: row.text(wcol::NODE_NAME).map(str::to_string),
        node_id: row.text(wcol::NODE_ID).and_then(parse_id),
        resumable_until_wall_ms: ms(row, wcol::RESUMABLE_UNTIL_MS),
        degraded: false,
    })
}

/// Parses PostgreSQL's text form of a `uuid[]` (`{a,b}`); malformed entries are skipped.
pub fn parse_uuid_array(text: &str) -> Vec<u128> {
    let inner = text.trim().trim_start_matches('{').trim_end_matches('}');
    inner.split(',').filter_map(|s| parse_id(s.trim().trim_matches('"'))).collect()
}

/// The text form of a list of uuids, as a PostgreSQL array literal.
pub fn uuid_array(ids: impl IntoIterator<Item = TaskId>) -> String {
    let texts: Vec<String> = ids.into_iter().map(crate::tasks::uuid_string).collect();
    crate::pg::sql::array(texts.iter().map(|s| Some(s.as_str())))
}

/// Whether a string may go to PostgreSQL as `text` (which cannot hold U+0000).
pub fn storable(text: &str) -> bool {
    !text.contains('\0')
}

/// `text` with every U+0000 replaced (for errors and versions workers send, which relay only
/// stores).
pub fn storable_lossy(text: &str) -> String {
    if storable(text) { text.to_string() } else { text.replace('\0', "\u{FFFD}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `GET_TASKS` row: (status, kind, created, run_at, finished, result, error, client, log).
    #[allow(clippy::too_many_arguments)]
    fn row(
        status: &str,
        kind: Option<&str>,
        created: &str,
        run_at: &str,
        finished: Option<&str>,
        result: Option<&str>,
        error: Option<&str>,
        client: Option<(&str, &str)>,
        log: &str,
    ) -> Row {
        Row::from_texts(&[
            Some("01234567-89ab-cdef-0123-456789abcdef"),
            Some(status),
            kind,
            Some(created),
            Some(run_at),
            finished,
            result,
            error,
            client.map(|c| c.0),
            client.map(|c| c.1),
            Some(log),
        ])
    }

    fn check(r: Row, expected: serde_json::Value) {
        let mut s = String::new();
        task(&r).expect("a task").write_json(&mut s);
        let got: serde_json::Value = serde_json::from_str(&s).expect("valid JSON");
        assert_eq!(got, expected);
    }

    #[test]
    fn task_json_from_rows() {
        let id = "01234567-89ab-cdef-0123-456789abcdef";
        let w = "00000000-0000-0000-0000-000000000007";
        check(
            row("pending", Some("http"), "1000", "1000", None, None, None, None, "[]"),
            serde_json::json!({"task_id": id, "status": "pending", "kind": "http", "waiting_on": "worker",
                "created_at": "1970-01-01T00:00:01.000Z", "attempts": 0, "attempt_log": []}),
        );
        // A retry waiting out its backoff: its last entry says until when (SPEC §13).
        let log = format!(
            r#"[{{"num":1,"client_id":"{w}","client_ip":"10.0.0.5","started_ms":2000,"outcome":"failed",
                 "error":"boom","duration_ms":10,"next_attempt_ms":9000}}]"#
        );
        crate::tasks::set_json_clock(3_000);
        check(
            row("pending", Some("http"), "1000", "1000", None, None, None, None, &log),
            serde_json::json!({"task_id": id, "status": "pending", "kind": "http", "waiting_on": "backoff",
                "next_attempt_at": "1970-01-01T00:00:09.000Z",
                "created_at": "1970-01-01T00:00:01.000Z", "attempts": 1, "attempt_log": [
                    {"num": 1, "client_id": w, "client_ip": "10.0.0.5", "outcome": "failed", "error": "boom",
                     "started_at": "1970-01-01T00:00:02.000Z", "duration_ms": 10}]}),
        );
        crate::tasks::set_json_clock(0);
        let log = format!(
            r#"[{{"num":1,"client_id":"{w}","client_ip":"10.0.0.5","node":"n1","started_ms":2000,
                 "outcome":"timeout","error":"no answer within 10s","duration_ms":10}},
               {{"num":2,"client_id":"{w}","client_ip":"10.0.0.5","node":"n2","started_ms":3000,
                 "outcome":"done","duration_ms":5}}]"#
        );
        check(
            row("done", None, "1000", "1500", Some("4000"), Some("[1,2]"), None, Some((w, "10.0.0.5")), &log),
            serde_json::json!({"task_id": id, "status": "done", "created_at": "1970-01-01T00:00:01.000Z",
                "run_at": "1970-01-01T00:00:01.500Z", "finished_at": "1970-01-01T00:00:04.000Z",
                "result": [1, 2], "client_id": w, "client_ip": "10.0.0.5", "attempts": 2, "attempt_log": [
                    {"num": 1, "client_id": w, "client_ip": "10.0.0.5", "node": "n1", "outcome": "timeout",
                     "error": "no answer within 10s", "started_at": "1970-01-01T00:00:02.000Z", "duration_ms": 10},
                    {"num": 2, "client_id": w, "client_ip": "10.0.0.5", "node": "n2", "outcome": "done",
                     "started_at": "1970-01-01T00:00:03.000Z", "duration_ms": 5}]}),
        );
        // A cancel closes the running attempt without timing it: the task's end times it.
        let log =
            format!(r#"[{{"num":1,"client_id":"{w}","client_ip":"::1","started_ms":2000,"outcome":"canceled"}}]"#);
        check(
            row("canceled", Some("k"), "1000", "1000", Some("2500"), None, None, None, &log),
            serde_json::json!({"task_id": id, "status": "canceled", "kind": "k",
                "created_at": "1970-01-01T00:00:01.000Z", "finished_at": "1970-01-01T00:00:02.500Z",
                "attempts": 1, "attempt_log": [{"num": 1, "client_id": w, "client_ip": "::1",
                    "outcome": "canceled", "started_at": "1970-01-01T00:00:02.000Z", "duration_ms": 500}]}),
        );
        check(
            row("failed", Some("k"), "1000", "1000", Some("2000"), None, Some("boom"), Some((w, "::1")), "not json"),
            serde_json::json!({"task_id": id, "status": "failed", "kind": "k", "error": "boom",
                "created_at": "1970-01-01T00:00:01.000Z", "finished_at": "1970-01-01T00:00:02.000Z",
                "attempts": 0, "attempt_log": []}),
        );
    }

    #[test]
    fn uuid_arrays_both_ways() {
        let a = 0x0123_4567_89ab_cdef_0123_4567_89ab_cdef_u128;
        let b = 7u128;
        let table: &[(&str, &[u128])] = &[
            ("{}", &[]),
            ("{01234567-89ab-cdef-0123-456789abcdef}", &[a]),
            ("{01234567-89ab-cdef-0123-456789abcdef,00000000-0000-0000-0000-000000000007}", &[a, b]),
            ("{nonsense,00000000-0000-0000-0000-000000000007}", &[b]),
        ];
        for (text, expected) in table {
            assert_eq!(parse_uuid_array(text), *expected, "{text}");
        }
        assert_eq!(parse_uuid_array(&uuid_array([a, b])), vec![a, b]);
    }

    #[test]
    fn text_postgres_can_store() {
        assert!(storable("plain é"));
        assert!(!storable("nul\0inside"));
        assert_eq!(storable_lossy("a\0b"), "a\u{FFFD}b");
    }
}
