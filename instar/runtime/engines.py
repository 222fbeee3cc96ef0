"""Rollout engines as Ray actors, and the thin proxy that lets a Router hold their handles.

Each actor hosts one engine (embedded PyTorch or vLLM) on its own asyncio loop, so requests from
every agent runner are continuously batched together. Weights arrive over a dedicated process group
(trainer rank 0 -> every engine), never through Ray's object store.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import ray
import torch

from instar.config import EngineConfig
from instar.contract import Generation, SamplingParams
from instar.engines.protocol import EngineLoad, PauseMode
from instar.train.launch import cpu_threads
from instar.train.weight_sync import open_sync_group, receive_weights


def make_engine(model_path: str, backend: str, cfg: EngineConfig, routing_replay: bool = False) -> Any:
    if backend == "embedded":
        from instar.engines.embedded import EmbeddedEngine

        return EmbeddedEngine.from_pretrained(model_path, cfg)
    if backend == "vllm":
        from instar.engines.vllm import VLLMEngine

        return VLLMEngine.from_pretrained(model_path, cfg, routing_replay=routing_replay)
    raise ValueError(f"--rollout.engine must be embedded or vllm, got {backend!r}")


@ray.remote
class EngineActor:
    def __init__(self, model_path: str, backend: str, cfg: EngineConfig, routing_replay: bool = False,
                 cpu_share: int = 1):
        threads = cpu_threads(cpu_share)  # see Cluster: how many processes compute at the same time
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        self.engine = make_engine(model_path, backend, cfg, routing_replay)
        self.group = None

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       session_id: str | None = None) -> Generation:
        return await self.engine.generate(prompt_token_ids, sampling_params, session_id)

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self.engine.update_weights(named_tensors, version)

    def load(self) -> EngineLoad:
        return self.engine.load()

    def version(self) -> int:
        return self.engine.version

    def stats(self) -> dict[str, float]:
        """Cumulative counters (tokens, busy seconds) where the engine keeps them."""
        return dict(getattr(self.engine, "stats", {}))

    async def join_weight_group(self, master_addr: str, master_port: int, rank: int, world_size: int,
                                device: str = "cpu") -> None:
        """Returns once trainer rank 0 and every engine joined; call on all of them concurrently. vLLM
        joins from inside its workers (one rank per tensor-parallel worker, from `rank` on)."""
        if hasattr(self.engine, "join_weight_group"):
            await self.engine.join_weight_group(open_sync_group, master_addr, master_port, rank, world_size, device)
        else:
            self.group = open_sync_group(master_addr, master_port, rank, world_size, device)

    async def receive_weights(self, version: int) -> None:
        """Receive one broadcast from trainer rank 0 and load it (the engine must be paused)."""
        if hasattr(self.engine, "receive_weights"):
            await self.engine.receive_weights(receive_weights, version)
        else:
            # the embedded engine copies each tensor before asking for the next: one bucket buffer, reused
            await self.engine.update_weights(receive_weights(self.group, reuse_buffer=True), version)

    async def close(self) -> None:
        if hasattr(self.engine, "close"):
            await self.engine.close()


class RemoteEngine:
    """The engine protocol over a Ray actor handle (what a Router in another process holds)."""

    def __init__(self, handle: Any):
        self.handle = handle

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       session_id: str | None = None) -> Generation:
        return await self.handle.generate.remote(prompt_token_ids, sampling_params, session_id)

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self.handle.pause.remote(mode)

    async def resume(self) -> None:
        await self.handle.resume.remote()

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self.handle.update_weights.remote(list(named_tensors), version)

    async def load(self) -> EngineLoad:
        return await self.handle.load.remote()
