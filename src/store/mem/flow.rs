//! The memory store's flow control (SPEC §14): each kind's counts, policy and token buckets,
//! and the ready lanes a claim walks.
//!
//! Every kind has a ready lane (its due-order queue, less priorities; tasks without a kind have
//! one too). `heads` holds the first task of every lane that is *open*: not empty, and not held
//! back by its kind's policy (paused, at its running cap, or out of rate tokens). A claim for
//! workers of every kind merges the lanes through `heads`, so a held kind costs it nothing — it
//! is not there — and a claim for a worker's kinds merges only its kinds' open lanes: no
//! head-of-line blocking and no scan. A held kind opens again when what held it changes: its
//! policy, one of its attempts ending (concurrency), or the time its next token is due (rate).

use std::collections::btree_map;
use std::iter::Peekable;
use std::ops::Bound;

use super::*;
use crate::flow::{Bucket, KindOp, Policy, WaitingOn, kind_response, unknown_kind};

/// A kind as the memory store knows it: tasks pending and running, its policy.
#[derive(Debug, Default)]
pub(super) struct KindState {
    pub policy: Option<Policy>,
    /// Where the policy's journal record is (pins its segment).
    pub stored: Stored,
    pub pending: u32,
    pub dispatched: u32,
    /// Claimed and not started yet: they count against the running cap.
    pub claimed: u32,
    pub buckets: Vec<Bucket>,
    /// Why its lane is out of `heads` (`None`: open).
    pub held: Option<WaitingOn>,
}

impl KindState {
    fn forgettable(&self) -> bool {
        self.policy.is_none() && self.pending == 0 && self.dispatched == 0 && self.claimed == 0
    }

    fn occupied(&self) -> u32 {
        self.dispatched + self.claimed
    }

