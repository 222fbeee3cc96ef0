"""The embedded engine: in-process PyTorch over an HF model, on CPU (the default when no GPU is present) or one GPU.

One asyncio task runs the scheduler; `generate` only enqueues a request and awaits its future. Each
scheduler step admits queued requests into free cache slots (reusing a session's cached prefix),
runs one forward over the new tokens of every running request (new prompts and one token per
decoding request, packed together), samples one token for each, and yields to the event loop. So a
request that arrives mid-generation joins the batch at the next step and a finished one leaves it
(continuous batching): a multi-turn agent's next turn never waits for somebody else's batch to
drain. A step is plain synchronous code, so `pause` can never interleave with one.

Partial rollouts: `pause("keep")` freezes running requests in their slots; `update_weights` swaps
the weights and marks their KV cache stale; after `resume` each is re-prefilled (prompt and tokens
sampled so far) under the new weights before it samples again. So every token after the swap is
drawn from, and its logprob computed by, exactly the new policy on the full context, which is what
the trainer recomputes; its `versions` entry says so. `pause("drain")` instead lets running requests
finish on the weights they started with while new ones start on the new weights at once: the update goes
into a second copy of the model, and the two forward apart until the old one has no request left.

MoE routing: the expert ids of a token are recorded when that token is fed through the model. A
finished request of an MoE model therefore takes one more (sampling-free) step so that its last
sampled token is routed too; `Generation.routed_experts[i]` is the routing of sampled token ``i``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from instar.config import EngineConfig
from instar.contract import Generation, ImageInputs, SamplingParams
from instar.engines.kv_model import SlotCache, check_supported, forward, load_named, make_batch, moe_shape, text_config
from instar.engines.prefix_cache import CachedPrefix, PrefixCache, common_prefix_len
from instar.engines.protocol import EngineLoad, PauseMode, Sampled, StepAccelerator, check_prompt
from instar.engines.request import Request, attach_images, image_features
from instar.engines.sampling import sample


class EmbeddedEngine:
    """Implements `instar.engines.protocol.Engine` for Qwen3 / Qwen3-MoE models in this process."""

    def __init__(self, model: nn.Module, cfg: EngineConfig | None = None, version: int = 0,
                 accelerator: StepAccelerator | None = None):
        """``accelerator``: computes what it takes of each step instead of plain PyTorch (--cpu.enable)."""
        check_supported(model)
        self.model = model.eval()
        self.cfg = cfg or EngineConfig()
        self.version = version  # of the weights that new requests sample
        self._params = dict(model.named_parameters(remove_duplicate=False))  # tied lm_head.weight included
        self._routing_shape = moe_shape(model)
        self.max_model_len = text_config(model).max_position_embeddings
        self._vision = hasattr(model.model, "visual")
        self._cache = SlotCache(model)
        self.accelerator = accelerator
        self._holes = False  # a request left its slot since the last `_compact`
        self._queue: deque[Request] = deque()
        self._running: list[Request] = []
        self._prefixes = PrefixCache(self.cfg.prefix_cache_max_tokens)
        self._paused = False
        self._draining = False  # pause("drain") until resume: new weights go to a second model
        self._previous: tuple[nn.Module, int] | None = None  # (model, version) the `previous` requests run on
        self._spare: nn.Module | None = None  # a model the next drained update loads into
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()  # set when there is work for the scheduler
        self._error: BaseException | None = None
        self._closed = False
        self._weight_group = None
        self._counts = {"prompt_tokens": 0, "prefix_hit_tokens": 0, "sampled_tokens": 0, "busy_seconds": 0.0,
                        "steps": 0, "sleeps": 0}
        self._stepping = threading.Lock()  # held for each step and its counting: `stats` reads between two steps

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg: EngineConfig | None = None, version: int = 0,
                        accelerate: Callable[[nn.Module], StepAccelerator | None] | None = None) -> EmbeddedEngine:
        """Load an HF checkpoint directory (Qwen3, Qwen3-MoE or Qwen3-VL) in ``cfg.dtype``, on the GPU where this
        process has one (the one Ray gave its actor); ``accelerate(model)`` gives the engine's accelerator, if any."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        cfg = cfg or EngineConfig()
        vlm = getattr(AutoConfig.from_pretrained(str(path)), "vision_config", None) is not None
        auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
        model = auto.from_pretrained(str(path), dtype=getattr(torch, cfg.dtype))
        model.to("cuda" if torch.cuda.is_available() else "cpu")
        return cls(model, cfg, version, accelerate(model) if accelerate is not None else None)

    def load(self) -> EngineLoad:
        return EngineLoad(queued=len(self._queue), running=len(self._running))

    @property
    def stats(self) -> dict[str, float]:
        """Counters since start: prompt tokens admitted, of those the ones whose KV came from the session's
        cached prefix (not recomputed), tokens sampled, steps and the seconds they took, and the clock,
        all read between the same two steps, so a rate or fraction of them lies in [0, 1]. Any thread may
        read them; one that is not the engine's waits for the step in progress."""
        with self._stepping:
            return {**self._counts, "seconds": time.perf_counter()}

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       session_id: str | None = None, images: ImageInputs | None = None) -> Generation:
        """Sample one turn after ``prompt_token_ids``; see `instar.engines.sampling` for which logprob."""
        # a cancelled caller cancels the future; the scheduler then drops the request
        return await self._submit(prompt_token_ids, sampling_params, session_id, images).future

    async def stream(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                     session_id: str | None = None, images: ImageInputs | None = None,
                     ) -> AsyncIterator[Sampled | Generation]:
        """`generate`, yielding each step's new tokens as the scheduler samples them."""
        request = self._submit(prompt_token_ids, sampling_params, session_id, images)
        sent = 0
        try:
            while True:
                await request.progress.wait()
                request.progress.clear()
                new = request.ids[request.prompt_len + sent:]
                if new:
                    yield Sampled(sent, new)
                    sent += len(new)
                if request.future.done():
                    yield request.future.result()
                    return
        finally:
            request.future.cancel()  # a no-op once finished; else the scheduler drops the request

    def _submit(self, prompt_token_ids: list[int], sampling_params: SamplingParams, session_id: str | None,
                images: ImageInputs | None = None) -> Request:
        check_prompt(prompt_token_ids, text_config(self.model).vocab_size, self.max_model_len,
                     "max_position_embeddings")
        if images is not None and not self._vision:
            raise ValueError("generate got images for a text-only model")
        self._start()
        request = Request(list(prompt_token_ids), len(prompt_token_ids), sampling_params, session_id,
                          asyncio.get_running_loop().create_future())
        if images is not None:
            attach_images(request, images)
        self._queue.append(request)
        self._wake.set()
        return request

    def release(self, session_id: str) -> None:
        self._prefixes.pop(session_id)  # its KV cache makes room for live sessions

    async def pause(self, mode: PauseMode = "keep") -> None:
        """keep: freeze running requests; abort: finish every request now with finish_reason "abort"; new
        requests queue up until `resume`. drain: nothing stops; `update_weights` then loads a second copy of
        the model, new requests run on it at once and running ones finish on the weights they started with."""
        if mode not in ("keep", "drain", "abort"):
            raise ValueError(f"pause mode must be 'keep', 'drain' or 'abort', got {mode!r}")
        if mode == "drain":
            self._draining = True
            return
        if mode == "abort":
            for request in [*self._running, *self._queue]:
                self._finish(request, request.finish_reason or "abort")
        self._paused = True

    async def resume(self) -> None:
        self._paused, self._draining = False, False
        self._wake.set()

    async def sleep(self) -> None:
        self._counts["sleeps"] += 1  # its memory is the host's, which the trainer shares anyway: nothing to free

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy tensors in by HF parameter name (``lm_head.weight`` may be absent when tied), set the
        policy version, drop cached prefixes and mark running requests' KV stale. Call while paused; after
        pause("drain") with requests running, the tensors go into a second model, which takes the new
        requests, and the running ones finish on this one (their KV stays)."""
        if not (self._paused or self._draining):
            raise RuntimeError("update_weights needs a paused engine (requests would sample from half-copied "
                               "weights); await engine.pause('keep') first and engine.resume() after")
        if self._draining and self._running:
            while self._previous is not None:  # an older drain still runs: a third model is one too many
                await asyncio.sleep(0.001)
            model = self._spare or copy.deepcopy(self.model)
            params = dict(model.named_parameters(remove_duplicate=False))
            # no request uses that copy: it loads (and a broadcast arrives) while the steps go on
            await asyncio.to_thread(load_named, params, named_tensors)
            self._previous, self._spare = (self.model, self.version), None
            self.model, self._params = model, params
            for request in self._running:
                request.previous = True
        else:
            load_named(self._params, named_tensors)
            for request in self._running:
                request.cached = 0  # its keys are the old weights': recomputed
                request.features.clear()
        self._prefixes.clear()
        self.version = version

    async def join_weight_group(self, open_group: Callable, master_addr: str, master_port: int, first_rank: int,
                                world_size: int, transport: str) -> None:
        self._weight_group = open_group(master_addr, master_port, first_rank, world_size, transport)

    async def receive_weights(self, receive: Callable, version: int) -> None:
        # each tensor is copied into the model before the next is received: one bucket buffer, reused
        await self.update_weights(receive(self._weight_group, reuse_buffer=True), version)

    async def close(self) -> None:
        """Abort every request and stop the scheduler task; the engine takes no new requests."""
        self._closed = True
        await self.pause("abort")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- the scheduler ---------------------------------------------------------------------------

    def _start(self) -> None:
        if self._closed:
            raise RuntimeError("generate on a closed engine; create a new EmbeddedEngine")
        if self._error is not None:
            raise RuntimeError(f"the embedded engine's scheduler failed earlier: {self._error!r}") from self._error
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        try:
            while True:
                if self._paused or not (self._running or self._queue):
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                with self._stepping:
                    start = time.perf_counter()
                    self._step()
                    self._counts["busy_seconds"] += time.perf_counter() - start
                    self._counts["steps"] += 1
                await asyncio.sleep(0)  # let new requests, pause and resume in between steps
        except Exception as error:  # fail every waiter rather than leave it hanging
            self._error = error
            for request in [*self._running, *self._queue]:
                if not request.future.done():
                    request.future.set_exception(error)
                request.progress.set()

    @torch.inference_mode()
    def _step(self) -> None:
        for request in [r for r in (*self._running, *self._queue) if r.future.cancelled()]:
            self._finish(request, "abort")
        self._compact()
        leaders: dict[tuple[int, ...], Request] = {}
        twins: dict[Request, int] = {}  # request -> its leader's slot (the leader may end at once)
        while self._queue and len(self._running) < self.cfg.max_num_seqs:
            request = self._queue.popleft()
            request.slot = len(self._running)
            self._cache.reserve(0, request.slot + 1)
            self._running.append(request)
            self._reuse_prefix(request)
            self._counts["prompt_tokens"] += request.prompt_len
            if self.cfg.enable_prefix_caching and request.cached == 0 and request.prompt_len > 1:
                # a group's samples arrive together with one prompt: it is computed once, for the first
                leader = leaders.setdefault(tuple(request.identity(request.prompt_len)), request)
                if leader is not request:
                    twins[request] = leader.slot
        for group in self._forward_groups():
            if group := [r for r in group if r not in twins]:
                self._run(group)
        self._cache.copy([(source, request.slot, request.prompt_len - 1) for request, source in twins.items()])
        for request in twins:  # fed from the last prompt token on, at the next step
            request.cached = request.prompt_len - 1
            self._counts["prefix_hit_tokens"] += request.cached
        self._compact()  # after the twins' copies: a leader that finished may leave a hole
        if self._previous is not None and not any(r.previous for r in self._running):  # the drain is over
            self._spare, self._previous = self._previous[0], None

    def _compact(self) -> None:
        """Move requests into the slots that finished ones left, so the running requests hold slots
        0..R-1 and a decode step reads their cached keys as one slice of the cache."""
        if not self._holes:
            return
        self._holes = False
        used = {r.slot for r in self._running}
        holes = iter(slot for slot in range(len(self._running)) if slot not in used)
        moves = [(r, next(holes)) for r in self._running if r.slot >= len(self._running)]
        self._cache.copy([(r.slot, slot, r.cached) for r, slot in moves])  # from slots >= R into holes < R
        for request, slot in moves:
            request.slot = slot

    def _forward_groups(self) -> list[list[Request]]:
        """Running requests split into forwards of at most ``max_num_batched_tokens`` new tokens:
        usually one forward for all (decode rows and new prompts together); a longer single prompt
        runs alone; during a drain, the requests on the previous model forward apart. Rows of one length
        are in slot order (see `_compact`)."""
        groups: list[list[Request]] = []
        size = 0
        for request in sorted(self._running, key=lambda r: (r.previous, len(r.ids) - r.cached, r.slot)):
            n = len(request.ids) - request.cached
            if not groups or size + n > self.cfg.max_num_batched_tokens or groups[-1][0].previous != request.previous:
                groups.append([])
                size = 0
            groups[-1].append(request)
            size += n
        return groups

    def _run(self, group: list[Request]) -> None:
        """One forward over ``group``'s uncached tokens, then one sampled token for each live request."""
        new = [r.ids[r.cached:] for r in group]
        model, version = self._previous if group[0].previous else (self.model, self.version)
        rope = [r.rope_of(r.cached, len(r.ids)) for r in group] if self._vision else None
        images = [image_features(model, r) for r in group] if self._vision else None
        batch = make_batch(self._cache, new, [r.slot for r in group], [r.cached for r in group], rope, images)
        logits, routed = forward(model, self._cache, batch, self.accelerator)
        if routed is not None:
            for request, rows in zip(group, routed.cpu().split([len(ids) for ids in new])):
                request.record_routing(rows)
        live = [row for row, r in enumerate(group) if r.finish_reason is None]
        for request in group:
            request.cached = len(request.ids)
            if request.finish_reason is not None:  # an MoE request's last step: routing only
                self._finish(request, request.finish_reason)
        if not live:
            return
        requests = [group[row] for row in live]
        tokens, logprobs = sample(logits[live] if len(live) < len(group) else logits,
                                  [r.params for r in requests], [r.num_sampled for r in requests],
                                  self.cfg.logprobs_mode, self.accelerator)
        self._counts["sampled_tokens"] += len(requests)
        for request, token, logprob in zip(requests, tokens.tolist(), logprobs.tolist()):
            request.ids.append(token)
            request.logprobs.append(logprob)
            request.versions.append(version)
            request.progress.set()
            if token in request.params.stop_token_ids:
                request.finish_reason = "stop"
            elif request.num_sampled >= request.params.max_tokens or len(request.ids) >= self.max_model_len:
                request.finish_reason = "length"
            if request.finish_reason is not None and self._routing_shape is None:
                self._finish(request, request.finish_reason)

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        if request.slot >= 0:
            self._save_prefix(request)
            self._running.remove(request)
            request.slot = -1
            self._holes = True
        elif request in self._queue:
            self._queue.remove(request)
        if not request.future.done():
            request.future.set_result(request.generation(self._routing_shape))
        request.progress.set()

    @torch.inference_mode()
    def _save_prefix(self, request: Request) -> None:
        """A finished session's keys/values, unless they are of weights no longer in use (a drain)."""
        if (self.cfg.enable_prefix_caching and request.session_id is not None and request.cached > 0
                and not request.previous):
            keys, values = self._cache.read(request.slot, request.cached)
            self._prefixes.save(request.session_id, CachedPrefix(request.identity(request.cached), keys, values))

    def _reuse_prefix(self, request: Request) -> None:
        """Copy the session's cached keys/values for the longest common prefix into the new slot; at
        least the last prompt token is always fed, since its logits give the first sample."""
        entry = self._prefixes.pop(request.session_id) if request.session_id is not None else None
        n = 0 if entry is None else common_prefix_len(entry.ids, request.identity(len(request.ids) - 1))
        if n:
            self._cache.write(request.slot, entry.keys, entry.values, n)
            request.cached = n
            self._counts["prefix_hit_tokens"] += n

