/* What the CPU kernels share (engine/cpu_kernels.py builds them into one library per KV dtype):
 * the KV element type with its widening load and rounding store, and a vectorizable e^x. */
#ifndef BATON_COMMON_H
#define BATON_COMMON_H
#include <stdint.h>
#include <string.h>

#if defined(KV_BF16)
typedef uint16_t kv_t;  /* bfloat16: the high half of a float32 */
static inline float ld(kv_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
/* round to nearest even, as torch's float32 -> bfloat16 conversion (a NaN stays a quiet NaN) */
static inline kv_t st(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (kv_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (kv_t)(bits >> 16);
}
#elif defined(KV_F16)
typedef _Float16 kv_t;  /* IEEE half: F16C converts it (round to nearest even) */
static inline float ld(kv_t x) { return (float)x; }
static inline kv_t st(float f) { return (kv_t)f; }
#else
typedef float kv_t;
static inline float ld(kv_t x) { return x; }
static inline kv_t st(float f) { return f; }
#endif

/* e^v, |relative error| < 2e-7 for v <= 0 (where softmax and SiLU use it): a Cephes-style
 * polynomial in plain arithmetic, so a loop calling it vectorizes (a call to expf would not). */
static inline float exp_le0(float v) {
    v = v < -87.0f ? -87.0f : (v > 88.0f ? 88.0f : v);
    float k = __builtin_floorf(v * 1.44269504088896341f + 0.5f);
    float r = v - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}
#endif
