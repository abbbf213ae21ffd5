#!/usr/bin/env bash
# Runs every test: formatting, lints, unit / loopback / cross-process tests against Debian's
# UCX (the default), then the same suite against the UCX 1.22 wheel. Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null; then
  echo "kvxfer: cargo (Rust >= 1.85) is needed: https://rustup.rs" >&2
  exit 1
fi
export CARGO_TERM_COLOR=never
log=$(mktemp)
trap 'rm -f "$log"' EXIT

echo "== UCX: Debian libucx-dev (default)"
(
  export KVXFER_UCX=system
  # shellcheck source=scripts/ucx-env.sh
  source scripts/ucx-env.sh
  cargo fmt --all -- --check
  cargo clippy --workspace --all-targets -- -D warnings
  cargo test --workspace 2>&1 | tee -a "$log"
)

echo "== UCX: 1.22 wheel (libucx-cu12)"
(
  export KVXFER_UCX=wheel
  # shellcheck source=scripts/ucx-env.sh
  source scripts/ucx-env.sh
  cargo test --workspace 2>&1 | tee -a "$log"
)

# One closing line over both runs (cargo's own last line is often a crate with no doctests).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "kvxfer: %d passed, %d failed\n", p, f; exit (f > 0) }' "$log"
