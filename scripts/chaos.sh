#!/usr/bin/env bash
# Chaos through the connector for a given time (examples/chaos): KV-shaped handoffs from a
# prefill worker process to a decode worker process, pull and push, partial and full, over
# TCP and in-host, while the driver SIGKILLs and restarts either worker and SIGSTOPs either
# past its lease; as root, also over TCP between two network namespaces with the link cut
# and restored. Each run prints one JSON line: handoffs, completed and verified byte for
# byte, failed (typed, with their blocks), stuck, died with a killed decode worker, faults of
# each kind, blocks held by the producer at the end, the surviving workers' RSS (after their
# first seconds, and at the end) and the most any incarnation's RSS grew beyond what its
# 64 MiB memory budget held then (a killed one measured just before its kill). Exits 1 if
# anything was lost or an RSS grew so by 32 MiB. CI runs a short version (tests/chaos.rs).
#
#   scripts/chaos.sh          # 150 s per run (6 runs, 8 as root)
#   scripts/chaos.sh 600
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-150}
export KVXFER_UCX=${KVXFER_UCX:-system}
# shellcheck source=scripts/ucx-env.sh
KVXFER_SPLIT_TARGET=1 source scripts/ucx-env.sh
cargo build --release --example chaos >&2
chaos="$CARGO_TARGET_DIR/release/examples/chaos"
for t in tcp shm; do
  for m in pull push; do
    "$chaos" --seconds "$secs" --mode "$m" --transport "$t" --seed "$RANDOM"
  done
done
# A hostile peer beside them (HELLO floods, stalled lane requests, garbage): TCP only, since
# it speaks to the prefill worker's side channel and TCP lane.
for m in pull push; do
  "$chaos" --seconds "$secs" --mode "$m" --transport tcp --hostile --seed "$RANDOM"
done
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null; then
  for m in pull push; do
    "$chaos" --seconds "$secs" --mode "$m" --transport tcp --netns --seed "$RANDOM"
  done
else
  echo "chaos: link cuts skipped (they need root and iproute2)" >&2
fi
