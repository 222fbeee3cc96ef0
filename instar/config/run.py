"""A run's surroundings: checkpoints (`--ckpt.*`), evaluation (`--eval.*`), the Ray cluster (`--ray.*`),
logging (`--log.*`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
    dataset_config: str | None = None
    """Configuration (subset) of a hub --eval.dataset."""
    dataset_revision: str | None = None
    """Revision (branch, tag or commit) of a hub --eval.dataset."""
    data_files: str | list[str] | None = None
    """Files of an --eval.dataset directory or hub dataset to read."""
    steps: int = 0
    """Evaluate every N steps (and at the start); 0: only after the last step."""
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
    wandb_mode: Literal["online", "offline"] | None = None
    """Weights & Biases mode; unset: the WANDB_MODE environment variable, else offline (no login, no network)."""
