"""bench/gpu_check.py and bench/gpu_rl.sh run on a GPU machine that CI never sees; their CPU smoke runs keep the
scripts in step with instar's code (a renamed function broke one once, unnoticed until a GPU was lent)."""

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


def test_the_gpu_rl_script_passes_shellcheck():
    check = subprocess.run([str(Path(sys.executable).parent / "shellcheck"), str(ROOT / "bench/gpu_rl.sh")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


@pytest.mark.slow
def test_gpu_rl_cpu_smoke_runs_the_loop_in_bf16_and_float32(tmp_path):
    """Both runs train every step, their engines and trainers agree at the first on-policy step."""
    run = subprocess.run([sys.executable, "bench/gpu_rl.py", str(tmp_path), "--cpu-smoke", "--checks", ""],
                         cwd=ROOT, capture_output=True, text=True, timeout=400)
    lines = [line for line in run.stdout.splitlines() if line.startswith(("PASS", "FAIL", "INFO"))]
    assert run.returncode == 0 and not [line for line in lines if line.startswith("FAIL")], run.stdout[-3000:]
    assert {line.split()[1].rstrip(":") for line in lines if line.startswith("PASS")} >= {
        "steps", "vllm_kl_fp32", "vllm_kl_bf16", "weight_sync"}, "\n".join(lines)
    assert any(line.startswith("INFO step_split: generation") for line in lines), "\n".join(lines)
