/* GGUF weights in the blocks the file holds them in: decoders and a matmul.
 *
 * Longer than our ~400-line guide on purpose: one unpacker per type and the three paths
 * that share them (decode to float32, integer dot products, panels); split, a type's
 * layout and the paths that read it would be in two places.
 *
 * A weight is the file's bytes, [N rows x row_bytes], each row K values in blocks of
 * 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or 256 (Q2_K .. Q6_K), or F16 / BF16 values.
 * Each block decoder computes what gguf-py's reference dequantizer computes, rounding
 * for rounding (the build has no fused multiply-add contraction, as numpy has none):
 * the tests compare them value by value. Layouts, from ggml's block definitions:
 *
 *   Q4_0  d:f16 qs[16]              w = d * (nibble - 8)
 *   Q4_1  d:f16 m:f16 qs[16]        w = d * nibble + m
 *   Q5_0  d:f16 qh[4] qs[16]        w = d * ((nibble | bit << 4) - 16)
 *   Q5_1  d:f16 m:f16 qh[4] qs[16]  w = d * (nibble | bit << 4) + m
 *   Q8_0  d:f16 qs[32] int8         w = d * q
 *   (value j < 16 is byte j's low nibble, j >= 16 byte j - 16's high one; its fifth bit is qh's bit j)
 *   Q2_K  scales[16] qs[64] d dmin          16 sub-blocks of 16: (d * sc) * q2 - dmin * min
 *   Q3_K  hmask[32] qs[64] scales[12] d     16 of 16: (d * (sc6 - 32)) * (q2 - (high bit ? 0 : 4))
 *   Q4_K  d dmin scales[12] qs[128]         8 of 32: (d * sc6) * q4 - dmin * min6
 *   Q5_K  d dmin scales[12] qh[32] qs[128]  8 of 32: (d * sc6) * (q4 | bit << 4) - dmin * min6
 *   Q6_K  ql[128] qh[64] scales[16] d       16 of 16: (d * sc8) * ((q4 | q2 << 4) - 32)
 *
 * Decode-sized batches (up to 8 rows of x) quantize x to int16 per 32 values (llama.cpp uses
 * int8) and take integer dot products per sub-block, the scales applied once per sub-block; Q4_K,
 * Q5_K and Q6_K have kernels of their own that read their blocks directly (on SIMD builds), the
 * other types are unpacked to int8 once for every row of x. With EXACT, or for F16 / BF16,
 * weight rows are decoded to float32 into a per-thread buffer and dotted with x instead. Larger
 * batches decode a panel of rows here and multiply it with torch's GEMM (cpu_gguf.py).
 *
 * What differs by instruction set (AVX2 / AVX-VNNI / AVX-512 VNNI, plain C) is in one section.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu_common.h" /* INLINE, MIN, tree_sum */

/* ggml's type ids (GGMLQuantizationType) */
enum { F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
       Q6_K = 14, BF16 = 30 };
enum { ACCUMULATE = 1, EXACT = 2 }; /* flags of trillm_gguf_matmul; EXACT: float activations */

#define ROWS 8 /* weight rows decoded at once by the matmul */
#define MAX_INT_ROWS 32 /* rows of x up to which activations go to int16 */
#define PARALLEL_MIN_WORK (1 << 18)
#define GROUP 8 /* legacy blocks unpacked together: 256 values, as one k-quant block */

/* A block's values are w = dl[s] * q - ml[s] for sub-block s (ml 0 where the type has no
 * minimum: x - 0 is x, so the rounding is the reference's; ``mins`` says whether any is kept).
 * Every type's quants fit int8. */
typedef struct {
    int subs, n, mins; /* sub-blocks, values in each (subs * n values); 1 if the type has minimums */
    float dl[16], ml[16];
    int8_t q[256];
} Unpacked;

/* ==== What differs by instruction set: all of it is in this section ====
 *
 * AVX2 (+ FMA, F16C) and plain C. The helpers below unpack runs of 16 or 32 quants from a
 * block's bit fields (each the same bytes on both paths, which the tests check value by value
 * against gguf's decoders), and block_dot takes one unpacked block's dot product with one row of
 * int16 activations. AVX-512 CPUs run the AVX2 code (with VNNI, its multiply-add in one
 * instruction). */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GGUF_SIMD 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SIMD_ID 3 /* cpu_gguf.py's names: plain, avx2, avxvnni, avx512vnni */
#define MADD_ADD(acc, a, b) _mm256_dpwssd_epi32((acc), (a), (b))
#elif defined(__AVXVNNI__)
#define SIMD_ID 2
#define MADD_ADD(acc, a, b) _mm256_dpwssd_avx_epi32((acc), (a), (b))
#else
#define SIMD_ID 1
#define MADD_ADD(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#endif
#else
#define GGUF_SIMD 0
#define SIMD_ID 0
#endif

/* The path this build runs (for the start-up log). */
int trillm_gguf_simd(void)
{
    return SIMD_ID;
}

INLINE float f16(const uint8_t *p)
{
    const uint16_t h = (uint16_t)(p[0] | p[1] << 8);
#if defined(__F16C__) /* the hardware conversion is exact, as the one below is */
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | man << 13; /* infinity, NaN */
    } else if (exp) {
        bits = sign | (exp + 112) << 23 | man << 13;
    } else if (man) { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | exp << 23 | (man & 0x3ff) << 13;
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

INLINE uint32_t u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The 6-bit scale and minimum of sub-block j (0..7) of Q4_K and Q5_K. */
INLINE void scale_min_k4(const uint8_t *s, int j, int *sc, int *mn)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        *mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

#if GGUF_SIMD
INLINE __m256i load32(const void *p)
{
    return _mm256_loadu_si256((const __m256i *)p);
}

INLINE void store32(void *p, __m256i v)
{
    _mm256_storeu_si256((__m256i *)p, v);
}

INLINE __m256i shift_right(__m256i v, int bits) /* per byte, the bits that leave masked off by the caller */
{
    return _mm256_srl_epi16(v, _mm_cvtsi32_si128(bits));
}
#endif

/* q[j] = (qs[j] & 15) - offset, q[j + 16] = (qs[j] >> 4) - offset, j < 16 (a legacy block) */
INLINE void nibbles16(const uint8_t *restrict qs, int offset, int8_t *restrict q)
{
#if GGUF_SIMD
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(15), o = _mm_set1_epi8((char)offset);
    _mm_storeu_si128((__m128i *)q, _mm_sub_epi8(_mm_and_si128(v, m), o));
    _mm_storeu_si128((__m128i *)(q + 16), _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), m), o));
