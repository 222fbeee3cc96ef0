"""instar from Python: `instar.rl / sft / evaluate`, from a script or from inside a running event loop
(a notebook), the version, and agents named as `package.module:AttributeName`."""

import asyncio
import json
import subprocess
import sys
from importlib.metadata import version

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import instar
from instar.agents.api import AgentLoadError, StepEnvRunner, load_agent
from instar.contract import read_jsonl

LABEL_ENV = '''from instar.agents import Env, Result, StepEnvRunner


class LabelEnv(Env):
    async def step(self, state):
        score = float(state["label"] == "yes")
        return Result(reward=score, score=score)


Runner = StepEnvRunner(LabelEnv)
'''


@pytest.fixture
def agent_package(tmp_path, monkeypatch):
    """An importable package `score_pkg` (on sys.path here and on PYTHONPATH for Ray's workers)."""
    root = tmp_path / "pkgs"
    (root / "score_pkg").mkdir(parents=True)
    (root / "score_pkg/__init__.py").write_text("")
    (root / "score_pkg/envs.py").write_text(LABEL_ENV)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))
    yield "score_pkg.envs:Runner"
    for name in ("score_pkg", "score_pkg.envs"):
        sys.modules.pop(name, None)


def test_version_is_the_installed_distribution():
    assert instar.__version__ == version("instar")
    out = subprocess.run([sys.executable, "-m", "instar", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout == f"instar {version('instar')}\n"
    from instar import evaluate, rl, sft  # noqa: F401  (loaded on first use)
    with pytest.raises(AttributeError, match="module 'instar' has no attribute 'trian'"):
        instar.trian  # noqa: B018  (a subpackage name would pass once another test imported it)


def test_agents_load_from_a_module_attribute(agent_package):
    import score_pkg.envs

    assert load_agent(agent_package) is score_pkg.envs.Runner
    assert isinstance(load_agent(agent_package), StepEnvRunner)
    with pytest.raises(AgentLoadError, match=r"--train.agent_path 'no_such_pkg.envs:Runner': cannot import "
                                             r"'no_such_pkg.envs' \(No module named 'no_such_pkg'\); install"):
        load_agent("no_such_pkg.envs:Runner")
    with pytest.raises(AgentLoadError, match="score_pkg.envs:Other defines no Other; add `Other = StepEnvRunner"):
        load_agent("score_pkg.envs:Other")


@pytest.mark.slow
def test_rl_and_evaluate_run_inside_a_running_event_loop(tmp_path, tiny_model_dir, prompts, agent_package):
    """A notebook cell runs in an event loop; asyncio.run would refuse to start inside it."""
    labels = ["yes" if i % 4 == 0 else "no" for i in range(8)]  # accuracy 0.25 whatever the model says
    eval_set = tmp_path / "eval"  # a directory of splits: --eval.split picks its test split
    eval_set.mkdir()
    pq.write_table(pa.Table.from_pylist([{"q": f"Question {i}?", "a": a} for i, a in enumerate(labels)]),
                   eval_set / "test.parquet")
    pq.write_table(pa.Table.from_pylist([{"q": "Train?", "a": "yes"}]), eval_set / "train.parquet")
    common = ["--actor.model_name_or_path", str(tiny_model_dir), "--train.agent_path", agent_package,
              "--data.max_new_tokens", "4", "--data.max_len", "128"]

    async def notebook_cell():
        metrics = instar.rl([*common, "--data.prompt_dataset", prompts, "--train.max_steps", "1",
                             "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2",
                             "--train.force_sync_mode", "true", "--ckpt.output_dir", str(tmp_path / "run")])
        scores = instar.evaluate([*common, "--eval.dataset", str(eval_set), "--data.input_key", "q",
                                  "--data.label_key", "a", "--eval.dump_dir", str(tmp_path / "dump"),
                                  "--ckpt.output_dir", str(tmp_path / "run")])
        return metrics, scores

    metrics, scores = asyncio.run(notebook_cell())
    [logged] = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert logged["step"] == 1 and metrics["trajectories"] == logged["trajectories"] == 4  # the last step's metrics
    assert (scores["eval/accuracy"], scores["eval_greedy/accuracy"]) == (0.25, 0.25)
    dumped = read_jsonl(str(tmp_path / "dump/eval_step_000000.jsonl"))
    assert sorted({t.prompt_index for t in dumped}) == list(range(8))  # the parquet rows, by index


def test_sft_takes_the_command_flags_and_raises_instead_of_exiting(tmp_path):
    from instar.config import ConfigError

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match=f"--ckpt.output_dir {tmp_path} already holds a run"):
        instar.sft(["--sft.dataset", "unused.jsonl", "--ckpt.output_dir", str(tmp_path)])
