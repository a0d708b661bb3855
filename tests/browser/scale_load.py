"""Load for measuring the dashboard at scale (not part of cargo test; see tests/browser/README.md).

Connects N fake workers to relay over WebSocket (each answers done, or failed for one task in
ten), submits T tasks over pipelined keep-alive HTTP, prints progress, then keeps the workers
connected (and a trickle of tasks flowing, so the chart moves) until it is killed.
Loopback only. Usage: python3 scale_load.py HOST:PORT API_TOKEN WORKER_TOKEN WORKERS TASKS
"""
import asyncio
import json
import random
import sys
import time

import websockets


async def worker(url, i):
    kinds = ["http", "file", "report"] if i % 2 else None
    hello = {"type": "hello", "concurrency": 4, "version": f"scale/{i}"}
    if kinds:
        hello["kinds"] = kinds
    async with websockets.connect(url, max_size=1 << 20, ping_interval=None) as ws:
        await ws.send(json.dumps(hello))
        async for msg in ws:
            m = json.loads(msg)
            if m.get("type") != "task":
                continue
            if random.random() < 0.1:
                out = {"type": "result", "task_id": m["task_id"], "status": "failed", "error": "scripted failure"}
            else:
                out = {"type": "result", "task_id": m["task_id"], "status": "done", "data": {"ok": 1}}
            await ws.send(json.dumps(out))


async def submit(host, port, token, n, kinds):
    reader, writer = await asyncio.open_connection(host, port)
    sent = 0
    while sent < n:
        batch = min(200, n - sent)
        for j in range(batch):
            kind = kinds[(sent + j) % len(kinds)]
            body = json.dumps({"payload": {"kind": kind, "n": sent + j}, "queue": True}).encode()
            writer.write(
                b"POST /tasks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token.encode() +
                b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        for _ in range(batch):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")][0].split(b":")[1])
            await reader.readexactly(length)
        sent += batch
    writer.close()


async def main():
    addr, api, wrk, n_workers, n_tasks = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    host, port = addr.rsplit(":", 1)
    url = f"ws://{addr}/ws?token={wrk}"
    tasks = [asyncio.create_task(worker(url, i)) for i in range(n_workers)]
    await asyncio.sleep(2)
    t0 = time.time()
    kinds = ["http", "file", "report", "scan"]
    per = n_tasks // 8
    await asyncio.gather(*(submit(host, port, api, per, kinds) for _ in range(8)))
    print(f"submitted {per * 8} tasks in {time.time() - t0:.1f}s", flush=True)
    print("READY", flush=True)
    while True:  # a trickle for the chart
        await submit(host, port, api, 20, kinds)
        await asyncio.sleep(0.5)


asyncio.run(main())
