"""Tool-call formats: an assistant turn's sampled text split into (content, calls), chosen by the name
vLLM's ``--tool-call-parser`` gives the same format (``--data.tool_parser``).

A call is ``{"name": str, "arguments": dict}``. Text that looks like a call but does not parse as one
stays in the content as the model wrote it, so nothing sampled is lost; the rendered history is the chat
template's business (it writes the calls back in the model's own format).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

_JSON = json.JSONDecoder()
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MISTRAL_NAMED = re.compile(r"\s*([\w.\-]+)\s*\[ARGS\]\s*")


@dataclass(frozen=True)
class ToolParser:
    name: str
    split: Callable[[str], tuple[str, list[dict]]]
    starts: tuple[str, ...]  # text that may open a call: a stream holds the turn's text back from the first of them


def _call(obj: object, keys: tuple[str, ...] = ("arguments",)) -> dict | None:
    """``obj`` as a call, or None when it is not an object with a string name and object arguments."""
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    arguments = next((obj[k] for k in keys if k in obj), {})
    return {"name": obj["name"], "arguments": arguments} if isinstance(arguments, dict) else None


def _hermes(text: str) -> tuple[str, list[dict]]:
    """Hermes / Qwen: one JSON object per ``<tool_call>...</tool_call>`` block, anywhere in the turn."""
    calls, kept, last = [], [], 0
    for m in _HERMES.finditer(text):
        try:
            call = _call(json.loads(m.group(1)))
        except json.JSONDecodeError:
            continue
        if call is not None:
            calls.append(call)
            kept.append(text[last:m.start()])
            last = m.end()
    return (("".join(kept) + text[last:]).strip(), calls) if calls else (text, [])


def _llama3_json(text: str) -> tuple[str, list[dict]]:
    """Llama 3.x JSON: objects ``{"name": ..., "parameters" | "arguments": {...}}``, optionally after
    ``<|python_tag|>``, several separated by ``;``."""
    calls, kept, last, i = [], [], 0, text.find("{")
    while i >= 0:
        try:
            obj, end = _JSON.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            continue
        call = _call(obj, ("arguments", "parameters"))
        if call is not None:
            calls.append(call)
            kept.append(text[last:i])
            last = end
        i = text.find("{", end)  # an object's inner braces are not calls of their own
    if not calls:
        return text, []
    pieces = [p for p in [*kept, text[last:]] if p.replace("<|python_tag|>", "").strip(" \n\t;")]
    return "".join(pieces).replace("<|python_tag|>", "").strip(), calls


def _mistral(text: str) -> tuple[str, list[dict]]:
    """Mistral: ``[TOOL_CALLS]`` then a JSON list of calls (older tokenizers) or ``name[ARGS]{...}``
    (v11 and later), once per call. A block that does not parse leaves the whole turn as content."""
    head, *blocks = text.split("[TOOL_CALLS]")
    calls, rest = [], [head]
    for block in blocks:
        named = _MISTRAL_NAMED.match(block)
        start = named.end() if named else len(block) - len(block.lstrip())
        try:
            obj, end = _JSON.raw_decode(block, start)
        except json.JSONDecodeError:
            return text, []
        found = [_call({"name": named.group(1), "arguments": obj})] if named else \
            [_call(o) for o in obj] if isinstance(obj, list) else [_call(obj)]
        if not found or None in found:
            return text, []
        calls += found
        rest.append(block[end:])
    return ("".join(rest).strip(), calls) if calls else (text, [])


PARSERS = {p.name: p for p in (ToolParser("hermes", _hermes, ("<tool_call>",)),
                               ToolParser("llama3_json", _llama3_json, ("<|python_tag|>", "{")),
                               ToolParser("mistral", _mistral, ("[TOOL_CALLS]",)))}


def parser_named(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r}: one of {', '.join(PARSERS)}")
    return PARSERS[name]
