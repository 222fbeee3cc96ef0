#!/usr/bin/env bash
# Create .venv and install instar with pinned dependencies. Idempotent: re-runs only when the pins change.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.instar-installed
want=$(cat requirements/lock.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
echo "setting up .venv (torch CPU wheel + pinned requirements; about 2 minutes)"
"$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -r requirements/lock.txt
.venv/bin/pip install -q --no-deps -e .
echo "$want" > "$stamp"
