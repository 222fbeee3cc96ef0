"""The one accumulator both agent forms build trajectories with (one mechanism, one set of tests).

Given the next full list of chat messages it renders only the template delta, appends its tokens to
the exact ids sampled so far, asks the engine for the next turn and records the sampled ids with
action_mask 1, their logprobs and policy versions. Messages that do not extend the previous ones
(compaction, a template that drops earlier reasoning) seal the segment and open a new one. An assistant
turn that comes back re-serialised by the client (whitespace, reasoning moved to its own field or dropped,
escaped text) is matched to the turn instar sampled at that position and keeps its sampled tokens.

A turn changes the record only once the engine has answered: an engine error or a cancelled request
leaves it as it was, so a retry samples on exactly the same context.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import html
import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from instar.contract import NO_VERSION, Generation, ImageInputs, Sample, SamplingParams
from instar.data.chat import Message, continuation_text, encode, prompt_ids
from instar.data.images import Vision, image_urls
from instar.data.tool_calls import parser_named
from instar.engines.protocol import Sampled, Sampler


@dataclass
class Turn:
    """One sampled assistant turn. ``message`` is the assistant message as the chat template and the
    wire protocols see it (tool calls parsed out of ``text``); ``text`` is the decoded sampled ids
    without the end-of-turn token. An empty ``token_ids`` means the context budget ran out first."""

    message: Message
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", "abort"
    prompt_tokens: int


_THINK = re.compile(r"\s*(?:<think>)?(.*?)</think>\s*", re.DOTALL)  # Qwen-style reasoning at a turn's start


def split_reasoning(content: str) -> tuple[str, str]:
    """A sampled turn's (reasoning, content): the text up to ``</think>`` (the opening tag may be the
    template's generation prompt, not sampled) and the rest; ("", content) when there is no reasoning."""
    found = _THINK.match(content)
    return (found.group(1).strip("\n"), content[found.end():]) if found else ("", content)


INLINE_RENDER_CHARS = 16384
"""Requests shorter than this (as JSON) are rendered on the event loop, longer ones on a worker thread."""


def _first_prompt(tokenizer: Any, messages: list[Message], tools: list[dict] | None) -> list[int]:
    """`prompt_ids`, computed once for the samples of a group (they start from one prompt)."""
    try:
        conversation = json.dumps([messages, tools])  # key order kept: a template may print it
    except TypeError:  # not plain JSON: render it as it is
        return prompt_ids(tokenizer, messages, tools)
    return list(_cached_prompt(tokenizer, conversation))


@functools.lru_cache(maxsize=256)
def _cached_prompt(tokenizer: Any, conversation: str) -> tuple[int, ...]:
    return tuple(prompt_ids(tokenizer, *json.loads(conversation)))


def _echo_key(message: Message) -> tuple[str, list]:
    """What a client's re-serialisation of an assistant turn keeps: the letters and digits of its content
    without reasoning (escapes undone) and its tool calls."""
    text = html.unescape(split_reasoning(message.get("content") or "")[1])
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return "".join(ch for ch in text if ch.isalnum()), calls


@dataclass
class _Segment:
    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed: list[torch.Tensor | None] = field(default_factory=list)  # (moe_layers, top_k) per token, MoE only
    images: list[ImageInputs] = field(default_factory=list)  # those whose placeholders are in token_ids

    def append(self, ids: list[int], gen: Generation | None = None) -> None:
        """Template tokens when ``gen`` is None, else the sampled tokens of ``gen``."""
        self.token_ids += ids
        self.action_mask += [int(gen is not None)] * len(ids)
        self.rollout_logprobs += list(gen.logprobs) if gen else [0.0] * len(ids)
        self.versions += list(gen.versions) if gen else [NO_VERSION] * len(ids)
        routed = gen.routed_experts if gen is not None else None
        self.routed += list(routed.unbind(0)) if routed is not None else [None] * len(ids)

    def to_sample(self) -> Sample:
        known = next((r for r in self.routed if r is not None), None)
        # The engine reports the experts of the tokens it sampled; -1 marks template tokens, whose
        # routing the trainer computes itself (the protocol does not return prefill routing).
        routed = None if known is None else torch.stack([torch.full_like(known, -1) if r is None else r
                                                         for r in self.routed])
        return Sample(list(self.token_ids), list(self.action_mask), list(self.rollout_logprobs),
                      list(self.versions), routed_experts=routed, images=ImageInputs.cat(self.images))