#else
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)((qs[j] & 15) - offset);
        q[j + 16] = (int8_t)((qs[j] >> 4) - offset);
    }
#endif
}

/* lo[l] = qs[l] & 15, hi[l] = qs[l] >> 4, l < 32 */
INLINE void nibbles32(const uint8_t *restrict qs, int8_t *restrict lo, int8_t *restrict hi)
{
#if GGUF_SIMD
    const __m256i v = load32(qs), m = _mm256_set1_epi8(15);
    store32(lo, _mm256_and_si256(v, m));
    store32(hi, _mm256_and_si256(_mm256_srli_epi16(v, 4), m));
#else
    for (int l = 0; l < 32; l++) {
        lo[l] = (int8_t)(qs[l] & 15);
        hi[l] = (int8_t)(qs[l] >> 4);
    }
#endif
}

/* q[l] = ((src[l] >> shift) & 3) - offset, l < 32 */
INLINE void crumbs32(const uint8_t *restrict src, int shift, int offset, int8_t *restrict q)
{
#if GGUF_SIMD
    const __m256i v = _mm256_and_si256(shift_right(load32(src), shift), _mm256_set1_epi8(3));
    store32(q, _mm256_sub_epi8(v, _mm256_set1_epi8((char)offset)));
#else
    for (int l = 0; l < 32; l++)
        q[l] = (int8_t)(((src[l] >> shift) & 3) - offset);
#endif
}

/* q[l] += value where bit ``bit`` of bytes[l] is set, l < 32 */
INLINE void add_where_bit(const uint8_t *restrict bytes, int bit, int value, int8_t *restrict q)
{
#if GGUF_SIMD
    const __m256i b = _mm256_set1_epi8((char)(1 << bit));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(load32(bytes), b), b);
    store32(q, _mm256_add_epi8(load32(q), _mm256_and_si256(set, _mm256_set1_epi8((char)value))));
#else
    for (int l = 0; l < 32; l++)
        q[l] = (int8_t)(q[l] + ((bytes[l] >> bit) & 1) * value);
#endif
}

/* q[j] += 16 where bit j of the 32-bit qh is set, j < 32 (Q5_0 / Q5_1's fifth bits) */
INLINE void add_fifth_bits(uint32_t qh, int8_t *restrict q)
{
#if GGUF_SIMD /* byte j takes byte j / 8 of qh, then its own bit j % 8 */
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)qh), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                                     2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    store32(q, _mm256_add_epi8(load32(q), _mm256_and_si256(set, _mm256_set1_epi8(16))));
#else
    for (int j = 0; j < 32; j++)
        q[j] = (int8_t)(q[j] + ((qh >> j) & 1) * 16);
#endif
}

/* q[l] = ((lo[l] >> lo_shift) & 15 | ((hi[l] >> hi_shift) & 3) << 4) - 32, l < 32 (Q6_K) */
INLINE void six_bit32(const uint8_t *restrict lo, int lo_shift, const uint8_t *restrict hi, int hi_shift,
                      int8_t *restrict q)
{
#if GGUF_SIMD
    const __m256i l4 = _mm256_and_si256(shift_right(load32(lo), lo_shift), _mm256_set1_epi8(15));
    const __m256i h2 = _mm256_and_si256(shift_right(load32(hi), hi_shift), _mm256_set1_epi8(3));
    const __m256i v = _mm256_or_si256(l4, _mm256_slli_epi16(h2, 4)); /* h2 < 4: nothing crosses a byte */
    store32(q, _mm256_sub_epi8(v, _mm256_set1_epi8(32)));
#else
    for (int l = 0; l < 32; l++)
        q[l] = (int8_t)((((lo[l] >> lo_shift) & 15) | ((hi[l] >> hi_shift) & 3) << 4) - 32);
#endif
}

/* The int16 activations of the rows of x (quantize_x): xq [M, K], and per row its scales per 32
 * values (dx) and sums per 16 and per 32 values (s16, s32), which the minimums multiply. */
typedef struct {
    const int16_t *xq;
    const float *dx, *s16, *s32;
    int64_t M, K;
} XRows;

/* One row of x against one unpacked block adds sum_s dl[s] dx[s] (q_s . xq_s) - ml[s] sum(x_s) to
 * its Acc; acc_total gives the row's sum. Each integer sum is exact (|q| <= 128, |xq| <= 32767, at
 * most 32 products); the float sums run in a fixed order, so a result does not depend on the
 * thread count. */
#if GGUF_SIMD
/* x's 32 values per run as the kernels read them: the even ones, then the odd ones. Pairs of
 * bytes loaded as int16 lanes then give their even and odd weights with one shift each, in the
 * lanes those activations are in; lanes 0-3 of a pair's products are values 0-15 of the run. */
INLINE int x_position(int l)
{
    return (l & 1) ? 16 + l / 2 : l / 2;
}

typedef struct {
    __m256 a0, a1, m; /* two chains of products (even and odd sub-blocks), and the minimums */
} Acc;

