"""--train.reward_fns: reward functions in TRL's convention, called once per group with TRL's keyword lists,
weighted, logged per component; math-verify limited in time off the main thread."""

import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.agents import GREEDY, USER, hosting
from helpers.loop import make_cfg, rows

import instar
from instar.agents import Task
from instar.agents.reward_fns import RewardFnRunner, load_reward_fns
from instar.agents.rewards import math_equal
from instar.config import ConfigError
from instar.data.chat import encode

ROOT = Path(__file__).resolve().parents[1]
FILE = str(ROOT / "tests/agents/trl_rewards.py")


def group(prompt, labels, difficulties, chat=True) -> list[Task]:
    return [Task(prompt=prompt, label=label, metadata={"difficulty": d}, chat=chat, sampling_params=GREEDY,
                 rollout_id=f"r{k}", group_id=1) for k, (label, d) in enumerate(zip(labels, difficulties))]


@pytest.mark.asyncio
async def test_a_group_is_scored_once_with_trl_arguments_and_weights(scripted):
    fns = load_reward_fns([f"{FILE}:accuracy_reward", f"{FILE}:length_penalty", f"{FILE}:difficulty_bonus"],
                          [1.0, 0.5, 2.0])
    calls = sys.modules["instar_agent_trl_rewards"].CALLS
    answer = encode(scripted.tokenizer, "The answer is 5.") + [scripted.tokenizer.eos_token_id]
    async with hosting(scripted, RewardFnRunner(fns, label_key="solution")) as (host, _):
        trajs = await host.run_group(group([USER], ["5", "5", "6"], [1.0, None, 2.0]))
        assert len(calls) == 1  # once for the group
        assert calls[0] == ([[USER]] * 3, [[{"role": "assistant", "content": "The answer is 5."}]] * 3,
                            [1.0, None, 2.0])
        host.runner = RewardFnRunner(fns[1:])  # accuracy_reward reads chat completions only
        text = await host.run_group(group([USER], ["5"], [0.0], chat=False))
        assert calls[1][:2] == (["What is 2+3?"], ["The answer is 5."])  # a string prompt: strings, as in TRL
    length = -len(answer) / 100
    assert [t.info["rewards"] for t in trajs] == [
        {"accuracy_reward": 1.0, "length_penalty": length, "difficulty_bonus": 0.25},
        {"accuracy_reward": 1.0, "length_penalty": length},  # None: no score from that function
        {"accuracy_reward": 0.0, "length_penalty": length, "difficulty_bonus": 0.5}]
    assert [t.reward for t in trajs] == pytest.approx([1 + 0.5 * length + 0.5, 1 + 0.5 * length,
                                                       0.5 * length + 1.0])
    assert text[0].reward == pytest.approx(0.5 * length)
    assert (trajs[0].turns, trajs[0].tool_calls) == (1, 0)


@pytest.mark.asyncio
async def test_a_reward_function_that_returns_no_numbers_stops_with_its_name(scripted):
    runner = RewardFnRunner(load_reward_fns([f"{FILE}:not_numbers"], None))
    async with hosting(scripted, runner) as (host, _):
        with pytest.raises(ConfigError, match=r"--train.reward_fns: not_numbers must return a list of 1 finite "
                                              r"numbers \(None for no score\), got \['high'\]"):
            await host.run_group(group([USER], ["5"], [None]))


@pytest.mark.parametrize("specs,weights,message", [
    (["no_such_module:fn"], None, "--train.reward_fns 'no_such_module:fn': cannot import 'no_such_module'"),
    ([f"{FILE}:missing"], None, f"--train.reward_fns '{FILE}:missing': name a function, as path/to/file.py:fn"),
    ([FILE], None, f"--train.reward_fns '{FILE}': name a function"),
    ([f"{FILE}:length_penalty"], [1.0, 2.0], "--train.reward_weights has 2 weights for 1 reward functions"),
    ([f"{FILE}:length_penalty", f"{FILE}:length_penalty"], None,
     "--train.reward_fns: two reward functions are named alike"),
])
def test_bad_reward_specs_say_what_is_wrong(specs, weights, message):
    with pytest.raises(ConfigError) as e:
        load_reward_fns(specs, weights)
    assert str(e.value).startswith(message)


def test_math_verify_is_time_limited_off_the_main_thread():
    """A tower of powers keeps sympy busy for hours; off the main thread (where agents grade) SIGALRM cannot
    be set, so math_equal grades in a worker process whose main thread can."""
    out = []
    thread = threading.Thread(target=lambda: out.append(math_equal("\\boxed{9^{9^{9^{9}}}}", "1", timeout_s=1)),
                              daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(60)
    assert out == [False], f"still grading after {time.monotonic() - start:.0f} s"


@pytest.mark.slow
def test_instar_rl_with_reward_functions_only(tmp_path, tiny_model_dir, prompts):
    """No agent file: a file's reward function and a callable given to `instar.rl`, their components logged."""
    def has_digit(completions, **kwargs):  # defined here: reaches the agent runner by value
        return [float(any(ch.isdigit() for ch in c)) for c in completions]  # string prompts: strings

    cfg = make_cfg(tmp_path, tiny_model_dir, prompts, **{"train.max_steps": 2, "train.agent_path": "",
                                                          "train.reward_fns": [f"{FILE}:length_penalty"],
                                                          "train.reward_weights": [1.0, 0.5]})
    instar.rl(cfg, reward_fns=[has_digit])
    metrics = rows(tmp_path / "run/metrics.jsonl")
    assert len(metrics) == 2
    for m in metrics:
        assert m["reward/length_penalty/mean"] < 0 and m["reward/has_digit/std"] >= 0
        weighted = m["reward/length_penalty/mean"] + 0.5 * m["reward/has_digit/mean"]
        assert m["reward"] == pytest.approx(weighted, abs=1e-6)  # float32 means
        assert m["reward/min"] <= m["reward"] <= m["reward/max"] and m["turns_per_trajectory"] == 1.0
        assert 0 <= m["reward/zero_std_groups"] <= 1




def test_the_flags_take_comma_separated_lists_and_bad_specs_fail_before_the_run(tiny_model_dir, prompts, capsys):
    from instar.cli.main import main, parse

    _, cfg = parse(["rl", "--train.reward_fns", f"{FILE}:accuracy_reward,{FILE}:length_penalty",
                    "--train.reward_weights", "1,0.5"])
    assert (cfg.train.reward_fns, cfg.train.reward_weights) == ([f"{FILE}:accuracy_reward", f"{FILE}:length_penalty"],
                                                                [1.0, 0.5])
    with pytest.raises(SystemExit) as e:
        main(["rl", "--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset", prompts,
              "--train.reward_fns", f"{FILE}:missing"])
    assert str(e.value) == f"instar rl: --train.reward_fns '{FILE}:missing': name a function, as path/to/file.py:fn " \
                           "or package.module:fn"
    with pytest.raises(SystemExit, match="give one of --train.agent_path"):
        main(["rl", "--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset", prompts,
              "--train.reward_fns", f"{FILE}:length_penalty", "--train.agent_path", FILE])
