//! Every statement cluster mode runs, as constants (prepared once per connection) and small
//! builders that fill their parameters. docs/cluster.md explains when each runs; the tests in
//! `tests/it/pg_cluster.rs` run the key ones against a private PostgreSQL.
//!
//! Batches travel as arrays (`unnest($1::uuid[], ...)`): one statement per kind of record per
//! transaction, however many tasks the loop turn carried. Arrays are passed in PostgreSQL's text
//! form, built by [`array`]. Fencing: every write about an attempt names the node and the attempt
//! number in its `WHERE`; a stale node's write matches no row, and the caller counts it `late`.

use super::wire::{Param, Stmt};

/// A task was queued (or went back to pending): nodes with idle workers should claim.
pub const CHANNEL_PENDING: &str = "relay_pending";
/// Payload: a task id whose attempt the owner node must cancel at its worker.
pub const CHANNEL_CANCEL: &str = "relay_cancel";
/// The token registry changed: refresh the cache.
pub const CHANNEL_TOKENS: &str = "relay_tokens";
/// Tasks became final: wake `wait=true` waiters on other nodes.
pub const CHANNEL_FINISHED: &str = "relay_finished";

/// `pg_notify` inside a transaction: delivered at COMMIT, and PostgreSQL folds identical ones.
pub const NOTIFY: &str = "SELECT pg_notify($1::text, '')";

/// A PostgreSQL array literal in text form: `{"a","b",NULL}`.
pub fn array<'a>(items: impl IntoIterator<Item = Option<&'a str>>) -> String {
    let mut out = String::from("{");
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        match item {
            None => out.push_str("NULL"),
            Some(s) => {
                out.push('"');
                for c in s.chars() {
                    if c == '"' || c == '\\' {
                        out.push('\\');
                    }
                    out.push(c);
                }
                out.push('"');
            }
        }
    }
    out.push('}');
    out
}

fn arr<'a>(items: impl IntoIterator<Item = &'a str>) -> Param {
    Param::Text(array(items.into_iter().map(Some)))
}

fn arr_opt<'a>(items: impl IntoIterator<Item = Option<&'a str>>) -> Param {
    Param::Text(array(items))
}

// ---------------------------------------------------------------------------------------------
// Nodes.

/// Tags the session with its node, for the counters' triggers. $1 node id.
pub const SET_NODE: &str = "SELECT set_config('relay.node_id', $1::text, false)";

/// $1 node id, $2 name, $3 started_ms, $4 version. Every `heartbeat_interval` (1 s).
pub const HEARTBEAT: &str = "INSERT INTO relay_nodes (node_id, name, started_ms, heartbeat_ms, version)
     VALUES ($1::uuid, $2::text, $3::int8, relay_now_ms(), $4::text)
     ON CONFLICT (node_id) DO UPDATE SET heartbeat_ms = relay_now_ms(), name = excluded.name";

/// Live nodes: $1 lease_ms.
pub const LIVE_NODES: &str = "SELECT node_id::text, name, started_ms, heartbeat_ms FROM relay_nodes
     WHERE heartbeat_ms > relay_now_ms() - $1::int8 ORDER BY started_ms";

// ---------------------------------------------------------------------------------------------
// Submit: one transaction per loop turn carries every accepted task; 202 after its COMMIT.

/// One task to insert.
#[derive(Debug, Clone)]
pub struct NewTask {
    pub id: String,
    pub kind: Option<String>,
    pub payload: String,
    pub queue: bool,
    pub timeout_ms: Option<u64>,
    pub max_retries: Option<u32>,
    pub created_ms: u64,
    pub run_at_ms: u64,
    pub idem_owner: Option<String>,
    pub idem_key: Option<String>,
}

/// Inserts the tasks and their pending rows in one statement. A task whose (owner, key) is
/// already taken is not inserted (nor queued); it is missing from the returned `id, seq` rows,
/// and [`IDEMPOTENT_LOOKUP`] in the same transaction tells which task holds the key.
pub const INSERT_TASKS: &str = "WITH n AS (
       SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bool[], $5::int8[], $6::int4[],
                            $7::int8[], $8::int8[], $9::text[], $10::text[])
         AS n(id, kind, payload, queue, timeout_ms, max_retries, created_ms, run_at_ms, idem_owner, idem_key)
     ), ins AS (
       INSERT INTO relay_tasks (id, status, kind, payload, queue, timeout_ms, max_retries, created_ms, run_at_ms,
                                idem_owner, idem_key)
       SELECT id, 'pending', kind, payload, queue, timeout_ms, max_retries, created_ms, run_at_ms, idem_owner, idem_key
       FROM n ORDER BY created_ms
       ON CONFLICT (idem_owner, idem_key) WHERE idem_key IS NOT NULL DO NOTHING
       RETURNING id, seq, kind, queue, run_at_ms, octet_length(payload) AS bytes
     ), pend AS (
       INSERT INTO relay_pending (task_id, due_ms, seq, kind, queue, payload_bytes)
       SELECT id, run_at_ms, seq, kind, queue, bytes FROM ins
     )
     SELECT id::text, seq FROM ins";

