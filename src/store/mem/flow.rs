//! The memory store's flow control (SPEC §14): each kind's counts, policy and token bucket, the
//! fair-share rotation of its ready tasks, and the per-key limits of its lanes.
//!
//! A *lane* is (kind, submitter, key): the ready tasks of one key of one submitter, in priority
//! order (due − priority, then submission). Each kind (and tasks without a kind) keeps a
//! [`Rotation`] over its lanes: its submitters with an open lane, least recently served first,
//! then that submitter's open lanes the same way, then the lane's first task. Serving a lane
//! stamps it and its submitter with the kind's next count; a lane or submitter that newly has a
//! task to give joins with the current count (at the back); ties go by name. That is round
//! robin: a flood from one submitter or one key delays another's task by one dispatch per
//! other backlogged submitter or key. Every step is a BTreeMap/BTreeSet operation: no scan.
//!
//! `heads` holds the task each *open* kind's rotation takes next: a kind that its policy holds
//! back (paused, at `max_running`, out of `rate` tokens) is not there, so a claim for workers of
//! every kind merges the open kinds through `heads` and a held kind costs it nothing. A lane at
//! its `max_running_per_key` or out of its `rate_per_key` tokens leaves its kind's rotation
//! until a slot frees or its next token is due: no head-of-line blocking, within a kind or
//! across kinds. Both are held by the claim that finds them out of room, and open again when
//! what held them changes: the policy, one of their attempts ending, their next token's time.
//!
//! Everything is bounded: a lane or submitter exists while it has ready, claimed or running
//! tasks, and an idle lane whose per-key bucket is not full yet stays only until it would be
//! full again (at most [`MAX_IDLE_LANES`] of them), so a key cannot refill by emptying.

use std::cell::Cell;
use std::collections::BTreeSet;
use std::ops::Bound;
use std::rc::Rc;

use super::*;
use crate::flow::{Bucket, KindOp, Policy, WaitingOn, kind_response, unknown_kind};
use crate::journal::Journal;
use crate::journal::replay::PolicyImage;
use crate::stream::{BodyStream, Source};

/// Idle lanes kept for a per-key bucket that is not full yet, at most: beyond, the one that
/// would be full soonest is forgotten early (its key gets a full bucket a little sooner).
const MAX_IDLE_LANES: usize = if cfg!(test) { 64 } else { 65_536 };

/// Rate wakes and lane expiries handled in one timer run at most (the rest: the next run).
const WAKES_PER_TURN: usize = 4_096;

/// The lane of a task: (kind, submitter, key).
#[derive(Debug, Clone, Copy)]
pub(super) struct LaneOf<'a> {
    pub kind: Option<&'a str>,
    pub submitter: &'a str,
    pub key: &'a str,
}

impl<'a> LaneOf<'a> {
    pub fn of(t: &'a Task) -> LaneOf<'a> {
        LaneOf { kind: t.kind.as_deref(), submitter: &t.submitter, key: &t.key }
    }
}

/// One key of one submitter in one kind.
#[derive(Debug)]
struct Lane {
    name: Rc<str>,
    stamp: u64,
    ready: BTreeMap<QueueKey, TaskId>,
    /// In its submitter's rotation (it has a ready task and is not held).
    in_rotation: bool,
    /// Claimed and running attempts (for `max_running_per_key`; tasks with a kind only).
    occupied: u32,
    /// Its `rate_per_key` bucket.
    bucket: Option<Bucket>,
    /// Why it is out of the rotation, if a per-key limit holds it.
    held: Option<WaitingOn>,
    /// It has an entry in [`Flow::expiries`].
    expiring: bool,
    /// (claim, the last task that claim walked past here, whether it found nothing here).
    walked: Cell<(u64, Option<QueueKey>, bool)>,
}

impl Lane {
    fn new(name: &str, bucket: Option<Bucket>) -> Lane {
        Lane {
            name: Rc::from(name),
            stamp: 0,
            ready: BTreeMap::new(),
            in_rotation: false,
            occupied: 0,
            bucket,
            held: None,
            expiring: false,
            walked: Cell::new((0, None, false)),
        }
    }

    fn idle(&self) -> bool {
        self.ready.is_empty() && self.occupied == 0
    }

    /// What holds it back under the kind's per-key limits now, if anything does.
    fn room(&self, policy: Option<&Policy>, wall_ms: u64) -> Option<WaitingOn> {
        let p = policy?;
        if p.key_cap().is_some_and(|cap| self.occupied >= cap) {
            return Some(WaitingOn::Concurrency);
        }
        let mut b = self.bucket?;
        (b.available(wall_ms) == 0).then_some(WaitingOn::Rate)
    }
}

/// A submitter of one kind: its lanes.
#[derive(Debug)]
struct Sub {
    name: Rc<str>,
    stamp: u64,
    /// Its lanes in the rotation, least recently served first.
    open: BTreeSet<(u64, Rc<str>)>,
    lanes: HashMap<Rc<str>, Lane>,
}

/// A kind's fair-share rotation (SPEC §14): submitters, then their keys, then priority order.
#[derive(Debug, Default)]
pub(super) struct Rotation {
    counter: u64,
    /// Submitters with a lane in the rotation, least recently served first.
    open: BTreeSet<(u64, Rc<str>)>,
    subs: HashMap<Rc<str>, Sub>,
    /// Its entry in `heads` (the task it takes next), while its kind is open.
    head: Option<(QueueKey, TaskId)>,
    /// The last claim that found nothing here to take.
    done_in: Cell<u64>,
}

impl Rotation {
    /// The task the rotation takes next.
    fn first(&self) -> Option<(QueueKey, TaskId)> {
        let (_, s) = self.open.first()?;
        let sub = self.subs.get(&**s)?;
        let (_, k) = sub.open.first()?;
        let (q, id) = sub.lanes.get(&**k)?.ready.first_key_value()?;
        Some((*q, *id))
    }

    fn lane(&self, sub: &str, key: &str) -> Option<&Lane> {
        self.subs.get(sub)?.lanes.get(key)
    }

    fn lane_mut(&mut self, sub: &str, key: &str) -> Option<&mut Lane> {
        self.subs.get_mut(sub)?.lanes.get_mut(key)
    }

    /// The lane, made (with `bucket`) if it is new (always `Some`).
    fn lane_or_new(&mut self, sub: &str, key: &str, bucket: Option<Bucket>) -> Option<&mut Lane> {
        if !self.subs.contains_key(sub) {
            let name: Rc<str> = Rc::from(sub);
            self.subs.insert(name.clone(), Sub { name, stamp: 0, open: BTreeSet::new(), lanes: HashMap::new() });
        }
        let s = self.subs.get_mut(sub)?;
        if !s.lanes.contains_key(key) {
            let l = Lane::new(key, bucket);
            s.lanes.insert(l.name.clone(), l);
        }
        s.lanes.get_mut(key)
    }

    /// The lane has a ready task and nothing holds it: into the rotation, at the back if new.
    fn join(&mut self, sub: &str, key: &str) {
        let counter = self.counter;
        let Some(s) = self.subs.get_mut(sub) else { return };
        let Some(l) = s.lanes.get_mut(key) else { return };
        if l.in_rotation || l.held.is_some() || l.ready.is_empty() {
            return;
        }
        l.in_rotation = true;
        l.stamp = counter;
        s.open.insert((counter, l.name.clone()));
        if s.open.len() == 1 {
            s.stamp = counter;
            self.open.insert((counter, s.name.clone()));
        }
    }

    /// Out of the rotation (no ready task, or held).
    fn leave(&mut self, sub: &str, key: &str) {
        let Some(s) = self.subs.get_mut(sub) else { return };
        let Some(l) = s.lanes.get_mut(key) else { return };
        if !l.in_rotation {
            return;
        }
        l.in_rotation = false;
        s.open.remove(&(l.stamp, l.name.clone()));
        if s.open.is_empty() {
            self.open.remove(&(s.stamp, s.name.clone()));
        }
    }

