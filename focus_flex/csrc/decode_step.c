/* One Focus decode step on a KV cache, on the CPU: the fused form of focus_flex.decode._one_group_attention.

   One query per (batch row, query head) and top-1 query routing: row r (KV slot j = r / rep, its group g = groups[r])
   attends its sinks [0, min(sinks, lk)), the far keys of group g, which are the positions in [sinks, end) of that
   group's ascending list (a slice, found by binary search), and its window [end, lk). Rows of one KV slot that chose
   the same group share one pass over those keys. The n keys of a pass are split into `parts` contiguous spans, one
   per OpenMP thread; each span keeps its own softmax statistics (max, sum, unnormalised output), merged at the end
   as in flash attention. Key and value rows are read in place, prefetched a few rows ahead (their positions are
   scattered, so the hardware prefetcher cannot guess them). Scores and sums are float32; keys and values are float32
   or bfloat16. Built and called by focus_flex/native.py; returns 0, 1 when out of memory, 2 on a bad argument. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define AHEAD 16    /* rows prefetched ahead */
#define MAX_REP 256 /* query heads per KV head */

typedef struct {
    int64_t rows, d, rep;             /* query rows (B * Hq), head dim, query heads per KV head */
    const float *q;                   /* [rows, d], float32 */
    const int64_t *groups;            /* [rows] */
    float scale;                      /* score scale */
    const void *k, *v;                /* cache tensors' data */
    const int64_t *k_at, *v_at;       /* [rows / rep]: offset (elements) of position 0 of each KV slot */
    int64_t k_step, v_step;           /* elements between consecutive positions */
    int bf16;                         /* keys and values are bfloat16 (else float32) */
    const int32_t *pool;              /* the lists of ascending positions of each group's keys, one after another */
    const int64_t *starts, *counts;   /* [rows / rep, G] where each list starts in pool, and its size */
    int64_t groups_n;                 /* G */
    int64_t sinks, end, lk;           /* sinks, first window position, cache length */
    int parts;
    float *stat_max, *stat_sum, *acc; /* [parts, rows], [parts, rows], [parts, rows, d] */
} step_t;

static int64_t lower_bound(const int32_t *a, int64_t n, int64_t x) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (a[mid] < x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* Row `at` of a cache tensor as float32: the row itself, or its bfloat16 values widened into buf. */
static const float *row(const step_t *s, const void *base, int64_t at, float *buf) {
    if (!s->bf16) return (const float *)base + at;
    const uint16_t *x = (const uint16_t *)base + at;
    for (int64_t i = 0; i < s->d; i++) {
        uint32_t bits = (uint32_t)x[i] << 16;
        memcpy(buf + i, &bits, sizeof bits);
    }
    return buf;
}

static void prefetch(const step_t *s, const void *base, int64_t at) {
    int64_t width = s->bf16 ? 2 : 4;
    const char *p = (const char *)base + at * width;
    for (int64_t o = 0; o < s->d * width; o += 64) __builtin_prefetch(p + o);
}

static float dot(const float *a, const float *b, int64_t d) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        for (int u = 0; u < 8; u++) acc[u] += a[i + u] * b[i + u];
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < d; i++) sum += a[i] * b[i];
    return sum;
}

/* Rows mine[0..m) (one KV slot j, one group) over keys t0..t1 of their n keys: sinks, then the far slice
   list[lo..hi), then the window. Writes this part's statistics of those rows. */
static void span(const step_t *s, int part, int64_t j, const int64_t *mine, int64_t m, const int32_t *list,
                 int64_t lo, int64_t hi, int64_t t0, int64_t t1, int64_t *pos, float *p, float *buf) {
    int64_t d = s->d, n = t1 - t0, nsink = s->sinks < s->lk ? s->sinks : s->lk, nfar = hi - lo;
    for (int64_t t = t0; t < t1; t++)
        pos[t - t0] = t < nsink ? t : t < nsink + nfar ? list[lo + t - nsink] : s->end + (t - nsink - nfar);
    const int64_t k0 = s->k_at[j], v0 = s->v_at[j];
    for (int64_t t = 0; t < n; t++) {
        if (t + AHEAD < n) prefetch(s, s->k, k0 + pos[t + AHEAD] * s->k_step);
        const float *key = row(s, s->k, k0 + pos[t] * s->k_step, buf);
        for (int64_t x = 0; x < m; x++) p[x * n + t] = dot(s->q + mine[x] * d, key, d) * s->scale;
    }
    for (int64_t x = 0; x < m; x++) {
        float *px = p + x * n, mx = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < n; t++) mx = px[t] > mx ? px[t] : mx;
        for (int64_t t = 0; t < n; t++) sum += px[t] = expf(px[t] - mx);
        int64_t at = part * s->rows + mine[x];
        s->stat_max[at] = mx;
        s->stat_sum[at] = sum;
        memset(s->acc + at * d, 0, sizeof(float) * d);
    }
    for (int64_t t = 0; t < n; t++) {
        if (t + AHEAD < n) prefetch(s, s->v, v0 + pos[t + AHEAD] * s->v_step);
        const float *value = row(s, s->v, v0 + pos[t] * s->v_step, buf);
        for (int64_t x = 0; x < m; x++) {
            float w = p[x * n + t], *o = s->acc + (part * s->rows + mine[x]) * d;
            for (int64_t i = 0; i < d; i++) o[i] += w * value[i];
        }
    }
}

