/* out[M, N] (+)= x[M, K] @ W[N, K]^T with W in GGUF-style blocks, for kernels/cpu_matmul.py (ctypes).
 *
 * W is Q4_1 (w = d * q + m, q in 0..15) or Q8_0 (w = d * q, q in -128..127), one d (and m)
 * per block of 32 along K; layouts in kernels/block_weights.py. Each weight is decoded to
 * float32 with the two roundings of block_weights.dequantize (the file is built with
 * -ffp-contract=off, so GCC cannot fuse d * q + m); only the dot products use FMAs. So the
 * result is torch.mm's on the dequantized matrix up to the order of the additions.
 *
 * Threads split N, each decoding only its own weight rows. Two AVX-512 paths:
 * - few x rows (M <= DIRECT_MAX_M): each block of DIRECT_NR weight rows is decoded in
 *   registers and multiplied with up to 4 x rows from L1, accumulating along K (summed
 *   across lanes at the end). Memory bound at M = 1: 0.75 bytes per Q4_1 weight.
 * - more rows: 48 weight rows x KC of K at a time are decoded into an L1-sized chunk,
 *   which then meets all rows of x (transposed into 16-row vectors beforehand) in a
 *   register tile of 32 rows x 12 weights: per k, 2 x vectors, 12 broadcast weights and
 *   24 FMAs. The next chunk is decoded a few rows at a time between those FMAs.
 * A plain-C path (used without AVX-512, and by the tests) decodes rows and takes dot products.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

enum { ACCUMULATE = 1, PORTABLE = 2 }; /* flags of trillm_matmul */

/* Up to this many x rows, the in-register path: below it the panel path still pays the
 * decode and the FMAs of 16 rows (measured crossover at about 12 rows). */
#define DIRECT_MAX_M 11
#define DIRECT_NR 4 /* weight rows per tile of that path */
#define PF_TILES 4  /* and how far ahead it prefetches weights: 4 tiles, ~7 KB at K = 576 */
#define PANEL 48    /* weight rows per decoded chunk */
#define KC 128      /* K per chunk: 48 x 128 floats = 24 KB, two of them (decoding, in use) fit L1 */
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

/* A per-thread buffer kept between calls: the OpenMP team (torch's) lives on, and a fresh
 * malloc of a few hundred KB would be an mmap with page faults on every call. */
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

/* ---- plain C ---- */

/* One weight row, exactly as block_weights.dequantize computes it. */
static void decode_row(const Weight *W, int64_t n, float *restrict w)
{
    const uint8_t *q = W->qs + n * W->row_bytes;
    const float *d = W->d + n * W->nb, *m = W->m ? W->m + n * W->nb : NULL;
    for (int64_t b = 0; b < W->nb; b++, w += 32) {
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

/* a . b with 16 partial sums (see sum_squares in cpu_ops.c for why). */
static float dot(const float *restrict a, const float *restrict b, int64_t K)
{
    float part[16] = {0};
    for (int64_t k = 0; k < K; k += 16) /* K % 32 == 0 */
        for (int l = 0; l < 16; l++)
            part[l] += a[k + l] * b[k + l];
    for (int w = 8; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            part[l] += part[l + w];
    return part[0];
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
                const float s = dot(x + i * ldx, buf + j * W->K, W->K);
                float *o = out + i * ldo + n + j;
                *o = accumulate ? *o + s : s;
            }
    }
}

#ifdef __AVX512F__
/* ---- AVX-512: few rows, weights decoded in registers ---- */

/* One block of one row into two vectors (k = 0..15, 16..31). Q4_1: the block's 16 possible
 * values d * j + m (the roundings of dequantize) form a table indexed by the nibbles, and
 * vpermps reads only the low 4 bits of each index: 6 vector ops per 32 weights. */
INLINE void decode_block(const uint8_t *q, float d, float m, const int q8, __m512 *lo, __m512 *hi)
{
    if (!q8) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d), iota), _mm512_set1_ps(m));
        *lo = _mm512_permutexvar_ps(v, table);
        *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
    } else {
        const __m512 dv = _mm512_set1_ps(d);
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), dv);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))), dv);
    }
}

/* out[0..MR, n0..n0+DIRECT_NR] (+)= x[0..MR] . W[n0..]; rows past N repeat row N-1, unstored.
 * (Array sizes are constants, not MR: GCC keeps only fixed-size arrays in registers.) */
