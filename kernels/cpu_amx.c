/* out[M, N] (+)= x[M, K] . W[N, K]^T on AMX bfloat16 tiles, W decoded a panel at a time from the
 * form it is kept in, for kernels/amx_tiles.py (ctypes).
 *
 * Why: a batched decode step (8 to a few hundred rows) is bound neither by the weights' bytes, as
 * one row is, nor by anything a float32 FMA can hide: the integer kernels take one row of x at a
 * time, and the oneDNN path (bf16_panels) writes every decoded panel to memory and reads it back.
 * Here a thread decodes 32 of its weight rows over up to KC values of K with the weight form's own
 * decoder (a function pointer: cpu_gguf's blocks or cpu_matmul's repacked ones, exactly the floats
 * they decode), rounds them to bfloat16 (nearest even, as torch rounds) into the tiles' layout of
 * K pairs, and multiplies that panel, still in L2, with every row of x (rounded to bfloat16 once)
 * on the tiles; products are summed in float32, and nothing decoded outlives the call.
 *
 * Tiles: C (float32 16 x 16) 0-3 for 32 rows of x by 32 weight rows, A (x: 16 rows x 32 values)
 * 4-5, B (16 pairs x 16 weight rows) 6-7. Built where the compiler and CPU have AMX-BF16
 * (-march=native); elsewhere trillm_amx_available() answers 0 and the callers keep their paths.
 * Linux hands a process the tiles' state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM).
 * From WIDE_ROWS rows of x (a prefill chunk) the roles swap: x, in tile order, is the A operand and
 * the panel, turned into pairs, the B, so the sums come out in out's own layout and are stored
 * straight into it; trillm_amx_gated runs a gated MLP's gate and up that way and applies its
 * activation as the sums leave the tiles. A wide step's kernels hand x to each other already in tile
 * order (trillm_amx_pack, with the layer's RMSNorm; trillm_amx_matmul_tiles and _gated_tiles, the
 * latter writing its product in tile order for the down projection).
 * Buffers are per thread and kept between calls (grown()): the caller's x in bfloat16 (a pass of
 * rows: 256 below WIDE_ROWS, else as many as fill X_BLOCK_BYTES, 16 MiB), each worker's panel, row and sums
 * (~0.3 MiB at K 4096, 256 rows), and its pairs of a wide call (at most KEEP_PAIRS_BYTES, else a
 * block of PAIRS_L2_BYTES).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_common.h" /* MIN, rms_norm_row: the norm cpu_ops.c runs */

#define NB 32     /* weight rows per panel: two B tiles */
#define KSTEP 32  /* values of K per tile product: 16 pairs */
/* A wide product's weight tiles (to_pairs with ld 16): a step of K's tile of a group's rows 0-15 and
 * that of rows 16-31 side by side (or, gated, a half's gate and up tiles), so each tile load reads 1 KiB
 * in one run of 64-byte rows (two tiles interleaved at a 128-byte stride ran a 2,000-row product
 * 10-15 % slower). */
#define TILE_WORDS 256 /* a B tile: 16 pairs x 16 weight rows, u32 */
#define STEP_WORDS (2 * TILE_WORDS) /* a wide product's B tiles of one step of K */
#define CHUNK_VALUES 320 /* see k_chunk */
#define CHUNKED_K 1024
#define KC 4096   /* values of K per panel, a multiple of 256 (whole blocks of every type): 256 KiB */
#define X_BLOCK_BYTES (16 << 20) /* rows of x per pass (each pass decodes W again; see pass_rows) */
#define WIDE_ROWS 128 /* rows of x from which x is the A operand (multiply_rows) */
#define WIDE_PASS 4096 /* its rows per pass at most */
#ifndef PAIRS_L2_BYTES /* (both overridable for the tests' builds) */
#define PAIRS_L2_BYTES (640 << 10) /* a wide call's weight pairs multiplied with each 32 rows of x in turn */
#endif
#ifndef KEEP_PAIRS_BYTES
#define KEEP_PAIRS_BYTES (8 << 20) /* a thread's pairs of a wide call kept for its later passes up to this */
#endif
#define MAX(a, b) ((a) > (b) ? (a) : (b))

enum { ACCUMULATE = 1 };
enum { SILU = 1, GELU_TANH = 2 }; /* trillm_amx_gated's activations */

/* Values k0 .. k0 + count of weight row n (whole blocks) as float32: cpu_gguf's and cpu_matmul's. */
typedef int (*RowDecoder)(const void *weight, int64_t n, int64_t k0, int64_t count, float *out);
/* The same values rounded to bfloat16 as they are made (nonzero where that build cannot). */
typedef int (*RowDecoder16)(const void *weight, int64_t n, int64_t k0, int64_t count, uint16_t *out);
/* A weight form's own matmul (cpu_forward.c's MatmulFn), for steps below min_rows. */
typedef int (*MatmulFn)(const float *x, int64_t ldx, const void *layout, float *out, int64_t ldo, int64_t M,
                        int flags, int num_threads);

