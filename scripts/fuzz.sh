#!/usr/bin/env bash
# Fuzzes every decoder (the targets in fuzz/fuzz_targets: metadata, side channel and its
# listener's handshake, notifications, the TCP lane, handoffs, connector control messages,
# the shm and device lanes' hand-over frames, the UCX fence)
# for a fixed time each, with libFuzzer through cargo-fuzz (nightly), growing the corpus kept
# in the repo (fuzz/corpus/<target>, minimised after the run). A crash fails the script and
# leaves its input in fuzz/artifacts/<target>.
#
#   scripts/fuzz.sh            # 60 s per target
#   scripts/fuzz.sh 10         # CI's short version
#   scripts/fuzz.sh 600 tcp_lane
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-60}
shift || true
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
targets=("$@")
[ ${#targets[@]} -eq 0 ] && mapfile -t targets < <(cargo +nightly fuzz list)
printf '%-14s %10s %10s %8s\n' target execs corpus seconds
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  log=$(mktemp)
  if ! cargo +nightly fuzz run "$t" "corpus/$t" -- -max_total_time="$secs" -max_len=4096 \
    -print_final_stats=1 >"$log" 2>&1; then
    tail -n 40 "$log"
    echo "fuzz: $t FAILED (input in fuzz/artifacts/$t)"
    exit 1
  fi
  # Keep the corpus small: only inputs that add coverage.
  cargo +nightly fuzz cmin "$t" "corpus/$t" >/dev/null 2>&1 || true
  execs=$(awk '/stat::number_of_executed_units/ {print $2}' "$log")
  printf '%-14s %10s %10s %8s\n' "$t" "${execs:-?}" "$(ls "corpus/$t" | wc -l)" "$secs"
  rm -f "$log"
done
echo "fuzz: ok"
