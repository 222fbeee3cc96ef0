"""Policy and value losses over one optimizer update, one call per trainer micro-batch.

Aggregation (`--actor.loss_agg_mode`). An update's loss is sum_t w_t l_t over every action token t of the
update (all micro-batches of all data-parallel ranks; one update is one mini-batch). With N its action tokens,
S its trajectories (a trajectory may span several rows, in several micro-batches and ranks), T_t the action
tokens of t's trajectory and M = --data.max_new_tokens:
  token-mean               w = 1 / N            (the default)
  seq-mean-token-mean      w = 1 / (S T_t)      the mean over trajectories of each one's token mean
  seq-mean-token-sum       w = 1 / S            the mean over trajectories of each one's token sum
  seq-mean-token-sum-norm  w = 1 / (S M)        Dr. GRPO's constant denominator
N and S are the trainer's per update (`global_num_tokens`, `global_num_seqs`); 1 / T_t comes per token from
the driver (`seq_weights`, which sum to 1 over a trajectory). Each call returns its micro-batch's *share*
of the sum, so summing the shares of every micro-batch and rank gives the update's loss exactly and the
update does not depend on how the batch is split. The trainer therefore backpropagates each share as is
and must *sum* gradients across ranks (FSDP2 averages by default: multiply the share by the world size,
or set the gradient divide factor to 1). Tokens dropped by IS correction, and rows run forward only,
still count in N, S and T; they add 0 to the sum. The entropy and KL terms are aggregated alike.

Metrics are token-mean shares (0-d tensors) whatever the aggregation: sum each over micro-batches and
ranks to get the update's mean over its action tokens.
  policy_loss        the surrogate part of the loss, as a token mean
  policy_clip_ratio  fraction of action tokens whose ratio was clipped (on kept tokens)
  policy_kl          mean of old_logprob - logprob (k1 estimate of KL(old || new))
  vllm_kl            mean of rollout_logprob - old_logprob (engine vs trainer, invariant 3)
  is_filter_ratio    fraction of action tokens dropped by IS correction
  entropy            when an entropy tensor is given
  ref_kl             mean KL(policy || reference) estimate per action token, when ref_logprobs are given
                     (added to the loss times the coefficient with --algo.kl.use_in loss)

NaN safety: every input is passed through `torch.where(action_mask, x, 0)` first and every dropped
token's loss through `torch.where(keep, loss, 0)`, and ratios are exp of a clamped log-ratio, so a
padded or dropped token adds exactly zero gradient to the policy term whatever its values (the entropy and KL
terms count every action token: the IS filter drops a token from the policy term only).

Loss modes (`--actor.loss_mode`), r = exp(logprob - old_logprob), band [1 - low, 1 + high]:
  ppo    -min(r A, clip(r) A); with --actor.dual_clip c, at most -c A for A < 0
  gspo   the same with the sequence ratio exp(mean_t log r) as value and per-token gradient (GSPO-token);
         the mean runs over the tokens IS correction kept
  cispo  -sg(clip(r)) A logprob: the clipped IS weight is a constant, every token keeps its gradient
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from instar.algo.is_correction import is_weights
from instar.algo.kl import kl_penalty
from instar.algo.ops import LOG_RATIO_CLAMP, register
from instar.config import ActorConfig, RLConfig

Pair = tuple[Tensor, Tensor]  # (per-token loss [B, T], clipped [B, T] bool)
# (logprobs, old_logprobs, advantages, keep, actor) -> Pair; inputs are 0 off the action tokens
TokenLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, ActorConfig], Pair]
LOSSES: dict[str, TokenLossFn] = {}


def _ratio(log_ratio: Tensor) -> Tensor:
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def _clipped_surrogate(ratio: Tensor, adv: Tensor, actor: ActorConfig) -> tuple[Tensor, Tensor]:
    low, high = actor.eps_clip_low_high
    unclipped, clipped = ratio * adv, ratio.clamp(1 - low, 1 + high) * adv
    loss, was_clipped = -torch.min(unclipped, clipped), clipped < unclipped
    if actor.dual_clip is not None:  # for A < 0 the loss grows with r without bound; cap it at -c A
        cap = -actor.dual_clip * adv
        was_clipped = was_clipped | ((adv < 0) & (loss > cap))
        loss = torch.where(adv < 0, torch.min(loss, cap), loss)
    return loss, was_clipped


@register(LOSSES, "ppo")
def ppo(logprobs: Tensor, old_logprobs: Tensor, adv: Tensor, keep: Tensor, actor: ActorConfig) -> Pair:
    return _clipped_surrogate(_ratio(logprobs - old_logprobs), adv, actor)


@register(LOSSES, "gspo")
def gspo(logprobs: Tensor, old_logprobs: Tensor, adv: Tensor, keep: Tensor, actor: ActorConfig) -> Pair:
    # a token IS correction dropped must not move its sequence's ratio
    log_ratio = torch.where(keep, logprobs - old_logprobs, 0)
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / keep.sum(-1, keepdim=True).clamp(min=1)
    # value: the sequence ratio; gradient: d log pi(y_t) of each token (GSPO-token)
    log_ratio = seq_log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) + logprobs - logprobs.detach()
    return _clipped_surrogate(log_ratio.exp(), adv, actor)


@register(LOSSES, "cispo")
def cispo(logprobs: Tensor, old_logprobs: Tensor, adv: Tensor, keep: Tensor, actor: ActorConfig) -> Pair:
    low, high = actor.eps_clip_low_high
    ratio = _ratio(logprobs - old_logprobs).detach()
    weight = ratio.clamp(1 - low, 1 + high)
    return -weight * adv * logprobs, weight != ratio


def policy_loss(cfg: RLConfig, logprobs: Tensor, old_logprobs: Tensor, rollout_logprobs: Tensor, advantages: Tensor,
                action_mask: Tensor, *, entropy: Tensor | None = None, ref_logprobs: Tensor | None = None,
                kl_coef: float | None = None, global_num_tokens: int | Tensor | None = None,
                seq_weights: Tensor | None = None, global_num_seqs: int | None = None,
                ) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the update's policy loss, and its metric shares (see the module doc).

    All tensors are [B, T] and aligned; only `logprobs` and `entropy` carry gradient. `old_logprobs` are
    the trainer's logprobs before the update, `rollout_logprobs` the engine's. `kl_coef` defaults to
    --algo.kl.coef (pass KLController.value when adaptive); `global_num_tokens` defaults to this
    micro-batch's own action-token count (the micro-batch is the whole update). The seq-mean modes need
    `seq_weights` (1 / the action tokens of each token's trajectory) and `global_num_seqs` (S)."""
    actor, kl = cfg.actor, cfg.algo.kl
    if actor.loss_mode not in LOSSES:
        raise ValueError(f"unknown --actor.loss_mode {actor.loss_mode!r}; choose one of {sorted(LOSSES)}")
    mask = action_mask.bool()
    n = mask.sum() if global_num_tokens is None else global_num_tokens
    if n <= 0:
        raise ValueError(f"global_num_tokens must be > 0 (the step's action-token count), got {n}")

    def clean(t: Tensor) -> Tensor:
        return torch.where(mask, t, 0)

    def share(t: Tensor) -> Tensor:
        return clean(t if t.is_floating_point() else t.to(logprobs.dtype)).sum() / n

    aggregate = _aggregation(cfg, n, seq_weights, global_num_seqs)
    lp = clean(logprobs)
    old, rollout, adv = (clean(t.detach()) for t in (old_logprobs, rollout_logprobs, advantages))
    weight, keep = is_weights(cfg.algo.advantage, old, rollout, mask)
    token_loss, clipped = LOSSES[actor.loss_mode](lp, old, adv, keep, actor)
    surrogate = torch.where(keep, token_loss * weight, 0)
    loss = aggregate(surrogate)
    metrics = {"policy_loss": share(surrogate).detach(), "policy_clip_ratio": share(clipped & keep),
               "policy_kl": share(old - lp.detach()), "vllm_kl": share(rollout - old), "is_filter_ratio": share(~keep)}
    if actor.entropy_coef != 0 and entropy is None:
        raise ValueError(f"--actor.entropy_coef {actor.entropy_coef} needs the per-token entropy; pass entropy=")
    if entropy is not None:
        metrics["entropy"] = share(entropy).detach()
        if actor.entropy_coef != 0:  # else no term: a zero one would still cost a backward through the softmax
            loss = loss - actor.entropy_coef * aggregate(clean(entropy))
    coef = kl.coef if kl_coef is None else kl_coef
    if kl.use_in == "loss" and coef > 0 and ref_logprobs is None:
        raise ValueError("--algo.kl.use_in loss with --algo.kl.coef > 0 needs ref_logprobs (the reference model)")
    if ref_logprobs is not None:  # measured whatever --algo.kl.use_in: the adaptive controller reads it
        ref_kl = clean(kl_penalty(lp, clean(ref_logprobs.detach()), kl.estimator))
        metrics["ref_kl"] = share(ref_kl).detach()
        if kl.use_in == "loss" and coef > 0:
            loss = loss + coef * aggregate(ref_kl)
    return loss, metrics


