#!/usr/bin/env bash
# The structure's guards, run by scripts/test.sh (and fast enough for a pre-commit hook):
#  1. no import cycle between the files of any crate (scripts/module-cycles.py, a copy of
#     ../shared/tools/module-cycles.py: `crate::` and `super::` paths, tests left out);
#  2. no file over 800 lines of non-test code in kvxfer/src or kvxfer-proto/src;
#  3. kvxfer-proto depends on nothing of UCX, bindgen or libclang, and builds and passes its
#     tests with pkg-config and libclang made unusable (what a machine without them sees);
#  4. ARCHITECTURE.md's layer table holds (scripts/layers.py): every file of kvxfer/src in it,
#     imports only down the layers and never what a row forbids, none through lib.rs, and no
#     cycle between directories.
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0

echo "== import cycles between files"
python3 scripts/module-cycles.py kvxfer-proto/src kvxfer/src kvxfer-sys/src kvxfer-capi/src || fail=1

echo "== the layer table of ARCHITECTURE.md"
python3 scripts/layers.py ARCHITECTURE.md kvxfer/src || fail=1

echo "== files over 800 lines of non-test code"
limit=800
while IFS= read -r f; do
  n=$(awk '/^[[:space:]]*#\[cfg\(test\)\]/ { exit } { n++ } END { print n + 0 }' "$f")
  if [ "$n" -gt "$limit" ]; then
    echo "  $f: $n lines before its tests (limit $limit): split it by concern"
    fail=1
  fi
done < <(find kvxfer/src kvxfer-proto/src -name '*.rs' | sort)

echo "== kvxfer-proto stands alone"
if cargo tree -p kvxfer-proto -e normal,build --prefix none | grep -E '^(kvxfer-sys|bindgen|clang-sys|kvxfer) ' ; then
  echo "  kvxfer-proto depends on the UCX side"
  fail=1
fi
# A target directory of its own, so that nothing built with UCX is reused.
if ! PKG_CONFIG=/bin/false LIBCLANG_PATH=/nonexistent CARGO_TARGET_DIR=target/proto-alone \
  cargo test -p kvxfer-proto 2>&1 | grep -E '^test result: .* [0-9]+ passed' | head -n 1; then
  echo "  kvxfer-proto did not build or pass without pkg-config and libclang"
  fail=1
fi

if [ "$fail" != 0 ]; then
  echo "kvxfer: structure check failed" >&2
  exit 1
fi
echo "structure: ok"
