"""The tiny-model kit: a random-init Qwen3 (or Qwen3-MoE, or Qwen3-VL) model and a byte-level BPE
tokenizer with a ChatML tool-calling template, built fully offline and byte-identically from the same spec.

Tests, examples and the CPU quick start all run on these models; vLLM's CPU build loads them too
(hence head_dim >= 32).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from instar.config import ConfigError

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>", "<think>", "</think>"]

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# chat_template.jinja: ChatML in the Qwen convention: tools listed in the system turn, calls as JSON inside
# <tool_call> tags in the assistant turn, consecutive tool results grouped into one user turn. HF renders
# templates with trim_blocks, which eats a newline right after a tag: those are written as {{ '\n' }}.
CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text()


@dataclass
class TinySpec:
    """Shape of a tiny model. head_dim >= 32 keeps it loadable by vLLM's CPU attention."""

    seed: int = 0
    """Seed of the random weight init (same spec and seed: byte-identical files)."""
    layers: int = 2
    """Decoder layers."""
    hidden: int = 64
    """Hidden size."""
    heads: int = 2
    """Attention heads."""
    kv_heads: int = 1
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 32
    """Per-head dimension (>= 32 for vLLM's CPU attention)."""
    intermediate: int = 128
    """MLP width (per expert with --moe)."""
    vocab_size: int = 512
    """BPE vocabulary size, special tokens included."""
    moe: bool = False
    """Build a Qwen3-MoE model (every layer sparse)."""
    experts: int = 4
    """Experts per MoE layer."""
    top_k: int = 2
    """Experts routed per token."""
    split_digits: bool = True
    """Tokenize every digit as its own token (as Qwen does)."""
    vlm: bool = False
    """Build a Qwen3-VL vision-language model: a vision tower (one deepstack level) before the decoder,
    the vision tokens in the tokenizer and Qwen's image processor (PIL backend)."""
    vision_layers: int = 1
    """Vision transformer blocks (with --vlm)."""
    patch_size: int = 16
    """Vision patch size in pixels (with --vlm); 2x2 patches merge into one image token."""
    image_pixels: int = 128 * 128
    """Largest image area the processor keeps (with --vlm): bigger images are resized down to it, so a
    128x128 image is 8x8 patches, 16 image tokens."""

    def check(self) -> None:
        if self.head_dim < 32:
            raise ConfigError(f"--head-dim must be >= 32 (vLLM's CPU attention rejects smaller), got {self.head_dim}")
        if self.heads % self.kv_heads:
            raise ConfigError(f"--heads ({self.heads}) must be a multiple of --kv-heads ({self.kv_heads})")
        if self.vocab_size < (least := 256 + len(SPECIAL_TOKENS) + 16):
            raise ConfigError(f"--vocab-size must be >= {least} (bytes, specials, some merges)")
        if self.vlm and self.moe:
            raise ConfigError("--vlm and --moe cannot be combined (the kit builds a dense Qwen3-VL)")
        if self.moe and not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"--top-k must be in [1, --experts={self.experts}], got {self.top_k}")


def build_tiny_model(out_dir: str | Path, spec: TinySpec | None = None) -> Path:
    """Write model weights, config, tokenizer and chat template into ``out_dir``; returns the path."""
    from transformers.utils import logging as hf_logging

    spec = spec or TinySpec()
    spec.check()
    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec)
    tokenizer.save_pretrained(out)
    torch.manual_seed(spec.seed)
    model = build_vlm(spec, tokenizer) if spec.vlm else build_model(spec, tokenizer)
    # Sampling defaults must come from instar's SamplingParams, never from the checkpoint.
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    if spec.vlm:
        image_processor(spec).save_pretrained(out)
    (out / "instar_tiny_spec.json").write_text(json.dumps(asdict(spec), indent=1, sort_keys=True) + "\n")
    return out


def _decoder(spec: TinySpec, tokenizer) -> dict:
    """The decoder's config, the same in the text and the vision-language model."""
    pad, eos = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    return dict(vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                head_dim=spec.head_dim, max_position_embeddings=4096, bos_token_id=pad, eos_token_id=eos,
                pad_token_id=pad, dtype="float32")


def build_model(spec: TinySpec, tokenizer) -> torch.nn.Module:
    """Random init from the torch seed the caller set."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(_decoder(spec, tokenizer), tie_word_embeddings=True)
    if spec.moe:
        config = Qwen3MoeConfig(moe_intermediate_size=spec.intermediate, num_experts=spec.experts,
                                num_experts_per_tok=spec.top_k, decoder_sparse_step=1, norm_topk_prob=True, **common)
        return Qwen3MoeForCausalLM(config)
    return Qwen3ForCausalLM(Qwen3Config(**common))


def build_vlm(spec: TinySpec, tokenizer) -> torch.nn.Module:
    """A Qwen3-VL: Qwen3's decoder with interleaved multimodal rotary positions, a vision tower whose
    merged patches replace the image placeholder tokens, and one deepstack level (the vision tower's
    first block's features added to the decoder's hidden states after its first layer)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    half = spec.head_dim // 2  # rotary frequencies split over (time, height, width), as Qwen3-VL's 24/20/20 of 64
    section = [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16]
    text = dict(_decoder(spec, tokenizer), rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                            "mrope_section": section, "mrope_interleaved": True})
    vision = dict(depth=spec.vision_layers, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                  num_heads=spec.heads, patch_size=spec.patch_size, spatial_merge_size=2, temporal_patch_size=2,
                  out_hidden_size=spec.hidden, deepstack_visual_indexes=[0],
                  num_position_embeddings=max(16, spec.image_pixels // spec.patch_size ** 2))
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    return Qwen3VLForConditionalGeneration(config)


def image_processor(spec: TinySpec):
    """Qwen's image processor (the PIL backend: no torchvision needed), sized for small images."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side = spec.patch_size * 2  # one merged image token
    return Qwen2VLImageProcessorPil(patch_size=spec.patch_size, merge_size=2, temporal_patch_size=2,
                                    min_pixels=side * side, max_pixels=max(side * side, spec.image_pixels))


def build_tokenizer(spec: TinySpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # One token per digit (as Qwen does) lets a tiny model learn arithmetic digit by digit.
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if spec.split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    if spec.vlm:  # after the merges: a VLM's text tokens keep the ids of the text-only kit's
        tok.add_special_tokens(list(VISION_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, chat_template=CHAT_TEMPLATE,
                                   model_max_length=4096, clean_up_tokenization_spaces=False)


_WORDS = ("the answer is what number result compute calculate tool call function name arguments expression "
          "user assistant system please help solve problem question think step first then final value sum "
          "product of and plus times minus equals check use calculator return json a an to is in for with "
          "you can this that it be are was not on as by at from hello thanks sure here correct wrong good").split()


def corpus() -> list[str]:
    """A small deterministic training text: words, arithmetic, tool-call JSON, chat markup."""
    rng = random.Random(1234)
    lines = []
    for _ in range(400):
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))).capitalize() + ".")
        a, b, c = rng.randint(10, 999), rng.randint(10, 99), rng.randint(1, 999)
        lines.append(f"What is {a}*{b}+{c}? The answer is {a * b + c}.")
        call = {"name": "calculator", "arguments": {"expression": f"{a}*{b}+{c}"}}
        lines.append(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
        lines.append(f"<tool_response>\n{a * b + c}\n</tool_response>")
        lines.append("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nSure, here is the result.<|im_end|>")
    return lines
