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

/// A `text[]` parameter in binary form, for texts that may be large (payloads, results, error
/// texts): each element is copied as it is, where the text form escapes it character by
/// character on the loop (a 48 MiB result took ~150 ms that way).
fn big_texts<'a>(items: impl IntoIterator<Item = Option<&'a str>> + Clone) -> Param {
    const TEXT_OID: u32 = 25;
    let (mut count, mut bytes, mut nulls, mut longest) = (0usize, 0usize, false, 0usize);
    for item in items.clone() {
        count += 1;
        bytes += item.map_or(0, str::len);
        nulls |= item.is_none();
        longest = longest.max(item.map_or(0, str::len));
    }
    let fits = |n: usize| i32::try_from(n).is_ok();
    if !fits(count) || !fits(longest) {
        return Param::Text(array(items));
    }
    let mut out = Vec::with_capacity(20 + count * 4 + bytes);
    out.extend_from_slice(&i32::from(count > 0).to_be_bytes()); // dimensions
    out.extend_from_slice(&i32::from(nulls).to_be_bytes());
    out.extend_from_slice(&TEXT_OID.to_be_bytes());
    if count > 0 {
        out.extend_from_slice(&(count as i32).to_be_bytes());
        out.extend_from_slice(&1i32.to_be_bytes()); // lower bound
    }
    for item in items {
        match item {
            None => out.extend_from_slice(&(-1i32).to_be_bytes()),
            Some(t) => {
                out.extend_from_slice(&(t.len() as i32).to_be_bytes());
                out.extend_from_slice(t.as_bytes());
            }
        }
    }
    Param::Bytes(out)
}

// ---------------------------------------------------------------------------------------------
// Nodes.

/// Tags the session with its node, for the counters' triggers. $1 node id.
pub const SET_NODE: &str = "SELECT set_config('relay.node_id', $1::text, false)";

/// $1 node id, $2 name, $3 started_ms, $4 version. Every `heartbeat_interval` (1 s).
pub const HEARTBEAT: &str = "INSERT INTO relay_nodes (node_id, name, started_ms, heartbeat_ms, version)
     VALUES ($1::uuid, $2::text, $3::int8, relay_now_ms(), $4::text)
     ON CONFLICT (node_id) DO UPDATE SET heartbeat_ms = relay_now_ms(), name = excluded.name";

/// A lost connection's server process $1, if it is still there and older than this session (a
/// process that took its number since is left alone): terminated (its open transaction rolls
/// back). Returns how many such processes are still there (0: gone).
pub const END_LOST_BACKEND: &str = "SELECT count(*) FROM (
       SELECT pg_terminate_backend(a.pid) FROM pg_stat_activity a, pg_stat_activity me
       WHERE a.pid = $1::int4 AND me.pid = pg_backend_pid() AND a.backend_start < me.backend_start
     ) t";

/// Whether the server process $1 (this node's `relay-db` session) is at work on a statement
/// (`active`, and waiting neither for a lock nor for this client), asked on another connection
/// while a request runs long: a long transaction is given time; a connection gone quiet (its
/// server process waiting to read the rest of a pipeline or to write its answer: `Client`), or
/// one blocked on a lock that some other session may hold for ever, is not.
pub const BACKEND_BUSY: &str = "SELECT coalesce((SELECT state = 'active' AND wait_event_type IS DISTINCT FROM 'Lock'
         AND wait_event_type IS DISTINCT FROM 'Client'
       FROM pg_stat_activity WHERE pid = $1::int4), false)";

/// Live nodes: $1 lease_ms.
pub const LIVE_NODES: &str = "SELECT node_id::text, name, started_ms, heartbeat_ms FROM relay_nodes
     WHERE heartbeat_ms > relay_now_ms() - $1::int8 ORDER BY started_ms";

// ---------------------------------------------------------------------------------------------
// Submit: one transaction per loop turn carries every accepted task; 202 after its COMMIT.

/// The lock every transaction that inserts tasks takes first (a statement of its own, so the
/// insert's snapshot is taken after it): inserts of all nodes are serialized, so MAX_PENDING
/// holds cluster-wide (SPEC §7). Claims and attempt ends do not take it.
pub const INSERT_LOCK: &str = "SELECT pg_advisory_xact_lock(8245972963651339265)";

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
    /// A worker of the inserting node can take it now: MAX_PENDING does not refuse it.
    pub runs_now: bool,
    /// Seconds of head start (SPEC §14).
    pub priority: i32,
    /// Its own retry policy (SPEC §13): backoff, backoff_max (ms), any_worker.
    pub retry_backoff_ms: Option<u64>,
    pub retry_backoff_max_ms: Option<u64>,
    pub retry_any_worker: Option<bool>,
    /// Its submitter and fairness key (SPEC §14; `""`: the root token, no key).
    pub submitter: String,
    pub fair_key: String,
}

/// The fair-shares bookkeeping of the tasks that just entered the queue (`entered`: inserted by
/// [`INSERT_TASKS`], re-run by [`RERUN`] and [`RERUN_MANY`]): a lane for each new (kind,
/// submitter, key) and a row for each new (kind, submitter), stamped with the stamp last given,
/// and a kind that now has more than one lane entered in `relay_fair_kinds` (the kinds
/// [`CLAIM`] picks fairly among lanes).
macro_rules! fair_lanes {
    () => {
        "), lanes AS (
       INSERT INTO relay_fair_lanes (kind, submitter, fair_key, stamp)
       SELECT DISTINCT coalesce('k' || kind, 'n'), submitter, fair_key, (SELECT last_value FROM relay_fair_stamp)
       FROM entered ORDER BY 1, 2, 3
       ON CONFLICT DO NOTHING RETURNING kind
     ), subs AS (
       INSERT INTO relay_fair_submitters (kind, submitter, stamp)
       SELECT DISTINCT coalesce('k' || kind, 'n'), submitter, (SELECT last_value FROM relay_fair_stamp)
       FROM entered ORDER BY 1, 2
       ON CONFLICT DO NOTHING
     ), multi AS (
       INSERT INTO relay_fair_kinds (kind)
       SELECT n.kind FROM lanes n GROUP BY n.kind
       HAVING count(*) > 1 OR EXISTS (SELECT 1 FROM relay_fair_lanes l WHERE l.kind = n.kind)
       ON CONFLICT DO NOTHING
     )"
    };
}

/// Inserts the tasks and their pending rows in one statement, in order (each `held` as its kind's
/// policy `holds`, read under a share lock of the policy row — once a statement, not by the
/// trigger once a row), as long as room is
/// left under $12 tasks and $13 payload bytes waiting (the retry policy: $15–$17) (counted by `relay_pending_counts`, read
/// under [`INSERT_LOCK`]; a task marked `runs_now` needs no room). A task whose (owner, key) is
/// already taken is not inserted. Returns one row per task given: id, seq (NULL: not inserted),
/// and whether there was room (not inserted but room: its key is taken — [`IDEMPOTENT_LOOKUP`]
/// in the same transaction tells by which task).
pub const INSERT_TASKS: &str = concat!(
    "WITH lim AS (
       SELECT coalesce(sum(n), 0) AS n, coalesce(sum(bytes), 0) AS b FROM relay_pending_counts
     ), n AS (
       SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bool[], $5::int8[], $6::int4[],
                            $7::int8[], $8::int8[], $9::text[], $10::text[], $11::bool[], $14::int4[],
                            $15::int8[], $16::int8[], $17::bool[], $18::text[], $19::text[]) WITH ORDINALITY
         AS n(id, kind, payload, queue, timeout_ms, max_retries, created_ms, run_at_ms, idem_owner, idem_key,
              runs_now, priority, retry_backoff_ms, retry_backoff_max_ms, retry_any_worker, submitter, fair_key, ord)
     ), room AS (
       SELECT n.*, count(*) FILTER (WHERE NOT n.runs_now) OVER (ORDER BY n.ord) AS cum_n,
              coalesce(sum(octet_length(n.payload)) FILTER (WHERE NOT n.runs_now) OVER (ORDER BY n.ord), 0) AS cum_b
       FROM n
     ), ok AS (
       SELECT room.* FROM room, lim
       WHERE room.runs_now OR (lim.n + room.cum_n <= $12::int8 AND lim.b + room.cum_b <= $13::int8)
     ), entered AS (
       INSERT INTO relay_tasks (id, status, kind, payload, queue, timeout_ms, max_retries, created_ms, run_at_ms,
                                idem_owner, idem_key, priority, retry_backoff_ms, retry_backoff_max_ms,
                                retry_any_worker, submitter, fair_key)
       SELECT id, 'pending', kind, payload, queue, timeout_ms, max_retries, created_ms, run_at_ms, idem_owner, idem_key,
              priority, retry_backoff_ms, retry_backoff_max_ms, retry_any_worker, submitter, fair_key
       FROM ok ORDER BY ord
       ON CONFLICT (idem_owner, idem_key) WHERE idem_key IS NOT NULL DO NOTHING
       RETURNING id, seq, kind, queue, greatest(run_at_ms, created_ms) AS due_ms,
                 greatest(run_at_ms, created_ms) - priority::int8 * 1000 AS ord_ms, octet_length(payload) AS bytes,
                 submitter, fair_key
     ), pol AS (
       SELECT k.kind, k.holds FROM relay_kind_policies k WHERE k.kind IN (SELECT kind FROM entered) FOR SHARE
     ), pend AS (
       INSERT INTO relay_pending (task_id, due_ms, ord_ms, seq, kind, queue, payload_bytes, submitter, fair_key, held)
       SELECT e.id, e.due_ms, e.ord_ms, e.seq, e.kind, e.queue, e.bytes, e.submitter, e.fair_key, coalesce(pol.holds, false)
       FROM entered e LEFT JOIN pol ON pol.kind = e.kind
     ",
    fair_lanes!(),
    "
     SELECT n.id::text, entered.seq, ok.id IS NOT NULL FROM n LEFT JOIN ok ON ok.id = n.id LEFT JOIN entered ON entered.id = n.id
     ORDER BY n.ord"
);

// ---------------------------------------------------------------------------------------------
// Kind policies (SPEC §14).

/// Taken before [`SET_POLICY`]: policy changes commit in the order of their `changed` numbers,
/// so a node that read up to one number never misses a smaller one committed later.
pub const POLICY_LOCK: &str = "SELECT pg_advisory_xact_lock(8245972963651339266)";

/// Sets ($2: the policy's JSON; $3: whether it holds the kind back — paused or limited) or
/// removes ($2 NULL, $3 false) the policy of kind $1; every node reads the change within a
/// second ([`POLICY_CHANGES`]) and brings the kind's pending rows in line ([`REHOLD`]). A
/// removed policy stays as a row without one, so the other nodes see it go (and an insert of
/// the kind has a row to wait on); removing a policy that is not there writes nothing (a
/// `DELETE` of any name left a row behind, and every node reads every row when it starts).
pub const SET_POLICY: &str = "INSERT INTO relay_kind_policies (kind, policy, holds) SELECT $1::text, $2::text, $3::bool
     WHERE $2::text IS NOT NULL
        OR EXISTS (SELECT 1 FROM relay_kind_policies WHERE kind = $1::text AND policy IS NOT NULL)
     ON CONFLICT (kind) DO UPDATE
       SET policy = excluded.policy, holds = excluded.holds, changed = nextval('relay_kind_policies_changed')
     RETURNING changed";

