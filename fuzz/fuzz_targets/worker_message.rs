//! Worker WebSocket messages, fed to a real core with one connected worker: never a panic,
//! whatever the bytes (results for unknown tasks, hellos of any shape).
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;
use common::{NullIo, WORKER, core_with_worker};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let mut core = core_with_worker();
    core.worker_message(&mut NullIo, WORKER, text);
    core.worker_disconnected(&mut NullIo, WORKER, "fuzz");
});
