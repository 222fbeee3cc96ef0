"""The token-first records that cross every process boundary, and their invariant checks.

A trajectory is one or more segments; a segment is a flat token sequence whose aligned fields say
which tokens were sampled (``action_mask``), with which log-probability (``rollout_logprobs``) and
by which policy version (``versions``). Nothing here decodes text: the ids *are* the data.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch

NO_VERSION = -1  # `versions` value on tokens the policy did not sample (prompt, observations)


class ContractError(ValueError):
    """A record breaks the token-first contract; the message names the field, index and value."""


@dataclass
class SamplingParams:
    """How an engine samples one turn. ``top_k <= 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ContractError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ContractError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ContractError(f"SamplingParams.min_p must be in [0, 1), got {self.min_p}")
        if self.max_tokens < 1:
            raise ContractError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def derived(self, *parts: object) -> SamplingParams:
        """With the seed derived from this seed and ``parts`` (the same in every process); unseeded stays unseeded."""
        if self.seed is None:
            return self
        digest = hashlib.blake2b(repr((self.seed, *parts)).encode(), digest_size=8).digest()
        return self.replace(seed=int.from_bytes(digest) >> 1)  # < 2**63, what torch and vLLM take


@dataclass
class Generation:
    """What an engine returns for one request: the sampled ids and, per sampled token, its logprob,
    the policy version that sampled it and (MoE) its routed experts, shaped (tokens, layers, top_k)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" (a stop id was sampled), "length" (max_tokens), "abort"
    routed_experts: torch.Tensor | None = None


@dataclass
class ImageInputs:
    """The images of a token sequence as the model's image processor made them (Qwen-VL layout):
    ``pixel_values`` (patches, channels x temporal x patch x patch) float32 and ``grid_thw`` (images, 3),
    each image's patch grid, in the order of their placeholder runs in the token ids. In the ids each
    image is one run of ``t * h * w / merge**2`` copies of ``token_id`` (one per merged patch)."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    token_id: int
    merge: int = 2

    @property
    def counts(self) -> list[int]:
        """Placeholder tokens of each image."""
        return (self.grid_thw.prod(1) // self.merge ** 2).tolist()

    def split(self) -> list[ImageInputs]:
        """One record per image."""
        patches = self.pixel_values.split(self.grid_thw.prod(1).tolist())
        return [ImageInputs(p, g[None], self.token_id, self.merge) for p, g in zip(patches, self.grid_thw)]

    @staticmethod
    def cat(images: list[ImageInputs]) -> ImageInputs | None:
        """The images one after the other (None for none)."""
        if not images:
            return None
        return ImageInputs(torch.cat([i.pixel_values for i in images]), torch.cat([i.grid_thw for i in images]),
                           images[0].token_id, images[0].merge)

    def runs(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """(start, end) of each placeholder run in ``token_ids``."""
        found, end = [], 0
        for token, run in itertools.groupby(token_ids):
            start, end = end, end + len(list(run))
            if token == self.token_id:
                found.append((start, end))
        return found

    def keys(self, token_ids: list[int]) -> list[int]:
        """``token_ids`` with each image token standing for its image's content (a negative int per image
        and index): sequences alike in ids but not in pixels differ here, for prefix sharing."""
        out = list(token_ids)
        for (start, end), digest in zip(self.runs(out), self._digests):
            out[start:end] = [-1 - (digest << 20) - j for j in range(end - start)]  # room for 2**20 tokens an image
        return out

    @functools.cached_property
    def _digests(self) -> list[int]:
        """Each image's content hash, computed once: the trainer asks for `keys` several times a step."""
        return [int(hashlib.sha1(one.pixel_values.numpy().tobytes() + one.grid_thw.numpy().tobytes())
                    .hexdigest()[:15], 16) for one in self.split()]

    def positions(self, token_ids: list[int]) -> torch.Tensor:
        """Multimodal rotary positions (3, len): (time, height, width). Text tokens count up on all three
        axes; an image's tokens sit on its (row, column) grid from the position after the text before it,
        and the text after it goes on from that position plus the grid's longer side (Qwen-VL's rule)."""
        out = torch.empty(3, len(token_ids), dtype=torch.long)
        at, pos = 0, 0
        for (start, end), grid in zip(self.runs(token_ids), self.grid_thw.tolist()):
            out[:, at:start] = torch.arange(pos, pos + start - at)
            pos += start - at
            t, h, w = grid[0], grid[1] // self.merge, grid[2] // self.merge
            out[0, start:end] = pos + torch.arange(t).repeat_interleave(h * w)
            out[1, start:end] = pos + torch.arange(h).repeat_interleave(w).repeat(t)
            out[2, start:end] = pos + torch.arange(w).repeat(t * h)
            pos, at = pos + max(h, w), end
        out[:, at:] = torch.arange(pos, pos + len(token_ids) - at)
        return out

    def validate(self, token_ids: list[int], where: str) -> None:
        grid, pixels = self.grid_thw, self.pixel_values
        if grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point():
            raise ContractError(f"{where}.images.grid_thw must be an int tensor (images, 3), got {tuple(grid.shape)}")
        if pixels.dim() != 2 or pixels.shape[0] != int(grid.prod(1).sum()):
            raise ContractError(f"{where}.images.pixel_values must be (patches={int(grid.prod(1).sum())}, dim) for "
                                f"grids {grid.tolist()}, got {tuple(pixels.shape)}")
        runs = [end - start for start, end in self.runs(token_ids)]
        if runs != self.counts:
            raise ContractError(f"{where}: the image placeholder runs in token_ids have {runs} tokens, the image "
                                f"features {self.counts} (token id {self.token_id}, merge {self.merge})")


@dataclass
class Sample:
    """One segment: ``token_ids`` with per-token aligned fields. Non-action tokens carry logprob 0.0
    and version ``NO_VERSION``; ``routed_experts`` is (tokens, moe_layers, top_k) ints when set; ``images``
    the images whose placeholder tokens are in ``token_ids`` (vision-language models only)."""

    token_ids: list[int]
    action_mask: list[int]
    rollout_logprobs: list[float]
    versions: list[int]
    routed_experts: torch.Tensor | None = None
    images: ImageInputs | None = None

    @property
    def num_actions(self) -> int:
        return sum(self.action_mask)

    @property
    def turn_ends(self) -> list[int]:
        """The last action token of each sampled turn in this segment."""
        m = self.action_mask
        return [i for i, a in enumerate(m) if a and (i + 1 == len(m) or not m[i + 1])]

    def validate(self, where: str = "sample") -> None:
        n = len(self.token_ids)
        for name in ("action_mask", "rollout_logprobs", "versions"):
            m = len(getattr(self, name))
            if m != n:
                raise ContractError(f"{where}.{name} has length {m} but token_ids has length {n}")
        for i, (tok, mask) in enumerate(zip(self.token_ids, self.action_mask)):
            if not isinstance(tok, int) or tok < 0:
                raise ContractError(f"{where}.token_ids[{i}] must be a non-negative int, got {tok!r}")
            if mask not in (0, 1):
                raise ContractError(f"{where}.action_mask[{i}] must be 0 or 1, got {mask!r}")
            if mask:
                lp, v = self.rollout_logprobs[i], self.versions[i]
                if not math.isfinite(lp) or lp > 0:
                    raise ContractError(
                        f"{where}.rollout_logprobs[{i}] on an action token must be finite and <= 0, got {lp!r}")
                if not isinstance(v, int) or v < 0:
                    raise ContractError(
                        f"{where}.versions[{i}] on an action token must be a policy version >= 0, got {v!r}")
        if not any(self.action_mask):
            raise ContractError(f"{where} has no action tokens (action_mask is all 0); nothing to train on")
        if (r := self.routed_experts) is not None:
            if not isinstance(r, torch.Tensor) or r.dim() != 3 or r.shape[0] != n or r.is_floating_point():
                shape = tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
                raise ContractError(
                    f"{where}.routed_experts must be an int tensor shaped (tokens={n}, moe_layers, top_k), got {shape}")
        if self.images is not None:
            self.images.validate(self.token_ids, where)


@dataclass
class Trajectory:
    """One rollout: its segments (a new one is sealed whenever the agent rewrote history) and its
    outcome. ``prompt_index`` ties it to the data ledger; ``group_id`` to its prompt group."""

    segments: list[Sample]
    reward: float
    score: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    group_id: int = 0
    rollout_id: str = ""
    prompt_index: int = -1
    finish_reason: str = "stop"  # "stop", "length" (a token budget ran out), "abort"
    metadata: dict[str, Any] = field(default_factory=dict)  # the prompt record's other columns
    turns: int = 0  # sampled turns
    tool_calls: int = 0  # tool calls in them
    turn_rewards: list[float] | None = None  # one per sampled turn, when the agent gave them (an Env does)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def outcome(self) -> float:
        """The score when the agent gave one, else the reward: what filters and accuracy count."""
        return self.reward if self.score is None else self.score

    def validate(self) -> None:
        if not self.segments:
            raise ContractError(f"trajectory {self.rollout_id!r} has no segments")
        for k, seg in enumerate(self.segments):
            seg.validate(where=f"trajectory {self.rollout_id!r} segment {k}")
        if not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise ContractError(f"trajectory {self.rollout_id!r} reward must be a finite number, got {self.reward!r}")
        ends = sum(len(s.turn_ends) for s in self.segments)
        if self.turn_rewards is not None and len(self.turn_rewards) != ends:
            raise ContractError(f"trajectory {self.rollout_id!r} has {len(self.turn_rewards)} turn rewards for {ends} "
                                "sampled turns")

    def to_json(self) -> str:
        return json.dumps(_encode(self), sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> Trajectory:
        d = json.loads(line)
        d["segments"] = [Sample(**{k: _decode(v) for k, v in s.items()}) for s in d["segments"]]
        for s in d["segments"]:
            s.images = None if s.images is None else ImageInputs(**s.images)
        return cls(**d)


@dataclass
class Result:
    """What an agent's ``step`` or ``run`` returns. Numbers may be Python numbers or 0-d tensors."""

    reward: float = 0.0
    observation: str = ""
    terminated: bool = True
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    score: float | None = None
    sampling_params: SamplingParams | None = None
    images: list[Any] | None = None
    turn_rewards: list[float] | None = None
    """A ChatAgent's reward for each turn it sampled through the traced routes (an Env's are its steps' rewards):
    the token-level estimators (reinforce, gae) credit each turn with its reward and the later ones'."""

    def __post_init__(self) -> None:
        self.reward = to_float(self.reward, "Result.reward")
        if self.turn_rewards is not None:
            self.turn_rewards = [to_float(r, "Result.turn_rewards") for r in self.turn_rewards]
        self.score = None if self.score is None else to_float(self.score, "Result.score")
        self.info = {k: to_float(v, f"Result.info[{k!r}]") if isinstance(v, torch.Tensor) else v
                     for k, v in self.info.items()}


def to_float(x: Any, name: str) -> float:
    """A Python number or 0-d tensor as a float; anything else is a clear error."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ContractError(f"{name} must be a number or a 0-d tensor, got a tensor of shape {tuple(x.shape)}")
        return float(x.item())
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ContractError(f"{name} must be a number or a 0-d tensor, got {type(x).__name__}: {x!r}")
    return float(x)


def write_jsonl(path: str, trajectories: list[Trajectory]) -> None:
    with open(path, "a") as f:
        f.writelines(t.to_json() + "\n" for t in trajectories)


def read_jsonl(path: str) -> list[Trajectory]:
    with open(path) as f:
        return [Trajectory.from_json(line) for line in f if line.strip()]


# JSON cannot hold tensors: store them as {"__tensor__": dtype, "shape": ..., "data": flat list}, or,
# past LIST_TENSOR_MAX elements (an image's patches), "bytes": base64 of the raw little-endian values: a
# quarter of the size of decimal floats and no parsing. Both round trips are bit-exact.
LIST_TENSOR_MAX = 256


def _encode(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        out = {"__tensor__": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        if t.numel() <= LIST_TENSOR_MAX:
            return {**out, "data": t.reshape(-1).tolist()}
        return {**out, "bytes": base64.b64encode(t.reshape(-1).view(torch.uint8).numpy().tobytes()).decode()}
    if hasattr(x, "__dataclass_fields__"):
        return {f.name: _encode(getattr(x, f.name)) for f in fields(x)}
    if isinstance(x, dict):
        return {k: _encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_encode(v) for v in x]
    return x


def _decode(x: Any) -> Any:
    if isinstance(x, dict) and "__tensor__" in x:
        dtype = getattr(torch, x["__tensor__"])
        if "bytes" in x:
            raw = bytearray(base64.b64decode(x["bytes"]))
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(x["shape"])
        return torch.tensor(x["data"], dtype=dtype).reshape(x["shape"])
    if isinstance(x, dict):
        return {k: _decode(v) for k, v in x.items()}
    return x