class Transcript:
    """The token-exact record of one session (one rollout).

    Budgets: the context of the open segment never exceeds ``max_len`` tokens and a turn samples at
    most ``max_new_tokens``; a turn that ends without its end-of-turn token marks the transcript
    ``truncated``. An identical retry of the last request is answered from cache, not sampled again.
    """

    def __init__(self, engine: Sampler, tokenizer: Any, *, session_id: str, max_len: int, max_new_tokens: int,
                 stop_token_ids: list[int] | None = None, tool_parser: str = "hermes",
                 vision: Vision | None = None) -> None:
        self.engine, self.tokenizer, self.session_id, self.vision = engine, tokenizer, session_id, vision
        self.tool_parser = parser_named(tool_parser)
        self.max_len, self.max_new_tokens = max_len, max_new_tokens
        self.stop_token_ids = stop_token_ids if stop_token_ids is not None else [tokenizer.eos_token_id]
        self.sealed: list[Sample] = []
        self.truncated = False
        self.last_finish_reason = "stop"
        self.messages: list[Message] = []  # the conversation the open segment holds, ending with a sampled turn
        self._tools: list[dict] | None = None
        self._open: _Segment | None = None
        self._ended = True  # the last turn ended with its end-of-turn token
        self.turns = self.tool_calls = 0
        self._cache: tuple[str, Turn] | None = None

    @property
    def segments(self) -> list[Sample]:
        """Sealed segments plus the open one; segments without an action token are left out."""
        found = self.sealed + ([self._open.to_sample()] if self._open else [])
        return [s for s in found if s.num_actions]

    def seal(self) -> None:
        if self._open is not None:
            self.sealed.append(self._open.to_sample())
        self._open, self.messages = None, []

    async def sample(self, messages: list[Message], tools: list[dict] | None = None,
                     sampling: SamplingParams | None = None,
                     on_tokens: Callable[[list[int], Sampled], None] | None = None) -> Turn:
        """Extend the transcript with ``messages`` (the whole conversation so far) and sample one turn.
        ``on_tokens(prompt_ids, sampled)`` streams it: called as the engine samples, end-of-turn id left out."""
        sampling = sampling or SamplingParams()
        key = json.dumps([messages, tools, asdict(sampling)], sort_keys=True, default=str)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        messages = self._with_sampled_turns(messages)
        # Rendering and tokenizing a long conversation takes seconds: off the event loop, so the chat server
        # keeps serving other sessions meanwhile. A short one takes well under a millisecond, less than the hop.
        inline = len(key) < INLINE_RENDER_CHARS
        if inline or self._open is None:  # no segment open: nothing to extend, no delta to render
            new_ids = self._delta_ids(messages, tools)
        else:
            new_ids = await asyncio.to_thread(self._delta_ids, messages, tools)
        extends = new_ids is not None
        context = list(self._open.token_ids) if extends else []
        if not extends:
            new_ids = _first_prompt(self.tokenizer, messages, tools) if inline else await asyncio.to_thread(
                prompt_ids, self.tokenizer, messages, tools)
        images: list[ImageInputs] = []
        if self.vision is not None:  # the delta's placeholders are those of the conversation's last images
            urls = image_urls(messages)
            new_ids, images = self.vision.expand(new_ids, urls[len(urls) - new_ids.count(self.vision.token_id):])
        room = self.max_len - len(context) - len(new_ids)
        if room <= 0:  # not even the observation fits: the rollout ends here
            self.truncated, self.last_finish_reason = True, "length"
            turn = Turn({"role": "assistant", "content": ""}, "", [], "length", len(context) + len(new_ids))
            self._cache = (key, turn)
            return turn
        # turn k of a seeded session samples from its own seed: reproducible, and no two turns draw alike
        params = sampling.derived(self.turns).replace(max_tokens=min(sampling.max_tokens, self.max_new_tokens, room),
                                  stop_token_ids=sorted({*sampling.stop_token_ids, *self.stop_token_ids}))
        prompt = context + new_ids
        seen = ImageInputs.cat((self._open.images if extends else []) + images)
        extra = {} if seen is None else {"images": seen}  # a text-only engine call stays as it was
        gen = await (self.engine.generate(prompt, params, self.session_id, **extra) if on_tokens is None
                     else self._streamed(prompt, params, on_tokens, extra))
        if not extends:
            self.seal()
            self._open = _Segment()
        self._open.append(new_ids)
        self._open.images += images
        turn = self._record(self._open, gen, messages, tools)
        self._cache = (key, turn)
        return turn

    async def _streamed(self, prompt: list[int], params: SamplingParams,
                        on_tokens: Callable[[list[int], Sampled], None], extra: dict) -> Generation:
        async with contextlib.aclosing(self.engine.stream(prompt, params, self.session_id, **extra)) as items:
            async for item in items:
                if isinstance(item, Generation):
                    return item
                on_tokens(prompt, Sampled(item.start, [t for t in item.token_ids if t not in self.stop_token_ids]))
        raise RuntimeError("the engine's stream ended without its Generation")

    def _with_sampled_turns(self, messages: list[Message]) -> list[Message]:
        """``messages`` with each assistant turn that re-serialises the one recorded at its position
        replaced by the recorded one, so the history still extends the open segment."""
        return [old if new.get("role") == old["role"] == "assistant" and _echo_key(new) == _echo_key(old) else new
                for old, new in zip(self.messages, messages)] + messages[len(self.messages):]

    def _delta_ids(self, messages: list[Message], tools: list[dict] | None) -> list[int] | None:
        """Tokens of the template delta when ``messages`` extend the open segment, else None."""
        if self._open is None or tools != self._tools:
            return None
        end_text = self.tokenizer.decode([self.stop_token_ids[0]], skip_special_tokens=False)
        text = continuation_text(self.tokenizer, self.messages, messages, tools, end_text, self._ended)
        return None if text is None else encode(self.tokenizer, text)

    def _record(self, seg: _Segment, gen: Generation, messages: list[Message], tools: list[dict] | None) -> Turn:
        prompt_tokens = len(seg.token_ids)
        ids = list(gen.token_ids)
        seg.append(ids, gen)
        self._ended = bool(ids) and ids[-1] in self.stop_token_ids
        text = self.tokenizer.decode(ids[:-1] if self._ended else ids, skip_special_tokens=False)
        content, calls = self.tool_parser.split(text)
        calls = [{"id": f"call_{self.turns}_{i}", "type": "function", "function": c} for i, c in enumerate(calls)]
        message: Message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        self.turns, self.tool_calls = self.turns + 1, self.tool_calls + len(calls)
        self.messages, self._tools = [*messages, message], tools
        self.last_finish_reason = gen.finish_reason
        self.truncated = self.truncated or gen.finish_reason == "length"
        return Turn(message, text, ids, gen.finish_reason, prompt_tokens)
