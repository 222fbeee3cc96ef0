"""Advantage estimators: golden values worked out by hand, multi-segment and multi-turn placement, errors."""

import math

import pytest
import torch

from instar.algo import ESTIMATORS, AdvantageInputs, Needs, compute_advantages
from instar.cli.flags import rows
from instar.cli.main import command_parser
from instar.config import AlgoConfig, ConfigError, RLConfig

EPS = 1e-6  # GRPO_EPS


def algo(estimator: str, **advantage) -> AlgoConfig:
    cfg = AlgoConfig()
    cfg.advantage.estimator = estimator
    for k, v in advantage.items():
        setattr(cfg.advantage, k, v)
    return cfg


def per_row(adv: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The advantage of each row, checking it is the same on all its action tokens and 0 elsewhere."""
    out = []
    for a, m in zip(adv, mask.bool()):
        assert torch.all(a[~m] == 0)
        assert torch.allclose(a[m], a[m][0].expand(int(m.sum())))
        out.append(a[m][0].item())
    return out


def group_batch() -> AdvantageInputs:
    """Group 0: trajectories A (two segments: rows 0 and 1), B, C with rewards 2, 0, 1.
    Group 1: D, E, F with rewards 5, 1, 3. Group 2: G alone (reward 7). Every row: 2 action tokens."""
    mask = torch.tensor([[0, 1, 1, 0]] * 8)
    return AdvantageInputs(action_mask=mask, rewards=torch.tensor([2., 2, 0, 1, 5, 1, 3, 7]),
                           group_index=torch.tensor([0, 0, 0, 0, 1, 1, 1, 2]),
                           traj_index=torch.tensor([0, 0, 1, 2, 3, 4, 5, 6]))


def test_grpo_counts_a_multi_segment_trajectory_once():
    x = group_batch()
    adv, returns, metrics = compute_advantages(algo("grpo"), x)
    # group 0: mean (2+0+1)/3 = 1, unbiased var ((1)^2+(-1)^2+0)/2 = 1 -> std 1 (counting A twice, mean would be 1.25)
    # group 1: mean 3, var (4+4+0)/2 = 4 -> std 2; group 2 alone: no peers -> 0
    a0, a1 = 1 / (1 + EPS), 2 / (2 + EPS)
    assert per_row(adv, x.action_mask) == pytest.approx([a0, a0, -a0, 0, a1, -a1, 0, 0], abs=1e-7)
    assert returns is None
    assert metrics["reward_mean"] == pytest.approx((2 + 0 + 1 + 5 + 1 + 3 + 7) / 7)  # per trajectory, not per row


def test_dr_grpo_is_reward_minus_group_mean():
    x = group_batch()
    adv = compute_advantages(algo("dr_grpo"), x)[0]
    assert per_row(adv, x.action_mask) == [1, 1, -1, 0, 2, -2, 0, 0]


def test_rloo_leaves_one_out():
    x = group_batch()
    adv = compute_advantages(algo("rloo"), x)[0]
    # A: 2 - (0+1)/2 = 1.5; B: 0 - (2+1)/2 = -1.5; C: 1 - (2+0)/2 = 0; D: 5 - (1+3)/2 = 3; E: 1 - 4 = -3; F: 3 - 3 = 0
    assert per_row(adv, x.action_mask) == pytest.approx([1.5, 1.5, -1.5, 0, 3, -3, 0, 0])


def test_reinforce_baseline_whitens_over_action_tokens():
    x = group_batch()
    adv = compute_advantages(algo("reinforce_baseline"), x)[0]
    # r - mean per row: [1, 1, -1, 0, 2, -2, 0, 0], two tokens each -> token mean 1/8;
    # population var over tokens = mean(v^2) - mean^2 = (1+1+1+4+4)/8 - 1/64
    rows = torch.tensor([1., 1, -1, 0, 2, -2, 0, 0])
    var = (rows**2).mean().item() - (1 / 8) ** 2
    expected = [(r - 1 / 8) / math.sqrt(var + 1e-8) for r in rows.tolist()]
    assert per_row(adv, x.action_mask) == pytest.approx(expected, rel=1e-6)


def test_reinforce_discounts_across_segments_and_skips_observations():
    # one trajectory: row 0 = [prompt, a, a, obs, a, pad], row 1 = [prompt, a, a, pad, pad, pad]; reward 1
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 1, 1, 0, 0, 0]])
    x = AdvantageInputs(action_mask=mask, rewards=torch.tensor([1., 1]), group_index=torch.tensor([0, 0]),
                        traj_index=torch.tensor([0, 0]))
    adv = compute_advantages(algo("reinforce", gamma=0.5), x)[0]
    # 5 action tokens in order; the reward on the last: returns 1/16, 1/8, 1/4, 1/2, 1 (gamma 0.5 per action token)
    # mean 1.9375/5 = 0.3875; deviations -0.325 -0.2625 -0.1375 0.1125 0.6125; population var 0.58125/5 = 0.11625
    dev = [-0.325, -0.2625, -0.1375, 0.1125, 0.6125]
    expected = torch.tensor([[0, dev[0], dev[1], 0, dev[2], 0], [0, dev[3], dev[4], 0, 0, 0]])
    expected /= math.sqrt(0.11625 + 1e-8)
    torch.testing.assert_close(adv, expected)


def test_reinforce_with_kl_in_reward():
    cfg = algo("reinforce", gamma=1.0)
    cfg.kl.use_in, cfg.kl.estimator = "reward", "k1"
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    old = torch.tensor([[-1., -1, -1], [-1, -1, 0]])
    ref = torch.tensor([[-2., -3, -1], [-1, -1, 0]])  # k1 = old - ref = 1, 2, 0 on row 0; 0 on row 1
    x = AdvantageInputs(action_mask=mask, rewards=torch.tensor([1., -1]), group_index=torch.tensor([0, 0]),
                        old_logprobs=old, ref_logprobs=ref, kl_coef=0.1)
    adv = compute_advantages(cfg, x)[0]
    # token rewards row 0: -0.1, -0.2, -0 + 1 -> returns 0.7, 0.8, 1.0; row 1: 0, -1 -> returns -1, -1
    # mean (0.7+0.8+1-1-1)/5 = 0.1; deviations 0.6 0.7 0.9 -1.1 -1.1; var (0.36+0.49+0.81+1.21+1.21)/5
    var = (0.36 + 0.49 + 0.81 + 1.21 + 1.21) / 5
    expected = torch.tensor([[0.6, 0.7, 0.9], [-1.1, -1.1, 0]]) / math.sqrt(var + 1e-8)
    torch.testing.assert_close(adv, expected)


def test_dense_turn_rewards_replace_the_outcome_reward():
    # [a, a, obs, a, a]: turn 1 reward 0.5 on its last action token, turn 2 reward 1 on the last
    mask = torch.tensor([[1, 1, 0, 1, 1]])
    dense = torch.tensor([[0, 0.5, 0, 0, 1]])
    x = AdvantageInputs(action_mask=mask, rewards=torch.tensor([1.5]), group_index=torch.tensor([0]),
                        token_rewards=dense)
    adv = compute_advantages(algo("reinforce", gamma=1.0), x)[0]
    # returns 1.5 1.5 _ 1 1; mean 1.25, deviations +-0.25, var 0.0625, std 0.25 -> +-1
    torch.testing.assert_close(adv, torch.tensor([[1., 1, 0, -1, -1]]) / math.sqrt(1 + 1e-8 / 0.0625))


def gae_batch() -> AdvantageInputs:
    # one trajectory: row 0 = [prompt, a, obs, a], row 1 = [prompt, a, pad, pad]; reward 1.
    # Values are 0.5 on action tokens and 9 elsewhere: gae must never read an observation's value.
    mask = torch.tensor([[0, 1, 0, 1], [0, 1, 0, 0]])
    values = torch.where(mask.bool(), 0.5, 9.0)
    return AdvantageInputs(action_mask=mask, rewards=torch.tensor([1., 1]), group_index=torch.tensor([0, 0]),
                           traj_index=torch.tensor([0, 0]), values=values)


def test_gae_is_transparent_across_observations_and_segments():
    x = gae_batch()
    adv, returns, _ = compute_advantages(algo("gae", gamma=1.0, lam=0.5), x)
    # action tokens t0 t1 t2, V = 0.5 each, reward 1 on t2, V after t2 = 0
    # d2 = 1 + 0 - 0.5 = 0.5, A2 = 0.5; d1 = 0 + 0.5 - 0.5 = 0, A1 = 0.5*0.5 = 0.25; A0 = 0.5*0.25 = 0.125
    torch.testing.assert_close(adv, torch.tensor([[0, 0.125, 0, 0.25], [0, 0.5, 0, 0]]))
    torch.testing.assert_close(returns, torch.tensor([[0, 0.625, 0, 0.75], [0, 1.0, 0, 0]]))  # A + V


def test_gae_discount():
    adv = compute_advantages(algo("gae", gamma=0.5, lam=1.0), gae_batch())[0]
    # d2 = 1 - 0.5 = 0.5 -> A2 = 0.5; d1 = 0.5*0.5 - 0.5 = -0.25 -> A1 = -0.25 + 0.5*0.5 = 0; d0 = -0.25 -> A0 = -0.25
    torch.testing.assert_close(adv, torch.tensor([[0, -0.25, 0, 0], [0, 0.5, 0, 0]]))


def test_whiten_gae_advantages_over_the_batch_but_not_the_returns():
    adv, returns, _ = compute_advantages(algo("gae", gamma=1.0, lam=0.5, whiten=True), gae_batch())
    # A = [1/8, 2/8, 4/8] (above): mean 7/24, deviations [-4, -1, 5] / 24, population var 42 / 576 / 3 = 7 / 288,
    # so (A - mean) / std = [-4, -1, 5] / 24 * 12 sqrt(2/7)
    k = math.sqrt(2 / 7)
    torch.testing.assert_close(adv, torch.tensor([[0, -2 * k, 0, -0.5 * k], [0, 2.5 * k, 0, 0]]))
    torch.testing.assert_close(returns, torch.tensor([[0, 0.625, 0, 0.75], [0, 1.0, 0, 0]]))  # A + V before


def test_on_policy_distill_is_teacher_minus_student_logprob():
    mask = torch.tensor([[1, 1, 0]])
    x = AdvantageInputs(action_mask=mask, rewards=torch.tensor([3.]), group_index=torch.tensor([0]),
                        old_logprobs=torch.tensor([[-1., -2, float("nan")]]),
                        ref_logprobs=torch.tensor([[-1.5, -1, 0]]))
    adv = compute_advantages(algo("on_policy_distill"), x)[0]
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 1.0, 0.0]]))  # the padded NaN does not leak


def test_each_estimator_declares_what_it_needs():
    # the checks, the cluster (reference, critic) and the loop (old logprobs) act on these records alone
    assert {name: e.needs for name, e in ESTIMATORS.items()} == {
        "reinforce_baseline": Needs(grouped=True), "rloo": Needs(grouped=True), "grpo": Needs(grouped=True),
        "dr_grpo": Needs(grouped=True), "reinforce": Needs(token_level=True),
        "gae": Needs(critic=True, token_level=True), "on_policy_distill": Needs(ref=True, old=True, teacher=True)}
    help_text = {flag: doc for flag, _, doc in rows(command_parser("rl", RLConfig))}["--algo.advantage.estimator"]
    assert all(name in help_text for name in ESTIMATORS), help_text
    with pytest.raises(ConfigError, match=r"--algo.advantage.estimator 'ppo2' is not registered; choose one of "
                                          r"\['dr_grpo', 'gae', 'grpo', 'on_policy_distill', 'reinforce', "):
        compute_advantages(algo("ppo2"), group_batch())


def test_errors_name_the_fix():
    x = gae_batch()
    x.values = None
    with pytest.raises(ValueError, match="gae needs AdvantageInputs.values"):
        compute_advantages(algo("gae"), x)
    cfg = algo("grpo")
    cfg.kl.use_in = "reward"
    y = group_batch()
    y.kl_coef = 0.1
    with pytest.raises(ValueError, match="set --algo.kl.use_in loss"):
        compute_advantages(cfg, y)
    y = group_batch()
    y.rewards[1] = 3.0  # second segment of trajectory A disagrees with the first
    with pytest.raises(ValueError, match="same reward and group_index"):
        compute_advantages(algo("grpo"), y)
    with pytest.raises(ValueError, match="on_policy_distill needs"):
        compute_advantages(algo("on_policy_distill"), group_batch())
