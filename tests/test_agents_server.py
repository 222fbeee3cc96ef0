"""The loopback chat server over real HTTP, driven by the stock OpenAI and Anthropic SDKs, on the
embedded engine and a tiny model fine-tuned to replay a fixed script (tool call included;
helpers/agents.py)."""

import anthropic
import httpx
import openai
import pytest
from anthropic import AsyncAnthropic
from helpers.agents import (
    CALCULATOR,
    GREEDY,
    JUDGE,
    USER,
    anthropic_tool_round_trip,
    chatml,
    openai_tool_round_trip,
    serving,
)
from openai import AsyncOpenAI

from instar.agents import ChatServer
from instar.data.chat import encode, prompt_ids, render


@pytest.mark.asyncio
async def test_three_turns_record_exactly_the_sampled_ids_plus_template_deltas(scripted):
    tok = scripted.tokenizer
    async with serving(scripted) as (server, engine):
        session = server.open(GREEDY)
        client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        messages, replies = [USER], []
        for follow_up in ("Check it.", "Thanks", None):
            replies.append(await client.chat.completions.create(model="tiny", messages=messages))
            messages.append({"role": "assistant", "content": replies[-1].choices[0].message.content})
            messages += [{"role": "user", "content": follow_up}] if follow_up else []
        await client.close()
    assert [r.choices[0].message.content for r in replies] == ["The answer is 5.", "It is correct.", "Sure."]
    assert [r.choices[0].finish_reason for r in replies] == ["stop"] * 3
    prompt = encode(tok, chatml(("user", "What is 2+3?")) + "<|im_start|>assistant\n")
    deltas = [encode(tok, "\n" + chatml(("user", text)) + "<|im_start|>assistant\n")
              for text in ("Check it.", "Thanks")]
    gens = [gen for _, gen, _ in engine.calls]
    assert [g.token_ids for g in gens] == [encode(tok, text) + [tok.eos_token_id]
                                           for text in ("The answer is 5.", "It is correct.", "Sure.")]
    [seg] = session.transcript.segments
    parts = [(prompt, None), (gens[0], 1), (deltas[0], None), (gens[1], 1), (deltas[1], None), (gens[2], 1)]
    assert seg.token_ids == [t for p, a in parts for t in (p.token_ids if a else p)]
    assert seg.action_mask == [int(bool(a)) for p, a in parts for _ in (p.token_ids if a else p)]
    assert seg.rollout_logprobs == [x for p, a in parts for x in (p.logprobs if a else [0.0] * len(p))]
    assert seg.versions == [v for p, a in parts for v in (p.versions if a else [-1] * len(p))]
    # Each turn was sampled on exactly the ids recorded before it; usage counts them.
    assert [len(ids) for ids, _, _ in engine.calls] == [r.usage.prompt_tokens for r in replies]
    assert all(seg.token_ids[:len(ids)] == ids for ids, _, _ in engine.calls)
    assert [r.usage.completion_tokens for r in replies] == [len(g.token_ids) for g in gens]
    assert tok.decode(seg.token_ids) == render(tok, messages, generation_prompt=False).removesuffix("\n")
    seg.validate()


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_openai_tool_call_round_trip(scripted, stream):
    tok = scripted.tokenizer
    async with serving(scripted) as (server, engine):
        session = server.open(GREEDY)
        first, second = await openai_tool_round_trip(session, stream)
    assert first["content"] is None and first["finish"] == "tool_calls"
    assert first["tool_calls"] == [{"id": "call_0_0", "type": "function", "function": {
        "name": "calculator", "arguments": '{"expression": "2+3"}'}}]
    assert second["content"] == "The answer is 5." and second["finish"] == "stop" and second["tool_calls"] is None
    [seg] = session.transcript.segments
    gens = [gen.token_ids for _, gen, _ in engine.calls]
    assert gens[0] == encode(tok, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n'
                                  '</tool_call>') + [tok.eos_token_id]
    delta = encode(tok, "\n" + chatml(("user", "<tool_response>\n5\n</tool_response>")) + "<|im_start|>assistant\n")
    prompt = engine.calls[0][0]
    assert prompt == prompt_ids(tok, [USER], [CALCULATOR])
    assert seg.token_ids == prompt + gens[0] + delta + gens[1]
    assert seg.action_mask == [0] * len(prompt) + [1] * len(gens[0]) + [0] * len(delta) + [1] * len(gens[1])
    assert first["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(gens[0]),
                              "total_tokens": len(prompt) + len(gens[0])}


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_tool_use_round_trip(scripted, stream):
    async with serving(scripted) as (server, engine):
        session = server.open(GREEDY)
        first, second = await anthropic_tool_round_trip(session, stream)
    assert first.stop_reason == "tool_use"
    assert [b.model_dump(exclude_none=True) for b in first.content] == [
        {"type": "tool_use", "id": "call_0_0", "name": "calculator", "input": {"expression": "2+3"}}]
    assert second.stop_reason == "end_turn" and [b.text for b in second.content] == ["The answer is 5."]
    gens = [gen.token_ids for _, gen, _ in engine.calls]
    assert (first.usage.input_tokens, first.usage.output_tokens) == (len(engine.calls[0][0]), len(gens[0]))
    # The same conversation over the OpenAI protocol records the same ids.
    async with serving(scripted) as (server, _):
        other = server.open(GREEDY)
        await openai_tool_round_trip(other, stream=False)
    assert session.transcript.segments[0].token_ids == other.transcript.segments[0].token_ids


