/* Paged decode attention on the CPU in float32 (the cache float32, float16 or bfloat16), for
 * kernels/cpu_decode.py (ctypes).
 *
 * Over our ~400-line guide on purpose: one kernel, its AVX-512 path and AVX2 loads beside the
 * portable version they must agree with (and, for tests, the stores the fused loop makes).
 *
 * out[b, h, :] = softmax(scale * q[b, h, :] . K[tokens of seq b, h / G, :]) @ V[...]
 * with G = H / KVH query heads per kv head. A task handles the G query heads of
 * a kv head together (in the AVX-512 version, every row reading the same pages too:
 * a verification's rows of one sequence), so each K/V row is read once. Two passes per task: scores
 * into a per-thread buffer (max, exp, sum), then the weighted sum of V rows.
 * Plain C (AVX-512 intrinsics where the compiler targets it, with a portable
 * fallback) so that it builds in about a second.
 *
 * Layouts (all contiguous): q, out [B, H, D]; k_cache, v_cache
 * [num_pages, page_size, KVH, D] float32, or float16 or bfloat16 (half the bytes to read, each
 * element widened to float32 as it is loaded: every function below takes the form kv, a constant
 * where inlined, so each form gets loops of its own); block_tables [B, max_pages] int32;
 * context_lens [B] int32. Token p of sequence b is in page
 * block_tables[b, p / page_size], slot p % page_size.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Vector expf (cpu_common.h): the weights loop below runs 16 lanes at a time.
 * Scalar expf was about a third of the kernel's time at 200 tokens of context. */
#include "cpu_common.h"

typedef struct {
    const char *k_cache, *v_cache; /* elements of KV_BYTES(kv) bytes */
    int64_t page_size, row, page;  /* elements between slots and between pages */
    int64_t stride;               /* floats between the score rows of two heads */
    float scale;
    float softcap; /* > 0: each score s becomes softcap * tanh(s / softcap) (Gemma 2); 0: none */
} Layout;

/* Gemma 2's soft cap of n scores, in place (before the window's mask and the softmax) */
INLINE void soft_cap(float *restrict s, int64_t n, float cap)
{
    if (cap > 0.0f)
        for (int64_t p = 0; p < n; p++)
            s[p] = cap * tanhf(s[p] / cap);
}

/* ---- Portable version: one task per (sequence, kv head) ---- */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(TRILLM_PORTABLE)
/* AVX2 machines run this version: the compiler vectorises the float32 loops below by itself, but
 * not a 16-bit cache's conversions (one scalar vcvtph2ps a value), so 8 lanes are loaded and
 * widened here. The same FMAs in the same lanes as the float32 loops compile to. */
#include <immintrin.h>
#define WIDEN8 1
INLINE __m256 load8(const char *base, int64_t i, int kv)
{
    if (kv == KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(base + 2 * i)));
    if (kv == KV_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(base + 2 * i))), 16));
    return _mm256_loadu_ps((const float *)(base + 4 * i));
}
#endif

/* a . b with 8 partial sums added as a tree at the end. An `omp simd reduction`
 * is summed lane after lane without -ffast-math: a long dependency chain that
 * made the whole kernel about 3x slower. */
INLINE float dot(const float *restrict a, const char *restrict b, int64_t D, int kv)
{
    float part[8] = {0};
    int64_t d = 0;
#ifdef WIDEN8
    __m256 lanes = _mm256_setzero_ps();
    for (; d + 8 <= D; d += 8)
        lanes = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b, d, kv), lanes);
    _mm256_storeu_ps(part, lanes);
#else
    for (; d + 8 <= D; d += 8)
        for (int l = 0; l < 8; l++)
            part[l] += a[d + l] * kv_at(b, d + l, kv);
#endif
    for (; d < D; d++)
        part[0] += a[d] * kv_at(b, d, kv);
    return tree_sum(part, 8);
}

/* acc[0..D) += w * row[0..D) */
INLINE void add_scaled(float *restrict acc, float w, const char *restrict row, int64_t D, int kv)
{
    int64_t d = 0;
#ifdef WIDEN8
    for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(_mm256_set1_ps(w), load8(row, d, kv), _mm256_loadu_ps(acc + d)));
