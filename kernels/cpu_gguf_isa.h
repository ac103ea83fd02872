/* cpu_gguf.c's section that differs by instruction set, included once by it; what both read (the
 * type ids, Unpacked, u32) is in cpu_gguf_blocks.h.
 *
 * AVX2 (+ FMA, F16C) and plain C: the helpers that unpack runs of 16 or 32 quants from a
 * block's bit fields (the same bytes on both paths, which the tests check value by value against
 * gguf's decoders), the x layout, the dot of one unpacked block with one row of int16
 * activations, and the kernels that read every k-quant's and Q5_0's and Q5_1's blocks directly.
 * AVX-512 CPUs run the AVX2 code (with VNNI, its multiply-add and add in one instruction), but for
 * the k-quant, Q5_0 / Q5_1 and MXFP4 kernels, which with AVX-512 BW take two runs of 32 values per 512-bit
 * instruction (GGUF_WIDE), int16 activations laid out by pairs of runs (x_index): the 8B-shaped
 * Q4_K_M file's one-stream step 233-236 -> 214-217 ms with int8 activations, 250-259 -> 231-234 ms
 * with int16; the gpt-oss-20b-shaped file's (MXFP4 experts) 157-161 -> 126-133 ms with int16;
 * the same bits as the 256-bit code.
 */

#include "cpu_gguf_blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GGUF_SIMD 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SIMD_ID 3 /* cpu_gguf.py's names: plain, avx2, avxvnni, avx512vnni-256, avx512vnni */
#define MADD_ADD(acc, a, b) _mm256_dpwssd_epi32((acc), (a), (b))
#define DOT_U8S8(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s))
#elif defined(__AVXVNNI__)
#define SIMD_ID 2
#define MADD_ADD(acc, a, b) _mm256_dpwssd_avx_epi32((acc), (a), (b))
#define DOT_U8S8(u, s) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (u), (s))
#else
#define SIMD_ID 1
#define MADD_ADD(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
/* u8 x s8 pairs to int16 (|sum| <= 2 * 63 * 127: the kernels' weights are < 64, no saturation), then to int32 */
#define DOT_U8S8(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1))
#endif
#else
#define GGUF_SIMD 0
#define SIMD_ID 0
#endif

/* AVX-512 (BW, VL, VNNI): the k-quant kernels take two runs of 32 per instruction (pair_product),
 * summing each run in the lanes and the order the AVX2 code sums it, so both give the same bits. */
#if GGUF_SIMD && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define GGUF_WIDE 1
#undef SIMD_ID
#define SIMD_ID 4
#else
#define GGUF_WIDE 0
#endif

/* MXFP4 (gpt-oss's experts): a power-of-two scale (E8M0) and 32 E2M1 values as nibbles, the low
 * nibbles values 0..15 and the high ones 16..31. The values are held doubled as int8 (0, 1, 2,
 * 3, 4, 6, 8, 12 and their negatives) and the scale halved, 2^(e - 128): the same floats. */
static const int8_t FP4_DOUBLED[16] __attribute__((aligned(16))) = {0, 1, 2, 3, 4, 6, 8, 12,
                                                                   0, -1, -2, -3, -4, -6, -8, -12};

INLINE float e8m0_half(uint8_t e)
{
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23; /* 2^(e - 128) */
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

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

/* q[j] = table[qs[j] & 15], q[j + 16] = table[qs[j] >> 4], j < 16: nibbles looked up (MXFP4's
 * E2M1 values), one byte shuffle per half where there is SIMD. */
INLINE void nibbles16_table(const uint8_t *restrict qs, const int8_t *restrict table, int8_t *restrict q)
{
#if GGUF_SIMD
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(15);
    const __m128i t = _mm_loadu_si128((const __m128i *)table);
    _mm_storeu_si128((__m128i *)q, _mm_shuffle_epi8(t, _mm_and_si128(v, m)));
    _mm_storeu_si128((__m128i *)(q + 16), _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(v, 4), m)));
#else
    for (int j = 0; j < 16; j++) {
        q[j] = table[qs[j] & 15];
        q[j + 16] = table[qs[j] >> 4];
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

#if GGUF_SIMD
/* Byte j: 16 where bit j of qh is set, else 0 (Q5_0 / Q5_1's fifth bits). Byte j takes byte j / 8
 * of qh, then its own bit j % 8. */
INLINE __m256i fifth_bits(uint32_t qh)
{
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)qh), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                                     2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}
#endif

/* q[j] += 16 where bit j of the 32-bit qh is set, j < 32 (Q5_0 / Q5_1's fifth bits) */
INLINE void add_fifth_bits(uint32_t qh, int8_t *restrict q)
{
#if GGUF_SIMD
    store32(q, _mm256_add_epi8(load32(q), fifth_bits(qh)));
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

/* The integer activations of the rows of x (quantize_x): xq [M, K] as int16, and per row its
 * scales per 32 values (dx) and sums per 16 and per 32 values (s16, s32), which the minimums
 * multiply. With int8 activations xq holds values of int8's range, and x8 the same values as
 * int8 in their natural order (the SIMD kernels' byte products); else x8 is NULL. */
typedef struct {
    const int16_t *xq;
    const int8_t *x8;
    const int8_t *xh, *xl; /* wide builds under int16 activations: each value 256 xh + xl, in order; else NULL */
    const float *dx, *s16, *s32;
    int64_t M, K;
} XRows;

/* One row of x against one unpacked block adds sum_s dl[s] dx[s] (q_s . xq_s) - ml[s] sum(x_s) to
 * its Acc; acc_total gives the row's sum. Each integer sum is exact (|q| <= 128, |xq| <= 32767, at
 * most 32 products); the float sums run in a fixed order, so a result does not depend on the
 * thread count. */
#if GGUF_SIMD
/* Where value v of a row of K sits in xq. Each run of 32 holds its 16 even values, then its 16 odd
 * ones: pairs of bytes loaded as int16 lanes then give their even and odd weights with one shift
 * each, in the lanes those activations are in; lanes 0-3 of a pair's products are values 0-15 of
 * the run. On wide builds two runs (64 values, where the row has them) hold both runs' even
 * values, then both runs' odd ones, so that pair_product loads each half with one instruction. */
INLINE int64_t x_index(int64_t v, int64_t K)
{
    const int64_t l = v & 31, odd = (l & 1) ? 16 : 0;
#if GGUF_WIDE
    const int64_t pair = v & ~(int64_t)63;
    if (pair + 64 <= K)
        return pair + 2 * odd + (v & 32 ? 16 : 0) + l / 2;
#else
    (void)K;
#endif
    return (v & ~(int64_t)31) + odd + l / 2;
}

/* max |v[l]|, l < 32 (max is exact: any order gives the scalar loop's value) */
INLINE float run_amax(const float *v)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(v));
    for (int j = 1; j < 4; j++)
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * j)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* quantize_x for one run of 32 values v (SIMD): the same floats and integers as its scalar loop (a
 * multiply, a half away from zero added, truncation), its values put where x_index says (its 16 even
 * values in a row, its 16 odd ones in a row) and, for int8 activations, into x8 in their order, or as
 * two byte planes (xh, and planes_apart bytes on, xl) where given.
 * Returns the exact integer sums of values 0-15 and 16-31. */
