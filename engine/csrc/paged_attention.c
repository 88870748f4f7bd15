/* Paged decode attention on CPU, reading K/V where they lie in the pool (engine/cpu_kernels.py).
 *
 * One decode step's attention for every layer call: B rows (one query token each, H heads of
 * D floats), keys and values in pages of the pool ([pages, page_size, kv_heads, D] per layer,
 * float32). No gather, no mask tensor.
 *
 * The work is a list of items, built once per step in Python. An item is a run of rows that
 * attend to the same keys: a shared prefix (every row of a RAG document or a system prompt
 * starts with the same page ids: read once for all of them) or one row's own pages after it.
 * A long item is split in key ranges so both cores have work. Each item writes a partial
 * softmax state (running max m, sum l, unnormalised output acc[D]) per (row, head); a row's
 * partials are then merged under one max, as a split-K flash decoding does.
 *
 *     items[i] = {row_start, row_end, page_offset, num_keys, slot}
 *       rows [row_start, row_end) attend keys 0..num_keys-1 of the pages
 *       pages[page_offset ...]; partial states go to slots slot .. slot + (row_end - row_start) - 1
 *     row_ptr[b] .. row_ptr[b + 1]: the slots holding row b's partials (row_slots)
 *
 * A page's keys are transposed once per (item, KV head) and read by all of the item's queries:
 * scores vectorise across the page's keys, the weighted sum of values across head_dim, e^x is
 * a vectorised polynomial; one online-softmax update per query and page.
 * K/V are float32, or 16-bit (kv_cache_dtype) when built with -DKV_BF16 or -DKV_F16: widened
 * to float32 as they are read, so a step moves half the bytes (decode reads every key of every
 * row once: at long contexts it runs at memory bandwidth). Each build is its own library.
 * OpenMP: the runtime is the one torch loaded (libgomp.so.1 resolves to it), so torch's
 * thread count applies and no second pool spins beside torch's.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define MAX_PAGE 64   /* keys per page this kernel handles (baton's default is 16) */
#define MAX_DIM 512   /* head_dim */

typedef struct {
    int32_t row_start, row_end, page_offset, num_keys, slot;
} item_t;

/* x[i] = e^x[i] for x[i] <= 0 (common.h's exp_le0), vectorized. */
static inline void exp_inplace(float *restrict x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) x[i] = exp_le0(x[i]);
}

/* One query against one page of 16 keys (baton's page size) when head_dim is a multiple of
 * 16: fixed trip counts keep the 16 scores and a block of the output in vector registers.
 * The scores come from a transposed page (kt, [D][MAX_PAGE]: several queries share the one
 * transpose) or, for an item of few queries, from the keys as they lie (a dot per key). */
#define FAST_KEYS 16
#define TRANSPOSE_MIN_QUERIES 8  /* below, transposing a page costs more than the dots it eases */
static inline void page16(const float *restrict qv, const float *restrict kt, const kv_t *restrict kp,
                          const kv_t *restrict vp, int64_t tok_stride, float *restrict st, int nk, int D) {
    float s[FAST_KEYS] = {0};
    if (kt != NULL) {
        for (int d = 0; d < D; d++) {
            const float qd = qv[d];
#pragma omp simd
            for (int j = 0; j < FAST_KEYS; j++) s[j] += qd * kt[d * MAX_PAGE + j];
        }
    } else {
        for (int j = 0; j < nk; j++) {
            const kv_t *restrict k = kp + j * tok_stride;
            float a = 0.0f;
#pragma omp simd reduction(+ : a)
            for (int d = 0; d < D; d++) a += qv[d] * ld(k[d]);
            s[j] = a;
        }
    }
    float mx = st[0];
    for (int j = 0; j < nk; j++) mx = s[j] > mx ? s[j] : mx;
#pragma omp simd
    for (int j = 0; j < FAST_KEYS; j++) s[j] = j < nk ? s[j] - mx : -87.0f;
    exp_inplace(s, FAST_KEYS);
    float sum = 0.0f;
    for (int j = 0; j < nk; j++) sum += s[j];
    const float rescale = st[0] == -INFINITY ? 0.0f : __builtin_expf(st[0] - mx);
    float *restrict acc = st + 2;
    for (int d0 = 0; d0 < D; d0 += 16) {
        float a[16];
#pragma omp simd
        for (int dd = 0; dd < 16; dd++) a[dd] = acc[d0 + dd] * rescale;
        for (int j = 0; j < nk; j++) {
            const float w = s[j];
            const kv_t *restrict v = vp + j * tok_stride + d0;
#pragma omp simd
            for (int dd = 0; dd < 16; dd++) a[dd] += w * ld(v[dd]);
        }
#pragma omp simd
        for (int dd = 0; dd < 16; dd++) acc[d0 + dd] = a[dd];
    }
    st[0] = mx;
    st[1] = st[1] * rescale + sum;
}