INLINE void direct_tile(const Weight *W, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t n0,
                        int accumulate, const int q8, const int MR)
{
    const uint8_t *q[DIRECT_NR];
    const float *d[DIRECT_NR], *m[DIRECT_NR];
    for (int j = 0; j < DIRECT_NR; j++) {
        const int64_t n = MIN(n0 + j, W->N - 1);
        q[j] = W->qs + n * W->row_bytes;
        d[j] = W->d + n * W->nb;
        m[j] = q8 ? d[j] : W->m + n * W->nb;
    }
    __m512 acc[4][DIRECT_NR];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < DIRECT_NR; j++)
            acc[r][j] = _mm512_setzero_ps();
    /* The tile's rows are contiguous: fetch the same bytes PF_TILES tiles ahead, a line per
     * block (1.6x faster from DRAM than the hardware prefetcher alone). */
    const int64_t qb = q8 ? 32 : 16, ahead = PF_TILES * DIRECT_NR;
    const char *pf_q = (const char *)(q[0] + ahead * W->row_bytes), *pf_d = (const char *)(d[0] + ahead * W->nb);
    const char *pf_m = (const char *)(m[0] + ahead * W->nb);
    for (int64_t b = 0; b < W->nb; b++) {
        for (int l = 0; l < DIRECT_NR * qb; l += 64)
            _mm_prefetch(pf_q + b * DIRECT_NR * qb + l, _MM_HINT_T0);
        if ((b & 3) == 0) {
            _mm_prefetch(pf_d + b * DIRECT_NR * 4, _MM_HINT_T0);
            if (!q8)
                _mm_prefetch(pf_m + b * DIRECT_NR * 4, _MM_HINT_T0);
        }
        for (int j = 0; j < DIRECT_NR; j++) {
            __m512 lo, hi;
            decode_block(q[j] + b * qb, d[j][b], m[j][b], q8, &lo, &hi);
            for (int r = 0; r < MR; r++) {
                acc[r][j] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * ldx + 32 * b), acc[r][j]);
                acc[r][j] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * ldx + 32 * b + 16), acc[r][j]);
            }
        }
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < DIRECT_NR && n0 + j < W->N; j++) {
            float *o = out + r * ldo + n0 + j;
            const float s = _mm512_reduce_add_ps(acc[r][j]);
            *o = accumulate ? *o + s : s;
        }
}

/* All x rows, 4 at a time, for each group of DIRECT_NR weight rows (still in L1 meanwhile).
 * Each tile prefetches for a later one; the first PF_TILES are fetched here. */
INLINE void direct_rows(const Weight *W, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t M,
                        int64_t n0, int64_t n1, int accumulate, const int q8)
{
    const int64_t first = MIN(n1 - n0, PF_TILES * DIRECT_NR);
    for (int64_t off = 0; off < first * W->row_bytes; off += 64)
        _mm_prefetch((const char *)(W->qs + n0 * W->row_bytes + off), _MM_HINT_T0);
    for (int64_t off = 0; off < first * W->nb; off += 16) {
        _mm_prefetch((const char *)(W->d + n0 * W->nb + off), _MM_HINT_T0);
        if (!q8)
            _mm_prefetch((const char *)(W->m + n0 * W->nb + off), _MM_HINT_T0);
    }
    for (int64_t n = n0; n < n1; n += DIRECT_NR)
        for (int64_t i = 0; i < M; i += 4) {
            const float *xi = x + i * ldx;
            float *oi = out + i * ldo;
            switch (MIN(M - i, 4)) {
            case 1: direct_tile(W, xi, ldx, oi, ldo, n, accumulate, q8, 1); break;
            case 2: direct_tile(W, xi, ldx, oi, ldo, n, accumulate, q8, 2); break;
            case 3: direct_tile(W, xi, ldx, oi, ldo, n, accumulate, q8, 3); break;
            default: direct_tile(W, xi, ldx, oi, ldo, n, accumulate, q8, 4); break;
            }
        }
}

/* ---- AVX-512: many rows, decoded chunks ---- */

/* r[i] lane j <- r[j] lane i: 64 shuffles for 256 floats. */
INLINE void transpose16(__m512 r[16])
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

