"""What the trainer computes: HF models loaded from a checkpoint directory, a value model for the
critic, and per-token logprobs of packed micro-batches. Nothing here knows about sharding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from instar.contract import ImageInputs
from instar.train.attention import attention_for, packed_rows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CHUNK_TOKENS = 512  # rows of the float32 softmax at a time: at 152k vocab 0.3 GB a tensor, two at a time


def auto_model(path: str, attn: str = "auto", causal_lm: bool = True, accelerated: bool = False,
               ) -> tuple[type, str | dict[str, str]]:
    """The transformers auto class and ``attn_implementation`` (`attention_for`) for checkpoint ``path``: a
    vision-language model is an image-text-to-text model whose vision tower keeps SDPA (its attention is not
    causal)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText
    impl = attention_for(path, attn, accelerated)
    if getattr(AutoConfig.from_pretrained(path), "vision_config", None) is None:
        return (AutoModelForCausalLM if causal_lm else AutoModel), impl
    if not causal_lm:
        raise ValueError(f"{path} is a vision-language model: instar has no critic for those (use a critic-free "
                         "estimator such as --algo.advantage.estimator grpo)")
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


class ValueModel(nn.Module):
    """The critic: an HF decoder trunk with a linear value head; ``forward`` returns one value per
    position, ``[1, N]`` for a packed row."""

    def __init__(self, trunk: nn.Module) -> None:
        super().__init__()
        self.trunk = trunk
        self.config = trunk.config
        self.value_head = nn.Linear(trunk.config.hidden_size, 1, bias=False, dtype=trunk.dtype)
        nn.init.zeros_(self.value_head.weight)  # values start at 0, so early GAE equals Monte-Carlo returns

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_kwargs: dict[str, Any] | None = None) -> torch.Tensor:
        """``attention_kwargs``: as in `forward_logits`."""
        bounds = _bounds_for(self.trunk, position_ids) if attention_kwargs is None else attention_kwargs
        hidden = self.trunk(input_ids=input_ids, position_ids=position_ids, use_cache=False, **bounds).last_hidden_state
        return self.value_head(hidden).float().sum(-1)  # not squeeze: FSDP warns on a view as module output


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of any HF model (the classes it names in ``_no_split_modules``), in
    order: the unit that FSDP shards and activation checkpointing recomputes."""
    names = {name for m in model.modules() for name in getattr(m, "_no_split_modules", None) or []}
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
    """Where the sequences of a packed row ``[1, N]`` start (``position_ids`` restart at 0), in the varlen form
    that `packed_attention` and transformers' flash-attention path both read; nothing for other attentions
    (transformers builds their mask from ``position_ids``). For ours the bounds stay on the host: it reads them
    in every layer, which on a GPU tensor would be a device sync per layer."""
    impl = str(getattr(model.config, "_attn_implementation", ""))
    if not (packed_rows(impl) or impl.startswith("flash_attention")):
        return {}
    pos = position_ids[0].cpu()
    starts = (pos == 0).nonzero().flatten()
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    if impl.startswith("flash_attention"):  # its varlen kernel takes the bounds on the device
        cu = cu.to(position_ids.device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


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
    (``logits.float() / t`` would make two), none at temperature 1 in ``compute`` already."""
    if temperature == 1.0:  # log_softmax writes a new tensor: no copy to protect the logits from
        return torch.log_softmax(logits, dim=-1, dtype=compute)
    return torch.log_softmax(logits.to(compute, copy=True).div_(temperature), dim=-1)
