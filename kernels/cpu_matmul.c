/* out[M, N] (+)= x[M, K] @ W[N, K]^T with W in GGUF-style blocks, for kernels/cpu_matmul.py (ctypes).
 *
 * Longer than our ~400-line guide on purpose: one kernel, written once over a
 * vector type for AVX-512 and AVX2, plus its plain-C path; split, the three would
 * drift apart.
 *
 * W is Q4_1 (w = d * q + m, q in 0..15) or Q8_0 (w = d * q, q in -128..127), one d (and m)
 * per block of 32 along K; layouts in kernels/block_weights.py. Each weight is decoded to
 * float32 with the two roundings of block_weights.dequantize (the file is built with
 * -ffp-contract=off, so GCC cannot fuse d * q + m); only the dot products use FMAs. So the
 * result is torch.mm's on the dequantized matrix up to the order of the additions.
 *
 * Threads split N, each decoding only its own weight rows. Two SIMD paths, written once over
 * a vector of VL floats: AVX-512 (VL = 16) or, without it, AVX2 + FMA (VL = 8):
 * - few x rows (M <= DIRECT_MAX_M): each block of a few weight rows is decoded in registers
 *   once and multiplied with up to DIRECT_PASS x rows from L1, accumulating along K (summed
 *   across lanes at the end), one accumulator per output in one order whatever M: a row's
 *   result does not depend on the others. Memory bound at M = 1: 0.75 bytes per Q4_1 weight.
 * - more rows: PANEL (48) weight rows x KC of K at a time are decoded into an L1-sized
 *   chunk, which then meets all rows of x (transposed into VL-row vectors beforehand) in a
 *   register tile of 2 VL rows x TILE_NR weights: per k, 2 x vectors, TILE_NR broadcast
 *   weights and 2 TILE_NR FMAs (AVX-512: 32 x 12, AVX2: 16 x 6). The next chunk is decoded
 *   a few rows at a time between those FMAs.
 * Only the ISA section below (vector type, block decoder, transpose, partial store, tile
 * sizes) differs between the two. A plain-C path (used without either, and by the tests)
 * decodes rows and takes dot products.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#define SIMD 2 /* what trillm_simd reports */
#elif defined(__AVX2__) && defined(__FMA__)
#define SIMD 1
#else
#define SIMD 0
#endif
#if SIMD
#include <immintrin.h>
#endif

#include "cpu_common.h" /* INLINE, MIN, tree_sum */

enum { ACCUMULATE = 1, PORTABLE = 2 }; /* flags of trillm_matmul */

#define PF_ROWS 16 /* how far ahead the in-register path prefetches weights: ~7 KB of Q4_1 at K = 576 */
#define PANEL 48   /* weight rows per decoded chunk */
#define X_BLOCK_BYTES (1 << 20) /* transposed x per thread, L2-resident: rows per block */
#define PLAIN_ROWS 8
/* Weights x rows below which one thread does everything: a parallel region costs ~1 us
 * with a warm team and far more with a sleeping one; 2^18 is ~30 us of work. */
#define PARALLEL_MIN_WORK (1 << 18)

typedef struct {        /* as passed from Python (_Layout in cpu_matmul.py) */
    const uint8_t *qs;  /* Q4_1: [N, K / 2] nibbles; Q8_0: [N, K] int8 */
    const float *d, *m; /* [N, K / 32]; m is NULL for Q8_0 */
    int64_t N, K;
} WeightLayout;

typedef struct {
    const uint8_t *qs;
    const float *d, *m;
    int64_t N, K, nb, row_bytes; /* blocks per row, bytes of qs per row */
} Weight;

static Weight weight(const WeightLayout *w)
{
    return (Weight){w->qs, w->d, w->m, w->N, w->K, w->K / 32, w->m ? w->K / 2 : w->K};
}


/* ---- plain C ---- */

/* Blocks b0 .. b1 of weight row n, exactly as block_weights.dequantize computes them. */
static void decode_blocks(const Weight *W, int64_t n, int64_t b0, int64_t b1, float *restrict w)
{
    const uint8_t *q = W->qs + n * W->row_bytes;
    const float *d = W->d + n * W->nb, *m = W->m ? W->m + n * W->nb : NULL;
    for (int64_t b = b0; b < b1; b++, w += 32) {
        if (m) {
            for (int j = 0; j < 16; j++) {
                w[j] = d[b] * (float)(q[16 * b + j] & 15) + m[b]; /* two roundings (no contraction) */
                w[j + 16] = d[b] * (float)(q[16 * b + j] >> 4) + m[b];
            }
        } else {
            for (int j = 0; j < 32; j++)
                w[j] = d[b] * (float)(int8_t)q[32 * b + j];
        }
    }
}

