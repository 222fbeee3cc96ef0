"""The trainable models: the policy (`--actor.*`) and the value model (`--critic.*`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@dataclass
class ActorConfig:
    """The trainable policy."""

    model_name_or_path: str = ""
    """HF checkpoint directory of the policy (e.g. one built by `instar tiny-model`)."""
    loss_mode: Literal["ppo", "gspo", "cispo"] = "ppo"
    """Policy loss: ppo (clipped token ratio), gspo (sequence-level ratio), cispo (clipped IS weight)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How an update's loss sums its token losses (S: its trajectories): token-mean (/ tokens), seq-mean-token-mean
    (mean over trajectories of their token means), seq-mean-token-sum (/ S), seq-mean-token-sum-norm (/ S x
    --data.max_new_tokens, as Dr. GRPO). Entropy and KL terms alike; the critic's loss stays a token mean."""
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
    """Seed of the trainer's RNGs and of sampling: each rollout turn samples from a seed derived from it, the prompt
    group, the sample and the turn, whichever engine serves it."""
    lora_rank: int = 0
    """Rank of LoRA adapters on the policy (built with PEFT); 0 trains every weight. With LoRA only the adapters
    train, the engines sample the merged weights, and the reference (when it is the same checkpoint) is the
    policy with its adapters off. MoE experts (fused 3-D weights) and the critic stay as they are: frozen, full."""
    lora_alpha: int = 16
    """LoRA scaling numerator: the adapter's update is scaled by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input in training forwards."""
    lora_target_modules: str | list[str] = "all-linear"
    """Layers that get adapters: all-linear (every linear layer but the LM head, as in PEFT) or a list of module
    names (e.g. [q_proj, v_proj])."""
    lora_path: str = ""
    """A PEFT adapter folder (e.g. a LoRA run's hf/ export) to start the adapters from; its adapter_config.json
    then sets the rank, alpha, dropout and target modules."""
    lora_merged_export: bool = False
    """With LoRA, HF exports (the run's hf/ folders) hold the merged full model instead of a PEFT adapter folder."""
    lora_base_dtype: Literal["", "float32", "bfloat16"] = ""
    """Dtype of the frozen base weights under LoRA (the adapters and their optimizer stay float32); empty:
    --actor.dtype."""


@dataclass
class CriticConfig:
    """The value model, used by the gae estimator only."""

    model_name_or_path: str | None = None
    """HF checkpoint for the critic trunk; None reuses --actor.model_name_or_path."""
    learning_rate: float = 5e-6
    """Critic learning rate."""
    value_clip: float = 0.2
    """Clip range of the value loss around the old values."""
