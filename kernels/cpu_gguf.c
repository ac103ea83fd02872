/* GGUF weights in the blocks the file holds them in: decoders and a matmul.
 *
 * Longer than our ~400-line guide on purpose: one unpacker per type and the three paths
 * that share them (decode to float32, integer dot products, panels); split, a type's
 * layout and the paths that read it would be in two places. What differs by instruction set
 * (AVX2 / VNNI / plain C) is the one section in cpu_gguf_isa.h.
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
 * Decode-sized batches (up to 48 rows of x) quantize x to int16 per 32 values, or with INT8 to
 * int8 as llama.cpp does (on SIMD builds one byte multiply-add per 32 products instead of two
 * int16 ones and the weights' unpacking into int16 lanes: measured 1.05-1.2x the blocks per second
 * at one row on AVX2, where the float scale per 32 products stays; 256x coarser), and take integer
 * dot products per sub-block, the scales applied once per sub-block; the
 * k-quants, Q5_0 and Q5_1 have kernels of their own that read their blocks directly (on SIMD
 * builds), the other types are unpacked to int8 once for every row of x. With EXACT, or for F16 / BF16,
 * weight rows are decoded to float32 into a per-thread buffer and dotted with x instead. Larger
 * batches decode a panel of rows here and multiply it with torch's GEMM (cpu_gguf.py).
 *
 */
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu_common.h" /* INLINE, MIN, tree_sum */
#include "cpu_gguf_blocks.h" /* the type ids, Unpacked, u32: shared with the ISA section */

enum { ACCUMULATE = 1, EXACT = 2, INT8 = 4 }; /* flags of trillm_gguf_matmul; EXACT: float activations, INT8: int8 ones */

#define ROWS 8 /* weight rows decoded at once by the matmul */
#define MAX_INT_ROWS 48 /* rows of x up to which activations go to int16 */
#define PARALLEL_MIN_WORK (1 << 18)
#define PREFETCH_ROWS 4 /* the integer path asks for the weight row this far ahead (measured: +3-5 % at one row) */

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

#include "cpu_gguf_isa.h" /* everything that differs by instruction set */


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

/* Q5_0 / Q5_1: value j's fifth bit is bit j of qh. With SIMD the 32 quants are made in one register and
 * stored once (two 16-byte stores read back as one 32-byte load stall store forwarding: the unpack was
 * ~8 % of a Gemma 3 decode step on AMX tiles). */
INLINE void five_bit32(const uint8_t *qs, uint32_t qh, int offset, int8_t *q)
{
#if GGUF_SIMD
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(15);
    const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
    store32(q, _mm256_sub_epi8(_mm256_add_epi8(nibbles, fifth_bits(qh)), _mm256_set1_epi8((char)offset)));
#else
    nibbles16(qs, offset, q);
    add_fifth_bits(qh, q);
#endif
}

static void q5_0(const uint8_t *b, Unpacked *U, int s)
{
    one_scale(U, s, f16(b), 0.0f);
    five_bit32(b + 6, u32(b + 2), 16, U->q + 32 * s);
}

static void q5_1(const uint8_t *b, Unpacked *U, int s)
{
    one_scale(U, s, f16(b), -f16(b + 2));
    five_bit32(b + 8, u32(b + 4), 0, U->q + 32 * s);
}

static void q8_0(const uint8_t *b, Unpacked *U, int s)
{
    one_scale(U, s, f16(b), 0.0f);
    memcpy(U->q + 32 * s, b + 2, 32);
}