/* One weight row. */
static void decode_row(const Weight *W, int64_t n, float *restrict w)
{
    decode_blocks(W, n, 0, W->nb, w);
}


static void plain_rows(const Weight *W, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t M,
                       int64_t n0, int64_t n1, int accumulate, float *buf)
{
    for (int64_t n = n0; n < n1; n += PLAIN_ROWS) {
        const int64_t rows = MIN(n1 - n, PLAIN_ROWS);
        for (int64_t j = 0; j < rows; j++)
            decode_row(W, n + j, buf + j * W->K);
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < rows; j++) {
                const float s = dot16(x + i * ldx, buf + j * W->K, W->K);
                float *o = out + i * ldo + n + j;
                *o = accumulate ? *o + s : s;
            }
    }
}

#if SIMD == 2
/* ---- ISA: AVX-512 ---- */

typedef __m512 vec;
#define VL 16
#define DIRECT_MAX_M 11 /* below 12 rows the panel path still pays the decode and FMAs of 16 (measured) */
#define DIRECT_PASS 11  /* x rows a pass over the weights takes: 5 x 4 or 11 x 2 accumulators at most */
#define KC 128          /* K per chunk: 48 x 128 floats = 24 KB, two of them (decoding, in use) fit L1 */
#define TILE_NR 12      /* weights per panel tile: 2 x 12 accumulators */

INLINE vec vzero(void) { return _mm512_setzero_ps(); }
INLINE vec vset1(float a) { return _mm512_set1_ps(a); }
INLINE vec vload(const float *p) { return _mm512_load_ps(p); } /* aligned */
INLINE vec vloadu(const float *p) { return _mm512_loadu_ps(p); }
INLINE void vstore(float *p, vec v) { _mm512_store_ps(p, v); } /* aligned */
INLINE void vstoreu(float *p, vec v) { _mm512_storeu_ps(p, v); }
INLINE vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
INLINE vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
INLINE float vsum(vec v) { return _mm512_reduce_add_ps(v); }

/* One block of one row into two vectors (k = 0..15, 16..31). Q4_1: the block's 16 possible
 * values d * j + m (the roundings of dequantize) form a table indexed by the nibbles, and
 * vpermps reads only the low 4 bits of each index: 6 vector ops per 32 weights. */
INLINE void decode_block(const uint8_t *q, float d, float m, const int q8, vec w[2])
{
    if (!q8) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d), iota), _mm512_set1_ps(m));
        w[0] = _mm512_permutexvar_ps(v, table);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
    } else {
        const __m512 dv = _mm512_set1_ps(d);
        w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), dv);
        w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))),
                             dv);
    }
}

/* r[i] lane j <- r[j] lane i: 64 shuffles for 256 floats. */
INLINE void transpose(vec r[16])
{
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) { /* u[g + c], lane L: column 4L + c of rows g..g+3 */
        const __m512d lo01 = _mm512_castps_pd(t[g]), hi01 = _mm512_castps_pd(t[g + 1]);
        const __m512d lo23 = _mm512_castps_pd(t[g + 2]), hi23 = _mm512_castps_pd(t[g + 3]);
        u[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo01, lo23));
        u[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo01, lo23));
        u[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi01, hi23));
        u[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi01, hi23));
    }
    for (int c = 0; c < 4; c++) { /* 4 x 4 transpose of the 128-bit lanes of u[c], u[4 + c], ... */
        const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
        const __m512 v2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
        const __m512 v3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_f32x4(v0, v2, 0x88);
        r[4 + c] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
        r[8 + c] = _mm512_shuffle_f32x4(v1, v3, 0x88);
        r[12 + c] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
    }
}

/* o[0..n] (+)= the first n = MIN(valid, VL) lanes of r; nothing if valid <= 0. */
INLINE void store_part(float *o, vec r, int64_t valid, int accumulate)
{
    const __mmask16 mask = valid >= 16 ? 0xFFFF : valid <= 0 ? 0 : (__mmask16)((1u << valid) - 1);
    if (accumulate)
        r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(mask, o));
    _mm512_mask_storeu_ps(o, mask, r);
}

