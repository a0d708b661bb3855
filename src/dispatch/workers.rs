//! This node's workers: who they are, what they take, their capacity, the round-robin ring, and
//! the groups a claim is made for (workers that declared the same kinds, with their free slots
//! summed), kept up to date as workers come, change and go — so that a claim round costs the
//! groups, not the workers, and "can anyone take this kind?" costs a lookup.
//!
//! Owned by the core; no I/O, no clock.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::BuildHasherDefault;
use std::net::IpAddr;

use crate::store::{MAX_TAKERS, WorkerInfo};
use crate::tasks::{ConnRef, IdHasher, TaskId};

/// Slots of one claim for a worker without a declared concurrency (the seed protocol: it may
/// take any number, but one claim must not empty the queue into one socket).
pub const UNLIMITED_SLOTS: u32 = 256;

/// What one worker accepts, as far as eligibility goes (capacity aside).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Accepts {
    /// Draining (`concurrency: 0`), or `kinds: []`.
    Nothing,
    /// No kinds declared: every task, also those without a kind.
    All,
    /// These kinds (sorted, without repeats).
    Kinds(Vec<Box<str>>),
}

impl Accepts {
    pub fn of(active: bool, kinds: Option<&[Box<str>]>) -> Accepts {
        match kinds {
            _ if !active => Accepts::Nothing,
            None => Accepts::All,
            Some([]) => Accepts::Nothing,
            Some(kinds) => {
                let mut ks: Vec<Box<str>> = kinds.to_vec();
                ks.sort_unstable();
                ks.dedup();
                Accepts::Kinds(ks)
            }
        }
    }

    /// Is this what `Accepts::of(active, kinds)` would be? (Without building it: a worker's
    /// slots change with every task, its kinds almost never.)
    pub fn same_as(&self, active: bool, kinds: Option<&[Box<str>]>) -> bool {
        match (self, kinds) {
            (Accepts::Nothing, _) if !active => true,
            _ if !active => false,
            (Accepts::All, None) => true,
            (Accepts::Nothing, Some([])) => true,
            (Accepts::Kinds(ks), Some(k)) if !k.is_empty() => {
                if k.windows(2).all(|p| p[0] < p[1]) {
                    ks.as_slice() == k
                } else {
                    *self == Accepts::of(active, kinds)
                }
            }
            _ => false,
        }
    }

    pub fn takes(&self, kind: Option<&str>) -> bool {
        match self {
            Accepts::Nothing => false,
            Accepts::All => true,
            Accepts::Kinds(kinds) => kind.is_some_and(|kind| kinds.iter().any(|k| &**k == kind)),
        }
    }

    /// The kinds a worker accepting `self` took and one accepting `after` does not (`None`:
    /// possibly any kind).
    pub fn lost(&self, after: &Accepts) -> Option<Vec<Option<Box<str>>>> {
        match (self, after) {
            (Accepts::Nothing, _) | (_, Accepts::All) => Some(Vec::new()),
            (Accepts::All, _) => None,
            (Accepts::Kinds(kinds), _) => {
                Some(kinds.iter().filter(|k| !after.takes(Some(k))).map(|k| Some(k.clone())).collect())
            }
        }
    }
}

/// How many active workers take each kind.
#[derive(Debug, Default)]
pub struct Reach {
    all: usize,
    by_kind: HashMap<Box<str>, usize>,
}

impl Reach {
    pub fn add(&mut self, accepts: &Accepts) {
        match accepts {
            Accepts::Nothing => {}
            Accepts::All => self.all += 1,
            Accepts::Kinds(kinds) => {
                for k in kinds {
                    *self.by_kind.entry(k.clone()).or_default() += 1;
                }
            }
        }
    }

    pub fn remove(&mut self, accepts: &Accepts) {
        match accepts {
            Accepts::Nothing => {}
            Accepts::All => self.all -= 1,
            Accepts::Kinds(kinds) => {
                for k in kinds {
                    if let Some(n) = self.by_kind.get_mut(k) {
                        *n -= 1;
                        if *n == 0 {
                            self.by_kind.remove(k);
                        }
                    }
                }
            }
        }
    }

    /// Active workers that take tasks of `kind`.
    pub fn count(&self, kind: Option<&str>) -> usize {
        match kind {
            // A worker that declared kinds never takes a task without one.
            None => self.all,
            Some(k) => self.all + self.by_kind.get(k).copied().unwrap_or(0),
        }
    }

    /// The kinds some worker declared (for messages: which kinds are connected).
    pub fn kinds(&self) -> impl Iterator<Item = &str> {
        self.by_kind.keys().map(|k| &**k)
    }

