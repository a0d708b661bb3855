//! `GET /tasks?status=&kind=&limit=&cursor=` (SPEC §4 "Listing"): query parsing, the one opaque
//! cursor and the page's JSON, for both stores (each walks its own submission index:
//! `store::mem::listing`, and `LIST_TASKS` in PostgreSQL). No I/O.
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
//! the journal on its reader thread, never on the loop.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use crate::tasks::Status;

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
}

/// Parses the query string of `GET /tasks`. The error is the 400 message. Unknown parameters
/// are ignored (cache busters); a known one given twice is an error.
pub fn parse_query(query: &str) -> Result<Query, String> {
    let mut q = Query { status: None, kind: None, limit: DEFAULT_LIMIT, below: u64::MAX };
    let (mut seen_status, mut seen_kind, mut seen_limit, mut seen_cursor) = (false, false, false, false);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, raw) = pair.split_once('=').unwrap_or((pair, ""));
        let value = crate::http::percent_decode(raw);
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
            _ => q.below = decode_cursor(&value).ok_or_else(|| format!("invalid cursor {value:?}"))?,
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
