"""Configuration: dataclasses -> dotted flags and YAML recipes, overrides, type checks, guard rails."""

import dataclasses
import re
import typing

import pytest

from instar.checks import check, choose_engine, in_flight_groups
from instar.cli.main import build_parser, parse
from instar.config import ConfigError, RLConfig

RECIPE = """
actor:
  model_name_or_path: /models/tiny
  learning_rate: 0.0002
  eps_clip_low_high: [0.2, 0.3]
algo:
  advantage:
    estimator: rloo
    is_correction_threshold: [0.25, 4.0]
rollout:
  batch_size: 4
  n_samples_per_prompt: 8
train:
  agent_path: examples/agents/math_env.py
  max_steps: 30
"""


def test_molt_spellings_are_aliases_in_flags_and_recipes(tmp_path):
    (tmp_path / "molt.yaml").write_text("vllm:\n  num_engines: 3\n  speculative_config: {method: ngram}\n"
                                        "rollout:\n  vllm_generate_batch_size: 24\n  batch_size: 4\n")
    _, cfg = parse(["rl", "--config", str(tmp_path / "molt.yaml"), "--vllm.max-num-seqs", "16"])
    e = cfg.engine
    assert (e.num_engines, e.max_num_seqs, e.speculative_config) == (3, 16, {"method": "ngram"})
    assert (cfg.rollout.max_groups_in_flight, cfg.rollout.batch_size) == (24, 4)
    _, cfg = parse(["rl", "--rollout.vllm_generate_batch_size", "5", "--engine.num_engines", "2"])
    assert (cfg.rollout.max_groups_in_flight, cfg.engine.num_engines) == (5, 2)


def test_yaml_recipe_plus_cli_overrides(tmp_path):
    (tmp_path / "r.yaml").write_text(RECIPE)
    name, cfg = parse(["rl", "--config", str(tmp_path / "r.yaml"), "--rollout.batch_size", "2",
                       "--algo.advantage.estimator", "grpo", "--train.force-sync-mode", "--vllm.num_engines=2"])
    assert name == "rl" and isinstance(cfg, RLConfig)
    assert cfg.actor.model_name_or_path == "/models/tiny"
    assert cfg.actor.learning_rate == 0.0002
    assert cfg.actor.eps_clip_low_high == (0.2, 0.3)
    assert cfg.algo.advantage.estimator == "grpo"  # the flag after the recipe wins
    assert cfg.algo.advantage.is_correction_threshold == (0.25, 4.0)
    assert cfg.rollout.batch_size == 2 and cfg.rollout.n_samples_per_prompt == 8
    assert cfg.train.force_sync_mode is True and cfg.train.max_steps == 30
    assert cfg.engine.num_engines == 2
    assert cfg.algo.kl == RLConfig().algo.kl  # untouched sections keep their defaults
    check(cfg)


