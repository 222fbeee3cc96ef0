"""The trainer's packed attention on CPU as a C kernel, forward and backward (`attention.packed_attention`).

Why: a packed row's sequences (or a prefix tree's segments) are laid out right-padded, one sequence a batch
row, for one SDPA call. On CPU that call computes every query against every key and masks afterwards: at
RL shapes (a few dozen queries, each seeing its context and its own earlier tokens) a third or more of the
work is masked out, and what is left runs as many tiny products. Here each query reads only the keys it
sees, four query rows at a time against sixteen keys at a time (a key block loaded once for four rows),
and the backward recomputes the probabilities from the saved log-sum-exp, as flash attention does.

Segment s of a batch row: queries ``i < own[s]`` see keys ``j <= context[s] + i`` (its context's keys come
first in its key rows, then its own); padded queries get zeros. Float32, any head width that is a multiple
of 16; built like the engine's decode kernel (`decode_kernel.native_library`), and where it cannot be built,
attention stays on SDPA.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from instar.engines.decode_kernel import native_library

_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
enum { R = 4 };  /* query rows at a time */

static inline v16 ld(const float *p) { v16 x; memcpy(&x, p, 64); return x; }
static inline void st(float *p, v16 x) { memcpy(p, &x, 64); }

/* out [d][nk16]: n rows of d floats (row j at base + j * stride), transposed, zero past n */
static void transpose(const float *base, int64_t stride, int64_t n, int64_t nk16, int64_t d, float *out) {
    for (int64_t c = 0; c < d; c++) {
        for (int64_t j = 0; j < n; j++) out[c * nk16 + j] = base[j * stride + c];
        for (int64_t j = n; j < nk16; j++) out[c * nk16 + j] = 0.f;
    }
}

/* S[r][j] = sum_c A[r][c] Bt[c][j] for R rows of A (d wide) and the first nb * 16 columns of Bt; two key blocks
   at a time where there are two: eight independent sums keep both FMA units busy (four leave half their slots) */
static void rows_by_keys(const float *A, const float *Bt, int64_t nk16, int64_t nb, int64_t d, float *S) {
    int64_t jb = 0;
    for (; jb + 1 < nb; jb += 2) {
        v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
        for (int64_t c = 0; c < d; c++) {
            const v16 x = ld(Bt + c * nk16 + jb * 16), y = ld(Bt + c * nk16 + jb * 16 + 16);
            const float r0 = A[c], r1 = A[d + c], r2 = A[2 * d + c], r3 = A[3 * d + c];
            a0 += r0 * x; a1 += r1 * x; a2 += r2 * x; a3 += r3 * x;
            b0 += r0 * y; b1 += r1 * y; b2 += r2 * y; b3 += r3 * y;
        }
        st(S + jb * 16, a0); st(S + nk16 + jb * 16, a1); st(S + 2 * nk16 + jb * 16, a2); st(S + 3 * nk16 + jb * 16, a3);
        st(S + jb * 16 + 16, b0); st(S + nk16 + jb * 16 + 16, b1); st(S + 2 * nk16 + jb * 16 + 16, b2);
        st(S + 3 * nk16 + jb * 16 + 16, b3);
    }
    if (jb < nb) {
        v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t c = 0; c < d; c++) {
            const v16 b = ld(Bt + c * nk16 + jb * 16);
            a0 += A[c] * b; a1 += A[d + c] * b; a2 += A[2 * d + c] * b; a3 += A[3 * d + c] * b;
        }
        st(S + jb * 16, a0); st(S + nk16 + jb * 16, a1); st(S + 2 * nk16 + jb * 16, a2); st(S + 3 * nk16 + jb * 16, a3);
    }
}

/* out[r] = sum_{j < n} P[r][j] B[j] for R rows of P; B's rows (d wide) at base + j * stride; 32 columns at a
   time where there are 32 (eight independent sums, as in rows_by_keys) */
static void probs_by_rows(const float *P, int64_t nk16, const float *B, int64_t stride, int64_t n, int64_t d,
                          float *out) {
    int64_t w = 0;
    for (; w + 16 < d; w += 32) {
        v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
        for (int64_t j = 0; j < n; j++) {
            const v16 x = ld(B + j * stride + w), y = ld(B + j * stride + w + 16);
            const float p0 = P[j], p1 = P[nk16 + j], p2 = P[2 * nk16 + j], p3 = P[3 * nk16 + j];
            a0 += p0 * x; a1 += p1 * x; a2 += p2 * x; a3 += p3 * x;
            b0 += p0 * y; b1 += p1 * y; b2 += p2 * y; b3 += p3 * y;
        }
        st(out + w, a0); st(out + d + w, a1); st(out + 2 * d + w, a2); st(out + 3 * d + w, a3);
        st(out + w + 16, b0); st(out + d + w + 16, b1); st(out + 2 * d + w + 16, b2); st(out + 3 * d + w + 16, b3);
    }
    if (w < d) {
        v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t j = 0; j < n; j++) {
            const v16 b = ld(B + j * stride + w);
            a0 += P[j] * b; a1 += P[nk16 + j] * b; a2 += P[2 * nk16 + j] * b; a3 += P[3 * nk16 + j] * b;
        }
        st(out + w, a0); st(out + d + w, a1); st(out + 2 * d + w, a2); st(out + 3 * d + w, a3);
    }
}

/* G[j] += sum_r P[r][j] A[r] for j < n; G's rows at base + j * stride */
static void keys_add(const float *restrict P, int64_t nk16, const float *restrict A, int64_t n, int64_t d,
                     float *restrict G, int64_t stride) {
    for (int64_t w = 0; w < d; w += 16) {
        const v16 a0 = ld(A + w), a1 = ld(A + d + w), a2 = ld(A + 2 * d + w), a3 = ld(A + 3 * d + w);
        for (int64_t j = 0; j < n; j++) {
            float *g = G + j * stride + w;
            st(g, ld(g) + P[j] * a0 + P[nk16 + j] * a1 + P[2 * nk16 + j] * a2 + P[3 * nk16 + j] * a3);
        }
    }
}

/* R rows of x [S, T, H, d] from row i0 of segment s, head h (times scale), zeros past `rows` */
static void take_rows(const float *x, int64_t s, int64_t i0, int64_t rows, int64_t h, int64_t T, int64_t H,
                      int64_t d, float scale, float *A) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < d; c++) A[r * d + c] = r < rows ? x[((s * T + i0 + r) * H + h) * d + c] * scale : 0.f;
}

/* Ask for `rows` rows of x [S, T, H, d] from row i0 of segment s, head h, ahead of their use: the backward reads
   a block's rows of q, dout and o (each 4 d floats, H d apart) cold, and ~10-20% of its time waited for them */
static inline void prefetch_rows(const float *x, int64_t s, int64_t i0, int64_t rows, int64_t h, int64_t T,
                                 int64_t H, int64_t d) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < d; c += 16) __builtin_prefetch(x + ((s * T + i0 + r) * H + h) * d + c, 0, 3);
}

static int bad(const int64_t *ctx, const int64_t *own, int64_t S, int64_t T, int64_t TK, int64_t H, int64_t KV,
               int64_t d) {
    if (KV < 1 || H % KV || d % 16) return 1;
    for (int64_t s = 0; s < S; s++)
        if (own[s] < 0 || own[s] > T || ctx[s] < 0 || ctx[s] + own[s] > TK) return 1;
    return 0;
}

/* q, o [S, T, H, d]; k, v [S, TK, KV, d]; lse [S, H, T]; scratch: threads * ((d + R) nk16 + R d) floats */
int attention_forward(const float *q, const float *k, const float *v, const int64_t *ctx, const int64_t *own,
                      float *o, float *lse, float *scratch, int64_t S, int64_t T, int64_t TK, int64_t H, int64_t KV,
                      int64_t d, float scale, int threads) {
    if (bad(ctx, own, S, T, TK, H, KV, d)) return -1;
    const int64_t group = H / KV, nk16 = (TK + 15) / 16 * 16;
    #pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t t = 0; t < S * KV; t++) {
        const int64_t s = t / KV, kv = t % KV;
        float *Kt = scratch + omp_get_thread_num() * ((d + R) * nk16 + R * d), *P = Kt + d * nk16, *A = P + R * nk16;
        const float *K = k + (s * TK * KV + kv) * d, *V = v + (s * TK * KV + kv) * d;
        transpose(K, KV * d, ctx[s] + own[s], nk16, d, Kt);
        for (int64_t h = kv * group; h < (kv + 1) * group; h++) {
            for (int64_t i0 = 0; i0 < own[s]; i0 += R) {
                const int64_t rows = own[s] - i0 < R ? own[s] - i0 : R, n = ctx[s] + i0 + rows;
                take_rows(q, s, i0, rows, h, T, H, d, scale, A);
                rows_by_keys(A, Kt, nk16, (n + 15) / 16, d, P);
                for (int64_t r = 0; r < R; r++) {
                    float *p = P + r * nk16, m = -3.0e38f, sum = 0.f;
                    const int64_t seen = r < rows ? ctx[s] + i0 + r + 1 : 0;
                    for (int64_t j = 0; j < seen; j++) m = fmaxf(m, p[j]);
                    for (int64_t j = 0; j < seen; j++) { p[j] = expf(p[j] - m); sum += p[j]; }
                    for (int64_t j = 0; j < seen; j++) p[j] /= sum;
                    for (int64_t j = seen; j < n; j++) p[j] = 0.f;
                    if (r < rows) lse[(s * H + h) * T + i0 + r] = m + logf(sum);
                }
                probs_by_rows(P, nk16, V, KV * d, n, d, A);
                for (int64_t r = 0; r < rows; r++) memcpy(o + ((s * T + i0 + r) * H + h) * d, A + r * d, d * 4);
            }
            for (int64_t i = own[s]; i < T; i++) {
                memset(o + ((s * T + i) * H + h) * d, 0, d * 4);
                lse[(s * H + h) * T + i] = 0.f;
            }
        }
    }
    return 0;
}

/* The gradients of q, k, v from dout (q's layout) and the forward's o and lse; dk, dv are overwritten.
   scratch: threads * (2 (d + R) nk16 + 3 R d) floats */
int attention_backward(const float *q, const float *k, const float *v, const float *o, const float *dout,
                       const float *lse, const int64_t *ctx, const int64_t *own, float *dq, float *dk, float *dv,
                       float *scratch, int64_t S, int64_t T, int64_t TK, int64_t H, int64_t KV, int64_t d, float scale,
                       int threads) {
    if (bad(ctx, own, S, T, TK, H, KV, d)) return -1;
    const int64_t group = H / KV, nk16 = (TK + 15) / 16 * 16, per = 2 * d * nk16 + 2 * R * nk16 + 3 * R * d;
    #pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t t = 0; t < S * KV; t++) {
        const int64_t s = t / KV, kv = t % KV, at = (s * TK * KV + kv) * d;
        float *Kt = scratch + omp_get_thread_num() * per, *Vt = Kt + d * nk16, *P = Vt + d * nk16;
        float *dS = P + R * nk16, *A = dS + R * nk16, *B = A + R * d, *G = B + R * d;
        for (int64_t j = 0; j < TK; j++) {
            memset(dk + at + j * KV * d, 0, d * 4);
            memset(dv + at + j * KV * d, 0, d * 4);
        }
        transpose(k + at, KV * d, ctx[s] + own[s], nk16, d, Kt);
        transpose(v + at, KV * d, ctx[s] + own[s], nk16, d, Vt);
        for (int64_t h = kv * group; h < (kv + 1) * group; h++) {
            for (int64_t i0 = 0; i0 < own[s]; i0 += R) {
                const int64_t rows = own[s] - i0 < R ? own[s] - i0 : R, n = ctx[s] + i0 + rows, nb = (n + 15) / 16;
                if (own[s] > i0 + R) {  /* the next block's rows, fetched while this block computes */
                    const int64_t next = own[s] - i0 - R < R ? own[s] - i0 - R : R;
                    prefetch_rows(q, s, i0 + R, next, h, T, H, d);
                    prefetch_rows(dout, s, i0 + R, next, h, T, H, d);
                    prefetch_rows(o, s, i0 + R, next, h, T, H, d);
                }
                take_rows(q, s, i0, rows, h, T, H, d, scale, A);
                take_rows(dout, s, i0, rows, h, T, H, d, 1.f, B);
                rows_by_keys(A, Kt, nk16, nb, d, P);
                rows_by_keys(B, Vt, nk16, nb, d, dS);
                for (int64_t r = 0; r < R; r++) {
                    float *p = P + r * nk16, *ds = dS + r * nk16, D = 0.f;
                    const int64_t seen = r < rows ? ctx[s] + i0 + r + 1 : 0;
                    if (r < rows) {
                        const float *orow = o + ((s * T + i0 + r) * H + h) * d, m = lse[(s * H + h) * T + i0 + r];
                        for (int64_t c = 0; c < d; c++) D += B[r * d + c] * orow[c];
                        for (int64_t j = 0; j < seen; j++) { p[j] = expf(p[j] - m); ds[j] = p[j] * (ds[j] - D); }
                    }
                    for (int64_t j = seen; j < n; j++) p[j] = ds[j] = 0.f;
                }
                probs_by_rows(dS, nk16, k + at, KV * d, n, d, G);
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t c = 0; c < d; c++) dq[((s * T + i0 + r) * H + h) * d + c] = G[r * d + c] * scale;
                keys_add(dS, nk16, A, n, d, dk + at, KV * d);
                keys_add(P, nk16, B, n, d, dv + at, KV * d);
            }
            for (int64_t i = own[s]; i < T; i++) memset(dq + ((s * T + i) * H + h) * d, 0, d * 4);
        }
    }
    return 0;
}
"""


