"""Coming from Molt: its quick-start command line (entry point and paths swapped) trains on CPU with an agent
file in Molt's form, and the adaptive KL controller follows the KL the trainer measured. One run checks both;
each agent form is checked in tests/test_agents_molt.py, the KL each update measures in test_train_updates.py."""

import json

import pytest
from helpers.loop import ROOT, rows

from instar.cli.main import main

pytestmark = pytest.mark.slow


def test_molts_quick_start_line_trains_a_molt_agent_and_the_kl_controller_follows_the_measured_kl(
        tmp_path, tiny_model_dir, capsys):
    # molt_anthropic_agent.py rewards an answer that contains the label: "e" is in ~95% of a random model's
    # answers (all 64 of a batch, ~4% of the time), a snowman in none, so the batch's rewards always differ and
    # the policy moves
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i}*7+3?", "label": "e" if i % 2 else "\u2603"}) + "\n"
                               for i in range(40)))
    out = tmp_path / "run"
    main(["rl", "--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset", str(prompts),
          "--train.agent_path", str(ROOT / "tests/agents/molt_anthropic_agent.py"),
          "--vllm.num_engines", "2", "--rollout.batch_size", "8", "--train.batch_size", "8",
          "--algo.advantage.estimator", "reinforce", "--fsdp.attn_implementation", "sdpa",
          "--ckpt.output_dir", str(out),
          # not in Molt's line: a short run of short answers on CPU, and an adaptive KL in the reward
          "--train.max_steps", "2", "--data.max_new_tokens", "16", "--actor.learning_rate", "1e-3",
          "--algo.kl.use_in", "reward", "--algo.kl.coef", "0.05", "--algo.kl.target", "1e-6",
          "--algo.kl.horizon", "64"])
    chosen = "instar: rollout engine embedded (--rollout.engine auto, no GPU in the Ray cluster)"
    assert chosen in capsys.readouterr().out
    m = rows(out / "metrics.jsonl")
    assert [r["step"] for r in m] == [1, 2]
    # 8 prompts x 8 samples = 64 trajectories, 8 per update; none dropped
    assert all(r["trajectories"] == 64 and r["actor/updates"] == 8 for r in m)
    assert not any(k.startswith("agent/dropped") for r in m for k in r)
    assert abs(m[0]["actor/vllm_kl"]) < 1e-3  # engine and trainer (sdpa) agree on the first batch
    # the first update's ratio is 1; the seven after it see a policy that moved, and some tokens get clipped
    assert m[0]["actor/policy_clip_ratio"] > 0
    coef = 0.05  # fed the measured KL, kl_coef follows it (fed 0, as once, it would shrink every step)
    for r in m:
        coef *= 1 + min(max(r["actor/ref_kl"] / 1e-6 - 1, -0.2), 0.2) * 64 / 64
        assert r["kl_coef"] == pytest.approx(coef)
    assert m[1]["actor/ref_kl"] > 1.2e-6 and m[1]["kl_coef"] > m[0]["kl_coef"]  # the policy moved: it grows
    config = json.loads((out / "config.json").read_text())
    assert config["fsdp"]["attn_implementation"] == "sdpa"
    assert (config["algo"]["advantage"]["is_correction_level"], config["algo"]["advantage"]["is_correction_mode"]) \
        == ("geo", "mask")
