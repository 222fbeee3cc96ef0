"""Runs one agent module's rollouts inside an agent-runner process.

The host owns the loopback chat server, opens one session per rollout, enforces
``--train.agent_timeout`` and turns the session transcript plus the agent's ``Result`` into a
``Trajectory``. A rollout whose user code raises or times out, or that sampled nothing, is dropped
and counted by reason; it never stops the run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable
from typing import Any

from instar.agents.api import ChatAgentRunner, StepEnvRunner, Task
from instar.agents.reward_fns import RewardFnRunner
from instar.agents.server import ChatServer
from instar.contract import ContractError, Result, Trajectory
from instar.data.chat import prompt_messages
from instar.data.images import Vision, with_markers
from instar.engines.protocol import Sampler

log = logging.getLogger(__name__)


class AgentHost:
    """``async with AgentHost(runner, engine, tokenizer, ...) as host: traj = await host.rollout(task)``.

    ``engine`` is anything with the engine protocol's ``generate`` (an engine or the router);
    ``max_len`` / ``max_new_tokens`` are --data.max_len / --data.max_new_tokens."""

    def __init__(self, runner: StepEnvRunner | ChatAgentRunner | RewardFnRunner, engine: Sampler, tokenizer: Any, *,
                 max_len: int, max_new_tokens: int, agent_timeout: float, system_prompt: str | None = None,
                 model_name: str = "policy", tool_parser: str = "hermes", vision: Vision | None = None,
                 error_reward: float | None = None) -> None:
        """``error_reward``: keep a rollout whose agent code raised, with this reward (None: drop it)."""
        self.runner, self.agent_timeout, self.system_prompt = runner, agent_timeout, system_prompt
        self.error_reward = error_reward
        self.server = ChatServer(engine, tokenizer, model_name=model_name, max_len=max_len,
                                 max_new_tokens=max_new_tokens, tool_parser=tool_parser, vision=vision)
        self.counts: Counter[str] = Counter()  # cancelled, dropped_<reason>, kept_error_<Type>
        self.finished = 0
        self._running: set[asyncio.Task] = set()
        self._closing = False
        self.held_s, self._held_since = 0.0, None  # how long the engines held requests behind weight syncs

    def hold(self, held: bool) -> None:
        """The engines hold new requests until a weight sync ends (or no longer): time held is not the agent's,
        and no rollout's --train.agent_timeout counts it."""
        self.held_s, self._held_since = self._held(), time.monotonic() if held else None

    def _held(self) -> float:
        return self.held_s + (0.0 if self._held_since is None else time.monotonic() - self._held_since)

    async def _timed(self, work: Awaitable[Any]) -> Any:
        """``work`` within --train.agent_timeout, time held by the engines not counted (`hold`)."""
        task, start, held = asyncio.ensure_future(work), time.monotonic(), self._held()
        try:
            while (left := self.agent_timeout - (time.monotonic() - start) + (self._held() - held)) > 0:
                if (await asyncio.wait({task}, timeout=left))[0]:
                    return task.result()
            raise TimeoutError
        finally:
            task.cancel()  # timed out, or the caller was cancelled: it ends with its caller, as under wait_for
            await asyncio.wait({task})

    async def __aenter__(self) -> AgentHost:
        await self.server.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Rollouts still running are cancelled first (counted in ``cancelled``, not as errors), so none of
        them meets an engine that is shutting down."""
        self._closing = True
        for task in self._running:
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        await self.server.__aexit__(*exc)

    async def rollout(self, task: Task) -> Trajectory | None:
        """Run one rollout; None when it was dropped (see ``dropped``)."""
        messages = prompt_messages(task.prompt, self.system_prompt)
        if task.images:  # a dataset's images column: in the first user turn
            first = next(i for i, m in enumerate(messages) if m["role"] == "user")
            messages[first] = {**messages[first], "content": with_markers(messages[first]["content"], task.images)}
        session = self.server.open(task.sampling_params)
        me, kept_error = asyncio.current_task(), None
        self._running.add(me)
        try:
            result = await self._timed(self.runner.rollout(task, messages, session))
        except asyncio.CancelledError:
            if not self._closing:
                raise
            self.counts["cancelled"] += 1  # the run is ending: not the agent's fault, and nobody waits for it
            return None
        except TimeoutError:
            return self._drop("timeout", task, f"exceeded --train.agent_timeout={self.agent_timeout}s")
        except Exception as e:  # user code: log it, drop the rollout (or keep what it sampled), keep the run going
            log.warning("rollout %r: %s raised", task.rollout_id, type(e).__name__, exc_info=True)
            if self.error_reward is None:
                return self._drop(f"error_{type(e).__name__}", task, str(e))
            kept_error = f"kept_error_{type(e).__name__}"  # counted once it is a trajectory, not dropped after all
            result = Result(reward=self.error_reward, info={"error": f"{type(e).__name__}: {e}"})
        finally:
            self._running.discard(me)
            self.server.close(session)
            self.server.engine.release(session.id)  # a Router forgets the session's placement
            self.server.engine.release(session.untraced_id)
        transcript = session.transcript
        if not transcript.segments and transcript.truncated:
            return self._drop("prompt_too_long", task, f"prompt does not fit in --data.max_len={transcript.max_len}")
        finish = "length" if transcript.truncated else "abort" if transcript.last_finish_reason == "abort" else "stop"
        traj = Trajectory(transcript.segments, reward=result.reward, score=result.score, info=result.info,
                          group_id=task.group_id, rollout_id=task.rollout_id, prompt_index=task.prompt_index,
                          finish_reason=finish, metadata=task.metadata, turns=transcript.turns,
                          tool_calls=transcript.tool_calls, turn_rewards=result.turn_rewards)
        try:
            traj.validate()
        except ContractError as e:
            return self._drop("invalid", task, str(e))
        self.finished += 1
        if kept_error:
            self.counts[kept_error] += 1
        return traj

    async def run_group(self, tasks: list[Task]) -> list[Trajectory]:
        """One prompt group's rollouts, concurrently; dropped ones are counted in `metrics`, not returned.
        A runner that scores whole groups (`RewardFnRunner`) scores them here, within --train.agent_timeout."""
        out = await asyncio.gather(*(self.rollout(task) for task in tasks))
        if isinstance(self.runner, RewardFnRunner):
            try:
                await self._timed(self.runner.score(tasks, out))
            except TimeoutError:
                for task in tasks:
                    self._drop("reward_timeout", task, f"scoring exceeded --train.agent_timeout={self.agent_timeout}s")
                return []
        return [t for t in out if t is not None]

    def _drop(self, reason: str, task: Task, detail: str) -> None:
        log.warning("rollout %r (prompt %d) dropped, %s: %s", task.rollout_id, task.prompt_index, reason, detail)
        self.counts[f"dropped_{reason}"] += 1

    def metrics(self) -> dict[str, float]:
        """Counts since start: finished rollouts, those cancelled at shutdown, dropped ones by reason (timeout,
        error_<Type>, prompt_too_long, invalid, reward_timeout) and kept ones whose agent raised (kept_error_<Type>,
        with --train.on_agent_error keep)."""
        counts = {f"agent/{key}": float(n) for key, n in sorted(self.counts.items())}
        return {"agent/finished": float(self.finished), **counts}