@pytest.mark.asyncio
async def test_streaming_and_non_streaming_return_the_same_tokens(scripted):
    async with serving(scripted) as (server, _):
        sessions = [server.open(GREEDY), server.open(GREEDY)]
        plain, streamed = [await openai_tool_round_trip(s, stream) for s, stream in zip(sessions, (False, True))]
        a_sessions = [server.open(GREEDY), server.open(GREEDY)]
        a_plain, a_streamed = [await anthropic_tool_round_trip(s, stream)
                               for s, stream in zip(a_sessions, (False, True))]
    assert plain == streamed
    assert [r.model_dump(exclude={"id"}) for r in a_plain] == [r.model_dump(exclude={"id"}) for r in a_streamed]
    ids = [s.transcript.segments[0].token_ids for s in sessions + a_sessions]
    assert ids[1:] == ids[:1] * 3


@pytest.mark.asyncio
async def test_rewritten_history_seals_a_segment_and_a_retry_is_answered_from_cache(scripted):
    tok = scripted.tokenizer
    async with serving(scripted) as (server, engine):
        session = server.open(GREEDY)
        client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        first = await client.chat.completions.create(model="tiny", messages=[USER])
        retry = await client.chat.completions.create(model="tiny", messages=[USER])
        assert len(engine.calls) == 1 and retry.choices[0].message == first.choices[0].message
        # Compaction: the agent replaces the history with a summary; the open segment is sealed.
        compacted = [{"role": "system", "content": "Earlier: 2+3 was asked and answered."},
                     {"role": "user", "content": "Check it."}]
        await client.chat.completions.create(model="tiny", messages=compacted)
        await client.close()
    first_seg, second_seg = session.transcript.segments
    assert first_seg.token_ids == engine.calls[0][0] + engine.calls[0][1].token_ids
    assert engine.calls[1][0] == prompt_ids(tok, compacted)
    assert second_seg.token_ids == engine.calls[1][0] + engine.calls[1][1].token_ids
    assert second_seg.action_mask == [0] * len(engine.calls[1][0]) + [1] * len(engine.calls[1][1].token_ids)


@pytest.mark.asyncio
async def test_untraced_judge_call_is_served_but_never_recorded(scripted):
    async with serving(scripted) as (server, engine):
        session = server.open(GREEDY)
        judge = AsyncOpenAI(base_url=session.untraced_base_url, api_key=session.api_key, max_retries=0)
        verdict = await judge.chat.completions.create(model="tiny", messages=[
            {"role": "system", "content": JUDGE},
            {"role": "user", "content": "Question: What is 2+3?\nAnswer: The answer is 5."}])
        assert session.transcript.segments == []
        client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        await client.chat.completions.create(model="tiny", messages=[USER])
        await judge.close()
        await client.close()
    assert verdict.choices[0].message.content == "correct"
    [seg] = session.transcript.segments
    assert seg.token_ids == engine.calls[1][0] + engine.calls[1][1].token_ids
    assert [sid for _, _, sid in engine.calls] == [session.untraced_id, session.id]


@pytest.mark.asyncio
async def test_wrong_key_unknown_session_and_bad_bodies_get_each_protocols_errors(scripted):
    async with serving(scripted) as (server, _):
        session = server.open(GREEDY)
        bad = AsyncOpenAI(base_url=session.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            await bad.chat.completions.create(model="tiny", messages=[USER])
        assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
        gone = AsyncOpenAI(base_url=session.base_url.replace(session.id, "nope"), api_key=session.api_key,
                           max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await gone.chat.completions.create(model="tiny", messages=[USER])
        bad_a = AsyncAnthropic(base_url=session.session_url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            await bad_a.messages.create(model="tiny", max_tokens=8, messages=[USER])
        assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": (
            "wrong api key for this session: use ctx.api_key (Authorization: Bearer or x-api-key)")}}
        good = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        assert [m.id for m in (await good.models.list()).data] == ["tiny"]
        async with httpx.AsyncClient(base_url=server.root, headers={"x-api-key": session.api_key}) as http:
            assert (await http.get("/v1/models")).json()["data"][0]["id"] == "tiny"
            r = await http.post(f"/s/{session.id}/v1/chat/completions", content=b"{not json")
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            r = await http.post(f"/s/{session.id}/v1/messages", content=b"{not json")
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            r = await http.post(f"/s/{session.id}/v1/messages", json={"model": "tiny", "messages": [USER]})
            assert r.status_code == 400 and r.json() == {"type": "error", "error": {
                "type": "invalid_request_error", "message": "invalid request body: max_tokens: Field required"}}
            r = await http.post(f"/s/{session.id}/v1/chat/completions", json={"model": "tiny", "messages": [
                {"role": "robot", "content": "hi"}]})
            assert r.status_code == 400 and r.json()["error"]["message"] == (
                "invalid request body: messages.0.role: Input should be 'system', 'developer', 'user', 'assistant' "
                "or 'tool'")
        for c in (bad, gone, bad_a, good):
            await c.close()
    assert session.transcript.segments == []


@pytest.mark.asyncio
async def test_accepted_connections_have_tcp_nodelay():
    """Without TCP_NODELAY, Nagle + the client's delayed ACK hold every response on a kept-alive
    connection ~40 ms (bench/chat_latency.py measures it)."""
    import socket

    async with ChatServer(engine=None, tokenizer=None, model_name="tiny", max_len=64, max_new_tokens=8) as server:
        async with httpx.AsyncClient(base_url=server.root) as http:
            assert (await http.get("/v1/models")).status_code == 200
            [conn] = server._server.server_state.connections
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
