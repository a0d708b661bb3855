//! The database schema and its versioned migrations.
//!
//! [`migrate`] runs at every start, on every node: one transaction that first takes
//! `pg_advisory_xact_lock(MIGRATION_LOCK)`, so nodes starting together apply each migration
//! exactly once (the others wait, then find it recorded in `relay_schema`). A database whose
//! schema is newer than this build knows is refused rather than used.
//!
//! Times are Unix milliseconds in `int8` columns ending in `_ms`, like the rest of relay; the
//! database's own clock (`relay_now_ms()`) is used only for node leases, so clock skew between
//! nodes cannot kill a live node. docs/cluster.md explains each table.

use super::wire::{Conn, PgError};

/// The advisory lock key of migrations ("relay" in ASCII).
pub const MIGRATION_LOCK: i64 = 0x72_65_6c_61_79;

/// `(version, description, SQL)`, in order. A migration is never edited once released: add one.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "tasks, pending, nodes, workers, tokens, files", V1),
    (2, "listing scans one index; an index of the waiting tasks that can fail", V2),
    (3, "one core over a task store: running attempts, exact pending counts, HOT state changes", V3),
    (4, "priorities: pending tasks are claimed in order of due time less their head start", V4),
    (5, "retry policies per task", V5),
    (6, "re-runs of failed and canceled tasks", V6),
    (7, "worker sessions: a running attempt names its worker's session", V7),
    (8, "kind policies: concurrency, rate, pause", V8),
    (9, "a held worker session's row says until when it may resume", V9),
    (10, "fair shares: tasks keep their submitter and key", V10),
    (11, "fair shares: claims rotate over submitters and keys", V11),
    (12, "per-key limits: running attempts and token buckets per lane", V12),
    (13, "the rotation walks lanes in stamp order and stops early", V13),
    (14, "the rotation probes each lane for a claimable task on its index", V14),
    (15, "the rotation reads lane buckets and running counts by subquery: lanes stay in stamp order", V15),
    (16, "pending tasks counted per kind by triggers", V16),
    (17, "a held kind's pending tasks are out of the index a claim of every kind walks", V17),
];

/// The newest version this build knows.
pub fn latest_version() -> i32 {
    MIGRATIONS.last().map_or(0, |m| m.0)
}

const V1: &str = r#"
CREATE FUNCTION relay_now_ms() RETURNS int8 LANGUAGE sql STABLE
    AS $$ SELECT (extract(epoch FROM now()) * 1000)::int8 $$;

-- Every task from submit until TASK_TTL after it finished. The row is the task's one source of
-- truth; `attempt` and `owner_node` fence every write of an attempt's outcome.
CREATE TABLE relay_tasks (
    id            uuid PRIMARY KEY,
    seq           int8 GENERATED ALWAYS AS IDENTITY,   -- submission order, cluster-wide
    status        text NOT NULL CHECK (status IN ('pending', 'dispatched', 'done', 'failed', 'canceled')),
    kind          text,                                -- payload.kind; NULL when none
    payload       text NOT NULL,                       -- the payload's JSON text, as received
    queue         boolean NOT NULL,                    -- waits for a worker instead of failing
    timeout_ms    int8,                                -- per-task TASK_TIMEOUT override
    max_retries   int4,                                -- per-task MAX_RETRIES override
    created_ms    int8 NOT NULL,
    run_at_ms     int8 NOT NULL,                       -- due time (= created_ms unless scheduled)
    finished_ms   int8,                                -- set once final
    attempt       int4 NOT NULL DEFAULT 0,             -- attempts started; the fencing number
    owner_node    uuid,                                -- node running attempt `attempt`; NULL unless dispatched
    tried         uuid[] NOT NULL DEFAULT '{}',        -- client ids of every worker that was sent it
    attempt_log   jsonb NOT NULL DEFAULT '[]',         -- SPEC §4 attempt_log entries, plus "node"
    result        text,                                -- worker data JSON text, when done
    error         text,                                -- final error, when failed
    client_id     uuid,                                -- worker that finished it (or last tried)
    client_ip     text,
    idem_owner    text,                                -- token identity: 'root' or the JWT jti
    idem_key      text                                 -- Idempotency-Key
) WITH (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);
CREATE UNIQUE INDEX relay_tasks_idem ON relay_tasks (idem_owner, idem_key) WHERE idem_key IS NOT NULL;
CREATE INDEX relay_tasks_list ON relay_tasks (created_ms DESC, seq DESC);
CREATE INDEX relay_tasks_list_status ON relay_tasks (status, created_ms DESC, seq DESC);
CREATE INDEX relay_tasks_list_kind ON relay_tasks (kind, created_ms DESC, seq DESC);
CREATE INDEX relay_tasks_finished ON relay_tasks (finished_ms) WHERE finished_ms IS NOT NULL;
CREATE INDEX relay_tasks_owner ON relay_tasks (owner_node) WHERE status = 'dispatched';

-- The small hot table of tasks waiting for a worker: inserted on submit and on retry, deleted
-- by the claim (FOR UPDATE SKIP LOCKED). Never updated, so it stays small and vacuum-cheap.
CREATE TABLE relay_pending (
    task_id        uuid PRIMARY KEY,
    due_ms         int8 NOT NULL,
    seq            int8 NOT NULL,
    kind           text,
    queue          boolean NOT NULL,
    tried          uuid[] NOT NULL DEFAULT '{}',       -- client ids of workers already tried
    payload_bytes  int4 NOT NULL                       -- for MAX_PENDING_BYTES
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 2000,
        autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 20000);
CREATE INDEX relay_pending_due ON relay_pending (due_ms, seq);
CREATE INDEX relay_pending_kind_due ON relay_pending (kind, due_ms, seq);

-- Task counts for /healthz without counting rows: statement-level triggers on relay_tasks add
-- each statement's net change per status to the row of the node that ran it (the session's
-- `relay.node_id`; the zero UUID for other sessions), so nodes never contend for one counter
-- row. Every path is counted, the housekeeping and an operator's hand edits included; the sum
-- over all rows, dead nodes' included, is the cluster-wide count.
CREATE TABLE relay_counters (
    node_id       uuid NOT NULL,
    status        text NOT NULL,
    n             int8 NOT NULL,
    PRIMARY KEY (node_id, status)
);
CREATE FUNCTION relay_counter_node() RETURNS uuid LANGUAGE sql STABLE AS $$
    SELECT coalesce(nullif(current_setting('relay.node_id', true), ''),
                    '00000000-0000-0000-0000-000000000000')::uuid $$;
CREATE FUNCTION relay_count_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO relay_counters (node_id, status, n)
    SELECT relay_counter_node(), status, count(*) FROM new_rows GROUP BY status
    ON CONFLICT (node_id, status) DO UPDATE SET n = relay_counters.n + excluded.n;
    RETURN NULL;
END $$;
CREATE FUNCTION relay_count_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO relay_counters (node_id, status, n)
    SELECT relay_counter_node(), status, sum(d) FROM (
        SELECT status, 1 AS d FROM new_rows UNION ALL SELECT status, -1 FROM old_rows) x
    GROUP BY status HAVING sum(d) <> 0
    ON CONFLICT (node_id, status) DO UPDATE SET n = relay_counters.n + excluded.n;
    RETURN NULL;
END $$;
CREATE FUNCTION relay_count_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO relay_counters (node_id, status, n)
    SELECT relay_counter_node(), status, -count(*) FROM old_rows GROUP BY status
    ON CONFLICT (node_id, status) DO UPDATE SET n = relay_counters.n + excluded.n;
    RETURN NULL;
END $$;
CREATE TRIGGER relay_tasks_count_insert AFTER INSERT ON relay_tasks
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION relay_count_insert();
CREATE TRIGGER relay_tasks_count_update AFTER UPDATE ON relay_tasks
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION relay_count_update();
CREATE TRIGGER relay_tasks_count_delete AFTER DELETE ON relay_tasks
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION relay_count_delete();

