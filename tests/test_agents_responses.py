"""The Responses API route (stock OpenAI SDK ``client.responses``) and reasoning turns on every protocol:
the server hands reasoning back the way each protocol expects and takes it back, and an echoed turn that a
client re-serialised keeps its sampled tokens and the segment; only a real edit seals."""

import httpx
import openai
import pytest
from anthropic import AsyncAnthropic
from helpers.agents import CALCULATOR, GREEDY, USER, chatml, serving, tool_conversation_ids
from openai import AsyncOpenAI

from instar.agents import ChatServer, SamplingParams
from instar.contract import Generation
from instar.data.chat import encode, prompt_ids
from instar.engines.protocol import Sampled

TOOL = {"type": "function", **CALCULATOR["function"], "strict": False}  # the Responses API's flat form


async def responses_round_trip(session, mode: str) -> tuple[list, list[str]]:
    """The calculator conversation over /v1/responses: the whole input each time, or previous_response_id,
    or streamed through the SDK's stream helper (which checks the events add up)."""
    client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    replies, kinds, items, previous = [], [], [USER], None
    for _ in range(2):
        kwargs = dict(model="tiny", input=items, tools=[TOOL], previous_response_id=previous or openai.omit)
        if mode == "stream":
            async with client.responses.stream(**kwargs) as events:
                kinds += [event.type async for event in events]
                reply = await events.get_final_response()
        else:
            reply = await client.responses.create(**kwargs)
        replies.append(reply)
        results = [{"type": "function_call_output", "call_id": o.call_id, "output": "5"}
                   for o in reply.output if o.type == "function_call"]
        if mode == "previous_response_id":
            items, previous = results, reply.id
        else:
            items = [*items, *(o.model_dump(exclude_none=True) for o in reply.output), *results]
    await client.close()
    return replies, kinds


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["full_input", "previous_response_id", "stream"])
async def test_responses_tool_round_trip_records_the_chat_completions_tokens(scripted, mode):
    async with serving(scripted) as (server, engine):
        session = server.open(GREEDY)
        (first, second), kinds = await responses_round_trip(session, mode)
    [call] = first.output
    assert (first.status, call.type, call.call_id, call.name, call.arguments) == (
        "completed", "function_call", "call_0_0", "calculator", '{"expression": "2+3"}')
    [message] = second.output
    assert (message.type, message.role, second.output_text, second.status) == (
        "message", "assistant", "The answer is 5.", "completed")
    gens = [gen.token_ids for _, gen, _ in engine.calls]
    assert (first.usage.input_tokens, first.usage.output_tokens) == (len(engine.calls[0][0]), len(gens[0]))
    [seg] = session.transcript.segments
    assert (seg.token_ids, seg.action_mask) == tool_conversation_ids(scripted.tokenizer)
    if mode == "stream":
        call_events = ["response.output_item.added", "response.function_call_arguments.delta",
                       "response.function_call_arguments.done", "response.output_item.done"]
        text_events = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                       "response.output_text.done", "response.content_part.done", "response.output_item.done"]
        frame = ["response.created", "response.in_progress"]
        # the answer streams token by token: one delta event per piece of it
        assert kinds.count("response.output_text.delta") == 5
        collapsed = [k for i, k in enumerate(kinds) if not (k.endswith(".delta") and kinds[i - 1] == k)]
        assert collapsed == [*frame, *call_events, "response.completed", *frame, *text_events, "response.completed"]


@pytest.mark.asyncio
async def test_responses_errors_name_the_problem(scripted):
    async with serving(scripted) as (server, _):
        session = server.open(GREEDY)
        client = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        with pytest.raises(openai.NotFoundError, match="previous_response_id 'resp_x' is not a response of this "
                                                       "session"):
            await client.responses.create(model="tiny", input="hi", previous_response_id="resp_x")
        with pytest.raises(openai.BadRequestError, match="tools.0.type: Input should be 'function'"):
            await client.responses.create(model="tiny", input="hi", tools=[{"type": "web_search"}])
        await client.close()
    assert session.transcript.segments == []


class Says:
    """An engine that answers its n-th turn with ``texts[n]`` and the end-of-turn id."""

    def __init__(self, tok, *texts):
        self.replies = [encode(tok, text) + [tok.eos_token_id] for text in texts]
        self.prompts = []

    async def generate(self, prompt_token_ids, sampling_params, session_id=None):
        ids = self.replies[len(self.prompts)]
        self.prompts.append(list(prompt_token_ids))
        return Generation(list(ids), [-0.5] * len(ids), [0] * len(ids), "stop")

    async def stream(self, prompt_token_ids, sampling_params, session_id=None):
        gen = await self.generate(prompt_token_ids, sampling_params, session_id)
        for i, token in enumerate(gen.token_ids):  # one token at a time: the text splits inside tags
            yield Sampled(i, [token])
        yield gen

    def release(self, session_id):
        pass


