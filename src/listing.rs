//! `GET /tasks?status=&kind=&limit=&cursor=` (SPEC §4 "Listing"): query parsing, the opaque
//! cursor, and one page of task JSON read from the core's submission index. No I/O.
//!
//! Order: newest submission first. The cursor names a position in that order (the submission
//! number of the last task the page looked at), not an offset, so tasks that arrive or are
//! forgotten between two pages never make a task appear twice or be skipped.
//!
//! Bounded work: one page looks at no more than [`MAX_SCAN`] tasks and writes no more than
//! [`MAX_PAGE_BYTES`] of JSON. A filter that matches little ends the page early with fewer
//! tasks (possibly none) and a `next_cursor` where it stopped; a client follows `next_cursor`
//! until it is absent. This keeps a page well under a millisecond of loop time whatever the
//! table holds, without per-status or per-kind indexes that every status change would have to
//! keep up to date.
//!
//! Tasks that left memory (`TASK_MEMORY`, SPEC §7) keep their place in the index until
//! `TASK_TTL`: a page that reaches them is planned here and completed by reading them back from
//! the journal on its reader thread (`Core::read_page`), never on the loop.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use crate::auth::Identity;
use crate::dispatch::Core;
use crate::tasks::{Status, TaskId, kind_hash};

pub const DEFAULT_LIMIT: usize = 50;
pub const MAX_LIMIT: usize = 1000;
/// Tasks one page may look at, matching or not.
pub const MAX_SCAN: usize = 10_000;
/// JSON one page may hold (a result can be up to MAX_MESSAGE_SIZE); at least one task is
/// always included, so a page always makes progress. A client that asks and never reads makes
/// relay hold its page until IDLE_TIMEOUT: SPEC §4 allows 256 KiB of such output.
pub const MAX_PAGE_BYTES: usize = 256 << 10;

/// Cursor format version (the first byte of the decoded cursor).
const CURSOR_V1: u8 = 1;

/// A validated listing query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub status: Option<Status>,
    pub kind: Option<String>,
    pub limit: usize,
    /// List tasks with a submission number strictly below this.
    pub below: u64,
    /// Cluster mode's cursor: list tasks below this (created_ms, seq) (`cluster::render`).
    pub at: Option<(u64, u64)>,
}

/// Parses the query string of `GET /tasks`. The error is the 400 message. Unknown parameters
/// are ignored (cache busters); a known one given twice is an error.
pub fn parse_query(query: &str) -> Result<Query, String> {
    let mut q = Query { status: None, kind: None, limit: DEFAULT_LIMIT, below: u64::MAX, at: None };
    let (mut seen_status, mut seen_kind, mut seen_limit, mut seen_cursor) = (false, false, false, false);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, raw) = pair.split_once('=').unwrap_or((pair, ""));
        let value = crate::api::percent_decode(raw);
        let seen = match key {
            "status" => &mut seen_status,
            "kind" => &mut seen_kind,
            "limit" => &mut seen_limit,
            "cursor" => &mut seen_cursor,
            _ => continue,
        };
        if std::mem::replace(seen, true) {
            return Err(format!("query parameter {key} is given more than once"));
        }
        match key {
            "status" => {
                q.status = Some(parse_status(&value).ok_or_else(|| {
                    format!("unknown status {value:?} (pending, dispatched, done, failed or canceled)")
                })?);
            }
            "kind" => q.kind = Some(value),
            "limit" => {
                q.limit = value
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=MAX_LIMIT).contains(n) && value.bytes().all(|b| b.is_ascii_digit()))
                    .ok_or_else(|| format!("invalid limit {value:?} (an integer from 1 to {MAX_LIMIT})"))?;
            }
            _ => match crate::cluster::render::decode_cursor(&value) {
                Some(at) => q.at = Some(at),
                None => q.below = decode_cursor(&value).ok_or_else(|| format!("invalid cursor {value:?}"))?,
            },
        }
    }
    Ok(q)
}

/// A status by its name.
pub fn status_of(text: &str) -> Option<Status> {
    parse_status(text)
}

fn parse_status(text: &str) -> Option<Status> {
    [Status::Pending, Status::Dispatched, Status::Done, Status::Failed, Status::Canceled]
        .into_iter()
        .find(|s| s.as_str() == text)
}

/// The opaque cursor for "continue below submission number `seq`".
pub fn encode_cursor(seq: u64) -> String {
    let mut raw = [0u8; 9];
    raw[0] = CURSOR_V1;
    raw[1..].copy_from_slice(&seq.to_be_bytes());
    URL_SAFE_NO_PAD.encode(raw)
}

