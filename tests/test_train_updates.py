"""Several optimizer updates per rollout batch (--train.batch_size, --train.max_epochs): the first
update's ratio is exactly 1, later ones move off it and get clipped, two mini-batches of 4 equal the
two AdamW steps the maths prescribes (and differ from one step on 8), N ranks equal 1 rank, and the
measured KL to the reference reaches the caller whatever --algo.kl.use_in is."""

from functools import partial

import pytest
import torch
from helpers.layouts import full
from helpers.updates import LENGTHS, LR, make_samples, rl_config, state, token_logprobs, worker

from instar.algo import policy_loss
from instar.config import RLConfig
from instar.runtime.batching import rl_loss
from instar.train.batch import StepInputs, plan_micro_batches
from instar.train.launch import run_ranks
from instar.train.model import load_model

ADV = [1.0, -1.0, 0.5, -0.5, 1.0, 1.0, -1.0, -0.5]


def advantages() -> list[torch.Tensor]:
    return [torch.full((n,), a) for n, a in zip(LENGTHS, ADV)]


class Recorder:
    """The loop's loss, recording per call the largest |logprob - old| on action tokens."""

    def __init__(self, cfg: RLConfig):
        self.loss, self.log_ratio = partial(rl_loss, cfg, 0.0), []

    def __call__(self, logprobs, entropy, x):
        diff = torch.where(x.action_mask, logprobs.detach() - x.old_logprobs, 0)
        self.log_ratio.append(diff.abs().max().item())
        return self.loss(logprobs, entropy, x)


@pytest.fixture(scope="module")
def samples(tiny_model_dir):
    return make_samples(tiny_model_dir)


def test_first_update_has_ratio_one_later_ones_are_clipped(tiny_model_dir, samples):
    updates = [[0, 1, 2, 3], [4, 5, 6, 7]]
    rec = Recorder(rl_config())
    w = worker(tiny_model_dir)
    stats = w.train_policy(samples, rec, StepInputs(advantages=advantages()), updates=updates)
    passes = len(plan_micro_batches([LENGTHS[i] for i in updates[0]], 32))  # the first update's forwards
    assert passes == 2
    assert rec.log_ratio[:passes] == [0.0] * passes  # exactly: the first update's own forward is "old"
    assert min(rec.log_ratio[passes:]) > 0.05  # the second update sees the policy after the first
    assert stats.metrics["actor/updates"] == 2
    # a mean over the 2 updates; the first clips nothing, so the second clipped > 0
    assert stats.metrics["actor/policy_clip_ratio"] > 0
    clipped = state(w)
    w2 = worker(tiny_model_dir, eps_clip_low_high=(0.999, 1e6))  # no clipping in practice
    stats2 = w2.train_policy(samples, partial(rl_loss, rl_config(eps_clip_low_high=(0.999, 1e6)), 0.0),
                             StepInputs(advantages=advantages()), updates=updates)
    assert stats2.metrics["actor/policy_clip_ratio"] == 0
    assert max((clipped[k] - v).abs().max().item() for k, v in state(w2).items()) > 1e-3


def reference_updates(model_dir, samples, updates) -> dict[str, torch.Tensor]:
    """The maths, written out: old = the initial policy; each update is one AdamW step (after global-norm
    clipping to 1.0) on the token-mean PPO loss over its own mini-batch, one unpacked forward per sample."""
    cfg = rl_config()
    model = load_model(str(model_dir))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    with torch.no_grad():
        old = [token_logprobs(model, s.token_ids) for s in samples]

    def pad(ts):
        return torch.nn.utils.rnn.pad_sequence(ts, batch_first=True)
    for update in updates:
        opt.zero_grad()
        lp = pad([token_logprobs(model, samples[i].token_ids) for i in update])
        loss, _ = policy_loss(cfg, lp, pad([old[i] for i in update]),
                              pad([torch.tensor(samples[i].rollout_logprobs) for i in update]),
                              pad([advantages()[i] for i in update]),
                              pad([torch.tensor(samples[i].action_mask, dtype=torch.bool) for i in update]))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def assert_same_weights(a: dict, b: dict) -> None:
    for k in a:
        diff = (a[k] - b[k]).abs()
        # Adam turns float noise in near-zero gradients into ~lr-sized steps on a handful of entries
        assert diff.max() < 5 * LR, k
        assert (diff > 1e-5).float().mean() < 2e-3, k


def test_two_mini_batches_of_four_are_two_steps_not_one_on_eight(tiny_model_dir, samples):
    two = [[0, 1, 2, 3], [4, 5, 6, 7]]
    w = worker(tiny_model_dir)
    w.train_policy(samples, partial(rl_loss, rl_config(), 0.0), StepInputs(advantages=advantages()), updates=two)
    got = state(w)
    assert_same_weights(got, reference_updates(tiny_model_dir, samples, two))
    one = reference_updates(tiny_model_dir, samples, [list(range(8))])
    assert max((got[k] - v).abs().max().item() for k, v in one.items()) > 1e-2


def _two_rank_job(rank, world, port, model_dir, samples, updates):
    w = worker(model_dir, rank, world, port)
    stats = w.train_policy(samples, partial(rl_loss, rl_config(), 0.0), StepInputs(advantages=advantages()),
                           updates=updates)
    out = {"metrics": stats.metrics, "state": {k: full(v) for k, v in w.policy.state_dict().items()}}
    w.shutdown()
    return out


@pytest.mark.slow
def test_two_ranks_equal_one_rank_over_two_epochs_of_two_mini_batches(tiny_model_dir, samples):
    updates = [[0, 1, 2, 3], [4, 5, 6, 7], [1, 3, 5, 7], [0, 2, 4, 6]]  # 2 epochs, reshuffled
    two = run_ranks(_two_rank_job, 2, tiny_model_dir, samples, updates)
    w = worker(tiny_model_dir)
    one = w.train_policy(samples, partial(rl_loss, rl_config(), 0.0), StepInputs(advantages=advantages()),
                         updates=updates)
    for k in ("actor/loss", "actor/grad_norm", "actor/policy_clip_ratio", "actor/vllm_kl"):
        assert two[0]["metrics"][k] == pytest.approx(one.metrics[k], rel=1e-4, abs=1e-6), k
    assert two[0]["metrics"]["actor/updates"] == 4
    assert_same_weights(state(w), two[0]["state"])


@pytest.mark.parametrize("use_in", ["loss", "reward"])
def test_measured_kl_to_the_reference_reaches_the_caller(tiny_model_dir, samples, use_in):
    cfg = rl_config()
    cfg.algo.kl.coef, cfg.algo.kl.use_in = 0.1, use_in
    w = worker(tiny_model_dir, ref=True)
    adv = advantages()
    ref = w.compute_logprobs(samples, model="ref")
    first = w.train_policy(samples, partial(rl_loss, cfg, 0.1), StepInputs(advantages=adv, ref_logprobs=ref))
    assert first.ref_kl == 0.0  # policy == reference before the first update
    ref = w.compute_logprobs(samples, model="ref")
    policy = w.compute_logprobs(samples)
    stats = w.train_policy(samples, partial(rl_loss, cfg, 0.1), StepInputs(advantages=adv, ref_logprobs=ref))
    mask = [torch.tensor(s.action_mask, dtype=torch.bool) for s in samples]
    log_r = torch.cat([(r - p)[m] for r, p, m in zip(ref, policy, mask)])
    expected = (torch.expm1(log_r) - log_r).mean().item()  # k3, the default estimator
    assert expected > 1e-4 and stats.ref_kl == pytest.approx(expected, rel=1e-3)
