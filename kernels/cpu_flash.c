/* Causal attention of one prefill span over the paged KV cache on AMX bfloat16 tiles, for
 * kernels/flash_prefill.py (ctypes).
 *
 * Why: torch's flash kernel wants contiguous [1, H, L, D] tensors, so each span was gathered from
 * its pages, padded (its oneDNN kernels are built per size) and converted to bfloat16, and its
 * output converted back: at 2,000 tokens those copies cost as much as the attention, which itself
 * spends most of its time in its exponentials. Here the span's keys and values are read from their
 * pages once, rounded to bfloat16 straight into the tiles' layouts, and every (query head, block of
 * 32 query rows) runs flash attention over the key blocks it sees (causal, and within ``window``):
 * S = Q K^T and O += P V on the tiles, the online softmax in AVX-512 with a base-2 exponential of
 * our own (a degree-3 polynomial around the nearest integer: 7.5e-5 relative, far below bfloat16's
 * rounding of P; the exponentials are most of the attention's time). Q, K, V and P are rounded to
 * bfloat16 as torch's bfloat16 flash kernel rounds them; scores, the softmax and the output are
 * float32. Queries and output stay float32 rows.
 *
 * Buffers: the keys and values in tiles' layout (grown to the largest span, 4 bytes per key and
 * head dimension and kv head: 1.5 MiB at 2,048 tokens of SmolLM2; freed after a span of over
 * 64 MiB) and per thread ~55 KB. Head dims: multiples of 32 up to 256.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_common.h" /* the KV cache's forms */

#define QB 32        /* query rows per block: two A tiles */
#define KB 32        /* keys per block: two B tiles */
#define STEP (2 * KB) /* keys per softmax step: two blocks */
#define VECS (STEP / 16) /* a row's scores of a step, 16 a vector */
#define MAX_D 256    /* head dims up to this */
#define RAISE 8.0f   /* base-2 units a score may pass the running maximum by before it is raised */
#define KEEP_BYTES (64 << 20) /* a larger layout buffer is freed after its call */
#define MAX(a, b) ((a) > (b) ? (a) : (b))

#if AMX

typedef struct {
    const char *k_cache, *v_cache;
    const int64_t *pages;
    int64_t page_size, kv_heads, D;
    int kv; /* the caches' form (cpu_common.h): bfloat16 copied as it is, float32 and float16 rounded here */
} Cache;

/* Element offset of key t's row of kv head g. */
static int64_t cache_row(const Cache *c, int64_t t, int64_t g)
{
    const int64_t slot = c->pages[t / c->page_size] * c->page_size + t % c->page_size;
    return (slot * c->kv_heads + g) * c->D;
}

/* 16 elements of a cache row as bfloat16: as stored, or rounded to nearest even. */
static __m256i row16(const Cache *c, const char *base, int64_t at)
{
    if (c->kv == KV_BF16)
        return _mm256_loadu_si256((const __m256i *)(base + 2 * at));
    if (c->kv == KV_F16)
        return (__m256i)_mm512_cvtneps_pbh(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(base + 2 * at))));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps((const float *)(base + 4 * at)));
}

/* Keys of block b (KB of them, zero past ``length``) of kv head g as B tiles of S = Q K^T: pair p
 * of dims of key c at [p][c] (u32), D / 2 rows of KB. Values as B tiles of O = P V: the pair of
 * keys (2j, 2j + 1) of dim d at [j][d], KB / 2 rows of D. */
