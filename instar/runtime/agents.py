"""Agent-runner actors: each loads the user's agent module, runs its loopback chat server, and rolls
out whole prompt groups against the engines through its own session-affinity router."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch

from instar.config import RLConfig
from instar.contract import Trajectory
from instar.runtime.engines import ROLLOUT_NICE, RemoteEngine

AGENT_MAX_RESTARTS = 3
"""How many times Ray restarts a crashed agent-runner actor in one run (its groups are launched again)."""


@ray.remote(max_restarts=AGENT_MAX_RESTARTS)
class AgentActor:
    def __init__(self, cfg: RLConfig, engine_handles: list[Any], reward_fns: Sequence[Callable[..., Any]] = ()):
        """The agent is --train.agent_path's, or with --train.reward_fns (plus ``reward_fns``, the callables
        given to `instar.rl`) a `RewardFnRunner`."""
        os.environ["OMP_NUM_THREADS"] = "1"
        os.nice(ROLLOUT_NICE)
        torch.set_num_threads(1)
        from instar.agents.api import load_agent
        from instar.agents.host import AgentHost
        from instar.agents.reward_fns import RewardFnRunner, load_reward_fns
        from instar.data.chat import load_tokenizer
        from instar.data.images import Vision
        from instar.engines.router import Router

        self.router = Router([RemoteEngine(h) for h in engine_handles])
        model, data, train = cfg.actor.model_name_or_path, cfg.data, cfg.train
        tokenizer = load_tokenizer(model, data.chat_template, data.chat_template_kwargs)
        fns = [*train.reward_fns, *reward_fns]
        runner = (RewardFnRunner(load_reward_fns(fns, train.reward_weights), data.label_key) if fns
                  else load_agent(train.agent_path))
        self.host = AgentHost(runner, self.router, tokenizer, max_len=data.max_len,
                              max_new_tokens=data.max_new_tokens, agent_timeout=train.agent_timeout,
                              system_prompt=data.system_prompt or None, tool_parser=data.tool_parser,
                              vision=Vision.from_pretrained(model),
                              error_reward=train.agent_error_reward if train.on_agent_error == "keep" else None)
        self.started = False

    async def run_group(self, tasks: list[Any]) -> list[Trajectory]:
        """Roll out one prompt group concurrently; dropped rollouts are counted in `stats`, not returned."""
        if not self.started:  # the chat server's loop must be the actor's own
            await self.host.__aenter__()
            self.started = True
        return await self.host.run_group(tasks)

    def hold(self, held: bool) -> None:
        self.host.hold(held)

    def stats(self) -> dict[str, float]:
        """The host's counts, and read together for the driver's per-step use fraction (`Usage`): this process's
        CPU seconds so far (the env, the chat server, tokenization: all agent-side work, every thread) and the
        wall clock times the machine's cores, which no process can use more of."""
        return {**self.host.metrics(), "cpu_seconds": time.process_time(),
                "core_seconds": time.perf_counter() * (os.cpu_count() or 1)}

    async def close(self) -> None:
        if self.started:
            await self.host.__aexit__(None, None, None)
