"""SFT data: chat-format conversations as token-level ``Sample``s whose ``action_mask`` marks
the assistant tokens, the only ones the loss sees.

Assistant spans come from the chat template itself, with no role markers written here: the
conversation is rendered prefix by prefix (``messages[:i]``, then with the generation prompt, then
``messages[:i+1]``) and each new piece of text is tokenized once and appended, as the RL transcript
does with template deltas. Pieces between the generation prompt and the end of an assistant message
(its content and the template's closing tokens) are trainable; everything else is context.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from instar.contract import NO_VERSION, ImageInputs, Sample
from instar.data.chat import encode, render
from instar.data.images import Vision, image_urls, normalise
from instar.data.records import Subset, lookup, read_records, without_nulls


class TemplateError(ValueError):
    """The chat template renders a conversation in a way spans cannot be read from."""


def _extend(done: str, text: str, where: str) -> str:
    if not text.startswith(done):
        raise TemplateError(f"the chat template does not render {where} as an extension of the messages before it "
                            "(it rewrites earlier turns, e.g. drops old reasoning); use a prefix-stable template")
    return text[len(done):]


def tokenize_conversation(tokenizer: Any, messages: list[dict],
                          tools: list | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 mask of the assistant tokens."""
    ids, mask, done = [], [], ""  # token ids, their 0/1 assistant mask, the text rendered so far

    def append(text: str, trainable: int) -> None:
        piece = encode(tokenizer, text) if text else []
        ids.extend(piece)
        mask.extend([trainable] * len(piece))

    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            prompt = render(tokenizer, messages[:i], tools, generation_prompt=True) if i else ""
            append(_extend(done, prompt, f"the generation prompt before message {i}"), 0)
            done = prompt
        full = render(tokenizer, messages[: i + 1], tools, generation_prompt=False)
        append(_extend(done, full, f"message {i}"), int(message.get("role") == "assistant"))
        done = full
    return ids, mask


def conversation_sample(tokenizer: Any, messages: list[dict], tools: list | None = None,
                        max_len: int | None = None, vision: Vision | None = None) -> Sample | None:
    """One conversation as a ``Sample`` (truncated to ``max_len`` tokens); None when no assistant
    token survives. Action tokens carry logprob 0 and version 0: no behaviour policy sampled them.
    With ``vision`` each image placeholder is expanded (`Vision.expand`); a cut never splits an image."""
    ids, mask = tokenize_conversation(tokenizer, messages, tools)
    images = None
    expanded, found = vision.expand(ids, image_urls(messages)) if vision is not None else (ids, [])
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
                     tools_key: str = "tools", split: str = "train", vision: Vision | None = None,
                     subset: Subset | None = None) -> list[Sample]:
    """Every conversation of a dataset (``instar.data.records``: a file, a directory or a hub name, its ``split``
    of ``subset``), in order: a list of chat messages under ``messages_key``, optional tool schemas under
    ``tools_key`` (dotted keys read nested fields)."""
    samples: list[Sample] = []
    for n, record in enumerate(read_records(source, split, "sft.dataset", subset)):
        messages = without_nulls(lookup(record, messages_key))
        if not isinstance(messages, list):
            raise ValueError(f"--sft.dataset {source!r}: record {n} has no message list under {messages_key!r} "
                             f"(columns: {sorted(record)}); set --sft.messages_key")
        if vision is not None:
            base = Path(source).parent if Path(source).is_file() else Path(source)
            messages = normalise(messages, base, f"--sft.dataset record {n}")
        tools = without_nulls(lookup(record, tools_key, None))
        sample = conversation_sample(tokenizer, messages, tools, max_len, vision)
        if sample is not None:
            samples.append(sample)
    if not samples:
        raise ValueError(f"--sft.dataset {source!r} holds no conversation with an assistant message; "
                         "nothing to train on")
    return samples
