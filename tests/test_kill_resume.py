"""kill -9 at three seeded moments of a real CPU run, resumed each time: bench/kill_resume.py, whose
ledger check is the test (every prompt trained exactly once per epoch, metrics steps 1..N, final
exports). Two prompts make every step cross an epoch, so the resumes restore mid-epoch states."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(600)  # four cold starts of the cluster: ~80 s alone, more on a busy machine
def test_three_kills_then_every_prompt_trained_exactly_once(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench/kill_resume.py"), "--kills", "3", "--seed", "0",
                           "--prompts", "2", "--steps", "8", "--workdir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0 and done.stdout.splitlines()[-1].startswith("PASS: 3 kills"), done.stdout