    /// The lane was served: it and its submitter go to the back.
    fn serve(&mut self, sub: &str, key: &str) {
        self.counter += 1;
        let c = self.counter;
        let Some(s) = self.subs.get_mut(sub) else { return };
        let Some(l) = s.lanes.get_mut(key) else { return };
        let sub_open = !s.open.is_empty();
        if l.in_rotation {
            s.open.remove(&(l.stamp, l.name.clone()));
            s.open.insert((c, l.name.clone()));
        }
        l.stamp = c;
        if sub_open {
            self.open.remove(&(s.stamp, s.name.clone()));
            self.open.insert((c, s.name.clone()));
        }
        s.stamp = c;
    }

    /// Forgets the lane (and its submitter, if it was the last), whatever its bucket.
    fn forget(&mut self, sub: &str, key: &str) {
        self.leave(sub, key);
        let Some(s) = self.subs.get_mut(sub) else { return };
        s.lanes.remove(key);
        if s.lanes.is_empty() {
            self.subs.remove(sub);
        }
    }
}

/// A kind as the memory store knows it: tasks pending and running, its policy, its rotation.
#[derive(Debug, Default)]
pub(super) struct KindState {
    pub policy: Option<Policy>,
    /// Where the policy's journal record is (pins its segment).
    pub stored: Stored,
    pub pending: u32,
    pub dispatched: u32,
    /// Claimed and not started yet: they count against the running cap.
    pub claimed: u32,
    /// The kind's `rate` bucket.
    pub bucket: Option<Bucket>,
    /// Why its rotation is out of `heads` (`None`: open).
    pub held: Option<WaitingOn>,
    rot: Rotation,
}

impl KindState {
    fn forgettable(&self) -> bool {
        self.policy.is_none() && self.pending == 0 && self.dispatched == 0 && self.claimed == 0
    }

    fn occupied(&self) -> u32 {
        self.dispatched + self.claimed
    }

    /// Why the kind holds its tasks back now, if it does (its own limits: the per-key ones are
    /// its lanes').
    fn room(&self, wall_ms: u64) -> (Option<u32>, Option<WaitingOn>) {
        match self.room_and_bound(wall_ms) {
            (Some(0), why) => (Some(0), Some(why)),
            (room, _) => (room, None),
        }
    }

    /// How many more tasks may start now (`None`: no limit), and what holds them back once
    /// that many have started.
    fn room_and_bound(&self, wall_ms: u64) -> (Option<u32>, WaitingOn) {
        let Some(p) = &self.policy else { return (None, WaitingOn::Worker) };
        if p.paused {
            return (Some(0), WaitingOn::Paused);
        }
        let mut room: Option<(u32, WaitingOn)> = None;
        if let Some(cap) = p.kind_cap() {
            room = Some((cap.saturating_sub(self.occupied()), WaitingOn::Concurrency));
        }
        if let Some(mut b) = self.bucket {
            let n = b.available(wall_ms);
            if room.is_none_or(|(r, _)| n < r) {
                room = Some((n, WaitingOn::Rate));
            }
        }
        match room {
            Some((n, why)) => (Some(n), why),
            None => (None, WaitingOn::Worker),
        }
    }
}

/// Something due at a time: a held kind or lane whose next token is there.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Wake {
    Kind(Box<str>),
    Lane(Box<str>, Rc<str>, Rc<str>),
}

/// A bucket a dispatch took from: (kind, (submitter, key) of a lane's, or `None`: the kind's own).
type Taken = (Box<str>, Option<(Rc<str>, Rc<str>)>);

/// An idle lane kept for its bucket: (when it is full again, kind, submitter, key).
type Expiry = (u64, Box<str>, Rc<str>, Rc<str>);

/// What a claim found held while looking for its next task.
enum Hold {
    Kind(Box<str>, WaitingOn),
    Lane(Box<str>, Rc<str>, Rc<str>, WaitingOn),
}

/// The task a claim takes next, and its lane.
struct Pick {
    at: QueueKey,
    id: TaskId,
    kind: Option<Box<str>>,
    sub: Rc<str>,
    key: Rc<str>,
}

/// One claim's walk: which claim it is, and how many tasks its takers all tried it passed.
#[derive(Debug)]
pub(super) struct ClaimWalk {
    no: u64,
    skipped: usize,
}

/// The kinds by name, and their names in order beside them: `GET /kinds` is answered in kind
/// order a piece at a time, each piece from where the last one ended (`crate::stream`), with no
/// sort and no copy of the whole list. Lookups on the dispatch path stay a hash; the order
/// costs a set insert when a kind appears and a removal when it is forgotten.
///
/// The kinds with a policy are a set of their own, in order (at most `MAX_POLICIES`): a
/// `/metrics` scrape labels the first `MAX_LABELLED_KINDS` of them and a compaction rewrites
/// theirs, each without walking every kind (with 200,000 kinds a scrape walked the map: 3 ms).
#[derive(Debug, Default)]
pub(super) struct KindMap {
    map: HashMap<Rc<str>, KindState>,
    order: BTreeSet<Rc<str>>,
    with_policy: BTreeSet<Rc<str>>,
}

impl KindMap {
    pub fn get(&self, kind: &str) -> Option<&KindState> {
        self.map.get(kind)
    }

    pub fn get_mut(&mut self, kind: &str) -> Option<&mut KindState> {
        self.map.get_mut(kind)
    }

    /// A kind not in the map yet, added (one that is keeps its state).
    fn insert_new(&mut self, kind: &str) -> &mut KindState {
        let name: Rc<str> = Rc::from(kind);
        self.order.insert(Rc::clone(&name));
        self.map.entry(name).or_default()
    }

    fn remove(&mut self, kind: &str) -> Option<KindState> {
        self.order.remove(kind);
        self.with_policy.remove(kind);
        self.map.remove(kind)
    }

    /// Replaces the kind's policy (the kind is in the map) and keeps [`KindMap::with_policy`]
    /// exact; returns the policy it had.
    fn set_policy(&mut self, kind: &str, policy: Option<Policy>) -> Option<Policy> {
        let name = Rc::clone(self.map.get_key_value(kind)?.0);
        let s = self.map.get_mut(kind)?;
        let had = std::mem::replace(&mut s.policy, policy);
        if policy.is_some() {
            self.with_policy.insert(name);
        } else {
            self.with_policy.remove(kind);
        }
        had
    }

    /// How many kinds have a policy.
    pub fn policies(&self) -> usize {
        self.with_policy.len()
    }

    /// The kinds with a policy, in order.
    pub fn with_policy(&self) -> impl Iterator<Item = (&str, &KindState)> {
        self.with_policy.iter().filter_map(|k| Some((&**k, self.map.get(&**k)?)))
    }

    /// `f` for each kind with a policy, in order.
    fn each_with_policy_mut(&mut self, mut f: impl FnMut(&str, &mut KindState)) {
        for k in &self.with_policy {
            if let Some(s) = self.map.get_mut(&**k) {
                f(k, s);
            }
        }
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.map.is_empty() && self.order.is_empty() && self.with_policy.is_empty()
    }

    /// In no particular order.
    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = (&str, &KindState)> {
        self.map.iter().map(|(k, s)| (&**k, s))
    }

    /// The kinds after `after` (all: `None`), in order.
    pub fn after<'a>(&'a self, after: Option<&str>) -> impl Iterator<Item = (&'a str, &'a KindState)> + use<'a> {
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        let names = self.order.range::<str, _>((from, Bound::Unbounded));
        names.filter_map(|k| Some((&**k, self.map.get(&**k)?)))
    }
}