    pub fn takes_all(&self) -> bool {
        self.all > 0
    }
}

#[derive(Debug)]
pub struct Worker {
    pub conn: ConnRef,
    pub client_id: u128,
    pub ip: IpAddr,
    pub connected_wall_ms: u64,
    /// `None` (no hello, or a hello without kinds): every kind.
    pub kinds: Option<Vec<Box<str>>>,
    /// `None`: unlimited (the seed protocol). `Some(0)`: draining.
    pub concurrency: Option<u32>,
    pub version: Option<Box<str>>,
    pub in_flight: Vec<TaskId>,
    /// Its first text message was read, or the hello grace passed: it may be sent tasks.
    pub greeted: bool,
    /// Its output buffer was full: no task for it until it drained (SPEC §5; no attempt lost).
    pub starved: bool,
    /// The group it is counted in and the free slots it adds there (see [`Groups`]).
    pub listed: Option<(u32, u32)>,
    /// Its session (SPEC §12): the key of the core's session table.
    pub session: Option<u64>,
    /// Its hello presented a session held on another node (cluster mode): it is sent nothing
    /// until the welcome.
    pub awaiting_welcome: bool,
    /// Whether its attempts keep failing (SPEC §13: a degraded worker gets no first attempts).
    pub health: Health,
}

/// Failed attempts in a row, of different tasks, after which a worker is degraded — when
/// another worker succeeded at one of those tasks' kinds meanwhile.
pub const DEGRADE_AFTER: usize = 5;
/// A degraded worker's first cool-down; it doubles each time it is degraded again without a
/// success in between, up to [`COOL_DOWN_MAX_MS`].
pub const COOL_DOWN_MIN_MS: u64 = 5_000;
pub const COOL_DOWN_MAX_MS: u64 = 300_000;

/// A worker's recent failures (SPEC §13, "failing workers are avoided"): the last
/// [`DEGRADE_AFTER`] attempts that failed (`failed` or `timeout` — not a permanent failure, which
/// is the task's, nor a lost connection), one per task, since its last success.
#[derive(Debug, Default, Clone)]
pub struct Health {
    /// (task, its kind, when the attempt ended: monotonic ms), oldest first.
    failed: std::collections::VecDeque<(TaskId, Option<Box<str>>, u64)>,
    /// Times it was degraded since its last success.
    pub level: u32,
    /// No first attempts before this (monotonic ms).
    pub until_ms: u64,
}

impl Health {
    /// A success: healthy again.
    pub fn on_done(&mut self) {
        if !self.failed.is_empty() || self.level > 0 {
            *self = Health::default();
        }
    }

    /// A failed attempt of task `id`. `others_succeeded(kind, since)`: did another worker
    /// succeed at `kind` at or after `since`? Returns whether it became degraded now.
    pub fn on_failed(
        &mut self,
        id: TaskId,
        kind: Option<&str>,
        now_ms: u64,
        others_succeeded: impl Fn(Option<&str>, u64) -> bool,
    ) -> bool {
        if self.failed.iter().any(|(t, ..)| *t == id) {
            // (The same task again, as `any_worker` retries do: one task counts once.)
            return false;
        }
        self.failed.push_back((id, kind.map(Box::from), now_ms));
        if self.failed.len() > DEGRADE_AFTER {
            self.failed.pop_front();
        }
        if self.failed.len() < DEGRADE_AFTER || self.degraded(now_ms) {
            return false;
        }
        let since = self.failed.front().map_or(now_ms, |f| f.2);
        if !self.failed.iter().any(|(_, k, _)| others_succeeded(k.as_deref(), since)) {
            return false;
        }
        self.level += 1;
        let cool = COOL_DOWN_MIN_MS.saturating_mul(1 << (self.level - 1).min(16)).min(COOL_DOWN_MAX_MS);
        self.until_ms = now_ms + cool;
        true
    }

    pub fn degraded(&self, now_ms: u64) -> bool {
        now_ms < self.until_ms
    }
}

impl Worker {
    pub fn new(conn: ConnRef, client_id: u128, ip: IpAddr, connected_wall_ms: u64) -> Worker {
        Worker {
            conn,
            client_id,
            ip,
            connected_wall_ms,
            kinds: None,
            concurrency: None,
            version: None,
            in_flight: Vec::new(),
            greeted: false,
            starved: false,
            listed: None,
            session: None,
            health: Health::default(),
            awaiting_welcome: false,
        }
    }

    pub fn active(&self) -> bool {
        self.concurrency != Some(0)
    }

