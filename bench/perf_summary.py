#!/usr/bin/env python3
"""Summarises `perf script -F ip,sym --no-inline` output of relay (DWARF call graphs) into:
where the time goes by kind of work (each sample counted once, by the first rule its stack
matches), the flat self-time top, and the inclusive share of relay's own functions.

usage: perf script -i perf.data -F ip,sym --no-inline | bench/perf_summary.py [TOP]
"""

import collections
import re
import sys

# (bucket, predicate over the stack: list of symbols, leaf first). First match wins.
KERNEL_SEND = ("__x64_sys_sendto", "__x64_sys_write", "__x64_sys_writev")
RULES = [
    ("kernel: rescheduled on return from a syscall (preempted; the sample lands when relay resumes)",
     lambda s: has(s, ("exit_to_user_mode_loop",)) and has(s, ("schedule", "__schedule"))),
    ("kernel: send, waking the peer thread (loopback softirq: sock_def_readable)",
     lambda s: has(s, KERNEL_SEND) and has(s, ("sock_def_readable", "try_to_wake_up", "__wake_up_common"))),
    ("kernel: send, loopback delivery to the peer's socket (softirq, TCP receive side)",
     lambda s: has(s, KERNEL_SEND) and has(s, ("net_rx_action",))),
    ("kernel: send, TCP transmit (own side)", lambda s: has(s, KERNEL_SEND)),
    ("kernel: recv", lambda s: has(s, ("__x64_sys_recvfrom", "__x64_sys_read"))),
    ("kernel: epoll_wait (incl. going to sleep and waking up)",
     lambda s: has(s, ("__x64_sys_epoll_wait", "do_epoll_wait", "__x64_sys_epoll_pwait"))),
    ("kernel: page faults (heap growth)", lambda s: has(s, ("asm_exc_page_fault",))),
    ("kernel: accept/close/other syscalls", lambda s: has(s, ("do_syscall_64",))),
    ("kernel: interrupts, scheduler, other", lambda s: is_kernel_leaf(s)),
    ("user: malloc/realloc/free", lambda s: leaf_in(s, ("malloc", "_int_malloc", "_int_free", "free", "realloc",
                                                        "_int_realloc", "cfree", "malloc_consolidate",
                                                        "unlink_chunk", "__libc_malloc", "__libc_free",
                                                        "__libc_realloc", "tcache"))),
    ("user: memcpy/memmove/memset", lambda s: leaf_match(s, r"mem(cpy|move|set|cmp)|__memmove|__memcpy|__memset")),
    ("user: task JSON output (Task::write_json, push_*, timefmt, core::fmt)",
     lambda s: has_re(s, r"relay::tasks::|relay::timefmt::") or leaf_match(s, r"core::fmt|Display|pad_integral|write_str")),
    ("user: JSON parsing (serde_json)", lambda s: leaf_match(s, r"serde_json|serde")),
    ("user: WebSocket framing (tungstenite)", lambda s: leaf_match(s, r"tungstenite")),
    ("user: HTTP head parsing (httparse)", lambda s: leaf_match(s, r"httparse")),
    ("user: token digest (sha2, auth)", lambda s: leaf_match(s, r"sha2|relay::auth")),
    ("user: hash maps (hashbrown, hashers)", lambda s: leaf_match(s, r"hashbrown|Hasher|hash")),
    ("user: uuid", lambda s: leaf_match(s, r"uuid|getrandom|rand")),
    ("user: relay dispatch core", lambda s: leaf_match(s, r"relay::dispatch")),
    ("user: relay reactor/conn/http/api", lambda s: leaf_match(s, r"relay::(reactor|conn|http|api)")),
    ("user: other", lambda s: True),
]


def has(stack, names):
    return any(f in names for f in stack)


def has_re(stack, pattern):
    rx = re.compile(pattern)
    return any(rx.search(f) for f in stack)


def leaf_in(stack, names):
    return bool(stack) and stack[0] in names


def leaf_match(stack, pattern):
    return bool(stack) and re.search(pattern, stack[0]) is not None


KERNEL_IP = re.compile(r"^ffffffff")


def is_kernel_leaf(stack):
    return bool(stack) and stack[0].startswith("[k]")


def samples(lines):
    """Yields stacks (leaf first); kernel frames are prefixed with [k] only for is_kernel_leaf."""
    stack = []
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            if stack:
                yield stack
            stack = []
            continue
        parts = line.split(None, 1)
        if len(parts) < 2 or not re.fullmatch(r"[0-9a-f]+", parts[0]):
            continue  # header line of a sample
        ip, sym = parts
        sym = re.sub(r"\+0x[0-9a-f]+$", "", sym.strip())
        sym = re.sub(r" \(.*\)$", "", sym)
        if KERNEL_IP.match(ip) and not stack:
            stack.append("[k]" + sym)
            stack.append(sym)
        else:
            stack.append(sym)
    if stack:
        yield stack


def main():
    top = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    buckets = collections.Counter()
    selfs = collections.Counter()
    inclusive = collections.Counter()
    total = 0
    for stack in samples(sys.stdin):
        total += 1
        leaf = stack[0]
        kernel = leaf.startswith("[k]")
        frames = stack[1:] if kernel else stack
        selfs[("[k] " if kernel else "") + frames[0]] += 1
        for f in set(frames):
            if f.startswith("relay::"):
                inclusive[f] += 1
        for name, rule in RULES:
            if rule(stack):
                buckets[name] += 1
                break
    if total == 0:
        print("no samples")
        return
    pct = lambda n: 100.0 * n / total
    print(f"{total} samples\n")
    print("| where the time goes (each sample once) | share |\n|---|---:|")
    for name, _ in RULES:
        if buckets[name]:
            print(f"| {name} | {pct(buckets[name]):.1f}% |")
    print(f"\n| top {top} symbols by self time | share |\n|---|---:|")
    for sym, n in selfs.most_common(top):
        print(f"| `{sym}` | {pct(n):.1f}% |")
    print(f"\n| relay functions, inclusive (callees included) | share |\n|---|---:|")
    for sym, n in inclusive.most_common(top):
        print(f"| `{sym}` | {pct(n):.1f}% |")


if __name__ == "__main__":
    main()
