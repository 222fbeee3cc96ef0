"""`instar` command line: one subcommand per job, every flag generated from a config dataclass.

jsonargparse turns the nested dataclasses of instar/config.py into dotted flags and YAML recipes
(`--config recipe.yaml`, later flags override it), with type checks and `--help` from field docs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import os
import sys
import typing
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import yaml
from jsonargparse import ArgumentParser, set_parsing_settings

from instar.checks import check
from instar.config import ALIASES, VALUE_ALIASES, ConfigError, RLConfig, SFTConfig
from instar.data.chat import read_template
from instar.data.records import HUB_NAME, source_kind
from instar.data.tiny_model import TinySpec, build_tiny_model
from instar.version import __version__

set_parsing_settings(docstring_parse_attribute_docstrings=True)


@dataclasses.dataclass
class TinyModelArgs(TinySpec):
    """`instar tiny-model`: build a random-init tiny model and tokenizer, offline."""

    out: str = ""
    """Output directory (an HF checkpoint: config, weights, tokenizer, chat template)."""


@dataclasses.dataclass
class ReportArgs:
    """`instar report`: curves (PNG), a short HTML page and the before/after eval accuracy of a run."""

    run_dir: str = ""
    """The run's --ckpt.output_dir (it holds metrics.jsonl)."""


@dataclasses.dataclass
class ViewArgs:
    """`instar view`: dumped trajectories as a token-level HTML page (tokens, logprobs, versions)."""

    path: str = ""
    """A rollout dump: one step_N.jsonl, or the run's --train.rollout_dump_dir."""
    tokenizer: str = ""
    """HF checkpoint directory whose tokenizer decodes the tokens (the run's --actor.model_name_or_path)."""
    out: str | None = None
    """HTML file to write; None writes view.html beside the dump."""
    limit: int = 64
    """Show the first this many trajectories."""


def _run_view(args: ViewArgs) -> None:
    from instar.cli.view import write_view

    if not args.path or not args.tokenizer:
        raise ConfigError("--path (a rollout dump) and --tokenizer (the run's model directory) are required")
    print(f"wrote {write_view(args.path, args.tokenizer, args.out, args.limit)}")


def _run_report(args: ReportArgs) -> None:
    from instar.cli.report import write_report

    png, page, summary = write_report(args.run_dir)
    for key, value in summary.items():
        print(f"{key}: {value}")
    print(f"wrote {png} and {page}")
    print(f"eval accuracy: before={summary['eval accuracy before']} after={summary['eval accuracy after']}")


def _check_inputs(cfg: RLConfig, prompts_given: bool = False, reward_fns: Sequence[Callable] = ()) -> None:
    """Missing files, or an agent module (reward functions) that does not load, fail here in seconds rather
    than inside a Ray actor minutes later."""
    from instar.agents.api import load_agent
    from instar.agents.reward_fns import load_reward_fns

    if not cfg.actor.model_name_or_path:
        raise ConfigError("--actor.model_name_or_path is required: an HF checkpoint directory or hub model name")
    models = {"actor.model_name_or_path": cfg.actor.model_name_or_path,
              "actor.ref_model_name_or_path": cfg.actor.ref_model_name_or_path,
              "critic.model_name_or_path": cfg.critic.model_name_or_path}
    for flag, path in models.items():
        if path and not os.path.exists(path) and (problem := _hub_problem(path)):
            raise ConfigError(f"--{flag} {path!r} {problem}; give an HF checkpoint directory")
    if not (prompts_given or cfg.data.prompt_dataset or cfg.train.rollout_replay_dir):
        raise ConfigError("--data.prompt_dataset is required: a JSONL/Parquet file, a directory or a hub dataset")
    if cfg.data.prompt_dataset and not prompts_given:
        source_kind(cfg.data.prompt_dataset, "data.prompt_dataset")
    if cfg.eval.dataset:
        source_kind(cfg.eval.dataset, "eval.dataset")
    if cfg.train.rollout_replay_dir:  # trains from a dump: no agent runs
        return
    fns = [*cfg.train.reward_fns, *reward_fns]
    if bool(cfg.train.agent_path) == bool(fns):
        raise ConfigError("give one of --train.agent_path (the Python file that defines AgentRunner) and "
                          "--train.reward_fns (reward functions for single-turn tasks)")
    flag = "--train.agent_path" if cfg.train.agent_path else "--train.reward_fns"
    try:
        load_agent(cfg.train.agent_path) if cfg.train.agent_path else load_reward_fns(fns, cfg.train.reward_weights)
    except SyntaxError as e:
        raise ConfigError(f"{flag} {e.filename!r} does not compile: {e.msg} (line {e.lineno})") from None
    except ImportError as e:  # what it imports is not installed here (nor, then, in the agent runners)
        raise ConfigError(f"{flag}: loading it failed: {e}") from None