#endif
    for (; d < D; d++)
        acc[d] += w * kv_at(row, d, kv);
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
    return tree_sum(part, 8);
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
    return tree_max(part, 8);
}

/* Pages are scattered, so the hardware prefetcher cannot guess the next one. */
INLINE void prefetch_page(const char *p, int64_t rows, int64_t row, int64_t D, int kv)
{
    for (int64_t s = 0; s < rows; s++)
        for (int64_t b = 0; b < D * KV_BYTES(kv); b += 64)
            __builtin_prefetch(p + s * row * KV_BYTES(kv) + b);
}

/* This kv head's rows in the page holding token p0 (a multiple of page_size),
 * after prefetching them from the next page. */
INLINE const char *page_start(const Layout *L, const char *cache, const int32_t *table, int64_t p0, int64_t n,
                              int64_t D, int kv)
{
    const int64_t ps = L->page_size;
    if (p0 + ps < n)
        prefetch_page(cache + (int64_t)table[p0 / ps + 1] * L->page * KV_BYTES(kv), n - p0 - ps < ps ? n - p0 - ps : ps, L->row,
                      D, kv);
    return cache + (int64_t)table[p0 / ps] * L->page * KV_BYTES(kv);
}

/* The G heads of kv head `kvh` over the n tokens of one sequence. Inlined with a
 * constant D for the common head sizes so the inner loops unroll completely.
 * scores: [G, L->stride]; acc: [G, D] then [G] reciprocal sums. */
INLINE void attend(const Layout *L, const int32_t *table, int64_t n, int64_t skip, int64_t kvh, int64_t G, int64_t D,
                   const float *restrict sinks, const float *restrict qb, float *restrict ob, float *restrict scores,
                   float *restrict acc, int kv)
{
    const int64_t ps = L->page_size, row = L->row, stride = L->stride;
    const float scale = L->scale;
    const char *k_cache = L->k_cache + kvh * D * KV_BYTES(kv), *v_cache = L->v_cache + kvh * D * KV_BYTES(kv);
    float *restrict inv = acc + G * D;

    for (int64_t p0 = 0; p0 < n; p0 += ps) {
        const char *page = page_start(L, k_cache, table, p0, n, D, kv);
        const int64_t m = n - p0 < ps ? n - p0 : ps;
        for (int64_t s = 0; s < m; s++)
            for (int64_t g = 0; g < G; g++)
                scores[g * stride + p0 + s] = dot(qb + g * D, page + s * row * KV_BYTES(kv), D, kv) * scale;
    }
    for (int64_t g = 0; g < G; g++) {
        soft_cap(scores + g * stride, n, L->softcap);
        for (int64_t p = 0; p < skip; p++) /* tokens before a sliding window: weight 0 */
            scores[g * stride + p] = -INFINITY;
    }
    /* Unnormalised weights (divided at the end). Weights under e^-80 add nothing
     * visible, but their denormal products are very slow. NaN stays NaN. */
    for (int64_t g = 0; g < G; g++) {
        float *restrict sg = scores + g * stride;
        const float sink = sinks ? sinks[kvh * G + g] : -INFINITY, top = max_of(sg, n);
        const float mx = sink > top ? sink : top;
        for (int64_t p = 0; p < n; p++) { /* no sum here: an ordered sum would stop vectorisation */
            const float x = sg[p] - mx;
            sg[p] = x < -80.0f ? 0.0f : expf(x);
        }
        inv[g] = 1.0f / (sum_of(sg, n) + (sinks ? expf(sink - mx) : 0.0f)); /* a sink: one more term below */
    }
    memset(acc, 0, sizeof(float) * (size_t)(G * D));
    for (int64_t p0 = 0; p0 < n; p0 += ps) {
        const char *page = page_start(L, v_cache, table, p0, n, D, kv);
        const int64_t m = n - p0 < ps ? n - p0 : ps;
        for (int64_t g = 0; g < G; g++) { /* g outside, so acc[g] can stay in registers */
            float *restrict ag = acc + g * D;
            for (int64_t s = 0; s < m; s++)
                add_scaled(ag, scores[g * stride + p0 + s], page + s * row * KV_BYTES(kv), D, kv);
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++)
            ob[g * D + d] = acc[g * D + d] * inv[g];
}

#define MAX_HEADS 4 /* kv heads per attend16 task */
#define MAX_ROWS 16 /* rows reading the same pages per attend16 task */

#if defined(__AVX512F__) && !defined(TRILLM_PORTABLE)
/* ---- AVX-512 version (D a multiple of 16 up to 128, G <= 8) ----
 * 2-core Ice Lake VM, SmolLM2, 32 sequences of 200 tokens, 30 layers of cold
 * cache (295 MB), called from C: about 17.5 ms for the portable version, 12.5 ms
 * here, 11.2 ms to only read the same rows. The gains: 16 scores per transposing sum instead
 * of a horizontal sum each; whole sequences per task, so that pages are read
 * whole rather than one kv head's 256 of every 768 bytes; and prefetches spread
 * through the arithmetic, into L2: issued in a burst (or to L1) they filled the
 * load queue and fill buffers, and the arithmetic waited for memory. */
#include <immintrin.h>
#define AVX512_PATH 1
#define MAX_G 8
#define MAX_DV 16 /* vectors of 16 floats per row (head dims up to 256: Gemma's) */

/* e^x for x <= 0 (NaN stays NaN) within 1.3 ulp: 2^n * e^r, |r| <= ln2 / 2, with
 * Cephes expf's polynomial. Inline: no call, and no libmvec ABI name to declare. */
INLINE __m512 exp16(__m512 x)
{
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x); /* ln 2 in two parts (Cody-Waite) */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Lane t of sum16(v) is the sum of the lanes of v[T16[t]] (T16 is its own
 * inverse): a transposing tree of 15 adds and 30 shuffles. */
static const int T16[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
INLINE __m512 sum16(const __m512 v[16])
{
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* 8 lanes each of v[i] and v[i + 8] */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
    for (int i = 0; i < 4; i++) /* 4 lanes each of four vectors */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[i], b[i + 2], 0x44), _mm512_shuffle_ps(b[i], b[i + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

/* 16 float32 from element i of a cache of form kv at base (float16 widened by vcvtph2ps, bfloat16
 * by a shift). */
INLINE __m512 load16(const char *base, int64_t i, int kv)
{
    if (kv == KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(base + 2 * i)));
    if (kv == KV_BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(base + 2 * i))), 16));
    return _mm512_loadu_ps((const float *)(base + 4 * i));
}

