"""`instar view`: a rollout dump rendered token by token."""

import math
import re

import pytest
from transformers import AutoTokenizer

from instar.cli.main import main
from instar.cli.view import write_view
from instar.contract import Sample, Trajectory, write_jsonl


def make_trajectory(tokenizer, rollout_id: str, reward: float, rewritten: bool = False) -> Trajectory:
    context = tokenizer.encode("What is <b>2+2</b>?\n")
    answer = tokenizer.encode("4")
    seg = Sample(context + answer, [0] * len(context) + [1] * len(answer),
                 [0.0] * len(context) + [math.log(0.25)] * len(answer), [-1] * len(context) + [3] * len(answer))
    return Trajectory([seg, seg] if rewritten else [seg], reward=reward, score=None, rollout_id=rollout_id,
                      prompt_index=7, finish_reason="stop")


def test_view_renders_every_token_escaped_with_its_logprob(tmp_path, tiny_model_dir, capsys):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    dump = tmp_path / "dump"
    dump.mkdir()
    write_jsonl(str(dump / "step_000001.jsonl"), [make_trajectory(tokenizer, "r0", 1.0)])
    write_jsonl(str(dump / "step_000002.jsonl"), [make_trajectory(tokenizer, "r1", 0.0, rewritten=True)])
    main(["view", "--path", str(dump), "--tokenizer", str(tiny_model_dir)])
    assert capsys.readouterr().out.strip() == f"wrote {dump / 'view.html'}"
    page = (dump / "view.html").read_text()
    sections = page.split("<section>")[1:]
    assert [re.search(r"rollout (\w+)", s).group(1) for s in sections] == ["r0", "r1"]
    assert "step_000001.jsonl" in sections[0] and "reward 1 " in sections[0] and "versions [3]" in sections[0]
    assert sections[1].count("history rewritten") == 1
    assert "<b>" not in page.split("</style>")[1]  # text is escaped (checked in full below)
    n_context, n_answer = len(tokenizer.encode("What is <b>2+2</b>?\n")), len(tokenizer.encode("4"))
    assert sections[0].count("<span class=c ") == n_context
    assert sections[0].count("<span class=a ") == n_answer
    assert "logprob -1.3863 · p 0.250 · version 3" in sections[0]
    text = re.sub(r"<[^>]+>", "", sections[0].split("</h2>")[1])
    assert text.replace("\u21b5", "") == "What is &lt;b&gt;2+2&lt;/b&gt;?\n4"  # every token shown once, in order

    main(["view", "--path", str(dump / "step_000002.jsonl"), "--tokenizer", str(tiny_model_dir),
          "--out", str(tmp_path / "one.html"), "--limit", "1"])
    assert (tmp_path / "one.html").read_text().count("<section>") == 1


def test_view_says_what_is_missing(tmp_path, tiny_model_dir):
    with pytest.raises(SystemExit, match="no rollout dump at"):
        main(["view", "--path", str(tmp_path), "--tokenizer", str(tiny_model_dir)])
    with pytest.raises(SystemExit, match="--path .* and --tokenizer .* are required"):
        main(["view", "--path", str(tmp_path)])


def test_view_shows_multi_byte_characters_whole(tmp_path, tiny_model_dir):
    """The tiny tokenizer is byte-level BPE: a CJK character or an emoji is several tokens, none of
    which decodes to text alone."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    context, answer = tokenizer.encode("Say 中文 and é: "), tokenizer.encode("ok 🙂!")
    assert "\ufffd" in tokenizer.decode(answer[-2:-1])  # a lone byte of the emoji
    seg = Sample(context + answer, [0] * len(context) + [1] * len(answer),
                 [0.0] * len(context) + [math.log(0.5)] * len(answer), [-1] * len(context) + [2] * len(answer))
    write_jsonl(str(tmp_path / "step_000001.jsonl"), [Trajectory([seg], reward=1.0, score=None, rollout_id="r0",
                                                                 prompt_index=0, finish_reason="stop")])
    page = write_view(tmp_path, str(tiny_model_dir)).read_text(encoding="utf-8")
    assert "\ufffd" not in page
    body = page.split("</h2>")[1]
    assert re.sub(r"<[^>]+>", "", body).strip() == "Say 中文 and é: ok 🙂!"
    emoji_ids = tokenizer.encode("🙂")
    emoji = re.search(r"<span class=a [^>]*title='([^']*)'>🙂</span>", body)
    n = len(emoji_ids)  # its bytes are one span: ids listed, logprob and probability of the whole character
    assert emoji.group(1) == (f"ids {' '.join(map(str, emoji_ids))} · logprob {n * math.log(0.5):.4f} · "
                              f"p {0.5 ** n:.3f} · version 2")
    assert body.count("<span class=a ") == len(answer) - n + 1
