"""Policy and value losses: golden values, each loss aggregation, the split invariance, NaN safety."""

import math
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from instar.algo import LOSSES, policy_loss, value_loss
from instar.checks import check
from instar.config import ActorConfig, ConfigError, RLConfig


def rl(loss_mode: str = "ppo", **actor) -> RLConfig:
    cfg = RLConfig()
    cfg.actor.loss_mode = loss_mode
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    return cfg


def run(cfg, delta, adv, mask=None, **kw):
    """Loss and d loss / d logprobs for logprobs = old + delta (rollout == old, so IS weights are 1)."""
    old = torch.full_like(delta, -1.0)
    lp = (old + delta).requires_grad_()
    mask = torch.ones_like(delta, dtype=torch.bool) if mask is None else mask
    loss, metrics = policy_loss(cfg, lp, old, old.clone(), adv, mask, **kw)
    loss.backward()
    return loss.item(), lp.grad, metrics


def test_ppo_asymmetric_clip():
    delta = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1)]])
    loss, grad, m = run(rl(eps_clip_low_high=(0.2, 0.28)), delta, torch.tensor([[1., -1, 2]]))
    # t0: r 1.5, A 1: min(1.5, 1.28) = 1.28 (clipped above);  t1: r 0.5, A -1: min(-0.5, -0.8) = -0.8 (clipped below)
    # t2: r 1.1, A 2: 2.2, unclipped.  loss = -(1.28 - 0.8 + 2.2) / 3; only t2 has gradient: -A r / 3
    assert loss == pytest.approx(-(1.28 - 0.8 + 2.2) / 3, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0, 0, -2 * 1.1 / 3]]))
    assert m["policy_clip_ratio"].item() == pytest.approx(2 / 3)
    assert m["policy_kl"].item() == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 3, rel=1e-5)


def test_ppo_dual_clip_caps_negative_advantages():
    delta, adv = torch.tensor([[math.log(5.0)]]), torch.tensor([[-1.0]])
    loss, grad, _ = run(rl(), delta, adv)
    assert loss == pytest.approx(5.0) and grad.item() == pytest.approx(5.0)  # -r A, d/dlp = -A r = 5
    loss, grad, m = run(rl(dual_clip=3.0), delta, adv)
    assert loss == pytest.approx(3.0) and grad.item() == 0  # capped at -c A = 3, constant
    assert m["policy_clip_ratio"].item() == 1


def test_gspo_uses_the_sequence_ratio():
    # row 0: log r = [log 2, 0] -> sequence ratio exp(log 2 / 2) = sqrt 2 > 1.28: clipped, no gradient
    # row 1: log r = [0.1, -0.1] -> sequence ratio 1: loss -1 per token, gradient -s A / N = -1/4 per token
    delta = torch.tensor([[math.log(2.0), 0], [0.1, -0.1]])
    loss, grad, m = run(rl("gspo"), delta, torch.ones(2, 2))
    assert loss == pytest.approx((-1.28 * 2 - 2) / 4, rel=1e-6)  # per-token ppo would give -(1.28+1+e^.1+e^-.1)/4
    torch.testing.assert_close(grad, torch.tensor([[0, 0], [-0.25, -0.25]]))
    assert m["policy_clip_ratio"].item() == 0.5


def test_cispo_keeps_gradient_on_clipped_tokens():
    delta = torch.tensor([[math.log(2.0), 0]])
    loss, grad, m = run(rl("cispo"), delta, torch.ones(1, 2))
    # weights sg(clip(r)) = [1.28, 1]; logprobs = [-1 + log 2, -1]; loss = -(1.28 (-1 + log 2) + 1 (-1)) / 2
    assert loss == pytest.approx(-(1.28 * (-1 + math.log(2)) - 1) / 2, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-1.28 / 2, -0.5]]))
    assert m["policy_clip_ratio"].item() == 0.5


def test_entropy_bonus_and_kl_loss():
    cfg = rl(entropy_coef=0.1)
    cfg.algo.kl.coef, cfg.algo.kl.estimator = 0.5, "k3"
    old = torch.tensor([[-1.0, -1.0]])
    lp = old.clone().requires_grad_()
    ent = torch.tensor([[0.5, 1.5]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0 + math.log(2)]])
    loss, m = policy_loss(cfg, lp, old, old, torch.zeros(1, 2), torch.ones(1, 2), entropy=ent, ref_logprobs=ref)
    loss.backward()
    # surrogate 0 (A = 0); entropy mean 1 -> -0.1; k3 = [0, (2 - 1) - log 2] -> mean (1 - log 2)/2, times 0.5
    assert m["entropy"].item() == 1.0
    assert m["ref_kl"].item() == pytest.approx((1 - math.log(2)) / 2)
    assert loss.item() == pytest.approx(-0.1 + 0.5 * (1 - math.log(2)) / 2)
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.05, -0.05]]))
    # d k3 / d lp = 1 - r with r = p_ref / p = [1, 2]: [0, -1], times 0.5 / 2
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.25]]))
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        policy_loss(cfg, lp, old, old, torch.zeros(1, 2), torch.ones(1, 2), ref_logprobs=ref)


AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("agg, expected, entropy", [
    # trajectory A: rows 0 and 1, advantages 1, 2 | 3 (T = 3, sum 6); B: row 2, advantages 1 x 4 (T = 4, sum 4)
    ("token-mean", -10 / 7, 1.0),  # (6 + 4) / 7 tokens; entropy 1 on every token: its mean 1
    ("seq-mean-token-mean", -(6 / 3 + 4 / 4) / 2, 1.0),
    ("seq-mean-token-sum", -(6 + 4) / 2, 7 / 2),
    ("seq-mean-token-sum-norm", -(6 + 4) / (2 * 8), 7 / 16),  # --data.max_new_tokens 8
])
def test_loss_aggregation_modes(agg, expected, entropy):
    cfg = rl(entropy_coef=0.1, loss_agg_mode=agg)
    cfg.data.max_new_tokens = 8
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([[1., 2, 0, 0], [3, 0, 0, 0], [1, 1, 1, 1]])
    seq_weights = mask / torch.tensor([[3.], [3], [4]])  # 1 / the action tokens of the row's trajectory
    weight = {"token-mean": torch.full((3, 1), 1 / 7), "seq-mean-token-mean": seq_weights / 2,
              "seq-mean-token-sum": torch.full((3, 1), 1 / 2), "seq-mean-token-sum-norm": torch.full((3, 1), 1 / 16)}
    old = torch.full((3, 4), -1.0)
    lp = old.clone().requires_grad_()
    ent = torch.ones(3, 4)
    total, metrics = 0.0, {}
    for rows in ([0, 2], [1]):  # trajectory A in both micro-batches: the shares sum to the update's loss
        loss, m = policy_loss(cfg, lp[rows], old[rows], old[rows], adv[rows], mask[rows], entropy=ent[rows],
                              global_num_tokens=7, seq_weights=seq_weights[rows], global_num_seqs=2)
        loss.backward()
        total += loss.item()
        metrics = {k: metrics.get(k, 0.0) + v.item() for k, v in m.items()}
    assert total == pytest.approx(expected - 0.1 * entropy, rel=1e-6)
    # ratio 1, unclipped: d(-r A)/d logprob = -A on each token, times its weight
    torch.testing.assert_close(lp.grad, torch.where(mask, -adv * weight[agg], 0))
    assert metrics["policy_loss"] == pytest.approx(-10 / 7, rel=1e-6)  # metrics stay token means
    assert metrics["entropy"] == pytest.approx(1.0)


def test_loss_aggregation_errors_name_the_flag():
    with pytest.raises(ValueError, match="seq-mean --actor.loss_agg_mode needs seq_weights and global_num_seqs"):
        run(rl(loss_agg_mode="seq-mean-token-sum"), torch.zeros(1, 2), torch.ones(1, 2))
    cfg = RLConfig()
    cfg.actor.loss_agg_mode = "seq-mean"
    with pytest.raises(ConfigError, match=r"^--actor.loss_agg_mode must be one of \('token-mean', .*got 'seq-mean'$"):
        check(cfg)


def test_value_loss_clipped():
    values = torch.tensor([[1.0, 2.0]], requires_grad=True)
    loss, m = value_loss(values, torch.tensor([[0.5, 0.5]]), torch.tensor([[1.0, 0.0]]), torch.ones(1, 2), clip=0.2)
    # t0: plain (1-1)^2 = 0, clipped V 0.5+0.2 = 0.7 -> 0.09 -> 0.045; t1: plain 4, clipped 0.49 -> 2; mean over 2
    assert loss.item() == pytest.approx((0.045 + 2) / 2)
    assert m["value_clip_ratio"].item() == 0.5


def test_registry_matches_config_literal():
    assert set(LOSSES) == set(typing.get_args(typing.get_type_hints(ActorConfig)["loss_mode"]))


