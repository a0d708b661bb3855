//! `GET /tasks` in the memory store: one bounded page planned from the submission index
//! (`crate::listing` has the query, the cursor and the limits). Tasks that left memory
//! (`TASK_MEMORY`) keep their place in the index until `TASK_TTL`: a page that reaches them is
//! completed by reading them back from the journal (`durable.rs`), never on the loop.

use super::*;
use crate::listing::{MAX_PAGE_BYTES, MAX_SCAN, Query};
use crate::tasks::kind_hash;

/// One page as planned on the loop: the JSON of the tasks in memory, and the tasks that left
/// memory whose JSON must be read back from the journal first.
pub struct Plan {
    /// In page order: a task's JSON, or `None` for one to read back (`evicted` says which).
    pub pieces: Vec<Option<String>>,
    pub evicted: Vec<(usize, TaskId)>,
    /// Where the next page starts, if there is one.
    pub next: Option<u64>,
    /// The newest journal record the page shows (the answer waits for it, SPEC §7).
    pub lsn: u64,
}

impl MemStore {
    pub fn list(&mut self, q: &Query, scope: Option<&[String]>, conn: ConnRef) {
        let plan = self.plan(q, scope);
        if plan.evicted.is_empty() {
            let mut r = Response::json(200, crate::listing::render(&plan.pieces, plan.next));
            r.lsn = plan.lsn;
            self.answer(conn, r);
        } else {
            self.read_page(conn, plan, q.kind.clone(), scope);
        }
    }

