"""LLM-as-judge: the policy answers an open-ended question once; a judge model rates the answer on a rubric.

A record holds `prompt`, `reference` (a reference answer: pass `--data.label_key reference`, it reaches the Env as
`state["label"]`) and `rubric` (criteria, each "name: what it asks"; it reaches the Env in `state["metadata"]`).
The judge rates each criterion 0-10 and the reward is their mean over 10, in [0, 1]. A record with no rubric gets
a pass/fail verdict instead (1 for "correct", 0 for "wrong"). A verdict that does not parse scores 0 and is
counted as `info/unparseable/mean`.

The judge is, by default, the policy itself: its own engines through the untraced route (never trained on), so it
changes as the policy trains. Set JUDGE_BASE_URL and JUDGE_MODEL (and JUDGE_API_KEY when the server wants one) to
judge with a frozen model on any OpenAI-compatible server instead, e.g. one started beside the run with
`vllm serve Qwen/Qwen3-8B --port 8001`. They are environment variables because an agent file has no instar
flags; they must be set where the agent runners start (before `instar rl`, or before `ray start` on each node).

    python examples/judge/task.py runs/judge-data   # offline records
    instar rl --config examples/judge/rl.yaml
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from pathlib import Path

from openai import AsyncOpenAI

from instar.agents import Env, Result, StepEnvRunner
from instar.config import ConfigError

VERDICT = "You are a judge. Reply correct or wrong."
RUBRIC = ("You grade an answer to a question. Rate it on each criterion below from 0 (fails it) to 10 (fully "
          "meets it); when a reference answer is given, it is the standard of correctness.\n\nCriteria:\n{criteria}"
          "\n\nReply with one line per criterion in this form, and nothing else:\n{form}")
MAX_TOKENS = 64  # the verdict is a word or a few short lines; a judge that rambles is cut off and scores 0
SCALE = 10.0


def frozen_judge() -> tuple[str, str, str] | None:
    """(base URL, API key, model) of the frozen judge that JUDGE_BASE_URL / JUDGE_MODEL / JUDGE_API_KEY name, or
    None when unset (the policy judges itself)."""
    url, model = os.environ.get("JUDGE_BASE_URL", ""), os.environ.get("JUDGE_MODEL", "")
    if bool(url) != bool(model):
        raise ConfigError(f"JUDGE_BASE_URL={url!r} and JUDGE_MODEL={model!r}: set both (the judge server's /v1 URL "
                          "and the model name it serves) for a frozen judge, or neither to let the policy judge")
    # vLLM started without --api-key accepts any key, but the SDK refuses an empty one
    return (url, os.environ.get("JUDGE_API_KEY") or "EMPTY", model) if url else None


FROZEN = frozen_judge()  # read at import: a bad setting fails at start-up, and the judge is fixed for the run


def criteria_of(rubric: list[str] | None) -> list[tuple[str, str]]:
    """The (name, description) of each "name: description" criterion; no rubric gives none (a verdict)."""
    criteria = []
    for item in rubric or []:
        name, sep, description = item.partition(":")
        if not (sep and name.strip()):
            raise ValueError(f"rubric criterion {item!r} must read 'name: what it asks', e.g. 'accuracy: agrees "
                             "with the reference answer'")
        criteria.append((name.strip().lower(), description.strip()))
    return criteria


def judge_messages(question: str, answer: str, reference: str | None,
                   criteria: list[tuple[str, str]]) -> list[dict]:
    """The judge's conversation: the rubric (or the verdict instruction), then the question and the answer."""
    if criteria:
        system = RUBRIC.format(criteria="\n".join(f"- {n}: {d}" for n, d in criteria),
                               form="\n".join(f"{n}: <0-10>" for n, _ in criteria))
    else:
        system = VERDICT
    shown = "" if reference is None else f"Reference answer: {reference}\n"
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"Question: {question}\n{shown}Answer: {answer}"}]


def without_thinking(reply: str) -> str:
    """The reply after any <think> block; a block never closed (cut by MAX_TOKENS) leaves nothing."""
    reply = re.sub(r"<think>.*?</think>", "", reply, flags=re.S)
    return reply.split("<think>")[0]


def parse_verdict(reply: str) -> float | None:
    """1.0 when the reply's first word is "correct", 0.0 for "wrong" or "incorrect", else None."""
    words = re.findall(r"[a-z]+", without_thinking(reply).lower())
    return {"correct": 1.0, "wrong": 0.0, "incorrect": 0.0}.get(words[0]) if words else None


def parse_rubric(reply: str, names: list[str]) -> float | None:
    """The mean of each criterion's rating over 10, from lines such as "accuracy: 7", "- **Accuracy**: 7/10" or
    "2. accuracy = 3 out of 5" (a later line for a criterion wins); None when one is missing or out of range."""
    text = without_thinking(reply).replace("*", "").replace("`", "")
    ratings = []
    for name in names:
        line = (rf"^[ \t]*(?:[-#>]+[ \t]*|\d+[.)][ \t]*)?{re.escape(name)}[ \t]*[:=-][ \t]*(\d+(?:\.\d+)?)"
                rf"(?:[ \t]*(?:/|out of)[ \t]*(\d+))?")
        found = re.findall(line, text, flags=re.I | re.M)
        if not found:
            return None
        value, scale = found[-1]
        value, scale = float(value), float(scale or SCALE)
        if not 0 < scale or not 0 <= value <= scale:
            return None
        ratings.append(value / scale)
    return sum(ratings) / len(ratings)


