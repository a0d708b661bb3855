//! `GET /tasks?...` query strings (listing::parse_query) and cursors: never a panic; an accepted
//! query keeps its limit within 1..=MAX_LIMIT; a cursor decodes to the number it was made from,
//! and any other text either decodes to a number or is refused.
#![no_main]
use libfuzzer_sys::fuzz_target;
use relay::listing::{MAX_LIMIT, decode_cursor, encode_cursor, parse_query};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(q) = parse_query(&text) {
        assert!((1..=MAX_LIMIT).contains(&q.limit), "limit {} from {text:?}", q.limit);
    }
    let _ = decode_cursor(&text);
    let mut n = [0u8; 8];
    for (i, b) in data.iter().take(8).enumerate() {
        n[i] = *b;
    }
    let seq = u64::from_le_bytes(n);
    assert_eq!(decode_cursor(&encode_cursor(seq)), Some(seq));
    // A cursor of this number, in a query, is the page below it.
    let q = parse_query(&format!("cursor={}", encode_cursor(seq))).map(|q| q.below);
    assert!(q.is_err() || q == Ok(seq), "{q:?} for {seq}");
});
