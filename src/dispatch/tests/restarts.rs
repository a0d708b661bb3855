//! Regression tests of restarts from the journal, each named after a bug the dispatch model
//! (`model.rs`) found: the core with a real journal in a scratch directory, stopped and started
//! again as the reactor does it (monotonic clock at 0, the journal replayed into a new core).

use std::path::PathBuf;
use std::sync::Arc;

use super::*;
use crate::journal::Journal;

const TTL_MS: u64 = 10_000;

/// A scratch DATA_DIR, removed at the end.
struct DataDir(PathBuf);

impl DataDir {
    fn new(name: &str) -> DataDir {
        let shm = std::path::Path::new("/dev/shm");
        let base = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
        DataDir(base.join(format!("relay-restarts-{name}-{}", std::process::id())))
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// relay starts at `wall_ms` on `dir`.
fn start(dir: &DataDir, wall_ms: u64) -> Core {
    let cfg = CoreConfig { task_timeout_ms: 1_000, max_retries: 2, wait_timeout_ms: 5_000, ..CoreConfig::default() };
    let mem = crate::store::mem::MemConfig {
        task_ttl_ms: TTL_MS,
        failed_ttl_ms: 0,
        max_pending: 100,
        max_pending_bytes: 1 << 20,
        task_memory_bytes: 64 << 20,
        task_timeout_ms: 1_000,
        max_retries: 2,
    };
    let (journal, replayed) = Journal::open(&dir.0, 64 << 20, wall_ms, Arc::new(|| {})).expect("the journal opens");
    let mut store = crate::store::mem::MemStore::new(mem, Some(Box::new(journal)));
    store.set_clock(0, wall_ms);
    store.restore(replayed);
    let mut core = Core::new(cfg, Store::Mem(Box::new(store)), 0, wall_ms);
    core.set_clock(0, wall_ms);
    core.end_turn(&mut FakeIo::default());
    core
}

/// relay stops: every record on disk, the journal's writer done (before the directory goes).
fn stop(mut core: Core) {
    let _ = core.store.stop();
}

/// relay stops and starts again `downtime_ms` later.
fn restart(core: Core, dir: &DataDir, downtime_ms: u64) -> Core {
    let wall = core.wall_ms + downtime_ms;
    stop(core);
    start(dir, wall)
}

fn queued(core: &mut Core, io: &mut FakeIo, max_retries: Option<u32>) -> TaskId {
    let p = payload("{}");
    let new = NewTask { max_retries, ..NewTask::queued(&p, None) };
    let id = core.submit_direct(io, new).expect("queued");
    core.end_turn(io);
    id
}

#[test]
fn a_second_restart_makes_the_attempt_the_first_cut_short_use_up_a_retry() {
    // The first restart closes the running attempt (`restarted`: it does not count against
    // max_retries) and journals that as an attempt-end record; replaying that record lost the
    // flag, so after a second restart the cut attempt used up a retry.
    let dir = DataDir::new("retry");
    let mut c = start(&dir, 1_000_000);
    let mut io = FakeIo::default();
    join(&mut c, &mut io, conn(0), "10.0.0.1");
    let id = queued(&mut c, &mut io, Some(1));
    assert_eq!(c.task(id).expect("task").status, Status::Dispatched);
    let c = restart(c, &dir, 0);
    let mut c = restart(c, &dir, 0);
    let a = &c.task(id).expect("task").attempts[0];
    assert_eq!((a.outcome, a.restarted), (Some(Outcome::Disconnect), true), "{a:?}");
    // One real attempt fails; max_retries 1 allows one more, on the other worker.
    let mut io = FakeIo::default();
    join(&mut c, &mut io, conn(0), "10.0.0.2");
    join(&mut c, &mut io, conn(1), "10.0.0.3");
    let first = if io.tasks_to(conn(0)) == [id] { conn(0) } else { conn(1) };
    result(&mut c, &mut io, first, id, false);
    let t = c.task(id).expect("task");
    assert_eq!(t.status, Status::Dispatched, "retried, not failed: {:?}", t.attempts);
    assert_eq!(t.attempts.len(), 3);
    stop(c);
}

#[test]
fn a_task_forgotten_at_a_restart_stays_in_the_listing_index() {
    // `restore` put every task it read into the submission index before it checked whether
    // TASK_TTL had run out while relay was down; those entries were never removed.
    let dir = DataDir::new("listing");
    let mut c = start(&dir, 1_000_000);
    let mut io = FakeIo::default();
    join(&mut c, &mut io, conn(0), "10.0.0.1");
    let id = queued(&mut c, &mut io, None);
    result(&mut c, &mut io, conn(0), id, true);
    c.end_turn(&mut io);
    let c = restart(c, &dir, TTL_MS + 1);
    assert!(c.task(id).is_none(), "forgotten");
    assert_eq!(c.tasks_newest_first(u64::MAX).len(), 0, "and not listed");
    stop(c);
}

#[test]
fn a_canceled_task_comes_back_pending_once_its_forget_record_is_deleted() {
    // The journal deleted any segment nothing pinned, also in the middle of the log. Here the
    // segment with the canceled task's Forget record went while an older one (kept by another
    // waiting task) still held its submit record: the next replay found it pending again.
    let dir = DataDir::new("resurrect");
    let mut c = start(&dir, 1_000_000);
    let mut io = FakeIo::default();
    let stays = queued(&mut c, &mut io, None);
    let canceled = queued(&mut c, &mut io, None);
    let mut c = restart(c, &dir, 0);
    assert_eq!(c.cancel_direct(&mut io, canceled), CancelResult::Canceled);
    c.end_turn(&mut io);
    // Forgotten while down (its Forget record goes to a new segment), then two more starts.
    let c = restart(c, &dir, TTL_MS + 1);
    let c = restart(c, &dir, 0);
    let c = restart(c, &dir, 0);
    assert!(c.task(canceled).is_none(), "a forgotten task stays forgotten: {:?}", c.task(canceled).map(|t| t.status));
    assert_eq!(c.task(stays).map(|t| t.status), Some(Status::Pending));
    assert_eq!(c.task_count(Status::Pending), 1);
    stop(c);
}
