"""SFT: assistant spans read from the chat template, and `run_sft` learning a small synthetic task."""

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from instar.config import ActorConfig, CkptConfig, FSDPConfig, SFTConfig, SFTSection
from instar.data.chat import load_tokenizer, prompt_ids
from instar.data.sft import TemplateError, conversation_samples, load_sft_samples, tokenize_conversation
from instar.train import checkpoint
from instar.train.sft import run_sft

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "add 2 3"},
        {"role": "assistant", "content": "5"}, {"role": "user", "content": "and 4 4?"},
        {"role": "assistant", "content": "8"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_assistant_spans_come_from_the_template(tokenizer):
    [(ids, mask, end)] = tokenize_conversation(tokenizer, CHAT)
    assert end == len(CHAT)
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    trained = [tokenizer.decode([i]) for i, m in zip(ids, mask) if m]
    assert trained == ["5", "<|im_end|>", "\n", "8", "<|im_end|>", "\n"]
    assert tokenizer.decode(ids[: mask.index(1)]).endswith("<|im_start|>assistant\n")


def test_truncation_and_conversations_without_assistant_tokens(tokenizer):
    [(ids, mask, _)] = tokenize_conversation(tokenizer, CHAT)
    first = mask.index(1)
    [short] = conversation_samples(tokenizer, CHAT, max_len=first + 2)
    assert short.token_ids == ids[: first + 2] and short.action_mask[-2:] == [1, 1]
    assert short.versions[first] == 0 and short.versions[0] == -1 and short.rollout_logprobs[first] == 0.0
    assert conversation_samples(tokenizer, CHAT, max_len=first) == []


def test_a_template_that_does_not_write_a_turn_after_its_generation_prompt_is_rejected(tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    # renders only the last message: the assistant turn does not follow the context it was written in
    tokenizer.chat_template = "{{ messages[-1].role }}: {{ messages[-1].content }}\n"
    with pytest.raises(TemplateError, match="does not render assistant message 1 after its generation prompt"):
        tokenize_conversation(tokenizer, CHAT[1:3])


THINKING = [{"role": "user", "content": "add 2 3"}, {"role": "assistant", "content": "<think>2+3</think>5"},
            {"role": "user", "content": "and 4 4?"}, {"role": "assistant", "content": "8"},
            {"role": "user", "content": "and 1 1?"}, {"role": "assistant", "content": "<think>1+1</think>2"}]


def _runs(sample):
    """A sample's (token ids, trainable) runs, in order."""
    runs = []
    for t, m in zip(sample.token_ids, sample.action_mask):
        if runs and runs[-1][1] == m:
            runs[-1][0].append(t)
        else:
            runs.append(([t], m))
    return runs


def test_a_template_that_drops_earlier_reasoning_splits_the_conversation_where_the_prefix_breaks(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir, str(Path(__file__).parent / "chat_templates" / "drop_reasoning.jinja"))
    # the first turn on its own, then the later turns on the context the template gives them: without its reasoning
    first, second = conversation_samples(tok, THINKING)
    assert [(tok.decode(ids), m) for ids, m in _runs(first)] == [
        ("<|im_start|>user\nadd 2 3<|im_end|>\n<|im_start|>assistant\n", 0), ("<think>2+3</think>5<|im_end|>\n", 1)]
    assert [(tok.decode(ids), m) for ids, m in _runs(second)] == [
        ("<|im_start|>user\nadd 2 3<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
         "<|im_start|>user\nand 4 4?<|im_end|>\n<|im_start|>assistant\n", 0), ("8<|im_end|>\n", 1),
        ("<|im_start|>user\nand 1 1?<|im_end|>\n<|im_start|>assistant\n", 0), ("<think>1+1</think>2<|im_end|>\n", 1)]
    # each turn's context is exactly the prompt the template renders when the model writes that turn
    contexts = []
    for sample in (first, second):
        done = []
        for ids, trainable in _runs(sample):
            contexts += [done] if trainable else []
            done = done + ids
    assert contexts == [prompt_ids(tok, THINKING[:i]) for i in (1, 3, 5)]
    # without reasoning each prefix extends the one before: one sample, as under the kit's template
    plain = [{**m, "content": m["content"].split("</think>")[-1]} for m in THINKING]
    [whole] = conversation_samples(tok, plain)
    [expected] = conversation_samples(load_tokenizer(tiny_model_dir), plain)
    assert (whole.token_ids, whole.action_mask) == (expected.token_ids, expected.action_mask)


def test_load_names_the_missing_key(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"conversation": []}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl': record 0 has no message list under 'messages' "
                                         r"\(columns: \['conv"):
        load_sft_samples(str(path), tokenizer)


def _write_task(path, n: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            a = rng.randint(10, 99)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"echo {a}"},
                                             {"role": "assistant", "content": f"The number is {a}."}]}) + "\n")


def test_sft_lowers_held_out_loss(tiny_model_dir, tmp_path):
    _write_task(tmp_path / "task.jsonl", 100)
    cfg = SFTConfig(actor=ActorConfig(model_name_or_path=str(tiny_model_dir), learning_rate=3e-3, lr_warmup_steps=2),
                    sft=SFTSection(dataset=str(tmp_path / "task.jsonl"), batch_size=16, epochs=3, eval_fraction=0.2,
                                   max_tokens_per_gpu=128), fsdp=FSDPConfig(num_ranks=1),
                    ckpt=CkptConfig(output_dir=str(tmp_path / "out")))
    last = run_sft(cfg)
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(16))  # 80 training conversations / 16 = 5 steps x 3 epochs
    first_eval = lines[0]["eval/loss"]
    assert 5.5 < first_eval < 6.5  # about ln(512): the random model knows nothing
    assert last["eval/loss"] < 0.5 * first_eval
    assert checkpoint.latest(str(tmp_path / "out" / "checkpoints")).endswith("step_15")
    assert (tmp_path / "out" / "hf" / "model.safetensors").exists()