    /// May be sent a task now (capacity and kind aside).
    pub fn ready(&self) -> bool {
        self.greeted && self.active() && !self.starved
    }

    pub fn accepts(&self, kind: Option<&str>) -> bool {
        self.active()
            && match &self.kinds {
                None => true,
                Some(kinds) => kind.is_some_and(|k| kinds.iter().any(|own| &**own == k)),
            }
    }

    pub fn acceptance(&self) -> Accepts {
        Accepts::of(self.active(), self.kinds.as_deref())
    }

    pub fn has_capacity(&self) -> bool {
        self.cap().is_none_or(|c| self.in_flight.len() < c as usize)
    }

    /// The most attempts it runs at once: its concurrency; a session worker at most
    /// MAX_RUNNING_LISTED, as many as a resume's `running` is read for (SPEC §12: a held
    /// attempt beyond it could not be listed, and would end while the worker still ran it).
    fn cap(&self) -> Option<u32> {
        let listed = super::sessions::MAX_RUNNING_LISTED as u32;
        match self.concurrency {
            Some(c) if self.session.is_some() => Some(c.min(listed)),
            None if self.session.is_some() => Some(listed),
            c => c,
        }
    }

    /// Slots a claim may fill now.
    fn free_slots(&self) -> u32 {
        if !self.ready() {
            return 0;
        }
        let in_flight = self.in_flight.len() as u32;
        let slots = match self.concurrency {
            Some(c) => c,
            None => UNLIMITED_SLOTS.saturating_sub(in_flight).max(1).saturating_add(in_flight),
        };
        slots.min(self.cap().unwrap_or(u32::MAX)).saturating_sub(in_flight)
    }

    pub fn info(&self, node: Option<&str>) -> WorkerInfo {
        WorkerInfo {
            client_id: self.client_id,
            ip: self.ip.to_string(),
            connected_wall_ms: self.connected_wall_ms,
            active: self.active(),
            in_flight: self.in_flight.len() as u32,
            kinds: self.kinds.as_ref().map(|k| k.iter().map(|s| s.to_string()).collect()),
            concurrency: self.concurrency,
            version: self.version.as_ref().map(|v| v.to_string()),
            node: node.map(str::to_string),
            node_id: None,
            resumable_until_wall_ms: None,
            degraded: false,
        }
    }
}

/// Workers that accept the same kinds, with room: one claim asks for all of them.
#[derive(Debug)]
pub struct Group {
    pub accepts: Accepts,
    /// Free slots of the members (each counted at most [`UNLIMITED_SLOTS`]).
    pub free: u64,
    /// Slots of members with free slots.
    pub members: BTreeSet<u32>,
    /// Slots asked for by the claim not answered yet (a database's claims are in flight).
    pub asked: u64,
    /// Where the next claim's takers start among the members (they rotate).
    pub next_taker: u32,
    /// Slots promised to submits that will not wait (`runs_now`) and not claimed yet: a batch
    /// of items in one step must not all count on the same free slot.
    pub offered: u64,
}

#[derive(Debug, Default)]
pub struct Groups {
    by_accepts: HashMap<Accepts, u32>,
    /// (Keys are this node's own numbers: a fast hash, not SipHash, on this hot path.)
    pub groups: HashMap<u32, Group, BuildHasherDefault<IdHasher>>,
    next_id: u32,
}

impl Groups {
    /// A worker's capacity or acceptance may have changed: its place in the groups follows.
    /// Returns whether a claim may now find it something it could not before (it gained free
    /// slots, or joined another group).
    pub fn refresh(&mut self, slot: u32, w: &mut Worker) -> bool {
        let free = w.free_slots();
        let (active, kinds) = (w.active(), w.kinds.as_deref());
        let takes_some = active && kinds.is_none_or(|k| !k.is_empty());
        let want = (free > 0 && takes_some).then_some(free);
        if let Some((gid, was)) = w.listed {
            let same_group = want.is_some() && self.groups.get(&gid).is_some_and(|g| g.accepts.same_as(active, kinds));
            if same_group && Some(was) == want {
                return false;
            }
            if let (true, Some(free)) = (same_group, want) {
                // Only its free slots changed (a task sent, or one ended): it stays a member.
                if let Some(g) = self.groups.get_mut(&gid) {
                    g.free = g.free - u64::from(was) + u64::from(free);
                }
                w.listed = Some((gid, free));
                return free > was;
            }
            // It leaves its group (no free slot, or it takes other kinds now).
            if let Some(g) = self.groups.get_mut(&gid) {
                g.free -= u64::from(was);
                g.members.remove(&slot);
                if g.members.is_empty() && g.asked == 0 {
                    self.by_accepts.remove(&g.accepts);
                    self.groups.remove(&gid);
                }
            }
            w.listed = None;
        }
        let Some(free) = want else { return false };
        let gid = self.group_of(w.acceptance());
        if let Some(g) = self.groups.get_mut(&gid) {
            g.free += u64::from(free);
            g.members.insert(slot);
        }
        w.listed = Some((gid, free));
        true
    }

