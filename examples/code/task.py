"""The code task: write a small Python function, with a `run_python` tool to try code first. The Env runs
each tool call in the sandbox (sandbox.py) and returns its output as a tool turn; the turn that makes no
call (or the one after MAX_TOOL_CALLS calls) is the answer. Its last ```python block (the whole turn when it
has none) is graded in the sandbox by the record's tests: reward = the fraction that pass, score = 1 when all do.

A record: ``prompt`` (chat messages or a string), ``tests`` (assert statements, e.g. ``"assert
affine(3) == 17"``), and optional columns the Env ignores (here ``entry_point`` and ``solution``, a
reference). Train with `--train.agent_path examples/code/task.py`; write offline datasets of generated
problems with `python examples/code/task.py OUT_DIR [SEED]`. See docs/recipes/code.md.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import secrets
import string
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from instar.agents import Env, Result, StepEnvRunner

SANDBOX = "instar_code_sandbox"  # one copy per process, whoever loads it: its probe and its run users are shared
if SANDBOX not in sys.modules:  # an agent file is loaded by path, not as a package: load the file beside it
    _spec = importlib.util.spec_from_file_location(SANDBOX, Path(__file__).with_name("sandbox.py"))
    sys.modules[SANDBOX] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up here
    _spec.loader.exec_module(sys.modules[SANDBOX])
sandbox = sys.modules[SANDBOX]
HARNESS = Path(__file__).with_name("harness.py").read_text()
SYSTEM = ("Write the Python function the user asks for. You may try code with the run_python tool first. "
          "End with the final solution in a ```python code block: hidden tests will call the function.")
RUN_PYTHON = {"type": "function", "function": {
    "name": "run_python",
    "description": "Run a Python program (standard library only, no network, no input) and see its stdout, "
                   "stderr and exit status.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The program."}},
                   "required": ["code"]}}}
MAX_TOOL_CALLS = 4
TOOL_LIMITS = sandbox.Limits(timeout=10.0, cpu_seconds=5, output_bytes=4096)
GRADE_LIMITS = sandbox.Limits(timeout=20.0, cpu_seconds=10, output_bytes=4096)
TEST_SECONDS = 2.0  # each test's own bound inside the grading run
TESTS = 5  # per generated problem; the first is shown in the prompt
FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)


@dataclass(frozen=True)
class Family:
    """A kind of problem: ``does`` and ``solution`` (the reference) are format strings over ``params``."""

    name: str
    arg: str
    does: str
    solution: str
    params: Callable[[random.Random], dict]
    sample: Callable[[random.Random, dict], object]


def _word(rng: random.Random, letters: str = "abcdefghij") -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(3, 8)))


def _ints(rng: random.Random) -> list[int]:
    return [rng.randint(-30, 30) for _ in range(rng.randint(0, 8))]


FAMILIES = [
    Family("affine", "x", "returns `{a} * x + {b}` for an integer `x`",
           "def affine(x):\n    return {a} * x + {b}\n",
           lambda r: {"a": r.randint(2, 9), "b": r.randint(1, 20)}, lambda r, p: r.randint(-50, 50)),
    Family("count_letter", "s", "returns how many times the letter {c!r} occurs in the string `s`",
           "def count_letter(s):\n    return s.count({c!r})\n",
           lambda r: {"c": r.choice("abcdef")}, lambda r, p: _word(r, "abcdef")),
    Family("sum_multiples", "nums", "returns the sum of the numbers in the list `nums` that are divisible by {k}",
           "def sum_multiples(nums):\n    return sum(n for n in nums if n % {k} == 0)\n",
           lambda r: {"k": r.randint(2, 7)}, lambda r, p: _ints(r)),
    Family("reverse_words", "s", "returns the words of `s` in reverse order, joined by single spaces",
           "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
           lambda r: {}, lambda r, p: " ".join(_word(r) for _ in range(r.randint(1, 5)))),
    Family("digit_sum", "n", "returns the sum of the decimal digits of the non-negative integer `n`",
           "def digit_sum(n):\n    return sum(int(d) for d in str(n))\n",
           lambda r: {}, lambda r, p: r.randint(0, 10 ** r.randint(1, 9))),
    Family("sequence", "n", "returns term `n` of the sequence that starts {a}, {b} and whose every later term is "
                            "the sum of the two before it (`n` = 0 gives {a})",
           "def sequence(n):\n    a, b = {a}, {b}\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
           lambda r: {"a": r.randint(0, 5), "b": r.randint(1, 5)}, lambda r, p: r.randint(0, 25)),
    Family("shift_letters", "s", "returns `s` with each lowercase letter moved {k} places on in the alphabet "
                                 "(wrapping from z to a) and every other character unchanged",
           "def shift_letters(s):\n    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c "
           "for c in s)\n",
           lambda r: {"k": r.randint(1, 25)}, lambda r, p: _word(r, string.ascii_lowercase + "XY -")),
    Family("dedupe", "nums", "returns the list `nums` without repeats, keeping each number's first occurrence "
                             "in order",
           "def dedupe(nums):\n    return list(dict.fromkeys(nums))\n",
           lambda r: {}, lambda r, p: [r.randint(0, 5) for _ in range(r.randint(0, 9))]),
]


def make_problem(rng: random.Random) -> dict:
    """A record: prompt messages, TESTS asserts (distinct inputs), the function's name and reference solution."""
    family = rng.choice(FAMILIES)
    params = family.params(rng)
    solution = family.solution.format(**params)
    namespace: dict = {}
    exec(solution, namespace)  # our own reference, to compute the expected values
    inputs: dict[str, object] = {}
    for _ in range(100 * TESTS):
        value = family.sample(rng, params)
        inputs.setdefault(repr(value), value)
        if len(inputs) == TESTS:
            break
    tests = [f"assert {family.name}({key}) == {namespace[family.name](value)!r}" for key, value in inputs.items()]
    example = tests[0].removeprefix("assert ").replace(" == ", "` returns `", 1)
    user = (f"Write a Python function `{family.name}({family.arg})` that {family.does.format(**params)}. "
            f"For example, `{example}`.")
    return {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}], "tests": tests,
            "entry_point": family.name, "solution": solution}


