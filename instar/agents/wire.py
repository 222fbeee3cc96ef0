"""The OpenAI and Anthropic wire formats, converted to and from one canonical chat form: the HF
chat-template messages (``role``, ``content`` text, ``tool_calls`` with dict ``arguments``,
``tool_call_id`` on tool results) and HF tool schemas. Both protocols share the transcript through it.

The request models are the one place a body is checked: a body that parses into them converts
without further type errors. Numbers are bounded so nothing out of range reaches an engine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field

from instar.agents.transcript import Turn
from instar.data.chat import Message

INT32 = 2**31 - 1


class WireError(Exception):
    """A request the server must refuse; rendered in the calling protocol's own error shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields instar does not use (metadata, cache_control...)


class TextPart(_Body):
    type: Literal["text"]
    text: str


Content = str | list[TextPart] | None


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Body):
    id: str = ""
    function: FunctionCall


class OpenAIMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str = ""


class FunctionSchema(BaseModel):
    model_config = ConfigDict(extra="allow")  # the template renders the schema as sent
    name: str


class OpenAITool(_Body):
    type: Literal["function"]
    function: FunctionSchema


class OpenAIRequest(_Body):
    model: str
    messages: list[OpenAIMessage] = Field(min_length=1)
    tools: list[OpenAITool] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32)
    seed: int | None = Field(None, ge=-2**63, lt=2**63)  # what torch and vLLM generators take
    n: int = Field(1, ge=1, le=1)
    stop: str | list[str] | None = None


class ToolUse(_Body):
    type: Literal["tool_use"]
    id: str = ""
    name: str
    input: dict[str, Any]


class ToolResult(_Body):
    type: Literal["tool_result"]
    tool_use_id: str = ""
    content: Content = None


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Annotated[TextPart | ToolUse | ToolResult, Field(discriminator="type")]]


class AnthropicTool(_Body):
    name: str
    description: str = ""
    input_schema: dict[str, Any] = {"type": "object"}


class AnthropicRequest(_Body):
    model: str
    max_tokens: int = Field(ge=1, le=INT32)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Content = None
    tools: list[AnthropicTool] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=INT32)
    stop_sequences: list[str] | None = None


def _text(content: Content) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content or [])


def _call(call_id: str, name: str, arguments: str | dict, where: str) -> dict:
    if isinstance(arguments, str):
        try:  # pydantic's parser: nesting and lone surrogates are refused as in the body itself
            arguments = pydantic_core.from_json(arguments or "{}")
        except ValueError as e:
            raise WireError(400, f"{where}: tool call arguments are not valid JSON ({e}): {arguments!r:.200}") from None
    if not isinstance(arguments, dict):
        raise WireError(400, f"{where}: tool call arguments must be a JSON object, got {arguments!r:.200}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _assistant(content: str, calls: list[dict]) -> Message:
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def openai_messages(messages: list[OpenAIMessage]) -> list[Message]:
    out = []
    for i, m in enumerate(messages):
        if m.role in ("system", "developer", "user"):
            out.append({"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)})
        elif m.role == "assistant":
            calls = [_call(c.id, c.function.name, c.function.arguments, f"messages[{i}]") for c in m.tool_calls or []]
            out.append(_assistant(_text(m.content), calls))
        else:
            out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": _text(m.content)})
    return out


def anthropic_messages(system: Content, messages: list[AnthropicMessage]) -> list[Message]:
    out = [{"role": "system", "content": _text(system)}] if system else []
    for i, m in enumerate(messages):
        blocks = [TextPart(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        texts = [b for b in blocks if isinstance(b, TextPart)]
        if m.role == "assistant":
            if any(isinstance(b, ToolResult) for b in blocks):
                raise WireError(400, f"messages[{i}]: assistant blocks must be text or tool_use")
            calls = [_call(b.id, b.name, b.input, f"messages[{i}]") for b in blocks if isinstance(b, ToolUse)]
            out.append(_assistant(_text(texts), calls))
            continue
        if any(isinstance(b, ToolUse) for b in blocks):
            raise WireError(400, f"messages[{i}]: user blocks must be text or tool_result")
        results = [b for b in blocks if isinstance(b, ToolResult)]
        out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)} for b in results]
        if texts or not results:
            out.append({"role": "user", "content": _text(texts)})
    return out


def openai_tools(tools: list[OpenAITool] | None) -> list[dict] | None:
    return [{"type": "function", "function": t.function.model_dump()} for t in tools] if tools else None


def anthropic_tools(tools: list[AnthropicTool] | None) -> list[dict] | None:
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.input_schema}} for t in tools]