INLINE void acc_zero(Acc *a)
{
    a->a0 = a->a1 = a->m = _mm256_setzero_ps();
}

INLINE float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

INLINE float acc_total(const Acc *a)
{
    return hsum(_mm256_add_ps(a->a0, a->a1)) - hsum(a->m);
}

/* int16 lanes of 32 bytes of int8 quants: the even bytes and the odd ones, sign-extended */
INLINE __m256i even_bytes(__m256i v)
{
    return _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);
}

/* The integer dot of a run of 32 (weights: even, odd lanes) with its activations: lanes 0-3 hold
 * values 0-15's part, lanes 4-7 values 16-31's. */
INLINE __m256 run_dot(__m256i even, __m256i odd, const int16_t *x)
{
    const __m256i p = _mm256_madd_epi16(even, load32(x));
    return _mm256_cvtepi32_ps(MADD_ADD(p, odd, load32(x + 16)));
}

/* A scale per 16 values of a run: lanes 0-3 lo, 4-7 hi */
INLINE __m256 halves(float lo, float hi)
{
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(lo)), _mm_set1_ps(hi), 1);
}

INLINE void block_dot(const Unpacked *U, const XRows *X, int64_t i, int64_t k0, Acc *acc)
{
    const int16_t *xb = X->xq + i * X->K + k0;
    const float *dx = X->dx + i * (X->K / 32) + k0 / 32;
    const int runs = U->subs * U->n / 32;
    __m256 a0 = acc->a0, a1 = acc->a1; /* in registers (see k4_direct) */
    for (int r = 0; r < runs; r++) {
        const __m256i v = load32(U->q + 32 * r);
        const __m256 p = run_dot(even_bytes(v), _mm256_srai_epi16(v, 8), xb + 32 * r);
        const __m256 sc = U->n == 32 ? _mm256_set1_ps(U->dl[r] * dx[r])
                                     : halves(U->dl[2 * r] * dx[r], U->dl[2 * r + 1] * dx[r]);
        if (r & 1)
            a1 = _mm256_fmadd_ps(p, sc, a1);
        else
            a0 = _mm256_fmadd_ps(p, sc, a0);
    }
    acc->a0 = a0;
    acc->a1 = a1;
    if (!U->mins)
        return;
    const float *s16 = X->s16 + i * (X->K / 16) + k0 / 16, *s32 = X->s32 + i * (X->K / 32) + k0 / 32;
    if (U->n == 32 && U->subs == 8) {
        acc->m = _mm256_fmadd_ps(_mm256_loadu_ps(U->ml), _mm256_loadu_ps(s32), acc->m);
    } else if (U->n == 16) {
        acc->m = _mm256_fmadd_ps(_mm256_loadu_ps(U->ml), _mm256_loadu_ps(s16), acc->m);
        acc->m = _mm256_fmadd_ps(_mm256_loadu_ps(U->ml + 8), _mm256_loadu_ps(s16 + 8), acc->m);
    } else {
        float part[8] = {0};
        for (int s = 0; s < U->subs; s++)
            part[s] = U->ml[s] * s32[s];
        acc->m = _mm256_add_ps(acc->m, _mm256_loadu_ps(part));
    }
}

/* ---- kernels that read a type's blocks directly (no Unpacked), for every row of x at once ---- */

/* The k-quant kernels run a tile of up to TILE rows of x along a whole weight row, their sums
 * in registers from the first block to the last: each group of weights is unpacked once for
 * the tile, and nothing is spilled (16 AVX2 registers: the tile's 8 sums, 4 of weights, 4 spare). */
#define TILE 4

/* Q4_K and Q5_K (qh NULL for Q4_K): byte l of a group of 32 holds values l (low nibble) and 32 + l
 * (high); as int16 lanes, the even values are the low nibble of each lane's low byte. */
INLINE void k4_block(const uint8_t *b, const uint8_t *qs, const uint8_t *qh, const XRows *X, int64_t i0, const int T,
                     int64_t k0, __m256 (*a)[2], __m256 *m)
{
    /* the 8 scales and 8 minimums of 6 bits (scale_min_k4), unpacked four at a time in 32-bit words */
    const uint32_t s0 = u32(b + 4), s1 = u32(b + 8), s2 = u32(b + 12);
    const uint32_t sc_lo = s0 & 0x3f3f3f3f, mn_lo = s1 & 0x3f3f3f3f;
    const uint32_t sc_hi = (s2 & 0x0f0f0f0f) | ((s0 >> 6) & 0x03030303) << 4;
    const uint32_t mn_hi = ((s2 >> 4) & 0x0f0f0f0f) | ((s1 >> 6) & 0x03030303) << 4;
    const __m256 dl = _mm256_mul_ps(_mm256_set1_ps(f16(b)),
                                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)sc_hi, (int)sc_lo))));
    const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(f16(b + 2)),
                                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)mn_hi, (int)mn_lo))));
    float sc[TILE][8];
    for (int t = 0; t < T; t++) {
        const int64_t run = (i0 + t) * (X->K / 32) + k0 / 32;
        m[t] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(X->s32 + run), m[t]);
        _mm256_storeu_ps(sc[t], _mm256_mul_ps(dl, _mm256_loadu_ps(X->dx + run)));
    }
    const __m256i low4 = _mm256_set1_epi16(15), bit = _mm256_set1_epi16(1);
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) { /* 64 values: even and odd of its first 32, even and odd of the next */
        const __m256i v = load32(qs + 32 * g);
        __m256i w0 = _mm256_and_si256(v, low4), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 8), low4);
        __m256i w2 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), w3 = _mm256_srli_epi16(v, 12);
        if (qh) { /* the fifth bit of value 32 s + l is bit s of qh[l] */
            const __m256i h = load32(qh);
            const int s = 2 * g;
            w0 = _mm256_or_si256(w0, _mm256_slli_epi16(_mm256_and_si256(shift_right(h, s), bit), 4));
            w1 = _mm256_or_si256(w1, _mm256_slli_epi16(_mm256_and_si256(shift_right(h, 8 + s), bit), 4));
            w2 = _mm256_or_si256(w2, _mm256_slli_epi16(_mm256_and_si256(shift_right(h, s + 1), bit), 4));
            w3 = _mm256_or_si256(w3, _mm256_slli_epi16(_mm256_and_si256(shift_right(h, 9 + s), bit), 4));
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const int16_t *x = X->xq + (i0 + t) * X->K + k0 + 64 * g;
            a[t][0] = _mm256_fmadd_ps(run_dot(w0, w1, x), _mm256_broadcast_ss(sc[t] + 2 * g), a[t][0]);
            a[t][1] = _mm256_fmadd_ps(run_dot(w2, w3, x + 32), _mm256_broadcast_ss(sc[t] + 2 * g + 1), a[t][1]);
        }
    }
}

