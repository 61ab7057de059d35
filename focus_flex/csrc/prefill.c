/* Focus prefill on the CPU for one sequence and one KV head: the fused form of focus_flex.flash's local and far parts.

   Rows are (query head r, query i) of the R query heads sharing the KV head, at position start + i. Two passes:

   1. local — tiles of NR consecutive queries of one head attend their sinks [0, min(sinks, p + 1)) and window
      [max(sinks, p - window + 1), p]; the normalised output goes to `out`, the log-sum-exp to `lse`.
   2. far — each group's keys past the sinks (ascending positions) and its query copies (ascending positions) are
      listed once (counting sorts); a copy at position p sees its group's keys at positions <= p - window, a prefix
      of the list. Tiles of NR copies of one group attend the union of their prefixes under a per-row bound, and
      merge into `out` and `lse` exactly through the log-sum-exps. With query and key top-k both above 1 a pair can
      share several groups: it is computed in the first of them only (the copy in group g skips a key whose groups
      meet the query's groups below g: two bitmasks ANDed per key and row).

   In one pass (`one_pass`: a layer whose queries join so many groups that listing a copy per group would compute a
   pair about once or more per shared group) the two passes are one: tiles of NR consecutive queries of one head
   attend every earlier key in order, a key beyond the window allowed iff the row's and the key's group bitmasks meet.
   That is a dense causal pass's work, whatever the top-k.

   Inside a tile the NR rows are the lanes of NV vectors of W floats, so a key's score for every row is one FMA per
   dimension, the mask of a key is one compare against per-row bounds, and the online softmax needs no horizontal
   reductions. Keys are taken in blocks of KB: scores, masked maximum, exponentials, then P V with rows broadcast.
   Scores, sums and outputs are float32; q, k, v and out are float32 or bfloat16 (rounded once per pass). Threads:
   OpenMP over tiles (joining PyTorch's pool when both use GNU OpenMP). Built and called by focus_flex/native.py. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Tile shapes per vector width, sized so that a step's accumulators stay in the vector registers: KS * NV score
   accumulators and RS * DV output accumulators, plus the operands (32 registers with AVX-512, 16 with AVX2 and with
   128-bit SSE / NEON). Accumulators that do not fit spill to memory on every multiply-add. */
#if defined(__AVX512F__)
#define W 16            /* floats per vector */
#define NV 2            /* vectors of rows per tile */
#define KS 8            /* keys per score step */
#define RS 4            /* rows per P V step */
#define DV 4            /* vectors of the head dimension per P V step */
#elif defined(__AVX__)
#define W 8
#define NV 2
#define KS 4
#define RS 4
#define DV 2
#else
#define W 4
#define NV 4
#define KS 2
#define RS 4
#define DV 2
#endif
#define NR (W * NV)     /* rows per tile */
#define KB 64           /* keys per block */
#define MAX_D 256       /* largest head dimension (a multiple of W) */
#define FAR_TAIL 256    /* a far tile ends before its rows' key prefixes differ by more than this */
#define NONE INT32_MAX  /* coordinate of a padding key: allowed for no row */

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

static vf sel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static vf vmax(vf a, vf b) { return sel(a > b, a, b); }
static vf splat(float x) { return (vf){0} + x; }

/* e^x for x <= 0; lanes below -80 (and -inf) give 0 (e^-80 < 1e-34 of the row's largest term, which is 1). */
static vf vexp(vf x) {
    vi tiny = x < -80.f;
    vf y = sel(tiny, splat(0.f), x) * 1.44269504088896341f;
    vi n = __builtin_convertvector(y - 0.5f, vi); /* round to nearest (y <= 0; truncation toward zero) */
    vf f = (y - __builtin_convertvector(n, vf)) * 0.69314718055994531f; /* |f| <= ln2 / 2 */
    vf p = 1.f + f * (1.f + f * (0.5f + f * (1.f / 6 + f * (1.f / 24 + f * (1.f / 120 + f * (1.f / 720))))));
    return sel(tiny, splat(0.f), (vf)((vi)p + n * (1 << 23)));
}

typedef struct {
    int64_t r, lq, lk, d;                    /* query heads, queries, keys, head dim */
    const void *q, *k, *v;                   /* data */
    void *out;
    int64_t q_hs, q_ps, k_ps, v_ps, o_hs, o_ps; /* element strides: head and position of q / out, position of k, v */
    int bf16;
    float scale;
    int64_t start, window, sinks;
    float *lse;                              /* [r * lq] */
} run_t;