def _finish(turn: Turn, calls: str, length: str, stop: str) -> str:
    return calls if turn.message.get("tool_calls") else length if turn.finish_reason == "length" else stop


def openai_response(turn: Turn, model: str, request_id: str) -> dict:
    calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
             for c in turn.message.get("tool_calls", [])]
    message = {"role": "assistant", "content": turn.message["content"] or (None if calls else ""),
               **({"tool_calls": calls} if calls else {})}
    n_out = len(turn.token_ids)
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _finish(turn, "tool_calls", "length", "stop")}],
            "usage": {"prompt_tokens": turn.prompt_tokens, "completion_tokens": n_out,
                      "total_tokens": turn.prompt_tokens + n_out}}


def openai_chunks(turn: Turn, model: str, request_id: str, pieces: list[str]) -> Iterator[dict]:
    """The same response as ``openai_response``, as chat.completion.chunk objects."""
    full = openai_response(turn, model, request_id)
    head = {k: full[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(delta: dict, finish: str | None = None, **extra: Any) -> dict:
        return head | {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]} | extra

    yield chunk({"role": "assistant", "content": ""})
    content = turn.message["content"]
    for piece in (pieces if content == turn.text else [content]):
        if piece:
            yield chunk({"content": piece})
    for i, call in enumerate(full["choices"][0]["message"].get("tool_calls", [])):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, full["choices"][0]["finish_reason"], usage=full["usage"])


def anthropic_response(turn: Turn, model: str, request_id: str) -> dict:
    blocks = [{"type": "text", "text": turn.message["content"]}] if turn.message["content"] else []
    blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": c["function"]["arguments"]}
               for c in turn.message.get("tool_calls", [])]
    return {"id": request_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": _finish(turn, "tool_use", "max_tokens", "end_turn"), "stop_sequence": None,
            "usage": {"input_tokens": turn.prompt_tokens, "output_tokens": len(turn.token_ids)}}


def anthropic_events(turn: Turn, model: str, request_id: str, pieces: list[str]) -> Iterator[tuple[str, dict]]:
    """The same response as ``anthropic_response``, as (event name, data) stream events."""
    full = anthropic_response(turn, model, request_id)
    start = full | {"content": [], "stop_reason": None, "usage": full["usage"] | {"output_tokens": 0}}
    yield "message_start", {"type": "message_start", "message": start}
    for i, block in enumerate(full["content"]):
        if block["type"] == "text":
            yield "content_block_start", {"type": "content_block_start", "index": i,
                                          "content_block": {"type": "text", "text": ""}}
            for piece in (pieces if block["text"] == turn.text else [block["text"]]):
                if piece:
                    yield "content_block_delta", {"type": "content_block_delta", "index": i,
                                                  "delta": {"type": "text_delta", "text": piece}}
        else:
            yield "content_block_start", {"type": "content_block_start", "index": i,
                                          "content_block": block | {"input": {}}}
            yield "content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}}
        yield "content_block_stop", {"type": "content_block_stop", "index": i}
    yield "message_delta", {"type": "message_delta", "usage": full["usage"],
                            "delta": {"stop_reason": full["stop_reason"], "stop_sequence": None}}
    yield "message_stop", {"type": "message_stop"}