-- Node heartbeats. UNLOGGED: rewritten every second, worthless after a database crash (the
-- table is then empty until each node's next heartbeat; see the reaper's grace rule).
CREATE UNLOGGED TABLE relay_nodes (
    node_id       uuid PRIMARY KEY,
    name          text NOT NULL,
    started_ms    int8 NOT NULL,
    heartbeat_ms  int8 NOT NULL,                       -- database clock (relay_now_ms())
    version       text NOT NULL
);

-- The workers of every node, for /clients. UNLOGGED for the same reason; each node rewrites
-- its own rows, and a dead node's rows go with it.
CREATE UNLOGGED TABLE relay_workers (
    client_id     uuid PRIMARY KEY,
    node_id       uuid NOT NULL,
    ip            text NOT NULL,
    connected_ms  int8 NOT NULL,
    kinds         text[],                              -- NULL: takes every kind
    concurrency   int4,                                -- NULL: unlimited (no hello)
    in_flight     int4 NOT NULL,
    active        boolean NOT NULL,
    version       text
);
CREATE INDEX relay_workers_node ON relay_workers (node_id);

-- The scoped-token registry (SPEC §6): no token material, only what identifies a token.
-- `changed` grows on every insert and revoke, so nodes refresh their cache incrementally.
CREATE SEQUENCE relay_tokens_changed;
CREATE TABLE relay_tokens (
    jti           text PRIMARY KEY,
    name          text NOT NULL,
    kinds         text[] NOT NULL,
    created_ms    int8 NOT NULL,
    expires_ms    int8 NOT NULL,
    revoked_ms    int8,
    changed       int8 NOT NULL DEFAULT nextval('relay_tokens_changed')
);
CREATE INDEX relay_tokens_changed_idx ON relay_tokens (changed);

-- Uploaded files, readable through every node: metadata, then the bytes in chunks.
CREATE TABLE relay_files (
    file_id       uuid PRIMARY KEY,
    filename      text NOT NULL,
    content_type  text NOT NULL,
    size          int8 NOT NULL DEFAULT 0,
    sha256        text,                                -- set when complete
    chunk_bytes   int4 NOT NULL,
    created_ms    int8 NOT NULL,
    expires_ms    int8 NOT NULL,
    complete      boolean NOT NULL DEFAULT false
);
CREATE INDEX relay_files_expires ON relay_files (expires_ms);
CREATE TABLE relay_file_chunks (
    file_id       uuid NOT NULL,
    n             int4 NOT NULL,
    data          bytea NOT NULL,
    PRIMARY KEY (file_id, n)
);
-- Files are often compressed already: store chunks out of line without trying to compress.
ALTER TABLE relay_file_chunks ALTER COLUMN data SET STORAGE EXTERNAL;
"#;

/// Version 2 (measured under load, docs/cluster.md §4): the listing now walks the one
/// `relay_tasks_list` index with a bounded scan (as a single node does), so the per-status and
/// per-kind listing indexes go — each cost two index insertions on every status change of every
/// task. And the housekeeping that fails waiting tasks nobody can take looks only at those that
/// can fail (plain submits and retries), not at every queued or scheduled task.
const V2: &str = r#"
DROP INDEX relay_tasks_list_status;
DROP INDEX relay_tasks_list_kind;
CREATE INDEX relay_pending_fragile ON relay_pending (due_ms) WHERE NOT queue OR cardinality(tried) > 0;
"#;

/// Version 3 (the one-core seam, docs/cluster.md §4): a task's state changes touch no index of
/// `relay_tasks` (its only indexes are the key, the idempotency key and the submission order,
/// none of which a state change moves), so they are HOT updates; the attempts running on each
/// node are rows of their own (`relay_running`: the dead-node reaper's index and the fencing of
/// orphans), and the pending tasks are counted per node by triggers, so an insert can check
/// MAX_PENDING exactly under one advisory lock.
const V3: &str = r#"
CREATE TABLE relay_running (
    task_id       uuid PRIMARY KEY,
    owner_node    uuid NOT NULL,
    attempt       int4 NOT NULL
);
INSERT INTO relay_running (task_id, owner_node, attempt)
    SELECT id, owner_node, attempt FROM relay_tasks WHERE status = 'dispatched' AND owner_node IS NOT NULL;
DROP INDEX relay_tasks_owner;
DROP INDEX relay_tasks_finished;
DROP INDEX relay_tasks_list;
CREATE UNIQUE INDEX relay_tasks_seq ON relay_tasks (seq);

CREATE TABLE relay_pending_counts (
    node_id       uuid PRIMARY KEY,
    n             int8 NOT NULL,
    bytes         int8 NOT NULL
);
INSERT INTO relay_pending_counts (node_id, n, bytes)
    SELECT '00000000-0000-0000-0000-000000000000'::uuid, count(*), coalesce(sum(payload_bytes), 0) FROM relay_pending;
CREATE FUNCTION relay_pending_count_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO relay_pending_counts (node_id, n, bytes)
    SELECT relay_counter_node(), count(*), coalesce(sum(payload_bytes), 0) FROM new_rows HAVING count(*) > 0
    ON CONFLICT (node_id) DO UPDATE SET n = relay_pending_counts.n + excluded.n,
        bytes = relay_pending_counts.bytes + excluded.bytes;
    RETURN NULL;
END $$;
CREATE FUNCTION relay_pending_count_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO relay_pending_counts (node_id, n, bytes)
    SELECT relay_counter_node(), -count(*), -coalesce(sum(payload_bytes), 0) FROM old_rows HAVING count(*) > 0
    ON CONFLICT (node_id) DO UPDATE SET n = relay_pending_counts.n + excluded.n,
        bytes = relay_pending_counts.bytes + excluded.bytes;
    RETURN NULL;
END $$;
CREATE TRIGGER relay_pending_count_insert AFTER INSERT ON relay_pending
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION relay_pending_count_insert();
CREATE TRIGGER relay_pending_count_delete AFTER DELETE ON relay_pending
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION relay_pending_count_delete();
"#;

/// Version 4 (SPEC §14 priorities): a task's `priority` (seconds of head start), and the
/// pending row's `ord_ms` (due time less the head start) that claims order by; the due time
/// itself still says when a task may run, and orders expiry.
const V4: &str = r#"
ALTER TABLE relay_tasks ADD COLUMN IF NOT EXISTS priority int4 NOT NULL DEFAULT 0;
ALTER TABLE relay_pending ADD COLUMN IF NOT EXISTS ord_ms int8;
UPDATE relay_pending SET ord_ms = due_ms WHERE ord_ms IS NULL;
ALTER TABLE relay_pending ALTER COLUMN ord_ms SET NOT NULL;
DROP INDEX IF EXISTS relay_pending_kind_due;
CREATE INDEX IF NOT EXISTS relay_pending_ord ON relay_pending (ord_ms, seq);
CREATE INDEX IF NOT EXISTS relay_pending_kind_ord ON relay_pending (kind, ord_ms, seq);
"#;

/// Version 5 (SPEC §13): a task's own retry policy (NULL: the node's configured default). A
/// retry waiting out its backoff needs no column: its pending row is due when the wait ends,
/// and its attempt_log entry says when (`next_attempt_ms`).
const V5: &str = r#"
ALTER TABLE relay_tasks ADD COLUMN IF NOT EXISTS retry_backoff_ms int8,
    ADD COLUMN IF NOT EXISTS retry_backoff_max_ms int8,
    ADD COLUMN IF NOT EXISTS retry_any_worker boolean;
"#;

/// Version 6 (SPEC §13 re-runs): how many times a task was run again, and the attempts before
/// its current run (whose retry budget starts after them).
const V6: &str = r#"
ALTER TABLE relay_tasks ADD COLUMN IF NOT EXISTS reruns int4 NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS rerun_base int4 NOT NULL DEFAULT 0;
"#;

