"""Per-step use of the agent runners and engines (counts, CPU, idle and prefix-hit fractions)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any


class Usage:
    """Agent-runner counts (cumulative) and engine / agent-runner use since the previous `read`."""

    def __init__(self, agents: list[Any], engines: list[Any]):
        self.agents, self.engines = agents, engines
        self.last: tuple[float, dict[str, float]] = (time.perf_counter(), {})

    async def read(self) -> dict[str, float]:
        totals = await _summed(a.metrics.remote() for a in self.agents)
        now, use = time.perf_counter(), {"agent_cpu_seconds": totals.pop("agent/cpu_seconds", 0.0)}
        use |= await _summed(e.stats.remote() for e in self.engines)
        (then, last), self.last = self.last, (now, use)
        delta = {k: v - last.get(k, 0.0) for k, v in use.items()}
        if now > then:
            if self.agents:  # none when replaying recorded rollouts
                totals["agent/cpu_fraction"] = delta["agent_cpu_seconds"] / ((now - then) * len(self.agents))
            if "busy_seconds" in delta:
                totals["engine/idle_fraction"] = 1 - delta["busy_seconds"] / ((now - then) * len(self.engines))
        if delta.get("steps"):  # how well requests batch, and what one engine step costs
            totals["engine/rows_per_step"] = delta["sampled_tokens"] / delta["steps"]
            totals["engine/step_ms"] = 1000 * delta.get("busy_seconds", 0.0) / delta["steps"]
        if delta.get("sleeps"):  # --engine.enable_sleep_mode: once a step when it works
            totals["engine/sleeps"] = delta["sleeps"] / len(self.engines)
        if delta.get("prompt_tokens"):
            totals["engine/prefix_hit_rate"] = delta.get("prefix_hit_tokens", 0.0) / delta["prompt_tokens"]
        return totals


async def _summed(calls: Iterable[Any]) -> dict[str, float]:
    """The actors' answers summed key by key; one that Ray is restarting (see `Cluster`) is left out of this
    step's figures rather than failing the run (its counters restart from zero, so one delta jumps)."""
    import ray

    total: dict[str, float] = {}
    for x in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(x, ray.exceptions.RayActorError):
            continue
        if isinstance(x, BaseException):
            raise x
        for k, v in x.items():
            total[k] = total.get(k, 0.0) + v
    return total