    /// Plans one page (bounded work: see `crate::listing`).
    fn plan(&self, q: &Query, scope: Option<&[String]>) -> Plan {
        let mut plan = Plan { pieces: Vec::new(), evicted: Vec::new(), next: None, lsn: 0 };
        let mut bytes = 0;
        // A scoped token asking for a kind outside its scope sees nothing (and learns nothing).
        if q.kind.as_deref().is_some_and(|k| !in_scope(Some(k), scope)) {
            return plan;
        }
        let want_hash = q.kind.as_deref().map(|k| kind_hash(Some(k)));
        let scope_hashes: Option<Vec<u32>> = scope.map(|kinds| kinds.iter().map(|k| kind_hash(Some(k))).collect());
        for (scanned, (seq, id)) in self.tasks_newest_first(q.below).enumerate() {
            if scanned == MAX_SCAN || (!plan.pieces.is_empty() && bytes >= MAX_PAGE_BYTES) {
                // Out of budget: the next page starts below the last task looked at.
                plan.next = Some(seq.saturating_add(1));
                break;
            }
            let piece = if let Some(task) = self.tasks.get(&id) {
                let matches = q.status.is_none_or(|s| task.status == s)
                    && q.kind.as_deref().is_none_or(|k| task.kind.as_deref() == Some(k))
                    && in_scope(task.kind.as_deref(), scope);
                if !matches {
                    continue;
                }
                let mut json = String::new();
                self.note_waiting(task);
                task.write_json(&mut json);
                plan.lsn = plan.lsn.max(task.stored.lsn);
                Ok(json)
            } else if let Some(e) = self.evicted.get(&id) {
                // The kind is compared by hash here and exactly once the task is read back.
                let matches = q.status.is_none_or(|s| e.status == s)
                    && want_hash.is_none_or(|h| e.kind_hash == h)
                    && scope_hashes.as_ref().is_none_or(|hs| hs.contains(&e.kind_hash));
                if !matches {
                    continue;
                }
                // To be read back: its JSON is about its record's size (result included), a
                // little more.
                Err(e.loc.len as usize + 512)
            } else {
                continue;
            };
            if plan.pieces.len() == q.limit {
                // Another match exists: the page is full and is not the last.
                plan.next = Some(seq.saturating_add(1));
                break;
            }
            match piece {
                Ok(json) => {
                    bytes += json.len();
                    plan.pieces.push(Some(json));
                }
                Err(estimate) => {
                    bytes += estimate;
                    plan.evicted.push((plan.pieces.len(), id));
                    plan.pieces.push(None);
                }
            }
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    //! Pages read from a real memory store (no sockets): order, stable cursors, filters,
    //! scopes, budgets.
    use super::*;
    use crate::listing::parse_query;
    use crate::store::{AttemptEnd, AttemptStart, ClaimAsk, NewTask, Next};
    use crate::tasks::{Outcome, parse_id};

    const CONN: ConnRef = ConnRef { slot: 9, generation: 9 };

    fn store() -> MemStore {
        let cfg = MemConfig {
            task_ttl_ms: 60_000,
            failed_ttl_ms: 0,
            max_pending: 100_000,
            max_pending_bytes: 1 << 30,
            task_memory_bytes: 1 << 30,
            task_timeout_ms: 1_000,
            max_retries: 0,
        };
        let mut s = MemStore::new(cfg, None);
        s.set_clock(0, 1_000_000);
        s
    }

    fn events(s: &mut MemStore) -> Vec<Event> {
        let mut out = Vec::new();
        s.take_events(&mut out);
        out
    }

    /// A queued task of `kind`.
    fn submit(s: &mut MemStore, kind: Option<&str>) -> TaskId {
        let payload = RawValue::from_string("{}".into()).expect("raw");
        let new = Insert::from(NewTask::queued(&payload, kind));
        s.insert(&new, InsertTo::Submit { conn: CONN, wait: false });
        events(s)
            .into_iter()
            .find_map(|e| match e {
                Event::Inserted { id, .. } => Some(id),
                _ => None,
            })
            .expect("inserted")
    }

    fn cancel(s: &mut MemStore, id: TaskId) {
        s.cancel(id, None, CONN);
        events(s);
    }

    /// (ids on the page, next cursor).
    fn list(s: &mut MemStore, query: &str, scope: Option<&[String]>) -> (Vec<TaskId>, Option<String>) {
        let q = parse_query(query).expect("valid query");
        s.list(&q, scope, CONN);
        let body = events(s)
            .into_iter()
            .find_map(|e| match e {
                Event::Answer { response, .. } => Some(response.body),
                _ => None,
            })
            .expect("an answer");
        let v: serde_json::Value = serde_json::from_slice(&body).expect("JSON page");
        let ids =
            v["tasks"].as_array().expect("tasks").iter().filter_map(|t| parse_id(t["task_id"].as_str()?)).collect();
        (ids, v["next_cursor"].as_str().map(str::to_string))
    }

    /// Follows cursors from the first page to the last; `between` runs before each next page.
    fn walk(s: &mut MemStore, query: &str, mut between: impl FnMut(&mut MemStore)) -> Vec<TaskId> {
        let mut all = Vec::new();
        let mut cursor: Option<String> = None;
        for _ in 0..10_000 {
            let q = match &cursor {
                Some(c) => format!("{query}&cursor={c}"),
                None => query.to_string(),
            };
            let (ids, next) = list(s, &q, None);
            all.extend(ids);
            match next {
                Some(c) => cursor = Some(c),
                None => return all,
            }
            between(s);
        }
        panic!("the cursor never ended");
    }

    #[test]
    fn newest_first_and_stable_while_tasks_come_and_go() {
        let mut s = store();
        let ids: Vec<TaskId> = (0..7).map(|_| submit(&mut s, Some("a"))).collect();
        let newest_first: Vec<TaskId> = ids.iter().rev().copied().collect();
        assert_eq!(walk(&mut s, "limit=2", |_| {}), newest_first);
        // New tasks between pages are not listed by this walk (they are newer than its
        // position) and push nothing twice or out of it.
        assert_eq!(
            walk(&mut s, "limit=2", |s| {
                submit(s, Some("a"));
            }),
            newest_first[..]
        );
        // The default page is 50 and the first page always starts at the newest.
        let (first, next) = list(&mut s, "", None);
        assert_eq!((first.len(), next), (7 + 3, None));
    }

    #[test]
    fn forgotten_tasks_leave_the_index_and_the_cursor_still_works() {
        let mut s = store();
        let old: Vec<TaskId> = (0..4).map(|_| submit(&mut s, None)).collect();
        for id in &old {
            cancel(&mut s, *id);
        }
        s.set_clock(10_000, 1_010_000);
        let newer: Vec<TaskId> = (0..4).map(|_| submit(&mut s, None)).collect();
        let (page1, cursor) = list(&mut s, "limit=5", None);
        assert_eq!(page1, [newer[3], newer[2], newer[1], newer[0], old[3]]);
        // TASK_TTL passes for the old (canceled) tasks: they are forgotten.
        s.set_clock(60_001, 1_060_001);
        s.on_timer();
        assert!(s.task(old[0]).is_none(), "swept");
        assert_eq!(s.tasks_newest_first(u64::MAX).count(), 4, "the index forgets with the table");
        let (page2, next) = list(&mut s, &format!("limit=5&cursor={}", cursor.expect("more")), None);
        assert_eq!((page2, next), (vec![], None));
    }

    #[test]
    fn filters_and_scopes() {
        let mut s = store();
        let a1 = submit(&mut s, Some("a"));
        let b1 = submit(&mut s, Some("b"));
        let none = submit(&mut s, None);
        let a2 = submit(&mut s, Some("a"));
        cancel(&mut s, a1);
        let scoped = vec!["a".to_string()];
        type Case<'a> = (&'a str, Option<&'a [String]>, Vec<TaskId>);
        let table: &[Case] = &[
            ("", None, vec![a2, none, b1, a1]),
            ("kind=a", None, vec![a2, a1]),
            ("status=canceled", None, vec![a1]),
            ("status=pending&kind=a", None, vec![a2]),
            ("status=done", None, vec![]),
            ("kind=zzz", None, vec![]),
            ("", Some(&scoped), vec![a2, a1]),
            ("kind=b", Some(&scoped), vec![]),
            ("status=pending", Some(&scoped), vec![a2]),
        ];
        for (query, scope, expected) in table {
            assert_eq!(&list(&mut s, query, *scope).0, expected, "{query} as {scope:?}");
        }
    }

    #[test]
    fn a_page_looks_at_no_more_than_max_scan_tasks() {
        let mut s = store();
        let wanted = submit(&mut s, Some("rare"));
        for _ in 0..MAX_SCAN + 5 {
            submit(&mut s, Some("common"));
        }
        let (ids, next) = list(&mut s, "kind=rare", None);
        assert!(ids.is_empty(), "stopped before reaching the match");
        let next = next.expect("a cursor where the scan stopped");
        let (ids, last) = list(&mut s, &format!("kind=rare&cursor={next}"), None);
        assert_eq!((ids, last), (vec![wanted], None));
        // The whole walk finds it exactly once.
        assert_eq!(walk(&mut s, "kind=rare", |_| {}), [wanted]);
    }

    #[test]
    fn a_page_holds_no_more_than_max_page_bytes() {
        let mut s = store();
        let big = RawValue::from_string(format!("\"{}\"", "x".repeat(100_000))).expect("raw");
        let ids: Vec<TaskId> = (0..4).map(|_| submit(&mut s, None)).collect();
        s.claim(&ClaimAsk { group: 0, kinds: None, limit: 10, takers: &[1] });
        events(&mut s);
        for id in &ids {
            let start = AttemptStart {
                client_id: 1,
                client_ip: "127.0.0.1".parse().expect("ip"),
                started_wall_ms: 1_000_000,
                started_mono_ms: 0,
                node: None,
                session: None,
            };
            s.attempt_started(*id, 1, &start);
            let end = AttemptEnd {
                outcome: Outcome::Done,
                error: None,
                duration_ms: 1,
                ended_wall_ms: 1_000_001,
                uncounted: false,
                resumes: 0,
            };
            s.attempt_ended(*id, 1, &end, Next::Done { result: &big });
        }
        events(&mut s);
        let (page1, cursor) = list(&mut s, "limit=10", None);
        assert_eq!(page1, [ids[3], ids[2], ids[1]], "cut once over {MAX_PAGE_BYTES} bytes");
        let (page2, next) = list(&mut s, &format!("limit=10&cursor={}", cursor.expect("more")), None);
        assert_eq!((page2, next), (vec![ids[0]], None));
    }
}
