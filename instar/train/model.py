"""What the trainer computes: HF models loaded from a checkpoint directory, a value model for the
critic, and per-token logprobs of packed micro-batches. Nothing here knows about sharding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from instar.contract import ImageInputs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PACKED = "instar_packed"
CHUNK_TOKENS = 512  # rows of the float32 softmax at a time: at 152k vocab 0.3 GB a tensor, two at a time


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

    def kwargs(self) -> dict[str, Any]:
        """The attention keyword argument that carries it through the model to `packed_attention`."""
        return {"instar_segments": self}

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
    if instar_segments is not None and instar_segments.shared:
        return _shared_attention(query, key, value, instar_segments, kw), None
    if instar_segments is not None:
        bounds = instar_segments.bounds
    else:
        bounds = (0, query.shape[2]) if cu_seq_lens_q is None else tuple(cu_seq_lens_q.tolist())
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    kw["is_causal"] = True
    if len(lengths) > 1 and len(lengths) * max(lengths) ** 2 <= 2 * sum(n * n for n in lengths):
        slots, width = _padded_slots(bounds), max(lengths)
        rows = len(lengths) * width
        # whole tokens (all heads) move as one row each: gathering a head's 32 floats at a time from the
        # [heads, N, d] view, with an accumulating scatter backward, took ~20 of a demo-sized update's ~330 ms
        q, k, v = (_ToPadded.apply(t[0].transpose(0, 1).reshape(t.shape[2], -1), slots, rows)
                   .view(len(lengths), width, t.shape[1], t.shape[3]).transpose(1, 2) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, **kw).transpose(1, 2).reshape(rows, -1)
        return _FromPadded.apply(out, slots).view(1, query.shape[2], query.shape[1], -1), None
    parts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], **kw)
             for a, b in zip(bounds, bounds[1:])]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=4)  # every layer of a forward (and its recompute) asks for the same bounds
def _padded_slots(bounds: tuple[int, ...]) -> torch.Tensor:
    """Where each of the row's tokens goes in the right-padded ``[B * T]`` batch of its sequences."""
    starts, lengths = torch.tensor(bounds[:-1]), torch.tensor(bounds[1:]) - torch.tensor(bounds[:-1])
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return sequence * int(lengths.max()) + torch.arange(bounds[-1]) - starts[sequence]


class _ToPadded(torch.autograd.Function):
    """``x [N, F]`` into a zero ``[rows, F]`` at the distinct ``slots``; the gradient gathers them back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, slots: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(slots)
        return x.new_zeros(rows, x.shape[1]).index_copy_(0, slots.to(x.device), x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (slots,) = ctx.saved_tensors
        return grad.index_select(0, slots.to(grad.device)), None, None


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


def _shared_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: Segments,
                      kw: dict[str, Any]) -> torch.Tensor:
    """`packed_attention` of a prefix-tree row: each segment's queries see its context segments whole and
    its own keys causally. The segments are laid out as one right-padded ``[S, heads, Tq, d]`` batch of
    queries against ``[S, heads, Tk, d]`` keys (context, then own) under one mask; a context's keys are
    gathered into every segment that sees it, so their gradients sum over those segments. When padding
    would more than double the work, one call per segment instead."""
    plan = _shared_plan(segments)
    if isinstance(plan, list):
        parts = [F.scaled_dot_product_attention(query[:, :, a:z], *(t[:, :, keys] for t in (key, value)),
                                                attn_mask=mask.to(query.device), **kw)
                 for a, z, keys, mask in plan]
        return torch.cat(parts, dim=2).transpose(1, 2)
    q_index, k_index, mask, real = (t.to(query.device) for t in plan)
    out = F.scaled_dot_product_attention(*(_gather_tokens(t, i) for t, i in
                                           ((query, q_index), (key, k_index), (value, k_index))), attn_mask=mask, **kw)
    out = out.transpose(1, 2).reshape(q_index.numel(), -1)  # [S, Tq, heads, d] -> the row's [1, N, heads, d]
    return _FromPadded.apply(out, real).view(1, query.shape[2], query.shape[1], -1)


def _gather_tokens(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[S, heads, T, d]`` from a packed ``[1, heads, N, d]`` at the row positions ``index [S, T]``, whole
    tokens at a time (see `packed_attention`); a position gathered twice gets the sum of both gradients."""
    rows = t[0].transpose(0, 1).reshape(t.shape[2], -1).index_select(0, index.reshape(-1))
    return rows.view(*index.shape, t.shape[1], t.shape[3]).transpose(1, 2)


