#!/usr/bin/env bash
# The seed deployment replayed with real engines (not CI): a prefill and a decode vLLM OpenAI
# server on this machine, KvxferConnector and vLLM's NixlConnector (NIXL 1.5.1, host memory)
# alternated, Qwen3-0.6B-shaped KV, 2,371-token prompts, TTFT and handoff p50/p99 at
# concurrency 1 and 4 (python/e2e/replay_engines.py says what is measured and how).
#
#   scripts/vllm-replay.sh [--out DIR] [--link inhost|1gbe] [driver options]
#
# --link 1gbe (root): the prefill engines run in namespace kvxa (198.18.0.1 on kvx0), the decode
# engines and the driver in kvxb (198.18.0.2 on kvx1), joined by a veth pair with
# `tc qdisc tbf rate 1gbit` on both ends; removed on exit, whatever happens. Each run takes
# about 15-25 minutes on a 2-core machine. The vLLM CPU workers are bound to cores (prefill
# engines to core 0, decode engines to core 1 by default, --prefill-cpus/--decode-cpus): with
# vLLM's default every engine binds the same cores, and a decode engine's idle steps then starve
# the prefill engine's worker and every thread it started (handoffs time out).
set -euo pipefail
cd "$(dirname "$0")/.."
out=replay-engines
link=inhost
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --link) link=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
KVX_WITH_NIXL=1
# shellcheck source=scripts/vllm-cpu-env.sh
source scripts/vllm-cpu-env.sh
model=$(mktemp -d)
p=kvx
# shellcheck source=scripts/netns-pair.sh
source scripts/netns-pair.sh
cleanup() {
  rm -rf "$model"
  if [ "$link" = 1gbe ]; then kvx_netns_down "$p"; fi
}
trap cleanup EXIT INT TERM
drive=(.venv-cpu/bin/python python/e2e/replay_engines.py --model "$model" --out "$out" --link "$link")
if [ "$link" = inhost ]; then
  "${drive[@]}" "${args[@]}"
  exit
fi
[ "$link" = 1gbe ] || { echo "kvxfer: --link inhost or 1gbe" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "kvxfer: --link 1gbe creates network namespaces and needs root" >&2; exit 2; }
cleanup
mkdir -p "$model"
kvx_netns_up "$p" 1gbit
ip netns exec "${p}b" "${drive[@]}" --prefill-ns "${p}a" --prefill-host 198.18.0.1 \
  --decode-host 198.18.0.2 --prefill-dev "${p}0" --decode-dev "${p}1" "${args[@]}"
