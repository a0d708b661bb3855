//! Cluster mode's start (SPEC §11): the node's identity, the database threads, and the
//! PostgreSQL task store over them. Everything after that runs through the one core, woken by
//! the one `Waker`.

use std::cell::RefCell;
use std::rc::Rc;

use super::*;
use crate::pg::db::{Db, DbConfig};
use crate::pg::url::DbParams;
use crate::store::pg::{PgConfig, PgStore};
use crate::tokens::pg::TokenCache;

/// This host's name (for the node's name; `localhost` if it cannot be read).
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into the buffer we own.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match std::str::from_utf8(&buf[..end]) {
        Ok(name) if rc == 0 && !name.is_empty() => name.to_string(),
        _ => "localhost".to_string(),
    }
}

/// Starts the database threads of a new node: a fresh UUID per process (a restarted relay is a
/// new node; its predecessor's tasks come back after the lease), named `host:port` in
/// `/clients`, `/healthz` and every attempt_log entry it writes.
pub(super) fn start_node(
    cfg: &Config,
    params: &DbParams,
    port: u16,
    waker: Arc<Waker>,
    tokens: Rc<RefCell<TokenCache>>,
) -> Result<PgStore, StartError> {
    let id = uuid::Uuid::new_v4().hyphenated().to_string();
    let name = format!("{}:{port}", hostname());
    let mut db_cfg = DbConfig::new(params.clone(), id.clone(), cfg.pong_wait_ms);
    db_cfg.node_name = name.clone();
    let lease_ms = db_cfg.lease_ms;
    let wake: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
        let _ = waker.wake();
    });
    let db = Db::start(db_cfg, wake)?;
    if cfg.data_dir.is_some() {
        crate::log!(Level::Info, "cluster mode: DATA_DIR is not used (PostgreSQL keeps the tasks)");
    }
    crate::log!(Level::Info, "cluster node", node = name, node_id = id, database = params, lease_ms = lease_ms);
    let pg_cfg = PgConfig {
        task_ttl_ms: cfg.task_ttl_ms,
        failed_ttl_ms: cfg.failed_ttl_ms,
        task_timeout_ms: cfg.task_timeout_ms,
        max_retries: cfg.max_retries,
        max_pending: cfg.max_pending,
        max_pending_bytes: cfg.max_pending_bytes,
    };
    let mut store = PgStore::new(id, name, db, lease_ms, tokens, pg_cfg);
    store.resume_window_ms = cfg.resume_window_ms;
    Ok(store)
}