/* Q6_K: value 128 h + 32 j + l is nibble j / 2 of ql[64 h + 32 (j % 2) + l] with bits 2 j of
 * qh[32 h + l] above it, less 32; 16 sub-blocks of 16 with int8 scales. The 32 is taken off as
 * a minimum (32 d sc times the sum of x), so the quants stay unsigned bytes until they are split
 * into int16 lanes. */
INLINE void q6_k_block(const uint8_t *b, const XRows *X, int64_t i0, const int T, int64_t k0, __m256 (*a)[2], __m256 *m)
{
    const uint8_t *ql = b, *qh = b + 128;
    const float d = f16(b + 208);
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(b + 192));
    const __m256 ds_lo = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
    const __m256 ds_hi = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))));
    const __m256 thirty_two = _mm256_set1_ps(32.0f);
    for (int t = 0; t < T; t++) {
        const float *s16 = X->s16 + (i0 + t) * (X->K / 16) + k0 / 16;
        m[t] = _mm256_fmadd_ps(_mm256_mul_ps(thirty_two, ds_lo), _mm256_loadu_ps(s16), m[t]);
        m[t] = _mm256_fmadd_ps(_mm256_mul_ps(thirty_two, ds_hi), _mm256_loadu_ps(s16 + 8), m[t]);
    }
    const __m256i low4 = _mm256_set1_epi8(15), bits45 = _mm256_set1_epi8(0x30), low8 = _mm256_set1_epi16(0xff);
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) { /* runs of 32: value 32 r + l */
        const int h = r / 4, j = r % 4, hs = 2 * j;
        const __m256i hv = load32(qh + 32 * h), lo = load32(ql + 64 * h + 32 * (j % 2));
        const __m256i l4 = _mm256_and_si256(j / 2 ? _mm256_srli_epi16(lo, 4) : lo, low4);
        /* bits hs, hs + 1 of each byte to bits 4, 5 */
        const __m256i he = hs <= 4 ? _mm256_sll_epi16(hv, _mm_cvtsi32_si128(4 - hs)) : shift_right(hv, hs - 4);
        const __m256i u = _mm256_or_si256(l4, _mm256_and_si256(he, bits45));
        const __m256i even = _mm256_and_si256(u, low8), odd = _mm256_srli_epi16(u, 8);
        const int s = 2 * r % 8; /* lanes 0-3: its first sub-block's d sc, 4-7 its second's */
        const __m256 scale =
            _mm256_permutevar8x32_ps(r < 4 ? ds_lo : ds_hi, _mm256_setr_epi32(s, s, s, s, s + 1, s + 1, s + 1, s + 1));
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const int16_t *x = X->xq + (i0 + t) * X->K + k0 + 32 * r;
            const float *dx = X->dx + (i0 + t) * (X->K / 32) + k0 / 32 + r;
            a[t][r & 1] = _mm256_fmadd_ps(run_dot(even, odd, x), _mm256_mul_ps(scale, _mm256_broadcast_ss(dx)), a[t][r & 1]);
        }
    }
}

/* A weight row (``blocks`` k-quant blocks of ``bytes``) against rows i0 .. i0 + T of x. */
INLINE void k_rows(int type, const uint8_t *row, int64_t blocks, int bytes, const XRows *X, int64_t i0, const int T,
                   Acc *acc)
{
    __m256 a[TILE][2], m[TILE];
    for (int t = 0; t < T; t++)
        a[t][0] = a[t][1] = m[t] = _mm256_setzero_ps();
    for (int64_t j = 0; j < blocks; j++) {
        const uint8_t *b = row + j * bytes;
        if (type == Q6_K)
            q6_k_block(b, X, i0, T, 256 * j, a, m);
        else if (type == Q5_K)
            k4_block(b, b + 48, b + 16, X, i0, T, 256 * j, a, m);
        else
            k4_block(b, b + 16, NULL, X, i0, T, 256 * j, a, m);
    }
    for (int t = 0; t < T; t++) {
        acc[i0 + t].a0 = a[t][0];
        acc[i0 + t].a1 = a[t][1];
        acc[i0 + t].m = m[t];
    }
}

/* Every row of x, TILE at a time (each tile size its own code, so that the sums stay in registers). */
INLINE void k_row(int type, const uint8_t *row, int64_t blocks, int bytes, const XRows *X, Acc *acc)
{
    int64_t i = 0;
    for (; i + TILE <= X->M; i += TILE)
        k_rows(type, row, blocks, bytes, X, i, TILE, acc);
    switch (X->M - i) {
    case 3: k_rows(type, row, blocks, bytes, X, i, 3, acc); break;
    case 2: k_rows(type, row, blocks, bytes, X, i, 2, acc); break;
    case 1: k_rows(type, row, blocks, bytes, X, i, 1, acc); break;
    default: break;
    }
}

