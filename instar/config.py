"""Every setting of instar, as nested dataclasses: the single source of truth for CLI flags
(``--actor.model_name_or_path``), YAML recipes and ``--help``. The docstring under each field is its
help text. Flag names follow Molt's where Molt has the concept.

Layer 0 (stdlib only), beside the contract: every layer reads its own section from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ActorConfig:
    """The trainable policy."""

    model_name_or_path: str = ""
    """HF checkpoint directory of the policy (e.g. one built by `instar tiny-model`)."""
    loss_mode: Literal["ppo", "gspo", "cispo"] = "ppo"
    """Policy loss: ppo (clipped token ratio), gspo (sequence-level ratio), cispo (clipped IS weight)."""
    eps_clip_low_high: tuple[float, float] = (0.2, 0.28)
    """Clip band of the policy ratio: [1 - low, 1 + high] (asymmetric, DAPO style)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1: caps the loss of a negative-advantage token at -c A (ppo, gspo); None disables it."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus in the policy loss."""
    learning_rate: float = 1e-6
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables clipping."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps of the learning rate."""
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warm-up (decays over --train.max_steps)."""
    freeze_moe_router: bool = False
    """Keep MoE router (gate) weights fixed during training."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trainer (use float32 on CPU)."""
    model_backend: Literal["hf", "automodel"] = "hf"
    """Model loader: hf (transformers) or automodel (NVIDIA NeMo AutoModel, GPU, when installed)."""
    ref_model_name_or_path: str | None = None
    """Frozen reference (KL) or teacher (on_policy_distill) checkpoint; None reuses --actor.model_name_or_path."""
    seed: int = 42
    """Seed of the trainer's RNGs."""


@dataclass
class CriticConfig:
    """The value model, used by the gae estimator only."""

    model_name_or_path: str | None = None
    """HF checkpoint for the critic trunk; None reuses --actor.model_name_or_path."""
    learning_rate: float = 5e-6
    """Critic learning rate."""
    value_clip: float = 0.2
    """Clip range of the value loss around the old values."""


@dataclass
class AdvantageConfig:
    """How advantages are estimated and how the rollout/trainer gap is corrected."""

    estimator: Literal["reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo", "gae",
                       "on_policy_distill"] = "grpo"
    """Advantage estimator (registry in instar/algo/advantages.py): reinforce (REINFORCE++), reinforce_baseline,
    rloo, grpo, dr_grpo (group baselines), gae (critic), on_policy_distill (reverse KL to the reference as teacher)."""
    gamma: float = 1.0
    """Discount factor (reinforce, gae)."""
    lam: float = 0.95
    """GAE lambda."""
    is_correction_level: Literal["off", "token", "seq", "geo"] = "token"
    """Importance-sampling correction of rollout vs trainer logprobs: per token, or a sequence gate."""
    is_correction_mode: Literal["mask", "clip", "trunc"] = "trunc"
    """What to do outside the band: mask the token, clip the weight into the band, or truncate above."""
    is_correction_threshold: tuple[float, float] = (0.5, 2.0)
    """Band [low, high] of the importance ratio exp(trainer_logprob - rollout_logprob)."""


@dataclass
class KLConfig:
    """KL regularisation towards the frozen reference policy."""

    coef: float = 0.0
    """Initial KL coefficient; 0 disables the reference model."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator per token (Schulman's k1, k2, k3)."""
    use_in: Literal["reward", "loss"] = "loss"
    """Apply the KL as a per-token reward penalty (REINFORCE++ style; reinforce and gae only) or as a loss term."""
    target: float | None = None
    """Adaptive controller target KL; None keeps the coefficient fixed."""
    horizon: int = 10000
    """Adaptive controller horizon (in samples)."""


@dataclass
class AlgoConfig:
    """The algorithm: pure functions in instar/algo selected by these names."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    dynamic_filter: tuple[float, float] | None = None
    """DAPO dynamic filter: keep prompt groups whose mean score lies strictly inside (low, high)."""


@dataclass
class DataConfig:
    """Prompt datasets."""

    prompt_dataset: str = ""
    """JSONL file (or HF `datasets` name available offline) of training prompts."""
    input_key: str = "prompt"
    """Key of the prompt (a string or a list of chat messages) in each record."""
    label_key: str = "label"
    """Key of the label given to the agent."""
    tools_key: str = "tools"
    """Key of an optional list of tool schemas for the chat template."""
    apply_chat_template: bool = True
    """Render string prompts as a user message with the tokenizer's chat template."""
    system_prompt: str | None = None
    """System message prepended to every prompt."""
    max_len: int = 2048
    """Total token budget of one rollout (prompt + all turns); running out truncates it."""
    max_new_tokens: int = 256
    """Per-turn budget of sampled tokens."""
    shuffle: bool = True
    """Shuffle prompts each epoch (seeded by --actor.seed)."""


