#!/usr/bin/env python3
"""A relay worker in Python, written from docs/protocol.md alone.

Needs Python 3.9+ and the `websockets` package (python3 -m pip install websockets).

Environment: RELAY_URL (default ws://localhost:8080/ws), TOKEN (required: relay's
WORKER_TOKEN), CONCURRENCY (default 4).

Kinds:
  echo   result = the task's spec
  sleep  spec {"ms": N}: waits N ms, result {"slept_ms": N}

It says hello with its kinds and concurrency, runs tasks on a thread pool, answers each with a
result, reconnects with exponential backoff and jitter (but exits 2 when relay refuses TOKEN
with 401: no retry can fix that), and on SIGTERM/SIGINT says hello with
concurrency 0, refuses tasks that still arrive ("worker shutting down"), lets running tasks
finish, and exits 0. Pings are answered by the websockets library.
"""

import json
import os
import random
import signal
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.sync.client import connect

MAX_MESSAGE_BYTES = 1024 * 1024 + 64 * 1024
GRACE_SECONDS = 30


def echo(task_id, spec):
    return spec


def sleep(task_id, spec):
    ms = int((spec or {}).get("ms", 100))
    time.sleep(ms / 1000)
    return {"slept_ms": ms}


KINDS = {"echo": echo, "sleep": sleep}


def log(msg, **fields):
    ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    parts = [f"ts={ts}Z", "level=info", f"msg={json.dumps(msg)}"]
    parts += [f"{k}={json.dumps(str(v))}" for k, v in fields.items()]
    print(" ".join(parts), file=sys.stderr, flush=True)


def hello(concurrency):
    return json.dumps({"type": "hello", "kinds": sorted(KINDS), "concurrency": concurrency,
                       "version": "worker.py/1"})


def result(task_id, data=None, error=None):
    if error is None:
        return json.dumps({"type": "result", "task_id": task_id, "status": "done", "data": data})
    return json.dumps({"type": "result", "task_id": task_id, "status": "failed", "error": error})


class Session:
    """One connection: reads tasks, runs them on the pool, sends their results."""

    def __init__(self, ws, pool, stop, concurrency):
        self.ws, self.pool, self.stop, self.concurrency = ws, pool, stop, concurrency
        self.send_lock = threading.Lock()
        self.running = set()
        self.running_lock = threading.Lock()

    def send(self, text):
        with self.send_lock:
            self.ws.send(text)

    def run_task(self, task_id, handler, spec):
        try:
            message = result(task_id, data=handler(task_id, spec))
        except Exception as e:  # a failing handler fails its task, not the worker
            message = result(task_id, error=f"{type(e).__name__}: {e}")
        try:
            self.send(message)
        except ConnectionClosed:
            # relay has moved the task on (outcome "disconnect"); a new connection could not
            # deliver this result, so it is dropped.
            log("result dropped", task_id=task_id)
        finally:
            with self.running_lock:
                self.running.discard(task_id)

    def serve(self):
        """Returns True when drained after a stop signal, False if the connection ended."""
        self.send(hello(self.concurrency))
        draining_since = None
        while True:
            if self.stop.is_set() and draining_since is None:
                draining_since = time.monotonic()
                self.send(hello(0))
                log("draining", in_flight=len(self.running))
            if draining_since is not None:
                with self.running_lock:
                    idle = not self.running
                if idle or time.monotonic() - draining_since > GRACE_SECONDS:
                    self.ws.close()
                    log("stopped")
                    return True
            try:
                raw = self.ws.recv(timeout=0.2)
            except TimeoutError:
                continue
            except ConnectionClosed:
                return False
            try:
                msg = json.loads(raw)
            except ValueError:
                log("malformed message ignored")
                continue
            if not isinstance(msg, dict) or msg.get("type") != "task":
                continue  # "cancel" is advisory: relay has stopped waiting already
            task_id = msg.get("task_id")
            payload = msg.get("payload")
            kind = payload.get("kind") if isinstance(payload, dict) else None
            if draining_since is not None:
                self.send(result(task_id, error="worker shutting down"))
            elif kind not in KINDS:
                self.send(result(task_id, error=f"unknown task kind: {kind}"))
            else:
                with self.running_lock:
                    self.running.add(task_id)
                self.pool.submit(self.run_task, task_id, KINDS[kind], payload.get("spec"))


def main():
    token = os.environ.get("TOKEN")
    if not token:
        print("worker.py: TOKEN is required (relay's WORKER_TOKEN)", file=sys.stderr)
        return 2
    url = os.environ.get("RELAY_URL", "ws://localhost:8080/ws")
    try:
        concurrency = int(os.environ.get("CONCURRENCY", "4"))
        if concurrency < 1:
            raise ValueError
    except ValueError:
        print("worker.py: CONCURRENCY must be a positive integer", file=sys.stderr)
        return 2

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    pool = ThreadPoolExecutor(max_workers=concurrency)
    full_url = url + ("&" if "?" in url else "?") + urllib.parse.urlencode({"token": token})
    delay = 0.25
    while not stop.is_set():
        try:
            with connect(full_url, max_size=MAX_MESSAGE_BYTES, open_timeout=10, close_timeout=2) as ws:
                log("connected", url=url)
                started = time.monotonic()
                if Session(ws, pool, stop, concurrency).serve():
                    break
                if time.monotonic() - started > 10:
                    delay = 0.25  # the connection was stable: start the backoff over
                reason = "closed by relay"
        except InvalidHandshake as e:
            # websockets >= 14: InvalidStatus(.response.status_code); older: InvalidStatusCode.
            status = getattr(getattr(e, "response", None), "status_code", None) or getattr(e, "status_code", None)
            if status == 401:
                # Final: relay refuses this token however often it is tried.
                print("worker.py: relay refused TOKEN (HTTP 401): set it to relay's WORKER_TOKEN", file=sys.stderr)
                pool.shutdown(wait=True)
                return 2
            reason = f"{type(e).__name__}: {e}"
        except (OSError, ConnectionClosed, InvalidURI, TimeoutError) as e:
            reason = f"{type(e).__name__}: {e}"
        wait = delay / 2 + random.random() * delay / 2
        log("disconnected", reason=reason, retry_in_ms=int(wait * 1000))
        stop.wait(wait)
        delay = min(delay * 2, 30)
    pool.shutdown(wait=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
