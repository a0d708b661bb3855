#!/usr/bin/env python3
"""A relay worker in Python, written from docs/protocol.md alone.

Needs Python 3.9+ and the `websockets` package (python3 -m pip install websockets).

Environment: RELAY_URL (default ws://localhost:8080/ws), TOKEN (required: relay's
WORKER_TOKEN), CONCURRENCY (default 4), WORKER_ID (default: a UUID per process).

Kinds:
  echo   result = the task's spec
  sleep  spec {"ms": N}: waits N ms, result {"slept_ms": N}
  fail   spec {"error": "...", "retry": false, "retry_after_ms": N}: fails with that error and
         those retry hints (each optional), to try relay's retries

A handler returns the task's result; any exception it raises fails the attempt (relay retries
the task as its policy says). To say more about the retry, raise Fail (docs/protocol.md, "Tasks
and results"; SPEC §13): Fail("bad request", retry=False) is a permanent failure (the task fails
at once, whatever retries remain); Fail("upstream 503", retry_after_ms=2000) makes the next
attempt wait at least that long (an upstream's Retry-After, say).

It says hello with its kinds and concurrency, runs tasks on a thread pool, answers each with a
result, reconnects with exponential backoff and jitter (but exits 2 when relay refuses TOKEN
with 401: no retry can fix that), and on SIGTERM/SIGINT says hello with
concurrency 0, refuses tasks that still arrive ("worker shutting down"), lets running tasks
finish, and exits 0. Pings are answered by the websockets library.

Sessions (docs/protocol.md, "Sessions"): every hello says WORKER_ID; relay's welcome gives a
secret. After a lost connection the next hello presents it and lists the tasks still running
or finished meanwhile; results finished while disconnected are kept (at most CONCURRENCY) and
sent once the welcome adopts their tasks, abandoned ones are dropped. {"type":"reconnect"}
brings it back at once (jitter up to 1 s); while tasks run or results are kept, it is back
within a quarter of the welcome's resume_window_ms, however far the backoff grew. (Unlike
relay-worker it does not keep a result it wrote just before a cut: see docs/protocol.md.)
"""

import json
import math
import os
import random
import signal
import sys
import threading
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.sync.client import connect

MAX_MESSAGE_BYTES = 1024 * 1024 + 64 * 1024
GRACE_SECONDS = 30


class Fail(Exception):
    """Fails the attempt with retry hints: retry=False (permanent), retry_after_ms=N (pace)."""

    def __init__(self, error, retry=True, retry_after_ms=None):
        super().__init__(error)
        self.error, self.retry = str(error), bool(retry)
        # relay takes a non-negative number of ms, at most a day (docs/protocol.md).
        self.retry_after_ms = None
        if retry_after_ms is not None:
            self.retry_after_ms = min(max(math.ceil(float(retry_after_ms)), 0), 86_400_000)


def echo(task_id, spec):
    return spec


def sleep(task_id, spec):
    ms = int((spec or {}).get("ms", 100))
    time.sleep(ms / 1000)
    return {"slept_ms": ms}


def fail(task_id, spec):
    spec = spec if isinstance(spec, dict) else {}
    raise Fail(spec.get("error", "failed on request"), retry=spec.get("retry", True) is not False,
               retry_after_ms=spec.get("retry_after_ms"))


KINDS = {"echo": echo, "sleep": sleep, "fail": fail}


def log(msg, **fields):
    ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    parts = [f"ts={ts}Z", "level=info", f"msg={json.dumps(msg)}"]
    parts += [f"{k}={json.dumps(str(v))}" for k, v in fields.items()]
    print(" ".join(parts), file=sys.stderr, flush=True)


class State:
    """What outlives a connection: the session, the tasks running, the results kept."""

    def __init__(self, worker_id, concurrency):
        self.worker_id, self.concurrency = worker_id, concurrency
        self.lock = threading.Lock()
        self.secret = None  # from the last welcome: relay has sessions
        self.gen = 0  # the connection number
        self.ws = None  # the live connection, once welcomed or without sessions
        self.tasks = {}  # task_id -> (connection number, attempt)
        self.kept = {}  # task_id -> (attempt, result message)
        self.reconnect_now = False
        self.window_ms = 0  # the last welcome's resume_window_ms


def hello(state, concurrency, running=None):
    msg = {"type": "hello", "kinds": sorted(KINDS), "concurrency": concurrency,
           "version": "worker.py/1", "worker_id": state.worker_id}
    if state.secret is not None:
        msg["session"] = state.secret
    if running is not None:
        msg["running"] = running
    return json.dumps(msg)


def result(task_id, data=None, error=None, attempt=None, retry=True, retry_after_ms=None):
    if error is None:
        msg = {"type": "result", "task_id": task_id, "status": "done", "data": data}
    else:
        msg = {"type": "result", "task_id": task_id, "status": "failed", "error": error}
        if not retry:
            msg["retry"] = False
        if retry_after_ms is not None:
            msg["retry_after_ms"] = retry_after_ms
    if attempt is not None:
        msg["attempt"] = attempt
    return json.dumps(msg)


