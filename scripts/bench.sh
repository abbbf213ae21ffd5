#!/usr/bin/env bash
# The main job: a two-process KV handoff on this machine (one Qwen3-0.6B request, 2,371 tokens
# = 8,344 blocks x 32 KiB = 273,416,192 B at random block slots, and as one region; bytes
# verified), over shared memory and TCP, WRITE and READ, as a short throughput table with
# memcpy and plain-TCP references measured in the same run. Extra arguments go to kvxfer-bench
# (e.g. --json, --iters 10, --ucx-only).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null; then
  echo "kvxfer: cargo (Rust >= 1.87) is needed: https://rustup.rs" >&2
  exit 1
fi
# shellcheck source=scripts/ucx-env.sh
KVXFER_SPLIT_TARGET=1 source scripts/ucx-env.sh
cargo build --release --quiet --bin kvxfer-bench
exec "$CARGO_TARGET_DIR/release/kvxfer-bench" --transport "shm;tcp" --op write,read \
  --placement random,single --reference --iters 7 "$@"
