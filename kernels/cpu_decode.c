/* Paged decode attention on the CPU, float32, for kernels/cpu_decode.py (ctypes).
 *
 * out[b, h, :] = softmax(scale * q[b, h, :] . K[tokens of seq b, h / G, :]) @ V[...]
 * with G = H / KVH query heads per kv head. One task is one (sequence, kv head)
 * pair and handles its G query heads together, so each K/V row is read once.
 * Two passes per task: scores into a per-thread buffer (max, exp, sum), then the
 * weighted sum of V rows. Plain C so that it builds in about a second.
 *
 * Layouts (all contiguous): q, out [B, H, D]; k_cache, v_cache
 * [num_pages, page_size, KVH, D]; block_tables [B, max_pages] int32;
 * context_lens [B] int32. Token p of sequence b is in page
 * block_tables[b, p / page_size], slot p % page_size.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Vector expf from glibc's libmvec, as in cpu_ops.c (built with -fno-math-errno):
 * the weights loop below then runs 16 lanes at a time. Scalar expf was about a
 * third of the kernel's time at 200 tokens of context. */
#if defined(__x86_64__) && defined(__GLIBC__)
float expf(float) __attribute__((simd("notinbranch")));
#endif

#define INLINE static inline __attribute__((always_inline))

typedef struct {
    const float *k_cache, *v_cache;
    int64_t page_size, row, page; /* floats between slots and between pages */
    int64_t stride;               /* floats between the score rows of two heads */
    float scale;
} Layout;

/* a . b with 8 partial sums added as a tree at the end. An `omp simd reduction`
 * is summed lane after lane without -ffast-math: a long dependency chain that
 * made the whole kernel about 3x slower. */
