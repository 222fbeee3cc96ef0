"""Generation (`--rollout.*`) and the rollout engines (`--engine.*`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class RolloutConfig:
    """Generation: how many prompts and samples, and how they are sampled."""

    engine: Literal["auto", "embedded", "vllm"] = "auto"
    """Rollout engine backend: embedded (in-process PyTorch), vllm, or auto: vllm when it is importable and a
    GPU is present, else embedded (the run logs which)."""
    batch_size: int = 8
    """Prompt groups per optimizer step."""
    n_samples_per_prompt: int = 8
    """Samples per prompt (the group size of group estimators)."""
    max_groups_in_flight: int | None = None
    """Prompt groups kept in flight by the streaming pool; None: as many as the staleness bound allows
    (--rollout.batch_size x (--train.async_queue_size + 1), or --rollout.batch_size in sync mode)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k filter; <= 0 disables it."""
    num_agent_runners: int = 1
    """Agent-runner actors (each with its own chat server)."""


@dataclass
class EngineConfig:
    """Rollout engine settings, for every backend unless marked vLLM (Molt's `--vllm.*` spellings work too)."""

    num_engines: int = 1
    """Number of rollout engines."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism per engine."""
    gpu_memory_utilization: float = 0.85
    """vLLM GPU memory fraction."""
    enable_prefix_caching: bool = True
    """Reuse KV cache of shared prefixes (multi-turn sessions)."""
    enforce_eager: bool = False
    """vLLM: disable CUDA graphs."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Engine compute dtype."""
    logprobs_mode: Literal["raw", "processed"] = "processed"
    """Which logprob the engine returns: of the raw model distribution (temperature 1, unfiltered),
    or of the distribution actually sampled from (after temperature, min-p, top-k, top-p, in that order;
    greedy requests return the raw one). Defined in instar/engines/sampling.py."""
    max_num_seqs: int = 256
    """Most requests decoded together in one engine step (vLLM's default)."""
    max_num_batched_tokens: int = 8192
    """Most new tokens (prompts and decodes together) in one forward; a longer single prompt runs alone."""
    prefix_cache_max_tokens: int = 262144
    """Embedded engine: tokens of finished sessions' KV cache kept for their next turn (LRU)."""
    speculative_config: dict | None = None
    """vLLM speculative decoding settings, passed through unchanged."""
    enable_sleep_mode: bool = False
    """Engines release their memory while the trainer runs (vLLM's sleep level 1: weights to host memory,
    KV cache freed; back at the weight sync), so engines and trainer fit on shared GPUs (--ray.placement
    colocated). Needs --train.force_sync_mode. The embedded engine keeps its memory and only counts the sleeps."""
