"""The trainer ranks as Ray actors: one ``TrainWorker`` per rank, and a group object whose async
methods fan each call out to every rank and gather the answers. Logprob and value passes split the
samples by tokens; a training batch goes to every rank whole (once, through the object store), and
each rank takes its share of each update.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError
from torch import Tensor

from instar.config import RLConfig
from instar.contract import Sample
from instar.runtime.placement import Slot, nodes, plan, ray_options
from instar.train import checkpoint
from instar.train.batch import StepInputs, identity, shard_samples
from instar.train.launch import GenerationFlag, cpu_threads, reserve_port
from instar.train.model import decoder_layers
from instar.train.weight_sync import Transport
from instar.train.worker import LossFn, TrainStats, TrainWorker, ValueLossFn


class _Rank(TrainWorker):
    def __init__(self, *args: Any, cpu_share: int = 1, idle_share: int | None = None,
                 generation: str | None = None, **kwargs: Any) -> None:
        """``cpu_share``: how many processes compute at once on this node (see Cluster); with ``generation``
        (a `GenerationFlag`'s path) only while it is set, and ``idle_share`` of them otherwise."""
        self.busy_threads = cpu_threads(cpu_share)
        torch.set_num_threads(self.busy_threads)
        super().__init__(*args, **kwargs)
        self.flag = None if generation is None or idle_share is None else GenerationFlag(generation)
        self.idle_threads = cpu_threads(idle_share or cpu_share)
        if self.flag is not None:
            self.before_micro_batch = self._pick_threads

    def init(self, *args: Any) -> None:
        super().init(*args)
        if self.flag is not None:  # look again at every layer, forward and backward: an update may be long
            for model in (self.policy, self.ref, self.critic):
                for layer in decoder_layers(model) if model is not None else []:
                    layer.register_forward_hook(self._after_layer)

    def _pick_threads(self) -> None:
        n = self.busy_threads if self.flag.is_set() else self.idle_threads
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def _after_layer(self, module: Any, args: Any, output: Any) -> None:
        self._pick_threads()
        self.threads_used.append(torch.get_num_threads())
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, Tensor) and out.requires_grad:  # and when backward reaches this layer
            out.register_hook(lambda grad: self._after_layer(module, args, None))

    def address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), reserve_port()