pub fn decode_cursor(text: &str) -> Option<u64> {
    if text.len() != 12 {
        return None;
    }
    let raw = URL_SAFE_NO_PAD.decode(text).ok()?;
    let (&version, seq) = raw.split_first()?;
    if version != CURSOR_V1 {
        return None;
    }
    Some(u64::from_be_bytes(seq.try_into().ok()?))
}

/// One page as planned on the loop: the JSON of the tasks in memory, and the tasks that left
/// memory (`TASK_MEMORY`) whose JSON must be read back from the journal first.
pub struct Plan {
    /// In page order: a task's JSON, or `None` for one to read back (`evicted` says which).
    pub pieces: Vec<Option<String>>,
    pub evicted: Vec<(usize, TaskId)>,
    /// Where the next page starts, if there is one.
    pub next: Option<u64>,
    /// The newest journal record the page shows (the answer waits for it, SPEC §7).
    pub lsn: u64,
}

/// Plans one page (bounded work: see the module comment).
pub fn plan(core: &Core, q: &Query, identity: &Identity) -> Plan {
    let mut plan = Plan { pieces: Vec::new(), evicted: Vec::new(), next: None, lsn: 0 };
    let mut bytes = 0;
    // A scoped token asking for a kind outside its scope sees nothing (and learns nothing).
    if q.kind.as_deref().is_some_and(|k| !identity.allows_kind(Some(k))) {
        return plan;
    }
    let want_hash = q.kind.as_deref().map(|k| kind_hash(Some(k)));
    let scope_hashes: Option<Vec<u32>> = match identity {
        Identity::Scoped { kinds, .. } => Some(kinds.iter().map(|k| kind_hash(Some(k))).collect()),
        _ => None,
    };
    for (scanned, (seq, id)) in core.tasks_newest_first(q.below).enumerate() {
        if scanned == MAX_SCAN || (!plan.pieces.is_empty() && bytes >= MAX_PAGE_BYTES) {
            // Out of budget: the next page starts below the last task looked at.
            plan.next = Some(seq.saturating_add(1));
            break;
        }
        let piece = if let Some(task) = core.task(id) {
            let matches = q.status.is_none_or(|s| task.status == s)
                && q.kind.as_deref().is_none_or(|k| task.kind.as_deref() == Some(k))
                && identity.allows_kind(task.kind.as_deref());
            if !matches {
                continue;
            }
            let mut json = String::new();
            task.write_json(&mut json);
            plan.lsn = plan.lsn.max(task.stored.lsn);
            Ok(json)
        } else if let Some(e) = core.evicted(id) {
            // The kind is compared by hash here and exactly once the task is read back.
            let matches = q.status.is_none_or(|s| e.status == s)
                && want_hash.is_none_or(|h| e.kind_hash == h)
                && scope_hashes.as_ref().is_none_or(|hs| hs.contains(&e.kind_hash));
            if !matches {
                continue;
            }
            // To be read back: its JSON is about its record's size (result included), a
            // little more.
            Err(e.loc.len as usize + 512)
        } else {
            continue;
        };
        if plan.pieces.len() == q.limit {
            // Another match exists: the page is full and is not the last.
            plan.next = Some(seq.saturating_add(1));
            break;
        }
        match piece {
            Ok(json) => {
                bytes += json.len();
                plan.pieces.push(Some(json));
            }
            Err(estimate) => {
                bytes += estimate;
                plan.evicted.push((plan.pieces.len(), id));
                plan.pieces.push(None);
            }
        }
    }
    plan
}

/// The response body `{"tasks":[...],"next_cursor":"..."}` (pieces left `None` are skipped:
/// a task read back that turned out not to match, or gone meanwhile).
pub fn render(pieces: &[Option<String>], next: Option<u64>) -> Vec<u8> {
    let mut out = String::with_capacity(64 + pieces.iter().flatten().map(String::len).sum::<usize>());
    out.push_str("{\"tasks\":[");
    for (i, json) in pieces.iter().flatten().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(json);
    }
    out.push(']');
    if let Some(below) = next {
        out.push_str(",\"next_cursor\":\"");
        out.push_str(&encode_cursor(below));
        out.push('"');
    }
    out.push('}');
    out.into_bytes()
}

/// One page, when every task on it is in memory (tests; the API plans and reads back).
pub fn page(core: &Core, q: &Query, identity: &Identity) -> Vec<u8> {
    let plan = plan(core, q, identity);
    render(&plan.pieces, plan.next)
}

#[cfg(test)]
mod tests {
    use super::*;