/* xt[g][k][i] = x[16 g + i][k], zero past `rows`: 16 rows of x per vector. */
static void pack_x(const float *x, int64_t ldx, int64_t rows, int64_t K, float *restrict xt)
{
    for (int64_t g = 0; 16 * g < rows; g++)
        for (int64_t k = 0; k < K; k += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = 16 * g + i < rows ? _mm512_loadu_ps(x + (16 * g + i) * ldx + k) : _mm512_setzero_ps();
            transpose16(r);
            for (int i = 0; i < 16; i++)
                _mm512_store_ps(xt + (g * K + k + i) * 16, r[i]);
        }
}

/* Where the next chunk goes: rows n..n+PANEL of W (past N: row N-1 again), blocks b0..b1,
 * as chunk[k / 16][j][k % 16] with k from 32 b0, so that each decoded vector is one aligned
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
        float *dst = c->chunk + c->j * 16;
        for (int64_t b = b0; b < b1; b++, dst += 2 * PANEL * 16) {
            __m512 lo, hi;
            decode_block(q + b * qb, d[b], m[b], q8, &lo, &hi);
            _mm512_store_ps(dst, lo);
            _mm512_store_ps(dst + PANEL * 16, hi);
        }
    }
}

/* outt[j][16 v + i] (+)= sum over the chunk's kc values of k of w[j0 + j][k] x[16 v + i][k],
 * for NR weight rows and MV groups of 16 x rows (xt at the chunk's first k, groups ldx
 * apart): MV * NR = 24 accumulators. Decodes `per_step` rows of the next chunk per 16 k. */
INLINE void panel_tile(const Weight *W, const float *restrict chunk, int j0, int64_t kc, const float *restrict xt,
                       int64_t ldx, float *outt, int first, Cursor *next, int64_t per_step, const int q8,
                       const int MV, const int NR)
{
    __m512 acc[2][12];
    for (int v = 0; v < MV; v++)
        for (int j = 0; j < NR; j++)
            acc[v][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(outt + (j0 + j) * 32 + 16 * v);
    for (int64_t k0 = 0; k0 < kc; k0 += 16) {
        const float *p = chunk + (k0 * PANEL + j0 * 16);
        for (int kk = 0; kk < 16; kk++) {
            __m512 xv[2];
            for (int v = 0; v < MV; v++)
                xv[v] = _mm512_load_ps(xt + v * ldx + (k0 + kk) * 16);
            for (int j = 0; j < NR; j++) {
                const __m512 wb = _mm512_set1_ps(p[j * 16 + kk]);
                for (int v = 0; v < MV; v++)
                    acc[v][j] = _mm512_fmadd_ps(xv[v], wb, acc[v][j]);
            }
        }
        decode_rows(W, next, per_step, q8);
    }
    for (int v = 0; v < MV; v++)
        for (int j = 0; j < NR; j++)
            _mm512_store_ps(outt + (j0 + j) * 32 + 16 * v, acc[v][j]);
}

/* out[0..rows, 0..PANEL] (+)= outt^T (outt [PANEL][32], rows <= 32), columns limited by mask. */
INLINE void store_tile(const float *restrict outt, int64_t rows, float *out, int64_t ldo, const __mmask16 *mask,
                       int accumulate)
{
    for (int64_t g = 0; 16 * g < rows; g++)
        for (int c = 0; c < PANEL / 16; c++) {
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = _mm512_load_ps(outt + (16 * c + i) * 32 + 16 * g);
            transpose16(r);
            for (int i = 0; i < 16 && 16 * g + i < rows; i++) {
                float *o = out + (16 * g + i) * ldo + 16 * c;
                if (accumulate)
                    r[i] = _mm512_add_ps(r[i], _mm512_maskz_loadu_ps(mask[c], o));
                _mm512_mask_storeu_ps(o, mask[c], r[i]);
            }
        }
}

/* Weight rows n0..n1 against x in blocks of MB rows. Per 48 weight rows and chunk of K: run
 * the chunk over all rows of the block (sums kept in outt, [PANEL][32] per 32 rows) while
 * the next chunk is decoded into the other buffer. Each weight is decoded once per block. */
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
            __mmask16 mask[PANEL / 16];
            for (int c = 0; c < PANEL / 16; c++) {
                const int64_t valid = MIN(W->N - n - 16 * c, 16);
                mask[c] = valid <= 0 ? 0 : (__mmask16)((1u << valid) - 1);
            }
            for (int64_t k = 0; k < K; k += KC, u++) {
                const int64_t kc = MIN(KC, K - k);
                /* the chunk after this one, in loop order (none after the last) */
                const int last_k = k + kc == K, wrap = last_k && n + PANEL >= n1;
                const int64_t nn = last_k ? (wrap ? n0 : n + PANEL) : n, nk = last_k ? 0 : k + kc;
                const int none = wrap && m0 + MB >= M;
                cur = (Cursor){chunks[(u + 1) & 1], nn, nk / 32, MIN(nk + KC, K) / 32, none ? PANEL : 0};
                /* spread its rows over the tiles' steps of 16 k */
                const int64_t steps = (rows + 31) / 32 * (PANEL / 12) * (kc / 16);
                const int64_t per_step = (PANEL + steps - 1) / steps;
                const float *chunk = chunks[u & 1];
                for (int64_t i = 0; i < rows; i += 32) {
                    const float *xi = xt + i * K + k * 16;
                    float *ot = outt + i * PANEL;
                    if (last_k) /* the stores below miss the cache: fetch their lines meanwhile */
                        for (int64_t r = i; r < MIN(rows, i + 32); r++)
                            for (int c = 0; c < PANEL; c += 16)
                                _mm_prefetch((const char *)(out + (m0 + r) * ldo + n + c), _MM_HINT_ET0);
                    for (int j0 = 0; j0 < PANEL; j0 += 12)
                        if (rows - i > 16)
                            panel_tile(W, chunk, j0, kc, xi, 16 * K, ot, k == 0, &cur, per_step, q8, 2, 12);
                        else
                            panel_tile(W, chunk, j0, kc, xi, 16 * K, ot, k == 0, &cur, per_step, q8, 1, 12);
                    if (last_k) /* done: store now, spreading the cache misses over the FMAs */
                        store_tile(ot, MIN(rows - i, 32), out + (m0 + i) * ldo + n, ldo, mask, accumulate);
                }
                decode_rows(W, &cur, PANEL, q8); /* whatever the tiles left */
            }
        }
    }
}
#endif