@functools.lru_cache(maxsize=4)  # every layer of a forward (and its recompute) asks for the same row
def _shared_plan(segments: Segments) -> tuple[torch.Tensor, ...] | list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """For `_shared_attention`: ``[S, Tq]`` query positions, ``[S, Tk]`` key positions (context first), the
    ``[S, 1, Tq, Tk]`` mask and where the row's queries are in the flattened ``[S * Tq]`` (padding points at
    position 0; its outputs are dropped). Or, per segment, its bounds, key positions and ``[Tq, Tk]`` mask."""
    b = segments.bounds
    own = [list(range(b[k], b[k + 1])) for k in range(len(b) - 1)]
    seen = [[p for c in ctx for p in own[c]] for ctx in segments.context]
    tq, tk = max(map(len, own)), max(len(s) + len(o) for s, o in zip(seen, own))
    causal = torch.ones(tq, tk, dtype=torch.bool).tril()  # own keys: query i sees own keys 0..i
    if len(own) * tq * tk > 2 * sum(len(o) * (len(s) + len(o)) for s, o in zip(seen, own)):
        return [(o[0], o[-1] + 1, torch.tensor(s + o), torch.cat([torch.ones(len(o), len(s), dtype=torch.bool),
                                                                  causal[:len(o), :len(o)]], 1))
                for s, o in zip(seen, own)]
    q_index = torch.zeros(len(own), tq, dtype=torch.long)
    k_index = torch.zeros(len(own), tk, dtype=torch.long)
    mask = torch.zeros(len(own), 1, tq, tk, dtype=torch.bool)
    for k, (s, o) in enumerate(zip(seen, own)):
        q_index[k, :len(o)] = torch.tensor(o)
        k_index[k, :len(s) + len(o)] = torch.tensor(s + o)
        mask[k, 0, :, :len(s)] = True
        mask[k, 0, :, len(s):] = causal[:, :tk - len(s)]  # padded queries see what the real ones before them see
    valid = torch.arange(tq)[None] < torch.tensor([len(o) for o in own])[:, None]
    return q_index, k_index, mask, valid.reshape(-1).nonzero()[:, 0]


def attention_for(path: str, choice: str = "auto") -> str:
    """The transformers ``attn_implementation`` for ``--fsdp.attn_implementation`` (see its help):
    "packed" is `packed_attention`, registered with transformers; "flex_attention" is transformers' own,
    which finds the packed row's sequences in the restarting ``position_ids`` and builds one
    document-causal BlockMask per forward, shared by all layers. "auto" picks flex_attention on a GPU
    and, on CPU (where FlexAttention has no backward), packed unless the model uses a sliding window,
    then sdpa. A kernel that cannot run here is an error that names the fix."""
    from transformers import AttentionInterface, AutoConfig
    # no mask function: transformers then builds none; eager under --fsdp.compile (see `compiled.compile_layers`)
    AttentionInterface.register(PACKED, torch.compiler.disable(packed_attention))
    gpu = torch.cuda.is_available()
    if choice == "auto":
        if gpu:
            return "flex_attention"
        return "sdpa" if getattr(AutoConfig.from_pretrained(path), "sliding_window", None) else PACKED
    if choice == "packed":
        return PACKED
    if choice == "flex_attention" and not gpu:
        raise ValueError("--fsdp.attn_implementation flex_attention needs a CUDA GPU (PyTorch's FlexAttention "
                         "has no backward on CPU); use packed (or auto) on CPU")
    if choice == "flash_attention_2":
        import importlib.util
        if importlib.util.find_spec("flash_attn") is None or not gpu:
            raise ValueError("--fsdp.attn_implementation flash_attention_2 needs a CUDA GPU and the flash-attn "
                             "package (pip install flash-attn); use packed (or auto) otherwise")
    return choice


