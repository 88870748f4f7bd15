/* A decode step's decoder layers on CPU in one call (engine/cpu_decode.py): the same kernels,
 * in the same order, as CausalLM._forward_fused calls them one by one from Python, so the
 * hidden states are bit for bit the same; only the ~40 Python -> C calls of a step (each a few
 * microseconds of argument checks, ctypes conversion and a fresh tensor) become one.
 *
 * At one row of baton-tiny a decode step was ~1.6 ms, ~0.35 ms of it Python between kernels:
 * that, not the kernels, is what separated it from llama.cpp's batch-1 token (with this and the
 * numpy argmax: 1.73-1.87 -> 1.19-1.22 ms). At 32 rows the kernels dominate: 8.6-9.2 -> 7.2-7.5.
 *
 * Per layer (h: the residual stream [B, hidden], updated in place; delta: the MLP's output of
 * the layer before, NULL at the first):
 *     x = add_rms_norm(h, delta, input_norm)        qkv = linear(x, Wqkv, bias)
 *     q = rope_and_cache(qkv -> this layer's pool)  attn = paged_decode(q, plan)
 *     x = add_rms_norm(h, linear(attn, Wo), post_norm)
 *     delta = linear(silu_mul(linear(x, Wgate_up)), Wdown)
 * then out = add_rms_norm(h, delta, final_norm). Weights in linear.c's panel layout.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

void baton_add_rms_norm(float *restrict h, const float *restrict delta, const float *restrict w,
                        float *restrict out, int64_t rows, int64_t cols, float eps);
void baton_silu_mul(const float *restrict gate_up, float *restrict out, int64_t rows, int64_t n);
int baton_rope_and_cache(const float *restrict qkv, int64_t qkv_stride, const float *restrict cos_t,
                         const float *restrict sin_t, int64_t cs_stride, int64_t max_len,
                         const int64_t *restrict pos, const int64_t *restrict slots, int64_t num_slots,
                         float *restrict q_out, kv_t *restrict k_cache, kv_t *restrict v_cache, int64_t T, int H,
                         int KVH, int D);
int baton_paged_decode(const float *q, const kv_t *k_cache, const kv_t *v_cache, const int32_t *items,
                       int num_items, const int64_t *pages, const int32_t *row_ptr, const int32_t *row_slots,
                       float *partials, float *out, int B, int H, int KVH, int D, int page_size, float scale);
int baton_linear(const float *restrict x, int64_t x_stride, int64_t M, int64_t K, const float *restrict w,
                 int64_t N, const float *restrict bias, float *restrict out);

/* one layer's weights, as addresses (engine/cpu_decode.py fills a table of them) */
enum { W_INPUT_NORM, W_QKV, W_QKV_BIAS, W_O, W_POST_NORM, W_GATE_UP, W_DOWN, W_FIELDS };

/* The step's shapes and per-step inputs; the kernels' own arguments, gathered. */
typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *cos, *sin; /* RoPE tables [max_len, head_dim] */
    int64_t cs_stride, max_len;
    kv_t *kv;               /* the pool: layer l's K at kv + l * layer_stride, its V v_offset after */
    int64_t layer_stride, v_offset, num_slots, page_size;
} decode_shape_t;

/* ids [B]: the tokens, looked up in embed [vocab, hidden] (the residual stream starts as their
 * rows); out [B, hidden]: the final RMSNorm of the stream. weights: [num_layers][W_FIELDS]
 * addresses (W_QKV_BIAS 0 where the model has none); final_norm [hidden]. pos, slots: [B];
 * items .. partials: the step's DecodePlan. Returns 0; -1 for a token outside the vocabulary
 * (nothing written) or a shape a kernel refuses (a position outside the RoPE tables, a slot
 * outside the pool, an unsupported head or page size: each checked before that kernel writes,
 * but a later layer's refusal leaves the earlier layers' K/V in the pool, as a failed kernel
 * call does on the Python path; the caller fails the step), -2 out of memory. */
