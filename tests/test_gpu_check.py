"""bench/gpu_check.py runs on a GPU machine that CI never sees; its CPU smoke run keeps the script in step
with instar's code (a renamed function broke it once, unnoticed until a GPU was lent)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_cpu_smoke_passes_its_trainer_checks():
    checks = "env,trainer_nccl_equals_cpu,bf16_trainer_vs_fp32"
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-smoke", "--only", checks], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    lines = [line for line in run.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert not [line for line in lines if line.startswith("FAIL")], "\n".join(lines)
    passed = {line.split()[1].split("[")[0].rstrip(":") for line in lines if line.startswith("PASS")}
    assert passed >= set(checks.split(",")), "\n".join(lines)
