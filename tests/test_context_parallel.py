"""Context parallelism over gloo equals one rank: cp=2 splits every packed row over two ranks (Ulysses
all-to-all around attention) and gives the same logprobs, losses, grad norms, entropies, critic values
and weights as a single rank after 3 steps, with a sequence-level loss (GSPO) whose ratios are not 1;
also with tp=2 and activation checkpointing, and with replayed expert routes (each rank replays its
chunk's). Layouts that cannot split are refused naming the fix."""

from functools import partial

import pytest
import torch
from helpers.layouts import TOL, advantages, full_state, make_sample, rl_config

from instar.config import ActorConfig, CriticConfig, FSDPConfig, TrainConfig
from instar.contract import Sample
from instar.data.tiny_model import TinySpec, build_tiny_model
from instar.runtime.batching import critic_loss, rl_loss
from instar.train.batch import StepInputs, plan_micro_batches
from instar.train.context_parallel import ULYSSES, apply_context_parallel
from instar.train.launch import reserve_port, run_ranks
from instar.train.worker import TrainWorker

LENGTHS = [7, 12, 5, 9, 3, 10, 4, 9]
MAX_TOKENS = 24  # rows of 22, 23 and 14 tokens
RL = rl_config()
RL.actor.loss_mode, RL.actor.entropy_coef = "gspo", 0.01  # sequence ratios need whole sequences; entropy a gradient
SAMPLES = [make_sample(n, i) for i, n in enumerate(LENGTHS)]
ADVANTAGES = advantages(LENGTHS)
RETURNS = [torch.linspace(-1, 1, n) for n in LENGTHS]
UPDATES = [[0, 1, 2, 3], [4, 5, 6, 7]]  # the second update's ratios compare against the policy before the first


def _job(rank, world, port, model_dir, cp, tp, recompute=False):
    w = TrainWorker(ActorConfig(model_name_or_path=str(model_dir), learning_rate=1e-3, lr_warmup_steps=1),
                    FSDPConfig(num_ranks=world, cp_size=cp, tp_size=tp, activation_checkpointing=recompute),
                    TrainConfig(max_tokens_per_gpu=MAX_TOKENS, max_steps=10), critic=CriticConfig(learning_rate=1e-2))
    w.init(rank, world, "127.0.0.1", port)
    out = {"initial": w.compute_logprobs(SAMPLES), "actor": [
        w.train_policy(SAMPLES, partial(rl_loss, RL, 0.0), StepInputs(advantages=ADVANTAGES), updates=UPDATES).metrics
        for _ in range(3)]}
    out["logprobs"] = w.compute_logprobs(SAMPLES)
    out["state"] = full_state(w)
    out["critic"] = [w.train_critic(SAMPLES, partial(critic_loss, RL), StepInputs(
        old_values=w.compute_values(SAMPLES), returns=RETURNS)).metrics for _ in range(2)]
    out["values"] = w.compute_values(SAMPLES)
    out["attention"] = w.policy.config._attn_implementation
    w.shutdown()
    return out


@pytest.fixture(scope="module")
def model_dir(tiny_heads4_dir):
    return tiny_heads4_dir


@pytest.fixture(scope="module")
def one_rank(model_dir):
    return _job(0, 1, reserve_port(), model_dir, 1, 1)


def test_rows_split_unevenly_and_through_sequences():
    """The rows cp=2 sees: one of odd length (padded), two with a sequence across the chunk boundary,
    one with a sequence starting at it."""
    rows = [[LENGTHS[i] for i in row] for row in plan_micro_batches(LENGTHS, MAX_TOKENS)]
    assert [sum(r) for r in rows] == [22, 23, 14]
    crossing = [[a < -(-sum(r) // 2) < b for a, b in zip(torch.tensor([0] + r).cumsum(0), torch.tensor(r).cumsum(0))]
                for r in rows]
    assert [any(c) for c in crossing] == [True, True, False]


@pytest.mark.parametrize("world, tp, recompute", [(2, 1, False), pytest.param(4, 2, True, marks=pytest.mark.slow)],
                         ids=["cp2", "cp2xtp2_recompute"])
def test_context_parallel_equals_one_rank(model_dir, one_rank, world, tp, recompute):
    """``recompute``: activation checkpointing, whose backward runs each layer's all-to-alls again."""
    results = run_ranks(_job, world, model_dir, 2, tp, recompute, timeout=600)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(one_rank["logprobs"], one_rank["initial"]))
    assert any(v.abs().max() > 1e-3 for v in one_rank["values"])  # the critic moved off its zero init
    for r in results:  # every rank holds whole sequences and the same metrics
        assert r["attention"] == ULYSSES
        for key in ("initial", "logprobs", "values"):
            for got, want in zip(r[key], one_rank[key], strict=True):
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, **TOL)
        for kind, keys in (("actor", ("loss", "grad_norm", "entropy", "policy_clip_ratio")),
                           ("critic", ("loss", "grad_norm"))):
            for m, ref in zip(r[kind], one_rank[kind], strict=True):
                for k in keys:
                    assert m[f"{kind}/{k}"] == pytest.approx(ref[f"{kind}/{k}"], rel=1e-4, abs=1e-6), (kind, k)
    assert results[0]["state"].keys() == one_rank["state"].keys()
    for k, v in one_rank["state"].items():  # the full state dict is gathered on rank 0
        torch.testing.assert_close(results[0]["state"][k], v, **TOL, msg=k)


def _replay_job(rank, world, port, model_dir, cp, routes):
    w = TrainWorker(ActorConfig(model_name_or_path=str(model_dir)), FSDPConfig(num_ranks=world, cp_size=cp),
                    TrainConfig(max_tokens_per_gpu=MAX_TOKENS, routing_replay=True))
    w.init(rank, world, "127.0.0.1", port)
    out = w.compute_logprobs([Sample(**{**s.__dict__, "routed_experts": r}) for s, r in zip(SAMPLES, routes)])
    w.shutdown()
    return out


def test_replayed_routes_follow_their_tokens_to_the_chunk(tmp_path):
    model_dir = build_tiny_model(tmp_path, TinySpec(moe=True, heads=4, kv_heads=2))  # 2 layers of 4 experts, top-2
    g = torch.Generator().manual_seed(0)
    routes = [(torch.randint(0, 4, (n, 2, 1), generator=g) + torch.arange(2)) % 4 for n in LENGTHS]  # 2 distinct
    one = _replay_job(0, 1, reserve_port(), model_dir, 1, routes)
    for got in run_ranks(_replay_job, 2, model_dir, 2, routes, timeout=600):
        for a, b in zip(got, one, strict=True):
            torch.testing.assert_close(a, b, **TOL)


def test_what_cannot_split_is_refused_naming_the_fix():
    """(Heads that cp does not divide: `check_layout`, tests/test_parallel.py.)"""
    model = type("Model", (), {"config": type("Config", (), {"num_attention_heads": 4})()})()
    with pytest.raises(ValueError, match="--fsdp.attn_implementation sdpa cannot run there: set "
                                         "--fsdp.attn_implementation packed"):
        apply_context_parallel(model, 2, "sdpa")