typedef struct {           /* _Layout in amx_tiles.py */
    RowDecoder decode;
    const void *weight;    /* the decoder's layout of W */
    int64_t N, K;
    MatmulFn below;        /* the form's own matmul and layout, for fewer than min_rows rows */
    const void *below_layout;
    int64_t min_rows;
    RowDecoder16 decode16; /* NULL: decode to float32 and round here */
    const uint16_t *rows;  /* bfloat16 rows [N, stride] the tiles read as they are (K a multiple of 32), or NULL */
    int64_t stride;
} AmxLayout;

/* A per-thread buffer kept between calls (slot 0: the caller's x, slot 1: a worker's panel, slot 2:
 * its groups' pairs, kept from a wide call's first pass of rows for the later ones), grown
 * to the largest call: a fresh one would be an mmap with page faults every call. */
static __attribute__((unused)) void *grown(int slot, size_t bytes)
{
    static __thread void *buf[3];
    static __thread size_t cap[3];
    if (bytes > cap[slot]) {
        free(buf[slot]);
        cap[slot] = 0;
        if (posix_memalign(&buf[slot], 64, bytes))
            return buf[slot] = NULL;
        cap[slot] = bytes;
    }
    return buf[slot];
}

#if AMX

/* dst[0..n) = bfloat16(src[0..n)), nearest even; n a multiple of 16. */
static void to_bf16(const float *src, int64_t n, uint16_t *dst)
{
    for (int64_t i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
}

/* Weight rows n0 .. n0 + NB over k0 .. k0 + kc (kc a multiple of KSTEP) as bfloat16, row after
 * row: A tiles read them as they are. Rows past N and values past K are zero. Nonzero if the
 * decoder failed. */
static int decode_panel(const AmxLayout *L, int64_t n0, int64_t k0, int64_t kc, float *row, uint16_t *panel)
{
    const int64_t valid = MIN(kc, L->K - k0);
    for (int c = 0; c < NB; c++) {
        const int64_t n = n0 + c;
        if (n < L->N && valid > 0 && L->decode16) {
            uint16_t *p = panel + c * kc;
            const int rc = L->decode16(L->weight, n, k0, valid, p);
            if (rc == 0) {
                memset(p + valid, 0, 2 * (size_t)(kc - valid));
                continue;
            }
            if (rc != 3) /* 3: that build has no bfloat16 decoder; round the float32 one here */
                return 1;
        }
        if (n < L->N && valid > 0) {
            if (L->decode(L->weight, n, k0, valid, row))
                return 1;
            memset(row + valid, 0, sizeof(float) * (size_t)(kc - valid));
        } else {
            memset(row, 0, sizeof(float) * (size_t)kc);
        }
        to_bf16(row, kc, panel + c * kc);
    }
    return 0;
}

/* Where the tiles read rows n0 .. n0 + NB over k0 .. k0 + kc: the weight's own bfloat16 rows where it
 * has them (a half-precision checkpoint's, no copy: a batched step reads them once), else ``panel``
 * decoded into. Sets *ps to the panel's row stride in values; NULL if the decoder failed. */
static const uint16_t *panel_at(const AmxLayout *L, int64_t n0, int64_t k0, int64_t kc, float *row, uint16_t *panel,
                                int64_t *ps)
{
    if (L->rows && n0 + NB <= L->N) {
        *ps = L->stride;
        return L->rows + n0 * L->stride + k0;
    }
    *ps = kc;
    return decode_panel(L, n0, k0, kc, row, panel) ? NULL : panel;
}

/* acc[NB, Mp] (+)= panel[NB, kc] . x[k0 .. k0 + kc, Mp] with x in B tiles' layout (xp: u32 pair p
 * of row m at [p][m]): the weights are the A operand, so the panel needs no reordering and the
 * result comes out transposed (the caller turns it). 32 rows of x (two B tiles) at a time. */
static void multiply(const uint32_t *xp, int64_t Mp, int64_t k0, int64_t kc, const uint16_t *panel, int64_t ps,
                     float *acc, int first)
{
    const int64_t as = ps * 2, bs = Mp * 4; /* strides in bytes: A's and B's and C's rows */
    for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
        const int two = m0 + 32 <= Mp;
        float *c0 = acc + m0, *c1 = acc + 16 * Mp + m0; /* weight rows 0-15 and 16-31 */
        start_tiles(first, c0, c1, two ? c0 + 16 : NULL, c1 + 16, bs);
        const uint32_t *b = xp + (k0 / 2) * Mp + m0;
        for (int64_t s = 0; s < kc / KSTEP; s++) {
            _tile_loadd(4, panel + s * KSTEP, as);
            _tile_loadd(5, panel + 16 * ps + s * KSTEP, as);
            _tile_loadd(6, b + s * 16 * Mp, bs);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            if (two) {
                _tile_loadd(7, b + s * 16 * Mp + 16, bs);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        store_tiles(c0, c1, two ? c0 + 16 : NULL, c1 + 16, bs);
    }
}

/* out[m, 0..cols) (+)= acc[0..cols, m] for m < M: the tiles' transposed result turned 16 x 16 at a
 * time (acc has NB rows of Mp, a multiple of 16; rows past cols hold zeros). */
static void write_out(const float *acc, int64_t Mp, int64_t M, int64_t cols, float *out, int64_t ldo, int accumulate)
{
    for (int64_t m0 = 0; m0 < M; m0 += 16)
        for (int64_t c0 = 0; c0 < cols; c0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = _mm512_loadu_ps(acc + (c0 + i) * Mp + m0);
            transpose16(r);
            const __mmask16 k = cols - c0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (cols - c0)) - 1);
            for (int64_t j = 0; j < 16 && m0 + j < M; j++) {
                float *o = out + (m0 + j) * ldo + c0;
                const __m512 v = accumulate ? _mm512_add_ps(_mm512_maskz_loadu_ps(k, o), r[j]) : r[j];
                _mm512_mask_storeu_ps(o, k, v);
            }
        }
}

