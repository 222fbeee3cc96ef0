"""Advantage estimators: one registered function per `--algo.advantage.estimator` value.

Layout. Rows are segments, right-padded to [B, T]; `action_mask` marks the trainable tokens. A
trajectory may span several rows (`traj_index`), which must appear in segment order. Group statistics
count each trajectory once, whatever its number of segments.

Where rewards go.
* Sequence-level estimators (reinforce_baseline, rloo, grpo, dr_grpo) turn the trajectory's scalar
  reward (a multi-turn env's rewards are summed over turns by the env loop) into one advantage and
  broadcast it to every action token of all its segments.
* Token-level estimators (reinforce, gae) walk a trajectory's action tokens in order across its
  segments; prompt and observation tokens are transparent (discounting and the GAE bootstrap step
  from one action token straight to the next). The trajectory reward sits on its last action token,
  unless `token_rewards` gives dense rewards (e.g. each turn's env reward on that turn's last action
  token), which then replace it. With `--algo.kl.use_in reward`, -coef * KL is added on every token.
* on_policy_distill: advantage = teacher logprob - trainer logprob per token (the negated k1 sample
  of the reverse KL), undiscounted and without the outcome reward; the teacher is `ref_logprobs`.

A group with a single trajectory (its peers were dropped) has no baseline and gets advantage 0.

What an estimator needs (a critic, reference or old logprobs, several samples per prompt) is declared
beside its name in `ESTIMATORS`, as `Needs`; nothing else names estimators.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from instar.algo.kl import kl_penalty
from instar.algo.ops import masked_mean, masked_whiten
from instar.config import AlgoConfig, ConfigError

GRPO_EPS = 1e-6  # added to the group std so a group of equal rewards gives 0, not 0 / 0


@dataclass
class AdvantageInputs:
    """What the estimators read. [B, T] tensors are aligned with `action_mask`; [B] ones are per row."""

    action_mask: Tensor
    rewards: Tensor  # [B] reward of the row's trajectory (equal on all rows of one trajectory)
    group_index: Tensor  # [B] prompt group of the row
    traj_index: Tensor | None = None  # [B] trajectory of the row; None: every row is its own trajectory
    old_logprobs: Tensor | None = None  # [B, T] trainer logprobs before the update (KL in reward, distill)
    ref_logprobs: Tensor | None = None  # [B, T] reference policy, or the teacher for on_policy_distill
    values: Tensor | None = None  # [B, T] critic values before the update (gae)
    token_rewards: Tensor | None = None  # [B, T] dense rewards for reinforce / gae; replace `rewards`
    kl_coef: float = 0.0  # current KL coefficient (KLController.value), used with --algo.kl.use_in reward


@dataclass(frozen=True)
class Needs:
    """What an estimator reads besides the rewards, and what that asks of the run."""

    critic: bool = False  # critic values; its returns A + V then train the critic
    ref: bool = False  # reference logprobs
    old: bool = False  # the policy's logprobs before the update, from a pass of their own
    token_level: bool = False  # walks token rewards, so --algo.kl.use_in reward can add the KL penalty to them
    grouped: bool = False  # compares the samples of one prompt: --rollout.n_samples_per_prompt >= 2
    teacher: bool = False  # the reference is its teacher, not a KL anchor: --algo.kl.coef must be 0


@dataclass(frozen=True)
class Estimator:
    fn: Callable[[AdvantageInputs, AlgoConfig], Tensor]
    needs: Needs


def registered(name: str) -> Estimator:
    """The estimator --algo.advantage.estimator names (`ESTIMATORS`, at the end of this file)."""
    if name not in ESTIMATORS:
        raise ConfigError(f"--algo.advantage.estimator {name!r} is not registered; choose one of {sorted(ESTIMATORS)}")
    return ESTIMATORS[name]


def token_level() -> str:
    """The estimators that can take the KL penalty in their token rewards, for error messages."""
    return " / ".join(sorted(name for name, e in ESTIMATORS.items() if e.needs.token_level))


def compute_advantages(cfg: AlgoConfig, x: AdvantageInputs) -> tuple[Tensor, Tensor | None, dict[str, float]]:
    """Advantages [B, T] (0 off action tokens), critic returns [B, T] (critic estimators, else None), metrics."""
    name = cfg.advantage.estimator
    est = registered(name)
    _validate(cfg, est.needs, x)
    mask = x.action_mask.bool()
    adv = torch.where(mask, est.fn(x, cfg), 0).float()
    if not torch.isfinite(adv).all():
        raise ValueError(f"estimator {name} produced non-finite advantages; check rewards and logprobs for inf/NaN")
    returns = torch.where(mask, adv + x.values, 0) if est.needs.critic else None  # lambda-return = A + V
    adv = masked_whiten(adv, mask) if cfg.advantage.whiten else adv
    return adv, returns, {"advantage_mean": masked_mean(adv, mask).item(),
                          "advantage_abs_mean": masked_mean(adv.abs(), mask).item(),
                          "reward_mean": _trajectories(x)[1].float().mean().item()}


def _validate(cfg: AlgoConfig, needs: Needs, x: AdvantageInputs) -> None:
    name, mask = cfg.advantage.estimator, x.action_mask
    if mask.dim() != 2:
        raise ValueError(f"action_mask must be [B, T], got shape {tuple(mask.shape)}")
    for field, t in (("rewards", x.rewards), ("group_index", x.group_index), ("traj_index", x.traj_index)):
        if t is not None and tuple(t.shape) != (mask.shape[0],):
            raise ValueError(f"AdvantageInputs.{field} must be [B={mask.shape[0]}], got shape {tuple(t.shape)}")
    for field in ("old_logprobs", "ref_logprobs", "values", "token_rewards"):
        if (t := getattr(x, field)) is not None and t.shape != mask.shape:
            raise ValueError(f"AdvantageInputs.{field} must be shaped like action_mask {tuple(mask.shape)}, "
                             f"got {tuple(t.shape)}")
    if not torch.isfinite(x.rewards).all():
        raise ValueError(f"rewards must be finite, got {x.rewards.tolist()}")
    for field, needed in (("values", needs.critic), ("old_logprobs", needs.old), ("ref_logprobs", needs.ref)):
        if needed and getattr(x, field) is None:
            raise ValueError(f"--algo.advantage.estimator {name} needs AdvantageInputs.{field} (from the critic, the "
                             "policy or the reference / teacher); compute it, or pick an estimator such as grpo")
    if cfg.kl.use_in == "reward" and x.kl_coef > 0:
        if not needs.token_level:
            raise ValueError(f"--algo.kl.use_in reward shapes token rewards, which only {token_level()} use; "
                             f"set --algo.kl.use_in loss for --algo.advantage.estimator {name}")
        if x.old_logprobs is None or x.ref_logprobs is None:
            raise ValueError("--algo.kl.use_in reward with --algo.kl.coef > 0 needs old_logprobs and ref_logprobs")


# ---- per-trajectory and per-group views -------------------------------------------------------------


def _trajectories(x: AdvantageInputs) -> tuple[Tensor, Tensor, Tensor]:
    """(trajectory id per row [B] in 0..N-1, reward per trajectory [N], group id per trajectory [N] in 0..G-1)."""
    rows = len(x.rewards)
    traj = x.traj_index if x.traj_index is not None else torch.arange(rows)
    ids, row_traj = torch.unique(traj, return_inverse=True)
    first = torch.full((len(ids),), rows).scatter_reduce(0, row_traj, torch.arange(rows), "amin")
    reward, group = x.rewards[first], x.group_index[first]
    if (x.rewards != reward[row_traj]).any() or (x.group_index != group[row_traj]).any():
        raise ValueError("all rows (segments) of one trajectory must carry the same reward and group_index")
    return row_traj, reward, torch.unique(group, return_inverse=True)[1]


def _group_view(x: AdvantageInputs) -> tuple[Tensor, ...]:
    """Per row [B]: its trajectory's reward, and the mean, unbiased std and size of its prompt group
    (statistics over trajectories, so a multi-segment trajectory counts once)."""
    row_traj, reward, group = _trajectories(x)
    reward = reward.double()  # group statistics in float64: golden values stay exact
    size = torch.bincount(group).double()
    mean = torch.zeros_like(size).index_add_(0, group, reward) / size
    sq_dev = torch.zeros_like(size).index_add_(0, group, (reward - mean[group]) ** 2)
    std = torch.where(size > 1, (sq_dev / (size - 1).clamp(min=1)).sqrt(), 0)
    g = group[row_traj]
    return reward[row_traj], mean[g], std[g], size[g]


def _per_token(row_value: Tensor, x: AdvantageInputs) -> Tensor:
    return row_value.float()[:, None].expand(x.action_mask.shape)


# ---- sequence-level estimators ----------------------------------------------------------------------


def reinforce_baseline(x: AdvantageInputs, cfg: AlgoConfig) -> Tensor:
    """Reward minus its group mean, whitened over all action tokens of the batch (REINFORCE++-baseline)."""
    reward, mean, _, _ = _group_view(x)
    return masked_whiten(_per_token(reward - mean, x), x.action_mask)


def rloo(x: AdvantageInputs, cfg: AlgoConfig) -> Tensor:
    """Reward minus the mean of the other n-1 rewards of its group: (r - mean) * n / (n - 1)."""
    reward, mean, _, size = _group_view(x)
    return _per_token(torch.where(size > 1, (reward - mean) * size / (size - 1).clamp(min=1), 0), x)


def grpo(x: AdvantageInputs, cfg: AlgoConfig) -> Tensor:
    """(r - group mean) / (group std + 1e-6), with the unbiased std (as torch.std)."""
    reward, mean, std, _ = _group_view(x)
    return _per_token((reward - mean) / (std + GRPO_EPS), x)


def dr_grpo(x: AdvantageInputs, cfg: AlgoConfig) -> Tensor:
    """r - group mean, without the std division (Dr. GRPO). Its paper pairs it with a constant loss denominator:
    --actor.loss_agg_mode seq-mean-token-sum-norm (the default token-mean is not Dr. GRPO's)."""
    reward, mean, _, _ = _group_view(x)
    return _per_token(reward - mean, x)


# ---- token-level estimators -------------------------------------------------------------------------


@dataclass
class _Packing:
    """A trajectory's action tokens, in order across its segments, as one row of an [N, L] tensor:
    the action token at [rows[i], cols[i]] of the batch goes to [traj[i], pos[i]]."""

    rows: Tensor
    cols: Tensor
    traj: Tensor
    pos: Tensor
    length: Tensor  # [N] action tokens per trajectory

    def pack(self, t: Tensor) -> Tensor:
        out = t.new_zeros(len(self.length), int(self.length.max()))
        out[self.traj, self.pos] = t[self.rows, self.cols]
        return out

    def unpack(self, packed: Tensor, like: Tensor) -> Tensor:
        out = torch.zeros_like(like, dtype=packed.dtype)
        out[self.rows, self.cols] = packed[self.traj, self.pos]
        return out


def _pack(x: AdvantageInputs) -> _Packing:
    row_traj = _trajectories(x)[0]
    rows, cols = x.action_mask.bool().nonzero(as_tuple=True)  # row-major: segment order, then time
    order = torch.sort(row_traj[rows], stable=True).indices
    rows, cols = rows[order], cols[order]
    traj = row_traj[rows]
    length = torch.bincount(traj, minlength=int(row_traj.max()) + 1)
    if (length == 0).any():
        raise ValueError("a trajectory has no action tokens; drop it before estimating advantages")
    pos = torch.arange(len(rows)) - (length.cumsum(0) - length)[traj]
    return _Packing(rows, cols, traj, pos, length)


def _token_rewards(x: AdvantageInputs, cfg: AlgoConfig, p: _Packing) -> Tensor:
    """[N, L] rewards: outcome on the last action token (or the dense `token_rewards`), minus coef * KL."""
    if x.token_rewards is not None:
        rewards = p.pack(x.token_rewards.float())
    else:
        rewards = torch.zeros(len(p.length), int(p.length.max()))
        rewards[torch.arange(len(p.length)), p.length - 1] = _trajectories(x)[1].float()
    if cfg.kl.use_in == "reward" and x.kl_coef > 0:
        rewards = rewards - x.kl_coef * p.pack(kl_penalty(x.old_logprobs, x.ref_logprobs, cfg.kl.estimator).float())
    return rewards


def _gae(rewards: Tensor, values: Tensor, gamma: float, lam: float) -> Tensor:
    """GAE(gamma, lambda) over [N, L] packed action tokens; the value after the last one is 0. With lambda 1
    and values 0 it is the discounted return-to-go of the rewards."""
    adv, running = torch.zeros_like(rewards), torch.zeros(len(rewards))
    next_value = torch.zeros(len(rewards))
    for j in reversed(range(rewards.shape[1])):  # padding has reward 0 and value 0: it stays at 0
        delta = rewards[:, j] + gamma * next_value - values[:, j]
        running = delta + gamma * lam * running
        adv[:, j], next_value = running, values[:, j]
    return adv


def reinforce(x: AdvantageInputs, cfg: AlgoConfig) -> Tensor:
    """REINFORCE++: discounted return-to-go of the token rewards, whitened over all action tokens."""
    p = _pack(x)
    rewards = _token_rewards(x, cfg, p)
    returns = _gae(rewards, torch.zeros_like(rewards), cfg.advantage.gamma, 1.0)
    return masked_whiten(p.unpack(returns, x.action_mask.float()), x.action_mask)


def gae(x: AdvantageInputs, cfg: AlgoConfig) -> Tensor:
    """GAE(gamma, lambda) over the trajectory's action tokens; the value after the last one is 0."""
    p = _pack(x)
    adv = _gae(_token_rewards(x, cfg, p), p.pack(x.values.float()), cfg.advantage.gamma, cfg.advantage.lam)
    return p.unpack(adv, x.action_mask.float())


def on_policy_distill(x: AdvantageInputs, cfg: AlgoConfig) -> Tensor:
    """Per-token teacher logprob - student (trainer) logprob: minimising the reverse KL to the teacher."""
    return (x.ref_logprobs - x.old_logprobs).float()


# Each estimator with what it needs: the start-up checks, the cluster (which models start) and the loop
# (which passes run) read this table. Register another with ESTIMATORS["name"] = Estimator(fn, Needs(...)).
ESTIMATORS: dict[str, Estimator] = {
    "reinforce_baseline": Estimator(reinforce_baseline, Needs(grouped=True)),
    "rloo": Estimator(rloo, Needs(grouped=True)),
    "grpo": Estimator(grpo, Needs(grouped=True)),
    "dr_grpo": Estimator(dr_grpo, Needs(grouped=True)),
    "reinforce": Estimator(reinforce, Needs(token_level=True)),
    "gae": Estimator(gae, Needs(critic=True, token_level=True)),
    "on_policy_distill": Estimator(on_policy_distill, Needs(ref=True, old=True, teacher=True)),
}
