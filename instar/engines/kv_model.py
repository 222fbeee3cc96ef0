"""A compact forward of an HF Qwen3 / Qwen3-MoE model over ragged sequences with a slotted KV cache.

Why not HF's forward and cache: HF's cache holds one length for the whole batch, so sequences that
join and leave a running batch (continuous batching) would need re-padding every step. Here each
running request owns a *slot* of a preallocated cache, (slots, kv_heads, capacity, head_dim) per
layer. One forward takes every request's not-yet-cached tokens packed back to back (prefill and
decode rows together, no padding through the projections and MLP), writes their keys and values at
the request's own positions, and attends per group of rows with a causal mask per row.

The forward uses the HF model's own modules and weights (norms, projections and the SiLU MLP through
torch.nn.functional, the rotary embedding, MoE router and experts called as they are), so its
arithmetic is HF's; only attention and the cache are written here.
"""

from __future__ import annotations

import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import nn

from instar.engines.protocol import StepAccelerator

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_vl")


def decoder(model: nn.Module) -> nn.Module:
    """The text decoder (embeddings, layers, norm, rotary embedding) of a causal LM or a Qwen3-VL."""
    return getattr(model.model, "language_model", model.model)


def text_config(model: nn.Module) -> Any:
    return getattr(model.config, "text_config", model.config)


def check_supported(model: nn.Module) -> None:
    """Raise if the embedded engine cannot run ``model`` exactly."""
    if model.config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"the embedded engine runs {SUPPORTED_MODEL_TYPES} models, got model_type "
                         f"{model.config.model_type!r}; use --rollout.engine vllm for other architectures")
    if any(getattr(layer.self_attn, "sliding_window", None) for layer in decoder(model).layers):
        raise ValueError("the embedded engine has no sliding-window attention; set use_sliding_window "
                         "false in the model config or use --rollout.engine vllm")


_MOE: WeakKeyDictionary[nn.Module, bool] = WeakKeyDictionary()


def is_moe(layer: nn.Module) -> bool:
    if (moe := _MOE.get(layer)) is None:  # asked every step: a module's hasattr costs an exception
        moe = _MOE[layer] = hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")
    return moe


def moe_shape(model: nn.Module) -> tuple[int, int] | None:
    """(MoE layers, experts per token): the shape of a token's routing in `forward`'s output; None: a dense model."""
    moe_layers = sum(is_moe(layer) for layer in decoder(model).layers)
    return (moe_layers, text_config(model).num_experts_per_tok) if moe_layers else None


