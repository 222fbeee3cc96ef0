"""The one token-level protocol every rollout engine speaks: token ids in, token ids out.

No text crosses it. Each sampled token comes back with its logprob and the policy version that
sampled it, so partial rollouts (weights swapped mid-request) stay exact.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from instar.contract import Generation, ImageInputs, SamplingParams

PauseMode = Literal["keep", "drain", "abort"]
"""keep: freeze in-flight requests and continue them after `resume` (partial rollout: a turn's tokens
may come from two policy versions); drain: in-flight requests finish on the weights they started with
and new ones run on the new weights (every turn from one version; the embedded engine runs both at once,
from a second copy of the model; vLLM's pause returns once they finished, new requests waiting for
`resume`); abort: finish them now with finish_reason "abort" (tokens so far are returned). New requests
wait for `resume` after keep and abort."""


@dataclass
class EngineLoad:
    """What the router needs to place a new session."""

    queued: int
    running: int

    @property
    def total(self) -> int:
        return self.queued + self.running


@dataclass
class Sampled:
    """Tokens a streamed request sampled: its sampled ids from position ``start`` on."""

    start: int
    token_ids: list[int]


def check_prompt(ids: list[int], vocab: int, max_len: int, max_len_name: str) -> None:
    """Refuse a prompt an engine cannot sample after: empty, out of the vocabulary, or leaving no room."""
    if not ids:
        raise ValueError("generate needs a non-empty prompt_token_ids")
    if min(ids) < 0 or max(ids) >= vocab:
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise ValueError(f"prompt token id {bad} is outside the model's vocabulary [0, {vocab})")
    if len(ids) >= max_len:
        raise ValueError(f"prompt has {len(ids)} tokens; the engine allows at most {max_len - 1} before the first "
                         f"sampled token ({max_len_name})")


class Sampler(Protocol):
    """What the chat server samples from: one engine, or a `Router` in front of several (and what a
    Router places sessions on)."""

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       session_id: str | None = None, images: ImageInputs | None = None) -> Generation:
        """Sample one turn after ``prompt_token_ids``. Per sampled token: its logprob (of the processed
        or the raw distribution, per ``--engine.logprobs_mode``; defined in `instar.engines.sampling`),
        the policy version that sampled it and, for MoE models, its routed experts (moe_layers, top_k).
        ``session_id`` groups the turns of one rollout (prefix-cache reuse, router affinity). ``images``
        (vision-language models): the images whose expanded placeholder tokens are in the prompt."""

    def stream(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
               session_id: str | None = None, images: ImageInputs | None = None,
               ) -> AsyncIterator[Sampled | Generation]:
        """`generate`, as the engine samples: `Sampled` increments, then the `Generation` (the record;
        the increments only show progress). Closing the iterator early cancels the request."""

    def release(self, session_id: str) -> None:
        """The session has ended: forget its placement and cached prefix (it may not come back)."""

    def load(self) -> EngineLoad | Awaitable[EngineLoad]:
        """Queued and running requests (an awaitable over Ray), for placing new sessions."""


class Engine(Sampler, Protocol):
    """A rollout engine. Control calls come from the driver, one engine at a time (`Cluster`)."""

    stats: dict[str, float]
    """Counters since start (prompt_tokens, prefix_hit_tokens, sampled_tokens; busy_seconds and steps where known)."""

    version: int  # the policy version of the weights new requests sample (set by `update_weights`)

    def load(self) -> EngineLoad: ...  # in process: answered at once

    async def pause(self, mode: PauseMode = "keep") -> None: ...

    async def resume(self) -> None: ...

    async def sleep(self) -> None:
        """Release what the engine holds on its devices until the next weight update (--engine.enable_sleep_mode)."""

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights (HF parameter names) and set the policy version; call while paused."""

    async def join_weight_group(self, open_group: Callable, master_addr: str, master_port: int, first_rank: int,
                                world_size: int, transport: str) -> None:
        """Join trainer rank 0's broadcast group (ranks from ``first_rank``, one per engine worker) with
        ``open_group`` (`instar.train.weight_sync.open_sync_group`); returns once every member joined."""

    async def receive_weights(self, receive: Callable, version: int) -> None:
        """Receive one broadcast with ``receive`` (`instar.train.weight_sync.receive_weights`), load it and
        set the policy version; call while paused."""

    async def close(self) -> None:
        """Abort every request and free the engine; it takes no new requests."""


class StepAccelerator(Protocol):
    """What an optional accelerator computes of the embedded engine's step in place of its plain PyTorch path
    (`kv_model.forward`, `sampling.sample`): the CPU accelerator's (instar/cpu, --cpu.enable) is the one there is.
    The engine holds one or none; each method computes what the torch path computes, up to float rounding."""

    def takes_layer(self, layer: torch.nn.Module) -> bool:
        """Whether it computes this decoder layer around attention (`before_attention`, `after_attention`)."""

    def before_attention(self, layer: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q (N, heads, d), rotated k and v (N, kv_heads, d) of the packed hidden states ``h``."""

    def after_attention(self, layer: torch.nn.Module, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input ``h`` and attention's output ``o`` (N, heads * d)."""

    def logits(self, h: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor | None:
        """The final norm and LM head of the rows ``h`` (B, hidden), or None to leave them to torch."""

    def takes_decode(self, q: torch.Tensor, cache: torch.Tensor) -> bool:
        """Whether `decode` computes the attention of these single-token rows over this cache."""

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
               lengths: torch.Tensor, span: int, scale: float, new: tuple[torch.Tensor, torch.Tensor] | None = None,
               ) -> torch.Tensor:
        """Attention of ``q (rows, heads, d)``, row r over the first ``lengths[r]`` keys of cache slot ``slots[r]``;
        ``new``: the rows' keys and values of this step, written at each row's last position first."""

    def sample(self, logits: torch.Tensor, u: torch.Tensor, keys: torch.Tensor | None,
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Tokens and logprobs of rows at temperature 1 with no filter, from the uniform draws ``u`` or, given the
        seeded rows' ``keys``, by `sampling.race`; or None to leave them to torch."""