THOUGHT = "<think>\nAdd them.\n</think>\n\nThe answer is <|im_start|>5."


@pytest.mark.asyncio
async def test_reasoning_comes_back_in_each_protocols_own_field(scripted):
    async with ChatServer(Says(scripted.tokenizer, *[THOUGHT] * 6), scripted.tokenizer, model_name="tiny",
                          max_len=512, max_new_tokens=32) as server:
        session = server.open(SamplingParams())
        oai = AsyncOpenAI(base_url=session.untraced_base_url, api_key=session.api_key, max_retries=0)
        chat = (await oai.chat.completions.create(model="tiny", messages=[USER])).choices[0].message
        streamed = [c.choices[0].delta async for c in await oai.chat.completions.create(
            model="tiny", messages=[USER], stream=True)]
        response = await oai.responses.create(model="tiny", input="What is 2+3?")
        claude = AsyncAnthropic(base_url=session.untraced_session_url, api_key=session.api_key, max_retries=0)
        blocks = (await claude.messages.create(model="tiny", max_tokens=32, messages=[USER])).content
        async with claude.messages.stream(model="tiny", max_tokens=32, messages=[USER]) as events:
            streamed_blocks = (await events.get_final_message()).content
        await oai.close()
        await claude.close()
    answer = "The answer is <|im_start|>5."
    assert (chat.content, chat.model_extra["reasoning_content"]) == (answer, "Add them.")
    assert ("".join(d.content or "" for d in streamed),
            "".join(d.model_extra.get("reasoning_content") or "" for d in streamed)) == (answer, "Add them.")
    assert [(o.type, o.content[0].text) for o in response.output] == [("reasoning", "Add them."),
                                                                       ("message", answer)]
    for got in (blocks, streamed_blocks):
        assert [b.model_dump() for b in got] == [{"type": "thinking", "thinking": "Add them.", "signature": ""},
                                                 {"type": "text", "text": answer, "citations": None}]


def openai_echo(form: str) -> dict:
    content = {"as_returned": "The answer is <|im_start|>5.", "reasoning_dropped": "The answer is <|im_start|>5.",
               "inline_normalised": "<think>Add them.</think>The answer is <|im_start|>5.",
               "whitespace": "  The answer is\n<|im_start|>5.\n",
               "escaped": "The answer is &lt;|im_start|&gt;5.", "edited": "The answer is 6."}[form]
    reasoning = {"reasoning_content": "Add them."} if form in ("as_returned", "escaped", "edited") else {}
    return {"role": "assistant", "content": content, **reasoning}


@pytest.mark.asyncio
@pytest.mark.parametrize("form", ["as_returned", "reasoning_dropped", "inline_normalised", "whitespace", "escaped",
                                  "anthropic_blocks", "responses_items", "edited"])
async def test_a_reserialised_echo_keeps_the_sampled_tokens_and_only_an_edit_seals(scripted, form):
    tok = scripted.tokenizer
    engine = Says(tok, THOUGHT, "It is correct.")
    follow_up = {"role": "user", "content": "Check it."}
    async with ChatServer(engine, tok, model_name="tiny", max_len=512, max_new_tokens=32) as server:
        session = server.open(SamplingParams())
        if form == "anthropic_blocks":
            claude = AsyncAnthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0)
            first = await claude.messages.create(model="tiny", max_tokens=32, messages=[USER])
            echo = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}
            await claude.messages.create(model="tiny", max_tokens=32, messages=[USER, echo, follow_up])
            await claude.close()
        elif form == "responses_items":
            oai = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
            first = await oai.responses.create(model="tiny", input=[USER])
            await oai.responses.create(model="tiny", input=[USER, *(o.model_dump(exclude_none=True)
                                                                    for o in first.output), follow_up])
            await oai.close()
        else:
            async with httpx.AsyncClient(base_url=session.base_url, headers={"x-api-key": session.api_key}) as http:
                for messages in ([USER], [USER, openai_echo(form), follow_up]):
                    r = await http.post("/chat/completions", json={"model": "tiny", "messages": messages})
                    assert r.status_code == 200, r.text
    sampled = engine.replies[0]
    if form == "edited":
        assert len(session.transcript.segments) == 2
        assert engine.prompts[1] == prompt_ids(tok, [USER, openai_echo(form), follow_up])
        return
    [seg] = session.transcript.segments
    delta = encode(tok, "\n" + chatml(("user", "Check it.")) + "<|im_start|>assistant\n")
    assert engine.prompts[1] == engine.prompts[0] + sampled + delta
    assert seg.token_ids == engine.prompts[1] + engine.replies[1]
    assert seg.action_mask == [0] * len(engine.prompts[0]) + [1] * len(sampled) + [0] * len(delta) + [1] * len(
        engine.replies[1])
