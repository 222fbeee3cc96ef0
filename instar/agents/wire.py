"""The OpenAI and Anthropic wire formats, converted to and from one canonical chat form: the HF
chat-template messages (``role``, ``content`` text, ``tool_calls`` with dict ``arguments``,
``tool_call_id`` on tool results) and HF tool schemas. Both protocols share the transcript through it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from instar.agents.transcript import Turn
from instar.data.chat import Message


class WireError(Exception):
    """A request the server must refuse; rendered in the calling protocol's own error shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    n: int = Field(1, ge=1, le=1)
    stop: str | list[str] | None = None


class AnthropicRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    stop_sequences: list[str] | None = None


def _text(content: Any, where: str) -> str:
    """Text of a content field: a string, None, or a list of text parts/blocks."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise WireError(400, f"{where}: content part of type {kind!r} is not supported (text only)")
            parts.append(part.get("text", ""))
        return "".join(parts)
    raise WireError(400, f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def _call(call_id: str, name: Any, arguments: Any, where: str) -> dict:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            raise WireError(400, f"{where}: tool call arguments are not valid JSON ({e}): {arguments!r}") from None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise WireError(400, f"{where}: a tool call needs a string name and object arguments, got {name!r}, "
                             f"{arguments!r}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _assistant(content: str, calls: list[dict]) -> Message:
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def openai_messages(messages: list[dict]) -> list[Message]:
    out = []
    for i, m in enumerate(messages):
        where, role = f"messages[{i}]", m.get("role")
        if role in ("system", "developer", "user"):
            out.append({"role": "system" if role == "developer" else role, "content": _text(m.get("content"), where)})
        elif role == "assistant":
            calls = [_call(c.get("id", ""), (c.get("function") or {}).get("name"),
                           (c.get("function") or {}).get("arguments"), where) for c in m.get("tool_calls") or []]
            out.append(_assistant(_text(m.get("content"), where), calls))
        elif role == "tool":
            out.append({"role": "tool", "tool_call_id": m.get("tool_call_id", ""),
                        "content": _text(m.get("content"), where)})
        else:
            raise WireError(400, f"{where}: unknown role {role!r}; use system, developer, user, assistant or tool")
    return out


def anthropic_messages(system: str | list[dict] | None, messages: list[dict]) -> list[Message]:
    out = [{"role": "system", "content": _text(system, "system")}] if system else []
    for i, m in enumerate(messages):
        where, role, content = f"messages[{i}]", m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise WireError(400, f"{where}: role must be user or assistant, got {role!r}")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise WireError(400, f"{where}: content must be a string or a list of blocks")
        texts = [b for b in blocks if isinstance(b, dict) and b.get("type") == "text"]
        if role == "assistant":
            calls = [_call(b.get("id", ""), b.get("name"), b.get("input"), where)
                     for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
            if len(texts) + len(calls) != len(blocks):
                raise WireError(400, f"{where}: assistant blocks must be text or tool_use")
            out.append(_assistant(_text(texts, where), calls))
            continue
        results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
        if len(texts) + len(results) != len(blocks):
            raise WireError(400, f"{where}: user blocks must be text or tool_result")
        out += [{"role": "tool", "tool_call_id": b.get("tool_use_id", ""), "content": _text(b.get("content"), where)}
                for b in results]
        if texts or not results:
            out.append({"role": "user", "content": _text(texts, where)})
    return out


def openai_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    if any(t.get("type") != "function" or "function" not in t for t in tools):
        raise WireError(400, "tools: every tool must be {'type': 'function', 'function': {...}}")
    return [{"type": "function", "function": t["function"]} for t in tools]


def anthropic_tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    if any("name" not in t for t in tools):
        raise WireError(400, "tools: every tool needs a name (and an input_schema)")
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                              "parameters": t.get("input_schema", {"type": "object"})}}
            for t in tools]


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
