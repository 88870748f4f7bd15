/* A decoder layer's elementwise work on CPU in one pass each (engine/cpu_ops.py), as
 * engine/triton_ops.py does on CUDA: the residual add with the next RMSNorm, RoPE with the
 * K/V write into the pool, SiLU with the up product. The torch path runs each as 3-10 ops,
 * every one a dispatch and a pass over [tokens, width] with a fresh tensor: at a decode row
 * that is per-op overhead, at a 2,048-token prefill chunk it is memory traffic.
 *
 * Activations float32 (the model's dtype on this path); the pool float32, or bfloat16/float16
 * (kv_cache_dtype, common.h's kv_t: rounded to nearest even as torch rounds). The arithmetic is
 * torch's, op for op (products and sums in float32, in the same order; RoPE's products are
 * rounded before their sum, as torch's separate mul and add do); only the RMSNorm's sum of
 * squares is added in another order (engine tests bound the difference). OpenMP: torch's pool
 * (see paged_attention.c), and only when a call has enough work to repay waking it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define PARALLEL_MIN 16384  /* floats a call touches below which it runs on the calling thread */

/* h [rows, cols] (+= delta when given: the residual stream, updated in place);
 * out = w * (h * 1/sqrt(mean(h^2) + eps)), as transformers' LlamaRMSNorm in float32. */
void baton_add_rms_norm(float *restrict h, const float *restrict delta, const float *restrict w,
                        float *restrict out, int64_t rows, int64_t cols, float eps) {
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_MIN)
    for (int64_t t = 0; t < rows; t++) {
        float *restrict x = h + t * cols;
        float *restrict o = out + t * cols;
        if (delta != NULL) {
            const float *restrict d = delta + t * cols;
#pragma omp simd
            for (int64_t i = 0; i < cols; i++) x[i] += d[i];
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < cols; i++) ss += x[i] * x[i];
        const float r = 1.0f / sqrtf(ss / (float)cols + eps);
#pragma omp simd
        for (int64_t i = 0; i < cols; i++) o[i] = w[i] * (x[i] * r);
    }
}

/* gate_up [rows, 2n] (gate | up) -> out [rows, n] = silu(gate) * up, silu(g) = g / (1 + e^-g)
 * written through e^-|g| (never overflows): g >= 0: g / (1 + e^-g); g < 0: g e^g / (1 + e^g). */
void baton_silu_mul(const float *restrict gate_up, float *restrict out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t t = 0; t < rows; t++) {
        const float *restrict g = gate_up + t * 2 * n;
        const float *restrict u = g + n;
        float *restrict o = out + t * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float x = g[i];
            const float e = exp_le0(x >= 0.0f ? -x : x);
            const float s = x >= 0.0f ? x / (1.0f + e) : (x * e) / (1.0f + e);
            o[i] = s * u[i];
        }
    }
}

/* x * cos + rotate_half(x) * sin for one head (rotate_half(x) = (-x2, x1)), each product
 * rounded to float32 before the sum (no fused multiply-add), as torch computes it. */
__attribute__((optimize("fp-contract=off")))
static inline void rotate(const float *restrict x, const float *restrict c, const float *restrict s,
                          float *restrict o, int half) {
    for (int i = 0; i < half; i++) {
        const float a1 = x[i] * c[i], b1 = -x[i + half] * s[i];
        const float a2 = x[i + half] * c[i + half], b2 = x[i] * s[i + half];
        o[i] = a1 + b1;
        o[i + half] = a2 + b2;
    }
}

/* qkv [T, (H + 2 KVH) D] (row stride qkv_stride) -> q_out [T, H, D] rotated; k rotated and v
 * stored at their slots of k_cache / v_cache ([pages * page_size, KVH, D], contiguous).
 * cos/sin: the tables [max_len, D] (row stride cs_stride), read at each token's position.
 * Returns -1 (nothing written) for an odd D, a position outside the tables or a slot outside
 * the pool's num_slots. */
int baton_rope_and_cache(const float *restrict qkv, int64_t qkv_stride, const float *restrict cos_t,
                         const float *restrict sin_t, int64_t cs_stride, int64_t max_len,
                         const int64_t *restrict pos, const int64_t *restrict slots, int64_t num_slots,
                         float *restrict q_out,
                         kv_t *restrict k_cache, kv_t *restrict v_cache, int64_t T, int H, int KVH, int D) {
    if (D % 2 || D > 1024) return -1;
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_len || slots[t] < 0 || slots[t] >= num_slots) return -1;
    const int half = D / 2;
#pragma omp parallel for schedule(static) if (T * (H + 2 * KVH) * D >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *restrict row = qkv + t * qkv_stride;
        const float *restrict c = cos_t + pos[t] * cs_stride;
        const float *restrict s = sin_t + pos[t] * cs_stride;
        for (int h = 0; h < H; h++) rotate(row + h * D, c, s, q_out + (t * H + h) * D, half);
        kv_t *restrict kd = k_cache + slots[t] * KVH * D;
        kv_t *restrict vd = v_cache + slots[t] * KVH * D;
        const float *restrict k = row + H * D;
        const float *restrict v = k + KVH * D;
        float kr[1024];
        for (int h = 0; h < KVH; h++) {
            rotate(k + h * D, c, s, kr, half);
            for (int i = 0; i < D; i++) kd[h * D + i] = st(kr[i]);
        }
        for (int i = 0; i < KVH * D; i++) vd[i] = st(v[i]);
    }
    return 0;
}
