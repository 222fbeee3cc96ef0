/* The trainer's packed attention on CPU, forward and backward (instar/cpu/attention.py calls it).

   For SDPA a packed row's sequences (or a prefix tree's segments) are laid out right-padded, one sequence a batch
   row; on CPU that call computes every query against every key and masks afterwards. Here each query reads only
   the keys it sees, four query rows at a time against sixteen keys at a time (a key block loaded once for four
   rows), and the backward recomputes the probabilities from the saved log-sum-exp, as flash attention does. It
   reads and writes the packed row where it is: each task gathers its segment's keys and values into its own
   scratch, so no padded copies go through memory.

   Segment s: its keys are the rows index[s][0 .. ctx[s] + own[s]) of the packed row, its context's first and then
   its own, which are also its queries; query i < own[s] sees keys j <= ctx[s] + i. A context row's key gradients
   add up over the segments that see it, in segment order (the same bits on any thread count). Float32, head
   widths that are multiples of 16. Both entry points return 0, or -1 (computing nothing) for arguments that do
   not fit. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
enum { R = 4 };  /* query rows at a time */

static inline v16 ld(const float *p) { v16 x; memcpy(&x, p, 64); return x; }
static inline void st(float *p, v16 x) { memcpy(p, &x, 64); }

/* out [d][nk16]: the d floats at base + idx[j] * stride for j < n, transposed, zero past n */
static void transpose(const float *base, int64_t stride, const int64_t *idx, int64_t n, int64_t nk16, int64_t d,
                      float *out) {
    for (int64_t j = 0; j < n; j++) {
        const float *row = base + idx[j] * stride;
        for (int64_t c = 0; c < d; c++) out[c * nk16 + j] = row[c];
    }
    for (int64_t c = 0; c < d; c++)
        for (int64_t j = n; j < nk16; j++) out[c * nk16 + j] = 0.f;
}

/* out [n][d]: the d floats at base + idx[j] * stride for j < n */
static void gather(const float *base, int64_t stride, const int64_t *idx, int64_t n, int64_t d, float *out) {
    for (int64_t j = 0; j < n; j++) memcpy(out + j * d, base + idx[j] * stride, d * 4);
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

/* R rows of head h of x [N, H, d]: rows idx[0..rows) (times scale), zeros past `rows` */
static void take_rows(const float *x, const int64_t *idx, int64_t rows, int64_t h, int64_t H, int64_t d, float scale,
                      float *A) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < d; c++) A[r * d + c] = r < rows ? x[(idx[r] * H + h) * d + c] * scale : 0.f;
}

/* Ask for head h of rows idx[0..rows) of x [N, H, d] ahead of their use: the backward reads a block's rows of q,
   dout and o (each 4 d floats, H d apart) cold, and ~10-20% of its time waited for them */
static inline void prefetch_rows(const float *x, const int64_t *idx, int64_t rows, int64_t h, int64_t H, int64_t d) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < d; c += 16) __builtin_prefetch(x + (idx[r] * H + h) * d + c, 0, 3);
}

/* segment s: keys at rows index[s][0 .. ctx[s] + own[s]) of the packed row, its context's and then its own, which
   are also its queries; C bounds the contexts */
static int bad(const int64_t *index, const int64_t *ctx, const int64_t *own, int64_t S, int64_t T, int64_t TK,
               int64_t C, int64_t N, int64_t H, int64_t KV, int64_t d) {
    if (KV < 1 || H % KV || d % 16) return 1;
    for (int64_t s = 0; s < S; s++) {
        if (own[s] < 0 || own[s] > T || ctx[s] < 0 || ctx[s] > C || ctx[s] + own[s] > TK) return 1;
        for (int64_t j = 0; j < ctx[s] + own[s]; j++)
            if (index[s * TK + j] < 0 || index[s * TK + j] >= N) return 1;
    }
    return 0;
}

/* q, o [N, H, d]; k, v [N, KV, d]; index [S, TK]; lse [S, H, T]; o is written at every segment's own rows.
   scratch: threads * ((2 d + R) nk16 + R d) floats */
int attention_forward(const float *q, const float *k, const float *v, const int64_t *index, const int64_t *ctx,
                      const int64_t *own, float *o, float *lse, float *scratch, int64_t S, int64_t T, int64_t TK,
                      int64_t N, int64_t H, int64_t KV, int64_t d, float scale, int threads) {
    if (bad(index, ctx, own, S, T, TK, TK, N, H, KV, d)) return -1;
    const int64_t group = H / KV, nk16 = (TK + 15) / 16 * 16;
    #pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t t = 0; t < S * KV; t++) {
        const int64_t s = t / KV, kv = t % KV, *keys = index + s * TK, *queries = keys + ctx[s];
        float *Kt = scratch + omp_get_thread_num() * ((2 * d + R) * nk16 + R * d), *V = Kt + d * nk16;
        float *P = V + d * nk16, *A = P + R * nk16;
        transpose(k + kv * d, KV * d, keys, ctx[s] + own[s], nk16, d, Kt);
        gather(v + kv * d, KV * d, keys, ctx[s] + own[s], d, V);
        for (int64_t h = kv * group; h < (kv + 1) * group; h++) {
            for (int64_t i0 = 0; i0 < own[s]; i0 += R) {
                const int64_t rows = own[s] - i0 < R ? own[s] - i0 : R, n = ctx[s] + i0 + rows;
                take_rows(q, queries + i0, rows, h, H, d, scale, A);
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
                probs_by_rows(P, nk16, V, d, n, d, A);
                for (int64_t r = 0; r < rows; r++) memcpy(o + (queries[i0 + r] * H + h) * d, A + r * d, d * 4);
            }
            for (int64_t i = own[s]; i < T; i++) lse[(s * H + h) * T + i] = 0.f;
        }
    }
    return 0;
}

