"""From finished prompt groups to trainer inputs: filtering, per-segment rows, advantages, the loss.

Each trajectory segment is one trainer sample (one row); rows of one trajectory stay adjacent and in
segment order, as the estimators require.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from instar.algo import AdvantageInputs, compute_advantages, dynamic_filter, policy_loss, registered, value_loss
from instar.config import RLConfig
from instar.contract import ContractError, Sample, Trajectory
from instar.runtime.pool import Group
from instar.train.batch import LossInputs, padded, right_pad


@dataclass
class Rows:
    samples: list[Sample]
    rewards: Tensor  # [B] reward of each row's trajectory
    group_index: Tensor  # [B]
    traj_index: Tensor  # [B]
    trajectories: list[Trajectory]


def select(groups: list[Group], cfg: RLConfig) -> tuple[list[Group], list[Group], dict[str, float]]:
    """(kept, rejected, metrics): invalid trajectories dropped (counted by reason), groups left empty
    rejected, then the dynamic filter. Kept groups are copies holding only valid trajectories."""
    dropped: Counter[str] = Counter()
    kept, rejected = [], []
    for g in groups:
        valid = []
        for t in g.trajectories:
            try:
                t.validate()  # the invariant check on every batch, in the driver too
                valid.append(t)
            except ContractError:
                dropped["invalid"] += 1
        if valid:
            kept.append(replace(g, trajectories=valid))
        else:
            rejected.append(g)
            dropped["empty_group"] += 1
    metrics = {f"dropped/{k}": float(v) for k, v in dropped.items()}
    if cfg.algo.dynamic_filter is not None and kept:
        scores = torch.tensor([t.outcome for g in kept for t in g.trajectories])
        index = torch.tensor([k for k, g in enumerate(kept) for _ in g.trajectories])
        keep, pass_rate = dynamic_filter(scores, index, cfg.algo.dynamic_filter)
        rejected += [g for k, g in enumerate(kept) if not keep[index == k].all()]
        kept = [g for k, g in enumerate(kept) if keep[index == k].all()]
        metrics["dynamic_filter/pass_rate"] = pass_rate
    return kept, rejected, metrics


def to_rows(groups: list[Group]) -> Rows:
    samples, rewards, group_index, traj_index, trajs = [], [], [], [], []
    for gi, g in enumerate(groups):
        for t in g.trajectories:
            for seg in t.segments:
                samples.append(seg)
                rewards.append(t.reward)
                group_index.append(gi)
                traj_index.append(len(trajs))
            trajs.append(t)
    return Rows(samples, torch.tensor(rewards, dtype=torch.float32), torch.tensor(group_index),
                torch.tensor(traj_index), trajs)


def advantages(cfg: RLConfig, rows: Rows, old_logprobs: list[Tensor] | None, ref_logprobs: list[Tensor] | None,
               values: list[Tensor] | None, kl_coef: float) -> tuple[list[Tensor], list[Tensor] | None, dict]:
    """Per-sample advantages (and gae returns), cut back to each sample's length."""
    mask = padded([s.action_mask for s in rows.samples], max(len(s.action_mask) for s in rows.samples), torch.bool)
    x = AdvantageInputs(action_mask=mask, rewards=rows.rewards, group_index=rows.group_index,
                        traj_index=rows.traj_index, old_logprobs=right_pad(old_logprobs) if old_logprobs else None,
                        ref_logprobs=right_pad(ref_logprobs) if ref_logprobs else None,
                        values=right_pad(values) if values else None, kl_coef=kl_coef)
    adv, returns, metrics = compute_advantages(cfg.algo, x)
    lengths = [len(s.token_ids) for s in rows.samples]
    cut = [adv[b, :n] for b, n in enumerate(lengths)]
    return cut, ([returns[b, :n] for b, n in enumerate(lengths)] if returns is not None else None), metrics


def needs_old(cfg: RLConfig) -> bool:
    """Whether the advantages need the policy's pre-update logprobs (KL in the reward, distillation)."""
    kl = cfg.algo.kl
    return registered(cfg.algo.advantage.estimator).needs.old or (kl.use_in == "reward" and kl.coef > 0)


