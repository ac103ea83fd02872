/* Small elementwise ops of the CPU forward, float32, for kernels/cpu_ops.py (ctypes).
 *
 * Each one replaces a handful of torch ops whose per-op overhead (dispatch, output
 * allocation, a pass over memory each) is most of their cost at decode sizes.
 * Rows are independent; they are shared among OpenMP threads only when there is
 * enough work, since starting the team costs more than a 32-row batch takes.
 * Built without -ffast-math (see cpu_decode.c), so the arithmetic is the same IEEE
 * float arithmetic as torch's, up to the order of additions and fused multiply-adds.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_common.h" /* INLINE, vector expf for the silu loop, tree_sum, the KV cache's stores */

/* Floats read below which one thread does all rows. Measured on the 2-core Xeon
 * VM with libgomp: a parallel region costs about 1 us while the other thread still
 * spins from the last one, but tens of us to several ms once it sleeps (a few ms
 * after its last region), and its spinning takes a core from torch's own threads.
 * Serially, 2^17 floats take about 15-30 us (rms_norm ~19 us at 228 rows of 576,
 * rotary ~14 us at 171 rows of 12 x 64, silu_mul ~27 us at 43 rows of 1536, where
 * expf makes it the costliest per float), where two threads start to win clearly.
 * So a SmolLM2 decode batch of 32 stays on one thread for all three ops. */
#ifndef PARALLEL_MIN_WORK
#define PARALLEL_MIN_WORK (1 << 17)
#endif

/* out[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * w, out contiguous [T, N]. */
void trillm_rms_norm(const float *restrict x, int64_t x_stride, const float *restrict w, float *restrict out,
                     int64_t T, int64_t N, float eps, int num_threads)
{
#pragma omp parallel for if (T > 1 && T * N >= PARALLEL_MIN_WORK) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++)
        rms_norm_row(x + t * x_stride, w, out + t * N, N, eps);
}

/* This step's keys and values into their cache slots: row t of k and v (``width`` floats at
 * k + t * ld, v + t * ld: the K and V columns of the fused QKV product) into slot slots[t] of
 * each cache (rows of ``width`` values of form kv, cpu_common.h's store_kv: the C decode loop's
 * stores). Slots below zero are skipped. What torch took in a clamp, a conversion and an
 * index_copy_ a cache (2 ms a layer at 2,000 rows) is one pass over the rows. */
void trillm_kv_scatter(const float *k, const float *v, int64_t ld, int64_t T, int64_t width, const int64_t *slots,
                       void *k_cache, void *v_cache, int kv, int num_threads)
{
    const int64_t row = width * KV_BYTES(kv);
#pragma omp parallel for if (T > 1 && 2 * T * width >= PARALLEL_MIN_WORK) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0)
            continue;
        store_kv((char *)k_cache + slots[t] * row, k + t * ld, width, kv);
        store_kv((char *)v_cache + slots[t] * row, v + t * ld, width, kv);
    }
}

/* Rotate-half, the same products and sums as engine.rope.apply_rotary:
 * x * cos + cat(-x2, x1) * sin, with each half using its own half of cos/sin. */
INLINE void rotate_row(float *restrict x, int64_t head_stride, const float *restrict c, const float *restrict s,
                       int64_t H, int64_t D)
{
    const int64_t half = D / 2;
    for (int64_t h = 0; h < H; h++) {
        float *restrict x1 = x + h * head_stride, *restrict x2 = x1 + half;
        for (int64_t j = 0; j < half; j++) {
            const float a = x1[j], b = x2[j];
            x1[j] = a * c[j] + (-b) * s[j];
            x2[j] = b * c[half + j] + a * s[half + j];
        }
    }
}

/* In place on qk[t, h, :] at qk + t * row_stride + h * head_stride; cos, sin
 * contiguous [T, D]. D is even. */
void trillm_rotary(float *qk, int64_t row_stride, int64_t head_stride, const float *restrict cos_,
                   const float *restrict sin_, int64_t T, int64_t H, int64_t D, int num_threads)
{
#pragma omp parallel for if (T > 1 && T * H * D >= PARALLEL_MIN_WORK) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        float *row = qk + t * row_stride;
        const float *c = cos_ + t * D, *s = sin_ + t * D;
        if (D == 64)
            rotate_row(row, head_stride, c, s, H, 64);
        else if (D == 128)
            rotate_row(row, head_stride, c, s, H, 128);
        else
            rotate_row(row, head_stride, c, s, H, D);
    }
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i], out contiguous [T, I]; silu(g) is
 * g / (1 + exp(-g)) as torch computes it. */
