//! Request heads: finding the end incrementally and parsing must never panic, and a head that
//! parses must respect the caps.
#![no_main]
use libfuzzer_sys::fuzz_target;
use relay::http::{MAX_HEAD_BYTES, find_head_end, parse_head};

fuzz_target!(|data: &[u8]| {
    // Scan in two steps, as the reactor does when bytes arrive in pieces.
    let split = data.first().map_or(0, |b| *b as usize % (data.len() + 1));
    let end = find_head_end(&data[..split], 0).or_else(|| find_head_end(data, split));
    if let Some(end) = end {
        assert!(end <= data.len());
        if let Ok(head) = parse_head(data, end) {
            assert!(head.head_len <= MAX_HEAD_BYTES);
            let _ = head.query_param("wait");
            let _ = head.bearer_token();
            let _ = relay::api::Route::of(&head.path);
        }
    }
});
