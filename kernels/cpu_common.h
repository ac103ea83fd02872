/* What the CPU kernels share: the inline marker, glibc's vector expf, the tree that
 * adds (or takes the maximum of) a row's partial results, a dot product by it, and a
 * per-thread scratch buffer.
 *
 * Partial sums: a single running sum is a long dependency chain that, without
 * -ffast-math, the compiler may not reorder; 8 or 16 independent partial sums
 * added as a tree at the end vectorise and keep the order of additions fixed (so
 * results are the same on every run and every thread count). The build key of
 * every kernel covers this header (cpu_build.py). */
#ifndef TRILLM_CPU_COMMON_H
#define TRILLM_CPU_COMMON_H

#include <stdint.h>
#include <stdlib.h> /* scratch: posix_memalign, free */

#define INLINE static inline __attribute__((always_inline))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

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
