"""MoE routing stability: routing replay (R3) and a frozen router, as hooks on the HF router
modules, so the model code stays untouched.

The router of an HF MoE block (``Qwen3MoeTopKRouter`` and its kin) maps ``[N, hidden]`` to
``(router_logits, routing_weights, expert_ids)``. Replay swaps ``expert_ids`` for the ones the
engine recorded and recomputes the weights from the trainer's own logits at those experts, so the
router still gets gradients while the experts used are the rollout's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor, nn


def routers(model: nn.Module) -> list[nn.Module]:
    """The top-k router of each MoE layer, in layer order (the order of ``routed_experts[:, l]``)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def freeze_routers(model: nn.Module) -> None:
    """--actor.freeze_moe_router: router weights get no gradient and no optimizer state (a dense model has none)."""
    for r in routers(model):
        r.requires_grad_(False)


@contextmanager
def replay_routes(model: nn.Module, routed_experts: Tensor) -> Iterator[None]:
    """Within the block (forward *and* backward, since activation checkpointing recomputes the
    forward there), every router of ``model`` uses ``routed_experts[:, layer]`` (``[N, layers,
    top_k]`` for the N tokens of the packed row) as its expert choice. Rows of -1 mean "not
    recorded": those tokens route themselves."""
    layers = routers(model)
    if routed_experts.dim() != 3 or routed_experts.shape[1] != len(layers):
        raise ValueError(f"routed_experts must be [tokens, {len(layers)} moe layers, top_k], got "
                         f"{tuple(routed_experts.shape)}; was it recorded by an engine running this model?")

    def hook(layer: int, module: nn.Module, args: tuple, output: tuple) -> tuple:
        logits, own = output[0], output[2]
        ids = routed_experts[:, layer].to(logits.device, torch.long)
        # A token with no recorded route (-1: e.g. prompt tokens the engine never routed) keeps its own.
        ids = torch.where((ids >= 0).all(-1, keepdim=True), ids, own)
        weights = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
        if getattr(module, "norm_topk_prob", True):
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), ids

    handles = [r.register_forward_hook(partial(hook, i)) for i, r in enumerate(layers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
