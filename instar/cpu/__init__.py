"""The optional CPU accelerator (--cpu.enable): speed work for CPU runs (laptops, CI, the demo) that the rest of
instar does not know about. Off, every path is plain PyTorch with the same numerics on every machine.

The core reaches it through two seams only: the trainer's attention registry (`train.attention.REGISTERED`:
"cpu" is `trainer.REGISTERED`, the C attention kernel plus its model preparation: oneDNN linears, the compiled
layers' CPU settings, malloc tuning) and the embedded engine's step accelerator (`engine.accelerator`, an
`engines.protocol.StepAccelerator`: AOT-compiled dense layers, C decode attention and sampling). C sources are
files in csrc/; every build is cached by what it depends on (`build.build_key`), self-checked against the torch op
it replaces, built again once where a cached one fails, and otherwise left out with one printed line.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any


def engine_process() -> Callable[[Any], Any]:
    """Set up an engine's process for the accelerator (malloc) and return what builds its step accelerator."""
    from instar.cpu.engine import accelerator
    from instar.cpu.trainer import keep_freed_memory

    keep_freed_memory()
    return accelerator


def describe() -> list[str]:
    """What of the accelerator is built and usable on this machine (builds the C kernels where they are not yet):
    one line per part, for `instar env`."""
    import torch

    from instar.cpu.attention import library
    from instar.cpu.build import cache_dir
    from instar.cpu.decode import DecodeKernel
    from instar.cpu.trainer import amd_cpu, uses_onednn

    cxx = torch._inductor.cpp_builder.get_cpp_compiler()
    return [f"cpu accelerator: off unless --cpu.enable; builds cached in {cache_dir()}",
            f"  trainer attention (C kernel): {'built, self-checked' if library() else 'unavailable'}",
            f"  engine decode attention and sampling (C kernels): "
            f"{'built, self-checked' if DecodeKernel.load_or_build() else 'unavailable'}",
            f"  engine dense layers (AOTInductor, built per model shape): C++ compiler "
            f"{shutil.which(cxx) or 'missing: unavailable'}",
            f"  trainer matmul (--cpu.matmul auto): {'oneDNN' if uses_onednn('auto') else 'BLAS'} "
            f"({'an AMD' if amd_cpu() else 'not an AMD'} CPU)",
            "  malloc tuning: glibc" if _glibc() else "  malloc tuning: unavailable (not glibc)"]


def _glibc() -> bool:
    import ctypes
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallopt")
    except OSError:
        return False
