"""Which settings work together: `check` rejects incompatible combinations before anything starts,
with a message that names the fix; `in_flight_groups` and `choose_engine` derive what a flag leaves open.

Beside config.py; what an advantage estimator needs is read from its registration (instar.algo).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, get_args

from instar.algo.advantages import registered, token_level
from instar.algo.is_correction import check_is_correction
from instar.config import ActorConfig, ConfigError, FSDPConfig, RLConfig
from instar.config.policy import LossAggMode
from instar.data.chat import read_template


def check(cfg: RLConfig) -> None:
    """Reject settings that cannot work together, before anything starts."""
    adv, actor = cfg.algo.advantage, cfg.actor
    needs = registered(adv.estimator).needs  # first: an unknown name is the error to report
    check_is_correction(adv)
    if needs.grouped and cfg.rollout.n_samples_per_prompt < 2:
        raise ConfigError(f"--algo.advantage.estimator {adv.estimator} compares samples of one prompt; "
                          f"set --rollout.n_samples_per_prompt >= 2 (got {cfg.rollout.n_samples_per_prompt})")
    async_run = not cfg.train.force_sync_mode and (cfg.train.async_queue_size > 0 or cfg.train.partial_rollout_enable)
    if async_run and adv.is_correction_level == "off":
        raise ConfigError("async or partial rollout trains on off-policy tokens; set "
                          "--algo.advantage.is_correction_level token (or seq/geo), or use --train.force_sync_mode")
    if cfg.engine.enable_sleep_mode and not cfg.train.force_sync_mode:
        raise ConfigError("--engine.enable_sleep_mode puts the engines to sleep while the trainer runs, so nothing "
                          "can be generated ahead; add --train.force_sync_mode")
    if cfg.train.force_sync_mode and cfg.train.partial_rollout_enable:
        raise ConfigError("--train.partial_rollout_enable contradicts --train.force_sync_mode; drop one of them")
    if needs.teacher and cfg.algo.kl.coef > 0:
        raise ConfigError(f"--algo.advantage.estimator {adv.estimator} uses the reference as teacher; "
                          "set --algo.kl.coef 0")
    if cfg.algo.dynamic_filter is not None and not cfg.algo.dynamic_filter[0] < cfg.algo.dynamic_filter[1]:
        raise ConfigError(f"--algo.dynamic_filter needs low < high, got {cfg.algo.dynamic_filter}")
    if actor.dual_clip is not None and actor.dual_clip <= 1:
        raise ConfigError(f"--actor.dual_clip must be > 1, got {actor.dual_clip}")
    _check_algo(cfg)
    _check_batches(cfg)
    _check_dumps(cfg)
    read_template(cfg.data.chat_template, cfg.data.chat_template_kwargs, "data")
    check_lora(actor, cfg.fsdp)


def check_lora(actor: ActorConfig, fsdp: FSDPConfig) -> None:
    """--actor.lora_*: values that can work, and the layouts LoRA has been proven in (data parallel)."""
    if actor.lora_path and not os.path.isfile(os.path.join(actor.lora_path, "adapter_config.json")):
        raise ConfigError(f"--actor.lora_path {actor.lora_path} is not a PEFT adapter folder (no adapter_config.json)")
    if actor.lora_rank < 0:
        raise ConfigError(f"--actor.lora_rank must be a positive integer (0 trains every weight), "
                          f"got {actor.lora_rank}")
    if actor.lora_rank == 0 and not actor.lora_path:
        return
    if actor.lora_alpha <= 0 or not 0 <= actor.lora_dropout < 1:
        raise ConfigError(f"--actor.lora_alpha must be > 0 and --actor.lora_dropout in [0, 1), got "
                          f"{actor.lora_alpha} and {actor.lora_dropout}")
    for name in ("tp_size", "ep_size", "cp_size"):
        if getattr(fsdp, name) > 1:
            raise ConfigError(f"--actor.lora_rank runs with data-parallel FSDP only; set --fsdp.{name} 1 (or train "
                              "without LoRA)")
    if actor.model_backend != "hf":
        raise ConfigError(f"--actor.lora_rank needs --actor.model_backend hf, got {actor.model_backend}")


def _check_batches(cfg: RLConfig) -> None:
    """Rollout batch, in-flight groups, mini-batches, trainer layout."""
    r, t, fsdp = cfg.rollout, cfg.train, cfg.fsdp
    if r.max_groups_in_flight is not None and r.max_groups_in_flight < r.batch_size:
        raise ConfigError(f"--rollout.max_groups_in_flight ({r.max_groups_in_flight}) must be >= "
                          f"--rollout.batch_size ({r.batch_size}) or a step can never fill "
                          "(leave it unset to derive it)")
    total = r.batch_size * r.n_samples_per_prompt
    if t.batch_size is not None and not (fsdp.data_size <= t.batch_size <= total and total % t.batch_size == 0):
        divisors = [d for d in range(fsdp.data_size, total + 1) if total % d == 0]
        raise ConfigError(f"--train.batch_size {t.batch_size} must divide the rollout batch of {total} samples "
                          f"(--rollout.batch_size {r.batch_size} x --rollout.n_samples_per_prompt "
                          f"{r.n_samples_per_prompt}) and be >= the data-parallel ranks {fsdp.data_size}; "
                          f"use one of {divisors}, or leave it unset for one update per batch")
    if t.max_epochs < 1:
        raise ConfigError(f"--train.max_epochs must be >= 1, got {t.max_epochs}")
    if cfg.rollout.engine == "embedded":  # named explicitly: its limits are known before Ray starts
        choose_engine(cfg, gpu=False, vllm_installed=False)
    check_layout(fsdp)


def _check_dumps(cfg: RLConfig) -> None:
    """A run deletes the rollout dumps of the steps it trains: never those it replays, nor another run's."""
    dump, replay, ckpt = cfg.train.rollout_dump_dir, cfg.train.rollout_replay_dir, cfg.ckpt
    if dump and replay and os.path.realpath(dump) == os.path.realpath(replay):
        raise ConfigError(f"--train.rollout_dump_dir and --train.rollout_replay_dir are the same directory ({dump}); "
                          "a run deletes the dumps of the steps it trains: dump elsewhere")
    if dump and not (ckpt.load_enable or ckpt.overwrite) and any(Path(dump).glob("step_*.jsonl")):
        raise ConfigError(f"--train.rollout_dump_dir {dump} holds another run's dumps; resume that run "
                          "(--ckpt.load_enable), delete them (--ckpt.overwrite) or choose another directory")


