#!/usr/bin/env python3
"""Issue 22 probe (bench/README.md, flow control): what a `GET /kinds` or a `/metrics` scrape
with many kinds costs the other clients of one node. KINDS tasks are queued by /tasks/batch, each
of its own kind (names in random order, so nothing arrives sorted), no worker connected. With
DATABASE_URL set in its environment the node runs in cluster mode on that database (give it an
empty one); else the memory store, journal in OUT_DIR.

`kinds` (the default): ROUNDS times, one client asks `GET /kinds` and reads the whole answer
while another process asks `GET /healthz` one after another on a keep-alive connection: the
figures are the big answer's time to first byte and to its end, and the longest /healthz seen
while it was under way.

`metrics`: POLICIES of the kinds get a policy first; then ROUNDS times, 50 `GET /metrics` one
after another while /healthz is asked as above: the figures are the scrapes' times and the
longest /healthz seen meanwhile.

usage: kinds-probe.py RELAY_BIN OUT_DIR [kinds=200000] [rounds=5] [kinds|metrics] [policies=100]
"""
import http.client, json, os, random, shutil, signal, subprocess, sys, time

relay_bin, out = sys.argv[1], sys.argv[2]
KINDS = int(sys.argv[3]) if len(sys.argv) > 3 else 200_000
ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 5
WHAT = sys.argv[5] if len(sys.argv) > 5 else "kinds"
POLICIES = int(sys.argv[6]) if len(sys.argv) > 6 else 100
SCRAPES = 50
PORT = 18461
TOKEN = "kinds-probe-api-token-0123456789"
AUTH = {"Authorization": "Bearer " + TOKEN}
assert WHAT in ("kinds", "metrics"), WHAT

POLLER = r"""
import http.client, json, sys, time
import os
port, stop_file = int(sys.argv[1]), sys.argv[2]
c = http.client.HTTPConnection("127.0.0.1", port)
seen = []
while not os.path.exists(stop_file):
    t0 = time.monotonic()
    c.request("GET", "/healthz")
    r = c.getresponse()
    r.read()
    t1 = time.monotonic()
    seen.append((t0, t1))
print(json.dumps(seen))
"""

shutil.rmtree(out, ignore_errors=True)
os.makedirs(out)
env = dict(os.environ, API_TOKEN=TOKEN, WORKER_TOKEN=TOKEN + "-worker", PORT=str(PORT), BIND="127.0.0.1", DATA_DIR=out + "/data", LOG_LEVEL="warn")
relay = subprocess.Popen([relay_bin], env=env, stdout=open(out + "/relay.log", "w"), stderr=subprocess.STDOUT)
mode = "cluster" if os.environ.get("DATABASE_URL") else "single node"


def cleanup(*_):
    relay.send_signal(signal.SIGTERM)
    try:
        relay.wait(30)
    except Exception:
        relay.kill()


def ms(s):
    return f"{s * 1e3:.1f} ms"


def during(seen, t0, t1):
    d = [b - a for a, b in seen if b >= t0 and a <= t1]
    outside = [b - a for a, b in seen if b < t0 or a > t1] or [0.0]
    return f"/healthz during it: {len(d)} answered, max {ms(max(d))}, median {ms(sorted(d)[len(d) // 2])}; outside it: max {ms(max(outside))}, median {ms(sorted(outside)[len(outside) // 2])}"


def polled(rnd, run):
    """Runs `run()` (returns (t0, t1, text)) with /healthz asked meanwhile."""
    stop_file = f"{out}/stop-{rnd}"
    poller = subprocess.Popen([sys.executable, "-c", POLLER, str(PORT), stop_file], stdout=subprocess.PIPE)
    time.sleep(1.0)
    t0, t1, text = run()
    time.sleep(0.5)
    open(stop_file, "w").close()
    seen = json.loads(poller.communicate()[0])
    print(f"round {rnd} ({mode}): {text}; {during(seen, t0, t1)}", flush=True)


signal.signal(signal.SIGTERM, lambda *a: (cleanup(), sys.exit(1)))
try:
    deadline = time.monotonic() + 30
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", PORT)
            c.request("GET", "/healthz")
            r = c.getresponse()
            r.read()
            if r.status == 200:  # (cluster mode: once the database is reached)
                break
            time.sleep(0.05)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    rng = random.Random(22)
    names = [f"k-{rng.getrandbits(48):012x}-{i}" for i in range(KINDS)]
    c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=300)
    t = time.monotonic()
    for at in range(0, KINDS, 10_000):
        body = json.dumps({"tasks": [{"payload": {"kind": k}} for k in names[at : at + 10_000]]})
        c.request("POST", "/tasks/batch", body, dict(AUTH, **{"Content-Type": "application/json"}))
        r = c.getresponse()
        answer = json.loads(r.read())
        assert r.status == 202 and all("task_id" in x for x in answer["tasks"]), answer["tasks"][:3]
    print(f"{KINDS} kinds queued in {time.monotonic() - t:.1f} s ({mode})", flush=True)
    want = sorted(names)
    if WHAT == "metrics":
        for k in want[:POLICIES]:
            c.request("PUT", f"/kinds/{k}", json.dumps({"max_running": 5}), dict(AUTH, **{"Content-Type": "application/json"}))
            r = c.getresponse()
            r.read()
            assert r.status == 200, r.status
        time.sleep(2.5)  # (cluster mode: the gauges are read once a second)
        c.request("GET", "/metrics")
        r = c.getresponse()
        text = r.read().decode()
        labelled = sum(1 for line in text.splitlines() if line.startswith("relay_kind_pending{"))
        assert labelled == min(POLICIES, 1000), labelled
    for rnd in range(ROUNDS):
        if WHAT == "kinds":

            def run():
                c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=300)
                t0 = time.monotonic()
                c.request("GET", "/kinds", headers=AUTH)
                r = c.getresponse()
                t_head = time.monotonic()
                body = r.read()
                t_end = time.monotonic()
                got = [k["kind"] for k in json.loads(body)["kinds"]]
                assert got == want, f"{len(got)} kinds, order {'ok' if got == sorted(got) else 'wrong'}"
                framing = r.getheader("Transfer-Encoding") or f"Content-Length {r.getheader('Content-Length')}"
                return t0, t_end, f"GET /kinds {len(body) / 1e6:.1f} MB ({framing}): first byte {ms(t_head - t0)}, end {ms(t_end - t0)}"

        else:

            def run():
                c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=60)
                times = []
                t0 = time.monotonic()
                for _ in range(SCRAPES):
                    a = time.monotonic()
                    c.request("GET", "/metrics")
                    r = c.getresponse()
                    r.read()
                    times.append(time.monotonic() - a)
                t_end = time.monotonic()
                times.sort()
                return t0, t_end, f"{SCRAPES} GET /metrics ({POLICIES} policies): median {ms(times[len(times) // 2])}, max {ms(times[-1])}"

        polled(rnd, run)
finally:
    cleanup()