    /// Why the kind holds its tasks back now, if it does.
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
        if let Some(cap) = p.running_cap() {
            room = Some((cap.saturating_sub(self.occupied()), WaitingOn::Concurrency));
        }
        for b in &self.buckets {
            let mut b = *b;
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

/// A lane's entries in order.
type LaneIter<'a> = Peekable<btree_map::Range<'a, QueueKey, TaskId>>;

impl MemStore {
    // ----- counts --------------------------------------------------------------------------

    /// A task of `kind` went from `from` to `to` (`None`: did not exist / is gone).
    pub(super) fn count_kind(&mut self, kind: Option<&str>, from: Option<Status>, to: Option<Status>) {
        let Some(kind) = kind else { return };
        if from == to {
            return;
        }
        let s = match self.kinds.get_mut(kind) {
            Some(s) => s,
            None => self.kinds.entry(Box::from(kind)).or_default(),
        };
        for (status, d) in [(from, -1i64), (to, 1)] {
            match status {
                Some(Status::Pending) => s.pending = (i64::from(s.pending) + d).max(0) as u32,
                Some(Status::Dispatched) => s.dispatched = (i64::from(s.dispatched) + d).max(0) as u32,
                _ => {}
            }
        }
        let freed = from == Some(Status::Dispatched);
        if s.forgettable() {
            self.kinds.remove(kind);
        } else if freed {
            self.reopen(kind);
        }
    }

    /// A claim took (`+1`) or let go of (`-1`) a task of `kind` before its attempt started.
    pub(super) fn count_claimed(&mut self, kind: Option<&str>, took: bool) {
        let Some(kind) = kind else { return };
        let Some(s) = self.kinds.get_mut(kind) else { return };
        if took {
            s.claimed += 1;
        } else {
            s.claimed = s.claimed.saturating_sub(1);
            self.reopen(kind);
        }
    }

    // ----- lanes ---------------------------------------------------------------------------

    fn lane(&self, kind: Option<&str>) -> Option<&BTreeMap<QueueKey, TaskId>> {
        match kind {
            None => Some(&self.ready_none),
            Some(k) => self.ready_kind.get(k),
        }
    }

    fn lane_first(&self, kind: Option<&str>) -> Option<(QueueKey, TaskId)> {
        self.lane(kind).and_then(|l| l.first_key_value()).map(|(k, id)| (*k, *id))
    }

    fn lane_open(&self, kind: Option<&str>) -> bool {
        kind.is_none_or(|k| self.kinds.get(k).is_none_or(|s| s.held.is_none()))
    }

    /// Puts a ready task in its lane (and `heads`, if it is the open lane's new first).
    pub(super) fn lane_insert(&mut self, kind: Option<&str>, key: QueueKey, id: TaskId) {
        let old = self.lane_first(kind);
        match kind {
            None => {
                self.ready_none.insert(key, id);
            }
            Some(k) => match self.ready_kind.get_mut(k) {
                Some(q) => {
                    q.insert(key, id);
                }
                None => {
                    self.ready_kind.insert(Box::from(k), BTreeMap::from([(key, id)]));
                }
            },
        }
        if old.is_none_or(|(o, _)| key < o) && self.lane_open(kind) {
            if let Some((o, _)) = old {
                self.heads.remove(&o);
            }
            self.heads.insert(key, id);
        }
    }

    pub(super) fn lane_remove(&mut self, kind: Option<&str>, key: QueueKey) {
        let was_first = self.lane_first(kind).is_some_and(|(k, _)| k == key);
        match kind {
            None => {
                self.ready_none.remove(&key);
            }
            Some(k) => {
                if let Some(q) = self.ready_kind.get_mut(k) {
                    q.remove(&key);
                    if q.is_empty() {
                        self.ready_kind.remove(k);
                    }
                }
            }
        }
        if was_first
            && self.heads.remove(&key).is_some()
            && let Some((k, id)) = self.lane_first(kind)
        {
            self.heads.insert(k, id);
        }
    }

    /// Holds the kind's lane back (`Some`) or opens it (`None`).
    fn set_held(&mut self, kind: &str, held: Option<WaitingOn>) {
        let Some(s) = self.kinds.get_mut(kind) else { return };
        let was = s.held;
        s.held = held;
        match (was.is_some(), held.is_some()) {
            (false, true) => {
                if let Some((k, _)) = self.lane_first(Some(kind)) {
                    self.heads.remove(&k);
                }
            }
            (true, false) => {
                if let Some((k, id)) = self.lane_first(Some(kind)) {
                    self.heads.insert(k, id);
                    self.events.push(Event::Ready);
                }
            }
            _ => {}
        }
    }

    /// Decides again whether the kind's lane is held, after what holds it may have changed.
    fn reopen(&mut self, kind: &str) {
        let wall = self.wall_ms;
        let Some(s) = self.kinds.get(kind) else { return };
        if s.held.is_none() && s.policy.is_none_or(|p| !p.limits()) {
            return;
        }
        let (held, (_, why)) = (s.held, s.room(wall));
        if why == Some(WaitingOn::Rate) {
            self.wake_for_rate(kind);
        }
        // (An open lane is closed by the claim that finds it out of room, not here: a held
        // task costs a claim nothing either way, and this keeps every attempt end cheap.)
        if why.is_none() || held.is_some() {
            self.set_held(kind, why);
        }
    }

    /// The kind is out of tokens: it opens again when its next one is due.
    fn wake_for_rate(&mut self, kind: &str) {
        let wall = self.wall_ms;
        let Some(s) = self.kinds.get_mut(kind) else { return };
        let at = s.buckets.iter_mut().map(|b| b.next_token_ms(wall)).max().unwrap_or(wall);
        self.rate_wakes.insert((at, Box::from(kind)));
    }

    /// Kinds whose next token is due now open again.
    pub(super) fn on_rate_wakes(&mut self) {
        while let Some((at, _)) = self.rate_wakes.first() {
            if *at > self.wall_ms {
                break;
            }
            let Some((_, kind)) = self.rate_wakes.pop_first() else { break };
            self.reopen(&kind);
        }
    }

    /// When a rate-held kind opens again (the loop's clock).
    pub(super) fn next_rate_wake_ms(&self) -> Option<u64> {
        self.rate_wakes.first().map(|(at, _)| self.now_ms + at.saturating_sub(self.wall_ms))
    }

    /// May a task of `kind` start now without waiting for anything its policy says?
    pub(super) fn unlimited(&self, kind: Option<&str>) -> bool {
        kind.is_none_or(|k| self.kinds.get(k).is_none_or(|s| s.policy.is_none_or(|p| !p.limits())))
    }

    /// The insert's fast path: may a task of `kind` start at once under its policy? If so, it
    /// takes its rate tokens now (its claim counts it against the running cap).
    pub(super) fn admit_now(&mut self, kind: Option<&str>) -> bool {
        if self.unlimited(kind) {
            return true;
        }
        let (wall, Some(k)) = (self.wall_ms, kind) else { return true };
        let Some(s) = self.kinds.get_mut(k) else { return true };
        if s.held.is_some() || s.room(wall).1.is_some() {
            return false;
        }
        for b in &mut s.buckets {
            b.take(wall, 1);
        }
        true
    }

    pub fn kind_paused(&self, kind: Option<&str>) -> bool {
        kind.is_some_and(|k| self.kinds.get(k).and_then(|s| s.policy).is_some_and(|p| p.paused))
    }

    // ----- claims ----------------------------------------------------------------------------

    /// The ready tasks a claim takes, in dispatch order: of its kinds, with room under their
    /// kinds' policies, and not tried by every taker. Kinds found out of room are held.
    pub(super) fn claimable(&mut self, ask: &ClaimAsk<'_>) -> Vec<TaskId> {
        let limit = ask.limit as usize;
        if limit == 0 {
            return Vec::new();
        }
        let wall = self.wall_ms;
        let mut out = Vec::new();
        // Limited kinds this claim met: (kind, room left, what holds it once out of room).
        let mut rooms: Vec<(&str, u32, WaitingOn)> = Vec::new();
        let mut full: Vec<(Box<str>, WaitingOn)> = Vec::new();
        {
            let kinds_state = &self.kinds;
            let tasks = &self.tasks;
            let takeable = |id: &TaskId| {
                tasks.get(id).is_some_and(|t| t.this_run().is_empty() || ask.takers.iter().any(|&c| !t.tried(c)))
            };
            let mut lanes: Vec<LaneIter<'_>> = Vec::new();
            let mut heads = match ask.kinds {
                None => Some(self.heads.iter().peekable()),
                Some(kinds) => {
                    for k in kinds {
                        if let Some(q) = self.ready_kind.get(&**k)
                            && kinds_state.get(&**k).is_none_or(|s| s.held.is_none())
                        {
                            lanes.push(q.range(..).peekable());
                        }
                    }
                    None
                }
            };
            let mut skipped = 0;
            loop {
                // The next task in order: the first of the open heads not walked yet, or the
                // next of a lane this claim is walking.
                let mut best: Option<(QueueKey, usize)> = None;
                for (i, l) in lanes.iter_mut().enumerate() {
                    if let Some((k, _)) = l.peek()
                        && best.is_none_or(|(b, _)| **k < b)
                    {
                        best = Some((**k, i));
                    }
                }
                let from_heads = match (heads.as_mut().and_then(|h| h.peek()), best) {
                    (Some((hk, _)), Some((bk, _))) => **hk < bk,
                    (Some(_), None) => true,
                    (None, _) => false,
                };
                let (key, id, lane_at) = if from_heads {
                    let Some((k, id)) = heads.as_mut().and_then(Iterator::next) else { break };
                    (*k, *id, None)
                } else {
                    let Some((_, i)) = best else { break };
                    let Some((k, id)) = lanes[i].next() else { break };
                    (*k, *id, Some(i))
                };
                let Some(task) = tasks.get(&id) else { continue };
                let kind = task.kind.as_deref();
                // Room under the kind's policy.
                let mut blocked = false;
                if let Some(k) = kind
                    && let Some(s) = kinds_state.get(k)
                    && s.policy.is_some_and(|p| p.limits())
                {
                    let at = match rooms.iter().position(|r| r.0 == k) {
                        Some(at) => at,
                        None => {
                            let (room, why) = s.room_and_bound(wall);
                            rooms.push((k, room.unwrap_or(u32::MAX), why));
                            rooms.len() - 1
                        }
                    };
                    if rooms[at].1 == 0 {
                        blocked = true;
                        if !full.iter().any(|f| &*f.0 == k) {
                            full.push((Box::from(k), rooms[at].2));
                        }
                    } else if takeable(&id) {
                        rooms[at].1 -= 1;
                    }
                }
                if !blocked {
                    if takeable(&id) {
                        out.push(id);
                    } else {
                        skipped += 1;
                    }
                    // Walk on in this lane (a head from `heads` opens its lane's walk).
                    if lane_at.is_none() && out.len() < limit && skipped < MAX_CLAIM_SKIP {
                        let lane = match kind {
                            None => Some(&self.ready_none),
                            Some(k) => self.ready_kind.get(k),
                        };
                        if let Some(q) = lane {
                            lanes.push(q.range((Bound::Excluded(key), Bound::Unbounded)).peekable());
                        }
                    }
                } else if let Some(i) = lane_at {
                    // A held kind's lane is walked no further.
                    drop(lanes.swap_remove(i));
                }
                if out.len() >= limit || skipped >= MAX_CLAIM_SKIP {
                    break;
                }
            }
        }
        // Rate tokens for what was taken; kinds out of room are held.
        let mut taken: Vec<(Box<str>, u32)> = Vec::new();
        for id in &out {
            if let Some(k) = self.tasks.get(id).and_then(|t| t.kind.as_deref())
                && self.kinds.get(k).is_some_and(|s| !s.buckets.is_empty())
            {
                match taken.iter_mut().find(|t| &*t.0 == k) {
                    Some(t) => t.1 += 1,
                    None => taken.push((Box::from(k), 1)),
                }
            }
        }
        for (k, n) in taken {
            if let Some(s) = self.kinds.get_mut(&*k) {
                for b in &mut s.buckets {
                    b.take(wall, n);
                }
            }
        }
        for (k, why) in full {
            self.held_total[why.index()] += 1;
            if why == WaitingOn::Rate {
                self.wake_for_rate(&k);
            }
            self.set_held(&k, Some(why));
        }
        out
    }

    // ----- policies --------------------------------------------------------------------------

    /// `GET/PUT/DELETE /kinds/{kind}`, `GET /kinds`: [`Event::Answer`].
    pub fn kind_op(&mut self, op: KindOp, conn: ConnRef) {
        match op {
            KindOp::Get(kind) => {
                let r = match self.kinds.get(kind.as_str()) {
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
                    && self.kinds.get(kind.as_str()).is_none_or(|s| s.policy.is_none())
                    && self.policies >= crate::flow::MAX_POLICIES
                {
                    self.answer(
                        conn,
                        Response::error(409, "too_many_policies", "relay keeps at most 10000 kind policies"),
                    );
                    return;
                }
                let lsn = self.set_policy(&kind, policy);
                let s = self.kinds.get(kind.as_str());
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
                let mut names: Vec<&str> = self.kinds.keys().map(|k| &**k).collect();
                names.sort_unstable();
                let mut s = String::from("{\"kinds\":[");
                for (i, k) in names.iter().enumerate() {
                    if i > 0 {
                        s.push(',');
                    }
                    let st = &self.kinds[*k];
                    crate::flow::write_kind_json(
                        &mut s,
                        k,
                        st.policy.as_ref(),
                        st.dispatched.into(),
                        st.pending.into(),
                    );
                }
                s.push_str("]}");
                self.answer(conn, Response::json(200, s.into_bytes()));
            }
        }
    }

    /// Replaces (`Some`) or removes the kind's policy, journaled; returns the record's number.
    pub(super) fn set_policy(&mut self, kind: &str, policy: Option<Policy>) -> u64 {
        let had = self.kinds.get(kind).is_some_and(|s| s.policy.is_some());
        let s = self.kinds.entry(Box::from(kind)).or_default();
        let mut stored = s.stored;
        let buckets: Vec<Bucket> = policy.iter().flat_map(|p| p.buckets()).collect();
        // A rate that stays the same keeps its bucket (a resume does not refill it).
        let kept: Vec<Bucket> =
            if buckets.len() == s.buckets.len() && buckets.iter().zip(&s.buckets).all(|(a, b)| a.same_shape(b)) {
                std::mem::take(&mut s.buckets)
            } else {
                buckets
            };
        s.buckets = kept;
        s.policy = policy;
        match (had, policy.is_some()) {
            (false, true) => self.policies += 1,
            (true, false) => self.policies -= 1,
            _ => {}
        }
        let mut lsn = 0;
        if let Some(j) = &mut self.journal {
            let json = policy.map(|p| p.to_json());
            j.policy(kind, json.as_deref(), &mut stored);
            lsn = j.lsn();
        }
        if let Some(s) = self.kinds.get_mut(kind) {
            s.stored = stored;
            let forget = s.forgettable();
            let held = s.held;
            if forget {
                if held.is_some() {
                    self.set_held(kind, None);
                }
                self.kinds.remove(kind);
                return lsn;
            }
        }
        let wall = self.wall_ms;
        let why = self.kinds.get(kind).and_then(|s| s.room(wall).1);
        if why == Some(WaitingOn::Rate) {
            self.wake_for_rate(kind);
        }
        self.set_held(kind, why);
        self.events.push(Event::Ready);
        lsn
    }

    /// Policies restored from the journal at start.
    pub(super) fn restore_policies(&mut self, policies: Vec<(Box<str>, Policy, Stored)>) {
        for (kind, policy, stored) in policies {
            let s = self.kinds.entry(kind.clone()).or_default();
            s.buckets = policy.buckets().collect();
            s.policy = Some(policy);
            s.stored = stored;
            self.policies += 1;
            if policy.paused {
                s.held = Some(WaitingOn::Paused);
            }
        }
    }

    /// Policies whose record pins segment `seg` or an older one (compaction writes them again).
    pub(super) fn compact_policies(&mut self, seg: u32) {
        let Some(j) = &mut self.journal else { return };
        for (kind, s) in self.kinds.iter_mut() {
            if let Some(p) = &s.policy
                && s.stored.segs.iter().any(|&x| x != 0 && x <= seg)
            {
                let json = p.to_json();
                j.policy(kind, Some(&json), &mut s.stored);
            }
        }
    }

    /// The kind policy that holds a pending task back now, if one does (SPEC §14).
    pub(super) fn held_by(&self, task: &Task) -> Option<WaitingOn> {
        if task.status != Status::Pending {
            return None;
        }
        let s = self.kinds.get(task.kind.as_deref()?)?;
        s.room(self.wall_ms).1
    }

    /// Marks the task with the policy that holds it back, for its JSON's `waiting_on`.
    pub(super) fn note_waiting(&self, task: &Task) {
        task.held_by.set(self.held_by(task));
    }

    /// `relay_kind_running` / `relay_kind_pending` (kinds with a policy, at most
    /// [`crate::flow::MAX_LABELLED_KINDS`]) and `relay_dispatch_held_total`.
    pub fn kind_gauges(&self, g: &mut crate::metrics::Gauges) {
        let mut kinds: Vec<(&str, u64, u64)> = self
            .kinds
            .iter()
            .filter(|(_, s)| s.policy.is_some())
            .map(|(k, s)| (&**k, u64::from(s.dispatched), u64::from(s.pending)))
            .collect();
        kinds.sort_unstable();
        kinds.truncate(crate::flow::MAX_LABELLED_KINDS);
        g.kinds = kinds.into_iter().map(|(k, r, p)| (k.to_string(), r, p)).collect();
        g.held = self.held_total;
    }
}
