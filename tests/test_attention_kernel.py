"""The trainer's packed attention kernel (`train/attention_kernel.py`) against SDPA with the mask it stands for:
outputs and all three gradients, segments with and without context, grouped query heads, empty segments;
and `packed_attention` through it against its own SDPA path on plain and prefix-tree rows."""

import pytest
import torch
import torch.nn.functional as F
from test_shared_prefix import _Eval, _grouped

from instar.train import attention_kernel
from instar.train.attention import packed_attention
from instar.train.attention_kernel import SegmentAttention
from instar.train.batch import row_layout


def masked_sdpa(q, k, v, context, own, scale):
    """Query i of segment s sees keys j <= context[s] + i; padded queries give zeros."""
    (_, T, _, _), TK = q.shape, k.shape[1]
    seen = context[:, None, None] + torch.arange(T)[None, :, None] + 1
    mask = (torch.arange(TK)[None, None] < seen)[:, None]
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask, scale=scale,
                                         enable_gqa=True).transpose(1, 2)
    return out * (torch.arange(T)[None] < own[:, None])[:, :, None, None]


@pytest.mark.parametrize("d,heads,kv_heads", [(32, 4, 2), (64, 8, 1), (16, 4, 4), (128, 2, 2)])
def test_the_kernel_equals_masked_sdpa_forward_and_backward(d, heads, kv_heads):
    g = torch.Generator().manual_seed(d + heads)
    context, own = torch.tensor([0, 5, 17, 0, 2, 9]), torch.tensor([13, 1, 9, 0, 13, 6])
    T, TK = 13, 28
    q = torch.randn(6, T, heads, d, generator=g).requires_grad_()
    k, v = (torch.randn(6, TK, kv_heads, d, generator=g).requires_grad_() for _ in range(2))
    weights = torch.randn(6, T, heads, d, generator=g)
    results = []
    for attend in (SegmentAttention.apply, masked_sdpa):
        out = attend(q, k, v, context, own, 0.3)
        (out * weights).sum().backward()
        results.append([out.detach(), *(t.grad for t in (q, k, v))])
        for t in (q, k, v):
            t.grad = None
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)  # float32, summed in other orders
    assert results[0][0][3].abs().sum() == 0 and results[0][1][3].abs().sum() == 0  # an empty segment


def test_segments_that_do_not_fit_are_refused():
    q, k = torch.zeros(2, 4, 2, 32), torch.zeros(2, 6, 1, 32)
    for context, own in (([0, 3], [4, 4]), ([0, 0], [5, 1]), ([-1, 0], [1, 1])):
        with pytest.raises(ValueError, match="do not fit"):
            SegmentAttention.apply(q, k, k, torch.tensor(context), torch.tensor(own), 1.0)


@pytest.mark.parametrize("share", [False, True], ids=["plain", "prefix_tree"])
def test_packed_attention_through_the_kernel_equals_its_sdpa_path(share, monkeypatch):
    """The layer's attention as the trainer calls it (a packed row of whole sequences, or a prefix tree's
    segments), float32: through the kernel and through SDPA (the path where no kernel is built)."""
    assert attention_kernel.takes(torch.zeros(1, 32), 0.0)  # this machine builds it
    layout = row_layout(_grouped(2, 3, 4), share)
    torch.manual_seed(0)
    x = torch.randn(len(layout.tokens), 4 * 32, requires_grad=True)
    results = []
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(attention_kernel, "takes", lambda query, dropout: False)
        q, k, v = (t.view(1, -1, 4, 32).transpose(1, 2) for t in (x, x.cos(), x.sin()))
        out, _ = packed_attention(_Eval(), q, k[:, :2], v[:, :2], None, instar_segments=layout.segments)
        out.square().sum().backward()
        results.append((out.detach(), x.grad))
        x.grad = None
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-5)
