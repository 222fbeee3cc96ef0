"""The OpenAI and Anthropic wire formats, converted to and from one canonical chat form: the HF
chat-template messages (``role``, ``content`` text, ``tool_calls`` with dict ``arguments``,
``tool_call_id`` on tool results) and HF tool schemas. Both protocols share the transcript through it.

The request models are the one place a body is checked: a body that parses into them converts
without further type errors. Numbers are bounded so nothing out of range reaches an engine.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field

from instar.agents.live import Delta
from instar.agents.transcript import Turn, split_reasoning
from instar.data.chat import Message

INT32 = 2**31 - 1
# Request fields (of any of the protocols) that would change what a turn samples or constrain it, which instar
# does not do: refused unless they ask for nothing, as frameworks send by default. tool_choice "none" forbids tool
# calls, which instar cannot enforce: it asks for nothing only in a request without tools.
IGNORED = {"stop": ("", []), "stop_sequences": ([],), "logit_bias": ({},), "frequency_penalty": (0,),
           "presence_penalty": (0,), "response_format": ({"type": "text"},), "text": ({}, {"format": {"type": "text"}}),
           "tool_choice": ("auto", {"type": "auto"}, "none", {"type": "none"})}


class WireError(Exception):
    """A request the server must refuse; rendered in the calling protocol's own error shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # fields instar does not use (metadata, cache_control...)


class BaseRequest(Body):
    """What every protocol's request has."""

    model_config = ConfigDict(extra="allow")  # the fields instar ignores stay in model_extra, to be checked
    model: str
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)


class TextPart(Body):
    type: Literal["text"]
    text: str


class ImageURL(Body):
    url: str


class ImageURLPart(Body):
    """OpenAI's image part; only data URLs: the chat server fetches nothing."""

    type: Literal["image_url"]
    image_url: ImageURL


class ImageSource(Body):
    type: Literal["base64", "url"]
    media_type: str = "image/png"
    data: str = ""


class ImageBlock(Body):
    """Anthropic's image block (base64 source)."""

    type: Literal["image"]
    source: ImageSource


Content = str | list[TextPart] | None
UserContent = str | list[Annotated[TextPart | ImageURLPart, Field(discriminator="type")]] | None


class FunctionCall(Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Body):
    id: str = ""
    function: FunctionCall


class OpenAIMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: UserContent = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str = ""
    reasoning_content: str | None = None  # how vLLM and others return reasoning; echoed back by clients
    reasoning: str | None = None


class FunctionSchema(BaseModel):
    model_config = ConfigDict(extra="allow")  # the template renders the schema as sent
    name: str


class OpenAITool(Body):
    type: Literal["function"]
    function: FunctionSchema


class OpenAIRequest(BaseRequest):
    messages: list[OpenAIMessage] = Field(min_length=1)
    tools: list[OpenAITool] | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32)
    seed: int | None = Field(None, ge=-2**63, lt=2**63)  # what torch and vLLM generators take
    n: int = Field(1, ge=1, le=1)


class ToolUse(Body):
    type: Literal["tool_use"]
    id: str = ""
    name: str
    input: dict[str, Any]


class Thinking(Body):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinking(Body):
    type: Literal["redacted_thinking"]
    data: str = ""


class ToolResult(Body):
    type: Literal["tool_result"]
    tool_use_id: str = ""
    content: str | list[Annotated[TextPart | ImageBlock, Field(discriminator="type")]] | None = None


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: str | list[Annotated[TextPart | ImageBlock | ToolUse | ToolResult | Thinking | RedactedThinking,
                                  Field(discriminator="type")]]


class AnthropicTool(Body):
    name: str
    description: str = ""
    input_schema: dict[str, Any] = {"type": "object"}


class AnthropicRequest(BaseRequest):
    max_tokens: int = Field(ge=1, le=INT32)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Content = None
    tools: list[AnthropicTool] | None = None
    top_k: int | None = Field(None, ge=0, le=INT32)


def refuse_ignored(body: BaseRequest, tools: list | None) -> None:
    """A 400 naming the first field of ``IGNORED`` that asks for something."""
    for name, neutral in IGNORED.items():
        value = (body.model_extra or {}).get(name)
        if value is not None and (value not in neutral or tools and value in ("none", {"type": "none"})):
            raise WireError(400, f"{name}={json.dumps(value):.200} is not supported: a turn is sampled from the "
                                 "model's own distribution up to its end-of-turn token, as the trainer assumes; "
                                 f"leave {name} unset")