@functools.cache
def _library() -> Any:
    library = native_library(_SOURCE, "attention", "the trainer's packed attention")
    if library is not None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        library.attention_forward.argtypes = [p] * 8 + [i] * 6 + [ctypes.c_float, ctypes.c_int]
        library.attention_backward.argtypes = [p] * 12 + [i] * 6 + [ctypes.c_float, ctypes.c_int]
        library.attention_forward.restype = library.attention_backward.restype = ctypes.c_int
    return library


def takes(query: torch.Tensor, dropout: float) -> bool:
    """Whether the kernel computes this attention: float32 on the CPU, a head width that is a multiple of 16,
    no dropout, and a kernel built for this machine."""
    return (query.device.type == "cpu" and query.dtype == torch.float32 and query.shape[-1] % 16 == 0
            and not dropout and _library() is not None)


def _pointers(*tensors: torch.Tensor) -> list[int]:
    return [t.data_ptr() for t in tensors]


class SegmentAttention(torch.autograd.Function):
    """``out [S, T, H, d]`` from ``q [S, T, H, d]``, ``k, v [S, TK, KV, d]`` (contiguous, float32) and per segment
    ``context``, ``own`` (int64): see the module's doc."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: torch.Tensor,
                own: torch.Tensor, scale: float) -> torch.Tensor:
        q, k, v = (t.contiguous() for t in (q, k, v))
        (S, T, H, d), TK, KV = q.shape, k.shape[1], k.shape[2]
        out, lse = torch.empty_like(q), q.new_empty(S, H, T)
        threads, nk16 = torch.get_num_threads(), (TK + 15) // 16 * 16
        scratch = q.new_empty(threads * ((d + 4) * nk16 + 4 * d))
        if _library().attention_forward(*_pointers(q, k, v, context, own, out, lse, scratch), S, T, TK, H, KV, d,
                                        scale, threads):
            raise ValueError(f"packed attention kernel: segments (context {context.tolist()}, own {own.tolist()}) do "
                             f"not fit queries {tuple(q.shape)} and keys {tuple(k.shape)}")
        ctx.save_for_backward(q, k, v, out, lse, context, own)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, context, own = ctx.saved_tensors
        (S, T, H, d), TK, KV = q.shape, k.shape[1], k.shape[2]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        threads, nk16 = torch.get_num_threads(), (TK + 15) // 16 * 16
        scratch = q.new_empty(threads * (2 * (d + 4) * nk16 + 12 * d))
        _library().attention_backward(*_pointers(q, k, v, out, grad.contiguous(), lse, context, own, dq, dk, dv,
                                                 scratch), S, T, TK, H, KV, d, ctx.scale, threads)
        return dq, dk, dv, None, None, None
