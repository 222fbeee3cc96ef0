"""Reward functions in TRL's convention (``--train.reward_fns``): single-turn tasks with no agent file.

A reward function is called once per prompt group with keyword lists, one entry per completion:
``prompts`` (the prompt string, or its chat messages for a chat prompt), ``completions`` (the sampled
text, or ``[{"role": "assistant", "content": text}]`` for a chat prompt), ``completion_ids`` (the sampled
tokens), the label under its column name (--data.label_key) and every other dataset column. It returns one
float per completion, or None where it does not apply. A completion's reward is the weighted sum of its
numbers, and the first function's value is its score (what eval accuracy and --algo.dynamic_filter count);
each function's value is kept in the trajectory's ``info["rewards"]`` and logged as
``reward/<name>/mean`` and ``/std``. A plain function runs in the grading processes (`grading_pool`:
signal-based limits such as math-verify's work there), an ``async def`` one on the agent runner's loop.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from instar.agents.api import Task, import_named
from instar.agents.rewards import call_pickled, grading_pool
from instar.agents.transcript import Turn
from instar.config import ConfigError
from instar.contract import Result, Trajectory
from instar.data.chat import Message
from instar.data.images import text_of

FLAG = "--train.reward_fns"


@dataclass
class RewardFn:
    name: str
    fn: Callable[..., Any]
    weight: float = 1.0


def load_reward_fns(specs: Sequence[str | Callable[..., Any]], weights: Sequence[float] | None) -> list[RewardFn]:
    """The functions ``specs`` name (``path/to/file.py:fn``, ``package.module:fn``) or are, with their weights."""
    if weights is not None and len(weights) != len(specs):
        raise ConfigError(f"--train.reward_weights has {len(weights)} weights for {len(specs)} reward functions")
    fns = [_resolve(spec) for spec in specs]
    named = [RewardFn(getattr(f, "__name__", type(f).__name__), f, w) for f, w in zip(fns, weights or [1.0] * len(fns))]
    if len({f.name for f in named}) < len(named):
        raise ConfigError(f"{FLAG}: two reward functions are named alike; each name is a metric")
    return named


def _resolve(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(spec):
        return spec
    module, name = import_named(spec, FLAG)
    fn = getattr(module, name, None) if name else None
    if not callable(fn):
        raise ConfigError(f"{FLAG} {spec!r}: name a function, as path/to/file.py:fn or package.module:fn")
    return fn


@dataclass
class RewardFnRunner:
    """Samples one turn per rollout; `score` then rewards the whole group at once."""

    fns: list[RewardFn]
    label_key: str = "label"
    turns: dict[str, Turn] = field(default_factory=dict)  # each rollout's completion, until scored

    async def rollout(self, task: Task, messages: list[Message], session: Any) -> Result:
        self.turns[task.rollout_id] = await session.transcript.sample(messages, task.tools, task.sampling_params)
        return Result()

    async def score(self, tasks: list[Task], trajectories: list[Trajectory | None]) -> None:
        """Set each kept trajectory's reward from the reward functions (dropped ones are None)."""
        turns = [self.turns.pop(task.rollout_id, None) for task in tasks]
        kept = [(task, traj, turn) for task, traj, turn in zip(tasks, trajectories, turns) if traj and turn]
        if not kept:
            return
        # as TRL passes them: the prompt's messages and a one-message list for a chat prompt, else strings
        prompts = [task.prompt if task.chat else text_of(task.prompt[-1]["content"]) for task, _, _ in kept]
        completions = [[{"role": "assistant", "content": turn.text}] if task.chat else turn.text
                       for task, _, turn in kept]
        columns = {k: [task.metadata.get(k) for task, _, _ in kept] for k in kept[0][0].metadata}
        kwargs = {**columns, self.label_key: [task.label for task, _, _ in kept], "prompts": prompts,
                  "completions": completions, "completion_ids": [list(turn.token_ids) for *_, turn in kept]}
        values = await asyncio.gather(*(_call(f, kwargs, len(kept)) for f in self.fns))
        for k, (_, traj, _) in enumerate(kept):
            traj.info = {"rewards": {f.name: v[k] for f, v in zip(self.fns, values) if v[k] is not None}}
            traj.reward = sum(f.weight * v[k] for f, v in zip(self.fns, values) if v[k] is not None)
            traj.score = values[0][k]  # the first function's value is what accuracy and the filters count


async def _call(f: RewardFn, kwargs: dict[str, list], n: int) -> list[float | None]:
    if inspect.iscoroutinefunction(f.fn):
        out = await f.fn(**kwargs)
    else:
        out = await asyncio.wrap_future(grading_pool().submit(call_pickled, cloudpickle.dumps((f.fn, kwargs))))
    ok = isinstance(out, (list, tuple)) and len(out) == n and all(
        v is None or (isinstance(v, numbers.Real) and math.isfinite(v)) for v in out)
    if not ok:
        raise ConfigError(f"{FLAG}: {f.name} must return a list of {n} finite numbers (None for no score), "
                          f"got {str(out)[:200]}")
    return [None if v is None else float(v) for v in out]