def text_of(content: str | list[Any] | None, where: str = "content") -> str:
    """A content's text: a string, or the concatenated ``text`` of its parts (which must all be text)."""
    if isinstance(content, str):
        return content
    if any(isinstance(part, ImageURLPart | ImageBlock) for part in content or []):
        raise WireError(400, f"{where}: images are allowed in user and tool messages only")
    return "".join(part.text for part in content or [])


def content_of(content: str | list[Any] | None, where: str) -> str | list[dict]:
    """A user or tool message's content: its text, or with images, text and image parts in the one
    canonical form (`instar.data.images`: data URLs, which the server decodes off its event loop)."""
    if isinstance(content, str) or not any(isinstance(p, ImageURLPart | ImageBlock) for p in content or []):
        return text_of(content, where)
    return [_part(part, f"{where}[{k}]") for k, part in enumerate(content)]


def _part(part: TextPart | ImageURLPart | ImageBlock, where: str) -> dict:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    if isinstance(part, ImageBlock) and part.source.type != "base64":
        raise WireError(400, f"{where}: image sources must be base64; the chat server fetches no URL")
    url = (f"data:{part.source.media_type};base64,{part.source.data}" if isinstance(part, ImageBlock)
           else part.image_url.url)
    if not url.startswith("data:image/"):
        raise WireError(400, f"{where}: image_url must be a data URL (data:image/png;base64,...); the chat server "
                             "fetches no URL")
    return {"type": "image", "image": url}


def tool_call(call_id: str, name: str, arguments: str | dict, where: str) -> dict:
    if isinstance(arguments, str):
        try:  # pydantic's parser: nesting and lone surrogates are refused as in the body itself
            arguments = pydantic_core.from_json(arguments or "{}")
        except ValueError as e:
            raise WireError(400, f"{where}: tool call arguments are not valid JSON ({e}): {arguments!r:.200}") from None
    if not isinstance(arguments, dict):
        raise WireError(400, f"{where}: tool call arguments must be a JSON object, got {arguments!r:.200}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _assistant(content: str | None, calls: list[dict], reasoning: str | None = None) -> Message:
    """The canonical assistant message; ``reasoning_content`` as HF templates read it (Qwen3's does)."""
    return {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {}),
            **({"tool_calls": calls} if calls else {})}


def openai_messages(messages: list[OpenAIMessage]) -> list[Message]:
    return [_openai_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _openai_message(m: OpenAIMessage, where: str) -> Message:
    if m.role in ("system", "developer"):
        return {"role": "system", "content": text_of(m.content, where)}
    if m.role == "user":
        return {"role": "user", "content": content_of(m.content, f"{where}.content")}
    if m.role == "assistant":
        calls = [tool_call(c.id, c.function.name, c.function.arguments, where) for c in m.tool_calls or []]
        return _assistant(text_of(m.content, where), calls, m.reasoning_content or m.reasoning)
    return {"role": "tool", "tool_call_id": m.tool_call_id, "content": content_of(m.content, f"{where}.content")}


def anthropic_messages(system: Content, messages: list[AnthropicMessage]) -> list[Message]:
    out = [{"role": "system", "content": text_of(system)}] if system else []
    for i, m in enumerate(messages):
        blocks = [TextPart(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        texts = [b for b in blocks if isinstance(b, TextPart | ImageBlock)]
        if m.role == "assistant":
            if any(isinstance(b, ToolResult | ImageBlock) for b in blocks):
                raise WireError(400, f"messages[{i}]: assistant blocks must be text, thinking or tool_use")
            calls = [tool_call(b.id, b.name, b.input, f"messages[{i}]") for b in blocks if isinstance(b, ToolUse)]
            thinking = "".join(b.thinking for b in blocks if isinstance(b, Thinking))
            out.append(_assistant(text_of(texts), calls, thinking))
            continue
        if any(isinstance(b, ToolUse | Thinking | RedactedThinking) for b in blocks):
            raise WireError(400, f"messages[{i}]: user blocks must be text, image or tool_result")
        results = [b for b in blocks if isinstance(b, ToolResult)]
        out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": content_of(b.content, f"messages[{i}]")}
                for b in results]
        if texts or not results:
            out.append({"role": "user", "content": content_of(texts, f"messages[{i}].content")})
    return out


def openai_tools(tools: list[OpenAITool] | None) -> list[dict] | None:
    """The schemas as sent, less ``strict``: an API switch for constrained decoding, not part of the tool's
    description (some frameworks always send it), so the same tool renders the same prompt from any client."""
    return [{"type": "function", "function": t.function.model_dump(exclude={"strict"})}
            for t in tools] if tools else None


def anthropic_tools(tools: list[AnthropicTool] | None) -> list[dict] | None:
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.input_schema}} for t in tools] if tools else None


