"""The engine's decode attention and sampling kernels (`cpu/decode.py`) against the torch paths they replace:
rows in any cache slots, each over its own number of cached keys; the sampled tokens of the same draws; rows with
non-finite logits rejected as torch rejects them; loading it leaves the process's float mode alone; without a
compiler the engine keeps torch's path."""

import pytest
import torch
from helpers.engine import LOGITS, analytic

from instar.contract import SamplingParams
from instar.cpu.decode import DecodeKernel
from instar.cpu.engine import EngineAccelerator
from instar.engines import kv_model as km
from instar.engines.sampling import sample


@pytest.fixture(scope="module")
def accel(kernel):
    return EngineAccelerator(None, kernel)


@pytest.fixture(scope="module")
def kernel():
    built = DecodeKernel.load_or_build()
    assert built is not None  # the test machine has the C compiler the accelerator needs
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
    assert "decode attention and sampling stays on plain PyTorch" in capsys.readouterr().out


def test_a_step_that_decodes_and_prefills_equals_the_eager_engine(tiny_model_dir, kernel):
    """The decode rows of a step that also prefills go through the kernel (scattered back among the others)."""
    from instar.train.model import load_model
    model = load_model(str(tiny_model_dir))
    logits = []
    for layers in (EngineAccelerator(None, kernel), None):
        cache = km.SlotCache(model, 4, 16)
        km.forward(model, cache, km.make_batch(cache, [[5, 6, 7], [8, 9]], [0, 1], [0, 0]), layers)
        step = km.make_batch(cache, [[10], [11, 12, 13, 14], [15]], [0, 2, 1], [3, 0, 2])
        assert [g.grid is not None and g.grid.shape[1] for g in step.groups] == [1, 4]  # decode rows, a prefill
        logits.append(km.forward(model, cache, step, layers)[0])
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seeded", [False, True], ids=["cdf", "race"])
def test_the_kernel_samples_what_torch_samples_from_the_same_draws(kernel, accel, seeded):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 512, generator=g) * 3
    logits[:, 7] = -200.0  # a token with probability 0 in float32
    params = [SamplingParams(seed=row if seeded else None) for row in range(64)]
    for draw in range(20):
        torch.manual_seed(draw)
        want_tokens, want_logprobs = sample(logits, params, [draw] * 64)
        torch.manual_seed(draw)
        tokens, logprobs = sample(logits, params, [draw] * 64, accelerator=accel)
        assert torch.equal(tokens, want_tokens)  # a draw within a rounding error of a boundary could differ: none here
        assert (logprobs - want_logprobs).abs().max() < 1e-5
        assert not (tokens == 7).any()
    # the frequencies of a small vocabulary, through the kernel
    torch.manual_seed(1)
    counts = sample(LOGITS.expand(20000, 6), [SamplingParams()] * 20000, [0] * 20000, accelerator=accel)[0].bincount(
        minlength=6)
    assert (counts / 20000 - analytic([0, 1, 2, 3, 4, 5])).abs().max() < 0.01


def test_the_kernel_leaves_greedy_and_filtered_rows_to_torch(kernel, accel, monkeypatch):
    calls = []
    monkeypatch.setattr(type(kernel), "sample", lambda self, *a: calls.append(1))  # it would fail the unpacking
    for params in ([SamplingParams(temperature=0)], [SamplingParams(top_k=2)], [SamplingParams(temperature=0.5)]):
        tokens, _ = sample(LOGITS[None], params, [0], accelerator=accel)
        assert tokens.shape == (1,)
    assert not calls


def test_a_draw_that_rounds_to_the_total_takes_the_last_token_with_probability(kernel, accel, monkeypatch):
    monkeypatch.setattr(torch, "rand", lambda n: torch.ones(n))
    logits = torch.tensor([[0.0, 0.0, -1.0, -2.0], [5.0, 0.0, 0.0, -200.0]])  # row 2's last token: probability 0
    tokens, logprobs = sample(logits, [SamplingParams(), SamplingParams()], [None, None], accelerator=accel)
    assert tokens.tolist() == [3, 2]
    assert torch.isfinite(logprobs).all()


def test_rows_with_non_finite_logits_are_rejected_as_torch_rejects_them(kernel, accel):
    """NaN or +inf anywhere, or only -inf: token 0 with a NaN logprob (the contract then drops the rollout), as
    torch's path gives; -inf in some places is a masked token and samples normally."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(2))
    logits[0, 3], logits[1, 2], logits[2], logits[3, 5] = float("nan"), float("inf"), float("-inf"), float("-inf")
    params = [SamplingParams()] * 5
    torch.manual_seed(0)
    want_tokens, want_logprobs = sample(logits, params, [0] * 5)
    torch.manual_seed(0)
    tokens, logprobs = sample(logits, params, [0] * 5, accelerator=accel)
    assert tokens.tolist()[:3] == want_tokens.tolist()[:3] == [0, 0, 0]
    assert logprobs[:3].isnan().all() and want_logprobs[:3].isnan().all()
    assert tokens[3:].tolist() == want_tokens[3:].tolist() and torch.isfinite(logprobs[3:]).all()
    assert tokens[3] != 5
