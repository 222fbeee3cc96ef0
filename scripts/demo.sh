#!/usr/bin/env bash
# The main job: a tiny model learns to use a calculator tool with RL, on CPU.
# tiny model -> datasets -> SFT warm start (instar sft) -> GRPO (instar rl) -> report.
# SEED (default 0) and RUN (default runs/demo-seed$SEED) select the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SEED=${SEED:-0}
RUN=${RUN:-runs/demo-seed$SEED}
bin=.venv/bin
start=$(date +%s)
rm -rf "$RUN"
$bin/instar tiny-model --out "$RUN/model" --seed "$SEED" --layers 4 --hidden 128 --heads 4 --kv-heads 2 \
    --intermediate 256
$bin/python examples/calculator/task.py "$RUN/data" >/dev/null
echo "== SFT warm start (imperfect demonstrations)"
$bin/instar sft --config examples/calculator/sft.yaml --actor.model_name_or_path "$RUN/model" \
    --actor.seed "$SEED" --sft.dataset "$RUN/data/sft.jsonl" --ckpt.output_dir "$RUN/sft"
sft_done=$(date +%s)
echo "== RL (GRPO, embedded engine, Ray actors)"
$bin/instar rl --config examples/calculator/rl.yaml --actor.model_name_or_path "$RUN/sft/hf" \
    --actor.seed "$SEED" --data.prompt_dataset "$RUN/data/train.jsonl" --eval.dataset "$RUN/data/eval.jsonl" \
    --ckpt.output_dir "$RUN/rl"
rl_done=$(date +%s)
echo "wall time: total $((rl_done - start)) s, sft $((sft_done - start)) s, rl $((rl_done - sft_done)) s"
$bin/instar report --run_dir "$RUN/rl"