INLINE float dot(const float *restrict a, const float *restrict b, int64_t D)
{
    float part[8] = {0};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        for (int l = 0; l < 8; l++)
            part[l] += a[d + l] * b[d + l];
    for (; d < D; d++)
        part[0] += a[d] * b[d];
    for (int w = 4; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            part[l] += part[l + w];
    return part[0];
}

/* The sum of x[0..n), with 8 partial sums for the same reason. */
INLINE float sum_of(const float *restrict x, int64_t n)
{
    float part[8] = {0};
    int64_t p = 0;
    for (; p + 8 <= n; p += 8)
        for (int l = 0; l < 8; l++)
            part[l] += x[p + l];
    for (; p < n; p++)
        part[0] += x[p];
    for (int w = 4; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            part[l] += part[l + w];
    return part[0];
}

/* The largest of x[0..n), with 8 running maxima for the same reason. */
INLINE float max_of(const float *restrict x, int64_t n)
{
    float part[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int64_t p = 0;
    for (; p + 8 <= n; p += 8)
        for (int l = 0; l < 8; l++)
            part[l] = x[p + l] > part[l] ? x[p + l] : part[l];
    for (; p < n; p++)
        part[0] = x[p] > part[0] ? x[p] : part[0];
    for (int w = 4; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            part[l] = part[l + w] > part[l] ? part[l + w] : part[l];
    return part[0];
}

/* Pages are scattered, so the hardware prefetcher cannot guess the next one. */
INLINE void prefetch_page(const float *p, int64_t rows, int64_t row, int64_t D)
{
    for (int64_t s = 0; s < rows; s++)
        for (int64_t d = 0; d < D; d += 16)
            __builtin_prefetch(p + s * row + d);
}

/* This kv head's rows in the page holding token p0 (a multiple of page_size),
 * after prefetching them from the next page. */
INLINE const float *page_start(const Layout *L, const float *cache, const int32_t *table, int64_t p0, int64_t n,
                               int64_t D)
{
    const int64_t ps = L->page_size;
    if (p0 + ps < n)
        prefetch_page(cache + (int64_t)table[p0 / ps + 1] * L->page, n - p0 - ps < ps ? n - p0 - ps : ps, L->row, D);
    return cache + (int64_t)table[p0 / ps] * L->page;
}

/* The G heads of kv head `kvh` over the n tokens of one sequence. Inlined with a
 * constant D for the common head sizes so the inner loops unroll completely.
 * scores: [G, L->stride]; acc: [G, D] then [G] reciprocal sums. */
INLINE void attend(const Layout *L, const int32_t *table, int64_t n, int64_t kvh, int64_t G, int64_t D,
                   const float *restrict qb, float *restrict ob, float *restrict scores, float *restrict acc)
{
    const int64_t ps = L->page_size, row = L->row, stride = L->stride;
    const float scale = L->scale, *k_cache = L->k_cache + kvh * D, *v_cache = L->v_cache + kvh * D;
    float *restrict inv = acc + G * D;

    for (int64_t p0 = 0; p0 < n; p0 += ps) {
        const float *page = page_start(L, k_cache, table, p0, n, D);
        const int64_t m = n - p0 < ps ? n - p0 : ps;
        for (int64_t s = 0; s < m; s++)
            for (int64_t g = 0; g < G; g++)
                scores[g * stride + p0 + s] = dot(qb + g * D, page + s * row, D) * scale;
    }
    /* Unnormalised weights (divided at the end). Weights under e^-80 add nothing
     * visible, but their denormal products are very slow. NaN stays NaN. */
    for (int64_t g = 0; g < G; g++) {
        float *restrict sg = scores + g * stride;
        const float mx = max_of(sg, n);
        for (int64_t p = 0; p < n; p++) { /* no sum here: an ordered sum would stop vectorisation */
            const float x = sg[p] - mx;
            sg[p] = x < -80.0f ? 0.0f : expf(x);
        }
        inv[g] = 1.0f / sum_of(sg, n);
    }
    memset(acc, 0, sizeof(float) * (size_t)(G * D));
    for (int64_t p0 = 0; p0 < n; p0 += ps) {
        const float *page = page_start(L, v_cache, table, p0, n, D);
        const int64_t m = n - p0 < ps ? n - p0 : ps;
        for (int64_t g = 0; g < G; g++) { /* g outside, so acc[g] can stay in registers */
            float *restrict ag = acc + g * D;
            for (int64_t s = 0; s < m; s++) {
                const float w = scores[g * stride + p0 + s], *restrict r = page + s * row;
                for (int64_t d = 0; d < D; d++)
                    ag[d] += w * r[d];
            }
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++)
            ob[g * D + d] = acc[g * D + d] * inv[g];
}

/* Returns 0 on success; 1 if a size, a context length or a used page index is
 * out of range (nothing is computed then); 2 if a buffer could not be allocated.
 * A context length of 0 gives zeros, as the reference does. */
int trillm_decode_attention(
    const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
    const int32_t *restrict block_tables, const int32_t *restrict context_lens, float *restrict out,
    int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t num_pages, int64_t page_size,
    int64_t max_pages, float scale, int num_threads)
{
    if (B == 0)
        return 0;
    if (B < 0 || H <= 0 || KVH <= 0 || D <= 0 || H % KVH != 0 || page_size <= 0 || num_threads < 1)
        return 1;
    /* Validate first so that a bad table cannot make us read outside the cache. */
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = context_lens[b];
        if (n < 0 || n > max_pages * page_size)
            return 1;
        for (int64_t i = 0; i < (n + page_size - 1) / page_size; i++) {
            const int32_t pg = block_tables[b * max_pages + i];
            if (pg < 0 || pg >= num_pages)
                return 1;
        }
        max_ctx = n > max_ctx ? n : max_ctx;
    }
    const int64_t G = H / KVH;
    const Layout L = {k_cache, v_cache, page_size, KVH * D, page_size * KVH * D, max_ctx, scale};
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* Per thread: G score rows of max_ctx, G accumulators of D, G reciprocal sums. */
        float *scores = malloc(sizeof(float) * (size_t)(G * max_ctx + G * D + G));
        float *acc = scores + G * max_ctx;
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < B * KVH; task++) {
            const int64_t b = task / KVH, kvh = task % KVH, n = context_lens[b];
            const int32_t *table = block_tables + b * max_pages;
            const float *qb = q + (b * H + kvh * G) * D;
            float *ob = out + (b * H + kvh * G) * D;
            if (!scores)
                continue;
            if (n == 0)
                memset(ob, 0, sizeof(float) * (size_t)(G * D));
            else if (D == 64)
                attend(&L, table, n, kvh, G, 64, qb, ob, scores, acc);
            else if (D == 128)
                attend(&L, table, n, kvh, G, 128, qb, ob, scores, acc);
            else
                attend(&L, table, n, kvh, G, D, qb, ob, scores, acc);
        }
        free(scores);
    }
    return failed ? 2 : 0;
}
