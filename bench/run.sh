#!/usr/bin/env bash
# The whole benchmark in one command: builds relay (dynamic, and static for the size figure), the
# load generator, makes sure nats-server is installed, runs every scenario and prints one table.
# Arguments go to relay-bench (e.g. `bench/run.sh sync nats --measure-ms 8000`; `--help`).
# Set NO_STATIC=1 to skip the static build. Everything it starts is stopped by PID before it exits.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nats-server >/dev/null 2>&1; then
  echo "bench: installing nats-server (Debian package)" >&2
  apt-get update -qq && apt-get install -y -qq nats-server >/dev/null
  # The package enables a system service on :4222; the bench starts its own on a free port.
  if command -v systemctl >/dev/null 2>&1; then
    systemctl disable --now nats-server >/dev/null 2>&1 || true
  fi
fi

cargo build --release -p relay -p relay-bench
target_dir=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
args=()
if [ -z "${NO_STATIC:-}" ]; then
  # The static build from the issue: a static-pie with LTO, stripped by the release profile.
  RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --target x86_64-unknown-linux-gnu -p relay
  args+=(--relay-static "$target_dir/x86_64-unknown-linux-gnu/release/relay")
fi
exec "$target_dir/release/relay-bench" "${args[@]}" "$@"
