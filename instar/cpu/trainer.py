"""The trainer's side of the CPU accelerator: registered as the trainer attention "cpu" (`REGISTERED`), which
attends through the C kernel (`cpu.attention`) and `prepare`s each model that uses it:

- **oneDNN linears** (--cpu.matmul): PyTorch's CPU wheels run a float32 matmul through MKL, which on AMD CPUs
  does not use its AVX-512 kernels; oneDNN, bundled in the same wheels, does (~90 against ~200 GFLOP/s a core on
  an AMD EPYC at the trainer's shapes). auto takes oneDNN on AMD CPUs and the BLAS elsewhere: a rule, not a
  timing, so every run on a machine computes alike. A swapped layer computes the same products (summed in another
  order) and falls back to `F.linear` for anything but float32 plain tensors on the CPU. Its weight gradient runs
  on the BLAS, which reads transposed operands in place (oneDNN would first copy the transposed output gradient).
- **Compiled layers' CPU settings** (with --fsdp.compile): inductor's kernels follow `torch.set_num_threads` (a
  rank lends cores mid-update), and the norms sum their weight gradient in an operator of their own
  (`_token_sum`), which inductor calls but does not generate: inductor's CPU code picks how it accumulates a
  float sum by its length (above 4096 terms, in chunks), so a norm's weight gradient, a sum over the
  micro-batch's tokens, made a new graph each time a micro-batch crossed 1024, 2048 or 4096 tokens (1-5 s each).
- **malloc** (`keep_freed_memory`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from instar.config import CpuConfig
from instar.cpu.attention import attention
from instar.train.attention import Registered
from instar.train.model import decoder_layers


def prepare(model: nn.Module, settings: CpuConfig) -> None:
    """Everything but attention that the accelerator does to a trainer's ``model`` (after `parallelize`)."""
    keep_freed_memory()
    use_cpu_matmul(model, settings.matmul)
    compiled = [layer for layer in decoder_layers(model) if hasattr(layer.forward, "compiled")]
    if compiled:
        import torch._inductor.config as inductor
        inductor.cpp.dynamic_threads = True  # kernels follow torch.set_num_threads: ranks lend cores mid-update
        for module in (m for layer in compiled for m in layer.modules() if _llama_norm(m)):
            module.forward = MethodType(_norm_forward, module)


REGISTERED = Registered(attention, prepare)


def keep_freed_memory() -> bool:
    """Have glibc keep the large blocks this process frees for its next allocations instead of handing them back to
    the OS. A CPU training step allocates and frees hundreds of megabytes of activations; by default glibc unmaps
    blocks over its (moving) threshold and trims the heap's free top, so the next step takes the same memory back
    one zeroed 4 KiB page fault at a time (1-5k faults and 2-10 ms of kernel time a step at the demo's size). False
    where the C library is not glibc (nothing changes there)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc's malloc.h
    # 32 MiB is the most glibc takes for the mmap threshold (larger blocks are still mapped apart).
    settings = ((m_mmap_threshold, 32 << 20), (m_trim_threshold, 1 << 30), (m_top_pad, 64 << 20))
    return all(libc.mallopt(option, value) == 1 for option, value in settings)


# ---- oneDNN linears ---------------------------------------------------------------------------------------------

def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` by oneDNN. A transposed ``weight`` is read in place; a transposed ``x`` is copied."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _gradients(ctx: Any, grad: torch.Tensor, linear: Callable) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    x, weight = ctx.saved_tensors
    grad_x = linear(grad, weight.t()) if ctx.needs_input_grad[0] else None  # grad @ weight
    grad_w = (torch.mm(grad.reshape(-1, grad.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
              if ctx.needs_input_grad[1] else None)  # on the BLAS (see the module's doc)
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


# The same as an operator of its own, for torch.compile (--fsdp.compile): traced through, inductor has no training
# lowering for oneDNN's linear; an operator stays one opaque call with the elementwise work around it fused.
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
        out = _linear_op(x, self.weight) if torch.compiler.is_compiling() else _OneDNNLinear.apply(x, self.weight)
        return out if self.bias is None else out + self.bias


def amd_cpu() -> bool:
    """Whether this is an AMD x86 CPU (Linux's /proc/cpuinfo names the vendor)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "AuthenticAMD" in f.read(4096)
    except OSError:
        return False


def uses_onednn(choice: str) -> bool:
    """Whether ``choice`` (--cpu.matmul) means oneDNN on this machine (auto: an AMD CPU, in a build with oneDNN)."""
    if choice == "onednn" and not torch.backends.mkldnn.is_available():
        raise ValueError("--cpu.matmul onednn: this PyTorch build has no oneDNN; use auto or blas")
    return choice == "onednn" or (choice == "auto" and torch.backends.mkldnn.is_available() and amd_cpu())


def use_cpu_matmul(model: nn.Module, choice: str = "auto") -> int:
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


# ---- the compiled layers' norms ---------------------------------------------------------------------------------

def _llama_norm(module: nn.Module) -> bool:
    """An RMSNorm whose forward is Llama's (transformers copies it into Qwen2/3 and their MoE and VL text models,
    Mistral, ...): ``weight * x / rms(x)``, not Gemma's ``(1 + weight)``."""
    code, llama = (getattr(type(module).forward, "__code__", None), LlamaRMSNorm.forward.__code__)
    return code is not None and (code.co_code, code.co_names, code.co_consts) == (
        llama.co_code, llama.co_names, llama.co_consts)


def _norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _RMSNorm.apply(x, self.weight, self.variance_epsilon)


class _RMSNorm(torch.autograd.Function):
    """Llama's RMSNorm, in float32 and rounded to the input's dtype before the weight as there, with its gradients
    written out: the weight's sums over the tokens in `_token_sum` (see the module's doc)."""

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
