"""The trainer's packed attention as a C kernel (csrc/attention.c), registered as the trainer attention "cpu".

`attention` computes what `train.attention.packed_attention` computes: through the kernel where it takes the call
(one packed row, float32 on the CPU, a head width that is a multiple of 16, no dropout, a kernel built and
self-checked here), through `packed_attention` otherwise. At RL shapes (a few dozen queries, each seeing its
context and its own earlier tokens) a third or more of SDPA's padded work is masked out and what is left runs as
many tiny products; the kernel reads each query's keys only, in place in the packed row.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from instar.cpu.build import checked, native, pointers
from instar.train.attention import Segments, kernel_plan, packed_attention, segments_of


@functools.cache
def library() -> ctypes.PyDLL | None:
    return native("attention", "the trainer's packed attention", _self_check)


def _declare(lib: ctypes.PyDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.attention_forward.argtypes = [p] * 9 + [i] * 7 + [ctypes.c_float, ctypes.c_int]
    lib.attention_backward.argtypes = [p] * 15 + [i] * 8 + [ctypes.c_float, ctypes.c_int]
    lib.attention_forward.restype = lib.attention_backward.restype = ctypes.c_int


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` in contiguous memory of its own: under context parallelism a row (and its gradient) comes from an
    all-to-all as a wrapper whose memory is filled once waited on."""
    return (t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t).contiguous()


class SegmentAttention(torch.autograd.Function):
    """``out [N, H, d]`` from a packed row's ``q [N, H, d]``, ``k, v [N, KV, d]`` (float32) and its segments
    (`train.attention.kernel_plan`): ``index [S, TK]`` the rows of each segment's keys, ``context [S]`` of them
    first, then its ``own [S]``, which are also its queries. Every row is one segment's own."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                context: torch.Tensor, own: torch.Tensor, scale: float, lib: Any = None) -> torch.Tensor:
        lib = lib or library()
        q, k, v = (_dense(t) for t in (q, k, v))
        (N, H, d), KV, (S, TK) = q.shape, k.shape[1], index.shape
        T = int(own.max()) if S else 0
        out, lse = torch.empty_like(q), q.new_empty(S, H, T)
        threads, nk16 = torch.get_num_threads(), (TK + 15) // 16 * 16
        scratch = q.new_empty(threads * ((2 * d + 4) * nk16 + 4 * d))
        if int(own.sum()) != N or k.shape[0] != N:
            raise ValueError(f"packed attention kernel: segments of {int(own.sum())} rows for {N} queries and keys "
                             f"{tuple(k.shape)}")
        checked(lib.attention_forward(*pointers(q, k, v, index, context, own, out, lse, scratch), S, T, TK, N, H, KV,
                                      d, scale, threads), "packed attention forward")
        ctx.save_for_backward(q, k, v, out, lse, index, context, own)
        ctx.scale, ctx.lib = scale, lib
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, index, context, own = ctx.saved_tensors
        (N, H, d), KV, (S, TK), T = q.shape, k.shape[1], index.shape, lse.shape[2]
        C = int(context.max()) if S else 0
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dck, dcv = (k.new_empty(S, C, KV, d) for _ in range(2))  # context keys' gradients, added in after
        threads, nk16 = torch.get_num_threads(), (TK + 15) // 16 * 16
        scratch = q.new_empty(threads * ((5 * d + 8) * nk16 + 12 * d))
        checked(ctx.lib.attention_backward(*pointers(q, k, v, out, _dense(grad), lse, index, context, own, dq, dk, dv,
                                                     dck, dcv, scratch), S, T, TK, C, N, H, KV, d, ctx.scale, threads),
                "packed attention backward")
        return dq, dk, dv, None, None, None, None, None


def takes(query: torch.Tensor, dropout: float) -> bool:
    """Whether the kernel computes this attention ``[1, heads, N, d]``."""
    return (query.shape[0] == 1 and query.device.type == "cpu" and query.dtype == torch.float32
            and query.shape[-1] % 16 == 0 and not dropout and library() is not None)


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              cu_seq_lens_q: torch.Tensor | None = None, instar_segments: Segments | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """`packed_attention`'s interface and results; through the kernel where it `takes` the call."""
    dropout = dropout if module.training else 0.0
    if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16):  # as packed_attention does
        out, _ = attention(module, query.float(), key.float(), value.float(), attention_mask, scaling, dropout,
                           cu_seq_lens_q, instar_segments, **kwargs)
        return out.to(query.dtype), None
    if kwargs.get("sliding_window") or not takes(query, dropout):
        return packed_attention(module, query, key, value, attention_mask, scaling, dropout, cu_seq_lens_q,
                                instar_segments, **kwargs)
    index, context, own = kernel_plan(segments_of(query, cu_seq_lens_q, instar_segments))
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, d]: a view of the projection
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return SegmentAttention.apply(q, k, v, index, context, own, scale)[None], None


@torch.inference_mode(False)
@torch.enable_grad()  # first asked for inside an autograd function's forward, where gradients are off
def _self_check(lib: ctypes.PyDLL) -> None:
    """The kernel against `packed_attention`'s torch path on a random prefix-tree row, forward and backward."""
    _declare(lib)
    g = torch.Generator().manual_seed(0)
    segments = Segments((0, 5, 9, 12, 19), ((), (0,), (0,), ()))
    q = torch.randn(1, 4, 19, 32, generator=g).requires_grad_()
    k, v = (torch.randn(1, 2, 19, 32, generator=g).requires_grad_() for _ in range(2))
    weights = torch.randn(1, 19, 4, 32, generator=g)
    index, context, own = kernel_plan(segments)
    results = []
    for attend in (lambda: SegmentAttention.apply(*(t[0].transpose(0, 1) for t in (q, k, v)), index, context, own,
                                                  0.3, lib)[None],
                   lambda: packed_attention(nn.Module().eval(), q, k, v, None, 0.3, instar_segments=segments)[0]):
        out = attend()
        (out * weights).sum().backward()
        results.append([out.detach(), *(t.grad.clone() for t in (q, k, v))])
        for t in (q, k, v):
            t.grad = None
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)