INLINE void quantize_run(const float *v, float id, int16_t *xq, int64_t even_at, int64_t odd_at, int8_t *x8,
                         int8_t *xh, int64_t planes_apart, int32_t *n0, int32_t *n1)
{
    const __m256 scale = _mm256_set1_ps(id), half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
    __m256i r[4]; /* int32: values 8 j .. 8 j + 7 */
    for (int j = 0; j < 4; j++) {
        const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), scale);
        r[j] = _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_or_ps(_mm256_and_ps(t, sign), half)));
    }
    const __m256i s0 = _mm256_add_epi32(r[0], r[1]), s1 = _mm256_add_epi32(r[2], r[3]);
    __m128i h = _mm_hadd_epi32(_mm256_castsi256_si128(s0), _mm256_extracti128_si256(s0, 1));
    h = _mm_hadd_epi32(h, _mm_hadd_epi32(_mm256_castsi256_si128(s1), _mm256_extracti128_si256(s1, 1)));
    h = _mm_hadd_epi32(h, h); /* lanes: n0, n1 */
    *n0 = _mm_cvtsi128_si32(h);
    *n1 = _mm_extract_epi32(h, 1);
    /* int32 lanes as (even, odd) int16 pairs: values 2 i and 2 i + 1 of a run, packed to int16 in order */
    const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(r[0], r[1]), 0xd8); /* values 0-15 */
    const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2], r[3]), 0xd8); /* 16-31 */
    const __m256i e_lo = _mm256_srai_epi32(_mm256_slli_epi32(lo, 16), 16), o_lo = _mm256_srai_epi32(lo, 16);
    const __m256i e_hi = _mm256_srai_epi32(_mm256_slli_epi32(hi, 16), 16), o_hi = _mm256_srai_epi32(hi, 16);
    store32(xq + even_at, _mm256_permute4x64_epi64(_mm256_packs_epi32(e_lo, e_hi), 0xd8));
    store32(xq + odd_at, _mm256_permute4x64_epi64(_mm256_packs_epi32(o_lo, o_hi), 0xd8));
    if (x8)
        store32(x8, _mm256_permute4x64_epi64(_mm256_packs_epi16(lo, hi), 0xd8));
    if (xh) { /* value = 256 high + low, both signed bytes (|value| <= INT16_LEVELS) */
        const __m256i h_lo = _mm256_srai_epi16(_mm256_add_epi16(lo, _mm256_set1_epi16(128)), 8);
        const __m256i h_hi = _mm256_srai_epi16(_mm256_add_epi16(hi, _mm256_set1_epi16(128)), 8);
        const __m256i l_lo = _mm256_sub_epi16(lo, _mm256_slli_epi16(h_lo, 8));
        const __m256i l_hi = _mm256_sub_epi16(hi, _mm256_slli_epi16(h_hi, 8));
        store32(xh, _mm256_permute4x64_epi64(_mm256_packs_epi16(h_lo, h_hi), 0xd8));
        store32(xh + planes_apart, _mm256_permute4x64_epi64(_mm256_packs_epi16(l_lo, l_hi), 0xd8));
    }
}

/* The 16 even values of the run of row ``row`` of x from value k (a multiple of 32), and its odd ones
 * (where its values k and k + 1 sit) */
INLINE const int16_t *x_run(const XRows *X, int64_t row, int64_t k, const int16_t **odd)
{
    const int16_t *x = X->xq + row * X->K;
    *odd = x + x_index(k + 1, X->K);
    return x + x_index(k, X->K);
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
INLINE __m256 run_dot(__m256i even, __m256i odd, const XRows *X, int64_t row, int64_t k)
{
    const int16_t *xo, *xe = x_run(X, row, k, &xo);
    const __m256i p = _mm256_madd_epi16(even, load32(xe));
    return _mm256_cvtepi32_ps(MADD_ADD(p, odd, load32(xo)));
}

/* The integer dot of a run of 32 weights with row ``row`` of x from value k, as floats in run_dot's
 * lanes. ``u``: unsigned bytes below 64; with int8 activations one byte multiply-add (DOT_U8S8),
 * else split into even and odd int16 lanes. ``int8`` is a constant where it is called: each
 * kernel is compiled once per activation width. */
INLINE __m256 run_product(__m256i u, const XRows *X, int64_t row, int64_t k, const int int8)
{
    if (int8)
        return _mm256_cvtepi32_ps(DOT_U8S8(u, load32(X->x8 + row * X->K + k)));
    const __m256i even = _mm256_and_si256(u, _mm256_set1_epi16(0xff)), odd = _mm256_srli_epi16(u, 8);
    return run_dot(even, odd, X, row, k);
}

/* A scale per 16 values of a run: lanes 0-3 lo, 4-7 hi */
INLINE __m256 halves(float lo, float hi)
{
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(lo)), _mm_set1_ps(hi), 1);
}

INLINE void block_dot(const Unpacked *U, const XRows *X, int64_t i, int64_t k0, Acc *acc)
{
    const float *dx = X->dx + i * (X->K / 32) + k0 / 32;
    const int runs = U->subs * U->n / 32;
    __m256 a0 = acc->a0, a1 = acc->a1; /* in registers (see k4_direct) */
    for (int r = 0; r < runs; r++) {
        const __m256i v = load32(U->q + 32 * r);
        const __m256 p = run_dot(even_bytes(v), _mm256_srai_epi16(v, 8), X, i, k0 + 32 * r);
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

/* Weight bytes asked into L2 this far ahead of the block being read. One stream of rows a thread
 * read at 12-13 GB/s (Q4_K, 8B-sized matrices from memory) with the hardware's prefetchers and a
 * burst of L1 prefetches a row ahead; a few L2 prefetches a block, spread through the reading,
 * 17-18 GB/s (two Sapphire Rapids cores; a plain read with them: 22 GB/s). */
#define AHEAD 2048

/* The lines of blocks [p, p + bytes) AHEAD bytes on, asked into L2 (past the end of the weight they
 * are dropped). */
INLINE void read_ahead(const uint8_t *p, int64_t bytes)
{
    for (int64_t c = 0; c < bytes; c += 64)
        _mm_prefetch((const char *)(p + AHEAD + c), _MM_HINT_T1);
    _mm_prefetch((const char *)(p + AHEAD + bytes - 1), _MM_HINT_T1);
}

/* The k-quant kernels run a tile of up to TILE rows of x along a whole weight row, their sums
 * in registers from the first block to the last: each group of weights is unpacked once for
 * the tile, and nothing is spilled (16 AVX2 registers: the tile's 8 sums, 4 of weights, 4 spare). */
#define TILE 4

/* Q4_K's and Q5_K's 8 scales times d and 8 minimums times dmin, their 6 bits (scale_min_k4) unpacked
 * four at a time in 32-bit words */
INLINE void k4_scales(const uint8_t *b, __m256 *dl, __m256 *mins)
{
    /* bytes 4-15: scales 0-3 (low 6 bits of 4-7), minimums 0-3 (of 8-11), the low and high nibbles of
     * 12-15 the low 4 bits of scales and minimums 4-7, whose top 2 bits are those of 4-7 and 8-11 */
    const __m128i v = _mm_loadu_si128((const __m128i *)b);
    const __m128i low = _mm_shuffle_epi8(v, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
    const __m128i m4 = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
    const __m128i hi4 = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
    __m128i q = _mm_or_si128(_mm_and_si128(low, m4), _mm_and_si128(_mm_srli_epi16(low, 4), hi4));
    q = _mm_or_si128(q, _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
    const __m128 dm = _mm_cvtph_ps(v); /* d, dmin */
    *dl = _mm256_mul_ps(_mm256_broadcastss_ps(dm), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)));
    *mins = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)),
                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))));
}