/* This part's span of every (KV slot, group) pass. Returns 0, or 1 when out of memory. */
static int run_part(const step_t *s, int part) {
    int64_t nsink = s->sinks < s->lk ? s->sinks : s->lk, nlocal = nsink + (s->lk > s->end ? s->lk - s->end : 0);
    int64_t most = 0;
    for (int64_t r = 0; r < s->rows; r++) {
        int64_t c = s->counts[(r / s->rep) * s->groups_n + s->groups[r]];
        most = c > most ? c : most;
    }
    int64_t cap = nlocal + most;
    int64_t *pos = malloc(sizeof(int64_t) * cap);
    float *p = malloc(sizeof(float) * s->rep * cap), *buf = malloc(sizeof(float) * s->d);
    int failed = !pos || !p || !buf;
    for (int64_t r0 = 0; r0 < s->rows && !failed; r0 += s->rep) {
        int64_t j = r0 / s->rep, mine[MAX_REP];
        char done[MAX_REP] = {0};
        for (int64_t a = 0; a < s->rep; a++) {
            if (done[a]) continue;
            int64_t g = s->groups[r0 + a], m = 0;
            for (int64_t b = a; b < s->rep; b++)
                if (!done[b] && s->groups[r0 + b] == g) mine[m++] = r0 + b, done[b] = 1;
            const int32_t *list = s->pool + s->starts[j * s->groups_n + g];
            int64_t count = s->counts[j * s->groups_n + g];
            int64_t lo = lower_bound(list, count, s->sinks), hi = lower_bound(list, count, s->end);
            int64_t n = nlocal + hi - lo;
            span(s, part, j, mine, m, list, lo, hi, n * part / s->parts, n * (part + 1) / s->parts, pos, p, buf);
        }
    }
    free(pos);
    free(p);
    free(buf);
    return failed;
}

int focus_decode_step(int64_t rows, int64_t d, int64_t rep, const float *q, const int64_t *groups, float scale,
                      const void *k, const int64_t *k_at, int64_t k_step, const void *v, const int64_t *v_at,
                      int64_t v_step, int bf16, const int32_t *pool, const int64_t *starts, const int64_t *counts,
                      int64_t groups_n, int64_t sinks, int64_t end, int64_t lk, int parts, float *out) {
    if (rows < 1 || d < 1 || rep < 1 || rep > MAX_REP || rows % rep || parts < 1 || lk < 1) return 2;
    for (int64_t r = 0; r < rows; r++)
        if (groups[r] < 0 || groups[r] >= groups_n) return 2;
    float *stats = malloc(sizeof(float) * parts * rows * (d + 2));
    if (!stats) return 1;
    step_t s = {rows, d, rep, q, groups, scale, k, v, k_at, v_at, k_step, v_step, bf16, pool, starts, counts,
                groups_n, sinks, end, lk, parts, stats, stats + parts * rows, stats + 2 * parts * rows};
    int failed = 0;
#pragma omp parallel for num_threads(parts) schedule(static, 1) reduction(| : failed)
    for (int part = 0; part < parts; part++) failed |= run_part(&s, part);
    for (int64_t r = 0; r < rows && !failed; r++) { /* merge the parts: out = sum_i e^(m_i - M) acc_i / sum_i ... */
        float mx = -INFINITY, sum = 0.f, *o = out + r * d;
        for (int i = 0; i < parts; i++) mx = s.stat_max[i * rows + r] > mx ? s.stat_max[i * rows + r] : mx;
        memset(o, 0, sizeof(float) * d);
        for (int i = 0; i < parts; i++) {
            float m_i = s.stat_max[i * rows + r], w = m_i == -INFINITY ? 0.f : expf(m_i - mx);
            const float *a = s.acc + (i * rows + r) * d;
            sum += w * s.stat_sum[i * rows + r];
            for (int64_t x = 0; x < d; x++) o[x] += w * a[x];
        }
        for (int64_t x = 0; x < d; x++) o[x] /= sum;
    }
    free(stats);
    return failed;
}
