"""The optional CPU accelerator (`--cpu.*`, the package instar/cpu): off by default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class CpuConfig:
    """The CPU accelerator (instar/cpu): native kernels, ahead-of-time compiled engine layers, oneDNN linears and
    malloc tuning, for CPU runs (laptops, CI, the demo). Off, every path is plain PyTorch with the same numerics on
    every machine; on, each part that cannot be built here stays plain PyTorch and says so in one line."""

    enable: bool = False
    """Turn the accelerator on: the embedded engine's dense layers AOT-compiled with C decode-attention and
    sampling kernels, the trainer's packed attention as a C kernel (float32), the matmul library below, and
    malloc tuning. Results agree with plain PyTorch up to float rounding, not bit for bit."""
    matmul: Literal["auto", "onednn", "blas"] = "auto"
    """With --cpu.enable: the trainer's float32 linear layers through oneDNN or PyTorch's BLAS (MKL); auto: oneDNN
    on AMD CPUs, where MKL skips its AVX-512 kernels (~2x there)."""