/// The most pending rows one [`REHOLD`] looks at.
pub const REHOLD_ROWS: i64 = 1000;

/// Brings up to [`REHOLD_ROWS`] pending rows of kind $1 in line with its policy's `holds`, under
/// a share lock of the policy row (a change waits for it): a kind held no more has its `held`
/// rows freed in queue order (`relay_pending_held`; waiting for rows a claim holds, so none is
/// left held by a claim that rolls back); a kind held now has the next rows after ($2, $3) in
/// queue order walked and those not held yet marked (skipping rows a claim holds: claims
/// still leave the kind out by the node's view of the policies). Returns the kind's `holds`
/// (NULL: no policy row — nothing to do), how many rows it found, and the last row walked.
/// A node repeats it for a kind whose policy changed until it finds fewer than it may look at:
/// a claim of every kind then walks none of a held kind's backlog (`relay_pending_open`), and
/// a resumed kind's tasks come back in order, a bounded step each turn.
pub const REHOLD: &str = "WITH k AS MATERIALIZED (
       SELECT holds FROM relay_kind_policies WHERE kind = $1::text FOR SHARE
     ), freed AS MATERIALIZED (
       SELECT p.task_id FROM relay_pending p
       WHERE p.kind = $1::text AND p.held AND (SELECT NOT holds FROM k)
       ORDER BY p.ord_ms, p.seq LIMIT $4::int8
       FOR UPDATE
     ), walked AS MATERIALIZED (
       SELECT p.task_id, p.held, p.ord_ms, p.seq FROM relay_pending p
       WHERE p.kind = $1::text AND (p.ord_ms, p.seq) > ($2::int8, $3::int8) AND (SELECT holds FROM k)
       ORDER BY p.ord_ms, p.seq LIMIT $4::int8
     ), caught AS MATERIALIZED (
       SELECT p.task_id FROM relay_pending p
       WHERE p.task_id = ANY(ARRAY(SELECT task_id FROM walked WHERE NOT held)) AND NOT p.held
       FOR UPDATE SKIP LOCKED
     ), u AS (
       UPDATE relay_pending p SET held = (SELECT holds FROM k)
       WHERE p.task_id IN (SELECT task_id FROM freed UNION ALL SELECT task_id FROM caught)
     ), last AS (
       SELECT ord_ms, seq FROM walked ORDER BY ord_ms DESC, seq DESC LIMIT 1
     )
     SELECT (SELECT holds FROM k), (SELECT count(*) FROM freed) + (SELECT count(*) FROM walked),
            (SELECT ord_ms FROM last), (SELECT seq FROM last)";

/// Policies changed since $1 (a `changed` number): kind, policy JSON (NULL: removed), changed.
pub const POLICY_CHANGES: &str = "SELECT kind, policy, changed FROM relay_kind_policies
     WHERE changed > $1::int8 ORDER BY changed";

/// The kinds `GET /kinds` shows ($1 NULL), or kind $1 alone: those with a policy or with pending
/// or running tasks — kind, policy JSON (NULL: none), running attempts, pending tasks (the sum of
/// the kind's per-node counts in `relay_kind_pending`, kept by triggers: kinds × nodes rows, not
/// the kind's pending rows); in byte order (`COLLATE "C"`, as one node orders them, whatever
/// the database's collation).
pub const KINDS: &str = "WITH p AS (
       SELECT kind, sum(n)::int8 AS n FROM relay_kind_pending
       WHERE $1::text IS NULL OR kind = $1::text GROUP BY kind HAVING sum(n) <> 0
     ), r AS (
       SELECT kind, count(*) AS n FROM relay_running
       WHERE kind IS NOT NULL AND ($1::text IS NULL OR kind = $1::text) GROUP BY kind
     ), pol AS (
       SELECT kind, policy FROM relay_kind_policies
       WHERE policy IS NOT NULL AND ($1::text IS NULL OR kind = $1::text)
     ), k AS (
       SELECT kind FROM pol UNION SELECT kind FROM p UNION SELECT kind FROM r
     )
     SELECT k.kind, pol.policy, coalesce(r.n, 0), coalesce(p.n, 0)
     FROM k LEFT JOIN pol ON pol.kind = k.kind LEFT JOIN p ON p.kind = k.kind LEFT JOIN r ON r.kind = k.kind
     ORDER BY k.kind COLLATE \"C\"";

pub fn insert_tasks(tasks: &[NewTask], max_pending: u64, max_pending_bytes: u64) -> Stmt {
    let num = |v: Option<u64>| v.map(|n| n.to_string());
    let timeouts: Vec<Option<String>> = tasks.iter().map(|t| num(t.timeout_ms)).collect();
    let retries: Vec<Option<String>> = tasks.iter().map(|t| num(t.max_retries.map(u64::from))).collect();
    let created: Vec<String> = tasks.iter().map(|t| t.created_ms.to_string()).collect();
    let run_at: Vec<String> = tasks.iter().map(|t| t.run_at_ms.to_string()).collect();
    let priorities: Vec<String> = tasks.iter().map(|t| t.priority.to_string()).collect();
    let flag = |b: bool| if b { "t" } else { "f" };
    let backoffs: Vec<Option<String>> = tasks.iter().map(|t| num(t.retry_backoff_ms)).collect();
    let maxes: Vec<Option<String>> = tasks.iter().map(|t| num(t.retry_backoff_max_ms)).collect();
    Stmt::new(
        INSERT_TASKS,
        vec![
            arr(tasks.iter().map(|t| t.id.as_str())),
            arr_opt(tasks.iter().map(|t| t.kind.as_deref())),
            big_texts(tasks.iter().map(|t| Some(t.payload.as_str()))),
            arr(tasks.iter().map(|t| flag(t.queue))),
            arr_opt(timeouts.iter().map(Option::as_deref)),
            arr_opt(retries.iter().map(Option::as_deref)),
            arr(created.iter().map(String::as_str)),
            arr(run_at.iter().map(String::as_str)),
            arr_opt(tasks.iter().map(|t| t.idem_owner.as_deref())),
            arr_opt(tasks.iter().map(|t| t.idem_key.as_deref())),
            arr(tasks.iter().map(|t| flag(t.runs_now))),
            (max_pending.min(i64::MAX as u64) as i64).into(),
            (max_pending_bytes.min(i64::MAX as u64) as i64).into(),
            arr(priorities.iter().map(String::as_str)),
            arr_opt(backoffs.iter().map(Option::as_deref)),
            arr_opt(maxes.iter().map(Option::as_deref)),
            arr_opt(tasks.iter().map(|t| t.retry_any_worker.map(flag))),
            arr(tasks.iter().map(|t| t.submitter.as_str())),
            arr(tasks.iter().map(|t| t.fair_key.as_str())),
        ],
    )
}

/// $1 owners text[], $2 keys text[] → the tasks that hold those keys (repeat submits, and the
/// check made for a keyed submit that will not be stored).
pub const IDEMPOTENT_LOOKUP: &str = "SELECT t.idem_owner, t.idem_key, t.id::text, t.status FROM relay_tasks t
     JOIN unnest($1::text[], $2::text[]) AS k(owner, key) ON t.idem_owner = k.owner AND t.idem_key = k.key";

// ---------------------------------------------------------------------------------------------
// Claim and dispatch.

/// The part [`CLAIM`] and [`CLAIM_KINDS`] share, after each found its due tasks (`plain`): the
/// fair-shares pick among them when a kind has several lanes, the pending rows deleted, the
/// tasks made dispatched to this node, and its running rows written.
macro_rules! claim_tail {
    () => {
        " mk AS MATERIALIZED (
       SELECT f.kind AS fk FROM relay_fair_kinds f
       WHERE EXISTS (SELECT 1 FROM relay_fair_kinds) AND f.kind IN (SELECT coalesce('k' || kind, 'n') FROM plain)
     ), c AS (
       SELECT task_id, ARRAY[ord_ms, seq] AS eff, NULL::text AS fk, 0::int8 AS pos FROM plain
       WHERE NOT EXISTS (SELECT 1 FROM mk)
       UNION ALL
       SELECT * FROM relay_fair_pick(ARRAY(SELECT fk FROM mk), $4::int8, $6::uuid[], $5::int4,
                                     ARRAY(SELECT task_id FROM plain), ARRAY(SELECT kind FROM plain),
                                     ARRAY(SELECT ord_ms FROM plain), ARRAY(SELECT seq FROM plain))
       WHERE EXISTS (SELECT 1 FROM mk)
     ), d AS (
       DELETE FROM relay_pending p USING c WHERE p.task_id = c.task_id RETURNING p.task_id, c.eff, c.fk, c.pos
     ), u AS (
       UPDATE relay_tasks t SET status = 'dispatched', owner_node = $1::uuid, attempt = t.attempt + 1
       FROM d WHERE t.id = d.task_id AND t.status = 'pending'
       RETURNING t.id, t.attempt, t.kind, t.payload, t.timeout_ms, t.max_retries, t.tried, t.created_ms, d.eff,
                 d.fk, d.pos, CASE WHEN t.attempt = 1 THEN 0 ELSE (SELECT count(*)
                   FROM jsonb_array_elements(t.attempt_log) WITH ORDINALITY e(v, i)
                   WHERE i > t.rerun_base AND v ? 'uncounted') END AS uncounted,
                 t.retry_backoff_ms, t.retry_backoff_max_ms, t.retry_any_worker, t.rerun_base, t.submitter, t.fair_key
     ), r AS (
       INSERT INTO relay_running (task_id, owner_node, attempt, kind, submitter, fair_key)
       SELECT id, $1::uuid, attempt, kind, submitter, fair_key FROM u
     )
     SELECT id::text, attempt, kind, payload, timeout_ms, max_retries, tried::text, created_ms, $2::int4, uncounted,
            retry_backoff_ms, retry_backoff_max_ms, retry_any_worker, rerun_base
     FROM u ORDER BY eff, fk, pos"
    };
}

/// Claims up to $5 due tasks (due at $4) for one group of this node's workers, in order of due
/// time less their priority's head start (`ord_ms`; a head start is at most a day, which bounds
/// the walk over tasks not due yet): those that
/// declared no kinds ($3 NULL: [`CLAIM`] takes every task, those without a kind included) or the
/// kinds $3 ([`CLAIM_KINDS`], a statement of its own so its plan walks `relay_pending_kind_ord`),
/// and not tried by every one of the group's workers $6 (client ids), of no kind a policy holds
/// back (its rows `held`, and — for rows not in line yet, [`REHOLD`] — its policy row's `holds`,
/// probed per row walked: what the node knows of the policies is not sent, a list of up to
/// 10,000 kinds compared with every row), and not behind a row of its kind still held (a
/// resumed kind's rows are freed in queue order, a step at a time: a task queued after the
/// resume waits for those before it; a probe of `relay_pending_held` per row walked, a subquery
/// rather than an `EXISTS` the planner may make an anti join over the queue). The pending row goes, the
/// task becomes dispatched to this node ($1), its attempt number (the fencing number) grows by
/// one, and the node's running row is written. Which worker runs it is the node's choice: the
/// attempt_log entry is written by [`ATTEMPT_STARTED`] or [`ATTEMPT_ENDED`] afterwards. Rows
/// locked by another claim are skipped, never waited for; the rows come back in that order.
pub const CLAIM: &str = concat!(
    "WITH plain AS (
       SELECT task_id, kind, ord_ms, seq FROM relay_pending
       WHERE $3::text[] IS NULL AND NOT held AND ord_ms <= $4::int8 + 86400000 AND due_ms <= $4::int8
         AND NOT (tried @> $6::uuid[])
         AND (kind IS NULL OR NOT EXISTS (SELECT 1 FROM relay_kind_policies k WHERE k.kind = relay_pending.kind AND k.holds))
         AND (kind IS NULL OR (SELECT true FROM relay_pending h
                               WHERE h.held AND h.kind = relay_pending.kind
                                 AND (h.ord_ms, h.seq) < (relay_pending.ord_ms, relay_pending.seq)
                               ORDER BY h.kind, h.ord_ms, h.seq LIMIT 1) IS NULL)
       ORDER BY ord_ms, seq
       LIMIT $5::int4
       FOR UPDATE SKIP LOCKED
     ),",
    claim_tail!()
);

