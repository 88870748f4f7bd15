/* Every projection on CPU float32 (engine/linear.py): out [M, N] = x [M, K] @ W^T (+ bias), with
 * the weight [N, K] held in column panels so that one pass streams it once for up to MR rows.
 *
 * Layout ("panels"): the N output columns in panels of PANEL (the last one narrower when PANEL
 * does not divide N); panel p (columns n0 .. n0 + w) is its K x w block, k-major, at n0 * K. A
 * full panel is itself SUBW-column sub-panels one after the other, each K x SUBW: the column
 * c of row k at (c / SUBW) * K * SUBW + k * SUBW + c % SUBW. SUBW is the ISA's narrowest tile
 * (below), so each pass over a panel streams whole sub-panels front to back: with the panel
 * k-major instead, a pass of 16 columns read one cache line in four at a 256-byte stride, and a
 * decode step of 3-8 rows read baton-tiny's LM head from memory at 9-11 GB/s where sub-panels
 * read it at 15-18 (a C harness, 2 cores; 1.6x). A narrow last panel is k-major. A decode step
 * (a few rows) reads every weight byte once; a prefill chunk re-reads each panel (K * PANEL
 * floats: 256 KiB at K = 1,024) for each MR rows from cache. engine/linear.py's to_panels writes
 * this layout for the SUBW that baton_linear_subpanel() reports.
 *
 * Arithmetic: float32, each output's products added in k order from zero, then the bias. The
 * reference is F.linear (tests/engine/test_linear.py); the sum order differs from MKL's and
 * oneDNN's as theirs differ from each other. OpenMP: torch's pool (see paged_attention.c), over
 * (panel, block of rows) so that a prefill chunk gives every core work even where N has few
 * panels; a call too small to repay waking the pool runs on the calling thread.
 */
#include <stdint.h>
#include <string.h>

/* a multiply-add is one fused instruction here (the library builds with -std=c11, which turns
 * contraction off: 1.3x slower at prefill sizes); MKL's and oneDNN's kernels fuse them too */
#pragma GCC optimize("fp-contract=fast")

#define PANEL 64           /* output columns a panel holds (engine/linear.py's PANEL: the weight layout) */
#define ROW_BLOCK 64       /* rows a task takes: its panel stays in L2 across them */
#define PARALLEL_MIN 65536 /* multiply-adds below which a call runs on the calling thread */

/* The register tile, by ISA: a pass over a panel serves mr rows and SUB(mr) of its columns, with
 * mr x SUB / VW accumulators, SUB / VW weight vectors and one broadcast in registers. A
 * multiply-add's result is ready ~4 cycles after it issues and a core issues two a cycle, so a
 * pass needs ~8 independent sums in flight: with fewer rows the tile widens to keep them (at one
 * row, AVX2's 16-column tile had 2 and read the weights at half the memory's speed: 14.7 against
 * 28.2 GB/s at baton-tiny's LM head, 2 cores). Each output's sum runs in k order all the same.
 *   AVX-512 (32 registers of 16 floats): the whole panel for up to 4 rows, 16 + 4 + 1 registers
 *   AVX2 (16 registers of 8): 16 columns for 3-6 rows (12 + 2 + 1 registers, four passes over
 *     the panel, one sub-panel each: the weight is still read once), 32 for 2 rows (8 + 4 + 1),
 *     the whole panel for one (8 + 1: its weights are read from memory by the multiply-adds
 *     themselves, as 8 more would not fit)
 *   SSE, NEON (16 or 32 registers of 4): 8 columns for 3-6 rows, 16 for 2, 32 for one
 * A wider tile than the ISA's does not build where KEEP pins its vectors to one register each,
 * and spills where it does not (AVX-512's tile on AVX2 made baton-tiny's 16-row decode step 4x as
 * slow as this one). */
#if defined(__AVX512F__)
#define VW 16 /* floats in one vector register */
#define MR 4
#define SUB(mr) 64
#define SUBW 64 /* the layout's sub-panel width: the narrowest SUB */
#elif defined(__AVX__)
#define VW 8
#define MR 6
#define SUB(mr) ((mr) == 1 ? 64 : (mr) == 2 ? 32 : 16)
#define SUBW 16
#else
#define VW 4
#define MR 6
#define SUB(mr) ((mr) == 1 ? 32 : (mr) == 2 ? 16 : 8)
#define SUBW 8
#endif
#define MAX_VECS (PANEL / VW)
typedef float vec __attribute__((vector_size(VW * 4)));
/* a weight vector stays in its register for all the rows (left alone, GCC loads it again from
 * memory for each row: 4x the loads, 1.6x slower at prefill sizes); at one row there is nothing to
 * keep it for */
#if defined(__x86_64__)
#define KEEP(v) __asm__("" : "+v"(v))
#else
#define KEEP(v) ((void)0)
#endif

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* out rows [0, mr) of a full panel from x rows [0, mr), SUB(mr) columns a pass: mr is a constant
 * where this is inlined, so the mr x SUB(mr) / VW accumulators stay in registers and each weight
 * vector is loaded once for all rows (written with vectors: the compiler's own choice of loop
 * order was 1.3x slower) */
