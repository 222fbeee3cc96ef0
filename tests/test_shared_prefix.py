"""Prefix-tree rows (--train.share_prefix): a group's shared prompt is computed once and every result is
the same as computing each sample in full. The layout (golden), the attention (forward and gradients,
batched and per segment), and the trainer: logprobs, values, losses, grad norms and weights after
3 steps equal those of plain rows, on one rank and with context parallelism (cp=2)."""

from functools import partial

import pytest
import torch
from helpers.layouts import TOL, EvalModule, full_state, grouped, rl_config

from instar.config import ActorConfig, CriticConfig, FSDPConfig, TrainConfig
from instar.contract import Sample
from instar.runtime.batching import critic_loss, rl_loss
from instar.train.attention import Segments, _shared_plan, packed_attention
from instar.train.batch import (
    ROW_MULTIPLE,
    StepInputs,
    collate,
    plan_micro_batches,
    row_layout,
    shard_samples,
    tree_order,
)
from instar.train.launch import reserve_port, run_ranks
from instar.train.worker import TrainWorker


def test_row_layout_puts_a_shared_start_in_the_row_once():
    head = list(range(1, 11))
    seqs = [head + [20, 21], head + [30], head + [20, 22], [40, 41]]
    shared = row_layout(seqs, share=True, min_shared=4)
    # [20, 21] and [20, 22] share one more token, too short for a segment of its own: each repeats it
    assert shared.tokens == head + [20, 21, 20, 22, 30, 40, 41]
    assert shared.positions == list(range(10)) + [10, 11, 10, 11, 10, 0, 1]
    assert shared.segments == Segments((0, 10, 12, 14, 15, 17), ((), (0,), (0,), (0,), ()))
    assert shared.place == [list(range(10)) + [10, 11], list(range(10)) + [14], list(range(10)) + [12, 13], [15, 16]]
    assert shared.sources == [(0, 0, 10), (0, 10, 12), (2, 10, 12), (1, 10, 11), (3, 0, 2)]
    plain = row_layout(seqs, share=False)
    assert plain.tokens == [t for s in seqs for t in s] and not plain.segments.shared
    assert plain.segments.bounds == (0, 12, 23, 35, 37)
    nested = row_layout([head + [50] * 9 + [1], head + [50] * 9 + [2], head + [3]], share=True, min_shared=4)
    # depth first in token order: head, [3], [50] x 9, then the two that continue it
    assert nested.segments.context == ((), (0,), (0,), (0, 2), (0, 2))  # a shared start within a shared start
    assert len(nested.tokens) == 10 + 9 + 1 + 1 + 1


def test_rows_and_ranks_keep_a_group_together():
    group_a = [list(range(1, 11)) + [20 + k] for k in range(3)]
    group_b = [list(range(50, 60)) + [60 + k] for k in range(3)]
    seqs = [group_b[0], group_a[0], [90, 91], group_a[1], group_b[1], group_a[2], group_b[2]]
    lengths = list(map(len, seqs))
    assert tree_order(seqs) == ([1, 3, 5, 0, 4, 6, 2], [10, 10, 0, 10, 10, 0])
    assert plan_micro_batches(lengths, 14, seqs) == [[1, 3, 5], [0, 4, 6], [2]]  # rows of 13, 13 and 2 tokens
    assert plan_micro_batches(lengths, 12, seqs) == [[1, 3], [5], [0, 4], [6], [2]]
    assert shard_samples(lengths, 2, seqs) == [[1, 3, 5], [0, 2, 4, 6]]  # 13 and 15 tokens of prefix tree
    assert shard_samples(lengths, 2) == [[0, 2, 3, 5], [1, 4, 6]]  # plain: by length, groups split
    # 10 tokens shared by all, 6 more by two: too few for a segment, so each of those two repeats them
    tail = [list(range(1, 11)) + [3], list(range(1, 11)) + [7] * 6 + [1], list(range(1, 11)) + [7] * 6 + [2]]
    assert len(row_layout(tail).tokens) == 25
    assert plan_micro_batches([11, 17, 17], 20, tail) == [[0, 1], [2]]  # 19 tokens by common starts, 25 real


