"""The sampling function against analytic distributions on a 6-token vocabulary."""

import pytest
import torch
from helpers.engine import DEVICES, LOGITS, analytic

from instar.contract import SamplingParams
from instar.engines.sampling import filter_logits, race, sample

GOLDEN_RACE = [1, 3, 0, 3, 0]
# LOGITS' probabilities at temperature 1: .605 .222 .082 .050 .030 .011
CASES = [
    (SamplingParams(temperature=1.0), analytic([0, 1, 2, 3, 4, 5])),
    (SamplingParams(temperature=0.5), analytic([0, 1, 2, 3, 4, 5], 0.5)),
    (SamplingParams(temperature=2.0, top_k=3), analytic([0, 1, 2], 2.0)),
    # cumulative .605, .827: token 2 has .827 >= .8 ranked above it
    (SamplingParams(top_p=0.8), analytic([0, 1])),
    # threshold .1 * .605 = .0605 drops .050 and below
    (SamplingParams(min_p=0.1), analytic([0, 1, 2])),
    # top-4 renormalised: .631 .232 .085 .052, cumulative .863 before token 3 reaches .948 >= .9
    (SamplingParams(top_k=4, top_p=0.9), analytic([0, 1, 2])),
    # min-p first (vLLM's order) keeps 0-2, renormalised .665 .245 .090: .910 before token 2 >= .88.
    # (top-p on the full distribution would have kept token 2: .827 < .88.)
    (SamplingParams(min_p=0.1, top_p=0.88), analytic([0, 1])),
]


@pytest.mark.parametrize("params,expected", CASES)
def test_processed_distribution_is_analytic(params, expected):
    probs = filter_logits(LOGITS[None], [params]).softmax(-1)[0]
    assert torch.allclose(probs, expected, atol=1e-6)


@pytest.mark.parametrize("seeded", [False, True], ids=["cdf", "race"])
@pytest.mark.parametrize("params,expected", CASES)
def test_sample_frequencies_and_logprobs(params, expected, seeded):
    n = 20000
    rows = [params.replace(seed=i) for i in range(n)] if seeded else [params] * n
    tokens, processed = sample(LOGITS.expand(n, 6), rows, [0] * n, "processed")
    frequencies = torch.bincount(tokens, minlength=6) / n
    assert (frequencies - expected).abs().max() < 0.015  # > 4 standard deviations at n = 20000
    assert frequencies[expected == 0].sum() == 0  # filtered tokens are never drawn
    assert torch.allclose(processed, expected[tokens].log(), atol=1e-5)
    raw_tokens, raw = sample(LOGITS.expand(n, 6), rows, [0] * n, "raw")
    assert torch.allclose(raw, LOGITS.log_softmax(-1)[raw_tokens], atol=1e-6)
    assert torch.equal(raw_tokens, tokens) == seeded  # seeded rows draw again what they drew


def test_greedy_returns_argmax_and_raw_logprob():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    for params in ([SamplingParams(temperature=0, top_k=2)] * 2, [SamplingParams(temperature=0, seed=3)] * 2):
        tokens, logprobs = sample(logits, params, [0, 0], "processed")
        assert tokens.tolist() == [0, 5]
        assert torch.allclose(logprobs, LOGITS.log_softmax(-1)[0].expand(2))


@pytest.mark.parametrize("device", DEVICES)
def test_the_race_is_golden(device):
    # splitmix64 of key + id * golden ratio, top 24 bits, Gumbel noise; pinned so that a change of the hash shows
    keys = torch.tensor([0, 1, -5, 2**62, 123456789], device=device)
    logprobs = LOGITS.log_softmax(-1).expand(5, 6).to(device)
    assert race(logprobs, keys).tolist() == GOLDEN_RACE
    one, two = torch.zeros(1, 6, device=device), torch.zeros(2, 6, device=device)
    assert race(one, keys[:1]).tolist() == race(two, keys[:2]).tolist()[:1]


def test_seeded_rows_sample_alike_whatever_shares_the_batch():
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(50)]

    def draw(rows, counts=None, logits=LOGITS):
        return sample(logits.expand(len(rows), 6), rows, counts or [0] * len(rows))[0].tolist()

    a = draw(params)
    assert a == draw(params)
    assert draw(params[7:8]) == [a[7]]  # a row's sample depends on its own seed only
    assert a != draw(params, [1] * 50)  # the next token of each request draws anew
    assert a != draw([p.replace(seed=p.seed + 100) for p in params])
    # Unseeded rows draw from torch's default generator and leave seeded rows alone.
    assert draw([SamplingParams(), params[7], SamplingParams()])[1] == a[7]
    # A random model's near-uniform rows, their logits changed in the last bits (as batching changes them): the race
    # keeps every token, where one CDF draw per row lies within rounding of a boundary a few times in a thousand.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 512, generator=g) * 0.1
    nudged = logits * (1 + torch.randn(4000, 512, generator=g) * 2e-7)
    rows = [SamplingParams(seed=s) for s in range(4000)]
    assert torch.equal(sample(logits, rows, [0] * 4000)[0], sample(nudged, rows, [0] * 4000)[0])


def test_a_draw_that_rounds_to_the_total_takes_the_last_token_with_probability(monkeypatch):
    # u * total rounding up to the total lies past every cdf entry (simulated by u = 1); the token must be
    # the last one the filter kept (top-k 2: token 1; no filter: token 3), never one past the vocabulary
    monkeypatch.setattr(torch, "rand", lambda n, device=None: torch.ones(n, device=device))
    logits = torch.tensor([[0.0, 0.0, -1.0, -2.0], [5.0, 0.0, 0.0, 0.0]])
    tokens, logprobs = sample(logits, [SamplingParams(top_k=2), SamplingParams()], [0, 0])
    assert tokens.tolist() == [1, 3]
    assert torch.isfinite(logprobs).all()
