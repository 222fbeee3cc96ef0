"""The flag reference (docs/flags.md), generated from the config dataclasses so it cannot drift:
`python -m instar.cli.flags > docs/flags.md` (a test checks the file is current)."""

from __future__ import annotations

import re

from jsonargparse import ArgumentParser

from instar.cli.main import COMMANDS, command_parser
from instar.config import ALIASES


def rows(parser: ArgumentParser) -> list[tuple[str, str, str]]:
    """(flag, default, meaning) of each flag of a command's parser, as its `--help` has them (jsonargparse
    reads the meaning from the docstring under each dataclass field); a bar in the meaning is escaped for the
    table, except inside code (`<|python_tag|>`)."""
    meaning = {a.dest: re.sub(r"(`+).*?\1|\|", lambda m: m.group(1) and m.group(0) or r"\|", " ".join(
        (a.help or "").split())) for a in parser._actions}
    return [(f"--{flag}", repr(default), meaning[flag]) for flag, default in parser.get_defaults().items()
            if flag != "config"]


def reference() -> str:
    lines = ["# instar flags", "", "Generated from `instar/config/` by `python -m instar.cli.flags`; every flag is",
             "also a key of a YAML recipe (`--config recipe.yaml`). Molt's spellings are accepted as aliases, in",
             "flags and recipe keys: " + ", ".join(f"`--{old}*` = `--{new}*`" if old.endswith(".") else
                                                  f"`--{old}` = `--{new}`" for old, new in ALIASES.items()) + ".", ""]
    listed: dict[type, str] = {}
    for name, (cls, _) in COMMANDS.items():
        lines += [f"## instar {name}", ""]
        if cls in listed:  # e.g. `instar eval` reads an RL recipe
            lines += [f"The flags of `instar {listed[cls]}`.", ""]
            continue
        listed[cls] = name
        table = [f"| `{flag}` | `{default}` | {doc} |" for flag, default, doc in rows(command_parser(name, cls))]
        lines += [(cls.__doc__ or "").strip(), "", "| flag | default | meaning |", "|---|---|---|", *table, ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference(), end="")
