#!/usr/bin/env bash
# Soak test: minutes of mixed load against the release relay while workers join, die and
# misbehave (real relay-worker processes killed, drained and restarted; fake workers that leave,
# never answer, cut their connection mid-task or answer wrongly). Prints tasks submitted, done,
# failed, canceled and lost, relay's RSS and open fds at the start and the end, and exits
# non-zero if a task was lost, an answer was wrong, relay died, or its fds or RSS did not come
# back after the load (the bounds are documented in bench/src/soak.rs and bench/README.md).
#
#   scripts/soak.sh                     # 10 minutes of load (two halves), about 11 in all
#   SOAK_SECS=120 scripts/soak.sh       # shorter
#   scripts/soak.sh --soak-clients 16   # more clients (default 8); other relay-bench options too
#
# Everything it starts it stops by PID; it only uses loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p relay -p relay-worker -p relay-bench
target_dir=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
exec "$target_dir/release/relay-bench" soak --soak-secs "${SOAK_SECS:-600}" "$@"
