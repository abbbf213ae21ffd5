#!/usr/bin/env bash
# Sourced by scripts/netns-1gbe.sh and scripts/vllm-replay.sh (root): two network namespaces
# ${1}a and ${1}b joined by a veth pair (${1}0 198.18.0.1 <-> ${1}1 198.18.0.2, RFC 2544
# benchmarking addresses), both links up, a token bucket of rate $2 on both ends (a burst of
# 256 KiB, at most 50 ms queued). kvx_netns_down removes them (safe when absent).
kvx_netns_down() {
  ip netns del "${1}a" 2>/dev/null || true
  ip netns del "${1}b" 2>/dev/null || true
  ip link del "${1}0" 2>/dev/null || true
}

kvx_netns_up() {
  local p=$1 rate=$2
  ip netns add "${p}a"
  ip netns add "${p}b"
  ip link add "${p}0" netns "${p}a" type veth peer name "${p}1" netns "${p}b"
  ip -n "${p}a" addr add 198.18.0.1/24 dev "${p}0"
  ip -n "${p}b" addr add 198.18.0.2/24 dev "${p}1"
  for ns in "${p}a" "${p}b"; do ip -n "$ns" link set lo up; done
  ip -n "${p}a" link set "${p}0" up
  ip -n "${p}b" link set "${p}1" up
  # veth carrier comes up asynchronously; UCX skips an interface that is not running yet.
  for _ in $(seq 100); do
    if [ "$(ip netns exec "${p}a" cat /sys/class/net/"${p}0"/operstate)" = up ] &&
       [ "$(ip netns exec "${p}b" cat /sys/class/net/"${p}1"/operstate)" = up ]; then break; fi
    sleep 0.05
  done
  if command -v ucx_info >/dev/null; then
    for _ in $(seq 100); do
      ip netns exec "${p}b" env UCX_TLS=tcp UCX_NET_DEVICES="${p}1" ucx_info -d 2>/dev/null |
        grep -q "Device: ${p}1" && break
      sleep 0.05
    done
  fi
  ip netns exec "${p}a" tc qdisc add dev "${p}0" root tbf rate "$rate" burst 256kb latency 50ms
  ip netns exec "${p}b" tc qdisc add dev "${p}1" root tbf rate "$rate" burst 256kb latency 50ms
}
