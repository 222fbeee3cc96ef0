"""The run directory (--ckpt.output_dir): one run per directory, its metrics log (JSONL, TensorBoard,
W&B, a progress bar), and crash-safe rewrites of its logs when a run resumes.

A fresh run over another run's files would mix with them: ``checkpoint.latest`` and pruning pick by
step number, and the ledger and metrics append. So a fresh run refuses a directory that holds run
artefacts unless told to resume (--ckpt.load_enable) or to start over (--ckpt.overwrite).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from tqdm import tqdm

from instar.config import CkptConfig, ConfigError, LogConfig

RUN_ARTEFACTS = ("checkpoints", "ledger.jsonl", "metrics.jsonl")
"""What makes a directory hold a run (config.json alone does not: it is rewritten at every start)."""
_OLD_OUTPUTS = ("tensorboard", "wandb", "wandb_run_id", "eval.jsonl", "hf", "hf_steps", "curve.png", "report.html")
"""Also removed by --ckpt.overwrite, so that nothing of the old run sits beside the new one's."""
_DUMP = re.compile(r"^step_(\d+)\.jsonl$")


def prepare_run_dir(ckpt: CkptConfig) -> None:
    """Before a run starts: refuse a fresh run over another run's artefacts; --ckpt.overwrite deletes
    them first (and the old run's exports), --ckpt.load_enable keeps them to resume from."""
    out = Path(ckpt.output_dir)
    found = [name for name in RUN_ARTEFACTS if (out / name).exists()]
    if ckpt.load_enable and ckpt.overwrite:
        raise ConfigError("--ckpt.load_enable resumes the run in --ckpt.output_dir and --ckpt.overwrite deletes it; "
                          "drop one of them")
    if not found or ckpt.load_enable:
        return
    if not ckpt.overwrite:
        raise ConfigError(f"--ckpt.output_dir {out} already holds a run ({', '.join(found)}); pass "
                          "--ckpt.load_enable to resume it, --ckpt.overwrite to delete it and start over, "
                          "or choose another --ckpt.output_dir")
    for path in [out / name for name in RUN_ARTEFACTS + _OLD_OUTPUTS] + sorted(out.glob("hf_step_*")):
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def truncate_lines(path: Path, keep: int) -> None:
    """Keep the first ``keep`` lines of ``path`` (when it exists), atomically: the ledger on resume,
    whose later lines belong to steps the resumed run redoes."""
    if path.exists():
        lines = path.read_text().splitlines()[:keep]
        atomic_write_text(path, "".join(line + "\n" for line in lines))


def truncate_dumps(dump_dir: str | None, step: int) -> None:
    """Delete the rollout dumps (``step_N.jsonl``) of steps after ``step``: the resumed run redoes
    those steps and writes them again."""
    if dump_dir and os.path.isdir(dump_dir):
        for name in os.listdir(dump_dir):
            if (m := _DUMP.match(name)) and int(m.group(1)) > step:
                os.remove(os.path.join(dump_dir, name))


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` by ``text``; a crash at any point leaves either the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new file in ``path`` durable (the entry lives in the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SHOWN = {"rl": ("reward", "score", "eval/accuracy"), "sft": ("actor/loss", "eval/loss"), "eval": ()}
"""The metrics each job's progress bar shows."""


class MetricsLogger:
    """One job's metrics: ``metrics.jsonl`` for rl and sft (``eval.jsonl`` for eval), TensorBoard, W&B."""

    def __init__(self, output_dir: str | Path, cfg: LogConfig, total_steps: int, start_step: int = 0,
                 run_config: dict[str, Any] | None = None, job: str = "rl"):
        self.dir, self.job = Path(output_dir), job
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / ("eval.jsonl" if job == "eval" else "metrics.jsonl")
        if job != "eval":  # rows past start_step are of steps this run redoes (from 0: step 0's eval too)
            self.truncate_after(start_step if start_step else -1)
        self.tb = self.wandb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / ("tensorboard/eval" if job == "eval" else "tensorboard")))
        if cfg.wandb_project:
            try:
                import wandb
            except ImportError:
                raise ImportError("--log.wandb_project needs the wandb package: pip install 'instar[wandb]'") from None
            # a resumed rl / sft run goes on in the same W&B run: its id is kept in the run directory; a fresh
            # one starts a new W&B run, also over the id of a run killed before its first checkpoint
            id_file = self.dir / "wandb_run_id"
            if job != "eval" and (start_step == 0 or not id_file.exists()):
                atomic_write_text(id_file, uuid.uuid4().hex[:16])
            same = {"id": id_file.read_text().strip(), "resume": "allow"} if job != "eval" else {}
            # neither the flag nor WANDB_MODE: offline, which needs no login (wandb's own default, online, asks for one)
            self.wandb = wandb.init(mode=cfg.wandb_mode or os.environ.get("WANDB_MODE", "offline"), dir=str(self.dir),
                                    project=cfg.wandb_project, config=run_config, job_type=job, **same)
        self.bar = tqdm(total=total_steps, initial=start_step, desc=job, dynamic_ncols=True, disable=job == "eval")

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
        self.bar.set_postfix({k: f"{numbers[k]:.3f}" for k in SHOWN[self.job] if k in numbers})
        self.bar.update(step - self.bar.n)

    def truncate_after(self, step: int) -> None:
        """Drop rows past `step` (a resumed run redoes them) and a torn line (a kill during a write)."""
        if self.path.exists():
            rows = []
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):  # only a torn line: each row is one whole JSON object
                    if json.loads(line)["step"] <= step:
                        rows.append(line)
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
    return None if isinstance(v, float) and not math.isfinite(v) else v
