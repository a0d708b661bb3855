#!/usr/bin/env python3
"""Issue 22 probe (bench/README.md, flow control, "Fixed: KIND_GAUGES and KINDS no longer count
the queue"): times the statements behind the kind gauges and /kinds at N pending tasks — the
old ones (counting relay_pending, below) on a database at the schema version before the
per-kind counts, then the ones of src/pg/sql.rs on the same database migrated (the migration
timed too), and an insert and a delete of 64 pending rows before and after. Three kinds with a
policy share the tasks; 2,000 more have no kind; 30 attempts run.

Needs a running PostgreSQL you own (a private one: it drops and creates the database `probe`);
psql connects as PGUSER (default postgres) over the socket directory and port given.

usage: kind-counts-probe.py SOCKET_DIR PORT [pending=300000] [novacuum]
       (novacuum: ANALYZE only, as a churning queue is — the old counts then visit the heap)
"""
import os, pathlib, re, statistics, subprocess, sys

root = pathlib.Path(__file__).resolve().parent.parent
sock, port = sys.argv[1], sys.argv[2]
N = int(sys.argv[3]) if len(sys.argv) > 3 else 300000
VACUUM = "novacuum" not in sys.argv[4:]
PSQL = ["psql", "-h", sock, "-p", port, "-U", os.environ.get("PGUSER", "postgres"), "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1"]
KINDS = ["k1", "k2", "k3"]
REPS = 25

# The statements before schema version 16.
OLD_KIND_GAUGES = """SELECT k.kind, (SELECT count(*) FROM relay_running r WHERE r.kind = k.kind),
            (SELECT count(*) FROM relay_pending p WHERE p.kind = k.kind)
     FROM unnest($1::text[]) AS k(kind) ORDER BY k.kind"""
OLD_KINDS = """WITH p AS (
       SELECT kind, count(*) AS n FROM relay_pending
       WHERE kind IS NOT NULL AND ($1::text IS NULL OR kind = $1::text) GROUP BY kind
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
     ORDER BY k.kind"""

schema = (root / "src/pg/schema.rs").read_text()
consts = {m.group(1): m.group(2) for m in re.finditer(r'^const (V\d+): &str = r#"(.*?)"#;', schema, re.M | re.S)}
migrations = [(int(m.group(1)), m.group(2), consts[m.group(3)])
              for m in re.finditer(r'^    \((\d+), "([^"]*)", (V\d+)\),', schema, re.M)]
at = next(i for i, m in enumerate(migrations) if m[1] == "pending tasks counted per kind by triggers")
src = (root / "src/pg/sql.rs").read_text()
new = {m.group(1): m.group(2).replace('\\"', '"')
       for m in re.finditer(r'^pub const ([A-Z0-9_]+): &str =\s*"((?:[^"\\]|\\.)*)";', src, re.M | re.S)}


def psql(db, sql, timing=False):
    out = subprocess.run(PSQL + ["-d", db], input=("\\timing on\n" if timing else "") + sql, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(out.stderr)
    return [float(x) for x in re.findall(r"^Time: ([0-9.]+) ms", out.stdout, re.M)] if timing else out.stdout


def bench(label, gauges, kinds):
    arr = "'{" + ",".join(KINDS) + "}'"
    for name, sql, params in [("KIND_GAUGES", gauges, f"({arr})"), ("KINDS (GET /kinds)", kinds, "(NULL)"),
                              ("KINDS (GET /kinds/k1)", kinds, "('k1')")]:
        t = psql("probe", f"PREPARE s AS {sql};\n" + f"EXECUTE s{params};\n" * REPS + "DEALLOCATE s;\n", True)[1:-1]
        print(f"{label} {name}: median {statistics.median(t):.2f} ms, min {min(t):.2f}, max {max(t):.2f} ({len(t)} runs)")
    t = psql("probe", """INSERT INTO relay_pending (task_id, due_ms, ord_ms, seq, kind, queue, payload_bytes)
  SELECT gen_random_uuid(), 5, 5, -i, 'k1', true, 100 FROM generate_series(1, 64) i;
DELETE FROM relay_pending WHERE kind = 'k1' AND ord_ms = 5;
""" * REPS, True)
    print(f"{label} insert of 64 pending rows: median {statistics.median(t[0::2]):.2f} ms; "
          f"their delete: median {statistics.median(t[1::2]):.2f} ms")


print(f"{N} pending, {'vacuumed' if VACUUM else 'analyzed only'}")
psql("postgres", "DROP DATABASE IF EXISTS probe; CREATE DATABASE probe;")
psql("probe", "BEGIN; CREATE TABLE relay_schema (version int4 PRIMARY KEY, description text NOT NULL, "
     "applied_at timestamptz NOT NULL DEFAULT now());"
     + "".join(f"{sql}; INSERT INTO relay_schema (version, description) VALUES ({v}, 'probe');" for v, _, sql in migrations[:at])
     + "COMMIT;")
arr = "ARRAY" + str(KINDS)
psql("probe", f"""
INSERT INTO relay_kind_policies (kind, policy) SELECT k, '{{"max_running":100}}' FROM unnest({arr}) k;
INSERT INTO relay_pending (task_id, due_ms, ord_ms, seq, kind, queue, payload_bytes)
  SELECT gen_random_uuid(), 1000 + i, 1000 + i, i, ({arr})[1 + i % 3], true, 100 FROM generate_series(1, {N}) i;
INSERT INTO relay_pending (task_id, due_ms, ord_ms, seq, kind, queue, payload_bytes)
  SELECT gen_random_uuid(), 1000 + i, 1000 + i, {N} + i, NULL, true, 100 FROM generate_series(1, 2000) i;
INSERT INTO relay_running (task_id, owner_node, attempt, kind)
  SELECT gen_random_uuid(), gen_random_uuid(), 1, ({arr})[1 + i % 3] FROM generate_series(1, 30) i;
{'VACUUM ANALYZE' if VACUUM else 'ANALYZE'};
""")
bench(f"before (v{migrations[at - 1][0]})", OLD_KIND_GAUGES, OLD_KINDS)
t = psql("probe", f"BEGIN;\n{migrations[at][2]}\nCOMMIT;", True)
print(f"migration v{migrations[at][0]}: {sum(t):.0f} ms")
psql("probe", "VACUUM ANALYZE" if VACUUM else "ANALYZE")
print("counts:", psql("probe", "SELECT string_agg(kind || '=' || n, ',' ORDER BY kind) FROM relay_kind_pending").strip())
bench(f"after (v{migrations[at][0]})", new["KIND_GAUGES"], new["KINDS"])