/* 16 token rows from p0, m of them real (the last one repeated after), as
 * element offsets from base in the cache; base NULL: none. */
typedef struct {
    const char *base;
    int64_t at[16];
    int m;
} Rows;

/* Page and slot step along: a division per token costs more than the rest. */
INLINE void chunk_rows(Rows *r, const Layout *L, const char *base, const int32_t *table, int64_t p0, int64_t n)
{
    int64_t pi = p0 / L->page_size, slot = p0 % L->page_size;
    r->base = base;
    r->m = n - p0 < 16 ? (int)(n - p0) : 16;
    for (int t = 0; t < 16; t++) {
        r->at[t] = (int64_t)table[pi] * L->page + slot * L->row;
        if (t + 1 < r->m && ++slot == L->page_size)
            slot = 0, pi++;
    }
}

/* Rows [t0, t1) of pf into L2, 16 * DV elements each from offset off. */
INLINE void prefetch(const Rows *pf, int64_t off, int t0, int t1, int DV, int kv)
{
    if (pf->base)
        for (int t = t0; t < (t1 < pf->m ? t1 : pf->m); t++)
            for (int b = 0; b < 16 * DV * KV_BYTES(kv); b += 64)
                __builtin_prefetch(pf->base + (off + pf->at[t]) * KV_BYTES(kv) + b, 0, 2);
}

/* sc[g * stride + t] = scale * q_g . K row t of r (from offset off) for the 16
 * rows and the G heads whose q rows start at qh; before each head, prefetches
 * 1/G of pf's rows. */
INLINE void scores16(const Rows *r, int64_t off, const float *qh, float scale, float *sc, int64_t stride,
                     const Rows *pf, int G, int DV, int kv)
{
#pragma GCC unroll 8
    for (int g = 0; g < G; g++) {
        prefetch(pf, off, g * 16 / G, (g + 1) * 16 / G, DV, kv);
        __m512 part[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) { /* slot i holds token T16[i], so lane t is token t */
            const int64_t k = off + r->at[T16[i]];
            const float *qg = qh + g * 16 * DV;
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), load16(r->base, k, kv));
#pragma GCC unroll 8
            for (int j = 1; j < DV; j++)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j), load16(r->base, k + 16 * j, kv), a);
            part[i] = a;
        }
        _mm512_storeu_ps(sc + g * stride, _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale)));
    }
}

