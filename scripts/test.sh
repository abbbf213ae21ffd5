#!/usr/bin/env bash
# Runs every test: the vLLM plugin's tests against the real vllm==0.33.0; formatting, lints,
# unit / loopback / cross-process / C ABI tests against Debian's UCX (the default); then the
# Rust suite against the UCX 1.22 wheel. Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null; then
  echo "kvxfer: cargo (Rust >= 1.87) is needed: https://rustup.rs" >&2
  exit 1
fi
export CARGO_TERM_COLOR=never
# One pass over fresh builds: incremental state only helps an edit loop, and costs disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# KVXFER_PRUNE=1 (CI): each stage's build directory is removed once no later stage needs it.
prune() {
  echo "kvxfer: disk after the stage: target $(du -sh target 2>/dev/null | cut -f1), $(df -h --output=avail . | tail -n 1 | tr -d ' ') free"
  if [ "${KVXFER_PRUNE:-0}" = 1 ]; then rm -rf "$@"; fi
}
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# A real etcd for discovery tests (etcd-client needs protoc to build; openssl makes the
# certificates of the TLS cases).
for p in etcd-server protobuf-compiler openssl; do
  dpkg -s "$p" >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$p" >/dev/null; }
done

# The plugin first: its venv (vLLM with torch: ~9.5 GB, the clone less its target
# directories in a fresh-clone run) is gone before the Rust builds grow.
echo "== vLLM plugin against the real vllm==0.33.0 (CPU)"
(
  export KVXFER_UCX=system
  # shellcheck source=scripts/ucx-env.sh
  KVXFER_SPLIT_TARGET=1 source scripts/ucx-env.sh
  scripts/vllm-env.sh
  # With etcd discovery (python/tests/test_etcd.py).
  cargo build -p kvxfer-capi --features etcd
  out=$(KVXFER_LIB="$CARGO_TARGET_DIR/debug/libkvxfer.so" .venv/bin/python -m pytest -q \
    -p no:cacheprovider python/tests 2>&1) && rc=0 || rc=$?
  echo "$out" | tail -n 30
  # pytest's summary in cargo's words, for the closing count.
  summary=$(echo "$out" | tail -n 1)
  counts=$(echo "$summary" | awk '{ for (i = 1; i < NF; i++) { if ($(i+1) ~ /^passed/) p += $i;
    if ($(i+1) ~ /^(failed|errors?)/) f += $i } } END { printf "%d passed; %d failed", p, f + (p == 0) }')
  echo "test result: python. $counts" | tee -a "$log"
  [ "$rc" = 0 ] || echo "kvxfer: python tests failed" >&2
)
prune .venv

echo "== UCX: Debian libucx-dev (default)"
(
  export KVXFER_UCX=system
  # shellcheck source=scripts/ucx-env.sh
  KVXFER_SPLIT_TARGET=1 source scripts/ucx-env.sh
  cargo fmt --all -- --check
  # No import cycle between files, no file over 800 lines of non-test code, and the pure
  # crate built and tested without pkg-config or libclang.
  scripts/check-structure.sh
  # The checked-in PTX is what its CUDA source compiles to (NVRTC 12.0 from PyPI) and
  # assembles with ptxas for sm_80 and sm_90: no GPU or CUDA toolkit needed.
  python3 scripts/gen-ptx.py --check
  # The public API, listed from rustdoc's JSON, against the committed docs/api/*.txt: any
  # change of it shows in a diff (scripts/api.sh writes the listing anew).
  scripts/api.sh --check
  if [ "${KVXFER_PRUNE:-0}" = 1 ]; then rm -rf target/api; fi
  cargo clippy --workspace --all-targets -- -D warnings
  RUSTDOCFLAGS="-D warnings" cargo doc -p kvxfer-proto -p kvxfer --no-deps --features kvxfer/cuda
  cargo test --workspace 2>&1 | tee -a "$log"
  # The whole workspace again with the cuda feature (cudarc, dynamic loading: no CUDA toolkit
  # needed): GPU tests report a skip with the reason where there is no GPU.
  cargo clippy --workspace --all-targets --features cuda -- -D warnings
  cargo test --workspace --features cuda cuda -- --nocapture 2>&1 | grep -E "SKIP|as expected" || true
  cargo test --workspace --features cuda 2>&1 | tee -a "$log"
  # Discovery through a real etcd (feature etcd).
  cargo clippy -p kvxfer --features etcd --all-targets -- -D warnings
  cargo test -p kvxfer --features etcd --test etcd -- --nocapture 2>&1 | tee -a "$log"
  # kvxfer-bench --etcd on both sides.
  cargo clippy -p libkvxfer --features etcd --all-targets -- -D warnings
  cargo test -p libkvxfer --features etcd --test bench_etcd -- --nocapture 2>&1 | tee -a "$log"
)
prune target/ucx-system

echo "== UCX: 1.22 wheel (libucx-cu12)"
(
  export KVXFER_UCX=wheel
  # shellcheck source=scripts/ucx-env.sh
  KVXFER_SPLIT_TARGET=1 source scripts/ucx-env.sh
  cargo test --workspace 2>&1 | tee -a "$log"
)
prune target/ucx-wheel

echo "== Checkers (short): loom, Miri, AddressSanitizer, 10 s of fuzzing per decoder"
(
  export KVXFER_UCX=system
  scripts/sanitizers.sh loom 2>&1 | tee -a "$log"
  prune target/loom
  scripts/sanitizers.sh miri 2>&1 | tee -a "$log"
  prune target/miri
  scripts/sanitizers.sh asan 2>&1 | tee -a "$log"
  prune target/asan
  scripts/fuzz.sh 10
  prune
)

# One closing line over both runs (cargo's own last line is often a crate with no doctests).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "kvxfer: %d passed, %d failed\n", p, f; exit (f > 0) }' "$log"
