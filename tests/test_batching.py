"""From finished groups to trainer rows: validation, dynamic filter, row layout, rollout metrics."""

import torch

from instar.config import RLConfig
from instar.contract import Sample, Trajectory
from instar.runtime.batching import rollout_metrics, select, to_rows
from instar.runtime.pool import Group


def traj(reward, versions=(3, 3), segments=1, valid=True, rid="r"):
    seg = Sample([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.25], [-1, -1, *versions])
    bad = Sample([1, 2], [0, 0], [0.0, 0.0], [-1, -1])  # no action tokens: breaks the contract
    return Trajectory([seg] * segments if valid else [bad], reward=reward, rollout_id=rid)


def test_select_drops_invalid_and_empty_groups_by_reason():
    groups = [Group(0, 0, 5, 0, [traj(1.0), traj(0.0, valid=False)]), Group(1, 0, 6, 0, [traj(0.0, valid=False)])]
    kept, metrics = select(groups, RLConfig())
    assert [g.prompt_index for g in kept] == [5]
    assert len(kept[0].trajectories) == 1
    assert metrics == {"dropped/invalid": 2.0, "dropped/empty_group": 1.0}


def test_dynamic_filter_keeps_groups_with_mixed_scores():
    cfg = RLConfig()
    cfg.algo.dynamic_filter = (0.0, 1.0)
    groups = [Group(0, 0, 0, 0, [traj(1.0), traj(1.0)]), Group(1, 0, 1, 0, [traj(0.0), traj(1.0)]),
              Group(2, 0, 2, 0, [traj(0.0), traj(0.0)])]
    kept, metrics = select(groups, cfg)
    assert [g.prompt_index for g in kept] == [1]
    assert metrics["dynamic_filter/pass_rate"] == 1 / 3


def test_rows_keep_trajectory_segments_adjacent():
    groups = [Group(0, 0, 0, 0, [traj(1.0, segments=2), traj(0.5)]), Group(1, 0, 1, 0, [traj(0.0)])]
    rows = to_rows(groups)
    assert len(rows.samples) == 4
    assert rows.traj_index.tolist() == [0, 0, 1, 2]
    assert rows.group_index.tolist() == [0, 0, 0, 1]
    assert torch.equal(rows.rewards, torch.tensor([1.0, 1.0, 0.5, 0.0]))


def test_rollout_metrics_staleness_and_lengths():
    trajs = [traj(1.0, versions=(3, 4)), traj(0.0, versions=(5, 5))]
    m = rollout_metrics(trajs, policy_version=5)
    assert m["reward"] == 0.5 and m["response_length"] == 2.0
    assert m["staleness_max"] == 2.0  # the oldest token of the first trajectory came from version 3
    assert m["staleness/2"] == 0.5 and m["staleness/0"] == 0.5
