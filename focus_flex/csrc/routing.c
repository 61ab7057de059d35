/* Top-1 routing on the CPU: the group of every vector is the first index of its largest score <x, c_g> (a NaN
   score counts as largest, as torch.max has it), the scores computed in float32 in one fixed order (a sum over the
   head dim, first to last, a multiply and an add per term), so a vector's group never depends on which other
   vectors are routed with it (chunks, a prefill, a decode step).

   x is [B, H, L, D] (float32 or bfloat16, rows of D contiguous, any other strides), c the normalised centroids
   [Hkv, G, D] (float32, contiguous; head h uses set h / (H / Hkv)), out [B, H, L] int64. W vectors at a time are
   the lanes of one vector register, GB groups scored at a time (independent sums keep the FMA units busy).
   Built and called by focus_flex/native.py; returns 0, or 2 on a bad argument. */

#include <stdint.h>
#include <string.h>

/* GB score accumulators of W lanes, plus an operand, fit the vector registers (32 with AVX-512, 16 with AVX2).
   Builds with 128-bit vectors route with PyTorch instead (focus_flex/native.py: routes), which is faster there. */
#if defined(__AVX512F__)
#define W 16      /* vectors per tile */
#define GB 16     /* groups scored at a time */
#else
#define W 8
#define GB 12
#endif
#define MAX_D 256

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

/* Plain multiplies and adds in the score sums: contracting some into fused multiply-adds and not others (as the
   compiler may, accumulator by accumulator) would give two identical centroids different scores. */
__attribute__((optimize("fp-contract=off"))) int focus_route_top1(const void *x, int bf16, int64_t b, int64_t h, int64_t l, int64_t d, int64_t sb, int64_t sh,
                     int64_t sl, const float *c, int64_t hkv, int64_t g, int64_t *out, int threads) {
    if (d < 1 || d > MAX_D || g < 1 || hkv < 1 || h % hkv) return 2;
    int64_t tiles = (l + W - 1) / W;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < b * h * tiles; t++) {
        int64_t bh = t / tiles, i0 = t % tiles * W, n = l - i0 < W ? l - i0 : W;
        int64_t at = bh / h * sb + bh % h * sh + i0 * sl;
        const float *cs = c + bh % h / (h / hkv) * g * d;
        float xt[MAX_D * W]; /* [d][W]: the tile's vectors, transposed */
        memset(xt, 0, sizeof(float) * d * W);
        for (int64_t i = 0; i < n; i++) {
            if (bf16) {
                const uint16_t *row = (const uint16_t *)x + at + i * sl;
                for (int64_t e = 0; e < d; e++) {
                    uint32_t bits = (uint32_t)row[e] << 16;
                    memcpy(xt + e * W + i, &bits, sizeof bits);
                }
            } else {
                const float *row = (const float *)x + at + i * sl;
                for (int64_t e = 0; e < d; e++) xt[e * W + i] = row[e];
            }
        }
        vf best = {0};
        vi arg = {0};
        for (int64_t j0 = 0; j0 < g; j0 += GB) {
            int64_t m = g - j0 < GB ? g - j0 : GB;
            vf s[GB] = {{0}};
            for (int64_t e = 0; e < d; e++) {
                vf xe;
                memcpy(&xe, xt + e * W, sizeof xe);
                for (int64_t j = 0; j < GB; j++) s[j] += xe * cs[(j0 + (j < m ? j : 0)) * d + e];
            }
            for (int64_t j = 0; j < m; j++) { /* in order: the first maximum (or NaN) wins */
                vi take = j0 + j == 0 ? (vi){0} - 1 : (s[j] > best) | ((s[j] != s[j]) & (best == best));
                best = (vf)(((vi)s[j] & take) | ((vi)best & ~take));
                arg = (arg & ~take) | (((vi){0} + (int32_t)(j0 + j)) & take);
            }
        }
        for (int64_t i = 0; i < n; i++) out[bh * l + i0 + i] = arg[i];
    }
    return 0;
}