/* Values of K a wide product runs through every group of a block before the next (a multiple of
 * KSTEP, the chunks of Kp as even as steps allow): up to CHUNKED_K, x's 32 rows of a chunk stay in L1
 * while each group's tiles stream past them (over all of K 576 at once, 36 KiB of x and 36 KiB of a
 * half's tiles, both came from L2), and the sums of the chunks before are loaded back into the tiles:
 * 2,000-row products at K 576 6-12 % faster (two threads). Past it all of K at once: a block there
 * holds a few groups, so x is reused little, and at K 2,048-8,192 the sums' round trips cost 10-40 %. */
static int64_t k_chunk(int64_t Kp)
{
    if (Kp > CHUNKED_K)
        return Kp;
    const int64_t chunks = (Kp + CHUNK_VALUES - 1) / CHUNK_VALUES, steps = Kp / KSTEP;
    return (steps + chunks - 1) / chunks * KSTEP;
}

/* out[m, 0..cols) (+)= x16[m, k0 .. k0 + kc] . pairs for m_from <= m < min(M, m_to) (m_from a multiple
 * of 32), x as the A operand (x16 in tile
 * order, see pack_tile_order; zero past M up to a multiple of 32). The tiles start from out where
 * ``load`` (adding, or a later panel of K) and are stored straight into it; a block cut by M or cols
 * goes through ``edge`` (32 x 32 floats). */
static void multiply_rows(const uint16_t *x16, int64_t Kp, int64_t M, int64_t m_from, int64_t m_to, int64_t k0,
                          int64_t kc, const uint32_t *pairs, int64_t cols, float *out, int64_t ldo, int load, float *edge)
{
    const int64_t xs = KSTEP * 2, tile = 16 * KSTEP; /* a tile of x: 16 rows of 32, 1 KiB */
    for (int64_t m0 = m_from; m0 < MIN(M, m_to); m0 += 32) {
        const int64_t rows = MIN(32, M - m0);
        const int full = rows == 32 && cols == NB;
        float *c = full ? out + m0 * ldo : edge;
        const int64_t ldc = full ? ldo : NB;
        if (!full) {
            memset(edge, 0, sizeof(float) * 32 * NB);
            if (load)
                for (int64_t i = 0; i < rows; i++)
                    memcpy(edge + i * NB, out + (m0 + i) * ldo, sizeof(float) * (size_t)cols);
        }
        start_tiles(!load && full, c, c + 16, c + 16 * ldc, c + 16 * ldc + 16, ldc * 4);
        const uint16_t *a = x16 + m0 * Kp + k0 * 16; /* rows m0 .. m0 + 15 from k0, then the next 16 */
        for (int64_t s = 0; s < kc / KSTEP; s++)
            dp_2x2(a + s * tile, a + 16 * Kp + s * tile, xs, pairs + s * STEP_WORDS, pairs + s * STEP_WORDS + TILE_WORDS, 64);
        store_tiles(c, c + 16, c + 16 * ldc, c + 16 * ldc + 16, ldc * 4);
        if (!full)
            for (int64_t i = 0; i < rows; i++)
                memcpy(out + (m0 + i) * ldo, edge + i * NB, sizeof(float) * (size_t)cols);
    }
}

/* A new name for a call whose workers keep weight pairs between its passes of rows: one count for
 * the products and the gated products, whose workers share one pairs buffer (grown() slot 2), so a
 * name never matches pairs another call left there. */
static int64_t new_call(void)
{
    static int64_t calls = 0;
    int64_t call;
#pragma omp atomic capture
    call = ++calls;
    return call;
}

static __thread int64_t kept_call = -1, kept_g0, kept_g1; /* what this worker's pairs buffer holds */

/* A worker's pairs buffer for its groups g0 .. g1 of a wide call (``group_words`` u32 each): all of
 * them where they take at most KEEP_PAIRS_BYTES (*keep; made in the call's first pass, kept for the
 * later ones), else a block of ``per_block``. *fresh: whether they must be made now. NULL if the
 * buffer cannot be had. */
static uint32_t *pairs_buffer(int64_t call, int64_t g0, int64_t g1, int64_t group_words, int64_t per_block, int *keep,
                              int *fresh)
{
    *keep = (size_t)(g1 - g0) * (size_t)group_words * 4 <= KEEP_PAIRS_BYTES;
    uint32_t *pairs = grown(2, (size_t)(*keep ? g1 - g0 : per_block) * (size_t)group_words * 4);
    *fresh = !(*keep && kept_call == call && kept_g0 == g0 && kept_g1 == g1);
    kept_call = *keep && pairs ? call : -1, kept_g0 = g0, kept_g1 = g1;
    return pairs;
}