pub fn insert_tasks(tasks: &[NewTask]) -> Stmt {
    let num = |v: Option<u64>| v.map(|n| n.to_string());
    let timeouts: Vec<Option<String>> = tasks.iter().map(|t| num(t.timeout_ms)).collect();
    let retries: Vec<Option<String>> = tasks.iter().map(|t| num(t.max_retries.map(u64::from))).collect();
    let created: Vec<String> = tasks.iter().map(|t| t.created_ms.to_string()).collect();
    let run_at: Vec<String> = tasks.iter().map(|t| t.run_at_ms.to_string()).collect();
    Stmt::new(
        INSERT_TASKS,
        vec![
            arr(tasks.iter().map(|t| t.id.as_str())),
            arr_opt(tasks.iter().map(|t| t.kind.as_deref())),
            arr(tasks.iter().map(|t| t.payload.as_str())),
            arr(tasks.iter().map(|t| if t.queue { "t" } else { "f" })),
            arr_opt(timeouts.iter().map(Option::as_deref)),
            arr_opt(retries.iter().map(Option::as_deref)),
            arr(created.iter().map(String::as_str)),
            arr(run_at.iter().map(String::as_str)),
            arr_opt(tasks.iter().map(|t| t.idem_owner.as_deref())),
            arr_opt(tasks.iter().map(|t| t.idem_key.as_deref())),
        ],
    )
}

/// $1 owners text[], $2 keys text[] → the tasks that hold those keys (repeat submits, and the
/// check made before a keyed submit's body is read).
pub const IDEMPOTENT_LOOKUP: &str = "SELECT t.idem_owner, t.idem_key, t.id::text, t.status FROM relay_tasks t
     JOIN unnest($1::text[], $2::text[]) AS k(owner, key) ON t.idem_owner = k.owner AND t.idem_key = k.key";

/// Pending count and payload bytes for MAX_PENDING / MAX_PENDING_BYTES (cached ≤ 1 s a node).
pub const PENDING_TOTALS: &str = "SELECT count(*), coalesce(sum(payload_bytes), 0) FROM relay_pending";

// ---------------------------------------------------------------------------------------------
// Claim and dispatch.

/// Claims up to $6 due tasks for one idle worker of this node and opens their attempt on it:
/// the worker ($3 client id, $4 IP) declared no kinds ($5 NULL) and takes every task, those
/// without a kind included ([`CLAIM_KINDS`] is the same for a worker with kinds), and must not
/// have tried the task. The pending row goes, the task becomes dispatched to this node ($1, shown as $2 in the attempt_log), its attempt number (the
/// fencing number) grows by one, the worker joins `tried`, and the attempt_log gains the entry
/// (started at $8). $7 now_ms (due time). Rows locked by another claim are skipped, never
/// waited for. A node sends one such statement per worker with free slots (limit = its free
/// slots, in round-robin order), all in its turn transaction; a later statement of the same
/// transaction does not see the tasks an earlier one took.
pub const CLAIM: &str = "WITH c AS (
       SELECT task_id FROM relay_pending
       WHERE $5::text[] IS NULL AND due_ms <= $7::int8 AND NOT ($3::uuid = ANY(tried))
       ORDER BY due_ms, seq
       LIMIT $6::int4
       FOR UPDATE SKIP LOCKED
     ), d AS (
       DELETE FROM relay_pending p USING c WHERE p.task_id = c.task_id RETURNING p.task_id
     )
     UPDATE relay_tasks t SET status = 'dispatched', owner_node = $1::uuid, attempt = t.attempt + 1,
       tried = t.tried || $3::uuid,
       attempt_log = t.attempt_log || jsonb_build_array(jsonb_build_object(
         'num', t.attempt + 1, 'client_id', $3::uuid, 'client_ip', $4::text, 'node', $2::text,
         'started_ms', $8::int8))
     FROM d WHERE t.id = d.task_id AND t.status = 'pending'
     RETURNING t.id::text, t.attempt, t.kind, t.payload, t.timeout_ms, t.max_retries, t.queue, t.seq, t.tried::text,
       t.created_ms";

/// [`CLAIM`] for a worker that declared kinds ($5): a statement of its own, so that its plan
/// can look the kinds up in `relay_pending_kind_due` whatever plan the other one settled on.
pub const CLAIM_KINDS: &str = "WITH c AS (
       SELECT task_id FROM relay_pending
       WHERE kind = ANY($5::text[]) AND due_ms <= $7::int8 AND NOT ($3::uuid = ANY(tried))
       ORDER BY due_ms, seq
       LIMIT $6::int4
       FOR UPDATE SKIP LOCKED
     ), d AS (
       DELETE FROM relay_pending p USING c WHERE p.task_id = c.task_id RETURNING p.task_id
     )
     UPDATE relay_tasks t SET status = 'dispatched', owner_node = $1::uuid, attempt = t.attempt + 1,
       tried = t.tried || $3::uuid,
       attempt_log = t.attempt_log || jsonb_build_array(jsonb_build_object(
         'num', t.attempt + 1, 'client_id', $3::uuid, 'client_ip', $4::text, 'node', $2::text,
         'started_ms', $8::int8))
     FROM d WHERE t.id = d.task_id AND t.status = 'pending'
     RETURNING t.id::text, t.attempt, t.kind, t.payload, t.timeout_ms, t.max_retries, t.queue, t.seq, t.tried::text,
       t.created_ms";

