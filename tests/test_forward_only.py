"""Samples whose loss has no gradient (zero advantage, no entropy or KL term) run forward only: the
update, its metrics and the old logprobs of later mini-batches are what a backward through them gives;
an update with nothing to backpropagate still steps the optimizer on a zero gradient; N ranks = 1 rank
when a rank holds only forward-only samples. Left out instead (--train.forward_only_rows false), they leave
the updates as they were too, and the metrics cover the trained rows."""

from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.distributed as dist
from helpers.updates import LENGTHS, make_samples, rl_config, state, worker

from instar.config import RLConfig
from instar.contract import Sample
from instar.runtime.batching import forward_only, rl_loss
from instar.train.batch import StepInputs
from instar.train.launch import run_ranks

ADV = [1.0, 0.0, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0]  # sample 1 idle in update 1; all of update 2 idle
UPDATES = [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]  # update 3 compares against old logprobs of update 1
IDLE = [1, 4, 5, 6, 7]
METRICS = ("actor/loss", "actor/grad_norm", "actor/vllm_kl", "actor/policy_kl", "actor/entropy",
           "actor/policy_clip_ratio")


@pytest.fixture(scope="module")
def samples(tiny_model_dir):
    return make_samples(tiny_model_dir)


@pytest.fixture(autouse=True)
def no_process_group_left():
    """The in-process workers share one default process group: gone after each test, for the next
    test files that start their own."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def advantages() -> list[torch.Tensor]:
    return [torch.full((n,), a) for n, a in zip(LENGTHS, ADV)]


class Passes:
    """The loop's loss, recording whether each pass can backpropagate and the samples it held."""

    def __init__(self):
        self.loss, self.calls = partial(rl_loss, rl_config(), 0.0), []

    def __call__(self, logprobs, entropy, x):
        self.calls.append((logprobs.requires_grad, x.advantages.abs().sum().item()))
        return self.loss(logprobs, entropy, x)


def smooth_worker(model_dir, rank=0, world=1, port=None):
    """AdamW divides each gradient by its own size: where one is near eps (1e-8), float rounding (a
    packed micro-batch holds other rows) would move its weight by a sizeable part of the learning rate."""
    w = worker(model_dir, rank, world, port)
    w.optimizer.param_groups[0]["eps"] = 1e-4
    return w


def train(model_dir, samples, idle, loss=None, updates=UPDATES, run_idle=True, runs=None):
    """A worker after ``updates``, its metrics, and the gradient each optimizer step was given; ``run_idle``:
    --train.forward_only_rows; ``runs`` collects the samples of each update's passes."""
    w, grads = smooth_worker(model_dir), []
    w.train = replace(w.train, forward_only_rows=run_idle)
    step, passes = w.optimizer.step, w._micro_batches

    def recorded_passes(batch, inputs=None, indices=None, forward_only=()):
        if indices is not None:  # an update's passes (a logprob pass names none)
            runs.append(sorted(indices))
        return passes(batch, inputs, indices, forward_only)
    if runs is not None:
        w._micro_batches = recorded_passes

    def recorded(*args, **kwargs):
        grads.append({n: p.grad.detach().clone() for n, p in w.policy.named_parameters()})
        return step(*args, **kwargs)
    w.optimizer.step = recorded
    stats = w.train_policy(samples, loss or partial(rl_loss, rl_config(), 0.0), StepInputs(advantages=advantages()),
                           updates=updates, forward_only=idle)
    return w, stats.metrics, grads


def test_forward_only_samples_leave_the_updates_and_metrics_as_they_were(tiny_model_dir, samples):
    w_all, all_metrics, all_grads = train(tiny_model_dir, samples, None)
    passes = Passes()
    w_fwd, fwd_metrics, fwd_grads = train(tiny_model_dir, samples, IDLE, passes)
    for u in (0, 2):  # the same gradients but for float summation order (~1e-7 apart on some CPUs' kernels)
        for k, g in all_grads[u].items():
            torch.testing.assert_close(fwd_grads[u][k], g, rtol=1e-5, atol=1e-6, msg=f"update {u + 1}: {k}")
    assert all(not g.any() for g in fwd_grads[1].values())  # update 2: nothing to backpropagate
    for k in METRICS:
        assert fwd_metrics[k] == pytest.approx(all_metrics[k], rel=1e-5, abs=1e-7), k
    for k, v in state(w_all).items():
        torch.testing.assert_close(state(w_fwd)[k], v, rtol=1e-5, atol=1e-5, msg=k)
    # the second update had a zero gradient and still moved the weights (AdamW's momentum)
    assert any((state(w_fwd)[k] - v).abs().max() > 1e-4 for k, v in state(worker(tiny_model_dir)).items())
    with_grad = [adv for grad, adv in passes.calls if grad]
    assert with_grad and all(adv > 0 for adv in with_grad)  # no backward carried an idle sample
    assert sum(not grad for grad, _ in passes.calls) >= 3  # idle ones of updates 1 and 3, and update 2


