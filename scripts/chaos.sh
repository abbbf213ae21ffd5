#!/usr/bin/env bash
# Chaos through the connector for a given time (examples/chaos.rs): KV-shaped handoffs
# between a prefill worker process and a decode worker, pull and push, partial and full,
# over TCP and in-host, while the prefill worker is SIGKILLed and restarted and SIGSTOPped
# past its lease. Each run prints one JSON line: handoffs, completed and verified byte for
# byte, failed (typed, with their blocks), stuck, blocks held by the producer at the end,
# and the decode worker's RSS after 400 requests and at the end. Exits 1 if anything was
# lost. CI runs a short version (tests/chaos.rs).
#
#   scripts/chaos.sh          # 150 s per mode x transport (4 runs)
#   scripts/chaos.sh 600
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-150}
export KVXFER_UCX=${KVXFER_UCX:-system}
# shellcheck source=scripts/ucx-env.sh
KVXFER_SPLIT_TARGET=1 source scripts/ucx-env.sh
cargo build --release --example chaos >&2
for t in tcp shm; do
  for m in pull push; do
    "$CARGO_TARGET_DIR/release/examples/chaos" --seconds "$secs" --mode "$m" --transport "$t" --seed "$RANDOM"
  done
done