/* Group g's 64 values (sub-blocks 2 g and 2 g + 1) of Q4_K or Q5_K (qh NULL for Q4_K) as unsigned bytes */
INLINE void k4_group(const uint8_t *qs, const uint8_t *qh, int g, __m256i *lo, __m256i *hi)
{
    const __m256i v = load32(qs + 32 * g), low4 = _mm256_set1_epi8(15), bit = _mm256_set1_epi8(1);
    *lo = _mm256_and_si256(v, low4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    if (qh) {
        const __m256i h = load32(qh);
        *lo = _mm256_or_si256(*lo, _mm256_slli_epi16(_mm256_and_si256(shift_right(h, 2 * g), bit), 4));
        *hi = _mm256_or_si256(*hi, _mm256_slli_epi16(_mm256_and_si256(shift_right(h, 2 * g + 1), bit), 4));
    }
}

/* Q4_K and Q5_K (qh NULL for Q4_K): byte l of a group of 32 holds values l (low nibble) and 32 + l
 * (high), the fifth bit of value 32 s + l bit s of qh[l]. */
INLINE void k4_block(const uint8_t *b, const uint8_t *qs, const uint8_t *qh, const XRows *X, int64_t i0, const int T,
                     int64_t k0, __m256 (*a)[2], __m256 *m, const int int8)
{
    __m256 dl, mins;
    k4_scales(b, &dl, &mins);
    float sc[TILE][8];
    for (int t = 0; t < T; t++) {
        const int64_t run = (i0 + t) * (X->K / 32) + k0 / 32;
        m[t] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(X->s32 + run), m[t]);
        _mm256_storeu_ps(sc[t], _mm256_mul_ps(dl, _mm256_loadu_ps(X->dx + run)));
    }
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) { /* 64 values: sub-blocks 2 g (the low nibbles) and 2 g + 1 (the high) */
        __m256i lo, hi;
        k4_group(qs, qh, g, &lo, &hi);
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const int64_t k = k0 + 64 * g;
            a[t][0] = _mm256_fmadd_ps(run_product(lo, X, i0 + t, k, int8), _mm256_broadcast_ss(sc[t] + 2 * g), a[t][0]);
            a[t][1] = _mm256_fmadd_ps(run_product(hi, X, i0 + t, k + 32, int8), _mm256_broadcast_ss(sc[t] + 2 * g + 1),
                                      a[t][1]);
        }
    }
}

/* The types of 16 sub-blocks of 16 (Q2_K, Q3_K, Q6_K): lo, hi the float scales of sub-blocks 0-7
 * and 8-15; run r (values 32 r ..) takes sub-blocks 2 r and 2 r + 1, in lanes 0-3 and 4-7. */
INLINE void scales16(__m256 d, __m128i sc8, __m256 *lo, __m256 *hi) /* sc8: 16 int8 scales */
{
    *lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
    *hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))));
}

INLINE __m256 run_scale(__m256 lo, __m256 hi, int r)
{
    const int s = 2 * r % 8;
    return _mm256_permutevar8x32_ps(r < 4 ? lo : hi, _mm256_setr_epi32(s, s, s, s, s + 1, s + 1, s + 1, s + 1));
}

/* m[t] += the 16 minimums (lo, hi as scales16's) times the sums of x of their sub-blocks */
INLINE void minimums16(__m256 lo, __m256 hi, const XRows *X, int64_t i0, const int T, int64_t k0, __m256 *m)
{
    for (int t = 0; t < T; t++) {
        const float *s16 = X->s16 + (i0 + t) * (X->K / 16) + k0 / 16;
        m[t] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(s16), m[t]);
        m[t] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(s16 + 8), m[t]);
    }
}

/* Run r (values 32 r .. 32 r + 31 of the block at k0) of one weight row, its quants unsigned bytes
 * u, with its scale per 16 values (run_scale), into the sums of rows i0 .. i0 + T of x. */
INLINE void run_into(__m256i u, __m256 scale, const XRows *X, int64_t i0, const int T, int64_t k0, int r,
                     __m256 (*a)[2], const int int8)
{
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
        const float *dx = X->dx + (i0 + t) * (X->K / 32) + k0 / 32 + r;
        a[t][r & 1] = _mm256_fmadd_ps(run_product(u, X, i0 + t, k0 + 32 * r, int8),
                                      _mm256_mul_ps(scale, _mm256_broadcast_ss(dx)), a[t][r & 1]);
    }
}

/* Q6_K: value 128 h + 32 j + l is nibble j / 2 of ql[64 h + 32 (j % 2) + l] with bits 2 j of
 * qh[32 h + l] above it, less 32; 16 sub-blocks of 16 with int8 scales. The 32 is taken off as
 * a minimum (32 d sc times the sum of x), so the quants stay unsigned bytes until they are split
 * into int16 lanes. */
INLINE void q6_k_block(const uint8_t *b, const XRows *X, int64_t i0, const int T, int64_t k0, __m256 (*a)[2], __m256 *m,
                      const int int8)
{
    const uint8_t *ql = b, *qh = b + 128;
    __m256 ds_lo, ds_hi;
    scales16(_mm256_set1_ps(f16(b + 208)), _mm_loadu_si128((const __m128i *)(b + 192)), &ds_lo, &ds_hi);
    minimums16(ds_lo, ds_hi, X, i0, T, k0, m); /* times 32: OFFSET */
    const __m256i low4 = _mm256_set1_epi8(15), bits45 = _mm256_set1_epi8(0x30);
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) { /* runs of 32: value 32 r + l */
        const int h = r / 4, j = r % 4, hs = 2 * j;
        const __m256i hv = load32(qh + 32 * h), lo = load32(ql + 64 * h + 32 * (j % 2));
        const __m256i l4 = _mm256_and_si256(j / 2 ? _mm256_srli_epi16(lo, 4) : lo, low4);
        /* bits hs, hs + 1 of each byte to bits 4, 5 */
        const __m256i he = hs <= 4 ? _mm256_sll_epi16(hv, _mm_cvtsi32_si128(4 - hs)) : shift_right(hv, hs - 4);
        const __m256i u = _mm256_or_si256(l4, _mm256_and_si256(he, bits45));
        run_into(u, run_scale(ds_lo, ds_hi, r), X, i0, T, k0, r, a, int8);
    }
}

/* The 16 scales of 6 bits less 32, four at a time in 32-bit words: low 4 bits from the nibbles of
 * bytes 96-103, high 2 bits from bytes 104-107 (scale s: bits 2 (s / 4) of byte 104 + s % 4) */
INLINE __m128i q3_k_scales(const uint8_t *b)
{
    const uint32_t lo0 = u32(b + 96), lo1 = u32(b + 100), hi = u32(b + 104), m4 = 0x0f0f0f0f, m2 = 0x03030303;
    return _mm_sub_epi8(
        _mm_set_epi32((int)(((lo1 >> 4) & m4) | ((hi >> 6) & m2) << 4), (int)(((lo0 >> 4) & m4) | ((hi >> 4) & m2) << 4),
                      (int)((lo1 & m4) | ((hi >> 2) & m2) << 4), (int)((lo0 & m4) | (hi & m2) << 4)),
        _mm_set1_epi8(32));
}

