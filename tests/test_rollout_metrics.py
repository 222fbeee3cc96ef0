"""The rollout metrics of a step, exactly: reward spread, zero-std groups, turns, tool calls, reward components
and the agents' numeric info fields."""

import pytest

from instar.contract import Sample, Trajectory
from instar.runtime.batching import rollout_metrics


def traj(reward, group, info, turns=1, tool_calls=0):
    seg = Sample([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.5], [-1, 4, 5])
    return Trajectory([seg], reward, info=info, group_id=group, turns=turns, tool_calls=tool_calls)


def test_rollout_metrics_golden():
    trajs = [traj(1.0, 0, {"rewards": {"acc": 1.0, "fmt": 0.5}}),
             traj(1.0, 0, {"rewards": {"acc": 1.0}}),  # fmt gave None: left out of its mean
             traj(0.0, 1, {"turns": [{"tool": "2+3", "ok": True}, {"ok": False, "n": 3}]}, turns=2, tool_calls=1),
             traj(2.0, 1, {"tool_calls": 2, "name": "x"}, turns=3, tool_calls=2)]
    m = rollout_metrics(trajs, policy_version=5)
    assert m["reward"] == 1.0 and m["reward/std"] == pytest.approx(0.5 ** 0.5)
    assert (m["reward/min"], m["reward/max"], m["reward/zero_std_groups"]) == (0.0, 2.0, 0.5)
    assert (m["turns_per_trajectory"], m["tool_calls_per_trajectory"]) == (7 / 4, 3 / 4)
    assert (m["reward/acc/mean"], m["reward/acc/std"], m["reward/fmt/mean"], m["reward/fmt/std"]) == (1, 0, 0.5, 0)
    # numeric info fields (an Env's per turn; bools as rates); strings and lists are left out
    assert (m["info/ok/mean"], m["info/ok/std"], m["info/n/mean"], m["info/tool_calls/mean"]) == (0.5, 0.5, 3.0, 2.0)
    assert not any(k.startswith(("info/tool/", "info/name/", "info/turns/", "info/rewards/")) for k in m)
    assert (m["staleness_max"], m["staleness/1"]) == (1.0, 1.0)
