"""Masked reductions and the name -> function registry shared by every algorithm module.

Every reduction takes `mask` ([B, T], bool or 0/1) and ignores the values off the mask entirely:
they go through `torch.where`, so padding may hold anything (even NaN) without leaking into the result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

F = TypeVar("F", bound=Callable)

# exp() of a log-ratio is taken after clamping to this bound: e^20 ~ 5e8 is far outside any clip or IS
# band, and a finite forward value keeps backward free of 0 * inf = NaN.
LOG_RATIO_CLAMP = 20.0


def register(table: dict[str, Callable], name: str) -> Callable[[F], F]:
    """Decorator: ``@register(KL_ESTIMATORS, "k3")`` adds the function to the table under that name."""

    def add(fn: F) -> F:
        if name in table:
            raise ValueError(f"{name!r} is registered twice (already by {table[name].__qualname__})")
        table[name] = fn
        return fn

    return add


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    mask = mask.bool()
    return torch.where(mask, x, 0).sum() / mask.sum().clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (population variance); 0 off the mask."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return torch.where(mask.bool(), (x - mean) * torch.rsqrt(var + eps), 0)
