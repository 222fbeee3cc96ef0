"""Chat-template rendering as token *deltas*, for any HF tokenizer with a chat template.

Token identity (instar.contract): sampled ids are never decoded and re-tokenized into training
data. Between two sampled turns only the template text the model did not produce (the rest of the
assistant turn after its stop token, the next role headers, the observation, the generation prompt)
is rendered and tokenized, once, and appended to the exact ids so far.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2 import TemplateSyntaxError

from instar.config import ConfigError

Message = dict[str, Any]


def read_template(path: str | None, kwargs: dict | None, section: str) -> str | None:
    """The text of the ``--{section}.chat_template`` file (None without one), read where the run starts: a
    missing file, one that does not parse, or a ``--{section}.chat_template_kwargs`` key that is no Jinja
    name fails here, in one line, before any process loads a tokenizer."""
    if not (path or kwargs):
        return None
    from transformers.utils.chat_template_utils import _compile_jinja_template  # the environment HF renders in

    try:
        text = Path(path).read_text() if path else None
    except OSError as e:
        raise ConfigError(f"--{section}.chat_template {path!r} cannot be read ({e.strerror}); give a Jinja "
                          "chat template file") from None
    for flag, given, source in (("chat_template_kwargs", kwargs, _fixed(kwargs)), ("chat_template", path, text)):
        try:
            _compile_jinja_template(source or "")
        except TemplateSyntaxError as e:
            raise ConfigError(f"--{section}.{flag} {given!r} does not parse as Jinja (line {e.lineno}: "
                              f"{e.message}); fix it") from None
    return text


def _fixed(kwargs: dict | None) -> str:
    # one `set` per variable, ahead of the template: it overrides any value a caller of apply_chat_template passes
    return "".join(f"{{%- set {name} = {value!r} %}}" for name, value in (kwargs or {}).items())


def load_tokenizer(path: str, chat_template: str | None = None, template_kwargs: dict | None = None,
                   section: str = "data") -> Any:
    """The tokenizer of an HF checkpoint, the one place instar makes one. ``chat_template`` (a Jinja file, see
    `read_template`) replaces its template and ``template_kwargs`` are fixed into it, so every rendering of a
    conversation (RL prompts and deltas, the chat server, SFT, eval) sees the same template and variables."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if chat_template or template_kwargs:
        text = read_template(chat_template, template_kwargs, section) or tokenizer.chat_template
        tokenizer.chat_template = _fixed(template_kwargs) + text
    return tokenizer


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
    end = old.rfind(end_text, len(before))  # the assistant turn's end-of-turn token
    if not old.startswith(before) or not full.startswith(old) or end < 0:
        return None
    return full[end + (len(end_text) if ended else 0):]


def prompt_messages(prompt: str | list[Message], system_prompt: str | None = None) -> list[Message]:
    """A dataset prompt as chat messages: a string becomes one user turn; ``system_prompt`` goes first
    unless the prompt already has a system message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt is not None and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