@dataclass
class RolloutConfig:
    """Generation: how many prompts and samples, and how they are sampled."""

    engine: Literal["embedded", "vllm"] = "embedded"
    """Rollout engine backend: embedded (in-process PyTorch, CPU default) or vllm."""
    batch_size: int = 8
    """Prompt groups per optimizer step."""
    n_samples_per_prompt: int = 8
    """Samples per prompt (the group size of group estimators)."""
    vllm_generate_batch_size: int = 16
    """Prompt groups kept in flight by the streaming pool."""
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
    """Rollout engine settings (the flag prefix is `vllm` as in Molt; most apply to every backend)."""

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
    max_num_seqs: int = 64
    """Most requests decoded together in one engine step."""
    max_num_batched_tokens: int = 8192
    """Most new tokens (prompts and decodes together) in one forward; a longer single prompt runs alone."""
    prefix_cache_max_tokens: int = 262144
    """Embedded engine: tokens of finished sessions' KV cache kept for their next turn (LRU)."""
    speculative_config: dict | None = None
    """vLLM speculative decoding settings, passed through unchanged."""


@dataclass
class FSDPConfig:
    """How the trainer is sharded (FSDP2)."""

    num_ranks: int = 1
    """Trainer ranks (data-parallel FSDP2 shards)."""
    offload: Literal["none", "optimizer"] = "none"
    """Offload optimizer state to CPU."""
    mixed_precision: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of FSDP2's mixed-precision policy (params reduce in float32)."""
    activation_checkpointing: bool = False
    """Recompute decoder-layer activations in backward to save memory."""


@dataclass
class TrainConfig:
    """The RL loop."""

    agent_path: str = ""
    """Python file that exports `AgentRunner` (an Env or ChatAgent runner)."""
    max_steps: int = 100
    """Stop after this many optimizer steps."""
    async_queue_size: int = 1
    """Staleness bound: generation may run this many policy versions ahead of training."""
    force_sync_mode: bool = False
    """Strictly on-policy: generate a batch, train on it, sync, repeat."""
    partial_rollout_enable: bool = False
    """Sync weights with in-flight requests paused (kept), then resume them."""
    agent_timeout: float = 600.0
    """Seconds one rollout may take in user code before it is dropped."""
    max_tokens_per_gpu: int = 16384
    """Token budget of one trainer micro-batch (packed, no padding)."""
    routing_replay: bool = False
    """MoE: replay the experts the engine routed to in the training forward (R3)."""
    rollout_dump_dir: str | None = None
    """Write every trajectory as JSONL here."""
    rollout_replay_dir: str | None = None
    """Train from a rollout dump instead of engines (reproduce / debug a step)."""


@dataclass
class CkptConfig:
    """Checkpoints and exports."""

    output_dir: str = "runs/instar"
    """Run directory: metrics.jsonl, checkpoints, HF exports."""
    save_steps: int = 0
    """Save a resumable checkpoint every N steps; 0 saves only at the end."""
    max_num: int = 2
    """Keep at most this many checkpoints."""
    load_enable: bool = False
    """Resume from the latest checkpoint in --ckpt.output_dir."""
    hf_save_steps: int = 0
    """Export an HF model every N steps; 0 exports only at the end."""


@dataclass
class EvalConfig:
    """Evaluation during RL."""

    dataset: str | None = None
    """JSONL prompts to evaluate pass@k on."""
    steps: int = 0
    """Evaluate every N steps (and at the start); 0 only at the start and end."""
    n_samples: int = 1
    """Samples per prompt (k of pass@k)."""
    temperature: float = 1.0
    """Eval sampling temperature."""
    dump_dir: str | None = None
    """Write each eval's trajectories to DIR/eval_step_N.jsonl (read them with `instar view`)."""


@dataclass
class RayConfig:
    """The Ray cluster."""

    address: str | None = None
    """Address of an existing Ray cluster; None starts a local one."""


@dataclass
class LogConfig:
    """Where metrics go besides metrics.jsonl."""

    tensorboard: bool = False
    """Also write TensorBoard event files."""
    wandb_project: str | None = None
    """Also log to Weights & Biases under this project."""
    wandb_mode: Literal["online", "offline"] = "offline"
    """Weights & Biases mode (offline needs no network)."""


@dataclass
class RLConfig:
    """`instar rl`: train a policy with reinforcement learning."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    vllm: EngineConfig = field(default_factory=EngineConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    log: LogConfig = field(default_factory=LogConfig)


@dataclass
class SFTSection:
    """Supervised fine-tuning data and schedule."""

    dataset: str = ""
    """JSONL file of chat conversations (a `messages` list per record)."""
    messages_key: str = "messages"
    """Key of the message list in each record."""
    epochs: int = 1
    """Passes over the dataset."""
    batch_size: int = 16
    """Conversations per optimizer step."""
    max_len: int = 1024
    """Longest conversation in tokens; longer ones are truncated."""
    eval_fraction: float = 0.0
    """Fraction of conversations held out to report eval loss."""
    eval_steps: int = 0
    """Report the held-out loss every N steps; 0: only before the first and after the last step."""


@dataclass
class SFTConfig:
    """`instar sft`: supervised fine-tuning, loss on assistant tokens only."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    sft: SFTSection = field(default_factory=SFTSection)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    log: LogConfig = field(default_factory=LogConfig)


