"""The RL loop end to end with vLLM engines (`--rollout.engine vllm`) on vLLM's CPU build: a vLLM
engine in a Ray actor, the agent runner, an FSDP2 trainer rank, and the weight broadcast between them.

In sync mode every trajectory is sampled by the weights the trainer then scores it with, so the
engine/trainer KL (`actor/vllm_kl`) stays at float noise on every step only if each weight update
reached vLLM: a missed update would leave it at the KL between consecutive policies (the high
learning rate makes that large)."""

import json
from pathlib import Path

import pytest
from vllm_tier import needs_vllm

from instar.config import RLConfig
from instar.loop import run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [needs_vllm, pytest.mark.slow]


@pytest.mark.parametrize("lora_rank", [0, 8])
def test_sync_loop_with_vllm_engine_keeps_engine_and_trainer_in_step(tmp_path, tiny_model_dir, lora_rank):
    """With LoRA (``lora_rank`` 8) the trainer sends the adapted layers' merged weights, and only those."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i}*7+3?", "label": str(i * 7 + 3)}) + "\n"
                               for i in range(16)))
    cfg = RLConfig()
    cfg.actor.model_name_or_path = str(tiny_model_dir)
    cfg.actor.learning_rate = 1e-2
    cfg.actor.lora_rank = lora_rank
    cfg.data.prompt_dataset = str(prompts)
    cfg.data.max_new_tokens = 16
    cfg.data.max_len = 256
    cfg.train.agent_path = str(ROOT / "tests/agents/length_env.py")
    cfg.train.max_steps = 3
    cfg.train.force_sync_mode = True
    cfg.rollout.engine = "vllm"
    cfg.rollout.batch_size = 2
    cfg.rollout.n_samples_per_prompt = 4
    cfg.rollout.max_groups_in_flight = 2
    cfg.ckpt.output_dir = str(tmp_path / "run")
    run(cfg)
    metrics = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["trajectories"] == 8 and m["staleness_max"] == 0 for m in metrics)
    assert all(abs(m["actor/vllm_kl"]) < 1e-3 for m in metrics), [m["actor/vllm_kl"] for m in metrics]
    assert metrics[0]["actor/grad_norm"] > 0
