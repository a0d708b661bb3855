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