def problems(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(n)]


def write_datasets(out: str | Path, seed: int = 0, n_train: int = 2000, n_eval: int = 200) -> Path:
    """train.jsonl and eval.jsonl of generated problems under ``out``, each split from its own seed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, n, offset in (("train", n_train, 1), ("eval", n_eval, 2)):
        with (out / f"{name}.jsonl").open("w") as f:
            for record in problems(n, seed=seed * 10 + offset):
                f.write(json.dumps(record) + "\n")
    return out


def final_code(text: str) -> str:
    """The last ```python (or bare ```) block of an answer; the whole answer when it has none."""
    blocks = FENCE.findall(text)
    return blocks[-1] if blocks else text


async def grade(code: str, tests: list[str]) -> tuple[int, sandbox.Output]:
    """How many of ``tests`` pass against ``code``, run by harness.py in the sandbox, and the run's output."""
    nonce = secrets.token_hex(8)  # the result line is the harness's, not one the code printed
    job = json.dumps({"code": code, "tests": tests, "seconds": TEST_SECONDS, "nonce": nonce})
    output = await sandbox.run(HARNESS, GRADE_LIMITS, stdin=job)
    found = re.search(rf"^{nonce} (\d+) \d+$", output.stdout, re.M)
    return (int(found.group(1)) if found else 0), output


class CodeEnv(Env):
    """Tool turns run code; the answer turn is graded by the record's tests."""

    tools = [RUN_PYTHON]  # rendered into the system turn by the chat template

    async def step(self, state: dict) -> Result:
        message = state["messages"][-1]
        calls = message.get("tool_calls") or []
        if calls and state["turn"] < MAX_TOOL_CALLS:
            args = calls[0]["function"].get("arguments")
            code = args.get("code", "") if isinstance(args, dict) else str(args)
            output = await sandbox.run(str(code), TOOL_LIMITS)
            return Result(observation=output.text(), terminated=False, info={"tool_exit": output.returncode})
        tests = state["metadata"].get("tests")
        if not (isinstance(tests, list) and tests):
            raise ValueError(f"the code task needs a 'tests' column of assert statements, got {tests!r} "
                             f"(see docs/recipes/code.md)")
        passed, output = await grade(final_code(message.get("content") or ""), tests)
        return Result(reward=passed / len(tests), score=float(passed == len(tests)),
                      info={"passed": passed, "tests": len(tests), "grade_exit": output.returncode})


AgentRunner = StepEnvRunner(CodeEnv)


if __name__ == "__main__":
    print(write_datasets(sys.argv[1], seed=int(sys.argv[2]) if len(sys.argv) > 2 else 0))
