"""Everything the loop talks to, placed on Ray: rollout engines, agent runners, trainer ranks, and the
dedicated weight-sync group from trainer rank 0 to every engine; `SyncPlan` says when and how it is used.

Ray restarts a crashed engine (`EngineActor`); the restarted one refuses requests until the next weight
sync forms a new group with it and sends it the policy. A dead trainer rank stops the run
(`TrainerGroup`); agent runners are the pool's concern (`RolloutPool`)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch.distributed as dist
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from instar.algo import registered
from instar.checks import choose_engine
from instar.config import ConfigError, RLConfig, TrainConfig
from instar.engines import PauseMode
from instar.runtime.agents import AgentActor
from instar.runtime.engines import ENGINE_MAX_RESTARTS, EngineActor
from instar.runtime.placement import Placement, nodes, plan, ray_options
from instar.runtime.trainer_group import TrainerGroup
from instar.train.launch import GenerationFlag
from instar.train.weight_sync import ABANDONED

CLOSE_TIMEOUT_S = 10.0
"""How long the agent runners and engines get to close before they are killed."""


@dataclass(frozen=True)
class SyncPlan:
    """When and how the policy goes to the engines: decided here, once, from the config; the loop and
    `Cluster` carry it out.

    Each step's sync starts once its updates are done. The loop waits for it before the next batch (`wait`)
    when nothing may be generated ahead (--train.force_sync_mode, --train.async_queue_size 0): nothing could
    overlap it. Otherwise the next batch trains while the weights travel, the trainer taking its next call
    as soon as it holds a copy of them (`background`).
    Requests in flight at a step's sync (`in_flight`) are kept with --train.partial_rollout_enable: paused
    and resumed, their tokens then span two versions. Otherwise they drain: they end under the weights they
    started with, and the embedded engine keeps the new weights aside until then, so the trainer does not
    wait (sampling them again instead threw away a third of all sampled tokens: bench/rl_step.py).
    A resume's sync drains (nothing is in flight yet); an engine restore sends the weights the others
    already hold, so their requests are kept. Both are awaited whole, the trainer sending in the foreground."""

    wait: bool
    in_flight: PauseMode
    background: bool = True
    resume_in_flight: PauseMode = "drain"
    restore_in_flight: PauseMode = "keep"

    @staticmethod
    def from_config(train: TrainConfig) -> SyncPlan:
        return SyncPlan(wait=train.force_sync_mode or train.async_queue_size == 0,
                        in_flight="keep" if train.partial_rollout_enable else "drain")


class Cluster:
    def __init__(self, cfg: RLConfig, train: bool = True, reward_fns: Sequence[Callable[..., Any]] = ()):
        """``train=False`` starts only engines and agent runners (`instar eval`); ``reward_fns``: reward
        functions given to `instar.rl` as callables."""
        self.cfg, self.train, self.reward_fns = cfg, train, reward_fns
        needs = registered(cfg.algo.advantage.estimator).needs
        self.has_ref, self.has_critic = cfg.algo.kl.coef > 0 or needs.ref, needs.critic
        self.started_ray = False
        self.engine_restarts = 0  # seen at weight syncs, counted in their metrics
        self.generation: GenerationFlag | None = None  # set while rollouts generate, for trainer ranks beside them
        self.plan = SyncPlan.from_config(cfg.train)

    async def __aenter__(self) -> Cluster:
        self.engines, self.agents, self.trainer = [], [], None
        try:
            return await self._start()
        except BaseException:
            await self.__aexit__()
            raise

    async def _start(self) -> Cluster:
        cfg = self.cfg
        self._init_ray()
        replay = bool(cfg.train.rollout_replay_dir)  # training from a dump: no engines, no agents
        gpu = ray.cluster_resources().get("GPU", 0) > 0
        engine = self._choose_engine(gpu, replay)
        where = self._place(engine, gpu, replay)
        # a rollout engine actor per placement slot, and the agent runners, each routing to every engine
        self.engines = [EngineActor.options(**ray_options(s)).remote(
            cfg.actor.model_name_or_path, engine, cfg.engine, cfg.train.routing_replay, cpu_share=s.cpu_share,
            cpu=cfg.cpu) for s in where.engines]
        self.agents = [] if replay else [AgentActor.options(num_cpus=0).remote(cfg, self.engines, self.reward_fns)
                                         for _ in range(cfg.rollout.num_agent_runners)]
        if self.train:
            await self._start_trainer(gpu, where)
        return self

    def _init_ray(self) -> None:
        """Start a local Ray instance, or join --ray.address; either stays as it is when Ray is already up."""
        cfg = self.cfg
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            try:
                ray.init(address=cfg.ray.address, include_dashboard=False, log_to_driver=True,
                         runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
                         **({} if cfg.ray.address else {"num_cpus": os.cpu_count() or 1}))
            except ConnectionError as e:
                if not cfg.ray.address:
                    raise
                # Ray sends its auth token to an address given explicitly only in token mode
                raise ConfigError(f"cannot connect to the Ray cluster at --ray.address {cfg.ray.address} ({e}); if "
                                  "`ray start` turned token authentication on (its default once ~/.ray/auth_token "
                                  "exists), run instar with RAY_AUTH_MODE=token and that token (the file, or "
                                  "RAY_AUTH_TOKEN)") from e

    def _choose_engine(self, gpu: bool, replay: bool) -> str:
        """The rollout engine, and the weight-sync ranks per engine it implies."""
        cfg = self.cfg
        engine = choose_engine(cfg, gpu, importlib.util.find_spec("vllm") is not None)
        if not replay:
            print(f"instar: rollout engine {engine} (--rollout.engine {cfg.rollout.engine}, "
                  f"{'a GPU' if gpu else 'no GPU'} in the Ray cluster)", flush=True)
        if engine == "vllm":
            from instar.engines.vllm import check_engine_config

            check_engine_config(cfg.engine, "cuda" if gpu else "cpu", cfg.train.routing_replay)
        # weight-sync ranks per engine: one per tensor-parallel worker (also the GPUs an engine takes)
        self.per_engine = cfg.engine.tensor_parallel_size if engine == "vllm" else 1
        return engine

    def _place(self, engine: str, gpu: bool, replay: bool) -> Placement:
        """Where the engines and trainer ranks run (said when it is more than one CPU node)."""
        cfg, vllm = self.cfg, engine == "vllm"
        # Threads: in sync mode generation and training take turns, so each gets every core of its node;
        # otherwise engines and trainer ranks on one node compute at the same time and share its cores
        # (bench/rl_step.py measures it).
        engines, ranks = 0 if replay else cfg.engine.num_engines, cfg.fsdp.num_ranks if self.train else 0
        where = plan(nodes(), engines, self.per_engine if gpu else 0, ranks, cfg.ray.placement,
                     cfg.train.force_sync_mode)
        self.transport = where.transport
        if len({s.node_id for s in where.engines + where.ranks}) > 1 or gpu:
            print(f"instar: placement {where.layout} (--ray.placement {cfg.ray.placement}): engines on nodes "
                  f"{[s.node_id[:8] for s in where.engines]}, trainer ranks on {[s.node_id[:8] for s in where.ranks]}, "
                  f"weights by {where.transport}", flush=True)
        if where.layout == "colocated" and vllm and gpu and where.ranks and cfg.engine.gpu_memory_utilization > 0.5:
            print(f"instar: warning: colocated, vLLM may take {cfg.engine.gpu_memory_utilization:.0%} of each GPU the "
                  "trainer shares; lower --engine.gpu_memory_utilization if the trainer runs out of memory", flush=True)
        return where

    async def _start_trainer(self, gpu: bool, where: Placement) -> None:
        """The trainer ranks, and the weight-sync group from rank 0 to the engines."""
        cfg = self.cfg
        if where.layout == "colocated" and not gpu and self.engines and not cfg.train.force_sync_mode:
            # the trainer ranks share the cores with generation only while it runs (async mode: a batch
            # generated ahead may finish before the update of a long one does)
            self.generation = GenerationFlag()
        ref = (cfg.actor.ref_model_name_or_path or cfg.actor.model_name_or_path) if self.has_ref else None
        self.trainer = await TrainerGroup.start(cfg, ref_path=ref, critic=self.has_critic, slots=where.ranks,
                                                generation=self.generation and self.generation.path)
        if self.generation is not None:
            self.generation.unlink()  # every rank has it open now
        if self.engines:
            await self._open_weight_sync()

    async def _open_weight_sync(self) -> None:
        """Trainer rank 0 and every engine join a new weight-sync group (a member's old one is dropped);
        its store lives on trainer rank 0's node, at a port free there."""
        addr, port = await self.trainer.ranks[0].address.remote()
        world, per = 1 + len(self.engines) * self.per_engine, self.per_engine
        await asyncio.gather(self.trainer.open_weight_sync(addr, port, world, self.transport),
                             *(self._call(i, "join_weight_group", addr, port, 1 + i * per, world, self.transport)
                               for i in range(len(self.engines))))
        self.sync_store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=60))

    async def _call(self, i: int, method: str, *args: Any) -> Any:
        """Engine ``i``'s ``method``; while Ray restarts the engine, asked again until the new one answers."""
        while True:
            try:
                return await getattr(self.engines[i], method).remote(*args)
            except ActorUnavailableError:
                await asyncio.sleep(1.0)
            except ActorDiedError as e:
                raise RuntimeError(f"rollout engine {i} is dead and Ray no longer restarts it (it died more than "
                                   f"{ENGINE_MAX_RESTARTS} times this run); see its log above") from e

    async def sync_weights(self, version: int, in_flight: PauseMode) -> dict[str, float]:
        """Pause the engines (``in_flight``: what they do with the requests they hold, `SyncPlan`), broadcast
        trainer rank 0's weights to all of them, set their version, resume."""
        return await (await self.start_sync(version, in_flight))

    async def start_sync(self, version: int, in_flight: PauseMode, background: bool = False,
                         ) -> Coroutine[Any, Any, dict[str, float]]:
        """`sync_weights` in two halves: this returns once every call of the sync is sent (the trainer's next
        call runs after its send) and every engine holds the requests that arrive from then on until it has
        the weights (`EngineActor.prepare_sync`); await what it returns for the end, when it has them.
        ``background``: the trainer takes its next call as soon as it holds a copy of the weights
        (`TrainWorker.send_weights`), so it may train while they travel."""
        if not self.engines:
            return _nothing()
        # From here the engines hold new requests until these weights are loaded: new groups may start now
        restarted = sum(await asyncio.gather(*(self._call(i, "prepare_sync") for i in range(len(self.engines)))))
        for agent in self.agents:  # their rollouts' timeouts stop while the engines hold requests
            agent.hold.remote(True)
        if restarted:  # a restarted engine is in no group: every member joins a new one
            self.engine_restarts += restarted
            await self._open_weight_sync()
        t0 = time.perf_counter()
        # Each engine pauses, receives and resumes in one call: it answers between two of its steps.
        sent = self.trainer.send_weights(background=background)
        received = [e.sync_weights.remote(version, in_flight) for e in self.engines]

        async def arrived() -> dict[str, float]:
            calls = [asyncio.ensure_future(call) for call in (sent, *received)]
            # an engine that died in the sync leaves the others waiting in its broadcast: they abandon it when the
            # group's store says so, and all sync again once Ray has restarted it (a new group, with it)
            await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
            if any(call.done() and call.exception() for call in calls):
                self.sync_store.set(ABANDONED, "1")
            results = await asyncio.gather(*calls, return_exceptions=True)
            if errors := [r for r in results if isinstance(r, BaseException)]:
                if not any(isinstance(error, RayActorError) for error in errors):
                    raise errors[0]
                return await (await self.start_sync(version, in_flight))
            for agent in self.agents:
                agent.hold.remote(False)
            return results[0] | {"weight_sync/engine_wait_s": max(results[1:]),
                                 "weight_sync/transfer_s": time.perf_counter() - t0,
                                 "faults/engine_restarts": float(self.engine_restarts)}
        return arrived()

    async def sleep_engines(self) -> None:
        """--engine.enable_sleep_mode: the engines free their GPU memory for the trainer until the weight sync."""
        await asyncio.gather(*(self._call(i, "sleep") for i in range(len(self.engines))))

    async def restore_engines(self, version: int) -> None:
        """Send the weights now if an engine was restarted: with one engine, nothing is generated until then."""
        if any(await asyncio.gather(*(self._call(i, "needs_weights") for i in range(len(self.engines))))):
            await self.sync_weights(version, self.plan.restore_in_flight)

    async def __aexit__(self, *exc: Any) -> None:
        async def closing() -> None:  # agents first: they cancel their rollouts while the engines still answer
            await asyncio.gather(*(a.close.remote() for a in self.agents), return_exceptions=True)
            await asyncio.gather(*(e.close.remote() for e in self.engines), return_exceptions=True)

        # an engine stuck in a broadcast from a dead trainer rank would answer only at the group's timeout
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(closing(), CLOSE_TIMEOUT_S)
        for actor in [*self.agents, *self.engines]:  # on a shared cluster they would outlive the run
            ray.kill(actor)
        if self.trainer is not None:
            await self.trainer.shutdown()
        if self.started_ray:
            ray.shutdown()
        if self.generation is not None:
            self.generation.close()


async def _nothing() -> dict[str, float]:
    return {}
