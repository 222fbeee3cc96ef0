"""Several optimizer updates per rollout batch (--train.batch_size, --train.max_epochs): the first
update's ratio is exactly 1, later ones move off it and get clipped, two mini-batches of 4 equal the
two AdamW steps the maths prescribes (and differ from one step on 8), each --actor.loss_agg_mode
aggregates each update over its own trajectories, N ranks equal 1 rank, and the measured KL to the
reference reaches the caller whatever --algo.kl.use_in is."""

from dataclasses import replace
from functools import partial

import pytest
import torch
from helpers.layouts import full
from helpers.updates import LENGTHS, LR, make_samples, rl_config, state, token_logprobs, worker

from instar.algo import policy_loss
from instar.config import RLConfig
from instar.contract import Trajectory
from instar.runtime.batching import Rows, rl_loss, seq_weights
from instar.train.batch import StepInputs, plan_micro_batches
from instar.train.launch import run_ranks
from instar.train.model import load_model

ADV = [1.0, -1.0, 0.5, -0.5, 1.0, 1.0, -1.0, -0.5]
TRAJS = [0, 0, 1, 2, 3, 3, 4, 5]  # each sample's trajectory: samples 0-1 and 4-5 are two segments of one
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def advantages() -> list[torch.Tensor]:
    return [torch.full((n,), a) for n, a in zip(LENGTHS, ADV)]


def step_inputs(cfg: RLConfig, samples, adv=None) -> StepInputs:
    """What the loop gives the trainer: the advantages, and what the loss aggregation needs of the trajectories."""
    trajs = [Trajectory([s for s, t in zip(samples, TRAJS) if t == k], reward=0.0) for k in range(max(TRAJS) + 1)]
    rows = Rows(samples, torch.zeros(8), torch.zeros(8, dtype=torch.long), torch.tensor(TRAJS), trajs)
    return StepInputs(advantages=adv or advantages(), seq_weights=seq_weights(cfg, rows))


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


def reference_updates(model_dir, samples, updates, cfg=None, adv=None) -> tuple[dict[str, torch.Tensor], list]:
    """The maths, written out: old = the initial policy; each update is one AdamW step (after global-norm
    clipping to 1.0) on the PPO loss over its own mini-batch, one unpacked forward per sample. Returns the
    weights and each update's (loss, gradient norm, clipped gradients)."""
    cfg = cfg or rl_config()
    inputs = step_inputs(cfg, samples, adv)
    model = load_model(str(model_dir))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    with torch.no_grad():
        old = [token_logprobs(model, s.token_ids) for s in samples]

    def pad(ts):
        return torch.nn.utils.rnn.pad_sequence(ts, batch_first=True)
    figures = []
    for update in updates:
        opt.zero_grad()
        lp = pad([token_logprobs(model, samples[i].token_ids) for i in update])
        weights = inputs.seq_weights and pad([inputs.seq_weights[i] for i in update])
        loss, _ = policy_loss(cfg, lp, pad([old[i] for i in update]),
                              pad([torch.tensor(samples[i].rollout_logprobs) for i in update]),
                              pad([inputs.advantages[i] for i in update]),
                              pad([torch.tensor(samples[i].action_mask, dtype=torch.bool) for i in update]),
                              seq_weights=weights, global_num_seqs=len({TRAJS[i] for i in update}))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        figures.append((loss.item(), norm, {k: p.grad.clone() for k, p in model.named_parameters()}))
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, figures


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
    assert_same_weights(got, reference_updates(tiny_model_dir, samples, two)[0])
    one = reference_updates(tiny_model_dir, samples, [list(range(8))])[0]
    assert max((got[k] - v).abs().max().item() for k, v in one.items()) > 1e-2


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("left_out", [False, True])
def test_each_update_aggregates_over_its_own_trajectories(tiny_model_dir, samples, agg, left_out):
    """Packed micro-batches of at most 32 tokens, a trajectory's two rows in different micro-batches, and a
    trajectory (sample 2) with no gradient run forward only or left out (--train.forward_only_rows false): the
    update's gradient is the maths' on its whole mini-batch (half the batch), whose trajectories all count."""
    cfg = rl_config(loss_agg_mode=agg)
    cfg.data.max_new_tokens = 5
    adv = advantages()
    adv[2] = torch.zeros_like(adv[2])
    updates = [[0, 1, 2, 3]]
    w = worker(tiny_model_dir)
    w.train = replace(w.train, forward_only_rows=not left_out)
    grads, step = [], w.optimizer.step

    def recorded(*args, **kwargs):
        grads.append({k: full(p.grad).clone() for k, p in w.policy.named_parameters()})
        return step(*args, **kwargs)
    w.optimizer.step = recorded
    stats = w.train_policy(samples, partial(rl_loss, cfg, 0.0), step_inputs(cfg, samples, adv), updates=updates,
                           forward_only=[2])
    [(loss, norm, expected)] = reference_updates(tiny_model_dir, samples, updates, cfg, adv)[1]
    for k, g in expected.items():  # clipped to norm 1: the direction
        torch.testing.assert_close(grads[0][k], g, rtol=1e-4, atol=1e-6, msg=k)
    assert stats.metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)  # the scale
    if not left_out:  # (else the metrics are means over the rows that ran)
        assert stats.metrics["actor/loss"] == pytest.approx(loss, rel=1e-4)


def smooth_worker(model_dir, rank=0, world=1, port=None):
    """AdamW divides each gradient by its own size: where one is near eps (1e-8), float rounding (ranks sum
    in another order) would move its weight by a sizeable part of the learning rate."""
    w = worker(model_dir, rank, world, port)
    w.optimizer.param_groups[0]["eps"] = 1e-4
    return w


def _two_rank_job(rank, world, port, model_dir, samples, updates, cfg):
    w = smooth_worker(model_dir, rank, world, port)
    stats = w.train_policy(samples, partial(rl_loss, cfg, 0.0), step_inputs(cfg, samples), updates=updates)
    out = {"metrics": stats.metrics, "state": {k: full(v) for k, v in w.policy.state_dict().items()}}
    w.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_two_ranks_equal_one_rank_over_two_epochs_of_two_mini_batches(tiny_model_dir, samples, agg):
    cfg = rl_config(loss_agg_mode=agg)
    updates = [[0, 1, 2, 3], [4, 5, 6, 7], [2, 3, 4, 5], [0, 1, 6, 7]]  # 2 epochs, reshuffled trajectories
    two = run_ranks(_two_rank_job, 2, tiny_model_dir, samples, updates, cfg)
    w = smooth_worker(tiny_model_dir)
    one = w.train_policy(samples, partial(rl_loss, cfg, 0.0), step_inputs(cfg, samples), updates=updates)
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
