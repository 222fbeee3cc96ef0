"""Agent-runner actors: each loads the user's agent module, runs its loopback chat server, and rolls
out whole prompt groups against the engines through its own session-affinity router."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import ray
import torch

from instar.contract import Trajectory
from instar.runtime.engines import ROLLOUT_NICE

AGENT_MAX_RESTARTS = 3
"""How many times Ray restarts a crashed agent-runner actor in one run (its groups are launched again)."""


@ray.remote(max_restarts=AGENT_MAX_RESTARTS)
class AgentActor:
    def __init__(self, agent_path: str, model_path: str, engine_handles: list[Any], *, max_len: int,
                 max_new_tokens: int, agent_timeout: float, system_prompt: str | None, tool_parser: str):
        os.environ["OMP_NUM_THREADS"] = "1"
        os.nice(ROLLOUT_NICE)
        torch.set_num_threads(1)
        from transformers import AutoTokenizer

        from instar.agents.api import load_agent
        from instar.agents.host import AgentHost
        from instar.data.images import Vision
        from instar.engines.router import Router
        from instar.runtime.engines import RemoteEngine

        self.router = Router([RemoteEngine(h) for h in engine_handles])
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.host = AgentHost(load_agent(agent_path), self.router, tokenizer, max_len=max_len,
                              max_new_tokens=max_new_tokens, agent_timeout=agent_timeout,
                              system_prompt=system_prompt, tool_parser=tool_parser,
                              vision=Vision.from_pretrained(model_path))
        self.started = False

    async def run_group(self, tasks: list[Any]) -> list[Trajectory]:
        """Roll out one prompt group concurrently; dropped rollouts are counted in `metrics`, not returned."""
        if not self.started:  # the chat server's loop must be the actor's own
            await self.host.__aenter__()
            self.started = True
        out = await asyncio.gather(*(self.host.rollout(task) for task in tasks))
        return [t for t in out if t is not None]

    def metrics(self) -> dict[str, float]:
        """The host's counts, and this process's CPU seconds so far (the env, the chat server,
        tokenization: all agent-side work) for the driver's per-step use fraction."""
        return {**self.host.metrics(), "agent/cpu_seconds": time.process_time()}

    async def close(self) -> None:
        if self.started:
            await self.host.__aexit__(None, None, None)
