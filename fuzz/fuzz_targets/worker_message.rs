//! Worker WebSocket messages, fed to a real core with one connected worker: never a panic,
//! whatever the bytes (results for unknown tasks, hellos of any shape).
#![no_main]
use libfuzzer_sys::fuzz_target;
use relay::dispatch::{Core, CoreConfig, Io};
use relay::http::Response;
use relay::tasks::ConnRef;

struct NullIo;

impl Io for NullIo {
    fn send_text(&mut self, _: ConnRef, _: &[&str]) -> bool {
        true
    }
    fn reply(&mut self, _: ConnRef, _: Response) {}
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let cfg = CoreConfig { task_timeout_ms: 1000, max_retries: 2, wait_timeout_ms: 1000, task_ttl_ms: 1000, max_pending: 10 };
    let mut core = Core::new(cfg, 0, 0);
    let worker = ConnRef { slot: 0, generation: 1 };
    core.worker_connected(&mut NullIo, worker, std::net::IpAddr::from([127, 0, 0, 1]));
    core.worker_message(&mut NullIo, worker, text);
    core.worker_disconnected(&mut NullIo, worker, "fuzz");
});