/* The gradients of q, k, v from dout (q's layout) and the forward's o and lse. A segment's own rows are written
   by its task; its context keys' gradients go to dck, dcv [S, C, KV, d] and are added in after, in segment order
   (the same sums on any thread count). scratch: threads * ((5 d + 2 R) nk16 + 3 R d) floats */
int attention_backward(const float *q, const float *k, const float *v, const float *o, const float *dout,
                       const float *lse, const int64_t *index, const int64_t *ctx, const int64_t *own, float *dq,
                       float *dk, float *dv, float *dck, float *dcv, float *scratch, int64_t S, int64_t T, int64_t TK,
                       int64_t C, int64_t N, int64_t H, int64_t KV, int64_t d, float scale, int threads) {
    if (bad(index, ctx, own, S, T, TK, C, N, H, KV, d)) return -1;
    const int64_t group = H / KV, nk16 = (TK + 15) / 16 * 16, per = 5 * d * nk16 + 2 * R * nk16 + 3 * R * d;
    #pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t t = 0; t < S * KV; t++) {
        const int64_t s = t / KV, kv = t % KV, n_keys = ctx[s] + own[s], *keys = index + s * TK;
        const int64_t *queries = keys + ctx[s];
        float *Kt = scratch + omp_get_thread_num() * per, *Vt = Kt + d * nk16, *K = Vt + d * nk16;
        float *dK = K + d * nk16, *dV = dK + d * nk16, *P = dV + d * nk16, *dS = P + R * nk16;
        float *A = dS + R * nk16, *B = A + R * d, *G = B + R * d;
        memset(dK, 0, n_keys * d * 4);
        memset(dV, 0, n_keys * d * 4);
        transpose(k + kv * d, KV * d, keys, n_keys, nk16, d, Kt);
        transpose(v + kv * d, KV * d, keys, n_keys, nk16, d, Vt);
        gather(k + kv * d, KV * d, keys, n_keys, d, K);
        for (int64_t h = kv * group; h < (kv + 1) * group; h++) {
            for (int64_t i0 = 0; i0 < own[s]; i0 += R) {
                const int64_t rows = own[s] - i0 < R ? own[s] - i0 : R, n = ctx[s] + i0 + rows, nb = (n + 15) / 16;
                if (own[s] > i0 + R) {  /* the next block's rows, fetched while this block computes */
                    const int64_t next = own[s] - i0 - R < R ? own[s] - i0 - R : R;
                    prefetch_rows(q, queries + i0 + R, next, h, H, d);
                    prefetch_rows(dout, queries + i0 + R, next, h, H, d);
                    prefetch_rows(o, queries + i0 + R, next, h, H, d);
                }
                take_rows(q, queries + i0, rows, h, H, d, scale, A);
                take_rows(dout, queries + i0, rows, h, H, d, 1.f, B);
                rows_by_keys(A, Kt, nk16, nb, d, P);
                rows_by_keys(B, Vt, nk16, nb, d, dS);
                for (int64_t r = 0; r < R; r++) {
                    float *p = P + r * nk16, *ds = dS + r * nk16, D = 0.f;
                    const int64_t seen = r < rows ? ctx[s] + i0 + r + 1 : 0;
                    if (r < rows) {
                        const float *orow = o + (queries[i0 + r] * H + h) * d, m = lse[(s * H + h) * T + i0 + r];
                        for (int64_t c = 0; c < d; c++) D += B[r * d + c] * orow[c];
                        for (int64_t j = 0; j < seen; j++) { p[j] = expf(p[j] - m); ds[j] = p[j] * (ds[j] - D); }
                    }
                    for (int64_t j = seen; j < n; j++) p[j] = ds[j] = 0.f;
                }
                probs_by_rows(dS, nk16, K, d, n, d, G);
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t c = 0; c < d; c++) dq[(queries[i0 + r] * H + h) * d + c] = G[r * d + c] * scale;
                keys_add(dS, nk16, A, n, d, dK, d);
                keys_add(P, nk16, B, n, d, dV, d);
            }
        }
        for (int64_t j = 0; j < own[s]; j++) {
            memcpy(dk + (queries[j] * KV + kv) * d, dK + (ctx[s] + j) * d, d * 4);
            memcpy(dv + (queries[j] * KV + kv) * d, dV + (ctx[s] + j) * d, d * 4);
        }
        for (int64_t j = 0; j < ctx[s]; j++) {
            memcpy(dck + ((s * C + j) * KV + kv) * d, dK + j * d, d * 4);
            memcpy(dcv + ((s * C + j) * KV + kv) * d, dV + j * d, d * 4);
        }
    }
    #pragma omp parallel for num_threads(threads)
    for (int64_t kv = 0; kv < KV; kv++)
        for (int64_t s = 0; s < S; s++)
            for (int64_t j = 0; j < ctx[s]; j++) {
                float *gk = dk + (index[s * TK + j] * KV + kv) * d, *gv = dv + (index[s * TK + j] * KV + kv) * d;
                const float *ck = dck + ((s * C + j) * KV + kv) * d, *cv = dcv + ((s * C + j) * KV + kv) * d;
                for (int64_t c = 0; c < d; c++) { gk[c] += ck[c]; gv[c] += cv[c]; }
            }
    return 0;
}
