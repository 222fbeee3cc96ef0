"""Chat-template rendering as token *deltas*, for any HF tokenizer with a chat template.

Token identity (instar.contract): sampled ids are never decoded and re-tokenized into training
data. Between two sampled turns only the template text the model did not produce (the rest of the
assistant turn after its stop token, the next role headers, the observation, the generation prompt)
is rendered and tokenized, once, and appended to the exact ids so far.
"""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]


def render(tokenizer: Any, messages: list[Message], tools: list[dict] | None = None, *,
           generation_prompt: bool) -> str:
    """The conversation as the tokenizer's chat template writes it."""
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Tokenize template text as it stands: the template already wrote every special token."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer: Any, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
    """The first context of a segment: the whole conversation plus the generation prompt."""
    return encode(tokenizer, render(tokenizer, messages, tools, generation_prompt=True))


def continuation_text(tokenizer: Any, history: list[Message], messages: list[Message], tools: list[dict] | None,
                      end_text: str, ended: bool) -> str | None:
    """The template text that follows the last sampled token when ``messages`` extend ``history``.

    ``history`` ends with the assistant message that was sampled; ``end_text`` is the text of the
    end-of-turn token and ``ended`` says whether the model sampled it (else the template's own copy
    is part of the delta). Returns None when the template does not render the old conversation as a
    prefix of the new one (history rewritten, earlier reasoning dropped): the caller opens a new segment.
    """
    if len(messages) <= len(history) or messages[:len(history)] != history or history[-1]["role"] != "assistant":
        return None
    before = render(tokenizer, history[:-1], tools, generation_prompt=True)
    old = render(tokenizer, history, tools, generation_prompt=False)
    full = render(tokenizer, messages, tools, generation_prompt=True)
    if not old.startswith(before) or not full.startswith(old):
        return None
    end = old.rfind(end_text, len(before))
    if end < 0:
        return None
    return full[end + (len(end_text) if ended else 0):]


def prompt_messages(prompt: str | list[Message], system_prompt: str | None = None) -> list[Message]:
    """A dataset prompt as chat messages: a string becomes one user turn; ``system_prompt`` goes first
    unless the prompt already has a system message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt is not None and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