class ConfigError(ValueError):
    """An invalid or incompatible combination of settings; the message names the fix."""


GROUP_ESTIMATORS = ("reinforce_baseline", "rloo", "grpo", "dr_grpo")


def check(cfg: RLConfig) -> None:
    """Reject settings that cannot work together, before anything starts."""
    adv, actor = cfg.algo.advantage, cfg.actor
    low, high = adv.is_correction_threshold
    if not 0 <= low < 1 < high:
        raise ConfigError("--algo.advantage.is_correction_threshold must satisfy 0 <= low < 1 < high, "
                          f"got {low} {high}")
    if adv.is_correction_level in ("seq", "geo") and adv.is_correction_mode != "mask":
        raise ConfigError(f"--algo.advantage.is_correction_level {adv.is_correction_level} is a sequence gate and "
                          f"needs --algo.advantage.is_correction_mode mask (got {adv.is_correction_mode})")
    if adv.estimator in GROUP_ESTIMATORS and cfg.rollout.n_samples_per_prompt < 2:
        raise ConfigError(f"--algo.advantage.estimator {adv.estimator} compares samples of one prompt; "
                          f"set --rollout.n_samples_per_prompt >= 2 (got {cfg.rollout.n_samples_per_prompt})")
    async_run = not cfg.train.force_sync_mode and (cfg.train.async_queue_size > 0 or cfg.train.partial_rollout_enable)
    if async_run and adv.is_correction_level == "off":
        raise ConfigError("async or partial rollout trains on off-policy tokens; set "
                          "--algo.advantage.is_correction_level token (or seq/geo), or use --train.force_sync_mode")
    if cfg.train.force_sync_mode and cfg.train.partial_rollout_enable:
        raise ConfigError("--train.partial_rollout_enable contradicts --train.force_sync_mode; drop one of them")
    if adv.estimator == "on_policy_distill" and cfg.algo.kl.coef > 0:
        raise ConfigError("--algo.advantage.estimator on_policy_distill uses the reference as teacher; "
                          "set --algo.kl.coef 0")
    if cfg.algo.dynamic_filter is not None and not cfg.algo.dynamic_filter[0] < cfg.algo.dynamic_filter[1]:
        raise ConfigError(f"--algo.dynamic_filter needs low < high, got {cfg.algo.dynamic_filter}")
    if actor.dual_clip is not None and actor.dual_clip <= 1:
        raise ConfigError(f"--actor.dual_clip must be > 1, got {actor.dual_clip}")
    _check_algo(cfg)
    if cfg.rollout.vllm_generate_batch_size < cfg.rollout.batch_size:
        raise ConfigError(f"--rollout.vllm_generate_batch_size ({cfg.rollout.vllm_generate_batch_size}) must be >= "
                          f"--rollout.batch_size ({cfg.rollout.batch_size}) or a step can never fill")


def _check_algo(cfg: RLConfig) -> None:
    """The algorithm's own combinations (instar/algo)."""
    adv, kl, actor = cfg.algo.advantage, cfg.algo.kl, cfg.actor
    low, high = actor.eps_clip_low_high
    if not (0 <= low < 1 and high >= 0):
        raise ConfigError(f"--actor.eps_clip_low_high must satisfy 0 <= low < 1 and high >= 0, got {low} {high}")
    if actor.dual_clip is not None and actor.loss_mode == "cispo":
        raise ConfigError("--actor.dual_clip caps the PPO/GSPO surrogate; cispo has none: unset --actor.dual_clip")
    if not (0 < adv.gamma <= 1 and 0 <= adv.lam <= 1):
        raise ConfigError(f"--algo.advantage.gamma must be in (0, 1] and --algo.advantage.lam in [0, 1], "
                          f"got {adv.gamma} {adv.lam}")
    if kl.use_in == "reward" and kl.coef > 0 and adv.estimator not in ("reinforce", "gae"):
        raise ConfigError(f"--algo.kl.use_in reward only shapes token rewards of reinforce / gae; set --algo.kl.use_in "
                          f"loss for --algo.advantage.estimator {adv.estimator}")
    if kl.coef < 0 or (kl.target is not None and kl.target <= 0) or kl.horizon < 1:
        raise ConfigError(f"--algo.kl.coef must be >= 0, --algo.kl.target > 0 (or unset), --algo.kl.horizon >= 1; "
                          f"got {kl.coef} {kl.target} {kl.horizon}")
    if kl.target is not None and kl.coef == 0:
        raise ConfigError("--algo.kl.target adapts the coefficient multiplicatively from --algo.kl.coef, which is 0; "
                          "set --algo.kl.coef > 0 (the starting value)")
