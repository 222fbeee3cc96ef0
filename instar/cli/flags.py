"""The flag reference (docs/flags.md), generated from the config dataclasses so it cannot drift:
`python -m instar.cli.flags > docs/flags.md` (a test checks the file is current)."""

from __future__ import annotations

from jsonargparse import ArgumentParser

from instar.cli.main import COMMANDS, command_parser
from instar.config import ALIASES


def rows(parser: ArgumentParser) -> list[tuple[str, str, str]]:
    """(flag, default, meaning) of each flag of a command's parser, as its `--help` has them (jsonargparse
    reads the meaning from the docstring under each dataclass field)."""
    meaning = {a.dest: a.help for a in parser._actions}
    return [(f"--{flag}", repr(default), " ".join((meaning[flag] or "").split()))
            for flag, default in parser.get_defaults().items() if flag != "config"]


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
        lines += [f"| `{flag}` | `{default}` | {doc.replace('|', '/')} |"
                  for flag, default, doc in rows(command_parser(name, cls))]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference(), end="")