/// [`CLAIM`] for a group that declared kinds ($3: the node leaves out the kinds its policies
/// hold back; so does the statement, by the kinds' `holds`), read per kind on
/// `relay_pending_kind_ord` — an index range per kind, `kind = k`, since `kind = ANY($3)` cannot
/// be read in order (measured: two kinds of 100,000 due tasks each, every one read and sorted,
/// 80–165 ms a claim). First, without locks, each kind's first $5 merged in queue order say how
/// many of the first $5 each kind has; then each kind's first that many are locked (skipping
/// rows another claim holds, and taking the next of the kind instead). Locking each kind's
/// first $5 locked up to kinds × $5 rows a claim (measured: 200 declared kinds, a claim of 64:
/// 12,800 rows locked, 25 ms and 780 KB of WAL).
pub const CLAIM_KINDS: &str = concat!(
    "WITH ks AS MATERIALIZED (
       SELECT DISTINCT k AS kind FROM unnest($3::text[]) AS u(k)
       WHERE NOT EXISTS (SELECT 1 FROM relay_kind_policies kp WHERE kp.kind = u.k AND kp.holds)
     ), share AS MATERIALIZED (
       SELECT x.kind, count(*) AS n FROM (
         SELECT c.kind FROM ks CROSS JOIN LATERAL (
           SELECT p.kind, p.ord_ms, p.seq FROM relay_pending p
           WHERE p.kind = ks.kind AND p.ord_ms <= $4::int8 + 86400000 AND p.due_ms <= $4::int8
             AND NOT (p.tried @> $6::uuid[])
           ORDER BY p.ord_ms, p.seq
           LIMIT $5::int4
         ) c
         ORDER BY c.ord_ms, c.seq
         LIMIT $5::int4
       ) x GROUP BY x.kind
     ), plain AS (
       SELECT y.task_id, y.kind, y.ord_ms, y.seq
       FROM share CROSS JOIN LATERAL (
         SELECT p.task_id, p.kind, p.ord_ms, p.seq FROM relay_pending p
         WHERE p.kind = share.kind AND p.ord_ms <= $4::int8 + 86400000 AND p.due_ms <= $4::int8
           AND NOT (p.tried @> $6::uuid[])
         ORDER BY p.ord_ms, p.seq
         LIMIT share.n
         FOR UPDATE SKIP LOCKED
       ) y
       LIMIT $5::int4
     ),",
    claim_tail!()
);

/// Tried before [`CLAIM_LIMITED`], one lock per limited kind ($1) that has a task due ($2 now;
/// a kind with none has nothing to claim, and is neither locked nor counted — a node with
/// thousands of idle limited kinds pays an index probe for each, not a claim): claims of one kind on all
/// nodes take turns, so what they count — the kind's running attempts, its token bucket — is
/// exact cluster-wide (SPEC §14). Never waited for: a kind whose lock another transaction holds
/// is left out of this claim (the node looks again shortly, as for a kind out of room), so a
/// kind another node is claiming delays no other kind, and no node's connection waits on it.
/// The kinds it got, a JSON array, are the transaction's `relay.kinds_locked` (also its one
/// row): [`CLAIM_LIMITED`] claims only those, in a statement of its own that starts after the
/// locks are held (its snapshot sees every claim of those kinds committed before).
pub const KIND_LOCKS: &str =
    "SELECT set_config('relay.kinds_locked', coalesce(json_agg(k ORDER BY i)::text, '[]'), true)
     FROM unnest($1::text[]) WITH ORDINALITY AS x(k, i)
     WHERE CASE WHEN EXISTS (SELECT 1 FROM relay_pending p WHERE p.kind = x.k AND p.due_ms <= $2::int8)
                THEN pg_try_advisory_xact_lock(hashtextextended('relay kind ' || k, 0)) ELSE false END";

/// [`CLAIM_KINDS`] for the kinds $3 that a `max_running` ($7, NULL: none) or a rate ($8 tokens
/// per ms, $9 burst; NULL: none) limits, or a per-key limit (`max_running_per_key` $10,
/// `rate_per_key` $11 tokens per ms and $12 burst) whose locks [`KIND_LOCKS`] got: each kind takes at
/// most what it has room for — its cap less its attempts running on every node
/// (`relay_running`), and the whole tokens of its bucket (`relay_kind_buckets`, refilled on the
/// database's clock, full when new) — in the order of its rotation over the lanes that have
/// room themselves (`relay_fair_rotation`: a lane at its per-key cap or out of per-key tokens is
/// left out, the others go on), and its bucket and those of the lanes served keep what is left.
pub const CLAIM_LIMITED: &str = "WITH k AS (
       SELECT k.kind, k.cap, k.per_ms, k.burst, k.key_cap, k.key_per_ms, k.key_burst, b.tokens AS b_tokens,
              b.at_ms AS b_at, relay_now_ms() AS now_db
       FROM unnest($3::text[], $7::int8[], $8::float8[], $9::float8[], $10::int8[], $11::float8[], $12::float8[])
         AS k(kind, cap, per_ms, burst, key_cap, key_per_ms, key_burst)
       LEFT JOIN relay_kind_buckets b ON b.kind = k.kind
       WHERE k.kind IN (SELECT jsonb_array_elements_text(
                          coalesce(nullif(current_setting('relay.kinds_locked', true), ''), '[]')::jsonb))
     ), k2 AS (
       SELECT k.*, CASE WHEN per_ms IS NULL THEN NULL
                        ELSE least(burst, coalesce(b_tokens + greatest(0, now_db - b_at) * per_ms, burst)) END AS tokens
       FROM k
     ), room AS (
       SELECT kind, per_ms, now_db, tokens, key_cap, key_per_ms, key_burst,
              greatest(0, least($5::int8,
                coalesce(cap - (SELECT count(*) FROM relay_running r WHERE r.kind = k2.kind), $5::int8),
                coalesce(floor(tokens + 1e-9)::int8, $5::int8))) AS n
       FROM k2
     ), open AS MATERIALIZED (
       SELECT * FROM room WHERE n > 0 ORDER BY kind
     ), c AS (
       SELECT p.task_id, rot.eff, rot.fk, rot.pos, rot.submitter, rot.fair_key
       FROM relay_fair_rotation(ARRAY(SELECT 'k' || kind FROM open), $4::int8, $6::uuid[], $5::int4,
                                ARRAY(SELECT key_cap FROM open), ARRAY(SELECT key_per_ms FROM open),
                                ARRAY(SELECT key_burst FROM open)) rot
       JOIN open ON 'k' || open.kind = rot.fk
       JOIN relay_pending p ON p.task_id = rot.task_id
       WHERE rot.pos <= open.n
       ORDER BY rot.eff, rot.fk, rot.pos LIMIT $5::int4
       FOR UPDATE OF p SKIP LOCKED
     ), served AS (
       SELECT fk, submitter, fair_key, nextval('relay_fair_stamp') AS stamp
       FROM (SELECT * FROM c ORDER BY fk, pos) x
     ), ls AS (
       INSERT INTO relay_fair_lanes AS l (kind, submitter, fair_key, stamp)
       SELECT fk, submitter, fair_key, max(stamp) FROM served GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
       ON CONFLICT (kind, submitter, fair_key) DO UPDATE SET stamp = greatest(l.stamp, excluded.stamp)
     ), ss AS (
       INSERT INTO relay_fair_submitters AS s (kind, submitter, stamp)
       SELECT fk, submitter, max(stamp) FROM served GROUP BY 1, 2 ORDER BY 1, 2
       ON CONFLICT (kind, submitter) DO UPDATE SET stamp = greatest(s.stamp, excluded.stamp)
     ), lb AS (
       INSERT INTO relay_lane_buckets AS lb (kind, submitter, fair_key, tokens, at_ms, full_ms)
       SELECT x.fk, x.submitter, x.fair_key, x.left_, x.now_db,
              x.now_db + ceil((x.key_burst - x.left_) / x.key_per_ms)::int8
       FROM (SELECT v.fk, v.submitter, v.fair_key, open.now_db, open.key_burst, open.key_per_ms,
                    greatest(0, least(open.key_burst, coalesce(b.tokens + greatest(0, open.now_db - b.at_ms)
                                                                 * open.key_per_ms, open.key_burst)) - count(*)) AS left_
             FROM served v JOIN open ON 'k' || open.kind = v.fk
             LEFT JOIN relay_lane_buckets b ON b.kind = v.fk AND b.submitter = v.submitter AND b.fair_key = v.fair_key
             WHERE open.key_per_ms IS NOT NULL
             GROUP BY v.fk, v.submitter, v.fair_key, open.now_db, open.key_burst, open.key_per_ms, b.tokens, b.at_ms
             ORDER BY 1, 2, 3) x
       ON CONFLICT (kind, submitter, fair_key) DO UPDATE
         SET tokens = excluded.tokens, at_ms = excluded.at_ms, full_ms = excluded.full_ms
     ), d AS (
       DELETE FROM relay_pending p USING c WHERE p.task_id = c.task_id RETURNING p.task_id, c.eff, c.fk, c.pos
     ), u AS (
       UPDATE relay_tasks t SET status = 'dispatched', owner_node = $1::uuid, attempt = t.attempt + 1
       FROM d WHERE t.id = d.task_id AND t.status = 'pending'
       RETURNING t.id, t.attempt, t.kind, t.payload, t.timeout_ms, t.max_retries, t.tried, t.created_ms, d.eff,
                 d.fk, d.pos, CASE WHEN t.attempt = 1 THEN 0 ELSE (SELECT count(*)
                   FROM jsonb_array_elements(t.attempt_log) WITH ORDINALITY e(v, i)
                   WHERE i > t.rerun_base AND v ? 'uncounted') END AS uncounted,
                 t.retry_backoff_ms, t.retry_backoff_max_ms, t.retry_any_worker, t.rerun_base, t.submitter, t.fair_key
     ), r AS (
       INSERT INTO relay_running (task_id, owner_node, attempt, kind, submitter, fair_key)
       SELECT id, $1::uuid, attempt, kind, submitter, fair_key FROM u
     ), bk AS (
       INSERT INTO relay_kind_buckets (kind, tokens, at_ms)
       SELECT room.kind, greatest(0, room.tokens - (SELECT count(*) FROM u WHERE u.kind = room.kind)), room.now_db
       FROM room WHERE room.per_ms IS NOT NULL
       ON CONFLICT (kind) DO UPDATE SET tokens = excluded.tokens, at_ms = excluded.at_ms
     )
     SELECT id::text, attempt, kind, payload, timeout_ms, max_retries, tried::text, created_ms, $2::int4, uncounted,
            retry_backoff_ms, retry_backoff_max_ms, retry_any_worker, rerun_base
     FROM u ORDER BY eff, fk, pos";

