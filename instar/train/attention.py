"""The trainer's attention over packed rows: each sequence (or each segment of a prefix tree) sees only its own
earlier tokens and its context, never the padding or another sequence. `attention_for` picks the kernel
for ``--fsdp.attn_implementation``; "packed" (the CPU default) is `packed_attention`, registered with
transformers. Other packed-row attentions are registered by name in `REGISTERED` (the CPU accelerator's "cpu").
"""

from __future__ import annotations

import functools
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

PACKED = "instar_packed"


@dataclass(frozen=True)
class Segments:
    """A packed row as segments of consecutive tokens: ``bounds`` are their starts plus the row's length;
    ``context[k]`` names the earlier segments that segment k's tokens see whole before seeing their own
    causally. A plain row has no context: each sequence is a segment. In a shared row (a prefix tree) a
    group's prompt is one segment and each continuation sees it as context. Hashable: index tensors
    built from it are cached."""

    bounds: tuple[int, ...]
    context: tuple[tuple[int, ...], ...]

    @property
    def shared(self) -> bool:
        return any(self.context)

    def padded(self, n: int) -> Segments:
        """The row extended to ``n`` tokens by one more segment (padding no real token sees)."""
        if n == self.bounds[-1]:
            return self
        return Segments((*self.bounds, n), (*self.context, ()))


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     cu_seq_lens_q: torch.Tensor | None = None, instar_segments: Segments | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention within each sequence of a packed row ``[1, heads, N, head_dim]``.

    Why: for packed rows transformers builds a dense block-diagonal mask, so attention costs the
    square of the row length (most of it masked out) and SDPA's masked CPU path is slow. Here the
    sequences (bounds in ``cu_seq_lens_q``: starts plus the row length, the name transformers'
    flash-attention varlen path also reads) are laid out right-padded as one ``[B, heads, T, d]``
    batch for one causal SDPA call: a real query never sees the padding after it. When padding would
    more than double the work (lengths far apart), one causal call per sequence instead. A shared row
    (``instar_segments`` with context) goes to `_shared_attention`.
    """
    if kwargs.get("sliding_window"):
        raise NotImplementedError("packed attention has no sliding window (load_model picks sdpa for such models)")
    if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16):
        # bf16 pays in the matmuls around attention (~5x float32's rate on CPUs with AVX512-BF16), but CPU
        # SDPA in bf16 is slower than in float32 (its backward ~5x on a demo-sized row): attend in float32.
        out, _ = packed_attention(module, query.float(), key.float(), value.float(), attention_mask, scaling,
                                  dropout, cu_seq_lens_q, instar_segments, **kwargs)
        return out.to(query.dtype), None
    kw = {"dropout_p": dropout if module.training else 0.0, "scale": scaling,
          "enable_gqa": query.shape[1] != key.shape[1]}
    instar_segments = segments_of(query, cu_seq_lens_q, instar_segments)
    if instar_segments.shared:
        return _shared_attention(query, key, value, instar_segments, kw), None
    bounds = instar_segments.bounds
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    kw["is_causal"] = True
    if len(lengths) > 1 and len(lengths) * max(lengths) ** 2 <= 2 * sum(n * n for n in lengths):
        slots, width = _padded_slots(bounds), max(lengths)
        rows = len(lengths) * width
        # whole tokens (all heads) move as one row each: gathering a head's 32 floats at a time from the
        # [heads, N, d] view, with an accumulating scatter backward, took ~20 of a demo-sized update's ~330 ms
        q, k, v = (_to_padded(t[0].transpose(0, 1).reshape(t.shape[2], -1), slots, rows)
                   .view(len(lengths), width, t.shape[1], t.shape[3]) for t in (query, key, value))
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), **kw).transpose(1, 2)
        return _FromPadded.apply(out.reshape(rows, -1), slots).view(1, query.shape[2], query.shape[1], -1), None
    parts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], **kw)
             for a, b in zip(bounds, bounds[1:])]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=4)  # every layer of a forward (and its recompute) asks for the same bounds
def _padded_slots(bounds: tuple[int, ...]) -> torch.Tensor:
    """Where each of the row's tokens goes in the right-padded ``[B * T]`` batch of its sequences."""
    starts, lengths = torch.tensor(bounds[:-1]), torch.tensor(bounds[1:]) - torch.tensor(bounds[:-1])
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return sequence * int(lengths.max()) + torch.arange(bounds[-1]) - starts[sequence]


