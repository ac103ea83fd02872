/* What the AMX kernels share (cpu_amx.c's matmuls, cpu_flash.c's attention): whether this build
 * has the tiles, asking Linux for them, the one tile shape both use, the C tiles' start and store,
 * the 2 x 2 block of tile products, a 16 x 16 transpose, the pair layout and a vector 2^x.
 * AMX is 1 where the compiler (-march=native) has AMX-BF16 and AVX512-BF16 on Linux, else 0 and
 * nothing below but amx_granted() (which then answers 0) is defined. */
#ifndef TRILLM_CPU_AMX_H
#define TRILLM_CPU_AMX_H

#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define AMX 0
#endif

#if AMX

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static inline void configure(void)
{
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* C tiles 0-3 zeroed (``first``) or loaded from c0 .. c3 (row stride in bytes; c2 NULL: tiles 2 and 3
 * left as they are, a block of 16 rows of x where 32 would be). */
static inline void start_tiles(int first, const float *c0, const float *c1, const float *c2, const float *c3,
                               int64_t stride)
{
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        return;
    }
    _tile_loadd(0, c0, stride);
    _tile_loadd(1, c1, stride);
    if (c2) {
        _tile_loadd(2, c2, stride);
        _tile_loadd(3, c3, stride);
    }
}

/* C tiles 0-3 stored to c0 .. c3 (row stride in bytes; c2 NULL: tiles 2 and 3 not stored). */
static inline void store_tiles(float *c0, float *c1, float *c2, float *c3, int64_t stride)
{
    _tile_stored(0, c0, stride);
    _tile_stored(1, c1, stride);
    if (c2) {
        _tile_stored(2, c2, stride);
        _tile_stored(3, c3, stride);
    }
}

/* C tiles 0-3 (+)= A tiles 4 (a0) and 5 (a1) by B tiles 6 (b0) and 7 (b1), strides in bytes: the 2 x 2
 * block of tile products the kernels here are made of (C0 = a0 b0, C1 = a0 b1, C2 = a1 b0, C3 = a1 b1). */
static inline void dp_2x2(const void *a0, const void *a1, int64_t as, const void *b0, const void *b1, int64_t bs)
{
    _tile_loadd(4, a0, as);
    _tile_loadd(5, a1, as);
    _tile_loadd(6, b0, bs);
    _tile_loadd(7, b1, bs);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

/* 1 once Linux has granted this process the tiles' state (asked once), else 0. */
static inline int amx_granted(void)
{
    static int state = -1;
    if (state < 0)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

/* 2^x, a degree-5 polynomial around the nearest integer (3e-6 relative); x below -126 gives 2^-126
 * (-inf too: callers mask it), x past 128 infinity. */
static inline __m512 exp2_ps(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n); /* [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* r[i] lane j <- r[j] lane i (16 x 16 floats). */
static inline void transpose16(__m512 r[16])
{
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 2; j++) {
            const __m512d a = _mm512_castps_pd(t[4 * i + j]), b = _mm512_castps_pd(t[4 * i + 2 + j]);
            r[4 * i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            r[4 * i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
    }
}

/* ``count`` rows (a multiple of 16) of ``values`` bfloat16 each (a multiple of 32; row stride ``stride``)
 * as B operands' pairs (pair p of row c at [p][c], u32), a 16 x 16 transpose of pairs per 16 rows and
 * 32 values: the block of pairs p0 .. p0 + 16 of rows c0 .. c0 + 16 starts at pairs + (p0 / 16) * step
 * + (c0 / 16) * across, its 16 rows of pairs ``ld`` apart. One matrix of pairs (ld the rows' count,
 * step 16 ld, across 16: cpu_flash.c's keys) or a tile a block (ld 16: cpu_amx.c's weight tiles, laid
 * out as its products load them). */
static inline void to_pairs(const uint16_t *rows, int64_t stride, int64_t count, int64_t values, uint32_t *pairs,
                            int64_t ld, int64_t step, int64_t across)
{
    for (int64_t p0 = 0; p0 < values / 2; p0 += 16)
        for (int64_t c0 = 0; c0 < count; c0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = _mm512_loadu_ps((const float *)(rows + (c0 + i) * stride) + p0);
            transpose16(r);
            uint32_t *block = pairs + p0 / 16 * step + c0 / 16 * across;
            for (int j = 0; j < 16; j++)
                _mm512_storeu_ps((float *)(block + j * ld), r[j]);
        }
}

#else

static inline int amx_granted(void)
{
    return 0;
}

#endif
#endif
