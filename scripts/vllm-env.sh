#!/usr/bin/env bash
# Creates .venv with the pinned vLLM (0.33.0, CPU use only), pytest, and the kvxfer_vllm plugin
# (editable). About 2.5-4 minutes and 9.4 GB on a fresh machine; reused afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.33.0
py=${PYTHON:-python3}
if ! "$py" -c 'import venv, ensurepip' 2>/dev/null; then
  echo "kvxfer: installing python3-venv" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
if ! .venv/bin/python -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
  echo "kvxfer: installing vllm==$VLLM_VERSION into .venv (a few minutes)" >&2
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q "vllm==$VLLM_VERSION"
fi
.venv/bin/python -c "import pytest" 2>/dev/null || .venv/bin/pip install -q pytest
.venv/bin/pip install -q -e python/