static inline __attribute__((always_inline)) void panel_rows(const float *restrict x, int64_t x_stride, int mr,
                                                             int64_t K, const float *restrict w,
                                                             const float *restrict bias, float *restrict out,
                                                             int64_t out_stride) {
    const int sub = SUB(mr), vecs = SUB(mr) / VW;
    for (int s = 0; s < PANEL; s += sub) {
        vec acc[MR][MAX_VECS];
        const float *ws[MAX_VECS]; /* each vector's column in its sub-panel, at k = 0 */
        for (int v = 0; v < vecs; v++) {
            const int c = s + v * VW;
            ws[v] = w + (c / SUBW) * K * SUBW + c % SUBW;
        }
        for (int m = 0; m < mr; m++)
            for (int v = 0; v < vecs; v++) acc[m][v] = (vec){0};
        for (int64_t k = 0; k < K; k++) {
            vec wk[MAX_VECS];
            for (int v = 0; v < vecs; v++) {
                wk[v] = load(ws[v] + k * SUBW);
                if (mr > 1) KEEP(wk[v]);
            }
            for (int m = 0; m < mr; m++) {
                const vec xv = (vec){0} + x[m * x_stride + k];
                for (int v = 0; v < vecs; v++) acc[m][v] += xv * wk[v];
            }
        }
        for (int m = 0; m < mr; m++)
            for (int v = 0; v < vecs; v++) {
                vec r = acc[m][v];
                if (bias != NULL) r += load(bias + s + v * VW);
                memcpy(out + m * out_stride + s + v * VW, &r, sizeof r);
            }
    }
}

/* the same for N's last panel, narrower than PANEL: width columns, scalar */
static void narrow_rows(const float *restrict x, int64_t x_stride, int mr, int64_t K, const float *restrict w,
                        int width, const float *restrict bias, float *restrict out, int64_t out_stride) {
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < width; j++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += x[m * x_stride + k] * w[k * width + j];
            out[m * out_stride + j] = bias != NULL ? acc + bias[j] : acc;
        }
}

static void rows_of_panel(const float *restrict x, int64_t x_stride, int64_t rows, int64_t K,
                          const float *restrict w, int width, const float *restrict bias, float *restrict out,
                          int64_t out_stride) {
    for (int64_t m0 = 0; m0 < rows; m0 += MR) {
        const int mr = rows - m0 < MR ? (int)(rows - m0) : MR;
        const float *restrict xm = x + m0 * x_stride;
        float *restrict om = out + m0 * out_stride;
        if (width < PANEL) {
            narrow_rows(xm, x_stride, mr, K, w, width, bias, om, out_stride);
            continue;
        }
        switch (mr) { /* a constant each: see panel_rows */
        case 1: panel_rows(xm, x_stride, 1, K, w, bias, om, out_stride); break;
        case 2: panel_rows(xm, x_stride, 2, K, w, bias, om, out_stride); break;
        case 3: panel_rows(xm, x_stride, 3, K, w, bias, om, out_stride); break;
#if MR > 4
        case 4: panel_rows(xm, x_stride, 4, K, w, bias, om, out_stride); break;
        case 5: panel_rows(xm, x_stride, 5, K, w, bias, om, out_stride); break;
#endif
        default: panel_rows(xm, x_stride, MR, K, w, bias, om, out_stride); /* mr == MR */
        }
    }
}

/* the layout's sub-panel width on this build (see the top) */
int baton_linear_subpanel(void) { return SUBW; }

/* the instruction set this build's register tile was chosen for (operators see it in /status) */
const char *baton_linear_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#elif defined(__AVX__)
    return "avx";
#elif defined(__ARM_NEON) || defined(__aarch64__)
    return "neon";
#elif defined(__SSE2__)
    return "sse2";
#else
    return "generic";
#endif
}

/* out [M, N] (contiguous) = x [M, K] (row stride x_stride) @ W^T + bias (NULL: none), with W in
 * panels (see above). Returns -1 (nothing written) for a non-positive size or a row stride
 * below K. */
int baton_linear(const float *restrict x, int64_t x_stride, int64_t M, int64_t K, const float *restrict w,
                 int64_t N, const float *restrict bias, float *restrict out) {
    if (M <= 0 || K <= 0 || N <= 0 || x_stride < K) return -1;
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const int64_t blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for collapse(2) schedule(static) if (M * K * N >= PARALLEL_MIN)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = p * PANEL, m0 = b * ROW_BLOCK;
            const int width = N - n0 < PANEL ? (int)(N - n0) : PANEL;
            const int64_t rows = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
            rows_of_panel(x + m0 * x_stride, x_stride, rows, K, w + n0 * K, width,
                          bias != NULL ? bias + n0 : NULL, out + m0 * N + n0, N);
        }
    }
    return 0;
}