static void layout_block(const Cache *c, int64_t length, int64_t g, int64_t b, uint32_t *kp, uint32_t *vp)
{
    const int64_t D = c->D;
    uint16_t k16[KB * MAX_D], v16[KB * MAX_D];
    for (int64_t i = 0; i < KB; i++) {
        const int64_t t = b * KB + i;
        const int64_t at = t < length ? cache_row(c, t, g) : 0;
        for (int64_t d = 0; d < D; d += 16) {
            __m256i kv = _mm256_setzero_si256(), vv = _mm256_setzero_si256();
            if (t < length) {
                kv = row16(c, c->k_cache, at + d);
                vv = row16(c, c->v_cache, at + d);
            }
            _mm256_storeu_si256((__m256i *)(k16 + i * D + d), kv);
            _mm256_storeu_si256((__m256i *)(v16 + i * D + d), vv);
        }
    }
    to_pairs(k16, D, KB, D, kp, KB, 16 * KB, 16); /* keys: rows of D / 2 pairs turned into columns */
    for (int64_t j = 0; j < KB / 2; j++) /* values: two key rows interleaved value by value */
        for (int64_t d = 0; d < D; d += 16) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(v16 + 2 * j * D + d));
            const __m256i z = _mm256_loadu_si256((const __m256i *)(v16 + (2 * j + 1) * D + d));
            const __m256i lo = _mm256_unpacklo_epi16(a, z), hi = _mm256_unpackhi_epi16(a, z);
            uint32_t *o = vp + j * D + d;
            _mm256_storeu_si256((__m256i *)o, _mm256_permute2x128_si256(lo, hi, 0x20));
            _mm256_storeu_si256((__m256i *)(o + 8), _mm256_permute2x128_si256(lo, hi, 0x31));
        }
}

typedef struct {
    const float *q;
    int64_t ldq;
    float *out;
    int64_t ldo;
    int64_t n, length, heads, kv_heads, D, window, blocks;
    float scale2; /* scale * log2(e): scores in base 2 */
    const float *sinks;
    const uint32_t *kp, *vp;
} Span;

/* 2^x for the softmax's weights: a degree-3 polynomial around the nearest integer, 7.5e-5 relative
 * (bfloat16, which the weights are rounded to, keeps 2^-9: the two more terms of exp2_ps were for
 * nothing here), no floor: x far below zero gives 0 and past 128 infinity, both only where the
 * caller masks the lane or a weight truly is 0. */
static inline __m512 exp2_coarse(__m512 x)
{
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n); /* [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(0.055171344f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24261034f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69326097f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992812f));
    return _mm512_scalef_ps(p, n);
}

/* One row's scores of a step's keys (row, STEP floats) into its weights (prow, bfloat16) against the
 * running maximum m (base 2) and sums l, its output row o rescaled where the maximum is raised.
 * seen: the keys it sees, 16 a mask (the others' weights are 0); ``whole`` (a constant where this is
 * inlined): all of them, no masking at all. Scores are scaled to base 2 in the exponent's own fma. */
static inline __attribute__((always_inline)) void softmax_row(const float *row, uint16_t *prow, float *m, __m512 *l,
                                                              float *o, int64_t D, float scale2, const __mmask16 *seen,
                                                              int whole)
{
    const __m512 k2 = _mm512_set1_ps(scale2);
    __m512 sv[VECS], p[VECS];
    for (int i = 0; i < VECS; i++)
        sv[i] = _mm512_loadu_ps(row + 16 * i);
    /* The running maximum is raised only when a score passes it by more than RAISE (weights up to
     * 2^RAISE then): most steps leave it, the output and the sums as they are, and need no
     * horizontal maximum. Compared unscaled (scale2 > 0). */
    const __m512 limit = _mm512_set1_ps((*m + RAISE) / scale2);
    __mmask16 over = 0;
    for (int i = 0; i < VECS; i++)
        over |= whole ? _mm512_cmp_ps_mask(sv[i], limit, _CMP_GT_OQ)
                      : _mm512_mask_cmp_ps_mask(seen[i], sv[i], limit, _CMP_GT_OQ);
    if (over) {
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        __m512 top = whole ? sv[0] : _mm512_mask_mov_ps(ninf, seen[0], sv[0]);
        for (int i = 1; i < VECS; i++)
            top = _mm512_max_ps(top, whole ? sv[i] : _mm512_mask_mov_ps(ninf, seen[i], sv[i]));
        const float t = _mm512_reduce_max_ps(top) * scale2;
        const __m512 alpha = _mm512_set1_ps(*m == -INFINITY ? 0.0f : exp2f(*m - t));
        *m = t;
        *l = _mm512_mul_ps(alpha, *l);
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(o + d, _mm512_mul_ps(alpha, _mm512_loadu_ps(o + d)));
    }
    const __m512 minus_m = _mm512_set1_ps(-*m);
    for (int i = 0; i < VECS; i++) {
        p[i] = exp2_coarse(_mm512_fmadd_ps(sv[i], k2, minus_m));
        if (!whole)
            p[i] = _mm512_maskz_mov_ps(seen[i], p[i]);
    }
    *l = _mm512_add_ps(*l, _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])));
    for (int i = 0; i < VECS; i += 2)
        _mm512_storeu_si512(prow + 16 * i, (__m512i)_mm512_cvtne2ps_pbh(p[i + 1], p[i]));
}