/* Run r's quants (value 32 r + l) plus 4, unsigned: its 2 bits and its third bit (h: hmask) */
INLINE __m256i run_u3(const uint8_t *qs, __m256i h, int r)
{
    const __m256i q2 = _mm256_and_si256(shift_right(load32(qs + 32 * (r / 4)), 2 * (r % 4)), _mm256_set1_epi8(3));
    const __m256i bit = _mm256_set1_epi8((char)(1 << r)); /* the third bit, to bit 2 */
    return _mm256_or_si256(q2, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), _mm256_set1_epi8(4)));
}

/* Q3_K: value 128 g + 32 j + l is bits 2 j of qs[32 g + l], its third bit bit 4 g + j of hmask[l],
 * less 4 (taken off as a minimum, as Q6_K's 32); 16 sub-blocks of 16 with 6-bit scales less 32. */
INLINE void q3_k_block(const uint8_t *b, const XRows *X, int64_t i0, const int T, int64_t k0, __m256 (*a)[2], __m256 *m,
                      const int int8)
{
    const uint8_t *hmask = b, *qs = b + 32;
    __m256 ds_lo, ds_hi;
    scales16(_mm256_set1_ps(f16(b + 108)), q3_k_scales(b), &ds_lo, &ds_hi);
    minimums16(ds_lo, ds_hi, X, i0, T, k0, m); /* times 4: OFFSET */
    const __m256i h = load32(hmask);
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) /* runs of 32: value 32 r + l */
        run_into(run_u3(qs, h, r), run_scale(ds_lo, ds_hi, r), X, i0, T, k0, r, a, int8);
}

/* Q2_K: value 128 g + 32 j + l is bits 2 j of qs[32 g + l]; 16 sub-blocks of 16, each with a
 * 4-bit scale (low nibble of scales[s], times d) and a 4-bit minimum (high nibble, times dmin). */
/* Q2_K's 16 scales (times d) and minimums (times dmin) as scales16 gives them */
INLINE void q2_k_scales(const uint8_t *b, __m256 *ds_lo, __m256 *ds_hi, __m256 *mn_lo, __m256 *mn_hi)
{
    const __m128i packed = _mm_loadu_si128((const __m128i *)b), m4 = _mm_set1_epi8(15);
    const __m128i sc8 = _mm_and_si128(packed, m4), mn8 = _mm_and_si128(_mm_srli_epi16(packed, 4), m4);
    scales16(_mm256_set1_ps(f16(b + 80)), sc8, ds_lo, ds_hi); /* the nibbles are < 16: as int8 the same values */
    scales16(_mm256_set1_ps(f16(b + 82)), mn8, mn_lo, mn_hi);
}

/* Run r's quants (value 32 r + l): bits 2 (r % 4) of qs[32 (r / 4) + l] */
INLINE __m256i run_u2(const uint8_t *qs, int r)
{
    return _mm256_and_si256(shift_right(load32(qs + 32 * (r / 4)), 2 * (r % 4)), _mm256_set1_epi8(3));
}

INLINE void q2_k_block(const uint8_t *b, const XRows *X, int64_t i0, const int T, int64_t k0, __m256 (*a)[2], __m256 *m,
                      const int int8)
{
    const uint8_t *qs = b + 16;
    __m256 ds_lo, ds_hi, mn_lo, mn_hi;
    q2_k_scales(b, &ds_lo, &ds_hi, &mn_lo, &mn_hi);
    minimums16(mn_lo, mn_hi, X, i0, T, k0, m);
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) /* runs of 32: value 32 r + l */
        run_into(run_u2(qs, r), run_scale(ds_lo, ds_hi, r), X, i0, T, k0, r, a, int8);
}

#if GGUF_WIDE
/* Two runs of 32 in one register: run 2 p in the low half (the AVX2 code's a0 lanes), 2 p + 1 in
 * the high one (a1's). */
INLINE __m512i pair_i(__m256i lo, __m256i hi)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

INLINE __m512 pair_ps(__m256 lo, __m256 hi)
{
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

/* The int16 products of runs 2 p and 2 p + 1 (values k .. k + 63) of a weight row, its values as int16
 * lanes (even: each pair's first, odd: its second), with row ``row`` of x, in run_dot's lanes */
INLINE __m512 pair_dot16(__m512i even, __m512i odd, const XRows *X, int64_t row, int64_t k)
{
    const int16_t *x = X->xq + row * X->K + k; /* both runs' even values, then both runs' odd ones (x_index) */
    const __m512i p = _mm512_madd_epi16(even, _mm512_loadu_si512(x));
    return _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(p, odd, _mm512_loadu_si512(x + 32)));
}

/* run_product for runs 2 p and 2 p + 1 (values k .. k + 63, k a multiple of 64) at once, each in run_dot's
 * lanes. With int16 activations ``sign`` says the bytes of u are signed values (MXFP4's), else unsigned;
 * ``planes``: multiply unsigned u by x's byte planes (two byte multiply-adds, no int16 lanes to make:
 * the faster form for one row of x), else by its int16 lanes (made once for a tile of rows, as the
 * compiler shares them between the tile's calls: at 4 and 8 rows the planes cost 4 % more). Both give
 * the same integers, so the same bits. */
INLINE __m512 pair_product(__m512i u, const XRows *X, int64_t row, int64_t k, const int int8, const int sign,
                           const int planes)
{
    if (int8)
        return _mm512_cvtepi32_ps(
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(X->x8 + row * X->K + k)));
    if (planes && !sign) { /* int16 x as its two byte planes: the same integer in each lane as pair_dot16's */
        const int64_t at = row * X->K + k;
        const __m512i high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(X->xh + at));
        return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_slli_epi32(high, 8), u, _mm512_loadu_si512(X->xl + at)));
    }
    const __m512i even = sign ? _mm512_srai_epi16(_mm512_slli_epi16(u, 8), 8) : _mm512_and_si512(u, _mm512_set1_epi16(0xff));
    const __m512i odd = sign ? _mm512_srai_epi16(u, 8) : _mm512_srli_epi16(u, 8);
    return pair_dot16(even, odd, X, row, k);
}

/* Group g of a Q4_K block as pair_product's unsigned bytes, from one broadcast load of its 32 bytes and
 * no shift: the low half takes the low nibbles as they are, the high half the high nibbles in place,
 * 16 times their values (16 * 15 fits a byte; k4_pair_scales gives the odd sub-blocks' scales 1/16,
 * which makes the same floats: a power of two commutes with each rounding). */
INLINE __m512i k4_pair_bytes(const uint8_t *qs, int g)
{
    const __m512i w = _mm512_broadcast_i64x4(load32(qs + 32 * g));
    return _mm512_and_si512(w, _mm512_inserti64x4(_mm512_set1_epi8(15), _mm256_set1_epi8((char)0xf0), 1));
}


/* Q4_K's 8 scales with the odd ones over 16, for k4_pair_bytes's high halves */
INLINE __m256 k4_pair_scales(__m256 dl)
{
    return _mm256_mul_ps(dl, _mm256_setr_ps(1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f));
}

/* A pair register's sums into an Acc: its low half is the 256-bit code's a0, its high half a1 */
INLINE void put_pair(__m512 a, Acc *acc)
{
    acc->a0 = _mm512_castps512_ps256(a);
    acc->a1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
}