class Session:
    """One connection: reads tasks, runs them on the pool, sends their results."""

    def __init__(self, ws, pool, stop, state):
        self.ws, self.pool, self.stop, self.state = ws, pool, stop, state
        self.send_lock = threading.Lock()

    def send(self, text):
        with self.send_lock:
            self.ws.send(text)

    def run_task(self, task_id, handler, spec, attempt):
        try:
            message = result(task_id, data=handler(task_id, spec), attempt=attempt)
        except Fail as e:
            message = result(task_id, error=e.error, attempt=attempt, retry=e.retry,
                             retry_after_ms=e.retry_after_ms)
        except Exception as e:  # a failing handler fails its task, not the worker
            message = result(task_id, error=f"{type(e).__name__}: {e}", attempt=attempt)
        state = self.state
        with state.lock:
            gen = state.tasks.pop(task_id, (None, None))[0]
            live = state.ws if gen == state.gen else None
            if live is None and state.secret is not None and len(state.kept) < state.concurrency:
                # Its connection is gone; a resumed session delivers it.
                state.kept[task_id] = (attempt, message)
                log("result kept", task_id=task_id)
                return
        if live is None:
            log("result dropped", task_id=task_id)
            return
        try:
            live.send(message)
        except ConnectionClosed:
            # Without a session relay has moved the task on (outcome "disconnect"); a new
            # connection could not deliver this result, so it is dropped.
            log("result dropped", task_id=task_id)

    def on_welcome(self, msg):
        state = self.state
        adopted = set(msg.get("adopted") or [])
        with state.lock:
            resumed = state.secret == msg.get("session")
            state.secret = msg.get("session")
            state.window_ms = msg.get("resume_window_ms") or 0
            for task_id, (gen, attempt) in list(state.tasks.items()):
                if task_id in adopted:
                    state.tasks[task_id] = (state.gen, attempt)
            kept, state.kept = state.kept, {}
            state.ws = self
        for task_id, (_attempt, message) in kept.items():
            if task_id in adopted:
                self.send(message)
        log("session resumed" if resumed else "session started", adopted=len(adopted),
            abandoned=len(msg.get("abandon") or []))

    def serve(self):
        """Returns True when drained after a stop signal, False if the connection ended."""
        state = self.state
        with state.lock:
            state.gen += 1
            running = [{"task_id": t, "attempt": a} for t, (_g, a) in state.tasks.items()]
            running += [{"task_id": t, "attempt": a} for t, (a, _m) in state.kept.items()]
            # Until a welcome says relay has sessions, results go out on this connection.
            state.ws = self
        self.send(hello(state, state.concurrency, running))
        draining_since = None
        while True:
            if self.stop.is_set() and draining_since is None:
                draining_since = time.monotonic()
                self.send(hello(state, 0))
                log("draining", in_flight=len(state.tasks))
            if draining_since is not None:
                with state.lock:
                    idle = not state.tasks
                if idle or time.monotonic() - draining_since > GRACE_SECONDS:
                    self.ws.close()
                    log("stopped")
                    return True
            try:
                raw = self.ws.recv(timeout=0.2)
            except TimeoutError:
                continue
            except ConnectionClosed:
                with state.lock:
                    state.ws = None
                return False
            try:
                msg = json.loads(raw)
            except ValueError:
                log("malformed message ignored")
                continue
            if isinstance(msg, dict) and msg.get("type") == "welcome":
                self.on_welcome(msg)
                continue
            if isinstance(msg, dict) and msg.get("type") == "reconnect":
                with state.lock:
                    state.ws = None
                    state.reconnect_now = True
                self.ws.close()
                return False
            if not isinstance(msg, dict) or msg.get("type") != "task":
                continue  # "cancel" is advisory: relay has stopped waiting already
            task_id = msg.get("task_id")
            attempt = msg.get("attempt")
            payload = msg.get("payload")
            kind = payload.get("kind") if isinstance(payload, dict) else None
            if draining_since is not None:
                self.send(result(task_id, error="worker shutting down", attempt=attempt))
            elif kind not in KINDS:
                self.send(result(task_id, error=f"unknown task kind: {kind}", attempt=attempt))
            else:
                with state.lock:
                    state.tasks[task_id] = (state.gen, attempt)
                self.pool.submit(self.run_task, task_id, KINDS[kind], payload.get("spec"), attempt)


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

    worker_id = os.environ.get("WORKER_ID") or str(uuid.uuid4())
    if len(worker_id.encode()) > 128:
        print("worker.py: WORKER_ID must be 1 to 128 bytes", file=sys.stderr)
        return 2
    state = State(worker_id, concurrency)

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
                if Session(ws, pool, stop, state).serve():
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
        if state.reconnect_now:
            # relay is restarting: back at once, spread over a second.
            state.reconnect_now, delay, wait = False, 0.25, random.random()
        with state.lock:
            held = state.secret is not None and (state.tasks or state.kept)
        if held and state.window_ms > 0:
            # Back before relay lets go of what it holds for us, however far the backoff grew.
            wait = min(wait, state.window_ms / 4000)
        log("disconnected", reason=reason, retry_in_ms=int(wait * 1000))
        stop.wait(wait)
        delay = min(delay * 2, 30)
    pool.shutdown(wait=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
