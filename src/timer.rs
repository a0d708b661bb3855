//! A hashed timer wheel with 1 ms ticks. Time is passed in (monotonic milliseconds from the
//! reactor); nothing here reads a clock.
//!
//! Entries live in a slab and are linked into per-slot lists, so arming, cancelling and firing
//! are O(1). A handle carries the entry's generation: cancelling a timer that already fired (or
//! whose entry was reused) is a no-op, never a wrong cancel. An entry further away than one turn
//! of the wheel stays in its slot and is skipped until its turn comes.

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TimerHandle {
    index: u32,
    generation: u32,
}

struct Entry<T> {
    deadline_ms: u64,
    generation: u32,
    prev: u32,
    next: u32,
    slot: u32,
    payload: Option<T>,
}

pub struct Wheel<T> {
    slots: Vec<u32>,
    occupied: Vec<u64>,
    entries: Vec<Entry<T>>,
    free_head: u32,
    /// The last tick whose slot has been processed.
    current_tick: u64,
    len: usize,
}

impl<T> Wheel<T> {
    /// `slot_count` is rounded up to a power of two (at least 64).
    pub fn new(slot_count: usize, now_ms: u64) -> Wheel<T> {
        let n = slot_count.max(64).next_power_of_two();
        Wheel {
            slots: vec![NIL; n],
            occupied: vec![0; n / 64],
            entries: Vec::new(),
            free_head: NIL,
            current_tick: now_ms,
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn mask(&self) -> u64 {
        self.slots.len() as u64 - 1
    }

    /// Arms a timer that fires at the first `advance` whose `now_ms >= deadline_ms`.
    pub fn arm(&mut self, deadline_ms: u64, payload: T) -> TimerHandle {
        let tick = deadline_ms.max(self.current_tick + 1);
        let slot = (tick & self.mask()) as u32;
        let index = if self.free_head != NIL {
            let index = self.free_head;
            self.free_head = self.entries[index as usize].next;
            index
        } else {
            self.entries.push(Entry { deadline_ms: 0, generation: 0, prev: NIL, next: NIL, slot: 0, payload: None });
            (self.entries.len() - 1) as u32
        };
        let head = self.slots[slot as usize];
        let entry = &mut self.entries[index as usize];
        entry.deadline_ms = deadline_ms;
        entry.prev = NIL;
        entry.next = head;
        entry.slot = slot;
        entry.payload = Some(payload);
        let generation = entry.generation;
        if head != NIL {
            self.entries[head as usize].prev = index;
        }
        self.slots[slot as usize] = index;
        self.occupied[slot as usize / 64] |= 1 << (slot % 64);
        self.len += 1;
        TimerHandle { index, generation }
    }

    /// Cancels a pending timer and returns its payload; `None` if it already fired or was
    /// cancelled.
    pub fn cancel(&mut self, handle: TimerHandle) -> Option<T> {
        let entry = self.entries.get(handle.index as usize)?;
        if entry.generation != handle.generation || entry.payload.is_none() {
            return None;
        }
        Some(self.remove(handle.index))
    }

    fn remove(&mut self, index: u32) -> T {
        let (prev, next, slot) = {
            let e = &self.entries[index as usize];
            (e.prev, e.next, e.slot)
        };
        if prev != NIL {
            self.entries[prev as usize].next = next;
        } else {
            self.slots[slot as usize] = next;
            if next == NIL {
                self.occupied[slot as usize / 64] &= !(1 << (slot % 64));
            }
        }
        if next != NIL {
            self.entries[next as usize].prev = prev;
        }
        let entry = &mut self.entries[index as usize];
        entry.generation = entry.generation.wrapping_add(1);
        entry.next = self.free_head;
        entry.prev = NIL;
        self.free_head = index;
        self.len -= 1;
        entry.payload.take().expect("a linked timer entry has a payload")
    }

    /// Fires every timer due at `now_ms`, appending payloads to `fired`.
    pub fn advance(&mut self, now_ms: u64, fired: &mut Vec<T>) {
        if now_ms <= self.current_tick {
            return;
        }
        let slot_count = self.slots.len() as u64;
        let steps = (now_ms - self.current_tick).min(slot_count);
        for step in 1..=steps {
            let slot = ((self.current_tick + step) & self.mask()) as usize;
            if self.occupied[slot / 64] & (1 << (slot % 64)) == 0 {
                continue;
            }
            let mut index = self.slots[slot];
            while index != NIL {
                let next = self.entries[index as usize].next;
                if self.entries[index as usize].deadline_ms <= now_ms {
                    fired.push(self.remove(index));
                }
                index = next;
            }
        }
        self.current_tick = now_ms;
    }

    /// The tick at which `advance` next has a slot to look at, or `None` when nothing is armed.
    /// It may be earlier than the next real deadline (an entry waiting for a later turn).
    pub fn next_wakeup_ms(&self) -> Option<u64> {
        if self.len == 0 {
            return None;
        }
        let n = self.slots.len();
        let start = ((self.current_tick + 1) & self.mask()) as usize;
        // Scan the bitmap circularly from `start`, one 64-bit word at a time.
        let words = self.occupied.len();
        for i in 0..=words {
            let w = (start / 64 + i) % words;
            let mut bits = self.occupied[w];
            if i == 0 {
                bits &= u64::MAX << (start % 64);
            } else if i == words {
                bits &= !(u64::MAX << (start % 64));
            }
            if bits != 0 {
                let slot = w * 64 + bits.trailing_zeros() as usize;
                let distance = (slot + n - start) % n;
                return Some(self.current_tick + 1 + distance as u64);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Arms `(deadline, id)` pairs, advances through `steps`, and compares what fired at each.
    fn check(arms: &[(u64, u32)], cancels: &[u32], steps: &[(u64, &[u32])]) {
        let mut wheel = Wheel::new(64, 0);
        let handles: Vec<(u32, TimerHandle)> = arms.iter().map(|&(d, id)| (id, wheel.arm(d, id))).collect();
        for id in cancels {
            let handle = handles.iter().find(|(i, _)| i == id).expect("known id").1;
            assert_eq!(wheel.cancel(handle), Some(*id));
            assert_eq!(wheel.cancel(handle), None, "second cancel is a no-op");
        }
        for (now, expected) in steps {
            let mut fired = Vec::new();
            wheel.advance(*now, &mut fired);
            fired.sort_unstable();
            assert_eq!(&fired[..], *expected, "at {now} ms (arms {arms:?})");
        }
    }

    #[test]
    fn firing_table() {
        check(&[(10, 1), (5, 2)], &[], &[(4, &[]), (5, &[2]), (9, &[]), (10, &[1]), (100, &[])]);
        check(&[(10, 1), (10, 2), (11, 3)], &[2], &[(10, &[1]), (11, &[3])]);
        // Further than one turn of the 64-slot wheel: skipped on the first pass.
        check(&[(70, 1), (6, 2)], &[], &[(6, &[2]), (64, &[]), (69, &[]), (70, &[1])]);
        // A long jump fires everything due at once.
        check(&[(3, 1), (500, 2), (10_000, 3)], &[], &[(1_000, &[1, 2]), (20_000, &[3])]);
        // A deadline in the past fires on the next advance.
        check(&[(0, 1)], &[], &[(1, &[1])]);
    }

    #[test]
    fn handles_are_generation_safe() {
        let mut wheel = Wheel::new(64, 0);
        let old = wheel.arm(5, "old");
        let mut fired = Vec::new();
        wheel.advance(5, &mut fired);
        assert_eq!(fired, ["old"]);
        let new = wheel.arm(9, "new");
        assert_eq!(wheel.cancel(old), None, "stale handle must not cancel the new occupant");
        assert_eq!(wheel.len(), 1);
        assert_eq!(wheel.cancel(new), Some("new"));
        assert!(wheel.is_empty());
    }

    #[test]
    fn next_wakeup() {
        let mut wheel: Wheel<u8> = Wheel::new(64, 100);
        assert_eq!(wheel.next_wakeup_ms(), None);
        let h = wheel.arm(130, 1);
        assert_eq!(wheel.next_wakeup_ms(), Some(130));
        wheel.arm(110, 2);
        assert_eq!(wheel.next_wakeup_ms(), Some(110));
        wheel.arm(100 + 64 + 5, 3); // same slot as 105, next turn
        assert_eq!(wheel.next_wakeup_ms(), Some(105));
        let mut fired = Vec::new();
        wheel.advance(110, &mut fired);
        assert_eq!(fired, [2]);
        assert_eq!(wheel.next_wakeup_ms(), Some(130));
        wheel.cancel(h);
        assert_eq!(wheel.next_wakeup_ms(), Some(169));
    }
}