def auto_model(path: str, attn: str = "auto", causal_lm: bool = True) -> tuple[type, str | dict[str, str]]:
    """The transformers auto class and ``attn_implementation`` for checkpoint ``path``: a vision-language
    model is an image-text-to-text model whose vision tower keeps SDPA (its attention is not causal)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText
    impl = attention_for(path, attn)
    if getattr(AutoConfig.from_pretrained(path), "vision_config", None) is None:
        return (AutoModelForCausalLM if causal_lm else AutoModel), impl
    if not causal_lm:
        raise ValueError(f"{path} is a vision-language model: instar has no critic for those (use a critic-free "
                         "estimator such as --algo.advantage_estimator grpo)")
    return AutoModelForImageTextToText, {"": impl, "text_config": impl, "vision_config": "sdpa"}


def load_model(path: str, dtype: str = "float32", backend: str = "hf", attn: str = "auto") -> nn.Module:
    """A causal LM from an HF checkpoint directory, in train mode. ``backend="automodel"`` loads it
    with NVIDIA NeMo AutoModel (GPU, optional) instead of transformers; ``attn``: `attention_for`."""
    if backend == "automodel":
        try:
            from nemo_automodel import NeMoAutoModelForCausalLM
        except ImportError as e:
            raise ImportError("--actor.model_backend automodel needs NVIDIA NeMo AutoModel (pip install "
                              "nemo_automodel) on a GPU machine; use --actor.model_backend hf otherwise") from e
        model = NeMoAutoModelForCausalLM.from_pretrained(path, torch_dtype=DTYPES[dtype])
    elif backend == "hf":
        auto, impl = auto_model(path, attn)
        model = auto.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=impl)
    else:
        raise ValueError(f"unknown model backend {backend!r}; use 'hf' or 'automodel'")
    model.config.use_cache = False  # training never decodes; a KV cache would only cost memory
    return model.train()


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


class ValueModel(nn.Module):
    """The critic: an HF decoder trunk with a linear value head; ``forward`` returns one value per
    position, ``[1, N]`` for a packed row."""

    def __init__(self, trunk: nn.Module) -> None:
        super().__init__()
        self.trunk = trunk
        self.value_head = nn.Linear(trunk.config.hidden_size, 1, bias=False, dtype=trunk.dtype)
        nn.init.zeros_(self.value_head.weight)  # values start at 0, so early GAE equals Monte-Carlo returns

    @property
    def config(self) -> Any:
        return self.trunk.config

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_kwargs: dict[str, Any] | None = None) -> torch.Tensor:
        """``attention_kwargs``: as in `forward_logits`."""
        bounds = _bounds_for(self.trunk, position_ids) if attention_kwargs is None else attention_kwargs
        hidden = self.trunk(input_ids=input_ids, position_ids=position_ids, use_cache=False, **bounds).last_hidden_state
        return self.value_head(hidden).float().sum(-1)  # not squeeze: FSDP warns on a view as module output


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of any HF model (the classes it names in ``_no_split_modules``), in
    order: the unit that FSDP shards and activation checkpointing recomputes."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    # by class, or by a base class: FSDP2 swaps in a subclass (FSDPQwen3DecoderLayer)
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise ValueError(f"found no decoder layers in {type(model).__name__} (no _no_split_modules classes); "
                         "only HF transformers models are supported")
    return layers


def enable_activation_checkpointing(model: nn.Module) -> None:
    """HF's own per-layer recompute: parameter names stay unchanged (a wrapper module would add a
    prefix that checkpoints and the weight sync would then have to strip)."""
    hf = [m for m in model.modules() if hasattr(m, "gradient_checkpointing_enable")]
    hf[0].gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def packing_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """Where the sequences of a packed row ``[1, N]`` start (``position_ids`` restart at 0), in the
    varlen form that `packed_attention` and transformers' flash-attention path both read. The bounds
    are on the host: `packed_attention` reads them in every layer, which on a GPU tensor would be a
    device sync per layer."""
    pos = position_ids[0].cpu()
    starts = (pos == 0).nonzero().flatten()
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def forward_logits(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   positions: torch.Tensor | None = None, attention_kwargs: dict[str, Any] | None = None,
                   images: ImageInputs | None = None, rope: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of a packed row ``[1, N]`` whose sequences are separated by ``position_ids`` restarting
    at 0, at every position or only at ``positions`` (``[1, M, vocab]``: the head and the float32
    softmax then cost M rows, not N). Attention stays within each sequence: `packed_attention` (or a
    varlen kernel) reads the sequence bounds; any other implementation gets a block-diagonal mask
    from transformers, built from the same ``position_ids``. ``attention_kwargs`` replace those bounds when
    the caller knows better (a slice of a row whose attention spans the whole row). A vision-language
    model also takes the row's ``images`` and multimodal rotary positions ``rope`` (3, 1, N)."""
    bounds = _bounds_for(model, position_ids) if attention_kwargs is None else attention_kwargs
    extra: dict[str, Any] = {"position_ids": position_ids}
    if rope is not None:  # text positions first: transformers reads the sequence bounds from them
        extra["position_ids"] = torch.cat([position_ids[None], rope.to(position_ids.device)])
    if images is not None:
        extra.update(pixel_values=images.pixel_values.to(input_ids.device, model.dtype),
                     image_grid_thw=images.grid_thw.to(input_ids.device))
    return model(input_ids=input_ids, use_cache=False, logits_to_keep=0 if positions is None else positions,
                 **extra, **bounds).logits


