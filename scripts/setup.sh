#!/usr/bin/env bash
# Create ./.venv with the pinned CPU stack and install primus_turbo (editable) into it.
# Idempotent: re-running only installs what is missing. On a CUDA machine use the README's GPU steps.
set -euo pipefail
export PIP_NO_CACHE_DIR=1  # no wheel cache: a CI disk once ran out during the install (Errno 28)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0 triton==3.7.1
.venv/bin/python -m pip install -q --no-build-isolation -e ".[test,train,megatron,torchtitan]"
echo "setup: $(.venv/bin/python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