/// Version 7 (SPEC §12): a running attempt of a session worker names the session (its secret
/// and worker id), the worker's client id and when it started, so that the worker may resume
/// it on any node, also after its node died, within RESUME_WINDOW of that node's heartbeat.
const V7: &str = r#"
ALTER TABLE relay_running ADD COLUMN IF NOT EXISTS session text,
    ADD COLUMN IF NOT EXISTS worker_id text,
    ADD COLUMN IF NOT EXISTS client_id uuid,
    ADD COLUMN IF NOT EXISTS started_ms int8;
CREATE INDEX IF NOT EXISTS relay_running_session ON relay_running (session) WHERE session IS NOT NULL;
"#;

/// Version 8 (SPEC §14 kind policies): one row per kind that has (or had) a policy; `changed`
/// grows on every change, so nodes read what changed since they last looked, every second. The
/// running attempts carry their kind (claims of a capped kind count them), and rate-limited
/// kinds have a token bucket row.
const V8: &str = r#"
CREATE SEQUENCE IF NOT EXISTS relay_kind_policies_changed;
CREATE TABLE IF NOT EXISTS relay_kind_policies (
    kind          text PRIMARY KEY,
    policy        text,                                -- the policy's JSON; NULL: removed
    changed       int8 NOT NULL DEFAULT nextval('relay_kind_policies_changed')
);
-- A kind's running attempts are counted from their rows (never a counter that can drift).
ALTER TABLE relay_running ADD COLUMN IF NOT EXISTS kind text;
UPDATE relay_running r SET kind = t.kind FROM relay_tasks t WHERE t.id = r.task_id AND r.kind IS NULL;
CREATE INDEX IF NOT EXISTS relay_running_kind ON relay_running (kind) WHERE kind IS NOT NULL;
-- The token bucket of each rate-limited kind, updated by claims under the kind's lock.
CREATE TABLE IF NOT EXISTS relay_kind_buckets (
    kind          text PRIMARY KEY,
    tokens        float8 NOT NULL,
    at_ms         int8 NOT NULL                        -- database clock (relay_now_ms())
);
"#;

/// Version 9 (SPEC §12): a worker row of a held session (its connection was lost) says until
/// when it may resume, for `/clients` on every node.
const V9: &str = r#"
ALTER TABLE relay_workers ADD COLUMN IF NOT EXISTS resumable_until_ms int8;
"#;

/// Version 10 (SPEC §14 fair shares): a task's submitter (`''`: the root token, else the
/// scoped token's jti) and fairness key (`''`: none), on the task, its pending row (claims rotate
/// over them) and its running row (per-key caps count them).
const V10: &str = r#"
ALTER TABLE relay_tasks ADD COLUMN IF NOT EXISTS submitter text NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS fair_key text NOT NULL DEFAULT '';
ALTER TABLE relay_pending ADD COLUMN IF NOT EXISTS submitter text NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS fair_key text NOT NULL DEFAULT '';
ALTER TABLE relay_running ADD COLUMN IF NOT EXISTS submitter text NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS fair_key text NOT NULL DEFAULT '';
"#;

/// Version 11 (SPEC §14 rotation, docs/cluster.md): a *lane* is (kind, submitter, key), named in
/// these tables by `coalesce('k' || kind, 'n')` (a kind, or `n` for tasks without one) so that
/// every column is a key column. Each lane with pending or running tasks has a row with the
/// stamp it was last served at (`relay_fair_stamp`: one counter for all kinds, as only stamps of
/// one kind are compared), and each (kind, submitter) too; a lane or submitter that is new joins
/// with the counter as it is, at the back. `relay_fair_kinds` names the kinds with two lanes or
/// more: only their claims rotate (a kind with one lane is claimed in plain order, as before).
/// The pending and running rows are indexed by lane.
const V11: &str = r#"
CREATE SEQUENCE IF NOT EXISTS relay_fair_stamp;
-- (Called once: a lane served next gets more than the `last_value` a new lane joins with.)
SELECT nextval('relay_fair_stamp');
CREATE TABLE IF NOT EXISTS relay_fair_lanes (
    kind          text NOT NULL,                       -- 'k' || kind, or 'n'
    submitter     text NOT NULL,
    fair_key      text NOT NULL,
    stamp         int8 NOT NULL,
    PRIMARY KEY (kind, submitter, fair_key)
);
CREATE TABLE IF NOT EXISTS relay_fair_submitters (
    kind          text NOT NULL,
    submitter     text NOT NULL,
    stamp         int8 NOT NULL,
    PRIMARY KEY (kind, submitter)
);
CREATE TABLE IF NOT EXISTS relay_fair_kinds (
    kind          text PRIMARY KEY
);
CREATE INDEX IF NOT EXISTS relay_pending_lane ON relay_pending (coalesce('k' || kind, 'n'), submitter, fair_key, ord_ms, seq);
CREATE INDEX IF NOT EXISTS relay_running_lane ON relay_running (coalesce('k' || kind, 'n'), submitter, fair_key);
-- The rotation of a claim (SPEC §14) over the lanes of the kinds `kinds` (as `relay_fair_lanes`
-- names them) with a task claimable at `now_ms` by one of `takers`: up to `2 lim` tasks in the
-- order the rotation hands them out — round robin over the kind's submitters (least recently
-- served first: `stamp`, then name), within a submitter over its lanes (the same way), within a
-- lane in priority order. Exact as long as no lane runs dry within the claim, which it allows
-- for: a lane's i-th task comes in the i-th round of its submitter's lanes, a submitter's t-th
-- in the t-th round of the kind's submitters. Only the first `lim` lanes a round robin of `lim`
-- dispatches can touch are read, `lim` tasks each. `eff` is the largest queue position (due time
-- less head start, submission) up to each task in its kind: kinds merge by it, as a node's
-- claim merges kinds by the head of each kind's rotation. A function of its own (PL/pgSQL)
-- so that its plan is cached apart from the claim's, and planned only when a kind rotates.
CREATE OR REPLACE FUNCTION relay_fair_rotation(kinds text[], now_ms int8, takers uuid[], lim int4)
RETURNS TABLE (task_id uuid, ord_ms int8, seq int8, fk text, submitter text, fair_key text, pos int8, eff int8[])
LANGUAGE plpgsql STABLE ROWS 8 AS $fn$
#variable_conflict use_column
BEGIN
  RETURN QUERY WITH lanes AS (
    SELECT l.kind AS fk, l.submitter, l.fair_key, l.stamp, s.stamp AS s_stamp
    FROM relay_fair_submitters s
    JOIN relay_fair_lanes l ON l.kind = s.kind AND l.submitter = s.submitter
    WHERE s.kind = ANY(kinds) AND EXISTS (SELECT 1 FROM relay_pending p
                  WHERE coalesce('k' || p.kind, 'n') = l.kind AND p.submitter = l.submitter
                    AND p.fair_key = l.fair_key AND p.ord_ms <= now_ms + 86400000 AND p.due_ms <= now_ms AND NOT (p.tried @> takers))
  ), ranked AS (
    SELECT lanes.*, dense_rank() OVER (PARTITION BY fk ORDER BY s_stamp, submitter) AS q,
           row_number() OVER (PARTITION BY fk, submitter ORDER BY stamp, fair_key) AS r
    FROM lanes
  ), touched AS (
    SELECT * FROM (SELECT ranked.*, row_number() OVER (PARTITION BY fk ORDER BY r, q) AS nth FROM ranked) x
    WHERE x.nth <= lim
  ), cand AS (
    SELECT f.fk, f.submitter, f.fair_key, f.q, f.r, x.task_id, x.ord_ms, x.seq,
           row_number() OVER (PARTITION BY f.fk, f.submitter, f.fair_key ORDER BY x.ord_ms, x.seq) AS i
    FROM touched f CROSS JOIN LATERAL (
      SELECT p.task_id, p.ord_ms, p.seq FROM relay_pending p
      WHERE coalesce('k' || p.kind, 'n') = f.fk AND p.submitter = f.submitter AND p.fair_key = f.fair_key
        AND p.ord_ms <= now_ms + 86400000 AND p.due_ms <= now_ms AND NOT (p.tried @> takers)
      ORDER BY p.ord_ms, p.seq LIMIT lim) x
  ), turns AS (
    SELECT cand.*, row_number() OVER (PARTITION BY fk, submitter ORDER BY i, r) AS t FROM cand
  ), rot AS (
    SELECT x.*, max(ARRAY[x.ord_ms, x.seq]) OVER (PARTITION BY x.fk ORDER BY x.pos ROWS UNBOUNDED PRECEDING) AS eff
    FROM (SELECT turns.*, row_number() OVER (PARTITION BY fk ORDER BY t, q) AS pos FROM turns) x
    WHERE x.pos <= 2 * lim
  )
  SELECT rot.task_id, rot.ord_ms, rot.seq, rot.fk, rot.submitter, rot.fair_key, rot.pos, rot.eff FROM rot;
