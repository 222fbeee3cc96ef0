"""The flag reference (docs/flags.md), generated from the config dataclasses so it cannot drift:
`python -m instar.cli.flags > docs/flags.md` (a test checks the file is current)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing

from instar.cli.main import COMMANDS
from instar.config import ALIASES


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (and of its bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            if isinstance(node, ast.AnnAssign) and documented:
                docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def rows(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    hints, docs, out = typing.get_type_hints(cls), field_docs(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += rows(hints[f.name], f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append((f"--{prefix}{f.name}", repr(default), docs.get(f.name, "")))
    return out


def reference() -> str:
    lines = ["# instar flags", "", "Generated from `instar/config.py` by `python -m instar.cli.flags`; every flag is",
             "also a key of a YAML recipe (`--config recipe.yaml`). Molt's spellings are accepted as aliases, in",
             "flags and recipe keys: " + ", ".join(f"`--{old}*` = `--{new}*`" if old.endswith(".") else
                                                  f"`--{old}` = `--{new}`" for old, new in ALIASES.items()) + ".", ""]
    listed: dict[type, str] = {}
    for name, (cls, _) in COMMANDS.items():
        if cls in listed:  # e.g. `instar eval` reads an RL recipe
            lines += [f"## instar {name}", "", f"The flags of `instar {listed[cls]}`.", ""]
            continue
        listed[cls] = name
        lines += [f"## instar {name}", "", (cls.__doc__ or "").strip(), "", "| flag | default | meaning |",
                  "|---|---|---|"]
        lines += [f"| `{flag}` | `{default}` | {doc.replace('|', '/')} |" for flag, default, doc in rows(cls)]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference(), end="")
