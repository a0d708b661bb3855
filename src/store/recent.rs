//! Attempts that ended recently, by (task, worker): what tells a late or duplicate result from
//! an unknown one once the store holds no attempt log for its task (SPEC §5: `unknown` is a task
//! this worker was never sent). The memory store remembers here the attempts of tasks it drops
//! from memory; the PostgreSQL store the attempts that ended on its node.

use crate::metrics::Ignored;
use crate::tasks::TaskId;

/// Attempts remembered at most (a power of two).
const RECENT_RESULTS: usize = 65_536;

/// (task, worker) of attempts that ended here recently, and whether the worker answered (a
/// late result names its attempt also after the task itself is gone). A set-associative cache
/// of [`RECENT_RESULTS`] entries: four ways a set, one cache line, the oldest of a set goes
/// first; an entry is the two ids folded to 64 bits each (bit 1 of the worker's: in use; bit 0:
/// answered). Nothing is allocated until the first attempt ends.
#[derive(Default)]
pub struct Recent {
    sets: Vec<[(u64, u64); RECENT_WAYS]>,
}

const RECENT_WAYS: usize = 4;

impl Recent {
    fn fold(id: u128) -> u64 {
        (id as u64) ^ ((id >> 64) as u64)
    }

    /// The set of `task`, and the entry's two halves (without the answered bit).
    fn slot(&mut self, task: TaskId, worker: u128) -> (&mut [(u64, u64); RECENT_WAYS], u64, u64) {
        if self.sets.is_empty() {
            self.sets = vec![[(0, 0); RECENT_WAYS]; RECENT_RESULTS / RECENT_WAYS];
        }
        let t = Self::fold(task);
        let w = (Self::fold(worker) & !3) | 2;
        let mask = self.sets.len() - 1;
        (&mut self.sets[(t as usize) & mask], t, w)
    }

    pub fn remember(&mut self, task: TaskId, worker: u128, answered: bool) {
        let (set, t, w) = self.slot(task, worker);
        let entry = (t, w | u64::from(answered));
        match set.iter().position(|&(et, ew)| et == t && ew & !1 == w) {
            Some(i) => set[i] = entry,
            None => {
                set.copy_within(0..RECENT_WAYS - 1, 1);
                set[0] = entry;
            }
        }
    }

    pub fn stray(&mut self, task: TaskId, worker: u128) -> Option<Ignored> {
        if self.sets.is_empty() {
            return None;
        }
        let (set, t, w) = self.slot(task, worker);
        let e = set.iter_mut().find(|(et, ew)| *et == t && *ew & !1 == w)?;
        let why = if e.1 & 1 == 1 { Ignored::Duplicate } else { Ignored::Late };
        e.1 |= 1;
        Some(why)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_attempts_tell_late_from_duplicate_and_forget_the_oldest_of_a_set() {
        // (Worker ids as real ones differ: not only in their lowest bits, which the cache drops.)
        const W7: u128 = 7 << 70;
        const W8: u128 = 8 << 70;
        const W9: u128 = 9 << 70;
        let mut r = Recent::default();
        assert_eq!(r.stray(1, W7), None, "nothing remembered yet");
        r.remember(1, W7, false);
        r.remember(1, W8, true);
        assert_eq!(r.stray(1, W9), None, "a worker never sent it");
        assert_eq!(r.stray(1, W7), Some(Ignored::Late));
        assert_eq!(r.stray(1, W7), Some(Ignored::Duplicate), "a second answer to the same attempt");
        assert_eq!(r.stray(1, W8), Some(Ignored::Duplicate));
        // Task ids that land in one set: the fifth pushes the oldest out.
        let set_mate = |n: u128| 1 + (n << 20);
        for n in 1..=RECENT_WAYS as u128 - 1 {
            r.remember(set_mate(n), W7, false);
        }
        assert_eq!(r.stray(1, W8), Some(Ignored::Duplicate), "four ways: still there");
        r.remember(set_mate(99), W7, false);
        assert_eq!(r.stray(1, W7), None, "the oldest of the set went");
        assert_eq!(r.stray(set_mate(99), W7), Some(Ignored::Late));
    }
}
