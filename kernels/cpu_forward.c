/* The layers of a decode-only step in one call, for kernels/cpu_forward.py (ctypes).
 *
 * At one row a decode step is ~300 small kernel calls (RMSNorm, block matmul, rotary,
 * K/V store, decode attention, SiLU-mul per layer); from Python each costs several
 * microseconds of wrapping, a third of the step. This loop makes the same calls, in the
 * same order and on the same buffers, from C: the kernels are the ones the Python path
 * uses (cpu_ops.c, cpu_matmul.c, cpu_gguf.c, cpu_decode.c, each its own library), reached
 * through function pointers that the Python side looks up once. So the result is bit for bit
 * the Python path's.
 *
 * A projection is one to four parts side by side (Q and K in Q4_K beside V in Q6_K), each with
 * its own matmul and weight layout, written into its columns of the output.
 */
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h" /* store_kv: a cache row in its form */

typedef int (*MatmulFn)(const float *x, int64_t ldx, const void *layout, float *out, int64_t ldo, int64_t M,
                        int flags, int num_threads);
typedef void (*RmsNormFn)(const float *x, int64_t x_stride, const float *w, float *out, int64_t T, int64_t N,
                          float eps, int num_threads);
typedef void (*RotaryFn)(float *qk, int64_t row_stride, int64_t head_stride, const float *cos_, const float *sin_,
                         int64_t T, int64_t H, int64_t D, int num_threads);
typedef void (*SiluMulFn)(const float *gu, int64_t gu_stride, float *out, int64_t T, int64_t I, int num_threads);
typedef int (*DecodeFn)(const float *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                        const int32_t *context_lens, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                        int64_t num_pages, int64_t page_size, int64_t max_pages, float scale, int num_threads,
                        int64_t window, const float *sinks, float softcap, int kv);

typedef int (*GroupedFn)(const float *x, int64_t ldx, int64_t x_step, int type, const uint8_t *const *ws, int64_t G,
                         int64_t row_bytes, int64_t N, int64_t K, float *out, int64_t ldo, int64_t out_step, int64_t M,
                         int flags, int num_threads);

enum { ACCUMULATE = 1 }; /* the matmuls' flag: out += x @ W^T */
#define MAX_TOP_K 16

typedef struct { /* _Part in cpu_forward.py: out[:, col0 : col0 + its rows] (+)= x @ W^T */
    MatmulFn matmul;
    const void *layout; /* cpu_matmul's block layout, or cpu_gguf's GGUFLayout */
    int64_t col0;
} Part;

#define MAX_PARTS 4

typedef struct { /* _Projection in cpu_forward.py */
    int64_t count;
    Part part[MAX_PARTS];
} Projection;

typedef struct { /* _Model in cpu_forward.py */
    RmsNormFn rms_norm;
    RotaryFn rotary;
    SiluMulFn gated_mul; /* silu_mul or gelu_tanh_mul (GeGLU): one signature */
    DecodeFn decode;
    int64_t hidden, heads, kv_heads, head_dim, intermediate, num_pages, page_size;
    int64_t rotary_dim; /* the rotated part of each head (< head_dim: partial rotary) */
    float eps, scale, softcap; /* softcap > 0: the attention scores' (Gemma 2) */
    GroupedFn grouped;         /* cpu_gguf's grouped matmul: a mixture's experts */
    int64_t swiglu_oai;        /* the gated MLP is gpt-oss's (gated_mul unused): clamped at limit, */
    float alpha, limit;        /* gate * sigmoid(alpha gate) * (up + 1) */
    int64_t kv;                /* the KV cache's form: KV_F32, KV_F16 or KV_BF16 (cpu_common.h; stored rounded) */
} Model;

