"""Hub-style dataset options (--data.dataset_config, --data.data_files), dotted keys for nested fields, a
`datasets.Dataset` given from Python, and every extra column reaching the agent and the trajectory."""

import json
from pathlib import Path

import datasets
import pytest
from helpers.loop import ROOT, make_cfg, rows

import instar
from instar.cli.view import load_dump, render
from instar.config import ConfigError, DataConfig
from instar.contract import SamplingParams
from instar.data.prompts import load_prompts
from instar.data.records import Subset
from instar.runtime.pool import group_tasks

# a folder laid out as openai/gsm8k is on the hub: two configurations, declared in its README card
CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train.jsonl
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train.jsonl
---
"""


@pytest.fixture
def gsm8k_like(tmp_path) -> str:
    for config, answer in (("main", "#### 7"), ("socratic", "step by step #### 7")):
        (tmp_path / config).mkdir()
        (tmp_path / config / "train.jsonl").write_text(json.dumps({"question": "3+4?", "answer": answer}) + "\n")
    (tmp_path / "README.md").write_text(CARD)
    return str(tmp_path)


def test_dataset_config_picks_the_subset(gsm8k_like):
    cfg = DataConfig(input_key="question", label_key="answer", dataset_config="socratic")
    [prompt] = load_prompts(gsm8k_like, cfg)
    assert prompt.label == "step by step #### 7"
    cfg.dataset_config = "main"
    assert load_prompts(gsm8k_like, cfg)[0].label == "#### 7"
    cfg.dataset_config = "nope"
    with pytest.raises(ValueError, match=r"--data.prompt_dataset .*'nope'.*main.*socratic"):
        load_prompts(gsm8k_like, cfg)


def test_data_files_pick_files_of_a_directory(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"prompt": f"from {name}"}) + "\n")
    [prompt] = load_prompts(str(tmp_path), DataConfig(data_files="b.jsonl"))
    assert prompt.messages[-1]["content"] == "from b"
    with pytest.raises(ConfigError, match="is one file, read whole"):
        load_prompts(str(tmp_path / "a.jsonl"), DataConfig(dataset_config="main"))


def test_dotted_keys_read_nested_fields_and_an_exact_column_wins(tmp_path):
    """verl's layout: the label under reward_model.ground_truth; the rest goes to the agent as metadata."""
    record = {"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4", "style": "rule"},
              "extra_info": {"index": 7}, "data_source": "gsm8k"}
    (tmp_path / "d.jsonl").write_text(json.dumps(record) + "\n")
    [prompt] = load_prompts(str(tmp_path / "d.jsonl"), DataConfig(label_key="reward_model.ground_truth"))
    assert prompt.label == "4"
    assert prompt.metadata == {"reward_model": {"ground_truth": "4", "style": "rule"}, "extra_info": {"index": 7},
                               "data_source": "gsm8k"}
    (tmp_path / "e.jsonl").write_text(json.dumps({**record, "reward_model.ground_truth": "exact"}) + "\n")
    [exact] = load_prompts(str(tmp_path / "e.jsonl"), DataConfig(label_key="reward_model.ground_truth"))
    assert exact.label == "exact"
    with pytest.raises(ValueError, match="no 'question.text' column or nested field"):
        load_prompts(str(tmp_path / "d.jsonl"), DataConfig(input_key="question.text"))


def test_a_dataset_from_python_and_its_metadata_reach_the_task():
    table = datasets.Dataset.from_list([{"prompt": "hi", "label": "x", "difficulty": 3}])
    for source in (table, datasets.DatasetDict({"train": table})):
        [prompt] = load_prompts(source, DataConfig())
        [task] = group_tasks(prompt, 0, 1, SamplingParams(), "r")
        assert (task.label, task.metadata) == ("x", {"difficulty": 3})
    with pytest.raises(ValueError, match="must be a non-empty datasets.Dataset"):
        load_prompts(datasets.DatasetDict({"test": table}), DataConfig())
    assert Subset() == Subset(None, None, None)


@pytest.mark.slow
def test_instar_rl_takes_a_dataset_and_the_env_reads_its_columns(tmp_path, tiny_model_dir):
    """`instar.rl(cfg, dataset=...)` with an Env that rewards a column no flag names: every trajectory's reward
    is its record's difficulty, and the dumped trajectories carry the columns into `instar view`."""
    table = datasets.Dataset.from_list([{"prompt": f"What is {i}+1?", "label": str(i + 1), "difficulty": d}
                                        for i, d in enumerate([1.0, 3.0])])
    cfg = make_cfg(tmp_path, tiny_model_dir, "", **{"train.max_steps": 1, "train.force_sync_mode": True,
                                                     "data.shuffle": False})
    cfg.train.agent_path = str(ROOT / "tests/agents/metadata_env.py")
    cfg.train.rollout_dump_dir = str(tmp_path / "dumps")
    instar.rl(cfg, dataset=table)
    [metrics] = rows(tmp_path / "run/metrics.jsonl")
    assert metrics["reward"] == pytest.approx(2.0)  # 4 rollouts of each record, rewarded 1 and 3
    dumped = load_dump(next(Path(cfg.train.rollout_dump_dir).iterdir()))
    assert sorted({t.metadata["difficulty"] for _, t in dumped}) == [1.0, 3.0]
    assert "difficulty" in render(dumped, lambda ids: "x" * len(ids), "dump")


def test_sft_reads_a_subset_and_a_nested_message_list(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from instar.data.sft import load_sft_samples

    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for config, n in (("main", 1), ("more", 2)):
        (tmp_path / config).mkdir()
        (tmp_path / config / "train.jsonl").write_text((json.dumps({"data": {"chat": chat}}) + "\n") * n)
    (tmp_path / "README.md").write_text(CARD.replace("socratic", "more"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    samples = load_sft_samples(str(tmp_path), tokenizer, messages_key="data.chat", subset=Subset("more"))
    assert len(samples) == 2 and sum(samples[0].action_mask) > 0