END $fn$;
-- A claim's choice once a kind in it rotates: the plain walk's tasks (`p_*`, locked by the
-- claim) of kinds that do not rotate, and the rotation of the kinds `mk`, merged by queue
-- position (a kind by the head of its rotation) — the first `lim`, locked (rows another claim
-- holds are skipped, and the rotation's next ones taken); the lanes and submitters served get
-- new stamps in the order they were served (rows upserted in key order: claims never deadlock).
CREATE OR REPLACE FUNCTION relay_fair_pick(mk text[], now_ms int8, takers uuid[], lim int4, p_ids uuid[],
                                           p_kinds text[], p_ord int8[], p_seq int8[])
RETURNS TABLE (task_id uuid, eff int8[], fk text, pos int8)
LANGUAGE plpgsql ROWS 8 AS $fn$
#variable_conflict use_column
BEGIN
  RETURN QUERY WITH plain AS (
    SELECT x.id, x.o, x.s FROM unnest(p_ids, p_kinds, p_ord, p_seq) AS x(id, kind, o, s)
    WHERE NOT (coalesce('k' || x.kind, 'n') = ANY(mk))
  ), rot_locked AS (
    SELECT p.task_id, rot.fk, rot.submitter, rot.fair_key, rot.pos, rot.eff
    FROM relay_fair_rotation(mk, now_ms, takers, lim) rot JOIN relay_pending p ON p.task_id = rot.task_id
    ORDER BY rot.eff, rot.fk, rot.pos LIMIT lim
    FOR UPDATE OF p SKIP LOCKED
  ), c AS (
    SELECT plain.id AS task_id, NULL::text AS fk, NULL::text AS submitter, NULL::text AS fair_key, 0::int8 AS pos,
           ARRAY[plain.o, plain.s] AS eff FROM plain
    UNION ALL SELECT r.task_id, r.fk, r.submitter, r.fair_key, r.pos, r.eff FROM rot_locked r
    ORDER BY eff, fk, pos LIMIT lim
  ), served AS (
    SELECT x.fk, x.submitter, x.fair_key, nextval('relay_fair_stamp') AS stamp
    FROM (SELECT * FROM c WHERE c.fk IS NOT NULL ORDER BY c.fk, c.pos) x
  ), ls AS (
    INSERT INTO relay_fair_lanes AS l (kind, submitter, fair_key, stamp)
    SELECT v.fk, v.submitter, v.fair_key, max(v.stamp) FROM served v GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
    ON CONFLICT (kind, submitter, fair_key) DO UPDATE SET stamp = greatest(l.stamp, excluded.stamp)
  ), ss AS (
    INSERT INTO relay_fair_submitters AS s (kind, submitter, stamp)
    SELECT v.fk, v.submitter, max(v.stamp) FROM served v GROUP BY 1, 2 ORDER BY 1, 2
    ON CONFLICT (kind, submitter) DO UPDATE SET stamp = greatest(s.stamp, excluded.stamp)
  )
  SELECT c.task_id, c.eff, c.fk, c.pos FROM c;
END $fn$;
INSERT INTO relay_fair_lanes (kind, submitter, fair_key, stamp)
    SELECT coalesce('k' || kind, 'n'), submitter, fair_key, 0 FROM relay_pending
    UNION SELECT coalesce('k' || kind, 'n'), submitter, fair_key, 0 FROM relay_running
    ON CONFLICT DO NOTHING;
INSERT INTO relay_fair_submitters (kind, submitter, stamp)
    SELECT DISTINCT kind, submitter, 0 FROM relay_fair_lanes ON CONFLICT DO NOTHING;
INSERT INTO relay_fair_kinds (kind)
    SELECT kind FROM relay_fair_lanes GROUP BY kind HAVING count(*) > 1 ON CONFLICT DO NOTHING;
"#;

/// Version 12 (SPEC §14 per-key limits): `max_running_per_key` and `rate_per_key` hold per lane.
/// The rotation leaves out the lanes at their cap (counted from `relay_running`) or out of
/// tokens (`relay_lane_buckets`: one per lane a claim took from, kept until it would be full
/// again, `full_ms`), under the kind's lock like the kind's own limits.
const V12: &str = r#"
CREATE TABLE IF NOT EXISTS relay_lane_buckets (
    kind          text NOT NULL,                       -- as relay_fair_lanes names it
    submitter     text NOT NULL,
    fair_key      text NOT NULL,
    tokens        float8 NOT NULL,
    at_ms         int8 NOT NULL,                       -- database clock (relay_now_ms())
    full_ms       int8 NOT NULL,                       -- when it is full again, untouched
    PRIMARY KEY (kind, submitter, fair_key)
);
CREATE INDEX IF NOT EXISTS relay_lane_buckets_full ON relay_lane_buckets (full_ms);
-- The rotation with a room per lane: `caps` (running attempts per lane), `rates` (tokens per
-- ms) and `bursts`, one of each per kind of `kinds` (NULL: no limit). A lane's room is the
-- least of its cap less its attempts running on every node and the whole tokens of its bucket
-- (full when it has none); a lane without room is out of the rotation, the others go on.
CREATE OR REPLACE FUNCTION relay_fair_rotation(kinds text[], now_ms int8, takers uuid[], lim int4, caps int8[],
                                               rates float8[], bursts float8[])
RETURNS TABLE (task_id uuid, ord_ms int8, seq int8, fk text, submitter text, fair_key text, pos int8, eff int8[])
LANGUAGE plpgsql STABLE ROWS 8 AS $fn$
#variable_conflict use_column
BEGIN
  RETURN QUERY WITH lanes AS (
    SELECT l.kind AS fk, l.submitter, l.fair_key, l.stamp, s.stamp AS s_stamp,
           least(coalesce(k.cap - (SELECT count(*) FROM relay_running r
                                   WHERE coalesce('k' || r.kind, 'n') = l.kind AND r.submitter = l.submitter
                                     AND r.fair_key = l.fair_key), lim),
                 coalesce(floor(least(k.burst, coalesce(b.tokens + greatest(0, relay_now_ms() - b.at_ms) * k.per_ms,
                                                        k.burst)) + 1e-9)::int8, lim)) AS room
    FROM unnest(kinds, caps, rates, bursts) AS k(fk, cap, per_ms, burst)
    JOIN relay_fair_submitters s ON s.kind = k.fk
    JOIN relay_fair_lanes l ON l.kind = s.kind AND l.submitter = s.submitter
    LEFT JOIN relay_lane_buckets b ON b.kind = l.kind AND b.submitter = l.submitter AND b.fair_key = l.fair_key
    WHERE EXISTS (SELECT 1 FROM relay_pending p
                  WHERE coalesce('k' || p.kind, 'n') = l.kind AND p.submitter = l.submitter
                    AND p.fair_key = l.fair_key AND p.ord_ms <= now_ms + 86400000 AND p.due_ms <= now_ms AND NOT (p.tried @> takers))
  ), ranked AS (
    SELECT lanes.*, dense_rank() OVER (PARTITION BY fk ORDER BY s_stamp, submitter) AS q,
           row_number() OVER (PARTITION BY fk, submitter ORDER BY stamp, fair_key) AS r
    FROM lanes WHERE lanes.room > 0
  ), touched AS (
    SELECT * FROM (SELECT ranked.*, row_number() OVER (PARTITION BY fk ORDER BY r, q) AS nth FROM ranked) x
    WHERE x.nth <= lim
  ), cand AS (
    SELECT f.fk, f.submitter, f.fair_key, f.q, f.r, f.room, x.task_id, x.ord_ms, x.seq,
           row_number() OVER (PARTITION BY f.fk, f.submitter, f.fair_key ORDER BY x.ord_ms, x.seq) AS i
    FROM touched f CROSS JOIN LATERAL (
      SELECT p.task_id, p.ord_ms, p.seq FROM relay_pending p
      WHERE coalesce('k' || p.kind, 'n') = f.fk AND p.submitter = f.submitter AND p.fair_key = f.fair_key
        AND p.ord_ms <= now_ms + 86400000 AND p.due_ms <= now_ms AND NOT (p.tried @> takers)
      ORDER BY p.ord_ms, p.seq LIMIT least(lim, f.room)) x
  ), turns AS (
    SELECT cand.*, row_number() OVER (PARTITION BY fk, submitter ORDER BY i, r) AS t FROM cand
  ), rot AS (
    SELECT x.*, max(ARRAY[x.ord_ms, x.seq]) OVER (PARTITION BY x.fk ORDER BY x.pos ROWS UNBOUNDED PRECEDING) AS eff
    FROM (SELECT turns.*, row_number() OVER (PARTITION BY fk ORDER BY t, q) AS pos FROM turns) x
    WHERE x.pos <= 2 * lim
  )
  SELECT rot.task_id, rot.ord_ms, rot.seq, rot.fk, rot.submitter, rot.fair_key, rot.pos, rot.eff FROM rot;
END $fn$;
DROP FUNCTION IF EXISTS relay_fair_rotation(text[], int8, uuid[], int4);
CREATE OR REPLACE FUNCTION relay_fair_pick(mk text[], now_ms int8, takers uuid[], lim int4, p_ids uuid[],
                                           p_kinds text[], p_ord int8[], p_seq int8[])
RETURNS TABLE (task_id uuid, eff int8[], fk text, pos int8)
LANGUAGE plpgsql ROWS 8 AS $fn$
#variable_conflict use_column
BEGIN
  RETURN QUERY WITH plain AS (
    SELECT x.id, x.o, x.s FROM unnest(p_ids, p_kinds, p_ord, p_seq) AS x(id, kind, o, s)
    WHERE NOT (coalesce('k' || x.kind, 'n') = ANY(mk))
  ), rot_locked AS (
    SELECT p.task_id, rot.fk, rot.submitter, rot.fair_key, rot.pos, rot.eff
    FROM relay_fair_rotation(mk, now_ms, takers, lim, NULL, NULL, NULL) rot JOIN relay_pending p ON p.task_id = rot.task_id
    ORDER BY rot.eff, rot.fk, rot.pos LIMIT lim
    FOR UPDATE OF p SKIP LOCKED
  ), c AS (
    SELECT plain.id AS task_id, NULL::text AS fk, NULL::text AS submitter, NULL::text AS fair_key, 0::int8 AS pos,
           ARRAY[plain.o, plain.s] AS eff FROM plain
    UNION ALL SELECT r.task_id, r.fk, r.submitter, r.fair_key, r.pos, r.eff FROM rot_locked r
    ORDER BY eff, fk, pos LIMIT lim
  ), served AS (
    SELECT x.fk, x.submitter, x.fair_key, nextval('relay_fair_stamp') AS stamp
    FROM (SELECT * FROM c WHERE c.fk IS NOT NULL ORDER BY c.fk, c.pos) x
  ), ls AS (
    INSERT INTO relay_fair_lanes AS l (kind, submitter, fair_key, stamp)
    SELECT v.fk, v.submitter, v.fair_key, max(v.stamp) FROM served v GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
    ON CONFLICT (kind, submitter, fair_key) DO UPDATE SET stamp = greatest(l.stamp, excluded.stamp)
  ), ss AS (
    INSERT INTO relay_fair_submitters AS s (kind, submitter, stamp)
    SELECT v.fk, v.submitter, max(v.stamp) FROM served v GROUP BY 1, 2 ORDER BY 1, 2
    ON CONFLICT (kind, submitter) DO UPDATE SET stamp = greatest(s.stamp, excluded.stamp)
  )
  SELECT c.task_id, c.eff, c.fk, c.pos FROM c;
END $fn$;
"#;

/// Version 13 (measured: a claim over 1,000 keys probed every lane, 27 ms): the rotation walks
/// the submitters of a kind and the lanes of each in stamp order on indexes, and stops at the
/// first `lim` with a claimable task and room, of each: the lanes a round robin of `lim`
/// dispatches can touch are among them.
const V13: &str = r#"
CREATE INDEX IF NOT EXISTS relay_fair_submitters_stamp ON relay_fair_submitters (kind, stamp, submitter);
CREATE INDEX IF NOT EXISTS relay_fair_lanes_stamp ON relay_fair_lanes (kind, submitter, stamp, fair_key);
CREATE OR REPLACE FUNCTION relay_fair_rotation(kinds text[], now_ms int8, takers uuid[], lim int4, caps int8[],
                                               rates float8[], bursts float8[])
RETURNS TABLE (task_id uuid, ord_ms int8, seq int8, fk text, submitter text, fair_key text, pos int8, eff int8[])
LANGUAGE plpgsql STABLE ROWS 8 AS $fn$
#variable_conflict use_column
BEGIN
  RETURN QUERY WITH lanes AS (
    SELECT w.fk, w.submitter, w.fair_key, w.stamp, w.room, s.stamp AS s_stamp
    FROM unnest(kinds, caps, rates, bursts) AS k(fk, cap, per_ms, burst)
    CROSS JOIN LATERAL (
      SELECT s.* FROM relay_fair_submitters s
      WHERE s.kind = k.fk AND EXISTS (SELECT 1 FROM (
          SELECT l.kind AS fk, l.submitter, l.fair_key, l.stamp,
                 least(coalesce(k.cap - (SELECT count(*) FROM relay_running r
                                     WHERE coalesce('k' || r.kind, 'n') = l.kind AND r.submitter = l.submitter
                                       AND r.fair_key = l.fair_key), lim),
                   coalesce(floor(least(k.burst, coalesce(b.tokens + greatest(0, relay_now_ms() - b.at_ms) * k.per_ms,
                                                          k.burst)) + 1e-9)::int8, lim)) AS room
          FROM relay_fair_lanes l
          LEFT JOIN relay_lane_buckets b ON b.kind = l.kind AND b.submitter = l.submitter AND b.fair_key = l.fair_key
          WHERE l.kind = s.kind AND l.submitter = s.submitter
            AND EXISTS (SELECT 1 FROM relay_pending p
                        WHERE coalesce('k' || p.kind, 'n') = l.kind AND p.submitter = l.submitter
                          AND p.fair_key = l.fair_key AND p.ord_ms <= now_ms + 86400000 AND p.due_ms <= now_ms AND NOT (p.tried @> takers))
          ORDER BY l.stamp, l.fair_key) x
        WHERE x.room > 0 LIMIT 1)
      ORDER BY s.stamp, s.submitter LIMIT lim) s
    CROSS JOIN LATERAL (SELECT x.* FROM (
        SELECT l.kind AS fk, l.submitter, l.fair_key, l.stamp,
               least(coalesce(k.cap - (SELECT count(*) FROM relay_running r
                                     WHERE coalesce('k' || r.kind, 'n') = l.kind AND r.submitter = l.submitter
                                       AND r.fair_key = l.fair_key), lim),
                   coalesce(floor(least(k.burst, coalesce(b.tokens + greatest(0, relay_now_ms() - b.at_ms) * k.per_ms,
                                                          k.burst)) + 1e-9)::int8, lim)) AS room
        FROM relay_fair_lanes l
        LEFT JOIN relay_lane_buckets b ON b.kind = l.kind AND b.submitter = l.submitter AND b.fair_key = l.fair_key
        WHERE l.kind = s.kind AND l.submitter = s.submitter
          AND EXISTS (SELECT 1 FROM relay_pending p
                      WHERE coalesce('k' || p.kind, 'n') = l.kind AND p.submitter = l.submitter
                        AND p.fair_key = l.fair_key AND p.ord_ms <= now_ms + 86400000 AND p.due_ms <= now_ms AND NOT (p.tried @> takers))
        ORDER BY l.stamp, l.fair_key) x
      WHERE x.room > 0 LIMIT lim) w
  ), ranked AS (
    SELECT lanes.*, dense_rank() OVER (PARTITION BY fk ORDER BY s_stamp, submitter) AS q,
           row_number() OVER (PARTITION BY fk, submitter ORDER BY stamp, fair_key) AS r
    FROM lanes
  ), touched AS (
    SELECT * FROM (SELECT ranked.*, row_number() OVER (PARTITION BY fk ORDER BY r, q) AS nth FROM ranked) x
    WHERE x.nth <= lim
  ), cand AS (
    SELECT f.fk, f.submitter, f.fair_key, f.q, f.r, f.room, x.task_id, x.ord_ms, x.seq,
           row_number() OVER (PARTITION BY f.fk, f.submitter, f.fair_key ORDER BY x.ord_ms, x.seq) AS i
    FROM touched f CROSS JOIN LATERAL (
      SELECT p.task_id, p.ord_ms, p.seq FROM relay_pending p
      WHERE coalesce('k' || p.kind, 'n') = f.fk AND p.submitter = f.submitter AND p.fair_key = f.fair_key
        AND p.ord_ms <= now_ms + 86400000 AND p.due_ms <= now_ms AND NOT (p.tried @> takers)
      ORDER BY p.ord_ms, p.seq LIMIT least(lim, f.room)) x
  ), turns AS (
    SELECT cand.*, row_number() OVER (PARTITION BY fk, submitter ORDER BY i, r) AS t FROM cand
  ), rot AS (
    SELECT x.*, max(ARRAY[x.ord_ms, x.seq]) OVER (PARTITION BY x.fk ORDER BY x.pos ROWS UNBOUNDED PRECEDING) AS eff
    FROM (SELECT turns.*, row_number() OVER (PARTITION BY fk ORDER BY t, q) AS pos FROM turns) x
    WHERE x.pos <= 2 * lim
  )
  SELECT rot.task_id, rot.ord_ms, rot.seq, rot.fk, rot.submitter, rot.fair_key, rot.pos, rot.eff FROM rot;
END $fn$;
"#;

/// Version 14 (measured: 5,000 keys of a kind with `max_running_per_key`, two nodes, before the
/// first autoanalyze of the tables: a claim of limited kinds took 1.1–1.7 s, 11–13 claims in
/// 15 s; with this, 96–130 ms on average over four runs, 24–121 claims, one claim of 2.7 s in
/// the function not explained yet): whether a lane has a claimable task is a subquery probed per lane on
/// `relay_pending_lane`, not an `EXISTS` the planner may make a semi join. On statistics that
/// say the lanes are few (the tables not analyzed since they filled) it made that semi join a
/// nested loop that rescanned the submitter's whole queue for every lane, matching the key by
/// filter (2,000,000 rows removed for 2,000 lanes), under the kinds' locks.
const V14: &str = r#"
CREATE OR REPLACE FUNCTION relay_fair_rotation(kinds text[], now_ms int8, takers uuid[], lim int4, caps int8[],
                                               rates float8[], bursts float8[])
RETURNS TABLE (task_id uuid, ord_ms int8, seq int8, fk text, submitter text, fair_key text, pos int8, eff int8[])
LANGUAGE plpgsql STABLE ROWS 8 AS $fn$
#variable_conflict use_column
BEGIN
  RETURN QUERY WITH lanes AS (
    SELECT w.fk, w.submitter, w.fair_key, w.stamp, w.room, s.stamp AS s_stamp
    FROM unnest(kinds, caps, rates, bursts) AS k(fk, cap, per_ms, burst)
    CROSS JOIN LATERAL (
      SELECT s.* FROM relay_fair_submitters s
      WHERE s.kind = k.fk AND EXISTS (SELECT 1 FROM (
          SELECT l.kind AS fk, l.submitter, l.fair_key, l.stamp,
                 least(coalesce(k.cap - (SELECT count(*) FROM relay_running r
                                     WHERE coalesce('k' || r.kind, 'n') = l.kind AND r.submitter = l.submitter
                                       AND r.fair_key = l.fair_key), lim),
                   coalesce(floor(least(k.burst, coalesce(b.tokens + greatest(0, relay_now_ms() - b.at_ms) * k.per_ms,
                                                          k.burst)) + 1e-9)::int8, lim)) AS room
          FROM relay_fair_lanes l
          LEFT JOIN relay_lane_buckets b ON b.kind = l.kind AND b.submitter = l.submitter AND b.fair_key = l.fair_key
          WHERE l.kind = s.kind AND l.submitter = s.submitter
            AND (SELECT true FROM relay_pending p
                 WHERE coalesce('k' || p.kind, 'n') = l.kind AND p.submitter = l.submitter
                   AND p.fair_key = l.fair_key AND p.ord_ms <= now_ms + 86400000 AND p.due_ms <= now_ms AND NOT (p.tried @> takers)
                 LIMIT 1)
          ORDER BY l.stamp, l.fair_key) x
        WHERE x.room > 0 LIMIT 1)
      ORDER BY s.stamp, s.submitter LIMIT lim) s
    CROSS JOIN LATERAL (SELECT x.* FROM (
        SELECT l.kind AS fk, l.submitter, l.fair_key, l.stamp,
               least(coalesce(k.cap - (SELECT count(*) FROM relay_running r
                                     WHERE coalesce('k' || r.kind, 'n') = l.kind AND r.submitter = l.submitter
                                       AND r.fair_key = l.fair_key), lim),
                   coalesce(floor(least(k.burst, coalesce(b.tokens + greatest(0, relay_now_ms() - b.at_ms) * k.per_ms,
                                                          k.burst)) + 1e-9)::int8, lim)) AS room
        FROM relay_fair_lanes l
        LEFT JOIN relay_lane_buckets b ON b.kind = l.kind AND b.submitter = l.submitter AND b.fair_key = l.fair_key
        WHERE l.kind = s.kind AND l.submitter = s.submitter
          AND (SELECT true FROM relay_pending p
               WHERE coalesce('k' || p.kind, 'n') = l.kind AND p.submitter = l.submitter
                 AND p.fair_key = l.fair_key AND p.ord_ms <= now_ms + 86400000 AND p.due_ms <= now_ms AND NOT (p.tried @> takers)
               LIMIT 1)
        ORDER BY l.stamp, l.fair_key) x
      WHERE x.room > 0 LIMIT lim) w
  ), ranked AS (
    SELECT lanes.*, dense_rank() OVER (PARTITION BY fk ORDER BY s_stamp, submitter) AS q,
           row_number() OVER (PARTITION BY fk, submitter ORDER BY stamp, fair_key) AS r
    FROM lanes
  ), touched AS (
    SELECT * FROM (SELECT ranked.*, row_number() OVER (PARTITION BY fk ORDER BY r, q) AS nth FROM ranked) x
    WHERE x.nth <= lim
  ), cand AS (
    SELECT f.fk, f.submitter, f.fair_key, f.q, f.r, f.room, x.task_id, x.ord_ms, x.seq,
           row_number() OVER (PARTITION BY f.fk, f.submitter, f.fair_key ORDER BY x.ord_ms, x.seq) AS i
    FROM touched f CROSS JOIN LATERAL (
      SELECT p.task_id, p.ord_ms, p.seq FROM relay_pending p
      WHERE coalesce('k' || p.kind, 'n') = f.fk AND p.submitter = f.submitter AND p.fair_key = f.fair_key
        AND p.ord_ms <= now_ms + 86400000 AND p.due_ms <= now_ms AND NOT (p.tried @> takers)
      ORDER BY p.ord_ms, p.seq LIMIT least(lim, f.room)) x
  ), turns AS (
    SELECT cand.*, row_number() OVER (PARTITION BY fk, submitter ORDER BY i, r) AS t FROM cand
  ), rot AS (
    SELECT x.*, max(ARRAY[x.ord_ms, x.seq]) OVER (PARTITION BY x.fk ORDER BY x.pos ROWS UNBOUNDED PRECEDING) AS eff
    FROM (SELECT turns.*, row_number() OVER (PARTITION BY fk ORDER BY t, q) AS pos FROM turns) x
    WHERE x.pos <= 2 * lim
  )
  SELECT rot.task_id, rot.ord_ms, rot.seq, rot.fk, rot.submitter, rot.fair_key, rot.pos, rot.eff FROM rot;
END $fn$;
"#;

/// Version 15 (measured: 20,000 tasks over 10,000 fresh keys of a kind with
/// `max_running_per_key`, two nodes, before the first autoanalyze: a limited claim took up to
/// 0.4–1.4 s, every lane of the submitter read and sorted): a lane's per-key bucket and its
/// running count are subqueries probed per lane (and only when the kind has that limit), not a
/// join. On statistics from when the tables were empty the planner hashed the buckets' join,
/// which lost the lanes' stamp order from `relay_fair_lanes_stamp`: all the submitter's lanes
/// were probed and sorted before the first `lim` were taken. Now the lanes are read in index
/// order and the walk stops at the first `lim` with room and a claimable task, whatever the
/// statistics say.
const V15: &str = r#"
CREATE OR REPLACE FUNCTION relay_fair_rotation(kinds text[], now_ms int8, takers uuid[], lim int4, caps int8[],
                                               rates float8[], bursts float8[])
RETURNS TABLE (task_id uuid, ord_ms int8, seq int8, fk text, submitter text, fair_key text, pos int8, eff int8[])
LANGUAGE plpgsql STABLE ROWS 8 AS $fn$
#variable_conflict use_column
BEGIN
  RETURN QUERY WITH lanes AS (
    SELECT w.fk, w.submitter, w.fair_key, w.stamp, w.room, s.stamp AS s_stamp
    FROM unnest(kinds, caps, rates, bursts) AS k(fk, cap, per_ms, burst)
    CROSS JOIN LATERAL (
      SELECT s.* FROM relay_fair_submitters s
      WHERE s.kind = k.fk AND EXISTS (SELECT 1 FROM (
          SELECT l.kind AS fk, l.submitter, l.fair_key, l.stamp,
                 least(CASE WHEN k.cap IS NULL THEN lim
                            ELSE k.cap - (SELECT count(*) FROM relay_running r
                                          WHERE coalesce('k' || r.kind, 'n') = l.kind AND r.submitter = l.submitter
                                            AND r.fair_key = l.fair_key) END,
                       CASE WHEN k.per_ms IS NULL THEN lim
                            ELSE floor(least(k.burst, coalesce((SELECT b.tokens + greatest(0, relay_now_ms() - b.at_ms) * k.per_ms
                                                                FROM relay_lane_buckets b
                                                                WHERE b.kind = l.kind AND b.submitter = l.submitter
                                                                  AND b.fair_key = l.fair_key), k.burst)) + 1e-9)::int8 END) AS room
          FROM relay_fair_lanes l
          WHERE l.kind = s.kind AND l.submitter = s.submitter
            AND (SELECT true FROM relay_pending p
                 WHERE coalesce('k' || p.kind, 'n') = l.kind AND p.submitter = l.submitter
                   AND p.fair_key = l.fair_key AND p.ord_ms <= now_ms + 86400000 AND p.due_ms <= now_ms AND NOT (p.tried @> takers)
                 LIMIT 1)
          ORDER BY l.stamp, l.fair_key) x
        WHERE x.room > 0 LIMIT 1)
      ORDER BY s.stamp, s.submitter LIMIT lim) s
    CROSS JOIN LATERAL (SELECT x.* FROM (
        SELECT l.kind AS fk, l.submitter, l.fair_key, l.stamp,
               least(CASE WHEN k.cap IS NULL THEN lim
                          ELSE k.cap - (SELECT count(*) FROM relay_running r
                                        WHERE coalesce('k' || r.kind, 'n') = l.kind AND r.submitter = l.submitter
                                          AND r.fair_key = l.fair_key) END,
                     CASE WHEN k.per_ms IS NULL THEN lim
                          ELSE floor(least(k.burst, coalesce((SELECT b.tokens + greatest(0, relay_now_ms() - b.at_ms) * k.per_ms
                                                              FROM relay_lane_buckets b
                                                              WHERE b.kind = l.kind AND b.submitter = l.submitter
                                                                AND b.fair_key = l.fair_key), k.burst)) + 1e-9)::int8 END) AS room
        FROM relay_fair_lanes l
        WHERE l.kind = s.kind AND l.submitter = s.submitter
          AND (SELECT true FROM relay_pending p
               WHERE coalesce('k' || p.kind, 'n') = l.kind AND p.submitter = l.submitter
                 AND p.fair_key = l.fair_key AND p.ord_ms <= now_ms + 86400000 AND p.due_ms <= now_ms AND NOT (p.tried @> takers)
               LIMIT 1)
        ORDER BY l.stamp, l.fair_key) x
      WHERE x.room > 0 LIMIT lim) w
  ), ranked AS (
    SELECT lanes.*, dense_rank() OVER (PARTITION BY fk ORDER BY s_stamp, submitter) AS q,
           row_number() OVER (PARTITION BY fk, submitter ORDER BY stamp, fair_key) AS r
    FROM lanes
  ), touched AS (
    SELECT * FROM (SELECT ranked.*, row_number() OVER (PARTITION BY fk ORDER BY r, q) AS nth FROM ranked) x
    WHERE x.nth <= lim
  ), cand AS (
    SELECT f.fk, f.submitter, f.fair_key, f.q, f.r, f.room, x.task_id, x.ord_ms, x.seq,
           row_number() OVER (PARTITION BY f.fk, f.submitter, f.fair_key ORDER BY x.ord_ms, x.seq) AS i
    FROM touched f CROSS JOIN LATERAL (
      SELECT p.task_id, p.ord_ms, p.seq FROM relay_pending p
      WHERE coalesce('k' || p.kind, 'n') = f.fk AND p.submitter = f.submitter AND p.fair_key = f.fair_key
        AND p.ord_ms <= now_ms + 86400000 AND p.due_ms <= now_ms AND NOT (p.tried @> takers)
      ORDER BY p.ord_ms, p.seq LIMIT least(lim, f.room)) x
  ), turns AS (
    SELECT cand.*, row_number() OVER (PARTITION BY fk, submitter ORDER BY i, r) AS t FROM cand
  ), rot AS (
    SELECT x.*, max(ARRAY[x.ord_ms, x.seq]) OVER (PARTITION BY x.fk ORDER BY x.pos ROWS UNBOUNDED PRECEDING) AS eff
    FROM (SELECT turns.*, row_number() OVER (PARTITION BY fk ORDER BY t, q) AS pos FROM turns) x
    WHERE x.pos <= 2 * lim
  )
  SELECT rot.task_id, rot.ord_ms, rot.seq, rot.fk, rot.submitter, rot.fair_key, rot.pos, rot.eff FROM rot;
END $fn$;
"#;

/// Version 16 (measured at 300,000 pending tasks: `KIND_GAUGES` 92 ms once a second on every
/// node, `KINDS` 95–240 ms, each counting the rows of a kind): the pending tasks of each kind are
/// counted per node by statement-level triggers, as `relay_pending_counts` counts them all, so
/// `/kinds` and the kind gauges read kinds × nodes rows, however long the queue. Each row is the
/// net change that node's statements made (a task submitted on one node and claimed on another is
/// +1 on the first and −1 on the second): only a kind's sum over its rows means anything. Tasks
/// without a kind are not counted here. The triggers come before the backfill: `CREATE TRIGGER`
/// waits for the writes to `relay_pending` in flight (of nodes of an older build) and holds new
/// ones until this commits, so each pending row is counted once, by the backfill or by a trigger.
const V16: &str = r#"
CREATE TABLE IF NOT EXISTS relay_kind_pending (
    kind          text NOT NULL,
    node_id       uuid NOT NULL,
    n             int8 NOT NULL,
    PRIMARY KEY (kind, node_id)
);
-- (Upserts in kind order: two transactions of one node take its rows in the same order.)
CREATE OR REPLACE FUNCTION relay_kind_pending_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO relay_kind_pending (kind, node_id, n)
    SELECT kind, relay_counter_node(), count(*) FROM new_rows WHERE kind IS NOT NULL GROUP BY kind ORDER BY kind
    ON CONFLICT (kind, node_id) DO UPDATE SET n = relay_kind_pending.n + excluded.n;
    RETURN NULL;
END $$;
CREATE OR REPLACE FUNCTION relay_kind_pending_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO relay_kind_pending (kind, node_id, n)
    SELECT kind, relay_counter_node(), -count(*) FROM old_rows WHERE kind IS NOT NULL GROUP BY kind ORDER BY kind
    ON CONFLICT (kind, node_id) DO UPDATE SET n = relay_kind_pending.n + excluded.n;
    RETURN NULL;
END $$;
-- relay never changes a pending row's kind (its rows are inserted and deleted, other columns
-- may be updated); an operator's hand edit of it is counted all the same, by a row trigger that
-- only an UPDATE naming `kind` considers (a statement trigger would fire on every UPDATE, with
-- transition tables of all its rows).
CREATE OR REPLACE FUNCTION relay_kind_pending_rekind() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO relay_kind_pending (kind, node_id, n)
    SELECT k, relay_counter_node(), d FROM (VALUES (OLD.kind, -1::int8), (NEW.kind, 1::int8)) AS v(k, d)
    WHERE k IS NOT NULL ORDER BY k
    ON CONFLICT (kind, node_id) DO UPDATE SET n = relay_kind_pending.n + excluded.n;
    RETURN NULL;
