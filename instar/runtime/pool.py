"""The streaming rollout pool: keeps prompt groups in flight on the agent runners and hands the loop
a batch as soon as enough groups have finished; unfinished groups carry over to the next step.

Staleness is bounded by how far generation may run ahead: at most `batch_size * (async_queue_size + 1)`
groups are launched and not yet trained with the engines holding the result, the batch in training
counted until `weights_updated` (called once the engines hold every request that arrives until they have
the weights trained on it: `EngineActor.prepare_sync`). So while batch k trains, batches k+1 .. k+async_queue_size are
generated, and a group is trained at most `async_queue_size` policy versions after the one it started
under (batches are taken in launch order). Counting the batch in training matters: batch k+2 started
during step k would be sampled under weights one version too old (sampling it again at the sync threw
away a third of all sampled tokens at async_queue_size 1). Sync mode is the same rule with nothing ahead
(`batch_size` groups): each batch is sampled by the policy it trains. The weight sync of step k may
still run while batch k+1 is handed out and trains: both then count until their own `weights_updated`.

A group whose agent runner died (Ray restarts it) is launched again: same prompt, same group id, fresh
rollouts; a runner Ray no longer restarts stops the run.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ray.exceptions import ActorDiedError, RayActorError

from instar.agents.api import Task
from instar.checks import in_flight_groups, run_ahead_groups
from instar.config import RLConfig
from instar.contract import SamplingParams, Trajectory, read_jsonl
from instar.data.prompts import Prompt, PromptStream
from instar.runtime.agents import AGENT_MAX_RESTARTS


def group_tasks(prompt: Prompt, group_id: int, n: int, sampling: SamplingParams, id_prefix: str) -> list[Task]:
    """The ``n`` rollouts of one prompt, with rollout ids ``{id_prefix}0`` .. ``{id_prefix}{n-1}``; a seeded
    ``sampling`` gives rollout k the seed derived from its seed, ``group_id`` and k."""
    return [Task(prompt=prompt.messages, label=prompt.label, tools=prompt.tools, images=prompt.images,
                 metadata=prompt.metadata, chat=prompt.chat, prompt_index=prompt.index, group_id=group_id,
                 rollout_id=f"{id_prefix}{k}", sampling_params=sampling.derived(group_id, k)) for k in range(n)]


@dataclass
class Group:
    """One prompt's samples, as they came back (dropped rollouts already removed)."""

    group_id: int
    epoch: int  # of the prompt stream; -1 for replayed groups, which are not drawn from it
    prompt_index: int
    trajectories: list[Trajectory] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {**vars(self), "trajectories": [t.to_json() for t in self.trajectories]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Group:
        return cls(d["group_id"], d["epoch"], d["prompt_index"], [Trajectory.from_json(t) for t in d["trajectories"]])


@dataclass
class PoolState:
    """What a checkpoint keeps of the pool: finished groups not yet trained, and the next group id."""

    pending: list[Group] = field(default_factory=list)
    next_group_id: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"pending": [g.to_json() for g in self.pending], "next_group_id": self.next_group_id}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PoolState:
        return cls([Group.from_json(g) for g in d["pending"]], d["next_group_id"])


class Pool(Protocol):
    """Where the loop's batches come from: live rollouts (`RolloutPool`) or a dump (`ReplayPool`)."""

    async def next_batch(self, n: int) -> list[Group]:
        """The next ``n`` finished groups, oldest first."""

    def weights_updated(self) -> None:
        """The engines run the policy trained on the oldest batch handed out and not yet followed by its
        weights (in sync mode, generation starts again here); a batch the loop dropped is released so too."""

    def state(self) -> PoolState: ...

    def metrics(self) -> dict[str, float]:
        """Counts since the start of the run, for the step's metrics."""

    async def close(self) -> None: ...


RELAUNCH_DELAY_S = 1.0
"""Wait before launching a group again on a restarting agent runner, so a runner that cannot be reached
for a while is not asked in a tight loop."""


