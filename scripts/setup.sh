#!/usr/bin/env bash
# Create .venv and install instar with pinned dependencies. Idempotent: re-runs only when the pins change.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
TORCH=2.13.0
stamp=.venv/.instar-installed
want=$(cat requirements/lock.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
echo "setting up .venv (torch $TORCH + pinned requirements; about 2 minutes)"
"$PY" -m venv .venv
pip=.venv/bin/pip
"$pip" install -q --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build, and so does this pin from PyPI
# on Linux. Without an NVIDIA GPU take the CPU build: from the configured index where it has one (a local
# mirror), else from PyTorch's CPU index.
if [ "$(scripts/torch_build.sh)" = cpu ]; then
  "$pip" install -q "torch==$TORCH+cpu" 2>/dev/null ||
    "$pip" install -q --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH+cpu"
else
  "$pip" install -q "torch==$TORCH"
fi
.venv/bin/python -W ignore -c 'import torch; print("torch", torch.__version__,
                                          f"(CUDA {torch.version.cuda} build)" if torch.version.cuda else "(CPU build)")'
"$pip" install -q -r requirements/lock.txt
"$pip" install -q --no-deps -e .
echo "$want" > "$stamp"
