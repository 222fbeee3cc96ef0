"""Micro-batches under a token budget, with no padding in the forward pass.

Samples are bin-packed (first-fit decreasing by length) into rows of at most ``max_tokens`` tokens;
one row is one forward pass. In a plain row the sequences follow each other, kept apart by
``position_ids`` that restart at 0. A shared row (`row_layout`) is a prefix tree: the prompt that a
group's samples share, and any longer common start, is in the row once, as a segment that the
segments continuing it attend to (`instar.train.attention.Segments`), so a group of 8 computes its prompt
once, not 8 times. The loss functions see the usual right-padded ``[B, T]`` tensors either way:
``MicroBatch.gather`` names the row position that predicts each token (index t holds the value for
token t, predicted at the position of token t-1; index 0 and padding hold 0).
"""

from __future__ import annotations

import array
from dataclasses import dataclass, fields
from itertools import accumulate

import torch
from torch import Tensor

from instar.contract import ImageInputs, Sample
from instar.train.attention import Segments

MIN_SHARED = 8
"""Tokens a common start must have to be its own shared segment: a shorter one is cheaper to repeat
in each continuation than to attend to as one more segment."""


@dataclass
class StepInputs:
    """What the driver computed for a training batch: per sample, one float tensor aligned with its
    token_ids (same length). Each trainer call reads the ones it needs."""

    advantages: list[Tensor] | None = None
    old_logprobs: list[Tensor] | None = None  # policy before the update (else the trainer takes its own)
    ref_logprobs: list[Tensor] | None = None  # the frozen reference, for a KL term in the loss
    old_values: list[Tensor] | None = None  # the critic before the update (value clipping)
    returns: list[Tensor] | None = None  # the critic's targets
    # seq-mean --actor.loss_agg_mode: 1 / the action tokens of the sample's trajectory, on its action tokens;
    # a trajectory's sum to 1, so an update's sum is its number of trajectories
    seq_weights: list[Tensor] | None = None

    def __reduce__(self) -> tuple:
        """Sent to the trainer ranks each step: each list travels as one flat tensor and its lengths (a
        tensor pickles in ~0.1 ms whatever its size, so 64 of them took 14 ms to send and receive)."""
        return _unpack_inputs, tuple(None if v is None else (torch.cat(v) if v else torch.empty(0), [len(t) for t in v])
                                     for v in (getattr(self, f.name) for f in fields(self)))


def _unpack_inputs(*packed: tuple[Tensor, list[int]] | None) -> StepInputs:
    return StepInputs(*(None if p is None else list(p[0].split(p[1])) for p in packed))


@dataclass
class LossInputs:
    """One micro-batch as the loss sees it: ``[B, T]`` tensors aligned with token_ids (index 0 and
    padding hold 0), the `StepInputs` given, and the normaliser the trainer sets per update."""

    token_ids: Tensor
    action_mask: Tensor  # bool
    rollout_logprobs: Tensor  # the engine's logprob of each sampled token
    lengths: Tensor  # [B]
    advantages: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    old_values: Tensor | None = None
    returns: Tensor | None = None
    seq_weights: Tensor | None = None
    global_num_action_tokens: Tensor | None = None
    """Action tokens of the whole update over every rank: each micro-batch's loss is its share of the
    global token mean (sum / this)."""
    global_num_seqs: int | None = None  # trajectories of the whole update, with ``seq_weights``


@dataclass
class MicroBatch:
    input_ids: Tensor  # [1, N] the packed row
    position_ids: Tensor  # [1, N] restarting at 0 for each sequence
    gather: Tensor  # [B, T] row position whose next-token value belongs to token t
    valid: Tensor  # [B, T] bool: 1 <= t < length of sample b
    inputs: LossInputs
    indices: list[int]  # each row sample's index in the caller's list (see `collate`'s names)
    segments: Segments  # the row's segments and what each attends to
    routed_experts: Tensor | None = None  # [N, moe_layers, top_k] for routing replay, when every sample has it
    images: ImageInputs | None = None  # the images whose tokens are in the row, in row order
    rope: Tensor | None = None  # [3, 1, N] multimodal rotary positions, when a sample has images

    @property
    def attention_kwargs(self) -> dict | None:
        """What attention needs beyond ``position_ids``: None for a plain row (its bounds are where the
        positions restart), the segments for a shared one (the keyword that carries them through the model to
        `packed_attention`)."""
        return {"instar_segments": self.segments} if self.segments.shared else None

    def unpack(self, per_position: Tensor) -> Tensor:
        """A ``[N]`` next-token quantity of the row as ``[B, T]`` aligned with token_ids."""
        return torch.where(self.valid, per_position[self.gather], 0)

    def split(self, unpacked: Tensor) -> list[Tensor]:
        """``[B, T]`` back to one 1-D tensor per sample, in row order (see ``indices``)."""
        return [unpacked[b, :n].detach().cpu() for b, n in enumerate(self.inputs.lengths.tolist())]