int baton_decode_layers(const decode_shape_t *s, const int64_t *weights, const float *embed, int64_t vocab,
                        const float *final_norm, const int64_t *ids, float *out, int64_t B, const int64_t *pos,
                        const int64_t *slots, const int32_t *items, int num_items, const int64_t *pages,
                        const int32_t *row_ptr, const int32_t *row_slots, float *partials) {
    const int64_t hidden = s->hidden, I = s->intermediate;
    const int64_t q_width = s->heads * s->head_dim, qkv_width = (s->heads + 2 * s->kv_heads) * s->head_dim;
    if (B <= 0 || hidden <= 0 || I <= 0 || q_width <= 0) return -1;
    for (int64_t b = 0; b < B; b++)
        if (ids[b] < 0 || ids[b] >= vocab) return -1;
    /* one block for the step's activations: h (the residual stream), x, qkv, q, attn, proj (also
     * the MLP's delta), gate_up, act */
    enum { NBUF = 8 };
    const int64_t sizes[NBUF] = {hidden, hidden, qkv_width, q_width, q_width, hidden, 2 * I, I};
    float *bufs[NBUF];
    int64_t total = 0;
    for (int i = 0; i < NBUF; i++) total += B * sizes[i];
    float *block = malloc(sizeof(float) * (size_t)total);
    if (block == NULL) return -2;
    bufs[0] = block;
    for (int i = 1; i < NBUF; i++) bufs[i] = bufs[i - 1] + B * sizes[i - 1];
    float *h = bufs[0], *x = bufs[1], *qkv = bufs[2], *q = bufs[3], *attn = bufs[4], *proj = bufs[5],
          *gu = bufs[6], *act = bufs[7];
    for (int64_t b = 0; b < B; b++) memcpy(h + b * hidden, embed + ids[b] * hidden, sizeof(float) * (size_t)hidden);
    const float *delta = NULL;
    int rc = 0;
    for (int64_t l = 0; l < s->num_layers && rc == 0; l++) {
        const int64_t *w = weights + l * W_FIELDS;
        kv_t *k_cache = s->kv + l * s->layer_stride, *v_cache = k_cache + s->v_offset;
        baton_add_rms_norm(h, delta, (const float *)w[W_INPUT_NORM], x, B, hidden, s->eps);
        rc = baton_linear(x, hidden, B, hidden, (const float *)w[W_QKV], qkv_width, (const float *)w[W_QKV_BIAS], qkv);
        if (rc == 0)
            rc = baton_rope_and_cache(qkv, qkv_width, s->cos, s->sin, s->cs_stride, s->max_len, pos, slots,
                                      s->num_slots, q, k_cache, v_cache, B, (int)s->heads, (int)s->kv_heads,
                                      (int)s->head_dim);
        if (rc == 0)
            rc = baton_paged_decode(q, k_cache, v_cache, items, num_items, pages, row_ptr, row_slots, partials,
                                    attn, (int)B, (int)s->heads, (int)s->kv_heads, (int)s->head_dim,
                                    (int)s->page_size, s->scale);
        if (rc == 0) rc = baton_linear(attn, q_width, B, q_width, (const float *)w[W_O], hidden, NULL, proj);
        if (rc != 0) break;
        baton_add_rms_norm(h, proj, (const float *)w[W_POST_NORM], x, B, hidden, s->eps);
        rc = baton_linear(x, hidden, B, hidden, (const float *)w[W_GATE_UP], 2 * I, NULL, gu);
        if (rc != 0) break;
        baton_silu_mul(gu, act, B, I);
        rc = baton_linear(act, I, B, I, (const float *)w[W_DOWN], hidden, NULL, proj);
        delta = proj;
    }
    if (rc == 0) baton_add_rms_norm(h, delta, final_norm, out, B, hidden, s->eps);
    free(block);
    return rc;
}