#elif SIMD == 1
/* ---- ISA: AVX2 + FMA (16 vector registers) ---- */

typedef __m256 vec;
#define VL 8
#define DIRECT_MAX_M 11 /* measured crossover at 12 rows here too */
#define DIRECT_PASS 4   /* x rows a pass takes (5 for a last row): 8 accumulators at most */
#define KC 64 /* K per chunk: 2 x 12 KB fit a 32 KB L1 (Zen 2/3, Intel client); 128 was no faster here */
#define TILE_NR 6 /* 2 x 6 accumulators, 2 x vectors and a broadcast: 15 of 16 registers */

INLINE vec vzero(void) { return _mm256_setzero_ps(); }
INLINE vec vset1(float a) { return _mm256_set1_ps(a); }
INLINE vec vload(const float *p) { return _mm256_load_ps(p); }
INLINE vec vloadu(const float *p) { return _mm256_loadu_ps(p); }
INLINE void vstore(float *p, vec v) { _mm256_store_ps(p, v); }
INLINE void vstoreu(float *p, vec v) { _mm256_storeu_ps(p, v); }
INLINE vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
INLINE vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }

INLINE float vsum(vec v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* One block of one row into four vectors (k = 0..7, ..., 24..31), computed as dequantize
 * does: float(q), times d (rounded), plus m (rounded). Q4_1: bytes 0..7 hold k = 0..7 in
 * their low nibbles and 16..23 in their high ones; bytes 8..15 the rest. (A 16-value table
 * as above takes two vpermps and a blend per 8 weights here: 30% slower, measured.) */
INLINE void decode_block(const uint8_t *q, float d, float m, const int q8, vec w[4])
{
    const __m256 dv = _mm256_set1_ps(d);
    if (!q8) {
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
        const __m256i low = _mm256_set1_epi32(15);
        const __m256i nib[4] = {_mm256_and_si256(b0, low), _mm256_and_si256(b1, low), _mm256_srli_epi32(b0, 4),
                                _mm256_srli_epi32(b1, 4)};
        const __m256 mv = _mm256_set1_ps(m);
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_add_ps(_mm256_mul_ps(dv, _mm256_cvtepi32_ps(nib[i])), mv);
    } else {
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                         _mm_loadl_epi64((const __m128i *)(q + 8 * i)))));
    }
}

/* r[i] lane j <- r[j] lane i: 24 shuffles for 64 floats. */
INLINE void transpose(vec r[8])
{
    __m256 t[8], s[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]); /* lanes: r[i][0] r[i+1][0] r[i][1] r[i+1][1] | 4, 5 */
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int g = 0; g < 8; g += 4) { /* s[g + c]: column c | column 4 + c of rows g..g+3 */
        s[g] = _mm256_shuffle_ps(t[g], t[g + 2], 0x44);
        s[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], 0xEE);
        s[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
        s[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x20);
        r[4 + c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x31);
    }
}

INLINE void store_part(float *o, vec r, int64_t valid, int accumulate)
{
    if (valid >= 8) {
        _mm256_storeu_ps(o, accumulate ? _mm256_add_ps(r, _mm256_loadu_ps(o)) : r);
    } else if (valid > 0) {
        const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)valid), iota);
        _mm256_maskstore_ps(o, mask, accumulate ? _mm256_add_ps(r, _mm256_maskload_ps(o, mask)) : r);
    }
}
#endif

#if SIMD
#define BV (32 / VL)       /* vectors per block of 32 weights */
#define TILE_M (2 * VL)    /* x rows per panel tile */

/* ---- few rows, weights decoded in registers ---- */

#define DIRECT_NR_MAX 8 /* weight rows per tile at most; threads split N in units of it */

/* out[0..MR, n0..n0+NR] (+)= x[0..MR] . W[n0..]; weight rows past N repeat row N-1, unstored.
 * Each output has one accumulator, fed in one order (block by block, a block's vectors in turn)
 * whatever MR and NR: a row's result does not depend on the rows beside it, so speculation's
 * verification rows give exactly the logits of plain decodes (tests/test_cpu_matmul). Weights are
 * decoded once per pass, for all its MR rows. (Array sizes are constants, not MR and NR: GCC
 * keeps only fixed-size arrays in registers.) */
