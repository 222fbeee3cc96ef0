"""`--fsdp.compile`: the trainer's dense decoder layers through torch.compile, one graph for every micro-batch.

Why: at small widths a layer is dozens of elementwise passes over memory (norms, RoPE, SwiGLU, residuals, and
their backward) between the matmuls; fused, an update costs ~10% less on CPU. The token dimension is dynamic,
and nothing in the graph may guard on it: inductor's CPU code picks how it accumulates a float sum by the sum's
length (above 4096 terms, in chunks), so a norm's weight gradient, a sum over the micro-batch's tokens, made
a new graph each time a micro-batch crossed 1024, 2048 or 4096 tokens (1-5 s each, mid-run). The norms of the
compiled layers therefore sum their weight gradient in an operator of their own (`_token_sum`), which inductor
calls but does not generate.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from instar.train.expert_parallel import experts_modules
from instar.train.model import decoder_layers


def compile_layers(model: nn.Module) -> None:
    """Each dense decoder layer's forward through torch.compile, with dynamic shapes. The packed attention
    stays eager (registered as such): it plans per row layout in Python, which a graph would have to recompile
    for. MoE layers and vision blocks stay eager (data-dependent routing, per-image Python). Hooks (FSDP2,
    the trainer's thread picking) run around the compiled forward. Forwards without gradients (logprob
    passes, zero-advantage rows) run eager: one graph, not one per grad mode."""
    import torch._inductor.config as inductor
    inductor.cpp.dynamic_threads = True  # kernels follow torch.set_num_threads: ranks lend cores mid-update
    for layer in decoder_layers(model):
        if hasattr(layer, "self_attn") and not experts_modules(layer):
            for module in layer.modules():
                if _llama_norm(module):
                    module.forward = MethodType(_norm_forward, module)
            layer.forward = _with_grad_compiled(layer.forward)


def _with_grad_compiled(eager: Callable[..., Any]) -> Callable[..., Any]:
    # Dynamo guards on its global state, the thread count included: a rank that lends cores between
    # layers would recompile (~1.5 s each) for every new count. The kernels read the count as they run
    # (dynamic_threads), and the rest of that state (grad mode aside: hence eager without gradients,
    # autocast, deterministic algorithms, default dtype) is fixed for a run, so that guard is dropped.
    compiled = torch.compile(eager, dynamic=True, options={"guard_filter_fn": lambda entries: [
        e.guard_type != "GLOBAL_STATE" for e in entries]})

    def forward(*args: Any, **kwargs: Any) -> Any:
        return (compiled if torch.is_grad_enabled() else eager)(*args, **kwargs)
    forward.compiled = compiled
    return forward


def _llama_norm(module: nn.Module) -> bool:
    """An RMSNorm whose forward is Llama's (transformers copies it into Qwen2/3 and their MoE and VL text
    models, Mistral, ...): ``weight * x / rms(x)``, not Gemma's ``(1 + weight)``."""
    code, llama = (getattr(type(module).forward, "__code__", None), LlamaRMSNorm.forward.__code__)
    return code is not None and (code.co_code, code.co_names, code.co_consts) == (
        llama.co_code, llama.co_names, llama.co_consts)


def _norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _RMSNorm.apply(x, self.weight, self.variance_epsilon)


class _RMSNorm(torch.autograd.Function):
    """Llama's RMSNorm, in float32 and rounded to the input's dtype before the weight as there, with its
    gradients written out: the weight's sums over the tokens in `_token_sum` (see the module's doc)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, scale)
        return weight * (xf * scale).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, scale = ctx.saved_tensors
        normed = x.float() * scale
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = _token_sum((grad * normed.to(x.dtype)).reshape(-1, grad.shape[-1])).to(weight.dtype)
        grad_n = (grad * weight).float()  # d loss / d normed
        grad_x = scale * (grad_n - normed * (grad_n * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None


@torch.library.custom_op("instar::token_sum", mutates_args=())
def _token_sum(x: torch.Tensor) -> torch.Tensor:
    """``x [tokens, width]`` summed over its tokens."""
    return x.sum(0)


@_token_sum.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[1:])
