//! What the connected workers could ever take, kept up to date as workers come, change their
//! hello and go, so that "can anyone take this kind?" and "which waiting tasks just lost their
//! last possible worker?" cost what changed, not (waiting tasks × workers).
//!
//! Owned by the core; no I/O, no clock.

use std::collections::{BTreeSet, HashMap, HashSet};

use crate::tasks::TaskId;

use super::IdSet;

/// A kind as a map key (`None`: tasks without a kind).
pub(super) type KindKey = Option<Box<str>>;

fn key(kind: Option<&str>) -> KindKey {
    kind.map(Box::from)
}

/// What one worker accepts, as far as eligibility goes (capacity aside).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Accepts {
    /// Draining (`concurrency: 0`), or `kinds: []`.
    Nothing,
    /// No kinds declared: every task, also those without a kind.
    All,
    /// These kinds (without repeats).
    Kinds(Vec<Box<str>>),
}

impl Accepts {
    pub(super) fn of(active: bool, kinds: Option<&[Box<str>]>) -> Accepts {
        match kinds {
            _ if !active => Accepts::Nothing,
            None => Accepts::All,
            Some([]) => Accepts::Nothing,
            Some(kinds) => {
                let mut seen = HashSet::with_capacity(kinds.len());
                Accepts::Kinds(kinds.iter().filter(|k| seen.insert(&***k)).cloned().collect())
            }
        }
    }

    fn takes(&self, kind: Option<&str>) -> bool {
        match self {
            Accepts::Nothing => false,
            Accepts::All => true,
            Accepts::Kinds(kinds) => kind.is_some_and(|kind| kinds.iter().any(|k| &**k == kind)),
        }
    }
}

/// How many active workers take each kind.
#[derive(Debug, Default)]
pub(super) struct Reach {
    all: usize,
    by_kind: HashMap<Box<str>, usize>,
}

impl Reach {
    pub(super) fn add(&mut self, accepts: &Accepts) {
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

    pub(super) fn remove(&mut self, accepts: &Accepts) {
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
    pub(super) fn count(&self, kind: Option<&str>) -> usize {
        match kind {
            // A worker that declared kinds never takes a task without one.
            None => self.all,
            Some(k) => self.all + self.by_kind.get(k).copied().unwrap_or(0),
        }
    }
}

/// Waiting tasks that fail once no untried worker that could take them is connected (retries,
/// and tasks submitted without `queue` or a schedule), by kind. A task that was never tried
/// loses hope only when nobody takes its kind any more; a retry also when every worker that
/// does was tried, which needs at least as many attempts as there are such workers — so
/// retries are kept ordered by their number of attempts.
#[derive(Debug, Default)]
pub(super) struct Fragile {
    fresh: HashMap<KindKey, IdSet>,
    retry: HashMap<KindKey, BTreeSet<(usize, TaskId)>>,
}

impl Fragile {
    pub(super) fn insert(&mut self, kind: Option<&str>, id: TaskId, attempts: usize) {
        if attempts == 0 {
            self.fresh.entry(key(kind)).or_default().insert(id);
        } else {
            self.retry.entry(key(kind)).or_default().insert((attempts, id));
        }
    }

    pub(super) fn remove(&mut self, kind: Option<&str>, id: TaskId, attempts: usize) {
        let k = key(kind);
        if attempts == 0 {
            if let Some(set) = self.fresh.get_mut(&k) {
                set.remove(&id);
                if set.is_empty() {
                    self.fresh.remove(&k);
                }
            }
        } else if let Some(set) = self.retry.get_mut(&k) {
            set.remove(&(attempts, id));
            if set.is_empty() {
                self.retry.remove(&k);
            }
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.fresh.is_empty() && self.retry.is_empty()
    }

    /// The kind keys with waiting fragile tasks that a worker accepting `before` and now
    /// `after` may have left without a worker.
    pub(super) fn affected(&self, before: &Accepts, after: &Accepts) -> Vec<KindKey> {
        let lost = |k: &KindKey| before.takes(k.as_deref()) && !after.takes(k.as_deref());
        let waiting = |k: &KindKey| self.fresh.contains_key(k) || self.retry.contains_key(k);
        match before {
            Accepts::Nothing => Vec::new(),
            Accepts::All if *after == Accepts::All => Vec::new(),
            Accepts::All => {
                let keys: HashSet<&KindKey> = self.fresh.keys().chain(self.retry.keys()).collect();
                keys.into_iter().filter(|k| lost(k)).cloned().collect()
            }
            Accepts::Kinds(kinds) => kinds.iter().map(|k| Some(k.clone())).filter(|k| lost(k) && waiting(k)).collect(),
        }
    }

    /// Every fragile task of a kind (when nobody takes that kind any more).
    pub(super) fn all_of(&self, kind: &KindKey) -> Vec<TaskId> {
        let fresh = self.fresh.get(kind).into_iter().flatten().copied();
        let retry = self.retry.get(kind).into_iter().flatten().map(|&(_, id)| id);
        fresh.chain(retry).collect()
    }

    /// Retries of a kind with at least `attempts` attempts: the only ones that can have tried
    /// every one of `attempts` workers.
    pub(super) fn retries_with_at_least(&self, kind: &KindKey, attempts: usize) -> Vec<TaskId> {
        self.retry.get(kind).into_iter().flat_map(|set| set.range((attempts, 0)..)).map(|&(_, id)| id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(ks: &[&str]) -> Accepts {
        Accepts::Kinds(ks.iter().map(|k| Box::from(*k)).collect())
    }

    #[test]
    fn counts_follow_workers() {
        let mut reach = Reach::default();
        let a = Accepts::of(true, Some(&[Box::from("a"), Box::from("a"), Box::from("b")]));
        assert_eq!(a, kinds(&["a", "b"]), "repeats count once");
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
    fn affected_kinds() {
        let mut f = Fragile::default();
        f.insert(Some("a"), 1, 0);
        f.insert(Some("b"), 2, 1);
        f.insert(None, 3, 0);
        let sorted = |mut v: Vec<KindKey>| {
            v.sort();
            v
        };
        let check = |before: Accepts, after: Accepts, expected: &[Option<&str>]| {
            let got = sorted(f.affected(&before, &after));
            let expected: Vec<KindKey> = expected.iter().map(|k| k.map(Box::from)).collect();
            assert_eq!(got, sorted(expected), "{before:?} -> {after:?}");
        };
        check(Accepts::All, Accepts::All, &[]);
        check(Accepts::All, Accepts::Nothing, &[Some("a"), Some("b"), None]);
        check(Accepts::All, kinds(&["a"]), &[Some("b"), None]);
        check(kinds(&["a", "b", "z"]), kinds(&["b"]), &[Some("a")]);
        check(kinds(&["a"]), Accepts::All, &[]);
        check(Accepts::Nothing, Accepts::Nothing, &[]);
        let b = Some(Box::from("b"));
        assert_eq!(f.retries_with_at_least(&b, 1), [2]);
        assert!(f.retries_with_at_least(&b, 2).is_empty());
        f.remove(Some("b"), 2, 1);
        f.remove(Some("a"), 1, 0);
        f.remove(None, 3, 0);
        assert!(f.is_empty());
    }
}
