#!/usr/bin/env bash
# Builds the C library (release) and lays it out for C users:
#   target/capi/include/kvxfer.h, target/capi/lib/libkvxfer.{so,a},
#   target/capi/lib/pkgconfig/kvxfer.pc
# then: PKG_CONFIG_PATH=target/capi/lib/pkgconfig cc app.c $(pkg-config --cflags --libs kvxfer)
# or, linked statically: ... $(pkg-config --cflags --libs --static kvxfer-static)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/ucx-env.sh
KVXFER_SPLIT_TARGET=1 source scripts/ucx-env.sh
cargo build --release --quiet -p kvxfer-capi
out=target/capi
mkdir -p "$out/include" "$out/lib/pkgconfig"
cp include/kvxfer.h "$out/include/"
cp "$CARGO_TARGET_DIR/release/libkvxfer.so" "$CARGO_TARGET_DIR/release/libkvxfer.a" "$out/lib/"
version=$(grep -m1 '^version' Cargo.toml | cut -d'"' -f2)
for pc in kvxfer kvxfer-static; do
  sed -e "s|@LIBDIR@|$PWD/$out/lib|" -e "s|@INCLUDEDIR@|$PWD/$out/include|" -e "s|@VERSION@|$version|" \
    "kvxfer-capi/$pc.pc.in" > "$out/lib/pkgconfig/$pc.pc"
done
echo "kvxfer: C library in $out (pkg-config: PKG_CONFIG_PATH=$PWD/$out/lib/pkgconfig)"
