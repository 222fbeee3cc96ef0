"""Dataset records through Hugging Face `datasets`: a local JSON / JSONL, Parquet or CSV file, a
directory of such files (one split per file name, as `datasets` reads it), or a dataset name on the hub.

Records come back as plain dicts in the dataset's own order, so record i is prompt index i in the
data ledger and in checkpoints, run after run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from instar.config import ConfigError

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
HUB_NAME = re.compile(r"\w[\w.-]*(/\w[\w.-]*)?")  # `name` or `org/name`, e.g. openai/gsm8k, Qwen/Qwen3-0.6B


def source_kind(source: str, flag: str) -> Literal["file", "dir", "hub"]:
    """What ``source`` names; a missing local file fails here, before anything is loaded."""
    path = Path(source)
    if path.is_file():
        if path.suffix.lower() not in FORMATS:
            raise ConfigError(f"--{flag} {source!r}: unknown file type {path.suffix!r}; give a "
                             f"{', '.join(FORMATS)} file, a directory of them or a dataset name")
        return "file"
    if path.is_dir():
        return "dir"
    if path.suffix.lower() in FORMATS or not HUB_NAME.fullmatch(source):
        raise ConfigError(f"--{flag} {source!r} does not exist; give a {', '.join(FORMATS)} file, a directory "
                         "of them or a Hugging Face dataset name (like openai/gsm8k)")
    return "hub"


@dataclass
class Subset:
    """Which part of a directory or hub dataset to read (`datasets.load_dataset`'s ``name``, ``revision`` and
    ``data_files``): --data.dataset_config and the like."""

    config: str | None = None
    revision: str | None = None
    data_files: str | list[str] | None = None


def read_records(source: str | Any, split: str, flag: str, subset: Subset | None = None) -> list[dict[str, Any]]:
    """Every record of ``source`` in order: a file is read whole; a directory or hub name gives ``split`` of
    ``subset``; a `datasets.Dataset` given from Python is read whole, a `DatasetDict` gives ``split``."""
    import datasets  # pulls in pyarrow and pandas: only when data is read

    if not isinstance(source, str):
        table = source.get(split) if isinstance(source, datasets.DatasetDict) else source
        if not isinstance(table, datasets.Dataset) or not len(table):
            raise ConfigError(f"the {flag} given from Python must be a non-empty datasets.Dataset (or a DatasetDict "
                              f"with split {split!r}), got {type(table).__name__}")
        return table.to_list()
    subset = subset or Subset()
    kind = source_kind(source, flag)
    if kind == "file" and subset != Subset():
        raise ConfigError(f"--{flag} {source!r} is one file, read whole: its dataset config, revision and data "
                          "files apply to directories and hub names only; drop them")
    if kind == "file" and Path(source).stat().st_size == 0:  # `datasets` fails on one with StopIteration
        raise ConfigError(f"--{flag} {source!r} is empty")
    try:
        if kind == "file":
            builder = FORMATS[Path(source).suffix.lower()]
            # A CSV has no types: read every column as text, so a label "007" stays "007".
            features = datasets.Features({c: datasets.Value("string") for c in _csv_header(source)}) \
                if builder == "csv" else None
            table = datasets.load_dataset(builder, data_files=source, split="train", features=features)
        else:
            table = datasets.load_dataset(source, subset.config, split=split, revision=subset.revision,
                                          data_files=subset.data_files)
    except ConnectionError as e:
        raise ConfigError(f"--{flag} {source!r} is not a local file or directory and the Hugging Face hub could not "
                          f"be reached ({e}); run where the hub is reachable, or download the data and give its "
                          "file or directory") from None
    # ValueError: an unknown or empty split (the message names the splits there are)
    except (datasets.exceptions.DatasetNotFoundError, ValueError) as e:
        raise ConfigError(f"--{flag} {source!r}: {e}") from None
    return table.to_list()  # an empty split failed above (`datasets`: "corresponds to no data")


def _csv_header(path: str) -> list[str]:
    import csv

    with open(path, newline="") as f:
        return next(csv.reader(f), [])


MISSING = object()


def lookup(record: dict[str, Any], key: str, missing: Any = MISSING) -> Any:
    """``record[key]``, or for a dotted key (``reward_model.ground_truth``) the nested value when no column has
    that exact name; ``missing`` when there is neither."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return missing
        value = value[part]
    return value


def without_nulls(value: Any) -> Any:
    """``value`` with every None-valued dict key removed, at any depth. A columnar dataset gives each
    message the fields of every other (None where absent); the chat template must see them as written."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value
