#!/usr/bin/env bash
# The public API of kvxfer-proto and kvxfer (features cuda and etcd: everything a user can
# reach), listed by scripts/public-api.py from rustdoc's JSON (nightly) into docs/api/.
#   scripts/api.sh          writes docs/api/*.txt (commit them with the change that made them)
#   scripts/api.sh --check  fails when the listing differs from the committed one (CI)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-write}
# rustdoc's JSON output is nightly-only; its format is versioned (scripts/public-api.py reads
# format 57, nightly 2026-05): another nightly may list the same API with other spellings.
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal >&2
out=target/api
mkdir -p docs/api
status=0
for crate in kvxfer-proto kvxfer; do
  feats=()
  [ "$crate" = kvxfer ] && feats=(--features cuda,etcd)
  CARGO_TARGET_DIR=$out cargo +nightly rustdoc -q -p "$crate" --lib "${feats[@]}" -- \
    -Z unstable-options --output-format json
  json="$out/doc/${crate//-/_}.json"
  listing=$(python3 scripts/public-api.py "$json")
  if [ "$mode" = --check ]; then
    if ! diff -u "docs/api/$crate.txt" <(echo "$listing") >"$out/$crate.diff"; then
      echo "kvxfer: the public API of $crate changed; the difference (- committed, + now):" >&2
      cat "$out/$crate.diff" >&2
      echo "kvxfer: if the change is meant, run scripts/api.sh and commit docs/api/$crate.txt" >&2
      status=1
    else
      echo "api: $crate unchanged ($(echo "$listing" | wc -l) items)"
    fi
  else
    echo "$listing" >"docs/api/$crate.txt"
    echo "api: wrote docs/api/$crate.txt ($(echo "$listing" | wc -l) items)"
  fi
done
exit $status
