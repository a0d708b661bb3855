//! `Range` headers (files::parse_range): never a panic; a partial answer is a non-empty range
//! inside the file; and the canonical forms `bytes=A-B`, `bytes=A-`, `bytes=-N`, built from
//! fuzzed numbers (every u64 edge included), get exactly the answer RFC 9110 §14.1.2 gives.
#![no_main]
use libfuzzer_sys::fuzz_target;
use relay::files::{RangeAnswer, parse_range};

fn check_shape(answer: RangeAnswer, size: u64) {
    if let RangeAnswer::Partial { start, end } = answer {
        assert!(start < end && end <= size, "{start}..{end} of {size}");
    }
}

fn u64_at(data: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    for (i, x) in data.iter().skip(at).take(8).enumerate() {
        b[i] = *x;
    }
    u64::from_le_bytes(b)
}

fuzz_target!(|data: &[u8]| {
    // Small sizes matter most: the size is one byte's worth unless the input asks for more.
    let size = match data.first() {
        Some(b) if b & 0x80 != 0 => u64_at(data, 1),
        Some(b) => u64::from(*b),
        None => 0,
    };
    // Any header text.
    if let Ok(text) = std::str::from_utf8(data.get(1..).unwrap_or_default()) {
        check_shape(parse_range(Some(text), size), size);
    }
    check_shape(parse_range(None, size), size);
    assert_eq!(parse_range(None, size), RangeAnswer::Full);

    // The canonical forms, with numbers from the input (small ones and every u64 edge).
    let (a, b) = (u64_at(data, 9) % (size.saturating_add(3)).max(1), u64_at(data, 17));
    let b = if data.get(25).is_some_and(|x| x & 1 == 1) { a.saturating_add(b % 8) } else { b };
    let closed = parse_range(Some(&format!("bytes={a}-{b}")), size);
    let expected = if b < a {
        RangeAnswer::Full // an invalid range is ignored
    } else if a >= size {
        RangeAnswer::Unsatisfiable
    } else {
        RangeAnswer::Partial { start: a, end: b.saturating_add(1).min(size) }
    };
    assert_eq!(closed, expected, "bytes={a}-{b} of {size}");

    let open = parse_range(Some(&format!("bytes={a}-")), size);
    let expected = if a >= size { RangeAnswer::Unsatisfiable } else { RangeAnswer::Partial { start: a, end: size } };
    assert_eq!(open, expected, "bytes={a}- of {size}");

    let suffix = parse_range(Some(&format!("bytes=-{b}")), size);
    let expected = if b == 0 || size == 0 {
        RangeAnswer::Unsatisfiable
    } else {
        RangeAnswer::Partial { start: size - b.min(size), end: size }
    };
    assert_eq!(suffix, expected, "bytes=-{b} of {size}");

    // Several ranges and other units are answered with the whole file.
    assert_eq!(parse_range(Some(&format!("bytes={a}-{b}, 0-0")), size), RangeAnswer::Full);
    assert_eq!(parse_range(Some(&format!("items={a}-{b}")), size), RangeAnswer::Full);
});
