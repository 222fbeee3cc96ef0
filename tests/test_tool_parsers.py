"""Each tool-call format (--data.tool_parser) round-trips through the real chat server: a tiny model
fine-tuned to write its calls in that format (with a chat template that writes them back the same way),
the stock OpenAI and Anthropic SDKs, streaming or not: the calls come back parsed, the tool result
continues the same segment, and the recorded ids are exactly the sampled ones plus the template delta."""

from types import SimpleNamespace

import pytest
from helpers.agents import (
    CALCULATOR,
    CALL,
    GREEDY,
    USER,
    anthropic_tool_round_trip,
    openai_tool_round_trip,
    scripted_model_dir,
    serving,
)
from openai import AsyncOpenAI

from instar.data.chat import encode, prompt_ids
from instar.data.tool_calls import PARSERS

# ChatML frames (the tiny tokenizer's special tokens); the calls and tool results in each family's own form.
FRAME = ("{% if tools %}<|im_start|>system{{ '\\n' }}Tools:{% for t in tools %} {{ t | tojson }}{% endfor %}"
         "<|im_end|>{{ '\\n' }}{% endif %}"
         "{% for message in messages %}"
         "{% if message.role in ('user', 'system') %}<|im_start|>{{ message.role }}{{ '\\n' }}{{ message.content }}"
         "<|im_end|>{{ '\\n' }}"
         "{% elif message.role == 'assistant' %}<|im_start|>assistant{{ '\\n' }}{{ message.content or '' }}"
         "{% for tc in message.tool_calls or [] %}{% set f = tc.function if tc.function is defined else tc %}"
         "{% set args = f.arguments if f.arguments is string else f.arguments | tojson %}CALL{% endfor %}"
         "<|im_end|>{{ '\\n' }}"
         "{% elif message.role == 'tool' %}RESULT{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}")
FORMATS = {
    "llama3_json": (
        "{% if loop.first %}<|python_tag|>{% else %}; {% endif %}"
        '{"name": "{{ f.name }}", "parameters": {{ args }}}',
        "<|im_start|>ipython{{ '\\n' }}{{ message.content }}<|im_end|>{{ '\\n' }}",
        '<|python_tag|>{"name": "calculator", "parameters": {"expression": "2+3"}}',
        "\n<|im_start|>ipython\n5<|im_end|>\n<|im_start|>assistant\n"),
    "mistral": (
        "{% if loop.first %}[TOOL_CALLS][{% else %}, {% endif %}"
        '{"name": "{{ f.name }}", "arguments": {{ args }}}{% if loop.last %}]{% endif %}',
        "[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]",
        '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "2+3"}}]',
        "\n[TOOL_RESULTS]5[/TOOL_RESULTS]<|im_start|>assistant\n"),
}
SCRIPT = [([CALCULATOR], [USER, CALL, {"role": "tool", "content": "5"},
                          {"role": "assistant", "content": "The answer is 5."}])]


def test_every_parser_round_trips_here_or_as_the_default():
    """hermes is the tiny tokenizer's own format (tests/test_agents_server.py); every other one has a FORMATS row."""
    assert set(PARSERS) == {"hermes", *FORMATS}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def fmt(request, tmp_path_factory):
    from transformers import AutoTokenizer

    call, result, sampled, delta = FORMATS[request.param]
    template = FRAME.replace("CALL", call).replace("RESULT", result)
    path = scripted_model_dir(tmp_path_factory, SCRIPT, template, f"tool_format_{request.param}")
    return SimpleNamespace(name=request.param, path=path, tokenizer=AutoTokenizer.from_pretrained(path),
                           sampled=sampled, delta=delta)


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_openai_calls_in_each_format_parse_and_continue_the_segment(fmt, stream):
    tok = fmt.tokenizer
    async with serving(fmt, tool_parser=fmt.name) as (server, engine):
        session = server.open(GREEDY)
        first, second = await openai_tool_round_trip(session, stream)
    assert first["content"] is None and first["finish"] == "tool_calls"
    assert first["tool_calls"] == [{"id": "call_0_0", "type": "function", "function": {
        "name": "calculator", "arguments": '{"expression": "2+3"}'}}]
    assert second["content"] == "The answer is 5." and second["finish"] == "stop"
    [seg] = session.transcript.segments
    gens = [gen.token_ids for _, gen, _ in engine.calls]
    assert gens[0] == encode(tok, fmt.sampled) + [tok.eos_token_id]
    prompt = engine.calls[0][0]
    assert prompt == prompt_ids(tok, [USER], [CALCULATOR])
    assert seg.token_ids == prompt + gens[0] + encode(tok, fmt.delta) + gens[1]


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_tool_use_in_each_format(fmt, stream):
    async with serving(fmt, tool_parser=fmt.name) as (server, _):
        session = server.open(GREEDY)
        first, second = await anthropic_tool_round_trip(session, stream)
    assert first.stop_reason == "tool_use"
    assert [b.model_dump(exclude_none=True) for b in first.content] == [
        {"type": "tool_use", "id": "call_0_0", "name": "calculator", "input": {"expression": "2+3"}}]
    assert [b.text for b in second.content] == ["The answer is 5."]
    assert len(session.transcript.segments) == 1


@pytest.mark.asyncio
async def test_the_default_parser_leaves_another_formats_call_as_text(fmt):
    async with serving(fmt) as (server, _):  # hermes: the call is not recognised, the turn is plain text
        session = server.open(GREEDY)
        client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        reply = await client.chat.completions.create(model="tiny", messages=[USER], tools=[CALCULATOR])
        await client.close()
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == fmt.sampled
