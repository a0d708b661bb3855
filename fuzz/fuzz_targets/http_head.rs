//! Request heads: the end found incrementally, as bytes arrive in random pieces (each search
//! starting where the last one stopped, as the reactor does), is the end a one-shot search of
//! the whole input finds; parsing never panics, and a head that parses respects the caps.
#![no_main]
use libfuzzer_sys::fuzz_target;
use relay::http::{MAX_HEAD_BYTES, find_head_end, parse_head};

#[path = "splits.rs"]
mod splits;

fuzz_target!(|data: &[u8]| {
    let Some((seed, data)) = splits::seed_and_rest(data) else { return };
    let one_shot = find_head_end(data, 0);
    let mut buf = Vec::new();
    let mut scanned = 0;
    let mut incremental = None;
    for piece in splits::pieces(data, seed) {
        buf.extend_from_slice(piece);
        if let Some(end) = find_head_end(&buf, scanned) {
            incremental = Some(end);
            break;
        }
        scanned = buf.len();
    }
    assert_eq!(incremental, one_shot, "incremental and one-shot searches disagree");
    if let Some(end) = one_shot {
        assert!(end <= data.len());
        assert!(data[..end].ends_with(b"\n\n") || data[..end].ends_with(b"\n\r\n"));
        if let Ok(head) = parse_head(data, end) {
            assert!(head.head_len <= MAX_HEAD_BYTES);
            let _ = head.query_param("wait");
            let _ = head.bearer_token();
            let _ = relay::api::Route::of(&head.path);
        }
    }
});
