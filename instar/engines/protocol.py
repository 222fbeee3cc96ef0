"""The one token-level protocol every rollout engine speaks: token ids in, token ids out.

No text crosses it. Each sampled token comes back with its logprob and the policy version that
sampled it, so partial rollouts (weights swapped mid-request) stay exact.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from instar.contract import Generation, SamplingParams

PauseMode = Literal["keep", "restart", "abort", "wait"]
"""keep: freeze in-flight requests and continue them after `resume` (partial rollout: a turn's tokens
may come from two policy versions); restart: drop what in-flight requests sampled and sample them again
from their start after `resume` (every turn from one version, no waiting); abort: finish them now with
finish_reason "abort" (tokens so far are returned); wait: stop admitting, let running ones finish."""


@dataclass
class EngineLoad:
    """What the router needs to place a new session."""

    queued: int
    running: int

    @property
    def total(self) -> int:
        return self.queued + self.running


@runtime_checkable
class Engine(Protocol):
    """A rollout engine. All methods are coroutines except `load` and `version`."""

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       session_id: str | None = None) -> Generation:
        """Sample one turn after ``prompt_token_ids``. Per sampled token: its logprob (of the processed
        or the raw distribution, per ``--vllm.logprobs_mode``; defined in `instar.engines.sampling`),
        the policy version that sampled it and, for MoE models, its routed experts (moe_layers, top_k).
        ``session_id`` groups the turns of one rollout (prefix-cache reuse, router affinity)."""
        ...

    async def pause(self, mode: PauseMode = "keep") -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights (HF parameter names) and set the policy version; call while paused."""
        ...

    def load(self) -> EngineLoad: ...

    @property
    def version(self) -> int: ...