typedef struct {                 /* _Mixture in cpu_forward.py: a mixture of experts, a GGUF file's blocks */
    const float *router;         /* [hidden, experts] float32 */
    int64_t experts, top_k, normalize, inter; /* normalize: the top k's weights sum to 1 */
    int64_t gate_up_type, gate_up_row_bytes, down_type, down_row_bytes, flags; /* flags: the activations' width */
    const uint8_t *const *gate, *const *up, *const *down; /* [experts] each: [inter, hidden] and [hidden, inter] */
    const float *router_bias, *gate_up_bias, *down_bias;  /* gpt-oss: [experts], [experts, 2 inter], [experts, hidden] */
    const Projection *shared_gate_up, *shared_down;       /* Qwen2-MoE's shared expert, or NULL */
    const float *shared_gate;                             /* [hidden]: its output times sigmoid(x . shared_gate) */
    int64_t shared_inter;
} Mixture;

typedef struct {                              /* _Layer in cpu_forward.py */
    const float *input_norm, *post_norm;      /* [hidden] */
    const float *q_norm, *k_norm;             /* [head_dim] per-head norms (Qwen3, Gemma 3), or NULL */
    const float *attn_out_norm, *mlp_out_norm; /* [hidden] norms of each block's output (Gemma), or NULL */
    const Projection *qkv, *o, *gate_up, *down;
    void *k_cache, *v_cache;                  /* [num_pages, page_size, kv_heads, head_dim], as Model's kv */
    int64_t window;                           /* > 0: attends its last `window` tokens only (no sinks here:
                                                 gpt-oss's layers run the Python loop) */
    int64_t local_rope;                       /* rotates by the local tables (Gemma 3's windowed layers) */
    const Mixture *moe;                       /* a mixture of experts in place of gate_up / down, or NULL */
    const float *qkv_bias;                    /* [qkv] (Qwen2, gpt-oss), or NULL */
    const float *sinks;                       /* [heads]: gpt-oss's logit per head in each softmax, or NULL */
    const float *o_bias;                      /* [hidden]: gpt-oss's O bias, or NULL */
} Layer;

/* The gated MLP's act(gate) * up over T rows of [gate (I), up (I)]: the model's kernel, or gpt-oss's
 * clamped SwiGLU as layers.gated_activation computes it (up + 1) * (gate * sigmoid(alpha gate)). */
static void gated(const Model *m, const float *gu, int64_t stride, float *out, int64_t T, int64_t I, int num_threads)
{
    if (!m->swiglu_oai) {
        m->gated_mul(gu, stride, out, T, I, num_threads);
        return;
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < I; i++) {
            float g = gu[t * stride + i], u = gu[t * stride + I + i];
            g = g < m->limit ? g : m->limit;
            u = u < -m->limit ? -m->limit : u > m->limit ? m->limit : u;
            const float sig = 1.0f / (1.0f + expf(-(g * m->alpha)));
            out[t * I + i] = (u + 1.0f) * (g * sig);
        }
}

static int project(const Projection *P, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t M, int flags,
                   int num_threads)
{
    for (int64_t p = 0; p < P->count; p++) {
        const Part *part = &P->part[p];
        const int rc = part->matmul(x, ldx, part->layout, out + part->col0, ldo, M, flags, num_threads);
        if (rc)
            return rc;
    }
    return 0;
}

/* Qwen3's RMSNorm of each of the n heads at row (its D values contiguous), in place through tmp
 * [n, D]: the kernel the Python path runs on the same rows. */
static void head_norm(const Model *m, float *row, const float *w, int64_t n, float *tmp, int num_threads)
{
    m->rms_norm(row, m->head_dim, w, tmp, n, m->head_dim, m->eps, num_threads);
    memcpy(row, tmp, sizeof(float) * (size_t)(n * m->head_dim));
}

/* h += a block's output out [M, hidden], normed first where the family norms it (Gemma: the Python
 * path's h + norm(out), through tmp [M, hidden]), else as it is. */
static void add_block(const Model *m, float *h, const float *out, const float *norm, float *tmp, int64_t M,
                      int num_threads)
{
    const float *add = out;
    if (norm) {
        m->rms_norm(out, m->hidden, norm, tmp, M, m->hidden, m->eps, num_threads);
        add = tmp;
    }
    for (int64_t i = 0; i < M * m->hidden; i++)
        h[i] += add[i];
}

