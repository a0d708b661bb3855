//! Answers written a piece at a time: a body too large to build on the loop at once (`GET
//! /kinds` with hundreds of thousands of kinds) is produced in pieces of about
//! [`PIECE_BYTES`], each once the connection's output has drained to [`LOW_WATER_BYTES`],
//! resuming after the last item written. A store writes the items of a piece (in the order of
//! their keys, `Store::stream_piece`); the reactor frames the pieces (`Transfer-Encoding:
//! chunked`; for an HTTP/1.0 client the body ends with the connection) and decides when the
//! next one is due. No I/O, no clock.
//!
//! Bounded: one piece is at most `PIECE_BYTES` and one item of work on the loop; a connection
//! holds at most `LOW_WATER_BYTES` + one piece of unwritten output (under `MAX_HTTP_BACKLOG`),
//! counted against OUTPUT_MEMORY like any answer, and a client that stops reading gets no
//! further piece (it is closed after IDLE_TIMEOUT, or OUTPUT_STALL under pressure).
//!
//! What a streamed list shows: each item as it was when its piece was written, in strictly
//! increasing key order. An item there for the whole answer is in it exactly once; one added
//! or removed meanwhile is in it at most once (in if it was there when the answer passed its
//! place). The JSON is always whole: the pieces are cut between items.
//!
//! A source may instead be a snapshot the stream holds (cluster mode's `GET /kinds`: the rows
//! of the database's read, [`Source::KindRows`]): each item is turned into its JSON as its
//! piece is written and let go after, so the loop's work per piece stays bounded; what the
//! snapshot still holds counts against OUTPUT_MEMORY as the connection's output
//! ([`BodyStream::held_bytes`]). Such an answer shows the read's moment, whole.

/// A piece holds at least one item, and no more once it holds this many bytes.
pub const PIECE_BYTES: usize = 64 << 10;
/// The next piece is written once the connection's unwritten output is at most this.
pub const LOW_WATER_BYTES: usize = 128 << 10;
/// The end of a chunked body: the last chunk, no trailers.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// What a streamed answer lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// `GET /kinds` (SPEC §14): `{"kinds":[...]}` in kind order, from the memory store's kinds
    /// as they are when each piece is written.
    Kinds,
    /// `GET /kinds` in cluster mode: the same answer, from the rows of its `KINDS` read that
    /// are not written yet, made into pieces by `store::pg::kinds`.
    KindRows(Made),
}

/// Pieces of an answer made ahead, off the loop (cluster mode's `GET /kinds`: one text column
/// a row, a run of items' JSON, comma-separated, each at most about [`PIECE_BYTES`]), in
/// order, and about the memory they hold; each is let go once written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Made {
    pieces: std::collections::VecDeque<crate::pg::wire::Row>,
    bytes: usize,
}

impl Made {
    pub fn new(pieces: Vec<crate::pg::wire::Row>) -> Made {
        let bytes = pieces.iter().map(crate::pg::wire::Row::held_bytes).sum();
        Made { pieces: std::collections::VecDeque::from(pieces), bytes }
    }

    pub fn held_bytes(&self) -> usize {
        self.bytes
    }

    /// The first `n` pieces are written: let go.
    fn written(&mut self, n: usize) {
        for row in self.pieces.drain(..n.min(self.pieces.len())) {
            self.bytes = self.bytes.saturating_sub(row.held_bytes());
        }
    }
}

/// Where a streamed answer is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyStream {
    pub source: Source,
    /// The key of the last item written (`None`: none yet).
    pub after: Option<Box<str>>,
    /// The opening bytes are written.
    pub opened: bool,
    /// The closing bytes are written: the body is complete.
    pub done: bool,
    /// Framed as chunks (HTTP/1.1); else the body ends when the connection closes (HTTP/1.0).
    pub chunked: bool,
}

impl BodyStream {
    pub fn new(source: Source) -> BodyStream {
        BodyStream { source, after: None, opened: false, done: false, chunked: true }
    }

    fn open_close(&self) -> (&'static str, &'static str) {
        match self.source {
            Source::Kinds | Source::KindRows(_) => ("{\"kinds\":[", "]}"),
        }
    }

    /// The next piece of an answer made ahead ([`Source::KindRows`]); a stream of another
    /// source gets none (its end, as an empty list's).
    pub fn write_made_piece(&mut self, out: &mut String) {
        let Source::KindRows(mut made) = std::mem::replace(&mut self.source, Source::Kinds) else {
            self.write_piece(std::iter::empty::<(&str, ())>(), |_, (), _| {}, out);
            return;
        };
        // (A piece's key is its place: pieces are written in order, each once.)
        let items = made.pieces.iter().map(|row| ("", row));
        let n = self.write_piece(items, |_, row, out| out.push_str(row.text(0).unwrap_or_default()), out);
        made.written(n);
        self.source = Source::KindRows(made);
    }

    /// The memory a snapshot source still holds (0 for a live one): it is the rest of the
    /// answer, so it counts as the connection's unwritten output.
    pub fn held_bytes(&self) -> usize {
        match &self.source {
            Source::Kinds => 0,
            Source::KindRows(rows) => rows.held_bytes(),
        }
    }

