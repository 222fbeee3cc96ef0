"""The code recipe (examples/code/): generated problems whose reference solutions pass their own tests, the
grader's count, the Env's tool and answer turns, the GPU recipe's YAML, and 2 RL steps on the tiny model."""

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from helpers.loop import make_cfg, rows

from instar.checks import check
from instar.cli.main import parse
from instar.contract import read_jsonl
from instar.loop import run

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("code_task", ROOT / "examples/code/task.py")
task = importlib.util.module_from_spec(_spec)
sys.modules["code_task"] = task  # dataclasses look their module up here
_spec.loader.exec_module(task)


@pytest.fixture(scope="module")
def runnable():
    if task.sandbox.containment().problem:
        pytest.skip(task.sandbox.containment().problem)


def test_generated_problems_are_deterministic_and_cover_every_family():
    assert task.problems(6, seed=3) == task.problems(6, seed=3) != task.problems(6, seed=4)
    records = task.problems(60, seed=0)
    assert {r["entry_point"] for r in records} == {f.name for f in task.FAMILIES}
    for r in records:
        assert len(r["tests"]) == len(set(r["tests"])) == task.TESTS
        assert all(t.startswith(f"assert {r['entry_point']}(") for t in r["tests"])
        shown = r["tests"][0].removeprefix("assert ").replace(" == ", "` returns `")
        assert r["prompt"][0]["content"] == task.SYSTEM and r["prompt"][1]["content"].endswith(f"`{shown}`.")
    first = task.problems(1, seed=0)[0]
    assert first["tests"][0] == "assert shift_letters('biqpm-') == 'ahpol-'"  # the generator's output, pinned


def test_reference_solutions_pass_every_test_and_wrong_ones_do_not(runnable):
    records = task.problems(16, seed=1)

    async def grade_all(codes):
        return [passed for passed, _ in await asyncio.gather(*(task.grade(c, r["tests"]) for c, r in
                                                               zip(codes, records)))]

    assert asyncio.run(grade_all([r["solution"] for r in records])) == [task.TESTS] * len(records)
    assert asyncio.run(grade_all(["" for _ in records])) == [0] * len(records)


def test_grade_counts_passing_tests_and_ignores_what_the_code_prints(runnable, monkeypatch):
    monkeypatch.setattr(task, "TEST_SECONDS", 0.5)
    tests = ["assert f(1) == 1", "assert f(2) == 4", "assert f(3) == 9", "assert f(4) == 16"]
    cases = {
        "def f(x):\n    return x * x": 4,
        "def f(x):\n    return x * x if x < 3 else 0": 2,
        "def f(x):\n    while x == 2:\n        pass\n    return x * x": 3,  # one test hangs: it alone fails
        "import sys\ndef f(x):\n    return x * x\nprint('0123456789abcdef 4 4')\nsys.exit(1)": 4,
        "print('0123456789abcdef 4 4')": 0,  # a result line the code forges does not count
        "import json, os\nos.lseek(0, 0, 0)\nnonce = json.loads(os.read(0, 1 << 20))['nonce']\n"
        "os.write(1, f'{nonce} 4 4\\n'.encode())\nos._exit(0)": 0,  # nor one forged from a rewound stdin
        "def f(x):\n    return x * x\nprint('y' * 100000)": 4,  # what it prints crowds nothing out
        "def f(x):\n    return x * x\nwhile True:\n    pass": 4,  # the module's endless loop is cut off, f stays
        "def f(x) return": 0,
    }

    async def grade_all():
        return [(await task.grade(code, tests))[0] for code in cases]

    assert asyncio.run(grade_all()) == list(cases.values())


def test_final_code_is_the_last_python_block_or_the_whole_answer():
    answer = "Try:\n```python\nx = 1\n```\nFinal:\n```py\ndef f():\n    return 2\n```\nDone."
    assert task.final_code(answer) == "def f():\n    return 2\n"
    assert task.final_code("```\nprint(1)\n```") == "print(1)\n"
    assert task.final_code("def f(): return 3") == "def f(): return 3"


def test_the_env_runs_tool_calls_then_grades_the_answer(runnable):
    tests = ["assert double(2) == 4", "assert double(5) == 10"]

    def step(turn, message):
        state = {"turn": turn, "messages": [message], "metadata": {"tests": tests}}
        return asyncio.run(task.CodeEnv().step(state))

    call = {"type": "function", "function": {"name": "run_python", "arguments": {"code": "print(2 * 21)"}}}
    tool = step(0, {"role": "assistant", "content": "", "tool_calls": [call]})
    assert (tool.observation, tool.terminated, tool.reward) == ("42\nexit status 0", False, 0.0)
    wrong_from_5 = "```python\ndef double(x):\n    return x * 2 if x < 5 else 0\n```"
    answer = step(1, {"role": "assistant", "content": wrong_from_5})
    assert (answer.reward, answer.score, answer.terminated) == (0.5, 0.0, True)
    assert answer.info == {"passed": 1, "tests": 2, "grade_exit": 0}
    last = step(task.MAX_TOOL_CALLS, {"role": "assistant", "content": "", "tool_calls": [call]})  # no more calls
    assert (last.reward, last.info["passed"], last.terminated) == (0.0, 0, True)
    with pytest.raises(ValueError, match="needs a 'tests' column"):
        asyncio.run(task.CodeEnv().step({"turn": 0, "messages": [{"role": "assistant", "content": "x"}],
                                         "metadata": {}}))


def test_the_gpu_recipe_parses():
    _, cfg = parse(["rl", "--config", str(ROOT / "examples/code/rl.yaml")])
    assert cfg.actor.model_name_or_path == "Qwen/Qwen3-4B" and cfg.train.agent_path == "examples/code/task.py"
    assert (cfg.rollout.engine, cfg.engine.num_engines, cfg.fsdp.num_ranks, cfg.engine.dtype) == ("vllm", 4, 4,
                                                                                                  "bfloat16")
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    check(cfg)


@pytest.mark.slow
def test_two_rl_steps_on_the_tiny_model(tmp_path, tiny_model_dir, runnable):
    data = task.write_datasets(tmp_path / "data", n_train=8, n_eval=4)
    cfg = make_cfg(tmp_path, tiny_model_dir, str(data / "train.jsonl"), **{
        "train.agent_path": str(ROOT / "examples/code/task.py"), "train.max_steps": 2, "train.force_sync_mode": True,
        "data.max_len": 1024, "data.max_new_tokens": 16, "train.rollout_dump_dir": str(tmp_path / "dump")})
    run(cfg)
    metrics = rows(tmp_path / "run/metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["trajectories"] == 8 for m in metrics)
    assert not any(k.startswith("agent/dropped") for m in metrics for k in m)
    trajectories = [t for f in sorted((tmp_path / "dump").iterdir()) for t in read_jsonl(str(f))]
    # every answer was graded in the sandbox by its record's 5 tests, the harness reaching its end
    answers = [t.info["turns"][-1] for t in trajectories]
    assert len(answers) == 16 and all(a["tests"] == 5 and a["grade_exit"] == 0 for a in answers)
    assert json.loads((data / "train.jsonl").read_text().splitlines()[0])["tests"][0].startswith("assert ")
