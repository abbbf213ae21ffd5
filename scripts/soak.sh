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
source scripts/ucx-env.sh
cargo build --release --quiet --bin kvxfer-bench
bench="$CARGO_TARGET_DIR/release/kvxfer-bench"
status=0
for t in shm tcp; do
  out=$("$bench" --soak "$n" --warmup 0 --transport "$t" --json)
  echo "$out" | python3 -c '
import json, sys
j = json.loads(sys.stdin.read())
g_self = j["soak_rss_self_mib_end"] - j["soak_rss_self_mib_after10"]
g_peer = j["soak_rss_peer_mib_end"] - j["soak_rss_peer_mib_after10"]
ok = j["verified"] and j["soak_bad_checks"] == 0 and g_self <= 1.0 and g_peer <= 1.0
print(f"soak {j[\"transport_requested\"]} ({j[\"lane\"]} lane): {j[\"soak_transfers\"]} transfers of {j[\"bytes\"]} B, "
      f"{j[\"soak_checks\"]} checks, {j[\"soak_bad_checks\"]} bad; median {j[\"median_ms\"]:.1f} ms; "
      f"RSS self {j[\"soak_rss_self_mib_after10\"]:.1f} -> {j[\"soak_rss_self_mib_end\"]:.1f} MiB ({g_self:+.2f}), "
      f"peer {j[\"soak_rss_peer_mib_after10\"]:.1f} -> {j[\"soak_rss_peer_mib_end\"]:.1f} MiB ({g_peer:+.2f}): "
      + ("ok" if ok else "FAILED"))
sys.exit(0 if ok else 1)
' || status=1
done
exit $status