/// One idle worker to claim for.
#[derive(Debug, Clone)]
pub struct ClaimFor<'a> {
    pub client_id: &'a str,
    pub client_ip: &'a str,
    /// `None`: the worker declared no kinds and takes every task.
    pub kinds: Option<&'a [&'a str]>,
    pub free_slots: u32,
}

pub fn claim(node: &str, node_name: &str, w: &ClaimFor<'_>, now_ms: u64) -> Stmt {
    Stmt::new(
        if w.kinds.is_some() { CLAIM_KINDS } else { CLAIM },
        vec![
            node.into(),
            node_name.into(),
            w.client_id.into(),
            w.client_ip.into(),
            w.kinds.map_or(Param::Null, |k| arr(k.iter().copied())),
            i64::from(w.free_slots).into(),
            (now_ms as i64).into(),
            (now_ms as i64).into(),
        ],
    )
}

/// Gives back claimed tasks the node could not send after all (the worker left before the
/// claim's answer arrived): pending again, with the attempt, its log entry and the worker's
/// place in `tried` taken back. Fenced like every attempt write. $1 node, $2 ids, $3 attempts.
pub const UNCLAIM: &str = "WITH u AS (
       UPDATE relay_tasks t SET status = 'pending', owner_node = NULL, attempt = t.attempt - 1,
         attempt_log = t.attempt_log - (t.attempt - 1),
         tried = t.tried[1:cardinality(t.tried) - 1]
       FROM unnest($2::uuid[], $3::int4[]) AS a(id, attempt)
       WHERE t.id = a.id AND t.owner_node = $1::uuid AND t.attempt = a.attempt AND t.status = 'dispatched'
       RETURNING t.id, t.run_at_ms, t.seq, t.kind, t.queue, t.tried, octet_length(t.payload) AS bytes
     )
     INSERT INTO relay_pending (task_id, due_ms, seq, kind, queue, tried, payload_bytes)
     SELECT id, run_at_ms, seq, kind, queue, tried, bytes FROM u RETURNING task_id::text";

/// After a transaction that claimed was lost (the connection broke: it may have committed),
/// every task the database says this node ($1) runs but the node does not know ($2: the ids
/// it runs) goes back to pending as [`UNCLAIM`] does: the node never sent it.
pub const RELEASE_ORPHANS: &str = "WITH u AS (
       UPDATE relay_tasks t SET status = 'pending', owner_node = NULL, attempt = t.attempt - 1,
         attempt_log = t.attempt_log - (t.attempt - 1),
         tried = t.tried[1:cardinality(t.tried) - 1]
       WHERE t.owner_node = $1::uuid AND t.status = 'dispatched' AND NOT (t.id = ANY($2::uuid[]))
       RETURNING t.id, t.run_at_ms, t.seq, t.kind, t.queue, t.tried, octet_length(t.payload) AS bytes
     )
     INSERT INTO relay_pending (task_id, due_ms, seq, kind, queue, tried, payload_bytes)
     SELECT id, run_at_ms, seq, kind, queue, tried, bytes FROM u
     ON CONFLICT (task_id) DO NOTHING RETURNING task_id::text";

pub fn unclaim(node: &str, claimed: &[(&str, u32)]) -> Stmt {
    let attempts: Vec<String> = claimed.iter().map(|c| c.1.to_string()).collect();
    Stmt::new(UNCLAIM, vec![node.into(), arr(claimed.iter().map(|c| c.0)), arr(attempts.iter().map(String::as_str))])
}

// ---------------------------------------------------------------------------------------------
// Attempt outcomes.

/// How one attempt ended, as the node saw it.
#[derive(Debug, Clone)]
pub struct Ended {
    pub id: String,
    pub attempt: u32,
    /// done · failed · timeout · disconnect · send_failed
    pub outcome: &'static str,
    /// The attempt's error (absent for done).
    pub error: Option<String>,
    pub ended_ms: u64,
    pub duration_ms: u64,
    /// The task's new status: `done`/`failed` when final, `pending` for a retry.
    pub status: &'static str,
    /// For done: the worker's data (JSON text).
    pub result: Option<String>,
    /// For failed: the task's final error.
    pub final_error: Option<String>,
    pub client_id: String,
    pub client_ip: String,
}

