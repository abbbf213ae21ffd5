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
# pip, tried up to four times with a pause between tries.
pip_retry() {
  local try
  for try in 1 2 3 4; do
    if .venv/bin/pip "$@"; then
      return 0
    fi
    echo "kvxfer: pip $* failed (try $try of 4)" >&2
    sleep $((try * 10))
  done
  return 1
}
if ! .venv/bin/python -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
  echo "kvxfer: installing vllm==$VLLM_VERSION into .venv (a few minutes)" >&2
  pip_retry install -q --upgrade pip
  # ~9 GB of wheels (torch's CUDA libraries among them): a download cut mid-file resumes, and a
  # whole install that still fails is tried again (CI's network has dropped a 553 MB wheel at
  # 26% six times in a row); what pip already fetched stays in its cache between tries.
  pip_retry install -q --resume-retries 20 --timeout 60 "vllm==$VLLM_VERSION"
fi
.venv/bin/python -c "import pytest" 2>/dev/null || pip_retry install -q pytest
# Editable, for development: the tests point KVXFER_LIB at the debug build, so the release
# library is not built here (python/tests/test_install.py tests the one-command install).
KVXFER_SKIP_NATIVE=1 pip_retry install -q -e python/