static int run_item(const item_t *it, const float *q, const kv_t *k_cache, const kv_t *v_cache,
                     const int64_t *pages, float *partials, int H, int KVH, int D, int page_size,
                     float scale) {
    const int G = H / KVH;
    const int nrows = it->row_end - it->row_start;
    const int64_t tok_stride = (int64_t)KVH * D;           /* floats from one key to the next */
    const int64_t page_stride = (int64_t)page_size * tok_stride;
    const int state = D + 2;                               /* m, l, acc[D] */
    float kt[MAX_DIM * MAX_PAGE];                          /* one page's keys, transposed [D][keys] */
    float s[MAX_PAGE];
    const int fast = page_size == FAST_KEYS && D % 16 == 0;
    const int transpose = !fast || nrows * G >= TRANSPOSE_MIN_QUERIES;
    /* the item's queries, scaled once */
    float *qs = malloc(sizeof(float) * (size_t)nrows * H * D);
    if (qs == NULL) return -1;
    for (int64_t i = 0; i < (int64_t)nrows * H * D; i++) qs[i] = q[(int64_t)it->row_start * H * D + i] * scale;
    for (int h = 0; h < KVH; h++) {
        for (int r = 0; r < nrows; r++) {
            for (int g = 0; g < G; g++) {
                float *st = partials + ((int64_t)(it->slot + r) * H + h * G + g) * state;
                st[0] = -INFINITY;
                st[1] = 0.0f;
                memset(st + 2, 0, sizeof(float) * D);
            }
        }
        const int num_pages = (it->num_keys + page_size - 1) / page_size;
        for (int p = 0; p < num_pages; p++) {
            int nk = it->num_keys - p * page_size;
            if (nk > page_size) nk = page_size;
            const kv_t *kp = k_cache + pages[it->page_offset + p] * page_stride + (int64_t)h * D;
            const kv_t *vp = v_cache + pages[it->page_offset + p] * page_stride + (int64_t)h * D;
            if (transpose) {
                for (int j = 0; j < nk; j++)
                    for (int d = 0; d < D; d++) kt[d * MAX_PAGE + j] = ld(kp[j * tok_stride + d]);
                for (int j = nk; j < page_size; j++)
                    for (int d = 0; d < D; d++) kt[d * MAX_PAGE + j] = 0.0f;  /* read, never weighed */
            }
            for (int r = 0; r < nrows; r++) {
                for (int g = 0; g < G; g++) {
                    const float *restrict qv = qs + ((int64_t)r * H + h * G + g) * D;
                    float *st = partials + ((int64_t)(it->slot + r) * H + h * G + g) * state;
                    if (fast) {
                        page16(qv, transpose ? kt : NULL, kp, vp, tok_stride, st, nk, D);
                        continue;
                    }
                    for (int j = 0; j < nk; j++) s[j] = 0.0f;
                    for (int d = 0; d < D; d++) {
                        const float qd = qv[d];
                        const float *restrict kd = kt + d * MAX_PAGE;
#pragma omp simd
                        for (int j = 0; j < nk; j++) s[j] += qd * kd[j];
                    }
                    float mx = st[0];
                    for (int j = 0; j < nk; j++) mx = s[j] > mx ? s[j] : mx;
                    for (int j = 0; j < nk; j++) s[j] -= mx;
                    exp_inplace(s, nk);
                    float sum = 0.0f;
                    for (int j = 0; j < nk; j++) sum += s[j];
                    const float rescale = st[0] == -INFINITY ? 0.0f : __builtin_expf(st[0] - mx);
                    float *restrict acc = st + 2;
                    if (rescale != 1.0f) {
#pragma omp simd
                        for (int d = 0; d < D; d++) acc[d] *= rescale;
                    }
                    for (int j = 0; j < nk; j++) {
                        const kv_t *restrict v = vp + j * tok_stride;
                        const float w = s[j];
#pragma omp simd
                        for (int d = 0; d < D; d++) acc[d] += w * ld(v[d]);
                    }
                    st[0] = mx;
                    st[1] = st[1] * rescale + sum;
                }
            }
        }
    }
    free(qs);
    return 0;
}

/* out[b, head, :] = softmax over every key row b attends, from its partial states. */
static void merge_row(int b, const int32_t *row_ptr, const int32_t *row_slots, const float *partials,
                      float *out, int H, int D) {
    const int state = D + 2;
    for (int head = 0; head < H; head++) {
        float m = -INFINITY;
        for (int k = row_ptr[b]; k < row_ptr[b + 1]; k++) {
            float mk = partials[((int64_t)row_slots[k] * H + head) * state];
            if (mk > m) m = mk;
        }
        float *restrict o = out + ((int64_t)b * H + head) * D;
        memset(o, 0, sizeof(float) * D);
        float l = 0.0f;
        for (int k = row_ptr[b]; k < row_ptr[b + 1]; k++) {
            const float *st = partials + ((int64_t)row_slots[k] * H + head) * state;
            if (st[1] == 0.0f) continue; /* an empty part */
            float w = expf(st[0] - m);
            l += st[1] * w;
            const float *restrict acc = st + 2;
            for (int d = 0; d < D; d++) o[d] += w * acc[d];
        }
        float inv = 1.0f / l;
        for (int d = 0; d < D; d++) o[d] *= inv;
    }
}

int baton_paged_decode(const float *q, const kv_t *k_cache, const kv_t *v_cache,
                       const int32_t *items, int num_items, const int64_t *pages,
                       const int32_t *row_ptr, const int32_t *row_slots, float *partials, float *out,
                       int B, int H, int KVH, int D, int page_size, float scale) {
    if (KVH < 1 || H % KVH != 0 || page_size > MAX_PAGE || page_size < 1 || D < 1 || D > MAX_DIM) return -1;
    const item_t *its = (const item_t *)items;
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1) reduction(| : failed)
        for (int i = 0; i < num_items; i++)
            failed |= run_item(&its[i], q, k_cache, v_cache, pages, partials, H, KVH, D, page_size, scale);
#pragma omp for schedule(static)
        for (int b = 0; b < B; b++) merge_row(b, row_ptr, row_slots, partials, out, H, D);
    }
    return failed ? -2 : 0;
}
