#!/usr/bin/env bash
# Profiles relay under the sync load (64 clients, 8 workers, 100-byte payloads): builds relay with
# symbols (the release profile, LTO included, but not stripped, with line tables) into
# target/profiling, starts it, samples it with `perf record` (cpu-clock: this machine has no
# hardware counters; DWARF call graphs, since release code has no frame pointers) while
# `relay-bench drive` loads it, then prints a summary (bench/perf_summary.py: time by kind of work,
# self-time top, relay functions inclusive) and perf's own flat report.
# SECS (default 10) sets the load duration; OUT (default a temp dir) keeps perf.data; RELAY (a
# relay binary with symbols, e.g. one built from an older commit the same way) skips the build and
# profiles that binary instead. relay and perf are stopped by PID before the script exits.
# MODE: `sync` (default: memory-only relay, DATA_DIR empty), `durable` (the same load with the
# journal in OUT/data, which must be on a real disk), or `replay`: TASKS (default 1000000) tasks are
# submitted in batches into a durable relay, relay is stopped, and its restart on that journal is
# profiled from exec to `listening`.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${SECS:-10}
out=${OUT:-$(mktemp -d /tmp/relay-profile.XXXXXX)}
mkdir -p "$out"

relay_bin=${RELAY:-target/profiling/release/relay}
if [ -z "${RELAY:-}" ]; then
  CARGO_PROFILE_RELEASE_STRIP=false CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
    cargo build --release -p relay --target-dir target/profiling
fi
cargo build --release -p relay-bench
target_dir=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')

mode=${MODE:-sync}
data_dir=
case "$mode" in
  sync) ;;
  durable | replay)
    data_dir="$out/data"
    mkdir -p "$data_dir"
    if [ "$(stat -f -c %T "$data_dir")" = tmpfs ]; then
      echo "$data_dir is on tmpfs: set OUT to a directory on a real disk" >&2
      exit 1
    fi
    ;;
  *) echo "MODE must be sync, durable or replay" >&2; exit 2 ;;
esac

# info for the replay (its `journal replayed` line); warn under load, as in relay-bench.
log_level=warn
[ "$mode" = replay ] && log_level=info
relay_env=(PORT=0 BIND=127.0.0.1 API_TOKEN=bench-api-token WORKER_TOKEN=bench-worker-token
  DATA_DIR="$data_dir" LOG_LEVEL=$log_level SHUTDOWN_TIMEOUT=1s BLOB_DIR="$out/blobs"
  TOKEN_STORE="$out/tokens.json" MAX_PENDING=4000000 MAX_PENDING_BYTES=4294967296)
relay_pid=
perf_pid=
cleanup() {
  [ -n "$perf_pid" ] && kill -INT "$perf_pid" 2>/dev/null && wait "$perf_pid" 2>/dev/null
  [ -n "$relay_pid" ] && kill "$relay_pid" 2>/dev/null && wait "$relay_pid" 2>/dev/null
  return 0
}
trap cleanup EXIT

# Waits for relay's `listening` line in $1; prints the address.
listening() {
  local addr=
  for _ in $(seq 1200); do
    addr=$(grep -o 'msg=listening addr=[0-9.:]*' "$1" | head -1 | sed 's/.*addr=//') || true
    [ -n "$addr" ] && { echo "$addr"; return 0; }
    sleep 0.05
  done
  echo "relay did not start:" >&2
  cat "$1" >&2
  return 1
}

env -i "${relay_env[@]}" "$relay_bin" 2>"$out/relay.log" &
relay_pid=$!
addr=$(listening "$out/relay.log")

if [ "$mode" = replay ]; then
  "$target_dir/release/relay-bench" fill --addr "$addr" --replay-tasks "${TASKS:-1000000}"
  kill -TERM "$relay_pid"
  wait "$relay_pid" || true
  relay_pid=
  echo "journal: $(du -sh "$data_dir" | cut -f1) in $data_dir"
  # perf starts relay itself, so the whole start-up is sampled; relay is perf's only child.
  env -i "${relay_env[@]}" perf record -q -e cpu-clock -F 1999 --call-graph dwarf,16384 \
    -o "$out/perf.data" -- "$relay_bin" 2>"$out/relay-restart.log" &
  perf_pid=$!
  listening "$out/relay-restart.log" >/dev/null
  grep 'journal replayed' "$out/relay-restart.log" || true
  relay_pid=$(cat "/proc/$perf_pid/task/$perf_pid/children" | awk '{print $1}')
  kill -TERM "$relay_pid"
  wait "$perf_pid" || true
  perf_pid=
  relay_pid=
else
  # One second of warm-up before sampling starts; sampling ends with the load.
  "$target_dir/release/relay-bench" drive --addr "$addr" --seconds "$((secs + 1))" &
  drive_pid=$!
  sleep 1
  perf record -q -e cpu-clock -F 1999 --call-graph dwarf,16384 -p "$relay_pid" -o "$out/perf.data" \
    -- sleep "$secs" &
  perf_pid=$!
  wait "$drive_pid"
  wait "$perf_pid" || true
  perf_pid=
fi

# `head` may close the pipe early: a SIGPIPE there is not a failure.
set +o pipefail
echo "== summary (bench/perf_summary.py) =="
perf script -i "$out/perf.data" -F ip,sym --no-inline 2>/dev/null | python3 bench/perf_summary.py 20
echo
echo "== perf report, self time, top 30 =="
perf report -i "$out/perf.data" --no-children --sort symbol --stdio -g none 2>/dev/null \
  | grep -v '^#' | grep -v '^$' | sed 's/ *-  *- *$//' | head -30
echo "perf data: $out/perf.data (perf report -i ... to explore)"
