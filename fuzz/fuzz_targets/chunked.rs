//! Chunked bodies: any bytes, fed whole or in random pieces, decode to the same result (the
//! same body, the same bytes consumed, the same end or the same error), and the body never
//! exceeds the limit. A decoder that is not done consumes every byte it is given (the reactor
//! drains what it reports as used).
#![no_main]
use libfuzzer_sys::fuzz_target;
use relay::http::{ChunkError, ChunkedDecoder};

#[path = "splits.rs"]
mod splits;

const LIMIT: usize = 4096;

#[derive(Debug, PartialEq)]
enum Outcome {
    /// The last chunk and trailers were read, after `used` bytes.
    Done {
        body: Vec<u8>,
        used: usize,
    },
    /// Everything was consumed; more is needed.
    Partial {
        body: Vec<u8>,
    },
    Error(ChunkError),
}

fn decode(pieces: &[&[u8]]) -> Outcome {
    let mut decoder = ChunkedDecoder::default();
    let mut body = Vec::new();
    let mut consumed = 0;
    for piece in pieces {
        match decoder.decode(piece, &mut body, LIMIT) {
            Ok(used) => {
                assert!(body.len() <= LIMIT);
                consumed += used;
                if decoder.is_done() {
                    return Outcome::Done { body, used: consumed };
                }
                assert_eq!(used, piece.len(), "not done, yet bytes were left unconsumed");
            }
            Err(e) => return Outcome::Error(e),
        }
    }
    Outcome::Partial { body }
}

fuzz_target!(|data: &[u8]| {
    let Some((seed, body)) = splits::seed_and_rest(data) else { return };
    let whole = decode(&[body]);
    let split = decode(&splits::pieces(body, seed));
    assert_eq!(whole, split, "fed whole and fed in pieces disagree");
});
