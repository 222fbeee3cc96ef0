"""Reliability of a run's start and resume: one run per output directory, crash-safe rewrites of the
ledger and the rollout dumps, and bad inputs that fail `instar rl` / `instar sft` in seconds with one
line naming the flag, before Ray or a model is loaded."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from instar.config import CkptConfig, ConfigError
from instar.train import run_dir

ROOT = Path(__file__).resolve().parents[1]


def _old_run(out: Path) -> None:
    (out / "checkpoints/step_5").mkdir(parents=True)
    (out / "hf_step_5").mkdir()
    (out / "tensorboard").mkdir()
    for name in ("ledger.jsonl", "metrics.jsonl", "config.json", "notes.txt"):
        (out / name).write_text("old\n")


@pytest.mark.parametrize("artefact", run_dir.RUN_ARTEFACTS)
def test_a_fresh_run_refuses_a_directory_that_holds_a_run(tmp_path, artefact):
    (tmp_path / artefact).write_text("")
    with pytest.raises(ConfigError) as e:
        run_dir.prepare_run_dir(CkptConfig(output_dir=str(tmp_path)))
    assert str(e.value) == (f"--ckpt.output_dir {tmp_path} already holds a run ({artefact}); pass --ckpt.load_enable "
                            "to resume it, --ckpt.overwrite to delete it and start over, or choose another "
                            "--ckpt.output_dir")


def test_an_empty_or_new_directory_or_a_config_alone_is_fine(tmp_path):
    run_dir.prepare_run_dir(CkptConfig(output_dir=str(tmp_path / "new")))
    (tmp_path / "config.json").write_text("{}")
    run_dir.prepare_run_dir(CkptConfig(output_dir=str(tmp_path)))
    assert os.listdir(tmp_path) == ["config.json"]


def test_resume_keeps_the_run_and_overwrite_deletes_it(tmp_path):
    _old_run(tmp_path)
    run_dir.prepare_run_dir(CkptConfig(output_dir=str(tmp_path), load_enable=True))
    assert len(os.listdir(tmp_path)) == 7
    run_dir.prepare_run_dir(CkptConfig(output_dir=str(tmp_path), overwrite=True))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "notes.txt"]
    run_dir.prepare_run_dir(CkptConfig(output_dir=str(tmp_path)))  # now a fresh run may start
    with pytest.raises(ConfigError, match="^--ckpt.load_enable resumes .* and --ckpt.overwrite deletes it; drop one"):
        run_dir.prepare_run_dir(CkptConfig(output_dir=str(tmp_path), load_enable=True, overwrite=True))


def test_ledger_truncation_is_atomic(tmp_path, monkeypatch):
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("".join(f'{{"step": {s}}}\n' for s in range(5)) + '{"st')  # torn by a kill
    run_dir.truncate_lines(ledger, 3)
    assert ledger.read_text() == '{"step": 0}\n{"step": 1}\n{"step": 2}\n'

    def crash(src, dst):
        raise OSError("killed")
    monkeypatch.setattr(os, "replace", crash)  # the process dies between writing the copy and the swap
    with pytest.raises(OSError):
        run_dir.truncate_lines(ledger, 1)
    assert ledger.read_text() == '{"step": 0}\n{"step": 1}\n{"step": 2}\n'
    run_dir.truncate_lines(tmp_path / "missing.jsonl", 0)
    assert not (tmp_path / "missing.jsonl").exists()


def test_rollout_dumps_past_the_resumed_step_are_removed(tmp_path):
    names = ["step_000001.jsonl", "step_000002.jsonl", "step_000003.jsonl", "eval_step_3.jsonl", "step_9.txt"]
    for name in names:
        (tmp_path / name).write_text("")
    run_dir.truncate_dumps(str(tmp_path), 1)
    assert sorted(os.listdir(tmp_path)) == ["eval_step_3.jsonl", "step_000001.jsonl", "step_9.txt"]
    run_dir.truncate_dumps(None, 0)
    run_dir.truncate_dumps(str(tmp_path / "missing"), 0)


def _instar(*argv: str) -> tuple[int, str]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "instar", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert time.monotonic() - start < 60, "a bad input must fail before Ray or a model starts"
    assert done.stdout == ""
    return done.returncode, done.stderr


@pytest.fixture
def rl_flags(tmp_path, tiny_model_dir):
    """Flags of an `instar rl` whose model and prompts exist (no agent yet), and two broken agents."""
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    (tmp_path / "syntax.py").write_text("def broken(:\n")
    (tmp_path / "empty.py").write_text("X = 1\n")
    (tmp_path / "imports.py").write_text("import no_such_package_here\n")
    return ["--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset",
            str(tmp_path / "prompts.jsonl"), "--ckpt.output_dir", str(tmp_path / "run")]


NO_AGENT = ("give one of --train.agent_path (the Python file that defines AgentRunner) and --train.reward_fns "
            "(reward functions for single-turn tasks)")


@pytest.mark.parametrize("flags,message", [
    ([], NO_AGENT),
    (["--train.agent_path", "{tmp}/missing.py"],
     "--train.agent_path '{tmp}/missing.py' is not a file; give the path of a Python file, or package.module:Name"),
    (["--train.agent_path", "{tmp}/syntax.py"], "--train.agent_path '{tmp}/syntax.py' does not compile: "
                                                "invalid syntax (line 1)"),
    (["--train.agent_path", "{tmp}/empty.py"], "{tmp}/empty.py defines no AgentRunner; add `AgentRunner = "
     "StepEnvRunner(YourEnv)` or `AgentRunner = ChatAgentRunner(YourChatAgent)`"),
    (["--actor.model_name_or_path", "/no/such/model"], "--actor.model_name_or_path '/no/such/model' does not exist "
     "and is not a hub model name (like Qwen/Qwen3-0.6B); give an HF checkpoint directory"),
    (["--actor.model_name_or_path", "Qwen/Qwen3-0.6B"], NO_AGENT),  # a cached hub name passes offline
    (["--actor.model_name_or_path", "runs/nope"], "--actor.model_name_or_path 'runs/nope' is not a directory here "
     "nor a model on the hub (OfflineModeIsEnabled); give an HF checkpoint directory"),
    (["--data.prompt_dataset", "{tmp}/none.jsonl"],
     "--data.prompt_dataset '{tmp}/none.jsonl' does not exist; give a .json, .jsonl, .parquet, .csv file, a "
     "directory of them or a Hugging Face dataset name (like openai/gsm8k)"),
    (["--eval.dataset", "no such file"], "--eval.dataset 'no such file' does not exist; give a .json, .jsonl, "
     ".parquet, .csv file, a directory of them or a Hugging Face dataset name (like openai/gsm8k)"),
    (["--data.prompt_dataset", ""], "--data.prompt_dataset is required: a JSONL/Parquet file, a directory or a hub "
     "dataset"),
    (["--train.agent_path", "{tmp}/imports.py"], "--train.agent_path: loading it failed: No module named "
     "'no_such_package_here'"),
    (["--train.agent_path", str(ROOT / "tests/agents/length_env.py"), "--data.input_key", "question"],
     "--data.prompt_dataset '{tmp}/prompts.jsonl' has no 'question' column or nested field (columns: ['label', "
     "'prompt']); set --data.input_key"),
    (["--rollout.batchsize", "3"], "no flag --rollout.batchsize; did you mean --rollout.batch_size?"),
])
def test_bad_inputs_fail_rl_in_seconds_with_one_line(flags, message, rl_flags, tmp_path, monkeypatch):
    snapshot = tmp_path / "hub/models--Qwen--Qwen3-0.6B/snapshots/abc"  # the hub's cache, offline
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs/main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, err = _instar("rl", *rl_flags, *(f.format(tmp=tmp_path) for f in flags))
    assert code == 1
    # the last line: reading a dataset may print its progress before (datasets' "Generating train split")
    assert err.splitlines()[-1] == f"instar rl: {message.format(tmp=tmp_path)}" and "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    (["sft", "--ckpt.output_dir", "{tmp}/run"], "--sft.dataset is required: conversations (a JSONL or Parquet file, "
     "directory, hub dataset)"),
    (["sft", "--sft.dataset", "x.jsonl", "--sft.batch_size", "1", "--fsdp.num_ranks", "2", "--ckpt.output_dir",
      "{tmp}/run"], "--sft.batch_size 1 must be >= --fsdp.num_ranks 2"),
    (["sft", "--train.max_steps", "3"], "no flag --train.max_steps; did you mean --sft.eval_steps?"),
    (["report", "--run_dir", "{tmp}/nothing"], "{tmp}/nothing/metrics.jsonl not found; pass the run's "
     "--ckpt.output_dir"),
    (["eval", "--actor.model_name_or_path", "/no/such/model", "--eval.dataset", "x.jsonl"],
     "--actor.model_name_or_path '/no/such/model' does not exist and is not a hub model name (like "
     "Qwen/Qwen3-0.6B); give an HF checkpoint directory"),
])
def test_bad_inputs_of_the_other_commands_are_one_line(argv, message, tmp_path):
    code, err = _instar(*(a.format(tmp=tmp_path) for a in argv))
    assert (code, err) == (1, f"instar {argv[0]}: {message.format(tmp=tmp_path)}\n")


def test_sft_refuses_a_directory_that_holds_a_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    code, err = _instar("sft", "--sft.dataset", "unused.jsonl", "--ckpt.output_dir", str(tmp_path))
    assert code == 1
    assert err == (f"instar sft: --ckpt.output_dir {tmp_path} already holds a run (metrics.jsonl); pass "
                   "--ckpt.load_enable to resume it, --ckpt.overwrite to delete it and start over, or choose "
                   "another --ckpt.output_dir\n")


def test_eval_describes_itself():
    from instar.cli.main import build_parser
    assert "`instar eval`: accuracy, pass@k and greedy accuracy" in build_parser().format_help()
