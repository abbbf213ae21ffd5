#!/usr/bin/env bash
# Runs kvxfer-bench across an emulated 1 GbE link: two network namespaces (kvxa, kvxb) joined
# by a veth pair (kvx0 198.18.0.1 <-> kvx1 198.18.0.2, RFC 2544 benchmarking addresses) with
# `tc qdisc tbf rate 1gbit` on both ends. The peer runs in kvxb, the initiator in kvxa, with
# --reference so that kvxfer's time is reported as a ratio to a plain TCP stream of the same
# bytes over the same link. Everything is removed on exit, whatever happens.
#
#   sudo scripts/netns-1gbe.sh [kvxfer-bench options]     (default: --op write,read)
#   sudo scripts/netns-1gbe.sh --data kv --compress off,on,auto   # raw and compressed, side by side
#
# Environment: KVX_RATE (default 1gbit), KVX_PREFIX (namespace/link name prefix, default kvx),
# KVX_PEER_ARGS (more options for the peer, e.g. "--secret s" to match the initiator's):
#
#   sudo KVX_PEER_ARGS="--secret s" scripts/netns-1gbe.sh --secret s --lane-encryption
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "kvxfer: $0 creates network namespaces and needs root (run it with sudo)" >&2
  exit 2
fi
for t in ip tc; do
  command -v "$t" >/dev/null || { echo "kvxfer: $t (iproute2) is needed" >&2; exit 2; }
done
# shellcheck source=scripts/ucx-env.sh
KVXFER_SPLIT_TARGET=1 source scripts/ucx-env.sh
cargo build --release --quiet --bin kvxfer-bench
bench="$CARGO_TARGET_DIR/release/kvxfer-bench"
rate="${KVX_RATE:-1gbit}"
p="${KVX_PREFIX:-kvx}"
nsa="${p}a"; nsb="${p}b"; la="${p}0"; lb="${p}1"
# shellcheck source=scripts/netns-pair.sh
source scripts/netns-pair.sh
peer_pid=""
cleanup() {
  # `ip netns exec` forks: stop the bench itself (pid from its READY line), then `ip`.
  if [ -n "${peer_out:-}" ] && [ -f "$peer_out" ]; then
    bpid=$(grep -o 'pid=[0-9]*' "$peer_out" | head -n1 | cut -d= -f2)
    [ -n "$bpid" ] && kill "$bpid" 2>/dev/null || true
  fi
  if [ -n "$peer_pid" ]; then kill "$peer_pid" 2>/dev/null || true; wait "$peer_pid" 2>/dev/null || true; fi
  kvx_netns_down "$p"
  rm -f "${peer_out:-}"
}
trap cleanup EXIT INT TERM
cleanup
kvx_netns_up "$p" "$rate"
peer_out=$(mktemp)
read -r -a peer_args <<<"${KVX_PEER_ARGS:-}"
ip netns exec "$nsb" "$bench" --listen 198.18.0.2:0 --transport tcp --net-devices "$lb" \
  "${peer_args[@]}" >"$peer_out" &
peer_pid=$!
for _ in $(seq 100); do grep -q READY "$peer_out" && break; sleep 0.1; done
ctl=$(grep -o 'ctl=[^ ]*' "$peer_out" | head -n1 | cut -d= -f2)
[ -n "$ctl" ] || { echo "kvxfer: the peer did not start" >&2; cat "$peer_out" >&2; exit 1; }
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--op write,read --iters 3 --warmup 1)
ip netns exec "$nsa" "$bench" --connect "$ctl" --transport tcp --net-devices "$la" --reference "${args[@]}"