def plan_micro_batches(lengths: list[int], max_tokens: int, seqs: list[list[int]] | None = None) -> list[list[int]]:
    """Indices grouped into bins of at most ``max_tokens`` tokens: first-fit decreasing, which keeps
    the number of forward passes near the minimum. With ``seqs`` (the samples' tokens, for shared rows)
    in which some samples share a start, the bins are runs in `tree_order`, so a group's samples share
    a row, and a bin holds at most ``max_tokens`` tokens of its prefix tree. Deterministic."""
    if not lengths:
        return []
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(f"a sample has {longest} tokens, more than --train.max_tokens_per_gpu {max_tokens}; "
                         "raise --train.max_tokens_per_gpu to at least the longest sample (or lower --data.max_len)")
    order, shared = _shared_with_previous(seqs) if seqs is not None else ([], [])
    if any(shared):  # else nothing is shared: first-fit decreasing packs tighter
        runs: list[list[int]] = []
        sizes: list[int] = []
        for i, common in zip(order, shared):
            if not runs or sizes[-1] + lengths[i] - common > max_tokens:  # a new row: its first sample brings all
                runs.append([])
                sizes.append(0)
                common = 0
            runs[-1].append(i)
            sizes[-1] += lengths[i] - common
        fitted: list[list[int]] = []
        while runs:  # `shared` can overstate by a too-short shared part: the last samples move on until it fits
            run, spill, size = runs.pop(0), [], sizes.pop(0)
            # only a row within that overstatement of the budget is laid out to be sure
            while (len(run) > 1 and size + (MIN_SHARED - 1) * (len(run) - 1) > max_tokens
                   and len(row_layout([seqs[j] for j in run]).tokens) > max_tokens):
                spill.insert(0, run.pop())
            fitted.append(run)
            if spill:  # joined to the next row, whose size is then unknown: the budget makes the next round look
                runs.insert(0, spill + (runs.pop(0) if runs else []))
                sizes[:1] = [max_tokens]
        return fitted
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


def shard_samples(lengths: list[int], world_size: int, seqs: list[list[int]] | None = None,
                  cost: list[int] | None = None) -> list[list[int]]:
    """Indices dealt to ranks so each gets about the same work: tokens times the sample's ``cost`` (default
    1; a backward costs about two forwards more), longest first, each to the least loaded rank. Every rank
    gets at least one sample when there are enough. With ``seqs`` (shared rows) in which some samples share a
    start, each rank gets a run of `tree_order`, cut where the work before it is nearest to an equal share:
    most groups stay whole on one rank; a cut inside one runs its shared start on both."""
    if len(lengths) < world_size:
        raise ValueError(f"{len(lengths)} samples cannot feed {world_size} trainer ranks; "
                         "use a batch of at least --fsdp.num_ranks samples")
    cost = cost or [1] * len(lengths)
    order, shared = _shared_with_previous(seqs) if seqs is not None else ([], [])
    if any(shared):  # else nothing is shared: dealing by length balances better
        done = list(accumulate(((lengths[i] - common) * cost[i] for i, common in zip(order, shared)), initial=0))
        cuts = [0]
        for r in range(1, world_size):  # nearest to r shares, leaving a sample for every later rank
            lo, hi = cuts[-1] + 1, len(order) - (world_size - r)
            cuts.append(min(range(lo, hi + 1), key=lambda k: (abs(done[k] - r * done[-1] / world_size), k)))
        cuts.append(len(order))
        return [sorted(order[a:b]) for a, b in zip(cuts, cuts[1:])]
    shards: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i] * cost[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], len(shards[r])))
        shards[r].append(i)
        load[r] += lengths[i] * cost[i]
    return [sorted(s) for s in shards]


@dataclass
class RowLayout:
    """Where the tokens of a row's sequences are: ``place[b][t]`` is the row position of token t of
    sequence b; the row holds ``tokens`` at ``positions`` (their index in their sequence), in
    ``segments``; segment k's tokens are ``sources[k] = (b, start, end)``: tokens start..end of sequence b."""

    tokens: list[int]
    positions: list[int]
    place: list[list[int]]
    segments: Segments
    sources: list[tuple[int, int, int]]


