"""A test helper: what the routers of an MoE model picked, recorded with forward hooks (the trainer's own
choice, to compare with replayed routes)."""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from instar.train.moe import routers


@contextmanager
def record_routes(model: nn.Module) -> Iterator[list[Tensor]]:
    """Collect the expert ids each router picks during the block; after it, the list holds one
    ``[N, layers, top_k]`` tensor per forward pass."""
    layers = routers(model)
    per_layer: list[list[Tensor]] = [[] for _ in layers]
    out: list[Tensor] = []

    def make_hook(layer: int):
        def hook(module: nn.Module, args: tuple, output: tuple) -> None:
            per_layer[layer].append(output[2].detach().cpu())
        return hook

    handles = [r.register_forward_hook(make_hook(i)) for i, r in enumerate(layers)]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()
        out.extend(torch.stack(step, dim=1) for step in zip(*per_layer))