/* Weight rows of groups g0 .. g1 (NB each): a panel decoded (or read in place), multiplied with every
 * row of x, the results written or added into out. ``wide``: x16 in tile order is the A operand, the
 * panel turned into pairs (a cost of N x K, against write_out's M x N: cheaper from WIDE_ROWS rows on)
 * and the tiles stored straight into out; else x in pairs (xs) is the B operand and the transposed
 * sums are turned after the last panel of K. A wide call takes a thread's groups in blocks whose pairs
 * fit PAIRS_L2_BYTES of L2, every 32 rows of x against each group of a block in turn: the rows' tiles
 * of x are reread from L1 after the first group, and out is written a row's runs in order (each group
 * against every row of the pass in turn read x from L2 for every group and stored its sums 1.5-2 KiB
 * apart: 0.7-1.2 TFLOP/s a core, against 1.5 so). Where all of a thread's pairs take at most
 * KEEP_PAIRS_BYTES they are made in the call's first pass of rows and kept for the later ones
 * (``call`` names the call; the thread's buffer says which call and groups it holds: at 2,000 rows
 * and K 1,536 a call has seven passes, and turning every panel again in each was a sixth of its
 * time); a larger weight's are made a block at a time in every pass. */
static int groups(const AmxLayout *L, const void *xs, int wide, int64_t call, int64_t Kp, int64_t M, int64_t Mp,
                  float *out, int64_t ldo, int accumulate, int64_t g0, int64_t g1)
{
    const int64_t kc_max = MIN(KC, Kp), group_words = Kp / 2 * NB;
    /* row: kc_max floats; panel: NB x kc_max bfloat16; then an edge of 32 x NB floats (wide), or the
     * sums, NB x Mp floats */
    const size_t words = (size_t)kc_max + (size_t)kc_max / 2 * NB + (wide ? 32 * NB : (size_t)Mp * NB);
    float *row = grown(1, words * 4);
    if (!row)
        return 1;
    uint16_t *panel = (uint16_t *)(row + kc_max);
    float *acc = row + kc_max + kc_max / 2 * NB; /* the sums, or the edge */
    const int64_t per_block = MAX(1, PAIRS_L2_BYTES / (group_words * 4)), chunk = k_chunk(Kp);
    int keep = 0, fresh = 1;
    uint32_t *pairs = wide ? pairs_buffer(call, g0, g1, group_words, per_block, &keep, &fresh) : NULL;
    if (wide && !pairs)
        return 1;
    configure();
    if (wide) {
        for (int64_t b0 = g0; b0 < g1; b0 += per_block) {
            const int64_t b1 = MIN(g1, b0 + per_block);
            uint32_t *block = pairs + (keep ? b0 - g0 : 0) * group_words; /* group g's pairs: (g - b0) further */
            for (int64_t g = b0; g < b1 && fresh; g++) /* the block's panels turned: out comes in its own layout */
                for (int64_t k0 = 0; k0 < Kp; k0 += KC) {
                    const int64_t kc = MIN(KC, Kp - k0);
                    int64_t ps;
                    const uint16_t *at = panel_at(L, g * NB, k0, kc, row, panel, &ps);
                    if (!at) {
                        kept_call = -1;
                        _tile_release();
                        return 2;
                    }
                    to_pairs(at, ps, NB, kc, block + (g - b0) * group_words + k0 / 2 * NB, 16, STEP_WORDS, TILE_WORDS);
                }
            for (int64_t m0 = 0; m0 < M; m0 += 32)
                for (int64_t k0 = 0; k0 < Kp; k0 += chunk) /* x's chunk in L1 for every group of the block */
                    for (int64_t g = b0; g < b1; g++)
                        multiply_rows(xs, Kp, M, m0, m0 + 32, k0, MIN(chunk, Kp - k0),
                                      block + (g - b0) * group_words + k0 / 2 * NB, MIN(NB, L->N - g * NB),
                                      out + g * NB, ldo, accumulate || k0 > 0, acc);
        }
        _tile_release();
        return 0;
    }
    for (int64_t g = g0; g < g1; g++) {
        const int64_t n0 = g * NB, cols = MIN(NB, L->N - n0);
        for (int64_t k0 = 0; k0 < Kp; k0 += KC) {
            const int64_t kc = MIN(KC, Kp - k0);
            int64_t ps = 0;
            const uint16_t *at = panel_at(L, n0, k0, kc, row, panel, &ps);
            if (!at) {
                _tile_release();
                return 2;
            }
            multiply(xs, Mp, k0, kc, at, ps, acc, k0 == 0);
        }
        write_out(acc, Mp, M, cols, out + n0, ldo, accumulate);
    }
    _tile_release();
    return 0;
}

/* x [M, K] rounded to bfloat16 by the calling team, a share of rows each (an omp for, inside a
 * parallel region), into tile order: for each 16 rows, their 32 values of each step of K side by
 * side (1 KiB), so a tile's load reads one contiguous run (row-major rows, 16 lines 2 KiB apart,
 * loaded slower). Rows past M up to Mp and values past K are zero. */
