#!/usr/bin/env python3
"""Issue 22 probe (bench/README.md, flow control): claims of a kind with max_running_per_key 2
over thousands of fresh keys, on relay nodes sharing one private PostgreSQL started here (initdb
in OUT_DIR as the postgres user, unix socket only; run as root), before autovacuum's first
analyze. Each node has two relay-worker processes (kind echo, 16 slots); the tasks are submitted
by /tasks/batch, 1,000 at a time, then drained. Statement durations come from the server's log
(log_min_duration_statement=0): median, p90 and max per statement of src/pg/sql.rs.

usage: fresh-keys-probe.py RELAY_BIN WORKER_BIN OUT_DIR [tasks=20000] [keys=10000] [nodes=2]
       fresh-keys-probe.py parse - OUT_DIR        (the figures of a run again)
env:   EXTRA_PGCONF="a = 1;b = 2" (more server settings), DRAIN_SECS (default 300)
"""
import json, os, re, shutil, signal, statistics, subprocess, sys, time, urllib.request

relay_bin, worker_bin, out = sys.argv[1], sys.argv[2], sys.argv[3]
PARSE_ONLY = relay_bin == "parse"
TASKS = int(sys.argv[4]) if len(sys.argv) > 4 else 20000
KEYS = int(sys.argv[5]) if len(sys.argv) > 5 else 10000
NODES = int(sys.argv[6]) if len(sys.argv) > 6 else 2
PG = "/usr/lib/postgresql/15/bin"
PGPORT = 55441
TOKEN = "repro-api-token-0123456789"
WTOKEN = "repro-worker-token-0123456789"
procs = []


def as_pg(args, **kw):
    return subprocess.Popen(["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"] + args, **kw)


def cleanup(*_):
    for p in reversed(procs):
        try:
            p.send_signal(signal.SIGINT if p is procs[0] else signal.SIGTERM)
        except Exception:
            pass
    for p in reversed(procs):
        try:
            p.wait(10)
        except Exception:
            p.kill()


start_off = 0
if PARSE_ONLY:
    pass
