"""Preemption: a SIGTERM to `instar rl` saves a checkpoint after its step and exits with 143, from which
`--ckpt.load_enable true` resumes with every prompt trained exactly once."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from helpers.loop import ROOT, rows

STEPS, BATCH, PROMPTS = 4, 2, 3  # few prompts: every step crosses an epoch, a lost prompt leaves a hole


@pytest.mark.slow
@pytest.mark.timeout(300)  # two cold starts of the cluster: ~40 s alone, more on a busy machine
def test_sigterm_saves_a_checkpoint_and_the_resume_trains_every_prompt_once(tmp_path, tiny_model_dir):
    run, recipe, prompts = tmp_path / "run", tmp_path / "recipe.yaml", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i}*7+3?", "label": str(i * 7 + 3)}) + "\n"
                               for i in range(PROMPTS)))
    recipe.write_text(json.dumps({  # no --ckpt.save_steps: the SIGTERM's checkpoint is the only one to resume from
        "actor": {"model_name_or_path": str(tiny_model_dir), "learning_rate": 1e-3},
        "data": {"prompt_dataset": str(prompts), "max_new_tokens": 24, "max_len": 256},
        "train": {"agent_path": str(ROOT / "tests/agents/length_env.py"), "max_steps": STEPS},
        "rollout": {"batch_size": BATCH, "n_samples_per_prompt": 4, "max_groups_in_flight": 4},
        "ckpt": {"output_dir": str(run)}}))
    cmd = [sys.executable, "-m", "instar", "rl", "--config", str(recipe)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 200
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().count("\n"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # the driver alone, as `kill PID` would
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    stopped = [row["step"] for row in rows(run / "metrics.jsonl")]
    assert stopped == list(range(1, stopped[-1] + 1)) and stopped[-1] < STEPS, stopped
    assert sorted(os.listdir(run / "checkpoints")) == [f"step_{stopped[-1]}"]
    assert not (run / "hf").exists()  # the export is the finished run's
    assert f"SIGTERM: stopped after step {stopped[-1]}" in out

    done = subprocess.run(cmd + ["--ckpt.load_enable", "true"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [row["step"] for row in rows(run / "metrics.jsonl")] == list(range(1, STEPS + 1))
    ledger = [r for r in rows(run / "ledger.jsonl") if r["outcome"] == "trained"]
    trained = [(r["epoch"], r["prompt_index"]) for r in ledger]
    assert len(set(trained)) == len(trained) == STEPS * BATCH  # none trained twice
    assert Counter(r["step"] for r in ledger) == {s: BATCH for s in range(1, STEPS + 1)}
    # none lost: every epoch is complete but the last two, which the 4 groups still in flight at the end may hold
    last = max(e for e, _ in trained)
    assert all({i for e, i in trained if e == epoch} == set(range(PROMPTS)) for epoch in range(last - 1)), trained
    assert (run / "hf/model.safetensors").exists()
