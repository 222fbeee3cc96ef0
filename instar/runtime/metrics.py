"""Per-step metrics: one JSON object per line in metrics.jsonl, plus TensorBoard / W&B when asked,
and a progress bar with the live reward."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tqdm import tqdm

from instar.config import LogConfig


class MetricsLogger:
    def __init__(self, output_dir: str | Path, cfg: LogConfig, total_steps: int, start_step: int = 0,
                 run_config: dict[str, Any] | None = None):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.tb = self.wandb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tensorboard"))
        if cfg.wandb_project:
            try:
                import wandb
            except ImportError:
                raise ImportError("--log.wandb_project needs the wandb package: .venv/bin/pip install wandb") from None
            self.wandb = wandb.init(project=cfg.wandb_project, mode=cfg.wandb_mode, dir=str(self.dir),
                                    config=run_config, resume="allow")
        self.bar = tqdm(total=total_steps, initial=start_step, desc="rl", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb is not None:
            for k, v in numbers.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)
        shown = {k: f"{numbers[k]:.3f}" for k in ("reward", "score", "eval/accuracy") if k in numbers}
        self.bar.set_postfix(shown)
        self.bar.update(step - self.bar.n)

    def truncate_after(self, step: int) -> None:
        """Drop rows past `step` (a resumed run redoes them)."""
        if self.path.exists():
            rows = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= step]
            self.path.write_text("".join(r + "\n" for r in rows))

    def close(self) -> None:
        self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
