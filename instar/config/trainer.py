"""The trainer: how it is sharded (`--fsdp.*`) and the RL loop around it (`--train.*`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class FSDPConfig:
    """How the trainer is sharded (FSDP2)."""

    num_ranks: int = 1
    """Trainer ranks in all: data x context x tensor parallel ranks (--fsdp.cp_size, --fsdp.tp_size), one mesh."""
    offload: Literal["none", "optimizer"] = "none"
    """Offload optimizer state to CPU."""
    mixed_precision: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of FSDP2's mixed-precision policy (params reduce in float32)."""
    activation_checkpointing: bool = False
    """Recompute decoder-layer activations in backward to save memory."""
    compile: bool = False
    """torch.compile each dense decoder layer, attention left eager (the first step compiles: ~30 s on CPU)."""
    attn_implementation: Literal["auto", "packed", "sdpa", "eager", "flash_attention_2", "flex_attention",
                                 "te"] = "auto"
    """Trainer attention over packed rows: packed (one causal SDPA call per sequence, no mask; with --cpu.enable the
    CPU accelerator's C kernel), flash_attention_2 (varlen kernel; needs the flash-attn package and a GPU),
    flex_attention (a document mask, PyTorch's FlexAttention; GPU only: it has no backward on CPU), sdpa / eager
    (transformers' own, with a block-diagonal mask), or auto (flex_attention on a GPU; on CPU packed, or sdpa for a
    model with a sliding window). te (Molt's value): the fastest kernel here, flash_attention_2 where flash-attn is
    installed, else auto's choice; it says which."""
    tp_size: int = 1
    """Tensor parallelism: each of this many ranks holds a slice of every attention and MLP weight and a
    share of the heads; they see the same samples. Divides --fsdp.num_ranks."""
    ep_size: int = 1
    """Expert parallelism of MoE layers: the experts are split over this many of the data-parallel ranks,
    tokens travel to their experts by all-to-all. Divides the data-parallel size."""
    cp_size: int = 1
    """Context parallelism: each packed row is split over this many ranks (Ulysses: all-to-all over
    heads around attention); they see the same samples. Divides --fsdp.num_ranks."""
    replicate_size: int = 1
    """Hybrid sharding (HSDP): the data ranks form this many groups, each holding a whole sharded copy of the
    model; gradients reduce within a group, then across the groups (one group per node is usual)."""

    @property
    def data_size(self) -> int:
        """Ranks that see different samples: --fsdp.num_ranks / (tp_size x cp_size)."""
        return self.num_ranks // (self.tp_size * self.cp_size)


@dataclass
class TrainConfig:
    """The RL loop."""

    agent_path: str = ""
    """The agent: a Python file exporting `AgentRunner` (an Env or ChatAgent runner), or `package.module:Name`."""
    reward_fns: list[str] = field(default_factory=list)
    """Instead of an agent: single-turn rollouts scored by reward functions in TRL's convention, each
    `path/to/file.py:fn` or `package.module:fn`; the reward is their weighted sum."""
    reward_weights: list[float] | None = None
    """One weight per --train.reward_fns entry (default: all 1)."""
    on_agent_error: Literal["drop", "keep"] = "drop"
    """A rollout whose agent code raised after sampling: drop it, or keep what it sampled with
    --train.agent_error_reward (a framework that raises on a turn cut by the token limit). Counted either way."""
    agent_error_reward: float = 0.0
    """The reward of a rollout kept by --train.on_agent_error keep."""
    max_steps: int = 100
    """Stop after this many optimizer steps."""
    async_queue_size: int = 1
    """Staleness bound: generation may run this many policy versions ahead of training."""
    force_sync_mode: bool = False
    """Strictly on-policy: generate a batch, train on it, sync, repeat."""
    partial_rollout_enable: bool = False
    """Sync weights with in-flight requests paused (kept), then resume them (a turn's tokens may then span
    two versions); off, in-flight turns finish on the weights they started with while new ones start on the new
    weights (every turn from one version)."""
    agent_timeout: float = 600.0
    """Seconds one rollout may take, sampling and user code together, before it is dropped."""
    batch_size: int | None = None
    """Samples (trajectories) per optimizer update: each rollout batch (--rollout.batch_size x
    --rollout.n_samples_per_prompt samples) is split into mini-batches of this many, one update each, and the
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
    """Write every trained trajectory here, one step_N.jsonl per step. A fresh run refuses a directory that holds
    step files unless --ckpt.overwrite (which deletes them); a resumed one deletes those past its checkpoint."""
    rollout_replay_dir: str | None = None
    """Train from a rollout dump instead of engines (reproduce / debug a step); not --train.rollout_dump_dir."""