def row_layout(seqs: list[list[int]], share: bool = True, min_shared: int = MIN_SHARED,
               keys: list[list] | None = None) -> RowLayout:
    """The row for ``seqs``: one after the other, or (``share``) as a prefix tree whose shared starts of
    at least ``min_shared`` tokens are in the row once. ``keys`` (default ``seqs``): what must be equal,
    token by token, for a start to be shared. Deterministic for the same sequences."""
    tokens: list[int] = []
    positions: list[int] = []
    place: list[list[int]] = [[] for _ in seqs]
    bounds: list[int] = []
    context: list[tuple[int, ...]] = []
    sources: list[tuple[int, int, int]] = []

    def add(members: list[int], start: int, end: int, ctx: tuple[int, ...]) -> tuple[int, ...]:
        """Tokens start..end of ``members[0]`` (all of ``members`` have them) as a segment attending to ``ctx``."""
        if end <= start:
            return ctx
        first = len(tokens)
        bounds.append(first)
        context.append(ctx)
        sources.append((members[0], start, end))
        tokens.extend(seqs[members[0]][start:end])
        positions.extend(range(start, end))
        for b in members:
            place[b].extend(range(first, first + end - start))
        return (*ctx, len(bounds) - 1)

    if not share:
        for b, seq in enumerate(seqs):
            add([b], 0, len(seq), ())
    else:  # lexicographic order: sequences with a common start are neighbours, their common start the min LCP
        order, common = tree_order(seqs if keys is None else keys)

        def grow(a: int, z: int, done: int, ctx: tuple[int, ...]) -> None:
            """Sequences ``order[a:z]`` whose first ``done`` tokens are in the segments ``ctx``."""
            if z - a == 1:
                add([order[a]], done, len(seqs[order[a]]), ctx)
                return
            depth = min(common[a:z - 1])
            if depth - done >= min_shared:  # else each continuation repeats tokens done..depth itself
                ctx, done = add(order[a:z], done, depth, ctx), depth
            start = a  # split where neighbours part at `depth`: each part shares more than `depth`
            for k in range(a, z):
                if k == z - 1 or common[k] == depth:
                    grow(start, k + 1, done, ctx)
                    start = k + 1
        grow(0, len(seqs), 0, ())
    return RowLayout(tokens, positions, place, Segments((*bounds, len(tokens)), tuple(context)), sources)


def tree_order(seqs: list[list]) -> tuple[list[int], list[int]]:
    """The sequences in `row_layout`'s order (lexicographic: a group's samples are neighbours) and the
    common start of each pair of neighbours."""
    order = sorted(range(len(seqs)), key=lambda b: seqs[b])
    return order, [_common_start(seqs[x], seqs[y]) for x, y in zip(order, order[1:])]


def _shared_with_previous(seqs: list[list[int]]) -> tuple[list[int], list[int]]:
    """`tree_order`, and per sample the tokens it shares with the one before it (its common start, if one
    is shared; 0 for the first): in a row that holds both it adds its length less that, or up to
    ``MIN_SHARED - 1`` more (a shared part too short to be a segment is repeated)."""
    order, common = tree_order(seqs)
    return order, [0] + [c if c >= MIN_SHARED else 0 for c in common]


def _common_start(x: list, y: list) -> int:
    return next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))


ROW_MULTIPLE = 64
"""A CPU bf16 trainer pads its rows to a multiple of this many tokens. oneDNN, which runs bf16 matmuls
on CPU, builds a kernel for each new shape, and a packed row has a new length at nearly every
micro-batch. Measured: a dense linear's forward + backward on ~3k rows, 4.9 ms at new lengths against
3.4 ms at lengths padded to 64; a demo-sized update of 64 samples whose lengths change every step,
one thread, 134 ms against 114-126 ms. float32 has no such cost, and is not padded."""


