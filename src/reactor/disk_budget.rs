//! A byte budget shared by connections, with the connections waiting for room: the disk budget
//! of uploads (file bytes handed to the disk thread and not yet written) and the batch budget
//! (`POST /tasks/batch` bodies buffered at once). A connection that finds it full stops, and is
//! remembered, so that the release that frees room wakes every connection waiting on it — not
//! only the one whose bytes were released.

use std::collections::HashSet;

use crate::tasks::ConnRef;

pub(super) struct DiskBudget {
    limit_bytes: usize,
    used_bytes: usize,
    /// Uploads stopped because the budget was full (bounded by the connections).
    waiting: HashSet<ConnRef>,
}

impl DiskBudget {
    pub(super) fn new(limit_bytes: usize) -> DiskBudget {
        DiskBudget { limit_bytes, used_bytes: 0, waiting: HashSet::new() }
    }

    pub(super) fn is_full(&self) -> bool {
        self.used_bytes >= self.limit_bytes
    }

    pub(super) fn take(&mut self, bytes: usize) {
        self.used_bytes += bytes;
    }

    /// Takes `bytes` if they fit (or if nothing is taken: one request may use it all).
    pub(super) fn try_take(&mut self, bytes: usize) -> bool {
        if self.used_bytes > 0 && self.used_bytes + bytes > self.limit_bytes {
            return false;
        }
        self.used_bytes += bytes;
        true
    }

    /// `r` stopped because the budget is full: wake it when there is room.
    /// `true` the first time (until woken).
    pub(super) fn wait(&mut self, r: ConnRef) -> bool {
        self.waiting.insert(r)
    }

    /// `bytes` were written. Returns the uploads to wake (every one that waited, once there
    /// is room again).
    pub(super) fn release(&mut self, bytes: usize) -> Vec<ConnRef> {
        self.used_bytes = self.used_bytes.saturating_sub(bytes);
        if self.is_full() { Vec::new() } else { self.waiting.drain().collect() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(slot: u32) -> ConnRef {
        ConnRef { slot, generation: 1 }
    }

    #[test]
    fn uploads_held_back_only_by_the_disk_budget_are_never_woken() {
        // Issue 10 #6: a write completing woke only its own upload; others stopped by the
        // global budget waited until HEADER_TIMEOUT and got 408.
        let mut b = DiskBudget::new(100);
        b.take(100);
        assert!(b.is_full());
        for s in [2, 3, 3] {
            b.wait(conn(s));
        }
        assert!(b.release(0).is_empty(), "still full: nobody to wake");
        let mut woken = b.release(10);
        woken.sort_by_key(|r| r.slot);
        assert_eq!(woken, [conn(2), conn(3)], "every waiting upload, once");
        assert!(b.release(10).is_empty(), "woken uploads are forgotten");
        assert!(!b.is_full());
    }
}