INLINE void direct_tile(const Weight *W, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t n0,
                        int accumulate, const int q8, const int MR, const int NR)
{
    const uint8_t *q[DIRECT_NR_MAX];
    const float *d[DIRECT_NR_MAX], *m[DIRECT_NR_MAX];
    for (int j = 0; j < NR; j++) {
        const int64_t n = MIN(n0 + j, W->N - 1);
        q[j] = W->qs + n * W->row_bytes;
        d[j] = W->d + n * W->nb;
        m[j] = q8 ? d[j] : W->m + n * W->nb;
    }
    vec acc[DIRECT_PASS + 1][DIRECT_NR_MAX]; /* only MR x NR are used (in registers) */
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR; j++)
            acc[r][j] = vzero();
    /* The tile's rows are contiguous: fetch the same bytes PF_ROWS rows ahead, a line per
     * block (1.6x faster from DRAM than the hardware prefetcher alone). */
    const int64_t qb = q8 ? 32 : 16, ahead = PF_ROWS;
    const char *pf_q = (const char *)(q[0] + ahead * W->row_bytes), *pf_d = (const char *)(d[0] + ahead * W->nb);
    const char *pf_m = (const char *)(m[0] + ahead * W->nb);
    for (int64_t b = 0; b < W->nb; b++) {
        for (int l = 0; l < NR * qb; l += 64)
            _mm_prefetch(pf_q + b * NR * qb + l, _MM_HINT_T0);
        if ((b & 3) == 0)
            for (int l = 0; l < NR * 16; l += 64) { /* 4 blocks' scales of NR rows */
                _mm_prefetch(pf_d + b * NR * 4 + l, _MM_HINT_T0);
                if (!q8)
                    _mm_prefetch(pf_m + b * NR * 4 + l, _MM_HINT_T0);
            }
        if (MR <= 5) { /* a weight row's block, then every x row */
            for (int j = 0; j < NR; j++) {
                vec w[BV];
                decode_block(q[j] + b * qb, d[j][b], m[j][b], q8, w);
                for (int r = 0; r < MR; r++)
                    for (int v = 0; v < BV; v++)
                        acc[r][j] = vfma(w[v], vloadu(x + r * ldx + 32 * b + VL * v), acc[r][j]);
            }
        } else { /* (AVX-512) the blocks of both weight rows, then an x row at a time, its vectors loaded
                  * once: loads of x repeated per weight row, which GCC kept on the stack, cost 15 % at 9 rows */
            vec w[2][BV];
            for (int j = 0; j < NR; j++)
                decode_block(q[j] + b * qb, d[j][b], m[j][b], q8, w[j]);
#pragma GCC unroll 16
            for (int r = 0; r < MR; r++) {
                vec xv[BV];
                for (int v = 0; v < BV; v++)
                    xv[v] = vloadu(x + r * ldx + 32 * b + VL * v);
                for (int j = 0; j < NR; j++)
                    for (int v = 0; v < BV; v++)
                        acc[r][j] = vfma(w[j][v], xv[v], acc[r][j]);
            }
        }
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR && n0 + j < W->N; j++) {
            float *o = out + r * ldo + n0 + j;
            const float s = vsum(acc[r][j]);
            *o = accumulate ? *o + s : s;
        }
}

/* All x rows against weight rows n0..n1 (whole units of DIRECT_NR_MAX from n0), a unit at a
 * time: up to DIRECT_PASS x rows a pass over the unit (still in L1 for the next pass). AVX-512
 * takes every row of a verification (up to 11) in one pass, 2 weight rows a tile from 6 rows:
 * SmolLM2's 121 matrices from memory, 6 rows 11.8 -> 9.8 ms, 9 rows 15.1 -> 13.7 (passes of 4
 * and 5 before), 10 rows 17.9 -> 15.9 (decoding every weight once more costs more than the
 * narrower tile). AVX2 takes 4 rows a pass, a last row alone joining the pass before (9 rows
 * 7-10 % faster than passes of 4, 4, 1). The first PF_ROWS rows are fetched here; each tile
 * prefetches for a later one. */