    /// The group of workers that accept this (a new one when there is none).
    fn group_of(&mut self, accepts: Accepts) -> u32 {
        match self.by_accepts.get(&accepts) {
            Some(&gid) => gid,
            None => {
                self.next_id = self.next_id.wrapping_add(1);
                let gid = self.next_id;
                self.by_accepts.insert(accepts.clone(), gid);
                self.groups.insert(
                    gid,
                    Group { accepts, free: 0, members: BTreeSet::new(), asked: 0, next_taker: 0, offered: 0 },
                );
                gid
            }
        }
    }

    /// A worker leaves: it is no longer counted.
    pub fn remove(&mut self, slot: u32, w: &mut Worker) {
        w.concurrency = Some(0);
        self.refresh(slot, w);
    }

    /// Up to [`MAX_TAKERS`] members of a group, starting where the last claim's stopped, into
    /// `out` (cleared first; the caller's buffer, reused claim after claim).
    pub fn takers_into(&mut self, gid: u32, client_of: impl Fn(u32) -> Option<u128>, out: &mut Vec<u128>) {
        out.clear();
        let Some(g) = self.groups.get_mut(&gid) else { return };
        let start = g.next_taker;
        let mut last = None;
        for &slot in g.members.range(start..).chain(g.members.range(..start)).take(MAX_TAKERS) {
            last = Some(slot);
            out.extend(client_of(slot));
        }
        if let Some(last) = last {
            g.next_taker = last.wrapping_add(1);
        }
    }

    #[cfg(test)]
    pub fn takers(&mut self, gid: u32, client_of: impl Fn(u32) -> Option<u128>) -> Vec<u128> {
        let mut out = Vec::new();
        self.takers_into(gid, client_of, &mut out);
        out
    }

    /// The slots promised to submits were claimed (or the submits stored nothing).
    pub fn forget_offers(&mut self) {
        for g in self.groups.values_mut() {
            g.offered = 0;
        }
    }

    /// A group's claim was answered (or failed): it may claim again.
    pub fn answered(&mut self, gid: u32) {
        if let Some(g) = self.groups.get_mut(&gid) {
            g.asked = 0;
            g.offered = 0;
            if g.members.is_empty() && g.asked == 0 {
                self.by_accepts.remove(&g.accepts);
                self.groups.remove(&gid);
            }
        }
    }

    pub fn contains(&self, gid: u32, slot: u32) -> bool {
        self.groups.get(&gid).is_some_and(|g| g.members.contains(&slot))
    }
}