@pytest.mark.parametrize("mode", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("level, is_mode", [("off", "mask"), ("token", "trunc"), ("token", "mask"), ("geo", "mask")])
def test_masked_huge_ratio_gives_exactly_zero_gradient(mode, level, is_mode):
    cfg = rl(mode)
    cfg.algo.advantage.is_correction_level, cfg.algo.advantage.is_correction_mode = level, is_mode
    nan, inf = float("nan"), float("inf")
    # token 2 is padding holding garbage. Token 1 is real, with policy ratio e^500 and IS ratio e^-599:
    # token+mask drops it, geo drops its row (geometric mean e^(-599/3)), off and token+trunc keep it.
    old = torch.tensor([[-1.0, -600.0, nan, -1.0]])
    lp = torch.tensor([[-1.0, -100.0, 1e30, -1.0]], requires_grad=True)
    rollout = torch.tensor([[-1.0, -1.0, -inf, -1.0]])
    adv = torch.tensor([[1.0, -1.0, inf, 1.0]])
    loss, metrics = policy_loss(cfg, lp, old, rollout, adv, torch.tensor([[1, 1, 0, 1]]))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 2].item() == 0.0
    if is_mode == "mask" and level != "off":
        assert lp.grad[0, 1].item() == 0.0
        assert metrics["is_filter_ratio"].item() == pytest.approx(1 / 3 if level == "token" else 1.0)
    # the untouched tokens 0 and 3 still learn (gspo: unless token 1's e^500 sits inside their sequence ratio)
    if (level, is_mode) == ("token", "mask") or (level in ("off", "token") and mode != "gspo"):
        assert lp.grad[0, 0].item() != 0 and lp.grad[0, 3].item() != 0


# ---- every aggregation: the gradient does not depend on the split -------------------------------------

@st.composite
def batches(draw):
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    floats = st.floats(-3, 0, allow_nan=False, width=32)
    def grid(elements):
        return torch.tensor(draw(st.lists(st.lists(elements, min_size=cols, max_size=cols), min_size=rows,
                                          max_size=rows)), dtype=torch.float64)
    mask = grid(st.sampled_from([0.0, 1.0]))
    mask[0, 0] = 1.0  # at least one action token in the step
    lp, old, rollout, adv = grid(floats), grid(floats), grid(floats), grid(st.floats(-2, 2, width=32))
    # the split: every row goes to one of up to 6 (rank, micro-batch) slots; summing the shares of all slots is
    # what gradient accumulation over micro-batches plus an all-reduce SUM over ranks computes
    slots = draw(st.lists(st.integers(0, 5), min_size=rows, max_size=rows))
    trajs = torch.tensor(draw(st.lists(st.integers(0, 2), min_size=rows, max_size=rows)))  # rows = segments
    mode = draw(st.sampled_from(sorted(LOSSES)))
    level_mode = draw(st.sampled_from([("off", "mask"), ("token", "trunc"), ("token", "mask"), ("token", "clip"),
                                       ("seq", "mask"), ("geo", "mask")]))
    return mask, lp, old, rollout, adv, slots, trajs, mode, level_mode


@pytest.mark.parametrize("agg", AGG_MODES)
@settings(max_examples=60, deadline=None)
@given(batch=batches())
def test_loss_is_split_invariant(agg, batch):
    mask, lp, old, rollout, adv, slots, trajs, mode, (level, is_mode) = batch
    cfg = rl(mode, entropy_coef=0.01, loss_agg_mode=agg)
    cfg.algo.advantage.is_correction_level, cfg.algo.advantage.is_correction_mode = level, is_mode
    cfg.algo.kl.coef = 0.1
    ref = old - 0.3
    tokens = torch.zeros(3, dtype=torch.float64).index_add_(0, trajs, mask.sum(1))  # per trajectory
    seq_weights = mask / tokens[trajs].clamp(min=1)[:, None]

    def grad_of(groups):
        leaf = lp.clone().requires_grad_()
        n = int(mask.sum())  # the step's action tokens, over every micro-batch and rank
        total = {}
        for rows in groups:
            loss, metrics = policy_loss(cfg, leaf[rows], old[rows], rollout[rows], adv[rows], mask[rows],
                                        entropy=-leaf[rows], ref_logprobs=ref[rows], global_num_tokens=n,
                                        seq_weights=seq_weights[rows], global_num_seqs=len(set(trajs.tolist())))
            loss.backward()
            for k, v in {"loss": loss, **metrics}.items():
                total[k] = total.get(k, 0.0) + v.item()
        return leaf.grad, total

    whole_grad, whole_metrics = grad_of([list(range(len(slots)))])
    split = [[r for r, s in enumerate(slots) if s == slot] for slot in sorted(set(slots))]
    split_grad, split_metrics = grad_of(split)
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-12, atol=1e-12)
    assert split_metrics == pytest.approx(whole_metrics, rel=1e-9, abs=1e-12)
