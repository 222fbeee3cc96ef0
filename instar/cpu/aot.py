"""The embedded engine's dense decoder layers as ahead-of-time compiled kernels (part of `cpu.engine`).

At the embedded engine's sizes a decode step is dozens of small eager ops per layer, each paying the dispatcher
and a pass over memory. Exported once per model shape and compiled by AOTInductor, the part of a layer before
attention (norm, q/k/v projections, q/k norms, RoPE) and the part after it (output projection, residual, norm,
SwiGLU MLP, residual) each become one call of fused C++ loops around the same matmuls, as do the final norm and the
LM head. The token count is a dynamic dimension, so one build serves prefill and decode steps of any size; the
weights are inputs, so weight updates and a drain's second model need no rebuild. A build takes ~20 s and a C++
compiler; it is cached on disk (`build.build_key`: this module's source, the compiler, the thread count, which
is baked into the kernels' loops, the shapes). The arithmetic is the eager layer's up to float rounding (fused
loops sum in another order).
"""

from __future__ import annotations

import inspect
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import nn

from instar.cpu.build import build_key, cache_dir, compiler_identity, load_or_build


class _Before(nn.Module):
    """Input norm, q/k/v projections, q/k norms and RoPE (sin signed as in `kv_model.forward`)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps

    def forward(self, h: torch.Tensor, norm: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, v_w: torch.Tensor,
                q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        n, d = h.shape[0], self.head_dim
        x = F.rms_norm(h, h.shape[-1:], norm, self.eps)
        q = F.rms_norm(F.linear(x, q_w).view(n, self.heads, d), (d,), q_norm, self.eps)
        k = F.rms_norm(F.linear(x, k_w).view(n, self.kv_heads, d), (d,), k_norm, self.eps)
        v = F.linear(x, v_w).view(n, self.kv_heads, d)
        return q * cos + q.roll(d // 2, -1) * sin, k * cos + k.roll(d // 2, -1) * sin, v


class _After(nn.Module):
    """Output projection and residual, then the post-attention norm and SwiGLU MLP and residual."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, h: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, norm: torch.Tensor, gate_w: torch.Tensor,
                up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
        h = h + F.linear(o, o_w)
        x = F.rms_norm(h, h.shape[-1:], norm, self.eps)
        return h + F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