/// After a claim of limited kinds $1: per kind, whether due tasks ($2 now) still wait (the node
/// looks again shortly: a slot or a token frees on any node without telling it), its attempts
/// running, and its bucket (tokens, ms since; NULL: none) — what `waiting_on` says meanwhile.
pub const KIND_BACKLOG: &str = "SELECT k.kind,
            EXISTS (SELECT 1 FROM relay_pending p WHERE p.kind = k.kind AND p.due_ms <= $2::int8),
            (SELECT count(*) FROM relay_running r WHERE r.kind = k.kind),
            b.tokens, relay_now_ms() - b.at_ms
     FROM unnest($1::text[]) AS k(kind) LEFT JOIN relay_kind_buckets b ON b.kind = k.kind";

/// After a claim of kinds with per-key limits $1 (`max_running_per_key` $2, `rate_per_key` $3
/// tokens per ms and $4 burst): the lanes with due tasks ($5 now) that a per-key limit holds
/// back, 1000 at most — kind, submitter, key and why (`concurrency`, `rate`; both: the first),
/// for `waiting_on`. Only lanes that can be held are looked at: those with attempts running
/// (`relay_running` of the kind, grouped by lane: as many as the kind runs at most) and those
/// with a token bucket (`relay_lane_buckets`: lanes a claim took from, until full again) —
/// never every lane of the kind (measured: 10,000 fresh keys, every lane probed per claim).
pub const LANE_BACKLOG: &str =
    "SELECT DISTINCT ON (x.kind, x.submitter, x.fair_key) x.kind, x.submitter, x.fair_key, x.why
     FROM (
       SELECT k.kind, r.submitter, r.fair_key, 'concurrency' AS why, 0 AS o
       FROM unnest($1::text[], $2::int8[]) AS k(kind, cap)
       JOIN relay_running r ON r.kind = k.kind
       WHERE k.cap IS NOT NULL
       GROUP BY k.kind, k.cap, r.submitter, r.fair_key HAVING count(*) >= k.cap
       UNION ALL
       SELECT k.kind, b.submitter, b.fair_key, 'rate', 1
       FROM unnest($1::text[], $3::float8[], $4::float8[]) AS k(kind, per_ms, burst)
       JOIN relay_lane_buckets b ON b.kind = 'k' || k.kind
       WHERE k.per_ms IS NOT NULL
         AND least(k.burst, b.tokens + greatest(0, relay_now_ms() - b.at_ms) * k.per_ms) < 1 - 1e-9
     ) x
     WHERE (SELECT true FROM relay_pending p
            WHERE coalesce('k' || p.kind, 'n') = 'k' || x.kind AND p.submitter = x.submitter
              AND p.fair_key = x.fair_key AND p.due_ms <= $5::int8
            LIMIT 1)
     ORDER BY x.kind, x.submitter, x.fair_key, x.o
     LIMIT 1000";

/// Of the limited kinds $1, those with tasks pending (due or not: summed from
/// `relay_kind_pending`), read every second: a node's claims lock and probe only these
/// ([`KIND_LOCKS`], [`KIND_BACKLOG`]), so a claim costs nothing for a limited kind with nothing
/// queued (measured: 10,000 idle limited kinds, probed by every claim).
pub const LIMITED_PENDING: &str = "SELECT kind FROM relay_kind_pending WHERE kind = ANY($1::text[])
     GROUP BY kind HAVING sum(n) > 0";

/// `relay_kind_running` / `relay_kind_pending` for the kinds with a policy ($1, at most 1,000):
/// kind, attempts running (counted on the running rows' kind index), tasks pending (the sum of
/// the kind's per-node counts: as many rows as nodes, however long the queue).
pub const KIND_GAUGES: &str = "SELECT k.kind, (SELECT count(*) FROM relay_running r WHERE r.kind = k.kind),
            (SELECT coalesce(sum(p.n), 0)::int8 FROM relay_kind_pending p WHERE p.kind = k.kind)
     FROM unnest($1::text[]) AS k(kind) ORDER BY k.kind";

/// A limited kind in a claim: the kind, its own running cap and bucket (tokens per ms, burst),
/// and those of each of its lanes.
#[derive(Debug, Clone, Copy)]
pub struct Limited<'a> {
    pub kind: &'a str,
    pub cap: Option<u32>,
    pub bucket: Option<(f64, f64)>,
    pub key_cap: Option<u32>,
    pub key_bucket: Option<(f64, f64)>,
}

/// [`CLAIM_LIMITED`] for one group.
/// [`LANE_BACKLOG`] for the kinds of `kinds` with per-key limits (`None`: none has).
pub fn lane_backlog(kinds: &[Limited<'_>], now_ms: u64) -> Option<Stmt> {
    let keyed: Vec<&Limited<'_>> = kinds.iter().filter(|k| k.key_cap.is_some() || k.key_bucket.is_some()).collect();
    if keyed.is_empty() {
        return None;
    }
    let caps: Vec<Option<String>> = keyed.iter().map(|k| k.key_cap.map(|c| c.to_string())).collect();
    let rates: Vec<Option<String>> = keyed.iter().map(|k| k.key_bucket.map(|b| format!("{:e}", b.0))).collect();
    let bursts: Vec<Option<String>> = keyed.iter().map(|k| k.key_bucket.map(|b| b.1.to_string())).collect();
    Some(Stmt::new(
        LANE_BACKLOG,
        vec![
            arr(keyed.iter().map(|k| k.kind)),
            texts(&caps),
            texts(&rates),
            texts(&bursts),
            (now_ms.min(i64::MAX as u64) as i64).into(),
        ],
    ))
}

fn texts(v: &[Option<String>]) -> Param {
    arr_opt(v.iter().map(Option::as_deref))
}

pub fn claim_limited(node: &str, group: u32, kinds: &[Limited<'_>], now_ms: u64, limit: u32, takers: &str) -> Stmt {
    let cap = |c: Option<u32>| c.map(|c| c.to_string());
    let rate = |b: Option<(f64, f64)>| b.map(|b| format!("{:e}", b.0));
    let burst = |b: Option<(f64, f64)>| b.map(|b| b.1.to_string());
    let caps: Vec<Option<String>> = kinds.iter().map(|k| cap(k.cap)).collect();
    let rates: Vec<Option<String>> = kinds.iter().map(|k| rate(k.bucket)).collect();
    let bursts: Vec<Option<String>> = kinds.iter().map(|k| burst(k.bucket)).collect();
    let key_caps: Vec<Option<String>> = kinds.iter().map(|k| cap(k.key_cap)).collect();
    let key_rates: Vec<Option<String>> = kinds.iter().map(|k| rate(k.key_bucket)).collect();
    let key_bursts: Vec<Option<String>> = kinds.iter().map(|k| burst(k.key_bucket)).collect();
    Stmt::new(
        CLAIM_LIMITED,
        vec![
            node.into(),
            i64::from(group).into(),
            arr(kinds.iter().map(|k| k.kind)),
            (now_ms.min(i64::MAX as u64) as i64).into(),
            i64::from(limit).into(),
            Param::Text(takers.to_string()),
            texts(&caps),
            texts(&rates),
            texts(&bursts),
            texts(&key_caps),
            texts(&key_rates),
            texts(&key_bursts),
        ],
    )
}

/// One claim: $2 echoes the group (so one statement's rows say whose they are).
pub fn claim(node: &str, group: u32, kinds: Option<&[&str]>, now_ms: u64, limit: u32, takers: &str) -> Stmt {
    Stmt::new(
        if kinds.is_some() { CLAIM_KINDS } else { CLAIM },
        vec![
            node.into(),
            i64::from(group).into(),
            kinds.map_or(Param::Null, |k| arr(k.iter().copied())),
            (now_ms.min(i64::MAX as u64) as i64).into(),
            i64::from(limit).into(),
            Param::Text(takers.to_string()),
        ],
    )
}

/// Gives back claimed tasks the node did not start after all (the worker left, or has no room,
/// before the claim's answer arrived): pending again, the attempt never happened. Fenced like
/// every attempt write. $1 node, $2 ids, $3 attempts.
pub const UNCLAIM: &str = "WITH u AS (
       UPDATE relay_tasks t SET status = 'pending', owner_node = NULL, attempt = t.attempt - 1
       FROM unnest($2::uuid[], $3::int4[]) AS a(id, attempt)
       WHERE t.id = a.id AND t.owner_node = $1::uuid AND t.attempt = a.attempt AND t.status = 'dispatched'
       RETURNING t.id, greatest(t.run_at_ms, t.created_ms) AS due_ms,
                 greatest(t.run_at_ms, t.created_ms) - t.priority::int8 * 1000 AS ord_ms, t.seq, t.kind, t.queue, t.tried,
                 octet_length(t.payload) AS bytes, t.submitter, t.fair_key
     ), r AS (
       DELETE FROM relay_running r USING u WHERE r.task_id = u.id
     )
     INSERT INTO relay_pending (task_id, due_ms, ord_ms, seq, kind, queue, tried, payload_bytes, submitter, fair_key)
     SELECT id, due_ms, ord_ms, seq, kind, queue, tried, bytes, submitter, fair_key FROM u
     ON CONFLICT (task_id) DO NOTHING RETURNING task_id::text";

pub fn unclaim(node: &str, claimed: &[(String, u32)]) -> Stmt {
    let attempts: Vec<String> = claimed.iter().map(|c| c.1.to_string()).collect();
    Stmt::new(
        UNCLAIM,
        vec![node.into(), arr(claimed.iter().map(|c| c.0.as_str())), arr(attempts.iter().map(String::as_str))],
    )
}

/// After a transaction that claimed was lost (the connection broke: it may have committed),
/// every task the database says this node ($1) runs but the node does not know ($2: the ids
/// it runs) goes back to pending as [`UNCLAIM`] does: the node never sent it.
pub const RELEASE_ORPHANS: &str = "WITH o AS (
       DELETE FROM relay_running r WHERE r.owner_node = $1::uuid AND NOT (r.task_id = ANY($2::uuid[]))
       RETURNING r.task_id, r.attempt
     ), u AS (
       UPDATE relay_tasks t SET status = 'pending', owner_node = NULL, attempt = t.attempt - 1
       FROM o WHERE t.id = o.task_id AND t.attempt = o.attempt AND t.owner_node = $1::uuid AND t.status = 'dispatched'
       RETURNING t.id, greatest(t.run_at_ms, t.created_ms) AS due_ms,
                 greatest(t.run_at_ms, t.created_ms) - t.priority::int8 * 1000 AS ord_ms, t.seq, t.kind, t.queue, t.tried,
                 octet_length(t.payload) AS bytes, t.submitter, t.fair_key
     )
     INSERT INTO relay_pending (task_id, due_ms, ord_ms, seq, kind, queue, tried, payload_bytes, submitter, fair_key)
     SELECT id, due_ms, ord_ms, seq, kind, queue, tried, bytes, submitter, fair_key FROM u
     ON CONFLICT (task_id) DO NOTHING RETURNING task_id::text";