INLINE void direct_rows(const Weight *W, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t M,
                        int64_t n0, int64_t n1, int accumulate, const int q8)
{
    const int64_t first = MIN(n1 - n0, PF_ROWS);
    for (int64_t off = 0; off < first * W->row_bytes; off += 64)
        _mm_prefetch((const char *)(W->qs + n0 * W->row_bytes + off), _MM_HINT_T0);
    for (int64_t off = 0; off < first * W->nb; off += 16) {
        _mm_prefetch((const char *)(W->d + n0 * W->nb + off), _MM_HINT_T0);
        if (!q8)
            _mm_prefetch((const char *)(W->m + n0 * W->nb + off), _MM_HINT_T0);
    }
    for (int64_t n = n0; n < n1; n += DIRECT_NR_MAX)
        for (int64_t i = 0, left = M; left > 0;) {
#if SIMD == 2 /* passes of equal size (a pass per DIRECT_PASS rows) */
            const int64_t passes = (left + DIRECT_PASS - 1) / DIRECT_PASS, rows = (left + passes - 1) / passes;
#else
            const int64_t rows = left == DIRECT_PASS + 1 ? left : MIN(left, DIRECT_PASS);
#endif
            const float *xi = x + i * ldx;
            float *oi = out + i * ldo;
#define PASS(MR, NR)                                                                                                  \
    for (int64_t t = n; t < n + DIRECT_NR_MAX; t += NR)                                                               \
    direct_tile(W, xi, ldx, oi, ldo, t, accumulate, q8, MR, NR)
            switch (rows) {
#if SIMD == 2 /* 4 weight rows a tile up to 5 x rows (2 x 12 was slower, with a load of x per FMA), then 2 */
            case 1: PASS(1, 4); break;
            case 2: PASS(2, 4); break;
            case 3: PASS(3, 4); break;
            case 4: PASS(4, 4); break;
            case 5: PASS(5, 4); break;
            case 6: PASS(6, 2); break;
            case 7: PASS(7, 2); break;
            case 8: PASS(8, 2); break;
            case 9: PASS(9, 2); break;
            case 10: PASS(10, 2); break;
            default: PASS(11, 2); break;
#else /* MR x NR <= 8 accumulators of 16 registers (1 x 8 was slower than 1 x 4) */
            case 1: PASS(1, 4); break;
            case 2: PASS(2, 4); break;
            case 3: PASS(3, 2); break;
            case 4: PASS(4, 2); break;
            default: PASS(5, 1); break;
#endif
            }
#undef PASS
            i += rows, left -= rows;
        }
}

/* ---- many rows, decoded chunks ---- */

/* xt[g][k][i] = x[VL g + i][k], zero past `rows`: VL rows of x per vector. */
static void pack_x(const float *x, int64_t ldx, int64_t rows, int64_t K, float *restrict xt)
{
    for (int64_t g = 0; VL * g < rows; g++)
        for (int64_t k = 0; k < K; k += VL) {
            vec r[VL];
            for (int i = 0; i < VL; i++)
                r[i] = VL * g + i < rows ? vloadu(x + (VL * g + i) * ldx + k) : vzero();
            transpose(r);
            for (int i = 0; i < VL; i++)
                vstore(xt + (g * K + k + i) * VL, r[i]);
        }
}

/* Where the next chunk goes: rows n..n+PANEL of W (past N: row N-1 again), blocks b0..b1,
 * as chunk[k / VL][j][k % VL] with k from 32 b0, so that each decoded vector is one aligned
 * store and the tile finds w[j][k] at a constant offset. Rows j.. are still to decode. */
typedef struct {
    float *chunk;
    int64_t n, b0, b1, j; /* j == PANEL: nothing (left) to decode */
} Cursor;

/* Decodes the next `rows` rows of the cursor's chunk, prefetching the same bytes of the next
 * panel (contiguous with this one) into L2. Called between the FMAs of the tile below, the
 * decode overlaps them: decoded in one go between tiles, it cost twice as much. */
