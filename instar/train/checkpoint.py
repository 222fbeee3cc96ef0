"""Resumable checkpoints: sharded model + optimizer state (torch.distributed.checkpoint), the
caller's metadata (scheduler, step, and an ``extra`` dict: data ledger, loader position, KL
controller, pending rollouts) and every rank's RNG states.

Atomic: everything is written into ``step_N.tmp``, fsynced, and renamed to ``step_N`` only when
complete, so a save killed at any point leaves nothing that ``latest`` would pick up; a checkpoint
damaged anyway (a disk that lost what it acknowledged) is skipped by ``latest`` for the one before it.
Our own files are read with ``weights_only=True``: plain data and tensors only, so a planted pickle runs no
code. DCP's ``.metadata`` and the optimizer's non-tensor values are still unpickled by torch itself: resume
only from checkpoints of a trusted source.
Call every function on every trainer rank.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

from instar.data.chat import load_tokenizer
from instar.train import lora
from instar.train.run_dir import fsync_dir

Stateful = dict[str, tuple[nn.Module, Optimizer]]
"""Named (model, optimizer) pairs saved as shards: e.g. {"policy": (model, opt), "critic": ...}."""

_STEP_DIR = re.compile(r"^step_(\d+)$")


def latest(root: str) -> str | None:
    """The newest readable checkpoint under ``root``, or None when it holds none. ``step_N.tmp``
    directories are interrupted saves and never count; a ``step_N`` with a missing, truncated or
    corrupt file is skipped with a warning naming it, and the one before it is taken."""
    skipped = []
    for step in _steps(root):
        path = os.path.join(root, f"step_{step}")
        if (problem := _problem(path)) is None:
            if skipped:
                warnings.warn(f"skipped unreadable checkpoint(s) {'; '.join(skipped)}; resuming from {path}",
                              stacklevel=2)
            return path
        skipped.append(f"{path} ({problem})")
    if skipped:
        raise ValueError(f"no readable checkpoint in {root}: {'; '.join(skipped)}; delete them to start over")
    return None


def save(root: str, step: int, models: Stateful, meta: dict[str, Any], max_num: int = 0) -> str:
    """Write checkpoint ``root/step_{step}`` and prune to the newest ``max_num`` (0 keeps all).
    ``meta`` (rank 0's) must be plain data (dicts, lists, tuples, numbers, strings, tensors: what
    ``torch.load(weights_only=True)`` reads); it comes back from ``load``."""
    final = os.path.join(root, f"step_{step}")
    tmp = final + ".tmp"
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a save that died
        os.makedirs(tmp)
    _barrier()
    dcp.save(_sharded_state(models), checkpoint_id=tmp)
    _save_synced(_rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))  # dcp fsyncs its own files
    if rank == 0:
        _save_synced({"step": step, "world_size": _world(), **meta}, os.path.join(tmp, "meta.pt"))
        torch.load(os.path.join(tmp, "meta.pt"), weights_only=True)  # what load could not read fails now
    _barrier()  # every rank's files are in tmp before it becomes visible
    if rank == 0:
        fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)  # re-saving the same step after a resume
        os.replace(tmp, final)
        fsync_dir(root)
        for s in _steps(root)[max_num:] if max_num > 0 else []:  # prune to the newest max_num
            shutil.rmtree(os.path.join(root, f"step_{s}"), ignore_errors=True)
    _barrier()
    return final


def load(path: str, models: Stateful) -> dict[str, Any]:
    """Restore shards into ``models``, built and sharded in any layout: DCP reads each rank's part of
    every tensor whatever the layout that saved it. This rank's RNG states too when the number of
    ranks is the same (else each rank keeps its own: nothing in a training step draws from them
    today, and a rank of another layout has no counterpart). Returns the metadata given to ``save``."""
    meta = torch.load(os.path.join(path, "meta.pt"), weights_only=True)
    state = _sharded_state(models)
    dcp.load(state, checkpoint_id=path)
    for name, (model, optimizer) in models.items():
        set_state_dict(model, optimizer, model_state_dict=state[name]["model"], optim_state_dict=state[name]["optim"],
                       options=_TRAINED)
    if meta["world_size"] == _world():
        _set_rng_state(torch.load(os.path.join(path, f"rng_rank{_rank()}.pt"), weights_only=True))
    return meta


def _problem(path: str) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded, or None: every file is read back except the
    shards, whose sizes are checked against the offsets the shard index records."""
    file = "meta.pt"
    try:
        meta = torch.load(os.path.join(path, file), weights_only=True)
        for file in [f"rng_rank{r}.pt" for r in range(meta["world_size"])]:
            torch.load(os.path.join(path, file), weights_only=True)
        file = ".metadata"
        storage = dcp.FileSystemReader(path).read_metadata().storage_data
    except Exception as e:  # a damaged file surfaces as any of the unpickler's or the OS's errors
        return f"{file}: {type(e).__name__}"
    for info in storage.values():
        shard = os.path.join(path, info.relative_path)
        if not os.path.isfile(shard) or os.path.getsize(shard) < info.offset + info.length:
            return f"{info.relative_path}: missing or truncated"
    return None


def _save_synced(obj: Any, path: str) -> None:
    """torch.save, then fsync: the rename that publishes the checkpoint must not reach the disk first."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


# A checkpoint holds what training changes: the trainable parameters (LoRA: the adapters) and their optimizer
# state; frozen weights come from the model's own checkpoint when it is built. Loading asks DCP for exactly these
# (not strict: the frozen ones are left as built).
_TRAINED = StateDictOptions(strict=False)


def _sharded_state(models: Stateful) -> dict[str, Any]:
    out = {}
    for name, (model, optimizer) in models.items():
        weights, optim = get_state_dict(model, optimizer, options=_TRAINED)
        # every name of a frozen weight: torch's ignore_frozen_params drops a tied head's first name only
        frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        out[name] = {"model": {k: v for k, v in weights.items() if k not in frozen}, "optim": optim}
    return out


def _steps(root: str) -> list[int]:
    """The steps of the checkpoints under ``root`` (none when it does not exist), newest first."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted((int(m.group(1)) for d in names if (m := _STEP_DIR.match(d))), reverse=True)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def export_hf(model: nn.Module, out_dir: str, source: str, merged: bool = False) -> str:
    """Write ``model`` as an HF checkpoint (``save_pretrained``, plus the tokenizer and any image processor of
    the ``source`` model directory), loadable by transformers and vLLM; a LoRA model as a PEFT adapter folder
    over ``source`` unless ``merged``. Atomic like checkpoints. Collective over the trainer ranks; rank 0 writes."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _rank() == 0:
        tmp = out_dir.rstrip("/") + ".tmp"
        if hasattr(model, "instar_lora") and not merged:
            lora.save_adapter(full, tmp, source, model)
        else:  # a model without adapters is its own merged state
            model.save_pretrained(tmp, state_dict=lora.merged_state(full, model))
        load_tokenizer(source).save_pretrained(tmp)
        processor = os.path.join(source, "preprocessor_config.json")
        if os.path.isfile(processor):  # a vision-language model's image processor
            shutil.copy(processor, tmp)
        shutil.rmtree(out_dir, ignore_errors=True)  # an earlier export to the same place
        os.replace(tmp, out_dir)
    _barrier()
    return out_dir