def updates_per_batch(cfg: RLConfig) -> int:
    """Optimizer updates per rollout batch and epoch: --train.batch_size splits the configured batch."""
    total = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    return total // cfg.train.batch_size if cfg.train.batch_size else 1


def mini_batches(rows: Rows, cfg: RLConfig, step: int) -> list[list[int]]:
    """The updates of one step as row indices: per epoch the trajectories are shuffled (seeded by
    --actor.seed, the step and the epoch) and dealt into `updates_per_batch` mini-batches, a
    trajectory's segments kept together. A batch that lost trajectories (dropped, filtered) keeps
    the number of updates with smaller mini-batches, down to one trajectory per data-parallel rank."""
    n = len(rows.trajectories)
    k = max(1, min(updates_per_batch(cfg), n // cfg.fsdp.data_size))
    by_traj: list[list[int]] = [[] for _ in range(n)]
    for row, t in enumerate(rows.traj_index.tolist()):
        by_traj[t].append(row)
    out = []
    for epoch in range(cfg.train.max_epochs):
        order = list(range(n))
        if k > 1 or epoch > 0:
            random.Random(f"{cfg.actor.seed}-{step}-{epoch}").shuffle(order)
        bounds = [n * j // k for j in range(k + 1)]
        out += [sorted(r for t in order[a:b] for r in by_traj[t]) for a, b in zip(bounds, bounds[1:])]
    return out


def forward_only(cfg: RLConfig, samples: list[Sample], advantages: list[Tensor], kl_coef: float) -> list[int]:
    """Rows whose policy loss has no gradient: a zero advantage on every action token (a group whose
    rewards are all equal, under GRPO) and no entropy bonus or KL term in the loss. The trainer runs
    them forward only (their metrics and old logprobs), which leaves the update as it was."""
    if cfg.actor.entropy_coef != 0 or (cfg.algo.kl.use_in == "loss" and kl_coef > 0):
        return []
    if not samples:
        return []
    mask = padded([s.action_mask for s in samples], max(len(s.action_mask) for s in samples), torch.bool)
    return ((right_pad(advantages, mask.shape[1]) == 0) | ~mask).all(1).nonzero()[:, 0].tolist()


def rl_loss(cfg: RLConfig, kl_coef: float, logprobs: Tensor, entropy: Tensor, x: LossInputs) -> tuple[Tensor, dict]:
    """The trainer's per-micro-batch loss (see `instar.train.worker.LossFn`)."""
    return policy_loss(cfg, logprobs, x.old_logprobs, x.rollout_logprobs, x.advantages, x.action_mask,
                       entropy=entropy, ref_logprobs=x.ref_logprobs, kl_coef=kl_coef,
                       global_num_tokens=x.global_num_action_tokens)


def critic_loss(cfg: RLConfig, values: Tensor, x: LossInputs) -> tuple[Tensor, dict]:
    """The trainer's per-micro-batch critic loss (see `instar.train.worker.ValueLossFn`)."""
    return value_loss(values, x.old_values, x.returns, x.action_mask, clip=cfg.critic.value_clip,
                      global_num_tokens=x.global_num_action_tokens)


def rollout_metrics(trajs: list[Trajectory], policy_version: int) -> dict[str, float]:
    """Reward, score, length, truncation and staleness of the trained trajectories."""
    n = max(len(trajs), 1)
    actions = [sum(s.num_actions for s in t.segments) for t in trajs]
    staleness = [policy_version - min(v for s in t.segments for v, m in zip(s.versions, s.action_mask) if m)
                 for t in trajs]
    out = {"reward": sum(t.reward for t in trajs) / n, "score": sum(t.outcome for t in trajs) / n,
           "response_length": sum(actions) / n, "truncation_rate": sum(t.truncated for t in trajs) / n,
           "segments_per_trajectory": sum(len(t.segments) for t in trajs) / n,
           "staleness_max": float(max(staleness, default=0)), "trajectories": float(len(trajs))}
    for k, c in Counter(staleness).items():
        out[f"staleness/{k}"] = c / n
    return out