def _to_padded(x: torch.Tensor, slots: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [N, F]`` into a zero ``[rows, F]`` at the distinct ``slots``; autograd's gradient of the in-place
    copy gathers them back (`index_copy`'s backward: an index_select, nothing accumulates)."""
    return x.new_zeros(rows, x.shape[1]).index_copy_(0, slots.to(x.device), x)


class _FromPadded(torch.autograd.Function):
    """The ``slots`` rows of ``x [rows, F]``; the gradient is zero at the padding."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slots)
        ctx.rows = x.shape[0]
        return x.index_select(0, slots.to(x.device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (slots,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, grad.shape[1]).index_copy_(0, slots.to(grad.device), grad), None


def segments_of(query: torch.Tensor, cu_seq_lens_q: torch.Tensor | None, segments: Segments | None) -> Segments:
    """The row's segments: given, or one per sequence of ``cu_seq_lens_q`` (the whole row without it)."""
    if segments is not None:
        return segments
    bounds = (0, query.shape[2]) if cu_seq_lens_q is None else tuple(cu_seq_lens_q.tolist())
    return Segments(bounds, ((),) * (len(bounds) - 1))


def _shared_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: Segments,
                      kw: dict[str, Any]) -> torch.Tensor:
    """`packed_attention` of a prefix-tree row through SDPA: each segment's queries see its context segments
    whole and its own keys causally. The segments are laid out as one right-padded ``[S, heads, Tq, d]`` batch
    of queries against ``[S, heads, Tk, d]`` keys (context, then own) under one mask; a context's keys are
    gathered into every segment that sees it, so their gradients sum over those segments. When padding
    would more than double the work, one call per segment instead."""
    plan = _shared_plan(segments)
    if isinstance(plan, list):
        parts = [F.scaled_dot_product_attention(query[:, :, a:z], *(t[:, :, keys] for t in (key, value)),
                                                attn_mask=mask.to(query.device), **kw)
                 for a, z, keys, mask in plan]
        return torch.cat(parts, dim=2).transpose(1, 2)
    q_index, k_index, mask, real = (t.to(query.device) for t in plan)
    q, k, v = (_gather_tokens(t, i) for t, i in ((query, q_index), (key, k_index), (value, k_index)))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw).transpose(1, 2)
    # [S, Tq, heads, d] -> the row's [1, N, heads, d]
    return _FromPadded.apply(out.reshape(q_index.numel(), -1), real).view(1, query.shape[2], query.shape[1], -1)


