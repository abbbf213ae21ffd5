#!/usr/bin/env bash
# The checkers over kvxfer's unsafe layers and its pure core (nightly Rust; `rustup toolchain
# install nightly --component miri rust-src` where it is missing):
#
#   AddressSanitizer  the TCP lane's socket pump (tcp transfers), the shm lane's copies (shm
#                     transfers), the TCP lane's in-host windows, staging (the
#                     simulated-device staged path), the device lane, the gates, and
#                     the C ABI's handles (the capi unit tests): kvxfer's own tests, built with
#                     -Zsanitizer=address.
#   ThreadSanitizer   the same tests under -Zsanitizer=thread (the lanes' threads, the staging
#                     pool's waits, the engine's command queue). std is rebuilt instrumented
#                     (-Zbuild-std) so that its synchronisation is seen.
#   Miri              the pure crate (kvxfer-proto): every unit test, undefined behaviour and
#                     leaks checked (PROPTEST_CASES kept small: Miri is ~1000x slower).
#   loom              the pin handshake (a transfer pinning a region against its
#                     deregistration) and the staging pool's waits, every interleaving
#                     (kvxfer built with --cfg loom; the models are `loom_model` tests).
#
#   scripts/sanitizers.sh            # all four
#   scripts/sanitizers.sh asan|tsan|miri|loom
#
# UCX itself is not instrumented; ASan's leak checker is off for that reason (UCX keeps
# process-lifetime allocations), and TSan's reports inside libucs/libucp are suppressed.
# UCX's memory hooks (it patches mmap/munmap to invalidate its registration cache) jump into
# ASan's own interceptors and crash at start: UCX_MEM_EVENTS=no turns them off for these runs.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
export KVXFER_UCX=${KVXFER_UCX:-system}
# shellcheck source=scripts/ucx-env.sh
source scripts/ucx-env.sh >/dev/null
target=x86_64-unknown-linux-gnu
# Nightly and the components the checkers need (installed when missing).
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal >&2
for c in miri rust-src; do
  rustup +nightly component list --installed | grep -q "^$c" || rustup +nightly component add "$c" >&2
done
tests=(--lib --test loopback --test staging --test hostile_clients --test connector --test fence
  --test device_lane --test lane_window)
export UCX_MEM_EVENTS=no

run_asan() {
  echo "== AddressSanitizer"
  RUSTFLAGS="-Zsanitizer=address -Cforce-frame-pointers=yes" \
    ASAN_OPTIONS="detect_leaks=0:abort_on_error=1" \
    CARGO_TARGET_DIR=target/asan \
    cargo +nightly test --target "$target" -p kvxfer "${tests[@]}" 2>&1 | grep -E "^test result|ERROR: AddressSanitizer|SUMMARY" 
  RUSTFLAGS="-Zsanitizer=address" ASAN_OPTIONS="detect_leaks=0:abort_on_error=1" \
    CARGO_TARGET_DIR=target/asan \
    cargo +nightly test --target "$target" -p kvxfer-capi --lib 2>&1 | grep -E "^test result|ERROR: AddressSanitizer|SUMMARY"
}

run_tsan() {
  echo "== ThreadSanitizer"
  local sup; sup=$(mktemp)
  # UCX's destructors at exit unlock its own mutexes from ld.so's fini (uninstrumented).
  printf 'called_from_lib:libucs.so\ncalled_from_lib:libucp.so\ncalled_from_lib:libuct.so\nrace:libucs\nrace:libucp\nrace:libuct\nmutex:_dl_call_fini\nmutex:libucs\n' > "$sup"
  RUSTFLAGS="-Zsanitizer=thread" RUSTDOCFLAGS="-Zsanitizer=thread" \
    TSAN_OPTIONS="suppressions=$sup:halt_on_error=1:report_signal_unsafe=0" \
    CARGO_TARGET_DIR=target/tsan \
    cargo +nightly test -Zbuild-std --target "$target" -p kvxfer "${tests[@]}" 2>&1 | grep -E "^test result|WARNING: ThreadSanitizer|SUMMARY"
  rm -f "$sup"
}

run_miri() {
  echo "== Miri (kvxfer-proto)"
  PROPTEST_CASES=${PROPTEST_CASES:-2} MIRIFLAGS="-Zmiri-disable-isolation" \
    CARGO_TARGET_DIR=target/miri \
    cargo +nightly miri test -p kvxfer-proto 2>&1 | grep -E "^test result|Undefined Behavior|error:"
}

run_loom() {
  echo "== loom"
  RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
    cargo test --release -p kvxfer --lib loom_model 2>&1 | grep -E "^test |^test result|panicked"
}

case "$what" in
  asan) run_asan ;;
  tsan) run_tsan ;;
  miri) run_miri ;;
  loom) run_loom ;;
  all) run_loom; run_miri; run_asan; run_tsan ;;
  *) echo "usage: $0 [asan|tsan|miri|loom|all]" >&2; exit 2 ;;
esac
