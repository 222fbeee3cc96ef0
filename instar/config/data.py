"""Prompt data for RL (`--data.*`) and conversations for SFT (`--sft.*`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class DataConfig:
    """Prompt datasets."""

    prompt_dataset: str = ""
    """Training prompts, read with Hugging Face `datasets`: a JSON / JSONL, Parquet or CSV file, a directory of
    them, or a hub dataset name (needs the hub, or its local cache with HF_HUB_OFFLINE=1)."""
    split: str = "train"
    """Split of a --data.prompt_dataset directory or hub name (a single file is read whole)."""
    dataset_config: str | None = None
    """Configuration (subset) of a hub dataset, e.g. main for openai/gsm8k."""
    dataset_revision: str | None = None
    """Revision (branch, tag or commit) of a hub dataset."""
    data_files: str | list[str] | None = None
    """Files of a directory or hub dataset to read (names or globs, relative to it)."""
    input_key: str = "prompt"
    """Key of the prompt (a string or a list of chat messages) in each record. Every *_key may be dotted
    (reward_model.ground_truth) to read a nested field; a column with the exact name wins."""
    label_key: str = "label"
    """Key of the label given to the agent. Other columns reach it too (state["metadata"], ctx.metadata)."""
    tools_key: str = "tools"
    """Key of an optional list of tool schemas for the chat template."""
    image_key: str = "images"
    """Key of an optional list of images (file paths relative to the dataset, base64, data URLs or image
    bytes) shown in the first user turn, each at an ``<image>`` marker in its text or else before it.
    Images may also be content parts of the prompt's messages (``{"type": "image", "image": ...}``)."""
    tool_parser: Literal["hermes", "llama3_json", "mistral"] = "hermes"
    """Format of the tool calls the model writes (vLLM's --tool-call-parser names): Hermes/Qwen ``<tool_call>``
    JSON, Llama 3 JSON (``<|python_tag|>``), Mistral ``[TOOL_CALLS]``. The chat template writes them back."""
    chat_template: str | None = None
    """A Jinja chat template file to render every conversation with (RL, eval, the chat server) in place of the
    tokenizer's own."""
    chat_template_kwargs: dict | None = None
    """Variables the chat template reads (apply_chat_template keywords), as JSON: '{"enable_thinking": false}'."""
    system_prompt: str | None = None
    """System message prepended to every prompt."""
    max_len: int = 2048
    """Total token budget of one rollout (prompt + all turns); running out truncates it."""
    max_new_tokens: int = 256
    """Per-turn budget of sampled tokens."""
    shuffle: bool = True
    """Shuffle prompts each epoch (seeded by --actor.seed)."""

@dataclass
class SFTSection:
    """Supervised fine-tuning data and schedule."""

    dataset: str = ""
    """Chat conversations (a `messages` list per record): a JSON / JSONL, Parquet or CSV file, a directory of
    them, or a hub dataset name, read with Hugging Face `datasets`."""
    split: str = "train"
    """Split of an --sft.dataset directory or hub name (a single file is read whole)."""
    dataset_config: str | None = None
    """Configuration (subset) of a hub dataset."""
    dataset_revision: str | None = None
    """Revision (branch, tag or commit) of a hub dataset."""
    data_files: str | list[str] | None = None
    """Files of a directory or hub dataset to read (names or globs, relative to it)."""
    messages_key: str = "messages"
    """Key of the message list in each record (dotted for a nested field)."""
    chat_template: str | None = None
    """A Jinja chat template file used in place of the tokenizer's own (see --data.chat_template)."""
    chat_template_kwargs: dict | None = None
    """Variables the chat template reads (apply_chat_template keywords), as JSON: '{"enable_thinking": false}'."""
    epochs: int = 1
    """Passes over the dataset."""
    batch_size: int = 16
    """Samples per optimizer step: a conversation is one sample, or more where the chat template rewrites earlier
    turns (see docs/data.md, Chat templates)."""
    max_len: int = 1024
    """Longest conversation in tokens; longer ones are truncated."""
    max_tokens_per_gpu: int = 16384
    """Token budget of one trainer micro-batch (packed, no padding)."""
    eval_fraction: float = 0.0
    """Fraction of conversations held out to report eval loss."""
    eval_steps: int = 0
    """Report the held-out loss every N steps; 0: only before the first and after the last step."""