def _gather_tokens(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[S, heads, T, d]`` from a packed ``[1, heads, N, d]`` at the row positions ``index [S, T]``, whole
    tokens at a time (see `packed_attention`); a position gathered twice gets the sum of both gradients."""
    rows = t[0].transpose(0, 1).reshape(t.shape[2], -1).index_select(0, index.reshape(-1))
    return rows.view(*index.shape, t.shape[1], t.shape[3]).transpose(1, 2)


@functools.lru_cache(maxsize=4)  # every layer of a forward (and its recompute) asks for the same row
def kernel_plan(segments: Segments) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each segment's key rows ``[S, Tk]`` (its context's, then its own; zeros past them), its context's and its
    own lengths: the key rows `_shared_attention` gathers, and what a kernel that reads the row in place needs."""
    own = [list(range(a, z)) for a, z in zip(segments.bounds, segments.bounds[1:])]
    seen = [[p for c in ctx for p in own[c]] for ctx in segments.context]  # each segment's context rows, in order
    index = pad_sequence([torch.tensor(s + o, dtype=torch.long) for s, o in zip(seen, own)], batch_first=True)
    return index, torch.tensor([len(s) for s in seen]), torch.tensor([len(o) for o in own])


@functools.lru_cache(maxsize=4)  # every layer of a forward (and its recompute) asks for the same row
def _shared_plan(segments: Segments) -> tuple[torch.Tensor, ...] | list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """For `_shared_attention`: ``[S, Tq]`` query positions, ``[S, Tk]`` key positions (context first), the
    ``[S, 1, Tq, Tk]`` mask, and where the row's queries are in the flattened ``[S * Tq]`` (padding points at
    position 0; its outputs are dropped). Or, when padding would more than double the work, per segment its
    bounds, key positions and ``[Tq, Tk]`` mask."""
    keys, seen, own = kernel_plan(segments)
    starts = torch.tensor(segments.bounds[:-1])
    tq, tk = int(own.max()), keys.shape[1]
    # query i of a segment sees its context whole and its own keys up to i: key j where j <= i + context length
    if len(own) * tq * tk > 2 * int((own * (seen + own)).sum()):
        return [(a, a + o, keys[k, :s + o], torch.arange(s + o)[None] <= torch.arange(o)[:, None] + s)
                for k, (a, s, o) in enumerate(zip(starts.tolist(), seen.tolist(), own.tolist()))]
    steps = torch.arange(tq)
    valid = steps[None] < own[:, None]
    mask = (torch.arange(tk) <= steps[:, None] + seen[:, None, None])[:, None]  # padded queries: as real ones
    return torch.where(valid, starts[:, None] + steps, 0), keys, mask, valid.reshape(-1).nonzero()[:, 0]


@dataclass(frozen=True)
class Registered:
    """A packed-row attention registered by name: ``attention`` has `packed_attention`'s interface and results
    (it reads `Segments`); ``prepare(model, settings)`` is done to each model that attends with it, after
    `parallelize` (the CPU accelerator's: its linear layers, compiled layers' CPU settings, malloc)."""

    attention: Callable[..., tuple[torch.Tensor, None]]
    prepare: Callable[[nn.Module, Any], None] | None = None


REGISTERED = {"cpu": "instar.cpu.trainer:REGISTERED"}
"""Registered attentions by name, as ``module:object`` (a `Registered`), imported when one is chosen: "cpu" is the
optional CPU accelerator's (--cpu.enable), which transformers knows as ``instar_cpu``."""


def registered(impl: str) -> Registered | None:
    """The `Registered` attention behind transformers' ``impl`` (``instar_<name>``), if any."""
    target = REGISTERED.get(impl.removeprefix("instar_")) if impl.startswith("instar_") else None
    return None if target is None else pkgutil.resolve_name(target)


def packed_rows(impl: str) -> bool:
    """Whether transformers' attention ``impl`` is one of ours, which read packed rows as `Segments`."""
    return impl.startswith("instar_")


def attention_for(path: str, choice: str = "auto", accelerated: bool = False) -> str:
    """The transformers ``attn_implementation`` for ``--fsdp.attn_implementation`` (see its help):
    "packed" is `packed_attention`, registered with transformers; "flex_attention" is transformers' own,
    which finds the packed row's sequences in the restarting ``position_ids`` and builds one
    document-causal BlockMask per forward, shared by all layers. "auto" picks flex_attention on a GPU
    and, on CPU (where FlexAttention has no backward), packed unless the model uses a sliding window,
    then sdpa. ``accelerated`` (--cpu.enable): packed on CPU is the accelerator's "cpu". A name in `REGISTERED`
    is that attention. A kernel that cannot run here is an error that names the fix."""
    import importlib.util

    from transformers import AttentionInterface, AutoConfig
    # no mask function: transformers then builds none; eager under --fsdp.compile (see `parallel.compile_layers`)
    AttentionInterface.register(PACKED, torch.compiler.disable(packed_attention))
    gpu = torch.cuda.is_available()
    flash = gpu and importlib.util.find_spec("flash_attn") is not None
    if choice == "te":  # transformers runs no TransformerEngine attention in HF models: the fastest kernel there is
        impl = attention_for(path, "flash_attention_2" if flash else "auto", accelerated)
        print(f"instar: --fsdp.attn_implementation te (TransformerEngine) runs {impl}, the fastest attention here",
              flush=True)
        return impl
    if choice == "auto":
        if gpu:
            return "flex_attention"
        choice = "sdpa" if getattr(AutoConfig.from_pretrained(path), "sliding_window", None) else "packed"
    if choice == "packed":
        choice = "cpu" if accelerated and not gpu else choice
    if choice in REGISTERED:
        impl = f"instar_{choice}"
        AttentionInterface.register(impl, torch.compiler.disable(registered(impl).attention))
        return impl
    if choice == "packed":
        return PACKED
    if choice == "flex_attention" and not gpu:
        raise ValueError("--fsdp.attn_implementation flex_attention needs a CUDA GPU (PyTorch's FlexAttention "
                         "has no backward on CPU); use packed (or auto) on CPU")
    if choice == "flash_attention_2" and not flash:
        raise ValueError("--fsdp.attn_implementation flash_attention_2 needs a CUDA GPU and the flash-attn "
                         "package (pip install flash-attn); use packed (or auto) otherwise")
    return choice