/// The memory store's flow control: kinds, their rotations and policies.
#[derive(Debug, Default)]
pub(super) struct Flow {
    /// Kinds with tasks pending or running, or with a policy (SPEC §14).
    kinds: KindMap,
    /// Tasks without a kind (no policy applies to them).
    none: Rotation,
    /// The task each open kind's rotation takes next (and the kindless rotation's).
    pub heads: BTreeMap<QueueKey, TaskId>,
    /// Held kinds and lanes by when their next token is due (wall clock).
    wakes: BTreeSet<(u64, Wake)>,
    /// Idle lanes kept for their bucket, by when it is full again (wall clock).
    expiries: BTreeSet<Expiry>,
    /// Dispatches a policy held back, by `WaitingOn` (`relay_dispatch_held_total`).
    held_total: [u64; 6],
    claims: u64,
    /// The store keeps a journal: buckets taken from are noted in `dirty` for it.
    journaled: bool,
    /// Buckets taken from since the journal last wrote them: (kind, lane or the kind's own).
    dirty: Vec<Taken>,
}

impl Flow {
    pub fn new(journaled: bool) -> Flow {
        Flow { journaled, ..Flow::default() }
    }

    fn rot_mut(&mut self, kind: Option<&str>) -> Option<&mut Rotation> {
        match kind {
            None => Some(&mut self.none),
            Some(k) => self.kinds.get_mut(k).map(|s| &mut s.rot),
        }
    }

    /// Puts the rotation's next task in `heads` (if its kind is open); `true` if it has one now
    /// and had none there before.
    fn refresh(&mut self, kind: Option<&str>) -> bool {
        let (rot, open) = match kind {
            None => (&mut self.none, true),
            Some(k) => match self.kinds.get_mut(k) {
                Some(s) => (&mut s.rot, s.held.is_none()),
                None => return false,
            },
        };
        let next = if open { rot.first() } else { None };
        if next == rot.head {
            return false;
        }
        let had = rot.head.is_some();
        if let Some((k, _)) = rot.head {
            self.heads.remove(&k);
        }
        if let Some((k, id)) = next {
            self.heads.insert(k, id);
        }
        rot.head = next;
        !had && next.is_some()
    }

    // ----- counts --------------------------------------------------------------------------

    /// A task of `lane` went from `from` to `to` (`None`: did not exist / is gone).
    pub fn count_kind(
        &mut self,
        lane: LaneOf<'_>,
        from: Option<Status>,
        to: Option<Status>,
        wall: u64,
        events: &mut Vec<Event>,
    ) {
        let Some(kind) = lane.kind else { return };
        if from == to {
            return;
        }
        let s = match self.kinds.get_mut(kind) {
            Some(s) => s,
            None => self.kinds.insert_new(kind),
        };
        for (status, d) in [(from, -1i64), (to, 1)] {
            match status {
                Some(Status::Pending) => s.pending = (i64::from(s.pending) + d).max(0) as u32,
                Some(Status::Dispatched) => s.dispatched = (i64::from(s.dispatched) + d).max(0) as u32,
                _ => {}
            }
        }
        let freed = from == Some(Status::Dispatched);
        match (freed, to == Some(Status::Dispatched)) {
            (true, false) => self.occupy(lane, false, wall),
            (false, true) => self.occupy(lane, true, wall),
            _ => {}
        }
        if self.kinds.get(kind).is_some_and(KindState::forgettable) {
            self.forget_kind(kind);
        } else if freed {
            self.reopen(kind, wall, events);
            self.reopen_lane(lane, wall, events);
        }
    }

    /// A claim took (`true`) or let go of a task of `lane` before its attempt started.
    pub fn count_claimed(&mut self, lane: LaneOf<'_>, took: bool, wall: u64, events: &mut Vec<Event>) {
        let Some(kind) = lane.kind else { return };
        let Some(s) = self.kinds.get_mut(kind) else { return };
        if took {
            s.claimed += 1;
            self.occupy(lane, true, wall);
        } else {
            s.claimed = s.claimed.saturating_sub(1);
            self.occupy(lane, false, wall);
            self.reopen(kind, wall, events);
            self.reopen_lane(lane, wall, events);
        }
    }

    /// One more (`true`) or one less claimed or running attempt in the lane.
    fn occupy(&mut self, lane: LaneOf<'_>, up: bool, wall: u64) {
        let Some(s) = lane.kind.and_then(|k| self.kinds.get_mut(k)) else { return };
        if up {
            let bucket = s.policy.and_then(|p| p.key_bucket());
            if let Some(l) = s.rot.lane_or_new(lane.submitter, lane.key, bucket) {
                l.occupied += 1;
            }
        } else {
            if let Some(l) = s.rot.lane_mut(lane.submitter, lane.key) {
                l.occupied = l.occupied.saturating_sub(1);
            }
            self.settle(lane, wall);
        }
    }

    fn forget_kind(&mut self, kind: &str) {
        if let Some(s) = self.kinds.remove(kind)
            && let Some((k, _)) = s.rot.head
        {
            self.heads.remove(&k);
        }
    }

    /// Forgets the lane if nothing keeps it: no ready, claimed or running task, and a full
    /// bucket or none (one not full yet stays until it is: [`Flow::expiries`]).
    fn settle(&mut self, lane: LaneOf<'_>, wall: u64) {
        let rot = match lane.kind {
            None => &mut self.none,
            Some(k) => match self.kinds.get_mut(k) {
                Some(s) => &mut s.rot,
                None => return,
            },
        };
        let Some(s) = rot.subs.get_mut(lane.submitter) else { return };
        let sub = s.name.clone();
        let Some(l) = s.lanes.get_mut(lane.key) else { return };
        if !l.idle() {
            return;
        }
        let full_at = l.bucket.as_mut().map(|b| b.full_ms(wall)).filter(|&at| at > wall);
        match (full_at, lane.kind) {
            (Some(at), Some(kind)) => {
                if !l.expiring {
                    l.expiring = true;
                    let key = l.name.clone();
                    self.expiries.insert((at, Box::from(kind), sub, key));
                    while self.expiries.len() > MAX_IDLE_LANES {
                        let Some((_, k, s, key)) = self.expiries.pop_first() else { break };
                        self.expired(LaneOf { kind: Some(&k), submitter: &s, key: &key }, true, wall);
                    }
                }
            }
            _ => rot.forget(lane.submitter, lane.key),
        }
    }

    /// An idle lane's expiry is due (`force`: the cap on idle lanes says so).
    fn expired(&mut self, lane: LaneOf<'_>, force: bool, wall: u64) {
        let Some(rot) = self.rot_mut(lane.kind) else { return };
        let Some(l) = rot.lane_mut(lane.submitter, lane.key) else { return };
        l.expiring = false;
        if !l.idle() {
            return;
        }
        if force {
            rot.forget(lane.submitter, lane.key);
        } else {
            self.settle(lane, wall);
        }
    }

    // ----- lanes ---------------------------------------------------------------------------

    /// Puts a ready task in its lane (and the lane in the rotation, if it can run).
    pub fn lane_insert(&mut self, lane: LaneOf<'_>, at: QueueKey, id: TaskId) {
        let (rot, bucket) = match lane.kind {
            None => (&mut self.none, None),
            Some(k) => {
                let s = match self.kinds.get_mut(k) {
                    Some(s) => s,
                    None => self.kinds.insert_new(k),
                };
                let bucket = s.policy.and_then(|p| p.key_bucket());
                (&mut s.rot, bucket)
            }
        };
        let Some(l) = rot.lane_or_new(lane.submitter, lane.key, bucket) else { return };
        l.ready.insert(at, id);
        if l.ready.len() == 1 {
            rot.join(lane.submitter, lane.key);
        }
        self.refresh(lane.kind);
    }

    pub fn lane_remove(&mut self, lane: LaneOf<'_>, at: QueueKey, wall: u64) {
        let Some(rot) = self.rot_mut(lane.kind) else { return };
        let Some(l) = rot.lane_mut(lane.submitter, lane.key) else { return };
        if l.ready.remove(&at).is_none() {
            return;
        }
        if l.ready.is_empty() {
            rot.leave(lane.submitter, lane.key);
            self.settle(lane, wall);
        }
        self.refresh(lane.kind);
    }

    /// Holds the kind's rotation back (`Some`) or opens it (`None`).
    fn set_held(&mut self, kind: &str, held: Option<WaitingOn>, events: &mut Vec<Event>) {
        let Some(s) = self.kinds.get_mut(kind) else { return };
        s.held = held;
        if self.refresh(Some(kind)) {
            events.push(Event::Ready);
        }
    }

