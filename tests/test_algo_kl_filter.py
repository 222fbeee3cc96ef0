"""KL estimators, the adaptive KL controller and its checkpoint state, the DAPO dynamic filter."""

import math
import typing

import pytest
import torch

from instar.algo import KL_ESTIMATORS, KLController, dynamic_filter, kl_penalty
from instar.config import KLConfig

LP = torch.tensor([-1.0, -1.0])
REF = torch.tensor([-1.0, -1.0 + math.log(2)])  # log r = ref - lp = [0, log 2]


@pytest.mark.parametrize("name, expected", [
    ("k1", [0, -math.log(2)]),  # -log r
    ("k2", [0, 0.5 * math.log(2) ** 2]),  # (log r)^2 / 2
    ("k3", [0, 1 - math.log(2)]),  # (r - 1) - log r with r = 2
])
def test_kl_estimators(name, expected):
    torch.testing.assert_close(kl_penalty(LP, REF, name), torch.tensor(expected))


def test_kl_registry_matches_config_literal():
    assert set(KL_ESTIMATORS) == set(typing.get_args(typing.get_type_hints(KLConfig)["estimator"]))


def test_fixed_coefficient_never_moves():
    ctl = KLController.from_config(KLConfig(coef=0.1))
    assert ctl.update(current_kl=5.0, n_samples=1000) == 0.1


def test_adaptive_controller_and_resume():
    ctl = KLController.from_config(KLConfig(coef=0.1, target=0.05, horizon=100))
    # kl 0.1: error clip(0.1/0.05 - 1, +-0.2) = 0.2 -> 0.1 * (1 + 0.2 * 10/100) = 0.102
    assert ctl.update(0.1, 10) == pytest.approx(0.102)
    state = ctl.state_dict()
    resumed = KLController.from_config(KLConfig(coef=0.1, target=0.05, horizon=100))
    resumed.load_state_dict(state)
    # kl 0.045: error -0.1 -> 0.102 * (1 - 0.1 * 50/100) = 0.0969, identically in both
    assert ctl.update(0.045, 50) == pytest.approx(0.0969)
    assert resumed.update(0.045, 50) == ctl.value


def test_dynamic_filter_keeps_groups_strictly_inside():
    scores = torch.tensor([1., 1, 0, 1, 0, 0, 1, 0])
    groups = torch.tensor([7, 7, 3, 3, 5, 5, 9, 9])  # means: 7 -> 1, 3 -> 0.5, 5 -> 0, 9 -> 0.5
    keep, pass_rate = dynamic_filter(scores, groups, (0.0, 1.0))
    assert keep.tolist() == [False, False, True, True, False, False, True, True]
    assert pass_rate == 0.5
    with pytest.raises(ValueError, match="low < high"):
        dynamic_filter(scores, groups, (1.0, 0.0))