INLINE void decode_rows(const Weight *W, Cursor *c, int64_t rows, const int q8)
{
    const int64_t qb = q8 ? 32 : 16, b0 = c->b0, b1 = c->b1;
    for (const int64_t end = MIN(c->j + rows, PANEL); c->j < end; c->j++) {
        const int64_t n = MIN(c->n + c->j, W->N - 1);
        const uint8_t *q = W->qs + n * W->row_bytes;
        const float *d = W->d + n * W->nb, *m = q8 ? d : W->m + n * W->nb;
        for (int64_t off = b0 * qb; off < b1 * qb; off += 64)
            _mm_prefetch((const char *)(q + PANEL * W->row_bytes + off), _MM_HINT_T1);
        _mm_prefetch((const char *)(d + PANEL * W->nb + b0), _MM_HINT_T1);
        if (!q8)
            _mm_prefetch((const char *)(m + PANEL * W->nb + b0), _MM_HINT_T1);
        float *dst = c->chunk + c->j * VL;
        for (int64_t b = b0; b < b1; b++, dst += 32 * PANEL) {
            vec w[BV];
            decode_block(q + b * qb, d[b], m[b], q8, w);
            for (int v = 0; v < BV; v++)
                vstore(dst + v * PANEL * VL, w[v]);
        }
    }
}

/* outt[j][VL v + i] (+)= sum over the chunk's kc values of k of w[j0 + j][k] x[VL v + i][k],
 * for NR weight rows and MV groups of VL x rows (xt at the chunk's first k, groups ldx
 * apart): up to 2 TILE_NR accumulators. Decodes `per_step` rows of the next chunk per VL k. */
INLINE void panel_tile(const Weight *W, const float *restrict chunk, int j0, int64_t kc, const float *restrict xt,
                       int64_t ldx, float *outt, int first, Cursor *next, int64_t per_step, const int q8,
                       const int MV, const int NR)
{
    vec acc[2][TILE_NR];
    for (int v = 0; v < MV; v++)
        for (int j = 0; j < NR; j++)
            acc[v][j] = first ? vzero() : vload(outt + (j0 + j) * TILE_M + VL * v);
    for (int64_t k0 = 0; k0 < kc; k0 += VL) {
        const float *p = chunk + (k0 * PANEL + j0 * VL);
        for (int kk = 0; kk < VL; kk++) {
            vec xv[2];
            for (int v = 0; v < MV; v++)
                xv[v] = vload(xt + v * ldx + (k0 + kk) * VL);
            for (int j = 0; j < NR; j++) {
                const vec wb = vset1(p[j * VL + kk]);
                for (int v = 0; v < MV; v++)
                    acc[v][j] = vfma(xv[v], wb, acc[v][j]);
            }
        }
        decode_rows(W, next, per_step, q8);
    }
    for (int v = 0; v < MV; v++)
        for (int j = 0; j < NR; j++)
            vstore(outt + (j0 + j) * TILE_M + VL * v, acc[v][j]);
}

/* out[0..rows, 0..valid] (+)= outt^T (outt [PANEL][TILE_M], rows <= TILE_M, valid columns). */
INLINE void store_tile(const float *restrict outt, int64_t rows, float *out, int64_t ldo, int64_t valid,
                       int accumulate)
{
    for (int64_t g = 0; VL * g < rows; g++)
        for (int c = 0; c < PANEL / VL && VL * c < valid; c++) {
            vec r[VL];
            for (int i = 0; i < VL; i++)
                r[i] = vload(outt + (VL * c + i) * TILE_M + VL * g);
            transpose(r);
            for (int i = 0; i < VL && VL * g + i < rows; i++)
                store_part(out + (VL * g + i) * ldo + VL * c, r[i], valid - VL * c, accumulate);
        }
}

/* Weight rows n0..n1 against x in blocks of MB rows. Per PANEL weight rows and chunk of K:
 * run the chunk over all rows of the block (sums kept in outt, [PANEL][TILE_M] per TILE_M
 * rows) while the next chunk is decoded into the other buffer. Each weight is decoded once
 * per block. */
