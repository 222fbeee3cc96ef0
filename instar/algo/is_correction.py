"""Importance-sampling correction for the gap between the engine that sampled a token and the trainer.

ratio = exp(old_logprob - rollout_logprob): the trainer's logprob (recomputed before the update) over
the engine's. `--algo.advantage.is_correction_level` x `_mode` with the band `_threshold LOW HIGH`:

  off          weight 1 on every action token
  token+trunc  weight min(ratio, HIGH)                                    = TIS (truncated IS)
  token+clip   weight clamp(ratio, LOW, HIGH)
  token+mask   weight ratio inside [LOW, HIGH], token dropped outside     = IcePop
  seq+mask     drop the whole row if prod(ratio) is outside the band      (sequence rejection)
  geo+mask     drop the whole row if the geometric mean of ratio is outside the band
                                                                          = sequence-masked IS

Sequences are rows (segments). The tokens of a row that passes a seq / geo gate keep the TIS weight
min(ratio, HIGH): the gate removes sequences that drifted as a whole, truncation bounds the variance
that a single odd token adds inside a sequence that passed. seq / geo accept only mode `mask`.
The weights are constants (no gradient); dropped tokens have `keep` False and weight exactly 0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from instar.algo.ops import LOG_RATIO_CLAMP
from instar.config import AdvantageConfig, ConfigError


def check_is_correction(cfg: AdvantageConfig) -> None:
    """Reject a level / mode / band that cannot work, naming the fix (at start-up too: `instar.checks`)."""
    level, mode, (low, high) = cfg.is_correction_level, cfg.is_correction_mode, cfg.is_correction_threshold
    if level not in ("off", "token", "seq", "geo"):
        raise ConfigError(f"unknown --algo.advantage.is_correction_level {level!r}; choose off, token, seq or geo")
    if mode not in ("mask", "clip", "trunc"):
        raise ConfigError(f"unknown --algo.advantage.is_correction_mode {mode!r}; choose mask, clip or trunc")
    if level in ("seq", "geo") and mode != "mask":
        raise ConfigError(f"--algo.advantage.is_correction_level {level} is a sequence gate and needs "
                          f"--algo.advantage.is_correction_mode mask (got {mode}); for per-token {mode} use level "
                          "token")
    if not 0 <= low < 1 < high:
        raise ConfigError("--algo.advantage.is_correction_threshold must satisfy 0 <= low < 1 < high, "
                          f"got {low} {high}")


def is_weights(cfg: AdvantageConfig, old_logprobs: Tensor, rollout_logprobs: Tensor,
               action_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(weight [B, T] float, keep [B, T] bool). Both are 0 / False off the action tokens."""
    check_is_correction(cfg)
    mask = action_mask.bool()
    if cfg.is_correction_level == "off":
        return mask.to(old_logprobs.dtype), mask
    low, high = cfg.is_correction_threshold
    log_ratio = torch.where(mask, old_logprobs.detach() - rollout_logprobs.detach(), 0)
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if cfg.is_correction_level == "token":
        keep = mask & (ratio >= low) & (ratio <= high) if cfg.is_correction_mode == "mask" else mask
        weight = {"trunc": ratio.clamp(max=high), "clip": ratio.clamp(low, high), "mask": ratio}[cfg.is_correction_mode]
    else:
        seq_log_ratio = log_ratio.sum(-1)  # compared in log space: a product of many ratios over/underflows
        if cfg.is_correction_level == "geo":
            seq_log_ratio = seq_log_ratio / mask.sum(-1).clamp(min=1)
        log_low = math.log(low) if low > 0 else -math.inf
        keep = mask & ((seq_log_ratio >= log_low) & (seq_log_ratio <= math.log(high)))[:, None]
        weight = ratio.clamp(max=high)
    return torch.where(keep, weight, 0), keep
