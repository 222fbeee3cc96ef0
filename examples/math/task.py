"""GSM8K-style math: one answer per question, rewarded by reward functions in TRL's convention (no agent file).

Records use openai/gsm8k's own schema: `question`, and `answer` (worked steps ending in `#### N`). On the hub:
`--data.prompt_dataset openai/gsm8k --data.dataset_config main`. Offline (the CPU smoke test, a first look):
`python examples/math/task.py OUT_DIR` writes records of the same schema, generated from templates.

    instar rl --config examples/math/rl.yaml
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from instar.agents.rewards import math_equal

SYSTEM = "Solve the problem. Put the final answer in \\boxed{}."


def final_number(answer: str) -> str:
    """GSM8K's label: the text after `####`, without thousands separators."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


def correct(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1 when the completion's final answer (its \\boxed{}, else its last number) equals the record's."""
    return [float(math_equal(text, final_number(gold))) for text, gold in zip(completions, answer)]


def boxed(completions: list[str], **kwargs) -> list[float]:
    """A small format reward: the answer is in \\boxed{} (where `correct` looks first)."""
    return [float("\\boxed{" in text) for text in completions]


def problem(rng: random.Random) -> dict:
    """One record in openai/gsm8k's schema: a two-step word problem and its worked answer."""
    name = rng.choice(["Ava", "Ben", "Chen", "Dara", "Eli", "Farah"])
    a, b, c = rng.randint(2, 60), rng.randint(2, 9), rng.randint(2, 12)
    kind = rng.randrange(3)
    if kind == 0:
        question = f"{name} has {a} apples and buys {b} bags of {c} apples each. How many apples does {name} have now?"
        steps = f"The bags hold {b} * {c} = {b * c} apples.\nSo {a} + {b * c} = {a + b * c}."
        n = a + b * c
    elif kind == 1:
        taken = min(a, b * c)
        question = f"A shelf holds {b} rows of {c} books. {name} takes {taken} away. How many books are left?"
        steps = f"The shelf holds {b} * {c} = {b * c} books.\nSo {b * c} - {taken} = {b * c - taken}."
        n = b * c - taken
    else:
        question = f"{name} reads {c} pages a day for {b} weeks. How many pages is that?"
        steps = f"{b} weeks are {b} * 7 = {b * 7} days.\nSo {c} * {b * 7} = {c * b * 7}."
        n = c * b * 7
    return {"question": question, "answer": f"{steps}\n#### {n}"}


def write_datasets(out: Path, n_train: int = 512, n_eval: int = 64, seed: int = 0) -> Path:
    """train.jsonl and test.jsonl in `out` (the splits openai/gsm8k has), disjoint by seed."""
    out.mkdir(parents=True, exist_ok=True)
    for name, n, s in (("train", n_train, seed), ("test", n_eval, seed + 1)):
        rng = random.Random(s)
        (out / f"{name}.jsonl").write_text("".join(json.dumps(problem(rng)) + "\n" for _ in range(n)))
    return out


if __name__ == "__main__":
    print(write_datasets(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/math-data")))
