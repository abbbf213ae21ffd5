#!/usr/bin/env bash
# The GPU checks of issues 6 and 36, as one prepared run: GPU->GPU KV handoff between two
# processes on one GPU. The device lane (kvxfer's own: CUDA IPC, a request as one table of
# copies run by one kernel launch) alternated with UCX's cuda_ipc (the lane off), random slots
# and one region, WRITE and READ; the staged path (pinned chunks, one gather launch per
# chunk, over the TCP lane) alternated with the host TCP lane for the same bytes;
# virtual-memory (expandable-segment) buffers; pool memory; a Llama-3-70B-shaped 32k-token
# request. Qwen3-0.6B otherwise (2,371 tokens: 8,344 blocks of 32 KiB = 273 MB). Every
# iteration clears the destination, moves, copies it back and compares byte for byte
# (--verify-each, not timed); medians of 5. Prints a table: case, lane, ms per request, GB/s,
# device submissions per request and microseconds per submission, ratio to a plain TCP
# stream of the same bytes in the same run, peak host RSS of the peer, verified.
#
#   scripts/gpu-check.sh bundle   where cargo and PyPI are reachable: builds target/gpu-bundle
#                                 (kvxfer-bench --features cuda against the UCX 1.22 wheel,
#                                 stripped, with the wheel's shared libraries; ~10 MiB), which
#                                 the device tool carries to a machine without network
#                                 (the binary needs glibc >= 2.34, as built on Debian 12).
#   scripts/gpu-check.sh          on the GPU machine: runs the checks with the bundle (building
#                                 it first if it is missing). Under 8 minutes including a build.
#
# GPU_CHECK_RUN_TIMEOUT (seconds, default 150) bounds each run (the 70B row: 300).
# Without a GPU it says SKIP with the reason and exits 0. GPU_CHECK_MEMORY=sim runs the same
# script on a CPU machine with simulated device memory (a dry run of the script itself: the
# device lane runs between the two processes' simulated devices; UCX's cuda_ipc rows are left
# out: UCX cannot reach simulated memory).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bundle="$root/target/gpu-bundle"