    type Parsed<'a> = (Option<Status>, Option<&'a str>, usize, u64);

    fn check(query: &str, expected: Result<Parsed<'_>, &str>) {
        let got = parse_query(query).map(|q| (q.status, q.kind, q.limit, q.below));
        match (&got, &expected) {
            (Ok(g), Ok(e)) => assert_eq!((g.0, g.1.as_deref(), g.2, g.3), *e, "{query}"),
            (Err(g), Err(e)) => assert!(g.contains(e), "{query}: error {g:?} should mention {e:?}"),
            _ => panic!("{query}: got {got:?}, expected {expected:?}"),
        }
    }

    #[test]
    fn queries() {
        let c = encode_cursor(42);
        check("", Ok((None, None, 50, u64::MAX)));
        check("status=failed", Ok((Some(Status::Failed), None, 50, u64::MAX)));
        check("kind=http&limit=1000", Ok((None, Some("http"), 1000, u64::MAX)));
        check("kind=a%20b", Ok((None, Some("a b"), 50, u64::MAX)));
        check("kind=", Ok((None, Some(""), 50, u64::MAX)));
        check(&format!("cursor={c}&limit=1"), Ok((None, None, 1, 42)));
        check("other=1&status=done", Ok((Some(Status::Done), None, 50, u64::MAX)));
        check("status=", Err("unknown status"));
        check("status=DONE", Err("unknown status"));
        check("status=running", Err("unknown status"));
        check("limit=0", Err("invalid limit"));
        check("limit=1001", Err("invalid limit"));
        check("limit=-1", Err("invalid limit"));
        check("limit=+5", Err("invalid limit"));
        check("limit=", Err("invalid limit"));
        check("limit=99999999999999999999999", Err("invalid limit"));
        check("cursor=", Err("invalid cursor"));
        check("cursor=abc", Err("invalid cursor"));
        check("cursor=AAAAAAAAAAAA", Err("invalid cursor"));
        check("cursor=!!!!!!!!!!!!", Err("invalid cursor"));
        check("status=done&status=failed", Err("more than once"));
    }

    #[test]
    fn cursors_round_trip() {
        for seq in [0, 1, 2, 1 << 40, u64::MAX] {
            let c = encode_cursor(seq);
            assert_eq!(decode_cursor(&c), Some(seq), "{c}");
            assert!(c.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'), "{c}");
        }
    }
}

#[cfg(test)]
mod core_tests {
    //! Pages read from a real `Core` (no sockets): order, stable cursors, filters, scopes, budgets.
    use super::*;
    use crate::dispatch::{CoreConfig, Io, NewTask, Timer};
    use crate::http::Response;
    use crate::tasks::{ConnRef, TaskId, parse_id, uuid_string};
    use serde_json::value::RawValue;

    struct NoIo;
    impl Io for NoIo {
        fn send_text(&mut self, _: ConnRef, _: &[&str]) -> bool {
            true
        }
        fn reply(&mut self, _: ConnRef, _: Response) {}
    }

    fn core() -> Core {
        let cfg = CoreConfig {
            task_timeout_ms: 1_000,
            max_retries: 0,
            wait_timeout_ms: 5_000,
            task_ttl_ms: 60_000,
            max_pending: 100_000,
            max_pending_bytes: 1 << 30,
            task_memory_bytes: 1 << 30,
        };
        Core::new(cfg, 0, 1_000_000)
    }

    /// A queued task (no worker needed) of `kind`.
    fn submit(core: &mut Core, kind: Option<&str>) -> TaskId {
        let payload = RawValue::from_string("{}".into()).expect("raw");
        let new = NewTask {
            payload: &payload,
            kind,
            run_at_wall_ms: None,
            queue: true,
            timeout_ms: None,
            max_retries: None,
            idempotency: None,
        };
        core.submit(&mut NoIo, new).expect("accepted")
    }

    /// (ids on the page, next cursor).
    fn list(core: &Core, query: &str, who: &Identity) -> (Vec<TaskId>, Option<String>) {
        let q = parse_query(query).expect("valid query");
        let v: serde_json::Value = serde_json::from_slice(&page(core, &q, who)).expect("JSON page");
        let ids =
            v["tasks"].as_array().expect("tasks").iter().filter_map(|t| parse_id(t["task_id"].as_str()?)).collect();
        (ids, v["next_cursor"].as_str().map(str::to_string))
    }

    /// Follows cursors from the first page to the last; `between` runs before each next page.
    fn walk(core: &mut Core, query: &str, mut between: impl FnMut(&mut Core)) -> Vec<TaskId> {
        let mut all = Vec::new();
        let mut cursor: Option<String> = None;
        for _ in 0..10_000 {
            let q = match &cursor {
                Some(c) => format!("{query}&cursor={c}"),
                None => query.to_string(),
            };
            let (ids, next) = list(core, &q, &Identity::Root);
            all.extend(ids);
            match next {
                Some(c) => cursor = Some(c),
                None => return all,
            }
            between(core);
        }
        panic!("the cursor never ended");
    }