class JudgedEnv(Env):
    async def step(self, state: dict) -> Result:
        if state["label"] is None and "reference" in state["metadata"]:
            raise ConfigError("the record has a 'reference' column but no label: pass --data.label_key reference")
        criteria = criteria_of(state["metadata"].get("rubric"))
        messages = judge_messages(state["observation_text"], state["action_text"], state["label"], criteria)
        url, key, model = FROZEN or (state["untraced_base_url"], state["api_key"], state["model_name"])
        async with AsyncOpenAI(base_url=url, api_key=key) as judge:
            reply = await judge.chat.completions.create(model=model, messages=messages, temperature=0.0,
                                                        max_tokens=MAX_TOKENS)
        text = reply.choices[0].message.content or ""
        score = parse_rubric(text, [n for n, _ in criteria]) if criteria else parse_verdict(text)
        return Result(reward=score or 0.0, score=score or 0.0,
                      info={"unparseable": int(score is None), "verdict": text})


AgentRunner = StepEnvRunner(JudgedEnv)

# Open-ended questions for the offline records: (topic, reference answer).
TOPICS = [
    ("photosynthesis", "Plants, algae and some bacteria use the energy of light to turn carbon dioxide and water "
     "into sugar, giving off oxygen. It takes place in chloroplasts and feeds nearly every food chain."),
    ("inflation", "A general rise in prices over time, so that each unit of money buys less. Some inflation is "
     "normal; central banks steer it mostly through interest rates."),
    ("the greenhouse effect", "Gases such as carbon dioxide, methane and water vapour let sunlight in but absorb "
     "the heat the ground radiates back, keeping the surface warmer; adding more of them warms the climate."),
    ("a hash table", "A structure that stores key-value pairs in an array, turning each key into an index with a "
     "hash function, so lookups and inserts take constant time on average; collisions are chained or probed."),
    ("vaccination", "A vaccine shows the immune system a harmless form or part of a germ, so it makes antibodies "
     "and memory cells and can fight the real infection quickly later."),
    ("plate tectonics", "The Earth's outer shell is split into plates that drift slowly over the mantle; where they "
     "meet or part they cause earthquakes, volcanoes and mountain ranges."),
    ("compound interest", "Interest paid on the interest already earned as well as on the original sum, so savings "
     "or debts grow exponentially rather than in a straight line."),
    ("recursion in programming", "A function solving a problem by calling itself on smaller cases of the same "
     "problem until it reaches a base case it can answer directly."),
    ("natural selection", "Individuals whose inherited traits suit their surroundings survive and have more "
     "offspring, so those traits grow more common in the population over generations."),
    ("supply and demand", "Prices settle where the amount buyers want equals the amount sellers offer; scarcity "
     "pushes prices up and a surplus pushes them down."),
    ("the water cycle", "Water evaporates from seas and land, condenses into clouds, falls as rain or snow, and "
     "returns to the sea through rivers and groundwater."),
    ("encryption", "Turning readable data into ciphertext with a key, so that only someone with the right key can "
     "read it; symmetric schemes share one key, public-key schemes use a pair."),
    ("overfitting in machine learning", "A model learns the noise of its training data rather than the general "
     "pattern, so it does well on that data and badly on new data; more data and regularisation help."),
    ("antibiotic resistance", "Bacteria that survive an antibiotic through chance mutations pass the resistance "
     "on; overuse of antibiotics speeds this up and makes infections harder to treat."),
    ("ocean tides", "The Moon's pull is stronger on the near side of the Earth than on its far side, raising two "
     "bulges of water; as the Earth turns, a coast passes through both, giving about two high tides a day."),
    ("opportunity cost", "The value of the best alternative given up when making a choice: the cost of a thing "
     "is also what else the time or money could have bought."),
]
BASE = ["accuracy: agrees with the reference answer and says nothing false",
        "completeness: covers the main points of the reference answer"]
# Each asks in its own way and adds the criterion that way calls for.
ASKS = [("Explain {} in two or three sentences.", "concision: two or three sentences, with no padding"),
        ("Explain {} to a curious ten-year-old.", "audience: words and examples a ten-year-old understands"),
        ("Describe {} and say why it matters.", "relevance: says why it matters, not only what it is")]


def records(topics: list[tuple[str, str]]) -> list[dict]:
    """One record per topic and way of asking."""
    return [{"prompt": ask.format(topic), "reference": reference, "rubric": [*BASE, extra]}
            for topic, reference in topics for ask, extra in ASKS]


def write_datasets(out: Path, n_eval_topics: int = 4, seed: int = 0) -> Path:
    """train.jsonl and eval.jsonl in `out`: every topic asked three ways, the eval topics held out of training."""
    out.mkdir(parents=True, exist_ok=True)
    topics = random.Random(seed).sample(TOPICS, len(TOPICS))
    for name, part in (("train", topics[n_eval_topics:]), ("eval", topics[:n_eval_topics])):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(part)))
    return out


if __name__ == "__main__":
    print(write_datasets(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/judge-data")))