/* The lanes of runs 2 p, 2 p + 1 from a block's 16 scales per 16 values (lanes 4 s .. 4 s + 3 take scale s) */
INLINE __m512 pair_scale16(__m512 ds, int p)
{
    const int s = 4 * p;
    return _mm512_permutexvar_ps(_mm512_setr_epi32(s, s, s, s, s + 1, s + 1, s + 1, s + 1, s + 2, s + 2, s + 2, s + 2,
                                                   s + 3, s + 3, s + 3, s + 3),
                                 ds);
}

/* ... and from its 8 per 32 values (lanes 0-7 take value 2 p, 8-15 value 2 p + 1) */
INLINE __m512 pair_scale32(__m256 d8, int p)
{
    const __m512i at = _mm512_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1,
                                         2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
    return _mm512_permutexvar_ps(at, _mm512_castps256_ps512(d8));
}

/* Blocks 2 p and 2 p + 1 of a group of legacy blocks (``bytes`` each, their 16 bytes of nibbles at
 * ``at``): 64 nibbles, block 2 p's low ones (its values 0-15), its high ones (16-31), then block
 * 2 p + 1's, the halves pair_i puts runs in. */
INLINE __m512i pair_nibbles(const uint8_t *b, int p, int bytes, int at)
{
    const __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(b + (2 * p + 1) * bytes + at)),
                                       _mm_loadu_si128((const __m128i *)(b + 2 * p * bytes + at)));
    const __m512i w = _mm512_castsi256_si512(v);
    const __m512i twice = _mm512_shuffle_i64x2(w, w, 0x50); /* 16-byte lanes: block 2 p's, twice, then 2 p + 1's */
    const __m512i shifts = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4); /* the high nibbles of the second copies */
    return _mm512_and_si512(_mm512_srlv_epi64(twice, shifts), _mm512_set1_epi8(15));
}

/* A whole group of 8 blocks of 32 (u: their values two blocks a register, as pair_nibbles lays them out;
 * dv: their scales; mv: their minimums, taken where ``mins``) against row i of x, onto its sums a (the
 * 256-bit code's a0 and a1 paired) and m, each block summed in the lanes and order of the 256-bit
 * kernels (the same bits); ``sign``: pair_product's. */
INLINE void group_row(const __m512i *u, __m256 dv, __m256 mv, const int mins, const XRows *X, int64_t i, int64_t k0,
                      __m512 *a, __m256 *m, const int int8, const int sign)
{
    const int64_t run = i * (X->K / 32) + k0 / 32;
    const __m256 scale = _mm256_mul_ps(dv, _mm256_loadu_ps(X->dx + run));
    if (mins)
        *m = _mm256_fmadd_ps(mv, _mm256_loadu_ps(X->s32 + run), *m);
#pragma GCC unroll 4
    for (int p = 0; p < GROUP / 2; p++)
        *a = _mm512_fmadd_ps(pair_product(u[p], X, i, k0 + 64 * p, int8, sign, 1), pair_scale32(scale, p), *a);
}

/* k4_block, two runs at a time. */
INLINE void k4_block_wide(const uint8_t *b, const uint8_t *qs, const uint8_t *qh, const XRows *X, int64_t i0,
                          const int T, int64_t k0, __m512 *a, __m256 *m, const int int8)
{
    __m256 dl, mins;
    k4_scales(b, &dl, &mins);
    if (!qh)
        dl = k4_pair_scales(dl);
    __m256 sc[TILE];
    for (int t = 0; t < T; t++) {
        const int64_t run = (i0 + t) * (X->K / 32) + k0 / 32;
        m[t] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(X->s32 + run), m[t]);
        sc[t] = _mm256_mul_ps(dl, _mm256_loadu_ps(X->dx + run));
    }
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
        __m512i u;
        if (qh) {
            __m256i lo, hi;
            k4_group(qs, qh, g, &lo, &hi);
            u = pair_i(lo, hi);
        } else
            u = k4_pair_bytes(qs, g);
#pragma GCC unroll 8
        for (int t = 0; t < T; t++)
            a[t] = _mm512_fmadd_ps(pair_product(u, X, i0 + t, k0 + 64 * g, int8, 0, T == 1), pair_scale32(sc[t], g), a[t]);
    }
}

/* A block's 16 scales per 16 values (ds) times x's scale of each one's run, for rows i0 .. i0 + T
 * of x: the products the 256-bit code takes per run, made once a block. */
INLINE void scaled16(__m512 ds, const XRows *X, int64_t i0, const int T, int64_t k0, __m512 *sd)
{
    const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    for (int t = 0; t < T; t++) {
        const __m256 dx = _mm256_loadu_ps(X->dx + (i0 + t) * (X->K / 32) + k0 / 32);
        sd[t] = _mm512_mul_ps(ds, _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(dx)));
    }
}

/* Runs 2 p, 2 p + 1 of one weight row (unsigned bytes u), with their scales (scaled16), into the sums
 * of rows i0 .. i0 + T of x: run_into two at a time. */
INLINE void pair_into(__m512i u, const __m512 *sd, const XRows *X, int64_t i0, const int T, int64_t k0, int p,
                      __m512 *a, const int int8)
{
#pragma GCC unroll 8
    for (int t = 0; t < T; t++)
        a[t] = _mm512_fmadd_ps(pair_product(u, X, i0 + t, k0 + 64 * p, int8, 0, T == 1), pair_scale16(sd[t], p), a[t]);
}

/* scales16 in one register: sub-block s in lane s (lanes 0-7 scales16's lo, 8-15 its hi) */
INLINE __m512 scales16_wide(const uint8_t *d, __m128i sc8)
{
    return _mm512_mul_ps(_mm512_set1_ps(f16(d)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)));
}

INLINE __m256 low_half(__m512 v)
{
    return _mm512_castps512_ps256(v);
}

INLINE __m256 high_half(__m512 v)
{
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* q6_k_block, two runs at a time: runs 2 p and 2 p + 1 are the same nibbles of 64 bytes of ql in a row,
 * their high bits two pairs apart in the same 32 bytes of qh. */
INLINE void q6_k_block_wide(const uint8_t *b, const XRows *X, int64_t i0, const int T, int64_t k0, __m512 *a,
                            __m256 *m, const int int8)
{
    const uint8_t *ql = b, *qh = b + 128;
    const __m512 ds = scales16_wide(b + 208, _mm_loadu_si128((const __m128i *)(b + 192)));
    minimums16(low_half(ds), high_half(ds), X, i0, T, k0, m); /* times 32: OFFSET */
    __m512 sd[TILE];
    scaled16(ds, X, i0, T, k0, sd);
    const __m512i low4 = _mm512_set1_epi8(15), bits45 = _mm512_set1_epi8(0x30);
    /* bits 2 j, 2 j + 1 of qh to bits 4, 5: runs with j = 0, 1 shift left 4, 2; j = 2, 3 by 0, right 2 */
    const __m512i left = pair_i(_mm256_set1_epi16(4), _mm256_set1_epi16(2));
    const __m512i right = pair_i(_mm256_setzero_si256(), _mm256_set1_epi16(2));
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) { /* runs 2 p, 2 p + 1: value 64 p + l */
        const int h = p / 2, upper = p % 2;
        const __m512i hv = _mm512_broadcast_i64x4(load32(qh + 32 * h));
        const __m512i v = _mm512_loadu_si512(ql + 64 * h);
        const __m512i l4 = _mm512_and_si512(upper ? _mm512_srli_epi16(v, 4) : v, low4);
        const __m512i he = upper ? _mm512_srlv_epi16(hv, right) : _mm512_sllv_epi16(hv, left);
        const __m512i u = _mm512_or_si512(l4, _mm512_and_si512(he, bits45));
        pair_into(u, sd, X, i0, T, k0, p, a, int8);
    }
}

