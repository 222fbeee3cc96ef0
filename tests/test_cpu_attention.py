"""The trainer's packed attention kernel (`cpu/attention.py`) against SDPA with the mask it stands for:
outputs and all three gradients on a packed row read in place, segments with and without context (one of two
segments), grouped query heads, an empty segment, one and two threads (the same bits on any count); and
the accelerator's attention through it against `packed_attention` on plain and prefix-tree rows."""

import pytest
import torch
import torch.nn.functional as F
from helpers.layouts import EvalModule as _Eval
from helpers.layouts import grouped as _grouped

from instar.cpu.attention import SegmentAttention, attention, takes
from instar.train.attention import packed_attention
from instar.train.batch import row_layout

# a packed row of 22 tokens: a prompt (0) with two continuations (1, 2; 2 empty), one that goes on from 1 (5),
# a plain sequence (3) with one continuation (4), and a sequence of one token (6)
BOUNDS = (0, 5, 8, 8, 15, 19, 21, 22)
CONTEXT = ((), (0,), (0,), (), (3,), (0, 1), ())


def plan():
    own = [list(range(a, b)) for a, b in zip(BOUNDS, BOUNDS[1:])]
    seen = [[p for c in ctx for p in own[c]] for ctx in CONTEXT]
    index = torch.zeros(len(own), max(len(s) + len(o) for s, o in zip(seen, own)), dtype=torch.long)
    for k, (s, o) in enumerate(zip(seen, own)):
        index[k, :len(s) + len(o)] = torch.tensor(s + o, dtype=torch.long)
    return index, torch.tensor([len(s) for s in seen]), torch.tensor([len(o) for o in own]), own, seen


def masked_sdpa(q, k, v, scale):
    """The packed row under the mask the segments stand for: a token sees its context's rows and its own
    segment's rows up to itself."""
    *_, own, seen = plan()
    mask = torch.zeros(q.shape[0], q.shape[0], dtype=torch.bool)
    for rows, context in zip(own, seen):
        for i in rows:
            mask[i, context] = True
            mask[i, rows[0]:i + 1] = True
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("d,heads,kv_heads", [(32, 4, 2), (64, 8, 1), (16, 4, 4), (128, 2, 2)])
def test_the_kernel_equals_masked_sdpa_forward_and_backward(d, heads, kv_heads, threads):
    g = torch.Generator().manual_seed(d + heads)
    index, context, own, *_ = plan()
    n = BOUNDS[-1]
    q = torch.randn(n, heads, d, generator=g).requires_grad_()
    k, v = (torch.randn(n, kv_heads, d, generator=g).requires_grad_() for _ in range(2))
    weights = torch.randn(n, heads, d, generator=g)
    results, before = [], torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for attend in (lambda *t: SegmentAttention.apply(*t, index, context, own, 0.3), masked_sdpa):
            out = attend(q, k, v) if attend is not masked_sdpa else masked_sdpa(q, k, v, 0.3)
            (out * weights).sum().backward()
            results.append([out.detach(), *(t.grad for t in (q, k, v))])
            for t in (q, k, v):
                t.grad = None
    finally:
        torch.set_num_threads(before)
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)  # float32, summed in other orders


def test_the_kernels_sums_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(0)
    index, context, own, *_ = plan()
    q = torch.randn(BOUNDS[-1], 4, 32, generator=g).requires_grad_()
    k, v = (torch.randn(BOUNDS[-1], 2, 32, generator=g).requires_grad_() for _ in range(2))
    results, before = [], torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            SegmentAttention.apply(q, k, v, index, context, own, 0.5).square().sum().backward()
            results.append([t.grad.clone() for t in (q, k, v)])
            for t in (q, k, v):
                t.grad = None
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            assert torch.equal(got, want)


def test_segments_that_do_not_fit_are_refused():
    q, k = torch.zeros(6, 2, 32), torch.zeros(6, 1, 32)
    for index, context, own in (([[0, 1, 2, 3], [4, 5, 0, 0]], [0, 0], [4, 3]),  # keys past the index rows
                                ([[0, 1, 2, 3], [4, 6, 0, 0]], [0, 0], [4, 2]),  # a row past the packed row
                                ([[0, 1, 2, 3], [4, 5, 0, 0]], [-1, 0], [4, 2]),
                                ([[0, 1, 2, 3], [4, 0, 0, 0]], [0, 0], [4, 1])):  # a row nobody owns
        with pytest.raises(ValueError, match="segments of|refused its arguments"):
            SegmentAttention.apply(q, k, k, torch.tensor(index), torch.tensor(context), torch.tensor(own), 1.0)


@pytest.mark.parametrize("share", [False, True], ids=["plain", "prefix_tree"])
def test_the_accelerators_attention_equals_packed_attention(share):
    """The layer's attention as the trainer calls it (a packed row of whole sequences, or a prefix tree's
    segments), float32: through the kernel and through `packed_attention`'s SDPA path (the default)."""
    assert takes(torch.zeros(1, 4, 8, 32), 0.0)  # this machine builds it
    layout = row_layout(_grouped(2, 3, 4), share)
    torch.manual_seed(0)
    x = torch.randn(len(layout.tokens), 4 * 32, requires_grad=True)
    results = []
    for attend in (attention, packed_attention):
        q, k, v = (t.view(1, -1, 4, 32).transpose(1, 2) for t in (x, x.cos(), x.sin()))
        out, _ = attend(_Eval(), q, k[:, :2], v[:, :2], None, instar_segments=layout.segments)
        out.square().sum().backward()
        results.append((out.detach(), x.grad))
        x.grad = None
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-5)