/* Query head h, rows r0 .. r0 + QB of the span (positions length - n + r). A step takes two key
 * blocks (STEP keys): their scores by S = Q K^T on the tiles, one softmax pass over both, then
 * O += P V with the output's tiles loaded and stored once for both (one block a step cost a third
 * more tile loads and stores and twice the rows' bookkeeping). */
static void attend_block(const Span *s, int64_t h, int64_t r0)
{
    const int64_t D = s->D, g = h / (s->heads / s->kv_heads), rows = MIN(QB, s->n - r0);
    const int64_t first = s->length - s->n + r0, last = first + rows - 1; /* positions of the rows */
    static __thread uint16_t q16[QB * MAX_D] __attribute__((aligned(64)));
    static __thread float o[QB * MAX_D] __attribute__((aligned(64)));
    static __thread float sc[QB * STEP] __attribute__((aligned(64)));
    static __thread uint16_t p16[QB * STEP] __attribute__((aligned(64)));
    static __thread __m512 l[QB]; /* each row's softmax denominator, 16 partial sums (added up at the end) */
    float m[QB];
    for (int64_t r = 0; r < QB; r++) {
        m[r] = -INFINITY;
        l[r] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
            const __m512 v = r < rows ? _mm512_loadu_ps(s->q + (r0 + r) * s->ldq + h * D + d) : _mm512_setzero_ps();
            _mm256_storeu_si256((__m256i *)(q16 + r * D + d), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
    memset(o, 0, sizeof(float) * QB * (size_t)D);
    const int64_t lo = s->window > 0 ? MAX(0, first - s->window + 1) : 0;
    const uint32_t *kp = s->kp + g * s->blocks * KB * D / 2, *vp = s->vp + g * s->blocks * KB * D / 2;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t b = lo / KB; b <= last / KB; b += 2) {
        const int two = b + 1 <= last / KB; /* the second block has keys some row sees */
        for (int half = 0; half < 1 + two; half++) { /* S = Q K^T, a block's 32 columns of sc at a time */
            const uint32_t *kb = kp + (b + half) * KB * D / 2;
            float *c = sc + half * KB;
            start_tiles(1, NULL, NULL, NULL, NULL, 0);
            for (int64_t d = 0; d < D; d += 32)
                dp_2x2(q16 + d, q16 + 16 * D + d, D * 2, kb + d / 2 * KB, kb + d / 2 * KB + 16, KB * 4);
            store_tiles(c, c + 16, c + 16 * STEP, c + 16 * STEP + 16, STEP * 4);
        }
        /* a step every row sees whole (below the diagonal, inside every row's window): no masks */
        const int whole = rows == QB && two && b * KB + STEP - 1 <= first && (s->window <= 0 || b * KB > last - s->window);
        if (whole)
            for (int64_t r = 0; r < QB; r++)
                softmax_row(sc + r * STEP, p16 + r * STEP, &m[r], &l[r], o + r * D, D, s->scale2, NULL, 1);
        else
            for (int64_t r = 0; r < QB; r++) {
                __mmask16 seen[VECS] = {0};
                __mmask16 any = 0;
                if (r < rows) { /* keys b*KB + c with max(lo_r, 0) <= key <= pos, in a block that is there */
                    const int64_t pos = first + r, from = s->window > 0 ? pos - s->window + 1 : 0;
                    for (int i = 0; i < VECS && (i < VECS / 2 || two); i++) {
                        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(b * KB + 16 * i)));
                        seen[i] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32((int)pos))
                                & _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32((int)MAX(from, 0)));
                        any |= seen[i];
                    }
                }
                if (!any) { /* nothing seen here (a padding row, or before its window) */
                    memset(p16 + r * STEP, 0, sizeof(uint16_t) * STEP);
                    continue;
                }
                softmax_row(sc + r * STEP, p16 + r * STEP, &m[r], &l[r], o + r * D, D, s->scale2, seen, 0);
            }
        const uint32_t *vb = vp + b * KB * D / 2;
        for (int64_t d = 0; d < D; d += 32) {
            float *c = o + d; /* O += P V, the rows' sums passed through the tiles */
            start_tiles(0, c, c + 16, c + 16 * D, c + 16 * D + 16, D * 4);
            for (int half = 0; half < 1 + two; half++) /* P's rows of this block's keys, its values' dims d .. d + 32 */
                dp_2x2(p16 + half * KB, p16 + 16 * STEP + half * KB, STEP * 2, vb + half * KB * D / 2 + d,
                       vb + half * KB * D / 2 + d + 16, D * 4);
            store_tiles(c, c + 16, c + 16 * D, c + 16 * D + 16, D * 4);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float denominator = _mm512_reduce_add_ps(l[r]);
        if (s->sinks) /* gpt-oss: one more logit per head in the denominator */
            denominator += exp2f(s->sinks[h] * (float)M_LOG2E - m[r]);
        const __m512 inv = _mm512_set1_ps(1.0f / denominator);
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(s->out + (r0 + r) * s->ldo + h * D + d, _mm512_mul_ps(inv, _mm512_loadu_ps(o + r * D + d)));
    }
}