def collate(samples: list[Sample], indices: list[int], step: StepInputs | None = None,
            device: str = "cpu", names: list[int] | None = None, share: bool = False,
            pad_to: int = 1) -> MicroBatch:
    """One packed row of ``samples[indices]`` plus their ``[B, T]`` loss inputs. ``names[i]`` is sample
    i's index in the lists of ``step`` and in ``MicroBatch.indices`` (default: ``i``). ``share``: lay
    the row out as a prefix tree (`row_layout`); only attention that reads `Segments` can run it.
    ``pad_to``: the row grows to a multiple of it by a sequence of padding that nothing reads (see
    `ROW_MULTIPLE`); not with images or recorded routes."""
    names = [names[i] for i in indices] if names is not None else list(indices)
    rows = [samples[i] for i in indices]
    lengths = torch.tensor([len(s.token_ids) for s in rows])
    T = int(lengths.max())
    t = torch.arange(T)
    recorded = all(s.routed_experts is not None for s in rows)
    seen = any(s.images is not None for s in rows)
    # what a shared start must agree in: replayed routes too, and image tokens only share one image
    keys = [_with_routes(s) for s in rows] if share and recorded else [identity(s) for s in rows]
    layout = row_layout([s.token_ids for s in rows], share, keys=keys)
    given = {f.name: right_pad([values[i] for i in names], T).to(device)
             for f in fields(StepInputs) if step is not None and (values := getattr(step, f.name)) is not None}
    inputs = LossInputs(
        token_ids=padded([s.token_ids for s in rows], T).to(device),
        action_mask=padded([s.action_mask for s in rows], T, torch.bool).to(device),
        rollout_logprobs=padded([s.rollout_logprobs for s in rows], T, torch.float32).to(device),
        lengths=lengths.to(device), **given)
    # a shared token's routes are those of the sequence it was taken from (with replay all sharers' agree)
    routes = torch.cat([rows[b].routed_experts[a:z] for b, a, z in layout.sources]).to(device) if recorded else None
    images, rope = _row_images(rows, layout) if seen else (None, None)
    tokens, positions, segments = layout.tokens, layout.positions, layout.segments
    if pad_to > 1 and not recorded and not seen and (extra := -len(tokens) % pad_to):
        tokens, positions = tokens + [0] * extra, positions + list(range(extra))
        segments = segments.padded(len(tokens))
    return MicroBatch(
        input_ids=padded([tokens], len(tokens)).to(device),
        position_ids=padded([positions], len(positions)).to(device),
        # the position predicting token t is that of token t-1 (t >= 1); padding points at position 0
        gather=padded([[0] + p[:-1] for p in layout.place], T).to(device),
        valid=((t[None] >= 1) & (t[None] < lengths[:, None])).to(device),
        inputs=inputs,
        indices=names,
        segments=segments,
        routed_experts=routes,
        images=images,
        rope=None if rope is None else rope.to(device),
    )


def identity(s: Sample) -> list[int]:
    """``s.token_ids`` with each image token standing for its image's pixels (negative ids): samples
    alike in ids but not in images share no image token."""
    return s.token_ids if s.images is None else s.images.keys(s.token_ids)


def _row_images(rows: list[Sample], layout: RowLayout) -> tuple[ImageInputs | None, Tensor]:
    """The images of the row's segments in row order, and the row's multimodal rotary positions [3, 1, N]."""
    rope = [torch.arange(len(s.token_ids)).expand(3, -1) if s.images is None else s.images.positions(s.token_ids)
            for s in rows]
    found = []
    for b, a, z in layout.sources:
        if rows[b].images is not None:
            for (start, end), one in zip(rows[b].images.runs(rows[b].token_ids), rows[b].images.split()):
                if a <= start and end <= z:
                    found.append(one)
                elif start < z and a < end:
                    raise ValueError(f"a row segment ({a}..{z}) cuts image tokens {start}..{end}")
    positions = torch.cat([rope[b][:, a:z] for b, a, z in layout.sources], dim=1)
    return ImageInputs.cat(found), positions[:, None]


def _with_routes(s: Sample) -> list[tuple[int, int]]:
    """Per token, (token id, a random linear hash of its recorded routes)."""
    routes = s.routed_experts.reshape(len(s.token_ids), -1).long()
    weights = torch.randint(1, 2**31, (routes.shape[1],), generator=torch.Generator().manual_seed(0))
    return list(zip(s.token_ids, (routes * weights).sum(1).tolist()))


_ARRAY_CODES = {torch.int64: "q", torch.float32: "f", torch.bool: "b"}


def padded(seqs: list[list], length: int, dtype: torch.dtype = torch.int64) -> Tensor:
    """Python lists (ints, floats, or 0/1 for bool) as one ``[B, length]`` tensor, zero-filled on the right,
    built through one array: torch.tensor converts a list element by element as Python objects, and a
    tensor per sample adds a call each (64 samples' fields: ~4 ms a micro-batch, against ~1 here)."""
    code = _ARRAY_CODES[dtype]
    flat = array.array(code, bytes(array.array(code).itemsize * len(seqs) * length))
    for b, s in enumerate(seqs):
        flat[b * length: b * length + len(s)] = array.array(code, s)
    return torch.frombuffer(flat, dtype=dtype).view(len(seqs), length) if flat else torch.zeros(len(seqs), length,
                                                                                                dtype=dtype)


def right_pad(seqs: list[Tensor], length: int | None = None) -> Tensor:
    """1-D tensors as one ``[B, length]`` tensor of their dtype, zero-filled on the right (``length``
    defaults to the longest)."""
    out = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    return out if length is None else torch.nn.functional.pad(out, (0, length - out.shape[1]))