static void pack_tile_order(const float *x, int64_t ldx, int64_t M, int64_t Mp, int64_t K, int64_t Kp, uint16_t *x16)
{
#pragma omp for schedule(static)
    for (int64_t m = 0; m < Mp; m++) {
        uint16_t *r = x16 + (m / 16) * 16 * Kp + (m % 16) * KSTEP; /* value k at r + (k / 32) * 512 + k % 32 */
        for (int64_t k = 0; k < Kp; k += 16) {
            const int64_t left = m < M ? MIN(16, MAX(0, K - k)) : 0;
            const __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << left) - 1), x + m * ldx + k);
            _mm256_storeu_si256((__m256i *)(r + (k / KSTEP) * 16 * KSTEP + k % KSTEP), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

/* act(g) * u, 16 values: SiLU g / (1 + e^-g), or GELU-tanh g / (1 + e^-2y), y = sqrt(2/pi) (g + 0.044715 g^3)
 * (cpu_ops.c's forms, with exp2_ps). */
static inline __m512 gated16(__m512 g, __m512 u, int activation)
{
    const __m512 minus_log2e = _mm512_set1_ps(-1.4426950408889634f);
    __m512 z = g; /* the exponent's argument, before -log2(e) */
    if (activation == GELU_TANH) {
        const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
        z = _mm512_mul_ps(_mm512_set1_ps(2.0f * 0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
    }
    const __m512 e = exp2_ps(_mm512_mul_ps(z, minus_log2e));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

/* acc[m, 0..64) (+)= x16[m] . the group's gate and up tiles over k0 .. k0 + kc (M a multiple of 32;
 * ``group`` in gated_tiles' layout): for each 32 rows of x and each half of the group's 32 columns, the
 * 2 x 2 block of tile products (two A tiles of x, the half's gate and up B tiles, side by side): one
 * tile load a product, and the second half finds its rows of x still in L1. */
static void multiply_gated(const uint16_t *x16, int64_t Kp, int64_t M, int64_t k0, int64_t kc, const uint32_t *group,
                           float *acc, int first)
{
    const int64_t xs = KSTEP * 2, cs = 2 * NB * 4, tile = 16 * KSTEP;
    for (int64_t m0 = 0; m0 < M; m0 += 32)
        for (int64_t half = 0; half < 2; half++) {
            float *c = acc + m0 * 2 * NB + half * 16; /* gate columns; up's NB further on */
            start_tiles(first, c, c + NB, c + 16 * 2 * NB, c + 16 * 2 * NB + NB, cs);
            const uint16_t *a = x16 + m0 * Kp + k0 * 16;
            const uint32_t *b = group + half * (Kp / KSTEP) * STEP_WORDS + k0 / KSTEP * STEP_WORDS;
            for (int64_t s = 0; s < kc / KSTEP; s++)
                dp_2x2(a + s * tile, a + 16 * Kp + s * tile, xs, b + s * STEP_WORDS, b + s * STEP_WORDS + TILE_WORDS, 64);
            store_tiles(c, c + NB, c + 16 * 2 * NB, c + 16 * 2 * NB + NB, cs);
        }
}

/* Groups g0 .. g1 of the gated MLP's columns: gate rows gate0 + n and up rows up0 + n of their
 * weights (one weight with both, or two), decoded and paired panel by panel (in the call's first
 * pass of rows, kept for the later ones as groups() keeps them); after the last panel of K,
 * out[m, n] = act(gate) * up, or (out16 not NULL) the same rounded to bfloat16 into out16 in tile
 * order (rows of Ip values, every row up to a multiple of 32: the down projection's x). */
static int groups_gated(const AmxLayout *G, int64_t gate0, const AmxLayout *U, int64_t up0, int64_t I,
                        const uint16_t *x16, int64_t call, int64_t Kp, int64_t M, float *out, int64_t ldo,
                        uint16_t *out16, int64_t Ip, int activation, int64_t g0, int64_t g1)
{
    const int64_t kc_max = MIN(KC, Kp), Mp = (M + 31) / 32 * 32;
    const int64_t group_words = Kp / 2 * NB * 2; /* a group's gate pairs, then its up pairs */
    /* as groups(): blocks of groups whose pairs stay in L2, every 32 rows of x against each in turn; a
     * thread's pairs kept for the call's later passes where they take at most KEEP_PAIRS_BYTES */
    const int64_t per_block = MAX(1, PAIRS_L2_BYTES / (group_words * 4));
    /* row: kc_max floats; panel: NB x kc_max bfloat16; acc: 32 x 2 NB floats a group of the block (32
     * rows' sums) */
    const size_t words = (size_t)kc_max + (size_t)kc_max / 2 * NB + (size_t)per_block * 32 * 2 * NB;
    float *row = grown(1, words * 4);
    const int64_t chunk = k_chunk(Kp);
    int keep, fresh;
    uint32_t *pairs = pairs_buffer(call, g0, g1, group_words, per_block, &keep, &fresh);
    if (!row || !pairs)
        return 1;
    uint16_t *panel = (uint16_t *)(row + kc_max);
    float *acc = (float *)(panel + kc_max * NB);
    configure();
    for (int64_t b0 = g0; b0 < g1; b0 += per_block) {
        const int64_t b1 = MIN(g1, b0 + per_block);
        uint32_t *block = pairs + (keep ? b0 - g0 : 0) * group_words; /* group g's pairs: (g - b0) further */
        for (int64_t g = b0; g < b1 && fresh; g++) /* the block's gate and up panels turned into pairs */
            for (int64_t k0 = 0; k0 < Kp; k0 += KC) {
                const int64_t kc = MIN(KC, Kp - k0);
                /* half h's step s: its gate tile at (h Kp / 32 + s) STEP_WORDS, its up tile next */
                uint32_t *gate = block + (g - b0) * group_words + k0 / KSTEP * STEP_WORDS, *up = gate + TILE_WORDS;
                for (int part = 0; part < 2; part++) {
                    int64_t ps;
                    const uint16_t *at = panel_at(part ? U : G, (part ? up0 : gate0) + g * NB, k0, kc, row, panel, &ps);
                    if (!at) {
                        kept_call = -1;
                        _tile_release();
                        return 2;
                    }
                    to_pairs(at, ps, NB, kc, part ? up : gate, 16, STEP_WORDS, Kp / KSTEP * STEP_WORDS);
                }
            }
        for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
            for (int64_t k0 = 0; k0 < Kp; k0 += chunk) /* x's chunk in L1 for every group of the block */
                for (int64_t g = b0; g < b1; g++)
                    multiply_gated(x16 + m0 * Kp, Kp, 32, k0, MIN(chunk, Kp - k0), block + (g - b0) * group_words,
                                   acc + (g - b0) * 32 * 2 * NB, k0 == 0);
            for (int64_t g = b0; g < b1; g++) {
                const int64_t n0 = g * NB, cols = MIN(NB, I - n0);
                const __mmask16 lo = (__mmask16)((1u << MIN(16, cols)) - 1);
                const __mmask16 hi = (__mmask16)((1u << MAX(0, cols - 16)) - 1);
                for (int64_t m = m0; m < MIN(m0 + 32, out16 ? Mp : M); m++) {
                    const float *a = acc + (g - b0) * 32 * 2 * NB + (m - m0) * 2 * NB;
                    const __m512 v0 = gated16(_mm512_loadu_ps(a), _mm512_loadu_ps(a + NB), activation);
                    const __m512 v1 = gated16(_mm512_loadu_ps(a + 16), _mm512_loadu_ps(a + NB + 16), activation);
                    if (out16) { /* this group's 32 values of row m: one run of the tile order; zeros past I and M */
                        const __m512 z = _mm512_setzero_ps();
                        const __m512 w0 = m < M ? _mm512_mask_mov_ps(z, lo, v0) : z;
                        const __m512 w1 = m < M ? _mm512_mask_mov_ps(z, hi, v1) : z;
                        _mm512_storeu_si512(out16 + (m / 16) * 16 * Ip + (n0 / KSTEP) * 16 * KSTEP + (m % 16) * KSTEP,
                                            (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
                        continue;
                    }
                    float *o = out + m * ldo + n0;
                    _mm512_mask_storeu_ps(o, lo, v0);
                    _mm512_mask_storeu_ps(o + 16, hi, v1);
                }
            }
        }
    }
    _tile_release();
    return 0;
}

/* x [M, K] into the B operand's pairs (pair p of row m at [p][m], Mp rows) by the calling team (an omp
 * for): 16 rows by 32 values rounded (zeros past M and K) and turned 16 x 16 pairs at a time. */
static void pack_pairs(const float *x, int64_t ldx, int64_t M, int64_t Mp, int64_t K, int64_t Kp, uint32_t *xp)
{
#pragma omp for schedule(static) collapse(2)
    for (int64_t m0 = 0; m0 < Mp; m0 += 16)
        for (int64_t k = 0; k < Kp; k += KSTEP) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) {
                const int64_t m = m0 + i, lo = m < M ? MIN(16, MAX(0, K - k)) : 0;
                const int64_t hi = m < M ? MIN(16, MAX(0, K - k - 16)) : 0;
                const __m512 a = _mm512_maskz_loadu_ps((__mmask16)((1u << lo) - 1), x + m * ldx + k);
                const __m512 b = _mm512_maskz_loadu_ps((__mmask16)((1u << hi) - 1), x + m * ldx + k + 16);
                r[i] = (__m512)_mm512_cvtne2ps_pbh(b, a);
            }
            transpose16(r);
            for (int j = 0; j < 16; j++)
                _mm512_storeu_ps((float *)(xp + (k / 2 + j) * Mp + m0), r[j]);
        }
}

/* out[M, N] (+)= x . W^T on the tiles, x packed by every thread (from WIDE_ROWS rows in tile order as
 * the A operand, below in pairs as the B). 0; 1 when a buffer could not be had; 2 when the decoder
 * failed. */
static int amx_matmul(const float *x, int64_t ldx, const uint16_t *given, const AmxLayout *L, float *out, int64_t ldo,
                      int64_t M, int flags, int64_t call, int num_threads)
{
    const int wide = M >= WIDE_ROWS || given;
    const int64_t K = L->K, Kp = (K + KSTEP - 1) / KSTEP * KSTEP, Mp = wide ? (M + 31) / 32 * 32 : (M + 15) / 16 * 16;
    void *xs = given ? (void *)given : grown(0, (size_t)(Mp * Kp) * 2);
    if (!xs)
        return 1;
    const int64_t G = (L->N + NB - 1) / NB;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (wide || G > 1)
    {
        if (given)
            ; /* x came in tile order */
        else if (wide)
            pack_tile_order(x, ldx, M, Mp, K, Kp, xs);
        else
            pack_pairs(x, ldx, M, Mp, K, Kp, xs);
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t g0 = G * t / T, g1 = G * (t + 1) / T;
        const int rc = g1 > g0 ? groups(L, xs, wide, call, Kp, M, Mp, out, ldo, flags & ACCUMULATE, g0, g1) : 0;
        if (rc)
#pragma omp atomic write
            failed = rc;
    }
    return failed;
}

/* Rows of x per pass of a call (X_BLOCK_BYTES of their bfloat16): each pass decodes W again, while x's
 * tiles are reread (from L3) once a block of groups. A 2,000-token prefill of a 1B-shaped Q4_K_M file
 * in one pass instead of eight (1 MiB, x in L2): 4.3 -> 2.9 s; SmolLM2 0.58 -> 0.55 s (bfloat16),
 * 0.56 -> 0.51 s (Q4_1). */
static int64_t pass_rows(int64_t Kp, int wide)
{
    return MIN(wide ? WIDE_PASS : 256, MAX(32, X_BLOCK_BYTES / (2 * Kp) / 32 * 32));
}

#endif

/* 1 where this build has the tiles and the kernel has them from Linux, else 0. */
int trillm_amx_available(void)
{
    return amx_granted();
}

/* out[M, N] (+)= x . W^T on the tiles, x float32 rows or (``given``, not NULL) already in tile order. */
static int matmul_passes(const float *x, int64_t ldx, const uint16_t *given, const void *layout, float *out, int64_t ldo,
                         int64_t M, int flags, int num_threads)
{
    const AmxLayout *L = layout;
    if (M <= 0 || L->N <= 0)
        return 0;
#if AMX
    if (!trillm_amx_available())
        return 3;
    const int64_t call = new_call(); /* for the pairs its workers keep between passes */
    const int64_t Kp = (L->K + KSTEP - 1) / KSTEP * KSTEP, rows = pass_rows(Kp, M >= WIDE_ROWS || given);
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int64_t m = MIN(rows, M - m0);
        const int rc = amx_matmul(given ? NULL : x + m0 * ldx, ldx, given ? given + m0 * Kp : NULL, L, out + m0 * ldo,
                                  ldo, m, flags, call, num_threads);
        if (rc)
            return rc;
    }
    return 0;
#else
    (void)x, (void)ldx, (void)given, (void)out, (void)ldo, (void)flags, (void)num_threads;
    return 3;
#endif
}

/* out[M, N] (+)= x . W^T on the tiles, whatever M. 0; 1 no buffer; 2 the decoder failed; 3 no tiles here. */
int trillm_amx_matmul(const float *x, int64_t ldx, const void *layout, float *out, int64_t ldo, int64_t M, int flags,
                      int num_threads)
{
    return matmul_passes(x, ldx, NULL, layout, out, ldo, M, flags, num_threads);
}

/* trillm_amx_matmul with x16 (M rows of the layout's K) already in tile order (trillm_amx_pack's layout). */
int trillm_amx_matmul_tiles(const uint16_t *x16, const void *layout, float *out, int64_t ldo, int64_t M, int flags,
                            int num_threads)
{
    return matmul_passes(NULL, 0, x16, layout, out, ldo, M, flags, num_threads);
}

/* x16 = x [M, K] rounded to bfloat16 in tile order: for each 16 rows, their 32 values of each step of
 * K side by side (1 KiB); rows M .. up to a multiple of 32 and values K .. up to one of 32 zero. With
 * ``weight`` (not NULL), each row is first RMS-normed with it (eps), as cpu_ops' rms_norm norms it:
 * a wide step's norm hands its output to the tiles without a float32 copy in memory. 0; 1 no
 * buffer; 3 no tiles here. */
int trillm_amx_pack(const float *x, int64_t ldx, const float *weight, float eps, int64_t M, int64_t K, uint16_t *x16,
                    int num_threads)
{
#if AMX
    const int64_t Kp = (K + KSTEP - 1) / KSTEP * KSTEP, Mp = (M + 31) / 32 * 32;
    if (!weight) {
#pragma omp parallel num_threads(num_threads)
        pack_tile_order(x, ldx, M, Mp, K, Kp, x16);
        return 0;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *row = grown(1, (size_t)Kp * 4);
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < Mp; m++) {
            uint16_t *r = x16 + (m / 16) * 16 * Kp + (m % 16) * KSTEP;
            if (!row)
                continue;
            if (m < M)
                rms_norm_row(x + m * ldx, weight, row, K, eps);
            memset(row + (m < M ? K : 0), 0, sizeof(float) * (size_t)(m < M ? Kp - K : Kp));
            for (int64_t k = 0; k < Kp; k += KSTEP)
                _mm512_storeu_si512(r + (k / KSTEP) * 16 * KSTEP,
                                    (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + k + 16), _mm512_loadu_ps(row + k)));
        }
    }
    return failed;
#else
    (void)x, (void)ldx, (void)weight, (void)eps, (void)M, (void)K, (void)x16, (void)num_threads;
    return 3;
#endif
}

