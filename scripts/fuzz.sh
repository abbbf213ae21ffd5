#!/usr/bin/env bash
# Fuzzes every decoder of peer input (cargo fuzz, libFuzzer, nightly toolchain) for
# ${1:-600} seconds each and prints one line per target: runs, corpus, crashes.
#   scripts/fuzz.sh 600        # 10 minutes per target, as the reliability issue asks
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-600}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
# The fuzz crate depends on kvxfer-proto alone: no UCX, no libclang needed.
unset CARGO_TARGET_DIR # cargo fuzz builds in fuzz/target
cd fuzz
for t in metadata side_channel notification tcp_lane handoff control; do
  mkdir -p "corpus/$t"
  log="target/fuzz-$t.log"
  mkdir -p target
  start=$(date +%s)
  if cargo +nightly fuzz run "$t" "corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=2048 >"$log" 2>&1; then
    result=ok
  else
    result="FAILED (see fuzz/$log and fuzz/artifacts/$t)"
  fi
  runs=$(grep -o 'Done [0-9]* runs' "$log" | tail -n1 | cut -d' ' -f2)
  corpus=$(find "corpus/$t" -type f | wc -l)
  echo "fuzz $t: ${result}; $((($(date +%s) - start))) s, ${runs:-?} runs, corpus $corpus inputs"
done
