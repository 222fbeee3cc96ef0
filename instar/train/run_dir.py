"""The run directory (--ckpt.output_dir): one run per directory, and crash-safe rewrites of its logs
when a run resumes.

A fresh run over another run's files would mix with them: ``checkpoint.latest`` and pruning pick by
step number, and the ledger and metrics append. So a fresh run refuses a directory that holds run
artefacts unless told to resume (--ckpt.load_enable) or to start over (--ckpt.overwrite).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from instar.config import CkptConfig, ConfigError

RUN_ARTEFACTS = ("checkpoints", "ledger.jsonl", "metrics.jsonl")
"""What makes a directory hold a run (config.json alone does not: it is rewritten at every start)."""
_OLD_OUTPUTS = ("tensorboard", "hf", "hf_steps", "curve.png", "report.html")
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


def truncate_lines(path: str | Path, keep: int) -> None:
    """Keep the first ``keep`` lines of ``path`` (when it exists), atomically: the ledger on resume,
    whose later lines belong to steps the resumed run redoes."""
    path = Path(path)
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


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace ``path`` by ``text``; a crash at any point leaves either the old file or the new one."""
    path = Path(path)
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
