"""Per-step use of the agent runners and engines (counts, CPU, idle and prefix-hit fractions)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import ray


class Usage:
    """Agent-runner counts (cumulative) and engine / agent-runner use since the previous `read`.

    Each actor answers its counters and its clock, read together in its own process (the embedded engine's
    between two of its steps); a fraction is the ratio of the sums of their changes between two answers, and
    each actor's own ratio lies in [0, 1], so the whole does too. An actor whose counters went down (Ray
    restarted it) is left out of that interval. The first interval starts when `Usage` is made: what the actors
    did before (start-up, imports) is not counted."""

    def __init__(self, agents: list[Any], engines: list[Any]):
        self.agents, self.engines = agents, engines
        self.asked = self._ask()  # the previous answers (the first `read` awaits these)

    def _ask(self) -> list[asyncio.Future]:
        return [asyncio.ensure_future(_answer(actor.stats.remote())) for actor in [*self.agents, *self.engines]]

    async def read(self) -> dict[str, float]:
        before, self.asked = self.asked, self._ask()
        totals, delta = Counter(), Counter()
        for then, now in zip(await asyncio.gather(*before), await asyncio.gather(*self.asked)):
            totals.update({k: v for k, v in now.items() if k.startswith("agent/")})  # the runners' counts
            if all(v >= then.get(k, v) for k, v in now.items()):  # else Ray restarted it: its counters began again
                delta.update({k: v - then.get(k, v) for k, v in now.items()})
        if delta["core_seconds"]:  # none when replaying recorded rollouts
            totals["agent/cpu_fraction"] = delta["cpu_seconds"] / delta["core_seconds"]
        if delta["seconds"]:  # the embedded engine's clock: it measures busy time
            totals["engine/idle_fraction"] = 1 - delta["busy_seconds"] / delta["seconds"]
        if delta["steps"]:  # how well requests batch, and what one engine step costs
            totals["engine/rows_per_step"] = delta["sampled_tokens"] / delta["steps"]
            totals["engine/step_ms"] = 1000 * delta["busy_seconds"] / delta["steps"]
        if delta["sleeps"]:  # --engine.enable_sleep_mode: once a step when it works
            totals["engine/sleeps"] = delta["sleeps"] / len(self.engines)
        if delta["prompt_tokens"]:
            totals["engine/prefix_hit_rate"] = delta["prefix_hit_tokens"] / delta["prompt_tokens"]
        return dict(totals)


async def _answer(call: Any) -> dict[str, float]:
    """An actor's answer; none from one that Ray is restarting (see `Cluster`): it is left out of this step's
    figures rather than failing the run."""
    try:
        return await call
    except ray.exceptions.RayActorError:
        return {}
