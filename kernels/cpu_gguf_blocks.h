/* What cpu_gguf.c and its instruction-set section (cpu_gguf_isa.h) both read: ggml's type ids,
 * one group of blocks unpacked, and a little-endian word of a block. */
#ifndef TRILLM_CPU_GGUF_BLOCKS_H
#define TRILLM_CPU_GGUF_BLOCKS_H

#include <stdint.h>

#include "cpu_common.h" /* INLINE */

/* ggml's type ids (GGMLQuantizationType) */
enum { F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
       Q6_K = 14, BF16 = 30, MXFP4 = 39 };

#define GROUP 8 /* legacy blocks unpacked together: 256 values, as one k-quant block */

/* A block's values are w = dl[s] * q - ml[s] for sub-block s (ml 0 where the type has no
 * minimum: x - 0 is x, so the rounding is the reference's; ``mins`` says whether any is kept).
 * Every type's quants fit int8. */
typedef struct {
    int subs, n, mins; /* sub-blocks, values in each (subs * n values); 1 if the type has minimums */
    float dl[16], ml[16];
    int8_t q[256];
} Unpacked;

INLINE uint32_t u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

#endif