/// Closes attempts: final ones set the status and result; retries go back to `relay_pending`
/// (keeping `tried`, so the next claim picks a worker not tried yet, on any node). Fenced by
/// node ($1), attempt and status: a stale write matches nothing and is missing from the
/// returned ids.
pub const ATTEMPT_ENDED: &str = "WITH a AS (
       SELECT * FROM unnest($2::uuid[], $3::int4[], $4::text[], $5::text[], $6::int8[], $7::int8[], $8::text[],
                            $9::text[], $10::text[], $11::uuid[], $12::text[])
         AS a(id, attempt, outcome, error, ended_ms, duration_ms, status, result, final_error, client_id, client_ip)
     ), u AS (
       UPDATE relay_tasks t SET
         status = a.status,
         owner_node = NULL,
         finished_ms = CASE WHEN a.status = 'pending' THEN NULL ELSE a.ended_ms END,
         result = a.result,
         error = a.final_error,
         client_id = a.client_id,
         client_ip = a.client_ip,
         attempt_log = jsonb_set(t.attempt_log, ARRAY[(t.attempt - 1)::text],
           coalesce(t.attempt_log -> (t.attempt - 1), jsonb_build_object('num', t.attempt))
             || jsonb_strip_nulls(jsonb_build_object('outcome', a.outcome, 'error', a.error,
                                                     'duration_ms', a.duration_ms)))
       FROM a
       WHERE t.id = a.id AND t.owner_node = $1::uuid AND t.attempt = a.attempt AND t.status = 'dispatched'
       RETURNING t.id, t.status, t.run_at_ms, t.seq, t.kind, t.queue, t.tried, octet_length(t.payload) AS bytes
     ), requeue AS (
       INSERT INTO relay_pending (task_id, due_ms, seq, kind, queue, tried, payload_bytes)
       SELECT id, run_at_ms, seq, kind, queue, tried, bytes FROM u WHERE status = 'pending'
     )
     SELECT id::text, status FROM u";

pub fn attempt_ended(node: &str, ended: &[Ended]) -> Stmt {
    let attempts: Vec<String> = ended.iter().map(|e| e.attempt.to_string()).collect();
    let ends: Vec<String> = ended.iter().map(|e| e.ended_ms.to_string()).collect();
    let durations: Vec<String> = ended.iter().map(|e| e.duration_ms.to_string()).collect();
    Stmt::new(
        ATTEMPT_ENDED,
        vec![
            node.into(),
            arr(ended.iter().map(|e| e.id.as_str())),
            arr(attempts.iter().map(String::as_str)),
            arr(ended.iter().map(|e| e.outcome)),
            arr_opt(ended.iter().map(|e| e.error.as_deref())),
            arr(ends.iter().map(String::as_str)),
            arr(durations.iter().map(String::as_str)),
            arr(ended.iter().map(|e| e.status)),
            arr_opt(ended.iter().map(|e| e.result.as_deref())),
            arr_opt(ended.iter().map(|e| e.final_error.as_deref())),
            arr(ended.iter().map(|e| e.client_id.as_str())),
            arr(ended.iter().map(|e| e.client_ip.as_str())),
        ],
    )
}

// ---------------------------------------------------------------------------------------------
// Reads.

/// $1 task id → the task. `attempt_log` is JSON text; the node renders SPEC §4's JSON from it.
pub const GET_TASK: &str = "SELECT id::text, status, kind, payload, created_ms, run_at_ms, finished_ms, result, error,
            client_id::text, client_ip, attempt, attempt_log::text, owner_node::text
     FROM relay_tasks WHERE id = $1::uuid";

/// $1 task ids → those tasks as the API shows them ([`GET_TASK`]'s columns but the payload,
/// which no answer carries): every read of a turn in one statement.
pub const GET_TASKS: &str = "SELECT id::text, status, kind, created_ms, run_at_ms, finished_ms, result, error,
            client_id::text, client_ip, attempt, attempt_log::text, owner_node::text
     FROM relay_tasks WHERE id = ANY($1::uuid[])";

/// $1 task ids → the final ones among them, with [`GET_TASKS`]'s columns (wait=true waiters
/// ask after a `relay_finished` notification, after their own node ended attempts, and every
/// second; the owner of canceled tasks asks after a `relay_cancel` notification). Written as a
/// join on the ids so that every plan looks each id up by its key: `id = ANY(..) AND status
/// IN (..)` let a generic plan intersect with the status index, which walks every finished
/// task in the table.
pub const FINISHED_AMONG: &str =
    "SELECT t.id::text, t.status, t.kind, t.created_ms, t.run_at_ms, t.finished_ms, t.result,
            t.error, t.client_id::text, t.client_ip, t.attempt, t.attempt_log::text, t.owner_node::text
     FROM unnest($1::uuid[]) AS k(id) JOIN relay_tasks t ON t.id = k.id
     WHERE t.status IN ('done', 'failed', 'canceled')";

