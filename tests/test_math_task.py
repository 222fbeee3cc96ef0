"""The math recipe (examples/math): GSM8K-schema records, its reward functions, the GPU recipe's flags, thinking
on and off in the rendered prompts, and two RL steps on the tiny model."""

import importlib.util
import json
from pathlib import Path

import pytest
from helpers.loop import make_cfg, rows

from instar.checks import check
from instar.cli.main import parse
from instar.contract import read_jsonl
from instar.loop import run

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("math_task", ROOT / "examples/math/task.py")
task = importlib.util.module_from_spec(spec)
spec.loader.exec_module(task)


def test_records_have_gsm8k_schema_and_right_answers(tmp_path):
    out = task.write_datasets(tmp_path, n_train=30, n_eval=5)
    records = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(records) == 30 and all(set(r) == {"question", "answer"} for r in records)
    for r in records:  # the worked steps' last equation holds, and its result is the label
        last = r["answer"].split("\n")[-2].removeprefix("So ").rstrip(".")
        expression, result = last.split(" = ")
        assert eval(expression) == int(result) == int(task.final_number(r["answer"]))
    assert (out / "test.jsonl").read_text() != (out / "train.jsonl").read_text()[:200]


def test_reward_functions_golden():
    answers = ["5 + 3 = 8\n#### 1,008", "#### 7", "#### 7"]
    completions = ["So the total is \\boxed{1008}.", "It is 7", "\\boxed{8}"]
    assert task.final_number(answers[0]) == "1008"
    assert task.correct(completions, answers) == [1.0, 1.0, 0.0]
    assert task.boxed(completions) == [1.0, 0.0, 1.0]


def test_the_gpu_recipe_parses():
    _, cfg = parse(["rl", "--config", str(ROOT / "examples/math/rl.yaml")])
    assert (cfg.data.prompt_dataset, cfg.data.dataset_config, cfg.data.input_key, cfg.data.label_key) == (
        "openai/gsm8k", "main", "question", "answer")
    assert cfg.train.reward_fns == ["examples/math/task.py:correct", "examples/math/task.py:boxed"]
    assert (cfg.train.reward_weights, cfg.eval.split, cfg.actor.model_name_or_path) == ([1.0, 0.1], "test",
                                                                                         "Qwen/Qwen3-1.7B")
    check(cfg)


@pytest.mark.parametrize("thinking", [True, False])
def test_thinking_is_switched_in_every_prompt(tiny_model_dir, thinking):
    from instar.data.chat import load_tokenizer, prompt_ids

    tok = load_tokenizer(str(tiny_model_dir), str(ROOT / "tests/chat_templates/thinking_switch.jinja"),
                         {"enable_thinking": thinking})
    text = tok.decode(prompt_ids(tok, [{"role": "user", "content": "What is 2+3?"}]))
    assert text.endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))


@pytest.mark.slow
def test_two_rl_steps_on_the_tiny_model(tmp_path, tiny_model_dir, thinking=False):
    """Thinking off, through the whole loop: every recorded prompt ends with the template's empty think block."""
    data = task.write_datasets(tmp_path / "data", n_train=8, n_eval=4)
    cfg = make_cfg(tmp_path, tiny_model_dir, str(data / "train.jsonl"), **{
        "train.agent_path": "", "train.max_steps": 2, "train.force_sync_mode": True, "data.input_key": "question",
        "data.label_key": "answer", "data.system_prompt": task.SYSTEM, "data.max_new_tokens": 16,
        "data.chat_template": str(ROOT / "tests/chat_templates/thinking_switch.jinja"),
        "data.chat_template_kwargs": {"enable_thinking": thinking}, "train.rollout_dump_dir": str(tmp_path / "dump")})
    cfg.train.reward_fns = [f"{ROOT}/examples/math/task.py:correct", f"{ROOT}/examples/math/task.py:boxed"]
    cfg.train.reward_weights = [1.0, 0.1]
    run(cfg)
    metrics = rows(tmp_path / "run/metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["trajectories"] == 8 for m in metrics)
    assert all(m["reward/correct/mean"] >= 0 and m["reward/boxed/mean"] >= 0 for m in metrics)
    trajectories = [t for f in sorted((tmp_path / "dump").iterdir()) for t in read_jsonl(str(f))]
    empty_think = "<think>\n\n</think>\n\n"
    from instar.data.chat import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    prompts = [tok.decode([i for i, m in zip(t.segments[0].token_ids, t.segments[0].action_mask) if not m])
               for t in trajectories]
    assert all(p.endswith(empty_think) != thinking for p in prompts)
    assert all(set(t.info["rewards"]) == {"correct", "boxed"} and t.score == t.info["rewards"]["correct"]
               for t in trajectories)
