"""The engine as a Ray actor behind `RemoteEngine`: requests made together travel as one call and come
back each to its caller, equal to the engine's own answers; a caller that goes away frees its request."""

import asyncio

import pytest

from instar.config import EngineConfig
from instar.contract import SamplingParams
from instar.engines import EmbeddedEngine
from instar.runtime.engines import EngineActor, RemoteEngine

PROMPTS = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def _params(seed: int, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed)


@pytest.mark.slow
def test_requests_made_together_come_back_each_to_its_caller(ray_cluster, tiny_model_dir):
    async def direct():
        engine = EmbeddedEngine.from_pretrained(tiny_model_dir)
        try:
            return [await engine.generate(p, _params(i)) for i, p in enumerate(PROMPTS)]
        finally:
            await engine.close()

    async def through_ray():
        actor = EngineActor.remote(str(tiny_model_dir), "embedded", EngineConfig())
        engine = RemoteEngine(actor)
        together = await asyncio.gather(*(engine.generate(p, _params(i), f"s{i}") for i, p in enumerate(PROMPTS)))
        too_long = await asyncio.gather(engine.generate([1] * 100_000, _params(0)), engine.generate([3], _params(0)),
                                        return_exceptions=True)
        long = [asyncio.ensure_future(engine.generate([5, 6], _params(i, 100_000), f"long{i}")) for i in range(2)]
        while (await actor.load.remote()).running < 2:
            await asyncio.sleep(0.01)
        long[0].cancel()
        for _ in range(500):  # the engine drops the abandoned request at its next step
            if (await actor.load.remote()).running == 1:
                break
            await asyncio.sleep(0.01)
        running = (await actor.load.remote()).running
        long[1].cancel()
        await actor.close.remote()
        return together, too_long, running

    expected = asyncio.run(direct())
    together, too_long, running = asyncio.run(through_ray())
    assert [g.token_ids for g in together] == [g.token_ids for g in expected]
    for got, want in zip(together, expected):  # batched with other rows: float rounding differs, not tokens
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert "max_position_embeddings" in str(too_long[0]) and too_long[1].token_ids
    assert running == 1