static __thread uint32_t *layout = NULL; /* the calling thread's (the forward's) */
static __thread size_t capacity = 0;

/* Every span of a step (span s: rows spans[4 s] .. spans[4 s + 1] of q and out, its first spans[4 s + 2]
 * cached tokens through the pages from pages + spans[4 s + 3]) in one parallel region: first every
 * span's keys and values laid out for the tiles, then every (span, head, block of query rows) handed
 * out in turn, each span's last blocks (which see the most keys) first. A region and its barriers a
 * span cost more than the attention of a 128-token prompt. 0, or 1 without a buffer. */
static int flash_spans(const float *q, int64_t ldq, const Cache *cache, const int64_t *spans, const int64_t *pages,
                       int64_t count, int64_t heads, float scale, int64_t window, const float *sinks, float *out,
                       int64_t ldo, int num_threads)
{
    const int64_t kv_heads = cache->kv_heads, D = cache->D;
    Span *all = malloc(sizeof(Span) * (size_t)count);
    Cache *caches = malloc(sizeof(Cache) * (size_t)count);
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(2 * count + 2)); /* prefix sums: layout items, tasks */
    if (!all || !caches || !starts) {
        free(all), free(caches), free(starts);
        return 1;
    }
    int64_t *tasks = starts + count + 1;
    starts[0] = tasks[0] = 0;
    for (int64_t s = 0; s < count; s++) { /* each span's (kv head, key block) items, and its work */
        const int64_t *sp = spans + 4 * s, n = sp[1] - sp[0];
        starts[s + 1] = starts[s] + kv_heads * ((sp[2] + KB - 1) / KB);
        tasks[s + 1] = tasks[s] + (n > 0 ? heads * ((n + QB - 1) / QB) : 0);
    }
    const size_t bytes = (size_t)(starts[count] * KB * D) * 4; /* an item's keys and values: 2 bytes a value each */
    if (bytes > capacity) {
        free(layout);
        capacity = 0;
        if (posix_memalign((void **)&layout, 64, bytes)) {
            free(all), free(caches), free(starts);
            return 1;
        }
        capacity = bytes;
    }
    for (int64_t s = 0; s < count; s++) {
        const int64_t *sp = spans + 4 * s, blocks = (sp[2] + KB - 1) / KB;
        const uint32_t *kp = layout + starts[s] * KB * D; /* the span's keys, then its values */
        caches[s] = *cache;
        caches[s].pages = pages + sp[3];
        all[s] = (Span){.q = q + sp[0] * ldq, .ldq = ldq, .out = out + sp[0] * ldo, .ldo = ldo, .n = sp[1] - sp[0],
                        .length = sp[2], .heads = heads, .kv_heads = kv_heads, .D = D, .window = window,
                        .blocks = blocks, .scale2 = scale * (float)M_LOG2E, .sinks = sinks, .kp = kp,
                        .vp = kp + kv_heads * blocks * KB * D / 2};
    }
