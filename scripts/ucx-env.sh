# shellcheck shell=bash
# Source this file: it selects the UCX that kvxfer builds and runs against.
#
#   KVXFER_UCX=system (default) Debian's libucx-dev (1.13.1), installed with apt when missing.
#                               On kvxfer-bench's KV-shaped workload it measured faster than the
#                               wheel in-host (shm 40.8 ms vs 70.4 ms) and equal over TCP; see
#                               docs/perf/README.md, "Which UCX".
#   KVXFER_UCX=wheel            UCX 1.22 from the PyPI wheel `libucx-cu12`, unpacked into .ucx/
#                               with its pkg-config files relocated. Has cuda_copy/cuda_ipc.
#
# Both paths also make sure libclang-dev and pkg-config (needed by bindgen) are present.
_kvx_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_kvx_ucx_version="1.22.0"

_kvx_apt() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ]; then
    echo "kvxfer: need apt packages: ${missing[*]} (run as root or install them)" >&2
    return 1
  fi
  echo "kvxfer: installing ${missing[*]}" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >&2
}

_kvx_wheel() {
  local dir="$_kvx_root/.ucx/$_kvx_ucx_version"
  if [ ! -f "$dir/ok" ]; then
    echo "kvxfer: fetching UCX $_kvx_ucx_version (PyPI wheel libucx-cu12) into $dir" >&2
    local tmp; tmp="$(mktemp -d)"
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" \
      "libucx-cu12==$_kvx_ucx_version" >&2 || { rm -rf "$tmp"; return 1; }
    rm -rf "$dir"; mkdir -p "$dir"
    (cd "$dir" && python3 -m zipfile -e "$tmp"/libucx_cu12-*.whl . ) || { rm -rf "$tmp"; return 1; }
    rm -rf "$tmp"
    chmod +x "$dir"/libucx/bin/* 2>/dev/null
    # The wheel's .pc files carry the build machine's prefix: relocate them here.
    sed -i "s|^prefix *=.*|prefix = $dir/libucx|" "$dir"/libucx/lib/pkgconfig/*.pc
    touch "$dir/ok"
  fi
  export PKG_CONFIG_PATH="$dir/libucx/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export KVXFER_UCX_PREFIX="$dir/libucx"
  # For UCX's own tools (ucx_perftest, ucx_info) from the wheel; kvxfer binaries use an rpath.
  export KVXFER_UCX_BIN="$dir/libucx/bin"
  # The wheel's cuda module needs libcuda; on machines without it UCX warns once per process.
  # Keep its logs quiet unless the user set a level.
  export UCX_LOG_LEVEL="${UCX_LOG_LEVEL:-error}"
}

_kvx_apt pkg-config libclang-dev python3 python3-pip || return 1 2>/dev/null || exit 1
case "${KVXFER_UCX:-system}" in
  wheel) _kvx_wheel || { echo "kvxfer: could not fetch the UCX wheel" >&2; return 1 2>/dev/null || exit 1; } ;;
  system) _kvx_apt libucx-dev ucx-utils || return 1 2>/dev/null || exit 1 ;;
  *) echo "kvxfer: KVXFER_UCX must be wheel or system" >&2; return 1 2>/dev/null || exit 1 ;;
esac
export KVXFER_UCX="${KVXFER_UCX:-system}"
# kvxfer's own scripts (KVXFER_SPLIT_TARGET=1) keep the two UCX builds in separate target
# directories so switching does not rebuild. Sourced by hand, it leaves the user's
# CARGO_TARGET_DIR as it is, set or not.
if [ "${KVXFER_SPLIT_TARGET:-0}" = 1 ]; then
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$_kvx_root/target/ucx-$KVXFER_UCX}"
fi