/* out[g] += w[g * stride + t] * V row t of r (from offset off, DV vectors) for the m real
 * rows and G heads; prefetches pf's rows as it goes. */
INLINE void values16(const Rows *r, int64_t off, const float *w, int64_t stride, __m512 *out, const Rows *pf, int G,
                     int DV, int kv)
{
    __m512 acc[MAX_G * MAX_DV]; /* a local copy stays in registers across rows */
    for (int i = 0; i < G * DV; i++)
        acc[i] = out[i];
    for (int t = 0; t < r->m; t++) {
        prefetch(pf, off, t, t + 1, DV, kv);
#pragma GCC unroll 8
        for (int j = 0; j < DV; j++) {
            const __m512 v = load16(r->base, off + r->at[t] + 16 * j, kv);
#pragma GCC unroll 8
            for (int g = 0; g < G; g++)
                acc[g * DV + j] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * stride + t]), v, acc[g * DV + j]);
        }
    }
    prefetch(pf, off, r->m, 16, DV, kv);
    for (int i = 0; i < G * DV; i++)
        out[i] = acc[i];
}

/* The 16 rows of r, width elements each from its base, as float32 at w (row t at w + t * width). */
INLINE void widen16(const Rows *r, float *restrict w, int64_t width, int kv)
{
    for (int t = 0; t < 16; t++)
        for (int64_t j = 0; j < width; j += 16)
            _mm512_store_ps(w + t * width + j, load16(r->base, r->at[t] + j, kv));
}

/* x[0..n) = exp(x - max x), with weights under e^-80 set to 0 as in attend (NaN
 * stays NaN); returns 1 / their sum (with exp(sink - max) in it: -INFINITY for none).
 * x has room for n rounded up to 16. */
INLINE float softmax_row(float *x, int64_t n, float sink)
{
    __m512 mx = _mm512_set1_ps(sink), sum = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + 16 <= n; p += 16)
        mx = _mm512_max_ps(mx, _mm512_loadu_ps(x + p));
    const __mmask16 tail = (__mmask16)((1u << (n - p)) - 1);
    mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, x + p));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    for (p = 0; p < n; p += 16) {
        const __m512 y = _mm512_sub_ps(_mm512_loadu_ps(x + p), m);
        const __mmask16 real = n - p < 16 ? tail : 0xFFFF;
        const __mmask16 keep = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-80.0f), _CMP_NLT_UQ) & real;
        const __m512 e = _mm512_maskz_mov_ps(keep, exp16(y));
        _mm512_storeu_ps(x + p, e);
        sum = _mm512_add_ps(sum, e);
    }
    const float top = _mm512_reduce_max_ps(m);
    return 1.0f / (_mm512_reduce_add_ps(sum) + (sink > -INFINITY ? expf(sink - top) : 0.0f));
}

/* As attend, for D = 16 * DV and the nh kv heads from h0 of R rows reading the same pages (a
 * sequence, or a verification's rows of one: R up to MAX_ROWS, row i's context ns[i] tokens of
 * table's, its q at qb + i * ld, its output at ob + i * ld): the scores of all tokens (K pass),
 * softmax, the weighted sum (V pass), 16 tokens at a time, each chunk prefetching the next (K's last
 * chunk V's first) and read once for all R rows. Each row's arithmetic is the one it gets alone (its
 * lanes past its own context are computed but never used), so a verification's rows give the plain
 * step's bits. Two passes rather than an online softmax: its max, exp and rescaling per chunk were
 * a latency chain that cost more than the score buffer sc (R * nh * G rows of L->stride). acc: R *
 * nh * G * DV vectors of scratch. */
