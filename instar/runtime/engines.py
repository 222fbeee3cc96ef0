"""Rollout engines as Ray actors, and the thin proxy that lets an agent runner's Router hold their handles.

Each actor hosts one engine (embedded PyTorch or vLLM) on an asyncio loop of its own thread, so requests
from every agent runner are continuously batched together, and Ray's own actor loop, which only relays
calls to it, is never busy: each of Ray's awaits around a call costs a turn of the loop it runs on, and a
turn of the engine's loop is a whole engine step (a pause took 35-330 ms to arrive at a busy engine this
way, 8-17 ms once relayed). Weights arrive over a dedicated process group
(trainer rank 0 -> every engine), never through Ray's object store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import threading
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import ray
import torch

from instar.config import CpuConfig, EngineConfig
from instar.contract import Generation, ImageInputs, SamplingParams
from instar.engines.protocol import Engine, EngineLoad, PauseMode, Sampled
from instar.train.launch import cpu_threads
from instar.train.weight_sync import Transport, open_sync_group, receive_weights


def make_engine(model_path: str, backend: str, cfg: EngineConfig, routing_replay: bool = False,
                cpu: CpuConfig | None = None) -> Engine:
    if backend == "embedded":
        from instar.engines.embedded import EmbeddedEngine

        if cpu is None or not cpu.enable:
            return EmbeddedEngine.from_pretrained(model_path, cfg)
        from instar.cpu import engine_process

        return EmbeddedEngine.from_pretrained(model_path, cfg, accelerate=engine_process())
    if backend == "vllm":
        from instar.engines.vllm import VLLMEngine

        return VLLMEngine.from_pretrained(model_path, cfg, routing_replay=routing_replay)
    raise ValueError(f"--rollout.engine must be embedded or vllm, got {backend!r}")


RELEASE_BATCH_SECONDS = 1.0
"""How long an agent runner keeps ended sessions before telling their engine in a call of their own;
the next batch of requests it sends meanwhile takes them along instead (no call of their own at all)."""

ITEM_GATHER_SECONDS = 0.01
"""How long `EngineActor.generate_many` waits after a request finishes, while others are still running,
so that those finishing in the next few engine steps travel in the same item: each item of a Ray
streaming call costs both processes CPU, and a batch's requests end over many steps."""

ROLLOUT_NICE = 5
"""Engines and agent runners run this much nicer than the trainer and the driver: where they share cores
the policy update is the step's critical path (async, 8 x 8 x 48 tokens: 6.0k -> 6.4k tok/s, bench/rl_step.py)."""

ENGINE_MAX_RESTARTS = 3
"""How many times Ray restarts a crashed engine actor in one run (the driver then gives it the weights)."""

REQUEST_SLOTS = 100_000
"""Request calls (`generate`, `generate_many`, `stream`) an engine actor serves at once, in a concurrency group of
their own (Ray's default group holds 1,000 calls): held requests park in their slots while a weight sync waits, and
the control calls (the sync itself, abort, load) run in the default group, so a flood of them never blocks it."""