int trillm_has_avx512(void)
{
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* out[M, N] (+)= x[M, K] @ W^T. x, out: rows ldx, ldo floats apart, unit column stride, not
 * overlapping. flags: ACCUMULATE, PORTABLE (the plain-C path, for tests).
 * Returns 0, or 2 if a scratch buffer could not be allocated. */
int trillm_matmul(const float *x, int64_t ldx, const WeightLayout *layout, float *out, int64_t ldo, int64_t M,
                  int flags, int num_threads)
{
    const Weight W = weight(layout);
    const int64_t N = W.N, K = W.K;
    const int accumulate = flags & ACCUMULATE;
    const int plain = (flags & PORTABLE) || !trillm_has_avx512(), direct = M <= DIRECT_MAX_M;
    const int64_t unit = plain ? PLAIN_ROWS : direct ? DIRECT_NR : PANEL, units = (N + unit - 1) / unit;
    const int64_t MB = MIN((M + 31) / 32 * 32, X_BLOCK_BYTES / (4 * K) / 32 * 32 + 32); /* rows per x block */
    const size_t floats = plain ? PLAIN_ROWS * K : direct ? 0 : 2 * PANEL * KC + PANEL * MB + MB * K;
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
#ifdef __AVX512F__
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

/* out[N, K] = W as decoded by decode_row (path 0) or by decode_block (path 1, used by both
 * AVX-512 paths), for the bit-exactness tests. Returns 1 if that path is not built. */
int trillm_dequantize(const WeightLayout *layout, float *out, int path)
{
    const Weight W = weight(layout);
    if (path == 0) {
        for (int64_t n = 0; n < W.N; n++)
            decode_row(&W, n, out + n * W.K);
        return 0;
    }
#ifdef __AVX512F__
    if (path == 1) {
        for (int64_t n = 0; n < W.N; n++)
            for (int64_t b = 0; b < W.nb; b++) {
                const uint8_t *q = W.qs + n * W.row_bytes;
                const float d = W.d[n * W.nb + b];
                __m512 lo, hi;
                if (W.m)
                    decode_block(q + 16 * b, d, W.m[n * W.nb + b], 0, &lo, &hi);
                else
                    decode_block(q + 32 * b, d, 0.0f, 1, &lo, &hi);
                _mm512_storeu_ps(out + n * W.K + 32 * b, lo);
                _mm512_storeu_ps(out + n * W.K + 32 * b + 16, hi);
            }
        return 0;
    }
#endif
    return 1;
}