INLINE void panel_rows(const Weight *W, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t M,
                       int64_t n0, int64_t n1, int accumulate, float *buf, int64_t MB, const int q8)
{
    const int64_t K = W->K;
    float *chunks[2] = {buf, buf + PANEL * KC}, *outt = buf + 2 * PANEL * KC, *xt = outt + PANEL * MB;
    Cursor cur = {chunks[0], n0, 0, MIN(KC, K) / 32, 0};
    decode_rows(W, &cur, PANEL, q8);
    int u = 0; /* chunks done */
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t rows = MIN(M - m0, MB);
        pack_x(x + m0 * ldx, ldx, rows, K, xt);
        for (int64_t n = n0; n < n1; n += PANEL) {
            for (int64_t k = 0; k < K; k += KC, u++) {
                const int64_t kc = MIN(KC, K - k);
                /* the chunk after this one, in loop order (none after the last) */
                const int last_k = k + kc == K, wrap = last_k && n + PANEL >= n1;
                const int64_t nn = last_k ? (wrap ? n0 : n + PANEL) : n, nk = last_k ? 0 : k + kc;
                const int none = wrap && m0 + MB >= M;
                cur = (Cursor){chunks[(u + 1) & 1], nn, nk / 32, MIN(nk + KC, K) / 32, none ? PANEL : 0};
                /* spread its rows over the tiles' steps of VL k */
                const int64_t steps = (rows + TILE_M - 1) / TILE_M * (PANEL / TILE_NR) * (kc / VL);
                const int64_t per_step = (PANEL + steps - 1) / steps;
                const float *chunk = chunks[u & 1];
                for (int64_t i = 0; i < rows; i += TILE_M) {
                    const float *xi = xt + i * K + k * VL;
                    float *ot = outt + i * PANEL;
                    if (last_k) /* the stores below miss the cache: fetch their lines meanwhile */
                        for (int64_t r = i; r < MIN(rows, i + TILE_M); r++)
                            for (int c = 0; c < PANEL; c += 16)
                                _mm_prefetch((const char *)(out + (m0 + r) * ldo + n + c), _MM_HINT_ET0);
                    for (int j0 = 0; j0 < PANEL; j0 += TILE_NR)
                        if (rows - i > VL)
                            panel_tile(W, chunk, j0, kc, xi, VL * K, ot, k == 0, &cur, per_step, q8, 2, TILE_NR);
                        else
                            panel_tile(W, chunk, j0, kc, xi, VL * K, ot, k == 0, &cur, per_step, q8, 1, TILE_NR);
                    if (last_k) /* done: store now, spreading the cache misses over the FMAs */
                        store_tile(ot, MIN(rows - i, TILE_M), out + (m0 + i) * ldo + n, ldo, W->N - n, accumulate);
                }
                decode_rows(W, &cur, PANEL, q8); /* whatever the tiles left */
            }
        }
    }
}
#endif

/* 0: plain C only, 1: the AVX2 paths, 2: the AVX-512 paths. */
int trillm_simd(void)
{
    return SIMD;
}

int trillm_has_avx512(void)
{
    return SIMD == 2;
}

/* out[M, N] (+)= x[M, K] @ W^T. x, out: rows ldx, ldo floats apart, unit column stride, not
 * overlapping. flags: ACCUMULATE, PORTABLE (the plain-C path, for tests; the only one without SIMD).
 * Returns 0, or 2 if a scratch buffer could not be allocated. */
int trillm_matmul(const float *x, int64_t ldx, const WeightLayout *layout, float *out, int64_t ldo, int64_t M,
                  int flags, int num_threads)
{
    const Weight W = weight(layout);
    const int64_t N = W.N, K = W.K;
    const int accumulate = flags & ACCUMULATE;
#if SIMD
    const int plain = flags & PORTABLE, direct = kernel_rows(flags, M) <= DIRECT_MAX_M;
    const int64_t unit = plain ? PLAIN_ROWS : direct ? DIRECT_NR_MAX : PANEL, units = (N + unit - 1) / unit;
    const int64_t MB = MIN((M + 31) / 32 * 32, X_BLOCK_BYTES / (4 * K) / 32 * 32 + 32); /* rows per x block */
    const size_t floats = plain ? PLAIN_ROWS * K : direct ? 0 : 2 * PANEL * KC + PANEL * MB + MB * K;
#else
    const int plain = 1;
    const int64_t unit = PLAIN_ROWS, units = (N + unit - 1) / unit;
    const size_t floats = PLAIN_ROWS * K;
#endif
    int failed = 0;
    if (M <= 0 || N <= 0 || K <= 0)
        return 0;
#pragma omp parallel num_threads(num_threads) if (units > 1 && N * K * (M + 4) >= PARALLEL_MIN_WORK)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t n0 = units * t / T * unit, n1 = MIN(units * (t + 1) / T * unit, N);
        float *buf = floats ? scratch(floats) : NULL;
        if (floats && !buf) {
#pragma omp atomic write
            failed = 1;
        } else if (n0 < n1) {
            if (plain)
                plain_rows(&W, x, ldx, out, ldo, M, n0, n1, accumulate, buf);
#if SIMD
            else if (direct)
                !W.m ? direct_rows(&W, x, ldx, out, ldo, M, n0, n1, accumulate, 1)
                   : direct_rows(&W, x, ldx, out, ldo, M, n0, n1, accumulate, 0);
            else
                !W.m ? panel_rows(&W, x, ldx, out, ldo, M, n0, n1, accumulate, buf, MB, 1)
                   : panel_rows(&W, x, ldx, out, ldo, M, n0, n1, accumulate, buf, MB, 0);
#endif
        }
    }
    return failed ? 2 : 0;
}