@ray.remote(max_restarts=ENGINE_MAX_RESTARTS, concurrency_groups={"requests": REQUEST_SLOTS})
class EngineActor:
    def __init__(self, model_path: str, backend: str, cfg: EngineConfig, routing_replay: bool = False,
                 cpu_share: int = 1, cpu: CpuConfig | None = None):
        os.nice(ROLLOUT_NICE)
        threads = cpu_threads(cpu_share)  # see Cluster: how many processes compute at the same time
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="engine", daemon=True).start()

        async def build() -> Engine:  # on the engine's loop: vLLM's AsyncLLM binds to the loop it starts on
            return make_engine(model_path, backend, cfg, routing_replay, cpu)
        self.engine = asyncio.run_coroutine_threadsafe(build(), self.loop).result()
        self.requests: dict[str, concurrent.futures.Future] = {}  # generate_many's requests by key, for abort
        # Restarted by Ray after a crash, it holds the initial weights, not the policy's, and belongs to
        # no weight-sync group: it refuses requests until the driver sends it the weights (`pause`).
        with warnings.catch_warnings():  # Ray's own property reads a deprecated one
            warnings.simplefilter("ignore", DeprecationWarning)
            self.stale = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        # Replaced by `prepare_sync` until the weights it announces are loaded: requests wait for them. A
        # thread-safe future: requests wait on their concurrency group's loop, `sync_weights` sets it from another
        self.weights_ready: concurrent.futures.Future = concurrent.futures.Future()
        self.weights_ready.set_result(None)

    def _on_engine(self, coro: Coroutine) -> asyncio.Future:
        """Run ``coro`` on the engine's loop; cancelling the returned future cancels it there."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def _check_serving(self) -> None:
        if self.stale:
            raise RuntimeError("this rollout engine was restarted after a crash and waits for the policy's "
                               "weights (sent at the next weight sync)")

    async def _serving(self) -> None:
        """Before a request: refuse it on a restarted engine; hold it while announced weights are on their way."""
        self._check_serving()
        if not self.weights_ready.done():  # else at once, without a turn of the loop
            await asyncio.shield(asyncio.wrap_future(self.weights_ready))  # one caller's cancel cancels it alone

    @ray.method(concurrency_group="requests")
    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       session_id: str | None = None, images: ImageInputs | None = None) -> Generation:
        await self._serving()
        return await self._on_engine(self.engine.generate(prompt_token_ids, sampling_params, session_id, images))

    @ray.method(concurrency_group="requests")
    async def generate_many(self, requests: list[tuple[str, list[int], SamplingParams, str | None,
                                                       ImageInputs | None]], released: tuple[str, ...] = (),
                            ) -> AsyncIterator[list[tuple[str, Generation | BaseException]]]:
        """Requests ``(key, prompt_token_ids, sampling_params, session_id, images)`` made together, as one
        Ray streaming generator: each item is the ``(key, generation or error)`` of those that finished
        since the last item (those of one engine step arrive together). One call and a few items instead
        of a call per request: a Ray call costs each side ~1 ms of CPU, as much as a short turn's sampling.
        ``abort(key)`` cancels one request; cancelling the generator cancels those left. ``released``: sessions
        that ended meanwhile (`release`), first."""
        held = {key: concurrent.futures.Future() for key, *_ in requests}  # `abort` cancels a held request too
        self.requests.update(held)
        here = asyncio.get_running_loop()
        finished: asyncio.Queue = asyncio.Queue()
        pending: dict[str, concurrent.futures.Future] = {}
        try:
            await self._serving()
            self.release(*released)
            # each finished request is queued by its own callback: one wake per finish, never a scan of those left
            for key, *args in (request for request in requests if not held[request[0]].cancelled()):
                future = asyncio.run_coroutine_threadsafe(self.engine.generate(*args), self.loop)
                future.add_done_callback(lambda f, key=key: here.call_soon_threadsafe(finished.put_nowait, (key, f)))
                pending[key] = self.requests[key] = future
            while pending:
                done = [await finished.get()]
                if len(pending) > 1:  # more to come: what finishes in the next engine steps goes in this item
                    await asyncio.sleep(ITEM_GATHER_SECONDS)
                while not finished.empty():
                    done.append(finished.get_nowait())
                item = []
                for key, future in done:
                    del pending[key]
                    self.requests.pop(key, None)
                    if not future.cancelled():  # aborted: nobody waits for it
                        item.append((key, future.exception() or future.result()))
                if item:
                    yield item
        finally:
            self.abort(*(key for key, *_ in requests))

    def abort(self, *keys: str) -> None:
        """Cancel requests of `generate_many` (their callers went away)."""
        for key in keys:
            if (future := self.requests.pop(key, None)) is not None:
                future.cancel()

    @ray.method(concurrency_group="requests")
    async def stream(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                     session_id: str | None = None, images: ImageInputs | None = None,
                     ) -> AsyncIterator[Sampled | Generation]:
        """A Ray streaming generator (an async generator method): one object per item."""
        await self._serving()
        items: asyncio.Queue = asyncio.Queue()
        here = asyncio.get_running_loop()

        async def pump() -> None:  # on the engine's loop: each item is handed over in order, then the end
            stream = self.engine.stream(prompt_token_ids, sampling_params, session_id, images)
            async with contextlib.aclosing(stream) as gen:
                async for item in gen:
                    here.call_soon_threadsafe(items.put_nowait, item)

        pumping = self._on_engine(pump())
        pumping.add_done_callback(lambda _: items.put_nowait(None))
        try:
            while (item := await items.get()) is not None:
                yield item
            pumping.result()  # the engine's error, if it failed
        finally:
            pumping.cancel()

    def needs_weights(self) -> bool:
        """True when this engine was restarted and has had no weights since: it must join a new
        weight-sync group before the broadcast."""
        return self.stale

    async def prepare_sync(self) -> bool:
        """The first call of a weight sync: requests that arrive from now on wait until `sync_weights` has
        loaded the weights, so the driver may hand out new prompt groups at once and they still sample the
        new policy (the agent runners' work and their calls overlap the broadcast). Returns `needs_weights`."""
        if self.weights_ready.done():  # else a failed sync's requests still wait for it
            self.weights_ready = concurrent.futures.Future()
        return self.stale

    def load(self) -> EngineLoad:
        self._check_serving()  # a Router skips an engine whose load() raises
        return self.engine.load()

    def release(self, *session_ids: str) -> None:
        for session_id in session_ids:
            self.loop.call_soon_threadsafe(self.engine.release, session_id)

    async def stats(self) -> dict[str, float]:
        # in a thread of its own: the embedded engine answers between two of its steps, so it may wait for one
        return await asyncio.to_thread(lambda: dict(self.engine.stats))

    async def join_weight_group(self, master_addr: str, master_port: int, rank: int, world_size: int,
                                transport: Transport = "gloo") -> None:
        """Returns once trainer rank 0 and every engine joined; call on all of them concurrently."""
        await self._on_engine(self.engine.join_weight_group(open_sync_group, master_addr, master_port, rank,
                                                            world_size, transport))

    async def sleep(self) -> None:
        await self._on_engine(self.engine.sleep())

    async def sync_weights(self, version: int, mode: PauseMode) -> float:
        """Pause (keep or drain), receive one broadcast from trainer rank 0, load it, resume; returns the
        seconds it waited for the engine's loop. One coroutine there: a busy engine's loop turns once per
        step, and every hop onto it waits for one. A sync that fails (another member died: the broadcast is
        abandoned) leaves the engine paused and holding requests, its weights half loaded, until the next."""
        called = time.perf_counter()

        async def sync() -> float:
            waited = time.perf_counter() - called
            await self.engine.pause(mode)
            await self.engine.receive_weights(receive_weights, version)
            await self.engine.resume()
            return waited

        waited = await self._on_engine(sync())
        self.stale = False
        self.weights_ready.set_result(None)
        return waited

    async def close(self) -> None:
        await self._on_engine(self.engine.close())
        self.loop.call_soon_threadsafe(self.loop.stop)


class RemoteEngine:
    """A `Sampler` over a Ray actor handle: what an agent runner's Router holds. Requests made in one
    turn of the event loop (a group's samples start together) travel as one `EngineActor.generate_many`
    call; a lone one as a plain `generate` call."""

    def __init__(self, handle: Any):
        self.handle = handle
        self._load: Any = None  # the load query in flight, shared by the placements that ask meanwhile
        self._released: list[str] = []  # sessions to release in the next batched call
        self._flushing: asyncio.TimerHandle | None = None  # the call of their own, if no batch takes them first
        self._pending: list[tuple[str, tuple, asyncio.Future]] = []  # requests for the next call
        self._keys = (f"{uuid.uuid4().hex[:12]}-{i}" for i in itertools.count())
        self._sent: dict[str, asyncio.Future] = {}  # requests in a generate_many call, by key
        self._collectors: set[asyncio.Task] = set()

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       session_id: str | None = None, images: ImageInputs | None = None) -> Generation:
        loop = asyncio.get_running_loop()
        key, answer = next(self._keys), loop.create_future()
        self._pending.append((key, (prompt_token_ids, sampling_params, session_id, images), answer))
        if len(self._pending) == 1:
            loop.call_soon(self._send)
        try:
            return await answer
        except asyncio.CancelledError:  # a client hung up: Ray does not pass that on by itself
            if self._sent.pop(key, None) is not None:
                self.handle.abort.remote(key)
            raise

    def _send(self) -> None:
        batch = [(key, args, answer) for key, args, answer in self._pending if not answer.done()]
        self._pending = []
        if len(batch) == 1:
            task = asyncio.ensure_future(self._one(*batch[0]))
        elif batch:
            self._sent.update((key, answer) for key, _, answer in batch)
            task = asyncio.ensure_future(self._many([(key, *args) for key, args, _ in batch], self._take_released()))
        else:
            return
        self._collectors.add(task)
        task.add_done_callback(self._collectors.discard)

    async def _one(self, key: str, args: tuple, answer: asyncio.Future) -> None:
        ref = self.handle.generate.remote(*args)
        waiting = asyncio.ensure_future(ref)
        answer.add_done_callback(lambda a: a.cancelled() and waiting.cancel())
        try:
            _settle(answer, await waiting)
        except asyncio.CancelledError:
            ray.cancel(ref)
        except Exception as error:
            _settle(answer, error)

    async def _many(self, requests: list[tuple], released: tuple[str, ...]) -> None:
        try:
            async for ref in self.handle.generate_many.remote(requests, released):
                for key, result in await ref:
                    _settle(self._sent.pop(key, None), result)
        except Exception as error:  # the actor died, or refused the whole call
            for key, *_ in requests:
                _settle(self._sent.pop(key, None), error)

    async def stream(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                     session_id: str | None = None, images: ImageInputs | None = None,
                     ) -> AsyncIterator[Sampled | Generation]:
        refs = self.handle.stream.remote(prompt_token_ids, sampling_params, session_id, images)
        try:
            async for ref in refs:
                yield await ref
        finally:  # closed early or cancelled: Ray cancels the actor's generator, and so its engine request
            ray.cancel(refs)

    def release(self, session_id: str) -> None:
        """Batched: ended sessions go with the next batch of requests, or after `RELEASE_BATCH_SECONDS` in
        one call of their own (a round trip per rollout cost the engine's process as much CPU as a short
        turn; a call per few sessions still cost the agent runner a fifth of its CPU); nothing waits on it."""
        self._released.append(session_id)
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().call_later(RELEASE_BATCH_SECONDS, self._flush)

    def _flush(self) -> None:
        self.handle.release.remote(*self._take_released())

    def _take_released(self) -> tuple[str, ...]:
        """The ended sessions to send now; the next one to end starts a new wait."""
        if self._flushing is not None:
            self._flushing.cancel()
            self._flushing = None
        released, self._released = tuple(self._released), []
        return released

    async def load(self) -> EngineLoad:
        """The engine's load; a group's samples start together and share one query."""
        if self._load is None:
            self._load = self.handle.load.remote()
        query = self._load
        try:
            return await query
        finally:
            if self._load is query:
                self._load = None


def _settle(answer: asyncio.Future | None, result: Any) -> None:
    """Answer a request still waiting (None: one already answered, or cancelled by its caller)."""
    if answer is not None and not answer.done():
        (answer.set_exception if isinstance(result, BaseException) else answer.set_result)(result)