#pragma omp parallel num_threads(num_threads)
    {
        int64_t s = 0;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < starts[count]; i++) {
            while (i >= starts[s + 1]) /* the span of item i (each thread's items come in order) */
                s++;
            const int64_t blocks = all[s].blocks, g = (i - starts[s]) / blocks, b = (i - starts[s]) % blocks;
            layout_block(&caches[s], all[s].length, g, b, (uint32_t *)all[s].kp + (g * blocks + b) * KB * D / 2,
                         (uint32_t *)all[s].vp + (g * blocks + b) * KB * D / 2);
        }
        configure();
        s = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < tasks[count]; i++) {
            while (i >= tasks[s + 1] || i < tasks[s]) /* dynamic: i only grows for a thread */
                s = i >= tasks[s + 1] ? s + 1 : 0;
            const int64_t j = i - tasks[s], query_blocks = (all[s].n + QB - 1) / QB;
            attend_block(&all[s], j % heads, (query_blocks - 1 - j / heads) * QB);
        }
        _tile_release();
    }
    free(all), free(caches), free(starts);
    return 0;
}
#endif

/* Every prefill span of a step in one call: span s is rows spans[4 s] .. spans[4 s + 1] of q and out,
 * attending its first spans[4 s + 2] cached tokens through the pages from pages + spans[4 s + 3]
 * (see flash_spans). q and out: float32 rows of heads x D (strides ldq, ldo); caches [pages,
 * page_size, kv_heads, D] of form kv (cpu_common.h). 0; 1 no buffer; 3 no tiles here; 4 a head dim
 * this kernel does not take. */
int trillm_flash_prefill(const float *q, int64_t ldq, const void *k_cache, const void *v_cache,
                         const int64_t *spans, const int64_t *pages, int64_t count, int64_t page_size, int64_t heads,
                         int64_t kv_heads, int64_t D, float scale, int64_t window, const float *sinks, float *out,
                         int64_t ldo, int num_threads, int kv)
{
#if AMX
    if (!amx_granted())
        return 3;
    if (D % 32 || D > MAX_D || heads % kv_heads || (kv != KV_F32 && kv != KV_F16 && kv != KV_BF16))
        return 4;
    const Cache cache = {k_cache, v_cache, pages, page_size, kv_heads, D, kv};
    const int rc = count > 0 ? flash_spans(q, ldq, &cache, spans, pages, count, heads, scale, window, sinks, out, ldo,
                                           num_threads)
                             : 0;
    if (capacity > KEEP_BYTES) {
        free(layout);
        layout = NULL;
        capacity = 0;
    }
    return rc;
#else
    (void)q, (void)ldq, (void)k_cache, (void)v_cache, (void)spans, (void)pages, (void)count, (void)page_size;
    (void)heads, (void)kv_heads, (void)D, (void)scale, (void)window, (void)sinks, (void)out, (void)ldo;
    (void)num_threads, (void)kv;
    return 3;
#endif
}
