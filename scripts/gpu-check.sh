#!/usr/bin/env bash
# The GPU check of issue 6, as one prepared run: GPU->GPU KV handoff between two processes on
# one GPU, for the direct path (UCX moves VRAM: cuda_ipc / cuda_copy from the UCX 1.22 wheel)
# and the staged path (pinned host chunks over kvxfer's TCP lane), WRITE and READ, on a
# KV-shaped request (Qwen3-0.6B, 2,371 tokens: 8,344 blocks of 32 KiB = 273 MB at random
# slots). Every run fills the source with a pseudo-random pattern, moves it, copies the
# destination back to the host and compares byte for byte. Prints a table: path, op, lane,
# ms per request, GB/s, ratio to a plain TCP stream of the same bytes in the same run, peak
# host RSS of both processes, verified. A host-memory row (shared-memory lane) is the in-host
# reference.
#
#   scripts/gpu-check.sh bundle   where cargo and PyPI are reachable: builds target/gpu-bundle
#                                 (kvxfer-bench --features cuda against the UCX 1.22 wheel,
#                                 stripped, with the wheel's shared libraries; ~10 MiB), which
#                                 the device tool carries to a machine without network
#                                 (the binary needs glibc >= 2.34, as built on Debian 12).
#   scripts/gpu-check.sh          on the GPU machine: runs the checks with the bundle (building
#                                 it first if it is missing). Under 8 minutes including a build.
#
# GPU_CHECK_RUN_TIMEOUT (seconds, default 150) bounds each of the six runs.
# Without a GPU it says SKIP with the reason and exits 0. GPU_CHECK_MEMORY=sim runs the same
# script on a CPU machine with simulated device memory (a dry run of the script itself; the
# direct path then fails at registration, as it must: UCX cannot reach simulated memory).
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
  if ! timeout "${GPU_CHECK_RUN_TIMEOUT:-150}" "$bench" --model qwen3-0.6b --iters 5 --warmup 2 --reference --json "$@" >>"$out"; then
    echo "{\"label\": \"$label\", \"failed\": true}" >>"$out"
  fi
}
run "host, shm lane (reference)" --memory host --transport shm --op write
for path in direct staged; do
  for op in write read; do
    # Direct: UCX picks its CUDA transports (cuda_ipc inside one host). Staged: the TCP lane.
    transport=auto
    [ "$path" = staged ] && transport=tcp
    run "$mem $path $op" --memory "$mem" --gpu-path "$path" --transport "$transport" --op "$op"
  done
done
# UCX refuses transports that cannot detect a dead peer when peer-failure detection is on
# (kvxfer's default); if the direct rows above show tcp rather than cuda_ipc, this row shows
# what cuda_ipc gives.
run "$mem direct write, peer-failure detection off" --memory "$mem" --gpu-path direct \
  --transport auto --op write --no-peer-failure
# Device memory from the stream-ordered pool (cuMemAllocAsync, cudarc's default; PyTorch's
# cudaMallocAsync backend) cannot be exported by legacy CUDA IPC: UCX then moves it by
# software emulation over its host transports. The rows above use cuMemAlloc (PyTorch's
# default caching allocator).
if [ "$mem" = cuda ]; then
  run "cuda direct write, pool memory" --memory cuda --cuda-alloc pool --gpu-path direct \
    --transport auto --op write
fi

rc=0
python3 - "$out" <<'EOF' || rc=$?
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'memory':<11} {'path':<7} {'op':<6} {'lane':<5} {'ucx transports':<28} {'MB':>5} "
      f"{'ms':>8} {'GB/s':>6} {'x_tcp':>6} {'rss_self':>9} {'rss_peer':>9} {'ok':>5}")
for r in rows:
    if r.get("failed"):
        print(f"{r['label']}: FAILED (see the log above)")
        continue
    mem = r['memory'] + (f"-{r['cuda_alloc']}" if r.get('cuda_alloc') else "")
    print(f"{mem:<11} {str(r.get('gpu_path') or '-'):<7} {r['op']:<6} {r['lane']:<5} "
          f"{r['transport'][:28]:<28} {r['bytes']/1e6:>5.0f} {r['median_ms']:>8.1f} "
          f"{r['gbps']:>6.2f} {r.get('x_tcp', float('nan')):>6.2f} "
          f"{r['rss_peak_self_mib']:>8.0f}M {r['rss_peak_peer_mib']:>8.0f}M {str(r['verified']):>5}")
bad = [r for r in rows if r.get("failed") or not r.get("verified")]
sys.exit(1 if bad else 0)
EOF
echo "gpu-check: $(( $(date +%s) - t0 )) s"
exit $rc
