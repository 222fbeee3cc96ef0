"""What the engine tests share: prompts, a fresh embedded engine per body, HF transformers' greedy tokens and
teacher-forced logprobs to compare with, a weight update in the middle of a turn, and the sampling tests'
6-token logits with their analytic distributions."""

import asyncio
import copy

import pytest
import torch

from instar.config import EngineConfig
from instar.contract import SamplingParams
from instar.engines import EmbeddedEngine

PROMPTS = [[5, 77, 301], [12, 400, 9, 250, 33, 71, 2, 18, 90, 91, 92, 300, 301, 302, 17, 16, 15],
           [260, 261, 262, 263, 264, 265, 266, 267, 268], [100 + i for i in range(30)]]


# The engine's code is the same on a GPU: tests that compare it with HF run there too, where there is one.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


def run_engine(model, body, cfg=None, device="cpu"):
    """Run ``await body(engine)`` on a fresh engine over a copy of ``model`` on ``device``; always closes it."""
    async def main():
        engine = EmbeddedEngine(copy.deepcopy(model).to(device), cfg or EngineConfig())
        try:
            return await body(engine)
        finally:
            await engine.close()
    return asyncio.run(main())


def hf_logprobs(model, prompt, tokens, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return (logits / temperature).log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def perturbed(model, scale=0.05):
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return new


async def swap_mid_turn(engine, mode, new_model, prompt, while_paused=None):
    """A greedy 12-token turn, paused in ``mode`` once 4 tokens are sampled, ``new_model`` loaded as version
    1, resumed: (tokens the request held just after the pause, the generation)."""
    task = asyncio.create_task(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12)))
    while not engine._running or engine._running[0].num_sampled < 4:
        await asyncio.sleep(0)
    await engine.pause(mode)
    at_pause = engine._running[0].num_sampled
    if while_paused is not None:
        await while_paused()
    await engine.update_weights(new_model.named_parameters(), version=1)  # tied: no lm_head.weight
    await engine.resume()
    return at_pause, await task


LOGITS = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.0, -1.0])
# probabilities at temperature 1: .605 .222 .082 .050 .030 .011


def analytic(kept: list[int], temperature: float = 1.0) -> torch.Tensor:
    """softmax(LOGITS / temperature) restricted to ``kept`` (renormalised), zero elsewhere."""
    probs = torch.zeros(6)
    probs[kept] = (LOGITS[kept] / temperature).softmax(-1)
    return probs