    /// Decides again whether the kind is held, after what holds it may have changed.
    fn reopen(&mut self, kind: &str, wall: u64, events: &mut Vec<Event>) {
        let Some(s) = self.kinds.get(kind) else { return };
        if s.held.is_none() && s.policy.is_none_or(|p| !p.kind_limits()) {
            return;
        }
        let (held, (_, why)) = (s.held, s.room(wall));
        if why == Some(WaitingOn::Rate) {
            self.wake_for_rate(kind, wall);
        }
        // (An open kind is closed by the claim that finds it out of room, not here: a held
        // task costs a claim nothing either way, and this keeps every attempt end cheap.)
        if why.is_none() || held.is_some() {
            self.set_held(kind, why, events);
        }
    }

    /// Decides again whether a held lane stays held.
    fn reopen_lane(&mut self, lane: LaneOf<'_>, wall: u64, events: &mut Vec<Event>) {
        let Some(kind) = lane.kind else { return };
        let Some(s) = self.kinds.get_mut(kind) else { return };
        let policy = s.policy;
        let Some(sb) = s.rot.subs.get_mut(lane.submitter) else { return };
        let Some(l) = sb.lanes.get_mut(lane.key) else { return };
        if l.held.is_none() {
            return;
        }
        let why = l.room(policy.as_ref(), wall);
        if why == Some(WaitingOn::Rate) && l.held != why {
            let at = l.bucket.as_mut().map_or(wall, |b| b.next_token_ms(wall));
            self.wakes.insert((at, Wake::Lane(Box::from(kind), sb.name.clone(), l.name.clone())));
        }
        l.held = why;
        if why.is_none() {
            // (Ready even if the kind had a next task: a claim may have found that one tried by
            // every worker with room, and this lane's task is for them.)
            let has_ready = !l.ready.is_empty();
            s.rot.join(lane.submitter, lane.key);
            self.refresh(Some(kind));
            if has_ready {
                events.push(Event::Ready);
            }
        }
    }

    /// The kind is out of tokens: it opens again when its next one is due.
    fn wake_for_rate(&mut self, kind: &str, wall: u64) {
        let Some(s) = self.kinds.get_mut(kind) else { return };
        let at = s.bucket.as_mut().map_or(wall, |b| b.next_token_ms(wall));
        self.wakes.insert((at, Wake::Kind(Box::from(kind))));
    }

    /// Kinds and lanes whose next token is due now open again; idle lanes whose bucket is full
    /// again are forgotten.
    pub fn on_wakes(&mut self, wall: u64, events: &mut Vec<Event>) {
        for _ in 0..WAKES_PER_TURN {
            match self.wakes.first() {
                Some((at, _)) if *at <= wall => {}
                _ => break,
            }
            let Some((_, wake)) = self.wakes.pop_first() else { break };
            match wake {
                Wake::Kind(kind) => self.reopen(&kind, wall, events),
                Wake::Lane(kind, sub, key) => {
                    self.reopen_lane(LaneOf { kind: Some(&kind), submitter: &sub, key: &key }, wall, events)
                }
            }
        }
        for _ in 0..WAKES_PER_TURN {
            match self.expiries.first() {
                Some((at, ..)) if *at <= wall => {}
                _ => break,
            }
            let Some((_, kind, sub, key)) = self.expiries.pop_first() else { break };
            self.expired(LaneOf { kind: Some(&kind), submitter: &sub, key: &key }, false, wall);
        }
    }

    /// When a wake is due (wall clock).
    pub fn next_wake_wall_ms(&self) -> Option<u64> {
        let a = self.wakes.first().map(|w| w.0);
        let b = self.expiries.first().map(|e| e.0);
        a.into_iter().chain(b).min()
    }

    /// The insert's fast path: may a task of `lane` start at once under its kind's policy? If
    /// so, it takes its rate tokens now (its claim counts it against the running caps).
    pub fn admit_now(&mut self, lane: LaneOf<'_>, wall: u64) -> bool {
        let Some(k) = lane.kind else { return true };
        let Some(s) = self.kinds.get_mut(k) else { return true };
        let Some(p) = s.policy.filter(Policy::limits) else { return true };
        if s.held.is_some() || s.room(wall).1.is_some() {
            return false;
        }
        if p.key_limits() {
            let Some(l) = s.rot.lane_or_new(lane.submitter, lane.key, p.key_bucket()) else { return false };
            let free = l.held.is_none() && l.room(Some(&p), wall).is_none();
            let mut took = None;
            if free && let Some(b) = &mut l.bucket {
                b.take(wall, 1);
                took = Some(l.name.clone());
            }
            if self.journaled
                && let Some(key) = took
                && let Some(sub) = s.rot.subs.get(lane.submitter)
            {
                self.dirty.push((Box::from(k), Some((sub.name.clone(), key))));
            }
            self.settle(lane, wall);
            if !free {
                return false;
            }
        }
        if let Some(b) = self.kinds.get_mut(k).and_then(|s| s.bucket.as_mut()) {
            b.take(wall, 1);
            if self.journaled {
                self.dirty.push((Box::from(k), None));
            }
        }
        true
    }

    pub fn kind_paused(&self, kind: Option<&str>) -> bool {
        kind.is_some_and(|k| self.kinds.get(k).and_then(|s| s.policy).is_some_and(|p| p.paused))
    }

    // ----- claims ----------------------------------------------------------------------------

    /// A new claim's walk.
    pub fn walk(&mut self) -> ClaimWalk {
        self.claims += 1;
        ClaimWalk { no: self.claims, skipped: 0 }
    }

    /// The next task a claim takes, served: of its kinds, the next in the open kinds' order
    /// (their rotations' next tasks, earliest first), in that kind the rotation's next task
    /// its takers have not all tried. Kinds and lanes found out of room are held on the way.
    pub fn claim_next(
        &mut self,
        tasks: &TaskTable,
        ask: &ClaimAsk<'_>,
        walk: &mut ClaimWalk,
        wall: u64,
        events: &mut Vec<Event>,
    ) -> Option<TaskId> {
        loop {
            if walk.skipped >= MAX_CLAIM_SKIP {
                return None;
            }
            let mut holds: Vec<Hold> = Vec::new();
            let mut best: Option<Pick> = None;
            let takeable = |id: &TaskId| {
                tasks.get(id).is_some_and(|t| t.this_run().is_empty() || ask.takers.iter().any(|&c| !t.tried(c)))
            };
            match ask.kinds {
                None => {
                    for (at, id) in &self.heads {
                        if best.as_ref().is_some_and(|b| *at >= b.at) || walk.skipped >= MAX_CLAIM_SKIP {
                            break;
                        }
                        let Some(t) = tasks.get(id) else { continue };
                        self.consider(t.kind.as_deref(), &takeable, walk, wall, &mut best, &mut holds);
                    }
                }
                Some(kinds) => {
                    for k in kinds {
                        let Some((at, _)) = self.kinds.get(k).and_then(|s| s.rot.head) else { continue };
                        if best.as_ref().is_some_and(|b| at >= b.at) || walk.skipped >= MAX_CLAIM_SKIP {
                            continue;
                        }
                        self.consider(Some(k), &takeable, walk, wall, &mut best, &mut holds);
                    }
                }
            }
            if !holds.is_empty() {
                for h in holds {
                    self.hold(h, wall, events);
                }
                continue;
            }
            let b = best?;
            let kind = b.kind.as_deref();
            match kind {
                None => self.none.serve(&b.sub, &b.key),
                Some(k) => {
                    if let Some(s) = self.kinds.get_mut(k) {
                        s.rot.serve(&b.sub, &b.key);
                        if let Some(bk) = &mut s.bucket {
                            bk.take(wall, 1);
                            if self.journaled {
                                self.dirty.push((Box::from(k), None));
                            }
                        }
                        if let Some(bk) = s.rot.lane_mut(&b.sub, &b.key).and_then(|l| l.bucket.as_mut()) {
                            bk.take(wall, 1);
                            if self.journaled {
                                self.dirty.push((Box::from(k), Some((b.sub.clone(), b.key.clone()))));
                            }
                        }
                    }
                }
            }
            self.refresh(kind);
            return Some(b.id);
        }
    }