else:
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out + "/sock")
    subprocess.run(["chown", "-R", "postgres:postgres", out], check=True)
    r = as_pg([PG + "/initdb", "-D", out + "/data", "-U", "postgres", "--auth=trust"], stdout=subprocess.DEVNULL)
    assert r.wait() == 0
    with open(out + "/data/postgresql.conf", "a") as f:
        f.write(f"""
    listen_addresses = ''
    port = {PGPORT}
    unix_socket_directories = '{out}/sock'
    fsync = off
    synchronous_commit = off
    full_page_writes = off
    log_min_duration_statement = 0
    log_line_prefix = '%m [%p] '
    max_connections = 50
    log_autovacuum_min_duration = 0
    """ + os.environ.get("EXTRA_PGCONF", "").replace(";", "\n") + "\n")
    pglog = open(out + "/pg.log", "w")
    pg = as_pg([PG + "/postgres", "-D", out + "/data"], stderr=pglog, stdout=pglog)
    procs.append(pg)
    signal.signal(signal.SIGTERM, cleanup)
    try:
        for _ in range(100):
            if subprocess.run([PG + "/pg_isready", "-h", out + "/sock", "-p", str(PGPORT)], stdout=subprocess.DEVNULL).returncode == 0:
                break
            time.sleep(0.1)
        subprocess.run(["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", PG + "/psql", "-h", out + "/sock",
                        "-p", str(PGPORT), "-U", "postgres", "-c", "CREATE DATABASE relay"], check=True, stdout=subprocess.DEVNULL)
        url = f"postgres://postgres@/relay?host={out}/sock&port={PGPORT}"
        ports = [18611 + i for i in range(NODES)]
        for i, port in enumerate(ports):
            env = dict(os.environ, DATABASE_URL=url, PORT=str(port), BIND="127.0.0.1", API_TOKEN=TOKEN, WORKER_TOKEN=WTOKEN,
                       LOG_LEVEL="warn", MAX_PENDING="1000000", TASK_TIMEOUT="60s")
            procs.append(subprocess.Popen([relay_bin], env=env, stderr=open(f"{out}/relay{i}.log", "w")))
            time.sleep(0.3 if i == 0 else 0)

        def api(port, method, path, body=None):
            req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": "Bearer " + TOKEN, "Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.loads(resp.read() or b"null")

        for port in ports:
            for _ in range(200):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
                    break
                except Exception:
                    time.sleep(0.1)
        api(ports[0], "PUT", "/kinds/echo", {"max_running_per_key": 2})
        for i, port in enumerate(ports):
            for j in range(2):
                env = dict(os.environ, RELAY_URL=f"ws://127.0.0.1:{port}/ws", TOKEN=WTOKEN, CONCURRENCY="16", LOG_LEVEL="warn")
                procs.append(subprocess.Popen([worker_bin], env=env, stderr=open(f"{out}/worker{i}{j}.log", "w")))
        time.sleep(1.5)
        mark = time.time()
        with open(out + "/pg.log") as f:
            f.seek(0, 2)
            start_off = f.tell()
        t0 = time.time()
        for b in range(0, TASKS, 1000):
            items = [{"payload": {"kind": "echo", "spec": n}, "key": f"k{n % KEYS}"} for n in range(b, min(TASKS, b + 1000))]
            api(ports[(b // 1000) % NODES], "POST", "/tasks/batch", {"tasks": items})
        queued = time.time() - t0
        deadline = time.time() + float(os.environ.get("DRAIN_SECS", "300"))
        while time.time() < deadline:
            k = api(ports[0], "GET", "/kinds/echo")
            if k["pending"] == 0 and k["running"] == 0:
                break
            time.sleep(0.5)
        drained = time.time() - t0
        print(f"queued {TASKS} tasks over {KEYS} keys in {queued:.1f}s; drained in {drained:.1f}s; left {k}")
    finally:
        cleanup()


# ----- statement durations after the submits began
pat = re.compile(r"duration: ([0-9.]+) ms\s+execute [^:]+: (.*)")
lines = open(out + "/pg.log").read()[start_off:].split("\n")
stats = {}
for i, line in enumerate(lines):
    m = pat.search(line)
    if not m:
        continue
    ms, first = float(m.group(1)), m.group(2).strip()
    nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
    name = None
    if first.startswith("WITH k AS ("):
        name = "CLAIM_LIMITED"
    elif (first.startswith("SELECT * FROM (") and "l.submitter" in nxt) or first.startswith("SELECT DISTINCT ON (x.kind"):
        name = "LANE_BACKLOG"
    elif first.startswith("SELECT k.kind,") and "EXISTS" in nxt:
        name = "KIND_BACKLOG"
    elif "relay kind" in first or "relay.kinds_locked" in first:
        name = "KIND_LOCKS"
    elif first.startswith("ANALYZE"):
        name = "ANALYZE"
    elif first.startswith("WITH plain AS ("):
        name = "CLAIM"
    elif first.startswith("WITH gone AS (") and "relay_fair_lanes" in nxt:
        name = "FAIR_SWEEP"
    elif first.startswith("WITH n AS") or "INSERT INTO relay_tasks" in first:
        name = "INSERT"
    if name:
        stats.setdefault(name, []).append(ms)
for name, v in sorted(stats.items()):
    v.sort()
    print(f"{name:14} n={len(v):6} median={statistics.median(v):9.2f} ms  p90={v[int(len(v) * 0.9)]:9.2f}  "
          f"max={v[-1]:9.2f} ms  mean={statistics.mean(v):8.2f}  sum={sum(v) / 1000:7.2f} s")
errs = [l for l in lines if "ERROR" in l]
print(f"errors in the pg log: {len(errs)}", *(errs[:5]), sep="\n  ")
