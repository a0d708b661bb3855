#!/usr/bin/env bash
# Runs fuzz targets for SECS seconds each (default 60): every target, or the ones named as
# arguments. Installs cargo-fuzz if missing; needs the nightly toolchain. A target starts from
# its corpus (fuzz/corpus/<target>: kept between runs, not committed) plus the committed seeds
# (fuzz/seeds/<target>). Stops at the first crash: libFuzzer leaves the input under
# fuzz/artifacts/<target>/, and `cargo +nightly fuzz run <target> <that file>` replays it.
set -euo pipefail
cd "$(dirname "$0")"
secs=${SECS:-60}
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
targets=${*:-$(cargo +nightly fuzz list)}
for t in $targets; do
  echo "== $t (${secs}s)"
  mkdir -p "corpus/$t"
  dirs=("corpus/$t")
  [ -d "seeds/$t" ] && dirs+=("seeds/$t")
  cargo +nightly fuzz run "$t" "${dirs[@]}" -- -max_total_time="$secs" -rss_limit_mb=2048
done
