/* What the CPU kernels share: the inline marker, glibc's vector expf, the tree that
 * adds (or takes the maximum of) a row's partial results, a dot product by it, a row of RMSNorm, the KV
 * cache's forms (float32, float16, bfloat16: their conversions, loads and stores) and a
 * per-thread scratch buffer.
 *
 * Partial sums: a single running sum is a long dependency chain that, without
 * -ffast-math, the compiler may not reorder; 8 or 16 independent partial sums
 * added as a tree at the end vectorise and keep the order of additions fixed (so
 * results are the same on every run and every thread count). The build key of
 * every kernel covers this header (cpu_build.py). */
#ifndef TRILLM_CPU_COMMON_H
#define TRILLM_CPU_COMMON_H

#include <math.h>   /* rms_norm_row: sqrtf */
#include <stdint.h>
#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h> /* store_kv's conversions */
#endif
#include <stdlib.h> /* scratch: posix_memalign, free */
#include <string.h> /* store_kv: memcpy */

#define INLINE static inline __attribute__((always_inline))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* A matmul's flags may carry, from this bit up, the rows by which to pick its kernel instead of its
 * own M (0: M): a decode step's sequences where the step carries proposed tokens, so that every
 * row is computed by the kernel its sequence's plain step would have used (each of them computes
 * a row whatever rows come with it), and speculation's greedy output is the plain one bit for bit. */
#define KERNEL_ROWS_SHIFT 8
INLINE int64_t kernel_rows(int flags, int64_t M)
{
    const int64_t k = (int64_t)((unsigned)flags >> KERNEL_ROWS_SHIFT);
    return k ? k : M;
}

/* glibc's libmvec has vector expf, which math.h declares only under -ffast-math.
 * With -fno-math-errno (the kernels build with it) loops over expf vectorise:
 * about 7x faster than scalar expf. Accuracy: silu over [-100, 100] within 3.0e-7
 * relative of exact (torch's Sleef exp: 2.6e-7). Elsewhere the loops stay scalar. */
#if defined(__x86_64__) && defined(__GLIBC__)
float expf(float) __attribute__((simd("notinbranch")));
#endif

/* part[0] = part[0] + ... + part[lanes - 1], added pairwise as a tree (lanes: 8 or 16). */
INLINE float tree_sum(float *part, int lanes)
{
    for (int w = lanes / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            part[l] += part[l + w];
    return part[0];
}

/* The largest of part[0..lanes), taken pairwise as a tree. */
INLINE float tree_max(float *part, int lanes)
{
    for (int w = lanes / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            part[l] = part[l + w] > part[l] ? part[l + w] : part[l];
    return part[0];
}

/* a . b with 16 partial sums added as a tree (see above), any K. */
INLINE float dot16(const float *restrict a, const float *restrict b, int64_t K)
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

/* Sum of squares with 16 partial sums added as a tree at the end (as `dot` in
 * cpu_decode.c: a single running sum is a long dependency chain, and without
 * -ffast-math the compiler may not reorder it). 16 rather than 8: one AVX-512 or
 * two AVX2 registers; with 8, GCC 12 unrolled N = 576 into shuffles, 6x slower. */
INLINE float sum_squares(const float *restrict x, int64_t N)
{
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= N; i += 16)
        for (int l = 0; l < 16; l++)
            part[l] += x[i + l] * x[i + l];
    for (; i < N; i++)
        part[0] += x[i] * x[i];
    return tree_sum(part, 16);
}

/* One row of RMSNorm as torch computes it (cpu_ops.c's rms_norm, cpu_amx.c's norm into tiles: the
 * same floats). */
INLINE void rms_norm_row(const float *restrict x, const float *restrict w, float *restrict o, int64_t N, float eps)
{
    const float inv = 1.0f / sqrtf(sum_squares(x, N) / (float)N + eps);
    for (int64_t i = 0; i < N; i++)
        o[i] = (x[i] * inv) * w[i]; /* torch: (x * rsqrt(mean + eps)) * weight */
}

/* The KV cache's forms (``--kv-cache-dtype``): float32, or 16 bits a value. float16 (llama.cpp's
 * default cache) keeps 10 bits of mantissa, bfloat16 7; both halve the bytes a cached token takes
 * and a decode step reads. Every reader widens to float32 as it loads. */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };
#define KV_BYTES(kv) ((kv) == KV_F32 ? 4 : 2)

/* A float32's bits and back (memcpy: no aliasing rules broken, one move once compiled). */
INLINE uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

INLINE float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE float bf16_float(uint16_t b) { return float_of((uint32_t)b << 16); }

