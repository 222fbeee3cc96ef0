"""Real streaming over HTTP with the stock SDKs, on the embedded engine and the tiny (random) model: text
arrives while the engine still samples the turn, adds up to the non-streamed text of the same seed, and
the transcript records the same tokens; a client that hangs up mid-stream cancels its engine request."""

import asyncio
import contextlib

import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from instar.agents import ChatServer, SamplingParams
from instar.agents.live import Delta, LiveText
from instar.agents.transcript import Turn
from instar.data.chat import encode
from instar.data.tool_calls import parser_named
from instar.engines import EmbeddedEngine
from instar.engines.protocol import Sampled

SEEDED = SamplingParams(temperature=1.0, max_tokens=120, seed=2)
PROMPT = [{"role": "user", "content": "Write a long story."}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@contextlib.asynccontextmanager
async def serving(tiny_model_dir, tok):
    engine = EmbeddedEngine.from_pretrained(tiny_model_dir)
    try:
        async with ChatServer(engine, tok, model_name="tiny", max_len=1024, max_new_tokens=512) as server:
            yield server, engine
    finally:
        await engine.close()


def in_flight(engine) -> bool:
    return engine.load().running == 1


async def openai_text(session, engine, stream: bool) -> tuple[str, int]:
    """The turn's text, and how many text deltas arrived while the engine still ran the request."""
    client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    if not stream:
        reply = await client.chat.completions.create(model="tiny", messages=PROMPT)
        await client.close()
        return reply.choices[0].message.content, 0
    text, early = "", 0
    async for chunk in await client.chat.completions.create(model="tiny", messages=PROMPT, stream=True):
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            text, early = text + piece, early + in_flight(engine)
    await client.close()
    return text, early


async def anthropic_text(session, engine, stream: bool) -> tuple[str, int]:
    client = AsyncAnthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0)
    kwargs = dict(model="tiny", max_tokens=120, messages=PROMPT)
    if not stream:
        reply = await client.messages.create(**kwargs)
        await client.close()
        return reply.content[0].text, 0
    early = 0
    async with client.messages.stream(**kwargs) as events:
        async for event in events:
            early += event.type == "text" and in_flight(engine)
        text = (await events.get_final_message()).content[0].text
    await client.close()
    return text, early


async def responses_text(session, engine, stream: bool) -> tuple[str, int]:
    client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    kwargs = dict(model="tiny", input=PROMPT)
    if not stream:
        reply = await client.responses.create(**kwargs)
        await client.close()
        return reply.output_text, 0
    early, deltas = 0, []
    async with client.responses.stream(**kwargs) as events:
        async for event in events:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
                early += in_flight(engine)
    await client.close()
    assert event.type == "response.incomplete" and event.response.output_text == "".join(deltas)  # max tokens
    return "".join(deltas), early


@pytest.mark.asyncio
@pytest.mark.parametrize("protocol", [openai_text, anthropic_text, responses_text])
async def test_streamed_text_arrives_while_sampled_and_records_the_same_tokens(tiny_model_dir, tok, protocol):
    async with serving(tiny_model_dir, tok) as (server, engine):
        plain, streamed = server.open(SEEDED), server.open(SEEDED)
        text, _ = await protocol(plain, engine, stream=False)
        streamed_text, early = await protocol(streamed, engine, stream=True)
    [want], [got] = plain.transcript.segments, streamed.transcript.segments
    assert (got.token_ids, got.action_mask, got.rollout_logprobs) == (
        want.token_ids, want.action_mask, want.rollout_logprobs)
    assert sum(want.action_mask) == 120  # the seed's turn runs to max_tokens: a long stream
    assert streamed_text == text
    assert early > 10  # many deltas came while the engine still had the request


@pytest.mark.asyncio
async def test_a_client_that_hangs_up_mid_stream_cancels_its_engine_request(tiny_model_dir, tok):
    async with serving(tiny_model_dir, tok) as (server, engine):
        session = server.open(SamplingParams(temperature=1.0, max_tokens=500, seed=40))
        client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        stream = await client.chat.completions.create(model="tiny", messages=PROMPT, stream=True)
        async for chunk in stream:
            if chunk.choices[0].delta.content:
                break
        await engine.pause("keep")  # frozen mid-turn: it cannot finish before the hang-up reaches it
        [request] = engine._running
        sampled = engine.stats["sampled_tokens"]
        await stream.close()
        for _ in range(500):
            if request.future.cancelled():
                break
            await asyncio.sleep(0.01)
        assert request.future.cancelled()
        await engine.resume()
        for _ in range(500):
            if engine.load().total == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.load().total == 0 and request.finish_reason == "abort"
        assert sampled < 500 and engine.stats["sampled_tokens"] == sampled
        await client.close()
    assert session.transcript.segments == []


def feed(tok, text: str, live: LiveText) -> list[list[Delta]]:
    """``text``'s ids, one token at a time: the deltas after each."""
    return [live.add([1, 2], Sampled(i, [t])) for i, t in enumerate(encode(tok, text))]


def joined(deltas: list[Delta], kind: str) -> str:
    return "".join(d.text for d in deltas if d.kind == kind)


def test_text_deltas_hold_back_split_characters_tool_calls_and_open_reasoning(tok):
    text = "héllo 世界 🎉 ok"
    ids = encode(tok, text)
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))  # characters split across ids
    live = LiveText(tok)
    steps = feed(tok, text, live)
    assert all("\ufffd" not in d.text for step in steps for d in step)
    assert joined([d for step in steps for d in step], "content") == text

    call = '<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>'
    text = "<think>\nplan it\n</think>\n\nAnswer: é \n" + call
    live = LiveText(tok)
    steps = feed(tok, text, live)
    sent = [d for step in steps for d in step]
    closing = next(i for i, step in enumerate(steps) if any(d.kind == "reasoning" for d in step))
    assert encode(tok, text)[closing] in encode(tok, "</think>")  # reasoning waits for its end, then whole
    assert [d.text for d in sent if d.kind == "reasoning"] == ["plan it"]
    assert joined(sent, "content") == "Answer: é"  # nothing of the call, no trailing space
    content, calls = parser_named("hermes").split(text)
    rest = live.rest(Turn({"role": "assistant", "content": content}, text, [], "stop", 0))
    assert rest == [] and calls == [{"name": "calc", "arguments": {"x": 1}}]

    live = LiveText(tok)  # sent text that the finished turn does not begin with is an error: here content
    feed(tok, "plan</think>answer", live)  # streamed before the model closed a block it never opened
    with pytest.raises(RuntimeError, match="closed a reasoning block it never opened"):
        live.rest(Turn({"role": "assistant", "content": "plan</think>answer"}, "plan</think>answer", [], "stop", 0))
