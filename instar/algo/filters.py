"""DAPO dynamic filtering: train only on prompt groups whose outcomes differ.

A group whose samples all succeed (or all fail) has zero advantage under group estimators and only
dilutes the token-mean; `--algo.dynamic_filter LOW HIGH` keeps a group when its mean score lies
strictly inside (LOW, HIGH), e.g. (0, 1) for 0/1 scores.
"""

from __future__ import annotations

import torch
from torch import Tensor


def dynamic_filter(scores: Tensor, group_index: Tensor, bounds: tuple[float, float]) -> tuple[Tensor, float]:
    """Per trajectory [N]: (keep, bool, True for every member of a passing group; pass rate = passing
    groups / groups). Use the trajectory's score (its reward when the agent gave no score)."""
    low, high = bounds
    if not low < high:
        raise ValueError(f"--algo.dynamic_filter needs low < high, got {bounds}")
    if scores.shape != group_index.shape or scores.dim() != 1:
        raise ValueError(f"scores and group_index must both be [N], got {tuple(scores.shape)} and "
                         f"{tuple(group_index.shape)}")
    _, group = torch.unique(group_index, return_inverse=True)
    size = torch.bincount(group).double()
    mean = torch.zeros_like(size).index_add_(0, group, scores.double()) / size
    passed = (mean > low) & (mean < high)
    return passed[group], passed.double().mean().item()