/* Rounded to nearest even as AVX512-BF16's vcvtneps2bf16 and torch round, so that a cache row holds
 * what the AMX flash kernel would round a float32 row to; a NaN stays a (quiet) NaN. */
INLINE uint16_t float_bf16(float f)
{
    const uint32_t u = bits_of(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)(u >> 16 | 0x40);
    return (uint16_t)((u + 0x7FFFu + (u >> 16 & 1u)) >> 16);
}

#define F16_MAX 65504.0f /* values past it are stored as it (saturated), not as infinity */

#if defined(__FLT16_MAX__) && !defined(TRILLM_PORTABLE)
/* The compiler's _Float16 (GCC 12, clang 15): with F16C (every AVX2 CPU) each conversion is one
 * vcvtph2ps / vcvtps2ph, a value at a time (GCC 12 does not vectorise loops over them: the decode
 * kernel loads 8 or 16 lanes itself); without F16C, library calls, still exact. */
INLINE float f16_float(uint16_t h)
{
    _Float16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v;
}
INLINE uint16_t float_f16(float f)
{
    f = f > F16_MAX ? F16_MAX : f < -F16_MAX ? -F16_MAX : f; /* NaN passes both tests and stays NaN */
    const _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, sizeof h);
    return h;
}
#else /* the same values by integer arithmetic, for compilers without _Float16 (and the portable build's tests) */
INLINE float f16_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = h >> 10 & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        const float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return float_of(sign | (exp == 0x1F ? 0x7F800000u | man << 13 : (exp + 112) << 23 | man << 13));
}

INLINE uint16_t float_f16(float f)
{
    uint32_t u = bits_of(f);
    const uint16_t sign = (uint16_t)(u >> 16 & 0x8000u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return sign | 0x7E00u;
    float a = float_of(u & 0x7FFFFFFFu);
    if (a > F16_MAX)
        a = F16_MAX;
    if (a < 6.103515625e-5f) { /* under 2^-14: a subnormal, man = |f| * 2^24 rounded to nearest even */
        const float scaled = a * 16777216.0f;
        uint32_t man = (uint32_t)scaled;
        const float rest = scaled - (float)man;
        man += rest > 0.5f || (rest == 0.5f && (man & 1u)); /* 1024 rounds up to the least normal: right */
        return sign | (uint16_t)man;
    }
    u = bits_of(a) + 0xFFFu + (bits_of(a) >> 13 & 1u); /* 23 bits of mantissa to 10, to nearest even */
    return sign | (uint16_t)((u >> 13) - (112u << 10));
}
#endif

/* Element i of a cache row at base, widened to float32; kv is a constant wherever this is inlined. */
INLINE float kv_at(const char *base, int64_t i, int kv)
{
    if (kv == KV_F16)
        return f16_float(((const uint16_t *)base)[i]);
    if (kv == KV_BF16)
        return bf16_float(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

/* dst[0..n) (a cache row of form kv) = src[0..n). Where the CPU converts 16 or 8 lanes at once
 * (AVX-512: vcvtps2ph, and vcvtneps2bf16 with AVX512-BF16; F16C: 8 lanes) the bits are the scalar
 * conversions' own: the same instructions, the same nearest-even rounding, float16 clamped first
 * (min/max keep a NaN: they return their second operand when one is NaN). A prefill stores
 * thousands of rows a layer, where a value at a time cost 2 ms. */
INLINE void store_kv(void *restrict dst, const float *restrict src, int64_t n, int kv)
{
    if (kv == KV_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *out = dst;
    int64_t i = 0;
#if !defined(TRILLM_PORTABLE) && defined(__AVX512F__)
    if (kv == KV_F16) {
        const __m512 hi = _mm512_set1_ps(F16_MAX), lo = _mm512_set1_ps(-F16_MAX);
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_max_ps(lo, _mm512_min_ps(hi, _mm512_loadu_ps(src + i)));
            _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
    }
#if defined(__AVX512BF16__)
    if (kv == KV_BF16)
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
#elif !defined(TRILLM_PORTABLE) && defined(__F16C__) && defined(__AVX__)
    if (kv == KV_F16) {
        const __m256 hi = _mm256_set1_ps(F16_MAX), lo = _mm256_set1_ps(-F16_MAX);
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(src + i)));
            _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
    }
#endif
    if (kv == KV_F16)
        for (; i < n; i++)
            out[i] = float_f16(src[i]);
    else
        for (; i < n; i++)
            out[i] = float_bf16(src[i]);
}

/* A per-thread buffer of at least ``floats`` floats, kept between calls (NULL if it cannot be
 * had): the OpenMP team (torch's) lives on, and a fresh malloc of a few hundred KB would be an
 * mmap with page faults on every call. */
static inline float *scratch(size_t floats)
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

#endif
