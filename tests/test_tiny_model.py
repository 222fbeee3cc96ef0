"""The tiny-model kit: byte-identical builds, offline loading, and the ChatML tool template."""

import hashlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from instar.cli.main import main
from instar.data.tiny_model import TinySpec, build_tiny_model


def digest(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_same_arguments_give_byte_identical_files(tmp_path, tiny_model_dir):
    again = build_tiny_model(tmp_path / "again", TinySpec())
    assert digest(again) == digest(tiny_model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(digest(again))
    other = build_tiny_model(tmp_path / "other", TinySpec(seed=1))
    assert digest(other)["model.safetensors"] != digest(tiny_model_dir)["model.safetensors"]
    assert digest(other)["tokenizer.json"] == digest(tiny_model_dir)["tokenizer.json"]


def test_cli_builds_what_the_function_builds(tmp_path, tiny_moe_dir):
    main(["tiny-model", "--out", str(tmp_path / "m"), "--moe"])  # bare boolean flag, dashes accepted
    assert digest(tmp_path / "m") == digest(tiny_moe_dir)
    with pytest.raises(SystemExit, match="--head-dim must be >= 32"):
        main(["tiny-model", "--out", str(tmp_path / "bad"), "--head-dim", "16"])


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_moe_dir"])
def test_load_round_trip_logits_equal(fixture, request, tmp_path):
    path = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([[1, 40, 41, 42, 7, 300, 2]])
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(tmp_path / "resaved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved").eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, logits)
    assert logits.shape == (1, 7, 512)
    assert type(model).__name__ == ("Qwen3MoeForCausalLM" if "moe" in fixture else "Qwen3ForCausalLM")


def test_tokenizer_specials_and_digits(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == 512
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for special in ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]:
        assert len(tok(special)["input_ids"]) == 1, special
    assert tok.tokenize("123*45") == ["1", "2", "3", "*", "4", "5"]
    text = "What is 12*34+5? <tool_call>\n{}\n</tool_call>"
    assert tok.decode(tok(text)["input_ids"]) == text


TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12*34+5?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*34+5"}}}]},
    {"role": "tool", "content": "413"},
    {"role": "assistant", "content": "The answer is 413."},
]
EXPECTED = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call functions. Their signatures are within "
    "<tools></tools>:\n<tools>\n"
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression", '
    '"parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}\n</tools>\n\n'
    "To call one, reply with a JSON object within <tool_call></tool_call> tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWhat is 12*34+5?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34+5"}}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n413\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nThe answer is 413.<|im_end|>\n"
)


def test_chat_template_renders_tool_call_and_result(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False) == EXPECTED


def test_chat_template_variants(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    # OpenAI sends arguments as a JSON string; two calls, then two results grouped in one user turn.
    calls = [{"role": "user", "content": "Go"},
             {"role": "assistant", "content": "Both.", "tool_calls": [
                 {"function": {"name": "a", "arguments": '{"x": 1}'}}, {"function": {"name": "b", "arguments": {}}}]},
             {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    assert tok.apply_chat_template(calls, tokenize=False) == (
        "<|im_start|>user\nGo<|im_end|>\n<|im_start|>assistant\nBoth.\n<tool_call>\n"
        '{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>\n")