/// Dead nodes' attempts: the running rows of nodes without a heartbeat within the lease ($2)
/// pass to this node ($1), which closes each (`disconnect`, naming the lost node, `uncounted`)
/// and sends its task back to pending. At most 1000 a run; rows another node is taking are
/// skipped. A session worker's attempt waits until RESUME_WINDOW ($3) after the node's last
/// heartbeat: its worker may resume it on any node until then ([`TAKE_SESSION`], SPEC §12) —
/// unless its TASK_TIMEOUT (the task's, else $4) ran out first: a held attempt's timeout keeps
/// running, also when its node died.
pub const ADOPT_ORPHANS: &str = "WITH dead AS (
       SELECT r.task_id, r.owner_node, r.attempt FROM relay_running r
       WHERE r.owner_node <> $1::uuid AND NOT EXISTS (SELECT 1 FROM relay_nodes n
         WHERE n.node_id = r.owner_node AND n.heartbeat_ms > relay_now_ms() - $2::int8)
         AND (r.session IS NULL OR NOT EXISTS (SELECT 1 FROM relay_nodes n
           WHERE n.node_id = r.owner_node AND n.heartbeat_ms > relay_now_ms() - $3::int8)
           OR r.started_ms + coalesce((SELECT t.timeout_ms FROM relay_tasks t WHERE t.id = r.task_id), $4::int8)
              < relay_now_ms())
       LIMIT 1000 FOR UPDATE SKIP LOCKED
     ), moved AS (
       UPDATE relay_running r SET owner_node = $1::uuid FROM dead WHERE r.task_id = dead.task_id
     ), u AS (
       UPDATE relay_tasks t SET owner_node = $1::uuid
       FROM dead WHERE t.id = dead.task_id AND t.attempt = dead.attempt AND t.status = 'dispatched'
       RETURNING t.id, t.attempt, t.kind, t.timeout_ms, t.max_retries, t.tried, t.created_ms, dead.owner_node
     )
     SELECT u.id::text, u.attempt, u.kind, NULL::text, u.timeout_ms, u.max_retries, u.tried::text, u.created_ms,
            coalesce(n.name, u.owner_node::text)
     FROM u LEFT JOIN relay_nodes n ON n.node_id = u.owner_node";

/// A worker resumes its session ($2 secret, $3 worker id) on this node ($1): the session's
/// running attempts on other nodes — alive, or silent for less than RESUME_WINDOW ($4) — pass
/// to this node, which holds them for the worker (SPEC §12). The other node's later writes
/// about them are fenced (`owner_node`). Columns as [`ADOPT_ORPHANS`]' (the node that held
/// them in place of the lost node), then the worker's client id and each attempt's start.
pub const TAKE_SESSION: &str = "WITH s AS (
       SELECT r.task_id, r.owner_node, r.attempt, r.client_id, r.started_ms FROM relay_running r
       WHERE r.session = $2::text AND r.worker_id = $3::text AND r.owner_node <> $1::uuid
         AND EXISTS (SELECT 1 FROM relay_nodes n
           WHERE n.node_id = r.owner_node AND n.heartbeat_ms > relay_now_ms() - $4::int8)
       LIMIT 4096 FOR UPDATE
     ), moved AS (
       UPDATE relay_running r SET owner_node = $1::uuid FROM s WHERE r.task_id = s.task_id
     ), u AS (
       UPDATE relay_tasks t SET owner_node = $1::uuid
       FROM s WHERE t.id = s.task_id AND t.attempt = s.attempt AND t.status = 'dispatched'
       RETURNING t.id, t.attempt, t.kind, t.timeout_ms, t.max_retries, t.tried, t.created_ms, s.owner_node,
                 CASE WHEN t.attempt = 1 THEN 0 ELSE (SELECT count(*)
                   FROM jsonb_array_elements(t.attempt_log) WITH ORDINALITY e(v, i)
                   WHERE i > t.rerun_base AND v ? 'uncounted') END AS uncounted,
                 t.retry_backoff_ms, t.retry_backoff_max_ms, t.retry_any_worker, t.rerun_base, s.client_id, s.started_ms
     )
     SELECT u.id::text, u.attempt, u.kind, NULL::text, u.timeout_ms, u.max_retries, u.tried::text, u.created_ms,
            coalesce(n.name, u.owner_node::text), u.uncounted, u.retry_backoff_ms, u.retry_backoff_max_ms,
            u.retry_any_worker, u.rerun_base, u.client_id::text, u.started_ms
     FROM u LEFT JOIN relay_nodes n ON n.node_id = u.owner_node";

// ---------------------------------------------------------------------------------------------
// Attempts.

/// Names the session of attempts this node ($1) started on session workers (SPEC §12): their
/// `relay_running` rows, fenced by attempt and owner, get the secret, worker id, client id and
/// start, for [`TAKE_SESSION`].
pub const SESSION_ATTEMPTS: &str = "UPDATE relay_running r SET session = a.session, worker_id = a.worker_id,
       client_id = a.client_id, started_ms = a.started_ms
     FROM unnest($2::uuid[], $3::int4[], $4::text[], $5::text[], $6::uuid[], $7::int8[])
       AS a(id, attempt, session, worker_id, client_id, started_ms)
     WHERE r.task_id = a.id AND r.attempt = a.attempt AND r.owner_node = $1::uuid";

/// An attempt of a session worker, for [`SESSION_ATTEMPTS`].
#[derive(Debug, Clone)]
pub struct SessionAttempt {
    pub id: String,
    pub attempt: u32,
    pub secret: String,
    pub worker_id: String,
    pub client_id: String,
    pub started_ms: u64,
}

pub fn session_attempts(node: &str, rows: &[SessionAttempt]) -> Stmt {
    let attempts: Vec<String> = rows.iter().map(|r| r.attempt.to_string()).collect();
    let starts: Vec<String> = rows.iter().map(|r| r.started_ms.to_string()).collect();
    Stmt::new(
        SESSION_ATTEMPTS,
        vec![
            node.into(),
            arr(rows.iter().map(|r| r.id.as_str())),
            arr(attempts.iter().map(String::as_str)),
            arr(rows.iter().map(|r| r.secret.as_str())),
            arr(rows.iter().map(|r| r.worker_id.as_str())),
            arr(rows.iter().map(|r| r.client_id.as_str())),
            arr(starts.iter().map(String::as_str)),
        ],
    )
}

/// Writes the attempt_log entry of attempts this node started (who, where, when), into what
/// the entry holds already, and adds the worker to `tried`. Fenced by attempt: the task is
/// still this node's ($1) and dispatched — or was canceled in that attempt before its start was
/// written (the cancel closed the entry; the start fills in who ran it). $2 the node's name.
pub const ATTEMPT_STARTED: &str = "UPDATE relay_tasks t SET
       attempt_log = jsonb_set(t.attempt_log, ARRAY[(t.attempt - 1)::text],
         coalesce(t.attempt_log -> (t.attempt - 1), '{}'::jsonb)
           || jsonb_build_object('num', t.attempt, 'client_id', a.client_id, 'client_ip', a.client_ip, 'node', $2::text,
                                 'started_ms', a.started_ms), true),
       tried = CASE WHEN a.client_id = ANY(t.tried) THEN t.tried ELSE t.tried || a.client_id END
     FROM unnest($3::uuid[], $4::int4[], $5::uuid[], $6::text[], $7::int8[])
       AS a(id, attempt, client_id, client_ip, started_ms)
     WHERE t.id = a.id AND t.attempt = a.attempt
       AND ((t.status = 'dispatched' AND t.owner_node = $1::uuid)
            OR (t.status = 'canceled' AND t.attempt_log -> (t.attempt - 1) ->> 'client_id' IS NULL))";

/// Who ran an attempt (absent for a dead node's attempt this node closes).
#[derive(Debug, Clone)]
pub struct Runner {
    pub client_id: String,
    pub client_ip: String,
    pub started_ms: u64,
}

pub fn attempt_started(node: &str, node_name: &str, started: &[(String, u32, Runner)]) -> Stmt {
    let attempts: Vec<String> = started.iter().map(|s| s.1.to_string()).collect();
    let at: Vec<String> = started.iter().map(|s| s.2.started_ms.to_string()).collect();
    Stmt::new(
        ATTEMPT_STARTED,
        vec![
            node.into(),
            node_name.into(),
            arr(started.iter().map(|s| s.0.as_str())),
            arr(attempts.iter().map(String::as_str)),
            arr(started.iter().map(|s| s.2.client_id.as_str())),
            arr(started.iter().map(|s| s.2.client_ip.as_str())),
            arr(at.iter().map(String::as_str)),
        ],
    )
}

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
    /// `None`: the attempt of a lost node, timed here from the start its entry shows.
    pub duration_ms: Option<u64>,
    /// The task's new status: `done`/`failed` when final, `pending` for a retry.
    pub status: &'static str,
    /// For done: the worker's data (JSON text).
    pub result: Option<String>,
    /// For failed: the task's final error.
    pub final_error: Option<String>,
    pub runner: Option<Runner>,
    /// The node that ran it: this one, or the lost node whose attempt this one closes.
    pub node: Option<String>,
    /// Closed by a lost node: not counted against max_retries (the entry says `uncounted`, which
    /// claims read), and the task waits for a worker as a queued one.
    pub uncounted: bool,
    /// A retry not claimable before this (its backoff, SPEC §13): the pending row's due time,
    /// and the entry's `next_attempt_ms` (which the task JSON shows as `next_attempt_at`).
    pub next_attempt_ms: Option<u64>,
    /// A worker that tried it and may take it again (`any_worker`): out of `tried`.
    pub again: Option<String>,
    /// Times a resuming worker took it back (SPEC §12; 0: the entry has no `resumes`).
    pub resumes: u32,
}

/// Closes attempts with their whole attempt_log entry (an attempt that started and ended
/// between two transactions is written once, here): final ones set the status and result;
/// retries go back to `relay_pending` in their place (keeping `tried`, so the next
/// claim picks a worker not tried yet, on any node). Fenced by node ($1), attempt and status: a
/// stale write matches nothing and is missing from the returned rows ([`GET_TASKS`]'s columns;
/// the attempt_log only for final tasks, which a waiter may be answered with at once).
pub const ATTEMPT_ENDED: &str = "WITH a AS (
       SELECT * FROM unnest($3::uuid[], $4::int4[], $5::text[], $6::text[], $7::int8[], $8::int8[], $9::text[],
                            $10::text[], $11::text[], $12::uuid[], $13::text[], $14::int8[], $2::text[],
                            $15::bool[], $16::int4[], $17::int8[], $18::uuid[])
         AS a(id, attempt, outcome, error, ended_ms, duration_ms, status, result, final_error, client_id, client_ip,
              started_ms, node, uncounted, resumes, next_attempt_ms, again)
     ), u AS (
       UPDATE relay_tasks t SET
         status = a.status,
         owner_node = NULL,
         queue = t.queue OR a.uncounted,
         finished_ms = CASE WHEN a.status = 'pending' THEN NULL ELSE a.ended_ms END,
         result = a.result,
         error = a.final_error,
         client_id = coalesce(a.client_id, t.client_id),
         client_ip = coalesce(a.client_ip, t.client_ip),
         tried = array_remove(CASE WHEN a.client_id IS NULL OR a.client_id = ANY(t.tried) THEN t.tried
                                   ELSE t.tried || a.client_id END, a.again),
         attempt_log = jsonb_set(t.attempt_log, ARRAY[(t.attempt - 1)::text],
           coalesce(t.attempt_log -> (t.attempt - 1), jsonb_build_object('num', t.attempt))
             || jsonb_strip_nulls(jsonb_build_object('client_id', a.client_id, 'client_ip', a.client_ip,
                  'node', a.node, 'started_ms', a.started_ms,
                  'outcome', a.outcome, 'error', a.error,
                  'duration_ms', coalesce(a.duration_ms,
                    greatest(0, a.ended_ms - ((t.attempt_log -> (t.attempt - 1)) ->> 'started_ms')::int8)),
                  'uncounted', CASE WHEN a.uncounted THEN true END,
                  'resumes', CASE WHEN a.resumes > 0 THEN a.resumes END,
                  'next_attempt_ms', a.next_attempt_ms)), true)
       FROM a
       WHERE t.id = a.id AND t.owner_node = $1::uuid AND t.attempt = a.attempt AND t.status = 'dispatched'
       RETURNING t.id, t.status, t.seq, t.kind, t.queue, t.tried, octet_length(t.payload) AS bytes, t.created_ms,
                 t.priority, t.reruns, t.submitter, t.fair_key,
                 t.run_at_ms, t.finished_ms, t.result, t.error, t.client_id, t.client_ip, t.attempt_log, a.ended_ms,
                 a.next_attempt_ms
     ), run AS (
       DELETE FROM relay_running r USING u WHERE r.task_id = u.id
     ), requeue AS (
       INSERT INTO relay_pending (task_id, due_ms, ord_ms, seq, kind, queue, tried, payload_bytes, submitter, fair_key)
       SELECT id, greatest(run_at_ms, created_ms, next_attempt_ms),
              greatest(run_at_ms, created_ms, next_attempt_ms) - priority::int8 * 1000, seq, kind,
              queue, tried, bytes, submitter, fair_key FROM u WHERE status = 'pending'
     )
     SELECT id::text, status, kind, created_ms, run_at_ms, finished_ms, result, error, client_id::text, client_ip,
            CASE WHEN status = 'pending' THEN NULL ELSE attempt_log::text END, priority, reruns, fair_key, submitter
     FROM u";