    /// The task `kind`'s rotation would give this claim, if earlier than `best`; or what holds
    /// the kind or its lanes back.
    fn consider(
        &self,
        kind: Option<&str>,
        takeable: &dyn Fn(&TaskId) -> bool,
        walk: &mut ClaimWalk,
        wall: u64,
        best: &mut Option<Pick>,
        holds: &mut Vec<Hold>,
    ) {
        let (rot, policy) = match kind {
            None => (&self.none, None),
            Some(k) => match self.kinds.get(k) {
                Some(s) => {
                    if s.policy.is_some_and(|p| p.kind_limits())
                        && let (_, Some(why)) = s.room(wall)
                    {
                        holds.push(Hold::Kind(Box::from(k), why));
                        return;
                    }
                    (&s.rot, s.policy)
                }
                None => return,
            },
        };
        if rot.done_in.get() == walk.no {
            return;
        }
        let key_limits = policy.is_some_and(|p| p.key_limits());
        let mut held = false;
        for (_, sname) in &rot.open {
            let Some(sub) = rot.subs.get(&**sname) else { continue };
            for (_, kname) in &sub.open {
                let Some(lane) = sub.lanes.get(&**kname) else { continue };
                if key_limits && let Some(why) = lane.room(policy.as_ref(), wall) {
                    if let Some(k) = kind {
                        holds.push(Hold::Lane(Box::from(k), sname.clone(), kname.clone(), why));
                        held = true;
                    }
                    continue;
                }
                let (no, after, exhausted) = lane.walked.get();
                let from = match (no == walk.no, after) {
                    (true, _) if exhausted => continue,
                    (true, Some(at)) => Bound::Excluded(at),
                    _ => Bound::Unbounded,
                };
                for (at, id) in lane.ready.range((from, Bound::Unbounded)) {
                    if takeable(id) {
                        if best.as_ref().is_none_or(|b| *at < b.at) {
                            *best = Some(Pick {
                                at: *at,
                                id: *id,
                                kind: kind.map(Box::from),
                                sub: sname.clone(),
                                key: kname.clone(),
                            });
                        }
                        return;
                    }
                    walk.skipped += 1;
                    lane.walked.set((walk.no, Some(*at), false));
                    if walk.skipped >= MAX_CLAIM_SKIP {
                        return;
                    }
                }
                lane.walked.set((walk.no, None, true));
            }
        }
        if !held {
            rot.done_in.set(walk.no);
        }
    }

    /// Holds what a claim found out of room.
    fn hold(&mut self, h: Hold, wall: u64, events: &mut Vec<Event>) {
        match h {
            Hold::Kind(kind, why) => {
                self.held_total[why.index()] += 1;
                if why == WaitingOn::Rate {
                    self.wake_for_rate(&kind, wall);
                }
                self.set_held(&kind, Some(why), events);
            }
            Hold::Lane(kind, sub, key, why) => {
                self.held_total[why.index()] += 1;
                let Some(s) = self.kinds.get_mut(&kind) else { return };
                let Some(l) = s.rot.lane_mut(&sub, &key) else { return };
                l.held = Some(why);
                if why == WaitingOn::Rate {
                    let at = l.bucket.as_mut().map_or(wall, |b| b.next_token_ms(wall));
                    self.wakes.insert((at, Wake::Lane(kind.clone(), sub.clone(), key.clone())));
                }
                s.rot.leave(&sub, &key);
                self.refresh(Some(&kind));
            }
        }
    }

    // ----- policies --------------------------------------------------------------------------

    /// The kind's per-key limits changed (or were restored): buckets made again unless the
    /// `rate_per_key` stays the same, held lanes decided again, idle lanes kept no longer than
    /// their bucket needs. A policy change is rare: this walks the kind's lanes.
    fn apply_key_policy(&mut self, kind: &str, old: Option<Policy>, wall: u64, events: &mut Vec<Event>) {
        let Some(s) = self.kinds.get_mut(kind) else { return };
        let policy = s.policy;
        let fresh = policy.and_then(|p| p.key_bucket());
        let keep = match (old.and_then(|p| p.key_bucket()), fresh) {
            (Some(a), Some(b)) => a.same_shape(&b),
            (None, None) => true,
            _ => false,
        };
        let mut lanes: Vec<(Rc<str>, Rc<str>)> = Vec::new();
        for sub in s.rot.subs.values_mut() {
            for l in sub.lanes.values_mut() {
                if !keep {
                    l.bucket = fresh;
                }
                if l.held.is_some() || l.idle() {
                    lanes.push((sub.name.clone(), l.name.clone()));
                }
            }
        }
        for (sub, key) in lanes {
            let lane = LaneOf { kind: Some(kind), submitter: &sub, key: &key };
            self.reopen_lane(lane, wall, events);
            self.settle(lane, wall);
        }
        self.refresh(Some(kind));
    }

    /// Replaces (`Some`) or removes the kind's policy (in memory only).
    fn set_policy(&mut self, kind: &str, policy: Option<Policy>, wall: u64, events: &mut Vec<Event>) {
        let had = self.kinds.get(kind).and_then(|s| s.policy);
        let s = match self.kinds.get_mut(kind) {
            Some(s) => s,
            None => self.kinds.insert_new(kind),
        };
        let bucket = policy.and_then(|p| p.kind_bucket());
        // A rate that stays the same keeps its bucket (a resume does not refill it).
        let same = match (&bucket, &s.bucket) {
            (Some(a), Some(b)) => a.same_shape(b),
            (None, None) => true,
            _ => false,
        };
        if !same {
            s.bucket = bucket;
        }
        self.kinds.set_policy(kind, policy);
        self.apply_key_policy(kind, had, wall, events);
    }

    /// After a policy change that the journal recorded: the kind forgotten if nothing keeps
    /// it, held or opened as the policy says.
    fn policy_applied(&mut self, kind: &str, wall: u64, events: &mut Vec<Event>) {
        if self.kinds.get(kind).is_some_and(KindState::forgettable) {
            self.forget_kind(kind);
            return;
        }
        let why = self.kinds.get(kind).and_then(|s| s.room(wall).1);
        if why == Some(WaitingOn::Rate) {
            self.wake_for_rate(kind, wall);
        }
        self.set_held(kind, why, events);
        events.push(Event::Ready);
    }

    /// The flow control that holds a pending task back now, if any does (SPEC §14: the first
    /// of paused, concurrency, rate — its kind's or its lane's).
    pub fn held_by(&self, task: &Task, wall: u64) -> Option<WaitingOn> {
        if task.status != Status::Pending {
            return None;
        }
        let s = self.kinds.get(task.kind.as_deref()?)?;
        let kind = s.room(wall).1;
        let lane = s
            .policy
            .filter(Policy::key_limits)
            .and_then(|p| s.rot.lane(&task.submitter, &task.key).and_then(|l| l.room(Some(&p), wall)));
        kind.into_iter().chain(lane).min_by_key(|w| w.index())
    }
}

/// Writes the kind's policy whole: its record, then each of its buckets that is not full — what
/// replay needs of the kind (a policy record starts it afresh).
fn write_policy(j: &mut Journal, kind: &str, s: &mut KindState, wall: u64) {
    let Some(p) = s.policy else { return };
    j.policy(kind, Some(&p.to_json()), &mut s.stored);
    if let Some(b) = &mut s.bucket
        && !b.is_full(wall)
        && let Some((tokens, at)) = b.state()
    {
        j.bucket(kind, None, tokens, at, &mut s.stored);
    }
    for sub in s.rot.subs.values_mut() {
        for l in sub.lanes.values_mut() {
            if let Some(b) = &mut l.bucket
                && !b.is_full(wall)
                && let Some((tokens, at)) = b.state()
            {
                // (Past three segments — a kind with very many lanes not full, in small
                // segments — a record is not pinned: the next compaction writes it again.)
                j.bucket(kind, Some((&sub.name, &l.name)), tokens, at, &mut s.stored);
            }
        }
    }
}

