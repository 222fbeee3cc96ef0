"""Importance-sampling correction: the named schemes pinned on one crafted batch where each differs."""

import math

import pytest
import torch

from instar.algo import check_is_correction, is_weights, policy_loss
from instar.checks import check
from instar.config import AdvantageConfig, ConfigError, RLConfig

# ratio = exp(old - rollout) per token, band [0.5, 2]. Column 3 is padding holding a huge ratio.
#   row A: [1, 1, 3]     product 3 (out)   geometric mean 3^(1/3) = 1.44 (in)
#   row C: [3, 3, 1]     product 9 (out)   geometric mean 9^(1/3) = 2.08 (out)
#   row E: [0.25, 4, 1]  product 1 (in)    geometric mean 1 (in)
RATIOS = [[1, 1, 3], [3, 3, 1], [0.25, 4, 1]]
ROLLOUT = torch.full((3, 4), -2.0)
OLD = torch.cat([ROLLOUT[:, :3] + torch.tensor(RATIOS).log(), torch.full((3, 1), 500.0)], dim=1)
MASK = torch.tensor([[1, 1, 1, 0]] * 3)

# Weights on the 9 action tokens (padding is always 0): no two rows are alike, so no flag silently means another.
EXPECTED = {
    ("off", "mask"): [[1, 1, 1], [1, 1, 1], [1, 1, 1]],
    ("token", "trunc"): [[1, 1, 2], [2, 2, 1], [0.25, 2, 1]],  # TIS: min(ratio, 2)
    ("token", "clip"): [[1, 1, 2], [2, 2, 1], [0.5, 2, 1]],  # clamp(ratio, 0.5, 2)
    ("token", "mask"): [[1, 1, 0], [0, 0, 1], [0, 0, 1]],  # IcePop: ratio inside the band, else dropped
    ("geo", "mask"): [[1, 1, 2], [0, 0, 0], [0.25, 2, 1]],  # row C out; survivors keep min(ratio, 2)
    ("seq", "mask"): [[0, 0, 0], [0, 0, 0], [0.25, 2, 1]],  # rows A and C out
}


def adv_cfg(level: str, mode: str) -> AdvantageConfig:
    return AdvantageConfig(is_correction_level=level, is_correction_mode=mode, is_correction_threshold=(0.5, 2.0))


@pytest.mark.parametrize("level, mode", list(EXPECTED))
def test_named_schemes(level, mode):
    weight, keep = is_weights(adv_cfg(level, mode), OLD, ROLLOUT, MASK)
    expected = torch.tensor([row + [0] for row in EXPECTED[level, mode]], dtype=torch.float32)
    torch.testing.assert_close(weight, expected)
    if mode == "mask" and level != "off":  # only masking drops tokens; trunc and clip keep a small weight
        assert torch.equal(keep, expected > 0)
    else:
        assert torch.equal(keep, MASK.bool())


def test_metrics_through_policy_loss():
    cfg = RLConfig()
    cfg.algo.advantage = adv_cfg("token", "mask")
    lp = OLD.clone().requires_grad_()  # policy ratio 1: the surrogate of a token is -weight * A
    loss, m = policy_loss(cfg, lp, OLD, ROLLOUT, torch.ones(3, 4), MASK)
    # IcePop keeps 4 of 9 tokens, each with weight 1 -> loss -4/9; dropped 5/9
    assert loss.item() == pytest.approx(-4 / 9)
    assert m["is_filter_ratio"].item() == pytest.approx(5 / 9)
    # vllm_kl = mean(rollout - old) = -mean(log ratio) = -(log 3 + 2 log 3 + 0) / 9
    assert m["vllm_kl"].item() == pytest.approx(-math.log(3) / 3, rel=1e-6)
    assert m["policy_kl"].item() == 0 and m["policy_clip_ratio"].item() == 0


def test_invalid_combinations_name_the_fix():
    with pytest.raises(ValueError, match="needs --algo.advantage.is_correction_mode mask"):
        is_weights(adv_cfg("geo", "trunc"), OLD, ROLLOUT, MASK)
    with pytest.raises(ValueError, match="0 <= low < 1 < high"):
        check_is_correction(AdvantageConfig(is_correction_threshold=(1.2, 2.0)))
    cfg = RLConfig()
    cfg.algo.advantage.is_correction_level, cfg.algo.advantage.is_correction_mode = "seq", "clip"
    with pytest.raises(ConfigError, match="is_correction_mode mask"):
        check(cfg)


@pytest.mark.parametrize("change, message", [
    (lambda c: setattr(c.algo.kl, "use_in", "reward") or setattr(c.algo.kl, "coef", 0.1), "--algo.kl.use_in loss"),
    (lambda c: setattr(c.actor, "loss_mode", "cispo") or setattr(c.actor, "dual_clip", 3.0), "unset --actor.dual_clip"),
    (lambda c: setattr(c.actor, "eps_clip_low_high", (1.0, 0.2)), "eps_clip_low_high"),
    (lambda c: setattr(c.algo.advantage, "gamma", 0.0), "gamma must be in"),
    (lambda c: setattr(c.algo.kl, "target", 0.05), "set --algo.kl.coef > 0"),
])
def test_config_check_rejects_algo_combinations(change, message):
    cfg = RLConfig()
    check(cfg)  # the defaults are valid
    change(cfg)
    with pytest.raises(ConfigError, match=message):
        check(cfg)