pub fn attempt_ended(node: &str, ended: &[Ended]) -> Stmt {
    let attempts: Vec<String> = ended.iter().map(|e| e.attempt.to_string()).collect();
    let resumes: Vec<String> = ended.iter().map(|e| e.resumes.to_string()).collect();
    let ends: Vec<String> = ended.iter().map(|e| e.ended_ms.to_string()).collect();
    let durations: Vec<Option<String>> = ended.iter().map(|e| e.duration_ms.map(|d| d.to_string())).collect();
    let starts: Vec<Option<String>> =
        ended.iter().map(|e| e.runner.as_ref().map(|r| r.started_ms.to_string())).collect();
    let nexts: Vec<Option<String>> = ended.iter().map(|e| e.next_attempt_ms.map(|n| n.to_string())).collect();
    Stmt::new(
        ATTEMPT_ENDED,
        vec![
            node.into(),
            arr_opt(ended.iter().map(|e| e.node.as_deref())),
            arr(ended.iter().map(|e| e.id.as_str())),
            arr(attempts.iter().map(String::as_str)),
            arr(ended.iter().map(|e| e.outcome)),
            big_texts(ended.iter().map(|e| e.error.as_deref())),
            arr(ends.iter().map(String::as_str)),
            arr_opt(durations.iter().map(Option::as_deref)),
            arr(ended.iter().map(|e| e.status)),
            big_texts(ended.iter().map(|e| e.result.as_deref())),
            big_texts(ended.iter().map(|e| e.final_error.as_deref())),
            arr_opt(ended.iter().map(|e| e.runner.as_ref().map(|r| r.client_id.as_str()))),
            arr_opt(ended.iter().map(|e| e.runner.as_ref().map(|r| r.client_ip.as_str()))),
            arr_opt(starts.iter().map(Option::as_deref)),
            arr(ended.iter().map(|e| if e.uncounted { "t" } else { "f" })),
            arr(resumes.iter().map(String::as_str)),
            arr_opt(nexts.iter().map(Option::as_deref)),
            arr_opt(ended.iter().map(|e| e.again.as_deref())),
        ],
    )
}

// ---------------------------------------------------------------------------------------------
// Reads.

/// $1 task ids → those tasks as the API shows them (`store::pg::rows::col` names the columns;
/// the payload only with `?include=payload`: [`GET_TASKS_PAYLOAD`]): every read of a turn in
/// one statement.
pub const GET_TASKS: &str = "SELECT id::text, status, kind, created_ms, run_at_ms, finished_ms, result, error,
            client_id::text, client_ip, attempt_log::text, priority, reruns, fair_key, submitter
     FROM relay_tasks WHERE id = ANY($1::uuid[])";

/// [`GET_TASKS`] with the payload (a task that is done has none).
pub const GET_TASKS_PAYLOAD: &str = "SELECT id::text, status, kind, created_ms, run_at_ms, finished_ms, result, error,
            client_id::text, client_ip, attempt_log::text, priority, reruns, fair_key, submitter,
            CASE WHEN status = 'done' THEN NULL ELSE payload END
     FROM relay_tasks WHERE id = ANY($1::uuid[])";

/// $1 task ids → the final ones among them, with [`GET_TASKS`]'s columns (wait=true waiters
/// ask after a `relay_finished` notification, after their own node ended attempts, and every
/// second; the owner of canceled tasks asks after a `relay_cancel` notification). Written as a
/// join on the ids so that every plan looks each id up by its key.
pub const FINISHED_AMONG: &str =
    "SELECT t.id::text, t.status, t.kind, t.created_ms, t.run_at_ms, t.finished_ms, t.result,
            t.error, t.client_id::text, t.client_ip, t.attempt_log::text, t.priority, t.reruns,
            t.fair_key, t.submitter
     FROM unnest($1::uuid[]) AS k(id) JOIN relay_tasks t ON t.id = k.id
     WHERE t.status IN ('done', 'failed', 'canceled')";

/// Listing, newest first, one bounded walk down `relay_tasks_seq` (every plan can use it: no
/// optional condition touches the walk): the $6 tasks below the cursor ($4: a submission
/// number; the largest int8 for the first page) are looked at, and those matching $1 status,
/// $2 kind and $3 kinds allowed (NULL: any) are listed, $5 (limit + 1) at most, stopping at the
/// first task past $7 bytes of results (results are up to MAX_MESSAGE_SIZE each). Columns: those
/// of [`GET_TASKS`], a NULL payload, `seq`, then on every row how many tasks the walk looked at
/// and the seq where it stopped (one row of NULL task columns when none matched): a page that ran
/// out of walk continues from there, as a single node's listing does.
pub const LIST_TASKS: &str = "WITH s AS MATERIALIZED (
       SELECT id, status, kind, seq FROM relay_tasks
       WHERE seq < $4::int8
       ORDER BY seq DESC LIMIT $6::int4
     ), m AS (
       SELECT id FROM s
       WHERE ($1::text IS NULL OR status = $1::text)
         AND ($2::text IS NULL OR kind = $2::text)
         AND ($3::text[] IS NULL OR kind = ANY($3::text[]))
       ORDER BY seq DESC LIMIT $5::int4
     ), page AS (
       SELECT t.*, coalesce(sum(octet_length(t.result)) OVER (ORDER BY t.seq DESC
                 ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before
       FROM m JOIN relay_tasks t ON t.id = m.id
     ), walked AS (
       SELECT count(*) AS n FROM s
     ), stop AS (
       SELECT seq FROM s ORDER BY seq LIMIT 1
     )
     SELECT p.id::text, p.status, p.kind, p.created_ms, p.run_at_ms, p.finished_ms, p.result, p.error,
            p.client_id::text, p.client_ip, p.attempt_log::text, p.priority, p.reruns, p.fair_key, p.submitter, NULL::text,
            p.seq,
            walked.n,
            stop.seq
     FROM walked LEFT JOIN stop ON true LEFT JOIN page p ON p.before < $7::int8
     ORDER BY p.seq DESC";

// ---------------------------------------------------------------------------------------------
// Re-runs (SPEC §13).

/// `POST /tasks/{id}/retry`: $1 task id, $2 kinds the caller may touch (NULL: all), $3 now_ms,
/// $4 MAX_PENDING, $5 MAX_PENDING_BYTES. A failed or canceled task goes back to pending with a
/// fresh retry budget (`rerun_base`: the attempts before this run; `tried` empty), its
/// attempt_log kept (but the wait of a retry canceled during its backoff: it is due now),
/// `reruns` counted, due now, waiting for a worker as a queued task — if the
/// pending tasks leave room for it (SPEC §7, as for a submit). Returns its status before (no
/// row: unknown or out of scope), whether it was re-run, and whether there was room;
/// [`GET_TASKS`] after it reads the task back.
pub const RERUN: &str = concat!(
    "WITH lim AS (
       SELECT coalesce(sum(n), 0) AS n, coalesce(sum(bytes), 0) AS b FROM relay_pending_counts
     ), old AS (
       SELECT t.id, t.status, lim.n + 1 <= $4::int8 AND lim.b + coalesce(octet_length(t.payload), 0) <= $5::int8 AS room
       FROM relay_tasks t, lim
       WHERE t.id = $1::uuid AND ($2::text[] IS NULL OR t.kind = ANY($2::text[])) FOR UPDATE OF t
     ), entered AS (
       UPDATE relay_tasks t SET status = 'pending', finished_ms = NULL, error = NULL, result = NULL, queue = true,
         reruns = t.reruns + 1, rerun_base = t.attempt, tried = '{}',
         attempt_log = t.attempt_log #- ARRAY[(jsonb_array_length(t.attempt_log) - 1)::text, 'next_attempt_ms']
       FROM old WHERE t.id = old.id AND old.status IN ('failed', 'canceled') AND old.room
       RETURNING t.id, t.seq, t.kind, t.priority, octet_length(t.payload) AS bytes, t.submitter, t.fair_key
     ), p AS (
       INSERT INTO relay_pending (task_id, due_ms, ord_ms, seq, kind, queue, payload_bytes, submitter, fair_key)
       SELECT id, $3::int8, $3::int8 - priority::int8 * 1000, seq, kind, true, bytes, submitter, fair_key FROM entered
     ",
    fair_lanes!(),
    "
     SELECT old.status, EXISTS (SELECT 1 FROM entered), old.room FROM old"
);

pub fn rerun(id: &str, scope: Option<&[String]>, now_ms: u64, max_pending: u64, max_pending_bytes: u64) -> Stmt {
    Stmt::new(
        RERUN,
        vec![
            id.into(),
            scope.map_or(Param::Null, |k| arr(k.iter().map(String::as_str))),
            (now_ms.min(i64::MAX as u64) as i64).into(),
            (max_pending.min(i64::MAX as u64) as i64).into(),
            (max_pending_bytes.min(i64::MAX as u64) as i64).into(),
        ],
    )
}

/// `POST /tasks/retry`: of the newest $8 tasks (one bounded walk down `relay_tasks_seq`), the
/// $6 newest with status $1 (`failed` or `canceled`), kind $2 (NULL: any), a kind in $3 (the
/// caller's scope; NULL: any), an error containing $4 and finished after $5 (NULL: any) are re-run
/// as [`RERUN`] re-runs one — as many, newest first, as $10 MAX_PENDING and $11
/// MAX_PENDING_BYTES leave room for — unless $7 (a dry run), which only lists them. Rows locked
/// by another node are skipped. Returns their ids, and on every row how many matched (one row
/// of a NULL id when none could be re-run).
pub const RERUN_MANY: &str = concat!(
    "WITH lim AS (
       SELECT coalesce(sum(n), 0) AS n, coalesce(sum(bytes), 0) AS b FROM relay_pending_counts
     ), s AS MATERIALIZED (
       SELECT id, status, kind, seq, finished_ms FROM relay_tasks ORDER BY seq DESC LIMIT $8::int4
     ), m AS (
       SELECT t.id, t.seq FROM s JOIN relay_tasks t ON t.id = s.id
       WHERE s.status = $1::text AND ($2::text IS NULL OR s.kind = $2::text)
         AND ($3::text[] IS NULL OR s.kind = ANY($3::text[]))
         AND ($4::text IS NULL OR strpos(t.error, $4::text) > 0)
         AND ($5::int8 IS NULL OR s.finished_ms > $5::int8)
       ORDER BY s.seq DESC LIMIT $6::int4
     ), l AS (
       SELECT t.id, m.seq, octet_length(t.payload) AS bytes FROM relay_tasks t JOIN m ON t.id = m.id
       WHERE t.status = $1::text FOR UPDATE OF t SKIP LOCKED
     ), r AS (
       SELECT l.id, l.seq FROM (
         SELECT l.*, count(*) OVER w AS cum_n, sum(coalesce(l.bytes, 0)) OVER w AS cum_b FROM l
         WINDOW w AS (ORDER BY l.seq DESC)
       ) l, lim
       WHERE $7::bool OR (lim.n + l.cum_n <= $10::int8 AND lim.b + l.cum_b <= $11::int8)
     ), entered AS (
       UPDATE relay_tasks t SET status = 'pending', finished_ms = NULL, error = NULL, result = NULL, queue = true,
         reruns = t.reruns + 1, rerun_base = t.attempt, tried = '{}',
         attempt_log = t.attempt_log #- ARRAY[(jsonb_array_length(t.attempt_log) - 1)::text, 'next_attempt_ms']
       FROM r WHERE t.id = r.id AND NOT $7::bool
       RETURNING t.id, t.seq, t.kind, t.priority, octet_length(t.payload) AS bytes, t.submitter, t.fair_key
     ), p AS (
       INSERT INTO relay_pending (task_id, due_ms, ord_ms, seq, kind, queue, payload_bytes, submitter, fair_key)
       SELECT id, $9::int8, $9::int8 - priority::int8 * 1000, seq, kind, true, bytes, submitter, fair_key FROM entered
     ",
    fair_lanes!(),
    ", matched AS (
       SELECT count(*) AS n FROM l
     )
     SELECT r.id::text, matched.n FROM matched LEFT JOIN r ON true ORDER BY r.seq DESC"
);

pub fn rerun_many(
    f: &crate::store::RerunFilter,
    scope: Option<&[String]>,
    walk: usize,
    now_ms: u64,
    max_pending: u64,
    max_pending_bytes: u64,
) -> Stmt {
    Stmt::new(
        RERUN_MANY,
        vec![
            f.status.as_str().into(),
            f.kind.as_deref().into(),
            scope.map_or(Param::Null, |k| arr(k.iter().map(String::as_str))),
            f.error_contains.as_deref().into(),
            f.finished_after_ms.map_or(Param::Null, |ms| (ms.min(i64::MAX as u64) as i64).into()),
            i64::from(f.limit).into(),
            Param::Text(if f.dry_run { "t" } else { "f" }.into()),
            (walk as i64).into(),
            (now_ms.min(i64::MAX as u64) as i64).into(),
            (max_pending.min(i64::MAX as u64) as i64).into(),
            (max_pending_bytes.min(i64::MAX as u64) as i64).into(),
        ],
    )
}

// ---------------------------------------------------------------------------------------------
// Cancel.

/// $1 task id, $2 now_ms, $3 kinds the caller may cancel (NULL: all, the root token): cancels a
/// pending or dispatched task; returns the node that was running it (NULL if pending) and the
/// attempt, so that node is told through `relay_cancel` to send `cancel` to its worker, and the
/// time it was created (for the submit-to-final histogram). No row: unknown, already final, or
/// of a kind the caller may not touch.
pub const CANCEL: &str = "WITH old AS (
       SELECT id, status, owner_node, attempt FROM relay_tasks
       WHERE id = $1::uuid AND status IN ('pending', 'dispatched')
         AND ($3::text[] IS NULL OR kind = ANY($3::text[])) FOR UPDATE
     ), dp AS (
       DELETE FROM relay_pending p USING old WHERE p.task_id = old.id
     ), dr AS (
       DELETE FROM relay_running r USING old WHERE r.task_id = old.id
     ), u AS (
       UPDATE relay_tasks t SET status = 'canceled', owner_node = NULL, finished_ms = $2::int8,
         attempt_log = CASE WHEN old.status = 'dispatched' THEN
             jsonb_set(t.attempt_log, ARRAY[(t.attempt - 1)::text],
               coalesce(t.attempt_log -> (t.attempt - 1), jsonb_build_object('num', t.attempt))
                 || jsonb_build_object('outcome', 'canceled'), true)
           ELSE t.attempt_log END
       FROM old WHERE t.id = old.id
       RETURNING t.id, t.created_ms
     )
     SELECT old.owner_node::text, old.attempt, u.created_ms, pg_notify('relay_cancel', old.id::text)
     FROM old JOIN u ON u.id = old.id";

