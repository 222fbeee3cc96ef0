"""The embedded engine's decode attention and sampling as C kernels (csrc/decode.c), for `cpu.engine`.

In a decode step each row's query heads attend over that row's cached keys; PyTorch runs it as two batched
matmuls of tiny products (`kv_model._decode_attention`), where the BLAS's cost per matrix dominates: the kernel
reads each row's keys where they lie in the cache (~180 -> ~110 us a layer at the demo's shapes). Sampling rows at
temperature 1 with no filter is ~8 small torch ops, each slow as the first of its kind in a step; the kernel does
it in one call (~235 -> ~110 us a step at the demo's size). Compiled with -ffast-math, linked without it, so
loading it does not set the process's floats to flush denormals to zero.
"""

from __future__ import annotations

import ctypes

import torch

from instar.contract import SamplingParams
from instar.cpu.build import checked, native, pointers
from instar.engines import kv_model
from instar.engines.sampling import sample

WIDTHS = (32, 64, 128)


class DecodeKernel:
    def __init__(self, library: ctypes.PyDLL) -> None:
        self._fn = library.decode_attention
        p, i = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [p] * 9 + [i] * 7 + [ctypes.c_float, ctypes.c_int]
        self._fn.restype = ctypes.c_int
        self._sample = library.sample_rows
        self._sample.argtypes = [p, p, p, i, i, p, p, p]
        self._sample.restype = ctypes.c_int

    @classmethod
    def load_or_build(cls) -> DecodeKernel | None:
        """The kernels built for this machine (cached) and self-checked, or None where they cannot be."""
        library = native("decode", "the engine's decode attention and sampling", lambda lib: cls(lib).self_check())
        return None if library is None else cls(library)

    def sample(self, logits: torch.Tensor, u: torch.Tensor, keys: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens (rows,) and their logprobs from float32 ``logits`` (rows, V) at temperature 1, unfiltered, with the
        uniform draws ``u`` (rows,), or racing with the int64 ``keys`` (rows,): what `sampling.sample` computes from
        the same draws (up to float rounding of the log-softmax and running sums: a draw within a rounding error of a
        boundary, or a near tie of the race, may land on a neighbour). A row with a NaN or +inf logit, or only -inf
        ones, gets token 0 and a NaN logprob, as there."""
        logits, u = logits.contiguous(), u.contiguous()
        rows, vocab = logits.shape
        tokens, logprobs, scratch = torch.empty(rows, dtype=torch.int64), torch.empty(rows), torch.empty(vocab)
        checked(self._sample(*pointers(logits, u, keys), rows, vocab, *pointers(scratch, tokens, logprobs)),
                "sampling")
        return tokens, logprobs

    @staticmethod
    def takes(q: torch.Tensor, cache: torch.Tensor) -> bool:
        """Whether the kernel computes this query over this cache (float32 on the CPU, a width it was built for)."""
        return q.dtype == cache.dtype == torch.float32 and q.device.type == "cpu" and q.shape[-1] in WIDTHS

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 lengths: torch.Tensor, span: int, scale: float, new: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ) -> torch.Tensor:
        """Attention of ``q (rows, heads, d)``, row r over the first ``lengths[r]`` (at most ``span``) keys and
        values of cache slot ``slots[r]`` (``k_cache``, ``v_cache``: (slots, kv_heads, capacity, d)); returns
        (rows, heads, d). ``new``: the rows' keys and values of this step (rows, kv_heads, d), written into the
        cache at each row's last position first (a decode step's cache write, in the same pass)."""
        q = q.contiguous()
        rows, heads, d = q.shape
        n_slots, kv_heads, capacity, _ = k_cache.shape
        new = (None, None) if new is None else tuple(t.contiguous() for t in new)
        if v_cache.shape != k_cache.shape or any(t is not None and t.shape != (rows, kv_heads, d) for t in new):
            raise ValueError(f"decode attention: caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}, query "
                             f"{tuple(q.shape)} and new keys {[None if t is None else tuple(t.shape) for t in new]}")
        out, scratch = torch.empty_like(q), torch.empty(rows * kv_heads * span)
        tensors = (q, *new, k_cache, v_cache, slots, lengths, out, scratch)
        if self._fn(*pointers(*tensors), rows, heads, kv_heads, n_slots, capacity, d, span, scale,
                    torch.get_num_threads()):
            raise ValueError(f"decode attention over up to {int(lengths.max())} keys (span {span}) of slots up to "
                             f"{int(slots.max())} would read past the cache {tuple(k_cache.shape)}")
        return out

    def self_check(self) -> None:
        """Both kernels against torch's paths on random inputs (raises on a mismatch)."""
        g = torch.Generator().manual_seed(0)
        for d in WIDTHS:
            k_cache, v_cache = (torch.randn(6, 2, 40, d, generator=g) for _ in range(2))
            slots, lengths, q = torch.tensor([5, 0, 3]), torch.tensor([1, 40, 17]), torch.randn(3, 4, d, generator=g)
            bias = torch.zeros(3, 4, 40).masked_fill_(torch.arange(40) >= lengths[:, None, None], float("-inf"))
            want = kv_model._decode_attention(q, k_cache[slots], v_cache[slots], bias, d ** -0.5)
            torch.testing.assert_close(self(q, k_cache, v_cache, slots, lengths, 40, d ** -0.5), want, rtol=1e-5,
                                       atol=1e-5)
        logits = torch.randn(16, 300, generator=g) * 3
        logits[3, 5] = float("nan")
        for seeded in (False, True):  # the inverse CDF, then the race
            params = [SamplingParams(seed=row if seeded else None) for row in range(16)]
            with torch.random.fork_rng(devices=[]):  # the process's own draws stay as they were
                torch.manual_seed(0)
                want_tokens, want_logprobs = sample(logits, params, [0] * 16)
                torch.manual_seed(0)
                tokens, logprobs = sample(logits, params, [0] * 16, accelerator=_Sampler(self))
            torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-4, atol=1e-4, equal_nan=True)
            if (tokens != want_tokens).sum() > 1:  # a draw within rounding of a boundary may land on its neighbour
                raise AssertionError(f"sampling kernel: tokens {tokens.tolist()} against {want_tokens.tolist()}")


class _Sampler:
    """Just the kernel's sampling, as `sampling.sample` calls an accelerator: what the self-check runs."""

    def __init__(self, kernel: DecodeKernel) -> None:
        self.sample = kernel.sample