INLINE void attend16(const Layout *L, const int32_t *table, const int64_t *ns, int R, int64_t skip, int64_t h0,
                     int nh, int G, int DV, const float *restrict sinks, const float *restrict qb, int64_t ld,
                     float *restrict ob, float *restrict sc, __m512 *restrict accs, float *restrict wide, int kv)
{
    const int64_t D = 16 * DV, stride = L->stride, rows_per = (int64_t)nh * G * stride;
    const char *k = L->k_cache + h0 * D * KV_BYTES(kv), *v = L->v_cache + h0 * D * KV_BYTES(kv);
    int64_t n = 0;
    for (int i = 0; i < R; i++)
        n = ns[i] > n ? ns[i] : n;
    /* A 16-bit cache read by several rows: each chunk widened to float32 once, into L1 (the same
     * floats), rather than once per row and head. */
    const int widen = kv != KV_F32 && R > 1;
    Rows r, pf = {0}, w = {(const char *)wide, {0}, 0};
    const Rows none = {0};
    for (int t = 0; t < 16; t++)
        w.at[t] = t * nh * D;
    for (int64_t p0 = 0; p0 < n; p0 += 16) {
        chunk_rows(&pf, L, p0 + 16 < n ? k : v, table, p0 + 16 < n ? p0 + 16 : 0, n);
        chunk_rows(&r, L, k, table, p0, n);
        if (widen)
            widen16(&r, wide, nh * D, kv);
        for (int i = 0; i < R; i++) {
            if (ns[i] <= p0)
                continue;
            for (int h = 0; h < nh; h++) {
                float *si = sc + i * rows_per + h * G * stride + p0;
                if (widen) {
                    prefetch(&pf, h * D, i * 16 / R, (i + 1) * 16 / R, DV, kv);
                    scores16(&w, h * D, qb + i * ld + h * G * D, L->scale, si, stride, &none, G, DV, KV_F32);
                } else
                    scores16(&r, h * D, qb + i * ld + h * G * D, L->scale, si, stride, i ? &none : &pf, G, DV, kv);
            }
        }
    }
    float inv[MAX_ROWS * MAX_HEADS * MAX_G];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < nh * G; j++) {
            float *row = sc + i * rows_per + j * stride;
            soft_cap(row, ns[i], L->softcap);
            for (int64_t p = 0; p < skip; p++) /* tokens before a sliding window: weight 0 */
                row[p] = -INFINITY;
            inv[i * nh * G + j] = ns[i] ? softmax_row(row, ns[i], sinks ? sinks[h0 * G + j] : -INFINITY) : 0.0f;
        }
    /* Rows of over 8 vectors (Gemma's 256 dims) in parts whose G x part accumulators stay in registers:
     * part c0 .. c0 + width(c0) of head h of row i at accs + (i nh + h) G DV + G c0, [g][width] */
    const int part = DV <= 8 ? DV : 24 / G > 1 ? 24 / G : 1;
#define WIDTH(c0) (DV - (c0) < part ? DV - (c0) : part)
    for (int64_t i = 0; i < (int64_t)R * nh * G * DV; i++)
        accs[i] = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < n; p0 += 16) {
        chunk_rows(&pf, L, p0 + 16 < n ? v : NULL, table, p0 + 16 < n ? p0 + 16 : 0, n);
        chunk_rows(&r, L, v, table, p0, n);
        if (widen)
            widen16(&r, wide, nh * D, kv);
        for (int i = 0; i < R; i++) {
            if (ns[i] <= p0)
                continue;
            Rows *ri = widen ? &w : &r;
            const int m = r.m;
            ri->m = ns[i] - p0 < 16 ? (int)(ns[i] - p0) : 16; /* this row's real tokens in the chunk */
            for (int h = 0; h < nh; h++)
                for (int c0 = 0; c0 < DV; c0 += part) {
                    const float *wi = sc + i * rows_per + h * G * stride + p0;
                    __m512 *ai = accs + (i * nh + h) * G * DV + G * c0;
                    if (widen) {
                        prefetch(&pf, h * D + 16 * c0, i * 16 / R, (i + 1) * 16 / R, WIDTH(c0), kv);
                        values16(&w, h * D + 16 * c0, wi, stride, ai, &none, G, WIDTH(c0), KV_F32);
                    } else
                        values16(&r, h * D + 16 * c0, wi, stride, ai, i ? &none : &pf, G, WIDTH(c0), kv);
                }
            r.m = m;
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < nh * G; j++)
            for (int jj = 0; jj < DV; jj++) {
                const int c0 = jj / part * part;
                const __m512 sum = accs[(i * nh + j / G) * G * DV + G * c0 + j % G * WIDTH(c0) + jj - c0];
                _mm512_storeu_ps(ob + i * ld + j * D + 16 * jj, _mm512_mul_ps(sum, _mm512_set1_ps(inv[i * nh * G + j])));
            }
#undef WIDTH
}
#endif