static void q4_k_row(const uint8_t *row, int64_t blocks, const XRows *X, Acc *acc)
{
    k_row(Q4_K, row, blocks, 144, X, acc);
}

static void q5_k_row(const uint8_t *row, int64_t blocks, const XRows *X, Acc *acc)
{
    k_row(Q5_K, row, blocks, 176, X, acc);
}

static void q6_k_row(const uint8_t *row, int64_t blocks, const XRows *X, Acc *acc)
{
    k_row(Q6_K, row, blocks, 210, X, acc);
}

/* Q5_0 and Q5_1, up to 8 blocks of 32 (a run each) at once, so that every row of x sums them in
 * registers: value j < 16 is byte j's low nibble, j >= 16 byte j - 16's high one, its fifth bit
 * bit j of qh; Q5_0 takes 16 off (as a minimum, 16 d sum(x)), Q5_1 adds m (a minimum of -m). */
INLINE void q5_legacy_direct(const uint8_t *b, int64_t count, int has_m, const XRows *X, int64_t k0, Acc *acc)
{
    const int bytes = has_m ? 24 : 22;
    const __m128i m4 = _mm_set1_epi8(15);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL), sixteen = _mm256_set1_epi8(16);
    const __m256i spread_bytes = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                                  3, 3, 3, 3, 3, 3, 3, 3);
    __m256i even[GROUP], odd[GROUP];
    float d[GROUP], mn[GROUP];
    for (int64_t j = 0; j < count; j++) {
        const uint8_t *blk = b + j * bytes, *qh = blk + (has_m ? 4 : 2);
        d[j] = f16(blk);
        mn[j] = has_m ? -f16(blk + 2) : 16.0f * d[j];
        const __m128i v = _mm_loadu_si128((const __m128i *)(qh + 4));
        const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)u32(qh)), spread_bytes);
        const __m256i u = _mm256_or_si256(nib, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), sixteen));
        even[j] = _mm256_and_si256(u, _mm256_set1_epi16(0xff));
        odd[j] = _mm256_srli_epi16(u, 8);
    }
    for (int64_t i = 0; i < X->M; i++) {
        const int64_t run = i * (X->K / 32) + k0 / 32;
        const int16_t *x = X->xq + i * X->K + k0;
        __m256 a0 = acc[i].a0, a1 = acc[i].a1; /* in registers (see k4_direct) */
        float mins = 0.0f;
        for (int64_t j = 0; j < count; j++) {
            const __m256 p = run_dot(even[j], odd[j], x + 32 * j);
            if (j & 1)
                a1 = _mm256_fmadd_ps(p, _mm256_set1_ps(d[j] * X->dx[run + j]), a1);
            else
                a0 = _mm256_fmadd_ps(p, _mm256_set1_ps(d[j] * X->dx[run + j]), a0);
            mins += mn[j] * X->s32[run + j];
        }
        acc[i].a0 = a0;
        acc[i].a1 = a1;
        acc[i].m = _mm256_add_ps(acc[i].m, _mm256_castps128_ps256(_mm_set_ss(mins)));
    }
}

static void q5_0_row(const uint8_t *row, int64_t blocks, const XRows *X, Acc *acc)
{
    for (int64_t j = 0; j < blocks; j += GROUP)
        q5_legacy_direct(row + j * 22, MIN(GROUP, blocks - j), 0, X, 32 * j, acc);
}

static void q5_1_row(const uint8_t *row, int64_t blocks, const XRows *X, Acc *acc)
{
    for (int64_t j = 0; j < blocks; j += GROUP)
        q5_legacy_direct(row + j * 24, MIN(GROUP, blocks - j), 1, X, 32 * j, acc);
}

/* A row of a type's blocks against every row of x (the block loop inside: one call per row). */
typedef void (*DirectKernel)(const uint8_t *row, int64_t blocks, const XRows *X, Acc *acc);




/* The types with a kernel of their own here (the others unpack, then block_dot). */
static DirectKernel direct_kernel(int type)
{
    switch (type) {
    case Q4_K: return q4_k_row;
    case Q5_K: return q5_k_row;
    case Q6_K: return q6_k_row;
    case Q5_0: return q5_0_row;
    case Q5_1: return q5_1_row;
    default: return NULL;
    }
}
#else
INLINE int x_position(int l)
{
    return l;
}

typedef struct {
    float s;
} Acc;

INLINE void acc_zero(Acc *a)
{
    a->s = 0.0f;
}

INLINE float acc_total(const Acc *a)
{
    return a->s;
}

INLINE void block_dot(const Unpacked *U, const XRows *X, int64_t i, int64_t k0, Acc *acc)
{
    const int16_t *xb = X->xq + i * X->K + k0;
    const float *dx = X->dx + i * (X->K / 32) + k0 / 32;
    const float *s16 = X->s16 + i * (X->K / 16) + k0 / 16, *s32 = X->s32 + i * (X->K / 32) + k0 / 32;
    /* 16 lanes of float partial sums, each product exact in float (|q xq| < 2^23), one tree per block */
    float part[16] = {0}, mins = 0.0f;
    if (U->n == 16) {
        for (int s = 0; s < U->subs; s++) {
            const float sc = U->dl[s] * dx[s / 2];
            for (int l = 0; l < 16; l++)
                part[l] += sc * (float)((int32_t)U->q[16 * s + l] * xb[16 * s + l]);
            mins += U->ml[s] * s16[s];
        }
    } else { /* sub-blocks of 32: an integer sum each is cheaper (measured) */
        for (int s = 0; s < U->subs; s++) {
            int32_t sum = 0;
            for (int l = 0; l < 32; l++)
                sum += (int32_t)U->q[32 * s + l] * xb[32 * s + l];
            part[s] = U->dl[s] * dx[s] * (float)sum; /* subs <= 8 < 16 lanes */
            mins += U->ml[s] * s32[s];
        }
    }
    acc->s += tree_sum(part, 16) - mins;
}

