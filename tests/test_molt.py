"""Coming from Molt: its quick-start command line (entry point and paths swapped) trains on CPU, its
agent-file forms train through `instar rl` with several updates per batch, and the adaptive KL
controller follows the measured KL in both --algo.kl.use_in modes."""

import json
from pathlib import Path

import pytest

from instar.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """The test agents reward an answer that contains the label: "e" is in some of a random model's answers,
    so the rewards of a group differ and the policy moves."""
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i}*7+3?", "label": "e"}) + "\n" for i in range(40)))
    return str(path)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_molts_quick_start_line_trains(tmp_path, tiny_model_dir, prompts, capsys):
    out = tmp_path / "run"
    main(["rl", "--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset", prompts,
          "--train.agent_path", str(ROOT / "tests/agents/length_env.py"),
          "--vllm.num_engines", "2", "--rollout.batch_size", "8", "--train.batch_size", "8",
          "--algo.advantage.estimator", "reinforce", "--fsdp.attn_implementation", "sdpa",
          "--ckpt.output_dir", str(out),
          # not in Molt's line: a short run of short answers on CPU
          "--train.max_steps", "2", "--data.max_new_tokens", "16"])
    chosen = "instar: rollout engine embedded (--rollout.engine auto, no GPU in the Ray cluster)"
    assert chosen in capsys.readouterr().out
    m = metrics(out)
    assert [r["step"] for r in m] == [1, 2]
    # 8 prompts x 8 samples = 64 trajectories, 8 per update
    assert all(r["trajectories"] == 64 and r["actor/updates"] == 8 for r in m)
    assert all(r["actor/policy_clip_ratio"] >= 0 and abs(r["actor/vllm_kl"]) < 1e-3 for r in m)
    config = json.loads((out / "config.json").read_text())
    assert config["fsdp"]["attn_implementation"] == "sdpa"
    assert (config["algo"]["advantage"]["is_correction_level"], config["algo"]["advantage"]["is_correction_mode"]) \
        == ("geo", "mask")


def rl(out: Path, model, prompts: str, agent: str, *flags: str) -> list[dict]:
    """A 2-step run of 2 prompts x 4 samples, 2 updates of 4 samples each."""
    main(["rl", "--actor.model_name_or_path", str(model), "--data.prompt_dataset", prompts,
          "--train.agent_path", str(ROOT / "tests/agents" / agent), "--rollout.batch_size", "2",
          "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "4", "--train.max_steps", "2",
          "--data.max_new_tokens", "16", "--data.max_len", "1024", "--actor.learning_rate", "1e-3",
          "--ckpt.output_dir", str(out), *flags])
    m = metrics(out)
    assert [r["step"] for r in m] == [1, 2]
    assert all(r["trajectories"] == 8 and r["actor/updates"] == 2 and r["actor/action_tokens"] > 0 for r in m)
    assert not any(k.startswith("agent/dropped") for r in m for k in r)
    return m


@pytest.mark.parametrize("agent", ["molt_openai_agent.py", "molt_anthropic_agent.py", "molt_env.py", "gym_env.py"])
def test_molt_form_agents_train_two_steps_with_mini_batches(agent, tmp_path, tiny_model_dir, prompts):
    rl(tmp_path / "run", tiny_model_dir, prompts, agent)


@pytest.mark.parametrize("use_in,estimator", [("loss", "grpo"), ("reward", "reinforce")])
def test_kl_controller_follows_the_measured_kl(use_in, estimator, tmp_path, tiny_model_dir, prompts):
    # length_env's reward varies with the answer's length, so advantages are non-zero and the policy moves
    m = rl(tmp_path / "run", tiny_model_dir, prompts, "length_env.py", "--algo.kl.use_in", use_in,
           "--algo.advantage.estimator", estimator, "--algo.kl.coef", "0.05", "--algo.kl.target", "1e-6",
           "--algo.kl.horizon", "8")
    coef = 0.05  # fed the measured KL, kl_coef follows it (fed 0, as before, it would shrink every step)
    for r in m:
        coef *= 1 + min(max(r["actor/ref_kl"] / 1e-6 - 1, -0.2), 0.2) * 8 / 8
        assert r["kl_coef"] == pytest.approx(coef)
    assert m[1]["actor/ref_kl"] > 1.2e-6 and m[1]["kl_coef"] > m[0]["kl_coef"]  # the policy moved: it grows