@pytest.mark.parametrize("argv,fragment", [
    (["rl", "--rollout.batch_size", "many"], "rollout.batch_size"),
    (["rl", "--actor.no_such_flag", "1"], "no_such_flag"),
    (["rl", "--train.force_sync_mode", "maybe"], "force_sync_mode"),
])
def test_bad_values_and_unknown_flags_fail_with_a_message(argv, fragment, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert fragment in capsys.readouterr().err


def test_bad_recipe_key_fails(tmp_path, capsys):
    (tmp_path / "r.yaml").write_text("actor:\n  learning_rat: 0.1\n")
    with pytest.raises(SystemExit):
        parse(["rl", "--config", str(tmp_path / "r.yaml")])
    assert "learning_rat" in capsys.readouterr().err


def _leaves(cls, prefix=""):
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _leaves(hint, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_help_lists_every_flag_with_its_doc():
    parser = build_parser()
    rl = parser._subcommands_action._name_parser_map["rl"]
    text = rl.format_help()
    leaves = list(_leaves(RLConfig))
    assert len(leaves) > 60
    for leaf in leaves:
        assert f"--{leaf} " in text or f"--{leaf}\n" in text, leaf
    documented = {a.dest for a in rl._actions if a.help and not a.help.startswith("Path to a configuration")}
    assert set(leaves) <= documented, set(leaves) - documented


@pytest.mark.parametrize("changes,fragment", [
    ({"algo.advantage.is_correction_level": "geo", "algo.advantage.is_correction_mode": "trunc"},
     "needs --algo.advantage.is_correction_mode mask"),
    ({"algo.advantage.estimator": "grpo", "rollout.n_samples_per_prompt": 1},
     "set --rollout.n_samples_per_prompt >= 2"),
    ({"algo.advantage.estimator": "ppo2"},
     "--algo.advantage.estimator 'ppo2' is not registered; choose one of ['dr_grpo', 'gae', 'grpo',"),
    ({"algo.advantage.estimator": "on_policy_distill", "algo.kl.coef": 0.1},
     "on_policy_distill uses the reference as teacher; set --algo.kl.coef 0"),
    ({"algo.kl.use_in": "reward", "algo.kl.coef": 0.1},
     "only shapes token rewards of gae / reinforce; set --algo.kl.use_in loss for --algo.advantage.estimator grpo"),
    ({"algo.advantage.is_correction_level": "off"}, "set --algo.advantage.is_correction_level token"),
    ({"train.force_sync_mode": True, "train.partial_rollout_enable": True}, "drop one of them"),
    ({"engine.enable_sleep_mode": True}, "add --train.force_sync_mode"),
    ({"algo.advantage.is_correction_threshold": (1.5, 2.0)}, "0 <= low < 1 < high"),
    ({"rollout.max_groups_in_flight": 2}, "a step can never fill"),
    ({"actor.dual_clip": 0.5}, "--actor.dual_clip must be > 1"),
    ({"train.batch_size": 24}, "must divide the rollout batch of 64 samples"),  # 8 prompts x 8 samples
    ({"train.batch_size": 1, "fsdp.num_ranks": 2}, r"use one of [2, 4, 8, 16, 32, 64]"),
    ({"train.max_epochs": 0}, "--train.max_epochs must be >= 1"),
    ({"fsdp.tp_size": 2}, "--fsdp.num_ranks 1 must be a multiple of --fsdp.tp_size x --fsdp.cp_size = 2"),
    ({"fsdp.num_ranks": 2, "fsdp.ep_size": 4}, "--fsdp.ep_size 4 must divide the data-parallel ranks"),
    ({"rollout.engine": "embedded", "engine.tensor_parallel_size": 2}, "set --engine.tensor_parallel_size 1"),
])
def test_incompatible_combinations_name_the_fix(changes, fragment):
    cfg = RLConfig()
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        obj = cfg
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, value)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        check(cfg)


def test_engine_choice_and_what_it_cannot_honour():
    cfg = RLConfig()
    assert choose_engine(cfg, gpu=True, vllm_installed=True) == "vllm"
    assert choose_engine(cfg, gpu=True, vllm_installed=False) == "embedded"
    assert choose_engine(cfg, gpu=False, vllm_installed=True) == "embedded"
    cfg.engine.tensor_parallel_size = 2
    assert choose_engine(cfg, gpu=True, vllm_installed=True) == "vllm"
    with pytest.raises(ConfigError, match=re.escape("(--rollout.engine auto chose it: no GPU); set "
                                                    "--engine.tensor_parallel_size 1")):
        choose_engine(cfg, gpu=False, vllm_installed=True)
    cfg.rollout.engine = "vllm"
    assert choose_engine(cfg, gpu=False, vllm_installed=False) == "vllm"  # named: vLLM says what it lacks


def test_in_flight_groups_follow_the_staleness_bound():
    cfg = RLConfig()  # 8 prompt groups a step, one version ahead
    assert in_flight_groups(cfg) == 16
    cfg.train.async_queue_size = 3
    assert in_flight_groups(cfg) == 32
    cfg.train.force_sync_mode = True
    assert in_flight_groups(cfg) == 8
    cfg.rollout.max_groups_in_flight = 12
    assert in_flight_groups(cfg) == 12


def test_off_policy_correction_off_is_fine_when_strictly_sync():
    cfg = RLConfig()
    cfg.algo.advantage.is_correction_level = "off"
    cfg.train.force_sync_mode = True
    check(cfg)


def test_flag_reference_is_current():
    from pathlib import Path

    from instar.cli.flags import reference

    doc = Path(__file__).resolve().parents[1] / "docs/flags.md"
    assert doc.read_text() == reference(), "docs/flags.md is stale: python -m instar.cli.flags > docs/flags.md"
    assert "| `--algo.advantage.estimator` | `'grpo'` |" in doc.read_text()
