#!/usr/bin/env bash
# CI: instar as a user installs it. Build the wheel, install it with the dependencies its metadata
# declares into a clean venv outside the checkout (no -e, no --no-deps), then run `instar --help`,
# `instar tiny-model` and a 1-step `instar rl` from a directory that is not the checkout.
# About 1-2 minutes with pip's cache warm. Needs .venv (scripts/setup.sh) for the build backend.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
start=$(date +%s)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/pip wheel -q --no-deps --no-build-isolation -w "$work/dist" .
wheel=$(ls "$work"/dist/instar-*.whl)
.venv/bin/python - "$wheel" <<'PYEOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
missing = [n for n in ("instar/py.typed", "instar/cli/main.py", "instar/cpu/csrc/attention.c",
                        "instar/cpu/csrc/decode.c") if n not in names]
missing += [] if any(n.endswith("licenses/LICENSE") for n in names) else ["LICENSE"]
assert not missing, f"the wheel lacks {missing}"
PYEOF
"$PY" -m venv "$work/venv"
bin=$work/venv/bin
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build (the README's CPU install).
"$bin/pip" install -q torch==2.13.0
# The lock only constrains versions to the tested set: what gets installed is what the wheel declares.
"$bin/pip" install -q "$wheel" -c requirements/lock.txt
cd "$work"
"$bin/instar" --help >/dev/null
"$bin/instar" --version
"$bin/python" -c "import instar, sys; assert instar.__file__.startswith(sys.prefix), instar.__file__"
"$bin/instar" tiny-model --out model >/dev/null
"$bin/python" - <<'PYEOF'
import pyarrow as pa, pyarrow.parquet as pq
pq.write_table(pa.Table.from_pylist([{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(8)]),
               "prompts.parquet")
PYEOF
cat > agent.py <<'PYEOF'
import asyncio

from instar.agents import Env, Result, StepEnvRunner
from instar.agents.rewards import math_equal


class Math(Env):
    async def step(self, state):
        reward = float(await asyncio.to_thread(math_equal, state["action_text"], state["label"]))
        return Result(reward=reward, score=reward)


AgentRunner = StepEnvRunner(Math)
PYEOF
"$bin/instar" env | tee env.txt  # the CPU accelerator builds from the wheel's C sources
grep -q "trainer attention (C kernel): built" env.txt || { echo "the wheel's C kernels did not build"; exit 1; }
"$bin/instar" rl --actor.model_name_or_path model --data.prompt_dataset prompts.parquet \
    --data.input_key question --data.label_key answer --train.agent_path agent.py --train.max_steps 1 \
    --rollout.batch_size 2 --rollout.n_samples_per_prompt 2 --data.max_new_tokens 8 --data.max_len 128 \
    --ckpt.output_dir run >rl.log 2>&1 || { tail -40 rl.log; exit 1; }
grep -q '"step": 1' run/metrics.jsonl || { echo "no step in run/metrics.jsonl"; tail -40 rl.log; exit 1; }
echo "wheel check passed: built, installed outside the checkout, instar rl ran one step ($(( $(date +%s) - start )) s)"