/* Project x into h: accumulated (h += x @ W^T); or, with an output bias (gpt-oss's O) or norm
 * (Gemma), through out and tmp ([M, hidden] each): h += norm(x @ W^T + bias), as the Python path
 * orders them. */
static int project_residual(const Model *m, const Projection *P, const float *bias, const float *norm,
                            const float *x, int64_t ldx, float *h, float *out, float *tmp, int64_t M, int pick,
                            int num_threads)
{
    const int64_t E = m->hidden;
    if (!norm && !bias)
        return project(P, x, ldx, h, E, M, ACCUMULATE | pick, num_threads);
    const int rc = project(P, x, ldx, out, E, M, pick, num_threads);
    if (rc)
        return rc;
    if (bias)
        for (int64_t r = 0; r < M; r++)
            for (int64_t k = 0; k < E; k++)
                out[r * E + k] += bias[k];
    add_block(m, h, out, norm, tmp, M, num_threads);
    return 0;
}

/* One row's mixture, as experts.moe_mlp computes one token's: the router's softmax over every
 * expert in float32, the top k (renormalised where the family does), their gates and ups as one
 * grouped call and their downs as another, each output weighed and summed into out [hidden]; a
 * shared expert's output (Qwen2-MoE), gated, added after.
 * buf: experts + 5 top_k inter + top_k hidden + 3 shared_inter + hidden floats. */
static int mixture(const Model *m, const Mixture *X, const float *x, float *out, float *buf, int num_threads)
{
    const int64_t E = m->hidden, NE = X->experts, K = X->top_k, I = X->inter;
    float *probs = buf, *gu = probs + NE, *rows = gu + 2 * K * I, *act = rows + 2 * K * I, *down = act + K * I;
    for (int64_t e = 0; e < NE; e++)
        probs[e] = 0.0f;
    for (int64_t k = 0; k < E; k++) { /* x . router, a row of the router at a time */
        const float v = x[k], *r = X->router + k * NE;
        for (int64_t e = 0; e < NE; e++)
            probs[e] += v * r[e];
    }
    if (X->router_bias)
        for (int64_t e = 0; e < NE; e++)
            probs[e] += X->router_bias[e];
    float top = probs[0], total = 0.0f;
    for (int64_t e = 1; e < NE; e++)
        top = probs[e] > top ? probs[e] : top;
    for (int64_t e = 0; e < NE; e++)
        total += probs[e] = expf(probs[e] - top);
    int64_t chosen[MAX_TOP_K];
    float w[MAX_TOP_K], kept = 0.0f;
    for (int64_t j = 0; j < K; j++) { /* the largest left, the lower index first among equals */
        int64_t best = -1;
        for (int64_t e = 0; e < NE; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++)
                taken |= chosen[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best]))
                best = e;
        }
        chosen[j] = best;
        kept += w[j] = probs[best] / total;
    }
    if (X->normalize)
        for (int64_t j = 0; j < K; j++)
            w[j] /= kept;
    const uint8_t *ws[2 * MAX_TOP_K];
    for (int64_t j = 0; j < K; j++) {
        ws[j] = X->gate[chosen[j]];
        ws[K + j] = X->up[chosen[j]];
    }
    int rc = m->grouped(x, E, 0, (int)X->gate_up_type, ws, 2 * K, X->gate_up_row_bytes, I, E, gu, 2 * K * I, I, 1,
                        (int)X->flags, num_threads);
    if (rc)
        return rc == 1 ? 2 : 3;
    for (int64_t j = 0; j < K; j++) { /* each expert's gate and up side by side, as the gated mul reads them */
        memcpy(rows + j * 2 * I, gu + j * I, sizeof(float) * (size_t)I);
        memcpy(rows + j * 2 * I + I, gu + (K + j) * I, sizeof(float) * (size_t)I);
        if (X->gate_up_bias)
            for (int64_t i = 0; i < 2 * I; i++)
                rows[j * 2 * I + i] += X->gate_up_bias[chosen[j] * 2 * I + i];
        ws[j] = X->down[chosen[j]];
    }
    gated(m, rows, 2 * I, act, K, I, num_threads);
    rc = m->grouped(act, K * I, I, (int)X->down_type, ws, K, X->down_row_bytes, E, I, down, K * E, E, 1,
                    (int)X->flags, num_threads);
    if (rc)
        return rc == 1 ? 2 : 3;
    for (int64_t k = 0; k < E; k++) {
        float s = 0.0f, b = 0.0f;
        for (int64_t j = 0; j < K; j++)
            s += w[j] * down[j * E + k];
        if (X->down_bias) { /* the downs' biases, weighed as their outputs are, added after */
            for (int64_t j = 0; j < K; j++)
                b += w[j] * X->down_bias[chosen[j] * E + k];
            s += b;
        }
        out[k] = s;
    }
    if (X->shared_gate_up) {
        const int64_t S = X->shared_inter;
        float *su = down + K * E, *sa = su + 2 * S, *sd = sa + S, g = 0.0f;
        if ((rc = project(X->shared_gate_up, x, E, su, 2 * S, 1, 0, num_threads)))
            return rc;
        gated(m, su, 2 * S, sa, 1, S, num_threads);
        if ((rc = project(X->shared_down, sa, S, sd, E, 1, 0, num_threads)))
            return rc;
        for (int64_t k = 0; k < E; k++)
            g += x[k] * X->shared_gate[k];
        g = 1.0f / (1.0f + expf(-g));
        for (int64_t k = 0; k < E; k++)
            out[k] += sd[k] * g;
    }
    return 0;
}