def _hub_problem(name: str) -> str | None:
    """Why ``name``, not a path here, names no model: None when the hub (or its cache, offline) has it."""
    import huggingface_hub as hub

    if not HUB_NAME.fullmatch(name):
        return "does not exist and is not a hub model name (like Qwen/Qwen3-0.6B)"
    try:
        hub.try_to_load_from_cache(name, "config.json") or hub.model_info(name, timeout=10)
    except Exception as e:  # RepositoryNotFoundError, or no network, HF_HUB_OFFLINE: the name cannot be settled
        return f"is not a directory here nor a model on the hub ({type(e).__name__})"


def rl(config: RLConfig | Sequence[str], dataset: typing.Any = None,
       reward_fns: Sequence[Callable[..., typing.Any]] = ()) -> dict[str, float]:
    """`instar rl` from Python (a script or a notebook): an ``RLConfig``, or the command's flags as a list.
    ``dataset``: the prompt records as a `datasets.Dataset` (or a `DatasetDict`, read at --data.split) instead of
    --data.prompt_dataset; ``reward_fns``: reward functions (see --train.reward_fns) as callables. Returns the
    last step's metrics."""
    cfg = _config("rl", config)
    # first: the agent module may register an estimator
    _check_inputs(cfg, prompts_given=dataset is not None, reward_fns=reward_fns)
    check(cfg)
    _announce(cfg)
    from instar.loop import run  # the loop pulls in Ray and torch.distributed; only load it to run

    return _outside_event_loop(partial(run, dataset=dataset, reward_fns=reward_fns), cfg)


def evaluate(config: RLConfig | Sequence[str]) -> dict[str, float]:
    """`instar eval` from Python: accuracy, pass@k and greedy accuracy of a checkpoint over --eval.dataset."""
    from instar.loop import evaluate as run_eval

    cfg = _config("eval", config)
    read_template(cfg.data.chat_template, cfg.data.chat_template_kwargs, "data")  # here, not in each agent runner
    if not cfg.eval.dataset:
        raise ConfigError("--eval.dataset is required: the prompts (with labels) to evaluate on")
    _check_inputs(cfg, prompts_given=True)  # the prompts are --eval.dataset's
    return _outside_event_loop(run_eval, cfg)


def sft(config: SFTConfig | Sequence[str]) -> dict[str, float]:
    """`instar sft` from Python. Returns the last step's metrics."""
    from instar.train.run_dir import prepare_run_dir
    from instar.train.sft import run_sft

    cfg = _config("sft", config)
    if not cfg.sft.dataset:
        raise ConfigError("--sft.dataset is required: conversations (a JSONL or Parquet file, directory, hub dataset)")
    _announce(cfg)
    prepare_run_dir(cfg.ckpt)
    return run_sft(cfg)


def _announce(cfg: RLConfig | SFTConfig) -> None:
    if cfg.cpu.enable:
        print(f"instar: CPU accelerator on (--cpu.enable): C kernels, compiled engine layers, --cpu.matmul "
              f"{cfg.cpu.matmul}, malloc tuning; each part that cannot build here says so and stays plain PyTorch",
              flush=True)