    /// Appends the next piece to `out`: the opening bytes first, then the `items` (those
    /// after [`BodyStream::after`], in key order), each written by `write`, until the piece
    /// holds [`PIECE_BYTES`]; the closing bytes once `items` has no more. Returns how many
    /// items it wrote.
    pub fn write_piece<'a, T>(
        &mut self,
        items: impl Iterator<Item = (&'a str, T)>,
        mut write: impl FnMut(&str, T, &mut String),
        out: &mut String,
    ) -> usize {
        if self.done {
            return 0;
        }
        let (open, close) = self.open_close();
        let start = out.len();
        if !self.opened {
            self.opened = true;
            out.push_str(open);
        }
        let mut last: Option<&str> = None;
        let mut more = false;
        let mut written = 0;
        for (key, item) in items {
            if last.is_some() && out.len() - start >= PIECE_BYTES {
                more = true;
                break;
            }
            if self.after.is_some() || last.is_some() {
                out.push(',');
            }
            write(key, item, out);
            last = Some(key);
            written += 1;
        }
        if let Some(k) = last {
            self.after = Some(k.into());
        }
        if !more {
            out.push_str(close);
            self.done = true;
        }
        written
    }
}

/// Appends `data` as one chunk of a chunked body (nothing for no data: an empty chunk would
/// end the body).
pub fn push_chunk(out: &mut Vec<u8>, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    let mut n = data.len();
    let mut hex = [0u8; 16];
    let mut i = hex.len();
    while n > 0 {
        i -= 1;
        hex[i] = b"0123456789abcdef"[n & 15];
        n >>= 4;
    }
    out.extend_from_slice(&hex[i..]);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::ChunkedDecoder;

    /// Streams `keys` (sorted) a piece at a time, `between` changing the keys before each
    /// next piece; returns the pieces.
    fn stream(mut keys: Vec<String>, mut between: impl FnMut(&mut Vec<String>)) -> Vec<String> {
        let mut s = BodyStream::new(Source::Kinds);
        let mut pieces = Vec::new();
        while !s.done {
            keys.sort();
            let after = s.after.clone();
            let from = keys.iter().map(|k| (k.as_str(), ())).filter(|(k, _)| after.as_deref().is_none_or(|a| *k > a));
            let mut piece = String::new();
            s.write_piece(from, |k, (), out| out.push_str(&format!("{{\"kind\":{k:?}}}")), &mut piece);
            pieces.push(piece);
            if !s.done {
                between(&mut keys);
            }
            assert!(pieces.len() < 10_000, "never done");
        }
        pieces
    }

    fn listed(pieces: &[String]) -> Vec<String> {
        let v: serde_json::Value = serde_json::from_str(&pieces.concat()).expect("whole JSON");
        v["kinds"].as_array().expect("kinds").iter().map(|k| k["kind"].as_str().expect("kind").to_string()).collect()
    }

    #[test]
    fn pieces_make_one_whole_answer() {
        type Case = (usize, usize);
        // (keys, pieces expected)
        let table: &[Case] = &[(0, 1), (1, 1), (100, 1), (20_000, 6)];
        for &(n, expected) in table {
            let keys: Vec<String> = (0..n).map(|i| format!("k{:06}", (i * 7919) % n.max(1))).collect();
            let pieces = stream(keys.clone(), |_| {});
            let mut sorted = keys;
            sorted.sort();
            assert_eq!(listed(&pieces), sorted, "{n} keys");
            assert_eq!(pieces.len(), expected, "{n} keys");
            assert!(pieces.iter().all(|p| p.len() <= PIECE_BYTES + 64), "{n} keys: a piece over its size");
        }
    }

    #[test]
    fn keys_that_come_and_go_meanwhile_are_in_at_most_once_and_in_order() {
        let keys: Vec<String> = (0..10_000).map(|i| format!("m{i:05}")).collect();
        let mut round = 0;
        let pieces = stream(keys, |keys| {
            round += 1;
            // One before the position (not listed), one far after it (listed), one removed
            // after the position (not listed), one listed already and removed (stays listed).
            keys.push(format!("a{round}"));
            keys.push(format!("z{round}"));
            keys.retain(|k| k != "m09999" && k != "m00000");
        });
        let got = listed(&pieces);
        let mut sorted = got.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(got, sorted, "in order, none twice");
        assert!(got.contains(&"m00000".to_string()) && !got.contains(&"m09999".to_string()));
        assert!(!got.iter().any(|k| k.starts_with('a')), "added before the position");
        assert!(got.iter().filter(|k| k.starts_with('z')).count() == round, "added after it");
    }

    #[test]
    fn chunks_decode_to_the_data() {
        for data in [&b"x"[..], &[b'a'; 15], &[b'b'; 16], &[b'c'; 70_000]] {
            let mut wire = Vec::new();
            push_chunk(&mut wire, data);
            push_chunk(&mut wire, b"");
            push_chunk(&mut wire, data);
            wire.extend_from_slice(LAST_CHUNK);
            let mut d = ChunkedDecoder::default();
            let mut out = Vec::new();
            let used = d.decode(&wire, &mut out, 1 << 20).expect("valid chunks");
            assert!(d.is_done() && used == wire.len(), "{} bytes", data.len());
            assert_eq!(out, [data, data].concat());
        }
    }
}
