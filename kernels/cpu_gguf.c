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
 * int8) and take integer dot products per sub-block, the block unpacked once for every row
 * (the scales applied once per sub-block); with EXACT, or for F16 / BF16, weight
 * rows are decoded to float32 into a per-thread buffer and dotted with x instead. Larger
 * batches decode a panel of rows here and multiply it with torch's GEMM (cpu_gguf.py).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu_common.h" /* INLINE, MIN, tree_sum */

/* ggml's type ids (GGMLQuantizationType) */
enum { F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
       Q6_K = 14, BF16 = 30 };
enum { ACCUMULATE = 1, EXACT = 2 }; /* flags of trillm_gguf_matmul; EXACT: float activations */

#define ROWS 8 /* weight rows decoded at once by the matmul */
#define MAX_INT_ROWS 8 /* rows of x up to which activations go to int16 */
#define PARALLEL_MIN_WORK (1 << 18)

INLINE float f16(const uint8_t *p)
{
    const uint16_t h = (uint16_t)(p[0] | p[1] << 8);
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
}

INLINE float bf16(const uint8_t *p)
{
    const uint32_t bits = (uint32_t)(p[0] | p[1] << 8) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- one block each, unpacked: quants as int8 and per sub-block w = dl * q - ml ---- */

/* A block's values are w = dl[s] * q - ml[s] for sub-block s (ml 0 where the type has no
 * minimum: x - 0 is x, so the rounding is the reference's). Every type's quants fit int8. */
typedef struct {
    int subs, n; /* sub-blocks, values in each: subs * n values */
    float dl[16], ml[16];
    int8_t q[256];
} Unpacked;

INLINE uint32_t u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

INLINE void one_scale(Unpacked *U, int s, float d, float m) /* legacy types: block s of a group */
{
    U->dl[s] = d;
    U->ml[s] = m;
}

static void q4_0(const uint8_t *b, Unpacked *U, int s)
{
    const uint8_t *qs = b + 2;
    int8_t *q = U->q + 32 * s;
    one_scale(U, s, f16(b), 0.0f);
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)((qs[j] & 15) - 8);
        q[j + 16] = (int8_t)((qs[j] >> 4) - 8);
    }
}

static void q4_1(const uint8_t *b, Unpacked *U, int s)
{
    const uint8_t *qs = b + 4;
    int8_t *q = U->q + 32 * s;
    one_scale(U, s, f16(b), -f16(b + 2)); /* d q + m as d q - (-m): the same float */
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)(qs[j] & 15);
        q[j + 16] = (int8_t)(qs[j] >> 4);
    }
}

/* Q5_0 / Q5_1: value j's fifth bit is bit j of qh. */
INLINE void five_bit(const uint8_t *qh_bytes, const uint8_t *qs, int offset, int8_t *restrict q)
{
    const uint32_t qh = u32(qh_bytes);
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)(((qs[j] & 15) | (int)((qh >> j) & 1) << 4) - offset);
        q[j + 16] = (int8_t)(((qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4) - offset);
    }
}

static void q5_0(const uint8_t *b, Unpacked *U, int s)
{
    one_scale(U, s, f16(b), 0.0f);
    five_bit(b + 2, b + 6, 16, U->q + 32 * s);
}

static void q5_1(const uint8_t *b, Unpacked *U, int s)
{
    one_scale(U, s, f16(b), -f16(b + 2));
    five_bit(b + 4, b + 8, 0, U->q + 32 * s);
}

static void q8_0(const uint8_t *b, Unpacked *U, int s)
{
    one_scale(U, s, f16(b), 0.0f);
    memcpy(U->q + 32 * s, b + 2, 32);
}

/* The k-quants: each run of 32 quants reads contiguous bytes with one shift (vectorised). */

