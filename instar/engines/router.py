"""The session-affinity router in front of N rollout engines.

Every request of one session goes to the engine that served its first turn, where that session's
prefix cache is warm; a new session goes to the engine with the least load (queued + running), and
with a single engine straight to it.
An engine whose `load()` raises (dead, restarting, or restarted and waiting for weights) is skipped
while the others serve; a session whose engine fails a request is placed afresh on its next one.
Control calls (pause, weights) do not pass through here: the driver sends them to each engine.

Engines are `instar.engines.protocol.Sampler`s: an in-process engine, or the thin async proxy of a Ray
actor handle that an agent runner holds (its `load()` is then awaited).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Sequence

from instar.contract import Generation, ImageInputs, SamplingParams
from instar.engines.protocol import EngineLoad, Sampled, Sampler


class Router:
    """Places sessions on engines; a `Sampler` itself."""

    def __init__(self, engines: Sequence[Sampler]):
        if not engines:
            raise ValueError("Router needs at least one engine")
        self.engines = list(engines)
        self.sessions: dict[str, int] = {}  # session_id -> engine index
        # Requests sent but not yet answered, per engine: breaks ties between equal loads, so a burst
        # of new sessions spreads out even when an engine reports its load with a delay.
        self._in_flight = [0] * len(self.engines)

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       session_id: str | None = None, images: ImageInputs | None = None) -> Generation:
        async with self._placed(session_id) as engine:
            return await engine.generate(prompt_token_ids, sampling_params, session_id, **_given(images))

    async def stream(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                     session_id: str | None = None, images: ImageInputs | None = None,
                     ) -> AsyncIterator[Sampled | Generation]:
        async with self._placed(session_id) as engine:
            stream = engine.stream(prompt_token_ids, sampling_params, session_id, **_given(images))
            async with contextlib.aclosing(stream) as items:
                async for item in items:
                    yield item

    @contextlib.asynccontextmanager
    async def _placed(self, session_id: str | None) -> AsyncIterator[Sampler]:
        """The engine of one request: the session's engine, or the least-loaded one; the request is counted in
        flight there while it runs."""
        index = self.sessions.get(session_id) if session_id is not None else None
        if index is None:
            # a lone engine is not asked: there is nothing to choose, and asking costs a round trip per rollout
            loads = await self._loads() if len(self.engines) > 1 else [EngineLoad(0, 0)]
            up = [i for i, load in enumerate(loads) if load is not None]
            if not up:
                raise RuntimeError(f"no rollout engine can take a request: all {len(loads)} failed their load() "
                                   "(dead, or restarted and waiting for the next weight sync)")
            # No await between choosing and counting: concurrent placements see each other's choice.
            index = min(up, key=lambda i: (loads[i].total, self._in_flight[i], i))
            if session_id is not None:  # a concurrent first request of the same session may have won
                index = self.sessions.setdefault(session_id, index)
        self._in_flight[index] += 1
        try:
            yield self.engines[index]
        except Exception:
            if session_id is not None and self.sessions.get(session_id) == index:
                del self.sessions[session_id]  # its engine may be gone: a retry goes to a live one
            raise
        finally:
            self._in_flight[index] -= 1

    async def _loads(self) -> list[EngineLoad | None]:
        """Each engine's load; None for one that cannot answer."""
        loads: list[EngineLoad | None] = []
        for engine in self.engines:  # one at a time: an in-process engine's load() then never suspends
            try:
                load = engine.load()
                loads.append(await load if inspect.isawaitable(load) else load)
            except Exception:
                loads.append(None)
        return loads

    def release(self, session_id: str) -> None:
        """Forget a finished session (its next request, if any, is placed afresh); its engine frees what
        it cached for it."""
        if (index := self.sessions.pop(session_id, None)) is not None:
            self.engines[index].release(session_id)

    async def load(self) -> EngineLoad:
        loads = [x for x in await self._loads() if x is not None]
        return EngineLoad(queued=sum(x.queued for x in loads), running=sum(x.running for x in loads))


def _given(images: ImageInputs | None) -> dict:
    """``images`` as a keyword only when there are some: a text-only Sampler need not take them."""
    return {} if images is None else {"images": images}
