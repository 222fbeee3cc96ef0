"""The sampling function against analytic distributions on a 6-token vocabulary."""

import pytest
import torch
from helpers.engine import LOGITS, analytic

from instar.contract import SamplingParams
from instar.engines.sampling import filter_logits, sample

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


@pytest.mark.parametrize("params,expected", CASES)
def test_sample_frequencies_and_logprobs(params, expected):
    n = 20000
    generators = [torch.Generator().manual_seed(i) for i in range(n)]
    tokens, processed = sample(LOGITS.expand(n, 6), [params] * n, generators, "processed")
    frequencies = torch.bincount(tokens, minlength=6) / n
    assert (frequencies - expected).abs().max() < 0.015  # > 4 standard deviations at n = 20000
    assert frequencies[expected == 0].sum() == 0  # filtered tokens are never drawn
    assert torch.allclose(processed, expected[tokens].log(), atol=1e-5)
    _, raw = sample(LOGITS.expand(n, 6), [params] * n, [torch.Generator().manual_seed(i) for i in range(n)], "raw")
    assert torch.allclose(raw, LOGITS.log_softmax(-1)[tokens], atol=1e-6)


def test_greedy_returns_argmax_and_raw_logprob():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    params = [SamplingParams(temperature=0, top_k=2)] * 2
    tokens, logprobs = sample(logits, params, [torch.Generator(), torch.Generator()], "processed")
    assert tokens.tolist() == [0, 5]
    assert torch.allclose(logprobs, LOGITS.log_softmax(-1)[0].expand(2))


def test_seeded_generators_reproduce_samples_row_by_row():
    params = [SamplingParams(temperature=1.0)] * 50

    def draw(seeds):
        return sample(LOGITS.expand(len(seeds), 6), params[: len(seeds)],
                      [torch.Generator().manual_seed(s) for s in seeds])[0].tolist()

    a, b = draw(range(50)), draw(range(50))
    assert a == b
    assert draw([7]) == [a[7]]  # a row's sample depends on its own seed only
    assert a != draw(range(100, 150))
    # Unseeded rows (generator None) draw from torch's default generator and leave seeded rows alone.
    mixed = sample(LOGITS.expand(3, 6), params[:3], [None, torch.Generator().manual_seed(7), None])[0].tolist()
    assert mixed[1] == a[7]


def test_a_draw_that_rounds_to_the_total_takes_the_last_token_with_probability(monkeypatch):
    # u * total rounding up to the total lies past every cdf entry (simulated by u = 1); the token must be
    # the last one the filter kept (top-k 2: token 1; no filter: token 3), never one past the vocabulary
    monkeypatch.setattr(torch, "rand", lambda n: torch.ones(n))
    logits = torch.tensor([[0.0, 0.0, -1.0, -2.0], [5.0, 0.0, 0.0, 0.0]])
    tokens, logprobs = sample(logits, [SamplingParams(top_k=2), SamplingParams()], [None, None])
    assert tokens.tolist() == [1, 3]
    assert torch.isfinite(logprobs).all()