/* Q2_K and Q3_K's 2-bit quants: value 128 g + 32 j + l is byte 32 g + l of qs, bits 2 j. */
INLINE void two_bit(const uint8_t *restrict qs, int8_t *restrict q)
{
    for (int g = 0; g < 2; g++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                q[128 * g + 32 * j + l] = (int8_t)((qs[32 * g + l] >> (2 * j)) & 3);
}

static void q2_k(const uint8_t *b, Unpacked *U, int slot) /* slot: legacy blocks only */
{
    const uint8_t *scales = b;
    const float d = f16(b + 80), dmin = f16(b + 82);
    U->subs = 16;
    U->n = 16;
    two_bit(b + 16, U->q);
    for (int s = 0; s < 16; s++) {
        U->dl[s] = d * (float)(scales[s] & 15);
        U->ml[s] = dmin * (float)(scales[s] >> 4);
    }
}

static void q3_k(const uint8_t *b, Unpacked *U, int slot) /* slot: legacy blocks only */
{
    const uint8_t *hmask = b, *sc = b + 96;
    const float d = f16(b + 108);
    U->subs = 16;
    U->n = 16;
    two_bit(b + 32, U->q);
    for (int v0 = 0; v0 < 256; v0 += 32) /* the high bit of value v is bit v / 32 of hmask[v % 32]; 0 takes 4 off */
        for (int l = 0; l < 32; l++)
            U->q[v0 + l] = (int8_t)(U->q[v0 + l] - 4 + 4 * ((hmask[l] >> (v0 / 32)) & 1));
    for (int s = 0; s < 16; s++) {
        const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4;
        const int high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        U->dl[s] = d * (float)((low | high << 4) - 32);
        U->ml[s] = 0.0f;
    }
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
        for (int l = 0; l < 32; l++) {
            U->q[64 * g + l] = (int8_t)(qs[32 * g + l] & 15);
            U->q[64 * g + 32 + l] = (int8_t)(qs[32 * g + l] >> 4);
        }
}

static void q4_k(const uint8_t *b, Unpacked *U, int slot) /* slot: legacy blocks only */
{
    k4_common(b, b + 16, U);
}

static void q5_k(const uint8_t *b, Unpacked *U, int slot) /* slot: legacy blocks only */
{
    const uint8_t *qh = b + 16;
    k4_common(b, b + 48, U);
    for (int s = 0; s < 8; s++) /* the fifth bit of value 32 s + l is bit s of qh[l] */
        for (int l = 0; l < 32; l++)
            U->q[32 * s + l] = (int8_t)(U->q[32 * s + l] | ((qh[l] >> s) & 1) << 4);
}

static void q6_k(const uint8_t *b, Unpacked *U, int slot) /* slot: legacy blocks only */
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
    U->subs = 16;
    U->n = 16;
    for (int h = 0; h < 2; h++) /* value 128 h + 32 j + l: nibble j / 2 of ql[64 h + 32 (j % 2) + l], bits 2 j of qh[32 h + l] */
        for (int l = 0; l < 32; l++) {
            const uint8_t *lo = ql + 64 * h, *hi = qh + 32 * h;
            int8_t *o = U->q + 128 * h;
            o[l] = (int8_t)(((lo[l] & 15) | (hi[l] & 3) << 4) - 32);
            o[32 + l] = (int8_t)(((lo[32 + l] & 15) | ((hi[l] >> 2) & 3) << 4) - 32);
            o[64 + l] = (int8_t)(((lo[l] >> 4) | ((hi[l] >> 4) & 3) << 4) - 32);
            o[96 + l] = (int8_t)(((lo[32 + l] >> 4) | ((hi[l] >> 6) & 3) << 4) - 32);
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
} BlockType;

#define GROUP 8 /* legacy blocks unpacked together: 256 values, as one k-quant block */

/* The values from ``b`` on, up to 256: one k-quant block, or ``blocks`` (<= GROUP) legacy ones.
 * Returns how many blocks it took. */
static int unpack(BlockType bt, const uint8_t *b, int64_t blocks, Unpacked *U)
{
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
    case Q4_0: return (BlockType){q4_0, 32, 18};
    case Q4_1: return (BlockType){q4_1, 32, 20};
    case Q5_0: return (BlockType){q5_0, 32, 22};
    case Q5_1: return (BlockType){q5_1, 32, 24};
    case Q8_0: return (BlockType){q8_0, 32, 34};
    case Q2_K: return (BlockType){q2_k, 256, 84};
    case Q3_K: return (BlockType){q3_k, 256, 110};
    case Q4_K: return (BlockType){q4_k, 256, 144};
    case Q5_K: return (BlockType){q5_k, 256, 176};
    case Q6_K: return (BlockType){q6_k, 256, 210};
    default: return (BlockType){NULL, 0, 0};
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
 * sums of x over each 16 values, which the minimums multiply. int16 rather than llama.cpp's int8
 * activations: the same speed here (the compiler widens int8 products to 16 bits either way)
 * and 256x finer: at int8 a Q4_K_M-style SmolLM2 lost 2.7 % of greedy tokens to transformers. */
static void quantize_x(const float *x, int64_t ldx, int64_t M, int64_t K, int16_t *xq, float *dx, float *xs)
{
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < K / 32; b++) {
            const float *v = x + i * ldx + 32 * b;
            float amax = 0.0f, s0 = 0.0f, s1 = 0.0f;
            for (int l = 0; l < 32; l++) {
                const float a = v[l] < 0.0f ? -v[l] : v[l];
                amax = a > amax ? a : amax;
            }
            for (int l = 0; l < 16; l++) {
                s0 += v[l];
                s1 += v[16 + l];
            }
            const float d = amax / 32767.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            int16_t *q = xq + i * K + 32 * b;
            for (int l = 0; l < 32; l++) {
                const float t = v[l] * id;
                q[l] = (int16_t)(int)(t + (t >= 0.0f ? 0.5f : -0.5f));
            }
            dx[i * (K / 32) + b] = d;
            xs[i * (K / 16) + 2 * b] = s0;
            xs[i * (K / 16) + 2 * b + 1] = s1;
        }
}

/* out[M, rows n0..n1) (+)= x . W^T with x in int16 (quantize_x): per sub-block an integer sum of
 * q * xq (|q| <= 128, |xq| <= 32767: 256 products fit int32), then dl * dx * sum - ml * sum(x).
 * The block is unpacked once for all rows of x. */
static void rows_int(BlockType bt, const uint8_t *w, int64_t row_bytes, int64_t K, const int16_t *xq, const float *dx,
                      const float *xs, float *out, int64_t ldo, int64_t M, int64_t n0, int64_t n1, int accumulate)
{
    const int64_t nbx = K / 32, nbs = K / 16;
    Unpacked U;
    for (int64_t n = n0; n < n1; n++) {
        float acc[MAX_INT_ROWS] = {0};
        const uint8_t *row = w + n * row_bytes;
        for (int64_t k0 = 0; k0 < K;) {
            const int taken = unpack(bt, row, (K - k0) / bt.values, &U);
            for (int64_t i = 0; i < M; i++) {
                const int16_t *xb = xq + i * K + k0;
                const float *d = dx + i * nbx + k0 / 32, *sums = xs + i * nbs + k0 / 16;
                /* Sub-blocks of 16: 16 lanes of float partial sums, each product exact in float
                 * (|q xq| < 2^23), so no horizontal sum per sub-block, one tree per block. */
                float part[16] = {0}, mins = 0.0f;
                if (U.n == 16) {
                    for (int s = 0; s < U.subs; s++) {
                        const float sc = U.dl[s] * d[s / 2];
                        for (int l = 0; l < 16; l++)
                            part[l] += sc * (float)((int32_t)U.q[16 * s + l] * xb[16 * s + l]);
                        mins += U.ml[s] * sums[s];
                    }
                } else { /* sub-blocks of 32: an integer sum each is cheaper (measured) */
                    for (int s = 0; s < U.subs; s++) {
                        int32_t sum = 0;
                        for (int l = 0; l < 32; l++)
                            sum += (int32_t)U.q[32 * s + l] * xb[32 * s + l];
                        part[s] = U.dl[s] * d[s] * (float)sum; /* subs <= 8 < 16 lanes */
                        mins += U.ml[s] * (sums[2 * s] + sums[2 * s + 1]);
                    }
                }
                const float a = tree_sum(part, 16) - mins;
                acc[i] += a;
            }
            k0 += (int64_t)taken * bt.values;
            row += taken * bt.bytes;
        }
        for (int64_t i = 0; i < M; i++) {
            float *o = out + i * ldo + n;
            *o = accumulate ? *o + acc[i] : acc[i];
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
        float *dx = malloc(sizeof(float) * (size_t)(M * (K / 32) + M * (K / 16)));
        if (!xq || !dx) {
            free(xq);
            free(dx);
            return 1;
        }
        float *xs = dx + M * (K / 32);
        quantize_x(x, ldx, M, K, xq, dx, xs);
#pragma omp parallel num_threads(num_threads) if (units > 1 && N * K * (M + 4) >= PARALLEL_MIN_WORK)
        {
            const int t = omp_get_thread_num(), T = omp_get_num_threads();
            const int64_t u0 = units * t / T, u1 = units * (t + 1) / T;
            if (u1 > u0)
                rows_int(bt, w, row_bytes, K, xq, dx, xs, out, ldo, M, u0 * ROWS, MIN(u1 * ROWS, N), accumulate);
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
