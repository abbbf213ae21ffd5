#!/usr/bin/env bash
# Soak: 1,000 KV-shaped transfers (one Qwen3-0.6B request each: 8,344 x 32 KiB = 273 MB at
# random slots), alternating READ and WRITE, between kvxfer-bench and its peer process, over
# shared memory and TCP. Every 100th transfer is verified byte for byte; the RSS of both
# processes after the first 10 transfers and at the end is reported; fails on any error, a
# failed check, or RSS growth over 1 MiB.   scripts/soak.sh [transfers]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-1000}
# shellcheck source=scripts/ucx-env.sh
KVXFER_SPLIT_TARGET=1 source scripts/ucx-env.sh
cargo build --release --quiet --bin kvxfer-bench
bench="$CARGO_TARGET_DIR/release/kvxfer-bench"
status=0
for t in shm tcp; do
  out=$("$bench" --soak "$n" --warmup 0 --transport "$t" --json)
  echo "$out" | python3 -c '
import json, sys
j = json.loads(sys.stdin.read())
a, b = j["soak_rss_self_mib_after10"], j["soak_rss_self_mib_end"]
c, d = j["soak_rss_peer_mib_after10"], j["soak_rss_peer_mib_end"]
ok = j["verified"] and j["soak_bad_checks"] == 0 and b - a <= 1.0 and d - c <= 1.0
print("soak %s (%s lane): %d transfers of %d B, %d checks, %d bad; median %.1f ms; "
      "RSS self %.1f -> %.1f MiB (%+.2f), peer %.1f -> %.1f MiB (%+.2f): %s" % (
      j["transport_requested"], j["lane"], j["soak_transfers"], j["bytes"], j["soak_checks"],
      j["soak_bad_checks"], j["median_ms"], a, b, b - a, c, d, d - c, "ok" if ok else "FAILED"))
sys.exit(0 if ok else 1)
' || status=1
done
exit $status
