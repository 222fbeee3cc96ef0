"""Prompt datasets and the data ledger: which prompt indices were handed out, and which trained.

A run must never lose a prompt nor train one twice, even across `kill -9` and resume. The stream
therefore hands out prompts in a seeded per-epoch order and skips, after a resume, every index the
restored ledger already trained or that waits among the restored (generated, untrained) rollouts.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from instar.config import ConfigError, DataConfig
from instar.data.chat import prompt_ids, prompt_messages
from instar.data.images import data_url, normalise
from instar.data.records import MISSING, Subset, lookup, read_records, without_nulls


@dataclass
class Prompt:
    """One dataset record, normalised: chat messages, label, optional tool schemas."""

    index: int
    messages: list[dict[str, Any]]
    label: Any = None
    tools: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    images: list[str] | None = None  # data URLs, for the first user turn (see --data.image_key)
    chat: bool = True  # the record's prompt was chat messages, not a string


def load_prompts(source: str | Any, cfg: DataConfig, split: str | None = None, flag: str = "data.prompt_dataset",
                 subset: Subset | None = None) -> list[Prompt]:
    """Every record of a dataset (``instar.data.records``: a file, a directory or a hub name; ``split`` and
    ``subset`` default to --data.split and --data.dataset_config / _revision / data_files) as a ``Prompt``. A string
    prompt becomes a user message (plus the system prompt)."""
    subset = subset or Subset(cfg.dataset_config, cfg.dataset_revision, cfg.data_files)
    records = read_records(source, cfg.split if split is None else split, flag, subset)
    if lookup(records[0], cfg.input_key) is MISSING:
        raise ConfigError(f"--{flag} {source!r} has no {cfg.input_key!r} column or nested field (columns: "
                          f"{sorted(records[0])}); set --data.input_key")
    base = None if not isinstance(source, str) else Path(source).parent if Path(source).is_file() else Path(source)
    return [_to_prompt(index, record, cfg, base) for index, record in enumerate(records)]


def _to_prompt(index: int, record: dict[str, Any], cfg: DataConfig, base: Path | None = None) -> Prompt:
    value = without_nulls(lookup(record, cfg.input_key))
    if value is MISSING:
        raise ConfigError(f"prompt {index} has no {cfg.input_key!r} (columns: {sorted(record)}); set --data.input_key")
    chat = isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)
    if not (isinstance(value, str) or chat):
        raise ConfigError(f"prompt {index}: {cfg.input_key!r} must be a string or a list of chat messages, "
                          f"got {type(value).__name__}")
    messages = normalise(prompt_messages(value, cfg.system_prompt or None), base, f"prompt {index}")
    tools, images = (without_nulls(lookup(record, k, None)) for k in (cfg.tools_key, cfg.image_key))
    if images is not None and not isinstance(images, list):
        images = [images]
    images = [data_url(im, base, f"prompt {index} {cfg.image_key}[{k}]") for k, im in enumerate(images or [])]
    keys = (cfg.input_key, cfg.label_key, cfg.tools_key, cfg.image_key)
    rest = {k: v for k, v in record.items() if k not in keys}
    return Prompt(index, messages, lookup(record, cfg.label_key, None), tools, rest, images or None, chat)


def drop_overlong(prompts: list[Prompt], tokenizer: Any, max_len: int) -> list[Prompt]:
    """The prompts that leave room to sample within --data.max_len, as the chat template renders them (an image's
    placeholder tokens not counted), as verl's filter_overlong_prompts; prints how many it dropped."""
    kept = [p for p in prompts if len(prompt_ids(tokenizer, p.messages, p.tools)) < max_len]
    if len(kept) < len(prompts):
        print(f"instar: dropped {len(prompts) - len(kept)} of {len(prompts)} prompts: they fill --data.max_len "
              f"{max_len}", flush=True)
    if not kept:
        raise ConfigError(f"every prompt fills --data.max_len {max_len}; raise it")
    return kept


class PromptStream:
    """Endless seeded epochs over a dataset, with the ledger of trained (epoch, index) pairs."""

    def __init__(self, prompts: list[Prompt], seed: int = 0, shuffle: bool = True):
        self.prompts, self.seed, self.shuffle = prompts, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self.floor = 0  # epochs before it are done (a resumed stream no longer holds their records)
        self.trained: set[tuple[int, int]] = set()
        self.rejected: set[tuple[int, int]] = set()  # groups the loop could not train on (filtered, dropped)
        self.skip: set[tuple[int, int]] = set()  # handed out before a resume and still pending

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> tuple[int, Prompt]:
        """The next prompt to roll out, with its epoch."""
        while True:
            if self.cursor == len(self.prompts):
                self.epoch, self.cursor = self.epoch + 1, 0
            prompt = self.prompts[self._order(self.epoch)[self.cursor]]
            self.cursor += 1
            key = (self.epoch, prompt.index)  # the record's index: overlong records are not in the list
            if key not in self.trained and key not in self.rejected and key not in self.skip:
                return self.epoch, prompt

    def mark_trained(self, epoch: int, index: int) -> None:
        key = (epoch, index)
        if key in self.trained:
            raise RuntimeError(f"prompt {index} of epoch {epoch} was already trained; the data ledger is corrupt")
        self.trained.add(key)

    def mark_rejected(self, epoch: int, index: int) -> None:
        """Consumed without training (filtered or every rollout dropped): not served again this epoch."""
        self.rejected.add((epoch, index))

    def state_dict(self) -> dict[str, Any]:
        # Resume from the oldest epoch with an untrained prompt: one handed out at the end of the
        # previous epoch may still have been in flight.
        counts = Counter(epoch for epoch, _ in self.trained | self.rejected)
        first = next((e for e in range(self.floor, self.epoch + 1) if counts[e] < len(self.prompts)), self.epoch)
        return {"epoch": first, "trained": sorted(k for k in self.trained if k[0] >= first),
                "rejected": sorted(k for k in self.rejected if k[0] >= first)}

    def load_state_dict(self, state: dict[str, Any], pending: list[tuple[int, int]] = ()) -> None:
        """Restart the recorded epoch from its beginning, skipping what was trained, rejected or is pending:
        whatever was in flight when the run died is simply handed out again."""
        self.epoch, self.cursor, self.floor = state["epoch"], 0, state["epoch"]
        self.trained = {tuple(k) for k in state["trained"]}
        self.rejected = {tuple(k) for k in state["rejected"]}
        self.skip = set(pending)
