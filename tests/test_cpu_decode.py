"""The engine's decode attention kernel (`--engine.compile aot`) against the matmuls it replaces: rows in any
cache slots, each over its own number of cached keys; loading it leaves the process's float mode alone; without
a compiler the engine keeps the matmuls."""

import pytest
import torch

from instar.engines import kv_model as km
from instar.engines.decode_kernel import DecodeKernel


@pytest.fixture(scope="module")
def kernel():
    built = DecodeKernel.load_or_build()
    assert built is not None  # the test machine has the C compiler that --engine.compile aot needs
    return built


@pytest.mark.parametrize("d,heads,kv_heads", [(32, 4, 2), (64, 4, 4), (128, 8, 1)])
def test_the_kernel_equals_the_matmuls(kernel, d, heads, kv_heads):
    g = torch.Generator().manual_seed(d + heads)
    k_cache, v_cache = (torch.randn(10, kv_heads, 50, d, generator=g) for _ in range(2))
    slots, lengths = torch.tensor([7, 2, 9, 0, 5, 3]), torch.tensor([1, 50, 17, 33, 2, 49])
    q = torch.randn(6, heads, d, generator=g) * 3
    span = int(lengths.max())
    bias = torch.zeros(6, heads, span).masked_fill_(torch.arange(span) >= lengths[:, None, None], float("-inf"))
    want = km._decode_attention(q, k_cache[slots, :, :span], v_cache[slots, :, :span], bias, d ** -0.5)
    torch.testing.assert_close(kernel(q, k_cache, v_cache, slots, lengths, span, d ** -0.5), want, rtol=1e-5,
                               atol=1e-5)
    assert kernel.takes(q, k_cache) and not kernel.takes(q.bfloat16(), k_cache.bfloat16())
    assert not kernel.takes(torch.zeros(6, heads, 48), torch.zeros(10, kv_heads, 50, 48))
    for bad_lengths, bad_span in ((lengths + 1, span + 1), (lengths, span - 1), (lengths - lengths, span)):
        with pytest.raises(ValueError, match="would read past"):  # past the cache, the scratch, or no key at all
            kernel(q, k_cache, v_cache, slots, bad_lengths, bad_span, d ** -0.5)
    with pytest.raises(ValueError, match="would read past"):
        kernel(q, k_cache, v_cache, slots + 1, lengths, span, d ** -0.5)


def test_the_kernel_writes_the_new_keys_before_reading_them(kernel):
    """A decode step's cache write in the kernel's pass: the same cache and output as writing first."""
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(5, 2, 20, 32, generator=g) for _ in range(2))
    slots, lengths = torch.tensor([4, 0, 2]), torch.tensor([7, 20, 1])
    q, k_new, v_new = (torch.randn(3, n, 32, generator=g) for n in (4, 2, 2))
    k_want, v_want = k_cache.clone(), v_cache.clone()
    k_want[slots, :, lengths - 1], v_want[slots, :, lengths - 1] = k_new, v_new
    want = kernel(q, k_want, v_want, slots, lengths, 20, 0.2)
    got = kernel(q, k_cache, v_cache, slots, lengths, 20, 0.2, (k_new, v_new))
    assert torch.equal(got, want) and torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
    with pytest.raises(ValueError, match="new keys"):
        kernel(q, k_cache, v_cache, slots, lengths, 20, 0.2, (k_new[:2], v_new[:2]))


def test_loading_it_keeps_denormal_floats(kernel):
    """Linked with -ffast-math, a shared library sets flush-to-zero for the whole process when loaded."""
    assert (torch.tensor([1e-40]) * 1.0).item() > 0


def test_without_a_compiler_the_engine_keeps_the_matmuls(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("INSTAR_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert DecodeKernel.load_or_build() is None
    assert "decode attention stays on torch" in capsys.readouterr().out


def test_a_step_that_decodes_and_prefills_equals_the_eager_engine(tiny_model_dir, kernel):
    """The decode rows of a step that also prefills go through the kernel (scattered back among the others)."""
    from instar.train.model import load_model
    model = load_model(str(tiny_model_dir))
    aot, logits = km.aot_layers(model), []
    assert aot.decode is not None
    for layers in (aot, None):
        cache = km.SlotCache(model, 4, 16)
        km.forward(model, cache, km.make_batch(cache, [[5, 6, 7], [8, 9]], [0, 1], [0, 0]), layers)
        step = km.make_batch(cache, [[10], [11, 12, 13, 14], [15]], [0, 2, 1], [3, 0, 2])
        assert [g.grid is not None and g.grid.shape[1] for g in step.groups] == [1, 4]  # decode rows, a prefill
        logits.append(km.forward(model, cache, step, layers)[0])
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("prompt", [12, 17])
def test_rows_read_a_shared_prompt_from_one_slot(kernel, prompt):
    """A group's rows hold copies of one prompt's keys; read from one row's slot they give the same output
    to the bit, and the reads do come from there (a source holding other keys changes the output). The kernel
    scores keys 16 at a time and sums values in two chains (even and odd keys): a prompt of 17 keys splits
    both unlike the row's own keys."""
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(6, 2, 30, 64, generator=g) for _ in range(2))
    for cache in (k_cache, v_cache):
        cache[[1, 3, 4], :, :prompt] = cache[2, :, :prompt]  # rows in slots 2, 1, 3, 4 share the prompt's keys
    slots, lengths = torch.tensor([2, 1, 3, 4, 0]), torch.tensor([prompt + 3, 30, prompt + 1, 20, 9])
    sources, shared = torch.tensor([2, 2, 2, 2, 0]), torch.tensor([prompt] * 4 + [0])
    q = torch.randn(5, 4, 64, generator=g)
    want = kernel(q, k_cache, v_cache, slots, lengths, 30, 0.125)
    assert torch.equal(kernel(q, k_cache, v_cache, slots, lengths, 30, 0.125, shared=(sources, shared)), want)
    k_cache[2, :, 5] += 1  # the source's keys now differ from the copies: rows reading there see it
    moved = kernel(q, k_cache, v_cache, slots, lengths, 30, 0.125, shared=(sources, shared))
    assert [not torch.equal(moved[r], want[r]) for r in range(5)] == [True, True, True, True, False]
    with pytest.raises(ValueError, match="would read past"):  # sharing the row's last key (or more) is refused
        kernel(q, k_cache, v_cache, slots, lengths, 30, 0.125, shared=(sources, lengths))
