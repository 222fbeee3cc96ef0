"""The chat server's edges, on a scripted engine that answers every turn with the same ids: a failed
turn records nothing, traced routes keep the session's sampling, bad bodies get each protocol's 4xx,
a client that hangs up cancels its engine request, and a large request does not stall the others."""

import asyncio
import contextlib
import copy
import time

import httpx
import pytest
from helpers.agents import USER, ScriptedEngine
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from instar.agents import ChatServer, SamplingParams
from instar.data.chat import encode, prompt_ids


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@contextlib.asynccontextmanager
async def serving(tok, **limits):
    engine = ScriptedEngine(tok)
    async with ChatServer(engine, tok, model_name="tiny", max_len=4096, max_new_tokens=16, **limits) as server:
        session = server.open(SamplingParams(temperature=1.0, top_p=1.0, max_tokens=16))
        async with httpx.AsyncClient(base_url=server.root, headers={"x-api-key": session.api_key},
                                     timeout=30) as http:
            yield server, engine, session, http


def openai_error(message, status_type="invalid_request_error"):
    return {"error": {"message": message, "type": status_type, "param": None, "code": None}}


def anthropic_error(message, kind="invalid_request_error"):
    return {"type": "error", "error": {"type": kind, "message": message}}


@pytest.mark.asyncio
async def test_a_turn_the_engine_fails_records_nothing_and_the_sdk_retry_records_it_once(tok):
    async with serving(tok) as (server, engine, session, _):
        client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=1)
        engine.fail = 1  # the first turn: before the fix, the retry raised IndexError
        first = await client.chat.completions.create(model="tiny", messages=[USER])
        messages = [USER, {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "Check it."}]
        engine.fail = 1  # a later turn: before the fix, the retry sampled on the delta twice
        await client.chat.completions.create(model="tiny", messages=messages)
        await client.close()
    prompt = prompt_ids(tok, [USER])
    delta = encode(tok, "\n<|im_start|>user\nCheck it.<|im_end|>\n<|im_start|>assistant\n")
    reply = engine.reply
    assert engine.prompts == [prompt, prompt, prompt + reply + delta, prompt + reply + delta]
    [seg] = session.transcript.segments
    assert seg.token_ids == prompt + reply + delta + reply
    assert seg.action_mask == [0] * len(prompt) + [1] * len(reply) + [0] * len(delta) + [1] * len(reply)
    assert seg.versions == [-1] * len(prompt) + [7] * len(reply) + [-1] * len(delta) + [7] * len(reply)


@pytest.mark.asyncio
async def test_an_engine_error_is_a_500_in_each_protocols_json_shape(tok):
    async with serving(tok) as (_, engine, session, http):
        engine.fail = 2
        r = await http.post(f"/s/{session.id}/v1/chat/completions", json={"model": "tiny", "messages": [USER]})
        assert r.status_code == 500 and r.json() == openai_error(
            "internal error: RuntimeError: engine connection lost", "server_error")
        r = await http.post(f"/s/{session.id}/v1/messages", json={"model": "tiny", "max_tokens": 8, "messages": [USER]})
        assert r.status_code == 500 and r.json() == anthropic_error(
            "internal error: RuntimeError: engine connection lost", "api_error")
    assert session.transcript.segments == []