class SlotCache:
    """Keys and values of every running request, one slot each, (slots, kv_heads, capacity, head_dim)
    per layer; both the slots and the capacity grow by doubling, up to what is asked. Every slot spans
    the longest running sequence: simple and fast for the small models this engine is for; a paged
    cache is what vLLM adds. The engine keeps its running requests in slots 0..R-1 (`copy` moves one
    into a freed slot), so a batch's cached keys are usually one slice, read without gathering."""

    def __init__(self, model: nn.Module, slots: int = 16, capacity: int = 16):
        config, layers = text_config(model), decoder(model).layers
        self.shape = (slots, config.num_key_value_heads, capacity, config.head_dim)
        self.dtype, self.device = decoder(model).embed_tokens.weight.dtype, model.device
        self.k = [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in layers]
        self.v = [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in layers]

    def reserve(self, length: int, slots: int = 0) -> None:
        if length <= self.shape[2] and slots <= self.shape[0]:
            return
        self.shape = (_grown(self.shape[0], slots), self.shape[1], _grown(self.shape[2], length), self.shape[3])
        for kv in (self.k, self.v):
            for i, old in enumerate(kv):
                kv[i] = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
                kv[i][: old.shape[0], :, : old.shape[2]] = old

    def read(self, slot: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the first ``length`` cached positions of ``slot``, per layer (kv_heads, length, head_dim)."""
        return [k[slot, :, :length].clone() for k in self.k], [v[slot, :, :length].clone() for v in self.v]

    def copy(self, moves: list[tuple[int, int, int]]) -> None:
        """For each ``(source, slot, length)``: the first ``length`` positions of ``source`` into ``slot``;
        no slot is another's source. Moves of one length in one indexed copy per layer: a step's group of
        samples or its compaction is one small copy per layer and length instead of one per request (each
        ~5 us of op overhead, 16 a request at the demo's size)."""
        by_length: dict[int, list[tuple[int, int]]] = {}
        for source, slot, length in moves:
            by_length.setdefault(length, []).append((source, slot))
        for length, pairs in by_length.items():
            sources, slots = (ints(part).to(self.device) for part in zip(*pairs))
            for cache in (*self.k, *self.v):
                part = cache[:, :, :length]
                part.index_copy_(0, slots, part.index_select(0, sources))

    def write(self, slot: int, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> None:
        """Put the first ``length`` positions of saved ``keys`` / ``values`` back into ``slot``."""
        self.reserve(length, slot + 1)
        for cache, saved in zip((*self.k, *self.v), (*keys, *values)):
            cache[slot, :, :length] = saved[:, :length]


def _grown(have: int, need: int) -> int:
    return have if need <= have else max(need, 2 * have)


@dataclass
class AttentionGroup:
    """Rows attended together: their new tokens on a (rows, T) grid of packed token indices."""

    slots: torch.Tensor  # (rows,)
    first_slot: int | None  # rows hold slots first_slot, first_slot + 1, ... in order: the cache is read as a slice
    span: int  # key positions the rows attend to: the longest row's cached keys after this step's
    mask: torch.Tensor | None  # (rows, 1, T, span) bool: key position <= query position; None: T = 1 (`decode_bias`)
    grid: torch.Tensor | None  # (rows, T), padding repeats a row's last token; None: T = 1 and rows = packed order
    valid: torch.Tensor | None  # (rows, T) bool: grid entries that are real tokens; None: all are
    lengths: torch.Tensor  # (rows,) each row's cached keys after this step's
    _bias: torch.Tensor | None = field(default=None, init=False, repr=False)

    def decode_bias(self, heads: int, dtype: torch.dtype) -> torch.Tensor:
        """The mask of single-token rows (each sees its keys up to its length) as 0 / -inf to add to their
        scores, (rows, heads, span): built once per step, at the first layer, for every layer."""
        if self._bias is None:
            hidden = torch.arange(self.span, device=self.lengths.device) >= self.lengths[:, None, None]
            self._bias = torch.zeros(len(self.lengths), heads, self.span, device=self.lengths.device, dtype=dtype
                                     ).masked_fill_(hidden, float("-inf"))
        return self._bias


@dataclass
class Batch:
    """B rows of new tokens packed back to back (N tokens): row b's tokens sit at positions
    ``past[b], past[b] + 1, ...`` after the ``past[b]`` tokens already cached in slot ``slots[b]``."""

    tokens: torch.Tensor  # (N,)
    positions: torch.Tensor  # (N,)
    slots: torch.Tensor  # (N,) the cache slot of each token's row
    last: torch.Tensor | None  # (B,) packed index of each row's last token; None: token b is row b's last
    groups: list[AttentionGroup]
    rope: torch.Tensor | None = None  # (3, N) multimodal rotary positions (vision-language models)
    visual: torch.Tensor | None = None  # (M,) packed indices of image tokens
    features: torch.Tensor | None = None  # (1 + deepstack levels, M, hidden): their embeddings, then additions
    _rows: torch.Tensor | None = field(default=None, init=False, repr=False)

    def write_rows(self, cache: SlotCache) -> torch.Tensor:
        """(N * kv_heads,) rows of the flattened cache that receive the new keys, computed at the first layer
        that writes them through torch (a decode step through an accelerator's kernel never does)."""
        if self._rows is None:
            _, kv_heads, capacity, _ = cache.shape
            heads = torch.arange(kv_heads, device=self.slots.device)
            self._rows = ((self.slots[:, None] * kv_heads + heads) * capacity + self.positions[:, None]).reshape(-1)
        return self._rows


def make_batch(cache: SlotCache, new_ids: list[list[int]], slots: list[int], past: list[int],
               rope: list[torch.Tensor] | None = None,
               images: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> Batch:
    """Index tensors for one forward. Single-token (decode) rows and longer (prefill) rows attend in
    separate groups, so a decode row is never padded to a prompt's length. A vision-language model's
    rows also give their rotary positions ``rope`` (3, new tokens) and, where new tokens are image
    tokens, ``images``: their indices in the row and their features (1 + levels, tokens, hidden)."""
    sizes = [len(ids) for ids in new_ids]
    rows = len(sizes)
    decode = max(sizes) == 1  # a pure decode step: packed token b is row b's, at position past[b]
    # every index the step needs from Python in one tensor: tokens, past, slots
    flat = ints([*(t for ids in new_ids for t in ids), *past, *slots])
    tokens, past_t, slots_t = flat.split([sum(sizes), rows, rows])
    span = max(p + n for p, n in zip(past, sizes))
    cache.reserve(span, max(slots) + 1)
    if decode:  # no gathering at all
        starts, token_slots, positions = None, slots_t, past_t
        groups = [AttentionGroup(slots_t, _first_slot(slots), span, None, None, None, past_t + 1)]
    else:
        lengths = ints(sizes)
        ends = past_t + lengths
        starts = lengths.cumsum(0) - lengths
        row = torch.repeat_interleave(torch.arange(rows), lengths)  # (N,) row of each packed token
        token_slots, positions = slots_t[row], past_t[row] + torch.arange(len(row)) - starts[row]
        groups = []
        for rows_of in ((lengths == 1).nonzero()[:, 0], (lengths > 1).nonzero()[:, 0]):
            if len(rows_of):
                steps, span = torch.arange(int(lengths[rows_of].max())), int(ends[rows_of].max())
                grid = starts[rows_of][:, None] + torch.minimum(steps, lengths[rows_of][:, None] - 1)
                # single-token rows attend through `decode_bias` (or the kernel): only longer rows read a mask
                mask = (torch.arange(span) <= positions[grid][:, :, None])[:, None] if len(steps) > 1 else None
                groups.append(AttentionGroup(slots_t[rows_of], _first_slot(slots_t[rows_of].tolist()), span, mask,
                                             grid, steps < lengths[rows_of][:, None], ends[rows_of]))
    batch = Batch(tokens, positions, token_slots, None if decode else starts + lengths - 1, groups)
    if rope is not None:
        batch.rope = torch.cat(rope, dim=1)
        starts = torch.arange(rows) if starts is None else starts  # a decode step: row b's token is token b
        found = [(starts[b] + at, f) for b, item in enumerate(images or []) if item is not None for at, f in [item]]
        if found:
            batch.visual = torch.cat([at for at, _ in found])
            batch.features = torch.cat([f for _, f in found], dim=1)
    for record in (batch, *batch.groups) if cache.device.type != "cpu" else ():  # built on the host: one move
        for name, value in vars(record).items():
            if isinstance(value, torch.Tensor):
                setattr(record, name, value.to(cache.device, non_blocking=True))
    return batch


def ints(values: list[int]) -> torch.Tensor:
    """An int64 tensor of ``values``, through an array: torch.tensor converts a list element by element as
    Python objects, ~0.15 us each, several times this."""
    return torch.frombuffer(array.array("q", values), dtype=torch.int64) if values else torch.zeros(0, dtype=torch.long)


def _first_slot(slots: list[int]) -> int | None:
    return slots[0] if slots == list(range(slots[0], slots[0] + len(slots))) else None


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query token per row ``q (rows, heads, d)`` over ``keys``/``values (rows, kv_heads, span, d)``
    with the mask as ``bias`` (`AttentionGroup.decode_bias`): two batched matmuls with the query heads of
    one key/value head side by side, the scale and the mask applied in the first. At decode sizes this is
    several times faster than SDPA's CPU kernel, and on a slice of the cache it reads the keys where they lie."""
    rows, heads, d = q.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    scores = torch.baddbmm(bias.view(rows * kv_heads, group, span), q.reshape(rows * kv_heads, group, d),
                           keys.reshape(-1, span, d).transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(scores, dim=-1), values.reshape(-1, span, d)).view(rows, heads, d)


def attention(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: SlotCache, layer: int,
              batch: Batch) -> torch.Tensor:
    """Self-attention of the packed new tokens ``x`` (N, hidden) over each row's cached and new keys."""
    tokens, head_dim = x.shape[0], cache.shape[3]
    q = _norm(attn.q_norm, _linear(attn.q_proj, x).view(tokens, -1, head_dim))
    k = _norm(attn.k_norm, _linear(attn.k_proj, x).view(tokens, -1, head_dim))
    v = _linear(attn.v_proj, x).view(tokens, -1, head_dim)
    half = head_dim // 2  # HF's rotate_half(x) * sin, as x with its halves swapped times the signed sin
    q, k = q * cos + q.roll(half, -1) * sin, k * cos + k.roll(half, -1) * sin
    return _linear(attn.o_proj, attend(attn, q, k, v, cache, layer, batch))


def attend(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: SlotCache, layer: int,
           batch: Batch, accelerator: StepAccelerator | None = None) -> torch.Tensor:
    """Write the new keys/values ``k, v`` (N, kv_heads, d) into the cache and attend with ``q`` (N, heads, d)
    (rotated); returns (N, heads * d), before the output projection. Decode rows through ``accelerator`` when
    given and it takes them."""
    tokens, head_dim = q.shape[0], cache.shape[3]
    kernel = accelerator.decode if accelerator is not None and accelerator.takes_decode(q, cache.k[layer]) else None
    if kernel is not None and (group := batch.groups[0]).grid is None:  # a pure decode step
        return kernel(q, cache.k[layer], cache.v[layer], group.slots, group.lengths, group.span,
                      attn.scaling, (k, v)).reshape(tokens, -1)  # it writes the new keys too
    cache.k[layer].view(-1, head_dim).index_copy_(0, batch.write_rows(cache), k.reshape(-1, head_dim))
    cache.v[layer].view(-1, head_dim).index_copy_(0, batch.write_rows(cache), v.reshape(-1, head_dim))
    out = torch.empty_like(q)
    for group in batch.groups:
        rows = None if group.grid is None or group.grid.shape[1] > 1 else group.grid[:, 0]  # a mixed step's decode rows
        if kernel is not None and rows is not None:
            out.index_copy_(0, rows, kernel(q[rows], cache.k[layer], cache.v[layer], group.slots, group.lengths,
                                            group.span, attn.scaling))
            continue
        span, first = group.span, group.first_slot
        if first is not None:  # the rows' slots in order: the cache's own slice
            keys, values = (c[layer][first: first + len(group.slots), :, :span] for c in (cache.k, cache.v))
        else:  # index_select is much faster than advanced indexing here
            keys, values = (c[layer][:, :, :span].index_select(0, group.slots) for c in (cache.k, cache.v))
        if group.grid is None:  # a pure decode step: every row, in packed order
            out = _decode_attention(q, keys, values, group.decode_bias(q.shape[1], q.dtype), attn.scaling)
        elif rows is not None:  # the decode rows of a step that also prefills: one query each
            out[rows] = _decode_attention(q[rows], keys, values, group.decode_bias(q.shape[1], q.dtype), attn.scaling)
        else:
            query = q[group.grid].transpose(1, 2)  # (rows, heads, T, head_dim)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=group.mask, scale=attn.scaling,
                                               enable_gqa=True)
            out[group.grid[group.valid]] = o.transpose(1, 2)[group.valid]
    return out.reshape(tokens, -1)


# The layers' own weights through torch.nn.functional: the same arithmetic as calling the HF modules
# (RMSNorm bit-identical in float32), without a module call's overhead, which at decode sizes is a
# sizeable part of each of the ~50 small ops of a step.
def _linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def _norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:  # HF's norm computes in float32 and rounds before the weight
        return module(x)
    return F.rms_norm(x, x.shape[-1:], module.weight, module.variance_epsilon)


def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):  # transformers' is F.silu too
        return mlp(x)
    return _linear(mlp.down_proj, F.silu(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))


# Rotary embeddings that are a function of the position alone (others rescale with the sequence's length)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
_ROTARY_TABLES: WeakKeyDictionary[nn.Module, tuple[torch.Tensor, torch.Tensor]] = WeakKeyDictionary()


def _rotary(emb: nn.Module, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos and sin at ``positions`` ``(1 or 3, N)`` as (N, head_dim), sin signed (see `attention`)."""
    cos, sin = emb(h, positions)
    half = sin.shape[-1] // 2
    return cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)


def _rotary_table(emb: nn.Module, h: torch.Tensor, cache: SlotCache) -> tuple[torch.Tensor, torch.Tensor]:
    """`_rotary` of every position the cache holds, computed once (again when the cache grows): a step looks
    its positions up instead of ~10 small ops. The same values: each is the same product, cos and sin."""
    table = _ROTARY_TABLES.get(emb)
    if table is None or table[0].shape[0] < cache.shape[2] or table[0].dtype != h.dtype:
        table = _ROTARY_TABLES[emb] = _rotary(emb, h, torch.arange(cache.shape[2], device=h.device)[None])
    return table


@torch.inference_mode()
def forward(model: nn.Module, cache: SlotCache, batch: Batch,
            accelerator: StepAccelerator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a batch's new tokens through ``model``, writing their keys and values into ``cache``; the layers that
    ``accelerator`` takes, and its part of attention and the head, through it. Returns the logits after each row's
    last token (B, vocab) and, for MoE models, the routed expert ids of every new token (N, moe_layers, top_k),
    int64."""
    inner = decoder(model)
    h = inner.embed_tokens(batch.tokens)
    if batch.visual is not None:  # image tokens: the vision tower's merged patches instead of the embedding
        h[batch.visual] = batch.features[0].to(h.dtype)
    if batch.rope is None and getattr(inner.rotary_emb, "rope_type", None) in STATIC_ROPE:
        cos, sin = (t.index_select(0, batch.positions)[:, None] for t in _rotary_table(inner.rotary_emb, h, cache))
    else:
        positions = batch.positions[None] if batch.rope is None else batch.rope[:, None]
        cos, sin = (t[:, None] for t in _rotary(inner.rotary_emb, h, positions))
    routed = []
    for i, layer in enumerate(inner.layers):
        if accelerator is not None and accelerator.takes_layer(layer):
            q, k, v = accelerator.before_attention(layer, h, cos, sin)
            h = accelerator.after_attention(layer, h, attend(layer.self_attn, q, k, v, cache, i, batch, accelerator))
        else:
            h = h + attention(layer.self_attn, _norm(layer.input_layernorm, h), cos, sin, cache, i, batch)
            x = _norm(layer.post_attention_layernorm, h)
            if is_moe(layer):  # HF's sparse MoE block, keeping the routed expert ids (N, top_k)
                _, weights, experts = layer.mlp.gate(x)
                h = h + layer.mlp.experts(x, experts, weights)
                routed.append(experts)
            else:
                h = h + _mlp(layer.mlp, x)
        if batch.visual is not None and i + 1 < len(batch.features):  # deepstack: vision features added early
            h[batch.visual] += batch.features[i + 1].to(h.dtype)
    h = h if batch.last is None else h[batch.last]
    logits = None if accelerator is None else accelerator.logits(h, inner.norm.weight, model.lm_head.weight)
    logits = _linear(model.lm_head, _norm(inner.norm, h)) if logits is None else logits
    return logits, torch.stack(routed, dim=1) if routed else None


@torch.no_grad()
def load_named(params: dict[str, torch.Tensor], named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy each tensor into the parameter of its HF name, checking the name and shape."""
    for name, tensor in named_tensors:
        param = params.get(name)
        if param is None:
            raise KeyError(f"update_weights got unknown parameter {name!r}; the engine holds HF names such as "
                           f"{next(iter(params))!r}")
        if param.shape != tensor.shape:
            raise ValueError(f"update_weights: {name} has shape {tuple(param.shape)} in the engine, "
                             f"got {tuple(tensor.shape)}")
        param.copy_(tensor)