END $$;
CREATE TRIGGER relay_pending_kind_count_insert AFTER INSERT ON relay_pending
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION relay_kind_pending_insert();
CREATE TRIGGER relay_pending_kind_count_delete AFTER DELETE ON relay_pending
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION relay_kind_pending_delete();
CREATE TRIGGER relay_pending_kind_count_rekind AFTER UPDATE OF kind ON relay_pending
    FOR EACH ROW WHEN (OLD.kind IS DISTINCT FROM NEW.kind) EXECUTE FUNCTION relay_kind_pending_rekind();
INSERT INTO relay_kind_pending (kind, node_id, n)
    SELECT kind, '00000000-0000-0000-0000-000000000000'::uuid, count(*) FROM relay_pending
    WHERE kind IS NOT NULL GROUP BY kind;
"#;

/// Version 17 (measured: 100,000 tasks of a paused kind, a claim for a worker that takes every
/// kind stepped over all of them — a sync task of another kind 5 → 40 ms p50): a pending row
/// whose kind a policy holds back (paused, or limited: claimed apart, under the kind's lock) is
/// `held`, and a claim of every kind walks `relay_pending_open`, which has only the others.
/// A policy row says whether it `holds`; a pending row takes its kind's as it is inserted (a
/// trigger on every path into the queue that does not say; the submit path's statement reads
/// it once for all its rows), under a share lock of the policy row, so an insert
/// either waits for a change being made and reads it, or is committed before the change is —
/// and the rows already there are brought in line by the nodes afterwards, a bounded step at a
/// time ([`super::sql::REHOLD`]; `relay_pending_held` finds a resumed kind's rows in order).
/// (A kind's first policy has no row to lock: a task inserted while it is created may stay
/// not held; claims still leave it out by the node's view of the policies, it costs them a
/// step.)
const V17: &str = r#"
ALTER TABLE relay_kind_policies ADD COLUMN IF NOT EXISTS holds boolean NOT NULL DEFAULT false;
UPDATE relay_kind_policies SET holds = coalesce(policy::jsonb ?| ARRAY['paused', 'max_running', 'max_running_per_key',
                                                                       'rate', 'rate_per_key'], false);
