"""The calculator task: `a*b+c` with 2-3 digit numbers, too hard for a tiny model in its head, easy with
a calculator tool. Problems, the exact grader, the tool, imperfect SFT demonstrations, and the Env.

Train with `--train.agent_path examples/calculator/task.py`; write the datasets with
`python examples/calculator/task.py OUT_DIR`.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import sys
from pathlib import Path

from instar.agents import Env, Result, StepEnvRunner

# The tool's schema is not rendered into the prompt: on a 2-core CPU its ~250 template tokens would
# dominate every rollout, and a tiny model learns the call format from the SFT demonstrations anyway.
SYSTEM = "Call calculator with the expression, then reply with the number only."
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def make_problem(rng: random.Random) -> dict:
    a, b, c = rng.randint(10, 999), rng.randint(10, 99), rng.randint(10, 999)
    return {"prompt": f"What is {a}*{b}+{c}?", "label": str(a * b + c), "expression": f"{a}*{b}+{c}"}


def problems(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(n)]


def calculate(expression: str) -> str:
    """The tool: integers with + - * only; anything else is an error message, never an exception."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")
    try:
        return str(ev(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError):
        return "error"


def grade(answer: str, label: str) -> float:
    """1.0 for exactly the right integer (surrounding whitespace ignored), else 0.0."""
    return float(answer.strip() == label)


def demo(problem: dict) -> list[dict]:
    """An imperfect demonstration whose kind depends on the input, so the warm-started model is right
    on some inputs and wrong on others: a full tool call, a partial one (`a*b`), or a direct guess."""
    a, rest = problem["expression"].split("*")
    b, c = rest.split("+")
    kind = (int(a) + int(b)) % 3
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": problem["prompt"]}]
    if kind == 2:  # answers in its head: right leading digits, wrong tail
        guess = str(int(problem["label"]) // 100 * 100 + (int(c) % 100))
        return messages + [{"role": "assistant", "content": guess}]
    expression = problem["expression"] if kind == 0 else f"{a}*{b}"
    result = calculate(expression)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return messages + [{"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "content": result}, {"role": "assistant", "content": result}]


def write_datasets(out: str | Path, n_train: int = 2000, n_eval: int = 200, n_sft: int = 2000) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {"train.jsonl": problems(n_train, seed=1), "eval.jsonl": problems(n_eval, seed=2)}
    for name, items in rows.items():
        with (out / name).open("w") as f:
            for p in items:
                f.write(json.dumps({"prompt": [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": p["prompt"]}], "label": p["label"]}) + "\n")
    with (out / "sft.jsonl").open("w") as f:
        for p in problems(n_sft, seed=3):
            f.write(json.dumps({"messages": demo(p)}) + "\n")
    return out


class CalculatorEnv(Env):
    """Turn 1 may call the calculator (its result comes back as a tool turn); the next turn must be the
    number. Reward 1 for the exact answer, whichever way it was reached."""

    async def step(self, state: dict) -> Result:
        message = state["messages"][-1]
        calls = message.get("tool_calls") or []
        if calls and state["turn"] == 0:
            args = calls[0]["function"].get("arguments")
            expression = str(args.get("expression", "")) if isinstance(args, dict) else str(args)
            return Result(observation=calculate(expression), terminated=False, info={"expression": expression})
        reward = grade(message["content"], state["label"])
        return Result(reward=reward, score=reward)


AgentRunner = StepEnvRunner(CalculatorEnv)


if __name__ == "__main__":
    print(write_datasets(sys.argv[1]))
