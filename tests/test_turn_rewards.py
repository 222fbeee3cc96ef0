"""Per-turn rewards: an Env's step rewards are kept per turn and reach reinforce and gae as token rewards at each
turn's last action token, discounted per turn by --algo.advantage.turn_gamma; grpo still uses their sum."""

import json

import pytest
import torch
from helpers.agents import USER, hosting, task
from helpers.loop import make_cfg, rows

import instar
from instar.agents import Env, Result, StepEnvRunner
from instar.config import RLConfig
from instar.contract import ContractError, Sample, Trajectory, read_jsonl
from instar.runtime.batching import advantages, to_rows, turn_rewards
from instar.runtime.pool import Group

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def three_turns(rewards):
    """Turns 1 and 2 in a first segment, turn 3 in a second (history was rewritten)."""
    first = Sample([1, 2, 3, 4, 5, 6, 7], [0, 1, 1, 0, 0, 1, 0], [0.0] * 7, [-1, 1, 1, -1, -1, 1, -1])
    second = Sample([1, 8, 9, 10], [0, 0, 1, 1], [0.0] * 4, [-1, -1, 1, 1])
    return Trajectory([first, second], sum(rewards or [3.0]), turn_rewards=rewards, rollout_id="t")


def test_turn_rewards_golden():
    # R = [1 + 0.5 (0 + 0.5 * 2), 0 + 0.5 * 2, 2] = [1.5, 1, 2]; each turn end gets R_k - R_k+1
    x = to_rows([Group(0, 0, 0, [three_turns([1.0, 0.0, 2.0]), three_turns(None)])])
    out = turn_rewards(x, turn_gamma=0.5)
    assert out.tolist() == [[0, 0, 0.5, 0, 0, -1, 0], [0, 0, 0, 2, 0, 0, 0],
                            [0] * 7, [0, 0, 0, 3, 0, 0, 0]]  # a whole reward: on the last action token
    assert turn_rewards(to_rows([Group(0, 0, 0, [three_turns(None)])]), 0.5) is None


@pytest.mark.parametrize("estimator,expected", [
    ("gae", [[0, 1.5, 1.5, 0, 0, 1, 0], [0, 0, 2, 2]]),  # values 0, lambda 1: each token's turn return
    ("grpo", None),  # the summed reward, as before
])
def test_estimators_credit_each_turn_with_its_return(estimator, expected):
    cfg = RLConfig()
    cfg.algo.advantage.estimator, cfg.algo.advantage.turn_gamma, cfg.algo.advantage.lam = estimator, 0.5, 1.0
    trajs = [three_turns([1.0, 0.0, 2.0]), three_turns([0.0, 0.0, 0.0])]
    x = to_rows([Group(0, 0, 0, trajs)])
    values = [torch.zeros(len(s.token_ids)) for s in x.samples]
    adv, _, _ = advantages(cfg, x, None, None, values if estimator == "gae" else None, 0.0)
    if expected is not None:
        assert [a.tolist() for a in adv[:2]] == expected
    else:  # (3 - 1.5) / std([3, 0]) on every action token of the first trajectory
        assert adv[0][1].item() == pytest.approx(1.5 / (4.5 ** 0.5), rel=1e-5)


def test_turn_rewards_must_match_the_sampled_turns():
    bad = three_turns([1.0, 2.0])
    with pytest.raises(ContractError, match="trajectory 't' has 2 turn rewards for 3 sampled turns"):
        bad.validate()


class ThreeTurns(Env):
    async def step(self, state):
        reply = {0: "Check it.", 1: "Thanks"}.get(state["turn"])
        return Result(reward=[1.0, 0.0, 2.0][state["turn"]], observation=reply or "", terminated=reply is None)


@pytest.mark.asyncio
async def test_an_env_keeps_its_step_rewards_per_turn(scripted):
    async with hosting(scripted, StepEnvRunner(ThreeTurns)) as (host, _):
        traj = await host.rollout(task())
    assert (traj.reward, traj.turn_rewards, traj.turns) == (3.0, [1.0, 0.0, 2.0], 3)
    assert sum(len(s.turn_ends) for s in traj.segments) == 3


@pytest.mark.slow
def test_instar_rl_with_an_env_that_rewards_each_turn(tmp_path, scripted):
    """The scripted model holds the three-turn conversation (tests/agents/turn_env.py asks what it was trained on)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": USER["content"], "label": "5"}) + "\n")
    cfg = make_cfg(tmp_path, scripted.path, str(prompts), **{
        "train.max_steps": 2, "train.agent_path": str(ROOT / "tests/agents/turn_env.py"),
        "train.rollout_dump_dir": str(tmp_path / "dumps"), "data.max_new_tokens": 32})
    cfg.algo.advantage.estimator, cfg.algo.advantage.turn_gamma = "reinforce", 0.5
    instar.rl(cfg)
    assert len(rows(tmp_path / "run/metrics.jsonl")) == 2
    dumped = [t for f in sorted((tmp_path / "dumps").iterdir()) for t in read_jsonl(str(f))]
    assert dumped and all(len(t.turn_rewards) == sum(len(s.turn_ends) for s in t.segments) for t in dumped)
    assert all(t.reward == pytest.approx(sum(t.turn_rewards)) for t in dumped)
    assert max(t.turns for t in dumped) == 3
