#!/usr/bin/env bash
# The trainer's GPU checks in one command, from the repo root: bash bench/gpu_check.sh [--cpu-smoke]
# Runs this checkout's instar with the machine's python3 (no venv, no install, no network); prints a
# PASS/FAIL/SKIP line per check and a timing table, and writes the full log to $OUT/gpu_check.log
# when $OUT is set. bench/gpu_check.py says what each check does.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Offline: every model is built here; nothing may try to reach a hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
log=()
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  log=(--log "$OUT/gpu_check.log")
fi
# gpu_check.py keeps to its own budget (320 s); this limit only catches a hang of the runner itself.
exec timeout -k 10 355 python3 bench/gpu_check.py "${log[@]}" "$@"
