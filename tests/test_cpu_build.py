"""The CPU accelerator's builds (`cpu/build.py`): its C sources compile with warnings as errors; a build's key names
the source, the compiler, its flags, the versions and the CPU's features, never the hostname; a corrupt cached
build is built again once, and a build that fails its self-check twice leaves the part on plain PyTorch with one
line. Nothing outside instar/cpu loads C or tunes malloc, the accelerator is off by default, its old flag
spellings still work, and `instar env` says what it built."""

import ctypes
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from instar.cli.main import main, parse
from instar.config import CpuConfig, RLConfig
from instar.cpu import build

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["attention", "decode"])
def test_the_c_sources_compile_with_warnings_as_errors(name, tmp_path):
    build.compile_library(name, tmp_path / f"{name}.so", werror=True)
    assert (tmp_path / f"{name}.so").stat().st_size > 0


def test_a_build_key_names_what_the_build_depends_on_and_not_the_host(monkeypatch):
    key = build.build_key("source", "cc", "gcc 12", build.CC_FLAGS)
    monkeypatch.setattr(platform, "node", lambda: "another-host")
    assert build.build_key("source", "cc", "gcc 12", build.CC_FLAGS) == key
    for parts in (("other source", "cc", "gcc 12", build.CC_FLAGS), ("source", "cc", "gcc 13", build.CC_FLAGS),
                  ("source", "cc", "gcc 12", build.CC_FLAGS + ["-O0"])):
        assert build.build_key(*parts) != key
    monkeypatch.setattr(build, "__version__", "99.0")
    assert build.build_key("source", "cc", "gcc 12", build.CC_FLAGS) != key
    monkeypatch.undo()
    build.cpu_features.cache_clear()
    monkeypatch.setattr(build, "cpu_features", lambda: "flags : sse2")
    assert build.build_key("source", "cc", "gcc 12", build.CC_FLAGS) != key


def test_a_corrupt_build_is_built_again_once(tmp_path, monkeypatch):
    monkeypatch.setenv("INSTAR_CACHE", str(tmp_path))
    checks = []
    assert build.native("decode", "decode", checks.append) is not None  # built, loaded and checked
    (path,) = (tmp_path / "cpu").glob("*-decode.so")
    path.unlink()  # a new file in its place: this process keeps the library it mapped (overwritten: SIGBUS)
    path.write_bytes(b"not a library")
    # another process (this one keeps the library it loaded under that name)
    out = subprocess.run([sys.executable, "-c", "from instar.cpu import build\n"
                          "print(build.native('decode', 'decode', lambda library: None) is not None)"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    assert out == "True\n" and len(checks) == 1 and path.stat().st_size > 1000


def test_a_build_that_fails_its_self_check_stays_on_torch_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("INSTAR_CACHE", str(tmp_path))
    checks = []

    def mismatch(library):
        checks.append(library)
        raise AssertionError("Tensor-likes are not close!")
    assert build.native("attention", "the trainer's packed attention", mismatch) is None
    assert len(checks) == 2  # the cached build, then a fresh one
    out = capsys.readouterr().out.splitlines()
    assert out == ["instar: the trainer's packed attention stays on plain PyTorch: AssertionError: Tensor-likes are "
                   "not close!"]
    assert not list((tmp_path / "cpu").glob("*.so"))


def test_nothing_outside_the_accelerator_loads_c_or_tunes_malloc():
    found = []
    for path in (ROOT / "instar").rglob("*.py"):
        if "cpu" in path.relative_to(ROOT / "instar").parts[:1]:
            continue
        text = path.read_text()
        found += [f"{path.name}: {m}" for m in re.findall(r"import ctypes|mallopt|CDLL|\"cc\"|-march", text)]
    assert found == []
    assert list((ROOT / "instar/cpu/csrc").glob("*.c")) and not re.search(
        r'r"""\s*#include', "".join(p.read_text() for p in (ROOT / "instar").rglob("*.py")))


def test_off_by_default_and_the_old_spellings_turn_it_on(tmp_path):
    assert RLConfig().cpu == CpuConfig(enable=False, matmul="auto")
    assert parse(["rl", "--engine.compile", "aot", "--fsdp.cpu_matmul", "blas"])[1].cpu == CpuConfig(True, "blas")
    assert parse(["rl", "--engine.compile=none"])[1].cpu.enable is False
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("engine:\n  compile: aot\n  num_engines: 2\nfsdp:\n  cpu_matmul: onednn\n")
    cfg = parse(["rl", "--config", str(recipe)])[1]
    assert cfg.cpu == CpuConfig(True, "onednn") and cfg.engine.num_engines == 2
    with pytest.raises(SystemExit, match="--engine.compile takes one of"):
        parse(["rl", "--engine.compile", "fast"])


def test_instar_env_says_what_is_built(capsys):
    main(["env"])
    out = capsys.readouterr().out
    assert "trainer attention (C kernel): built, self-checked" in out
    assert "engine decode attention and sampling (C kernels): built, self-checked" in out
    assert "malloc tuning: glibc" in out or not hasattr(ctypes, "CDLL")