/// Listing, newest first, one bounded walk down `relay_tasks_list` (every plan can use it: no
/// optional condition touches the walk): the $8 tasks below the cursor ($4, $5: created_ms, seq;
/// the largest int8s for the first page) are looked at, and those matching $1 status, $2 kind
/// and $3 kinds allowed (NULL: any) are listed, $6 (limit + 1) at most, stopping at the first
/// task past $7 bytes of results (results are up to MAX_MESSAGE_SIZE each). Columns: those of
/// [`GET_TASKS`], `seq`, then on every row how many tasks the walk looked at and the (created_ms,
/// seq) where it stopped (one row of NULL task columns when none matched): a page that ran out
/// of walk continues from there, as a single node's listing does.
pub const LIST_TASKS: &str = "WITH s AS MATERIALIZED (
       SELECT id, status, kind, created_ms, seq FROM relay_tasks
       WHERE (created_ms, seq) < ($4::int8, $5::int8)
       ORDER BY created_ms DESC, seq DESC LIMIT $8::int4
     ), m AS (
       SELECT id FROM s
       WHERE ($1::text IS NULL OR status = $1::text)
         AND ($2::text IS NULL OR kind = $2::text)
         AND ($3::text[] IS NULL OR kind = ANY($3::text[]))
       ORDER BY created_ms DESC, seq DESC LIMIT $6::int4
     ), page AS (
       SELECT t.*, coalesce(sum(octet_length(t.result)) OVER (ORDER BY t.created_ms DESC, t.seq DESC
                 ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before
       FROM m JOIN relay_tasks t ON t.id = m.id
     ), walked AS (
       SELECT count(*) AS n FROM s
     ), stop AS (
       SELECT created_ms, seq FROM s ORDER BY created_ms, seq LIMIT 1
     )
     SELECT p.id::text, p.status, p.kind, p.created_ms, p.run_at_ms, p.finished_ms, p.result, p.error,
            p.client_id::text, p.client_ip, p.attempt, p.attempt_log::text, p.owner_node::text, p.seq,
            walked.n, stop.created_ms, stop.seq
     FROM walked LEFT JOIN stop ON true LEFT JOIN page p ON p.before < $7::int8
     ORDER BY p.created_ms DESC, p.seq DESC";

// ---------------------------------------------------------------------------------------------
// Cancel.

/// $1 task id, $2 now_ms, $3 kinds the caller may cancel (NULL: all, the root token): cancels a
/// pending or dispatched task; returns the node that was running it (NULL if pending), so that
/// node is told through `relay_cancel` to send `cancel` to its worker. No row: unknown, already
/// final, or of a kind the caller may not touch.
pub const CANCEL: &str = "WITH old AS (
       SELECT id, status, owner_node, attempt FROM relay_tasks
       WHERE id = $1::uuid AND status IN ('pending', 'dispatched')
         AND ($3::text[] IS NULL OR kind = ANY($3::text[])) FOR UPDATE
     ), dp AS (
       DELETE FROM relay_pending p USING old WHERE p.task_id = old.id
     ), u AS (
       UPDATE relay_tasks t SET status = 'canceled', owner_node = NULL, finished_ms = $2::int8,
         attempt_log = CASE WHEN old.status = 'dispatched' THEN
             jsonb_set(t.attempt_log, ARRAY[(t.attempt - 1)::text],
               coalesce(t.attempt_log -> (t.attempt - 1), jsonb_build_object('num', t.attempt))
                 || jsonb_build_object('outcome', 'canceled'))
           ELSE t.attempt_log END
       FROM old WHERE t.id = old.id
       RETURNING t.id
     )
     SELECT old.owner_node::text, old.attempt, pg_notify('relay_cancel', old.id::text) FROM old JOIN u ON u.id = old.id";

// ---------------------------------------------------------------------------------------------
// Housekeeping (the database thread of every node; SKIP LOCKED keeps them from colliding).

/// Dead nodes' attempts: every dispatched task whose owner has no heartbeat within the lease
/// ($1) goes back to pending (or fails, retries used up: $2 default MAX_RETRIES), its attempt
/// closed `disconnect` naming the lost node. $3 now_ms. At most 1000 a run.
pub const REAP_DEAD_NODES: &str = "WITH dead AS (
       SELECT t.id, coalesce((SELECT n.name FROM relay_nodes n WHERE n.node_id = t.owner_node),
                             t.owner_node::text) AS node_name
       FROM relay_tasks t
       WHERE t.status = 'dispatched'
         AND NOT EXISTS (SELECT 1 FROM relay_nodes n
                         WHERE n.node_id = t.owner_node AND n.heartbeat_ms > relay_now_ms() - $1::int8)
       LIMIT 1000 FOR UPDATE OF t SKIP LOCKED
     ), u AS (
       UPDATE relay_tasks t SET
         status = CASE WHEN t.attempt > coalesce(t.max_retries, $2::int4) THEN 'failed' ELSE 'pending' END,
         finished_ms = CASE WHEN t.attempt > coalesce(t.max_retries, $2::int4) THEN $3::int8 END,
         error = CASE WHEN t.attempt > coalesce(t.max_retries, $2::int4)
                      THEN 'relay node ' || dead.node_name || ' was lost' END,
         owner_node = NULL,
         attempt_log = jsonb_set(t.attempt_log, ARRAY[(t.attempt - 1)::text],
           coalesce(t.attempt_log -> (t.attempt - 1), jsonb_build_object('num', t.attempt))
             || jsonb_build_object('outcome', 'disconnect',
                  'error', 'relay node ' || dead.node_name || ' was lost (no heartbeat for '
                           || $1::int8 || ' ms)'))
       FROM dead
       WHERE t.id = dead.id
       RETURNING t.id, t.status, t.run_at_ms, t.seq, t.kind, t.queue, t.tried, octet_length(t.payload) AS bytes
     ), requeue AS (
       INSERT INTO relay_pending (task_id, due_ms, seq, kind, queue, tried, payload_bytes)
       SELECT id, run_at_ms, seq, kind, queue, tried, bytes FROM u WHERE status = 'pending'
       ON CONFLICT (task_id) DO NOTHING
     ), gone AS (
       DELETE FROM relay_workers w WHERE NOT EXISTS (SELECT 1 FROM relay_nodes n
         WHERE n.node_id = w.node_id AND n.heartbeat_ms > relay_now_ms() - $1::int8)
     )
     SELECT id::text, status FROM u";