// ---------------------------------------------------------------------------------------------
// Housekeeping: every node's turn transactions, once a second, on the node's clock (and the
// database thread's, for nodes and files); SKIP LOCKED keeps nodes from colliding.

/// Waiting tasks that no live worker can take any more (SPEC §5): plain tasks (`queue` false)
/// and retries (`tried` not empty) for which no active worker of a live node ($1 lease_ms) takes
/// the kind without having tried it. They fail: a retry with its last attempt's error, a plain
/// task with `no connected worker can take this task any more`. $2 now_ms. Run after a worker
/// of this node left (its `relay_workers` row deleted) and once a second.
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
     RETURNING t.id::text, t.error, t.created_ms";

pub fn fail_unplaceable(lease_ms: u64, now_ms: i64) -> Stmt {
    Stmt::new(FAIL_UNPLACEABLE, vec![(lease_ms as i64).into(), now_ms.into()])
}

/// Nodes silent for an hour are forgotten (a restarted relay is a new node: without this their
/// rows would pile up), and the counter rows of every node not heard from for an hour are
/// folded into the zero node's (sums unchanged; a live node's next change writes a fresh row).
///
/// The pending counts per kind (`relay_kind_pending`) are folded the same way, and a kind whose
/// rows add up to 0 (no task of it pending: a made-up name, a kind drained) loses them, so the
/// table holds kinds × nodes rows of kinds with work, not every name ever submitted (the rows of
/// a kind can each be nonzero and add up to 0: a task submitted on one node and claimed on
/// another is +1 on the first and −1 on the second). The kinds that add up to 0 as this
/// statement's snapshot sees them (1000 a run) are the candidates; of their rows, those it can
/// lock (`FOR UPDATE SKIP LOCKED`: the sweep never waits for a node's turn transaction, nor
/// deadlocks with one) go if the locked versions still add up to 0. Under READ COMMITTED the
/// locked versions are the latest committed ones and none can change before this commits, and
/// removing rows that add up to 0 leaves their kind's sum as it is — whatever runs meanwhile: a
/// trigger's upsert of a row being removed waits for this statement, then finds no row and
/// inserts its change as a new one (`ON CONFLICT` either inserts or updates, retrying until one
/// succeeds); a row a trigger has changed and not committed yet is skipped (the rest may still
/// add up to 0: they go, and the skipped row keeps its kind's whole sum); a row inserted after
/// the snapshot is not seen. A kind with a row of a node being folded is left alone until the
/// next run (one statement touches a row once).
pub const FORGET_NODES: &str = "WITH gone AS (
       DELETE FROM relay_nodes WHERE heartbeat_ms < relay_now_ms() - 3600000
     ), workers_gone AS (
       DELETE FROM relay_workers w
       WHERE NOT EXISTS (SELECT 1 FROM relay_nodes n
                         WHERE n.node_id = w.node_id AND n.heartbeat_ms > relay_now_ms() - 3600000)
     ), folded AS (
       DELETE FROM relay_counters c
       WHERE c.node_id <> '00000000-0000-0000-0000-000000000000'::uuid
         AND NOT EXISTS (SELECT 1 FROM relay_nodes n
                         WHERE n.node_id = c.node_id AND n.heartbeat_ms > relay_now_ms() - 3600000)
       RETURNING c.status, c.n
     ), pending_folded AS (
       DELETE FROM relay_pending_counts c
       WHERE c.node_id <> '00000000-0000-0000-0000-000000000000'::uuid
         AND NOT EXISTS (SELECT 1 FROM relay_nodes n
                         WHERE n.node_id = c.node_id AND n.heartbeat_ms > relay_now_ms() - 3600000)
       RETURNING c.n, c.bytes
     ), pending_zero AS (
       INSERT INTO relay_pending_counts (node_id, n, bytes)
       SELECT '00000000-0000-0000-0000-000000000000'::uuid, coalesce(sum(n), 0), coalesce(sum(bytes), 0)
       FROM pending_folded HAVING count(*) > 0
       ON CONFLICT (node_id) DO UPDATE SET n = relay_pending_counts.n + excluded.n,
         bytes = relay_pending_counts.bytes + excluded.bytes
     ), kind_folded AS (
       DELETE FROM relay_kind_pending c WHERE (c.kind, c.node_id) IN (
         SELECT x.kind, x.node_id FROM relay_kind_pending x
         WHERE x.node_id <> '00000000-0000-0000-0000-000000000000'::uuid
           AND NOT EXISTS (SELECT 1 FROM relay_nodes n
                           WHERE n.node_id = x.node_id AND n.heartbeat_ms > relay_now_ms() - 3600000)
         FOR UPDATE SKIP LOCKED)
       RETURNING c.kind, c.n
     ), kind_zero AS (
       INSERT INTO relay_kind_pending (kind, node_id, n)
       SELECT kind, '00000000-0000-0000-0000-000000000000'::uuid, sum(n) FROM kind_folded GROUP BY kind ORDER BY kind
       ON CONFLICT (kind, node_id) DO UPDATE SET n = relay_kind_pending.n + excluded.n
     ), kind_idle AS MATERIALIZED (
       SELECT l.kind, array_agg(l.node_id) AS nodes FROM (
         SELECT x.kind, x.node_id, x.n FROM relay_kind_pending x
         WHERE x.kind IN (SELECT y.kind FROM relay_kind_pending y GROUP BY y.kind HAVING sum(y.n) = 0 LIMIT 1000)
           AND NOT EXISTS (SELECT 1 FROM relay_kind_pending d
                           WHERE d.kind = x.kind AND d.node_id <> '00000000-0000-0000-0000-000000000000'::uuid
                             AND NOT EXISTS (SELECT 1 FROM relay_nodes n
                                             WHERE n.node_id = d.node_id AND n.heartbeat_ms > relay_now_ms() - 3600000))
         FOR UPDATE OF x SKIP LOCKED) l
       GROUP BY l.kind HAVING sum(l.n) = 0
     ), kind_swept AS (
       DELETE FROM relay_kind_pending c USING kind_idle z WHERE c.kind = z.kind AND c.node_id = ANY(z.nodes)
     )
     INSERT INTO relay_counters (node_id, status, n)
     SELECT '00000000-0000-0000-0000-000000000000'::uuid, status, sum(n) FROM folded GROUP BY status
     ON CONFLICT (node_id, status) DO UPDATE SET n = relay_counters.n + excluded.n";