/* Values k0 .. k0 + count (whole blocks of 32) of row n of W, as decode_row decodes them: the reader
 * that cpu_amx.c's tiles decode panels with. */
int trillm_decode_range(const WeightLayout *layout, int64_t n, int64_t k0, int64_t count, float *out)
{
    const Weight W = weight(layout);
#if SIMD
    const uint8_t *q = W.qs + n * W.row_bytes;
    const float *d = W.d + n * W.nb, *m = W.m ? W.m + n * W.nb : NULL;
    const int64_t qb = W.m ? 16 : 32; /* bytes of qs per block */
    for (int64_t b = k0 / 32; b < (k0 + count) / 32; b++, out += 32) {
        vec w[BV];
        decode_block(q + qb * b, d[b], m ? m[b] : 0.0f, !m, w);
        for (int v = 0; v < BV; v++)
            vstoreu(out + VL * v, w[v]);
    }
#else
    decode_blocks(&W, n, k0 / 32, (k0 + count) / 32, out);
#endif
    return 0;
}

/* trillm_decode_range's values rounded to bfloat16 (nearest even) as they are made, for the AMX
 * tiles' panels; 3 where this build has no AVX512-BF16. */
#define PF_PANEL 4 /* rows ahead that the bfloat16 decoder prefetches (measured: Gemma 3's head 19.6 -> 15 ms at 32 rows) */
int trillm_decode_range_bf16(const WeightLayout *layout, int64_t n, int64_t k0, int64_t count, uint16_t *out)
{
#if SIMD == 2 && defined(__AVX512BF16__)
    const Weight W = weight(layout);
    const uint8_t *q = W.qs + n * W.row_bytes;
    const float *d = W.d + n * W.nb, *m = W.m ? W.m + n * W.nb : NULL;
    const int64_t qb = W.m ? 16 : 32;
    if (n + PF_PANEL < W.N) { /* the panel's rows come in order: ask for a later one's bytes now */
        for (int64_t c = qb * (k0 / 32); c < qb * ((k0 + count) / 32); c += 64)
            _mm_prefetch((const char *)(q + PF_PANEL * W.row_bytes + c), _MM_HINT_T0);
        for (int64_t b = k0 / 32; b < (k0 + count) / 32; b += 16)
            _mm_prefetch((const char *)(d + PF_PANEL * W.nb + b), _MM_HINT_T0);
    }
    for (int64_t b = k0 / 32; b < (k0 + count) / 32; b++, out += 32) {
        vec w[BV];
        decode_block(q + qb * b, d[b], m ? m[b] : 0.0f, !m, w);
        _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
    }
    return 0;
#else
    (void)layout, (void)n, (void)k0, (void)count, (void)out;
    return 3;
#endif
}

/* out[N, K] = W as decoded by decode_row (path 0) or by decode_block (path 1, used by both
 * SIMD paths), for the bit-exactness tests. Returns 1 if that path is not built. */
int trillm_dequantize(const WeightLayout *layout, float *out, int path)
{
    const Weight W = weight(layout);
    if (path == 0) {
        for (int64_t n = 0; n < W.N; n++)
            decode_row(&W, n, out + n * W.K);
        return 0;
    }
#if SIMD
    if (path == 1) {
        for (int64_t n = 0; n < W.N; n++)
            for (int64_t b = 0; b < W.nb; b++) {
                const uint8_t *q = W.qs + n * W.row_bytes;
                const float d = W.d[n * W.nb + b];
                vec w[BV];
                if (W.m)
                    decode_block(q + 16 * b, d, W.m[n * W.nb + b], 0, w);
                else
                    decode_block(q + 32 * b, d, 0.0f, 1, w);
                for (int v = 0; v < BV; v++)
                    vstoreu(out + n * W.K + 32 * b + VL * v, w[v]);
            }
        return 0;
    }
#endif
    return 1;
}
