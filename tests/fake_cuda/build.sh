#!/usr/bin/env bash
# Builds the fake CUDA driver: tests/fake_cuda/build.sh OUTDIR -> OUTDIR/libcuda.so
set -euo pipefail
src="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$1"
gcc -shared -fPIC -O1 -Wall -Werror -pthread -I"$src" -o "$1/libcuda.so.tmp.$$" \
  "$src/libcuda.c" "$src/stubs.c"
mv "$1/libcuda.so.tmp.$$" "$1/libcuda.so"
