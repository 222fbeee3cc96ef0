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
    is_correction_level: Literal["off", "token", "seq", "geo"] = "geo"
    """Importance-sampling correction of rollout vs trainer logprobs: per token, or a sequence gate (seq: the
    product of the token ratios; geo: their geometric mean). Default geo with mode mask, as in Molt."""
    is_correction_mode: Literal["mask", "clip", "trunc"] = "mask"
    """What to do outside the band: mask the token (the whole sequence for seq/geo), clip the weight into the
    band, or truncate above (token level only)."""
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
    """Training prompts, read with Hugging Face `datasets`: a JSON / JSONL, Parquet or CSV file, a directory of
    them, or a hub dataset name (needs the hub, or its local cache with HF_HUB_OFFLINE=1)."""
    split: str = "train"
    """Split of a --data.prompt_dataset directory or hub name (a single file is read whole)."""
    input_key: str = "prompt"
    """Key of the prompt (a string or a list of chat messages) in each record."""
    label_key: str = "label"
    """Key of the label given to the agent."""
    tools_key: str = "tools"
    """Key of an optional list of tool schemas for the chat template."""
    image_key: str = "images"
    """Key of an optional list of images (file paths relative to the dataset, base64, data URLs or image
    bytes) shown in the first user turn, each at an ``<image>`` marker in its text or else before it.
    Images may also be content parts of the prompt's messages (``{"type": "image", "image": ...}``)."""
    tool_parser: Literal["hermes", "llama3_json", "mistral"] = "hermes"
    """Format of the tool calls the model writes (vLLM's --tool-call-parser names): Hermes/Qwen ``<tool_call>``
    JSON, Llama 3 JSON (``<|python_tag|>``), Mistral ``[TOOL_CALLS]``. The chat template writes them back."""
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
    compile: Literal["none", "aot"] = "none"
    """Embedded engine: "aot" runs dense float32 layers as AOTInductor kernels (see instar/engines/aot.py)."""
    enable_sleep_mode: bool = False
    """Engines release their memory while the trainer runs (vLLM's sleep level 1: weights to host memory,
    KV cache freed; back at the weight sync), so engines and trainer fit on shared GPUs (--ray.placement
    colocated). Needs --train.force_sync_mode. The embedded engine has nothing to release (host memory)."""


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
    compile: bool = False
    """torch.compile each dense decoder layer, attention left eager (the first step compiles: ~30 s on CPU)."""
    attn_implementation: Literal["auto", "packed", "sdpa", "eager", "flash_attention_2", "flex_attention"] = "auto"
    """Trainer attention over packed rows: packed (one causal SDPA call per sequence, no mask), flash_attention_2
    (varlen kernel; needs the flash-attn package and a GPU), flex_attention (a document mask, PyTorch's
    FlexAttention; GPU only: it has no backward on CPU), sdpa / eager (transformers' own, with a block-diagonal
    mask), or auto (flex_attention on a GPU; on CPU packed, or sdpa for a model with a sliding window)."""
    cpu_matmul: Literal["auto", "onednn", "blas"] = "auto"
    """The trainer's CPU float32 linear layers through oneDNN or PyTorch's BLAS (MKL); auto: oneDNN on AMD CPUs,
    where MKL skips its AVX-512 kernels (~2x there); under --fsdp.compile too (see instar/train/cpu_kernels.py)."""
    tp_size: int = 1
    """Tensor parallelism: each of this many ranks holds a slice of every attention and MLP weight and a
    share of the heads; they see the same samples. Divides --fsdp.num_ranks."""
    ep_size: int = 1
    """Expert parallelism of MoE layers: the experts are split over this many of the data-parallel ranks,
    tokens travel to their experts by all-to-all. Divides the data-parallel size."""
    cp_size: int = 1
    """Context parallelism: each packed row is split over this many ranks (Ulysses: all-to-all over
    heads around attention); they see the same samples. Divides --fsdp.num_ranks."""

    @property
    def data_size(self) -> int:
        """Ranks that see different samples: --fsdp.num_ranks / (tp_size x cp_size)."""
        return self.num_ranks // (self.tp_size * self.cp_size)