void trillm_silu_mul(const float *restrict gu, int64_t gu_stride, float *restrict out, int64_t T, int64_t I,
                     int num_threads)
{
#pragma omp parallel for if (T > 1 && T * 2 * I >= PARALLEL_MIN_WORK) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        const float *restrict g = gu + t * gu_stride, *restrict u = g + I;
        float *restrict o = out + t * I;
        for (int64_t i = 0; i < I; i++)
            o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* out[t, i] = gelu_tanh(gu[t, i]) * gu[t, I + i] (GeGLU, Gemma's MLP), out contiguous [T, I];
 * gelu_tanh(g) = g / 2 * (1 + tanh(y)), y = sqrt(2 / pi) * (g + 0.044715 g^3), as torch defines it,
 * computed as g / (1 + exp(-2 y)) (the same function: 1 + tanh y = 2 / (1 + exp(-2 y))) so that the
 * loop takes glibc's vector expf as silu_mul's does; scalar tanhf was 8 % of a Gemma 3 decode step. */
void trillm_gelu_tanh_mul(const float *restrict gu, int64_t gu_stride, float *restrict out, int64_t T, int64_t I,
                          int num_threads)
{
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
#pragma omp parallel for if (T > 1 && T * 2 * I >= PARALLEL_MIN_WORK) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        const float *restrict g = gu + t * gu_stride, *restrict u = g + I;
        float *restrict o = out + t * I;
        for (int64_t i = 0; i < I; i++) {
            const float x = g[i];
            o[i] = x / (1.0f + expf(-2.0f * beta * (x + kappa * x * x * x))) * u[i];
        }
    }
}

/* Grammar masks (structured outputs): for each listed row, every logit whose bit in the
 * row's int32 bitmask is 0 becomes -inf. A word of 32 allowed tokens is skipped, a word
 * of none is 32 stores the compiler vectorises; masks of JSON grammars are mostly whole
 * words of none, so this is a store-bound pass over the forbidden part of each row. */
void trillm_apply_bitmask(float *logits, int64_t logits_stride, const int32_t *restrict bitmask,
                          int64_t bitmask_stride, const int64_t *restrict rows, int64_t num_rows, int64_t vocab)
{
    const float ninf = -INFINITY;
    for (int64_t r = 0; r < num_rows; r++) {
        float *restrict row = logits + rows[r] * logits_stride;
        const int32_t *restrict bits = bitmask + rows[r] * bitmask_stride;
        int64_t words = (vocab + 31) / 32;
        for (int64_t w = 0; w < words; w++) {
            uint32_t word = (uint32_t)bits[w];
            if (word == 0xFFFFFFFFu)
                continue;
            int64_t base = w * 32, n = MIN(32, vocab - base);
            if (word == 0 && n == 32) {
                for (int k = 0; k < 32; k++)
                    row[base + k] = ninf;
                continue;
            }
            for (int64_t k = 0; k < n; k++)
                if (!((word >> k) & 1u))
                    row[base + k] = ninf;
        }
    }
}

/* ---- sampling: one draw per row from softmax(logits / temperature) ---- */

#define DRAW_BLOCK 1024 /* values per block sum: the draw finds its block, then its value in it */

/* sum of expf((x[i] - m) / t) over n values, 16 partial sums (vector expf where glibc has one) */
INLINE float exp_sum(const float *restrict x, int64_t n, float m, float t)
{
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++)
            part[l] += expf((x[i + l] - m) / t);
    for (; i < n; i++)
        part[0] += expf((x[i] - m) / t);
    return tree_sum(part, 16);
}

/* The first index of the largest value m (0 if none equals it, as when m is NaN). */
static int64_t first_of(const float *x, int64_t V, float m)
{
    for (int64_t i = 0; i < V; i++)
        if (x[i] == m)
            return i;
    return 0;
}

/* The index drawn from softmax(x / t) with uniform u in [0, 1): the CDF of the unnormalised
 * weights expf((x - max) / t) inverted at u times their total, as sampler.draw does: block sums
 * pick the block, a running sum in it the value, never one of weight 0. (x - max) / t rather than
 * x / t - max / t: a tiny t sends every value but the largest to -inf, not to inf - inf. */
static int64_t draw_row(const float *restrict x, int64_t V, float t, double u, float *restrict sums)
{
    float part[16];
    for (int l = 0; l < 16; l++)
        part[l] = -INFINITY;
    int64_t i0 = 0;
    for (; i0 + 16 <= V; i0 += 16) /* vectorised: 16 running maxima */
        for (int l = 0; l < 16; l++)
            part[l] = x[i0 + l] > part[l] ? x[i0 + l] : part[l];
    for (; i0 < V; i0++)
        part[0] = x[i0] > part[0] ? x[i0] : part[0];
    const float m = tree_max(part, 16);
    if (!(m > -INFINITY) || m == INFINITY)
        return first_of(x, V, m); /* everything masked, or an infinite logit: nothing to weigh */
    const int64_t blocks = (V + DRAW_BLOCK - 1) / DRAW_BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n = MIN(DRAW_BLOCK, V - b * DRAW_BLOCK);
        sums[b] = exp_sum(x + b * DRAW_BLOCK, n, m, t);
        total += sums[b];
    }
    const double target = u * total;
    double before = 0.0;
    int64_t b = 0;
    while (b < blocks - 1 && before + sums[b] <= target)
        before += sums[b++];
    int64_t last = -1;
    double run = before;
    for (int64_t i = b * DRAW_BLOCK; i < MIN(V, (b + 1) * DRAW_BLOCK); i++) {
        const float w = expf((x[i] - m) / t);
        if (w > 0.0f) {
            last = i;
            run += w;
            if (run > target)
                return i;
        }
    }
    return last >= 0 ? last : first_of(x, V, m); /* rounding stepped past the block's last weight */
}

/* out[r] = a draw from softmax(logits[r] / temperature[r]) with uniform u[r], r < R; rows of V
 * logits, `stride` floats apart. Temperatures must be > 0. */
void trillm_sample_rows(const float *logits, int64_t stride, int64_t R, int64_t V, const float *temperature,
                        const double *u, int64_t *out, int num_threads)
{
    const int64_t blocks = (V + DRAW_BLOCK - 1) / DRAW_BLOCK;
#pragma omp parallel num_threads(num_threads) if (R > 1 && R * V >= PARALLEL_MIN_WORK)
    {
        float *sums = malloc(sizeof(float) * (size_t)(blocks > 0 ? blocks : 1));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++)
            out[r] = sums ? draw_row(logits + r * stride, V, temperature[r], u[r], sums) : -1;
        free(sums);
    }
}
