"""The trainer's linear layers through oneDNN on CPUs where PyTorch's BLAS takes a slow path.

Why: PyTorch's CPU wheels run a float32 matmul through MKL, which on AMD CPUs does not use its AVX-512
kernels; oneDNN, bundled in the same wheels (bf16 matmuls already go through it), does. On an AMD EPYC
core at the trainer's shapes that is ~90 against ~200 GFLOP/s, and matmuls are most of a CPU update.
`--fsdp.cpu_matmul auto` takes oneDNN on AMD CPUs and the BLAS elsewhere: a rule, not a timing, so that
every run on a machine computes alike (a replayed step reproduces its grad norm to the last bit).
``onednn`` and ``blas`` force one. A swapped layer computes the same products (the sums in another
order); it falls back to `F.linear` for anything but float32 plain tensors on the CPU (DTensors under
tensor parallelism, bf16, GPUs) and for empty inputs, so swapping is always safe. The weight gradient runs on
the BLAS, which reads transposed operands in place: at its shapes (the inner dimension is every token) it
is as fast there, and oneDNN would first copy the transposed output gradient (~3% of a demo-sized update).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

CpuMatmul = Literal["auto", "onednn", "blas"]


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` by oneDNN. A transposed ``weight`` is read in place; a transposed ``x`` is
    copied first."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _gradients(ctx: Any, grad: torch.Tensor, linear: Callable) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    x, weight = ctx.saved_tensors
    grad_x = linear(grad, weight.t()) if ctx.needs_input_grad[0] else None  # grad @ weight
    # the weight gradient on the BLAS (see the module's doc)
    grad_w = (torch.mm(grad.reshape(-1, grad.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
              if ctx.needs_input_grad[1] else None)
    return grad_x, grad_w


class _OneDNNLinear(torch.autograd.Function):
    """`F.linear` without bias whose forward and input gradient run in oneDNN (eager)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return onednn_linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return _gradients(ctx, grad, onednn_linear)


# The same as an operator of its own, for torch.compile (`--fsdp.compile`): traced through, inductor has no
# training lowering for oneDNN's linear; an operator stays one opaque call with the elementwise work around it
# fused. Eager, its dispatch costs ~5% of a demo-sized update more than the autograd function's.
@torch.library.custom_op("instar::onednn_linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return onednn_linear(x, weight)


@_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_linear_op.register_autograd(lambda ctx, grad: _gradients(ctx, grad, _linear_op),
                             setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` (same parameters and names) whose products run in oneDNN when it can take them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # no rows (a context-parallel rank's share can be empty): oneDNN refuses an empty product
        if (x.device.type != "cpu" or x.dtype != torch.float32 or self.weight.dtype != torch.float32
                or isinstance(x, DTensor) or isinstance(self.weight, DTensor) or not x.numel()):
            return F.linear(x, self.weight, self.bias)
        out = (_linear_op(x, self.weight) if torch.compiler.is_compiling() else _OneDNNLinear.apply(x, self.weight))
        return out if self.bias is None else out + self.bias


def amd_cpu() -> bool:
    """Whether this is an AMD x86 CPU (Linux's /proc/cpuinfo names the vendor)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "AuthenticAMD" in f.read(4096)
    except OSError:
        return False


def uses_onednn(choice: CpuMatmul) -> bool:
    """Whether ``choice`` means oneDNN on this machine (for auto: an AMD CPU, in a build with oneDNN)."""
    if choice == "onednn" and not torch.backends.mkldnn.is_available():
        raise ValueError("--fsdp.cpu_matmul onednn: this PyTorch build has no oneDNN; use auto or blas")
    return choice == "onednn" or (choice == "auto" and torch.backends.mkldnn.is_available() and amd_cpu())


def use_cpu_matmul(model: nn.Module, choice: CpuMatmul = "auto") -> int:
    """Turn ``model``'s `nn.Linear` layers into `OneDNNLinear` in place when ``choice`` (`uses_onednn`) says so;
    returns how many were turned."""
    if not uses_onednn(choice):
        return 0
    turned = 0
    for module in model.modules():
        if type(module) is nn.Linear:  # a subclass (a LoRA layer, FSDP's wrapper) keeps its own forward
            module.__class__ = OneDNNLinear
            turned += 1
    return turned
