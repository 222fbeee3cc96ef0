"""AdamW over the trainable parameters and the learning-rate schedule (linear warm-up, then constant,
cosine or linear decay to 0 at ``max_steps``)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def build_optimizer(model: nn.Module, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                    weight_decay: float = 0.0) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]  # frozen routers get no state
    # fused: one pass over each tensor and its two moments instead of ~10 (a demo-sized step 2.0 -> 0.5 ms
    # on CPU, more at size); torch has it for floating-point parameters on CPUs and GPUs
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, fused=fused or None)


def lr_factor(step: int, warmup_steps: int, max_steps: int, schedule: str) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    raise ValueError(f"unknown --actor.lr_scheduler {schedule!r}; use constant, cosine or linear")


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int, schedule: str) -> LambdaLR:
    lr_factor(warmup_steps, warmup_steps, max_steps, schedule)  # reject an unknown name now, not at step N
    return LambdaLR(optimizer, lambda step: lr_factor(step, warmup_steps, max_steps, schedule))