typedef void (*DirectKernel)(const uint8_t *row, int64_t blocks, const XRows *X, Acc *acc);

static DirectKernel direct_kernel(int type)
{
    return NULL;
}
#endif

/* ==== end of the section that differs by instruction set ==== */

INLINE float bf16(const uint8_t *p)
{
    const uint32_t bits = (uint32_t)(p[0] | p[1] << 8) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- one block each, unpacked: quants as int8 and per sub-block w = dl * q - ml ---- */


INLINE void one_scale(Unpacked *U, int s, float d, float m) /* legacy types: block s of a group */
{
    U->dl[s] = d;
    U->ml[s] = m;
}

static void q4_0(const uint8_t *b, Unpacked *U, int s)
{
    one_scale(U, s, f16(b), 0.0f);
    nibbles16(b + 2, 8, U->q + 32 * s);
}

static void q4_1(const uint8_t *b, Unpacked *U, int s)
{
    one_scale(U, s, f16(b), -f16(b + 2)); /* d q + m as d q - (-m): the same float */
    nibbles16(b + 4, 0, U->q + 32 * s);
}

/* Q5_0 / Q5_1: value j's fifth bit is bit j of qh. */
static void q5_0(const uint8_t *b, Unpacked *U, int s)
{
    one_scale(U, s, f16(b), 0.0f);
    nibbles16(b + 6, 16, U->q + 32 * s);
    add_fifth_bits(u32(b + 2), U->q + 32 * s);
}

static void q5_1(const uint8_t *b, Unpacked *U, int s)
{
    one_scale(U, s, f16(b), -f16(b + 2));
    nibbles16(b + 8, 0, U->q + 32 * s);
    add_fifth_bits(u32(b + 4), U->q + 32 * s);
}

static void q8_0(const uint8_t *b, Unpacked *U, int s)
{
    one_scale(U, s, f16(b), 0.0f);
    memcpy(U->q + 32 * s, b + 2, 32);
}

/* The k-quants (``slot``: legacy blocks only). */

/* Q2_K and Q3_K's 2-bit quants: value 128 g + 32 j + l is byte 32 g + l of qs, bits 2 j. */
INLINE void two_bit(const uint8_t *restrict qs, int offset, int8_t *restrict q)
{
    for (int g = 0; g < 2; g++)
        for (int j = 0; j < 4; j++)
            crumbs32(qs + 32 * g, 2 * j, offset, q + 128 * g + 32 * j);
}

static void q2_k(const uint8_t *b, Unpacked *U, int slot)
{
    const uint8_t *scales = b;
    const float d = f16(b + 80), dmin = f16(b + 82);
    U->subs = 16;
    U->n = 16;
    two_bit(b + 16, 0, U->q);
    for (int s = 0; s < 16; s++) {
        U->dl[s] = d * (float)(scales[s] & 15);
        U->ml[s] = dmin * (float)(scales[s] >> 4);
    }
}

static void q3_k(const uint8_t *b, Unpacked *U, int slot)
{
    const uint8_t *hmask = b, *sc = b + 96;
    const float d = f16(b + 108);
    U->subs = 16;
    U->n = 16;
    two_bit(b + 32, 4, U->q); /* 4 off, given back where the high bit is set */
    for (int v0 = 0; v0 < 256; v0 += 32) /* the high bit of value v is bit v / 32 of hmask[v % 32] */
        add_where_bit(hmask, v0 / 32, 4, U->q + v0);
    for (int s = 0; s < 16; s++) {
        const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4;
        const int high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        U->dl[s] = d * (float)((low | high << 4) - 32);
        U->ml[s] = 0.0f;
    }
}

/* Q4_K and Q5_K's scales and minimums, and their low nibbles: value 64 g + l is byte 32 g + l's
 * low nibble, 64 g + 32 + l its high one. */
INLINE void k4_common(const uint8_t *b, const uint8_t *qs, Unpacked *U)
{
    const float d = f16(b), dmin = f16(b + 2);
    U->subs = 8;
    U->n = 32;
    for (int s = 0; s < 8; s++) {
        int sc, mn;
        scale_min_k4(b + 4, s, &sc, &mn);
        U->dl[s] = d * (float)sc;
        U->ml[s] = dmin * (float)mn;
    }
    for (int g = 0; g < 4; g++)
        nibbles32(qs + 32 * g, U->q + 64 * g, U->q + 64 * g + 32);
}

static void q4_k(const uint8_t *b, Unpacked *U, int slot)
{
    k4_common(b, b + 16, U);
}

static void q5_k(const uint8_t *b, Unpacked *U, int slot)
{
    k4_common(b, b + 48, U);
    for (int s = 0; s < 8; s++) /* the fifth bit of value 32 s + l is bit s of qh[l] */
        add_where_bit(b + 16, s, 16, U->q + 32 * s);
}

static void q6_k(const uint8_t *b, Unpacked *U, int slot)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
    U->subs = 16;
    U->n = 16;
    for (int h = 0; h < 2; h++) { /* value 128 h + 32 j + l: nibble j / 2 of ql[64 h + 32 (j % 2) + l], bits 2 j of qh[32 h + l] */
        const uint8_t *lo = ql + 64 * h, *hi = qh + 32 * h;
        int8_t *o = U->q + 128 * h;
        six_bit32(lo, 0, hi, 0, o);
        six_bit32(lo + 32, 0, hi, 2, o + 32);
        six_bit32(lo, 4, hi, 4, o + 64);
        six_bit32(lo + 32, 4, hi, 6, o + 96);
    }
    for (int s = 0; s < 16; s++) {
        U->dl[s] = d * (float)scales[s];
        U->ml[s] = 0.0f;
    }
}