/* Longest sequences first, so that the last tasks to be handed out are short. */
static int longer_first(const void *a, const void *b)
{
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Returns 0 on success; 1 if a size, a context length or a used page index is
 * out of range (nothing is computed then); 2 if a buffer could not be allocated.
 * A context length of 0 gives zeros, as the reference does. window > 0: each row
 * attends only its last `window` tokens (a sliding-window layer); its pages before
 * the window are not read. sinks [H] (or NULL): a logit per query head added to each
 * softmax's denominator, its value row zero (gpt-oss). kv: the caches' form (KV_F32, KV_F16, KV_BF16). */
int trillm_decode_attention(
    const float *restrict q, const void *restrict k_cache, const void *restrict v_cache,
    const int32_t *restrict block_tables, const int32_t *restrict context_lens, float *restrict out,
    int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t num_pages, int64_t page_size,
    int64_t max_pages, float scale, int num_threads, int64_t window, const float *restrict sinks, float softcap,
    int kv)
{
    if (B == 0)
        return 0;
    if (kv != KV_F32 && kv != KV_F16 && kv != KV_BF16)
        return 1;
    if (B < 0 || H <= 0 || KVH <= 0 || D <= 0 || H % KVH != 0 || page_size <= 0 || num_threads < 1 || window < 0 ||
        !(softcap >= 0.0f))
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
    const int64_t stride = (max_ctx + 15) / 16 * 16; /* attend16 writes 16 scores at a time */
    const Layout L = {k_cache, v_cache, page_size, KVH * D, page_size * KVH * D, stride, scale, softcap};
    /* one call per cache form below, each inlined with its element size as a constant */
#define ATTEND16(KV, nh_, G_, DV_) \
    attend16(&L, table, ns, (int)R, skip, h0, nh_, G_, DV_, sinks, qb, H * D, ob, scores, accs, wide, KV)
#define ATTEND(KV, D_) attend(&L, table, n, skip, h0, G, D_, sinks, qb, ob, scores, acc, KV)
#define BY_FORM(F, ...) kv == KV_F16 ? F(KV_F16, __VA_ARGS__) : kv == KV_BF16 ? F(KV_BF16, __VA_ARGS__) : F(KV_F32, __VA_ARGS__)
#ifdef AVX512_PATH
    const int avx = G <= MAX_G && D % 16 == 0 && D <= 16 * MAX_DV;
#else
    const int avx = 0;
#endif
    /* Groups of consecutive rows whose tables agree over the pages of the longest (a verification's
     * rows of one sequence; the AVX-512 version, without a window, whose rows step over different
     * pages): each chunk of their cache is read once (and widened once) for all of them. 9 rows of
     * one sequence over 30 layers of a float16 cache (SmolLM2's heads): 1,000 tokens 7.2 ms a row
     * apiece, 5.1 ms as a group; 300 tokens 2.5 -> 1.9 ms (the rest is each row's own arithmetic). */
    int64_t *group = malloc(sizeof(int64_t) * (size_t)(3 * B)), *rows = group + B, *order = rows + B;
    if (!group)
        return 2;
    int64_t groups = 0, widest = 1;
    for (int64_t b = 0; b < B; groups++) {
        int64_t e = b + 1, longest = context_lens[b];
        if (avx && !window)
            for (; e < B && e - b < MAX_ROWS; e++) {
                const int64_t n = context_lens[e] > longest ? context_lens[e] : longest;
                if (memcmp(block_tables + b * max_pages, block_tables + e * max_pages,
                           sizeof(int32_t) * (size_t)((n + page_size - 1) / page_size)))
                    break;
                longest = n;
            }
        group[groups] = b, rows[groups] = e - b, b = e;
    }
    /* A task is a whole group (its pages read whole) when there are at least as many as threads;
     * else one kv head of one, so that more tasks share out; and groups are halved while there are
     * fewer than two tasks a thread (one sequence's verification: 3 kv heads on 2 threads). */
    const int64_t nh = avx && KVH <= MAX_HEADS && groups >= num_threads ? KVH : 1, per_seq = KVH / nh;
    while (groups * per_seq < 2 * num_threads) {
        int64_t g = 0;
        for (int64_t i = 1; i < groups; i++)
            g = rows[i] > rows[g] ? i : g;
        if (rows[g] < 2)
            break;
        group[groups] = group[g] + rows[g] / 2, rows[groups] = rows[g] - rows[g] / 2, rows[g] /= 2, groups++;
    }
    for (int64_t g = 0; g < groups; g++) { /* (length of the longest row, group) */
        int64_t longest = 0;
        for (int64_t i = group[g]; i < group[g] + rows[g]; i++)
            longest = context_lens[i] > longest ? context_lens[i] : longest;
        order[g] = longest << 32 | g;
        widest = rows[g] > widest ? rows[g] : widest;
    }
    qsort(order, (size_t)groups, sizeof(int64_t), longer_first);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* Per thread: attend16's accumulators (widest * nh * G * D floats, aligned) and widest * nh * G
         * score rows; for attend G accumulators of D and G sums. */
        const size_t vectors = (size_t)(avx ? widest * nh * G * D / 16 + nh * D : 0); /* + 16 widened rows */
        float *buffer = NULL;
        if (posix_memalign((void **)&buffer, 64, sizeof(float) * (16 * vectors + widest * nh * G * stride + G * D + G)))
            buffer = NULL;
        float *scores = buffer + 16 * vectors, *acc = scores + widest * nh * G * stride;
#ifdef AVX512_PATH
        __m512 *accs = (__m512 *)buffer;
        float *wide = buffer + 16 * (vectors - nh * D);
#endif
        if (!buffer) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < groups * per_seq; task++) {
            const int64_t g = order[task / per_seq] & 0xFFFFFFFF, h0 = task % per_seq * nh;
            const int64_t b = group[g], R = rows[g];
            /* A window starts mid-page: whole pages before it are stepped over, the rest masked
             * (a row of its own: groups have no window). */
            const int64_t len = context_lens[b], first = window && len > window ? len - window : 0;
            const int64_t pages_before = first / page_size, n = len - pages_before * page_size;
            const int64_t skip = first - pages_before * page_size;
            const int32_t *table = block_tables + b * max_pages + pages_before;
            const float *qb = q + (b * H + h0 * G) * D;
            float *ob = out + (b * H + h0 * G) * D;
            int64_t ns[MAX_ROWS] = {n};
            for (int64_t i = 1; i < R; i++)
                ns[i] = context_lens[b + i];
            if (!buffer)
                continue;
            if (n == 0 && R == 1)
                memset(ob, 0, sizeof(float) * (size_t)(nh * G * D));
#ifdef AVX512_PATH
            else if (avx && G == 3 && D == 64 && nh == 3) /* SmolLM2, inlined with constants */
                BY_FORM(ATTEND16, 3, 3, 4);
            else if (avx && G == 3 && D == 64 && nh == 1)
                BY_FORM(ATTEND16, 1, 3, 4);
            else if (avx)
                BY_FORM(ATTEND16, (int)nh, (int)G, (int)(D / 16));
#endif
            else if (D == 64)
                BY_FORM(ATTEND, 64);
            else if (D == 128)
                BY_FORM(ATTEND, 128);
            else
                BY_FORM(ATTEND, D);
        }
        free(buffer);
    }
    free(group);
    return failed ? 2 : 0;
}

/* dst[0..n) = src[0..n) as a cache of form kv holds it (the fused loop's stores, cpu_common.h's
 * store_kv; exported for tests). 0, or 1 for a form it does not know. */
int trillm_kv_store(const float *restrict src, void *restrict dst, int64_t n, int kv)
{
    if (kv == KV_F16)
        store_kv(dst, src, n, KV_F16);
    else if (kv == KV_BF16)
        store_kv(dst, src, n, KV_BF16);
    else if (kv == KV_F32)
        store_kv(dst, src, n, KV_F32);
    else
        return 1;
    return 0;
}
