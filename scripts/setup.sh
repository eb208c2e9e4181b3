#!/usr/bin/env bash
# Create .venv and install pinned-eval with its extras. Idempotent.
# torch is installed first, pinned, because an unpinned torch resolves to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip
if ! "$VPY" -c "import torch" 2>/dev/null; then
  "$VPY" -m pip install -q "torch==2.13.0"
fi
"$VPY" -m pip install -q -e ".[dev,megatron,wandb,report,harness,mlflow,tensorboard,prometheus,aws]"
