"""Attention over packed rows: transformers' FlexAttention (one document-causal BlockMask per forward,
found from the restarting position_ids) equals instar's per-sequence `packed_attention`, and
``--fsdp.attn_implementation auto`` picks it only where it can train (a CUDA GPU)."""

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from instar.contract import Sample
from instar.train.attention import attention_for
from instar.train.batch import collate
from instar.train.model import forward_logits, load_model, next_token_logprobs

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
NO_CPU_BACKWARD = ("flex gradients are checked on a CUDA GPU only: on CPU torch raises 'NotImplementedError: "
                   "FlexAttention does not support backward on CPU. Please set the input requires_grad to False "
                   "or use another device.'")
# Sequences longer than FlexAttention's 128-token blocks, so the BlockMask has full, partial and empty blocks.
LENGTHS = [150, 9, 200, 30, 4]


def make_sample(n: int, seed: int) -> Sample:
    ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    mask = [0] * (n // 2) + [1] * (n - n // 2)
    return Sample(ids, mask, [-1.0 if m else 0.0 for m in mask], [0 if m else -1 for m in mask])


def row_logprobs(model, mb) -> torch.Tensor:
    logp, _ = next_token_logprobs(forward_logits(model, mb.input_ids, mb.position_ids), mb.input_ids)
    return mb.unpack(logp)


def test_flex_logprobs_equal_packed_attention(tiny_model_dir):
    packed = load_model(tiny_model_dir, attn="packed").to(DEVICE)
    # On CPU load_model refuses flex (no backward there); its forward runs, so load it directly.
    flex = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="flex_attention").to(DEVICE)
    mb = collate([make_sample(n, i) for i, n in enumerate(LENGTHS)], list(range(len(LENGTHS))), device=DEVICE)
    with torch.no_grad():
        want, got = row_logprobs(packed, mb), row_logprobs(flex, mb)
        # The same row read as one sequence (attention across the packed samples) is far off: the
        # comparison above can fail.
        mb.position_ids = torch.arange(mb.input_ids.shape[1], device=DEVICE)[None]
        mixed = row_logprobs(flex, mb)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (mixed - want).abs().max() > 1e-2


@pytest.mark.skipif(not GPU, reason=NO_CPU_BACKWARD)
def test_flex_gradients_equal_packed_attention(tiny_model_dir):
    packed = load_model(tiny_model_dir, attn="packed").to(DEVICE)
    flex = load_model(tiny_model_dir, attn="flex_attention").to(DEVICE)
    assert flex.config._attn_implementation == "flex_attention"
    mb = collate([make_sample(n, i) for i, n in enumerate(LENGTHS)], list(range(len(LENGTHS))), device=DEVICE)
    for model in (packed, flex):
        row_logprobs(model, mb).sum().backward()
    for (name, a), b in zip(packed.named_parameters(), flex.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_auto_picks_flex_only_on_gpu(tiny_model_dir):
    assert attention_for(tiny_model_dir, "auto") == ("flex_attention" if GPU else "instar_packed")
    if GPU:
        assert attention_for(tiny_model_dir, "flex_attention") == "flex_attention"
    else:
        with pytest.raises(ValueError, match="flex_attention needs a CUDA GPU .* use packed \\(or auto\\) on CPU"):
            attention_for(tiny_model_dir, "flex_attention")
    if importlib.util.find_spec("flash_attn") is None or not GPU:
        with pytest.raises(ValueError, match="flash_attention_2 needs a CUDA GPU and the flash-attn package"):
            attention_for(tiny_model_dir, "flash_attention_2")
    assert attention_for(tiny_model_dir, "sdpa") == "sdpa"
    assert attention_for(tiny_model_dir, "packed") == "instar_packed"


def test_molts_te_value_runs_the_fastest_attention_here_and_says_which(tiny_model_dir, capsys):
    """TransformerEngine is installed neither here nor on our GPU machines: te falls back, in one printed line."""
    from instar.cli.main import parse

    fastest = "flash_attention_2" if GPU and importlib.util.find_spec("flash_attn") else ("flex_attention" if GPU
                                                                                           else "instar_packed")
    assert attention_for(tiny_model_dir, "te") == fastest
    assert capsys.readouterr().out == f"instar: --fsdp.attn_implementation te (TransformerEngine) runs {fastest}, " \
                                      "the fastest attention here\n"
    assert parse(["rl", "--fsdp.attn_implementation", "te"])[1].fsdp.attn_implementation == "te"


@pytest.mark.parametrize("lengths", [[40, 37, 29, 40], [90, 3, 5, 2]])  # one padded call / one call per sequence
def test_packed_attention_equals_per_sequence_sdpa_with_gradients(lengths):
    from instar.train.attention import packed_attention

    gen = torch.Generator().manual_seed(0)
    n, heads, kv_heads, d = sum(lengths), 4, 2, 16
    q, k, v = (torch.randn(1, h, n, d, generator=gen, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    module = torch.nn.Module().eval()
    got, _ = packed_attention(module, q, k, v, None, scaling=0.25, cu_seq_lens_q=cu)
    (got * torch.linspace(-1, 1, got.numel()).view_as(got)).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    parts = [torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                                              scale=0.25, enable_gqa=True)
             for a, b in zip(cu.tolist(), cu.tolist()[1:])]
    want = torch.cat(parts, dim=2).transpose(1, 2)
    (want * torch.linspace(-1, 1, want.numel()).view_as(want)).sum().backward()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad, atol=1e-6, rtol=1e-5)


def test_packed_attention_in_bfloat16_attends_in_float32():
    """A bf16 model's packed attention on CPU (--fsdp.mixed_precision bfloat16) computes in float32 (CPU
    SDPA is slow in bf16): its output and gradients are the float32 ones, rounded to bf16."""
    from instar.train.attention import Segments, packed_attention

    gen = torch.Generator().manual_seed(0)
    n, module = 12, torch.nn.Module().eval()
    segments = Segments((0, 4, 8, 12), ((), (0,), (0,)))  # a prompt and two continuations that see it
    q16, k16, v16 = (torch.randn(1, h, n, 8, generator=gen).bfloat16().requires_grad_() for h in (4, 2, 2))
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q16, k16, v16))
    weight = torch.linspace(-1, 1, n * 4 * 8).view(1, n, 4, 8)
    got, _ = packed_attention(module, q16, k16, v16, None, scaling=0.3, instar_segments=segments)
    want, _ = packed_attention(module, q32, k32, v32, None, scaling=0.3, instar_segments=segments)
    (got.float() * weight).sum().backward()
    (want * weight.bfloat16().float()).sum().backward()
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.bfloat16())
    for low, high in ((q16, q32), (k16, k32), (v16, v32)):
        assert low.grad.dtype == torch.bfloat16
        assert torch.equal(low.grad, high.grad.bfloat16())