def _bounds_for(model: nn.Module, position_ids: torch.Tensor) -> dict[str, Any]:
    impl = str(getattr(model.config, "_attn_implementation", ""))
    if impl == PACKED:
        return packing_kwargs(position_ids)
    if impl.startswith("flash_attention"):  # its varlen kernel takes the bounds on the device
        return {k: v.to(position_ids.device) if torch.is_tensor(v) else v
                for k, v in packing_kwargs(position_ids).items()}
    return {}


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                        with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per position t of a plain row ``[1, N]``: logprob of token t+1 under the logits at t (and the entropy
    of that distribution). The last position (no next token) and sequence ends are garbage the caller drops."""
    return token_logprobs(logits, torch.roll(input_ids[0], -1), temperature, with_entropy)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, with_entropy: bool = True,
                   chunk_tokens: int = CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits [1, M, vocab]``: the logprob of ``targets [M]`` (and the entropy) under ``softmax(logits /
    temperature)`` in float32, ``chunk_tokens`` rows at a time forward and backward (`ChunkedLogprobs`): no
    float32 ``[M, vocab]`` tensor exists besides the logits."""
    # squeeze, not [0]: the gradient of a view is a view, of a selection a new tokens x vocab tensor
    return ChunkedLogprobs.apply(logits.squeeze(0), targets, temperature, with_entropy, chunk_tokens)


class ChunkedLogprobs(torch.autograd.Function):
    """``(logits [M, vocab], target [M]) -> (logprob of target [M], entropy [M] or None)`` of
    ``softmax(logits / temperature)`` in float32 (float64 logits stay float64), ``chunk`` rows at a time.

    Why: the plain autograd graph keeps float32 log-probs and probabilities of every row for backward
    and builds several more of that size in it: at 8k tokens x 152k vocab each is 5 GB. Here forward
    keeps only the logits (which exist anyway) and the entropies, and backward recomputes each chunk's
    softmax to write that chunk's gradient: d logp_y/dz = onehot(y) - p, dH/dz = -p (log p + H), with
    z = logits / temperature (so both are divided by the temperature)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, temperature: float, with_entropy: bool,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        compute = torch.promote_types(logits.dtype, torch.float32)
        token_logp = torch.empty(logits.shape[0], dtype=compute, device=logits.device)
        entropy = torch.empty_like(token_logp) if with_entropy else None
        for a in range(0, logits.shape[0], chunk):
            rows = slice(a, a + chunk)
            logp = _log_softmax(logits[rows], temperature, compute)
            token_logp[rows] = logp.gather(-1, target[rows, None]).squeeze(-1)
            if entropy is not None:
                entropy[rows] = -(logp.exp().mul_(logp)).sum(-1)
            del logp  # before the next chunk allocates its own
        ctx.set_materialize_grads(False)  # an unused output (often the entropy) gets None: skip its term
        ctx.save_for_backward(logits, target, entropy)
        ctx.temperature, ctx.chunk, ctx.compute = temperature, chunk, compute
        return token_logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> tuple:
        logits, target, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None
        grad = torch.empty_like(logits)
        for a in range(0, logits.shape[0], ctx.chunk):
            rows = slice(a, a + ctx.chunk)
            logp = _log_softmax(logits[rows], ctx.temperature, ctx.compute)
            p = logp.exp()
            if grad_entropy is None:  # - p g_y
                chunk_grad = p.mul_(-grad_logp[rows, None])
            else:  # - p (log p + H) g_H (written over log p), then - p g_y
                chunk_grad = logp.add_(entropy[rows, None]).mul_(p).mul_(-grad_entropy[rows, None])
                if grad_logp is not None:
                    chunk_grad.sub_(p.mul_(grad_logp[rows, None]))
            if grad_logp is not None:  # + onehot(y) g_y
                chunk_grad.scatter_add_(-1, target[rows, None], grad_logp[rows, None])
            grad[rows] = chunk_grad.div_(ctx.temperature)
            del logp, p, chunk_grad  # before the next chunk allocates its own
        return grad, None, None, None, None


def _log_softmax(logits: torch.Tensor, temperature: float, compute: torch.dtype) -> torch.Tensor:
    """Log-softmax of ``logits / temperature`` in ``compute`` with one temporary of the chunk's size
    (``logits.float() / t`` would make two)."""
    return torch.log_softmax(logits.to(compute, copy=True).div_(temperature), dim=-1)