def check_layout(fsdp: FSDPConfig, model: Any = None) -> None:
    """The trainer's mesh: --fsdp.num_ranks = data x cp x tp ranks, experts split over ep of the data
    ranks. With ``model`` (an HF config) also that heads and experts divide."""
    tp, ep, cp, n = fsdp.tp_size, fsdp.ep_size, fsdp.cp_size, fsdp.num_ranks
    for name, size in (("tp_size", tp), ("ep_size", ep), ("cp_size", cp)):
        if size < 1:
            raise ConfigError(f"--fsdp.{name} must be >= 1, got {size}")
    if n % (tp * cp):
        raise ConfigError(f"--fsdp.num_ranks {n} must be a multiple of --fsdp.tp_size x --fsdp.cp_size = {tp * cp}; "
                          f"use --fsdp.num_ranks {tp * cp * max(1, n // (tp * cp))}")
    if fsdp.data_size % ep:
        raise ConfigError(f"--fsdp.ep_size {ep} must divide the data-parallel ranks (--fsdp.num_ranks / (tp x cp) "
                          f"= {fsdp.data_size}); use --fsdp.num_ranks {ep * tp * cp} or a smaller --fsdp.ep_size")
    if fsdp.replicate_size < 1 or fsdp.data_size // ep % fsdp.replicate_size:
        raise ConfigError(f"--fsdp.replicate_size {fsdp.replicate_size} must divide the data-parallel ranks outside "
                          f"expert parallelism (--fsdp.num_ranks / (tp x cp x ep) = {fsdp.data_size // ep})")
    if fsdp.compile and tp > 1:  # torch 2.13: the compiled layers' backward recurses without end over DTensors
        raise ConfigError("--fsdp.compile does not run with --fsdp.tp_size > 1 yet; drop one of them")
    if model is None:
        return
    if getattr(model, "vision_config", None) is not None and tp * cp > 1:
        raise ConfigError("--fsdp.tp_size and --fsdp.cp_size do not cover vision-language models yet; keep both 1 "
                          "(FSDP still shards the model over --fsdp.num_ranks)")
    model = getattr(model, "text_config", model)
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    if heads % tp or kv % tp:
        raise ConfigError(f"--fsdp.tp_size {tp} must divide the model's attention heads ({heads}) and "
                          f"key/value heads ({kv}); use a divisor of {math.gcd(heads, kv)}")
    if (heads // tp) % cp:  # key/value heads that do not divide are repeated (train/context_parallel.py)
        raise ConfigError(f"--fsdp.cp_size {cp} must divide the {heads // tp} attention heads of each tp rank "
                          f"({heads} heads / --fsdp.tp_size {tp}); use a divisor of {heads // tp}")
    experts = getattr(model, "num_experts", None)
    if ep > 1 and (not experts or experts % ep):
        raise ConfigError(f"--fsdp.ep_size {ep} must divide the model's experts ({experts or 'none: a dense model'}); "
                          "use a divisor of the expert count, or 1")


def run_ahead_groups(cfg: RLConfig) -> int:
    """Prompt groups launched but not yet trained at most: the staleness bound, in groups."""
    return cfg.rollout.batch_size * (1 if cfg.train.force_sync_mode else cfg.train.async_queue_size + 1)


def in_flight_groups(cfg: RLConfig) -> int:
    """Prompt groups the streaming pool keeps in flight (--rollout.max_groups_in_flight, or derived)."""
    size = cfg.rollout.max_groups_in_flight
    return run_ahead_groups(cfg) if size is None else size


def choose_engine(cfg: RLConfig, gpu: bool, vllm_installed: bool) -> str:
    """The rollout engine --rollout.engine names (auto: vllm with a GPU and vllm installed, else
    embedded); settings the chosen engine cannot honour are a ConfigError."""
    engine = cfg.rollout.engine
    if engine == "auto":
        engine = "vllm" if gpu and vllm_installed else "embedded"
    if engine == "embedded":
        v, why = cfg.engine, "" if cfg.rollout.engine == "embedded" else (
            f" (--rollout.engine auto chose it: {'no GPU' if not gpu else 'vllm is not installed'})")
        if v.tensor_parallel_size != 1:
            raise ConfigError(f"--engine.tensor_parallel_size {v.tensor_parallel_size} needs the vLLM engine, but the "
                              f"embedded engine runs{why}; set --engine.tensor_parallel_size 1 or run vLLM on a GPU")
        if v.speculative_config is not None:
            raise ConfigError(f"--engine.speculative_config needs the vLLM engine, but the embedded engine runs{why}; "
                              "unset it or run vLLM on a GPU")
    return engine


def _check_algo(cfg: RLConfig) -> None:
    """The algorithm's own combinations (instar/algo)."""
    adv, kl, actor = cfg.algo.advantage, cfg.algo.kl, cfg.actor
    low, high = actor.eps_clip_low_high
    if not (0 <= low < 1 and high >= 0):
        raise ConfigError(f"--actor.eps_clip_low_high must satisfy 0 <= low < 1 and high >= 0, got {low} {high}")
    if actor.loss_agg_mode not in get_args(LossAggMode):
        raise ConfigError(f"--actor.loss_agg_mode must be one of {get_args(LossAggMode)}, got {actor.loss_agg_mode!r}")
    if actor.dual_clip is not None and actor.loss_mode == "cispo":
        raise ConfigError("--actor.dual_clip caps the PPO/GSPO surrogate; cispo has none: unset --actor.dual_clip")
    if not (0 < adv.gamma <= 1 and 0 <= adv.lam <= 1):
        raise ConfigError(f"--algo.advantage.gamma must be in (0, 1] and --algo.advantage.lam in [0, 1], "
                          f"got {adv.gamma} {adv.lam}")
    if kl.use_in == "reward" and kl.coef > 0 and not registered(adv.estimator).needs.token_level:
        raise ConfigError(f"--algo.kl.use_in reward only shapes token rewards of {token_level()}; set --algo.kl.use_in "
                          f"loss for --algo.advantage.estimator {adv.estimator}")
    if kl.coef < 0 or (kl.target is not None and kl.target <= 0) or kl.horizon < 1:
        raise ConfigError(f"--algo.kl.coef must be >= 0, --algo.kl.target > 0 (or unset), --algo.kl.horizon >= 1; "
                          f"got {kl.coef} {kl.target} {kl.horizon}")
    if kl.target is not None and kl.coef == 0:
        raise ConfigError("--algo.kl.target adapts the coefficient multiplicatively from --algo.kl.coef, which is 0; "
                          "set --algo.kl.coef > 0 (the starting value)")