pub fn reap_dead_nodes(lease_ms: u64, max_retries: u32, now_ms: i64) -> Stmt {
    Stmt::new(REAP_DEAD_NODES, vec![(lease_ms as i64).into(), i64::from(max_retries).into(), now_ms.into()])
}

/// Waiting tasks that no live worker can take any more (SPEC §5): plain tasks (`queue` false)
/// and retries (`tried` not empty) for which no active worker of a live node ($1 lease_ms) takes
/// the kind without having tried it. They fail: a retry with its last attempt's error, a plain
/// task with `no connected worker can take this task any more`. $2 now_ms. Run after workers
/// leave (a `relay_workers` delete) and by housekeeping.
pub const FAIL_UNPLACEABLE: &str = "WITH live AS (
       SELECT w.client_id, w.kinds FROM relay_workers w JOIN relay_nodes n ON n.node_id = w.node_id
       WHERE n.heartbeat_ms > relay_now_ms() - $1::int8 AND w.active
     ), f AS (
       DELETE FROM relay_pending p WHERE p.task_id IN (
         SELECT q.task_id FROM relay_pending q
         WHERE (NOT q.queue OR cardinality(q.tried) > 0) AND q.due_ms <= $2::int8
           AND NOT EXISTS (SELECT 1 FROM live
                           WHERE (live.kinds IS NULL OR q.kind = ANY(live.kinds))
                             AND NOT (live.client_id = ANY(q.tried)))
         LIMIT 1000 FOR UPDATE SKIP LOCKED)
       RETURNING p.task_id, cardinality(p.tried) > 0 AS retried
     )
     UPDATE relay_tasks t SET status = 'failed', finished_ms = $2::int8,
       error = CASE WHEN f.retried
                    THEN coalesce(t.attempt_log -> (t.attempt - 1) ->> 'error', 'no untried worker can take this task')
                    ELSE 'no connected worker can take this task any more' END
     FROM f WHERE t.id = f.task_id AND t.status = 'pending'
     RETURNING t.id::text, t.error";

pub fn fail_unplaceable(lease_ms: u64, now_ms: i64) -> Stmt {
    Stmt::new(FAIL_UNPLACEABLE, vec![(lease_ms as i64).into(), now_ms.into()])
}

/// Nodes silent for an hour are forgotten (a restarted relay is a new node: without this their
/// rows would pile up), and the counter rows of every node not heard from for an hour are
/// folded into the zero node's (sums unchanged; a live node's next change writes a fresh row).
pub const FORGET_NODES: &str = "WITH gone AS (
       DELETE FROM relay_nodes WHERE heartbeat_ms < relay_now_ms() - 3600000
     ), folded AS (
       DELETE FROM relay_counters c
       WHERE c.node_id <> '00000000-0000-0000-0000-000000000000'::uuid
         AND NOT EXISTS (SELECT 1 FROM relay_nodes n
                         WHERE n.node_id = c.node_id AND n.heartbeat_ms > relay_now_ms() - 3600000)
       RETURNING c.status, c.n
     )
     INSERT INTO relay_counters (node_id, status, n)
     SELECT '00000000-0000-0000-0000-000000000000'::uuid, status, sum(n) FROM folded GROUP BY status
     ON CONFLICT (node_id, status) DO UPDATE SET n = relay_counters.n + excluded.n";

/// Tasks pending TASK_TTL ($2) past their due time fail `expired in queue`. $1 now_ms. A retry
/// never expires in the queue (SPEC §5): it fails when no untried worker is left
/// ([`FAIL_UNPLACEABLE`]) or runs when one frees up.
pub const EXPIRE_IN_QUEUE: &str = "WITH e AS (
       DELETE FROM relay_pending p
       WHERE p.task_id IN (SELECT task_id FROM relay_pending
                           WHERE due_ms < $1::int8 - $2::int8 AND cardinality(tried) = 0
                           ORDER BY due_ms LIMIT 5000 FOR UPDATE SKIP LOCKED)
       RETURNING p.task_id
     )
     UPDATE relay_tasks t SET status = 'failed', error = 'expired in queue', finished_ms = $1::int8
     FROM e WHERE t.id = e.task_id AND t.status = 'pending'";

pub fn expire_in_queue(now_ms: i64, task_ttl_ms: u64) -> Stmt {
    Stmt::new(EXPIRE_IN_QUEUE, vec![now_ms.into(), (task_ttl_ms as i64).into()])
}

/// Retention: finished tasks older than TASK_TTL go, in batches of 5000 (oldest first), so one
/// run is a short transaction and autovacuum reclaims the space behind it. $1 now_ms, $2 ttl.
pub const RETENTION: &str = "DELETE FROM relay_tasks WHERE id IN (
       SELECT id FROM relay_tasks WHERE finished_ms < $1::int8 - $2::int8
       ORDER BY finished_ms LIMIT 5000 FOR UPDATE SKIP LOCKED)";

