"""The router: session affinity, least-loaded placement, releasing finished sessions."""

import asyncio
import copy

import pytest
from transformers import AutoModelForCausalLM

from instar.contract import Generation, SamplingParams
from instar.engines import EmbeddedEngine, EngineLoad, Router
from instar.runtime.engines import RELEASE_BATCH_SECONDS, RemoteEngine


class RecordingEngine:
    """A `Sampler`: reports a settable load and records what it was asked."""

    def __init__(self, name: str, queued: int = 0, async_load: bool = False):
        self.name, self.queued, self.async_load = name, queued, async_load
        self.running = 0
        self.calls: list[tuple] = []
        self.go = asyncio.Event()

    def load(self):
        value = EngineLoad(queued=self.queued, running=self.running)
        if not self.async_load:
            return value

        async def later():
            await asyncio.sleep(0)
            return value
        return later()

    async def generate(self, prompt_token_ids, sampling_params, session_id=None):
        self.calls.append(("generate", session_id))
        self.running += 1
        await self.go.wait()
        self.running -= 1
        return Generation(token_ids=[1], logprobs=[-0.5], versions=[0], finish_reason="stop")

    def release(self, session_id):
        self.calls.append(("release", session_id))


def sessions_on(engine):
    return [s for call, s in (c[:2] for c in engine.calls) if call == "generate"]


def test_new_session_goes_to_least_loaded_and_stays_there():
    async def main():
        engines = [RecordingEngine("a", queued=5), RecordingEngine("b", queued=1), RecordingEngine("c", queued=3)]
        router = Router(engines)
        for e in engines:
            e.go.set()
        await router.generate([1], SamplingParams(), "s1")
        engines[1].queued = 9  # "b" is now the busiest, yet s1 keeps its engine
        await router.generate([1, 2], SamplingParams(), "s1")
        await router.generate([1], SamplingParams(), "s2")
        router.release("s1")
        router.release("never-placed")
        await router.generate([1], SamplingParams(), "s1")
        return engines, router

    (a, b, c), router = asyncio.run(main())
    assert sessions_on(b) == ["s1", "s1"]
    assert sessions_on(c) == ["s2", "s1"]  # released, s1 is placed afresh
    assert sessions_on(a) == [] and router.sessions == {"s2": 2, "s1": 2}
    # the engine that served s1 is told it ended; nobody hears of a session never placed
    assert ("release", "s1") in b.calls and [c for e in (a, c) for c in e.calls if c[0] == "release"] == []


@pytest.mark.parametrize("async_load", [False, True])  # an engine behind an actor reports its load late
def test_burst_of_new_sessions_spreads_evenly(async_load):
    async def main():
        engines = [RecordingEngine(n, async_load=async_load) for n in "abc"]
        router = Router(engines)
        tasks = [asyncio.create_task(router.generate([1], SamplingParams(), f"s{i}")) for i in range(9)]
        while sum(e.running for e in engines) < 9:
            await asyncio.sleep(0)
        placed = [len(sessions_on(e)) for e in engines]
        for e in engines:
            e.go.set()
        await asyncio.gather(*tasks)
        return placed, (await router.load()).total

    placed, left = asyncio.run(main())
    assert placed == [3, 3, 3]
    assert left == 0