ALTER TABLE relay_pending ADD COLUMN IF NOT EXISTS held boolean NOT NULL DEFAULT false;
UPDATE relay_pending p SET held = true FROM relay_kind_policies k WHERE k.kind = p.kind AND k.holds;
-- (No default: an insert that does not say is given its kind's by the trigger.)
ALTER TABLE relay_pending ALTER COLUMN held DROP DEFAULT;
CREATE OR REPLACE FUNCTION relay_pending_hold() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
  h boolean;
BEGIN
  IF NEW.kind IS NOT NULL THEN
    SELECT k.holds INTO h FROM relay_kind_policies k WHERE k.kind = NEW.kind FOR SHARE;
    NEW.held := coalesce(h, false);
  ELSE
    NEW.held := false;
  END IF;
  RETURN NEW;
END $fn$;
DROP TRIGGER IF EXISTS relay_pending_hold ON relay_pending;
CREATE TRIGGER relay_pending_hold BEFORE INSERT ON relay_pending FOR EACH ROW WHEN (NEW.held IS NULL)
    EXECUTE FUNCTION relay_pending_hold();
DROP INDEX IF EXISTS relay_pending_ord;
CREATE INDEX IF NOT EXISTS relay_pending_open ON relay_pending (ord_ms, seq) WHERE NOT held;
CREATE INDEX IF NOT EXISTS relay_pending_held ON relay_pending (kind, ord_ms, seq) WHERE held;
"#;

/// What [`migrate`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Migrated {
    /// The version found before.
    pub from: i32,
    /// The version now.
    pub to: i32,
}

