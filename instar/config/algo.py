"""The algorithm (`--algo.*`): advantage estimation, importance-sampling correction, KL."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class AdvantageConfig:
    """How advantages are estimated and how the rollout/trainer gap is corrected."""

    estimator: str = "grpo"
    """Advantage estimator, any name registered in instar/algo/advantages.py; built in: reinforce (REINFORCE++),
    reinforce_baseline, rloo, grpo, dr_grpo (group baselines), gae (critic), on_policy_distill (teacher = reference)."""
    gamma: float = 1.0
    """Discount factor (reinforce, gae)."""
    lam: float = 0.95
    """GAE lambda."""
    turn_gamma: float = 1.0
    """Discount per turn of an agent's per-turn rewards (reinforce, gae): turn k's tokens are credited with
    sum over later turns j of turn_gamma^(j-k) r_j (the grouped estimators use the summed reward)."""
    whiten: bool = False
    """Whiten the advantages over all action tokens of the step (mean 0, std 1), as PPO implementations do with gae;
    the critic's returns use them before. reinforce and reinforce_baseline always whiten."""
    is_correction_level: Literal["off", "token", "seq", "geo"] = "geo"
    """Importance-sampling correction of rollout vs trainer logprobs: per token, or a sequence gate (seq: the
    product of the token ratios; geo: their geometric mean). Default geo with mode mask, as in Molt's recipes."""
    is_correction_mode: Literal["mask", "clip", "trunc"] = "mask"
    """What to do outside the band: mask the token (the whole sequence for seq/geo), clip the weight into the
    band, or truncate above (token level only)."""
    is_correction_threshold: tuple[float, float] = (0.5, 2.0)
    """Band [low, high] of the importance ratio exp(trainer_logprob - rollout_logprob)."""


@dataclass
class KLConfig:
    """KL regularisation towards the frozen reference policy."""

    coef: float = 0.0
    """Initial KL coefficient; 0 disables the reference model."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator per token (Schulman's k1, k2, k3)."""
    use_in: Literal["reward", "loss"] = "loss"
    """Apply the KL as a per-token reward penalty (REINFORCE++ style; reinforce and gae only) or as a loss term."""
    target: float | None = None
    """Adaptive controller target KL; None keeps the coefficient fixed."""
    horizon: int = 10000
    """Adaptive controller horizon (in samples)."""


@dataclass
class AlgoConfig:
    """The algorithm: pure functions in instar/algo selected by these names."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    dynamic_filter: tuple[float, float] | None = None
    """DAPO dynamic filter: keep prompt groups whose mean score lies strictly inside (low, high)."""