def _finish(turn: Turn, calls: str, length: str, stop: str) -> str:
    return calls if turn.message.get("tool_calls") else length if turn.finish_reason == "length" else stop


def openai_response(turn: Turn, model: str, request_id: str) -> dict:
    calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
             for c in turn.message.get("tool_calls", [])]
    reasoning, content = split_reasoning(turn.message["content"])
    message = _assistant(content or (None if calls else ""), calls, reasoning)
    n_out = len(turn.token_ids)
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _finish(turn, "tool_calls", "length", "stop")}],
            "usage": {"prompt_tokens": turn.prompt_tokens, "completion_tokens": n_out,
                      "total_tokens": turn.prompt_tokens + n_out}}


async def openai_chunks(parts: AsyncIterator[Delta | Turn], model: str, request_id: str) -> AsyncIterator[tuple]:
    """The turn as (no event name, chat.completion.chunk) stream events while it is sampled (``parts``: its
    text deltas, then the Turn), ending with [DONE]; they add up to ``openai_response``. Tool calls come with
    the end of the turn."""
    head = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(delta: dict, finish: str | None = None, **extra: Any) -> tuple[None, dict]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return None, head | {"choices": [choice]} | extra

    yield chunk({"role": "assistant", "content": ""})
    async for part in parts:
        if isinstance(part, Turn):
            full = openai_response(part, model, request_id)
            break
        yield chunk({"reasoning_content" if part.kind == "reasoning" else "content": part.text})
    for i, call in enumerate(full["choices"][0]["message"].get("tool_calls", [])):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, full["choices"][0]["finish_reason"], usage=full["usage"])
    yield None, "[DONE]"


def anthropic_response(turn: Turn, model: str, request_id: str) -> dict:
    reasoning, content = split_reasoning(turn.message["content"])
    blocks = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
    blocks += [{"type": "text", "text": content}] if content else []
    blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": c["function"]["arguments"]}
               for c in turn.message.get("tool_calls", [])]
    return {"id": request_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": _finish(turn, "tool_use", "max_tokens", "end_turn"), "stop_sequence": None,
            "usage": {"input_tokens": turn.prompt_tokens, "output_tokens": len(turn.token_ids)}}


async def anthropic_events(parts: AsyncIterator[Delta | Turn], model: str,
                           request_id: str) -> AsyncIterator[tuple[str, dict]]:
    """The turn as (event name, data) stream events while it is sampled (``parts``: its text deltas, then
    the Turn); they add up to ``anthropic_response``. Tool uses come with the end of the turn."""
    def event(name: str, **data: Any) -> tuple[str, dict]:
        return name, {"type": name, **data}

    # input_tokens is known once the prompt is rendered; message_delta carries the final usage
    start = {"id": request_id, "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
    yield event("message_start", message=start)
    index, kind = -1, None  # the open block
    async for part in parts:
        if isinstance(part, Turn):
            full = anthropic_response(part, model, request_id)
            break
        if part.kind != kind:
            if kind is not None:
                yield event("content_block_stop", index=index)
            index, kind = index + 1, part.kind
            name = "thinking" if kind == "reasoning" else "text"  # the block's type, and its text's key
            block = {"type": name, name: ""} | ({"signature": ""} if kind == "reasoning" else {})
            yield event("content_block_start", index=index, content_block=block)
        yield event("content_block_delta", index=index, delta={"type": f"{name}_delta", name: part.text})
    if kind is not None:
        yield event("content_block_stop", index=index)
    for k, block in enumerate(full["content"][index + 1:], index + 1):  # the tool uses
        yield event("content_block_start", index=k, content_block=block | {"input": {}})
        partial = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield event("content_block_delta", index=k, delta=partial)
        yield event("content_block_stop", index=k)
    yield event("message_delta", usage=full["usage"], delta={"stop_reason": full["stop_reason"], "stop_sequence": None})
    yield event("message_stop")

