#!/usr/bin/env bash
# One sitting, runs alternated: kvxfer's lanes, kvxfer --ucx-only on Debian's UCX 1.13 and on
# the UCX 1.22 wheel, NIXL 1.5.1 (its own UCX 1.23), with memcpy and plain-TCP references
# measured inside the kvxfer runs; every op x placement x transport (tcp, shm) on the KV-shaped
# request (8,344 x 32 KiB = 273 MB); the UCX path on memfd host memory and on transparent huge
# pages (`--memory thp`; NIXL's numpy buffers are on huge pages). ROUNDS rounds, each running every implementation once in
# turn (ABCD ABCD ...); prints a table of medians over the rounds' medians and writes all JSON
# lines to OUT (default target/compare.jsonl).
#
#   scripts/compare.sh [ROUNDS] [ITERS]
#
# NIXL is measured only where /tmp/nixlvenv (or $NIXL_PY) has it:
#   python3 -m venv /tmp/nixlvenv && /tmp/nixlvenv/bin/pip install numpy
#   /tmp/nixlvenv/bin/pip install --no-deps nixl-cu12==1.5.1
# BEFORE=path/to/an/older/kvxfer-bench (built against Debian's UCX) adds that binary's lane and
# --ucx-only runs as "before"; BEFORE_WHEEL=path (the same commit built with KVXFER_UCX=wheel)
# adds its --ucx-only runs on UCX 1.22 (without it, this build with kvxfer's UCX settings
# reverted stands in, labelled "before: ucx settings reverted").
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-3}"
ITERS="${2:-5}"
OUT="${OUT:-target/compare.jsonl}"
NIXL_PY="${NIXL_PY:-/tmp/nixlvenv/bin/python}"
mkdir -p "$(dirname "$OUT")"
: >"$OUT"

build() {
  # shellcheck source=scripts/ucx-env.sh
  (export KVXFER_UCX="$1" KVXFER_SPLIT_TARGET=1; source scripts/ucx-env.sh >&2
   cargo build --release --quiet --bin kvxfer-bench >&2; echo "$CARGO_TARGET_DIR/release/kvxfer-bench")
}
SYS="$(build system)"
WHEEL="$(build wheel)"
WHEEL_LIB="$PWD/.ucx/1.22.0/libucx/lib"
COMMON=(--op write,read --placement random,single --iters "$ITERS" --json)

tag() { python3 -c 'import sys,json
impl=sys.argv[1]
for l in sys.stdin:
    l=l.strip()
    if l.startswith("{"):
        r=json.loads(l); r["impl"]=impl; print(json.dumps(r))' "$1"; }

for r in $(seq 1 "$ROUNDS"); do
  echo "round $r/$ROUNDS" >&2
  "$SYS" --transport "shm;tcp" --reference "${COMMON[@]}" | tag "kvxfer lanes" >>"$OUT"
  "$SYS" --transport "shm;tcp" --ucx-only "${COMMON[@]}" | tag "kvxfer ucx-only" >>"$OUT"
  LD_LIBRARY_PATH="$WHEEL_LIB" "$WHEEL" --transport "shm;tcp" --ucx-only "${COMMON[@]}" \
    | tag "kvxfer ucx-only" >>"$OUT"
  # The same on transparent huge pages (HostBuffer::huge), as NIXL's numpy buffers are.
  "$SYS" --transport "shm;tcp" --ucx-only --memory thp "${COMMON[@]}" \
    | tag "kvxfer ucx-only" >>"$OUT"
  LD_LIBRARY_PATH="$WHEEL_LIB" "$WHEEL" --transport "shm;tcp" --ucx-only --memory thp \
    "${COMMON[@]}" | tag "kvxfer ucx-only" >>"$OUT"
  if [ -n "${BEFORE:-}" ]; then
    "$BEFORE" --transport "shm;tcp" "${COMMON[@]}" | tag "before: kvxfer lanes" >>"$OUT"
    "$BEFORE" --transport "shm;tcp" --ucx-only "${COMMON[@]}" \
      | tag "before: kvxfer ucx-only" >>"$OUT"
  fi
  if [ -n "${BEFORE_WHEEL:-}" ]; then
    LD_LIBRARY_PATH="$WHEEL_LIB" "$BEFORE_WHEEL" --transport "shm;tcp" --ucx-only \
      "${COMMON[@]}" | tag "before: kvxfer ucx-only" >>"$OUT"
  elif [ -n "${BEFORE:-}" ]; then
    # Without an older wheel build: this build with the UCX settings kvxfer now applies
    # reverted to UCX's own (a user's UCX_* wins), labelled as such.
    UCX_RNDV_THRESH=auto UCX_TCP_TX_SEG_SIZE=8k LD_LIBRARY_PATH="$WHEEL_LIB" "$WHEEL" \
      --transport "shm;tcp" --ucx-only "${COMMON[@]}" \
      | tag "before: ucx settings reverted" >>"$OUT"
  fi
  if [ -x "$NIXL_PY" ]; then
    for t in tcp shm; do
      timeout 300 "$NIXL_PY" scripts/nixl-bench.py --transport "$t" --iters "$ITERS" 2>/dev/null \
        | tag "nixl 1.5.1" >>"$OUT" || echo "nixl-bench $t failed" >&2
    done
  fi
done

python3 - "$OUT" <<'EOF'
import json, statistics, sys
from collections import defaultdict
runs = defaultdict(list)
refs = defaultdict(lambda: defaultdict(list))
for l in open(sys.argv[1]):
    r = json.loads(l)
    t = r.get("transport_requested") or r["transport"]
    ucx = r.get("ucx_version") or r.get("ucx", "")
    if r["impl"].startswith("nixl"):
        ucx = "1.23 (bundled)"
    impl = r["impl"]
    if r.get("memory") == "thp":
        impl += " thp"
    key = (r["op"], r["placement"], t)
    runs[(key, impl, ucx)].append(r["median_ms"])
    for f in ("memcpy_ms", "tcp_ms", "tcp_mem_ms"):
        if r.get(f):
            refs[key][f].append(r[f])
print(f"{'op':6} {'placement':9} {'transport':9} {'implementation':28} {'UCX':15} {'median ms':>9} {'x plain TCP':>11} {'x memcpy':>8}")
for (key, impl, ucx), v in sorted(runs.items()):
    m = statistics.median(v)
    tcp = statistics.median(refs[key]["tcp_ms"]) if refs[key]["tcp_ms"] else float("nan")
    mc = statistics.median(refs[key]["memcpy_ms"]) if refs[key]["memcpy_ms"] else float("nan")
    print(f"{key[0]:6} {key[1]:9} {key[2]:9} {impl:28} {ucx:15} {m:9.1f} {m/tcp:11.2f} {m/mc:8.2f}")
for key in sorted(refs):
    rr = refs[key]
    print(f"{key[0]:6} {key[1]:9} {key[2]:9} reference: memcpy {statistics.median(rr['memcpy_ms']):.1f} ms, "
          f"plain TCP {statistics.median(rr['tcp_ms']):.1f} ms, TCP through transfer-sized buffers "
          f"{statistics.median(rr['tcp_mem_ms']):.1f} ms")
EOF
