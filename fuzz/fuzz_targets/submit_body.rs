//! `POST /tasks` bodies: validation never panics; accepted bodies have a non-null payload.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(submit) = relay::api::parse_submit(data, 1_700_000_000_000) {
        assert_ne!(submit.payload.get(), "null");
    }
});