impl MemStore {
    /// A task of `kind` went from `from` to `to`, for a task not in the table (yet).
    pub(super) fn count_task(&mut self, task: &Task, from: Option<Status>, to: Option<Status>) {
        self.flow.count_kind(LaneOf::of(task), from, to, self.wall_ms, &mut self.events);
    }

    /// The tasks a claim takes, in dispatch order, out of the ready lanes and claimed.
    pub(super) fn claim_tasks(&mut self, ask: &ClaimAsk<'_>) -> Vec<Claimed> {
        let mut out = Vec::new();
        let mut walk = self.flow.walk();
        while out.len() < ask.limit as usize {
            let Some(id) = self.flow.claim_next(&self.tasks, ask, &mut walk, self.wall_ms, &mut self.events) else {
                break;
            };
            self.unqueue(id);
            out.extend(self.claimed(id));
        }
        out
    }

    /// Kinds and lanes whose next token is due now open again.
    pub(super) fn on_rate_wakes(&mut self) {
        self.flow.on_wakes(self.wall_ms, &mut self.events);
    }

    /// When a rate-held kind or lane opens again (the loop's clock).
    pub(super) fn next_rate_wake_ms(&self) -> Option<u64> {
        self.flow.next_wake_wall_ms().map(|at| self.now_ms + at.saturating_sub(self.wall_ms))
    }

    pub fn kind_paused(&self, kind: Option<&str>) -> bool {
        self.flow.kind_paused(kind)
    }

    // ----- policies --------------------------------------------------------------------------

    /// `GET/PUT/DELETE /kinds/{kind}`, `GET /kinds`: [`Event::Answer`].
    pub fn kind_op(&mut self, op: KindOp, conn: ConnRef) {
        match op {
            KindOp::Get(kind) => {
                let r = match self.flow.kinds.get(kind.as_str()) {
                    Some(s) => kind_response(&kind, s.policy.as_ref(), s.dispatched.into(), s.pending.into()),
                    None => unknown_kind(),
                };
                self.answer(conn, r);
            }
            KindOp::Set(kind, policy) => {
                if let Some(r) = self.unavailable(true) {
                    self.answer(conn, r);
                    return;
                }
                if policy.is_some()
                    && self.flow.kinds.get(kind.as_str()).is_none_or(|s| s.policy.is_none())
                    && self.flow.kinds.policies() >= crate::flow::MAX_POLICIES
                {
                    self.answer(
                        conn,
                        Response::error(409, "too_many_policies", "relay keeps at most 10000 kind policies"),
                    );
                    return;
                }
                let lsn = self.set_policy(&kind, policy);
                let s = self.flow.kinds.get(kind.as_str());
                let mut r = kind_response(
                    &kind,
                    s.and_then(|s| s.policy.as_ref()),
                    s.map_or(0, |s| s.dispatched.into()),
                    s.map_or(0, |s| s.pending.into()),
                );
                r.lsn = lsn;
                self.answer(conn, r);
            }
            KindOp::List => {
                // The first piece now; the rest as the client reads (`crate::stream`): with
                // 200,000 kinds the whole answer took the loop 340-450 ms.
                let mut stream = BodyStream::new(Source::Kinds);
                let mut body = String::new();
                self.stream_piece(&mut stream, &mut body);
                let r = Response::json(200, body.into_bytes());
                self.answer(conn, if stream.done { r } else { r.streamed(stream) });
            }
        }
    }

    /// The next piece of a streamed answer (`crate::stream`): kinds in order, each as it is now.
    pub fn stream_piece(&self, stream: &mut BodyStream, out: &mut String) {
        match stream.source {
            Source::Kinds => {
                stream.write_piece(
                    self.flow.kinds.after(stream.after.as_deref()),
                    |k, st, out| {
                        crate::flow::write_kind_json(
                            out,
                            k,
                            st.policy.as_ref(),
                            st.dispatched.into(),
                            st.pending.into(),
                        );
                    },
                    out,
                );
            }
            // (The database store's; none begins here.)
            Source::KindRows(_) => stream.write_made_piece(out),
        }
    }

    /// Replaces (`Some`) or removes the kind's policy, journaled; returns the record's number.
    pub(super) fn set_policy(&mut self, kind: &str, policy: Option<Policy>) -> u64 {
        self.flow.set_policy(kind, policy, self.wall_ms, &mut self.events);
        let mut lsn = 0;
        if let Some(j) = &mut self.journal
            && let Some(s) = self.flow.kinds.get_mut(kind)
        {
            match policy {
                // (With the buckets a kept rate keeps: a pause or a new cap refills nothing.)
                Some(_) => write_policy(j, kind, s, self.wall_ms),
                None => j.policy(kind, None, &mut s.stored),
            }
            lsn = j.lsn();
        }
        self.flow.policy_applied(kind, self.wall_ms, &mut self.events);
        lsn
    }

    /// Policies restored from the journal at start, with the buckets their dispatches left (a
    /// restart is no idle time: it refills no bucket, SPEC §14).
    pub(super) fn restore_policies(&mut self, policies: Vec<(PolicyImage, Policy)>) {
        let wall = self.wall_ms;
        for (image, policy) in policies {
            let kind = &*image.kind;
            self.flow.set_policy(kind, Some(policy), wall, &mut self.events);
            if let Some(s) = self.flow.kinds.get_mut(kind) {
                s.stored = image.stored;
                if policy.paused {
                    s.held = Some(WaitingOn::Paused);
                }
                if let (Some(b), Some((tokens, at))) = (&mut s.bucket, image.bucket) {
                    b.restore(tokens, at);
                }
            }
            for ((sub, key), &(tokens, at)) in &image.lanes {
                if let Some(s) = self.flow.kinds.get_mut(kind)
                    && let Some(bucket) = policy.key_bucket()
                    && let Some(b) = s.rot.lane_or_new(sub, key, Some(bucket)).and_then(|l| l.bucket.as_mut())
                {
                    b.restore(tokens, at);
                }
                // (An idle lane stays while its bucket is not full yet.)
                self.flow.settle(LaneOf { kind: Some(kind), submitter: sub, key }, wall);
            }
            self.flow.refresh(Some(kind));
            if (image.bucket.is_some() || !image.lanes.is_empty())
                && let Some(j) = &mut self.journal
                && let Some(s) = self.flow.kinds.get_mut(kind)
            {
                // (Its records may span more segments than a policy pins: one record again.)
                write_policy(j, kind, s, wall);
            }
        }
    }

    /// The buckets dispatches took from this turn go to the journal (one record each).
    pub(super) fn save_buckets(&mut self) {
        if self.flow.dirty.is_empty() {
            return;
        }
        let mut dirty = std::mem::take(&mut self.flow.dirty);
        let Some(j) = &mut self.journal else { return };
        dirty.sort_unstable();
        dirty.dedup();
        let wall = self.wall_ms;
        let mut whole: Vec<Box<str>> = Vec::new();
        for (kind, lane) in dirty {
            let Some(s) = self.flow.kinds.get_mut(&kind).filter(|s| s.policy.is_some()) else { continue };
            let bucket = match &lane {
                None => s.bucket.as_ref(),
                Some((sub, key)) => s.rot.lane(sub, key).and_then(|l| l.bucket.as_ref()),
            };
            let Some((tokens, at)) = bucket.and_then(Bucket::state) else { continue };
            let lane = lane.as_ref().map(|(sub, key)| (&**sub, &**key));
            if !j.bucket(&kind, lane, tokens, at, &mut s.stored) && whole.last() != Some(&kind) {
                whole.push(kind);
            }
        }
        for kind in whole {
            if let Some(s) = self.flow.kinds.get_mut(&kind) {
                write_policy(j, &kind, s, wall);
            }
        }
    }

