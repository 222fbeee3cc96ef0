"""Grades a solution inside the sandbox. It reads a JSON job from stdin (``code``, ``tests``: assert
statements, ``seconds``: the time each may take, ``nonce``), runs the code as a module named ``solution``
(so its ``if __name__ == "__main__":`` block stays idle), then each test in the code's namespace, and
writes ``NONCE PASSED TOTAL`` on a line of its own. The code cannot read the job: it is gone from stdin."""

import json
import os
import signal
import sys


def _too_slow(signum: int, frame: object) -> None:
    raise TimeoutError("took too long")


def _within(seconds: float, source: str, namespace: dict) -> bool:
    """Run ``source`` in ``namespace``; True unless it raised (anything, SystemExit included) or overran."""
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        exec(source, namespace)
        return True
    except BaseException:  # a failed test, whatever the solution raised
        return False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main() -> None:
    job = json.loads(sys.stdin.read())
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # stdin is a file the code could rewind to read the job
    signal.signal(signal.SIGALRM, _too_slow)
    sys.stdout = sys.stderr  # what the code prints never crowds the result line out of the kept output
    namespace: dict = {"__name__": "solution"}
    _within(job["seconds"], job["code"], namespace)  # a broken module may still define what the tests call
    passed = sum(_within(job["seconds"], test, namespace) for test in job["tests"])
    os.write(1, f"{job['nonce']} {passed} {len(job['tests'])}\n".encode())  # past any sys.stdout the code set


if __name__ == "__main__":
    main()
