//! `/kinds` answers in cluster mode, from the rows of the database's `KINDS` read (SPEC §14).
//!
//! A list's rows are made into its JSON where they are read, on the database connection's
//! thread ([`pack`]): the loop gets a row per piece of about `crate::stream::PIECE_BYTES` (a
//! run of kinds' objects), not a row per kind, and writes them a piece at a time as the client
//! reads (`crate::stream::BodyStream::write_made_piece`), letting each go once written. So no loop turn
//! builds the whole answer, or walks or frees every kind's row: 200,000 kinds are ~210 pieces.
//! The pieces not written yet are the rest of the answer and count against OUTPUT_MEMORY as the
//! connection's output (`crate::stream::Made::held_bytes`). No I/O.

use crate::flow::{KindOp, Policy, kind_response, unknown_kind, write_kind_json};
use crate::http::Response;
use crate::pg::wire::{Row, Rows};
use crate::stream::{BodyStream, Made, PIECE_BYTES, Source};

/// A `KINDS` row as the kind's JSON object: (kind, policy, running, pending).
fn write_row(row: &Row, out: &mut String) {
    let (kind, policy, running, pending) = of(row);
    write_kind_json(out, kind, policy.as_ref(), running, pending);
}

fn of(row: &Row) -> (&str, Option<Policy>, u64, u64) {
    let policy = row.text(1).and_then(|p| Policy::parse(p.as_bytes()).ok());
    let n = |i: usize| row.i64(i).map_or(0, |n| n.max(0) as u64);
    (row.text(0).unwrap_or_default(), policy, n(2), n(3))
}

/// On the database connection's thread: a list's `KINDS` rows become its JSON, one row (one
/// text column) per run of kinds' objects, comma-separated, cut once a run holds
/// `PIECE_BYTES` (at least one kind each), in the rows' order.
pub fn pack(rows: &mut Rows) {
    let mut pieces = Vec::new();
    let mut piece = String::new();
    for row in &rows.rows {
        if !piece.is_empty() {
            piece.push(',');
        }
        write_row(row, &mut piece);
        if piece.len() >= PIECE_BYTES {
            pieces.push(Row::from_texts(&[Some(&piece)]));
            piece.clear();
        }
    }
    if !piece.is_empty() {
        pieces.push(Row::from_texts(&[Some(&piece)]));
    }
    rows.rows = pieces;
}

/// The answer to a `/kinds` request from its `KINDS` rows (a list's made by [`pack`]): a list
/// longer than a piece is its first piece, streamed (the rest as the client reads).
pub fn answer(rows: Vec<Row>, op: &KindOp) -> Response {
    match op {
        KindOp::List => {
            let mut stream = BodyStream::new(Source::KindRows(Made::new(rows)));
            let mut body = String::new();
            stream.write_made_piece(&mut body);
            let r = Response::json(200, body.into_bytes());
            if stream.done { r } else { r.streamed(stream) }
        }
        KindOp::Get(kind) | KindOp::Set(kind, _) => match rows.first().map(of) {
            Some((_, policy, running, pending)) => kind_response(kind, policy.as_ref(), running, pending),
            None if matches!(op, KindOp::Set(..)) => kind_response(kind, None, 0, 0),
            None => unknown_kind(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `KINDS` rows: (kind, policy, running, pending).
    fn rows(n: usize) -> Vec<Row> {
        (0..n)
            .map(|i| {
                let kind = format!("kind-{i:06}");
                let policy = (i % 7 == 0).then_some(r#"{"max_running":3,"paused":true}"#);
                let (running, pending) = ((i % 3).to_string(), (i * 11 % 1_000).to_string());
                Row::from_texts(&[Some(&kind), policy, Some(&running), Some(&pending)])
            })
            .collect()
    }

    /// The answer as it was built before it was streamed: every row at once.
    fn whole(rows: &[Row]) -> String {
        let mut s = String::from("{\"kinds\":[");
        for (i, row) in rows.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            write_row(row, &mut s);
        }
        s.push_str("]}");
        s
    }

    #[test]
    fn a_long_list_is_made_into_pieces_where_read_and_is_the_same_answer_a_piece_at_a_time() {
        type Case = (usize, usize);
        // (rows, pieces at least)
        let table: &[Case] = &[(0, 1), (1, 1), (300, 1), (40_000, 20)];
        for &(n, at_least) in table {
            let all = rows(n);
            let want = whole(&all);
            let mut read = Rows { rows: all, affected: n as u64 };
            pack(&mut read);
            assert!(
                read.rows.len() <= n.max(1) && read.rows.len() * 1_000 <= n.max(1_000),
                "{n} rows: {} pieces",
                read.rows.len()
            );
            let first = answer(read.rows, &KindOp::List);
            assert_eq!(first.status, 200);
            let mut body = String::from_utf8(first.body).expect("utf-8");
            let Some(mut stream) = first.stream.map(|s| *s) else {
                assert_eq!(body, want, "{n} rows: whole");
                assert!(at_least == 1 && want.len() <= crate::stream::PIECE_BYTES + 1024, "{n} rows not streamed");
                continue;
            };
            let mut pieces = 1;
            let mut held = stream.held_bytes();
            assert!(held > 0 && held <= want.len() + 100 * 1024, "{n} rows: the rest held is {held} bytes");
            while !stream.done {
                let mut piece = String::new();
                stream.write_made_piece(&mut piece);
                assert!(piece.len() <= crate::stream::PIECE_BYTES + 1024, "{n} rows: a piece of {} bytes", piece.len());
                assert!(stream.held_bytes() < held || stream.done, "{n} rows: a piece lets its rows go");
                held = stream.held_bytes();
                body.push_str(&piece);
                pieces += 1;
                assert!(pieces < 10_000, "never done");
            }
            assert_eq!(stream.held_bytes(), 0, "{n} rows: all let go");
            assert!(pieces >= at_least, "{n} rows: {pieces} pieces");
            assert!(
                body == want,
                "{n} rows: the pieces make the answer as it was ({} bytes, {} wanted)",
                body.len(),
                want.len()
            );
            let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
            assert_eq!(v["kinds"].as_array().map(Vec::len), Some(n));
        }
    }

    #[test]
    fn one_kind_is_answered_from_its_row() {
        let row = rows(1);
        let one = answer(row.clone(), &KindOp::Get("kind-000000".into()));
        let body: serde_json::Value = serde_json::from_slice(&one.body).expect("JSON");
        assert_eq!(body["kind"], "kind-000000");
        assert_eq!(body["policy"]["max_running"], 3);
        assert!(one.stream.is_none());
        assert_eq!(answer(Vec::new(), &KindOp::Get("x".into())).status, 404);
        assert_eq!(answer(Vec::new(), &KindOp::Set("x".into(), None)).status, 200);
    }
}