class TrainerGroup:
    def __init__(self, ranks: list[Any], cfg: RLConfig) -> None:
        """``cfg``: the run's; its data-parallel ranks and --train.share_prefix shard the per-sample passes."""
        self.ranks, self.cfg = ranks, cfg
        self.checkpoints = os.path.join(cfg.ckpt.output_dir, "checkpoints")  # named when a rank dies
        self.broken = False  # a call failed: ranks may be stuck in a collective, shutdown kills them

    @classmethod
    async def start(cls, cfg: RLConfig, ref_path: str | None = None, critic: bool = False,
                    slots: list[Slot] | None = None, generation: str | None = None) -> TrainerGroup:
        """Start ``--fsdp.num_ranks`` actors (one GPU each when the cluster has GPUs), join them into
        one process group rooted at rank 0's node, load and shard the models. Each rank computes with
        the cores of its node divided by its slot's ``cpu_share``. ``slots``: where each rank runs (the
        cluster's placement; by default the trainer alone, from the driver's node on). ``generation``: a
        `GenerationFlag` on the ranks' node; while it is unset the ranks share the node's cores among
        themselves only."""
        slots = slots or plan(nodes(), 0, 0, cfg.fsdp.num_ranks).ranks
        actor = ray.remote(_Rank)
        # the critic's section only when asked for: only an RLConfig has one
        ranks = [actor.options(**ray_options(s)).remote(
            cfg.actor, cfg.fsdp, cfg.train, cfg.critic if critic else None, ref_path, cfg.cpu, cpu_share=s.cpu_share,
            idle_share=sum(o.node_id == s.node_id for o in slots), generation=generation) for s in slots]
        addr, port = await ranks[0].address.remote()
        group = cls(ranks, cfg)
        await group._all("init", *[(r, len(ranks), addr, port) for r in range(len(ranks))])
        return group

    def _all(self, method: str, *per_rank: tuple) -> Coroutine[Any, Any, list[Any]]:
        """Call ``method`` on every rank now, rank r with ``per_rank[r]`` (or ``per_rank[0]`` for all); await
        the result for their answers. A call made later runs after this one on every rank (Ray keeps a
        caller's calls to an actor in order)."""
        refs = [getattr(r, method).remote(*(per_rank[i] if len(per_rank) > 1 else per_rank[0] if per_rank else ()))
                for i, r in enumerate(self.ranks)]
        return self._gather(refs)

    async def _gather(self, refs: list[Any]) -> list[Any]:
        try:  # all at once: a dead rank leaves the others waiting in a collective (30 min to time out)
            return await asyncio.gather(*(self._one(rank, ref) for rank, ref in enumerate(refs)))
        except BaseException:
            self.broken = True
            raise

    async def _one(self, rank: int, ref: Any) -> Any:
        try:
            return await ref
        except RayActorError as e:
            last = checkpoint.latest(self.checkpoints)
            resume = (f"the latest checkpoint is {last}: resume from it with --ckpt.load_enable true" if last else
                      f"no checkpoint was saved in {self.checkpoints} yet (--ckpt.save_steps): start over")
            raise RuntimeError(f"trainer rank {rank} died ({type(e).__name__}); the run cannot go on without "
                               f"it; {resume}") from e

    async def _per_sample(self, method: str, samples: list[Sample], *rest: Any) -> list[Tensor]:
        """One shard per data-parallel rank; the cp x tp ranks of a data shard (consecutive ranks, see
        `instar.train.parallel`) compute it together, and the first of them answers."""
        group = len(self.ranks) // self.cfg.fsdp.data_size
        shards = shard_samples([len(s.token_ids) for s in samples], self.cfg.fsdp.data_size,
                               [identity(s) for s in samples] if self.cfg.train.share_prefix else None)
        results = await self._all(method, *[([samples[i] for i in shards[r // group]], *rest)
                                            for r in range(len(self.ranks))])
        out = {i: v for shard, values in zip(shards, results[::group]) for i, v in zip(shard, values)}
        return [out[i] for i in range(len(samples))]

    async def compute_logprobs(self, samples: list[Sample], temperature: float = 1.0,
                               model: str = "policy") -> list[Tensor]:
        """Per-token logprobs of every sample (see ``TrainWorker.compute_logprobs``), in input order."""
        return await self._per_sample("compute_logprobs", samples, temperature, model)

    async def compute_values(self, samples: list[Sample]) -> list[Tensor]:
        return await self._per_sample("compute_values", samples)

    async def train_policy(self, samples: list[Sample], loss_fn: LossFn, inputs: StepInputs | None = None,
                           temperature: float = 1.0, updates: list[list[int]] | None = None,
                           forward_only: list[int] | None = None) -> TrainStats:
        """The policy's updates on this batch (see ``TrainWorker.train_policy``); the batch is stored once
        in the object store and every rank reads it (Ray resolves a reference passed as an argument); the
        metrics are global (rank 0's copy)."""
        shared = (ray.put(samples), loss_fn, ray.put(inputs or StepInputs()), temperature, updates, forward_only)
        return (await self._all("train_policy", shared))[0]

    async def train_critic(self, samples: list[Sample], loss_fn: ValueLossFn, inputs: StepInputs,
                           updates: list[list[int]] | None = None) -> TrainStats:
        return (await self._all("train_critic", (ray.put(samples), loss_fn, ray.put(inputs), updates)))[0]

    async def open_weight_sync(self, master_addr: str, master_port: int, world_size: int,
                               transport: Transport = "gloo") -> None:
        """Rank 0 joins the weight-sync group; await it together with the engines joining."""
        await self._all("open_weight_sync", (master_addr, master_port, world_size, transport))

    def send_weights(self, bucket_mb: float = 256.0, background: bool = False) -> Coroutine[Any, Any, dict[str, float]]:
        """Broadcast the policy to the engines (await together with their receive) for rank 0's stats. Sent
        at once: the trainer's next call runs after it, ``background`` or not."""
        return _first(self._all("send_weights", (bucket_mb, background)))

    async def save(self, root: str, extra: dict[str, Any] | None = None, max_num: int = 0) -> str:
        return (await self._all("save", (root, extra, max_num)))[0]

    async def load(self, path: str) -> dict[str, Any]:
        return (await self._all("load", (path,)))[0]

    async def export_hf(self, out_dir: str) -> str:
        return (await self._all("export_hf", (out_dir,)))[0]

    async def shutdown(self) -> None:
        if not self.broken:
            await self._all("shutdown")
        for r in self.ranks:
            ray.kill(r)


async def _first(answers: Coroutine[Any, Any, list[Any]]) -> Any:
    return (await answers)[0]
