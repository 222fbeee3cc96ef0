"""From finished prompt groups to trainer inputs: filtering, per-segment rows, advantages, the loss.

Each trajectory segment is one trainer sample (one row); rows of one trajectory stay adjacent and in
segment order, as the estimators require.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
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
    """One row per segment, in trajectory order: each row's trajectory (``traj_index``) gives its reward and group."""
    trajs = [t for g in groups for t in g.trajectories]
    group_of = [gi for gi, g in enumerate(groups) for _ in g.trajectories]
    traj_index = [ti for ti, t in enumerate(trajs) for _ in t.segments]
    return Rows([seg for t in trajs for seg in t.segments],
                torch.tensor([trajs[ti].reward for ti in traj_index], dtype=torch.float32),
                torch.tensor([group_of[ti] for ti in traj_index]), torch.tensor(traj_index), trajs)


def turn_rewards(rows: Rows, turn_gamma: float) -> Tensor | None:
    """[B, T] token rewards when agents rewarded turns (else None): turn k's last action token gets R_k - R_{k+1},
    with R_k = r_k + turn_gamma * R_{k+1} its turn-discounted return, so that the undiscounted return-to-go of
    each of turn k's tokens is R_k. A trajectory rewarded as a whole has its reward on its last action token."""
    if all(t.turn_rewards is None for t in rows.trajectories):
        return None
    out = torch.zeros(len(rows.samples), max(len(s.action_mask) for s in rows.samples))
    ends: list[list[tuple[int, int]]] = [[] for _ in rows.trajectories]
    for b, (sample, t) in enumerate(zip(rows.samples, rows.traj_index.tolist())):
        ends[t] += [(b, i) for i in sample.turn_ends]
    for t, traj in enumerate(rows.trajectories):
        returns, gamma = [0.0], turn_gamma if traj.turn_rewards else 1.0
        for r in reversed(traj.turn_rewards or [0.0] * (len(ends[t]) - 1) + [traj.reward]):
            returns.insert(0, r + gamma * returns[0])
        for (b, i), now, later in zip(ends[t], returns, returns[1:]):
            out[b, i] = now - later
    return out


def advantages(cfg: RLConfig, rows: Rows, old_logprobs: list[Tensor] | None, ref_logprobs: list[Tensor] | None,
               values: list[Tensor] | None, kl_coef: float) -> tuple[list[Tensor], list[Tensor] | None, dict]:
    """Per-sample advantages (and gae returns), cut back to each sample's length."""
    mask = padded([s.action_mask for s in rows.samples], max(len(s.action_mask) for s in rows.samples), torch.bool)
    x = AdvantageInputs(action_mask=mask, rewards=rows.rewards, group_index=rows.group_index,
                        traj_index=rows.traj_index, old_logprobs=right_pad(old_logprobs) if old_logprobs else None,
                        ref_logprobs=right_pad(ref_logprobs) if ref_logprobs else None,
                        values=right_pad(values) if values else None, kl_coef=kl_coef,
                        token_rewards=turn_rewards(rows, cfg.algo.advantage.turn_gamma) if registered(
                            cfg.algo.advantage.estimator).needs.token_level else None)
    adv, returns, metrics = compute_advantages(cfg.algo, x)
    lengths = [len(s.token_ids) for s in rows.samples]
    cut = [adv[b, :n] for b, n in enumerate(lengths)]
    return cut, ([returns[b, :n] for b, n in enumerate(lengths)] if returns is not None else None), metrics


def needs_old(cfg: RLConfig) -> bool:
    """Whether the advantages need the policy's pre-update logprobs (KL in the reward, distillation)."""
    kl = cfg.algo.kl
    return registered(cfg.algo.advantage.estimator).needs.old or (kl.use_in == "reward" and kl.coef > 0)


