"""SFT data: chat-format conversations as token-level ``Sample``s whose ``action_mask`` marks
the assistant tokens, the only ones the loss sees.

Assistant spans come from the chat template itself, with no role markers written here: at each assistant
message ``i`` the conversation is rendered up to it with the generation prompt (its context) and then with
it (``messages[:i+1]``); each new piece of text is tokenized once and appended, as the RL transcript does
with template deltas. The pieces from the generation prompt to the end of the message are trainable.

A template may render a turn's context as something other than an extension of the text before it (one
that drops the reasoning of earlier assistant turns, as Qwen3's does): that turn starts a new sample from
its context as the template renders it, so each turn is trained on what the model sees when it writes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from instar.config import ConfigError
from instar.contract import NO_VERSION, ImageInputs, Sample
from instar.data.chat import encode, render
from instar.data.images import Vision, image_urls, normalise
from instar.data.records import Subset, lookup, read_records, without_nulls


class TemplateError(ValueError):
    """The chat template renders a conversation in a way spans cannot be read from."""


def tokenize_conversation(tokenizer: Any, messages: list[dict],
                          tools: list | None = None) -> list[tuple[list[int], list[int], int]]:
    """Token ids of the rendered conversation, a 0/1 mask of the assistant tokens and how many messages they
    cover: one such piece, or one more at each assistant turn whose context breaks the prefix."""
    pieces, ids, mask, done, end = [], [], [], "", 0  # done: the text ``ids`` hold
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], tools, generation_prompt=True) if i else ""
        if not prompt.startswith(done):  # the template rewrote earlier turns: a new sample from this context
            pieces.append((ids, mask, end))
            ids, mask, done = [], [], ""
        full = render(tokenizer, messages[: i + 1], tools, generation_prompt=False)
        if not full.startswith(prompt):
            raise TemplateError(f"the chat template does not render assistant message {i} after its generation "
                                "prompt, so its tokens cannot be told apart; use a template that does")
        for text, trainable in ((prompt[len(done):], 0), (full[len(prompt):], 1)):
            piece = encode(tokenizer, text) if text else []
            ids.extend(piece)
            mask.extend([trainable] * len(piece))
        done, end = full, i + 1
    return [*pieces, (ids, mask, end)]


def conversation_samples(tokenizer: Any, messages: list[dict], tools: list | None = None,
                         max_len: int | None = None, vision: Vision | None = None) -> list[Sample]:
    """One conversation as ``Sample``s, one per piece of `tokenize_conversation` that keeps an assistant token
    once truncated to ``max_len``. Action tokens carry logprob 0 and version 0: no behaviour policy sampled
    them. With ``vision`` each image placeholder is expanded (`Vision.expand`); a cut never splits an image."""
    pieces = tokenize_conversation(tokenizer, messages, tools)
    samples = [_sample(ids, mask, image_urls(messages[:end]), max_len, vision) for ids, mask, end in pieces]
    return [s for s in samples if s is not None]


def _sample(ids: list[int], mask: list[int], urls: list[str], max_len: int | None,
            vision: Vision | None) -> Sample | None:
    images = None
    expanded, found = vision.expand(ids, urls) if vision is not None else (ids, [])
    if found:
        counts = iter(im.counts[0] for im in found)  # a placeholder's copies take its mask value
        mask = [m for t, m in zip(ids, mask) for _ in range(next(counts) if t == vision.token_id else 1)]
        ids = expanded
        runs = ImageInputs.cat(found).runs(ids)
        if max_len is not None:  # a cut before an image that does not fit whole: no image is split
            max_len = min([max_len, *(start for start, end in runs if end > max_len)])
        images = ImageInputs.cat([im for (_, end), im in zip(runs, found) if max_len is None or end <= max_len])
    ids, mask = ids[:max_len], mask[:max_len]
    if not any(mask):
        return None
    return Sample(token_ids=ids, action_mask=mask, rollout_logprobs=[0.0] * len(ids),
                  versions=[0 if m else NO_VERSION for m in mask], images=images)


def load_sft_samples(source: str, tokenizer: Any, messages_key: str = "messages", max_len: int | None = None,
                     split: str = "train", vision: Vision | None = None, subset: Subset | None = None) -> list[Sample]:
    """Every conversation of a dataset (``instar.data.records``: a file, a directory or a hub name, its ``split``
    of ``subset``), in order: a list of chat messages under ``messages_key`` (a dotted key reads a nested field),
    optional tool schemas under ``tools``."""
    samples: list[Sample] = []
    for n, record in enumerate(read_records(source, split, "sft.dataset", subset)):
        messages = without_nulls(lookup(record, messages_key))
        if not isinstance(messages, list):
            raise ConfigError(f"--sft.dataset {source!r}: record {n} has no message list under {messages_key!r} "
                              f"(columns: {sorted(record)}); set --sft.messages_key")
        if vision is not None:
            base = Path(source).parent if Path(source).is_file() else Path(source)
            messages = normalise(messages, base, f"--sft.dataset record {n}")
        tools = without_nulls(lookup(record, "tools", None))
        samples.extend(conversation_samples(tokenizer, messages, tools, max_len, vision))
    if not samples:
        raise ConfigError(f"--sft.dataset {source!r} holds no conversation with an assistant message; "
                          "nothing to train on")
    return samples