@pytest.mark.asyncio
async def test_traced_routes_refuse_sampling_that_differs_from_the_sessions_untraced_routes_take_it(tok):
    why = ("a traced turn is trained on, and the trainer recomputes its logprobs with the session's sampling "
           "(--rollout.temperature and friends): leave these unset or equal to the session's, or send this "
           "request to the untraced URL (ctx.untraced_base_url / ctx.untraced_session_url)")
    async with serving(tok) as (_, engine, session, http):
        r = await http.post(f"/s/{session.id}/v1/chat/completions",
                            json={"model": "tiny", "messages": [USER], "temperature": 0.7, "top_p": 0.9})
        assert r.status_code == 400 and r.json() == openai_error(
            f"temperature=0.7 differs from this session's 1.0; top_p=0.9 differs from this session's 1.0: {why}")
        r = await http.post(f"/s/{session.id}/v1/messages",
                            json={"model": "tiny", "max_tokens": 8, "messages": [USER], "top_k": 5})
        assert r.status_code == 400 and r.json() == anthropic_error(
            f"top_k=5 differs from this session's -1: {why}")
        assert engine.prompts == []
        # The session's own values, sent explicitly as SDKs often do, and any max_tokens or seed are fine.
        r = await http.post(f"/s/{session.id}/v1/chat/completions", json={
            "model": "tiny", "messages": [USER], "temperature": 1.0, "top_p": 1, "max_tokens": 5, "seed": 3})
        assert r.status_code == 200
        r = await http.post(f"/u/{session.id}/v1/messages", json={
            "model": "tiny", "max_tokens": 8, "messages": [USER], "temperature": 0.2, "top_k": 5})
        assert r.status_code == 200
    # a turn samples from a seed derived from the request's and the turn's index (`SamplingParams.derived`)
    assert [(p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) for p in engine.params] == [
        (1.0, 1.0, -1, 5, SamplingParams(seed=3).derived(0).seed), (0.2, 1.0, 5, 8, None)]


@pytest.mark.asyncio
@pytest.mark.parametrize(("field", "value", "message"), [
    ("seed", 2**64, "seed: Input should be less than 9223372036854775808"),
    ("temperature", 2.5, "temperature: Input should be less than or equal to 2"),
    ("max_tokens", 2**40, "max_tokens: Input should be less than or equal to 2147483647"),
])
async def test_numeric_fields_are_bounded(tok, field, value, message):
    async with serving(tok) as (_, engine, session, http):
        r = await http.post(f"/u/{session.id}/v1/chat/completions",
                            json={"model": "tiny", "messages": [USER], field: value})
    assert r.status_code == 400 and r.json() == openai_error(f"invalid request body: {message}")
    assert engine.prompts == []


BAD_BODIES = [  # (route, body, status, message): each was a plain-text 500 (or went unchecked) before
    ("chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "invalid request body: Invalid JSON: unexpected end of hex escape at line 1 column 67"),
    ("chat/completions", b'{"model": "\\udc00x", "messages": []}', 400,
     "invalid request body: Invalid JSON: lone leading surrogate in hex escape at line 1 column 17"),
    ("messages", b'{"model": "tiny", "max_tokens": 8, "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400,
     "invalid request body: Invalid JSON: recursion limit exceeded at line 1 column 248"),
    ("chat/completions", {"model": "tiny", "messages": [USER, {"role": "assistant", "tool_calls": "calc"}]}, 400,
     "invalid request body: messages.1.tool_calls: Input should be a valid array"),
    ("chat/completions", {"model": "tiny", "messages": [USER, {"role": "assistant", "tool_calls": [
        {"function": {"name": "calc", "arguments": "[1, 2]"}}]}, USER]}, 400,
     "messages[1]: tool call arguments must be a JSON object, got [1, 2]"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     400, "invalid request body: messages.0.content.str: Input should be a valid string; "
          "messages.0.content.list[tagged-union[TextPart,ImageURLPart]].0.text.text: Input should be a valid string"),
    ("messages", {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     400, "invalid request body: messages.0.content.str: Input should be a valid string; messages.0.content."
          "list[tagged-union[TextPart,ImageBlock,ToolUse,ToolResult,Thinking,RedactedThinking]].0.image.source: "
          "Field required"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("route", "body", "status", "message"), BAD_BODIES)
async def test_bad_bodies_get_a_4xx_naming_the_problem(tok, route, body, status, message):
    async with serving(tok) as (_, engine, session, http):
        content = body if isinstance(body, bytes) else None
        r = await http.post(f"/s/{session.id}/v1/{route}", content=content,
                            json=None if content else body)
    shape = anthropic_error if route == "messages" else openai_error
    assert (r.status_code, r.json()) == (status, shape(message))
    assert engine.prompts == []


@pytest.mark.asyncio
async def test_a_body_over_the_limit_is_a_413_with_or_without_content_length(tok):
    async with serving(tok, max_body_bytes=1000) as (_, engine, session, http):
        big = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * 1000}]}
        r = await http.post(f"/s/{session.id}/v1/messages", json=big)
        assert r.status_code == 413 and r.json() == anthropic_error(
            "the request body is over 1000 bytes, the limit of this chat server", "request_too_large")

        async def chunked():  # no Content-Length: the limit counts what arrives
            yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
            yield b"x" * 1000
            yield b'"}]}'
        r = await http.post(f"/s/{session.id}/v1/chat/completions", content=chunked())
        assert r.status_code == 413 and r.json() == openai_error(
            "the request body is over 1000 bytes, the limit of this chat server")
        r = await http.post(f"/s/{session.id}/v1/chat/completions", json={"model": "tiny", "messages": [USER]})
        assert r.status_code == 200
    assert len(engine.prompts) == 1