def _aggregation(cfg: RLConfig, n: int | Tensor, seq_weights: Tensor | None, num_seqs: int | None) -> Callable:
    """x -> sum_t w_t x_t with the weights of --actor.loss_agg_mode (module doc); x is 0 off the action tokens."""
    if cfg.actor.loss_agg_mode == "token-mean":
        return lambda x: x.sum() / n
    if seq_weights is None or not num_seqs:
        raise ValueError("a seq-mean --actor.loss_agg_mode needs seq_weights and global_num_seqs (the trajectories)")
    if cfg.actor.loss_agg_mode == "seq-mean-token-mean":
        return lambda x: (x * seq_weights).sum() / num_seqs
    norm = cfg.data.max_new_tokens if cfg.actor.loss_agg_mode == "seq-mean-token-sum-norm" else 1  # or token-sum
    return lambda x: x.sum() / (num_seqs * norm)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, action_mask: Tensor, *, clip: float,
               global_num_tokens: int | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clamp(V - V_old, +-clip),
    as the micro-batch's share of the global token-mean (like `policy_loss`). Use --critic.value_clip."""
    mask = action_mask.bool()
    n = mask.sum() if global_num_tokens is None else global_num_tokens
    v, old, ret = (torch.where(mask, t, 0) for t in (values, old_values.detach(), returns.detach()))
    plain, clipped = (v - ret) ** 2, (old + (v - old).clamp(-clip, clip) - ret) ** 2
    loss = torch.where(mask, 0.5 * torch.max(plain, clipped), 0).sum() / n
    return loss, {"value_loss": loss.detach(), "value_clip_ratio": (mask & (clipped > plain)).sum() / n}