/* Unpack a block: a k-quant's 256 values, or a legacy block of 32 into slot s of a group. */
typedef void (*Unpacker)(const uint8_t *, Unpacked *, int s);

typedef struct {
    Unpacker unpack;
    int values, bytes; /* per block */
    int mins; /* the type has minimums (w = d q - m) */
} BlockType;


/* The values from ``b`` on, up to 256: one k-quant block, or ``blocks`` (<= GROUP) legacy ones.
 * Returns how many blocks it took. */
static int unpack(BlockType bt, const uint8_t *b, int64_t blocks, Unpacked *U)
{
    U->mins = bt.mins;
    if (bt.values == 256) {
        bt.unpack(b, U, 0);
        return 1;
    }
    const int count = (int)MIN(blocks, GROUP);
    for (int s = 0; s < count; s++)
        bt.unpack(b + s * bt.bytes, U, s);
    U->subs = count;
    U->n = 32;
    return count;
}

static BlockType block_type(int type)
{
    switch (type) {
    case Q4_0: return (BlockType){q4_0, 32, 18, 0};
    case Q4_1: return (BlockType){q4_1, 32, 20, 1};
    case Q5_0: return (BlockType){q5_0, 32, 22, 0};
    case Q5_1: return (BlockType){q5_1, 32, 24, 1};
    case Q8_0: return (BlockType){q8_0, 32, 34, 0};
    case Q2_K: return (BlockType){q2_k, 256, 84, 1};
    case Q3_K: return (BlockType){q3_k, 256, 110, 0};
    case Q4_K: return (BlockType){q4_k, 256, 144, 1};
    case Q5_K: return (BlockType){q5_k, 256, 176, 1};
    case Q6_K: return (BlockType){q6_k, 256, 210, 0};
    default: return (BlockType){NULL, 0, 0, 0};
    }
}

/* y = dl * q - ml per sub-block: the block's values, rounded as the reference rounds them. */
static void apply(const Unpacked *U, float *restrict y)
{
    if (U->n == 16) {
        for (int s = 0; s < U->subs; s++)
            for (int l = 0; l < 16; l++)
                y[16 * s + l] = U->dl[s] * (float)U->q[16 * s + l] - U->ml[s];
    } else {
        for (int s = 0; s < U->subs; s++)
            for (int l = 0; l < 32; l++)
                y[32 * s + l] = U->dl[s] * (float)U->q[32 * s + l] - U->ml[s];
    }
}

/* One row of K values. */
static void decode_row(int type, BlockType bt, const uint8_t *row, int64_t K, float *restrict y)
{
    if (type == F16) {
        int64_t k = 0;
#if defined(__F16C__) /* 8 at a time in hardware (the same values: the conversion is exact) */
        for (; k + 8 <= K; k += 8)
            _mm256_storeu_ps(y + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * k))));
#endif
        for (; k < K; k++)
            y[k] = f16(row + 2 * k);
    } else if (type == BF16) {
        for (int64_t k = 0; k < K; k++)
            y[k] = bf16(row + 2 * k);
    } else {
        Unpacked U;
        for (int64_t k = 0; k < K;) {
            const int taken = unpack(bt, row, (K - k) / bt.values, &U);
            apply(&U, y + k);
            k += (int64_t)taken * bt.values;
            row += taken * bt.bytes;
        }
    }
}

static int known(int type, BlockType bt)
{
    return type == F16 || type == BF16 || bt.unpack != NULL;
}



/* out[M, rows n0..n1) (+)= x[M, K] . W[n0..n1)^T, ROWS weight rows decoded at a time. */
static int rows_of(int type, BlockType bt, const uint8_t *w, int64_t row_bytes, int64_t K, const float *x,
                   int64_t ldx, float *out, int64_t ldo, int64_t M, int64_t n0, int64_t n1, int accumulate)
{
    float *buf = scratch((size_t)ROWS * K);
    if (!buf)
        return 1;
    for (int64_t n = n0; n < n1; n += ROWS) {
        const int64_t rows = MIN(n1 - n, ROWS);
        for (int64_t j = 0; j < rows; j++)
            decode_row(type, bt, w + (n + j) * row_bytes, K, buf + j * K);
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < rows; j++) {
                const float s = dot16(x + i * ldx, buf + j * K, K);
                float *o = out + i * ldo + n + j;
                *o = accumulate ? *o + s : s;
            }
    }
    return 0;
}

/* ---- decode-sized batches: activations in int16, integer dot products ---- */

/* x [M, K] per 32 values: xq = round(x / dx), dx = max |x| / 32767 (half away from zero); and the
 * sums of x over each 16 and each 32 values, which the minimums multiply. int16 rather than
 * llama.cpp's int8 activations: one more widening per 16 weights, and 256x finer: at int8 a
 * Q4_K_M-style SmolLM2 lost 2.7 % of greedy tokens to transformers. */
static void quantize_x(const float *x, int64_t ldx, int64_t M, int64_t K, int16_t *xq, float *dx, float *s16,
                       float *s32)
{
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < K / 32; b++) {
            const float *v = x + i * ldx + 32 * b;
            float amax = 0.0f, h0 = 0.0f, h1 = 0.0f;
            for (int l = 0; l < 32; l++) {
                const float a = v[l] < 0.0f ? -v[l] : v[l];
                amax = a > amax ? a : amax;
            }
            for (int l = 0; l < 16; l++) {
                h0 += v[l];
                h1 += v[16 + l];
            }
            const float d = amax / 32767.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            int16_t *q = xq + i * K + 32 * b;
            for (int l = 0; l < 32; l++) {
                const float t = v[l] * id;
                q[x_position(l)] = (int16_t)(int)(t + (t >= 0.0f ? 0.5f : -0.5f));
            }
            dx[i * (K / 32) + b] = d;
            s16[i * (K / 16) + 2 * b] = h0;
            s16[i * (K / 16) + 2 * b + 1] = h1;
            s32[i * (K / 32) + b] = h0 + h1;
        }
}

