"""The math answer grader (math-verify): answers that look different but are equal, and near misses."""

import asyncio
import time

import pytest

from instar.agents.rewards import math_equal

EQUAL = [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5"),  # fraction vs decimal
    ("so \\boxed{\\dfrac{3}{4}}.", "3/4"),  # \dfrac vs a slash
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}"),  # rationalised denominator
    ("\\boxed{1,000}", "1000"),  # thousands separator
    ("\\boxed{42}", 42),  # an integer label, as JSON gives it
    ("\\boxed{42}", "42.0"),
    ("$\\boxed{\\{2, 3\\}}$", "\\{3,2\\}"),  # sets in any order
    ("\\boxed{(1, 2]}", "(1,2]"),  # an interval
    ("\\boxed{2x+1}", "1+2x"),  # symbolic
    ("The final answer is $x = 5$", "5"),  # an equation's right-hand side
    ("first 3, then 7", "7"),  # no box: the last number
    ("\\boxed{0.3333333}", "\\frac13"),  # rounding to 6 places
]
DIFFERENT = [
    ("\\boxed{3}", "2"),
    ("I don't know", "2"),  # no answer at all
    ("first 3, then 7", "3"),  # an earlier number is not the answer
    ("\\boxed{[1, 2]}", "(1,2]"),  # closed vs half-open
    ("\\boxed{0.333}", "1/3"),  # too coarse
    ("\\boxed{1} or maybe \\boxed{2}", "2"),  # hedging between two boxes earns nothing
    ("\\boxed{\\pi}", "3.14159"),
    ("\\boxed{2}", ""),  # an empty label matches nothing
]


@pytest.mark.parametrize("response,label", EQUAL)
def test_equal_answers(response, label):
    assert math_equal(response, label) is True


@pytest.mark.parametrize("response,label", DIFFERENT)
def test_different_answers(response, label):
    assert math_equal(response, label) is False


def test_grades_off_the_main_thread():
    """Agents grade in a worker thread (asyncio.to_thread), where math-verify's SIGALRM timeout cannot be set."""
    async def grade() -> list[bool]:
        return list(await asyncio.gather(*(asyncio.to_thread(math_equal, r, label) for r, label in EQUAL[:4])))
    start = time.monotonic()
    assert asyncio.run(grade()) == [True] * 4
    assert time.monotonic() - start < 20


def test_grading_workers_end_with_the_process_that_started_them(tmp_path):
    """An agent runner killed outright (Ray kills actors so) must not leave its grading processes behind: they
    hold both ends of their task pipe and would wait on it forever."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    script = tmp_path / "grade.py"
    script.write_text("import threading, time\nfrom instar.agents.rewards import math_equal\n"
                      "if __name__ == '__main__':\n"
                      "    t = threading.Thread(target=lambda: print(math_equal('\\\\boxed{2}', '2'), flush=True))\n"
                      "    t.start(); t.join(); time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "True"
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert workers  # the forkserver and at least one grading worker
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=20)
    assert not alive, [p.cmdline()[:3] for p in alive]