    /// Policies whose record pins segment `seg` or an older one (compaction writes them again).
    pub(super) fn compact_policies(&mut self, seg: u32) {
        let Some(j) = &mut self.journal else { return };
        let wall = self.wall_ms;
        self.flow.kinds.each_with_policy_mut(|kind, s| {
            if s.stored.segs.iter().any(|&x| x != 0 && x <= seg) {
                write_policy(j, kind, s, wall);
            }
        });
    }

    /// Marks the task with the policy that holds it back, for its JSON's `waiting_on`.
    pub(super) fn note_waiting(&self, task: &Task) {
        task.held_by.set(self.flow.held_by(task, self.wall_ms));
    }

    /// `relay_kind_running` / `relay_kind_pending` (kinds with a policy, at most
    /// [`crate::flow::MAX_LABELLED_KINDS`]) and `relay_dispatch_held_total`.
    ///
    /// The kinds with a policy are kept in order beside the others: a scrape costs
    /// `MAX_LABELLED_KINDS` at most, however many kinds there are.
    pub fn kind_gauges(&self, g: &mut crate::metrics::Gauges) {
        g.kinds = (self.flow.kinds.with_policy())
            .take(crate::flow::MAX_LABELLED_KINDS)
            .map(|(k, s)| (k.to_string(), u64::from(s.dispatched), u64::from(s.pending)))
            .collect();
        g.held = self.flow.held_total;
    }
}

#[cfg(test)]
mod tests {
    //! The rotation and the lanes on a real memory store (no sockets): the order, and that
    //! everything a lane keeps goes once nothing needs it.
    use super::*;
    use crate::store::{AttemptEnd, AttemptStart, InsertTo, NewTask, Next};
    use crate::tasks::Outcome;

    const CONN: ConnRef = ConnRef { slot: 9, generation: 9 };
    const WALL: u64 = 1_000_000;

    fn store() -> MemStore {
        let cfg = MemConfig {
            task_ttl_ms: 600_000,
            failed_ttl_ms: 0,
            max_pending: 100_000,
            max_pending_bytes: 1 << 30,
            task_memory_bytes: 1 << 30,
            task_timeout_ms: 1_000,
            max_retries: 0,
        };
        let mut s = MemStore::new(cfg, None);
        s.set_clock(0, WALL);
        s
    }

    fn events(s: &mut MemStore) -> Vec<Event> {
        let mut out = Vec::new();
        s.take_events(&mut out);
        out
    }

    /// A queued task of `kind` from `submitter` with `key`, its payload `name`.
    fn submit(s: &mut MemStore, kind: &str, submitter: &str, key: &str, name: &str) -> TaskId {
        let payload = RawValue::from_string(format!("{name:?}")).expect("raw");
        let new = Insert::from(NewTask { submitter, key, ..NewTask::queued(&payload, Some(kind)) });
        s.insert(&new, InsertTo::Submit { conn: CONN, wait: false });
        events(s)
            .into_iter()
            .find_map(|e| match e {
                Event::Inserted { id, .. } => Some(id),
                _ => None,
            })
            .expect("inserted")
    }

    /// Claims up to `n` tasks for one taker of every kind: (id, payload).
    fn claim(s: &mut MemStore, n: u32) -> Vec<(TaskId, String)> {
        s.claim(&ClaimAsk { group: 0, kinds: None, limit: n, takers: &[1] });
        events(s)
            .into_iter()
            .find_map(|e| match e {
                Event::Claimed { tasks, .. } => {
                    Some(tasks.into_iter().map(|c| (c.id, c.payload.get().trim_matches('"').to_string())).collect())
                }
                _ => None,
            })
            .unwrap_or_default()
    }

    /// The claimed task's attempt starts and ends done.
    fn run(s: &mut MemStore, id: TaskId) {
        let start = AttemptStart {
            client_id: 1,
            client_ip: std::net::IpAddr::from([127, 0, 0, 1]),
            started_wall_ms: s.wall_ms,
            started_mono_ms: s.now_ms,
            node: None,
            session: None,
        };
        s.attempt_started(id, 1, &start);
        let end = AttemptEnd {
            outcome: Outcome::Done,
            error: None,
            duration_ms: 1,
            ended_wall_ms: s.wall_ms,
            uncounted: false,
            resumes: 0,
        };
        let result = RawValue::from_string("null".into()).expect("raw");
        s.attempt_ended(id, 1, &end, Next::Done { result: &result });
        events(s);
    }

    fn lanes(s: &MemStore, kind: &str) -> usize {
        s.flow.kinds.get(kind).map_or(0, |k| k.rot.subs.values().map(|sub| sub.lanes.len()).sum())
    }

    /// `GET /kinds`: the answer and the stream it began, if it did.
    fn list_kinds(s: &mut MemStore) -> Response {
        s.kind_op(KindOp::List, CONN);
        events(s)
            .into_iter()
            .find_map(|e| match e {
                Event::Answer { response, .. } => Some(response),
                _ => None,
            })
            .expect("an answer")
    }

    /// The kinds an answer lists (`pieces` concatenated), in its order.
    fn kinds_of(pieces: &[u8]) -> Vec<String> {
        let v: serde_json::Value = serde_json::from_slice(pieces).expect("whole JSON");
        v["kinds"].as_array().expect("kinds").iter().map(|k| k["kind"].as_str().expect("kind").to_string()).collect()
    }

    #[test]
    fn kinds_are_listed_in_order_a_piece_at_a_time() {
        let mut s = store();
        // Few kinds: one answer, as before (no stream).
        let b = submit(&mut s, "b", "", "", "t");
        for k in ["a", "c"] {
            submit(&mut s, k, "", "", "t");
        }
        s.set_policy("p", Some(Policy { max_running: Some(1), ..Policy::default() }));
        events(&mut s);
        let small = list_kinds(&mut s);
        assert!(small.stream.is_none());
        assert_eq!(kinds_of(&small.body), ["a", "b", "c", "p"]);
        // Many: the first piece, then the rest from where it ended, each piece bounded.
        let names: Vec<String> = (0..5_000).map(|i| format!("k{:04}", (i * 7_919) % 5_000)).collect();
        for k in &names {
            submit(&mut s, k, "", "", "t");
        }
        let first = list_kinds(&mut s);
        let mut stream = *first.stream.expect("streamed");
        let mut body = first.body;
        let mut pieces = 1;
        // Meanwhile: a kind before the position (not listed), one after it (listed), one
        // after it that goes away (not listed), one listed already that goes away (stays).
        let gone = submit(&mut s, "k4999x", "", "", "t");
        submit(&mut s, "0-early", "", "", "t");
        submit(&mut s, "z-late", "", "", "t");
        for id in [gone, b] {
            s.cancel(id, None, CONN);
        }
        events(&mut s);
        while !stream.done {
            let mut piece = String::new();
            s.stream_piece(&mut stream, &mut piece);
            assert!(piece.len() <= crate::stream::PIECE_BYTES + 1024, "a piece of {} bytes", piece.len());
            body.extend_from_slice(piece.as_bytes());
            pieces += 1;
        }
        assert!(pieces > 3, "{pieces} pieces");
        let mut want: Vec<String> = ["a", "b", "c", "p", "z-late"].iter().map(|k| k.to_string()).collect();
        want.extend(names);
        want.sort();
        assert_eq!(kinds_of(&body), want);
        // Forgotten kinds leave the order too: none is listed twice, none left behind.
        assert_eq!(s.flow.kinds.order.len(), s.flow.kinds.map.len());
    }

    /// The kind gauges as a walk of every kind would give them (what a scrape did before the
    /// kinds with a policy had an index of their own).
    fn gauges_by_walk(s: &MemStore) -> Vec<(String, u64, u64)> {
        let mut all: Vec<(String, u64, u64)> = (s.flow.kinds.iter())
            .filter(|(_, st)| st.policy.is_some())
            .map(|(k, st)| (k.to_string(), u64::from(st.dispatched), u64::from(st.pending)))
            .collect();
        all.sort_unstable();
        all.truncate(crate::flow::MAX_LABELLED_KINDS);
        all
    }