/* Q3_K and Q2_K: their runs as the AVX2 code makes them (run_u3, run_u2), put in pairs. */
INLINE void q3_k_block_wide(const uint8_t *b, const XRows *X, int64_t i0, const int T, int64_t k0, __m512 *a,
                            __m256 *m, const int int8)
{
    const uint8_t *hmask = b, *qs = b + 32;
    const __m512 ds = scales16_wide(b + 108, q3_k_scales(b));
    minimums16(low_half(ds), high_half(ds), X, i0, T, k0, m); /* times 4: OFFSET */
    __m512 sd[TILE];
    scaled16(ds, X, i0, T, k0, sd);
    const __m256i h = load32(hmask);
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++)
        pair_into(pair_i(run_u3(qs, h, 2 * p), run_u3(qs, h, 2 * p + 1)), sd, X, i0, T, k0, p, a, int8);
}

INLINE void q2_k_block_wide(const uint8_t *b, const XRows *X, int64_t i0, const int T, int64_t k0, __m512 *a,
                            __m256 *m, const int int8)
{
    const uint8_t *qs = b + 16;
    __m256 ds_lo, ds_hi, mn_lo, mn_hi;
    q2_k_scales(b, &ds_lo, &ds_hi, &mn_lo, &mn_hi);
    minimums16(mn_lo, mn_hi, X, i0, T, k0, m);
    __m512 sd[TILE];
    scaled16(pair_ps(ds_lo, ds_hi), X, i0, T, k0, sd);
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++)
        pair_into(pair_i(run_u2(qs, 2 * p), run_u2(qs, 2 * p + 1)), sd, X, i0, T, k0, p, a, int8);
}

#define KQ(block) block##_wide /* k_rows's kernel of a block */
#else
#define KQ(block) block
#endif

/* The offset Q6_K's and Q3_K's quants are stored above (32, 4), taken off through their minimums:
 * each block's minimums are summed unscaled and the row's total scaled once */
#define OFFSET(type) ((type) == Q6_K ? 32.0f : (type) == Q3_K ? 4.0f : 1.0f)

/* A weight row (``blocks`` k-quant blocks of ``bytes``) against rows i0 .. i0 + T of x. */
INLINE void k_rows(int type, const uint8_t *row, int64_t blocks, int bytes, const XRows *X, int64_t i0, const int T,
                   Acc *acc, const int int8)
{
#if GGUF_WIDE
    __m512 a[TILE]; /* a run pair's lanes: the 256-bit code's a0, then its a1 */
#else
    __m256 a[TILE][2];
#endif
    __m256 m[TILE];
    for (int t = 0; t < T; t++) {
#if GGUF_WIDE
        a[t] = _mm512_setzero_ps();
#else
        a[t][0] = a[t][1] = _mm256_setzero_ps();
#endif
        m[t] = _mm256_setzero_ps();
    }
    for (int64_t j = 0; j < blocks; j++) {
        const uint8_t *b = row + j * bytes;
        if (i0 == 0) /* the row's first tile of x: the later ones find it in cache */
            read_ahead(b, bytes);
        if (type == Q6_K)
            KQ(q6_k_block)(b, X, i0, T, 256 * j, a, m, int8);
        else if (type == Q3_K)
            KQ(q3_k_block)(b, X, i0, T, 256 * j, a, m, int8);
        else if (type == Q2_K)
            KQ(q2_k_block)(b, X, i0, T, 256 * j, a, m, int8);
        else if (type == Q5_K)
            KQ(k4_block)(b, b + 48, b + 16, X, i0, T, 256 * j, a, m, int8);
        else
            KQ(k4_block)(b, b + 16, NULL, X, i0, T, 256 * j, a, m, int8);
    }
    const float offset = OFFSET(type);
    for (int t = 0; t < T; t++) {
        if (offset != 1.0f) /* a power of two: the same floats as each block's minimums scaled by it */
            m[t] = _mm256_mul_ps(m[t], _mm256_set1_ps(offset));
#if GGUF_WIDE
        put_pair(a[t], &acc[i0 + t]);
#else
        acc[i0 + t].a0 = a[t][0];
        acc[i0 + t].a1 = a[t][1];
#endif
        acc[i0 + t].m = m[t];
    }
}

/* Every row of x, TILE at a time (each tile size its own code, so that the sums stay in registers). */
INLINE void k_row_as(int type, const uint8_t *row, int64_t blocks, int bytes, const XRows *X, Acc *acc, const int int8)
{
    int64_t i = 0;
    for (; i + TILE <= X->M; i += TILE)
        k_rows(type, row, blocks, bytes, X, i, TILE, acc, int8);
    switch (X->M - i) {
    case 3: k_rows(type, row, blocks, bytes, X, i, 3, acc, int8); break;
    case 2: k_rows(type, row, blocks, bytes, X, i, 2, acc, int8); break;
    case 1: k_rows(type, row, blocks, bytes, X, i, 1, acc, int8); break;
    default: break;
    }
}

INLINE void k_row(int type, const uint8_t *row, int64_t blocks, int bytes, const XRows *X, Acc *acc)
{
    if (X->x8)
        k_row_as(type, row, blocks, bytes, X, acc, 1);
    else
        k_row_as(type, row, blocks, bytes, X, acc, 0);
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

static void q3_k_row(const uint8_t *row, int64_t blocks, const XRows *X, Acc *acc)
{
    k_row(Q3_K, row, blocks, 110, X, acc);
}

static void q2_k_row(const uint8_t *row, int64_t blocks, const XRows *X, Acc *acc)
{
    k_row(Q2_K, row, blocks, 84, X, acc);
}

/* Q5_0 and Q5_1, up to 8 blocks of 32 (a run each) at once, so that every row of x sums them in
 * registers: value j < 16 is byte j's low nibble, j >= 16 byte j - 16's high one, its fifth bit
 * bit j of qh; Q5_0 takes 16 off (as a minimum, 16 d sum(x)), Q5_1 adds m (a minimum of -m). */
INLINE void q5_legacy_direct(const uint8_t *b, int64_t count, int has_m, const XRows *X, int64_t k0, Acc *acc,
                             const int int8)
{
    const int bytes = has_m ? 24 : 22;
    const __m128i m4 = _mm_set1_epi8(15);
    __m256i even[GROUP], odd[GROUP]; /* int8: the unsigned quants in even */
    float d[GROUP], mn[GROUP];
    for (int64_t j = 0; j < count; j++) {
        const uint8_t *blk = b + j * bytes, *qh = blk + (has_m ? 4 : 2);
        d[j] = f16(blk);
        mn[j] = has_m ? -f16(blk + 2) : 16.0f * d[j];
        const __m128i v = _mm_loadu_si128((const __m128i *)(qh + 4));
        const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
        const __m256i u = _mm256_or_si256(nib, fifth_bits(u32(qh)));
        even[j] = int8 ? u : _mm256_and_si256(u, _mm256_set1_epi16(0xff));
        odd[j] = _mm256_srli_epi16(u, 8);
    }
    for (int64_t i = 0; i < X->M; i++) {
        const int64_t run = i * (X->K / 32) + k0 / 32;
        __m256 a0 = acc[i].a0, a1 = acc[i].a1; /* in registers (see k4_direct) */
        float scale[GROUP];
        if (count == GROUP) { /* the scales and minimums of all eight at once */
            _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_loadu_ps(d), _mm256_loadu_ps(X->dx + run)));
            acc[i].m = _mm256_fmadd_ps(_mm256_loadu_ps(mn), _mm256_loadu_ps(X->s32 + run), acc[i].m);
        } else {
            float mins = 0.0f;
            for (int64_t j = 0; j < count; j++) {
                scale[j] = d[j] * X->dx[run + j];
                mins += mn[j] * X->s32[run + j];
            }
            acc[i].m = _mm256_add_ps(acc[i].m, _mm256_castps128_ps256(_mm_set_ss(mins)));
        }
        for (int64_t j = 0; j < count; j++) {
            const __m256 p = int8 ? run_product(even[j], X, i, k0 + 32 * j, 1) : run_dot(even[j], odd[j], X, i, k0 + 32 * j);
            if (j & 1)
                a1 = _mm256_fmadd_ps(p, _mm256_broadcast_ss(scale + j), a1);
            else
                a0 = _mm256_fmadd_ps(p, _mm256_broadcast_ss(scale + j), a0);
        }
        acc[i].a0 = a0;
        acc[i].a1 = a1;
    }
}

