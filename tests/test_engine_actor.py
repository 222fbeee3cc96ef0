"""The engine as a Ray actor behind `RemoteEngine`: requests made together travel as one call and come
back each to its caller, equal to the engine's own answers; a caller that goes away frees its request."""

import asyncio
import concurrent.futures
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


def _bare_actor(engine) -> EngineActor:
    """The class behind the Ray actor, without Ray, over ``engine`` on a loop of its own thread."""
    actor = object.__new__(EngineActor.__ray_actor_class__)
    actor.engine, actor.requests, actor.stale = engine, {}, False
    actor.weights_ready = concurrent.futures.Future()
    actor.weights_ready.set_result(None)
    actor.loop = asyncio.new_event_loop()
    threading.Thread(target=actor.loop.run_forever, daemon=True).start()
    return actor


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

    actor = _bare_actor(Engine())

    async def main():
        requests = [(key, delay, None, None, None) for key, delay in (("a", 0.05), ("b", 0.06), ("c", 1.5))]
        return [sorted(key for key, _ in item) async for item in actor.generate_many(requests, ("old",))]

    try:
        items = asyncio.run(main())
    finally:
        actor.loop.call_soon_threadsafe(actor.loop.stop)
    assert items == [["a", "b"], ["c"]]
    assert Engine.released == ["old"] and actor.requests == {}


def test_requests_after_prepare_sync_wait_for_the_announced_weights():
    """Once a weight sync is announced (`prepare_sync`), a request that arrives runs only after the engine has
    paused, received the weights and resumed: the driver launches the next groups before the sync ends, and
    they must still sample the new policy. A request before the announcement runs at once."""
    calls: list[str] = []
    received = threading.Event()

    class Engine:
        async def generate(self, prompt, params, session_id, images):
            calls.append(f"generate {prompt}")
            return prompt

        async def pause(self, mode):
            calls.append(f"pause {mode}")

        async def receive_weights(self, receive, version):
            await asyncio.to_thread(received.wait, 5.0)  # the broadcast: held until the test lets it arrive
            calls.append(f"receive {version}")

        async def resume(self):
            calls.append("resume")

    actor = _bare_actor(Engine())

    async def main():
        assert await actor.generate("before", None) == "before"
        assert await actor.prepare_sync() is False
        held = asyncio.ensure_future(actor.generate("after", None))
        many = asyncio.ensure_future(anext(actor.generate_many([("k", "many", None, None, None)])))
        syncing = asyncio.ensure_future(actor.sync_weights(3, "drain"))
        await asyncio.sleep(0.2)
        waiting = list(calls)
        received.set()
        await syncing
        return waiting, await held, await many

    try:
        waiting, after, many = asyncio.run(main())
    finally:
        actor.loop.call_soon_threadsafe(actor.loop.stop)
    assert waiting == ["generate before", "pause drain"]
    assert calls[:4] == ["generate before", "pause drain", "receive 3", "resume"]
    assert sorted(calls[4:]) == ["generate after", "generate many"]
    assert after == "after" and many == [("k", "many")]


@pytest.mark.slow
def test_a_flood_of_held_requests_leaves_the_weight_sync_its_own_slots(ray_cluster, tiny_model_dir):
    """More requests held behind an announced sync than the actor has request slots: the control calls (load, abort,
    the sync itself) run in a concurrency group of their own, so the sync runs; the held requests then run on the new
    weights, and the one aborted while held never runs."""
    import ray
    from transformers import AutoModelForCausalLM

    from instar.train.launch import reserve_port
    from instar.train.weight_sync import open_sync_group, send_weights

    few_slots = ray.remote(concurrency_groups={"requests": 2})(EngineActor.__ray_actor_class__)
    actor = few_slots.options(max_concurrency=4).remote(str(tiny_model_dir), "embedded", EngineConfig())
    model, port = AutoModelForCausalLM.from_pretrained(tiny_model_dir), reserve_port()

    async def answers(call) -> list:
        return [item async for ref in call for item in await ref]

    async def main():
        joined = actor.join_weight_group.remote("127.0.0.1", port, 1, 2)
        group = await asyncio.to_thread(open_sync_group, "127.0.0.1", port, 0, 2, timeout_s=60)
        await joined
        assert await actor.prepare_sync.remote() is False
        first = asyncio.ensure_future(answers(actor.generate_many.remote([("k0", PROMPTS[0], _params(0), None, None)])))
        await asyncio.sleep(0.5)  # k0 holds a slot
        rest = [asyncio.ensure_future(answers(actor.generate_many.remote([(f"k{i}", PROMPTS[i % 4], _params(i), None,
                                                                             None)]))) for i in range(1, 6)]
        await asyncio.sleep(0.5)  # k1 holds the other slot; k2-k5 wait for one
        actor.abort.remote("k0")
        assert (await asyncio.wait_for(actor.load.remote(), 30)).total == 0
        syncing = actor.sync_weights.remote(1, "keep")
        await asyncio.to_thread(send_weights, model.named_parameters(), group)
        await asyncio.wait_for(syncing, 60)
        return await first, await asyncio.wait_for(asyncio.gather(*rest), 60)

    first, rest = asyncio.run(main())
    assert first == []
    assert [key for [(key, _)] in rest] == ["k1", "k2", "k3", "k4", "k5"]
    assert all(set(gen.versions) == {1} for [(_, gen)] in rest)