/// Distinct kinds, at most `max`, for a message ("connected workers take: ...").
pub fn kinds_list(reach: &Reach, remote: &[WorkerInfo], max: usize) -> (Vec<String>, bool) {
    let mut set: HashSet<&str> = reach.kinds().collect();
    for w in remote.iter().filter(|w| w.active) {
        for k in w.kinds.iter().flatten() {
            set.insert(k);
        }
    }
    let mut kinds: Vec<String> = set.into_iter().map(str::to_string).collect();
    kinds.sort_unstable();
    let more = kinds.len() > max;
    kinds.truncate(max);
    (kinds, more)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn five_failures_of_five_tasks_while_others_succeed_degrade_for_a_growing_cool_down() {
        let mut h = Health::default();
        let yes = |_: Option<&str>, _: u64| true;
        for t in 0..4 {
            assert!(!h.on_failed(t, Some("k"), 100, yes));
        }
        // The same task again does not count.
        assert!(!h.on_failed(3, Some("k"), 100, yes));
        // Nobody else succeeded: a bad upstream, not a bad worker.
        assert!(!h.on_failed(4, Some("k"), 100, |_, _| false));
        assert!(h.on_failed(5, Some("k"), 200, yes));
        assert!(h.degraded(200) && h.degraded(5_199) && !h.degraded(5_200));
        // Failing on after the cool-down: degraded again, twice as long.
        assert!(h.on_failed(6, Some("k"), 6_000, yes));
        assert_eq!(h.until_ms, 16_000);
        for t in 7..40 {
            h.on_failed(t, Some("k"), h.until_ms, yes);
        }
        assert!(h.until_ms - (h.until_ms - COOL_DOWN_MAX_MS) <= COOL_DOWN_MAX_MS);
        h.on_done();
        assert!(!h.degraded(0) && h.level == 0);
    }

    fn kinds(ks: &[&str]) -> Accepts {
        Accepts::Kinds(ks.iter().map(|k| Box::from(*k)).collect())
    }

    #[test]
    fn counts_follow_workers() {
        let mut reach = Reach::default();
        let a = Accepts::of(true, Some(&[Box::from("b"), Box::from("a"), Box::from("a")]));
        assert_eq!(a, kinds(&["a", "b"]), "sorted, repeats count once");
        reach.add(&a);
        reach.add(&Accepts::All);
        assert_eq!((reach.count(Some("a")), reach.count(Some("c")), reach.count(None)), (2, 1, 1));
        reach.remove(&Accepts::All);
        assert_eq!((reach.count(Some("a")), reach.count(None)), (1, 0));
        reach.remove(&a);
        assert!(reach.by_kind.is_empty(), "keys go with their last worker");
        assert_eq!(Accepts::of(false, None), Accepts::Nothing);
        assert_eq!(Accepts::of(true, Some(&[])), Accepts::Nothing);
    }

    #[test]
    fn lost_kinds() {
        let sorted = |v: Option<Vec<Option<Box<str>>>>| {
            v.map(|mut v| {
                v.sort();
                v
            })
        };
        let some = |ks: &[&str]| Some(ks.iter().map(|k| Some(Box::from(*k))).collect::<Vec<_>>());
        assert_eq!(Accepts::All.lost(&Accepts::All), Some(vec![]));
        assert_eq!(Accepts::All.lost(&Accepts::Nothing), None);
        assert_eq!(Accepts::All.lost(&kinds(&["a"])), None);
        assert_eq!(sorted(kinds(&["a", "b", "z"]).lost(&kinds(&["b"]))), some(&["a", "z"]));
        assert_eq!(kinds(&["a"]).lost(&Accepts::All), Some(vec![]));
        assert_eq!(Accepts::Nothing.lost(&Accepts::Nothing), Some(vec![]));
    }

    #[test]
    fn groups_sum_free_slots_of_workers_that_take_the_same() {
        let ip: IpAddr = "127.0.0.1".parse().expect("ip");
        let mut groups = Groups::default();
        let mut w1 = Worker::new(ConnRef { slot: 1, generation: 1 }, 11, ip, 0);
        let mut w2 = Worker::new(ConnRef { slot: 2, generation: 1 }, 22, ip, 0);
        for (slot, w) in [(1, &mut w1), (2, &mut w2)] {
            w.greeted = true;
            w.concurrency = Some(3);
            w.kinds = Some(vec!["b".into(), "a".into()]);
            groups.refresh(slot, w);
        }
        assert_eq!(groups.groups.len(), 1);
        let (&gid, g) = groups.groups.iter().next().expect("a group");
        assert_eq!((g.free, g.members.len()), (6, 2));
        w1.in_flight.push(7);
        groups.refresh(1, &mut w1);
        assert_eq!(groups.groups[&gid].free, 5);
        w1.starved = true;
        groups.refresh(1, &mut w1);
        assert_eq!((groups.groups[&gid].free, groups.groups[&gid].members.len()), (3, 1));
        assert_eq!(groups.takers(gid, |s| Some(u128::from(s) * 11)), vec![22]);
        w2.kinds = None;
        groups.refresh(2, &mut w2);
        assert!(!groups.groups.contains_key(&gid), "an empty group goes");
        assert_eq!(groups.groups.len(), 1);
        groups.remove(2, &mut w2);
        assert!(groups.groups.is_empty());
    }

    #[test]
    fn same_as_answers_what_of_would_build() {
        let k = |names: &[&str]| names.iter().map(|n| Box::<str>::from(*n)).collect::<Vec<_>>();
        let lists: Vec<Option<Vec<Box<str>>>> =
            vec![None, Some(k(&[])), Some(k(&["a"])), Some(k(&["a", "b"])), Some(k(&["b", "a"])), Some(k(&["a", "a"]))];
        for active in [true, false] {
            for kinds in &lists {
                let built = Accepts::of(active, kinds.as_deref());
                for other_active in [true, false] {
                    for other in &lists {
                        let want = Accepts::of(other_active, other.as_deref()) == built;
                        assert_eq!(
                            built.same_as(other_active, other.as_deref()),
                            want,
                            "{built:?} vs {other_active} {other:?}"
                        );
                    }
                }
            }
        }
    }
}
