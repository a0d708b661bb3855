//! Byte budgets shared by connections, with the connections waiting for room: the disk budget
//! of uploads (file bytes handed to the disk thread and not yet written) and the batch budget
//! (`POST /tasks/batch` bodies buffered at once). A connection that finds one full stops, and is
//! remembered, so that the release that frees room wakes every connection waiting on it — not
//! only the one whose bytes were released.

use std::collections::{HashMap, HashSet};

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

/// The batch budget: the bytes of `POST /tasks/batch` bodies buffered at once. A body holds what
/// has arrived (reserved a read ahead), not what its head declared, so bodies that trickle in or
/// stall hold little and an honest batch is read beside them (issue 19: four stalled 64 MiB
/// declarations kept a 2.3 MB batch waiting 9 s).
///
/// Growing by arrival could deadlock — every body half read, the budget gone, each waiting for
/// room the others hold — so a body grows only while the budget stays *safe* (the banker's
/// rule): some order exists in which every body under way can be read whole, each releasing
/// what it holds when it is parsed. While at least the largest body's size is free this holds
/// at once; only near the limit are the bodies' needs looked at.
pub(super) struct BatchBudget {
    limit_bytes: usize,
    /// The most one body may need in all (its head's Content-Length, or the limit when chunked).
    max_body_bytes: usize,
    used_bytes: usize,
    /// Each body under way: (the most it may need in all, what it holds).
    bodies: HashMap<ConnRef, (usize, usize)>,
    waiting: HashSet<ConnRef>,
}

impl BatchBudget {
    pub(super) fn new(limit_bytes: usize, max_body_bytes: usize) -> BatchBudget {
        BatchBudget {
            limit_bytes: limit_bytes.max(max_body_bytes),
            max_body_bytes,
            used_bytes: 0,
            bodies: HashMap::new(),
            waiting: HashSet::new(),
        }
    }

    /// Grows what `r` holds to `want` bytes (of a body that may need `declared` in all); `false`
    /// when that would leave the budget over its limit or unsafe (then `r` should [`wait`]).
    pub(super) fn grow(&mut self, r: ConnRef, declared: usize, want: usize) -> bool {
        let declared = declared.min(self.max_body_bytes);
        let want = want.min(declared);
        let held = self.bodies.get(&r).map_or(0, |&(_, held)| held);
        if want <= held {
            return true;
        }
        let step = want - held;
        let used = self.used_bytes + step;
        if used > self.limit_bytes {
            return false;
        }
        let free = self.limit_bytes - used;
        if free < self.max_body_bytes && !self.safe_with(r, declared, want, free) {
            return false;
        }
        self.used_bytes = used;
        self.bodies.insert(r, (declared, want));
        true
    }

    /// Whether, with `r` holding `want` of `declared`, every body could still be read whole:
    /// the smallest need first, each adding what it held to the free bytes once it is done.
    fn safe_with(&self, r: ConnRef, declared: usize, want: usize, mut free: usize) -> bool {
        let mut bodies: Vec<(usize, usize)> = self
            .bodies
            .iter()
            .filter(|(c, _)| **c != r)
            .map(|(_, &(d, held))| (d.saturating_sub(held), held))
            .collect();
        bodies.push((declared - want, want));
        bodies.sort_unstable();
        for (need, held) in bodies {
            if need > free {
                return false;
            }
            free += held;
        }
        true
    }

    /// `r` could not grow: wake it when there is room. `true` the first time (until woken).
    pub(super) fn wait(&mut self, r: ConnRef) -> bool {
        self.waiting.insert(r)
    }

    /// `r`'s body is parsed (or its connection gone): what it held is free again. Returns the
    /// connections to wake (every one that waited).
    pub(super) fn release(&mut self, r: ConnRef) -> Vec<ConnRef> {
        self.waiting.remove(&r);
        let Some((_, held)) = self.bodies.remove(&r) else { return Vec::new() };
        self.used_bytes = self.used_bytes.saturating_sub(held);
        self.waiting.drain().collect()
    }

    #[cfg(test)]
    fn used_bytes(&self) -> usize {
        self.used_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(slot: u32) -> ConnRef {
        ConnRef { slot, generation: 1 }
    }

    #[test]
    fn batch_bodies_hold_what_arrived_and_never_deadlock() {
        // Four stalled bodies that declared the largest size hold what they sent, not it.
        let mut b = BatchBudget::new(400, 100);
        for s in 1..=4 {
            assert!(b.grow(conn(s), 100, 10), "a first read");
        }
        assert!(b.grow(conn(9), 90, 90), "an honest body beside four stalled ones");
        assert_eq!(b.used_bytes(), 130);
        assert!(b.release(conn(9)).is_empty());
        // Bodies growing together stop before no order could finish them all: with 400 bytes
        // and five bodies of 100, one must wait while the others can finish.
        let mut b = BatchBudget::new(400, 100);
        let mut held = [0usize; 5];
        let mut progress = true;
        while progress {
            progress = false;
            for (s, held) in held.iter_mut().enumerate() {
                if *held < 100 && b.grow(conn(s as u32), 100, *held + 10) {
                    *held += 10;
                    progress = true;
                }
            }
        }
        assert!(b.used_bytes() <= 400);
        let done: Vec<usize> = (0..5).filter(|&s| held[s] == 100).collect();
        assert!(!done.is_empty(), "some body can always be read whole: {held:?}");
        // Each finished body's release lets the rest go on, until all are read.
        for s in 0..5u32 {
            b.wait(conn(s));
        }
        let mut finished = 0;
        while finished < 5 {
            let s = (0..5).find(|&s| held[s] == 100).expect("a body that finished");
            held[s] = usize::MAX;
            b.release(conn(s as u32));
            finished += 1;
            for (t, held) in held.iter_mut().enumerate() {
                while *held < 100 && b.grow(conn(t as u32), 100, *held + 10) {
                    *held += 10;
                }
            }
        }
        assert_eq!(b.used_bytes(), 0);
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
