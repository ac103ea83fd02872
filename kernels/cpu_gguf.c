/* GGUF weights in the blocks the file holds them in: decoders and a matmul.
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
 * The matmul decodes a few weight rows into a per-thread buffer and takes their dot
 * products with every row of x: for decode-sized batches. Larger batches decode a panel
 * of rows here and multiply it with torch's GEMM (cpu_gguf.py).
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
enum { ACCUMULATE = 1 };

#define ROWS 8 /* weight rows decoded at once by the matmul */
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

/* ---- one block each ---- */

static void q4_0(const uint8_t *b, float *restrict y)
{
    const float d = f16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((qs[j] & 15) - 8);
        y[j + 16] = d * (float)((qs[j] >> 4) - 8);
    }
}

static void q4_1(const uint8_t *b, float *restrict y)
{
    const float d = f16(b), m = f16(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(qs[j] & 15) + m;
        y[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
}

INLINE uint32_t u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void q5_0(const uint8_t *b, float *restrict y)
{
    const float d = f16(b);
    const uint32_t qh = u32(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        const int low = (qs[j] & 15) | (int)((qh >> j) & 1) << 4; /* int: qh is unsigned */
        const int high = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        y[j] = d * (float)(low - 16);
        y[j + 16] = d * (float)(high - 16);
    }
}

static void q5_1(const uint8_t *b, float *restrict y)
{
    const float d = f16(b), m = f16(b + 2);
    const uint32_t qh = u32(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((qs[j] & 15) | ((qh >> j) & 1) << 4) + m;
        y[j + 16] = d * (float)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) + m;
    }
}

static void q8_0(const uint8_t *b, float *restrict y)
{
    const float d = f16(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++)
        y[j] = d * (float)qs[j];
}

/* The k-quants in two passes the compiler vectorises: the quants of the 256 values into
 * bytes (each run of 32 reads contiguous bytes with one shift), then per sub-block the
 * scale (and minimum) applied, rounding as the reference does. */

/* y[s * n + l] = dl[s] * t[s * n + l] - ml[s] (ml NULL: no minimum) for sub-blocks of n. */
INLINE void scale_u8(const uint8_t *restrict t, const float *dl, const float *ml, int subs, int n, float *restrict y)
{
    for (int s = 0; s < subs; s++)
        for (int l = 0; l < n; l++)
            y[s * n + l] = dl[s] * (float)t[s * n + l] - ml[s];
}

INLINE void scale_i8(const int8_t *restrict t, const float *dl, int subs, int n, float *restrict y)
{
    for (int s = 0; s < subs; s++)
        for (int l = 0; l < n; l++)
            y[s * n + l] = dl[s] * (float)t[s * n + l];
}

/* Q2_K and Q3_K's 2-bit quants: value 128 g + 32 j + l is byte 32 g + l of qs, bits 2 j. */
INLINE void two_bit(const uint8_t *restrict qs, uint8_t *restrict t)
{
    for (int g = 0; g < 2; g++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                t[128 * g + 32 * j + l] = (qs[32 * g + l] >> (2 * j)) & 3;
}

static void q2_k(const uint8_t *b, float *restrict y)
{
    const uint8_t *scales = b;
    const float d = f16(b + 80), dmin = f16(b + 82);
    uint8_t t[256];
    float dl[16], ml[16];
    two_bit(b + 16, t);
    for (int s = 0; s < 16; s++) {
        dl[s] = d * (float)(scales[s] & 15);
        ml[s] = dmin * (float)(scales[s] >> 4);
    }
    scale_u8(t, dl, ml, 16, 16, y);
}

static void q3_k(const uint8_t *b, float *restrict y)
{
    const uint8_t *hmask = b, *sc = b + 96;
    const float d = f16(b + 108);
    uint8_t u[256];
    int8_t t[256];
    float dl[16];
    two_bit(b + 32, u);
    for (int v0 = 0; v0 < 256; v0 += 32) /* the high bit of value v is bit v / 32 of hmask[v % 32]; 0 takes 4 off */
        for (int l = 0; l < 32; l++)
            t[v0 + l] = (int8_t)(u[v0 + l] - 4 + 4 * ((hmask[l] >> (v0 / 32)) & 1));
    for (int s = 0; s < 16; s++) {
        const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4;
        const int high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        dl[s] = d * (float)((low | high << 4) - 32);
    }
    scale_i8(t, dl, 16, 16, y);
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
INLINE void k4_common(const uint8_t *b, const uint8_t *qs, uint8_t *restrict t, float *dl, float *ml)
{
    const float d = f16(b), dmin = f16(b + 2);
    for (int s = 0; s < 8; s++) {
        int sc, mn;
        scale_min_k4(b + 4, s, &sc, &mn);
        dl[s] = d * (float)sc;
        ml[s] = dmin * (float)mn;
    }
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 32; l++) {
            t[64 * g + l] = qs[32 * g + l] & 15;
            t[64 * g + 32 + l] = qs[32 * g + l] >> 4;
        }
}

static void q4_k(const uint8_t *b, float *restrict y)
{
    uint8_t t[256];
    float dl[8], ml[8];
    k4_common(b, b + 16, t, dl, ml);
    scale_u8(t, dl, ml, 8, 32, y);
}

static void q5_k(const uint8_t *b, float *restrict y)
{
    const uint8_t *qh = b + 16;
    uint8_t t[256];
    float dl[8], ml[8];
    k4_common(b, b + 48, t, dl, ml);
    for (int s = 0; s < 8; s++) /* the fifth bit of value 32 s + l is bit s of qh[l] */
        for (int l = 0; l < 32; l++)
            t[32 * s + l] |= ((qh[l] >> s) & 1) << 4;
    scale_u8(t, dl, ml, 8, 32, y);
}

static void q6_k(const uint8_t *b, float *restrict y)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
    int8_t t[256];
    float dl[16];
    for (int h = 0; h < 2; h++) /* value 128 h + 32 j + l: nibble j / 2 of ql[64 h + 32 (j % 2) + l], bits 2 j of qh[32 h + l] */
        for (int l = 0; l < 32; l++) {
            const uint8_t *lo = ql + 64 * h, *hi = qh + 32 * h;
            int8_t *o = t + 128 * h;
            o[l] = (int8_t)(((lo[l] & 15) | (hi[l] & 3) << 4) - 32);
            o[32 + l] = (int8_t)(((lo[32 + l] & 15) | ((hi[l] >> 2) & 3) << 4) - 32);
            o[64 + l] = (int8_t)(((lo[l] >> 4) | ((hi[l] >> 4) & 3) << 4) - 32);
            o[96 + l] = (int8_t)(((lo[32 + l] >> 4) | ((hi[l] >> 6) & 3) << 4) - 32);
        }
    for (int s = 0; s < 16; s++)
        dl[s] = d * (float)scales[s];
    scale_i8(t, dl, 16, 16, y);
}

typedef void (*BlockDecoder)(const uint8_t *, float *restrict);

typedef struct {
    BlockDecoder decode;
    int values, bytes; /* per block */
} BlockType;

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
        for (int64_t k = 0; k < K; k += bt.values, row += bt.bytes)
            bt.decode(row, y + k);
    }
}

static int known(int type, BlockType bt)
{
    return type == F16 || type == BF16 || bt.decode != NULL;
}

static float *scratch(size_t floats)
{
    static __thread float *buf;
    static __thread size_t cap;
    if (floats > cap) {
        free(buf);
        cap = 0;
        if (posix_memalign((void **)&buf, 64, floats * sizeof(float)))
            return buf = NULL;
        cap = floats;
    }
    return buf;
}

/* a . b with 16 partial sums added as a tree (K % 16 == 0 for every type: blocks of 32 or 256,
 * and F16 / BF16 rows the caller pads). */
static float dot(const float *restrict a, const float *restrict b, int64_t K)
{
    float part[16] = {0};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
        for (int l = 0; l < 16; l++)
            part[l] += a[k + l] * b[k + l];
    for (int l = 0; k < K; k++, l++)
        part[l] += a[k] * b[k];
    return tree_sum(part, 16);
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
                const float s = dot(x + i * ldx, buf + j * K, K);
                float *o = out + i * ldo + n + j;
                *o = accumulate ? *o + s : s;
            }
    }
    return 0;
}

int trillm_gguf_known(int type)
{
    return known(type, block_type(type));
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