@pytest.mark.asyncio
async def test_a_template_error_is_a_400_with_the_templates_message(tok):
    strict = copy.deepcopy(tok)
    strict.chat_template = ("{% if messages[-1].content == 'boom' %}"
                            "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                            + tok.chat_template)
    async with serving(strict) as (_, engine, session, http):
        r = await http.post(f"/s/{session.id}/v1/chat/completions",
                            json={"model": "tiny", "messages": [{"role": "user", "content": "boom"}]})
    assert r.status_code == 400 and r.json() == openai_error(
        "the chat template rejected these messages: Conversation roles must alternate user/assistant")
    assert engine.prompts == []


@pytest.mark.asyncio
async def test_sessions_are_capped_per_server(tok):
    async with serving(tok, max_sessions=2) as (server, _, session, _):
        other = server.open()
        with pytest.raises(RuntimeError, match=r"^2 chat sessions are open on this agent runner, the cap: close"):
            server.open()
        server.close(other)
        server.open()


@pytest.mark.asyncio
async def test_a_client_that_hangs_up_cancels_its_engine_request(tok):
    async with serving(tok) as (_, engine, session, http):
        engine.hang = True
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"/s/{session.id}/v1/chat/completions", json={"model": "tiny", "messages": [USER]},
                            timeout=0.5)
        await asyncio.wait_for(engine.cancelled.wait(), 5)
        engine.hang = False  # the session is free again and nothing was recorded
        r = await http.post(f"/s/{session.id}/v1/chat/completions", json={"model": "tiny", "messages": [USER]})
        assert r.status_code == 200
    [seg] = session.transcript.segments
    assert seg.token_ids == prompt_ids(tok, [USER]) + engine.reply


@pytest.mark.asyncio
async def test_a_large_request_does_not_stall_other_sessions(tok):
    async with serving(tok) as (server, _, session, http):
        other = server.open()
        words = " ".join(f"w{i % 997}" for i in range(400_000))  # ~2.4 MB: seconds of tokenizing
        big = asyncio.create_task(http.post(f"/s/{session.id}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": words}]}))
        await asyncio.sleep(0.2)
        waits = []
        while not big.done():
            start = time.perf_counter()
            r = await http.post(f"/s/{other.id}/v1/chat/completions", json={"model": "tiny", "messages": [USER]},
                                headers={"x-api-key": other.api_key})
            waits.append(time.perf_counter() - start)
            assert r.status_code == 200
            await asyncio.sleep(0.05)
        assert (await big).json()["choices"][0]["finish_reason"] == "length"  # over max_len: nothing sampled
    assert len(waits) >= 3 and max(waits) < 1.0, (len(waits), max(waits))


@pytest.mark.asyncio
async def test_unknown_routes_and_methods_answer_in_each_protocols_shape(tok):
    async with serving(tok) as (_, _, session, http):
        r = await http.post(f"/s/{session.id}/v1/completions", json={})
        assert (r.status_code, r.json()) == (404, openai_error("Not Found", "not_found_error"))
        r = await http.get(f"/s/{session.id}/v1/messages")
        assert (r.status_code, r.json()) == (405, anthropic_error("Method Not Allowed"))