/// Brings the schema to [`latest_version`] in one transaction under the migration lock.
pub fn migrate(conn: &mut Conn) -> Result<Migrated, PgError> {
    migrate_to(conn, MIGRATIONS)
}

/// [`migrate`] with an explicit list (tests add versions to see the upgrade path).
pub fn migrate_to(conn: &mut Conn, migrations: &[(i32, &str, &str)]) -> Result<Migrated, PgError> {
    conn.simple(&format!(
        "BEGIN; SELECT pg_advisory_xact_lock({MIGRATION_LOCK});
         CREATE TABLE IF NOT EXISTS relay_schema (
             version     int4 PRIMARY KEY,
             description text NOT NULL,
             applied_at  timestamptz NOT NULL DEFAULT now()
         );"
    ))
    .inspect_err(|_| rollback(conn))?;
    let result = (|| {
        let found = conn.simple("SELECT coalesce(max(version), 0) FROM relay_schema")?;
        let from = found.first().and_then(|r| r.rows.first()).and_then(|r| r.i64(0)).unwrap_or(0) as i32;
        let newest = migrations.last().map_or(0, |m| m.0);
        if from > newest {
            return Err(PgError::Db {
                code: "relay".into(),
                message: format!(
                    "the database schema is version {from}, newer than this relay knows ({newest}): upgrade relay"
                ),
            });
        }
        for (version, description, sql) in migrations.iter().filter(|m| m.0 > from) {
            conn.simple(sql)?;
            let description = description.replace('\'', "''");
            conn.simple(&format!(
                "INSERT INTO relay_schema (version, description) VALUES ({version}, '{description}')"
            ))?;
        }
        conn.simple("COMMIT")?;
        Ok(Migrated { from, to: newest.max(from) })
    })();
    if result.is_err() {
        rollback(conn);
    }
    result
}

fn rollback(conn: &mut Conn) {
    let _ = conn.simple("ROLLBACK");
}