/* MXFP4 (gpt-oss's experts; FP4_DOUBLED and e8m0_half in cpu_gguf_isa.h). */
static void mxfp4(const uint8_t *b, Unpacked *U, int s)
{
    one_scale(U, s, e8m0_half(b[0]), 0.0f);
    nibbles16_table(b + 1, FP4_DOUBLED, U->q + 32 * s);
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
    case MXFP4: return (BlockType){mxfp4, 32, 17, 0};
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
        f16_row(row, K, y);
    } else if (type == BF16) {
        for (int64_t k = 0; k < K; k++) { /* 16-bit loads and shifts: the compiler vectorizes these */
            uint16_t h;
            memcpy(&h, row + 2 * k, 2);
            const uint32_t bits = (uint32_t)h << 16;
            memcpy(y + k, &bits, 4);
        }
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

/* int16 activations' largest magnitude: 255 * 128 - 1, so that each value is 256 hi + lo with hi and lo
 * signed bytes (the wide kernels' byte planes) */
#define INT16_LEVELS 32639.0f

/* The int8 copies of x quantize_x writes per value: int8 activations' x8 (1), int16 ones as two signed
 * bytes for the wide kernels (2), or none */
static int64_t byte_planes(int int8)
{
    return int8 ? 1 : GGUF_WIDE ? 2 : 0;
}

/* x [M, K] per 32 values: xq = round(x / dx), dx = max |x| / levels (half away from zero), levels
 * INT16_LEVELS or, for int8 activations, 127 (then also x8: the same values as int8, in their order); and the
 * sums over each 16 and each 32 values, which the minimums (and the offsets of Q3_K, Q5_0, Q6_K) multiply,
 * taken of the quantized values (dx times their exact integer sum): so a product's error is the
 * weight times x's rounding, as for the types without a minimum. int16 rather than llama.cpp's
 * int8 activations: 256x finer; with int8 SmolLM2 in Q4_K_M agreed with transformers on 94.6 % of
 * next tokens (mean |delta logprob| 0.078), with int16 on 100 % (0.0003). */
static void quantize_x(const float *x, int64_t ldx, int64_t M, int64_t K, float levels, int16_t *xq, int8_t *x8,
                       int8_t *xh, float *dx, float *s16, float *s32)
{
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < K / 32; b++) {
            const float *v = x + i * ldx + 32 * b;
#if GGUF_SIMD
            const float amax = run_amax(v);
#else
            float amax = 0.0f;
            for (int l = 0; l < 32; l++) {
                const float a = v[l] < 0.0f ? -v[l] : v[l];
                amax = a > amax ? a : amax;
            }
#endif
            const float d = amax / levels, id = d > 0.0f ? 1.0f / d : 0.0f;
            int16_t *q = xq + i * K;
            int32_t n0 = 0, n1 = 0; /* the sums of the quantized values, exact */
#if GGUF_SIMD
            quantize_run(v, id, q, x_index(32 * b, K), x_index(32 * b + 1, K), x8 ? x8 + i * K + 32 * b : NULL,
                         xh ? xh + i * K + 32 * b : NULL, M * K, &n0, &n1);
#else
            for (int l = 0; l < 32; l++) {
                const float t = v[l] * id;
                const int16_t r = (int16_t)(int)(t + (t >= 0.0f ? 0.5f : -0.5f));
                q[x_index(32 * b + l, K)] = r;
                if (x8)
                    x8[i * K + 32 * b + l] = (int8_t)r;
                (void)xh; /* the byte planes are the wide kernels' (SIMD builds) */
                if (l < 16)
                    n0 += r;
                else
                    n1 += r;
            }
#endif
            const float h0 = d * (float)n0, h1 = d * (float)n1;
            dx[i * (K / 32) + b] = d;
            s16[i * (K / 16) + 2 * b] = h0;
            s16[i * (K / 16) + 2 * b + 1] = h1;
            s32[i * (K / 32) + b] = d * (float)(n0 + n1);
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
#if defined(__AVX2__)
        if (!direct && n + PREFETCH_ROWS < n1) /* the direct kernels read ahead themselves (read_ahead) */
            for (int64_t c = 0; c < row_bytes; c += 64)
                _mm_prefetch((const char *)(row + PREFETCH_ROWS * row_bytes + c), _MM_HINT_T0);
#endif
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

/* A thread's share of a matmul's units, [lo, hi) packed in one word: it takes CHUNK_UNITS at a time
 * from the front, and a thread done with its own takes from the back of another's. On two cores of a
 * VM one thread often lags (the memory, the host): an even split kept the other spinning at the join
 * (libgomp's wait, 6-7 % of an 8B one-stream profile). */
typedef struct {
    _Atomic uint64_t range;
} Share;

#define MAX_SHARES 64
#define CHUNK_UNITS 4 /* 32 rows: a few hundred microseconds at 8B sizes, whole rows of prefetched lines */

static void share_init(Share *s, int64_t lo, int64_t hi)
{
    atomic_store_explicit(&s->range, (uint64_t)hi << 32 | (uint64_t)lo, memory_order_relaxed);
}

/* units split into equal shares, one a thread (num_threads of them, within 1 .. MAX_SHARES): how many */
static int shares_of(Share *share, int num_threads, int64_t units)
{
    const int shares = num_threads < 1 ? 1 : num_threads < MAX_SHARES ? num_threads : MAX_SHARES;
    for (int s = 0; s < shares; s++)
        share_init(&share[s], units * s / shares, units * (s + 1) / shares);
    return shares;
}

/* A chunk of share s, from the front (own) or the back (another's): 1 and [*u0, *u1), or 0 if none is left. */
static int take_from(Share *s, int front, int64_t *u0, int64_t *u1)
{
    uint64_t old = atomic_load_explicit(&s->range, memory_order_relaxed);
    for (;;) {
        const uint64_t lo = old & 0xffffffffu, hi = old >> 32;
        if (lo >= hi)
            return 0;
        const uint64_t n = hi - lo < CHUNK_UNITS ? hi - lo : CHUNK_UNITS;
        const uint64_t next = front ? hi << 32 | (lo + n) : (hi - n) << 32 | lo;
        if (atomic_compare_exchange_weak_explicit(&s->range, &old, next, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *u0 = (int64_t)(front ? lo : hi - n);
            *u1 = *u0 + (int64_t)n;
            return 1;
        }
    }
}

/* The next chunk for thread t of a team over ``shares`` shares (a team smaller than asked for takes
 * the missing threads' shares from their backs). */
static int take(Share *share, int shares, int t, int64_t *u0, int64_t *u1)
{
    if (t < shares && take_from(&share[t], 1, u0, u1))
        return 1;
    for (int k = 1; k <= shares; k++)
        if (take_from(&share[(t + k) % shares], 0, u0, u1))
            return 1;
    return 0;
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
        const int int8 = (flags & INT8) != 0;
        int16_t *xq = malloc(sizeof(int16_t) * (size_t)(M * K) + (size_t)(M * K * byte_planes(int8)));
        float *dx = malloc(sizeof(float) * (size_t)(2 * M * (K / 32) + M * (K / 16)));
        if (!xq || !dx) {
            free(xq);
            free(dx);
            return 1;
        }
        float *s16 = dx + M * (K / 32), *s32 = s16 + M * (K / 16);
        int8_t *x8 = int8 ? (int8_t *)(xq + M * K) : NULL, *xh = byte_planes(int8) == 2 ? (int8_t *)(xq + M * K) : NULL;
        quantize_x(x, ldx, M, K, int8 ? 127.0f : INT16_LEVELS, xq, x8, xh, dx, s16, s32);
        const XRows X = {xq, x8, xh, xh ? xh + M * K : NULL, dx, s16, s32, M, K};
        const DirectKernel direct = direct_kernel(type);
        Share share[MAX_SHARES];
        const int shares = shares_of(share, num_threads, units);
#pragma omp parallel num_threads(shares) if (units > 1 && N * K * (M + 4) >= PARALLEL_MIN_WORK)
        {
            int64_t u0, u1;
            while (take(share, shares, omp_get_thread_num(), &u0, &u1))
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

/* G matrices of one type and shape at once (a mixture's chosen experts), integer path only (flags: INT8 or 0):
 * out[:, g] = x_g . W_g^T for g < G, W_g at ws[g] ([N, K] rows of row_bytes), x_g at
 * x + g * x_step (x_step 0: one x for every group, quantized once), out_g at out + g * out_step.
 * One parallel region over every group's rows: at one token, 16 small matrices cost one
 * thread start instead of 16. Returns 0; 1 when a buffer could not be allocated; 2 for a type
 * without the int16 path or more rows than it takes (the caller multiplies one by one). */
int trillm_gguf_matmul_grouped(const float *x, int64_t ldx, int64_t x_step, int type, const uint8_t *const *ws,
                               int64_t G, int64_t row_bytes, int64_t N, int64_t K, float *out, int64_t ldo,
                               int64_t out_step, int64_t M, int flags, int num_threads)
{
    const BlockType bt = block_type(type);
    if (!known(type, bt) || !bt.unpack || M > MAX_INT_ROWS)
        return 2;
    if (G <= 0 || M <= 0 || N <= 0)
        return 0;
    const int int8 = (flags & INT8) != 0;
    const int64_t xs = x_step ? G : 1, per = M * K, scales = 2 * M * (K / 32) + M * (K / 16);
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)(xs * per) + (size_t)(xs * per * byte_planes(int8)));
    float *dx = malloc(sizeof(float) * (size_t)(xs * scales));
    XRows *X = malloc(sizeof(XRows) * (size_t)xs);
    if (!xq || !dx || !X) {
        free(xq), free(dx), free(X);
        return 1;
    }
    for (int64_t g = 0; g < xs; g++) {
        float *d = dx + g * scales, *s16 = d + M * (K / 32), *s32 = s16 + M * (K / 16);
        int8_t *x8 = int8 ? (int8_t *)(xq + xs * per) + g * per : NULL;
        int8_t *xh = byte_planes(int8) == 2 ? (int8_t *)(xq + xs * per) + 2 * g * per : NULL;
        quantize_x(x + g * x_step, ldx, M, K, int8 ? 127.0f : INT16_LEVELS, xq + g * per, x8, xh, d, s16, s32);
        X[g] = (XRows){xq + g * per, x8, xh, xh ? xh + per : NULL, d, s16, s32, M, K};
    }
    const DirectKernel direct = direct_kernel(type);
    const int64_t units = (N + ROWS - 1) / ROWS, tasks = G * units; /* a task: ROWS rows of one weight */
    Share share[MAX_SHARES]; /* as trillm_gguf_matmul's: a thread done early takes chunks of the others' */
    const int shares = shares_of(share, num_threads, tasks);
#pragma omp parallel num_threads(shares) if (tasks > 1 && G * N * K * (M + 4) >= PARALLEL_MIN_WORK)
    {
        int64_t t0, t1;
        while (take(share, shares, omp_get_thread_num(), &t0, &t1))
            for (int64_t task = t0; task < t1;) {
                const int64_t g = task / units, u0 = task % units, u1 = MIN(units, u0 + t1 - task);
                rows_int(bt, direct, ws[g], row_bytes, &X[x_step ? g : 0], out + g * out_step, ldo, u0 * ROWS,
                         MIN(u1 * ROWS, N), 0);
                task += u1 - u0;
            }
    }
    free(xq), free(dx), free(X);
    return 0;
}

/* What the fused decode loop (cpu_forward.c) holds of a weight: the matmul's arguments. */
typedef struct {
    int64_t type;
    const uint8_t *w;
    int64_t row_bytes, N, K, flags; /* flags: INT8 or 0, the weight's activations */
} GGUFLayout;

/* trillm_gguf_matmul with cpu_matmul's signature (a layout, the flags), for cpu_forward.c's loop;
 * 2 when a buffer could not be allocated (that loop's code for it). */
int trillm_gguf_layout_matmul(const float *x, int64_t ldx, const void *layout, float *out, int64_t ldo, int64_t M,
                              int flags, int num_threads)
{
    const GGUFLayout *L = layout;
    const int rc = trillm_gguf_matmul(x, ldx, (int)L->type, L->w, L->row_bytes, L->N, L->K, out, ldo, M,
                                      flags | (int)L->flags, num_threads);
    return rc ? 2 : 0;
}

/* The bytes of a row's first `values` values (whole blocks; F16 and BF16: 2 bytes a value). */
INLINE int64_t span_bytes(BlockType bt, int64_t values)
{
    return bt.unpack ? values / bt.values * bt.bytes : 2 * values;
}

/* Values k0 .. k0 + count (whole blocks) of row n of a weight, decoded: the reader that cpu_amx.c's
 * tiles decode panels with. */
int trillm_gguf_decode_range(const void *layout, int64_t n, int64_t k0, int64_t count, float *out)
{
    const GGUFLayout *L = layout;
    const BlockType bt = block_type((int)L->type);
    if (!known((int)L->type, bt))
        return 2;
    decode_row((int)L->type, bt, L->w + n * L->row_bytes + span_bytes(bt, k0), count, out);
    return 0;
}

/* The same values as trillm_gguf_decode_range, rounded to bfloat16 (nearest even) as they are made:
 * the AMX tiles' panels without a float32 row in between. 3 where this build has no AVX512-BF16. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* 16 values dl_a * q - ml_a, then 16 of dl_b * q - ml_b (two roundings each, as apply), as 32 bfloat16 */
INLINE void apply32_bf16(const int8_t *q, float dl_a, float ml_a, float dl_b, float ml_b, uint16_t *out)
{
    const __m512 lo = _mm512_sub_ps(
        _mm512_mul_ps(_mm512_set1_ps(dl_a), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)))),
        _mm512_set1_ps(ml_a));
    const __m512 hi = _mm512_sub_ps(
        _mm512_mul_ps(_mm512_set1_ps(dl_b),
                      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))))),
        _mm512_set1_ps(ml_b));
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