@pytest.mark.parametrize("long_tail", [False, True], ids=["batched", "per_segment"])
def test_shared_attention_equals_plain_forward_and_backward(long_tail):
    """Queries, keys and values made from (token, position) so both layouts compute the same thing."""
    seqs = grouped(0, 3, 4, long_tail)
    heads, dim = 4, 8
    torch.manual_seed(0)
    emb, pos = torch.randn(500, heads * dim, dtype=torch.float64, requires_grad=True), torch.randn(64, heads * dim)

    def run(share: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        layout = row_layout(seqs, share)
        assert layout.segments.shared == share
        if share:  # lengths far apart: one call per segment (padding would more than double the work)
            assert isinstance(_shared_plan(layout.segments), list) == long_tail
        x = emb[torch.tensor(layout.tokens)] + pos[torch.tensor(layout.positions)]
        q, k, v = (t.view(1, -1, heads, dim).transpose(1, 2) for t in (x, x.cos(), x.sin()))
        out, _ = packed_attention(EvalModule(), q, k[:, :2], v[:, :2], None, instar_segments=layout.segments)
        per_seq = [out[0, p] for p in layout.place]
        emb.grad = None
        sum(o.square().sum() * (i + 1) for i, o in enumerate(per_seq)).backward()
        return per_seq, emb.grad.clone()

    plain, plain_grad = run(False)
    shared, shared_grad = run(True)
    for a, b in zip(shared, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(shared_grad, plain_grad, rtol=1e-10, atol=1e-10)


LENGTHS_RL = rl_config()
LENGTHS_RL.actor.loss_mode, LENGTHS_RL.actor.entropy_coef = "gspo", 0.01
SEQS = grouped(1, 3, 4)
SAMPLES = [Sample(s, [0] * 9 + [1] * (len(s) - 9), [0.0] * 9 + [-1.0] * (len(s) - 9), [-1] * 9 + [0] * (len(s) - 9))
           for s in SEQS if len(s) > 9]
ADVANTAGES = [torch.full((len(s.token_ids),), 1.0 if i % 3 else -1.0) for i, s in enumerate(SAMPLES)]
RETURNS = [torch.linspace(-1, 1, len(s.token_ids)) for s in SAMPLES]
UPDATES = [list(range(0, len(SAMPLES), 2)), list(range(1, len(SAMPLES), 2))]


def _job(rank, world, port, model_dir, cp, share, pad: int | None = None, mixed: str = "float32"):
    w = TrainWorker(ActorConfig(model_name_or_path=str(model_dir), learning_rate=1e-3, lr_warmup_steps=1),
                    FSDPConfig(num_ranks=world, cp_size=cp, mixed_precision=mixed),
                    TrainConfig(max_tokens_per_gpu=512, max_steps=10, share_prefix=share),
                    critic=CriticConfig(learning_rate=1e-2))
    w.init(rank, world, "127.0.0.1", port)
    chosen, w.pad_rows = w.pad_rows, pad or w.pad_rows
    mb = collate(SAMPLES, list(range(len(SAMPLES))), share=w.share_prefix, pad_to=w.pad_rows)
    out = {"row": mb.input_ids.shape[1], "pad_rows": chosen, "initial": w.compute_logprobs(SAMPLES), "actor": [
        w.train_policy(SAMPLES, partial(rl_loss, LENGTHS_RL, 0.0), StepInputs(advantages=ADVANTAGES),
                       updates=UPDATES).metrics for _ in range(3)]}
    out["logprobs"] = w.compute_logprobs(SAMPLES)
    out["state"] = full_state(w)
    out["critic"] = [w.train_critic(SAMPLES, partial(critic_loss, LENGTHS_RL), StepInputs(
        old_values=w.compute_values(SAMPLES), returns=RETURNS)).metrics for _ in range(2)]
    out["values"] = w.compute_values(SAMPLES)
    w.shutdown()
    return out


@pytest.fixture(scope="module")
def plain(tiny_heads4_dir):
    return _job(0, 1, reserve_port(), tiny_heads4_dir, 1, False)


def _assert_same(got: dict, want: dict) -> None:
    for key in ("initial", "logprobs", "values"):
        for a, b in zip(got[key], want[key], strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, **TOL)
    for kind, keys in (("actor", ("loss", "grad_norm", "entropy", "policy_clip_ratio", "policy_kl")),
                       ("critic", ("loss", "grad_norm"))):
        for m, ref in zip(got[kind], want[kind], strict=True):
            for k in keys:
                assert m[f"{kind}/{k}"] == pytest.approx(ref[f"{kind}/{k}"], rel=1e-4, abs=1e-6), (kind, k)
    for k, v in want["state"].items():
        torch.testing.assert_close(got["state"][k], v, **TOL, msg=k)


def test_shared_rows_train_like_plain_rows(tiny_heads4_dir, plain):
    shared = _job(0, 1, reserve_port(), tiny_heads4_dir, 1, True)
    assert shared["row"] < 0.7 * plain["row"]  # the prompts really were computed once per group
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(plain["logprobs"], plain["initial"]))
    _assert_same(shared, plain)


@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared"])
def test_rows_padded_for_bf16_kernels_train_like_unpadded_rows(tiny_heads4_dir, plain, share):
    """The padding a CPU bf16 trainer adds (a sequence nothing reads), here in float32 so the results
    must be the unpadded ones up to float rounding."""
    assert plain["pad_rows"] == 1  # float32 rows are not padded
    padded = _job(0, 1, reserve_port(), tiny_heads4_dir, 1, share, pad=ROW_MULTIPLE)
    assert padded["row"] % ROW_MULTIPLE == 0 and (padded["row"] > plain["row"] or share)
    _assert_same(padded, plain)


def test_a_cpu_bf16_trainer_pads_its_rows(tiny_heads4_dir):
    assert _job(0, 1, reserve_port(), tiny_heads4_dir, 1, False, mixed="bfloat16")["pad_rows"] == ROW_MULTIPLE


@pytest.mark.slow
def test_shared_rows_under_context_parallelism_train_like_plain_rows(tiny_heads4_dir, plain):
    results = run_ranks(_job, 2, tiny_heads4_dir, 2, True, timeout=600)
    assert results[0]["row"] < 0.7 * plain["row"]
    for r in results:
        _assert_same({**r, "state": results[0]["state"]}, plain)