def mini_batches(rows: Rows, cfg: RLConfig, step: int) -> list[list[int]]:
    """The updates of one step as row indices: per epoch the trajectories are shuffled (seeded by
    --actor.seed, the step and the epoch) and dealt into as many mini-batches as --train.batch_size splits
    the configured rollout batch into (one when unset), a trajectory's segments kept together. A batch that
    lost trajectories (dropped, filtered) keeps the number of updates with smaller mini-batches, down to one
    trajectory per data-parallel rank."""
    n = len(rows.trajectories)
    total = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    per_batch = total // cfg.train.batch_size if cfg.train.batch_size else 1
    k = max(1, min(per_batch, n // cfg.fsdp.data_size))
    by_traj: list[list[int]] = [[] for _ in range(n)]
    for row, t in enumerate(rows.traj_index.tolist()):
        by_traj[t].append(row)
    out = []
    for epoch in range(cfg.train.max_epochs):
        order = list(range(n))  # one mini-batch holds every row in order, however they were shuffled
        random.Random(f"{cfg.actor.seed}-{step}-{epoch}").shuffle(order)
        bounds = [n * j // k for j in range(k + 1)]
        out += [sorted(r for t in order[a:b] for r in by_traj[t]) for a, b in zip(bounds, bounds[1:])]
    return out


def forward_only(cfg: RLConfig, samples: list[Sample], advantages: list[Tensor], kl_coef: float) -> list[int]:
    """Rows whose policy loss has no gradient: a zero advantage on every action token (a group whose
    rewards are all equal, under GRPO) and no entropy bonus or KL term in the loss. The trainer runs
    them forward only (their metrics and old logprobs), which leaves the update as it was."""
    if not samples or cfg.actor.entropy_coef != 0 or (cfg.algo.kl.use_in == "loss" and kl_coef > 0):
        return []
    mask = padded([s.action_mask for s in samples], max(len(s.action_mask) for s in samples), torch.bool)
    return ((right_pad(advantages, mask.shape[1]) == 0) | ~mask).all(1).nonzero()[:, 0].tolist()


def seq_weights(cfg: RLConfig, rows: Rows) -> list[Tensor] | None:
    """Per row, 1 / its trajectory's action tokens on each action token: what a seq-mean --actor.loss_agg_mode
    needs of the trajectories (`StepInputs.seq_weights`); None under token-mean."""
    if cfg.actor.loss_agg_mode == "token-mean":
        return None
    totals = [sum(s.num_actions for s in t.segments) for t in rows.trajectories]
    return [torch.tensor(s.action_mask) / totals[t] for s, t in zip(rows.samples, rows.traj_index.tolist())]


def rl_loss(cfg: RLConfig, kl_coef: float, logprobs: Tensor, entropy: Tensor, x: LossInputs) -> tuple[Tensor, dict]:
    """The trainer's per-micro-batch loss (see `instar.train.worker.LossFn`)."""
    return policy_loss(cfg, logprobs, x.old_logprobs, x.rollout_logprobs, x.advantages, x.action_mask,
                       entropy=entropy, ref_logprobs=x.ref_logprobs, kl_coef=kl_coef,
                       global_num_tokens=x.global_num_action_tokens, seq_weights=x.seq_weights,
                       global_num_seqs=x.global_num_seqs)


def critic_loss(cfg: RLConfig, values: Tensor, x: LossInputs) -> tuple[Tensor, dict]:
    """The trainer's per-micro-batch critic loss (see `instar.train.worker.ValueLossFn`)."""
    return value_loss(values, x.old_values, x.returns, x.action_mask, clip=cfg.critic.value_clip,
                      global_num_tokens=x.global_num_action_tokens)


def rollout_metrics(trajs: list[Trajectory], policy_version: int) -> dict[str, float]:
    """Reward (mean, population std, min, max, the fraction of groups whose rewards are all equal), score,
    length, turns, tool calls, truncation and staleness of the trained trajectories, and `info_metrics`."""
    n = max(len(trajs), 1)
    actions = [sum(s.num_actions for s in t.segments) for t in trajs]
    staleness = [policy_version - min(v for s in t.segments for v, m in zip(s.versions, s.action_mask) if m)
                 for t in trajs]
    rewards, groups = torch.tensor([t.reward for t in trajs] or [0.0]), defaultdict(set)
    for t in trajs:
        groups[t.group_id].add(t.reward)
    return {"reward": rewards.mean().item(), "reward/std": rewards.std(correction=0).item(),
            "reward/min": rewards.min().item(), "reward/max": rewards.max().item(),
            "reward/zero_std_groups": sum(len(g) == 1 for g in groups.values()) / max(len(groups), 1),
            "score": sum(t.outcome for t in trajs) / n, "response_length": sum(actions) / n,
            "turns_per_trajectory": sum(t.turns for t in trajs) / n,
            "tool_calls_per_trajectory": sum(t.tool_calls for t in trajs) / n,
            "truncation_rate": sum(t.truncated for t in trajs) / n,
            "segments_per_trajectory": sum(len(t.segments) for t in trajs) / n,
            "staleness_max": float(max(staleness, default=0)), "trajectories": float(len(trajs)),
            **{f"staleness/{k}": c / n for k, c in Counter(staleness).items()}, **info_metrics(trajs)}


def info_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """The mean and population std of each reward function's value (``info["rewards"]``) as reward/<name>/mean
    and /std, and of every numeric field of the agents' ``Result.info`` (an Env's, over its turns) as info/<key>/..."""
    values: defaultdict[str, list[float]] = defaultdict(list)
    for t in trajs:
        for name, v in t.info.get("rewards", {}).items():
            values[f"reward/{name}"].append(v)
        turns = t.info.get("turns")
        for info in turns if isinstance(turns, list) else [t.info]:
            for k, v in info.items() if isinstance(info, dict) else ():
                if isinstance(v, (int, float)):
                    values[f"info/{k}"].append(float(v))
    out = {}
    for k, v in values.items():
        x = torch.tensor(v)
        out[f"{k}/mean"], out[f"{k}/std"] = x.mean().item(), x.std(correction=0).item()
    return out
