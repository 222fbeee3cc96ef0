"""The OpenAI Responses API wire format (``POST /v1/responses``) over the canonical chat form of wire.py.

Input items become chat-template messages: a reasoning item, an assistant message and the function calls
that follow it are the parts of one assistant turn; a function_call_output is a tool message. A sampled
turn becomes output items (reasoning, message, function calls). ``previous_response_id`` names a response
of the same session: its conversation is kept in the session, so the new input only extends it.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field

from instar.agents.live import Delta
from instar.agents.transcript import Turn, split_reasoning
from instar.agents.wire import INT32, BaseRequest, Body, text_of, tool_call
from instar.data.chat import Message


class Part(Body):
    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]
    text: str


class Item(Body):
    """One input item; the short form ``{"role": ..., "content": ...}`` has no type."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["system", "developer", "user", "assistant"] = "user"
    content: str | list[Part] | None = None
    call_id: str = ""
    name: str = ""
    arguments: str = "{}"
    output: str | list[Part] = ""
    summary: list[Part] = []


class FunctionTool(Body):
    type: Literal["function"]  # hosted tools (web search, file search...) have no meaning here
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ResponsesRequest(BaseRequest):
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32)


def conversation(body: ResponsesRequest, history: list[Message]) -> list[Message]:
    """``history`` (the conversation of ``previous_response_id``) extended by the request's input; the
    instructions are not part of it: they are never carried over to the next response."""
    items = [Item(content=body.input)] if isinstance(body.input, str) else body.input
    out = list(history)
    turn: Message | None = None  # the assistant turn that the input's reasoning / message / call items extend
    for i, item in enumerate(items):
        if item.type == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(item.output)})
        elif item.type == "message" and item.role != "assistant":
            out.append({"role": "system" if item.role == "developer" else item.role, "content": text_of(item.content)})
        else:
            if item.type == "reasoning" or not out or out[-1] is not turn:  # a tool or user message closed it
                turn = {"role": "assistant", "content": ""}
                out.append(turn)
            if item.type == "reasoning":
                turn["reasoning_content"] = text_of(item.content) or text_of(item.summary)
            elif item.type == "function_call":
                call = tool_call(item.call_id, item.name, item.arguments, f"input[{i}]")
                turn.setdefault("tool_calls", []).append(call)
            else:
                turn["content"] += text_of(item.content)
    return out


def tools(body: ResponsesRequest) -> list[dict] | None:
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.parameters or {"type": "object", "properties": {}}}}
            for t in body.tools] if body.tools else None


def response(turn: Turn, model: str, response_id: str) -> dict:
    reasoning, content = split_reasoning(turn.message["content"])
    calls = turn.message.get("tool_calls", [])
    output = [_text_item("reasoning", response_id, reasoning)] if reasoning else []
    if content or not calls:
        output.append(_text_item("content", response_id, content))
    output += [{"type": "function_call", "id": f"fc_{c['id']}", "call_id": c["id"], "name": c["function"]["name"],
                "arguments": json.dumps(c["function"]["arguments"]), "status": "completed"} for c in calls]
    cut = turn.finish_reason == "length"
    n_in, n_out = turn.prompt_tokens, len(turn.token_ids)
    return _envelope(model, response_id) | {
        "status": "incomplete" if cut else "completed", "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "usage": {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n_out,
                  "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}}


def _text_item(kind: str, response_id: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning", "id": f"rs_{response_id}", "summary": [], "status": "completed",
                "content": [{"type": "reasoning_text", "text": text}]}
    return {"type": "message", "id": f"msg_{response_id}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _envelope(model: str, response_id: str) -> dict:
    """A response in progress: nothing sampled yet."""
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
            "status": "in_progress", "error": None, "incomplete_details": None, "output": [], "instructions": None,
            "metadata": {}, "parallel_tool_calls": True, "temperature": None, "tool_choice": "auto", "tools": [],
            "top_p": None, "usage": None}


async def events(parts: AsyncIterator[Delta | Turn], model: str, response_id: str) -> AsyncIterator[tuple[str, dict]]:
    """The turn as (event name, data) stream events while it is sampled (``parts``: its text deltas, then
    the Turn); they add up to ``response``. Function calls come with the end of the turn."""
    numbers = itertools.count()

    def event(kind: str, **data: Any) -> tuple[str, dict]:
        return kind, {"type": kind, "sequence_number": next(numbers), **data}

    def opened(i: int, item: dict) -> list[tuple[str, dict]]:
        empty = {"arguments": ""} if item["type"] == "function_call" else {"content": []}
        out = [event("response.output_item.added", output_index=i, item=item | empty | {"status": "in_progress"})]
        if item["type"] == "message":
            out.append(event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                             part=item["content"][0] | {"text": ""}))
        return out

    def delta(i: int, item: dict, text: str) -> tuple[str, dict]:
        at = {"item_id": item["id"], "output_index": i}
        if item["type"] == "function_call":
            return event("response.function_call_arguments.delta", **at, delta=text)
        # a message's part is output_text, a reasoning item's reasoning_text: the events' names
        return event(f"response.{item['content'][0]['type']}.delta", **at, content_index=0, delta=text, logprobs=[])

    def closed(i: int, item: dict) -> list[tuple[str, dict]]:
        at = {"item_id": item["id"], "output_index": i}
        if item["type"] == "function_call":
            out = [event("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])]
        else:
            [part] = item["content"]
            out = [event(f"response.{part['type']}.done", **at, content_index=0, text=part["text"], logprobs=[])]
            if part["type"] == "output_text":
                out.append(event("response.content_part.done", **at, content_index=0, part=part))
        return [*out, event("response.output_item.done", output_index=i, item=item)]

    started = _envelope(model, response_id)
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    live: list[dict] = []  # the items streamed, in output order, with the text sent so far
    async for part in parts:
        if isinstance(part, Turn):
            full = response(part, model, response_id)
            break
        item = _text_item(part.kind, response_id, "")
        if not live or live[-1]["type"] != item["type"]:
            now = closed(len(live) - 1, live[-1]) if live else []  # the item before is complete
            for e in now + opened(len(live), item):
                yield e
            live.append(item)
        live[-1]["content"][0]["text"] += part.text
        yield delta(len(live) - 1, item, part.text)
    for i, item in enumerate(full["output"]):
        whole = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        now = [*opened(i, item), delta(i, item, whole)] if i >= len(live) else []  # function calls, an empty answer
        for e in now + (closed(i, item) if i >= len(live) - 1 else []):
            yield e
    yield event(f"response.{full['status']}", response=full)
