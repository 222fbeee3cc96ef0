"""Context parallelism, Ulysses-style: the cp ranks of one data shard split each packed row into
contiguous chunks, one each. Embeddings, norms, MLPs and the head run on the rank's chunk alone;
around attention an all-to-all trades the split over tokens for a split over heads, so each rank
attends over the whole row with 1/cp of the heads, and a second all-to-all trades back.

Why Ulysses, not ring attention: it needs only `all_to_all_single` (with autograd, on gloo and NCCL
alike) and runs the unchanged `packed_attention` inside, over the whole row's sequence bounds; ring
attention needs its own kernel that merges partial softmaxes forward and backward. Its limit: cp
divides each rank's query heads (key/value heads that do not divide are repeated).

The model code knows none of this: `apply_context_parallel` swaps its attention implementation, and
the worker feeds each rank its chunk (`split_row`) and sums the per-position results over the cp ranks
(`SumOverChunks`), so every cp rank holds the whole row's logprobs and computes the whole loss.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from instar.train.attention import Segments, packed_attention, registered

ULYSSES = "instar_ulysses"


def apply_context_parallel(model: nn.Module, cp: int, choice: str) -> None:
    """Run ``model``'s attention through `ulysses_attention`, in place (``choice``: --fsdp.attn_implementation),
    which attends with the packed-row attention the model had (`packed_attention`, or a registered one). That cp
    divides each tp rank's heads is checked before (`instar.checks.check_layout`, in `parallelize`)."""
    from transformers import AttentionInterface
    if choice not in ("auto", "packed"):
        raise ValueError(f"--fsdp.cp_size {cp} runs packed attention over each whole row; --fsdp.attn_implementation "
                         f"{choice} cannot run there: set --fsdp.attn_implementation packed (or auto)")
    impl = model.config._attn_implementation
    inner = registered(impl)
    name = ULYSSES if inner is None else f"{ULYSSES}_{impl}"
    attend = functools.partial(ulysses_attention, inner=packed_attention if inner is None else inner.attention)
    AttentionInterface.register(name, torch.compiler.disable(attend))  # no mask function; eager
    model.config._attn_implementation = name


def ulysses_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      cp_group: dist.ProcessGroup, row_segments: Segments, inner: Any = packed_attention,
                      **kwargs: Any) -> tuple[Tensor, None]:
    """``inner`` (a packed-row attention) for this rank's chunk ``[1, heads, L, d]``: all-to-all to the whole row
    ``[1, heads / cp, cp L, d]``, attend within its segments (``row_segments``), and back to ``[1, L, heads, d]``."""
    cp = dist.get_world_size(cp_group)
    if key.shape[1] % cp:  # e.g. one key/value head per tp rank: give each query head its own copy
        key, value = (t.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for t in (key, value))

    def to_row(t: Tensor) -> Tensor:  # send head group j to rank j; chunk i arrives from rank i
        _, h, n, d = t.shape
        t = funcol.all_to_all_single(t.reshape(cp, h // cp, n, d).contiguous(), None, None, cp_group)
        return t.transpose(0, 1).reshape(1, h // cp, cp * n, d)

    out, _ = inner(module, to_row(query), to_row(key), to_row(value), attention_mask, instar_segments=row_segments,
                   **kwargs)
    _, n, h, d = out.shape  # the row [1, cp L, heads / cp, d]: send chunk j to rank j
    out = funcol.all_to_all_single(out.reshape(cp, n // cp, h, d).contiguous(), None, None, cp_group)
    return out.transpose(0, 1).reshape(1, n // cp, cp * h, d), None


@dataclass
class Chunk:
    """This cp rank's part of a packed row, padded to a multiple of cp by one dummy segment at its end."""

    input_ids: Tensor  # [1, L] the chunk
    position_ids: Tensor  # [1, L]
    mine: Tensor  # [M] bool: which of the wanted row positions are in this chunk
    local: Tensor  # [M'] those positions within the chunk
    attention: dict[str, Any]  # the cp group and the row's segments, for `ulysses_attention`
    start: int
    row_length: int  # of the padded row

    def spread_row(self, values: Tensor) -> Tensor:
        """The chunk's ``[L]`` per-position values at their place in an ``[cp L]`` row of zeros."""
        return torch.nn.functional.pad(values, (self.start, self.row_length - self.start - values.shape[0]))


def split_row(input_ids: Tensor, position_ids: Tensor, segments: Segments, group: dist.ProcessGroup,
              positions: Tensor | None = None) -> Chunk:
    """This rank's chunk of the row ``[1, N]`` laid out in ``segments``; ``positions``: the row positions
    (repeats allowed) whose logits are wanted."""
    cp, n = dist.get_world_size(group), input_ids.shape[1]
    pad = -n % cp
    # the padding is a segment of its own (positions restart at 0): nothing real attends to it
    row_ids = torch.nn.functional.pad(input_ids, (0, pad))
    row_pos = torch.cat([position_ids, torch.arange(pad, device=position_ids.device)[None]], dim=1)
    size = (n + pad) // cp
    start = dist.get_rank(group) * size
    positions = torch.arange(n, device=input_ids.device) if positions is None else positions
    mine = (positions >= start) & (positions < start + size)
    return Chunk(row_ids[:, start:start + size], row_pos[:, start:start + size], mine, positions[mine] - start,
                 {"cp_group": group, "row_segments": segments.padded(n + pad)}, start, n + pad)


def chunk_rows(rows: Tensor, group: dist.ProcessGroup, fill: float) -> Tensor:
    """This rank's chunk of per-token rows ``[N, ...]`` (e.g. recorded expert routes), padded like `split_row`."""
    cp, n = dist.get_world_size(group), rows.shape[0]
    size = -(-n // cp)
    padded = torch.cat([rows, rows.new_full((size * cp - n, *rows.shape[1:]), fill)])
    return padded[dist.get_rank(group) * size:][:size]


class SumOverChunks(torch.autograd.Function):
    """Forward: the sum of the cp ranks' ``[cp L]`` rows, each zero outside its own chunk. Backward: the
    gradient unchanged. Every cp rank computes the same loss from the sum, so the gradient for its own
    part is that loss's gradient; an all-reduce backward would count it cp times."""

    @staticmethod
    def forward(ctx: Any, part: Tensor, group: dist.ProcessGroup) -> Tensor:
        whole = part.clone()
        dist.all_reduce(whole, group=group)
        return whole

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None