def test_rows_left_out_give_the_same_updates_and_metrics_over_the_trained_rows(tiny_model_dir, samples):
    """--train.forward_only_rows false: an update's forward-only rows do not run (update 2, idle only, still
    runs its rows); the weights are those of the run that ran them, and the metrics are means over the
    trained rows' tokens: what a run given only those rows logs."""
    w_fwd, _, fwd_grads = train(tiny_model_dir, samples, IDLE)
    runs = []
    w_skip, _, skip_grads = train(tiny_model_dir, samples, IDLE, run_idle=False, runs=runs)
    assert runs == [[0, 2, 3], [4, 5, 6, 7], [0, 2, 3]]
    for u in range(3):
        for k, g in fwd_grads[u].items():
            torch.testing.assert_close(skip_grads[u][k], g, rtol=1e-5, atol=1e-6, msg=f"update {u + 1}: {k}")
    for k, v in state(w_fwd).items():
        torch.testing.assert_close(state(w_skip)[k], v, rtol=1e-5, atol=1e-5, msg=k)
    _, skipped, _ = train(tiny_model_dir, samples, IDLE, updates=[[0, 1, 2, 3]], run_idle=False)
    _, trained_only, _ = train(tiny_model_dir, samples, IDLE, updates=[[0, 2, 3]])
    for k in (*METRICS[:1], *METRICS[2:]):  # the gradient's norm is over every action token
        assert skipped[k] == pytest.approx(trained_only[k], rel=1e-5, abs=1e-7), k
    _, all_rows, _ = train(tiny_model_dir, samples, IDLE, updates=[[0, 1, 2, 3]])
    tokens = [s.num_actions for s in samples[:4]]  # the loss: the same sum over fewer tokens
    assert skipped["actor/loss"] == pytest.approx(all_rows["actor/loss"] * sum(tokens) / (sum(tokens) - tokens[1]))
    assert abs(skipped["actor/loss"]) > 1e-4


def _two_rank_job(rank, world, port, model_dir, samples):
    w = smooth_worker(model_dir, rank, world, port)
    stats = w.train_policy(samples, partial(rl_loss, rl_config(), 0.0), StepInputs(advantages=advantages()),
                           updates=UPDATES, forward_only=IDLE)
    out = {"metrics": stats.metrics, "state": state(w), "share": w._share(samples, UPDATES[0], IDLE)}
    w.shutdown()
    return out


def test_two_ranks_equal_one_rank_when_a_rank_has_only_forward_only_samples(tiny_model_dir, samples):
    two = run_ranks(_two_rank_job, 2, tiny_model_dir, samples)  # update 2: both ranks idle only
    # update 1 dealt by work, a backward counting three forwards: 14 + 3 x 11 and 3 x (9 + 6) tokens' worth
    # (by tokens alone rank 0 would hold samples 1 and 2: work 32 against 60)
    assert [two[0]["share"], two[1]["share"]] == [[1, 3], [0, 2]]
    w, one, _ = train(tiny_model_dir, samples, IDLE)
    for k in METRICS:
        assert two[0]["metrics"][k] == pytest.approx(one[k], rel=1e-4, abs=1e-6), k
    for k, v in state(w).items():
        torch.testing.assert_close(two[0]["state"][k], v, rtol=1e-5, atol=1e-5, msg=k)


def test_forward_only_rows_are_those_with_no_advantage_and_no_other_loss_term():
    samples = [Sample([5, 6, 7, 8], [0, 1, 1, 1], [0.0] * 4, [-1, 0, 0, 0]) for _ in range(3)]
    adv = [torch.tensor([0.0, 0.5, 0.5, 0.5]), torch.tensor([0.0, 0.0, 0.0, 0.0]),
           torch.tensor([0.7, 0.0, 0.0, 0.0])]  # row 2: advantage only off the action tokens
    assert forward_only(RLConfig(), samples, adv, 0.0) == [1, 2]
    entropy = RLConfig()
    entropy.actor.entropy_coef = 0.01
    assert forward_only(entropy, samples, adv, 0.0) == []
    kl = RLConfig()
    kl.algo.kl.use_in = "loss"
    assert forward_only(kl, samples, adv, 0.1) == []
    assert forward_only(kl, samples, adv, 0.0) == [1, 2]
    kl.algo.kl.use_in = "reward"  # a KL in the reward is in the advantages already
    assert forward_only(kl, samples, adv, 0.1) == [1, 2]
