"""Dataset records through Hugging Face `datasets`: a local JSON / JSONL, Parquet or CSV file, a
directory of such files (one split per file name, as `datasets` reads it), or a dataset name on the hub.

Records come back as plain dicts in the dataset's own order, so record i is prompt index i in the
data ledger and in checkpoints, run after run.
"""

from __future__ import annotations

import re
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


def read_records(source: str, split: str, flag: str) -> list[dict[str, Any]]:
    """Every record of ``source`` in order: a file is read whole; a directory or hub name gives ``split``."""
    import datasets  # pulls in pyarrow and pandas: only when data is read

    kind = source_kind(source, flag)
    if kind == "file" and Path(source).stat().st_size == 0:  # `datasets` fails on one with StopIteration
        raise ValueError(f"--{flag} {source!r} is empty")
    try:
        if kind == "file":
            builder = FORMATS[Path(source).suffix.lower()]
            # A CSV has no types: read every column as text, so a label "007" stays "007".
            features = datasets.Features({c: datasets.Value("string") for c in _csv_header(source)}) \
                if builder == "csv" else None
            table = datasets.load_dataset(builder, data_files=source, split="train", features=features)
        else:
            table = datasets.load_dataset(source, split=split)
    except ConnectionError as e:
        raise ValueError(f"--{flag} {source!r} is not a local file or directory and the Hugging Face hub could not "
                         f"be reached ({e}); run where the hub is reachable, or download the data and give its "
                         "file or directory") from None
    # ValueError: an unknown or empty split (the message names the splits there are)
    except (datasets.exceptions.DatasetNotFoundError, ValueError) as e:
        raise ValueError(f"--{flag} {source!r}: {e}") from None
    return table.to_list()  # an empty split failed above (`datasets`: "corresponds to no data")


def _csv_header(path: str) -> list[str]:
    import csv

    with open(path, newline="") as f:
        return next(csv.reader(f), [])


def without_nulls(value: Any) -> Any:
    """``value`` with every None-valued dict key removed, at any depth. A columnar dataset gives each
    message the fields of every other (None where absent); the chat template must see them as written."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value
