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
peer_pid=""
cleanup() {
  # `ip netns exec` forks: stop the bench itself (pid from its READY line), then `ip`.
  if [ -n "${peer_out:-}" ] && [ -f "$peer_out" ]; then
    bpid=$(grep -o 'pid=[0-9]*' "$peer_out" | head -n1 | cut -d= -f2)
    [ -n "$bpid" ] && kill "$bpid" 2>/dev/null || true
  fi
  if [ -n "$peer_pid" ]; then kill "$peer_pid" 2>/dev/null || true; wait "$peer_pid" 2>/dev/null || true; fi
  ip netns del "$nsa" 2>/dev/null || true
  ip netns del "$nsb" 2>/dev/null || true
  ip link del "$la" 2>/dev/null || true
  rm -f "${peer_out:-}"
}
trap cleanup EXIT INT TERM
cleanup
ip netns add "$nsa"
ip netns add "$nsb"
ip link add "$la" netns "$nsa" type veth peer name "$lb" netns "$nsb"
ip -n "$nsa" addr add 198.18.0.1/24 dev "$la"
ip -n "$nsb" addr add 198.18.0.2/24 dev "$lb"
for ns in "$nsa" "$nsb"; do ip -n "$ns" link set lo up; done
ip -n "$nsa" link set "$la" up
ip -n "$nsb" link set "$lb" up
# veth carrier comes up asynchronously; UCX skips an interface that is not running yet.
for _ in $(seq 100); do
  if [ "$(ip netns exec "$nsa" cat /sys/class/net/"$la"/operstate)" = up ] &&
     [ "$(ip netns exec "$nsb" cat /sys/class/net/"$lb"/operstate)" = up ]; then break; fi
  sleep 0.05
done
if command -v ucx_info >/dev/null; then
  for _ in $(seq 100); do
    ip netns exec "$nsb" env UCX_TLS=tcp UCX_NET_DEVICES="$lb" ucx_info -d 2>/dev/null |
      grep -q "Device: $lb" && break
    sleep 0.05
  done
fi
# The token bucket: 1 Gbit/s, a burst of 256 KiB, at most 50 ms queued.
ip netns exec "$nsa" tc qdisc add dev "$la" root tbf rate "$rate" burst 256kb latency 50ms
ip netns exec "$nsb" tc qdisc add dev "$lb" root tbf rate "$rate" burst 256kb latency 50ms
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
