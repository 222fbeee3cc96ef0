"""A turn's text while the engine samples it: sampled ids in, text deltas out that are sure to be part of
the finished turn, so a stream can send them before it ends.

What waits: the bytes of an incomplete UTF-8 character; text that may open a tool call (``<tool_call>`` in
the default format) and everything after it (a call needs its whole text to parse, and is sent when the
turn ends); whitespace at either end of the answer
(stripped when the turn holds a tool call). Reasoning (``<think>``...``</think>``, the opening tag sampled
or written by the generation prompt) is sent whole once ``</think>`` is sampled; the answer after it
streams token by token. `LiveText.rest` gives what waited, from the finished turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from instar.agents.transcript import Turn, split_reasoning
from instar.engines.protocol import Sampled


@dataclass
class Delta:
    kind: Literal["reasoning", "content"]
    text: str


class LiveText:
    """One streamed turn's decoder."""

    def __init__(self, tokenizer: Any, call_starts: tuple[str, ...] = ("<tool_call>",)) -> None:
        self.tokenizer, self.call_starts = tokenizer, call_starts
        self.ids: list[int] = []
        self.text = ""  # decoded ids[:_read], whole characters only
        self._prefix = self._read = 0  # decode from _prefix: a tokenizer may write a token differently at the start
        self.opened: bool | None = None  # the generation prompt ends with <think>
        self.sent = {"reasoning": "", "content": ""}

    def add(self, prompt_ids: list[int], sampled: Sampled) -> list[Delta]:
        """The new deltas once ``sampled`` (an increment of the turn's ids) is added."""
        if self.opened is None:
            self.opened = self._decode(prompt_ids[-4:]).rstrip().endswith("<think>")
        self.ids += sampled.token_ids
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if not now.endswith("\ufffd"):  # else the last token ends inside a character: wait for the rest
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._send(self._safe())

    def rest(self, turn: Turn) -> list[Delta]:
        """What the finished turn adds to the deltas sent so far."""
        final = split_reasoning(turn.message["content"])
        if not all(text.startswith(self.sent[kind]) for kind, text in zip(("reasoning", "content"), final)):
            raise RuntimeError("the streamed text is not the text of the finished turn (the model closed a reasoning "
                               "block it never opened); send the same request again: it is answered from the "
                               "recorded turn")
        return self._send(final)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _safe(self) -> tuple[str, str]:
        """(reasoning, content) that the finished turn is sure to begin with."""
        cut = min(_opening(self.text, start) for start in self.call_starts)
        text = self.text[:cut].rstrip()
        if "</think>" in text:  # the reasoning is complete (split as the finished turn will be)
            return split_reasoning(text)
        # held while it may still open reasoning, or starts with whitespace (which a tool call's turn strips)
        held = self.opened or "<think>".startswith(text.lstrip()[:len("<think>")]) or text[:1].isspace()
        return "", ("" if held else text)

    def _send(self, safe: tuple[str, str]) -> list[Delta]:
        deltas = []
        for kind, text in zip(("reasoning", "content"), safe):
            sent = self.sent[kind]
            if len(text) > len(sent) and text.startswith(sent):
                deltas.append(Delta(kind, text[len(sent):]))
                self.sent[kind] = text
        return deltas


def _opening(text: str, start: str) -> int:
    """Where ``start`` first occurs in ``text``, or begins at its end (the rest may still come); else len(text)."""
    if (cut := text.find(start)) >= 0:
        return cut
    return next((i for i in range(max(len(text) - len(start), 0), len(text)) if start.startswith(text[i:])), len(text))
