"""Prompts, eval sets and SFT data from every source `datasets` reads: JSON, JSONL, Parquet and CSV
files, a directory of splits, a hub name (offline here: a clear error); columns chosen by flag."""

import csv
import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from instar.config import DataConfig
from instar.data.prompts import PromptStream, load_prompts
from instar.data.sft import load_sft_samples

# "007" must stay text in every format; the third prompt is a chat-message list
ROWS = [{"question": "What is 3+4?", "answer": "007", "level": "easy"},
        {"question": "Spell ünïcödé 中文", "answer": "ok", "level": "hard"},
        {"question": "2*5?", "answer": "10", "level": "easy"}]


def write(path, rows, fmt):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_every_file_format_gives_the_same_prompts_at_the_same_indices(tmp_path, fmt):
    source = write(tmp_path / f"prompts.{fmt}", ROWS, fmt)
    cfg = DataConfig(input_key="question", label_key="answer", system_prompt="Be brief.")
    prompts = load_prompts(source, cfg)
    assert [p.index for p in prompts] == [0, 1, 2]
    assert [p.label for p in prompts] == ["007", "ok", "10"]
    assert prompts[1].messages == [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Spell ünïcödé 中文"}]
    assert [p.metadata for p in prompts] == [{"level": "easy"}, {"level": "hard"}, {"level": "easy"}]
    assert [p.index for p in load_prompts(source, cfg)] == [0, 1, 2]  # read again (from the cache): same order
    # the ledger names prompts by these indices: a seeded stream serves the same records from every format
    stream = PromptStream(prompts, seed=3)
    assert [stream.next()[1].label for _ in range(3)] == [prompts[i].label for i in stream._order(0)]


def test_columnar_files_give_chat_messages_back_as_written(tmp_path):
    """Arrow gives every message every field seen in any message (None where absent)."""
    calls = [{"type": "function", "function": {"name": "calc", "arguments": {"expression": "1+2"}}}]
    rows = [{"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": calls},
                        {"role": "tool", "content": "3"}], "label": "3"},
            {"prompt": [{"role": "user", "content": "b"}], "label": "4"}]
    source = write(tmp_path / "chat.parquet", rows, "parquet")
    assert pq.read_table(source).to_pylist()[1]["prompt"][0]["tool_calls"] is None  # what arrow made of it
    prompts = load_prompts(source, DataConfig())
    assert [p.messages for p in prompts] == [r["prompt"] for r in rows]


def test_a_directory_holds_splits(tmp_path):
    (tmp_path / "d").mkdir()
    write(tmp_path / "d" / "train.jsonl", [{"prompt": "t1", "label": "1"}, {"prompt": "t2", "label": "2"}], "jsonl")
    write(tmp_path / "d" / "test.jsonl", [{"prompt": "e1", "label": "9"}], "jsonl")
    source = str(tmp_path / "d")
    assert [p.messages[0]["content"] for p in load_prompts(source, DataConfig())] == ["t1", "t2"]
    assert [p.label for p in load_prompts(source, DataConfig(split="test"))] == ["9"]
    assert [p.label for p in load_prompts(source, DataConfig(), "test", "eval.dataset")] == ["9"]
    with pytest.raises(ValueError, match=r"--eval.dataset '.*d': Unknown split \"validation\". "
                                         r"Should be one of \['train', 'test'\]"):
        load_prompts(source, DataConfig(), "validation", "eval.dataset")


def test_a_hub_name_offline_fails_with_the_fix(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"--data.prompt_dataset 'someorg/math-prompts' is not a local file or "
                                         r"directory and the Hugging Face hub could not be reached \(.*\); run where "
                                         "the hub is reachable, or download the data and give its file or directory"):
        load_prompts("someorg/math-prompts", DataConfig())


def test_unreadable_sources_are_named(tmp_path):
    (tmp_path / "p.txt").write_text("hello\n")
    with pytest.raises(ValueError, match=r"--data.prompt_dataset '.*p.txt': unknown file type '.txt'"):
        load_prompts(str(tmp_path / "p.txt"), DataConfig())
    with pytest.raises(ValueError, match="--data.prompt_dataset 'not a name!' does not exist"):
        load_prompts("not a name!", DataConfig())
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"--data.prompt_dataset '.*empty.jsonl' is empty"):
        load_prompts(str(tmp_path / "empty.jsonl"), DataConfig())
    (tmp_path / "header.csv").write_text("prompt,label\n")
    with pytest.raises(ValueError, match=r"--data.prompt_dataset '.*header.csv': .*no data"):
        load_prompts(str(tmp_path / "header.csv"), DataConfig())


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_sft_conversations_read_alike_from_any_format(tmp_path, tiny_model_dir, fmt):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    calls = [{"type": "function", "function": {"name": "calc", "arguments": {"expression": "6*7"}}}]
    rows = [{"chat": [{"role": "user", "content": "6*7?"}, {"role": "assistant", "content": "", "tool_calls": calls},
                      {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}]},
            {"chat": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    reference = load_sft_samples(write(tmp_path / "c.jsonl", rows, "jsonl"), tokenizer, messages_key="chat")
    samples = load_sft_samples(write(tmp_path / f"c.{fmt}", rows, fmt), tokenizer, messages_key="chat")
    assert [s.token_ids for s in samples] == [s.token_ids for s in reference]
    assert [s.action_mask for s in samples] == [s.action_mask for s in reference]
    assert "calc" in tokenizer.decode(reference[0].token_ids) and len(reference) == 2


def test_sft_reads_the_split_it_is_given(tmp_path, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    (tmp_path / "d").mkdir()
    for split, n in (("train", 3), ("validation", 1)):
        write(tmp_path / "d" / f"{split}.jsonl", [{"messages": [{"role": "user", "content": f"{split} {i}"},
                                                               {"role": "assistant", "content": "ok"}]}
                                                 for i in range(n)], "jsonl")
    assert len(load_sft_samples(str(tmp_path / "d"), tokenizer)) == 3
    [sample] = load_sft_samples(str(tmp_path / "d"), tokenizer, split="validation")
    assert "validation 0" in tokenizer.decode(sample.token_ids)