/// The longest [`FAIR_SWEEP`] may take, its wait for [`INSERT_LOCK`] included (the rest of its
/// transaction: 1 s): it holds every node's inserts while it runs.
pub const SWEEP_TIMEOUT: &str = "SELECT set_config('statement_timeout', '1000', true)";

/// Rotation state of lanes that have no pending and no running task any more goes, 1000 lanes
/// a run (with their submitters' rows once they have no lane left, and the kind's mark once it
/// has one lane or none): the tables hold only lanes with work. So do lanes' token buckets once
/// they would be full again (1000 a run): a key cannot refill its bucket by running dry. Run by each node's database
/// thread once a second, after [`INSERT_LOCK`] in its transaction (an insert either sees the
/// lane's row or makes a new one, never one that goes as it inserts).
pub const FAIR_SWEEP: &str = "WITH gone AS (
       DELETE FROM relay_fair_lanes l WHERE (l.kind, l.submitter, l.fair_key) IN (
         SELECT x.kind, x.submitter, x.fair_key FROM relay_fair_lanes x
         WHERE NOT EXISTS (SELECT 1 FROM relay_pending p WHERE coalesce('k' || p.kind, 'n') = x.kind
                             AND p.submitter = x.submitter AND p.fair_key = x.fair_key)
           AND NOT EXISTS (SELECT 1 FROM relay_running r WHERE coalesce('k' || r.kind, 'n') = x.kind
                             AND r.submitter = x.submitter AND r.fair_key = x.fair_key)
         LIMIT 1000 FOR UPDATE SKIP LOCKED)
       RETURNING l.kind, l.submitter
     ), subs AS (
       DELETE FROM relay_fair_submitters s
       USING (SELECT kind, submitter, count(*) AS n FROM gone GROUP BY kind, submitter) g
       WHERE s.kind = g.kind AND s.submitter = g.submitter
         AND (SELECT count(*) FROM relay_fair_lanes l WHERE l.kind = g.kind AND l.submitter = g.submitter) <= g.n
     ), kinds AS (
       DELETE FROM relay_fair_kinds f USING (SELECT kind, count(*) AS n FROM gone GROUP BY kind) g
       WHERE f.kind = g.kind AND (SELECT count(*) FROM relay_fair_lanes l WHERE l.kind = g.kind) - g.n < 2
     ), buckets AS (
       DELETE FROM relay_lane_buckets b WHERE (b.kind, b.submitter, b.fair_key) IN (
         SELECT x.kind, x.submitter, x.fair_key FROM relay_lane_buckets x WHERE x.full_ms <= relay_now_ms()
         LIMIT 1000 FOR UPDATE SKIP LOCKED)
     )
     SELECT count(*) FROM gone";

/// The queue and fair-shares tables whose statistics a sharp growth made stale: more live rows
/// than 1,000 plus twice the rows counted at their last analyze (autovacuum analyzes after a
/// tenth changed, but looks only once a minute, and plans made on statistics from when a table
/// was nearly empty walk every lane; a steady churn is left to it). The names, for
/// [`ANALYZE_QUEUE`].
pub const STALE_STATS: &str = "SELECT s.relname::text FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
     WHERE s.schemaname = current_schema()
       AND s.relname IN ('relay_pending', 'relay_running', 'relay_fair_lanes', 'relay_fair_submitters',
                         'relay_lane_buckets')
       AND s.n_live_tup > 1000 + 2 * greatest(c.reltuples, 0)::int8";

/// The longest [`ANALYZE_QUEUE`] may take (as [`SWEEP_TIMEOUT`]): it runs on a node's database
/// thread, between the loop's transactions, which wait for it.
pub const ANALYZE_TIMEOUT: &str = "SELECT set_config('statement_timeout', '1000', true)";

/// Fresh statistics for the tables [`STALE_STATS`] looks at (all five: they grow together, and
/// ANALYZE samples at most 30,000 rows of each), skipping a table another ANALYZE or autovacuum
/// holds rather than waiting.
pub const ANALYZE_QUEUE: &str =
    "ANALYZE (SKIP_LOCKED) relay_pending, relay_running, relay_fair_lanes, relay_fair_submitters, relay_lane_buckets";

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
     FROM e WHERE t.id = e.task_id AND t.status = 'pending'
     RETURNING t.id::text, t.created_ms";

pub fn expire_in_queue(now_ms: i64, task_ttl_ms: u64) -> Stmt {
    Stmt::new(EXPIRE_IN_QUEUE, vec![now_ms.into(), (task_ttl_ms as i64).into()])
}

/// Retention: finished tasks older than TASK_TTL go, at most [`RETENTION_BATCH`] a transaction
/// (oldest submission first, walking `relay_tasks_seq`), so one run is a short transaction and
/// autovacuum reclaims the space behind it; it answers how many went. $1 now_ms, $2 TASK_TTL, $3
/// FAILED_TTL (failed tasks are kept that long, SPEC §13).
pub const RETENTION: &str = "WITH d AS (
       DELETE FROM relay_tasks WHERE id IN (
         SELECT id FROM relay_tasks
         WHERE finished_ms < $1::int8 - CASE WHEN status = 'failed' THEN $3::int8 ELSE $2::int8 END
         ORDER BY seq LIMIT 2000 FOR UPDATE SKIP LOCKED)
       RETURNING 1
     )
     SELECT count(*) FROM d";

/// The most tasks one [`RETENTION`] deletes: a node that deleted as many looks again with its
/// next transaction rather than a second later, so retention keeps up with any rate of tasks.
pub const RETENTION_BATCH: i64 = 2000;

pub fn retention(now_ms: i64, task_ttl_ms: u64, failed_ttl_ms: u64) -> Stmt {
    Stmt::new(RETENTION, vec![now_ms.into(), (task_ttl_ms as i64).into(), (failed_ttl_ms as i64).into()])
}

// ---------------------------------------------------------------------------------------------
// Workers (/clients) and counts (/healthz).

/// Upserts this node's workers' rows (arrays: client_id, ip, connected_ms, kinds as a JSON
/// array text or NULL, concurrency, in_flight, active, version). Sent with the turn's
/// transaction when a worker connected or changed.
pub const UPSERT_WORKERS: &str = "INSERT INTO relay_workers
       (client_id, node_id, ip, connected_ms, kinds, concurrency, in_flight, active, version, resumable_until_ms)
     SELECT w.client_id, $1::uuid, w.ip, w.connected_ms,
            CASE WHEN w.kinds IS NULL THEN NULL
                 ELSE ARRAY(SELECT jsonb_array_elements_text(w.kinds::jsonb)) END,
            w.concurrency, w.in_flight, w.active, w.version, w.resumable_until_ms
     FROM unnest($2::uuid[], $3::text[], $4::int8[], $5::text[], $6::int4[], $7::int4[], $8::bool[], $9::text[],
                 $10::int8[])
       AS w(client_id, ip, connected_ms, kinds, concurrency, in_flight, active, version, resumable_until_ms)
     ON CONFLICT (client_id) DO UPDATE SET node_id = excluded.node_id, ip = excluded.ip, kinds = excluded.kinds,
       concurrency = excluded.concurrency, in_flight = excluded.in_flight, active = excluded.active,
       version = excluded.version, resumable_until_ms = excluded.resumable_until_ms";

/// $1 client ids that left this node ($2). (A session's client id may be another node's row by
/// now: its worker resumed there, SPEC §12.)
pub const DELETE_WORKERS: &str = "DELETE FROM relay_workers WHERE client_id = ANY($1::uuid[]) AND node_id = $2::uuid";

/// Every row of this node ($1) but its workers connected now ($2): after an outage, or when
/// more workers left than the node keeps track of, instead of [`DELETE_WORKERS`].
pub const RESYNC_WORKERS: &str =
    "DELETE FROM relay_workers WHERE node_id = $1::uuid AND NOT (client_id = ANY($2::uuid[]))";

/// /clients: every worker of every live node ($1 lease_ms), with its node's name.
pub const LIST_WORKERS: &str =
    "SELECT w.client_id::text, w.ip, w.connected_ms, array_to_json(w.kinds)::text, w.concurrency,
            w.in_flight, w.active, w.version, n.name, w.node_id::text, w.resumable_until_ms
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

/// A refused or cut-off upload (413, 400, a client gone): its metadata and chunks at once, as
/// a single node removes its temp file. $1 file id. Only an upload not complete: a stored file
/// goes only by `FILE_EXPIRE`.
pub const FILE_ABORT: &str = "WITH f AS (
       DELETE FROM relay_files WHERE file_id = $1::uuid AND NOT complete RETURNING file_id
     )
     DELETE FROM relay_file_chunks c USING f WHERE c.file_id = f.file_id";

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
    ("BACKEND_BUSY", BACKEND_BUSY),
    ("LIVE_NODES", LIVE_NODES),
    ("INSERT_LOCK", INSERT_LOCK),
    ("INSERT_TASKS", INSERT_TASKS),
    ("IDEMPOTENT_LOOKUP", IDEMPOTENT_LOOKUP),
    ("CLAIM", CLAIM),
    ("CLAIM_KINDS", CLAIM_KINDS),
    ("POLICY_LOCK", POLICY_LOCK),
    ("SET_POLICY", SET_POLICY),
    ("REHOLD", REHOLD),
    ("KIND_LOCKS", KIND_LOCKS),
    ("CLAIM_LIMITED", CLAIM_LIMITED),
    ("KIND_BACKLOG", KIND_BACKLOG),
    ("LANE_BACKLOG", LANE_BACKLOG),
    ("KIND_GAUGES", KIND_GAUGES),
    ("LIMITED_PENDING", LIMITED_PENDING),
    ("POLICY_CHANGES", POLICY_CHANGES),
    ("KINDS", KINDS),
    ("UNCLAIM", UNCLAIM),
    ("RELEASE_ORPHANS", RELEASE_ORPHANS),
    ("END_LOST_BACKEND", END_LOST_BACKEND),
    ("ADOPT_ORPHANS", ADOPT_ORPHANS),
    ("TAKE_SESSION", TAKE_SESSION),
    ("SESSION_ATTEMPTS", SESSION_ATTEMPTS),
    ("ATTEMPT_STARTED", ATTEMPT_STARTED),
    ("ATTEMPT_ENDED", ATTEMPT_ENDED),
    ("GET_TASKS", GET_TASKS),
    ("GET_TASKS_PAYLOAD", GET_TASKS_PAYLOAD),
    ("FINISHED_AMONG", FINISHED_AMONG),
    ("LIST_TASKS", LIST_TASKS),
    ("CANCEL", CANCEL),
    ("RERUN", RERUN),
    ("RERUN_MANY", RERUN_MANY),
    ("FAIL_UNPLACEABLE", FAIL_UNPLACEABLE),
    ("FORGET_NODES", FORGET_NODES),
    ("SWEEP_TIMEOUT", SWEEP_TIMEOUT),
    ("FAIR_SWEEP", FAIR_SWEEP),
    ("STALE_STATS", STALE_STATS),
    ("ANALYZE_TIMEOUT", ANALYZE_TIMEOUT),
    ("ANALYZE_QUEUE", ANALYZE_QUEUE),
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
    ("FILE_ABORT", FILE_ABORT),
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
    fn retention_deletes_the_batch_its_node_counts_on() {
        assert!(RETENTION.contains(&format!("LIMIT {RETENTION_BATCH} ")));
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