    #[test]
    fn newest_first_and_stable_while_tasks_come_and_go() {
        let mut c = core();
        let ids: Vec<TaskId> = (0..7).map(|_| submit(&mut c, Some("a"))).collect();
        let newest_first: Vec<TaskId> = ids.iter().rev().copied().collect();
        assert_eq!(walk(&mut c, "limit=2", |_| {}), newest_first);
        // New tasks between pages are not listed by this walk (they are newer than its
        // position) and push nothing twice or out of it.
        assert_eq!(
            walk(&mut c, "limit=2", |c| {
                submit(c, Some("a"));
            }),
            newest_first[..]
        );
        // The default page is 50 and the first page always starts at the newest.
        let (first, next) = list(&c, "", &Identity::Root);
        assert_eq!((first.len(), next), (7 + 3, None));
    }

    #[test]
    fn forgotten_tasks_leave_the_index_and_the_cursor_still_works() {
        let mut c = core();
        let old: Vec<TaskId> = (0..4).map(|_| submit(&mut c, None)).collect();
        for id in &old {
            c.cancel(&mut NoIo, *id);
        }
        c.now_ms += 10_000;
        let newer: Vec<TaskId> = (0..4).map(|_| submit(&mut c, None)).collect();
        let (page1, cursor) = list(&c, "limit=5", &Identity::Root);
        assert_eq!(page1, [newer[3], newer[2], newer[1], newer[0], old[3]]);
        // TASK_TTL passes for the old (canceled) tasks: they are forgotten.
        c.now_ms = 60_000 + 1;
        c.on_timer(&mut NoIo, Timer::Sweep);
        assert!(c.task(old[0]).is_none(), "swept");
        assert_eq!(c.tasks_newest_first(u64::MAX).count(), 4, "the index forgets with the table");
        let (page2, next) = list(&c, &format!("limit=5&cursor={}", cursor.expect("more")), &Identity::Root);
        assert_eq!((page2, next), (vec![], None));
    }

    #[test]
    fn filters_and_scopes() {
        let mut c = core();
        let a1 = submit(&mut c, Some("a"));
        let b1 = submit(&mut c, Some("b"));
        let none = submit(&mut c, None);
        let a2 = submit(&mut c, Some("a"));
        c.cancel(&mut NoIo, a1);
        let scoped = Identity::Scoped { jti: "j".into(), kinds: vec!["a".into()] };
        let table: &[(&str, &Identity, Vec<TaskId>)] = &[
            ("", &Identity::Root, vec![a2, none, b1, a1]),
            ("kind=a", &Identity::Root, vec![a2, a1]),
            ("status=canceled", &Identity::Root, vec![a1]),
            ("status=pending&kind=a", &Identity::Root, vec![a2]),
            ("status=done", &Identity::Root, vec![]),
            ("kind=zzz", &Identity::Root, vec![]),
            ("", &scoped, vec![a2, a1]),
            ("kind=b", &scoped, vec![]),
            ("status=pending", &scoped, vec![a2]),
        ];
        for (query, who, expected) in table {
            assert_eq!(&list(&c, query, who).0, expected, "{query} as {who:?}");
        }
    }

    #[test]
    fn a_page_looks_at_no_more_than_max_scan_tasks() {
        let mut c = core();
        let wanted = submit(&mut c, Some("rare"));
        for _ in 0..MAX_SCAN + 5 {
            submit(&mut c, Some("common"));
        }
        let (ids, next) = list(&c, "kind=rare", &Identity::Root);
        assert!(ids.is_empty(), "stopped before reaching the match");
        let next = next.expect("a cursor where the scan stopped");
        let (ids, last) = list(&c, &format!("kind=rare&cursor={next}"), &Identity::Root);
        assert_eq!((ids, last), (vec![wanted], None));
        // The whole walk finds it exactly once.
        assert_eq!(walk(&mut c, "kind=rare", |_| {}), [wanted]);
    }

    #[test]
    fn a_page_holds_no_more_than_max_page_bytes() {
        let mut c = core();
        let w = ConnRef { slot: 1, generation: 1 };
        c.worker_connected(&mut NoIo, w, "127.0.0.1".parse().expect("ip"));
        let big = "x".repeat(100_000);
        let ids: Vec<TaskId> = (0..4).map(|_| submit(&mut c, None)).collect();
        for id in &ids {
            let msg = format!(r#"{{"type":"result","task_id":"{}","status":"done","data":"{big}"}}"#, uuid_string(*id));
            c.worker_message(&mut NoIo, w, &msg);
        }
        let (page1, cursor) = list(&c, "limit=10", &Identity::Root);
        assert_eq!(page1, [ids[3], ids[2], ids[1]], "cut once over {MAX_PAGE_BYTES} bytes");
        let (page2, next) = list(&c, &format!("limit=10&cursor={}", cursor.expect("more")), &Identity::Root);
        assert_eq!((page2, next), (vec![ids[0]], None));
    }
}
