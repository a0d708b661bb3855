//! Waiting tasks that fail once no untried worker that could take them is connected (SPEC §5:
//! retries, and tasks submitted without `queue` or a schedule), by kind, so that "which waiting
//! tasks just lost their last possible worker?" costs what changed, not waiting tasks × workers.
//!
//! A task that was never tried loses hope only when nobody takes its kind any more; a retry
//! also when every worker that does was tried, which needs at least as many attempts as there
//! are such workers — so retries are kept ordered by their number of attempts.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::BuildHasherDefault;

use crate::tasks::{IdHasher, TaskId};

/// A kind as a map key (`None`: tasks without a kind).
pub type KindKey = Option<Box<str>>;

type IdSet = HashSet<TaskId, BuildHasherDefault<IdHasher>>;

fn key(kind: Option<&str>) -> KindKey {
    kind.map(Box::from)
}

#[derive(Debug, Default)]
pub struct Fragile {
    fresh: HashMap<KindKey, IdSet>,
    retry: HashMap<KindKey, BTreeSet<(usize, TaskId)>>,
}

impl Fragile {
    pub fn insert(&mut self, kind: Option<&str>, id: TaskId, attempts: usize) {
        if attempts == 0 {
            self.fresh.entry(key(kind)).or_default().insert(id);
        } else {
            self.retry.entry(key(kind)).or_default().insert((attempts, id));
        }
    }

    pub fn remove(&mut self, kind: Option<&str>, id: TaskId, attempts: usize) {
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

    pub fn is_empty(&self) -> bool {
        self.fresh.is_empty() && self.retry.is_empty()
    }

    /// The kinds with waiting fragile tasks among `kinds` (`None`: every kind).
    pub fn kinds_among(&self, kinds: Option<&[KindKey]>) -> Vec<KindKey> {
        match kinds {
            Some(kinds) => {
                kinds.iter().filter(|k| self.fresh.contains_key(*k) || self.retry.contains_key(*k)).cloned().collect()
            }
            None => {
                let keys: HashSet<&KindKey> = self.fresh.keys().chain(self.retry.keys()).collect();
                keys.into_iter().cloned().collect()
            }
        }
    }

    /// Every fragile task of a kind (when nobody takes that kind any more).
    pub fn all_of(&self, kind: &KindKey) -> Vec<TaskId> {
        let fresh = self.fresh.get(kind).into_iter().flatten().copied();
        let retry = self.retry.get(kind).into_iter().flatten().map(|&(_, id)| id);
        fresh.chain(retry).collect()
    }

    /// Retries of a kind with at least `attempts` attempts: the only ones that can have tried
    /// every one of `attempts` workers.
    pub fn retries_with_at_least(&self, kind: &KindKey, attempts: usize) -> Vec<TaskId> {
        self.retry.get(kind).into_iter().flat_map(|set| set.range((attempts, 0)..)).map(|&(_, id)| id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_and_retries() {
        let mut f = Fragile::default();
        f.insert(Some("a"), 1, 0);
        f.insert(Some("b"), 2, 1);
        f.insert(None, 3, 0);
        let sorted = |mut v: Vec<KindKey>| {
            v.sort();
            v
        };
        let all: Vec<KindKey> = vec![None, Some("a".into()), Some("b".into())];
        assert_eq!(sorted(f.kinds_among(None)), all);
        let asked: Vec<KindKey> = vec![Some("a".into()), Some("z".into())];
        assert_eq!(f.kinds_among(Some(&asked)), vec![Some(Box::from("a"))]);
        let b = Some(Box::from("b"));
        assert_eq!(f.retries_with_at_least(&b, 1), [2]);
        assert!(f.retries_with_at_least(&b, 2).is_empty());
        assert_eq!(f.all_of(&None), [3]);
        f.remove(Some("b"), 2, 1);
        f.remove(Some("a"), 1, 0);
        f.remove(None, 3, 0);
        assert!(f.is_empty());
    }
}