def _config(command: str, config: object) -> typing.Any:
    return config if isinstance(config, COMMANDS[command][0]) else parse([command, *config])[1]


def _outside_event_loop(fn: Callable[[RLConfig], dict[str, float]], cfg: RLConfig) -> dict[str, float]:
    """``fn(cfg)``, which runs its own event loop; in a thread of its own when this thread already runs
    one (a notebook, an async script), where asyncio.run would refuse to start."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn(cfg)
    with ThreadPoolExecutor(1, thread_name_prefix="instar") as pool:
        return pool.submit(fn, cfg).result()


def _run_eval(cfg: RLConfig) -> None:
    metrics = evaluate(cfg)
    for key, value in metrics.items():
        print(f"{key}: {value:g}")
    print(f"eval accuracy: {metrics['eval/accuracy']:g} (greedy {metrics['eval_greedy/accuracy']:g})")


@dataclasses.dataclass
class EnvArgs:
    """`instar env`: versions, devices, threads, and which parts of the CPU accelerator build and run here."""


def _run_env(args: EnvArgs) -> None:
    import torch

    from instar.cpu import describe
    from instar.train.launch import cpu_threads

    cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "no GPU"
    print(f"instar {__version__}, torch {torch.__version__} ({cuda}), python {sys.version.split()[0]}, "
          f"{cpu_threads(1)} cores available")
    print("\n".join(describe()))


def _run_tiny_model(args: TinyModelArgs) -> None:
    if not args.out:
        raise ConfigError("--out DIR is required: the directory to write the model into")
    spec = TinySpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TinySpec)})
    print(f"wrote tiny model to {build_tiny_model(args.out, spec)}")


COMMANDS: dict[str, tuple[type, Callable]] = {
    "rl": (RLConfig, rl),
    "sft": (SFTConfig, sft),
    "eval": (RLConfig, _run_eval),
    "tiny-model": (TinyModelArgs, _run_tiny_model),
    "report": (ReportArgs, _run_report),
    "view": (ViewArgs, _run_view),
    "env": (EnvArgs, _run_env),
}


# `instar eval` reads an RL recipe: RLConfig's flags, a description of its own
DESCRIPTIONS = {"eval": "`instar eval`: accuracy, pass@k and greedy accuracy of a checkpoint over --eval.dataset."}


def command_parser(name: str, cls: type) -> ArgumentParser:
    """The parser of `instar NAME`: the fields of its config dataclass ``cls`` as flags, their docstrings as help."""
    p = ArgumentParser(prog=f"instar {name}", description=DESCRIPTIONS.get(name) or (cls.__doc__ or "").strip())
    p.add_argument("--config", action="config", help="YAML recipe; flags given after it override it")
    p.add_class_arguments(cls, nested_key=None, as_group=False)
    return p


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="instar", description="instar: agentic reinforcement learning for language models")
    parser.add_argument("--version", action="version", version=f"instar {__version__}")
    sub = parser.add_subcommands(dest="command")
    for name, (cls, _) in COMMANDS.items():
        sub.add_subcommand(name, p := command_parser(name, cls), help=p.description.split("\n")[0])
    return parser


def parse(argv: list[str]) -> tuple[str, object]:
    """Parse a command line into (command, config dataclass); raises SystemExit with a message on bad input."""
    parser, argv = build_parser(), _normalise(argv)
    if argv and (command := parser._subcommands_action._name_parser_map.get(argv[0])) is not None:
        known = {flag for action in command._actions for flag in action.option_strings}
        for flag in (arg.split("=")[0] for arg in argv[1:] if arg.startswith("--")):
            if flag not in known:  # one line with the nearest flag, not the whole usage
                near = difflib.get_close_matches(flag, known, 1)
                hint = f"; did you mean {near[0]}?" if near else ""
                print(f"instar {argv[0]}: no flag {flag}{hint}", file=sys.stderr)
                sys.exit(1)
    ns = parser.parse_args(argv)
    # jsonargparse instantiates the nested config dataclasses; the command's own one is built here
    cls, values = COMMANDS[ns.command][0], parser.instantiate(ns)[ns.command]
    return ns.command, cls(**{f.name: values.get(f.name) for f in dataclasses.fields(cls)})


def main(argv: list[str] | None = None) -> None:
    name, cfg = parse(sys.argv[1:] if argv is None else argv)
    try:
        COMMANDS[name][1](cfg)
    except (ConfigError, FileNotFoundError) as e:  # what the user gave: one line, no traceback
        sys.exit(f"instar {name}: {e}")


COMMA_LISTS = {"train.reward_fns", "train.reward_weights"}


def _normalise(argv: list[str]) -> list[str]:
    """Accept `--kv-heads` for `--kv_heads`, a bare boolean flag (`--moe`) for `--moe true`, and Molt's and
    earlier spellings (`config.ALIASES`, `config.VALUE_ALIASES`) in flags and in the keys of a `--config` recipe."""
    flags = _bool_flags()
    argv, out = list(argv), []  # a value alias rewrites the argument after it: the caller's list stays as given
    for i, arg in enumerate(argv):
        if i and argv[i - 1] == "--config" and os.path.isfile(arg):
            out.append(_recipe(arg))
            continue
        if i and argv[i - 1][2:].replace("-", "_") in COMMA_LISTS and not arg.startswith("["):
            arg = f"[{arg}]"  # `--train.reward_fns a.py:f,b.py:g`: a comma-separated list, as well as a JSON one
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            name = _alias(name.replace("-", "_"))
            if name in VALUE_ALIASES and eq:
                name, value = _value_alias(name, value)
            elif name in VALUE_ALIASES and i + 1 < len(argv):
                name, argv[i + 1] = _value_alias(name, argv[i + 1])
            arg = "--" + name + eq + value
            bare = not eq and (i + 1 == len(argv) or argv[i + 1].startswith("--"))
            if bare and name.split(".")[-1] in flags:
                out += [arg, "true"]
                continue
        out.append(arg)
    return out


def _alias(name: str) -> str:
    for old, new in ALIASES.items():
        if name == old or (old.endswith(".") and name.startswith(old)):
            return new + name[len(old):]
    return name


def _value_alias(name: str, value: str) -> tuple[str, str]:
    """An earlier flag and its value as the flag that replaces it and that flag's value, as the text of a flag
    (`config.VALUE_ALIASES`); a recipe holds that text too, which the parser reads as it reads a flag's."""
    new, values = VALUE_ALIASES[name]
    if value not in values:
        raise SystemExit(f"instar: --{name} takes one of {sorted(values)} (it is --{new} now), got {value!r}")
    return new, str(values[value]).lower()


def _recipe(path: str) -> str:
    """A YAML recipe's text with aliased keys renamed (jsonargparse reads YAML text as well as a path): each
    leaf's dotted key is renamed as the flag would be, so a key may move to another section."""
    tree: dict = {}
    for key, value in _leaves(yaml.safe_load(Path(path).read_text()) or {}):
        key = _alias(key)
        if key in VALUE_ALIASES:
            key, value = _value_alias(key, str(value).lower())
        *sections, leaf = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return yaml.safe_dump(tree, sort_keys=False)


def _leaves(tree: dict, prefix: str = "") -> typing.Iterator[tuple[str, object]]:
    """(dotted key, value) of each leaf of a YAML tree."""
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        elif isinstance(value, dict):  # an empty section keeps its (aliased) name
            yield _alias(f"{prefix}{key}.")[:-1], value
        else:
            yield f"{prefix}{key}", value


def _bool_flags() -> set[str]:
    names: set[str] = set()
    todo = [cls for cls, _ in COMMANDS.values()]  # config dataclasses, nested sections added as found
    while todo:
        for f, hint in typing.get_type_hints(todo.pop()).items():
            if hint is bool:
                names.add(f)
            elif dataclasses.is_dataclass(hint):
                todo.append(hint)
    return names