class RolloutPool:
    def __init__(self, agents: list[Any], stream: PromptStream, cfg: RLConfig, sampling: SamplingParams,
                 state: PoolState | None = None, generating: Callable[[bool], None] | None = None):
        """``state``: what a checkpoint kept (`state`); its pending groups are handed out first.
        ``generating`` is told whenever generation starts or stops: it runs while groups are in flight, or
        when a weight sync under way will launch more (a batch was handed out before the last one's
        weights arrived)."""
        self.agents, self.stream, self.cfg, self.sampling = agents, stream, cfg, sampling
        self.generating, self.told = generating, False
        state = state or PoolState()
        self.done: list[Group] = list(state.pending)
        self.next_group_id = state.next_group_id
        self.in_flight: dict[asyncio.Task, tuple[Group, list[Task], int, bool]] = {}  # + agent index, relaunched
        self.error: BaseException | None = None
        self.agent_restarts = self.requeued_groups = 0
        self.agents_down: set[int] = set()  # died, and no group finished on them since
        self.ahead, self.limit = run_ahead_groups(cfg), in_flight_groups(cfg)
        # groups of each batch handed out, until the engines have the weights trained on it (the next batch
        # may be handed out before: the weight sync runs while it trains)
        self.training: deque[int] = deque()

    def fill(self) -> None:
        """Launch groups up to the in-flight and run-ahead limits."""
        while (len(self.in_flight) < self.limit
               and len(self.in_flight) + len(self.done) + sum(self.training) < self.ahead):
            self._launch()

    def _launch(self) -> None:
        epoch, prompt = self.stream.next()
        gid = self.next_group_id
        self.next_group_id += 1
        tasks = group_tasks(prompt, gid, self.cfg.rollout.n_samples_per_prompt, self.sampling, f"g{gid}-s")
        self._start(Group(gid, epoch, prompt.index), tasks, gid % len(self.agents))

    def _start(self, group: Group, tasks: list[Task], agent: int, relaunch: bool = False) -> None:
        task = asyncio.ensure_future(self._run(self.agents[agent], tasks, RELAUNCH_DELAY_S if relaunch else 0.0))
        self.in_flight[task] = (group, tasks, agent, relaunch)
        task.add_done_callback(self._finished)
        self._tell()

    @staticmethod
    async def _run(agent: Any, tasks: list[Task], delay: float) -> list[Trajectory]:
        await asyncio.sleep(delay)
        return await agent.run_group.remote(tasks)

    def _finished(self, task: asyncio.Task) -> None:
        group, tasks, agent, relaunched = self.in_flight.pop(task)
        self._tell()
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            self.agents_down.discard(agent)
            group.trajectories = task.result()
            self.done.append(group)
            self.fill()
        elif isinstance(error, ActorDiedError):
            self.error = RuntimeError(f"agent runner {agent} is dead and Ray no longer restarts it (it died more "
                                      f"than {AGENT_MAX_RESTARTS} times this run); see its log above")
            self.error.__cause__ = error
        elif isinstance(error, RayActorError):
            # The runner died and Ray restarts it (user-code errors never get here: they drop one rollout)
            if agent not in self.agents_down:  # its other groups in flight died with it: one restart
                self.agent_restarts += 1
                self.agents_down.add(agent)
            if not relaunched:  # a relaunch may fail again while Ray restarts the runner: one requeue
                self.requeued_groups += 1
            self._start(group, tasks, agent, relaunch=True)
        else:  # raised by next_batch, in the loop
            self.error = error

    async def next_batch(self, n: int) -> list[Group]:
        """Wait until the `n` oldest groups (in launch order) have finished and return them; the rest stay for
        the next step. In launch order, not as they finish: a slow group taken one step later would be one
        version staler than the bound. Batches handed out count against the run-ahead bound until
        `weights_updated` releases them."""
        self.fill()
        while not self._oldest_done(n):
            if self.error is not None:
                raise RuntimeError(f"an agent runner failed: {self.error}") from self.error
            if not self.in_flight:
                raise RuntimeError("rollout pool is empty: no group in flight and too few finished")
            await asyncio.wait(list(self.in_flight), return_when=asyncio.FIRST_COMPLETED)
        self.done.sort(key=lambda g: g.group_id)
        batch, self.done = self.done[:n], self.done[n:]
        self.training.append(len(batch))
        self._tell()
        return batch

    def _oldest_done(self, n: int) -> bool:
        flying = min((group.group_id for group, *_ in self.in_flight.values()), default=None)
        return len(self.done) >= n and (flying is None or sum(g.group_id < flying for g in self.done) >= n)

    def weights_updated(self) -> None:
        if self.training:
            self.training.popleft()
        self.fill()
        self._tell()

    def _tell(self) -> None:
        now = bool(self.in_flight) or len(self.training) > 1
        if self.generating is not None and now != self.told:
            self.told = now
            self.generating(now)

    def state(self) -> PoolState:
        """Saved with checkpoints, so no finished group is lost and no group id is used twice."""
        return PoolState(list(self.done), self.next_group_id)

    def metrics(self) -> dict[str, float]:
        return {"faults/agent_restarts": float(self.agent_restarts),
                "faults/requeued_groups": float(self.requeued_groups)}

    async def close(self) -> None:
        for task in list(self.in_flight):
            task.cancel()
        await asyncio.gather(*self.in_flight, return_exceptions=True)


class ReplayPool:
    """`--train.rollout_replay_dir`: the batches of a rollout dump, step by step, instead of engines."""

    def __init__(self, dump_dir: str, start_step: int = 0):
        self.files = sorted(Path(dump_dir).glob("step_*.jsonl"))[start_step:]
        if not self.files:
            raise FileNotFoundError(f"no step_*.jsonl rollout dumps in {dump_dir!r} (past step {start_step}); "
                                    "write them with --train.rollout_dump_dir")

    async def next_batch(self, n: int) -> list[Group]:
        if not self.files:
            raise RuntimeError("the rollout dump has no more steps; lower --train.max_steps")
        groups: dict[int, Group] = {}
        for t in read_jsonl(str(self.files.pop(0))):
            groups.setdefault(t.group_id, Group(t.group_id, -1, t.prompt_index)).trajectories.append(t)
        return list(groups.values())

    def weights_updated(self) -> None:
        pass

    def state(self) -> PoolState:
        return PoolState()  # the dump is the state: a resumed replay starts at its step's file

    def metrics(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        pass
