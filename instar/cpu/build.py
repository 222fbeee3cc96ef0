"""Builds for this machine, cached on disk: the C kernels (`native`) and the key every build is cached under.

A cache key names everything a build depends on: the source, the compiler's identity and flags, the instar and
torch versions and the CPU's feature flags (the kernels are built with -march=native), never the hostname. A
cached build that does not load, or that loads and fails its self-check, is built again once; after that the
part stays on plain PyTorch and says so in one line (`Part`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from instar.version import __version__

CC_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-Wall", "-Wextra"]
if platform.machine() in ("x86_64", "AMD64"):  # without it GCC vectorises the exp loops 8 lanes wide on AVX-512
    CC_FLAGS.append("-mprefer-vector-width=512")


def cache_dir() -> Path:
    """Where builds are kept: $INSTAR_CACHE/cpu, by default ~/.cache/instar/cpu."""
    return Path(os.environ.get("INSTAR_CACHE") or Path.home() / ".cache" / "instar") / "cpu"


@functools.cache
def cpu_features() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f.read(1 << 16).splitlines() if line.startswith(("flags", "model name"))]
        return "\n".join(sorted(set(lines))) or platform.processor()
    except OSError:  # not Linux
        return f"{platform.machine()} {platform.processor()}"


@functools.cache
def compiler_identity(cc: str) -> str:
    """The first line of ``cc --version`` (empty when there is no such compiler)."""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0] if out else ""


def build_key(*parts: Any) -> str:
    """A key for a build of ``parts`` (its source and settings) on this machine, instar and torch."""
    text = repr((parts, __version__, torch.__version__, platform.machine(), cpu_features()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def source(name: str) -> str:
    """The C source ``csrc/<name>.c`` shipped with the package."""
    return resources.files("instar.cpu").joinpath("csrc", f"{name}.c").read_text()


def compile_library(name: str, out: Path, werror: bool = False) -> None:
    """Compile ``csrc/<name>.c`` into the shared library ``out``. Compiled with fast math, linked without it:
    linking it would set the process's floats to flush denormals to zero."""
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, obj, lib = (f"{tmp}/{name}.{ext}" for ext in ("c", "o", "so"))
        Path(src).write_text(source(name))
        libs = ["-lm"] + (["-lmvec"] if platform.system() == "Linux" else [])  # glibc's vector exp
        subprocess.run([cc, "-c", *CC_FLAGS, *(["-Werror"] if werror else []), src, "-o", obj], check=True,
                       capture_output=True)
        subprocess.run([cc, "-shared", "-fopenmp", obj, "-o", lib, *libs], check=True, capture_output=True)
        os.replace(lib, out)  # atomic: processes may build at once


def load_or_build(what: str, path: Path, build: Callable[[Path], None], load: Callable[[Path], Any],
                  check: Callable[[Any], None]) -> Any | None:
    """``load(path)`` after ``check`` passed on it (it raises on a mismatch with torch); ``build(path)`` first
    where there is no file, and again once where the file does not load or check. None, with one printed line
    saying that ``what`` stays on plain PyTorch, where even a fresh build fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    error: BaseException | None = None
    for attempt in range(2):
        try:
            if attempt or not path.exists():
                build(path)
            loaded = load(path)
            check(loaded)
            return loaded
        except Exception as e:  # a compiler error, a corrupt file, a failed self-check
            error = e
            path.unlink(missing_ok=True)
    detail = getattr(error, "stderr", b"") or str(error).encode()
    detail = detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
    print(f"instar: {what} stays on plain PyTorch: {type(error).__name__}: {' '.join(detail.split())[:300]}",
          flush=True)
    return None


def native(name: str, what: str, check: Callable[[ctypes.PyDLL], None]) -> ctypes.PyDLL | None:
    """The C kernels of ``csrc/<name>.c`` built for this machine and self-checked, or None (`load_or_build`).
    PyDLL: a call keeps the GIL, as a torch op does; released, the engine's thread would wait to get it back from
    the event loop's, up to its 5 ms switch interval."""
    cc = os.environ.get("CC", "cc")
    key = build_key(source(name), cc, compiler_identity(cc), CC_FLAGS)
    return load_or_build(what, cache_dir() / f"{key}-{name}.so", lambda p: compile_library(name, p),
                         lambda p: ctypes.PyDLL(str(p)), check)


def pointers(*tensors: torch.Tensor | None) -> list[int | None]:
    return [None if t is None else t.data_ptr() for t in tensors]


def checked(code: int, what: str) -> None:
    """Raise where a native call refused its arguments (it returns non-zero and computes nothing)."""
    if code:
        raise ValueError(f"{what}: the native kernel refused its arguments (code {code})")