/* out[M, rows n0..n1) (+)= x . W^T with x in int16 (quantize_x): a type's own kernel per block
 * where it has one, else the block unpacked once and block_dot per row of x. */
static void rows_int(BlockType bt, DirectKernel direct, const uint8_t *w, int64_t row_bytes, const XRows *X,
                     float *out, int64_t ldo, int64_t n0, int64_t n1, int accumulate)
{
    const int64_t K = X->K, M = X->M;
    Unpacked U;
    Acc acc[MAX_INT_ROWS];
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t i = 0; i < M; i++)
            acc_zero(&acc[i]);
        const uint8_t *row = w + n * row_bytes;
        if (direct)
            direct(row, K / bt.values, X, acc);
        else
            for (int64_t k0 = 0; k0 < K;) {
                const int taken = unpack(bt, row, (K - k0) / bt.values, &U);
                for (int64_t i = 0; i < M; i++)
                    block_dot(&U, X, i, k0, &acc[i]);
                k0 += (int64_t)taken * bt.values;
                row += taken * bt.bytes;
            }
        for (int64_t i = 0; i < M; i++) {
            float *o = out + i * ldo + n;
            const float a = acc_total(&acc[i]);
            *o = accumulate ? *o + a : a;
        }
    }
}

/* out[M, N] (+)= x[M, K] . W^T. Returns 0, 1 when a buffer could not be allocated, 2 for an
 * unknown type. */
int trillm_gguf_matmul(const float *x, int64_t ldx, int type, const uint8_t *w, int64_t row_bytes, int64_t N,
                       int64_t K, float *out, int64_t ldo, int64_t M, int flags, int num_threads)
{
    const BlockType bt = block_type(type);
    if (!known(type, bt))
        return 2;
    const int accumulate = flags & ACCUMULATE;
    const int64_t units = (N + ROWS - 1) / ROWS;
    int failed = 0;
    if (bt.unpack && !(flags & EXACT) && M <= MAX_INT_ROWS) {
        int16_t *xq = malloc(sizeof(int16_t) * (size_t)(M * K));
        float *dx = malloc(sizeof(float) * (size_t)(2 * M * (K / 32) + M * (K / 16)));
        if (!xq || !dx) {
            free(xq);
            free(dx);
            return 1;
        }
        float *s16 = dx + M * (K / 32), *s32 = s16 + M * (K / 16);
        quantize_x(x, ldx, M, K, xq, dx, s16, s32);
        const XRows X = {xq, dx, s16, s32, M, K};
        const DirectKernel direct = direct_kernel(type);
#pragma omp parallel num_threads(num_threads) if (units > 1 && N * K * (M + 4) >= PARALLEL_MIN_WORK)
        {
            const int t = omp_get_thread_num(), T = omp_get_num_threads();
            const int64_t u0 = units * t / T, u1 = units * (t + 1) / T;
            if (u1 > u0)
                rows_int(bt, direct, w, row_bytes, &X, out, ldo, u0 * ROWS, MIN(u1 * ROWS, N), accumulate);
        }
        free(xq);
        free(dx);
        return 0;
    }
#pragma omp parallel num_threads(num_threads) if (units > 1 && N * K * (M + 4) >= PARALLEL_MIN_WORK)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t u0 = units * t / T, u1 = units * (t + 1) / T;
        if (u1 > u0 && rows_of(type, bt, w, row_bytes, K, x, ldx, out, ldo, M, u0 * ROWS, MIN(u1 * ROWS, N), accumulate))
#pragma omp atomic write
            failed = 1;
    }
    return failed;
}

/* What the fused decode loop (cpu_forward.c) holds of a weight: the matmul's arguments. */
typedef struct {
    int64_t type;
    const uint8_t *w;
    int64_t row_bytes, N, K;
} GGUFLayout;

/* trillm_gguf_matmul with cpu_matmul's signature (a layout, the flags), for cpu_forward.c's loop;
 * 2 when a buffer could not be allocated (that loop's code for it). */
int trillm_gguf_layout_matmul(const float *x, int64_t ldx, const void *layout, float *out, int64_t ldo, int64_t M,
                              int flags, int num_threads)
{
    const GGUFLayout *L = layout;
    const int rc = trillm_gguf_matmul(x, ldx, (int)L->type, L->w, L->row_bytes, L->N, L->K, out, ldo, M, flags,
                                      num_threads);
    return rc ? 2 : 0;
}

/* out[i] = row ids[i] of W, decoded (an embedding lookup; ids checked by the caller). */
int trillm_gguf_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t K, const int64_t *ids, int64_t count,
                     float *out, int num_threads)
{
    const BlockType bt = block_type(type);
    if (!known(type, bt))
        return 2;
#pragma omp parallel for num_threads(num_threads) if (count * K >= PARALLEL_MIN_WORK)
    for (int64_t i = 0; i < count; i++)
        decode_row(type, bt, w + ids[i] * row_bytes, K, out + i * K);
    return 0;
}

/* out[r, K] = rows n0 .. n0 + count of W, decoded (a panel for the GEMM path, or a whole weight). */
int trillm_gguf_dequantize(int type, const uint8_t *w, int64_t row_bytes, int64_t K, int64_t n0, int64_t count,
                           float *out, int64_t ldo, int num_threads)
{
    const BlockType bt = block_type(type);
    if (!known(type, bt))
        return 2;
#pragma omp parallel for num_threads(num_threads) if (count * K >= PARALLEL_MIN_WORK)
    for (int64_t i = 0; i < count; i++)
        decode_row(type, bt, w + (n0 + i) * row_bytes, K, out + i * ldo);
    return 0;
}
