#!/usr/bin/env bash
# A tiny vision-language model learns to count shapes in pictures with RL, on CPU.
# tiny Qwen3-VL -> pictures and datasets -> SFT warm start (instar sft) -> GRPO (instar rl) -> report.
# SEED (default 0) and RUN (default runs/demo-vlm-seed$SEED) select the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SEED=${SEED:-0}
RUN=${RUN:-runs/demo-vlm-seed$SEED}
bin=.venv/bin
start=$(date +%s)
rm -rf "$RUN"
$bin/instar tiny-model --vlm true --out "$RUN/model" --seed "$SEED" --layers 4 --hidden 128 --heads 4 \
    --kv-heads 2 --intermediate 256 --vision-layers 2
$bin/python examples/vlm/task.py "$RUN/data" "$SEED" >/dev/null
echo "== SFT warm start (demonstrations that undercount)"
$bin/instar sft --config examples/vlm/sft.yaml --actor.model_name_or_path "$RUN/model" \
    --actor.seed "$SEED" --sft.dataset "$RUN/data/sft.jsonl" --ckpt.output_dir "$RUN/sft"
sft_done=$(date +%s)
echo "== RL (GRPO on image prompts, embedded engine, Ray actors)"
$bin/instar rl --config examples/vlm/rl.yaml --actor.model_name_or_path "$RUN/sft/hf" \
    --actor.seed "$SEED" --data.prompt_dataset "$RUN/data/train.jsonl" --eval.dataset "$RUN/data/eval.jsonl" \
    --ckpt.output_dir "$RUN/rl"
rl_done=$(date +%s)
echo "wall time: total $((rl_done - start)) s, sft $((sft_done - start)) s, rl $((rl_done - sft_done)) s"
$bin/instar report --run_dir "$RUN/rl"
