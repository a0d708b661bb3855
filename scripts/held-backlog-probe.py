#!/usr/bin/env python3
"""Issue 22 probe (bench/README.md, "a held kind's backlog in cluster claims"): the latency of
sync tasks of a kind with no policy while N tasks of a paused kind wait ahead of them, with a
worker that declares no kinds (KINDS=a,b: one that declares those). Start relay first (cluster
mode: DATABASE_URL on a fresh database; API_TOKEN=atok, WORKER_TOKEN=wtok, BIND=127.0.0.1), wait
until /healthz says the database is ok. Needs the `websockets` package.

usage: held-backlog-probe.py PORT N [ROUNDS=30]
prints: p50 and max of the sync tasks, and how many took over 500 ms (the slow poll)
"""
import os, urllib.error, asyncio, json, sys, time, urllib.request, statistics, threading
import websockets
port, n = int(sys.argv[1]), int(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 20
base = f"http://127.0.0.1:{port}"
def api(method, path, body=None):
    req = urllib.request.Request(base + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer atok", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        print("HTTP", e.code, method, path, e.read()[:300], flush=True)
        raise
api("PUT", "/kinds/held", {"paused": True})
for b in range(0, n, 1000):
    api("POST", "/tasks/batch", {"tasks": [{"payload": {"kind": "held"}, "queue": True} for _ in range(min(1000, n - b))]})
async def worker(ready):
    async with websockets.connect(f"ws://127.0.0.1:{port}/ws?token=wtok") as ws:
        hello = {"type": "hello", "concurrency": 8}
        if os.environ.get("KINDS"):
            hello["kinds"] = os.environ["KINDS"].split(",")
        await ws.send(json.dumps(hello))
        ready.set()
        async for m in ws:
            msg = json.loads(m)
            if msg.get("type") == "task":
                await ws.send(json.dumps({"type": "result", "task_id": msg["task_id"], "status": "done", "data": None}))
ready = threading.Event()
def run():
    try:
        asyncio.run(worker(ready))
    except Exception as e:
        print("worker:", repr(e), flush=True)
threading.Thread(target=run, daemon=True).start()
ready.wait(10); time.sleep(1.5)
lat = []
for i in range(rounds):
    t = time.monotonic()
    api("POST", "/tasks?wait=true", {"payload": {"kind": "o"}})
    lat.append((time.monotonic() - t) * 1000)
lat.sort()
print(f"n={n} p50={statistics.median(lat):.1f} ms max={lat[-1]:.1f} ms over500={sum(1 for x in lat if x > 500)} of {len(lat)}")