pub fn retention(now_ms: i64, task_ttl_ms: u64) -> Stmt {
    Stmt::new(RETENTION, vec![now_ms.into(), (task_ttl_ms as i64).into()])
}

// ---------------------------------------------------------------------------------------------
// Workers (/clients) and counts (/healthz).

/// Upserts this node's workers' rows (arrays: client_id, ip, connected_ms, kinds as a JSON
/// array text or NULL, concurrency, in_flight, active, version). Sent with the turn's
/// transaction when a worker connected or changed.
pub const UPSERT_WORKERS: &str = "INSERT INTO relay_workers
       (client_id, node_id, ip, connected_ms, kinds, concurrency, in_flight, active, version)
     SELECT w.client_id, $1::uuid, w.ip, w.connected_ms,
            CASE WHEN w.kinds IS NULL THEN NULL
                 ELSE ARRAY(SELECT jsonb_array_elements_text(w.kinds::jsonb)) END,
            w.concurrency, w.in_flight, w.active, w.version
     FROM unnest($2::uuid[], $3::text[], $4::int8[], $5::text[], $6::int4[], $7::int4[], $8::bool[], $9::text[])
       AS w(client_id, ip, connected_ms, kinds, concurrency, in_flight, active, version)
     ON CONFLICT (client_id) DO UPDATE SET kinds = excluded.kinds, concurrency = excluded.concurrency,
       in_flight = excluded.in_flight, active = excluded.active, version = excluded.version";

/// $1 client ids that left this node.
pub const DELETE_WORKERS: &str = "DELETE FROM relay_workers WHERE client_id = ANY($1::uuid[])";

/// Every row of this node ($1) but its workers connected now ($2): after an outage, or when
/// more workers left than the node keeps track of, instead of [`DELETE_WORKERS`].
pub const RESYNC_WORKERS: &str =
    "DELETE FROM relay_workers WHERE node_id = $1::uuid AND NOT (client_id = ANY($2::uuid[]))";

/// /clients: every worker of every live node ($1 lease_ms), with its node's name.
pub const LIST_WORKERS: &str =
    "SELECT w.client_id::text, w.ip, w.connected_ms, array_to_json(w.kinds)::text, w.concurrency,
            w.in_flight, w.active, w.version, n.name, w.node_id::text
     FROM relay_workers w JOIN relay_nodes n ON n.node_id = w.node_id
     WHERE n.heartbeat_ms > relay_now_ms() - $1::int8
     ORDER BY w.connected_ms, w.client_id";

/// Cluster-wide task counts for /healthz (kept by triggers; cached ≤ 1 s on each node).
pub const COUNTS: &str = "SELECT status, sum(n)::int8 FROM relay_counters GROUP BY status";

// ---------------------------------------------------------------------------------------------
// Tokens (`relay token` with DATABASE_URL, and every node's cache).

pub const TOKEN_INSERT: &str = "INSERT INTO relay_tokens (jti, name, kinds, created_ms, expires_ms)
     VALUES ($1::text, $2::text, $3::text[], $4::int8, $5::int8)";

pub const TOKEN_LIST: &str = "SELECT jti, name, array_to_json(kinds)::text, created_ms, expires_ms, revoked_ms
     FROM relay_tokens ORDER BY created_ms, jti";

/// $1 jti, $2 now_ms → (revoked_ms, whether it was revoked just now); no row: unknown jti.
/// Notifies `relay_tokens` so every node refreshes at once.
pub const TOKEN_REVOKE: &str = "WITH old AS (SELECT jti, revoked_ms FROM relay_tokens WHERE jti = $1::text FOR UPDATE),
     u AS (UPDATE relay_tokens t SET revoked_ms = $2::int8, changed = nextval('relay_tokens_changed')
           FROM old WHERE t.jti = old.jti AND old.revoked_ms IS NULL RETURNING t.jti)
     SELECT coalesce(old.revoked_ms, $2::int8), u.jti IS NOT NULL,
            pg_notify('relay_tokens', old.jti)
     FROM old LEFT JOIN u ON u.jti = old.jti";

/// A node's token cache refresh: rows changed after $1 (the highest `changed` seen). Run on a
/// `relay_tokens` notification and every 500 ms, so a revoke is refused within 1 s everywhere.
pub const TOKEN_CHANGES: &str = "SELECT jti, revoked_ms IS NOT NULL, changed FROM relay_tokens
     WHERE changed > $1::int8 ORDER BY changed LIMIT 10000";

// ---------------------------------------------------------------------------------------------
// Files (bytes in chunks in the database, readable through every node).

/// $1 file id, $2 filename, $3 content type, $4 chunk bytes, $5 created_ms, $6 expires_ms.
pub const FILE_BEGIN: &str =
    "INSERT INTO relay_files (file_id, filename, content_type, chunk_bytes, created_ms, expires_ms)
     VALUES ($1::uuid, $2::text, $3::text, $4::int4, $5::int8, $6::int8)";

