//! Chunked bodies: any bytes, fed in any split, never panic and never exceed the limit.
#![no_main]
use libfuzzer_sys::fuzz_target;
use relay::http::ChunkedDecoder;

fuzz_target!(|data: &[u8]| {
    let limit = 4096;
    let mut decoder = ChunkedDecoder::default();
    let mut out = Vec::new();
    let step = data.first().map_or(1, |b| (*b as usize % 17) + 1);
    let mut rest = data;
    while !rest.is_empty() {
        let piece = &rest[..step.min(rest.len())];
        match decoder.decode(piece, &mut out, limit) {
            Ok(used) => {
                assert!(used <= piece.len());
                if decoder.is_done() || used == 0 {
                    break;
                }
                rest = &rest[used..];
            }
            Err(_) => break,
        }
        assert!(out.len() <= limit);
    }
});
