"""KL divergence to the reference policy: per-token estimators and the coefficient controller.

Tokens are sampled from the policy q; with log r = ref_logprob - logprob (Schulman, "Approximating
KL divergence"): k1 = -log r (unbiased, can be negative), k2 = (log r)^2 / 2, k3 = (r - 1) - log r
(unbiased and >= 0). `--algo.kl.use_in reward` subtracts coef * k per token from the reward of the
token-level estimators (REINFORCE++); `loss` adds coef * k, aggregated as --actor.loss_agg_mode, to the policy loss.

The coefficient is fixed (`--algo.kl.target` unset) or adapted by the proportional controller of
Ziegler et al. (2019); its state goes into checkpoints through `state_dict` / `load_state_dict`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from instar.algo.ops import LOG_RATIO_CLAMP, register
from instar.config import KLConfig

KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {}


@register(KL_ESTIMATORS, "k1")
def k1(log_r: Tensor) -> Tensor:
    return -log_r


@register(KL_ESTIMATORS, "k2")
def k2(log_r: Tensor) -> Tensor:
    return 0.5 * log_r**2


@register(KL_ESTIMATORS, "k3")
def k3(log_r: Tensor) -> Tensor:
    return torch.expm1(log_r) - log_r


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(policy || reference), same shape as the inputs (mask it yourself).
    The log-ratio is clamped to +-LOG_RATIO_CLAMP so k3 stays finite."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown --algo.kl.estimator {estimator!r}; choose one of {sorted(KL_ESTIMATORS)}")
    log_r = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return KL_ESTIMATORS[estimator](log_r)


@dataclass
class KLController:
    """The KL coefficient. With a `target`, after each step
    value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_samples / horizon; without one it never moves."""

    value: float
    target: float | None = None
    horizon: int = 10000

    @classmethod
    def from_config(cls, cfg: KLConfig) -> KLController:
        return cls(value=cfg.coef, target=cfg.target, horizon=cfg.horizon)

    def update(self, current_kl: float, n_samples: int) -> float:
        """Feed the step's measured KL (mean per token) and its number of samples; returns the new value."""
        if self.target is not None:
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_samples / self.horizon
        return self.value

    # Only the coefficient is state; target and horizon come from the (possibly edited) config on resume.
    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
