/* The embedded engine's decode attention and sampling (instar/cpu/decode.py calls them).

   Decode attention: each row's query heads attend over that row's cached keys, a few query heads per key/value
   head. PyTorch runs it as two batched matmuls of tiny products, where the BLAS's cost per matrix dominates.
   Here each row's keys and values are read where they lie in the cache (no gather, no mask: it stops at the
   row's length), one row and key/value head per task. Keys come from beyond the core's L2 cache and summing one
   key's product across its vector lanes takes ~30 instructions, so scores are computed 16 keys at a time and
   summed across lanes together (sum16); the values' weighted sums keep two chains (even and odd keys).
   Float32, head widths 32, 64 and 128.

   Sampling: rows at temperature 1 with no filter, log-softmax, probabilities and the inverse-CDF search in one
   call, from the draws torch's path would use; or, for seeded rows, the race from their keys. */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

#if defined(__clang__) || __GNUC__ >= 12
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t i16 __attribute__((vector_size(64)));
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (i16){__VA_ARGS__})
#endif

/* The sums of 16 vectors' lanes as one vector (lane i: the sum of p[i]), in 15 steps that each halve the
   partial sums of twice as many vectors (two lane shuffles and an add): summed one vector at a time, each
   would take ~30 scalar instructions. */
static inline v16 sum16(v16 *p) {
    v16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = SHUF(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SHUF(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        b[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + SHUF(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        c[i] = SHUF(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + SHUF(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUF(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SHUF(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Scores of the query q (D wide, scaled) against keys 0..n-1 (rows of K, D apart) into S, 16 keys a block
   (`sum16`), and the values' sums weighted by S into two sets of sums (even, odd keys: each addition waits on
   the one two keys back, not one). */
#define KEYS(D)                                                                                              \
static void scores_##D(const v16 *q, const float *K, int64_t n, float *restrict S) {                         \
    enum { W = D / 16 };                                                                                     \
    v16 part[16], x;                                                                                         \
    int64_t j = 0;                                                                                           \
    for (; j + 16 <= n; j += 16) {                                                                           \
        for (int i = 0; i < 16; i++) {                                                                       \
            memcpy(&x, K + (j + i) * D, 64); part[i] = q[0] * x;                                             \
            for (int w = 1; w < W; w++) { memcpy(&x, K + (j + i) * D + 16 * w, 64); part[i] += q[w] * x; }   \
        }                                                                                                    \
        v16 s = sum16(part); memcpy(S + j, &s, 64);                                                          \
    }                                                                                                        \
    if (j < n) {                                                                                             \
        for (int i = 0; i < 16; i++) {                                                                       \
            part[i] = q[0] * 0.f;                                                                            \
            if (j + i < n)                                                                                   \
                for (int w = 0; w < W; w++) { memcpy(&x, K + (j + i) * D + 16 * w, 64); part[i] += q[w] * x; } \
        }                                                                                                    \
        v16 s = sum16(part); for (int i = 0; i < n - j; i++) S[j + i] = s[i];                                \
    }                                                                                                        \
}                                                                                                            \
static void values_##D(const float *S, const float *V, int64_t n, v16 *even_sums, v16 *odd_sums) {           \
    enum { W = D / 16 };                                                                                     \
    v16 x, y, even[W], odd[W];                                                                               \
    for (int w = 0; w < W; w++) { even[w] = even_sums[w]; odd[w] = odd_sums[w]; }                            \
    int64_t j = 0;                                                                                           \
    for (; j + 1 < n; j += 2)                                                                                \
        for (int w = 0; w < W; w++) {                                                                        \
            memcpy(&x, V + j * D + 16 * w, 64); memcpy(&y, V + (j + 1) * D + 16 * w, 64);                    \
            even[w] += S[j] * x; odd[w] += S[j + 1] * y;                                                     \
        }                                                                                                    \
    if (j < n)                                                                                               \
        for (int w = 0; w < W; w++) { memcpy(&x, V + j * D + 16 * w, 64); even[w] += S[j] * x; }             \
    for (int w = 0; w < W; w++) { even_sums[w] = even[w]; odd_sums[w] = odd[w]; }                            \
}

/* One row and key/value head: its query heads (`group` of them, D wide) over its n cached keys. */
#define HEAD(D)                                                                                              \
KEYS(D)                                                                                                      \
static void head_##D(const float *Q, const float *K, const float *V, float *restrict S, float *restrict O,   \
                     int64_t n, int64_t group, float scale) {                                                \
    enum { W = D / 16 };                                                                                     \
    for (int64_t g = 0; g < group; g++) {                                                                    \
        v16 q[W], even[W], odd[W]; float m = -3.0e38f, sum = 0.f;                                            \
        for (int w = 0; w < W; w++) {                                                                        \
            memcpy(&q[w], Q + g * D + 16 * w, 64); q[w] *= scale; even[w] = odd[w] = q[w] * 0.f;             \
        }                                                                                                    \
        scores_##D(q, K, n, S);                                                                              \
        for (int64_t j = 0; j < n; j++) m = fmaxf(m, S[j]);                                                  \
        _Pragma("omp simd reduction(+:sum)")                                                                 \
        for (int64_t j = 0; j < n; j++) { S[j] = expf(fmaxf(S[j] - m, -80.f)); sum += S[j]; }                \
        values_##D(S, V, n, even, odd);                                                                      \
        for (int w = 0; w < W; w++) { v16 x = (even[w] + odd[w]) / sum; memcpy(O + g * D + 16 * w, &x, 64); } \
    }                                                                                                        \
}
HEAD(32)
HEAD(64)
HEAD(128)

/* q, out (rows, heads, d); caches (n_slots, kv_heads, capacity, d); row r reads slot slots[r], lengths[r] keys;
   k_new, v_new (rows, kv_heads, d) or NULL: the rows' new keys and values, written at position lengths[r] - 1
   first; scratch: rows * kv_heads * span floats. Returns -1 (and computes nothing) where a row would read or
   write outside the cache or the scratch. */
int decode_attention(const float *q, const float *k_new, const float *v_new, float *kc, float *vc,
                     const int64_t *slots, const int64_t *lengths, float *out, float *scratch, int64_t rows,
                     int64_t heads, int64_t kv_heads, int64_t n_slots, int64_t capacity, int64_t d, int64_t span,
                     float scale, int threads) {
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= n_slots || lengths[r] < 1 || lengths[r] > span || span > capacity)
            return -1;
    const int64_t group = heads / kv_heads;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < rows * kv_heads; t++) {
        const int64_t r = t / kv_heads, at = (slots[r] * kv_heads + t % kv_heads) * capacity * d;
        const float *Q = q + (r * heads + (t % kv_heads) * group) * d;
        float *O = out + (r * heads + (t % kv_heads) * group) * d, *S = scratch + t * span;
        if (k_new) {
            for (int64_t i = 0; i < d; i += 16) {  /* d is a multiple of 16: no call of memcpy's own */
                memcpy(kc + at + (lengths[r] - 1) * d + i, k_new + t * d + i, 64);
                memcpy(vc + at + (lengths[r] - 1) * d + i, v_new + t * d + i, 64);
            }
        }
        if (d == 32) head_32(Q, kc + at, vc + at, S, O, lengths[r], group, scale);
        else if (d == 64) head_64(Q, kc + at, vc + at, S, O, lengths[r], group, scale);
        else head_128(Q, kc + at, vc + at, S, O, lengths[r], group, scale);
    }
    return 0;
}

/* `sampling.sample` for rows at temperature 1 with no filter: per row of logits (V), the log-softmax (max, then
   the log of the sum of exp(x - max)), its probabilities (into p, scratch of V), and the first token at which
   their running sum exceeds u times their total; where rounding leaves the target past the sum, the last token
   with probability, as sample's guard does. A row with a NaN or +inf logit, or only -inf ones, gets token 0 and
   a NaN logprob, as torch's path gives it (the rollout is then rejected): checked on the bits, since fast math
   lets the compiler assume finite floats. With ``keys`` (one per row), each row instead races as `sampling.race`
   does: the argmax of its logprobs plus Gumbel noise from splitmix64 of key + id * golden ratio (every token gets
   noise, in a loop the compiler vectorises).
   Returns -1 (computing nothing) for an empty vocabulary. */
static inline uint32_t bits(float x) { uint32_t b; memcpy(&b, &x, 4); return b; }

int sample_rows(const float *logits, const float *u, const int64_t *keys, int64_t rows, int64_t V, float *p,
                int64_t *tokens, float *logprobs) {
    if (V < 1) return -1;
    const uint32_t nan_bits = 0x7fc00000u, inf_bits = 0x7f800000u, minus_inf_bits = 0xff800000u;
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * V;
        uint32_t bad = 0, finite_seen = 0;
        for (int64_t j = 0; j < V; j++) {
            const uint32_t b = bits(x[j]), magnitude = b & 0x7fffffffu;
            bad |= magnitude > inf_bits || b == inf_bits;  /* NaN, +inf */
            finite_seen |= b != minus_inf_bits;
        }
        if (bad || !finite_seen) {
            tokens[r] = 0;
            memcpy(&logprobs[r], &nan_bits, 4);
            continue;
        }
        float m = -INFINITY, s = 0.f, total = 0.f, c = 0.f;
        for (int64_t j = 0; j < V; j++) m = fmaxf(m, x[j]);
        for (int64_t j = 0; j < V; j++) s += expf(x[j] - m);
        const float log_s = logf(s);
        int64_t token = 0;
        if (keys) {
            const uint64_t key = (uint64_t)keys[r];
            for (int64_t j = 0; j < V; j++) {
                uint64_t z = key + (uint64_t)j * 0x9E3779B97F4A7C15ull;
                z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
                z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
                p[j] = ((x[j] - m) - log_s) - logf(-logf(((float)(uint32_t)(z >> 40) + 0.5f) * 0x1p-24f));
            }
            for (int64_t j = 1; j < V; j++) if (p[j] > p[token]) token = j;
            tokens[r] = token;
            logprobs[r] = (x[token] - m) - log_s;
            continue;
        }
        for (int64_t j = 0; j < V; j++) { p[j] = expf((x[j] - m) - log_s); total += p[j]; }
        const float target = u[r] * total;
        for (; token < V; token++) if ((c += p[token]) > target) break;
        if (token == V) for (token = V - 1; token > 0 && p[token] == 0.f; token--) {}
        tokens[r] = token;
        logprobs[r] = (x[token] - m) - log_s;
    }
    return 0;
}
