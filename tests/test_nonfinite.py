"""Bad steps: an update whose gradient norm is not finite is skipped and counted (`actor/skipped_nonfinite`)."""

from functools import partial

import torch
from helpers.updates import LENGTHS, make_samples, rl_config, state, worker

from instar.runtime.batching import rl_loss
from instar.train.batch import StepInputs

ADV = [1.0, -1.0, 0.5, -0.5, 1.0, 1.0, -1.0, -0.5]


def test_an_update_with_a_nan_gradient_is_skipped_and_counted(tiny_model_dir):
    samples = make_samples(tiny_model_dir)
    adv = [torch.full((n,), a) for n, a in zip(LENGTHS, ADV)]
    loss = partial(rl_loss, rl_config(), 0.0)
    clean = worker(tiny_model_dir)  # the second mini-batch alone: what the bad run must end with
    initial = state(clean)
    clean.train_policy(samples, loss, StepInputs(advantages=adv), updates=[[4, 5, 6, 7]])
    bad = worker(tiny_model_dir)
    nan_adv = [torch.full_like(a, float("nan")) if i == 0 else a for i, a in enumerate(adv)]
    stats = bad.train_policy(samples, loss, StepInputs(advantages=nan_adv), updates=[[0, 1, 2, 3], [4, 5, 6, 7]])
    assert stats.metrics["actor/skipped_nonfinite"] == 1.0 and stats.metrics["actor/updates"] == 2.0
    got, want = state(bad), state(clean)
    for k, v in got.items():
        assert torch.isfinite(v).all(), k
        # the first update left no trace (weights, Adam moments and step count): the second is AdamW's first step
        assert torch.allclose(v, want[k], atol=1e-6), k
    assert max((got[k] - v).abs().max().item() for k, v in initial.items()) > 1e-3  # the second update was applied


STEPS, BATCH, PROMPTS = 4, 2, 3  # few prompts: every step crosses an epoch, a lost prompt leaves a hole
