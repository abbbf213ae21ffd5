#!/usr/bin/env bash
# A prefill worker under the memory limit that OOM-killed the motivating deployment's worker
# after 4 requests: kvxfer-bench's peer (the side that serves the KV: READ from it, WRITE into
# it) runs in a memory cgroup of 3.5 GiB and serves concurrency 8 of 273 MB requests (8,344 x
# 32 KiB each, 2.19 GB of KV buffers), over TCP and in-host, READ and WRITE, bytes verified;
# then the cgroup's peak and OOM kills are shown beside the limit and kvxfer's budget. Last,
# a SETUP that cannot fit (concurrency 16) is refused at once with the figures, not OOM-killed.
#
#   sudo scripts/memory-limit.sh            # the full run (release build)
#   sudo scripts/memory-limit.sh --quick    # CI's version: 8 x 16 MiB under 768 MiB
#
# Needs root and a cgroup memory controller (v1 or v2); says SKIP without them.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
[ "${1:-}" = "--quick" ] && quick=1
if [ "$quick" = 1 ]; then
  limit_mib=768 conc=8 blocks=512 bs=32768 budget=64 refuse_conc=64 iters=2
else
  limit_mib=3584 conc=8 blocks=8344 bs=32768 budget=256 refuse_conc=16 iters=3
fi

if [ "$(id -u)" != 0 ]; then echo "SKIP: memory-limit needs root (cgroups)"; exit 0; fi
if [ -n "${KVX_BENCH:-}" ]; then
  bench=$KVX_BENCH
else
  export KVXFER_UCX=${KVXFER_UCX:-system}
  # shellcheck source=scripts/ucx-env.sh
  KVXFER_SPLIT_TARGET=1 source scripts/ucx-env.sh
  cargo build --release --bin kvxfer-bench >&2
  bench=$CARGO_TARGET_DIR/release/kvxfer-bench
fi

# The cgroup: v2 where the unified hierarchy has the memory controller, else v1's.
if [ -f /sys/fs/cgroup/cgroup.controllers ] && grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
  v=2 root=/sys/fs/cgroup
elif [ -d /sys/fs/cgroup/memory ]; then
  v=1 root=/sys/fs/cgroup/memory
else
  echo "SKIP: no cgroup memory controller"; exit 0
fi
cgs=() peers=()
cleanup() {
  for p in "${peers[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  for c in "${cgs[@]}"; do
    for _ in $(seq 50); do rmdir "$c" 2>/dev/null && break; sleep 0.1; done
  done
}
trap cleanup EXIT

mkcg() { # name limit_bytes: makes the cgroup $cg
  cg="$root/kvx-mem-$$-$1"
  mkdir "$cg"
  if [ "$v" = 2 ]; then echo "$2" > "$cg/memory.max"; echo 0 > "$cg/memory.swap.max" 2>/dev/null || true
  else echo "$2" > "$cg/memory.limit_in_bytes"; echo "$2" > "$cg/memory.memsw.limit_in_bytes" 2>/dev/null || true; fi
  cgs+=("$cg")
}
peak() { if [ "$v" = 2 ]; then cat "$1/memory.peak" 2>/dev/null || echo 0; else cat "$1/memory.max_usage_in_bytes"; fi; }
ooms() {
  if [ "$v" = 2 ]; then awk '/^oom_kill /{print $2}' "$1/memory.events"
  else awk '/^oom_kill /{print $2; f=1} END{if(!f) print 0}' "$1/memory.oom_control"; fi
}
start_peer() { # cgroup transport: starts a peer in it; its control address in $ctl, pid in $peer_pid
  local out; out=$(mktemp)
  sh -c "echo \$\$ > '$1/cgroup.procs' && exec '$bench' --listen 127.0.0.1:0 --transport $2 --budget-mib $budget" >"$out" 2>&1 &
  peer_pid=$!
  peers+=("$peer_pid")
  for _ in $(seq 100); do grep -q READY "$out" && break; sleep 0.1; done
  ctl=$(sed -n 's/.*ctl=\([^ ]*\).*/\1/p' "$out" | head -n 1)
  rm -f "$out"
}

limit=$((limit_mib << 20))
echo "== peer (the serving worker) in a memory cgroup v$v of $limit_mib MiB; concurrency $conc x $((blocks * bs)) B"
printf '%-6s %-6s %10s %10s %14s %14s %14s %10s\n' transport op median_ms verified peer_rss_MiB budget_peak_KiB cgroup_peak_MiB oom_kills
fail=0
for t in tcp shm; do
  mkcg "$t" "$limit"
  start_peer "$cg" "$t"
  json=$("$bench" --connect "$ctl" --transport "$t" --op read,write --concurrency "$conc" \
    --blocks "$blocks" --block-size "$bs" --iters "$iters" --warmup 1 --budget-mib "$budget" --json) || fail=1
  while read -r j; do
    [ -z "$j" ] && continue
    python3 - "$j" "$(peak "$cg")" "$(ooms "$cg")" "$t" <<'EOF'
import json, sys
j = json.loads(sys.argv[1]); pk = int(sys.argv[2]); oom = int(sys.argv[3])
print(f"{sys.argv[4]:<6} {j['op']:<6} {j['median_ms']:10.1f} {str(j['verified']):>10} {j['rss_peak_peer_mib']:14.0f} "
      f"{j['budget_peak_peer_mib'] * 1024:14.1f} {pk / 2**20:14.0f} {oom:10d}")
EOF
  done <<< "$(echo "$json" | grep '^{')"
  echo "$json" | grep -q '"verified":false' && fail=1
  [ "$(ooms "$cg")" = 0 ] || fail=1
  [ "$(peak "$cg")" -le "$limit" ] || fail=1
  kill "$peer_pid"; wait "$peer_pid" 2>/dev/null || true
done

echo "== a SETUP that cannot fit: concurrency $refuse_conc under the same limit"
mkcg refuse "$limit"
start_peer "$cg" tcp
if out=$("$bench" --connect "$ctl" --transport tcp --op write --concurrency "$refuse_conc" \
  --blocks "$blocks" --block-size "$bs" --iters 1 --warmup 0 --budget-mib "$budget" 2>&1); then
  echo "not refused: $out"; fail=1
else
  echo "$out" | tail -n 1
  echo "$out" | grep -q "memory limit" || fail=1
fi
echo "oom kills: $(ooms "$cg"), cgroup peak $(( $(peak "$cg") >> 20 )) MiB"
[ "$(ooms "$cg")" = 0 ] || fail=1

if [ "$fail" != 0 ]; then echo "memory-limit: FAILED"; exit 1; fi
echo "memory-limit: ok"
