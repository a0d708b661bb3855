//! The dispatch core against the reference model of SPEC §5/§7: the bytes become a
//! configuration and a sequence of operations (submits, workers, answers, cancels, waits, time,
//! restarts from the journal), and any difference from the model or broken invariant is a
//! crash. The model is `src/dispatch/tests/model.rs`, the same file `cargo test` runs seeds
//! through; a crash's input replays there with `run_bytes`.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[allow(dead_code)] // the seed runner and the shrinker are for `cargo test`
#[path = "../../src/dispatch/tests/model.rs"]
mod model;

fuzz_target!(|data: &[u8]| {
    if let Err(failure) = model::run_bytes(data) {
        panic!("dispatch model: {failure}");
    }
});