/* act(x . Wg^T) * (x . Wu^T) in passes of rows: x float32 rows or (``given``) in tile order; into out
 * (float32 rows) or (``out16``) bfloat16 in tile order. */
static int gated_passes(const float *x, int64_t ldx, const uint16_t *given, const void *gate, int64_t gate0,
                        const void *up, int64_t up0, int64_t I, float *out, int64_t ldo, uint16_t *out16, int64_t M,
                        int activation, int num_threads)
{
    const AmxLayout *G = gate, *U = up;
    if (M <= 0 || I <= 0)
        return 0;
    if (G->K != U->K || gate0 + I > G->N || up0 + I > U->N || (activation != SILU && activation != GELU_TANH))
        return 4;
#if AMX
    if (!trillm_amx_available())
        return 3;
    const int64_t K = G->K, Kp = (K + KSTEP - 1) / KSTEP * KSTEP, Ip = (I + KSTEP - 1) / KSTEP * KSTEP;
    const int64_t rows = pass_rows(Kp, 1);
    const int64_t groups = (I + NB - 1) / NB;
    const int64_t call = new_call(); /* for the pairs its workers keep between passes */
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int64_t m = MIN(rows, M - m0), Mp = (m + 31) / 32 * 32;
        const uint16_t *x16 = given ? given + m0 * Kp : grown(0, (size_t)(Mp * Kp) * 2);
        if (!x16)
            return 1;
        int failed = 0;
#pragma omp parallel num_threads(num_threads)
        {
            if (!given)
                pack_tile_order(x + m0 * ldx, ldx, m, Mp, K, Kp, (uint16_t *)x16);
            const int t = omp_get_thread_num(), T = omp_get_num_threads();
            const int64_t g0 = groups * t / T, g1 = groups * (t + 1) / T;
            const int rc = g1 > g0 ? groups_gated(G, gate0, U, up0, I, x16, call, Kp, m, out16 ? NULL : out + m0 * ldo,
                                                  ldo, out16 ? out16 + m0 * Ip : NULL, Ip, activation, g0, g1)
                                   : 0;
            if (rc)
#pragma omp atomic write
                failed = rc;
        }
        if (failed)
            return failed;
    }
    return 0;
