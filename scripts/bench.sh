#!/usr/bin/env bash
# The main job: a two-process KV handoff on this machine (one Qwen3-0.6B request, 2,371 tokens
# = 8,344 blocks x 32 KiB = 273,416,192 B at random block slots, bytes verified), over TCP and
# shared memory, READ and WRITE, as a short throughput table. Extra arguments go to every run.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null; then
  echo "kvxfer: cargo (Rust >= 1.85) is needed: https://rustup.rs" >&2
  exit 1
fi
# shellcheck source=scripts/ucx-env.sh
source scripts/ucx-env.sh
cargo build --release --quiet --bin kvxfer-bench
bench="$CARGO_TARGET_DIR/release/kvxfer-bench"
first=1
for t in shm tcp; do
  for op in write read; do
    out=$("$bench" --transport "$t" --op "$op" "$@")
    if [ $first = 1 ]; then echo "$out"; first=0; else echo "$out" | tail -n 1; fi
  done
done
