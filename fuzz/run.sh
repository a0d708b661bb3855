#!/usr/bin/env bash
# Runs every fuzz target for SECS seconds each (default 60). Installs cargo-fuzz if missing;
# needs the nightly toolchain. Stops at the first crash (libFuzzer leaves the input under
# fuzz/artifacts/<target>/).
set -euo pipefail
cd "$(dirname "$0")"
secs=${SECS:-60}
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
targets=$(cargo +nightly fuzz list)
for t in $targets; do
  echo "== $t (${secs}s)"
  cargo +nightly fuzz run "$t" -- -max_total_time="$secs" -rss_limit_mb=2048
done