#if GGUF_WIDE
/* 8 float16 values ``stride`` bytes apart (a group's d or m) */
INLINE __m256 f16x8(const uint8_t *p, int stride)
{
    uint16_t h[8];
    for (int j = 0; j < 8; j++)
        h[j] = (uint16_t)(p[j * stride] | p[j * stride + 1] << 8);
    return _mm256_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], (short)h[4], (short)h[5],
                                          (short)h[6], (short)h[7]));
}

/* q5_legacy_direct for a whole group, two blocks a register: the fifth bits added under a mask; its
 * values, scales and minimums into u, dv and mv */
INLINE void q5_group_values(const uint8_t *b, int has_m, __m512i *u, __m256 *dv, __m256 *mv)
{
    const int bytes = has_m ? 24 : 22, qh = has_m ? 4 : 2;
    for (int p = 0; p < GROUP / 2; p++) {
        const __m512i nibbles = pair_nibbles(b, p, bytes, qh + 4);
        const __mmask64 fifth = (__mmask64)u32(b + 2 * p * bytes + qh) | (__mmask64)u32(b + (2 * p + 1) * bytes + qh) << 32;
        u[p] = _mm512_mask_add_epi8(nibbles, fifth, nibbles, _mm512_set1_epi8(16));
    }
    *dv = f16x8(b, bytes);
    *mv = has_m ? _mm256_xor_ps(f16x8(b + 2, bytes), _mm256_set1_ps(-0.0f)) /* -m, as the 256-bit code */
                : _mm256_mul_ps(_mm256_set1_ps(16.0f), *dv);
}

#endif

/* MXFP4, 8 blocks at a time: the nibbles looked up as signed doubled E2M1 values (one byte
 * shuffle per half), split into even and odd int16 lanes for the x layout; no minimums. */
INLINE void mxfp4_direct(const uint8_t *b, int64_t count, const XRows *X, int64_t k0, Acc *acc)
{
    const __m128i m4 = _mm_set1_epi8(15), table = _mm_load_si128((const __m128i *)FP4_DOUBLED);
    __m256i even[GROUP], odd[GROUP];
    float d[GROUP];
    for (int64_t j = 0; j < count; j++) {
        const uint8_t *blk = b + j * 17;
        d[j] = e8m0_half(blk[0]);
        const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 1));
        const __m256i q = _mm256_set_m128i(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), m4)),
                                           _mm_shuffle_epi8(table, _mm_and_si128(v, m4)));
        even[j] = even_bytes(q);
        odd[j] = _mm256_srai_epi16(q, 8);
    }
    for (int64_t i = 0; i < X->M; i++) {
        const int64_t run = i * (X->K / 32) + k0 / 32;
        __m256 a0 = acc[i].a0, a1 = acc[i].a1;
        for (int64_t j = 0; j < count; j++) {
            const __m256 p = run_dot(even[j], odd[j], X, i, k0 + 32 * j);
            const __m256 scale = _mm256_set1_ps(d[j] * X->dx[run + j]);
            if (j & 1)
                a1 = _mm256_fmadd_ps(p, scale, a1);
            else
                a0 = _mm256_fmadd_ps(p, scale, a0);
        }
        acc[i].a0 = a0;
        acc[i].a1 = a1;
    }
}

/* MXFP4 against int8 activations, 8 blocks at a time: the doubled E2M1 values offset by 12 (one
 * byte shuffle per half, FP4_OFFSET: unsigned bytes 0..24), so each run of 32 is one u8 x s8
 * multiply-add with no sign juggling; the 12 comes off as a minimum (12 d times x's sum), the
 * eight blocks' scales and minimums taken at once. */
static const int8_t FP4_OFFSET[16] __attribute__((aligned(16))) = {12, 13, 14, 15, 16, 18, 20, 24,
                                                                  12, 11, 10, 9, 8, 6, 4, 0};

/* 2^(e - 128) for 8 E8M0 bytes (e8m0_half's value), in registers: a float built from the scalars
 * stored in an array and loaded as a vector stalled the loop on store forwarding. */
INLINE __m256 e8m0_half8(const uint8_t *b)
{
    const __m256i e = _mm256_setr_epi32(b[0], b[17], b[34], b[51], b[68], b[85], b[102], b[119]);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e); /* e < 2: subnormal */
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small));
}

#if GGUF_WIDE
/* Blocks 2 p and 2 p + 1 of a group of MXFP4 blocks as 64 bytes of ``table``'s values */
INLINE __m512i mxfp4_pair(const uint8_t *b, int p, const int8_t *table)
{
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)table)), pair_nibbles(b, p, 17, 1));
}

#endif

INLINE void mxfp4_direct8(const uint8_t *b, int64_t count, const XRows *X, int64_t k0, Acc *acc)
{
    const __m128i m4 = _mm_set1_epi8(15), table = _mm_load_si128((const __m128i *)FP4_OFFSET);
    __m256i u[GROUP];
    for (int64_t j = 0; j < count; j++) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(b + j * 17 + 1));
        u[j] = _mm256_set_m128i(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), m4)),
                                _mm_shuffle_epi8(table, _mm_and_si128(v, m4)));
    }
    const __m256 dv = count == GROUP ? e8m0_half8(b) : _mm256_setzero_ps();
    const __m256 mv = _mm256_mul_ps(_mm256_set1_ps(12.0f), dv);
    for (int64_t i = 0; i < X->M; i++) {
        const int64_t run = i * (X->K / 32) + k0 / 32;
        const int8_t *x = X->x8 + i * X->K + k0;
        __m256 a0 = acc[i].a0, a1 = acc[i].a1;
        if (count == GROUP) {
            const __m256 scale = _mm256_mul_ps(dv, _mm256_loadu_ps(X->dx + run));
            acc[i].m = _mm256_fmadd_ps(mv, _mm256_loadu_ps(X->s32 + run), acc[i].m);
#pragma GCC unroll 8
            for (int j = 0; j < GROUP; j++) {
                const __m256 p = _mm256_cvtepi32_ps(DOT_U8S8(u[j], load32(x + 32 * j)));
                const __m256 sj = _mm256_permutevar8x32_ps(scale, _mm256_set1_epi32(j));
                if (j & 1)
                    a1 = _mm256_fmadd_ps(p, sj, a1);
                else
                    a0 = _mm256_fmadd_ps(p, sj, a0);
            }
        } else {
            float mins = 0.0f;
            for (int64_t j = 0; j < count; j++) {
                const float d = e8m0_half(b[j * 17]);
                mins += 12.0f * d * X->s32[run + j];
                const __m256 p = _mm256_cvtepi32_ps(DOT_U8S8(u[j], load32(x + 32 * j)));
                if (j & 1)
                    a1 = _mm256_fmadd_ps(p, _mm256_set1_ps(d * X->dx[run + j]), a1);
                else
                    a0 = _mm256_fmadd_ps(p, _mm256_set1_ps(d * X->dx[run + j]), a0);
            }
            acc[i].m = _mm256_add_ps(acc[i].m, _mm256_castps128_ps256(_mm_set_ss(mins)));
        }
        acc[i].a0 = a0;
        acc[i].a1 = a1;
    }
}