#else
    (void)x, (void)ldx, (void)given, (void)out, (void)ldo, (void)out16, (void)num_threads;
    return 3;
#endif
}

/* out[M, I] = act(x . Wg^T) * (x . Wu^T), the gated MLP's gate/up product and activation in one pass
 * on the tiles (act: 1 SiLU, 2 GELU-tanh): Wg rows gate0 .. gate0 + I of ``gate``, Wu rows up0 .. of
 * ``up`` (the same layout for a weight that holds both). No [M, 2 I] product in memory, no separate
 * activation pass over it. 0; 1 no buffer; 2 the decoder failed; 3 no tiles here; 4 bad arguments. */
int trillm_amx_gated(const float *x, int64_t ldx, const void *gate, int64_t gate0, const void *up, int64_t up0,
                     int64_t I, float *out, int64_t ldo, int64_t M, int activation, int num_threads)
{
    return gated_passes(x, ldx, NULL, gate, gate0, up, up0, I, out, ldo, NULL, M, activation, num_threads);
}

/* trillm_amx_gated with x16 in tile order (trillm_amx_pack's layout) and, where out16 is not NULL, the
 * product rounded to bfloat16 into out16 in tile order instead of out: the down projection's x as
 * trillm_amx_matmul_tiles takes it (I rounded up to 32 values a row, M to 32 rows, zeros there). */
int trillm_amx_gated_tiles(const uint16_t *x16, const void *gate, int64_t gate0, const void *up, int64_t up0, int64_t I,
                           float *out, int64_t ldo, uint16_t *out16, int64_t M, int activation, int num_threads)
{
    return gated_passes(NULL, 0, x16, gate, gate0, up, up0, I, out, ldo, out16, M, activation, num_threads);
}

/* cpu_forward.c's MatmulFn: from min_rows rows on the tiles (by kernel_rows), below them the weight's
 * own matmul. */
int trillm_amx_layout_matmul(const float *x, int64_t ldx, const void *layout, float *out, int64_t ldo, int64_t M,
                             int flags, int num_threads)
{
    const AmxLayout *L = layout;
    if (kernel_rows(flags, M) < L->min_rows)
        return L->below(x, ldx, L->below_layout, out, ldo, M, flags, num_threads);
    const int rc = trillm_amx_matmul(x, ldx, layout, out, ldo, M, flags, num_threads);
    return rc ? 2 : 0; /* the loop's code for a kernel that could not run */
}
