#!/usr/bin/env python3
"""Issue 22 probe (bench/README.md, "Cluster claims with many limited kinds idle"): N kinds are
given {"max_running": 5} and no task, a worker that declares no kinds connects (so every claim
covers every limited kind), then 30 sequential sync tasks of a kind with no policy. Start relay
first (cluster mode: DATABASE_URL on a fresh database; API_TOKEN=atok, WORKER_TOKEN=wtok,
BIND=127.0.0.1) and wait until /healthz says the database is ok. Needs `websockets`.

usage: limited-kinds-probe.py PORT N
"""
import asyncio, json, sys, time, urllib.request, statistics, threading, os
import websockets
port, n = int(sys.argv[1]), int(sys.argv[2])
base = f"http://127.0.0.1:{port}"
def api(method, path, body=None):
    req = urllib.request.Request(base + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer atok"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()
import concurrent.futures as cf
with cf.ThreadPoolExecutor(16) as ex:
    list(ex.map(lambda i: api("PUT", f"/kinds/lim{i}", {"max_running": 5}), range(n)))
async def worker(ready):
    async with websockets.connect(f"ws://127.0.0.1:{port}/ws?token=wtok") as ws:
        await ws.send(json.dumps({"type": "hello", "concurrency": 8}))
        ready.set()
        async for m in ws:
            msg = json.loads(m)
            if msg.get("type") == "task":
                await ws.send(json.dumps({"type": "result", "task_id": msg["task_id"], "status": "done", "data": None}))
ready = threading.Event()
threading.Thread(target=lambda: asyncio.run(worker(ready)), daemon=True).start()
ready.wait(10); time.sleep(1.5)
lat = []
for i in range(30):
    t = time.monotonic(); api("POST", "/tasks?wait=true", {"payload": {"kind": "o"}}); lat.append((time.monotonic() - t) * 1000)
lat.sort()
print(f"limited kinds={n} p50={statistics.median(lat):.1f} ms max={lat[-1]:.1f} ms")
