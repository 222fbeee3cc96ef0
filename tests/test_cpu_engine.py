"""The CPU accelerator in the embedded engine: its dense layers as AOTInductor kernels, against the eager layer
and HF transformers (greedy tokens, logprobs, a weight update, the build cache, a failed or corrupt build)."""

import asyncio
import copy
import os
from pathlib import Path

import pytest
import torch
from helpers.engine import PROMPTS, hf_greedy, hf_logprobs, perturbed, swap_mid_turn
from transformers import AutoModelForCausalLM

from instar.config import EngineConfig
from instar.contract import SamplingParams
from instar.cpu import engine as cpu_engine
from instar.cpu.aot import AotLayers
from instar.cpu.build import cache_dir
from instar.engines import EmbeddedEngine
from instar.engines import kv_model as km


def aot_layers(model):
    accelerator = cpu_engine.accelerator(model)
    return accelerator and accelerator.layers


def accelerated(model, body):
    """`test_engine.run_engine` with the accelerator."""
    async def main():
        engine = EmbeddedEngine(copy.deepcopy(model), EngineConfig(), accelerator=cpu_engine.accelerator(model))
        try:
            return await body(engine)
        finally:
            await engine.close()
    return asyncio.run(main())


@pytest.mark.parametrize("tokens", [1, 2, 37])  # one token runs the build's smallest size (2) and keeps one
def test_the_compiled_halves_equal_the_eager_layer(dense, tokens):
    layer = km.decoder(dense).layers[1]
    aot = aot_layers(dense)
    g = torch.Generator().manual_seed(tokens)
    width, hidden = layer.self_attn.q_proj.weight.shape
    h, o = torch.randn(tokens, hidden, generator=g), torch.randn(tokens, width, generator=g)
    positions = torch.arange(tokens)[None] + 5
    with torch.inference_mode():
        cos, sin = km.decoder(dense).rotary_emb(h, positions)
        cos, sin = cos[0, :, None], sin[0, :, None]
        half = sin.shape[-1] // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        q, k, v = aot.before_attention(layer, h, cos, sin)
        attn, d = layer.self_attn, layer.self_attn.head_dim
        x = km._norm(layer.input_layernorm, h)
        want_q = km._norm(attn.q_norm, km._linear(attn.q_proj, x).view(tokens, -1, d))
        want_k = km._norm(attn.k_norm, km._linear(attn.k_proj, x).view(tokens, -1, d))
        want_v = km._linear(attn.v_proj, x).view(tokens, -1, d)
        want_q = want_q * cos + want_q.roll(d // 2, -1) * sin
        want_k = want_k * cos + want_k.roll(d // 2, -1) * sin
        for got, want in ((q, want_q), (k, want_k), (v, want_v)):
            assert got.shape == want.shape
            assert (got - want).abs().max() < 1e-5
        out = aot.after_attention(layer, h, o)
        mid = h + km._linear(attn.o_proj, o)
        want = mid + km._mlp(layer.mlp, km._norm(layer.post_attention_layernorm, mid))
        assert (out - want).abs().max() < 1e-5
        norm, head = km.decoder(dense).norm, dense.lm_head
        logits = aot.logits(h, norm.weight, head.weight)
        want = km._linear(head, km._norm(norm, h))
        assert logits.shape == want.shape == (tokens, dense.config.vocab_size)
        assert (logits - want).abs().max() < 1e-5


def test_a_build_is_cached_by_shape(dense, tiny_heads4_dir):
    aot_layers(dense)
    builds = sorted(cache_dir().glob("*.pt2"))
    stamps = [p.stat().st_mtime_ns for p in builds]
    aot_layers(dense)  # loaded, not rebuilt
    assert [p.stat().st_mtime_ns for p in sorted(cache_dir().glob("*.pt2"))] == stamps
    other = AutoModelForCausalLM.from_pretrained(tiny_heads4_dir).eval()
    aot_layers(other)  # another shape: three more files (before and after attention, the head)
    assert len(list(cache_dir().glob("*.pt2"))) == len(builds) + 3
    assert all(Path(p).parent == cache_dir() for p in builds) and os.environ["INSTAR_CACHE"] in str(cache_dir())


def test_greedy_tokens_and_logprobs_match_hf(dense):
    eos = dense.config.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[eos])

    async def body(engine):
        assert isinstance(engine.accelerator.layers, AotLayers)
        return await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))

    for prompt, gen in zip(PROMPTS, accelerated(dense, body)):
        assert gen.token_ids == hf_greedy(dense, prompt, 12)
        assert (torch.tensor(gen.logprobs) - hf_logprobs(dense, prompt, gen.token_ids)).abs().max() < 1e-4


def test_the_weights_are_inputs_a_weight_update_needs_no_rebuild(dense):
    new_model = perturbed(dense)
    prompt = PROMPTS[2]

    async def body(engine):
        return await swap_mid_turn(engine, "keep", new_model, prompt)

    before, gen = accelerated(dense, body)
    old_part, new_part = gen.token_ids[:before], gen.token_ids[before:]
    assert old_part == hf_greedy(dense, prompt, before)
    assert new_part == hf_greedy(new_model, prompt + old_part, 12 - before)
    got = torch.tensor(gen.logprobs)
    assert (got[before:] - hf_logprobs(new_model, prompt, gen.token_ids)[before:]).abs().max() < 1e-4


def test_models_it_cannot_compile_stay_eager_with_one_line(dense, tiny_moe_dir, capsys):
    assert aot_layers(copy.deepcopy(dense).to(torch.bfloat16)) is None
    assert capsys.readouterr().out.count("the engine's layers stay on plain PyTorch") == 1
    moe = AutoModelForCausalLM.from_pretrained(tiny_moe_dir).eval()  # every layer sparse: nothing to compile
    assert aot_layers(moe) is None


def test_a_failed_build_falls_back_with_one_line(dense, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("INSTAR_CACHE", str(tmp_path))
    calls = []

    def no_compiler(*args, **kwargs):
        calls.append(1)
        raise FileNotFoundError("g++")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)
    assert aot_layers(dense) is None
    assert len(calls) == 2  # built, and once more
    assert "compiled layers (before) stays on plain PyTorch: FileNotFoundError: g++" in capsys.readouterr().out
    assert not list((tmp_path / "cpu").glob("*.pt2"))  # nothing half-written left behind


def test_a_corrupt_cached_build_is_built_again(dense, tmp_path, monkeypatch):
    monkeypatch.setenv("INSTAR_CACHE", str(tmp_path))
    aot_layers(dense)
    builds = sorted((tmp_path / "cpu").glob("*.pt2"))
    builds[0].write_bytes(b"not a package")
    assert aot_layers(dense) is not None
    assert builds[0].stat().st_size > 1000  # built again in its place