make_bundle() {
  export KVXFER_UCX=wheel
  # shellcheck source=scripts/ucx-env.sh
  KVXFER_SPLIT_TARGET=1 source scripts/ucx-env.sh
  cargo build --release --features cuda --bin kvxfer-bench
  rm -rf "$bundle"
  mkdir -p "$bundle/bin" "$bundle/lib/ucx"
  cp "$CARGO_TARGET_DIR/release/kvxfer-bench" "$bundle/bin/"
  strip "$bundle/bin/kvxfer-bench"
  # The sonames only (the wheel holds copies, not links), UCX's perftest modules left out,
  # stripped: the bundle must fit the device tool's 64 MiB carry.
  cp "$KVXFER_UCX_PREFIX"/lib/lib*.so.0 "$bundle/lib/"
  for m in "$KVXFER_UCX_PREFIX"/lib/ucx/lib*.so.0; do
    case "$m" in *perftest*) ;; *) cp "$m" "$bundle/lib/ucx/" ;; esac
  done
  strip --strip-unneeded "$bundle"/lib/*.so.0 "$bundle"/lib/ucx/*.so.0
  # The wheel's vendored libraries (libucm_cuda needs its own libcudart-<hash>.so.12), which
  # the modules find through an rpath into the wheel's tree: here through LD_LIBRARY_PATH.
  cp "$KVXFER_UCX_PREFIX"/../libucx_cu12.libs/*.so* "$bundle/lib/"
  cp "$KVXFER_UCX_BIN/ucx_info" "$bundle/bin/"
  du -sh "$bundle"
}

if [ "${1:-}" = bundle ]; then
  make_bundle
  exit 0
fi

t0=$(date +%s)
mem="${GPU_CHECK_MEMORY:-cuda}"
if [ "$mem" = cuda ] && { ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L; }; then
  echo "gpu-check: SKIP: no NVIDIA GPU or driver on this machine (nvidia-smi unavailable or failed)"
  exit 0
fi
[ -x "$bundle/bin/kvxfer-bench" ] || make_bundle
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export UCX_LOG_LEVEL="${UCX_LOG_LEVEL:-error}"
bench="$bundle/bin/kvxfer-bench"
echo "== UCX transports for CUDA memory"
"$bundle/bin/ucx_info" -v | head -2 || true
"$bundle/bin/ucx_info" -d 2>/dev/null | grep -E "Transport: (cuda|gdr)" | sort -u || true

out="$(mktemp)"
trap 'rm -f "$out"' EXIT
run() {
  local label="$1"
  shift
  echo "== $label" >&2
  local line defaults=()
  # Qwen3-0.6B and 2 warm-ups unless the row names its own; medians of 5.
  [[ " $* " == *" --model "* ]] || defaults+=(--model qwen3-0.6b)
  [[ " $* " == *" --warmup "* ]] || defaults+=(--warmup 2)
  # The plain TCP stream of the same bytes, in the same run (x_tcp), unless the row is too
  # large to stream it five times in its time.
  [ -n "${GPU_CHECK_NO_REF:-}" ] || defaults+=(--reference)
  if line="$(timeout "${GPU_CHECK_RUN_TIMEOUT:-150}" "$bench" "${defaults[@]}" --iters 5 \
      --json "$@")"; then
    echo "$line" | python3 -c 'import json,sys; l=sys.argv[1]
for x in sys.stdin:
    if x.strip(): r=json.loads(x); r["label"]=l; print(json.dumps(r))' "$label" >>"$out"
  else
    echo "{\"label\": \"$label\", \"failed\": true}" >>"$out"
  fi
}
run "host, shm lane (reference)" --memory host --transport shm --op write
# The device lane against UCX's cuda_ipc (the lane off), alternated (ABAB), random slots,
# every iteration verified; then the same bytes as one region (contiguous on both sides),
# the lane's READ, and the staged path against the host TCP lane for the same bytes.
for round in 1 2; do
  run "$mem device lane write r$round" --memory "$mem" --gpu-path auto --transport auto \
    --op write --verify-each
  # UCX cannot reach simulated memory: on the dry run this row is left out.
  [ "$mem" = sim ] || run "$mem ucx cuda_ipc write r$round" --memory "$mem" --gpu-path direct \
    --transport auto --op write --verify-each --no-device-lane --no-peer-failure
done
run "$mem device lane write, one region" --memory "$mem" --gpu-path auto --transport auto \
  --op write --placement contiguous --verify-each
# The driver's batch copy (cuMemcpyBatchAsync, CUDA 12.8) instead of the copy kernel, for the
# device lane and for the staged path's gathers: which wins where.
export KVXFER_DEVICE_COPY=driver
run "$mem device lane write, driver batch" --memory "$mem" --gpu-path auto --transport auto \
  --op write --verify-each
run "$mem staged write, driver batch" --memory "$mem" --gpu-path staged --transport tcp \
  --op write --verify-each --no-device-lane
unset KVXFER_DEVICE_COPY
run "$mem device lane read" --memory "$mem" --gpu-path auto --transport auto --op read \
  --verify-each
# A grant-only cache (shared with the initiator only, with a secret): no device export, so
# it is staged at both ends over the TCP lane, whose target checks the share set. What that
# check costs in-host against the device lane rows above.
run "$mem shared-only write (checked)" --memory "$mem" --gpu-path auto --transport auto \
  --op write --verify-each --secret gpu-check --shared-only
for round in 1 2; do
  run "$mem staged write r$round" --memory "$mem" --gpu-path staged --transport tcp \
    --op write --verify-each --no-device-lane
  run "host tcp lane write r$round" --memory host --transport tcp --op write --verify-each
done
if [ "$mem" = cuda ]; then
  # Virtual-memory buffers (PyTorch's expandable segments): the device lane, not refused,
  # not emulated.
  run "cuda vmm device lane write" --memory cuda --cuda-alloc vmm --gpu-path direct \
    --transport auto --op write --verify-each
  # Pool memory (cuMemAllocAsync) cannot be opened by another process: it takes the staged
  # path (lane tcp), said at registration, never UCX's emulation (--gpu-path direct would be
  # refused, typed).
  run "cuda pool write" --memory cuda --cuda-alloc pool --gpu-path auto --transport auto \
    --op write --verify-each
  # A Llama-3-70B-shaped 32k-token request: 80 layers x 2 x 2,048 blocks of 32 KiB (10.7 GB
  # a side), the device lane, every iteration verified.
  GPU_CHECK_RUN_TIMEOUT=300 GPU_CHECK_NO_REF=1 run "cuda device lane write, llama-3-70b 32k" --memory cuda \
    --gpu-path direct --transport auto --op write --model llama-3-70b --tokens 32768 \
    --verify-each --warmup 1
fi

rc=0
python3 - "$out" <<'EOF' || rc=$?
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'case':<34} {'lane':<6} {'ucx transports':<22} {'MB':>6} {'ms':>8} {'GB/s':>7} "
      f"{'subm':>5} {'us/sub':>7} {'x_tcp':>6} {'rss_peer':>9} {'ok':>5}")
for r in rows:
    if r.get("failed"):
        print(f"{r['label']}: FAILED (see the log above)")
        continue
    alloc = f" [{r['device_alloc']}]" if r.get('device_alloc') else ""
    print(f"{(r['label'] + alloc)[:34]:<34} {r['lane']:<6} {r['transport'][:22]:<22} "
          f"{r['bytes']/1e6:>6.0f} {r['median_ms']:>8.2f} {r['gbps']:>7.2f} "
          f"{r.get('submissions', 0):>5} {r.get('us_per_submission', float('nan')):>7.1f} "
          f"{r.get('x_tcp', float('nan')):>6.2f} {r['rss_peak_peer_mib']:>8.0f}M "
          f"{str(r['verified']):>5}")
bad = [r for r in rows if r.get("failed") or not r.get("verified")]
sys.exit(1 if bad else 0)
EOF
echo "gpu-check: $(( $(date +%s) - t0 )) s"
exit $rc