def test_router_over_embedded_engines_keeps_sessions_warm(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    params = SamplingParams(temperature=0, max_tokens=4)

    async def main():
        engines = [EmbeddedEngine(copy.deepcopy(model)) for _ in range(2)]
        router = Router(engines)
        try:
            firsts = await asyncio.gather(*(router.generate([10 + i, 20, 30], params, f"s{i}") for i in range(4)))
            seconds = await asyncio.gather(*(router.generate([10 + i, 20, 30] + g.token_ids + [7], params, f"s{i}")
                                             for i, g in enumerate(firsts)))
            for e in engines:
                await e.pause("keep")
                await e.update_weights(model.named_parameters(), version=2)
                await e.resume()
            third = await router.generate([1, 2], params, "s0")
            sessions = dict(router.sessions)
            cached = [len(e._prefixes) for e in engines]
            for i in range(4):
                router.release(f"s{i}")
            return [e.stats for e in engines], sessions, seconds, third, cached, [len(e._prefixes) for e in engines]
        finally:
            for e in engines:
                await e.close()

    stats, sessions, seconds, third, cached, after_release = asyncio.run(main())
    assert sorted(sessions.values()) == [0, 0, 1, 1]
    # Each second turn reused its session's 3 prompt + 3 fed sampled tokens on the same engine.
    assert [s["prefix_hit_tokens"] for s in stats] == [12, 12]
    assert all(len(g.token_ids) == 4 for g in seconds)
    assert third.versions == [2] * 4
    # The weight update dropped every cached prefix; s0's third turn cached one again, on its engine only.
    assert sorted(cached) == [0, 1] and after_release == [0, 0]


class DeadEngine(RecordingEngine):
    """An engine behind a dead (or restarted, weightless) actor: every call raises."""

    def load(self):
        raise RuntimeError("actor died")

    async def generate(self, prompt_token_ids, sampling_params, session_id=None):
        self.calls.append(("generate", session_id))
        raise RuntimeError("actor died")


def test_an_engine_that_cannot_report_its_load_is_skipped_and_a_failed_session_is_placed_afresh():
    async def main():
        live, dead = RecordingEngine("live", queued=7), DeadEngine("dead")
        live.go.set()
        router = Router([dead, live])  # the dead one would win: its index breaks the tie
        router.sessions["s1"] = 0  # placed on "dead" before it died
        with pytest.raises(RuntimeError, match="actor died"):
            await router.generate([1], SamplingParams(), "s1")
        after_failure = dict(router.sessions)
        await router.generate([1], SamplingParams(), "s1")  # e.g. the agent SDK's retry
        await router.generate([1], SamplingParams(), "s2")
        load = await router.load()
        with pytest.raises(RuntimeError, match="all 2 failed their load"):
            await Router([DeadEngine("x"), DeadEngine("y")]).generate([1], SamplingParams(), "s3")
        lone = DeadEngine("z")  # not asked its load (nothing to choose): its own error reaches the caller
        with pytest.raises(RuntimeError, match="actor died"):
            await Router([lone]).generate([1], SamplingParams(), "s4")
        return live, dead, router, after_failure, load

    live, dead, router, after_failure, load = asyncio.run(main())
    assert after_failure == {} and router.sessions == {"s1": 1, "s2": 1}
    assert sessions_on(dead) == ["s1"] and sessions_on(live) == ["s1", "s2"]
    assert load == EngineLoad(queued=7, running=0) and router._in_flight == [0, 0]


def test_an_actor_engine_shares_one_load_query_and_batches_releases():
    class Method:
        def __init__(self, answer=None):
            self.calls, self.answer = [], answer

        def remote(self, *args):
            self.calls.append(args)
            future = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_later(0.01, future.set_result, self.answer)
            return future

    class Handle:
        load, release = Method(EngineLoad(queued=2, running=1)), Method()

    async def main():
        engine = RemoteEngine(Handle())
        loads = await asyncio.gather(*(engine.load() for _ in range(8)))  # a group's samples start together
        again = await engine.load()  # asked after the answer came: a new query
        for i in range(5):
            engine.release(f"s{i}")
        await asyncio.sleep(3 * RELEASE_BATCH_SECONDS)
        engine.release("s5")
        await asyncio.sleep(3 * RELEASE_BATCH_SECONDS)
        return loads, again

    loads, again = asyncio.run(main())
    assert loads == [EngineLoad(queued=2, running=1)] * 8 and again == loads[0]
    assert len(Handle.load.calls) == 2
    assert Handle.release.calls == [("s0", "s1", "s2", "s3", "s4"), ("s5",)]


def test_an_actor_engine_sends_requests_made_together_in_one_call():
    """Requests made in one turn of the loop travel as one generate_many call whose answers come back by key
    (an error to its own request only); a lone request is a plain generate call; a caller that goes away
    aborts its request by key."""
    answers = {"p1": Generation([1], [-0.5], [0], "stop"), "p2": ValueError("prompt too long"),
               "p3": Generation([3], [-0.1], [0], "length"), "solo": Generation([9], [-0.2], [0], "stop")}

    def ready(value):
        future = asyncio.get_running_loop().create_future()
        future.set_result(value)
        return future

    class Handle:
        calls: list = []

        class generate:
            @staticmethod
            def remote(prompt, params, session_id, images):
                Handle.calls.append(("generate", prompt))
                return ready(answers[prompt])

        class generate_many:
            @staticmethod
            def remote(requests, released):
                Handle.calls.append(("generate_many", [r[1] for r in requests], released))

                async def items():  # p1 and p2 finish in one engine step, p3 later
                    yield ready([(key, answers[p]) for key, p, *_ in requests if p != "p3"])
                    await asyncio.sleep(0.01)
                    yield ready([(key, answers[p]) for key, p, *_ in requests if p == "p3"])
                return items()

        class abort:
            @staticmethod
            def remote(*keys):
                Handle.calls.append(("abort", keys))

        class release:
            @staticmethod
            def remote(*sessions):
                Handle.calls.append(("release", sessions))

    async def main():
        engine = RemoteEngine(Handle())
        engine.release("ended")  # goes with the next batch of requests, not in a call of its own
        results = await asyncio.gather(*(engine.generate(p, SamplingParams()) for p in ("p1", "p2", "p3")),
                                       return_exceptions=True)
        solo = await engine.generate("solo", SamplingParams())
        hanging = [asyncio.ensure_future(engine.generate(p, SamplingParams())) for p in ("p1", "p3")]
        await asyncio.sleep(0.002)  # sent; p1 answered, p3 not yet
        hanging[1].cancel()
        await asyncio.sleep(2 * RELEASE_BATCH_SECONDS)  # its timer finds nothing left to send
        return results, solo, hanging

    results, solo, hanging = asyncio.run(main())
    assert results[0] == answers["p1"] and results[2] == answers["p3"] and solo == answers["solo"]
    assert isinstance(results[1], ValueError) and str(results[1]) == "prompt too long"
    assert hanging[0].result() == answers["p1"] and hanging[1].cancelled()
    names = [c[0] for c in Handle.calls]
    assert names == ["generate_many", "generate", "generate_many", "abort"]
    assert Handle.calls[0][1:] == (["p1", "p2", "p3"], ("ended",)) and Handle.calls[2][1:] == (["p1", "p3"], ())
    assert len(Handle.calls[3][1]) == 1 and Handle.calls[3][1][0].endswith("-5")  # the key of the 6th request (p3)
