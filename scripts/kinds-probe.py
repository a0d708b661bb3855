#!/usr/bin/env python3
"""Issue 22 probe (bench/README.md, flow control): what a `GET /kinds` with many kinds costs
the other clients of one node (memory store, journal in OUT_DIR). KINDS tasks are queued by
/tasks/batch, each of its own kind (names in random order, so nothing arrives sorted), no worker
connected. Then, ROUNDS times, one client asks `GET /kinds` and reads the whole answer while
another process asks `GET /healthz` one after another on a keep-alive connection: the figures
are the big answer's time to first byte and to its end, and the longest /healthz seen while it
was under way.

usage: kinds-probe.py RELAY_BIN OUT_DIR [kinds=200000] [rounds=5]
"""
import http.client, json, os, random, shutil, signal, subprocess, sys, time

relay_bin, out = sys.argv[1], sys.argv[2]
KINDS = int(sys.argv[3]) if len(sys.argv) > 3 else 200_000
ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 5
PORT = 18461
TOKEN = "kinds-probe-api-token-0123456789"
AUTH = {"Authorization": "Bearer " + TOKEN}

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


def cleanup(*_):
    relay.send_signal(signal.SIGTERM)
    try:
        relay.wait(30)
    except Exception:
        relay.kill()


signal.signal(signal.SIGTERM, lambda *a: (cleanup(), sys.exit(1)))
try:
    deadline = time.monotonic() + 30
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", PORT)
            c.request("GET", "/healthz")
            c.getresponse().read()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    rng = random.Random(22)
    names = [f"k-{rng.getrandbits(48):012x}-{i}" for i in range(KINDS)]
    c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=120)
    t = time.monotonic()
    for at in range(0, KINDS, 10_000):
        body = json.dumps({"tasks": [{"payload": {"kind": k}} for k in names[at : at + 10_000]]})
        c.request("POST", "/tasks/batch", body, dict(AUTH, **{"Content-Type": "application/json"}))
        r = c.getresponse()
        answer = json.loads(r.read())
        assert r.status == 202 and all("task_id" in x for x in answer["tasks"]), answer["tasks"][:3]
    print(f"{KINDS} kinds queued in {time.monotonic() - t:.1f} s", flush=True)
    want = sorted(names)
    for rnd in range(ROUNDS):
        stop_file = f"{out}/stop-{rnd}"
        poller = subprocess.Popen([sys.executable, "-c", POLLER, str(PORT), stop_file], stdout=subprocess.PIPE)
        time.sleep(1.0)
        c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=120)
        t0 = time.monotonic()
        c.request("GET", "/kinds", headers=AUTH)
        r = c.getresponse()
        t_head = time.monotonic()
        body = r.read()
        t_end = time.monotonic()
        time.sleep(0.5)
        open(stop_file, "w").close()
        seen = json.loads(poller.communicate()[0])
        got = [k["kind"] for k in json.loads(body)["kinds"]]
        assert got == want, f"{len(got)} kinds, order {'ok' if got == sorted(got) else 'wrong'}"
        during = [b - a for a, b in seen if b >= t0 and a <= t_end]
        framing = r.getheader("Transfer-Encoding") or f"Content-Length {r.getheader('Content-Length')}"
        print(
            f"round {rnd}: GET /kinds {len(body) / 1e6:.1f} MB ({framing}): first byte {(t_head - t0) * 1e3:.0f} ms, "
            f"end {(t_end - t0) * 1e3:.0f} ms; /healthz during it: {len(during)} answered, "
            f"max {max(during) * 1e3:.1f} ms, median {sorted(during)[len(during) // 2] * 1e3:.2f} ms; "
            f"outside it: max {max(b - a for a, b in seen if b < t0 or a > t_end) * 1e3:.1f} ms",
            flush=True,
        )
finally:
    cleanup()
