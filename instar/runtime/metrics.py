"""Per-step metrics: one JSON object per line in metrics.jsonl, plus TensorBoard / W&B when asked,
and a progress bar with the live reward."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from instar.config import LogConfig
from instar.train.run_dir import atomic_write_text


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
        row = {"step": step, **{k: _json_value(v) for k, v in sorted(metrics.items())}}
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
        """Drop rows past `step` (a resumed run redoes them) and a torn line (a kill during a write)."""
        if self.path.exists():
            rows = []
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= step:
                        rows.append(line)
                except json.JSONDecodeError:  # only a torn line: each row is one whole JSON object
                    continue
            atomic_write_text(self.path, "".join(r + "\n" for r in rows))

    def note(self, text: str) -> None:
        """A line for the person watching the run, printed above the progress bar."""
        self.bar.write(f"instar: {text}", file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _json_value(v: Any) -> Any:
    """A metric as JSON can hold it: tensors and numpy scalars as numbers, NaN and inf as null."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class Usage:
    """Agent-runner counts (cumulative) and engine / agent-runner use since the previous `read`."""

    def __init__(self, agents: list[Any], engines: list[Any]):
        self.agents, self.engines = agents, engines
        self.last: tuple[float, dict[str, float]] = (time.perf_counter(), {})

    async def read(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for m in await _answers(a.metrics.remote() for a in self.agents):
            for k, v in m.items():
                totals[k] = totals.get(k, 0.0) + v
        now, use = time.perf_counter(), {"agent_cpu_seconds": totals.pop("agent/cpu_seconds", 0.0)}
        for m in await _answers(e.stats.remote() for e in self.engines):
            for k, v in m.items():
                use[k] = use.get(k, 0.0) + v
        (then, last), self.last = self.last, (now, use)
        delta = {k: v - last.get(k, 0.0) for k, v in use.items()}
        if now > then:
            if self.agents:  # none when replaying recorded rollouts
                totals["agent/cpu_fraction"] = delta["agent_cpu_seconds"] / ((now - then) * len(self.agents))
            if "busy_seconds" in delta:
                totals["engine/idle_fraction"] = 1 - delta["busy_seconds"] / ((now - then) * len(self.engines))
        if delta.get("prompt_tokens"):
            totals["engine/prefix_hit_rate"] = delta.get("prefix_hit_tokens", 0.0) / delta["prompt_tokens"]
        return totals


async def _answers(calls: Iterable[Any]) -> list[dict[str, float]]:
    """The actors' answers; one that Ray is restarting (see `Cluster`) is left out of this step's
    figures rather than failing the run (its counters restart from zero, so one delta jumps)."""
    import ray

    out = await asyncio.gather(*calls, return_exceptions=True)
    for x in out:
        if isinstance(x, BaseException) and not isinstance(x, ray.exceptions.RayActorError):
            raise x
    return [x for x in out if not isinstance(x, BaseException)]
