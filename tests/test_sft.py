"""SFT: assistant spans read from the chat template, and `run_sft` learning a small synthetic task."""

import json
import random

import pytest
from transformers import AutoTokenizer

from instar.config import ActorConfig, CkptConfig, FSDPConfig, SFTConfig, SFTSection, TrainConfig
from instar.data.sft import TemplateError, conversation_sample, load_sft_samples, tokenize_conversation
from instar.train import checkpoint
from instar.train.sft import run_sft

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "add 2 3"},
        {"role": "assistant", "content": "5"}, {"role": "user", "content": "and 4 4?"},
        {"role": "assistant", "content": "8"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_assistant_spans_come_from_the_template(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CHAT)
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    trained = [tokenizer.decode([i]) for i, m in zip(ids, mask) if m]
    assert trained == ["5", "<|im_end|>", "\n", "8", "<|im_end|>", "\n"]
    assert tokenizer.decode(ids[: mask.index(1)]).endswith("<|im_start|>assistant\n")


def test_truncation_and_conversations_without_assistant_tokens(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CHAT)
    first = mask.index(1)
    short = conversation_sample(tokenizer, CHAT, max_len=first + 2)
    assert short.token_ids == ids[: first + 2] and short.action_mask[-2:] == [1, 1]
    assert short.versions[first] == 0 and short.versions[0] == -1 and short.rollout_logprobs[first] == 0.0
    assert conversation_sample(tokenizer, CHAT, max_len=first) is None


def test_a_template_that_rewrites_history_is_rejected(tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    # renders only the last message: a later prefix does not extend an earlier one
    tokenizer.chat_template = "{{ messages[-1].role }}: {{ messages[-1].content }}\n"
    with pytest.raises(TemplateError, match="does not render message 1 as an extension"):
        tokenize_conversation(tokenizer, CHAT[1:3])


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
                    sft=SFTSection(dataset=str(tmp_path / "task.jsonl"), batch_size=16, epochs=3, eval_fraction=0.2),
                    fsdp=FSDPConfig(num_ranks=1), train=TrainConfig(max_tokens_per_gpu=128),
                    ckpt=CkptConfig(output_dir=str(tmp_path / "out")))
    last = run_sft(cfg)
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(16))  # 80 training conversations / 16 = 5 steps x 3 epochs
    first_eval = lines[0]["eval/loss"]
    assert 5.5 < first_eval < 6.5  # about ln(512): the random model knows nothing
    assert last["eval/loss"] < 0.5 * first_eval
    assert checkpoint.latest(str(tmp_path / "out" / "checkpoints")).endswith("step_15")
    assert (tmp_path / "out" / "hf" / "model.safetensors").exists()