INLINE uint16_t bf16_of(float f) /* nearest even, as vcvtne2ps2bf16 (NaN kept a quiet NaN) */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#endif

int trillm_gguf_decode_range_bf16(const void *layout, int64_t n, int64_t k0, int64_t count, uint16_t *out)
{
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const GGUFLayout *L = layout;
    const int type = (int)L->type;
    const BlockType bt = block_type(type);
    if (!known(type, bt))
        return 2;
    const uint8_t *row = L->w + n * L->row_bytes + span_bytes(bt, k0);
    const int64_t bytes = span_bytes(bt, count);
    if (n + PREFETCH_ROWS < L->N) /* a panel's rows come in order: ask for a later one's bytes now */
        for (int64_t c = 0; c < bytes; c += 64)
            _mm_prefetch((const char *)(row + PREFETCH_ROWS * L->row_bytes + c), _MM_HINT_T0);
    if (type == BF16) {
        memcpy(out, row, 2 * (size_t)count);
    } else if (type == F16) {
        int64_t k = 0;
        for (; k + 32 <= count; k += 32) {
            const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * k)));
            const __m512 hi = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * k + 32)));
            _mm512_storeu_si512(out + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
        for (; k < count; k++)
            out[k] = bf16_of(f16(row + 2 * k));
    } else {
        Unpacked U;
        for (int64_t k = 0; k < count;) {
            const int taken = unpack(bt, row, (count - k) / bt.values, &U);
            for (int j = 0; j < U.subs * U.n; j += 32) {
                const int a = j / U.n, b = (j + 16) / U.n;
                apply32_bf16(U.q + j, U.dl[a], U.ml[a], U.dl[b], U.ml[b], out + k + j);
            }
            k += (int64_t)taken * bt.values;
            row += taken * bt.bytes;
        }
    }
    return 0;
#else
    (void)layout, (void)n, (void)k0, (void)count, (void)out;
    return 3;
#endif
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
