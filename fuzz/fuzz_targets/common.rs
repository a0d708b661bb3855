//! Shared by the targets that drive a real core: an `Io` that accepts everything, and a core
//! with one connected worker.
use relay::dispatch::{Core, CoreConfig, Io};
use relay::store::Store;
use relay::store::mem::{MemConfig, MemStore};
use relay::http::Response;
use relay::tasks::ConnRef;

pub struct NullIo;

impl Io for NullIo {
    fn send_text(&mut self, _: ConnRef, _: &[&str]) -> bool {
        true
    }
    fn reply(&mut self, _: ConnRef, _: Response) {}
}

pub const WORKER: ConnRef = ConnRef { slot: 0, generation: 1 };

pub fn core_with_worker() -> Core {
    let (task_timeout_ms, max_retries) = (1000, 2);
    let cfg = CoreConfig { task_timeout_ms, max_retries, wait_timeout_ms: 1000, ..CoreConfig::default() };
    let store = MemConfig {
        task_ttl_ms: 1000, failed_ttl_ms: 0,
        max_pending: 10,
        max_pending_bytes: 1 << 20,
        task_memory_bytes: 1 << 20,
        task_timeout_ms,
        max_retries,
    };
    let mut core = Core::new(cfg, Store::Mem(Box::new(MemStore::new(store, None))), 0, 0);
    core.worker_connected(&mut NullIo, WORKER, std::net::IpAddr::from([127, 0, 0, 1]));
    // Nothing is sent to a worker before its first message (SPEC §5): it says hello at once.
    core.worker_message(&mut NullIo, WORKER, r#"{"type":"hello"}"#);
    core
}
