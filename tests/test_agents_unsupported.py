"""Request fields instar would ignore (stop strings, penalties, logit_bias, a forced tool or output format) are
refused in each protocol's own error shape, on traced and untraced routes, through the stock SDKs; the values
frameworks send by default, which ask for nothing, are served."""

import contextlib
import json

import anthropic
import openai
import pytest
from anthropic import AsyncAnthropic
from helpers.agents import CALCULATOR, CALCULATOR_ANTHROPIC, USER, ScriptedEngine
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from instar.agents import ChatServer, SamplingParams


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@contextlib.asynccontextmanager
async def clients(tok, traced=True):
    """An engine that answers "ok", and the OpenAI and Anthropic SDKs on one session's traced or untraced URLs."""
    engine = ScriptedEngine(tok)
    async with ChatServer(engine, tok, model_name="tiny", max_len=4096, max_new_tokens=16) as server:
        session = server.open(SamplingParams(temperature=1.0, max_tokens=16))
        urls = (session.base_url, session.session_url) if traced else (
            session.untraced_base_url, session.untraced_session_url)
        oai = AsyncOpenAI(base_url=urls[0], api_key=session.api_key, max_retries=0)
        ant = AsyncAnthropic(base_url=urls[1], api_key=session.api_key, max_retries=0)
        yield engine, session, oai, ant
        await oai.close()
        await ant.close()


def chat(oai, ant, **fields):
    return oai.chat.completions.create(model="tiny", messages=[USER], **fields)


def messages(oai, ant, **fields):
    return ant.messages.create(model="tiny", max_tokens=8, messages=[USER], **fields)


def responses(oai, ant, **fields):
    return oai.responses.create(model="tiny", input="What is 2+3?", **fields)


FORCED = {"type": "function", "function": {"name": "calculator"}}
FUNCTION = {"type": "function", "name": "calculator", "parameters": {}}  # a Responses API tool
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}


@pytest.mark.asyncio
@pytest.mark.parametrize(("call", "field", "value", "tools", "traced"), [
    (chat, "logit_bias", {"15": 100}, None, True),
    (chat, "logit_bias", {"15": 100}, None, False),  # the engines apply none of these to judge calls either
    (chat, "frequency_penalty", 0.5, None, True),
    (chat, "presence_penalty", -1.0, None, True),
    (chat, "response_format", {"type": "json_object"}, None, True),
    (chat, "response_format", SCHEMA, None, False),
    (chat, "stop", ["\n"], None, True),
    (chat, "tool_choice", "required", [CALCULATOR], True),
    (chat, "tool_choice", FORCED, [CALCULATOR], True),
    (chat, "tool_choice", "none", [CALCULATOR], True),  # forbids the calls the model may still make
    (messages, "stop_sequences", ["\n"], None, True),
    (messages, "tool_choice", {"type": "any"}, [CALCULATOR_ANTHROPIC], True),
    (messages, "tool_choice", {"type": "tool", "name": "calculator"}, [CALCULATOR_ANTHROPIC], False),
    (messages, "tool_choice", {"type": "none"}, [CALCULATOR_ANTHROPIC], True),
    (responses, "tool_choice", "required", [FUNCTION], True),
    (responses, "text", {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}}, None,
     True),
])
async def test_a_field_instar_would_ignore_is_refused_naming_it(tok, call, field, value, tools, traced):
    message = (f"{field}={json.dumps(value)} is not supported: a turn is sampled from the model's own distribution "
               f"up to its end-of-turn token, as the trainer assumes; leave {field} unset")
    async with clients(tok, traced) as (engine, session, oai, ant):
        error = anthropic.BadRequestError if call is messages else openai.BadRequestError
        with pytest.raises(error) as e:
            await call(oai, ant, **{field: value}, **({"tools": tools} if tools else {}))
    if call is messages:
        assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    else:
        assert e.value.body == {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    assert engine.prompts == [] and session.transcript.segments == []


@pytest.mark.asyncio
async def test_the_values_frameworks_send_by_default_are_served(tok):
    neutral = {"logit_bias": {}, "frequency_penalty": 0, "presence_penalty": 0.0, "response_format": {"type": "text"},
               "stop": []}
    async with clients(tok) as (engine, session, oai, ant):
        replies = [
            await chat(oai, ant, tools=[CALCULATOR], tool_choice="auto", **neutral),
            await chat(oai, ant, tool_choice="none", stop=None),  # no tools: forbidding calls asks for nothing
            await messages(oai, ant, tools=[CALCULATOR_ANTHROPIC], tool_choice={"type": "auto"},
                           stop_sequences=[]),
            await messages(oai, ant, tool_choice={"type": "none"}),
            await responses(oai, ant, tools=[FUNCTION], tool_choice="auto", text={"format": {"type": "text"}}),
        ]
    assert [r.choices[0].message.content for r in replies[:2]] == ["ok", "ok"]
    assert [r.content[0].text for r in replies[2:4]] == ["ok", "ok"]
    assert replies[4].output_text == "ok"
    assert len(engine.prompts) == 5
