"""Micro-batches under a token budget, with no padding in the forward pass.

Samples are bin-packed (first-fit decreasing by length) into rows of at most ``max_tokens`` tokens;
one row is one forward pass, its sequences kept apart by ``position_ids`` that restart at 0. The
loss functions see the usual right-padded ``[B, T]`` tensors: ``MicroBatch.unpack`` scatters the
row's per-position results back to ``[B, T]``, aligned with ``token_ids`` (index t holds the value
for token t, predicted at position t-1; index 0 and padding hold 0).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from instar.contract import Sample


@dataclass
class StepInputs:
    """What the driver computed for a training batch: per sample, one float tensor aligned with its
    token_ids (same length). Each trainer call reads the ones it needs."""

    advantages: list[Tensor] | None = None
    old_logprobs: list[Tensor] | None = None  # policy before the update (else the trainer takes its own)
    ref_logprobs: list[Tensor] | None = None  # the frozen reference, for a KL term in the loss
    old_values: list[Tensor] | None = None  # the critic before the update (value clipping)
    returns: list[Tensor] | None = None  # the critic's targets


@dataclass
class LossInputs:
    """One micro-batch as the loss sees it: ``[B, T]`` tensors aligned with token_ids (index 0 and
    padding hold 0), the `StepInputs` given, and the normaliser the trainer sets per update."""

    token_ids: Tensor
    action_mask: Tensor  # bool
    rollout_logprobs: Tensor  # the engine's logprob of each sampled token
    versions: Tensor  # the policy version that sampled each token
    lengths: Tensor  # [B]
    advantages: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    old_values: Tensor | None = None
    returns: Tensor | None = None
    global_num_action_tokens: Tensor | None = None
    """Action tokens of the whole update over every rank: each micro-batch's loss is its share of the
    global token mean (sum / this)."""


@dataclass
class MicroBatch:
    input_ids: Tensor  # [1, N] the packed row
    position_ids: Tensor  # [1, N] restarting at 0 for each sequence
    gather: Tensor  # [B, T] row position whose next-token value belongs to token t
    valid: Tensor  # [B, T] bool: 1 <= t < length of sample b
    inputs: LossInputs
    indices: list[int]  # each row sample's index in the caller's list (see `collate`'s names)
    routed_experts: Tensor | None = None  # [N, moe_layers, top_k] for routing replay, when every sample has it
    action_positions: Tensor | None = None  # [M] row positions whose next token is an action token

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def unpack(self, per_position: Tensor) -> Tensor:
        """A ``[N]`` next-token quantity of the row as ``[B, T]`` aligned with token_ids."""
        return torch.where(self.valid, per_position[self.gather], torch.zeros((), dtype=per_position.dtype,
                                                                              device=per_position.device))

    def split(self, unpacked: Tensor) -> list[Tensor]:
        """``[B, T]`` back to one 1-D tensor per sample, in row order (see ``indices``)."""
        lengths = self.inputs.lengths.tolist()
        return [unpacked[b, :n].detach().cpu() for b, n in enumerate(lengths)]


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped into bins of at most ``max_tokens`` tokens: first-fit decreasing, which keeps
    the number of forward passes near the minimum. Deterministic for the same lengths."""
    if not lengths:
        return []
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(f"a sample has {longest} tokens, more than --train.max_tokens_per_gpu {max_tokens}; "
                         "raise --train.max_tokens_per_gpu to at least the longest sample (or lower --data.max_len)")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return bins


def shard_samples(lengths: list[int], world_size: int) -> list[list[int]]:
    """Indices dealt to ranks so each gets about the same number of tokens (longest first, each to the
    least loaded rank). Every rank gets at least one sample when there are enough."""
    if len(lengths) < world_size:
        raise ValueError(f"{len(lengths)} samples cannot feed {world_size} trainer ranks; "
                         "use a batch of at least --fsdp.num_ranks samples")
    shards: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], len(shards[r])))
        shards[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shards]


def collate(samples: list[Sample], indices: list[int], step: StepInputs | None = None,
            device: str = "cpu", names: list[int] | None = None) -> MicroBatch:
    """One packed row of ``samples[indices]`` plus their ``[B, T]`` loss inputs. ``names[i]`` is sample
    i's index in the lists of ``step`` and in ``MicroBatch.indices`` (default: ``i``)."""
    names = [names[i] for i in indices] if names is not None else list(indices)
    rows = [samples[i] for i in indices]
    lengths = [len(s.token_ids) for s in rows]
    T = max(lengths)
    offsets = torch.tensor([0] + lengths[:-1]).cumsum(0)
    t = torch.arange(T)
    lengths_t = torch.tensor(lengths)
    mask = right_pad([torch.tensor(s.action_mask, dtype=torch.bool) for s in rows], T)
    given = {f.name: right_pad([values[i] for i in names], T).to(device)
             for f in fields(StepInputs) if step is not None and (values := getattr(step, f.name)) is not None}
    inputs = LossInputs(
        token_ids=right_pad([torch.tensor(s.token_ids) for s in rows], T).to(device),
        action_mask=mask.to(device),
        rollout_logprobs=right_pad([torch.tensor(s.rollout_logprobs, dtype=torch.float32) for s in rows],
                                   T).to(device),
        versions=right_pad([torch.tensor(s.versions) for s in rows], T).to(device),
        lengths=lengths_t.to(device), **given)
    action_positions = (offsets[:, None] + t[None] - 1)[mask & (t[None] >= 1)]
    recorded = all(s.routed_experts is not None for s in rows)
    routes = torch.cat([s.routed_experts for s in rows]).to(device) if recorded else None
    return MicroBatch(
        input_ids=torch.cat([torch.tensor(s.token_ids) for s in rows])[None].to(device),
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None].to(device),
        gather=(offsets[:, None] + t[None] - 1).clamp(0, sum(lengths) - 1).to(device),
        valid=((t[None] >= 1) & (t[None] < lengths_t[:, None])).to(device),
        inputs=inputs,
        indices=names,
        routed_experts=routes,
        action_positions=action_positions.to(device),
    )


def right_pad(seqs: list[Tensor], length: int | None = None) -> Tensor:
    """1-D tensors as one ``[B, length]`` tensor of their dtype, zero-filled on the right (``length``
    defaults to the longest)."""
    length = max(len(s) for s in seqs) if length is None else length
    out = torch.zeros((len(seqs), length), dtype=seqs[0].dtype)
    for b, s in enumerate(seqs):
        out[b, : len(s)] = s
    return out