/// $1 file id, $2 chunk number, $3 the bytes (binary parameter).
pub const FILE_CHUNK: &str = "INSERT INTO relay_file_chunks (file_id, n, data) VALUES ($1::uuid, $2::int4, $3::bytea)";

/// $1 file id, $2 size, $3 sha256 hex, $4 filename, $5 content type, $6 expires_ms (the name
/// and type are known once the part's headers were parsed; the upload began before).
pub const FILE_COMPLETE: &str = "UPDATE relay_files SET size = $2::int8, sha256 = $3::text, filename = $4::text,
       content_type = $5::text, expires_ms = $6::int8, complete = true
     WHERE file_id = $1::uuid AND NOT complete";

/// $1 file id, $2 now_ms → its metadata if complete and not expired.
pub const FILE_META: &str = "SELECT filename, content_type, size, sha256, chunk_bytes, created_ms, expires_ms
     FROM relay_files WHERE file_id = $1::uuid AND complete AND expires_ms > $2::int8";

/// $1 file id, $2 chunk number → the bytes (read with binary results, one chunk a time as the
/// client drains the previous one).
pub const FILE_READ_CHUNK: &str = "SELECT data FROM relay_file_chunks WHERE file_id = $1::uuid AND n = $2::int4";

/// Expired files, and uploads abandoned for an hour: chunks and metadata, 100 files a run.
/// $1 now_ms.
pub const FILE_EXPIRE: &str = "WITH f AS (
       DELETE FROM relay_files WHERE file_id IN (
         SELECT file_id FROM relay_files
         WHERE expires_ms <= $1::int8 OR (NOT complete AND created_ms < $1::int8 - 3600000)
         LIMIT 100 FOR UPDATE SKIP LOCKED)
       RETURNING file_id
     )
     DELETE FROM relay_file_chunks c USING f WHERE c.file_id = f.file_id";

/// Every statement, by name: docs/cluster.md shows each (a test checks it does).
pub const ALL: &[(&str, &str)] = &[
    ("NOTIFY", NOTIFY),
    ("SET_NODE", SET_NODE),
    ("HEARTBEAT", HEARTBEAT),
    ("LIVE_NODES", LIVE_NODES),
    ("INSERT_TASKS", INSERT_TASKS),
    ("IDEMPOTENT_LOOKUP", IDEMPOTENT_LOOKUP),
    ("PENDING_TOTALS", PENDING_TOTALS),
    ("CLAIM", CLAIM),
    ("CLAIM_KINDS", CLAIM_KINDS),
    ("UNCLAIM", UNCLAIM),
    ("RELEASE_ORPHANS", RELEASE_ORPHANS),
    ("ATTEMPT_ENDED", ATTEMPT_ENDED),
    ("GET_TASK", GET_TASK),
    ("GET_TASKS", GET_TASKS),
    ("FINISHED_AMONG", FINISHED_AMONG),
    ("LIST_TASKS", LIST_TASKS),
    ("CANCEL", CANCEL),
    ("REAP_DEAD_NODES", REAP_DEAD_NODES),
    ("FAIL_UNPLACEABLE", FAIL_UNPLACEABLE),
    ("FORGET_NODES", FORGET_NODES),
    ("EXPIRE_IN_QUEUE", EXPIRE_IN_QUEUE),
    ("RETENTION", RETENTION),
    ("UPSERT_WORKERS", UPSERT_WORKERS),
    ("DELETE_WORKERS", DELETE_WORKERS),
    ("RESYNC_WORKERS", RESYNC_WORKERS),
    ("LIST_WORKERS", LIST_WORKERS),
    ("COUNTS", COUNTS),
    ("TOKEN_INSERT", TOKEN_INSERT),
    ("TOKEN_LIST", TOKEN_LIST),
    ("TOKEN_REVOKE", TOKEN_REVOKE),
    ("TOKEN_CHANGES", TOKEN_CHANGES),
    ("FILE_BEGIN", FILE_BEGIN),
    ("FILE_CHUNK", FILE_CHUNK),
    ("FILE_COMPLETE", FILE_COMPLETE),
    ("FILE_META", FILE_META),
    ("FILE_READ_CHUNK", FILE_READ_CHUNK),
    ("FILE_EXPIRE", FILE_EXPIRE),
];

#[cfg(test)]
mod tests {
    use super::*;

    fn squash(text: &str) -> String {
        text.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn docs_show_every_statement_as_it_is() {
        let doc = squash(include_str!("../../docs/cluster.md"));
        for (name, sql) in ALL {
            assert!(doc.contains(&squash(sql)), "docs/cluster.md lacks the current text of {name}");
        }
    }

    #[test]
    fn array_literals() {
        let table: &[(&[Option<&str>], &str)] = &[
            (&[], "{}"),
            (&[Some("a")], r#"{"a"}"#),
            (&[Some("a"), None, Some("")], r#"{"a",NULL,""}"#),
            (&[Some(r#"q"uote\back"#)], r#"{"q\"uote\\back"}"#),
            (&[Some("NULL"), Some("{,}")], r#"{"NULL","{,}"}"#),
        ];
        for (items, expected) in table {
            assert_eq!(array(items.iter().copied()), *expected);
        }
    }
}