typedef struct {                             /* per key and row: groups as bitmasks (low and high 32 bits) */
    int32_t klo[KB], khi[KB];                /* the block's keys' groups */
    vi qlo[NV], qhi[NV];                     /* far tile: the rows' groups below the tile's; one pass: all of them */
    vi far[NV];                              /* one pass: the last key position beyond each row's window */
    int meet;                                /* one pass: groups that meet allow a key (else they forbid it) */
} shared_t;

typedef struct {                             /* one thread's tile buffers (aligned to the vector size) */
    float qt[MAX_D * NR];                    /* [d][NR] scaled queries, rows as lanes */
    float s[KB * NR];                        /* [KB][NR] scores, then probabilities */
    float o[NR * MAX_D];                     /* [NR][d] unnormalised outputs */
    float kbuf[KB * MAX_D], vbuf[KB * MAX_D]; /* a block's keys and values as float32 (bfloat16 inputs) */
    vf m[NV], l[NV];                         /* running maximum and sum of every row */
    const float *kr[KB], *vr[KB];            /* the block's key and value rows */
} work_t;

static float load(const run_t *c, const void *base, int64_t at) {
    if (!c->bf16) return ((const float *)base)[at];
    uint32_t bits = (uint32_t)((const uint16_t *)base)[at] << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static void store(const run_t *c, void *base, int64_t at, float x) {
    if (!c->bf16) {
        ((float *)base)[at] = x;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits += 0x7fff + ((bits >> 16) & 1); /* round to nearest even (inputs are finite) */
    ((uint16_t *)base)[at] = (uint16_t)(bits >> 16);
}

/* Point kr/vr at the rows of keys pos[0..n) (float32: in place; bfloat16: widened into kbuf/vbuf). */
static void gather(const run_t *c, work_t *w, const int32_t *pos, int n) {
    for (int t = 0; t < n; t++) {
        int64_t ka = pos[t] * c->k_ps, va = pos[t] * c->v_ps;
        if (!c->bf16) {
            w->kr[t] = (const float *)c->k + ka;
            w->vr[t] = (const float *)c->v + va;
            continue;
        }
        float *kb = w->kbuf + t * c->d, *vb = w->vbuf + t * c->d;
        for (int64_t e = 0; e < c->d; e++) kb[e] = load(c, c->k, ka + e), vb[e] = load(c, c->v, va + e);
        w->kr[t] = kb;
        w->vr[t] = vb;
    }
}

/* Prefetch the d elements of a row (q and out rows of a far tile are scattered: let their misses overlap). */
static void prefetch_row(const run_t *c, const void *base, int64_t at, int write) {
    const char *p = (const char *)base + at * (c->bf16 ? 2 : 4);
    for (int64_t o = 0; o < c->d * (c->bf16 ? 2 : 4); o += 64) write ? __builtin_prefetch(p + o, 1) : __builtin_prefetch(p + o);
}

static void start_tile(const run_t *c, work_t *w, const int64_t *rows, int n) {
    for (int i = 0; i < n; i++) {
        prefetch_row(c, c->q, rows[i] / c->lq * c->q_hs + rows[i] % c->lq * c->q_ps, 0);
        prefetch_row(c, c->out, rows[i] / c->lq * c->o_hs + rows[i] % c->lq * c->o_ps, 1);
    }
    for (int i = 0; i < NR; i++) {
        int64_t at = rows[i] / c->lq * c->q_hs + rows[i] % c->lq * c->q_ps;
        for (int64_t e = 0; e < c->d; e++) w->qt[e * NR + i] = i < n ? load(c, c->q, at + e) * c->scale : 0.f;
    }
    memset(w->o, 0, sizeof(float) * NR * c->d);
    for (int v = 0; v < NV; v++) w->m[v] = splat(-FLT_MAX), w->l[v] = splat(0.f);
}

/* o[i0 .. i0 + RS)[e0 .. e0 + nd * W) += P V over the block's n keys (nd a constant: the accumulators stay in
   registers). */
static inline __attribute__((always_inline)) void pv(work_t *w, int n, int64_t d, int i0, int64_t e0, const int nd) {
    vf acc[RS][DV];
    for (int i = 0; i < RS; i++)
        for (int j = 0; j < nd; j++) memcpy(&acc[i][j], w->o + (i0 + i) * d + e0 + j * W, sizeof(vf));
    for (int t = 0; t < n; t++) {
        const float *vt = w->vr[t] + e0, *pt = w->s + t * NR + i0;
        vf vv[DV];
        for (int j = 0; j < nd; j++) memcpy(&vv[j], vt + j * W, sizeof(vf));
        for (int i = 0; i < RS; i++)
            for (int j = 0; j < nd; j++) acc[i][j] += vv[j] * pt[i];
    }
    for (int i = 0; i < RS; i++)
        for (int j = 0; j < nd; j++) memcpy(w->o + (i0 + i) * d + e0 + j * W, &acc[i][j], sizeof(vf));
}

/* One block of n <= KB keys (rows in kr/vr, coordinates x): key t is allowed for a row iff
   x[t] < a or a2 <= x[t] <= b (per-row bounds, lanes of a/a2/b). Given `shared`: in a far tile, only if also the
   key's groups do not meet the row's groups below the tile's; in one pass, also if x[t] <= far and the key's and
   the row's groups meet. Updates m, l, o. */
static void block(const run_t *c, work_t *w, int n, const int32_t *x, const vi *a, const vi *a2, const vi *b,
                  const shared_t *shared) {
    const int64_t d = c->d;
    static const float zero[MAX_D];
    for (int t = n; t < (n + KS - 1) / KS * KS; t++) w->kr[t] = w->vr[t] = zero;
    vf *s = (vf *)w->s, mx[NV];
    for (int v = 0; v < NV; v++) mx[v] = splat(-FLT_MAX);
    for (int t0 = 0; t0 < n; t0 += KS) {
        vf acc[KS][NV] = {{0}};
        for (int64_t e = 0; e < d; e++) {
            const vf *qe = (const vf *)(w->qt + e * NR);
            for (int u = 0; u < KS; u++) {
                float kv = w->kr[t0 + u][e];
                for (int v = 0; v < NV; v++) acc[u][v] += qe[v] * kv;
            }
        }
        for (int u = 0; u < KS && t0 + u < n; u++) {
            int32_t xt = x[t0 + u];
            for (int v = 0; v < NV; v++) {
                vi ok = (xt < a[v]) | ((xt >= a2[v]) & (xt <= b[v]));
                if (shared) {
                    vi meet = ((shared->klo[t0 + u] & shared->qlo[v]) | (shared->khi[t0 + u] & shared->qhi[v])) != 0;
                    if (shared->meet)
                        ok |= (xt <= shared->far[v]) & meet;
                    else
                        ok &= ~meet;
                }
                vf sc = sel(ok, acc[u][v], splat(-INFINITY));
                s[(t0 + u) * NV + v] = sc;
                mx[v] = vmax(mx[v], sc);
            }
        }
    }
    for (int v = 0; v < NV; v++) {
        vf m_new = vmax(w->m[v], mx[v]), alpha = vexp(w->m[v] - m_new), sum = splat(0.f);
        for (int t = 0; t < n; t++) {
            vf p = vexp(s[t * NV + v] - m_new);
            s[t * NV + v] = p;
            sum += p;
        }
        w->m[v] = m_new;
        w->l[v] = w->l[v] * alpha + sum;
        for (int i = 0; i < W; i++) {
            float al = alpha[i];
            if (al != 1.f)
                for (int64_t e = 0; e < d; e++) w->o[(v * W + i) * d + e] *= al;
        }
    }
    for (int i0 = 0; i0 < NR; i0 += RS) {
        int64_t e0 = 0;
        for (; e0 + DV * W <= d; e0 += DV * W) pv(w, n, d, i0, e0, DV);
        for (; e0 < d; e0 += W) pv(w, n, d, i0, e0, 1);
    }
}

/* Rows rows[0..n): out = the tile's result (merge = 0), or its exact union with what out and lse hold (merge = 1). */
static void finish_tile(const run_t *c, work_t *w, const int64_t *rows, int n, int merge) {
    for (int i = 0; i < n; i++) {
        float m = w->m[i / W][i % W], l = w->l[i / W][i % W], lse = m + logf(l), *o = w->o + i * c->d;
        int64_t row = rows[i], at = row / c->lq * c->o_hs + row % c->lq * c->o_ps;
        float a = 0.f, b = 1.f / l;
        if (merge && l == 0.f) continue; /* every key of the tile was computed in an earlier shared group */
        if (merge) {
            float old = c->lse[row], hi = old > lse ? old : lse, total = hi + logf(expf(old - hi) + expf(lse - hi));
            a = expf(old - total);
            b = expf(lse - total) / l;
            lse = total;
        }
        for (int64_t e = 0; e < c->d; e++) store(c, c->out, at + e, (merge ? a * load(c, c->out, at + e) : 0.f) + b * o[e]);
        c->lse[row] = lse;
    }
}

/* Local tile: head r, queries [i0, i0 + n). Keys: the sinks, then the window span of the tile. In one pass (qbits
   and kbits given) every earlier key in order instead: the sinks, the window, and beyond the window the keys whose
   groups (kbits) meet the row's (qbits). */
static void local_tile(const run_t *c, work_t *w, int64_t r, int64_t i0, int n, const int64_t *qbits,
                       const int64_t *kbits) {
    int64_t rows[NR];
    vi a[NV], a2[NV], b[NV];
    shared_t shared;
    shared.meet = 1;
    for (int i = 0; i < NR; i++) {
        int64_t p = c->start + i0 + i;
        rows[i] = r * c->lq + i0 + (i < n ? i : 0);
        int32_t sink_end = (int32_t)(p + 1 < c->sinks ? p + 1 : c->sinks), lo = (int32_t)(p - c->window + 1);
        a[i / W][i % W] = i < n ? sink_end : 0;
        a2[i / W][i % W] = lo > c->sinks ? lo : (int32_t)c->sinks;
        b[i / W][i % W] = i < n ? (int32_t)p : -1;
        shared.far[i / W][i % W] = i < n ? lo - 1 : -1;
        uint64_t bits = qbits && i < n ? (uint64_t)qbits[rows[i]] : 0;
        shared.qlo[i / W][i % W] = (int32_t)(uint32_t)bits, shared.qhi[i / W][i % W] = (int32_t)(uint32_t)(bits >> 32);
    }
    start_tile(c, w, rows, n);
    int64_t p0 = c->start + i0, p1 = p0 + n; /* window span [lo, p1) */
    int32_t pos[KB];
    if (qbits) {
        for (int64_t j0 = 0; j0 < p1; j0 += KB) {
            int cnt = (int)(p1 - j0 < KB ? p1 - j0 : KB);
            for (int t = 0; t < cnt; t++) {
                uint64_t bits = (uint64_t)kbits[j0 + t];
                pos[t] = (int32_t)(j0 + t);
                shared.klo[t] = (int32_t)(uint32_t)bits, shared.khi[t] = (int32_t)(uint32_t)(bits >> 32);
            }
            gather(c, w, pos, cnt);
            block(c, w, cnt, pos, a, a2, b, &shared);
        }
        finish_tile(c, w, rows, n, 0);
        return;
    }
    int64_t nsink = c->sinks < c->lk ? c->sinks : c->lk, lo = p0 - c->window + 1;
    lo = lo > c->sinks ? lo : c->sinks;
    int cnt = 0;
    for (int64_t j = 0; j < nsink + (p1 > lo ? p1 - lo : 0); j++) {
        pos[cnt++] = (int32_t)(j < nsink ? j : lo + j - nsink);
        if (cnt == KB) gather(c, w, pos, cnt), block(c, w, cnt, pos, a, a2, b, NULL), cnt = 0;
    }
    if (cnt) gather(c, w, pos, cnt), block(c, w, cnt, pos, a, a2, b, NULL);
    finish_tile(c, w, rows, n, 0);
}

/* Far tile: copies [c0, c1) of group g (rows, key prefixes hi), its key list; qbits/kbits (the rows' and keys'
   groups as bitmasks) where a pair can share several groups, else NULL. */
static void far_tile(const run_t *c, work_t *w, const int32_t *rows32, const int32_t *hi, int n, const int32_t *list,
                     int64_t g, const int64_t *qbits, const int64_t *kbits) {
    int64_t rows[NR];
    vi a[NV], a2[NV], b[NV];
    shared_t shared;
    shared.meet = 0;
    for (int i = 0; i < NR; i++) {
        rows[i] = rows32[i < n ? i : 0];
        a[i / W][i % W] = i < n ? hi[i] : 0;
        a2[i / W][i % W] = 1, b[i / W][i % W] = 0; /* no second range */
        uint64_t below = qbits ? (uint64_t)qbits[rows[i]] & ((UINT64_C(1) << g) - 1) : 0;
        shared.qlo[i / W][i % W] = (int32_t)(uint32_t)below, shared.qhi[i / W][i % W] = (int32_t)(uint32_t)(below >> 32);
    }
    start_tile(c, w, rows, n);
    int32_t x[KB];
    for (int32_t t0 = 0; t0 < hi[n - 1]; t0 += KB) {
        int cnt = hi[n - 1] - t0 < KB ? hi[n - 1] - t0 : KB;
        for (int t = 0; t < cnt; t++) x[t] = t0 + t;
        if (kbits)
            for (int t = 0; t < cnt; t++) {
                uint64_t bits = (uint64_t)kbits[list[t0 + t]];
                shared.klo[t] = (int32_t)(uint32_t)bits, shared.khi[t] = (int32_t)(uint32_t)(bits >> 32);
            }
        gather(c, w, list + t0, cnt);
        block(c, w, cnt, x, a, a2, b, kbits ? &shared : NULL);
    }
    finish_tile(c, w, rows, n, 1);
}

/* The far plan of one sequence and KV head, into the caller's arrays (sizes in focus_flex/native.py):
   kstart [G + 1], klist [lk * kk]: each group's keys past the sinks, ascending (counting sort);
   cstart [G + 1], crow/chi [r * lq * kq]: each group's query copies that see a far key, ascending by position, as
   (row, key prefix); ctiles [G + 1], tiles [2 * r * lq * kq]: runs of at most NR copies of a group whose prefixes
   differ by at most FAR_TAIL keys, [c0, c1) into crow; qbits [r * lq], kbits [lk]: every row's and key's groups as
   a bitmask, only where a pair can share several groups (kq > 1 and kk > 1; else not touched, may be empty).
   With one_pass only qbits and kbits are filled (the other arrays are not touched, may be empty).
   Returns 0, or 2 on a bad argument. */
int focus_prefill_plan(int64_t r, int64_t lq, int64_t lk, int64_t window, int64_t sinks, int64_t groups_n,
                       const int64_t *q_groups, int64_t kq, const int64_t *k_groups, int64_t kk, int one_pass,
                       int64_t *kstart, int32_t *klist, int64_t *cstart, int32_t *crow, int32_t *chi, int64_t *ctiles,
                       int32_t *tiles, int64_t *qbits, int64_t *kbits) {
    if (r < 1 || lq < 1 || lk < lq || window < 1 || sinks < 0 || groups_n < 1 || groups_n > 63 || kq < 1 || kk < 1 ||
        lk >= NONE || r * lq * kq >= NONE)
        return 2;
    for (int64_t i = 0; i < r * lq * kq; i++)
        if (q_groups[i] < 0 || q_groups[i] >= groups_n) return 2;
    for (int64_t i = 0; i < lk * kk; i++)
        if (k_groups[i] < 0 || k_groups[i] >= groups_n) return 2;
    if (one_pass || (kq > 1 && kk > 1)) {
        memset(qbits, 0, sizeof(int64_t) * r * lq);
        memset(kbits, 0, sizeof(int64_t) * lk);
        for (int64_t i = 0; i < r * lq * kq; i++) qbits[i / kq] |= INT64_C(1) << q_groups[i];
        for (int64_t i = 0; i < lk * kk; i++) kbits[i / kk] |= INT64_C(1) << k_groups[i];
    }
    if (one_pass) return 0;
    int64_t start = lk - lq, *fill = ctiles; /* (ctiles: the fill counts, then each group's key pointer) */
    memset(kstart, 0, sizeof(int64_t) * (groups_n + 1));
    memset(cstart, 0, sizeof(int64_t) * (groups_n + 1));
    memset(fill, 0, sizeof(int64_t) * (groups_n + 1));
    for (int64_t j = sinks; j < lk; j++)
        for (int64_t u = 0; u < kk; u++) kstart[k_groups[j * kk + u] + 1]++;
    for (int64_t i = 0; i < r * lq * kq; i++) cstart[q_groups[i] + 1]++;
    for (int64_t g = 0; g < groups_n; g++) kstart[g + 1] += kstart[g], cstart[g + 1] += cstart[g];
    for (int64_t j = sinks; j < lk; j++)
        for (int64_t u = 0; u < kk; u++) {
            int64_t g = k_groups[j * kk + u];
            klist[kstart[g] + fill[g]++] = (int32_t)j;
        }
    int64_t *ptr = calloc(groups_n, sizeof(int64_t));
    if (!ptr) return 1;
    memset(fill, 0, sizeof(int64_t) * (groups_n + 1));
    for (int64_t i = 0; i < lq; i++) {
        int64_t p = start + i;
        for (int64_t h = 0; h < r; h++)
            for (int64_t u = 0; u < kq; u++) {
                int64_t g = q_groups[(h * lq + i) * kq + u], n = kstart[g + 1] - kstart[g];
                while (ptr[g] < n && klist[kstart[g] + ptr[g]] <= p - window) ptr[g]++;
                if (ptr[g] == 0) continue; /* no far key yet */
                crow[cstart[g] + fill[g]] = (int32_t)(h * lq + i);
                chi[cstart[g] + fill[g]++] = (int32_t)ptr[g];
            }
    }
    free(ptr);
    int64_t nt = 0;
    for (int64_t g = 0; g < groups_n; g++) {
        int64_t c0 = cstart[g], end = cstart[g] + fill[g];
        ctiles[g] = nt;
        while (c0 < end) {
            int64_t c1 = c0 + 1;
            while (c1 < end && c1 - c0 < NR && chi[c1] - chi[c0] <= FAR_TAIL) c1++;
            tiles[2 * nt] = (int32_t)c0, tiles[2 * nt + 1] = (int32_t)c1, nt++;
            c0 = c1;
        }
    }
    ctiles[groups_n] = nt;
    return 0;
}

/* The width of the vectors this build computes with, in bits. */
int focus_vector_bits(void) { return W * 32; }

/* Focus attention of rows (head, query) into out, with the plan of focus_prefill_plan (made with the same one_pass).
   lse [r * lq] is scratch.
   Returns 0, 1 when out of memory, 2 on a bad argument. */
int focus_prefill(int64_t r, int64_t lq, int64_t lk, int64_t d, const void *q, int64_t q_hs, int64_t q_ps,
                  const void *k, int64_t k_ps, const void *v, int64_t v_ps, void *out, int64_t o_hs, int64_t o_ps,
                  int bf16, float scale, int64_t window, int64_t sinks, int64_t groups_n, int64_t kq,
                  const int64_t *kstart, const int32_t *klist, const int64_t *cstart, const int32_t *crow,
                  const int32_t *chi, const int64_t *ctiles, const int32_t *tiles, const int64_t *qbits,
                  const int64_t *kbits, int64_t kk, int one_pass, int threads, float *lse) {
    if (r < 1 || lq < 1 || lk < lq || d < W || d > MAX_D || d % W || window < 1 || sinks < 0 || groups_n < 1 ||
        groups_n > 63 || kq < 1 || kk < 1 || threads < 1)
        return 2;
    int shared = kq > 1 && kk > 1; /* a pair can share several groups */
    run_t c = {r, lq, lk, d, q, k, v, out, q_hs, q_ps, k_ps, v_ps, o_hs, o_ps, bf16, scale, lk - lq, window, sinks,
               lse};
    int64_t local_per_head = (lq + NR - 1) / NR, failed = 0;
    /* 1. local tiles (one pass: the whole pattern); 2. far tiles (a query in several groups has a copy per group:
       then one group at a time). */
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        work_t *w = aligned_alloc(64, (sizeof(work_t) + 63) / 64 * 64);
        failed = !w;
#pragma omp for schedule(dynamic, 4)
        for (int64_t t = 0; t < r * local_per_head; t++) {
            if (!w) continue;
            int64_t h = t / local_per_head, i0 = t % local_per_head * NR;
            local_tile(&c, w, h, i0, (int)(lq - i0 < NR ? lq - i0 : NR), one_pass ? qbits : NULL,
                       one_pass ? kbits : NULL);
        }
        for (int64_t g0 = 0; g0 < (one_pass ? 0 : groups_n); g0 = kq == 1 ? groups_n : g0 + 1) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = ctiles[g0]; t < ctiles[kq == 1 ? groups_n : g0 + 1]; t++) {
                if (!w) continue;
                int32_t c0 = tiles[2 * t], c1 = tiles[2 * t + 1];
                int64_t g = 0;
                while (cstart[g + 1] <= c0) g++;
                far_tile(&c, w, crow + c0, chi + c0, c1 - c0, klist + kstart[g], g, shared ? qbits : NULL,
                         shared ? kbits : NULL);
            }
        }
        free(w);
    }
    return failed ? 1 : 0;
}

