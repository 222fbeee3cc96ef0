"""Chat-template deltas, tool-call parsing and token pieces (instar/data/chat.py) on the tiny tokenizer."""

import pytest
from transformers import AutoTokenizer

from instar.data.chat import continuation_text, encode, prompt_messages, render
from instar.data.tool_calls import parser_named

END = "<|im_end|>"
USER = {"role": "user", "content": "What is 2+3?"}
ANSWER = {"role": "assistant", "content": "The answer is 5."}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}]}
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_delta_after_a_stopped_turn_is_the_template_text_after_the_end_token(tok):
    new = [USER, ANSWER, {"role": "user", "content": "Thanks"}]
    delta = continuation_text(tok, [USER, ANSWER], new, None, END, ended=True)
    assert delta == "\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n"
    # Appending the delta to the prompt and the turn as sampled gives the whole conversation.
    before = render(tok, [USER], generation_prompt=True)
    assert before + "The answer is 5." + END + delta == render(tok, new, generation_prompt=True)


def test_delta_after_a_cut_off_turn_starts_with_the_templates_own_end_token(tok):
    delta = continuation_text(tok, [USER, ANSWER], [USER, ANSWER, USER], None, END, ended=False)
    assert delta == "<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"


def test_delta_after_a_tool_call_renders_the_tool_result_as_the_template_does(tok):
    new = [USER, CALL, {"role": "tool", "content": "5"}, {"role": "tool", "content": "6"}]
    delta = continuation_text(tok, [USER, CALL], new, TOOLS, END, ended=True)
    assert delta == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n"
                     "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert encode(tok, delta)[:3] == encode(tok, "\n<|im_start|>user")


def test_no_delta_when_history_is_rewritten_or_not_extended(tok):
    assert continuation_text(tok, [USER, ANSWER], [{"role": "user", "content": "Summary"}, USER], None,
                             END, True) is None
    assert continuation_text(tok, [USER, ANSWER], [USER, ANSWER], None, END, True) is None
    assert continuation_text(tok, [USER], [USER, USER], None, END, True) is None  # history must end with a turn


def test_a_template_that_drops_earlier_reasoning_breaks_the_prefix_and_gets_no_delta(tok):
    # A Qwen3-style template: reasoning is shown only in an assistant turn that is still the last one.
    dropping = tok.chat_template.replace(
        "<|im_start|>assistant\n{{ message.content or '' }}",
        "<|im_start|>assistant\n{{ (message.content or '') if loop.last else "
        "(message.content or '').split('</think>')[-1].lstrip() }}")
    assert dropping != tok.chat_template
    tok2 = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok2.chat_template = dropping
    thought = {"role": "assistant", "content": "<think>2 plus 3</think>5"}
    assert continuation_text(tok2, [USER, thought], [USER, thought, USER], None, END, True) is None
    # without reasoning, or with the template that keeps it, the old conversation is a prefix: a delta
    again = "\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert continuation_text(tok2, [USER, ANSWER], [USER, ANSWER, USER], None, END, True) == again
    assert continuation_text(tok, [USER, thought], [USER, thought, USER], None, END, True) == again


def test_hermes_parser_takes_well_formed_calls_and_leaves_the_rest_in_the_content():
    parse = parser_named("hermes").split
    text = ('Let me check.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
            '\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "4*5"}}\n</tool_call>')
    assert parse(text) == ("Let me check.", [
        {"name": "calculator", "arguments": {"expression": "2+3"}},
        {"name": "calculator", "arguments": {"expression": "4*5"}}])
    broken = '<tool_call>\n{"name": "calculator", "arguments": {\n</tool_call>'
    assert parse(broken) == (broken, [])
    not_object = '<tool_call>["calculator"]</tool_call> <tool_call>{"name": "f", "arguments": [1]}</tool_call>'
    assert parse(not_object) == (not_object, [])
    assert parse('<tool_call>{"name": "f"}</tool_call>') == ("", [{"name": "f", "arguments": {}}])
    assert parse("The answer is 5.") == ("The answer is 5.", [])


def test_llama3_json_calls_take_parameters_or_arguments_after_the_python_tag_separated_by_semicolons():
    def parse(text):
        return parser_named("llama3_json").split(text)

    two = ('<|python_tag|>{"name": "calc", "parameters": {"e": "2+3", "nested": {"a": [1, {"b": 2}]}}}; '
           '{"name": "search", "arguments": {"q": "x"}}')
    assert parse(two) == ("", [{"name": "calc", "arguments": {"e": "2+3", "nested": {"a": [1, {"b": 2}]}}},
                               {"name": "search", "arguments": {"q": "x"}}])
    assert parse('Sure. {"name": "f", "parameters": {}}') == ("Sure.", [{"name": "f", "arguments": {}}])
    for plain in ("The set {1, 2} has two elements.", '{"x": 1} is not a call', '{"name": "f", "parameters": 3}',
                  '<|python_tag|>{"name": "calc", "parameters": {"e": '):
        assert parse(plain) == (plain, [])
    # an object's inner objects are never calls of their own, inside a call or not
    assert parse('{"name": "f", "arguments": {"inner": {"name": "g", "arguments": {}}}}') == (
        "", [{"name": "f", "arguments": {"inner": {"name": "g", "arguments": {}}}}])
    wrapped = '{"result": {"name": "g", "arguments": {}}}'
    assert parse(wrapped) == (wrapped, [])


def test_mistral_calls_as_a_json_list_or_name_args_blocks_and_a_broken_block_leaves_the_turn_as_text():
    def parse(text):
        return parser_named("mistral").split(text)

    listed = 'Let me look. [TOOL_CALLS][{"name": "calc", "arguments": {"e": "2+3"}}, {"name": "f", "arguments": {}}]'
    assert parse(listed) == ("Let me look.", [{"name": "calc", "arguments": {"e": "2+3"}},
                                              {"name": "f", "arguments": {}}])
    named = '[TOOL_CALLS]calc[ARGS]{"e": "2+3"}[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    assert parse(named) == ("", [{"name": "calc", "arguments": {"e": "2+3"}},
                                 {"name": "get_weather", "arguments": {"city": "Paris"}}])
    for broken in ('[TOOL_CALLS][{"name": "calc", "arguments": {', '[TOOL_CALLS][{"arguments": {}}]',
                   '[TOOL_CALLS]calc[ARGS][1, 2]', "no calls here", '{"name": "f", "arguments": {}}'):
        assert parse(broken) == (broken, [])


def test_a_tool_parser_is_named_as_vllm_names_it_and_the_flag_offers_exactly_these():
    import typing

    from instar.config import DataConfig
    from instar.data.tool_calls import PARSERS, parser_named

    flag = typing.get_type_hints(DataConfig)["tool_parser"]
    assert set(typing.get_args(flag)) == set(PARSERS)  # each round-trips in tests/test_tool_parsers.py
    with pytest.raises(ValueError, match="unknown tool parser 'pythonic': one of hermes, llama3_json, mistral"):
        parser_named("pythonic")


def test_prompt_messages_wraps_strings_and_prepends_the_system_prompt_once():
    assert prompt_messages("Hi") == [{"role": "user", "content": "Hi"}]
    assert prompt_messages("Hi", "Be brief.") == [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hi"}]
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "Hi"}]
    assert prompt_messages(own, "Be brief.") == own