#if GGUF_WIDE
/* A whole group of a 32-value legacy type (Q5_0, Q5_1, MXFP4) as group_row takes it: its values two
 * blocks a register (u), its scales (dv) and minimums (mv). */
INLINE void legacy_group(int type, const uint8_t *b, const int int8, __m512i *u, __m256 *dv, __m256 *mv)
{
    if (type != MXFP4) {
        q5_group_values(b, type == Q5_1, u, dv, mv);
        return;
    }
    for (int p = 0; p < GROUP / 2; p++)
        u[p] = mxfp4_pair(b, p, int8 ? FP4_OFFSET : FP4_DOUBLED);
    *dv = e8m0_half8(b);
    *mv = _mm256_mul_ps(_mm256_set1_ps(12.0f), *dv);
}

/* A weight row's first `groups` whole groups of such a type against rows i0 .. i0 + T of x, their runs
 * in pairs (x's too) and their sums in registers from the first group to the last, as k_rows keeps
 * them: through acc each group, they were a store-to-load chain (one thread, a decode row from L2:
 * MXFP4 9.2-9.5 -> 10.5 GB/s, Q5_0 13.3-14.7 -> 14.8-15.3, Q5_1 13.5-13.8 -> 14.8; two threads from
 * memory, MXFP4 16.3-17.0 -> 17.3). Each row's sums in the same order: the same bits. MXFP4's values
 * are signed (offset, with minimums, under int8 activations), Q5's unsigned with minimums. */
INLINE void legacy_rows_wide(int type, const uint8_t *row, int64_t groups, const XRows *X, int64_t i0, const int T,
                             Acc *acc, const int int8)
{
    const int bytes = type == MXFP4 ? 17 : type == Q5_1 ? 24 : 22, mxfp4 = type == MXFP4;
    __m512 a[TILE];
    __m256 m[TILE];
    for (int t = 0; t < T; t++)
        a[t] = pair_ps(acc[i0 + t].a0, acc[i0 + t].a1), m[t] = acc[i0 + t].m;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *b = row + g * GROUP * bytes;
        if (i0 == 0) /* the row's first tile of x: the later ones find it in cache */
            read_ahead(b, GROUP * bytes);
        __m512i u[GROUP / 2];
        __m256 dv, mv;
        legacy_group(type, b, int8, u, &dv, &mv);
        for (int t = 0; t < T; t++)
            group_row(u, dv, mv, mxfp4 ? int8 : 1, X, i0 + t, 32 * GROUP * g, &a[t], &m[t], int8, mxfp4);
    }
    for (int t = 0; t < T; t++)
        put_pair(a[t], &acc[i0 + t]), acc[i0 + t].m = m[t];
}

/* Every row of x, TILE at a time (each tile size its own code, so that the sums stay in registers). */
INLINE void legacy_wide_as(int type, const uint8_t *row, int64_t groups, const XRows *X, Acc *acc, const int int8)
{
    int64_t i = 0;
    for (; i + TILE <= X->M; i += TILE)
        legacy_rows_wide(type, row, groups, X, i, TILE, acc, int8);
    switch (X->M - i) {
    case 3: legacy_rows_wide(type, row, groups, X, i, 3, acc, int8); break;
    case 2: legacy_rows_wide(type, row, groups, X, i, 2, acc, int8); break;
    case 1: legacy_rows_wide(type, row, groups, X, i, 1, acc, int8); break;
    default: break;
    }
}
#endif

static void mxfp4_row(const uint8_t *row, int64_t blocks, const XRows *X, Acc *acc)
{
    int64_t j = 0;
#if GGUF_WIDE
    j = blocks / GROUP * GROUP; /* the whole groups first, the rest as below */
    if (j)
        X->x8 ? legacy_wide_as(MXFP4, row, j / GROUP, X, acc, 1) : legacy_wide_as(MXFP4, row, j / GROUP, X, acc, 0);
#endif
    for (; j < blocks; j += GROUP) {
        read_ahead(row + j * 17, GROUP * 17);
        if (X->x8)
            mxfp4_direct8(row + j * 17, MIN(GROUP, blocks - j), X, 32 * j, acc);
        else
            mxfp4_direct(row + j * 17, MIN(GROUP, blocks - j), X, 32 * j, acc);
    }
}

INLINE void q5_legacy_row(const uint8_t *row, int64_t blocks, int has_m, const XRows *X, Acc *acc, const int int8)
{
    const int bytes = has_m ? 24 : 22;
    int64_t j = 0;
#if GGUF_WIDE
    j = blocks / GROUP * GROUP; /* the whole groups first, the rest below */
    if (j)
        legacy_wide_as(has_m ? Q5_1 : Q5_0, row, j / GROUP, X, acc, int8);
#endif
    for (; j < blocks; j += GROUP) {
        read_ahead(row + j * bytes, GROUP * bytes);
        q5_legacy_direct(row + j * bytes, MIN(GROUP, blocks - j), has_m, X, 32 * j, acc, int8);
    }
}

static void q5_0_row(const uint8_t *row, int64_t blocks, const XRows *X, Acc *acc)
{
    if (X->x8)
        q5_legacy_row(row, blocks, 0, X, acc, 1);
    else
        q5_legacy_row(row, blocks, 0, X, acc, 0);
}

static void q5_1_row(const uint8_t *row, int64_t blocks, const XRows *X, Acc *acc)
{
    if (X->x8)
        q5_legacy_row(row, blocks, 1, X, acc, 1);
    else
        q5_legacy_row(row, blocks, 1, X, acc, 0);
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
    case Q3_K: return q3_k_row;
    case Q2_K: return q2_k_row;
    case Q5_0: return q5_0_row;
    case Q5_1: return q5_1_row;
    case MXFP4: return mxfp4_row;
    default: return NULL;
    }
}
#else
INLINE int64_t x_index(int64_t v, int64_t K)
{
    (void)K;
    return v;
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

/* y[k] = the float16 value at row + 2 k, k < K: 8 at a time in hardware where the CPU has F16C
 * (the same values: the conversion is exact). */
INLINE void f16_row(const uint8_t *row, int64_t K, float *restrict y)
{
    int64_t k = 0;
#if defined(__F16C__)
    for (; k + 8 <= K; k += 8)
        _mm256_storeu_ps(y + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * k))));
#endif
    for (; k < K; k++)
        y[k] = f16(row + 2 * k);
}
