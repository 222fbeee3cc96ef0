"""A request in the embedded engine's scheduler, and what an image prompt adds to it: the image tokens'
identity for prefix sharing, their multimodal rotary positions, and the vision tower's features, computed
once per image and kept until the request's cache goes stale."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch
from torch import nn

from instar.contract import Generation, ImageInputs, SamplingParams


@dataclass(eq=False)
class Request:
    ids: list[int]  # prompt, then every sampled token
    prompt_len: int
    params: SamplingParams
    session_id: str | None
    future: asyncio.Future
    slot: int = -1
    cached: int = 0  # leading ids whose keys/values are in the slot (and valid for the current weights)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed: list[torch.Tensor] = field(default_factory=list)  # (moe_layers, top_k) per routed sampled token
    finish_reason: str | None = None
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # set on each sampled token and when finished
    previous: bool = False  # started before the weights now in use: it finishes on the previous model (drain)
    images: ImageInputs | None = None
    keys: list[int] | None = None  # the prompt's identity: its ids, image tokens by content (`ImageInputs.keys`)
    rope: torch.Tensor | None = None  # (3, prompt_len) multimodal rotary positions
    delta: int = 0  # rotary position minus index of every token after the prompt's last image
    features: dict[int, torch.Tensor] = field(default_factory=dict)  # image index -> (1 + levels, tokens, hidden)

    @property
    def num_sampled(self) -> int:
        return len(self.ids) - self.prompt_len

    def identity(self, end: int) -> list:
        """What the first ``end`` tokens are, for prefix sharing: the ids, with each image token
        standing for its image's content (images alike in ids differ in pixels)."""
        return self.ids[:end] if self.keys is None else (self.keys + self.ids[self.prompt_len:])[:end]

    def record_routing(self, rows: torch.Tensor) -> None:
        """Keep the routing ``rows`` of the fed positions ``cached..`` that hold sampled tokens (re-fed ones are
        overwritten)."""
        first = max(self.cached - self.prompt_len, 0)  # the first fed sampled token's index
        sampled_rows = rows[max(self.prompt_len - self.cached, 0):]
        self.routed[first: first + len(sampled_rows)] = list(sampled_rows.unbind(0))

    def generation(self, routing_shape: tuple[int, int] | None) -> Generation:
        """What it sampled; for an MoE model (``routing_shape``: moe layers, top-k) with each sampled token's
        routing, -1 for one never fed through the model (only after an abort)."""
        routed = torch.full((self.num_sampled, *routing_shape), -1, dtype=torch.int64) if routing_shape else None
        if self.routed:  # recorded only when the model has MoE layers
            routed[: len(self.routed)] = torch.stack(self.routed)
        return Generation(token_ids=self.ids[self.prompt_len:], logprobs=self.logprobs, versions=self.versions,
                          finish_reason=self.finish_reason, routed_experts=routed)

    def rope_of(self, start: int, end: int) -> torch.Tensor:
        """Rotary positions (3, end - start) of tokens start..end."""
        if self.rope is None:
            return torch.arange(start, end).expand(3, -1)
        tail = torch.arange(max(start, self.prompt_len), end) + self.delta
        return torch.cat([self.rope[:, start:end], tail.expand(3, -1)], dim=1)


def attach_images(request: Request, images: ImageInputs) -> None:
    """Check the prompt's images against its placeholder tokens and derive what the scheduler needs."""
    images.validate(request.ids, "prompt")
    request.images, request.rope = images, images.positions(request.ids)
    request.delta = int(request.rope.max()) + 1 - request.prompt_len
    request.keys = images.keys(request.ids)


def image_features(model: nn.Module, request: Request) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Row indices and features of the image tokens among ``request``'s uncached tokens, running the
    vision tower once for each image not yet seen (again after a weight update)."""
    if request.images is None or request.cached >= request.prompt_len:  # decoding: no image token is new
        return None
    runs = request.images.runs(request.ids[: request.prompt_len])  # a sampled placeholder id is no image
    fed = [(k, start, end) for k, (start, end) in enumerate(runs) if end > request.cached]  # images with new tokens
    if need := [k for k, _, _ in fed if k not in request.features]:
        parts = request.images.split()
        inputs = ImageInputs.cat([parts[k] for k in need])
        out = model.model.get_image_features(inputs.pixel_values.to(model.device, model.dtype),
                                             inputs.grid_thw.to(model.device), return_dict=True)
        levels = [out.pooler_output, *out.deepstack_features]
        for j, k in enumerate(need):
            request.features[k] = torch.stack([level[j] for level in levels])
    at = [torch.arange(max(start, request.cached), end) - request.cached for _, start, end in fed]
    features = [request.features[k][:, max(0, request.cached - start):] for k, start, _ in fed]
    return (torch.cat(at), torch.cat(features, dim=1)) if at else None