@dataclass
class TrainConfig:
    """The RL loop."""

    agent_path: str = ""
    """The agent: a Python file exporting `AgentRunner` (an Env or ChatAgent runner), or `package.module:Name`."""
    max_steps: int = 100
    """Stop after this many optimizer steps."""
    async_queue_size: int = 1
    """Staleness bound: generation may run this many policy versions ahead of training."""
    force_sync_mode: bool = False
    """Strictly on-policy: generate a batch, train on it, sync, repeat."""
    partial_rollout_enable: bool = False
    """Sync weights with in-flight requests paused (kept), then resume them (a turn's tokens may then span
    two versions); off, in-flight turns are sampled again from their start under the new weights."""
    agent_timeout: float = 600.0
    """Seconds one rollout may take in user code before it is dropped."""
    batch_size: int | None = None
    """Samples (trajectories) per optimizer update: each rollout batch (--rollout.batch_size x
    --rollout.n_samples_per_prompt samples) is split into that many mini-batches, one update each, and the
    weights go to the engines once per rollout batch. None: one update per rollout batch."""
    max_epochs: int = 1
    """Passes over each rollout batch's mini-batches (reshuffled every pass)."""
    max_tokens_per_gpu: int = 16384
    """Token budget of one trainer micro-batch (packed, no padding)."""
    share_prefix: bool = True
    """Lay each micro-batch out as a prefix tree: the prompt a group's samples share (and any longer common
    start) is computed once, not once per sample; same results. Needs packed attention (the CPU default, and
    inside context parallelism); with another --fsdp.attn_implementation every sample is computed in full."""
    forward_only_rows: bool = True
    """Run the rows whose loss has no gradient (zero advantage, no entropy or KL term: a GRPO group whose rewards
    are all equal) forward, for their metrics; false: leave them out while every data-parallel rank keeps a row
    (the same update; the actor metrics, `vllm_kl` and `ref_kl` included, then cover the trained rows only)."""
    max_barren_batches: int = 10
    """Stop the run after this many rollout batches in a row leave nothing to train on (every rollout
    dropped, or every group rejected by --algo.dynamic_filter); each one is logged with its reason."""
    routing_replay: bool = False
    """MoE: replay the experts the engine routed to in the training forward (R3)."""
    rollout_dump_dir: str | None = None
    """Write every trained trajectory here, one step_N.jsonl per step (a fresh run first deletes the step
    files there; a resumed one those past its checkpoint)."""
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
    overwrite: bool = False
    """Start afresh in an --ckpt.output_dir that holds a run: delete its checkpoints, ledger, metrics, exports."""
    hf_save_steps: int = 0
    """Export an HF model every N steps; 0 exports only at the end."""


@dataclass
class EvalConfig:
    """Evaluation during RL."""

    dataset: str | None = None
    """Prompts to evaluate pass@k on: a file, directory or hub dataset, as --data.prompt_dataset (--data.*_key)."""
    split: str = "test"
    """Split of an --eval.dataset directory or hub name (a single file is read whole)."""
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
    placement: Literal["auto", "colocated", "disaggregated"] = "auto"
    """Engines and trainer ranks on GPUs (or, without GPUs, nodes) of their own, or sharing them (half a GPU
    each); auto: disaggregated when there are enough."""


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
    engine: EngineConfig = field(default_factory=EngineConfig)
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
    """Chat conversations (a `messages` list per record): a JSON / JSONL, Parquet or CSV file, a directory of
    them, or a hub dataset name, read with Hugging Face `datasets`."""
    split: str = "train"
    """Split of an --sft.dataset directory or hub name (a single file is read whole)."""
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


ALIASES = {"vllm.": "engine.", "rollout.vllm_generate_batch_size": "rollout.max_groups_in_flight"}
"""Molt's flag spellings (dotted prefixes or whole names) and the ones they mean here; accepted on the
command line and as YAML recipe keys."""


class ConfigError(ValueError):
    """An invalid or incompatible combination of settings; the message names the fix (see `instar.checks`)."""