class _Head(nn.Module):
    """The final norm and the LM head: logits of each row's last hidden state."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, h: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        return F.linear(F.rms_norm(h, h.shape[-1:], norm, self.eps), lm_head)


def compilable(layer: nn.Module) -> bool:
    """A dense Qwen3 layer without projection biases and with the SiLU MLP: what `_Before` / `_After` compute."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *(getattr(mlp, n, None) for n in
                                                                     ("gate_proj", "up_proj", "down_proj")))
    return (all(m is not None and getattr(m, "bias", None) is None for m in linears)
            and type(getattr(mlp, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"))


def _before_weights(layer: nn.Module) -> tuple[torch.Tensor, ...]:
    attn = layer.self_attn
    return (layer.input_layernorm.weight, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
            attn.q_norm.weight, attn.k_norm.weight)


def _after_weights(layer: nn.Module) -> tuple[torch.Tensor, ...]:
    mlp = layer.mlp
    return (layer.self_attn.o_proj.weight, layer.post_attention_layernorm.weight, mlp.gate_proj.weight,
            mlp.up_proj.weight, mlp.down_proj.weight)


class AotLayers:
    """The two compiled halves of every dense layer of a model (all share one build) and its head. They are called
    through their loaders' ``boxed_run`` (a flat list of tensors in, one out): the packages' own ``__call__``
    parses the call's tree specs from JSON every time: ~25 us a call, nine calls a decode step, a tenth of one at
    the demo's size."""

    def __init__(self, before: Any, after: Any, head: Any) -> None:
        self.before, self.after, self.final = before.loader, after.loader, head.loader
        # each layer's weights, looked up once: a module's attribute lookups cost a few us each, ~25 a step.
        # Weight updates copy into the same tensors; a drained model is other layers (other keys).
        self._weights: WeakKeyDictionary[nn.Module, tuple[tuple, tuple]] = WeakKeyDictionary()

    def weights(self, layer: nn.Module) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        if (found := self._weights.get(layer)) is None:
            found = self._weights[layer] = (_before_weights(layer), _after_weights(layer))
        return found

    @classmethod
    def load_or_build(cls, layer: nn.Module, eps: float, head: tuple[torch.Tensor, torch.Tensor]) -> AotLayers | None:
        """Compile (or load the cached build of) the halves for layers shaped like ``layer``, and the final norm
        and LM head for ``head``'s weights (norm, lm_head); each checked against its eager module on random
        inputs. None (one printed line) where a part cannot be built."""
        attn = layer.self_attn
        d, (width, hidden) = attn.head_dim, attn.q_proj.weight.shape
        heads, kv_heads = width // d, attn.k_proj.weight.shape[0] // d
        dtype = attn.q_proj.weight.dtype
        cxx = torch._inductor.cpp_builder.get_cpp_compiler()
        key = build_key(inspect.getsource(sys.modules[__name__]), cxx, compiler_identity(cxx), torch.get_num_threads(),
                        heads, kv_heads, d, hidden, layer.mlp.gate_proj.weight.shape[0], eps, str(dtype),
                        head[1].shape[0])
        tokens = torch.export.Dim("tokens", min=2, max=1 << 20)  # exporting specialises sizes 0 and 1
        rows = lambda *widths: [torch.randn(5, *w, dtype=dtype) for w in widths]  # noqa: E731
        act, weight = {0: tokens}, None  # the activations' first dimension varies, the weights' shapes do not
        parts = {"before": (_Before(heads, kv_heads, d, eps),
                            (*rows((hidden,)), *_before_weights(layer), *rows((1, d), (1, d))),
                            [act, *[weight] * 6, act, act]),
                 "after": (_After(eps), (*rows((hidden,), (width,)), *_after_weights(layer)),
                           [act, act, *[weight] * 5]),
                 "head": (_Head(eps), (*rows((hidden,)), *head), [act, weight, weight])}
        loaded = []
        for name, (module, example, dynamic) in parts.items():
            example = tuple(t.detach() for t in example)
            package = load_or_build(f"the engine's compiled layers ({name})", cache_dir() / f"{key}-{name}.pt2",
                                    lambda path, m=module, e=example, s=dynamic: _build(m, e, s, path),
                                    lambda path: torch._inductor.aoti_load_package(str(path)),
                                    lambda package, m=module, e=example: _check(package, m, e))
            if package is None:
                return None
            loaded.append(package)
        return cls(*loaded)

    def before_attention(self, layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """Rotated q (N, heads, d), rotated k and v (N, kv_heads, d) of the packed hidden states ``h``."""
        if h.shape[0] == 1:  # the build's token dimension starts at 2: the token twice, one result kept
            return tuple(t[:1] for t in self.before_attention(layer, _twice(h), _twice(cos), _twice(sin)))
        return tuple(self.before.boxed_run([h.contiguous(), *self.weights(layer)[0], cos.contiguous(),
                                            sin.contiguous()]))

    def logits(self, h: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head of the rows ``h`` (B, hidden): (B, vocab). One call instead of the norm's
        half-dozen eager ops and the product: at the demo's sizes ~200 -> ~100 us a decode step."""
        if h.shape[0] == 1:
            return self.logits(_twice(h), norm, lm_head)[:1]
        return self.final.boxed_run([h.contiguous(), norm, lm_head])[0]

    def after_attention(self, layer: nn.Module, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input ``h`` and attention's output ``o`` (N, heads * d)."""
        if h.shape[0] == 1:
            return self.after_attention(layer, _twice(h), _twice(o))[:1]
        return self.after.boxed_run([h.contiguous(), o.contiguous(), *self.weights(layer)[1]])[0]


def _twice(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t])


def _build(module: nn.Module, example: tuple[torch.Tensor, ...], dynamic: list, path: Path) -> None:
    with warnings.catch_warnings(), tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecation notices, from inside
        program = torch.export.export(module, example, dynamic_shapes=dynamic)
        built = torch._inductor.aoti_compile_and_package(program, package_path=f"{tmp}/{path.name}")
        os.replace(built, path)  # atomic: engines may build at once


def _check(package: Any, module: nn.Module, example: tuple[torch.Tensor, ...]) -> None:
    """The compiled part against its eager module on ``example`` (random activations; raises on a mismatch)."""
    with torch.inference_mode():
        want, got = module(*example), package.loader.boxed_run(list(example))
        for g, w in zip(got, want if isinstance(want, tuple) else (want,), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
