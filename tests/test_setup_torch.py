"""scripts/setup.sh installs PyTorch's CPU build on Linux without an NVIDIA GPU (PyPI's is the CUDA one), and
the CPU path runs on macOS. Nothing is installed: pip, uname and nvidia-smi are stubs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from instar.train.launch import cpu_threads

ROOT = Path(__file__).resolve().parents[1]
BASH = shutil.which("bash")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def stub(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def test_the_setup_scripts_pass_shellcheck():
    scripts = [str(ROOT / "scripts" / name) for name in ("setup.sh", "torch_build.sh")]
    check = subprocess.run([str(Path(sys.executable).parent / "shellcheck"), *scripts], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout


@pytest.mark.parametrize("system, gpu, build", [("Linux", False, "cpu"), ("Linux", True, "default"),
                                                ("Darwin", False, "default")])
def test_torch_build_is_cpu_on_linux_without_an_nvidia_gpu(tmp_path, system, gpu, build):
    if system == "Linux" and not gpu and Path("/proc/driver/nvidia").exists():
        pytest.skip("this machine has an NVIDIA driver loaded")
    stub(tmp_path / "uname", f"#!{BASH}\necho {system}\n")
    if gpu:
        stub(tmp_path / "nvidia-smi", f"#!{BASH}\nexit 0\n")
    done = subprocess.run([BASH, str(ROOT / "scripts/torch_build.sh")], capture_output=True, text=True,
                          env={"PATH": str(tmp_path)}, timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{build}\n", "")


@pytest.mark.parametrize("build, mirror_has_cpu, torch_calls, line", [
    ("cpu", True, [["torch==2.13.0+cpu"]], "torch 2.13.0+cpu (CPU build)"),
    ("cpu", False, [["torch==2.13.0+cpu"], ["--index-url", CPU_INDEX, "torch==2.13.0+cpu"]],
     "torch 2.13.0+cpu (CPU build)"),
    ("default", False, [["torch==2.13.0"]], "torch 2.13.0 (CUDA 12.9 build)"),
])
def test_setup_installs_the_chosen_torch_build(tmp_path, build, mirror_has_cpu, torch_calls, line):
    """setup.sh on a scratch copy: the configured index first for the CPU build, PyTorch's CPU index where it
    has none; then the line that names what was installed."""
    for name in ("scripts/setup.sh", "requirements/lock.txt", "pyproject.toml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    stub(tmp_path / "scripts/torch_build.sh", f"#!{BASH}\necho {build}\n")
    site = tmp_path / "site"
    # pip records its arguments; "installing" torch writes a torch module with that version for the python stub
    stub(tmp_path / ".venv/bin/pip", f"""#!{sys.executable}
import json, sys
from pathlib import Path
args = sys.argv[1:]
with open({str(tmp_path / "pip.log")!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
[version] = [a.removeprefix("torch==") for a in args if a.startswith("torch==")] or [None]
if version and version.endswith("+cpu") and "--index-url" not in args and not {mirror_has_cpu}:
    sys.exit("ERROR: No matching distribution found for torch==" + version)
if version:
    pkg = Path({str(site)!r}) / "torch"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(f"from . import version\\n__version__ = {{version!r}}\\n")
    (pkg / "version.py").write_text("cuda = " + ("None" if version.endswith("+cpu") else "'12.9'") + "\\n")
""")
    stub(tmp_path / ".venv/bin/python", f"#!{BASH}\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    done = subprocess.run([BASH, str(tmp_path / "scripts/setup.sh")], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": "true"}, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = [json.loads(row) for row in (tmp_path / "pip.log").read_text().splitlines()]
    assert [c[2:] for c in calls if any(a.startswith("torch==") for a in c)] == torch_calls
    assert [c[0:2] for c in calls] == [["install", "-q"]] * len(calls)
    assert done.stdout.splitlines()[1:] == [line] and done.stderr == ""


def test_cpu_threads_counts_every_core_where_there_is_no_affinity_call(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert [cpu_threads(1), cpu_threads(3), cpu_threads(16)] == [8, 2, 1]
