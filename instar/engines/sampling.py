"""Sampling: a pure function from a batch of logits and per-request settings to (token, logprob).

The distribution actually sampled from is built in this order, vLLM's, so that both engines sample
(and report logprobs of) the same distribution:

1. temperature: ``logits / T`` (``T == 0`` means greedy: argmax of the raw logits);
2. min-p: keep tokens whose probability is at least ``min_p`` times the largest one (``0``: all);
3. top-k: keep the ``k`` highest-ranked tokens (``k <= 0``: all; ties are broken by sort order);
4. top-p: keep the smallest set of highest-ranked tokens whose probability, renormalised over the
   tokens 2-3 kept, reaches ``p`` (``p == 1``: all).

Which logprob comes back is the ``logprobs_mode`` setting (``--engine.logprobs_mode``), because
importance-sampling correction divides by it:

* ``processed``: log-probability of the sampled token under the distribution of 1-4, i.e. the
  behaviour policy that really produced the token. Filtered-out tokens have -inf (never sampled).
* ``raw``: log-probability under the unmodified model distribution (temperature 1, no filter), the
  same quantity a trainer forward computes with ``log_softmax(logits)``.

Greedy requests (temperature 0) always return the raw logprob: the processed distribution is a
point mass (logprob 0), which carries no information for a trainer.

An unseeded request draws one uniform number per token from torch's generator and inverts the CDF. A
seeded request races: the argmax of its logprobs plus Gumbel noise hashed from its seed, the token's
index in the request and each token id (the exponential race vLLM samples seeded requests with). So it
samples alike whatever else shares the batch, and even where batching changes the logits in their last
bits: a token changes only when two noisy scores tie to rounding, where one CDF draw changes it whenever it
lies within rounding of any of the vocabulary's boundaries (a few tokens in a thousand of a random model).
"""

from __future__ import annotations

import hashlib
from typing import Literal

import torch

from instar.contract import SamplingParams
from instar.engines.protocol import StepAccelerator

LogprobsMode = Literal["processed", "raw"]


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits with top-k / top-p / min-p filtered tokens set to -inf, shape (B, V).
    Greedy rows (temperature 0) are left at temperature 1 and unfiltered; `sample` takes their argmax."""
    logits, device = logits.float(), logits.device
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
    scaled = logits / temps[:, None]
    if not any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
        return scaled
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    ratio = (sorted_logits - sorted_logits[:, :1]).exp()  # p_i / p_max
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    keep = (ratio >= min_p[:, None]) & (torch.arange(vocab, device=device)[None, :] < top_k[:, None])
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    # A token stays if the mass ranked above it is still short of p; rows with p == 1 keep everything
    # (float rounding can push the cumulative sum past 1 on the tail).
    keep &= ((probs.cumsum(dim=-1) - probs) < top_p[:, None]) | (top_p[:, None] >= 1)
    mask = torch.zeros_like(keep).scatter_(1, order, keep)
    return scaled.masked_fill(~mask, float("-inf"))


_MIX = [c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)]  # splitmix64's


def race(logprobs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per row the argmax of ``logprobs`` (B, V) plus Gumbel noise hashed from the row's int64 key and the token id."""
    x = keys[:, None] + torch.arange(logprobs.shape[-1], device=keys.device) * _MIX[0]  # int64 wraps: splitmix64,
    x = (x ^ (x >> 30 & (1 << 34) - 1)) * _MIX[1]  # logical shifts by masking
    x = (x ^ (x >> 27 & (1 << 37) - 1)) * _MIX[2]
    u = (x >> 40 & (1 << 24) - 1).float().add_(0.5).mul_(2.0 ** -24)
    return (logprobs - u.log_().neg_().log_()).argmax(dim=-1)


def _inverted(logprobs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row the token where the CDF of ``logprobs`` (B, V) passes the uniform draw ``u[row]``."""
    cdf = logprobs.exp().cumsum(dim=-1)
    # right=True skips zero-probability tokens (their cdf equals their predecessor's); the minimum guards
    # u * total rounding up to total, which would point past the last token with probability > 0.
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    if bool((tokens == cdf.shape[-1]).any()):  # rare: only then the pass over the whole cdf
        tokens = torch.minimum(tokens, (cdf < cdf[:, -1:]).sum(dim=-1))
    return tokens


def sample(logits: torch.Tensor, params: list[SamplingParams], counts: list[int],
           logprobs_mode: LogprobsMode = "processed", accelerator: StepAccelerator | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` (B, V), each the ``counts[row]``-th of its request. Returns (token ids
    (B,) int64, logprobs (B,) float32). Rows at temperature 1 with no filter (all seeded or none) through
    ``accelerator`` when given and it takes them, from the same draws."""
    device = logits.device
    untouched = all(p.temperature in (0, 1) and p.top_k <= 0 and p.top_p >= 1 and p.min_p <= 0 for p in params)
    seeded = [p.seed is not None for p in params]
    keys = torch.tensor([int.from_bytes(hashlib.blake2b(f"{p.seed}-{n}".encode(), digest_size=8).digest(), signed=True)
                         if p.seed is not None else 0 for p, n in zip(params, counts)], device=device
                        ) if any(seeded) else None
    if accelerator is not None and untouched and all(p.temperature for p in params) and all(seeded) != (keys is None):
        if (sampled := accelerator.sample(logits, torch.rand(len(params)), keys)) is not None:
            return sampled
    raw = logits.float().log_softmax(dim=-1)
    processed = raw if untouched else filter_logits(logits, params).log_softmax(dim=-1)
    tokens = race(processed, keys) if all(seeded) else _inverted(processed, torch.rand(len(params), device=device))
    if keys is not None and not all(seeded):
        tokens = torch.where(torch.tensor(seeded, device=device), race(processed, keys), tokens)
    greedy_rows = [p.temperature == 0 for p in params]
    if any(greedy_rows):
        greedy = torch.tensor(greedy_rows, device=device)
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
        use_raw, pick = greedy | (logprobs_mode == "raw"), tokens[:, None]
        return tokens, torch.where(use_raw, raw.gather(1, pick)[:, 0], processed.gather(1, pick)[:, 0])
    return tokens, (raw if logprobs_mode == "raw" else processed).gather(1, tokens[:, None])[:, 0]
