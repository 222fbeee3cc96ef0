"""The engine as a Ray actor behind `RemoteEngine`: requests made together travel as one call and come
back each to its caller, equal to the engine's own answers; a caller that goes away frees its request."""

import asyncio
import threading

import pytest

from instar.config import EngineConfig
from instar.contract import SamplingParams
from instar.engines import EmbeddedEngine
from instar.runtime import engines
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


def test_requests_that_finish_steps_apart_come_back_in_one_item(monkeypatch):
    """`generate_many` holds a finished answer briefly while others run, so that those of the next engine
    steps travel with it (each item of a Ray streaming call costs both processes CPU); one that finishes
    much later comes in an item of its own. Sessions ended meanwhile are released before the requests."""
    monkeypatch.setattr(engines, "ITEM_GATHER_SECONDS", 0.3)  # wide margins: a loaded machine stalls threads

    class Engine:  # "prompt" = seconds until the request finishes
        released: list[str] = []

        async def generate(self, delay, params, session_id, images):
            await asyncio.sleep(delay)
            return delay

        def release(self, session_id):
            self.released.append(session_id)

    actor = object.__new__(EngineActor.__ray_actor_class__)  # the class behind the Ray actor, without Ray
    actor.engine, actor.requests, actor.stale = Engine(), {}, False
    actor.loop = asyncio.new_event_loop()
    threading.Thread(target=actor.loop.run_forever, daemon=True).start()

    async def main():
        requests = [(key, delay, None, None, None) for key, delay in (("a", 0.05), ("b", 0.06), ("c", 1.5))]
        return [sorted(key for key, _ in item) async for item in actor.generate_many(requests, ("old",))]

    try:
        items = asyncio.run(main())
    finally:
        actor.loop.call_soon_threadsafe(actor.loop.stop)
    assert items == [["a", "b"], ["c"]]
    assert Engine.released == ["old"] and actor.requests == {}
