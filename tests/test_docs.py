"""The docs hold as written: the site builds in strict mode, every `instar` command in the README and the guides
names flags its parser has and files that exist, their Python snippets run, and no page carries dates."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from instar.cli.main import COMMANDS, _alias, command_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
GUIDES = [p for p in PAGES if p.name != "flags.md"]  # flags.md is generated from the config's docstrings
NOT_RUN = "# not run:"  # a Python snippet's first line that exempts it, with the reason


def fenced(page: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", page.read_text(), re.S | re.M)


def test_site_builds_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("instar.rl") > 0


def test_readme_is_short_and_pages_are_undated():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    month = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
    date = re.compile(rf"\b20\d\d-\d\d-\d\d\b|\b(?:{month})[a-z]* \d{{1,2}}\b|\b20[2-3]\d\b")
    dated = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in PAGES
             for i, line in enumerate(p.read_text().splitlines(), 1) if date.search(line)]
    assert dated == []


def instar_commands(page: Path) -> list[tuple[str, list[str]]]:
    """(subcommand, arguments) of every `instar ...` line in the page's bash blocks, continuations joined."""
    found = []
    for block in fenced(page, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*", "", line)
            m = re.search(r"(?:^|[\s/])instar\s+(" + "|".join(COMMANDS) + r")\b(.*)", line)
            if m:
                args = re.split(r"\s(?:\||&&|;|>)\s", m.group(2))[0]
                found.append((m.group(1), shlex.split(args)))
    return found


def test_commands_name_flags_that_exist():
    known = {name: {"config", "help", "print_config"} | {k for k, _ in command_parser(name, cls).get_defaults().items()}
             for name, (cls, _) in COMMANDS.items()}
    commands = [(p, sub, args) for p in GUIDES for sub, args in instar_commands(p)]
    assert len(commands) > 30
    unknown = [f"{p.relative_to(ROOT)}: instar {sub} {arg}" for p, sub, args in commands for arg in args
               if arg.startswith("--") and _alias(arg[2:].split("=")[0].replace("-", "_")) not in known[sub]]
    assert unknown == []


def test_pages_name_files_that_exist():
    missing = []
    placeholder = re.compile(r"/[A-Z_]+\.|^[A-Z_]+\.")  # bench/NAME.py, MY_AGENT.py
    for page in GUIDES:
        text = page.read_text()
        paths = set(re.findall(r"(?<![\w/.-])((?:examples|scripts|bench|tests|instar|requirements)/[\w./-]*\w)", text))
        # every file a shell example reads exists, or is written under runs/ (or /tmp) by a command before it
        commands = re.sub(r"(^|\s)#.*", "", "".join(fenced(page, "bash")))
        paths |= set(re.findall(r"(?<![\w/.-])([\w./-]+\.(?:jsonl|json|yaml|py|sh|sbatch|parquet|csv|jinja))\b",
                                commands))
        missing += [f"{page.relative_to(ROOT)}: {p}" for p in sorted(paths) if not (ROOT / p).exists()
                    and not p.startswith(("runs/", "/tmp/")) and not placeholder.search(p)]
    assert missing == []


def snippets() -> list[tuple[str, str]]:
    return [(f"{p.relative_to(ROOT)}#{i}", code) for p in PAGES for i, code in enumerate(fenced(p, "python"))
            if not code.startswith(NOT_RUN)]


@pytest.mark.slow
def test_python_snippets_run(tmp_path, tiny_model_dir):
    """Each snippet runs in a fresh namespace of one process, in a directory that holds what the guides' commands
    would have made (runs/tiny, runs/data) and the repository's examples."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny").symlink_to(tiny_model_dir)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    subprocess.run([sys.executable, str(ROOT / "examples/calculator/task.py"), "runs/data"], cwd=tmp_path, check=True,
                   capture_output=True, timeout=120)
    driver = ("import json, sys, traceback\nfailed = {}\nfor name, code in json.load(sys.stdin):\n"
              "    try:\n        exec(compile(code, name, 'exec'), {'__name__': '__main__'})\n"
              "    except BaseException:\n        failed[name] = traceback.format_exc(limit=-3)\n"
              "print(json.dumps(failed))\n")
    assert len(snippets()) >= 5
    out = subprocess.run([sys.executable, "-c", driver], input=json.dumps(snippets()), cwd=tmp_path, text=True,
                         capture_output=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {}
