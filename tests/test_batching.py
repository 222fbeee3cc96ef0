"""From finished groups to trainer rows: validation, dynamic filter, row layout, rollout metrics."""

import json

import pytest
import torch

from instar.config import RLConfig
from instar.contract import Sample, Trajectory
from instar.runtime.batching import mini_batches, rollout_metrics, select, seq_weights, to_rows
from instar.runtime.pool import Group, PoolState


def traj(reward, versions=(3, 3), segments=1, valid=True, rid="r"):
    seg = Sample([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.25], [-1, -1, *versions])
    bad = Sample([1, 2], [0, 0], [0.0, 0.0], [-1, -1])  # no action tokens: breaks the contract
    return Trajectory([seg] * segments if valid else [bad], reward=reward, rollout_id=rid)


def test_select_drops_invalid_and_empty_groups_by_reason():
    groups = [Group(0, 0, 5, [traj(1.0), traj(0.0, valid=False)]), Group(1, 0, 6, [traj(0.0, valid=False)])]
    kept, rejected, metrics = select(groups, RLConfig())
    assert [g.prompt_index for g in kept] == [5] and [g.prompt_index for g in rejected] == [6]
    assert len(kept[0].trajectories) == 1
    assert len(groups[0].trajectories) == 2  # the caller's groups are left as they came
    assert metrics == {"dropped/invalid": 2.0, "dropped/empty_group": 1.0}


def test_dynamic_filter_keeps_groups_with_mixed_scores():
    cfg = RLConfig()
    cfg.algo.dynamic_filter = (0.0, 1.0)
    groups = [Group(0, 0, 0, [traj(1.0), traj(1.0)]), Group(1, 0, 1, [traj(0.0), traj(1.0)]),
              Group(2, 0, 2, [traj(0.0), traj(0.0)])]
    kept, rejected, metrics = select(groups, cfg)
    assert [g.prompt_index for g in kept] == [1] and [g.prompt_index for g in rejected] == [0, 2]
    assert metrics["dynamic_filter/pass_rate"] == 1 / 3


def test_rows_keep_trajectory_segments_adjacent():
    groups = [Group(0, 0, 0, [traj(1.0, segments=2), traj(0.5)]), Group(1, 0, 1, [traj(0.0)])]
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


def test_mini_batches_deal_whole_trajectories_into_updates():
    # 4 trajectories (the first two have 2 segments): rows 0-1, 2-3, 4, 5
    groups = [Group(0, 0, 0, [traj(1.0, segments=2), traj(0.5, segments=2)]),
              Group(1, 0, 1, [traj(0.0), traj(1.0)])]
    rows = to_rows(groups)
    cfg = RLConfig()
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt = 2, 2
    assert mini_batches(rows, cfg, step=0) == [[0, 1, 2, 3, 4, 5]]  # default: one update, no shuffle
    cfg.train.batch_size = 2  # 4 samples / 2 = 2 updates
    updates = mini_batches(rows, cfg, step=0)
    assert len(updates) == 2 and sorted(sum(updates, [])) == [0, 1, 2, 3, 4, 5]
    by_traj = {0: {0, 1}, 1: {2, 3}, 2: {4}, 3: {5}}
    for u in updates:  # whole trajectories, two per update
        assert sum(by_traj[t] <= set(u) for t in by_traj) == 2 and set(u) == set().union(
            *(by_traj[t] for t in by_traj if by_traj[t] <= set(u)))
    assert mini_batches(rows, cfg, step=0) == updates  # seeded: a resumed step deals the same way
    assert any(mini_batches(rows, cfg, step=s) != updates for s in range(1, 6))  # and differently per step
    cfg.train.max_epochs = 3
    epochs = mini_batches(rows, cfg, step=0)
    assert len(epochs) == 6 and epochs[:2] == updates
    assert all(sorted(sum(epochs[e:e + 2], [])) == [0, 1, 2, 3, 4, 5] for e in (0, 2, 4))
    cfg.fsdp.num_ranks = 3  # 4 trajectories cannot feed 2 updates x 3 ranks: one update, every rank fed
    assert len(mini_batches(rows, cfg, step=0)) == 3


def test_seq_weights_are_one_over_each_trajectorys_action_tokens():
    long = Sample([1, 2, 3, 4, 5], [0, 1, 1, 1, 0], [0.0, -0.5, -0.5, -0.5, 0.0], [-1, 3, 3, 3, -1])
    two = traj(1.0)
    two.segments = [two.segments[0], long]  # 2 + 3 action tokens over its two segments
    rows = to_rows([Group(0, 0, 0, [two, traj(0.0)])])
    assert seq_weights(RLConfig(), rows) is None  # token-mean needs no trajectories
    cfg = RLConfig()
    cfg.actor.loss_agg_mode = "seq-mean-token-mean"
    got = seq_weights(cfg, rows)
    expected = [[0, 0, 0.2, 0.2], [0, 0.2, 0.2, 0.2, 0], [0, 0, 0.5, 0.5]]
    assert [w.tolist() for w in got] == [pytest.approx(e) for e in expected]
    assert sum(w.sum() for w in got).item() == pytest.approx(2.0)  # an update's sum: its trajectories


def test_group_round_trips_through_json():
    state = PoolState([Group(7, 2, 5, [traj(1.0, segments=2), traj(0.0)])], next_group_id=9)
    back = PoolState.from_json(json.loads(json.dumps(state.to_json())))
    assert back.next_group_id == 9 and [(g.group_id, g.epoch, g.prompt_index) for g in back.pending] == [(7, 2, 5)]
    assert [t.to_json() for t in back.pending[0].trajectories] == [t.to_json() for t in state.pending[0].trajectories]