    fn kind_gauges(s: &MemStore) -> Vec<(String, u64, u64)> {
        let mut g = crate::metrics::Gauges::default();
        s.kind_gauges(&mut g);
        g.kinds
    }

    #[test]
    fn the_kinds_with_a_policy_stay_indexed_exactly_as_policies_and_kinds_come_and_go() {
        let mut s = store();
        let capped = || Some(Policy { max_running: Some(1), ..Policy::default() });
        let check = |s: &MemStore, step: &str, want: &[&str]| {
            let walked = gauges_by_walk(s);
            assert_eq!(kind_gauges(s), walked, "{step}: the gauges");
            let named: Vec<&str> = walked.iter().map(|(k, _, _)| k.as_str()).collect();
            assert_eq!(named, want, "{step}");
            let indexed: Vec<&str> = s.flow.kinds.with_policy().map(|(k, _)| k).collect();
            assert_eq!(indexed.len(), s.flow.kinds.policies(), "{step}");
            assert!(indexed.len() <= crate::flow::MAX_LABELLED_KINDS && indexed == want, "{step}: {indexed:?}");
        };
        let mut ids = HashMap::new();
        for k in ["a", "b", "c"] {
            ids.insert(k, submit(&mut s, k, "", "", "t"));
        }
        check(&s, "no policy", &[]);
        s.set_policy("b", capped());
        check(&s, "a policy on a kind with tasks", &["b"]);
        s.set_policy("x", capped());
        check(&s, "a policy on a kind relay has not seen", &["b", "x"]);
        s.set_policy("b", Some(Policy { paused: true, ..Policy::default() }));
        check(&s, "a policy replaced", &["b", "x"]);
        s.set_policy("x", None);
        assert!(s.flow.kinds.get("x").is_none(), "a kind with no task and no policy is forgotten");
        check(&s, "a policy removed: its kind forgotten", &["b"]);
        s.cancel(ids["b"], None, CONN);
        events(&mut s);
        assert!(s.flow.kinds.get("b").is_some(), "a kind with a policy stays");
        check(&s, "the tasks of a kind with a policy gone", &["b"]);
        s.set_policy("b", None);
        assert!(s.flow.kinds.get("b").is_none());
        check(&s, "its policy removed too", &[]);
        s.set_policy("c", capped());
        s.set_policy("c", None);
        assert!(s.flow.kinds.get("c").is_some(), "a kind with tasks stays");
        check(&s, "a policy on and off a kind with tasks", &[]);
        s.set_policy("b", capped());
        submit(&mut s, "b", "", "", "t");
        events(&mut s);
        check(&s, "a kind back, with a policy", &["b"]);
        // More kinds with a policy than are labelled: the first ones in kind order.
        let names: Vec<String> = (0..1_200).map(|i| format!("p{:04}", (i * 7_919) % 1_200)).collect();
        for k in &names {
            s.set_policy(k, capped());
        }
        for k in names.iter().step_by(3) {
            submit(&mut s, k, "", "", "t");
        }
        events(&mut s);
        let mut want: Vec<&str> = names.iter().map(String::as_str).collect();
        want.push("b");
        want.sort_unstable();
        want.truncate(crate::flow::MAX_LABELLED_KINDS);
        let walked = gauges_by_walk(&s);
        assert_eq!(kind_gauges(&s), walked, "1,201 policies");
        assert_eq!(walked.iter().map(|(k, _, _)| k.as_str()).collect::<Vec<_>>(), want);
        assert_eq!(s.flow.kinds.policies(), 1_201);
        for k in &names {
            s.set_policy(k, None);
        }
        check(&s, "the 1,200 removed", &["b"]);
        assert!(s.flow.kinds.get("p0000").is_some() && s.flow.kinds.get("p0001").is_none());
    }

    #[test]
    fn the_rotation_goes_over_submitters_then_their_keys_then_each_keys_order() {
        let mut s = store();
        for (sub, key, name) in [
            ("", "a", "a0"),
            ("", "a", "a1"),
            ("", "a", "a2"),
            ("", "b", "b0"),
            ("s1", "", "s0"),
            ("s1", "", "s1"),
            ("s1", "", "s2"),
        ] {
            submit(&mut s, "k", sub, key, name);
        }
        let order: Vec<String> = (0..7).flat_map(|_| claim(&mut s, 1)).map(|c| c.1).collect();
        assert_eq!(order, ["a0", "s0", "b0", "s1", "a1", "s2", "a2"]);
        assert!(claim(&mut s, 1).is_empty());
    }

    #[test]
    fn one_claim_of_many_takes_the_rotation_in_turn() {
        let mut s = store();
        for i in 0..4 {
            submit(&mut s, "k", "", "", &format!("r{i}"));
        }
        for i in 0..2 {
            submit(&mut s, "k", "s1", "x", &format!("s{i}"));
        }
        let order: Vec<String> = claim(&mut s, 10).into_iter().map(|c| c.1).collect();
        assert_eq!(order, ["r0", "s0", "r1", "s1", "r2", "r3"]);
    }

    #[test]
    fn everything_is_forgotten_once_no_task_waits_or_runs() {
        let mut s = store();
        let mut ids = Vec::new();
        for i in 0..50 {
            let sub = ["", "s1", "s2"][i % 3];
            let key = format!("key{}", i % 7);
            ids.push(submit(&mut s, "k", sub, &key, "t"));
        }
        // Half run, the rest are canceled (some claimed first, given back).
        let claimed = claim(&mut s, 20);
        for (id, _) in &claimed[..10] {
            run(&mut s, *id);
        }
        for (id, _) in &claimed[10..] {
            s.give_back(*id, 1);
        }
        for id in ids {
            s.cancel(id, None, CONN);
            events(&mut s);
        }
        assert!(s.flow.heads.is_empty());
        assert!(s.flow.kinds.is_empty(), "{:?}", s.flow.kinds.iter().map(|(k, _)| k).collect::<Vec<_>>());
        assert!(s.flow.none.subs.is_empty());
    }

    #[test]
    fn an_idle_lane_keeps_its_bucket_until_it_is_full_again_and_no_longer() {
        let mut s = store();
        let policy = Policy { rate_per_key: Some(crate::flow::Rate { count: 1, per_ms: 1_000 }), ..Policy::default() };
        s.set_policy("k", Some(policy));
        events(&mut s);
        for i in 0..40 {
            submit(&mut s, "k", "", &format!("key{i}"), "t");
        }
        let claimed = claim(&mut s, 100);
        assert_eq!(claimed.len(), 40, "a full bucket each");
        for (id, _) in claimed {
            run(&mut s, id);
        }
        assert_eq!(lanes(&s, "k"), 40, "empty buckets are kept: a key does not refill by emptying");
        // Its next task waits for the token, though the lane had emptied.
        submit(&mut s, "k", "", "key0", "again");
        assert!(claim(&mut s, 1).is_empty());
        s.set_clock(1_000, WALL + 1_000);
        s.on_timer();
        events(&mut s);
        assert_eq!(claim(&mut s, 1).len(), 1, "its token came");
        s.set_clock(2_000, WALL + 2_000);
        s.on_timer();
        assert_eq!(lanes(&s, "k"), 1, "full buckets are forgotten (key0's task is claimed)");
        assert!(s.flow.expiries.len() <= 1);
        // At most MAX_IDLE_LANES idle lanes however many keys empty at once.
        for i in 0..(MAX_IDLE_LANES + 30) {
            submit(&mut s, "k", "s1", &format!("many{i}"), "t");
        }
        for (id, _) in claim(&mut s, 10_000) {
            run(&mut s, id);
        }
        assert!(lanes(&s, "k") <= MAX_IDLE_LANES + 1, "{} lanes", lanes(&s, "k"));
        assert!(s.flow.expiries.len() <= MAX_IDLE_LANES);
    }
}