/* h [M, hidden] (in place): the residual stream of M sequences decoding one token each,
 * at cache slots slots[M], rotated by cos/sin [M, rotary_dim] (a layer with local_rope by
 * local_cos/local_sin), attending context_lens[M] tokens through block_tables [M, max_pages].
 * work: M * (hidden + qkv + 2 q + 3 I + hidden) floats. kernel_rows > 0: the projections pick their
 * kernels as for that many rows (cpu_common.h: a step's sequences, when it carries proposed tokens).
 * Returns 0, or the first non-zero code of a kernel (1: a bad table, 2: out of memory). */
int trillm_decode_layers(const Model *m, const Layer *layers, int64_t num_layers, float *h, int64_t M,
                         const float *cos_, const float *sin_, const float *local_cos, const float *local_sin,
                         const int64_t *slots, const int32_t *block_tables, const int32_t *context_lens,
                         int64_t max_pages, float *work, int64_t kernel_rows, int num_threads)
{
    const int pick = (int)(kernel_rows << KERNEL_ROWS_SHIFT); /* into every projection's flags */
    const int64_t E = m->hidden, D = m->head_dim, KVH = m->kv_heads, I = m->intermediate;
    const int64_t q_size = m->heads * D, kv_size = KVH * D, qkv_size = q_size + 2 * kv_size;
    float *x = work, *qkv = x + M * E, *q = qkv + M * qkv_size, *attn = q + M * q_size, *gu = attn + M * q_size,
          *act = gu + M * 2 * I, *tmp = act + M * I;
    int rc = 0;
    float *moe_buf = NULL; /* a mixture's: M hidden outputs, then one row's scratch (mixture) */
    for (int64_t l = 0; l < num_layers; l++) {
        const Mixture *X = layers[l].moe;
        if (X && !moe_buf) {
            int64_t most = 0;
            for (int64_t j = 0; j < num_layers; j++) {
                const Mixture *Y = layers[j].moe;
                const int64_t need = Y ? Y->experts + 5 * Y->top_k * Y->inter + Y->top_k * E + 3 * Y->shared_inter + E : 0;
                most = need > most ? need : most;
            }
            if (!(moe_buf = malloc(sizeof(float) * (size_t)(M * E + most))))
                return 2;
        }
        if (X && (X->top_k < 1 || X->top_k > MAX_TOP_K || X->top_k > X->experts)) {
            free(moe_buf);
            return 3;
        }
    }
    for (int64_t r = 0; r < M; r++) { /* refuse before anything is written */
        const int64_t n = context_lens[r];
        if (slots[r] < 0 || slots[r] >= m->num_pages * m->page_size || n < 0 || n > max_pages * m->page_size)
            return free(moe_buf), 1;
        for (int64_t i = 0; i < (n + m->page_size - 1) / m->page_size; i++)
            if (block_tables[r * max_pages + i] < 0 || block_tables[r * max_pages + i] >= m->num_pages)
                return free(moe_buf), 1;
    }
    for (int64_t l = 0; l < num_layers && !rc; l++) {
        const Layer *L = &layers[l];
        m->rms_norm(h, E, L->input_norm, x, M, E, m->eps, num_threads);
        if ((rc = project(L->qkv, x, E, qkv, qkv_size, M, pick, num_threads)))
            break;
        if (L->qkv_bias)
            for (int64_t r = 0; r < M; r++)
                for (int64_t j = 0; j < qkv_size; j++)
                    qkv[r * qkv_size + j] += L->qkv_bias[j];
        if (L->q_norm && L->k_norm) /* attn is free until the attention writes it: M * q_size floats */
            for (int64_t r = 0; r < M; r++) {
                head_norm(m, qkv + r * qkv_size, L->q_norm, m->heads, attn, num_threads);
                head_norm(m, qkv + r * qkv_size + q_size, L->k_norm, KVH, attn, num_threads);
            }
        /* Q and K sit side by side: one rotary pass for both, as the Python path does. */
        m->rotary(qkv, qkv_size, D, L->local_rope ? local_cos : cos_, L->local_rope ? local_sin : sin_, M,
                  m->heads + KVH, m->rotary_dim, num_threads);
        for (int64_t r = 0; r < M; r++) {
            const float *row = qkv + r * qkv_size;
            const int64_t at = slots[r] * kv_size * KV_BYTES(m->kv);
            store_kv((char *)L->k_cache + at, row + q_size, kv_size, (int)m->kv);
            store_kv((char *)L->v_cache + at, row + q_size + kv_size, kv_size, (int)m->kv);
            memcpy(q + r * q_size, row, sizeof(float) * (size_t)q_size);
        }
        if ((rc = m->decode(q, L->k_cache, L->v_cache, block_tables, context_lens, attn, M, m->heads, KVH, D,
                            m->num_pages, m->page_size, max_pages, m->scale, num_threads, L->window, L->sinks, m->softcap,
                            (int)m->kv)))
            break;
        /* x is free once QKV is projected, and again once gate_up is: the blocks' outputs go there. */
        if ((rc = project_residual(m, L->o, L->o_bias, L->attn_out_norm, attn, q_size, h, x, tmp, M, pick,
                                   num_threads)))
            break;
        m->rms_norm(h, E, L->post_norm, x, M, E, m->eps, num_threads);
        if (L->moe) { /* each row its own experts; h += the outputs (normed first where the family norms them) */
            for (int64_t r = 0; r < M && !rc; r++)
                rc = mixture(m, L->moe, x + r * E, moe_buf + r * E, moe_buf + M * E, num_threads);
            if (rc)
                break;
            add_block(m, h, moe_buf, L->mlp_out_norm, tmp, M, num_threads);
            continue;
        }
        if ((rc = project(L->gate_up, x, E, gu, 2 * I, M, pick, num_threads)))
            break;
        gated(m, gu, 2 * I, act, M, I, num_threads);
        rc = project_residual(m, L->down, NULL, L->mlp_out_norm, act, I, h, x, tmp, M, pick, num_threads);
    }
    free(moe_buf);
    return rc;
}
